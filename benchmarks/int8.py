"""INT8 vs FP32-optimized, paired, with accuracy on labelled synthetic data.

    python benchmarks/int8.py [--only wdl_tf,...] [--batch 512] [--seconds 10]
    python benchmarks/int8.py --only big --extra big=/tmp/big/fuxictr_WideDeep_dynamo.onnx

For each model: FP32 = `ctropt optimize --passes all`, INT8 = `--passes all,quantize-int8` (as `optimize --int8`:
quantized after the fusions, before the lowering); calibration data = generated inputs (4096 rows);
evaluation data = other generated inputs (8192 rows) labelled by sampling each row's click from the FP32 model's
own probability (so the FP32 AUC is what a calibrated model would reach, and INT8's drift is measured against
it); quantize-int8 takes that calibration/evaluation data and gates its speed at the benchmark batch. Then both run interleaved on onnxruntime CPU, 1 thread (the median of paired time ratios).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from common import THIRD, ZOO  # noqa: E402  (puts the checkout on sys.path)

import ctropt  # noqa: E402
from ctropt.passes.precision.quantize import auc, logloss  # noqa: E402
from ctropt.runtime import Runner, generate_inputs  # noqa: E402
from ctropt.runtime.bench import bench  # noqa: E402

MODELS = {
    "wdl_tf": ZOO / "wdl_tf.onnx", "deepfm_tf": ZOO / "deepfm_tf.onnx", "dlrm_tf": ZOO / "dlrm_tf.onnx",
    "mmoe_tf": ZOO / "mmoe_tf.onnx", "deepctr WDL": THIRD / "deepctr_WDL_tf2onnx.onnx",
    "deepctr-torch WDL": THIRD / "deepctr_torch_WDL_legacy.onnx", "deepctr MMOE": THIRD / "deepctr_MMOE_tf2onnx.onnx",
    "torchrec DLRM": THIRD / "torchrec_dlrm_dynamo.onnx", "deepctr DeepFM": THIRD / "deepctr_DeepFM_tf2onnx.onnx",
    "FuxiCTR WideDeep": THIRD / "fuxictr_WideDeep_dynamo.onnx", "FuxiCTR DeepFM": THIRD / "fuxictr_DeepFM_dynamo.onnx",
    "PaddleRec WideDeep": THIRD / "paddlerec_WideDeep_paddle2onnx.onnx",
    "PaddleRec DeepFM": THIRD / "paddlerec_DeepFM_paddle2onnx.onnx",
    "DeepRec WDL": THIRD / "deeprec_WDL_tf2onnx.onnx", "DeepRec DeepFM": THIRD / "deeprec_DeepFM_tf2onnx.onnx",
}


def labelled(model, rows: int, seed: int) -> dict:
    feeds = generate_inputs(model, batch=rows, seed=seed)
    rng = np.random.default_rng(seed)
    out = Runner(model, threads=1).run(feeds)
    for name, p in out.items():
        if np.issubdtype(p.dtype, np.floating) and p.min() >= 0 and p.max() <= 1:
            feeds[f"label:{name}"] = (rng.random(p.shape) < p).astype(np.float32)
    return feeds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="")
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--extra", default="", help="more models: name=path.onnx,... (e.g. production-sized exports)")
    args = ap.parse_args()
    MODELS.update(dict(item.split("=", 1) for item in args.extra.split(",") if item))
    names = [n for n in MODELS if not args.only or n in args.only.split(",")]
    print("| model | FC layers in INT8 | FP32-opt / INT8 time, paired (p10–p90) | max abs err | AUC FP32 → INT8 "
          "| logloss FP32 → INT8 |")
    print("|---|---|---|---|---|---|")
    for name in names:
        raw = ctropt.load(MODELS[name])
        fp32 = ctropt.optimize(raw, passes="all").model
        calib, evaluation = labelled(fp32, 4096, 1), labelled(fp32, 8192, 2)
        # as `optimize --int8` runs it: quantized after the fusions, before the lowering to ctropt's kernels
        result = ctropt.optimize(raw, passes="all,quantize-int8", options={
            "calib": calib, "int8_eval": evaluation, "int8_batch": args.batch})
        rec = next(r for r in result.records if r.name == "quantize-int8")
        int8 = result.model
        kept = sum(n.endswith("→ INT8") for n in rec.notes)
        total = sum(n.endswith("→ INT8") or n.endswith("stays FP32") for n in rec.notes)
        feeds = generate_inputs(fp32, batch=args.batch, seed=3)
        r = bench([Runner(fp32, threads=1), Runner(int8, threads=1)], feeds, args.batch, seconds=args.seconds)
        ev = {k: v for k, v in evaluation.items() if not k.startswith("label:")}
        a, b = Runner(fp32, threads=1).run(ev), Runner(int8, threads=1).run(ev)
        errs, aucs, lls = [], [], []
        for out, p in a.items():
            if not np.issubdtype(p.dtype, np.floating):
                continue
            errs.append(float(np.abs(p - b[out]).max()))
            y = evaluation.get(f"label:{out}")
            if y is not None:
                aucs.append(f"{auc(y, p):.4f} → {auc(y, b[out]):.4f}")
                lls.append(f"{logloss(y, p):.4f} → {logloss(y, b[out]):.4f}")
        print(f"| {name} | {kept}/{total} | {r.ratio:.2f}× ({r.ratio_p10:.2f}–{r.ratio_p90:.2f}) | {max(errs):.2g} "
              f"| {'; '.join(aucs) or '-'} | {'; '.join(lls) or '-'} |", flush=True)
        for note in rec.notes:
            print(f"    {note}", file=sys.stderr)


if __name__ == "__main__":
    main()
