"""Attention over padded histories: `remove-attention-padding` scores the valid history positions only.

DIN and DIEN score every history position with an MLP over [B, T, 4C] and then mask the padded positions away.
The pass starts at the masking, in the exporters' forms:
- ``Where(valid, s, fill)`` (or ``Where(padded, fill, s)``) with a fill that does not depend on the scores'
  values (zeros_like, ones_like * -2^32+1, a constant);
- ``Mul(s, mask)`` with the mask a Cast of booleans or a mask input (tf2onnx writes ``tf.where`` this way);
- ``s + m`` before a softmax, with m a mask input (PaddleRec's 0 / -1e9) and s bounded by its last layer's
  weights: the positions that get exactly zero weight for every input are the padding (``additive_mask``).
Scores computed flat ([B·T, ...]: FuxiCTR's Gemms over a view, tf2onnx's tensordot in DeepRec) end the region at the
reshape that makes them [B, T], or are scattered back flat when the mask is [B, 1, T]. From the scores it walks
back over the nodes that work position by position. Which axis is the batch and which
the history is measured, not guessed: the graph is run at two sizes (``runtime.probe``). The walk stops at the
region's entries: values of shape [B, T, ...] made outside it (history embeddings, the tiled query, the GRU's
outputs). The region is then rebuilt over the valid positions (flat, b·T + t, found by Compress): each entry read
as [B·T, ...] rows and gathered to [1, N, ...], the same ops, the scores scattered back into zeros of [B, T, ...].
The masking op writes what it wrote before at padded positions, so the outputs are unchanged exactly. Each region is
checked numerically before it is replaced.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from ...graph import topological_order
from ...graph.edit import Builder, const_value, unique_name
from ...runtime.inputs import analyze_inputs
from ...runtime.probe import Probe, try_probe
from ...runtime.subgraph import Subgraph
from .additive_mask import LAYOUT, additive_masks, valid_flags
from ..cleanup import tidy
from .padding_rows import insert_padding_masks, padding_candidates, undo
from .query_once import bias_after, layer_weights, replicated, weights_by_term
from .valid_pooling import pool_valid_positions, position_rows, zero_at_padding
from ..registry import PassContext, register_pass

LAYOUT_OPS = LAYOUT  # ops that move values without changing them
HEAVY_OPS = {"MatMul", "Gemm", "Conv", "MatMulInteger", "QLinearMatMul"}
OPAQUE_OPS = {"Loop", "Scan", "If"}  # their bodies are not read position by position


@dataclasses.dataclass
class Site:
    """One masking of per-position scores: `mask_op` reads `scores` (through layout ops) and `cond`."""

    mask_op: gs.Node
    scores: gs.Tensor  # S, [B, T] or [B, T, 1, ...]: where the position-wise region ends
    cond: gs.Tensor  # same shape as the masked value
    negate: bool  # valid positions are where cond is false (Where(padded, fill, s))
    chain: list[gs.Node]  # layout ops from S to the masked value
    flat: bool = False  # S is [B·T, ...] (set once the probe has measured it)
    shape_reads: bool = False  # the mask reads a shape off the scores (`_batch_read_elsewhere` fixes that)


# ----------------------------------------------------------------------------------------- finding sites


def _depends_on(t: gs.Tensor, targets: set[int], depth: int = 0, shapes: bool = False) -> bool:
    """Whether `t`'s values depend on any of `targets` (reading only a shape counts only with `shapes`)."""
    if id(t) in targets:
        return True
    if depth > 40 or not t.inputs:
        return False
    n = t.inputs[0]
    if (n.op == "Shape" or n.op == "Size") and not shapes:
        return False
    return any(_depends_on(u, targets, depth + 1, shapes) for u in n.inputs)


def _bool_mask(m: gs.Tensor, mask_inputs: set[str]) -> bool:
    """A mask input, or a Cast (of booleans: checked on the probe's values, `_site_sizes`)."""
    if m.name in mask_inputs:
        return True
    n = m.inputs[0] if m.inputs else None
    return n is not None and n.op == "Cast" and n.inputs[0].dtype in (np.bool_, None)


def _walk_to_scores(x: gs.Tensor, mask_op: gs.Node) -> tuple[gs.Tensor, list[gs.Node]] | None:
    """From the masked value back over layout ops whose values are read only by the next op (or by Shape)."""
    chain, t, reader = [], x, mask_op
    while True:
        others = [c for c in t.outputs if c is not reader and c.op not in ("Shape", "Size")]
        if others:
            return None
        n = t.inputs[0] if t.inputs else None
        if n is None:
            return None
        if n.op not in LAYOUT_OPS:
            return t, chain
        chain.insert(0, n)
        t, reader = n.inputs[0], n


def find_sites(graph: gs.Graph) -> list[Site]:
    mask_inputs = {name for name, f in analyze_inputs(graph).items() if f.is_mask}
    sites = []
    for n in graph.nodes:
        candidates = []
        if n.op == "Where" and len(n.inputs) == 3:
            c, a, b = n.inputs
            candidates = [(a, c, False, b), (b, c, True, a)]
        elif n.op == "Mul" and len(n.inputs) == 2:
            a, b = n.inputs
            candidates = [(x, m, False, None) for x, m in ((a, b), (b, a)) if _bool_mask(m, mask_inputs)]
        for x, cond, negate, fill in candidates:
            if const_value(x) is not None:
                continue
            found = _walk_to_scores(x, n)
            if found is None:
                continue
            scores, chain = found
            region_values = {id(scores)} | {id(c.outputs[0]) for c in chain}
            if fill is not None and _depends_on(fill, region_values):
                continue
            if _depends_on(cond, region_values):
                continue
            # even a shape read off the scores would be a cycle (the scatter reads the mask): fixed once probed
            reads_shape = _depends_on(cond, region_values, shapes=True)
            sites.append(Site(n, scores, cond, negate, chain, shape_reads=reads_shape))
    return sites


def _first_dim_only(shape: gs.Node) -> bool:
    """The Shape node's value is read only for its first dim (Gather of index 0, Slice [0:1], or start 0 end 1)."""
    if shape.attrs.get("start", 0) == 0 and shape.attrs.get("end") == 1:
        return True
    for c in shape.outputs[0].outputs:
        args = [const_value(u) for u in c.inputs[1:]]
        if c.op == "Gather" and c.attrs.get("axis", 0) == 0 and args[0] is not None and args[0].size == 1 and \
                int(args[0].ravel()[0]) == 0:
            continue
        if c.op == "Slice" and len(args) >= 2 and all(a is not None and a.size == 1 for a in args[:2]) and \
                (int(args[0].ravel()[0]), int(args[1].ravel()[0])) == (0, 1) and (len(args) < 3 or args[2] is None
                                                                             or args[2].ravel().tolist() == [0]):
            continue
        return False
    return True


def _batch_read_elsewhere(graph: gs.Graph, site: Site, probe: Probe) -> bool:
    """Shapes that the mask reads off the scores (RecBole: ``mask.repeat(scores.size(0), 1)``), only for the
    batch size, read it off a graph input with that first dim in every probe run instead; whether the mask is then
    free of the scores."""
    region_values = {id(site.scores)} | {id(c.outputs[0]) for c in site.chain}
    reads, stack, seen = [], [site.cond], set()
    while stack:
        t = stack.pop()
        n = t.inputs[0] if t.inputs else None
        if n is None or id(n) in seen:
            continue
        seen.add(id(n))
        if n.op == "Shape" and id(n.inputs[0]) in region_values:
            reads.append(n)
        else:
            stack.extend(u for u in n.inputs if u.name)
    batch = [probe.value(site.scores, run).shape[0] for run in range(len(probe.runs))]
    sources = [x for x in graph.inputs if all(
        probe.value(x, run) is not None and probe.value(x, run).ndim and probe.value(x, run).shape[0] == b
        for run, b in enumerate(batch))]
    if not sources or len(set(batch)) < 2 or not all(_first_dim_only(n) for n in reads):
        return False
    for n in reads:  # an input of the same rank if there is one: the Shape's value keeps its length
        rank = probe.value(n.inputs[0]).ndim
        n.inputs[0] = next((x for x in sources if probe.value(x).ndim == rank), sources[0])
        if probe.value(n.inputs[0]).ndim != rank:
            n.outputs[0].shape = None  # read only at 0, but its declared length is the old rank
    return not _depends_on(site.cond, region_values, shapes=True)


# ----------------------------------------------------------------------------------------- the region


@dataclasses.dataclass
class Region:
    nodes: list[gs.Node]  # in graph order
    entries: list[gs.Tensor]  # [B, T, ...] values made outside the region


class _Axes:
    """Which values carry the (batch, history) positions, by their shapes in both probe runs."""

    def __init__(self, probe: Probe, bt: list[tuple[int, int]]):
        self.probe, self.bt = probe, bt

    def positional(self, t: gs.Tensor) -> bool:
        shapes = self.probe.shapes(t)
        return shapes is not None and all(len(s) >= 2 and tuple(s[:2]) == bt for s, bt in zip(shapes, self.bt))

    def flat(self, t: gs.Tensor) -> bool:
        """[B·T, ...], or [1, B·T, ...] (tf2onnx's tensordot)."""
        shapes = self.probe.shapes(t)
        return shapes is not None and all(len(s) >= 1 and (s[0] == b * t or tuple(s[:2]) == (1, b * t))
                                          for s, (b, t) in zip(shapes, self.bt))


def _walk_region(scores: gs.Tensor, axes: _Axes, forced: set[int]) -> Region | None:
    """The nodes between the entries and `scores` that work position by position (memoized backward walk)."""
    state: dict[int, str] = {}  # id(tensor) -> "const" | "node" | "entry" | "fail"

    def visit(t: gs.Tensor) -> bool:
        key = id(t)
        if key in state:
            return state[key] != "fail"
        if const_value(t) is not None:
            state[key] = "const"
            return True
        n = t.inputs[0] if t.inputs else None
        movable = n is not None and key not in forced and n.op not in OPAQUE_OPS and n.domain in ("", "ai.onnx", None)
        kind = axes.positional(t) or axes.flat(t) or (axes.probe.shape_like(t) and not axes.positional(t))
        if movable and kind:
            state[key] = "node"  # provisional: a cycle cannot occur in a DAG
            if all(visit(u) for u in n.inputs if u.name):
                for o in n.outputs:
                    state.setdefault(id(o), "node")
                return True
        ok = axes.positional(t) and t is not scores
        state[key] = "entry" if ok else "fail"
        return ok

    if not visit(scores) or state[id(scores)] != "node":
        return None
    nodes, entries, seen = {}, {}, set()
    stack = [scores]
    while stack:  # what S needs, through included nodes only (a failed branch leaves strays behind)
        t = stack.pop()
        if id(t) in seen:
            continue
        seen.add(id(t))
        s = state.get(id(t))
        if s == "entry":
            entries[id(t)] = t
        elif s == "node":
            n = t.inputs[0]
            nodes[id(n)] = n
            stack.extend(u for u in n.inputs if u.name)
    return Region(list(nodes.values()), list(entries.values()))


def _light_shape(t: gs.Tensor, axes: _Axes, inside: set[int]) -> bool:
    """A shape-like value made in the region without a heavy op: outside readers keep the original nodes."""
    if not axes.probe.shape_like(t):
        return False
    stack, seen = [t], set()
    while stack:
        u = stack.pop()
        n = u.inputs[0] if u.inputs else None
        if n is None or id(n) not in inside or id(n) in seen:
            continue
        seen.add(id(n))
        if n.op in HEAVY_OPS:
            return False
        stack.extend(x for x in n.inputs if n.op not in ("Shape", "Size"))
    return True


def find_region(scores: gs.Tensor, axes: _Axes, graph_outputs: set[int]) -> Region | None:
    """The region, with every value it makes that something outside reads turned into an entry (a light shape
    computation is left to be computed twice)."""
    forced: set[int] = set()
    while True:
        region = _walk_region(scores, axes, forced)
        if region is None:
            return None
        inside = {id(n) for n in region.nodes}
        leaks = {id(t) for n in region.nodes for t in n.outputs if t is not scores and
                 (id(t) in graph_outputs or any(id(c) not in inside for c in t.outputs)) and
                 (id(t) in graph_outputs or not _light_shape(t, axes, inside))}
        if not leaks - forced:
            return region
        forced |= leaks


# ----------------------------------------------------------------------------------------- the rewrite


class _Builder(Builder):
    """New nodes collected in a list (added to the graph only once they are checked)."""

    def __init__(self, graph: gs.Graph, base: str):
        super().__init__(graph, base, nodes=[])
        self.leaves: list[gs.Tensor] = []  # values made outside that the nodes read, besides the region's entries
        self.per_row = self.split = 0  # entries read once per row; layers whose per-row part is projected once
        self.batch_rows: gs.Tensor | None = None  # [N]: the row of each valid position (made when first needed)
        self.scores_valid: gs.Tensor | None = None
        self.positions: gs.Tensor | None = None  # [N]: the valid positions, flat
        self.entry_rows: dict[int, gs.Tensor] = {}  # id(entry) → its [N, ...] rows at those positions

    def discard(self) -> None:
        """Unhook the nodes from the values they read (graphsurgeon lists a node among its inputs' readers)."""
        for n in self.nodes:
            n.inputs.clear()
            n.outputs.clear()
        self.nodes = []


def _graph_order(graph: gs.Graph, nodes: list[gs.Node]) -> list[gs.Node]:
    ids = {id(n) for n in nodes}
    return [n for n in graph.nodes if id(n) in ids]


def row_constant_entries(region: Region, probe: Probe) -> set[int]:
    """Entries made by repeating a value that are equal at every history position of a row on the probe's
    values (the query tiled over T)."""
    found = set()
    for e in region.entries:
        if not replicated(e):
            continue
        values = [probe.value(e, run) for run in range(len(probe.runs))]
        if all(v is not None and v.ndim >= 2 for v in values) and any(v.shape[1] > 1 for v in values) and \
                all(np.array_equal(v, np.broadcast_to(v[:, :1], v.shape)) for v in values):
            found.add(id(e))
    return found


def build_valid_region(graph: gs.Graph, site: Site, region: Region, tail: tuple | None,
                       per_row: set[int] = frozenset(), probe: Probe | None = None
                       ) -> tuple[_Builder, gs.Tensor, gs.Tensor]:
    """Nodes computing the scores at the valid positions (and (0, 0), last) and scattering them back; returns
    (builder, valid [B, T] tensor, scattered scores [B, T, ...]). Positions are flat (b·T + t, found by Compress:
    onnxruntime's NonZero and GatherND cost twice as much) and entries are read as [B·T, ...] rows. Entries in
    `per_row` (equal along T) are read once per row and gathered by row; an MLP layer over a concatenation that
    includes them then projects them once per row (`_project_rows_once`)."""
    b = _Builder(graph, f"{site.scores.name}/valid")
    cond = b.op("Not", [site.cond]) if site.negate else site.cond
    valid = b.op("Flatten", [cond], {"axis": 1}, name="valid")  # [B, T] (a Reshape [0, -1] fails at batch 0)
    count = b.op("Size", [valid], name="count")
    everywhere = b.op("Range", [b.const("start", np.array(0, np.int64)), count,
                                b.const("step", np.array(1, np.int64))], name="everywhere")
    made = cond.inputs[0] if cond.inputs else None
    bools = made.inputs[0] if made is not None and made.op == "Cast" and _is_bool(made.inputs[0], probe) else cond
    if bools is not cond:
        b.leaves.append(bools)
    flags = b.op("Reshape", [bools, b.const("flat", np.array([-1], np.int64))], name="flags")
    if not _is_bool(bools, probe):  # a float mask: its nonzero entries are the valid positions
        flags = b.op("Cast", [flags], {"to": onnx.TensorProto.BOOL}, name="nonzero")
    # The region may run on zero rows (an empty batch, histories of length 0, every position padded): onnxruntime's
    # Reshape to [-1, C] and the region's row-wise ops take them, and the scatter writes nothing
    idx = b.op("Compress", [everywhere, flags], {"axis": 0}, name="positions")  # [N]
    b.positions = idx
    swap, row_of = _gather_entries(b, region, idx, valid, per_row, probe)
    for n in _graph_order(graph, region.nodes):
        inputs = [swap.get(id(u), u) for u in n.inputs]
        outs = []
        for o in n.outputs:
            swap[id(o)] = gs.Variable(unique_name(graph, f"{o.name}/valid"), dtype=o.dtype)
            outs.append(swap[id(o)])
        b.nodes.append(gs.Node(n.op, unique_name(graph, f"{n.name}/valid"), dict(n.attrs), inputs, outs,
                               domain=n.domain))
    origin = {id(swap[id(t)]): t for t in region.entries + [o for n in region.nodes for o in n.outputs]}
    if row_of:
        _project_rows_once(b, row_of, b.batch_rows, origin, probe)
    zero_axis = b.const("axis0", np.array([0], np.int64))
    scores_valid = swap[id(site.scores)]
    if not site.flat and tail is not None:   # [1, N, ...] → [N, ...], also where a Reshape to [-1, N] in the region
        scores_valid = b.op("Reshape", [scores_valid, b.const("rows_scores", np.array([-1, *tail], np.int64))],
                            name="scores")   # made it [0, 1] from no rows (an empty batch, histories of length 0)
    elif not site.flat:
        scores_valid = b.op("Squeeze", [scores_valid, zero_axis], name="scores")  # [N, ...]
    b.scores_valid = scores_valid
    return b, valid, _scatter_back(b, site, scores_valid, idx, valid, count, tail)


BOOL_OPS = {"Not", "And", "Or", "Xor", "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "IsNaN", "IsInf"}


def _is_bool(t: gs.Tensor, probe: Probe | None) -> bool:
    value = probe.value(t) if probe is not None else None
    return t.dtype == np.bool_ or (value is not None and value.dtype == np.bool_) or \
        bool(t.inputs and t.inputs[0].op in BOOL_OPS)


def _gather_entries(b: _Builder, region: Region, idx: gs.Tensor, valid: gs.Tensor, per_row: set[int],
                    probe: Probe | None) -> tuple[dict, dict]:
    """Each entry at the positions `idx` as [1, N, ...] (a row of a per-row entry: position // T); returns the
    swap map (entry → that value) and, for per-row entries, their [B, ...] value."""
    swap, row_of = {}, {}
    for e in region.entries:
        once = None
        if id(e) in per_row:
            source = _before_broadcast(e, probe)
            if source is not e:
                b.leaves.append(source)
            once = b.op("Gather", [source, b.const("first", np.array(0, np.int64))], {"axis": 1}, name="per_row")
            rows = b.op("Gather", [once, position_rows(b, b, valid)], {"axis": 0}, name="gather_rows")
            b.per_row += 1
        else:
            rows = b.op("Gather", [b.op("Reshape", [e, _rows_shape(b, e, probe)], name="as_rows"), idx],
                        {"axis": 0}, name="gather")
            b.entry_rows[id(e)] = rows
        swap[id(e)] = b.op("Unsqueeze", [rows, b.const("axis0", np.array([0], np.int64))], name="rows")
        if once is not None:
            row_of[id(swap[id(e)])] = once  # the region's [1, N, ...] value → its [B, ...] value
    return swap, row_of


def _rows_shape(b: _Builder, e: gs.Tensor, probe: Probe | None) -> gs.Tensor:
    """[-1, dims after (B, T)...] of entry `e`: a constant when the probe saw the same dims at every size."""
    shapes = {tuple(s[2:]) for s in probe.shapes(e)} if probe is not None and probe.shapes(e) else set()
    if len(shapes) == 1:
        return b.const("rows_shape", np.array([-1, *shapes.pop()], np.int64))
    rest = b.op("Slice", [b.op("Shape", [e]), b.const("two", np.array([2], np.int64)),
                          b.const("end", np.array([np.iinfo(np.int64).max], np.int64))])
    return b.op("Concat", [b.const("rows", np.array([-1], np.int64)), rest], {"axis": 0})


def _scatter_back(b: _Builder, site: Site, scores_valid: gs.Tensor, idx: gs.Tensor, valid: gs.Tensor,
                  count: gs.Tensor, tail: tuple | None) -> gs.Tensor:
    """The valid scores [N, ...] written at their flat positions into zeros of [B·T, ...], viewed [B, T, ...]
    unless the scores were flat."""
    if tail is None:  # the scores' dims after (B, T), when they are not the same at every size
        tail = b.op("Slice", [b.op("Shape", [scores_valid]), b.const("one", np.array([1], np.int64)),
                              b.const("end", np.array([np.iinfo(np.int64).max], np.int64))])
    else:
        tail = b.const("tail", np.array(tail, np.int64))
    dtype = np.dtype(site.scores.dtype or np.float32)
    last = b.const("last", np.array([1], np.int64))
    at = b.op("Unsqueeze", [idx, last], name="at")  # [N, 1]
    if site.flat or b.opset >= 14:
        rows = b.op("Reshape", [count, b.const("one_dim", np.array([1], np.int64))])
    else:   # opset 13 has no allowzero (a Reshape to [B, 0, ...] reads the 0 as "copy"): write at (b, t) instead
        rows, at = b.op("Shape", [valid]), _row_and_step(b, idx, valid, at)
    zeros = b.op("ConstantOfShape", [b.op("Concat", [rows, tail], {"axis": 0})],
                 {"value": gs.Constant("zero", np.zeros(1, dtype))})
    scattered = b.op("ScatterND", [zeros, at, scores_valid], name="scatter")  # [B·T, ...] or [B, T, ...]
    if not site.flat and b.opset >= 14:  # back to [B, T, ...]; allowzero: histories of length 0 are [B, 0, ...]
        scattered = b.op("Reshape", [scattered, b.op("Concat", [b.op("Shape", [valid]), tail], {"axis": 0})],
                         {"allowzero": 1}, name="positional")
    scattered.dtype = site.scores.dtype
    return scattered


def _row_and_step(b: _Builder, idx: gs.Tensor, valid: gs.Tensor, at: gs.Tensor) -> gs.Tensor:
    """[N, 2]: (position // T, position % T) of the flat positions idx ([N]; at: [N, 1]) in valid [B, T]."""
    rows = position_rows(b, b, valid)
    steps = b.op("Max", [b.op("Gather", [b.op("Shape", [valid]), b.const("history_axis", np.array(1, np.int64))],
                              {"axis": 0}), b.const("one", np.array(1, np.int64))])
    last = b.const("last", np.array([1], np.int64))
    row = b.op("Unsqueeze", [rows, last])
    step = b.op("Sub", [at, b.op("Mul", [row, steps])])
    return b.op("Concat", [row, step], {"axis": 1}, name="at")


def _before_broadcast(e: gs.Tensor, probe: Probe) -> gs.Tensor:
    """The [B, 1, ...] value an Expand/Tile (or tf2onnx's Concat of T copies) broadcast over T to make `e`, else
    `e` itself."""
    n = e.inputs[0] if e.inputs else None
    copies = n is not None and n.op == "Concat" and n.attrs.get("axis") in (1, -len(probe.value(e).shape) + 1) \
        and all(u is n.inputs[0] for u in n.inputs)
    if n is None or (n.op not in ("Expand", "Tile") and not copies):
        return e
    shapes, x_shapes = probe.shapes(e), probe.shapes(n.inputs[0])
    if shapes is None or x_shapes is None or any(
            len(xs) != len(s) or xs[0] != s[0] or xs[1] != 1 or xs[2:] != s[2:] for s, xs in zip(shapes, x_shapes)):
        return e
    return n.inputs[0]



def _project_rows_once(b: _Builder, row_of: dict[int, gs.Tensor], batch_rows: gs.Tensor, origin: dict,
                       probe: Probe) -> None:
    """``concat[q, k, q - k, q * k] · W`` with q gathered by row → ``Gather(q₀ · (W_q + W_d), row) +
    concat[k, q * k] · [W_k - W_d; W_p]``: the query's part of the layer is computed once per row (DIN's
    attention MLP, first layer) and the concatenation shrinks. The builder's region is checked numerically after."""
    for cat in [n for n in b.nodes if n.op == "Concat"]:
        out = cat.outputs[0]
        widths = [probe.value(origin[id(u)]).shape[-1] if id(u) in origin else None for u in cat.inputs]
        rank = probe.value(origin[id(out)]).ndim if id(out) in origin else None
        if None in widths or cat.attrs.get("axis") not in (-1, (rank or 0) - 1):
            continue
        readers = [c for c in out.outputs if c.op != "Shape"]
        layout = _flattening(readers[0]) if len(readers) == 1 else []
        last = layout[-1] if layout else cat
        matmul = last.outputs[0].outputs[0] if len(last.outputs[0].outputs) == 1 else None
        w, gemm_bias = layer_weights(matmul)
        if w is None or w.ndim != 2 or w.shape[0] != sum(widths) or matmul.inputs[0] is not last.outputs[0]:
            continue
        terms = weights_by_term(cat.inputs, widths, w)
        once = [t for k, t in terms.items() if k in row_of] if terms else []
        rest = [t for k, t in terms.items() if k not in row_of] if terms else []
        if once and rest:
            _split_layer(b, cat, layout, matmul, once, rest, row_of, batch_rows, w.dtype, gemm_bias)
            b.split += 1




def _flattening(node: gs.Node) -> list[gs.Node]:
    """[Reshape] or [Reshape, Squeeze] (tf2onnx's tensordot: [1, N, K] squeezed) from a concatenation to its FC."""
    if node.op != "Reshape":
        return []
    readers = node.outputs[0].outputs
    return [node, readers[0]] if len(readers) == 1 and readers[0].op == "Squeeze" else [node]


def _split_layer(b, cat, layout, matmul, once, rest, row_of, batch_rows, dtype, gemm_bias=None) -> None:
    """Build the split layer (see `_project_rows_once`) in place of `cat` → [layout] → `matmul` (→ bias Add;
    a Gemm's own bias)."""
    width = once[0][1].shape[1]
    bias_add, bias = None, (np.zeros(width) if gemm_bias is None else np.broadcast_to(gemm_bias.ravel(), (width,)))
    if gemm_bias is None:  # the layer's bias, folded into the per-row part
        bias_add, found = bias_after(matmul, width)
        bias = bias if found is None else found
    projected = None
    for value, rows_w in once:
        p = b.op("MatMul", [row_of[id(value)], b.const("w_once", rows_w.astype(dtype))], name="project_once")
        projected = p if projected is None else b.op("Add", [projected, p])
    projected = b.op("Add", [projected, b.const("bias_once", bias.reshape(-1).astype(dtype))])
    per_position = b.op("Gather", [projected, batch_rows], {"axis": 0}, name="gather_projected")  # [N, H]
    merged = b.op("Concat", [value for value, _ in rest], {"axis": -1}, name="concat_rest")
    flat = b.op("Reshape", [merged, b.const("flat", np.array([-1, sum(r.shape[0] for _, r in rest)], np.int64))])
    w_rest = b.const("w_rest", np.concatenate([r for _, r in rest]).astype(dtype))
    layer = b.op("Gemm", [flat, w_rest, per_position], name="layer")  # [N, H]
    end = matmul.outputs[0]
    if bias_add is not None:  # its readers read the layer (bias included) instead
        for c in list(bias_add.outputs[0].outputs):
            c.inputs[c.inputs.index(bias_add.outputs[0])] = end
    if not layout:  # the layer was a MatMul over [1, N, K]
        layer = b.op("Unsqueeze", [layer, b.const("axis0", np.array([0], np.int64))])
    for shape_reader in [c for c in cat.outputs[0].outputs if c.op == "Shape"]:
        shape_reader.inputs[0] = rest[0][0]  # leading dims only (the region check catches any other use)
    layer.inputs[0].outputs[0] = end  # the last new node writes the layer's value: its readers stay as they are
    dead = {id(cat), id(matmul)} | {id(n) for n in layout} | \
        ({id(bias_add)} if bias_add is not None else set())
    b.nodes[:] = topological_order([n for n in b.nodes if id(n) not in dead])
    for n in (cat, matmul, *layout, bias_add):
        if n is not None:
            n.inputs.clear()
            n.outputs.clear()


def check_region(site: Site, region: Region, built: _Builder, valid: gs.Tensor, probe: Probe, opset: int) -> str:
    """Run the original region and the rebuilt one on the probe's values; '' if the valid scores agree."""
    leaves = region.entries + built.leaves + [site.cond]
    leaf_dtypes = [probe.value(t).dtype for t in leaves]
    try:
        scores_dtype = probe.value(site.scores).dtype
        old = Subgraph([site.scores], leaves, opset, nodes=region.nodes, dtypes=[scores_dtype])
        new = Subgraph([built.scores_valid, valid], leaves, opset, nodes=built.nodes,
                       dtypes=[scores_dtype, leaf_dtypes[-1]])
        old.prepare(leaf_dtypes)
        new.prepare(leaf_dtypes)
    except Exception as e:  # an op that cannot be copied out (e.g. reads a value from an outer scope)
        return f"cannot run the region on its own: {str(e).splitlines()[0][:160]}"
    for run in range(len(probe.runs)):
        values = [probe.value(t, run) for t in leaves]
        try:
            (full,) = old.run(values)
            got, mask = new.run(values)
        except Exception as e:
            return f"the rebuilt region does not run: {str(e).splitlines()[0][:160]}"
        mask = mask != 0
        want = full.reshape(mask.shape + full.shape[1 if site.flat else 2:])[mask]
        if want.shape != got.shape or not np.allclose(want, got, rtol=1e-5, atol=1e-6):
            return "the region does not work position by position (scores differ when run on valid positions only)"
    return ""


def _positional_scores(site: Site, probe: Probe) -> Site:
    """The site with its scores moved along the layout chain to the first value shaped [B, T, ...] like the mask,
    when the scores are computed flat ([B·T, ...], then reshaped: torch's Linear over a [B·T, C] view)."""
    values = [site.scores] + [n.outputs[0] for n in site.chain]
    for k, t in enumerate(values):
        ok = True
        for run in range(len(probe.runs)):
            cond, value = probe.value(site.cond, run), probe.value(t, run)
            if cond is None or value is None or cond.ndim < 2 or not cond.shape[0] or \
                    tuple(value.shape[:2]) != (cond.shape[0], cond.size // cond.shape[0]):
                ok = False
                break
        if ok:
            return dataclasses.replace(site, scores=t, chain=site.chain[k:])
    return site


def _site_sizes(site: Site, probe: Probe) -> list[tuple[int, int]] | None:
    """(B, T) of each probe run, read off the mask; None when the mask is not [B, ...T...] like the scores."""
    sizes = []
    for run in range(len(probe.runs)):
        cond, scores = probe.value(site.cond, run), probe.value(site.scores, run)
        x = site.chain[-1].outputs[0] if site.chain else site.scores
        x_value = probe.value(x, run)
        if cond is None or scores is None or x_value is None or cond.shape != x_value.shape or cond.ndim < 2:
            return None
        cast = site.cond.inputs[0] if site.cond.inputs and site.cond.inputs[0].op == "Cast" else None
        source = probe.value(cast.inputs[0], run) if cast is not None and site.mask_op.op == "Mul" else cond
        if source is None or source.dtype not in (np.bool_, np.float32, np.float64):
            return None
        batch = cond.shape[0]
        if batch == 0 or cond.size % batch or scores.ndim < 2 or scores.size != cond.size:
            return None
        steps = cond.size // batch
        if tuple(scores.shape[:2]) != (batch, steps) and not (site.flat and scores.shape[0] == batch * steps):
            return None
        sizes.append((batch, steps))
    return sizes


def _flat_scores(site: Site, probe: Probe) -> Site:
    """The site marked flat when its scores are [B·T, ...] and no value of its chain is [B, T, ...] (DeepRec's
    attention: the MLP over [B·T, C] rows, the scores reshaped to [B, 1, T] for a mask of that shape)."""
    cond, scores = probe.value(site.cond), probe.value(site.scores)
    if cond is None or scores is None or cond.ndim < 2 or not cond.shape[0] or scores.ndim < 1:
        return site
    batch, steps = cond.shape[0], cond.size // cond.shape[0]
    positional = scores.ndim >= 2 and tuple(scores.shape[:2]) == (batch, steps)
    return dataclasses.replace(site, flat=not positional and scores.shape[0] == batch * steps)


def _additive_sites(graph: gs.Graph) -> list[tuple[Site, gs.Node]]:
    """Additive masks before a softmax over bounded scores (`additive_mask`), as sites: the valid flags are the
    condition; the Add then writes 0 + m at the positions that get no weight."""
    sites = []
    for add, x, mask, bound, scale, shift, softmax in additive_masks(graph, _depends_on):
        found = _walk_to_scores(x, add)
        if found is not None:
            valid = valid_flags(graph, mask, bound, scale, shift)
            sites.append((Site(add, found[0], valid, False, found[1]), softmax))
    return sites


def _softmax_over_history(site: Site, softmax: gs.Node, probe: Probe) -> bool:
    """The softmax normalizes over one row's positions, the mask's row: its axis holds all of the row's T."""
    for run in range(len(probe.runs)):
        x, mask = probe.value(softmax.inputs[0], run), probe.value(site.cond, run)
        if x is None or mask is None or not mask.shape[0]:
            return False
        axis = softmax.attrs.get("axis", -1) % x.ndim
        steps = mask.size // mask.shape[0]
        if x.shape[0] != mask.shape[0] or x.shape[axis] != steps or x.size != mask.size or axis == 0:
            return False
    return True


def _order_kept(chain: list[gs.Node], probe: Probe) -> bool:
    """The layout ops keep the positions in row-major (batch, history) order: transposes move unit axes only."""
    for n in chain:
        if n.op != "Transpose":
            continue
        shape = probe.value(n.inputs[0]).shape
        perm = n.attrs.get("perm", list(range(len(shape)))[::-1])
        moved = [p for p in perm if shape[p] != 1]
        if moved != sorted(moved):
            return False
    return True


@register_pass("remove-attention-padding", group="fusion")
def remove_attention_padding(ctx: PassContext) -> None:
    """Attention MLPs over padded histories ([B, T, ...]) → the same MLP over the N valid positions only."""
    graph = ctx.graph
    sites, candidates = find_sites(graph), padding_candidates(graph)
    additive = _additive_sites(graph)
    if not sites and not candidates and not additive:
        return
    probe, why = try_probe(graph)
    if probe is None:
        ctx.note(why)
        graph.cleanup()  # the valid flags made for additive masks
        return
    masked = {id(s.mask_op.outputs[0]) for s in sites}
    inserted = insert_padding_masks(graph, probe, candidates, lambda w: _depends_on(w, masked))
    if inserted:  # the new masks' values are needed too
        sites = find_sites(graph)
        probe, why = try_probe(graph)
        if probe is None:
            undo(inserted)
            graph.cleanup()
            ctx.note(why)
            return
    sites += [site for site, softmax in additive if _softmax_over_history(site, softmax, probe)]
    opset = int(getattr(graph, "opset", None) or 0)
    graph_outputs = {id(t) for t in graph.outputs}
    done: set[int] = set()
    applied: set[int] = set()  # the mask ops whose region was rebuilt
    for site in sites:
        if id(site.scores) in done:
            continue
        where = f"{site.mask_op.op} {site.mask_op.name}"
        site = _flat_scores(_positional_scores(site, probe), probe)
        sizes = _site_sizes(site, probe)
        if sizes is None:
            continue  # not a mask over per-position scores
        if site.shape_reads and not _batch_read_elsewhere(graph, site, probe):
            ctx.note(f"left as is: {where}: the mask reads the scores' shape")
            continue
        if not _order_kept(site.chain, probe):
            ctx.note(f"left as is: {where}: the scores reach the mask transposed")
            continue
        region = find_region(site.scores, _Axes(probe, sizes), graph_outputs)
        if region is None or not any(n.op in HEAVY_OPS for n in region.nodes):
            ctx.note(f"left as is: {where}: no position-wise MLP computes the masked scores")
            continue
        tails = {tuple(shape[1 if site.flat else 2:]) for shape in probe.shapes(site.scores)}
        tail = tails.pop() if len(tails) == 1 else None
        built, valid, scattered = build_valid_region(graph, site, region, tail, row_constant_entries(region, probe),
                                                     probe)
        problem = check_region(site, region, built, valid, probe, opset)
        if problem and (built.per_row or built.split):  # without the per-row reads and projections
            built.discard()
            built, valid, scattered = build_valid_region(graph, site, region, tail, probe=probe)
            problem = check_region(site, region, built, valid, probe, opset)
        ctx.matches += 1
        if problem:
            built.discard()
            ctx.note(f"left as is: {where}: {problem}")
            continue
        graph.nodes.extend(built.nodes)
        inside = {id(n) for n in region.nodes}
        for consumer in list(site.scores.outputs):
            if id(consumer) not in inside:
                consumer.inputs[consumer.inputs.index(site.scores)] = scattered
        done.add(id(site.scores))
        applied.add(id(site.mask_op))
        ctx.rewrites += 1
        pooled = pool_valid_positions(graph, site.mask_op.outputs[0], built, valid, sizes, probe) if opset >= 16 and not site.flat and tail in ((), (1,)) and \
            zero_at_padding(site.mask_op, site.cond, site.negate) else 0
        ops = sum(n.op in HEAVY_OPS for n in region.nodes)
        once = f"; {built.per_row} read once per row" if built.per_row else ""
        once += f", its part of {built.split} layer(s) projected once per row" if built.split else ""
        once += f"; {pooled} pooling(s) of the weights over the valid positions only" if pooled else ""
        ctx.note(f"{where}: {len(region.nodes)} ops ({ops} matmuls) over [B, T, ...] now run on the valid positions "
                 f"({len(region.entries)} entries gathered{once})")
    unused = [i for i in inserted if id(i[2]) not in applied]  # masks made explicit that no region took
    undo(unused)
    for _, _, mul in inserted:
        if id(mul) in applied:
            ctx.note(f"{mul.name}: the pooled lookup's zero row is padding, masked explicitly")
    if ctx.rewrites or unused or additive:
        graph.cleanup()
    if ctx.rewrites:
        tidy(ctx)
