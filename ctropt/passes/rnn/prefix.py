"""A GRU run over whole padded histories whose outputs are then zeroed past each row's length → the same layer
told the lengths, so it stops at each row's last valid step.

deepctr-torch's DIEN with plain GRUs runs ``nn.GRU`` over [B, T, E] without packing, then multiplies its outputs
by ``arange(T) < length``. A recurrence reads only earlier steps, so the outputs at valid steps do not depend on
the padded ones, and those are zeroed anyway: with ``sequence_lens`` (padded outputs zero) the layer gives the
same product and skips the padded steps (the GRUScan kernel runs each row only up to its length). The mask must
be a prefix of every row, which its form proves: positions that do not decrease along T (a constant or a Range
with a positive step) compared with a per-row bound (``p < n``, ``p <= n``, ``n > p``, ``n >= p``).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from ...graph.edit import Builder, const_value
from ...ops.rnn import INPUTS, OUTPUTS, SequenceAttrs, is_sequence_node, replace_sequence_node
from ...runtime.probe import Probe, try_probe

PASS_THROUGH = {"Cast", "Unsqueeze", "Reshape", "Identity", "Squeeze"}
COMPARE = {"Less": (0, 1), "LessOrEqual": (0, 1), "Greater": (1, 0), "GreaterOrEqual": (1, 0)}  # (p, n) inputs


def _comparison(m: gs.Tensor) -> gs.Node | None:
    """The comparison that `m` is a float (0/1) view of, through casts and reshapes."""
    t = m
    for _ in range(6):
        n = t.inputs[0] if t.inputs else None
        if n is None:
            return None
        if n.op in COMPARE:
            return n
        if n.op not in PASS_THROUGH:
            return None
        t = n.inputs[0]
    return None


def _non_decreasing(p: gs.Tensor) -> bool:
    """`p` is [T] or [1, T] of positions that never decrease along T: a constant, or a Range with a constant
    positive step (through casts and reshapes)."""
    v = const_value(p)
    if v is not None:
        return v.ndim in (1, 2) and (v.ndim == 1 or v.shape[0] == 1) and bool(np.all(np.diff(v.ravel()) >= 0))
    n = p.inputs[0] if p.inputs else None
    if n is not None and n.op in ("Cast", "Unsqueeze", "Reshape", "Identity"):
        return _non_decreasing(n.inputs[0])
    delta = const_value(n.inputs[2]) if n is not None and n.op == "Range" else None
    return delta is not None and delta.size == 1 and float(delta.ravel()[0]) > 0


def _prefix_mask(mul: gs.Node, y: gs.Tensor, probe: Probe) -> gs.Node | None:
    """The comparison whose 0/1 view `mul` multiplies `y` [B, T, H] by, when it is a prefix of every row."""
    m = next((u for u in mul.inputs if u is not y), None)
    c = _comparison(m) if m is not None and len(mul.inputs) == 2 else None
    if c is None or not _non_decreasing(c.inputs[COMPARE[c.op][0]]):
        return None
    for run in range(len(probe.runs)):
        yv, mv, cv = probe.value(y, run), probe.value(m, run), probe.value(c.outputs[0], run)
        nv = probe.value(c.inputs[COMPARE[c.op][1]], run)
        if yv is None or mv is None or cv is None or nv is None or yv.ndim != 3 or \
                mv.shape != yv.shape[:2] + (1,) or cv.shape != yv.shape[:2] or nv.shape != (yv.shape[0], 1):
            return None
        if not np.array_equal(mv[..., 0], cv.astype(mv.dtype)):  # the 0/1 view of the comparison
            return None
    return c


def _with_lengths(graph: gs.Graph, node: gs.Node, compare: gs.Node) -> gs.Node:
    """`node` rebuilt with sequence_lens = the count of valid steps per row, padded outputs zero."""
    b = Builder(graph, node.name, np.int64)
    valid = b.op("Cast", [compare.outputs[0]], {"to": onnx.TensorProto.INT64}, name="valid")
    lens = b.axes_op("ReduceSum", valid, [1], {"keepdims": 0}, name="lengths")
    attrs = SequenceAttrs.of(node)
    attrs = SequenceAttrs(attrs.kind, attrs.hidden_size, attrs.linear_before_reset, attrs.att_keep, "zero")
    return replace_sequence_node(graph, node, attrs, {"sequence_lens": lens})


def lengths_from_output_masks(graph: gs.Graph) -> list[str]:
    """Each sequence layer without lengths or mask whose outputs Y only a prefix mask multiplies, and whose last
    state nothing reads, → the layer with sequence_lens; the multiply goes. Returns notes."""
    candidates = []
    for node in graph.nodes:
        if not is_sequence_node(node):
            continue
        named = {k: t for k, t in zip(INPUTS, node.inputs) if t.name}
        outs = dict(zip(OUTPUTS, node.outputs))
        y, y_h = outs.get("Y"), outs.get("Y_h")
        if "sequence_lens" in named or "mask" in named or y is None or not y.name or \
                (y_h is not None and y_h.outputs) or y in graph.outputs or y_h in graph.outputs:
            continue
        readers = list(y.outputs)
        if len(readers) == 1 and readers[0].op == "Mul" and _comparison(
                next((u for u in readers[0].inputs if u is not y), y)) is not None:
            candidates.append((node, readers[0]))
    if not candidates:
        return []
    probe, why = try_probe(graph)
    if probe is None:
        return [f"left as is: outputs masked after the layer ({why})"]
    notes = []
    for node, mul in candidates:
        y, product = node.outputs[OUTPUTS.index("Y")], mul.outputs[0]
        compare = _prefix_mask(mul, y, probe)
        if compare is None:
            continue
        mul.inputs.clear()
        mul.outputs.clear()
        graph.nodes.remove(mul)
        fused = _with_lengths(graph, node, compare)
        fused.outputs[OUTPUTS.index("Y")] = product  # the layer writes what the multiply wrote
        notes.append(f"{fused.name}: its outputs were zeroed past each row's length ({compare.op} "
                     f"{compare.name}): given sequence_lens instead, padded steps skipped")
    return notes
