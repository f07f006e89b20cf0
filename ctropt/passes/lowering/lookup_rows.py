"""Look up only the rows that are read: `lookup-selected-rows`.

An embedding lookup over a whole [B, T] history, viewed as [B·T, D] rows and then cut down to some rows by a
Gather (the valid positions that `remove-attention-padding` scores, or any other row selection), looks up every
position and copies the kept ones a second time. Selecting the ids first and looking up only those rows gives
the same values: ``Gather(Reshape(Gather(E, ids), [-1, D]), rows) = Gather(E, Gather(Reshape(ids, [-1]), rows))``.
A Concat of lookups along the last axis (the item and category embeddings of one history) is split first:
``rows of Concat(a, b) = Concat(rows of a, rows of b)``. The rules only fire where the selected value is read by
the selection alone, so the full lookup goes away.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from ...graph import annotate_shapes
from ...graph.edit import const_value, shape_of
from ...patterns import Const, Match, P, Rewrite, Var
from ..registry import PassContext, register_pass


def _axis0(v) -> bool:
    return not v  # Gather's default axis is 0


def _as_rows(view, width) -> bool:
    """`view` is a Reshape to [n, width] of a value whose last axis is `width` wide: its rows are the value's
    positions in row-major order."""
    shape = shape_of(view)
    return shape is not None and len(shape) == 2 and isinstance(width, (int, np.integer)) and shape[1] == width


def _lookup_rows_condition(m: Match) -> bool | str:
    table = m.const("table")
    if not _as_rows(m.node("view").outputs[0], table.shape[1]):
        return "the lookup is not viewed as rows of its embedding width"
    return True


def _lookup_rows(m: Match) -> list:
    """Gather(Reshape(Gather(E, ids), [-1, D]), rows) → Gather(E, Gather(Reshape(ids, [-1]), rows)), every id
    still checked (`_all_checked`), so an id out of the table at a row that is not selected (a padded history
    position) raises as the raw lookup does."""
    name, out, dtype = m.root.name, m.root.outputs[0], m["ids"].dtype
    flat = m.constant(f"{name}/flat", np.array([-1], np.int64))
    (ids,) = m.op("Reshape", [m["ids"], flat], name=f"{name}/ids_flat", dtype=dtype)
    ids = _all_checked(m, ids, flat)
    (picked,) = m.op("Gather", [ids, m["rows"]], {"axis": 0}, name=f"{name}/ids_selected", dtype=dtype)
    return m.op("Gather", [m["table"], picked], {"axis": 0}, name=f"{name}/lookup_selected",
                dtype=out.dtype, shape=out.shape)


def _all_checked(m: Match, ids: gs.Tensor, flat: gs.Tensor) -> gs.Tensor:
    """The flat ids joined with an empty value that is made only if every id is in the table's [-V, V): the table's
    rows at the largest id (0 at least) and the smallest (0 at most), none of them kept (onnxruntime's bounds check
    and message; 0 for an empty batch). Two indices, not one per id: Gather costs ~8 ns an index."""
    name, dtype = m.root.name, ids.dtype
    zero = m.constant(f"{name}/zero", np.zeros(1, np.dtype(dtype)))
    (high,) = m.op("ReduceMax", [ids], {"keepdims": 1}, name=f"{name}/ids_max", dtype=dtype)
    (low,) = m.op("ReduceMin", [ids], {"keepdims": 1}, name=f"{name}/ids_min", dtype=dtype)
    (high,) = m.op("Max", [high, zero], name=f"{name}/ids_max_0", dtype=dtype)
    (low,) = m.op("Min", [low, zero], name=f"{name}/ids_min_0", dtype=dtype)
    (ends,) = m.op("Concat", [high, low], {"axis": 0}, name=f"{name}/ids_ends", dtype=dtype)
    (rows,) = m.op("Gather", [m["table"], ends], {"axis": 0}, name=f"{name}/ids_checked", dtype=m["table"].dtype)
    none = m.constant(f"{name}/none", np.zeros(1, np.int64))
    (rows,) = m.op("Slice", [rows, none, none, none], name=f"{name}/no_rows", dtype=m["table"].dtype)
    (rows,) = m.op("Cast", [rows], {"to": onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))},
                   name=f"{name}/as_ids", dtype=dtype)
    (none,) = m.op("Reshape", [rows, flat], name=f"{name}/no_ids", dtype=dtype)
    return m.op("Concat", [ids, none], {"axis": 0}, name=f"{name}/ids_all_checked", dtype=dtype)[0]


def _concat_rows_condition(m: Match) -> bool | str:
    cat = m.node("cat")
    shape = shape_of(cat.outputs[0])
    if shape is None or cat.attrs.get("axis") not in (-1, len(shape) - 1):
        return "the Concat is not along the last axis"
    if not _as_rows(m.node("view").outputs[0], shape[-1]):
        return "the Concat is not viewed as rows of its width"
    widths = [(shape_of(t) or [None])[-1] for t in cat.inputs]
    if not all(isinstance(w, (int, np.integer)) and w > 0 for w in widths):
        return "a part's width is unknown"
    if not any(t.inputs and t.inputs[0].op == "Gather" and const_value(t.inputs[0].inputs[0]) is not None
               for t in cat.inputs):
        return "no part is a lookup"
    return True


def _concat_rows(m: Match) -> list:
    """rows of Concat(a_1, …, a_k) along the last axis → Concat(rows of a_1, …, rows of a_k)."""
    name, out, cat = m.root.name, m.root.outputs[0], m.node("cat")
    parts = []
    for i, t in enumerate(cat.inputs):
        width = int(shape_of(t)[-1])
        view = m.constant(f"{name}/rows_of_{i}", np.array([-1, width], np.int64))
        (rows,) = m.op("Reshape", [t, view], name=f"{name}/as_rows_{i}", dtype=t.dtype, shape=["n", width])
        parts += m.op("Gather", [rows, m["rows"]], {"axis": 0}, name=f"{name}/selected_{i}", dtype=t.dtype)
    return m.op("Concat", parts, {"axis": -1}, name=f"{name}/selected", dtype=out.dtype, shape=out.shape)


_ROWS = Var("rows")  # the selected rows' indices, any shape
LOOKUP_ROWS_RULES = (
    Rewrite("rows-of-a-lookup",
            P.Gather(P.Reshape(P.Gather(Const("table", rank=2), Var("ids"), axis=_axis0), Var("shape"), _name="view"),
                     _ROWS, axis=_axis0),
            _lookup_rows, _lookup_rows_condition),
    Rewrite("rows-of-a-concat",
            P.Gather(P.Reshape(P.Concat(Var("first"), ..., _name="cat"), Var("shape"), _name="view"), _ROWS,
                     axis=_axis0),
            _concat_rows, _concat_rows_condition),
)


@register_pass("lookup-selected-rows", group="fusion", rules=LOOKUP_ROWS_RULES)
def lookup_selected_rows(ctx: PassContext) -> None:
    """A row selection (Gather on axis 0) of embedding lookups viewed as rows → the lookups of the selected ids
    only, through a Concat of lookups along the last axis."""
    if not any(n.op == "Gather" for n in ctx.graph.nodes):
        return
    annotate_shapes(ctx.graph)
    ctx.apply(*LOOKUP_ROWS_RULES)
