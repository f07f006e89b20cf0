"""ctropt's onnxruntime kernel library (``ai.ctropt.kernels`` ops), built from C on the machine that runs it.

``GRUScan`` (gru_sequence.c) runs a whole GRU-family layer, input projection included, in one kernel;
lower-rnn-ort emits it with ``--option rnn_ort_form=kernel``. A model that holds such a node needs the library registered in its
onnxruntime session: ctropt's own sessions do it, other code calls ``register(session_options)``.

The build needs gcc and onnxruntime's C API header ``onnxruntime_c_api.h`` from any release up to the installed
onnxruntime: the API is versioned, so a library built against an older header loads in newer onnxruntimes. It is looked
for in $ORT_INCLUDE_DIR, then /usr/include/onnxruntime and /usr/local/include/onnxruntime (Debian's
``libonnxruntime-dev``). ``tools/fetch_ort_headers.sh`` unpacks that package into a folder without installing it.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from ..graph import CtroptError, iter_proto_nodes

DOMAIN = "ai.ctropt.kernels"
SOURCE = Path(__file__).with_name("gru_sequence.c")
HEADER = "onnxruntime_c_api.h"


def library_path() -> Path:
    """Where the built library is (or goes): $CTROPT_KERNELS_DIR, else beside the source."""
    folder = Path(os.environ.get("CTROPT_KERNELS_DIR") or SOURCE.parent)
    return folder / "libctropt_kernels.so"


def available() -> bool:
    lib = library_path()
    return lib.exists() and lib.stat().st_mtime >= SOURCE.stat().st_mtime


def include_dir() -> Path | None:
    places = [os.environ.get("ORT_INCLUDE_DIR"), "/usr/include/onnxruntime", "/usr/local/include/onnxruntime"]
    return next((Path(p) for p in places if p and (Path(p) / HEADER).exists()), None)


def build(include: str | Path | None = None, compiler: str = "gcc") -> Path:
    """Compile the library for this machine's CPU (-march=native); returns its path."""
    inc = Path(include) if include else include_dir()
    if inc is None or not (inc / HEADER).exists():
        raise CtroptError(f"{HEADER} not found (looked in $ORT_INCLUDE_DIR, /usr/include/onnxruntime, "
                          "/usr/local/include/onnxruntime): install libonnxruntime-dev, or run "
                          "tools/fetch_ort_headers.sh DIR and set ORT_INCLUDE_DIR=DIR")
    out = library_path()
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [compiler, "-O3", "-march=native", "-shared", "-fPIC", "-Wall", f"-I{inc}", str(SOURCE), "-o", str(out)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
    except FileNotFoundError:
        raise CtroptError(f"{compiler} not found: a C compiler is needed to build the kernels") from None
    if done.returncode:
        raise CtroptError(f"building the kernels failed:\n{done.stderr.strip()[-2000:]}")
    return out


def uses_kernels(model) -> bool:
    """Whether an onnx ModelProto has a node of this library (at any depth)."""
    return any(n.domain == DOMAIN for n in iter_proto_nodes(model.graph))


def register_if_used(session_options, model) -> None:
    """`register` when the onnx ModelProto uses this library's ops; nothing otherwise."""
    if uses_kernels(model):
        register(session_options)


def register(session_options) -> None:
    """Register the library with onnxruntime SessionOptions; a clear error if it is not built."""
    if not available():
        raise CtroptError(f"the model uses {DOMAIN} ops and ctropt's kernel library is not built for this "
                          "checkout: run `ctropt kernels build`")
    session_options.register_custom_ops_library(str(library_path()))
