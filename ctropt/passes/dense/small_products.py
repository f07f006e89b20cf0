"""`small-products-kernel`: sums over a middle axis and batched products of small matrices → ctropt's ``SumAxes`` and
``SmallMatMul`` kernels for onnxruntime.

Dense CTR models pool their fields and histories with sums and mix their experts with small batched products:
FM's sum over fields (``ReduceSum([B, F, E], axis 1)``: deepctr, deepctr-torch, PaddleRec, FuxiCTR), FuxiCTR's sum
over a history ``[B, L, D]``, PaddleRec's sum of ``[B, F, 1]``, an MMoE gate's ``[B, 1, E] × [B, E, D]`` (after
weighted-sum-as-matmul), FinalMLP's bilinear heads ``[B, H, 1, d] × [H, d, d]``, DCN's ``[B, D, 1] × [B, 1, 1]``.
onnxruntime's CPU kernels run one sgemm call per matrix for each of these, so the calls' overhead is their cost:
40–60 µs each at B = 256 (1 thread), 5–10× the kernels' (`git show 8b89a5f:benchmarks/RESULTS.md`). A sum over the last axes stays
(onnxruntime's is fast there), and so does a product of more than 2048 multiply-adds per matrix (DLRM's
``[27, 16] × [16, 27]``: sgemm is faster).
"""

from __future__ import annotations

import numpy as np

from ... import kernels
from ...graph.edit import axes_of, dtype_of, rank_of, shape_of
from ...patterns import Match, P, Rewrite, Var
from ..registry import PassContext, register_pass

MAX_PRODUCT = 2048   # multiply-adds per matrix, beyond which onnxruntime's sgemm per matrix is as fast or faster
MAX_RANK = 8   # the kernels' (small_products.c)


def _is_float(t) -> bool:
    dtype = dtype_of(t)
    return dtype is not None and np.dtype(dtype) == np.float32


def _summed_block(m: Match) -> tuple[int, int] | str:
    """(first axis, count) of a ReduceSum over contiguous axes with an axis after them, or why not."""
    x, rank, axes = m["x"], rank_of(m["x"]), axes_of(m.root)
    if not _is_float(x) or rank is None or rank > MAX_RANK:
        return "not a float32 input of known rank (8 at most)"
    if not axes:
        return "no constant axes"
    axes = sorted({a % rank for a in axes})
    if axes != list(range(axes[0], axes[-1] + 1)):
        return "the summed axes are not contiguous"
    if axes[-1] == rank - 1:
        return "a sum over the last axes (onnxruntime's own is fast)"
    return axes[0], len(axes)


def _is_summed_block(m: Match) -> bool | str:
    block = _summed_block(m)
    return block if isinstance(block, str) else True


def _sum_kernel(m: Match) -> list:
    axis, count = _summed_block(m)
    out = m.root.outputs[0]
    attrs = {"axis": axis, "count": count, "keepdims": int(m.root.attrs.get("keepdims", 1))}
    return m.op("SumAxes", [m["x"]], attrs, name=f"{m.root.name}/SumAxes", domain=kernels.DOMAIN,
                dtype=out.dtype, shape=out.shape)


def _small_product(m: Match) -> bool | str:
    a, b = m["a"], m["b"]
    sa, sb = shape_of(a), shape_of(b)
    if not (_is_float(a) and _is_float(b)) or sa is None or sb is None:
        return "not float32 operands of known shape"
    if max(len(sa), len(sb)) > MAX_RANK:
        return "rank above 8"
    if len(sa) < 2 or len(sb) < 3 or all(d == 1 for d in sb[:-2]):
        return "B is one matrix (onnxruntime runs one GEMM)"
    dims = (sa[-2], sa[-1], sb[-1])
    if not all(isinstance(d, int) and d > 0 for d in dims):
        return "M, K or N not static"
    if dims[0] * dims[1] * dims[2] > MAX_PRODUCT:
        return f"{dims[0]}×{dims[1]}×{dims[2]} multiply-adds per matrix (sgemm is faster beyond {MAX_PRODUCT})"
    return True


def _product_kernel(m: Match) -> list:
    out = m.root.outputs[0]
    return m.op("SmallMatMul", [m["a"], m["b"]], name=f"{m.root.name}/SmallMatMul", domain=kernels.DOMAIN,
                dtype=out.dtype, shape=out.shape)


SMALL_RULES = (
    Rewrite("sum-axes", P.ReduceSum(Var("x"), ..., _domain=""), _sum_kernel, _is_summed_block, subgraphs=False),
    Rewrite("small-matmul", P.MatMul(Var("a"), Var("b"), _domain=""), _product_kernel, _small_product, subgraphs=False),
)


@register_pass("small-products-kernel", group="lower", targets=("ort",), rules=SMALL_RULES)
def small_products_kernel(ctx: PassContext) -> None:
    """ReduceSum over middle axes and MatMul of many small matrices (fields pooled, experts mixed, FM and DCN
    products) → ctropt's SumAxes and SmallMatMul kernels, where its library loads."""
    if any(n.op in ("ReduceSum", "MatMul") for n in ctx.graph.nodes):
        kernels.apply_rules(ctx, SMALL_RULES, "sums and small products")
