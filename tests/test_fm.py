"""fm-interaction-kernel: a factorization machine's second order → ctropt's FMInteraction kernel, in the dialects the
DeepFM exporters write: deepctr's (Mul squares, keepdims, ReduceSum over the columns, then × 1/2), torch's (Pow,
keepdim=True), FuxiCTR's (Pow, no keepdims, × 1/2 left for the sum after it), PaddleRec's (Mul, keepdims, ReduceSum,
× 1/2), DeepRec's (no keepdims, × 1/2, the vector kept); the kernel against numpy; what stays."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from helpers import F, check_pass, init, kernel_session, make_model, node, ops, run_pass, vi

from ctropt import kernels

RNG = np.random.default_rng(13)
FIELDS, D = 6, 11


def _reference(e, keepdims, scale, reduce):
    s, q = e.astype(np.float64).sum(1, keepdims=True), (e.astype(np.float64) ** 2).sum(1, keepdims=True)
    v = (s * s - q) * scale
    v = v if keepdims else v[:, 0]
    return v.sum(-1, keepdims=reduce == 2) if reduce else v


@pytest.mark.parametrize("keepdims,scale,reduce", [(1, 0.5, 1), (0, 1.0, 0), (1, 1.0, 2), (0, 0.5, 1), (1, 2.0, 0)])
@pytest.mark.parametrize("rows,d", [(9, D), (3, 16), (0, 4), (2, 3)])
def test_fm_interaction_matches_numpy(keepdims, scale, reduce, rows, d):
    e = RNG.normal(size=(rows, FIELDS, d)).astype(np.float32)
    s = kernel_session([onnx.helper.make_node("FMInteraction", ["e"], ["y"], domain=kernels.DOMAIN, keepdims=keepdims,
                                              scale=scale, reduce=reduce)], [vi("e", F, None)])
    got, want = s.run(None, {"e": e})[0], _reference(e, keepdims, scale, reduce)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def _square(x, out, pow_):
    return node("Pow", [x, "two"], [out]) if pow_ else node("Mul", [x, x], [out])


def fm(pow_=False, keepdims=1, tail=("sum", "half")):
    """The second order of E [B, F, D] as an exporter writes it; `tail`: what follows the Sub, in order."""
    nodes = [node("ReduceSum", ["e", "ax1"], ["s"], keepdims=keepdims), _square("s", "s2", pow_),
             _square("e", "e2", pow_), node("ReduceSum", ["e2", "ax1"], ["q"], keepdims=keepdims),
             node("Sub", ["s2", "q"], ["t0"])]
    for i, step in enumerate(tail):
        nodes.append(node("ReduceSum", [f"t{i}", "axl"], [f"t{i + 1}"], keepdims=0) if step == "sum" else
                     node("Mul", [f"t{i}", "half"], [f"t{i + 1}"]))
    nodes[-1].output[0] = "y"
    return make_model(nodes, [vi("e", F, ["batch", FIELDS, D])], [vi("y", F, None)],
                      [init("ax1", np.array([1], np.int64)), init("axl", np.array([-1], np.int64)),
                       init("two", np.array(2.0, np.float32)), init("half", np.array(0.5, np.float32))])


@pytest.mark.parametrize("build,attrs", [
    (lambda: fm(), (1, 0.5, 1)),                                        # deepctr, PaddleRec
    (lambda: fm(pow_=True, tail=("sum",)), (1, 1.0, 1)),                # torch (the 1/2 in a Gemm after it)
    (lambda: fm(pow_=True, keepdims=0, tail=("half",)), (0, 0.5, 0)),   # FuxiCTR, DeepRec: the vector kept
    (lambda: fm(tail=("half", "sum")), (1, 0.5, 1)),
])
def test_second_orders_become_one_kernel(build, attrs):
    feeds = {"e": RNG.normal(size=(7, FIELDS, D)).astype(np.float32)}
    done, _ = check_pass(build(), "fm-interaction-kernel", ["FMInteraction"], feeds=feeds)
    got = {a.name: onnx.helper.get_attribute_value(a) for a in done.graph.node[0].attribute}
    assert (got["keepdims"], got["scale"], got["reduce"]) == attrs


def test_what_stays():
    model = fm()
    model.graph.output.append(vi("s2", F, None))   # the square of the sum is read elsewhere too
    assert "FMInteraction" not in ops(run_pass(model, "fm-interaction-kernel")[0])
    other = fm()
    other.graph.node[2].input[:] = ["e", "e"]
    other.graph.node[3].input[0] = "e"   # the squares' sum reads E, not its square
    assert "FMInteraction" not in ops(run_pass(other, "fm-interaction-kernel")[0])
    assert ops(run_pass(fm(), "fm-interaction-kernel", ort_kernels="off")[0]).count("FMInteraction") == 0
