#!/usr/bin/env python
"""Export torch-rechub (datawhalechina/torch-rechub, pip torch-rechub==0.9.0, PyTorch) ranking models DIN and
DIEN to ONNX with both torch exporters and keep those that match torch-rechub's own eager outputs in ONNX Runtime.

Environment (a venv of its own, not ctropt's), e.g. /work/venvs/recbole (shared with make_recbole.py):
    pip install torch==2.13.0 torch-rechub==0.9.0 onnx onnxscript onnxruntime numpy
No third-party code lives in this repository; nothing is downloaded; all weights are random (seeded), data
synthetic.

Usage (from this directory):  python make_torch_rechub.py [DIN] [DIEN]
Outputs per kept export, in this directory:
    torch_rechub_<Model>_<legacy|dynamo>.onnx     legacy = dynamo=False, opset 17; dynamo = dynamo=True, opset 18;
                                                  ir_version clamped to <= 10; batch dim dynamic
    torch_rechub_<Model>_<legacy|dynamo>.npz      sample batch (B=33, one empty, one length-1, full histories),
                                                  keys = ONNX graph input names
    torch_rechub_<Model>_<legacy|dynamo>.ref.npz  torch-rechub eager outputs on it (unpatched library code)
An export is kept only if onnxruntime CPU matches eager within 1e-5 (abs) on three batches (B=8, B=5, B=33 with
other history-length mixes; where the history axis is dynamic, the B=33 batch has another padded length).

What was followed: torch_rechub/models/ranking/din.py and dien.py as shipped, built from torch-rechub Feature
objects the way its examples (examples/ranking/run_amazon_electronics.py) do: target features own the tables
(padding_idx=0), history (and DIEN's negative-history) SequenceFeatures use pooling="concat" and
shared_with=<target feature>. Export goes through torch-rechub's own ONNX path
(torch_rechub.utils.onnx_export.ONNXExporter: its ONNXWrapper maps positional inputs to the feature dict and drops
DIEN's aux-loss output; do_constant_folding=True; output name "output"; dynamic batch and per-feature history
length), with the exporter forced (onnx_export_kwargs={"dynamo": False/True}) and our sample batch as dummy input.
What differs, and why:
  * Weights: torch-rechub initialises embeddings N(0, 1e-4), which makes every output ~sigmoid(bias); for a
    sensitive check all embeddings are re-drawn N(0, 0.5) (padding row 0 kept zero), and BatchNorm running
    statistics are randomised (seeded) so eval-mode BN is not the identity.
  * DIN has no length/mask input: torch-rechub's ActivationUnit does not mask padding; padded positions have the
    zero padding embedding and contribute 0 to the weighted sum (its attention weight is not zero).
  * DIEN: the legacy export cannot go through ONNXExporter as is, because that marks the history length dynamic
    but the tracer unrolls AUGRU's Python loop over T (torch-rechub's AUGRU.forward: `for i in range(x.size(1))`):
    the export fails in onnxruntime at any other T. It is exported with ONNXExporter's own wrapper (ONNXWrapper)
    and settings, only the batch axis dynamic (T = 30 static). The traced graph also bakes in the Python branches
    `if has_hist.any()` (taken: the sample batch has histories; an all-empty batch would still run the packed GRU
    and AUGRU on zero rows) and `if nan_rows.any()` (not taken: all-padding rows are filtered out before AUGRU).
    Negative-history inputs only feed the aux loss, which the wrapper drops, so the export has no such inputs.
    The dynamo exporter refuses DIEN (torch.export: data-dependent `if has_hist.any()` in DIEN.forward); nothing
    is kept for it (error recorded below in the run output).
"""
import os
import sys
from collections import Counter, OrderedDict

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
OPSET, DYNAMO_OPSET = 17, 18
EMB = 8
T = 30          # padded history length of the export and of the B=8 / B=5 checks
T3 = 13         # padded history length of the B=33 check where the history axis is dynamic
TOL = 1e-5
VOCAB = {"user_id": 1000, "gender": 3, "target_item": 500, "target_cate": 100}
SEQS = [("hist_item", "target_item"), ("hist_cate", "target_cate")]


def features():
    from torch_rechub.basic.features import SequenceFeature, SparseFeature
    ctx = [SparseFeature("user_id", VOCAB["user_id"], EMB), SparseFeature("gender", VOCAB["gender"], EMB)]
    tgt = [SparseFeature(n, VOCAB[n], EMB, padding_idx=0) for n in ("target_item", "target_cate")]
    hist = [SequenceFeature(n, VOCAB[s], EMB, pooling="concat", shared_with=s, padding_idx=0) for n, s in SEQS]
    neg = [SequenceFeature("neg_" + n, VOCAB[s], EMB, pooling="concat", shared_with=s, padding_idx=0)
           for n, s in SEQS]
    return ctx, tgt, hist, neg


def make_model(name):
    import torch
    from torch_rechub.models.ranking import DIEN, DIN
    torch.manual_seed(0)
    ctx, tgt, hist, neg = features()
    if name == "DIN":
        model = DIN(ctx, hist, tgt, mlp_params={"dims": [32, 16]},
                    attention_mlp_params={"dims": [16], "activation": "dice", "use_softmax": False})
    else:
        model = DIEN(ctx, hist, neg, tgt, mlp_params={"dims": [32, 16]})
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Embedding):
                m.weight.copy_(torch.randn(m.weight.shape, generator=g) * 0.5)
                if m.padding_idx is not None:
                    m.weight[m.padding_idx].zero_()
            elif isinstance(m, torch.nn.BatchNorm1d):
                m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=g) * 0.1)
                m.running_var.copy_(torch.rand(m.running_var.shape, generator=g) + 0.5)
    return model.eval()


def gen_data(batch, t, lens, rng):
    """ids int64 [B] in 1..vocab-1; histories int64 [B, t], 0 past each row's length."""
    lens = np.asarray(lens)
    pad = np.arange(t)[None, :] >= lens[:, None]
    d = OrderedDict((n, rng.integers(1, v, size=batch).astype(np.int64)) for n, v in VOCAB.items())
    for n, s in SEQS:
        for name in (n, "neg_" + n):
            ids = rng.integers(1, VOCAB[s], size=(batch, t)).astype(np.int64)
            ids[pad] = 0
            d[name] = ids
    return d


def batches(dyn_t):
    rng = np.random.default_rng(42)
    d1 = gen_data(8, T, [0, 1, T, 7, 3, T, 12, 5], rng)
    d2 = gen_data(5, T, [T, 0, 2, T, 1], rng)
    t3 = T3 if dyn_t else T
    l3 = np.concatenate([[0, 1, t3, t3, 0, 2], rng.integers(0, t3 + 1, size=27)])
    d3 = gen_data(33, t3, l3, rng)
    return [d1, d2, d3]


def export(model, name, exporter, path, example):
    import torch
    from torch_rechub.utils.onnx_export import ONNXExporter, ONNXWrapper
    ex = ONNXExporter(model)
    names = [f.name for f in ex.feature_info["features"]]
    dummy = {k: torch.from_numpy(v) for k, v in example.items() if k in names}
    if name == "DIEN" and exporter == "legacy":   # T static: the tracer unrolls AUGRU's loop over T
        wrapper = ONNXWrapper(model, names).eval()
        with torch.no_grad():
            torch.onnx.export(wrapper, tuple(dummy[n] for n in names), path, dynamo=False, opset_version=OPSET,
                              input_names=names, output_names=["output"], do_constant_folding=True,
                              dynamic_axes={**{n: {0: "batch_size"} for n in names}, "output": {0: "batch_size"}})
    else:
        ex.export(path, dummy_input=dummy, opset_version=OPSET if exporter == "legacy" else DYNAMO_OPSET,
                  onnx_export_kwargs={"dynamo": exporter == "dynamo"})
    import onnx
    m = onnx.load(path)
    m.ir_version = min(m.ir_version, 10)
    onnx.save(m, path)                      # one file: the dynamo path writes its weights to path + ".data"
    if os.path.exists(path + ".data"):
        os.remove(path + ".data")


def run(name):
    import onnx
    import onnxruntime as ort
    import torch
    torch.set_num_threads(1)
    model = make_model(name)

    def eager(d):
        with torch.no_grad():
            out = model({k: torch.from_numpy(v) for k, v in d.items()})
        return (out[0] if isinstance(out, tuple) else out).numpy().copy()

    for exporter in ("legacy", "dynamo"):
        stem = f"torch_rechub_{name}_{exporter}"
        path = os.path.join(HERE, stem + ".onnx")
        for ext in (".onnx", ".npz", ".ref.npz"):
            if os.path.exists(os.path.join(HERE, stem + ext)):
                os.remove(os.path.join(HERE, stem + ext))
        dyn_t = not (name == "DIEN")
        data = batches(dyn_t)
        try:
            export(model, name, exporter, path, data[0])
        except Exception as e:  # noqa
            msg = " ".join(str(e).split())
            print(f"[torch_rechub/{name}/{exporter}] export failed: {type(e).__name__}: {msg[-600:]}")
            if os.path.exists(path):
                os.remove(path)
            continue
        m = onnx.load(path)
        sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        inputs = [i.name for i in sess.get_inputs()]
        out_name = sess.get_outputs()[0].name
        errs = []
        for d in data:
            try:
                got = sess.run(None, {k: d[k] for k in inputs})[0]
                errs.append(float(np.abs(got - eager(d)).max()))
            except Exception as e:  # noqa
                errs.append(f"{type(e).__name__}: {str(e)[:200]}")
        keep = all(isinstance(e, float) and e <= TOL for e in errs)
        ops = Counter(n.op_type for n in m.graph.node)
        print(f"[torch_rechub/{name}/{exporter}] keep={keep} errs={errs} nodes={len(m.graph.node)} "
              f"bytes={os.path.getsize(path)} inputs={inputs} ops={dict(ops.most_common())}")
        if keep:
            np.savez(os.path.join(HERE, stem + ".npz"), **{k: data[2][k] for k in inputs})
            np.savez(os.path.join(HERE, stem + ".ref.npz"), **{out_name: eager(data[2])})
        else:
            os.remove(path)


if __name__ == "__main__":
    for n in sys.argv[1:] or ["DIN", "DIEN"]:
        run(n)
