"""TensorFlow → ONNX through tf2onnx, from every form users keep their models in.

Every entry point returns an `Export`: the ONNX model (inputs/outputs named as in TensorFlow, without
':0'; dynamic batch and sequence axes named `batch` / `seq_len`) and a function that runs the
original in TensorFlow, so `check_export` can compare the two.
"""

from __future__ import annotations

import os
from pathlib import Path
import numpy as np
import onnx

from ..graph import CtroptError
from .common import DEFAULT_OPSET, Export, name_dims, strip_port_suffixes


def _tf():
    try:
        import tensorflow as tf
        import tf2onnx  # noqa: F401
    except ImportError as e:
        raise CtroptError(f"TensorFlow export needs the tf extra: pip install 'ctropt[tf]' ({e})") from None
    return tf


def _port(name: str) -> str:
    return name if ":" in name else f"{name}:0"


def from_graph_def(graph_def, inputs: list[str], outputs: list[str], *, opset: int = DEFAULT_OPSET,
                   sequence_inputs: tuple[str, ...] = ()) -> Export:
    """A frozen GraphDef (variables already constants) with named placeholders and outputs."""
    tf = _tf()
    import tf2onnx

    inputs, outputs = [_port(n) for n in inputs], [_port(n) for n in outputs]
    try:
        model, _ = tf2onnx.convert.from_graph_def(graph_def, input_names=inputs, output_names=outputs, opset=opset)
    except Exception as e:  # tf2onnx raises anything from ValueError to KeyError on unsupported graphs
        raise CtroptError(f"tf2onnx could not convert the graph: {type(e).__name__}: {e}") from None
    model = _finish(model, sequence_inputs)
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.import_graph_def(graph_def, name="")
    session = tf.compat.v1.Session(graph=graph)
    fetches = [graph.get_tensor_by_name(n) for n in outputs]
    out_names = [n.split(":")[0] for n in outputs]

    def run(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        values = session.run(fetches, {graph.get_tensor_by_name(_port(k)): v for k, v in feeds.items()})
        return dict(zip(out_names, values))

    return Export(model, run, "tf2onnx")


def from_function(fn, input_signature, *, opset: int = DEFAULT_OPSET, sequence_inputs: tuple[str, ...] = ()) -> Export:
    """A tf.function (or any callable) with a list of tf.TensorSpec; names come from the specs."""
    tf = _tf()
    import tf2onnx

    function = fn if hasattr(fn, "get_concrete_function") else tf.function(fn)
    try:
        model, _ = tf2onnx.convert.from_function(function, input_signature=input_signature, opset=opset)
    except Exception as e:
        raise CtroptError(f"tf2onnx could not convert the function: {type(e).__name__}: {e}") from None
    model = _finish(model, sequence_inputs)
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

