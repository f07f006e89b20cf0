"""The sequence node that replaces a chain of unrolled cells: the values that read the chain (the last state, the
states stacked along time), and the node's inputs and outputs in their layouts."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from ...graph.edit import Builder, axes_of, const_value, unique_name
from ...graph.shapes import Shapes
from ...ops.rnn import add_sequence_node
from .unrolled_steps import _Cell, _Chain, _Group
from .values import _ints, _take_over


def _chain_readers(graph: gs.Graph, chain: _Chain, region: dict) -> tuple | None:
    """What the graph reads from the chain: (stacked, need_h), stacked being (Y, the stacking nodes) or None and
    need_h whether the last state is read; None if it reads other values of the chain, or nothing."""
    s = chain.states
    graph_outputs = {id(t) for t in graph.outputs}
    stacked = _stacked(chain, region)
    if stacked is False:
        return None
    stack_nodes = {id(n) for n in stacked[1]} if stacked else set()
    last_readers = [u for u in s[-1].outputs if id(u) not in region and id(u) not in stack_nodes]
    need_h = bool(last_readers) or id(s[-1]) in graph_outputs
    for ns in chain.nodes:
        for n in ns:
            for o in n.outputs:
                if o is s[-1]:
                    continue
                if id(o) in graph_outputs:
                    return None
                for u in o.outputs:
                    if id(u) in region:
                        continue
                    if id(u) in stack_nodes and any(o is x for x in s):
                        continue
                    return None
    if not need_h and not stacked:
        return None
    return stacked, need_h


def _stacked(chain: _Chain, region: dict):
    """States stacked along time: Concat(axis 1) of Unsqueeze(s_t, 1), or ConcatFromSequence(axis 1, new_axis 1)
    of SequenceConstruct(s_t), t = 0..T-1 in order, Y [B, T, H]; or along axis 0, Y [T, B, H] (paddle2onnx's
    stacks grow one Concat per step from an empty tensor). Returns (Y, the stacking nodes, time axis), None if
    only the last state is read, False if the states are read in another way."""
    s = chain.states
    outside = [[u for u in st.outputs if id(u) not in region] for st in s]
    if not any(outside[:-1]):
        return None
    if any(len(o) != 1 for o in outside[:-1]):
        return False
    first = outside[0][0]
    if first.op == "SequenceConstruct":
        cfs = first.outputs[0].outputs
        if (len(first.inputs) != len(s) or any(first.inputs[t] is not s[t] for t in range(len(s)))
                or len(cfs) != 1 or cfs[0].op != "ConcatFromSequence"
                or int(cfs[0].attrs.get("new_axis", 0)) != 1 or int(cfs[0].attrs.get("axis", 0)) not in (1, -2)):
            return False
        return cfs[0].outputs[0], [first, cfs[0]], 1
    axis = {(1,): 1, (-2,): 1, (0,): 0, (-3,): 0}.get(tuple(axes_of(first) or ())) if first.op == "Unsqueeze" else None
    if axis is None:
        return False
    unsq = []
    for t, st in enumerate(s):
        us = [u for u in outside[t] if u.op == "Unsqueeze"]
        if len(us) != 1 or axes_of(us[0]) not in ([axis], [axis - 3]) or len(us[0].outputs[0].outputs) != 1:
            return False
        unsq.append(us[0])
    concats = _concat_steps([u.outputs[0] for u in unsq], axis)
    if concats is None:
        return False
    return concats[-1].outputs[0], unsq + concats, axis


def _concat_steps(parts: list, axis: int) -> list | None:
    """The Concat(axis) nodes that join `parts` in order: one Concat of them all, or one per step, each of the
    previous result (an empty tensor, or nothing, before the first part) and the next part."""
    c = parts[0].outputs[0]
    if c.op != "Concat" or int(c.attrs.get("axis", 0)) not in (axis, axis - 3):
        return None
    if len(c.inputs) == len(parts) and all(c.inputs[t] is parts[t] for t in range(len(parts))):
        return [c]
    start = 0 if len(c.inputs) == 2 and c.inputs[1] is parts[0] and _empty_along(c.inputs[0], axis) else 1
    if start == 1 and not (len(c.inputs) == 2 and c.inputs[0] is parts[0] and c.inputs[1] is parts[1]):
        return None
    chain = [c]
    for part in parts[start + 1:]:
        prev = chain[-1].outputs[0]
        c = part.outputs[0]
        if (c.op != "Concat" or c.attrs != chain[0].attrs or len(c.inputs) != 2 or c.inputs[0] is not prev
                or c.inputs[1] is not part or len(prev.outputs) != 1):
            return None
        chain.append(c)
    return chain


def _empty_along(t: gs.Tensor, axis: int) -> bool:
    """True if `t` has length 0 along `axis` by construction: a constant, or ConstantOfShape/Expand (of one
    value) to a shape whose entry `axis` is a constant 0."""
    v = const_value(t)
    if v is not None:
        return v.ndim > axis and v.shape[axis] == 0
    p = t.inputs[0] if len(t.inputs) == 1 else None
    if p is None or p.op not in ("ConstantOfShape", "Expand"):
        return False
    if p.op == "Expand" and (const_value(p.inputs[0]) is None or const_value(p.inputs[0]).size != 1):
        return False
    shape = p.inputs[-1]
    dims = _ints(shape)
    if dims is not None:
        return len(dims) > axis and dims[axis] == 0
    q = shape.inputs[0] if len(shape.inputs) == 1 else None
    if q is None or q.op != "Concat" or len(q.inputs) <= axis:
        return False
    head = [_ints(x) for x in q.inputs[:axis + 1]]
    return all(h is not None and len(h) == 1 for h in head) and head[axis] == [0]


def _replace_chain(graph: gs.Graph, opset: int, shapes: Shapes, chain: _Chain, cell: _Cell, stacked,
                   need_h: bool, h0_zero: bool, n_nodes: int) -> str:
    """One sequence node over the slices' sources in place of the chain: it writes the last state (Y_h) and the
    stacked states (Y) the graph reads. Returns its description."""
    T, attrs, found = chain.T, cell.attrs, cell.match
    b = Builder(graph, unique_name(graph, f"rnn_{attrs.kind.lower()}"), opset=opset)
    X = _batch_major(b, shapes, cell.x_group, T)
    inputs = {"X": X, "W": b.const("W", found.W), "R": b.const("R", found.R), "B": b.const("B", found.B)}
    if not h0_zero:
        inputs["initial_h"] = chain.h0
    if cell.att_group is not None:
        inputs["att"] = _att_sequence(b, shapes, cell.att_group.source, T)
    if cell.mask_group is not None:
        m = _time_prefix(b, shapes, cell.mask_group.source, T)
        if shapes.rank(cell.mask_group.source) == 3:  # a blend's [B, T, 1] mask
            m = b.axes_op("Squeeze", m, [2])
        if cell.invert:
            m = b.op("Not", [m], dtype=np.bool_)
        inputs["mask"] = m
    outputs = {}
    if need_h:
        outputs["Y_h"] = _take_over(chain.states[-1])
    if stacked:
        outputs["Y"] = _stacked_output(graph, b, stacked)
    add_sequence_node(graph, attrs, inputs, outputs, unique_name(graph, f"{b.prefix}/{attrs.op_type}"))
    mask_note = "" if cell.mask_group is None else (f", {cell.mask_form} mask → mask" + (" (inverted)" if cell.invert else ""))
    outs = " and ".join(k for k in ("Y", "Y_h") if k in outputs)
    return (f"{attrs.kind} cell unrolled over {T} steps ({n_nodes} nodes) → {attrs.op_type} "
            f"(linear_before_reset={attrs.linear_before_reset}, att_keep={attrs.att_keep}{mask_note}; {outs})")


def _stacked_output(graph: gs.Graph, b: Builder, stacked) -> gs.Tensor:
    """The value the node's Y [B, T, H] writes: the stack itself, or for a time-major stack [T, B, H] the
    Transpose back that reads it (or a fresh Y with a Transpose to the stack)."""
    Y, _, axis = stacked
    if axis == 1:
        return _take_over(Y)
    readers = Y.outputs
    if (len(readers) == 1 and readers[0].op == "Transpose" and list(readers[0].attrs.get("perm", [])) == [1, 0, 2]
            and all(Y is not o for o in graph.outputs)):
        return _take_over(readers[0].outputs[0])
    fresh = gs.Variable(unique_name(graph, f"{b.prefix}/Y"), dtype=np.float32)
    b.op("Transpose", [fresh], {"perm": [1, 0, 2]}, out=_take_over(Y))
    return fresh


def _batch_major(b: Builder, shapes: Shapes, g: _Group, T: int) -> gs.Tensor:
    """The steps' sequence as X [B, T, I]: a time-major source [T', B, I] transposed back (the Transpose that made
    it, where there is one), then cut to its first T steps."""
    X, axis = g.source, g.axis
    if axis == 0:
        p = X.inputs[0] if len(X.inputs) == 1 else None
        if p is not None and p.op == "Transpose" and list(p.attrs.get("perm", [])) == [1, 0, 2]:
            X, axis = p.inputs[0], 1
    src_T = (shapes.shape(X) or [None, None])[axis]
    if src_T != T:
        X = b.op("Slice", [X, b.const("starts", np.array([0], np.int64)), b.const("ends", np.array([T], np.int64)),
                           b.const("axes", np.array([axis], np.int64))], dtype=np.float32)
    if axis == 0:
        X = b.op("Transpose", [X], {"perm": [1, 0, 2]}, dtype=np.float32)
    return X


def _att_sequence(b: Builder, shapes: Shapes, src: gs.Tensor, T: int) -> gs.Tensor:
    """The attention [B, T] of an attention sequence `src`, [B, T'] or [B, T', 1]: for the latter the [B, T'] value
    it unsqueezes (torch-rechub's ``att.unsqueeze(-1)``), else `src` squeezed; cut to its first T steps."""
    if shapes.rank(src) != 3:
        return _time_prefix(b, shapes, src, T)
    p = src.inputs[0] if len(src.inputs) == 1 else None
    if p is not None and p.op == "Unsqueeze" and axes_of(p) in ([2], [-1]) and shapes.rank(p.inputs[0]) == 2:
        return _time_prefix(b, shapes, p.inputs[0], T)
    return b.axes_op("Squeeze", _time_prefix(b, shapes, src, T), [2])


def _time_prefix(b: Builder, shapes: Shapes, src: gs.Tensor, T: int) -> gs.Tensor:
    """`src` [B, T', ...] cut to its first T steps (as is when T' is T)."""
    shape = shapes.shape(src)
    if shape is not None and len(shape) > 1 and shape[1] == T:
        return src
    return b.op("Slice", [src, b.const("starts", np.array([0], np.int64)), b.const("ends", np.array([T], np.int64)),
                          b.const("axes", np.array([1], np.int64))])
