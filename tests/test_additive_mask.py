"""remove-attention-padding over an additive mask input (PaddleRec DIN/DIEN: 0 at valid positions, -1e9 at padded
ones, added to bounded scores before a softmax): the positions that get exactly zero weight are skipped, for every
value the mask input may hold."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import F, I64, assert_same_outputs, init, make_model, node, ops, run_pass, vi

import ctropt

D, H, T = 4, 6, 7
RNG = np.random.default_rng(11)
W1 = RNG.normal(size=(3 * D, H)).astype(np.float32)
B1 = RNG.normal(size=H).astype(np.float32)
W2 = RNG.normal(size=(H, 1)).astype(np.float32)
B2 = RNG.normal(size=1).astype(np.float32)


def paddle_din(act: str = "Sigmoid", softmax_axis: int = -1, mask_dtype=I64, shift: float = 0.0, gemm_bias=None):
    """paddle2onnx (PaddleRec rank/din): the MLP over concat[k, q_seq, k * q_seq] ([B, T, 3D], the target fed
    tiled as an input), the cast mask added to the [B, T, 1] scores, transposed to [B, 1, T], scaled (paddle's
    scale op: Mul then Add), softmax, pooled by MatMul."""
    nodes = [node("Mul", ["keys", "q_seq"], ["p"]), node("Concat", ["keys", "q_seq", "p"], ["c"], axis=-1),
             node("MatMul", ["c", "W1"], ["m1"]), node("Add", ["m1", "B1"], ["a1"]), node(act, ["a1"], ["h"]),
             *([node("MatMul", ["h", "W2"], ["m2"]), node("Add", ["m2", "B2"], ["s"])] if gemm_bias is None else
               [node("ReduceSum", ["c", "last"], ["c_sum"]), node("Reshape", ["h", "rows_h"], ["h_rows"]),
                node("Reshape", ["c_sum", "rows_1"], ["c_rows"]), node("Gemm", ["h_rows", "W2", "c_rows"], ["s_rows"]),
                node("Shape", ["mask"], ["back"]), node("Reshape", ["s_rows", "back"], ["s"])]),
             node("Cast", ["mask"], ["mask_f"], to=F), node("Add", ["s", "mask_f"], ["masked"]),
             node("Transpose", ["masked"], ["mt"], perm=[0, 2, 1]), node("Mul", ["mt", "scale"], ["scaled"]),
             node("Add", ["scaled", "shift"], ["shifted"]), node("Softmax", ["shifted"], ["w"], axis=softmax_axis),
             node("MatMul", ["w", "keys"], ["y"])]
    inits = [init("W1", W1), init("B1", B1), init("W2", W2), init("B2", B2),
             init("scale", np.array([0.5], np.float32)), init("shift", np.array([shift], np.float32)),
             init("last", np.array([-1], np.int64)), init("rows_h", np.array([-1, H], np.int64)),
             init("rows_1", np.array([-1, 1], np.int64))]
    inputs = [vi("keys", F, ["batch", "seq_len", D]), vi("q_seq", F, ["batch", "seq_len", D]),
              vi("mask", mask_dtype, ["batch", "seq_len", 1])]
    return make_model(nodes, inputs, [vi("y", F, ["batch", 1, D])], inits)


def _feeds(lengths, seed=0, mask=None, dtype=np.int64):
    rng = np.random.default_rng(seed)
    B = len(lengths)
    pad = np.arange(T)[None, :] >= np.array(lengths)[:, None]
    values = np.where(pad, -1e9, 0.0)[:, :, None] if mask is None else mask
    return {"keys": rng.normal(size=(B, T, D)).astype(np.float32),
            "q_seq": rng.normal(size=(B, T, D)).astype(np.float32), "mask": values.astype(dtype)}


def test_positions_an_additive_mask_leaves_no_weight_are_not_scored():
    model = paddle_din()
    done, ctx = run_pass(model, "remove-attention-padding")
    assert ctx.rewrites == 1, ctx.notes
    assert {"Compress", "ScatterND", "ReduceMax", "GreaterOrEqual"} <= set(ops(done)), ops(done)
    for lengths in ([T, 0, 3, 1], [2], [T, T], [0, 0, 5]):  # full, empty (all padding) and partial histories
        assert_same_outputs(model, done, _feeds(lengths), atol=1e-6, rtol=1e-5)
    twice, ctx2 = run_pass(done, "remove-attention-padding")
    assert ctx2.rewrites == 0 and sorted(ops(twice)) == sorted(ops(done))
    assert ctropt.graph.interface(done) == ctropt.graph.interface(model)


def test_any_mask_values_give_the_same_outputs():
    """A float mask input may hold anything: small values keep every position, huge gaps drop them."""
    model = paddle_din(mask_dtype=F)
    done, ctx = run_pass(model, "remove-attention-padding")
    assert ctx.rewrites == 1, ctx.notes
    rng = np.random.default_rng(4)
    for mask in (rng.normal(size=(5, T, 1)), rng.normal(size=(5, T, 1)) * 1e4, -1e30 * (rng.random((5, T, 1)) < 0.5),
                 np.full((5, T, 1), -3e8), np.where(rng.random((5, T, 1)) < 0.5, -1e9, 1e9)):
        assert_same_outputs(model, done, _feeds([T] * 5, mask=mask, dtype=np.float32), atol=1e-6, rtol=1e-5)


def test_a_large_constant_before_the_softmax_widens_the_margin():
    """softmax(a·(s + m) + c) with a = 0.5, c = 1.5·2^33: float32 rounds the sum in steps of 2^10, so a gap of 1024
    in the mask no longer leaves zero weight (0.5·(s - 1024) + c rounds to c - 1024, but 0.5·(0 - 1024) + c, a tie,
    to c); the margin grows with |c| and those positions are kept."""
    model = paddle_din(mask_dtype=F, shift=1.5 * 2 ** 33)
    done, _ = run_pass(model, "remove-attention-padding")
    mask = np.full((16, T, 1), -1024.0)
    mask[:, 0] = 0.0
    assert_same_outputs(model, done, _feeds([T] * 16, mask=mask, dtype=np.float32), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("change", ["unbounded scores", "softmax over the batch", "a bias computed per row"])
def test_scores_that_can_outgrow_the_mask_or_another_normalization_stay(change):
    model = {"unbounded scores": lambda: paddle_din(act="Relu"), "softmax over the batch": lambda: paddle_din(
        softmax_axis=0), "a bias computed per row": lambda: paddle_din(gemm_bias="computed")}[change]()
    done, ctx = run_pass(model, "remove-attention-padding")
    assert ctx.rewrites == 0 and sorted(ops(done)) == sorted(ops(model)), ops(done)


def test_in_the_pipeline_outputs_and_interface_hold():
    model = paddle_din()
    result = ctropt.optimize(model, passes="all", speed=False)
    record = next(r for r in result.records if r.name == "remove-attention-padding")
    assert record.status == "applied", (record.status, record.notes)
    assert_same_outputs(model, result.model, _feeds([T, 0, 2, 5, 1]), atol=1e-6, rtol=1e-5)
    assert ctropt.graph.interface(result.model) == ctropt.graph.interface(model)
