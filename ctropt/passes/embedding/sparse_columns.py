"""`rewrite-sparse-columns`: TensorFlow feature-column lookups → a Gather on the table and a zero row.

`categorical_column_with_identity` on a dense int input (-1: no id) → `to_sparse_input` (NonZero of the ids
that are not -1) → `safe_embedding_lookup_sparse` (ids < 0 pruned, SparseFillEmptyRows, Unique, a Gather of
the table, SparseSegmentSum/Mean/SqrtN, empty rows zeroed), as tf2onnx writes it (DeepRec's modelzoo: 650 to
1230 nodes and 12 to 36 Unique ops per model after the other passes). Per row b it means: combine over the
positions l with a valid id (id >= 0) the rows W[id[b, l]] (sum, mean or sqrtn; zeros when there is none),
and for `sequence_` columns the [B, T, D] rows themselves, zeros where the id is not valid.

The lookup is found by meaning, not by names: from each Gather of a constant table, the int graph input its
ids come from, then the farthest value downstream that depends on that input only and evaluates, on hostile
probe ids (-1 and -2 anywhere, empty rows, repeated ids, both table ends, two batch and history sizes), to
one of those meanings; only then is it replaced. Ids outside the table are probed too (bags.padding_rule): the
lookup must drop every negative id and raise from the table's rows on, as the replacement does (issue 47).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_graphsurgeon as gs

from ...graph import annotate_shapes, nodes_near
from ...graph.edit import const_value, redirect_consumers, replace_outputs, unique_name
from ...runtime.subgraph import Subgraph
from ..cleanup import tidy
from ..registry import PassContext, register_pass
from .bags import (COMBINERS, REWRITTEN_NODES, input_sources, lookup_values, padding_rule, pooled_lookup,
                   region_nodes, same_values, table_lookups)

FORMS = ("rows", *COMBINERS)  # rows: W[id] per position ([B] ids → [B, D], [B, T] → [B, T, D])
MIN_ID_NODES = 6  # between the input and the table's Gather (tf2onnx's to_sparse_input + pruning: 20 and more)
HOPS = 48  # how far downstream of the table's Gather the combined rows may be (tf2onnx: about 30 nodes)
PROBE_SIZES = ((7, 5), (1, 4), (16, 3))  # (batch, ids per row when the input does not fix it)


@dataclasses.dataclass
class Column:
    """A sparse-column lookup: `out` = the `form` of table[ids] over the valid ids of the graph input `ids`."""

    gather: gs.Node
    ids: gs.Tensor
    out: gs.Tensor
    form: str
    padding: str = "negative"  # which ids are padding, and what the others outside the table do (PADDINGS)


def _ids_input(graph: gs.Graph, gather: gs.Node) -> gs.Tensor | None:
    """The one int graph input ([B] or [B, L]) the lookup's ids come from, when a few nodes derive them."""
    values, _ = input_sources(gather.inputs[1], graph)
    by_name = {x.name: x for x in graph.inputs}
    ids = by_name.get(next(iter(values))) if len(values) == 1 else None
    if ids is None or ids.shape is None or len(ids.shape) not in (1, 2):
        return None
    if region_nodes(gather.inputs[1], ids) < MIN_ID_NODES:
        return None  # ids read (nearly) as they come: a plain lookup
    return ids if ids.dtype is not None and np.issubdtype(np.dtype(ids.dtype), np.integer) else None


def _candidates(graph: gs.Graph, gather: gs.Node, ids: gs.Tensor, width: int) -> list[tuple[gs.Tensor, set]]:
    """Values downstream of the lookup, nearest first, that may be its result: float, rank 2 or 3 with the
    table's width last (or unknown), computed from `ids` only (other inputs only for their shapes)."""
    found = []
    for node in nodes_near(gather.outputs[0], HOPS, up=False):
        for t in node.outputs:
            shape = t.shape
            if not t.outputs and not any(o is t for o in graph.outputs):
                continue
            if t.dtype is None or not np.issubdtype(np.dtype(t.dtype), np.floating):
                continue
            if shape is not None and (len(shape) not in (2, 3) or shape[-1] not in (width, None)
                                      and not isinstance(shape[-1], str)):
                continue
            values, shapes = input_sources(t, graph)
            if values == {ids.name}:
                found.append((t, shapes))
    return found


def _probe_ids(rows: int, batch: int, length: int | None, dtype, seed: int) -> np.ndarray:
    """Ids in [-2, rows): -1 and -2 anywhere, an empty row, a full one with a repeat and both table ends."""
    rng = np.random.default_rng(seed)
    shape = (batch,) if length is None else (batch, length)
    ids = np.where(rng.random(shape) < 0.4, rng.integers(-2, 0, shape), rng.integers(0, rows, shape))
    if length is None:
        ids[:3] = [0, rows - 1, -1][:batch]
        return ids.astype(dtype)
    ids[0] = -1
    if batch > 1:
        ids[1] = rng.integers(0, rows, length)
        ids[1, 0], ids[1, -1], ids[-1, -1] = 0, rows - 1, ids[1, 0]
    if batch > 2:
        ids[2] = ids[1, ::-1]  # the same ids in another order
    return ids.astype(dtype)


def _probe_feeds(ids: gs.Tensor, shape_only: list[gs.Tensor], rows: int) -> list[list[np.ndarray]]:
    """Leaf values per probe: ids, then zeros shaped like each input read for its shape only."""
    length = None if len(ids.shape) == 1 else ids.shape[1]
    feeds = []
    for seed, (batch, n) in enumerate(PROBE_SIZES):
        n = None if len(ids.shape) == 1 else (length if isinstance(length, int) else n)
        probe = _probe_ids(rows, batch, n, np.dtype(ids.dtype), seed)
        sizes = [np.zeros([batch] + [d if isinstance(d, int) else (n or 1) for d in x.shape[1:]],
                          dtype=np.dtype(x.dtype)) for x in shape_only]
        feeds.append([probe, *sizes])
    return feeds


def _evaluate(outs: list[gs.Tensor], leaves: list[gs.Tensor], opset: int, dtype, feeds: list) -> list:
    """Per output, [(feed, value)] over the probe feeds; None for an output whose region fails on one (all
    outputs at once, then one by one when that fails)."""
    try:
        region = Subgraph(outs, leaves, opset, dtypes=[dtype] * len(outs))
        values = [region.run(feed) for feed in feeds]
        return [[(feed, v[i]) for feed, v in zip(feeds, values)] for i in range(len(outs))]
    except Exception:  # some output's region does not evaluate on its own: try each alone
        pass
    results = []
    for t in outs:
        try:
            region = Subgraph([t], leaves, opset, dtypes=[dtype])
            results.append([(feed, region.run(feed)[0]) for feed in feeds])
        except Exception:  # this one does not evaluate: not the lookup's result
            results.append(None)
    return results


def _identify(graph: gs.Graph, gather: gs.Node) -> Column | str | None:
    """The sparse-column lookup that ends in `gather`'s table lookup; a reason when a region that looked like
    one did not evaluate as one; None when there is no such region."""
    table = const_value(gather.inputs[0])
    ids = _ids_input(graph, gather)
    if ids is None:
        return None
    found = _candidates(graph, gather, ids, table.shape[1])
    if not found:
        return None
    by_name = {x.name: x for x in graph.inputs}
    shape_only = [by_name[name] for name in sorted(set().union(*(s for _, s in found)))]
    outs = [t for t, _ in found]
    results = _evaluate(outs, [ids, *shape_only], graph.opset, table.dtype,
                        _probe_feeds(ids, shape_only, table.shape[0]))
    if not any(results):
        return f"{gather.name}: not evaluated"
    matches = [(t, form) for t, got in zip(outs, results) if got is not None
               for form in FORMS[:1 if len(ids.shape) == 1 else None]
               if all(same_values(v, lookup_values(table, probe[0], form)) for probe, v in got)]
    if matches:  # the one that computes the most: a mean's division and the empty rows' zeros included
        out, form = max(matches, key=lambda m: region_nodes(m[0], ids))  # ties: the first form (fewest nodes)
        if region_nodes(out, ids) <= REWRITTEN_NODES[form]:
            return None
        (probe, *sizes), _ = results[outs.index(out)][0]
        region = Subgraph([out], [ids, *shape_only], graph.opset, dtypes=[table.dtype])
        padding = padding_rule(lambda x: region.run([x, *sizes])[0], probe, table, form)
        if padding is None:
            return f"{gather.name}: ids outside the table are not padding or raising as a lookup's are"
        return Column(gather, ids, out, form, padding)
    return f"{gather.name}: no value downstream of the lookup combines its valid ids ({', '.join(FORMS)})"


@register_pass("rewrite-sparse-columns", group="fusion")
def rewrite_sparse_columns(ctx: PassContext) -> None:
    """TF feature-column lookups (identity column → safe_embedding_lookup_sparse: NonZero, Unique, segment
    sums, empty rows zeroed; sequence columns) → Gather on the table and a zero row (+ ReduceSum, ÷ count)."""
    graph = ctx.graph
    for gather, found in list(table_lookups(graph, _identify)):
        ctx.matches += 1
        if isinstance(found, str):
            ctx.note(found)
            continue
        table = const_value(gather.inputs[0])
        out = pooled_lookup(graph, table, found.ids, found.form, unique_name(graph, f"{gather.name}/column"),
                            found.padding)
        producer = found.out.inputs[0]
        if len(producer.outputs) == 1:
            replace_outputs(graph, producer, [out])
        else:
            redirect_consumers(found.out, out)
        ctx.rewrites += 1
    if ctx.rewrites:
        graph.cleanup(remove_unused_graph_inputs=False).toposort(mode="nodes")
        annotate_shapes(graph)
        tidy(ctx)
