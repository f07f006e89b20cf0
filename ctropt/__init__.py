"""ctropt: pattern-matching graph optimizer for CTR and recommendation models in ONNX.

    import ctropt
    model = ctropt.load("model.onnx")
    result = ctropt.optimize(model, passes="all", target="ort")   # verified after every pass
    ctropt.save(result.model, "model.opt.onnx")
"""

from . import patterns
from .graph import CtroptError, load, save
from .passes import (
    REGISTRY,
    OptimizeResult,
    Pass,
    PassContext,
    PassFailed,
    PassManager,
    PassRecord,
    optimize,
    register_pass,
    rewrite_pass,
)
from .patterns import Any, Const, Match, P, Rewrite, Var, explain, find_matches

__version__ = "0.1.0"

__all__ = ["REGISTRY", "Any", "Const", "CtroptError", "Match", "OptimizeResult", "P", "Pass", "PassContext",
           "PassFailed", "PassManager", "PassRecord", "Rewrite", "Var", "explain", "find_matches", "load",
           "optimize", "patterns", "register_pass", "rewrite_pass", "save"]
