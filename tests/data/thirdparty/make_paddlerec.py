#!/usr/bin/env python
"""Export PaddleRec models (PaddlePaddle/PaddleRec) to ONNX through paddle2onnx and check them
in ONNX Runtime and OpenVINO.

Environment: two venvs of their own (not ctropt's), Python 3.11:
  /work/venvs/paddle3: paddlepaddle==3.1.1 paddle2onnx==2.1.0 (PIR .json programs) onnx==1.17.0 (pinned by
      paddle2onnx) onnxruntime==1.32.0 openvino==2026.4.1 numpy==2.4.6, plus polygraphy 0.53.6,
      onnx_graphsurgeon 0.6.1 and sympy 1.14.0 (paddle2onnx 2.x constant-folds with polygraphy and sets
      POLYGRAPHY_AUTOINSTALL_DEPS=1: install these beforehand or it pip-installs them on first use), and
      six 1.17.0 (imported by rank/bert4rec/net.py).
      Do not use paddle 3.3.1 with paddle2onnx 2.1.0 (float attributes are read as garbage).
  /work/venvs/paddle2: paddlepaddle==2.6.2 paddle2onnx==1.3.1 (old-IR .pdmodel programs) onnx==1.23.2
      onnxruntime==1.32.0 openvino==2026.4.1 numpy==1.26.4 -- only for the models in OLD_PAIR.
  Override the interpreters with PADDLE3_PYTHON / PADDLE2_PYTHON.

PaddleRec's model code is not on PyPI: unpack a snapshot of the repository's models/ folder, e.g.
    git --git-dir=<bare PaddleRec git dir> archive HEAD models | tar -x -C /work/thirdparty_src/paddlerec
(checked with commit 656326adf3c4117c11ec0eff5e8f61acd8191c2a) and point PADDLEREC_SRC at the folder
holding models/ (default /work/thirdparty_src/paddlerec).  Nothing of PaddleRec is copied here; nothing is
downloaded at run time: weights are seeded random, data are synthetic.

Usage (from this directory, with the paddle3 venv's python):
    /work/venvs/paddle3/bin/python make_paddlerec.py               # every model, one subprocess each
    /work/venvs/paddle3/bin/python make_paddlerec.py DIN DIEN_aux  # some of them
Scratch files (jit.save programs, per-export result JSON with op histograms and all errors) go to
$PADDLEREC_WORK (default /tmp/paddlerec_work).  One export runs at a time.

Every model is built with models/<dir>/dygraph_model.py `DygraphModel().create_model(config)` from a
small hyper_parameters dict (tables <= 1000 rows, embedding dim 8, histories of 20 (and 13) steps, small
MLPs), its weights are re-drawn from a seeded normal (PaddleRec's own initialisers give near-constant
outputs; padding_idx rows are NOT zeroed, so the export must reproduce Paddle's padding_idx masking), then
`paddle.jit.to_static(full_graph=True)` with InputSpecs (dynamic batch; dynamic history length where the
model allows it) -> `paddle.jit.save` -> `paddle2onnx.export(opset_version=13)` (auto-upgrade on: DLRM
comes out at opset 14).  A thin wrapper layer only picks the inference outputs (and passes None for the
unused `label` argument of DIN/DIEN); it adds no ops.  DIN/DIEN need register_orphans() (PaddleRec bug:
duplicate sublayer names leave the attention MLP unregistered; computation unchanged).

Exports (stem paddlerec_<Model>_paddle2onnx), all with paddle 3.1.1 + paddle2onnx 2.1.0 unless noted:
    DCN       rank/dcn        26 sparse [B,1] int64 ids C1..C26 (one table, padding_idx 0) + dense_input
                              [B,13]; cross net x2 + MLP; output: predict (l2 cross regulariser dropped)
    DIN       rank/din        hist item/cat [B,T] (T dynamic), target item/cat [B], int64 mask [B,T,1]
                              (0 / -1e9, as dinReader feeds it), target item/cat tiled [B,T]; output: logit
    DIEN      rank/dien       DIENLayer: 2-layer GRU extractor + attention-weighted GRUCell unrolled by a
                              Python loop over T (T fixed at export = 20; float32 mask); output: logit
                              (negative histories feed only the aux loss, so they are not inputs)
    DIEN_aux  rank/dien       same model with the negative histories, outputs logit and auxiliary loss.
                              paddle 2.6.2 + paddle2onnx 1.3.1 only: paddle2onnx 2.1.0 aborts on the aux
                              loss's paddle.mean ("Can not get input 'axis(dim)' value").  The ONNX output
                              declares rank 0 but onnxruntime returns shape [1]; the ref is Paddle's scalar.
    DIEN_dyn  rank/dien       DIENLayer with T dynamic: dy2static turns the loop over T into a while ->
                              ONNX Loop (body concat-grows the states); output: logit
    DeepFM    rank/deepfm     26 sparse + 13 dense; FM + DNN; output: predict
    MMoE      multitask/mmoe  input_data [B,64]; 4 experts, 2 gates/towers; outputs: two softmax [B,2]
    DLRM      rank/dlrm       26 sparse + 13 dense; BatchNorm MLPs; dot interaction via triu/tril +
                              masked_select; output [B,2] (opset 14)
    WideDeep  rank/wide_deep  26 sparse + 13 dense; output: predict
    PLE       multitask/ple   input_data [B,64]; 1 CGC level, 2 experts/task + 2 shared; two softmax [B,2]
    BST       rank/bst        transformer layer over [hist..., target] (T dynamic); output: predict
    AutoInt   rank/autoint    criteo_reader's feat_index [B,39] int64 / feat_value [B,39] float32; config.yaml's
                              pure AutoInt (no DNN; wide part, residual, scaling on), 2 interacting layers of
                              16 = 2 heads x 8 over the 39 fields, written with paddle.einsum (-> ONNX Einsum);
                              output: sigmoid [B,1]
    BERT4Rec  rank/bert4rec   2 encoder layers, hidden 16, 2 heads, gelu, vocab ITEMS (0 pad, ITEMS-1 [MASK]),
                              20 positions (T dynamic <= 20); int32 src_ids/pos_ids/sent_ids [B,T],
                              input_mask [B,T,1], mask_pos [M] (flat b*T + [MASK] position); histories of 0..T-1
                              items + [MASK], 0-padded; output: item logits [M, ITEMS] at mask_pos
Not exported: DIEN_rnn (net.StaticDIENLayer, paddle.nn.RNN -> while over tensor arrays): both paddle2onnx
versions abort on the tensor-array ops (1.3.1: increment, read_from_array, tensor_array_to_tensor, while,
write_to_array).

Outputs per export, in this directory:
    paddlerec_<Model>_paddle2onnx.onnx     the model (ir_version clamped to <= 10, opset kept)
    paddlerec_<Model>_paddle2onnx.npz      sample batch (B=8, T=20), keys = ONNX graph input names,
                                           dtypes/ranks as declared; histories 0-padded to mixed lengths
    paddlerec_<Model>_paddle2onnx.ref.npz  Paddle eager (dygraph) outputs, keys = ONNX graph output names
An export is kept only if onnxruntime CPU matches Paddle eager within 1e-5 (abs) at B=8 and at B=33 with
different data (and T=13 where T is dynamic).  The saved program re-run by paddle.jit.load is compared too
(jit_vs_eager).  OpenVINO is recorded, not required: default CPU config (bf16 inference precision on CPUs
with AVX512-BF16/AMX, errors ~1e-3) and INFERENCE_PRECISION_HINT=f32.
"""
import importlib
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from collections import Counter

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.environ.get("PADDLEREC_SRC", "/work/thirdparty_src/paddlerec")
WORK = os.environ.get("PADDLEREC_WORK", "/tmp/paddlerec_work")
OPSET = 13
TOL = 1e-5
B1, B2 = 8, 33
T1, T2 = 20, 13      # history lengths of the two check batches (T2 only for dynamic-T models)
SEED = 2024

# Production-sized variants for measurements (not the committed fixtures): PADDLEREC_OUT=/tmp/big PADDLEREC_EMB=16
# PADDLEREC_FC=400,400,400 python make_paddlerec.py WideDeep DeepFM writes them elsewhere.
OUT = os.environ.get("PADDLEREC_OUT", HERE)
FC = [int(h) for h in os.environ.get("PADDLEREC_FC", "32,16").split(",")]
N_SPARSE, N_DENSE, VOCAB, EMB = 26, 13, 1000, int(os.environ.get("PADDLEREC_EMB", "8"))
ITEMS, CATS = 1000, 100
FEAT = 64            # MMoE / PLE input width

MODELS = ["DCN", "DIN", "DIEN", "DIEN_aux", "DIEN_dyn", "DIEN_rnn", "DeepFM", "MMoE", "DLRM", "WideDeep", "PLE", "BST",
          "AutoInt", "BERT4Rec"]
DIRS = {"DCN": "rank/dcn", "DIN": "rank/din", "DIEN": "rank/dien", "DIEN_aux": "rank/dien", "DIEN_dyn": "rank/dien",
        "DIEN_rnn": "rank/dien", "DeepFM": "rank/deepfm", "WideDeep": "rank/wide_deep",
        "MMoE": "multitask/mmoe", "PLE": "multitask/ple", "DLRM": "rank/dlrm", "BST": "rank/bst",
        "AutoInt": "rank/autoint", "BERT4Rec": "rank/bert4rec"}
N_FIELD = N_DENSE + N_SPARSE   # AutoInt: criteo_reader's 39 (feat_index, feat_value) pairs
B4R_EMB = 16                   # BERT4Rec hidden size (2 heads of 8)
CRITEO = {"sparse_inputs_slots": N_SPARSE + 1, "sparse_feature_number": VOCAB, "sparse_feature_dim": EMB,
          "dense_input_dim": N_DENSE}
HP = {
    "DCN": dict(CRITEO, fc_sizes=[32, 16], cross_num=2, l2_reg_cross=5e-5, clip_by_norm=100.0,
                is_sparse=False, dnn_use_bn=False),
    "DeepFM": dict(CRITEO, fc_sizes=FC),
    "WideDeep": dict(CRITEO, fc_sizes=FC),
    "DLRM": dict(CRITEO, bot_layer_sizes=[32, EMB], top_layer_sizes=[32, 16, 2], num_field=N_SPARSE),
    "DIN": dict(item_emb_size=EMB, cat_emb_size=EMB, is_sparse=False, item_count=ITEMS, cat_count=CATS,
                act="sigmoid", use_DataLoader=True),
    "MMoE": dict(feature_size=FEAT, expert_num=4, expert_size=16, tower_size=8, gate_num=2),
    "PLE": dict(feature_size=FEAT, task_num=2, exp_per_task=2, shared_num=2, expert_size=16,
                tower_size=8, level_number=1),
    # BST: d_model = item + cat + position emb; dropout 0; postprocess_cmd "da" (create_model reads
    # preprocess_cmd from the postprocess_cmd key too, so no static-only layer_norm is reached)
    "BST": dict(item_emb_size=EMB, cat_emb_size=EMB, position_emb_size=EMB, item_count=ITEMS,
                user_count=1000, cat_count=CATS, position_count=64, n_encoder_layers=1, d_model=3 * EMB,
                d_key=6, d_value=6, n_head=4, dropout_rate=0.0, postprocess_cmd="da",
                prepostprocess_dropout=0.0, d_inner_hid=32, relu_dropout=0.0, fc_sizes=[32, 16],
                is_sparse=False, act="relu", use_DataLoader=True),
    # AutoInt: config.yaml's pure AutoInt (fc_sizes [] -> no DNN branch, use_wide on, residual + scaling),
    # 2 interacting layers of 16 (2 heads of 8) instead of 3 of 64
    "AutoInt": dict(feature_number=VOCAB, embedding_dim=EMB, fc_sizes=[], use_residual=True, scaling=True,
                    use_wide=True, use_sparse=False, head_num=2, num_field=N_FIELD, attn_layer_sizes=[16, 16]),
    # BERT4Rec: config.yaml's structure (2 layers, 2 heads, gelu, 2 sentence types) at hidden 16, item vocab
    # ITEMS (id 0 = padding, ITEMS-1 = [MASK]), 20 positions; dropout 0 (eval anyway).  create_model needs
    # runner.data_batch_size / num_test_user only for its eval bookkeeping.
    "BERT4Rec": dict(_emb_size=B4R_EMB, _n_layer=2, _n_head=2, _voc_size=ITEMS, _max_position_seq_len=T1,
                     _sent_types=2, hidden_act="gelu", _dropout=0.0, _attention_dropout=0.0,
                     _param_initializer=0.02, num_test_user=1),
}
HP["DIEN"] = HP["DIEN_aux"] = HP["DIEN_dyn"] = HP["DIEN_rnn"] = HP["DIN"]
DYN_T = {"DIN", "DIEN_dyn", "DIEN_rnn", "BST", "BERT4Rec"}


# models that export only through the older pair (paddle 2.6.2 + paddle2onnx 1.3.1): paddle2onnx 2.1.0
# aborts on DIEN's aux-loss paddle.mean ("Can not get input 'axis(dim)' value")
OLD_PAIR = {"DIEN_aux"}
PYTHONS = {"paddle3": os.environ.get("PADDLE3_PYTHON", sys.executable),
           "paddle2": os.environ.get("PADDLE2_PYTHON", "/work/venvs/paddle2/bin/python")}


def stem(model):
    return f"paddlerec_{model}_paddle2onnx"


# ----------------------------------------------------------------------------- ONNX checks
def walk_nodes(graph):
    for n in graph.node:
        yield n
        for a in n.attribute:
            if a.type == 5:
                yield from walk_nodes(a.g)
            elif a.type == 10:
                for g in a.graphs:
                    yield from walk_nodes(g)


def model_stats(m):
    nodes = list(walk_nodes(m.graph))
    hist = Counter(n.op_type for n in nodes)
    return dict(nodes_total=len(nodes), nodes_top=len(m.graph.node), op_hist=dict(hist.most_common()),
                opsets={o.domain or "ai.onnx": o.version for o in m.opset_import}, ir_version=m.ir_version,
                n_initializers=len(m.graph.initializer),
                inputs=[(i.name, i.type.tensor_type.elem_type,
                         [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim])
                        for i in m.graph.input],
                outputs=[(o.name, [d.dim_param or d.dim_value for d in o.type.tensor_type.shape.dim])
                         for o in m.graph.output])


def max_err(outs, refs):
    e = 0.0
    for k, r in refs.items():
        o = np.asarray(outs[k], dtype=np.float64)
        r = np.asarray(r, dtype=np.float64)
        if o.shape != r.shape:
            if o.size != r.size:
                return float("inf"), f"shape mismatch {k}: {o.shape} vs {r.shape}"
            o = o.reshape(r.shape)
        e = max(e, float(np.max(np.abs(o - r))) if r.size else 0.0)
    return e, None


def check_export(path, feeds, refs):
    """feeds/refs: lists (one per check batch) of dicts keyed by ONNX names."""
    import onnx
    res = {"size_bytes": os.path.getsize(path)}
    m = onnx.load(path)
    res.update(model_stats(m))
    try:
        onnx.checker.check_model(m)
        res["onnx_checker"] = "ok"
    except Exception as e:  # noqa
        res["onnx_checker"] = f"{type(e).__name__}: {str(e)[:300]}"
    try:
        import onnxruntime as ort
        s = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        names = [o.name for o in s.get_outputs()]
        for i, (f, r) in enumerate(zip(feeds, refs)):
            try:
                err, msg = max_err(dict(zip(names, s.run(None, f))), r)
            except Exception as e:  # noqa
                err, msg = None, f"{type(e).__name__}: {str(e)[:500]}"
            res[f"ort_err_{i}"] = err
            if msg:
                res[f"ort_note_{i}"] = msg
    except Exception as e:  # noqa
        res["ort_error"] = f"{type(e).__name__}: {str(e)[:800]}"
    # OpenVINO: default CPU config (bf16 inference precision on CPUs with AVX512-BF16/AMX), then f32
    for tag, cfg in (("ov", {}), ("ov_f32", {"INFERENCE_PRECISION_HINT": "f32"})):
        _ov_check(path, feeds, refs, res, tag, cfg)
    return res


def _ov_check(path, feeds, refs, res, tag, cfg):
    try:
        import openvino as ov
        cm = ov.Core().compile_model(path, "CPU", cfg)
        res[f"{tag}_ok"] = True
        for i, (f, r) in enumerate(zip(feeds, refs)):
            try:
                out = cm(f)
                got = {}
                for o in cm.outputs:
                    for nm in o.get_names():
                        if nm in r:
                            got[nm] = out[o]
                err, msg = max_err(got, r)
            except Exception as e:  # noqa
                err, msg = None, f"{type(e).__name__}: {str(e)[:500]}"
            res[f"{tag}_err_{i}"] = err
            if msg:
                res[f"{tag}_note_{i}"] = msg
    except Exception as e:  # noqa
        res[f"{tag}_ok"] = False
        res[f"{tag}_error"] = f"{type(e).__name__}: {str(e)[:800]}"


# ----------------------------------------------------------------------------- data
def seq_batch(rng, b, t, with_neg=False, min_len=1):
    """DIN/DIEN/BST style batch: ids 0-padded after each row's length (the last row is always full)."""
    lens = rng.integers(min_len, t + 1, size=b)
    lens[-1] = t
    pad = np.arange(t)[None, :] >= lens[:, None]
    d = {}
    d["hist_item_seq"] = np.where(pad, 0, rng.integers(1, ITEMS, size=(b, t))).astype(np.int64)
    d["hist_cat_seq"] = np.where(pad, 0, rng.integers(1, CATS, size=(b, t))).astype(np.int64)
    d["target_item"] = rng.integers(1, ITEMS, size=b).astype(np.int64)
    d["target_cat"] = rng.integers(1, CATS, size=b).astype(np.int64)
    d["mask"] = np.where(pad, -1e9, 0.0)[:, :, None]
    d["target_item_seq"] = np.repeat(d["target_item"][:, None], t, axis=1)
    d["target_cat_seq"] = np.repeat(d["target_cat"][:, None], t, axis=1)
    if with_neg:
        d["neg_hist_item_seq"] = np.where(pad, 0, rng.integers(1, ITEMS, size=(b, t))).astype(np.int64)
        d["neg_hist_cat_seq"] = np.where(pad, 0, rng.integers(1, CATS, size=(b, t))).astype(np.int64)
    d["_lens"] = lens
    return d


def criteo_batch(rng, b):
    d = {f"C{i + 1}": rng.integers(0, VOCAB, size=(b, 1)).astype(np.int64) for i in range(N_SPARSE)}
    d["C1"][0, 0] = 0          # id 0 is padding_idx in DCN / DeepFM tables
    d["dense_input"] = rng.normal(size=(b, N_DENSE)).astype(np.float32)
    return d


# ----------------------------------------------------------------------------- model building
def load_paddlerec(model):
    d = os.path.join(SRC, "models", DIRS[model])
    if not os.path.isdir(d):
        raise FileNotFoundError(f"{d} (set PADDLEREC_SRC)")
    sys.path.insert(0, d)
    dm = importlib.import_module("dygraph_model")
    net = importlib.import_module("net")
    return dm, net


def reinit(layer, seed):
    """Seeded weights: tables N(0, 0.3), matrices N(0, 1/fan_in), vectors N(0, 0.1); BatchNorm / LayerNorm
    scales 1 + N(0, 0.1) (N(0, 0.1) LayerNorm scales shrink the input-dependent part ~10x per LayerNorm:
    BERT4Rec's 6 left outputs that hardly depend on the input)."""
    import paddle
    rng = np.random.default_rng(seed)
    tables, bn_var, bn_scale = set(), set(), set()
    for _, sub in layer.named_sublayers(include_self=True):
        if isinstance(sub, paddle.nn.Embedding):
            tables.add(id(sub.weight))
        if isinstance(sub, paddle.nn.layer.norm._BatchNormBase):
            bn_var.add(id(sub._variance))
            bn_scale.add(id(sub.weight))
        if isinstance(sub, paddle.nn.LayerNorm) and sub.weight is not None:
            bn_scale.add(id(sub.weight))
    for name, p in sorted(layer.named_parameters(), key=lambda kv: kv[0]):
        shp = list(p.shape)
        if id(p) in bn_var:
            v = rng.uniform(0.5, 1.5, size=shp)
        elif id(p) in bn_scale:
            v = 1.0 + rng.normal(0, 0.1, size=shp)
        elif id(p) in tables:
            v = rng.normal(0, 0.3, size=shp)
        elif len(shp) >= 2:
            v = rng.normal(0, 1.0 / np.sqrt(shp[0]), size=shp)
        else:
            v = rng.normal(0, 0.1, size=shp)
        p.set_value(v.astype(np.float32))


def register_orphans(layer):
    """WORKAROUND (PaddleRec bug, no effect on the computation): DIN/DIEN add their attention-MLP and
    con/top-MLP Linears with the same sublayer names ('linear_0', ...), so the later list replaces the
    earlier in the layer registry: those Linears are used in forward() but their parameters are not the
    layer's (not trained by PaddleRec either; jit.save fails with KeyError 'linear_0.b_0').  Register
    every Layer held in a list attribute that the registry does not hold under an extra name."""
    import paddle
    for owner in [layer] + list(layer.sublayers()):
        known = {id(s) for s in owner.sublayers(include_self=True)}
        for attr, val in list(vars(owner).items()):
            if isinstance(val, (list, tuple)):
                for i, sub in enumerate(val):
                    if isinstance(sub, paddle.nn.Layer) and id(sub) not in known:
                        owner.add_sublayer(f"orphan_{attr.strip('_')}_{i}", sub)
                        known.update(id(s) for s in sub.sublayers(include_self=True))


def build(model):
    """Returns (wrapper layer, [InputSpec...] positional, input names (flat), data fn(rng, b, t))."""
    import paddle
    from paddle.static import InputSpec as S
    dm, net = load_paddlerec(model)
    config = {f"hyper_parameters.{k}": v for k, v in HP[model].items()}
    config["runner.data_batch_size"] = 1     # BERT4Rec's create_model reads it (test-batch count only)
    if model == "DIEN_rnn":
        hp = HP[model]
        core = net.StaticDIENLayer(hp["item_emb_size"], hp["cat_emb_size"], hp["act"], hp["is_sparse"],
                                   hp["use_DataLoader"], hp["item_count"], hp["cat_count"])
    else:
        core = dm.DygraphModel().create_model(config)
    register_orphans(core)
    reinit(core, SEED)
    core.eval()

    if model in ("DCN", "DeepFM", "WideDeep", "DLRM"):
        class W(paddle.nn.Layer):
            def __init__(self, m):
                super().__init__()
                self.m = m

            def forward(self, sparse_inputs, dense_inputs):
                out = self.m(sparse_inputs, dense_inputs)
                return out[0] if isinstance(out, (tuple, list)) else out
        sparse_names = [f"C{i + 1}" for i in range(N_SPARSE)]
        spec = [[S([None, 1], "int64", n) for n in sparse_names], S([None, N_DENSE], "float32", "dense_input")]
        names = sparse_names + ["dense_input"]

        def data(rng, b, t):
            return criteo_batch(rng, b)

        def call(w, d):
            return w([paddle.to_tensor(d[n]) for n in sparse_names], paddle.to_tensor(d["dense_input"]))
        return W(core), spec, names, data, call

    if model in ("MMoE", "PLE"):
        class W(paddle.nn.Layer):
            def __init__(self, m):
                super().__init__()
                self.m = m

            def forward(self, input_data):
                o = self.m(input_data)
                return o[0], o[1]
        spec = [S([None, FEAT], "float32", "input_data")]

        def data(rng, b, t):
            return {"input_data": rng.normal(size=(b, FEAT)).astype(np.float32)}

        def call(w, d):
            return w(paddle.to_tensor(d["input_data"]))
        return W(core), spec, ["input_data"], data, call

    if model == "DIN" or model.startswith("DIEN"):
        dien = model.startswith("DIEN")
        with_aux = model in ("DIEN_aux", "DIEN_rnn")
        tdim = None if model in DYN_T else T1
        names = ["hist_item_seq", "hist_cat_seq", "target_item", "target_cat", "mask", "target_item_seq",
                 "target_cat_seq"] + (["neg_hist_item_seq", "neg_hist_cat_seq"] if with_aux else [])
        mask_dtype = "float32" if dien else "int64"   # as the readers feed them (din: int64 0/-1e9)
        shapes = {"target_item": [None], "target_cat": [None], "mask": [None, tdim, 1]}
        dtypes = {"mask": mask_dtype}
        spec = [S(shapes.get(n, [None, tdim]), dtypes.get(n, "int64"), n) for n in names]

        class W(paddle.nn.Layer):
            def __init__(self, m):
                super().__init__()
                self.m = m

            if with_aux:
                def forward(self, hist_item_seq, hist_cat_seq, target_item, target_cat, mask,
                            target_item_seq, target_cat_seq, neg_hist_item_seq, neg_hist_cat_seq):
                    logit, aux = self.m(hist_item_seq, hist_cat_seq, target_item, target_cat, None, mask,
                                        target_item_seq, target_cat_seq, neg_hist_item_seq, neg_hist_cat_seq)
                    return logit, aux
            elif model.startswith("DIEN"):
                # logit only: the negative histories feed only the aux loss, so they are not inputs
                # (jit.save refuses feeds the outputs do not use); the dead aux branch gets the positives
                def forward(self, hist_item_seq, hist_cat_seq, target_item, target_cat, mask,
                            target_item_seq, target_cat_seq):
                    logit, _ = self.m(hist_item_seq, hist_cat_seq, target_item, target_cat, None, mask,
                                      target_item_seq, target_cat_seq, hist_item_seq, hist_cat_seq)
                    return logit
            else:
                def forward(self, hist_item_seq, hist_cat_seq, target_item, target_cat, mask,
                            target_item_seq, target_cat_seq):
                    return self.m(hist_item_seq, hist_cat_seq, target_item, target_cat, None, mask,
                                  target_item_seq, target_cat_seq)

        def data(rng, b, t):
            d = seq_batch(rng, b, t, with_neg=with_aux)
            d["mask"] = d["mask"].astype(np.float32 if dien else np.int64)
            return {k: v for k, v in d.items() if not k.startswith("_")}

        def call(w, d):
            return w(*[paddle.to_tensor(d[n]) for n in names])
        return W(core), spec, names, data, call

    if model == "BST":
        names = ["userid", "hist_item_seq", "hist_cat_seq", "position_seq", "target_item", "target_cat",
                 "target_position"]
        spec = [S([None, 1], "int64", "userid"), S([None, None], "int64", "hist_item_seq"),
                S([None, None], "int64", "hist_cat_seq"), S([None, None], "int64", "position_seq"),
                S([None, 1], "int64", "target_item"), S([None, 1], "int64", "target_cat"),
                S([None, 1], "int64", "target_position")]

        def data(rng, b, t):
            s = seq_batch(rng, b, t)
            lens = s["_lens"]
            pos = np.arange(1, t + 1)[None, :].repeat(b, 0)
            pos[np.arange(t)[None, :] >= lens[:, None]] = 0
            return {"userid": rng.integers(0, 1000, size=(b, 1)).astype(np.int64),
                    "hist_item_seq": s["hist_item_seq"], "hist_cat_seq": s["hist_cat_seq"],
                    "position_seq": pos.astype(np.int64),
                    "target_item": s["target_item"][:, None], "target_cat": s["target_cat"][:, None],
                    "target_position": (lens + 1)[:, None].astype(np.int64)}

        class W(paddle.nn.Layer):
            def __init__(self, m):
                super().__init__()
                self.m = m

            def forward(self, userid, hist_item_seq, hist_cat_seq, position_seq, target_item, target_cat,
                        target_position):
                return self.m(userid, hist_item_seq, hist_cat_seq, position_seq, target_item, target_cat,
                              target_position)

        def call(w, d):
            return w(*[paddle.to_tensor(d[n]) for n in names])
        return W(core), spec, names, data, call

    if model == "AutoInt":
        # criteo_reader: feat_index [B,39] int64 (13 dense field ids, then 26 sparse ids), feat_value [B,39]
        # float32 (13 dense values, then 26 ones); output: sigmoid [B,1]
        class W(paddle.nn.Layer):
            def __init__(self, m):
                super().__init__()
                self.m = m

            def forward(self, feat_index, feat_value):
                return self.m(feat_index, feat_value)
        names = ["feat_index", "feat_value"]
        spec = [S([None, N_FIELD], "int64", "feat_index"), S([None, N_FIELD], "float32", "feat_value")]

        def data(rng, b, t):
            idx = np.concatenate([np.tile(np.arange(1, N_DENSE + 1), (b, 1)),
                                  rng.integers(N_DENSE + 1, VOCAB, size=(b, N_SPARSE))], axis=1)
            val = np.concatenate([np.abs(rng.normal(size=(b, N_DENSE))) * 2.0, np.ones((b, N_SPARSE))], axis=1)
            return {"feat_index": idx.astype(np.int64), "feat_value": val.astype(np.float32)}

        def call(w, d):
            return w(*[paddle.to_tensor(d[n]) for n in names])
        return W(core), spec, names, data, call

    if model == "BERT4Rec":
        # next-item inference as data_reader/infer_forward feed it (all int32 after create_feeds): src_ids
        # [B,T] = history, [MASK], 0-padding; pos_ids 0..len-1 then 0; sent_ids zeros; input_mask [B,T,1]
        # (1 on history + [MASK]); mask_pos flat index b*T + position of [MASK] (M = B here), fed 1-D [M]:
        # data_reader gives [M,1], which paddle.gather reads as [M] but paddle2onnx maps to a plain ONNX
        # Gather -> the export returns [M,1,ITEMS] while declaring [M,ITEMS].
        # Output: logits over the item vocab at the masked positions [M, ITEMS].
        names = ["src_ids", "pos_ids", "sent_ids", "input_mask", "mask_pos"]
        spec = [S([None, None], "int32", "src_ids"), S([None, None], "int32", "pos_ids"),
                S([None, None], "int32", "sent_ids"), S([None, None, 1], "int32", "input_mask"),
                S([None], "int32", "mask_pos")]

        def data(rng, b, t):
            hist = rng.integers(0, t, size=b)      # history length 0..T-1, + the [MASK] token
            hist[0] = 0                            # an empty history (only [MASK])
            hist[-1] = t - 1                       # a full row
            n_tok = hist + 1
            ar = np.arange(t)[None, :]
            src = np.where(ar < hist[:, None], rng.integers(1, ITEMS - 1, size=(b, t)), 0)
            src[np.arange(b), hist] = ITEMS - 1
            valid = ar < n_tok[:, None]
            return {"src_ids": src.astype(np.int32),
                    "pos_ids": np.where(valid, ar, 0).astype(np.int32),
                    "sent_ids": np.zeros((b, t), np.int32),
                    "input_mask": valid[:, :, None].astype(np.int32),
                    "mask_pos": (np.arange(b) * t + hist).astype(np.int32)}

        class W(paddle.nn.Layer):
            def __init__(self, m):
                super().__init__()
                self.m = m

            def forward(self, src_ids, pos_ids, sent_ids, input_mask, mask_pos):
                return self.m(src_ids, pos_ids, sent_ids, input_mask, mask_pos)

        def call(w, d):
            return w(*[paddle.to_tensor(d[n]) for n in names])
        return W(core), spec, names, data, call
    raise ValueError(model)


def to_list(out):
    if isinstance(out, (tuple, list)):
        return [o.numpy() for o in out]
    return [out.numpy()]


def run_one(model):
    import paddle
    import paddle2onnx
    import onnx
    paddle.seed(SEED)
    np.random.seed(SEED)
    res = {"model": model, "paddle": paddle.__version__, "paddle2onnx": paddle2onnx.__version__,
           "dir": DIRS[model]}
    for ext in (".onnx", ".npz", ".ref.npz"):      # never leave a stale fixture behind
        p = os.path.join(OUT, stem(model) + ext)
        if os.path.exists(p):
            os.remove(p)
    w, spec, names, data, call = build(model)
    w.eval()
    t2 = T2 if model in DYN_T else T1
    batches = [data(np.random.default_rng(42), B1, T1), data(np.random.default_rng(7), B2, t2)]
    buffers_before = {(id(sub), b) for _, sub in w.named_sublayers(include_self=True) for b in sub._buffers}
    with paddle.no_grad():
        refs = [to_list(call(w, d)) for d in batches]     # eager references, before to_static
    # a forward that stores a tensor on the layer (AutoInt: normalized_attn_scores, BERT4Rec: _enc_out) registers it as a
    # non-persistable buffer in eager mode; to_static would then trace an assign into that buffer (shaped by
    # the last eager batch, B=33) and the saved program gets a fixed batch of 33.  Drop such buffers.
    res["dropped_buffers"] = []
    for lname, sub in w.named_sublayers(include_self=True):
        for b in [b for b in sub._buffers if (id(sub), b) not in buffers_before]:
            del sub._buffers[b]
            sub._non_persistable_buffer_names_set.discard(b)
            res["dropped_buffers"].append(f"{lname}.{b}")
    res["ref_shapes"] = [[list(r.shape) for r in rr] for rr in refs]

    work = os.path.join(WORK, model)
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    prefix = os.path.join(work, "inference")
    t0 = time.time()
    try:
        st = paddle.jit.to_static(w, input_spec=spec, full_graph=True)
        paddle.jit.save(st, prefix)
    except Exception as e:  # noqa
        res["export_error"] = f"to_static/jit.save: {type(e).__name__}: {str(e)[:1500]}"
        res["traceback"] = traceback.format_exc()[-3000:]
        return res
    # the saved program, run by Paddle itself (separates paddle2onnx errors from dy2static ones)
    try:
        loaded = paddle.jit.load(prefix)
        loaded.eval()
        errs = []
        for d, r in zip(batches, refs):
            out = to_list(loaded(*[paddle.to_tensor(d[n]) for n in names]))
            errs.append(max(float(np.abs(np.asarray(o, np.float64) - rr).max()) for o, rr in zip(out, r)))
        res["jit_vs_eager"] = errs
    except Exception as e:  # noqa
        res["jit_load_error"] = f"{type(e).__name__}: {str(e)[:500]}"
    model_file = prefix + (".json" if os.path.exists(prefix + ".json") else ".pdmodel")
    path = os.path.join(OUT, stem(model) + ".onnx")
    tmp = os.path.join(work, "raw.onnx")
    try:
        paddle2onnx.export(model_file, prefix + ".pdiparams", save_file=tmp, opset_version=OPSET,
                           enable_onnx_checker=True)
        if not os.path.exists(tmp):
            raise RuntimeError("paddle2onnx wrote no file (see its log above)")
    except Exception as e:  # noqa
        res["export_error"] = f"paddle2onnx: {type(e).__name__}: {str(e)[:1500]}"
        return res
    res["export_s"] = round(time.time() - t0, 2)
    m = onnx.load(tmp)
    res["orig_ir_version"] = m.ir_version
    m.ir_version = min(m.ir_version, 10)
    onnx.save(m, tmp)

    # feeds keyed by ONNX input names, dtype/shape as declared
    np_t = {1: np.float32, 6: np.int32, 7: np.int64, 11: np.float64, 9: np.bool_}
    feeds = []
    for d in batches:
        f = {}
        for i in m.graph.input:
            if i.name not in d:
                raise KeyError(f"ONNX input {i.name} not among {list(d)}")
            f[i.name] = np.ascontiguousarray(d[i.name].astype(np_t[i.type.tensor_type.elem_type]))
            rank = len(i.type.tensor_type.shape.dim)
            assert f[i.name].ndim == rank, (i.name, f[i.name].shape, rank)
        feeds.append(f)
    res["pruned_inputs"] = [n for n in names if n not in feeds[0]]
    onames = [o.name for o in m.graph.output]
    if len(onames) != len(refs[0]):
        res["export_error"] = f"{len(onames)} ONNX outputs vs {len(refs[0])} Paddle outputs"
        return res
    ref_d = [dict(zip(onames, r)) for r in refs]
    res.update(check_export(tmp, feeds, ref_d))
    ok = all(res.get(f"ort_err_{i}") is not None and res[f"ort_err_{i}"] <= TOL for i in range(2))
    res["kept"] = ok
    res["ref_stats"] = [[float(np.mean(r)), float(np.std(r))] for r in refs[0]]
    if ok:
        shutil.copy(tmp, path)
        np.savez(os.path.join(OUT, stem(model) + ".npz"), **feeds[0])
        np.savez(os.path.join(OUT, stem(model) + ".ref.npz"), **ref_d[0])
    return res


def write_result(model, res):
    os.makedirs(WORK, exist_ok=True)
    with open(os.path.join(WORK, f"{stem(model)}.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    keys = ("kept", "paddle", "paddle2onnx", "nodes_total", "opsets", "size_bytes", "jit_vs_eager", "ort_err_0", "ort_err_1",
            "ov_ok", "ov_err_0", "ov_err_1", "ov_f32_err_0", "ov_f32_err_1", "pruned_inputs", "ref_stats", "export_error", "ort_error", "ort_note_1",
            "ov_error", "jit_load_error")
    print(f"[{model}] " + json.dumps({k: res[k] for k in keys if k in res}, default=str), flush=True)


def main(argv):
    if len(argv) >= 2 and argv[0] == "--one":
        model = argv[1]
        try:
            res = run_one(model)
        except Exception as e:  # noqa
            res = {"model": model, "export_error": f"{type(e).__name__}: {str(e)[:1500]}",
                   "traceback": traceback.format_exc()[-3000:]}
        write_result(model, res)
        return
    models = argv or MODELS
    for m in models:     # one subprocess per model: every PaddleRec dir has its own `net` module
        t0 = time.time()
        py = PYTHONS["paddle2" if m in OLD_PAIR else "paddle3"]
        r = subprocess.run([py, os.path.abspath(__file__), "--one", m], capture_output=True, text=True)
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith(f"[{m}]")]
        if not lines:    # paddle2onnx aborts the process (SIGABRT) on unsupported ops
            why = [ln.strip() for ln in (r.stdout + r.stderr).splitlines() if "Oops" in ln or "[ERROR]" in ln]
            res = {"model": m, "kept": False,
                   "export_error": f"process died rc={r.returncode}: " + " | ".join(why or [r.stderr[-800:]])}
            os.makedirs(WORK, exist_ok=True)
            with open(os.path.join(WORK, f"{stem(m)}.json"), "w") as f:
                json.dump(res, f, indent=1)
            lines = [f"[{m}] " + json.dumps(res)]
        print(lines[-1], f"({time.time() - t0:.0f}s)", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
