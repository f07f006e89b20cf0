"""RESULTS.md from the committed logs: every table between marker lines there is rendered by its script's `render`
from the log that script keeps beside it, so a table is regenerated, never edited by hand.

    python benchmarks/results.py            # rewrite every section from the logs
    python benchmarks/results.py --check    # exit 1, naming the sections, where RESULTS.md differs from its logs

A script that measures writes its log and its own section (`--write`); this one re-renders them all, and
tests/test_results.py checks that RESULTS.md is what the logs render.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.append(str(HERE))   # appended: benchmarks/requests.py must not shadow the `requests` package

from common import section, write_section  # noqa: E402

# (script, log) in RESULTS.md's order; each script has MARKS and render(log) -> the text between them
SECTIONS = [("production", "production-run.jsonl"), ("scale", "scale-run.json"),
            ("requests", "requests-run.jsonl.gz"), ("corpus", "corpus-run.jsonl"), ("one_user", "one-user-run.json"),
            ("strings", "strings-run.json"), ("gpu", "gpu-run.json"), ("portable_kernels", "portable-kernels-run.json"),
            ("frameworks", "frameworks-run.json")]


def script(name: str):
    """A benchmark script as a module, under a name of its own (requests.py is not the `requests` package)."""
    key = f"ctropt_bench_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, HERE / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module   # dataclasses look their module up by name
        spec.loader.exec_module(module)
    return sys.modules[key]


def rendered() -> list[tuple[str, tuple[str, str], str]]:
    """(script, its marker lines, the section its log renders) for every section."""
    out = []
    for name, log in SECTIONS:
        module = script(name)
        out.append((name, module.MARKS, module.render(HERE / log)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare only; exit 1 where a section differs")
    args = ap.parse_args()
    stale = []
    for name, marks, text in rendered():
        if section(marks) != text:
            stale.append(name)
            if not args.check:
                write_section(marks, text)
    if args.check and stale:
        sys.exit(f"RESULTS.md differs from what the logs render: {', '.join(stale)} (python benchmarks/results.py)")
    print(("rewritten: " if stale else "up to date") + ", ".join(stale))


if __name__ == "__main__":
    main()
