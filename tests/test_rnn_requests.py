"""Bad requests to recurrent layers (issue 47, README "Bad requests: the policy"): every form a sequence op is
lowered to answers an empty batch and an empty history without taking the process down (onnxruntime's GRU op
aborts on them), and reads lengths outside [0, T] as the layer it was read from did: clamped where that was a
Scan/Loop's masking, an error where it was an ONNX GRU op (``lengths_checked``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest

import ctropt
from ctropt.graph import to_graph, to_model
from ctropt.ops.rnn import SequenceAttrs, add_sequence_node, reference
from ctropt.passes.rnn import lower_ort
from ctropt.passes.rnn.lower_ort import lower_sequence_node
from ctropt.runtime import Runner
from tests.helpers import built_kernels, make_model

Bn, T, I, H = 5, 7, 4, 3
OUTSIDE = np.array([T + 5, -1, 0, 3, T], np.int64)  # above T, negative, and the edges
INSIDE = np.array([0, T, 3, 1, T - 1], np.int64)
FORMS = ["function", "scan", "gru-op", "standard", "standard-large-batch", "kernel", "openvino"]


@pytest.fixture(scope="module", autouse=True)
def library(tmp_path_factory):
    yield from built_kernels(tmp_path_factory)


# (lengths, initial_h, outputs) per layer: what the GRU op forms take (no lengths with initial_h on onnxruntime)
LAYERS = [(True, False, ("Y", "Y_h")), (True, False, ("Y_h",)), (False, True, ("Y", "Y_h")), (False, False, ("Y",))]


def _model(attrs: SequenceAttrs, layers=LAYERS, seed=0, opset=17):
    """One graph, a sequence node per layer (each its own weights and its own input X<i>, fed the same X: OpenVINO's
    lowering gives one GRU op per input; all reading lens, h0, att); the weights."""
    rng = np.random.default_rng(seed)
    g = gs.Graph(opset=opset)
    lens, h0 = gs.Variable("lens", np.int64, ["b"]), gs.Variable("h0", np.float32, ["b", H])
    att = gs.Variable("att", np.float32, ["b", "t"])
    g.inputs, weights = [att] if attrs.kind != "GRU" else [], []
    for i, (with_lens, with_h0, outs) in enumerate(layers):
        W, R, B = (rng.normal(size=s).astype(np.float32) for s in ((I, 3 * H), (H, 3 * H), (6 * H,)))
        weights.append((W, R, B))
        X = gs.Variable(f"X{i}", np.float32, ["b", "t", I])
        g.inputs.append(X)
        ins = {"X": X, "W": gs.Constant(f"W{i}", W), "R": gs.Constant(f"R{i}", R), "B": gs.Constant(f"B{i}", B)}
        if attrs.kind != "GRU":
            ins["att"] = att
        for on, key, t in ((with_lens, "sequence_lens", lens), (with_h0, "initial_h", h0)):
            if on:
                ins[key] = t
                if t not in g.inputs:
                    g.inputs.append(t)
        outputs = {k: gs.Variable(f"{k}_{i}", np.float32, ["b", "t", H] if k == "Y" else ["b", H]) for k in outs}
        add_sequence_node(g, attrs, ins, outputs, f"layer{i}")
        g.outputs += list(outputs.values())
    return g, weights


def _want(attrs, layers, weights, feeds) -> dict:
    want = {}
    for i, ((with_lens, with_h0, outs), (W, R, B)) in enumerate(zip(layers, weights)):
        y, y_h = reference(attrs, feeds["X"], W, R, B, sequence_lens=feeds["lens"] if with_lens else None,
                           initial_h=feeds["h0"] if with_h0 else None,
                           att=feeds["att"] if attrs.kind != "GRU" else None)
        want.update({f"{k}_{i}": {"Y": y, "Y_h": y_h}[k] for k in outs})
    return want


def _feeds(rows: int, steps: int, lens=None, seed=1) -> dict:
    rng = np.random.default_rng(seed)
    return {"X": rng.normal(size=(rows, steps, I)).astype(np.float32),
            "lens": np.asarray(lens if lens is not None else np.minimum(INSIDE[:rows], steps), np.int64),
            "h0": rng.normal(size=(rows, H)).astype(np.float32),
            "att": rng.uniform(size=(rows, steps)).astype(np.float32)}


def _lowered(g: gs.Graph, form: str, monkeypatch) -> onnx.ModelProto:
    """The graph's sequence nodes in `form` (standard-large-batch: the standard form's branch for large batches)."""
    if form == "openvino":
        model = to_model(g, make_model([], [], [], opset=g.opset))
        graph = to_graph(model)
        ctx = ctropt.PassContext(graph, target="openvino", options={})
        ctropt.REGISTRY["lower-rnn-openvino"](ctx)
        return to_model(ctx.graph, like=model)
    if form == "standard-large-batch":
        monkeypatch.setattr(lower_ort, "GRU_OP_MAX_BATCH", 1)
    if form != "function":
        for n in [n for n in g.nodes if n.domain == "ai.ctropt"]:
            lower_sequence_node(g, n, form.replace("-large-batch", ""))
        g.cleanup()
    model = to_model(g, make_model([], [], [], opset=g.opset))
    onnx.checker.check_model(model)
    return model


def _used(model: onnx.ModelProto, feeds: dict) -> dict:
    """The feeds of the model's inputs (X<i>: X)."""
    return {i.name: feeds["X" if i.name.startswith("X") else i.name] for i in model.graph.input}


def _check(got: dict, want: dict) -> None:
    for k, v in want.items():
        assert got[k].shape == v.shape, (k, got[k].shape, v.shape)
        np.testing.assert_allclose(got[k], v, atol=1e-5, err_msg=k)


CHILD = r"""
import sys, numpy as np
from ctropt.runtime import Runner
model, feeds, out = sys.argv[1:4]
try:
    got = Runner(model, threads=1).run(dict(np.load(feeds)))
except Exception as e:
    print(str(e)[:500]); sys.exit(3)
np.savez(out, **got)
"""


def _run_apart(model: onnx.ModelProto, feeds: dict, tmp_path: Path, tag: str):
    """Run `model` on `feeds` in a child process (onnxruntime's GRU op aborts it on an empty batch): its outputs,
    or fails the test with how the child ended."""
    path, inputs, out = tmp_path / f"{tag}.onnx", tmp_path / f"{tag}.in.npz", tmp_path / f"{tag}.out.npz"
    onnx.save(model, path)
    np.savez(inputs, **feeds)
    done = subprocess.run([sys.executable, "-c", CHILD, str(path), str(inputs), str(out)], capture_output=True,
                          text=True, timeout=120, cwd=Path(__file__).parent.parent)
    assert done.returncode == 0, f"{tag}: exit {done.returncode} {done.stdout[-500:]} {done.stderr[-500:]}"
    with np.load(out) as data:
        return {k: data[k] for k in data.files}


# ------------------------------------------------------------------------------ empty batches and histories

@pytest.mark.parametrize("opset", [13, 17])  # 13: no Reshape allowzero, no Shape start/end
@pytest.mark.parametrize("form", ["gru-op", "standard", "openvino"])
def test_gru_op_forms_answer_an_empty_batch_and_history(form, opset, tmp_path, monkeypatch):
    """The forms holding onnxruntime's GRU op (which aborts the process at batch 0, and at T = 0 without lengths)
    answer as the op means: nothing at batch 0; at T = 0 no steps and the initial state (or 0)."""
    attrs = SequenceAttrs("GRU", H, 1)
    g, weights = _model(attrs, opset=opset)
    model = _lowered(g, form, monkeypatch)
    assert "GRU" in ctropt.graph.op_histogram(model), ctropt.graph.op_histogram(model)
    for tag, feeds in (("batch0", _feeds(0, T)), ("batch1", _feeds(1, T)), ("steps0", _feeds(Bn, 0)),
                       ("both0", _feeds(0, 0))):
        _check(_run_apart(model, _used(model, feeds), tmp_path, f"{form}-{tag}"), _want(attrs, LAYERS, weights, feeds))


@pytest.mark.parametrize("form", ["scan", "function", "kernel", "openvino"])
def test_other_forms_answer_an_empty_batch(form, tmp_path, monkeypatch):
    """The lean Scan's Reshape of X·W back to [T, B, k] keeps the 0 of an empty batch (allowzero), so it answers
    at batch 0 like the function body and the kernel (a Scan over no steps fails in onnxruntime, raw exports' too)."""
    attrs = SequenceAttrs("AUGRU", H, 0, 1)
    layers = [(True, False, ("Y", "Y_h")), (False, True, ("Y_h",))]
    g, weights = _model(attrs, layers)
    model = _lowered(g, form, monkeypatch)
    feeds = _feeds(0, T)
    _check(_run_apart(model, _used(model, feeds), tmp_path, form), _want(attrs, layers, weights, feeds))


# ------------------------------------------------------------------------------ lengths outside [0, T]

@pytest.mark.parametrize("form", FORMS)
def test_a_clamping_layer_answers_lengths_outside_the_history_in_every_form(form, monkeypatch):
    """A layer read from a Scan/Loop's masking (t < length decides) takes any length, in every form: the GRU op
    forms clamp the lengths into [0, T] first (the GRU op itself rejects them)."""
    attrs = SequenceAttrs("GRU", H, 0)
    g, weights = _model(attrs)
    model = _lowered(g, form, monkeypatch)
    for lens in (OUTSIDE, INSIDE):
        feeds = _feeds(Bn, T, lens)
        _check(Runner(model, threads=1).run(_used(model, feeds)), _want(attrs, LAYERS, weights, feeds))


@pytest.mark.parametrize("form", FORMS)
def test_a_checked_layer_raises_on_lengths_outside_the_history_in_every_form(form, monkeypatch):
    """A layer read from an ONNX GRU op (lengths_checked=1) raises on a length above T or below 0, as the GRU op
    does, in every form (ctropt's kernel included: check_lengths), and answers lengths in [0, T]."""
    attrs = SequenceAttrs("GRU", H, 0, lengths_checked=1)
    assert SequenceAttrs.of(gs.Node("GRUSequence", attrs=attrs.as_node_attrs())) == attrs
    g, weights = _model(attrs)
    model = _lowered(g, form, monkeypatch)
    runner = Runner(model, threads=1)
    for bad in (T + 1, -1):
        lens = INSIDE.copy()
        lens[2] = bad
        with pytest.raises(Exception, match="sequence_lens"):
            runner.run(_used(model, _feeds(Bn, T, lens)))
        with pytest.raises(ValueError, match="sequence_lens"):
            _want(attrs, LAYERS, weights, _feeds(Bn, T, lens))
    feeds = _feeds(Bn, T, INSIDE)
    _check(runner.run(_used(model, feeds)), _want(attrs, LAYERS, weights, feeds))


def test_clamping_layers_keep_their_node_attributes():
    """lengths_checked is written only where set: clamping layers' nodes and function variants stay as they were."""
    assert "lengths_checked" not in SequenceAttrs("GRU", H).as_node_attrs()
    assert SequenceAttrs("GRU", H, lengths_checked=1).as_node_attrs()["lengths_checked"] == 1


# ------------------------------------------------------------------------------ end to end, per dialect

VARIANTS = {"default": dict(target="ort"), "no_kernels": dict(target="ort", options={"ort_kernels": "off"}),
            "openvino": dict(target="openvino")}


def _optimized(raw: onnx.ModelProto, variant: str) -> onnx.ModelProto:
    result = ctropt.optimize(raw, "all", speed=False, **VARIANTS[variant])
    hist = ctropt.graph.op_histogram(result.model)
    assert ("GRUScan" if variant == "default" else "GRU") in {k.split("::")[-1] for k in hist}, hist  # fused, lowered
    return result.model


def _outcome(model, feeds):
    try:
        return Runner(model, threads=1).run(feeds)
    except Exception as e:  # noqa: BLE001
        return e


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_an_optimized_gru_op_export_rejects_the_lengths_the_gru_op_rejected(variant):
    """torch nn.GRU / tf2onnx's GRU op with sequence_lens: lengths above T or below 0 raise in the raw export and
    in every optimized form of it (GRUScan was answering them); lengths in [0, T] give the same answers."""
    from tests.test_rnn_unrolled import gru_op_feeds, gru_op_model

    raw = gru_op_model(0, lens=True, h0=False, T=5)
    opt = _optimized(raw, variant)
    feeds = gru_op_feeds(raw, T=5)
    for bad in (5 + 1, -1):
        changed = dict(feeds, lens=feeds["lens"].copy())
        changed["lens"][0] = bad
        assert isinstance(_outcome(raw, changed), Exception)
        got = _outcome(opt, changed)
        assert isinstance(got, Exception) and "sequence_lens" in str(got), got
    _check(Runner(opt, threads=1).run(feeds), Runner(raw, threads=1).run(feeds))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_an_optimized_scan_export_answers_as_the_raw_one(variant, tmp_path):
    """A dynamic_rnn Scan (t < seq_len masking): lengths above T and below 0 answer, clamped, as in the raw
    export, and so does an empty batch (the GRU op forms used to abort the process there)."""
    from tests.test_rnn_loops import T as steps, hand_feeds, scan_model

    raw = scan_model("zero", "int64", "zeros")
    opt = _optimized(raw, variant)
    feeds = hand_feeds(raw, lengths=(0, steps + 1, -1, 3, steps + 5, 1, -3))
    _check(Runner(opt, threads=1).run(feeds), Runner(raw, threads=1).run(feeds))
    empty = {k: v[:0] for k, v in feeds.items()}
    _check(_run_apart(opt, empty, tmp_path, f"{variant}-batch0"), Runner(raw, threads=1).run(empty))
