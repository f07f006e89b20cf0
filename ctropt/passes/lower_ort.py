"""Lowering for onnxruntime: forms that onnxruntime's own graph fusions would make slower.

onnxruntime fuses a residual ``Add`` and the LayerNormalization that reads it (also one it first fuses from
ReduceMean/Sub/Pow/Sqrt/Div) into ``com.microsoft.SkipLayerNormalization``. On onnxruntime 1.32's CPU provider that
kernel is 3–6× slower than the two ops it replaces (1 thread: [256, 21, 24] 557 µs against 180 µs, [256, 21, 256]
6.9 ms against 1.1 ms, [64, 128, 768] 31 ms against 6.5 ms; `benchmarks/RESULTS.md`), and the behaviour-sequence
transformers (BST, TransAct) spend a third of their time there. `residual-add-as-sum` writes that Add as a ``Sum`` of
the same two values: the same float addition, which the fusion does not match. The speed guard keeps it only where
it measures faster.
"""

from __future__ import annotations

from ..graph.edit import axes_of, const_value
from ..patterns import Match, P, Rewrite, Var
from .registry import PassContext, register_pass


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
