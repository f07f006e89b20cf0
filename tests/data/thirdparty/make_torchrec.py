#!/usr/bin/env python
"""Build torchrec's DLRM (real torchrec.models.dlrm.DLRM + EmbeddingBagCollection),
export it to ONNX with the dynamo and the legacy (TorchScript) exporter, and check
the exports against torch with onnxruntime and OpenVINO.

Run with /work/venv-rec/bin/python make_torchrec.py [dynamo] [legacy] [legacy_scripted]
Outputs (in the directory of this script):
  torchrec_dlrm_<exporter>.onnx      the model (ir_version forced to 10 for onnxruntime 1.31)
  torchrec_dlrm_<exporter>.npz       sample inputs, batch 8 (keys = ONNX input names)
  torchrec_dlrm_<exporter>.ref.npz   torch outputs for that sample (keys = ONNX output names)
  results_<exporter>.json            op histograms, checks, latency, errors
No weights or data are downloaded: weights are seeded random, inputs synthetic.
"""
import collections
import json
import os
import sys
import time
import traceback
import warnings
from typing import List

import numpy as np
import torch

warnings.filterwarnings("ignore")
import logging

logging.getLogger().setLevel(logging.ERROR)

import fbgemm_gpu  # noqa: F401  (torchrec imports it too; loads torch.ops.fbgemm)
import torchrec
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.models.dlrm import DLRM

HERE = os.path.dirname(os.path.abspath(__file__))

# ---------------------------------------------------------------- model config
SEED = 0
ROWS = [100, 200, 300, 500, 800, 1000]  # 6 tables
EMB_DIM = 16
DENSE_IN = 13
BOTTOM = [64, EMB_DIM]  # dense_arch_layer_sizes (last must equal EMB_DIM)
TOP = [64, 32, 1]  # over_arch_layer_sizes
KEYS = [f"f{i}" for i in range(len(ROWS))]
F = len(ROWS)
MAX_BAG = 4  # bag lengths drawn from 0..MAX_BAG-1 -> some empty bags
INPUT_NAMES = ["dense", "values", "lengths"]
OUTPUT_NAMES = ["logits"]


def build_dlrm() -> torch.nn.Module:
    torch.manual_seed(SEED)
    tables = [
        EmbeddingBagConfig(
            name=f"t{i}",
            embedding_dim=EMB_DIM,
            num_embeddings=r,
            feature_names=[KEYS[i]],
        )
        for i, r in enumerate(ROWS)
    ]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
    # torchrec initialises the tables with uniform(-1/sqrt(n), 1/sqrt(n)) -- fine,
    # but make sure every parameter is deterministic from SEED.
    torch.manual_seed(SEED)
    model = DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=DENSE_IN,
        dense_arch_layer_sizes=BOTTOM,
        over_arch_layer_sizes=TOP,
    )
    g = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=g) * (1.0 / max(1, p.shape[-1]) ** 0.5))
    return model.eval()


class DLRMPlain(torch.nn.Module):
    """Plain-tensor front end: dense [B,13] f32, values [N] i64, lengths [F*B] i64
    (feature-major: lengths[f*B + b] = bag size of feature f for sample b).
    Builds the KeyedJaggedTensor inside and calls torchrec's DLRM."""

    def __init__(self, dlrm: torch.nn.Module):
        super().__init__()
        self.dlrm = dlrm
        self.keys: List[str] = list(KEYS)  # attribute (not a global) so torch.jit.script works

    def forward(self, dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor):
        kjt = KeyedJaggedTensor(keys=self.keys, values=values, lengths=lengths)
        return self.dlrm(dense_features=dense, sparse_features=kjt)


def make_batch(B: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(B, DENSE_IN, generator=g)
    lengths = torch.randint(0, MAX_BAG, (F * B,), generator=g)
    if B >= 2:  # make sure there are empty bags
        lengths[0] = 0
        lengths[F * B - 1] = 0
    vals = []
    for f in range(F):
        for b in range(B):
            n = int(lengths[f * B + b])
            vals.append(torch.randint(0, ROWS[f], (n,), generator=g))
    values = torch.cat(vals).to(torch.int64)
    return dense, values, lengths.to(torch.int64)


# ---------------------------------------------------------------- ONNX helpers
def op_histogram(model):
    """Histogram over all nodes, including subgraphs (Loop/If/Scan bodies)."""
    import onnx

    hist = collections.Counter()
    top = collections.Counter()

    def walk(graph, is_top):
        for n in graph.node:
            key = n.op_type if n.domain in ("", "ai.onnx") else f"{n.domain}::{n.op_type}"
            hist[key] += 1
            if is_top:
                top[key] += 1
            for a in n.attribute:
                if a.type == onnx.AttributeProto.GRAPH:
                    walk(a.g, False)
                elif a.type == onnx.AttributeProto.GRAPHS:
                    for sg in a.graphs:
                        walk(sg, False)

    walk(model.graph, True)
    return dict(sorted(hist.items(), key=lambda kv: (-kv[1], kv[0]))), dict(
        sorted(top.items(), key=lambda kv: (-kv[1], kv[0]))
    )


def torch_ref(w, batch):
    with torch.no_grad():
        return w(*batch).numpy()


def ort_session(path, threads=None):
    import onnxruntime as ort

    so = ort.SessionOptions()
    if threads:
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


def feeds_of(batch):
    return {n: t.numpy() for n, t in zip(INPUT_NAMES, batch)}


def check_exporter(name, w, export_fn, res):
    import onnx

    path = os.path.join(HERE, f"torchrec_dlrm_{name}.onnx")
    t0 = time.time()
    try:
        export_fn(path)
    except Exception as e:  # record the exact error
        res["export"] = "FAILED"
        res["export_error"] = f"{type(e).__name__}: {e}"[:4000]
        res["export_traceback_tail"] = traceback.format_exc()[-3000:]
        print(f"[{name}] export FAILED: {res['export_error'][:800]}")
        return
    res["export_seconds"] = round(time.time() - t0, 1)
    m = onnx.load(path)
    res["ir_version_written"] = m.ir_version
    m.ir_version = 10  # onnxruntime 1.31 accepts IR <= 13; onnx 1.23 writes 14
    onnx.save(m, path)
    res["export"] = "ok"
    res["opsets"] = {o.domain or "ai.onnx": o.version for o in m.opset_import}
    res["graph_inputs"] = [
        (i.name, [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim])
        for i in m.graph.input
    ]
    res["graph_outputs"] = [
        (o.name, [d.dim_param or d.dim_value for d in o.type.tensor_type.shape.dim])
        for o in m.graph.output
    ]
    hist, top = op_histogram(m)
    res["node_count_top_level"] = len(m.graph.node)
    res["node_count_total_incl_subgraphs"] = sum(hist.values())
    res["op_histogram_total"] = hist
    res["op_histogram_top_level"] = top
    res["file_bytes"] = os.path.getsize(path)
    try:
        onnx.checker.check_model(path, full_check=True)
        res["onnx_checker"] = "ok"
    except Exception as e:
        res["onnx_checker"] = f"{type(e).__name__}: {e}"[:1000]

    in_names = [i.name for i in m.graph.input]
    out_names = [o.name for o in m.graph.output]
    res["onnx_input_names"] = in_names
    res["onnx_output_names"] = out_names

    # sample batch 8 + torch reference
    sample = make_batch(8, seed=1234)
    ref = torch_ref(w, sample)
    np.savez(os.path.join(HERE, f"torchrec_dlrm_{name}.npz"),
             **{n: t.numpy() for n, t in zip(in_names, sample)})
    np.savez(os.path.join(HERE, f"torchrec_dlrm_{name}.ref.npz"), **{out_names[0]: ref})

    # onnxruntime
    ortres = {}
    try:
        sess = ort_session(path)
        for B, seed in [(8, 1234), (1, 11), (64, 64)]:
            batch = make_batch(B, seed)
            exp = torch_ref(w, batch)
            try:
                got = sess.run(None, {n: t.numpy() for n, t in zip(in_names, batch)})[0]
                ortres[f"batch{B}"] = {
                    "max_abs_err": float(np.max(np.abs(got - exp))) if got.shape == exp.shape else None,
                    "shape": list(got.shape),
                    "n_values": int(batch[1].numel()),
                    "n_empty_bags": int((batch[2] == 0).sum()),
                }
            except Exception as e:
                ortres[f"batch{B}"] = f"{type(e).__name__}: {e}"[:1500]
    except Exception as e:
        ortres["session"] = f"{type(e).__name__}: {e}"[:1500]
    res["onnxruntime"] = ortres
    print(f"[{name}] onnxruntime: {json.dumps(ortres)[:1500]}")

    # latency at the batch-8 sample (valid for every export, incl. the traced legacy one)
    try:
        sess1 = ort_session(path, threads=1)
        feeds = {n: t.numpy() for n, t in zip(in_names, sample)}
        for _ in range(3):
            sess1.run(None, feeds)
        ts = []
        for _ in range(30):
            t = time.perf_counter()
            sess1.run(None, feeds)
            ts.append((time.perf_counter() - t) * 1e3)
        res["ort_latency_b8_sample_1thread_ms_median"] = round(float(np.median(ts)), 3)
    except Exception as e:
        res["ort_latency_b8_error"] = f"{type(e).__name__}: {e}"[:1500]

    # latency, batch 256, 1 thread
    try:
        sess1 = ort_session(path, threads=1)
        batch = make_batch(256, 256)
        feeds = {n: t.numpy() for n, t in zip(in_names, batch)}
        for _ in range(3):
            sess1.run(None, feeds)
        ts = []
        for _ in range(30):
            t = time.perf_counter()
            sess1.run(None, feeds)
            ts.append((time.perf_counter() - t) * 1e3)
        res["ort_latency_b256_1thread_ms_median"] = round(float(np.median(ts)), 3)
        res["ort_latency_b256_1thread_ms_min"] = round(float(np.min(ts)), 3)
        # torch eager for comparison (1 thread)
        nt = torch.get_num_threads()
        torch.set_num_threads(1)
        with torch.no_grad():
            for _ in range(3):
                w(*batch)
            ts = []
            for _ in range(30):
                t = time.perf_counter()
                w(*batch)
                ts.append((time.perf_counter() - t) * 1e3)
        torch.set_num_threads(nt)
        res["torch_eager_latency_b256_1thread_ms_median"] = round(float(np.median(ts)), 3)
    except Exception as e:
        res["ort_latency_error"] = f"{type(e).__name__}: {e}"[:1500]

    # OpenVINO
    try:
        import openvino as ov

        core = ov.Core()
        cm = core.compile_model(path, "CPU")
        ovres = {"compile": "ok"}
        for B, seed in [(8, 1234), (1, 11), (64, 64)]:
            batch = make_batch(B, seed)
            exp = torch_ref(w, batch)
            try:
                out = cm({n: t.numpy() for n, t in zip(in_names, batch)})
                got = list(out.values())[0]
                ovres[f"batch{B}"] = {"max_abs_err": float(np.max(np.abs(got - exp)))}
            except Exception as e:
                ovres[f"batch{B}"] = {"infer": "FAILED", "error": f"{type(e).__name__}: {e}"[:2000]}
        res["openvino"] = ovres
    except Exception as e:
        res["openvino"] = {"compile": "FAILED", "error": f"{type(e).__name__}: {e}"[:2000]}
    print(f"[{name}] openvino: {json.dumps(res['openvino'])[:1500]}")


def main(which):
    import onnx
    import onnxruntime
    import onnxscript
    import openvino

    versions = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torchrec": getattr(torchrec, "__version__", None),
        "fbgemm_gpu": fbgemm_gpu.__version__,
        "onnx": onnx.__version__,
        "onnxscript": onnxscript.__version__,
        "onnxruntime": onnxruntime.__version__,
        "openvino": openvino.__version__,
        "numpy": np.__version__,
    }
    try:
        from importlib.metadata import version

        versions["torchrec"] = version("torchrec")
        versions["fbgemm_gpu_dist"] = version("fbgemm-gpu-cpu")
    except Exception:
        pass
    print(versions)

    w = DLRMPlain(build_dlrm()).eval()
    print(w)
    example = make_batch(8, seed=1234)
    print("torch out (batch 8):", torch_ref(w, example).ravel())

    batch = torch.export.Dim("batch", min=1, max=65536)
    nvals = torch.export.Dim("nvalues", min=0, max=1 << 24)
    dyn = {"dense": {0: batch}, "values": {0: nvals}, "lengths": {0: F * batch}}

    def export_dynamo(path):
        prog = torch.onnx.export(
            w, example, path, dynamo=True, opset_version=18,
            input_names=INPUT_NAMES, output_names=OUTPUT_NAMES,
            dynamic_shapes=dyn, external_data=False,
        )
        return prog

    def export_legacy(path):
        torch.onnx.export(
            w, example, path, dynamo=False, opset_version=18,
            input_names=INPUT_NAMES, output_names=OUTPUT_NAMES,
            dynamic_axes={"dense": {0: "batch"}, "values": {0: "nvalues"},
                          "lengths": {0: "F_x_batch"}, "logits": {0: "batch"}},
        )

    def export_legacy_scripted(path):
        # TorchScript exporter on torch.jit.script(model): keeps the KJT split
        # sizes data-dependent instead of baking them in like tracing does.
        sm = torch.jit.script(w)
        torch.onnx.export(
            sm, example, path, dynamo=False, opset_version=18,
            input_names=INPUT_NAMES, output_names=OUTPUT_NAMES,
            dynamic_axes={"dense": {0: "batch"}, "values": {0: "nvalues"},
                          "lengths": {0: "F_x_batch"}, "logits": {0: "batch"}},
        )

    fns = {"dynamo": export_dynamo, "legacy": export_legacy,
           "legacy_scripted": export_legacy_scripted}
    for name in which:
        res = {"versions": versions, "config": {
            "rows": ROWS, "emb_dim": EMB_DIM, "dense_in": DENSE_IN,
            "dense_arch_layer_sizes": BOTTOM, "over_arch_layer_sizes": TOP,
            "keys": KEYS, "lengths_layout": "feature-major [F*B]"}}
        check_exporter(name, w, fns[name], res)
        with open(os.path.join(HERE, f"results_{name}.json"), "w") as fh:
            json.dump(res, fh, indent=1)
        print(f"[{name}] summary:", json.dumps(
            {k: v for k, v in res.items() if k not in ("versions", "config", "export_traceback_tail")})[:3000])


if __name__ == "__main__":
    main(sys.argv[1:] or ["dynamo", "legacy", "legacy_scripted"])
