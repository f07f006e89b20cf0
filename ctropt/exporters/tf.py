"""TensorFlow → ONNX through tf2onnx, from every form users keep their models in.

Every entry point returns an `Export`: the ONNX model (inputs/outputs named as in TensorFlow, without
':0'; dynamic batch and sequence axes named `batch` / `seq_len`) and a function that runs the
original in TensorFlow, so `check_export` can compare the two.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
import numpy as np
import onnx

from ..graph import CtroptError
from ..runtime import strings
from .common import DEFAULT_OPSET, Export, name_dims, strip_port_suffixes


def _tf():
    try:
        import tensorflow as tf
        import tf2onnx  # noqa: F401
    except ImportError as e:
        raise CtroptError(f"TensorFlow export needs the tf extra: pip install 'ctropt[tf]' ({e})") from None
    _register_handlers()
    return tf


@functools.cache
def _register_handlers() -> None:
    """tf2onnx handlers for TensorFlow ops it lacks and CTR graphs hold (registered once, never over one of its
    own): SparseSlice, which DeepRec's DIN/DIEN/BST apply to a `tf.strings.split` history
    (`tf.sparse.slice(split, [0, 0], [batch, MAX_SEQ_LENGTH])`)."""
    from tf2onnx.handler import tf_op

    if not any("SparseSlice" in ops for ops in tf_op.get_opsets().get("", [])):
        tf_op("SparseSlice")(_SparseSlice)


class _SparseSlice:
    """tf.sparse.slice: the entries with start <= index < start + size in every dim, in their order, their
    indices less start; dense shape max(min(start + size, shape) - start, 0), as TensorFlow's SparseTensor::Slice.
    (indices [N, R], values [N], shape [R], start [R], size [R]) → Compress of the indices and the values."""

    @classmethod
    def version_13(cls, ctx, node, **kwargs):
        from tf2onnx.graph_builder import GraphBuilder

        indices, values, shape, start, size = node.input
        out_indices, out_values, out_shape = node.output
        end = ctx.make_node("Min", [ctx.make_node("Add", [start, size]).output[0], shape]).output[0]
        inside = ctx.make_node("And", [ctx.make_node("GreaterOrEqual", [indices, start]).output[0],
                                       ctx.make_node("Less", [indices, end]).output[0]]).output[0]
        as_int = ctx.make_node("Cast", [inside], attr={"to": onnx.TensorProto.INT64}).output[0]
        keep = ctx.make_node("Cast", [GraphBuilder(ctx).make_reduce_min({"data": as_int, "axes": [1], "keepdims": 0})],
                             attr={"to": onnx.TensorProto.BOOL}).output[0]
        dtypes, shapes = [ctx.get_dtype(o) for o in node.output], [ctx.get_shape(o) for o in node.output]
        ctx.remove_node(node.name)
        kept = ctx.make_node("Compress", [indices, keep], attr={"axis": 0}).output[0]
        zero = ctx.make_const(_fresh_name("zero"), np.array([0], dtype=np.int64)).output[0]
        ctx.make_node("Sub", [kept, start], outputs=[out_indices], shapes=shapes[:1], dtypes=dtypes[:1])
        ctx.make_node("Compress", [values, keep], attr={"axis": 0}, outputs=[out_values], shapes=shapes[1:2],
                      dtypes=dtypes[1:2])
        ctx.make_node("Max", [ctx.make_node("Sub", [end, start]).output[0], zero], outputs=[out_shape],
                      shapes=shapes[2:], dtypes=dtypes[2:])


def _fresh_name(name: str) -> str:
    """A name tf2onnx has not given out yet."""
    from tf2onnx import utils

    return utils.make_name(name)


def _port(name: str) -> str:
    return name if ":" in name else f"{name}:0"


def from_graph_def(graph_def, inputs: list[str], outputs: list[str], *, opset: int = DEFAULT_OPSET,
                   sequence_inputs: tuple[str, ...] = ()) -> Export:
    """A frozen GraphDef (variables already constants) with named placeholders and outputs.

    String ops go to the ai.onnx.contrib domain (onnxruntime-extensions runs them); lookup tables are read
    from the graph after its table initializers ran (frozen with them: e.g. 'init_all_tables' kept) and
    become CategoryMapper."""
    tf = _tf()
    inputs, outputs = [_port(n) for n in inputs], [_port(n) for n in outputs]
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.import_graph_def(graph_def, name="")
    session = tf.compat.v1.Session(graph=graph)
    tables = _tables(graph_def, graph, session)
    try:
        model = _convert_graph_def(graph_def, inputs, outputs, opset, tables)
    except CtroptError:
        raise
    except Exception as e:  # tf2onnx raises anything from ValueError to KeyError on unsupported graphs
        raise CtroptError(f"tf2onnx could not convert the graph: {type(e).__name__}: {e}") from None
    model = _finish(model, sequence_inputs)
    fetches = [graph.get_tensor_by_name(n) for n in outputs]
    out_names = [n.split(":")[0] for n in outputs]

    def feed(feeds):
        return {graph.get_tensor_by_name(_port(k)): v for k, v in feeds.items()}

    def run(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(out_names, session.run(fetches, feed(feeds))))

    id_names = _id_tensors(graph_def, model)

    def ids(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(id_names, session.run([graph.get_tensor_by_name(n) for n in id_names], feed(feeds))))

    return Export(model, run, "tf2onnx", tuple(id_names), ids if id_names else None)


# TensorFlow ops that take strings, which tf2onnx converts only with the ai.onnx.contrib opset
STRING_OPS = {"StringToHashBucketFast", "StringSplit", "StringSplitV2", "StaticRegexReplace", "StringJoin",
              "ReduceJoin", "StringToHashBucket", "StringToHashBucketStrong"}
TABLE_INIT_OPS = {"InitializeTableV2", "InitializeTableFromTextFileV2", "LookupTableImportV2"}
# ops whose output is an id computed from a string (compared exactly with TensorFlow's by check_export)
ID_OPS = {"StringToHashBucketFast", "LookupTableFindV2"}


def _has_strings(graph_def) -> bool:
    """The graph takes or hashes strings: a string placeholder or a string op."""
    string = 7  # tf.string's DataType enum
    return any(n.op in STRING_OPS or (n.op == "Placeholder" and n.attr["dtype"].type == string)
               for n in graph_def.node)


def _tables(graph_def, graph, session) -> dict:
    """{shared name: (keys, values)} of every lookup table, read after running the graph's table initializers."""
    tf = _tf()
    from tensorflow.python.ops import lookup_ops

    nodes = [n for n in graph_def.node if n.op in ("HashTableV2", "MutableHashTableV2")]
    if not nodes:
        return {}
    inits = [n.name for n in graph_def.node if n.op in TABLE_INIT_OPS]
    if not inits:
        raise CtroptError("the graph looks strings up in tables but holds no table initializer: freeze it with "
                          "the tables' init op among the output nodes (tf.compat.v1.tables_initializer's, e.g. "
                          "'init_all_tables')")
    session.run([graph.get_operation_by_name(n) for n in inits])
    tables = {}
    with graph.as_default():
        for n in nodes:
            handle = graph.get_operation_by_name(n.name).outputs[0]
            keys, values = lookup_ops.lookup_table_export_v2(
                handle, tf.as_dtype(n.attr["key_dtype"].type), tf.as_dtype(n.attr["value_dtype"].type))
            tables[n.attr["shared_name"].s] = tuple(session.run([keys, values]))
    return tables


def _convert_graph_def(graph_def, inputs, outputs, opset, tables) -> onnx.ModelProto:
    """tf2onnx on a frozen graph, with the contrib opset when it has strings. With tables, through
    tf2onnx's `_convert_common`, as its own checkpoint/Keras paths do: its public from_graph_def passes none."""
    import tf2onnx
    from tf2onnx import tf_loader

    extra = [onnx.helper.make_opsetid(strings.DOMAIN, 1)] if _has_strings(graph_def) else None
    if extra:  # "Cannot infer shape for .../LookupTableFindV2" for every table: not the user's business
        logging.getLogger("tf2onnx.shape_inference").setLevel(logging.ERROR)
    if not tables:
        model, _ = tf2onnx.convert.from_graph_def(graph_def, input_names=inputs, output_names=outputs,
                                                  opset=opset, extra_opset=extra)
        return _drop_unused_contrib(model)
    convert = getattr(tf2onnx.convert, "_convert_common", None)
    if convert is None:
        raise CtroptError(f"tf2onnx {tf2onnx.__version__} has no _convert_common: lookup tables need tf2onnx 1.16/1.17")
    tf = _tf()
    with tf.Graph().as_default():
        optimized = tf_loader.tf_optimize(inputs, outputs, graph_def)
    model, _ = convert(optimized, name="tf2onnx", continue_on_error=True, opset=opset, extra_opset=extra,
                       input_names=inputs, output_names=outputs, initialized_tables=tables)
    _refuse_unconverted(model)
    return _drop_unused_contrib(model)


def _refuse_unconverted(model: onnx.ModelProto) -> None:
    """tf2onnx with continue_on_error (the lookup-table path) leaves an op it has no handler for as a node of the
    ONNX domain named like the TensorFlow op: say which, rather than let onnxruntime refuse the model later."""
    from collections import Counter

    from ..graph import iter_proto_nodes

    left = Counter(n.op_type for n in iter_proto_nodes(model.graph)
                   if n.domain in ("", "ai.onnx") and not onnx.defs.has(n.op_type))
    if left:
        ops = ", ".join(f"{op} ({k})" for op, k in sorted(left.items()))
        raise CtroptError(f"tf2onnx has no converter for the TensorFlow op(s) {ops}: rewrite them in the model "
                          "before export, or register a tf2onnx handler (tf2onnx.handler.tf_op)")


def _drop_unused_contrib(model: onnx.ModelProto) -> onnx.ModelProto:
    """No ai.onnx.contrib import where no node uses it (a string placeholder that only a table reads)."""
    if not strings.uses_strings(model):
        kept = [o for o in model.opset_import if o.domain != strings.DOMAIN]
        del model.opset_import[:]
        model.opset_import.extend(kept)
    return model


def _id_tensors(graph_def, model: onnx.ModelProto) -> list[str]:
    """TensorFlow tensors that turn strings into ids and that the ONNX graph computes under the same name."""
    produced = {o for n in model.graph.node for o in n.output}
    string = 7
    names = [f"{n.name}:0" for n in graph_def.node if n.op in ID_OPS
             and (n.op != "LookupTableFindV2" or n.attr["Tin"].type == string)]
    return [n for n in names if n in produced]


def from_function(fn, input_signature, *, opset: int = DEFAULT_OPSET, sequence_inputs: tuple[str, ...] = ()) -> Export:
    """A tf.function (or any callable) with a list of tf.TensorSpec; names come from the specs."""
    tf = _tf()
    import tf2onnx

    function = fn if hasattr(fn, "get_concrete_function") else tf.function(fn)
    try:
        graph_def = function.get_concrete_function(*input_signature).graph.as_graph_def()
        extra = [onnx.helper.make_opsetid(strings.DOMAIN, 1)] if _has_strings(graph_def) else None
        model, _ = tf2onnx.convert.from_function(function, input_signature=input_signature, opset=opset,
                                                 extra_opset=extra)
    except Exception as e:
        raise CtroptError(f"tf2onnx could not convert the function: {type(e).__name__}: {e}") from None
    model = _finish(_drop_unused_contrib(model), sequence_inputs)
    names = [spec.name for spec in input_signature]
    out_names = [o.name for o in model.graph.output]

    def run(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        result = function(*[tf.constant(feeds[n]) for n in names])
        flat = tf.nest.flatten(result)
        return {n: np.asarray(t) for n, t in zip(out_names, flat)}

    return Export(model, run, "tf2onnx")


def from_keras(model, *, opset: int = DEFAULT_OPSET, sequence_inputs: tuple[str, ...] = ()) -> Export:
    """A Keras model. tf2onnx's from_keras fails on Keras 3, so the model is wrapped in a tf.function."""
    tf = _tf()
    specs = [tf.TensorSpec([None] + list(t.shape[1:]), t.dtype, name=_keras_input_name(t)) for t in model.inputs]

    def call(*args):
        return model(list(args) if len(args) > 1 else args[0], training=False)

    return from_function(tf.function(call), specs, opset=opset, sequence_inputs=sequence_inputs)


def _keras_input_name(t) -> str:
    return getattr(t, "name", "input").split(":")[0]


def from_saved_model(path: str | os.PathLike, *, signature: str = "serving_default", opset: int = DEFAULT_OPSET,
                     sequence_inputs: tuple[str, ...] = ()) -> Export:
    """A SavedModel directory: its serving signature becomes the ONNX graph."""
    tf = _tf()
    loaded = tf.saved_model.load(str(path))
    if signature not in loaded.signatures:
        raise CtroptError(f"{path}: no signature {signature!r}; it has {list(loaded.signatures)}")
    concrete = loaded.signatures[signature]
    specs = [tf.TensorSpec(s.shape, s.dtype, name=name)
             for name, s in sorted(concrete.structured_input_signature[1].items())]

    def call(*args):
        return concrete(**{spec.name: a for spec, a in zip(specs, args)})

    return from_function(tf.function(call), specs, opset=opset, sequence_inputs=sequence_inputs)


def from_frozen_pb(path: str | os.PathLike, inputs: list[str], outputs: list[str], **kw) -> Export:
    """A frozen GraphDef file (.pb)."""
    tf = _tf()
    graph_def = tf.compat.v1.GraphDef()
    try:
        graph_def.ParseFromString(Path(path).read_bytes())
    except Exception as e:
        raise CtroptError(f"{path}: not a frozen TensorFlow GraphDef ({e})") from None
    return from_graph_def(graph_def, inputs, outputs, **kw)


def from_checkpoint(meta_path: str | os.PathLike, inputs: list[str], outputs: list[str], **kw) -> Export:
    """A TF1 meta graph + checkpoint (model.ckpt.meta beside model.ckpt.index/.data): restored, then frozen."""
    tf = _tf()
    meta_path = str(meta_path)
    if not meta_path.endswith(".meta"):
        raise CtroptError(f"{meta_path}: expected the .meta file of a TF1 checkpoint")
    graph = tf.Graph()
    with graph.as_default(), tf.compat.v1.Session(graph=graph) as sess:
        saver = tf.compat.v1.train.import_meta_graph(meta_path, clear_devices=True)
        saver.restore(sess, meta_path[: -len(".meta")])
        frozen = tf.compat.v1.graph_util.convert_variables_to_constants(
            sess, graph.as_graph_def(), [n.split(":")[0] for n in outputs])
    return from_graph_def(frozen, inputs, outputs, **kw)


def export_path(path: str | os.PathLike, inputs: list[str] | None = None, outputs: list[str] | None = None,
                **kw) -> Export:
    """Pick the loader from what `path` is: SavedModel dir, .keras/.h5, .pb (frozen) or .meta (checkpoint)."""
    path = Path(path)
    if not path.exists():
        raise CtroptError(f"{path}: no such file or directory")
    if path.is_dir():
        return from_saved_model(path, **kw)
    if path.suffix in (".keras", ".h5"):
        tf = _tf()
        return from_keras(tf.keras.models.load_model(str(path), compile=False), **kw)
    if not inputs or not outputs:
        raise CtroptError(f"{path}: a {path.suffix} graph needs --input and --output tensor names")
    if path.suffix == ".meta":
        return from_checkpoint(path, inputs, outputs, **kw)
    return from_frozen_pb(path, inputs, outputs, **kw)


def _finish(model: onnx.ModelProto, sequence_inputs) -> onnx.ModelProto:
    strip_port_suffixes(model)
    name_dims(model, sequence_inputs)
    return model

