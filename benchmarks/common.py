"""What the benchmark scripts share: the repository on sys.path (so they run from a checkout) and the model files."""

import os
import pathlib
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
