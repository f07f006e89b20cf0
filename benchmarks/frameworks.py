"""The frameworks as yardstick: each zoo model in its own framework beside its export on onnxruntime and OpenVINO,
raw and through ctropt, one table and one chart of speed-up over the framework.

    python benchmarks/frameworks.py                        # every zoo model, batch 256, 1 thread
    python benchmarks/frameworks.py --only wdl,din --rounds 20
    python benchmarks/frameworks.py --write                # also keep the run in frameworks-run.json (the log
                                                           # RESULTS renders), rewrite its table and frameworks.svg
    python benchmarks/frameworks.py --from-log benchmarks/frameworks-run.json [--write]   # the table from a log

Per zoo model and framework (each in a process of its own: TensorFlow and PyTorch are never loaded together), the
model is built with its seeded weights and exported fresh (so every form computes the same function), and these
run on the same generated inputs (batch 256, histories of 100), with the same thread count:
- the framework as a user serves it: TensorFlow's frozen graph as a graph function (`wrap_function`), PyTorch's
  module eagerly (`inference_mode`);
- the framework compiled: `tf.function(jit_compile=True)` (XLA), `torch.compile` (inductor);
- the raw export and `ctropt optimize` (`--target ort`) on onnxruntime CPU;
- the raw export and `ctropt optimize --target openvino` on OpenVINO CPU (f32).
Each form's outputs are checked against the framework's (within 1e-4); all forms then run interleaved, round after
round, and each cell is the median over rounds of time(framework) / time(form): > 1 means faster than the framework.
A form that fails (does not compile, does not load, gives other outputs) says so in its cell.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from common import ROOT, provenance, read_log, write_log, write_section

FORMS = ("framework compiled", "ORT raw", "ORT ctropt", "OpenVINO raw", "OpenVINO ctropt")
COMPILED = {"tf": "XLA", "torch": "torch.compile"}
BASE = {"tf": "TF graph", "torch": "PyTorch eager"}
MARKS = ("<!-- cross-runtime table: benchmarks/frameworks.py writes it -->", "<!-- end of cross-runtime table -->")
LOG = Path(__file__).resolve().parent / "frameworks-run.json"


def _tf_forms(spec, threads: int):
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    wrapped = tf.compat.v1.wrap_function(lambda: tf.compat.v1.import_graph_def(spec.graph_def, name=""), [])
    graph = wrapped.graph
    fn = wrapped.prune([graph.get_tensor_by_name(f"{i.name}:0") for i in spec.inputs],
                       [graph.get_tensor_by_name(f"{o}:0") for o in spec.outputs])
    xla = tf.function(lambda *args: fn(*args), jit_compile=True)
    names = [i.name for i in spec.inputs]

    def call(f):
        def run(feeds):
            out = f(*[tf.constant(feeds[n]) for n in names])
            return {o: np.asarray(v) for o, v in zip(spec.outputs, out)}
        return run
    return call(fn), call(xla)


def _torch_forms(spec, threads: int):
    import torch

    torch.set_num_threads(threads)
    module = spec.module.eval()
    compiled = torch.compile(module)
    names = [i.name for i in spec.inputs]

    def call(f):
        def run(feeds):
            with torch.inference_mode():
                out = f(*[torch.from_numpy(feeds[n]) for n in names])
            out = out if isinstance(out, (tuple, list)) else (out,)
            return {o: v.numpy() for o, v in zip(spec.outputs, out)}
        return run
    return call(module), call(compiled)


def _onnx_forms(raw, threads: int) -> dict:
    """The four ONNX forms as callables, or the reason each one cannot run."""
    import ctropt
    from ctropt.graph import CtroptError
    from ctropt.runtime import Runner

    made = {}
    for form, target, backend in (("ORT raw", None, "ort-cpu"), ("ORT ctropt", "ort", "ort-cpu"),
                                  ("OpenVINO raw", None, "openvino-cpu"),
                                  ("OpenVINO ctropt", "openvino", "openvino-cpu")):
        try:
            model = raw if target is None else ctropt.optimize(raw, passes="all", target=target).model
            made[form] = Runner(model, backend, threads).run
        except CtroptError as e:
            made[form] = f"fails: {str(e)[:70]}"
    return made


def measure(name: str, framework: str, batch: int, rounds: int, threads: int) -> dict:
    """One zoo model in one framework: every form checked against the framework, then timed interleaved."""
    from ctropt.exporters.zoo import SEQ_LENS, builder, export_spec

    spec = builder(name, framework)()
    feeds = spec.sample(batch, SEQ_LENS[0], np.random.default_rng(0))
    base, compiled = (_tf_forms if framework == "tf" else _torch_forms)(spec, threads)
    forms = {"framework compiled": compiled, **_onnx_forms(export_spec(spec).model, threads)}
    want = base(feeds)
    for form, run in list(forms.items()):
        if isinstance(run, str):
            continue
        try:
            for _ in range(3):   # the compiled forms compile on their first calls
                got = run(feeds)
            if any(np.shape(got[k]) != np.shape(want[k]) for k in want):
                raise ValueError("outputs of another shape")
            err = max(float(np.abs(np.asarray(got[k], np.float64) - want[k]).max()) for k in want)
            if not err <= 1e-4:
                forms[form] = f"other outputs (max err {err:.1e})"
        except Exception as e:   # a form the framework or runtime cannot run: its cell says why
            forms[form] = f"fails: {str(e).strip().splitlines()[0][:70] if str(e).strip() else type(e).__name__}"
    live = {f: r for f, r in forms.items() if not isinstance(r, str)}
    times = {f: [] for f in ["base", *live]}
    for _ in range(rounds):
        for form, run in [("base", base), *live.items()]:
            start = time.perf_counter()
            run(feeds)
            times[form].append(time.perf_counter() - start)
    base_t = np.array(times["base"])
    cells = {}
    for form in FORMS:
        if form in live:
            ratios = base_t / np.array(times[form])
            cells[form] = [float(np.median(ratios)), float(np.percentile(ratios, 10)),
                           float(np.percentile(ratios, 90))]
        else:
            cells[form] = forms[form]
    return {"model": f"{name}_{framework}", "framework": framework, "base_ms": float(np.median(base_t) * 1e3),
            "cells": cells}


def _cell(value) -> str:
    return value if isinstance(value, str) else f"{value[0]:.2f}× ({value[1]:.2f}–{value[2]:.2f})"


def table(data: dict) -> str:
    """The section from a run's log: {date, cpu, command, rows}."""
    rows = data["rows"]
    lines = [f"Command: `{data['command']}` ({data['date']}; {data['cpu']}). Speed-up over the framework as served "
             f"(TF graph function, PyTorch eager), median of paired rounds (10th–90th percentile); > 1 is faster.", "",
             "| model | framework (median per batch) | " + " | ".join(FORMS) + " |",
             "|---|---|" + "---|" * len(FORMS)]
    for r in rows:
        base = f"{BASE[r['framework']]} ({r['base_ms']:.1f} ms)"
        cells = [_cell(r["cells"][f]).replace("framework compiled", COMPILED[r["framework"]]) for f in FORMS]
        lines.append(f"| {r['model']} | {base} | " + " | ".join(cells) + " |")
    lines.append(f"\n\"framework compiled\" is {COMPILED['tf']} for the TF models and {COMPILED['torch']} for the "
                 "PyTorch ones. Chart: ![speed-up over the framework](frameworks.svg)")
    return "\n".join(lines)


def render(log: Path = LOG) -> str:
    return table(read_log(log))


def chart(rows: list[dict]) -> str:
    """Grouped horizontal bars of each form's speed-up (log scale, the framework at 1×) as an SVG document."""
    colors = ("#9ca3af", "#93c5fd", "#2563eb", "#fcd34d", "#d97706")
    values = [c[0] for r in rows for c in r["cells"].values() if not isinstance(c, str)]
    top = max([4.0] + values)
    left, width, bar, gap = 150, 520, 9, 14
    x = lambda v: left + width * (np.log(max(v, 0.1)) - np.log(0.1)) / (np.log(top * 1.2) - np.log(0.1))  # noqa: E731
    height = 40 + len(rows) * (len(FORMS) * bar + gap) + 20 * (len(FORMS) + 1)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 90}" height="{height}" '
           'font-family="sans-serif" font-size="11">',
           f'<text x="{left}" y="16" font-weight="bold">Speed-up over the framework (log scale)</text>']
    for tick in (0.25, 0.5, 1, 2, 4, 8, 16, 32, 64):
        if tick <= top * 1.2:
            out.append(f'<line x1="{x(tick):.1f}" y1="24" x2="{x(tick):.1f}" y2="{height - 20 * (len(FORMS) + 1)}" '
                       f'stroke="{"#111" if tick == 1 else "#e5e7eb"}"/><text x="{x(tick):.1f}" y="22" '
                       f'text-anchor="middle">{tick:g}×</text>')
    y = 30
    for r in rows:
        out.append(f'<text x="{left - 6}" y="{y + len(FORMS) * bar / 2 + 4}" text-anchor="end">{r["model"]}</text>')
        for form, color in zip(FORMS, colors):
            cell = r["cells"][form]
            if not isinstance(cell, str):
                out.append(f'<rect x="{x(0.1):.1f}" y="{y}" width="{x(cell[0]) - x(0.1):.1f}" height="{bar - 1}" '
                           f'fill="{color}"/><text x="{x(cell[0]) + 3:.1f}" y="{y + bar - 1}">{cell[0]:.2f}</text>')
            y += bar
        y += gap
    for i, (form, color) in enumerate(zip(FORMS, colors)):
        out.append(f'<rect x="{left}" y="{y + 20 * i}" width="12" height="10" fill="{color}"/>'
                   f'<text x="{left + 18}" y="{y + 20 * i + 9}">{form}</text>')
    return "\n".join(out + ["</svg>"]) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma list of zoo model names (wdl, din, ...)")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--write", action="store_true", help="keep the run in frameworks-run.json, rewrite RESULTS' "
                    "table and frameworks.svg (with --from-log: the table only)")
    ap.add_argument("--from-log", type=Path, help="the table from a kept run's log, without measuring")
    ap.add_argument("--one", help=argparse.SUPPRESS)   # name:framework, measured in this process
    args = ap.parse_args()
    if args.one:
        name, framework = args.one.split(":")
        print(json.dumps(measure(name, framework, args.batch, args.rounds, args.threads)))
        return
    if args.from_log:
        text = render(args.from_log)
        print(text)
        if args.write:
            write_section(MARKS, text)
        return
    from ctropt.exporters.zoo import ENTRIES

    only = [o for o in args.only.split(",") if o]
    rows = []
    for name, entry in ENTRIES.items():
        for framework in entry.frameworks if not only or name in only else ():
            cmd = [sys.executable, __file__, "--one", f"{name}:{framework}", "--batch", str(args.batch),
                   "--rounds", str(args.rounds), "--threads", str(args.threads)]
            env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
            done = subprocess.run(cmd, capture_output=True, text=True, env=env)
            lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
            if done.returncode or not lines:
                print(f"{name}_{framework}: failed\n{done.stderr[-2000:]}", file=sys.stderr)
                continue
            rows.append(json.loads(lines[-1]))
            print(f"{name}_{framework}: done", file=sys.stderr, flush=True)
    data = {**provenance(), "rows": rows}
    text = table(data)
    print(text)
    if args.write:
        write_log(LOG, data)
        (ROOT / "benchmarks/frameworks.svg").write_text(chart(rows))
        write_section(MARKS, text)


if __name__ == "__main__":
    main()
