"""Sizes the graph names by construction: the entries of a shape value computed from Shape ops, and whether two
(value, axis) pairs have the same size because one is made from the other by ops that keep that axis.

tf2onnx writes a Keras Dense layer as MatMul, then a Reshape back to ``Concat(Shape(x)[:-1], [units])``: on a 2-D
input that Reshape is the identity, but its target is computed, and symbolic shape inference cannot see it (the
exports' inputs each have their own batch symbol, and a custom kernel in between stops inference). Following the
batch axis back through the ops that keep it proves it instead, with no inference and no run.

One assumption beyond the ops' definitions: graph inputs that name a dim alike have one size there (ONNX's meaning
of a named dim; TensorRT checks it so, onnxruntime does not).
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from .edit import axes_of, const_value, rank_of, shape_of

ROW_WISE = {"Relu", "LeakyRelu", "Sigmoid", "Tanh", "Elu", "Selu", "Gelu", "Erf", "Exp", "Log", "Neg", "Abs", "Sqrt",
            "Reciprocal", "Softplus", "HardSigmoid", "Clip", "Cast", "Identity", "Not", "IsNaN", "Sign", "Floor",
            "Ceil", "Round", "Softmax", "LogSoftmax", "LayerNormalization", "Dropout", "Sin", "Cos", "Swish"}
# ops whose inputs broadcast numpy-style to the output (eliminate-identity's broadcast rules read this set too)
BROADCASTING = {"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Sum", "Where", "And", "Or", "Xor", "Equal",
                "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Mod", "BitShift"}
REDUCING = {"ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
            "ReduceLogSumExp", "ReduceSumSquare"}
DEPTH = 64  # steps followed back from one value (a chain of layers is a few per layer)
STANDARD = (None, "", "ai.onnx")


def shape_entries(t: gs.Tensor, depth: int = 0) -> list | None:
    """The entries of an integer vector (or scalar) built from constants and Shape ops: each an int or a
    (value, axis) pair naming that value's size there; None when some entry is neither."""
    value = const_value(t)
    if value is not None:
        return [int(v) for v in value.ravel()] if value.dtype.kind in "iu" and value.ndim <= 1 else None
    if len(t.inputs) != 1 or depth > DEPTH:
        return None
    node = t.inputs[0]
    if node.domain not in STANDARD:
        return None
    if node.op in ("Concat", "Squeeze", "Unsqueeze") and rank_of(t) not in (0, 1):
        return None  # entries of a vector only
    if node.op == "Shape":
        rank = rank_of(node.inputs[0])
        if rank is None:
            return None
        start, end = node.attrs.get("start", 0), node.attrs.get("end", rank)
        return [(node.inputs[0], a) for a in range(rank)][slice(start, end)]
    if node.op in ("Cast", "Identity", "Squeeze", "Unsqueeze"):  # on shape values: rank 0 or 1, entries unchanged
        if node.op == "Cast" and not np.issubdtype(np.dtype(t.dtype or np.int64), np.integer):
            return None
        return shape_entries(node.inputs[0], depth + 1)
    if node.op == "Concat":
        parts = [shape_entries(x, depth + 1) for x in node.inputs]
        return None if any(p is None for p in parts) else [e for p in parts for e in p]
    entries = shape_entries(node.inputs[0], depth + 1) if node.inputs else None
    if entries is None:
        return None
    if node.op == "Gather" and node.attrs.get("axis", 0) == 0:
        index = const_value(node.inputs[1])
        if index is None or index.ndim > 1 or not all(-len(entries) <= i < len(entries) for i in index.ravel()):
            return None
        return [entries[int(i)] for i in index.ravel()]
    if node.op == "Slice" and len(node.inputs) >= 3:
        bounds = [const_value(x) for x in node.inputs[1:]]
        if any(b is None or b.size != 1 for b in bounds) or (len(bounds) > 2 and int(bounds[2].ravel()[0]) != 0):
            return None
        step = int(bounds[3].ravel()[0]) if len(bounds) > 3 else 1
        return entries[slice(int(bounds[0].ravel()[0]), int(bounds[1].ravel()[0]), step)] if step else None
    return None


def _axis(t: gs.Tensor, axis: int) -> int | None:
    rank = rank_of(t)
    return None if rank is None or not -rank <= axis < rank else axis % rank


def _broadcast_source(node: gs.Node, axis: int, rank: int) -> tuple | None:
    """The one input that sets the size of an elementwise op's output along `axis`: every other input has size 1
    there or lacks the axis (shapes known)."""
    candidates = []
    for x in node.inputs:
        shape = shape_of(x)
        if shape is None:
            return None
        at = axis - (rank - len(shape))
        if at < 0 or shape[at] == 1:
            continue
        candidates.append((x, at))
    if len(candidates) > 1 and all(same_size(candidates[0], c) for c in candidates[1:]):
        return candidates[0]   # inputs of one size there by construction: any of them sets the output's
    return candidates[0] if len(candidates) == 1 else None


DOMAIN_OF = {"FusedGemm": ("com.microsoft",), "FusedMatMul": ("com.microsoft",),
             "GatherRows": ("ai.ctropt.kernels",), "GatherRowsInt64": ("ai.ctropt.kernels",),
             "GatherFields": ("ai.ctropt.kernels",)}


def _kept_axis(node: gs.Node, axis: int, rank: int) -> tuple | None:
    """(input, axis) whose size the output of `node` has along `axis` by the op's definition, or None."""
    op, x = node.op, node.inputs[0] if node.inputs else None
    if node.domain not in DOMAIN_OF.get(op, STANDARD) or x is None:
        return None
    if op in ROW_WISE:
        return x, axis
    if op in BROADCASTING or op == "PRelu":   # PRelu: its slope broadcasts to x
        return _broadcast_source(node, axis, rank)
    if op in ("Gemm", "FusedGemm"):
        if axis == 0:
            return x, 1 if node.attrs.get("transA", 0) else 0
        return node.inputs[1], 0 if node.attrs.get("transB", 0) else 1
    if op == "MatMul" or op == "FusedMatMul" and not any(node.attrs.get(a, 0) for a in ("transA", "transBatchA")):
        a, b = rank_of(x), rank_of(node.inputs[1])
        if a == rank and b == 2 and axis < rank - 1:
            return x, axis
        return None
    if op == "Concat":
        return (x, axis) if _axis(node.outputs[0], node.attrs.get("axis", 0)) != axis else None
    if op in ("Gather", "GatherRows", "GatherRowsInt64"):
        g, indices = _axis(x, node.attrs.get("axis", 0)), rank_of(node.inputs[1])
        if g is None or indices is None:
            return None
        return (x, axis) if axis < g else (node.inputs[1], axis - g) if axis < g + indices else (x, axis - indices + 1)
    if op in ("Unsqueeze", "Squeeze") and (axes := axes_of(node)) is not None and rank_of(x) is not None:
        return _squeeze_kept(op, x, axis, rank, axes)
    if op == "Transpose" and "perm" in node.attrs:
        return x, int(node.attrs["perm"][axis])
    if op == "Reshape" and len(node.inputs) > 1:
        return _reshape_kept(node, x, axis)
    if op == "Expand" and len(node.inputs) > 1:
        return _expanded_from(node, x, axis, rank)
    if op == "Flatten" and axis == 0 and node.attrs.get("axis", 1) == 1:
        return x, 0
    if op == "Slice" and len(node.inputs) >= 3:   # an axis it does not slice (opset 10+: bounds as inputs)
        starts = const_value(node.inputs[1])
        axes = const_value(node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3].name else \
            (np.arange(starts.size) if starts is not None else None)
        return (x, axis) if axes is not None and axis not in [int(a) % rank for a in axes.ravel()] else None
    if op == "GatherFields" and axis == 0 and len(node.inputs) > 2:
        return node.inputs[2], 0   # its rows: the first ids part's
    if op in REDUCING and (axes := axes_of(node)) is not None and rank_of(x) is not None:
        if not axes:   # no axes: every axis reduced, unless noop_with_empty_axes
            return (x, axis) if node.attrs.get("noop_with_empty_axes", 0) else None
        reduced = {a % rank_of(x) for a in axes}
        kept = [a for a in range(rank_of(x)) if node.attrs.get("keepdims", 1) or a not in reduced]
        return (x, kept[axis]) if axis < len(kept) and kept[axis] not in reduced else None
    return None


def _squeeze_kept(op: str, x: gs.Tensor, axis: int, rank: int, axes: list) -> tuple | None:
    """(x, its axis) that output `axis` of an Unsqueeze (axes inserted) or Squeeze (axes removed) of x is."""
    if op == "Unsqueeze":
        inserted = {a % rank for a in axes}
        return None if axis in inserted else (x, axis - sum(a < axis for a in inserted))
    removed = {a % rank_of(x) for a in axes}
    kept = [a for a in range(rank_of(x)) if a not in removed]
    return (x, kept[axis]) if axis < len(kept) else None


def _expanded_from(node: gs.Node, x: gs.Tensor, axis: int, rank: int) -> tuple | None:
    """Expand(x, shape) along `axis`: the entry of a shape read from another value's Shape, where x has size 1 or
    lacks the axis (fuse-parallel-embeddings' offsets Expanded to the ids' shape)."""
    entries, shape = shape_entries(node.inputs[1]), shape_of(x)
    if entries is None or shape is None or len(entries) != rank:
        return None
    at = axis - (rank - len(shape))
    entry = entries[axis]
    return entry if isinstance(entry, tuple) and (at < 0 or shape[at] == 1) else None


def _reshape_kept(node: gs.Node, x: gs.Tensor, axis: int) -> tuple | None:
    """A Reshape keeps an axis it copies (0 in its target), and the first axis when every other size, before and
    after, is a known int and their products are equal."""
    target = const_value(node.inputs[1])
    if target is None:   # a computed shape: an entry read from another value's Shape is that value's size
        entries = shape_entries(node.inputs[1])
        if not entries or axis >= len(entries):
            return None
        if isinstance(entries[axis], tuple):
            return entries[axis]
        if not all(isinstance(e, int) for e in entries):
            return None
        target = np.array(entries)   # made of constants only
    if axis >= target.size:
        return None
    if target[axis] == 0:   # a copy of x's size, unless allowzero (then a literal 0)
        return None if node.attrs.get("allowzero", 0) else (x, axis)
    rest, shape = [int(v) for v in target.ravel()[1:]], shape_of(x)
    if axis == 0 and shape and all(v > 0 for v in rest) and all(isinstance(d, (int, np.integer)) and d > 0
                                                                 for d in shape[1:]):
        return (x, 0) if int(np.prod(rest)) == int(np.prod([int(d) for d in shape[1:]])) else None
    return None


def size_source(t: gs.Tensor, axis: int) -> tuple | None:
    """One step back: the (value, axis) that `t` takes its size along `axis` from, or None."""
    rank = rank_of(t)
    if len(t.inputs) != 1 or rank is None or t is not t.inputs[0].outputs[0]:
        return None
    return _kept_axis(t.inputs[0], axis, rank)


def _graph_input(t: gs.Tensor) -> bool:
    return not t.inputs and not isinstance(t, gs.Constant)


_MEMO: dict | None = None   # during one same_size call: chains by (value, axis), and how deep calls are nested
NESTING = 48   # same_size calls inside same_size (an elementwise op's inputs compared): deeper, nothing is proven


def _chain(t: gs.Tensor, axis: int) -> list[tuple]:
    """(value, axis) pairs from (t, axis) back through the ops that keep the axis's size, t's first (memoized for
    the outermost same_size call: an elementwise op compares its inputs' chains, which would otherwise be walked
    again for each op above it)."""
    key = (id(t), axis)
    if _MEMO is not None and key in _MEMO:
        return _MEMO[key]
    steps = _walk(t, axis)
    if _MEMO is not None:
        _MEMO[key] = steps
    return steps


def _walk(t: gs.Tensor, axis: int) -> list[tuple]:
    steps, step = [], (t, _axis(t, axis))
    for _ in range(DEPTH):
        if step[1] is None:
            break
        steps.append(step)
        back = size_source(*step)
        if back is None:
            break
        step = (back[0], _axis(back[0], back[1]))
    return steps


def _joins(node: gs.Node) -> tuple[list, list] | None:
    """(values, axes) that `node` requires of one size: a Concat's inputs on each axis but its own; a GatherFields'
    parts (its ids and dense values) on axis 0, which the kernel checks."""
    if node.op == "Concat" and node.domain in STANDARD and len(node.inputs) >= 2:
        rank = rank_of(node.outputs[0]) or rank_of(node.inputs[0])
        return (list(node.inputs), sorted(set(range(rank)) - {node.attrs.get("axis", 0) % rank})) if rank else None
    if node.op == "GatherFields" and node.domain in DOMAIN_OF["GatherFields"] and len(node.inputs) > 3:
        return list(node.inputs[2:]), [0]
    return None


def _joined(graph: gs.Graph, roots: tuple[tuple, tuple]) -> bool:
    """Whether a node of `graph` joins values whose chains end at the two roots (`_joins`: it runs only when they
    have one size there)."""
    want = {(id(t), axis) for t, axis in roots}
    for node in graph.nodes:
        joins = _joins(node)
        for axis in joins[1] if joins else ():
            ends = {(id(c[-1][0]), c[-1][1]) for c in (_chain(x, axis) for x in joins[0]) if c}
            if want <= ends:
                return True
    return False


def same_size(a: tuple, b: tuple, graph: gs.Graph | None = None) -> bool:
    """Whether (value, axis) pairs a and b have the same size by construction: equal known ints, or one chain of
    size-keeping ops leads back from both to one (value, axis); given the graph, also when a Concat on another
    axis (or a GatherFields' parts) joins values whose chains end where theirs do."""
    global _MEMO
    outer = _MEMO is None
    if outer:
        _MEMO = {"nesting": 0}
    elif _MEMO["nesting"] >= NESTING:
        return False
    _MEMO["nesting"] += 1
    try:
        return _same_size(a, b, graph)
    finally:
        _MEMO["nesting"] -= 1
        if outer:
            _MEMO = None


def _same_size(a: tuple, b: tuple, graph: gs.Graph | None) -> bool:
    (ta, xa), (tb, xb) = a, b
    xa, xb = _axis(ta, xa), _axis(tb, xb)
    if xa is None or xb is None:
        return False
    da, db = shape_of(ta)[xa], shape_of(tb)[xb]
    if isinstance(da, (int, np.integer)) and isinstance(db, (int, np.integer)):
        return int(da) == int(db)
    chain_a, chain_b = _chain(ta, xa), _chain(tb, xb)   # each starts at the pair itself
    seen = {(id(t), axis) for t, axis in chain_a}
    if any((id(t), axis) in seen for t, axis in chain_b):
        return True
    (ra, ia), (rb, ib) = chain_a[-1], chain_b[-1]
    named = shape_of(ra)[ia]
    if isinstance(named, str) and named and named == shape_of(rb)[ib] and _graph_input(ra) and _graph_input(rb):
        return True   # graph inputs with one named dim: one size, in ONNX's meaning (TensorRT checks it so)
    return graph is not None and _joined(graph, (chain_a[-1], chain_b[-1]))


def source_dim(t: gs.Tensor, axis: int):
    """The size of (t, axis) as the value its chain of size-keeping ops starts from declares it (a graph input's
    named batch dim, where inference gave t a symbol of its own), else t's own."""
    chain = _walk(t, axis)
    if not chain:
        return None
    root, at = chain[-1]
    dim = shape_of(root)[at]
    return dim if dim not in (None, "") else shape_of(t)[_axis(t, axis)]


def is_own_shape(x: gs.Tensor, shape: gs.Tensor, allowzero: int = 0) -> bool:
    """Whether the computed `shape` is `x`'s own shape entry by entry (a Reshape to it does nothing)."""
    entries, dims = shape_entries(shape), shape_of(x)
    if entries is None or dims is None or len(entries) != len(dims):
        return False
    free = [i for i, e in enumerate(entries) if e == -1]
    for i, e in enumerate(entries):
        if isinstance(e, tuple):
            if not same_size((x, i), e):
                return False
        elif e == 0 and not allowzero:
            continue
        elif e != -1 and not (isinstance(dims[i], (int, np.integer)) and int(dims[i]) == e):
            return False
    return len(free) <= 1
