"""`fuse-parallel-embeddings`: the lookups of one batch into tables of one width → one Gather on the
concatenated table (seed 003: 26 lookups → one gather)."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from ...graph import annotate_shapes, iter_graphs, weights
from ...graph.edit import Builder, add_constant, add_node, const_value, dtype_of, replace_outputs, shape_of, unique_name
from ..cleanup import tidy
from ..registry import PassContext, register_pass
from .partitioned import read_merged_ids


@dataclasses.dataclass
class Lookup:
    """One lookup Gather(table, ids) on a constant [rows, D] table, ids [B, d1, ...] with static trailing dims."""

    gather: gs.Node
    values: np.ndarray
    ids: gs.Tensor
    out: gs.Tensor  # what consumers read: the Gather's output, or an Unsqueeze / same-shape Reshape of it
    out_shape: list  # [B, ..., D]
    start: int = 0  # the first column of its unit among the fused lookup's ids
    block: list | None = None  # lookups joined on their last axis, laid out interleaved (see _interleave)
    lane: int = 0  # its place in the block
    negatives: tuple | None = None  # a merged partitioned lookup's (reach, step, shift): `ids` read as it reads them

    def rule(self) -> tuple[int, int, int]:
        """(reach, step, shift) of its negative ids: those in [-reach, 0) that step divides read row id + shift,
        the others raise; a Gather's own (rows, 1, rows) unless merge-partitioned-embeddings said otherwise."""
        rows = int(self.values.shape[0])
        return self.negatives or (rows, 1, rows)

    @property
    def k(self) -> int:
        """Ids per row."""
        return int(np.prod(shape_of(self.ids)[1:], dtype=np.int64))

    @property
    def width(self) -> int:
        return int(self.values.shape[1])


def _known(shape) -> bool:
    return shape is not None and all(isinstance(d, str) or (isinstance(d, (int, np.integer)) and d >= 0) for d in shape)


def _batch_symbols(graph: gs.Graph) -> set[str]:
    """Axis 0 of every input of rank >= 2 is the batch (the convention of `ctropt bench` and `specialize`; rank-1
    inputs may be jagged values, as torchrec's are)."""
    return {x.shape[0] for x in graph.inputs if x.shape is not None and len(x.shape) >= 2 and isinstance(x.shape[0], str)}


def _batch_key(dim, batch: set[str]):
    if isinstance(dim, str):
        return "batch" if dim in batch else dim
    return int(dim) if isinstance(dim, (int, np.integer)) and dim >= 0 else None


def _unsqueeze_axes(node: gs.Node):
    if "axes" in node.attrs:
        return [int(a) for a in node.attrs["axes"]]
    value = const_value(node.inputs[1]) if len(node.inputs) > 1 else None
    return None if value is None else [int(a) for a in value.ravel()]


def _flattened(t: gs.Tensor, out_shape: list) -> bool:
    """Whether t, a Reshape of a lookup [B, 1, D], is [B, D]: of rank 2 with D last (so B rows, whatever its first
    axis is called)."""
    shape = shape_of(t)
    return shape is not None and len(shape) == 2 and shape[1] == out_shape[-1]


def _lookups(graph: gs.Graph, batch: set[str]) -> list[Lookup]:
    """Every lookup whose ids have a known batch and static ids per row, seen through the reshapes after it."""
    found, outputs = [], {id(t) for t in graph.outputs}
    for node in graph.nodes:
        if node.op != "Gather" or node.attrs.get("axis", 0) != 0:
            continue
        values, ids = const_value(node.inputs[0]), node.inputs[1]
        merged, negatives = read_merged_ids(ids), None
        if merged is not None and values is not None and values.ndim >= 1 and merged[2] == values.shape[0]:
            ids, fit = merged[0], merged[1]  # its negative ids' rule joins the others' (_negative_ids)
            negatives = (fit.reach, fit.step, fit.shift)
        shape, dtype = shape_of(ids), dtype_of(ids)
        if values is None or values.ndim != 2 or values.dtype.kind != "f" or not shape or dtype is None:
            continue
        if np.dtype(dtype).kind not in "iu" or _batch_key(shape[0], batch) is None or \
                not all(isinstance(d, (int, np.integer)) and d > 0 for d in shape[1:]):
            continue
        out, out_shape = node.outputs[0], list(shape) + [values.shape[1]]
        while len(out.outputs) == 1 and id(out) not in outputs:
            user = out.outputs[0]
            if user.op == "Reshape" and _known(out_shape) and shape_of(user.outputs[0]) == out_shape:
                out = user.outputs[0]  # TF's reshape to ids' shape + [D]: the shape it already has
            elif user.op == "Unsqueeze" and len(shape) == 1 and out is node.outputs[0] and \
                    _unsqueeze_axes(user) in ([1], [-2]):
                out, out_shape = user.outputs[0], [shape[0], 1, values.shape[1]]
            elif user.op == "Reshape" and out_shape[1:-1] == [1] and _flattened(user.outputs[0], out_shape):
                out, out_shape = user.outputs[0], [shape[0], values.shape[1]]   # paddle2onnx: [B, 1, D] → [B, D]
            else:
                break
        if id(out) not in outputs:
            found.append(Lookup(node, values, ids, out, out_shape, negatives=negatives))
    return found


def _groups(graph: gs.Graph, lookups: list[Lookup], batch: set[str]) -> list[list[Lookup]]:
    """Lookups of one batch, table width and dtype, in the order their consumers read them."""
    by_out = {id(lk.out): lk for lk in lookups}
    ordered = []
    for node in graph.nodes:
        for t in node.inputs:
            lk = by_out.pop(id(t), None)
            if lk is not None:
                ordered.append(lk)
    groups: dict[tuple, list[Lookup]] = {}
    for lk in ordered:
        key = (_batch_key(shape_of(lk.ids)[0], batch), lk.width, lk.values.dtype)
        groups.setdefault(key, []).append(lk)
    return [g for g in groups.values() if len(g) >= 2]


def _interleave(graph: gs.Graph, group: list[Lookup]) -> None:
    """Lookups with one ids shape [B, d...] (more than one id per row) that a Concat joins on the last axis (DIN's
    history items and categories) form a block: their ids are stacked on a new last axis, so the block's columns
    of the fused lookup, [B, d... * n, D], reshape to the Concat's result."""
    members = {id(lk.out): lk for lk in group}
    batch = _batch_symbols(graph)

    def ids_shape(lk):  # inputs name their batch dims apart (paddle2onnx): axis 0 of every input is the batch
        shape = shape_of(lk.ids)
        return shape and [_batch_key(shape[0], batch)] + list(shape[1:])

    def joinable(lk, concat):
        axis = concat.attrs.get("axis", 0)
        return lk is not None and lk.block is None and lk.k > 1 and axis in (-1, len(lk.out_shape) - 1)

    for concat in [n for n in graph.nodes if n.op == "Concat"]:
        run = []
        for t in list(concat.inputs) + [None]:
            lk = members.get(id(t)) if t is not None else None
            if joinable(lk, concat) and run and ids_shape(lk) == ids_shape(run[0]) and lk not in run:
                run.append(lk)
                continue
            if len(run) >= 2:
                for lane, member in enumerate(run):
                    member.block, member.lane = run, lane
            run = [lk] if joinable(lk, concat) else []


def _units(group: list[Lookup]) -> list[list[Lookup]]:
    """The fused lookup's layout: each block once, where its first member comes, and every other lookup alone."""
    units, seen = [], set()
    for lk in group:
        unit = lk.block or [lk]
        if id(unit[0]) not in seen:
            seen.add(id(unit[0]))
            units.append(unit)
    return units


def _fused_gather(graph: gs.Graph, group: list[Lookup], name: str) -> tuple[gs.Tensor, dict]:
    """One Gather on the concatenated tables: ids [B, K] (each lookup's k columns, offset into its table). Returns
    its output and where each table went: {id(table): (joined table, first row, rows)}."""
    tables, first = [], {}
    for lk in group:
        if id(lk.gather.inputs[0]) not in first:  # a table read by several lookups is stored once
            first[id(lk.gather.inputs[0])] = len(tables)
            tables.append(lk.values)
    starts = np.cumsum([0] + [t.shape[0] for t in tables])
    dtypes = {np.dtype(dtype_of(lk.ids)) for lk in group}
    id_dtype = dtypes.pop() if len(dtypes) == 1 else np.dtype(np.int64)
    if starts[-1] > np.iinfo(id_dtype).max:
        id_dtype = np.dtype(np.int64)

    def cast(x):
        if np.dtype(dtype_of(x)) == id_dtype:
            return x
        return add_node(graph, "Cast", [x], {"to": onnx.helper.np_dtype_to_tensor_dtype(id_dtype)},
                        name=f"{name}/cast", dtype=id_dtype)[0]

    sizes, offsets, rules, columns, start = [], [], [], [], 0
    for unit in _units(group):
        rows = [lk.values.shape[0] for lk in unit]
        at = [starts[first[id(lk.gather.inputs[0])]] for lk in unit]
        sizes += rows * unit[0].k  # a block's columns run over its lanes first
        offsets += at * unit[0].k
        rules += [lk.rule() for lk in unit] * unit[0].k
        x = cast(unit[0].ids)
        if len(unit) > 1:
            last = add_constant(graph, f"{name}/last", np.array([-1]))
            lanes = [add_node(graph, "Unsqueeze", [cast(lk.ids), last], name=f"{name}/lane", dtype=id_dtype)[0]
                     for lk in unit]
            (x,) = add_node(graph, "Concat", lanes, {"axis": -1}, name=f"{name}/block", dtype=id_dtype)
        rank = len(shape_of(unit[0].ids)) if len(unit) == 1 else None  # a block is [B, d..., n]
        columns.append((x, unit[0].k * len(unit), rank))
        for lk in unit:
            lk.start = start
        start += unit[0].k * len(unit)
    ids = []
    for flat, run in itertools.groupby(columns, key=lambda c: c[2] == 1):
        run = list(run)
        if flat and len(run) >= 3:  # [B] ids: one Concat and a transpose instead of a Reshape each
            (x,) = add_node(graph, "Concat", [x for x, _, _ in run], {"axis": 0}, name=f"{name}/flat", dtype=id_dtype)
            (x,) = add_node(graph, "Reshape", [x, add_constant(graph, f"{name}/rows_first", np.array([len(run), -1]))],
                            name=f"{name}/rows_first", dtype=id_dtype)
            ids += add_node(graph, "Transpose", [x], {"perm": [1, 0]}, name=f"{name}/by_row", dtype=id_dtype)
            continue
        for x, k, rank in run:
            if rank != 2:
                (x,) = add_node(graph, "Reshape", [x, add_constant(graph, f"{name}/cols", np.array([0, k]))],
                                name=f"{name}/cols", dtype=id_dtype)
            ids.append(x)
    (x,) = add_node(graph, "Concat", ids, {"axis": 1}, name=f"{name}/ids", dtype=id_dtype) if len(ids) > 1 else ids
    b = Builder(graph, name, id_dtype)
    if any(lk.negatives for lk in group):
        x = _negative_ids(b, x, np.array(sizes, id_dtype), np.array(rules, id_dtype))
    x = field_rows(b, x, np.array(sizes, id_dtype), np.array(offsets, id_dtype), starts[-1])
    table = add_constant(graph, f"{name}/table", weights.concatenate(tables))
    placed = {key: (table, int(starts[i]), int(tables[i].shape[0])) for key, i in first.items()}
    return add_node(graph, "Gather", [table, x], {"axis": 0}, name=name, dtype=table.values.dtype)[0], placed


def _negative_ids(b: Builder, x: gs.Tensor, sizes: np.ndarray, rules: np.ndarray) -> gs.Tensor:
    """The ids x ([..., K]) of lookups that merge-partitioned-embeddings made (rules[c] = (reach, step, shift): what
    their shards did with negative ids, partitioned.Negatives) and of plain ones ((rows, 1, rows)), each column
    read as its lookup reads it: a negative id that its rule answers → id + shift, one it does not → sizes[c]
    (past the field: field_rows then sends it past the joined table). The rules' few elementwise ops once on
    all the columns instead of on each lookup's ids."""
    shape = b.op("Shape", [x], dtype=np.int64)

    def per_column(what, values):
        return b.op("Expand", [b.const(what, values), shape])

    negative = b.op("Less", [x, b.const("zero", np.zeros((), sizes.dtype))], dtype=np.bool_)
    row = b.op("Where", [negative, b.op("Add", [x, per_column("shift", rules[:, 2])]), x])
    bad = b.op("Less", [x, per_column("reach", -rules[:, 0])], dtype=np.bool_)
    if (rules[:, 1] > 1).any():
        divided = b.op("Equal", [b.op("Mod", [x, per_column("step", rules[:, 1])]),
                                 b.const("zero", np.zeros((), sizes.dtype))], dtype=np.bool_)
        bad = b.op("Or", [bad, b.op("And", [negative, b.op("Not", [divided], dtype=np.bool_)], dtype=np.bool_)],
                   dtype=np.bool_)
    return b.op("Where", [bad, per_column("past", sizes), row])


def field_rows(b: Builder, x: gs.Tensor, sizes: np.ndarray, offsets: np.ndarray, total: int) -> gs.Tensor:
    """The rows of a joined table that ids x ([..., K]) read, column c's in its field's sizes[c] rows from
    offsets[c] (`checked_rows`). gather-rows-kernel reads this form back (`read_field_rows`) and does the same per
    id in the kernel."""
    shape = b.op("Shape", [x], dtype=np.int64)
    # constants Expanded to the ids' shape first: onnxruntime broadcasts a row vector over [N, K] a row at a time
    # (Add [1400, 2] + [2]: 14 us; Expand then Add: 2 us)
    return checked_rows(b, x, b.op("Expand", [b.const("sizes", sizes), shape]),
                        b.op("Expand", [b.const("offsets", offsets), shape]), total)


def checked_rows(b: Builder, x: gs.Tensor, size: gs.Tensor, offset: gs.Tensor, total: int) -> gs.Tensor:
    """offset + x, x read as its own table's Gather reads it (negative: from the end of its `size` rows); an id
    outside [-size, size) → `total`, past the joined table, so that the joined Gather raises where the table's own
    would (never another table's row). size and offset: per id, x's shape and type."""
    zero = b.const("zero", np.zeros((), dtype_of(x)))
    row = b.op("Where", [b.op("Less", [x, zero], dtype=np.bool_), b.op("Add", [x, size]), x])
    inside = b.op("And", [b.op("GreaterOrEqual", [row, zero], dtype=np.bool_), b.op("Less", [row, size], dtype=np.bool_)],
                  dtype=np.bool_)
    return b.op("Where", [inside, b.op("Add", [row, offset]), b.const("past", np.array(total, dtype_of(x)))])


def read_field_rows(ids: gs.Tensor, rows: int) -> tuple | None:
    """(x, sizes, offsets) where `ids` is `field_rows(x, sizes, offsets, total)` into a table of `rows` rows (sizes
    and offsets constants [K], total ≥ rows: the form fuse-parallel-embeddings writes); None for anything else."""
    where = _made_by(ids, "Where", 3)
    inside, placed = (_made_by(where.inputs[0], "And", 2), _made_by(where.inputs[1], "Add", 2)) if where else (None,) * 2
    past = const_value(where.inputs[2]) if where else None
    if inside is None or placed is None or past is None or past.size != 1 or int(past.ravel()[0]) < rows:
        return None
    row, offsets = placed.inputs
    first = _made_by(row, "Where", 3)
    lower, upper = _made_by(inside.inputs[0], "GreaterOrEqual", 2), _made_by(inside.inputs[1], "Less", 2)
    if first is None or lower is None or upper is None or not _is_zero(lower.inputs[1]) or \
            lower.inputs[0] is not row or upper.inputs[0] is not row:
        return None
    x, negative, added = first.inputs[2], _made_by(first.inputs[0], "Less", 2), _made_by(first.inputs[1], "Add", 2)
    if negative is None or added is None or negative.inputs[0] is not x or not _is_zero(negative.inputs[1]) or \
            added.inputs[0] is not x:
        return None
    sizes, offsets, wrap = (_per_column(t, x) for t in (upper.inputs[1], offsets, added.inputs[1]))
    if sizes is None or offsets is None or wrap is None or not np.array_equal(wrap, sizes):
        return None
    return x, sizes, offsets


def _is_zero(t: gs.Tensor) -> bool:
    value = const_value(t)
    return value is not None and value.size == 1 and value.ravel()[0] == 0


def _made_by(t: gs.Tensor, op: str, arity: int) -> gs.Node | None:
    node = t.inputs[0] if len(t.inputs) == 1 else None
    ok = node is not None and node.op == op and not node.domain and len(node.inputs) == arity
    return node if ok else None


def _per_column(t: gs.Tensor, x: gs.Tensor) -> np.ndarray | None:
    """The constant [K] that t is, or Expands to x's shape."""
    expand = _made_by(t, "Expand", 2)
    if expand is not None:
        shape = _made_by(expand.inputs[1], "Shape", 1)
        if shape is None or shape.inputs[0] is not x or shape.attrs:
            return None
        t = expand.inputs[0]
    value = const_value(t)
    return value if value is not None and value.ndim == 1 else None


class _Fused:
    """The fused lookup's output [B, K, D] and the pieces cut from it."""

    def __init__(self, graph: gs.Graph, group: list[Lookup], name: str):
        self.graph, self.group, self.name = graph, group, name
        self.out, self.placed = _fused_gather(graph, group, name)
        self.total = sum(lk.k for lk in group)
        self.dtype = group[0].values.dtype
        self.sliced = []  # lookups read through a Slice of the fused output
        self.b = Builder(graph, name, self.dtype)

    def columns(self, start: int, stop: int) -> gs.Tensor:
        """[B, stop - start, D]: the fused lookup's columns start..stop."""
        if (start, stop) == (0, self.total):
            return self.out
        self.sliced += [lk for lk in self.group if start <= lk.start < stop]
        b = self.b
        return b.op("Slice", [self.out, b.const("start", [start], np.int64), b.const("stop", [stop], np.int64),
                              b.const("axis", [1], np.int64)])

    def reshaped(self, x: gs.Tensor, shape: list) -> gs.Tensor:
        """x ([B, k, D]) as [B] + shape[1:] (0 keeps the batch)."""
        return self.b.op("Reshape", [x, self.b.const("shape", [0] + [int(d) for d in shape[1:]], np.int64)])


def _join(f: _Fused, concat: gs.Node, pieces: dict) -> None:
    """Runs of consecutive lookups, in fused order, concatenated on their stacking axis (pieces [B, k, D] on
    axis 1) or on their last axis (pieces [B, D] or [B, 1, D]) → one slice of the fused lookup."""
    inputs, i, out = list(concat.inputs), 0, []
    while i < len(inputs):
        lk = pieces.get(id(inputs[i]))
        if lk is not None and lk.block and lk.lane == 0 and \
                [id(t) for t in inputs[i:i + len(lk.block)]] == [id(m.out) for m in lk.block] and \
                concat.attrs.get("axis", 0) in (-1, len(lk.out_shape) - 1):
            n = len(lk.block)
            out.append(f.reshaped(f.columns(lk.start, lk.start + n * lk.k), lk.out_shape[:-1] + [n * lk.width]))
            i += n
            continue
        form = _join_form(lk, concat) if lk is not None and not lk.block else None
        j = i
        while form and j + 1 < len(inputs) and (nxt := pieces.get(id(inputs[j + 1]))) is not None and \
                not nxt.block and nxt.start == pieces[id(inputs[j])].start + pieces[id(inputs[j])].k and \
                _join_form(nxt, concat) == form:
            j += 1
        if not form:
            out.append(inputs[i])
            i += 1
            continue
        run = [pieces[id(t)] for t in inputs[i:j + 1]]
        x = f.columns(run[0].start, run[0].start + sum(lk.k for lk in run))
        if form == "flat":
            x = f.reshaped(x, lk.out_shape[:-1] + [len(run) * lk.width])
        out.append(x)
        i = j + 1
    concat.inputs.clear()
    concat.inputs.extend(out)


def _join_form(lk: Lookup, concat: gs.Node) -> str | None:
    rank = len(lk.out_shape)
    axis = concat.attrs.get("axis", 0)
    axis = axis + rank if axis < 0 else axis
    if rank == 3 and axis == 1 and lk.out_shape[1] == lk.k:
        return "stack"
    if axis == rank - 1 and lk.k == 1 and rank in (2, 3):
        return "flat"
    return None


def _sum(f: _Fused, node: gs.Node, pieces: dict) -> None:
    """Sum over consecutive single-id lookups ([B, D] or [B, 1, D]) → one ReduceSum over their columns."""
    mine = [pieces[id(t)] for t in node.inputs if id(t) in pieces]
    mine = [lk for lk in mine if lk.k == 1 and len(lk.out_shape) in (2, 3)]
    starts = sorted(lk.start for lk in mine)
    if len(mine) < 2 or starts != list(range(starts[0], starts[0] + len(mine))) or \
            len({len(lk.out_shape) for lk in mine}) != 1:
        return
    keep = len(mine[0].out_shape) == 3
    total = f.b.op("ReduceSum", [f.columns(starts[0], starts[-1] + 1), f.b.const("axes", [1], np.int64)],
                   {"keepdims": int(keep)})
    ids = {id(lk.out) for lk in mine}
    rest = [t for t in node.inputs if id(t) not in ids]
    node.inputs.clear()
    node.inputs.extend([total] + rest)


def _row_pool(node: gs.Node, lk: Lookup | None) -> bool:
    """ReduceSum of a [B, k, D] lookup over its k ids (a bag pooled per row, as vectorize-embedding-bags makes)."""
    if lk is None or node.op != "ReduceSum" or len(lk.out_shape) != 3 or lk.out_shape[1] != lk.k:
        return False
    axes = node.attrs.get("axes") if "axes" in node.attrs else \
        (const_value(node.inputs[1]) if len(node.inputs) > 1 else None)
    return axes is not None and [int(a) % 3 for a in np.ravel(axes)] == [1]


def _pool(f: _Fused, nodes: list[gs.Node], pieces: dict) -> None:
    """Row sums of several lookups → one MatMul of the fused lookup by a 0/1 segment matrix ([B, n, D]), of which
    each sum reads its row."""
    bags = [pieces[id(n.inputs[0])] for n in nodes]
    segments = np.zeros((len(bags), f.total), dtype=f.dtype)
    for i, lk in enumerate(bags):
        segments[i, lk.start:lk.start + lk.k] = 1
    pooled = f.b.op("MatMul", [add_constant(f.graph, f"{f.name}/segments", segments), f.out])
    for i, node in enumerate(nodes):  # the sum becomes a Gather of its row (_fuse undoes this if need be)
        index = gs.Constant(unique_name(f.graph, f"{f.name}/bag"),  # a scalar: add_constant makes 1-D arrays
                            np.array(i if not node.attrs.get("keepdims", 1) else [i], dtype=np.int64))
        node.op, node.attrs = "Gather", {"axis": 1}
        node.inputs.clear()
        node.inputs.extend([pooled, index])


def _rewire(f: _Fused) -> list[Lookup]:
    """Concat runs, Sums and row sums read columns of the fused lookup instead of the lookups. Returns the lookups
    still read elsewhere or read through a Slice: cutting those out again would copy what the separate Gathers
    wrote once (zoo and DeepCTR DIN measured 0.97-0.99x that way)."""
    pieces = {id(lk.out): lk for lk in f.group}
    readers = []
    for lk in f.group:
        readers += [n for n in lk.out.outputs if not any(n is r for r in readers)]
    pools = [n for n in readers if _row_pool(n, pieces.get(id(n.inputs[0])))]
    for node in readers:
        if node.op == "Concat":
            _join(f, node, pieces)
        elif node.op == "Sum":
            _sum(f, node, pieces)
    if pools:
        _pool(f, pools, pieces)
    return [lk for lk in f.group if lk.out.outputs or any(lk is s for s in f.sliced)]


def _fuse(graph: gs.Graph, group: list[Lookup]) -> list[Lookup]:
    """Fuse the lookups of `group` whose consumers read the fused output whole; returns those fused (none or >= 2)."""
    while len(group) >= 2:
        for lk in group:
            lk.block, lk.lane = None, 0
        _interleave(graph, group)
        readers = {id(n): (n, list(n.inputs), n.op, dict(n.attrs)) for lk in group for n in lk.out.outputs}
        count = len(graph.nodes)
        fused = _Fused(graph, group, unique_name(graph, f"fused_lookup_w{group[0].width}"))
        left = _rewire(fused)
        if not left:
            for node, *_ in readers.values():
                if node.op in ("Concat", "Sum") and len(node.inputs) == 1:
                    replace_outputs(graph, node, list(node.inputs))
            _read_joined(graph, group, fused.placed)
            return group
        drop = [lk for lk in left if lk.out.outputs] or left   # read elsewhere first: the others may then be whole
        for node in graph.nodes[count:]:  # undo, and try again without those
            node.inputs.clear()
            node.outputs.clear()
        del graph.nodes[count:]
        for node, inputs, op, attrs in readers.values():
            node.op, node.attrs = op, attrs
            node.inputs.clear()
            node.inputs.extend(inputs)
        group = [lk for lk in group if lk not in drop]
    return []


def _read_joined(graph: gs.Graph, group: list[Lookup], placed: dict) -> None:
    """Where a joined table's other readers are all row Gathers (a target item's lookup beside its history's,
    lookup-selected-rows' reads of valid positions), they read the joined table, each id checked against its own
    table's rows (field_rows, which gather-rows-kernel reads back): the table is stored once. A table read any other
    way stays as it was beside the joined copy."""
    fused, mine = {id(lk.gather) for lk in group}, {id(n) for n in graph.nodes}
    for lk in group:
        table = lk.gather.inputs[0]
        others = [n for n in table.outputs if id(n) not in fused]
        if not others or not all(id(n) in mine and n.op == "Gather" and not n.domain and n.attrs.get("axis", 0) == 0
                                 and n.inputs[0] is table and n.inputs[1] is not table for n in others):
            continue
        joined, start, rows = placed[id(table)]
        total = int(joined.values.shape[0])
        for node in others:
            x = node.inputs[1]
            dtype = np.dtype(dtype_of(x))
            if total > np.iinfo(dtype).max:
                (x,) = add_node(graph, "Cast", [x], {"to": onnx.TensorProto.INT64}, name=f"{node.name}/cast",
                                dtype=np.int64)
                dtype = np.dtype(np.int64)
            b = Builder(graph, f"{node.name}/joined", dtype)
            x = field_rows(b, x, np.array([rows], dtype), np.array([start], dtype), total)
            node.inputs[0], node.inputs[1] = joined, x


# OpenVINO's CPU plugin runs a fused chain of integer element-wise ops in f32: the offset ids into a joined table
# past 2^24 rows come out rounded (a 1.8 GB DLRM-style export, 26 tables of 10^6 rows: rows off by one from the
# 20th table on). A joined table stays under it for --target openvino.
OPENVINO_EXACT_ROWS = 1 << 24


def _fused_groups(graph: gs.Graph, max_rows: int | None = None):
    """Fuse every group of lookups in `graph` and its subgraphs (whose tables have at most `max_rows` rows in
    all); yields (group, the lookups fused)."""
    batch = _batch_symbols(graph)
    if any(t.shape is None for n in graph.nodes if n.op == "Gather" for t in n.outputs[:1] + n.inputs[1:2]):
        annotate_shapes(graph)
    for g in list(iter_graphs(graph)):
        for group in _groups(g, _lookups(g, batch), batch):
            tables = {id(lk.gather.inputs[0]): lk.values.shape[0] for lk in group}
            if max_rows is not None and sum(tables.values()) > max_rows:
                yield group, None
                continue
            yield group, _fuse(g, group)


def parallel_lookup_tables(graph: gs.Graph) -> set[str]:
    """Names of the tables whose lookups fuse-parallel-embeddings fuses (for `ctropt inspect`; on a copy)."""
    return {lk.gather.inputs[0].name for _, fused in _fused_groups(graph.copy()) for lk in fused}


# After it the graph no longer shows each id input's table (the ids reach one Gather through a Concat and an
# offset vector): inputs generated for the fused model use the raw model's facts the PassManager stores.
@register_pass("fuse-parallel-embeddings", group="fusion")
def fuse_parallel_embeddings(ctx: PassContext) -> None:
    """Lookups of one batch into tables of one width, read together by Concats, Sums or row sums (pooled bags) →
    one Gather on the concatenated tables, ids offset per lookup, that those consumers read whole. Lookups also
    read elsewhere stay. Runs after the attention and user-side passes, which start from the separate lookups."""
    ctx.graph.cleanup(remove_unused_graph_inputs=False)  # a dead Concat reading lookups would keep them apart
    for group, fused in _fused_groups(ctx.graph, OPENVINO_EXACT_ROWS if ctx.target == "openvino" else None):
        ctx.matches += len(group)
        if fused is None:
            ctx.note(f"{len(group)} lookups of width {group[0].width} stay separate: their tables hold over 2^24 rows "
                     "in all, past the ids OpenVINO's CPU plugin computes exactly (in f32)")
            continue
        ctx.rewrites += bool(fused)
        if len(fused) < len(group):
            ctx.note(f"{len(group) - len(fused)} of {len(group)} lookups of width {group[0].width} stay "
                     "separate: read by other ops, or by Concats that would read a slice of the fused lookup")
    if ctx.rewrites:
        ctx.graph.cleanup(remove_unused_graph_inputs=False).toposort(mode="nodes")
        tidy(ctx)  # groups of other widths over the same ids share their offset ids; Reshape pairs merge
