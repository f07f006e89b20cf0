"""ctropt's onnxruntime kernel library (``ai.ctropt.kernels`` ops), built from C for any CPU of the architecture:
one build per instruction set and a library that loads the widest one the CPU runs (``build``, dispatch.c).

``GRUScan`` (gru_sequence.c) runs a whole GRU-family layer, input projection included, in one kernel;
lower-rnn-ort emits it when the library loads (``--option rnn_ort_form=kernel`` insists on it). ``AttentionCore``
(attention.c) computes softmax(s · Q·Kᵀ + bias) · V for every head; attention-core-kernel emits it. ``SumAxes``,
``SmallMatMul`` (small_products.c), ``GatherRows`` (gather_rows.c), ``GatherFields`` (gather_fields.c: several
fields' lookups and dense columns written side by side) and ``UniqueRows`` / ``UniqueRowsFloat`` (unique_rows.c) stand in for
onnxruntime ops whose CPU kernels make a call per matrix or per index, or sort; small-products-kernel,
gather-rows-kernel and unique-rows-kernel emit them; ``LayerNorm`` (layer_norm.c) and ``MulAdd`` (mul_add.c: a * b
+ c (+ d) in one pass) stand in for chains of elementwise ops (layer-norm-kernel, mul-add-kernel); ``DotSum``
(dot_sum.c: width-1 GEMMs summed, a sigmoid after them), ``FMInteraction`` (fm_interaction.c: FM's second order) and
``GatedSum`` (gated_sum.c: a mixture of experts' mix) for the small ops of a ranker's head, FM and experts
(dot-sum-kernel, fm-interaction-kernel, gated-sum-kernel). A model that holds
such a node needs the library registered in its onnxruntime session: ctropt's own sessions do it, other code calls
``register(session_options)``; ``ctropt repository`` names it in the Triton config.

The build needs gcc and onnxruntime's C API header ``onnxruntime_c_api.h`` from any release up to the installed
onnxruntime: the API is versioned, and the library asks for the newest version both know (register.c), so it
loads in onnxruntime 1.16 and newer whatever header it was built with. ctropt
ships that header (``include/``: onnxruntime 1.21, API 21, MIT licence beside it), so ``ensure()`` builds the
library on first use with nothing but gcc; $ORT_INCLUDE_DIR, /usr/include/onnxruntime and
/usr/local/include/onnxruntime (Debian's ``libonnxruntime-dev``) are looked in first.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from ..graph import CtroptError, annotate_shapes_if_bare, iter_proto_nodes
from . import compiling

DOMAIN = "ai.ctropt.kernels"
HERE = Path(__file__).parent
SOURCES, DISPATCH, isas = compiling.SOURCES, compiling.DISPATCH, compiling.isas
HEADER = "onnxruntime_c_api.h"
SHIPPED_HEADER_DIR = Path(__file__).with_name("include")
_BUILD_FAILED: list[str] = []  # why this process's automatic build failed (tried once per process)


def library_path() -> Path:
    """Where the built library is (or goes): $CTROPT_KERNELS_DIR, else beside the source when the wheel brought it
    prebuilt or the folder is writable (a checkout), else the user's cache (~/.cache/ctropt, a read-only install)."""
    folder = os.environ.get("CTROPT_KERNELS_DIR")
    if not folder:
        folder = HERE if (HERE / "libctropt_kernels.so").exists() or os.access(HERE, os.W_OK) else \
            Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ctropt"
    return Path(folder) / "libctropt_kernels.so"


def build_paths() -> list[Path]:
    """The library onnxruntime registers (dispatch.c) and the builds it chooses from, beside it."""
    lib = library_path()
    return [lib] + [lib.with_name(f"libctropt_kernels.{isa}.so") for isa, _ in isas()]


def chosen_isa() -> str | None:
    """The build registering the library loads on this CPU (honouring $CTROPT_KERNELS_ISA); None when not built."""
    if not library_path().exists():
        return None
    import ctypes

    isa = ctypes.CDLL(str(library_path())).ctropt_kernels_isa
    isa.restype = ctypes.c_char_p
    return isa().decode()


def available() -> bool:
    """Whether the library and its builds are there, built from these sources (the hash they were built from, not
    file times: a wheel's files are all unpacked at install time)."""
    sources = SOURCES + [HERE / "kernels.h", HERE / "api_version.h", DISPATCH]
    if not all(p.exists() for p in build_paths() + sources):   # a source missing: the build says which
        return False
    done = compiling.stamp(library_path())
    return done.exists() and done.read_text() == _sources_hash()


def include_dir() -> Path | None:
    """The folder with onnxruntime's C API header: the environment's or system's, else the one ctropt ships."""
    places = [os.environ.get("ORT_INCLUDE_DIR"), "/usr/include/onnxruntime", "/usr/local/include/onnxruntime",
              SHIPPED_HEADER_DIR]
    return next((Path(p) for p in places if p and (Path(p) / HEADER).exists()), None)


def build(include: str | Path | None = None, compiler: str | None = None, folder: Path | None = None,
          machine: str | None = None) -> Path:
    """Compile the library (compiling.py: one build per instruction set and the library that picks one) into
    `folder` (default: `library_path`'s), with $CC or gcc; returns the library."""
    inc = Path(include) if include else include_dir()
    if inc is None or not (inc / HEADER).exists():
        raise CtroptError(f"{HEADER} not found in {inc}: give a folder that holds it (ctropt ships one in "
                          f"{SHIPPED_HEADER_DIR}; tools/fetch_ort_headers.sh DIR unpacks Debian's)")
    out = Path(folder) / library_path().name if folder else library_path()
    try:
        return compiling.build(out, inc, compiler or os.environ.get("CC") or "gcc", machine)
    except compiling.BuildError as e:
        raise CtroptError(str(e)) from None


@functools.lru_cache(maxsize=1)
def _sources_hash() -> str:
    return compiling.sources_hash()   # once per process: the sources of an installed package do not change


def ensure() -> str | None:
    """Build the library if it is not built yet; None when it is ready, else why not (one try per process)."""
    if available():
        return None
    if not _BUILD_FAILED:
        try:
            build()
            return None
        except CtroptError as e:
            _BUILD_FAILED.append(str(e).splitlines()[0])
    return _BUILD_FAILED[0]


METADATA = ("ctropt.kernels.library", "ctropt.kernels.version", "ctropt.kernels.ops", "ctropt.kernels.how")


def describe(model) -> None:
    """Say in the ModelProto's metadata what it needs to run (changed in place): this library (its file, version and
    the ops the model uses) and how to register it; entries of a library the model no longer uses go."""
    ops = sorted({n.op_type for n in iter_proto_nodes(model.graph) if n.domain == DOMAIN})
    kept = [p for p in model.metadata_props if p.key not in METADATA]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    if not ops:
        return
    from importlib.metadata import PackageNotFoundError, version

    try:
        release = version("ctropt")
    except PackageNotFoundError:   # a checkout on sys.path, not installed
        release = "unknown"
    how = ("onnxruntime needs the library registered: SessionOptions.register_custom_ops_library(path), path from "
           "`ctropt kernels path` (or the libctropt_kernels.so a Triton repository holds); or optimize with "
           "--option ort_kernels=off for standard ops only")
    values = ("libctropt_kernels.so", f"ctropt {release}, sources {_sources_hash()[:12]}", ",".join(ops), how)
    for key, value in zip(METADATA, values):
        model.metadata_props.add(key=key, value=value)


def uses_kernels(model) -> bool:
    """Whether an onnx ModelProto has a node of this library (at any depth)."""
    return any(n.domain == DOMAIN for n in iter_proto_nodes(model.graph))


def register_if_used(session_options, model) -> None:
    """`register` when the onnx ModelProto uses this library's ops; nothing otherwise."""
    if uses_kernels(model):
        register(session_options)


def register(session_options) -> None:
    """Register the library with onnxruntime SessionOptions; a clear error if it is not built."""
    problem = ensure()
    if problem:
        raise CtroptError(f"the model uses {DOMAIN} ops and ctropt's kernel library cannot be built here: {problem}")
    session_options.register_custom_ops_library(str(library_path()))


def wanted(options: dict) -> bool:
    """Whether the passes may emit this library's ops: option ort_kernels=auto (default) or off (standard ops only,
    a model any onnxruntime loads without the library)."""
    value = options.get("ort_kernels", "auto") or "auto"
    if value not in ("auto", "off"):
        raise CtroptError(f"ort_kernels must be auto or off, not {value!r}")
    return value == "auto"


def ready(ctx, left: str) -> bool:
    """Whether a kernel pass may emit this library's ops: the library loads and is wanted (shapes then annotated);
    where it does not load, a note that `left` stays as standard ops."""
    if not wanted(ctx.options):
        return False
    problem = ensure()
    if problem:
        ctx.note(f"{left} left as standard ops: ctropt's kernel library is not available ({problem})")
        return False
    annotate_shapes_if_bare(ctx.graph)
    return True


def note_needed(ctx) -> None:
    """The note that the model now needs the library, naming its ops."""
    ops = sorted({n.op for n in ctx.graph.nodes if n.domain == DOMAIN})
    ctx.note(f"{', '.join(ops)} kernels: the model needs ctropt's kernel library at run time ({library_path()})")


def apply_rules(ctx, rules, left: str) -> int:
    """A kernel pass's body: its rewrite rules applied where the library loads and is wanted (`ready`), a note that
    the model then needs it. Returns the rewrites."""
    if not ready(ctx, left):
        return 0
    done = ctx.apply(*rules)
    if done:
        note_needed(ctx)
    return done
