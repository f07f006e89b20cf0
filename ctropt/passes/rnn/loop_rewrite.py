"""The fused sequence op that replaces a recurrent Scan/Loop read by loops.py: its inputs (X batch-major, the
score column, lengths or mask, initial state), its outputs in the layer's layout, and the loop's removal."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_graphsurgeon as gs

from ...graph.edit import Builder, axes_of, const_value, redirect_consumers, replace_outputs, unique_name
from ...graph.shapes import Shapes
from ...ops.rnn import add_sequence_node
from .loop_dims import _dim
from .loop_plan import _Plan
from .loop_roles import _used


def _swap01(shape):
    return None if shape is None or len(shape) < 2 else [shape[1], shape[0]] + list(shape[2:])


def _batch_major(graph: gs.Graph, src: gs.Tensor, time_axis: int, shapes: Shapes, name: str) -> gs.Tensor:
    """`src` with batch first: itself, what a [1, 0, ...] Transpose made it from, or a new Transpose."""
    if time_axis == 1:
        return src
    rank = len(shapes.shape(src) or [0, 0, 0])
    perm = [1, 0] + list(range(2, rank))
    p = src.inputs[0] if len(src.inputs) == 1 else None
    if p is not None and p.op == "Transpose" and list(p.attrs.get("perm", [])) == perm:
        return p.inputs[0]
    return Builder(graph, name).op("Transpose", [src], {"perm": perm}, name="batch_major", dtype=shapes.dtype(src),
                                   shape=_swap01(shapes.shape(src)))


def _as_bt(graph: gs.Graph, t: gs.Tensor, shapes: Shapes, name: str) -> gs.Tensor:
    """A [B, T] view of a [B, T] or [B, T, 1] tensor (skipping an Unsqueeze that made the 1)."""
    s = shapes.shape(t)
    if s is not None and len(s) == 2:
        return t
    p = t.inputs[0] if len(t.inputs) == 1 else None
    if p is not None and p.op == "Unsqueeze" and axes_of(p) in ([2], [-1]) and \
            len(shapes.shape(p.inputs[0]) or [0, 0, 0]) == 2:
        return p.inputs[0]
    b = Builder(graph, name)
    return b.op("Reshape", [t, b.const("bt", np.array([0, 0], np.int64))], name="bt", dtype=shapes.dtype(t),
                shape=None if s is None else s[:2])


def _columns(graph: gs.Graph, X: gs.Tensor, cols: list[int], shapes: Shapes, name: str) -> gs.Tensor:
    """Columns `cols` (last axis) of a [B, T, I] tensor: a piece of the Concat that made it, or a Slice/Gather."""
    p = X.inputs[0] if len(X.inputs) == 1 else None
    if p is not None and p.op == "Concat" and int(p.attrs.get("axis", 0)) in (2, -1):
        start = 0
        for piece in p.inputs:
            w = _dim(piece, -1, shapes)
            if w is None:
                break
            if cols == list(range(start, start + w)):
                return piece
            start += w
    s = shapes.shape(X)
    out_shape = None if s is None else list(s[:2]) + [len(cols)]
    b = Builder(graph, name)
    if cols == list(range(cols[0], cols[-1] + 1)):
        return b.op("Slice", [X, b.const("starts", np.array([cols[0]], np.int64)),
                              b.const("ends", np.array([cols[-1] + 1], np.int64)),
                              b.const("axes", np.array([2], np.int64))],
                    name="x_columns", dtype=np.float32, shape=out_shape)
    return b.op("Gather", [X, b.const("cols", np.array(cols, np.int64))], {"axis": 2},
                name="x_columns", dtype=np.float32, shape=out_shape)


def _column(graph: gs.Graph, X: gs.Tensor, col: int, shapes: Shapes, name: str) -> gs.Tensor:
    """Column `col` of a [B, T, I] tensor as [B, T]."""
    piece = _columns(graph, X, [col], shapes, name)
    return _as_bt(graph, piece, shapes, name)


def _trim(graph: gs.Graph, t: gs.Tensor, X: gs.Tensor, name: str) -> gs.Tensor:
    """t[:, :T] with T = X's dim 1: the steps the loop read, when t is not known to be exactly that long."""
    b = Builder(graph, name)
    shape = b.op("Shape", [X], name="shape", dtype=np.int64, shape=[3])
    steps = b.op("Slice", [shape, b.const("one", np.array([1], np.int64)), b.const("two", np.array([2], np.int64))],
                 name="steps", dtype=np.int64, shape=[1])
    return b.op("Slice", [t, b.const("zero", np.array([0], np.int64)), steps,
                          b.const("axis1", np.array([1], np.int64))], name="trimmed", dtype=t.dtype)


def _aigru_split(X: gs.Tensor, width: int, shapes: Shapes):
    """X = P * A with A [B, T, 1] (DIEN's AIGRU: a GRU over a*x): (P, A), else None."""
    p = X.inputs[0] if len(X.inputs) == 1 else None
    if p is None or p.op != "Mul" or len(p.inputs) != 2:
        return None
    for P, A in (p.inputs, p.inputs[::-1]):
        sp, sa = shapes.shape(P), shapes.shape(A)
        if sp is None or sa is None or len(sp) != 3 or len(sa) != 3 or sa[2] != 1 or sp[2] != width:
            continue
        if sp[0] == 1 or sp[1] == 1 or (sa[1] is not None and sp[1] is not None and sa[1] != sp[1]):
            continue
        if const_value(A) is not None:
            continue
        return P, A
    return None


def _rewrite(graph: gs.Graph, node: gs.Node, plan: _Plan, shapes: Shapes) -> str:
    """Replaces the layer by one sequence op as `plan` says: the line that describes what was done."""
    name = node.name
    attrs = dataclasses.replace(plan.cell.attrs, padded_output=plan.padded)
    X, att, attrs = _x_and_att(graph, plan, attrs, shapes, name)
    inputs = _sequence_inputs(graph, plan, X, att, shapes, name)
    outputs, batch, steps = _sequence_outputs(graph, plan, attrs, X, shapes, name)
    add_sequence_node(graph, attrs, inputs, outputs, unique_name(graph, f"{name}/{attrs.op_type}"))
    new = _replacements(graph, node, plan, outputs, batch, steps, attrs.hidden_size)
    _remove_loop(graph, node, new)
    return _summary(node, plan, attrs)


def _x_and_att(graph: gs.Graph, plan: _Plan, attrs, shapes: Shapes, name: str):
    """X batch-major and the attention score [B, T] (None if none): a packed column of X, the score read per step
    (cut to X's steps if needed), or A of X = P * A (then the kind becomes AIGRU). Returns (X, att, attrs)."""
    cell = plan.cell
    X = _batch_major(graph, plan.x.source, plan.x.time_axis, shapes, name)
    att = None
    if cell.att_column is not None:
        att = _column(graph, X, cell.att_column, shapes, name)
        X = _columns(graph, X, list(cell.x_columns), shapes, name)
    elif plan.att is not None:
        att = _as_bt(graph, _batch_major(graph, plan.att.source, plan.att.time_axis, shapes, f"{name}/att"),
                     shapes, name)
        if id(plan.att) in plan.trim:
            att = _trim(graph, att, X, f"{name}/att")
    elif attrs.kind == "GRU":
        split = _aigru_split(X, len(cell.x_columns), shapes)
        if split is not None:
            X, A = split
            att = _as_bt(graph, A, shapes, name)
            attrs = dataclasses.replace(attrs, kind="AIGRU")
    return X, att, attrs


def _sequence_inputs(graph: gs.Graph, plan: _Plan, X: gs.Tensor, att: gs.Tensor | None, shapes: Shapes,
                     name: str) -> dict:
    """The sequence op's inputs: X, the weights, the lengths (flat, ceiled if float) or the mask, h0, the score."""
    cell, b = plan.cell, Builder(graph, name)
    inputs = {"X": X, "W": b.const("W", cell.W.astype(np.float32)), "R": b.const("R", cell.R.astype(np.float32)),
              "B": b.const("B", cell.B.astype(np.float32))}
    if plan.lens is not None:
        lens = plan.lens
        if plan.lens_rank == 2:
            lens = b.op("Reshape", [lens, b.const("flat", np.array([-1], np.int64))], name="lengths",
                        dtype=shapes.dtype(lens))
        if np.issubdtype(shapes.dtype(lens), np.floating):  # t < len  <=>  t < ceil(len) for integer t
            lens = b.op("Ceil", [lens], name="lengths_ceil", dtype=shapes.dtype(lens))
        inputs["sequence_lens"] = lens
    if plan.mask is not None:
        mask = _as_bt(graph, _batch_major(graph, plan.mask.source, plan.mask.time_axis, shapes, f"{name}/mask"),
                      shapes, f"{name}/mask")
        inputs["mask"] = _trim(graph, mask, X, f"{name}/mask") if id(plan.mask) in plan.trim else mask
    if plan.h0 is not None:
        inputs["initial_h"] = plan.h0
    if att is not None:
        inputs["att"] = att
    return inputs


def _sequence_outputs(graph: gs.Graph, plan: _Plan, attrs, X: gs.Tensor, shapes: Shapes, name: str):
    """New tensors for the outputs the plan uses (Y [B, T, H], Y_h [B, H]): (outputs, batch, steps)."""
    H = attrs.hidden_size
    xs = shapes.shape(X)
    batch, steps = (xs[0], xs[1]) if xs is not None and len(xs) == 3 else (None, None)
    outputs = {}
    if plan.stacked:
        outputs["Y"] = gs.Variable(unique_name(graph, f"{name}/{attrs.op_type}/Y"), np.float32, [batch, steps, H])
    if plan.finals:
        outputs["Y_h"] = gs.Variable(unique_name(graph, f"{name}/{attrs.op_type}/Y_h"), np.float32, [batch, H])
    return outputs, batch, steps


def _replacements(graph: gs.Graph, node: gs.Node, plan: _Plan, outputs: dict, batch, steps, H: int) -> list:
    """For each output of the layer, the tensor that replaces it (None if unused): Y (batch-major; a Transpose back
    to batch-major reads it directly) or one time-major Transpose of it, Y_h, or the passed-through init."""
    b = Builder(graph, node.name)
    new = [None] * len(node.outputs)
    y_tm = None
    for out, axis in plan.stacked:
        Y = outputs["Y"]
        if axis == 1:
            new[node.outputs.index(out)] = Y
            continue
        for c in list(out.outputs):  # a Transpose back to batch-major reads Y directly
            if c.op == "Transpose" and list(c.attrs.get("perm", [])) == [1, 0, 2] and c.inputs[0] is out \
                    and not any(o is c.outputs[0] for o in graph.outputs):
                redirect_consumers(c.outputs[0], Y)
                c.inputs.clear()
        if _used(graph, out):
            if y_tm is None:
                y_tm = b.op("Transpose", [Y], {"perm": [1, 0, 2]}, name="time_major", dtype=np.float32,
                            shape=[steps, batch, H])
            new[node.outputs.index(out)] = y_tm
    for out in plan.finals:
        new[node.outputs.index(out)] = outputs["Y_h"]
    for out, init in plan.passthrough:
        new[node.outputs.index(out)] = init
    seen = set()
    for i, (out, repl) in enumerate(zip(node.outputs, new)):  # graph outputs each need a tensor of their own
        if repl is None:
            continue
        if id(repl) in seen and any(o is out for o in graph.outputs):
            new[i] = b.op("Identity", [repl], name="copy", dtype=repl.dtype, shape=repl.shape)
        seen.add(id(repl))
    return new


def _remove_loop(graph: gs.Graph, node: gs.Node, new: list) -> None:
    """Routes the layer's outputs to `new` and removes it (its dead body no longer reads outer values)."""
    replace_outputs(graph, node, new)
    node.inputs.clear()
    for n in node.attrs["body"].nodes:
        n.inputs.clear()
    graph.nodes.remove(node)


def _summary(node: gs.Node, plan: _Plan, attrs) -> str:
    """The line that says which layer became which op, and how."""
    details = [f"H {attrs.hidden_size}"]
    if attrs.kind == "AUGRU":
        details.append(f"att_keep {attrs.att_keep}")
    if attrs.linear_before_reset:
        details.append("linear_before_reset")
    details.append(f"lengths {plan.lens.name}" if plan.lens is not None else
                   f"mask {plan.mask.source.name}" if plan.mask is not None else "no lengths")
    if (plan.lens is not None or plan.mask is not None) and plan.stacked:
        details.append(f"padded {attrs.padded_output}")
    if plan.h0 is not None:
        details.append(f"initial_h {plan.h0.name}")
    return f"{node.op} {node.name} → {attrs.op_type} ({', '.join(details)})"
