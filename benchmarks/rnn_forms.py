"""Which standard-ONNX form of a fused recurrent layer runs fastest: paired ratios in one run.

    python benchmarks/rnn_forms.py                      # B=1,32,64,128,256, T=100, H=I=36, 1 thread, onnxruntime
    python benchmarks/rnn_forms.py --batch 32 --seconds 3
    python benchmarks/rnn_forms.py --form kernel        # ctropt's GRUScan kernel (`ctropt kernels build` first)
    python benchmarks/rnn_forms.py --form kernel --against gru-op --batch 1,4,16,64

One ai.ctropt sequence node per kind is lowered by `lower_sequence_node` to each candidate form; every form
is timed interleaved against the lean Scan on the same inputs (history lengths uniform in 0..T); > 1 means the
form is slower than the Scan.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import onnx_graphsurgeon as gs

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ctropt.graph import to_model  # noqa: E402
from ctropt.ops.rnn import SequenceAttrs, add_sequence_node  # noqa: E402
from ctropt.passes.rnn.lower_ort import lower_sequence_node  # noqa: E402
from ctropt.runtime import Runner  # noqa: E402
from ctropt.runtime.bench import bench  # noqa: E402
from tests.helpers import make_model  # noqa: E402


def layer(kind: str, H: int, I: int, want_y: bool, form: str, lbr: int):
    rng = np.random.default_rng(0)
    g = gs.Graph(opset=17)
    X = gs.Variable("X", np.float32, ["batch", "T", I])
    L = gs.Variable("lens", np.int64, ["batch"])
    A = gs.Variable("att", np.float32, ["batch", "T"])
    g.inputs = [X, L] + ([A] if kind != "GRU" else [])
    ins = {"X": X, "W": gs.Constant("W", (rng.normal(size=(I, 3 * H)) * 0.2).astype(np.float32)),
           "R": gs.Constant("R", (rng.normal(size=(H, 3 * H)) * 0.2).astype(np.float32)),
           "B": gs.Constant("B", (rng.normal(size=6 * H) * 0.1).astype(np.float32)), "sequence_lens": L}
    if kind != "GRU":
        ins["att"] = A
    outs = {"Y_h": gs.Variable("Y_h", np.float32, ["batch", H])}
    if want_y:
        outs["Y"] = gs.Variable("Y", np.float32, ["batch", "T", H])
    node = add_sequence_node(g, SequenceAttrs(kind, H, lbr), ins, outs, "layer")
    lower_sequence_node(g, node, form)
    g.functions.clear()
    g.outputs = list(outs.values())
    g.cleanup()
    return to_model(g, make_model([], [], []))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="1,32,64,128,256")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--hidden", type=int, default=36)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--form", default="gru-op", choices=("gru-op", "kernel"), help="the form timed")
    ap.add_argument("--against", default="scan", choices=("scan", "gru-op"), help="the form it is timed against")
    args = ap.parse_args()
    rng = np.random.default_rng(1)
    T, H = args.steps, args.hidden
    print(f"T={T} H=I={H}, onnxruntime CPU, {args.threads} thread(s); cell = median time({args.form})/time({args.against}) "
          f"[p10-p90], lengths given; > 1: {args.against} is faster")
    for want_y in (False, True):
        for lbr in (0, 1):
            scan = Runner(layer("GRU", H, H, want_y, args.against, lbr), threads=args.threads)
            op = Runner(layer("GRU", H, H, want_y, args.form, lbr), threads=args.threads)
            cells = []
            for B in (int(b) for b in args.batch.split(",")):
                feeds = {"X": rng.normal(size=(B, T, H)).astype(np.float32),
                         "lens": rng.integers(0, T + 1, B).astype(np.int64)}
                r = bench([op, scan], feeds, B, seconds=args.seconds)
                cells.append(f"B={B}: {r.ratio:.2f} [{r.ratio_p10:.2f}-{r.ratio_p90:.2f}]")
            print(f"GRU {'Y+Y_h' if want_y else 'Y_h  '} lbr={lbr}: " + "; ".join(cells))


if __name__ == "__main__":
    main()
