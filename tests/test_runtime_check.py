"""A model another target made, handed to a runtime that cannot run its ops: every command refuses it in one line
(issue 47), before OpenVINO sees it (its compile has ended in a segmentation fault on such a model)."""

import os
import subprocess
import sys

import numpy as np
import onnx
import pytest
from typer.testing import CliRunner

import ctropt
from ctropt import kernels
from ctropt.cli import app
from ctropt.graph import CtroptError, save
from ctropt.runtime.runnable import OPENVINO_CONTRIB, check_runnable
from helpers import F, I64, init, make_model, node, vi

KERNEL_OPS = "(DotSum, GatherRows, SumAxes)"


def _raw():
    rng = np.random.default_rng(0)
    return make_model(
        [node("Gather", ["table", "ids"], ["e"]), node("ReduceSum", ["e", "ax"], ["s"], keepdims=0),
         node("MatMul", ["s", "w"], ["y"])],
        [vi("ids", I64, ["B", 3])], [vi("y", F, ["B", 1])],
        [init("table", rng.standard_normal((20, 4)).astype(np.float32)), init("ax", np.array([1])),
         init("w", rng.standard_normal((4, 1)).astype(np.float32))])


@pytest.fixture(scope="module")
def ort_model(tmp_path_factory):
    """The raw model and its ort-target result (ctropt's kernels in it), as files."""
    if kernels.ensure():
        pytest.skip(f"ctropt's kernel library cannot be built here: {kernels.ensure()}")
    folder = tmp_path_factory.mktemp("check")
    raw = save(_raw(), folder / "m.onnx")
    result = ctropt.optimize(_raw(), speed=False)
    assert {n.domain for n in result.model.graph.node} >= {kernels.DOMAIN}
    return raw, save(result.model, folder / "m.opt.onnx")


def _commands(raw, opt, out):
    return {
        "bench": ["bench", opt, "--backend", "openvino-cpu", "--batch", "1", "--seconds", "0.1"],
        "verify": ["verify", raw, opt, "--backend", "openvino-cpu"],
        "inspect": ["inspect", opt, "--target", "openvino"],
        "specialize": ["specialize", opt, "-o", out / "buckets", "--batch", "1,4", "--target", "openvino"],
        "repository": ["repository", opt, "-o", out / "repo", "--name", "m", "--batch", "1,4"],
        "optimize": ["optimize", opt, "-o", out / "again.onnx", "--target", "openvino", "--no-speed-check"],
    }


@pytest.mark.parametrize("command", ["bench", "verify", "inspect", "specialize", "repository", "optimize"])
def test_an_ort_target_model_on_openvino_is_one_error_line(ort_model, tmp_path, command):
    """In a subprocess: the old behaviour handed the model to OpenVINO, which may crash the process."""
    raw, opt = ort_model
    args = [str(a) for a in _commands(raw, opt, tmp_path)[command]]
    done = subprocess.run([sys.executable, "-m", "ctropt", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "COLUMNS": "300"})
    line = done.stderr.strip()
    assert done.returncode == 2, (done.returncode, done.stdout[-2000:], line)
    assert "\n" not in line and "Traceback" not in line, line
    assert line.startswith(f"error: m.opt.onnx holds ctropt's onnxruntime kernels {KERNEL_OPS} that OpenVINO "
                           "cannot run: "), line
    assert "--target openvino" in line or "original model" in line, line
    assert not (tmp_path / "buckets").exists() and not (tmp_path / "repo").exists()


def test_ort_backend_without_the_kernel_library_names_the_ops(ort_model, monkeypatch):
    monkeypatch.setattr(kernels, "ensure", lambda: "gcc not found")
    result = CliRunner().invoke(app, ["bench", str(ort_model[1]), "--batch", "1", "--seconds", "0.1"])
    assert result.exit_code == 2, result.output
    assert (f"m.opt.onnx holds ctropt's onnxruntime kernels {KERNEL_OPS} and ctropt's kernel library cannot be "
            "built here: gcc not found;") in " ".join(result.output.split()), result.output
    assert "--option ort_kernels=off" in " ".join(result.output.split())


def test_ort_openvino_runs_the_kernels_on_the_cpu_provider(ort_model):
    """onnxruntime's OpenVINO EP leaves the nodes it cannot take to the CPU provider: nothing to refuse."""
    check_runnable(onnx.load(ort_model[1]), "ort-openvino")


def _one_op(domain, op):
    model = onnx.helper.make_model(
        onnx.helper.make_graph([onnx.helper.make_node(op, ["a", "b", "c"], ["y"], domain=domain)], "g",
                               [onnx.helper.make_tensor_value_info(x, F, [2, 3]) for x in "abc"],
                               [onnx.helper.make_tensor_value_info("y", F, None)]),
        opset_imports=[onnx.helper.make_opsetid("", 17), onnx.helper.make_opsetid(domain, 1)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize("domain, op, refused", [
    ("com.microsoft", "QGemm", "com.microsoft contrib ops (QGemm)"),
    ("com.microsoft", "FusedGemm", None),
    ("ai.ctropt", "GRUSequence", "ctropt's fused ops (GRUSequence)"),
    ("ai.onnx.contrib", "StringSplit", "string ops (StringSplit)"),
    (kernels.DOMAIN, "GatherFields", "ctropt's onnxruntime kernels (GatherFields)"),
])
def test_openvino_refuses_each_domain_it_cannot_convert(domain, op, refused):
    if refused is None:
        check_runnable(_one_op(domain, op), "openvino-cpu")
        return
    with pytest.raises(CtroptError, match=rf"^x\.onnx holds .*{refused.replace('(', r'.').replace(')', r'.')}"):
        check_runnable(_one_op(domain, op), "openvino-cpu", "x.onnx")


def test_the_contrib_list_is_what_openvino_converts():
    """Each listed com.microsoft op has a conversion rule in the installed OpenVINO; a few others have none."""
    ov = pytest.importorskip("openvino")
    core = ov.Core()

    def has_rule(op):
        try:
            core.read_model(_one_op("com.microsoft", op).SerializeToString(), b"")
            return True
        except Exception as e:  # a converter that refuses these dummy inputs still has a rule
            return "No conversion rule" not in str(e)

    assert [op for op in sorted(OPENVINO_CONTRIB) if not has_rule(op)] == []
    assert [op for op in ("QGemm", "Unique", "ExpandDims", "QAttention") if has_rule(op)] == []
