#!/usr/bin/env python
"""Export FuxiCTR (reczoo/FuxiCTR, PyTorch) model-zoo models to ONNX with both torch exporters and
check them against FuxiCTR's own eager outputs in ONNX Runtime (keep criterion) and OpenVINO (recorded).

Environment (a venv of its own, not ctropt's), e.g. /work/venvs/fuxictr:
    pip install torch==2.13.0 onnx onnxscript onnxruntime openvino numpy \
                pandas pyyaml scikit-learn h5py tqdm pyarrow polars
    pip install --no-deps fuxictr==2.3.10
The model zoo is not on pip: unpack a snapshot of github.com/reczoo/FuxiCTR (commit 0245987 = 2.3.10)
and point FUXICTR_SRC at it (default /work/thirdparty_src/fuxictr). No third-party code lives in this
repository; nothing is downloaded at run time; all weights are random (seeded), data synthetic.

Usage (from this directory):
    FUXICTR_SRC=/path/to/FuxiCTR python make_fuxictr.py            # all models, one subprocess each
    python make_fuxictr.py DIN DIEN                                 # some models (both exporters)
    python make_fuxictr.py --one DIN                                # in-process, one model
    python make_fuxictr.py report                                   # summary of the last results
Per-export results (JSON) go to $FUXICTR_RESULTS (default /tmp/fuxictr_results), not into the repo.

Outputs per kept export, in this directory:
    fuxictr_<Model>_<legacy|dynamo>.onnx     legacy = torch.onnx.export(dynamo=False, opset 17),
                                             dynamo = torch.onnx.export(dynamo=True, opset 18);
                                             ir_version clamped to <= 10; batch dim dynamic
    fuxictr_<Model>_<legacy|dynamo>.npz      sample batch (B=8), keys = ONNX graph input names
    fuxictr_<Model>_<legacy|dynamo>.ref.npz  FuxiCTR eager outputs (unpatched library code),
                                             keys = ONNX graph output names
Dynamo exports are made with one exporter-side workaround (patch_onnxscript_zero_tolerance): stock
onnxscript 0.7.2 rewrites `x + 1e-12` to `x` (its `x + 0` no-op rule matches constants with
abs_tol=1e-8), so FuxiCTR's MaskedAveragePooling gives NaN for empty histories (0/0) in every model
that pools sequence features (DCNv2, DeepFM, MMoE, DLRM, FinalMLP, xDeepFM, AutoInt, WideDeep, PLE).
What the stock optimizer gives is still exported to a scratch dir and recorded in the results JSON
("dynamo_stock_optimizer").
An export is kept only if onnxruntime CPU matches eager within 1e-5 (abs) at B=8 and at B=5 / B=33
(other history-length mixes incl. empty and full histories, and another padded length where the
history axis is dynamic). Failing exports are deleted (reason in the results JSON).

Feature map (FuxiCTR FeatureMap built in code, all ids int64 with 0 = padding, numerics float32 [B]):
    user_id(1000) item_id(500) cate_id(100) gender(3) age(10) | price, score (numeric)
    hist_item_id / hist_cate_id: sequences (max_len 20) sharing item_id / cate_id tables.
    Sequence-attention models (DIN, DIEN, BST, TransAct) take the raw [B, T] histories; the other
    models use FuxiCTR's default sequence encoder (layers.MaskedAveragePooling) on them.
Models (embedding_dim 8 or 16, small MLPs), each wrapped so positional tensors map to FuxiCTR's input
dict and the prediction tensor(s) come back:
    DIN       target (item_id, cate_id) attention over (hist_item_id, hist_cate_id), Dice, T dynamic
    DIEN      GRU interest extractor + AUGRU interest evolution, bilinear attention, BN in the DNN.
              Export-time monkeypatch (see patch_dien): FuxiCTR packs the histories
              (pack_padded_sequence) and walks PackedSequence.batch_sizes in a Python loop; the
              legacy tracer bakes the traced batch_sizes in as constants (wrong on other data), the
              dynamo exporter cannot trace PackedSequence / data-dependent row filtering. The patch
              runs the same nn.GRU on the padded history (masked) and the same AUGRUCell step by step
              with a padding mask, unrolled over T (T static = 20, batch dynamic). References come
              from the unpatched FuxiCTR code.
    DCNv2     parallel CrossNetV2 + DNN;  DeepFM;
    DLRM      dot interaction, dense features -> bottom MLP (DLRM concatenates its dense inputs on the
              last axis, so here they are float32 [B, 1]). Dynamo: torch 2.13 has no ONNX translation
              for aten.masked_select (InnerProductInteraction) -> custom_translation_table entry
              (Compress), see masked_select_translation(); model code unchanged.
    MMoE      multitask zoo, 2 tasks (click_pred, conversion_pred), 3 experts
    FinalMLP  two-stream MLP with feature selection + multi-head bilinear fusion
    BST       transformer over history+target with position embedding (T static: position table)
    TransAct  nn.TransformerEncoder over history + CrossNetV2/DNN; T dynamic in the dynamo export,
              static in the legacy one (legacy bakes the traced T into MultiheadAttention's Reshape:
              ORT fails at T != 20)
    xDeepFM (CIN), AutoInt (self-attention), WideDeep, PLE (multitask, 2 tasks)
"""
import importlib.util
import json
import os
import subprocess
import sys
import time
import traceback
from collections import Counter, OrderedDict

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.environ.get("FUXICTR_SRC", "/work/thirdparty_src/fuxictr")
RES_DIR = os.environ.get("FUXICTR_RESULTS", "/tmp/fuxictr_results")
# Production-sized variants for measurements (not the committed fixtures): FUXICTR_OUT=/tmp/big
# FUXICTR_EMB=16 FUXICTR_HIDDEN=400,400,400 python make_fuxictr.py WideDeep DeepFM writes them elsewhere.
OUT = os.environ.get("FUXICTR_OUT", HERE)
HIDDEN = [int(h) for h in os.environ.get("FUXICTR_HIDDEN", "32,16").split(",")]
OPSET = 17
DYNAMO_OPSET = 18
B, B2, B3 = 8, 5, 33
MAXLEN = 20          # padded history length used for export and the B=8 / B=5 batches
MAXLEN3 = 13         # padded history length of the B=33 check where the history axis is dynamic
TOL = 1e-5
EMB = int(os.environ.get("FUXICTR_EMB", "8"))

MODELS = ["DIN", "DIEN", "DCNv2", "DeepFM", "MMoE", "DLRM", "FinalMLP", "BST", "TransAct",
          "xDeepFM", "AutoInt", "WideDeep", "PLE"]
ZOO_DIR = {"DeepFM": "DeepFM/DeepFM_torch", "WideDeep": "WideDeep/WideDeep_torch",
           "MMoE": "multitask/MMoE", "PLE": "multitask/PLE"}
SEQ_MODELS = {"DIN", "DIEN", "BST", "TransAct"}      # take raw histories (no pooling encoder)
STATIC_T = {"DIEN", "BST"}                          # history length fixed in the export
# (model, exporter) pairs whose export bakes the traced history length in (checked: B=33 with T=13
# fails in ORT): exported with T static
STATIC_T_EXPORTER = {("TransAct", "legacy")}
MULTITASK = {"MMoE", "PLE"}

CAT = [("user_id", 1000), ("item_id", 500), ("cate_id", 100), ("gender", 3), ("age", 10)]
NUM = ["price", "score"]
SEQ = [("hist_item_id", "item_id", 500), ("hist_cate_id", "cate_id", 100)]


# ----------------------------------------------------------------------------- FuxiCTR setup
def stub_ray():
    """fuxictr 2.3.10 imports ray (dataset building / parquet loading) at import time; building and
    running models never touches it. If ray is not installed, register an inert stub."""
    try:
        import ray  # noqa: F401
        return
    except ImportError:
        pass
    import types

    class _Anything:
        def __init__(self, *a, **k):
            pass

        def __getattr__(self, k):
            return _Anything()
    mods = {}
    for n in ("ray", "ray.data", "ray.data.datasource", "ray.data.datasource.filename_provider"):
        mods[n] = types.ModuleType(n)
        sys.modules[n] = mods[n]
    mods["ray"].data = mods["ray.data"]
    mods["ray.data"].datasource = mods["ray.data.datasource"]
    mods["ray.data.datasource"].filename_provider = mods["ray.data.datasource.filename_provider"]
    mods["ray.data.datasource.filename_provider"].FilenameProvider = type("FilenameProvider", (), {})
    mods["ray.data"].SaveMode = _Anything()
    mods["ray.data"].TaskPoolStrategy = _Anything


def load_zoo_model(name):
    """Import model_zoo/<dir>/src from the FuxiCTR snapshot (package-relative imports work)."""
    stub_ray()
    d = os.path.join(SRC, "model_zoo", ZOO_DIR.get(name, name), "src")
    if not os.path.isdir(d):
        raise FileNotFoundError(f"{d} (set FUXICTR_SRC to a reczoo/FuxiCTR snapshot)")
    modname = f"fuxictr_zoo_{name}"
    spec = importlib.util.spec_from_file_location(modname, os.path.join(d, "__init__.py"),
                                                  submodule_search_locations=[d])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[modname] = mod
    spec.loader.exec_module(mod)
    return getattr(mod, name), mod


def build_feature_map(model_name):
    stub_ray()
    from fuxictr.features import FeatureMap
    fm = FeatureMap("synthetic_fuxictr", "/nonexistent")
    feats = OrderedDict()
    for n, v in CAT:
        feats[n] = {"source": "item" if n in ("item_id", "cate_id") else "user",
                    "type": "categorical", "padding_idx": 0, "vocab_size": v}
    for n in NUM:
        feats[n] = {"source": "context", "type": "numeric"}
    for n, share, v in SEQ:
        feats[n] = {"source": "user", "type": "sequence", "share_embedding": share,
                    "padding_idx": 0, "vocab_size": v, "max_len": MAXLEN}
        if model_name not in SEQ_MODELS:
            feats[n]["feature_encoder"] = "layers.MaskedAveragePooling()"
    if model_name == "DIEN":   # DIEN's DNN width assumes the negative-sample fields exist in the map;
        for n, share, v in SEQ:   # they are only read by the (training-only) auxiliary loss
            feats["neg_" + n] = dict(feats[n])
    fm.features = feats
    fm.labels = ["click", "conversion"] if model_name in MULTITASK else ["click"]
    fm.default_emb_dim = EMB
    fm.num_fields = fm.get_num_fields()
    fm.set_column_index()
    return fm


def input_names(model_name):
    names = [n for n, _ in CAT] + NUM + [n for n, _, _ in SEQ]
    return names


def gen_data(batch, rng, maxlen=MAXLEN, lens=None, dense_2d=False):
    """Synthetic FuxiCTR batch: ids int64 [B] (1..vocab-1), numerics float32 [B] ([B,1] for DLRM),
    histories int64 [B, T] post-padded with 0 after each row's length."""
    d = OrderedDict()
    for n, v in CAT:
        d[n] = rng.integers(1, v, size=batch).astype(np.int64)
    for n in NUM:
        x = rng.normal(size=batch).astype(np.float32)
        d[n] = x.reshape(batch, 1) if dense_2d else x
    if lens is None:
        lens = rng.integers(0, maxlen + 1, size=batch)
    lens = np.asarray(lens)
    pad = np.arange(maxlen)[None, :] >= lens[:, None]
    for n, _, v in SEQ:
        ids = rng.integers(1, v, size=(batch, maxlen)).astype(np.int64)
        ids[pad] = 0
        d[n] = ids
    return d


def batches(model_name, static_t=False):
    dense_2d = model_name == "DLRM"
    # B=8: one empty, one length-1, one full history, rest random
    l1 = [0, 1, MAXLEN, 7, 3, MAXLEN, 12, 5]
    d1 = gen_data(B, np.random.default_rng(42), lens=l1, dense_2d=dense_2d)
    l2 = [MAXLEN, 0, 2, MAXLEN, 1]
    d2 = gen_data(B2, np.random.default_rng(7), lens=l2, dense_2d=dense_2d)
    t3 = MAXLEN if (static_t or model_name in STATIC_T) else MAXLEN3
    rng3 = np.random.default_rng(11)
    l3 = np.concatenate([[0, 0, 1, t3, t3, t3], rng3.integers(0, t3 + 1, size=B3 - 6)])
    d3 = gen_data(B3, rng3, maxlen=t3, lens=l3, dense_2d=dense_2d)
    return d1, d2, d3


def make_model(model_name):
    import torch
    cls, mod = load_zoo_model(model_name)
    fm = build_feature_map(model_name)
    common = dict(feature_map=fm, gpu=-1, verbose=0, model_root="/tmp/fuxictr_ckpt", metrics=["AUC"],
                  optimizer="adam", loss="binary_crossentropy", embedding_regularizer=None,
                  net_regularizer=None, learning_rate=1e-3)
    seqpair = dict()
    if model_name == "DIN":
        kw = dict(embedding_dim=EMB, dnn_hidden_units=[32, 16], attention_hidden_units=[16],
                  attention_hidden_activations="Dice", din_target_field=[("item_id", "cate_id")],
                  din_sequence_field=[("hist_item_id", "hist_cate_id")], din_use_softmax=False)
    elif model_name == "DIEN":
        kw = dict(embedding_dim=EMB, dnn_hidden_units=[32, 16], gru_type="AUGRU",
                  attention_type="bilinear_attention", use_attention_softmax=True, batch_norm=True,
                  dien_target_field=[("item_id", "cate_id")],
                  dien_sequence_field=[("hist_item_id", "hist_cate_id")],
                  dien_neg_seq_field=[("neg_hist_item_id", "neg_hist_cate_id")], aux_loss_alpha=0)
    elif model_name == "DCNv2":
        kw = dict(embedding_dim=EMB, model_structure="parallel", num_cross_layers=2,
                  parallel_dnn_hidden_units=[32, 16])
    elif model_name == "DeepFM":
        kw = dict(embedding_dim=EMB, hidden_units=HIDDEN)
    elif model_name == "MMoE":
        kw = dict(embedding_dim=EMB, task=["binary_classification"] * 2, num_tasks=2, num_experts=3,
                  expert_hidden_units=[32, 16], gate_hidden_units=[16], tower_hidden_units=[8])
    elif model_name == "PLE":
        kw = dict(embedding_dim=EMB, task=["binary_classification"] * 2, num_tasks=2, num_layers=2,
                  num_shared_experts=2, num_specific_experts=1, expert_hidden_units=[32, 16],
                  gate_hidden_units=[16], tower_hidden_units=[8])
    elif model_name == "DLRM":
        kw = dict(embedding_dim=EMB, top_mlp_units=[32, 16], bottom_mlp_units=[16], interaction_op="dot")
    elif model_name == "FinalMLP":
        kw = dict(embedding_dim=EMB, mlp1_hidden_units=[32, 16], mlp2_hidden_units=[32, 16],
                  use_fs=True, fs_hidden_units=[16], fs1_context=["user_id"], fs2_context=["item_id"],
                  num_heads=2)
    elif model_name == "BST":
        kw = dict(embedding_dim=EMB, dnn_hidden_units=[32, 16], num_heads=2, stacked_transformer_layers=1,
                  bst_target_field=[("item_id", "cate_id")],
                  bst_sequence_field=[("hist_item_id", "hist_cate_id")], seq_pooling_type="mean",
                  use_position_emb=True)
    elif model_name == "TransAct":
        kw = dict(embedding_dim=EMB, dcn_cross_layers=2, dcn_hidden_units=[32, 16], mlp_hidden_units=[],
                  num_heads=2, transformer_layers=1, dim_feedforward=32,
                  target_item_field=[("item_id", "cate_id")],
                  sequence_item_field=[("hist_item_id", "hist_cate_id")], first_k_cols=1,
                  concat_max_pool=True)
    elif model_name == "xDeepFM":
        kw = dict(embedding_dim=EMB, dnn_hidden_units=[32, 16], cin_hidden_units=[8, 8])
    elif model_name == "AutoInt":
        kw = dict(embedding_dim=EMB, dnn_hidden_units=[32, 16], attention_layers=2, num_heads=2,
                  attention_dim=8, use_residual=True, use_wide=True, layer_norm=True, use_scale=True)
    elif model_name == "WideDeep":
        kw = dict(embedding_dim=EMB, hidden_units=HIDDEN)
    else:
        raise ValueError(model_name)
    torch.manual_seed(2024)
    model = cls(**common, **kw)
    init_weights(model, 1234)
    model.eval()
    return model, fm, mod


def init_weights(model, seed):
    """FuxiCTR initialises embeddings with std 1e-4 and biases with 0, which makes every output
    ~constant; use larger seeded values so comparisons are meaningful. Padding rows (index 0) stay 0,
    BatchNorm running stats are made non-trivial."""
    import torch
    from torch import nn
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Embedding):
                m.weight.copy_(torch.randn(m.weight.shape, generator=g) * 0.5)
                if m.padding_idx is not None:
                    m.weight[m.padding_idx].zero_()
            elif isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d)):
                m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=g) * 0.1)
                m.running_var.copy_(torch.rand(m.running_var.shape, generator=g) * 0.5 + 0.75)
                if m.affine:
                    m.weight.copy_(1 + 0.1 * torch.randn(m.weight.shape, generator=g))
                    m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
        for name, p in model.named_parameters():
            if p.dim() == 1 and name.endswith("bias") and float(p.abs().max()) == 0.0:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


# ----------------------------------------------------------------------------- DIEN patch
def patch_dien(mod):
    """WORKAROUND (export only, no library file touched): FuxiCTR DIEN.forward drops rows with an
    empty history (boolean row indexing), packs the histories with pack_padded_sequence, and
    DynamicGRU walks PackedSequence.batch_sizes in a Python loop -> the legacy tracer freezes the
    traced batch's batch_sizes as constants (wrong results on other data) and the dynamo exporter
    cannot trace it. Replacement with the same modules and weights:
      * interest extractor: the same nn.GRU run on the padded (post-padded) history, outputs zeroed
        at padding (== pad_packed_sequence);
      * interest evolution: the same AttentionLayer and the same AUGRUCell, applied step by step over
        the padded history with h kept where the step is padding (== walking the packed batch);
        rows with an empty history keep h = 0 (== get_unmasked_tensor's zero rows).
    Unrolled over T (static), batch dynamic. Returns a function that switches orig/patched."""
    import torch
    from pandas.core.common import flatten
    DIEN = mod.DIEN
    orig_forward = DIEN.forward

    def forward(self, inputs):
        X = self.get_inputs(inputs)
        feature_emb_dict = self.embedding_layer(X)
        concat_emb = []
        for idx, (target_field, sequence_field) in enumerate(
                zip(self.dien_target_field, self.dien_sequence_field)):
            target_emb = self.get_embedding(target_field, feature_emb_dict)
            sequence_emb = self.get_embedding(sequence_field, feature_emb_dict)
            seq_field = list(flatten([sequence_field]))[0]
            pad_mask = X[seq_field].long() > 0
            maskf = pad_mask.float().unsqueeze(-1)
            # interest extraction: nn.GRU over the padded history
            interest_emb, _ = self.extraction_modules[idx](sequence_emb)
            interest_emb = interest_emb * maskf
            assert self.gru_type in ("AUGRU", "AGRU"), "patch covers the DynamicGRU types"
            attn_scores = self.attention_modules[idx](interest_emb, target_emb, pad_mask)
            cell = self.evolving_modules[idx].gru_cell
            h = torch.zeros_like(interest_emb[:, 0, :])
            for t in range(interest_emb.size(1)):
                h_new = cell(interest_emb[:, t, :], h, attn_scores[:, t])
                m = maskf[:, t, :]
                h = m * h_new + (1.0 - m) * h
            concat_emb.append(h)
            if self.enable_sum_pooling:
                sum_pool_emb = self.sum_pooling(sequence_emb)
                concat_emb += [sum_pool_emb, target_emb * sum_pool_emb]
        for feature, emb in feature_emb_dict.items():
            if emb.ndim == 2 and (feature not in flatten([self.dien_neg_seq_field])):
                concat_emb.append(emb)
        y_pred = self.dnn(torch.cat(concat_emb, dim=-1))
        return {"y_pred": y_pred}

    def use(which):
        DIEN.forward = forward if which == "patched" else orig_forward
    return use


# ----------------------------------------------------------------------------- exporter-side patches
def patch_onnxscript_zero_tolerance(enable=True):
    """WORKAROUND (dynamo exporter, export-time only): onnxscript 0.7.2's rewriter matches pattern
    constants with math.isclose(abs_tol=1e-8), so its no-op rule `x + 0 -> x` also fires on
    `x + 1e-12`. FuxiCTR's MaskedAveragePooling (default encoder of sequence features) divides by
    `mask.sum() + 1e-12`; after the rewrite an empty history gives 0/0 = NaN instead of 0. This
    makes pattern constants match 0 only exactly (abs_tol=0; rel_tol kept); every other rewrite is
    unchanged. Returns the onnxscript module patched (None if the layout changed).
    enable=False restores the stock behaviour (used to record what the unpatched export gives)."""
    import math
    try:
        from onnxscript.rewriter import _matcher
    except ImportError:
        return None
    if not enable:
        _matcher.math = math
        _matcher._fuxictr_zero_tol = False
        return _matcher
    if getattr(_matcher, "_fuxictr_zero_tol", False):
        return _matcher

    class _ExactZeroMath:
        def __getattr__(self, k):
            return getattr(math, k)

        @staticmethod
        def isclose(a, b, *, rel_tol=1e-9, abs_tol=0.0):
            return math.isclose(a, b, rel_tol=rel_tol, abs_tol=0.0)
    _matcher.math = _ExactZeroMath()
    _matcher._fuxictr_zero_tol = True
    return _matcher


def masked_select_translation():
    """Custom dynamo translation for aten.masked_select (no ONNX function is registered for it in
    torch 2.13; FuxiCTR's InnerProductInteraction(output="inner_product"), used by DLRM, calls it):
    Compress(Reshape(x, -1), Reshape(Expand(mask, Shape(x)), -1)) -- the row-major order of
    torch.masked_select. Passed as custom_translation_table; the model code is unchanged."""
    import torch
    from onnxscript import opset18 as op

    def masked_select(self, mask):
        m = op.Expand(mask, op.Shape(self))
        flat_shape = op.Constant(value_ints=[-1])
        return op.Compress(op.Reshape(self, flat_shape), op.Reshape(m, flat_shape), axis=0)
    return {torch.ops.aten.masked_select.default: masked_select}


# ----------------------------------------------------------------------------- export wrapper
def make_wrapper(model, names, out_keys):
    import torch

    class Wrapper(torch.nn.Module):
        """Positional tensors -> FuxiCTR input dict -> prediction tensor(s)."""
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, *args):
            out = self.model(dict(zip(names, args)))
            return tuple(out[k] for k in out_keys) if len(out_keys) > 1 else out[out_keys[0]]
    return Wrapper().eval()


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
    for f in m.functions:
        nodes.extend(f.node)
    hist = Counter(n.op_type if not n.domain or n.domain == "ai.onnx" else f"{n.domain}:{n.op_type}"
                   for n in nodes)
    return dict(nodes_total=len(nodes), nodes_top=len(m.graph.node), op_hist=dict(hist.most_common()),
                n_functions=len(m.functions), n_initializers=len(m.graph.initializer),
                opsets={o.domain or "ai.onnx": o.version for o in m.opset_import}, ir_version=m.ir_version,
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
            return float("inf"), f"shape mismatch for {k}: {o.shape} vs {r.shape}"
        if r.size:
            d = np.abs(o - r)
            if not np.all(np.isfinite(d)):
                return float("inf"), f"non-finite output for {k} (NaN/inf in {int((~np.isfinite(d)).sum())} values)"
            e = max(e, float(np.max(d)))
    return e, None


ONNX_NP = {1: np.float32, 7: np.int64, 6: np.int32, 9: np.bool_, 11: np.float64}


def onnx_feed(m, raw):
    """Cast/shape a raw batch to exactly what the ONNX graph inputs declare."""
    feed = {}
    for i in m.graph.input:
        a = np.asarray(raw[i.name]).astype(ONNX_NP[i.type.tensor_type.elem_type])
        rank = len(i.type.tensor_type.shape.dim)
        if a.ndim != rank:
            raise ValueError(f"input {i.name}: rank {a.ndim} vs ONNX rank {rank}")
        feed[i.name] = a
    return feed


def check_export(path, feeds, refs):
    """feeds/refs: lists over the check batches (first = the saved B=8 batch)."""
    import onnx
    res = {"size_bytes": os.path.getsize(path)}
    m = onnx.load(path)
    res.update(model_stats(m))
    try:
        onnx.checker.check_model(m, full_check=True)
        res["onnx_checker"] = "ok"
    except Exception as e:  # noqa
        res["onnx_checker"] = f"{type(e).__name__}: {str(e)[:300]}"
    try:
        import onnxruntime as ort
        s = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        names = [o.name for o in s.get_outputs()]
        res["ort_ok"] = True
        res["ort_errs"] = []
        for f, r in zip(feeds, refs):
            try:
                e, msg = max_err(dict(zip(names, s.run(None, f))), r)
                res["ort_errs"].append(e)
                if msg:
                    res.setdefault("ort_notes", []).append(msg)
            except Exception as ex:  # noqa
                res["ort_errs"].append(None)
                res.setdefault("ort_notes", []).append(f"{type(ex).__name__}: {str(ex)[:500]}")
    except Exception as e:  # noqa
        res["ort_ok"] = False
        res["ort_error"] = f"{type(e).__name__}: {str(e)[:800]}"
    try:
        import openvino as ov
        core = ov.Core()
        cm = core.compile_model(path, "CPU")
        res["ov_ok"] = True
        res["ov_errs"] = []
        # default CPU plugin settings may run in bf16 on CPUs with avx512_bf16/AMX; also record f32
        cm32 = core.compile_model(path, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
        res["ov_errs_f32"] = []
        for f, r in zip(feeds, refs):
            try:
                out = cm32(f)
                got = {nm: out[o] for o in cm32.outputs for nm in o.get_names() if nm in r}
                res["ov_errs_f32"].append(max_err(got, r)[0] if len(got) == len(r) else None)
            except Exception:  # noqa
                res["ov_errs_f32"].append(None)
        for f, r in zip(feeds, refs):
            try:
                out = cm(f)
                got = {}
                for o in cm.outputs:
                    for nm in o.get_names():
                        if nm in r:
                            got[nm] = out[o]
                e, msg = max_err(got, r) if len(got) == len(r) else (None, "output names not found")
                res["ov_errs"].append(e)
                if msg:
                    res.setdefault("ov_notes", []).append(msg)
            except Exception as ex:  # noqa
                res["ov_errs"].append(None)
                res.setdefault("ov_notes", []).append(f"{type(ex).__name__}: {str(ex)[:500]}")
    except Exception as e:  # noqa
        res["ov_ok"] = False
        res["ov_error"] = f"{type(e).__name__}: {str(e)[:1000]}"
    errs = res.get("ort_errs") or []
    res["keep"] = bool(res.get("ort_ok")) and len(errs) == len(feeds) and all(
        e is not None and e <= TOL for e in errs)
    return res


def finalize_onnx(path):
    import onnx
    m = onnx.load(path)
    orig = m.ir_version
    m.ir_version = min(m.ir_version, 10)
    onnx.save(m, path)
    return orig


def write_result(model_name, exporter, res):
    os.makedirs(RES_DIR, exist_ok=True)
    res.update(model=model_name, exporter=exporter)
    with open(os.path.join(RES_DIR, f"fuxictr_{model_name}_{exporter}.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    short = {k: res.get(k) for k in ("nodes_total", "size_bytes", "ort_errs", "ov_ok", "ov_errs", "ov_errs_f32",
                                      "keep", "patched_vs_library_max_diff",
                                      "export_error", "ort_error", "ov_error", "ort_notes", "ov_notes")
             if res.get(k) is not None}
    print(f"[fuxictr/{model_name}/{exporter}] {short}", flush=True)


# ----------------------------------------------------------------------------- one model
def export_and_check(wrapper, example, names, out_names, exporter, path, dyn_t, raws, refs, res,
                     custom_table=None, stock_optimizer=False):
    """Export with one exporter to `path`, check in ORT/OpenVINO; fills `res`, returns feeds/refs."""
    import torch
    import onnx
    seq_names = {n for n, _, _ in SEQ}
    t0 = time.time()
    try:
        if exporter == "legacy":
            dyn = {}
            for n in names:
                dyn[n] = {0: "batch", 1: "hist_len"} if (n in seq_names and dyn_t) else {0: "batch"}
            for o in out_names:
                dyn[o] = {0: "batch"}
            torch.onnx.export(wrapper, example, path, dynamo=False, opset_version=OPSET,
                              input_names=names, output_names=out_names, dynamic_axes=dyn)
        else:
            batch = torch.export.Dim("batch", min=1, max=4096)
            hist = torch.export.Dim("hist_len", min=1, max=1024)
            ds = tuple({0: batch, 1: hist} if (n in seq_names and dyn_t) else {0: batch} for n in names)
            res["onnxscript_zero_tol_patch"] = (patch_onnxscript_zero_tolerance(not stock_optimizer) is not None
                                                and not stock_optimizer)
            extra = {}
            if custom_table:
                extra["custom_translation_table"] = custom_table
                res["custom_translation"] = [str(k) for k in custom_table]
            prog = torch.onnx.export(wrapper, example, dynamo=True, opset_version=DYNAMO_OPSET,
                                     input_names=names, output_names=out_names,
                                     dynamic_shapes=(ds,), verbose=False, **extra)   # (*args,)
            prog.save(path)
        res["export_s"] = round(time.time() - t0, 2)
        res["orig_ir_version"] = finalize_onnx(path)
    except Exception as e:  # noqa
        res["export_s"] = round(time.time() - t0, 2)
        msg = str(e)
        if "## Exception summary" in msg:
            msg = msg.split("## Exception summary", 1)[1]
        res["export_error"] = f"{type(e).__name__}: {' '.join(msg.split())[:1500]}"
        res["export_traceback_tail"] = traceback.format_exc()[-3000:]
        if os.path.exists(path):
            os.remove(path)
        return None, None
    m = onnx.load(path)
    onames = [o.name for o in m.graph.output]
    try:
        feeds = [onnx_feed(m, r) for r in raws]
    except Exception as e:  # noqa
        res["export_error"] = f"input mismatch: {e}"
        os.remove(path)
        return None, None
    orefs = [OrderedDict(zip(onames, r.values())) for r in refs]
    res.update(check_export(path, feeds, orefs))
    return feeds, orefs


def run_one(model_name):
    import torch
    torch.set_num_threads(1)
    model, fm, mod = make_model(model_name)
    names = input_names(model_name)
    out_keys = [f"{lab}_pred" for lab in fm.labels] if model_name in MULTITASK else ["y_pred"]
    out_names = out_keys
    use = patch_dien(mod) if model_name == "DIEN" else None
    raws = batches(model_name)
    raws_static = batches(model_name, static_t=True)

    def eager(raw):
        with torch.no_grad():
            out = model({k: torch.from_numpy(np.ascontiguousarray(raw[k])) for k in names})
        return OrderedDict((k, out[k].detach().numpy().copy()) for k in out_keys)

    refs = [eager(r) for r in raws]     # references: unpatched FuxiCTR code
    refs_static = [eager(r) for r in raws_static]
    info = {"eager_out_shapes": {k: list(v.shape) for k, v in refs[0].items()},
            "check_batches": [[int(next(iter(r.values())).shape[0]), int(r["hist_item_id"].shape[1]),
                               [int(x) for x in (r["hist_item_id"] > 0).sum(1)]] for r in raws]}
    wrapper = make_wrapper(model, names, out_keys)
    example = tuple(torch.from_numpy(np.ascontiguousarray(raws[0][k])) for k in names)
    dyn_t = model_name not in STATIC_T
    if use:
        # record what the plain library code gives (export to a scratch dir, never kept)
        import tempfile
        tmp = tempfile.mkdtemp(prefix="fuxictr_unpatched_")
        for exporter in ("legacy", "dynamo"):
            r = {}
            export_and_check(wrapper, example, names, out_names, exporter,
                             os.path.join(tmp, f"{model_name}_{exporter}.onnx"), dyn_t, raws, refs, r)
            info[f"unpatched_{exporter}"] = {k: r.get(k) for k in (
                "export_error", "ort_ok", "ort_error", "ort_errs", "ort_notes", "nodes_total", "keep")
                if r.get(k) is not None}
            print(f"[fuxictr/{model_name}/{exporter} UNPATCHED library code] {info[f'unpatched_{exporter}']}",
                  flush=True)
        use("patched")
        info["patched_vs_library_max_diff"] = max(max_err(eager(r), ref)[0] for r, ref in zip(raws, refs))

    # record what the dynamo export gives with the stock onnxscript optimizer (scratch dir, not kept)
    import tempfile
    tmp = tempfile.mkdtemp(prefix="fuxictr_stockopt_")
    r = {}
    export_and_check(wrapper, example, names, out_names, "dynamo", os.path.join(tmp, "m.onnx"), dyn_t,
                     raws, refs, r, stock_optimizer=True,
                     custom_table=masked_select_translation() if model_name == "DLRM" else None)
    info["dynamo_stock_optimizer"] = {k: r.get(k) for k in (
        "export_error", "ort_ok", "ort_errs", "ort_notes", "nodes_total", "keep") if r.get(k) is not None}
    print(f"[fuxictr/{model_name}/dynamo, stock onnxscript optimizer] {info['dynamo_stock_optimizer']}",
          flush=True)

    for exporter in ("legacy", "dynamo"):
        stem = f"fuxictr_{model_name}_{exporter}"
        path = os.path.join(OUT, stem + ".onnx")
        dyn_e = dyn_t and (model_name, exporter) not in STATIC_T_EXPORTER
        rw, rf = (raws, refs) if dyn_e else (raws_static, refs_static)
        res = dict(info, dynamic_history=dyn_e)
        if not dyn_e:
            res["check_batches"] = [[int(next(iter(r.values())).shape[0]), int(r["hist_item_id"].shape[1]),
                                     [int(x) for x in (r["hist_item_id"] > 0).sum(1)]] for r in rw]
        for ext in (".onnx", ".npz", ".ref.npz"):
            if os.path.exists(os.path.join(OUT, stem + ext)):
                os.remove(os.path.join(OUT, stem + ext))
        feeds, orefs = export_and_check(wrapper, example, names, out_names, exporter, path, dyn_e,
                                        rw, rf, res,
                                        custom_table=masked_select_translation()
                                        if (model_name == "DLRM" and exporter == "dynamo") else None)
        if feeds is not None:
            if res["keep"]:
                np.savez(os.path.join(OUT, stem + ".npz"), **feeds[0])
                np.savez(os.path.join(OUT, stem + ".ref.npz"), **orefs[0])
            else:
                os.remove(path)
        write_result(model_name, exporter, res)
    if use:
        use("orig")


# ----------------------------------------------------------------------------- report
def report():
    rows = []
    if os.path.isdir(RES_DIR):
        for fn in sorted(os.listdir(RES_DIR)):
            if fn.startswith("fuxictr_") and fn.endswith(".json"):
                with open(os.path.join(RES_DIR, fn)) as f:
                    rows.append(json.load(f))
    order = {m: i for i, m in enumerate(MODELS)}
    rows.sort(key=lambda r: (order.get(r["model"], 99), r["exporter"]))

    def fe(x):
        return "-" if x is None else f"{x:.1e}"
    lines = ["| file | kept | nodes | size KB | ORT err B8/B5/B33 | OpenVINO | notes |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        stem = f"fuxictr_{r['model']}_{r['exporter']}"
        if "export_error" in r:
            lines.append(f"| {stem} | no | - | - | - | - | export failed: {r['export_error'][:200]} |")
            continue
        ort = "/".join(fe(e) for e in r.get("ort_errs", [])) if r.get("ort_ok") else "load failed"
        if r.get("ov_ok"):
            ov = "ok " + "/".join(fe(e) for e in r.get("ov_errs", []))
            ov += " (f32 hint " + "/".join(fe(e) for e in r.get("ov_errs_f32", [])) + ")"
            if r.get("ov_notes"):
                ov += " (" + r["ov_notes"][0][:120] + ")"
        else:
            ov = "compile failed: " + (r.get("ov_error") or "")[:160]
        notes = "; ".join(r.get("ort_notes", []))[:200] or (r.get("ort_error") or "")[:200]
        so = r.get("dynamo_stock_optimizer")
        if r["exporter"] == "dynamo" and so and not so.get("keep"):
            notes = ("stock onnxscript optimizer: " + (so.get("export_error") or "; ".join(so.get("ort_notes", []))
                                                        or str(so.get("ort_errs"))))[:160] + "; " + notes
        if "patched_vs_library_max_diff" in r:
            notes = f"patched vs library eager {r['patched_vs_library_max_diff']:.1e}; " + notes
        lines.append(f"| {stem} | {'yes' if r.get('keep') else 'NO'} | {r.get('nodes_total')} | "
                     f"{r.get('size_bytes', 0) / 1024:.0f} | {ort} | {ov} | {notes} |")
    out = "\n".join(lines)
    print(out)
    return out


def main():
    args = sys.argv[1:]
    if args and args[0] == "report":
        report()
        return
    if args and args[0] == "--one":
        run_one(args[1])
        return
    for mname in (args or MODELS):
        t0 = time.time()
        p = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", mname], cwd=HERE)
        print(f"== {mname}: rc={p.returncode} {time.time() - t0:.0f}s", flush=True)
        if p.returncode != 0:
            for ex in ("legacy", "dynamo"):
                fn = os.path.join(RES_DIR, f"fuxictr_{mname}_{ex}.json")
                if not os.path.exists(fn) or os.path.getmtime(fn) < t0:
                    write_result(mname, ex, {"export_error": f"subprocess exited rc={p.returncode}"})
    report()


if __name__ == "__main__":
    main()
