"""mul-add-kernel: cross layers' tails ``a * b + c (+ d)`` → ctropt's MulAdd kernel, in PaddleRec's DCN form (a value
per row, a bias per column, then the residual) and torch's DCNv2 form (the residual first); the kernel against
numpy, bit for bit."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from helpers import F, check_pass, init, kernel_session, make_model, node, ops, run_pass, vi

from ctropt import kernels

RNG = np.random.default_rng(5)
D = 13


@pytest.mark.parametrize("shapes", [
    [(6, D), (6, D), (6, D)], [(6, D), (6, 1), (D,), (6, D)], [(2, 3, D), (1, D), (2, 3, 1), ()],
    [(6, 1), (1, D), (6, D)], [(4, 5), (4, 5), (5,), (4, 1)], [(0, D), (0, 1), (D,)], [(), (), ()],
])
def test_mul_add_matches_numpy_bit_for_bit(shapes):
    values = [RNG.normal(size=s).astype(np.float32) for s in shapes]
    names = "abcd"[:len(shapes)]
    s = kernel_session([onnx.helper.make_node("MulAdd", list(names), ["y"], domain=kernels.DOMAIN)],
                 [vi(n, F, None) for n in names])
    want = values[0] * values[1] + values[2]
    if len(values) > 3:
        want = want + values[3]
    got = s.run(None, dict(zip(names, values)))[0]
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)


def test_mul_add_refuses_an_inner_broadcast():
    s = kernel_session([onnx.helper.make_node("MulAdd", ["a", "b", "c"], ["y"], domain=kernels.DOMAIN)],
                 [vi(n, F, None) for n in "abc"])
    with pytest.raises(Exception, match="inner axis"):
        s.run(None, {"a": np.ones((2, 3, D), np.float32), "b": np.ones((2, 1, D), np.float32),
                     "c": np.ones((2, 3, D), np.float32)})
    with pytest.raises(Exception, match="do not broadcast"):
        s.run(None, {"a": np.ones((2, D), np.float32), "b": np.ones((3, D), np.float32),
                     "c": np.ones((2, D), np.float32)})


def dcn_paddle():
    """PaddleRec DCN: x1 = x0 · s + b + x0, s = x0·w a value per row (two layers, the second on x1)."""
    nodes = []
    for i, x in enumerate(("x0", "x1")):
        nodes += [node("MatMul", [x, "w"], [f"s{i}"]), node("Mul", ["x0", f"s{i}"], [f"p{i}"]),
                  node("Add", [f"p{i}", "bias"], [f"q{i}"]), node("Add", [f"q{i}", x], ["x1" if i == 0 else "y"])]
    rng = np.random.default_rng(0)
    return make_model(nodes, [vi("x0", F, ["batch", D])], [vi("y", F, ["batch", D])],
                      [init("w", rng.normal(size=(D, 1)).astype(np.float32)),
                       init("bias", rng.normal(size=(D,)).astype(np.float32))])


def dcnv2_torch():
    """torch's DCNv2 (FuxiCTR, deepctr-torch): x1 = x0 ⊙ (W x0 + b) + x0, written residual first."""
    nodes = [node("Gemm", ["x0", "W", "b"], ["h"]), node("Mul", ["x0", "h"], ["p"]), node("Add", ["x0", "p"], ["y"])]
    rng = np.random.default_rng(1)
    return make_model(nodes, [vi("x0", F, ["batch", D])], [vi("y", F, ["batch", D])],
                      [init("W", rng.normal(size=(D, D)).astype(np.float32)),
                       init("b", rng.normal(size=(D,)).astype(np.float32))])


@pytest.mark.parametrize("build,expected", [(dcn_paddle, ["MatMul", "MulAdd"] * 2), (dcnv2_torch, ["Gemm", "MulAdd"])])
def test_cross_layer_tails_become_one_kernel(build, expected):
    feeds = {"x0": RNG.normal(size=(7, D)).astype(np.float32)}
    done, _ = check_pass(build(), "mul-add-kernel", expected, feeds=feeds)
    ref = ort.InferenceSession(build().SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    so = ort.SessionOptions()
    kernels.register(so)
    got = ort.InferenceSession(done.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    np.testing.assert_array_equal(got, ref)   # rounded as the ops it replaces


def test_a_product_broadcast_along_an_inner_axis_stays():
    nodes = [node("Mul", ["a", "m"], ["p"]), node("Add", ["p", "a"], ["y"])]
    model = make_model(nodes, [vi("a", F, ["batch", "T", D]), vi("m", F, ["batch", 1, D])],
                       [vi("y", F, ["batch", "T", D])])
    assert ops(run_pass(model, "mul-add-kernel")[0]) == ["Mul", "Add"]
