"""The embedding passes on every dialect: per-feature lookups, partitioned tables, bags, indicator columns."""

import re
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto

import ctropt
import ctropt.exporters.zoo
from ctropt.exporters import Export
from ctropt.graph import load
from ctropt.passes.embedding import parallel
from ctropt.runtime import generate_inputs
from ctropt.runtime.inputs import stored_input_facts
from helpers import F, I64, assert_same_outputs, check_pass, init, make_model, node, ops, run_pass, vi

RNG = np.random.default_rng(0)
ROWS = (5, 9, 7)
TABLES = [init(f"t{i}", RNG.standard_normal((rows, 4)).astype(np.float32)) for i, rows in enumerate(ROWS)]
DATA = Path(__file__).parent / "data" / "thirdparty"
# fuse-parallel-embeddings' ids into its joined table: each column's id checked against its own field's rows
FIELD_ROWS = ["Shape", "Expand", "Less", "Add", "Where", "GreaterOrEqual", "Less", "And", "Expand", "Add", "Where"]

# ----------------------------------------------------------------------------------------- parallel lookups


def boundary_ids(rows, shape, dtype=np.int64):
    """Ids at both ends of a table (0 and rows-1) and negative ones (-1, -rows: Gather reads them from the end)."""
    ids = np.resize(np.array([0, rows - 1, -1, -rows, 2]), int(np.prod(shape)))
    return ids.reshape(shape).astype(dtype)


def feeds_with_boundaries(ids_shape, dtype=np.int64, rows=ROWS):
    return {f"id{i}": boundary_ids(n, ids_shape, dtype) for i, n in enumerate(rows)}


def stacked_model(dtype=TensorProto.INT64):
    """Keras/tf2onnx and torch form: ids [B, 1] → Gather → [B, 1, D], Concat on axis 1."""
    nodes = [node("Gather", [f"t{i}", f"id{i}"], [f"e{i}"]) for i in range(3)]
    nodes += [node("Concat", ["e0", "e1", "e2"], ["emb"], axis=1), node("Flatten", ["emb"], ["y"], axis=1)]
    inputs = [vi(f"id{i}", dtype, ["B", 1]) for i in range(3)]
    return make_model(nodes, inputs, [vi("y", F, ["B", 12])], TABLES)


def test_stacked_lookups_become_one_gather_on_one_copy_of_the_tables():
    """Each table stored once; an id is read as its field's own Gather reads it (negative: from its field's end)."""
    out, ctx = check_pass(stacked_model(), "fuse-parallel-embeddings", ["Concat", *FIELD_ROWS, "Gather", "Flatten"],
                          feeds=feeds_with_boundaries((5, 1)))
    assert ctx.rewrites == 1 and ctx.matches == 3
    table = next(t for t in out.graph.initializer if len(t.dims) == 2 and t.dims[0] > 9)
    assert list(table.dims) == [sum(ROWS), 4]


@pytest.mark.parametrize("field,bad", [(0, 5), (0, -6), (1, 9), (2, 7), (2, -8), (1, 1 << 40)])
def test_an_id_outside_its_own_field_raises_as_its_gather_does(field, bad):
    """Where a neighbouring field's rows would lie (id = rows) or the joined table's (a large id), the fused
    lookup raises as the field's own Gather does, never reading another field's row."""
    out, _ = run_pass(stacked_model(), "fuse-parallel-embeddings")
    feeds = feeds_with_boundaries((5, 1))
    feeds[f"id{field}"][3, 0] = bad
    for model in (stacked_model(), out):
        with pytest.raises(Exception, match="out of data bounds|out of bounds"):
            ctropt.runtime.run_model(model, feeds)


@pytest.mark.parametrize("target,options", [("ort", {}), ("ort", {"ort_kernels": "off"}), ("openvino", {})])
def test_an_optimized_model_raises_on_an_id_outside_its_field(target, options):
    """The whole pipeline (ctropt's GatherRows/GatherFields with per-field sizes, or the standard ops): an id one past
    its field, or below its negative range, raises; one inside (negative too) answers as the raw export does."""
    model = stacked_model()
    out = ctropt.optimize(model, speed=False, target=target, options=options).model
    kernels = [n for n in out.graph.node if n.domain == "ai.ctropt.kernels"]
    assert bool(kernels) == (target == "ort" and not options)
    assert all(any(a.name == "sizes" for a in n.attribute) for n in kernels if n.op_type.startswith("Gather"))
    assert_same_outputs(model, out, feeds_with_boundaries((5, 1)))
    for field, bad in [(0, 5), (1, -10), (2, 7), (1, 1 << 40)]:
        feeds = feeds_with_boundaries((5, 1))
        feeds[f"id{field}"][1, 0] = bad
        with pytest.raises(Exception, match="out of data bounds|out of bounds"):
            ctropt.runtime.run_model(out, feeds)


def test_int32_ids_need_no_casts():
    check_pass(stacked_model(TensorProto.INT32), "fuse-parallel-embeddings", ["Concat", *FIELD_ROWS, "Gather", "Flatten"],
               feeds=feeds_with_boundaries((5, 1), np.int32))


def test_unsqueezed_lookups_and_a_shared_table():
    """tf1 form: ids [B] → Gather → Unsqueeze(1) → Concat(1); the item table is read by two features. [B] ids are
    stacked by one Concat + Transpose."""
    nodes = [node("Gather", ["t0", "id0"], ["e0"]), node("Gather", ["t1", "id1"], ["e1"]),
             node("Gather", ["t1", "id2"], ["e2"])]
    nodes += [node("Unsqueeze", [f"e{i}", "ax1"], [f"u{i}"]) for i in range(3)]
    nodes += [node("Concat", ["u0", "u1", "u2"], ["y"], axis=1)]
    model = make_model(nodes, [vi(f"id{i}", I64, ["B"]) for i in range(3)], [vi("y", F, ["B", 3, 4])],
                       TABLES[:2] + [init("ax1", np.array([1]))])
    feeds = feeds_with_boundaries((5,), rows=(5, 9, 9))
    out, _ = check_pass(model, "fuse-parallel-embeddings", ["Concat", "Reshape", "Transpose", *FIELD_ROWS, "Gather"],
                        feeds=feeds)
    table = next(t for t in out.graph.initializer if len(t.dims) == 2 and t.dims[0] > 9)
    assert list(table.dims) == [5 + 9, 4]  # the shared table is stored once


def din_shared_tables_model():
    """DIN/DIEN (DeepCTR, tf2onnx): the history's item and category lookups ([B, T]) are concatenated, the target's
    ([B]) are read by other ops, from the same two tables."""
    nodes = [node("Gather", ["t0", "hist0"], ["h0"]), node("Gather", ["t1", "hist1"], ["h1"]),
             node("Concat", ["h0", "h1"], ["y"], axis=-1),
             node("Gather", ["t0", "id0"], ["q0"]), node("Gather", ["t1", "id1"], ["q1"]), node("Add", ["q0", "q1"], ["z"])]
    inputs = [vi("hist0", I64, ["B", 3]), vi("hist1", I64, ["B", 3]), vi("id0", I64, ["B"]), vi("id1", I64, ["B"])]
    return make_model(nodes, inputs, [vi("y", F, ["B", 3, 8]), vi("z", F, ["B", 4])], TABLES[:2])


def din_feeds():
    return {"hist0": boundary_ids(5, (4, 3)), "hist1": boundary_ids(9, (4, 3)), "id0": boundary_ids(5, (4,)),
            "id1": boundary_ids(9, (4,))}


def test_a_table_also_read_outside_the_fused_lookup_is_stored_once():
    """The target's lookups read the joined table at their own field's rows (checked as their Gathers were):
    the item and category tables are not stored twice."""
    expected = ["Unsqueeze", "Unsqueeze", "Concat", "Reshape", "Reshape", "Add"] + (FIELD_ROWS + ["Gather"]) * 3
    out, _ = check_pass(din_shared_tables_model(), "fuse-parallel-embeddings", expected, feeds=din_feeds())
    tables = [list(t.dims) for t in out.graph.initializer if len(t.dims) == 2]
    assert tables == [[5 + 9, 4]]
    assert ops(out).count("Gather") == 3
    for name, bad in [("id0", 5), ("id1", -10), ("id0", 1 << 40)]:
        feeds = din_feeds()
        feeds[name][2] = bad
        with pytest.raises(Exception, match="out of data bounds|out of bounds"):
            ctropt.runtime.run_model(out, feeds)


@pytest.mark.parametrize("target,options", [("ort", {}), ("ort", {"ort_kernels": "off"}), ("openvino", {})])
def test_optimized_din_stores_each_table_once(target, options):
    model = din_shared_tables_model()
    out = ctropt.optimize(model, speed=False, target=target, options=options).model
    big = [list(t.dims) for t in out.graph.initializer if len(t.dims) == 2 and t.dims[0] >= 5]
    assert big == [[14, 4]]
    assert_same_outputs(model, out, din_feeds())
    feeds = din_feeds()
    feeds["id1"][0] = 9
    with pytest.raises(Exception, match="out of data bounds|out of bounds"):
        ctropt.runtime.run_model(out, feeds)


def test_flat_lookups_joined_on_the_last_axis_with_dense_features_around():
    """torch form: ids [B] → [B, D] pieces, Concat(-1) with dense features: the run of lookups is one Reshape."""
    nodes = [node("Gather", [f"t{i}", f"id{i}"], [f"e{i}"]) for i in range(3)]
    nodes += [node("Concat", ["dense", "e0", "e1", "e2", "dense"], ["y"], axis=-1)]
    model = make_model(nodes, [vi(f"id{i}", I64, ["B"]) for i in range(3)] + [vi("dense", F, ["B", 3])],
                       [vi("y", F, ["B", 18])], TABLES)
    feeds = {**feeds_with_boundaries((5,)), "dense": RNG.standard_normal((5, 3)).astype(np.float32)}
    check_pass(model, "fuse-parallel-embeddings",
               ["Concat", "Reshape", "Transpose", *FIELD_ROWS, "Gather", "Reshape", "Concat"], feeds=feeds)


def test_paddle_lookups_reshaped_to_rows_then_joined():
    """paddle2onnx: ids [B, 1] → Gather [B, 1, D] → Reshape [B, D] → Concat(1) with dense features."""
    nodes = []
    for i in range(3):
        nodes += [node("Gather", [f"t{i}", f"id{i}"], [f"e{i}"]), node("Reshape", [f"e{i}", "rows"], [f"r{i}"])]
    nodes += [node("Concat", ["r0", "r1", "r2", "dense"], ["y"], axis=1)]
    model = make_model(nodes, [vi(f"id{i}", I64, ["B", 1]) for i in range(3)] + [vi("dense", F, ["B", 3])],
                       [vi("y", F, ["B", 15])], TABLES + [init("rows", np.array([-1, 4]))])
    model, _ = run_pass(model, "infer-shapes")
    feeds = {**feeds_with_boundaries((5, 1)), "dense": RNG.standard_normal((5, 3)).astype(np.float32)}
    out, _ = check_pass(model, "fuse-parallel-embeddings",
                        ["Concat", *FIELD_ROWS, "Gather", "Reshape", "Concat"], feeds=feeds)
    assert ops(out).count("Gather") == 1


def test_wide_part_summed_through_tf_reshapes():
    """TF estimator wide part: Gather on [rows, 1] tables, Reshape to Concat(Shape(ids), [1]) (the shape it has),
    AddN: one Gather and a ReduceSum over the fused columns."""
    wide = [init(f"w{i}", RNG.standard_normal((n, 1)).astype(np.float32)) for i, n in enumerate(ROWS)]
    nodes = []
    for i in range(3):
        nodes += [node("Gather", [f"w{i}", f"id{i}"], [f"g{i}"]), node("Shape", [f"id{i}"], [f"s{i}"]),
                  node("Concat", [f"s{i}", "one"], [f"shape{i}"], axis=0),
                  node("Reshape", [f"g{i}", f"shape{i}"], [f"r{i}"])]
    nodes += [node("Sum", ["r0", "r1", "r2"], ["y"])]
    model = make_model(nodes, [vi(f"id{i}", I64, ["B"]) for i in range(3)], [vi("y", F, ["B", 1])],
                       wide + [init("one", np.array([1]))])
    out, _ = run_pass(model, "infer-shapes")
    check_pass(out, "fuse-parallel-embeddings", ["Concat", "Reshape", "Transpose", *FIELD_ROWS, "Gather", "ReduceSum"],
               feeds=feeds_with_boundaries((5,)))


def history_model(target: bool, batch_names=("B", "B")):
    """DIN: history items and categories [B, T] joined on the last axis; with `target`, the candidate's item and
    category [B, 1] (same tables) joined the same way. `batch_names`: the ids' batch dims (paddle2onnx names every
    input's apart)."""
    nodes = [node("Gather", ["t0", "id0"], ["h0"]), node("Gather", ["t1", "id1"], ["h1"]),
             node("Concat", ["h0", "h1"], ["hist"], axis=-1), node("ReduceSum", ["hist", "ax1"], ["y"], keepdims=0)]
    inputs = [vi("id0", I64, [batch_names[0], 3]), vi("id1", I64, [batch_names[1], 3])]
    outputs = [vi("y", F, ["B", 8])]
    if target:
        nodes += [node("Gather", ["t0", "q0"], ["e0"]), node("Gather", ["t1", "q1"], ["e1"]),
                  node("Concat", ["e0", "e1"], ["q"], axis=-1)]
        inputs += [vi("q0", I64, ["B", 1]), vi("q1", I64, ["B", 1])]
        outputs += [vi("q", F, ["B", 1, 8])]
    return make_model(nodes, inputs, outputs, TABLES[:2] + [init("ax1", np.array([1]))])


@pytest.mark.parametrize("batch_names", [("B", "B"), ("DynamicDimension.0", "DynamicDimension.1")])
def test_history_lookups_joined_on_the_last_axis_interleave(batch_names):
    feeds = feeds_with_boundaries((4, 3), rows=ROWS[:2])
    out, _ = check_pass(history_model(False, batch_names), "fuse-parallel-embeddings",
                        ["Unsqueeze", "Unsqueeze", "Concat", "Reshape", *FIELD_ROWS, "Gather", "Reshape", "ReduceSum"],
                        feeds=feeds)


def test_lookups_the_consumers_would_read_in_slices_stay():
    """Target and history in one fused lookup would be cut into slices again (measured slower): left alone."""
    model = history_model(True)
    out, ctx = run_pass(model, "fuse-parallel-embeddings")
    assert ctx.rewrites == 0 and sorted(ops(out)) == sorted(ops(model)) and ctx.matches == 4
    assert any("stay separate" in n for n in ctx.notes)


def test_lookups_used_elsewhere_of_other_widths_or_batches_are_left_alone():
    wide = init("wide", RNG.standard_normal((6, 8)).astype(np.float32))
    nodes = [node("Gather", ["t0", "id0"], ["e0"]), node("Gather", ["wide", "id1"], ["e1"]),
             node("Gather", ["t1", "id2"], ["e2"]), node("Concat", ["e0", "e1", "e2"], ["y"], axis=-1),
             node("Neg", ["e2"], ["z"]), node("Gather", ["t2", "id3"], ["e3"]),
             node("Concat", ["e0", "e3"], ["v"], axis=0)]
    inputs = [vi(f"id{i}", I64, ["B"]) for i in range(3)] + [vi("id3", I64, ["N"])]  # N: not the batch
    model = make_model(nodes, inputs, [vi("y", F, ["B", 16]), vi("z", F, ["B", 4]), vi("v", F, [None, 4])],
                       TABLES + [wide])
    out, ctx = run_pass(model, "fuse-parallel-embeddings")
    assert ctx.rewrites == 0 and sorted(ops(out)) == sorted(ops(model))


def test_inputs_generated_for_the_fused_model_are_the_raw_models():
    """The fused graph hides each id's table; the optimized model keeps the raw model's facts in its metadata."""
    model = load(DATA / "deepctr_torch_DeepFM_dynamo.onnx")
    fused = ctropt.optimize(model, speed=False).model
    assert any(n.op_type in ("Gather", "GatherRows", "GatherFields") and "fuse" in n.name for n in fused.graph.node)
    for batch in (1, 256):
        raw, opt = generate_inputs(model, batch=batch), generate_inputs(fused, batch=batch)
        assert all(np.array_equal(raw[k], opt[k]) for k in raw)
        assert_same_outputs(model, fused, opt)
    again = ctropt.optimize(fused, speed=False).model  # optimizing an optimized model keeps the raw facts
    assert stored_input_facts(again) == stored_input_facts(fused) != {}


@pytest.mark.parametrize("name", ["deepctr_WDL_tf2onnx", "deepctr_DeepFM_tf2onnx", "deepctr_DCN_tf2onnx",
                                  "deepctr_MMOE_tf2onnx", "deepctr_torch_WDL_legacy", "deepctr_torch_WDL_dynamo",
                                  "deepctr_torch_DeepFM_dynamo", "deepctr_torch_DeepFM_legacy",
                                  "paddlerec_WideDeep_paddle2onnx"])
def test_third_party_exports_keep_one_lookup_per_table_width(name):
    model = load(DATA / f"{name}.onnx")
    widths = {t.dims[1] for t in model.graph.initializer if len(t.dims) == 2 and
              any(n.op_type == "Gather" and n.input[0] == t.name for n in model.graph.node)}
    result = ctropt.optimize(model, speed=False)
    rec = next(r for r in result.records if r.name == "fuse-parallel-embeddings")
    assert rec.status == "applied", (rec.status, rec.message)
    tables = {t.name for t in result.model.graph.initializer if len(t.dims) == 2 and t.dims[0] > 1}
    lookups = [n for n in result.model.graph.node if n.op_type in ("Gather", "GatherRows", "GatherFields") and n.input[0] in tables]
    assert len(lookups) == len(widths), [n.name for n in lookups]
    with np.load(DATA / f"{name}.npz") as data:
        assert_same_outputs(model, result.model, {k: data[k] for k in data.files})


# ----------------------------------------------------------------------------------------- embedding bags

TORCHREC = DATA / "torchrec_dlrm_dynamo.onnx"


def bag_feeds(offsets, n, rows=20, seed=0):
    ids = np.random.default_rng(seed).integers(0, rows, size=n)
    if n >= 2:
        ids[[0, -1]] = [0, rows - 1]  # both ends of the table
    return {"ids": ids.astype(np.int64), "offsets": np.array(offsets, dtype=np.int64)}


@pytest.fixture(scope="module")
def torch_bag_models(tmp_path_factory):
    """nn.EmbeddingBag (sum and mean) through the dynamo exporter: torch's per-bag Loop lowering."""
    torch = pytest.importorskip("torch")
    models = {}
    for mode in ("sum", "mean"):
        class Bags(torch.nn.Module):
            def __init__(self):
                super().__init__()
                torch.manual_seed(0)
                self.bag = torch.nn.EmbeddingBag(20, 4, mode=mode)

            def forward(self, ids, offsets):
                return self.bag(ids, offsets)

        module = Bags().eval()
        example = tuple(torch.from_numpy(v) for v in bag_feeds([0, 2, 2, 5], 7).values())
        dims = ({0: torch.export.Dim("n", min=2)}, {0: torch.export.Dim("bags", min=2)})
        program = torch.onnx.export(module, example, dynamo=True, input_names=["ids", "offsets"],
                                    output_names=["pooled"], dynamic_shapes=dims, opset_version=18, verbose=False)

        def run(feeds, module=module):
            with torch.no_grad():
                return {"pooled": module(*(torch.from_numpy(feeds[k]) for k in ("ids", "offsets"))).numpy()}

        models[mode] = Export(program.model_proto, run, "dynamo")
    return models


def test_torch_embedding_bag_loop_becomes_one_scatter(torch_bag_models):
    exp = torch_bag_models["sum"]
    model = exp.model
    assert "Loop" in [n.op_type for n in model.graph.node]
    once, ctx = run_pass(model, "vectorize-embedding-bags")
    assert ctx.rewrites == 1 and "Loop" not in ops(once) and "ScatterND" in ops(once)
    cases = [([0, 2, 2, 5], 7),  # an empty bag in the middle
             ([0, 0, 0], 4),  # only the last bag holds ids
             ([0, 1, 2, 3, 4], 5),  # one id per bag
             ([0, 3, 7], 7),  # an empty last bag
             ([0], 1)]  # batch 1
    for offsets, n in cases:
        feeds = bag_feeds(offsets, n)
        expected = exp.run_framework(feeds)["pooled"]
        got = ctropt.runtime.run_model(once, feeds)["pooled"]
        np.testing.assert_allclose(got, expected, atol=1e-6)
    twice, ctx2 = run_pass(once, "vectorize-embedding-bags")
    assert ctx2.rewrites == 0


def test_mean_bags_are_not_taken_for_sums(torch_bag_models):
    once, ctx = run_pass(torch_bag_models["mean"].model, "vectorize-embedding-bags")
    assert ctx.rewrites == 0


def test_other_loops_are_left_alone():
    model = load(Path(__file__).parent / "data" / "keras_gru_tf2onnx.onnx")
    assert run_pass(model, "vectorize-embedding-bags")[1].rewrites == 0


def test_torchrec_dlrm_loops_vectorize_and_openvino_loads_it():
    """torchrec's EmbeddingBagCollection through the dynamo exporter: a per-sample Loop per table."""
    model = load(TORCHREC)
    result = ctropt.optimize(model, speed=False)  # generated jagged inputs: lengths with empty bags, values = sum(lengths)
    rec = next(r for r in result.records if r.name == "vectorize-embedding-bags")
    assert rec.status == "applied" and rec.rewrites == 6
    assert ops(result.model).count("Loop") == 0
    tables = {t.name for t in result.model.graph.initializer if len(t.dims) == 2 and t.dims[0] > 1}
    assert len([n for n in result.model.graph.node if n.op_type in ("Gather", "GatherRows", "GatherFields") and n.input[0] in tables]) == 1
    assert ops(result.model).count("ScatterND") == 1  # one scatter over the bags of all 6 tables
    with np.load(TORCHREC.with_suffix(".npz")) as data, np.load(TORCHREC.with_suffix(".ref.npz")) as ref:
        feeds = {k: data[k] for k in data.files}
        np.testing.assert_allclose(ctropt.runtime.run_model(result.model, feeds)["logits"], ref["logits"], atol=1e-5)
        for_openvino = ctropt.optimize(model, target="openvino", speed=False).model
        got = ctropt.runtime.Runner(for_openvino, "openvino-cpu").run(feeds)["logits"]
        np.testing.assert_allclose(got, ref["logits"], atol=1e-5)


@pytest.fixture(scope="module")
def torch_two_bags(tmp_path_factory):
    """Two nn.EmbeddingBag of one width on their own ids and offsets (sum; weighted: per_sample_weights)."""
    torch = pytest.importorskip("torch")
    models = {}
    for kind in ("plain", "weighted", "shared"):
        class TwoBags(torch.nn.Module):
            def __init__(self, kind):
                super().__init__()
                torch.manual_seed(0)
                self.a, self.b = torch.nn.EmbeddingBag(20, 4, mode="sum"), torch.nn.EmbeddingBag(30, 4, mode="sum")
                if kind == "shared":  # one table read by both bags (ids of b stay under 20)
                    self.b = self.a
                self.weighted = kind == "weighted"

            def forward(self, ids_a, offsets_a, ids_b, offsets_b, w_a, w_b):
                if self.weighted:
                    return torch.cat([self.a(ids_a, offsets_a, w_a), self.b(ids_b, offsets_b, w_b)], dim=1)
                return torch.cat([self.a(ids_a, offsets_a), self.b(ids_b, offsets_b)], dim=1)

        module = TwoBags(kind).eval()
        names = ["ids_a", "offsets_a", "ids_b", "offsets_b", "w_a", "w_b"]
        example = tuple(torch.from_numpy(v) for v in two_bag_feeds([0, 2, 2, 5], 7, [0, 1, 4, 4], 6,
                                                                   rows_b=20 if kind == "shared" else 30).values())
        n, bags = torch.export.Dim("n", min=2), torch.export.Dim("bags", min=2)
        m = torch.export.Dim("m", min=2)
        dims = ({0: n}, {0: bags}, {0: m}, {0: bags}, {0: n}, {0: m})
        program = torch.onnx.export(module, example, dynamo=True, input_names=names, output_names=["pooled"],
                                    dynamic_shapes=dims, opset_version=18, verbose=False)

        def run(feeds, module=module):
            with torch.no_grad():
                return {"pooled": module(*(torch.from_numpy(feeds[k]) for k in names)).numpy()}

        models[kind] = Export(program.model_proto, run, "dynamo")
    return models


def two_bag_feeds(offsets_a, n, offsets_b, m, seed=0, rows_b=30):
    a, b = bag_feeds(offsets_a, n, 20, seed), bag_feeds(offsets_b, m, rows_b, seed + 1)
    w = np.random.default_rng(seed).uniform(0.5, 2, n + m).astype(np.float32)
    return {"ids_a": a["ids"], "offsets_a": a["offsets"], "ids_b": b["ids"], "offsets_b": b["offsets"],
            "w_a": w[:n], "w_b": w[n:]}


@pytest.mark.parametrize("kind", ["plain", "weighted", "shared"])
def test_bags_of_two_tables_become_one_lookup_and_one_scatter(torch_two_bags, kind):
    exp = torch_two_bags[kind]
    once, ctx = run_pass(exp.model, "vectorize-embedding-bags")
    assert ctx.rewrites == 2 and "Loop" not in ops(once)
    assert ops(once).count("ScatterND") == 1 and "one lookup and one scatter" in ctx.notes[0]
    assert ops(once).count("Mul") == int(kind == "weighted")
    tables = [t for t in once.graph.initializer if len(t.dims) == 2]
    assert [t.dims[0] for t in tables] == [20 if kind == "shared" else 50]  # each table once, a shared one too
    cases = [([0, 2, 2, 5], 7, [0, 1, 4, 4], 6),  # empty bags in the middle and at the end
             ([0, 0, 0], 4, [0, 3, 3], 5),  # only the last bag of a holds ids
             ([0, 1, 2, 3, 4], 5, [0, 1, 2, 3, 4], 5),  # one id per bag
             ([0], 1, [0], 1)]  # batch 1
    for offsets_a, n, offsets_b, m in cases:
        feeds = two_bag_feeds(offsets_a, n, offsets_b, m, rows_b=20 if kind == "shared" else 30)
        np.testing.assert_allclose(ctropt.runtime.run_model(once, feeds)["pooled"],
                                   exp.run_framework(feeds)["pooled"], atol=1e-5)
    assert run_pass(once, "vectorize-embedding-bags")[1].rewrites == 0


# Padded bags: [B, L] ids, -1 where a row has fewer ids, pooled by a segment sum.
BAG_TABLE = np.random.default_rng(3).normal(size=(9, 4)).astype(np.float32)
# the ids of a padded bag's Gather on a zero row and its table: padding (< 0) to the zero row, the others id + 1 (so
# an id from the table's rows on is past it, and the Gather raises as the export's does)
PADDED_IDS = ["Less", "Add", "Where"]


def segment_bag(i: int, combiner: str = "sum", valid: str = "GreaterOrEqual") -> list:
    """Bag i as ONNX exporters write a gather + segment sum: NonZero of the valid ids, GatherND, a Gather of the
    flat ids, ScatterND(add) by row (÷ ScatterND of ones for mean). `valid`: Greater makes 0 padding too;
    NotMinusOne keeps every id but -1 (embedding_lookup_sparse: -2 reads the table's end, below -rows raises)."""
    p = f"b{i}_"
    if valid == "NotMinusOne":
        nodes = [node("Equal", [f"ids{i}", "minus_one"], [p + "none"]), node("Not", [p + "none"], [p + "valid"])]
    else:
        nodes = [node(valid, [f"ids{i}", "zero"], [p + "valid"])]
    nodes += [node("NonZero", [p + "valid"], [p + "nz"]),
             node("Transpose", [p + "nz"], [p + "where"], perm=[1, 0]),
             node("GatherND", [f"ids{i}", p + "where"], [p + "flat"]),
             node("Slice", [p + "where", "s0", "s1", "s1"], [p + "rows"]),
             node("Gather", ["table", p + "flat"], [p + "vecs"]),
             node("Shape", [f"ids{i}"], [p + "shape"]), node("Slice", [p + "shape", "s0", "s1"], [p + "b"]),
             node("Concat", [p + "b", "width"], [p + "zshape"], axis=0),
             node("ConstantOfShape", [p + "zshape"], [p + "zeros"], value=init("v", np.zeros(1, np.float32))),
             node("ScatterND", [p + "zeros", p + "rows", p + "vecs"], [p + "sum" if combiner == "mean" else f"e{i}"],
                  reduction="add")]
    if combiner == "mean":
        nodes += [node("Shape", [p + "flat"], [p + "n"]),
                  node("ConstantOfShape", [p + "n"], [p + "ones"], value=init("v", np.ones(1, np.float32))),
                  node("ConstantOfShape", [p + "b"], [p + "zb"], value=init("v", np.zeros(1, np.float32))),
                  node("ScatterND", [p + "zb", p + "rows", p + "ones"], [p + "count"], reduction="add"),
                  node("Max", [p + "count", "one"], [p + "safe"]), node("Unsqueeze", [p + "safe", "s1"], [p + "col"]),
                  node("Div", [p + "sum", p + "col"], [f"e{i}"])]
    return nodes


def padded_bags_model(combiners=("sum", "mean"), lengths=(3, 5), valid="GreaterOrEqual"):
    """`valid`: one for every bag, or one per bag."""
    valid = [valid] * len(combiners) if isinstance(valid, str) else list(valid)
    nodes = [n for i, c in enumerate(combiners) for n in segment_bag(i, c, valid[i])]
    nodes.append(node("Concat", [f"e{i}" for i in range(len(combiners))], ["y"], axis=1))
    inits = [init("table", BAG_TABLE), init("zero", np.array(0)), init("s0", np.array([0])), init("s1", np.array([1])),
             init("width", np.array([4])), init("one", np.array(1, np.float32))]
    inits += [init("minus_one", np.array(-1))] if "NotMinusOne" in valid else []
    return make_model(nodes, [vi(f"ids{i}", I64, ["B", n]) for i, n in enumerate(lengths)],
                      [vi("y", F, ["B", 4 * len(combiners)])], inits)


def padded_feeds(lengths=(3, 5), batch=6, seed=0):
    rng = np.random.default_rng(seed)
    feeds = {}
    for i, n in enumerate(lengths):
        ids = np.where(rng.random((batch, n)) < 0.4, -1, rng.integers(0, 9, (batch, n)))
        ids[0], ids[1], ids[-1, :2] = -1, 8, [0, -1]  # an empty row, a full one at the table's end, id 0
        feeds[f"ids{i}"] = ids.astype(np.int64)
    return feeds


def test_padded_segment_sum_bags_become_one_gather_and_a_row_sum():
    model = padded_bags_model()
    out, ctx = check_pass(model, "vectorize-embedding-bags",
                          PADDED_IDS * 2 + ["Gather", "ReduceSum"] * 2 + ["Not", "Cast", "ReduceSum", "Max", "Div",
                                                                          "Concat"], feeds=padded_feeds())
    assert ctx.rewrites == 2
    for batch in (1, 3, 17):
        feeds = padded_feeds(batch=batch, seed=batch) if batch > 1 else {k: v[1:2] for k, v in padded_feeds().items()}
        assert_same_outputs(model, out, feeds)
    assert_same_outputs(model, out, {k: np.full_like(v, -1) for k, v in padded_feeds().items()})  # no id at all
    fused, ctx = check_pass(out, "fuse-parallel-embeddings", PADDED_IDS * 2 + [
        "Concat", *FIELD_ROWS, "Gather", "MatMul", "Gather", "Gather", "Not", "Cast", "ReduceSum", "Max", "Div",
        "Concat"], feeds=padded_feeds())
    assert_same_outputs(model, fused, padded_feeds(batch=9, seed=4))


def test_a_bag_padded_otherwise_is_left_with_a_note():
    """0 is padding here too (Greater): the probe's id 0 shows it is not the -1-padded bag the rewrite assumes."""
    out, ctx = run_pass(padded_bags_model(("sum",), (3,), valid="Greater"), "vectorize-embedding-bags")
    assert ctx.rewrites == 0 and "no tensor downstream pools the bag" in " ".join(ctx.notes)


def test_a_lookup_summed_over_its_ids_is_no_bag():
    nodes = [node("Gather", ["table", "ids0"], ["g"]), node("ReduceSum", ["g", "s1"], ["y"], keepdims=0)]
    model = make_model(nodes, [vi("ids0", I64, ["B", 3])], [vi("y", F, ["B", 4])],
                       [init("table", BAG_TABLE), init("s1", np.array([1]))])
    out, ctx = run_pass(model, "vectorize-embedding-bags")
    assert ctx.rewrites == 0 and ops(out) == ops(model)


def with_id(feeds, name, value, at=0):
    """The feeds with input `name`'s element `at` (flat index) set to `value`."""
    x = feeds[name].copy()
    x.flat[at] = value
    return {**feeds, name: x}


def outcomes(model, cases: dict) -> dict:
    """Each case's outputs, None where the model raises."""
    runner = ctropt.runtime.Runner(model)
    found = {}
    for label, feeds in cases.items():
        try:
            found[label] = runner.run(feeds)
        except Exception:  # an id outside its table: what the case asks about
            found[label] = None
    return found


def assert_same_answers(raw, opt, cases: dict, atol=1e-5) -> set:
    """opt raises on the cases where raw raises and answers the others as raw does (issue 47); returns the cases
    that raised."""
    want, got = outcomes(raw, cases), outcomes(opt, cases)
    wrong = {k: "raw raises, optimized answers" if want[k] is None else "raw answers, optimized raises"
             for k in cases if (want[k] is None) != (got[k] is None)}
    assert not wrong, wrong
    for k in cases:
        for name in want[k] or {}:
            np.testing.assert_allclose(got[k][name], want[k][name], atol=atol, rtol=1e-4, err_msg=str(k))
    return {k for k in cases if want[k] is None}


def first_raising_id(model, feeds, name, at=0, top=1 << 24) -> int:
    """V: the smallest id at which `model` raises when input `name`'s element `at` holds it (ids from 0 up
    answer until then)."""
    runner, lo, hi = ctropt.runtime.Runner(model), 0, top
    while hi - lo > 1:
        mid = (lo + hi) // 2
        try:
            runner.run(with_id(feeds, name, mid, at))
            lo = mid
        except Exception:  # past the table
            hi = mid
    return hi


def id_cases(feeds, name, values, at=0) -> dict:
    return {(name, int(v)): with_id(feeds, name, v, at) for v in values}


@pytest.mark.parametrize("valid", ["GreaterOrEqual", "NotMinusOne"])
def test_padded_bags_answer_ids_outside_the_table_as_the_export_does(valid):
    """A segment-sum bag over ids >= 0 (safe_embedding_lookup_sparse, gather + unsorted_segment_sum) drops every
    negative id; embedding_lookup_sparse drops only -1: -2 .. -rows read the table's end and below raises. Either
    way an id from the table's rows on raises: the rewrite raises there too (id rows read its zero row) and reads
    -2 from the end where the export does (it was padding)."""
    model = padded_bags_model(valid=valid)
    out, ctx = run_pass(model, "vectorize-embedding-bags")
    assert ctx.rewrites == 2
    rows, feeds = BAG_TABLE.shape[0], padded_feeds()
    top, bottom = int(np.iinfo(np.int64).max), int(np.iinfo(np.int64).min)
    values = [0, rows - 1, -1, -2, -rows, rows, rows + 1, rows + 1000, -rows - 1, -(1 << 31), 1 << 40, top, bottom]
    for bag in ("ids0", "ids1"):
        raised = assert_same_answers(model, out, id_cases(feeds, bag, values, at=4))
        beyond = {-rows - 1, -(1 << 31), bottom} if valid == "NotMinusOne" else set()
        assert {v for _, v in raised} == {rows, rows + 1, rows + 1000, 1 << 40, top} | beyond


@pytest.mark.parametrize("target,options", [("ort", {}), ("ort", {"ort_kernels": "off"}), ("openvino", {})])
def test_an_optimized_model_with_padded_bags_raises_where_the_export_raises(target, options):
    """The whole pipeline (bags vectorized, then fused into one lookup checked per field, ctropt's GatherRows or
    standard ops) on a bag of each kind."""
    model = padded_bags_model(valid=("GreaterOrEqual", "NotMinusOne"))
    out = ctropt.optimize(model, speed=False, target=target, options=options).model
    rows, feeds = BAG_TABLE.shape[0], padded_feeds()
    cases = {**id_cases(feeds, "ids0", [0, -2, -rows - 1, rows, 1 << 40], at=4),
             **id_cases(feeds, "ids1", [0, -2, -rows, -rows - 1, rows, 1 << 40], at=4)}
    assert assert_same_answers(model, out, cases) == {("ids0", rows), ("ids0", 1 << 40), ("ids1", -rows - 1),
                                                      ("ids1", rows), ("ids1", 1 << 40)}


def test_zoo_dlrm_tf2onnx_bags_raise_where_the_export_raises():
    """tf2onnx's embedding_lookup_sparse (bag2: only -1 is padding) and gather + unsorted_segment_sum (bag6: every
    negative id is): id V, and -2^31 in bag2, raise after ctropt as in the export (they read a zero row)."""
    path = ctropt.exporters.zoo.shipped_path("dlrm")
    model = load(path)
    out = ctropt.optimize(model, speed=False).model
    feeds = dict(np.load(path.with_suffix(".npz")))
    cases = {}
    for bag in ("bag2", "bag6"):
        v = first_raising_id(model, feeds, bag)
        cases.update(id_cases(feeds, bag, [0, v - 1, -1, -2, -v, v, v + 1000, -v - 1, -(1 << 31), 1 << 40]))
    raised = assert_same_answers(model, out, cases)
    assert ("bag6", first_raising_id(model, feeds, "bag6")) in raised and ("bag2", -(1 << 31)) in raised


def test_zoo_dlrm_tf2onnx_bags_vectorize_and_fuse():
    """tf2onnx's lowerings of embedding_lookup_sparse, safe_embedding_lookup_sparse (sum, mean) and gather +
    unsorted_segment_sum (sum, mean): 8 bags → one Gather on the concatenated tables."""
    path = ctropt.exporters.zoo.shipped_path("dlrm")
    model = load(path)
    result = ctropt.optimize(model, speed=False)
    rec = {r.name: r for r in result.records}
    assert rec["vectorize-embedding-bags"].rewrites == 8 and rec["fuse-parallel-embeddings"].status == "applied"
    tables = [n for n in result.model.graph.node if n.op_type in ("Gather", "GatherRows", "GatherFields") and "fused_lookup" in n.name]
    assert len(tables) == 1 and not {"NonZero", "Unique", "GatherND", "ScatterND"} & set(ops(result.model))
    assert ops(result.model).count("Div") == 2  # the two mean bags
    with np.load(path.with_suffix(".npz")) as data, np.load(path.with_suffix(".ref.npz")) as ref:
        feeds = {k: data[k] for k in data.files}
        assert (feeds["bag1"] < 0).any() and (feeds["bag1"] < 0).all(axis=1).any()  # padding, and an empty bag
        np.testing.assert_allclose(ctropt.runtime.run_model(result.model, feeds)["prob"], ref["prob"], atol=1e-5)


@pytest.mark.parametrize("name, taken_by", [("dlrm", "vectorize-embedding-bags"), ("deepfm", "fuse-parallel-embeddings")])
def test_inspect_names_the_pass_that_takes_each_table(name, taken_by):
    from ctropt.graph import to_graph
    from ctropt.inspect import embedding_tables

    tables = embedding_tables(to_graph(load(ctropt.exporters.zoo.shipped_path(name))))
    assert tables and {t.taken_by for t in tables} == {taken_by}


# ----------------------------------------------------------------------------------------- partitioned tables



def partitioned_lookup(strategy: str, rows: int = 10, shards: int = 3):
    """A TF1 embedding_lookup over a table split in `shards` (uneven when rows % shards), through tf2onnx."""
    tf = pytest.importorskip("tensorflow")
    from ctropt.exporters.tf import from_graph_def

    graph = tf.Graph()
    with graph.as_default():
        ids = tf.compat.v1.placeholder(tf.int64, [None], name="ids")
        table = tf.compat.v1.get_variable("table", [rows, 3], partitioner=tf.compat.v1.fixed_size_partitioner(shards),
                                          initializer=tf.compat.v1.random_normal_initializer(seed=1))
        tf.identity(tf.compat.v1.nn.embedding_lookup(table, ids, partition_strategy=strategy), name="emb")
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            frozen = tf.compat.v1.graph_util.convert_variables_to_constants(sess, graph.as_graph_def(), ["emb"])
    return from_graph_def(frozen, ["ids"], ["emb"])


@pytest.mark.parametrize("strategy", ["mod", "div"])
def test_partitioned_lookup_becomes_one_gather(strategy):
    exp = partitioned_lookup(strategy)
    once, ctx = run_pass(exp.model, "merge-partitioned-embeddings")
    assert ctx.rewrites == 1 and not {"Compress", "ScatterElements"} & set(ops(once))  # TF's reshape glue stays
    for ids in (np.array([0, 9, 4, 4, 3]), np.array([9]), np.arange(10)[::-1]):  # table ends, repeats, batch 1
        np.testing.assert_allclose(ctropt.runtime.run_model(once, {"ids": ids})["emb"],
                                   exp.run_framework({"ids": ids})["emb"], atol=1e-6)
    assert run_pass(once, "merge-partitioned-embeddings")[1].rewrites == 0


@pytest.mark.parametrize("strategy, rows", [("mod", 10), ("mod", 9), ("div", 10), ("div", 9)])
def test_a_merged_lookup_answers_ids_outside_the_table_as_the_shards_did(strategy, rows):
    """The partitioned lookup (tf2onnx's lowering) raises on every id from its rows on, but not on every negative
    one: mod puts id -k·N in shard 0 (row -k from its end), div reads -1 .. -(rows of shard 0 - 1) from shard 0's
    end, other negative ids fall in no shard and the stitch raises. The merged Gather does the same on every id
    (it read every negative id from the table's end); the ids past ±2^31 where div's int32 shard wraps around
    are named in a note."""
    exp = partitioned_lookup(strategy, rows)
    once, ctx = run_pass(exp.model, "merge-partitioned-embeddings")
    assert ctx.rewrites == 1
    values = [*range(-2 * rows - 5, rows + 5), 1 << 31, 1 << 40, -(1 << 31), -(1 << 31) + 1]
    cases = {v: {"ids": np.array([3, v, 0, rows - 1])} for v in values}
    raised = assert_same_answers(exp.model, once, cases)
    assert set(range(rows, rows + 5)) <= raised and set(range(-2 * rows - 5, -2 * rows)) <= raised
    assert set(range(-rows, 0)) - raised and set(range(-rows, 0)) & raised  # a plain Gather answers all of these
    notes = [n for n in ctx.notes if "wraps around in int32" in n]  # div: -2^40's shard index wraps to shard 0
    odd = {int(x) for x in re.findall(r"-?\d+", notes[0].split("ids ", 1)[1].split(" are")[0])} if notes else set()
    assert (-(1 << 40) in odd) == (strategy == "div") and all(x <= -(1 << 40) for x in odd)


def test_zoo_wdl_merged_tables_answer_ids_outside_the_table_as_the_shards_did():
    """C9 reads a 4-shard table by div (the deep part: -1 .. -213 answered) and by mod (the linear part: every
    fourth negative id from -856 on answered): the model answers -4, raises on -1 and -856."""
    path = ctropt.exporters.zoo.shipped_path("wdl")
    model = load(path)
    once, ctx = run_pass(model, "merge-partitioned-embeddings")
    assert ctx.rewrites == 52 and not ctx.notes
    feeds = dict(np.load(path.with_suffix(".npz")))
    v = first_raising_id(model, feeds, "C9")
    rng = np.random.default_rng(0)
    values = {*range(-24, 0), *range(-v - 8, -v + 8), *range(-860, -848), *rng.integers(-2 * v, v + 5, 40).tolist(),
              0, v - 1, v, v + 1, 1 << 40, -(1 << 31), -856}
    raised = assert_same_answers(model, once, id_cases(feeds, "C9", sorted(values)))
    assert {("C9", -1), ("C9", -856), ("C9", v)} <= raised and ("C9", -4) not in raised


@pytest.mark.parametrize("target,options", [("ort", {}), ("ort", {"ort_kernels": "off"}), ("openvino", {})])
def test_zoo_wdl_optimized_answers_ids_outside_the_table_as_the_export(target, options):
    """The whole pipeline: fuse-parallel-embeddings joins the merged lookups on their ids and reads each column's
    negative ids by its lookup's rule, once for all the columns (one Mod for the 26 mod-partitioned tables)."""
    path = ctropt.exporters.zoo.shipped_path("wdl")
    model = load(path)
    out = ctropt.optimize(model, speed=False, target=target, options=options).model
    feeds = dict(np.load(path.with_suffix(".npz")))
    cases = {}
    for name in ("C1", "C9", "C26"):
        v = first_raising_id(model, feeds, name)
        cases.update(id_cases(feeds, name, [0, v - 1, v, v + 1000, -1, -2, -4, -12, -v, -v - 1, -856, 1 << 40]))
    raised = assert_same_answers(model, out, cases)
    assert ("C9", -1) in raised and ("C9", -4) not in raised
    assert ops(out).count("Mod") == 1 and ops(out).count("Where") <= 8  # not 5 for each of the 52 tables


def test_zoo_wdl_partitioned_tables_merge():
    model = load(ctropt.exporters.zoo.shipped_path("wdl"))
    result = ctropt.optimize(model, passes=["merge-partitioned-embeddings"], speed=False)
    rec = result.records[0]
    assert rec.status == "applied" and rec.rewrites == 52 and "Compress" not in ops(result.model)
    with np.load(ctropt.exporters.zoo.shipped_path("wdl").with_suffix(".npz")) as data:
        assert_same_outputs(model, result.model, {k: data[k] for k in data.files})


def repeats_and_an_empty_row(feeds):
    """The sample batch with row 2's ids repeating row 1's, and no id in row 0 of the 1-D id columns (-1): so
    the distinct ids of a column are fewer than its rows."""
    out = dict(feeds)
    for k, x in feeds.items():
        if x.dtype.kind == "i":
            x = out[k] = x.copy()
            x[2] = x[1]
            if x.ndim == 1:
                x[0] = -1
    return out


@pytest.mark.parametrize("name, shards", [("WDL", 12), ("DIN", 5)])
def test_deeprec_sparse_lookups_over_shards_merge(name, shards):
    """DeepRec's feature columns: embedding_lookup_sparse over fixed_size_partitioner(3) tables ([B] ids, -1
    padded [B, T] histories). The shards look up the Unique ids of the SparseTensor, not the ids input: the merged
    Gather reads those, one row per distinct id (it read the input and was rolled back: {13, 8} rows for {7, 8})."""
    path = DATA / f"deeprec_{name}_tf2onnx.onnx"
    raw = load(path)
    once, ctx = run_pass(raw, "merge-partitioned-embeddings")
    assert ctx.matches == ctx.rewrites == shards and ops(once).count("Compress") < ops(raw).count("Compress")
    feeds = dict(np.load(path.with_suffix(".npz")))
    with np.load(path.with_suffix(".ref.npz")) as ref:
        got = ctropt.runtime.run_model(once, feeds)
        for k in ref.files:
            np.testing.assert_allclose(got[k].reshape(ref[k].shape), ref[k], atol=1e-5, rtol=1e-4)
    assert_same_outputs(raw, once, repeats_and_an_empty_row(feeds))
    assert_same_outputs(raw, once, {k: x[:1] for k, x in feeds.items()})  # one row
    assert run_pass(once, "merge-partitioned-embeddings")[1].rewrites == 0


def test_other_scatters_are_left_alone():
    model = load(ctropt.exporters.zoo.shipped_path("dlrm"))
    assert run_pass(model, "merge-partitioned-embeddings")[1].rewrites == 0


# ----------------------------------------------------------------------------------------- indicator columns


def indicator_model(values=(0.0, 1.0), keepdims=0, axes=(1,)):
    nodes = [node("OneHot", ["ids", "depth", "values"], ["hot"], axis=-1),
             node("ReduceSum", ["hot", "axes"], ["y"], keepdims=keepdims)]
    return make_model(nodes, [vi("ids", I64, ["B", 4])], [vi("y", F, None)],
                      [init("depth", np.array([6])), init("values", np.array(values, np.float32)),
                       init("axes", np.array(axes))])


def test_indicator_column_becomes_a_scatter_of_ones():
    ids = np.array([[0, 5, -1, -6],  # both ends, and negatives counted from the end (-1 is 5, -6 is 0)
                    [6, 9, -7, 2],  # out of range on either side: nowhere
                    [3, 3, 3, 1]])  # repeats count
    out, ctx = check_pass(indicator_model(), "rewrite-indicator-columns",
                          ["GreaterOrEqual", "Less", "And", "Mod", "Where", "Shape", "Slice", "Concat",
                           "ConstantOfShape", "Shape", "Expand", "Cast", "ScatterElements", "Slice"],
                          feeds={"ids": ids})
    got = ctropt.runtime.run_model(out, {"ids": ids})["y"]
    np.testing.assert_array_equal(got[0], [2, 0, 0, 0, 0, 2])
    np.testing.assert_array_equal(got[1], [0, 0, 1, 0, 0, 0])


@pytest.mark.parametrize("kw", [{"values": (1.0, 2.0)}, {"keepdims": 1}, {"axes": (0,)}])
def test_other_one_hot_sums_are_left_alone(kw):
    assert run_pass(indicator_model(**kw), "rewrite-indicator-columns")[1].rewrites == 0


def test_zoo_deepfm_indicator_column():
    model = load(ctropt.exporters.zoo.shipped_path("deepfm"))
    result = ctropt.optimize(model, speed=False)
    rec = next(r for r in result.records if r.name == "rewrite-indicator-columns")
    assert rec.status == "applied" and rec.rewrites == 1 and "OneHot" not in ops(result.model)


# ----------------------------------------------------------------------------------------- TF sparse columns

SPARSE_COLUMNS = Path(__file__).parent / "data" / "tf_sparse_columns.onnx"  # made by make_sparse_columns.py


def ops_behind(model, output: str) -> set[str]:
    """Op types of the main-graph nodes that `output` depends on."""
    made = {o: n for n in model.graph.node for o in n.output}
    seen, stack, found = set(), [output], set()
    while stack:
        t = stack.pop()
        if t in seen or t not in made:
            continue
        seen.add(t)
        found.add(made[t].op_type)
        stack.extend(made[t].input)
    return found


def hostile_column_feeds(feeds, histories=(), seed=0):
    """-1 and -2 anywhere, repeats, whole rows and a whole batch without ids, batch 1, other bag lengths. Each of
    `histories` keeps an id last in row 0: the exports' sequence length is the max over rows, and their attention
    masks expect it to be the history's width."""
    rng = np.random.default_rng(seed)
    empty = {k: np.full_like(v, -1) for k, v in feeds.items()}
    out = [{k: np.where(rng.random(v.shape) < 0.5, rng.integers(-2, 0, v.shape), v) for k, v in feeds.items()},
           empty, {k: v[1:2] for k, v in feeds.items()},
           {k: np.concatenate([v, v[::-1]]) for k, v in feeds.items()}]
    out.append({k: v if v.ndim == 1 or k == "bag_sum:0" else np.concatenate([v, v[:, :2]], axis=1)
                for k, v in feeds.items()})  # longer bags and histories
    for f in out:
        for k in histories:
            f[k] = f[k].copy()
            f[k][0, -1] = 1
    return out


def test_feature_column_lookups_become_gathers():
    """Identity columns → safe_embedding_lookup_sparse ([B] ids; [B, L] bags with sum, mean and sqrtn; a
    sequence column [B, T] → [B, T, D]): no NonZero/Unique behind the lookups, TF's outputs, idempotent."""
    model = load(SPARSE_COLUMNS)
    once, ctx = run_pass(model, "rewrite-sparse-columns")
    assert ctx.matches == ctx.rewrites == 5 and not ctx.notes
    for out in ("pooled:0", "seq:0"):
        assert not {"NonZero", "Unique", "ScatterND", "ScatterElements"} & ops_behind(once, out)
    assert {"Sqrt", "Div"} <= ops_behind(once, "pooled:0") and len(ops(once)) < len(ops(model)) / 4
    feeds = dict(np.load(SPARSE_COLUMNS.with_suffix(".npz")))
    with np.load(SPARSE_COLUMNS.with_suffix(".ref.npz")) as ref:
        got = ctropt.runtime.run_model(once, feeds)
        for k in ("pooled:0", "seq:0"):  # seq_len: tf2onnx's SegmentMax gives int64 min for an empty row
            np.testing.assert_allclose(got[k], ref[k], atol=1e-6)
    for f in hostile_column_feeds(feeds, ["hist:0"]):
        assert_same_outputs(model, once, f, atol=1e-6)
    again, ctx = run_pass(once, "rewrite-sparse-columns")
    assert ctx.rewrites == 0 and ops(again) == ops(once)


def test_a_lookup_that_reads_negative_ids_from_the_end_is_no_sparse_column():
    nodes = [node("Gather", ["table", "ids0"], ["g"]), node("Mul", ["g", "two"], ["y"])]
    model = make_model(nodes, [vi("ids0", I64, ["B"])], [vi("y", F, ["B", 4])],
                       [init("table", BAG_TABLE), init("two", np.array(2, np.float32))])
    out, ctx = run_pass(model, "rewrite-sparse-columns")
    assert ctx.rewrites == 0 and ops(out) == ops(model)


def test_feature_columns_raise_on_ids_past_their_table():
    """safe_embedding_lookup_sparse drops every negative id and raises on an id from the table's rows on; the
    rewrite's zero row answered id rows (11)."""
    model = load(SPARSE_COLUMNS)
    once, ctx = run_pass(model, "rewrite-sparse-columns")
    assert ctx.rewrites == 5
    feeds = dict(np.load(SPARSE_COLUMNS.with_suffix(".npz")))
    cases = {}
    for name in ("one:0", "bag_sum:0", "bag_mean:0", "bag_sqrtn:0", "hist:0"):
        v = first_raising_id(model, feeds, name, at=1)
        assert v == 11
        cases.update(id_cases(feeds, name, [0, v - 1, -1, -2, -v, -v - 1, -(1 << 31), v, v + 1000, 1 << 40], at=1))
    raised = assert_same_answers(model, once, cases, atol=1e-6)
    assert {v for _, v in raised} == {11, 1011, 1 << 40}


@pytest.mark.parametrize("name", ["DIEN", "WDL"])
def test_deeprec_columns_over_shards_raise_on_ids_past_their_table(name):
    """DeepRec's feature columns over partitioned tables, merged then rewritten: an id of V raises as the export's
    stitch does (it was answered with the zero row), negative ids stay padding, ids inside answer the same."""
    path = DATA / f"deeprec_{name}_tf2onnx.onnx"
    raw = load(path)
    merged, ctx = run_pass(raw, "merge-partitioned-embeddings")
    assert ctx.rewrites > 0
    once, ctx = run_pass(merged, "rewrite-sparse-columns")
    assert ctx.rewrites > 0
    feeds = dict(np.load(path.with_suffix(".npz")))
    names = ["UID:0", "ITEM:0", "CATEGORY:0", "HISTORY_ITEM:0", "HISTORY_CATEGORY:0"] if name == "DIEN" else \
        ["C1:0", "C5:0"]
    cases = {}
    for k in names:
        v = first_raising_id(raw, feeds, k)
        cases.update(id_cases(feeds, k, [0, v - 1, -1, -2, -v - 1, -(1 << 31), v, v + 1000, 1 << 40]))
    raised = assert_same_answers(raw, once, cases)
    assert {v for _, v in raised} >= {1 << 40} and all((k, first_raising_id(raw, feeds, k)) in raised for k in names)


@pytest.mark.parametrize("name", ["DIN", "MMoE", "DCNv2"])
def test_deeprec_feature_columns_become_gathers(name):
    """DeepRec's columns over merged shards: the Unique ops of every lookup go, outputs kept on hostile ids."""
    path = DATA / f"deeprec_{name}_tf2onnx.onnx"
    raw = load(path)
    merged, _ = run_pass(raw, "merge-partitioned-embeddings")
    once, ctx = run_pass(merged, "rewrite-sparse-columns")
    assert ctx.rewrites == ctx.matches > 0 and ops(once).count("Unique") <= 1  # DIN: the history length's
    feeds = dict(np.load(path.with_suffix(".npz")))
    ids = {k: v for k, v in feeds.items() if v.dtype.kind == "i"}
    for f in hostile_column_feeds(ids, [k for k in ids if k.startswith("HISTORY")]):
        batch = len(next(iter(f.values())))
        assert_same_outputs(raw, once, {k: f.get(k, np.resize(v, (batch,) + v.shape[1:])) for k, v in feeds.items()})


def test_openvino_joins_no_tables_past_the_ids_it_computes_exactly():
    """OpenVINO's CPU plugin runs a fused chain of integer element-wise ops in f32: a joined table of over 2^24 rows
    would read rounded rows (seen on a 1.8 GB DLRM-style export), so for --target openvino the group stays apart;
    for onnxruntime it is joined."""
    rows = (1 << 23) + 1
    tables = [init(f"t{i}", np.zeros((rows, 1), np.float32)) for i in range(2)]
    nodes = [node("Gather", [f"t{i}", f"id{i}"], [f"e{i}"]) for i in range(2)] + [node("Concat", ["e0", "e1"], ["y"], axis=1)]
    model = make_model(nodes, [vi(f"id{i}", I64, ["B", 1]) for i in range(2)], [vi("y", F, ["B", 2, 1])], tables)
    _, ctx = run_pass(model, "fuse-parallel-embeddings", target="openvino")
    assert ctx.rewrites == 0 and any("2^24" in n for n in ctx.notes), ctx.notes
    _, ctx = run_pass(model, "fuse-parallel-embeddings")
    assert ctx.rewrites == 1
