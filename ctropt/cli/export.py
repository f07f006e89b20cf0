"""`ctropt export`: a TensorFlow or PyTorch model to ONNX, checked against the framework."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from ..graph import CtroptError, check_output_path, node_count, save
from ..runtime import generate_inputs
from .common import _batch_sizes, _check_table, _user_errors, app, console

def _load_factory(source: str):
    """`package.module:function` → what the function returns (a zoo spec: TFModel or TorchModel)."""
    import importlib

    module, _, attr = source.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)()
    except Exception as e:  # user code can fail in any way
        raise CtroptError(f"cannot build {source}: {type(e).__name__}: {e}") from None


@app.command("export")
def export_cmd(
    source: str = typer.Argument(..., help="SavedModel dir, .keras/.h5, frozen .pb, TF1 .meta checkpoint, or "
                                 "module:function returning a ctropt TFModel/TorchModel."),
    output: Path = typer.Option(..., "-o", "--output", help="Output .onnx path."),
    input_names: Optional[List[str]] = typer.Option(None, "--input", help="Input tensor (.pb/.meta; repeatable)."),
    output_names: Optional[List[str]] = typer.Option(None, "--output-name", help="Output tensor (.pb/.meta)."),
    sequence_input: Optional[List[str]] = typer.Option(None, "--sequence-input",
                                                       help="Input whose axis 1 is a dynamic sequence length."),
    exporter: str = typer.Option("legacy", "--exporter", help="torch.onnx exporter: legacy or dynamo."),
    opset: Optional[int] = typer.Option(None, "--opset", min=1, help="ONNX opset (default 17; 18 for torch dynamo)."),
    batch: str = typer.Option("1,7,256", "--batch", help="Batch sizes of the numeric check."),
):
    """Export a TensorFlow or PyTorch model to ONNX and check it against the framework."""
    from ..exporters import DEFAULT_OPSET, check_export
    from ..exporters.zoo import export_spec

    with _user_errors():
        out = check_output_path(output)
        batches = tuple(_batch_sizes(batch))
        seq = tuple(sequence_input or ()) or None
        if ":" in source and not Path(source).exists():
            spec = _load_factory(source)
            result = export_spec(spec, exporter=exporter, opset=opset, sequence_inputs=seq, seq_len=10)
            sample = lambda b, t, rng: spec.sample(b, t or 10, rng)  # noqa: E731
        else:
            from ..exporters.tf import export_path

            result = export_path(source, input_names, output_names, opset=opset or DEFAULT_OPSET,
                                 sequence_inputs=seq or ())
            sample = lambda b, t, rng: generate_inputs(result.model, batch=b, seed=int(rng.integers(1 << 30)))  # noqa: E731
        save(result.model, out)
        console.print(f"exported {source} with {result.exporter} → {out} ({node_count(result.model)} nodes)")
        if not _check_table(check_export(result, sample, batches=batches), f"{result.exporter} vs framework"):
            raise typer.Exit(1)
