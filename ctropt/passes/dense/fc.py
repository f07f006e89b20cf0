"""Fully connected layers: MatMul(+Add)(+activation) → Gemm, at any input rank.

- `x[M, K] · W + b` (MatMul then Add of a bias that broadcasts along the last axis) → `Gemm(x, W, b)`, and a
  bias-less `x · W` followed by an activation → `Gemm(x, W)` + the activation. Both runtimes fuse Gemm with a
  following Relu/Sigmoid/Tanh/LeakyRelu... (onnxruntime into FusedGemm, OpenVINO into FullyConnected), and
  onnxruntime's quantizer turns a Gemm into QGemm with an int32 bias, where a MatMul + Add keeps a float Add.
- For `--target ort`, an FC on `x[B, T, K]` (rank ≥ 3: DIN/DIEN attention MLPs) is flattened:
  Reshape to `[-1, K]` → Gemm → activation → Reshape back to `x`'s leading dims (read at run time, so
  dynamic dims stay dynamic). onnxruntime fuses MatMul+Add+Relu only at rank 2; a chain of such layers is
  flattened once (measured 1.09-1.13× on a [B, 100, 144]→80→40→1 MLP; OpenVINO 0.99-1.02×, so not there).
- Activations a Gemm cannot absorb (PRelu, Dice: a sigmoid of the normalized value mixing x and αx) stay
  as they are after the Gemm, exact.

One `ai.ctropt` MLP op per chain is not built: no runtime here has a kernel that would run it faster than
the Gemm chain it would be lowered back to.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_graphsurgeon as gs

from ...graph import annotate_shapes, annotate_shapes_if_bare, iter_graphs
from ...graph.dims import same_size, shape_entries
from ...patterns import Const, Match, P, Rewrite, Var
from ...graph.edit import Builder, axes_of, const_value, dtype_of, rank_of, replace_outputs, shape_of
from ..cleanup.layout import cancel_layout_pairs
from ..cleanup import tidy
from ..registry import PassContext, register_pass

# Activations onnxruntime folds into FusedGemm (GemmActivationFusion) and OpenVINO into FullyConnected.
ACTIVATIONS = "Relu|Sigmoid|Tanh|LeakyRelu|Elu|HardSigmoid|Selu|Softsign"
FLOAT_TYPES = {np.dtype(np.float32), np.dtype(np.float64)}  # onnxruntime's CPU Gemm


def _bias_ok(v: np.ndarray, m: Match) -> bool:
    """The bias adds one value per output column: shape [..1, N] with N = W's columns."""
    n = m.const("w").shape[1]
    return v.size == n and v.ndim >= 1 and v.shape[-1] == n and v.ndim <= _rank(m["x"])


def _rank(t: gs.Tensor) -> int:
    """The rank, -1 when unknown (read as a number below)."""
    rank = rank_of(t)
    return -1 if rank is None else rank


def _fc_rules(target: str) -> list[Rewrite]:
    def x():
        return Var("x")

    def w():
        return Const("w", rank=2)

    linear = P.MatMul(x(), w(), _name="mm")
    biased = P.Add(P.MatMul(x(), w(), _name="mm"), Const("b"), _name="add")
    acted_biased = P[ACTIVATIONS](P.Add(P.MatMul(x(), w(), _name="mm"), Const("b"), _name="add"), _name="act")
    acted_linear = P[ACTIVATIONS](P.MatMul(x(), w(), _name="mm"), _name="act")
    # TF's tensordot: the product is reshaped (to the input's leading dims, last dim kept) before the bias
    reshaped = P.Add(P.Reshape(P.MatMul(x(), w(), _name="mm"), Var("s"), _name="reshape"), Const("b"), _name="add")
    acted_reshaped = P[ACTIVATIONS](
        P.Add(P.Reshape(P.MatMul(x(), w(), _name="mm"), Var("s"), _name="reshape"), Const("b"), _name="add"), _name="act")

    def condition(m: Match):
        rank = _rank(m["x"])
        if dtype_of(m["x"]) not in FLOAT_TYPES or m.const("w").dtype != dtype_of(m["x"]):
            return "not a floating-point FC"
        if "b" in m.consts and not _bias_ok(m.const("b"), m):
            return "the Add is not a per-column bias"
        users = m.root.outputs[0].outputs
        if "act" not in m.named_nodes and len(users) == 1 and users[0].op in ACTIVATIONS.split("|"):
            return "matched with its activation"
        if "add" not in m.named_nodes and len(users) == 1 and users[0].op == "Add":
            return "matched with its bias"
        if "reshape" in m.named_nodes:
            out = shape_of(m.node("reshape").outputs[0])
            if rank != 2 or not out or out[-1] != m.const("w").shape[1]:
                return "the Reshape between MatMul and bias changes the last axis"
            return True
        if rank == 2:
            return True
        if rank >= 3 and target == "ort":
            return True
        return f"input rank {rank}" + (" (rank ≥ 3 is flattened for onnxruntime only)" if rank >= 3 else "")

    flat_of: dict[int, tuple] = {}  # id of a value we reshaped back to rank ≥ 3 → (its 2-D form, leading dims)

    def replace(m: Match):
        w_, n = m["w"], m.const("w").shape[1]
        xin, rank = m["x"], _rank(m["x"])
        inputs = [xin, w_]
        if "b" in m.consts:
            inputs.append(m.constant(f"{m['b'].name}/cols", m.const("b").reshape(n)))
        act = m.named_nodes.get("act")
        if rank == 2:
            (y,) = m.op("Gemm", inputs, dtype=dtype_of(xin), shape=[shape_of(xin)[0], n])
            if act:
                (y,) = m.op(act.op, [y], dict(act.attrs), dtype=y.dtype, shape=y.shape)
            if "reshape" in m.named_nodes:  # bias and activation act per column, so they go before the Reshape
                r = m.node("reshape").outputs[0]
                (y,) = m.op("Reshape", [y, m["s"]], dict(m.node("reshape").attrs), dtype=y.dtype, shape=shape_of(r))
            return [y]
        k = m.const("w").shape[0]
        x2, lead = flat_of.get(id(xin), (None, None))
        if x2 is None:  # the first layer of a flat chain: rows of x, and x's leading dims for the way back
            # the rows get a dim name of their own: onnxruntime plans buffers of one dim name as one size, and
            # chains over different inputs have different row counts (PaddleRec BST: B*(T+1) and B*(T+2))
            (x2,) = m.op("Reshape", [xin, m.constant("fc/flat", np.array([-1, k], np.int64))],
                         dtype=dtype_of(xin), shape=[f"rows_of_{xin.name}", k])
            (lead,) = m.op("Shape", [xin], dtype=np.int64, shape=[rank])
            (lead,) = m.op("Slice", [lead, m.constant("fc/zero", np.array([0], np.int64)),
                                     m.constant("fc/minus_one", np.array([-1], np.int64))], dtype=np.int64,
                           shape=[rank - 1])
        inputs[0] = x2
        (y,) = m.op("Gemm", inputs, dtype=dtype_of(xin), shape=[shape_of(x2)[0] if shape_of(x2) else None, n])
        if act:
            (y,) = m.op(act.op, [y], dict(act.attrs), dtype=y.dtype, shape=y.shape)
        (shape,) = m.op("Concat", [lead, m.constant("fc/cols", np.array([n], np.int64))], {"axis": 0},
                        dtype=np.int64, shape=[rank])
        (out,) = m.op("Reshape", [y, shape], dtype=y.dtype, shape=(shape_of(xin) or [None] * rank)[:-1] + [n])
        flat_of[id(out)] = (y, lead)  # the next layer reads y; this Reshape stays only if something else reads out
        return [out]

    return [Rewrite(name, pattern, replace, condition) for name, pattern in
            (("fc+bias+act", acted_biased), ("fc+reshape+bias+act", acted_reshaped), ("fc+bias", biased),
             ("fc+reshape+bias", reshaped), ("fc+act", acted_linear))] + \
        ([] if target != "ort" else [Rewrite("fc-chain", linear, replace, lambda m: _chained(m, flat_of, condition))])


def _chained(m: Match, flat_of: dict, condition) -> bool | str:
    """A bias-less, activation-less FC whose input we already flattened joins the flat chain."""
    return condition(m) if id(m["x"]) in flat_of else "a lone MatMul (nothing to fuse)"


@register_pass("fuse-fc", group="fusion", rules=_fc_rules)
def fuse_fc(ctx: PassContext) -> None:
    """MatMul+Add(+activation) → Gemm(+activation), any rank: rank ≥ 3 flattened for onnxruntime, which fuses only 2-D."""
    if any(t.shape is None for g in iter_graphs(ctx.graph) for n in g.nodes if n.op == "MatMul"
           for t in [n.inputs[0]] + [c.outputs[0] for c in n.outputs[0].outputs if c.op == "Reshape"]):
        annotate_shapes(ctx.graph)  # the rank of each FC's input decides its form
    if ctx.apply(*_fc_rules(ctx.target)):
        if ctx.target == "ort":  # elementwise activations between flattened layers (Dice) join the 2-D chain
            cancel_layout_pairs(ctx.graph)
        tidy(ctx)  # the Reshape back and the next layer's Reshape to [-1, K] cancel; shapes computed once
    ctx.note(f"{ctx.rewrites} FC layer(s) → Gemm" if ctx.rewrites else "no MatMul+Add/activation to fuse")


def per_column(t: gs.Tensor, width: int) -> np.ndarray | None:
    """A constant that acts per column of a [M, width] value ([width], [1, width], a scalar), as [width]."""
    v = const_value(t)
    if v is None or v.ndim > 2 or (v.size != width and v.size != 1) or (v.ndim and v.shape[-1] != v.size):
        return None
    return np.broadcast_to(v.reshape(-1), (width,)).astype(np.float64)


def _gathered_projection(c: gs.Tensor):
    """(Gather node, Gemm node) when the bias `c` of a Gemm is ``Gather(Gemm(q, W, b), rows)`` with constants W,
    b (remove-attention-padding's query part, computed once per row)."""
    g = c.inputs[0] if c.inputs else None
    p = g.inputs[0].inputs[0] if g is not None and g.op == "Gather" and g.inputs[0].inputs else None
    plain = (("transA", 0), ("transB", 0), ("alpha", 1.0), ("beta", 1.0))
    if p is None or p.op != "Gemm" or len(p.inputs) != 3 or any(p.attrs.get(a, d) != d for a, d in plain):
        return None
    if const_value(p.inputs[1]) is None or const_value(p.inputs[2]) is None or len(g.inputs[0].outputs) != 1:
        return None
    return g, p


def _fc_width(m: Match) -> int | str:
    """The FC's output width, or why it cannot take a per-column scale into its weight."""
    fc, w = m.node("fc"), m.const("W")
    if any(fc.attrs.get(a, d) != d for a, d in (("transA", 0), ("alpha", 1.0), ("beta", 1.0))):
        return "a Gemm with transA, alpha or beta"
    if w.ndim != 2 or w.dtype not in FLOAT_TYPES:
        return "its weight is not a 2-D float matrix"
    return w.shape[0] if fc.attrs.get("transB", 0) else w.shape[1]


# A second Gemm (the FC's output also read as is: Dice) pays only for small layers. onnxruntime CPU, 1 thread,
# two Gemms vs Gemm + Mul + Add, µs: [2560 rows, K 16 → H 16] 43 vs 86, [1280, 32 → 16] 36 vs 53,
# [1280, 64 → 16] 61 vs 65; [256, 32 → 80] 34 vs 33, [256, 64 → 80] 57 vs 44, [256, 200 → 80] 155 vs 93.
SECOND_GEMM_MAX = 1024  # K·H


def _affine_foldable(m: Match) -> bool | str:
    width = _fc_width(m)
    if isinstance(width, str):
        return width
    if per_column(m["s"], width) is None:
        return "the scale is not per column"
    if "t" in m.values and per_column(m["t"], width) is None:
        return "the shift is not per column"
    readers = m.root.outputs[0].outputs
    if "t" not in m.values and len(readers) == 1 and readers[0].op == "Add" and any(
            u is not m.root.outputs[0] and per_column(u, width) is not None for u in readers[0].inputs):
        return "the per-column Add after it folds with it"
    fc = m.node("fc")
    inside = {id(n) for n in m.nodes}
    second = any(id(r) not in inside for r in fc.outputs[0].outputs)  # the FC's output is also read as is
    depth = m.const("W").shape[1 if fc.attrs.get("transB", 0) else 0]
    if second and depth * width > SECOND_GEMM_MAX:
        return f"a second Gemm ({depth} × {width}) would cost more than the scale and shift"
    c = fc.inputs[2] if len(fc.inputs) > 2 else None
    c_value = const_value(c) if c is not None else None
    if c is not None and c_value is None and _gathered_projection(c) is None:
        return "the FC's bias is neither a constant nor a gathered projection"
    if c_value is not None and c_value.ndim > 1 and c_value.shape[0] != 1:
        return "the FC's bias is not per column"
    return True


def _fold_affine(m: Match) -> list:
    """``Gemm(a, W, c) · s (+ t)`` → ``Gemm(a, W·s, c·s + t)``; a gathered projection bias is scaled at its source."""
    fc, w, x = m.node("fc"), m.const("W"), m.node("fc").outputs[0]
    width = _fc_width(m)
    s = per_column(m["s"], width)
    t = per_column(m["t"], width) if "t" in m.values else np.zeros(width)
    c = fc.inputs[2] if len(fc.inputs) > 2 else None
    c_value = const_value(c) if c is not None else np.zeros(width)
    w_s = w * (s[:, None] if fc.attrs.get("transB", 0) else s[None, :])
    if c_value is not None:
        bias = m.constant(f"{fc.name}/affine_bias", (c_value.reshape(-1) * s + t).astype(w.dtype))
    else:
        gather, proj = _gathered_projection(c)
        pw, pb = const_value(proj.inputs[1]), const_value(proj.inputs[2])
        (p2,) = m.op("Gemm", [proj.inputs[0], m.constant(f"{proj.name}/affine", (pw * s).astype(pw.dtype)),
                              m.constant(f"{proj.name}/affine_bias", (pb.reshape(-1) * s + t).astype(pb.dtype))],
                     name=f"{proj.name}/affine", dtype=x.dtype)
        (bias,) = m.op("Gather", [p2, gather.inputs[1]], dict(gather.attrs), name=f"{gather.name}/affine",
                       dtype=x.dtype)
    return m.op("Gemm", [m["a"], m.constant(f"{fc.name}/affine", w_s.astype(w.dtype)), bias],
                {"transB": fc.attrs.get("transB", 0)}, name=f"{fc.name}/affine", dtype=x.dtype, shape=x.shape)


_FC = P.Gemm(Var("a"), Const("W"), ..., _name="fc", _shared=True)  # its output may also be read as is (Dice)
AFFINE_RULES = (
    Rewrite("fc-scale-shift", P.Add(P.Mul(_FC, Var("s")), Var("t")), _fold_affine, _affine_foldable),
    Rewrite("fc-scale", P.Mul(_FC, Var("s")), _fold_affine, _affine_foldable),
)


@register_pass("fold-fc-affine", group="fusion", rules=AFFINE_RULES)
def fold_fc_affine(ctx: PassContext) -> None:
    """``Gemm(a, W, c) · s + t`` with s, t per column (a folded BatchNormalization: Dice) → a second
    ``Gemm(a, W·s, c·s + t)`` when the FC's output is also read as is and the layer is small (K·H ≤ 1024:
    `SECOND_GEMM_MAX`), else the same Gemm: on onnxruntime CPU a small Gemm costs less than two broadcast
    elementwise ops (68 µs vs 124 µs at [1280, 16]), a large one more."""
    if ctx.apply(*AFFINE_RULES):
        tidy(ctx)
        ctx.note(f"{ctx.rewrites} per-column scale/shift after an FC (a folded BatchNormalization) → a Gemm")


@dataclasses.dataclass
class _Terms:
    """What an Add tree sums: FC layers (x, W [K, N], alpha, bias), other values as (kind, value): "value", "const",
    or "zeros" with its shape's entries; and, once checked, the constants summed per column."""

    layers: list
    values: list
    bias: np.ndarray | None
    adds: list


def _layer_term(t: gs.Tensor, graph: gs.Graph) -> tuple | None:
    """(x, W, alpha, bias or None) when t is a MatMul/Gemm by a constant 2-D W of a 2-D x (bias: a Gemm's
    constant C times beta, per column), read only where it is summed."""
    n = t.inputs[0] if len(t.inputs) == 1 else None
    if n is None or n.op not in ("MatMul", "Gemm") or n.domain or len(t.outputs) != 1 or t in graph.outputs:
        return None
    w = const_value(n.inputs[1])
    if w is None or w.ndim != 2 or w.dtype != np.float32 or rank_of(n.inputs[0]) != 2 or n.attrs.get("transA", 0):
        return None
    w = w.T if n.attrs.get("transB", 0) else w
    bias = None
    if n.op == "Gemm" and len(n.inputs) > 2 and n.inputs[2].name:
        c = per_column(n.inputs[2], w.shape[1])
        if c is None:
            return None
        bias = c * float(n.attrs.get("beta", 1.0))
    return n.inputs[0], w, float(n.attrs.get("alpha", 1.0)) if n.op == "Gemm" else 1.0, bias


def _row_sum_term(t: gs.Tensor, graph: gs.Graph) -> tuple | None:
    """(x, ones [K, 1], 1, None) when t [M, 1] sums x's K columns (ReduceSum over the last axis of [M, K], or of
    [M, 1, K] without keepdims: WDL's wide part), read only where it is summed: a product by ones, one more Gemm in
    the chain (x as [M, K] after `_flat`)."""
    n = t.inputs[0] if len(t.inputs) == 1 else None
    if n is None or n.op != "ReduceSum" or n.domain or len(t.outputs) != 1 or t in graph.outputs:
        return None
    shape, axes, out = shape_of(n.inputs[0]), axes_of(n), shape_of(t)
    if not shape or axes is None or out is None or len(out) != 2 or out[1] != 1 or dtype_of(t) != np.dtype(np.float32):
        return None
    k, keep = shape[-1], n.attrs.get("keepdims", 1)
    if not isinstance(k, (int, np.integer)) or [a % len(shape) for a in axes] != [len(shape) - 1] or \
            not (len(shape) == 2 and keep or len(shape) == 3 and shape[1] == 1 and not keep):
        return None
    return n.inputs[0], np.ones((int(k), 1), np.float32), 1.0, None


def _flat(b: Builder, x: gs.Tensor, k: int) -> gs.Tensor:
    """x as [M, K] (a Reshape when it is not 2-D)."""
    return x if rank_of(x) == 2 else b.op("Reshape", [x, b.const("rows", np.array([-1, k], np.int64))])


def _zeros(t: gs.Tensor) -> list | None:
    """The shape entries (graph/dims.shape_entries) of a ConstantOfShape of zeros (deepctr-torch's linear logit
    starts as zeros of [B, 1]), else None."""
    n = t.inputs[0] if len(t.inputs) == 1 else None
    if n is None or n.op != "ConstantOfShape" or n.domain:
        return None
    value = n.attrs.get("value")
    value = np.zeros(1) if value is None else np.asarray(value.values if isinstance(value, gs.Constant) else value)
    return shape_entries(n.inputs[0]) if value.size == 1 and value.ravel()[0] == 0 else None


def _sum_terms(root: gs.Node, graph: gs.Graph) -> _Terms:
    """The terms of the sum made by the Add `root` and the Adds it reads that nothing else reads."""
    terms, stack = _Terms([], [], None, []), [root]
    while stack:
        node = stack.pop()
        terms.adds.append(node)
        for u in node.inputs:
            p = u.inputs[0] if len(u.inputs) == 1 else None
            if p is not None and p.op == "Add" and not p.domain and len(u.outputs) == 1 and u not in graph.outputs:
                stack.append(p)
            elif (layer := _layer_term(u, graph) or _row_sum_term(u, graph)) is not None:
                terms.layers.append(layer)
            elif const_value(u) is not None:
                terms.values.append(("const", u))
            elif (entries := _zeros(u)) is not None:
                terms.values.append(("zeros", entries))
            else:
                terms.values.append(("value", u))
    return terms


def _foldable(terms: _Terms, out: gs.Tensor, graph: gs.Graph) -> bool:
    """Whether every term fits a Gemm's C for the layers' [M, N]: per-column constants; values of rank ≤ 2 with N
    or 1 columns and the layers' rows or one row; the layers' rows one size, and the sum's."""
    if not terms.layers or rank_of(out) != 2 or dtype_of(out) != np.dtype(np.float32):
        return False
    n = terms.layers[0][1].shape[1]
    x0 = terms.layers[0][0]
    if any(w.shape[1] != n or not same_size((x, 0), (x0, 0), graph) for x, w, _, _ in terms.layers):
        return False
    bias = np.zeros(n)
    for kind, u in terms.values:
        if kind == "zeros":   # adds nothing where its size is the layers' or 1 (it cannot widen the sum)
            entries, last = u, len(u) - 1   # its shape's entries
            if len(entries) > 2 or any(e != 1 and not (i == last and e == n) and
                                       not (i == last - 1 and isinstance(e, tuple) and same_size(e, (x0, 0), graph))
                                       for i, e in enumerate(entries)):
                return False
            continue
        if kind == "const":
            c = per_column(u, n)
            if c is None:
                return False
            bias = bias + c
            continue
        shape = shape_of(u)
        if shape is None or len(shape) > 2 or dtype_of(u) != np.dtype(np.float32) or shape and shape[-1] not in (1, n):
            return False
        if len(shape) == 2 and shape[0] != 1 and not same_size((u, 0), (x0, 0), graph):
            return False
    for *_, b in terms.layers:
        bias = bias if b is None else bias + b
    has_const = any(k == "const" for k, _ in terms.values) or any(b is not None for *_, b in terms.layers)
    terms.bias = bias.astype(np.float32) if has_const else None
    values = sum(k == "value" for k, _ in terms.values)
    terms.values = [(k, u) for k, u in terms.values if k != "zeros"]
    return len(terms.adds) > (values if has_const else max(0, values - 1))   # fewer Adds than the tree has


def _sum_into_gemms(graph: gs.Graph, root: gs.Node, terms: _Terms) -> None:
    """The sum as a chain of Gemms, each adding what the one before made as its C. The first takes the constants
    as its bias (as fuse-fc makes it; measured faster than a bias Add of the other values) and the other values
    are added after it, or, with no constants, summed into its C."""
    b = Builder(graph, f"{root.name}/as_gemm", np.float32)
    rest = [u for kind, u in terms.values if kind == "value"]
    c = b.const("bias", terms.bias) if terms.bias is not None else rest.pop(0) if rest else None
    if c is None and b.opset < 11:   # Gemm's C is required before opset 11
        c = b.const("bias", np.zeros(terms.layers[0][1].shape[1], np.float32))
    for i, (x, w, alpha, _) in enumerate(terms.layers):
        if i == 0 and terms.bias is None:
            while rest:
                c = b.op("Add", [c, rest.pop(0)])
        inputs = [_flat(b, x, w.shape[0]), b.const("W", w)] + ([c] if c is not None else [])
        c = b.op("Gemm", inputs, {"alpha": alpha} if alpha != 1.0 else {})
        while rest:
            c = b.op("Add", [c, rest.pop(0)])
    out = root.outputs[0]
    c.dtype, c.shape = out.dtype, out.shape
    replace_outputs(graph, root, [c])
    for node in terms.adds:
        node.outputs.clear()


@register_pass("sum-into-gemm", group="fusion", targets=("ort",), order=64)
def sum_into_gemm(ctx: PassContext) -> None:
    """A sum of FC layers, other values and constants (WDL's wide + deep logits and its bias) → a chain of Gemms,
    each adding the sum so far as its C: one node per layer, no Add per term."""
    annotate_shapes_if_bare(ctx.graph)
    for node in [n for n in ctx.graph.nodes if n.op == "Add" and not n.domain]:
        if not node.outputs or node.outputs[0].outputs and all(c.op == "Add" and not c.domain
                                                                for c in node.outputs[0].outputs):
            continue   # an inner Add: the tree is read from its root
        terms = _sum_terms(node, ctx.graph)
        if not _foldable(terms, node.outputs[0], ctx.graph):
            continue
        ctx.matches += 1
        _sum_into_gemms(ctx.graph, node, terms)
        ctx.rewrites += 1
    if ctx.rewrites:
        tidy(ctx)
    ctx.note(f"{ctx.rewrites} sum(s) of FC layers → chained Gemms" if ctx.rewrites else "no sum of FC layers")
