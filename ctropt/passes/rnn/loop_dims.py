"""Sizes in and around a recurrent Scan/Loop: a dimension followed back through the ops that keep it, small
integer computations folded in numpy (`_Folder`), and the trip count a Loop runs (phase 4 of loops.py)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from ...graph.edit import axes_of, const_value
from ...graph.shapes import Shapes
from ...ops.rnn import is_sequence_node
from ...graph import strip_identity
from .loop_plan import _Skip, _Step


_SAME_SHAPE = {"Identity", "Cast", "Relu", "Sigmoid", "Tanh", "Neg", "Abs", "Exp", "Log", "Sqrt", "Erf", "Softsign",
               "Not", "Softmax"}
_BROADCAST = {"Add", "Sub", "Mul", "Div", "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "And", "Or",
              "Pow", "Max", "Min"}


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

    def _args(self, n: gs.Node, env, memo):
        """`arg(i)`: the folded value of `n`'s input i (None where absent); a shape with unknown dims only where
        the op can pass them on."""
        def arg(i):
            if i >= len(n.inputs) or not n.inputs[i].name:
                return None
            v = self.value(n.inputs[i], env, memo)
            if v.dtype == object and any(x is None for x in v.ravel()):
                if n.op not in ("Gather", "Slice", "Squeeze", "Unsqueeze", "Concat", "Identity", "Reshape", "Cast") \
                        or (i > 0 and n.op != "Concat"):
                    raise _Unknown(n.name)
            return v

        return arg

    def _op(self, n: gs.Node, env, memo):
        """The value `n` computes: arithmetic, comparisons and logic, Range and Shape here, indexing and
        reshaping in `_indexing`."""
        arg = self._args(n, env, memo)
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
        if op in ("Gather", "Slice", "Squeeze", "Unsqueeze", "Concat", "Reshape"):
            return self._indexing(n, arg)
        raise _Unknown(op)

    @staticmethod
    def _indexing(n: gs.Node, arg):
        """Gather, Slice, Squeeze, Unsqueeze, Concat and Reshape of folded values."""
        op, a = n.op, n.attrs
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
