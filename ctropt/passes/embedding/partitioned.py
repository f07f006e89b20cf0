"""`merge-partitioned-embeddings`: the shards of a partitioned table (TF's embedding_lookup on a
PartitionedVariable: DynamicPartition → Gather per shard → DynamicStitch) → one Gather on the reassembled table."""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import onnx_graphsurgeon as gs

from ...graph import annotate_shapes, nodes_near
from ...graph.edit import Builder, add_constant, add_node, const_value, dtype_of, replace_outputs, shape_of
from ...runtime.subgraph import Subgraph
from ..registry import PassContext, register_pass


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


def _reassembled_table(ids: gs.Tensor, out: gs.Tensor, shape: tuple[int, int], dtype,
                       opset: int) -> tuple[np.ndarray, Subgraph] | str:
    """The stitched lookup evaluated from `ids` alone: on every id (the table, [rows, width]), then checked to be
    a row lookup of it on shuffled ids, on repeated ids and on one id; with the region evaluated. A reason when it
    is not."""
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
    return table, region


# Ids outside the table (issue 47). The partitioned lookup raises on every id from the table's rows on, as a Gather
# does, but what it does with a negative id is its lowering's arithmetic, not a Gather's: tf2onnx's mod strategy
# (shard = id - N·trunc(id / N), row id / N) puts a negative id in no shard (the stitch raises) unless N divides it,
# and then reads row id / N from the end of shard 0; its div strategy reads ids -1 .. -(rows of shard 0 - 1) from
# the end of shard 0. Both are "the negative ids in [-reach, 0) that `step` divides read row id + shift, the
# others raise", found by running the lookup on single ids and checked on many; the merged lookup then sends
# the ids it raises on past the merged table, so its Gather raises too. (The div lowering casts the shard to int32:
# a few huge negative ids, such as -2^40, land in shard 0 by wrapping around; those are not followed, and the pass
# says so in a note.)


@dataclasses.dataclass(frozen=True)
class Negatives:
    """The negative ids a partitioned lookup answers: those in [-reach, 0) that `step` divides, reading row
    id + shift; it raises on every other negative id (and on every id from its rows on)."""

    reach: int
    step: int = 1
    shift: int = 0

    def answers(self, x: int) -> bool:
        return -self.reach <= x < 0 and x % self.step == 0


def _reader(region: Subgraph, rows: int, dtype):
    """read(x): the row the partitioned lookup gives id x (between two valid ids), None when it raises."""
    seen = {}

    def read(x: int):
        if x not in seen:
            try:
                seen[x] = region.run([np.array([0, x, rows - 1], dtype)])[0][1]
            except Exception:  # an id out of the lookup's range: the region raises, as the export does
                seen[x] = None
        return seen[x]
    return read


def _shift(table: np.ndarray, answered: dict, lowest: int, highest: int) -> int | None:
    """A shift in [lowest, highest] with table[x + shift] = what id x read, for every answered negative id x
    (rows alike, as in a table of zeros, allow several: the nearest to `lowest`)."""
    shifts = set(range(lowest, highest + 1))
    for x, row in answered.items():
        shifts &= {int(c) - x for c in np.flatnonzero((table == row).all(axis=1))}
    return min(shifts) if shifts else None


def _fit_negatives(read, table: np.ndarray, near: range) -> Negatives | str:
    """The Negatives that the ids of `near` (the first negative ids) show: the step that divides those answered,
    the reach bisected on the multiples of the step, and the shift that reads their rows."""
    rows = table.shape[0]
    answered = {x: row for x in near if (row := read(x)) is not None}
    if not answered:
        return Negatives(0)
    step = math.gcd(*answered)
    if any(x not in answered for x in near if x % step == 0 and x >= min(answered)):
        return "answers some negative ids and not others between them"
    # -step reads row shift - step < rows, so no id below -(rows + step) reads a row
    lo, hi = -min(answered) // step, rows // step + 2
    if read(-hi * step) is not None:
        return f"answers id {-hi * step}"
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if read(-mid * step) is not None else (lo, mid)
    reach = lo * step
    shift = _shift(table, {**answered, -reach: read(-reach)}, reach, rows + step - 1)
    return "reads negative ids as no row of the table" if shift is None else Negatives(reach, step, shift)


def _negatives(region: Subgraph, table: np.ndarray, dtype, shards: int) -> tuple[Negatives, list[int]] | str:
    """How the partitioned lookup from `region`'s ids treats ids outside [0, rows): (its Negatives, the huge
    negative ids where it does otherwise), or a reason when no Negatives describes it."""
    rows, info, rng = table.shape[0], np.iinfo(dtype), np.random.default_rng(0)
    read, w = _reader(region, rows, dtype), shards + 1
    past = {rows + d for d in range(w)} | {2 * rows, info.max, min(1 << 40, info.max)}  # every shard's next row
    if any(read(x) is not None for x in sorted(past)):
        return f"answers ids past its {rows} rows"
    if info.min == 0:
        return Negatives(rows, 1, rows), []  # unsigned ids: none is negative
    near = range(-1, -2 * w - 1, -1)  # two multiples of any step up to the shards' count
    fit = _fit_negatives(read, table, near)
    if isinstance(fit, str):
        return fit
    probes = set(near) | {-(fit.reach + d) for d in range(-2 * fit.step - 1, 2 * fit.step + 2)}
    probes |= {-rows + d for d in range(-w, w + 1)} | {-2 * rows, -fit.shift, -fit.shift - 1}
    probes |= {int(x) for x in rng.integers(-2 * rows, 0, 8)}
    probes = sorted(x for x in probes if x < 0)
    answered = np.array([x for x in probes if fit.answers(x)], dtype)
    if len(answered) and not np.array_equal(region.run([answered])[0], table[answered + fit.shift]):
        return "reads negative ids as other rows"
    if any(read(x) is not None for x in probes if not fit.answers(x)):
        return "answers negative ids beyond the ones it was seen to answer"
    wide = sorted({info.min, max(-(1 << 62), info.min), max(-(1 << 40), info.min), -(1 << 31), 1 - (1 << 31)})
    return fit, [x for x in wide if (read(x) is not None) != fit.answers(x)]


def _merged_ids(graph: gs.Graph, ids: gs.Tensor, fit: Negatives, rows: int, name: str) -> gs.Tensor:
    """The ids the merged Gather reads: ids in [0, rows) as they are, the negative ones the partitioned lookup
    answers shifted to their rows, the others past the merged table (so that its Gather raises)."""
    if fit == Negatives(rows, 1, rows):
        return ids  # what Gather does with negative ids itself
    dtype = np.dtype(dtype_of(ids))
    b = Builder(graph, name, dtype)
    past = b.const("past", np.array(rows, dtype))
    negative = b.op("Less", [ids, b.const("zero", np.array(0, dtype))], dtype=np.bool_)
    if fit.reach == 0:
        return b.op("Where", [negative, past, ids])
    row = b.op("Where", [negative, b.op("Add", [ids, b.const("shift", np.array(fit.shift, dtype))]), ids])
    bad = b.op("Less", [ids, b.const("reach", np.array(-fit.reach, dtype))], dtype=np.bool_)
    if fit.step > 1:
        divided = b.op("Equal", [b.op("Mod", [ids, b.const("step", np.array(fit.step, dtype))]),
                                 b.const("zero", np.array(0, dtype))], dtype=np.bool_)
        bad = b.op("Or", [bad, b.op("And", [negative, b.op("Not", [divided], dtype=np.bool_)], dtype=np.bool_)],
                   dtype=np.bool_)
    return b.op("Where", [bad, past, row])


def read_merged_ids(t: gs.Tensor) -> tuple[gs.Tensor, Negatives, int] | None:
    """(ids, fit, rows) where `t` is `_merged_ids(ids, fit, rows)` (fuse-parallel-embeddings joins the lookup on the
    ids and applies fit to every column at once); None for anything else."""
    where = _made_by(t, "Where")
    rows = _scalar(where.inputs[1]) if where else None
    if rows is None:
        return None
    bad, row = where.inputs[0], where.inputs[2]
    negative = _made_by(bad, "Less")
    if negative is not None and negative.inputs[0] is row and _scalar(negative.inputs[1]) == 0:
        return row, Negatives(0), rows
    inner = _made_by(row, "Where")
    negative, shifted = (_made_by(inner.inputs[0], "Less"), _made_by(inner.inputs[1], "Add")) if inner else (None,) * 2
    if negative is None or shifted is None:
        return None
    ids, shift = inner.inputs[2], _scalar(shifted.inputs[1])
    if negative.inputs[0] is not ids or _scalar(negative.inputs[1]) != 0 or shifted.inputs[0] is not ids or \
            shift is None:
        return None
    step, either = 1, _made_by(bad, "Or")
    if either is not None:  # Or(Less(ids, -reach), And(negative, Not(Equal(Mod(ids, step), 0))))
        bad, odd = either.inputs
        both = _made_by(odd, "And")
        differs = _made_by(both.inputs[1], "Not") if both and both.inputs[0] is negative.outputs[0] else None
        equal = _made_by(differs.inputs[0], "Equal") if differs else None
        mod = _made_by(equal.inputs[0], "Mod") if equal and _scalar(equal.inputs[1]) == 0 else None
        step = _scalar(mod.inputs[1]) if mod and mod.inputs[0] is ids else None
        if step is None:
            return None
    below = _made_by(bad, "Less")
    reach = -_scalar(below.inputs[1]) if below and below.inputs[0] is ids and _scalar(below.inputs[1]) is not None \
        else None
    return None if reach is None else (ids, Negatives(reach, step, shift), rows)


def _made_by(t: gs.Tensor, op: str) -> gs.Node | None:
    node = t.inputs[0] if len(t.inputs) == 1 else None
    return node if node is not None and node.op == op and not node.domain else None


def _scalar(t: gs.Tensor) -> int | None:
    value = const_value(t)
    return int(value.ravel()[0]) if value is not None and value.size == 1 else None


def _merged_table(stitch: gs.Node, graph: gs.Graph, shape: tuple[int, int], dtype):
    """(ids, table, the lookup's region from them): the nearest ids from which the stitched lookup is a row lookup
    of one table; else a reason."""
    reasons = []
    for ids in itertools.islice(_lookup_ids(stitch, graph), MAX_IDS_TRIED):
        found = _reassembled_table(ids, stitch.outputs[0], shape, dtype, graph.opset)
        if not isinstance(found, str):
            return (ids, *found)
        reasons.append(found)
    return "; ".join(reasons) or "no 1-D integer ids that every path from the inputs to it passes through"


@register_pass("merge-partitioned-embeddings", group="fusion")
def merge_partitioned_embeddings(ctx: PassContext) -> None:
    """A lookup over N table shards (DynamicPartition + Gather per shard + DynamicStitch, mod or div) → one Gather.

    The lookup's ids are the nearest value every path from the inputs to the stitch passes through (the ids
    input, or embedding_lookup_sparse's Unique ids); the full table is rebuilt by evaluating the partitioned lookup
    from them on every id (whatever the strategy and the exporter's lowering), and checked to be a row lookup on
    shuffled and repeated ids. Ids outside the table get the partitioned lookup's answers (Negatives): found by
    running it on single ids, the merged Gather raises where it raises and reads the rows it reads."""
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
        ids, table, region = found
        bounds = _negatives(region, table, np.dtype(dtype_of(ids)), len(shards))
        if isinstance(bounds, str):
            ctx.note(f"{stitch.name}: ids outside the table: {bounds}")
            continue
        fit, odd = bounds
        if odd:
            ctx.note(f"{stitch.name}: ids {', '.join(map(str, odd))} are not answered as the export answers them "
                     "(its shard index wraps around in int32)")
        merged = add_constant(graph, f"{stitch.name}/merged_table", table)
        index = _merged_ids(graph, ids, fit, rows, f"{stitch.name}/merged_ids")
        (out,) = add_node(graph, "Gather", [merged, index], {"axis": 0}, name=f"{stitch.name}/merged",
                          dtype=table.dtype)
        replace_outputs(graph, stitch, [out])
        ctx.rewrites += 1
    if ctx.rewrites:
        graph.cleanup(remove_unused_graph_inputs=False).toposort(mode="nodes")
