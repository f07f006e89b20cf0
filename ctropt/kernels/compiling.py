"""Compiling ctropt's kernel library, with nothing but the standard library (setup.py runs it to put the library in
the wheel; `ctropt.kernels.build` for a source install): the sources once per instruction set, and the library
onnxruntime registers (dispatch.c), which loads the widest build the CPU runs from beside itself."""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
from pathlib import Path

HERE = Path(__file__).parent
SOURCES = [HERE / "register.c", HERE / "gru_sequence.c", HERE / "attention.c", HERE / "small_products.c",
           HERE / "gather_rows.c", HERE / "unique_rows.c", HERE / "layer_norm.c", HERE / "mul_add.c",
           HERE / "gather_fields.c", HERE / "dot_sum.c",
           HERE / "fm_interaction.c", HERE / "gated_sum.c", HERE / "token_attention.c"]  # and kernels.h, which they share
DISPATCH = HERE / "dispatch.c"   # the library onnxruntime registers: it loads the build for this CPU
SHIPPED_HEADERS = HERE / "include"   # onnxruntime's C API header (1.21, API 21)


class BuildError(RuntimeError):
    """The compiler is missing or refused the sources."""


def isas(machine: str | None = None) -> list[tuple[str, list[str]]]:
    """The builds for `machine` (default: this one), widest first: (name, compiler flags). x86-64: AVX-512
    (x86-64-v4), AVX2 + FMA (x86-64-v3) and the baseline; elsewhere (aarch64, ...) the compiler's default only."""
    if (machine or platform.machine()).lower() in ("x86_64", "amd64"):
        return [("avx512", ["-march=x86-64-v4"]), ("avx2", ["-march=x86-64-v3"]), ("base", ["-march=x86-64"])]
    return [("base", [])]


def build(out: Path, include: Path = SHIPPED_HEADERS, compiler: str = "gcc", machine: str | None = None) -> Path:
    """Compile into `out` (the library onnxruntime registers) and beside it `libctropt_kernels.<isa>.so` for each
    instruction set of `machine` (default: this one; another with a cross compiler); returns `out`."""
    out.parent.mkdir(parents=True, exist_ok=True)
    common = ["-O3", "-shared", "-fPIC", "-Wall", "-Wno-psabi", f"-I{include}"]
    for isa, flags in isas(machine):
        _compile(compiler, [*common, *flags, *map(str, SOURCES), "-lm"], out.with_name(f"libctropt_kernels.{isa}.so"))
    _compile(compiler, [*common, *dict(isas(machine))["base"], str(DISPATCH), "-ldl"], out)   # last: a whole set
    stamp(out).write_text(sources_hash())
    return out


def stamp(library: Path) -> Path:
    """The file beside a built library that names the sources it was built from (`sources_hash`)."""
    return library.with_name(library.name + ".sources")


def sources_hash() -> str:
    """A hash of the sources and the header they share: a library built from other ones is rebuilt."""
    digest = hashlib.sha256()
    for path in [*SOURCES, DISPATCH, HERE / "kernels.h", HERE / "api_version.h"]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _compile(compiler: str, args: list[str], out: Path) -> None:
    part = out.with_name(f"{out.name}.{os.getpid()}.part")  # then renamed: a concurrent build never loads half a file
    try:
        done = subprocess.run([compiler, *args, "-o", str(part)], capture_output=True, text=True)
    except FileNotFoundError:
        raise BuildError(f"{compiler} not found: a C compiler is needed to build the kernels") from None
    if done.returncode:
        part.unlink(missing_ok=True)
        raise BuildError(f"building the kernels failed:\n{done.stderr.strip()[-2000:]}")
    os.replace(part, out)
