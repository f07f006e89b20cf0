"""Phase 1 of loops.py: the roles of a recurrent body's carried values (counters, invariants, the float state)
and its per-step inputs (Scan slices, or reads `S[t]` / `S[:, t]` of an outer tensor), on a throwaway copy of
the body."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_graphsurgeon as gs

from ...graph.edit import const_value, redirect_consumers
from ...graph.shapes import Shapes
from ...runtime.subgraph import Subgraph
from ...graph import strip_identity
from .loop_plan import _Skip, _Step


_RESHAPES = ("Squeeze", "Unsqueeze", "Reshape", "Flatten", "Identity")


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
