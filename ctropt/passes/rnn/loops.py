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
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from ...graph import strip_identity
from ...ops.rnn import add_sequence_node, is_sequence_node
from .cell import CellMatch, identify_gru_cell
from ...graph.edit import (Builder, axes_of, const_value, is_all_zeros, redirect_consumers, replace_outputs,
                           unique_name)
from ...graph.shapes import Shapes
from ...runtime.subgraph import Subgraph

_PROBE_BATCH = 8
_RESHAPES = ("Squeeze", "Unsqueeze", "Reshape", "Flatten", "Identity")
_SAME_SHAPE = {"Identity", "Cast", "Relu", "Sigmoid", "Tanh", "Neg", "Abs", "Exp", "Log", "Sqrt", "Erf", "Softsign",
               "Not", "Softmax"}
_BROADCAST = {"Add", "Sub", "Mul", "Div", "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "And", "Or",
              "Pow", "Max", "Min"}
_MAX_CANDIDATES = 8


class _Skip(Exception):
    """This layer is not fused; the message says why."""


# ------------------------------------------------------------------------------------------ entry point


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


# ------------------------------------------------------------------------------------------ shapes


def _dim(t: gs.Tensor, axis: int, shapes: Shapes) -> int | None:
    """The static size of dimension `axis` of `t` (or of a tensor it is known to equal), else None."""
    for u, ax in _dim_chain(t, axis, shapes):
        s = shapes.shape(u)
        if s is not None and -len(s) <= ax < len(s) and s[ax] is not None:
            return s[ax]
    return None


def _dim_chain(t: gs.Tensor, axis: int, shapes: Shapes | None = None) -> list[tuple[gs.Tensor, int]]:
    """(tensor, axis) pairs known to be the same dimension as `axis` of `t`: followed up through transposes,
    same-shape ops and the sequence ops this pass writes."""
    def rank(x):
        s = shapes.shape(x) if shapes is not None else (None if x.shape is None else list(x.shape))
        return None if s is None else len(s)

    chain = [(t, axis)]
    while len(chain) < 64 and len(t.inputs) == 1:
        n = t.inputs[0]
        if n.op == "Transpose" and n.attrs.get("perm") is not None and n.inputs:
            perm = list(n.attrs["perm"])
            if not -len(perm) <= axis < len(perm):
                break
            axis, t = perm[axis], n.inputs[0]
        elif (n.op in _SAME_SHAPE or n.op == "ReverseSequence") and n.inputs:
            t = n.inputs[0]
        elif n.op in _BROADCAST and len(n.inputs) == 2 and any(_scalar(x) for x in n.inputs):
            t = n.inputs[1] if _scalar(n.inputs[0]) else n.inputs[0]
        elif n.op == "Gather" and int(n.attrs.get("axis", 0)) == 0 and const_value(n.inputs[0]) is not None \
                and rank(n.inputs[1]) is not None and 0 <= axis < rank(n.inputs[1]):
            t = n.inputs[1]     # an embedding lookup: ids [...] -> [..., D]
        elif n.op in ("Unsqueeze", "Squeeze") and axes_of(n) is not None and rank(n.inputs[0]) is not None:
            r_in, axes = rank(n.inputs[0]), axes_of(n)
            if n.op == "Unsqueeze":
                r_out = r_in + len(axes)
                axes, axis = sorted(a % r_out for a in axes), axis % r_out
                if axis in axes:
                    break
                axis -= sum(1 for a in axes if a < axis)
            else:
                axes, axis = sorted(a % r_in for a in axes), axis % max(r_in - len(axes), 1)
                for a in axes:
                    if a <= axis:
                        axis += 1
            t = n.inputs[0]
        elif is_sequence_node(n) and n.inputs and axis in (0, 1) and (t is n.outputs[0] or axis == 0):
            t = n.inputs[0]     # Y [B, T, H] and Y_h [B, H] share B (and Y its T) with X [B, T, I]
        else:
            break
        chain.append((t, axis))
    return chain


def _scalar(t: gs.Tensor) -> bool:
    """A constant that broadcasts without changing the other operand's shape."""
    v = const_value(t)
    return v is not None and v.size == 1 and v.ndim <= 1


def _dim_key(t: gs.Tensor, axis: int, shapes: Shapes | None = None):
    """An identity for dimension `axis` of `t`: equal keys are equal dims."""
    last, ax = _dim_chain(t, axis, shapes)[-1]
    return (id(last), ax)


# ------------------------------------------------------------------------------------------ folding (trip count)


class _Unknown(Exception):
    pass


class _Folder:
    """Evaluates small integer/boolean computations (loop conditions, shapes) in numpy.

    Shape reads static dims; a dynamic dim whose key is `time_key` reads the hypothetical length `T`."""

    def __init__(self, shapes: Shapes, time_key=None, T: int | None = None):
        self.shapes, self.time_key, self.T = shapes, time_key, T

    def value(self, t: gs.Tensor, env: dict, memo: dict) -> np.ndarray:
        key = id(t)
        if key in memo:
            return memo[key]
        if key in env:
            v = env[key]
            v = self.value(v, env, memo) if isinstance(v, gs.Tensor) else np.asarray(v)
        else:
            v = const_value(t)
            if v is None:
                if not t.inputs:
                    raise _Unknown(t.name)
                v = self._op(t.inputs[0], env, memo)
            v = np.asarray(v)
            if v.dtype == object and not any(x is None for x in v.ravel()):
                v = np.array(v.tolist())
        memo[key] = v
        return v

    def _dim(self, t, axis):
        d = _dim(t, axis, self.shapes)
        if d is None and self.time_key is not None and _dim_key(t, axis, self.shapes) == self.time_key:
            d = self.T
        return d

    def _shape(self, n: gs.Node, env, memo):
        """A Shape: static dims, the hypothetical length, or the size of a Range it folds; None where unknown."""
        rank = self.shapes.shape(n.inputs[0])
        if rank is None:
            raise _Unknown(n.name)
        dims = [self._dim(n.inputs[0], i) for i in range(len(rank))]
        if any(d is None for d in dims) and n.inputs[0].inputs and n.inputs[0].inputs[0].op == "Range":
            dims = list(self.value(n.inputs[0], env, memo).shape)
        dims = dims[n.attrs.get("start", 0):n.attrs.get("end", None)]
        if any(d is None for d in dims):
            return np.array(dims, dtype=object)
        return np.array(dims, dtype=np.int64)

    def _op(self, n: gs.Node, env, memo):
        def arg(i):
            if i >= len(n.inputs) or not n.inputs[i].name:
                return None
            v = self.value(n.inputs[i], env, memo)
            if v.dtype == object and any(x is None for x in v.ravel()):
                if n.op not in ("Gather", "Slice", "Squeeze", "Unsqueeze", "Concat", "Identity", "Reshape", "Cast") \
                        or (i > 0 and n.op != "Concat"):
                    raise _Unknown(n.name)
            return v

        op, a = n.op, n.attrs
        if op == "Identity":
            return arg(0)
        if op == "Cast":
            x, to = arg(0), onnx.helper.tensor_dtype_to_np_dtype(a["to"])
            if x.dtype == object:  # a shape with unknown dims: cast the known ones
                return np.array([None if v is None else to.type(v) for v in x.ravel()], dtype=object).reshape(x.shape)
            return x.astype(to)
        if op in ("Add", "Sub", "Mul", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Equal", "And", "Or",
                  "Xor"):
            f = {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Less": np.less,
                 "LessOrEqual": np.less_equal, "Greater": np.greater, "GreaterOrEqual": np.greater_equal,
                 "Equal": np.equal, "And": np.logical_and, "Or": np.logical_or, "Xor": np.logical_xor}[op]
            x, y = arg(0), arg(1)
            out = f(x, y)
            return out.astype(x.dtype) if op in ("Add", "Sub", "Mul") else out
        if op == "Not":
            return np.logical_not(arg(0))
        if op in ("Max", "Min"):
            vals = [arg(i) for i in range(len(n.inputs))]
            f = np.maximum if op == "Max" else np.minimum
            out = vals[0]
            for v in vals[1:]:
                out = f(out, v)
            return out
        if op == "Range":  # paddle's arange over the steps
            return np.arange(*[np.ravel(arg(i))[0] for i in range(3)]).astype(arg(0).dtype)
        if op == "Shape":
            return self._shape(n, env, memo)
        if op == "Gather":
            return np.take(arg(0), arg(1).astype(np.int64), axis=a.get("axis", 0))
        if op == "Slice":
            data = arg(0)
            starts, ends = arg(1).astype(np.int64), arg(2).astype(np.int64)
            axes = arg(3)
            steps = arg(4)
            axes = list(range(len(starts))) if axes is None else [int(x) for x in axes]
            steps = [1] * len(starts) if steps is None else [int(x) for x in steps]
            index = [slice(None)] * data.ndim
            for s, e, ax, st in zip(starts, ends, axes, steps):
                index[ax] = slice(int(s), int(e), st)
            return data[tuple(index)]
        if op in ("Squeeze", "Unsqueeze"):
            data = arg(0)
            axes = arg(1) if len(n.inputs) > 1 else a.get("axes")
            if op == "Squeeze":
                if axes is None:
                    return np.squeeze(data)
                return np.squeeze(data, axis=tuple(int(x) % data.ndim for x in np.ravel(axes)))
            out = data
            rank = data.ndim + len(np.ravel(axes))
            for ax in sorted(int(x) % rank for x in np.ravel(axes)):
                out = np.expand_dims(out, ax)
            return out
        if op == "Concat":
            return np.concatenate([np.atleast_1d(arg(i)) for i in range(len(n.inputs))], axis=a.get("axis", 0))
        if op == "Reshape":
            data, shape = arg(0), [int(x) for x in arg(1)]
            shape = [data.shape[i] if s == 0 else s for i, s in enumerate(shape)]
            return data.reshape(shape)
        raise _Unknown(op)


# ------------------------------------------------------------------------------------------ analysis


@dataclasses.dataclass
class _Step:
    """A per-step input of the cell: `leaf` (in the body copy) is `source` at step t along `time_axis`."""

    leaf: gs.Tensor
    source: gs.Tensor
    time_axis: int
    width: int
    rank: int  # of the leaf's value: 2 ([B, w]) or 1 ([B])
    dtype: np.dtype
    scanned: bool = False  # a Scan slice (same length as the scan by construction)


@dataclasses.dataclass
class _Plan:
    cell: CellMatch
    x: _Step
    att: _Step | None
    mask: _Step | None
    lens: gs.Tensor | None
    lens_rank: int
    h0: gs.Tensor | None
    padded: str
    stacked: list  # (node output, time axis of it)
    finals: list   # node outputs that are the final state
    passthrough: list  # (node output, outer init)
    trim: list = dataclasses.field(default_factory=list)  # ids of steps whose [B, T'] input is cut to X's T


def _used(graph: gs.Graph, t: gs.Tensor) -> bool:
    return bool(t.outputs) or any(o is t for o in graph.outputs)


def _is_counter(vi: gs.Tensor, vo: gs.Tensor) -> bool:
    """vo = vi + 1: an Add of 1 (tf2onnx), or paddle2onnx's ``scale`` (Cast → Mul 1 → Add 1 → Cast back)."""
    return _affine(vo, vi) == (1.0, 1.0)


def _affine(t: gs.Tensor, vi: gs.Tensor, depth: int = 0) -> tuple[float, float] | None:
    """(a, b) with t = a * vi + b through Identity/Cast and Add/Sub/Mul by constant scalars, else None."""
    if t is vi:
        return 1.0, 0.0
    if depth > 8 or len(t.inputs) != 1 or not t.inputs[0].inputs:
        return None
    n = t.inputs[0]
    if n.op in ("Identity", "Cast"):
        return _affine(n.inputs[0], vi, depth + 1)
    if n.op not in ("Add", "Sub", "Mul") or len(n.inputs) != 2:
        return None
    consts = [const_value(x) for x in n.inputs]
    k = next((i for i in (1, 0) if consts[i] is not None and consts[i].size == 1), None)
    if k is None or (n.op == "Sub" and k == 0):
        return None
    inner = _affine(n.inputs[1 - k], vi, depth + 1)
    if inner is None:
        return None
    c, (a, b) = float(np.ravel(consts[k])[0]), inner
    return (a * c, b * c) if n.op == "Mul" else (a, b + c) if n.op == "Add" else (a, b - c)


def _grown_axis(vi: gs.Tensor, vo: gs.Tensor) -> int | None:
    """The axis along which vo = Concat(vi, piece) grows a stack by one step each iteration (paddle2onnx's
    concat-grown outputs of a ``while``), if nothing else reads vi; else None."""
    vo, t = strip_identity(vo), vi
    while len(t.outputs) == 1 and t.outputs[0].op == "Identity":
        t = t.outputs[0].outputs[0]
    if len(vo.inputs) != 1 or vo.inputs[0].op != "Concat" or len(vo.inputs[0].inputs) != 2:
        return None
    cat = vo.inputs[0]
    if cat.inputs[0] is not t or len(t.outputs) != 1 or cat.inputs[1] is t:
        return None
    axis = int(cat.attrs.get("axis", 0))
    return axis % 3 if -3 <= axis < 3 else None


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


def _empty_along(t: gs.Tensor, axis: int, shapes: Shapes) -> bool:
    """True if `t` has size 0 along `axis`: by its shape, or as an Expand / ConstantOfShape to a shape that folds
    to 0 there (paddle2onnx's ``full_with_tensor`` start of a grown stack)."""
    if _dim(t, axis, shapes) == 0:
        return True
    t = strip_identity(t)
    if len(t.inputs) != 1 or t.inputs[0].op not in ("Expand", "ConstantOfShape"):
        return False
    n = t.inputs[0]
    if n.op == "Expand" and (const_value(n.inputs[0]) is None or const_value(n.inputs[0]).ndim > 1):
        return False
    try:
        dims = np.ravel(_Folder(shapes).value(n.inputs[-1], {}, {}))
    except (_Unknown, ValueError, TypeError, IndexError, KeyError, RecursionError):
        return False
    return len(dims) == 3 and dims[axis] is not None and int(dims[axis]) == 0


def _has_nested_subgraph(body: gs.Graph) -> bool:
    """True if a node of `body` holds a graph attribute (an If, a Loop, a Scan inside the step)."""
    return any(isinstance(v, gs.Graph) or (isinstance(v, list) and any(isinstance(x, gs.Graph) for x in v))
               for n in body.nodes for v in n.attrs.values())


# ---- carried values


def _carried_roles(graph: gs.Graph, inits: list, b_in: list, b_out: list, finals: list
                   ) -> tuple[dict, dict, list, dict]:
    """Roles of the carried values: (counters: k → start, for v + 1 from a constant; invariants: k → outer init,
    for values passed through; floats: the k of the float values, the state and possibly a copy of it; grown:
    k → axis, for stacks grown by one step each iteration). Values the body never reads and nobody reads after
    the loop (paddle2onnx carries every variable of a ``while``, written or not) have no role."""
    counters, invariants, floats, grown = {}, {}, [], {}
    for k, (vi, vo) in enumerate(zip(b_in, b_out)):
        if strip_identity(vo) is vi:
            invariants[k] = inits[k]
        elif _is_counter(vi, vo):
            start = const_value(inits[k])
            if start is None or start.size != 1:
                raise _Skip(f"counter {vi.name} starts at a value that is not constant")
            counters[k] = int(np.ravel(start)[0])
        elif not vi.outputs and not _used(graph, finals[k]):
            continue  # written each step, read by no one
        elif _grown_axis(vi, vo) is not None:
            grown[k] = _grown_axis(vi, vo)
        elif vi.dtype is not None and np.issubdtype(np.dtype(vi.dtype), np.floating):
            floats.append(k)
        else:
            raise _Skip(f"carried value {vi.name} has no known role")
    if not floats:
        raise _Skip("no recurrent state")
    if len(floats) > 2:
        raise _Skip(f"{len(floats)} recurrent values (not a GRU)")
    for k in counters:
        if _used(graph, finals[k]):
            raise _Skip(f"the final value of counter {b_in[k].name} is used")
    return counters, invariants, floats, grown


# ---- a copy of the body to probe


@dataclasses.dataclass
class _BodyCopy:
    """A throwaway copy of the body, constants in place of constant invariants and outer values.

    `inputs`: all of its inputs; `carried_in` / `carried_out`: its carried values; `scan_outs`: its stacked outputs;
    `outer_of`: id of a copy's tensor → the outer value it stands for (invariants, values read from outside);
    `t_sources`: (tensor, offset) with value t + offset at step t; `extra_leaves`: a Loop's condition (fed True)."""

    graph: gs.Graph
    inputs: list
    carried_in: list
    carried_out: list
    scan_outs: list
    outer_of: dict
    t_sources: list
    extra_leaves: list
    ranges: list = dataclasses.field(default_factory=list)  # outer Ranges probed by a long prefix of theirs

    @property
    def base_leaves(self) -> list:
        """The leaves every probe feeds with :meth:`t_feeds`: the step-time sources, then the extra leaves."""
        return [s for s, _ in self.t_sources] + self.extra_leaves

    def t_feeds(self, t: int) -> list[np.ndarray]:
        """Values of :attr:`base_leaves` at step t."""
        feeds = []
        for src, offset in self.t_sources:
            dt = np.dtype(src.dtype) if src.dtype is not None else np.dtype(np.int64)
            shape = tuple(d if isinstance(d, int) else 1 for d in (src.shape or []))
            feeds.append(np.full(shape, t + offset, dtype=dt))
        return feeds + [np.array(True)] * len(self.extra_leaves)


def _probe_copy(node: gs.Node, inits: list, counters: dict, invariants: dict) -> _BodyCopy:
    """A copy of the body to probe: constants in place of constant invariants and outer values; the step-time
    sources (the counters, and a Loop's iteration number)."""
    body: gs.Graph = node.attrs["body"]
    n_carried = len(inits)
    orig = body.tensors()
    bc = body.copy()
    c_in = list(bc.inputs)
    off = 2 if node.op == "Loop" else 0
    c_b_in = c_in[off:off + n_carried]
    outer_of, ranges = {id(c_b_in[k]): inits[k] for k in invariants}, []
    for t in bc.tensors().values():
        if not t.inputs and not isinstance(t, gs.Constant) and t.name and all(t is not x for x in c_in):
            if t.name in orig:
                outer_of[id(t)] = orig[t.name]
    for t in list(c_b_in) + [t for t in bc.tensors().values() if id(t) in outer_of]:
        if id(t) not in outer_of:
            continue
        v = const_value(outer_of[id(t)])
        if v is None and node.op == "Loop":
            v = _range_prefix(outer_of[id(t)])
            if v is not None:
                ranges.append(outer_of[id(t)])
        if v is not None:
            redirect_consumers(t, gs.Constant(f"{t.name}/const", np.asarray(v)))
    c_out = list(bc.outputs)
    c_b_out = c_out[(1 if node.op == "Loop" else 0):][:n_carried]
    c_scan_outs = c_out[(1 + n_carried if node.op == "Loop" else n_carried):]
    # step-time sources: (tensor, offset) with value t + offset at step t
    t_sources = [(c_b_in[k], counters[k]) for k in counters]
    extra_leaves = []
    if node.op == "Loop":
        t_sources.append((c_in[0], 0))
        extra_leaves.append(c_in[1])
    return _BodyCopy(bc, c_in, c_b_in, c_b_out, c_scan_outs, outer_of, t_sources, extra_leaves, ranges)


def _range_prefix(t: gs.Tensor) -> np.ndarray | None:
    """For an outer ``Range(start, limit, delta)`` of constant start and delta (paddle's ``arange`` over the steps
    that a ``while`` indexes by its counter): a prefix longer than any probe; _check_trip_count checks that the
    Range is at least as long as the Loop runs. Else None."""
    t = strip_identity(t)
    if len(t.inputs) != 1 or t.inputs[0].op != "Range":
        return None
    start, delta = const_value(t.inputs[0].inputs[0]), const_value(t.inputs[0].inputs[2])
    if start is None or delta is None or start.size != 1 or delta.size != 1 or float(np.ravel(delta)[0]) == 0:
        return None
    a, d = np.ravel(start)[0], np.ravel(delta)[0]
    return np.arange(a, a + 64 * d, d).astype(np.result_type(start, delta))[:64]


# ---- per-step inputs


def _per_step_inputs(node: gs.Node, copy: _BodyCopy, slice_srcs: list, in_axes: list, b_in: list, floats: list,
                     shapes: Shapes, opset: int, rng) -> tuple[_Step, _Step | None]:
    """The per-step inputs, Scan slices and reads S[t] / S[:, t] of outer values (checked on `rng`'s data):
    (x_t, the one wide input; the narrow one, if any). All float32, as the float carried values."""
    n_carried = len(b_in)
    steps: list[_Step] = []
    for sl, src, ax in zip(copy.inputs[n_carried:] if node.op == "Scan" else [], slice_srcs, in_axes):
        s = shapes.shape(src)
        if s is None or len(s) not in (2, 3) or (len(s) == 3 and not s[2]):
            raise _Skip(f"scanned input {src.name} of unknown rank or width")
        steps.append(_Step(sl, src, ax, 1 if len(s) == 2 else int(s[2]), len(s) - 1,
                           shapes.dtype(src) or np.dtype(np.float32), scanned=True))
    base_leaves = copy.base_leaves
    for rn in list(copy.graph.nodes):
        if rn.op not in ("Gather", "Slice") or not rn.inputs or id(rn.inputs[0]) not in copy.outer_of:
            continue
        src = copy.outer_of[id(rn.inputs[0])]
        if const_value(src) is not None:
            continue
        step = _read_step(rn, src, base_leaves, copy.t_feeds, shapes, opset, rng)
        if step is not None:
            steps.append(step)
    wide = [s for s in steps if s.width > 1]
    narrow = [s for s in steps if s.width == 1]
    if len(wide) != 1 or len(narrow) > 1:
        raise _Skip(f"{len(steps)} per-step inputs of widths {[s.width for s in steps]}")
    x_step, extra = wide[0], (narrow[0] if narrow else None)
    if x_step.dtype != np.float32 or any(np.dtype(b_in[k].dtype) != np.float32 for k in floats):
        raise _Skip("not float32")
    return x_step, extra


# ---- the cell


@dataclasses.dataclass
class _Cell:
    """The cell found in the body copy: its `match`, the tensor `new` that is its output, the carried value `state`
    it updates (of width H), the per-step score `att` and `mask` (None if absent), the copies of the state."""

    match: CellMatch
    new: gs.Tensor
    state: int
    H: int
    att: _Step | None
    mask: _Step | None
    aliases: list


def _search_cell(copy: _BodyCopy, x_step: _Step, extra: _Step | None, b_in: list, inits: list, floats: list,
                 shapes: Shapes, opset: int) -> tuple[CellMatch, gs.Tensor, int, _Step | None, int]:
    """The first tensor after the Tanh that reads as a GRU-family cell of one float carried value, the narrow
    per-step input (if any) as the attention score, else as none: (match, tensor, state, score step, H)."""
    options = [(k, a) for k in floats for a in ([extra] if extra is not None and extra.dtype != np.bool_ else [])
               + [None]]
    for state, att_step in options:
        H = _dim(b_in[state], -1, shapes) or _dim(inits[state], -1, shapes)
        if not H:
            continue
        for cand in _candidates(copy.graph, copy.carried_out[state], opset):
            cell = identify_gru_cell(cand, copy.carried_in[state], x_step.leaf, att_step.leaf if att_step else None,
                                     hidden=H, x_width=x_step.width, opset=opset,
                                     att_column=None if att_step else -2)
            if cell is not None:
                return cell, cand, state, att_step, H
    raise _Skip("no GRU-family cell found in the body")


def _find_cell(copy: _BodyCopy, x_step: _Step, extra: _Step | None, b_in: list, inits: list, floats: list,
               shapes: Shapes, opset: int) -> _Cell:
    """The cell (:func:`_search_cell`); a narrow per-step input that is not the score must be a 0/1 mask, and a
    second float value (Keras' previous output) a copy of the state: starting equal (updated alike: see _masking)."""
    match, new, state, att_step, H = _search_cell(copy, x_step, extra, b_in, inits, floats, shapes, opset)
    mask_step = extra if extra is not None and att_step is None else None
    if mask_step is not None and not _binary(mask_step.source, shapes):
        raise _Skip(f"per-step value {mask_step.source.name} is neither an attention score nor a 0/1 mask")
    aliases = [k for k in floats if k != state]
    for k in aliases:
        if not (inits[k] is inits[state] or (is_all_zeros(inits[k]) and is_all_zeros(inits[state]))):
            raise _Skip(f"a second recurrent value {b_in[k].name} that does not start as the state")
    return _Cell(match, new, state, H, att_step, mask_step, aliases)


# ---- masking and outputs


@dataclasses.dataclass
class _Outer:
    """Outer values the step reads besides its leaves: proven zeros and the sequence lengths, as (leaf, outer)."""

    zeros: list
    lens_c: list
    lens: gs.Tensor | None
    lens_rank: int


def _masking(copy: _BodyCopy, cell: _Cell, x_step: _Step, used_stacked: list, shapes: Shapes, opset: int,
             rng) -> tuple[_Outer, str]:
    """The masking and the outputs, by running the step: (its outer values, the padded_output of its stacked ones)."""
    step_leaves = [copy.carried_in[cell.state]] + [copy.carried_in[k] for k in cell.aliases] + [x_step.leaf] + \
        [s.leaf for s in (cell.att, cell.mask) if s is not None] + copy.base_leaves
    outs = [cell.new, copy.carried_out[cell.state]] + [copy.carried_out[k] for k in cell.aliases] + \
        [copy.scan_outs[j] for j in used_stacked]
    outer = _outer_values(Subgraph(outs, step_leaves, opset).unresolved, copy.outer_of, cell.mask, shapes)
    probe = Subgraph(outs, step_leaves + [u for u, _ in outer.zeros] + [u for u, _ in outer.lens_c], opset)
    if probe.unresolved:
        raise _Skip("the step uses values from outside")
    return outer, _padded_output(probe, copy, cell, x_step, outer, used_stacked, shapes, rng)


def _outer_values(unresolved: list, outer_of: dict, mask_step: _Step | None, shapes: Shapes) -> _Outer:
    """The values from outside that the step uses: each must be all zeros or (one of them) the sequence lengths,
    an integer or float tensor of rank 1 or [B, 1] (checked by the probe); not with a per-step mask."""
    zeros, lens_c = [], []
    for u in unresolved:
        outer = outer_of.get(id(u))
        if outer is None:
            raise _Skip(f"the step uses {u.name}, which is not an input of the loop")
        dt = shapes.dtype(outer)
        if is_all_zeros(outer):
            zeros.append((u, outer))
        elif dt is not None and (np.issubdtype(dt, np.integer) or np.issubdtype(dt, np.floating)):
            lens_c.append((u, outer))  # the lengths, if the probe agrees
        else:
            raise _Skip(f"the step uses {outer.name}, neither lengths nor zeros")
    if len({id(o) for _, o in lens_c}) > 1:
        raise _Skip("more than one candidate for the sequence lengths")
    lens = lens_c[0][1] if lens_c else None
    if lens is not None and mask_step is not None:
        raise _Skip("both lengths and a per-step mask")
    lens_rank = len(shapes.shape(lens) or [0]) if lens is not None else 0
    if lens is not None and lens_rank not in (1, 2):
        raise _Skip("sequence lengths of rank other than 1 or [B, 1]")
    return _Outer(zeros, lens_c, lens, lens_rank)


def _probe_feeds(t: int, copy: _BodyCopy, cell: _Cell, x_step: _Step, outer: _Outer, shapes: Shapes,
                 rng) -> tuple[np.ndarray, list, np.ndarray]:
    """Random values for the step at t (drawn from `rng` in the order of the leaves): (h, the feeds, valid), with
    valid [B, 1] = t < len, or m_t, or all true."""
    B, H = _PROBE_BATCH, cell.H
    hv = rng.normal(size=(B, H)).astype(np.float32)
    feeds = [hv] + [hv] * len(cell.aliases) + [rng.normal(size=(B, x_step.width)).astype(x_step.dtype)]
    if cell.att is not None:
        feeds.append(rng.uniform(0.05, 0.95, size=(B, 1) if cell.att.rank == 2 else (B,)).astype(cell.att.dtype))
    valid = np.ones((B, 1), bool)
    if cell.mask is not None:
        mv = rng.random(B) < 0.5
        mv[:2] = [True, False]
        valid = mv[:, None]
        feeds.append(mv.reshape((B, 1) if cell.mask.rank == 2 else (B,)).astype(cell.mask.dtype))
    feeds += copy.t_feeds(t)
    for u, o in outer.zeros:
        rank = len(shapes.shape(o) or [0, 0])
        feeds.append(np.zeros((B, H) if rank == 2 else (H,) if rank == 1 else (B,) + (1,) * (rank - 1),
                              dtype=shapes.dtype(o) or np.float32))
    if outer.lens is not None:
        lens_float = np.issubdtype(shapes.dtype(outer.lens), np.floating)
        lv = np.array([0, t, t + 1, t + 5, max(t - 1, 0), 1] + ([t + 0.5, t - 0.5] if lens_float else [t + 2, -1]))
        valid = (t < lv)[:, None]
        feeds += [lv.reshape((B,) if outer.lens_rank == 1 else (B, 1)).astype(shapes.dtype(o))
                  for _, o in outer.lens_c]
    return hv, feeds, valid


def _padded_output(probe: Subgraph, copy: _BodyCopy, cell: _Cell, x_step: _Step, outer: _Outer, used_stacked: list,
                   shapes: Shapes, rng) -> str:
    """Runs the step at t = 0, 3, 7: the new state (and its copies) must be where(valid, cell, h) (the cell's output
    if nothing masks), each used stacked output where(valid, cell, 0) ("zero") or where(valid, cell, h) ("state");
    the padded_output that all of them agree on ("zero" first)."""
    B, H = _PROBE_BATCH, cell.H
    masked = outer.lens is not None or cell.mask is not None
    padded = {j: {"zero", "state"} for j in used_stacked}
    for t in (0, 3, 7):
        hv, feeds, valid = _probe_feeds(t, copy, cell, x_step, outer, shapes, rng)
        try:
            vals = probe.run(feeds)
        except Exception as e:
            raise _Skip(f"the step does not run on probe values ({str(e).splitlines()[0][:120]})") from None
        c = np.asarray(vals[0], np.float32).reshape(B, H)
        kept = np.where(valid, c, hv)
        for v in vals[1:2 + len(cell.aliases)]:
            if not np.allclose(np.asarray(v, np.float32).reshape(B, H), kept, atol=1e-6, rtol=1e-6):
                raise _Skip("the new state is not where(valid step, cell, h)" if masked
                            else "the new state is not the cell's output")
        for j, y in zip(used_stacked, vals[2 + len(cell.aliases):]):
            y = np.asarray(y, np.float32).reshape(B, H)
            if not np.allclose(y, np.where(valid, c, 0.0), atol=1e-6, rtol=1e-6):
                padded[j].discard("zero")
            if not np.allclose(y, kept, atol=1e-6, rtol=1e-6):
                padded[j].discard("state")
    kinds = set.intersection(*padded.values()) if padded else {"zero", "state"}
    if not kinds:
        raise _Skip("padded steps' outputs are neither zeros nor the kept state")
    return "zero" if "zero" in kinds else "state"


# ---- all per-step inputs span the same steps (a Loop runs exactly that many: _check_trip_count)


def _steps_to_trim(x_step: _Step, others: tuple, T_static: int | None, shapes: Shapes) -> list[int]:
    """ids of the per-step inputs among `others` (score, mask) read from a tensor that may be longer than the input:
    they are cut to its length. One known to be shorter is a _Skip."""
    trim = []
    for other in others:
        if other is None or (other.scanned and x_step.scanned):
            continue
        To = _dim(other.source, other.time_axis, shapes)
        if To is not None and T_static is not None:
            if To < T_static:
                raise _Skip(f"{other.source.name} is shorter than the input")
            same = To == T_static
        else:
            same = _dim_key(other.source, other.time_axis, shapes) == _dim_key(x_step.source, x_step.time_axis,
                                                                              shapes)
        if not same:
            trim.append(id(other))
    return trim


def _binary(t: gs.Tensor, shapes: Shapes, depth: int = 0) -> bool:
    """True if `t` holds only 0/1 by construction: a boolean, or a Cast of one (through layout ops)."""
    if shapes.dtype(t) == np.bool_:
        return True
    if depth > 12 or len(t.inputs) != 1:
        return False
    n = t.inputs[0]
    if n.op in ("Transpose", "Reshape", "Unsqueeze", "Squeeze", "Identity", "Expand", "Flatten", "Cast") and n.inputs:
        return _binary(n.inputs[0], shapes, depth + 1)
    return False


def _read_step(rn: gs.Node, src: gs.Tensor, base_leaves, t_feeds, shapes: Shapes, opset: int, rng) -> _Step | None:
    """`rn` reads step t of `src`: the read (extended through reshapes) as a _Step, checked numerically."""
    s = shapes.shape(src)
    if s is None or len(s) not in (2, 3):
        return None
    r = rn.outputs[0]
    while len(r.outputs) == 1 and r.outputs[0].op in _RESHAPES and r.outputs[0].inputs[0] is r and \
            all(const_value(t) is not None for t in r.outputs[0].inputs[1:]):
        r = r.outputs[0].outputs[0]
    data = rn.inputs[0]
    dtype = shapes.dtype(src) or np.dtype(np.float32)
    probe = Subgraph([r], [data] + base_leaves, opset, dtypes=[dtype])
    if probe.unresolved:
        return None
    free = iter((5, 7, 9))
    dims = [d if d is not None else next(free) for d in s]
    found = None
    for t in (0, 1, 2):
        if t >= min(dims[:2]):
            break
        value = rng.normal(size=dims)
        value = (value > 0) if dtype == np.bool_ else value.astype(dtype)
        try:
            (got,) = probe.run([value] + t_feeds(t))
        except Exception:
            return None
        matches = []
        for axis in (0, 1):
            want = np.take(value, t, axis=axis)
            rows = want.shape[0]
            if got.size == want.size and got.shape[:1] == (rows,) and np.array_equal(got.reshape(rows, -1),
                                                                                     want.reshape(rows, -1)):
                matches.append(axis)
        if len(matches) != 1 or (found is not None and matches[0] != found):
            return None
        found = matches[0]
        rank = got.ndim
    if found is None or rank not in (1, 2):
        return None
    width = 1 if len(s) == 2 else s[2]
    if not width:
        return None
    return _Step(r, src, found, int(width), rank, dtype)


def _candidates(bc: gs.Graph, h_out: gs.Tensor, opset: int) -> list[gs.Tensor]:
    """Tensors after the Tanh on the way to the new state: the cell's output is one of them (Adds first)."""
    upstream = {id(t) for n in Subgraph([h_out], [], opset).nodes for t in n.outputs}
    found, seen = [], set()
    frontier = [n.outputs[0] for n in bc.nodes if n.op == "Tanh"]
    for depth in range(6):
        nxt = []
        for t in frontier:
            for c in t.outputs:
                for o in c.outputs:
                    if id(o) in seen:
                        continue
                    seen.add(id(o))
                    nxt.append(o)
                    if id(o) in upstream:
                        found.append((c.op not in ("Add", "Sub", "Sum"), depth, o))
        frontier = nxt
    found.sort(key=lambda f: (f[0], f[1]))
    return [o for _, _, o in found[:_MAX_CANDIDATES]]


def _check_trip_count(node, body, counters, invariants, inits, shapes: Shapes, x_step: _Step, T_static,
                      ranges: tuple = ()):
    """The Loop runs exactly T = (length of the read input) iterations: M, the initial and the body's condition;
    each outer Range the step reads (`ranges`) holds at least T values."""
    hyps = [int(T_static)] if T_static is not None else [7, 12]
    time_key = _dim_key(x_step.source, x_step.time_axis, shapes)
    b_in = body.inputs[2:]
    for T in hyps:
        folder = _Folder(shapes, time_key, T)
        try:
            M = int(np.ravel(folder.value(node.inputs[0], {}, {}))[0]) if node.inputs[0].name else None
            run = bool(np.ravel(folder.value(node.inputs[1], {}, {}))[0]) if node.inputs[1].name else True
            count, i = 0, 0
            run = run and (M is None or M > 0)
            while run and count <= T + 1:
                count += 1
                env = {id(body.inputs[0]): np.array(i, np.int64), id(body.inputs[1]): np.array(True)}
                for k, start in counters.items():
                    dt = np.dtype(b_in[k].dtype) if b_in[k].dtype is not None else np.int64
                    env[id(b_in[k])] = np.array(start + i, dt)
                for k in invariants:
                    env[id(b_in[k])] = inits[k]
                cond = bool(np.ravel(folder.value(body.outputs[0], env, {}))[0])
                i += 1
                run = cond and (M is None or i < M)
            short = [r.name for r in ranges if np.size(folder.value(r, {}, {})) < T]
        except (_Unknown, ValueError, TypeError, IndexError, KeyError, RecursionError) as e:
            raise _Skip(f"cannot tell how many times the Loop runs ({type(e).__name__} {e})") from None
        if count != T:
            raise _Skip(f"the Loop runs {count} times over {T} steps")
        if short:
            raise _Skip(f"the step reads {short[0]}, shorter than the {T} steps")


# ------------------------------------------------------------------------------------------ rewriting


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
