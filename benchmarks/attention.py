"""DIN/DIEN: raw export vs ctropt at batch 256, 1 thread, history fills of 10 / 50 / 100 %, with a user per row
and with one user per request (all rows share the history), for zoo models and third-party exports.

    python benchmarks/attention.py                          # zoo din/dien + third-party DIN/DIEN
    python benchmarks/attention.py --only dien_tf --seconds 3
    python benchmarks/attention.py --only DIEN,dien --option rnn_ort_form=kernel   # pass options, as the CLI's

Prints a markdown table (its last: `git show 8b89a5f:benchmarks/RESULTS.md`, "Attention without padding and user
dedup"). Each cell is the median of paired
time ratios raw/optimized from one interleaved run; "without" is ctropt with remove-attention-padding and
dedup-user-side skipped, so the difference is what those two passes add.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import ctropt  # noqa: E402
from ctropt.exporters import zoo  # noqa: E402
from ctropt.graph import load  # noqa: E402
from ctropt.runtime import Runner, compare_outputs, generate_inputs  # noqa: E402
from ctropt.runtime.bench import bench  # noqa: E402

FILLS = (0.1, 0.5, 1.0)
NEW_PASSES = ("remove-attention-padding", "dedup-user-side")


def models(only: list[str]) -> list[Path]:
    found = [p for p in sorted(zoo.DATA.glob("*.onnx")) if p.stem.startswith(("din", "dien"))]
    found += [p for p in sorted((ROOT / "tests" / "data" / "thirdparty").glob("*.onnx")) if "_DI" in p.stem]
    return [p for p in found if not only or any(o in p.stem for o in only)]


def cell(runners, feeds, batch: int, seconds: float) -> str:
    r = bench(runners, feeds, batch, seconds=seconds, min_runs=10)
    return f"{r.ratio:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="")
    parser.add_argument("--seconds", type=float, default=1.5)
    parser.add_argument("--seq-len", type=int, default=100, help="history length where the model leaves it dynamic")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--option", action="append", default=[], help="KEY=VALUE pass option (repeatable)")
    args = parser.parse_args()
    options = dict(o.split("=", 1) for o in args.option)
    print(f"`python benchmarks/attention.py{''.join(' ' + a for a in sys.argv[1:])}`: batch {args.batch}, "
          f"1 thread, history length {args.seq_len} where dynamic; raw/optimized (without the two passes).\n")
    head = " | ".join(f"fill {int(f * 100)}%" for f in FILLS)
    print(f"| model | user per row: {head} | one user per request: {head} |")
    print("|---|" + "---|" * (2 * len(FILLS)))
    for path in models([o for o in args.only.split(",") if o]):
        raw = load(path)
        full = ctropt.optimize(raw, target="ort", options=options)
        base = ctropt.optimize(raw, target="ort", skip=NEW_PASSES, options=options).model
        applied = [r.name for r in full.records if r.name in NEW_PASSES and r.status == "applied"]
        runners = [Runner(m, "ort-cpu", 1) for m in (raw, full.model, base)]
        cells = []
        for one_user in (False, True):
            for fill in FILLS:
                feeds = generate_inputs(raw, batch=args.batch, seq_len=args.seq_len, fill=fill, one_user=one_user)
                ok = all(d.ok for d in compare_outputs(runners[0].run(feeds), runners[1].run(feeds)))
                mark = "" if ok else " MISMATCH"
                cells.append(f"{cell(runners[:2], feeds, args.batch, args.seconds)}"
                             f" ({cell([runners[0], runners[2]], feeds, args.batch, args.seconds)}){mark}")
        print(f"| {path.stem} ({', '.join(applied) or 'neither pass applies'}) | " + " | ".join(cells) + " |",
              flush=True)


if __name__ == "__main__":
    main()
