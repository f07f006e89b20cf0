"""`merge-partitioned-embeddings`: the shards of a partitioned table (TF's embedding_lookup on a
PartitionedVariable: DynamicPartition → Gather per shard → DynamicStitch) → one Gather on the reassembled table."""

from __future__ import annotations

import itertools

import numpy as np
import onnx_graphsurgeon as gs

from ...graph import annotate_shapes, nodes_near
from ...graph.edit import add_constant, add_node, const_value, dtype_of, replace_outputs, shape_of
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
