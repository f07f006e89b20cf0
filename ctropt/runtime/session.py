"""Running a model on onnxruntime or OpenVINO (in memory, or through a temporary file when large)."""

from __future__ import annotations

import os
import tempfile

import numpy as np
import onnx

from ..graph import CtroptError, PROTOBUF_LIMIT, initializer_bytes, runtime_ir_version, save

BACKENDS = ("ort-cpu", "openvino-cpu")


def _quiet_onnxruntime() -> None:
    """Graph-optimizer warnings from onnxruntime (also in constant folding) are noise for ctropt's users."""
    import onnxruntime as ort

    ort.set_default_logger_severity(3)


_quiet_onnxruntime()


class Runner:
    """One loaded model on one backend; `run(feeds)` returns {output name: array}."""

    def __init__(self, model: onnx.ModelProto | str, backend: str = "ort-cpu", threads: int = 0):
        if backend not in BACKENDS:
            raise CtroptError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
        self.backend = backend
        self._tmp = None
        source = model
        proto = model if isinstance(model, onnx.ModelProto) else onnx.load(model, load_external_data=False)
        self._onnx_outputs = [o.name for o in proto.graph.output]
        if isinstance(model, onnx.ModelProto):
            if initializer_bytes(model) > PROTOBUF_LIMIT // 2:
                self._tmp = tempfile.TemporaryDirectory(prefix="ctropt-run-")
                source = str(save(model, os.path.join(self._tmp.name, "model.onnx"), external_data=True))
            else:
                saved_ir = model.ir_version
                model.ir_version = runtime_ir_version(model)
                source = model.SerializeToString()
                model.ir_version = saved_ir
        try:
            if backend == "ort-cpu":
                self._init_ort(source, threads)
            else:
                self._init_openvino(source, threads)
        except CtroptError:
            raise
        except Exception as e:  # the runtimes raise many exception types for unloadable models
            raise CtroptError(f"{backend} cannot load the model: {_first_line(e)}") from None

    def _init_ort(self, source, threads):
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        if threads:
            opts.intra_op_num_threads = threads
            opts.inter_op_num_threads = 1
        self._sess = ort.InferenceSession(source, opts, providers=["CPUExecutionProvider"])
        self.output_names = [o.name for o in self._sess.get_outputs()]

    def _init_openvino(self, source, threads):
        import openvino as ov

        core = ov.Core()
        model = core.read_model(source) if isinstance(source, str) else core.read_model(source, b"")
        config = {"INFERENCE_NUM_THREADS": threads} if threads else {}
        self._compiled = core.compile_model(model, "CPU", config)
        self._request = self._compiled.create_infer_request()
        onnx_names = set(self._onnx_outputs)
        # OpenVINO gives each output several names; report the ONNX graph output name.
        self.output_names = [next((n for n in sorted(o.get_names()) if n in onnx_names), o.get_any_name())
                             for o in self._compiled.outputs]

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        try:
            if self.backend == "ort-cpu":
                return dict(zip(self.output_names, self._sess.run(None, feeds)))
            results = self._request.infer(feeds)
            return {name: np.asarray(results[out]) for name, out in zip(self.output_names, self._compiled.outputs)}
        except Exception as e:
            raise CtroptError(f"{self.backend} failed to run the model: {_first_line(e)}") from None


def run_model(model: onnx.ModelProto | str, feeds: dict[str, np.ndarray], backend: str = "ort-cpu") -> dict:
    return Runner(model, backend).run(feeds)


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return (lines[0] if lines else type(e).__name__)[:500]
