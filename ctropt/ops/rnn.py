"""ai.ctropt GRU-family sequence ops: attributes, numpy reference, and the lean Scan that computes them.

One node per recurrent layer, op type ``<KIND>Sequence`` (GRUSequence, AUGRUSequence, AGRUSequence,
AIGRUSequence), batch-major like CTR models are:

    inputs   X [B, T, I], W [I, 3H], R [H, 3H], B [6H] (= W bias, R bias),
             sequence_lens [B] (optional), initial_h [B, H] (optional), att [B, T] (attention kinds),
             mask [B, T] (optional: nonzero = the step updates the state; use it or sequence_lens)
    outputs  Y [B, T, H] (all states), Y_h [B, H] (the state after the last valid step); either may be "".

Gates follow the ONNX GRU op: columns z, r, h of W/R/B; z keeps the state, h' = z*h + (1-z)*n, and
n = tanh(x Wh + (r*h) Rh + Rbh + Wbh), or with linear_before_reset n = tanh(x Wh + Wbh + r*(h Rh + Rbh)).
Kinds, with u = 1 - z the weight of the candidate n:
    GRU    h' = h + u*(n - h)
    AUGRU  h' = h + a*u*(n - h)              (DIEN paper, deepctr-torch); with att_keep=1 the DIEN and DeepCTR
           h' = h + (1 - (1-a)*z)*(n - h)    TF code instead scales the keep gate: z' = (1 - a)*z
    AGRU   h' = h + a*(n - h)
    AIGRU  a GRU over a*x
Steps that are masked (t >= sequence_lens, or mask == 0) keep the state; their Y is 0 (padded_output
"zero", what dynamic_rnn and the ONNX GRU op write) or the kept state (padded_output "state").
Lengths outside [0, T] read as clamped (t < len decides: a Scan/Loop's masking accepts any length), or, with
lengths_checked=1 (a layer read from an ONNX GRU op, which rejects them), raise (``checked_lengths``).

The node's function body is :func:`build_sequence` itself: a Scan over time whose body holds only the
recurrent part (the input projection X·W + biases is one MatMul over all steps, hoisted out of the loop).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from ..graph.edit import Builder
from . import DOMAIN

KINDS = ("GRU", "AUGRU", "AGRU", "AIGRU")
INPUTS = ("X", "W", "R", "B", "sequence_lens", "initial_h", "att", "mask")
OUTPUTS = ("Y", "Y_h")
OPSET = 17  # of the function bodies, unless the model's is given
MIN_OPSET = 13  # Split/Unsqueeze with tensor inputs


@dataclasses.dataclass(frozen=True)
class SequenceAttrs:
    kind: str = "GRU"
    hidden_size: int = 0
    linear_before_reset: int = 0
    att_keep: int = 0
    padded_output: str = "zero"
    lengths_checked: int = 0  # 1: sequence_lens outside [0, T] raise (the ONNX GRU op's check); 0: clamped

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, not {self.kind!r}")
        if self.padded_output not in ("zero", "state"):
            raise ValueError("padded_output must be 'zero' or 'state'")
        if self.lengths_checked not in (0, 1):
            raise ValueError("lengths_checked must be 0 or 1")

    @property
    def op_type(self) -> str:
        return f"{self.kind}Sequence"

    def as_node_attrs(self) -> dict:
        attrs = {"kind": self.kind, "hidden_size": self.hidden_size, "linear_before_reset": self.linear_before_reset,
                 "att_keep": self.att_keep, "padded_output": self.padded_output}
        if self.lengths_checked:  # only where set: clamping layers' nodes (and function variants) stay as they were
            attrs["lengths_checked"] = 1
        return attrs

    @classmethod
    def of(cls, node: gs.Node) -> "SequenceAttrs":
        a = node.attrs
        return cls(str(a["kind"]), int(a["hidden_size"]), int(a.get("linear_before_reset", 0)),
                   int(a.get("att_keep", 0)), str(a.get("padded_output", "zero")), int(a.get("lengths_checked", 0)))


def is_sequence_node(node: gs.Node) -> bool:
    return node.domain == DOMAIN and node.op.split("_")[0] in {f"{k}Sequence" for k in KINDS}


# ------------------------------------------------------------------------------------------ reference


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def reference(attrs: SequenceAttrs, X, W, R, B, sequence_lens=None, initial_h=None, att=None, mask=None):
    """The op's meaning in numpy: returns (Y [B, T, H], Y_h [B, H])."""
    X = np.asarray(X, np.float64)
    batch, steps, _ = X.shape
    H = R.shape[0]
    wb, rb = B[: 3 * H], B[3 * H:]
    h = np.zeros((batch, H)) if initial_h is None else np.asarray(initial_h, np.float64).copy()
    valid = np.ones((batch, steps), bool)
    if sequence_lens is not None:
        lens = np.asarray(sequence_lens).reshape(-1)
        if attrs.lengths_checked and np.any((lens < 0) | (lens > steps)):
            raise ValueError(f"sequence_lens must be in [0, {steps}] (lengths_checked)")
        valid = np.arange(steps)[None, :] < lens.reshape(-1, 1)
    if mask is not None:
        valid = np.asarray(mask) != 0
    Y = np.zeros((batch, steps, H))
    for t in range(steps):
        x = X[:, t]
        a = None if att is None else np.asarray(att, np.float64)[:, t:t + 1]
        if attrs.kind == "AIGRU":
            x = x * a
        gx, gh = x @ W + wb, h @ R
        z = _sigmoid(gx[:, :H] + gh[:, :H] + rb[:H])
        r = _sigmoid(gx[:, H:2 * H] + gh[:, H:2 * H] + rb[H:2 * H])
        if attrs.linear_before_reset:
            n = np.tanh(gx[:, 2 * H:] + r * (gh[:, 2 * H:] + rb[2 * H:]))
        else:
            n = np.tanh(gx[:, 2 * H:] + (r * h) @ R[:, 2 * H:] + rb[2 * H:])
        if attrs.kind == "AUGRU":
            c = 1 - (1 - a) * z if attrs.att_keep else a * (1 - z)
        elif attrs.kind == "AGRU":
            c = a
        else:
            c = 1 - z
        new = h + c * (n - h)
        m = valid[:, t:t + 1]
        h = np.where(m, new, h)
        Y[:, t] = np.where(m, h, 0.0) if attrs.padded_output == "zero" else h
    return Y.astype(np.float32), h.astype(np.float32)


# ------------------------------------------------------------------------------------------ the lean Scan


def _fold(op: str, inputs: list, attrs: dict) -> list[np.ndarray] | None:
    """Weight preparation on constants (not in a function body) is done here, once, in numpy."""
    if not all(isinstance(t, gs.Constant) for t in inputs):
        return None
    v = [np.asarray(t.values) for t in inputs]
    if op in ("Add", "Sub", "Mul"):
        out = [{"Add": np.add, "Sub": np.subtract, "Mul": np.multiply}[op](v[0], v[1])]
    elif op == "Concat":
        out = [np.concatenate(v, axis=attrs["axis"])]
    elif op == "Split":
        out = np.split(v[0], np.cumsum(v[1])[:-1], axis=attrs["axis"])
    else:
        return None
    return [o.astype(v[0].dtype) for o in out]


def build_sequence(graph: gs.Graph, attrs: SequenceAttrs, inputs: dict, outputs: dict, prefix: str,
                   shapes: dict | None = None) -> None:
    """Emit into `graph` the nodes that compute the op from `inputs` into `outputs` (name -> tensor).

    `inputs` maps names of INPUTS to tensors (absent = not given); `outputs` maps "Y"/"Y_h" to the tensors
    to write (absent = not needed). The recurrent loop is one Scan; all per-step work that does not depend
    on the state (input projection, biases, attention and mask factors) happens before it, once.
    """
    e = Builder(graph, prefix, fold=None if isinstance(graph, gs.Function) else _fold)
    H = attrs.hidden_size
    X, W, R, Bias = (inputs[k] for k in ("X", "W", "R", "B"))
    att, lens, mask, h0 = (inputs.get(k) for k in ("att", "sequence_lens", "mask", "initial_h"))
    lbr, kind = attrs.linear_before_reset, attrs.kind
    if kind != "GRU" and att is None:
        raise ValueError(f"{kind}Sequence needs att")

    # Weights: negate the z columns so the Sigmoid yields u = 1 - z directly (except for att_keep, which needs z).
    use_u = not (kind == "AUGRU" and attrs.att_keep)
    flip = np.concatenate([np.full(H, -1.0 if use_u else 1.0), np.ones(2 * H)]).astype(np.float32)
    wb, rb = e.op("Split", [Bias, e.const("const", np.array([3 * H, 3 * H], np.int64))], {"axis": 0}, outputs=2)
    rb_zr, rb_n = e.op("Split", [rb, e.const("const", np.array([2 * H, H], np.int64))], {"axis": 0}, outputs=2)
    zero_n = e.const("const", np.zeros(H, np.float32))
    # Biases that add linearly before the nonlinearity move into the hoisted projection.
    x_bias = e.op("Add", [wb, e.op("Concat", [rb_zr, rb_n if not lbr else zero_n], {"axis": 0})])
    x_bias = e.op("Mul", [x_bias, e.const("const", flip)])
    Wf = e.op("Mul", [W, e.const("const", flip)])
    Rf = e.op("Mul", [R, e.const("const", flip)])

    # Time-major per-step factors, [T, B, 1] each.
    def time_major(t2d):  # [B, T] -> [T, B, 1]
        return e.op("Unsqueeze", [e.op("Transpose", [e.op("Cast", [t2d], {"to": onnx.TensorProto.FLOAT})],
                                       {"perm": [1, 0]}), e.const("const", np.array([2], np.int64))])

    x_in = X
    if kind == "AIGRU":
        x_in = e.op("Mul", [X, e.op("Unsqueeze", [att, e.const("const", np.array([2], np.int64))])])
    x_t = _time_major(e, x_in)                                        # [T, B, I]: X is narrower than X·W
    W_zr, W_n = e.op("Split", [Wf, e.const("const", np.array([2 * H, H], np.int64))], {"axis": 1}, outputs=2)
    b_zr, b_n = e.op("Split", [x_bias, e.const("const", np.array([2 * H, H], np.int64))], {"axis": 0}, outputs=2)
    # One Gemm (bias included) per gate group over all T*B rows, viewed back as [T, B, k] (a Reshape with allowzero:
    # at batch 0 the shape's 0 is meant, not "copy the input's dim"; opset 13 has no allowzero: 3-D MatMul there).
    opset = int(e.graph.opset or OPSET)
    if not isinstance(W, gs.Constant) or opset < 14:  # function body: 3-D MatMul
        xw_zr = e.op("Add", [e.op("MatMul", [x_t, W_zr]), b_zr])   # [T, B, 2H]
        xw_n = e.op("Add", [e.op("MatMul", [x_t, W_n]), b_n])      # [T, B, H]
    else:
        tb = e.op("Shape", [x_t], {"end": 2}) if opset >= 15 else \
            e.op("Slice", [e.op("Shape", [x_t]), e.const("const", np.array([0], np.int64)),
                           e.const("const", np.array([2], np.int64))])
        x_2d = e.op("Reshape", [x_t, e.const("const", np.array([-1, W.shape[0]], np.int64))])
        xw_zr = e.op("Reshape", [e.op("Gemm", [x_2d, W_zr, b_zr]),
                                 e.op("Concat", [tb, e.const("const", np.array([2 * H], np.int64))], {"axis": 0})],
                     {"allowzero": 1})
        xw_n = e.op("Reshape", [e.op("Gemm", [x_2d, W_n, b_n]),
                                e.op("Concat", [tb, e.const("const", np.array([H], np.int64))], {"axis": 0})],
                    {"allowzero": 1})

    step_mask = None
    if lens is not None or mask is not None:
        if mask is not None:
            valid = e.op("Cast", [mask], {"to": onnx.TensorProto.BOOL})
        else:
            steps = e.op("Gather", [e.op("Shape", [X]), e.const("const", np.array(1, np.int64))], {"axis": 0})
            rng = e.op("Range", [e.const("const", np.array(0, np.int64)), steps,
                                 e.const("const", np.array(1, np.int64))])
            # [-1]: exporters squeeze [B, 1] lengths without axes, which leaves a scalar at batch 1
            lens64 = e.op("Cast", [lens], {"to": onnx.TensorProto.INT64})
            if lens.shape is None or len(lens.shape) != 1:
                lens64 = e.op("Reshape", [lens64, e.const("const", np.array([-1], np.int64))])
            if attrs.lengths_checked:
                lens64 = checked_lengths(e, lens64, steps)
            valid = e.op("Less", [e.op("Unsqueeze", [rng, e.const("const", np.array([0], np.int64))]),
                                  e.op("Unsqueeze", [lens64, e.const("const", np.array([1], np.int64))])])  # [B, T]
        step_mask = time_major(valid)
    # The candidate's weight c per step: u, a*u, 1-(1-a)*z, or a; the mask multiplies into it.
    scan_factor = None    # [T, B, 1] that multiplies the gate
    if kind == "AUGRU" and attrs.att_keep:
        scan_factor = e.op("Sub", [e.const("const", np.array(1.0, np.float32)), time_major(att)])   # (1 - a)
    elif kind in ("AUGRU", "AGRU"):
        scan_factor = time_major(att)
        if step_mask is not None:
            scan_factor = e.op("Mul", [scan_factor, step_mask])
    elif step_mask is not None:
        scan_factor = step_mask

    if h0 is None:
        batch = e.op("Gather", [e.op("Shape", [X]), e.const("const", np.array(0, np.int64))], {"axis": 0})
        shape = e.op("Concat", [e.op("Unsqueeze", [batch, e.const("const", np.array([0], np.int64))]),
                                e.const("const", np.array([H], np.int64))], {"axis": 0})
        h0 = e.op("ConstantOfShape", [shape], {"value": gs.Constant("zero", np.zeros(1, np.float32))})

    # ---- the Scan body
    body = gs.Graph(name=e.name("gru_step"), opset=graph.opset or OPSET)
    h = gs.Variable(e.name("h"), dtype=np.float32, shape=[None, H])
    x_zr = gs.Variable(e.name("x_zr"), dtype=np.float32, shape=[None, 2 * H])
    x_n = gs.Variable(e.name("x_n"), dtype=np.float32, shape=[None, H])
    body.inputs = [h, x_zr, x_n]
    f_s = m_s = None
    if scan_factor is not None:
        f_s = gs.Variable(e.name("factor_t"), dtype=np.float32, shape=[None, 1])
        body.inputs.append(f_s)
    keep_masked = kind == "AUGRU" and attrs.att_keep and step_mask is not None
    if scan_factor is step_mask and step_mask is not None:
        m_s = f_s                                   # GRU/AIGRU: the factor is the mask itself
    elif keep_masked or (step_mask is not None and attrs.padded_output == "zero" and "Y" in outputs):
        m_s = gs.Variable(e.name("mask_t"), dtype=np.float32, shape=[None, 1])
        body.inputs.append(m_s)

    bb = Builder(body, prefix, root=graph)
    b = bb.op

    R_zr, R_n = e.op("Split", [Rf, e.const("const", np.array([2 * H, H], np.int64))], {"axis": 1}, outputs=2)
    gates = b("Sigmoid", [b("Add", [x_zr, b("MatMul", [h, R_zr])])])
    g0, r = b("Split", [gates, bb.const("const", np.array([H, H], np.int64))], {"axis": 1}, outputs=2)
    if lbr:
        n = b("Tanh", [b("Add", [x_n, b("Mul", [r, b("Gemm", [h, R_n, rb_n])])])])
    else:
        n = b("Tanh", [b("Add", [x_n, b("MatMul", [b("Mul", [r, h]), R_n])])])
    d = b("Sub", [n, h])
    if kind == "AGRU":
        c = f_s                                          # a (times the mask)
    elif kind == "AUGRU" and attrs.att_keep:
        c = b("Sub", [bb.const("const", np.array(1.0, np.float32)), b("Mul", [g0, f_s])])  # 1 - (1-a) z
        if m_s is not None:
            c = b("Mul", [c, m_s])
    else:
        c = g0 if f_s is None else b("Mul", [g0, f_s])   # u, u*mask, u*a(*mask)
    h_new = b("Add", [h, b("Mul", [c, d])])
    body.outputs = [h_new]
    if "Y" in outputs:
        y = b("Mul", [h_new, m_s]) if m_s is not None and attrs.padded_output == "zero" else b("Identity", [h_new])
        body.outputs.append(y)
    for t in body.outputs:
        t.dtype, t.shape = np.float32, [None, H]

    scan_inputs = [xw_zr, xw_n] + ([scan_factor] if f_s is not None else []) + \
        ([step_mask] if m_s is not None and m_s is not f_s else [])
    scan_outs = [outputs.get("Y_h") or gs.Variable(e.name("Y_h"))]
    if "Y" in outputs:
        scan_outs.append(gs.Variable(e.name("Y_time_major")))
    graph.nodes.append(gs.Node("Scan", e.name("Scan"), attrs={"body": body, "num_scan_inputs": len(scan_inputs)},
                               inputs=[h0] + scan_inputs, outputs=scan_outs))
    if "Y" in outputs:
        graph.nodes.append(gs.Node("Transpose", e.name("Transpose"), attrs={"perm": [1, 0, 2]},
                                   inputs=[scan_outs[1]], outputs=[outputs["Y"]]))


def checked_lengths(e: Builder, lens: gs.Tensor, steps: gs.Tensor) -> gs.Tensor:
    """`lens` (int64 [B]) through a check that raises, as the ONNX GRU op does, when a length lies outside
    [0, steps] (`steps`: T, int64, 0-d or [1]): a Gather from a one-element tensor at the count of bad lengths
    ("indices element out of data bounds" from the node named sequence_lens_must_be_in_0_T), added to `lens`
    (0 when none is bad). Seven ops on [B] values; OpenVINO's Gather reads an out-of-range index as 0 instead."""
    i64 = onnx.TensorProto.INT64
    zero = e.const("zero", np.zeros(1, np.int64))
    bad = e.op("Or", [e.op("Less", [lens, zero], dtype=np.bool_), e.op("Greater", [lens, steps], dtype=np.bool_)],
               dtype=np.bool_)
    count = e.op("ReduceSum", [e.op("Cast", [bad], {"to": i64}, dtype=np.int64)], {"keepdims": 1}, dtype=np.int64)
    offset = e.op("Gather", [zero, count], {"axis": 0}, name="sequence_lens_must_be_in_0_T", dtype=np.int64)
    return e.op("Add", [lens, offset], dtype=np.int64)


def _time_major(e: Builder, x: gs.Tensor) -> gs.Tensor:
    """[B, T, I] -> [T, B, I]; when x is itself a batch-major view of a time-major value, that value."""
    producer = x.inputs[0] if x.inputs else None
    if producer is not None and producer.op == "Transpose" and list(producer.attrs.get("perm", [])) == [1, 0, 2] \
            and not isinstance(e.graph, gs.Function):
        return producer.inputs[0]
    return e.op("Transpose", [x], {"perm": [1, 0, 2]})


# ------------------------------------------------------------------------------------------ the node


def function_for(attrs: SequenceAttrs, present: tuple[str, ...], name: str, opset: int = OPSET) -> gs.Function:
    """The model-local function of one variant (attributes + which optional inputs are given)."""
    fn = gs.Function(name, domain=DOMAIN, opset=opset)
    formal = {k: gs.Variable(k, dtype=np.float32 if k not in ("sequence_lens",) else None) for k in INPUTS}
    outs = {k: gs.Variable(k, dtype=np.float32) for k in OUTPUTS}
    build_sequence(fn, attrs, {k: formal[k] for k in present}, outs, prefix="s")
    fn.inputs = [formal[k] for k in INPUTS]
    fn.outputs = [outs[k] for k in OUTPUTS]
    fn.import_domains = [onnx.helper.make_opsetid("", opset)]
    return fn


def add_sequence_node(graph: gs.Graph, attrs: SequenceAttrs, inputs: dict, outputs: dict, name: str) -> gs.Node:
    """Append one ai.ctropt sequence node (and its function, once per variant) to the top-level `graph`."""
    present = tuple(k for k in INPUTS if inputs.get(k) is not None)
    variant = f"ctropt variant: {attrs.as_node_attrs()} inputs {list(present)}"
    fn = next((f for f in graph.functions if f.domain == DOMAIN and f.doc_string == variant), None)
    if fn is None:
        taken = {f.name for f in graph.functions if f.domain == DOMAIN}
        op, i = attrs.op_type, 1
        while op in taken:
            i += 1
            op = f"{attrs.op_type}_{i}"
        fn = function_for(attrs, present, op, max(int(graph.opset or OPSET), MIN_OPSET))
        fn.doc_string = variant
        graph.functions.append(fn)
    empty = gs.Variable.empty()
    node = gs.Node(fn.name, name, attrs=attrs.as_node_attrs(), domain=DOMAIN,
                   inputs=[inputs.get(k) if inputs.get(k) is not None else empty for k in INPUTS],
                   outputs=[outputs.get(k) if outputs.get(k) is not None else gs.Variable.empty() for k in OUTPUTS])
    while node.inputs and node.inputs[-1] is empty:
        node.inputs.pop()
    graph.nodes.append(node)
    return node


def replace_sequence_node(graph: gs.Graph, node: gs.Node, attrs: SequenceAttrs, inputs: dict) -> gs.Node:
    """`node` rebuilt with `attrs` and its inputs updated by `inputs` (same outputs, same name)."""
    named = {k: t for k, t in zip(INPUTS, node.inputs) if t.name}
    outputs = {k: t for k, t in zip(OUTPUTS, node.outputs) if t.name}
    graph.nodes.remove(node)
    node.inputs.clear()
    node.outputs.clear()
    return add_sequence_node(graph, attrs, {**named, **inputs}, outputs, node.name)
