"""project-query-once: DIN's first attention layer over concat[q, k, q - k, q * k], q repeated along the history,
in the exporters' forms: the query's part is projected once per row; q - k folded into the weights of q and k."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import F, assert_same_outputs, init, make_model, node, ops, run_pass, vi

import ctropt

D, H = 4, 6
RNG = np.random.default_rng(3)
W = RNG.normal(size=(4 * D, H)).astype(np.float32)
BIAS = RNG.normal(size=H).astype(np.float32)
BN = [RNG.random(H).astype(np.float32) + 0.5, RNG.normal(size=H).astype(np.float32),
      RNG.normal(size=H).astype(np.float32), RNG.random(H).astype(np.float32) + 0.5]


def _din_parts(q_tiled: str) -> list:
    return [node("Sub", [q_tiled, "k"], ["d"]), node("Mul", [q_tiled, "k"], ["p"]),
            node("Concat", [q_tiled, "k", "d", "p"], ["c"], axis=-1)]


def torch_form(batchnorm: bool = True):
    """torch (legacy and dynamo alike): q.unsqueeze(1).expand(-1, T, -1), the MLP's Linear over a [B·T, 4D] view
    (Gemm, W transposed), then BatchNorm1d (DIN's Dice reads its output)."""
    nodes = [node("Unsqueeze", ["q", "ax1"], ["q3"]), node("Shape", ["k"], ["k_shape"]),
             node("Expand", ["q3", "k_shape"], ["qt"]), *_din_parts("qt"),
             node("Reshape", ["c", "flat"], ["cf"]), node("Gemm", ["cf", "Wt", "bias"], ["g"], transB=1)]
    nodes += [node("BatchNormalization", ["g", "s", "b", "m", "v"], ["bn"])] if batchnorm else \
        [node("Identity", ["g"], ["bn"])]
    nodes += [node("Sigmoid", ["bn"], ["y"])]
    inits = [init("ax1", np.array([1], np.int64)), init("flat", np.array([-1, 4 * D], np.int64)),
             init("Wt", W.T.copy()), init("bias", BIAS), *(init(n, v) for n, v in zip("sbmv", BN))]
    return make_model(nodes, [vi("q", F, ["batch", D]), vi("k", F, ["batch", "seq_len", D])],
                      [vi("y", F, ["rows", H])], inits)


def recbole_form():
    """RecBole: queries.repeat(1, T).view(-1, T, D) (Tile of [B, D] and a Reshape), a 3-D MatMul and its bias."""
    nodes = [node("Shape", ["k"], ["k_shape"]), node("Gather", ["k_shape", "one"], ["t"], axis=0),
             node("Unsqueeze", ["t", "ax0"], ["t1"]), node("Concat", ["ones", "t1"], ["reps"], axis=0),
             node("Tile", ["q", "reps"], ["q_rep"]), node("Concat", ["minus", "t1", "d_dim"], ["view"], axis=0),
             node("Reshape", ["q_rep", "view"], ["qt"]), *_din_parts("qt"),
             node("MatMul", ["c", "W"], ["mm"]), node("Add", ["mm", "bias"], ["y"])]
    inits = [init("one", np.array(1, np.int64)), init("ax0", np.array([0], np.int64)),
             init("ones", np.array([1], np.int64)), init("minus", np.array([-1], np.int64)),
             init("d_dim", np.array([D], np.int64)), init("W", W), init("bias", BIAS)]
    return make_model(nodes, [vi("q", F, ["batch", D]), vi("k", F, ["batch", "seq_len", D])],
                      [vi("y", F, ["batch", "seq_len", H])], inits)


def tf2onnx_form():
    """tf2onnx (DeepCTR's LocalActivationUnit): tf.tile of the [B, 1, D] query, tensordot as Reshape → MatMul →
    Reshape back, then the bias."""
    nodes = [node("Shape", ["k"], ["k_shape"]), node("Slice", ["k_shape", "one", "two"], ["t1"]),
             node("Concat", ["one", "t1", "one"], ["reps"], axis=0), node("Tile", ["q", "reps"], ["qt"]),
             *_din_parts("qt"), node("Reshape", ["c", "flat"], ["cf"]), node("MatMul", ["cf", "W"], ["mm"]),
             node("Slice", ["k_shape", "zero", "two"], ["bt"]), node("Concat", ["bt", "h_dim"], ["back"], axis=0),
             node("Reshape", ["mm", "back"], ["mm3"]), node("Add", ["mm3", "bias"], ["y"])]
    inits = [init("zero", np.array([0], np.int64)), init("one", np.array([1], np.int64)),
             init("two", np.array([2], np.int64)), init("h_dim", np.array([H], np.int64)),
             init("flat", np.array([-1, 4 * D], np.int64)), init("W", W), init("bias", BIAS)]
    return make_model(nodes, [vi("q", F, ["batch", 1, D]), vi("k", F, ["batch", "seq_len", D])],
                      [vi("y", F, ["batch", "seq_len", H])], inits)


def _feeds(model, B, T, seed=0):
    rng = np.random.default_rng(seed)
    q_shape = [B, 1, D] if model.graph.input[0].type.tensor_type.shape.dim[1].dim_value == 1 else [B, D]
    return {"q": rng.normal(size=q_shape).astype(np.float32), "k": rng.normal(size=(B, T, D)).astype(np.float32)}


SPLIT = ["Mul", "Concat", "MatMul", "Reshape", "MatMul", "Add"]  # q * k; [k, q * k]·W_rest; q as [B, 1, D]·W_q; sum
TORCH_KEPT = ["Unsqueeze", "Shape", "Expand", "Add", "Reshape", "Sigmoid"]  # + bias once; back to [B·T, H]


@pytest.mark.parametrize("make,want", [
    (torch_form, TORCH_KEPT + SPLIT),  # the BatchNormalization folded into the weights and the bias
    (lambda: torch_form(batchnorm=False), TORCH_KEPT + SPLIT),
    (recbole_form, ["Shape", "Gather", "Unsqueeze", "Concat", "Tile", "Concat", "Reshape", "Add"] + SPLIT),
    # no bias inside the layer: q·W_q is added as is; the Reshape back to [B, T, H] and the bias Add stay
    # q is [B, 1, D] already: its Reshape to [0, 1, D] is none
    (tf2onnx_form, ["Shape", "Slice", "Concat", "Tile", "Slice", "Concat", "Reshape", "Add"] + SPLIT),
])
def test_the_query_part_of_the_first_layer_is_projected_once_per_row(make, want):
    model = make()
    once, ctx = run_pass(model, "project-query-once")
    assert ctx.rewrites == 1, ctx.notes
    assert sorted(ops(once)) == sorted(want), ops(once)
    assert "projected once per row" in ctx.notes[0]
    for B, T in ((6, 7), (1, 7), (4, 1), (3, 30)):
        assert_same_outputs(model, once, _feeds(model, B, T), atol=1e-5, rtol=1e-5)
    twice, ctx2 = run_pass(once, "project-query-once")
    assert ctx2.rewrites == 0 and ops(twice) == ops(once)
    assert ctropt.graph.interface(once) == ctropt.graph.interface(model)


def test_a_tiled_query_fed_as_an_input_or_repeated_across_rows_is_not_projected_once():
    """PaddleRec feeds the target already tiled ([B, T, D] input: its positions may differ); a Tile that repeats
    the batch (reps [T, 1], viewed as [B, T, D]) does not repeat a row along the history. Their q - k part is still
    folded into the weights of q and k: concat[q, k, q·k]·W' per position, 3D of 4D weight rows."""
    fed = make_model(_din_parts("qt") + [node("MatMul", ["c", "W"], ["y"])],
                     [vi("qt", F, ["batch", "seq_len", D]), vi("k", F, ["batch", "seq_len", D])],
                     [vi("y", F, ["batch", "seq_len", H])], [init("W", W)])
    across = recbole_form()
    reps = next(n for n in across.graph.node if n.output[0] == "reps")
    reps.input[:] = ["t1", "ones"]  # Tile(q [B, D], [T, 1]) → [T·B, D], viewed as [B, T, D]: rows mixed
    for model in (fed, across):
        folded, ctx = run_pass(model, "project-query-once")
        assert ctx.rewrites == 1 and "mix 3 values linearly" in ctx.notes[0] and f"{3 * D} of {4 * D}" in ctx.notes[0]
        assert ops(folded).count("MatMul") == 1 and "Sub" not in ops(folded), ops(folded)
        rng = np.random.default_rng(1)
        feeds = {"qt": rng.normal(size=(3, 5, D)).astype(np.float32)} if model is fed else \
            {"q": rng.normal(size=(3, D)).astype(np.float32)}
        feeds["k"] = rng.normal(size=(3, 5, D)).astype(np.float32)
        assert_same_outputs(model, folded, feeds, atol=1e-5, rtol=1e-5)
        again, ctx2 = run_pass(folded, "project-query-once")
        assert ctx2.rewrites == 0 and ops(again) == ops(folded)


def test_in_the_pipeline_outputs_and_interface_hold():
    model = torch_form()
    result = ctropt.optimize(model, passes="all", speed=False)
    record = next(r for r in result.records if r.name == "project-query-once")
    assert record.status == "applied", (record.status, record.notes)
    assert "BatchNormalization" not in ops(result.model)
    assert_same_outputs(model, result.model, _feeds(model, 5, 9), atol=1e-5, rtol=1e-5)
    assert ctropt.graph.interface(result.model) == ctropt.graph.interface(model)
