"""`dot-sum-kernel`: width-1 GEMMs → ctropt's ``DotSum`` kernel for onnxruntime: ``y = bias + Σₖ xₖ·wₖ``, one value
per row, with the Sigmoid after it where there is one.

A ranker's logit is such a sum: WDL's wide and deep parts and its bias (sum-into-gemm writes them as a chain of Gemms,
each adding the one before as its C), a tower's head, FM's first order; a DCN cross layer computes ``xₗ·w`` as a
MatMul by a [D, 1] vector. onnxruntime's CPU GEMM runs N = 1 as any N, packing and all: about 3 µs for
[256, 47] × [47, 1], 15 µs for [256, 221] × [221, 1], where the multiply-adds take well under a microsecond. The
kernel reads each row once and writes one value.

A link of the chain: a Gemm of a 2-D x (no transA) or a MatMul of x (rank ≥ 2) by a constant [K, 1] (a Gemm's
transB: [1, K]), alpha folded into w. A Gemm's C is the link before it (a width-1 Gemm read only there), a
constant of one value (the bias), or another [M, 1] value (a term of its own, w = [1]); beta scales it. Every
term's rows must be proven one size (graph/dims.same_size): the kernel does not broadcast.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_graphsurgeon as gs

from ... import kernels
from ...graph import annotate_shapes_if_bare
from ...graph.dims import same_size
from ...graph.edit import Builder, const_value, dtype_of, rank_of, replace_outputs, shape_of
from ..cleanup import slice_bounds, tidy
from ..registry import PassContext, register_pass

MAX_TERMS = 64   # the kernel's (dot_sum.c)
MAX_RANK = 8
F32 = np.dtype(np.float32)


@dataclasses.dataclass
class _Chain:
    """What a chain of width-1 links sums: terms (x, w [K]), the bias, the nodes it replaces (the root last)."""

    terms: list
    bias: float
    nodes: list


def _link(n: gs.Node) -> tuple | None:
    """(x, w [K] times alpha) when `n` is a Gemm (2-D x, no transA) or MatMul (x of rank ≥ 2) by a constant [K, 1]
    of float32 x; else None."""
    if n.domain or n.op not in ("Gemm", "MatMul") or len(n.outputs) != 1:
        return None
    x, w = n.inputs[0], const_value(n.inputs[1])
    if w is None or w.dtype != F32 or w.ndim != 2 or dtype_of(x) != F32 or not 2 <= (rank_of(x) or 0) <= MAX_RANK:
        return None
    if n.op == "Gemm":
        if n.attrs.get("transA", 0) or rank_of(x) != 2:
            return None
        w = w.T if n.attrs.get("transB", 0) else w
    if w.shape[1] != 1 or w.shape[0] < 1 or shape_of(x)[-1] != w.shape[0]:
        return None
    alpha = float(n.attrs.get("alpha", 1.0)) if n.op == "Gemm" else 1.0
    return x, (w[:, 0] * alpha).astype(np.float32)


def _unsliced(x: gs.Tensor, w: np.ndarray) -> tuple:
    """(data, w with zeros around it) when x is columns [a, b) of a 2-D data (deepctr-torch's dense columns of its
    one input): the kernel reads the rows where they are; else (x, w)."""
    cut = slice_bounds(x, 1) if rank_of(x) == 2 else None
    if cut is None or rank_of(cut[0]) != 2 or dtype_of(cut[0]) != F32:
        return x, w
    data, start, end = cut
    wide = np.zeros(int(shape_of(data)[1]), np.float32)
    wide[start:end] = w
    return data, wide


def _below(n: gs.Node, graph: gs.Graph) -> gs.Node | None:
    """The link that makes Gemm n's C, where only n reads it."""
    c = n.inputs[2]
    p = c.inputs[0] if len(c.inputs) == 1 else None
    if p is None or len(c.outputs) != 1 or c in graph.outputs or _link(p) is None:
        return None
    return p


def _chain(root: gs.Node, graph: gs.Graph) -> _Chain | None:
    """The terms the link `root` and the links below it sum, or None when a C is none of the three kinds."""
    chain, node, scale = _Chain([], 0.0, []), root, 1.0
    while node is not None:
        x, w = _link(node)
        chain.terms.append(_unsliced(x, w * np.float32(scale)))
        chain.nodes.append(node)
        c = node.inputs[2] if node.op == "Gemm" and len(node.inputs) > 2 and node.inputs[2].name else None
        if c is None:
            break
        scale *= float(node.attrs.get("beta", 1.0))
        below = _below(node, graph) if len(chain.terms) < MAX_TERMS - 1 else None
        value = const_value(c)
        if below is not None:
            node = below
        elif value is not None:
            if value.size != 1 or value.dtype != F32 or value.ndim > 2:
                return None
            chain.bias = float(value.ravel()[0]) * scale
            node = None
        else:
            shape = shape_of(c)
            if dtype_of(c) != F32 or shape is None or len(shape) != 2 or shape[1] != 1:
                return None
            chain.terms.append((c, np.array([scale], np.float32)))
            node = None
    chain.nodes.reverse()
    return chain


def _rows_proven(chain: _Chain, graph: gs.Graph) -> bool:
    """Whether every term's rows are the first's: rank-2 terms with one size on axis 0 (or one term)."""
    x0 = chain.terms[0][0]
    if len(chain.terms) == 1:
        return True
    return all(rank_of(x) == 2 and same_size((x, 0), (x0, 0), graph) for x, _ in chain.terms)


def _roots(graph: gs.Graph) -> list:
    """Links whose output is not the C of another link (a chain's top)."""
    out = []
    for n in graph.nodes:
        if _link(n) is None:
            continue
        readers = n.outputs[0].outputs
        if len(readers) == 1 and n.outputs[0] not in graph.outputs and readers[0].op == "Gemm" and \
                not readers[0].domain and _link(readers[0]) is not None and len(readers[0].inputs) > 2 and \
                readers[0].inputs[2] is n.outputs[0]:
            continue
        out.append(n)
    return out


def _sigmoid_after(root: gs.Node, graph: gs.Graph) -> gs.Node | None:
    out = root.outputs[0]
    readers = out.outputs
    if len(readers) == 1 and out not in graph.outputs and readers[0].op == "Sigmoid" and not readers[0].domain:
        return readers[0]
    return None


def _to_kernel(graph: gs.Graph, chain: _Chain, sigmoid: gs.Node | None) -> None:
    root = chain.nodes[-1]
    b = Builder(graph, f"{root.name}/DotSum", np.float32)
    inputs = [b.const("bias", np.array([chain.bias], np.float32))]
    for x, w in chain.terms:
        inputs += [x, b.const("w", w)]
    end = sigmoid or root
    out = end.outputs[0]
    y = b.op("DotSum", inputs, {"sigmoid": int(sigmoid is not None)}, domain=kernels.DOMAIN, dtype=out.dtype,
             shape=out.shape)
    replace_outputs(graph, end, [y])
    for n in chain.nodes + ([sigmoid] if sigmoid else []):
        n.outputs.clear()


@register_pass("dot-sum-kernel", group="lower", targets=("ort",))
def dot_sum_kernel(ctx: PassContext) -> None:
    """Width-1 Gemm/MatMul chains (a logit's parts and bias, a cross layer's xₗ·w), with a Sigmoid after them →
    ctropt's DotSum kernel, where its library loads."""
    graph = ctx.graph
    annotate_shapes_if_bare(graph)
    if not any(_link(n) for n in graph.nodes):
        ctx.note("no width-1 GEMM")
        return
    if not kernels.ready(ctx, "width-1 GEMMs"):
        return
    for root in _roots(graph):
        chain = _chain(root, graph)
        if chain is None:
            continue
        ctx.matches += 1
        if not _rows_proven(chain, graph):
            continue
        _to_kernel(graph, chain, _sigmoid_after(root, graph))
        ctx.rewrites += 1
    if ctx.rewrites:
        tidy(ctx)
        kernels.note_needed(ctx)
    ctx.note(f"{ctx.rewrites} width-1 GEMM chain(s) → DotSum" if ctx.rewrites else "no width-1 GEMM chain")
