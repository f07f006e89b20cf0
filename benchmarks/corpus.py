"""Never slower, never broken: every export of the corpus (the zoo and tests/data/thirdparty) through
`ctropt optimize` as a user runs it, checked and timed against its raw export.

    python benchmarks/corpus.py                      # everything; prints the table of every export
    python benchmarks/corpus.py --only fuxictr,paddle # stems containing one of these
    python benchmarks/corpus.py --twice              # optimize twice: do the speed guard's decisions repeat?
    python benchmarks/corpus.py --log run.jsonl      # also keep each export's measurements, a JSON line each
    python benchmarks/corpus.py --from-log run.jsonl # the table from a kept run (each export's last line), without
                                                     # measuring: `--only X --log run.jsonl` re-measures X into it
    python benchmarks/corpus.py --from-log benchmarks/corpus-run.jsonl --write   # RESULTS' corpus section

RESULTS.md holds the summary per library (`render`) of the committed log, benchmarks/corpus-run.jsonl; the row of
every export is in that log (`--from-log` prints them all). A full run with `--log benchmarks/corpus-run.jsonl`
rewrites the section.

Per export: `ctropt optimize RAW -o OPT --json` (exit code, wall time, the guard's keep/rollback decisions),
`ctropt optimize RAW --target openvino`; both saved models through onnx's full checker; the interface against
the raw export's; the ort model's outputs against the framework's own (the export's .ref.npz, within 1e-4);
the openvino model compiled and run in OpenVINO against the same (a model with string inputs, which OpenVINO's ONNX
reader cannot load, as `ctropt split-strings` serves it: the raw export split, its id model optimized for OpenVINO
and run there on the ids its front makes in onnxruntime-extensions); then raw vs optimized on onnxruntime CPU,
1 thread, batch 256 (generated inputs), paired and interleaved: the median of time(raw)/time(optimized).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx

from common import THIRD, ZOO, provenance, read_log, stamp, write_section

from ctropt.graph import CtroptError, interface, load, node_count, save  # noqa: E402
from ctropt.runtime import Runner, compare_outputs, generate_inputs  # noqa: E402
from ctropt.runtime.bench import bench  # noqa: E402
from ctropt.string_front import split_strings  # noqa: E402

CTROPT = [sys.executable, "-m", "ctropt"]
MARKS = BEGIN, END = "<!-- corpus table: benchmarks/corpus.py writes it -->", "<!-- end of corpus table -->"
LOG = Path(__file__).resolve().parent / "corpus-run.jsonl"
LIBRARIES = {"deepctr_torch": "deepctr-torch", "deepctr": "DeepCTR", "fuxictr": "FuxiCTR", "paddlerec": "PaddleRec",
             "deeprec": "DeepRec", "torchrec": "torchrec", "recbole": "RecBole", "torch_rechub": "torch-rechub"}


def exports(only: list[str]) -> list[Path]:
    found = sorted(ZOO.glob("*.onnx")) + sorted(THIRD.glob("*.onnx"))
    return [p for p in found if p.with_suffix(".ref.npz").exists() and (not only or any(o in p.stem for o in only))]


def library(path: Path) -> str:
    return next((name for prefix, name in LIBRARIES.items() if path.stem.startswith(prefix + "_")), "zoo")


def npz(path: Path) -> dict:
    with np.load(path) as data:
        return {k: data[k] for k in data.files}


def optimize(raw: Path, out: Path, *extra: str, timeout: int = 300) -> dict:
    """`ctropt optimize` in a subprocess: exit code, wall time, and its --json record."""
    report = out.with_suffix(".json")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(CTROPT + ["optimize", str(raw), "-o", str(out), "--json", str(report), *extra],
                              capture_output=True, text=True, timeout=timeout)
        code, tail = proc.returncode, (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [""]
    except subprocess.TimeoutExpired:
        code, tail = "timeout", [f"still running after {timeout} s"]
    result = {"exit": code, "seconds": time.perf_counter() - t0, "error": tail[0][:160] if code != 0 else ""}
    if code == 0:
        result.update(json.loads(report.read_text()))
    return result


def decisions(record: dict) -> list[str]:
    return [f"{p['name']}:{p['status']}" for p in record.get("passes", []) if p["status"] in ("applied", "slower")]


def outputs_error(model: Path, feeds: dict, ref: dict, backend: str, front=None) -> tuple[float | None, str]:
    """Max abs error against the framework's outputs, and a problem in words ('' when within 1e-4). front: a
    split-strings front that makes the model's feeds from the raw ones."""
    try:
        got = Runner(str(model), backend).run(front.ids(feeds) if front else feeds)
    except CtroptError as e:
        return None, str(e)[:120]
    diffs = compare_outputs(ref, {k: got[k] for k in ref}, atol=1e-4, rtol=1e-4)
    return max((d.max_abs for d in diffs), default=0.0), "" if all(d.ok for d in diffs) else "outputs differ"


def checker(model: Path) -> str:
    try:
        onnx.checker.check_model(str(model), full_check=True)
        return "ok"
    except Exception as e:  # noqa: BLE001  (checker and shape-inference errors)
        return str(e).strip().splitlines()[0][:100]


def speed(raw: Path, opt: Path, seconds: float) -> str:
    model = load(raw)
    feeds = generate_inputs(model, batch=256)
    try:
        r = bench([Runner(model, "ort-cpu", 1), Runner(str(opt), "ort-cpu", 1)], feeds, 256, seconds=seconds,
                  min_runs=10)
    except CtroptError as e:
        return f"fails: {str(e)[:60]}"
    return f"{r.ratio:.2f} ({r.ratio_p10:.2f}–{r.ratio_p90:.2f})"


def openvino_part(raw: Path, work: Path) -> tuple[Path, object, list]:
    """(the model for OpenVINO, the split-strings front or None, extra optimize arguments). OpenVINO reads no string
    op: a model with string inputs is split, and its id model optimized on ids as split-strings samples them."""
    model = load(raw)
    if not any(i.type.tensor_type.elem_type == onnx.TensorProto.STRING for i in model.graph.input):
        return raw, None, []
    ids, front = split_strings(model)
    np.savez(work / "ids.inputs.npz", **front.ids(generate_inputs(model, batch=64, seed=256)))
    return save(ids, work / "ids.onnx"), front, ["--inputs", str(work / "ids.inputs.npz")]


def measure(raw: Path, work: Path, args) -> dict:
    row = {"model": raw.stem, "library": library(raw), "nodes": node_count(load(raw))}
    ort = optimize(raw, work / "ort.onnx")
    row["ort"] = {k: ort.get(k) for k in ("exit", "seconds", "error", "kept_input", "speed")}
    row["decisions"] = decisions(ort)
    if args.twice:
        row["decisions_again"] = decisions(optimize(raw, work / "ort2.onnx"))
    feeds, ref = npz(raw.with_suffix(".npz")), npz(raw.with_suffix(".ref.npz"))
    try:
        source, front, extra = openvino_part(raw, work)
        ov = optimize(source, work / "ov.onnx", "--target", "openvino", *extra)
    except CtroptError as e:
        front, ov = None, {"exit": "split-strings", "seconds": 0.0, "error": str(e)[:160]}
    row["ov"] = {k: ov.get(k) for k in ("exit", "seconds", "error")}
    if ort["exit"] == 0:
        opt = work / "ort.onnx"
        row["nodes_opt"] = node_count(load(opt))
        row["checker"] = checker(opt)
        row["interface"] = interface(load(opt)) == interface(load(raw))
        row["ort_err"], row["ort_problem"] = outputs_error(opt, feeds, ref, "ort-cpu")
        row["speed"] = speed(raw, opt, args.seconds)
    if ov["exit"] == 0:
        row["ov_checker"] = checker(work / "ov.onnx")
        row["ov_err"], row["ov_problem"] = outputs_error(work / "ov.onnx", feeds, ref, "openvino-cpu", front)
    return row


def cell_ok(row: dict) -> str:
    """What breaks the export's promise, or 'ok'."""
    problems = []
    for side in ("ort", "ov"):
        if row[side]["exit"] != 0:
            problems.append(f"{side}: exit {row[side]['exit']} {row[side]['error']}")
        elif row[side]["seconds"] > 60:
            problems.append(f"{side}: {row[side]['seconds']:.0f} s")
    if row.get("checker", "ok") != "ok" or row.get("ov_checker", "ok") != "ok":
        problems.append(f"checker: {row.get('checker') if row.get('checker') != 'ok' else row.get('ov_checker')}")
    if row.get("interface") is False:
        problems.append("interface changed")
    for key in ("ort_problem", "ov_problem"):
        if row.get(key):
            problems.append(f"{key[:-8]}: {row[key]}")
    return "; ".join(problems) or "ok"


def table(rows: list[dict], twice: bool) -> str:
    head = ("| export | library | nodes raw → opt | optimize s (ort / openvino) | rolled back for speed | "
            "max err vs framework (ort / OpenVINO) | checks | ORT 1 thread b256: raw/opt |"
            + (" same decisions twice |" if twice else ""))
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        slower = [d.split(":")[0] for d in r["decisions"] if d.endswith(":slower")]
        if r["ort"].get("kept_input"):
            slower.append("**whole result: input kept**")
        errs = " / ".join("-" if r.get(k) is None else f"{r[k]:.1e}" for k in ("ort_err", "ov_err"))
        line = (f"| {r['model']} | {r['library']} | {r['nodes']} → {r.get('nodes_opt', '-')} | "
                f"{r['ort']['seconds']:.1f} / {r['ov']['seconds']:.1f} | {', '.join(slower) or '-'} | {errs} | "
                f"{cell_ok(r)} | {r.get('speed', '-')} |")
        if twice:
            line += f" {'yes' if r['decisions'] == r.get('decisions_again') else 'NO'} |"
        lines.append(line)
    return "\n".join(lines)


def summary(rows: list[dict]) -> str:
    ratios = [float(r["speed"].split()[0]) for r in rows if re.match(r"^[0-9.]+ ", r.get("speed", ""))]
    ok = sum(cell_ok(r) == "ok" for r in rows)
    geo = float(np.exp(np.mean(np.log(ratios)))) if ratios else float("nan")
    return (f"{len(rows)} exports from {len({r['library'] for r in rows})} sources; {ok} pass every check; "
            f"ORT 1 thread, batch 256: min {min(ratios, default=float('nan')):.2f}×, geometric mean {geo:.2f}×, "
            f"{sum(x < 0.97 for x in ratios)} below 0.97×.")


def _ratio(row: dict) -> float | None:
    m = re.match(r"^([0-9.]+) ", row.get("speed", ""))
    return float(m.group(1)) if m else None


def by_library(rows: list[dict]) -> str:
    """One line per library: exports, how many pass every check, how many had a pass rolled back by the speed
    guard, nodes before and after (all exports summed), and raw/optimized on onnxruntime (1 thread, batch 256)."""
    lines = ["| library | exports | pass every check | a pass rolled back | nodes raw → opt (sum) | "
             "raw/opt: geometric mean | lowest | highest |", "|---|---|---|---|---|---|---|---|"]
    names = sorted({r["library"] for r in rows}, key=str.lower)
    for name in names + ["all"]:
        group = [r for r in rows if name in ("all", r["library"])]
        ratios = [x for x in map(_ratio, group) if x is not None]
        rolled = sum(any(d.endswith(":slower") for d in r["decisions"]) or bool(r["ort"].get("kept_input"))
                     for r in group)
        geo = f"{float(np.exp(np.mean(np.log(ratios)))):.2f}×" if ratios else "·"
        lines.append(f"| {name} | {len(group)} | {sum(cell_ok(r) == 'ok' for r in group)} | {rolled} | "
                     f"{sum(r['nodes'] for r in group)} → {sum(r.get('nodes_opt') or 0 for r in group)} | {geo} | "
                     f"{min(ratios, default=float('nan')):.2f}× | {max(ratios, default=float('nan')):.2f}× |")
    failing = [f"{r['model']} ({cell_ok(r)})" for r in rows if cell_ok(r) != "ok"]
    if failing:
        lines += ["", "Failing a check: " + "; ".join(failing) + "."]
    return "\n".join(lines)


def last_rows(log: Path) -> list[dict]:
    """Each export's last row in a log (re-measure some with --only and --log into the same file)."""
    kept = {}
    for row in read_log(log):
        kept.pop(row["model"], None)
        kept[row["model"]] = row
    return sorted(kept.values(), key=lambda r: (r["library"].lower(), r["model"]))


def render(log: Path = LOG) -> str:
    """RESULTS' corpus section from a log: the summary per library of each export's last row."""
    rows = last_rows(log)
    name = f"benchmarks/{log.name}" if log.resolve() == LOG else log.name
    return (f"Command: `python benchmarks/corpus.py --log {name}` (subsets again with `--only`), then `python "
            f"benchmarks/corpus.py --from-log {name} --write` ({stamp(rows)}). {summary(rows)} Each export's row: "
            f"`python benchmarks/corpus.py --from-log {name}`.\n\n" + by_library(rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma list: stems containing one of these")
    ap.add_argument("--twice", action="store_true", help="optimize each export twice and compare the decisions")
    ap.add_argument("--seconds", type=float, default=3.0, help="time per raw/optimized comparison")
    ap.add_argument("--log", type=Path, help="append each export's measurements to this file (JSON lines)")
    ap.add_argument("--from-log", type=Path, help="the table from a --log file instead of measuring")
    ap.add_argument("--write", action="store_true", help="put the log's summary in RESULTS.md")
    args = ap.parse_args()
    only = [o for o in args.only.split(",") if o]
    if args.from_log:
        rows = last_rows(args.from_log)
        args.twice = "decisions_again" in rows[0]
    else:
        rows = []
        for raw in exports(only):
            with tempfile.TemporaryDirectory(prefix="ctropt-corpus-") as tmp:
                rows.append({**measure(raw, Path(tmp), args), **provenance()})
            if args.log:
                with args.log.open("a") as log:
                    log.write(json.dumps(rows[-1]) + "\n")
    print(f"{stamp(rows)}. {summary(rows)}\n\n{table(rows, args.twice)}\n\n{by_library(rows)}")
    log = args.from_log or args.log
    if log and (args.write or (not only and not args.from_log and log.resolve() == LOG)):
        text = render(log)
        write_section(MARKS, text, heading="The corpus through `ctropt optimize` with the speed guard")
        print(f"\nRESULTS.md's corpus section rewritten from {log}")

if __name__ == "__main__":
    main()
