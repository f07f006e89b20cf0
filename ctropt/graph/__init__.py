"""Model I/O (validation, external data, versions the runtimes accept) and graph walking."""

from __future__ import annotations

import collections
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx_graphsurgeon.ir.tensor import LazyValues

from . import weights

# The highest versions onnxruntime 1.31 loads (tests/test_graph.py checks the installed runtime loads them):
# onnx 1.23 writes IR 14, which 1.31 rejects, so saved models are clamped to these. (1.32 loads IR 14.)
MAX_IR_VERSION = 13
MAX_ONNX_OPSET = 26
PROTOBUF_LIMIT = 2**31 - 1
# Above this many bytes of initializers a model is saved with its tensors in a side file.
EXTERNAL_DATA_THRESHOLD = 1 << 30
# Domains whose ops a runtime or ctropt itself implements; anything else must come as a model-local function.
KNOWN_DOMAINS = {
    "",
    "ai.onnx",
    "ai.onnx.ml",
    "ai.onnx.preview.training",
    "com.microsoft",
    "com.microsoft.nchwc",
    "ai.ctropt",
    "ai.ctropt.kernels",  # ctropt's onnxruntime kernel library (ctropt.kernels)
    "ai.onnx.contrib",  # tf2onnx's string ops, run by onnxruntime-extensions (ctropt.runtime.strings)
}


class CtroptError(Exception):
    """An error the user can act on; the CLI prints it without a traceback."""


# ----------------------------------------------------------------------------------------- loading


def load(path: str | os.PathLike, *, check: bool = True, keep_external: bool = False) -> onnx.ModelProto:
    """Load and validate a model file, external data included (`keep_external`: its tensors stay references, for a
    weight store to adopt). Raises CtroptError on bad input."""
    path = Path(path)
    if not path.exists():
        raise CtroptError(f"{path}: no such file")
    if path.is_dir():
        raise CtroptError(f"{path}: is a directory, expected an .onnx file")
    size = path.stat().st_size
    if size > PROTOBUF_LIMIT:
        raise CtroptError(
            f"{path}: {size / 2**30:.1f} GiB in one file; a protobuf cannot exceed 2 GiB. "
            "Save the model with external data: onnx.save_model(m, path, save_as_external_data=True)"
        )
    model = _parse(path)
    if model.ir_version <= 0 or not model.HasField("graph") or not model.graph.output:
        raise CtroptError(f"{path}: not an ONNX model, or the file is truncated (no graph outputs)")
    if any(_uses_external_data(t) for t in _all_initializers(model.graph)):
        try:
            if keep_external:
                for t in _all_initializers(model.graph):  # found and long enough, read later
                    ref = weights.external_ref(t) if _uses_external_data(t) else None
                    if ref and (path.parent / ref[0]).stat().st_size < ref[1] + ref[2]:
                        raise ValueError(f"{ref[0]} ends before tensor {t.name}'s data")
            else:
                onnx.load_external_data_for_model(model, str(path.parent))
        except (OSError, ValueError, onnx.checker.ValidationError) as e:
            raise CtroptError(f"{path}: cannot read its external data: {e}") from None
    if check:
        check_model(model, str(path), path=path)
    return model


def _parse(path: Path) -> onnx.ModelProto:
    """The file's ModelProto (onnx picks the format by the extension: .json and .textproto are read as text), or a
    one-line CtroptError."""
    import warnings

    import onnx.parser
    import onnx.serialization
    from google.protobuf import json_format, message, text_format

    text = onnx.serialization.registry.get_format_from_file_extension(path.suffix)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # onnx warns that its onnxtxt format is experimental
            return onnx.load_model(str(path), load_external_data=False)
    except OSError as e:
        raise CtroptError(f"{path}: cannot read it ({e.strerror or e})") from None
    except (message.Error, json_format.Error, text_format.Error, onnx.parser.ParseError, RuntimeError,
            ValueError) as e:
        lines = str(e).removeprefix("b'").replace("\\n", "\n").strip().splitlines()
        detail = lines[0].rstrip(".") if lines else type(e).__name__
        if text in (None, "protobuf"):
            raise CtroptError(f"{path}: not an ONNX model, or the file is truncated ({detail})") from None
        raise CtroptError(f"{path}: not an ONNX model (onnx reads a {path.suffix} file as a model in {text} form: "
                          f"{detail})") from None


def check_model(model: onnx.ModelProto, where: str = "model", path: Path | None = None) -> None:
    """Structure, versions and domains a runtime can handle; CtroptError with the reason otherwise."""
    opsets = {o.domain or "": o.version for o in model.opset_import}
    onnx_opset = opsets.get("", opsets.get("ai.onnx"))
    if onnx_opset is None:
        raise CtroptError(f"{where}: no ai.onnx opset import (not an ONNX model, or truncated)")
    if onnx_opset > MAX_ONNX_OPSET:
        raise CtroptError(
            f"{where}: opset {onnx_opset} is newer than supported (onnxruntime runs up to opset "
            f"{MAX_ONNX_OPSET}); re-export with opset {MAX_ONNX_OPSET} or lower"
        )
    functions = {(f.domain, f.name) for f in model.functions}
    unknown_domains: dict[str, str] = {}
    unknown_ops: set[str] = set()
    for node in iter_proto_nodes(model.graph):
        if (node.domain, node.op_type) in functions:
            continue
        if node.domain not in KNOWN_DOMAINS:
            unknown_domains.setdefault(node.domain, node.op_type)
        elif node.domain in ("", "ai.onnx") and not onnx.defs.has(node.op_type):
            unknown_ops.add(node.op_type)
    if unknown_domains:
        listed = ", ".join(f"{d!r} (e.g. {op})" for d, op in sorted(unknown_domains.items()))
        raise CtroptError(
            f"{where}: uses custom-op domain {listed} that neither onnxruntime nor ctropt implements, "
            "and the model carries no function body for it"
        )
    if unknown_ops:
        raise CtroptError(f"{where}: unknown ONNX op(s): {', '.join(sorted(unknown_ops))}")
    saved_ir = model.ir_version
    try:
        model.ir_version = min(saved_ir, onnx.IR_VERSION)
        if path is not None and (not _small(model) or any(map(_uses_external_data, _all_initializers(model.graph)))):
            onnx.checker.check_model(str(path))  # over the limit, or data not read: the checker reads the files
        else:
            onnx.checker.check_model(model)
    except onnx.checker.ValidationError as e:
        first = str(e).strip().splitlines()[0]
        raise CtroptError(f"{where}: invalid ONNX model: {first}") from None
    finally:
        model.ir_version = saved_ir


# ----------------------------------------------------------------------------------------- saving


def runtime_ir_version(model: onnx.ModelProto) -> int:
    """The IR version to save with: the lowest the opsets need, never above what onnxruntime loads."""
    needed = onnx.helper.find_min_ir_version_for(list(model.opset_import), ignore_unknown=True)
    return max(min(model.ir_version, MAX_IR_VERSION), needed)


def check_output_path(out: str | os.PathLike, *inputs: str | os.PathLike, flag: str = "-o") -> Path:
    """Refuse an output path that would overwrite an input file (`flag`: the option that names the output)."""
    out = Path(out)
    for inp in inputs:
        inp = Path(inp)
        if out.resolve() == inp.resolve() or (out.exists() and inp.exists() and out.samefile(inp)):
            raise CtroptError(f"output path {out} is the input file; choose another path ({flag})")
    if out.is_dir():
        raise CtroptError(f"output path {out} is a directory")
    if not out.parent.exists():
        raise CtroptError(f"output directory {out.parent} does not exist")
    return out


def save(
    model: onnx.ModelProto,
    path: str | os.PathLike,
    *,
    external_data: bool | None = None,
    protect: tuple[str | os.PathLike, ...] = (),
) -> Path:
    """Write atomically, with an IR version the runtimes accept; large models get a `.data` side file."""
    path = check_output_path(path, *protect)
    store = weights.active() if weights.stored(model) else None
    model = onnx.ModelProto.FromString(model.SerializeToString()) if _small(model) or store else _copy(model)
    model.ir_version = runtime_ir_version(model)
    if external_data is None:
        external_data = initializer_bytes(model) > EXTERNAL_DATA_THRESHOLD
    data_name = path.name + ".data"
    for p in protect:
        if (path.parent / data_name).resolve() == Path(p).resolve():
            raise CtroptError(f"writing {data_name} would overwrite an input file")
    tmp = Path(tempfile.mkdtemp(prefix=".ctropt-", dir=path.parent))
    try:
        target = tmp / path.name
        if store is not None:  # its large tensors are a weight store's: written once into PATH.data
            store.save(model, target)
            os.replace(tmp / data_name, path.parent / data_name)
        elif external_data:
            onnx.save_model(model, str(target), save_as_external_data=True, all_tensors_to_one_file=True,
                            location=data_name, size_threshold=1024)
            os.replace(tmp / data_name, path.parent / data_name)
        else:
            onnx.save_model(model, str(target))
        os.replace(target, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def initializer_bytes(model: onnx.ModelProto) -> int:
    return sum(_tensor_bytes(t) for t in _all_initializers(model.graph))


def _tensor_bytes(t: onnx.TensorProto) -> int:
    if t.HasField("raw_data"):
        return len(t.raw_data)
    n = 1
    for d in t.dims:
        n *= d
    return n * 4


def _small(model: onnx.ModelProto) -> bool:
    return initializer_bytes(model) < PROTOBUF_LIMIT // 2


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    return copy


def _uses_external_data(t: onnx.TensorProto) -> bool:
    return t.data_location == onnx.TensorProto.EXTERNAL


# ----------------------------------------------------------------------------------------- walking


def _all_initializers(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    for g in iter_proto_graphs(graph):
        yield from g.initializer
        for node in g.node:
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.TENSOR:
                    yield attr.t


def iter_proto_graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """The graph and every Loop/Scan/If body inside it, depth first."""
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from iter_proto_graphs(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    yield from iter_proto_graphs(g)


def iter_proto_nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    for g in iter_proto_graphs(graph):
        yield from g.node


def op_name(n: onnx.NodeProto) -> str:
    """The op type, prefixed with its domain when that is not the default one (`ai.ctropt::GRUSequence`)."""
    return f"{n.domain}::{n.op_type}" if n.domain not in ("", "ai.onnx") else n.op_type


def op_histogram(model: onnx.ModelProto) -> collections.Counter:
    """Op type counts over the graph and all subgraphs (custom domains prefixed)."""
    return collections.Counter(op_name(n) for n in iter_proto_nodes(model.graph))


def node_count(model: onnx.ModelProto) -> int:
    return sum(1 for _ in iter_proto_nodes(model.graph))


def nodes_near(t: gs.Tensor, hops: int, *, up: bool) -> list[gs.Node]:
    """Nodes within `hops` steps of t, nearest first, each once: its producers, theirs, ... (up) or its
    consumers, theirs, ... (down)."""
    found, frontier, seen = [], [t], set()
    for _ in range(hops):
        nxt = []
        for x in frontier:
            for node in (x.inputs if up else x.outputs):
                if id(node) not in seen:
                    seen.add(id(node))
                    found.append(node)
                    nxt.extend(node.inputs if up else node.outputs)
        frontier = nxt
    return found


def topological_order(nodes: list[gs.Node]) -> list[gs.Node]:
    """`nodes` in an order where each follows the nodes of the list that make its inputs (iterative DFS:
    unrolled chains are thousands of nodes deep; the first-listed ties stay first)."""
    producer = {}
    for n in nodes:
        for o in n.outputs:
            producer[id(o)] = n
    order, state = [], {}
    for root in nodes:
        if id(root) in state:
            continue
        state[id(root)] = 1
        stack = [(root, 0)]
        while stack:
            n, i = stack.pop()
            ins = n.inputs
            pushed = False
            while i < len(ins):
                p = producer.get(id(ins[i]))
                i += 1
                if p is not None and id(p) not in state:
                    state[id(p)] = 1
                    stack.append((n, i))
                    stack.append((p, 0))
                    pushed = True
                    break
            if not pushed:
                state[id(n)] = 2
                order.append(n)
    return order


def iter_graphs(graph: gs.Graph) -> Iterator[gs.Graph]:
    """A graphsurgeon graph and all its subgraphs, outermost first."""
    yield graph
    yield from graph.subgraphs(recursive=True)


# ----------------------------------------------------------------------------------------- graphsurgeon bridge


def to_graph(model: onnx.ModelProto) -> gs.Graph:
    graph = gs.import_onnx(model)
    store = weights.active()
    if store is not None:  # stored tensors: read as memory maps where a rule reads them (graph/weights.py)
        for t in graph.tensors().values():
            if isinstance(t, gs.Constant) and isinstance(t._values, LazyValues) and \
                    weights.external_ref(t._values.tensor) is not None:
                t._values = weights.MappedValues(t._values.tensor, store)
    for g in iter_graphs(graph):
        for n in g.nodes:
            if n.op == "Loop" and isinstance(n.attrs.get("body"), gs.Graph) and len(n.attrs["body"].inputs) >= 2:
                # a carried value's shape may change after the first iteration, whatever the body declares
                # (paddle2onnx: a scalar 0 that the body makes [1]; a "Reshape to the same shape" removed on the
                # strength of the declaration gives a Slice 2-D starts): not trusted. The iteration number and
                # condition keep theirs: onnxruntime makes the iteration number of the rank declared.
                for t in n.attrs["body"].inputs[2:]:
                    t.shape = None
    return graph


def loop_varying_values(graph: gs.Graph) -> list[gs.Tensor]:
    """In every Loop body: the carried inputs that change from one iteration to the next and the body values
    computed from them, whose declared or inferred shapes may hold for the first iteration only (paddle2onnx
    declares a scalar that is [1] from the first iteration on). A value passed through unchanged (tf2onnx threads a
    Keras GRU's sequence and weights that way) keeps its shape from one iteration to the next."""
    found = []
    for g in iter_graphs(graph):
        for n in g.nodes:
            body = n.attrs.get("body") if n.op == "Loop" else None
            if not isinstance(body, gs.Graph) or len(body.inputs) < 2:
                continue
            varying = [t for t, out in zip(body.inputs[2:], body.outputs[1:]) if strip_identity(out) is not t]
            seen = {id(t) for t in varying}
            for node in body.nodes:  # in topological order
                if any(id(t) in seen for t in node.inputs):
                    varying += [o for o in node.outputs if id(o) not in seen]
                    seen.update(id(o) for o in node.outputs)
            found += varying
    return found


def strip_identity(t: gs.Tensor) -> gs.Tensor:
    """The value `t` copies through a chain of Identity nodes (`t` itself when made otherwise)."""
    while len(t.inputs) == 1 and t.inputs[0].op == "Identity" and t.inputs[0].inputs:
        t = t.inputs[0].inputs[0]
    return t


def export_graph(graph: gs.Graph) -> onnx.ModelProto:
    """gs.export_onnx (no type check), string constants included: onnx-graphsurgeon 0.6 writes a constant whose
    values were read as raw bytes, which onnx refuses for strings (the separators, vocabularies and "" of string
    features), so those go back as the TensorProtos onnx makes of them."""
    for g in [graph, *graph.subgraphs(recursive=True)]:
        constants = [t for t in g.tensors().values() if isinstance(t, gs.Constant)]
        constants += [a for n in g.nodes for a in n.attrs.values() if isinstance(a, gs.Constant)]
        for t in constants:
            if isinstance(t._values, np.ndarray) and t._values.dtype.kind in "OUS":
                t._values = LazyValues(onnx.numpy_helper.from_array(t._values.astype(object), t.name))
    _store_large(graph)
    return gs.export_onnx(graph, do_type_check=False)


def _store_large(graph: gs.Graph) -> None:
    """With a weight store active, the main graph's large constants go out as references: a mapped one as the
    reference it was read from, a new array of weights.THRESHOLD bytes or more written into the store once."""
    store = weights.active()
    if store is None:
        return
    for t in graph.tensors().values():
        values = t._values if isinstance(t, gs.Constant) else None
        if not isinstance(values, np.ndarray) or values.dtype.kind in "OUS":
            continue
        ref = store.reference(values)
        if ref is None and values.nbytes >= weights.THRESHOLD:
            ref = store.write(values, t.name)
        if ref is not None:
            ref = weights._renamed(ref, t.name)
            t._values = weights.MappedValues(ref, store)


def to_model(graph: gs.Graph, like: onnx.ModelProto) -> onnx.ModelProto:
    """Export a graphsurgeon graph, keeping `like`'s model-level fields and opset imports."""
    graph.toposort(recurse_subgraphs=True, mode="nodes")  # "full" also sorts functions: recursion bug in gs 0.6.1
    model = export_graph(graph)
    opsets = {o.domain: o.version for o in like.opset_import}
    for o in model.opset_import:
        opsets.setdefault(o.domain, o.version)
    # Model-local functions (ai.ctropt fused ops) travel only while some node uses them.
    used = {(n.domain, n.op_type) for g in iter_proto_graphs(model.graph) for n in g.node}
    functions = [f for f in model.functions if (f.domain, f.name) in used]
    del model.functions[:]
    model.functions.extend(functions)
    for domain in {d for d, _ in used} | {f.domain for f in functions}:
        opsets.setdefault(domain, 1)
    del model.opset_import[:]
    model.opset_import.extend(onnx.helper.make_opsetid(d, v) for d, v in opsets.items())
    model.ir_version = max(like.ir_version, 8) if functions else like.ir_version
    for field in ("producer_name", "producer_version", "domain", "model_version", "doc_string"):
        setattr(model, field, getattr(like, field))
    del model.metadata_props[:]
    model.metadata_props.extend(like.metadata_props)
    return model


def runnable_model(graph: gs.Graph) -> onnx.ModelProto:
    """A graph being rewritten as a model onnxruntime runs (its own opsets, IR 10); the graph is not changed."""
    return to_model(graph.copy(), like=onnx.helper.make_model(onnx.GraphProto(), ir_version=10, opset_imports=[]))


def interface(model: onnx.ModelProto) -> list[tuple]:
    """(kind, name, elem type, dims) of every graph input and output, in order."""

    def dims(vi):
        t = vi.type.tensor_type
        if not t.HasField("shape"):
            return None
        return tuple(d.dim_param if d.HasField("dim_param") else (d.dim_value if d.HasField("dim_value") else None)
                     for d in t.shape.dim)

    initializers = {t.name for t in model.graph.initializer}
    inputs = [v for v in model.graph.input if v.name not in initializers]
    return [("input", v.name, v.type.tensor_type.elem_type, dims(v)) for v in inputs] + [
        ("output", v.name, v.type.tensor_type.elem_type, dims(v)) for v in model.graph.output
    ]


def annotate_shapes_if_bare(graph: gs.Graph) -> None:
    """Shapes for a graph whose intermediate values have none (a pass run alone, on a model no infer-shapes has
    seen); a graph the pass manager annotated is left as it is, so that a pass which rewrites nothing leaves the
    model unchanged."""
    outputs = {id(t) for t in graph.outputs}
    if not any(t.shape is not None for n in graph.nodes for t in n.outputs if id(t) not in outputs):
        annotate_shapes(graph)


def annotate_shapes(graph: gs.Graph, refine: bool = False) -> tuple[int, str]:
    """Fill in missing dtypes/shapes of node outputs (all scopes) by onnx shape inference. With `refine`, inference
    runs on the graph without its annotations, and a dim it finds a number for is set where the annotation has a
    symbol or nothing (passes name the sizes of the values they build as they can: a second optimize, inferring
    afresh, would see more).

    Graph inputs and outputs are never touched. Returns (values annotated, reason if inference could not run).
    """
    model = export_graph(graph)
    if model.ByteSize() > PROTOBUF_LIMIT - (1 << 20):
        return 0, "model over 2 GiB: shape inference skipped"
    if refine:
        for g in iter_proto_graphs(model.graph):
            del g.value_info[:]
    try:
        inferred = onnx.shape_inference.infer_shapes(model, check_type=False, strict_mode=False, data_prop=True)
    except Exception as e:  # inference is best effort: a model it cannot handle keeps its annotations
        return 0, f"shape inference failed: {str(e).splitlines()[0][:200]}"
    known = {}
    for vi in (vi for g in iter_proto_graphs(inferred.graph) for vi in g.value_info):
        # one name in several scopes (a body's copy of an outer value may have no shape): the one with a shape
        if vi.name not in known or not known[vi.name].type.tensor_type.HasField("shape"):
            known[vi.name] = vi
    annotated = 0
    for g in iter_graphs(graph):
        interface = {id(t) for t in list(g.inputs) + list(g.outputs)}
        for node in g.nodes:
            for t in node.outputs:
                vi = known.get(t.name)
                if vi is None or id(t) in interface or not vi.type.HasField("tensor_type"):
                    continue
                tt = vi.type.tensor_type
                changed = False
                if t.dtype is None and tt.elem_type:
                    t.dtype = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type)
                    changed = True
                dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim] \
                    if tt.HasField("shape") else None
                if t.shape is None and dims is not None:
                    t.shape, changed = dims, True
                elif refine and dims is not None and len(dims) == len(t.shape):
                    better = [d if isinstance(d, int) and not isinstance(o, (int, np.integer)) else o
                              for o, d in zip(t.shape, dims)]
                    if better != list(t.shape):
                        t.shape, changed = better, True
                annotated += changed
    return annotated, ""
