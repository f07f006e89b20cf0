"""A real Triton server serves the repository `ctropt repository` writes, after it was moved.

The server is tritonserver 2.51 from the nvidia-pytriton wheel (CPU, Python backend included), unpacked, never
installed (it pins numpy < 2). Triton's onnxruntime backend is not on the package registries, so `backend:
"onnxruntime"` runs tests/data/triton_backend/onnxruntime/model.py, a Python-based backend of that name that does
what the real one does with the repository: loads `<model>/1/model.onnx` in onnxruntime and registers each
`op_library_filename` as written (dlopen). The backend's stub is built against numpy 1 (a numpy 2 array reaches it
with no bytes): its onnxruntime and numpy come from one of CTROPT_OLD_ORT_PYTHON's interpreters (.ci/run makes
onnxruntime 1.20.1 with numpy < 2; Triton 2.51's own onnxruntime backend ships onnxruntime 1.19). What this proves: the real server's parsing of ctropt's config.pbtxt, the
repository layout, dynamic batching over the declared dims, and the library paths resolving where the repository
was moved to (--library-dir). Set CTROPT_TRITON_WHEEL to the wheel (.ci/run downloads it); CTROPT_TRITON_TESTS=
required makes a missing wheel a failure. The server binds 127.0.0.1 only and is stopped by its PID."""

import os
import shutil
import shlex
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.request
import zipfile
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from ctropt import kernels
from ctropt.cli import app
from ctropt.graph import load
from ctropt.runtime import Runner, generate_inputs

ROOT = Path(__file__).parent
ZOO = ROOT.parent / "ctropt" / "exporters" / "zoo" / "data"
BACKEND = ROOT / "data" / "triton_backend" / "onnxruntime" / "model.py"
README = ROOT.parent / "README.md"
READY_S = 90


def _wheel() -> Path:
    path = os.environ.get("CTROPT_TRITON_WHEEL")
    if path and Path(path).is_file():
        return Path(path)
    if os.environ.get("CTROPT_TRITON_TESTS") == "required":
        pytest.fail(f"CTROPT_TRITON_TESTS=required but CTROPT_TRITON_WHEEL ({path}) is not the nvidia-pytriton wheel")
    pytest.skip("set CTROPT_TRITON_WHEEL to an nvidia-pytriton wheel (pip download --no-deps nvidia-pytriton==0.7.0)")


def _stub_site() -> str:
    """site-packages with onnxruntime and numpy < 2 for the stub: the newest onnxruntime of CTROPT_OLD_ORT_PYTHON."""
    found = []
    for python in filter(None, os.environ.get("CTROPT_OLD_ORT_PYTHON", "").split(os.pathsep)):
        out = subprocess.run([python, "-c", "import numpy, onnxruntime, sysconfig; print(onnxruntime.__version__, "
                              "numpy.__version__, sysconfig.get_paths()['purelib'])"], capture_output=True, text=True)
        if out.returncode == 0:
            ort_version, np_version, site = out.stdout.split()
            if int(np_version.split(".")[0]) < 2:
                found.append((tuple(int(x) for x in ort_version.split(".")[:2]), site))
    if found:
        return max(found)[1]
    if os.environ.get("CTROPT_TRITON_TESTS") == "required":
        pytest.fail("CTROPT_TRITON_TESTS=required but no CTROPT_OLD_ORT_PYTHON interpreter has onnxruntime and numpy<2")
    pytest.skip("CTROPT_OLD_ORT_PYTHON names no interpreter with onnxruntime and numpy < 2 (for the backend's stub)")


@pytest.fixture(scope="module")
def server_files(tmp_path_factory) -> tuple[Path, Path, str]:
    """(tritonserver, a backend directory: the Python backend with this interpreter's stub, and `onnxruntime`;
    the site-packages the stub imports onnxruntime from)."""
    if not kernels.available():
        pytest.skip("ctropt's kernel library is not built")
    site = _stub_site()
    root = tmp_path_factory.mktemp("pytriton")
    with zipfile.ZipFile(_wheel()) as wheel:
        wheel.extractall(root, [n for n in wheel.namelist() if n.startswith(("pytriton/tritonserver/",
                                                                               "nvidia_pytriton.libs/"))])
    server = root / "pytriton" / "tritonserver"
    backends = root / "backends"
    shutil.copytree(server / "backends" / "python", backends / "python")
    stub = server / "python_backend_stubs" / f"{sys.version_info.major}.{sys.version_info.minor}" / \
        "triton_python_backend_stub"
    shutil.copy(stub, backends / "python" / "triton_python_backend_stub")
    (backends / "onnxruntime").mkdir()
    shutil.copy(BACKEND, backends / "onnxruntime" / "model.py")
    for f in [server / "bin" / "tritonserver", backends / "python" / "triton_python_backend_stub"]:
        f.chmod(0o755)
    return server / "bin" / "tritonserver", backends, site


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(tritonserver: Path, backends: Path, site: str, repository: Path, port: int, log: Path) -> subprocess.Popen:
    env = dict(os.environ)
    # the Python backend's stub embeds this interpreter's libpython (and the wheel's libraries, which its RPATH finds
    # only from where the wheel keeps it) and imports numpy and onnxruntime from `site`
    libs = tritonserver.parents[3] / "nvidia_pytriton.libs"
    env["LD_LIBRARY_PATH"] = ":".join(filter(None, [sysconfig.get_config_var("LIBDIR"), str(libs),
                                                    env.get("LD_LIBRARY_PATH")]))
    env["PYTHONPATH"] = site
    cmd = [str(tritonserver), f"--model-repository={repository}", f"--backend-directory={backends}",
           "--http-address=127.0.0.1", f"--http-port={port}", "--allow-grpc=false", "--allow-metrics=false",
           "--exit-on-error=true", "--log-verbose=0"]
    return subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)


def _wait_ready(proc: subprocess.Popen, port: int, model: str, log: Path) -> None:
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        if proc.poll() is not None or "failed to load" in log.read_text():
            pytest.fail(f"tritonserver exited {proc.returncode} or the model failed:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/models/{model}/ready", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    pytest.fail(f"{model} not ready after {READY_S} s:\n{log.read_text()[-4000:]}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def _infer(port: int, model: str, feeds: dict) -> dict:
    import tritonclient.http as httpclient
    from tritonclient.utils import np_to_triton_dtype

    client = httpclient.InferenceServerClient(f"127.0.0.1:{port}", network_timeout=60.0)
    model_config = client.get_model_config(model)
    config = {i["name"]: i for i in model_config["input"]}
    inputs = []
    for name, value in feeds.items():
        if "reshape" in config[name]:   # a [batch] input: clients send [batch, 1] (its dims), the model gets [batch]
            value = value.reshape(len(value), *config[name]["dims"])
        entry = httpclient.InferInput(name, list(value.shape), np_to_triton_dtype(value.dtype))
        entry.set_data_from_numpy(value)
        inputs.append(entry)
    names = [o["name"] for o in model_config["output"]]
    result = client.infer(model, inputs, outputs=[httpclient.InferRequestedOutput(n, binary_data=True) for n in names])
    return {name: result.as_numpy(name) for name in names}


def _readme_command(written: Path, served: Path) -> list[str]:
    """The README's Triton snippet's `ctropt repository` command, its paths made this test's: dien.onnx the zoo
    DIEN, repo the folder written, /models the folder the server is given (`--model-repository=/models`)."""
    block = README.read_text().split("<!-- serving: triton -->")[1].split("```bash")[1].split("```")[0]
    assert "--model-repository=/models" in block and '"$PWD/repo/triton:/models"' in block
    words = shlex.split(block.splitlines()[1])
    assert words[:2] == ["ctropt", "repository"]
    swap = {"dien.onnx": str(ZOO / "dien_tf.onnx"), "repo": str(written)}
    return [swap.get(w, w.replace("/models", str(served), 1) if w.startswith("/models") else w) for w in words[1:]]


def test_triton_serves_a_moved_repository_with_the_kernels(server_files, tmp_path):
    tritonserver, backends, site = server_files
    served = tmp_path / "served" / "models"       # where the repository will live: the server's /models
    written = tmp_path / "written"
    r = CliRunner().invoke(app, _readme_command(written, served), catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert str(served / "dien" / "libctropt_kernels.so") in (written / "triton" / "dien" / "config.pbtxt").read_text()
    shutil.move(written / "triton", served)       # the repository moves; nothing of it stays where it was written
    assert not (written / "triton").exists()
    port, log = _free_port(), tmp_path / "tritonserver.log"
    proc = _start(tritonserver, backends, site, served, port, log)
    try:
        _wait_ready(proc, port, "dien", log)
        raw = load(ZOO / "dien_tf.onnx")
        optimized = load(served / "dien" / "1" / "model.onnx")
        assert kernels.uses_kernels(optimized)
        for batch in (1, 7, 64):
            feeds = generate_inputs(raw, batch=batch, seed=batch)
            want = Runner(raw).run(feeds)
            got = _infer(port, "dien", feeds)
            assert set(got) == set(want)
            for name in want:
                np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-5)
    finally:
        _stop(proc)
    assert proc.returncode is not None
