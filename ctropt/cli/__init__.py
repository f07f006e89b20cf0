"""The `ctropt` command: optimize, passes, inspect, verify. Errors are messages, never tracebacks."""

from __future__ import annotations

import collections
import contextlib
import os
import re
import sys
from pathlib import Path
from typing import List, Optional

import numpy as np
import onnx
import typer
from rich.console import Console, ConsoleDimensions
from rich.markup import escape
from rich import box
from rich.table import Table

from ..graph import (EXTERNAL_DATA_THRESHOLD, CtroptError, check_output_path, initializer_bytes, interface,
                     iter_proto_nodes, load, node_count, save, weights)
from ..passes import REGISTRY, PassManager, load_plugin, resolve
from ..passes.registry import DEVICES
from ..passes.speed import SpeedCheck
from ..report import write_report
from ..report.terminal import print_pass_diffs
from ..runtime import BACKENDS, DEFAULT_ATOL, DEFAULT_BATCH, DEFAULT_RTOL, Runner, compare_outputs, generate_inputs, load_inputs
from ..runtime.inputs import DEFAULT_SEQ_LEN, stored_input_facts
from ..runtime import strings
from ..runtime.runnable import check_target
from ..runtime.session import available_backends

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Make CTR/recommendation ONNX models fast: fuse, verify, lower.")
PIPE_COLUMNS = 120  # the width off a terminal (pipes, CI logs) where COLUMNS is not set; rich's own, 80, cuts tables


class _Console(Console):
    """rich's Console, PIPE_COLUMNS wide off a terminal unless COLUMNS says otherwise."""

    @Console.size.getter
    def size(self) -> ConsoleDimensions:
        size = Console.size.fget(self)
        if self.is_terminal or os.environ.get("COLUMNS", "").isdigit():
            return size
        return ConsoleDimensions(PIPE_COLUMNS, size.height)


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


PRECISIONS = ("f32", "f16", "int8", "auto", "bf16")


def _precision_choice(precision: str, int8: bool, device: str, calib) -> tuple[bool, str]:
    """(whether quantize-int8 runs, the decision in words) for --precision and --int8 (= --precision int8). auto:
    INT8 where the CPU has a fast 8-bit path (VNNI/AMX) and real calibration rows are given, the pass's gate then
    keeping each layer in INT8 only where measured faster and accurate; FP32 otherwise, saying why."""
    from ..runtime.cpu import cpu_info

    if precision not in PRECISIONS:
        raise CtroptError(f"--precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")
    if precision == "bf16":
        raise CtroptError("--precision bf16 is not built yet: onnxruntime's CPU kernels have no BF16 GEMM, and "
                          "OpenVINO's BF16 is a compile setting (INFERENCE_PRECISION_HINT bf16, where the CPU has "
                          "AMX-BF16 or AVX512_BF16), not a model rewrite")
    if precision == "f16" and device != "cuda":
        raise CtroptError("--precision f16 is for --device cuda (on this CPU, FP16 runs slower than FP32)")
    if (int8 or precision == "int8") and device != "cpu":
        raise CtroptError("--int8 is for --device cpu (onnxruntime's INT8 kernels are CPU kernels); on the GPU use "
                          "--precision f16")
    path = cpu_info().int8
    if int8 or precision == "int8":
        return True, f"int8 where quantize-int8's gate keeps a layer (CPU INT8 path: {path or 'none, emulated'})"
    if precision != "auto":
        return False, precision
    if device != "cpu":
        return False, "f32 (auto: INT8 is for --device cpu; on the GPU --precision f16 is the choice)"
    if path is None:
        return False, "f32 (auto: this CPU has no VNNI or AMX, so INT8 is emulated and rarely faster)"
    if calib is None:
        return False, (f"f32 (auto: the CPU has {path}, but no calibration data was given: --calib, rows of real "
                       "traffic; on generated inputs the accuracy gate measures nothing real)")
    return True, f"int8 where quantize-int8's gate keeps a layer (auto: the CPU has {path}, calibration {calib.name})"


def _extra_passes(passes: str, device: str, precision: str, quantize: bool) -> str:
    """The pass list with what --precision adds (quantize-int8, or convert-float16 for f16)."""
    if device not in DEVICES:
        raise CtroptError(f"--device must be one of {', '.join(DEVICES)}, not {device!r}")
    return passes + (",quantize-int8" if quantize else "") + (",convert-float16" if precision == "f16" else "")


def _can_time_on(device: str) -> bool:
    """The speed check times on the device the model is for; without a CUDA provider it is off, with a note."""
    if device == "cpu" or available_backends().get(f"ort-{device}") == "available":
        return True
    console.print(f"[yellow]speed check off:[/] onnxruntime has no {device.upper()} provider here (install "
                  "onnxruntime-gpu); passes are verified, not timed")
    return False


def _optimize_options(option, static_seq_len, user_inputs, calib, quantize: bool, precision: str) -> dict:
    """The pass options `optimize`'s flags set (--option KEY=VALUE, --static-seq-len, --user-inputs, --calib)."""
    options = _pass_options(option or [])
    if static_seq_len is not None:
        options["static_seq_len"] = static_seq_len
    if user_inputs:
        options["user_inputs"] = user_inputs
    if calib is not None:
        if not quantize and precision != "auto":
            raise CtroptError("--calib is calibration data for --int8 (or --precision int8|auto); add one")
        if not calib.is_file():
            raise CtroptError(f"{calib}: no such calibration file")
        options["calib"] = str(calib)
    return options


# Every key the passes and the manager read from their options (`--option KEY=VALUE`), with its meaning; a plugin
# declares its own with register_pass(options=...). tests/test_cli.py checks each key read in ctropt/ is here.
PASS_OPTIONS = {
    "ort_kernels": "auto (default): ctropt's onnxruntime kernels where faster; off: standard ops only",
    "rnn_ort_form": "lower-rnn-ort's form: auto, kernel, standard, scan or gru-op",
    "attention_ort_form": "attention-core-kernel's form: auto, kernel (insist) or standard (leave the ops)",
    "rnn_openvino_form": "lower-rnn-openvino's form: auto, scan, gru-op or augru-unrolled",
    "static_seq_len": "the history length T fixed for OpenVINO (as --static-seq-len)",
    "user_inputs": "the inputs that describe the user (as --user-inputs)",
    "fold_size_cap": "fold-constants' largest folded constant, in bytes (default 16 MiB)",
    "calib": "quantize-int8's calibration data, an .npz (as --calib)",
    "calibrator": "quantize-int8's calibration: minmax (default), percentile or entropy",
    "int8_eval": "quantize-int8's evaluation data, an .npz (default: the calibration data)",
    "int8_threshold": "quantize-int8's accuracy gate: relative mean error bound (default 0.005)",
    "int8_max_abs": "quantize-int8's accuracy gate: worst-row error bound (default 0.01)",
    "int8_batch": "rows quantize-int8's speed gate times each layer at (default 256)",
    "int8_bench_seconds": "seconds quantize-int8's speed gate times each layer (default 1.0)",
    "int8_min_speedup": "a layer goes INT8 where at least this much faster (default 1.05; 0: no speed gate)",
    "int8_reduce_range": "7-bit INT8 weights: auto (default: where the CPU lacks VNNI), true or false",
    "fp16_threshold": "convert-float16's accuracy gate: relative mean error bound (default 0.002)",
    "fp16_max_abs": "convert-float16's accuracy gate: worst-row error bound (default 0.005)",
}


def _known_options() -> dict[str, str]:
    """ctropt's option keys and those the registered (plugin) passes declare."""
    return {**PASS_OPTIONS, **{k: v for p in REGISTRY.values() for k, v in p.options.items()}}


def _pass_options(items: list[str]) -> dict:
    """--option KEY=VALUE items → the pass options; an unknown key is an error that names the closest."""
    import difflib

    options, known = {}, _known_options()
    for item in items:
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise CtroptError(f"--option wants KEY=VALUE, got {item!r}")
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            raise CtroptError(f"--option {key}: unknown key" + (f"; did you mean {close[0]}?" if close else "")
                              + f" (known: {', '.join(sorted(known))}; `ctropt passes --options` says what each does)")
        options[key] = int(value) if value.strip().lstrip("-").isdigit() else value.strip()
    return options


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
    static_seq_len: Optional[int] = typer.Option(
        None, "--static-seq-len", min=1,
        help="History length T to fix for OpenVINO, which fuses whole recurrent sequences only for a static T."),
    option: Optional[List[str]] = OPTION,
    user_inputs: Optional[str] = typer.Option(None, "--user-inputs", help=escape(  # rich markup would eat [i]
        "Comma list of the inputs that describe the user (the same for every candidate of a request): their work "
        "runs once per distinct user, and the speed check times one-user requests. Columns of a packed "
        "[batch, width] input: NAME[i] or NAME[i:j] (deepctr-torch's X). Stored in the saved model.")),
    int8: bool = typer.Option(False, "--int8", help="Also run quantize-int8: FC layers to INT8 where measured "
                              "faster, within the accuracy gate."),
    device: str = typer.Option("cpu", "--device", help="Where the ort-target model runs: cpu, or cuda (standard "
                               "ops only, no INT8, the speed check on the GPU)."),
    precision: str = typer.Option("f32", "--precision", help="f32; int8 (as --int8); auto: INT8 where this CPU "
                                  "has VNNI or AMX and --calib gives real rows (else FP32, saying why); f16 with "
                                  "--device cuda: FP16 where the worst row stays within the accuracy gate. The "
                                  "choice and the CPU go in the saved model's metadata."),
    calib: Optional[Path] = typer.Option(None, "--calib", help="INT8 calibration data: .npz of input arrays "
                                         "(batch first), optional `label` for AUC/logloss."),
    show_diff: bool = typer.Option(False, "--show-diff", help="Print what each pass changed (a tree of changed "
                                   "regions) and why the others did not fire."),
    report: Optional[Path] = typer.Option(None, "--report", help="Write a self-contained HTML page: every pass "
                                          "with before/after drawings of what it changed."),
    speed_check: bool = typer.Option(True, "--speed-check/--no-speed-check", help="Time each speed pass against "
                                     "its input on the target's runtime (paired, 1 thread, --speed-batch rows) "
                                     "and roll it back when slower; then the whole result against the input."),
    speed_batch: int = typer.Option(256, "--speed-batch", min=1, help="Rows of the speed check's generated inputs (with --inputs: those)."),
    bench_passes: bool = typer.Option(False, "--bench-passes", help="Time every applied pass against its input "
                                      "(as the speed check does) and only record the ratios: nothing is rolled back "
                                      "for speed."),

    json_out: Optional[Path] = typer.Option(None, "--json", help="Also write what each pass did (status, "
                                            "rewrites, speed ratio, message) and the whole result's speed as JSON."),
):
    """Run passes on a model, verifying outputs after each one, and save the result."""
    with _user_errors():
        _plugins(plugin)
        quantize, decision = _precision_choice(precision, int8, device, calib)
        options = _optimize_options(option, static_seq_len, user_inputs, calib, quantize, precision)
        passes = _extra_passes(passes, device, precision, quantize)
        out = output or _beside(model, ".opt.onnx")
        replacing = _check_outputs(model, {"-o": out, "--report": report, "--json": json_out})
        m = load(model, keep_external=True)
        check_target(m, target, model.name)
        feeds = load_inputs(inputs, m) if inputs else None
        with weights.WeightStore.opened(near=out.parent) as store:
            external = bool(weights.stored(m))
            store.adopt(m, model.parent)  # large tensors stay in files while the passes run (graph/weights.py)
            _optimize(m, model, out, store, external, feeds=feeds, passes=passes, skip=skip, target=target,
                      batch=batch, atol=atol, rtol=rtol, verify=verify, strict=strict, options=options,
                      speed_check=speed_check, bench_passes=bench_passes, speed_batch=speed_batch,
                      static_seq_len=static_seq_len, device=device, show_diff=show_diff, json_out=json_out,
                      report=report, replacing=replacing, precision=decision)


def _precision_kept(result, decision: str) -> str:
    """The decision, and where INT8 was tried what quantize-int8 kept (its note: how many layers, or why none)."""
    record = next((r for r in result.records if r.name == "quantize-int8"), None)
    if record is None or not decision.startswith("int8"):
        return decision
    if record.status != "applied":
        why = "; ".join(record.notes) or record.message or record.status
        return f"f32: quantize-int8 kept no layer ({why}); asked: {decision}"
    return f"{decision}: {'; '.join(record.notes) or 'applied'}"


def _check_outputs(model: Path, outputs: dict[str, Optional[Path]]) -> set[Path]:
    """optimize's outputs by flag: none over the input, each in its own file (the model's .data included). Returns
    those that exist: the run replaces them, and says so."""
    what = {"-o": "the model (-o)", "--report": "the report (--report)", "--json": "the JSON (--json)"}
    taken: dict[Path, str] = {}
    for flag, path in outputs.items():
        if path is None:
            continue
        check_output_path(path, model, flag=flag)
        where = path.resolve()
        if where in taken:
            raise CtroptError(f"{flag} {path} is also the path of {taken[where]}; give each output its own path")
        taken[where] = what[flag]
        if flag == "-o":
            taken[where.with_name(where.name + ".data")] = "the model's large tensors (-o)"
    return {path for path in outputs.values() if path is not None and path.exists()}


def _optimize(m, model: Path, out: Path, store, external: bool, *, feeds, passes, skip, target, batch, atol, rtol,
              verify, strict, options, speed_check, bench_passes, speed_batch, static_seq_len, device, show_diff,
              json_out, report, replacing, precision: str = "f32") -> None:
    """`optimize` once the model is loaded and its large tensors are in `store`: run, save, report."""
    status = console.status("starting")
    done: list[str] = []
    piped = not console.is_terminal

    def progress(p, record):
        if record is None:
            status.update(f"running [bold]{p.name}[/] ({len(done) + 1}/{len(manager.passes)})")
            return
        done.append(p.name)
        if piped:  # no spinner off a terminal: a line per pass, so a long run is never silent
            console.print(f"({len(done)}/{len(manager.passes)}) {p.name}: {record.status}, "
                          f"{record.nodes_before}→{record.nodes_after} nodes, {record.seconds:.1f} s",
                          highlight=False, soft_wrap=True)

    speed = SpeedCheck(batch=speed_batch, seq_len=static_seq_len, enforce=not bench_passes, feeds=feeds) \
        if (speed_check or bench_passes) and _can_time_on(device) else None
    manager = PassManager(passes, skip=skip, target=target, feeds=feeds, batch=batch, atol=atol, rtol=rtol,
                          verify=verify, strict=strict, on_pass=progress, options=options, speed=speed,
                          device=device)
    console.print(f"[bold]{escape(model.name)}[/]: {node_count(m)} nodes, {len(manager.passes)} passes, "
                  f"target {target}" + (f" on {device}" if device != "cpu" else ""))
    with status:
        result = manager.run(m)
    precision = _precision_kept(result, precision)
    result.model.metadata_props.add(key="ctropt.precision", value=precision)
    keep_external = external or initializer_bytes(result.model) > EXTERNAL_DATA_THRESHOLD
    save(result.model if keep_external else store.inline(result.model), out, protect=(model,))
    _print_result(result)
    console.print(f"[cyan]precision:[/] {escape(precision)}", soft_wrap=True)
    if show_diff:
        print_pass_diffs(console, result.records)
    timed_rows = len(next(iter(feeds.values()), [])) if feeds else speed_batch
    console.print(_closing_line(result, node_count(m), verify, target, timed_rows, device))

    def replaced(path: Path) -> str:  # an output that was there before: -o, --report and --json replace it
        return " (replaced the file there)" if path in replacing else ""

    data = out.with_name(out.name + ".data")
    console.print(f"saved {out}{replaced(out)}" + (
        f" + {data.name} ({data.stat().st_size / 2**20:.0f} MiB: the large tensors, written once; the input's "
        "files are not referenced)" if keep_external and data.exists() else ""), soft_wrap=True)
    if report is not None:
        applied = sum(r.status == "applied" for r in result.records)
        write_report(report, result.records, title=f"ctropt: {model.name}",
                     subtitle=f"{model} → {out.name} · target {target} · {node_count(m)} → "
                              f"{node_count(result.model)} nodes · {applied}/{len(result.records)} passes applied"
                              + ("" if verify else " · outputs NOT verified"))
        console.print(f"report {report}{replaced(report)}")
    if json_out is not None:
        _write_json(json_out, result, model, out, target)
        console.print(f"json {json_out}{replaced(json_out)}")
    if target == "openvino":
        _print_openvino_check(result.model, feeds or generate_inputs(
            result.model, batch=batch, seq_len=static_seq_len or DEFAULT_SEQ_LEN))


def _print_openvino_check(model, feeds) -> None:
    """Whether OpenVINO's CPU runs the optimized model, and what to do where it cannot."""
    try:
        Runner(model, "openvino-cpu").run(feeds)
        console.print("OpenVINO CPU: loads and runs")
    except CtroptError as e:
        console.print(f"[yellow]OpenVINO CPU cannot run it yet:[/] {escape(str(e))}"
                      + ("; it has string inputs: `ctropt split-strings` makes the id model OpenVINO runs"
                         if strings.has_string_inputs(model) and "split-strings" not in str(e) else ""))


def _print_result(result) -> None:
    """The repairs, the pass table, what the saved model needs at run time, and the notes of the passes that gate
    their own accuracy (INT8, FP16: what was kept and what it cost)."""
    for repair in result.repairs:
        console.print(f"[yellow]repaired the export:[/] {escape(repair)}")
    _print_pass_table(result)
    _print_runtime_needs(result)
    for r in result.records:
        if r.name in REGISTRY and not REGISTRY[r.name].exact and r.notes:
            console.print(f"[bold]{r.name}[/]:\n" + "\n".join(f"  {escape(n)}" for n in r.notes))


def _write_json(path: Path, result, model: Path, out: Path, target: str) -> None:
    import json

    speed = result.speed
    path.write_text(json.dumps({
        "input": str(model), "output": str(out), "target": target, "kept_input": result.kept_input,
        "speed": None if speed is None else {"ratio": speed.ratio, "p10": speed.p10, "p90": speed.p90,
                                             "pairs": speed.pairs},
        "speed_note": result.speed_note, "repairs": result.repairs,
        "passes": [{"name": r.name, "status": r.status, "rewrites": r.rewrites, "nodes": [r.nodes_before, r.nodes_after],
                    "max_abs_err": r.max_abs_err, "speedup": r.speedup, "seconds": round(r.seconds, 3),
                    "message": r.message} for r in result.records]}, indent=1))


def _print_runtime_needs(result) -> None:
    """Which form the recurrent layers took on onnxruntime: ctropt's kernels (the saved model needs the library)
    or stock ops, and why; the CPU it was measured on (what it does fast below FP32)."""
    from .. import kernels
    from ..runtime.cpu import cpu_info

    console.print(f"[cyan]cpu:[/] {escape(cpu_info().summary())}", soft_wrap=True)

    if kernels.uses_kernels(result.model):
        used = sorted({n.op_type for n in iter_proto_nodes(result.model.graph) if n.domain == kernels.DOMAIN})
        console.print(f"[cyan]kernels:[/] {', '.join(used)} run as ctropt's kernels; onnxruntime needs "
                      f"{kernels.library_path()} registered (ctropt's own sessions and `ctropt repository` do it; "
                      "other code: ctropt.kernels.register(session_options))")
    if strings.uses_strings(result.model):
        used = sorted({n.op_type for n in iter_proto_nodes(result.model.graph) if n.domain == strings.DOMAIN})
        console.print(f"[cyan]strings:[/] {', '.join(used)} run in onnxruntime-extensions {strings.version()}; "
                      f"onnxruntime needs {strings.library_path()} registered (ctropt's sessions do it; other "
                      "code: ctropt.runtime.strings.register(session_options))")
    for r in result.records:
        for note in r.notes if r.name == "lower-rnn-ort" and r.status == "applied" else ():
            if note.startswith("standard ops"):
                console.print(f"[yellow]{r.name}:[/] {escape(note)}")


def _print_pass_table(result) -> None:
    """One compact table of the passes that changed the model or were rolled back, why each pass that saw a
    candidate left it, and a count of the passes that found none."""
    shown = [r for r in result.records if r.status != "unchanged"]
    table = _table("pass", "status", "rewrites", "nodes", "max err", "speed", box=box.SIMPLE_HEAD, pad_edge=False,
                   show_edge=False, collapse_padding=True, numbers=("rewrites", "nodes", "max err", "speed"))
    for r in shown:
        style = {"rolled back": "red", "failed": "red", "slower": "yellow"}.get(r.status, "")
        table.add_row(r.name, f"[{style}]{r.status}[/]" if style else r.status, str(r.rewrites),
                      f"{r.nodes_before}→{r.nodes_after}", _fmt_err(r.max_abs_err),
                      "-" if r.speedup is None else f"{r.speedup:.2f}×")
    if shown:
        console.print(table)
    for r in shown:  # why a pass was rolled back, or kept although it was slower alone
        if r.message and r.status in ("rolled back", "failed", "slower", "applied"):
            color = {"slower": "yellow", "applied": "green"}.get(r.status, "red")
            console.print(f"[{color}]{r.name} {r.status}[/]: {escape(r.message)}", soft_wrap=True)
    declined = [(r, _why_not(r)) for r in result.records
                if r.status == "unchanged" and r.matches and REGISTRY[r.name].group != "cleanup"]
    for r, why in declined:
        console.print(f"[dim]{r.name} declined:[/] {escape(why)}", soft_wrap=True)
    idle = sum(r.status == "unchanged" for r in result.records) - len(declined)
    if idle:
        console.print(f"[dim]{idle} more passes found nothing to do[/]")


def _why_not(record) -> str:
    """A pass that saw a candidate and left it: the first reason it gave (its note, or the check that declined)."""
    reasons = [re.sub(rf"^(left as is|{re.escape(record.name)}): ", "", n) for n in record.notes + record.misses]
    if not reasons:
        return "declined by its checks (--show-diff explains)"
    first = reasons[0] if len(reasons[0]) <= 160 else reasons[0][:159] + "…"
    return first + (" (--show-diff: all reasons)" if first is not reasons[0] or len(reasons) > 1 else "")


def _closing_line(result, nodes_before: int, verified: bool, target: str, batch: int, device: str = "cpu") -> str:
    """"N → M nodes, verified (max err E), X.X× faster on <runtime> (paired, batch B)"."""
    errors = [r.max_abs_err for r in result.records if r.max_abs_err is not None and r.status == "applied"
              and not result.kept_input]
    check = (f"verified (max err {max(errors):.1e})" if errors else "verified") if verified else "outputs NOT verified"
    runtime = {"ort": f"onnxruntime {device.upper()}", "openvino": "OpenVINO CPU"}.get(target, target)
    if result.kept_input:
        speed = f"[bold red]the input kept: the result was slower[/] ({escape(result.speed_note)})"
    elif result.speed is not None:
        v = result.speed
        verdict = f"{v.ratio:.2f}× faster" if v.ratio >= 1 else f"{1 / v.ratio:.2f}× slower"
        one_user = any(f.is_user for f in stored_input_facts(result.model).values())
        rows = f"one user × {batch} candidates" if one_user else f"batch {batch}"
        threads = ", 1 thread" if device == "cpu" else ""
        speed = f"[bold]{verdict}[/] on {runtime} (paired, {rows}{threads}; p10–p90 {v.p10:.2f}–{v.p90:.2f})"
    else:
        speed = f"speed not measured ({escape(result.speed_note)})" if result.speed_note else "speed not measured"
    return f"{nodes_before} → {node_count(result.model)} nodes, {check}, {speed}"


@app.command()
def diff(
    model_a: Path = typer.Argument(..., metavar="BEFORE", help="Model before."),
    model_b: Path = typer.Argument(..., metavar="AFTER", help="Model after."),
    report: Optional[Path] = typer.Option(None, "--report", help="Also write the diff as a self-contained HTML page."),
):
    """Show what changed between two models: op counts, and a tree of changed regions (all subgraphs too)."""
    from ..report import diff_models
    from ..report.terminal import print_model_diff

    with _user_errors():
        if report is not None:
            check_output_path(report, model_a, model_b, flag="--report")
        a, b = load(model_a), load(model_b)
        d = diff_models(a, b)
        if interface(a) != interface(b):
            console.print("[yellow]the two models' inputs/outputs differ[/]")
        print_model_diff(console, d, model_a.name, model_b.name)
        if report is not None:
            from ..passes import PassRecord

            record = PassRecord(f"{model_a.name} → {model_b.name}", "applied" if not d.empty else "unchanged",
                                nodes_before=node_count(a), nodes_after=node_count(b), diff=d)
            write_report(report, [record], title=f"ctropt diff: {model_a.name} → {model_b.name}",
                         subtitle=f"{model_a} → {model_b}")
            console.print(f"report {report}")


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


@app.command("passes")
def list_passes(plugin: Optional[List[str]] = PLUGIN,
                options: bool = typer.Option(False, "--options", help="List the --option keys instead.")):
    """List every registered pass (or, with --options, the keys of --option KEY=VALUE)."""
    with _user_errors():
        _plugins(plugin)
        if options:
            table = _table("--option key", "meaning")
            for key, meaning in sorted(_known_options().items()):
                table.add_row(key, escape(meaning))
            console.print(table)
            return
        table = _table("pass", "group", "targets", "in all", "description")
        for p in sorted(REGISTRY.values(), key=lambda p: p.sort_key):
            table.add_row(p.name, p.group, ",".join(p.targets), "yes" if p.default else "opt-in", escape(p.description))
        console.print(table)


@app.command()
def inspect(
    model: Path = typer.Argument(..., help="Input .onnx model."),
    target: str = TARGET,
    explain: bool = typer.Option(False, "--explain", help="For passes that would not fire, show the closest miss."),
    top: int = typer.Option(25, "--top", min=1, help="Op histogram rows."),
    plugin: Optional[List[str]] = PLUGIN,
):
    """Show ops, interface, embedding tables, recurrent structures and which passes would match."""
    from .. import inspect as insp
    from ..graph import to_graph

    with _user_errors():
        _plugins(plugin)
        m = load(model)
        check_target(m, target, model.name,
                     "inspect it with --target ort, or the original model with --target openvino")
        opsets = ", ".join(f"{o.domain or 'ai.onnx'} {o.version}" for o in m.opset_import)
        console.print(f"[bold]{model}[/]  producer {m.producer_name or '?'} {m.producer_version}  IR {m.ir_version}"
                      f"  opsets: {opsets}  nodes (subgraphs included): {node_count(m)}")
        io = _table("", "name", "dtype", "shape", title="interface")
        import onnx

        for kind, name, elem, dims in interface(m):
            dtype = onnx.TensorProto.DataType.Name(elem) if elem else "?"
            io.add_row(kind, escape(name), dtype, escape("?" if dims is None else str(list(dims))))
        console.print(io)
        counts = insp.op_counts(m)
        ops = _table("op", "count", numbers=("count",), title=f"ops ({len(counts)} types)")
        for op, n in counts[:top]:
            ops.add_row(op, str(n))
        if len(counts) > top:
            ops.add_row(f"... {len(counts) - top} more", str(sum(n for _, n in counts[top:])))
        console.print(ops)
        graph = to_graph(m)
        tables = insp.embedding_tables(graph)
        emb = _table("table", "rows", "width", "lookups", "via", "taken by", numbers=("rows", "width", "lookups"),
                     title=f"embedding tables ({len(tables)})")
        for t in tables:
            emb.add_row(escape(t.name), str(t.rows), str(t.width), str(t.lookups), t.ops, t.taken_by or "-")
        console.print(emb)
        found = insp.ctr_structures(graph)
        kinds = collections.Counter(f.kind for f in found)
        ct = _table("kind", "where", "detail",
                    title="CTR structures (" + (", ".join(f"{k} ×{n}" for k, n in kinds.items()) or "none") + ")")
        for f in found[:top]:
            ct.add_row(f.kind, escape(f.where), escape(f.detail))
        if len(found) > top:
            ct.add_row("...", f"{len(found) - top} more", "")
        console.print(ct)
        rec = insp.recurrent_structures(graph)
        rt = _table("kind", "where", "detail", title=f"recurrent structures ({len(rec)})")
        for r in rec:
            rt.add_row(r.kind, escape(r.where), escape(r.detail))
        console.print(rt)
        previews = insp.preview_passes(m, resolve("all", (), target), target, explain)
        pt = _table("pass", "matches", "rewrites", "notes", numbers=("matches", "rewrites"),
                    title=f"passes that would match (target {target}, dry run)")
        for p in previews:
            pt.add_row(p.name, str(p.matches), str(p.rewrites), escape("; ".join(p.notes + p.misses)))
        console.print(pt)


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
        table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
        for col in ("batch", "model", "p50 ms", "p90 ms", "p99 ms", "samples/s"):
            table.add_column(col, justify="left" if col == "model" else "right", no_wrap=True)
        for r in results:
            for k, lat in zip(labels, r.latency):
                table.add_row(str(r.batch), k, f"{lat.p50_ms:.3f}", f"{lat.p90_ms:.3f}", f"{lat.p99_ms:.3f}",
                              f"{lat.throughput:,.0f}")
        console.print(table)
        for r in results if len(runners) == 2 else ():
            console.print(_ratio_line(r), soft_wrap=True)
        if sweep:
            ordered = sorted(results, key=lambda r: r.batch)
            wins = [r.batch for i, r in enumerate(ordered) if all(x.ratio > 1 for x in ordered[i:])]
            console.print(f"{sweep} is faster from batch {wins[0]} on: gpu_backend={sweep!r}, gpu_threshold={wins[0]}"
                          if wins else f"{sweep} is not faster at the largest batch measured: keep {backend}")
        if json_out:
            json_out.write_text(json.dumps({"models": names, "backend": backend, "threads": threads,
                                            "results": [dataclasses.asdict(r) for r in results]}, indent=2))


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


kernels_app = typer.Typer(no_args_is_help=True, help="ctropt's onnxruntime kernel library (rnn_ort_form=kernel).")
app.add_typer(kernels_app, name="kernels")


@kernels_app.command("build")
def kernels_build(
    include: Optional[Path] = typer.Option(None, "--include", help="Folder with onnxruntime_c_api.h "
                                           "(default: $ORT_INCLUDE_DIR, /usr/include/onnxruntime)."),
):
    """Compile the kernel library, one build per instruction set (gcc and onnxruntime's C API header needed)."""
    from .. import kernels

    with _user_errors():
        console.print(f"built {kernels.build(include)}")


@kernels_app.command("path")
def kernels_path(
    include: bool = typer.Option(False, "--include", help="Print instead the folder of the onnxruntime C API header "
                                 "ctropt ships (onnxruntime_c_api.h, API 21), for a C/C++ server (examples/c/serve.c)."),
):
    """Print where the library onnxruntime registers is (built or not): register_custom_ops_library(that path)."""
    from .. import kernels

    print(kernels.SHIPPED_HEADER_DIR if include else kernels.library_path())


@kernels_app.command("status")
def kernels_status():
    """Whether the library is built, where, and which of its builds this CPU runs."""
    from .. import kernels

    state = f"built ({', '.join(isa for isa, _ in kernels.isas())}; this CPU runs {kernels.chosen_isa()})" \
        if kernels.available() else "not built (run `ctropt kernels build`)"
    console.print(f"{kernels.library_path()}: {state}; header: {kernels.include_dir() or 'not found'}", soft_wrap=True)


def _usage_message(e) -> str:
    """A usage error in one line; a missing argument with the usage line (what `verify RAW OPTIMIZED` needs)."""
    import difflib

    command = e.ctx.command_path if e.ctx else "ctropt"
    if getattr(e, "possibilities", None):  # click's difflib counts the dashes: --frob "matches" --rtol; not the name
        name = e.option_name.lstrip("-")
        e.possibilities = [p for p in e.possibilities
                           if difflib.SequenceMatcher(None, name, p.lstrip("-")).ratio() >= 0.6]
    message = e.format_message()
    if e.ctx and getattr(getattr(e, "param", None), "param_type_name", "") == "argument":
        message = f"{message.rstrip('.')}; usage: {e.ctx.get_usage().removeprefix('Usage: ')}"
    return f"{message} (see {command} --help)"


def main() -> None:
    """The console script: a bad argument is a one-line `error:` and exit 2, like every other bad input."""
    try:   # typer >= 0.2x bundles its click; older ones use the click package
        from typer._click import exceptions
    except ImportError:
        from click import exceptions
    UsageError, NoArgsIsHelpError = exceptions.UsageError, getattr(exceptions, "NoArgsIsHelpError", ())

    try:
        code = app(standalone_mode=False)
    except NoArgsIsHelpError:   # the help is printed already
        sys.exit(2)
    except UsageError as e:
        err_console.print(f"[bold red]error:[/] {escape(_usage_message(e))}", soft_wrap=True)
        sys.exit(2)
    except KeyboardInterrupt:
        err_console.print("interrupted")
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)
