"""The headline: production-sized exports (benchmarks/production_corpus.py makes them) through `ctropt optimize` as a
user runs it, timed against the raw export on the traffic shapes a CTR server sees.

    python benchmarks/production.py run --corpus /tmp/prodcorpus --log /tmp/prod.jsonl   # measure (appends)
    python benchmarks/production.py run --only deepctr_tf_DIN --log /tmp/prod.jsonl       # some exports again
    python benchmarks/production.py table --log /tmp/prod.jsonl [--write]                 # the table (into RESULTS)

RESULTS' headline is rendered from the committed log, benchmarks/production-run.jsonl (copy a kept run's log there,
then `table --write`, or `python benchmarks/results.py`).

Per export X.onnx (with X.npz, a batch of 256 rows with skewed ids, and X.ref.npz, the framework's outputs on it):
`ctropt optimize X.onnx -o OPT --inputs X.npz` (the defaults: target ort, the speed guard deciding on the user's
rows), the outputs against the framework's (max abs error), then raw vs optimized on onnxruntime CPU, interleaved
pairs, median of time(raw)/time(optimized) (10th-90th percentile): batch 256 at 1 and at 2 threads (each side on the
same threads), and for models with a history one user × 100 and × 1,000 candidates (`generate_inputs(one_user=True)`:
one user's features and history in every row, the candidates' items differing). The load average is read before
and after each export: a row measured on a busy machine (above 1.5) says so and is to be run again.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import numpy as np

from common import ROOT, read_log, write_section  # noqa: E402  (puts the checkout on sys.path)

from ctropt.graph import load  # noqa: E402
from ctropt.runtime import Runner, compare_outputs, generate_inputs  # noqa: E402
from ctropt.runtime.bench import compare_speed  # noqa: E402
from ctropt.runtime.cpu import cpu_info  # noqa: E402

MARKS = ("<!-- production table: benchmarks/production.py writes it -->", "<!-- end of production table -->")
FAMILIES = [("dien", r"DIEN"), ("din", r"DIN"), ("bst", r"BST|SASRec|TransAct"), ("dlrm", r"DLRM"),
            ("dense", r"DeepFM|WDL|WideDeep|DCN|xDeepFM|MMOE|MMoE|PLE|AutoInt|FiBiNET|NFM|AFM|FinalMLP|ESMM")]
BUSY = 1.5
LOG = Path(__file__).resolve().parent / "production-run.jsonl"


def family(stem: str) -> str:
    return next((f for f, pattern in FAMILIES if re.search(pattern, stem)), "other")


def npz(path: Path) -> dict:
    with np.load(path) as data:
        return {k: data[k] for k in data.files}


def cpu() -> str:
    return f"{cpu_info().summary()}, {os.cpu_count()} cores"


def optimize(raw: Path, out: Path) -> dict:
    report = out.with_suffix(".json")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "ctropt", "optimize", str(raw), "-o", str(out), "--inputs",
                           str(raw.with_suffix(".npz")), "--json", str(report)], capture_output=True, text=True,
                          cwd=ROOT, timeout=1800)
    row = {"exit": proc.returncode, "optimize_s": round(time.perf_counter() - t0, 1)}
    if proc.returncode:
        row["error"] = (proc.stderr or proc.stdout).strip().splitlines()[-1][:200]
        return row
    record = json.loads(report.read_text())
    row["kept"] = [p["name"] for p in record.get("passes", []) if p["status"] == "applied"]
    row["rolled_back"] = [p["name"] for p in record.get("passes", []) if p["status"] == "slower"]
    row["kept_input"] = bool(record.get("kept_input"))
    return row


def files_bytes(model: Path) -> int:
    """The model file and its external data (MODEL.data, as ctropt and the exporters write it)."""
    return sum(p.stat().st_size for p in model.parent.glob(model.name + "*") if p.suffix in (".onnx", ".data"))


def paired(raw: Path, opt: Path, feeds: dict, threads: int, seconds: float) -> list[float]:
    v = compare_speed(Runner(str(raw), threads=threads), Runner(str(opt), threads=threads), feeds, threshold=1.0,
                      seconds=seconds, min_pairs=20)
    return [round(v.ratio, 3), round(v.p10, 3), round(v.p90, 3)]


def has_history(model) -> bool:
    return any(i.type.tensor_type.elem_type in (6, 7) and len(i.type.tensor_type.shape.dim) == 2 and
               i.type.tensor_type.shape.dim[1].dim_value != 1 for i in model.graph.input)


def measure(raw: Path, work: Path, seconds: float) -> dict:
    row = {"export": raw.stem, "family": family(raw.stem), "load_before": os.getloadavg()[0],
           "size_mb": round(sum(p.stat().st_size for p in raw.parent.glob(raw.name + "*")) / 1e6, 1)}
    opt = work / "opt.onnx"
    row.update(optimize(raw, opt))
    if row["exit"]:
        return row
    row["size_ratio"] = round(files_bytes(opt) / files_bytes(raw), 4)   # issue 47: none over 1.05
    feeds, ref = npz(raw.with_suffix(".npz")), npz(raw.with_suffix(".ref.npz"))
    got = Runner(str(opt)).run(feeds)
    row["max_err"] = max(d.max_abs for d in compare_outputs(ref, {k: got[k] for k in ref}, atol=1e-4, rtol=1e-4))
    row["b256_t1"] = paired(raw, opt, feeds, 1, seconds)
    row["b256_t2"] = paired(raw, opt, feeds, 2, seconds)
    model = load(raw)
    if has_history(model):
        for n in (100, 1000):
            row[f"user_x{n}"] = paired(raw, opt, generate_inputs(model, batch=n, seed=n, one_user=True), 1, seconds)
    row["load_after"] = os.getloadavg()[0]
    return row


def run(args) -> None:
    exports = sorted(p for p in Path(args.corpus).glob("*.onnx") if p.with_suffix(".ref.npz").exists())
    only = [o for o in args.only.split(",") if o]
    for raw in exports:
        if only and not any(o in raw.stem for o in only):
            continue
        with tempfile.TemporaryDirectory(dir=args.work) as work:
            try:
                row = measure(raw, Path(work), args.seconds)
            except Exception as e:  # noqa: BLE001  (one export's failure is its row)
                row = {"export": raw.stem, "family": family(raw.stem), "exit": "error", "error": str(e)[:200]}
        row["cpu"], row["date"] = cpu(), date.today().isoformat()
        print(json.dumps(row), flush=True)
        with open(args.log, "a") as f:
            f.write(json.dumps(row) + "\n")


def _cell(v) -> str:
    return f"{v[0]:.2f}× ({v[1]:.2f}–{v[2]:.2f})" if v else "·"


def _size(row: dict) -> str:
    return f"{row['size_ratio']:.3f}" if "size_ratio" in row else "·"


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def table(rows: list[dict]) -> str:
    lines = ["| export | family | MB | size × | optimize s | rolled back | max err | batch 256, 1 thread "
             "| batch 256, 2 threads | one user × 100 | one user × 1,000 | load |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("exit") != 0:
            lines.append(f"| {r['export']} | {r['family']} | {r.get('size_mb', '·')} | · | fails: {r.get('error', '')} |"
                         " · | · | · | · | · | · | · |")
            continue
        busy = " busy" if max(r["load_before"], r["load_after"]) > BUSY else ""
        lines.append(f"| {r['export']} | {r['family']} | {r['size_mb']:.0f} | "
                     f"{_size(r)} | {r['optimize_s']:.0f} | "
                     f"{len(r['rolled_back'])}{' (input kept)' if r['kept_input'] else ''} | {r['max_err']:.1e} | "
                     f"{_cell(r['b256_t1'])} | {_cell(r['b256_t2'])} | {_cell(r.get('user_x100'))} | "
                     f"{_cell(r.get('user_x1000'))} | {r['load_before']:.1f}/{r['load_after']:.1f}{busy} |")
    ok = [r for r in rows if r.get("exit") == 0]
    summary = ["", "| family | exports | geometric mean, 1 thread | 2 threads | lowest, 1 thread | one user × 1,000 |",
               "|---|---|---|---|---|---|"]
    for name in sorted({r["family"] for r in ok}) + ["all"]:
        group = [r for r in ok if name in ("all", r["family"])]
        users = [r["user_x1000"][0] for r in group if r.get("user_x1000")]
        summary.append(f"| {name} | {len(group)} | {geomean([r['b256_t1'][0] for r in group]):.2f}× | "
                       f"{geomean([r['b256_t2'][0] for r in group]):.2f}× | "
                       f"{min(r['b256_t1'][0] for r in group):.2f}× | "
                       f"{f'{geomean(users):.2f}×' if users else '·'} |")
    return "\n".join(lines + summary)


def last_rows(log: Path) -> list[dict]:
    rows = {}
    for row in read_log(log):
        rows[row["export"]] = row
    return sorted(rows.values(), key=lambda r: (r["family"], r["export"]))


def render(log: Path = LOG) -> str:
    """RESULTS' headline section from a log: the command, dates and CPUs the rows carry, then the tables."""
    rows = last_rows(log)
    cpus = sorted({r["cpu"] for r in rows if "cpu" in r})
    name = f"benchmarks/{log.name}" if log.resolve() == LOG else log.name
    head = (f"Command: `python benchmarks/production.py run --log {name}`, then `python benchmarks/production.py "
            f"table --log {name} --write` ({', '.join(sorted({r['date'] for r in rows if 'date' in r}))}; "
            f"{'; '.join(cpus)}). Raw export vs "
            "`ctropt optimize --inputs X.npz` (defaults), onnxruntime CPU, paired and interleaved, median of "
            "time(raw)/time(optimized) (10th–90th percentile); size ×: the optimized model's "
            "files over the raw export's; load: the 1-minute load average before/after.")
    return head + "\n\n" + table(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--corpus", default="/tmp/prodcorpus")
    r.add_argument("--only", default="")
    r.add_argument("--seconds", type=float, default=6.0, help="time budget per paired comparison")
    r.add_argument("--log", type=Path, required=True)
    r.add_argument("--work", default=None, help="folder for the optimized models (default: the system's temp)")
    t = sub.add_parser("table")
    t.add_argument("--log", type=Path, default=LOG, help="default: the committed log RESULTS is rendered from")
    t.add_argument("--write", action="store_true")
    args = ap.parse_args()
    if args.cmd == "run":
        run(args)
        return
    text = render(args.log)
    print(text)
    if args.write:
        write_section(MARKS, text, heading="Headline: production-sized exports")


if __name__ == "__main__":
    main()
