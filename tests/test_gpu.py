"""--device cuda, --precision f16 (convert-float16) and the GPU backends: everything a CPU can check, and the GPU
checks themselves where onnxruntime has its CUDA provider (they skip with the reason elsewhere)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from typer.testing import CliRunner

import ctropt
from ctropt.cli import app
from ctropt.graph import CtroptError, save
from ctropt.passes import PassManager, resolve
from ctropt.runtime import Runner, compare_outputs, generate_inputs
from ctropt.runtime.session import available_backends
from helpers import F, init, make_model, node, run_pass, vi

runner = CliRunner()
ZOO = Path(ctropt.__file__).parent / "exporters/zoo/data"
NO_CUDA = available_backends()["ort-cuda"] != "available"


def mlp(seed: int = 0) -> onnx.ModelProto:
    """An FC head as exporters write it: MatMul/Add/Relu, then a width-1 layer and a Sigmoid."""
    rng = np.random.default_rng(seed)
    w1, w2 = rng.normal(0, 0.3, (16, 32)).astype(np.float32), rng.normal(0, 0.3, (32, 1)).astype(np.float32)
    nodes = [node("MatMul", ["x", "w1"], ["h"]), node("Add", ["h", "b1"], ["hb"]), node("Relu", ["hb"], ["r"]),
             node("MatMul", ["r", "w2"], ["logit"]), node("Sigmoid", ["logit"], ["prob"])]
    return make_model(nodes, [vi("x", F, ["batch", 16])], [vi("prob", F, ["batch", 1])],
                      [init("w1", w1), init("b1", np.full(32, 0.1, np.float32)), init("w2", w2)])


def test_float16_pass_keeps_the_interface_within_the_gate():
    model = mlp()
    once, ctx = run_pass(model, "convert-float16")
    halves = [t.name for t in once.graph.initializer if t.data_type == onnx.TensorProto.FLOAT16]
    assert sorted(halves) == ["b1", "w1", "w2"]
    assert [(i.name, i.type.tensor_type.elem_type) for i in once.graph.input] == [("x", F)]
    assert [(o.name, o.type.tensor_type.elem_type) for o in once.graph.output] == [("prob", F)]
    feeds = generate_inputs(model, batch=64, seed=5)
    a, b = Runner(model).run(feeds)["prob"], Runner(once).run(feeds)["prob"]
    assert b.dtype == np.float32 and 0 < np.abs(a - b).max() < 5e-3
    assert any("max abs err" in n for n in ctx.notes), ctx.notes
    twice, ctx2 = run_pass(once, "convert-float16")
    assert ctx2.rewrites == 0 and "already computes in FP16" in " ".join(ctx2.notes)


def test_float16_gate_keeps_fp32_when_the_worst_row_is_off():
    once, ctx = run_pass(mlp(), "convert-float16", fp16_max_abs=1e-9)
    assert ctx.rewrites == 0 and all(t.data_type == F for t in once.graph.initializer)
    assert "breaks the accuracy gate" in " ".join(ctx.notes) and "stays FP32" in ctx.notes[-1]


def test_device_cuda_emits_standard_ops_only():
    raw = ctropt.load(ZOO / "din_torch.onnx")
    cpu = PassManager("all", speed=None).run(raw).model
    cuda = PassManager("all", speed=None, device="cuda").run(raw).model
    domains = lambda m: {n.domain for n in m.graph.node}  # noqa: E731
    assert "ai.ctropt.kernels" in domains(cpu)
    assert domains(cuda) <= {"", "ai.onnx"}
    feeds = generate_inputs(raw, batch=32, seed=3)
    assert all(d.ok for d in compare_outputs(Runner(raw).run(feeds), Runner(cuda).run(feeds)))


def test_device_rules():
    with pytest.raises(CtroptError, match="quantize-int8 is for --device cpu"):
        resolve("quantize-int8", device="cuda")
    with pytest.raises(CtroptError, match="convert-float16 is for --device cuda"):
        resolve("convert-float16")
    with pytest.raises(CtroptError, match="unknown device"):
        resolve("all", device="tpu")
    with pytest.raises(CtroptError, match="for --target ort"):
        resolve("all", target="openvino", device="cuda")
    with pytest.raises(CtroptError, match="kernels are CPU code"):
        PassManager("all", device="cuda", options={"ort_kernels": "auto"})
    assert "convert-float16" not in [p.name for p in resolve("all", device="cuda")]   # opt-in


def test_ort_backends_refuse_a_precision_they_do_not_run():
    with pytest.raises(CtroptError, match="runs the model's own types"):
        Runner(mlp(), "ort-cpu", precision="f16")


@pytest.mark.parametrize("args, message", [
    (["--precision", "f16"], "--precision f16 is for --device cuda"),
    (["--device", "tpu"], "--device must be one of cpu, cuda"),
    (["--device", "cuda", "--int8"], "--int8 is for --device cpu"),
    (["--precision", "f8"], "--precision must be one of f32, f16, int8, auto, bf16"),
])
def test_cli_device_errors(tmp_path, args, message):
    path = tmp_path / "mlp.onnx"
    save(mlp(), path)
    r = runner.invoke(app, ["optimize", str(path), *args])
    assert r.exit_code == 2 and message in " ".join(r.output.split()), r.output


def test_cli_device_cuda_without_a_gpu(tmp_path):
    if not NO_CUDA:
        pytest.skip("this machine has the CUDA provider: the GPU test below covers it")
    path = tmp_path / "mlp.onnx"
    save(mlp(), path)
    r = runner.invoke(app, ["optimize", str(path), "--device", "cuda", "--precision", "f16", "-o",
                            str(tmp_path / "out.onnx")])
    text = " ".join(r.output.split())
    assert r.exit_code == 0, r.output
    assert "speed check off" in text and "target ort on cuda" in text and "checked on onnxruntime's CPU" in text
    out = onnx.load(tmp_path / "out.onnx")
    assert any(t.data_type == onnx.TensorProto.FLOAT16 for t in out.graph.initializer)


@pytest.mark.parametrize("backend", ["ort-cuda", "ort-trt"])
def test_cli_gpu_backend_missing_is_a_clear_error(tmp_path, backend):
    if available_backends()[backend] == "available":
        pytest.skip(f"{backend} is available here")
    path = tmp_path / "mlp.onnx"
    save(mlp(), path)
    r = runner.invoke(app, ["bench", str(path), "--backend", backend, "--batch", "4", "--seconds", "0.1"])
    assert r.exit_code == 2 and f"backend {backend} is not available" in r.output, r.output


def test_tensorrt_listed_without_its_library_is_not_available(monkeypatch):
    """onnxruntime-gpu lists TensorRT wherever the wheel has its provider; without libnvinfer a session would fall
    back to CUDA with a banner, so ctropt calls it not available (seen on the H100 machine)."""
    import onnxruntime as ort

    from ctropt.runtime import session

    monkeypatch.setattr(ort, "get_available_providers",
                        lambda: ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"])
    monkeypatch.setattr(session, "_tensorrt_loads", lambda: False)
    status = available_backends()
    assert status["ort-cuda"] == "available"
    assert status["ort-trt"].startswith("not available: onnxruntime-gpu has the provider, but TensorRT's libnvinfer")


@pytest.mark.skipif(NO_CUDA, reason="onnxruntime has no CUDA provider here (onnxruntime-gpu and an NVIDIA GPU)")
def test_gpu_runs_the_zoo_like_the_cpu_and_times_passes_there():
    raw = ctropt.load(ZOO / "wdl_tf.onnx")
    result = PassManager("all,convert-float16", device="cuda", speed=True).run(raw)
    assert "ort-cuda" in result.speed_note or result.speed is not None
    feeds = generate_inputs(raw, batch=256, seed=4)
    truth = Runner(raw).run(feeds)
    assert all(d.ok for d in compare_outputs(truth, Runner(raw, "ort-cuda").run(feeds), atol=1e-5, rtol=1e-4))
    half = Runner(result.model, "ort-cuda").run(feeds)
    assert max(float(np.abs(truth[k] - half[k]).max()) for k in truth) < 5e-3


def test_float16_on_a_model_with_a_scan_body_sharing_constants():
    """A graphsurgeon round trip writes a constant shared by a Scan body and its graph into both; onnxruntime's
    converter refuses the repeat, so the pass drops it first (zoo DIEN-TF failed on the H100 run)."""
    raw = ctropt.load(ZOO / "dien_tf.onnx")
    opt = PassManager("all", speed=None, device="cuda").run(raw).model
    result = PassManager("convert-float16", speed=None, device="cuda").run(opt)
    (rec,) = result.records
    assert rec.status == "applied", (rec.status, rec.message, rec.notes)
    assert any(t.data_type == onnx.TensorProto.FLOAT16 for t in result.model.graph.initializer)
    again = PassManager("convert-float16", speed=None, device="cuda").run(result.model)
    assert again.records[0].status == "unchanged" and "already" in again.records[0].notes[0]
