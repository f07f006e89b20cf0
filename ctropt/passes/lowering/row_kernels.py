"""Rows looked up and rows deduplicated → ctropt's ``GatherRows`` and ``UniqueRows`` kernels for onnxruntime.

`gather-rows-kernel`: a CTR model reads thousands of ids per batch (fields × batch, histories × batch), and
onnxruntime's CPU Gather costs about 8 ns per index whatever the row's width, its per-index copy being a function
call: a [1000, 8] table read at [256, 26] ids takes about 50 µs, a quarter of an optimized PaddleRec DeepFM
(1 thread). The kernel copies each row inline, 3–5× faster (`git show 8b89a5f:benchmarks/RESULTS.md`). Any float table (``GatherRows``), or int64 one
(``GatherRowsInt64``: the positions other passes gather), of rank 1 to 8, constant or computed, with int32 or int64
indices; an index out of range is an error there as here. A lookup at ``ids + offsets`` (fuse-parallel-embeddings'
per-field offsets into its concatenated table, Expanded to the ids' shape or not) gives the offsets to the kernel,
which adds them as it reads: the Shape, Expand and Add go (three nodes of a dozen in a small model's lookup).
A lookup of several fields' ids (a Concat of [B, k] ids) flattened to [B, K·E] and, where it is the first part of a
Concat with dense [B, w] values, those values → ``GatherFields``: the ids' Concat, the Reshape and the Concat go.

`unique-rows-kernel`: dedup-user-side finds a batch's distinct users with ``Unique(key, axis=0, sorted=0)`` over
[B, K] int64 rows (ids and histories); onnxruntime sorts them, 14–80 µs at B = 256, on every request. The kernel
hashes the rows (the same four outputs, in the same order: first occurrences), reading the int64 key's parts in
place where the key is their Concat (the Concat goes: 13 µs of a one-user BST request); float32 rows
(deepctr-torch's columns) by their bits, ``UniqueRowsFloat`` (rows found equal are equal values, all deduplication
needs).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from ... import kernels
from ...graph.dims import same_size
from ...graph.edit import Builder, const_value, dtype_of, rank_of, read_once, replace_outputs, shape_of
from ...patterns import Match, P, Rewrite, Var
from ..cleanup import slice_bounds
from ..embedding.parallel import read_field_rows
from ..registry import PassContext, register_pass


KERNEL_OF = {np.dtype(np.float32): "GatherRows", np.dtype(np.int64): "GatherRowsInt64"}
MAX_PARTS = 512   # GatherFields' ids and dense inputs (gather_fields.c)
UNIQUE_OF = {np.dtype(np.int64): "UniqueRows", np.dtype(np.float32): "UniqueRowsFloat"}   # float32: by their bits
MAX_KEY_PARTS = 64   # unique_rows.c's


def _is_row_lookup(m: Match) -> bool | str:
    table, ids, rank = m["table"], m["ids"], rank_of(m["table"])
    if dtype_of(table) is None or np.dtype(dtype_of(table)) not in KERNEL_OF or rank is None or not 1 <= rank <= 8:
        return "not a float32 or int64 table of rank 1 to 8"
    if (rank_of(ids) or 0) > 8:
        return "indices of rank above 8"
    if np.dtype(dtype_of(table)) == np.int64 and isinstance(shape_of(table)[0], (int, np.integer)):
        return "int64 values of a static length (shape arithmetic, which onnxruntime folds: left as Gather)"
    if dtype_of(ids) is None or np.dtype(dtype_of(ids)) not in (np.int32, np.int64):
        return "indices of unknown type"
    if m.root.attrs.get("axis", 0) % rank != 0:
        return "not a lookup of rows (axis 0)"
    return True


def _offset_ids(ids) -> tuple | None:
    """(x, offsets) for ids = x + offsets, offsets a constant [K] over x's last axis of K (fuse-parallel-embeddings'
    per-field offsets, Expanded to x's shape or not): the kernel adds them itself."""
    add = ids.inputs[0] if len(ids.inputs) == 1 else None
    if add is None or add.op != "Add" or add.domain not in (None, "", "ai.onnx"):
        return None
    for x, off in (add.inputs, add.inputs[::-1]):
        made = off.inputs[0] if len(off.inputs) == 1 else None
        if made is not None and made.op == "Expand" and made.inputs[1].inputs \
                and made.inputs[1].inputs[0].op == "Shape" and made.inputs[1].inputs[0].inputs[0] is x \
                and not made.inputs[1].inputs[0].attrs:
            off = made.inputs[0]
        value, shape = const_value(off), shape_of(x)
        if value is not None and value.ndim == 1 and value.size and shape and value.dtype == dtype_of(x) \
                and isinstance(shape[-1], (int, np.integer)) and shape[-1] == value.size:
            return x, off
    return None


def _to_kernel(m: Match) -> list:
    out, op = m.root.outputs[0], KERNEL_OF[np.dtype(dtype_of(m["table"]))]
    rows = shape_of(m["table"])[0]
    fields = read_field_rows(m["ids"], int(rows)) if isinstance(rows, (int, np.integer)) else None
    if fields is not None:   # the kernel takes a size and an offset per column of the ids' last axis
        fields = _per_last_axis(*fields)
    if fields is not None:   # fuse-parallel-embeddings' joined table: each id checked against its own field's rows
        x, sizes, offsets = fields
        attrs = {"sizes": [int(v) for v in sizes]}
        names = _column_names(x, len(sizes))
        if names:   # the kernel's error names the input an id out of its field came from
            attrs["names"] = "\n".join(names)
        return m.op(op, [m["table"], x, m.constant("offsets", offsets)], attrs,
                    name=f"{m.root.name}/{op}", domain=kernels.DOMAIN, dtype=out.dtype, shape=out.shape)
    inputs = [m["table"], *(_offset_ids(m["ids"]) or [m["ids"]])]
    return m.op(op, inputs, name=f"{m.root.name}/{op}", domain=kernels.DOMAIN, dtype=out.dtype, shape=out.shape)


def _per_last_axis(x: gs.Tensor, sizes: np.ndarray, offsets: np.ndarray) -> tuple | None:
    """(x, sizes, offsets) with one entry per column of x's last axis (one field's [B, T] ids, which the joined
    table's other readers have, repeat it); None where that axis is not static (then the ids stay as computed)."""
    shape = shape_of(x)
    k = shape[-1] if shape and len(shape) >= 2 else None
    if k == len(sizes):
        return x, sizes, offsets
    if len(sizes) == 1 and isinstance(k, (int, np.integer)) and k > 0:
        return x, np.repeat(sizes, k), np.repeat(offsets, k)
    return None


_SAME_IDS = {"Cast", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Identity", "Slice"}   # Slice: a column of X


def _column_names(x: gs.Tensor, k: int, depth: int = 0) -> list[str] | None:
    """The name of the graph input (or, failing that, the value) each of x's k last-axis columns comes from: x a
    Concat of [B, w] parts on its last axis, the [B] parts of a Concat on axis 0 turned to columns (Reshape and
    Transpose), or ids as they came, through casts and reshapes. None where the columns cannot be told apart."""
    made = x.inputs[0] if len(x.inputs) == 1 and depth < 16 else None
    if made is not None and made.op == "Concat" and not made.domain and made.attrs.get("axis") in (-1, (rank_of(x) or 0) - 1):
        widths = [(shape_of(p) or [None])[-1] for p in made.inputs]
        if all(isinstance(w, (int, np.integer)) for w in widths) and sum(widths) == k:
            parts = [_column_names(p, int(w), depth + 1) for p, w in zip(made.inputs, widths)]
            return None if any(p is None for p in parts) else [n for p in parts for n in p]
    if made is not None and made.op == "Transpose" and made.inputs[0].inputs and \
            made.inputs[0].inputs[0].op == "Reshape":   # the flat form: Concat of k [B] ids on axis 0, [k, B] → [B, k]
        cat = made.inputs[0].inputs[0].inputs[0].inputs
        if cat and cat[0].op == "Concat" and cat[0].attrs.get("axis") == 0 and len(cat[0].inputs) == k:
            return [_source(p, depth) for p in cat[0].inputs]
    return [_source(x, depth)] * k


def _source(t: gs.Tensor, depth: int) -> str:
    while len(t.inputs) == 1 and t.inputs[0].op in _SAME_IDS and not t.inputs[0].domain and depth < 16:
        t, depth = t.inputs[0].inputs[0], depth + 1
    return t.name


GATHER_RULES = (Rewrite("gather-rows", P.Gather(Var("table"), Var("ids"), _domain=""), _to_kernel, _is_row_lookup, subgraphs=False),)


def _id_parts(ids: gs.Tensor) -> list[gs.Tensor] | None:
    """The fields' ids a lookup reads: the parts of a Concat on the last axis of [B, k] ids, or the [B, K] ids."""
    cat = ids.inputs[0] if len(ids.inputs) == 1 else None
    parts = list(cat.inputs) if cat is not None and cat.op == "Concat" and not cat.domain and \
        cat.attrs.get("axis") in (1, -1) else [ids]
    ok = all(rank_of(p) == 2 and dtype_of(p) == dtype_of(ids) for p in parts)
    return parts if ok and np.dtype(dtype_of(ids)) in (np.int32, np.int64) else None


def _flattened_lookup(reshape: gs.Node) -> tuple | None:
    """(GatherRows node, id parts) when `reshape` (a Reshape or Flatten, after others read only there) flattens a
    float GatherRows over [B, K] ids to [B, K·D], rows kept (proven by graph/dims), the lookup read only there."""
    x = reshape.inputs[0]
    g = x.inputs[0] if len(x.inputs) == 1 else None
    while g is not None and g.op in ("Reshape", "Flatten") and not g.domain and len(x.outputs) == 1:
        x = g.inputs[0]
        g = x.inputs[0] if len(x.inputs) == 1 else None
    if g is None or g.op != "GatherRows" or g.domain != kernels.DOMAIN or len(x.outputs) != 1 or rank_of(g.inputs[1]) != 2:
        return None
    out, shape = reshape.outputs[0], shape_of(x)
    if rank_of(out) != 2 or not shape or not all(isinstance(d, (int, np.integer)) for d in shape[1:]) or \
            shape_of(out)[1] != int(np.prod(shape[1:])) or not same_size((out, 0), (x, 0)):
        return None
    parts = _id_parts(g.inputs[1])
    return (g, parts) if parts else None


def _dense_after(out: gs.Tensor, graph: gs.Graph) -> tuple[gs.Node, list] | None:
    """(Concat, its other parts) when `out` is read only as the first part of a Concat on the last axis whose other
    parts are float [B, w] values: the kernel writes them beside the lookups."""
    if len(out.outputs) != 1 or out in graph.outputs:
        return None
    cat = out.outputs[0]
    if cat.op != "Concat" or cat.domain or cat.attrs.get("axis") not in (1, -1) or cat.inputs[0] is not out:
        return None
    rest = list(cat.inputs[1:])
    if any(rank_of(p) not in (1, 2) or dtype_of(p) != np.dtype(np.float32) or p is out for p in rest):
        return None
    return cat, rest


def fuse_gather_fields(ctx: PassContext) -> int:
    """GatherRows over the Concat of several fields' ids, flattened to [B, K·D] (and the first part of a Concat with
    dense values) → one GatherFields that reads the ids inputs where they are and writes each row once."""
    done = 0
    for reshape in [n for n in ctx.graph.nodes if n.op in ("Reshape", "Flatten") and not n.domain]:
        found = _flattened_lookup(reshape)
        if found is None:
            continue
        (g, parts), out = found, reshape.outputs[0]
        dense = _dense_after(out, ctx.graph)
        end, rest = (dense[0], dense[1]) if dense else (reshape, [])
        if len(parts) + len(rest) > MAX_PARTS:
            continue
        offsets = g.inputs[2] if len(g.inputs) > 2 and g.inputs[2].name else gs.Variable.empty()
        ctx.matches += 1
        b = Builder(ctx.graph, f"{g.name}/fields")
        y = end.outputs[0]
        sizes = {a: g.attrs[a] for a in ("sizes", "names") if a in g.attrs} or None
        made = b.op("GatherFields", [g.inputs[0], offsets, *parts, *rest], sizes, domain=kernels.DOMAIN, dtype=y.dtype,
                    shape=y.shape)
        replace_outputs(ctx.graph, end, [made])
        end.outputs.clear()
        done += 1
    return _counted(ctx, done, "lookup(s) of several fields' ids, flattened (beside dense values) → GatherFields")


def _counted(ctx: PassContext, done: int, what: str) -> int:
    """`done` rewrites of a step of gather-rows-kernel: counted, the graph cleaned up, a note."""
    if done:
        ctx.rewrites += done
        ctx.graph.cleanup()
        ctx.note(f"{done} {what}")
    return done


def _float_ids(t: gs.Tensor) -> gs.Tensor | None:
    """x when t = Cast(x, to=int64) of a float32 x (deepctr-torch's id columns): the kernels read x as that Cast."""
    n = t.inputs[0] if len(t.inputs) == 1 else None
    if n is None or n.op != "Cast" or n.domain or n.attrs.get("to") != onnx.TensorProto.INT64:
        return None
    return n.inputs[0] if dtype_of(n.inputs[0]) == np.dtype(np.float32) else None


def read_float_ids(ctx: PassContext) -> int:
    """GatherRows and GatherFields read float ids where the model casts them to int64: the Cast goes (GatherFields
    then names its id parts, `fields`, since they no longer differ from its dense parts by type)."""
    done = 0
    for n in [n for n in ctx.graph.nodes if n.domain == kernels.DOMAIN]:
        if n.op in ("GatherRows", "GatherRowsInt64") and (x := _float_ids(n.inputs[1])) is not None:
            n.inputs[1] = x
            done += 1
        elif n.op == "GatherFields" and "fields" not in n.attrs:
            ids = [p for p in n.inputs[2:] if np.dtype(dtype_of(p) or np.float32).kind in "iu"]
            floats = [_float_ids(p) for p in ids]
            if ids and all(f is not None for f in floats):
                for i, x in enumerate(floats):
                    n.inputs[2 + i] = x
                n.attrs["fields"] = len(ids)
                done += 1
    return _counted(ctx, done, "lookup(s) read float ids where the model cast them to int64")


def _width(t: gs.Tensor) -> int | None:
    """The columns of a [B] or [B, w] part, where known."""
    shape = shape_of(t)
    if shape is None or len(shape) not in (1, 2):
        return None
    return 1 if len(shape) == 1 else shape[1] if isinstance(shape[1], (int, np.integer)) else None


def read_column_ranges(ctx: PassContext) -> int:
    """GatherFields reads its parts' columns from the matrix they are Sliced from (deepctr-torch packs every
    feature into one [B, n] input): the Slices on the last axis of 2-D values go, a `ranges` attribute says what
    each part reads."""
    done = 0
    for n in [n for n in ctx.graph.nodes if n.op == "GatherFields" and n.domain == kernels.DOMAIN]:
        parts = list(n.inputs[2:])
        sliced = [slice_bounds(p, 1) if rank_of(p) == 2 else None for p in parts]
        widths = [_width(p) for p in parts]
        if "ranges" in n.attrs or not any(sliced) or any(w is None for w in widths):
            continue
        ranges = []
        for i, (p, cut, w) in enumerate(zip(parts, sliced, widths)):
            if cut is not None and rank_of(cut[0]) == 2:
                n.inputs[2 + i] = cut[0]
                ranges += [cut[1], cut[2]]
            else:
                ranges += [0, int(w)]
        n.attrs["ranges"] = [int(r) for r in ranges]
        done += 1
    return _counted(ctx, done, "GatherFields read their parts' columns where they are Sliced from")


@register_pass("gather-rows-kernel", group="lower", targets=("ort",), rules=GATHER_RULES)
def gather_rows_kernel(ctx: PassContext) -> None:
    """Gather of float or int64 rows (embedding lookups, positions) → ctropt's GatherRows kernels, where its library
    loads; a lookup of several fields' ids, flattened, → GatherFields."""
    if any(n.op == "Gather" for n in ctx.graph.nodes):
        kernels.apply_rules(ctx, GATHER_RULES, "lookups")
    if any(n.op == "GatherRows" for n in ctx.graph.nodes) and kernels.wanted(ctx.options) and not kernels.ensure():
        fuse_gather_fields(ctx)
        read_float_ids(ctx)
        read_column_ranges(ctx)


def _is_row_dedup(m: Match) -> bool | str:
    x, rank = m["x"], rank_of(m["x"])
    if dtype_of(x) is None or np.dtype(dtype_of(x)) not in UNIQUE_OF or rank != 2:
        return "not int64 or float32 rows (rank 2)"
    if m.root.attrs.get("axis") not in (0, -2) or m.root.attrs.get("sorted", 1):
        return "not Unique(axis=0, sorted=0)"
    return True


def _key_parts(x, graph) -> list:
    """The int64 [B, k] parts of a key Concat on axis 1 that only the Unique reads (UniqueRows reads them in place:
    dedup-user-side's ids and histories, not copied into one key first); [x] otherwise."""
    cat = x.inputs[0] if x.inputs else None
    if cat is None or cat.op != "Concat" or cat.attrs.get("axis") not in (1, -1) or not read_once(x, graph) or \
            not 1 < len(cat.inputs) <= MAX_KEY_PARTS:
        return [x]
    if all(rank_of(u) == 2 and dtype_of(u) is not None and np.dtype(dtype_of(u)) == np.int64 for u in cat.inputs):
        return list(cat.inputs)
    return [x]


def _to_unique_rows(m: Match) -> list:
    op = UNIQUE_OF[np.dtype(dtype_of(m["x"]))]
    parts = _key_parts(m["x"], m.graph) if op == "UniqueRows" else [m["x"]]
    made = m.op(op, parts, outputs=4, name=f"{m.root.name}/{op}", domain=kernels.DOMAIN, dtype=np.int64)
    made[0].dtype = dtype_of(m["x"])
    return [made[i] if i < len(m.root.outputs) and m.root.outputs[i].name else None for i in range(len(m.root.outputs))]


UNIQUE_RULES = (Rewrite("unique-rows", P.Unique(Var("x"), _domain=""), _to_unique_rows, _is_row_dedup, subgraphs=False),)


@register_pass("unique-rows-kernel", group="lower", targets=("ort",), rules=UNIQUE_RULES)
def unique_rows_kernel(ctx: PassContext) -> None:
    """Unique over int64 rows (dedup-user-side's distinct users) → ctropt's UniqueRows kernel, where its library
    loads."""
    if any(n.op == "Unique" for n in ctx.graph.nodes):
        kernels.apply_rules(ctx, UNIQUE_RULES, "Unique")
