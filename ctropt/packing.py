"""Input packing: many per-feature inputs ([B, 1] or [B], as DeepCTR/Keras export one input per feature) become
one [B, F] input per dtype, split back inside the graph; `Packing.pack(feeds)` turns the old feed dict into
the new one, so callers keep their feeds.

Seed 002 merged small inputs to cut host-to-device copies; on CPU it cuts per-input binding and checking.
This changes the model's interface on purpose, so it is its own step (`ctropt pack-inputs`), not a pass of
`all` (passes keep the interface); its result is verified through the adapter.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .graph import CtroptError
from .runtime import Runner, compare_outputs, generate_inputs


@dataclasses.dataclass
class Packing:
    """packed input name -> the original inputs it holds, in column order; `flat` are the originally [B] ones."""

    groups: dict[str, list[str]]
    flat: list[str]

    def pack(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The old feed dict → the packed model's feeds (unpacked inputs pass through)."""
        taken = {n for names in self.groups.values() for n in names}
        missing = sorted(taken - set(feeds))
        if missing:
            raise CtroptError(f"missing inputs: {', '.join(missing)}")
        out = {k: v for k, v in feeds.items() if k not in taken}
        for packed, names in self.groups.items():
            cols = [np.asarray(feeds[n]).reshape(len(feeds[n]), 1) for n in names]
            out[packed] = np.concatenate(cols, axis=1)
        return out

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(json.dumps({"groups": self.groups, "flat": self.flat}, indent=2) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Packing":
        try:
            data = json.loads(Path(path).read_text())
            return cls({k: list(v) for k, v in data["groups"].items()}, list(data["flat"]))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CtroptError(f"{path}: not a packing file ({e})") from None


def _per_feature(vi: onnx.ValueInfoProto) -> bool:
    """[B] or [B, 1] with a dynamic or fixed batch axis."""
    dims = vi.type.tensor_type.shape.dim if vi.type.tensor_type.HasField("shape") else None
    if dims is None or len(dims) not in (1, 2):
        return False
    return len(dims) == 1 or (dims[1].HasField("dim_value") and dims[1].dim_value == 1)


def pack_inputs(model: onnx.ModelProto, *, min_group: int = 2) -> tuple[onnx.ModelProto, Packing]:
    """The model with per-feature inputs of each dtype packed into one `packed_<dtype>` input, and the adapter."""
    initializers = {t.name for t in model.graph.initializer}
    inputs = [vi for vi in model.graph.input if vi.name not in initializers]
    by_type: dict[int, list[onnx.ValueInfoProto]] = {}
    for vi in inputs:
        if _per_feature(vi):
            by_type.setdefault(vi.type.tensor_type.elem_type, []).append(vi)
    by_type = {t: vs for t, vs in by_type.items() if len(vs) >= min_group}
    if not by_type:
        return model, Packing({}, [])
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 13)
    out = onnx.ModelProto.FromString(model.SerializeToString())
    g = out.graph
    taken = {vi.name for vs in by_type.values() for vi in vs}
    new_inputs, nodes, groups, flat = [], [], {}, []
    existing = {v.name for v in g.input} | {o for n in g.node for o in n.output}
    for vi in inputs:
        if vi.name not in taken:
            new_inputs.append(vi)
            continue
        elem = vi.type.tensor_type.elem_type
        members = by_type[elem]
        if vi is not members[0]:
            continue  # the packed input sits where its first feature was
        name = _fresh(f"packed_{onnx.helper.tensor_dtype_to_np_dtype(elem).name}", existing)
        batch = members[0].type.tensor_type.shape.dim[0]
        packed = helper.make_tensor_value_info(name, elem, [batch.dim_value if batch.HasField("dim_value")
                                                            else (batch.dim_param or None), len(members)])
        new_inputs.append(packed)
        groups[name] = [m.name for m in members]
        columns = [m.name if len(m.type.tensor_type.shape.dim) == 2 else _fresh(f"{m.name}/col", existing)
                   for m in members]
        split_sizes = np.ones(len(members), np.int64)
        if opset >= 13:
            sizes_name = _fresh(f"{name}/sizes", existing)
            g.initializer.append(numpy_helper.from_array(split_sizes, sizes_name))
            nodes.append(helper.make_node("Split", [name, sizes_name], columns, name=f"{name}/split", axis=1))
        else:
            nodes.append(helper.make_node("Split", [name], columns, name=f"{name}/split", axis=1,
                                          split=split_sizes.tolist()))
        for m, col in zip(members, columns):
            if col != m.name:  # an originally [B] input: drop the column axis
                flat.append(m.name)
                if opset >= 13:
                    axes = _fresh(f"{m.name}/axes", existing)
                    g.initializer.append(numpy_helper.from_array(np.array([1], np.int64), axes))
                    nodes.append(helper.make_node("Squeeze", [col, axes], [m.name], name=f"{m.name}/squeeze"))
                else:
                    nodes.append(helper.make_node("Squeeze", [col], [m.name], name=f"{m.name}/squeeze", axes=[1]))
    kept = [vi for vi in g.input if vi.name in initializers]
    del g.input[:]
    g.input.extend(new_inputs + kept)
    rest = list(g.node)
    del g.node[:]
    g.node.extend(nodes + rest)
    return out, Packing(groups, flat)


def _fresh(base: str, taken: set[str]) -> str:
    name, i = base, 1
    while name in taken:
        name, i = f"{base}_{i}", i + 1
    taken.add(name)
    return name


def verify_packing(original: onnx.ModelProto, packed: onnx.ModelProto, packing: Packing, batch: int = 13) -> float:
    """Max abs difference between the original on generated feeds and the packed model on the packed feeds."""
    feeds = generate_inputs(original, batch=batch)
    diffs = compare_outputs(Runner(original).run(feeds), Runner(packed).run(packing.pack(feeds)))
    if not all(d.ok for d in diffs):
        raise CtroptError("the packed model's outputs differ: "
                          + "; ".join(f"{d.name}: {d.reason}" for d in diffs if not d.ok))
    return max((d.max_abs for d in diffs), default=0.0)
