"""`ctropt repository`: a Triton model repository and an OpenVINO Model Server config."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer
from rich.markup import escape

from ..graph import load
from .common import OPTION, _buckets, _user_errors, app, console
from .options import _pass_options

@app.command("repository")
def repository_cmd(
    model: Path = typer.Argument(..., help="Input .onnx model."),
    output: Path = typer.Option(..., "-o", "--output", help="Directory: triton/ and ovms/ are written inside."),
    name: Optional[str] = typer.Option(None, "--name", help="Model name on the servers (default: file stem)."),
    batch: str = typer.Option("1,32,128,512", "--batch", help="Buckets: Triton's preferred batch sizes; the "
                              "largest is max_batch_size."),
    static_seq_len: Optional[int] = typer.Option(None, "--static-seq-len", min=1,
                                                 help="History length to fix for OpenVINO (as in optimize)."),
    option: Optional[List[str]] = OPTION,
    library_dir: Optional[str] = typer.Option(None, "--library-dir", help="Where the Triton server sees this "
                                              "model's folder (triton/NAME, which holds ctropt's kernel libraries), "
                                              "e.g. /models/NAME with the repository mounted at /models; "
                                              "op_library_filename names the libraries there. Default: where they "
                                              "are written."),
):
    """A Triton model repository (onnxruntime backend, dynamic batching over the buckets) and an OpenVINO Model
    Server config, each with the model optimized and checked for that server's runtime."""
    from ..deploy import write_repositories

    with _user_errors():
        sizes = _buckets(batch, output)
        m = load(model)
        with console.status("optimizing for onnxruntime (Triton) and OpenVINO (OVMS)"):
            summary = write_repositories(m, output, name or model.name.removesuffix(".onnx"), sizes, source=str(model),
                                         static_seq_len=static_seq_len, options=_pass_options(option or []),
                                         library_dir=library_dir)
        console.print(f"Triton: {summary['triton']}" + ("" if summary["batched"] else " (no dynamic batching)"))
        if summary["libraries"]:
            console.print(f"  the server loads {', '.join(summary['libraries'])}" + (
                "" if library_dir else " (absolute paths of this machine: give --library-dir where the server "
                "will see triton/NAME if the repository moves)"), soft_wrap=True)
        console.print(f"OpenVINO Model Server: {summary['ovms']}" + (
            f" (the id model: clients turn strings into ids with {summary['ovms_front']})"
            if "ovms_front" in summary else ""))
        if not summary["batched"]:
            console.print(f"[yellow]requests are not batched together:[/] {escape(summary['why_not'])}")
        for item in summary.get("rolled_back", []):
            console.print(f"[yellow]rolled back[/] {escape(item)}")
