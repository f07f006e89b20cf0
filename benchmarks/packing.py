"""Input packing on onnxruntime CPU: the optimized model vs the same model after pack-inputs, paired per batch.

    python benchmarks/packing.py [--seconds 4]

Two ways to feed the packed model: tensors the client already packed, and the old feeds packed per call by the
Python adapter (`Packing.pack`). Ratio = time(unpacked) / time(packed): > 1 means packing is faster.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from common import THIRD, ZOO  # noqa: E402  (puts the checkout on sys.path)

import ctropt  # noqa: E402
from ctropt.packing import pack_inputs  # noqa: E402
from ctropt.runtime import Runner, generate_inputs  # noqa: E402

MODELS = {"zoo wdl_tf": ZOO / "wdl_tf.onnx", "DeepCTR WDL": THIRD / "deepctr_WDL_tf2onnx.onnx"}


def paired(run_a, run_b, seconds: float) -> tuple[float, float, float]:
    for _ in range(20):
        run_a(), run_b()
    ratios, end, i = [], time.time() + seconds, 0
    while time.time() < end:
        t = [0.0, 0.0]
        for w in ((0, 1) if i % 2 == 0 else (1, 0)):
            t0 = time.perf_counter()
            (run_a if w == 0 else run_b)()
            t[w] = time.perf_counter() - t0
        ratios.append(t[0] / t[1])
        i += 1
    return float(np.median(ratios)), float(np.percentile(ratios, 10)), float(np.percentile(ratios, 90))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=4.0)
    args = ap.parse_args()
    print("| model | feeds | batch 1 | 64 | 512 |")
    print("|---|---|---|---|---|")
    for name, path in MODELS.items():
        raw = ctropt.load(path)
        optimized = ctropt.optimize(raw).model
        packed, packing = pack_inputs(optimized)  # pack the optimized model: the passes expect the exporter's inputs
        a, b = Runner(optimized, threads=1), Runner(packed, threads=1)
        for mode in ("packed by the client", "old feeds + adapter per call"):
            cells = []
            for batch in (1, 64, 512):
                feeds = generate_inputs(raw, batch=batch)
                ready = packing.pack(feeds)
                run_b = (lambda: b.run(ready)) if mode.startswith("packed") else (lambda: b.run(packing.pack(feeds)))
                r, lo, hi = paired(lambda: a.run(feeds), run_b, args.seconds)
                cells.append(f"{r:.2f}× ({lo:.2f}–{hi:.2f})")
            print(f"| {name} | {mode} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
