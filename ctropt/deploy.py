"""Server configurations for an optimized model: a Triton Inference Server model repository and an OpenVINO
Model Server config, each with the model optimized for that server's runtime and verified against the input.

Triton: `<name>/config.pbtxt` + `<name>/1/model.onnx` (onnxruntime backend), max_batch_size = the largest
bucket and dynamic batching preferring the buckets when rows are independent (padding-free batching of
requests is only exact then); otherwise max_batch_size 0 and the full shapes. A model that uses ctropt's kernel
library, or string ops (onnxruntime-extensions), gets a copy of each library beside config.pbtxt, named in
`model_operations { op_library_filename }`. OVMS: `config.json` with `model_config_list` and `<name>/1/model.onnx`
optimized with `--target openvino`, checked to load in OpenVINO. OpenVINO has no converter for the string ops, so a
model with string inputs is served there as its id model (`string_front.split_strings`), with the front written
beside config.json for the client that turns strings into ids.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import onnx

from . import kernels
from .runtime import strings
from .string_front import split_strings
from .graph import CtroptError, interface, save
from .passes import PassManager
from .runtime import Runner, generate_inputs
from .runtime.inputs import DEFAULT_SEQ_LEN
from .runtime.runnable import check_target
from .specialize import rows_independent

TRITON_TYPES = {
    onnx.TensorProto.FLOAT: "TYPE_FP32", onnx.TensorProto.DOUBLE: "TYPE_FP64", onnx.TensorProto.FLOAT16: "TYPE_FP16",
    onnx.TensorProto.BFLOAT16: "TYPE_BF16", onnx.TensorProto.INT8: "TYPE_INT8", onnx.TensorProto.INT16: "TYPE_INT16",
    onnx.TensorProto.INT32: "TYPE_INT32", onnx.TensorProto.INT64: "TYPE_INT64", onnx.TensorProto.UINT8: "TYPE_UINT8",
    onnx.TensorProto.UINT16: "TYPE_UINT16", onnx.TensorProto.UINT32: "TYPE_UINT32",
    onnx.TensorProto.UINT64: "TYPE_UINT64", onnx.TensorProto.BOOL: "TYPE_BOOL", onnx.TensorProto.STRING: "TYPE_STRING",
}


def _dims(dims, batched: bool) -> tuple[list[int], bool]:
    """Triton dims (batch axis dropped when batched, dynamic dims -1) and whether a reshape to [] is needed."""
    if dims is None:
        raise CtroptError("a graph input/output has no shape; Triton needs the rank")
    rest = list(dims[1:] if batched else dims)
    values = [d if isinstance(d, int) and d > 0 else -1 for d in rest]
    return (values, False) if values else ([1], True)  # a [batch] tensor: dims [1], reshaped to []


def triton_config(model: onnx.ModelProto, name: str, buckets: list[int], *, batched: bool,
                  instance_kind: str = "KIND_CPU", queue_delay_us: int = 100, op_libraries: tuple[str, ...] = ()) -> str:
    """config.pbtxt text (protobuf text format of Triton's ModelConfig); `op_libraries`: the custom-op libraries
    the onnxruntime backend registers for the model."""
    lines = [f'name: "{name}"', 'backend: "onnxruntime"', f"max_batch_size: {max(buckets) if batched else 0}"]
    if op_libraries:
        lines.append("model_operations {\n" + "".join(f'  op_library_filename: "{lib}"\n' for lib in op_libraries)
                     + "}")
    for kind in ("input", "output"):
        entries = []
        for k, tensor, elem, dims in interface(model):
            if k != kind:
                continue
            if elem not in TRITON_TYPES:
                raise CtroptError(f"{kind} {tensor!r}: element type {elem} has no Triton type")
            values, reshape = _dims(dims, batched)
            entry = (f'  {{\n    name: "{tensor}"\n    data_type: {TRITON_TYPES[elem]}\n'
                     f'    dims: [ {", ".join(map(str, values))} ]\n')
            if reshape:
                entry += "    reshape: { shape: [ ] }\n"
            entries.append(entry + "  }")
        lines.append(f"{kind} [\n" + ",\n".join(entries) + "\n]")
    if batched:
        lines.append("dynamic_batching {\n"
                     f"  preferred_batch_size: [ {', '.join(str(b) for b in sorted(buckets))} ]\n"
                     f"  max_queue_delay_microseconds: {queue_delay_us}\n}}")
    lines.append(f"instance_group [\n  {{\n    count: 1\n    kind: {instance_kind}\n  }}\n]")
    return "\n".join(lines) + "\n"


def ovms_config(name: str, target_device: str = "CPU") -> dict:
    """config.json of OpenVINO Model Server for one model stored beside it in `<name>/1/`."""
    return {"model_config_list": [{"config": {"name": name, "base_path": name, "target_device": target_device,
                                              "plugin_config": {"PERFORMANCE_HINT": "LATENCY"}}}]}


def write_repositories(model: onnx.ModelProto, out_dir: str | os.PathLike, name: str, buckets: list[int], *,
                       static_seq_len: int | None = None, options: dict | None = None, source: str = "",
                       library_dir: str | None = None) -> dict:
    """Write `triton/` and `ovms/` under out_dir; returns a summary (paths, batched, why not). `source`: the
    model's path, for messages. `library_dir`: the Triton model directory (`triton/<name>`, where the libraries
    are copied) as the server will see it, e.g. /models/<name> in a container; default: where it is written."""
    if not name.replace("_", "").replace("-", "").isalnum():
        raise CtroptError(f"model name {name!r}: use letters, digits, '-' and '_'")
    if library_dir is not None and not library_dir.startswith("/"):
        raise CtroptError(f"--library-dir {library_dir}: an absolute path, as the server sees it (Triton's "
                          "onnxruntime backend hands op_library_filename to dlopen as written)")
    check_target(model, "openvino", Path(source).name if source else None,   # OVMS needs a model OpenVINO runs
                 "give `ctropt repository` the original model: it optimizes a copy for each server")
    out = Path(out_dir)
    seq = static_seq_len or DEFAULT_SEQ_LEN
    feeds = generate_inputs(model, batch=13, seq_len=seq)
    why_not = rows_independent(model, feeds)
    summary = {"batched": not why_not, "why_not": why_not}
    for target, server in (("ort", "triton"), ("openvino", "ovms")):
        if server == "ovms" and strings.has_string_inputs(model):
            model, front = split_strings(model)
            feeds = front.ids(feeds)
            (out / server).mkdir(parents=True, exist_ok=True)
            front.save(out / server / f"{name}.front.onnx")
            summary["ovms_front"] = str(out / server / f"{name}.front.onnx")
        opts = dict(options or {})
        if target == "openvino" and static_seq_len:
            opts["static_seq_len"] = static_seq_len
        result = PassManager("all", target=target, feeds=feeds, options=opts).run(model)
        if result.failed:
            summary.setdefault("rolled_back", []).extend(f"{target}: {r.name}" for r in result.failed)
        backend = "ort-cpu" if target == "ort" else "openvino-cpu"
        try:
            Runner(result.model, backend).run(feeds)
        except CtroptError as e:
            raise CtroptError(f"the model optimized for {server} does not run on {backend}: {e}") from None
        model_dir = out / server / name / "1"
        model_dir.mkdir(parents=True, exist_ok=True)
        save(result.model, model_dir / "model.onnx")
        if server == "triton":
            libraries = []   # Triton's onnxruntime backend registers each for this model
            # (ctropt's: the library registered and the per-CPU builds it loads from beside itself)
            for uses, files in ((kernels.uses_kernels, kernels.build_paths),
                                (strings.uses_strings, lambda: [strings.library_path()])):
                if uses(result.model):
                    seen = library_dir.rstrip("/") if library_dir else str((out / server / name).resolve())
                    libraries.append(f"{seen}/{files()[0].name}")
                    for f in files():
                        shutil.copyfile(f, out / server / name / f.name)
            text = triton_config(result.model, name, buckets, batched=not why_not, op_libraries=tuple(libraries))
            (out / server / name / "config.pbtxt").write_text(text)
            summary["triton"] = str(out / server / name / "config.pbtxt")
            summary["libraries"] = libraries
        else:
            (out / server / "config.json").write_text(json.dumps(ovms_config(name), indent=2) + "\n")
            summary["ovms"] = str(out / server / "config.json")
    return summary
