"""split-strings: the string zoo models cut where their strings become numbers; the id model (no string op, loads in
OpenVINO) fed by the front (the model's own string ops) gives the model's outputs exactly."""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest
from typer.testing import CliRunner

from ctropt.cli import app
from ctropt.exporters import zoo
from ctropt.graph import CtroptError
from ctropt.runtime import Runner, generate_inputs, strings
from ctropt.string_front import StringFront, split_strings, verify_split
from helpers import F, make_model, node, vi

pytestmark = pytest.mark.skipif(not strings.available(), reason=f"{strings.PACKAGE} not installed: "
                                f"{strings.INSTALL_HINT}")
runner = CliRunner()


def shipped(name: str):
    return zoo.shipped_path(name)


def dims(vi_: onnx.ValueInfoProto) -> list:
    return [d.dim_param or d.dim_value for d in vi_.type.tensor_type.shape.dim]


@pytest.mark.parametrize("name", ["wdl_strings", "din_strings"])
def test_split_is_exact_and_the_id_model_loads_in_openvino(name, tmp_path):
    model = onnx.load(shipped(name))
    ids, front = split_strings(model)
    assert not any(i.type.tensor_type.elem_type == onnx.TensorProto.STRING for i in ids.graph.input)
    assert not any(n.domain == strings.DOMAIN for n in ids.graph.node) and not strings.uses_strings(ids)
    assert strings.uses_strings(front.model)
    assert [o.name for o in ids.graph.output] == [o.name for o in model.graph.output]
    hashed = [i for i in ids.graph.input if i.type.tensor_type.elem_type == onnx.TensorProto.INT64]
    assert any(dims(i) == ["batch"] for i in hashed)   # a column hashed per row keeps the batch dim
    assert verify_split(model, ids, front) == 0.0
    assert verify_split(model, ids, front, "openvino-cpu") < 1e-6
    front.save(tmp_path / "front.onnx")
    again = StringFront.load(tmp_path / "front.onnx")
    feeds = generate_inputs(model, batch=6, seq_len=9, seed=4)
    a, b = front.ids(feeds), again.ids(feeds)
    assert sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)


def test_din_history_dims_keep_their_names():
    ids, _ = split_strings(onnx.load(shipped("din_strings")))
    assert {tuple(dims(i)) for i in ids.graph.input if len(dims(i)) == 2} == {("batch", "seq_len")}


def test_a_model_without_strings_is_a_clear_error(tmp_path):
    plain = make_model([node("Relu", ["x"], ["y"])], [vi("x", F, ["B", 4])], [vi("y", F, ["B", 4])])
    with pytest.raises(CtroptError, match="no string input"):
        split_strings(plain)
    onnx.save(onnx.ModelProto(), tmp_path / "not_front.onnx")
    with pytest.raises(CtroptError, match="not a string front"):
        StringFront.load(tmp_path / "not_front.onnx")


def test_cli_split_then_verify_through_the_front_on_openvino(tmp_path):
    out = tmp_path / "wdl.ids.onnx"
    r = runner.invoke(app, ["split-strings", str(shipped("wdl_strings")), "-o", str(out), "--batch", "32"])
    text = " ".join(r.output.split())
    assert r.exit_code == 0, r.output
    assert "verified together, max err 0.0e+00" in text and "OpenVINO CPU: the id model loads and matches" in text
    front, sample = tmp_path / "wdl.ids.front.onnx", tmp_path / "wdl.ids.inputs.npz"
    assert front.is_file() and sample.is_file()
    with np.load(sample) as z:
        assert sorted(z.files) == sorted(i.name for i in onnx.load(out).graph.input)
        assert len(z["dense"]) == 32
    r = runner.invoke(app, ["verify", str(shipped("wdl_strings")), str(out), "--strings", str(front),
                            "--backend", "openvino-cpu"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["verify", str(shipped("wdl_strings")), str(out)])
    assert r.exit_code == 2 and "different inputs" in r.output


def test_id_model_optimizes_for_openvino_on_the_sample_inputs(tmp_path):
    model = onnx.load(shipped("din_strings"))
    ids, front = split_strings(model)
    import ctropt

    feeds = front.ids(generate_inputs(model, batch=64, seed=1))
    result = ctropt.optimize(ids, target="openvino", feeds=feeds,
                             speed=ctropt.passes.speed.SpeedCheck(batch=64, seconds=0.3, feeds=feeds))
    Runner(result.model, "openvino-cpu").run(feeds)   # loads: a fusion that broke loading was left out
    want, got = Runner(model).run(generate_inputs(model, batch=64, seed=1)), Runner(result.model).run(feeds)
    assert all(np.abs(want[k] - got[k]).max() < 1e-5 for k in want)


@pytest.mark.parametrize("name", ["wdl_strings", "din_strings"])
def test_repository_of_a_string_model_names_both_libraries_and_serves_ids_on_openvino(tmp_path, name):
    """Triton: the model as it is, with onnxruntime-extensions (and ctropt's kernels where used) registered as the
    onnxruntime backend does; OVMS: the id model, with the front beside config.json for the clients."""
    import onnxruntime as ort
    from google.protobuf import text_format

    model_config_pb2 = pytest.importorskip("tritonclient.grpc.model_config_pb2")
    r = runner.invoke(app, ["repository", str(shipped(name)), "-o", str(tmp_path), "--name", "wdl"],
                      catch_exceptions=False)
    assert r.exit_code == 0, r.output
    folder = tmp_path / "triton" / "wdl"
    config = text_format.Parse((folder / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    libraries = list(config.model_operations.op_library_filename)
    assert any("_extensions_pydll" in lib for lib in libraries) and all(os.path.exists(lib) for lib in libraries)
    so = ort.SessionOptions()
    for lib in libraries:
        so.register_custom_ops_library(lib)
    sess = ort.InferenceSession(str(folder / "1" / "model.onnx"), so, providers=["CPUExecutionProvider"])
    raw = onnx.load(shipped(name))
    feeds = generate_inputs(raw, batch=5, seed=8)
    want = Runner(raw).run(feeds)
    got = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    front = StringFront.load(tmp_path / "ovms" / "wdl.front.onnx")
    served = Runner(onnx.load(tmp_path / "ovms" / "wdl" / "1" / "model.onnx"), "openvino-cpu").run(front.ids(feeds))
    for k in want:
        assert np.abs(got[k] - want[k]).max() < 1e-5 and np.abs(served[k] - want[k]).max() < 1e-5
