"""The attention pooling over the valid positions only, for `remove-attention-padding`.

Once the scores are computed at the N valid positions, the pooling ``Σ_t w[b, t] · E[b, t]`` still walks all
B·T positions when the masked weights are zero at the padded ones (``Where(mask, s, 0)`` or ``s · Cast(mask)``,
no softmax in between): it equals a scatter-add of ``s_i · E[b_i, t_i]`` over the valid positions i into row b_i.
onnxruntime runs that (ScatterND with reduction "add", opset 16) on N rows instead of a batched MatMul of B tiny
products. The sum's order changes, so the result agrees to float rounding.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from ...graph.edit import Builder, is_all_zeros
from ...runtime.probe import Probe
from .padding_rows import MOVES, poolings

def zero_at_padding(mask_op: gs.Node, cond: gs.Tensor, negate: bool) -> bool:
    """The masking writes 0 at padded positions and the scores themselves at valid ones: ``Where(valid, s, 0)`` /
    ``Where(padded, 0, s)``, or a product with `cond` a Cast of booleans (a float mask input may hold other
    values)."""
    if mask_op.op == "Where":
        fill = mask_op.inputs[1 if negate else 2]
        return is_all_zeros(fill)  # a constant, or zeros_like(s): ConstantOfShape(0)
    made = cond.inputs[0] if cond.inputs else None
    return made is not None and made.op == "Cast" and made.inputs[0].dtype in (np.bool_, None)


def position_rows(b: Builder, region, valid: gs.Tensor) -> gs.Tensor:
    """[N]: the row of each of a rebuilt region's positions (position // T), made once (by `b`) and kept on
    the region's builder."""
    if region.batch_rows is None:
        steps = b.op("Gather", [b.op("Shape", [valid]), b.const("history_axis", np.array(1, np.int64))],
                     {"axis": 0}, name="steps")
        steps = b.op("Max", [steps, b.const("one", np.array(1, np.int64))], name="steps_1")  # T = 0: no positions
        region.batch_rows = b.op("Div", [region.positions, steps], name="batch_rows")
    return region.batch_rows


def _reads(w: gs.Tensor, weights: gs.Tensor) -> bool:
    """`w` is `weights` through layout ops only."""
    for _ in range(6):
        if w is weights:
            return True
        n = w.inputs[0] if w.inputs else None
        if n is None or n.op not in MOVES:
            return False
        w = n.inputs[0]
    return False


def pool_valid_positions(graph: gs.Graph, weights: gs.Tensor, region, valid: gs.Tensor,
                         sizes: list[tuple[int, int]], probe: Probe) -> int:
    """Each pooling of `weights` ([B, T], zero at padded positions) → a scatter-add over the rebuilt `region`'s
    positions (flat b·T + t) of its valid scores times the pooled values there
    (the rows the region gathered, when the pooled values are one of its entries). Returns how many."""
    positions, scores_valid, done = region.positions, region.scores_valid, 0
    b = Builder(graph, f"{weights.name}/pooled")
    for node, w, e, axis in poolings(graph):
        shapes, w_shapes = probe.shapes(e), probe.shapes(w)
        want = [(bt[0], bt[1], 1) if axis == 1 else (bt[0], 1, bt[1]) for bt in sizes]  # w [B, T, 1] or [B, 1, T]
        if not _reads(w, weights) or shapes is None or w_shapes is None or [tuple(x) for x in w_shapes] != want or \
                any(len(s) != 3 or tuple(s[:2]) != bt or s[2] != shapes[0][2] for s, bt in zip(shapes, sizes)):
            continue
        width = shapes[0][2]
        weight = b.op("Reshape", [scores_valid, b.const("column", np.array([-1, 1], np.int64))],
                      name="weights")
        rows = b.op("Unsqueeze", [position_rows(b, region, valid),
                                  b.const("last", np.array([1], np.int64))], name="rows")
        if id(e) in region.entry_rows:
            values = region.entry_rows[id(e)]
        else:
            values = b.op("Gather", [b.op("Reshape", [e, b.const("as_rows", np.array([-1, width], np.int64))]),
                                     positions], {"axis": 0}, name="values")
        batch = b.op("Slice", [b.op("Shape", [valid]), b.const("from", np.array([0], np.int64)),
                               b.const("one", np.array([1], np.int64))])
        zero = gs.Constant(b.name("zero"), np.zeros(1, probe.value(e).dtype))
        zeros = b.op("ConstantOfShape", [b.op("Concat", [batch, b.const("width", np.array([width], np.int64))],
                                                {"axis": 0})], {"value": zero})
        pooled = b.op("ScatterND", [zeros, rows, b.op("Mul", [weight, values])], {"reduction": "add"}, name="pooled")
        out = node.outputs[0]
        keep = node.op == "MatMul" or node.attrs.get("keepdims", 1)
        if keep:
            pooled = b.axes_op("Unsqueeze", pooled, [1], name="pooled_row")
        for c in list(out.outputs):
            c.inputs[c.inputs.index(out)] = pooled
        if out in graph.outputs:  # the graph output keeps its name, type and shape
            graph.outputs[graph.outputs.index(out)] = pooled
            pooled.name, out.name = out.name, f"{out.name}/unused"
            pooled.dtype, pooled.shape = out.dtype, out.shape
        done += 1
    return done
