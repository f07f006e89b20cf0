"""benchmarks/RESULTS.md holds the current tables only, each the rendering of a log committed beside its script:
short enough to read, and a hand edit of a table (or a log changed without rendering it) fails here."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
MAX_LINES = 400

_spec = importlib.util.spec_from_file_location("ctropt_bench_results", ROOT / "benchmarks" / "results.py")
results = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = results
_spec.loader.exec_module(results)


def test_results_is_short():
    lines = RESULTS.read_text(encoding="utf-8").count("\n")
    assert lines <= MAX_LINES, (f"benchmarks/RESULTS.md is {lines} lines (at most {MAX_LINES}): leave superseded "
                                "tables to the history")


@pytest.mark.parametrize("name,log", results.SECTIONS, ids=[name for name, _ in results.SECTIONS])
def test_section_is_what_its_log_renders(name, log):
    assert (ROOT / "benchmarks" / log).exists(), f"benchmarks/{log} is not committed"
    module = results.script(name)
    text = RESULTS.read_text(encoding="utf-8")
    assert text.count(module.MARKS[0]) == 1 and text.count(module.MARKS[1]) == 1, f"{name}: its marker lines"
    committed = text[text.index(module.MARKS[0]) + len(module.MARKS[0]) + 1:text.index(module.MARKS[1]) - 1]
    assert committed == module.render(ROOT / "benchmarks" / log), (
        f"RESULTS.md's {name} section is not what benchmarks/{log} renders: run python benchmarks/results.py")


def test_every_table_is_a_rendered_section():
    """Outside the marker lines, prose only: no table rows that no script renders."""
    text = RESULTS.read_text(encoding="utf-8")
    for name, _ in results.SECTIONS:
        begin, end = results.script(name).MARKS
        text = text[:text.index(begin)] + text[text.index(end) + len(end):]
    stray = [line for line in text.splitlines() if line.startswith("|")]
    assert not stray, f"tables outside the rendered sections: {stray[:3]}"
    assert "<!--" not in text, "marker lines that no script in benchmarks/results.py renders"


def test_each_row_says_when_and_where():
    for name, log in results.SECTIONS:
        first = results.script(name).render(ROOT / "benchmarks" / log).splitlines()[0]
        assert first.startswith("Command: `python benchmarks/"), f"{name}: {first[:80]}"
        assert "20" in first and ("cores" in first or "CPU" in first), f"{name}: no date or CPU: {first[:200]}"
