"""The ai.ctropt sequence ops: meaning, function body, lowerings, and reading cells by meaning."""

from __future__ import annotations

import itertools
import sys

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import onnxruntime as ort
import pytest
from onnx import TensorProto

from ctropt.graph import to_graph, to_model
from ctropt.ops import DOMAIN
from ctropt.ops.rnn import SequenceAttrs, add_sequence_node, reference
from ctropt.passes.rnn import lower_ort as rnn_passes
from ctropt.passes.rnn.lower_ort import lower_sequence_node
from ctropt.passes.rnn.cell import identify_gru_cell
from tests.helpers import init, make_model, node, vi

Bn, T, I, H = 5, 7, 4, 3
LENS = np.array([0, T, 3, 1, T - 1], np.int64)  # empty, full and partial rows


def _run(model, feeds):
    model = model if isinstance(model, onnx.ModelProto) else model
    s = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return s.run(None, feeds)


def _layer(attrs, with_lens, with_mask, with_h0, want_y, rng):
    """A graph with one sequence node, its feeds, and the reference outputs."""
    g = gs.Graph(opset=17)
    X = gs.Variable("X", np.float32, ["b", "t", I])
    W, R, B = (rng.normal(size=s).astype(np.float32) for s in ((I, 3 * H), (H, 3 * H), (6 * H,)))
    ins = {"X": X, "W": gs.Constant("W", W), "R": gs.Constant("R", R), "B": gs.Constant("Bias", B)}
    feeds = {"X": rng.normal(size=(Bn, T, I)).astype(np.float32)}
    kw = {}

    def add(key, name, value, shape):
        v = gs.Variable(name, value.dtype, shape)
        g.inputs.append(v)
        ins[key], feeds[name], kw[key] = v, value, value

    g.inputs = [X]
    if attrs.kind != "GRU":
        add("att", "att", rng.uniform(size=(Bn, T)).astype(np.float32), ["b", "t"])
    if with_lens:
        add("sequence_lens", "lens", LENS, ["b"])
    if with_mask:
        add("mask", "mask", (rng.uniform(size=(Bn, T)) > 0.4).astype(np.float32), ["b", "t"])
    if with_h0:
        add("initial_h", "h0", rng.normal(size=(Bn, H)).astype(np.float32), ["b", H])
    outs = {"Y_h": gs.Variable("Y_h", np.float32, ["b", H])}
    if want_y:
        outs["Y"] = gs.Variable("Y", np.float32, ["b", "t", H])
    node_ = add_sequence_node(g, attrs, ins, outs, "layer")
    g.outputs = [outs[k] for k in ("Y", "Y_h") if k in outs]
    y, y_h = reference(attrs, feeds["X"], W, R, B, **kw)
    return g, node_, feeds, ([y] if want_y else []) + [y_h]


VARIANTS = [(k, lbr, keep, pad) for k in ("GRU", "AUGRU", "AGRU", "AIGRU") for lbr in (0, 1)
            for keep in ((0, 1) if k == "AUGRU" else (0,)) for pad in ("zero", "state")]
MASKING = [(1, 0), (0, 1), (0, 0)]  # lengths, mask, neither


@pytest.mark.parametrize("kind,lbr,keep,pad", VARIANTS)
@pytest.mark.parametrize("form", ["function", "scan", "gru-op", "standard"])
def test_sequence_op_matches_reference(kind, lbr, keep, pad, form):
    rng = np.random.default_rng(0)
    for (with_lens, with_mask), with_h0, want_y in itertools.product(MASKING, (0, 1), (0, 1)):
        g, n, feeds, want = _layer(SequenceAttrs(kind, H, lbr, keep, pad), with_lens, with_mask, with_h0, want_y, rng)
        if form != "function":
            lower_sequence_node(g, n, form)
            g.cleanup()
        model = to_model(g, make_model([], [], []))
        onnx.checker.check_model(model)
        assert any(n.domain == DOMAIN for n in model.graph.node) == (form == "function")
        assert bool(model.functions) == (form == "function")
        for rows in (slice(None), slice(0, 1)):  # auto: batch 5 takes the GRU op where it applies; check both
            got = _run(model, {k: v[rows] for k, v in feeds.items()})
            for a, b in zip(got, want):
                np.testing.assert_allclose(a, b[rows], atol=1e-5)


@pytest.mark.parametrize("kind", ["GRU", "AUGRU", "AIGRU"])
@pytest.mark.parametrize("form", ["scan", "gru-op", "standard"])
def test_last_state_only_runs_up_to_the_longest_length(kind, form, monkeypatch):
    """A layer read only for its last state runs the steps before the batch's longest length (X, att sliced);
    with all states wanted, or a mask instead of lengths, it runs all T steps."""
    monkeypatch.setattr(sys.modules[__name__], "LENS", np.array([2, 0, 3, 1, 2], np.int64))
    for want_y, (with_lens, with_mask) in itertools.product((0, 1), MASKING):
        g, n, feeds, want = _layer(SequenceAttrs(kind, H, 1), with_lens, with_mask, 0, want_y, np.random.default_rng(3))
        lower_sequence_node(g, n, form)
        g.cleanup()
        model = to_model(g, make_model([], [], []))
        cut = [x for x in model.graph.node if x.op_type == "Slice" and x.input[0] in ("X", "att")]
        assert len(cut) == (0 if want_y or not with_lens else 1 + (kind != "GRU")), [x.name for x in cut]
        for rows in (slice(None), slice(1, 2), slice(2, 3)):  # longest 3; 0 (one step still runs); 3
            got = _run(model, {k: v[rows] for k, v in feeds.items()})
            for a, b in zip(got, want):
                np.testing.assert_allclose(a, b[rows], atol=1e-5)


def test_auto_form_switches_on_the_batch(monkeypatch):
    """auto = If(batch >= GRU_OP_MAX_BATCH or an empty batch or history, lean Scan (or the empty answer), GRU op):
    both branches give the reference."""
    monkeypatch.setattr(rnn_passes, "GRU_OP_MAX_BATCH", 3)
    rng = np.random.default_rng(6)
    g, n, feeds, want = _layer(SequenceAttrs("GRU", H, 1), 1, 0, 0, 1, rng)
    lower_sequence_node(g, n, "standard")
    g.cleanup()
    model = to_model(g, make_model([], [], []))
    assert [x.op_type for x in model.graph.node if x.op_type == "If"] == ["If"]

    def ops_in(graph):  # op types of a graph and the graphs inside it
        return {x.op_type for x in graph.node} | {t for x in graph.node for a in x.attribute if a.g.node
                                                   for t in ops_in(a.g)}

    branch_ops = {b.name: ops_in(b.g) for b in next(x for x in model.graph.node if x.op_type == "If").attribute}
    assert any("GRU" in ops for ops in branch_ops.values()) and any("Scan" in ops for ops in branch_ops.values())
    for rows in (slice(0, 2), slice(None)):  # batch 2 < 3: GRU op; batch 5: Scan
        got = _run(model, {k: v[rows] for k, v in feeds.items()})
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b[rows], atol=1e-5)


def test_reference_is_the_onnx_gru_op():
    rng = np.random.default_rng(1)
    for lbr in (0, 1):
        W, R, B = (rng.normal(size=s).astype(np.float32) for s in ((I, 3 * H), (H, 3 * H), (6 * H,)))
        X = rng.normal(size=(Bn, T, I)).astype(np.float32)
        m = make_model([node("Transpose", ["X"], ["Xt"], perm=[1, 0, 2]),
                        node("Cast", ["lens"], ["lens32"], to=TensorProto.INT32),
                        node("GRU", ["Xt", "W", "R", "B", "lens32"], ["Y", "Y_h"], hidden_size=H, linear_before_reset=lbr)],
                       [vi("X", shape=None), vi("lens", TensorProto.INT64, None)], [vi("Y"), vi("Y_h")],
                       [init("W", W.T[None]), init("R", R.T[None]), init("B", B[None])])
        y, y_h = _run(m, {"X": X, "lens": LENS})
        ry, rh = reference(SequenceAttrs("GRU", H, lbr), X, W, R, B, sequence_lens=LENS)
        np.testing.assert_allclose(y[:, 0].transpose(1, 0, 2), ry, atol=1e-6)
        np.testing.assert_allclose(y_h[0], rh, atol=1e-6)


def test_function_survives_a_roundtrip_and_is_dropped_when_unused():
    g, n, feeds, want = _layer(SequenceAttrs("AUGRU", H, 1), 1, 0, 0, 1, np.random.default_rng(2))
    model = to_model(g, make_model([], [], []))
    again = to_model(to_graph(model), model)
    assert [f.name for f in again.functions] == ["AUGRUSequence"]
    assert {o.domain: o.version for o in again.opset_import}[DOMAIN] == 1
    np.testing.assert_allclose(_run(again, feeds)[0], want[0], atol=1e-5)
    graph = to_graph(again)
    lower_sequence_node(graph, graph.nodes[0] if graph.nodes[0].domain == DOMAIN else
                        next(x for x in graph.nodes if x.domain == DOMAIN))
    assert not to_model(graph, again).functions


def test_two_variants_of_one_kind_get_two_functions():
    rng = np.random.default_rng(3)
    g, _, _, _ = _layer(SequenceAttrs("GRU", H, 0), 1, 0, 0, 1, rng)
    X2 = gs.Variable("X2", np.float32, ["b", "t", I])
    y2 = gs.Variable("Y2", np.float32, ["b", H])
    g.inputs.append(X2)
    g.outputs.append(y2)
    W, R, B = (rng.normal(size=s).astype(np.float32) for s in ((I, 3 * H), (H, 3 * H), (6 * H,)))
    add_sequence_node(g, SequenceAttrs("GRU", H, 1), {"X": X2, "W": gs.Constant("W2", W), "R": gs.Constant("R2", R),
                                                      "B": gs.Constant("B2", B)}, {"Y_h": y2}, "second")
    model = to_model(g, make_model([], [], []))
    assert sorted(f.name for f in model.functions) == ["GRUSequence", "GRUSequence_2"]
    onnx.checker.check_model(model)


# ---------------------------------------------------------------- reading cells written in different dialects

def _sig(x):
    return 1 / (1 + np.exp(-x))


def _cell_model(nodes, inits, att=False, x_width=I):
    inputs = [vi("h", shape=["b", H]), vi("x", shape=["b", x_width])] + ([vi("a", shape=["b", 1])] if att else [])
    return make_model(nodes, inputs, [vi("h_new", shape=["b", H])], inits)


def _tf_gru_cell(rng, att_keep=None, packed_att=False):
    """tf.nn.rnn_cell.GRUCell as tf2onnx writes it: r, u = split(sigmoid([x, h] Wg + bg)); c = tanh([x, r*h] Wc + bc);
    h' = u*h + (1-u)*c. With att_keep the DIEN TF VecAttGRUCell: u = (1 - a) * u."""
    Wg = rng.normal(size=(I + H, 2 * H)).astype(np.float32)
    Wc = rng.normal(size=(I + H, H)).astype(np.float32)
    nodes = []
    x = "x"
    if packed_att:
        nodes += [node("Slice", ["x", "s0", "sI", "ax1"], ["xx"]), node("Slice", ["x", "sI", "sI1", "ax1"], ["a"])]
        x = "xx"
    nodes += [node("Concat", [x, "h"], ["xh"], axis=1), node("MatMul", ["xh", "Wg"], ["g0"]), node("Add", ["g0", "bg"], ["g1"]),
              node("Sigmoid", ["g1"], ["g"]), node("Split", ["g", "halves"], ["r", "u0"], axis=1)]
    u = "u0"
    if att_keep:
        nodes += [node("Sub", ["one", "a"], ["oma"]), node("Mul", ["oma", "u0"], ["u"])]
        u = "u"
    nodes += [node("Mul", ["r", "h"], ["rh"]), node("Concat", [x, "rh"], ["xrh"], axis=1),
              node("MatMul", ["xrh", "Wc"], ["c0"]), node("Add", ["c0", "bc"], ["c1"]), node("Tanh", ["c1"], ["c"]),
              node("Mul", [u, "h"], ["uh"]), node("Sub", ["one", u], ["omu"]), node("Mul", ["omu", "c"], ["uc"]),
              node("Add", ["uh", "uc"], ["h_new"])]
    inits = [init("Wg", Wg), init("Wc", Wc), init("bg", rng.normal(size=2 * H).astype(np.float32)),
             init("bc", rng.normal(size=H).astype(np.float32)), init("one", np.float32(1.0)),
             init("halves", np.array([H, H])), init("s0", np.array([0])), init("sI", np.array([I])), init("sI1", np.array([I + 1])), init("ax1", np.array([1]))]
    return _cell_model(nodes, inits, att=bool(att_keep) and not packed_att, x_width=I + 1 if packed_att else I)


def _torch_gru_cell(rng, kind="GRU"):
    """torch.nn.GRUCell / deepctr-torch AUGRUCell/AGRUCell as exported: gi = Gemm(x, W_ih^T), gh = Gemm(h, W_hh^T),
    chunks r, z, n; n = tanh(i_n + r*h_n); GRU: h' = (1-z)*n + z*h; AUGRU: u = a*z, h' = (1-u)*h + u*n;
    AGRU: h' = (1-a)*h + a*n."""
    nodes = [node("Gemm", ["x", "Wih", "bih"], ["gi"], transB=1), node("Gemm", ["h", "Whh", "bhh"], ["gh"], transB=1),
             node("Split", ["gi", "thirds"], ["i_r", "i_z", "i_n"], axis=1),
             node("Split", ["gh", "thirds"], ["h_r", "h_z", "h_n"], axis=1),
             node("Add", ["i_r", "h_r"], ["r0"]), node("Sigmoid", ["r0"], ["r"]),
             node("Mul", ["r", "h_n"], ["rhn"]), node("Add", ["i_n", "rhn"], ["n0"]), node("Tanh", ["n0"], ["n"])]
    if kind != "AGRU":
        nodes += [node("Add", ["i_z", "h_z"], ["z0"]), node("Sigmoid", ["z0"], ["z"])]
    if kind == "GRU":
        nodes += [node("Sub", ["one", "z"], ["omz"]), node("Mul", ["omz", "n"], ["a1"]), node("Mul", ["z", "h"], ["a2"]),
                  node("Add", ["a1", "a2"], ["h_new"])]
    else:
        gate = "a"
        if kind == "AUGRU":
            nodes += [node("Mul", ["a", "z"], ["u"])]
            gate = "u"
        nodes += [node("Sub", ["one", gate], ["omu"]), node("Mul", ["omu", "h"], ["a1"]), node("Mul", [gate, "n"], ["a2"]),
                  node("Add", ["a1", "a2"], ["h_new"])]
    inits = [init("Wih", rng.normal(size=(3 * H, I)).astype(np.float32)),
             init("Whh", rng.normal(size=(3 * H, H)).astype(np.float32)),
             init("bih", rng.normal(size=3 * H).astype(np.float32)), init("bhh", rng.normal(size=3 * H).astype(np.float32)),
             init("one", np.float32(1.0)), init("thirds", np.array([H, H, H]))]
    return _cell_model(nodes, inits, att=kind != "GRU")


CELLS = {
    "tf GRUCell": (lambda rng: _tf_gru_cell(rng), ("GRU", 0, 0)),
    "tf VecAttGRUCell, separate score": (lambda rng: _tf_gru_cell(rng, att_keep=True), ("AUGRU", 0, 1)),
    "tf VecAttGRUCell, score packed in x": (lambda rng: _tf_gru_cell(rng, att_keep=True, packed_att=True), ("AUGRU", 0, 1)),
    "torch GRUCell": (lambda rng: _torch_gru_cell(rng), ("GRU", 1, 0)),
    "deepctr-torch AUGRUCell": (lambda rng: _torch_gru_cell(rng, "AUGRU"), ("AUGRU", 1, 0)),
    "deepctr-torch AGRUCell": (lambda rng: _torch_gru_cell(rng, "AGRU"), ("AGRU", 1, 0)),
}


@pytest.mark.parametrize("dialect", list(CELLS))
def test_identify_gru_cell_by_meaning(dialect):
    build, (kind, lbr, keep) = CELLS[dialect]
    rng = np.random.default_rng(4)
    model = build(rng)
    g = to_graph(model)
    t = g.tensors()
    att = t.get("a") if "a" in [i.name for i in g.inputs] else None
    cell = identify_gru_cell(t["h_new"], t["h"], t["x"], att)
    assert cell is not None
    assert (cell.attrs.kind, cell.attrs.linear_before_reset, cell.attrs.att_keep) == (kind, lbr, keep)
    # the canonical cell computes what the graph computes
    h = rng.normal(size=(6, H)).astype(np.float32)
    x = rng.normal(size=(6, model.graph.input[1].type.tensor_type.shape.dim[1].dim_value)).astype(np.float32)
    a = rng.uniform(size=(6, 1)).astype(np.float32)
    if cell.att_column is not None:
        x[:, cell.att_column] = a[:, 0]
    feeds = {"h": h, "x": x} | ({"a": a} if att is not None else {})
    (want,) = _run(model, feeds)
    _, got = reference(cell.attrs, x[:, None, cell.x_columns], cell.W, cell.R, cell.B, initial_h=h,
                       att=None if kind == "GRU" else a)
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_identify_gru_cell_rejects_other_cells():
    """An LSTM-like cell (two tanh) and a GRU whose reset gate is applied to x are not GRU-family cells."""
    rng = np.random.default_rng(5)
    model = _torch_gru_cell(rng)
    g = to_graph(model)
    t = g.tensors()
    # Rewire: the reset gate multiplies i_n instead of h_n, which no GRU kind computes.
    mul = next(n for n in g.nodes if n.outputs[0].name == "rhn")
    mul.inputs[1] = t["i_n"]
    assert identify_gru_cell(t["h_new"], t["h"], t["x"]) is None
