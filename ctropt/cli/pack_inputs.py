"""`ctropt pack-inputs`: per-feature inputs packed into one input per dtype, with the feed adapter."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape

from ..graph import CtroptError, check_output_path, load, save
from .common import _beside, _input_names, _table, _user_errors, app, console

@app.command("pack-inputs")
def pack_inputs_cmd(
    model: Path = typer.Argument(..., help="Input .onnx model."),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="Output path (default: IN.packed.onnx)."),
    packing_out: Optional[Path] = typer.Option(None, "--packing", help="Where to write the feed adapter "
                                               "(default: OUT with .pack.json)."),
):
    """Per-feature [B, 1] / [B] inputs → one [B, F] input per dtype (split inside the graph), verified through
    the adapter that packs old feeds (Python: ctropt.packing.Packing.load(path).pack(feeds))."""
    from ..packing import pack_inputs, verify_packing

    with _user_errors():
        out = check_output_path(output or _beside(model, ".packed.onnx"), model)
        adapter = check_output_path(packing_out or _beside(out, ".pack.json"), model, out, flag="--packing")
        m = load(model)
        packed, packing = pack_inputs(m)
        if not packing.groups:
            raise CtroptError("nothing to pack: no two per-feature inputs ([B, 1] or [B]) share a dtype")
        err = verify_packing(m, packed, packing)
        save(packed, out, protect=(model,))
        packing.save(adapter)
        table = _table("packed input", "features", "holds", numbers=("features",),
                       title=f"{model.name} → {out.name} (outputs verified through the adapter, max err {err:.1e})")
        for name, features in packing.groups.items():
            shown = ", ".join(features[:6]) + (f", … {len(features) - 6} more" if len(features) > 6 else "")
            table.add_row(name, str(len(features)), escape(shown))
        console.print(table)
        before = len(_input_names(m))
        console.print(f"{before} → {len(_input_names(packed))} inputs; adapter {adapter}")
