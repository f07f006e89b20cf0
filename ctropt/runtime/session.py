"""One interface over the runtimes ctropt hands models to: onnxruntime (CPU, CUDA, OpenVINO EPs) and
OpenVINO's own runtime (CPU, GPU). Models run in memory, or through a temporary file when large."""

from __future__ import annotations

import os
import tempfile

import numpy as np
import onnx

from .. import kernels
from . import strings
from .runnable import check_runnable, model_name
from ..graph import CtroptError, PROTOBUF_LIMIT, initializer_bytes, runtime_ir_version, save, weights

# backend -> (runtime, device or execution provider)
BACKENDS = {
    "ort-cpu": ("ort", "CPUExecutionProvider"),
    "ort-cuda": ("ort", "CUDAExecutionProvider"),
    "ort-trt": ("ort", "TensorrtExecutionProvider"),
    "ort-openvino": ("ort", "OpenVINOExecutionProvider"),
    "openvino-cpu": ("openvino", "CPU"),
    "openvino-gpu": ("openvino", "GPU"),
}
PRECISIONS = ("f32", "f16", "bf16")
_INSTALL_HINT = {
    "CUDAExecutionProvider": "install onnxruntime-gpu on a machine with an NVIDIA GPU and CUDA",
    "TensorrtExecutionProvider": "install onnxruntime-gpu and TensorRT's libraries on a machine with an NVIDIA GPU",
    "OpenVINOExecutionProvider": "install its plugin: pip install onnxruntime-ep-openvino",
    "GPU": "OpenVINO needs an Intel GPU and its driver",
}


def _quiet_onnxruntime() -> None:
    """Graph-optimizer warnings from onnxruntime (also in constant folding) are noise for ctropt's users."""
    import onnxruntime as ort

    ort.set_default_logger_severity(4)  # errors reach the user as CtroptError messages instead


_quiet_onnxruntime()


def openvino_plugin_devices() -> tuple[list, str]:
    """onnxruntime's OpenVINO execution provider as its plugin package ships it (onnxruntime-ep-openvino, the EP
    ABI): registered once per process, as onnxruntime documents plugin EPs; (the EP devices of OpenVINO's CPU, "")
    or ([], why there are none)."""
    import onnxruntime as ort

    try:
        import onnxruntime_ep_openvino as plugin
    except ImportError:
        return [], _INSTALL_HINT["OpenVINOExecutionProvider"]
    name = plugin.get_ep_name()
    if not _PLUGINS_REGISTERED and not any(d.ep_name == name for d in ort.get_ep_devices()):   # not by the host
        try:
            ort.register_execution_provider_library("ctropt-openvino-ep", plugin.get_library_path())
        except Exception as e:  # a library onnxruntime cannot load (another onnxruntime ABI)
            return [], f"onnxruntime cannot load the OpenVINO EP plugin: {_first_line(e)}"
        _PLUGINS_REGISTERED.append(name)
    found = [d for d in ort.get_ep_devices() if d.ep_name == name]
    cpu = [d for d in found if d.ep_metadata.get("ov_device") == "CPU"]
    if not cpu:
        host = next((d.device for d in ort.get_ep_devices() if d.ep_name == "CPUExecutionProvider"), None)
        vendor = f" (this machine's CPU: {host.vendor})" if host is not None else ""
        return [], ("the OpenVINO EP plugin loads but claims no CPU here: it takes Intel devices only" + vendor
                    if not found else "the OpenVINO EP plugin offers no CPU device here")
    return cpu, ""


_PLUGINS_REGISTERED: list[str] = []


def available_backends() -> dict[str, str]:
    """Every backend with 'available' or the reason it is not."""
    import onnxruntime as ort

    providers = set(ort.get_available_providers())
    try:
        import openvino as ov

        devices, no_openvino = set(ov.Core().available_devices), ""
    except ImportError:   # a GPU image with onnxruntime-gpu alone
        devices, no_openvino = set(), "pip install openvino"
    status = {}
    for name, (runtime, device) in BACKENDS.items():
        present = device in providers if runtime == "ort" else any(d.split(".")[0] == device for d in devices)
        why = (runtime == "openvino" and no_openvino) or _INSTALL_HINT.get(device, "missing")
        if present and device == "TensorrtExecutionProvider" and not _tensorrt_loads():
            present, why = False, "onnxruntime-gpu has the provider, but TensorRT's libnvinfer does not load here " \
                                  "(install tensorrt)"
        if not present and device == "OpenVINOExecutionProvider":   # the plugin package, not a build of its own
            plugin, why = openvino_plugin_devices()
            present = bool(plugin)
        status[name] = "available" if present else f"not available: {why}"
    return status


def _tensorrt_loads() -> bool:
    """onnxruntime-gpu lists its TensorRT provider wherever the wheel has it; sessions then fall back to CUDA with
    a banner when TensorRT's own library is missing. Loadable: on the library path, or pip's tensorrt-libs."""
    import ctypes
    import importlib

    try:
        ctypes.CDLL("libnvinfer.so.10")
        return True
    except OSError:
        try:
            importlib.import_module("tensorrt_libs")   # pip's TensorRT: importing it loads its libraries
            return True
        except ImportError:
            return False


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise CtroptError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    state = available_backends()[backend]
    if state != "available":
        raise CtroptError(f"backend {backend} is {state}")


class Runner:
    """One loaded model on one backend; `run(feeds)` returns {output name: array}.

    threads: 0 = the runtime's default (all cores). precision: an OpenVINO inference precision hint (default f32,
    which OpenVINO's CPU default is not where the CPU has bf16); on ort-trt, f16 builds FP16 TensorRT engines. The
    other onnxruntime backends run the model's own types (an FP16 model: `ctropt optimize --precision f16`).
    initializers: {name: onnxruntime.OrtValue} used instead of the model's own (onnxruntime; the caller keeps
    them alive), so that several sessions hold one copy of the same weights. name: how errors name the model
    (default: a path's file name). A model with ops the backend's runtime cannot run is refused before it is
    handed over (`runnable.check_runnable`).
    """

    def __init__(self, model: onnx.ModelProto | str, backend: str = "ort-cpu", threads: int = 0,
                 precision: str | None = None, initializers: dict | None = None, *, name: str | None = None):
        check_backend(backend)
        if precision is not None and precision not in PRECISIONS:
            raise CtroptError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
        if precision not in (None, "f32") and backend.startswith("ort") and (backend, precision) != ("ort-trt", "f16"):
            raise CtroptError(f"{backend} runs the model's own types: make an FP16 model with "
                              "`ctropt optimize --device cuda --precision f16`, or use ort-trt or openvino")
        self.backend, self.precision = backend, precision
        runtime, device = BACKENDS[backend]
        self._tmp = None
        source = model
        proto = model if isinstance(model, onnx.ModelProto) else onnx.load(model, load_external_data=False)
        check_runnable(proto, backend, model_name(model, name))
        self._onnx_outputs = [o.name for o in proto.graph.output]
        self._needs_kernels = kernels.uses_kernels(proto)
        self._stored = None  # the model, where a weight store holds its large tensors (onnxruntime reads them there)
        self._strings = proto if strings.uses_strings(proto) else None  # string ops: onnxruntime-extensions
        self._keep = []  # OrtValues of a weight store's mapped tensors: they must outlive the session
        stored = isinstance(model, onnx.ModelProto) and weights.stored(model) and weights.active() is not None
        if stored and runtime != "ort":  # OpenVINO reads the store's tensors by path
            source = str(weights.active().path_for(model))
        elif isinstance(model, onnx.ModelProto):
            if initializer_bytes(model) > PROTOBUF_LIMIT // 2 and not stored:
                self._tmp = tempfile.TemporaryDirectory(prefix="ctropt-run-")
                source = str(save(model, os.path.join(self._tmp.name, "model.onnx"), external_data=True))
            else:  # a weight store's tensors: onnxruntime takes its mapped arrays (_init_ort)
                self._stored = model if stored else None
                saved_ir = model.ir_version
                model.ir_version = runtime_ir_version(model)
                source = model.SerializeToString()
                model.ir_version = saved_ir
        try:
            if runtime == "ort":
                self._init_ort(source, device, threads, initializers or {})
            else:
                self._init_openvino(source, device, threads, precision)
        except CtroptError:
            raise
        except Exception as e:  # the runtimes raise many exception types for unloadable models
            raise CtroptError(f"{backend} cannot load the model: {_first_line(e)}") from None

    def _init_ort(self, source, provider, threads, initializers):
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.log_severity_level = 4
        if self._stored is not None:
            self._keep = weights.attach(opts, self._stored)
        for name, value in initializers.items():
            opts.add_initializer(name, value)
        if threads:
            opts.intra_op_num_threads = threads
            opts.inter_op_num_threads = 1
        if self._needs_kernels:
            kernels.register(opts)
        if self._strings is not None:
            strings.register(opts, self._strings)
        if provider == "OpenVINOExecutionProvider" and provider not in ort.get_available_providers():
            devices, why = openvino_plugin_devices()
            if not devices:
                raise CtroptError(f"ort-openvino is not available: {why}")
            opts.add_provider_for_devices(devices, {"num_of_threads": str(threads)} if threads else {})
            self._sess = ort.InferenceSession(source, opts)
        else:
            self._sess = ort.InferenceSession(source, opts, providers=_providers(provider, self.precision))
        self.output_names = [o.name for o in self._sess.get_outputs()]

    def _init_openvino(self, source, device, threads, precision):
        import openvino as ov

        core = ov.Core()
        model = core.read_model(source) if isinstance(source, str) else core.read_model(source, b"")
        config = {}
        if threads:
            config["INFERENCE_NUM_THREADS"] = threads
        # f32 unless asked otherwise: on a CPU with AVX512_BF16, OpenVINO's default is bf16 (PaddleRec DCN: 8.5e-4
        # off the framework's outputs by default, 6e-8 with f32)
        config["INFERENCE_PRECISION_HINT"] = precision or "f32"
        self._compiled = core.compile_model(model, device, config)
        self._request = self._compiled.create_infer_request()
        # OpenVINO's in-memory reader drops graph inputs no node reads; runs feed only what the model takes.
        self._ov_inputs = {n for port in self._compiled.inputs for n in port.get_names()}
        onnx_names = set(self._onnx_outputs)
        # OpenVINO gives each output several names; report the ONNX graph output name.
        self.output_names = [next((n for n in sorted(o.get_names()) if n in onnx_names), o.get_any_name())
                             for o in self._compiled.outputs]

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        try:
            if BACKENDS[self.backend][0] == "ort":
                return dict(zip(self.output_names, self._sess.run(None, feeds)))
            results = self._request.infer({k: v for k, v in feeds.items() if k in self._ov_inputs})
            return {name: np.asarray(results[out]) for name, out in zip(self.output_names, self._compiled.outputs)}
        except Exception as e:
            raise CtroptError(f"{self.backend} failed to run the model: {_first_line(e)}") from None


def _providers(provider: str, precision: str | None) -> list:
    """onnxruntime's provider list for one backend, the CPU last for the ops a GPU provider lacks. CUDA computes
    FP32 MatMuls in FP32 (not TF32, onnxruntime's default), so an FP32 model keeps its outputs; TensorRT builds FP16
    engines where precision f16 asks for them and caches them beside the temporary files."""
    if provider == "CPUExecutionProvider":
        return [provider]
    cuda = ("CUDAExecutionProvider", {"use_tf32": "0"})
    if provider == "CUDAExecutionProvider":
        return [cuda, "CPUExecutionProvider"]
    trt = {"trt_fp16_enable": "1" if precision == "f16" else "0", "trt_engine_cache_enable": "1",
           "trt_engine_cache_path": os.path.join(tempfile.gettempdir(), "ctropt-trt-cache")}
    return [(provider, trt), cuda, "CPUExecutionProvider"]


def run_model(model: onnx.ModelProto | str, feeds: dict[str, np.ndarray], backend: str = "ort-cpu") -> dict:
    return Runner(model, backend).run(feeds)


_NOISE = ("Exception from", "Check 'false' failed", "FrontEnd API failed", "Model wasn't fully converted",
          "Failed operations detailed log", "Summary:")


def _first_line(e: Exception) -> str:
    """A runtime error in one line: OpenVINO's multi-line reports without their boilerplate."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    useful = [ln for ln in lines if not ln.startswith(_NOISE)] or lines or [type(e).__name__]
    return " ".join(useful)[:600]
