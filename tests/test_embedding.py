"""The embedding passes on every dialect: per-feature lookups, partitioned tables, bags, indicator columns."""

from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto

import ctropt
import ctropt.exporters.zoo
from ctropt.exporters import Export
from ctropt.graph import load
from ctropt.passes import embedding
from helpers import F, I64, assert_same_outputs, check_pass, init, make_model, node, ops, run_pass, vi

RNG = np.random.default_rng(0)
ROWS = (5, 9, 7)
TABLES = [init(f"t{i}", RNG.standard_normal((rows, 4)).astype(np.float32)) for i, rows in enumerate(ROWS)]
DATA = Path(__file__).parent / "data" / "thirdparty"

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


def test_stacked_lookups_become_one_gather_on_doubled_tables():
    """Small tables are stored twice, so one Add maps ids in [-rows, rows) exactly (no Mod)."""
    out, ctx = check_pass(stacked_model(), "fuse-parallel-embeddings", ["Concat", "Add", "Gather", "Flatten"],
                          feeds=feeds_with_boundaries((5, 1)))
    assert ctx.rewrites == 1 and ctx.matches == 3
    table = next(t for t in out.graph.initializer if t.dims[0] > 9)
    assert list(table.dims) == [2 * sum(ROWS), 4]


def test_large_tables_are_stored_once_and_ids_wrapped(monkeypatch):
    monkeypatch.setattr(embedding, "DOUBLED_TABLE_BYTES", 0)
    out, _ = check_pass(stacked_model(), "fuse-parallel-embeddings", ["Concat", "Mod", "Add", "Gather", "Flatten"],
                        feeds=feeds_with_boundaries((5, 1)))
    assert max(t.dims[0] for t in out.graph.initializer) == sum(ROWS)


def test_int32_ids_need_no_casts():
    check_pass(stacked_model(TensorProto.INT32), "fuse-parallel-embeddings", ["Concat", "Add", "Gather", "Flatten"],
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
    out, _ = check_pass(model, "fuse-parallel-embeddings", ["Concat", "Reshape", "Transpose", "Add", "Gather"],
                        feeds=feeds)
    table = next(t for t in out.graph.initializer if t.dims[0] > 9)
    assert list(table.dims) == [2 * (5 + 9), 4]  # the shared table is stored once (twice: doubled)


def test_flat_lookups_joined_on_the_last_axis_with_dense_features_around():
    """torch form: ids [B] → [B, D] pieces, Concat(-1) with dense features: the run of lookups is one Reshape."""
    nodes = [node("Gather", [f"t{i}", f"id{i}"], [f"e{i}"]) for i in range(3)]
    nodes += [node("Concat", ["dense", "e0", "e1", "e2", "dense"], ["y"], axis=-1)]
    model = make_model(nodes, [vi(f"id{i}", I64, ["B"]) for i in range(3)] + [vi("dense", F, ["B", 3])],
                       [vi("y", F, ["B", 18])], TABLES)
    feeds = {**feeds_with_boundaries((5,)), "dense": RNG.standard_normal((5, 3)).astype(np.float32)}
    check_pass(model, "fuse-parallel-embeddings",
               ["Concat", "Reshape", "Transpose", "Add", "Gather", "Reshape", "Concat"], feeds=feeds)


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
    check_pass(out, "fuse-parallel-embeddings", ["Concat", "Reshape", "Transpose", "Add", "Gather", "ReduceSum"],
               feeds=feeds_with_boundaries((5,)))


def history_model(target: bool):
    """DIN: history items and categories [B, T] joined on the last axis; with `target`, the candidate's item and
    category [B, 1] (same tables) joined the same way."""
    nodes = [node("Gather", ["t0", "id0"], ["h0"]), node("Gather", ["t1", "id1"], ["h1"]),
             node("Concat", ["h0", "h1"], ["hist"], axis=-1), node("ReduceSum", ["hist", "ax1"], ["y"], keepdims=0)]
    inputs, outputs = [vi("id0", I64, ["B", 3]), vi("id1", I64, ["B", 3])], [vi("y", F, ["B", 8])]
    if target:
        nodes += [node("Gather", ["t0", "q0"], ["e0"]), node("Gather", ["t1", "q1"], ["e1"]),
                  node("Concat", ["e0", "e1"], ["q"], axis=-1)]
        inputs += [vi("q0", I64, ["B", 1]), vi("q1", I64, ["B", 1])]
        outputs += [vi("q", F, ["B", 1, 8])]
    return make_model(nodes, inputs, outputs, TABLES[:2] + [init("ax1", np.array([1]))])


def test_history_lookups_joined_on_the_last_axis_interleave():
    feeds = feeds_with_boundaries((4, 3), rows=ROWS[:2])
    out, _ = check_pass(history_model(False), "fuse-parallel-embeddings",
                        ["Unsqueeze", "Unsqueeze", "Concat", "Reshape", "Add", "Gather", "Reshape", "ReduceSum"],
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


def test_opt_in():
    assert not ctropt.REGISTRY["fuse-parallel-embeddings"].default


@pytest.mark.parametrize("name", ["deepctr_WDL_tf2onnx", "deepctr_DeepFM_tf2onnx", "deepctr_DCN_tf2onnx",
                                  "deepctr_MMOE_tf2onnx", "deepctr_torch_WDL_legacy", "deepctr_torch_WDL_dynamo",
                                  "deepctr_torch_DeepFM_dynamo", "deepctr_torch_DeepFM_legacy"])
def test_third_party_exports_keep_one_lookup_per_table_width(name):
    model = load(DATA / f"{name}.onnx")
    widths = {t.dims[1] for t in model.graph.initializer if len(t.dims) == 2 and
              any(n.op_type == "Gather" and n.input[0] == t.name for n in model.graph.node)}
    result = ctropt.optimize(model, passes=["all", "fuse-parallel-embeddings"])
    rec = next(r for r in result.records if r.name == "fuse-parallel-embeddings")
    assert rec.status == "applied", (rec.status, rec.message)
    tables = {t.name for t in result.model.graph.initializer if len(t.dims) == 2 and t.dims[0] > 1}
    lookups = [n for n in result.model.graph.node if n.op_type == "Gather" and n.input[0] in tables]
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
    result = ctropt.optimize(model)  # generated jagged inputs: lengths with empty bags, values = sum(lengths)
    rec = next(r for r in result.records if r.name == "vectorize-embedding-bags")
    assert rec.status == "applied" and rec.rewrites == 6
    assert ops(result.model).count("Loop") == 0
    with np.load(TORCHREC.with_suffix(".npz")) as data, np.load(TORCHREC.with_suffix(".ref.npz")) as ref:
        feeds = {k: data[k] for k in data.files}
        np.testing.assert_allclose(ctropt.runtime.run_model(result.model, feeds)["logits"], ref["logits"], atol=1e-5)
        got = ctropt.runtime.Runner(result.model, "openvino-cpu").run(feeds)["logits"]
        np.testing.assert_allclose(got, ref["logits"], atol=1e-5)


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


def test_zoo_wdl_partitioned_tables_merge():
    model = load(ctropt.exporters.zoo.shipped_path("wdl"))
    result = ctropt.optimize(model, passes=["merge-partitioned-embeddings"])
    rec = result.records[0]
    assert rec.status == "applied" and rec.rewrites == 52 and "Compress" not in ops(result.model)
    with np.load(ctropt.exporters.zoo.shipped_path("wdl").with_suffix(".npz")) as data:
        assert_same_outputs(model, result.model, {k: data[k] for k in data.files})


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
    result = ctropt.optimize(model)
    rec = next(r for r in result.records if r.name == "rewrite-indicator-columns")
    assert rec.status == "applied" and rec.rewrites == 1 and "OneHot" not in ops(result.model)
