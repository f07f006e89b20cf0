"""fuse-fc: MatMul(+Add)(+activation) → Gemm at rank 2, flattened at rank 3 for onnxruntime, in the exporters'
dialects (plain MatMul+Add, bias first, [1, N] bias, TF tensordot's Reshape before the bias, no bias)."""

import numpy as np
import pytest

import ctropt
from ctropt.graph import interface
from helpers import F, I64, assert_same_outputs, check_pass, init, make_model, node, ops, run_pass, vi

RNG = np.random.default_rng(0)


def _w(k, n):
    return (RNG.normal(size=(k, n)) / np.sqrt(k)).astype(np.float32)


def _b(*shape):
    return RNG.normal(size=shape).astype(np.float32)


def _feeds(shape):
    return {"x": RNG.normal(size=shape).astype(np.float32)}


def test_rank2_bias_and_relu_become_gemm_and_relu_in_either_operand_order():
    model = make_model(
        [node("MatMul", ["x", "w1"], ["m1"]), node("Add", ["b1", "m1"], ["a1"]), node("Relu", ["a1"], ["r1"]),
         node("MatMul", ["r1", "w2"], ["m2"]), node("Add", ["m2", "b2"], ["y"])],
        [vi("x", F, ["B", 8])], [vi("y", F, ["B", 3])],
        [init("w1", _w(8, 16)), init("b1", _b(1, 16)), init("w2", _w(16, 3)), init("b2", _b(3))])
    out, ctx = check_pass(model, "fuse-fc", ["Gemm", "Relu", "Gemm"], feeds=_feeds((5, 8)))
    assert ctx.rewrites == 2
    assert_same_outputs(model, out, _feeds((1, 8)), atol=0, rtol=0)


def test_no_bias_with_activation_fuses_a_lone_matmul_does_not():
    model = make_model(
        [node("MatMul", ["x", "w1"], ["m1"]), node("Sigmoid", ["m1"], ["s"]), node("MatMul", ["s", "w2"], ["y"])],
        [vi("x", F, ["B", 8])], [vi("y", F, ["B", 4])], [init("w1", _w(8, 6)), init("w2", _w(6, 4))])
    check_pass(model, "fuse-fc", ["Gemm", "Sigmoid", "MatMul"], feeds=_feeds((3, 8)))


def test_rank3_chain_is_flattened_once_for_ort_with_dynamic_dims():
    """DIN's attention MLP on [B, T, 4C]: one Reshape in, Gemm+activation per layer, one Reshape out."""
    model = make_model(
        [node("MatMul", ["x", "w1"], ["m1"]), node("Add", ["m1", "b1"], ["a1"]), node("Relu", ["a1"], ["r1"]),
         node("MatMul", ["r1", "w2"], ["m2"]), node("Add", ["m2", "b2"], ["a2"]), node("Sigmoid", ["a2"], ["r2"]),
         node("MatMul", ["r2", "w3"], ["m3"]), node("Add", ["m3", "b3"], ["y"])],
        [vi("x", F, ["B", "T", 12])], [vi("y", F, ["B", "T", 1])],
        [init("w1", _w(12, 8)), init("b1", _b(8)), init("w2", _w(8, 4)), init("b2", _b(1, 1, 4)),
         init("w3", _w(4, 1)), init("b3", _b(1))])
    out, _ = check_pass(model, "fuse-fc", ["Reshape", "Gemm", "Relu", "Gemm", "Sigmoid", "Gemm", "Shape", "Slice",
                                           "Concat", "Reshape"], feeds=_feeds((3, 5, 12)))
    for shape in [(1, 1, 12), (7, 2, 12), (0, 4, 12)]:
        assert_same_outputs(model, out, _feeds(shape))
    assert interface(out) == interface(model)  # B and T stay symbolic


def test_rank3_is_left_alone_for_openvino():
    model = make_model([node("MatMul", ["x", "w"], ["m"]), node("Add", ["m", "b"], ["y"])],
                       [vi("x", F, ["B", "T", 6])], [vi("y", F, ["B", "T", 4])], [init("w", _w(6, 4)), init("b", _b(4))])
    out, ctx = run_pass(model, "fuse-fc", target="openvino")
    assert ops(out) == ["MatMul", "Add"] and ctx.rewrites == 0


def test_tensordot_reshape_between_product_and_bias():
    """tf2onnx's Keras Dense (tensordot): MatMul → Reshape to the input's leading dims → Add bias → Relu; on a 2-D
    input that Reshape lists the product's own sizes, and goes."""
    model = make_model(
        [node("Shape", ["x"], ["s"]), node("Gather", ["s", "zero"], ["b0"], axis=0),
         node("Unsqueeze", ["b0", "ax0"], ["b1"]), node("Concat", ["b1", "n"], ["shape"], axis=0),
         node("MatMul", ["x", "w"], ["m"]), node("Reshape", ["m", "shape"], ["r"]), node("Add", ["r", "b"], ["a"]),
         node("Relu", ["a"], ["y"])],
        [vi("x", F, ["B", 6])], [vi("y", F, ["B", 5])],
        [init("w", _w(6, 5)), init("b", _b(5)), init("zero", np.array(0, np.int64)), init("ax0", np.array([0])),
         init("n", np.array([5], np.int64))])
    check_pass(model, "fuse-fc", ["Gemm", "Relu"], feeds=_feeds((4, 6)))


@pytest.mark.parametrize("act", ["PRelu", "Dice"])
def test_activation_a_gemm_cannot_absorb_stays_exact(act):
    """PReLU and Dice (x·p + α·x·(1-p), p = sigmoid of the normalized x) follow the Gemm unchanged."""
    tail = ([node("PRelu", ["a"], ["y"], )] if act == "PRelu" else
            [node("Sub", ["a", "mean"], ["c"]), node("Mul", ["c", "inv_std"], ["z"]), node("Sigmoid", ["z"], ["p"]),
             node("Mul", ["a", "p"], ["xp"]), node("Sub", ["one", "p"], ["q"]), node("Mul", ["q", "alpha"], ["aq"]),
             node("Mul", ["aq", "a"], ["xq"]), node("Add", ["xp", "xq"], ["y"])])
    if act == "PRelu":
        tail[0].input.append("alpha")
    model = make_model([node("MatMul", ["x", "w"], ["m"]), node("Add", ["m", "b"], ["a"])] + tail,
                       [vi("x", F, ["B", 6])], [vi("y", F, ["B", 4])],
                       [init("w", _w(6, 4)), init("b", _b(4)), init("alpha", _b(4)), init("mean", _b(4)),
                        init("inv_std", np.abs(_b(4))), init("one", np.ones(1, np.float32))])
    out, _ = check_pass(model, "fuse-fc", ["Gemm"] + [n.op_type for n in tail], feeds=_feeds((5, 6)))
    assert_same_outputs(model, out, _feeds((9, 6)), atol=0, rtol=0)


def test_not_a_per_column_bias_or_shared_product_is_left():
    model = make_model(
        [node("MatMul", ["x", "w"], ["m"]), node("Add", ["m", "rows"], ["y"]), node("Neg", ["m"], ["z"]),
         node("MatMul", ["x", "w2"], ["m2"]), node("Add", ["m2", "col"], ["u"])],
        [vi("x", F, ["B", 6])], [vi("y", F, ["B", 4]), vi("z", F, ["B", 4]), vi("u", F, [3, 4])],
        [init("w", _w(6, 4)), init("rows", _b(3, 1)), init("w2", _w(6, 4)), init("col", _b(3, 4))])
    out, ctx = run_pass(model, "fuse-fc")
    assert ctx.rewrites == 0 and sorted(ops(out)) == sorted(ops(model))


def test_integer_matmul_is_not_an_fc():
    model = make_model([node("MatMul", ["x", "w"], ["m"]), node("Add", ["m", "b"], ["y"])],
                       [vi("x", I64, ["B", 3])], [vi("y", I64, ["B", 2])],
                       [init("w", np.ones((3, 2), np.int64)), init("b", np.ones(2, np.int64))])
    assert run_pass(model, "fuse-fc")[1].rewrites == 0


def _dice_after_fc(trans_b: int = 0, seed: int = 0, k: int = 3, h: int = 5):
    """x → Gemm → Dice with its BatchNormalization folded (·s + t per column, then the sigmoid mix reads x)."""
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(k, h)).astype(np.float32)
    nodes = [node("Gemm", ["x", "w", "b"], ["h"], transB=trans_b),
             node("Mul", ["h", "s"], ["hs"]),
             node("Add", ["hs", "t"], ["z"]),
             node("Sigmoid", ["z"], ["p"]),
             node("Mul", ["p", "h"], ["y"])]
    inits = [init("w", w.T.copy() if trans_b else w), init("b", rng.normal(size=h).astype(np.float32)),
             init("s", rng.normal(size=(1, h)).astype(np.float32)), init("t", rng.normal(size=h).astype(np.float32))]
    return make_model(nodes, [vi("x", F, ["rows", k])], [vi("y", F, ["rows", h])], inits)


@pytest.mark.parametrize("trans_b", [0, 1])
def test_per_column_affine_after_an_fc_becomes_a_second_gemm(trans_b):
    model = _dice_after_fc(trans_b)
    once, ctx = run_pass(model, "fold-fc-affine")
    assert ctx.rewrites == 1
    assert sorted(ops(once)) == sorted(["Gemm", "Gemm", "Sigmoid", "Mul"])  # the FC read as is, and ·s + t folded
    for rows in (1, 4, 9):
        feeds = {"x": np.random.default_rng(rows).normal(size=(rows, 3)).astype(np.float32)}
        assert_same_outputs(model, once, feeds, atol=1e-5, rtol=1e-5)
    twice, ctx2 = run_pass(once, "fold-fc-affine")
    assert ctx2.rewrites == 0 and ops(twice) == ops(once)


def test_a_second_gemm_over_a_large_layer_is_not_made():
    """[256, 200 → 80] (the zoo DIEN's top MLP with Dice): Gemm + Mul + Add 93 µs, two Gemms 155 µs."""
    model = _dice_after_fc(k=200, h=80)
    once, ctx = run_pass(model, "fold-fc-affine")
    assert ctx.rewrites == 0 and ops(once) == ops(model)
    misses = ctropt.REGISTRY["fold-fc-affine"].misses(ctropt.graph.to_graph(model), "ort")
    assert any("second Gemm (200 × 80)" in m for m in misses), misses


def test_scale_that_is_not_per_column_stays():
    model = _dice_after_fc()
    s = next(t for t in model.graph.initializer if t.name == "s")
    s.CopyFrom(init("s", np.ones((4, 5), np.float32)))
    once, ctx = run_pass(model, "fold-fc-affine")
    assert ctx.rewrites == 0 and ops(once) == ops(model)


def _wdl_tf2onnx():
    """deepctr WDL through tf2onnx: deep logit MatMul(h, Wd); wide part a ReduceSum over [B, 1, F] lookups (no
    keepdims) + MatMul(dense, w); summed, then the bias Add → Sigmoid. The inputs have their own batch symbols:
    the Concat that makes the deep input (embeddings, dense values, the wide rows) proves their rows one size."""
    return make_model(
        [node("Reshape", ["e", "flat"], ["ef"]), node("Reshape", ["wide", "five"], ["wide_rows"]),
         node("Concat", ["ef", "dense", "wide_rows"], ["x"], axis=1),
         node("Gemm", ["x", "w1", "b1"], ["g1"]), node("Relu", ["g1"], ["h"]),
         node("MatMul", ["h", "wd"], ["deep"]),
         node("ReduceSum", ["wide", "ax"], ["wsum"], keepdims=0), node("MatMul", ["dense", "wl"], ["lin"]),
         node("Add", ["wsum", "lin"], ["linear"]), node("Add", ["deep", "linear"], ["logit"]),
         node("Add", ["logit", "bias"], ["z"]), node("Sigmoid", ["z"], ["y"])],
        [vi("e", F, ["unk_1", 3, 4]), vi("dense", F, ["unk_2", 2]), vi("wide", F, ["unk_3", 1, 5])],
        [vi("y", F, ["unk_4", 1])],
        [init("flat", np.array([-1, 12])), init("five", np.array([-1, 5])), init("w1", _w(19, 8)), init("b1", _b(8)),
         init("wd", _w(8, 1)), init("ax", np.array([2])), init("wl", _w(2, 1)), init("bias", _b(1))])


def _feeds_wdl(batch=6):
    return {"e": RNG.normal(size=(batch, 3, 4)).astype(np.float32), "dense": _b(batch, 2), "wide": _b(batch, 1, 5)}


def test_wide_and_deep_logits_and_bias_become_one_chain_of_gemms():
    model = _wdl_tf2onnx()
    once, ctx = check_pass(model, "sum-into-gemm", ["Reshape", "Reshape", "Concat", "Gemm", "Relu", "Gemm", "Gemm",
                                                    "Gemm", "Sigmoid"], feeds=_feeds_wdl())
    assert ctx.rewrites == 1 and "Add" not in ops(once) and "ReduceSum" not in ops(once)
    first = next(n for n in once.graph.node if n.op_type == "Gemm" and n.input[0] == "h")
    assert first.input[2].endswith("bias")   # the constants are the first Gemm's bias, as fuse-fc makes it
    assert_same_outputs(model, once, _feeds_wdl(1), atol=1e-6, rtol=1e-6)


def test_paddle_wide_plus_deep_gemms_chain_and_a_value_is_added_after_the_biased_gemm():
    """PaddleRec WideDeep: Gemm(dense, w, b) + Gemm(h, w3, b3) → Sigmoid; with a third, non-linear term."""
    model = make_model(
        [node("Gemm", ["x", "w1", "b1"], ["h"]), node("Relu", ["h"], ["r"]), node("Gemm", ["r", "w3", "b3"], ["deep"]),
         node("Gemm", ["x", "w0", "b0"], ["wide"]), node("Add", ["wide", "deep"], ["s"]),
         node("Tanh", ["x0"], ["t"]), node("Add", ["s", "t"], ["z"]), node("Sigmoid", ["z"], ["y"])],
        [vi("x", F, ["B", 6]), vi("x0", F, ["B", 1])], [vi("y", F, ["B", 1])],
        [init("w1", _w(6, 4)), init("b1", _b(4)), init("w3", _w(4, 1)), init("b3", _b(1)), init("w0", _w(6, 1)),
         init("b0", _b(1))])
    once, ctx = check_pass(model, "sum-into-gemm", ["Gemm", "Relu", "Gemm", "Add", "Gemm", "Tanh", "Sigmoid"],
                           feeds={"x": _b(5, 6), "x0": _b(5, 1)})
    assert ctx.rewrites == 1


def test_a_sum_whose_rows_are_not_proven_one_size_stays():
    """Two inputs with their own batch symbols and nothing joining them: C might not broadcast to the Gemm's rows."""
    model = make_model(
        [node("MatMul", ["x", "w"], ["m"]), node("Add", ["m", "v"], ["y"])],
        [vi("x", F, ["B1", 4]), vi("v", F, ["B2", 3])], [vi("y", F, ["B2", 3])], [init("w", _w(4, 3))])
    once, ctx = run_pass(model, "sum-into-gemm")
    assert ctx.rewrites == 0 and ops(once) == ["MatMul", "Add"]


def test_sum_into_gemm_before_opset_11_gives_each_gemm_a_c_and_a_scalar_value_is_a_term():
    """Gemm's C is required before opset 11 (a zero bias then); a rank-0 value broadcasts like a constant."""
    model = make_model(
        [node("MatMul", ["x", "w1"], ["a"]), node("MatMul", ["x", "w2"], ["b"]), node("Add", ["a", "b"], ["y"])],
        [vi("x", F, ["B", 4])], [vi("y", F, ["B", 3])], [init("w1", _w(4, 3)), init("w2", _w(4, 3))])
    model.opset_import[0].version = 10
    once, ctx = check_pass(model, "sum-into-gemm", ["Gemm", "Gemm"], feeds=_feeds((5, 4)))
    assert all(len(n.input) == 3 for n in once.graph.node)
    scalar = make_model(
        [node("MatMul", ["x", "w1"], ["a"]), node("ReduceSum", ["x"], ["s"], keepdims=0), node("Add", ["a", "s"], ["y"])],
        [vi("x", F, ["B", 4])], [vi("y", F, ["B", 3])], [init("w1", _w(4, 3))])
    check_pass(scalar, "sum-into-gemm", ["ReduceSum", "Gemm"], feeds=_feeds((5, 4)))


def test_deepctr_torch_linear_logit_starts_from_zeros_of_the_batch():
    """deepctr-torch: the linear logit is ConstantOfShape(0) of [B, 1] (B read from X's Shape) plus the wide parts;
    the zeros add nothing where their rows are X's (proven) and go with the Adds."""
    model = make_model(
        [node("Shape", ["X"], ["s"], end=1), node("Concat", ["s", "one"], ["zs"], axis=0),
         node("ConstantOfShape", ["zs"], ["zeros"]), node("Slice", ["X", "c0", "c2", "ax1"], ["d"]),
         node("MatMul", ["d", "wl"], ["lin"]), node("Add", ["zeros", "lin"], ["a"]),
         node("Slice", ["X", "c2", "c6", "ax1"], ["h"]), node("MatMul", ["h", "wd"], ["deep"]),
         node("Add", ["a", "deep"], ["z"]), node("Add", ["z", "bias"], ["y"])],
        [vi("X", F, ["batch", 6])], [vi("y", F, ["batch", 1])],
        [init("one", np.array([1])), init("c0", np.array([0])), init("c2", np.array([2])), init("c6", np.array([6])),
         init("ax1", np.array([1])), init("wl", _w(2, 1)), init("wd", _w(4, 1)), init("bias", _b(1))])
    model.opset_import[0].version = 17
    once, ctx = check_pass(model, "sum-into-gemm", ["Slice", "Slice", "Gemm", "Gemm"], feeds={"X": _b(5, 6)})
    assert ctx.rewrites == 1
    wider = make_model(   # zeros of [B, 3] would widen a [B, 1] sum: kept
        [node("ConstantOfShape", ["zs"], ["zeros"]), node("MatMul", ["X", "w"], ["m"]), node("Add", ["zeros", "m"], ["y"])],
        [vi("X", F, ["batch", 6])], [vi("y", F, ["batch", 3])], [init("zs", np.array([5, 3])), init("w", _w(6, 1))])
    out, ctx = run_pass(wider, "sum-into-gemm")
    assert ctx.rewrites == 0
    rows = make_model(   # zeros of [3, 1] beside a [B, 3] layer: at B = 1 they set the rows (3): kept
        [node("ConstantOfShape", ["zs"], ["zeros"]), node("MatMul", ["X", "w"], ["m"]), node("Add", ["zeros", "m"], ["y"])],
        [vi("X", F, ["batch", 6])], [vi("y", F, [3, 3])], [init("zs", np.array([3, 1])), init("w", _w(6, 3))])
    out, ctx = run_pass(rows, "sum-into-gemm")
    assert ctx.rewrites == 0
