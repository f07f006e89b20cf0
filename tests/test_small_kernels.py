"""small-products-kernel and gather-rows-kernel: sums over middle axes, batched small products and row lookups →
ctropt's SumAxes, SmallMatMul and GatherRows kernels, in the dialects of torch (FM's ReduceSum with axes as an input,
keepdims), tf2onnx and paddle2onnx (axes an attribute before opset 13, int32 ids), FuxiCTR (a history summed over
a dynamic length); the kernels against numpy."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from helpers import F, I64, check_pass, init, kernel_session, make_model, node, ops, run_pass, vi

from ctropt import REGISTRY, kernels
from ctropt.graph import to_graph

RNG = np.random.default_rng(3)
I32 = onnx.TensorProto.INT32


def fm_sum_torch():
    """deepctr-torch FM: [B, F, E] summed over the fields, keepdims, axes an input (opset 13+)."""
    return make_model([node("ReduceSum", ["x", "ax"], ["s"], keepdims=1), node("Mul", ["s", "s"], ["y"])],
                      [vi("x", F, ["batch", 5, 8])], [vi("y", F, ["batch", 1, 8])], [init("ax", np.array([1]))])


def history_sum_fuxictr():
    """FuxiCTR: a history of dynamic length summed, no keepdims; and a sum over the last axis that stays."""
    nodes = [node("ReduceSum", ["h", "ax1"], ["pooled"], keepdims=0), node("ReduceSum", ["h", "axl"], ["y2"], keepdims=0),
             node("Relu", ["pooled"], ["y"])]
    return make_model(nodes, [vi("h", F, ["batch", "hist_len", 8])],
                      [vi("y", F, ["batch", 8]), vi("y2", F, ["batch", "hist_len"])],
                      [init("ax1", np.array([1])), init("axl", np.array([-1]))])


def paddle_sum_opset11():
    """paddle2onnx/tf2onnx before opset 13: axes an attribute; [B, F, 1] summed over F (a trailing axis of 1)."""
    return make_model([node("ReduceSum", ["x"], ["y"], axes=[1], keepdims=0)], [vi("x", F, ["n", 26, 1])],
                      [vi("y", F, ["n", 1])], opset=11)


def test_fm_sum_over_fields():
    check_pass(fm_sum_torch(), "small-products-kernel", ["SumAxes", "Mul"])


def _misses(model) -> str:
    return " ".join(REGISTRY["small-products-kernel"].misses(to_graph(model), "ort"))


def test_history_sum_and_the_last_axis_stays():
    check_pass(history_sum_fuxictr(), "small-products-kernel", ["SumAxes", "ReduceSum", "Relu"])
    assert "last axes" in _misses(history_sum_fuxictr())


def test_axes_as_an_attribute_before_opset_13():
    check_pass(paddle_sum_opset11(), "small-products-kernel", ["SumAxes"])


@pytest.mark.parametrize("axes,why", [([0, 2], "not contiguous"), ([2], "last axes")])
def test_sums_that_stay(axes, why):
    model = make_model([node("ReduceSum", ["x", "ax"], ["y"], keepdims=0)], [vi("x", F, [4, 5, 6])], [vi("y", F, None)],
                       [init("ax", np.array(axes))])
    done, ctx = run_pass(model, "small-products-kernel")
    assert ops(done) == ["ReduceSum"] and ctx.rewrites == 0 and why in _misses(model)


def mmoe_gate_product():
    """An MMoE gate's weighted sum of experts (after weighted-sum-as-matmul): [B, 1, E] × [B, E, D]."""
    return make_model([node("MatMul", ["g", "e"], ["y"])], [vi("g", F, ["batch", 1, 3]), vi("e", F, ["batch", 3, 16])],
                      [vi("y", F, ["batch", 1, 16])])


def finalmlp_bilinear():
    """FuxiCTR FinalMLP: [B, H, 1, d] × a constant [H, d, d], broadcast over the batch; then [B, H, 1, d] × [B, H, d, 1]."""
    nodes = [node("MatMul", ["x", "w"], ["xw"]), node("MatMul", ["xw", "z"], ["y"])]
    return make_model(nodes, [vi("x", F, ["batch", 2, 1, 8]), vi("z", F, ["batch", 2, 8, 1])],
                      [vi("y", F, ["batch", 2, 1, 1])], [init("w", RNG.normal(size=(2, 8, 8)).astype(np.float32))])


def dcn_outer():
    """deepctr DCN's cross: [B, D, 1] × [B, 1, 1] (K = 1)."""
    return make_model([node("MatMul", ["x0", "s"], ["y"])], [vi("x0", F, ["batch", 42, 1]), vi("s", F, ["batch", 1, 1])],
                      [vi("y", F, ["batch", 42, 1])])


@pytest.mark.parametrize("build", [mmoe_gate_product, finalmlp_bilinear, dcn_outer])
def test_small_batched_products(build):
    model = build()
    check_pass(model, "small-products-kernel", ["SmallMatMul"] * ops(model).count("MatMul"))


@pytest.mark.parametrize("a,b,why", [
    (["batch", 16], [16, 8], "one matrix"),                           # a 2-D weight: one GEMM
    (["batch", 27, 16], ["batch", 16, 27], "multiply-adds"),          # DLRM's interaction: sgemm is faster
    (["batch", "m", 16], ["batch", 16, 8], "not static"),
])
def test_products_that_stay(a, b, why):
    inits = [] if isinstance(b[0], str) else [init("b", RNG.normal(size=b).astype(np.float32))]
    inputs = [vi("a", F, a)] + ([vi("b", F, b)] if not inits else [])
    model = make_model([node("MatMul", ["a", "b"], ["y"])], inputs, [vi("y", F, None)], inits)
    done, ctx = run_pass(model, "small-products-kernel")
    assert ops(done) == ["MatMul"] and why in _misses(model)


def lookups(ids_type=I64, rank=2):
    """Two tables read at the same ids (the first-order weights and the embeddings), and a lookup of int rows."""
    nodes = [node("Gather", ["w1", "ids"], ["a"]), node("Gather", ["w8", "ids"], ["b"], axis=0),
             node("Gather", ["codes", "ids"], ["c"]), node("Cast", ["c"], ["cf"], to=F),
             node("ReduceSum", ["a", "axl"], ["a1"], keepdims=0), node("Concat", ["a1", "cf"], ["y1"], axis=-1)]
    shape = ["batch", 26][:rank]
    return make_model(nodes, [vi("ids", ids_type, shape)], [vi("y1", F, None), vi("b", F, shape + [8])],
                      [init("w1", RNG.normal(size=(100, 1)).astype(np.float32)),
                       init("w8", RNG.normal(size=(100, 8)).astype(np.float32)),
                       init("codes", RNG.integers(0, 9, (100,)).astype(np.int64)), init("axl", np.array([-1]))])


@pytest.mark.parametrize("ids_type", [I64, I32])
def test_lookups_of_float_rows(ids_type):
    f = {"ids": RNG.integers(-100, 100, (4, 26)).astype(np.int64 if ids_type == I64 else np.int32)}
    check_pass(lookups(ids_type), "gather-rows-kernel",
               ["GatherRows", "GatherRows", "Gather", "Cast", "ReduceSum", "Concat"], feeds=f)


@pytest.mark.parametrize("shape,axis,count,keepdims", [
    ((7, 13, 1), 1, 1, 0), ((7, 13, 4), 1, 1, 1), ((5, 9, 8), 1, 1, 0), ((3, 11, 19), 1, 1, 0),   # narrow, wide, tails
    ((2, 3, 5, 6), 1, 2, 1), ((6, 5), 0, 1, 0), ((4, 0, 3), 1, 1, 0), ((2, 37, 3), 1, 1, 1),
])
def test_sum_axes_matches_numpy(shape, axis, count, keepdims):
    x = RNG.normal(size=shape).astype(np.float32)
    s = kernel_session([onnx.helper.make_node("SumAxes", ["x"], ["y"], domain=kernels.DOMAIN, axis=axis, count=count,
                                        keepdims=keepdims)], [vi("x", F, None)])
    want = x.astype(np.float64).sum(axis=tuple(range(axis, axis + count)), keepdims=bool(keepdims))
    got = s.run(None, {"x": x})[0]
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("a,b", [
    ((5, 1, 3), (5, 3, 16)), ((5, 4, 9), (5, 9, 17)), ((5, 42, 1), (5, 1, 1)), ((5, 42, 1), (5, 1, 3)),
    ((3, 2, 1, 8), (2, 8, 8)), ((3, 2, 1, 8), (3, 2, 8, 1)), ((1, 50), (4, 50, 8)), ((4, 1, 6, 5), (3, 5, 2)),
    ((2, 3, 0), (2, 0, 4)),
])
def test_small_matmul_matches_numpy(a, b):
    fa, fb = RNG.normal(size=a).astype(np.float32), RNG.normal(size=b).astype(np.float32)
    s = kernel_session([onnx.helper.make_node("SmallMatMul", ["a", "b"], ["y"], domain=kernels.DOMAIN)],
                 [vi("a", F, None), vi("b", F, None)])
    got, want = s.run(None, {"a": fa, "b": fb})[0], np.matmul(fa.astype(np.float64), fb)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [(50,), (50, 1), (50, 3), (50, 4), (50, 8), (50, 12), (50, 16), (50, 2, 5), (50, 0)])
@pytest.mark.parametrize("ids_type", [np.int64, np.int32])
def test_gather_rows_matches_numpy(rows, ids_type):
    table = RNG.normal(size=rows).astype(np.float32)
    ids = RNG.integers(-rows[0], rows[0], (4, 7)).astype(ids_type)
    s = kernel_session([onnx.helper.make_node("GatherRows", ["t", "ids"], ["y"], domain=kernels.DOMAIN)],
                 [vi("ids", I64 if ids_type == np.int64 else I32, None)], [init("t", table)])
    np.testing.assert_array_equal(s.run(None, {"ids": ids})[0], table[ids])


@pytest.mark.parametrize("ids_type", [np.int64, np.int32])
def test_gather_rows_adds_per_column_offsets(ids_type):
    table, offsets = RNG.normal(size=(60, 8)).astype(np.float32), np.array([0, 20, 45], ids_type)
    ids = RNG.integers(-15, 15, (50, 3)).astype(ids_type)   # 150 indices in 64 blocks: rows cross blocks
    s = kernel_session([onnx.helper.make_node("GatherRows", ["t", "ids", "off"], ["y"], domain=kernels.DOMAIN)],
                       [vi("ids", I64 if ids_type == np.int64 else I32, None)],
                       [init("t", table), init("off", offsets)])
    np.testing.assert_array_equal(s.run(None, {"ids": ids})[0], table[ids + offsets])
    with pytest.raises(Exception, match="offsets must be"):
        s.run(None, {"ids": ids[:, :2]})
    with pytest.raises(Exception, match="idx=60 must be"):   # the index with its offset, as Add then Gather says
        s.run(None, {"ids": np.array([[0, 0, 15]], ids_type)})


def fused_lookup(expanded=True):
    """fuse-parallel-embeddings' lookup: two tables read at the fields' ids plus per-field offsets (Expanded)."""
    off = ["offx"] if expanded else ["off"]
    nodes = ([node("Shape", ["ids"], ["s"]), node("Expand", ["off", "s"], ["offx"])] if expanded else []) + [
        node("Add", ["ids"] + off, ["at"]), node("Gather", ["w8", "at"], ["y8"]), node("Gather", ["w1", "at"], ["y1"])]
    return make_model(nodes, [vi("ids", I32, ["batch", 3])], [vi("y8", F, None), vi("y1", F, None)],
                      [init("w8", RNG.normal(size=(60, 8)).astype(np.float32)),
                       init("w1", RNG.normal(size=(60, 1)).astype(np.float32)),
                       init("off", np.array([0, 20, 45], np.int32))])


@pytest.mark.parametrize("expanded", [True, False])
def test_lookups_at_offset_ids_take_the_offsets(expanded):
    f = {"ids": RNG.integers(0, 15, (4, 3)).astype(np.int32)}
    done, _ = check_pass(fused_lookup(expanded), "gather-rows-kernel", ["GatherRows", "GatherRows"], feeds=f)
    assert all(len(n.input) == 3 for n in done.graph.node)


def test_the_kernels_refuse_what_does_not_fit():
    s = kernel_session([onnx.helper.make_node("GatherRows", ["t", "ids"], ["y"], domain=kernels.DOMAIN)],
                 [vi("ids", I64, None)], [init("t", np.ones((10, 4), np.float32))])
    with pytest.raises(Exception, match="out of data bounds"):
        s.run(None, {"ids": np.array([[1, 10]], np.int64)})
    s = kernel_session([onnx.helper.make_node("GatherRows", ["t", "ids"], ["y"], domain=kernels.DOMAIN)],
                 [vi("ids", I64, None)], [init("t", np.ones((3, 0), np.float32))])
    with pytest.raises(Exception, match="out of data bounds"):   # rows of no floats: the index is checked still
        s.run(None, {"ids": np.array([5], np.int64)})
    s = kernel_session([onnx.helper.make_node("SmallMatMul", ["a", "b"], ["y"], domain=kernels.DOMAIN)],
                 [vi("a", F, None), vi("b", F, None)])
    with pytest.raises(Exception, match="do not broadcast"):
        s.run(None, {"a": np.ones((2, 3, 4), np.float32), "b": np.ones((3, 4, 5), np.float32)})
    with pytest.raises(Exception, match="columns differ"):
        s.run(None, {"a": np.ones((2, 3, 4), np.float32), "b": np.ones((2, 5, 5), np.float32)})


def test_without_the_library_standard_ops_and_a_note(monkeypatch):
    monkeypatch.setattr(kernels, "ensure", lambda: "no gcc")
    for model, name in ((fm_sum_torch(), "small-products-kernel"), (lookups(), "gather-rows-kernel")):
        done, ctx = run_pass(model, name)
        assert ctx.rewrites == 0 and any("not available" in n for n in ctx.notes)


def dedup_key():
    """dedup-user-side's key: Unique(axis=0, sorted=0) over [B, K] int64 rows; the first indices and the inverse read."""
    nodes = [node("Unique", ["key"], ["u", "first", "inverse", "counts"], axis=0, sorted=0),
             node("Gather", ["key", "first"], ["distinct"], axis=0), node("Gather", ["distinct", "inverse"], ["y"], axis=0)]
    return make_model(nodes, [vi("key", I64, ["batch", 5])], [vi("y", I64, ["batch", 5]), vi("counts", I64, None)])


def test_unique_rows_of_the_dedup_key():
    f = {"key": RNG.integers(0, 3, (9, 5))}
    f["key"][4] = f["key"][1]
    check_pass(dedup_key(), "unique-rows-kernel", ["UniqueRows", "Gather", "Gather"], feeds=f)
    sorted_model = dedup_key()
    sorted_model.graph.node[0].attribute[1].i = 1   # sorted=1: the kernel keeps first occurrences' order only
    done, ctx = run_pass(sorted_model, "unique-rows-kernel")
    assert ctx.rewrites == 0


@pytest.mark.parametrize("one_user", [False, True])
def test_unique_rows_reads_the_parts_of_a_concatenated_key(one_user):
    """dedup-user-side's key is a Concat of the user's ids and histories ([B, 1], [B, 3], [B, 2]): UniqueRows reads
    the parts in place, the Concat goes; the four outputs as onnxruntime's Unique (Y the concatenated rows)."""
    nodes = [node("Concat", ["a", "b", "c"], ["key"], axis=1),
             node("Unique", ["key"], ["u", "first", "inverse", "counts"], axis=0, sorted=0)]
    model = make_model(nodes, [vi("a", I64, ["batch", 1]), vi("b", I64, ["batch", 3]), vi("c", I64, ["batch", 2])],
                       [vi(x, I64, None) for x in ("u", "first", "inverse", "counts")])
    f = {k: RNG.integers(0, 2, (11, w)) for k, w in (("a", 1), ("b", 3), ("c", 2))}
    if one_user:
        f = {k: np.repeat(v[:1], 11, axis=0) for k, v in f.items()}
    out, _ = check_pass(model, "unique-rows-kernel", ["UniqueRows"], feeds=f)
    assert len(out.graph.node[0].input) == 3


@pytest.mark.parametrize("dtype", [np.int64, np.float32])   # float32: UniqueRowsFloat (integral values: no -0, NaN)
@pytest.mark.parametrize("rows", ["distinct", "repeated", "one user", "empty"])   # no columns: onnxruntime aborts
def test_unique_rows_matches_onnxruntime(rows, dtype):
    x = RNG.integers(0, 4, (40, 7)).astype(dtype)
    t, op = (I64, "UniqueRows") if dtype == np.int64 else (F, "UniqueRowsFloat")
    if rows == "repeated":
        x = x[RNG.integers(0, 6, 40)]
    elif rows == "one user":
        x[:] = x[0]
    elif rows == "empty":
        x = x[:0]
    outs = ["y", "first", "inverse", "counts"]
    graph = onnx.helper.make_graph([onnx.helper.make_node("Unique", ["x"], outs, axis=0, sorted=0)], "u",
                                   [vi("x", t, None)], [vi("y", t, None)] + [vi(n, I64, None) for n in outs[1:]])
    want = ort.InferenceSession(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
                                .SerializeToString()).run(None, {"x": x})
    graph = onnx.helper.make_graph([onnx.helper.make_node(op, ["x"], outs, domain=kernels.DOMAIN)], "k",
                                   [vi("x", t, None)], [vi("y", t, None)] + [vi(n, I64, None) for n in outs[1:]])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17),
                                                         onnx.helper.make_opsetid(kernels.DOMAIN, 1)])
    so = ort.SessionOptions()
    kernels.register(so)
    got = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_ort_kernels_off_keeps_standard_ops():
    from ctropt.passes import optimize

    result = optimize(lookups(), speed=False, options={"ort_kernels": "off"})
    assert not any(n.domain == kernels.DOMAIN for n in result.model.graph.node)
    with pytest.raises(Exception, match="ort_kernels must be auto or off"):
        run_pass(lookups(), "gather-rows-kernel", ort_kernels="no")


def test_only_onnx_domain_ops_are_taken():
    model = lookups()
    model.graph.node[0].domain = "com.example"
    model.opset_import.append(onnx.helper.make_opsetid("com.example", 1))
    done, ctx = run_pass(model, "gather-rows-kernel")
    assert ops(done).count("GatherRows") == 1   # the other float lookup only


def positions_and_shape_arithmetic():
    """remove-attention-padding's positions: an int64 vector of dynamic length gathered at positions; and a Gather
    of a Shape (static length: shape arithmetic onnxruntime folds), which stays."""
    nodes = [node("Gather", ["rows", "at"], ["picked"]), node("Shape", ["rows"], ["n"]),
             node("Gather", ["n", "zero"], ["n0"], axis=0), node("Unsqueeze", ["n0", "zero1"], ["n1"]),
             node("Concat", ["n1", "picked"], ["y"], axis=0)]
    return make_model(nodes, [vi("rows", I64, ["m"]), vi("at", I64, ["k"])], [vi("y", I64, None)],
                      [init("zero", np.array(0)), init("zero1", np.array([0]))])


def test_int64_positions_of_dynamic_length_but_not_shape_arithmetic():
    f = {"rows": RNG.integers(0, 100, 12), "at": np.array([3, -1, 0, 11])}
    done, _ = check_pass(positions_and_shape_arithmetic(), "gather-rows-kernel",
                         ["GatherRowsInt64", "Shape", "Gather", "Unsqueeze", "Concat"], feeds=f)


@pytest.mark.parametrize("table", [(50,), (50, 3)])
def test_gather_rows_int64_matches_numpy(table):
    values = RNG.integers(-2**62, 2**62, table)
    ids = RNG.integers(-50, 50, (4, 7))
    s = kernel_session([onnx.helper.make_node("GatherRowsInt64", ["t", "ids"], ["y"], domain=kernels.DOMAIN)],
                 [vi("ids", I64, None)], [init("t", values)], out_type=I64)
    np.testing.assert_array_equal(s.run(None, {"ids": ids})[0], values[ids])


def test_unique_rows_float_compares_bits():
    """-0 and 0 are two rows (deduplication needs only that rows found equal are equal values); a NaN row is one."""
    outs = ["y", "first", "inverse", "counts"]
    graph = onnx.helper.make_graph([onnx.helper.make_node("UniqueRowsFloat", ["x"], outs, domain=kernels.DOMAIN)], "k",
                                   [vi("x", F, None)], [vi("y", F, None)] + [vi(n, I64, None) for n in outs[1:]])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17),
                                                         onnx.helper.make_opsetid(kernels.DOMAIN, 1)])
    so = ort.SessionOptions()
    kernels.register(so)
    s = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    x = np.array([[0.0, 1.0], [-0.0, 1.0], [np.nan, 2.0], [np.nan, 2.0], [0.0, 1.0]], np.float32)
    y, first, inverse, counts = s.run(None, {"x": x})
    assert first.tolist() == [0, 1, 2] and inverse.tolist() == [0, 1, 2, 2, 0] and counts.tolist() == [2, 1, 2]
    np.testing.assert_array_equal(y, x[[0, 1, 2]])
