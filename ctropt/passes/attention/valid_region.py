"""The region rebuilt over the valid positions only: its entries gathered to [1, N, ...] rows (per-row values read
once per row, a layer's per-row part projected once), the same ops, the scores scattered back; and the numeric
check of the rebuilt region before it replaces the old one."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from ...graph.edit import Builder, unique_name
from ...runtime.probe import Probe
from ...runtime.subgraph import Subgraph
from ...graph import topological_order
from .mask_sites import Site
from .query_once import bias_after, layer_weights, replicated, weights_by_term
from .score_region import Region
from .valid_pooling import position_rows


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
