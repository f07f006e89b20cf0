"""onnxruntime's CPU ReduceSum over a middle axis, batched MatMul of small matrices, Gather of rows (at offset ids
too), Unique of rows, a residual Sum + LayerNormalization, a cross layer's Mul and Adds, a logit's width-1 Gemms, FM's
second order and a mixture of experts' mix against ctropt's SumAxes, SmallMatMul, GatherRows, UniqueRows, LayerNorm,
MulAdd, DotSum, FMInteraction and GatedSum kernels, and a dot product with a constant vector against the MatMul
weighted-sum-as-matmul makes of it, at the shapes the corpus's exports hold.

    python benchmarks/small_ops.py            # batch 256, 1 thread

Each case is one node in a session of its own; both are checked equal (to float rounding), then run interleaved:
each row is the median of time(onnxruntime) / time(kernel) over the rounds, with both medians (a session.run of
one node: about 6 µs of it is the call itself). Prints a markdown table (its last: `git show
8b89a5f:benchmarks/RESULTS.md`, "Small ops as kernels").
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
from ctropt import kernels  # noqa: E402

RNG = np.random.default_rng(0)
# (what, the export it comes from, shapes)
SUMS = [("[256, 50, 8] over axis 1", "FuxiCTR: a history summed", (256, 50, 8)),
        ("[256, 5, 8] over axis 1", "deepctr(-torch) FM: fields summed", (256, 5, 8)),
        ("[256, 39, 8] over axis 1", "PaddleRec DeepFM FM", (256, 39, 8)),
        ("[256, 26, 1] over axis 1", "PaddleRec DeepFM first order", (256, 26, 1))]
PRODUCTS = [("[256, 1, 3] × [256, 3, 16]", "FuxiCTR MMoE gate", (256, 1, 3), (256, 3, 16)),
            ("[256, 2, 1, 8] × [2, 8, 8]", "FuxiCTR FinalMLP bilinear head", (256, 2, 1, 8), (2, 8, 8)),
            ("[256, 42, 1] × [256, 1, 1]", "deepctr DCN cross", (256, 42, 1), (256, 1, 1)),
            ("[256, 1, 50] × [256, 50, 16]", "DIN-style weighted sum", (256, 1, 50), (256, 50, 16)),
            ("[256, 8, 16] × [256, 16, 8]", "2048 multiply-adds (the limit)", (256, 8, 16), (256, 16, 8)),
            ("[256, 27, 16] × [256, 16, 27]", "DLRM interaction (left to sgemm)", (256, 27, 16), (256, 16, 27))]
LOOKUPS = [("[1000, 8] at [256, 26]", "PaddleRec DeepFM embeddings", (1000, 8), (256, 26)),
           ("[1000, 1] at [256, 26]", "PaddleRec DeepFM first-order weights", (1000, 1), (256, 26)),
           ("[100000, 16] at [256, 26]", "a larger table", (100000, 16), (256, 26)),
           ("[500, 8] at [256, 50]", "FuxiCTR history", (500, 8), (256, 50))]
UNIQUES = [("[256, 103], one user", "dedup key: 3 ids and two histories of 50", (256, 103), 1),
           ("[256, 103], 20 users", "the same, 20 users in the batch", (256, 103), 20),
           ("[256, 103], all distinct", "the same, every row its own user", (256, 103), 256),
           ("[256, 50], all distinct", "DIEN's history rows", (256, 50), 256)]
CROSS = [("[256, 221]: x0 · s + b + x", "PaddleRec DCN cross layer", 221, (256, 1)),
         ("[256, 72]: x0 ⊙ h + x", "FuxiCTR DCNv2 cross layer", 72, None)]
DOTS = [("[256, 16] · [16]", "a narrow dot", 16), ("[256, 221] · [221]", "PaddleRec DCN's x·w", 221)]
HEADS = [("[256, 16]·w + [256, 5]·1 + [256, 2]·w + b, Sigmoid", "deepctr WDL's logit (sum-into-gemm's chain)", [16, 5, 2]),
         ("[256, 221] · [221, 1]", "PaddleRec DCN's x·w (no Sigmoid)", [221])]
FMS = [("[256, 5, 8]", "deepctr(-torch) DeepFM", (256, 5, 8)), ("[256, 39, 8]", "PaddleRec DeepFM", (256, 39, 8))]
MIXES = [("3 experts [256, 16], gate [256, 16]·[16, 3]", "deepctr-torch MMoE task", 3, 16, 16),
         ("8 experts [256, 32], gate [256, 64]·[64, 8]", "a wider MMoE", 8, 32, 64)]
NORMS = [("[256, 21, 32]", "FuxiCTR BST block", (256, 21, 32)),
         ("[256, 20, 64]", "RecBole SASRec block", (256, 20, 64)),
         ("[256, 20, 40]", "a width of no 8·N up to 64 (row buffer)", (256, 20, 40))]


def _session(node, inputs: dict, consts: dict) -> ort.InferenceSession:
    nodes = node if isinstance(node, list) else [node]
    node = nodes[-1]
    outs = [helper.make_tensor_value_info(o, TensorProto.FLOAT if node.op_type not in ("Unique", "UniqueRows") else
                                          TensorProto.INT64, None) for o in node.output]
    graph = helper.make_graph(nodes, "op", [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), None)
                                             for k, v in inputs.items()],
                              outs,
                              [numpy_helper.from_array(v, k) for k, v in consts.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(kernels.DOMAIN, 1)])
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    kernels.register(so)
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _pair(std, kernel, feeds: dict, seconds: float) -> tuple[float, float, float]:
    for a, b in zip(std.run(None, feeds), kernel.run(None, feeds)):
        assert a.shape == b.shape and np.allclose(a, b, rtol=1e-4, atol=1e-4), "the kernel differs"
    ta, tb, end = [], [], time.perf_counter() + seconds
    while time.perf_counter() < end or len(ta) < 50:
        t0 = time.perf_counter()
        std.run(None, feeds)
        t1 = time.perf_counter()
        kernel.run(None, feeds)
        ta.append(t1 - t0)
        tb.append(time.perf_counter() - t1)
    ratio = np.median(np.array(ta) / np.array(tb))
    return float(np.median(ta) * 1e6), float(np.median(tb) * 1e6), float(ratio)


def cases():
    n = helper.make_node
    for what, where, shape in SUMS:
        x = {"x": RNG.standard_normal(shape).astype(np.float32)}
        yield ("ReduceSum " + what, where, _session(n("ReduceSum", ["x", "ax"], ["y"], keepdims=0), x, {"ax": np.array([1])}),
               _session(n("SumAxes", ["x"], ["y"], domain=kernels.DOMAIN, axis=1, count=1, keepdims=0), x, {}), x)
    for what, where, sa, sb in PRODUCTS:
        f = {"a": RNG.standard_normal(sa).astype(np.float32), "b": RNG.standard_normal(sb).astype(np.float32)}
        yield ("MatMul " + what, where, _session(n("MatMul", ["a", "b"], ["y"]), f, {}),
               _session(n("SmallMatMul", ["a", "b"], ["y"], domain=kernels.DOMAIN), f, {}), f)
    for what, where, table, ids in LOOKUPS:
        t, f = {"t": RNG.standard_normal(table).astype(np.float32)}, {"i": RNG.integers(0, table[0], ids)}
        yield ("Gather " + what, where, _session(n("Gather", ["t", "i"], ["y"]), f, t),
               _session(n("GatherRows", ["t", "i"], ["y"], domain=kernels.DOMAIN), f, t), f)
    outs = ["y", "first", "inverse", "counts"]
    for what, where, shape, users in UNIQUES:
        f = {"x": RNG.integers(0, 1000, shape)[RNG.integers(0, users, shape[0])]}
        yield ("Unique " + what, where, _session(n("Unique", ["x"], outs, axis=0, sorted=0), f, {}),
               _session(n("UniqueRows", ["x"], outs, domain=kernels.DOMAIN), f, {}), f)
    for what, where, table, ids in LOOKUPS[:1]:   # fuse-parallel-embeddings' per-field offsets, Expanded and added
        t = {"t": RNG.standard_normal(table).astype(np.float32), "off": np.arange(ids[1]) * (table[0] // ids[1])}
        f = {"i": RNG.integers(0, table[0] // ids[1], ids)}
        yield ("Gather " + what + " + offsets", where,
               _session([n("Shape", ["i"], ["s"]), n("Expand", ["off", "s"], ["o"]), n("Add", ["i", "o"], ["at"]),
                         n("Gather", ["t", "at"], ["y"])], f, t),
               _session(n("GatherRows", ["t", "i", "off"], ["y"], domain=kernels.DOMAIN), f, t), f)
    for what, where, width, per_row in CROSS:
        f = {k: RNG.standard_normal((256, width)).astype(np.float32) for k in ("x0", "x")}
        f["h"] = RNG.standard_normal(per_row or (256, width)).astype(np.float32)
        b = {"b": RNG.standard_normal(width).astype(np.float32)} if per_row else {}
        std = [n("Mul", ["x0", "h"], ["p"])] + ([n("Add", ["p", "b"], ["q"])] if b else []) + \
            [n("Add", ["q" if b else "p", "x"], ["y"])]
        yield ("Mul + Add" + (" + Add " if b else " ") + what, where, _session(std, f, b),
               _session(n("MulAdd", ["x0", "h"] + (["b"] if b else []) + ["x"], ["y"], domain=kernels.DOMAIN), f, b), f)
    for what, where, width in DOTS:
        f, w = {"x": RNG.standard_normal((256, width)).astype(np.float32)}, RNG.standard_normal(width).astype(np.float32)
        yield ("Mul + ReduceSum " + what + " (kernel: MatMul)", where,
               _session([n("Mul", ["x", "w"], ["p"]), n("ReduceSum", ["p", "ax"], ["y"])], f,
                        {"w": w, "ax": np.array([-1])}),
               _session(n("MatMul", ["x", "w"], ["y"]), f, {"w": w.reshape(-1, 1)}), f)
    yield from head_cases()
    for what, where, shape in NORMS:
        f = {k: RNG.standard_normal(shape).astype(np.float32) for k in "ab"}
        w = {"g": RNG.standard_normal(shape[-1]).astype(np.float32), "c": RNG.standard_normal(shape[-1]).astype(np.float32)}
        yield ("Sum + LayerNormalization " + what, where,
               _session([n("Sum", ["a", "b"], ["s"]), n("LayerNormalization", ["s", "g", "c"], ["y"], axis=-1)], f, w),
               _session(n("LayerNorm", ["a", "g", "c", "b"], ["y"], domain=kernels.DOMAIN, epsilon=1e-5), f, w), f)


def head_cases():
    """A logit's width-1 GEMMs and Sigmoid, FM's second order and a mixture of experts' mix, as the exporters write
    them, against DotSum, FMInteraction and GatedSum."""
    n = helper.make_node
    for what, where, widths in HEADS:
        f = {f"x{i}": RNG.standard_normal((256, k)).astype(np.float32) for i, k in enumerate(widths)}
        w = {f"w{i}": RNG.standard_normal((k, 1)).astype(np.float32) for i, k in enumerate(widths)}
        c = {"b": np.array([0.1], np.float32)}
        std, prev = [], "b"
        for i in range(len(widths)):
            std.append(n("Gemm", [f"x{i}", f"w{i}", prev], [f"g{i}"]))
            prev = f"g{i}"
        sig = len(widths) > 1
        std = std + [n("Sigmoid", [prev], ["y"])] if sig else [n("MatMul", ["x0", "w0"], ["y"])]
        flat = {k: v.ravel() for k, v in w.items()}
        kernel = n("DotSum", ["b"] + [a for i in range(len(widths)) for a in (f"x{i}", f"w{i}")], ["y"],
                   domain=kernels.DOMAIN, sigmoid=int(sig))
        yield (("Gemm chain + Sigmoid " if sig else "MatMul ") + what, where, _session(std, f, w | c),
               _session(kernel, f, flat | (c if sig else {"b": np.zeros(1, np.float32)})), f)
    for what, where, shape in FMS:
        f = {"e": RNG.standard_normal(shape).astype(np.float32)}
        c = {"ax": np.array([1]), "last": np.array([-1]), "half": np.array(0.5, np.float32)}
        std = [n("ReduceSum", ["e", "ax"], ["s"]), n("Mul", ["s", "s"], ["s2"]), n("Mul", ["e", "e"], ["e2"]),
               n("ReduceSum", ["e2", "ax"], ["q"]), n("Sub", ["s2", "q"], ["d"]),
               n("ReduceSum", ["d", "last"], ["r"], keepdims=0), n("Mul", ["r", "half"], ["y"])]
        yield ("FM second order " + what, where, _session(std, f, c),
               _session(n("FMInteraction", ["e"], ["y"], domain=kernels.DOMAIN, keepdims=1, reduce=1, scale=0.5), f, {}), f)
    for what, where, experts, d, hidden in MIXES:
        f = {"h": RNG.standard_normal((256, hidden)).astype(np.float32)} | \
            {f"x{e}": RNG.standard_normal((256, d)).astype(np.float32) for e in range(experts)}
        c = {"W": RNG.standard_normal((hidden, experts)).astype(np.float32), "ax": np.array([1])}
        xs = [f"x{e}" for e in range(experts)]
        std = [n("MatMul", ["h", "W"], ["l"]), n("Softmax", ["l"], ["g"], axis=-1), n("Unsqueeze", ["g", "ax"], ["row"])]
        std += [n("Unsqueeze", [x, "ax"], [f"u{x}"]) for x in xs] + [n("Concat", [f"u{x}" for x in xs], ["st"], axis=1),
                                                                   n("MatMul", ["row", "st"], ["m"]), n("Squeeze", ["m", "ax"], ["y"])]
        kernel = n("GatedSum", ["h", "W", "b"] + xs, ["y"], domain=kernels.DOMAIN, keepdims=0, softmax=1, project=1)
        yield ("MatMul + Softmax + stack + MatMul " + what, where, _session(std, f, c),
               _session(kernel, f, {"W": c["W"], "b": np.zeros(experts, np.float32)}), f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=1.0, help="time per case")
    args = ap.parse_args()
    problem = kernels.ensure()
    if problem:
        sys.exit(f"ctropt's kernel library is not available: {problem}")
    print("| op, shapes | where | onnxruntime µs | kernel µs | onnxruntime / kernel |")
    print("|---|---|---|---|---|")
    for what, where, std, kernel, feeds in cases():
        a, b, r = _pair(std, kernel, feeds, args.seconds)
        print(f"| {what} | {where} | {a:.1f} | {b:.1f} | {r:.2f}× |", flush=True)


if __name__ == "__main__":
    main()
