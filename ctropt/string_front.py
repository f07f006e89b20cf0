"""Strings turned into ids outside the model: a model with string features split where its strings become numbers.

`split_strings(model)` returns the id model, which reads the tensors the string ops made (hashed ids, vocabulary
ids, split positions, "is this token empty") and every numeric input, and the front (`StringFront`), which is the
model's own string ops cut out as an ONNX model of their own. The client, or a feature service, runs the front on
onnxruntime with onnxruntime-extensions. These are the exported ops, so the ids are TensorFlow's. The id model
then runs anywhere, OpenVINO included, which has no converter for these ops, and the passes optimize it like any
numeric model. Seed 002 splits a serving graph at this same point.

The cut is found by running the model once: a node belongs to the string side when it reads or writes a string
tensor, and the front also computes whatever numeric values those nodes read. The tensors the string side hands
to the rest of the graph become the id model's inputs, with their names, dtypes and the dims they take at two
batch sizes.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from .graph import CtroptError
from .runtime import generate_inputs
from .runtime.probe import all_values


class StringFront:
    """The string side of a model: `ids(feeds)` runs it on the raw feeds (strings included) and returns the id
    model's feeds (the numeric inputs it reads, passed through, and the tensors the string ops made)."""

    def __init__(self, model: onnx.ModelProto, passthrough: list[str]):
        self.model, self.passthrough = model, passthrough
        self._session = None

    def ids(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        from .runtime.subgraph import ort_session

        if self._session is None:
            self._session = ort_session(self.model)
        wanted = {i.name for i in self._session.get_inputs()}
        made = self._session.run(None, {k: v for k, v in feeds.items() if k in wanted})
        out = {k: feeds[k] for k in self.passthrough}
        out.update(zip((o.name for o in self._session.get_outputs()), made))
        return out

    def save(self, path) -> None:
        front = onnx.ModelProto.FromString(self.model.SerializeToString())
        front.metadata_props.add(key="ctropt.passthrough", value=",".join(self.passthrough))
        onnx.save(front, str(path))

    @classmethod
    def load(cls, path) -> "StringFront":
        model = onnx.load(str(path))
        meta = {p.key: p.value for p in model.metadata_props}
        if "ctropt.passthrough" not in meta:
            raise CtroptError(f"{path} is not a string front written by `ctropt split-strings`")
        return cls(model, [n for n in meta["ctropt.passthrough"].split(",") if n])


def _is_string(value) -> bool:
    return isinstance(value, np.ndarray) and value.dtype == object


def _string_side(model: onnx.ModelProto, values: dict) -> set[int]:
    """Indices of the nodes that read or write a string tensor (initializers and inputs included)."""
    strings = {t.name for t in model.graph.initializer if t.data_type == onnx.TensorProto.STRING}
    strings |= {k for k, v in values.items() if _is_string(v)}
    return {i for i, n in enumerate(model.graph.node) if any(x in strings for x in list(n.input) + list(n.output))}


def _ancestors(model: onnx.ModelProto, seeds: set[int]) -> set[int]:
    """`seeds` and every node whose outputs they need, transitively."""
    producer = {o: i for i, n in enumerate(model.graph.node) for o in n.output if o}
    done, todo = set(), list(seeds)
    while todo:
        i = todo.pop()
        if i in done:
            continue
        done.add(i)
        todo += [producer[x] for x in model.graph.node[i].input if x in producer]
    return done


PROBES = ((5, 7), (9, 12))   # (batch, history length) of the two runs that tell the dims apart


def _axis_names(model: onnx.ModelProto) -> dict[tuple, str]:
    """The model's own names of the batch and history dims, keyed by their sizes in the two probe runs."""
    first = [i.type.tensor_type.shape.dim for i in model.graph.input if i.type.tensor_type.shape.dim]
    batch = next((d[0].dim_param for d in first if d[0].dim_param), "batch")
    seq = next((d[1].dim_param for d in first if len(d) > 1 and d[1].dim_param and d[1].dim_param != batch),
               "seq_len")
    return {tuple(p[0] for p in PROBES): batch, tuple(p[1] for p in PROBES): seq}


def _value_info(name: str, runs: list[dict], axes: dict[tuple, str]) -> onnx.ValueInfoProto:
    """A dim equal in both runs is fixed; one that follows the batch or the history is named as the model names
    it; any other that changes is named after the tensor."""
    array = runs[0][name]
    sizes = zip(*(r[name].shape for r in runs))
    dims = [a[0] if len(set(a)) == 1 else axes.get(a, f"{name}_dim{k}") for k, a in enumerate(sizes)]
    return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(array.dtype), dims)


def split_strings(model: onnx.ModelProto) -> tuple[onnx.ModelProto, StringFront]:
    """(the id model, the front) of a model whose string inputs are turned into numbers by its own ops."""
    g = model.graph
    string_inputs = [i.name for i in g.input if i.type.tensor_type.elem_type == onnx.TensorProto.STRING]
    if not string_inputs:
        raise CtroptError("the model has no string input: nothing to split")
    runs = [all_values(model, generate_inputs(model, batch=b, seq_len=t, seed=b)) for b, t in PROBES]
    axes = _axis_names(model)
    side = _string_side(model, runs[0])
    front_nodes = _ancestors(model, side)
    read_after = {x for i, n in enumerate(g.node) if i not in side for x in n.input} | {o.name for o in g.output}
    handed = [o for i in sorted(side) for o in g.node[i].output if o in read_after]
    strings_out = [o for o in handed if _is_string(runs[0][o])]
    if strings_out:
        raise CtroptError(f"strings reach the numeric part of the model ({', '.join(strings_out[:3])}): no cut "
                          "where every string has become a number")
    inits = {t.name: t for t in g.initializer}
    front_ops = [g.node[i] for i in sorted(front_nodes)]
    front_reads = {x for n in front_ops for x in n.input}
    front = helper.make_graph(front_ops, f"{g.name}_strings", [i for i in g.input if i.name in front_reads],
                              [_value_info(o, runs, axes) for o in handed],
                              [t for name, t in inits.items() if name in front_reads])
    rest_ops = [n for i, n in enumerate(g.node) if i not in side]
    rest_reads = {x for n in rest_ops for x in n.input} | {o.name for o in g.output}
    passthrough = [i.name for i in g.input if i.name in rest_reads and i.name not in string_inputs]
    rest = helper.make_graph(rest_ops, g.name, [i for i in g.input if i.name in passthrough]
                             + [_value_info(o, runs, axes) for o in handed], list(g.output),
                             [t for name, t in inits.items() if name in rest_reads])
    ids_model = helper.make_model(rest, opset_imports=[o for o in model.opset_import if o.domain != "ai.onnx.contrib"],
                                  ir_version=model.ir_version, producer_name=model.producer_name)
    front_model = helper.make_model(front, opset_imports=list(model.opset_import), ir_version=model.ir_version)
    return _without_dead_nodes(ids_model), StringFront(front_model, passthrough)


def _without_dead_nodes(model: onnx.ModelProto) -> onnx.ModelProto:
    """The id model without the numeric nodes that only fed the string side."""
    g = model.graph
    needed = _ancestors(model, {i for i, n in enumerate(g.node) if any(o in {x.name for x in g.output}
                                                                          for o in n.output)})
    keep = [n for i, n in enumerate(g.node) if i in needed]
    del g.node[:]
    g.node.extend(keep)
    return model


def verify_split(original: onnx.ModelProto, ids_model: onnx.ModelProto, front: StringFront,
                 backend: str = "ort-cpu", batch: int = 13) -> float:
    """The largest difference between the model on raw feeds and the id model on the front's feeds."""
    from .runtime import Runner

    feeds = generate_inputs(original, batch=batch, seed=3)
    want = Runner(original).run(feeds)
    got = Runner(ids_model, backend).run(front.ids(feeds))
    return max((float(np.abs(want[k].astype(np.float64) - got[k].astype(np.float64)).max(initial=0.0))
                for k in want if np.issubdtype(want[k].dtype, np.number)), default=0.0)
