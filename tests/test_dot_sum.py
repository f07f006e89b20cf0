"""dot-sum-kernel: width-1 GEMMs → ctropt's DotSum kernel. The kernel against numpy; the chains sum-into-gemm makes
(deepctr's WDL logit: deep head, wide sum, dense part, bias, then a Sigmoid), torch's Gemm head with transB and
alpha/beta, PaddleRec DCN's MatMul by a [D, 1] vector, a C that is another value; what stays."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from helpers import F, check_pass, init, kernel_session, make_model, node, ops, run_pass, vi

from ctropt import kernels

RNG = np.random.default_rng(11)


def _sigmoid(v):
    return 1 / (1 + np.exp(-v.astype(np.float64)))


@pytest.mark.parametrize("widths,rows,sigmoid", [
    ([47, 16], 256, 1), ([3], 5, 0), ([8, 1, 24, 7], 37, 1), ([221], 256, 0), ([5, 9], 0, 1), ([1], 1, 1),
])
def test_dot_sum_matches_numpy(widths, rows, sigmoid):
    xs = [RNG.normal(size=(rows, k)).astype(np.float32) for k in widths]
    ws = [RNG.normal(size=k).astype(np.float32) for k in widths]
    names = [f"{c}{i}" for i in range(len(widths)) for c in "xw"]
    s = kernel_session([onnx.helper.make_node("DotSum", ["b"] + names, ["y"], domain=kernels.DOMAIN, sigmoid=sigmoid)],
                       [vi("b", F, None)] + [vi(n, F, None) for n in names])
    feeds = {"b": np.array([0.25], np.float32)} | {f"x{i}": x for i, x in enumerate(xs)} | \
        {f"w{i}": w for i, w in enumerate(ws)}
    want = 0.25 + sum(x.astype(np.float64) @ w for x, w in zip(xs, ws))
    want = (_sigmoid(want) if sigmoid else want)[:, None]
    got = s.run(None, feeds)[0]
    assert got.shape == (rows, 1)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


def test_dot_sum_keeps_leading_dims_and_checks_sizes():
    s = kernel_session([onnx.helper.make_node("DotSum", ["b", "x", "w"], ["y"], domain=kernels.DOMAIN)],
                       [vi(n, F, None) for n in "bxw"])
    x, w = RNG.normal(size=(2, 3, 10)).astype(np.float32), RNG.normal(size=10).astype(np.float32)
    np.testing.assert_allclose(s.run(None, {"b": np.zeros(1, np.float32), "x": x, "w": w})[0], (x @ w)[..., None],
                               rtol=1e-5, atol=1e-6)
    with pytest.raises(Exception, match="last dim"):
        s.run(None, {"b": np.zeros(1, np.float32), "x": x, "w": w[:9]})
    with pytest.raises(Exception, match="one value"):
        s.run(None, {"b": np.zeros(2, np.float32), "x": x, "w": w})
    two = kernel_session([onnx.helper.make_node("DotSum", ["b", "x", "w", "z", "v"], ["y"], domain=kernels.DOMAIN)],
                         [vi(n, F, None) for n in "bxwzv"])
    with pytest.raises(Exception, match="rows differ"):
        two.run(None, {"b": np.zeros(1, np.float32), "x": x, "w": w, "z": np.ones((5, 2), np.float32),
                       "v": np.ones(2, np.float32)})


def wdl_logit(sigmoid=True):
    """deepctr WDL after sum-into-gemm: Gemm(deep, W, bias) → Gemm(wide, ones, ·) → Gemm(dense, W2, ·) → Sigmoid;
    its three inputs with their own batch symbols, joined by a Concat as the DNN input joins them."""
    nodes = [node("Concat", ["deep_in", "wide", "dense"], ["cat"], axis=1), node("Gemm", ["cat", "W0"], ["deep"]),
             node("Gemm", ["deep", "Wd", "bias"], ["g0"]), node("Gemm", ["wide", "ones", "g0"], ["g1"]),
             node("Gemm", ["dense", "Wx", "g1"], ["logit"])]
    nodes += [node("Sigmoid", ["logit"], ["y"])] if sigmoid else []
    return make_model(nodes, [vi("deep_in", F, ["a", 6]), vi("wide", F, ["b", 5]), vi("dense", F, ["c", 2])],
                      [vi("y" if sigmoid else "logit", F, ["a", 1])],
                      [init("W0", RNG.normal(size=(13, 16)).astype(np.float32)),
                       init("Wd", RNG.normal(size=(16, 1)).astype(np.float32)), init("bias", np.array([0.3], np.float32)),
                       init("ones", np.ones((5, 1), np.float32)), init("Wx", RNG.normal(size=(2, 1)).astype(np.float32))])


def _feeds(rows=9):
    return {"deep_in": RNG.normal(size=(rows, 6)).astype(np.float32),
            "wide": RNG.normal(size=(rows, 5)).astype(np.float32), "dense": RNG.normal(size=(rows, 2)).astype(np.float32)}


@pytest.mark.parametrize("sigmoid", [True, False])
def test_a_logit_chain_becomes_one_kernel(sigmoid):
    done, ctx = check_pass(wdl_logit(sigmoid), "dot-sum-kernel", ["Concat", "Gemm", "DotSum"], feeds=_feeds())
    dot = next(n for n in done.graph.node if n.op_type == "DotSum")
    assert len(dot.input) == 7 and onnx.helper.get_attribute_value(dot.attribute[0]) == int(sigmoid)
    assert done.graph.output[0].name == ("y" if sigmoid else "logit")


def torch_head():
    """deepctr-torch's head: Gemm(h, W [1, K], transB, alpha 2), C the linear logit [B, 1] (another value), beta 0.5,
    its output also read by a Relu (the Sigmoid then stays)."""
    nodes = [node("Gemm", ["x", "Wl"], ["lin"]), node("Relu", ["x"], ["h"]),
             node("Gemm", ["h", "W", "lin"], ["logit"], transB=1, alpha=2.0, beta=0.5),
             node("Sigmoid", ["logit"], ["y"]), node("Relu", ["logit"], ["z"])]
    return make_model(nodes, [vi("x", F, ["batch", 7])], [vi("y", F, ["batch", 1]), vi("z", F, ["batch", 1])],
                      [init("Wl", RNG.normal(size=(7, 1)).astype(np.float32)),
                       init("W", RNG.normal(size=(1, 7)).astype(np.float32))])


def test_a_head_with_trans_b_alpha_beta_and_a_value_c():
    feeds = {"x": RNG.normal(size=(8, 7)).astype(np.float32)}
    done, _ = check_pass(torch_head(), "dot-sum-kernel", ["Relu", "DotSum", "Sigmoid", "Relu"], feeds=feeds)
    dot = next(n for n in done.graph.node if n.op_type == "DotSum")
    assert len(dot.input) == 5   # bias, then (h, W·2) and (x, Wl·0.5): the linear logit's Gemm is a link below


def test_a_cross_layer_projection_becomes_the_kernel():
    """PaddleRec DCN: s = x0 · w ([D, 1] by MatMul), then x0 * s + x0."""
    d = 13
    nodes = [node("MatMul", ["x0", "w"], ["s"]), node("Mul", ["x0", "s"], ["p"]), node("Add", ["p", "x0"], ["y"])]
    model = make_model(nodes, [vi("x0", F, ["batch", d])], [vi("y", F, ["batch", d])],
                       [init("w", RNG.normal(size=(d, 1)).astype(np.float32))])
    check_pass(model, "dot-sum-kernel", ["DotSum", "Mul", "Add"], feeds={"x0": RNG.normal(size=(5, d)).astype(np.float32)})


def test_what_stays():
    wide = make_model([node("Gemm", ["x", "W"], ["y"])], [vi("x", F, ["batch", 4])], [vi("y", F, ["batch", 2])],
                      [init("W", np.ones((4, 2), np.float32))])   # two columns
    assert ops(run_pass(wide, "dot-sum-kernel")[0]) == ["Gemm"]
    # rows not proven one size: the C's batch is its own symbol, nothing joins it to x's
    other = make_model([node("Gemm", ["x", "W", "c"], ["y"])], [vi("x", F, ["a", 4]), vi("c", F, ["b", 1])],
                       [vi("y", F, ["a", 1])], [init("W", np.ones((4, 1), np.float32))])
    assert ops(run_pass(other, "dot-sum-kernel")[0]) == ["Gemm"]
    assert ops(run_pass(wdl_logit(), "dot-sum-kernel", ort_kernels="off")[0]).count("DotSum") == 0


def test_a_term_of_sliced_columns_reads_the_matrix():
    """deepctr-torch: the dense columns X[:, 5:7] of its one input, a term of the logit: w padded with zeros."""
    nodes = [node("Slice", ["X", "s", "e", "ax"], ["dense"]), node("Gemm", ["dense", "W", "b"], ["logit"]),
             node("Sigmoid", ["logit"], ["y"])]
    model = make_model(nodes, [vi("X", F, ["batch", 7])], [vi("y", F, ["batch", 1])],
                       [init("s", np.array([5])), init("e", np.array([7])), init("ax", np.array([1])),
                        init("W", RNG.normal(size=(2, 1)).astype(np.float32)), init("b", np.array([0.1], np.float32))])
    done, _ = check_pass(model, "dot-sum-kernel", ["DotSum"], feeds={"X": RNG.normal(size=(6, 7)).astype(np.float32)})
    assert list(done.graph.node[0].input)[1] == "X"


def test_empty_values_made_in_the_graph():
    """onnxruntime gives a value of no elements that it made itself no data: the kernels take it (0 rows)."""
    nodes = [node("Relu", ["x"], ["m"]), node("Gemm", ["m", "W", "b"], ["logit"]), node("Sigmoid", ["logit"], ["y"])]
    model = make_model(nodes, [vi("x", F, ["batch", 4])], [vi("y", F, ["batch", 1])],
                       [init("W", RNG.normal(size=(4, 1)).astype(np.float32)), init("b", np.array([0.1], np.float32))])
    check_pass(model, "dot-sum-kernel", ["Relu", "DotSum"], feeds={"x": np.zeros((0, 4), np.float32)})
