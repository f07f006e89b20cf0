"""Embedding passes: many per-feature lookups into one.

CTR models look up one table per feature (Wide&Deep: 26 deep + 26 wide lookups), tables split in shards,
bags of ids per sample and multi-hot indicator columns. `merge-partitioned-embeddings` joins the shards,
`vectorize-embedding-bags` replaces per-sample bag loops by one scatter (one for all the tables of a bag
collection) and segment-summed padded bags by a Gather + row sum, `rewrite-indicator-columns` replaces
OneHot + ReduceSum by a scatter, and `fuse-parallel-embeddings` turns the lookups of one batch into tables of
one width into a single Gather on the concatenated table (seed 003: 26 lookups → one gather).
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from ..graph import annotate_shapes, iter_graphs, nodes_near
from ..patterns import Const, P, Rewrite, Var
from ..graph.edit import Builder, add_constant, add_node, const_value, dtype_of, replace_outputs, shape_of, unique_name
from ..runtime.subgraph import Subgraph
from .cleanup import tidy
from .registry import PassContext, register_pass


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


def _lookups(graph: gs.Graph, batch: set[str]) -> list[Lookup]:
    """Every lookup whose ids have a known batch and static ids per row, seen through the reshapes after it."""
    found, outputs = [], {id(t) for t in graph.outputs}
    for node in graph.nodes:
        if node.op != "Gather" or node.attrs.get("axis", 0) != 0:
            continue
        values, ids = const_value(node.inputs[0]), node.inputs[1]
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
            else:
                break
        if id(out) not in outputs:
            found.append(Lookup(node, values, ids, out, out_shape))
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

    def joinable(lk, concat):
        axis = concat.attrs.get("axis", 0)
        return lk is not None and lk.block is None and lk.k > 1 and axis in (-1, len(lk.out_shape) - 1)

    for concat in [n for n in graph.nodes if n.op == "Concat"]:
        run = []
        for t in list(concat.inputs) + [None]:
            lk = members.get(id(t)) if t is not None else None
            if joinable(lk, concat) and run and shape_of(lk.ids) == shape_of(run[0].ids) and lk not in run:
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


# Concatenated tables up to this size hold every table twice, so that one Add maps an id in [-rows, rows) to its
# row as Gather reads it (negative: from the end); larger ones keep a single copy and wrap ids with a Mod, which
# measured 5-8 % of the whole model's time at batch 256 on the small DeepCTR models (ORT CPU).
DOUBLED_TABLE_BYTES = 64 << 20


def _fused_gather(graph: gs.Graph, group: list[Lookup], name: str) -> gs.Tensor:
    """One Gather on the concatenated tables: ids [B, K] (each lookup's k columns, offset into its table)."""
    tables, first = [], {}
    for lk in group:
        if id(lk.gather.inputs[0]) not in first:  # a table read by several lookups is stored once
            first[id(lk.gather.inputs[0])] = len(tables)
            tables.append(lk.values)
    doubled = 2 * sum(t.nbytes for t in tables) <= DOUBLED_TABLE_BYTES
    if doubled:
        tables = [t for table in tables for t in (table, table)]
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

    sizes, offsets, columns, start = [], [], [], 0
    for unit in _units(group):
        rows = [lk.values.shape[0] for lk in unit]
        at = [starts[2 * first[id(lk.gather.inputs[0])]] + lk.values.shape[0] if doubled
              else starts[first[id(lk.gather.inputs[0])]] for lk in unit]
        sizes += rows * unit[0].k  # a block's columns run over its lanes first
        offsets += at * unit[0].k
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
    if not doubled:
        rows = add_constant(graph, f"{name}/rows", np.array(sizes, dtype=id_dtype))
        (x,) = add_node(graph, "Mod", [x, rows], name=f"{name}/wrap", dtype=id_dtype)
    (x,) = add_node(graph, "Add", [x, add_constant(graph, f"{name}/offsets", np.array(offsets, dtype=id_dtype))],
                    name=f"{name}/offset", dtype=id_dtype)
    table = add_constant(graph, f"{name}/table", np.concatenate(tables, axis=0))
    return add_node(graph, "Gather", [table, x], {"axis": 0}, name=name, dtype=table.values.dtype)[0]


class _Fused:
    """The fused lookup's output [B, K, D] and the pieces cut from it."""

    def __init__(self, graph: gs.Graph, group: list[Lookup], name: str):
        self.graph, self.group, self.name = graph, group, name
        self.out = _fused_gather(graph, group, name)
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
        left = _rewire(_Fused(graph, group, unique_name(graph, f"fused_lookup_w{group[0].width}")))
        if not left:
            for node, *_ in readers.values():
                if node.op in ("Concat", "Sum") and len(node.inputs) == 1:
                    replace_outputs(graph, node, list(node.inputs))
            return group
        for node in graph.nodes[count:]:  # undo, and try again without those
            node.inputs.clear()
            node.outputs.clear()
        del graph.nodes[count:]
        for node, inputs, op, attrs in readers.values():
            node.op, node.attrs = op, attrs
            node.inputs.clear()
            node.inputs.extend(inputs)
        group = [lk for lk in group if lk not in left]
    return []


def _fused_groups(graph: gs.Graph):
    """Fuse every group of lookups in `graph` and its subgraphs; yields (group, the lookups fused)."""
    batch = _batch_symbols(graph)
    if any(t.shape is None for n in graph.nodes if n.op == "Gather" for t in n.outputs[:1] + n.inputs[1:2]):
        annotate_shapes(graph)
    for g in list(iter_graphs(graph)):
        for group in _groups(g, _lookups(g, batch), batch):
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
    for group, fused in _fused_groups(ctx.graph):
        ctx.matches += len(group)
        ctx.rewrites += bool(fused)
        if len(fused) < len(group):
            ctx.note(f"{len(group) - len(fused)} of {len(group)} lookups of width {group[0].width} stay "
                     "separate: read by other ops, or by Concats that would read a slice of the fused lookup")
    if ctx.rewrites:
        ctx.graph.cleanup(remove_unused_graph_inputs=False).toposort(mode="nodes")
        tidy(ctx)  # groups of other widths over the same ids share their offset ids; Reshape pairs merge


# ----------------------------------------------------------------------------------------- embedding bags


@dataclasses.dataclass
class BagLoop:
    """torch's embedding_bag lowering: for each bag i, rows[offsets[i]:offsets[i+1]] summed (zeros when empty)."""

    loop: gs.Node
    concat: gs.Node  # ConcatFromSequence collecting the per-bag rows
    rows: gs.Tensor  # [n, D], read by the body from the outer scope
    offsets: gs.Tensor  # [num_bags + 1]


def _slice_at(t: gs.Tensor, index: gs.Tensor, shift: int) -> gs.Tensor | None:
    """If t = Slice(O, index + shift, index + shift + 1) (index possibly reshaped), return O."""
    if len(t.inputs) != 1 or t.inputs[0].op != "Slice" or len(t.inputs[0].inputs) < 3:
        return None
    source, start, end = t.inputs[0].inputs[:3]

    def plus(x: gs.Tensor, k: int) -> bool:
        if k == 0:
            return x is index
        if len(x.inputs) != 1 or x.inputs[0].op != "Add":
            return False
        a, b = x.inputs[0].inputs
        for y, c in ((a, b), (b, a)):
            value = const_value(c.inputs[0].inputs[0]) if c.inputs and c.inputs[0].op == "CastLike" else const_value(c)
            if y is index and value is not None and value.size == 1 and int(value.ravel()[0]) == k:
                return True
        return False

    return source if plus(start, shift) and plus(end, shift + 1) else None


def _bag_loop(loop: gs.Node, graph: gs.Graph) -> BagLoop | None:
    body = loop.attrs.get("body")
    if body is None or len(loop.inputs) != 4 or len(loop.outputs) != 2 or len(body.inputs) != 4:
        return None
    # Two carried values in either order: the bag index (from 0) and the sequence of pooled rows.
    made_by = [o.inputs[0].op if len(o.inputs) == 1 else None for o in body.outputs[1:]]
    if sorted(map(str, made_by)) != ["Add", "SequenceInsert"]:
        return None
    seq, idx = (0, 1) if made_by[0] == "SequenceInsert" else (1, 0)
    init = const_value(loop.inputs[2 + idx])
    seq_out = loop.outputs[seq]
    if init is None or int(init.ravel()[0]) != 0 or len(seq_out.outputs) != 1 or loop.outputs[idx].outputs:
        return None
    concat = seq_out.outputs[0]
    if concat.op != "ConcatFromSequence" or concat.attrs.get("axis") != 0 or concat.attrs.get("new_axis", 0) != 0:
        return None
    if any(o is seq_out for o in graph.outputs):
        return None
    row = body.outputs[1 + seq].inputs[0].inputs[1]
    if len(row.inputs) != 1 or row.inputs[0].op != "If":
        return None
    branch_if = row.inputs[0]
    zeros = const_value(branch_if.attrs["then_branch"].outputs[0])
    reduced = branch_if.attrs["else_branch"].outputs[0]
    if zeros is None or np.any(zeros != 0) or zeros.ndim != 2 or zeros.shape[0] != 1:
        return None
    if len(reduced.inputs) != 1 or reduced.inputs[0].op != "ReduceSum":
        return None
    reduce = reduced.inputs[0]
    axes = const_value(reduce.inputs[1]) if len(reduce.inputs) > 1 else reduce.attrs.get("axes")
    if axes is None or list(np.ravel(axes)) != [0] or reduce.attrs.get("keepdims", 1) != 1:
        return None
    sliced = reduce.inputs[0]
    if len(sliced.inputs) != 1 or sliced.inputs[0].op != "Slice" or len(sliced.inputs[0].inputs) != 3:
        return None
    rows, start, end = sliced.inputs[0].inputs
    # start/end: offsets[i], offsets[i+1], with i the loop-carried index (reshaped to 1-D).
    index = body.inputs[2 + idx]
    flat = next((n.outputs[0] for n in index.outputs if n.op == "Reshape"), index)
    offsets = _slice_at(start, flat, 0)
    if offsets is None or _slice_at(end, flat, 1) is not offsets:
        return None
    cond = branch_if.inputs[0]
    if len(cond.inputs) != 1 or cond.inputs[0].op != "Equal" or {id(t) for t in cond.inputs[0].inputs} != {id(start), id(end)}:
        return None
    local = {id(t) for n in body.nodes for t in n.outputs} | {id(t) for t in body.inputs}
    if id(rows) in local or id(offsets) in local:
        return None
    return BagLoop(loop, concat, rows, offsets)


def _vectorized_bags(graph: gs.Graph, bag: BagLoop) -> gs.Tensor:
    """out[i] = sum of rows[offsets[i]:offsets[i+1]]: each row's bag from a running count of offsets, then one
    ScatterND(add). Rows before offsets[0] or from offsets[-1] on belong to no bag, as in the loop: they go to
    an extra last row, cut off at the end."""
    name = f"{bag.loop.name}/bags"
    i64 = np.int64
    dtype = bag.rows.dtype

    b = Builder(graph, name, i64)
    c, op = b.const, b.op

    shape = op("Shape", [bag.rows])
    n = op("Slice", [shape, c("zero", [0]), c("one", [1])])  # [1]
    num_offsets = op("Shape", [bag.offsets])  # [1]
    num_bags = op("Sub", [num_offsets, c("one", [1])])  # [1]
    where = op("Clip", [bag.offsets, c("lo", [0]), op("Squeeze", [n, c("axis0", [0])])])
    marks = op("ScatterElements", [op("ConstantOfShape", [op("Add", [n, c("one", [1])])], {"value": _attr_tensor(0)}),
                                   where, op("Expand", [c("ones", [1]), num_offsets])], {"axis": 0, "reduction": "add"})
    segment = op("Sub", [op("Slice", [op("CumSum", [marks, c("axis", [0])]), c("zero", [0]), n]), c("one", [1])])
    bags = op("Squeeze", [num_bags, c("axis0", [0])])
    inside = op("And", [op("GreaterOrEqual", [segment, c("zero", [0])], dtype=np.bool_),
                        op("Less", [segment, bags], dtype=np.bool_)], dtype=np.bool_)
    segment = op("Where", [inside, segment, bags])  # outside every bag: the extra row
    width = op("Slice", [shape, c("one", [1]), c("two", [2])])
    zeros = op("ConstantOfShape", [op("Concat", [op("Add", [num_bags, c("one", [1])]), width], {"axis": 0})],
               {"value": gs.Constant("value", np.zeros(1, dtype=dtype))}, dtype=dtype)
    summed = op("ScatterND", [zeros, op("Unsqueeze", [segment, c("axis1", [1])]), bag.rows], {"reduction": "add"},
                dtype=dtype)
    return op("Slice", [summed, c("zero", [0]), num_bags], dtype=dtype)


@dataclasses.dataclass
class BagRows:
    """A bag loop whose rows are a table lookup Gather(table, ids) of 1-D ids, maybe times per-id weights."""

    bag: BagLoop
    lookup: gs.Node
    weights: gs.Tensor | None  # [n, 1], [1] or a scalar


def _bag_rows(bag: BagLoop) -> BagRows | None:
    node = bag.rows.inputs[0] if len(bag.rows.inputs) == 1 else None
    pairs = [(node, None)] if node is not None and node.op == "Gather" else []
    if node is not None and node.op == "Mul":
        pairs = [(a.inputs[0], w) for a, w in (node.inputs, node.inputs[::-1]) if len(a.inputs) == 1]
    for lookup, w in pairs:
        table, ids = const_value(lookup.inputs[0]) if lookup.op == "Gather" else None, lookup.inputs[1]
        if table is None or table.ndim != 2 or lookup.attrs.get("axis", 0) != 0 or shape_of(ids) is None or \
                len(shape_of(ids)) != 1 or dtype_of(ids) is None:
            continue
        if w is not None and (shape_of(w) is None or len(shape_of(w)) > 2 or (shape_of(w) and shape_of(w)[-1] != 1)):
            continue
        return BagRows(bag, lookup, None if _ones(w) else w)
    return None


def _ones(w: gs.Tensor | None) -> bool:
    """w is a constant 1 broadcast (torchrec's per-id weights when the batch has none)."""
    while w is not None and len(w.inputs) == 1 and w.inputs[0].op in ("Expand", "Unsqueeze", "Reshape", "Cast"):
        w = w.inputs[0].inputs[0]
    value = const_value(w) if w is not None else None
    return value is not None and value.size >= 1 and bool(np.all(value == 1))


def _bag_collections(bags: list[BagLoop]) -> tuple[list[list[BagRows]], list[BagLoop]]:
    """Bags over lookups of one table width and dtype (torchrec's EmbeddingBagCollection: one per table), in
    groups of two or more; and the other bags."""
    groups: dict[tuple, list[BagRows]] = {}
    alone = []
    for bag in bags:
        rows = _bag_rows(bag)
        table = const_value(rows.lookup.inputs[0]) if rows is not None else None
        if rows is None:
            alone.append(bag)
        else:
            groups.setdefault((table.shape[1], table.dtype), []).append(rows)
    for key, group in list(groups.items()):
        tables = {id(r.lookup.inputs[0]): const_value(r.lookup.inputs[0]).nbytes for r in group}
        if len(group) < 2 or 2 * sum(tables.values()) > DOUBLED_TABLE_BYTES:
            alone += [r.bag for r in groups.pop(key)]
    return list(groups.values()), alone


def _collection_bags(graph: gs.Graph, group: list[BagRows]) -> list[gs.Tensor]:
    """The bags of several lookups as one: the ids of all tables in a row (each offset into one concatenated
    table, stored twice so that negative ids stay exact), one Gather, one scatter over the bags of every table
    (each table's offsets shifted by where its ids start, its last offset closing a gap bag), then each table's
    bags sliced out. Returns each bag loop's replacement, in order."""
    name = unique_name(graph, f"{group[0].bag.loop.name}/collection")
    i64 = np.int64

    b = Builder(graph, name, i64)
    c, op = b.const, b.op

    def as_i64(x):
        return x if np.dtype(dtype_of(x)) == i64 else op("Cast", [x], {"to": onnx.TensorProto.INT64})

    tables, first = [], {}
    for r in group:
        if id(r.lookup.inputs[0]) not in first:
            first[id(r.lookup.inputs[0])] = len(tables)
            tables.append(const_value(r.lookup.inputs[0]))
    starts = np.cumsum([0] + [2 * t.shape[0] for t in tables])
    at = [starts[first[id(r.lookup.inputs[0])]] + tables[first[id(r.lookup.inputs[0])]].shape[0] for r in group]
    ids = [r.lookup.inputs[1] for r in group]
    split = ids[0].inputs[0] if len(ids[0].inputs) == 1 else None
    sizes = None
    if split is not None and split.op == "Split" and split.attrs.get("axis", 0) == 0 and \
            [id(t) for t in split.outputs] == [id(t) for t in ids]:
        all_ids = as_i64(split.inputs[0])  # torchrec: the per-table ids are one split of the jagged values
        sizes = as_i64(split.inputs[1]) if len(split.inputs) > 1 and split.inputs[1].name else None
    else:
        all_ids = op("Concat", [as_i64(x) for x in ids], {"axis": 0})
    if sizes is None:
        sizes = op("Concat", [op("Shape", [x]) for x in ids], {"axis": 0})  # ids per table
    first_ids = op("Sub", [op("CumSum", [sizes, c("axis", [0])]), sizes])
    n = op("Shape", [all_ids])
    # Each id's table offset: the offsets' steps scattered where each table's ids start, summed up to the id.
    steps = op("ScatterElements", [op("ConstantOfShape", [op("Add", [n, c("one", [1])])], {"value": _attr_tensor(0)}),
                                   first_ids, c("steps", np.diff([0] + at))], {"axis": 0, "reduction": "add"})
    shifted = op("Add", [all_ids, op("Slice", [op("CumSum", [steps, c("axis", [0])]), c("zero", [0]), n])])
    dtype = tables[0].dtype
    rows = op("Gather", [add_constant(graph, f"{name}/table", np.concatenate([t for t in tables for _ in (0, 1)])),
                         shifted], {"axis": 0}, dtype=dtype)
    if any(r.weights is not None for r in group):
        weights = [op("Expand", [r.weights if r.weights is not None else c("unit", [1.0], dtype=dtype),
                                 op("Concat", [op("Shape", [x]), c("one", [1])], {"axis": 0})], dtype=dtype)
                   for r, x in zip(group, ids)]
        rows = op("Mul", [rows, op("Concat", weights, {"axis": 0}, dtype=dtype)], dtype=dtype)
    offsets = [as_i64(r.bag.offsets) for r in group]
    shifted_offsets = [op("Add", [o, op("Slice", [first_ids, c("at", [i]), c("next", [i + 1])])])
                       for i, o in enumerate(offsets)]
    every = BagLoop(group[0].bag.loop, group[0].bag.concat, rows, op("Concat", shifted_offsets, {"axis": 0}))
    pooled = _vectorized_bags(graph, every)
    counts = op("Concat", [op("Shape", [o]) for o in offsets], {"axis": 0})  # bags + 1 per table
    base = op("Sub", [op("CumSum", [counts, c("axis", [0])]), counts])
    out = []
    for i in range(len(group)):
        begin = op("Slice", [base, c("at", [i]), c("next", [i + 1])])
        end = op("Sub", [op("Add", [begin, op("Slice", [counts, c("at", [i]), c("next", [i + 1])])]), c("one", [1])])
        out.append(op("Slice", [pooled, begin, end, c("zero", [0])], dtype=dtype))
    return out


def _attr_tensor(v: int) -> gs.Constant:
    """An int64 ConstantOfShape value."""
    return gs.Constant("value", np.array([v], dtype=np.int64))


# Padded bags: ids [B, L] with -1 where a row has fewer than L ids, pooled per row by whatever the exporter made
# of TF's sparse lookups (embedding_lookup_sparse, safe_embedding_lookup_sparse, gather + unsorted_segment_sum:
# NonZero/GatherND, Unique, a Gather per bag, a segment sum, ...). Which tensor holds the pooled [B, D] and how it
# was pooled is found by evaluating the region on probe ids, as merge-partitioned-embeddings does.
COMBINERS = {
    "sum": lambda total, count: total,
    "mean": lambda total, count: total / np.maximum(count, 1),
    "sqrtn": lambda total, count: total / np.sqrt(np.maximum(count, 1)),
}
MIN_BAG_REGION = 6  # nodes: a bag pooled in fewer is as vectorized as the rewrite would make it
REWRITTEN_NODES = {"sum": 4, "mean": 9, "sqrtn": 10}  # what _pooled_lookup makes of each


def _probe_ids(rows: int, batch: int, length: int, dtype, seed: int) -> np.ndarray:
    """Ids in [0, rows) padded with -1 anywhere: an empty row, a full one, both table ends."""
    rng = np.random.default_rng(seed)
    ids = np.where(rng.random((batch, length)) < 0.4, -1, rng.integers(0, rows, (batch, length)))
    ids[0], ids[1 % batch] = -1, rng.integers(0, rows, length)
    ids[1 % batch, 0], ids[1 % batch, -1] = 0, rows - 1
    return ids.astype(dtype)


def _input_sources(t: gs.Tensor, graph: gs.Graph) -> tuple[set[str], set[str]]:
    """Names of the graph inputs whose values `t` depends on ("" for control flow on the way), and of those it
    reads only the shape of (TF's tf.shape(x)[0])."""
    inputs = {id(x) for x in graph.inputs}
    seen, stack, values, shapes = set(), [(t, False)], set(), set()
    while stack:
        x, via_shape = stack.pop()
        if (id(x), via_shape) in seen:
            continue
        seen.add((id(x), via_shape))
        if id(x) in inputs:
            (shapes if via_shape else values).add(x.name)
        for node in x.inputs:
            if any(isinstance(a, gs.Graph) for a in node.attrs.values()):
                values.add("")  # control flow: not a plain bag
            stack.extend((i, via_shape or node.op == "Shape") for i in node.inputs)
    return values, shapes - values


def _region_nodes(t: gs.Tensor, stop: gs.Tensor) -> int:
    seen, stack = set(), [t]
    while stack:
        x = stack.pop()
        for node in x.inputs:
            if id(node) not in seen and x is not stop:
                seen.add(id(node))
                stack.extend(node.inputs)
    return len(seen)


def _bag_candidates(gather: gs.Node, width: int, hops: int = 12) -> list[gs.Tensor]:
    """2-D [?, width] tensors downstream of a table lookup, nearest first: where a pooled bag may be."""
    return [out for node in nodes_near(gather.outputs[0], hops, up=False) for out in node.outputs
            if out.outputs and out.shape is not None and len(out.shape) == 2 and out.shape[1] == width]


def _padded_bag(graph: gs.Graph, gather: gs.Node) -> tuple[gs.Tensor, gs.Tensor, str] | str | None:
    """(ids input, pooled tensor, combiner) of a padded bag ending in a lookup of `gather`'s table; a reason
    when it looked like one but did not evaluate as one; None when it is no bag."""
    table = const_value(gather.inputs[0])
    values, _ = _input_sources(gather.inputs[1], graph)
    by_name = {x.name: x for x in graph.inputs}
    ids = by_name.get(next(iter(values))) if len(values) == 1 else None
    if (ids is None or ids.shape is None or len(ids.shape) != 2 or not isinstance(ids.shape[1], int)
            or ids.dtype is None or not np.issubdtype(np.dtype(ids.dtype), np.integer) or gather.inputs[1] is ids):
        return None
    candidates = []
    for t in _bag_candidates(gather, table.shape[1]):
        t_values, t_shapes = _input_sources(t, graph)
        if t_values == {ids.name} and _region_nodes(t, ids) >= MIN_BAG_REGION:
            candidates.append((t, t_shapes))
    if not candidates:
        return None
    shape_only = [by_name[name] for name in sorted(set().union(*(s for _, s in candidates)))]
    pooled = [t for t, _ in candidates]
    region = Subgraph(pooled, [ids, *shape_only], graph.opset, dtypes=[table.dtype] * len(pooled))
    try:
        results = []
        for seed, batch in ((0, 7), (1, 1), (2, 16)):
            probe = _probe_ids(table.shape[0], batch, ids.shape[1], np.dtype(ids.dtype), seed)
            sizes = [np.zeros([batch] + [d if isinstance(d, int) else 1 for d in x.shape[1:]], dtype=np.dtype(x.dtype))
                     for x in shape_only]  # read for the batch size only
            results.append((probe, {t.name: v for t, v in zip(pooled, region.run([probe, *sizes]))}))
    except Exception as e:  # the region does not evaluate on its own: leave it
        return f"{gather.name}: not evaluated ({type(e).__name__})"
    for t, _ in reversed(candidates):  # the farthest pooled tensor: mean's division included
        for combiner, pool in COMBINERS.items():
            if all(_pools(table, probe, out[t.name], pool) for probe, out in results):
                return (ids, t, combiner) if _region_nodes(t, ids) > REWRITTEN_NODES[combiner] else None
    return f"{gather.name}: no tensor downstream pools the bag ({', '.join(COMBINERS)})"


def _padded_bags(graph: gs.Graph):
    """(table lookup, what _padded_bag found) for every lookup that may end a padded bag in the main graph."""
    annotated = False
    for gather in [n for n in graph.nodes if n.op == "Gather"]:
        table = const_value(gather.inputs[0])
        if table is None or table.ndim != 2 or gather.attrs.get("axis", 0) != 0 or not gather.outputs[0].outputs:
            continue
        if not annotated:
            annotate_shapes(graph)
            annotated = True
        found = _padded_bag(graph, gather)
        if found is not None:
            yield gather, found


def padded_bag_tables(graph: gs.Graph) -> set[str]:
    """Names of the tables whose padded bags vectorize-embedding-bags rewrites (for `ctropt inspect`; on a copy)."""
    graph = graph.copy()
    return {g.inputs[0].name for g, found in _padded_bags(graph) if not isinstance(found, str)}


def _pools(table: np.ndarray, ids: np.ndarray, got: np.ndarray, pool) -> bool:
    valid = ids >= 0
    total = (table[np.where(valid, ids, 0)] * valid[..., None]).sum(axis=1)
    want = pool(total, valid.sum(axis=1, keepdims=True))
    return got.shape == want.shape and np.allclose(got, want, rtol=1e-5, atol=1e-6)


def _pooled_lookup(graph: gs.Graph, table: np.ndarray, ids: gs.Tensor, combiner: str, name: str) -> gs.Tensor:
    """Gather on the table and a zero row that negative ids (padding) read, summed over L; ÷ count for mean."""
    rows = table.shape[0]
    id_dtype = np.dtype(ids.dtype)
    padded = add_constant(graph, f"{name}/table", np.concatenate([table, np.zeros_like(table[:1])]))

    op = Builder(graph, name, table.dtype).op

    padding = op("Less", [ids, add_constant(graph, f"{name}/zero", np.array(0, dtype=id_dtype))], dtype=np.bool_)
    safe = op("Where", [padding, add_constant(graph, f"{name}/pad_row", np.array(rows, dtype=id_dtype)), ids],
              dtype=id_dtype)

    def row_sum(x, keepdims):
        if graph.opset < 13:
            return op("ReduceSum", [x], {"axes": [1], "keepdims": keepdims})
        return op("ReduceSum", [x, add_constant(graph, f"{name}/axis", np.array([1], dtype=np.int64))],
                  {"keepdims": keepdims})

    pooled = row_sum(op("Gather", [padded, safe], {"axis": 0}), 0)
    if combiner == "sum":
        return pooled
    to = onnx.helper.np_dtype_to_tensor_dtype(table.dtype)
    valid = op("Cast", [op("Not", [padding], dtype=np.bool_)], {"to": to})
    count = row_sum(valid, 1)
    count = op("Max", [count, add_constant(graph, f"{name}/one", np.array(1, dtype=table.dtype))])
    return op("Div", [pooled, count if combiner == "mean" else op("Sqrt", [count])])


@register_pass("vectorize-embedding-bags", group="fusion")
def vectorize_embedding_bags(ctx: PassContext) -> None:
    """Bags of ids pooled per sample → one vectorized form: torch's per-bag Loops (Slice + ReduceSum +
    SequenceInsert per sample) → one scatter-add, a single lookup and scatter for the loops over tables of one
    width (torchrec's EmbeddingBagCollection); TF's padded bags ([B, L] ids, -1 for none) pooled by a segment
    sum → Gather on the table and a zero row + ReduceSum (÷ count for mean)."""
    for graph in list(iter_graphs(ctx.graph)):
        bags = [b for loop in graph.nodes if loop.op == "Loop" and (b := _bag_loop(loop, graph)) is not None]
        if not bags:
            continue
        if any(t.shape is None for b in bags for t in (b.rows, b.offsets)):
            annotate_shapes(ctx.graph)
        collections, alone = _bag_collections(bags)
        for group in collections:
            for r, out in zip(group, _collection_bags(graph, group)):
                replace_outputs(graph, r.bag.concat, [out])
            ctx.matches += len(group)
            ctx.rewrites += len(group)
            ctx.note(f"{len(group)} bags over tables of width {const_value(group[0].lookup.inputs[0]).shape[1]} "
                     "→ one lookup and one scatter")
        for bag in alone:
            ctx.matches += 1
            replace_outputs(graph, bag.concat, [_vectorized_bags(graph, bag)])
            ctx.rewrites += 1
    graph = ctx.graph
    for gather, found in list(_padded_bags(graph)):
        ctx.matches += 1
        if isinstance(found, str):
            ctx.note(found)
            continue
        ids, pooled, combiner = found
        table = const_value(gather.inputs[0])
        out = _pooled_lookup(graph, table, ids, combiner, unique_name(graph, f"{gather.name}/bag"))
        replace_outputs(graph, pooled.inputs[0], [out if o is pooled else None for o in pooled.inputs[0].outputs])
        ctx.rewrites += 1
    if ctx.rewrites:
        ctx.graph.cleanup(remove_unused_graph_inputs=False).toposort(mode="nodes")
        annotate_shapes(ctx.graph)  # the table width of the new rows folds
        tidy(ctx)


# ----------------------------------------------------------------------------------------- partitioned tables
#
# TF's embedding_lookup on a PartitionedVariable, as tf2onnx lowers it: the ids split by shard (DynamicPartition:
# a Compress per shard of the ids' rows within it and of their positions), a Gather per shard, and the rows put
# back in the ids' order (DynamicStitch: ScatterElements / ScatterND). The ids it partitions are not always a
# graph input: the zoo's WDL (a plain embedding_lookup) partitions its flattened ids input, but DeepRec's feature
# columns (embedding_lookup_sparse over -1 padded or multi-hot ids) partition the Unique ids of the SparseTensor
# they built (-1 dropped, empty rows given id 0), and read the rows back by the Unique's inverse afterwards: a
# Gather on the ids input there gives one row per input id (13) where the rest of the graph expects one per
# distinct id (7). So the lookup's ids are found by meaning: the nearest tensor that every path from the graph's
# inputs to the stitch passes through, from which the shards are evaluated alone.

MAX_MERGED_ROWS = 1 << 22  # tables up to 4M rows are reassembled (the evaluation holds rows x width floats)
MAX_IDS_TRIED = 3  # candidate ids tensors evaluated per stitch, nearest first


def _shard_lookups(stitch: gs.Node) -> list[gs.Node]:
    """Gathers on constant 2-D shards whose ids were partitioned (Compress), feeding `stitch`'s updates."""
    found, frontier = [], [stitch.inputs[-1]]
    for _ in range(3):
        nxt = []
        for t in frontier:
            for node in t.inputs:
                if node.op == "Gather" and (table := const_value(node.inputs[0])) is not None and table.ndim == 2:
                    if any(n.op == "Compress" for n in nodes_near(node.inputs[1], 2, up=True)):
                        found.append(node)
                else:
                    nxt.extend(node.inputs)
        frontier = nxt
    return found


def _upstream(t: gs.Tensor) -> list[gs.Tensor] | None:
    """The values `t` is computed from, nearest first; None when control flow is on the way (its bodies read
    outer values that no edge shows)."""
    order, seen, frontier = [], {id(t)}, [t]
    while frontier:
        nxt = []
        for x in frontier:
            for node in x.inputs:
                if any(isinstance(a, gs.Graph) for a in node.attrs.values()):
                    return None
                for y in node.inputs:
                    if id(y) not in seen:
                        seen.add(id(y))
                        order.append(y)
                        nxt.append(y)
        frontier = nxt
    return order


def _reaches_input(t: gs.Tensor, inputs: set[int], cut: gs.Tensor | None = None) -> bool:
    """Whether some path from a graph input to `t` avoids `cut`."""
    seen, stack = set(), [t]
    while stack:
        x = stack.pop()
        if x is cut or id(x) in seen:
            continue
        seen.add(id(x))
        if id(x) in inputs:
            return True
        stack.extend(y for node in x.inputs for y in node.inputs)
    return False


def _lookup_ids(stitch: gs.Node, graph: gs.Graph):
    """Where the partitioned lookup may read its ids, nearest first: 1-D integer values computed from the graph's
    inputs that every path from an input to the stitch passes through (the ids input itself in plain lookups,
    the Unique ids of the SparseTensor in embedding_lookup_sparse)."""
    out, inputs = stitch.outputs[0], {id(x) for x in graph.inputs}
    for t in _upstream(out) or []:
        shape, dtype = shape_of(t), dtype_of(t)
        if isinstance(t, gs.Constant) or shape is None or len(shape) != 1 or dtype is None or \
                np.dtype(dtype).kind not in "iu":
            continue
        if _reaches_input(t, inputs) and not _reaches_input(out, inputs, cut=t):
            yield t


def _reassembled_table(ids: gs.Tensor, out: gs.Tensor, shape: tuple[int, int], dtype, opset: int) -> np.ndarray | str:
    """The stitched lookup evaluated from `ids` alone: on every id (the table, [rows, width]), then checked to be
    a row lookup of it on shuffled ids, on repeated ids and on one id. A reason when it is not."""
    id_dtype, rows = np.dtype(dtype_of(ids)), shape[0]
    rng = np.random.default_rng(0)
    probes = [rng.permutation(rows)[:1024], rng.integers(0, rows, 1024), np.array([rows - 1])]
    region = Subgraph([out], [ids], opset, dtypes=[dtype])
    try:
        table, *got = [region.run([x.astype(id_dtype)])[0] for x in [np.arange(rows)] + probes]
    except Exception as e:  # the region does not evaluate from these ids alone
        return f"not evaluated from {ids.name} ({type(e).__name__})"
    if table.shape != shape or not all(np.array_equal(g, table[p]) for g, p in zip(got, probes)):
        return f"not a row lookup of one table on {ids.name}"
    return table


def _merged_table(stitch: gs.Node, graph: gs.Graph, shape: tuple[int, int], dtype):
    """(ids, table): the nearest ids from which the stitched lookup is a row lookup of one table; else a reason."""
    reasons = []
    for ids in itertools.islice(_lookup_ids(stitch, graph), MAX_IDS_TRIED):
        table = _reassembled_table(ids, stitch.outputs[0], shape, dtype, graph.opset)
        if not isinstance(table, str):
            return ids, table
        reasons.append(table)
    return "; ".join(reasons) or "no 1-D integer ids that every path from the inputs to it passes through"


@register_pass("merge-partitioned-embeddings", group="fusion")
def merge_partitioned_embeddings(ctx: PassContext) -> None:
    """A lookup over N table shards (DynamicPartition + Gather per shard + DynamicStitch, mod or div) → one Gather.

    The lookup's ids are the nearest value every path from the inputs to the stitch passes through (the ids
    input, or embedding_lookup_sparse's Unique ids); the full table is rebuilt by evaluating the partitioned lookup
    from them on every id (whatever the strategy and the exporter's lowering), and checked to be a row lookup on
    shuffled and repeated ids."""
    graph, annotated = ctx.graph, False
    for stitch in [n for n in graph.nodes if n.op in ("ScatterElements", "ScatterND") and len(n.inputs) == 3]:
        shards = [const_value(s.inputs[0]) for s in _shard_lookups(stitch)]  # equal shards may share one constant
        if len(shards) < 2 or len({(s.shape[1], s.dtype) for s in shards}) != 1:
            continue
        rows = sum(s.shape[0] for s in shards)
        if rows > MAX_MERGED_ROWS:
            ctx.note(f"{stitch.name}: {rows} rows, over the {MAX_MERGED_ROWS} this pass reassembles")
            continue
        ctx.matches += 1
        if not annotated:
            if any(t.shape is None or t.dtype is None for t in _upstream(stitch.outputs[0]) or []):
                annotate_shapes(graph)  # the lookup's ids are told by their rank and dtype
            annotated = True
        found = _merged_table(stitch, graph, (rows, shards[0].shape[1]), shards[0].dtype)
        if isinstance(found, str):
            ctx.note(f"{stitch.name}: {found}")
            continue
        ids, table = found
        merged = add_constant(graph, f"{stitch.name}/merged_table", table)
        (out,) = add_node(graph, "Gather", [merged, ids], {"axis": 0}, name=f"{stitch.name}/merged", dtype=table.dtype)
        replace_outputs(graph, stitch, [out])
        ctx.rewrites += 1
    if ctx.rewrites:
        graph.cleanup(remove_unused_graph_inputs=False).toposort(mode="nodes")


# ----------------------------------------------------------------------------------------- indicator columns


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
