"""`ctropt verify`: two models on the same inputs, every output compared."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape

from ..graph import CtroptError, load
from ..runtime import BACKENDS, Runner, compare_outputs
from .common import ATOL, BATCH, INPUTS, RTOL, _feeds, _input_names, _table, _user_errors, app, console

@app.command()
def verify(
    model_a: Path = typer.Argument(..., metavar="RAW", help="The reference: the model as exported."),
    model_b: Path = typer.Argument(..., metavar="OPTIMIZED", help="The model to check against it: what optimize "
                                   "(or pack-inputs, split-strings) made of RAW."),
    inputs: Optional[Path] = INPUTS,
    batch: int = BATCH,
    atol: float = ATOL,
    rtol: float = RTOL,
    backend: str = typer.Option("ort-cpu", "--backend", help=f"One of {', '.join(BACKENDS)}."),
    packing: Optional[Path] = typer.Option(None, "--packing", help="B was made by pack-inputs: feed it A's inputs "
                                           "packed by this adapter (.pack.json)."),
    strings_front: Optional[Path] = typer.Option(None, "--strings", help="B is the id model of split-strings: feed it "
                                           "what this front (.front.onnx) makes of A's inputs; A runs on ort-cpu."),
):
    """Run two models, RAW then OPTIMIZED, on the same inputs; exit 0 iff every output matches."""
    from ..packing import Packing
    from ..string_front import StringFront

    with _user_errors():
        if packing and strings_front:
            raise CtroptError("--packing and --strings adapt B's feeds two ways: give one")
        a, b = load(model_a), load(model_b)
        adapter = Packing.load(packing) if packing else None
        front = StringFront.load(strings_front) if strings_front else None
        feeds = _feeds(inputs, a, batch)
        feeds_b = adapter.pack(feeds) if adapter else front.ids(feeds) if front else feeds
        if sorted(feeds_b) != sorted(_input_names(b)):
            raise CtroptError(f"the models have different inputs: {_input_names(a)} vs {_input_names(b)}"
                              + ("" if adapter or front else " (a packed model? give --packing)"))
        run_b = Runner(b, backend, name=model_b.name)   # first: the model a backend may refuse is most often B
        run_a = Runner(a, "ort-cpu" if front else backend, name=model_a.name)
        diffs = compare_outputs(run_a.run(feeds), run_b.run(feeds_b), atol=atol, rtol=rtol)
        table = _table("output", "shape", "max abs err", "max rel err", "ok", numbers=("max abs err", "max rel err"),
                       title=f"{model_a.name} vs {model_b.name} ({backend})")
        for d in diffs:
            table.add_row(escape(d.name), escape(str(list(d.shape))), f"{d.max_abs:.2e}", f"{d.max_rel:.2e}",
                          "[green]yes[/]" if d.ok else f"[red]NO[/] {d.reason}")
        console.print(table)
        if not all(d.ok for d in diffs):
            raise typer.Exit(1)
