"""`ctropt optimize`: the precision choice, the pass options the flags set, the outputs' paths, and the run."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import List, Optional

import typer
from rich.markup import escape

from ..graph import (EXTERNAL_DATA_THRESHOLD, CtroptError, check_output_path, initializer_bytes, load, node_count, save,
                     weights)
from ..passes import PassManager
from ..passes.registry import DEVICES
from ..passes.speed import SpeedCheck
from ..report import write_report
from ..report.terminal import print_pass_diffs
from ..runtime import generate_inputs, load_inputs
from ..runtime.inputs import DEFAULT_SEQ_LEN
from ..runtime.runnable import check_target
from ..runtime.session import available_backends
from .common import ATOL, BATCH, INPUTS, OPTION, PLUGIN, RTOL, TARGET, _beside, _plugins, _user_errors, app, console
from .optimize_summary import _closing_line, _print_openvino_check, _print_result, _write_json
from .options import _pass_options

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
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print only the closing line and the paths written "
                               "(for scripts; errors still go to stderr)."),
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
            with _quiet_console(quiet):
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


@contextlib.contextmanager
def _quiet_console(quiet: bool):
    """--quiet: the console prints nothing until `_optimize` turns it back on for the closing line and paths."""
    console.quiet = quiet
    try:
        yield
    finally:
        console.quiet = False


def _optimize(m, model: Path, out: Path, store, external: bool, *, feeds, passes, skip, target, batch, atol, rtol,
              verify, strict, options, speed_check, bench_passes, speed_batch, static_seq_len, device, show_diff,
              json_out, report, replacing, precision: str = "f32") -> None:
    """`optimize` once the model is loaded and its large tensors are in `store`: run, save, report (under
    `_quiet_console`, the closing line and the paths only)."""
    quiet = console.quiet
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
    console.quiet = False
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
    if target == "openvino" and not quiet:
        _print_openvino_check(result.model, feeds or generate_inputs(
            result.model, batch=batch, seq_len=static_seq_len or DEFAULT_SEQ_LEN))
