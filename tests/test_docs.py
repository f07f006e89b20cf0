"""The documentation: the generated pages are current, the README stays short, every relative link resolves."""

import re
from pathlib import Path

import pytest

from ctropt import docs

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
README_MAX_BYTES = 15_000
LINE_MAX = 300


@pytest.mark.parametrize("name", sorted(docs.PAGES))
def test_generated_page_is_current(name):
    committed = (ROOT / "docs" / name).read_text(encoding="utf-8")
    assert committed == docs.PAGES[name](), f"docs/{name} is stale: run {docs.COMMAND}"


def test_generated_pages_are_plain_markdown():
    for name, render in docs.PAGES.items():
        text = render()
        assert "\x1b[" not in text, f"ANSI codes in docs/{name}"
        assert not re.search(r"\[/?(bold|red|yellow|green|dim|cyan)[^\]]*\]", text), f"rich markup in docs/{name}"


def test_every_command_and_pass_is_documented():
    cli, passes = docs.cli_markdown(), docs.passes_markdown()
    for name in ("optimize", "verify", "bench", "repository", "zoo build", "kernels path"):
        assert f"## `ctropt {name}`" in cli
    details = (ROOT / "docs" / "pass-details.md").read_text(encoding="utf-8")
    for p in docs.builtin_passes():
        assert f"## `{p.name}`" in passes
        assert f"### `{p.name}`" in details, f"docs/pass-details.md has no section for {p.name}"


def test_readme_is_short():
    text = README.read_text(encoding="utf-8")
    assert len(text.encode()) <= README_MAX_BYTES, f"README.md is {len(text.encode())} bytes: move prose to docs/"
    long = [i + 1 for i, line in enumerate(text.splitlines()) if len(line) > LINE_MAX]
    assert not long, f"README.md lines over {LINE_MAX} characters: {long}"


def test_readme_keeps_what_tests_and_users_read():
    text = README.read_text(encoding="utf-8")
    for tag in ("python", "c", "triton", "openvino"):
        assert f"<!-- serving: {tag} -->" in text
    assert "## Bad requests: the policy" in text and "## Serving the result" in text


PAGES = ["README.md", "benchmarks/RESULTS.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("page", PAGES)
def test_relative_links_resolve(page):
    path = ROOT / page
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        assert dest.exists(), f"{page}: link to {target}: no such file"
        if anchor and dest.suffix == ".md":
            assert anchor in _anchors(dest), f"{page}: link to {target}: no such heading"


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped (backticks too), spaces as dashes."""
    heads = re.findall(r"^#+ (.*)$", re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}
