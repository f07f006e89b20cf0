"""`fm-interaction-kernel`: a factorization machine's second order → ctropt's ``FMInteraction`` kernel for
onnxruntime.

Every DeepFM (deepctr, deepctr-torch, FuxiCTR, PaddleRec, DeepRec) computes ``(Σ_f e_f)² − Σ_f e_f²`` over its
field embeddings E [B, F, D] as a ReduceSum over the fields, a square (``Mul(x, x)`` or ``Pow(x, 2)``), the
embeddings' square, its ReduceSum and a Sub, and most then scale it by 1/2 and sum the columns (a Mul and a
ReduceSum over the last axis, in either order). The kernel reads E once; the Mul by one constant and the ReduceSum
after the Sub, where nothing else reads the values between, become its `scale` and `reduce`.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from ... import kernels
from ...graph import annotate_shapes_if_bare
from ...graph.edit import Builder, axes_of, const_value, dtype_of, rank_of, replace_outputs, shape_of
from ..cleanup import tidy
from ..registry import PassContext, register_pass

F32 = np.dtype(np.float32)


def _made_by(t: gs.Tensor, graph: gs.Graph, op: str, domain: str = "") -> gs.Node | None:
    """The `op` that makes t, where one node reads t (a square reads it twice) and t is none of the graph's outputs."""
    n = t.inputs[0] if len(t.inputs) == 1 else None
    if n is None or n.op != op or (n.domain or "") != domain or len({id(r) for r in t.outputs}) != 1 or \
            t in graph.outputs:
        return None
    return n


def _square_of(t: gs.Tensor, graph: gs.Graph) -> tuple | None:
    """(x, node) when t = x * x or x ** 2, read only once."""
    for op in ("Mul", "Pow"):
        n = _made_by(t, graph, op)
        if n is None or len(n.inputs) != 2:
            continue
        a, b = n.inputs
        if op == "Mul" and a is b:
            return a, n
        p = const_value(b) if op == "Pow" else None
        if p is not None and p.size == 1 and float(p.ravel()[0]) == 2.0:
            return a, n
    return None


def _field_sum(t: gs.Tensor, graph: gs.Graph) -> tuple | None:
    """(E, keepdims, node) when t sums a rank-3 E over axis 1 (ReduceSum, or small-products-kernel's SumAxes), read
    only once."""
    n = _made_by(t, graph, "ReduceSum") or _made_by(t, graph, "SumAxes", kernels.DOMAIN)
    if n is None or rank_of(n.inputs[0]) != 3:
        return None
    axes = [n.attrs.get("axis")] * n.attrs.get("count", 0) if n.op == "SumAxes" else axes_of(n) or []
    if [a % 3 for a in axes] != [1]:
        return None
    return n.inputs[0], int(n.attrs.get("keepdims", 1)), n


def _match(sub: gs.Node, graph: gs.Graph) -> tuple | None:
    """(E, keepdims, nodes) when `sub` is (Σ_f E)² − Σ_f E² over a float32 E [B, F, D]."""
    a, b = sub.inputs
    sq = _square_of(a, graph)
    total = _field_sum(sq[0], graph) if sq else None
    squares = _field_sum(b, graph)
    inner = _square_of(squares[0], graph) if squares else None
    if not (total and inner) or inner[0] is not total[0] or total[1] != squares[1] or dtype_of(total[0]) != F32:
        return None
    return total[0], total[1], [total[2], sq[1], inner[1], squares[2], sub]


def _absorb(out: gs.Tensor, graph: gs.Graph, keepdims: int) -> tuple:
    """(scale, reduce, nodes) for the Mul by one constant and the ReduceSum over the last axis read right after."""
    scale, reduce, nodes, rank, scaled = 1.0, 0, [], 3 if keepdims else 2, False
    while len(out.outputs) == 1 and out not in graph.outputs:
        n = out.outputs[0]
        if n.domain or len(n.outputs) != 1:
            break
        other = n.inputs[1] if len(n.inputs) == 2 and n.inputs[0] is out else n.inputs[0]
        value = const_value(other) if n.op == "Mul" and len(n.inputs) == 2 else None
        if value is not None and value.size == 1 and value.dtype == F32 and value.ndim <= rank and not scaled:
            scale, scaled = float(value.ravel()[0]), True
        elif n.op == "ReduceSum" and not reduce and [a % rank for a in (axes_of(n) or [])] == [rank - 1]:
            reduce = 2 if n.attrs.get("keepdims", 1) else 1
            rank -= reduce == 1
        else:
            break
        nodes.append(n)
        out = n.outputs[0]
    return scale, reduce, nodes


def _to_kernel(graph: gs.Graph, sub: gs.Node, e: gs.Tensor, keepdims: int, nodes: list) -> None:
    scale, reduce, after = _absorb(sub.outputs[0], graph, keepdims)
    end = (after or [sub])[-1]
    b = Builder(graph, f"{sub.name}/FMInteraction", np.float32)
    y = b.op("FMInteraction", [e], {"keepdims": keepdims, "reduce": reduce, "scale": scale}, domain=kernels.DOMAIN,
             dtype=end.outputs[0].dtype, shape=end.outputs[0].shape)
    replace_outputs(graph, end, [y])
    for n in nodes + after:
        n.outputs.clear()


@register_pass("fm-interaction-kernel", group="lower", targets=("ort",))
def fm_interaction_kernel(ctx: PassContext) -> None:
    """(Σ_f e)² − Σ_f e² over field embeddings (DeepFM's second order), its scale and column sum → ctropt's
    FMInteraction kernel, where its library loads."""
    graph = ctx.graph
    annotate_shapes_if_bare(graph)
    found = [(s, m) for s in graph.nodes if s.op == "Sub" and not s.domain and (m := _match(s, graph))]
    if not found:
        ctx.note("no factorization machine's second order")
        return
    if not kernels.ready(ctx, "the FM second order"):
        return
    for sub, (e, keepdims, nodes) in found:
        ctx.matches += 1
        if shape_of(sub.outputs[0]) is not None and len(shape_of(sub.outputs[0])) != (3 if keepdims else 2):
            continue
        _to_kernel(graph, sub, e, keepdims, nodes)
        ctx.rewrites += 1
    if ctx.rewrites:
        tidy(ctx)
        kernels.note_needed(ctx)
    ctx.note(f"{ctx.rewrites} FM second order(s) → FMInteraction")
