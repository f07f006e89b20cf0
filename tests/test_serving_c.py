"""Serving from C: examples/c/serve.c, compiled with gcc against the onnxruntime shared library inside the
onnxruntime wheel and the C API header ctropt ships, runs the optimized zoo DIEN with ctropt's kernel library and
answers as ctropt's Python session does (and as the raw export does). The README's C snippet is part of that file."""

import re
import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest

import ctropt
from ctropt import kernels
from ctropt.graph import load, save
from ctropt.runtime import Runner, generate_inputs

ROOT = Path(__file__).parent
SERVE_C = ROOT.parent / "examples" / "c" / "serve.c"
ZOO = ROOT.parent / "ctropt" / "exporters" / "zoo" / "data"
README = ROOT.parent / "README.md"

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc")


def _write(path: Path, feeds: dict) -> None:
    with path.open("wb") as f:
        f.write(struct.pack("<I", len(feeds)))
        for name, value in feeds.items():
            value = np.ascontiguousarray(value)
            raw = name.encode()
            f.write(struct.pack("<I", len(raw)) + raw)
            f.write(struct.pack("<iI", onnx.helper.np_dtype_to_tensor_dtype(value.dtype), value.ndim))
            f.write(struct.pack(f"<{value.ndim}q", *value.shape) + value.tobytes())


def _read(path: Path) -> dict:
    data, at, out = path.read_bytes(), 4, {}
    for _ in range(struct.unpack_from("<I", data)[0]):
        (length,) = struct.unpack_from("<I", data, at)
        name = data[at + 4:at + 4 + length].decode()
        at += 4 + length
        elem, rank = struct.unpack_from("<iI", data, at)
        dims = struct.unpack_from(f"<{rank}q", data, at + 8)
        at += 8 + 8 * rank
        dtype = onnx.helper.tensor_dtype_to_np_dtype(elem)
        count = int(np.prod(dims)) if rank else 1
        out[name] = np.frombuffer(data, dtype, count, at).reshape(dims)
        at += count * dtype.itemsize
    return out


@pytest.fixture(scope="module")
def serve(tmp_path_factory) -> Path:
    """serve.c built against the wheel's libonnxruntime.so.* and ctropt's shipped header. The wheel's file is
    named by its full version and its soname is libonnxruntime.so.1: a folder with that link stands for an
    onnxruntime release's lib/ folder."""
    (library,) = (Path(onnxruntime.__file__).parent / "capi").glob("libonnxruntime.so.*")
    folder = tmp_path_factory.mktemp("serve_c")
    (folder / "libonnxruntime.so.1").symlink_to(library)
    binary = folder / "serve"
    subprocess.run(["gcc", "-O2", "-Wall", "-Werror", f"-I{kernels.SHIPPED_HEADER_DIR}", str(SERVE_C), "-o",
                    str(binary), f"-L{folder}", "-l:libonnxruntime.so.1", f"-Wl,-rpath,{folder}"], check=True)
    return binary


def test_c_serving_answers_as_python_does(serve, tmp_path):
    if not kernels.available():
        pytest.skip("ctropt's kernel library is not built")
    raw = load(ZOO / "dien_tf.onnx")
    optimized = ctropt.optimize(raw, passes="all", speed=False).model
    assert kernels.uses_kernels(optimized)
    save(optimized, tmp_path / "dien.opt.onnx")
    for batch in (1, 33):
        feeds = generate_inputs(raw, batch=batch, seed=batch)
        _write(tmp_path / "in.bin", feeds)
        subprocess.run([str(serve), str(tmp_path / "dien.opt.onnx"), str(kernels.library_path()),
                        str(tmp_path / "in.bin"), str(tmp_path / "out.bin")], check=True, timeout=120)
        got = _read(tmp_path / "out.bin")
        python = Runner(optimized).run(feeds)
        assert set(got) == set(python)
        for name in python:
            np.testing.assert_array_equal(got[name], python[name])   # one library, one thread: the same bits
            np.testing.assert_allclose(got[name], Runner(raw).run(feeds)[name], rtol=1e-4, atol=1e-5)


def test_c_serving_says_what_is_missing_without_the_library(serve, tmp_path):
    raw = load(ZOO / "dien_tf.onnx")
    optimized = ctropt.optimize(raw, passes="all", speed=False).model
    save(optimized, tmp_path / "dien.opt.onnx")
    _write(tmp_path / "in.bin", generate_inputs(raw, batch=2))
    run = subprocess.run([str(serve), str(tmp_path / "dien.opt.onnx"), str(tmp_path / "no_such_library.so"),
                          str(tmp_path / "in.bin"), str(tmp_path / "out.bin")], capture_output=True, text=True)
    assert run.returncode == 1 and "no_such_library.so" in run.stderr


def test_the_readme_c_snippet_is_the_tested_program():
    text = README.read_text()
    blocks = re.findall(r"```c\n(.*?)```", text, re.S)
    assert blocks, "the README's serving section has no C snippet"
    source = SERVE_C.read_text()
    for line in (line.strip() for block in blocks for line in block.splitlines()):
        if line and not line.startswith(("/*", "*", "//", "...")):
            assert line in source, f"README C line not in examples/c/serve.c: {line}"
