"""Reference CTR models built in TensorFlow (TF1 graph style, as DeepRec's modelzoo) and PyTorch.

Each entry's export, a sample batch and the framework's outputs on it ship with the package (data/), so
demos and tests run without TensorFlow or PyTorch; `build` rebuilds from the framework when installed.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import shutil
from pathlib import Path

import numpy as np

from ...graph import CtroptError, load, save
from ..common import DEFAULT_OPSET, Export, check_export
from .spec import Input, TFModel, TorchModel

DATA = Path(__file__).parent / "data"
SEQ_LENS = (100, 37)  # the two history lengths every sequence model is checked at


@dataclasses.dataclass
class Entry:
    name: str
    description: str
    frameworks: tuple[str, ...]
    structures: str  # what the export must show in `ctropt inspect`
    sequence: bool = False  # has a padded behaviour history (checked at both SEQ_LENS)


ENTRIES = {e.name: e for e in [
    Entry("wdl", "Wide&Deep, Criteo layout (26 categorical, 13 dense), MLP 1024-512-256", ("tf",),
          "partitioned embedding lookups (DynamicPartition/DynamicStitch lowering)"),
    Entry("deepfm", "DeepFM with an indicator (multi-hot) column", ("tf",),
          "OneHot + ReduceSum indicator column"),
    Entry("dlrm", "DLRM: bottom MLP, multi-hot bags, dot interaction, top MLP", ("tf",),
          "embedding bags reduced by segment sums"),
    Entry("din", "DIN: attention MLP over [q, k, q-k, q*k] of a padded history, Dice", ("tf", "torch"),
          "padded attention with a mask", sequence=True),
    Entry("dien", "DIEN: GRU interest extraction, attention, AUGRU interest evolution (H=36, E=18, T=100)",
          ("tf", "torch"), "GRU and AUGRU cells (Scan bodies from TF; GRU op + unrolled AUGRU from PyTorch)", sequence=True),
    Entry("mmoe", "MMoE: shared experts, per-task gates, two outputs", ("tf",), "experts and gates"),
    Entry("wdl_strings", "Wide&Deep on raw strings: hash-bucket, vocabulary (OOV id, OOV buckets) and "
          "'|'-split tag columns", ("tf",),
          "StringToHashBucketFast, CategoryMapper, StringSplit (ai.onnx.contrib: needs onnxruntime-extensions)"),
    Entry("din_strings", "DIN on raw strings: hashed ids, a category vocabulary, a [B, T] string history padded "
          "with \"\"", ("tf",), "StringToHashBucketFast, CategoryMapper, StringEqual mask (ai.onnx.contrib)",
          sequence=True),
]}
STRINGS = ("wdl_strings", "din_strings")  # their exports run with onnxruntime-extensions registered


def entry(name: str) -> Entry:
    if name not in ENTRIES:
        raise CtroptError(f"no zoo model {name!r}; choose one of {', '.join(ENTRIES)}")
    return ENTRIES[name]


def _framework(name: str, framework: str) -> None:
    if framework not in entry(name).frameworks:
        raise CtroptError(f"zoo model {name} is built in {' and '.join(entry(name).frameworks)}, not {framework}")


def shipped_path(name: str, framework: str = "tf") -> Path:
    """The committed export of an entry (and beside it .npz sample inputs and .ref.npz framework outputs)."""
    _framework(name, framework)
    path = DATA / f"{name}_{framework}.onnx"
    if not path.exists():
        raise CtroptError(f"the shipped export {path.name} is missing from this installation")
    return path


def builder(name: str, framework: str):
    """The framework object of an entry (TFModel or TorchModel), built with seeded weights."""
    _framework(name, framework)
    module = "tf_models" if framework == "tf" else "torch_models"
    try:
        models = importlib.import_module(f"{__name__}.{module}")
    except ImportError as e:
        extra = "tf" if framework == "tf" else "torch"
        raise CtroptError(f"building {name} needs {framework}: pip install 'ctropt[{extra}]' ({e})") from None
    return getattr(models, name)


def export_spec(spec: TFModel | TorchModel, *, exporter: str = "legacy", opset: int | None = None,
                sequence_inputs: tuple[str, ...] | None = None, seq_len: int = SEQ_LENS[0]) -> Export:
    """Export a framework model description to ONNX (sequence inputs: those with a dynamic axis 1 by default)."""
    if sequence_inputs is None:
        sequence_inputs = tuple(i.name for i in spec.inputs if len(i.shape) > 1 and i.shape[1] is None)
    if isinstance(spec, TFModel):
        from ..tf import from_graph_def

        return from_graph_def(spec.graph_def, [i.name for i in spec.inputs], spec.outputs,
                              opset=opset or DEFAULT_OPSET, sequence_inputs=sequence_inputs)
    if isinstance(spec, TorchModel):
        from ..torch import export_module

        example = spec.sample(2, seq_len, np.random.default_rng(0))
        return export_module(spec.module, example, spec.outputs, exporter=exporter, opset=opset,
                             sequence_inputs=sequence_inputs)
    raise CtroptError(f"expected a TFModel or TorchModel, got {type(spec).__name__}")


def export(name: str, framework: str = "tf", *, exporter: str = "legacy", opset: int | None = None,
           seq_len: int | None = None) -> tuple[Export, TFModel | TorchModel]:
    """Build the entry in its framework and export it to ONNX."""
    build = builder(name, framework)
    spec = build() if seq_len is None else build(seq_len=seq_len)
    return export_spec(spec, exporter=exporter, opset=opset, seq_len=seq_len or SEQ_LENS[0]), spec


def build_and_check(name: str, framework: str = "tf", **kw):
    """Export and compare with the framework at batch 1, 7, 256 (and both SEQ_LENS for sequence models).

    Returns (export, spec, checks). A sequence model whose export fixes the history length (an unrolled
    loop) is exported once more at the second length for its checks.
    """
    result, spec = export(name, framework, **kw)
    if not entry(name).sequence:
        return result, spec, check_export(result, lambda b, t, rng: spec.sample(b, SEQ_LENS[0], rng))
    if spec.has_sequence:
        return result, spec, check_export(result, spec.sample, seq_lens=SEQ_LENS)
    checks = check_export(result, spec.sample, seq_lens=SEQ_LENS[:1])
    other, other_spec = export(name, framework, seq_len=SEQ_LENS[1], **kw)
    return result, spec, checks + check_export(other, other_spec.sample, seq_lens=SEQ_LENS[1:])


def write(name: str, out: str | Path, framework: str = "tf", *, rebuild: bool | None = None,
          **kw) -> tuple[Path, list | None]:
    """Write an entry's ONNX to `out`: rebuilt from the framework (checked), or the shipped copy.

    rebuild=None rebuilds when the framework is installed and copies the shipped export otherwise.
    """
    out = Path(out)
    if rebuild is None:
        module = "tensorflow" if framework == "tf" else "torch"
        rebuild = importlib.util.find_spec(module) is not None
    if not rebuild:
        shutil.copyfile(shipped_path(name, framework), out)
        return out, None
    result, _, checks = build_and_check(name, framework, **kw)
    save(result.model, out)
    return out, checks


def refresh_shipped(names=None, frameworks=("tf", "torch")) -> list[tuple[str, str, list]]:
    """Rebuild the committed exports, sample inputs (batch 8) and framework outputs in data/."""
    DATA.mkdir(exist_ok=True)
    report = []
    for name in names or list(ENTRIES):
        for framework in entry(name).frameworks:
            if framework not in frameworks:
                continue
            result, spec, checks = build_and_check(name, framework)
            path = save(result.model, DATA / f"{name}_{framework}.onnx")
            feeds = spec.sample(8, SEQ_LENS[0], np.random.default_rng(8))
            np.savez(path.with_suffix(".npz"), **feeds)
            np.savez(path.with_suffix(".ref.npz"), **result.run_framework(feeds))
            load(path)  # what ships must load
            report.append((name, framework, checks))
    return report


__all__ = ["ENTRIES", "Entry", "Input", "TFModel", "TorchModel", "build_and_check", "builder", "entry", "export",
           "export_spec",
           "refresh_shipped", "shipped_path", "write"]
