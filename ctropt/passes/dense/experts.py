"""`gated-sum-kernel`: a mixture of experts' per-task mix, ``Σₑ g[:, e] · xₑ``, → ctropt's ``GatedSum`` kernel for
onnxruntime.

MMoE and PLE (deepctr, deepctr-torch, FuxiCTR, PaddleRec) weight each row's experts by its gate and sum them as a
batched MatMul of the gate as a row, [B, 1, E], by the experts stacked, [B, E, D] (small-products-kernel makes it
SmallMatMul), then a Squeeze. The stack is an Unsqueeze per expert and a Concat on axis 1 (deepctr, torch) or a
Concat of the [B, D] experts on the last axis and a Reshape (PaddleRec); the gate's row is the Softmax's output
through Unsqueeze, Squeeze or Reshape, which keep the order of its values. The kernel takes the experts where the
stack reads them and the gate before those ops; the Squeeze of its output to [B, D] becomes its `keepdims` 0. Where
only the way to the MatMul reads them, the gate's Softmax (over its last axis) and the layer before it (a constant
[H, E] projection, E ≤ 8, with or without a bias) go into the kernel too: onnxruntime's GEMM at N = 3 and its
Softmax cost two nodes per task (deepctr-torch MMoE: the pass 1.15× → 1.26× with them).
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from ... import kernels
from ...graph import annotate_shapes_if_bare
from ...graph.dims import same_size
from ...graph.edit import Builder, axes_of, const_value, dtype_of, rank_of, replace_outputs, shape_of
from ..cleanup import tidy
from .fc import per_column
from ..registry import PassContext, register_pass

MAX_EXPERTS = 256   # the kernel's (gated_sum.c)
LANES = 8   # the most experts whose gate's projection the kernel computes (gated_sum.c)
LAYOUT = ("Unsqueeze", "Squeeze", "Reshape", "Flatten", "Identity")   # ops that keep the order of the values
F32 = np.dtype(np.float32)


def _producer(t: gs.Tensor, op: str) -> gs.Node | None:
    n = t.inputs[0] if len(t.inputs) == 1 else None
    return n if n is not None and n.op == op and not n.domain else None


def _before_layout(t: gs.Tensor) -> gs.Tensor:
    """t's values as made before Unsqueeze/Squeeze/Reshape/Flatten ops (the same values, in the same order)."""
    for _ in range(16):
        n = t.inputs[0] if len(t.inputs) == 1 else None
        if n is None or n.op not in LAYOUT or n.domain or dtype_of(n.inputs[0]) != F32:
            break
        t = n.inputs[0]
    return t


def _own_rows(part: gs.Tensor, d: int) -> gs.Tensor:
    """An expert's values before the layout ops that made it [B, 1, D], where they are rows of D there too (the
    kernel reads D from an expert's last dim), of rank 8 at most; else the part itself."""
    x = _before_layout(part)
    shape = shape_of(x)
    return x if shape is not None and 1 <= len(shape) <= 8 and shape[-1] == d else part


def _experts(stack: gs.Tensor, e: int, d: int) -> list | None:
    """The E experts [.., D] that the stack [B, E, D] is made of: Concat on axis 1 of [B, 1, D] parts (each before
    its Unsqueeze), or a Reshape of a Concat on the last axis of E values [B, D]."""
    cat = _producer(stack, "Concat")
    if cat is not None and cat.attrs.get("axis") % 3 == 1 and len(cat.inputs) == e:
        parts = [shape_of(p) for p in cat.inputs]
        if all(s is not None and len(s) == 3 and s[1] == 1 and s[2] == d for s in parts):
            return [_own_rows(p, d) for p in cat.inputs]
    reshape = _producer(stack, "Reshape")
    cat = _producer(reshape.inputs[0], "Concat") if reshape is not None else None
    if cat is not None and len(cat.inputs) == e and rank_of(cat.outputs[0]) == 2 and cat.attrs.get("axis") % 2 == 1:
        if all(shape_of(p) is not None and len(shape_of(p)) == 2 and shape_of(p)[1] == d for p in cat.inputs):
            return list(cat.inputs)
    return None


def _match(n: gs.Node) -> tuple | None:
    """(gate, experts) when `n` is a MatMul/SmallMatMul of a gate row [B, 1, E] by a stack of E experts [B, E, D]."""
    if len(n.inputs) != 2 or len(n.outputs) != 1 or dtype_of(n.outputs[0]) != F32:
        return None
    row, stack = shape_of(n.inputs[0]), shape_of(n.inputs[1])
    if row is None or stack is None or len(row) != 3 or len(stack) != 3 or row[1] != 1:
        return None
    e, d = row[2], stack[2]
    if not isinstance(e, (int, np.integer)) or not isinstance(d, (int, np.integer)) or stack[1] != e or \
            not 1 <= e <= MAX_EXPERTS:
        return None
    if not same_size((n.inputs[0], 0), (n.inputs[1], 0)):
        return None   # a gate of one row for every row of the stack (a constant gate): the kernel takes one per row
    experts = _experts(n.inputs[1], int(e), int(d))
    return (_before_layout(n.inputs[0]), experts) if experts else None


def _read_only_toward(t: gs.Tensor, row: gs.Tensor, graph: gs.Graph) -> bool:
    """Whether t is read only through the layout ops that make it `row`, and `row` only once."""
    while True:
        if len(t.outputs) != 1 or t in graph.outputs:
            return False
        if t is row:
            return True
        n = t.outputs[0]
        if n.op not in LAYOUT or n.domain:
            return False
        t = n.outputs[0]


def _projection(x: gs.Tensor, graph: gs.Graph) -> list | None:
    """[h, W [H, E], b [E]] when x = h·W (+ b) by a constant W of E ≤ 8 columns (MatMul, or Gemm without transA; a
    per-column C), read only there."""
    n = x.inputs[0] if len(x.inputs) == 1 else None
    if n is None or n.op not in ("MatMul", "Gemm") or n.domain or len(x.outputs) != 1 or x in graph.outputs:
        return None
    h, w = n.inputs[0], const_value(n.inputs[1])
    if w is None or w.dtype != F32 or w.ndim != 2 or rank_of(h) != 2 or dtype_of(h) != F32 or n.attrs.get("transA", 0):
        return None
    w = (w.T if n.attrs.get("transB", 0) else w) * np.float32(n.attrs.get("alpha", 1.0))
    bias = np.zeros(w.shape[1], np.float32)
    if n.op == "Gemm" and len(n.inputs) > 2 and n.inputs[2].name:
        c = per_column(n.inputs[2], w.shape[1])
        if c is None:
            return None
        bias = (c * float(n.attrs.get("beta", 1.0))).astype(np.float32)
    if not 1 <= w.shape[1] <= LANES:
        return None
    return [h, gs.Constant(f"{n.name}/W", np.ascontiguousarray(w, np.float32)), gs.Constant(f"{n.name}/b", bias)]


def _gate_inputs(gate: gs.Tensor, row: gs.Tensor, graph: gs.Graph) -> tuple[list, dict]:
    """The kernel's gate inputs and attributes: the Softmax over the last axis of a [B, E] value that makes the gate,
    and the projection before it, where only the way to the MatMul reads them; else the gate as it is."""
    n = gate.inputs[0] if len(gate.inputs) == 1 else None
    if n is None or n.op != "Softmax" or n.domain or rank_of(gate) != 2 or not _read_only_toward(gate, row, graph):
        return [gate], {}
    if n.attrs.get("axis", -1) % 2 != 1:   # the default, -1 from opset 13 and 1 before, is the last axis of [B, E]
        return [gate], {}
    logits = n.inputs[0]
    projected = _projection(logits, graph)
    return (projected, {"softmax": 1, "project": 1}) if projected else ([logits], {"softmax": 1})


def _squeezed(out: gs.Tensor, graph: gs.Graph) -> gs.Node | None:
    """The Squeeze of axis 1 (or Reshape/Flatten to [B, D]) that alone reads the mix [B, 1, D]."""
    if len(out.outputs) != 1 or out in graph.outputs:
        return None
    n = out.outputs[0]
    if n.domain or n.op not in ("Squeeze", "Reshape", "Flatten"):
        return None
    if n.op == "Squeeze" and [a % 3 for a in (axes_of(n) or [])] != [1]:
        return None
    if n.op == "Flatten" and n.attrs.get("axis", 1) != 1:
        return None
    if n.op == "Reshape":
        target = const_value(n.inputs[1])
        if target is None or target.size != 2 or int(target.ravel()[1]) != shape_of(out)[2]:
            return None
    return n


@register_pass("gated-sum-kernel", group="lower", targets=("ort",))
def gated_sum_kernel(ctx: PassContext) -> None:
    """A gate-weighted sum of stacked experts (MMoE's and PLE's per-task mix) → ctropt's GatedSum kernel, where its
    library loads."""
    graph = ctx.graph
    annotate_shapes_if_bare(graph)
    found = [(n, m) for n in graph.nodes if n.op in ("MatMul", "SmallMatMul")
             and (n.domain or "") == ("" if n.op == "MatMul" else kernels.DOMAIN) and (m := _match(n))]
    if not found:
        ctx.note("no gate-weighted sum of experts")
        return
    if not kernels.ready(ctx, "the experts' mix"):
        return
    for node, (gate, experts) in found:
        ctx.matches += 1
        squeeze = _squeezed(node.outputs[0], graph)
        end = squeeze or node
        b = Builder(graph, f"{node.name}/GatedSum", np.float32)
        gate_inputs, attrs = _gate_inputs(gate, node.inputs[0], graph)
        y = b.op("GatedSum", gate_inputs + experts, {"keepdims": int(squeeze is None), **attrs},
                 domain=kernels.DOMAIN, dtype=end.outputs[0].dtype, shape=end.outputs[0].shape)
        replace_outputs(graph, end, [y])
        for n in [node] + ([squeeze] if squeeze else []):
            n.outputs.clear()
        ctx.rewrites += 1
    tidy(ctx)
    kernels.note_needed(ctx)
    ctx.note(f"{ctx.rewrites} gate-weighted sum(s) of experts → GatedSum")
