"""Generic cleanup passes: dead nodes, shapes, training leftovers, no-op ops, constants, duplicates.

Where onnx, onnx-graphsurgeon or onnxruntime already do the job (shape inference, constant folding,
dead-node removal) these passes call them and return how many changes they made (the Pass counts them); the
no-op and training-op cleanups are pattern rules.
"""

from __future__ import annotations

import hashlib

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx_graphsurgeon.logger import G_LOGGER

from ...graph import annotate_shapes, iter_graphs, loop_varying_values, weights
from ...graph.dims import BROADCASTING, is_own_shape, same_size, shape_entries, source_dim
from ...patterns import Const, P, Rewrite, Var
from ...graph.edit import (axes_of, const_value, dtype_of, rank_of, renameable, replace_outputs, shape_of, stacked_part,
                          unique_name)
from ..registry import PassContext, register_pass

FOLD_SIZE_CAP = 16 << 20  # bytes: larger folded constants would bloat the model


def _node_total(graph: gs.Graph) -> int:
    return sum(len(g.nodes) for g in iter_graphs(graph))


@register_pass("eliminate-dead-nodes", group="cleanup")
def eliminate_dead_nodes(ctx: PassContext) -> int:
    """Remove nodes and initializers no graph output depends on (Loop/Scan/If bodies included)."""
    before = _node_total(ctx.graph)
    ctx.graph.cleanup(remove_unused_graph_inputs=False, recurse_subgraphs=True)
    return before - _node_total(ctx.graph)


@register_pass("infer-shapes", group="cleanup")
def infer_shapes(ctx: PassContext) -> int:
    """Annotate intermediate values with dtypes and shapes (onnx shape inference with data propagation). Annotations
    are not rewrites: the count goes into a note."""
    annotated, problem = annotate_shapes(ctx.graph)
    ctx.note(problem or f"{annotated} values annotated with their dtypes and shapes")
    return 0


def _keeps_interface(cond=None):
    """Wrap a condition: also refuse when dropping the node would only move it (graph output fed by a non-renameable value)."""

    def check(m):
        verdict = True if cond is None else cond(m)
        if verdict is not True:
            return verdict
        out = m.root.outputs[0]
        x = m.values.get("x")
        if x is not None and any(o is out for o in m.graph.outputs) and not renameable(m.graph, x):
            return "its output is a graph output and its input cannot take the name"
        return True

    return check


def _inference_dropout(m) -> bool | str:
    node = m.root
    if len(node.outputs) > 1 and (node.outputs[1].outputs or any(o is node.outputs[1] for o in m.graph.outputs)):
        return "its mask is read, or is a graph output"
    if len(node.inputs) > 2 and node.inputs[2].name:
        mode = const_value(node.inputs[2])
        if mode is None or bool(np.asarray(mode).ravel()[0]):
            return "training_mode is not a constant false"
    return True


TRAINING_RULES = (
    Rewrite("dropout", P.Dropout(Var("x"), ...), lambda m: [m["x"]], _keeps_interface(_inference_dropout)),
)


@register_pass("prune-training-ops", group="cleanup", rules=TRAINING_RULES)
def prune_training_ops(ctx: PassContext) -> None:
    """Drop training-only ops left in inference exports (Dropout in inference mode with its mask unused)."""
    ctx.apply(*TRAINING_RULES)


# ----------------------------------------------------------------------------------------- no-op ops


def _static(shape) -> bool:
    return shape is not None and all(isinstance(d, (int, np.integer)) and d >= 0 for d in shape)


def _cast_to_same_type(m) -> bool:
    dtype = dtype_of(m["x"])
    return dtype is not None and np.dtype(dtype) == onnx.helper.tensor_dtype_to_np_dtype(m.root.attrs["to"])


def _reshape_to_same_shape(m) -> bool:
    x, target = shape_of(m["x"]), m.const("shape")
    if target is None or target.ndim != 1 or x is None:
        return False
    if m.root.attrs.get("allowzero", 0) == 0:
        target = np.array([x[i] if d == 0 and i < len(x) else d for i, d in enumerate(target)], dtype=object)
    if len(target) != len(x):
        return False
    # Equal if every dim agrees; at most one -1 may stand for the one dim left unknown to the check.
    unknown = [i for i, d in enumerate(target) if d == -1]
    mismatched = [i for i, (d, s) in enumerate(zip(target, x))
                  if d != -1 and not (s == d and (isinstance(s, (int, np.integer)) or isinstance(d, str)))]
    if mismatched:
        return False
    if len(unknown) == 1:
        others = [s for i, s in enumerate(x) if i != unknown[0]]
        return all(isinstance(s, (int, np.integer)) for s in others) or _static(x)
    return not unknown


def _reshape_to_own_dims(m) -> bool:
    """A Reshape to a computed shape that lists x's own sizes (tf2onnx's Keras Dense on a 2-D input)."""
    return const_value(m["shape"]) is None and is_own_shape(m["x"], m["shape"], m.root.attrs.get("allowzero", 0))


def _same_axes(m) -> bool:
    def axes(node):
        if "axes" in node.attrs:
            return list(node.attrs["axes"])
        if len(node.inputs) > 1:
            v = const_value(node.inputs[1])
            return None if v is None else v.ravel().tolist()
        return None

    outer, inner = axes(m.root), axes(m.node("inner"))
    return outer is not None and outer == inner and len(set(np.sign(outer))) <= 1


def _identity_perm(m) -> bool:
    perm = m.root.attrs.get("perm")
    return perm is not None and list(perm) == list(range(len(perm)))


def _full_slice(m) -> bool:
    starts, ends = m.const("starts"), m.const("ends")
    steps = const_value(m.root.inputs[4]) if len(m.root.inputs) > 4 and m.root.inputs[4].name else None
    return (np.all(starts == 0) and np.all(ends >= np.iinfo(np.int32).max)
            and (steps is None or np.all(steps == 1)))


def _zero_pads(m) -> bool:
    return bool(np.all(m.const("pads") == 0))


def _expand_to_own_shape(m) -> bool:
    """Expand(x, c) with c no longer than x's rank and each entry 1 or x's own size there."""
    x, c = shape_of(m["x"]), m.const("shape")
    return x is not None and c.ndim == 1 and c.size <= len(x) and \
        all(int(d) == 1 or d == s for d, s in zip(c[::-1].tolist(), x[::-1]))


def _neutral(value: float):
    """x op c == x when c is all `value` and c's broadcast cannot grow x's shape or change its dtype."""

    def check(m) -> bool:
        c, x = m.const("c"), shape_of(m["x"])
        dtype = dtype_of(m["x"])
        if x is None or dtype is None or np.dtype(dtype) != c.dtype or not np.all(c == value):
            return False
        if m.root.op in ("Sub", "Div") and m.root.inputs[0] is not m["x"]:
            return False
        return c.ndim <= len(x) and all(d == 1 or (isinstance(s, (int, np.integer)) and s == d)
                                        for d, s in zip(c.shape[::-1], x[::-1]))

    return check


def _same(m):
    return [m["x"]]


x = Var("x")
NO_OP_RULES = (
    Rewrite("identity", P.Identity(x), _same),
    Rewrite("cast-same-type", P.Cast(x), _same, _cast_to_same_type),
    Rewrite("reshape-same-shape", P.Reshape(x, Const("shape")), _same, _reshape_to_same_shape),
    Rewrite("reshape-of-own-shape", P.Reshape(x, P.Shape(x)), _same),
    Rewrite("reshape-to-own-dims", P.Reshape(x, Var("shape")), _same, _reshape_to_own_dims),
    Rewrite("squeeze-unsqueeze", P.Squeeze(P.Unsqueeze(x, ..., _name="inner"), ...), _same, _same_axes),
    Rewrite("unsqueeze-squeeze", P.Unsqueeze(P.Squeeze(x, ..., _name="inner"), ...), _same, _same_axes),
    Rewrite("transpose-identity", P.Transpose(x), _same, _identity_perm),
    Rewrite("concat-single", P.Concat(x), _same),
    Rewrite("flatten-of-2d", P.Flatten(x), _same, lambda m: rank_of(m["x"]) == 2 and m.root.attrs.get("axis", 1) == 1),
    Rewrite("slice-whole", P.Slice(x, Const("starts"), Const("ends"), ...), _same, _full_slice),
    Rewrite("expand-own-shape", P.Expand(x, Const("shape")), _same, _expand_to_own_shape),
    Rewrite("pad-zero", P.Pad(x, Const("pads"), ...), _same, _zero_pads),
    Rewrite("add-zero", P.Add(x, Const("c")), _same, _neutral(0)),
    Rewrite("sub-zero", P.Sub(x, Const("c")), _same, _neutral(0)),
    Rewrite("mul-one", P.Mul(x, Const("c")), _same, _neutral(1)),
    Rewrite("div-one", P.Div(x, Const("c")), _same, _neutral(1)),
)
NO_OP_RULES = tuple(Rewrite(r.name, r.pattern, r.replace, _keeps_interface(r.condition)) for r in NO_OP_RULES)


def _reshape_chain(m):
    attrs = {"allowzero": m.root.attrs["allowzero"]} if "allowzero" in m.root.attrs else {}   # from opset 14
    (out,) = m.op("Reshape", [m["x"], m["shape"]], attrs, dtype=m.root.outputs[0].dtype, shape=m.root.outputs[0].shape)
    return [out]


def _static_target(m) -> np.ndarray | None:
    """A computed Reshape target as a constant: its entries (graph/dims.shape_entries) all known ints but at most
    one size of another value, which becomes -1 (the one entry the input's size then determines; torch's legacy
    exporter writes tensordot's reshapes as Concat(Slice(Shape(x)), [-1]))."""
    entries = shape_entries(m["shape"])
    if entries is None or const_value(m["shape"]) is not None:
        return None
    sizes = []
    for e in entries:
        if isinstance(e, tuple):
            dim = (shape_of(e[0]) or [None] * (e[1] + 1))[e[1]]
            e = int(dim) if isinstance(dim, (int, np.integer)) else -1
        sizes.append(e)
    if sizes.count(-1) > 1:
        return None
    if 0 in sizes:
        return None   # "the input's size" (or, with allowzero, a -1 that cannot be inferred): left as it is
    return np.array(sizes, np.int64)


def _with_static_target(m):
    """The Reshape to the constant target; its output's shape the entries' sizes (a named dim where one is), and
    marked for the values after it to be inferred again (`_reinfer_after`)."""
    target = _static_target(m)
    dims = [source_dim(*e) if isinstance(e, tuple) and size == -1 else int(size)
            for e, size in zip(shape_entries(m["shape"]), target)]
    attrs = {"allowzero": m.root.attrs["allowzero"]} if "allowzero" in m.root.attrs else {}   # from opset 14
    (out,) = m.op("Reshape", [m["x"], m.constant(f"{m.root.name}/shape", target)], attrs,
                  dtype=m.root.outputs[0].dtype, shape=[d if d != -1 else None for d in dims])
    m.graph.__dict__.setdefault("_ctropt_reinfer", []).append(out)
    return [out]


def _reinfer_after(graph: gs.Graph) -> None:
    """Shapes inferred again for the values a static Reshape target feeds (inference saw the computed target's
    sizes as unknown, and so every value after it)."""
    stack = graph.__dict__.pop("_ctropt_reinfer", [])
    if not stack:
        return
    outputs, seen = {id(t) for t in graph.outputs}, {id(t) for t in stack}   # those keep the sizes they were given
    cleared = []
    while stack:
        t = stack.pop()
        for n in t.outputs:
            for o in n.outputs:
                if id(o) not in seen and id(o) not in outputs:
                    seen.add(id(o))
                    cleared.append((o, o.shape))
                    o.shape = None
                    stack.append(o)
    annotate_shapes(graph)
    for o, shape in cleared:   # the sizes are the same as before: a number known before or now is kept
        if o.shape is None or shape is None or len(o.shape) != len(shape):
            o.shape = o.shape if o.shape is not None else shape   # inference not run (over 2 GiB) or no better
            continue
        o.shape = [old if isinstance(old, (int, np.integer)) and not isinstance(new, (int, np.integer)) else new
                   for old, new in zip(shape, o.shape)]


def _parts_gathered_alike(m) -> bool:
    """Concat(Gather(x_1, i), ..., Gather(x_k, i)) along an axis other than the rows, each Gather read there only."""
    gathers = [u.inputs[0] if len(u.inputs) == 1 and len(u.outputs) == 1 else None for u in m.root.inputs]
    if len(gathers) < 2 or any(g is None or g.op != "Gather" or g.attrs.get("axis", 0) != 0 for g in gathers):
        return False
    index, rank = gathers[0].inputs[1], rank_of(gathers[0].inputs[0])   # a 1-D index keeps the rank
    if rank_of(index) != 1 or any(g.inputs[1] is not index for g in gathers) or not rank \
            or m.root.attrs.get("axis", 0) % rank == 0:
        return False
    # computed values (a constant table would be copied whole) with the same rows (else their Concat would fail)
    sources = [g.inputs[0] for g in gathers]
    return all(const_value(s) is None for s in sources) and \
        all(same_size((s, 0), (sources[0], 0)) for s in sources[1:])


def _gathered_once(m):
    """One Gather of the parts' Concat: the rows picked once (dedup-user-side's distinct users' ids, joined for one
    fused lookup, are then its key's rows)."""
    gathers = [u.inputs[0] for u in m.root.inputs]
    (cat,) = m.op("Concat", [g.inputs[0] for g in gathers], {"axis": m.root.attrs.get("axis", 0)})
    out = m.root.outputs[0]
    return m.op("Gather", [cat, gathers[0].inputs[1]], {"axis": 0}, dtype=out.dtype, shape=out.shape)


def _casts_alike(m) -> bool:
    """Concat(Cast(x_1), ..., Cast(x_k)): every part a Cast to one type of one input type, read only here."""
    casts = [u.inputs[0] if len(u.inputs) == 1 and len(u.outputs) == 1 else None for u in m.root.inputs]
    if len(casts) < 2 or any(c is None or c.op != "Cast" or c.domain for c in casts):
        return False
    return len({c.attrs.get("to") for c in casts}) == 1 and len({dtype_of(c.inputs[0]) for c in casts}) == 1 and \
        dtype_of(casts[0].inputs[0]) is not None


def _cast_once(m):
    """One Cast of the parts' Concat (deepctr-torch's per-column Casts of its id columns, joined for one lookup)."""
    casts = [u.inputs[0] for u in m.root.inputs]
    (cat,) = m.op("Concat", [c.inputs[0] for c in casts], {"axis": m.root.attrs.get("axis", 0)},
                  dtype=dtype_of(casts[0].inputs[0]))
    out = m.root.outputs[0]
    return m.op("Cast", [cat], {"to": casts[0].attrs["to"]}, dtype=out.dtype, shape=out.shape)


def slice_bounds(u: gs.Tensor, axis: int) -> tuple | None:
    """(data, start, end) when u is Slice(data) of steps 1 on `axis` only, constant bounds within the axis's known
    size (no clamping)."""
    n = u.inputs[0] if len(u.inputs) == 1 else None
    if n is None or n.op != "Slice" or n.domain or len(n.inputs) < 4:
        return None
    data, rank = n.inputs[0], rank_of(n.inputs[0])
    values = [const_value(t) for t in n.inputs[1:]]
    if rank is None or any(v is None or v.size != 1 for v in values) or (len(values) > 3 and int(values[3].ravel()[0]) != 1):
        return None
    start, end, at = (int(v.ravel()[0]) for v in values[:3])
    size = (shape_of(data) or [None] * rank)[at % rank]
    if at % rank != axis or not isinstance(size, (int, np.integer)) or not 0 <= start < end <= size:
        return None
    return data, start, end


def _adjacent_slices(m) -> bool:
    """Concat(Slice(x, a, b), Slice(x, b, c), ...) on the sliced axis: the parts are one range of x."""
    rank = rank_of(m.root.inputs[0])
    if not rank or len(m.root.inputs) < 2:
        return False
    parts = [slice_bounds(u, m.root.attrs.get("axis", 0) % rank) for u in m.root.inputs]
    if any(p is None or p[0] is not parts[0][0] for p in parts):
        return False
    return all(a[2] == b[1] for a, b in zip(parts, parts[1:]))


def _one_slice(m):
    """The range as one Slice (deepctr-torch's dense columns, sliced one by one and joined)."""
    axis = m.root.attrs.get("axis", 0) % rank_of(m.root.inputs[0])
    first = slice_bounds(m.root.inputs[0], axis)
    last = slice_bounds(m.root.inputs[-1], axis)
    out = m.root.outputs[0]
    bounds = [m.constant(f"{m.root.name}/{k}", np.array([v], np.int64)) for k, v in
              (("start", first[1]), ("end", last[2]), ("axis", axis))]
    return m.op("Slice", [first[0], *bounds], dtype=out.dtype, shape=out.shape)


def _no_zero_dims(m) -> bool:
    return bool(np.all(m.const("shape") != 0)) or m.root.attrs.get("allowzero", 0) == 1


def _compose_transposes(m):
    inner, outer = m.node("inner").attrs.get("perm"), m.root.attrs.get("perm")
    if inner is None or outer is None:
        return None
    perm = [int(inner[i]) for i in outer]
    if perm == list(range(len(perm))):
        return [m["x"]]
    (out,) = m.op("Transpose", [m["x"]], {"perm": perm}, dtype=m.root.outputs[0].dtype, shape=m.root.outputs[0].shape)
    return [out]


def _stacked_part(m):
    """Gather(Concat(Unsqueeze(x_0, k), …, axis=k), c, axis=k) with c a scalar constant: x_c (torch.stack then
    indexing one of the stacked values; `graph.edit.stacked_part`)."""
    if not shape_of(m.node("cat").outputs[0]) or m.const("index").ndim != 0 or \
            any(o is m.root.outputs[0] for o in m.graph.outputs):
        return None
    x = stacked_part(m.root)
    return None if x is None else [x]


def _covered_by_broadcast(m):
    """Tile(x, r) read only by broadcasting elementwise ops, each of which also reads a value as wide as the Tile on
    every repeated axis (where x is 1): x broadcasts there to the same result, so the copy is dropped (TransAct's
    padding mask tiled to [B, L, D] before two Wheres: 2.5× the Where itself)."""
    out, x, reps = m.root.outputs[0], shape_of(m["x"]), m.const("repeats")
    if x is None or reps.ndim != 1 or reps.size != len(x) or any(o is out for o in m.graph.outputs):
        return None
    tiled = [i for i, r in enumerate(reps.tolist()) if r != 1]
    if not tiled or any(x[i] != 1 for i in tiled) or not out.outputs:
        return None
    for reader in out.outputs:
        if reader.op not in BROADCASTING:
            return None
        others = [shape_of(t) for t in reader.inputs if t is not out]
        if not all(any(s is not None and len(s) >= len(x) and s[i - len(x)] == reps[i] for s in others)
                   for i in tiled):
            return None
    return [m["x"]]


def _overwritten_where(m):
    """Where(c, a, Where(c, b, x)) = Where(c, a, x): every position the inner Where fills from b the outer one
    fills from a (TransAct's masked fill with 0 then -inf before its max pooling). b must not widen the shape."""
    b = shape_of(m["b"])
    if b is None or any(d != 1 for d in b) or len(b) > (len(shape_of(m["x"]) or [])):
        return None
    (out,) = m.op("Where", [m["c"], m["a"], m["x"]], dtype=m.root.outputs[0].dtype, shape=m.root.outputs[0].shape)
    return [out]


def _sliced_operands(m):
    """Slice(f(a, b, …)) with f a broadcasting elementwise op read by this Slice only = f(Slice(a), Slice(b), …):
    each operand sliced on the sliced axes it holds at the result's length, left whole on those where it broadcasts
    (length 1, or no such axis). Only for a Slice that keeps at most half of the result, on axes whose lengths are
    known and above 1 (a Slice of the first tokens of TransAct's masked sequence: the Where then runs on them only)."""
    f, out = m.node("f"), m.root.outputs[0]
    res, axes = shape_of(f.outputs[0]), m.const("axes")
    steps = const_value(m.root.inputs[4]) if len(m.root.inputs) > 4 and m.root.inputs[4].name else None
    if not res or f.op == "BitShift" or f.attrs or (len(m.root.inputs) > 4 and m.root.inputs[4].name and steps is None):
        return None
    axes = [int(a) % len(res) for a in np.atleast_1d(axes)]
    kept = shape_of(out)
    if len(set(axes)) != len(axes) or kept is None or any(
            not isinstance(res[a], (int, np.integer)) or res[a] <= 1 or not isinstance(kept[a], (int, np.integer))
            for a in axes) or 2 * int(np.prod([kept[a] for a in axes])) > int(np.prod([res[a] for a in axes])):
        return None
    bounds = [np.atleast_1d(m.const("starts")), np.atleast_1d(m.const("ends"))] + \
        ([np.atleast_1d(steps)] if steps is not None else [])
    operands = []
    for i, t in enumerate(f.inputs):
        s = shape_of(t)
        if s is None or len(s) > len(res):
            return None
        lead = len(res) - len(s)
        held = [k for k, a in enumerate(axes) if a >= lead and s[a - lead] != 1]
        if any(s[axes[k] - lead] != res[axes[k]] for k in held):
            return None   # neither the result's length nor 1: not provably a broadcast
        if not held:
            operands.append(t)
            continue
        pick = [m.constant(f"{m.root.name}/{what}{i}", b[held].astype(np.int64))
                for what, b in zip(("starts", "ends", "steps"), bounds)]
        local = m.constant(f"{m.root.name}/axes{i}", np.array([axes[k] - lead for k in held], np.int64))
        (part,) = m.op("Slice", [t, pick[0], pick[1], local, *pick[2:]], dtype=t.dtype)
        operands.append(part)
    (y,) = m.op(f.op, operands, dtype=out.dtype, shape=out.shape)
    return [y]


def _unit_moves(s: gs.Tensor, graph: gs.Graph) -> tuple[gs.Tensor, list] | None:
    """(x, axes) when `s` is x moved by Unsqueeze, Transpose and Squeeze of inserted axes only, each value between
    read once: `axes` names, for each axis of s, the axis of x it is or "u" (an inserted axis of length 1)."""
    chain, t = [], s
    while t.inputs and t.inputs[0].op in ("Unsqueeze", "Transpose", "Squeeze"):
        if t is not s and len(t.outputs) != 1 or any(t is o for o in graph.outputs):
            return None
        chain.append(t.inputs[0])
        t = t.inputs[0].inputs[0]
    rank = len(shape_of(t) or [])
    if not chain or not rank:
        return None
    axes = list(range(rank))
    for node in reversed(chain):
        if node.op == "Transpose":
            perm = node.attrs.get("perm", list(range(len(axes)))[::-1])
            axes = [axes[int(p)] for p in perm]
            continue
        at = axes_of(node)
        if at is None:
            return None
        if node.op == "Unsqueeze":
            out_rank = len(axes) + len(at)
            for a in sorted(a % out_rank for a in at):
                axes.insert(a, "u")
        else:
            drop = {a % len(axes) for a in at}
            if any(axes[a] != "u" for a in drop):
                return None
            axes = [a for i, a in enumerate(axes) if i not in drop]
    return t, axes


def _part_gathered_first(m):
    """Gather(moves(x), c, axis) with c one constant index on an axis of x, every reader of moves(x) such a Gather:
    Gather(x, c) on that axis of x, then only the moves that remain (torch's packed in-projection: [L, B, 3, E]
    unsqueezed, transposed to [3, L, B, 1, E] and squeezed before q, k and v are taken: each part is read where it
    is instead of the whole being copied first)."""
    moved = _unit_moves(m["s"], m.graph)
    if moved is None or m.const("index").ndim != 0:
        return None
    x, axes = moved
    readers = m["s"].outputs
    if any(r.op != "Gather" or const_value(r.inputs[1]) is None or const_value(r.inputs[1]).ndim != 0 or
           r.attrs.get("axis", 0) % len(axes) != m.root.attrs.get("axis", 0) % len(axes) for r in readers):
        return None
    picked = axes[m.root.attrs.get("axis", 0) % len(axes)]
    if picked == "u":
        return None
    rest = [a for i, a in enumerate(axes) if i != m.root.attrs.get("axis", 0) % len(axes)]
    kept = sorted(a for a in rest if a != "u")
    out = m.root.outputs[0]
    (y,) = m.op("Gather", [x, m["index"]], {"axis": picked}, dtype=out.dtype)
    order = [kept.index(a) for a in rest if a != "u"]
    if order != sorted(order):
        (y,) = m.op("Transpose", [y], {"perm": order}, dtype=out.dtype)
    units = [i for i, a in enumerate(rest) if a == "u"]
    if units and int(m.graph.opset or 13) >= 13:
        (y,) = m.op("Unsqueeze", [y, m.constant(f"{m.root.name}/units", np.array(units, np.int64))], dtype=out.dtype)
    elif units:   # axes an attribute before opset 13
        (y,) = m.op("Unsqueeze", [y], {"axes": units}, dtype=out.dtype)
    y.shape = out.shape
    return [y]


CHAIN_RULES = (
    Rewrite("stacked-part", P.Gather(P.Concat(Var(), ..., _name="cat", _shared=True), Const("index")),
            _stacked_part),
    Rewrite("gathered-once", P.Concat(P.Gather(Var(), Var()), ...), _gathered_once, _parts_gathered_alike),
    Rewrite("cast-once", P.Concat(P.Cast(Var()), ...), _cast_once, _casts_alike),
    Rewrite("adjacent-slices", P.Concat(P.Slice(Var(), ...), ...), _one_slice, _adjacent_slices),
    Rewrite("reshape-reshape", P.Reshape(P.Reshape(x, Var()), Const("shape")), _reshape_chain,
            _no_zero_dims),
    Rewrite("transpose-transpose", P.Transpose(P.Transpose(x, _name="inner")), _compose_transposes,
            _keeps_interface()),
    Rewrite("tile-into-broadcast", P.Tile(x, Const("repeats")), _covered_by_broadcast),
    Rewrite("part-gathered-first", P.Gather(Var("s"), Const("index")), _part_gathered_first),
    Rewrite("where-overwritten", P.Where(Var("c"), Var("a"), P.Where(Var("c"), Var("b"), Var("x"), _shared=True)),
            _overwritten_where),
    Rewrite("slice-before-elementwise", P.Slice(P["|".join(sorted(BROADCASTING))](..., _name="f"), Const("starts"), Const("ends"),
                                                Const("axes"), ...), _sliced_operands),
)


@register_pass("eliminate-identity", group="cleanup", rules=NO_OP_RULES + CHAIN_RULES)
def eliminate_identity(ctx: PassContext) -> None:
    """Remove ops that do nothing (Identity, Cast/Reshape/Expand to the same type/shape, x*1, ...), merge
    Reshape/Transpose chains, and drop copies that broadcasting makes (a Tile read by elementwise ops, a Where
    overwritten under the same condition, an elementwise op computed whole for a Slice of it)."""
    if any(t.dtype is None or t.shape is None for g in iter_graphs(ctx.graph) for n in g.nodes for t in n.outputs):
        annotate_shapes(ctx.graph)  # the no-op rules read types and shapes: known on the first run as on a second
    # A Loop body's values that change per iteration may change shape after the first one (PaddleRec DIEN with
    # dynamic history: a "Reshape to the same shape" removed on the strength of a declared scalar that is [1] from
    # the first iteration on gave a Slice 2-D ends): the rules see their shapes as unknown.
    hidden = [(t, t.shape) for t in loop_varying_values(ctx.graph) if t.shape is not None]
    for t, _ in hidden:
        t.shape = None
    try:
        ctx.apply(*NO_OP_RULES, *CHAIN_RULES)
    finally:
        for t, shape in hidden:
            t.shape = shape


STATIC_TARGET_RULES = (
    Rewrite("static-reshape-target", P.Reshape(x, Var("shape")), _with_static_target,
            lambda m: _static_target(m) is not None or "its target is constant, or more than one size is unknown",
            subgraphs=False),   # a Loop body's sizes may change per iteration (paddle2onnx declares the first's)
)


@register_pass("static-reshape-targets", group="fusion", speed=False, rules=STATIC_TARGET_RULES)
def static_reshape_targets(ctx: PassContext) -> None:
    """Reshape targets computed from Shape ops whose sizes are known but the batch's → constants with -1 for it
    (torch's legacy tensordot), the values after them inferred again: torch's squeeze(dim), an If on that axis's
    size, then folds, and sum-into-gemm sees the logit's terms. A fusion pass: after those that run a region on
    fewer rows or tokens (dedup-user-side, remove-attention-padding: their computed sizes must stay computed) and
    after fuse-fc (its flattened layers' targets, read at run time, are made constant here too where they can be)."""
    kept = [(t, t.shape) for g in iter_graphs(ctx.graph) for n in g.nodes for t in n.outputs]
    annotate_shapes(ctx.graph, refine=True)   # the sizes of values other passes built, as a second run sees them
    done = 0
    for _ in range(8):   # a target made constant makes the sizes after it known: another target may follow
        if not ctx.apply(*STATIC_TARGET_RULES):
            break
        done += 1
        _reinfer_after(ctx.graph)
    if done:
        tidy(ctx)
    else:   # nothing rewritten: the model as it came (the refined sizes would let later passes see more)
        for t, shape in kept:
            t.shape = shape


# ----------------------------------------------------------------------------------------- constants


@register_pass("fold-constants", group="cleanup")
def fold_constants(ctx: PassContext) -> int:
    """Evaluate subgraphs whose inputs are all constant (onnx-graphsurgeon + onnxruntime), up to a size cap."""
    before = _node_total(ctx.graph)
    cap = int(ctx.options.get("fold_size_cap", FOLD_SIZE_CAP))
    saved = G_LOGGER.severity
    G_LOGGER.severity = G_LOGGER.ERROR
    declared = [(t.name, t.dtype, t.shape) for t in ctx.graph.outputs]
    try:
        ctx.graph.toposort(recurse_subgraphs=True, mode="nodes")
        ctx.graph.fold_constants(size_threshold=cap, recurse_subgraphs=True, error_ok=True)
        ctx.graph.cleanup(remove_unused_graph_inputs=False)
    finally:
        G_LOGGER.severity = saved
    _keep_declared_outputs(ctx.graph, declared)
    return max(before - _node_total(ctx.graph), 0)


def _keep_declared_outputs(graph: gs.Graph, declared: list) -> None:
    """A graph output folded to a constant would be declared with the constant's dims ([?] becomes [2]): it is
    an Identity of the constant instead, declared as before."""
    for i, (name, dtype, shape) in enumerate(declared):
        t = graph.outputs[i]
        if isinstance(t, gs.Constant) and (shape is None or list(shape) != list(t.values.shape)):
            t.name = unique_name(graph, f"{name}/folded")
            out = gs.Variable(name, dtype=dtype or t.values.dtype, shape=shape)
            graph.nodes.append(gs.Node("Identity", unique_name(graph, f"{name}/keep"), inputs=[t], outputs=[out]))
            graph.outputs[i] = out


def _constant_key(c: gs.Constant):
    values = c.values
    store = weights.active()
    ref = store.reference(values) if store is not None else None
    if ref is not None:  # a stored table: known by where it is, not hashed (gigabytes)
        return (values.dtype.str, values.shape, str(weights.external_ref(ref)))
    return (values.dtype.str, values.shape, hashlib.sha1(np.ascontiguousarray(values).tobytes()).hexdigest())


@register_pass("dedup-initializers", group="cleanup")
def dedup_initializers(ctx: PassContext) -> int:
    """Make identical constants (same dtype, shape and bytes) one tensor, within each scope and from outer scopes."""

    def visit(graph: gs.Graph, visible: dict) -> int:
        pool, merged = dict(visible), 0
        interface = {id(t) for t in list(graph.inputs) + list(graph.outputs)}
        for node in graph.nodes:
            for i, t in enumerate(node.inputs):
                if not isinstance(t, gs.Constant) or id(t) in interface:
                    continue
                key = _constant_key(t)
                keep = pool.setdefault(key, t)
                if keep is not t:
                    node.inputs[i] = keep
                    merged += 1
        for node in graph.nodes:
            for attr in node.attrs.values():
                for sub in (attr if isinstance(attr, list) else [attr]):
                    if isinstance(sub, gs.Graph):
                        merged += visit(sub, pool)
        return merged

    merged = visit(ctx.graph, {})
    ctx.graph.cleanup(remove_unused_graph_inputs=False)
    return merged


NONDETERMINISTIC = {"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial",
                    "Bernoulli", "Dropout"}


def _attr_key(value):
    if isinstance(value, gs.Constant):
        return ("tensor",) + _constant_key(value)
    if isinstance(value, (list, tuple)):
        return tuple(_attr_key(v) for v in value)
    if isinstance(value, np.ndarray):
        return (value.dtype.str, value.shape, value.tobytes())
    return value


@register_pass("eliminate-common-subexpressions", group="cleanup")
def eliminate_common_subexpressions(ctx: PassContext) -> int:
    """Compute once what several nodes compute identically (same op, attributes and inputs)."""
    merged = 0
    for g in list(iter_graphs(ctx.graph)):
        g.toposort(recurse_subgraphs=False, mode="nodes")
        seen: dict = {}
        graph_outputs = {id(t) for t in g.outputs}
        for node in list(g.nodes):
            if node.op == "Identity" and all(id(o) in graph_outputs for o in node.outputs):
                continue  # a graph output equal to another is an Identity of it: merging two only chains them
            if node.op in NONDETERMINISTIC or not node.outputs or any(
                isinstance(v, gs.Graph) or (isinstance(v, list) and any(isinstance(s, gs.Graph) for s in v))
                for v in node.attrs.values()
            ):
                continue
            try:
                key = (node.op, node.domain or "", tuple(id(t) for t in node.inputs), len(node.outputs),
                       tuple(sorted((k, _attr_key(v)) for k, v in node.attrs.items())))
                hash(key)
            except TypeError:
                continue
            keep = seen.setdefault(key, node)
            if keep is node:
                continue
            replace_outputs(g, node, list(keep.outputs))
            merged += 1
    if merged:
        ctx.graph.cleanup(remove_unused_graph_inputs=False)
    return merged


def tidy(ctx: PassContext) -> None:
    """What the cleanup passes would still find in the nodes a pass built (casts to the same type, equal
    constants, shapes known statically): done by that pass, so that it is idempotent under `all`."""
    for _ in range(2):   # again where CSE merged values: a rule that wants its parts read once may apply then
        for cleanup in (fold_constants, eliminate_identity, dedup_initializers, eliminate_common_subexpressions):
            done = PassContext(ctx.graph, ctx.target, dict(ctx.options))
            cleanup(done)
        if not done.rewrites:
            break
