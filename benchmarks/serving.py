"""Batch buckets vs the dynamic model on a request mix like seed 002's, paired, in one run.

    python benchmarks/serving.py [--only wdl_tf,...] [--buckets 1,8,32,64,128,256,512] [--requests 200] [--rounds 5]
                                 [--policy measured|pad] [--exact] [--backend ort-cpu|openvino-cpu]

For each model: dynamic = `ctropt optimize --passes all` (one model, dynamic batch); bucketed =
`ctropt specialize --batch BUCKETS` served by `BucketedSession` (policy "measured": a request runs padded on its
bucket where that was timed faster at start-up, else on the dynamic model; "pad": always padded). `--exact`
also times each bucket model against the dynamic one at exactly its batch (no padding). `--backend openvino-cpu`
runs both on OpenVINO (the models optimized with `--target openvino`).
The mix: 45 % of requests at the maximum batch (512), 7.4 % at 45, 2.3 % at 1, the rest spread evenly
over 2..511 (seed 002's search service). Every request runs on both, alternating which goes first; a round is
the whole mix, and the ratio is total dynamic time / total bucketed time per round (median and range over
rounds). 1 thread each.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np

from common import THIRD, ZOO  # noqa: E402  (puts the checkout on sys.path)

import ctropt  # noqa: E402
from ctropt.runtime import Runner, generate_inputs  # noqa: E402
from ctropt.runtime.bench import bench  # noqa: E402
from ctropt.runtime.buckets import BucketedSession  # noqa: E402
from ctropt.specialize import specialize  # noqa: E402

MODELS = {
    "wdl_tf": ZOO / "wdl_tf.onnx", "deepfm_tf": ZOO / "deepfm_tf.onnx", "dlrm_tf": ZOO / "dlrm_tf.onnx",
    "mmoe_tf": ZOO / "mmoe_tf.onnx", "din_tf": ZOO / "din_tf.onnx", "dien_tf": ZOO / "dien_tf.onnx",
    "deepctr WDL": THIRD / "deepctr_WDL_tf2onnx.onnx", "deepctr-torch DeepFM": THIRD / "deepctr_torch_DeepFM_legacy.onnx",
    "deepctr MMOE": THIRD / "deepctr_MMOE_tf2onnx.onnx", "deepctr-torch DIN": THIRD / "deepctr_torch_DIN_legacy.onnx",
}


def request_mix(n: int, max_batch: int, seed: int = 0) -> list[int]:
    """Seed 002's distribution: 45 % at the maximum, 7.4 % at 45, 2.3 % at 1, the rest uniform on the others."""
    rng = np.random.default_rng(seed)
    others = np.array([b for b in range(2, max_batch) if b != 45])
    draw = rng.random(n)
    sizes = np.where(draw < 0.45, max_batch, np.where(draw < 0.524, 45, np.where(draw < 0.547, 1,
                     rng.choice(others, n))))
    return [int(s) for s in sizes]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="")
    ap.add_argument("--buckets", default="1,8,32,64,128,256,512")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seq-len", type=int, default=None, help="history length to fix (default: left dynamic)")
    ap.add_argument("--policy", default="measured", help="BucketedSession policy: measured or pad")
    ap.add_argument("--exact", action="store_true", help="also time each bucket at exactly its batch")
    ap.add_argument("--backend", default="ort-cpu", help="where both run: ort-cpu or openvino-cpu")
    args = ap.parse_args()
    buckets = [int(b) for b in args.buckets.split(",")]
    mix = request_mix(args.requests, max(buckets))
    print(f"buckets {buckets}; {len(mix)} requests: {sum(b == max(buckets) for b in mix)} at {max(buckets)}, "
          f"{sum(b == 45 for b in mix)} at 45, {sum(b == 1 for b in mix)} at 1; mean {np.mean(mix):.0f} rows")
    print("| model | nodes dynamic → bucket | dynamic / bucketed time per round, median (min–max) | runs on a bucket "
          "| rows padded |" + (" at exactly a bucket's batch: dynamic / bucket |" if args.exact else ""))
    print("|---|---|---|---|---|" + ("---|" if args.exact else ""))
    names = [n for n in MODELS if not args.only or n in args.only.split(",")]
    target = "openvino" if args.backend.startswith("openvino") else "ort"
    for name in names:
        raw = ctropt.load(MODELS[name])
        dynamic = ctropt.optimize(raw, passes="all", target=target).model
        with tempfile.TemporaryDirectory() as tmp:
            manifest = specialize(raw, tmp, buckets, seq_len=args.seq_len, target=target)
            served = BucketedSession(tmp, args.backend, threads=1, policy=args.policy)
            runner = Runner(dynamic, args.backend, threads=1)
            feeds = generate_inputs(raw, batch=max(buckets), seq_len=args.seq_len or 10, seed=3)
            for n in (1, 45, max(buckets)):  # warm both
                part = {k: v[:n] for k, v in feeds.items()}
                runner.run(part), served.run(part)
            ratios, exact = [], []
            for r in range(args.rounds):
                t_dyn = t_bkt = 0.0
                for i, n in enumerate(mix):
                    part = {k: v[:n] for k, v in feeds.items()}
                    order = (0, 1) if (i + r) % 2 == 0 else (1, 0)
                    for which in order:
                        t0 = time.perf_counter()
                        (runner if which == 0 else served).run(part)
                        dt = time.perf_counter() - t0
                        if which == 0:
                            t_dyn += dt
                        else:
                            t_bkt += dt
                ratios.append(t_dyn / t_bkt)
            runs = [run for n in mix for run in served.plan(n)]
            padded = sum(bucket - take for take, bucket in runs if bucket) / sum(mix)
            on_buckets = sum(1 for _, bucket in runs if bucket) / len(runs)
            nodes = f"{ctropt.graph.node_count(dynamic)} → {manifest['buckets'][-1]['nodes']}"
            if args.exact:
                for b in buckets:
                    part = {k: v[:b] for k, v in feeds.items()}
                    res = bench([runner, served.runners[b]], part, b, seconds=2)
                    exact.append(f"{b}: {res.ratio:.2f}")
            print(f"| {name} | {nodes} | **{np.median(ratios):.2f}×** ({min(ratios):.2f}–{max(ratios):.2f}) "
                  f"| {on_buckets:.0%} | {padded:.1%} |" + (f" {', '.join(exact)} |" if exact else ""), flush=True)


if __name__ == "__main__":
    main()
