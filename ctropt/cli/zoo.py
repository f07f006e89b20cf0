"""`ctropt zoo`: the reference CTR models (list, build)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape

from ..graph import check_output_path, load, node_count
from .common import _check_table, _table, _user_errors, app, console

zoo_app = typer.Typer(no_args_is_help=True, help="Reference CTR models (TensorFlow and PyTorch).")
app.add_typer(zoo_app, name="zoo")


@zoo_app.command("list")
def zoo_list():
    """The reference models, their frameworks and the structures their exports carry."""
    from ..exporters import zoo

    table = _table("name", "frameworks", "model", "structures in the export")
    for e in zoo.ENTRIES.values():
        table.add_row(e.name, ",".join(e.frameworks), escape(e.description), escape(e.structures))
    console.print(table)


@zoo_app.command("build")
def zoo_build(
    name: str = typer.Argument(..., help="Zoo model name (see `ctropt zoo list`)."),
    output: Path = typer.Option(..., "-o", "--output", help="Output .onnx path."),
    framework: str = typer.Option("tf", "--framework", help="tf or torch."),
    exporter: str = typer.Option("legacy", "--exporter", help="torch.onnx exporter: legacy or dynamo."),
    rebuild: Optional[bool] = typer.Option(None, "--rebuild/--shipped",
                                           help="Build in the framework, or copy the shipped export "
                                                "(default: build when the framework is installed)."),
):
    """Write a zoo model's ONNX export (built and checked in its framework, or the shipped copy)."""
    from ..exporters import zoo

    with _user_errors():
        out = check_output_path(output)
        kw = {"exporter": exporter} if framework == "torch" else {}
        path, checks = zoo.write(name, out, framework, rebuild=rebuild, **kw)
        if checks is None:
            console.print(f"{name} ({framework}): copied the shipped export to {path} "
                          f"(sample inputs: {zoo.shipped_path(name, framework).with_suffix('.npz')})")
            return
        console.print(f"{name} ({framework}): built and exported to {path} ({node_count(load(path))} nodes)")
        if not _check_table(checks, f"{name}: onnxruntime vs {framework}"):
            raise typer.Exit(1)
