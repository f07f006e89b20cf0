"""What every exporter shares: the Export result, interface naming, and the numeric check against the framework."""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np
import onnx

from ..graph import iter_proto_graphs
from ..runtime import Runner, compare_outputs

DEFAULT_OPSET = 17
CHECK_BATCHES = (1, 7, 256)
CHECK_ATOL = 1e-5


@dataclasses.dataclass
class Export:
    """An ONNX model and the framework's own forward on the same feeds (for the numeric check)."""

    model: onnx.ModelProto
    run_framework: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]
    exporter: str
    # the framework's ids computed from strings (hash buckets, vocabulary lookups): tensors the ONNX graph computes
    # under the same names, and the framework's values of them; check_export compares them exactly
    id_names: tuple[str, ...] = ()
    ids: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]] | None = None


@dataclasses.dataclass
class ExportCheck:
    batch: int
    seq_len: int | None
    max_abs_err: float
    ok: bool
    detail: str = ""
    ids: int = 0  # ids computed from strings, compared exactly (all equal when ok)


def strip_port_suffixes(model: onnx.ModelProto) -> None:
    """Rename TensorFlow's 'name:0' graph inputs/outputs to 'name' everywhere (when the short name is free)."""
    taken = {v for g in iter_proto_graphs(model.graph) for n in g.node for v in list(n.input) + list(n.output)}
    taken |= {t.name for t in model.graph.initializer}
    renames = {}
    for v in list(model.graph.input) + list(model.graph.output):
        short = v.name.rsplit(":", 1)[0]
        if v.name.endswith(":0") and short not in taken and short not in renames.values():
            renames[v.name] = short
    for g in iter_proto_graphs(model.graph):
        for v in list(g.input) + list(g.output) + list(g.value_info):
            v.name = renames.get(v.name, v.name)
        for n in g.node:
            n.input[:] = [renames.get(x, x) for x in n.input]
            n.output[:] = [renames.get(x, x) for x in n.output]


def name_dims(model: onnx.ModelProto, sequence_inputs=()) -> None:
    """Dynamic axis 0 of inputs/outputs is `batch`; dynamic axis 1 of sequence inputs is `seq_len`."""
    for v in list(model.graph.input) + list(model.graph.output):
        dims = v.type.tensor_type.shape.dim
        for axis, name in ((0, "batch"), (1, "seq_len")):
            if axis == 1 and v.name not in sequence_inputs:
                continue
            if len(dims) > axis and not dims[axis].HasField("dim_value"):
                dims[axis].dim_param = name


def check_export(export: Export, sample, *, batches=CHECK_BATCHES, seq_lens=(None,), atol: float = CHECK_ATOL,
                 seed: int = 0) -> list[ExportCheck]:
    """Run the ONNX model in onnxruntime and the framework on the same sample batches; compare every output,
    and the ids computed from strings exactly (`Export.ids`).

    `sample(batch, seq_len, rng)` makes the feeds (seq_len None: the model's default).
    """
    id_names = list(export.id_names) if export.ids else []
    runner = Runner(_with_outputs(export.model, id_names))
    checks = []
    for seq_len in seq_lens:
        for batch in batches:
            feeds = sample(batch, seq_len, np.random.default_rng(seed + batch))
            framework = export.run_framework(feeds)
            got = runner.run(feeds)
            diffs = compare_outputs(framework, {k: got[k] for k in framework}, atol=atol, rtol=0.0)
            err = max((d.max_abs for d in diffs), default=0.0)
            bad = [f"{d.name}: {d.reason}" for d in diffs if not d.ok]
            expected_ids = export.ids(feeds) if id_names else {}
            for name, want in expected_ids.items():
                differ = int(np.sum(np.asarray(got[name]) != want)) if got[name].shape == want.shape else want.size
                if differ:
                    bad.append(f"{name}: {differ} of {want.size} ids differ from the framework's")
            count = sum(v.size for v in expected_ids.values())
            checks.append(ExportCheck(batch, seq_len, err, not bad, "; ".join(bad), count))
    return checks


def _with_outputs(model: onnx.ModelProto, names: list[str]) -> onnx.ModelProto:
    """A copy of `model` that also outputs the int64 tensors `names` (the ids computed from strings)."""
    if not names:
        return model
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    copy.graph.output.extend(onnx.helper.make_tensor_value_info(n, onnx.TensorProto.INT64, None) for n in names)
    return copy
