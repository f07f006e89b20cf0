"""Recurrent Scan/Loop layers (the tf2onnx dialects) → one ai.ctropt sequence op each.

tf2onnx writes a recurrent layer as a Scan or a Loop whose body holds one step of the cell:
- TF1 ``dynamic_rnn`` → Scan over the time-major input [T, B, I]; carried: two step counters and the state;
  with ``sequence_length`` the body masks by ``GreaterOrEqual(t, seq_len)`` → Not/Cast/Mul/Add: the state is
  kept and the step's output is the zero state past the length (DIEN's GRU and VecAttGRU, the score packed as
  the last input column);
- Keras/TF2 ``while_loop`` → Loop: carried time counter, state, and (Keras) the weights; x_t read by
  ``Gather(x_time_major, t)``, attention scores by a strided Slice of a [B, T, 1] tensor at t; DeepCTR's
  DIEN masks with SelectV2 like dynamic_rnn does (``_where`` exports); a Keras GRU behind a mask
  (``mask_zero``) reads m_t = ``Gather(mask_time_major, t)`` and also carries its previous output, kept like the
  state where m_t is false (padded_output "state", the ``mask`` input).

Rather than one pattern per dialect, a layer is read by meaning on a throwaway copy of its body:
1. roles of the carried values (counter: ``v + 1`` from a constant start; invariant: passed through; the
   float state, and possibly a copy of it) and of the per-step inputs (Scan slices, or reads ``S[t]`` /
   ``S[:, t]`` of an outer tensor, each checked numerically against numpy on random data);
2. the cell: the first tensor after the Tanh that :func:`ctropt.passes.rnn.cell.identify_gru_cell` reads as
   a GRU-family cell of (h, x_t[, a_t]); a one-wide per-step input is the score a_t, or else a 0/1 mask;
3. the masking, by running the body step on random states, inputs, masks and lengths around t: with
   valid = t < len (or m_t), the new state must be ``where(valid, cell, h)`` (``cell`` if neither), each stacked
   output ``where(valid, cell, 0)`` (padded_output "zero") or ``where(valid, cell, h)`` ("state"); other values
   the step uses must be constants or proven zeros (an integer or float one is tried as the lengths);
4. for Loops, the trip count: M, the initial condition and the body's condition are folded (shapes of
   static dims, or two hypothetical lengths for a dynamic time dim) and must give exactly T iterations.
A layer that fails any check stays as it is (the reason goes to `notes`). Glue is minimal: X is taken from
before the exporter's [T, B] Transpose, a packed score column from the Concat that packed it, and a GRU over
``x * a`` (DIEN's AIGRU) becomes an AIGRUSequence.

This module is the driver (`_analyze` runs the phases in order); the phases are `loop_roles.py` (1),
`loop_step.py` (2 and 3) and `loop_dims.py` (4, and the sizes the others read); `loop_plan.py` holds what they
find, and `loop_rewrite.py` builds the fused op from it.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from ...graph.edit import is_all_zeros
from ...graph.shapes import Shapes
from ...graph import strip_identity
from .loop_dims import _check_trip_count, _dim, _empty_along, _steps_to_trim
from .loop_plan import _Plan, _Skip
from .loop_rewrite import _rewrite
from .loop_roles import _carried_roles, _per_step_inputs, _probe_copy, _used
from .loop_step import _find_cell, _masking


def fuse_recurrent_loops(graph: gs.Graph, opset: int, notes: list[str] | None = None) -> list[str]:
    """Replace every recurrent Scan/Loop of the main graph whose body is a GRU-family cell by one sequence op.

    Returns one line per fused layer; reasons for layers left as they are go to `notes` when given.
    """
    done: list[str] = []
    candidates = [n for n in graph.nodes if n.op in ("Scan", "Loop") and n.domain in ("", "ai.onnx", None)
                  and _looks_recurrent(n)]
    if not candidates:
        return done
    shapes = Shapes(graph)
    shapes.infer()  # once, on the graph as it is
    for node in candidates:
        try:
            plan = _analyze(graph, node, shapes, int(opset))
        except _Skip as e:
            if notes is not None:
                notes.append(f"{node.op} {node.name} left as is: {e}")
            continue
        except Exception as e:  # a body this reader cannot handle stays as it is
            if notes is not None:
                notes.append(f"{node.op} {node.name} left as is: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            continue
        done.append(_rewrite(graph, node, plan, shapes))
    if done:
        graph.cleanup(remove_unused_graph_inputs=False).toposort(mode="nodes")
    return done


def _looks_recurrent(node: gs.Node) -> bool:
    body = node.attrs.get("body")
    if not isinstance(body, gs.Graph):
        return False
    ops = {n.op for n in body.nodes}
    return "Tanh" in ops and "Sigmoid" in ops


def _interface(node: gs.Node, shapes: Shapes, opset: int):
    """(carried: inits, body inputs, body outputs; scan outputs and their time axes; Scan slices, sources, axes)."""
    body: gs.Graph = node.attrs["body"]
    if node.op == "Loop":
        n = len(node.inputs) - 2
        if n < 1 or len(body.inputs) != n + 2 or len(body.outputs) < n + 1:
            raise _Skip("unexpected Loop interface")
        scan_outs = list(body.outputs[1 + n:])
        return (list(node.inputs[2:]), list(body.inputs[2:]), list(body.outputs[1:1 + n]), scan_outs,
                [0] * len(scan_outs), [], [], [])
    if opset < 9 or "num_scan_inputs" not in node.attrs:
        raise _Skip("Scan-8 form")
    m = int(node.attrs["num_scan_inputs"])
    n = len(node.inputs) - m
    if len(body.inputs) != len(node.inputs) or len(body.outputs) < n:
        raise _Skip("unexpected Scan interface")
    scan_outs, srcs = list(body.outputs[n:]), list(node.inputs[n:])
    if any(int(d) != 0 for d in list(node.attrs.get("scan_input_directions", [])) +
           list(node.attrs.get("scan_output_directions", []))):
        raise _Skip("reverse scan")
    in_axes = [int(x) for x in node.attrs.get("scan_input_axes", [0] * m)]
    out_axes = [int(x) for x in node.attrs.get("scan_output_axes", [0] * len(scan_outs))]
    in_axes = [a % len(shapes.shape(s) or [0, 0, 0]) if a < 0 else a for a, s in zip(in_axes, srcs)]
    out_axes = [a % 3 if a < 0 else a for a in out_axes]
    if any(a not in (0, 1) for a in in_axes + out_axes):
        raise _Skip("scan axis other than time-major or batch-major")
    return (list(node.inputs[:n]), list(body.inputs[:n]), list(body.outputs[:n]), scan_outs, out_axes,
            list(body.inputs[n:]), srcs, in_axes)


def _analyze(graph: gs.Graph, node: gs.Node, shapes: Shapes, opset: int) -> _Plan:
    """Reads a recurrent Scan/Loop by meaning, phase by phase (see the module docstring): its plan, or _Skip."""
    body: gs.Graph = node.attrs["body"]
    if _has_nested_subgraph(body):
        raise _Skip("nested subgraph in the body")
    inits, b_in, b_out, scan_outs, out_axes, slices, slice_srcs, in_axes = _interface(node, shapes, opset)
    n_carried = len(inits)
    finals, stacked_outs = list(node.outputs[:n_carried]), list(node.outputs[n_carried:])
    counters, invariants, floats, grown = _carried_roles(graph, inits, b_in, b_out, finals)
    copy = _probe_copy(node, inits, counters, invariants)
    for k, axis in grown.items():  # a stack grown from empty is a stacked output
        if _used(graph, finals[k]) and not _empty_along(inits[k], axis, shapes):
            raise _Skip(f"stack {b_in[k].name} grows from a start that is not empty")
        stacked_outs.append(finals[k])
        out_axes = list(out_axes) + [axis]
        copy.scan_outs.append(strip_identity(copy.carried_out[k]).inputs[0].inputs[1])
    used_stacked = [j for j, t in enumerate(stacked_outs) if _used(graph, t)]
    rng = np.random.default_rng(0)  # one stream for every probe below, consumed in this order
    x_step, extra = _per_step_inputs(node, copy, slice_srcs, in_axes, b_in, floats, shapes, opset, rng)
    cell = _find_cell(copy, x_step, extra, b_in, inits, floats, shapes, opset)
    outer, padded_output = _masking(copy, cell, x_step, used_stacked, shapes, opset, rng)
    T_static = _dim(x_step.source, x_step.time_axis, shapes)
    trim = _steps_to_trim(x_step, (cell.att, cell.mask), T_static, shapes)
    if node.op == "Loop":
        _check_trip_count(node, body, counters, invariants, inits, shapes, x_step, T_static, copy.ranges)
    state = cell.state
    h0 = None if is_all_zeros(inits[state]) else inits[state]
    passthrough = [(finals[k], inits[k]) for k in invariants if _used(graph, finals[k])]
    return _Plan(cell.match, x_step, cell.att, cell.mask, outer.lens, outer.lens_rank, h0, padded_output,
                 [(stacked_outs[j], out_axes[j]) for j in used_stacked],
                 [finals[k] for k in [state] + cell.aliases if _used(graph, finals[k])], passthrough, trim)


def _has_nested_subgraph(body: gs.Graph) -> bool:
    """True if a node of `body` holds a graph attribute (an If, a Loop, a Scan inside the step)."""
    return any(isinstance(v, gs.Graph) or (isinstance(v, list) and any(isinstance(x, gs.Graph) for x in v))
               for n in body.nodes for v in n.attrs.values())
