"""The `--option KEY=VALUE` keys: ctropt's own, with their meaning, and those plugin passes declare."""

from __future__ import annotations

from ..graph import CtroptError
from ..passes import REGISTRY

# Every key the passes and the manager read from their options (`--option KEY=VALUE`), with its meaning; a plugin
# declares its own with register_pass(options=...). tests/test_cli.py checks each key read in ctropt/ is here.
PASS_OPTIONS = {
    "ort_kernels": "auto (default): ctropt's onnxruntime kernels where faster; off: standard ops only",
    "rnn_ort_form": "lower-rnn-ort's form: auto, kernel, standard, scan or gru-op",
    "attention_ort_form": "attention-core-kernel's form: auto, kernel (insist) or standard (leave the ops)",
    "rnn_openvino_form": "lower-rnn-openvino's form: auto, scan, gru-op or augru-unrolled",
    "static_seq_len": "the history length T fixed for OpenVINO (as --static-seq-len)",
    "user_inputs": "the inputs that describe the user (as --user-inputs)",
    "fold_size_cap": "fold-constants' largest folded constant, in bytes (default 16 MiB)",
    "calib": "quantize-int8's calibration data, an .npz (as --calib)",
    "calibrator": "quantize-int8's calibration: minmax (default), percentile or entropy",
    "int8_eval": "quantize-int8's evaluation data, an .npz (default: the calibration data)",
    "int8_threshold": "quantize-int8's accuracy gate: relative mean error bound (default 0.005)",
    "int8_max_abs": "quantize-int8's accuracy gate: worst-row error bound (default 0.01)",
    "int8_batch": "rows quantize-int8's speed gate times each layer at (default 256)",
    "int8_bench_seconds": "seconds quantize-int8's speed gate times each layer (default 1.0)",
    "int8_min_speedup": "a layer goes INT8 where at least this much faster (default 1.05; 0: no speed gate)",
    "int8_reduce_range": "7-bit INT8 weights: auto (default: where the CPU lacks VNNI), true or false",
    "fp16_threshold": "convert-float16's accuracy gate: relative mean error bound (default 0.002)",
    "fp16_max_abs": "convert-float16's accuracy gate: worst-row error bound (default 0.005)",
}


def _known_options() -> dict[str, str]:
    """ctropt's option keys and those the registered (plugin) passes declare."""
    return {**PASS_OPTIONS, **{k: v for p in REGISTRY.values() for k, v in p.options.items()}}


def _pass_options(items: list[str]) -> dict:
    """--option KEY=VALUE items → the pass options; an unknown key is an error that names the closest."""
    import difflib

    options, known = {}, _known_options()
    for item in items:
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise CtroptError(f"--option wants KEY=VALUE, got {item!r}")
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            raise CtroptError(f"--option {key}: unknown key" + (f"; did you mean {close[0]}?" if close else "")
                              + f" (known: {', '.join(sorted(known))}; `ctropt passes --options` says what each does)")
        options[key] = int(value) if value.strip().lstrip("-").isdigit() else value.strip()
    return options
