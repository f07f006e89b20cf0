"""`rewrite-indicator-columns`: multi-hot indicator columns (OneHot + ReduceSum) → a scatter of ones."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from ...patterns import Const, P, Rewrite, Var
from ...graph.edit import Builder
from ..registry import PassContext, register_pass


def _indicator_applies(m) -> bool | str:
    """One-hot on the last axis of [B, K] ids, summed over K, with values (0, 1): a multi-hot count."""
    ids, depth, values, axes = m["ids"], m.const("depth"), m.const("values"), m.const("axes")
    rank = len(ids.shape) if ids.shape is not None else None
    if rank != 2 or depth.size != 1 or values.size != 2 or values[0] != 0 or values[1] != 1:
        return "needs [B, K] ids and values (0, 1)"
    if m.node("onehot").attrs.get("axis", -1) not in (-1, 2) or list(axes.ravel()) not in ([1], [-2]):
        return "one-hot must be on the last axis and the sum over the ids axis"
    return m.root.attrs.get("keepdims", 1) == 0 or "keepdims must be 0"


def _indicator_scatter(m):
    """counts[b, d] = #{k: ids[b, k] is d} (negative ids from the end, out-of-range ids nowhere) by one scatter-add."""
    ids, depth = m["ids"], int(m.const("depth").ravel()[0])
    dtype = m.const("values").dtype
    id_dtype = np.dtype(ids.dtype) if ids.dtype is not None else np.dtype(np.int64)

    b = Builder(m.graph, m.root.name, id_dtype)
    c, op = b.const, b.op

    inside = op("And", [op("GreaterOrEqual", [ids, c("low", [-depth], id_dtype)], dtype=np.bool_),
                        op("Less", [ids, c("high", [depth], id_dtype)], dtype=np.bool_)], dtype=np.bool_)
    column = op("Where", [inside, op("Mod", [ids, c("depth", [depth], id_dtype)]), c("nowhere", [depth], id_dtype)])
    rows = op("Slice", [op("Shape", [ids], dtype=np.int64), c("zero", [0], np.int64), c("one", [1], np.int64)],
              dtype=np.int64)
    width = op("Concat", [rows, c("width", [depth + 1], np.int64)], {"axis": 0}, dtype=np.int64)
    zeros = op("ConstantOfShape", [width],
               {"value": gs.Constant("value", np.zeros(1, dtype=dtype))}, dtype=dtype)
    ones = op("Expand", [c("one_", [1], dtype), op("Shape", [ids], dtype=np.int64)], dtype=dtype)
    counts = op("ScatterElements", [zeros, op("Cast", [column], {"to": 7}, dtype=np.int64), ones],
                {"axis": 1, "reduction": "add"}, dtype=dtype)
    return [op("Slice", [counts, c("from", [0], np.int64), c("to", [depth], np.int64), c("axis", [1], np.int64)],
               dtype=dtype)]


INDICATOR = Rewrite(
    "onehot-reducesum",
    P.ReduceSum(P.OneHot(Var("ids"), Const("depth"), Const("values"), _name="onehot"), Const("axes")),
    _indicator_scatter, _indicator_applies)


@register_pass("rewrite-indicator-columns", group="fusion", rules=(INDICATOR,))
def rewrite_indicator_columns(ctx: PassContext) -> None:
    """Indicator (multi-hot) columns, OneHot + ReduceSum over the ids, → a scatter-add of ones (seed 004)."""
    ctx.apply(INDICATOR)
