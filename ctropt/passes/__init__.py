"""The pass registry, the PassManager, the speed guard and the built-in pass families (one package each)."""

import importlib

# The modules that register the built-in passes, family by family. The attention, dense, lowering and precision
# packages do not import their own modules (their modules use each other's helpers across families, which
# package-level imports would turn into cycles); cleanup, embedding and rnn do.
FAMILIES = {
    "cleanup": (), "embedding": (), "rnn": (),
    "attention": ("attention", "attention_core", "pooling", "query_once", "token_attention"),
    "dense": ("dedup", "dot_sum", "experts", "fc", "fm", "mul_add", "small_products"),
    "lowering": ("lookup_rows", "lower_openvino", "lower_ort", "read_rows", "row_kernels"),
    "precision": ("float16", "quantize"),
}
for _family, _modules in FAMILIES.items():
    importlib.import_module(f"{__name__}.{_family}")
    for _module in _modules:
        importlib.import_module(f"{__name__}.{_family}.{_module}")

from .manager import OptimizeResult, PassFailed, PassManager, PassRecord, optimize
from .registry import GROUPS, REGISTRY, TARGETS, Pass, PassContext, load_plugin, register_pass, resolve, rewrite_pass

__all__ = ["GROUPS", "REGISTRY", "TARGETS", "OptimizeResult", "Pass", "PassContext", "PassFailed", "PassManager",
           "PassRecord", "load_plugin", "optimize", "register_pass", "resolve", "rewrite_pass"]
