"""Raw export vs ctropt-optimized, for every zoo model and third-party export, on onnxruntime and OpenVINO.

    python benchmarks/run.py                    # everything; prints the table at the end
    python benchmarks/run.py --out run.md       # and writes it to run.md after every model
    python benchmarks/run.py --only dien,wdl    # models whose file name contains one of these
    python benchmarks/run.py --seconds 2        # longer measurements

Every number is a paired ratio from one run: raw and optimized run interleaved (A B, B A, ...) on the same
inputs with the same session options; the cell is the median of time(raw)/time(optimized) over the pairs,
with the 10th–90th percentile spread. > 1 means ctropt's model is faster.

Its table was the first of benchmarks/RESULTS.md (2026-11-21); benchmarks/corpus.py's corpus table superseded it
there, so this script no longer writes RESULTS.md (it would replace the whole file).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import ctropt  # noqa: E402
from ctropt.exporters import zoo  # noqa: E402
from ctropt.graph import CtroptError, load, node_count  # noqa: E402
from ctropt.runtime import Runner, compare_outputs, generate_inputs  # noqa: E402
from ctropt.runtime.bench import bench  # noqa: E402

BATCHES = (1, 32, 256)
THREADS = (1, os.cpu_count() or 1)


def models(only: list[str]) -> list[Path]:
    found = sorted(zoo.DATA.glob("*.onnx")) + sorted((ROOT / "tests" / "data" / "thirdparty").glob("*.onnx"))
    return [p for p in found if not only or any(o in p.stem for o in only)]


def ratio_cell(runners, feeds, batch, seconds) -> str:
    try:
        r = bench(runners, feeds, batch, seconds=seconds, min_runs=10)
    except CtroptError as e:  # e.g. an export that only runs at some batch sizes
        return f"fails: {str(e)[:80]}"
    return f"{r.ratio:.2f} ({r.ratio_p10:.2f}–{r.ratio_p90:.2f})"


def measure(path: Path, seconds: float, seq_len: int) -> dict:
    raw = load(path)
    row = {"model": path.stem, "nodes": node_count(raw)}
    t0 = time.perf_counter()
    ort_opt = ctropt.optimize(raw, target="ort").model
    row["optimize_s"] = time.perf_counter() - t0
    row["nodes_ort"] = node_count(ort_opt)
    feeds = {b: generate_inputs(raw, batch=b, seq_len=seq_len) for b in BATCHES}
    for threads in THREADS:
        runners = [Runner(raw, "ort-cpu", threads), Runner(ort_opt, "ort-cpu", threads)]
        row[f"ort{threads}"] = [ratio_cell(runners, feeds[b], b, seconds) for b in BATCHES]
    try:
        ov_opt = ctropt.optimize(raw, target="openvino").model
        ov_opt_runner = Runner(ov_opt, "openvino-cpu", 1)
        ov_opt_runner.run(feeds[BATCHES[0]])
        row["ov_opt"] = "loads"
    except CtroptError as e:
        row["ov_opt"] = f"fails: {str(e)[:120]}"
        ov_opt_runner = None
    try:
        raw_runner = Runner(raw, "openvino-cpu", 1)
        for b in BATCHES:  # a raw export OpenVINO runs but computes wrongly is no baseline
            expected, got = Runner(raw).run(feeds[b]), raw_runner.run(feeds[b])
            if not all(d.ok for d in compare_outputs(expected, got)):
                raise CtroptError(f"gives wrong outputs at batch {b}")
        row["ov_raw"] = "loads"
    except CtroptError as e:
        row["ov_raw"] = f"fails: {str(e)[:120]}"
        raw_runner = None
    if raw_runner and ov_opt_runner:
        row["ov1"] = [ratio_cell([raw_runner, ov_opt_runner], feeds[b], b, seconds) for b in BATCHES]
    return row


def write(rows: list[dict], command: str, out: Path | None, seconds: float) -> None:
    """The table of `rows`, written to `out`, or printed without one."""
    lines = [
        "# Benchmarks: raw export vs ctropt",
        "",
        f"Produced by `{command}` on {datetime.date.today()} ({platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, onnxruntime and OpenVINO CPU; {seconds:g} s of interleaved pairs per cell).",
        "",
        "Each cell: median of time(raw) / time(optimized) over interleaved pairs, with the 10th–90th percentile",
        "in brackets; > 1 means the optimized model is faster. Batches 1 / 32 / 256. Optimized for onnxruntime",
        "with `ctropt optimize --target ort` (all default passes); OpenVINO columns compare the raw export with",
        "`--target openvino` when both load, else say which fails.",
        "",
        "| model | nodes raw → opt | ORT 1 thread: b1 / b32 / b256 | ORT all threads: b1 / b32 / b256 "
        "| OpenVINO 1 thread: b1 / b32 / b256 |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        ov = " / ".join(r["ov1"]) if "ov1" in r else f"raw {r['ov_raw']}; optimized {r['ov_opt']}"
        lines.append(f"| {r['model']} | {r['nodes']} → {r['nodes_ort']} | {' / '.join(r[f'ort{THREADS[0]}'])} "
                     f"| {' / '.join(r[f'ort{THREADS[-1]}'])} | {ov} |")
    if out is None:
        print("\n".join(lines))
    else:
        out.write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="comma list of substrings of model file names")
    parser.add_argument("--seconds", type=float, default=1.0, help="measurement time per cell")
    parser.add_argument("--out", type=Path, help="write the table to this file after every model (default: print "
                        "it at the end)")
    parser.add_argument("--seq-len", type=int, default=10, help="history length where the model leaves it dynamic")
    args = parser.parse_args()
    command = "python benchmarks/run.py" + "".join(f" {a}" for a in sys.argv[1:])
    rows = []
    for path in models([o for o in args.only.split(",") if o]):
        print(f"{path.stem} ...", flush=True)
        try:
            rows.append(measure(path, args.seconds, args.seq_len))
        except CtroptError as e:
            print(f"  skipped: {e}", flush=True)
            continue
        print(f"  {rows[-1]}", flush=True)
        if args.out:
            write(rows, command, args.out, args.seconds)
    if not args.out:
        write(rows, command, None, args.seconds)


if __name__ == "__main__":
    main()
