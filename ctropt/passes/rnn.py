"""Recurrent layers: `fuse-rnn` turns every GRU-family layer, in whatever form the exporter wrote it, into one
ai.ctropt sequence op (``ctropt.ops.rnn``); `lower-rnn-ort` turns those into what onnxruntime runs fastest.

Dialects (each reader lives beside this module and identifies the cell by meaning, ``ctropt.patterns.gru_cell``):
- ONNX GRU ops (torch ``nn.GRU``, tf2onnx's GRU rewriter): ``rnn_unrolled.fuse_gru_ops``;
- Scan/Loop layers (tf2onnx from ``dynamic_rnn``, Keras GRU, DeepCTR's while loops): ``rnn_loops``;
- cells unrolled over time (a Python loop over steps in PyTorch): ``rnn_unrolled.fuse_unrolled_cells``.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from ..graph import CtroptError
from ..ops.rnn import INPUTS, MIN_OPSET, OUTPUTS, SequenceAttrs, build_sequence, is_sequence_node
from ..patterns.matcher import const_value, unique_name
from .registry import PassContext, register_pass

# onnxruntime form per kind (see benchmarks/RESULTS.md, "Recurrent layers on onnxruntime").
ORT_FORMS = ("scan", "gru-op")


def _opset(graph: gs.Graph) -> int:
    return int(getattr(graph, "opset", None) or 0)


@register_pass("fuse-rnn", group="fusion", order=30)
def fuse_rnn(ctx: PassContext) -> None:
    """GRU/AUGRU/AGRU/AIGRU layers (ONNX GRU ops, Scan/Loop bodies, unrolled cells) → one ai.ctropt sequence op each."""
    from .rnn_loops import fuse_recurrent_loops
    from .rnn_unrolled import fuse_gru_ops, fuse_unrolled_cells

    opset = _opset(ctx.graph)
    if opset < MIN_OPSET:
        ctx.note(f"skipped: opset {opset} < {MIN_OPSET}")
        return
    skipped: list[str] = []
    for reader in (fuse_gru_ops, fuse_unrolled_cells):
        for line in reader(ctx.graph, opset):
            ctx.matches += 1
            ctx.rewrites += 1
            ctx.note(line)
    for line in fuse_recurrent_loops(ctx.graph, opset, notes=skipped):
        ctx.matches += 1
        ctx.rewrites += 1
        ctx.note(line)
    for line in skipped:
        ctx.note(f"left as is: {line}")
    if ctx.rewrites:
        _forget_intermediate_shapes(ctx.graph)


def _forget_intermediate_shapes(graph: gs.Graph) -> None:
    """Shapes annotated before the rewrite may name dims of values that now mean something else (a GRU over
    packed rows becomes one over the batch); the manager re-infers them."""
    keep = {id(t) for t in list(graph.inputs) + list(graph.outputs)}
    for t in graph.tensors().values():
        if isinstance(t, gs.Variable) and id(t) not in keep:
            t.shape = None


def _gru_op_ok(node: gs.Node, attrs: SequenceAttrs) -> bool:
    """The ONNX GRU op computes this node: a plain GRU, lengths (not a mask), zeros at padded steps."""
    names = [t.name for t in node.inputs]
    has = lambda i: len(names) > i and names[i] != ""  # noqa: E731
    # onnxruntime's GRU writes 0, not initial_h, as the last state of a row of length 0.
    return attrs.kind == "GRU" and attrs.padded_output == "zero" and not has(6) and not has(7) \
        and not (has(4) and has(5))


def _lower_to_gru_op(graph: gs.Graph, node: gs.Node, attrs: SequenceAttrs) -> None:
    H = attrs.hidden_size
    X, W, R, B = node.inputs[:4]
    lens = node.inputs[4] if len(node.inputs) > 4 and node.inputs[4].name else None
    h0 = node.inputs[5] if len(node.inputs) > 5 and node.inputs[5].name else None
    w, r, b = const_value(W), const_value(R), const_value(B)
    name = unique_name(graph, f"{node.name}/gru")
    c = lambda tag, v: gs.Constant(unique_name(graph, f"{name}/{tag}"), np.ascontiguousarray(v))  # noqa: E731
    x_t = gs.Variable(unique_name(graph, f"{name}/x_time_major"), np.float32)
    graph.nodes.append(gs.Node("Transpose", f"{name}/transpose_x", {"perm": [1, 0, 2]}, [X], [x_t]))
    ins = [x_t, c("W", w.T[None]), c("R", r.T[None]), c("B", b[None]), gs.Variable.empty()]
    if lens is not None:
        ins[4] = gs.Variable(unique_name(graph, f"{name}/lens32"), np.int32)
        graph.nodes.append(gs.Node("Cast", f"{name}/cast_lens", {"to": 6}, [lens], [ins[4]]))
    if h0 is not None:
        h0_3 = gs.Variable(unique_name(graph, f"{name}/h0"), np.float32)
        graph.nodes.append(gs.Node("Unsqueeze", f"{name}/unsqueeze_h0", {}, [h0, c("axis0", np.array([0], np.int64))],
                                   [h0_3]))
        ins.append(h0_3)
    Y, Y_h = node.outputs
    y4 = gs.Variable(unique_name(graph, f"{name}/Y4"), np.float32) if Y.name else gs.Variable.empty()
    yh3 = gs.Variable(unique_name(graph, f"{name}/Yh3"), np.float32) if Y_h.name else gs.Variable.empty()
    graph.nodes.append(gs.Node("GRU", name, {"hidden_size": H, "linear_before_reset": attrs.linear_before_reset},
                               ins, [y4, yh3]))
    if Y.name:
        y3 = gs.Variable(unique_name(graph, f"{name}/Y3"), np.float32)
        graph.nodes.append(gs.Node("Squeeze", f"{name}/squeeze_y", {}, [y4, c("axis1", np.array([1], np.int64))], [y3]))
        graph.nodes.append(gs.Node("Transpose", f"{name}/transpose_y", {"perm": [1, 0, 2]}, [y3], [Y]))
    if Y_h.name:
        graph.nodes.append(gs.Node("Squeeze", f"{name}/squeeze_yh", {}, [yh3, c("axis0", np.array([0], np.int64))],
                                   [Y_h]))


def lower_sequence_node(graph: gs.Graph, node: gs.Node, form: str = "scan") -> None:
    """Replace one sequence node by standard ONNX: the lean Scan of its function body, or the GRU op."""
    attrs = SequenceAttrs.of(node)
    if form == "gru-op" and _gru_op_ok(node, attrs) and all(const_value(t) is not None for t in node.inputs[1:4]):
        _lower_to_gru_op(graph, node, attrs)
    else:
        inputs = {k: t for k, t in zip(INPUTS, node.inputs) if t.name}
        outputs = {k: t for k, t in zip(OUTPUTS, node.outputs) if t.name}
        build_sequence(graph, attrs, inputs, outputs, prefix=unique_name(graph, node.name))
    node.outputs.clear()
    node.inputs.clear()
    graph.nodes.remove(node)


@register_pass("lower-rnn-ort", group="lower", targets=("ort",), order=1)
def lower_rnn_ort(ctx: PassContext) -> None:
    """ai.ctropt sequence ops → onnxruntime's fastest measured form: a lean Scan with X·W hoisted out of the loop."""
    form = ctx.options.get("rnn_ort_form", "scan")
    if form not in ORT_FORMS:
        raise CtroptError(f"rnn_ort_form must be one of {', '.join(ORT_FORMS)}, not {form!r}")
    for node in [n for n in ctx.graph.nodes if is_sequence_node(n)]:
        lower_sequence_node(ctx.graph, node, form)
        ctx.matches += 1
        ctx.rewrites += 1
    if ctx.rewrites:
        ctx.graph.cleanup(remove_unused_graph_inputs=False)
        tidy(ctx)


def tidy(ctx: PassContext) -> None:
    """What the cleanup passes would still find in lowered layers (casts to the same type, equal constants):
    done here so that lowering is idempotent under `all`."""
    from .registry import REGISTRY

    for name in ("fold-constants", "eliminate-identity", "dedup-initializers", "eliminate-common-subexpressions"):
        REGISTRY[name](PassContext(ctx.graph, ctx.target, dict(ctx.options)))
