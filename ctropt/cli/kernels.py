"""`ctropt kernels`: ctropt's onnxruntime kernel library (build, path, status)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from .common import _user_errors, app, console

kernels_app = typer.Typer(no_args_is_help=True, help="ctropt's onnxruntime kernel library (rnn_ort_form=kernel).")
app.add_typer(kernels_app, name="kernels")


@kernels_app.command("build")
def kernels_build(
    include: Optional[Path] = typer.Option(None, "--include", help="Folder with onnxruntime_c_api.h "
                                           "(default: $ORT_INCLUDE_DIR, /usr/include/onnxruntime)."),
):
    """Compile the kernel library, one build per instruction set (gcc and onnxruntime's C API header needed)."""
    from .. import kernels

    with _user_errors():
        console.print(f"built {kernels.build(include)}")


@kernels_app.command("path")
def kernels_path(
    include: bool = typer.Option(False, "--include", help="Print instead the folder of the onnxruntime C API header "
                                 "ctropt ships (onnxruntime_c_api.h, API 21), for a C/C++ server (examples/c/serve.c)."),
):
    """Print where the library onnxruntime registers is (built or not): register_custom_ops_library(that path)."""
    from .. import kernels

    print(kernels.SHIPPED_HEADER_DIR if include else kernels.library_path())


@kernels_app.command("status")
def kernels_status():
    """Whether the library is built, where, and which of its builds this CPU runs."""
    from .. import kernels

    state = f"built ({', '.join(isa for isa, _ in kernels.isas())}; this CPU runs {kernels.chosen_isa()})" \
        if kernels.available() else "not built (run `ctropt kernels build`)"
    console.print(f"{kernels.library_path()}: {state}; header: {kernels.include_dir() or 'not found'}", soft_wrap=True)
