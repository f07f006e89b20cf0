"""The pattern language: patterns read like the math they match.

    x, w, b = Var("x"), Const("w", rank=2), Const("b")
    fc = P.Relu(P.Add(P.MatMul(x, w), b))          # Add is matched in either operand order
    gemm_or_matmul = P["MatMul|Gemm"](x, w, ...)    # op alternatives; `...` = any further inputs
    parts = P.Split(x, _outputs=2)                  # multi-output node: parts[0], parts[1]
    either = P.Gemm(x, w, b) | P.Add(P.MatMul(x, w), b)

Keyword arguments of an op pattern are attribute checks (a value, or a predicate on the value);
`_name` captures the node, `_shared=True` allows the node's outputs to be used outside the match,
`_domain` restricts the op domain. An op type ending in `*` stands for every op type that starts
with the rest (`P["GRUSequence*"](...)`: all variants of a custom op). Matching runs in every graph,
Loop/Scan/If bodies included; a Var or Const may bind a value from an outer scope, but nodes of an
outer scope are never part of a match (a rewrite inside a body cannot change them). A rule with
`Rewrite(..., subgraphs=False)` looks at the outermost graph only.
"""

from ..graph.edit import const_value  # a graph helper, kept here for the pattern API's users
from .matcher import (
    Any,
    Const,
    Explanation,
    Match,
    OpPattern,
    P,
    Pattern,
    Rewrite,
    Var,
    apply_rewrites,
    explain,
    find_matches,
    is_commutative,
)

__all__ = [
    "Any",
    "Const",
    "Explanation",
    "Match",
    "OpPattern",
    "P",
    "Pattern",
    "Rewrite",
    "Var",
    "apply_rewrites",
    "const_value",
    "explain",
    "find_matches",
    "is_commutative",
]
