"""`lower-rnn-ort`: ai.ctropt sequence ops → what onnxruntime runs fastest: ctropt's own kernel (``ctropt.kernels``,
built on first use) where its library loads, else stock ONNX ops (the lean Scan, or the GRU op at small batch)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from ... import kernels
from ...graph import CtroptError
from ...ops import DOMAIN
from ...ops.rnn import INPUTS, KINDS, OUTPUTS, SequenceAttrs, build_sequence, checked_lengths, is_sequence_node
from ...graph.edit import Builder, add_constant, add_node, const_value, unique_name
from ...patterns import Match, P, Rewrite
from ..cleanup import tidy
from ..registry import PassContext, register_pass

# onnxruntime form per kind (see "Recurrent layers on onnxruntime" in git show 8b89a5f:benchmarks/RESULTS.md): auto is the kernel where
# ctropt's kernel library loads (1.77-3.42x over raw on the DIEN exports, against 1.28-1.92x), else `standard`.
ORT_FORMS = ("auto", "standard", "scan", "gru-op", "kernel")
# onnxruntime's GRU op runs the whole sequence in one kernel but each step slower than the lean Scan's ops:
# `python benchmarks/rnn_forms.py` (T=100, H=36, 1 thread), time(GRU op)/time(Scan): 0.03-0.10 at batch 1,
# 0.5-0.65 at 32, 0.73-0.84 at 64, 0.89-0.96 at 128, 0.99-1.11 at 256. So: the GRU op below this batch (and
# above 0: onnxruntime 1.32's GRU op aborts the process on an empty batch, or history without lengths, see
# `when_not_empty`; lengths outside [0, T] it rejects are clamped first unless the layer was read from a GRU op).
GRU_OP_MAX_BATCH = 192


def _gru_op_ok(node: gs.Node, attrs: SequenceAttrs) -> bool:
    """The ONNX GRU op computes this node: a plain GRU, lengths (not a mask), zeros at padded steps."""
    names = [t.name for t in node.inputs]
    has = lambda i: len(names) > i and names[i] != ""  # noqa: E731
    # onnxruntime's GRU writes 0, not initial_h, as the last state of a row of length 0.
    return attrs.kind == "GRU" and attrs.padded_output == "zero" and not has(6) and not has(7) \
        and not (has(4) and has(5))


def _empty_test(graph: gs.Graph, root: gs.Graph, x: gs.Tensor, base: str):
    """([B, T] of x, int64 [2]; whether B or T is 0, a 0-d bool)."""
    b = Builder(graph, base, np.int64, root=root)
    if int(root.opset or 13) >= 15:  # Shape's start/end attributes are opset 15
        dims = b.op("Shape", [x], {"start": 0, "end": 2}, name="batch_steps")
    else:
        dims = b.op("Slice", [b.op("Shape", [x]), b.const("start", [0], np.int64), b.const("end", [2], np.int64)],
                    name="batch_steps")
    empty = b.op("Equal", [b.op("ReduceMin", [dims], {"keepdims": 0}, name="fewest"),
                           b.const("zero", np.array(0, np.int64))], name="is_empty", dtype=np.bool_)
    return dims, empty


def when_not_empty(graph: gs.Graph, root: gs.Graph, attrs: SequenceAttrs, inputs: dict, outputs: dict, base: str,
                   emit, test=None) -> None:
    """If(batch == 0 or T == 0, the op's answer for no rows or no steps, `emit(branch, outs)`): onnxruntime's GRU
    op aborts the process on an empty batch (SIGABRT/SIGSEGV, onnxruntime 1.32), and on an empty history without
    sequence_lens; a Scan over no steps fails. With no step to run, Y is [B, T, H] of nothing and Y_h the initial
    state (0 without one), as in ``reference``; a layer read from a GRU op still rejects lengths outside [0, T]
    (lengths_checked). `test`: `_empty_test`'s (dims, empty) of X, if made already. In onnxruntime an If costs a
    few microseconds (no copies), less than its Shape/ReduceMin/Equal test."""
    H = attrs.hidden_size
    dims, empty = test if test is not None else _empty_test(graph, root, inputs["X"], f"{base}/empty")
    keys = [k for k in OUTPUTS if k in outputs]
    branches = []
    for tag in ("no_steps", "steps"):
        branch = gs.Graph(name=unique_name(root, f"{base}/{tag}"), opset=graph.opset)
        outs = {k: gs.Variable(unique_name(root, f"{base}/{tag}/{k}"), np.float32) for k in keys}
        if tag == "steps":
            emit(branch, outs)
        else:
            e = Builder(branch, f"{base}/{tag}", np.int64, root=root)
            zero = gs.Constant(unique_name(root, f"{base}/{tag}/zero"), np.zeros(1, np.float32))
            batch = e.op("Gather", [dims, e.const("first", [0], np.int64)], {"axis": 0})
            if attrs.lengths_checked and "sequence_lens" in inputs and "mask" not in inputs:
                lens = e.op("Reshape", [e.op("Cast", [inputs["sequence_lens"]], {"to": onnx.TensorProto.INT64}),
                                        e.const("minus1", [-1], np.int64)])
                steps = e.op("Gather", [dims, e.const("second", [1], np.int64)], {"axis": 0})
                batch = e.op("Shape", [checked_lengths(e, lens, steps)])  # the rows, once the lengths are checked
            if "Y" in outs:
                shape = e.op("Concat", [batch, e.op("Gather", [dims, e.const("second", [1], np.int64)], {"axis": 0}),
                                        e.const("H", [H], np.int64)], {"axis": 0})
                e.op("ConstantOfShape", [shape], {"value": zero}, out=outs["Y"])
            if "Y_h" in outs and "initial_h" in inputs:
                e.op("Identity", [inputs["initial_h"]], out=outs["Y_h"])
            elif "Y_h" in outs:
                e.op("ConstantOfShape", [e.op("Concat", [batch, e.const("H", [H], np.int64)], {"axis": 0})],
                     {"value": zero}, out=outs["Y_h"])
        branch.outputs = [outs[k] for k in keys]
        branches.append(branch)
    graph.nodes.append(gs.Node("If", unique_name(root, f"{base}/unless_empty"),
                               {"then_branch": branches[0], "else_branch": branches[1]}, [empty],
                               [outputs[k] for k in keys]))


def _lower_to_gru_op(graph: gs.Graph, root: gs.Graph, inputs: dict, outputs: dict, attrs: SequenceAttrs,
                     base: str) -> None:
    """The ONNX GRU op between batch-major views (names unique in `root`, nodes appended to `graph`), unless the
    batch or the history is empty (`when_not_empty`)."""
    when_not_empty(graph, root, attrs, inputs, outputs, base,
                   lambda branch, outs: _gru_op_nodes(branch, root, inputs, outs, attrs, base))


def _gru_op_nodes(graph: gs.Graph, root: gs.Graph, inputs: dict, outputs: dict, attrs: SequenceAttrs,
                  base: str) -> None:
    """The ONNX GRU op between batch-major views (names unique in `root`, nodes appended to `graph`)."""
    H = attrs.hidden_size
    name = unique_name(root, f"{base}/gru")
    var = lambda tag, dtype=np.float32: gs.Variable(unique_name(root, f"{name}/{tag}"), dtype)  # noqa: E731
    c = lambda tag, v: gs.Constant(unique_name(root, f"{name}/{tag}"), np.ascontiguousarray(v))  # noqa: E731
    w, r, b = (const_value(inputs[k]) for k in ("W", "R", "B"))
    x_t = var("x_time_major")
    graph.nodes.append(gs.Node("Transpose", f"{name}/transpose_x", {"perm": [1, 0, 2]}, [inputs["X"]], [x_t]))
    ins = [x_t, c("W", w.T[None]), c("R", r.T[None]), c("B", b[None]), gs.Variable.empty()]
    if "sequence_lens" in inputs:
        e = Builder(graph, f"{name}/lens", np.int64, root=root)
        lens = inputs["sequence_lens"]
        if lens.shape is None or len(lens.shape) != 1:  # a [B, 1] squeezed without axes is a scalar at batch 1
            lens = e.op("Reshape", [lens, e.const("minus1", [-1], np.int64)], dtype=lens.dtype)
        if not attrs.lengths_checked:
            # clamped into [0, T]: a Scan/Loop's masking (t < length) takes any length, the GRU op rejects those
            # outside ("Invalid value/s in sequence_lens"), as a layer read from a GRU op must (lengths_checked)
            steps = e.op("Shape", [x_t], {"start": 0, "end": 1}) if int(root.opset or 13) >= 15 else \
                e.op("Slice", [e.op("Shape", [x_t]), e.const("t0", [0], np.int64), e.const("t1", [1], np.int64)])
            lens = e.op("Cast", [lens], {"to": onnx.TensorProto.INT64})
            lens = e.op("Min", [e.op("Max", [lens, e.const("zero", [0], np.int64)]), steps])
        ins[4] = e.op("Cast", [lens], {"to": onnx.TensorProto.INT32}, dtype=np.int32)
    if "initial_h" in inputs:
        ins.append(var("h0"))
        graph.nodes.append(gs.Node("Unsqueeze", f"{name}/unsqueeze_h0", {},
                                   [inputs["initial_h"], c("axis0", np.array([0], np.int64))], [ins[-1]]))
    y4 = var("Y4") if "Y" in outputs else gs.Variable.empty()
    yh3 = var("Yh3") if "Y_h" in outputs else gs.Variable.empty()
    graph.nodes.append(gs.Node("GRU", name, {"hidden_size": H, "linear_before_reset": attrs.linear_before_reset},
                               ins, [y4, yh3]))
    if "Y" in outputs:
        y3 = var("Y3")
        graph.nodes.append(gs.Node("Squeeze", f"{name}/squeeze_y", {}, [y4, c("axis1", np.array([1], np.int64))], [y3]))
        graph.nodes.append(gs.Node("Transpose", f"{name}/transpose_y", {"perm": [1, 0, 2]}, [y3], [outputs["Y"]]))
    if "Y_h" in outputs:
        graph.nodes.append(gs.Node("Squeeze", f"{name}/squeeze_yh", {}, [yh3, c("axis0", np.array([0], np.int64))],
                                   [outputs["Y_h"]]))


def _lower_to_kernel(graph: gs.Graph, inputs: dict, outputs: dict, attrs: SequenceAttrs, base: str) -> None:
    """ctropt's GRUScan kernel (``ctropt.kernels``): the whole layer in one node, each row run up to its last
    valid step, its input projection included (so padded steps cost nothing)."""
    H, kind, lbr = attrs.hidden_size, attrs.kind, attrs.linear_before_reset
    w, r, b = (const_value(inputs[k]).astype(np.float32) for k in ("W", "R", "B"))
    keep = kind == "AUGRU" and attrs.att_keep          # needs z itself; every other kind reads u = 1 - z
    flip = np.concatenate([np.full(H, 1.0 if keep else -1.0), np.ones(2 * H)]).astype(np.float32)
    bias = (b[:3 * H] + np.concatenate([b[3 * H:5 * H], np.zeros(H, np.float32) if lbr else b[5 * H:]])) * flip
    const = lambda tag, value: add_constant(graph, f"{base}/{tag}", value)  # noqa: E731

    empty = gs.Variable.empty()
    att = inputs.get("att")
    ins = [inputs["X"], const("W", w * flip), const("R", r * flip), const("bias", bias),
           const("Rn_bias", b[5 * H:]) if lbr else empty, inputs.get("initial_h", empty), empty, empty, empty]
    if keep:
        (ins[6],) = add_node(graph, "Sub", [const("one", np.array(1.0, np.float32)), att], name=f"{base}/one_minus_att",
                             dtype=np.float32)
    elif kind != "GRU":
        ins[6] = att
    if "mask" in inputs:
        ins[8] = inputs["mask"]
        if ins[8].dtype != np.float32:
            (ins[8],) = add_node(graph, "Cast", [ins[8]], {"to": onnx.TensorProto.FLOAT}, name=f"{base}/mask",
                                 dtype=np.float32)
    elif "sequence_lens" in inputs:
        ins[7] = given = inputs["sequence_lens"]
        if given.dtype != np.int64:
            (ins[7],) = add_node(graph, "Cast", [given], {"to": onnx.TensorProto.INT64}, name=f"{base}/lens",
                                 dtype=np.int64)
        if given.shape is None or len(given.shape) != 1:  # a [B, 1] squeezed without axes is a scalar at batch 1
            (ins[7],) = add_node(graph, "Reshape", [ins[7], const("minus1", np.array([-1], np.int64))],
                                 name=f"{base}/lens_1d", dtype=np.int64)
    while ins[-1] is empty:
        ins.pop()
    mode = {"AUGRU": 2 if keep else 1, "AGRU": 3, "AIGRU": 4}.get(kind, 0)
    outs = [outputs.get("Y_h") or gs.Variable(unique_name(graph, f"{base}/Y_h"), np.float32)]
    if "Y" in outputs:
        outs.append(outputs["Y"])
    kernel_attrs = {"hidden_size": H, "linear_before_reset": lbr, "mode": mode,
                    "padded_output_zero": int(attrs.padded_output == "zero")}
    if attrs.lengths_checked and "mask" not in inputs and "sequence_lens" in inputs:
        kernel_attrs["check_lengths"] = 1  # raise on lengths outside [0, T], as the GRU op it replaces did
    graph.nodes.append(gs.Node("GRUScan", unique_name(graph, f"{base}/GRUScan"), kernel_attrs, ins, outs,
                               domain=kernels.DOMAIN))


def _by_batch(graph: gs.Graph, attrs: SequenceAttrs, inputs: dict, outputs: dict, base: str) -> None:
    """If(batch >= GRU_OP_MAX_BATCH or batch == 0 or T == 0, lean Scan, GRU op): each form where it is the faster
    one, and never the GRU op where it would abort the process; the lean Scan's side answers an empty batch or
    history as the op means (`when_not_empty`: a Scan over no steps fails). A layer read from a GRU op
    (lengths_checked) has its lengths checked by the GRU op, or in the lean Scan (`checked_lengths`)."""
    dims, empty = _empty_test(graph, graph, inputs["X"], f"{base}/empty")
    b = Builder(graph, base, np.int64)
    batch = b.op("Gather", [dims, b.const("first", np.array(0, np.int64))], {"axis": 0}, name="batch")
    big = b.op("GreaterOrEqual", [batch, b.const("max_batch", np.array(GRU_OP_MAX_BATCH, np.int64))],
               name="is_large_batch", dtype=np.bool_)
    cond = b.op("Or", [big, empty], name="cond", dtype=np.bool_)
    branches = []
    for form in ("scan", "gru-op"):
        branch = gs.Graph(name=unique_name(graph, f"{base}/{form}"), opset=graph.opset)
        outs = {k: gs.Variable(unique_name(graph, f"{base}/{form}/{k}"), np.float32) for k in outputs}
        if form == "scan":
            when_not_empty(branch, graph, attrs, inputs, outs, f"{base}/{form}", lambda body, o: build_sequence(
                body, attrs, inputs, o, prefix=unique_name(graph, f"{base}/{form}")), test=(dims, empty))
        else:
            _gru_op_nodes(branch, graph, inputs, outs, attrs, f"{base}/{form}")
        branch.outputs = [outs[k] for k in OUTPUTS if k in outs]
        branches.append(branch)
    graph.nodes.append(gs.Node("If", unique_name(graph, f"{base}/by_batch"),
                               {"then_branch": branches[0], "else_branch": branches[1]}, [cond],
                               [outputs[k] for k in OUTPUTS if k in outputs]))


def _up_to_the_longest(graph: gs.Graph, inputs: dict, base: str) -> dict:
    """X and att cut to the steps before the batch's longest length (at least 1). Past it every row keeps its
    state, so the last state is the same; one request's rows often share one history (one user), and histories
    are padded to T: a layer whose outputs are only the last state then runs for its length, not for T."""
    b = Builder(graph, f"{base}/longest", np.int64)
    op = b.op
    lens = op("Cast", [inputs["sequence_lens"]], {"to": onnx.TensorProto.INT64})
    longest = op("Max", [op("Reshape", [op("ReduceMax", [lens], {"keepdims": 1}), b.const("one_dim", [1], np.int64)]),
                         b.const("at_least", [1], np.int64)])
    cut = dict(inputs)
    for k in ("X", "att"):
        if k in inputs:
            cut[k] = op("Slice", [inputs[k], b.const("start", [0], np.int64), longest,
                                  b.const("time_axis", [1], np.int64)],
                        dtype=inputs[k].dtype)
    return cut


def lower_sequence_node(graph: gs.Graph, node: gs.Node, form: str = "standard") -> None:
    """Replace one sequence node by what onnxruntime runs: the lean Scan of its function body, the GRU op,
    (standard) the GRU op for batches below GRU_OP_MAX_BATCH and the Scan above, chosen at run time, or (kernel)
    ctropt's GRUScan, for constant weights (else standard). A Scan or GRU op layer whose only output is its last state runs up to the batch's longest length
    (`_up_to_the_longest`); GRUScan stops each row at its own length anyway."""
    attrs = SequenceAttrs.of(node)
    inputs = {k: t for k, t in zip(INPUTS, node.inputs) if t.name}
    outputs = {k: t for k, t in zip(OUTPUTS, node.outputs) if t.name}
    base = unique_name(graph, node.name)
    weights = all(const_value(t) is not None for t in node.inputs[1:4])
    kernel = form == "kernel" and weights
    if "Y" not in outputs and "sequence_lens" in inputs and "mask" not in inputs and not kernel:
        inputs = _up_to_the_longest(graph, inputs, base)
    gru_op = _gru_op_ok(node, attrs) and weights
    if kernel:
        _lower_to_kernel(graph, inputs, outputs, attrs, base)
    elif form == "gru-op" and gru_op:
        _lower_to_gru_op(graph, graph, inputs, outputs, attrs, base)
    elif form in ("standard", "kernel") and gru_op:
        _by_batch(graph, attrs, inputs, outputs, base)
    else:
        build_sequence(graph, attrs, inputs, outputs, prefix=base)
    node.outputs.clear()
    node.inputs.clear()
    graph.nodes.remove(node)


# Every variant of the sequence ops (`GRUSequence`, `GRUSequence_2`, ...; ``ops.rnn.add_sequence_node``).
SEQUENCE_OPS = "|".join(f"{kind}Sequence*" for kind in KINDS)


def sequence_op(m: Match) -> bool | str:
    """The node is one of ctropt's sequence ops (not another op whose name starts alike)."""
    return True if is_sequence_node(m.root) else "not an ai.ctropt sequence op"


def _ort_rules(form: str = "standard") -> tuple:
    """Each sequence node of the main graph → the onnxruntime form `form` (see `lower_sequence_node`)."""

    def lower(m: Match) -> list:
        lower_sequence_node(m.graph, m.root, form)
        return list(m.root.outputs)  # the node is gone; the nodes made write its old outputs

    return (Rewrite("sequence-op-for-ort", P[SEQUENCE_OPS](..., _domain=DOMAIN), lower, sequence_op,
                    subgraphs=False),)


ORT_RULES = _ort_rules()


@register_pass("lower-rnn-ort", group="lower", targets=("ort",), rules=ORT_RULES)
def lower_rnn_ort(ctx: PassContext) -> None:
    """ai.ctropt sequence ops → ctropt's GRUScan kernel where its library loads (the saved model then needs it at
    run time: `ctropt.kernels.register`), else onnxruntime's fastest measured stock form (lean Scan with X·W
    hoisted, GRU op at small batch); rnn_ort_form picks one (kernel, standard, scan, gru-op).

    --device cuda gets the standard form too: the GRU op (cuDNN) at every batch measured 0.26× at batch 4096 on
    zoo dien_tf (H100; the GPU section of git show 8b89a5f:benchmarks/RESULTS.md)."""
    form = ctx.options.get("rnn_ort_form") or ("auto" if kernels.wanted(ctx.options) else "standard")
    if form not in ORT_FORMS:
        raise CtroptError(f"rnn_ort_form must be one of {', '.join(ORT_FORMS)}, not {form!r}")
    if not any(is_sequence_node(n) for n in ctx.graph.nodes):
        return
    if form in ("auto", "kernel"):
        problem = kernels.ensure()
        if problem and form == "kernel":
            raise CtroptError(f"rnn_ort_form=kernel needs ctropt's kernel library, which cannot be built here: {problem}")
        form = "standard" if problem else "kernel"
        ctx.note(f"standard ops: ctropt's kernel library is not available ({problem})" if problem else
                 f"GRUScan kernels: the model needs ctropt's kernel library at run time ({kernels.library_path()})")
    if ctx.apply(*_ort_rules(form)):
        tidy(ctx)
