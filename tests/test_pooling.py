"""weighted-sum-as-matmul: attention pooling as ReduceSum(Mul(w, E)) over the history, in the exporters' forms."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import F, assert_same_outputs, init, make_model, node, ops, run_pass, vi

import ctropt

D = 5


def pooling(*, weights_first: bool = True, keepdims: int = 0, opset: int = 17, weights_t: str = "seq_len"):
    """w [B, T] unsqueezed to [B, T, 1] (the attention weights), E [B, T, D]; sum over T of w·E."""
    product = ["w3", "E"] if weights_first else ["E", "w3"]
    axes = {"axes": [1]} if opset < 13 else {}
    unsqueeze = node("Unsqueeze", ["w", "ax2"], ["w3"]) if opset >= 13 else node("Unsqueeze", ["w"], ["w3"], axes=[2])
    nodes = [unsqueeze, node("Mul", product, ["p"]),
             node("ReduceSum", ["p", "ax1"] if opset >= 13 else ["p"], ["y"], keepdims=keepdims, **axes)]
    inits = [init("ax1", np.array([1], np.int64)), init("ax2", np.array([2], np.int64))] if opset >= 13 else []
    out = ["batch", 1, D] if keepdims else ["batch", D]
    return make_model(nodes, [vi("w", F, ["batch", weights_t]), vi("E", F, ["batch", "seq_len", D])],
                      [vi("y", F, out)], inits, opset=opset)


def _feeds(B=6, T=7, seed=0):
    rng = np.random.default_rng(seed)
    return {"w": rng.random((B, T)).astype(np.float32), "E": rng.normal(size=(B, T, D)).astype(np.float32)}


@pytest.mark.parametrize("weights_first,keepdims,opset", [(True, 0, 17), (False, 0, 17), (True, 1, 17),
                                                           (False, 0, 11)])
def test_weighted_sum_over_the_history_is_one_matmul(weights_first, keepdims, opset):
    model = pooling(weights_first=weights_first, keepdims=keepdims, opset=opset)
    once, ctx = run_pass(model, "weighted-sum-as-matmul")
    assert ctx.rewrites == 1
    want = ["Unsqueeze", "MatMul"] + ["Squeeze"] * (not keepdims)  # Unsqueeze(w, 2) then Squeeze(2): gone
    assert sorted(ops(once)) == sorted(want), ops(once)
    for B, T in ((6, 7), (1, 7), (4, 1), (3, 30)):
        assert_same_outputs(model, once, _feeds(B, T), atol=1e-5, rtol=1e-5)
    twice, ctx2 = run_pass(once, "weighted-sum-as-matmul")
    assert ctx2.rewrites == 0 and ops(twice) == ops(once)
    assert ctropt.graph.interface(once) == ctropt.graph.interface(model)


def test_weights_broadcast_over_the_history_or_a_product_read_twice_stay():
    """w of another (possibly broadcast) length than E's T, or the product also an output: no rewrite."""
    model = pooling(weights_t="other_len")
    once, ctx = run_pass(model, "weighted-sum-as-matmul")
    assert ctx.rewrites == 0 and ops(once) == ops(model)
    model = pooling()
    model.graph.output.append(vi("p", F, None))
    once, ctx = run_pass(model, "weighted-sum-as-matmul")
    assert ctx.rewrites == 0 and ops(once) == ops(model)
    misses = ctropt.REGISTRY["weighted-sum-as-matmul"].misses(ctropt.graph.to_graph(model), "ort")
    assert any("used by a graph output" in m for m in misses), misses


def dcn_dot(keepdims: int = 1, w_shape=(D,)):
    """PaddleRec's DCN cross layer scalar: x · w as ReduceSum(Mul(x, w), axis=-1), w a constant vector."""
    nodes = [node("Mul", ["x", "w"], ["p"]), node("ReduceSum", ["p", "axl"], ["s"], keepdims=keepdims),
             node("Mul", ["x", "s" if keepdims else "x"], ["y"])]
    return make_model(nodes, [vi("x", F, ["batch", D])], [vi("y", F, ["batch", D]), vi("s", F, None)],
                      [init("w", np.linspace(-1, 1, D, dtype=np.float32).reshape(w_shape)),
                       init("axl", np.array([-1], np.int64))])


@pytest.mark.parametrize("keepdims", [1, 0])
def test_dot_with_a_constant_vector_is_a_matmul(keepdims):
    model = dcn_dot(keepdims)
    once, ctx = run_pass(model, "weighted-sum-as-matmul")
    assert sorted(ops(once)) == sorted(["MatMul", "Mul"] + ["Squeeze"] * (not keepdims)), ops(once)
    assert_same_outputs(model, once, {"x": np.random.default_rng(1).normal(size=(6, D)).astype(np.float32)})
    assert run_pass(once, "weighted-sum-as-matmul")[1].rewrites == 0


def test_a_vector_with_leading_ones_is_a_dot_a_sum_over_the_rows_is_not():
    assert run_pass(dcn_dot(w_shape=(1, D)), "weighted-sum-as-matmul")[1].rewrites == 1   # leading 1s: a vector
    model = dcn_dot()
    model.graph.initializer[1].CopyFrom(init("axl", np.array([0], np.int64)))
    assert run_pass(model, "weighted-sum-as-matmul")[1].rewrites == 0
