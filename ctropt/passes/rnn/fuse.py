"""`fuse-rnn`: every GRU-family layer, in whatever form the exporter wrote it, → one ai.ctropt sequence op
(``ctropt.ops.rnn``). The readers find where a layer is; ``cell.identify_gru_cell`` reads its cell by meaning:
- ONNX GRU ops (torch ``nn.GRU``, tf2onnx's GRU rewriter): ``unrolled.fuse_gru_ops``;
- Scan/Loop layers (tf2onnx from ``dynamic_rnn``, Keras GRU, DeepCTR's while loops): ``loops``;
- cells unrolled over time (a Python loop over steps in PyTorch): ``unrolled.fuse_unrolled_cells``.
"""

from __future__ import annotations

import onnx_graphsurgeon as gs

from ...ops.rnn import MIN_OPSET
from ..registry import PassContext, register_pass
from .loops import fuse_recurrent_loops
from .prefix import lengths_from_output_masks
from .scaled import attention_from_scaled_inputs
from .gru_op import fuse_gru_ops
from .unrolled import fuse_unrolled_cells


def _opset(graph: gs.Graph) -> int:
    return int(getattr(graph, "opset", None) or 0)


@register_pass("fuse-rnn", group="fusion")
def fuse_rnn(ctx: PassContext) -> int:
    """GRU/AUGRU/AGRU/AIGRU layers (ONNX GRU ops, Scan/Loop bodies, unrolled cells) → one ai.ctropt sequence op each.

    The readers (one per dialect) read each layer by meaning; a layer whose outputs are then zeroed past each
    row's length is told the lengths (``prefix``), a GRU over inputs scaled per step reads the weights as an AIGRU
    (``scaled``); the pass returns how many layers they fused."""
    opset = _opset(ctx.graph)
    if opset < MIN_OPSET:
        ctx.note(f"skipped: opset {opset} < {MIN_OPSET}")
        return 0
    skipped: list[str] = []
    fused = list(fuse_gru_ops(ctx.graph, opset)) + list(fuse_unrolled_cells(ctx.graph, opset, notes=skipped))
    fused += list(fuse_recurrent_loops(ctx.graph, opset, notes=skipped))
    told = lengths_from_output_masks(ctx.graph) + attention_from_scaled_inputs(ctx.graph) if fused else []
    for line in fused + told + [f"left as is: {line}" for line in skipped]:
        ctx.note(line)
    if fused:
        _forget_intermediate_shapes(ctx.graph)
    return len(fused)


def _forget_intermediate_shapes(graph: gs.Graph) -> None:
    """Shapes annotated before the rewrite may name dims of values that now mean something else (a GRU over
    packed rows becomes one over the batch); the manager re-infers them."""
    keep = {id(t) for t in list(graph.inputs) + list(graph.outputs)}
    for t in graph.tensors().values():
        if isinstance(t, gs.Variable) and id(t) not in keep:
            t.shape = None
