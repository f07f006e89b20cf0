"""`ctropt diff`: what changed between two models."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ..graph import check_output_path, interface, load, node_count
from ..report import write_report
from .common import _user_errors, app, console

@app.command()
def diff(
    model_a: Path = typer.Argument(..., metavar="BEFORE", help="Model before."),
    model_b: Path = typer.Argument(..., metavar="AFTER", help="Model after."),
    report: Optional[Path] = typer.Option(None, "--report", help="Also write the diff as a self-contained HTML page."),
):
    """Show what changed between two models: op counts, and a tree of changed regions (all subgraphs too)."""
    from ..report import diff_models
    from ..report.terminal import print_model_diff

    with _user_errors():
        if report is not None:
            check_output_path(report, model_a, model_b, flag="--report")
        a, b = load(model_a), load(model_b)
        d = diff_models(a, b)
        if interface(a) != interface(b):
            console.print("[yellow]the two models' inputs/outputs differ[/]")
        print_model_diff(console, d, model_a.name, model_b.name)
        if report is not None:
            from ..passes import PassRecord

            record = PassRecord(f"{model_a.name} → {model_b.name}", "applied" if not d.empty else "unchanged",
                                nodes_before=node_count(a), nodes_after=node_count(b), diff=d)
            write_report(report, [record], title=f"ctropt diff: {model_a.name} → {model_b.name}",
                         subtitle=f"{model_a} → {model_b}")
            console.print(f"report {report}")
