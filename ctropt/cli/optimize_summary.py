"""What `ctropt optimize` says about a run: the pass table, why passes declined, what the saved model needs
at run time, the closing line, the OpenVINO check and the JSON record."""

from __future__ import annotations

import re
from pathlib import Path

from rich.markup import escape
from rich import box

from ..graph import CtroptError, iter_proto_nodes, node_count
from ..passes import REGISTRY
from ..runtime import Runner, strings
from ..runtime.inputs import stored_input_facts
from .common import _fmt_err, _table, console

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
