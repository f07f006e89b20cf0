"""The `ctropt` command: optimize, passes, inspect, verify. Errors are messages, never tracebacks."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..graph import CtroptError, check_output_path, interface, load, node_count, save
from ..passes import REGISTRY, PassManager, load_plugin, resolve
from ..runtime import BACKENDS, DEFAULT_ATOL, DEFAULT_RTOL, Runner, compare_outputs, generate_inputs, load_inputs

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Make CTR/recommendation ONNX models fast: fuse, verify, lower.")
console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)

PLUGIN = typer.Option(None, "--plugin", help="Python module or .py file with your own passes (repeatable).")
INPUTS = typer.Option(None, "--inputs", help="npz of inputs (keys = graph input names); default: generated.")
BATCH = typer.Option(16, "--batch", min=1, help="Batch size of generated inputs.")
ATOL = typer.Option(DEFAULT_ATOL, "--atol", help="Absolute tolerance of the output comparison.")
RTOL = typer.Option(DEFAULT_RTOL, "--rtol", help="Relative tolerance of the output comparison.")
TARGET = typer.Option("ort", "--target", help="Runtime to optimize for: ort or openvino.")


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


def _plugins(plugins: Optional[List[str]]) -> None:
    for module in plugins or []:
        load_plugin(module)


def _feeds(inputs: Optional[Path], model, batch: int):
    return load_inputs(inputs, model) if inputs else generate_inputs(model, batch=batch)


def _fmt_err(value) -> str:
    return "-" if value is None else f"{value:.1e}"


@app.command()
def optimize(
    model: Path = typer.Argument(..., help="Input .onnx model."),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="Output path (default: IN.opt.onnx)."),
    passes: str = typer.Option("all", "--passes", help="'all' or a comma list of pass names."),
    skip: str = typer.Option("", "--skip", help="Comma list of passes to leave out."),
    target: str = TARGET,
    inputs: Optional[Path] = INPUTS,
    batch: int = BATCH,
    strict: bool = typer.Option(False, "--strict", help="Fail instead of rolling back a pass that breaks outputs."),
    verify: bool = typer.Option(True, "--verify/--no-verify", help="Check outputs after every pass."),
    atol: float = ATOL,
    rtol: float = RTOL,
    plugin: Optional[List[str]] = PLUGIN,
):
    """Run passes on a model, verifying outputs after each one, and save the result."""
    with _user_errors():
        _plugins(plugin)
        out = check_output_path(output or model.with_name(model.name.removesuffix(".onnx") + ".opt.onnx"), model)
        m = load(model)
        feeds = load_inputs(inputs, m) if inputs else None
        status = console.status("starting")

        def progress(p, record):
            if record is None:
                status.update(f"running [bold]{p.name}[/]")
            else:
                console.print(f"  {p.name:34s} {record.status}"
                              + (f" ({record.rewrites} rewrites)" if record.rewrites else "")
                              + (f": {escape(record.message)}" if record.message else ""))

        manager = PassManager(passes, skip=skip, target=target, feeds=feeds, batch=batch, atol=atol, rtol=rtol,
                              verify=verify, strict=strict, on_pass=progress)
        console.print(f"[bold]{model}[/]: {node_count(m)} nodes, {len(manager.passes)} passes, target {target}")
        with status:
            result = manager.run(m)
        save(result.model, out, protect=(model,))
        table = Table(title=f"{model.name} → {out.name}")
        for col in ("pass", "status", "matches", "rewrites", "nodes", "max err", "time"):
            table.add_column(col, justify="left" if col in ("pass", "status") else "right")
        for r in result.records:
            style = {"rolled back": "red", "failed": "red", "unchanged": "dim"}.get(r.status, "")
            table.add_row(r.name, f"[{style}]{r.status}[/]" if style else r.status, str(r.matches), str(r.rewrites),
                          f"{r.nodes_before}→{r.nodes_after}", _fmt_err(r.max_abs_err), f"{r.seconds:.2f}s")
        console.print(table)
        for r in result.failed:
            console.print(f"[red]{r.name} {r.status}[/]: {escape(r.message)}")
        console.print(f"saved {out} ({node_count(m)} → {node_count(result.model)} nodes"
                      + ("" if verify else ", outputs NOT verified") + ")")


@app.command("passes")
def list_passes(plugin: Optional[List[str]] = PLUGIN):
    """List every registered pass."""
    with _user_errors():
        _plugins(plugin)
        table = Table()
        for col in ("pass", "group", "targets", "in all", "description"):
            table.add_column(col)
        for p in sorted(REGISTRY.values(), key=lambda p: p.sort_key):
            table.add_row(p.name, p.group, ",".join(p.targets), "yes" if p.default else "opt-in", p.description)
        console.print(table)


@app.command()
def inspect(
    model: Path = typer.Argument(..., help="Input .onnx model."),
    target: str = TARGET,
    explain: bool = typer.Option(False, "--explain", help="For passes that would not fire, show the closest miss."),
    top: int = typer.Option(25, "--top", help="Op histogram rows."),
    plugin: Optional[List[str]] = PLUGIN,
):
    """Show ops, interface, embedding tables, recurrent structures and which passes would match."""
    from .. import inspect as insp
    from ..graph import to_graph

    with _user_errors():
        _plugins(plugin)
        m = load(model)
        opsets = ", ".join(f"{o.domain or 'ai.onnx'} {o.version}" for o in m.opset_import)
        console.print(f"[bold]{model}[/]  producer {m.producer_name or '?'} {m.producer_version}  IR {m.ir_version}"
                      f"  opsets: {opsets}  nodes (subgraphs included): {node_count(m)}")
        io = Table(title="interface")
        for col in ("", "name", "dtype", "shape"):
            io.add_column(col)
        import onnx

        for kind, name, elem, dims in interface(m):
            dtype = onnx.TensorProto.DataType.Name(elem) if elem else "?"
            io.add_row(kind, escape(name), dtype, escape("?" if dims is None else str(list(dims))))
        console.print(io)
        counts = insp.op_counts(m)
        ops = Table(title=f"ops ({len(counts)} types)")
        ops.add_column("op")
        ops.add_column("count", justify="right")
        for op, n in counts[:top]:
            ops.add_row(op, str(n))
        if len(counts) > top:
            ops.add_row(f"... {len(counts) - top} more", str(sum(n for _, n in counts[top:])))
        console.print(ops)
        graph = to_graph(m)
        tables = insp.embedding_tables(graph)
        emb = Table(title=f"embedding tables ({len(tables)})")
        for col in ("table", "rows", "width", "lookups", "via"):
            emb.add_column(col)
        for t in tables:
            emb.add_row(escape(t.name), str(t.rows), str(t.width), str(t.lookups), t.ops)
        console.print(emb)
        rec = insp.recurrent_structures(graph)
        rt = Table(title=f"recurrent structures ({len(rec)})")
        for col in ("kind", "where", "detail"):
            rt.add_column(col)
        for r in rec:
            rt.add_row(r.kind, escape(r.where), escape(r.detail))
        console.print(rt)
        previews = insp.preview_passes(m, resolve("all", (), target), target, explain)
        pt = Table(title=f"passes that would match (target {target}, dry run)")
        for col in ("pass", "matches", "rewrites", "notes"):
            pt.add_column(col)
        for p in previews:
            pt.add_row(p.name, str(p.matches), str(p.rewrites), escape("; ".join(p.notes + p.misses)))
        console.print(pt)


@app.command()
def verify(
    model_a: Path = typer.Argument(..., help="Reference model."),
    model_b: Path = typer.Argument(..., help="Model to check against it."),
    inputs: Optional[Path] = INPUTS,
    batch: int = BATCH,
    atol: float = ATOL,
    rtol: float = RTOL,
    backend: str = typer.Option("ort-cpu", "--backend", help=f"One of {', '.join(BACKENDS)}."),
):
    """Run two models on the same inputs; exit 0 iff every output matches."""
    with _user_errors():
        a, b = load(model_a), load(model_b)
        ins_a = [x for x in interface(a) if x[0] == "input"]
        ins_b = [x for x in interface(b) if x[0] == "input"]
        if [x[1] for x in ins_a] != [x[1] for x in ins_b]:
            raise CtroptError(f"the models have different inputs: {[x[1] for x in ins_a]} vs {[x[1] for x in ins_b]}")
        feeds = _feeds(inputs, a, batch)
        diffs = compare_outputs(Runner(a, backend).run(feeds), Runner(b, backend).run(feeds), atol=atol, rtol=rtol)
        table = Table(title=f"{model_a.name} vs {model_b.name} ({backend})")
        for col in ("output", "shape", "max abs err", "max rel err", "ok"):
            table.add_column(col)
        for d in diffs:
            table.add_row(escape(d.name), escape(str(list(d.shape))), f"{d.max_abs:.2e}", f"{d.max_rel:.2e}",
                          "[green]yes[/]" if d.ok else f"[red]NO[/] {d.reason}")
        console.print(table)
        if not all(d.ok for d in diffs):
            raise typer.Exit(1)


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        err_console.print("interrupted")
        sys.exit(130)
