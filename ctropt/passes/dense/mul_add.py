"""`mul-add-kernel`: a product and the sums after it, ``a * b + c (+ d)``, → ctropt's ``MulAdd`` kernel for
onnxruntime: one pass over the values where onnxruntime makes one per op.

A cross layer ends in such a chain: DCN's ``x0 · s + b + xₗ`` (PaddleRec: ``s = xₗ·w`` a value per row, ``b`` a
vector per column), DCNv2's ``x0 ⊙ (W xₗ + b) + xₗ`` (FuxiCTR, deepctr-torch, DeepRec). onnxruntime runs each op as
its own pass over [N, D] and broadcasts a vector along the rows a row at a time (PaddleRec DCN's three ops over
[256, 221]: 1.68× the kernel's time, FuxiCTR DCNv2's two over [256, 72]: 1.10×; benchmarks/small_ops.py). Each
operand must read the output in one of the kernel's four ways (the output's shape, a value per row, a vector per
column, one value); the kernel rounds the product and each sum on its own, as the ops it replaces, so the outputs
are bit-identical.
"""

from __future__ import annotations

import numpy as np

from ... import kernels
from ...graph.edit import dtype_of, shape_of
from ...patterns import Match, P, Rewrite, Var
from ..registry import PassContext, register_pass

MAX_RANK = 8   # the kernel's (mul_add.c)


def _reads(shape: list, out: list) -> bool:
    """Whether an operand of `shape` reads the output `out` as the kernel can: the whole shape, [..., 1] with the
    output's leading dims, [D] with leading 1s, or one value (dims compared as known: equal ints or names)."""
    if len(shape) > len(out) or any(d is None or d == "" for d in shape):
        return False
    padded = [1] * (len(out) - len(shape)) + list(shape)
    lead, last = padded[:-1], padded[-1] if padded else 1
    lead_same, lead_ones = lead == out[:-1], all(d == 1 for d in lead)
    return (lead_ones and last in (1, out[-1])) or (lead_same and last in (1, out[-1]))


def _operands(m: Match) -> list:
    """The kernel's inputs: a, b, c of Add(Mul(a, b), c); a MulAdd's three and d of Add(MulAdd(a, b, c), d)."""
    if "inner" in m.named_nodes:
        return list(m.node("inner").inputs) + [m["d"]]
    return [m["a"], m["b"], m["c"]]


def _fits(m: Match) -> bool | str:
    operands, out = _operands(m), shape_of(m.root.outputs[0])
    if any(dtype_of(t) is None or np.dtype(dtype_of(t)) != np.float32 for t in operands + [m.root.outputs[0]]):
        return "not float32"
    if out is None or not out or len(out) > MAX_RANK or any(d is None or d == "" for d in out):
        return "the output's shape is not known (rank 1 to 8)"
    shapes = [shape_of(t) for t in operands]
    if any(s is None or not _reads(s, out) for s in shapes):
        return "an operand broadcasts along an inner axis (or its shape is not known)"
    return True


def _to_kernel(m: Match) -> list:
    out = m.root.outputs[0]
    return m.op("MulAdd", _operands(m), name=f"{m.root.name}/MulAdd", domain=kernels.DOMAIN, dtype=out.dtype,
                shape=out.shape)


def _grown_fits(m: Match) -> bool | str:
    inner = m.node("inner")
    if len(inner.inputs) != 3:
        return "the kernel already takes four inputs"
    if shape_of(inner.outputs[0]) != shape_of(m.root.outputs[0]):
        return "the sum after it broadcasts the result"
    return _fits(m)


a, b, c, d = Var("a"), Var("b"), Var("c"), Var("d")
MUL_ADD_RULES = (
    Rewrite("mul-add", P.Add(P.Mul(a, b), c), _to_kernel, _fits, subgraphs=False),
)
GROW_RULES = (
    Rewrite("mul-add-add", P.Add(P.MulAdd(..., _name="inner", _domain=kernels.DOMAIN), d), _to_kernel, _grown_fits,
            subgraphs=False),
)


@register_pass("mul-add-kernel", group="lower", targets=("ort",), speed=True, rules=MUL_ADD_RULES + GROW_RULES)
def mul_add_kernel(ctx: PassContext) -> None:
    """a * b + c (+ d) over float32 values (cross layers' tails) → ctropt's MulAdd kernel, where its library loads."""
    if any(n.op == "Mul" for n in ctx.graph.nodes) and kernels.apply_rules(ctx, MUL_ADD_RULES, "products and sums"):
        ctx.apply(*GROW_RULES)
