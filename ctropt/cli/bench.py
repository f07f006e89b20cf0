"""`ctropt bench`: latency and throughput, and paired time ratios of two models or two backends."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich import box
from rich.table import Table

from ..graph import CtroptError, load
from ..runtime import BACKENDS, Runner, generate_inputs, load_inputs
from ..runtime.inputs import DEFAULT_SEQ_LEN, stored_input_facts
from .common import INPUTS, _batch_sizes, _input_names, _user_errors, app, console

@app.command()
def bench(
    model_a: Path = typer.Argument(..., metavar="A", help="Model to time (the baseline when two are given)."),
    model_b: Optional[Path] = typer.Argument(None, metavar="B", help="Second model: run interleaved with the first."),
    backend: str = typer.Option("ort-cpu", "--backend", help=f"One of {', '.join(BACKENDS)}."),
    batch: str = typer.Option("1,32,256", "--batch", help="Comma list of batch sizes (generated inputs)."),
    threads: int = typer.Option(1, "--threads", min=0, help="Intra-op threads: 1, as optimize's speed check "
                                "times; 0: the runtime's default (onnxruntime: one per physical core)."),
    inputs: Optional[Path] = INPUTS,
    seconds: float = typer.Option(3.0, "--seconds", min=0.1, help="Time per batch size (at least 10 runs)."),
    precision: Optional[str] = typer.Option(None, "--precision", help="OpenVINO precision hint: f32, f16, bf16."),
    seq_len: int = typer.Option(DEFAULT_SEQ_LEN, "--seq-len", min=1,
                                help="History length of generated inputs where the model leaves it dynamic."),
    fill: Optional[float] = typer.Option(None, "--fill", min=0.0, max=1.0,
                                         help="Mean history fill of generated inputs (0..1; default: lengths "
                                              "uniform in 0..T)."),
    one_user: bool = typer.Option(False, "--one-user",
                                  help="Generated rows share row 0's history and user inputs (one request; user "
                                       "inputs: those `optimize --user-inputs` stored, or named like a user id)."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the results as JSON."),
    sweep: Optional[str] = typer.Option(None, "--sweep", help="A second backend: time model A on --backend and "
                                        "on this one at every --batch, paired, and print the batch from which it "
                                        "wins (BucketedSession's gpu_threshold)."),
):
    """Latency p50/p90/p99 and throughput; with two models (or --sweep), the median of paired time ratios (A/B)."""
    import dataclasses
    import json

    from rich.progress import Progress

    from ..runtime.bench import bench as run_bench

    with _user_errors():
        a = load(model_a)
        runners = [Runner(a, backend, threads, precision, name=model_a.name)]
        if model_b is not None and sweep:
            raise CtroptError("--sweep compares one model on two backends; give one model")
        if model_b is not None:
            b = load(model_b)
            if _input_names(a) != _input_names(b):
                raise CtroptError("the two models have different inputs; bench compares models of one interface")
            runners.append(Runner(b, backend, threads, precision, name=model_b.name))
        if sweep:
            runners.append(Runner(a, sweep, threads, precision, name=model_a.name))
        if inputs:
            feeds = load_inputs(inputs, a)
            feeds_by_batch = {len(next(iter(feeds.values()))): feeds}
        else:
            users = sorted({k for m in [a] + ([b] if model_b is not None else []) for k, f in
                            stored_input_facts(m).items() if f.is_user and k in _input_names(a)})  # declared
            feeds_by_batch = {n: generate_inputs(a, batch=n, seq_len=seq_len, fill=fill, one_user=one_user,
                                                 user_inputs=users) for n in _batch_sizes(batch)}
        results = []
        with Progress(console=console, transient=True) as progress:
            for n, feeds in feeds_by_batch.items():
                task = progress.add_task(f"batch {n}", total=1.0)
                results.append(run_bench(runners, feeds, n, seconds=seconds,
                                         on_step=lambda f, t=task: progress.update(t, completed=f)))
        names = [model_a.name] + ([model_b.name] if model_b else [])
        if sweep:
            names = [f"{model_a.name} on {backend}", f"{model_a.name} on {sweep}"]
        labels = "AB"[: len(names)]
        console.print("  ".join(f"{k} = {escape(n)}" for k, n in zip(labels, names))
                      + ("" if sweep else f"  on {backend}") + f", {_threads(threads)}")
        _print_latencies(results, labels)
        for r in results if len(runners) == 2 else ():
            console.print(_ratio_line(r), soft_wrap=True)
        if sweep:
            _print_sweep(results, sweep, backend)
        if json_out:
            json_out.write_text(json.dumps({"models": names, "backend": backend, "threads": threads,
                                            "results": [dataclasses.asdict(r) for r in results]}, indent=2))


def _print_latencies(results, labels: str) -> None:
    """One row per batch size and model: latency percentiles and throughput."""
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    for col in ("batch", "model", "p50 ms", "p90 ms", "p99 ms", "samples/s"):
        table.add_column(col, justify="left" if col == "model" else "right", no_wrap=True)
    for r in results:
        for k, lat in zip(labels, r.latency):
            table.add_row(str(r.batch), k, f"{lat.p50_ms:.3f}", f"{lat.p90_ms:.3f}", f"{lat.p99_ms:.3f}",
                          f"{lat.throughput:,.0f}")
    console.print(table)


def _print_sweep(results, sweep: str, backend: str) -> None:
    """--sweep: the batch from which the second backend wins at every larger batch measured, if any."""
    ordered = sorted(results, key=lambda r: r.batch)
    wins = [r.batch for i, r in enumerate(ordered) if all(x.ratio > 1 for x in ordered[i:])]
    console.print(f"{sweep} is faster from batch {wins[0]} on: gpu_backend={sweep!r}, gpu_threshold={wins[0]}"
                  if wins else f"{sweep} is not faster at the largest batch measured: keep {backend}")


def _threads(threads: int) -> str:
    """bench's thread count in words."""
    return f"{threads} thread{'s' * (threads > 1)}" if threads else "the runtime's default threads"


def _ratio_line(r) -> str:
    """One paired ratio in words: which model is faster and by how much; a warning when the spread is wide."""
    faster = f"B is [bold]{r.ratio:.2f}×[/] faster than A" if r.ratio >= 1 else \
        f"B is [bold]{1 / r.ratio:.2f}×[/] slower than A"
    line = (f"batch {r.batch}: {faster} (the median of paired time(A)/time(B) = {r.ratio:.2f}; > 1 means B is "
            f"faster; p10–p90 {r.ratio_p10:.2f}–{r.ratio_p90:.2f})")
    if (r.ratio_p90 - r.ratio_p10) > 0.25 * r.ratio:
        line += " [yellow]wide spread: the machine was busy or the runs short; rerun with more --seconds[/]"
    return line
