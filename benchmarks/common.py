"""What the benchmark scripts share: the repository on sys.path (so they run from a checkout), the model files, and
their logs: each script keeps what it measured in a log beside it (JSON or JSON lines, each row with its date, CPU and
command) and renders its RESULTS.md section from that log alone, so `python benchmarks/results.py` rewrites every
section from the committed logs and tests/test_results.py fails on a hand edit."""

import gzip
import json
import os
import pathlib
import shlex
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
ZOO = ROOT / "ctropt/exporters/zoo/data"
THIRD = ROOT / "tests/data/thirdparty"


def machine() -> str:
    """The CPU the numbers come from, as /proc/cpuinfo names it, and its cores: every table in RESULTS.md says it."""
    from ctropt.runtime.cpu import cpu_info

    return f"{cpu_info().name}, {os.cpu_count()} cores"


def today() -> str:
    return time.strftime("%Y-%m-%d")


def command() -> str:
    """This script's command line as a user types it from the repository root."""
    return shlex.join(["python", f"benchmarks/{pathlib.Path(sys.argv[0]).name}", *sys.argv[1:]])


def provenance(cmd: str | None = None) -> dict:
    """What every log row carries beside its numbers: the date, the CPU (ctropt.runtime.cpu.cpu_info), the command."""
    return {"date": today(), "cpu": machine(), "command": cmd or command()}


def _open(path: pathlib.Path, mode: str):
    return gzip.open(path, mode + "t") if str(path).endswith(".gz") else open(path, mode)


def read_log(path: pathlib.Path):
    """A log as written: a .json file's object, or a .jsonl(.gz) file's rows (a list of dicts)."""
    path = pathlib.Path(path)
    with _open(path, "r") as f:
        text = f.read()
    if path.suffix == ".json":
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def append_log(path: pathlib.Path, rows: list[dict]) -> None:
    """Rows appended to a .jsonl(.gz) log (a gzip file takes another member)."""
    with _open(pathlib.Path(path), "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def write_log(path: pathlib.Path, data: dict) -> None:
    """A .json log, whole: its fields, then its "rows" one a line."""
    head = [f"{json.dumps(k)}: {json.dumps(v, ensure_ascii=False)}" for k, v in data.items() if k != "rows"]
    rows = ",\n".join(json.dumps(r, ensure_ascii=False) for r in data.get("rows", []))
    pathlib.Path(path).write_text("{" + ",\n".join(head + [f'"rows": [\n{rows}\n]']) + "}\n")


def stamp(rows: list[dict]) -> str:
    """'DATE; CPU' (or 'FIRST to LAST'; several CPUs joined) of a log's rows, for a table's command line."""
    dates = sorted({r["date"] for r in rows if r.get("date")}) or ["date not in the log"]
    cpus = sorted({r["cpu"] for r in rows if r.get("cpu")}) or ["CPU not in the log"]
    return f"{dates[0] if len(dates) == 1 else f'{dates[0]} to {dates[-1]}'}; {'; '.join(cpus)}"


def commands(rows: list[dict]) -> str:
    """The distinct commands of a log's rows, each in backticks, in the order first run."""
    seen = list(dict.fromkeys(r["command"] for r in rows if r.get("command")))
    return ", ".join(f"`{c}`" for c in seen) or "(commands not in the log)"


def section(marks: tuple[str, str]) -> str | None:
    """What RESULTS.md holds between the two marker lines now (None: no such section)."""
    doc = (ROOT / "benchmarks/RESULTS.md").read_text()
    if marks[0] not in doc:
        return None
    return doc[doc.index(marks[0]) + len(marks[0]) + 1:doc.index(marks[1]) - 1]


def write_section(marks: tuple[str, str], text: str, heading: str | None = None) -> None:
    """Put `text` between RESULTS.md's two marker lines, replacing what was there. The first time: at the end under
    `## heading`, or without a heading right under the title."""
    path = ROOT / "benchmarks/RESULTS.md"
    doc = path.read_text()
    block = f"{marks[0]}\n{text}\n{marks[1]}"
    if marks[0] in doc:
        doc = doc[:doc.index(marks[0])] + block + doc[doc.index(marks[1]) + len(marks[1]):]
    elif heading:
        doc = doc.rstrip() + f"\n\n## {heading}\n\n{block}\n"
    else:
        title, rest = doc.split("\n", 1)
        doc = f"{title}\n\n{block}\n{rest}"
    path.write_text(doc)
