"""A GRU over inputs scaled by one attention weight per step → the AIGRU layer that reads the weights.

PaddleRec's DIEN multiplies the history [B, T, I] by the softmax weights [B, T, 1] and runs a plain GRU over the
product. ``(a·x)·W = a·(x·W)``: the AIGRU kind (a GRU over a·x) takes x and the weights as its `att` input and
scales the projected rows inside the layer, so the [B, T, I] product is never written (onnxruntime broadcasts
the per-step weight a row at a time). The weights' shape is read on the probe.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_graphsurgeon as gs

from ...graph.edit import Builder
from ...ops.rnn import SequenceAttrs, is_sequence_node, replace_sequence_node
from ...runtime.probe import Probe, try_probe


def _weights(mul: gs.Node, probe: Probe) -> tuple[gs.Tensor, gs.Tensor] | None:
    """(x [B, T, I], a [B, T, 1]) of ``Mul(x, a)`` on every probe run; else None."""
    for x, a in ((mul.inputs[0], mul.inputs[1]), (mul.inputs[1], mul.inputs[0])):
        shapes = [(probe.value(x, run), probe.value(a, run)) for run in range(len(probe.runs))]
        if all(xv is not None and av is not None and xv.ndim == 3 and av.shape == xv.shape[:2] + (1,) and
               xv.dtype == av.dtype for xv, av in shapes):
            return x, a
    return None


def attention_from_scaled_inputs(graph: gs.Graph) -> list[str]:
    """Each GRU layer (no attention yet) whose input X only a Mul by per-step weights makes → AIGRU over the
    unscaled input with those weights as `att`. Returns notes."""
    candidates = []
    for node in graph.nodes:
        if not is_sequence_node(node) or SequenceAttrs.of(node).kind != "GRU":
            continue
        x = node.inputs[0]
        made = x.inputs[0] if x.inputs else None
        if made is not None and made.op == "Mul" and len(made.inputs) == 2 and len(x.outputs) == 1 and \
                x not in graph.outputs:
            candidates.append((node, made))
    if not candidates:
        return []
    probe, why = try_probe(graph)
    if probe is None:
        return [f"left as is: inputs scaled before the layer ({why})"]
    notes = []
    for node, mul in candidates:
        found = _weights(mul, probe)
        if found is None:
            continue
        x, a = found
        b = Builder(graph, node.name, a.dtype)
        att = b.op("Flatten", [a], {"axis": 1}, name="att")  # [B, T] (a Reshape [0, -1] fails at batch 0)
        attrs = SequenceAttrs.of(node)
        attrs = dataclasses.replace(attrs, kind="AIGRU", att_keep=0)  # lengths_checked kept
        replace_sequence_node(graph, node, attrs, {"X": x, "att": att})
        notes.append(f"{node.name}: a GRU over its inputs times per-step weights ({mul.name}) → AIGRU reading "
                     "the weights")
    if notes:
        graph.cleanup()
    return notes
