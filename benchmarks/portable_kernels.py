"""The portable kernel library (the build the dispatcher picks here) against a -march=native build of the same
sources, paired (onnxruntime, 1 thread, batch 256, interleaved), on optimized corpus models and the 10^7-row DIN of
benchmarks/scale.py (made first: `python benchmarks/scale.py make --kind din --rows 10000000 -o /tmp/scale`).

    python benchmarks/portable_kernels.py             # prints time(native) / time(portable) per model
    python benchmarks/portable_kernels.py --write     # also keeps the run in benchmarks/portable-kernels-run.json
                                                      # (the log RESULTS renders) and rewrites RESULTS' section
    python benchmarks/portable_kernels.py --from-log benchmarks/portable-kernels-run.json [--write]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path

from common import THIRD, ZOO, provenance, read_log, write_log, write_section  # noqa: E402

MARKS = ("<!-- portable kernels: benchmarks/portable_kernels.py writes it -->", "<!-- end of portable kernels -->")
LOG = Path(__file__).resolve().parent / "portable-kernels-run.json"
SCALE_DIN = Path("/tmp/scale/din_r10000000_w16.onnx")


def label(path: Path) -> str:
    if path == SCALE_DIN:
        return "DIN, 10^7-row item table (scale.py)"
    return f"zoo {path.stem}" if path.parent == ZOO else path.stem


def native_build() -> Path:
    """The kernel library's sources compiled with -march=native, beside copies of the portable builds."""
    from ctropt import kernels
    from ctropt.kernels import compiling

    folder = Path(tempfile.mkdtemp())
    for p in kernels.build_paths() + [compiling.stamp(kernels.library_path())]:
        shutil.copy(p, folder / p.name)
    compiling._compile("gcc", ["-O3", "-shared", "-fPIC", "-Wno-psabi", f"-I{kernels.include_dir()}", "-march=native",
                               *map(str, compiling.SOURCES), "-lm"], folder / "libctropt_kernels.native.so")
    return folder


def measure() -> dict:
    os.environ["CTROPT_KERNELS_DIR"] = str(native_build())
    import ctropt
    from ctropt import kernels
    from ctropt.graph import load
    from ctropt.runtime import Runner, generate_inputs
    from ctropt.runtime.bench import compare_speed

    models = [ZOO / f"{m}_tf.onnx" for m in ("dien", "din", "deepfm", "dlrm", "mmoe")]
    models += [THIRD / "fuxictr_BST_dynamo.onnx", THIRD / "deepctr_torch_DIEN_GRU_legacy.onnx"]
    models += [p for p in [SCALE_DIN] if p.exists()]
    portable = kernels.chosen_isa()
    rows = []
    for path in models:
        raw = load(path)
        opt = ctropt.optimize(raw, speed=False).model
        feeds = generate_inputs(raw, batch=256, seed=5)
        runners = {}
        for isa in ("native", portable):
            os.environ["CTROPT_KERNELS_ISA"] = isa
            runners[isa] = Runner(opt, threads=1)
            runners[isa].run(feeds)
        v = compare_speed(runners["native"], runners[portable], feeds, threshold=1.0, seconds=6, min_pairs=30)
        rows.append({"model": label(path), "native_over_portable": [round(v.ratio, 3), round(v.p10, 3),
                                                                     round(v.p90, 3)], "pairs": v.pairs})
        print(f"{path.stem}: portable ({portable} build) vs native: {v.ratio:.3f}× ({v.p10:.3f}–{v.p90:.3f}, "
              f"{v.pairs} pairs)", flush=True)
    return {**provenance(), "portable": portable, "load": round(os.getloadavg()[0], 2), "rows": rows}


def table(data: dict) -> str:
    """The section from a run's log: {date, cpu, command, portable, load, rows}."""
    ratios = [r["native_over_portable"][0] for r in data["rows"]]
    head = (f"Command: `{data['command']}` ({data['date']}; {data['cpu']}; load average {data['load']}). "
            f"time(native -march=native build) / time(the portable library's build this CPU runs: {data['portable']}), "
            "paired and interleaved, onnxruntime CPU, 1 thread, batch 256, median (10th–90th percentile; above 1: the "
            f"portable build is faster): the medians lie between {min(ratios):.3f}× and {max(ratios):.3f}×.")
    cell = lambda v: f"{v[0]:.3f}× ({v[1]:.3f}–{v[2]:.3f})"  # noqa: E731
    return "\n".join([head, "", "| model | native / portable |", "|---|---|"]
                     + [f"| {r['model']} | {cell(r['native_over_portable'])} |" for r in data["rows"]])


def render(log: Path = LOG) -> str:
    return table(read_log(log))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="keep the run in portable-kernels-run.json and rewrite "
                    "RESULTS' section (with --from-log: the section only)")
    ap.add_argument("--from-log", type=Path, help="the table from a kept run's log, without measuring")
    args = ap.parse_args()
    if args.from_log:
        text = render(args.from_log)
    else:
        data = measure()
        text = table(data)
        if args.write:
            write_log(LOG, data)
    print(text)
    if args.write:
        write_section(MARKS, text, heading="Portable kernels vs a native build")


if __name__ == "__main__":
    main()
