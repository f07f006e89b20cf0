"""`ctropt split-strings`: strings turned into ids outside the model (the id model and the front)."""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Optional

import numpy as np
import onnx
import typer
from rich.markup import escape

from ..graph import CtroptError, check_output_path, load, save
from ..runtime import generate_inputs
from .common import _beside, _table, _user_errors, app, console

@app.command("split-strings")
def split_strings_cmd(
    model: Path = typer.Argument(..., help="Input .onnx model with string inputs."),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="The id model (default: IN.ids.onnx)."),
    front_out: Optional[Path] = typer.Option(None, "--front", help="Where to write the front, the model's own "
                                             "string ops (default: OUT with .front.onnx)."),
    batch: int = typer.Option(256, "--batch", min=1, help="Rows of the sample id inputs written beside the id model "
                              "(OUT with .inputs.npz: the front's ids of generated strings, for optimize --inputs)."),
):
    """Strings → ids outside the model: the id model (any runtime, OpenVINO included, loads it) and the front (the
    model's own string ops, run with onnxruntime-extensions where the strings arrive), verified together against
    the model (Python: ctropt.string_front.StringFront.load(path).ids(feeds))."""
    from ..string_front import split_strings, verify_split

    with _user_errors():
        out = check_output_path(output or _beside(model, ".ids.onnx"), model)
        front_path = check_output_path(front_out or _beside(out, ".front.onnx"), model, out, flag="--front")
        m = load(model)
        ids, front = split_strings(m)
        err = verify_split(m, ids, front)
        if err > 1e-5:
            raise CtroptError(f"the id model fed by the front does not give the model's outputs (max err {err:.2e})")
        sample = check_output_path(_beside(out, ".inputs.npz"), model, out)
        save(ids, out, protect=(model,))
        front.save(front_path)
        np.savez(sample, **front.ids(generate_inputs(m, batch=batch, seed=256)))
        table = _table("id model input", "dtype", "dims",
                       title=f"{model.name} → {out.name} + {front_path.name} (verified together, max err {err:.1e})")
        for i in ids.graph.input:
            dims = [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim]
            table.add_row(escape(i.name), onnx.TensorProto.DataType.Name(i.type.tensor_type.elem_type).lower(), escape(str(dims)))
        console.print(table)
        front_ops = collections.Counter(n.op_type for n in front.model.graph.node)
        console.print(f"front: {sum(front_ops.values())} ops ({', '.join(f'{k} ×{v}' for k, v in front_ops.most_common(4))}"
                      f"{', …' if len(front_ops) > 4 else ''}); passes through {len(front.passthrough)} numeric "
                      f"inputs; sample id inputs {sample.name} (`ctropt optimize {out.name} --inputs {sample.name}`)")
        try:
            console.print(f"OpenVINO CPU: the id model loads and matches (max err "
                          f"{verify_split(m, ids, front, 'openvino-cpu'):.1e})")
        except CtroptError as e:
            console.print(f"[yellow]OpenVINO CPU cannot run the id model:[/] {escape(str(e))}")
