"""onnxruntime's SkipLayerNormalization against the Add + LayerNormalization it replaces: paired ratios in one run.

    python benchmarks/layernorm.py                  # transformer shapes of the corpus and a BERT-base layer, 1 thread
    python benchmarks/layernorm.py --seconds 3 --threads 2

onnxruntime fuses a residual Add and the LayerNormalization that reads it into com.microsoft.SkipLayerNormalization
when it knows their shapes. Both forms are built here as they reach the runtime: the fused op itself, and
Sum + LayerNormalization (what `residual-add-as-sum` writes, which the fusion leaves alone). They are timed
interleaved on the same inputs; > 1 means the fused op is slower. The Sum form is checked against the fused one.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ctropt.runtime import Runner  # noqa: E402
from ctropt.runtime.bench import bench  # noqa: E402

SHAPES = [(256, 21, 24), (256, 21, 64), (256, 51, 64), (256, 21, 256), (64, 128, 768)]


def model(shape: tuple, fused: bool):
    rng = np.random.default_rng(0)
    d = shape[-1]
    inits = [helper.make_tensor("gamma", TensorProto.FLOAT, [d], rng.normal(size=d).astype(np.float32)),
             helper.make_tensor("beta", TensorProto.FLOAT, [d], rng.normal(size=d).astype(np.float32))]
    if fused:
        nodes = [helper.make_node("SkipLayerNormalization", ["x", "skip", "gamma", "beta"], ["y"],
                                  domain="com.microsoft", epsilon=1e-5)]
    else:
        nodes = [helper.make_node("Sum", ["x", "skip"], ["s"]),
                 helper.make_node("LayerNormalization", ["s", "gamma", "beta"], ["y"], axis=-1, epsilon=1e-5)]
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", shape[1], d]) for n in ("x", "skip", "y")]
    graph = helper.make_graph(nodes, "layer_norm", io[:2], io[2:], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    print(f"onnxruntime CPU, {args.threads} thread(s); time(SkipLayerNormalization) / time(Sum + LayerNormalization)\n")
    print("| [B, L, D] | ratio (p10–p90) | fused µs (p50) | Sum + LayerNormalization µs (p50) |")
    print("|---|---|---|---|")
    for shape in SHAPES:
        rng = np.random.default_rng(1)
        feeds = {"x": rng.normal(size=shape).astype(np.float32), "skip": rng.normal(size=shape).astype(np.float32)}
        fused, plain = Runner(model(shape, True), "ort-cpu", args.threads), Runner(model(shape, False), "ort-cpu",
                                                                                  args.threads)
        np.testing.assert_allclose(fused.run(feeds)["y"], plain.run(feeds)["y"], atol=1e-4)
        r = bench([fused, plain], feeds, shape[0], seconds=args.seconds, min_runs=20)  # ratio: time(fused)/time(Sum)
        print(f"| {list(shape)} | {r.ratio:.2f} ({r.ratio_p10:.2f}–{r.ratio_p90:.2f}) | "
              f"{r.latency[0].p50_ms * 1000:.0f} | {r.latency[1].p50_ms * 1000:.0f} |")


if __name__ == "__main__":
    main()
