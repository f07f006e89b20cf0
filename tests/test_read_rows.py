"""compute-read-rows-only: a transformer block whose output is read at one position (torch-rechub's BST reads the
target's row, `out[:, -1]`) computes its row-wise ops for that position only; in the torch dialects (3-D MatMuls
over [B, T, D]; heads split by Reshape/Transpose) and the legacy one (Gemm over [B·T, D], which the selection does
not pass: it stops there)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import F, I64, assert_same_outputs, init, make_model, node, ops, run_pass, vi

import ctropt
from ctropt.runtime import run_model

RNG = np.random.default_rng(11)
T, D, H, DH, FF = 6, 8, 2, 4, 16


def w(*shape):
    return RNG.normal(0, 0.4, shape).astype(np.float32)


def block(read=("Gather", -1), legacy_ffn=False):
    """x [B, T, D] → self-attention (2 heads) + residual + LayerNorm → FFN + residual + LayerNorm → read."""
    n = [node("MatMul", ["x", "wq"], ["q"]), node("MatMul", ["x", "wk"], ["k"]), node("MatMul", ["x", "wv"], ["v"])]
    for t in "qkv":
        n += [node("Reshape", [t, "heads"], [f"{t}4"]), node("Transpose", [f"{t}4"], [f"{t}h"], perm=[0, 2, 1, 3])]
    n += [node("Transpose", ["kh"], ["kt"], perm=[0, 1, 3, 2]), node("MatMul", ["qh", "kt"], ["s"]),
          node("Mul", ["s", "scale"], ["ss"]), node("Softmax", ["ss"], ["p"], axis=-1), node("MatMul", ["p", "vh"], ["o"]),
          node("Transpose", ["o"], ["ot"], perm=[0, 2, 1, 3]), node("Reshape", ["ot", "merged"], ["om"]),
          node("MatMul", ["om", "wo"], ["a"]), node("Add", ["a", "x"], ["r1"]),
          node("LayerNormalization", ["r1", "g1", "b1"], ["n1"], axis=-1)]
    if legacy_ffn:   # torch legacy: Linear over rows [B·T, D]
        n += [node("Reshape", ["n1", "rows2d"], ["n1r"]), node("Gemm", ["n1r", "w1", "c1"], ["f1"]),
              node("Relu", ["f1"], ["f1r"]), node("Gemm", ["f1r", "w2", "c2"], ["f2"]),
              node("Reshape", ["f2", "back3d"], ["f3"])]
    else:
        n += [node("MatMul", ["n1", "w1"], ["f1"]), node("Add", ["f1", "c1"], ["f1b"]), node("Relu", ["f1b"], ["f1r"]),
              node("MatMul", ["f1r", "w2"], ["f2"]), node("Add", ["f2", "c2"], ["f3"])]
    n += [node("Add", ["f3", "n1"], ["r2"]), node("LayerNormalization", ["r2", "g2", "b2"], ["n2"], axis=-1)]
    op, idx = read
    n.append(node(op, ["n2", "at"], ["y"], axis=1))
    inits = [init("wq", w(D, D)), init("wk", w(D, D)), init("wv", w(D, D)), init("wo", w(D, D)),
             init("heads", np.array([0, T, H, DH], np.int64)), init("merged", np.array([0, T, D], np.int64)),
             init("scale", np.array(DH ** -0.5, np.float32)), init("g1", w(D) + 1), init("b1", w(D)),
             init("w1", w(D, FF)), init("c1", w(FF)), init("w2", w(FF, D)), init("c2", w(D)), init("g2", w(D) + 1),
             init("b2", w(D)), init("at", np.array(idx, np.int64)), init("rows2d", np.array([-1, D], np.int64)),
             init("back3d", np.array([-1, T, D], np.int64))]
    out_shape = ["B", D] if np.ndim(idx) == 0 else ["B", len(idx), D]
    return make_model(n, [vi("x", F, ["B", T, D])], [vi("y", F, out_shape)], inits)


def _ffn_rows(model) -> set:
    """The row counts (axis 1) the feed-forward MatMul/Gemm ops see, from onnxruntime's shapes."""
    import onnx

    inferred = onnx.shape_inference.infer_shapes(model)
    shapes = {v.name: [d.dim_value or d.dim_param for d in v.type.tensor_type.shape.dim]
              for v in inferred.graph.value_info}
    w1_reader = next(nd for nd in inferred.graph.node if "w1" in nd.input)
    return shapes.get(w1_reader.input[0])


def _ffn_input(model, feeds):
    """The value the first feed-forward MatMul reads, as onnxruntime computes it."""
    import copy

    probe = copy.deepcopy(model)
    name = next(nd for nd in probe.graph.node if "w1" in nd.input).input[0]
    probe.graph.output.append(vi(name, F, None))
    return run_model(probe, feeds)[name]


def _check(model, feeds):
    done, ctx = run_pass(model, "compute-read-rows-only")
    assert ctx.rewrites == 1, ctx
    want, got = run_model(model, feeds)["y"], run_model(done, feeds)["y"]
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)
    again, ctx2 = run_pass(done, "compute-read-rows-only")
    assert ctx2.rewrites == 0 and sorted(ops(again)) == sorted(ops(done))
    assert ctropt.graph.interface(done) == ctropt.graph.interface(model)
    return done


def test_the_target_row_of_a_transformer_block():
    """Gather(out, -1, axis=1): the FFN, both layer norms, the residuals, the output projection and the queries run
    on one row; the keys and values (read whole) get the full input."""
    model = block()
    done = _check(model, {"x": RNG.normal(size=(3, T, D)).astype(np.float32)})
    assert _ffn_rows(model)[1] == T and _ffn_rows(done)[1] == 1
    picked = [nd for nd in done.graph.node if nd.op_type == "Gather"]
    assert [nd.input[0] for nd in picked] == ["x"]   # one cut: the queries' rows of the block's input
    q_proj = next(nd for nd in done.graph.node if "wq" in nd.input)
    assert q_proj.input[0] == picked[0].output[0]


def test_two_positions_read():
    model = block(read=("Gather", [0, -1]))
    done = _check(model, {"x": RNG.normal(size=(2, T, D)).astype(np.float32)})
    assert _ffn_rows(done)[1] == 2


def test_a_legacy_feed_forward_over_merged_rows_stops_the_selection():
    """Reshape to [B·T, D] merges the axis: the selection stops after it (the FFN runs whole), still exact."""
    model = block(legacy_ffn=True)
    done = _check(model, {"x": RNG.normal(size=(2, T, D)).astype(np.float32)})
    rows = [nd for nd in done.graph.node if nd.op_type == "Gather"]
    assert len(rows) == 2   # the residual's n1 and the FFN's output, each cut where the selection stops


def test_reads_it_leaves():
    """The last axis (features), every position, a value also read whole: no rewrite."""
    features = block(read=("Gather", [0, 1]))
    features.graph.node[-1].attribute[0].i = 2
    features.graph.output[0].type.tensor_type.shape.dim[1].dim_value = T
    every = block(read=("Gather", list(range(T))))
    twice = block()
    twice.graph.output.append(vi("n2", F, ["B", T, D]))
    for model in (features, every, twice):
        done, ctx = run_pass(model, "compute-read-rows-only")
        assert ctx.rewrites == 0 and sorted(ops(done)) == sorted(ops(model))
    assert_same_outputs(twice, run_pass(twice, "compute-read-rows-only")[0])


def test_softmax_over_the_read_axis_is_not_passed():
    """A softmax across positions mixes them: the selection stops there."""
    model = make_model([node("Softmax", ["x"], ["s"], axis=1), node("Relu", ["s"], ["r"]),
                        node("Gather", ["r", "at"], ["y"], axis=1)],
                       [vi("x", F, ["B", T, D])], [vi("y", F, ["B", D])], [init("at", np.array(2, np.int64))])
    done = _check(model, {"x": RNG.normal(size=(2, T, D)).astype(np.float32)})
    assert ops(done) == ["Softmax", "Gather", "Relu", "Squeeze"]


def sasrec_read(model, varying=False):
    """RecBole SASRec's gather_indexes: GatherElements(out, Expand(Reshape(lengths - 1, [-1, 1, 1]), [1, 1, D]),
    axis=1): each row's last valid position (`varying`: an index that also varies over the features)."""
    g = model.graph
    del g.node[-1]
    g.input.append(vi("lengths", I64, ["B"]))
    g.node.extend([node("Sub", ["lengths", "one"], ["last"]), node("Reshape", ["last", "r3"], ["last3"]),
                   node("Expand", ["last3", "wide"], ["index"]), node("GatherElements", ["n2", "index"], ["y"], axis=1)])
    if varying:
        g.node[-2].input[0] = "lengths_grid"
        g.input.append(vi("lengths_grid", I64, ["B", 1, D]))
    g.initializer.extend([init("one", np.array(1, np.int64)), init("r3", np.array([-1, 1, 1], np.int64)),
                          init("wide", np.array([1, 1, D], np.int64))])
    g.output[0].CopyFrom(vi("y", F, ["B", 1, D]))
    return model


def test_one_position_per_row_sasrec():
    """Each row read at its own last valid position: the FFN and norms run on one row per sequence, a
    GatherElements takes each row's position where the region ends."""
    model = sasrec_read(block())
    feeds = {"x": RNG.normal(size=(4, T, D)).astype(np.float32), "lengths": np.array([T, 1, 3, 5], np.int64)}
    done = _check(model, feeds)
    assert _ffn_input(model, feeds).shape == (4, T, D) and _ffn_input(done, feeds).shape == (4, 1, D)
    assert [nd.input[0] for nd in done.graph.node if nd.op_type == "GatherElements"] == ["x"]
    grid = sasrec_read(block(), varying=True)
    out, ctx = run_pass(grid, "compute-read-rows-only")
    assert ctx.rewrites == 0


@pytest.mark.parametrize("name", ["torch_rechub_BST_legacy", "torch_rechub_BST_dynamo", "recbole_SASRec_dynamo",
                                  "recbole_SASRec_legacy"])
def test_third_party_exports_compute_the_rows_read_only(name):
    from pathlib import Path

    from ctropt.graph import load

    path = Path(__file__).parent / "data" / "thirdparty" / f"{name}.onnx"
    result = ctropt.optimize(load(path), passes="all", speed=False)
    record = next(r for r in result.records if r.name == "compute-read-rows-only")
    assert record.status == "applied" and record.rewrites == 1
    with np.load(path.with_suffix(".npz")) as data, np.load(path.with_suffix(".ref.npz")) as ref:
        got = run_model(result.model, {k: data[k] for k in data.files})
        for k in ref.files:
            np.testing.assert_allclose(got[k], ref[k], atol=1e-5, rtol=1e-4)


def _exact(model, feeds, rewrites):
    done, ctx = run_pass(model, "compute-read-rows-only")
    assert ctx.rewrites == rewrites
    want, got = run_model(model, feeds)["y"], run_model(done, feeds)["y"]
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=1e-6)
    assert run_pass(done, "compute-read-rows-only")[1].rewrites == 0
    return done


def test_a_value_reached_in_two_places_is_taken_in_each():
    """u read as is and transposed: its rows along each reader's own axis (review: one cached place was wrong)."""
    model = make_model([node("Relu", ["x"], ["u"]), node("Transpose", ["u"], ["ut"], perm=[0, 2, 1]),
                        node("Add", ["u", "ut"], ["s"]), node("Gather", ["s", "at"], ["y"], axis=1)],
                       [vi("x", F, ["B", 5, 5])], [vi("y", F, ["B", 5])], [init("at", np.array(1, np.int64))])
    _exact(model, {"x": RNG.normal(size=(3, 5, 5)).astype(np.float32)}, 1)


def test_per_row_reads_that_are_not_one_position_of_each_whole_row_are_left():
    """An index not expanded over the features (or over fewer of them) reads a corner: no rewrite."""
    for wide in (None, [1, 1, 2]):
        nodes = [node("Relu", ["x"], ["u"]), node("Sub", ["lengths", "one"], ["last"]),
                 node("Reshape", ["last", "r3"], ["i3"])]
        inits = [init("one", np.array(1, np.int64)), init("r3", np.array([-1, 1, 1], np.int64))]
        if wide:
            nodes.append(node("Expand", ["i3", "wide"], ["i"]))
            inits.append(init("wide", np.array(wide, np.int64)))
        nodes.append(node("GatherElements", ["u", "i" if wide else "i3"], ["y"], axis=1))
        model = make_model(nodes, [vi("x", F, ["B", 5, 4]), vi("lengths", I64, ["B"])], [vi("y", F, None)], inits)
        _exact(model, {"x": RNG.normal(size=(3, 5, 4)).astype(np.float32), "lengths": np.array([5, 1, 3])}, 0)


def test_a_layer_norms_mean_output_is_not_its_normalized_one():
    model = make_model([node("Relu", ["x"], ["r"]), node("LayerNormalization", ["r", "g"], ["n", "mean"], axis=-1),
                        node("Gather", ["mean", "at"], ["y"], axis=1)],
                       [vi("x", F, ["B", 5, 4])], [vi("y", F, None)],
                       [init("g", np.ones(4, np.float32)), init("at", np.array(1, np.int64))])
    _exact(model, {"x": RNG.normal(size=(3, 5, 4)).astype(np.float32)}, 0)


def test_an_operand_whose_axis_is_only_named_is_not_selected():
    """p [S, D] with S = 1 at run time broadcasts: a dim neither 1 nor the output's own stops the selection there."""
    model = make_model([node("Relu", ["x"], ["r"]), node("Add", ["r", "p"], ["s"]), node("Tanh", ["s"], ["t"]),
                        node("Gather", ["t", "at"], ["y"], axis=1)],
                       [vi("x", F, ["B", 5, 4]), vi("p", F, ["S", 4])], [vi("y", F, None)],
                       [init("at", np.array(2, np.int64))])
    done = _exact(model, {"x": RNG.normal(size=(3, 5, 4)).astype(np.float32),
                          "p": RNG.normal(size=(1, 4)).astype(np.float32)}, 1)
    assert [n.op_type for n in done.graph.node].count("Add") == 1 and "Tanh" in ops(done)


def computed_merge(model):
    """The heads merged by a Reshape to a target computed from the value's own Shape, as the legacy exporter writes
    it (``Concat(Gather(Shape(o), 0), Gather(Shape(o), 1), [D])``): shape inference then names the batch of
    what follows apart from the residual's."""
    g = model.graph
    at = next(i for i, nd in enumerate(g.node) if nd.op_type == "Reshape" and nd.input[1] == "merged")
    g.node[at].input[1] = "merged_dyn"
    extra = [node("Shape", ["ot"], ["ot_shape"]), node("Gather", ["ot_shape", "zero"], ["d0"], axis=0),
             node("Gather", ["ot_shape", "one_i"], ["d1"], axis=0), node("Unsqueeze", ["d0", "ax0"], ["d0u"]),
             node("Unsqueeze", ["d1", "ax0"], ["d1u"]), node("Concat", ["d0u", "d1u", "width"], ["merged_dyn"], axis=0)]
    for k, nd in enumerate(extra):
        g.node.insert(at + k, nd)
    g.initializer.extend([init("zero", np.array(0, np.int64)), init("one_i", np.array(1, np.int64)),
                          init("ax0", np.array([0], np.int64)), init("width", np.array([D], np.int64))])
    return model


def test_one_position_per_row_through_heads_merged_to_a_computed_shape():
    """RecBole's legacy SASRec: the selection passes the computed Reshape (its target gets the kept count by
    arithmetic) and the Shape read of the merged heads (given from the rows), so the attention's queries run on one
    row too and no op computes the whole attention output; the dims shape inference named apart are compared by
    their sizes in the probe."""
    model = sasrec_read(computed_merge(block()))
    feeds = {"x": RNG.normal(size=(4, T, D)).astype(np.float32), "lengths": np.array([T, 1, 3, 5], np.int64)}
    done = _check(model, feeds)
    assert [nd.input[0] for nd in done.graph.node if nd.op_type == "GatherElements"] == ["x"]
    q_proj = next(nd for nd in done.graph.node if "wq" in nd.input)
    picked = next(nd for nd in done.graph.node if nd.op_type == "GatherElements")
    assert q_proj.input[0] == picked.output[0]
    assert not any(nd.op_type == "Shape" and nd.input[0] == "ot" for nd in done.graph.node)


def test_history_dims_the_probe_sizes_alike_are_not_taken_as_one():
    """z [B, N, 4] added to a [B, T, 4] sequence: the probe gives N and T the same length, but only the batch is
    compared by its probed size; N may be 1 at run time, so z is not selected (the read stays after the Add)."""
    model = make_model([node("Relu", ["x"], ["r"]), node("Add", ["r", "z"], ["s"]), node("Tanh", ["s"], ["t"]),
                        node("Gather", ["t", "at"], ["y"], axis=1)],
                       [vi("x", F, ["B", "T", 4]), vi("z", F, ["B", "N", 4])], [vi("y", F, None)],
                       [init("at", np.array(2, np.int64))])
    done = _exact(model, {"x": RNG.normal(size=(3, 5, 4)).astype(np.float32),
                          "z": RNG.normal(size=(3, 1, 4)).astype(np.float32)}, 1)
    assert [n.op_type for n in done.graph.node].count("Add") == 1 and "Tanh" in ops(done)
