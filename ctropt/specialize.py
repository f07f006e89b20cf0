"""Batch buckets: one model per batch size with static shapes, each checked against the dynamic model.

Seed 002 served CTR models with N fixed-batch variants and padded each request up to the nearest one.
With every shape static, constant folding removes the Shape/Gather/Concat arithmetic exporters emit and
shape-guarded branches resolve (zoo WDL: 287 → 79 nodes). `BucketedSession` (runtime)
serves such a directory.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import onnx

from .graph import CtroptError, interface, node_count, save
from .passes import PassManager, resolve
from .runtime import Runner, compare_outputs, generate_inputs
from .runtime.inputs import DEFAULT_SEQ_LEN
from .runtime.runnable import check_target

MANIFEST = "manifest.json"
DYNAMIC = "model.dynamic.onnx"


@dataclasses.dataclass
class Bucket:
    batch: int
    file: str
    nodes: int
    max_abs_err: float


def _dynamic(d: onnx.TensorShapeProto.Dimension) -> bool:
    return not d.HasField("dim_value")


def fix_shapes(model: onnx.ModelProto, batch: int, seq_len: int | None = None) -> onnx.ModelProto:
    """A copy with the batch axis (axis 0) and, given `seq_len`, the history axis (axis 1) of every input static.

    Axis 0 is the batch wherever it is dynamic (tf2onnx names it differently per input: unk__40, unk__41, ...);
    an input not aligned with the batch (a jagged id list) is caught by `rows_independent`. Other dynamic dims
    stay dynamic.
    """
    out = onnx.ModelProto.FromString(model.SerializeToString())
    initializers = {t.name for t in out.graph.initializer}
    inputs = [vi for vi in out.graph.input if vi.name not in initializers]
    if not any(vi.type.tensor_type.shape.dim and _dynamic(vi.type.tensor_type.shape.dim[0]) for vi in inputs):
        raise CtroptError("the model's inputs have no dynamic batch axis (axis 0): nothing to specialize")
    history = set()
    for vi in inputs:
        for axis, d in enumerate(vi.type.tensor_type.shape.dim):
            if not _dynamic(d):
                continue
            if axis == 0:
                d.Clear()
                d.dim_value = batch
            elif axis == 1 and seq_len is not None:
                history.add(d.dim_param)
                d.Clear()
                d.dim_value = seq_len
    for vi in out.graph.output:
        for axis, d in enumerate(vi.type.tensor_type.shape.dim):
            if axis == 0 and _dynamic(d):
                d.Clear()
                d.dim_value = batch
            elif d.HasField("dim_param") and d.dim_param in history - {""}:
                d.Clear()
                d.dim_value = seq_len
    del out.graph.value_info[:]  # stale symbolic shapes; the passes infer static ones
    return out


def rows_independent(model: onnx.ModelProto | Runner, feeds: dict[str, np.ndarray]) -> str:
    """'' if each output row depends only on its input row (so padding a request is safe), else why not.

    Runs the batch, then a reordered subset of its rows, and compares those rows: batch statistics, a
    softmax over the batch or a reduction across rows all show up as a difference.
    """
    runner = model if isinstance(model, Runner) else Runner(model)
    batch = len(next(iter(feeds.values())))
    if batch < 4:
        raise CtroptError("the row check needs at least 4 rows")
    if any(len(v.shape) == 0 or len(v) != batch for v in feeds.values()):
        return "not every input has the batch on axis 0"
    full = runner.run(feeds)
    rows = [batch - 1, 0, 2]
    part = runner.run({k: v[rows] for k, v in feeds.items()})
    for name, value in full.items():
        if value.ndim == 0 or value.shape[0] != batch:
            return f"output {name!r} does not have the batch on axis 0"
        other = part[name]
        if other.shape[0] != len(rows) or not np.allclose(value[rows], other, rtol=1e-4, atol=1e-5):
            return (f"output {name!r} of a row changes with the other rows of the batch (batch statistics or a "
                    "reduction across rows): padded rows would change real ones")
    return ""


def specialize(model: onnx.ModelProto, out_dir: str | os.PathLike, batches: list[int], *, seq_len: int | None = None,
               passes="all", target: str = "ort", source: str = "", options: dict | None = None) -> dict:
    """Write one optimized static model per batch size into `out_dir`, plus manifest.json; returns the manifest.

    Each bucket is the dynamic model with static dims, run through `passes` (verified after each pass),
    then compared with the dynamic model on the same inputs; a bucket that differs is an error.
    """
    if not batches or any(b < 1 for b in batches):
        raise CtroptError("--batch wants positive batch sizes, e.g. 1,32,128,512")
    check_target(model, target, Path(source).name if source else None,
                 "specialize the original model with --target openvino, or this one with --target ort")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t = seq_len or DEFAULT_SEQ_LEN
    probe = generate_inputs(model, batch=13, seq_len=t)
    dynamic = Runner(model)
    dependent = rows_independent(dynamic, probe)
    if dependent.startswith("not every input"):
        raise CtroptError(f"cannot bucket this model: {dependent} (a jagged input, as torchrec's KeyedJaggedTensor)")
    # Fuse once on the dynamic graph (the patterns expect the exporter's forms), then per bucket fix the
    # shapes and run the passes again: folding now removes the shape arithmetic. The lowering waits for the
    # buckets: shape inference cannot see through the kernels it may emit.
    chosen = resolve(passes, (), target)
    fused = PassManager([p for p in chosen if p.group != "lower"], target=target, feeds=probe,
                        options=options).run(model).model
    optimized = PassManager([p for p in chosen if p.group == "lower"], target=target, feeds=probe,
                            options=options).run(fused).model
    buckets = []
    for b in sorted(set(batches)):
        fixed = fix_shapes(fused, b, seq_len)
        feeds = generate_inputs(model, batch=b, seq_len=t, seed=b)
        result = PassManager(chosen, target=target, feeds=feeds, options=options).run(fixed)
        diffs = compare_outputs(dynamic.run(feeds), Runner(result.model).run(feeds))
        if not all(d.ok for d in diffs):
            raise CtroptError(f"the batch-{b} model differs from the dynamic one: "
                              + "; ".join(f"{d.name}: {d.reason}" for d in diffs if not d.ok))
        name = f"model.b{b}.onnx"
        save(result.model, out_dir / name)
        buckets.append(Bucket(b, name, node_count(result.model), max((d.max_abs for d in diffs), default=0.0)))
    save(optimized, out_dir / DYNAMIC)  # the fallback a BucketedSession may prefer to padding
    manifest = {
        "source": source,
        "dynamic": DYNAMIC,
        "target": target,
        "seq_len": seq_len,
        "rows_independent": not dependent,
        "why_not": dependent,
        "inputs": [{"name": n, "dtype": onnx.helper.tensor_dtype_to_np_dtype(e).name, "shape": list(d or [])}
                   for k, n, e, d in interface(model) if k == "input"],
        "outputs": [{"name": n, "dtype": onnx.helper.tensor_dtype_to_np_dtype(e).name, "shape": list(d or [])}
                    for k, n, e, d in interface(model) if k == "output"],
        "source_nodes": node_count(model),
        "dynamic_nodes": node_count(optimized),
        "buckets": [dataclasses.asdict(x) for x in buckets],
    }
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return manifest
