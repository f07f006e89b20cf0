"""INT8 FC layers: QDQ around each fully connected layer, calibrated, kept only where measured faster and only
while the model stays within an accuracy gate (opt-in: `ctropt optimize --int8 [--calib data.npz]`).

The scheme is seed 003's (Intel's INT8 Wide&Deep), produced by onnxruntime.quantization.quantize_static in
QDQ form: int8 weights, symmetric, one scale per output column; uint8 activations with a zero point, so the
first FC, whose input can be negative, is quantized asymmetrically, and an FC after a ReLU gets zero point 0,
i.e. the symmetric 255/max scale; the bias is int32 at scale s_x·s_w, so it is added exactly in the integer
accumulator (what the seed calls the shifted bias). onnxruntime runs DequantizeLinear → Gemm → QuantizeLinear
as QGemm; OpenVINO reads QDQ too.

Three gates, each reported in the pass notes:
1. speed: each FC layer is run alone at its real input (batch `int8_batch`, default 256) in FP32 and INT8 on
   the target's runtime, paired; a layer stays FP32 unless INT8 is at least `int8_min_speedup` (1.05) times
   faster (small GEMMs often are slower in INT8: quantizing the input and dequantizing the output cost more than
   the product saves); `int8_min_speedup=0` turns the gate off;
   without 8-bit dot products (VNNI) onnxruntime multiplies u8·s8 pairs with a saturating 16-bit add
   (vpmaddubsw), so there weights get 7 bits (`int8_reduce_range`, default auto): on this AVX2-only CPU that
   halved zoo WDL's error (0.31 % → 0.17 % of the mean output) at no measured cost in speed;
2. accuracy: FP32 vs INT8 outputs on the evaluation data (`int8_eval`, else the calibration data): max and
   mean absolute error of each output; with labels (key `label`, or `label:OUTPUT` for one output, in the
   .npz) the AUC and logloss drift. The
   gate (`int8_threshold`, default 0.005 relative) holds on the AUC drop and logloss rise when labels are
   given, else on the mean absolute error relative to the mean |output|. It also bounds the worst row:
   the max absolute error of each output (`int8_max_abs`, default 0.01 for a probability output, times
   max(1, max |output|) for any other), since a mean can hide rows off by 0.025 (deepctr-torch DeepFM/WDL
   dynamo exports). Beyond either bound, the layer whose INT8 error is largest returns to FP32, and so on; if
   none can stay INT8 the model is left as it was;
3. the manager then runs the usual check that the model still runs with the same interface; as the outputs
   change by design, later passes are verified against the INT8 model's outputs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import os
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from ...graph import CtroptError, runnable_model, to_graph, weights
from ...graph.edit import const_value
from ...runtime import Runner, generate_inputs, store_input_facts
from ...runtime.cpu import cpu_info
from ...runtime.bench import bench
from ...runtime.inputs import read_npz
from ...runtime.probe import all_values
from ..registry import PassContext, register_pass

BACKEND_OF_TARGET = {"ort": "ort-cpu", "openvino": "openvino-cpu"}
CALIBRATORS = ("minmax", "percentile", "entropy")
LABEL_KEY = "label"  # in a calibration/eval .npz: `label` (every output) or `label:OUTPUT` (one output)


@dataclasses.dataclass
class FCLayer:
    node: str
    op: str
    k: int
    n: int
    x: str  # the input value
    act: str | None  # a Relu that follows (quantized together: removed into the QuantizeLinear)
    speedup: float | None = None  # measured FP32 time / INT8 time, the layer alone
    error: float | None = None  # the accuracy metric with only this layer INT8


def fc_layers(graph: gs.Graph) -> list[FCLayer]:
    """Gemm/MatMul nodes of the main graph with a constant 2-D float32 weight (FC layers)."""
    layers = []
    for node in graph.nodes:
        if node.op not in ("Gemm", "MatMul") or len(node.inputs) < 2 or node.attrs.get("transA", 0):
            continue
        w = const_value(node.inputs[1])
        if any(const_value(t) is None for t in node.inputs[2:] if t.name) or w is None or w.ndim != 2 or w.dtype != np.float32 or node.inputs[0].dtype not in (np.float32, None):
            continue
        k, n = (w.shape[::-1] if node.attrs.get("transB", 0) else w.shape)
        users = node.outputs[0].outputs
        act = users[0].name if len(users) == 1 and users[0].op == "Relu" else None
        layers.append(FCLayer(node.name, node.op, int(k), int(n), node.inputs[0].name, act))
    return layers


def cpu_has_vnni() -> bool:
    """Whether this CPU has 8-bit dot products (AVX-512 VNNI, AVX-VNNI or AMX)."""
    return cpu_info().int8 is not None


# ----------------------------------------------------------------------------------------- data


def split_data(model: onnx.ModelProto, source, rows_per_batch: int = 256):
    """Feeds in batches of `rows_per_batch` rows from an .npz/dict keyed by input names, and its labels by output
    name ("" = every output)."""
    data = ({k: np.asarray(v) for k, v in source.items()} if isinstance(source, dict)
            else read_npz(source, "calibration data"))
    initializers = {t.name for t in model.graph.initializer}
    names = [i.name for i in model.graph.input if i.name not in initializers]
    labels = {k.partition(":")[2]: data.pop(k) for k in list(data)
              if k.partition(":")[0] == LABEL_KEY and k not in names}
    missing = [n for n in names if n not in data]
    if missing:
        raise CtroptError(f"calibration data lacks the inputs {missing} (keys: {sorted(data)})")
    rows = {len(data[n]) if data[n].ndim else 0 for n in names}
    if len(rows) == 1 and 0 not in rows:
        total = rows.pop()
        batches = [{n: data[n][i:i + rows_per_batch] for n in names} for i in range(0, total, rows_per_batch)]
    else:  # jagged inputs (torchrec's values/lengths/offsets) cannot be cut by rows: one feed
        batches = [{n: data[n] for n in names}]
    return batches, {k: np.asarray(v).reshape(len(v), -1) for k, v in labels.items()}


def _calibration(model: onnx.ModelProto, ctx: PassContext):
    if ctx.options.get("calib") is not None:
        batches, labels = split_data(model, ctx.options["calib"])
        return batches, labels, f"{sum(len(next(iter(b.values()))) for b in batches)} calibration rows"
    ctx.note("WARNING: no calibration data (--calib): calibrated on generated inputs, whose value ranges may "
             "differ from real traffic")
    return [generate_inputs(model, batch=128, seed=100 + i) for i in range(8)], {}, "generated inputs"


# ----------------------------------------------------------------------------------------- quantizing


def quantize(model: onnx.ModelProto, batches: list[dict], layers: list[FCLayer], method: str = "minmax",
             reduce_range: bool = False) -> onnx.ModelProto:
    """onnxruntime's static QDQ quantization of exactly these FC layers (and the Relu each one feeds)."""
    from onnxruntime.quantization import CalibrationDataReader, CalibrationMethod, QuantFormat, QuantType, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self):
            self._it = iter(batches)

        def get_next(self):
            return next(self._it, None)

    nodes = [x.node for x in layers] + [x.act for x in layers if x.act]
    calibrate = {"minmax": CalibrationMethod.MinMax, "percentile": CalibrationMethod.Percentile,
                 "entropy": CalibrationMethod.Entropy}[method]
    with tempfile.TemporaryDirectory(prefix="ctropt-int8-") as tmp:
        src, out = os.path.join(tmp, "fp32.onnx"), os.path.join(tmp, "int8.onnx")
        # a path, not the proto: quantize_static moves a proto's weights to external data. Tensors the running
        # optimization keeps in its weight store are references into the store's folder: written beside src
        store = weights.active()
        if store is not None and weights.stored(model):
            store.save(model, Path(src))
        else:
            onnx.save(model, src)
        with _quiet():
            quantize_static(src, out, Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                            reduce_range=reduce_range, activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                            nodes_to_quantize=nodes, op_types_to_quantize=["Gemm", "MatMul", "Relu"],
                            calibrate_method=calibrate,
                            extra_options={"WeightSymmetric": True, "ActivationSymmetric": False,
                                           "MatMulConstBOnly": True, "CalibPercentile": 99.999})
        quantized = onnx.load(out)
    # quantize_static's shape inference resolves the export's symbolic dims (the legacy torch exporter's
    # `Sigmoidy_dim_1` becomes 1): the interface stays the input model's, as the pass manager checks it
    declared = {v.name: v for v in list(model.graph.input) + list(model.graph.output)}
    for v in list(quantized.graph.input) + list(quantized.graph.output):
        if v.name in declared:
            v.CopyFrom(declared[v.name])
    return quantized


@contextlib.contextmanager
def _quiet():
    """onnxruntime's quantizer logs advice on the root logger and prints calibration progress."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        root.setLevel(level)


def _layer_model(model: onnx.ModelProto, layer: FCLayer) -> onnx.ModelProto:
    """The FC layer alone (with its Relu): x → Gemm/MatMul → (Relu) → y (its weights inline)."""
    graph = to_graph(model)   # a weight in the store: read from it (gs.import_onnx would look beside the cwd)
    nodes = {n.name: n for n in graph.nodes}
    node = nodes[layer.node]
    x = gs.Variable("x", dtype=np.float32, shape=[None, layer.k])
    inputs = [x] + [gs.Constant(f"c{i}", const_value(t)) for i, t in enumerate(node.inputs[1:], 1) if t.name]
    y = gs.Variable("y", dtype=np.float32)
    mid = gs.Variable("z", dtype=np.float32) if layer.act else y
    new = [gs.Node(node.op, layer.node, dict(node.attrs), inputs=inputs, outputs=[mid])]
    if layer.act:
        new.append(gs.Node("Relu", layer.act, inputs=[mid], outputs=[y]))
    small = gs.Graph(nodes=new, inputs=[x], outputs=[y], opset=graph.opset)
    return onnx.helper.make_model(gs.export_onnx(small).graph, ir_version=8,
                                  opset_imports=[onnx.helper.make_opsetid("", max(13, graph.opset))])


def measure_speedups(model: onnx.ModelProto, layers: list[FCLayer], feeds: dict, backend: str,
                     seconds: float, reduce_range: bool = False) -> None:
    """Each layer alone on its real input, FP32 vs INT8 interleaved: sets `layer.speedup`."""
    values = all_values(model, feeds)
    for layer in layers:
        x = values[layer.x].reshape(-1, layer.k).astype(np.float32)
        fp32 = _layer_model(model, layer)
        int8 = quantize(fp32, [{"x": x}], [FCLayer(layer.node, layer.op, layer.k, layer.n, "x", layer.act)],
                        reduce_range=reduce_range)
        runners = [Runner(fp32, backend, threads=1), Runner(int8, backend, threads=1)]
        layer.speedup = bench(runners, {"x": x}, len(x), seconds=seconds, min_runs=5).ratio


# ----------------------------------------------------------------------------------------- accuracy


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve (Mann-Whitney, ties shared)."""
    labels, scores = labels.ravel() > 0.5, scores.ravel().astype(np.float64)
    pos, neg = labels.sum(), (~labels).sum()
    if not pos or not neg:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores))
    sorted_scores = scores[order]
    first = np.r_[True, sorted_scores[1:] != sorted_scores[:-1]]
    group = np.cumsum(first) - 1
    starts = np.flatnonzero(first)
    ends = np.r_[starts[1:], len(scores)]
    ranks[order] = ((starts + ends + 1) / 2.0)[group]
    return float((ranks[labels].sum() - pos * (pos + 1) / 2) / (pos * neg))


def logloss(labels: np.ndarray, p: np.ndarray) -> float:
    p = np.clip(p.ravel().astype(np.float64), 1e-7, 1 - 1e-7)
    y = labels.ravel().astype(np.float64)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))


@dataclasses.dataclass
class Gate:
    """The accuracy gate: a mean-based bound (`threshold`, relative) and a worst-row bound (`max_abs`: absolute
    for a probability output, times max(1, max |output|) for any other float output)."""

    threshold: float = 0.005
    max_abs: float = 0.01


def accuracy_report(ref: list[dict], new: list[dict], labels: dict[str, np.ndarray], gate: Gate) -> dict[str, dict]:
    """Per float output: max/mean abs error, relative mean error; AUC and logloss drift given labels; `excess`:
    the larger of the two gate terms as a fraction of its bound (> 1 fails)."""
    report = {}
    for name in ref[0]:
        if not np.issubdtype(ref[0][name].dtype, np.floating):
            continue
        a = np.concatenate([r[name].reshape(len(r[name]), -1) for r in ref]).astype(np.float64)
        b = np.concatenate([r[name].reshape(len(r[name]), -1) for r in new]).astype(np.float64)
        err = np.abs(a - b)
        row = {"max_abs": float(err.max(initial=0.0)), "mean_abs": float(err.mean()) if err.size else 0.0}
        row["rel_mean"] = row["mean_abs"] / max(float(np.abs(a).mean()), 1e-12) if a.size else 0.0
        row["gate"] = row["rel_mean"]
        y = labels.get(name, labels.get(""))
        probability = bool(a.size and a.min() >= 0 and a.max() <= 1)
        if y is not None and probability and y.shape[0] == a.shape[0] and y.shape[1] in (1, a.shape[1]):
            y = np.broadcast_to(y, a.shape)
            row["auc_fp32"], row["auc_int8"] = auc(y, a), auc(y, b)
            row["logloss_fp32"], row["logloss_int8"] = logloss(y, a), logloss(y, b)
            row["auc_drop"] = (row["auc_fp32"] - row["auc_int8"]) / row["auc_fp32"]
            row["logloss_rise"] = (row["logloss_int8"] - row["logloss_fp32"]) / row["logloss_fp32"]
            row["gate"] = max(row["auc_drop"], row["logloss_rise"], 0.0)
        row["max_bound"] = gate.max_abs * (1.0 if probability else max(1.0, float(np.abs(a).max(initial=0.0))))
        row["excess"] = max(row["gate"] / gate.threshold if gate.threshold > 0 else 0.0,
                            row["max_abs"] / row["max_bound"] if row["max_bound"] > 0 else 0.0)
        report[name] = row
    return report


def _worst(report: dict) -> float:
    """The largest gate excess over the outputs (> 1: the gate refuses)."""
    return max((r["excess"] for r in report.values()), default=0.0)


def _gate_failure(report: dict, gate: Gate) -> str:
    """Which bound the worst output breaks, in words."""
    name, row = max(report.items(), key=lambda kv: kv[1]["excess"])
    if row["max_abs"] > row["max_bound"]:
        return f"{name}: max abs err {row['max_abs']:.4g} > {row['max_bound']:.4g}"
    return f"{name}: {row['gate']:.4%} > {gate.threshold:.2%}"


def _run_all(model: onnx.ModelProto, batches: list[dict]) -> list[dict]:
    runner = Runner(model, "ort-cpu", threads=1)
    return [runner.run(b) for b in batches]


# ----------------------------------------------------------------------------------------- the pass


@register_pass("quantize-int8", group="quantize", default=False, exact=False, devices=("cpu",))
def quantize_int8(ctx: PassContext) -> None:
    """FC layers → INT8 (QDQ, calibrated), where measured faster and within the accuracy gate (opt-in: --int8)."""
    opt = ctx.options
    method = str(opt.get("calibrator", "minmax")).lower()
    if method not in CALIBRATORS:
        raise CtroptError(f"unknown calibrator {method!r}; choose one of {', '.join(CALIBRATORS)}")
    gate = Gate(float(opt.get("int8_threshold", 0.005)), float(opt.get("int8_max_abs", 0.01)))
    batch = int(opt.get("int8_batch", 256))
    seconds = float(opt.get("int8_bench_seconds", 1.0))
    min_speedup = float(opt.get("int8_min_speedup", 1.05))  # 0: no speed gate, every FC layer is a candidate
    reduce_range = str(opt.get("int8_reduce_range", "auto")).lower()
    reduce_range = not cpu_has_vnni() if reduce_range == "auto" else reduce_range in ("1", "true", "yes")
    model = runnable_model(ctx.graph)
    if ctx.input_facts:  # inputs generated for it stay in the raw model's id ranges (fused tables hide them)
        store_input_facts(model, ctx.input_facts)
    opset = max(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    if opset < 13:
        ctx.note(f"opset {opset}: per-channel QuantizeLinear needs opset 13 or newer; re-export with a newer opset")
        return
    layers = fc_layers(ctx.graph)
    ctx.matches = len(layers)
    if not layers:
        ctx.note("no FC layer (Gemm/MatMul with a constant 2-D float32 weight) in the main graph")
        return
    batches, labels, source = _calibration(model, ctx)
    if opt.get("int8_eval") is not None:
        eval_batches, eval_labels = split_data(model, opt["int8_eval"])
        ctx.note(f"calibrated on {source}; accuracy on the evaluation data")
    else:
        eval_batches, eval_labels = batches, labels
        ctx.note(f"calibrated on {source}; accuracy on the same data (pass int8_eval=data.npz to hold some out)")

    backend = BACKEND_OF_TARGET[ctx.target]
    if min_speedup > 0:
        measure_speedups(model, layers, generate_inputs(model, batch=batch, seed=7), backend, seconds, reduce_range)
    chosen = [x for x in layers if min_speedup <= 0 or x.speedup >= min_speedup]
    reference = _run_all(model, eval_batches)

    result = report = None
    while chosen:
        candidate = quantize(model, batches, chosen, method, reduce_range)
        report = accuracy_report(reference, _run_all(candidate, eval_batches), eval_labels, gate)
        if _worst(report) <= 1.0:
            result = candidate
            break
        for layer in chosen:  # which layer costs most accuracy on its own
            if layer.error is None:
                alone = quantize(model, batches, [layer], method, reduce_range)
                layer.error = _worst(accuracy_report(reference, _run_all(alone, eval_batches), eval_labels, gate))
        worst = max(chosen, key=lambda x: x.error)
        ctx.note(f"accuracy gate: {_gate_failure(report, gate)}; {worst.node} back to FP32 "
                 f"(alone it uses {worst.error:.0%} of the gate)")
        chosen.remove(worst)

    for layer in layers:
        kept = any(layer is c for c in chosen) and result is not None
        ctx.note(f"{layer.node}: {layer.op} {layer.k}→{layer.n}"
                 + ("+Relu" if layer.act else "")
                 + (f", INT8 {layer.speedup:.2f}× alone on {backend} at batch {batch}" if layer.speedup else "")
                 + (" → INT8" if kept else " → stays FP32"))
    if result is None:
        ctx.note("no layer is both faster in INT8 and within the accuracy gate: the model stays FP32")
        return
    for name, row in report.items():
        ctx.note(f"accuracy {name}: max abs err {row['max_abs']:.3g}, mean {row['mean_abs']:.3g} "
                 f"({row['rel_mean']:.3%} of mean |output|)"
                 + (f", AUC {row['auc_fp32']:.5f} → {row['auc_int8']:.5f}, logloss {row['logloss_fp32']:.5f} → "
                    f"{row['logloss_int8']:.5f}" if "auc_fp32" in row else "")
                 + f"; gate {row['gate']:.4%} ≤ {gate.threshold:.2%}, max ≤ {row['max_bound']:.3g}")
    _replace_graph(ctx.graph, result)
    ctx.rewrites = len(chosen)


def _replace_graph(graph: gs.Graph, model: onnx.ModelProto) -> None:
    """Make `graph` the quantized model's main graph (same interface; the quantizer keeps input/output names)."""
    new = gs.import_onnx(model)
    graph.nodes, graph.inputs, graph.outputs = new.nodes, new.inputs, new.outputs
    graph.opset = max(int(graph.opset or 13), new.opset)
    graph.__dict__.pop("_ctropt_names", None)
