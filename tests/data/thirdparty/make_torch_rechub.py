#!/usr/bin/env python
"""Export torch-rechub (datawhalechina/torch-rechub, pip torch-rechub==0.9.0, PyTorch) models to ONNX with both torch
exporters and keep those that match torch-rechub's own eager outputs in ONNX Runtime: the ranking models DIN and DIEN
(target attention), and its self-attention models BST (ranking, behaviour-sequence transformer), AutoInt (ranking,
feature self-attention) and SASRec (matching, causal self-attention over the history).

Environment (a venv of its own, not ctropt's), e.g. /work/venvs/recbole (shared with make_recbole.py):
    pip install torch==2.13.0 torch-rechub==0.9.0 onnx onnxscript onnxruntime numpy
No third-party code lives in this repository; nothing is downloaded; all weights are random (seeded), data
synthetic.

Usage (from this directory):  python make_torch_rechub.py [DIN] [DIEN] [BST] [AutoInt] [SASRec]   (default: all)
Outputs per kept export, in this directory:
    torch_rechub_<Model>_<legacy|dynamo>.onnx     legacy = dynamo=False, opset 17; dynamo = dynamo=True, opset 18;
                                                  ir_version clamped to <= 10; batch dim dynamic
    torch_rechub_<Model>_<legacy|dynamo>.npz      sample batch (B=33, one empty, one length-1, full histories),
                                                  keys = ONNX graph input names (histories right-padded with 0)
    torch_rechub_<Model>_<legacy|dynamo>.ref.npz  torch-rechub eager outputs on it (unpatched library code),
                                                  keys = ONNX graph output names
An export is kept only if onnxruntime CPU matches eager within 1e-5 (abs), every output, on three batches (B=8, B=5,
B=33 with other history-length mixes; where the history axis is dynamic, the B=33 batch has another padded length:
13 for DIN, 45 for BST/SASRec; the export itself is traced at B=8, T=30).

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

Self-attention models (torch_rechub/models/ranking/bst.py, autoint.py, models/matching/sasrec.py as shipped; 16-dim
embeddings, 2 heads, MLP [32, 16]; same weight re-draw as above; no dropout at eval). torch-rechub has no BERT4Rec;
HSTUModel (models/generative/hstu.py) is self-attention too but pointwise (SiLU, no softmax) and not exported here.
  * BST: built like DIN (target_item/target_cate own the tables, padding_idx=0; hist_item/hist_cate pooling="concat",
    shared_with the target; user_id/gender context), nhead=2, num_layers=1 (library default; the paper's best),
    max_seq_len=51 (default). BST appends the target to the history, adds a learned absolute position embedding and
    builds src_key_padding_mask from `hist == padding_idx` (the target slot is never masked, so an empty history
    gives no all-masked row); nn.TransformerEncoder takes its slow (exportable) path because BST's LeakyReLU
    activation disables PyTorch's fused encoder fast path / nested tensors. BST does not pass dim_feedforward, so the
    encoder FFN is PyTorch's default 32 -> 2048 -> 32 (most of the file size). Dynamo: ONNXExporter as is (batch and
    history length dynamic; torch.export merges both history lengths into one symbol). Legacy: not through
    ONNXExporter as is, because with the history axis dynamic the traced nn.MultiheadAttention bakes T+1 into a
    Reshape (onnxruntime fails at any other T, e.g. T=13: "{14,33,32} cannot be reshaped to {31,66,16}");
    exported, like DIEN, with ONNXExporter's own ONNXWrapper and settings, only the batch axis dynamic (T = 30
    static). The BST mask reaches attention as Where(pad, -inf, 0) added to the scores (both exporters).
  * AutoInt: sparse user_id/gender/target_item/target_cate plus two DenseFeatures price/age (float [B], min-max
    scaled to [0, 1) as torch-rechub's examples do), num_layers=2 (library default 3), num_heads=2. No sequence, so
    no mask. ONNXExporter's reflection (utils/model_utils.extract_feature_info) does not know AutoInt's
    `sparse_features` / `dense_features` attributes and finds no inputs at all; its exporter is used with
    feature_info["features"] set to sparse + dense features, otherwise as is.
  * SASRec: features [seq, pos, neg] (SequenceFeature, pooling="concat", pos/neg shared_with seq, padding_idx=0) as in
    sasrec.py's own __main__, max_len=50, num_blocks=2 (default), num_heads=2; ONNXExporter as is (mode=None: full
    forward, inputs seq/pos/neg, outputs pos_logits "output" and neg_logits [B, T]). Histories right-padded: pos is seq
    shifted by one item, neg random, all zero past the length (torch-rechub's user_tower takes position
    count(seq != 0) - 1 as the last item). Nothing is kept, both exporters fail on SASRec.seq_forward's
    `positions = np.tile(np.array(range(x.shape[1])), [x.shape[0], 1])`: legacy bakes a [8, 30] position constant
    (onnxruntime: "Attempting to broadcast an axis by a dimension other than 1. 5 by 8" at B=5); dynamo silently
    specialises batch and length (graph inputs [8, 30]; onnxruntime refuses B=5). The in-batch user tower
    (item_feature + mode="user") shares seq_forward and fails the same way (and ONNXExporter(mode="user") refuses
    SASRec: no user_features attribute). Not patched: recorded in the run output.
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
EMB_TF = 16     # embedding size of the self-attention models (BST, AutoInt, SASRec)
T3_TF = 45      # padded history length of their B=33 check where the history axis is dynamic
TF_MODELS = ("BST", "AutoInt", "SASRec")
STATIC_T_LEGACY = ("DIEN", "BST")   # legacy export with the history axis static (see docstring)
VOCAB = {"user_id": 1000, "gender": 3, "target_item": 500, "target_cate": 100}
SEQS = [("hist_item", "target_item"), ("hist_cate", "target_cate")]


# Sizes of the toy exports; benchmarks/production_corpus.py passes its own. Context features are the vocab's keys
# that are not target_*; the targets own the tables that the histories share.
TOY_SIZES = dict(vocab=VOCAB, emb=EMB, emb_tf=EMB_TF, mlp=[32, 16], att=[16], heads=2, bst_layers=1, bst_max_len=51,
                 sasrec_len=50, sasrec_blocks=2)


def features(vocab=VOCAB, emb=EMB):
    from torch_rechub.basic.features import SequenceFeature, SparseFeature
    ctx = [SparseFeature(n, v, emb) for n, v in vocab.items() if not n.startswith("target_")]
    tgt = [SparseFeature(n, vocab[n], emb, padding_idx=0) for n in ("target_item", "target_cate")]
    hist = [SequenceFeature(n, vocab[s], emb, pooling="concat", shared_with=s, padding_idx=0) for n, s in SEQS]
    neg = [SequenceFeature("neg_" + n, vocab[s], emb, pooling="concat", shared_with=s, padding_idx=0)
           for n, s in SEQS]
    return ctx, tgt, hist, neg


def features_tf(name, vocab=VOCAB, emb=EMB_TF):
    from torch_rechub.basic.features import DenseFeature, SequenceFeature, SparseFeature
    if name == "BST":
        ctx, tgt, hist, _ = features(vocab, emb)
        return ctx, hist, tgt
    if name == "AutoInt":
        return [SparseFeature(n, v, emb) for n, v in vocab.items()], [DenseFeature("price"), DenseFeature("age")]
    seq = SequenceFeature("seq", vocab["target_item"], emb, pooling="concat", padding_idx=0)
    return [seq] + [SequenceFeature(n, vocab["target_item"], emb, pooling="concat", shared_with="seq",
                                    padding_idx=0) for n in ("pos", "neg")]


def make_model(name, sizes=TOY_SIZES):
    import torch
    from torch_rechub.models.matching import SASRec
    from torch_rechub.models.ranking import BST, DIEN, DIN, AutoInt
    torch.manual_seed(0)
    z = sizes
    if name in TF_MODELS:
        f = features_tf(name, z["vocab"], z["emb_tf"])
    else:
        ctx, tgt, hist, neg = features(z["vocab"], z["emb"])
    mlp = {"dims": list(z["mlp"])}
    if name == "DIN":
        model = DIN(ctx, hist, tgt, mlp_params=mlp,
                    attention_mlp_params={"dims": list(z["att"]), "activation": "dice", "use_softmax": False})
    elif name == "DIEN":
        model = DIEN(ctx, hist, neg, tgt, mlp_params=mlp)
    elif name == "BST":
        model = BST(*f, mlp_params=mlp, nhead=z["heads"], num_layers=z["bst_layers"], max_seq_len=z["bst_max_len"])
    elif name == "AutoInt":
        model = AutoInt(*f, num_layers=2, num_heads=z["heads"], mlp_params=mlp)
    else:
        model = SASRec(f, max_len=z["sasrec_len"], num_blocks=z["sasrec_blocks"], num_heads=z["heads"])
    randomize_weights(model)
    return model.eval()


def randomize_weights(model):
    """Embeddings N(0, 0.5) (padding row kept zero), BatchNorm running statistics randomised (seeded)."""
    import torch
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


def gen_data_tf(batch, t, lens, rng):
    """gen_data plus AutoInt's dense features (float32 [B] in [0, 1)) and SASRec's seq/pos/neg int64 [B, t]
    (pos = seq shifted by one item, neg random; all 0 past each row's length)."""
    d = gen_data(batch, t, lens, rng)
    for n in ("price", "age"):
        d[n] = rng.random(batch).astype(np.float32)
    pad = np.arange(t)[None, :] >= np.asarray(lens)[:, None]
    items = rng.integers(1, VOCAB["target_item"], size=(batch, t + 1)).astype(np.int64)
    d["seq"], d["pos"] = items[:, :-1].copy(), items[:, 1:].copy()
    d["neg"] = rng.integers(1, VOCAB["target_item"], size=(batch, t)).astype(np.int64)
    for n in ("seq", "pos", "neg"):
        d[n][pad] = 0
    return d


def batches(dyn_t, t3_dyn=T3, gen=gen_data):
    rng = np.random.default_rng(42)
    d1 = gen(8, T, [0, 1, T, 7, 3, T, 12, 5], rng)
    d2 = gen(5, T, [T, 0, 2, T, 1], rng)
    t3 = t3_dyn if dyn_t else T
    l3 = np.concatenate([[0, 1, t3, t3, 0, 2], rng.integers(0, t3 + 1, size=27)])
    d3 = gen(33, t3, l3, rng)
    return [d1, d2, d3]


def export(model, name, exporter, path, example):
    import torch
    from torch_rechub.utils.onnx_export import ONNXExporter, ONNXWrapper
    ex = ONNXExporter(model)
    if name == "AutoInt":   # extract_feature_info does not know AutoInt's sparse_features / dense_features
        ex.feature_info["features"] = model.sparse_features + model.dense_features
    names = [f.name for f in ex.feature_info["features"]]
    dummy = {k: torch.from_numpy(v) for k, v in example.items() if k in names}
    if name in STATIC_T_LEGACY and exporter == "legacy":
        # T static: DIEN's tracer unrolls AUGRU's loop over T; BST's traced MultiheadAttention bakes T+1 in a Reshape
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
        """Model outputs as ONNXWrapper returns them: DIEN's (output, scalar aux loss) -> output only."""
        with torch.no_grad():
            out = model({k: torch.from_numpy(v) for k, v in d.items()})
        if isinstance(out, tuple) and len(out) == 2 and out[1].dim() == 0:
            out = out[0]
        return [o.numpy().copy() for o in (out if isinstance(out, tuple) else (out,))]

    for exporter in ("legacy", "dynamo"):
        stem = f"torch_rechub_{name}_{exporter}"
        path = os.path.join(HERE, stem + ".onnx")
        for ext in (".onnx", ".npz", ".ref.npz"):
            if os.path.exists(os.path.join(HERE, stem + ext)):
                os.remove(os.path.join(HERE, stem + ext))
        if name in TF_MODELS:
            data = batches(not (name in STATIC_T_LEGACY and exporter == "legacy"), T3_TF, gen_data_tf)
        else:
            data = batches(not (name == "DIEN"))
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
        out_names = [o.name for o in sess.get_outputs()]
        errs = []
        for d in data:
            try:
                got, ref = sess.run(None, {k: d[k] for k in inputs}), eager(d)
                if len(got) != len(ref):
                    raise ValueError(f"{len(got)} ONNX outputs vs {len(ref)} eager outputs")
                errs.append(max(float(np.abs(g - r).max()) for g, r in zip(got, ref)))
            except Exception as e:  # noqa
                errs.append(f"{type(e).__name__}: {str(e)[:200]}")
        keep = all(isinstance(e, float) and e <= TOL for e in errs)
        ops = Counter(n.op_type for n in m.graph.node)
        print(f"[torch_rechub/{name}/{exporter}] keep={keep} errs={errs} nodes={len(m.graph.node)} "
              f"bytes={os.path.getsize(path)} inputs={inputs} ops={dict(ops.most_common())}")
        if keep:
            np.savez(os.path.join(HERE, stem + ".npz"), **{k: data[2][k] for k in inputs})
            np.savez(os.path.join(HERE, stem + ".ref.npz"), **dict(zip(out_names, eager(data[2]))))
        else:
            os.remove(path)


if __name__ == "__main__":
    for n in sys.argv[1:] or ["DIN", "DIEN", *TF_MODELS]:
        run(n)
