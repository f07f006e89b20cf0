"""Sample-aware dedup: `dedup-user-side` computes what depends only on the user once per distinct user.

In ranking, one request scores B candidate items for one user, so everything that depends only on the user
(history embeddings, the interest-extraction GRU, user towers) is the same in every row (DeepRec's sample-aware
graph compression). The pass:
- takes the user-side seeds: history id inputs ([B, T] ids), history lengths and masks, the history/length
  columns deepctr-torch slices out of its one input, and inputs named in the ``user_inputs`` option;
- finds the nodes that read only seeds and constants and whose values are per row (measured: ``runtime.probe``);
- checks, by running them on a subset of rows with repeats, that no op mixes rows (batch statistics at
  inference, reductions over the batch axis); such ops and what follows them stay per row, and the pass says so;
- rewrites: Unique over the rows of the seeds → the nodes run on the distinct rows → Gather(inverse) where the
  rest of the graph reads their results. Exact: equal seeds give equal results.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from ...ops.rnn import is_sequence_node
from ...graph import annotate_shapes_if_bare
from ...graph.edit import Builder, const_value, unique_name
from ...runtime.inputs import analyze_inputs, user_input_columns, user_input_names
from ...runtime.probe import Probe, try_probe
from ...runtime.subgraph import Subgraph
from ..attention.additive_mask import LAYOUT
from ..cleanup import tidy
from ..registry import PassContext, register_pass
from .user_layer import column_seeds, is_user_input, split_user_layers

HEAVY_OPS = {"MatMul", "Gemm", "GRU", "LSTM", "RNN", "Conv"}
VIEW_OPS = LAYOUT - {"Transpose"}   # layout ops onnxruntime writes no bytes for
OPAQUE_OPS = {"Loop", "Scan", "If"}  # bodies may read outer values the closure does not track
SUBSET = [3, 0, 0, 7, 5]  # rows of the first probe run, reordered and repeated: a row-wise op maps them alike


def _batches(probe: Probe) -> list[int]:
    return [len(next(iter(f.values()))) if f else 0 for f in probe.feeds]


def _per_row(t: gs.Tensor, probe: Probe, batches: list[int]) -> bool:
    shapes = probe.shapes(t)
    return shapes is not None and all(len(s) >= 1 and s[0] == b for s, b in zip(shapes, batches))


def _rows_stacked(t: gs.Tensor, probe: Probe, batches: list[int]) -> bool:
    """Rows of the batch stacked on the first axis: heads concatenated over the batch (tf's multi-head attention),
    [B, T, D] flattened to [B·T, D]. Such a value may run once per user inside the user side, never leave it."""
    shapes = probe.shapes(t)
    return shapes is not None and all(len(s) >= 1 and b > 0 and s[0] > b and s[0] % b == 0
                                      for s, b in zip(shapes, batches))


def user_seeds(graph: gs.Graph, probe: Probe, named: set[str], columns: dict[str, set[int]] | None = None,
               facts: dict | None = None) -> list[gs.Tensor]:
    """The values that describe the user: history ids, lengths, masks (inputs or packed columns), named inputs and
    declared columns of packed inputs. `facts`: the raw model's input facts (the PassManager's), read off the graph
    where absent: an optimized graph no longer shows them (a joined table's bounds check compares ids with 0, as a
    length is compared), and a second run must see what the first saw."""
    facts = {**analyze_inputs(graph), **(facts or {})}
    batches = _batches(probe)
    seeds = []
    for inp in graph.inputs:
        f = facts[inp.name]
        if not _per_row(inp, probe, batches):
            continue
        if is_user_input(inp, f, probe.shapes(inp), named):
            seeds.append(inp)
            continue
        read = f.length_columns | (columns or {}).get(inp.name, set()) | \
            {c for s, e in f.regions if e - s > 1 for c in range(s, e)}
        if read:
            seeds += column_seeds(inp, read)
    return seeds


def _closure(graph: gs.Graph, seeds: list[gs.Tensor], probe: Probe, excluded: set[int]) -> tuple[list, list]:
    """Nodes (graph order) that read only seeds, constants and each other, with per-row or shape-like values;
    and why nodes that read only those were left out (their value is not per row: a reduction over the batch)."""
    batches = _batches(probe)
    inside = {id(s) for s in seeds}
    nodes, reasons = [], []
    for n in graph.nodes:
        values = [u for u in n.inputs if u.name and const_value(u) is None]
        if id(n) in excluded or n.op in OPAQUE_OPS or not values or not all(id(u) in inside for u in values):
            continue
        if not all(_per_row(o, probe, batches) or _rows_stacked(o, probe, batches) or probe.shape_like(o)
                   for o in n.outputs if o.name):
            reasons.append(f"{n.op} {n.name} reduces over the batch (its value is not one per row)")
            continue
        nodes.append(n)
        inside.update(id(o) for o in n.outputs)
    return nodes, reasons


def _explicit_squeeze_axes(nodes: list[gs.Node], probe: Probe, opset: int, changed: list) -> None:
    """A Squeeze without axes drops the batch axis when one distinct user is left: name the axes it drops
    (those of size 1 in both probe runs). `changed` gets (node, inputs, attrs) to undo it."""
    for n in nodes:
        if n.op != "Squeeze" or (len(n.inputs) > 1 and n.inputs[1].name) or "axes" in n.attrs:
            continue
        shapes = probe.shapes(n.inputs[0])
        axes = [{i for i, d in enumerate(s) if d == 1} for s in shapes or []]
        if not axes or any(a != axes[0] for a in axes):
            continue
        value = np.array(sorted(axes[0]), np.int64)
        changed.append((n, list(n.inputs), dict(n.attrs)))
        if opset >= 13:
            axes_input = gs.Constant(f"{n.name}/axes", value)
            if len(n.inputs) > 1:
                n.inputs[1] = axes_input
            else:
                n.inputs.append(axes_input)
        else:
            n.attrs["axes"] = value.tolist()


def _descendants(nodes: list[gs.Node], start: set[int]) -> set[int]:
    """Ids of the nodes in `nodes` (graph order) that are in `start` or read a value made by one of them."""
    out, made = set(), set()
    for n in nodes:
        if id(n) in start or any(id(u) in made for u in n.inputs):
            out.add(id(n))
            made.update(id(o) for o in n.outputs)
    return out


def rows_mixed(nodes: list[gs.Node], seeds: list[gs.Tensor], probe: Probe, opset: int, functions) -> tuple[set, str]:
    """Nodes whose values for a row depend on other rows (measured on a reordered subset with repeats)."""
    batches = _batches(probe)
    values = [o for n in nodes for o in n.outputs if o.name and _per_row(o, probe, batches)]
    if not values:   # nothing of the user's alone to run
        return set(), ""
    try:
        user_side = Subgraph(values, seeds, opset, nodes=nodes, dtypes=[probe.value(v).dtype for v in values],
                             functions=functions)
        full = user_side.run([probe.value(s) for s in seeds])
    except Exception as e:
        return {id(n) for n in nodes}, f"cannot run the user side on its own: {str(e).splitlines()[0][:160]}"
    bad = []
    for sel in ([r for r in SUBSET if r < batches[0]], [0]):  # one user per request: one distinct row
        try:
            part = user_side.run([probe.value(s)[sel] for s in seeds])
        except Exception as e:
            return {id(n) for n in nodes}, f"the user side does not run on {len(sel)} rows: {str(e)[:160]}"
        bad += [v for v, a, b in zip(values, full, part) if a[sel].shape != b.shape or
                not np.allclose(a[sel], b, rtol=1e-5, atol=1e-6, equal_nan=True)]
    producer = {id(o): n for n in nodes for o in n.outputs}
    if not bad:
        return set(), ""
    first = producer[id(bad[0])]
    return {id(producer[id(v)]) for v in bad}, f"{first.op} {first.name} mixes rows of the batch"


@register_pass("dedup-user-side", group="fusion")
def dedup_user_side(ctx: PassContext) -> None:
    """Per-user work (history embeddings, interest GRU, with --user-inputs the user part of the first FC layer) →
    computed once per distinct user in the batch (Unique/Gather)."""
    named = user_input_names(ctx.options.get("user_inputs", "") or "")
    named |= {k for k, f in (ctx.input_facts or {}).items() if f.is_user}
    columns = {k: set(f.user_columns) for k, f in (ctx.input_facts or {}).items() if f.user_columns}
    for k, cols in user_input_columns(ctx.options.get("user_inputs", "") or "").items():
        columns[k] = columns.get(k, set()) | cols
    declared = bool(named or columns)
    if not any(i.shape and len(i.shape) >= 2 for i in ctx.graph.inputs) and not declared:
        return
    whole, halves = (ctx.graph.copy(), []) if declared else (None, [])
    if declared:
        annotate_shapes_if_bare(ctx.graph)   # the widths of the first layers' parts
        halves = split_user_layers(ctx.graph, named, columns)
    before = (len(ctx.notes), ctx.matches, ctx.rewrites)
    rewritten = _dedup(ctx, named, columns)
    if halves and not all(id(h) in rewritten for h in halves):   # the split pays only with its user half deduplicated
        del ctx.notes[before[0]:]
        ctx.graph, ctx.matches, ctx.rewrites = whole, before[1], before[2]
        rewritten = _dedup(ctx, named, columns)
        ctx.note(f"{len(halves)} first layer(s) left whole: their user part would not run once per user")
    elif halves:
        ctx.note(f"{len(halves)} first layer(s) split into a user part and an item part (x·W = x_u·W_u + x_i·W_i)")
    elif whole is not None and not rewritten:
        ctx.graph = whole   # as it came (without the shapes annotated for the split)


def _dedup(ctx: PassContext, named: set[str], columns: dict[str, set[int]]) -> set[int]:
    """The rewrite; the ids of the nodes that now run on the distinct rows (none: no rewrite)."""
    graph = ctx.graph
    probe, why = try_probe(graph)
    if probe is None:
        ctx.note(why)
        return set()
    seeds = user_seeds(graph, probe, named, columns, ctx.input_facts)
    if not seeds:
        ctx.note("left as is: no user-side inputs (history ids, lengths, masks; name others with "
                 "--user-inputs a,b)")
        return set()
    if all(any(s is i for s in seeds) for i in graph.inputs):
        ctx.note("left as is: every input is user side (no candidate item to share the user's work with)")
        return set()
    opset = int(getattr(graph, "opset", None) or 0)
    batches = _batches(probe)
    excluded: set[int] = set()
    reasons, squeezes = [], []
    for _ in range(20):  # shrink until nothing mixes rows and no shape value is read outside
        nodes, blocked = _closure(graph, seeds, probe, excluded)
        _explicit_squeeze_axes(nodes, probe, opset, squeezes)
        mixed, why = rows_mixed(nodes, seeds, probe, opset, graph.functions)
        reasons += [r for r in blocked + [why] if r and r not in reasons]
        inside = {id(n) for n in nodes}
        outputs = {id(o) for o in graph.outputs}
        leaked = {id(n) for n in nodes for o in n.outputs if o.name and not _per_row(o, probe, batches)
                  and (id(o) in outputs or any(id(c) not in inside for c in o.outputs))}
        drop = _descendants(nodes, mixed | leaked)
        if not drop:
            break
        excluded |= drop
    heavy = [n for n in nodes if _heavy(n)]
    if named or columns:   # one user per request: a light chain pays as well when it writes more than comes back
        heavy += [n for n in _worth_once(nodes, probe, batches) if n not in heavy]
    reachable = len(nodes)
    nodes = _with_readers(nodes, _around(nodes, heavy, seeds), probe, batches)
    read = {id(u) for n in nodes for u in n.inputs}
    seeds = [s for s in seeds if id(s) in read]
    for why in reasons:
        ctx.note(f"kept per row: {why}")
    ctx.matches += 1
    rewriting = {id(n) for n in nodes} if heavy and _key_dtype(seeds, probe) is not None else set()
    for n, inputs, attrs in squeezes:  # what will not run on distinct rows stays as it was
        if id(n) not in rewriting:
            n.inputs.clear()
            n.inputs.extend(inputs)
            n.attrs.clear()
            n.attrs.update(attrs)
    if not heavy:
        ctx.note(f"left as is: the user side ({reachable} ops, no matmul or recurrent layer) is too light to pay "
                 "for deduplication")
        return set()
    if _key_dtype(seeds, probe) is None:
        ctx.note("left as is: the user-side values mix int64 ids and floats, which no one key type holds exactly")
        return set()
    _rewrite(graph, seeds, nodes, probe)
    ctx.rewrites += 1
    tidy(ctx)
    ctx.note(f"{len(nodes)} ops ({', '.join(sorted({n.op for n in heavy}))}) on {len(seeds)} user-side values run "
             "once per distinct user")
    return {id(n) for n in nodes}


def _heavy(node: gs.Node) -> bool:
    """A layer worth running once per user: a matmul (not by a 0/1 matrix, which only sums or selects, as
    fuse-parallel-embeddings' bag segments do) or a recurrent layer."""
    if is_sequence_node(node):
        return True
    if node.op not in HEAVY_OPS:
        return False
    weights = [w for w in (const_value(x) for x in node.inputs[:2]) if w is not None]
    return not any(w.size and np.isin(w, (0, 1)).all() for w in weights)


def _worth_once(nodes: list[gs.Node], probe: Probe, batches: list[int]) -> list[gs.Node]:
    """Light nodes whose per-row value costs more to compute than to gather back once per row: the bytes written by
    the ops it needs, itself included, at least twice its own (a mask tiled over heads and tokens, embeddings
    concatenated), measured on the probe. Layout ops are views: they neither count nor qualify. Worth it only where
    requests hold one user."""
    producer = {id(o): n for n in nodes for o in n.outputs}

    def size(t: gs.Tensor) -> int:
        v = probe.value(t)
        return 0 if v is None else v.nbytes

    found = []
    for n in nodes:
        own = sum(size(o) for o in n.outputs if o.name and _per_row(o, probe, batches))
        seen, stack, cost = set(), [n], 0
        while stack and own and n.op not in VIEW_OPS and cost < 2 * own:   # each op it needs once, until it pays
            m = stack.pop()
            if id(m) not in seen:
                seen.add(id(m))
                cost += 0 if m.op in VIEW_OPS else sum(size(o) for o in m.outputs if o.name)
                stack += [producer[id(u)] for u in m.inputs if id(u) in producer]
        if own and n.op not in VIEW_OPS and cost >= 2 * own:
            found.append(n)
    return found


def _with_readers(closure: list[gs.Node], kept: list[gs.Node], probe: Probe, batches: list[int]) -> list[gs.Node]:
    """`kept` grown until each of its values that is not one per row (rows stacked on the first axis, a shape) is
    read inside it only: such a value's readers join it with what they need (all in the closure, whose values read
    outside it are per row), since only per-row values are gathered back."""
    producer = {id(o): n for n in closure for o in n.outputs}
    keep = {id(n) for n in kept}
    while True:
        stack = [c for n in closure if id(n) in keep for o in n.outputs if o.name and not _per_row(o, probe, batches)
                 for c in o.outputs if id(c) not in keep]
        if not stack:
            return [n for n in closure if id(n) in keep]
        while stack:
            m = stack.pop()
            if id(m) not in keep:
                keep.add(id(m))
                stack += [producer[id(u)] for u in m.inputs if id(u) in producer]


def _around(nodes: list[gs.Node], heavy: list[gs.Node], seeds: list[gs.Tensor]) -> list[gs.Node]:
    """The heavy nodes, what they need and what follows from them alone: light side branches (masks, sums) stay
    per row, so they need no Gather back."""
    producer = {id(o): n for n in nodes for o in n.outputs}
    keep, stack = set(), list(heavy)
    while stack:
        n = stack.pop()
        if id(n) not in keep:
            keep.add(id(n))
            stack.extend(producer[id(u)] for u in n.inputs if id(u) in producer)
    made = {id(s) for s in seeds} | {id(o) for n in nodes if id(n) in keep for o in n.outputs}
    for n in nodes:
        values = [u for u in n.inputs if u.name and const_value(u) is None]
        if id(n) not in keep and any(id(u) in producer and id(producer[id(u)]) in keep for u in values) \
                and all(id(u) in made for u in values):
            keep.add(id(n))
            made.update(id(o) for o in n.outputs)
    return [n for n in nodes if id(n) in keep]


def _key_dtype(seeds: list[gs.Tensor], probe: Probe):
    """One dtype holding every seed exactly: int64 for integers, the float type for floats, float64 when mixed
    (None when an int64 seed is mixed with floats: float64 would round ids above 2^53)."""
    kinds = {np.dtype(probe.value(s).dtype) for s in seeds}
    if all(np.issubdtype(k, np.integer) or k == np.bool_ for k in kinds):
        return np.int64
    if len(kinds) == 1:
        return next(iter(kinds))
    if any(k.itemsize == 8 and np.issubdtype(k, np.integer) for k in kinds):
        return None
    return np.float64


def _probe_width(s: gs.Tensor, probe: Probe) -> int | None:
    """The columns of seed s per row where the probe saw the same number at every size; None where they vary."""
    widths = {int(np.prod(shape[1:], dtype=np.int64)) for shape in (probe.shapes(s) or [])}
    return widths.pop() if len(widths) == 1 else None


def _rewrite(graph: gs.Graph, seeds: list[gs.Tensor], nodes: list[gs.Node], probe: Probe) -> None:
    base = unique_name(graph, "user_side")
    b = Builder(graph, base)
    op = b.op

    dtype = _key_dtype(seeds, probe)
    to = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    # Flatten, not Reshape [0, -1]: an empty batch has no elements to infer the -1 from
    parts = [s if len(s.shape or []) == 2 and s.dtype == dtype else op("Cast", [op("Flatten", [s], {"axis": 1})], {"to": to})
             for s in seeds]   # [B, k] seeds of the key's type as they are: a lookup's ids concatenated are the same
    if not any((_probe_width(s, probe) or 0) > 0 for s in seeds):
        # histories alone, whose length may be 0: onnxruntime's Unique aborts the process on rows of no width
        rows = op("Slice", [op("Shape", [parts[0]]), b.const("zero", np.array([0], np.int64)),
                            b.const("one", np.array([1], np.int64))])
        parts.append(op("ConstantOfShape", [op("Concat", [rows, b.const("one", np.array([1], np.int64))], {"axis": 0})],
                        {"value": gs.Constant(b.name("zero_value"), np.zeros(1, dtype))}))
    key = op("Concat", parts, {"axis": 1}) if len(parts) > 1 else parts[0]
    _, first, inverse, _ = op("Unique", [key], {"axis": 0, "sorted": 0}, outputs=4)
    inside = {id(n) for n in nodes}
    for s in seeds:
        distinct = op("Gather", [s, first], {"axis": 0})
        for n in list(s.outputs):
            if id(n) in inside:
                n.inputs[n.inputs.index(s)] = distinct
    graph_outputs = {id(t) for t in graph.outputs}
    for n in nodes:
        for o in n.outputs:
            declared = (o.dtype, o.shape)
            o.shape = None  # one row per distinct user now: the batch dim's name no longer applies
            outside = [c for c in o.outputs if id(c) not in inside]
            if not outside and id(o) not in graph_outputs:
                continue
            full = op("Gather", [o, inverse], {"axis": 0})
            full.dtype, full.shape = declared  # one row per row again
            for c in outside:
                c.inputs[c.inputs.index(o)] = full
            if id(o) in graph_outputs:  # the graph output keeps its name: the per-row value takes it
                i = graph.outputs.index(o)
                o.name, full.name = full.name, o.name
                graph.outputs[i] = full
