"""The first FC layer over user and item features split in two, ``x·W = x_u·W_u + x_i·W_i``, so that its user part
depends on the user alone (dedup-user-side then computes it once per distinct user, with the user's lookups).

A dense ranker (WDL, DeepFM, DCN, MMoE) joins every feature's embedding, user and item alike, in one Concat that
its first layer reads, so nothing above the lookups is the user's alone. Given the user side (``--user-inputs``),
the layer's input is read as its parts, each part classified as user side (computed from user inputs and constants
only) or not, and W's rows split alike. Dialects of that input:
- a Concat on the last axis of [B, k] parts (PaddleRec: per-feature lookups reshaped to [B, E] and the dense
  values; deepctr's DNN input), nested;
- a Flatten/Reshape to [B, K] of a Concat on axis 1 of [B, k, E] pieces (FuxiCTR's torch.stack of [B, E]
  embeddings, an Unsqueeze each), or on axis 2 of [B, 1, E] pieces (deepctr through tf2onnx), and a Reshape to the
  shape the value has (tf2onnx's Tensordot).
Not read: one lookup over the ids of every feature concatenated (PaddleRec's DeepFM and DCN): no value above the ids
is the user's alone there.
MatMul by a constant W, or Gemm: the user part is a Gemm with the layer's bias (a Gemm's C and beta, or the Add of
a per-column constant that follows a MatMul), or a MatMul by alpha·W_u when there is none; the item part is
Gemm(x_i, W_i, C = the user part), so the user's rows and the bias are added inside the item GEMM (and onnxruntime
fuses a Relu after it). The sum's order changes (two partial products): the result agrees to float rounding.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_graphsurgeon as gs

from ...graph.edit import Builder, axes_of, const_value, replace_outputs, shape_of
from ...runtime.inputs import analyze_inputs
from .fc import per_column


@dataclasses.dataclass
class Part:
    """Columns of the layer's input: `value` ([B, width]), or `value` [B, k, E] read flat (`flat` True)."""

    value: gs.Tensor
    width: int
    flat: bool = False


def is_user_input(t: gs.Tensor, f, shapes: list, named: set[str]) -> bool:
    """Whether input t (facts f, its shapes as known: static or probed) is the user's: named, a length, a mask, or an id
    history ([B, T] ints, T not 1, not columns of a packed input)."""
    ints = t.dtype is not None and np.issubdtype(np.dtype(t.dtype), np.integer)
    history = ints and bool(shapes) and all(len(s) == 2 and s[1] not in (0, 1) for s in shapes) and \
        not (f.columns or f.regions)
    return t.name in named or f.is_length or f.is_mask or history


def column_seeds(inp: gs.Tensor, columns: set[int]) -> list[gs.Tensor]:
    """Slices of `inp` along axis 1 that read only user columns (deepctr-torch packs features in one matrix)."""
    seeds = []
    for n in inp.outputs:
        if n.op != "Slice" or len(n.inputs) < 4:
            continue
        starts, ends, axes = (const_value(t) for t in n.inputs[1:4])
        if starts is None or ends is None or axes is None or list(axes.reshape(-1)) != [1]:
            continue
        s, e = int(starts.reshape(-1)[0]), int(ends.reshape(-1)[0])
        width = (shape_of(inp) or [None, None])[1]
        e = min(e, int(width)) if isinstance(width, (int, np.integer)) else e   # torch's X[:, 8:] ends at 2^63 - 1
        if 0 <= s < e and e - s <= len(columns) and all(c in columns for c in range(s, e)):
            seeds.append(n.outputs[0])
    return seeds


def _user_inputs(graph: gs.Graph, named: set[str], columns: dict[str, set[int]]) -> list[gs.Tensor]:
    """The inputs dedup-user-side takes as the user's, read off their static shapes, and the slices of packed
    inputs that read only columns declared the user's."""
    facts = analyze_inputs(graph)
    seeds = [t for t in graph.inputs if is_user_input(t, facts[t.name], [shape_of(t) or []], named)]
    return seeds + [s for t in graph.inputs if columns.get(t.name) for s in column_seeds(t, columns[t.name])]


def user_side(graph: gs.Graph, named: set[str], columns: dict[str, set[int]] | None = None) -> set[int]:
    """Ids of the values computed from the user's inputs (and declared columns) and constants only (graph order)."""
    side = {id(t) for t in _user_inputs(graph, named, columns or {})}
    for n in graph.nodes:
        values = [u for u in n.inputs if u.name and const_value(u) is None]
        if values and all(id(u) in side for u in values):
            side.update(id(o) for o in n.outputs)
    return side


def _width(t: gs.Tensor) -> int | None:
    shape = shape_of(t)
    if shape is None or len(shape) != 2 or not isinstance(shape[1], (int, np.integer)) or shape[1] <= 0:
        return None
    return int(shape[1])


def _pieces(t: gs.Tensor) -> list[Part] | None:
    """The pieces of a [B, K] value made by flattening a Concat of [B, k, E] pieces on axis 1, or of [B, 1, E] pieces
    on axis 2 (each piece then a block of columns), else None."""
    p = t.inputs[0] if t.inputs else None
    if p is None or p.op not in ("Flatten", "Reshape") or (p.op == "Flatten" and p.attrs.get("axis", 1) != 1):
        return None
    cat = p.inputs[0].inputs[0] if p.inputs[0].inputs else None
    if cat is None or cat.op != "Concat" or cat.attrs.get("axis") not in (1, -2, 2, -1):
        return None
    parts = []
    for x in cat.inputs:
        shape = shape_of(x)
        if shape is None or len(shape) != 3 or not all(isinstance(d, (int, np.integer)) and d > 0 for d in shape[1:]):
            return None
        if cat.attrs.get("axis") in (2, -1) and shape[1] != 1:
            return None
        u = x.inputs[0] if x.inputs else None
        if u is not None and u.op == "Unsqueeze" and axes_of(u) in ([1], [-2]) and _width(u.inputs[0]) == shape[2]:
            parts.append(Part(u.inputs[0], int(shape[2])))   # torch.stack's Unsqueeze of a [B, E] embedding
        else:
            parts.append(Part(x, int(shape[1] * shape[2]), flat=True))
    return parts if sum(q.width for q in parts) == _width(t) else None


def layer_parts(t: gs.Tensor) -> list[Part] | None:
    """The parts of a layer's input t ([B, K]), in column order; None when it is not of static width."""
    width = _width(t)
    if width is None:
        return None
    p = t.inputs[0] if t.inputs else None
    if p is not None and p.op in ("Reshape", "Flatten") and _width(p.inputs[0]) == width:
        return layer_parts(p.inputs[0])   # a reshape to the shape it has (tf2onnx's Tensordot)
    if p is not None and p.op == "Concat" and p.attrs.get("axis") in (1, -1):
        parts = []
        for x in p.inputs:
            inner = layer_parts(x)
            if inner is None:
                return None
            parts += inner
        return parts if sum(q.width for q in parts) == width else None
    return _pieces(t) or [Part(t, width)]


def _layer(node: gs.Node) -> tuple[np.ndarray, bool] | None:
    """(W, transposed) of a MatMul/Gemm by a constant 2-D W that splits by its input's columns."""
    w = const_value(node.inputs[1]) if len(node.inputs) > 1 else None
    if w is None or w.ndim != 2 or w.dtype != np.float32:
        return None
    if node.op == "MatMul":
        return w, False
    if node.op == "Gemm" and not node.attrs.get("transA", 0):
        return w, bool(node.attrs.get("transB", 0))
    return None


def _bias_fits(graph: gs.Graph, node: gs.Node, layer: tuple) -> bool:
    """A Gemm's C, which the user half takes, is a per-column constant (so it stays the user's alone and broadcasts
    to the distinct users' rows), in an opset whose Gemm broadcasts it without the `broadcast` attribute (7+)."""
    if node.op != "Gemm" or len(node.inputs) < 3 or not node.inputs[2].name:
        return True
    width = layer[0].shape[0] if layer[1] else layer[0].shape[1]
    return per_column(node.inputs[2], width) is not None and int(getattr(graph, "opset", None) or 13) >= 7


def split_user_layers(graph: gs.Graph, named: set[str], columns: dict[str, set[int]] | None = None) -> list[gs.Node]:
    """Split every first layer whose input has both user and item parts; returns the user halves' nodes."""
    side, halves = user_side(graph, named, columns), []
    for node in [n for n in graph.nodes if n.op in ("MatMul", "Gemm") and not n.domain]:
        layer, parts = _layer(node), layer_parts(node.inputs[0])
        if layer is None or not parts or len(parts) < 2 or not _bias_fits(graph, node, layer):
            continue
        is_user = [id(q.value) in side for q in parts]
        if all(is_user) or not any(is_user):
            continue
        halves.append(_split(graph, node, layer, parts, is_user))
    return halves


def _bias_after(graph: gs.Graph, node: gs.Node) -> tuple[gs.Tensor, gs.Node] | None:
    """(bias, its Add) when a MatMul's output is read only by an Add of a per-column constant ([N] or [1, N])."""
    out = node.outputs[0]
    readers = out.outputs
    if node.op != "MatMul" or len(readers) != 1 or readers[0].op != "Add" or out in graph.outputs:
        return None
    add = readers[0]
    other = add.inputs[1 - add.inputs.index(out)] if len(add.inputs) == 2 else None
    value = const_value(other) if other is not None else None
    width = const_value(node.inputs[1]).shape[1]
    if value is None or value.dtype != np.float32 or value.shape not in ((width,), (1, width)):
        return None
    return other, add


def _split(graph: gs.Graph, node: gs.Node, layer: tuple, parts: list[Part], is_user: list[bool]) -> gs.Node:
    """The layer as two halves; returns the user half's node. The user half, x_u·W_u (+ the layer's bias: a
    Gemm's C, or the Add of a per-column constant that follows a MatMul), is the item half's C:
    Gemm(x_i, W_i, C = user half), so the user's rows and the bias are added in the item GEMM (and a Relu after it
    fuses with it in onnxruntime)."""
    w, transposed = layer
    b = Builder(graph, f"{node.name}/by_user", node.outputs[0].dtype)
    starts = np.cumsum([0] + [q.width for q in parts])
    alpha = float(node.attrs.get("alpha", 1.0)) if node.op == "Gemm" else 1.0
    bias, beta, after = None, float(node.attrs.get("beta", 1.0)), None
    if node.op == "Gemm" and len(node.inputs) > 2 and node.inputs[2].name:
        bias = node.inputs[2]   # a per-column constant (split_user_layers checks it)
    elif (found := _bias_after(graph, node)) is not None and b.opset >= 7:
        (bias, after), beta = found, 1.0
    xs, ws = {}, {}
    for user in (False, True):
        mine = [i for i, u in enumerate(is_user) if u == user]
        rows = np.concatenate([np.arange(starts[i], starts[i + 1]) for i in mine])
        flat = [b.op("Reshape", [q.value, b.const("flat", np.array([0, q.width], np.int64))]) if q.flat else q.value
                for q in (parts[i] for i in mine)]
        xs[user] = flat[0] if len(flat) == 1 else b.op("Concat", flat, {"axis": 1},
                                                        name="user_part" if user else "item_part")
        ws[user] = w[:, rows] if transposed else w[rows]
    trans = {"transB": 1} if transposed else {}
    if bias is None:   # a MatMul by alpha·W_u
        scaled = ((ws[True].T if transposed else ws[True]) * np.float32(alpha)).astype(np.float32)
        user = b.op("MatMul", [xs[True], b.const("W_user", scaled)])
    else:
        user = b.op("Gemm", [xs[True], b.const("W_user", ws[True]), bias], {"alpha": alpha, "beta": beta, **trans})
    end = after if after is not None else node
    out = end.outputs[0]
    total = b.op("Gemm", [xs[False], b.const("W_item", ws[False]), user], {"alpha": alpha, **trans},
                 dtype=out.dtype, shape=out.shape)
    replace_outputs(graph, end, [total])
    for done in [node] + ([after] if after is not None else []):
        done.inputs.clear()
        graph.nodes.remove(done)
    return user.inputs[0]
