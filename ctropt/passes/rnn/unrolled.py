"""Recurrent layers → one ai.ctropt sequence node: the ONNX GRU op, and GRU-family cells unrolled over time.

:func:`fuse_gru_ops` turns each ONNX ``GRU`` node (forward, one layer, default activations, no clip) into a
``GRUSequence``: weights in the canonical layout (W [I, 3H] = W_onnx[0].T, R = R_onnx[0].T, B = B_onnx[0]),
``sequence_lens`` carried as is, with lengths_checked (the GRU op rejects lengths outside [0, T]; the op's "zero"
padded output is the GRU op's own meaning; with an initial_h, onnxruntime's GRU gives rows of length 0 the state 0,
which a Where keeps). The time-major glue exporters write around the op (Transpose [B,T,I]→[T,B,I] before, Squeeze
of the direction axis and Transpose back after, dynamo's Transpose/Reshape/Transpose) is absorbed; where it cannot
be, a Transpose/Unsqueeze makes the value the old consumers expect.

:func:`fuse_unrolled_cells` finds a GRU-family cell exported once per step of a Python loop (PyTorch,
paddle2onnx):

1. *step slices*: Gather(S, t, axis=1), Slice(S, t, t+1, axis 1) (+ Squeeze) or Split(S, axis 1) over every
   t in 0..T-1 of a sequence tensor S; each slice is a step input (x_t, the attention a_t, the mask m_t); x_t
   may also be a time-major step, the same ops along axis 0 of S [T, B, I] with the time axis dropped
   (paddle2onnx transposes the sequence, then slices and squeezes); a_t may be a step of a [B, T, 1] sequence
   (torch-rechub's DIEN: ``att.unsqueeze(-1)``). B is whatever rows S holds: torch-rechub selects the rows with a
   history first (NonZero → GatherND), so its steps run over N data-dependent rows, and so does the fused op;
2. *levels*: each value gets the highest step whose slices it depends on; the state s_t that the cells pass on
   is the one level-t value every level-t value that step t+2 reads derives from (the dominator of the chain);
3. *same cell every step*: each step's subgraph (from s_t back to s_{t-1}, its step slices, constants and shared
   values) is compared op by op, attribute by attribute and constant by constant with step 1's; step 0 binds
   the initial state;
4. *meaning*: the masking (``Where(m_t, h_new, s_{t-1})`` → ``mask`` = the mask's sequence tensor, padded output
   "state"; or FuxiCTR's DIEN blend m_t * h_new + (1 - m_t) * s_{t-1} of a bool mask cast to float, [B, T, 1]) is
   peeled off and :func:`ctropt.passes.rnn.cell.identify_gru_cell` reads step 1's cell
   (kind, linear_before_reset, att_keep, weights); a numeric check of the first steps (the exported nodes,
   slices included, against :func:`ctropt.ops.rnn.reference`, rows masked fully, partly and not at all) guards
   the rewrite.

The chain becomes one sequence node over the slices' sources (a time-major one transposed back): the last state
becomes Y_h, states stacked with Unsqueeze + Concat(axis 1) (or SequenceConstruct + ConcatFromSequence) become
Y; stacked along axis 0 (paddle2onnx: one Concat per step grown from an empty tensor) they become Y transposed.
A GRU cell over a_t * x_t is an AIGRU. A chain that is not read completely (other masking, other state readers,
shapes unknown) stays as is, and `notes` says which phase stopped it.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_graphsurgeon as gs

from ...graph import topological_order
from ...ops.rnn import SequenceAttrs, add_sequence_node, reference
from .cell import CellMatch, identify_gru_cell
from ...graph.edit import Builder, axes_of, const_value, is_all_zeros, unique_name
from ...graph.shapes import Shapes
from ...runtime.subgraph import Subgraph

MIN_STEPS = 3          # shorter unrolled loops are left alone
MAX_STEP_NODES = 4000  # nodes one step's comparison may visit
CHECK_STEPS = 3        # steps run in the numeric check
CHECK_TOL = 1e-4


# ----------------------------------------------------------------------------------------- shared helpers


def _ints(t: gs.Tensor | None) -> list[int] | None:
    if t is None:
        return None
    v = const_value(t)
    if v is None or v.dtype.kind not in "iu":
        return None
    return [int(x) for x in np.asarray(v).ravel()]


def _present(t: gs.Tensor | None) -> bool:
    return t is not None and bool(t.name)


def _take_over(t: gs.Tensor) -> gs.Tensor:
    """Detach `t` from its producer so a new node can write it (its name and readers stay)."""
    t.inputs.clear()
    return t


# ----------------------------------------------------------------------------------------- the ONNX GRU op


def fuse_gru_ops(graph: gs.Graph, opset: int) -> list[str]:
    """ONNX GRU nodes (forward, one layer, default activations, no clip) → GRUSequence. Returns what was fused."""
    done: list[str] = []
    shapes = Shapes(graph, symbolic=True)
    ordered = topological_order(list(graph.nodes))
    for node in [n for n in ordered if n.op == "GRU" and n.domain in (None, "", "ai.onnx")]:
        what = _fuse_gru_op(graph, node, opset, shapes)
        if what:
            done.append(what)
    if done:
        graph.cleanup(remove_unused_graph_inputs=False)
        graph.toposort(mode="nodes")  # "full" recurses forever on graphs with If/Loop plus functions (gs 0.6.1)
    return done


def _gru_op_weights(node: gs.Node):
    a = node.attrs
    if a.get("direction", "forward") not in ("forward", b"forward"):
        return None
    acts = a.get("activations")
    if acts is not None and [str(x).lower() for x in acts] != ["sigmoid", "tanh"]:
        return None
    if a.get("clip") is not None or a.get("activation_alpha") or a.get("activation_beta"):
        return None
    if len(node.inputs) < 3:
        return None
    W, R = const_value(node.inputs[1]), const_value(node.inputs[2])
    if W is None or R is None or W.ndim != 3 or R.ndim != 3 or W.shape[0] != 1 or R.shape[0] != 1:
        return None
    H = int(R.shape[2])
    if int(a.get("hidden_size", H)) != H or W.shape[1] != 3 * H or R.shape[1] != 3 * H:
        return None
    B = np.zeros(6 * H, np.float32)
    if len(node.inputs) > 3 and _present(node.inputs[3]):
        b = const_value(node.inputs[3])
        if b is None or b.shape != (1, 6 * H):
            return None
        B = b[0]
    if W.dtype != np.float32 or R.dtype != np.float32:
        return None
    return H, np.ascontiguousarray(W[0].T), np.ascontiguousarray(R[0].T), np.asarray(B, np.float32)


def _fuse_gru_op(graph: gs.Graph, node: gs.Node, opset: int, shapes: Shapes) -> str | None:
    weights = _gru_op_weights(node)
    if weights is None:
        return None
    H, W, R, B = weights
    layout = int(node.attrs.get("layout", 0))
    lbr = int(node.attrs.get("linear_before_reset", 0))
    ins = list(node.inputs) + [gs.Variable.empty()] * (6 - len(node.inputs))
    X, lens, h0 = ins[0], ins[4], ins[5]
    outs = list(node.outputs) + [gs.Variable.empty()] * (2 - len(node.outputs))
    graph_outputs = {id(t) for t in graph.outputs}
    used = [_present(t) and (bool(t.outputs) or id(t) in graph_outputs) for t in outs]
    if not any(used):
        return None
    b = Builder(graph, node.name or "gru", opset=opset)

    # X, batch-major
    if layout == 1:
        Xb = X
    elif len(X.inputs) == 1 and X.inputs[0].op == "Transpose" and list(X.inputs[0].attrs.get("perm", [])) == [1, 0, 2]:
        Xb = X.inputs[0].inputs[0]
    else:
        Xb = b.op("Transpose", [X], {"perm": [1, 0, 2]}, dtype=np.float32)
    # initial_h, [B, H]
    hb = None
    if _present(h0) and not is_all_zeros(h0):
        axis = 0 if layout == 0 else 1
        p = h0.inputs[0] if len(h0.inputs) == 1 else None
        if p is not None and p.op == "Unsqueeze" and axes_of(p) in ([axis], [axis - 3]):
            hb = p.inputs[0]
        else:
            hb = b.axes_op("Squeeze", h0, [axis], dtype=np.float32)

    # lengths_checked: the GRU op raises on lengths outside [0, T] ("Invalid value/s in sequence_lens"), so does the op
    attrs = SequenceAttrs("GRU", H, lbr, 0, "zero", lengths_checked=int(_present(lens)))
    inputs = {"X": Xb, "W": b.const("W", W), "R": b.const("R", R), "B": b.const("B", B)}
    if _present(lens):
        inputs["sequence_lens"] = lens
    if hb is not None:
        inputs["initial_h"] = hb
    Y, Y_h = outs[0], outs[1]
    outputs = {}
    y_labels = ["T", "D", "B", "H"] if layout == 0 else ["B", "T", "D", "H"]
    yh_labels = ["D", "B", "H"] if layout == 0 else ["B", "D", "H"]
    plans = []
    if used[0]:
        tgt, labels = _follow_layout(graph, Y, y_labels, shapes, opset)
        plans.append(("Y", tgt, labels, ["B", "T", "H"]))
    if used[1]:
        tgt, labels = _follow_layout(graph, Y_h, yh_labels, shapes, opset)
        plans.append(("Y_h", tgt, labels, ["B", "H"]))
    glue = []
    for key, tgt, labels, canon in plans:
        if labels == canon:
            outputs[key] = _take_over(tgt)
        else:
            fresh = gs.Variable(unique_name(graph, f"{node.name or 'gru'}/{key}"), dtype=np.float32)
            outputs[key] = fresh
            glue.append((fresh, tgt, labels, canon))
    name = unique_name(graph, f"{node.name or 'gru'}/GRUSequence")
    # the GRU node goes away now: its outputs may be taken over below
    graph.nodes = [n for n in graph.nodes if n is not node]
    node.inputs.clear()
    node.outputs.clear()
    final_h = None
    if "Y_h" in outputs and _present(lens) and hb is not None:
        # onnxruntime's GRU gives rows of length 0 the state 0, not initial_h: keep that
        final_h, outputs["Y_h"] = outputs["Y_h"], gs.Variable(unique_name(graph, f"{name}/Y_h"), dtype=np.float32)
    add_sequence_node(graph, attrs, inputs, outputs, name)
    if final_h is not None:
        some = b.op("Greater", [lens, b.const("zero_len", np.zeros(1, shapes.dtype(lens) or np.int32))],
                    dtype=np.bool_)
        some = b.axes_op("Unsqueeze", some, [1], dtype=np.bool_)
        b.op("Where", [some, outputs["Y_h"], b.const("zero_state", np.zeros(1, np.float32))], out=final_h)
    for fresh, tgt, labels, canon in glue:
        _make_layout(b, fresh, canon, tgt, labels)
    how = "absorbed" if not glue else "kept as Transpose/Unsqueeze for other readers"
    lens_note = ", sequence_lens" if "sequence_lens" in inputs else ""
    h0_note = ", initial_h" if hb is not None else ""
    return (f"GRU '{node.name}' → GRUSequence (H={H}, linear_before_reset={lbr}{lens_note}{h0_note}; "
            f"time-major layout {how})")


def _follow_layout(graph: gs.Graph, t: gs.Tensor, labels: list[str], shapes: Shapes, opset: int):
    """Walk from a GRU output through the ops that only drop the direction axis or permute axes (each value read
    by that op alone, or by Shape nodes that feed only that op's shape): the furthest value and its axis labels."""
    graph_outputs = {id(x) for x in graph.outputs}
    canon = [x for x in ("B", "T", "H") if x in labels]
    while labels != canon and id(t) not in graph_outputs:
        users = list(t.outputs)
        main = [u for u in users if u.op in ("Squeeze", "Transpose", "Reshape")]
        if len(main) != 1:
            break
        u = main[0]
        others = [x for x in users if x is not u]
        if others and not (u.op == "Reshape" and _only_feed(others, u, 1)):
            break
        if u.inputs[0] is not t or len(u.outputs) != 1:
            break
        new = None
        if u.op == "Squeeze":
            axes = axes_of(u)
            if axes is not None and len(axes) == 1 and "D" in labels and axes[0] % len(labels) == labels.index("D"):
                new = [x for x in labels if x != "D"]
        elif u.op == "Transpose":
            perm = u.attrs.get("perm")
            if perm is not None and sorted(perm) == list(range(len(labels))):
                new = [labels[p] for p in perm]
        elif u.op == "Reshape" and "D" in labels and _drops_axis(t, u, labels.index("D"), shapes, opset):
            new = [x for x in labels if x != "D"]
        if new is None:
            break
        t, labels = u.outputs[0], new
    return t, labels


def _drops_axis(t: gs.Tensor, reshape: gs.Node, d: int, shapes: Shapes, opset: int) -> bool:
    """True if `reshape` only removes the size-1 axis `d` of `t`: by the annotated shapes, or else by running
    the shape computation (from Shape(t) and constants) on a value of `t` with made-up sizes for unknown axes."""
    s_in, s_out = shapes.shape(t), shapes.shape(reshape.outputs[0])
    if s_in is None or len(s_in) <= d or s_in[d] not in (1, None):
        return False
    dropped = s_in[:d] + s_in[d + 1:]
    if s_out is not None and len(s_out) == len(dropped) and all(
            x is not None and x == y for x, y in zip(s_out, dropped)):
        return s_in[d] == 1
    primes = iter((7, 11, 13, 17, 19))
    dims = [1 if i == d else (int(x) if isinstance(x, (int, np.integer)) and x > 0 else next(primes))
            for i, x in enumerate(s_in)]
    target = reshape.inputs[1]
    v = const_value(target)
    if v is None:
        nodes, seen, stack = [], set(), [target]
        while stack:
            x = stack.pop()
            if x is t or id(x) in seen or const_value(x) is not None:
                continue
            seen.add(id(x))
            if len(x.inputs) != 1 or len(seen) > 64:
                return False
            n = x.inputs[0]
            if n.op not in ("Shape", "Slice", "Gather", "Concat", "Mul", "Reshape", "Unsqueeze", "Squeeze", "Cast"):
                return False
            nodes.append(n)
            stack.extend(n.inputs)
        try:
            (v,) = Subgraph([target], [t], opset, nodes=nodes).run([np.zeros(dims, np.float32)])
        except Exception:
            return False
    v = [int(x) for x in np.asarray(v).ravel()]
    if not int(reshape.attrs.get("allowzero", 0)):
        v = [dims[i] if x == 0 and i < len(dims) else x for i, x in enumerate(v)]
    if v.count(-1) == 1:
        known = int(np.prod([x for x in v if x != -1]))
        v[v.index(-1)] = int(np.prod(dims)) // known if known else -1
    return v == dims[:d] + dims[d + 1:]


def _only_feed(nodes: list[gs.Node], target: gs.Node, index: int) -> bool:
    """True if everything `nodes` compute flows only into input `index` of `target`."""
    seen, stack = set(), list(nodes)
    while stack:
        n = stack.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        if len(seen) > 64 or n.op not in ("Shape", "Slice", "Gather", "Concat", "Mul", "Reshape", "Unsqueeze",
                                          "Squeeze", "Cast", "Constant"):
            return False
        for o in n.outputs:
            if not o.outputs:
                return False
            for c in o.outputs:
                if c is target:
                    if target.inputs[index] is not o:
                        return False
                else:
                    stack.append(c)
    return True


def _make_layout(b: Builder, src: gs.Tensor, src_labels: list[str], out: gs.Tensor, labels: list[str]) -> None:
    """Write `out` (axes `labels`, maybe with a size-1 direction axis D) from `src` (axes `src_labels`)."""
    core = [x for x in labels if x != "D"]
    perm = [src_labels.index(x) for x in core]
    _take_over(out)
    steps = []
    if perm != list(range(len(perm))):
        steps.append(("Transpose", perm))
    if "D" in labels:
        steps.append(("Unsqueeze", [labels.index("D")]))
    if not steps:
        b.op("Identity", [src], out=out)
        return
    v = src
    for i, (op, arg) in enumerate(steps):
        last = i == len(steps) - 1
        if op == "Transpose":
            v = b.op("Transpose", [v], {"perm": arg}, out=out if last else None, dtype=np.float32)
        else:
            v = b.axes_op("Unsqueeze", v, arg, out=out if last else None, dtype=np.float32)


# ----------------------------------------------------------------------------------------- unrolled cells


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


class _Miss(Exception):
    """A chain that does not read completely: the phase that stopped it."""


class _Unroller:
    """Finds the chains of unrolled steps, one length T at a time, and rewrites each one that reads completely;
    `misses` says why each chain found but left as is was left."""

    def __init__(self, graph: gs.Graph, opset: int, shapes: Shapes):
        self.graph, self.opset, self.shapes = graph, opset, shapes
        self.failed: set[int] = set()
        self.misses: list[tuple] = []          # (step 2's Tanh, why its chain was left)

    def scan(self):
        """The complete step groups (every step 0..T-1 sliced) by their length T."""
        groups = [g for g in _step_slices(self.graph, self.shapes) if self._complete(g)]
        # slices that feed another group's sequence (feature columns cut from a flat input, a lower layer's
        # steps) are not step inputs of a cell over that sequence: leave them out of the levels
        feeding, stack = set(), [g.source for g in groups]
        while stack:
            t = stack.pop()
            if id(t) in feeding:
                continue
            feeding.add(id(t))
            for n in t.inputs:
                stack.extend(n.inputs)
        groups = [g for g in groups if not any(id(o) in feeding for outs in g.steps.values() for o in outs)]
        by_T: dict[int, list[_Group]] = {}
        for g in groups:
            by_T.setdefault(len(g.steps), []).append(g)
        return by_T

    @staticmethod
    def _complete(g: _Group) -> bool:
        T = len(g.steps)
        return T >= MIN_STEPS and set(g.steps) == set(range(T))

    def find(self) -> tuple | None:
        """Rewrite the next chain that reads completely; its description, or None when none is left."""
        order = topological_order(list(self.graph.nodes))
        for T, groups in sorted(self.scan().items()):
            steps = _Steps(T, groups, order)
            for tanh in order:
                if tanh.op != "Tanh" or id(tanh) in self.failed or steps.lvl(tanh.outputs[0]) != 2:
                    continue
                try:
                    done = self._try(steps, tanh)
                except _Miss as e:
                    done = None
                    self.misses.append((tanh, f"cell unrolled over {T} steps (step 2 at {tanh.name}): {e}"))
                except Exception as e:  # anything unexpected: leave the chain as it is
                    done = None
                    why = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}" if str(e) else type(e).__name__
                    self.misses.append((tanh, f"cell unrolled over {T} steps (step 2 at {tanh.name}): {why}"))
                if done:
                    return done
                self.failed.add(id(tanh))
        return None

    def _try(self, steps: _Steps, tanh2: gs.Node) -> str | None:
        """The chain whose step 2 computes `tanh2`, rewritten if it reads completely: its description."""
        chain = self._trace(steps, tanh2)
        if chain is None:
            return None
        return self._rewrite(steps, chain)

    @staticmethod
    def _trace(steps: _Steps, tanh2: gs.Node) -> _Chain | None:
        """Follow the state from step 0 through every step, each step's cell the same as step 1's (None: no state
        passed from step to step; _Miss: a step differs)."""
        T = steps.T
        s0 = steps.state_before(tanh2, 2)
        if s0 is None:
            return None
        found = steps.path_to_step(s0, 0)
        if found is None:
            return None
        leaf0, hops = found
        role = steps.step_of[id(leaf0)][1]
        g = steps.groups[role]
        states, nodes = [s0], [None] * T
        h_init = None
        for t in range(1, T):
            hit = None
            for start in g.steps[t]:
                for cand in steps.follow(start, hops):
                    if t == 1:
                        m = steps.match(cand, 1, s0, s0, 0, None)
                    else:
                        m = steps.match(states[1], 1, s0, cand, t, states[t - 1])
                    if m is not None:
                        hit = (cand, m)
                        break
                if hit:
                    break
            if hit is None:
                raise _Miss(f"step {t} does not compute step 1's cell (same ops, attributes, constants, slices)")
            cand, (ref_nodes, cand_nodes, bound_h) = hit
            if t == 1:
                h_init = bound_h
                nodes[0], nodes[1] = cand_nodes, ref_nodes
            else:
                nodes[t] = cand_nodes
            states.append(cand)
        return _Chain(T, states, h_init, nodes)

    def _rewrite(self, steps: _Steps, chain: _Chain) -> str | None:
        """Read the chain (its cell, masking and readers), check its first steps numerically and replace it by
        one sequence node: its description, or None where it does not read completely."""
        region = _chain_region(chain)
        if region is None:
            raise _Miss("a node belongs to two steps")
        cell = _read_cell(steps, self.shapes, self.opset, chain)
        readers = _chain_readers(self.graph, chain, region)
        if readers is None:
            raise _Miss("the graph reads the chain other than through the last state and the stacked states")
        stacked, need_h = readers
        h0_zero = is_all_zeros(chain.h0)
        if const_value(chain.h0) is not None and not h0_zero:
            raise _Miss("the initial state is a nonzero constant")
        if not _check(chain, cell, h0_zero, self.shapes, self.opset):
            raise _Miss("numeric check of the first steps against the reference op failed")
        return _replace_chain(self.graph, self.opset, self.shapes, chain, cell, stacked, need_h, h0_zero,
                              len(region))


# ---- reading a chain


def _chain_region(chain: _Chain) -> dict | None:
    """The nodes of every step's cell by id, or None if a node belongs to two steps."""
    region = {}
    for ns in chain.nodes:
        for n in ns:
            if id(n) in region:
                return None
            region[id(n)] = n
    return region


def _read_cell(steps: _Steps, shapes: Shapes, opset: int, chain: _Chain) -> _Cell:
    """Step 1's cell: its masking, its step inputs (x, attention) and what it computes; _Miss if not read."""
    s = chain.states
    masking = _peel_mask(steps, shapes, s)
    if masking is None:
        raise _Miss("the mask is not a [B, T] sequence (Where) nor a 0/1 one, a bool Cast to float (blend)")
    mask_group, invert, h_new1, form = masking
    step_inputs = _step_inputs(steps, shapes, h_new1, s[0])
    if step_inputs is None:
        raise _Miss("the cell's step inputs are not x_t [B, I] (and a_t [B] or [B, 1]) of float32 sequences")
    x_group, x1, att_group, att1 = step_inputs
    H = _last_dim(shapes.shape(s[0])) or _last_dim(shapes.shape(s[1]))
    I = _last_dim(shapes.shape(x_group.source))
    if not H or not I:
        raise _Miss("hidden or input width unknown")
    if att_group is not None and att_group.squeezed and shapes.rank(att_group.source) == 2:
        att1 = _att_column(chain.nodes[1], att1)
    found = _identify_cell(chain.nodes[1], h_new1, s[0], x1, att1, H, I, opset)
    if found is None or list(found.x_columns) != list(range(I)):
        raise _Miss("step 1 is not a GRU-family cell (identify_gru_cell)")
    if (found.attrs.kind == "GRU") != (att_group is None):
        raise _Miss(f"a {found.attrs.kind} cell {'without' if att_group is None else 'with'} an attention sequence")
    attrs = dataclasses.replace(found.attrs, padded_output="state" if mask_group is not None else "zero")
    return _Cell(attrs, found, x_group, att_group, mask_group, invert, H, I, form)


def _peel_mask(steps: _Steps, shapes: Shapes, s: list) -> tuple | None:
    """The masking of step 1: s_t = Where(m_t, h_new, s_{t-1}), or the blend m_t * h_new + (1 - m_t) * s_{t-1}
    of a 0/1 float mask (FuxiCTR's DIEN, torch). Returns (mask group or None, inverted, h_new, form), or None
    if the mask is not a [B, T] (blend: [B, T] or [B, T, 1]) sequence."""
    mask_group, invert, h_new1, form = None, False, s[1], "Where"
    p = s[1].inputs[0] if len(s[1].inputs) == 1 else None
    if p is not None and p.op == "Where" and len(p.inputs) == 3:
        cond, a, b_ = p.inputs
        not_node = None
        if id(cond) not in steps.step_of and len(cond.inputs) == 1 and cond.inputs[0].op == "Not":
            not_node = cond.inputs[0]
            cond = not_node.inputs[0]
        st = steps.step_of.get(id(cond))
        if st is not None and st[0] == 1 and (b_ is s[0] or a is s[0]):
            mask_group = steps.groups[st[1]]
            h_new1 = a if b_ is s[0] else b_
            invert = (a is s[0]) != (not_node is not None)
            if mask_group.squeezed or shapes.rank(mask_group.source) != 2:
                return None
    elif p is not None and p.op == "Add" and len(p.inputs) == 2:
        blend = _blend(steps, s[0], p)
        if blend is not None:
            (mask_group, h_new1), form = blend, "blend"
            if not _binary_mask(mask_group, shapes):
                return None
    return mask_group, invert, h_new1, form


def _blend(steps: _Steps, s0: gs.Tensor, add: gs.Node) -> tuple | None:
    """Add(Mul(m_1, h_new), Mul(Sub(1, m_1), s_0)) in any operand order, m_1 a step-1 slice: (its group, h_new)."""
    muls = [i.inputs[0] if len(i.inputs) == 1 and i.inputs[0].op == "Mul" else None for i in add.inputs]
    if any(m is None for m in muls):
        return None
    for keep, upd in (muls, muls[::-1]):
        if not any(i is s0 for i in keep.inputs):
            continue
        one_minus = keep.inputs[1] if keep.inputs[0] is s0 else keep.inputs[0]
        q = one_minus.inputs[0] if len(one_minus.inputs) == 1 else None
        if q is None or q.op != "Sub" or not _is_one(q.inputs[0]):
            continue
        m = q.inputs[1]
        st = steps.step_of.get(id(m))
        if st is None or st[0] != 1 or not any(i is m for i in upd.inputs):
            continue
        return steps.groups[st[1]], upd.inputs[1] if upd.inputs[0] is m else upd.inputs[0]
    return None


def _is_one(t: gs.Tensor) -> bool:
    v = const_value(t)
    return v is not None and v.size == 1 and float(np.asarray(v).ravel()[0]) == 1.0


def _binary_mask(g: _Group, shapes: Shapes) -> bool:
    """The blend's mask sequence holds only 0 and 1: a bool Cast to float, maybe reshaped, [B, T] sliced to
    [B, 1] or [B, T, 1] gathered to [B, 1]."""
    rank = shapes.rank(g.source)
    if not ((rank == 2 and not g.squeezed) or (rank == 3 and g.squeezed and _last_dim(shapes.shape(g.source)) == 1)):
        return False
    t = g.source
    while len(t.inputs) == 1 and t.inputs[0].op in ("Unsqueeze", "Reshape", "Squeeze", "Identity"):
        t = t.inputs[0].inputs[0]
    p = t.inputs[0] if len(t.inputs) == 1 else None
    return p is not None and p.op == "Cast" and shapes.dtype(p.inputs[0]) == np.bool_ \
        and shapes.dtype(g.source) == np.float32


def _step_inputs(steps: _Steps, shapes: Shapes, h_new1: gs.Tensor, s0: gs.Tensor) -> tuple | None:
    """The step slices step 1's cell reads: (x group, x_1, attention group, a_1), the attention ones None if
    there is none; None if it reads others or not in float32. x_t is a step of a [B, T, I] sequence; a_t one
    of a [B, T] sequence, or of a [B, T, 1] one (torch-rechub's ``att.unsqueeze(-1)`` sliced to [B, 1]) beside
    a wider x. B is whatever rows the sequences hold (rows the graph selected, not necessarily its batch)."""
    cell_leaves = steps.leaves(h_new1, s0, step=1)
    if cell_leaves is None:
        return None
    seqs = [(steps.groups[gi], leaf) for gi, leaf in cell_leaves.items()]
    flat = [p for p in seqs if shapes.rank(p[0].source) == 2]                      # a_t of [B, T]
    wide = [p for p in seqs if shapes.rank(p[0].source) == 3 and p[0].squeezed]   # x_t, or a_t of [B, T, 1]
    if len(flat) + len(wide) != len(seqs):
        return None
    if len(wide) == 2 and not flat:  # x_t beside a_t of [B, T, 1]: the attention is the one a column wide
        columns = [p for p in wide if _last_dim(shapes.shape(p[0].source)) == 1]
        if len(columns) != 1:
            return None
        flat, wide = columns, [p for p in wide if p is not columns[0]]
    if len(wide) != 1 or len(flat) > 1:
        return None
    (x_group, x1), (att_group, att1) = wide[0], flat[0] if flat else (None, None)
    if any(g is not None and shapes.dtype(g.source) != np.float32 for g in (x_group, att_group)):
        return None  # the fused op computes in float32
    return x_group, x1, att_group, att1


def _identify_cell(step_nodes: list[gs.Node], h_new1: gs.Tensor, h: gs.Tensor, x1: gs.Tensor,
                   att1: gs.Tensor | None, H: int, I: int, opset: int) -> CellMatch | None:
    """What step 1's cell computes (identify_gru_cell); a GRU cell over a_t * x_t is an AIGRU."""
    found = identify_gru_cell(h_new1, h, x1, att1, hidden=H, x_width=I, opset=opset, att_column=None)
    if found is None and att1 is not None:
        # AIGRU: the cell is a GRU over a_t * x_t
        scaled = _scaled_input(step_nodes, x1, att1)
        if scaled is not None:
            found = identify_gru_cell(h_new1, h, scaled, None, hidden=H, x_width=I, opset=opset,
                                      att_column=None)
            if found is not None and found.attrs.kind == "GRU":
                found = dataclasses.replace(found, attrs=dataclasses.replace(found.attrs, kind="AIGRU"))
    return found


def _att_column(nodes: list[gs.Node], att: gs.Tensor) -> gs.Tensor:
    """A [B] attention step a_t (Gather of [B, T] at t) that the step reads only as Unsqueeze(a_t, -1): that
    [B, 1] column (torch's ``attn.unsqueeze(-1)``), else `att` as is."""
    ids = {id(n) for n in nodes}
    readers = [n for n in att.outputs if id(n) in ids]
    if len(readers) == 1 and readers[0].op == "Unsqueeze" and axes_of(readers[0]) in ([-1], [1]):
        return readers[0].outputs[0]
    return att


def _scaled_input(nodes: list[gs.Node], x: gs.Tensor, att: gs.Tensor) -> gs.Tensor | None:
    """The output of Mul(x, a) (a = att, or att reshaped/unsqueezed) among a step's nodes, if x is read
    by nothing else in the step."""
    ids = {id(n) for n in nodes}
    for n in nodes:
        if n.op != "Mul" or len(n.inputs) != 2 or not any(i is x for i in n.inputs):
            continue
        other = n.inputs[1] if n.inputs[0] is x else n.inputs[0]
        while other is not att and len(other.inputs) == 1 and other.inputs[0].op in (
                "Unsqueeze", "Reshape", "Identity", "Cast") and id(other.inputs[0]) in ids:
            other = other.inputs[0].inputs[0]
        if other is att and all(u is n for u in x.outputs if id(u) in ids):
            return n.outputs[0]
    return None


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


def _check(chain: _Chain, cell: _Cell, h0_zero: bool, shapes: Shapes, opset: int) -> bool:
    """Run the exported nodes of the first steps (slices included) on random sequences and compare the state
    with the reference op's."""
    x_group, att_group, mask_group, H, I = cell.x_group, cell.att_group, cell.mask_group, cell.H, cell.I
    K = min(CHECK_STEPS, chain.T)
    T, batch = chain.T, 4
    rng = np.random.default_rng(0)
    nodes = {}
    for ns in chain.nodes[:K]:
        for n in ns:
            nodes[id(n)] = n
    produced = {id(o) for n in nodes.values() for o in n.outputs}
    feeds = {}
    X = rng.normal(size=(batch, T, I)).astype(np.float32)
    feeds[id(x_group.source)] = (x_group.source, X if x_group.axis == 1 else np.ascontiguousarray(X.transpose(1, 0, 2)))
    att = mask = None
    if att_group is not None:
        att = rng.uniform(0.05, 1.0, size=(batch, T)).astype(np.float32)
        dtype = shapes.dtype(att_group.source) or np.float32
        shaped = att.reshape(att.shape + (1,) * ((shapes.rank(att_group.source) or 2) - 2))
        feeds[id(att_group.source)] = (att_group.source, shaped.astype(dtype))
    if mask_group is not None:
        cond = np.ones((batch, T), bool)
        cond[0, :] = False           # an empty row
        cond[1, 1:] = False          # length 1
        cond[3, 2:] = False          # partial
        dtype = shapes.dtype(mask_group.source) or np.bool_
        shaped = cond.reshape(cond.shape + (1,) * ((shapes.rank(mask_group.source) or 2) - 2))
        feeds[id(mask_group.source)] = (mask_group.source, shaped.astype(dtype))
        mask = ~cond if cell.invert else cond
    h0 = None if h0_zero else rng.normal(size=(batch, H)).astype(np.float32)
    if const_value(chain.h0) is None:
        feeds[id(chain.h0)] = (chain.h0, np.zeros((batch, H), np.float32) if h0 is None else h0)
    # the slices that feed these steps
    for g in (x_group, att_group, mask_group):
        if g is None:
            continue
        for t in range(K):
            for o in g.steps[t]:
                for n in g.nodes[id(o)]:
                    nodes[id(n)] = n
    produced = {id(o) for n in nodes.values() for o in n.outputs}
    for n in nodes.values():
        for i in n.inputs:
            if (_present(i) and id(i) not in produced and id(i) not in feeds and const_value(i) is None):
                return False  # a value from elsewhere: not a chain we can run alone
    out = chain.states[K - 1]
    try:
        (got,) = Subgraph([out], [t for t, _ in feeds.values()], opset, nodes=list(nodes.values())).run(
            [v for _, v in feeds.values()])
    except Exception:
        return False
    found = cell.match
    _, want = reference(cell.attrs, X[:, :K], found.W, found.R, found.B, initial_h=h0,
                        att=None if att is None else att[:, :K], mask=None if mask is None else mask[:, :K])
    return got.shape == want.shape and np.allclose(got, want, atol=CHECK_TOL, rtol=CHECK_TOL)


# ---- the replacement


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


def _index(items, x) -> int:
    return next(i for i, y in enumerate(items) if y is x)


def _last_dim(shape) -> int | None:
    if shape and isinstance(shape[-1], (int, np.integer)) and shape[-1] > 0:
        return int(shape[-1])
    return None


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


def fuse_unrolled_cells(graph: gs.Graph, opset: int, notes: list[str] | None = None) -> list[str]:
    """GRU-family cells unrolled over time steps → one sequence node. Returns what was fused; why chains were
    left as they are goes to `notes` when given."""
    done: list[str] = []
    shapes = Shapes(graph, symbolic=True)
    unroller = _Unroller(graph, opset, shapes)
    for _ in range(32):
        what = unroller.find()
        if not what:
            break
        done.append(what)
        graph.cleanup(remove_unused_graph_inputs=False)
    if notes is not None:  # chains still there (one tried under another length may have been fused since)
        present = {id(n) for n in graph.nodes}
        notes.extend(dict.fromkeys(why for tanh, why in unroller.misses if id(tanh) in present))
    if done:
        graph.toposort(mode="nodes")  # "full" recurses forever on graphs with If/Loop plus functions (gs 0.6.1)
    return done
