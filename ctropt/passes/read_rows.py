"""`compute-read-rows-only`: a sequence read at a few positions only (BST's `out[:, -1]`, the target token's row
of the last transformer block) → the token-wise ops before that read run on those positions only.

A transformer block computes every position of the sequence: its feed-forward layers, layer norms, residual adds
and the attention's queries, each row by itself (the attention mixes over keys, not over queries). When the model
then reads one position, a ``Gather(X, -1, axis=1)``, every other row was computed for nothing; in torch-rechub's BST
the feed-forward block (32 → 2048 → 32 per token) is 85 % of the model's time. The selection commutes with each
row-wise op, so it moves up through them, to just below the values that are also read whole (the keys and values
of the attention, the block's input): ``Gather(f(X), i) = f(Gather(X, i))``. Row-wise, as read from each op: unary
elementwise ops, elementwise binaries (an operand broadcast along the axis stays whole), LayerNormalization and
Softmax over later axes, MatMul on its rows (the right operand whole) or batch axes, Transposes (the axis follows
the permutation) and Reshapes that keep the axes up to the selected one. Exact: the same ops on fewer rows.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from ..graph import annotate_shapes
from ..graph.edit import Builder, const_value, shape_of
from ..patterns import Match, P, Rewrite, Var
from .registry import PassContext, register_pass

UNARY = {"Relu", "LeakyRelu", "Gelu", "Erf", "Sigmoid", "Tanh", "Neg", "Sqrt", "Exp", "Log", "Abs", "Elu", "Selu",
         "Softplus", "HardSigmoid", "Cast", "Identity", "Reciprocal", "Clip"}
BINARY = {"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Sum", "Where"}
MAX_NODES = 400  # a bound on the walk: each rewrite visits at most this many nodes


class _Walk:
    """One selection (positions `rows`, a 1-D constant, along an axis) pushed up from a read. First the region: the
    values whose every reader is inside it, each with the axis its positions are on (a value read whole by an op
    outside the region is cut: a Gather takes its rows); then the row-wise ops of the region copied onto the rows."""

    def __init__(self, graph: gs.Graph, rows: gs.Constant, prefix: str):
        self.graph, self.rows = graph, rows
        self.b = Builder(graph, prefix)
        self.outputs = {id(t) for t in graph.outputs}

    def region(self, root: gs.Tensor, axis: int) -> None:
        """self.axes: value id → the axis of its positions, over the region; self.cut: the values taken by Gather."""
        self.cut: set[int] = set()
        while True:
            self.axes, self.plans, self.nodes, self._tensors = {}, {}, set(), {}
            self._visit(root, axis, budget=[MAX_NODES])
            inside = self.nodes
            cut = {i for i, t in self._tensors.items() if i != id(root) and i not in self.cut and
                   (i in self.outputs or any(id(r) not in inside for r in t.outputs))}
            if not cut:
                return
            self.cut |= cut

    def _visit(self, t: gs.Tensor, axis: int, budget: list) -> None:
        if id(t) in self.axes:
            if self.axes[id(t)] != axis:   # reached on two axes: take it whole
                self.cut.add(id(t))
            return
        self.axes[id(t)], self._tensors[id(t)] = axis, t
        budget[0] -= 1
        node = t.inputs[0] if t.inputs else None
        if id(t) in self.cut or node is None or budget[0] <= 0 or shape_of(t) is None:
            return
        plan = _plan(node, t, axis, len(shape_of(t)), int(self.graph.opset or 13))
        if plan is None:
            return
        self.plans[id(t)] = plan
        self.nodes.add(id(node))
        for u, at in plan:
            if at is not None:
                self._visit(u, at, budget)

    def take(self, t: gs.Tensor) -> gs.Tensor:
        """t's selected rows: its producer copied onto the rows of its inputs, or a Gather where the region ends."""
        made = self.__dict__.setdefault("_made", {})
        if id(t) not in made:
            plan = None if id(t) in self.cut else self.plans.get(id(t))
            if plan is None:
                made[id(t)] = self.b.op("Gather", [t, self.rows], {"axis": self.axes[id(t)]}, name="rows",
                                        dtype=t.dtype)
            else:
                node = t.inputs[0]
                ins = [self.take(u) if at is not None else u for u, at in plan]
                if node.op == "Reshape":
                    ins[1] = self._reshape_target(node, self.axes[id(t)])
                made[id(t)] = self.b.op(node.op, ins, dict(node.attrs), name=node.op, dtype=t.dtype,
                                        domain=node.domain or None)
        return made[id(t)]

    def moved(self, root: gs.Tensor) -> bool:
        return id(root) not in self.cut and id(root) in self.plans

    def _reshape_target(self, node: gs.Node, axis: int) -> gs.Tensor:
        new = np.array(const_value(node.inputs[1]), np.int64)
        if new[axis] > 0:
            new[axis] = self.rows.values.size
        return self.b.const("shape", new)


def _plan(node: gs.Node, t: gs.Tensor, axis: int, rank: int, opset: int) -> list | None:
    """How `node` (which makes t) passes a selection on `axis` of t: [(input, its axis or None to keep it whole)],
    or None when it cannot."""
    op, attrs, ins = node.op, node.attrs, list(node.inputs)
    if op in UNARY and all(const_value(u) is not None for u in ins[1:]):
        return [(ins[0], axis)] + [(u, None) for u in ins[1:]]
    if op in BINARY:
        plan = [(u, _broadcast_axis(u, axis, rank)) for u in ins]
        return None if any(at == -1 for _, at in plan) else plan
    if op in ("LayerNormalization", "Softmax", "LogSoftmax"):
        norm = attrs.get("axis", -1 if op == "LayerNormalization" or opset >= 13 else 1)
        return None if axis >= norm % rank else [(ins[0], axis)] + [(u, None) for u in ins[1:]]
    if op == "MatMul":
        sa, sb = shape_of(ins[0]), shape_of(ins[1])
        if sa is None or sb is None or len(sa) < 2 or len(sb) < 2 or axis == rank - 1:
            return None
        if axis == rank - 2:   # rows of the product: rows of the left operand, the right one whole
            return [(ins[0], len(sa) - 2), (ins[1], None)]
        plan = [(u, _broadcast_axis(u, axis, rank)) for u in ins]   # a batch axis
        return None if any(at == -1 for _, at in plan) else plan
    if op == "Transpose":
        perm = list(attrs.get("perm", range(rank - 1, -1, -1)))
        return [(ins[0], int(perm[axis]))]
    if op == "Reshape" and _keeps_axes(node, t, axis):
        return [(ins[0], axis), (ins[1], None)]
    return None


def _broadcast_axis(u: gs.Tensor, axis: int, rank: int) -> int | None:
    """The axis of an elementwise operand that the output's `axis` reads (None: it broadcasts along it; -1: its shape
    is unknown)."""
    shape = shape_of(u)
    if shape is None:
        return -1
    at = axis - (rank - len(shape))
    return None if at < 0 or shape[at] == 1 else at


def _keeps_axes(node: gs.Node, t: gs.Tensor, axis: int) -> bool:
    """A Reshape that keeps every axis up to `axis` (it splits or merges later ones), its target there 0, -1 or the
    dim itself."""
    want, before, after = const_value(node.inputs[1]), shape_of(node.inputs[0]), shape_of(t)
    if want is None or before is None or after is None or min(len(before), len(after)) <= axis:
        return False
    if node.attrs.get("allowzero", 0) or any(before[i] != after[i] or before[i] is None for i in range(axis + 1)):
        return False
    return all(w in (0, -1, before[i]) for i, w in enumerate(want[:axis + 1]))


def _read_rows(m: Match) -> bool | str:
    idx = const_value(m.node("read").inputs[1])
    shape = shape_of(m["x"])
    if idx is None or idx.ndim > 1 or idx.dtype.kind not in "iu" or shape is None:
        return "not a constant selection of positions of a value of known rank"
    axis = m.node("read").attrs.get("axis", 0) % len(shape)
    if axis == len(shape) - 1:
        return "a selection of features (the last axis), not of positions"
    if len(m["x"].outputs) > 1 or any(o is m["x"] for o in m.graph.outputs):
        return "the value is read elsewhere too"
    if isinstance(shape[axis], int) and idx.size >= shape[axis]:
        return "every position is read"
    return True


def _move_up(m: Match) -> list | None:
    read, x = m.node("read"), m["x"]
    idx = const_value(read.inputs[1])
    axis = read.attrs.get("axis", 0) % len(shape_of(x))
    walk = _Walk(m.graph, gs.Constant(f"{read.name}/rows", np.atleast_1d(idx).astype(np.int64)), read.name)
    walk.region(x, axis)
    if not walk.moved(x):   # nothing to pass: leave the read as it is
        return None
    picked = walk.take(x)
    out = read.outputs[0]
    if idx.ndim == 0:
        picked = walk.b.axes_op("Squeeze", picked, [axis], name="read", dtype=out.dtype)
    return [picked]


def _computed(t: gs.Tensor) -> bool:
    return bool(t.inputs) and const_value(t) is None   # not an embedding table's lookup


READ_RULES = (Rewrite("rows-read-first", P.Gather(Var("x", _computed), Var("i"), _name="read"), _move_up, _read_rows,
                      subgraphs=False),)


@register_pass("compute-read-rows-only", rules=READ_RULES)
def compute_read_rows_only(ctx: PassContext) -> None:
    """A sequence read at a few constant positions (BST's target row `out[:, -1]`) → the row-wise ops before the
    read (feed-forward layers, layer norms, residual adds, the attention's queries) run on those positions only."""
    if any(t.shape is None for n in ctx.graph.nodes for t in n.outputs):
        annotate_shapes(ctx.graph)   # the walk reads ranks and broadcast axes (the manager has done it; a lone run may not)
    ctx.apply(*READ_RULES)
