"""Accuracy and speed of `ctropt optimize` in FP32 and INT8 on models trained on real data (issue 51): the
MovieLens-100k corpus that benchmarks/movielens.py makes, its test rows labelled.

    python benchmarks/precision.py run [--corpus /tmp/mlcorpus] [--only DIN,BST] --log /tmp/precision.jsonl
    python benchmarks/precision.py table --log /tmp/precision.jsonl

Each log row carries its date, CPU and command (common.provenance) and the CPU's vector / INT8 / BF16 paths
(ctropt.runtime.cpu.cpu_info().summary()); `table` renders the last row per model (`render(log)`).

Per model NAME of the corpus' manifest.json (NAME.onnx, NAME.calib.npz, NAME.calib_labels.npz, NAME.test.npz,
NAME.labels.npz):
  fp32   `ctropt optimize NAME.onnx -o fp32.onnx --passes all --inputs b256.npz`
  int8   `ctropt optimize NAME.onnx -o int8.onnx --passes all --precision int8 --calib calib.npz --inputs b256.npz`
         where calib.npz = NAME.calib.npz plus its labels under `label` (quantize-int8 then gates on AUC and
         logloss drift, not only on the outputs' error), b256.npz = the first 256 calibration rows (the speed
         check's and the verification's rows: real ids, not generated ones); --int8-option KEY=VALUE passes
         quantize-int8's options (`ctropt passes --options`), e.g. int8_threshold=0.0005
then on the test rows (the last 10 % by time, never seen by either): AUC and logloss of raw, fp32 and int8 (per
output column: MMOE's click and like), and each one's absolute probability error against raw: max (the worst row,
its index), 99.9th percentile. The targets (issue 51): AUC drop <= 0.0005, logloss rise <= 0.001, |error| <= 0.01
on 99.9 % of rows; a row says which it misses. Speed: paired and interleaved on onnxruntime CPU
(ctropt.runtime.bench.compare_speed, as benchmarks/production.py), 1 thread, batch 256 (the first 256 test rows),
median of time(slower side)/time(faster side) as fp32 vs raw and int8 vs fp32 (>1: the second is faster), 10th-90th
percentile. The load average is read before and after: rows above 1.5 say `busy` and are not measurements.
Which layers quantize-int8 kept FP32, and why, comes from `ctropt optimize`'s own report (--json).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from common import ROOT, append_log, commands, provenance, read_log, stamp  # noqa: E402  (the checkout on sys.path)

from ctropt.passes.precision.quantize import auc, logloss  # noqa: E402
from ctropt.runtime import Runner  # noqa: E402
from ctropt.runtime.bench import compare_speed  # noqa: E402
from ctropt.runtime.cpu import cpu_info  # noqa: E402

BUSY = 1.5
TARGETS = {"auc_drop": 0.0005, "logloss_rise": 0.001, "p999_abs": 0.01}


def npz(path: Path) -> dict:
    with np.load(path) as data:
        return {k: data[k] for k in data.files}


def optimize(raw: Path, out: Path, extra: list[str]) -> dict:
    report = out.with_suffix(".json")
    cmd = [sys.executable, "-m", "ctropt", "optimize", str(raw), "-o", str(out), "--passes", "all", "--json",
           str(report)] + extra
    t0 = time.perf_counter()
    env = {**os.environ, "COLUMNS": "1000"}   # no wrapped lines: its notes are read back from the printout
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=3600, env=env)
    row = {"exit": proc.returncode, "optimize_s": round(time.perf_counter() - t0, 1),
           "command": " ".join(["ctropt"] + cmd[3:])}
    if proc.returncode:
        row["error"] = (proc.stderr or proc.stdout).strip().splitlines()[-1][:300]
        return row
    record = json.loads(report.read_text())
    row["applied"] = [p["name"] for p in record.get("passes", []) if p["status"] == "applied"]
    row["rolled_back"] = [p["name"] for p in record.get("passes", []) if p["status"] == "slower"]
    q = [p for p in record.get("passes", []) if p["name"] == "quantize-int8"]
    if q:
        row["int8_status"] = q[0]["status"]
        row["int8_notes"] = notes(proc.stdout, "quantize-int8:")
    row["precision_line"] = next((ln for ln in proc.stdout.splitlines() if ln.startswith("precision:")), "")
    return row


def notes(stdout: str, head: str) -> list[str]:
    """The indented lines under `head` in `ctropt optimize`'s printout (a pass's notes)."""
    lines = stdout.splitlines()
    if head not in lines:
        return []
    out = []
    for ln in lines[lines.index(head) + 1:]:
        if not ln.startswith("  "):
            break
        out.append(ln.strip())
    return out


def predict(path: Path, feeds: dict, threads: int = 2) -> np.ndarray:
    r = Runner(str(path), threads=threads)
    n = len(next(iter(feeds.values())))
    outs = [next(iter(r.run({k: v[i:i + 2048] for k, v in feeds.items()}).values())) for i in range(0, n, 2048)]
    return np.concatenate(outs).reshape(n, -1).astype(np.float64)


def accuracy(p: np.ndarray, ref: np.ndarray, y: np.ndarray) -> dict:
    """Per output column: AUC, logloss; and the absolute error against the raw model's probabilities."""
    err = np.abs(p - ref)
    worst = int(np.argmax(err.max(1)))
    return {"auc": [round(auc(y[:, k], p[:, k]), 6) for k in range(y.shape[1])],
            "logloss": [round(logloss(y[:, k], p[:, k]), 6) for k in range(y.shape[1])],
            "max_abs": float(err.max()), "worst_row": worst, "p999_abs": float(np.percentile(err.max(1), 99.9)),
            "rows_over_001": int((err.max(1) > 0.01).sum())}


def verdict(base: dict, new: dict) -> list[str]:
    miss = []
    for k in range(len(base["auc"])):
        if base["auc"][k] - new["auc"][k] > TARGETS["auc_drop"]:
            miss.append(f"AUC drop {base['auc'][k] - new['auc'][k]:.5f}")
        if new["logloss"][k] - base["logloss"][k] > TARGETS["logloss_rise"]:
            miss.append(f"logloss rise {new['logloss'][k] - base['logloss'][k]:.5f}")
    if new["p999_abs"] > TARGETS["p999_abs"]:
        miss.append(f"99.9th pct |err| {new['p999_abs']:.4f}")
    return miss


def paired(a: Path, b: Path, feeds: dict, seconds: float) -> list[float]:
    v = compare_speed(Runner(str(a), threads=1), Runner(str(b), threads=1), feeds, threshold=1.0, seconds=seconds,
                      min_pairs=20)
    return [round(v.ratio, 3), round(v.p10, 3), round(v.p90, 3)]


def measure(corpus: Path, entry: dict, work: Path, args) -> dict:
    name = entry["name"]
    raw = corpus / f"{name}.onnx"
    row = {"model": name, "family": entry["family"], "library": entry["library"],
           "framework_auc": entry.get("test_auc"), "load_before": os.getloadavg()[0],
           "raw_mb": round(raw.stat().st_size / 1e6, 2)}
    calib, test = npz(corpus / f"{name}.calib.npz"), npz(corpus / f"{name}.test.npz")
    b256 = work / "b256.npz"
    np.savez(b256, **{k: v[:256] for k, v in calib.items()})
    calib_l = work / "calib.npz"
    np.savez(calib_l, **calib, label=npz(corpus / f"{name}.calib_labels.npz")["label"])
    opt_fp32, opt_int8 = work / "fp32.onnx", work / "int8.onnx"
    row["fp32"] = optimize(raw, opt_fp32, ["--inputs", str(b256)])
    extra = [x for kv in args.int8_option for x in ("--option", kv)]
    row["int8"] = optimize(raw, opt_int8, ["--precision", "int8", "--calib", str(calib_l), "--inputs", str(b256)]
                           + extra)
    for side in ("fp32", "int8"):
        row[side]["command"] = (row[side]["command"].replace(str(work), "WORK").replace(str(corpus), "CORPUS")
                                .replace(name, "NAME"))
    y = npz(corpus / f"{name}.labels.npz")["label"]
    y = y.reshape(len(y), -1).astype(np.float64)
    p_raw = predict(raw, test)
    row["raw"] = accuracy(p_raw, p_raw, y)
    for side, path in (("fp32", opt_fp32), ("int8", opt_int8)):
        if row[side]["exit"]:
            continue
        row[side].update(accuracy(predict(path, test), p_raw, y))
        row[side]["misses"] = verdict(row["raw"], row[side])
        row[side]["mb"] = round(path.stat().st_size / 1e6, 2)
    if not args.no_speed and not row["fp32"]["exit"]:
        feeds = {k: v[:256] for k, v in test.items()}
        row["fp32_vs_raw_t1"] = paired(raw, opt_fp32, feeds, args.seconds)
        if not row["int8"]["exit"]:
            row["int8_vs_fp32_t1"] = paired(opt_fp32, opt_int8, feeds, args.seconds)
    row["load_after"] = os.getloadavg()[0]
    return row


def run(args) -> None:
    corpus = Path(args.corpus)
    entries = [e for e in json.loads((corpus / "manifest.json").read_text()) if e.get("kept")]
    only = [o for o in args.only.split(",") if o]
    for entry in entries:
        if only and not any(o in entry["name"] for o in only):
            continue
        with tempfile.TemporaryDirectory(dir=args.work) as work:
            try:
                row = measure(corpus, entry, Path(work), args)
            except Exception as e:  # noqa: BLE001  (one model's failure is its row)
                row = {"model": entry["name"], "family": entry["family"], "exit": "error", "error": str(e)[:300]}
        row.update(provenance())
        row["cpu_paths"] = cpu_info().summary()      # the vectors and the INT8 / BF16 paths it has
        row["time"] = datetime.now(timezone.utc).strftime("%H:%M UTC")
        print(json.dumps(row), flush=True)
        append_log(args.log, [row])


# ------------------------------------------------------------------------------------------------------ table
def _speed(v) -> str:
    return f"{v[0]:.2f}× ({v[1]:.2f}–{v[2]:.2f})" if v else "·"


def _cols(values: list[float], fmt: str = "{:.4f}") -> str:
    return " / ".join(fmt.format(v) for v in values)


def _side(r: dict, side: str) -> str:
    s = r[side]
    if s.get("exit"):
        return f"fails: {s.get('error', '')} | · | · | ·"
    misses = "; ".join(s["misses"]) or "within"
    return (f"{_cols(s['auc'])} | {_cols(s['logloss'])} | {s['p999_abs']:.1e} / {s['max_abs']:.1e} "
            f"(row {s['worst_row']}) | {misses}")


def table(rows: list[dict]) -> str:
    lines = ["| model | family | AUC raw | logloss raw | AUC fp32 | logloss fp32 | fp32 \\|err\\| p99.9 / max | "
             "fp32 targets | AUC int8 | logloss int8 | int8 \\|err\\| p99.9 / max | int8 targets | "
             "fp32 vs raw, 1 thread, b256 | int8 vs fp32, 1 thread, b256 | load |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("exit") == "error":
            lines.append(f"| {r['model']} | {r['family']} | fails: {r['error']} |" + " · |" * 12)
            continue
        busy = " busy: not a measurement" if max(r["load_before"], r["load_after"]) > BUSY else ""
        lines.append(f"| {r['model']} | {r['family']} | {_cols(r['raw']['auc'])} | {_cols(r['raw']['logloss'])} | "
                     f"{_side(r, 'fp32')} | {_side(r, 'int8')} | {_speed(r.get('fp32_vs_raw_t1'))} | "
                     f"{_speed(r.get('int8_vs_fp32_t1'))} | {r['load_before']:.1f}/{r['load_after']:.1f}{busy} |")
    return "\n".join(lines)


def last_rows(log: Path) -> list[dict]:
    rows = {}
    for row in read_log(log):
        rows[row["model"]] = row
    return sorted(rows.values(), key=lambda r: (r["family"], r["model"]))


def render(log: Path) -> str:
    """The table of a log, under the command, dates, CPUs and the optimize commands its rows carry, then each
    model's quantize-int8 notes (which layers stay FP32, and why)."""
    rows = last_rows(log)
    paths = sorted({r["cpu_paths"] for r in rows if r.get("cpu_paths")})
    optimized = sorted({r[s]["command"] for r in rows for s in ("fp32", "int8") if isinstance(r.get(s), dict)
                        and "command" in r[s]})
    head = (f"Command: {commands(rows)}, then `python benchmarks/precision.py table --log {log.name}` "
            f"({stamp(rows)}; {'; '.join(paths)}). MovieLens-100k test rows (the last 10 % by time); AUC and "
            "logloss per output (MMOE: click / like); |err| = |p − p_raw| (99.9th percentile / worst row); targets: "
            f"AUC drop ≤ {TARGETS['auc_drop']}, logloss rise ≤ {TARGETS['logloss_rise']}, |err| ≤ "
            f"{TARGETS['p999_abs']} on 99.9 % of rows. Speed: onnxruntime CPU, paired and interleaved, median of "
            "time(first)/time(second) (10th–90th percentile); load: the 1-minute load average before/after.\n\n"
            "Optimized with: " + "; ".join(f"`{c}`" for c in optimized))
    notes = []
    for r in rows:
        lines = r.get("int8", {}).get("int8_notes")
        if lines:
            notes.append(f"{r['model']}, quantize-int8 ({r['int8'].get('int8_status')}):\n"
                         + "\n".join(f"- {ln}" for ln in lines))
        elif r.get("int8", {}).get("precision_line"):
            notes.append(f"{r['model']}: {r['int8']['precision_line']}")
    return head + "\n\n" + table(rows) + "".join("\n\n" + n for n in notes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--corpus", default="/tmp/mlcorpus")
    r.add_argument("--only", default="")
    r.add_argument("--seconds", type=float, default=6.0, help="time budget per paired comparison")
    r.add_argument("--no-speed", action="store_true", help="accuracy only")
    r.add_argument("--int8-option", action="append", default=[], metavar="KEY=VALUE",
                   help="a quantize-int8 option for the int8 side (repeatable)")
    r.add_argument("--log", type=Path, required=True)
    r.add_argument("--work", default=None, help="folder for the optimized models (default: the system's temp)")
    t = sub.add_parser("table")
    t.add_argument("--log", type=Path, required=True)
    args = ap.parse_args()
    if args.cmd == "run":
        run(args)
        return
    print(render(args.log))


if __name__ == "__main__":
    main()
