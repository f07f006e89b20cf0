"""A stand-in for Triton's onnxruntime backend, as a Python-based backend named `onnxruntime` (Triton loads
`<backend-directory>/onnxruntime/model.py` for every model whose config says `backend: "onnxruntime"`).

Triton's real onnxruntime backend is not on the package registries; this one does what it does with a model
repository, so that a real Triton server (the one in the nvidia-pytriton wheel) parses ctropt's config.pbtxt, finds
`<model>/<version>/model.onnx` and resolves each `model_operations { op_library_filename }` as written: the real
backend hands each string to onnxruntime's RegisterCustomOpsLibrary (dlopen), and so does this one, through
SessionOptions.register_custom_ops_library. One thread per session, as ctropt measures."""

import json
import os
import sys

# the stub's embedded interpreter ignores PYTHONPATH: numpy and onnxruntime come from the paths it names
sys.path[:0] = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]

import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        for library in config.get("model_operations", {}).get("op_library_filename", []):
            options.register_custom_ops_library(library)
        path = os.path.join(args["model_repository"], args["model_version"], "model.onnx")
        self.session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        self.inputs = [i["name"] for i in config["input"]]
        self.outputs = [o["name"] for o in config["output"]]

    def execute(self, requests):
        responses = []
        for request in requests:
            feeds = {name: pb_utils.get_input_tensor_by_name(request, name).as_numpy() for name in self.inputs}
            try:
                values = self.session.run(self.outputs, feeds)
            except Exception as e:  # the client gets onnxruntime's message, as from the real backend
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e))))
                continue
            responses.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor(name, np.ascontiguousarray(v)) for name, v in zip(self.outputs, values)]))
        return responses
