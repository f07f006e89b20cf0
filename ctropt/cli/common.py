"""Shared by the commands: the typer app, the consoles, the options several commands take, errors as messages,
tables, and small helpers."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console, ConsoleDimensions
from rich.markup import escape
from rich.table import Table

from ..graph import CtroptError, interface
from ..passes import load_plugin
from ..runtime import DEFAULT_ATOL, DEFAULT_BATCH, DEFAULT_RTOL, generate_inputs, load_inputs

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Make CTR/recommendation ONNX models fast: fuse, verify, lower.")
PIPE_COLUMNS = 120  # the width off a terminal (pipes, CI logs) where COLUMNS is not set; rich's own, 80, cuts tables


class _Console(Console):
    """rich's Console, PIPE_COLUMNS wide off a terminal unless COLUMNS says otherwise."""

    @Console.size.getter
    def size(self) -> ConsoleDimensions:
        size = Console.size.fget(self)
        columns = os.environ.get("COLUMNS", "")
        if columns.isdigit():   # read now: rich keeps the COLUMNS it saw when the console was made
            return ConsoleDimensions(int(columns), size.height)
        return size if self.is_terminal else ConsoleDimensions(PIPE_COLUMNS, size.height)


console = _Console(highlight=False)
err_console = _Console(stderr=True, highlight=False)

PLUGIN = typer.Option(None, "--plugin", help="Python module or .py file with your own passes (repeatable).")
INPUTS = typer.Option(None, "--inputs", help="npz of inputs (keys = graph input names); default: generated. "
                      "optimize also times its passes on them.")
BATCH = typer.Option(DEFAULT_BATCH, "--batch", min=1, help="Batch size of generated inputs.")
ATOL = typer.Option(DEFAULT_ATOL, "--atol", min=0.0, help="Absolute tolerance of the output comparison.")
RTOL = typer.Option(DEFAULT_RTOL, "--rtol", min=0.0, help="Relative tolerance of the output comparison.")
TARGET = typer.Option("ort", "--target", help="Runtime to optimize for: ort or openvino.")
OPTION = typer.Option(None, "--option", help="KEY=VALUE pass option (repeatable), e.g. rnn_ort_form=gru-op; "
                      "`ctropt passes --options` lists the keys.")


def _print_version(value: bool) -> None:
    if value:
        from .. import __version__

        print(f"ctropt {__version__}")
        raise typer.Exit()


@app.callback()
def _app(version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                      help="Print ctropt's version and exit.")):
    """Make CTR/recommendation ONNX models fast: fuse, verify, lower."""


@contextlib.contextmanager
def _user_errors():
    """Turn every failure into a one-line message and an exit code."""
    try:
        yield
    except CtroptError as e:
        err_console.print(f"[bold red]error:[/] {escape(str(e))}", soft_wrap=True)
        raise typer.Exit(2)
    except (typer.Exit, typer.Abort, KeyboardInterrupt):
        raise
    except Exception as e:  # an internal bug: say so plainly; CTROPT_DEBUG=1 shows the traceback
        if os.environ.get("CTROPT_DEBUG"):
            raise
        err_console.print(f"[bold red]internal error:[/] {type(e).__name__}: {escape(str(e))}\n"
                          "Rerun with CTROPT_DEBUG=1 for a traceback, and please report it.", soft_wrap=True)
        raise typer.Exit(3)


def _table(*columns: str, numbers: tuple[str, ...] = (), **kw) -> Table:
    """A table whose `numbers` columns are never wrapped or cut and whose other columns fold what is too long
    (never "…"): every value whole at any width, 80-column CI logs included."""
    table = Table(**kw)
    for col in columns:
        if col in numbers:
            table.add_column(col, justify="right", no_wrap=True)
        else:
            table.add_column(col, overflow="fold")
    return table


def _plugins(plugins: Optional[List[str]]) -> None:
    for module in plugins or []:
        load_plugin(module)


def _feeds(inputs: Optional[Path], model, batch: int):
    return load_inputs(inputs, model) if inputs else generate_inputs(model, batch=batch)


def _beside(path: Path, suffix: str) -> Path:
    """The file that goes with `path`: its name without .onnx, then `suffix` (dien.onnx, ".opt.onnx" → dien.opt.onnx)."""
    return path.with_name(path.name.removesuffix(".onnx") + suffix)


def _input_names(model) -> list[str]:
    return [name for kind, name, *_ in interface(model) if kind == "input"]


def _fmt_err(value) -> str:
    return "-" if value is None else f"{value:.1e}"


def _buckets(batch: str, output: Path) -> list[int]:
    """--batch of the serving commands (positive integers), and -o must be a directory."""
    if output.exists() and not output.is_dir():
        raise CtroptError(f"output {output} is a file; -o wants a directory")
    return _batch_sizes(batch)


def _batch_sizes(batch: str) -> list[int]:
    """A --batch list: comma-separated positive integers, or a clear error."""
    try:
        sizes = [int(b) for b in batch.split(",") if b.strip()]
    except ValueError:
        raise CtroptError(f"--batch wants comma-separated integers, got {batch!r}") from None
    if not sizes or min(sizes) < 1:
        raise CtroptError("--batch wants positive batch sizes, e.g. 1,32,128,512")
    return sizes


def _check_table(checks, title: str) -> bool:
    ids = any(c.ids for c in checks)  # ids computed from strings, compared exactly
    table = _table("batch", "seq len", "max abs err", *(("ids from strings",) if ids else ()), "ok",
                   numbers=("batch", "seq len", "max abs err"), title=title)
    for c in checks:
        table.add_row(str(c.batch), str(c.seq_len or "-"), f"{c.max_abs_err:.2e}",
                      *([f"{c.ids} equal" if "ids differ" not in c.detail else "[red]differ[/]"] if ids else []),
                      "[green]yes[/]" if c.ok else f"[red]NO[/] {escape(c.detail)}")
    console.print(table)
    ok = all(c.ok for c in checks)
    if not ok:
        err_console.print("[bold red]EXPORT MISMATCH:[/] the ONNX model does not compute what the framework does; "
                          "do not optimize or deploy it before finding out why", soft_wrap=True)
    return ok
