"""Whether a backend's runtime can run a model's ops, checked before the model is handed to it.

OpenVINO's ONNX frontend reads the default domain and some ``com.microsoft`` contrib ops. It has no conversion rule
for ctropt's onnxruntime kernels (``ai.ctropt.kernels``), for ctropt's fused ops (``ai.ctropt``: their function
bodies, inlined or not, hold Scan forms it does not convert; `--target openvino` lowers them) or for
onnxruntime-extensions' string ops (OpenVINO 2026.4, each probed: "No conversion rule found"; an ort-target result
has also ended in a segmentation fault inside its compile). onnxruntime runs all of them, the kernels only where
ctropt's kernel library loads; its OpenVINO EP hands the nodes it cannot take to the CPU provider.
"""

from __future__ import annotations

from pathlib import Path

import onnx

from .. import kernels
from ..graph import CtroptError, iter_proto_nodes
from . import strings

FUSED_DOMAIN = "ai.ctropt"   # ctropt.ops.DOMAIN (the runtime layer does not import ops)

# com.microsoft ops OpenVINO 2026.4's ONNX frontend has a conversion rule for (each read alone; the others of
# onnxruntime's contrib schemas say "No conversion rule found"). tests/test_runtime_check.py probes them.
OPENVINO_CONTRIB = frozenset({
    "Attention", "BiasAdd", "BiasGelu", "BifurcationDetector", "DequantizeLinear", "DynamicQuantizeLSTM",
    "DynamicQuantizeMatMul", "EmbedLayerNormalization", "FastGelu", "FusedConv", "FusedGemm", "FusedMatMul",
    "GatherBlockQuantized", "GatherND", "Gelu", "GroupNorm", "GroupQueryAttention", "MatMulIntegerToFloat",
    "MatMulNBits", "MultiHeadAttention", "Pad", "QLinearAdd", "QLinearAveragePool", "QLinearConcat", "QLinearLeakyRelu",
    "QLinearMul", "QLinearReduceMean", "QLinearSigmoid", "QLinearSoftmax", "QLinearWhere", "QuantizeLinear",
    "QuickGelu", "Range", "RotaryEmbedding", "SimplifiedLayerNormalization", "SkipLayerNormalization",
    "SkipSimplifiedLayerNormalization", "Trilu"})
CONTRIB = "com.microsoft"
_ELSEWHERE = "or run it on an onnxruntime backend (ort-cpu)"


def ops_of(model: onnx.ModelProto, domain: str) -> list[str]:
    """The op types of `domain` in the model (subgraphs included), sorted."""
    return sorted({n.op_type for n in iter_proto_nodes(model.graph) if n.domain == domain})


def _kernels_on_openvino(model: onnx.ModelProto, name: str, instead: str | None = None) -> str:
    used = ops_of(model, kernels.DOMAIN)
    if not used:
        return ""
    return (f"{name} holds ctropt's onnxruntime kernels ({', '.join(used)}) that OpenVINO cannot run: "
            + (instead or f"optimize the original model with --target openvino for OpenVINO, {_ELSEWHERE}"))


def _openvino_refusal(model: onnx.ModelProto, name: str) -> str:
    """Why OpenVINO cannot run the model's ops, or ''."""
    kernel_ops = _kernels_on_openvino(model, name)
    if kernel_ops:
        return kernel_ops
    kinds = (
        (ops_of(model, FUSED_DOMAIN), "ctropt's fused ops", "optimize it with --target openvino, which lowers them"),
        ([op for op in ops_of(model, CONTRIB) if op not in OPENVINO_CONTRIB], f"{CONTRIB} contrib ops",
         "optimize the original model with --target openvino for OpenVINO"),
        (ops_of(model, strings.DOMAIN), "onnxruntime-extensions string ops",
         "`ctropt split-strings` makes the id model OpenVINO runs"),
    )
    for used, what, instead in kinds:
        if used:
            return f"{name} holds {what} ({', '.join(used)}) that OpenVINO cannot run: {instead}, {_ELSEWHERE}"
    return ""


def _ort_refusal(model: onnx.ModelProto, name: str) -> str:
    """Why onnxruntime cannot run the model's ops here (ctropt's kernels without their library), or ''."""
    used = ops_of(model, kernels.DOMAIN)
    problem = kernels.ensure() if used else None
    if not problem:
        return ""
    return (f"{name} holds ctropt's onnxruntime kernels ({', '.join(used)}) and ctropt's kernel library cannot be "
            f"built here: {problem}; fix that (`ctropt kernels build`), or optimize the original model with "
            "--option ort_kernels=off for standard ops only")


def model_name(model, name: str | None = None) -> str:
    """How messages name a model: `name`, a path's file name, else 'the model'."""
    return name or (Path(model).name if isinstance(model, (str, Path)) else "the model")


def check_runnable(model: onnx.ModelProto, backend: str, name: str | None = None) -> None:
    """CtroptError naming the ops `backend`'s runtime cannot run and what to do instead; nothing when it can."""
    from .session import BACKENDS

    runtime = BACKENDS[backend][0]
    why = (_openvino_refusal if runtime == "openvino" else _ort_refusal)(model, model_name(model, name))
    if why:
        raise CtroptError(why)


def check_target(model: onnx.ModelProto, target: str, name: str | None = None, instead: str | None = None) -> None:
    """Before optimizing for `target`: CtroptError when the model holds ops no pass for it takes back (ctropt's
    onnxruntime kernels, for openvino); `instead`: what the message tells the user to do."""
    why = _kernels_on_openvino(model, model_name(model, name), instead) if target == "openvino" else ""
    if why:
        raise CtroptError(why)
