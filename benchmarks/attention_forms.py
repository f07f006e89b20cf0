"""Which form of multi-head attention onnxruntime runs fastest on CPU: the decomposed graph exporters write
(MatMul, Transpose, Softmax), onnxruntime's com.microsoft MultiHeadAttention and Attention, the ONNX Attention op
(opset 23), and what ctropt's `attention-core-kernel` makes of the decomposed graph (its AttentionCore kernel).

    python benchmarks/attention_forms.py                       # BST/TransAct/SASRec-like shapes, batch 256, 1 thread
    python benchmarks/attention_forms.py --shapes 256x21x24x2  # batch x length x width x heads

Each form computes self-attention over x [B, L, D]: one projection to Q, K, V, heads split, scores scaled, an
additive mask (key padding at ~55 % fill and causal), softmax, · V, heads merged. Every form is checked against the
decomposed one, then all run interleaved in rounds: each cell is the median over rounds of time(decomposed) /
time(form). Prints a markdown table (its last: `git show 8b89a5f:benchmarks/RESULTS.md`, "Attention forms on
onnxruntime").
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import ctropt  # noqa: E402
from ctropt import kernels  # noqa: E402

SHAPES = ("256x21x24x2", "256x51x32x4", "256x21x64x2", "256x9x16x2")


def _model(form: str, B: int, L: int, D: int, heads: int, weights: tuple) -> bytes:
    dh = D // heads
    w, b = numpy_helper.from_array(weights[0], "W"), numpy_helper.from_array(weights[1], "b")
    c = lambda name, v: numpy_helper.from_array(np.asarray(v), name)  # noqa: E731
    inits = [w, b, c("s5", np.array([B, L, 3, heads, dh], np.int64)), c("s3", np.array([B, L, D], np.int64)),
             c("ax0", np.array([0], np.int64)), c("scale", np.array(dh ** -0.5, np.float32))]
    n = helper.make_node
    project = [n("MatMul", ["x", "W"], ["p"]), n("Add", ["p", "b"], ["pb"])]
    heads_split = project + [n("Reshape", ["pb", "s5"], ["r"]), n("Transpose", ["r"], ["t"], perm=[2, 0, 3, 1, 4]),
                             n("Split", ["t"], ["q0", "k0", "v0"], axis=0, num_outputs=3)] + \
        [n("Squeeze", [f"{x}0", "ax0"], [x]) for x in "qkv"]
    merge = [n("Transpose", ["o"], ["ot"], perm=[0, 2, 1, 3]), n("Reshape", ["ot", "s3"], ["y"])]
    domains = [helper.make_opsetid("", 23 if form == "onnx-attention-23" else 21)]
    if form in ("decomposed", "ctropt-AttentionCore"):
        nodes = heads_split + [n("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]), n("MatMul", ["q", "kt"], ["s"]),
                               n("Mul", ["s", "scale"], ["ss"]), n("Add", ["ss", "bias"], ["sb"]),
                               n("Softmax", ["sb"], ["a"], axis=-1), n("MatMul", ["a", "v"], ["o"])] + merge
    elif form == "com.microsoft-MultiHeadAttention":
        nodes = [n("MatMul", ["x", "W"], ["p"]), n("Split", ["p"], ["q", "k", "v"], axis=2, num_outputs=3),
                 n("MultiHeadAttention", ["q", "k", "v", "b", "", "bias"], ["y"], domain="com.microsoft",
                   num_heads=heads)]
        domains.append(helper.make_opsetid("com.microsoft", 1))
    elif form == "com.microsoft-Attention":
        nodes = [n("Attention", ["x", "W", "b", "", "", "bias"], ["y"], domain="com.microsoft", num_heads=heads)]
        domains.append(helper.make_opsetid("com.microsoft", 1))
    else:  # the ONNX Attention op, 3-D inputs
        nodes = project + [n("Split", ["pb"], ["q", "k", "v"], axis=2, num_outputs=3),
                           n("Attention", ["q", "k", "v", "bias"], ["y"], q_num_heads=heads, kv_num_heads=heads)]
    used = {i for nd in nodes for i in nd.input}
    graph = helper.make_graph(nodes, "attention", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [B, L, D]),
                                            helper.make_tensor_value_info("bias", TensorProto.FLOAT, [B, 1, L, L])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [B, L, D])],
                              [i for i in inits if i.name in used])
    model = helper.make_model(graph, opset_imports=domains)
    if form == "ctropt-AttentionCore":   # what the pass makes of the decomposed graph
        model = ctropt.optimize(model, passes=["attention-core-kernel"], target="ort", speed=False).model
    return model.SerializeToString()


FORMS = ("decomposed", "com.microsoft-MultiHeadAttention", "com.microsoft-Attention", "onnx-attention-23",
         "ctropt-AttentionCore")


def measure(shape: str, rounds: int, threads: int) -> dict:
    B, L, D, heads = (int(v) for v in shape.split("x"))
    rng = np.random.default_rng(0)
    weights = (rng.normal(0, 0.3, (D, 3 * D)).astype(np.float32), rng.normal(0, 0.1, 3 * D).astype(np.float32))
    x = rng.normal(0, 1, (B, L, D)).astype(np.float32)
    lens = np.clip(rng.normal(0.55 * L, 0.2 * L, B).round(), 1, L).astype(int)
    allowed = (np.arange(L)[None, None] < lens[:, None, None]) & np.tril(np.ones((L, L), bool))[None]
    feeds = {"x": x, "bias": np.where(allowed, 0, -1e9).astype(np.float32)[:, None]}
    sessions = {}
    for form in FORMS:
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.log_severity_level = 3
        if form == "ctropt-AttentionCore":
            kernels.register(so)
        sessions[form] = ort.InferenceSession(_model(form, B, L, D, heads, weights), so, providers=["CPUExecutionProvider"])
    want = sessions["decomposed"].run(None, feeds)[0]
    errors = {f: float(np.abs(s.run(None, feeds)[0] - want).max()) for f, s in sessions.items()}
    times = {f: [] for f in FORMS}
    for _ in range(rounds):
        for form, s in sessions.items():
            t0 = time.perf_counter()
            s.run(None, feeds)
            times[form].append(time.perf_counter() - t0)
    base = np.array(times["decomposed"])
    return {f: (float(np.median(base / np.array(t))), errors[f]) for f, t in times.items() if f != "decomposed"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help="batch x length x width x heads, comma separated")
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    if kernels.ensure():
        sys.exit(f"ctropt's kernel library cannot be built here: {kernels.ensure()}")
    print("| B×L×D×heads | " + " | ".join(FORMS[1:]) + " |")
    print("|---|" + "---|" * (len(FORMS) - 1))
    for shape in args.shapes.split(","):
        r = measure(shape, args.rounds, args.threads)
        print(f"| {shape} | " + " | ".join(f"{r[f][0]:.2f}× (err {r[f][1]:.0e})" for f in FORMS[1:]) + " |")


if __name__ == "__main__":
    main()
