"""Lowering for onnxruntime: forms that onnxruntime's own graph fusions would make slower.

onnxruntime fuses a residual ``Add`` and the LayerNormalization that reads it (also one it first fuses from
ReduceMean/Sub/Pow/Sqrt/Div) into ``com.microsoft.SkipLayerNormalization``. On onnxruntime 1.32's CPU provider that
kernel is 3–6× slower than the two ops it replaces (1 thread: [256, 21, 24] 557 µs against 180 µs, [256, 21, 256]
6.9 ms against 1.1 ms, [64, 128, 768] 31 ms against 6.5 ms; `git show 8b89a5f:benchmarks/RESULTS.md`), and the behaviour-sequence
transformers (BST, TransAct) spend a third of their time there. `residual-add-as-sum` writes that Add as a ``Sum`` of
the same two values: the same float addition, which the fusion does not match. The speed guard keeps it only where
it measures faster.

`layer-norm-kernel` goes further where ctropt's kernel library loads: a LayerNormalization over the last axis, with
the residual Add or Sum before it, becomes one ``LayerNorm`` kernel node, which reads each row once and normalizes
it in registers. onnxruntime's own takes about 7× a copy of its input on the short rows of these models
([5376, 32]: 166 µs against a 23 µs copy; 190 µs with the Sum). It also reads the forms exporters write a layer norm
in: elementwise ops (paddle2onnx before opset 17), and tf2onnx's Keras LayerNormalization, a BatchNormalization over
x reshaped to [1, rows, D, 1] with the rows' own mean and variance (DeepRec BST: five ops and two Reshapes a norm).
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from ... import kernels
from ...graph.edit import axes_of, const_value, dtype_of, read_once, shape_of
from ...patterns import Const, Match, P, Rewrite, Var
from ...runtime.probe import try_probe
from ..registry import PassContext, register_pass


def _normalized(m: Match) -> bool | str:
    """The sum is what a layer norm normalizes: a LayerNormalization's input, or the mean over the last axis that
    a decomposed one starts with (onnxruntime fuses that into a LayerNormalization first)."""
    out = m.root.outputs[0]
    if any(const_value(u) is not None for u in m.root.inputs):
        return "a bias, not a residual"
    if any(o is out for o in m.graph.outputs):
        return "a graph output"
    for reader in out.outputs:
        if reader.op == "LayerNormalization" and reader.inputs[0] is out:
            return True
        if reader.op == "ReduceMean" and axes_of(reader) == [-1] and any(
                r.op == "Sub" and r.inputs[0] is out for r in out.outputs):
            return True
    return "no layer norm reads it"


def _as_sum(m: Match) -> list:
    out = m.root.outputs[0]
    return m.op("Sum", list(m.root.inputs), name=f"{m.root.name}/Sum", dtype=out.dtype, shape=out.shape)


RESIDUAL_RULES = (
    Rewrite("residual-add-as-sum", P.Add(Var("x"), Var("skip")), _as_sum, _normalized),
)


@register_pass("residual-add-as-sum", group="lower", targets=("ort",), rules=RESIDUAL_RULES)
def residual_add_as_sum(ctx: PassContext) -> None:
    """A residual Add that a layer norm reads → Sum: onnxruntime does not fuse it into SkipLayerNormalization, whose
    CPU kernel measures 3–6× slower than Add + LayerNormalization."""
    ctx.apply(*RESIDUAL_RULES)


def _residual_add(x: gs.Tensor, graph: gs.Graph) -> gs.Node | None:
    """The Sum or Add of two values that makes a norm's input x, when only the norm reads x; else None."""
    node = x.inputs[0] if x.inputs else None
    if node is None or node.op not in ("Sum", "Add") or len(node.inputs) != 2 or not read_once(x, graph):
        return None
    return node


def _norm_inputs(x: gs.Tensor, scale_bias: list, skip: gs.Tensor | None) -> list:
    """The LayerNorm kernel's inputs: x, scale, bias, the residual; the optional ones empty where there are none,
    trailing empties dropped."""
    inputs = [x, *scale_bias, *[gs.Variable.empty()] * (2 - len(scale_bias)), skip or gs.Variable.empty()]
    while not inputs[-1].name:
        inputs.pop()
    return inputs


def _residual(m: Match) -> list | None:
    """The two same-shape values a Sum or Add adds (read only by the norm) before the norm, or None."""
    node = _residual_add(m["x"], m.graph)
    if node is None:
        return None
    a, b = (shape_of(u) for u in node.inputs)
    return list(node.inputs) if a is not None and a == b and None not in a else None


def _is_row_norm(m: Match) -> bool | str:
    x, shape = m["x"], shape_of(m["x"])
    if dtype_of(x) is None or np.dtype(dtype_of(x)) != np.float32 or shape is None or not 1 <= len(shape) <= 8:
        return "not a float32 value of rank 1 to 8"
    if m.root.attrs.get("axis", -1) % len(shape) != len(shape) - 1:
        return "not a norm over the last axis"
    if any(o.name and (o.outputs or any(o is g for g in m.graph.outputs)) for o in m.root.outputs[1:]):
        return "its mean or inverse deviation is read"
    width = shape[-1]
    if not isinstance(width, (int, np.integer)) or any(
            shape_of(t) is None or int(np.prod(shape_of(t))) != width for t in m.root.inputs[1:] if t.name):
        return "the width or the scale's size is not known to match"
    return True


def _to_norm_kernel(m: Match) -> list:
    """LayerNorm(x or a, scale, bias, b): inputs 2 and 3 (bias, residual) empty where there is none."""
    out, residual = m.root.outputs[0], _residual(m)
    inputs = _norm_inputs(residual[0] if residual else m["x"], list(m.root.inputs[1:3]),
                          residual[1] if residual else None)
    return [m.op("LayerNorm", inputs, {"epsilon": float(m.root.attrs.get("epsilon", 1e-5))},
                 name=f"{m.root.name}/LayerNorm", domain=kernels.DOMAIN, dtype=out.dtype, shape=out.shape)[0]]


def _decomposed(m: Match) -> dict | None:
    """``(x - mean(x)) / sqrt(mean((x - mean(x))²) + eps) · scale + bias`` over the last axis, as paddle2onnx writes
    a LayerNorm before opset 17 (onnxruntime fuses it back at load time, into its own slow kernel); the pattern
    (WRITTEN_OUT) holds from the bias to the centred value d: here d = x - mean(x), read by the square and the
    division only. x, scale, bias, eps; None when it is not that."""
    d = m["d"]
    sub = d.inputs[0] if d.inputs else None
    if sub is None or sub.op != "Sub" or len(d.outputs) != 2 or any(d is o for o in m.graph.outputs):
        return None
    x, mean = sub.inputs
    mean_node = mean.inputs[0] if mean.inputs and read_once(mean, m.graph) else None
    two, eps, rank = m.const("two"), m.const("eps"), len(shape_of(x) or [])
    if mean_node is None or mean_node.op != "ReduceMean" or mean_node.inputs[0] is not x or two.size != 1 or \
            float(np.ravel(two)[0]) != 2.0 or eps.size != 1 or not rank:
        return None
    if any((axes_of(n) or [None]) != [rank - 1] and (axes_of(n) or [None]) != [-1] or not n.attrs.get("keepdims", 1)
           for n in (mean_node, m.node("var"))):
        return None
    width = (shape_of(x) or [None])[-1]
    if not isinstance(width, (int, np.integer)) or rank > 8 or any(   # a [D] row (leading 1s) broadcast as the kernel does
            c.ndim > rank or c.shape[-1:] != (width,) or c.size != width for c in (m.const("scale"), m.const("bias"))):
        return None
    return {"x": x, "scale": m.const("scale"), "bias": m.const("bias"), "eps": float(np.ravel(eps)[0])}


def _is_decomposed_norm(m: Match) -> bool | str:
    found = _decomposed(m)
    if found is None:
        return "not a layer norm written out over the last axis"
    return True if np.dtype(dtype_of(found["x"]) or np.float64) == np.float32 else "not float32"


def _decomposed_to_kernel(m: Match) -> list:
    found, out = _decomposed(m), m.root.outputs[0]
    scale = m.constant(f"{m.root.name}/scale", np.ravel(found["scale"]).astype(np.float32))
    bias = m.constant(f"{m.root.name}/bias", np.ravel(found["bias"]).astype(np.float32))
    return [m.op("LayerNorm", [found["x"], scale, bias], {"epsilon": found["eps"]}, name=f"{m.root.name}/LayerNorm",
                 domain=kernels.DOMAIN, dtype=out.dtype, shape=out.shape)[0]]


_d = Var("d")   # the centred value, read twice: by the square and by the division
WRITTEN_OUT = P.Add(P.Mul(P.Div(_d, P.Sqrt(P.Add(P.ReduceMean(P.Pow(_d, Const("two")), ..., _name="var"),
                                                 Const("eps")))), Const("scale")), Const("bias"), _domain="")


def _fill(t: gs.Tensor) -> float | None:
    """The one value a constant, or Expand(constant), holds everywhere; None otherwise."""
    if t.inputs and t.inputs[0].op == "Expand":
        t = t.inputs[0].inputs[0]
    v = const_value(t)
    return float(v.reshape(-1)[0]) if v is not None and v.size and (v == v.reshape(-1)[0]).all() else None


def _made(t: gs.Tensor, op: str) -> gs.Node | None:
    return t.inputs[0] if t.inputs and t.inputs[0].op == op else None


def _batchnorm_norm(m: Match) -> dict | None:
    """tf2onnx's Keras LayerNormalization: x [.., D] reshaped to [1, N, D, 1] (a row per channel), BatchNormalization
    with scale 1, bias 0 and the rows' own statistics (mean = ReduceMean over D, var = ReduceSumSquare(x - mean) /
    D), reshaped back to x's shape: a norm over the last axis, without scale and bias. x and eps, or None."""
    bn, x4 = m.node("bn"), m["x4"]
    flat = _made(x4, "Reshape")
    x = flat.inputs[0] if flat else None
    shape, to, back = shape_of(x) if x else None, const_value(flat.inputs[1]) if flat else None, const_value(m["back"])
    if shape is None or to is None or back is None or not isinstance(shape[-1], (int, np.integer)) or \
            [int(a) for a in to] != [1, -1, shape[-1], 1] or bn.attrs.get("training_mode", 0) or \
            _fill(m["scale"]) != 1.0 or _fill(m["bias"]) != 0.0 or len(back) != len(shape) or \
            any(b != d and not (b == -1 and not isinstance(d, (int, np.integer))) for b, d in zip(back, shape)):
        return None
    squeeze, div = _made(m["mean"], "Squeeze"), _made(m["var"], "Div")
    mean = _made(squeeze.inputs[0], "ReduceMean") if squeeze else None
    sum_sq = _made(div.inputs[0], "ReduceSumSquare") if div else None
    sub = _made(sum_sq.inputs[0], "Sub") if sum_sq else None
    rows = ([0, 2, 3], [2, 3], [2])
    if mean is None or sub is None or mean.inputs[0] is not x4 or list(sub.inputs) != [x4, mean.outputs[0]] or \
            axes_of(mean) not in rows or axes_of(sum_sq) != [0, 2, 3] or sum_sq.attrs.get("keepdims", 1) or \
            not mean.attrs.get("keepdims", 1) or axes_of(squeeze) != [0, 2, 3] or \
            _fill(div.inputs[1]) != float(shape[-1]):
        return None   # the statistics of each row ([1, N, D, 1] → [N]), the variance over D
    return {"x": x, "eps": float(bn.attrs.get("epsilon", 1e-5))}


def _batchnorm_to_kernel(m: Match) -> list:
    found, out = _batchnorm_norm(m), m.root.outputs[0]
    width = int(shape_of(found["x"])[-1])
    ones = m.constant(f"{m.root.name}/ones", np.ones(width, np.float32))
    zeros = m.constant(f"{m.root.name}/zeros", np.zeros(width, np.float32))
    return [m.op("LayerNorm", [found["x"], ones, zeros], {"epsilon": found["eps"]}, name=f"{m.root.name}/LayerNorm",
                 domain=kernels.DOMAIN, dtype=out.dtype, shape=out.shape)[0]]


def _is_batchnorm_norm(m: Match) -> bool | str:
    found = _batchnorm_norm(m)
    if found is None:
        return "not a layer norm written as a BatchNormalization over rows"
    return True if np.dtype(dtype_of(found["x"]) or np.float64) == np.float32 else "not float32"


NORM_RULES = (
    Rewrite("layer-norm", P.LayerNormalization(Var("x"), ..., _domain=""), _to_norm_kernel, _is_row_norm,
            subgraphs=False),
    Rewrite("layer-norm-written-out", WRITTEN_OUT, _decomposed_to_kernel, _is_decomposed_norm, subgraphs=False),
    Rewrite("layer-norm-as-batchnorm", P.Reshape(P.BatchNormalization(Var("x4"), Var("scale"), Var("bias"),
                                                                       Var("mean"), Var("var"), _name="bn"),
                                                 Var("back")),
            _batchnorm_to_kernel, _is_batchnorm_norm, subgraphs=False),
)


@register_pass("layer-norm-kernel", group="lower", targets=("ort",), rules=NORM_RULES)
def layer_norm_kernel(ctx: PassContext) -> None:
    """LayerNormalization over the last axis, and the residual Add or Sum before it, or a layer norm written out in
    elementwise ops (paddle2onnx before opset 17) or as a BatchNormalization over rows (tf2onnx's Keras
    LayerNormalization) → ctropt's LayerNorm kernel, where its library loads."""
    if any(n.op in ("LayerNormalization", "ReduceMean", "BatchNormalization") for n in ctx.graph.nodes):
        if kernels.apply_rules(ctx, NORM_RULES, "layer norms"):
            ctx.count(_residuals_measured(ctx.graph))


def _residuals_measured(graph: gs.Graph) -> int:
    """The residual Sum or Add before a LayerNorm kernel whose two values the annotations cannot tell of one shape
    (sizes named apart: a Transpose's 'unk__10' and a Concat's 'batch'), taken into it where a run of the graph at
    two sizes gives them the same shape in both. Returns how many."""
    found = []
    for n in graph.nodes:
        add = _residual_add(n.inputs[0], graph) \
            if n.op == "LayerNorm" and n.domain == kernels.DOMAIN and len(n.inputs) < 4 else None
        if add is not None and all(const_value(u) is None for u in add.inputs):
            found.append((n, add))
    probe = try_probe(graph)[0] if found else None
    if probe is None:
        return 0
    done = 0
    for norm, add in found:
        a, b = (probe.shapes(u) for u in add.inputs)
        if a is None or a != b:
            continue
        inputs = _norm_inputs(add.inputs[0], list(norm.inputs[1:3]), add.inputs[1])
        norm.inputs.clear()
        norm.inputs.extend(inputs)
        add.outputs.clear()
        done += 1
    graph.cleanup()
    return done
