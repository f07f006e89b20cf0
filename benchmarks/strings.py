"""String features (#29): the string zoo models raw vs ctropt, on onnxruntime (with onnxruntime-extensions) and, by
way of `split-strings`, on OpenVINO.

    python benchmarks/strings.py [--seconds 4] [--batch 256] [--write]

Rows, each the median of paired, interleaved runs (time(A) / time(B), > 1: B is faster; 1 thread):
- `ctropt optimize` (all passes) vs the raw export, both with their string ops, on onnxruntime;
- the fused string chains: `all` vs `all` without `string-embedding`;
- the server's side when the client hashes: the raw export vs the optimized id model (split-strings of the
  optimized model) fed the front's ids;
- the same request end to end through the split: front + optimized id model vs the raw export (what the split
  costs where strings arrive at the server);
- OpenVINO, which cannot load the raw export: the id model optimized with --target openvino (optimized on the
  front's ids of generated strings) vs the raw id model, both on OpenVINO, and end to end with the front on
  onnxruntime against the raw export on onnxruntime.
`--write` keeps the run in benchmarks/strings-run.json, the log RESULTS' string section is rendered from, and
rewrites that section; `--from-log benchmarks/strings-run.json [--write]` renders a kept run.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from common import THIRD, ZOO, provenance, read_log, write_log, write_section  # noqa: E402  (the checkout on sys.path)

import ctropt  # noqa: E402
from ctropt.passes.speed import SpeedCheck  # noqa: E402
from ctropt.runtime import Runner, generate_inputs  # noqa: E402
from ctropt.runtime.bench import bench  # noqa: E402
from ctropt.string_front import split_strings  # noqa: E402

MODELS = {"wdl_strings_tf": ZOO, "din_strings_tf": ZOO, "deeprec_WDL_strings_tf2onnx": THIRD,
          "deeprec_DIN_strings_tf2onnx": THIRD}
MARKS = ("<!-- string features: benchmarks/strings.py writes it -->", "<!-- end of string features -->")
LOG = Path(__file__).resolve().parent / "strings-run.json"


class Split:
    """The front on onnxruntime, then the id model on `backend`: one request through the split."""

    def __init__(self, front, ids_model, backend: str):
        self.front, self.model = front, Runner(ids_model, backend, threads=1)

    def run(self, feeds):
        return self.model.run(self.front.ids(feeds))


def _cell(r) -> str:
    return r if isinstance(r, str) else f"{r[0]:.2f}× ({r[1]:.2f}–{r[2]:.2f})"


def _timed(runners, feeds, batch: int, seconds: float):
    """The paired ratio [median, p10, p90], or why a side does not run (OpenVINO and a raw id model with a
    dynamic-rank Squeeze)."""
    try:
        r = bench(runners(), feeds, batch, seconds=seconds)
        return [round(r.ratio, 3), round(r.ratio_p10, 3), round(r.ratio_p90, 3)]
    except ctropt.CtroptError as e:
        return f"fails: {str(e).splitlines()[0][:90]}"


def measure(name: str, folder, batch: int, seconds: float) -> list[tuple[str, list | str]]:
    raw = ctropt.load(folder / f"{name}.onnx")
    feeds = generate_inputs(raw, batch=batch, seed=7)
    opt = ctropt.optimize(raw).model
    unfused = ctropt.optimize(raw, skip=["string-embedding"]).model
    ids_opt, front_opt = split_strings(opt)
    ids_raw, front_raw = split_strings(raw)
    id_feeds = front_raw.ids(feeds)
    ov = ctropt.optimize(ids_raw, target="openvino", feeds=id_feeds,
                         speed=SpeedCheck(batch=batch, feeds=id_feeds)).model
    r_raw, r_opt = Runner(raw, threads=1), Runner(opt, threads=1)
    ov_raw = lambda: [Runner(ids_raw, "openvino-cpu", threads=1), Runner(ov, "openvino-cpu", threads=1)]  # noqa: E731
    return [  # each row a paired ratio, or why it does not run
        ("optimize (all) vs raw, onnxruntime", _timed(lambda: [r_raw, r_opt], feeds, batch, seconds)),
        ("string-embedding: all vs all without it, onnxruntime",
         _timed(lambda: [Runner(unfused, threads=1), r_opt], feeds, batch, seconds)),
        ("server side, client hashes: optimized id model vs raw", _timed(
            lambda: [_Fixed(r_raw, feeds), _Fixed(Runner(ids_opt, threads=1), front_opt.ids(feeds))], feeds, batch,
            seconds)),
        ("end to end through the split: front + optimized id model vs raw",
         _timed(lambda: [r_raw, Split(front_opt, ids_opt, "ort-cpu")], feeds, batch, seconds)),
        ("OpenVINO: id model --target openvino vs raw id model", _timed(ov_raw, id_feeds, batch, seconds)),
        ("front (onnxruntime) + OpenVINO id model vs raw on onnxruntime",
         _timed(lambda: [r_raw, Split(front_raw, ov, "openvino-cpu")], feeds, batch, seconds))]


class _Fixed:
    """A runner fed its own inputs whatever it is given (the id model on the ids the client computed)."""

    def __init__(self, runner, feeds):
        self.runner, self.feeds = runner, feeds

    def run(self, _):
        return self.runner.run(self.feeds)


def table(data: dict) -> str:
    """The section from a run's log: {date, cpu, command, rows}."""
    lines = [f"Command: `{data['command']}` ({data['date']}; {data['cpu']}; 1 thread; "
             "time(A) / time(B), > 1: B is faster; median, p10–p90).", "",
             "| model | A → B | ratio |", "|---|---|---|"]
    return "\n".join(lines + [f"| {r['model']} | {r['what']} | {_cell(r['ratio'])} |" for r in data["rows"]])


def render(log: Path = LOG) -> str:
    return table(read_log(log))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--from-log", type=Path, help="the table from a kept run's log, without measuring")
    args = ap.parse_args()
    if args.from_log:
        text = render(args.from_log)
    else:
        rows = []
        for name, folder in MODELS.items():
            for what, ratio in measure(name, folder, args.batch, args.seconds):
                rows.append({"model": name, "what": what, "ratio": ratio})
                print(f"| {name} | {what} | {_cell(ratio)} |", flush=True)
        data = {**provenance(), "rows": rows}
        text = table(data)
        if args.write:
            write_log(LOG, data)
    print(text)
    if args.write:
        write_section(MARKS, text, "String features (#29)")


if __name__ == "__main__":
    main()
