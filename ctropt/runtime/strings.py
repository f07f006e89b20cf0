"""String features: the ``ai.onnx.contrib`` ops tf2onnx writes for them, run by onnxruntime-extensions.

tf2onnx converts TensorFlow's string ops into that domain when given its opset (``StringToHashBucketFast``,
``StringSplit``, ``StringEqual`` for a string ``Equal``/``NotEqual``, ``StringJoin``, ``StringRegexReplace``);
vocabulary tables become ``ai.onnx.ml`` ``CategoryMapper``, which onnxruntime runs itself. A session over a
model with contrib nodes needs onnxruntime-extensions' library registered (``register_if_used``).

Hashing: TensorFlow's ``StringToHashBucketFast`` is farmhash ``Fingerprint64(s) % buckets``. onnxruntime-extensions
0.13 and 0.14 compute exactly that; 0.15 (June 2025, "Remove farmhash dependency") hashes with ``std::hash``, so
every id differs from TensorFlow's. Before a model that hashes runs, the library is checked on known TensorFlow
values (``hashes_like_tensorflow``), and a library that hashes otherwise is refused with the version to install.

The library is found without importing the ``onnxruntime_extensions`` package: 0.14's ``__init__`` imports
``transformers`` and sets ``PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python`` for the whole process.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
from pathlib import Path

import numpy as np
import onnx

from ..graph import CtroptError, iter_proto_nodes

DOMAIN = "ai.onnx.contrib"
PACKAGE = "onnxruntime-extensions"
REQUIREMENT = "onnxruntime-extensions>=0.13,<0.15"
INSTALL_HINT = f"pip install '{REQUIREMENT}' (or: pip install 'ctropt[strings]')"
# tf.strings.to_hash_bucket_fast(s, 2**63 - 1) in TensorFlow 2.21: farmhash Fingerprint64 nearly whole
KNOWN_HASHES = {"": 1936946117179621456, "ctropt": 1878889354686084188, "user_42": 2770529383709671217,
                "日本語": 6457860189211899976}


def uses_strings(model: onnx.ModelProto) -> bool:
    """Whether the model has a node of onnxruntime-extensions' domain (at any depth)."""
    return any(n.domain == DOMAIN for n in iter_proto_nodes(model.graph))


def has_string_inputs(model: onnx.ModelProto) -> bool:
    """Whether a graph input is a string tensor (a model OpenVINO serves through `split-strings`)."""
    return any(i.type.tensor_type.elem_type == onnx.TensorProto.STRING for i in model.graph.input)


def _hashes(model: onnx.ModelProto) -> bool:
    return any(n.domain == DOMAIN and n.op_type == "StringToHashBucketFast" for n in iter_proto_nodes(model.graph))


def version() -> str | None:
    """The installed onnxruntime-extensions' version, None when it is not installed."""
    try:
        return importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None


def library_path() -> Path:
    """onnxruntime-extensions' custom-op library (the package's ``get_library_path()``, found without importing
    it); a CtroptError saying what to install when it is missing."""
    spec = importlib.util.find_spec("onnxruntime_extensions")
    folders = list(spec.submodule_search_locations or []) if spec else []
    found = [p for f in folders for p in sorted(Path(f).glob("_extensions_pydll*")) if p.suffix in (".so", ".pyd",
                                                                                                 ".dylib")]
    if not found:
        raise CtroptError(f"the model has string ops ({DOMAIN}) and {PACKAGE} is not installed: {INSTALL_HINT}")
    return found[0]


def available() -> bool:
    try:
        library_path()
    except CtroptError:
        return False
    return True


@functools.lru_cache(maxsize=None)
def hashes_like_tensorflow() -> bool:
    """Whether the installed library's StringToHashBucketFast gives TensorFlow's ids (checked on KNOWN_HASHES)."""
    import onnxruntime as ort

    from onnx import TensorProto, helper

    node = helper.make_node("StringToHashBucketFast", ["s", "n"], ["ids"], domain=DOMAIN)
    graph = helper.make_graph([node], "probe", [helper.make_tensor_value_info("s", TensorProto.STRING, [None])],
                              [helper.make_tensor_value_info("ids", TensorProto.INT64, [None])],
                              [helper.make_tensor("n", TensorProto.INT64, [1], [2**63 - 1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)])
    model.ir_version = 8
    opts = ort.SessionOptions()
    opts.register_custom_ops_library(str(library_path()))
    session = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    (ids,) = session.run(None, {"s": np.array(list(KNOWN_HASHES), dtype=object)})
    return ids.tolist() == list(KNOWN_HASHES.values())


def register(session_options, model: onnx.ModelProto | None = None) -> None:
    """Register onnxruntime-extensions' library with onnxruntime SessionOptions. When `model` hashes strings, the
    library must hash as TensorFlow does; a CtroptError otherwise (ids would all differ)."""
    path = library_path()
    if model is not None and _hashes(model) and not hashes_like_tensorflow():
        raise CtroptError(f"{PACKAGE} {version()} hashes strings with std::hash, not TensorFlow's farmhash "
                          f"(0.15 dropped it): every StringToHashBucketFast id would differ from TensorFlow's; "
                          f"{INSTALL_HINT}")
    session_options.register_custom_ops_library(str(path))


def register_if_used(session_options, model: onnx.ModelProto) -> None:
    """`register` when the model has string ops; nothing otherwise."""
    if uses_strings(model):
        register(session_options, model)
