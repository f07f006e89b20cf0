"""The pass registry, the PassManager and the built-in pass families (one module each)."""

from . import attention, attention_core, cleanup, dedup, dot_sum, embedding, experts, fc, fm, float16, layout, lookup_rows, lower_openvino, lower_ort, mul_add, pooling, quantize, query_once, read_rows, rnn, row_kernels, small_products, strings, token_attention  # noqa: F401  (registers the passes)
from .manager import OptimizeResult, PassFailed, PassManager, PassRecord, optimize
from .registry import GROUPS, REGISTRY, TARGETS, Pass, PassContext, load_plugin, register_pass, resolve, rewrite_pass

__all__ = ["GROUPS", "REGISTRY", "TARGETS", "OptimizeResult", "Pass", "PassContext", "PassFailed", "PassManager",
           "PassRecord", "load_plugin", "optimize", "register_pass", "resolve", "rewrite_pass"]
