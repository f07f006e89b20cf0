"""Additive masks before a softmax, for `remove-attention-padding`: which positions get exactly zero weight.

PaddleRec's readers feed DIN/DIEN a float mask input (0 at valid positions, -1e9 at padded ones) that is added to
the attention scores before a softmax: ``softmax(a·(s + m) + c)``. A position p gets exactly zero weight when
``a·((s_p + m_p) - (s_v + m_v)) < -110`` for some v of its row (exp underflows to 0 in float32). When the scores
are bounded, |s| ≤ S (the last layer of the scoring MLP reads a Sigmoid or Tanh, so S = |b| + Σ|W|·max|h|, read off
its weights), that holds whenever ``m_p < max_row(m) - C`` with ``C = 2S + 110/a`` (plus room for float32
rounding, `valid_flags`): those positions are padding for every input, whatever the mask's values. The valid flags
``m ≥ max_row(m) - C`` become the site's condition; the rebuilt region writes 0 as the score there, and 0 + m_p is
below the bound too. A row of padding only (every m equal) keeps all its positions. (As for every padding removal,
a NaN or infinity in the features of a position that gets no weight no longer reaches the output.)
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from ...graph import annotate_shapes
from ...graph.edit import Builder, const_value
from .query_once import layer_weights

LAYOUT = {"Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Transpose"}  # ops that move values unchanged
RANGES = {"Sigmoid": (0.0, 1.0), "Tanh": (-1.0, 1.0)}
UNDERFLOW = 110.0  # exp(-110) is 0 in float32 (the smallest subnormal is about exp(-103.3))


def _through_layout(t: gs.Tensor) -> gs.Tensor:
    """Back over layout ops to the value they move."""
    for _ in range(8):
        n = t.inputs[0] if t.inputs else None
        if n is None or n.op not in LAYOUT:
            return t
        t = n.inputs[0]
    return t


def _linear(t: gs.Tensor) -> tuple[gs.Tensor, np.ndarray, np.ndarray] | None:
    """(h, W [K, N], b) when `t` is ``h·W + b`` (MatMul or a plain Gemm by constants, `query_once.layer_weights`,
    then an Add of a constant bias or not), else None."""
    n = t.inputs[0] if t.inputs else None
    bias = np.zeros(1)
    if n is not None and n.op == "Add":
        consts = [const_value(u) for u in n.inputs]
        if sum(c is not None for c in consts) != 1:
            return None
        k = 0 if consts[0] is not None else 1
        bias, n = consts[k], n.inputs[1 - k].inputs[0] if n.inputs[1 - k].inputs else None
    w, b = layer_weights(n)
    if w is None or w.ndim != 2:
        return None  # a Gemm whose bias is computed is not bounded: layer_weights refuses it
    return n.inputs[0], w, bias + (0 if b is None else b)


def score_bound(scores: gs.Tensor) -> float | None:
    """max |s| over every input, when the scores are a linear layer of a bounded activation; else None."""
    found = _linear(_through_layout(scores))
    if found is None:
        return None
    h, w, b = found
    made = _through_layout(h).inputs[0] if _through_layout(h).inputs else None
    if made is None or made.op not in RANGES:
        return None
    lo, hi = RANGES[made.op]
    per_column = np.abs(np.asarray(b, np.float64)).max(initial=0.0) + \
        np.maximum(np.abs(w * lo), np.abs(w * hi)).astype(np.float64).sum(axis=0)
    return float(np.max(per_column))


def softmax_scale(graph: gs.Graph, added: gs.Tensor) -> tuple[float, float, gs.Node] | None:
    """(a > 0, the constants added on the way in units of the masked value, the Softmax) when the masked value
    reaches a Softmax only through layout ops, scalings by a positive constant and additions of a scalar constant,
    each value read by the next op alone; else None."""
    scale, shift, t = 1.0, 0.0, added
    for _ in range(8):
        readers = [c for c in t.outputs if c.op not in ("Shape", "Size")]
        if len(readers) != 1 or any(o is t for o in graph.outputs):
            return None
        n = readers[0]
        if n.op == "Softmax":
            return scale, shift, n
        other = [const_value(u) for u in n.inputs if u is not t]
        if n.op in LAYOUT and n.inputs[0] is t:
            pass
        elif n.op in ("Mul", "Div") and len(other) == 1 and other[0] is not None and other[0].size == 1 and \
                (n.op == "Mul" or n.inputs[0] is t):
            c = float(np.asarray(other[0]).ravel()[0])
            c = c if n.op == "Mul" else (1.0 / c if c else 0.0)
            if not c > 0:
                return None
            scale *= c
        elif n.op == "Add" and len(other) == 1 and other[0] is not None and other[0].size == 1:
            shift += abs(float(np.asarray(other[0]).ravel()[0])) / scale  # its rounding is relative to it
        else:
            return None
        t = n.outputs[0]
    return None


def valid_flags(graph: gs.Graph, mask: gs.Tensor, bound: float, scale: float, shift: float) -> gs.Tensor:
    """``m ≥ max over the row (all axes but the first) of m - C``: the positions that may get weight. C has room for
    float32 rounding: relative 1e-4 on the scores' bound (a sum of K products), 1e-5 on the row's largest mask value
    and on the constants added before the softmax."""
    b = Builder(graph, f"{mask.name}/reachable")
    rows = b.op("Flatten", [mask], {"axis": 1}, name="rows")  # [B, T] (a Reshape [0, -1] fails at batch 0)
    if (getattr(graph, "opset", None) or 13) < 18:
        row_max = b.op("ReduceMax", [rows], {"axes": [1], "keepdims": 1}, name="row_max")
    else:
        row_max = b.op("ReduceMax", [rows, b.const("axes", np.array([1], np.int64))], {"keepdims": 1}, name="row_max")
    margin = np.array(2 * bound * (1 + 1e-4) + UNDERFLOW / scale + 1e-5 * shift, np.float32)
    slack = b.op("Mul", [b.op("Abs", [row_max]), b.const("relative", np.array(1e-5, np.float32))])
    floor = b.op("Sub", [b.op("Sub", [row_max, b.const("margin", margin)]), slack], name="floor")
    valid = b.op("GreaterOrEqual", [rows, floor], name="valid_rows")
    return b.op("Reshape", [valid, b.op("Shape", [mask])], name="valid")


def additive_masks(graph: gs.Graph, depends_on) -> list[tuple]:
    """(the Add, the scores it reads, the mask, the scores' bound S, the scale a, the constants added after it, the
    Softmax) for each additive mask whose scores are bounded and whose result only goes on to a softmax.
    `depends_on(t, values)`: whether t depends on values."""
    found = []
    adds = [n for n in graph.nodes if n.op == "Add" and len(n.inputs) == 2 and
            all(const_value(u) is None for u in n.inputs)]
    if any(u.dtype is None for n in adds for u in n.inputs) and any(n.op == "Softmax" for n in graph.nodes):
        annotate_shapes(graph)  # the mask's dtype decides (the underflow bound is float32's)
    for n in adds:
        for x, m in ((n.inputs[0], n.inputs[1]), (n.inputs[1], n.inputs[0])):
            if m.dtype != np.float32 or x.dtype != np.float32 or (m.shape is not None and len(m.shape) < 2):
                continue  # the underflow bound is float32's
            bound = score_bound(x)
            after = softmax_scale(graph, n.outputs[0]) if bound is not None else None
            if after is None or depends_on(m, {id(x)}):
                continue
            found.append((n, x, m, bound, *after))
            break
    return found
