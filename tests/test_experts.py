"""gated-sum-kernel: a mixture of experts' per-task mix → ctropt's GatedSum kernel. The kernel against numpy; the
stacks torch and deepctr write (an Unsqueeze per expert, a Concat on axis 1), PaddleRec's (a Concat on the last axis,
a Reshape), the gate as a row through Unsqueeze or Reshape, the MatMul as it is or as small-products-kernel's
SmallMatMul; the Squeeze after it absorbed or not; what stays."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from helpers import F, check_pass, init, kernel_session, make_model, node, ops, run_pass, vi

from ctropt import kernels

RNG = np.random.default_rng(17)
E, D = 3, 10


@pytest.mark.parametrize("rows,d,keepdims", [(9, D, 0), (4, 16, 1), (0, 5, 0), (3, 1, 1)])
def test_gated_sum_matches_numpy(rows, d, keepdims):
    g = RNG.random(size=(rows, E)).astype(np.float32)
    xs = [RNG.normal(size=(rows, d)).astype(np.float32) for _ in range(E)]
    names = [f"x{i}" for i in range(E)]
    s = kernel_session([onnx.helper.make_node("GatedSum", ["g"] + names, ["y"], domain=kernels.DOMAIN,
                                              keepdims=keepdims)], [vi(n, F, None) for n in ["g"] + names])
    got = s.run(None, {"g": g} | dict(zip(names, xs)))[0]
    want = sum(g[:, e:e + 1] * xs[e] for e in range(E))
    assert got.shape == ((rows, 1, d) if keepdims else (rows, d))
    np.testing.assert_allclose(got.reshape(rows, d), want, rtol=1e-5, atol=1e-6)


def test_gated_sum_checks_sizes():
    s = kernel_session([onnx.helper.make_node("GatedSum", ["g", "a", "b"], ["y"], domain=kernels.DOMAIN, keepdims=0)],
                       [vi(n, F, None) for n in "gab"])
    with pytest.raises(Exception, match="gate"):
        s.run(None, {"g": np.ones((4, 3), np.float32), "a": np.ones((4, 5), np.float32), "b": np.ones((4, 5), np.float32)})
    with pytest.raises(Exception, match="sizes differ"):
        s.run(None, {"g": np.ones((4, 2), np.float32), "a": np.ones((4, 5), np.float32), "b": np.ones((3, 5), np.float32)})


def _experts_and_gate():
    nodes = [node("Gemm", ["x", f"W{e}"], [f"h{e}"]) for e in range(E)]
    nodes += [node("Gemm", ["x", "Wg"], ["logits"]), node("Softmax", ["logits"], ["gate"], axis=-1)]
    inits = [init(f"W{e}", RNG.normal(size=(6, D)).astype(np.float32)) for e in range(E)]
    inits += [init("Wg", RNG.normal(size=(6, E)).astype(np.float32)), init("ax1", np.array([1], np.int64)),
              init("ax2", np.array([2], np.int64))]
    return nodes, inits


def mix_torch(squeeze=True):
    """deepctr-torch / FuxiCTR: experts Unsqueezed and concatenated on axis 1, the gate Unsqueezed to a row."""
    nodes, inits = _experts_and_gate()
    nodes += [node("Unsqueeze", [f"h{e}", "ax1"], [f"u{e}"]) for e in range(E)]
    nodes += [node("Concat", [f"u{e}" for e in range(E)], ["stack"], axis=1), node("Unsqueeze", ["gate", "ax1"], ["row"]),
              node("MatMul", ["row", "stack"], ["mix" if squeeze else "y"])]
    nodes += [node("Squeeze", ["mix", "ax1"], ["y"])] if squeeze else []
    return make_model(nodes, [vi("x", F, ["batch", 6])], [vi("y", F, None)], inits)


def mix_paddle():
    """PaddleRec: the [B, D] experts concatenated on the last axis and reshaped to [B, E, D]; the gate reshaped to
    [B, E, 1], then squeezed and unsqueezed to a row (as weighted-sum-as-matmul writes it)."""
    nodes, inits = _experts_and_gate()
    nodes += [node("Concat", [f"h{e}" for e in range(E)], ["cat"], axis=1), node("Reshape", ["cat", "s3"], ["stack"]),
              node("Reshape", ["gate", "g3"], ["col"]), node("Squeeze", ["col", "ax2"], ["flat"]),
              node("Unsqueeze", ["flat", "ax1"], ["row"]), node("MatMul", ["row", "stack"], ["mix"]),
              node("Reshape", ["mix", "s2"], ["y"])]
    inits += [init("s3", np.array([-1, E, D], np.int64)), init("g3", np.array([-1, E, 1], np.int64)),
              init("s2", np.array([-1, D], np.int64))]
    return make_model(nodes, [vi("x", F, ["batch", 6])], [vi("y", F, None)], inits)


def _feeds():
    return {"x": RNG.normal(size=(7, 6)).astype(np.float32)}


@pytest.mark.parametrize("build", [mix_torch, mix_paddle])
def test_mixes_become_one_kernel(build):
    done, _ = check_pass(build(), "gated-sum-kernel", ["Gemm"] * E + ["GatedSum"], feeds=_feeds())
    mix = next(n for n in done.graph.node if n.op_type == "GatedSum")
    assert list(mix.input)[3:] == [f"h{e}" for e in range(E)] and mix.input[0] == "x"   # the gate's layer too
    attrs = {a.name: a.i for a in mix.attribute}
    assert attrs == {"keepdims": 0, "softmax": 1, "project": 1}


def test_the_mix_as_small_matmul_and_kept_as_a_row():
    once, _ = run_pass(mix_torch(squeeze=False), "small-products-kernel")
    assert "SmallMatMul" in ops(once)
    done, _ = check_pass(once, "gated-sum-kernel", ["Gemm"] * E + ["GatedSum"], feeds=_feeds())
    mix = next(n for n in done.graph.node if n.op_type == "GatedSum")
    assert {a.name: a.i for a in mix.attribute}["keepdims"] == 1   # [B, 1, D], as the MatMul made it


def test_a_gate_read_elsewhere_is_taken_as_it_is():
    model = mix_torch()
    model.graph.output.append(vi("gate", F, ["batch", E]))   # the Softmax's output is a graph output too
    done, _ = check_pass(model, "gated-sum-kernel", ["Gemm"] * (E + 1) + ["Softmax", "GatedSum"], feeds=_feeds())
    mix = next(n for n in done.graph.node if n.op_type == "GatedSum")
    assert mix.input[0] == "gate" and {a.name: a.i for a in mix.attribute} == {"keepdims": 0}
    logits_read = mix_torch()
    logits_read.graph.output.append(vi("logits", F, ["batch", E]))   # the gate's layer is read elsewhere: Softmax only
    done, _ = check_pass(logits_read, "gated-sum-kernel", ["Gemm"] * (E + 1) + ["GatedSum"], feeds=_feeds())
    mix = next(n for n in done.graph.node if n.op_type == "GatedSum")
    assert mix.input[0] == "logits" and {a.name: a.i for a in mix.attribute} == {"keepdims": 0, "softmax": 1}


@pytest.mark.parametrize("experts,rows", [(3, 9), (8, 70), (12, 5)])
def test_gated_sum_softmax_and_projection_match_numpy(experts, rows):
    h = RNG.normal(size=(rows, 6)).astype(np.float32)
    w, b = RNG.normal(size=(6, experts)).astype(np.float32), RNG.normal(size=experts).astype(np.float32)
    xs = [RNG.normal(size=(rows, D)).astype(np.float32) for _ in range(experts)]
    names = [f"x{i}" for i in range(experts)]
    logits = h @ w + b
    gate = np.exp(logits - logits.max(1, keepdims=True))
    gate /= gate.sum(1, keepdims=True)
    want = sum(gate[:, e:e + 1] * xs[e] for e in range(experts))
    soft = kernel_session([onnx.helper.make_node("GatedSum", ["g"] + names, ["y"], domain=kernels.DOMAIN, keepdims=0,
                                                 softmax=1)], [vi(n, F, None) for n in ["g"] + names])
    np.testing.assert_allclose(soft.run(None, {"g": logits} | dict(zip(names, xs)))[0], want, rtol=1e-5, atol=1e-5)
    if experts > 8:
        return
    proj = kernel_session([onnx.helper.make_node("GatedSum", ["h", "w", "b"] + names, ["y"], domain=kernels.DOMAIN,
                                                 keepdims=0, softmax=1, project=1)],
                          [vi(n, F, None) for n in ["h"] + names], [init("w", w), init("b", b)])
    np.testing.assert_allclose(proj.run(None, {"h": h} | dict(zip(names, xs)))[0], want, rtol=1e-5, atol=1e-5)


def test_what_stays():
    # the stack is an input: no experts to read where they are
    model = make_model([node("Unsqueeze", ["gate", "ax1"], ["row"]), node("MatMul", ["row", "stack"], ["y"])],
                       [vi("gate", F, ["batch", E]), vi("stack", F, ["batch", E, D])], [vi("y", F, ["batch", 1, D])],
                       [init("ax1", np.array([1], np.int64))])
    assert "GatedSum" not in ops(run_pass(model, "gated-sum-kernel")[0])
    assert "GatedSum" not in ops(run_pass(mix_torch(), "gated-sum-kernel", ort_kernels="off")[0])


def test_a_gate_shared_by_every_row_stays():
    """A constant gate [1, 1, E] (a learned mix, folded) broadcast over the batch's stack: the kernel takes a gate
    per row, so the MatMul stays."""
    nodes, inits = _experts_and_gate()
    nodes = nodes[:E] + [node("Unsqueeze", [f"h{e}", "ax1"], [f"u{e}"]) for e in range(E)]
    nodes += [node("Concat", [f"u{e}" for e in range(E)], ["stack"], axis=1), node("MatMul", ["row", "stack"], ["y"])]
    inits = [i for i in inits if i.name != "Wg"] + [init("row", np.full((1, 1, E), 1 / E, np.float32))]
    model = make_model(nodes, [vi("x", F, ["batch", 6])], [vi("y", F, ["batch", 1, D])], inits)
    assert "GatedSum" not in ops(run_pass(model, "gated-sum-kernel")[0])
