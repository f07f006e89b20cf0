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

from .graph import CtroptError, iter_proto_nodes
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
        missing = sorted((wanted | set(self.passthrough)) - set(feeds))
        if missing:
            raise CtroptError(f"the front needs the inputs {missing}: feeds of another model?")
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


def _reads(node: onnx.NodeProto) -> list[str]:
    """The values a node reads: its inputs and what its subgraphs (If/Loop/Scan bodies) read from outside them."""
    names = [x for x in node.input if x]
    for attr in node.attribute:
        for sub in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)):
            made = {i.name for i in sub.input} | {t.name for t in sub.initializer}
            made |= {o for n in iter_proto_nodes(sub) for o in n.output}
            names += [x for n in iter_proto_nodes(sub) for x in n.input if x and x not in made]
    return names


def _string_side(model: onnx.ModelProto, values: dict) -> set[int]:
    """Indices of the main-graph nodes that read or write a string tensor (initializers and inputs included, and
    reads by their subgraphs)."""
    strings = {t.name for t in model.graph.initializer if t.data_type == onnx.TensorProto.STRING}
    strings |= {k for k, v in values.items() if _is_string(v)}
    return {i for i, n in enumerate(model.graph.node) if any(x in strings for x in _reads(n) + list(n.output))}


def _ancestors(model: onnx.ModelProto, seeds: set[int], stop: set[int] = frozenset()) -> set[int]:
    """`seeds` and every node whose outputs they need, transitively, not through the nodes in `stop`."""
    producer = {o: i for i, n in enumerate(model.graph.node) for o in n.output if o}
    done, todo = set(), list(seeds)
    while todo:
        i = todo.pop()
        if i in done or i in stop:
            continue
        done.add(i)
        todo += [producer[x] for x in _reads(model.graph.node[i]) if x in producer]
    return done


PROBES = ((5, 7), (9, 12))   # (batch, history length) of the two runs that tell the dims apart


def _axis_names(model: onnx.ModelProto) -> dict[tuple, str]:
    """The model's own names of the batch and history dims, keyed by their sizes in the two probe runs."""
    first = [i.type.tensor_type.shape.dim for i in model.graph.input if i.type.tensor_type.shape.dim]
    batch = next((d[0].dim_param for d in first if d[0].dim_param), "batch")
    seq = next((d[1].dim_param for d in first if len(d) > 1 and d[1].dim_param and d[1].dim_param != batch),
               "seq_len")
    return {tuple(p[0] for p in PROBES): batch, tuple(p[1] for p in PROBES): seq}


def _value_info(name: str, runs: list[dict], axes: dict[tuple, str], static: dict | None = None) -> onnx.ValueInfoProto:
    """A dim that follows the batch or the history is named as the model names it; a dim the model's shapes fix (a
    SparseTensor's dense_shape or a split's indices hold the rank: OpenVINO needs it static to give a Reshape fed by
    it a static rank) keeps its size where the runs agree; every other dim is named after the tensor: what the string
    ops make can depend on the data (the longest tag list), which two runs cannot rule out."""
    array = runs[0][name]
    sizes = list(zip(*(r[name].shape for r in runs)))
    known = (static or {}).get(name) or [None] * len(sizes)
    dims = [known[k] if len(known) == len(sizes) and isinstance(known[k], int) and set(a) == {known[k]}
            else axes.get(a, f"{name}_dim{k}") for k, a in enumerate(sizes)]
    return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(array.dtype), dims)


def _static_dims(model: onnx.ModelProto) -> dict[str, list]:
    """{value: its dims (an int where static)} as onnx's shape inference reads the model (empty where it fails)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, check_type=False, strict_mode=False)
    except Exception:  # noqa: BLE001 - shape inference is a hint here
        return {}
    return {v.name: [d.dim_value if d.HasField("dim_value") else None for d in v.type.tensor_type.shape.dim]
            for v in list(inferred.graph.value_info) + list(inferred.graph.output)
            if v.type.tensor_type.HasField("shape")}


def _probe(model: onnx.ModelProto) -> list[dict]:
    try:
        return [all_values(model, generate_inputs(model, batch=b, seq_len=t, seed=b)) for b, t in PROBES]
    except CtroptError:
        raise
    except Exception as e:  # onnxruntime refuses the model or the generated inputs
        raise CtroptError(f"cannot split: the model does not run on generated inputs "
                          f"({str(e).strip().splitlines()[0][:300]})") from None


def split_strings(model: onnx.ModelProto) -> tuple[onnx.ModelProto, StringFront]:
    """(the id model, the front) of a model whose string inputs are turned into numbers by its own ops."""
    g = model.graph
    string_inputs = [i.name for i in g.input if i.type.tensor_type.elem_type == onnx.TensorProto.STRING]
    if not string_inputs:
        raise CtroptError("the model has no string input: nothing to split")
    string_outputs = [o.name for o in g.output if o.type.tensor_type.elem_type == onnx.TensorProto.STRING]
    if string_outputs:
        raise CtroptError(f"the model outputs strings ({', '.join(string_outputs[:3])}): its id model could not "
                          "give them")
    runs = _probe(model)
    axes = _axis_names(model)
    static = _static_dims(model)
    side = _string_side(model, runs[0])
    outputs = {o.name for o in g.output}
    rest = _ancestors(model, {i for i, n in enumerate(g.node) if outputs & set(n.output)}, stop=side)
    read_after = {x for i in rest for x in _reads(g.node[i])} | outputs
    handed = list(dict.fromkeys(o for i in sorted(side) for o in g.node[i].output if o and o in read_after))
    inits = {t.name: t for t in g.initializer}
    front_ops = [g.node[i] for i in sorted(_ancestors(model, side))]
    front_reads = {x for n in front_ops for x in _reads(n)}
    front = helper.make_graph(front_ops, f"{g.name}_strings", [i for i in g.input if i.name in front_reads],
                              [_value_info(o, runs, axes, static) for o in handed],
                              [t for name, t in inits.items() if name in front_reads])
    passthrough = [i.name for i in g.input if i.name in read_after and i.name not in string_inputs]
    rest_graph = helper.make_graph([g.node[i] for i in sorted(rest)], g.name,
                                   [i for i in g.input if i.name in passthrough]
                                   + [_value_info(o, runs, axes, static) for o in handed], list(g.output),
                                   [t for name, t in inits.items() if name in read_after])
    ids_model = helper.make_model(rest_graph, ir_version=model.ir_version, producer_name=model.producer_name,
                                  opset_imports=[o for o in model.opset_import if o.domain != "ai.onnx.contrib"],
                                  functions=list(model.functions))
    front_model = helper.make_model(front, opset_imports=list(model.opset_import), ir_version=model.ir_version,
                                    functions=list(model.functions))
    return ids_model, StringFront(front_model, passthrough)


def verify_split(original: onnx.ModelProto, ids_model: onnx.ModelProto, front: StringFront,
                 backend: str = "ort-cpu", batch: int = 13) -> float:
    """The largest difference between the model on raw feeds and the id model on the front's feeds (inf where an
    integer or bool output differs)."""
    from .runtime import Runner

    feeds = generate_inputs(original, batch=batch, seed=3)
    want = Runner(original).run(feeds)
    got = Runner(ids_model, backend).run(front.ids(feeds))
    return max((float(np.abs(want[k].astype(np.float64) - got[k].astype(np.float64)).max(initial=0.0))
                if np.issubdtype(want[k].dtype, np.floating) else 0.0 if np.array_equal(want[k], got[k]) else np.inf
                for k in want), default=0.0)
