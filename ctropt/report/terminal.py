"""The diff in the terminal: rich tables and a tree of changed regions, summarised so a 5,000-node graph reads.

Regions with the same change (`MatMul, Add, Relu → Gemm`) in the same scope collapse into one line with a
count and an example node; a tree never lists more than a screenful.
"""

from __future__ import annotations

import collections

from rich.markup import escape
from rich.table import Table
from rich.tree import Tree

from .diff import ModelDiff

MAX_KINDS = 8  # kinds of change listed per scope
MAX_SCOPES = 6  # scopes listed per diff
MAX_MISS = 160  # characters of one near-miss line
SUMMARY_OPS = 5  # op types named per side of a change


def _delta_line(diff: ModelDiff, limit: int = 6) -> str:
    rows = diff.op_delta()
    parts = [f"{op} {a - b:+d}" for op, b, a in rows[:limit]]
    if len(rows) > limit:
        parts.append(f"… {len(rows) - limit} more ops")
    return ", ".join(parts)


def _short_scope(scope: str) -> str:
    return scope if len(scope) <= 70 else "…" + scope[-69:]


def add_regions(tree: Tree, diff: ModelDiff) -> None:
    """One branch per scope, one line per kind of change (count, summary, an example node)."""
    by_scope: dict[str, list] = collections.defaultdict(list)
    for r in diff.regions:
        by_scope[r.scope].append(r)
    for k, (scope, regions) in enumerate(by_scope.items()):
        if k == MAX_SCOPES:
            rest = sum(len(v) for v in list(by_scope.values())[MAX_SCOPES:])
            tree.add(f"[dim]… {len(by_scope) - MAX_SCOPES} more scopes ({rest} regions)[/]")
            break
        branch = tree.add(f"[bold]{escape(_short_scope(scope))}[/] [dim]({len(regions)} region"
                          f"{'' if len(regions) == 1 else 's'})[/]")
        kinds = collections.Counter(r.describe(SUMMARY_OPS) for r in regions)
        example = {}
        for r in regions:
            example.setdefault(r.describe(SUMMARY_OPS), (r.removed + r.changed + r.added)[0][1])
        for j, (summary, n) in enumerate(kinds.most_common()):
            if j == MAX_KINDS:
                branch.add(f"[dim]… {len(kinds) - MAX_KINDS} more kinds of change[/]")
                break
            branch.add(f"{'×' + str(n) + '  ' if n > 1 else ''}{escape(summary)}  [dim]e.g. '{escape(example[summary])}'[/]")
    extra = [f"{len(v)} initializers {k}" for k, v in (("added", diff.initializers_added),
                                                       ("removed", diff.initializers_removed),
                                                       ("changed", diff.initializers_changed)) if v]
    if diff.value_types:
        extra.append(f"dtype/shape recorded for {diff.value_types} values")
    if extra:
        tree.add(f"[dim]{', '.join(extra)}[/]")


def print_pass_diffs(console, records) -> None:
    """`ctropt optimize --show-diff`: a tree per pass that changed the model, then why the others did not."""
    for r in records:
        if r.diff is None or r.diff.empty:
            continue
        style = "red" if r.status in ("rolled back", "failed") else "green"
        head = (f"[bold {style}]{escape(r.name)}[/] [dim]{r.status}[/]  {r.nodes_before} → "
                f"{r.nodes_after} nodes" + (f"  ({escape(_delta_line(r.diff))})" if r.diff.op_delta() else ""))
        if r.status == "rolled back":
            head += f"\n[red]{escape(r.message)}[/]"
        tree = Tree(head)
        add_regions(tree, r.diff)
        console.print(tree)
    missed = [r for r in records if r.misses]
    if missed:
        tree = Tree("[bold]did not fire[/] [dim](closest attempts)[/]")
        for r in missed:
            branch = tree.add(escape(r.name))
            for m in r.misses:
                branch.add("[dim]" + escape(m if len(m) <= MAX_MISS else m[:MAX_MISS - 1] + "…") + "[/]")
        console.print(tree)


def print_model_diff(console, diff: ModelDiff, name_a: str, name_b: str) -> None:
    """`ctropt diff A B`: node counts, the op histogram delta and the tree of changed regions."""
    total_a, total_b = sum(diff.ops_before.values()), sum(diff.ops_after.values())
    console.print(f"[bold]{escape(name_a)}[/] → [bold]{escape(name_b)}[/]: {total_a} → {total_b} nodes; "
                  f"{len(diff.removed)} removed, {len(diff.added)} added, {len(diff.changed)} rewired, "
                  f"{len(diff.regions)} changed regions")
    rows = diff.op_delta()
    if rows:
        table = Table(title="op counts that changed")
        for col in ("op", name_a, name_b, "Δ"):
            table.add_column(escape(col), justify="left" if col == "op" else "right")
        for op, b, a in rows[:25]:
            table.add_row(escape(op), str(b), str(a), f"[{'green' if a > b else 'red'}]{a - b:+d}[/]")
        if len(rows) > 25:
            table.add_row(f"[dim]… {len(rows) - 25} more[/]", "", "", "")
        console.print(table)
    tree = Tree("[bold]changed regions[/]")
    add_regions(tree, diff)
    console.print(tree)
