"""ctropt against onnxruntime's own transformer optimizer on the corpus's transformer exports: paired ratios over
the raw export in one run.

    python benchmarks/ort_transformers.py                 # BST, TransAct, SASRec, BERT4Rec, AutoInt; 1 thread, b256
    python benchmarks/ort_transformers.py --only BST --seconds 4
    python benchmarks/ort_transformers.py --openvino    # the same exports on OpenVINO CPU: its own attention form

Per export: the raw export; `onnxruntime.transformers.optimizer.optimize_model(model_type="bert", opt_level=0)`
(the fusions onnxruntime's transformer tooling offers: attention, LayerNormalization, SkipLayerNormalization, Gelu;
level 0 so that the runtime's own graph optimizations stay as for the others), checked against the raw outputs; and
`ctropt optimize` (`all`, onnxruntime target, speed guard on). Raw vs each, on onnxruntime CPU with the same inputs
(generated, history fill ~55 %), interleaved: > 1 means faster than the raw export. The table also counts the
attention ops each form holds (com.microsoft Attention/MultiHeadAttention, ctropt's AttentionCore).

With --openvino: the raw export and `ctropt optimize --target openvino` on OpenVINO CPU (f32), paired, and what the
compiled model made of the attention: its runtime model's MHA subgraphs (OpenVINO's snippets tokenize
MatMul-Softmax-MatMul into one `Subgraph` node) and the MatMul/Softmax nodes left outside one.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import onnx

from common import THIRD

import ctropt  # noqa: E402
from ctropt.graph import load  # noqa: E402
from ctropt.runtime import Runner, compare_outputs, generate_inputs  # noqa: E402
from ctropt.runtime.bench import bench  # noqa: E402

KINDS = ("BST", "TransAct", "SASRec", "BERT4Rec", "AutoInt")
ATTENTION = {"Attention", "MultiHeadAttention", "AttentionCore"}


def ort_optimized(path: Path, out: Path) -> onnx.ModelProto:
    from onnxruntime.transformers.optimizer import optimize_model

    optimize_model(str(path), model_type="bert", opt_level=0).save_model_to_file(str(out))
    return onnx.load(out)


def attention_ops(model: onnx.ModelProto) -> int:
    return sum(n.op_type in ATTENTION for n in model.graph.node)


def openvino_form(model: onnx.ModelProto) -> str:
    """The compiled model's attention: its fused subgraphs, and the MatMul/Softmax nodes left outside them."""
    import collections

    import openvino as ov

    core = ov.Core()
    compiled = core.compile_model(core.read_model(model.SerializeToString(), b""), "CPU",
                                  {"INFERENCE_PRECISION_HINT": "f32"})
    kinds = collections.Counter(str(n.get_rt_info()["layerType"].astype(str))
                                for n in compiled.get_runtime_model().get_ops())
    return f"{kinds['Subgraph']} subgraph(s), {kinds['MatMul'] + kinds['Softmax']} MatMul/Softmax outside"


def compare_openvino(paths: list[Path], seconds: float, threads: int) -> None:
    print(f"OpenVINO CPU (f32), {threads} thread(s), batch 256; time(raw) / time(ctropt --target openvino)\n")
    print("| export | raw: attention as compiled | ctropt: attention as compiled | ratio (p10–p90) |")
    print("|---|---|---|---|")
    for path in paths:
        raw = load(path)
        ours = ctropt.optimize(raw, passes="all", target="openvino").model
        feeds = generate_inputs(raw, batch=256, fill=0.55)
        try:
            raw_form, runners = openvino_form(raw), [Runner(raw, "openvino-cpu", threads)]
        except RuntimeError as e:   # some raw exports do not compile on OpenVINO at all
            raw_form, runners = f"does not compile ({str(e).strip().splitlines()[-1][:60]})", []
        runners.append(Runner(ours, "openvino-cpu", threads))
        ratio = "-"
        if len(runners) == 2:
            r = bench(runners, feeds, 256, seconds=seconds, min_runs=10)
            ratio = f"{r.ratio:.2f} ({r.ratio_p10:.2f}–{r.ratio_p90:.2f})"
        print(f"| {path.stem} | {raw_form} | {openvino_form(ours)} | {ratio} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="stems containing one of these (comma list)")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--openvino", action="store_true", help="raw vs --target openvino on OpenVINO CPU instead")
    args = ap.parse_args()
    only = [o for o in args.only.split(",") if o]
    paths = [p for p in sorted(THIRD.glob("*.onnx")) if any(k in p.stem for k in KINDS)
             and (not only or any(o in p.stem for o in only))]
    if args.openvino:
        return compare_openvino(paths, args.seconds, args.threads)
    print(f"onnxruntime CPU, {args.threads} thread(s), batch 256; time(raw) / time(form), paired\n")
    print("| export | ORT transformers optimizer: ratio (p10–p90), attention ops | ctropt: ratio (p10–p90), "
          "attention ops |")
    print("|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for path in paths:
            raw = load(path)
            feeds = generate_inputs(raw, batch=256, fill=0.55)
            ours = ctropt.optimize(raw, passes="all", target="ort").model
            theirs = ort_optimized(path, Path(tmp) / f"{path.stem}.ort.onnx")
            base = Runner(raw, "ort-cpu", args.threads)
            want = base.run(feeds)
            cells = []
            for model in (theirs, ours):
                runner = Runner(model, "ort-cpu", args.threads)
                ok = all(d.ok for d in compare_outputs(want, runner.run(feeds), atol=1e-4, rtol=1e-3))
                r = bench([base, runner], feeds, 256, seconds=args.seconds, min_runs=10)
                cells.append(f"{r.ratio:.2f} ({r.ratio_p10:.2f}–{r.ratio_p90:.2f}), {attention_ops(model)}"
                             + ("" if ok else " **outputs differ**"))
            print(f"| {path.stem} | {cells[0]} | {cells[1]} |", flush=True)


if __name__ == "__main__":
    main()
