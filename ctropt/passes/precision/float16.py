"""`convert-float16`: the model computes in FP16 on the GPU, within a worst-row accuracy gate (opt-in:
`ctropt optimize --device cuda --precision f16`).

onnxruntime's own converter (``onnxruntime.transformers.float16``) does the rewrite: weights and tables to FP16,
Casts where ops without FP16 kernels stay FP32, the inputs and outputs kept FP32 (``keep_io_types``), so the
interface is unchanged. The pass then runs the FP32 and the FP16 model on the same generated inputs, on the GPU
where onnxruntime has its CUDA provider (else on the CPU, which has FP16 kernels for most ops), and keeps FP16 only
within the gate (quantize-int8's: ``fp16_threshold`` on the mean error relative to the mean |output|, default
0.002, and ``fp16_max_abs`` on the worst row, default 0.005 for a probability). A first try converts every op the
converter allows; where that breaks the gate, a second keeps the accumulating ops (reductions, softmax, norms,
exp/log) in FP32. Where neither holds, the model stays FP32 and the note says by how much.
"""

from __future__ import annotations

import onnx

from ...graph import CtroptError, runnable_model
from ...runtime import Runner, generate_inputs, store_input_facts
from ...runtime.session import available_backends
from .quantize import Gate, _gate_failure, _replace_graph, _worst, accuracy_report
from ..registry import PassContext, register_pass

# the second try: ops that sum many terms or amplify small differences stay FP32
ACCUMULATING_OPS = ("ReduceSum", "ReduceMean", "ReduceSumSquare", "ReduceLogSumExp", "Softmax", "LogSoftmax",
                    "LayerNormalization", "SkipLayerNormalization", "CumSum", "Exp", "Log", "Pow", "Sqrt", "Div")


def to_float16(model: onnx.ModelProto, block: tuple[str, ...] = ()) -> onnx.ModelProto:
    """The FP16 model onnxruntime's converter makes, I/O kept FP32; `block`: op types left FP32 as well. A
    CtroptError where the converter fails."""
    from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST, convert_float_to_float16

    try:
        return convert_float_to_float16(_outer_constants_once(model), keep_io_types=True,
                                        op_block_list=list(DEFAULT_OP_BLOCK_LIST) + list(block))
    except Exception as e:  # the converter asserts on graphs it does not handle
        raise CtroptError(f"onnxruntime's FP16 converter fails: {type(e).__name__} {str(e)[:200]}") from None


def _outer_constants_once(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy without the subgraph initializers that repeat an enclosing graph's (same name, same bytes): the
    body reads the outer one, as ONNX scoping allows. The converter refuses a name on both levels, and a
    graphsurgeon round trip writes a constant shared by a Scan body and its graph into both."""
    model = onnx.ModelProto.FromString(model.SerializeToString())

    def walk(graph: onnx.GraphProto, outer: dict[str, bytes]) -> None:
        own = {t.name: t.SerializeToString() for t in graph.initializer}
        keep = [t for t in graph.initializer if outer.get(t.name) != own[t.name]]
        if len(keep) != len(graph.initializer):
            del graph.initializer[:]
            graph.initializer.extend(keep)
        scope = {**outer, **{t.name: own[t.name] for t in keep}}
        for node in graph.node:
            for attr in node.attribute:
                for sub in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)):
                    walk(sub, scope)

    walk(model.graph, {})
    return model


def _half_initializers(model: onnx.ModelProto) -> int:
    return sum(t.data_type == onnx.TensorProto.FLOAT16 for t in model.graph.initializer)


def _gate_backend(ctx: PassContext) -> str:
    if ctx.device == "cuda" and available_backends()["ort-cuda"] == "available":
        return "ort-cuda"
    ctx.note("no CUDA provider here: the FP16 accuracy is checked on onnxruntime's CPU kernels")
    return "ort-cpu"


@register_pass("convert-float16", group="lower", targets=("ort",), default=False, exact=False, devices=("cuda",),
               order=200)
def convert_float16(ctx: PassContext) -> None:
    """The model in FP16 (onnxruntime's converter, I/O kept FP32) where its worst row stays within the accuracy
    gate (opt-in: --device cuda --precision f16)."""
    gate = Gate(float(ctx.options.get("fp16_threshold", 0.002)), float(ctx.options.get("fp16_max_abs", 0.005)))
    model = runnable_model(ctx.graph)
    if ctx.input_facts:
        store_input_facts(model, ctx.input_facts)
    floats = sum(t.data_type == onnx.TensorProto.FLOAT for t in model.graph.initializer)
    ctx.matches = floats
    if _half_initializers(model):
        ctx.note("the model already computes in FP16")
        return
    if not floats:
        ctx.note("no FP32 weight: nothing to compute in FP16")
        return
    feeds = [generate_inputs(model, batch=256, seed=11), generate_inputs(model, batch=7, seed=12)]
    backend = _gate_backend(ctx)
    reference = [Runner(model, backend).run(f) for f in feeds]
    for block, what in (((), "every op the converter allows"), (ACCUMULATING_OPS, "accumulating ops kept FP32")):
        try:
            half = to_float16(model, block)
            outputs = [Runner(half, backend).run(f) for f in feeds]
        except CtroptError as e:
            ctx.note(f"FP16 ({what}) does not run on {backend}: {e}")
            continue
        report = accuracy_report(reference, outputs, {}, gate)
        if _worst(report) > 1.0:
            ctx.note(f"FP16 ({what}) breaks the accuracy gate: {_gate_failure(report, gate)}")
            continue
        for name, row in report.items():
            ctx.note(f"FP16 ({what}) on {backend}, {name}: max abs err {row['max_abs']:.3g} ≤ {row['max_bound']:.3g}, "
                     f"mean {row['mean_abs']:.3g} ({row['rel_mean']:.3%} of mean |output| ≤ {gate.threshold:.2%})")
        _replace_graph(ctx.graph, half)
        ctx.rewrites = max(1, _half_initializers(half))
        return
    ctx.note("the model stays FP32")

