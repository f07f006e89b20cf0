"""`attention-core-kernel`: the core of scaled dot-product attention, ``softmax(s · Q·Kᵀ + bias) · V``, → one
``ai.ctropt.kernels::AttentionCore`` node for onnxruntime.

Behaviour-sequence transformers (BST, TransAct, SASRec) and AutoInt attend over short histories (L = 9–51) with small
heads (8–32 wide), so onnxruntime spends their attention in per-head overheads: a batched MatMul per head for Q·Kᵀ
and for P·V, a Softmax over rows of L, the scale and the mask each a pass over [B, H, L, L]. Its own fused forms do
not help on CPU (1 thread, B = 256, L = 21, D = 24, two heads: com.microsoft MultiHeadAttention 0.72×, Attention
1.00×, the ONNX Attention op of opset 23 1.22× the decomposed graph; `git show 8b89a5f:benchmarks/RESULTS.md`). The kernel computes
each head's rows LANES at a time with the softmax in registers.

Found by what it computes, in whichever dialect: a MatMul reading a Softmax over the last axis of
``[MatMul(Q, Kᵀ) scaled by constants] [+ bias | - bias]``, the scale on Q, on Kᵀ or on the scores (a torch export
scales both by √s), the bias any float value of rank 4 at most (a key-padding, causal or additive mask made by the
export; the kernel broadcasts it as the Add does). A bias that is Where(mask, c, 0), or c times the mask as 0/1
floats (tf2onnx's c·Cast(Not(mask)), or (1 - Cast(mask))·c), is read from the boolean mask itself (the Where,
or the Cast and Mul, passes over [B·H, L, L], are not run). Heads that tf splits off the last axis and stacks on
the batch axis, concat(split(x, H, -1), 0), are read from x in place, and the kernel writes them merged back; so
are Q, K and V that torch's nn.MultiheadAttention selects out of one packed projection (a Gather of index 0, 1, 2,
then the heads split into the batch: the kernel reads the projection with a select). deepctr's dialect (tf2onnx):
the key mask as tf's where(m, s, pad), written Cast(m)·s + Cast(Not(m))·pad, is read as the mask (the score is pad
where masked: mask_replace; the same where the scores are finite), and the max its softmax subtracts first is
dropped (the kernel subtracts it); a value per query row that multiplies the probabilities multiplies the output instead. A
Transpose that makes Q, Kᵀ or V (heads split out of a projection, sequence-first layouts) is read by the kernel
through strides instead of being run, and so is one that merges the heads back after it (the kernel writes that
layout). Float32 only, ranks 2–4.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from ... import kernels
from ...graph import CtroptError, annotate_shapes_if_bare
from ...graph.edit import add_constant, axes_of, const_value, is_all_zeros, rank_of, read_once, replace_outputs, shape_of
from ...patterns import Match, P, Rewrite, Var
from ..registry import PassContext, register_pass

FORMS = ("auto", "kernel", "standard")


def _scalar(t: gs.Tensor, of: gs.Tensor) -> float | None:
    """The float constant t holds, when it is one value that does not raise the rank of `of` (what it scales)."""
    v, rank = const_value(t), rank_of(of)
    if v is None or v.size != 1 or v.dtype.kind != "f" or rank is None or v.ndim > rank:
        return None
    return float(v.reshape(-1)[0])


def _unscaled(t: gs.Tensor, graph: gs.Graph, alone: bool = True) -> tuple[gs.Tensor, float]:
    """`t` without the Mul/Div by scalar constants that made it (each read only here, unless not `alone`), and their
    product."""
    scale = 1.0
    while t.inputs and t.inputs[0].op in ("Mul", "Div") and (read_once(t, graph) or not alone):
        node = t.inputs[0]
        c, x = _scalar(node.inputs[1], node.inputs[0]), node.inputs[0]
        if node.op == "Mul" and c is None:
            c, x = _scalar(node.inputs[0], node.inputs[1]), node.inputs[1]
        if c is None or c == 0.0:
            break
        scale, t = scale * (c if node.op == "Mul" else 1.0 / c), x
    return t, scale


@dataclass
class Stacked:
    """Heads split off the last axis and stacked on the first, tf's concat(split(x, H, axis=-1), axis=0): x
    [B, L, H·d] read as [H·B, L, d] (the kernel reads x as [B, L, H, d] with its heads' axis first)."""
    x: gs.Tensor
    heads: int


def _stacked(t: gs.Tensor, graph: gs.Graph) -> Stacked | None:
    """t = Concat(Split(x, H equal parts, last axis), axis 0), the parts in order and read only there."""
    node = t.inputs[0] if t.inputs and read_once(t, graph) else None
    if node is None or node.op != "Concat" or node.attrs.get("axis") != 0 or len(node.inputs) < 2:
        return None
    split = node.inputs[0].inputs[0] if node.inputs[0].inputs else None
    if split is None or split.op != "Split" or list(split.outputs) != list(node.inputs) or rank_of(split.inputs[0]) != 3:
        return None
    width = (shape_of(split.inputs[0]) or [None])[-1]
    if split.attrs.get("axis", 0) not in (-1, 2) or not isinstance(width, int) or width % len(node.inputs) or \
            not _equal_parts(split) or any(not read_once(o, graph) for o in split.outputs):
        return None
    return Stacked(split.inputs[0], len(node.inputs))


def _equal_parts(split: gs.Node) -> bool:
    """Whether a Split cuts equal parts: its sizes constant and all one, or none given (num_outputs, even)."""
    if len(split.inputs) > 1 and split.inputs[1].name:
        sizes = const_value(split.inputs[1])
        return sizes is not None and len({int(x) for x in np.ravel(sizes)}) == 1
    sizes = split.attrs.get("split")
    return sizes is None or len(set(sizes)) == 1


@dataclass
class Packed:
    """Q, K or V selected out of one packed projection and its heads split, torch nn.MultiheadAttention's
    Reshape(Gather(p, c, axis), [.., n·H, d]): p read with its last axis split into (H, d) and index c of `axis`
    selected (the kernel reads it in place), the heads an axis of their own."""
    p: gs.Tensor
    axis: int
    index: int
    heads: int
    depth: int


def _packed(t: gs.Tensor, graph: gs.Graph) -> tuple[Packed, dict] | None:
    """t = Reshape(Gather(p, c, axis), ...) that splits the gathered value's last axis into (H, d) and merges H into
    the axis before it; with the map from t's axes to those of the value the kernel reads (p split, c selected)."""
    node = t.inputs[0] if t.inputs and read_once(t, graph) else None
    gather = node.inputs[0].inputs[0] if node is not None and node.op == "Reshape" and node.inputs[0].inputs else None
    if gather is None or gather.op != "Gather" or not read_once(node.inputs[0], graph):
        return None
    c, p = const_value(gather.inputs[1]), gather.inputs[0]
    g, out, rank = shape_of(node.inputs[0]), shape_of(t), rank_of(p)
    if c is None or c.ndim != 0 or g is None or out is None or rank is None or len(out) != len(g) or len(g) != 3:
        return None
    axis, k, index = int(gather.attrs.get("axis", 0)) % rank, len(g), int(c)
    if index < 0:
        index += (shape_of(p) or [None] * rank)[axis] if isinstance((shape_of(p) or [None] * rank)[axis], int) else 0
    if index < 0:
        return None
    width, depth = g[-1], out[-1]
    if not isinstance(width, (int, np.integer)) or not isinstance(depth, (int, np.integer)) or width % depth or \
            width == depth or axis == rank - 1 or any(a != b or a is None for a, b in zip(g[:k - 2], out[:k - 2])):
        return None
    heads = width // depth
    if isinstance(g[k - 2], (int, np.integer)) and out[k - 2] != g[k - 2] * heads:
        return None
    axes = {i: [i] for i in range(k - 2)}
    axes.update({k - 2: [k - 2, k - 1], k - 1: [k]})
    return Packed(p, axis, index, int(heads), int(depth)), axes


def _source(t: gs.Tensor, graph: gs.Graph, packed: bool = True) -> tuple[gs.Tensor | Stacked | Packed, list[int] | None,
                                                                       float]:
    """`t` as (value, perm, scale): t = scale · Transpose(value, perm), the Transpose (perm None: none) and the scalar
    Mul/Div it strips each read only here; heads stacked on the batch axis as Stacked, with the rank-4 perm that
    reads them."""
    t, scale = _unscaled(t, graph)
    node = t.inputs[0] if t.inputs else None
    perm = None
    if node is not None and node.op == "Transpose" and read_once(t, graph) and rank_of(node.inputs[0]) is not None:
        rank = rank_of(node.inputs[0])
        perm = [int(p) for p in node.attrs.get("perm", range(rank - 1, -1, -1))]
        t, inner = _unscaled(node.inputs[0], graph)
        scale *= inner
    stacked = _stacked(t, graph) if rank_of(t) == 3 else None
    if stacked is not None:
        axes = {0: [2, 0], 1: [1], 2: [3]}   # [H·B, L, d] in the axes of [B, L, H, d]
        return stacked, [a for p in (perm or [0, 1, 2]) for a in axes[p]], scale
    found = _packed(t, graph) if packed else None
    if found is not None:
        return found[0], [a for p in (perm or range(rank_of(t))) for a in found[1][p]], scale
    return t, perm, scale


def _merged_heads(out: gs.Tensor, graph: gs.Graph, heads: int) -> gs.Tensor | None:
    """The value that merges stacked heads back, Concat(Split(out, H, axis 0), last axis), when it is all that reads
    out."""
    split = out.outputs[0] if read_once(out, graph) else None
    if split is None or split.op != "Split" or split.attrs.get("axis", 0) != 0 or len(split.outputs) != heads or \
            not _equal_parts(split):
        return None
    concat = split.outputs[0].outputs[0] if read_once(split.outputs[0], graph) else None
    if concat is None or concat.op != "Concat" or list(concat.inputs) != list(split.outputs) or \
            concat.attrs.get("axis") not in (-1, 2) or any(not read_once(o, graph) for o in split.outputs):
        return None
    return concat.outputs[0]


def _where_mask(node: gs.Node) -> tuple[gs.Tensor, float, int] | None:
    """Where(mask, c, 0) or Where(mask, 0, c) (c one float, the zeros no larger than the mask) as (mask, c, the
    mask's value where c is added)."""
    if node.op != "Where" or node.inputs[0].dtype != np.bool_:
        return None
    cond, rank = node.inputs[0], rank_of(node.inputs[0])
    for on, (c, zeros) in ((1, node.inputs[1:]), (0, node.inputs[2:0:-1])):
        value, shape, cond_shape = _scalar(c, cond), shape_of(zeros), shape_of(cond)
        if value is None or not is_all_zeros(zeros) or shape is None or cond_shape is None or len(shape) > rank:
            continue
        if all(x == 1 or (x == y and x is not None) for x, y in zip(shape[::-1], cond_shape[::-1])):
            return cond, value, on
    return None


def _flag(t: gs.Tensor, graph: gs.Graph) -> tuple[gs.Tensor, int] | None:
    """t as 0/1 floats of a boolean mask: Cast(mask) (mask, 1), Cast(Not(mask)) or 1 - Cast(mask) (mask, 0)."""
    node = t.inputs[0] if t.inputs else None
    if node is not None and node.op == "Sub" and _scalar(node.inputs[0], node.inputs[1]) == 1.0:
        inner = _flag(node.inputs[1], graph)
        return (inner[0], 1 - inner[1]) if inner else None
    if node is None or node.op != "Cast" or node.inputs[0].dtype != np.bool_ or \
            node.attrs.get("to") != onnx.TensorProto.FLOAT:
        return None
    mask = node.inputs[0]
    if mask.inputs and mask.inputs[0].op == "Not":
        return mask.inputs[0].inputs[0], 0
    return mask, 1


def _as_mask(bias: gs.Tensor, graph: gs.Graph) -> tuple[gs.Tensor, float, int] | None:
    """A bias (read only here) that is a boolean mask's constant: Where(mask, c, 0) or Where(mask, 0, c), or c times
    the mask as 0/1 floats (tf2onnx's c·Cast(Not(mask)), (1 - Cast(mask))·c; c finite: ∞·0 is NaN), as (mask,
    c, the mask's value where c is added); None otherwise."""
    node = bias.inputs[0] if bias.inputs and read_once(bias, graph) else None
    if node is None:
        return None
    if node.op == "Where":
        return _where_mask(node)
    if node.op != "Mul":
        return None
    for c, x in ((node.inputs[0], node.inputs[1]), (node.inputs[1], node.inputs[0])):
        value, flag = _scalar(c, x), _flag(x, graph)
        if value is not None and np.isfinite(value) and flag is not None:
            return flag[0], value, flag[1]
    return None


def _fill_of(t: gs.Tensor, like: gs.Tensor) -> float | None:
    """The one value t holds, where it is no larger than `like`: a constant of size 1, ConstantOfShape(Shape(like)),
    or a product of those."""
    v = const_value(t)
    if v is not None:
        return float(v.reshape(-1)[0]) if v.size == 1 and v.ndim <= (rank_of(like) or 0) else None
    node = t.inputs[0] if t.inputs else None
    if node is not None and node.op == "Mul":
        a, b = (_fill_of(x, like) for x in node.inputs)
        return None if a is None or b is None else a * b
    shape = node.inputs[0].inputs[0] if node is not None and node.op == "ConstantOfShape" and node.inputs[0].inputs \
        else None
    if shape is None or shape.op != "Shape" or shape.inputs[0] is not like or shape.attrs.get("start", 0) or \
            shape.attrs.get("end") is not None:
        return None
    value = node.attrs.get("value")
    return float(np.ravel(value.values)[0]) if value is not None else 0.0


def _selected(t: gs.Tensor, graph: gs.Graph) -> tuple[gs.Tensor, gs.Tensor, float] | None:
    """t = Cast(m)·s + Cast(Not(m))·c, tf's where(m, s, c) as tf2onnx writes it (deepctr's attention), c one finite
    float: (s, m, c)."""
    node = t.inputs[0] if t.inputs else None   # read also by the max a softmax subtracts (_without_max)
    if node is None or node.op != "Add":
        return None
    for a, b in (node.inputs, node.inputs[::-1]):
        keep, drop = (x.inputs[0] if x.inputs and read_once(x, graph) and x.inputs[0].op == "Mul" else None
                      for x in (a, b))
        for (score, flag), (c, other) in ((p, q) for p in _pairs(keep) for q in _pairs(drop)):
            kept, dropped = _flag(flag, graph), _flag(other, graph)
            value = _fill_of(c, score)
            if kept and dropped and kept[0] is dropped[0] and (kept[1], dropped[1]) == (1, 0) and \
                    value is not None and np.isfinite(value):
                return score, kept[0], value
    return None


def _pairs(node: gs.Node | None) -> list[tuple[gs.Tensor, gs.Tensor]]:
    return [] if node is None else [tuple(node.inputs), tuple(node.inputs[::-1])]


def _without_max(t: gs.Tensor, graph: gs.Graph) -> gs.Tensor:
    """Softmax(x - max(x)) is Softmax(x): x, where the max over the last axis (GlobalMaxPool of a rank-3 value,
    ReduceMax keeping its axis) is subtracted before the softmax, read only there."""
    node = t.inputs[0] if t.inputs and read_once(t, graph) else None
    top = node.inputs[1].inputs[0] if node is not None and node.op == "Sub" and node.inputs[1].inputs and \
        read_once(node.inputs[1], graph) else None
    if top is None or top.inputs[0] is not node.inputs[0]:
        return t
    rank = rank_of(node.inputs[0])
    if (top.op == "GlobalMaxPool" and rank == 3) or (top.op == "ReduceMax" and top.attrs.get("keepdims", 1) and
                                                     rank and axes_of(top) in ([-1], [rank - 1])):
        return node.inputs[0]
    return t


def _per_row(t: gs.Tensor) -> gs.Tensor | None:
    """t as a value per query row, [.., S, 1]: t itself, or u where t = Tile(u, [1, .., 1, L])."""
    shape = shape_of(t)
    if shape is not None and shape[-1:] == [1]:
        return t
    node = t.inputs[0] if t.inputs else None
    reps = const_value(node.inputs[1]) if node is not None and node.op == "Tile" else None
    if reps is None or any(int(r) != 1 for r in np.ravel(reps)[:-1]) or (shape_of(node.inputs[0]) or [None])[-1] != 1:
        return None
    return node.inputs[0]


def read_core(m: Match) -> dict | str:
    """The attention core at the matched MatMul(Softmax(x), V): its Q, K (and whether given as Kᵀ), V, bias, scale
    and bias sign; a reason when it is not one."""
    g, scores = m.graph, m["scores"]
    rank = rank_of(scores)
    # before opset 13 Softmax flattens from `axis` (default 1) on: the last axis alone only when axis is the last
    axis = m.node("softmax").attrs.get("axis", -1 if int(g.opset or 13) >= 13 else 1)
    if rank is None or rank < 2 or rank > 4 or axis not in (-1, rank - 1):
        return "not a softmax over the last axis of a rank 2-4 value"
    core = {"bias": None, "bias_scale": 1.0}
    if "rowmul" in m.named_nodes:   # a value per query row times the probabilities: times the output instead
        core["rows"] = _per_row(m["rows"]) if read_once(m.node("softmax").outputs[0], g) else None
        if core["rows"] is None:
            return "a Mul after the softmax that is not a value per query row"
    t, outer = _unscaled(_without_max(scores, g), g)
    selected = _selected(t, g)
    if selected is not None:   # a scale outside the select scales the scores and the value they are replaced by
        if rank_of(selected[1]) is None or rank_of(selected[1]) > 4:
            return "a mask of unknown rank or rank above 4"
        core.update(mask=selected[1], mask_value=selected[2] * outer, mask_on=0, mask_replace=1)
        t, inner = _unscaled(selected[0], g, alone=False)   # its Shape read by the constant selected (dead then)
        outer *= inner
    node = t.inputs[0] if t.inputs and read_once(t, g) else None
    if node is not None and node.op in ("Add", "Sub"):
        for i in (0,) if node.op == "Sub" else (0, 1):   # a Sub's bias is what it subtracts
            base, _ = _unscaled(node.inputs[i], g)
            if base.inputs and base.inputs[0].op == "MatMul":
                core["bias"], core["bias_scale"] = node.inputs[1 - i], -1.0 if node.op == "Sub" else 1.0
                t = node.inputs[i]
                break
        else:
            return "the scores add no Q·Kᵀ product"
        if outer != 1.0:
            return "a scale after the bias"
    t, inner = _unscaled(t, g)
    mm = t.inputs[0] if t.inputs and read_once(t, g) else None
    if mm is None or mm.op != "MatMul":
        return "the softmax does not read a MatMul of Q and Kᵀ"
    q, q_perm, sq = _source(mm.inputs[0], g)
    k, kt_perm, sk = _source(mm.inputs[1], g)
    v, v_perm, sv = _source(m["v"], g)
    packed = [isinstance(x, Packed) for x in (q, k, v)]
    if any(packed) and (not all(packed) or len({x.heads for x in (q, k, v)}) != 1):   # read them as they are
        (q, q_perm, sq), (k, kt_perm, sk), (v, v_perm, sv) = (_source(x, g, packed=False)
                                                             for x in (mm.inputs[0], mm.inputs[1], m["v"]))
    if sv != 1.0 or rank_of(mm.inputs[1]) is None:
        return "V scaled, or Kᵀ of unknown rank"
    stacked = [isinstance(x, Stacked) for x in (q, k, v)]
    if any(stacked) and (not all(stacked) or len({x.heads for x in (q, k, v)}) != 1):
        return "heads stacked on the batch axis for some of Q, K and V only"
    r = len(kt_perm) if kt_perm else rank_of(mm.inputs[1])
    swap = list(range(r - 2)) + [r - 1, r - 2]   # K is Kᵀ with its last two axes swapped
    k_perm = [kt_perm[a] for a in swap] if kt_perm else swap
    core.update(q=q, k=k, v=v, scale=outer * inner * sq * sk, q_perm=q_perm, k_perm=k_perm, v_perm=v_perm)
    values = [x.x if isinstance(x, Stacked) else x.p if isinstance(x, Packed) else x for x in (q, k, v)] + \
        ([core["bias"]] if core["bias"] is not None else [])
    if any(v.dtype != np.float32 for v in values):
        return "not float32"
    if any(rank_of(x) is None or not 2 <= rank_of(x) <= 4 for x in values[:3]):
        return "Q, K or V of unknown rank or rank above 4"
    if core["bias"] is not None and (rank_of(core["bias"]) is None or rank_of(core["bias"]) > 4):
        return "a bias of unknown rank or rank above 4"
    if "mask" in core and core["bias"] is not None:
        return "a bias and a mask"
    mask = _as_mask(core["bias"], g) if core["bias"] is not None else None
    if mask is not None and rank_of(mask[0]) <= 4:
        core.update(bias=None, mask=mask[0], mask_value=mask[1] * core["bias_scale"], mask_on=mask[2])
    if all(stacked):
        return _with_stacked_heads(core, m)
    return _with_packed_heads(core, m.root.outputs[0]) if isinstance(q, Packed) else core


def _regrouped(core: dict, lead: list[int], form: str) -> dict | str:
    """The kernel reads the heads as an axis of their own: a [n·H, S, L] bias or mask (the heads merged into its
    first axis as Q, K and V had them) regrouped as `lead` + [S, L] (a Reshape, no copy)."""
    extra = core["mask"] if "mask" in core else core["bias"]
    shape = shape_of(extra) if extra is not None else []
    if shape is None or len(shape) == 4 or (len(shape) == 3 and shape[0] != 1 and
                                            not all(isinstance(d, int) for d in shape[1:])):
        return f"{form}, with a bias of unknown size"
    if len(shape) == 3 and shape[0] != 1:
        core["regroup"] = [*lead, *shape[1:]]
    return core


def _with_packed_heads(core: dict, out: gs.Tensor) -> dict | str:
    """Packed Q, K and V: the bias regrouped as [n, H, S, L]; the output's [S, dv] known (the kernel's
    [n, H, S, dv] is reshaped back to it)."""
    if any(not isinstance(d, int) for d in (shape_of(out) or [None])[-2:]) or "rows" in core:
        return "Q, K and V packed in one projection, the output's size unknown or a value per query row after it"
    return _regrouped(core, [-1, core["q"].heads], "Q, K and V packed in one projection")


def _with_stacked_heads(core: dict, m: Match) -> dict | str:
    """Stacked heads: the value that merges them back (the kernel writes it), and the bias regrouped as
    [H, B, S, L]."""
    heads = core["q"].heads
    rows = shape_of(core["rows"]) if "rows" in core else [1, 1, 1]
    if rows is None or len(rows) != 3 or not isinstance(rows[1], int):
        return "heads stacked on the batch axis, with a value per query row of unknown size"
    core["merged"] = _merged_heads(m.root.outputs[0], m.graph, heads)
    if core["merged"] is None:
        return "heads stacked on the batch axis, not merged back by a Split and a Concat"
    return _regrouped(core, [heads, -1], "heads stacked on the batch axis")


def _is_core(m: Match) -> bool | str:
    core = read_core(m)
    return core if isinstance(core, str) else True


def _to_kernel(m: Match) -> list:
    core = read_core(m)
    out = m.root.outputs[0]
    empty = gs.Variable.empty()
    inputs = [core["q"], core["k"], core["v"], core["bias"] if core["bias"] is not None else empty]
    attrs = {"scale": float(core["scale"]), "bias_scale": core["bias_scale"]}
    if "mask" in core:
        inputs.append(core["mask"])
        attrs.update(mask_value=float(core["mask_value"]), mask_on=core["mask_on"])
        if core.get("mask_replace"):
            attrs["mask_replace"] = 1
    while inputs[-1] is empty:
        inputs.pop()
    if "merged" in core:
        return _stacked_kernel(m, core, inputs, attrs)
    reader = out.outputs[0] if read_once(out, m.graph) and "rows" not in core else None
    if reader is not None and reader.op == "Transpose" and "perm" in reader.attrs and \
            len(reader.attrs["perm"]) == rank_of(out):   # heads merged back: the kernel writes that layout
        core["y_perm"] = [int(a) for a in reader.attrs["perm"]]
    absorbed = core.get("y_perm") is not None   # the Transpose after it: the kernel writes its layout
    written = reader.outputs[0] if absorbed else out
    if isinstance(core["q"], Packed):
        y_perm = _packed_inputs(m, core, inputs, attrs)
    for key in ("q_perm", "k_perm", "v_perm", "y_perm"):
        if core.get(key) is not None and core[key] != list(range(len(core[key]))):
            attrs[key] = core[key]
    (y,) = m.op("AttentionCore", inputs, attrs, name=f"{m.root.name}/AttentionCore", domain=kernels.DOMAIN,
                dtype=written.dtype, shape=None if isinstance(core["q"], Packed) else written.shape)
    if isinstance(core["q"], Packed):   # [.., n, H, ..] → the written [.., n·H, ..]
        dims = [d for d in np.array(shape_of(out), dtype=object)[y_perm]]
        merged = (attrs.get("y_perm") or [0, 1, 2, 3]).index(0)
        target = add_constant(m.graph, f"{m.root.name}/merge", np.array(
            [-1 if i == merged else int(d) if i > merged else 0 for i, d in enumerate(dims)], np.int64))
        (y,) = m.op("Reshape", [y, target], name=f"{m.root.name}/merge", dtype=written.dtype, shape=written.shape)
    if "rows" in core:
        (y,) = m.op("Mul", [y, core["rows"]], name=f"{m.root.name}/rows", dtype=out.dtype, shape=out.shape)
    if not absorbed:
        return [y]
    replace_outputs(m.graph, reader, [y])   # the Transpose is dead now, and so is the MatMul it read
    return [None]


def _packed_inputs(m: Match, core: dict, inputs: list, attrs: dict) -> list[int]:
    """Packed Q, K and V: each the projection p with its last axis split into (H, d) (a Reshape, no copy) and its
    index selected by the kernel; the bias or mask regrouped; y_perm over the kernel's [n, H, S, dv]. Returns the
    written value's axes in the terms of the output before the heads were split (to size the merge)."""
    for i, key in enumerate(("q", "k", "v")):
        x = core[key]
        split = add_constant(m.graph, f"{m.root.name}/heads", np.array([0] * (rank_of(x.p) - 1) + [x.heads, x.depth],
                                                                         np.int64))
        (inputs[i],) = m.op("Reshape", [x.p, split], name=f"{m.root.name}/heads_{key}", dtype=np.float32)
        attrs[f"{key}_select"] = [x.axis, x.index]
    if "regroup" in core:
        extra = 4 if "mask" in core else 3
        regroup = add_constant(m.graph, f"{m.root.name}/regroup", np.array(core["regroup"], np.int64))
        (inputs[extra],) = m.op("Reshape", [inputs[extra], regroup], name=f"{m.root.name}/regroup",
                                dtype=inputs[extra].dtype)
    before = core.get("y_perm") or [0, 1, 2]
    axes = {0: [0, 1], 1: [2], 2: [3]}   # the output [n·H, S, dv] in the axes of [n, H, S, dv]
    core["y_perm"] = [a for p in before for a in axes[p]]
    return before


def _per_head(x: gs.Tensor, heads: int) -> int:
    """x's last dim over the heads, where it is static; -1 where not."""
    width = (shape_of(x) or [None])[-1]
    return int(width) // heads if isinstance(width, (int, np.integer)) and width % heads == 0 else -1


def _stacked_kernel(m: Match, core: dict, inputs: list, attrs: dict) -> list:
    """Stacked heads: the kernel reads x [B, L, H·d] as [B, L, H, d] (a Reshape, no copy) and writes [B, S, H, dv],
    which a Reshape makes the merged [B, S, H·dv]; neither Split nor Concat runs."""
    heads = core["q"].heads
    for i in range(3):   # the heads' width where known: a -1 cannot be inferred from an empty batch
        split = add_constant(m.graph, f"{m.root.name}/heads", np.array([0, 0, heads, _per_head(inputs[i].x, heads)],
                                                                        np.int64))
        (inputs[i],) = m.op("Reshape", [inputs[i].x, split], name=f"{m.root.name}/heads_{'qkv'[i]}",
                            dtype=np.float32)
    if "regroup" in core:
        extra = 4 if "mask" in core else 3
        regroup = add_constant(m.graph, f"{m.root.name}/regroup", np.array(core["regroup"], np.int64))
        (inputs[extra],) = m.op("Reshape", [inputs[extra], regroup], name=f"{m.root.name}/regroup",
                                dtype=inputs[extra].dtype)
    for key in ("q_perm", "k_perm", "v_perm"):
        attrs[key] = core[key]
    attrs["y_perm"] = [1, 2, 0, 3]
    (y,) = m.op("AttentionCore", inputs, attrs, name=f"{m.root.name}/AttentionCore", domain=kernels.DOMAIN,
                dtype=np.float32)
    if "rows" in core:   # [H·B, S, 1] → [B, S, H, 1], as the kernel writes the heads
        lead = [heads, -1] if (shape_of(core["rows"]) or [1])[0] != 1 else [1, 1]
        regroup = add_constant(m.graph, f"{m.root.name}/rows_by_head", np.array(
            [*lead, int(shape_of(core["rows"])[1]), 1], np.int64))
        (rows,) = m.op("Reshape", [core["rows"], regroup], name=f"{m.root.name}/rows_by_head", dtype=np.float32)
        (rows,) = m.op("Transpose", [rows], {"perm": [1, 2, 0, 3]}, name=f"{m.root.name}/rows_first",
                       dtype=np.float32)
        (y,) = m.op("Mul", [y, rows], name=f"{m.root.name}/rows", dtype=np.float32)
    merged = core["merged"]
    width = (shape_of(merged) or [None])[-1]
    merge = add_constant(m.graph, f"{m.root.name}/merge",
                         np.array([0, 0, width if isinstance(width, (int, np.integer)) else -1], np.int64))
    (out,) = m.op("Reshape", [y, merge], name=f"{m.root.name}/merge", dtype=merged.dtype, shape=merged.shape)
    replace_outputs(m.graph, merged.inputs[0], [out])   # the Split and Concat are dead now, and so is the MatMul
    return [None]


CORE_RULES = (
    Rewrite("attention-core", P.MatMul(P.Softmax(Var("scores"), _name="softmax"), Var("v")), _to_kernel, _is_core,
            subgraphs=False),
    Rewrite("attention-core-rows", P.MatMul(P.Mul(P.Softmax(Var("scores"), _name="softmax"), Var("rows"),
                                                  _name="rowmul"), Var("v")),
            _to_kernel, _is_core, subgraphs=False),
)


@register_pass("attention-core-kernel", group="lower", targets=("ort",), rules=CORE_RULES)
def attention_core_kernel(ctx: PassContext) -> None:
    """softmax(s · Q·Kᵀ + bias) · V (the attention of transformers, any head count and mask) → ctropt's
    AttentionCore kernel, where its library loads (the saved model then needs it at run time, as for GRUScan);
    option attention_ort_form: auto, kernel (insist), standard (leave the ops)."""
    form = ctx.options.get("attention_ort_form") or ("auto" if kernels.wanted(ctx.options) else "standard")
    if form not in FORMS:
        raise CtroptError(f"attention_ort_form must be one of {', '.join(FORMS)}, not {form!r}")
    if form == "standard":
        return
    problem = kernels.ensure()
    if problem:
        if form == "kernel":
            raise CtroptError(f"attention_ort_form=kernel needs ctropt's kernel library, which cannot be built here: "
                              f"{problem}")
        ctx.note(f"attention left as standard ops: ctropt's kernel library is not available ({problem})")
        return
    annotate_shapes_if_bare(ctx.graph)   # the rank of the scores
    if ctx.apply(*CORE_RULES):
        ctx.note(f"AttentionCore kernels: the model needs ctropt's kernel library at run time "
                 f"({kernels.library_path()})")
