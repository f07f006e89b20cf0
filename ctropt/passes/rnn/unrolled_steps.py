"""Phases 1-3 of unrolled.py: the step slices of sequence tensors (`_Group`), the level of every value, and the
chain of states whose steps all compute the same cell (`_Steps`: found and compared op by op)."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_graphsurgeon as gs

from ...graph.edit import axes_of, const_value
from ...graph.shapes import Shapes
from ...ops.rnn import SequenceAttrs
from .cell import CellMatch
from .values import _ints, _present


MIN_STEPS = 3          # shorter unrolled loops are left alone
MAX_STEP_NODES = 4000  # nodes one step's comparison may visit


class _Miss(Exception):
    """A chain that does not read completely: the phase that stopped it."""


@dataclasses.dataclass
class _Group:
    """Step slices of one sequence tensor: steps[t] are the values of step t."""

    key: tuple
    source: gs.Tensor
    axis: int
    squeezed: bool             # the slices drop the time axis
    steps: dict                # t -> list of tensors
    nodes: dict                # id(tensor) -> nodes from the source to it


def _step_slices(graph: gs.Graph, shapes: Shapes) -> list[_Group]:
    """Every (source, step) slice along axis 1 of the main graph, grouped by source."""
    groups: dict[tuple, _Group] = {}

    def add(source, axis, t, out, squeezed, nodes):
        if squeezed is False and len(out.outputs) == 1:
            u = out.outputs[0]
            if u.op == "Squeeze" and u.inputs[0] is out and axes_of(u) is not None:
                rank = shapes.rank(source)
                axes = axes_of(u)
                if len(axes) == 1 and (axes[0] == axis or (rank is not None and axes[0] % rank == axis)):
                    out, squeezed, nodes = u.outputs[0], True, nodes + [u]
        if axis == 0 and not squeezed:
            return  # time-major steps drop the time axis: [1, B, ...] slices are not step inputs
        key = (id(source), axis, squeezed)
        g = groups.setdefault(key, _Group(key, source, axis, squeezed, {}, {}))
        g.steps.setdefault(t, []).append(out)
        g.nodes[id(out)] = nodes

    for n in graph.nodes:
        if not n.inputs or not n.outputs:
            continue
        src = n.inputs[0]
        if const_value(src) is not None:
            continue
        if n.op == "Gather" and len(n.inputs) == 2:
            axis = _time_axis(int(n.attrs.get("axis", 0)), src, shapes)
            idx = const_value(n.inputs[1])
            if axis is None or idx is None or idx.dtype.kind not in "iu" or idx.size != 1 or int(idx.ravel()[0]) < 0:
                continue
            add(src, axis, int(idx.ravel()[0]), n.outputs[0], idx.ndim == 0, [n])
        elif n.op == "Slice" and len(n.inputs) >= 4:
            starts, ends, axes = _ints(n.inputs[1]), _ints(n.inputs[2]), _ints(n.inputs[3])
            steps = _ints(n.inputs[4]) if len(n.inputs) > 4 and _present(n.inputs[4]) else [1]
            if None in (starts, ends, axes, steps) or len(starts) != 1 or len(ends) != 1 or len(axes) != 1:
                continue
            axis = _time_axis(axes[0], src, shapes)
            if steps != [1] or axis is None or starts[0] < 0 or ends[0] != starts[0] + 1:
                continue
            add(src, axis, starts[0], n.outputs[0], False, [n])
        elif n.op == "Split" and len(n.outputs) >= MIN_STEPS:
            axis = _time_axis(int(n.attrs.get("axis", 0)), src, shapes)
            if axis is None:
                continue
            k = len(n.outputs)
            sizes = _ints(n.inputs[1]) if len(n.inputs) > 1 and _present(n.inputs[1]) else n.attrs.get("split")
            if sizes is None:
                shape = shapes.shape(src)
                ok = shape is not None and len(shape) > 1 and shape[axis] == k
            else:
                ok = list(sizes) == [1] * k
            if ok:
                for t, o in enumerate(n.outputs):
                    add(src, axis, t, o, False, [n])
    return list(groups.values())


def _time_axis(axis: int, t: gs.Tensor, shapes: Shapes) -> int | None:
    """The time axis a slice along `axis` of `t` steps over: 1 (batch-major [B, T, ...]), 0 (time-major
    [T, B, ...], rank 3: paddle2onnx's transpose-then-slice loops), else None."""
    axis = _norm_axis(axis, t, shapes)
    if axis == 1 or (axis == 0 and shapes.rank(t) == 3):
        return axis
    return None


def _norm_axis(axis: int, t: gs.Tensor, shapes: Shapes) -> int | None:
    if axis >= 0:
        return axis
    rank = shapes.rank(t)
    return None if rank is None else axis % rank


@dataclasses.dataclass
class _Chain:
    T: int
    states: list                # s_0 .. s_{T-1}
    h0: gs.Tensor               # the state before step 0
    nodes: list                 # per step, the nodes of its cell


@dataclasses.dataclass
class _Cell:
    """The cell every step of a chain computes, read from step 1, and the step groups it reads."""

    attrs: SequenceAttrs        # padded_output set by the masking
    match: CellMatch            # the weights, as identify_gru_cell read them
    x_group: _Group
    att_group: _Group | None
    mask_group: _Group | None
    invert: bool                # the mask is the negation of the Where's condition
    H: int
    I: int
    mask_form: str = "Where"    # "Where", or "blend" (m * h_new + (1 - m) * h)


class _Steps:
    """The step slices of one length T and the level of every value (the highest step whose slices it depends
    on), with the walks over them that find and compare the steps of a chain."""

    def __init__(self, T: int, groups: list[_Group], order: list[gs.Node]):
        self.T, self.groups = T, groups
        self.step_of: dict[int, tuple] = {}      # id(tensor) -> (t, role)
        for gi, g in enumerate(groups):
            for t, outs in g.steps.items():
                for o in outs:
                    self.step_of[id(o)] = (t, gi)
        self.level: dict[int, int] = {}
        for n in order:
            lv = -1
            for i in n.inputs:
                x = self.level.get(id(i), -1)
                if x > lv:
                    lv = x
            for o in n.outputs:
                s = self.step_of.get(id(o))
                self.level[id(o)] = s[0] if s is not None else lv

    def lvl(self, t: gs.Tensor) -> int:
        return self.level.get(id(t), -1)

    # ---- finding the chain

    def state_before(self, tanh: gs.Node, L: int) -> gs.Tensor | None:
        """s_{L-2}: the level L-2 value that every level L-2 value read on the way to step L's Tanh derives from."""
        want, boundary, seen = L - 2, [], set()
        stack = list(tanh.inputs)
        while stack:
            t = stack.pop()
            if id(t) in seen:
                continue
            seen.add(id(t))
            if len(seen) > MAX_STEP_NODES:
                return None
            lv = self.lvl(t)
            if lv < 0 or const_value(t) is not None:
                continue
            if id(t) in self.step_of:
                if self.step_of[id(t)][0] < L - 1:
                    return None
                continue
            if lv == want:
                boundary.append(t)
                continue
            if lv < want or not t.inputs:
                return None
            stack.extend(t.inputs[0].inputs)
        for r in boundary:
            if all(b is r or self._derives(b, r) for b in boundary):
                return r
        return None

    def _derives(self, b: gs.Tensor, r: gs.Tensor) -> bool:
        seen, stack = set(), [b]
        while stack:
            t = stack.pop()
            if t is r or id(t) in seen:
                continue
            seen.add(id(t))
            if const_value(t) is not None or self.lvl(t) < 0:
                continue
            if id(t) in self.step_of or not t.inputs or len(seen) > MAX_STEP_NODES:
                return False
            stack.extend(t.inputs[0].inputs)
        return True

    def path_to_step(self, out: gs.Tensor, step: int):
        """The shortest producer path from a slice of `step` to `out`: (role tensor, hops)."""
        from collections import deque

        prev = {id(out): None}
        queue = deque([out])
        while queue:
            t = queue.popleft()
            s = self.step_of.get(id(t))
            if s is not None:
                if s[0] != step:
                    continue
                hops, cur = [], t
                while prev[id(cur)] is not None:
                    node, idx, nxt = prev[id(cur)]
                    hops.append((node.op, idx, _index(node.outputs, nxt)))
                    cur = nxt
                return t, hops
            if const_value(t) is not None or not t.inputs or len(prev) > MAX_STEP_NODES:
                continue
            node = t.inputs[0]
            for i, x in enumerate(node.inputs):
                if id(x) not in prev:
                    prev[id(x)] = (node, i, t)
                    queue.append(x)
        return None

    @staticmethod
    def follow(start: gs.Tensor, hops) -> list[gs.Tensor]:
        """The values reached from `start` along `hops` (consumer op, input index, output index), at most 16."""
        cur = [start]
        for op, idx, out_idx in hops:
            nxt = []
            for t in cur:
                for c in t.outputs:
                    if c.op == op and idx < len(c.inputs) and c.inputs[idx] is t and out_idx < len(c.outputs):
                        if all(c.outputs[out_idx] is not x for x in nxt):
                            nxt.append(c.outputs[out_idx])
            cur = nxt[:16]
        return cur

    # ---- comparing steps

    def match(self, ref_out, ref_step, ref_h, cand_out, cand_step, cand_h):
        """Compare step `cand_step` (from cand_out back) with step `ref_step`: same ops, attributes, constants,
        slices of the same sequences, shared outer values; the state before each step (ref_h, cand_h) is a leaf
        (cand_h None: bound here). Returns (ref nodes, cand nodes, cand_h) or None."""
        pairs, back, node_pairs = {}, {}, {}
        ref_nodes, cand_nodes = [], []
        stack = [(ref_out, cand_out)]
        while stack:
            r, c = stack.pop()
            if id(r) in pairs:
                if pairs[id(r)] is not c:
                    return None
                continue
            if id(c) in back and back[id(c)] is not r:
                return None
            pairs[id(r)], back[id(c)] = c, r
            if len(pairs) > MAX_STEP_NODES:
                return None
            if r is ref_h or (cand_h is not None and c is cand_h):
                if r is not ref_h:
                    return None
                if cand_h is None:
                    if id(c) in self.step_of or c is ref_out:
                        return None
                    cand_h = c
                elif c is not cand_h:
                    return None
                continue
            if r is c:  # a value from outside the steps, read by both
                if id(r) in self.step_of or self.lvl(r) >= 0:
                    return None
                continue
            sr, sc = self.step_of.get(id(r)), self.step_of.get(id(c))
            if sr is not None or sc is not None:
                if sr is None or sc is None or sr[0] != ref_step or sc[0] != cand_step or sr[1] != sc[1]:
                    return None
                continue
            vr, vc = const_value(r), const_value(c)
            if vr is not None or vc is not None:
                if (vr is None or vc is None or vr.dtype != vc.dtype or vr.shape != vc.shape
                        or not np.array_equal(vr, vc)):
                    return None
                continue
            if not r.name or not c.name:
                if r.name or c.name:
                    return None
                continue
            if len(r.inputs) != 1 or len(c.inputs) != 1:
                return None
            pr, pc = r.inputs[0], c.inputs[0]
            if id(pr) in node_pairs:
                if node_pairs[id(pr)] is not pc or _index(pr.outputs, r) != _index(pc.outputs, c):
                    return None
                continue
            if (pr.op != pc.op or pr.domain != pc.domain or len(pr.inputs) != len(pc.inputs)
                    or len(pr.outputs) != len(pc.outputs) or _index(pr.outputs, r) != _index(pc.outputs, c)
                    or not _same_attrs(pr.attrs, pc.attrs)):
                return None
            node_pairs[id(pr)] = pc
            ref_nodes.append(pr)
            cand_nodes.append(pc)
            stack.extend(zip(pr.inputs, pc.inputs))
        if cand_h is None:
            return None
        return ref_nodes, cand_nodes, cand_h

    def leaves(self, out: gs.Tensor, h: gs.Tensor, step: int) -> dict | None:
        """The step slices the cell from (h, step slices) to `out` reads: group index -> slice, in order of use."""
        found, seen, stack = {}, set(), [out]
        while stack:
            t = stack.pop()
            if t is h or id(t) in seen:
                continue
            seen.add(id(t))
            st = self.step_of.get(id(t))
            if st is not None:
                if st[0] != step or (st[1] in found and found[st[1]] is not t):
                    return None
                found[st[1]] = t
                continue
            if const_value(t) is not None:
                continue
            if not t.inputs or len(seen) > MAX_STEP_NODES:
                return None
            stack.extend(t.inputs[0].inputs)
        return found


def _index(items, x) -> int:
    return next(i for i, y in enumerate(items) if y is x)


def _same_attrs(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for k, x in a.items():
        y = b[k]
        if isinstance(x, (gs.Graph,)) or isinstance(y, gs.Graph):
            return False
        if isinstance(x, gs.Constant) or isinstance(y, gs.Constant):
            if not (isinstance(x, gs.Constant) and isinstance(y, gs.Constant)):
                return False
            if x.values.dtype != y.values.dtype or not np.array_equal(x.values, y.values):
                return False
            continue
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            if not np.array_equal(np.asarray(x), np.asarray(y)):
                return False
            continue
        if x != y:
            return False
    return True
