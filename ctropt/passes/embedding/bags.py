"""`vectorize-embedding-bags`: per-sample bag loops (torch's embedding_bag lowering) → one scatter, one for all
the tables of a bag collection; segment-summed padded bags → a Gather + row sum."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from ...graph import annotate_shapes, iter_graphs, nodes_near
from ...graph.weights import concatenate as concatenate_tables
from ...graph.edit import Builder, add_constant, const_value, dtype_of, replace_outputs, shape_of, unique_name
from ...runtime.subgraph import Subgraph
from ..cleanup import tidy
from ..registry import PassContext, register_pass
from . import parallel


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
        if len(group) < 2:
            alone += [r.bag for r in groups.pop(key)]
    return list(groups.values()), alone


def _collection_bags(graph: gs.Graph, group: list[BagRows]) -> list[gs.Tensor]:
    """The bags of several lookups as one: the ids of all tables in a row (each offset into one concatenated
    table, checked against its own table's rows as its Gather did: `parallel.checked_rows`), one Gather, one scatter over the bags of every table
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
    starts = np.cumsum([0] + [t.shape[0] for t in tables])
    at = [starts[first[id(r.lookup.inputs[0])]] for r in group]
    rows_of = [tables[first[id(r.lookup.inputs[0])]].shape[0] for r in group]
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

    def per_id(values, what):   # each id's table's value: steps scattered where each table's ids start, summed
        steps = op("ScatterElements", [op("ConstantOfShape", [op("Add", [n, c("one", [1])])], {"value": _attr_tensor(0)}),
                                       first_ids, c(what, np.diff([0] + values))], {"axis": 0, "reduction": "add"})
        return op("Slice", [op("CumSum", [steps, c("axis", [0])]), c("zero", [0]), n])

    shifted = parallel.checked_rows(b, all_ids, per_id(rows_of, "sizes"), per_id(at, "offsets"), int(starts[-1]))
    dtype = tables[0].dtype
    rows = op("Gather", [add_constant(graph, f"{name}/table", concatenate_tables(tables)), shifted], {"axis": 0},
              dtype=dtype)
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
# was pooled is found by evaluating the region on probe ids, as merge-partitioned-embeddings does; what it does
# with ids outside the table (which are padding, which raise: PADDINGS) too, on the same probes with one id changed.
COMBINERS = {
    "sum": lambda total, count: total,
    "mean": lambda total, count: total / np.maximum(count, 1),
    "sqrtn": lambda total, count: total / np.sqrt(np.maximum(count, 1)),
}
MIN_BAG_REGION = 6  # nodes: a bag pooled in fewer is as vectorized as the rewrite would make it
REWRITTEN_NODES = {"rows": 3, "sum": 4, "mean": 9, "sqrtn": 10}  # what pooled_lookup makes of each


def _probe_ids(rows: int, batch: int, length: int, dtype, seed: int) -> np.ndarray:
    """Ids in [0, rows) padded with -1 anywhere: an empty row, a full one, both table ends."""
    rng = np.random.default_rng(seed)
    ids = np.where(rng.random((batch, length)) < 0.4, -1, rng.integers(0, rows, (batch, length)))
    ids[0], ids[1 % batch] = -1, rng.integers(0, rows, length)
    ids[1 % batch, 0], ids[1 % batch, -1] = 0, rows - 1
    return ids.astype(dtype)


def input_sources(t: gs.Tensor, graph: gs.Graph) -> tuple[set[str], set[str]]:
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


def region_nodes(t: gs.Tensor, stop: gs.Tensor) -> int:
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


def _padded_bag(graph: gs.Graph, gather: gs.Node) -> tuple[gs.Tensor, gs.Tensor, str, str] | str | None:
    """(ids input, pooled tensor, combiner, padding rule) of a padded bag ending in a lookup of `gather`'s table; a
    reason when it looked like one but did not evaluate as one; None when it is no bag."""
    table = const_value(gather.inputs[0])
    values, _ = input_sources(gather.inputs[1], graph)
    by_name = {x.name: x for x in graph.inputs}
    ids = by_name.get(next(iter(values))) if len(values) == 1 else None
    if (ids is None or ids.shape is None or len(ids.shape) != 2 or not isinstance(ids.shape[1], int)
            or ids.dtype is None or not np.issubdtype(np.dtype(ids.dtype), np.integer) or gather.inputs[1] is ids):
        return None
    candidates = []
    for t in _bag_candidates(gather, table.shape[1]):
        t_values, t_shapes = input_sources(t, graph)
        if t_values == {ids.name} and region_nodes(t, ids) >= MIN_BAG_REGION:
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
        for combiner in COMBINERS:
            if all(same_values(out[t.name], lookup_values(table, probe, combiner)) for probe, out in results):
                if region_nodes(t, ids) <= REWRITTEN_NODES[combiner]:
                    return None
                probe, _ = results[0]
                sizes = [np.zeros([len(probe)] + [d if isinstance(d, int) else 1 for d in x.shape[1:]],
                                  dtype=np.dtype(x.dtype)) for x in shape_only]
                padding = padding_rule(lambda x: region.run([x, *sizes], outputs=[t])[0], probe, table, combiner)
                if padding is None:
                    return f"{gather.name}: ids outside the table are not padding or raising as a lookup's are"
                return ids, t, combiner, padding
    return f"{gather.name}: no tensor downstream pools the bag ({', '.join(COMBINERS)})"


def table_lookups(graph: gs.Graph, identify):
    """(lookup, what `identify(graph, lookup)` found, when not None) for every Gather of a constant [rows, D] table
    in the main graph whose rows something reads; shapes annotated once, before the first."""
    annotated = False
    for gather in [n for n in graph.nodes if n.op == "Gather"]:
        table = const_value(gather.inputs[0])
        if table is None or table.ndim != 2 or gather.attrs.get("axis", 0) != 0 or not gather.outputs[0].outputs:
            continue
        if not annotated:
            annotate_shapes(graph)
            annotated = True
        found = identify(graph, gather)
        if found is not None:
            yield gather, found


def _padded_bags(graph: gs.Graph):
    """(table lookup, what _padded_bag found) for every lookup that may end a padded bag in the main graph."""
    return table_lookups(graph, _padded_bag)


def padded_bag_tables(graph: gs.Graph) -> set[str]:
    """Names of the tables whose padded bags vectorize-embedding-bags rewrites (for `ctropt inspect`; on a copy)."""
    graph = graph.copy()
    return {g.inputs[0].name for g, found in _padded_bags(graph) if not isinstance(found, str)}


def lookup_values(table: np.ndarray, ids: np.ndarray, combiner: str, padding: str = "negative") -> np.ndarray | None:
    """What pooled_lookup computes for `ids` (None: a combiner over ids that are not [B, L]; IndexError for an id
    outside the table)."""
    valid = ids >= 0 if padding == "negative" else ids != -1
    rows = table[np.where(valid, ids, 0)] * valid[..., None]
    if combiner == "rows":
        return rows
    if ids.ndim != 2:
        return None
    return COMBINERS[combiner](rows.sum(axis=1), valid.sum(axis=1, keepdims=True).astype(table.dtype))


def same_values(got: np.ndarray, want: np.ndarray | None) -> bool:
    return want is not None and got.shape == want.shape and np.allclose(got, want, rtol=1e-5, atol=1e-6)


# Ids outside the table (issue 47): the exporters' lookups drop padding and raise on the rest, two ways.
PADDINGS = {
    "negative": "every id < 0 is padding (safe_embedding_lookup_sparse, a segment sum over ids >= 0)",
    "minus_one": "only -1 is padding; other negative ids read from the table's end, as Gather does, and raise "
                 "below -rows (embedding_lookup_sparse over the ids that are not -1)",
}  # in both, an id from the table's rows on raises


def padding_rule(evaluate, probe: np.ndarray, table: np.ndarray, combiner: str) -> str | None:
    """Which of PADDINGS a padded lookup follows, found by running it (`evaluate(ids)`: its output, or it raises) on
    `probe` (valid ids, padded with -1) with one valid id changed: an id past the table and a huge one must raise,
    negative ones be padding, read from the end or raise as the rule says. None: it does something else with them
    (a default row for ids out of range, a hash): pooled_lookup would not answer as it does."""
    rows, dtype = table.shape[0], probe.dtype
    at = tuple(np.argwhere(probe >= 0)[0])

    def changed(v):
        x = probe.copy()
        x[at] = v
        return x

    def answers(v, padding):
        try:
            got = evaluate(changed(v))
        except Exception:  # raising is the answer tested elsewhere
            return False
        return same_values(got, lookup_values(table, changed(v), combiner, padding))

    def raises(v):
        try:
            evaluate(changed(v))
        except Exception:  # what a Gather does with an id outside its table
            return True
        return False

    info = np.iinfo(dtype)
    if not all(raises(v) for v in sorted({rows, rows + 1, info.max, min(1 << 40, info.max)})):
        return None
    from_end = sorted({v for v in (-2, -rows) if v >= -rows})
    beyond = sorted({-rows - 1, info.min, max(-(1 << 40), info.min)})
    if all(answers(v, "negative") for v in from_end + beyond):
        return "negative"
    if all(answers(v, "minus_one") for v in from_end) and all(raises(v) for v in beyond):
        return "minus_one"
    return None


def pooled_lookup(graph: gs.Graph, table: np.ndarray, ids: gs.Tensor, combiner: str, name: str,
                  padding: str = "negative") -> gs.Tensor:
    """Gather on a zero row and the table (row id + 1), the zero row read by padding ids (combiner "rows": that is
    all), summed over L; ÷ count for mean, ÷ √count for sqrtn (the count at least 1: a row without ids gives
    zeros). An id outside the table (as `padding` says, PADDINGS) lands past the table's last row, so the Gather
    raises as the lookup did."""
    rows = table.shape[0]
    id_dtype = np.dtype(ids.dtype)
    padded = add_constant(graph, f"{name}/table", np.concatenate([np.zeros_like(table[:1]), table]))

    b = Builder(graph, name, table.dtype)
    op = b.op

    def const(what, value):
        return add_constant(graph, f"{name}/{what}", np.array(value, dtype=id_dtype))

    # id + 1 for an id >= 0: from the table's rows on, past its last row (and int max + 1 wraps below its first)
    shifted = op("Add", [ids, const("one_row", 1)], dtype=id_dtype)
    if padding == "negative":
        padding = op("Less", [ids, const("zero", 0)], dtype=np.bool_)
        safe = op("Where", [padding, const("pad_row", 0), shifted], dtype=id_dtype)
    else:  # -1 + 1 is the zero row; -2 .. -rows read as they are, from the end (rows + 1 + id); below, past the end
        minus_one = const("minus_one", -1)
        kept = op("Where", [op("Less", [ids, minus_one], dtype=np.bool_), ids, shifted], dtype=id_dtype)
        beyond = op("Less", [ids, const("minus_rows", -rows)], dtype=np.bool_)
        safe = op("Where", [beyond, const("past", rows + 1), kept], dtype=id_dtype)
        padding = None if combiner in ("rows", "sum") else \
            op("Equal", [ids, minus_one], dtype=np.bool_)  # what mean and sqrtn do not count

    def row_sum(x, keepdims):
        return b.axes_op("ReduceSum", x, [1], {"keepdims": keepdims})

    rows = op("Gather", [padded, safe], {"axis": 0})
    if combiner == "rows":
        return rows
    pooled = row_sum(rows, 0)
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
        ids, pooled, combiner, padding = found
        table = const_value(gather.inputs[0])
        out = pooled_lookup(graph, table, ids, combiner, unique_name(graph, f"{gather.name}/bag"), padding)
        replace_outputs(graph, pooled.inputs[0], [out if o is pooled else None for o in pooled.inputs[0].outputs])
        ctx.rewrites += 1
    if ctx.rewrites:
        ctx.graph.cleanup(remove_unused_graph_inputs=False).toposort(mode="nodes")
        annotate_shapes(ctx.graph)  # the table width of the new rows folds
        tidy(ctx)
