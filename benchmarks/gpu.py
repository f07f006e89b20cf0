"""The GPU run (#28): the zoo models on onnxruntime's CUDA provider, raw vs `ctropt optimize --device cuda`,
FP16 vs FP32 with its worst-row error, the CPU/GPU threshold, a serving mix split at it, and packed inputs.

    python benchmarks/gpu.py --run gpu.json [--seconds 0.4] [--budget 420]   # on the GPU machine
    python benchmarks/gpu.py --write gpu.json                              # here: RESULTS' GPU section

RESULTS.md's GPU section is rendered from the committed run, benchmarks/gpu-run.json (copy a kept run there, then
`--write benchmarks/gpu-run.json`, or `python benchmarks/results.py`).

Every ratio is the median of paired, interleaved runs (time(A) / time(B), > 1: B is faster), inputs fed from host
memory as a server gets them (the host→device copies are in the time). The CPU side of the threshold is
`ctropt optimize` for the CPU (kernels included) on onnxruntime's CPU provider with --cpu-threads threads, the
GPU side the --device cuda model. The serving mix is seed 002's (benchmarks/serving.py): total time of the mix on
the CPU alone, the GPU alone, and split at the measured threshold. Results are written after every model, and
models past --budget seconds are left out, so a cut-off run still reports.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

import numpy as np

from common import ZOO, machine as cpu_machine, read_log, write_section  # noqa: E402  (puts the checkout on sys.path)

import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402

from ctropt.packing import pack_inputs  # noqa: E402
from ctropt.passes import PassManager  # noqa: E402
from ctropt.passes.speed import SpeedCheck  # noqa: E402
from ctropt.runtime import Runner, generate_inputs  # noqa: E402
from ctropt.runtime.bench import bench  # noqa: E402
from ctropt.runtime.session import available_backends  # noqa: E402
from serving import request_mix  # noqa: E402

MODELS = ("wdl_tf", "deepfm_tf", "din_torch", "dien_torch", "mmoe_tf", "dlrm_tf", "din_tf", "dien_tf")
BATCHES = (1, 16, 64, 256, 1024, 4096)
MARKS = ("<!-- GPU run: benchmarks/gpu.py writes it -->", "<!-- end of GPU run -->")
LOG = Path(__file__).resolve().parent / "gpu-run.json"


def optimized(raw: onnx.ModelProto, device: str, passes: str = "all", seconds: float = 0.4) -> tuple:
    """(model, seconds, rolled-back passes, notes of non-exact passes) of `ctropt optimize --device`."""
    t0 = time.perf_counter()
    timed = available_backends()[f"ort-{device}"] == "available"   # a smoke run without a GPU: not timed
    result = PassManager(passes, device=device, speed=SpeedCheck(seconds=seconds) if timed else None).run(raw)
    back = [r.name for r in result.records if r.status != "applied" and r.status != "unchanged"]
    half = [r for r in result.records if r.name == "convert-float16"]
    notes = [n for r in half for n in r.notes] + [f"{r.status}: {r.message}" for r in half if r.message]
    return result.model, time.perf_counter() - t0, back, notes


def worst_err(truth: dict, got: dict) -> float:
    return max(float(np.abs(truth[k].astype(np.float64) - got[k].astype(np.float64)).max(initial=0.0))
               for k in truth if np.issubdtype(truth[k].dtype, np.floating))


def paired(a: Runner, b: Runner, feeds: dict, batch: int, seconds: float) -> dict:
    r = bench([a, b], feeds, batch, seconds=seconds, min_runs=15)
    return {"a_ms": r.latency[0].p50_ms, "b_ms": r.latency[1].p50_ms, "ratio": r.ratio,
            "p10": r.ratio_p10, "p90": r.ratio_p90}


def serve_mix(cpu: Runner, gpu: Runner, raw, threshold: int | None, seconds_cap: float = 20.0) -> dict:
    """Total time of seed 002's mix (max batch 512) on the CPU, on the GPU, and split at `threshold`."""
    mix = request_mix(120, 512)
    feeds = {n: generate_inputs(raw, batch=n, seed=n) for n in sorted(set(mix))}
    totals = {"cpu": 0.0, "gpu": 0.0, "split": 0.0}
    t_end = time.perf_counter() + seconds_cap
    for n in mix:
        for way, runner in (("cpu", cpu), ("gpu", gpu),
                            ("split", gpu if threshold is not None and n >= threshold else cpu)):
            t0 = time.perf_counter()
            runner.run(feeds[n])
            totals[way] += time.perf_counter() - t0
        if time.perf_counter() > t_end:
            return {"cut": True, **totals}
    return totals


def measure(name: str, args) -> dict:
    raw = onnx.load(ZOO / f"{name}.onnx")
    row = {"model": name}
    opt, row["optimize_s"], row["rolled_back"], _ = optimized(raw, "cuda", seconds=args.seconds)
    half, row["fp16_s"], _, row["fp16_notes"] = optimized(opt, "cuda", "convert-float16", args.seconds)
    row["fp16_kept"] = any(t.data_type == onnx.TensorProto.FLOAT16 for t in half.graph.initializer)
    cpu_opt, row["cpu_optimize_s"], _, _ = optimized(raw, "cpu", seconds=args.seconds)
    g_raw, g_opt, g_half = (Runner(m, args.gpu_backend) for m in (raw, opt, half))
    c_opt = Runner(cpu_opt, "ort-cpu", threads=args.cpu_threads)
    truth = Runner(raw, "ort-cpu")
    row["batches"] = {}
    for batch in BATCHES:
        feeds = generate_inputs(raw, batch=batch, seed=batch)
        ref = truth.run(feeds)
        cell = {"opt_err": worst_err(ref, g_opt.run(feeds)), "fp16_err": worst_err(ref, g_half.run(feeds))}
        cell["raw_vs_opt"] = paired(g_raw, g_opt, feeds, batch, args.seconds)
        cell["opt_vs_fp16"] = paired(g_opt, g_half, feeds, batch, args.seconds)
        cell["cpu_vs_gpu"] = paired(c_opt, g_half, feeds, batch, args.seconds)
        row["batches"][str(batch)] = cell
    wins = [b for b in BATCHES if all(row["batches"][str(c)]["cpu_vs_gpu"]["ratio"] > 1 for c in BATCHES if c >= b)]
    row["threshold"] = wins[0] if wins else None
    row["mix"] = serve_mix(c_opt, g_half, raw, row["threshold"])
    packed, packing = pack_inputs(opt)
    g_packed = Runner(packed, args.gpu_backend)
    row["packed"] = {}
    for batch in (64, 1024):
        feeds = generate_inputs(raw, batch=batch, seed=batch)
        ready = packing.pack(feeds)

        class _Fed:   # the packed model on tensors the client packed, beside the unpacked one on its own feeds
            def run(self, _):
                return g_packed.run(ready)
        row["packed"][str(batch)] = paired(g_opt, _Fed(), feeds, batch, args.seconds)
    return row


def machine() -> dict:
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True).stdout.strip()
    except FileNotFoundError:
        smi = "no NVIDIA GPU"
    return {"gpu": smi, "onnxruntime": ort.__version__, "providers": ort.get_available_providers(),
            "backends": available_backends(), "cpu": cpu_machine(),
            "date": time.strftime("%Y-%m-%d")}


def run(args) -> None:
    out = {"machine": machine(), "args": vars(args), "rows": []}
    print(json.dumps(out["machine"], indent=1), flush=True)
    start = time.perf_counter()
    for name in [m for m in MODELS if not args.only or m in args.only.split(",")]:
        if time.perf_counter() - start > args.budget:
            out.setdefault("skipped", []).append(name)
            continue
        try:
            out["rows"].append(measure(name, args))
        except Exception as e:  # one model's failure must not lose the others
            out["rows"].append({"model": name, "error": f"{type(e).__name__}: {str(e)[:300]}"})
        print(f"{name}: {time.perf_counter() - start:.0f} s", flush=True)
        with open(args.run, "w") as f:
            json.dump(out, f, indent=1)


def _r(p: dict) -> str:
    return f"{p['ratio']:.2f}× ({p['p10']:.2f}–{p['p90']:.2f})"


def table(data: dict) -> str:
    m, a = data["machine"], data["args"]
    lines = [f"Command: `python benchmarks/gpu.py --run gpu-run.json --seconds {a['seconds']} --cpu-threads "
             f"{a['cpu_threads']}`, then `python benchmarks/gpu.py --write benchmarks/gpu-run.json` ({m['date']}; "
             f"{m['gpu']}; onnxruntime-gpu {m['onnxruntime']}; host CPU: {m['cpu']}). TensorRT: "
             f"{m['backends']['ort-trt']}.",
             "", "| model | batch | CUDA: ctropt vs raw | FP16 vs FP32 (CUDA) | FP16 worst err | GPU vs CPU ctropt "
             "| GPU p50 |", "|---|---|---|---|---|---|---|"]
    for row in data["rows"]:
        if "error" in row:
            lines.append(f"| {row['model']} | fails: {row['error'][:80]} | | | | | |")
            continue
        for b, c in row["batches"].items():
            err = f"{c['fp16_err']:.1e}" if row["fp16_kept"] else "FP32 (not kept)"
            lines.append(f"| {row['model']} | {b} | {_r(c['raw_vs_opt'])} | {_r(c['opt_vs_fp16'])} | {err} | "
                         f"{_r(c['cpu_vs_gpu'])} | {c['opt_vs_fp16']['b_ms']:.2f} ms |")
    lines += ["", "| model | FP16 kept | GPU faster from batch | seed 002 mix: GPU alone vs CPU | split vs CPU "
              "| split vs GPU | packed inputs, batch 64 / 1024 (CUDA) | optimize s (cuda / cpu) |",
              "|---|---|---|---|---|---|---|---|"]
    for row in data["rows"]:
        if "error" in row:
            continue
        mix, p = row["mix"], row["packed"]
        kept = "yes" if row["fp16_kept"] else "no" + (" (converter failed)" if "fp16_status" in row else "")
        lines.append(f"| {row['model']} | {kept} | {row['threshold'] or 'never'} | "
                     f"{mix['cpu'] / mix['gpu']:.2f}× | {mix['cpu'] / mix['split']:.2f}× | "
                     f"{mix['gpu'] / mix['split']:.2f}× | {_r(p['64'])} / {_r(p['1024'])} | "
                     f"{row['optimize_s']:.0f} / {row['cpu_optimize_s']:.0f} |")
    return "\n".join(lines)


def render(log: Path = LOG) -> str:
    return table(read_log(log))


def write(path: str) -> None:
    text = render(Path(path))
    write_section(MARKS, text, "GPU: onnxruntime CUDA provider (#28)")
    print(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", help="measure here (needs onnxruntime-gpu and a GPU) and write this JSON")
    ap.add_argument("--write", help="render this JSON into RESULTS' GPU section")
    ap.add_argument("--only", default="")
    ap.add_argument("--seconds", type=float, default=0.4)
    ap.add_argument("--cpu-threads", type=int, default=8)
    ap.add_argument("--gpu-backend", default="ort-cuda", help="ort-cpu: a smoke run of this script without a GPU")
    ap.add_argument("--budget", type=float, default=420.0, help="seconds after which models are left out")
    args = ap.parse_args()
    if args.run:
        run(args)
    if args.write:
        write(args.write)


if __name__ == "__main__":
    main()
