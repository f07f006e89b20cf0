"""Histories masked only by a zero embedding row: the mask made explicit, for `remove-attention-padding`.

Some DIN exports never mask the attention (torch-rechub: ``nn.Embedding(padding_idx=0)``, no mask, no softmax):
the pooled interest ``Σ_t w_t · E_t`` simply gets nothing from padded positions because their embedding row is
zero, so the MLP scores them for nothing. Where the pooled values are a lookup ``E = table[ids]`` (through data
movement: a feature picked from stacked lookups, reshapes) whose table has an all-zero row p, ``w · E`` equals
``(w · (ids != p)) · E`` for finite w, exactly. Inserting that product gives `remove-attention-padding` a mask to
start from. Which value is the lookup of which ids is read structurally and confirmed on the probe's values.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from ...graph.edit import Builder, axes_of, const_value, stacked_part
from ...runtime.probe import Probe

MOVES = {"Identity", "Unsqueeze", "Squeeze", "Reshape"}


def _lookup(e: gs.Tensor) -> tuple[np.ndarray, gs.Tensor] | None:
    """(table, ids) when `e` is ``table[ids]`` through data movement: reshapes, and a Gather of one constant index
    that picks one of several lookups stacked by a Concat on that axis."""
    for _ in range(8):
        n = e.inputs[0] if e.inputs else None
        if n is None:
            return None
        if n.op == "Gather" and const_value(n.inputs[0]) is not None and n.attrs.get("axis", 0) == 0:
            return const_value(n.inputs[0]), n.inputs[1]
        if n.op == "Gather":  # one of the lookups stacked on its axis
            e = stacked_part(n)
            if e is None:
                return None
        elif n.op in MOVES:
            e = n.inputs[0]
        else:
            return None
    return None


def poolings(graph: gs.Graph) -> list[tuple[gs.Node, gs.Tensor, gs.Tensor, int]]:
    """(node, weights, values, history axis of the weights) of ``ReduceSum(Mul(w [B, T, 1], E [B, T, D]), 1)``
    and ``MatMul(w [B, 1, T], E [B, T, D])``."""
    found = []
    for n in graph.nodes:
        if n.op == "MatMul" and const_value(n.inputs[1]) is None:
            found.append((n, n.inputs[0], n.inputs[1], 2))
        elif n.op == "ReduceSum" and axes_of(n) == [1] and n.inputs[0].inputs and \
                n.inputs[0].inputs[0].op == "Mul" and len(n.inputs[0].outputs) == 1:
            a, b = n.inputs[0].inputs[0].inputs
            found += [(n, a, b, 1), (n, b, a, 1)]
    return found


def _pads(probe: Probe, w: gs.Tensor, e: gs.Tensor, axis: int, table: np.ndarray, ids: gs.Tensor) -> int | None:
    """The first all-zero table row, when `e` [B, T, D] is table[ids [B, T]] and `w` has T on `axis` (a 1 on the
    other) in every probe run."""
    zero = np.flatnonzero(~table.reshape(table.shape[0], -1).any(axis=1)) if table.ndim == 2 else []
    if len(zero) == 0:
        return None
    for run in range(len(probe.runs)):
        wv, ev, iv = probe.value(w, run), probe.value(e, run), probe.value(ids, run)
        if wv is None or ev is None or iv is None or ev.ndim != 3 or iv.shape != ev.shape[:2] or wv.ndim != 3:
            return None
        if wv.shape[axis] != ev.shape[1] or wv.shape[3 - axis] != 1 or wv.shape[0] != ev.shape[0]:
            return None
        if not np.issubdtype(iv.dtype, np.integer) or not np.array_equal(ev, table[iv]):
            return None
    return int(zero[0])


def padding_candidates(graph: gs.Graph) -> list[tuple]:
    """(node, weights, values, axis, table, ids) of the poolings of a lookup (structure only: cheap)."""
    found = []
    for node, w, e, axis in poolings(graph):
        lookup = _lookup(e) if const_value(w) is None else None
        if lookup is not None:
            found.append((node, w, e, axis) + lookup)
    return found


def insert_padding_masks(graph: gs.Graph, probe: Probe, candidates: list[tuple], masked) -> list[tuple]:
    """The candidates' weights that `masked(w)` says no mask reaches, where the lookup's table has a zero row →
    times ``ids != that row``. Returns (reader, weights, the Mul node) of each, to undo it."""
    inserted = []
    for node, w, e, axis, table, ids in candidates:
        pad = None if masked(w) else _pads(probe, w, e, axis, table, ids)
        if pad is None:
            continue
        b = Builder(graph, f"{node.name}/padding_mask")
        padded = b.op("Equal", [ids, b.const("pad", np.array(pad, probe.value(ids).dtype))], dtype=np.bool_)
        valid = b.op("Not", [padded], dtype=np.bool_)
        flags = b.op("Cast", [b.axes_op("Unsqueeze", valid, [3 - axis], dtype=np.bool_)],
                     {"to": onnx.helper.np_dtype_to_tensor_dtype(probe.value(w).dtype)}, dtype=probe.value(w).dtype)
        weighted = b.op("Mul", [w, flags], name="masked", dtype=w.dtype)
        reader = node if node.op == "MatMul" else node.inputs[0].inputs[0]
        reader.inputs[reader.inputs.index(w)] = weighted
        inserted.append((reader, w, weighted.inputs[0]))
    return inserted


def undo(inserted: list[tuple]) -> None:
    """Put back the weights the reader read before (the mask nodes are left to graph.cleanup)."""
    for reader, w, mul in inserted:
        reader.inputs[reader.inputs.index(mul.outputs[0])] = w
