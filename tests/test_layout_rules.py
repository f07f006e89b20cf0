"""The code's layout (docs/architecture.md): modules stay small, passes live in family packages, and every module
that registers a pass is imported by ctropt.passes."""

import re
from pathlib import Path

import ctropt
from ctropt import passes

PACKAGE = Path(ctropt.__file__).resolve().parent
MAX_LINES = 700
TOP_LEVEL = {"__init__.py", "manager.py", "registry.py", "speed.py"}  # the rest of passes/ is in family packages


def test_no_module_over_700_lines():
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them along a seam, one concern per module): {long}"


def test_passes_are_in_family_packages():
    root = PACKAGE / "passes"
    loose = sorted(p.name for p in root.glob("*.py") if p.name not in TOP_LEVEL)
    assert not loose, f"passes/ keeps only {sorted(TOP_LEVEL)} at the top; put {loose} in a family package"
    families = sorted(p.name for p in root.iterdir() if (p / "__init__.py").is_file())
    assert families == sorted(passes.FAMILIES), "a family package ctropt.passes.FAMILIES does not import"


def test_every_module_that_registers_a_pass_is_imported():
    registering = {".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts)
                   for p in (PACKAGE / "passes").rglob("*.py")
                   if re.search(r"^@register_pass\(", p.read_text(encoding="utf-8"), re.M)}
    registered = {p.fn.__module__ for p in ctropt.REGISTRY.values() if p.fn.__module__.startswith("ctropt.")}
    assert registering - registered == set(), "add these modules to ctropt.passes.FAMILIES (or their package)"
