"""PyTorch → ONNX with either torch.onnx exporter: the legacy TorchScript one or the dynamo one."""

from __future__ import annotations

import io
import warnings

import numpy as np
import onnx

from ..graph import CtroptError
from .common import DEFAULT_OPSET, Export, name_dims

EXPORTERS = ("legacy", "dynamo")


def _torch():
    try:
        import torch
    except ImportError as e:
        raise CtroptError(f"PyTorch export needs the torch extra: pip install 'ctropt[torch]' ({e})") from None
    return torch


# The dynamo exporter works at opset 18; asked for 17 it down-converts and leaves Split(num_outputs),
# an opset-18 attribute onnxruntime rejects.
DYNAMO_MIN_OPSET = 18


def export_module(module, example: dict[str, np.ndarray], outputs: list[str], *, exporter: str = "legacy",
                  opset: int | None = None, sequence_inputs: tuple[str, ...] = ()) -> Export:
    """Export `module(*inputs)` (positional, in the order of `example`) with a dynamic batch axis
    (and a dynamic axis 1 for `sequence_inputs`). opset None: 17 (legacy) or 18 (dynamo)."""
    torch = _torch()
    if exporter not in EXPORTERS:
        raise CtroptError(f"unknown torch exporter {exporter!r}; choose {' or '.join(EXPORTERS)}")
    if opset is None:
        opset = DEFAULT_OPSET if exporter == "legacy" else DYNAMO_MIN_OPSET
    elif exporter == "dynamo" and opset < DYNAMO_MIN_OPSET:
        raise CtroptError(f"the dynamo exporter needs opset >= {DYNAMO_MIN_OPSET} (at {opset} it writes an "
                          "invalid Split); use --opset 18 or the legacy exporter")
    module = module.eval()
    names = list(example)
    args = tuple(torch.from_numpy(np.asarray(example[n])) for n in names)
    axes = {n: {0: "batch", **({1: "seq_len"} if n in sequence_inputs else {})} for n in names}
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            if exporter == "legacy":
                buf = io.BytesIO()
                torch.onnx.export(module, args, buf, dynamo=False, input_names=names, output_names=outputs,
                                  dynamic_axes={**axes, **{o: {0: "batch"} for o in outputs}}, opset_version=opset)
                model = onnx.load_from_string(buf.getvalue())
            else:
                batch = torch.export.Dim("batch", min=1)
                seq = torch.export.Dim("seq_len", min=2)
                shapes = tuple({0: batch, **({1: seq} if n in sequence_inputs else {})} for n in names)
                program = torch.onnx.export(module, args, dynamo=True, input_names=names, output_names=outputs,
                                            dynamic_shapes=shapes, opset_version=opset, verbose=False)
                model = program.model_proto
    except CtroptError:
        raise
    except Exception as e:  # the exporters raise many kinds of errors for unsupported code
        raise CtroptError(f"torch.onnx ({exporter}) could not export the module: {type(e).__name__}: "
                          f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}") from None
    name_dims(model, sequence_inputs)

    def run(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        with torch.no_grad():
            result = module(*[torch.from_numpy(np.asarray(feeds[n])) for n in names])
        flat = result if isinstance(result, (tuple, list)) else [result]
        return {o: t.detach().numpy() for o, t in zip(outputs, flat)}

    return Export(model, run, f"torch.onnx {exporter}")
