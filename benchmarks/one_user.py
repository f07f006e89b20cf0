"""One user × many candidates: rankers optimized with and without `--user-inputs`, against the raw export.

    python benchmarks/one_user.py [--only fuxictr,...] [--seconds 3] [--write]
    python benchmarks/one_user.py --from-log benchmarks/one-user-run.json [--write]   # the table from a kept run

A ranking request scores B candidate items for one user. For each export, about half of its sparse features are
declared user side (the user's id and profile; a history is the user's without being named): `ctropt optimize`
without and with `--user-inputs`, each with the speed guard on. All three models then run on one-user requests
(`generate_inputs(one_user=True)`: row 0's user features in every row, items differing), paired against the raw
export: the median of time(raw) / time(optimized), onnxruntime CPU, 1 thread, batch 256. Prints a markdown table;
--write (all exports) keeps the run in benchmarks/one-user-run.json, the log RESULTS.md's "One user × 256
candidates" section is rendered from, and rewrites that section.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from common import THIRD, provenance, read_log, write_log, write_section  # noqa: E402  (the checkout on sys.path)

import ctropt  # noqa: E402
from ctropt.runtime import Runner, generate_inputs  # noqa: E402
from ctropt.runtime.bench import bench  # noqa: E402

PROFILE = "user_id,gender,age"  # FuxiCTR's and deepctr's example features: 3 of 5 sparse, histories besides
HALF_C = ",".join(f"C{i}" for i in range(1, 14))  # 13 of the 26 Criteo-style sparse features
TORCH_COLUMNS = "X[0],X[3:5]"  # deepctr-torch packs the same features in one matrix: user_id, gender, age by column
MARKS = ("<!-- one-user table: benchmarks/one_user.py writes it -->", "<!-- end of one-user table -->")
LOG = Path(__file__).resolve().parent / "one-user-run.json"
HEAD = ["| export | user inputs | `optimize` | `optimize --user-inputs` | dedup-user-side |", "|---|---|---|---|---|"]
CASES = [(f"fuxictr_{m}_{e}", PROFILE) for m in ("WideDeep", "DeepFM", "DCNv2", "MMoE") for e in ("dynamo", "legacy")] + \
        [(f"deepctr_{m}_tf2onnx", PROFILE) for m in ("WDL", "DeepFM", "DCN", "MMOE")] + \
        [(f"deepctr_torch_{m}_{e}", TORCH_COLUMNS) for m in ("WDL", "DeepFM", "DCN", "MMOE") for e in ("dynamo", "legacy")] + \
        [(f"paddlerec_{m}_paddle2onnx", HALF_C) for m in ("WideDeep", "DeepFM", "DCN")] + \
        [(f"deeprec_{m}_tf2onnx", "C1:0,C2:0,C3:0") for m in ("WDL", "DeepFM", "DCNv2")] + \
        [("deeprec_MMoE_tf2onnx", "user_id:0,age_level:0,tag_category_list:0")] + \
        [(f"fuxictr_BST_{e}", PROFILE) for e in ("dynamo", "legacy")] + \
        [(f"torch_rechub_BST_{e}", "user_id,gender") for e in ("dynamo", "legacy")] + \
        [("paddlerec_BST_paddle2onnx", "userid"), ("deeprec_BST_tf2onnx", "user_id:0,age_level:0"),
         ("deepctr_BST_tf2onnx", PROFILE)]   # the behaviour-sequence transformers (#26's one-user measure)


def _ratio(raw, model, feeds, seconds: float) -> list[float]:
    r = bench([Runner(raw, "ort-cpu", 1), Runner(model, "ort-cpu", 1)], feeds, 256, seconds=seconds, min_runs=20)
    return [round(r.ratio, 3), round(r.ratio_p10, 3), round(r.ratio_p90, 3)]


def line(row: dict) -> str:
    names = row["user_inputs"].split(",")
    shown = row["user_inputs"] if len(names) <= 4 else f"{names[0]}..{names[-1]}"
    cell = lambda v: f"{v[0]:.2f}× ({v[1]:.2f}–{v[2]:.2f})"  # noqa: E731
    return f"| {row['export']} | {shown} | {cell(row['optimize'])} | {cell(row['user_side'])} | {row['dedup']} |"


def table(data: dict) -> str:
    """The section from a run's log: {date, cpu, command, rows}."""
    head = (f"Command: `{data['command']}` ({data['date']}; {data['cpu']}). One-user requests, onnxruntime CPU, "
            "1 thread, batch 256, paired: raw / optimized.")
    return "\n".join([head, ""] + HEAD + [line(r) for r in data["rows"]])


def render(log: Path = LOG) -> str:
    return table(read_log(log))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma list: stems containing one of these")
    ap.add_argument("--seconds", type=float, default=3.0, help="time per comparison")
    ap.add_argument("--write", action="store_true", help="keep the run in one-user-run.json and put the table in "
                    "benchmarks/RESULTS.md (all exports)")
    ap.add_argument("--from-log", type=Path, help="the table from a kept run's log, without measuring")
    args = ap.parse_args()
    if args.from_log:
        text = render(args.from_log)
        print(text)
        if args.write:
            write_section(MARKS, text)
        return
    only = [o for o in args.only.split(",") if o]
    print("\n".join(HEAD))
    rows = []
    for stem, users in CASES:
        if only and not any(o in stem for o in only):
            continue
        raw = ctropt.load(THIRD / f"{stem}.onnx")
        plain = ctropt.optimize(raw).model
        declared = ctropt.optimize(raw, options={"user_inputs": users})
        record = next(r for r in declared.records if r.name == "dedup-user-side")
        feeds = generate_inputs(raw, batch=256, seed=4, one_user=True, user_inputs=users)
        rows.append({"export": stem, "user_inputs": users, "optimize": _ratio(raw, plain, feeds, args.seconds),
                     "user_side": _ratio(raw, declared.model, feeds, args.seconds), "dedup": record.status})
        print(line(rows[-1]), flush=True)
    if args.write and only:
        print("--write takes the whole table: nothing written with --only")
    elif args.write:
        data = {**provenance(), "rows": rows}
        write_log(LOG, data)
        write_section(MARKS, table(data))


if __name__ == "__main__":
    main()
