"""`compute-read-rows-only`: a sequence read at a few positions only (BST's `out[:, -1]`, the target token's row
of the last transformer block; SASRec's last valid position of each row, a GatherElements) → the token-wise ops
before that read run on those positions only.

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
import onnx
import onnx_graphsurgeon as gs

from ...graph import annotate_shapes_if_bare
from ...graph.edit import Builder, const_value, read_once, redirect_consumers, shape_of
from ...patterns import Match, P, Rewrite, Var
from ...runtime.probe import PROBE_SIZES, try_probe
from ..cleanup import tidy
from ..registry import PassContext, register_pass

UNARY = {"Relu", "LeakyRelu", "Gelu", "Erf", "Sigmoid", "Tanh", "Neg", "Sqrt", "Exp", "Log", "Abs", "Elu", "Selu",
         "Softplus", "HardSigmoid", "Cast", "Identity", "Reciprocal", "Clip"}
BINARY = {"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Sum", "Where"}
MAX_NODES = 400  # a bound on the walk: each rewrite visits at most this many nodes


class _Walk:
    """One selection pushed up from a read: constant positions `rows` (1-D) along an axis, or one position per row
    (`per_row`, [B] int64: SASRec's last valid position) along an axis with the batch on another. A place is
    (axis, batch axis or None). First the region: the values whose every reader is inside it, each with its place (a
    value read whole by an op outside the region is cut: a Gather, or a GatherElements per row, takes its rows);
    then the row-wise ops of the region copied onto the rows."""

    def __init__(self, graph: gs.Graph, prefix: str, rows: np.ndarray | None = None):
        self.graph, self.per_row = graph, None
        self.b = Builder(graph, prefix)
        self.rows = None if rows is None else self.b.const("rows", rows)
        self.count = 1 if rows is None else rows.size   # positions kept per row
        self.outputs = {id(t) for t in graph.outputs}

    def region(self, root: gs.Tensor, where: tuple) -> None:
        """self.places: value id → its place, over the region; self.cut: the values taken whole."""
        self.cut: set[int] = set()
        while True:
            self.places, self.plans, self.nodes, self._tensors = {}, {}, set(), {}
            self._visit(root, where, budget=[MAX_NODES])
            cut = {i for i, t in self._tensors.items() if i != id(root) and i not in self.cut and
                   (i in self.outputs or any(id(r) not in self.nodes and not self._reads_shape(t, r)
                                             for r in t.outputs))}
            if not cut:
                return
            self.cut |= cut

    def _visit(self, t: gs.Tensor, where: tuple, budget: list) -> None:
        if shape_of(t) is None:   # no rank: cannot be selected here (its reader's plan refuses it)
            return
        if id(t) in self.places:
            if self.places[id(t)] != where:   # reached in two places: take it whole
                self.cut.add(id(t))
            return
        self.places[id(t)], self._tensors[id(t)] = where, t
        budget[0] -= 1
        node = t.inputs[0] if t.inputs else None
        if id(t) in self.cut or node is None or budget[0] <= 0:
            return
        plan = _plan(node, t, where, len(shape_of(t)), int(self.graph.opset or 13))
        if plan is None:
            return
        self.plans[id(t)] = plan
        self.nodes.add(id(node))
        for u, place in plan:
            if place is not None:
                self._visit(u, place, budget)

    def _reads_shape(self, t: gs.Tensor, reader: gs.Node) -> bool:
        """A whole Shape of a value whose selected axis has a static length: `shapes_from_rows` gives it from the
        rows (the legacy exports' Reshape targets are computed from such Shapes of values inside a block)."""
        axis = self.places[id(t)][0]
        return reader.op == "Shape" and not reader.attrs.get("start") and reader.attrs.get("end") is None and \
            isinstance(shape_of(t)[axis], (int, np.integer))

    def shapes_from_rows(self) -> None:
        """After `take`: each whole Shape of a value of the region read from the selected rows, the axis's static
        length put back, so that the whole value is no longer computed for its shape."""
        for (i, place), made in self.__dict__.get("_made", {}).items():
            t = self._tensors.get(i)
            if t is None or i not in self.plans or i in self.cut or self.places.get(i) != place:
                continue
            for reader in [r for r in t.outputs if r.op == "Shape" and self._reads_shape(t, r)]:
                rows = self.b.op("Shape", [made], dtype=np.int64)
                whole = self._with_length(rows, len(shape_of(t)), place[0], int(shape_of(t)[place[0]]))
                redirect_consumers(reader.outputs[0], whole)

    def _with_length(self, dims: gs.Tensor, rank: int, axis: int, length: int) -> gs.Tensor:
        """An int64 vector of `rank` dims (a shape, a Reshape's target) with `length` on `axis`, by arithmetic."""
        at = np.zeros(rank, np.int64)
        at[axis] = 1
        kept = self.b.op("Mul", [dims, self.b.const("others", 1 - at)], dtype=np.int64)
        return self.b.op("Add", [kept, self.b.const("length", at * length)], dtype=np.int64)

    def take(self, t: gs.Tensor, place: tuple) -> gs.Tensor:
        """t's selected rows at `place` (where its reader wants them): its producer copied onto the rows of its
        inputs, or a selection where the region ends (a value cut, or wanted in another place than the region's)."""
        made, key = self.__dict__.setdefault("_made", {}), (id(t), place)
        if key not in made:
            plan = None if id(t) in self.cut or self.places.get(id(t)) != place else self.plans.get(id(t))
            if plan is None:
                made[key] = self._select(t, *place)
            else:
                node = t.inputs[0]
                ins = [self.take(u, at) if at is not None else u for u, at in plan]
                if node.op == "Reshape":
                    ins[1] = self._reshape_target(node, place[0])
                made[key] = self.b.op(node.op, ins, dict(node.attrs), name=node.op, dtype=t.dtype,
                                      domain=node.domain or None)
        return made[key]

    def _select(self, t: gs.Tensor, axis: int, batch: int | None) -> gs.Tensor:
        """The rows of a value taken whole: a Gather of the positions, or a GatherElements of each row's position."""
        if self.per_row is None:
            return self.b.op("Gather", [t, self.rows], {"axis": axis}, name="rows", dtype=t.dtype)
        rank, b = len(shape_of(t)), self.b
        at, keep, one = np.ones(rank, np.int64), np.ones(rank, np.int64), np.zeros(rank, np.int64)
        at[batch], keep[axis], one[axis] = -1, 0, 1
        shape = b.op("Add", [b.op("Mul", [b.op("Shape", [t], dtype=np.int64), b.const("keep", keep)], dtype=np.int64),
                             b.const("one", one)], dtype=np.int64)   # t's shape, 1 along the axis
        index = b.op("Expand", [b.op("Reshape", [self.per_row, b.const("at", at)], dtype=np.int64), shape],
                     dtype=np.int64)
        return b.op("GatherElements", [t, index], {"axis": axis}, name="row", dtype=t.dtype)

    def moved(self, root: gs.Tensor) -> bool:
        return id(root) not in self.cut and id(root) in self.plans

    def _reshape_target(self, node: gs.Node, axis: int) -> gs.Tensor:
        """The Reshape's target with the kept positions' count on `axis` (a computed target: by arithmetic)."""
        want = const_value(node.inputs[1])
        if want is not None:
            new = np.array(want, np.int64)
            if new[axis] > 0:
                new[axis] = self.count
            return self.b.const("shape", new)
        return self._with_length(node.inputs[1], len(shape_of(node.outputs[0])), axis, self.count)


def _plan(node: gs.Node, t: gs.Tensor, where: tuple, rank: int, opset: int) -> list | None:
    """How `node` (which makes t) passes a selection at `where` (axis, batch axis or None) of t: [(input, its place,
    or None to keep it whole)], or None when it cannot (an input to select of unknown shape included)."""
    plan = _row_wise(node, t, where, rank, opset)
    if plan is None or any(place is not None and shape_of(u) is None for u, place in plan):
        return None
    return plan


def _row_wise(node: gs.Node, t: gs.Tensor, where: tuple, rank: int, opset: int) -> list | None:
    op, attrs, ins = node.op, node.attrs, list(node.inputs)
    axis, batch = where
    last = max(axis, -1 if batch is None else batch)
    if (node.domain or "") not in ("", "ai.onnx") or not ins or t is not node.outputs[0]:
        return None
    if op in UNARY and all(const_value(u) is not None for u in ins[1:]):
        return [(ins[0], where)] + [(u, None) for u in ins[1:]]
    if op in BINARY:
        return _elementwise(ins, shape_of(t), where)
    if op in ("LayerNormalization", "Softmax", "LogSoftmax"):
        norm = attrs.get("axis", -1 if op == "LayerNormalization" or opset >= 13 else 1) % rank
        return None if last >= norm else [(ins[0], where)] + [(u, None) for u in ins[1:]]
    if op == "MatMul":
        sa, sb = shape_of(ins[0]), shape_of(ins[1])
        if sa is None or sb is None or len(sa) < 2 or len(sb) < 2 or rank - 1 in (axis, batch):
            return None
        if axis == rank - 2:   # rows of the product: rows of the left operand, the right one whole
            place = _place(sa, shape_of(t), where)
            return None if place in (None, -1) else [(ins[0], place), (ins[1], None)]
        if batch is not None and batch >= rank - 2:   # the batch on the rows or columns of the product
            return None
        return _elementwise(ins, shape_of(t), where)   # a batch axis of the product
    if op == "Transpose":
        perm = [int(p) for p in attrs.get("perm", range(rank - 1, -1, -1))]
        return [(ins[0], (perm[axis], None if batch is None else perm[batch]))]
    if op == "Reshape" and _keeps_axes(node, t, last):
        return [(ins[0], where), (ins[1], None)]
    return None


def _elementwise(ins: list, out: list, where: tuple) -> list | None:
    plan = [(u, _place(shape_of(u), out, where)) for u in ins]
    return None if any(place == -1 for _, place in plan) else plan


def _place(shape: list | None, out: list, where: tuple):
    """Where an operand of shape `shape`, broadcast to the output's `out`, holds the output's selected axis (and
    batch axis): None when it broadcasts along the axis (a literal 1, or no such axis: read whole), -1 when that
    cannot be told (a dim neither 1 nor the output's own) or a selection per row would need a batch axis the operand
    broadcasts."""
    if shape is None:
        return -1
    axis, batch = where
    off = len(out) - len(shape)
    if axis - off < 0 or shape[axis - off] == 1:
        return None
    if shape[axis - off] != out[axis] or shape[axis - off] is None:
        return -1
    if batch is None:
        return (axis - off, None)
    if batch - off < 0 or shape[batch - off] != out[batch] or shape[batch - off] is None:
        return -1
    return (axis - off, batch - off)


def _keeps_axes(node: gs.Node, t: gs.Tensor, axis: int) -> bool:
    """A Reshape that keeps every axis up to `axis` (it splits or merges later ones): its target there 0, -1 or the
    dim itself, or a computed target (of the output's rank) where the shapes say so."""
    want, before, after = const_value(node.inputs[1]), shape_of(node.inputs[0]), shape_of(t)
    if before is None or after is None or min(len(before), len(after)) <= axis:
        return False
    if node.attrs.get("allowzero", 0) or any(before[i] != after[i] or before[i] is None for i in range(axis + 1)):
        return False
    if want is None:
        return shape_of(node.inputs[1]) == [len(after)]
    return all(w in (0, -1, before[i]) for i, w in enumerate(want[:axis + 1]))


def _read_rows(m: Match) -> bool | str:
    idx = const_value(m.node("read").inputs[1])
    shape = shape_of(m["x"])
    if idx is None or idx.ndim > 1 or idx.dtype.kind not in "iu" or shape is None:
        return "not a constant selection of positions of a value of known rank"
    axis = m.node("read").attrs.get("axis", 0) % len(shape)
    if axis == len(shape) - 1:
        return "a selection of features (the last axis), not of positions"
    if not read_once(m["x"], m.graph):
        return "the value is read elsewhere too"
    if isinstance(shape[axis], int) and idx.size >= shape[axis]:
        return "every position is read"
    return True



def _move_up(m: Match) -> list | None:
    read, x = m.node("read"), m["x"]
    idx = const_value(read.inputs[1])
    axis = read.attrs.get("axis", 0) % len(shape_of(x))
    walk = _Walk(m.graph, read.name, rows=np.atleast_1d(idx).astype(np.int64))
    walk.region(x, (axis, None))
    if not walk.moved(x):   # nothing to pass: leave the read as it is
        return None
    picked = walk.take(x, (axis, None))
    walk.shapes_from_rows()
    if idx.ndim == 0:
        picked = walk.b.axes_op("Squeeze", picked, [axis], name="read", dtype=read.outputs[0].dtype)
    return [picked]


def _per_row(m: Match) -> gs.Tensor | str:
    """GatherElements(x, idx, axis) with idx the same along every axis but the batch (axis 0): one position per row,
    idx[b, 0, ...] (SASRec's last valid position, item_length - 1, expanded over the features); its [B, 1, ...]
    source, or why not."""
    read, x, idx = m.node("read"), m["x"], m["i"]
    shape = shape_of(x)
    expand = idx.inputs[0] if idx.inputs and idx.inputs[0].op == "Expand" else None
    source = expand.inputs[0] if expand is not None else idx
    small, index_shape = shape_of(source), shape_of(idx)
    target = const_value(expand.inputs[1]) if expand is not None else None
    if target is not None and small is not None and len(target) <= len(small):   # inference left it unknown (a
        index_shape = _broadcast(small, [int(v) for v in target])                # target torch folded from a Where)
    if shape is None or len(shape) < 3 or small is None or index_shape is None:
        return "not one position per row of a [B, T, ...] value"
    axis = read.attrs.get("axis", 0) % len(shape)
    if axis in (0, len(shape) - 1) or len(small) != len(shape) or index_shape[axis] != 1:
        return "not one position per row of a [B, T, ...] value"
    if any(d != 1 for d in small[1:]) or small[0] == 1:
        return "the index varies along more than the batch axis"
    if any(index_shape[i] != shape[i] or shape[i] is None for i in range(1, len(shape)) if i != axis) or \
            (isinstance(index_shape[0], int) and index_shape[0] != shape[0]):
        return "the index does not cover the value's other axes (the read would take a corner of them)"
    if not read_once(x, m.graph):
        return "the value is read elsewhere too"
    return source


def _broadcast(a: list, b: list) -> list:
    """numpy's broadcast of two shapes (None where a dim is not known to be either)."""
    b = [1] * (len(a) - len(b)) + list(b)
    return [y if x == 1 else x if y == 1 or x == y else None for x, y in zip(a, b)]


def _per_row_condition(m: Match) -> bool | str:
    found = _per_row(m)
    return found if isinstance(found, str) else True


def _move_up_per_row(m: Match) -> list | None:
    read, x, source = m.node("read"), m["x"], _per_row(m)
    walk = _Walk(m.graph, read.name)
    walk.per_row = walk.b.op("Reshape", [source, walk.b.const("flat", np.array([-1], np.int64))], dtype=source.dtype)
    if source.dtype != np.int64:
        walk.per_row = walk.b.op("Cast", [walk.per_row], {"to": onnx.TensorProto.INT64}, dtype=np.int64)
    where = (read.attrs.get("axis", 0) % len(shape_of(x)), 0)
    walk.region(x, where)
    if not walk.moved(x):
        return None
    picked = walk.take(x, where)
    walk.shapes_from_rows()
    return [picked]


def _computed(t: gs.Tensor) -> bool:
    return bool(t.inputs) and const_value(t) is None   # not an embedding table's lookup


READ_RULES = (
    Rewrite("rows-read-first", P.Gather(Var("x", _computed), Var("i"), _name="read"), _move_up, _read_rows,
            subgraphs=False),
    Rewrite("row-per-sequence-read-first", P.GatherElements(Var("x", _computed), Var("i"), _name="read"),
            _move_up_per_row, _per_row_condition, subgraphs=False),
)


@register_pass("compute-read-rows-only", rules=READ_RULES)
def compute_read_rows_only(ctx: PassContext) -> None:
    """A sequence read at a few constant positions (BST's target row `out[:, -1]`) or at one position per row
    (SASRec's last valid one) → the row-wise ops before the read (feed-forward layers, layer norms, residual adds,
    the attention's queries) run on those positions only."""
    annotate_shapes_if_bare(ctx.graph)   # the walk reads ranks and broadcast axes
    renamed = _dims_named_by_probe(ctx.graph) if _has_read(ctx.graph) else []
    try:
        applied = ctx.apply(*READ_RULES)
    finally:
        for t, shape in renamed:
            t.shape = shape
    if applied:
        tidy(ctx)   # the per-row index's reshapes, as the cleanup passes would leave them


def _has_read(graph: gs.Graph) -> bool:
    """A read the rules could take: positions of a computed sequence (a rank ≥ 3 value, not its last axis)."""
    for n in graph.nodes:
        if n.op not in ("Gather", "GatherElements") or not n.inputs or not _computed(n.inputs[0]):
            continue
        rank = len(shape_of(n.inputs[0]) or [])
        if rank >= 3 and n.attrs.get("axis", 0) % rank not in (0, rank - 1) and \
                (n.op == "GatherElements" or const_value(n.inputs[1]) is not None):
            return True
    return False


def _dims_named_by_probe(graph: gs.Graph) -> list:
    """Symbolic dims that are the batch in both of the probe's runs (PROBE_SIZES) renamed alike, so that batches shape
    inference named apart compare equal in the walk: the batch of a value reshaped to a computed shape (`unk__8`)
    and that of the value it is added to (`unk__10`), in RecBole's legacy SASRec. Other dims keep their names (the
    probe gives every history axis the same length: equal there is not the same). Returns (value, shape) pairs to
    restore."""
    symbolic = [t for t in graph.tensors().values()
                if isinstance(t, gs.Variable) and t.shape is not None and any(isinstance(d, str) for d in t.shape)]
    if not symbolic:
        return []
    probe, _ = try_probe(graph)
    if probe is None:
        return []
    batches = [batch for batch, _ in PROBE_SIZES]
    renamed = []
    for t in symbolic:
        sizes = probe.shapes(t)
        if sizes is None or any(len(s) != len(t.shape) for s in sizes):
            continue
        shape = ["probed_batch" if isinstance(d, str) and [s[i] for s in sizes] == batches else d
                 for i, d in enumerate(t.shape)]
        if shape != list(t.shape):
            renamed.append((t, t.shape))
            t.shape = shape
    return renamed
