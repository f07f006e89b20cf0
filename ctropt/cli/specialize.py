"""`ctropt specialize`: one optimized static-shape model per batch bucket."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer
from rich.markup import escape

from ..graph import load
from .common import OPTION, PLUGIN, TARGET, _buckets, _fmt_err, _plugins, _table, _user_errors, app, console
from .options import _pass_options

@app.command("specialize")
def specialize_cmd(
    model: Path = typer.Argument(..., help="Input .onnx model (dynamic batch)."),
    output: Path = typer.Option(..., "-o", "--output", help="Directory for the bucket models and manifest.json."),
    batch: str = typer.Option("1,32,128,512", "--batch", help="Comma list of bucket batch sizes."),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", min=1, help="Also fix the history length (axis 1 of "
                                          "sequence inputs); default: left dynamic."),
    passes: str = typer.Option("all", "--passes", help="'all' or a comma list of pass names."),
    target: str = TARGET,
    option: Optional[List[str]] = OPTION,
    plugin: Optional[List[str]] = PLUGIN,
):
    """One optimized static-shape model per batch bucket, each verified against the dynamic model; serve them
    with ctropt.runtime.BucketedSession."""
    from ..specialize import specialize

    with _user_errors():
        _plugins(plugin)
        sizes = _buckets(batch, output)
        m = load(model)
        with console.status("specializing"):
            manifest = specialize(m, output, sizes, seq_len=seq_len, passes=passes, target=target,
                                  source=str(model), options=_pass_options(option or []))
        table = _table("batch", "file", "nodes: source → optimized dynamic → bucket", "max abs err vs source",
                       numbers=("batch", "max abs err vs source"),
                       title=f"{model.name} → {output}/ (dynamic optimized: {output / manifest['dynamic']})")
        for b in manifest["buckets"]:
            table.add_row(str(b["batch"]), b["file"],
                          f"{manifest['source_nodes']} → {manifest['dynamic_nodes']} → {b['nodes']}",
                          _fmt_err(b["max_abs_err"]))
        console.print(table)
        if manifest["rows_independent"]:
            console.print("rows are independent: requests can be padded to a bucket")
        else:
            console.print(f"[yellow]requests cannot be padded:[/] {escape(manifest['why_not'])}")
