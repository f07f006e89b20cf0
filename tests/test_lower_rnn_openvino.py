"""`lower-rnn-openvino` (ctropt/passes/rnn/lower_openvino.py): every ai.ctropt sequence node becomes standard ONNX
that OpenVINO's CPU plugin loads and runs with the op's meaning (``ctropt.ops.rnn.reference``), on onnxruntime too;
AUGRU (att_keep=1) and AGRU with a static T become cells OpenVINO fuses into one AUGRUSequence, GRU/AIGRU the GRU op.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest

import ctropt
from ctropt.graph import interface, save, to_graph, to_model
from ctropt.ops import DOMAIN
from ctropt.ops.rnn import SequenceAttrs, add_sequence_node, reference
from ctropt.runtime import Runner

from helpers import make_model, ops

Bn, T, I, H = 5, 7, 4, 3
LENS = np.array([0, T, 3, 1, T - 1], np.int64)  # empty, full and partial rows
MASK = np.array([[0] * T, [1] * T, [1, 0, 1, 1, 0, 0, 1], [0, 0, 0, 1, 1, 1, 1], [1] * (T - 1) + [0]], np.float32)
# (masking, initial_h, outputs used) per layer of the test graphs
LAYERS = [("lens", 0, ("Y", "Y_h")), ("lens", 1, ("Y",)), ("lens", 1, ("Y_h",)), ("lens", 1, ("Y", "Y_h")),
          ("mask", 1, ("Y", "Y_h")), ("mask", 0, ("Y_h",)), (None, 0, ("Y",)), (None, 1, ("Y", "Y_h"))]


def _model(attrs: SequenceAttrs, static_t: bool, seed: int = 0, layers=LAYERS, shared_x: bool = False):
    """One graph with a sequence node per (masking, initial_h, outputs) layer; feeds and reference outputs.
    Each layer reads its own X unless shared_x (the attention, lengths, mask and initial_h are shared)."""
    rng = np.random.default_rng(seed)
    steps = T if static_t else "t"
    g = gs.Graph(opset=17)
    g.inputs, feeds, shared = [], {}, {}

    def graph_input(name, value, shape):
        if name not in shared:
            shared[name] = gs.Variable(name, value.dtype, shape)
            g.inputs.append(shared[name])
            feeds[name] = value
        return shared[name]

    want = {}
    for i, (masking, with_h0, outs) in enumerate(layers):
        X = graph_input("X" if shared_x else f"X{i}", rng.normal(size=(Bn, T, I)).astype(np.float32), ["b", steps, I])
        W, R, B = (rng.normal(size=s).astype(np.float32) for s in ((I, 3 * H), (H, 3 * H), (6 * H,)))
        ins = {"X": X, "W": gs.Constant(f"W{i}", W), "R": gs.Constant(f"R{i}", R), "B": gs.Constant(f"B{i}", B)}
        kw = {}
        if attrs.kind != "GRU":
            ins["att"] = graph_input("att", rng.uniform(size=(Bn, T)).astype(np.float32), ["b", steps])
        if masking == "lens":
            ins["sequence_lens"] = graph_input("lens", LENS, ["b"])
        if masking == "mask":
            ins["mask"] = graph_input("mask", MASK, ["b", steps])
        if with_h0:
            ins["initial_h"] = graph_input("h0", rng.normal(size=(Bn, H)).astype(np.float32), ["b", H])
        for k in ("att", "sequence_lens", "mask", "initial_h"):
            if k in ins:
                kw[k] = feeds[ins[k].name]
        y, y_h = reference(attrs, feeds[X.name], W, R, B, **kw)
        outputs = {k: gs.Variable(f"{k}_{i}", np.float32, ["b", steps, H] if k == "Y" else ["b", H]) for k in outs}
        add_sequence_node(g, attrs, ins, outputs, f"layer{i}")
        g.outputs += list(outputs.values())
        want.update({f"{k}_{i}": {"Y": y, "Y_h": y_h}[k] for k in outs})
    model = to_model(g, make_model([], [], []))
    return model, feeds, want


def _lower(model, **options):
    graph = to_graph(model)
    ctx = ctropt.PassContext(graph, target="openvino", options=options)
    ctropt.REGISTRY["lower-rnn-openvino"](ctx)
    return to_model(ctx.graph, like=model), ctx


def _all_ops(model) -> Counter:
    return ctropt.graph.op_histogram(model)


def _check(got: dict, want: dict, what: str) -> None:
    for k, v in want.items():
        np.testing.assert_allclose(got[k], v, atol=1e-5, rtol=0, err_msg=f"{what}: {k}")


def _openvino(model, tmp_path=None):
    runners = [Runner(model, "openvino-cpu", threads=1)]
    if tmp_path is not None:
        runners.append(Runner(str(save(model, tmp_path / "lowered.onnx")), "openvino-cpu", threads=1))
    return runners


def _runtime_types(runner: Runner) -> Counter:
    return Counter(op.get_rt_info()["layerType"].astype(str) for op in runner._compiled.get_runtime_model().get_ops())


VARIANTS = [(k, lbr, keep, pad) for k in ("GRU", "AIGRU", "AUGRU", "AGRU") for lbr in (0, 1)
            for keep in ((0, 1) if k == "AUGRU" else (0,)) for pad in ("zero", "state")]


def _expected_form(kind, lbr, keep, static_t, masking):
    if masking == "mask":
        return "scan"
    if kind in ("GRU", "AIGRU"):
        return "gru-op"
    if lbr == 0 and static_t and (kind == "AGRU" or keep):
        return "augru-unrolled"
    return "scan"


# static T matters where cells unroll (AUGRU att_keep=1, AGRU; linear_before_reset=0) and for one that must not
CASES = [v + (False,) for v in VARIANTS] + [v + (True,) for v in VARIANTS if v[0] in ("AUGRU", "AGRU") and v[1] == 0
                                            and (v[0] == "AGRU" or v[2] == 1 or v[3] == "zero")]
CASE_IDS = [f"{k}-lbr{lbr}-keep{keep}-{pad}-{'static' if s else 'dynamic'}T" for k, lbr, keep, pad, s in CASES]


@pytest.mark.parametrize("kind,lbr,keep,pad,static_t", CASES, ids=CASE_IDS)
def test_lowered_matches_reference_on_openvino_and_onnxruntime(kind, lbr, keep, pad, static_t):
    model, feeds, want = _model(SequenceAttrs(kind, H, lbr, keep, pad), static_t)
    once, ctx = _lower(model)
    assert ctx.matches == len(LAYERS) and ctx.rewrites == len(LAYERS)
    assert not any(n.domain == DOMAIN for g in ctropt.graph.iter_proto_graphs(once.graph) for n in g.node)
    assert not once.functions
    assert interface(once) == interface(model)
    onnx.checker.check_model(once)
    forms = [note.rsplit(": ", 1)[1] for note in ctx.notes]
    assert forms == [_expected_form(kind, lbr, keep, static_t, m) for m, _, _ in LAYERS], forms
    _check(Runner(once).run(feeds), want, "onnxruntime")
    (ov,) = _openvino(once)
    _check(ov.run(feeds), want, "openvino")
    twice, ctx2 = _lower(once)
    assert ctx2.matches == 0 and ctx2.rewrites == 0 and ops(twice) == ops(once)


def test_openvino_fuses_sequences(tmp_path):
    """GRU op → GRUSequence; static-T AUGRU (DIEN code form) and AGRU → AUGRUSequence (runtime type RNNSeq)."""
    layers = [(None, 0, ("Y", "Y_h")), ("lens", 1, ("Y_h",))]
    for attrs, static_t in ((SequenceAttrs("GRU", H, 1), False), (SequenceAttrs("AUGRU", H, 0, 1), True),
                            (SequenceAttrs("AGRU", H, 0, 0, "state"), True)):
        model, feeds, want = _model(attrs, static_t, seed=1, layers=layers)
        once, _ = _lower(model)
        for ov in _openvino(once, tmp_path if attrs.kind == "AUGRU" else None):  # read from a file too, once
            assert _runtime_types(ov)["RNNSeq"] == len(layers), _runtime_types(ov)
            assert _runtime_types(ov)["TensorIterator"] == 0
            _check(ov.run(feeds), want, f"openvino {attrs.kind}")


def test_static_seq_len_option_unrolls_dynamic_t():
    attrs = SequenceAttrs("AUGRU", H, 0, 1)
    layers = [("lens", 1, ("Y", "Y_h")), (None, 0, ("Y_h",))]
    model, feeds, want = _model(attrs, static_t=False, layers=layers)
    once, ctx = _lower(model, static_seq_len=T)
    assert [n.rsplit(": ", 1)[1] for n in ctx.notes] == ["augru-unrolled"] * 2
    assert "Scan" not in _all_ops(once)
    _check(Runner(once).run(feeds), want, "onnxruntime")
    (ov,) = _openvino(once)
    assert _runtime_types(ov)["RNNSeq"] == 2
    _check(ov.run(feeds), want, "openvino")
    longer = {k: np.concatenate([v, v], axis=1) if k in ("X", "att") else v for k, v in feeds.items()}
    with pytest.raises(ctropt.CtroptError):  # another T fails loudly, never gives wrong numbers
        Runner(once).run(longer)


@pytest.mark.parametrize("form", ["scan", "gru-op", "augru-unrolled"])
def test_forced_form_is_exact(form):
    attrs = SequenceAttrs("AUGRU", H, 0, 1, "state")
    model, feeds, want = _model(attrs, static_t=True, layers=[("lens", 1, ("Y", "Y_h"))])
    once, ctx = _lower(model, rnn_openvino_form=form)
    assert ctx.notes[0].endswith("augru-unrolled" if form == "augru-unrolled" else "scan")  # gru-op cannot do AUGRU
    _check(Runner(once).run(feeds), want, "onnxruntime")
    _check(_openvino(once)[0].run(feeds), want, "openvino")


def test_bad_options():
    model, _, _ = _model(SequenceAttrs("GRU", H), False, layers=[(None, 0, ("Y",))])
    with pytest.raises(ctropt.CtroptError):
        _lower(model, rnn_openvino_form="loop")
    with pytest.raises(ctropt.CtroptError):
        _lower(model, static_seq_len=0)


def test_openvino_target_chain(tmp_path):
    """The whole `--target openvino` chain, verified by the pass manager, ends in a model OpenVINO runs right."""
    layers = [("lens", 1, ("Y", "Y_h")), ("mask", 0, ("Y_h",))]
    for attrs, static_t in ((SequenceAttrs("AUGRU", H, 0, 1), True), (SequenceAttrs("AIGRU", H, 1, 0, "state"), False)):
        model, feeds, want = _model(attrs, static_t, seed=2, layers=layers)
        with pytest.raises(ctropt.CtroptError):  # the fused op as it is: OpenVINO cannot load model-local functions
            _openvino(model)
        result = ctropt.optimize(model, passes="all", target="openvino", feeds=feeds, speed=False)
        assert not result.failed, [(r.name, r.message) for r in result.failed]
        record = next(r for r in result.records if r.name == "lower-rnn-openvino")
        assert record.status == "applied" and record.rewrites == len(layers)
        assert not any(n.startswith(f"{DOMAIN}::") for n in _all_ops(result.model))
        for ov in _openvino(result.model, tmp_path):
            _check(ov.run(feeds), want, f"openvino {attrs}")


@pytest.mark.parametrize("attrs,static_t", [(SequenceAttrs("GRU", H), False), (SequenceAttrs("AIGRU", H, 1), True),
                                            (SequenceAttrs("AUGRU", H, 0, 1), True)], ids=["GRU", "AIGRU", "AUGRU"])
def test_layers_sharing_an_input(attrs, static_t):
    """Two GRU ops on one X: OpenVINO's OptimizeGRUSequenceTransposes rewires the shared Transpose and the first gives
    garbage, so only the first layer on an input becomes a GRU op. Unrolled AUGRU chains may share X."""
    layers = [(None, 0, ("Y", "Y_h")), ("lens", 1, ("Y",)), (None, 1, ("Y_h",))]
    model, feeds, want = _model(attrs, static_t, seed=3, layers=layers, shared_x=True)
    once, ctx = _lower(model)
    forms = [n.rsplit(": ", 1)[1] for n in ctx.notes]
    assert forms == (["gru-op", "scan", "scan"] if attrs.kind != "AUGRU" else ["augru-unrolled"] * 3), forms
    _check(Runner(once).run(feeds), want, "onnxruntime")
    (ov,) = _openvino(once)
    _check(ov.run(feeds), want, "openvino")


def test_weights_made_by_nodes():
    """Weights from a Constant node are constants (GRU op); computed ones keep the lean Scan, which the later
    OpenVINO lowerings (scan-outer-scope-as-state) make loadable."""
    rng = np.random.default_rng(4)
    g = gs.Graph(opset=17)
    X = gs.Variable("X", np.float32, ["b", "t", I])
    g.inputs = [X]
    feeds, want = {"X": rng.normal(size=(Bn, T, I)).astype(np.float32)}, {}
    for i, how in enumerate(("Constant", "Identity")):
        W, R, B = (rng.normal(size=s).astype(np.float32) for s in ((I, 3 * H), (H, 3 * H), (6 * H,)))
        ins = {"X": X}
        for k, v in zip("WRB", (W, R, B)):
            ins[k] = gs.Variable(f"{k}{i}", np.float32, list(v.shape))
            attrs = {"value": gs.Constant(f"{k}{i}_value", v)} if how == "Constant" else {}
            source = [] if attrs else [gs.Constant(f"{k}{i}c", v)]
            g.nodes.append(gs.Node(how, f"{k}{i}_{how}", attrs=attrs, inputs=source, outputs=[ins[k]]))
        outputs = {"Y": gs.Variable(f"Y_{i}", np.float32, ["b", "t", H])}
        add_sequence_node(g, SequenceAttrs("GRU", H, i), ins, outputs, f"layer{i}")
        g.outputs += list(outputs.values())
        want[f"Y_{i}"] = reference(SequenceAttrs("GRU", H, i), feeds["X"], W, R, B)[0]
    model = to_model(g, make_model([], [], []))
    once, ctx = _lower(model)
    assert [n.rsplit(": ", 1)[1] for n in ctx.notes] == ["gru-op", "scan"]
    _check(Runner(once).run(feeds), want, "onnxruntime")
    lower = [p.name for p in ctropt.passes.resolve("all", target="openvino") if p.group == "lower"]
    result = ctropt.optimize(model, passes=lower, target="openvino", feeds=feeds, speed=False)
    assert not result.failed, [(r.name, r.message) for r in result.failed]
    _check(_openvino(result.model)[0].run(feeds), want, "openvino")
