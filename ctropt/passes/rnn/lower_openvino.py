"""`lower-rnn-openvino`: the ai.ctropt GRU-family sequence ops (``ctropt.ops.rnn``) as the standard ONNX that
OpenVINO's CPU plugin runs fastest. OpenVINO 2026.4 cannot load model-local functions, so for
`--target openvino` every such node must go; this pass runs first among the OpenVINO lowerings (order 1), the
others may then work on its output (the lean Scan, for one, relies on `scan-outer-scope-as-state` when its
weights are not constants).

What OpenVINO makes of each candidate form (checked in ``compiled.get_runtime_model()``, and by a probe: a
subgraph OpenVINO's loose matcher fuses computes different numbers once fused if one constant is changed):

- ONNX ``GRU`` op → ``GRUSequence`` (runtime type RNNSeq), linear_before_reset 0 and 1. The CPU plugin ignores
  ``sequence_lens`` and onnxruntime writes 0 (not initial_h) as Y_h of an empty row, so the op runs unmasked
  and the lengths are applied after it (Where on Y, Y_h gathered at length-1, initial_h for empty rows): exact,
  since a forward GRU's states before a row's length do not depend on the steps after it. onnxruntime (these
  models run there too) aborts on a GRU op over an empty batch or history: the op reads X with at least one row
  and one step, in place for OpenVINO (`_emit_gru_op`). Lengths of a layer read from a GRU op (lengths_checked)
  are checked first (`_check_lengths_first`; onnxruntime raises, OpenVINO's Gather reads on).
  OpenVINO 2026.4 bug: the CPU plugin's OptimizeGRUSequenceTransposes replaces the Transpose in front of a
  GRUSequence whose Y is used by a Reshape for *all* consumers of that Transpose, so a second GRUSequence on the
  same (CSE-merged) Transpose computes garbage. Only the first GRU layer on an input gets the GRU op.
- AUGRU: ``AUGRUCellFusion`` (common transformations, run by the CPU plugin, not by the offline MOC) turns the
  TF ``VecAttGRUCell`` subgraph into the internal ``AUGRUCell``: Concat(x, h)·[W;R] + b → Sigmoid → equal
  ``Split`` (a VariadicSplit does not match) into (r, u), Concat(x, r*h)·[W;R]_h + b → Tanh, u' = (1 - a)*u,
  h' = u'*h + (1 - u')*c. The update gate keeps the state and the attention scales it: OpenVINO's AUGRU is the
  DIEN *code* form, our ``att_keep=1``, not the paper form h' = h + a*u*(n - h) (no OpenVINO op computes that).
  linear_before_reset must be 0. ``SequenceFusion`` joins a chain of these cells into one ``AUGRUSequence``
  only when the chain is unrolled in the graph, i.e. for a static T. In a Scan/Loop body the cell is fused too
  but runs step by step in a TensorIterator (there is no TensorIterator → AUGRUSequence conversion): time/scan
  0.97 at B=256 but 1.28 at B=8, so that form is not used.
- AGRU h' = h + a*(n - h) is OpenVINO's AUGRU with the update gate pinned to 1 (zero z weights, bias 60:
  sigmoid is exactly 1.0 in float32), u' = 1 - a.
- GRU cells are not emitted unrolled: the same TF-layout cell with the AUGRU attention taken out is not fused
  by this OpenVINO (no GRUCell/GRUSequence in the runtime model, I != H and I == H), and the GRU op covers GRU.
- Everything else (AUGRU paper form, attention kinds with linear_before_reset=1, a mask input, computed weights,
  AUGRU/AGRU with a dynamic T) keeps the lean Scan of ``build_sequence`` (X·W hoisted out of the loop), its
  weight preparation folded into constants.

Measured: OpenVINO 2026.4 CPU plugin, 1 thread, AVX2 (AMD EPYC), T=100 I=H=36, one layer, paired interleaved
runs (ctropt.runtime.bench), median time(form)/time(lean Scan), with/without lengths, Y+Y_h or Y_h only:
    GRU op, lbr=0      B=256 0.87-0.91   B=64 0.85   B=8 0.72-0.79
    GRU op, lbr=1      B=256 1.02-1.06   B=64 0.80   B=8 0.39-0.44   (the lean Scan is ~25-35 ms at B=256)
    GRU op, AIGRU      B=256 0.83-1.01               B=8 0.75-0.82
    unrolled AUGRU     B=256 0.88-0.96               B=8 0.87-0.99
    unrolled AGRU      B=256 0.91-0.98               B=8 0.93-1.04
Zoo DIEN (TF) end to end: 0.96 (B=256) / 0.90 (B=8); with static_seq_len=100 0.95 / 0.83.

Options: ``static_seq_len`` (int T) lets AUGRU/AGRU unroll when X's time dim is not static; the model then
runs only with that T (any other T fails in the Split, it never gives wrong numbers).
``rnn_openvino_form`` = auto (default) | scan | gru-op | augru-unrolled forces a form where it applies.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from ...graph import CtroptError, iter_graphs
from ...ops import DOMAIN
from ...ops.rnn import (INPUTS, MIN_OPSET, OUTPUTS, SequenceAttrs, build_sequence, checked_lengths,
                        is_sequence_node)
from ...graph.edit import Builder, const_value, dtype_of, shape_of, unique_name
from ...patterns import Match, P, Rewrite
from ..cleanup import tidy
from ..registry import PassContext, register_pass
from .lower_ort import SEQUENCE_OPS, sequence_op

FORMS = ("auto", "scan", "gru-op", "augru-unrolled")
MAX_UNROLL = 512  # steps: longer chains would bloat the graph (18 nodes per step)
GATE_ONE_BIAS = 60.0  # sigmoid(60) == 1.0 in float32: pins the update gate of AGRU-as-AUGRU


def _opset(graph: gs.Graph) -> int:
    return int(getattr(graph, "opset", None) or 0)


def _lowerable(m: Match) -> bool | str:
    """A sequence op in a model whose opset its forms need."""
    verdict, opset = sequence_op(m), _opset(m.top)
    return f"opset {opset} < {MIN_OPSET}" if verdict is True and opset < MIN_OPSET else verdict


def _openvino_rules(form: str = "auto", static_t=None, note=None, gru_sources: set | None = None) -> tuple:
    """Each sequence node → the form `choose_form` picks (one GRU op per input: `gru_sources`, the inputs GRU ops
    read so far, filled in as nodes are lowered in graph order; by default those of the graph rewritten);
    `note(text)` hears which form each node got."""

    def lower(m: Match) -> list:
        sources = gru_sources if gru_sources is not None else _kept_gru_sources(m.top)
        name, op = m.root.name, m.root.op
        chosen = _lower(m.top, m.graph, m.root, form, static_t, _opset(m.top), sources)
        if note is not None:
            note(f"{name} ({op}): {chosen}")
        return list(m.root.outputs)  # the node is gone; the nodes made write its old outputs

    return (Rewrite("sequence-op-for-openvino", P[SEQUENCE_OPS](..., _domain=DOMAIN), lower, _lowerable),)


OPENVINO_RULES = _openvino_rules()


@register_pass("lower-rnn-openvino", group="lower", targets=("openvino",), rules=OPENVINO_RULES)
def lower_rnn_openvino(ctx: PassContext) -> None:
    """ai.ctropt sequence ops → OpenVINO's fastest exact form: GRU op, unrolled AUGRU cells (static T), lean Scan."""
    form = ctx.options.get("rnn_openvino_form", "auto") or "auto"
    if form not in FORMS:
        raise CtroptError(f"rnn_openvino_form must be one of {', '.join(FORMS)}, not {form!r}")
    static_t = ctx.options.get("static_seq_len")
    if static_t is not None and (not isinstance(static_t, (int, np.integer)) or int(static_t) < 1):
        raise CtroptError(f"static_seq_len must be a positive integer, not {static_t!r}")
    opset = _opset(ctx.graph)
    if opset < MIN_OPSET:
        for node in (n for g in iter_graphs(ctx.graph) for n in g.nodes if is_sequence_node(n)):
            ctx.note(f"{node.name}: left as is, opset {opset} < {MIN_OPSET}")
    gru_sources = _gru_sources(ctx.graph)  # batch-major inputs GRU ops already read (see _lower)
    if ctx.apply(*_openvino_rules(form, static_t, ctx.note, gru_sources)):
        used = {(n.domain, n.op) for g in iter_graphs(ctx.graph) for n in g.nodes}
        ctx.graph.functions = [f for f in ctx.graph.functions if (f.domain, f.name) in used]
        tidy(ctx)


# ----------------------------------------------------------------------------------------- choosing the form


def _gru_sources(root: gs.Graph) -> set:
    """Keys of the batch-major tensors that GRU ops already in the model read through Transpose(perm 1,0,2)."""
    found = set()
    for g in iter_graphs(root):
        for n in g.nodes:
            x = n.inputs[0] if n.op == "GRU" and n.inputs else None
            if x is not None and len(x.inputs) == 1 and x.inputs[0].op == "Transpose" \
                    and list(x.inputs[0].attrs.get("perm", [])) == [1, 0, 2]:
                found.add((id(_unpadded(x.inputs[0].inputs[0])),))
    return found


def _unpadded(t: gs.Tensor) -> gs.Tensor:
    """X where t is `_at_least_one`'s Reshape(Concat(Reshape(X), zeros)), else t."""
    chain = t
    for op in ("Reshape", "Concat", "Reshape"):
        if len(chain.inputs) != 1 or chain.inputs[0].op != op:
            return t
        chain = chain.inputs[0].inputs[0]
    return chain


def _kept_gru_sources(root: gs.Graph) -> set:
    """`_gru_sources` of the graph as it was when first asked, then kept with it (and filled in by `_lower`)."""
    if "_ctropt_gru_sources" not in root.__dict__:  # not getattr: graphsurgeon logs misses as errors
        root.__dict__["_ctropt_gru_sources"] = _gru_sources(root)
    return root.__dict__["_ctropt_gru_sources"]


def _static_steps(node: gs.Node) -> int | None:
    """T if the graph says it is static (X, att or mask has a fixed time dim)."""
    for t in (node.inputs[0],) + tuple(node.inputs[6:8]):
        shape = shape_of(t) if t.name else None
        if shape is not None and len(shape) >= 2 and isinstance(shape[1], (int, np.integer)) and shape[1] > 0:
            return int(shape[1])
    return None


def choose_form(attrs: SequenceAttrs, present: set[str], consts: bool, steps: int | None, form: str = "auto") -> str:
    """The form to emit: `form` where it computes the node exactly, else the best that does (see the docstring)."""
    gru_op = consts and "mask" not in present and attrs.kind in ("GRU", "AIGRU")
    augru = (consts and "mask" not in present and attrs.linear_before_reset == 0
             and ((attrs.kind == "AUGRU" and attrs.att_keep) or attrs.kind == "AGRU"))
    unroll = augru and steps is not None and 1 <= steps <= MAX_UNROLL
    if form == "scan" or (form == "gru-op" and not gru_op) or (form == "augru-unrolled" and not unroll):
        return "scan"
    if gru_op:
        return "gru-op"
    return "augru-unrolled" if unroll else "scan"


def _used(g: gs.Graph, t: gs.Tensor) -> bool:
    return bool(t.name) and (bool(t.outputs) or any(o is t for o in g.outputs))


def _lower(root: gs.Graph, g: gs.Graph, node: gs.Node, form: str, static_t, opset: int, gru_sources: set) -> str:
    attrs = SequenceAttrs.of(node)
    inputs = {k: t for k, t in zip(INPUTS, node.inputs) if t.name}
    outputs = {k: t for k, t in zip(OUTPUTS, node.outputs) if _used(g, t)}
    weights = [const_value(inputs[k]) for k in ("W", "R", "B")]
    consts = all(w is not None for w in weights)
    known = _static_steps(node)  # from the graph: any form may rely on it
    steps = known if known is not None else (int(static_t) if static_t is not None else None)  # for unrolling
    chosen = choose_form(attrs, set(inputs), consts, steps, form)
    if chosen == "gru-op":
        # OpenVINO 2026.4 CPU bug: OptimizeGRUSequenceTransposes replaces the Transpose in front of a GRUSequence
        # whose Y is used by a Reshape for *all* its consumers, so a second GRUSequence reading the same (CSE'd)
        # Transpose computes garbage. One GRU op per input; the other layers on that input take the lean Scan.
        source = (id(inputs["X"]), id(inputs["att"])) if attrs.kind == "AIGRU" else (id(inputs["X"]),)
        if source in gru_sources:
            chosen = "scan"
        gru_sources.add(source)
    node.outputs.clear()
    node.inputs.clear()
    g.nodes.remove(node)
    if not outputs:
        return "removed (no output used)"
    b = _Builder(root, g, node.name or attrs.op_type, opset)
    inputs, attrs = _check_lengths_first(g, root, attrs, inputs, b.base)
    if chosen == "gru-op":
        _emit_gru_op(b, attrs, inputs, outputs, known, *[np.asarray(w, np.float32) for w in weights])
    elif chosen == "augru-unrolled":
        _emit_augru_unrolled(b, attrs, inputs, outputs, steps, *[np.asarray(w, np.float32) for w in weights])
    else:
        if consts:  # weights as constants the prologue folds
            inputs = dict(inputs, **{k: b.const(k, np.asarray(w, np.float32)) for k, w in zip("WRB", weights)})
        first = len(g.nodes)
        build_sequence(g, attrs, inputs, outputs, prefix=unique_name(root, f"{b.base}/scan"))
        _fold_constant_nodes(g, first)
    return chosen


# ----------------------------------------------------------------------------------------- emitting


def _check_lengths_first(graph: gs.Graph, root: gs.Graph, attrs: SequenceAttrs, inputs: dict, base: str):
    """(inputs, attrs) with sequence_lens checked once, up front, where the layer raises on lengths outside [0, T]
    (lengths_checked: read from an ONNX GRU op, which the CPU plugin runs unmasked); each form after it then reads
    them as clamped (lengths_checked 0). Else as given: every form here accepts any length, read as clamped."""
    if not attrs.lengths_checked or "sequence_lens" not in inputs or "mask" in inputs:
        return inputs, attrs
    b = Builder(graph, f"{base}/lengths", np.int64, root=root)
    lens = b.op("Cast", [inputs["sequence_lens"]], {"to": onnx.TensorProto.INT64})
    if inputs["sequence_lens"].shape is None or len(inputs["sequence_lens"].shape) != 1:  # a squeezed [B, 1]
        lens = b.op("Reshape", [lens, b.const("minus1", [-1], np.int64)])
    if int(root.opset or 13) >= 15:
        steps = b.op("Shape", [inputs["X"]], {"start": 1, "end": 2})
    else:
        steps = b.op("Gather", [b.op("Shape", [inputs["X"]]), b.const("time_axis", [1], np.int64)], {"axis": 0})
    checked = checked_lengths(b, lens, steps)
    checked.shape = [None]  # rank 1, as the forms read it (no dim name: one may mean another size in the model)
    return dict(inputs, sequence_lens=checked), dataclasses.replace(attrs, lengths_checked=0)


class _Builder(Builder):
    """Appends nodes to `g`, names unique in the whole model; small constants are shared by value within `g`."""

    def __init__(self, root: gs.Graph, g: gs.Graph, base: str, opset: int):
        super().__init__(g, base, root=root, share="rnn")
        self.g, self.base, self.opset = g, base, opset


def _emit_gru_op(b: _Builder, attrs: SequenceAttrs, inputs: dict, outputs: dict, steps: int | None, W, R, B) -> None:
    """Transpose → GRU (unmasked) → lengths applied after it; AIGRU scales X by the attention first.

    The model must also run in onnxruntime, whose GRU op aborts the process on an empty batch or history
    (onnxruntime 1.32), so the GRU op reads X with at least one row and one step (`_at_least_one`: zeros where
    X has none) and its outputs are cut back to X's rows and steps; the answer is then the op's (no rows; no
    steps: the initial state, or 0). For X [B, T, I] that is a Reshape to [B·T, I], a Concat with an empty
    tensor, a Reshape back, and a Split of Y with an empty part, which OpenVINO's CPU plugin does in place: one
    GRU layer (T=100, I=H=36, 1 thread) 1.00× at B=256, 0.97-0.99× at B=1-64, where an If(empty) around the
    GRU op measured 0.90-0.93× at B=256 (OpenVINO copies an If's inputs and outputs)."""
    H = attrs.hidden_size
    x = inputs["X"]
    if attrs.kind == "AIGRU":
        x = b.op("Mul", [x, b.op("Unsqueeze", [_float(b, inputs["att"]), b.const("axis2", [2], np.int64)])],
                 dtype=np.float32)
    x, grid = _at_least_one(b, x)
    x_t = b.op("Transpose", [x], {"perm": [1, 0, 2]}, dtype=np.float32)
    h0 = inputs.get("initial_h")
    gru_in = [x_t, b.const("W", W.T[None]), b.const("R", R.T[None]), b.const("B", B[None])]
    if h0 is not None:  # [B', H]: zero rows added where X got one
        h0 = b.op("Concat", [h0, b.op("ConstantOfShape", [b.op("Concat", [grid.extra_rows, b.const("H", [H], np.int64)],
                                                                      {"axis": 0}, dtype=np.int64)],
                                      {"value": gs.Constant(unique_name(b.root, f"{b.base}/zero_h"),
                                                            np.zeros(1, np.float32))}, dtype=np.float32)],
                  {"axis": 0}, dtype=np.float32)
        gru_in += [gs.Variable.empty(), b.op("Unsqueeze", [h0, b.const("axis0", [0], np.int64)], dtype=np.float32)]
    lens = inputs.get("sequence_lens")
    if lens is not None:  # [B'], read up to X's own T (an added step never counts)
        lens = b.op("Cast", [lens], {"to": onnx.TensorProto.INT64}, dtype=np.int64)
        if shape_of(inputs["sequence_lens"]) is None or len(shape_of(inputs["sequence_lens"])) != 1:
            lens = b.op("Reshape", [lens, b.const("minus1", [-1], np.int64)], dtype=np.int64)  # a squeezed [B, 1]
        lens = b.op("Min", [lens, grid.steps], dtype=np.int64)
        lens = b.op("Concat", [lens, b.op("ConstantOfShape", [grid.extra_rows], {"value": gs.Constant(
            unique_name(b.root, f"{b.base}/zero_len"), np.zeros(1, np.int64))}, dtype=np.int64)], {"axis": 0},
            dtype=np.int64)
    want_y = "Y" in outputs or lens is not None
    cut = {k: gs.Variable(unique_name(b.root, f"{b.base}/{k}_padded"), np.float32) for k in outputs}
    y4 = gs.Variable(unique_name(b.root, f"{b.base}/Y4"), np.float32) if want_y else gs.Variable.empty()
    yh3 = gs.Variable(unique_name(b.root, f"{b.base}/Yh3"), np.float32) if lens is None and "Y_h" in outputs \
        else gs.Variable.empty()
    b.op("GRU", gru_in, {"hidden_size": H, "linear_before_reset": attrs.linear_before_reset}, out=[y4, yh3])
    if yh3.name:
        y_h = b.op("Squeeze", [yh3, b.const("axis0", [0], np.int64)], dtype=np.float32)
        # with no steps (T = 0) the state is the initial one: not the one after the added step of zeros
        b.op("Where", [grid.has_steps, y_h, h0 if h0 is not None else b.const("zero_y", np.zeros((), np.float32))],
             out=[cut["Y_h"]], dtype=np.float32)
    if want_y:
        y_tm = b.op("Squeeze", [y4, b.const("axis1", [1], np.int64)], dtype=np.float32)  # [T', B', H]
        if lens is None:
            b.op("Transpose", [y_tm], {"perm": [1, 0, 2]}, out=[cut["Y"]])
        else:
            y = _apply_lengths(b, attrs, y_tm, 0, lens, h0, cut, steps)
            if y is not None:
                b.op("Transpose", [y], {"perm": [1, 0, 2]}, out=[cut["Y"]])
    if "Y_h" in outputs:  # X's rows of [B', H]
        b.op("Split", [cut["Y_h"], b.op("Concat", [grid.rows, grid.extra_rows], {"axis": 0}, dtype=np.int64)],
             {"axis": 0}, out=[outputs["Y_h"], gs.Variable(unique_name(b.root, f"{b.base}/Y_h_added"), np.float32)])
    if "Y" in outputs and b.opset >= 14:  # X's rows and steps of [B', T', H]: the first B·T of its B'·T' rows of H
        flat = b.op("Reshape", [cut["Y"], b.const("rows_of_h", [-1, H], np.int64)], dtype=np.float32)
        kept = b.op("Split", [flat, b.op("Concat", [grid.cells, grid.extra_cells], {"axis": 0}, dtype=np.int64)],
                    {"axis": 0}, outputs=2, dtype=np.float32)[0]
        b.op("Reshape", [kept, b.op("Concat", [grid.rows, grid.steps, b.const("H", [H], np.int64)], {"axis": 0},
                                    dtype=np.int64)], {"allowzero": 1}, out=[outputs["Y"]])
    elif "Y" in outputs:  # opset 13: no Reshape to a shape with a 0 in it (allowzero); rows, then steps
        rows = b.op("Split", [cut["Y"], b.op("Concat", [grid.rows, grid.extra_rows], {"axis": 0}, dtype=np.int64)],
                    {"axis": 0}, outputs=2, dtype=np.float32)[0]
        extra_steps = b.op("Sub", [b.op("Max", [grid.steps, b.const("one", [1], np.int64)], dtype=np.int64),
                                   grid.steps], dtype=np.int64)
        b.op("Split", [rows, b.op("Concat", [grid.steps, extra_steps], {"axis": 0}, dtype=np.int64)], {"axis": 1},
             out=[outputs["Y"], gs.Variable(unique_name(b.root, f"{b.base}/Y_added_step"), np.float32)])


def _at_least_one(b: _Builder, x):
    """(x [B, T, I] as [B', T', I] = [max(B, 1), max(T, 1), I], zeros after its values (its B·T rows of I first,
    then B'·T' - B·T rows of zeros, viewed as [B', T', I]): a Reshape, a Concat with an empty tensor, a Reshape
    while B, T >= 1; the shapes that cut the results back, each [1] int64: rows B, steps T, cells B·T,
    extra_rows B' - B, extra_cells B'·T' - B·T, and has_steps T > 0, a bool)."""
    one = b.const("one", [1], np.int64)
    rows, steps, width = _dim(b, x, 0), _dim(b, x, 1), _dim(b, x, 2)
    rows1, steps1 = b.op("Max", [rows, one], dtype=np.int64), b.op("Max", [steps, one], dtype=np.int64)
    cells, cells1 = b.op("Mul", [rows, steps], dtype=np.int64), b.op("Mul", [rows1, steps1], dtype=np.int64)
    extra_cells = b.op("Sub", [cells1, cells], dtype=np.int64)
    flat = b.op("Reshape", [x, b.op("Concat", [b.const("all", [-1], np.int64), width], {"axis": 0}, dtype=np.int64)],
                dtype=np.float32)
    zeros = b.op("ConstantOfShape", [b.op("Concat", [extra_cells, width], {"axis": 0}, dtype=np.int64)],
                 {"value": gs.Constant(unique_name(b.root, f"{b.base}/zero_x"), np.zeros(1, np.float32))},
                 dtype=np.float32)
    padded = b.op("Reshape", [b.op("Concat", [flat, zeros], {"axis": 0}, dtype=np.float32),
                              b.op("Concat", [rows1, steps1, width], {"axis": 0}, dtype=np.int64)], dtype=np.float32)
    grid = SimpleNamespace(rows=rows, steps=steps, cells=cells, extra_cells=extra_cells,
                 extra_rows=b.op("Sub", [rows1, rows], dtype=np.int64),
                 has_steps=b.op("Greater", [steps, b.const("zero", [0], np.int64)], dtype=np.bool_))
    return padded, grid


def _time_index(b: _Builder, steps, static_steps: int | None, time_axis: int):
    """Step numbers [0, T) as [T, 1] (time_axis 0) or [1, T] (time_axis 1), int64. Nothing the cleanup passes
    would fold, and no 0-d int64 constant (``lower_openvino._constant`` keys constants by
    np.ascontiguousarray(value), which makes 0-d values 1-D, so it would hand one out as Squeeze axes)."""
    shape = [-1, 1] if time_axis == 0 else [1, -1]
    if static_steps is not None:
        return b.const("steps_range", np.arange(static_steps).reshape(shape), np.int64)
    limit = b.op("Squeeze", [steps, b.const("axis0", [0], np.int64)], dtype=np.int64)  # T, 0-d
    start = b.op("Sub", [limit, limit], dtype=np.int64)  # 0 and 1 as 0-d values computed from T
    delta = b.op("Cast", [b.op("Equal", [limit, limit], dtype=np.bool_)], {"to": onnx.TensorProto.INT64},
                 dtype=np.int64)
    t = b.op("Range", [start, limit, delta], dtype=np.int64)
    return b.op("Unsqueeze", [t, b.const("axis1" if time_axis == 0 else "axis0", [1 - time_axis], np.int64)],
                dtype=np.int64)


def _apply_lengths(b: _Builder, attrs: SequenceAttrs, y_full, time_axis: int, lens, h0, outputs: dict,
                   static_steps: int | None = None, y_out=None):
    """Y_h = the state at step length-1 (initial_h or 0 for empty rows) into outputs["Y_h"]; if outputs has Y,
    Y masked (padded steps 0 or the kept state) in y_full's layout, into y_out if given; y_full is the unmasked run."""
    H = attrs.hidden_size
    if dtype_of(lens) is None or np.dtype(dtype_of(lens)) != np.int64:
        lens = b.op("Cast", [lens], {"to": onnx.TensorProto.INT64}, dtype=np.int64)
    steps = _dim(b, y_full, time_axis) if static_steps is None else None
    need_h = "Y_h" in outputs or ("Y" in outputs and attrs.padded_output == "state")
    y_h = None
    if need_h:
        last = b.op("Max", [b.op("Sub", [lens, b.const("one", [1], np.int64)], dtype=np.int64),
                            b.const("zero", [0], np.int64)],
                    dtype=np.int64)
        final = b.op("Sub", [steps, b.const("one", [1], np.int64)], dtype=np.int64) if static_steps is None \
            else b.const("last_step", [static_steps - 1], np.int64)
        last = b.op("Min", [last, final], dtype=np.int64)
        idx = b.op("Unsqueeze", [last, b.const("idx_axes", [1, 2] if time_axis == 1 else [0, 2], np.int64)],
                   dtype=np.int64)
        idx = b.op("Expand", [idx, b.const("idx_shape", [1, 1, H], np.int64)], dtype=np.int64)  # [B, 1, H] or [1, B, H]
        picked = b.op("GatherElements", [y_full, idx], {"axis": time_axis}, dtype=np.float32)
        picked = b.op("Squeeze", [picked, b.const("time_axis", [time_axis], np.int64)], dtype=np.float32)  # [B, H]
        nonempty = b.op("Unsqueeze", [b.op("Greater", [lens, b.const("zero", [0], np.int64)], dtype=np.bool_),
                                      b.const("axis1", [1], np.int64)], dtype=np.bool_)  # [B, 1]
        empty_h = h0 if h0 is not None else b.const("zero_h", np.zeros((), np.float32))
        y_h = b.op("Where", [nonempty, picked, empty_h], out=[outputs["Y_h"]] if "Y_h" in outputs else None,
                   dtype=np.float32)
    if "Y" not in outputs:
        return None
    t = _time_index(b, steps, static_steps, time_axis)  # valid[t, b] or valid[b, t] = t < lens[b]
    lens_b = b.op("Unsqueeze", [lens, b.const("axis0" if time_axis == 0 else "axis1", [time_axis], np.int64)],
                  dtype=np.int64)
    valid = b.op("Less", [t, lens_b], dtype=np.bool_)
    valid = b.op("Unsqueeze", [valid, b.const("axis2", [2], np.int64)], dtype=np.bool_)
    if attrs.padded_output == "zero":
        pad = b.const("zero_y", np.zeros((), np.float32))
    else:
        pad = b.op("Unsqueeze", [y_h, b.const("time_axis", [time_axis], np.int64)], dtype=np.float32)
    return b.op("Where", [valid, y_full, pad], out=[y_out] if y_out is not None else None, dtype=np.float32)


def _dim(b: _Builder, t, axis: int):
    """t.shape[axis] as a [1] int64 tensor."""
    if b.opset >= 15:
        return b.op("Shape", [t], {"start": axis, "end": axis + 1}, dtype=np.int64)
    return b.op("Gather", [b.op("Shape", [t], dtype=np.int64), b.const("axis", [axis], np.int64)], {"axis": 0},
                dtype=np.int64)


def _float(b: _Builder, t):
    dt = dtype_of(t)
    if dt is not None and np.dtype(dt) == np.float32:
        return t
    return b.op("Cast", [t], {"to": onnx.TensorProto.FLOAT}, dtype=np.float32)


def _tf_weights(attrs: SequenceAttrs, W, R, B):
    """Canonical (columns z, r, h; z keeps the state) → the VecAttGRUCell layout OpenVINO's AUGRUCellFusion reads:
    [W; R] for (r, u) with u = z, [W; R] for the candidate, biases summed (linear_before_reset=0)."""
    H = attrs.hidden_size
    z, r, h = slice(0, H), slice(H, 2 * H), slice(2 * H, 3 * H)
    wb, rb = B[:3 * H], B[3 * H:]
    wr_ru = np.concatenate([np.concatenate([W[:, r], W[:, z]], 1), np.concatenate([R[:, r], R[:, z]], 1)], 0)
    b_ru = np.concatenate([wb[r] + rb[r], wb[z] + rb[z]])
    if attrs.kind == "AGRU":  # update gate pinned to 1: u' = (1 - a)
        wr_ru[:, H:] = 0.0
        b_ru[H:] = GATE_ONE_BIAS
    wr_h = np.concatenate([W[:, h], R[:, h]], 0)
    return [np.ascontiguousarray(a, np.float32) for a in (wr_ru, b_ru, wr_h, wb[h] + rb[h])]


def _emit_augru_unrolled(b: _Builder, attrs: SequenceAttrs, inputs: dict, outputs: dict, steps: int, W, R, B) -> None:
    """T copies of the cell OpenVINO fuses into AUGRUCell, chained state to state, which it fuses into AUGRUSequence."""
    H, I = attrs.hidden_size, W.shape[0]
    wr_ru, b_ru, wr_h, b_h = (b.const(tag, v) for tag, v in zip(("WR_ru", "B_ru", "WR_h", "B_h"),
                                                                 _tf_weights(attrs, W, R, B)))
    one = b.const("one", np.array(1.0, np.float32))
    X, att = inputs["X"], _float(b, inputs["att"])
    ones = b.const("split_steps", [1] * steps, np.int64)
    x_steps = b.op("Split", [X, ones], {"axis": 1}, outputs=steps) if steps > 1 else [X]
    a_steps = b.op("Split", [att, ones], {"axis": 1}, outputs=steps) if steps > 1 else [att]
    x_shape, h_shape = b.const("x_shape", [-1, I], np.int64), b.const("h_shape", [-1, H], np.int64)
    h0 = inputs.get("initial_h")
    if h0 is not None:
        h = h0 if (shape_of(h0) or [None, None])[-1] == H else b.op("Reshape", [h0, h_shape], dtype=np.float32)
    else:
        batch = _dim(b, X, 0)
        h = b.op("ConstantOfShape", [b.op("Concat", [batch, b.const("H", [H], np.int64)], {"axis": 0}, dtype=np.int64)],
                 {"value": gs.Constant("zero", np.zeros(1, np.float32))}, dtype=np.float32)
    split2 = {"axis": 1, "num_outputs": 2} if b.opset >= 18 else {"axis": 1}
    lens = inputs.get("sequence_lens")
    keep_all = "Y" in outputs or lens is not None
    states = []
    f = Builder(b.g, b.base, np.float32, root=b.root).op
    for t in range(steps):
        x = b.op("Reshape", [x_steps[t], x_shape], dtype=np.float32)  # [B, I] with I static for the matcher
        gates = f("Sigmoid", [f("Add", [f("MatMul", [f("Concat", [x, h], {"axis": 1}), wr_ru]), b_ru])])
        r, u = b.op("Split", [gates], split2, outputs=2)
        cand = f("Tanh", [f("Add", [f("MatMul", [f("Concat", [x, f("Mul", [r, h])], {"axis": 1}), wr_h]), b_h])])
        keep = f("Mul", [f("Sub", [one, a_steps[t]]), u])  # u' = (1 - a) * u
        last = t == steps - 1 and lens is None and "Y_h" in outputs
        h = b.op("Add", [f("Mul", [keep, h]), f("Mul", [f("Sub", [one, keep]), cand])],
                 out=[outputs["Y_h"]] if last else None, dtype=np.float32)
        if keep_all:
            states.append(b.op("Unsqueeze", [h, b.const("axis1", [1], np.int64)], dtype=np.float32))
    if not keep_all:
        return
    if lens is None:
        b.op("Concat", states, {"axis": 1}, out=[outputs["Y"]])
        return
    y_full = b.op("Concat", states, {"axis": 1}, dtype=np.float32)
    _apply_lengths(b, attrs, y_full, 1, lens, h0, outputs, steps, y_out=outputs.get("Y"))


# ----------------------------------------------------------------------------------------- folding


def _fold_constant_nodes(g: gs.Graph, first: int) -> None:
    """Evaluate the nodes appended from index `first` whose inputs are all constants (the Scan's weight prologue)."""
    from onnx.reference import ReferenceEvaluator

    folded = set()
    for node in g.nodes[first:]:
        if node.op in ("Constant", "Scan", "Loop", "If") or not node.inputs:
            continue
        values = [const_value(t) if t.name else None for t in node.inputs]
        if any(v is None for v in values) or any(not t.name or not t.outputs for t in node.outputs):
            continue
        names = [f"i{i}" for i in range(len(values))]
        try:
            proto = onnx.helper.make_node(node.op, names, [f"o{i}" for i in range(len(node.outputs))], **node.attrs)
            results = ReferenceEvaluator(proto).run(None, dict(zip(names, values)))
        except Exception:  # leave anything the reference evaluator cannot run to the runtime
            continue
        for t, v in zip(node.outputs, results):
            t.to_constant(np.asarray(v))
        node.outputs.clear()
        node.inputs.clear()
        folded.add(id(node))
    if folded:
        g.nodes = [n for n in g.nodes if id(n) not in folded]
