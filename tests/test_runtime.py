"""Backends (and their absence), and `ctropt bench` with paired ratios."""

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from ctropt.cli import app
from ctropt.graph import CtroptError, save
from ctropt.runtime import Runner, generate_inputs
from ctropt.runtime.bench import Latency, bench
from ctropt.runtime.session import available_backends
from helpers import F, init, make_model, node, vi

runner = CliRunner()


@pytest.fixture
def mlp_paths(tmp_path):
    """Two models of one interface: a 3-layer MLP and the same MLP with a redundant Identity chain."""
    rng = np.random.default_rng(0)
    ws = [init(f"w{i}", rng.standard_normal((64, 64)).astype(np.float32) / 8) for i in range(3)]
    nodes = [node("MatMul", ["x", "w0"], ["h0"]), node("Relu", ["h0"], ["r0"]), node("MatMul", ["r0", "w1"], ["h1"]),
             node("Relu", ["h1"], ["r1"]), node("MatMul", ["r1", "w2"], ["y"])]
    fast = make_model(nodes, [vi("x", F, ["B", 64])], [vi("y", F, ["B", 64])], ws)
    slow_nodes = list(nodes[:-1]) + [node("Identity", ["r1"], [f"i{k}"]) for k in range(1)]
    slow_nodes += [node("Identity", [f"i{k}"], [f"i{k + 1}"]) for k in range(50)]
    slow_nodes.append(node("MatMul", ["i50", "w2"], ["y"]))
    slow = make_model(slow_nodes, [vi("x", F, ["B", 64])], [vi("y", F, ["B", 64])], ws)
    return save(slow, tmp_path / "slow.onnx"), save(fast, tmp_path / "fast.onnx")


def test_cpu_backends_run_and_agree(mlp_paths):
    feeds = generate_inputs(__import__("onnx").load(mlp_paths[1]), batch=5)
    ort_out = Runner(str(mlp_paths[1]), "ort-cpu", threads=1).run(feeds)["y"]
    ov_out = Runner(str(mlp_paths[1]), "openvino-cpu", threads=1, precision="f32").run(feeds)["y"]
    assert np.allclose(ort_out, ov_out, atol=1e-4)


@pytest.mark.parametrize("backend", ["ort-cuda", "ort-openvino", "openvino-gpu"])
def test_absent_backends_say_so(mlp_paths, backend):
    if available_backends()[backend] == "available":
        pytest.skip(f"{backend} is present on this machine")
    with pytest.raises(CtroptError, match=f"{backend} is not available"):
        Runner(str(mlp_paths[1]), backend)
    result = runner.invoke(app, ["bench", str(mlp_paths[1]), "--backend", backend])
    assert result.exit_code == 2 and "not available" in result.output and "Traceback" not in result.output


def test_ort_openvino_through_its_plugin_package(mlp_paths):
    """onnxruntime's OpenVINO EP from onnxruntime-ep-openvino: registered as a plugin EP; where it claims this
    machine's CPU the models run there (and bench compares them), else the reason is the plugin's."""
    pytest.importorskip("onnxruntime_ep_openvino", reason="the plugin package is not installed")
    from ctropt.runtime.session import openvino_plugin_devices

    devices, why = openvino_plugin_devices()
    assert openvino_plugin_devices() == (devices, why)   # registered once: asking again is the same answer
    if not devices:
        assert "OpenVINO EP plugin" in why and available_backends()["ort-openvino"] == f"not available: {why}"
        pytest.skip(f"ort-openvino here: {why}")
    feeds = generate_inputs(__import__("onnx").load(mlp_paths[1]), batch=5)
    want = Runner(str(mlp_paths[1]), "ort-cpu").run(feeds)["y"]
    assert np.allclose(Runner(str(mlp_paths[1]), "ort-openvino").run(feeds)["y"], want, atol=1e-4)
    result = runner.invoke(app, ["bench", *map(str, mlp_paths), "--backend", "ort-openvino", "--batch", "4",
                                 "--seconds", "0.2"])
    assert result.exit_code == 0 and "time(A)/time(B)" in result.output, result.output


def test_unknown_backend_and_precision(mlp_paths):
    with pytest.raises(CtroptError, match="unknown backend"):
        Runner(str(mlp_paths[1]), "tpu")
    with pytest.raises(CtroptError, match="unknown precision"):
        Runner(str(mlp_paths[1]), "openvino-cpu", precision="int3")


def test_latency_percentiles():
    lat = Latency.of([0.001] * 90 + [0.002] * 10, batch=10)
    assert lat.runs == 100 and lat.p50_ms == pytest.approx(1.0) and lat.p99_ms == pytest.approx(2.0)
    assert lat.throughput == pytest.approx(10_000)


def test_paired_bench_interleaves_and_reports_a_ratio(mlp_paths):
    runners = [Runner(str(p), "ort-cpu", threads=1) for p in mlp_paths]
    feeds = generate_inputs(__import__("onnx").load(mlp_paths[0]), batch=8)
    result = bench(runners, feeds, 8, seconds=0.2, min_runs=20)
    assert all(lat.runs >= 20 for lat in result.latency) and result.latency[0].runs == result.latency[1].runs
    assert result.ratio_p10 <= result.ratio <= result.ratio_p90


def test_bench_cli_one_and_two_models(mlp_paths, tmp_path):
    one = runner.invoke(app, ["bench", str(mlp_paths[1]), "--batch", "1,4", "--seconds", "0.1", "--threads", "1"])
    assert one.exit_code == 0, one.output
    two = runner.invoke(app, ["bench", *map(str, mlp_paths), "--batch", "4", "--seconds", "0.2",
                              "--json", str(tmp_path / "b.json")])
    assert two.exit_code == 0, two.output
    assert "time(A)/time(B)" in two.output and "×" in two.output
    data = json.loads((tmp_path / "b.json").read_text())
    assert data["models"] == ["slow.onnx", "fast.onnx"] and data["results"][0]["ratio"] > 0


def test_openvino_runner_takes_a_feed_with_an_unused_input(tmp_path):
    """OpenVINO's in-memory reader drops inputs no node reads (DeepCTR DIN's seq_length); the full feed still works."""
    from helpers import I64

    model = make_model([node("Relu", ["x"], ["y"])], [vi("x", F, ["N", 2]), vi("unused", I64, ["N", 1])],
                       [vi("y", F, ["N", 2])])
    feeds = {"x": -np.ones((3, 2), np.float32), "unused": np.ones((3, 1), np.int64)}
    assert np.array_equal(Runner(model, "openvino-cpu").run(feeds)["y"], np.zeros((3, 2), np.float32))
