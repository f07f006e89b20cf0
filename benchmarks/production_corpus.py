"""The production-sized third-party corpus (issue 50): the libraries of tests/data/thirdparty, regenerated at the
widths that serving sees, written outside the repository.

    python benchmarks/production_corpus.py list
    python benchmarks/production_corpus.py make --lib deepctr_torch -o /tmp/prodcorpus
    python benchmarks/production_corpus.py make --lib deepctr_tf --models DeepFM,DIN_h50 -o /tmp/prodcorpus
    python benchmarks/production_corpus.py make --lib torch_rechub -o /tmp/prodcorpus
    python benchmarks/production_corpus.py make --lib fuxictr --models DLRM -o /tmp/prodcorpus
    (libraries: deepctr_torch deepctr_tf torch_rechub fuxictr recbole paddlerec torchfm widedeep tfrs torchrec)

Each library runs in its own virtual environment, the one its fixture script's docstring names (make_exports.py for
deepctr_torch and deepctr_tf, make_torch_rechub.py for torch_rechub), looked up as $CTROPT_VENVS/<venv>/bin/python
(default /work/venvs: `deepctr` holds torch==2.13.0, tensorflow-cpu 2.21, tf_keras, tf2onnx 1.17, deepctr-torch 0.3.0
and deepctr 0.9.4; `torch_rechub` holds torch==2.13.0 and torch-rechub 0.9.0; both onnx, onnxscript, onnxruntime),
or given with --python. Every (library, model, exporter) runs in a subprocess of its own, one at a time.
The other libraries' venvs (torch always pinned to 2.13.0: /opt/wheels' CPU build; unpinned, pip pulls CUDA):
  fuxictr    make_fuxictr.py's: torch==2.13.0 onnx onnxscript onnxruntime numpy pandas pyyaml scikit-learn h5py
             tqdm pyarrow polars, then `pip install --no-deps fuxictr==2.3.10`; the model zoo from a snapshot of
             reczoo/FuxiCTR at 0245987 in $FUXICTR_SRC (default /work/thirdparty_src/fuxictr)
  recbole    make_recbole.py's: torch==2.13.0 recbole==1.2.1 onnx onnxscript onnxruntime numpy "pandas<3"
  paddle3    make_paddlerec.py's: paddlepaddle==3.1.1 paddle2onnx==2.1.0 onnx==1.17.0 onnxruntime numpy polygraphy
             onnx_graphsurgeon sympy six; PaddleRec's models/ at 656326a in $PADDLEREC_SRC
             (default /work/thirdparty_src/paddlerec)
  torchfm    torch==2.13.0 numpy onnx onnxscript onnxruntime, then `pip install --no-deps torchfm==0.7.0`
  widedeep   torch==2.13.0 "numpy<2" scipy pandas scikit-learn einops torchmetrics tqdm wrapt pyarrow onnx onnxscript
             onnxruntime, then `pip install --no-deps pytorch-widedeep==1.7.0` (its text / image / word-vector
             dependencies, never used by these models, are stubbed at import: stub_modules)
  tfrs       a copy of `deepctr` plus `pip install --no-deps tensorflow-recommenders==0.7.7`
  torchrec   torch==2.13.0, torchrec==1.9.2, fbgemm-gpu-cpu==1.9.0 (--no-deps: torchrec's own dependency pulls the
             CUDA fbgemm-gpu over it). Does not load: fbgemm-gpu-cpu 1.9.0 is built against an older torch
             (undefined symbols in fbgemm_gpu_*.so under torch 2.13.0), and no fbgemm release matches 2.13; the
             runner is kept for a venv with a matching pair.
Dropped by the 1e-4 check or the exporter (2026-12, results/*.json say why): widedeep xDeepFM (both exporters: its
logits sit near 395, where float32's spacing is 3e-5, off by 1.2e-4); fuxictr TransAct_h50 legacy (0.06 at B=256, 3e-7
at B=7: eager nn.TransformerEncoder takes its nested-tensor fast path, padded positions 0, the traced slow path
computes them, and the max-pool over the history sees them); recbole DIEN_GRU_h50 dynamo (torch.export refuses
pack_padded_sequence, as in the fixture); torch_rechub DIEN_h50 dynamo, SASRec_h50 (both; SASRec_arange is kept).
Libraries without a fixture script here (torchfm, widedeep, tfrs) are built from the library's own model classes
with this script's seeded weights (seeded_init; tfrs: make_exports.init_tf_weights).

The models are built by the fixture scripts' own builders (build_torch_model / build_tf_model / make_model), with
the production sizes below instead of their toy ones, and exported the way the fixtures export them (export_torch,
tf2onnx.convert.from_function on tf_serving's function, make_torch_rechub.export), with the same seeded weights and
the same workarounds (deepctr-torch DIEN `_padded`, DeepCTR DIEN `_where`), plus one of this script's:
SASRec_arange (torch-rechub SASRec's host-side positions, which no exporter can keep dynamic, from torch.arange).
DeepCTR models are converted from a twin with small tables, the real tables put in after (see deepctr_tf).
Families:
  dense   26 sparse fields C1..C26 (vocabularies: Criteo's, clipped to 10^3..10^6, 5.58M rows in all) and 13 dense
          I1..I13; embedding 16; MLP 400-400-400 or 1024-512-256; DCN 3 cross layers; xDeepFM CIN 200-200-200;
          MMoE 8 experts of 256, PLE 2 levels of 4 shared + 2 per task; DLRM bottom 512-256-64(-16), top
          512-256(-1), as the Criteo Kaggle DLRM.
  seq     user_id 10^6, user_city 10^4, user_age 10^3, item 10^6 and cate 10^4 (shared by the target and its
          history), embedding 32 (BST 32 per field: 64 wide, 4 heads; SASRec 64, 2 heads); histories of 50 or 200
          (`_h50`, `_h200`); MLP 1024-512-256, DIN attention 80-40.
Per kept export, under -o:
    <lib>_<Model>_<exporter>_prod.onnx (+ .onnx.data: every tensor of 1 MiB or more, as ONNX external data)
    <lib>_<Model>_<exporter>_prod.npz       256 rows, keys = graph input names: Zipf-skewed ids (a few hot ids
                                            scattered over each table), cate ids a function of the item id; in
                                            sequence models mixed history lengths (0-padded), and rows 0-127 four
                                            users of 32 candidates each (same user fields and history)
    <lib>_<Model>_<exporter>_prod.ref.npz   the framework's eager outputs on it, keys = graph output names
    results/<stem>.json                     sizes, parameters, timings, the max differences, or the failure
An export is kept only when onnxruntime (CPU) matches the framework within 1e-4 (abs) on that batch and on a batch
of 7 (rows 0-2 one user); otherwise its files are removed and the failure is recorded. Nothing is downloaded, all
weights are random (seeded). Toy exports stay the unit-test fixtures; nothing here is a speed measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
THIRD = HERE.parent / "tests" / "data" / "thirdparty"
VENVS = Path(os.environ.get("CTROPT_VENVS", "/work/venvs"))
BATCH, BATCH2, TOL = 256, 7, 1e-4
SHARED = 4, 32                 # rows 0..127: 4 users x 32 candidates
INLINE_BYTES = 1 << 20
SEED = 50

# Criteo (Kaggle display advertising) cardinalities of C1..C26, clipped to 10^3..10^6.
CRITEO = [1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992, 5461306,
          10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572]
DENSE_VOCABS = [min(max(v, 10**3), 10**6) for v in CRITEO]
USER = {"user_id": 10**6, "user_city": 10**4, "user_age": 10**3}
ITEM, CATE = 10**6, 10**4
W400, W1024 = (400, 400, 400), (1024, 512, 256)
# Embedding std of the fixtures' seeded weights (theirs: 0.3): with 0.3, FM and linear terms over 26 fields saturate
# half the dense models' outputs; with 0.1 the 1024-512-256 sequence models' outputs stay within 0.52-0.56.
EMB_STD = {"dense": 0.1, "seq": 0.5}


@dataclass(frozen=True)
class Spec:
    model: str                  # the library's model, as the fixture's builder names it
    family: str                 # "dense" | "seq"
    emb: int
    hist: int = 0               # padded history length (seq family)
    sizes: dict = field(default_factory=dict)   # over the fixture's TOY_SIZES
    patch: str = ""             # an export workaround of this script's (references always from the library's code)


SEQ_SIZES = dict(hid=W1024, att=(80, 40), mlp=list(W1024))
DENSE = {
    "DeepFM": Spec("DeepFM", "dense", 16, sizes=dict(hid=W400)),
    "WDL": Spec("WDL", "dense", 16, sizes=dict(hid=W1024)),
    "DCN": Spec("DCN", "dense", 16, sizes=dict(hid=W1024, cross_num=3)),
    "xDeepFM": Spec("xDeepFM", "dense", 16, sizes=dict(hid=W400, cin=(200, 200, 200))),
    "MMOE": Spec("MMOE", "dense", 16, sizes=dict(experts=8, expert_hid=(256,), gate=(64,), tower=(128,))),
}
MODELS = {
    "deepctr_torch": {
        **DENSE,
        "DCNMix": Spec("DCNMix", "dense", 16, sizes=dict(hid=W400, cross_num=3, low_rank=64, experts=4)),
        "DIN_h50": Spec("DIN", "seq", 32, 50, SEQ_SIZES),
        "DIN_h200": Spec("DIN", "seq", 32, 200, SEQ_SIZES),
        "DIEN_AUGRU_padded_h50": Spec("DIEN_AUGRU_padded", "seq", 32, 50, SEQ_SIZES),
    },
    "deepctr_tf": {
        **DENSE,
        "DIN_h50": Spec("DIN", "seq", 32, 50, SEQ_SIZES),
        "DIN_h200": Spec("DIN", "seq", 32, 200, SEQ_SIZES),
        "DIEN_AUGRU_where_h50": Spec("DIEN_AUGRU_where", "seq", 32, 50, SEQ_SIZES),
        "BST_h50": Spec("BST", "seq", 32, 50, dict(hid=W1024, heads=4)),
    },
    "torch_rechub": {
        "DIN_h50": Spec("DIN", "seq", 32, 50, SEQ_SIZES),
        "DIN_h200": Spec("DIN", "seq", 32, 200, SEQ_SIZES),
        "DIEN_h50": Spec("DIEN", "seq", 32, 50, SEQ_SIZES),
        "BST_h50": Spec("BST", "seq", 32, 50, dict(mlp=list(W1024), heads=4, bst_max_len=51)),
        "SASRec_h50": Spec("SASRec", "seq", 64, 50, dict(heads=2, sasrec_len=50)),
        "SASRec_arange_h50": Spec("SASRec", "seq", 64, 50, dict(heads=2, sasrec_len=50), patch="sasrec_arange"),
    },
}
# FuxiCTR: Spec.sizes are the zoo model's own keyword arguments (embedding_dim is Spec.emb).
FUXI_TARGET, FUXI_SEQ = [("item_id", "cate_id")], [("hist_item_id", "hist_cate_id")]
FUXI_MT = dict(task=["binary_classification"] * 2, num_tasks=2, gate_hidden_units=[64], tower_hidden_units=[128])
FUXI_DIN = dict(dnn_hidden_units=list(W1024), attention_hidden_units=[80, 40], attention_hidden_activations="Dice",
                din_target_field=FUXI_TARGET, din_sequence_field=FUXI_SEQ, din_use_softmax=False)
MODELS["fuxictr"] = {
    "DLRM": Spec("DLRM", "dense", 16, sizes=dict(bottom_mlp_units=[512, 256, 64], top_mlp_units=[512, 256],
                                                  interaction_op="dot")),
    "DCNv2": Spec("DCNv2", "dense", 16, sizes=dict(model_structure="parallel", num_cross_layers=3,
                                                    parallel_dnn_hidden_units=list(W1024))),
    "DeepFM": Spec("DeepFM", "dense", 16, sizes=dict(hidden_units=list(W400))),
    "WideDeep": Spec("WideDeep", "dense", 16, sizes=dict(hidden_units=list(W1024))),
    "xDeepFM": Spec("xDeepFM", "dense", 16, sizes=dict(dnn_hidden_units=list(W400), cin_hidden_units=[200] * 3)),
    "FinalMLP": Spec("FinalMLP", "dense", 16, sizes=dict(mlp1_hidden_units=list(W400), mlp2_hidden_units=list(W400),
                                                          use_fs=True, fs_hidden_units=[800], fs1_context=["C1"],
                                                          fs2_context=["C2"], num_heads=4)),
    "AutoInt": Spec("AutoInt", "dense", 16, sizes=dict(dnn_hidden_units=list(W400), attention_layers=3, num_heads=2,
                                                        attention_dim=64, use_residual=True, use_wide=False,
                                                        layer_norm=True, use_scale=True)),
    "MMoE": Spec("MMoE", "dense", 16, sizes=dict(FUXI_MT, num_experts=8, expert_hidden_units=[256])),
    "PLE": Spec("PLE", "dense", 16, sizes=dict(FUXI_MT, num_layers=2, num_shared_experts=4, num_specific_experts=2,
                                                expert_hidden_units=[256])),
    "DIN_h50": Spec("DIN", "seq", 32, 50, FUXI_DIN),
    "DIN_h200": Spec("DIN", "seq", 32, 200, FUXI_DIN),
    "DIEN_h50": Spec("DIEN", "seq", 32, 50, dict(
        dnn_hidden_units=list(W1024), gru_type="AUGRU", attention_type="bilinear_attention",
        use_attention_softmax=True, batch_norm=True, dien_target_field=FUXI_TARGET, dien_sequence_field=FUXI_SEQ,
        dien_neg_seq_field=[("neg_hist_item_id", "neg_hist_cate_id")], aux_loss_alpha=0), patch="dien"),
    "BST_h50": Spec("BST", "seq", 32, 50, dict(
        dnn_hidden_units=list(W1024), num_heads=4, stacked_transformer_layers=1, bst_target_field=FUXI_TARGET,
        bst_sequence_field=FUXI_SEQ, seq_pooling_type="mean", use_position_emb=True)),
    "TransAct_h50": Spec("TransAct", "seq", 32, 50, dict(
        dcn_cross_layers=3, dcn_hidden_units=list(W1024), mlp_hidden_units=[], num_heads=4, transformer_layers=1,
        dim_feedforward=256, target_item_field=FUXI_TARGET, sequence_item_field=FUXI_SEQ, first_k_cols=1,
        concat_max_pool=True)),
}
MODELS["torchrec"] = {
    "DLRM": Spec("DLRM", "dense", 16, sizes=dict(bottom=[512, 256, 64], top=[512, 256])),
}
# torchfm (rixwew/pytorch-fm, pip torchfm 0.7.0): Spec.model = torchfm.model.<module>.<class>, sizes = its arguments
# after field_dims (categorical fields only: the 26 C fields, one table with per-field offsets).
MODELS["torchfm"] = {
    "DeepFM": Spec("dfm.DeepFactorizationMachineModel", "dense", 16,
                   sizes=dict(embed_dim=16, mlp_dims=list(W400), dropout=0.0)),
    "xDeepFM": Spec("xdfm.ExtremeDeepFactorizationMachineModel", "dense", 16,
                    sizes=dict(embed_dim=16, mlp_dims=list(W400), dropout=0.0, cross_layer_sizes=[200] * 3)),
    "DCN": Spec("dcn.DeepCrossNetworkModel", "dense", 16,
                sizes=dict(embed_dim=16, num_layers=3, mlp_dims=list(W1024), dropout=0.0)),
    "WideDeep": Spec("wd.WideAndDeepModel", "dense", 16, sizes=dict(embed_dim=16, mlp_dims=list(W1024), dropout=0.0)),
    "AutoInt": Spec("afi.AutomaticFeatureInteractionModel", "dense", 16,
                    sizes=dict(embed_dim=16, atten_embed_dim=64, num_heads=2, num_layers=3, mlp_dims=list(W400),
                               dropouts=[0.0, 0.0])),
    "PNN": Spec("pnn.ProductNeuralNetworkModel", "dense", 16,
                sizes=dict(embed_dim=16, mlp_dims=list(W400), dropout=0.0, method="inner")),
    "NFM": Spec("nfm.NeuralFactorizationMachineModel", "dense", 16,
                sizes=dict(embed_dim=16, mlp_dims=list(W400), dropouts=[0.0, 0.0])),
}
# pytorch-widedeep 1.7.0: Spec.model = the class (pytorch_widedeep.models.rec, or TabMlp for WideDeep), sizes = its
# arguments; every model is the deeptabular (deeptext: Transformer) component of the library's WideDeep.
WD_DIN = dict(attention_unit_activation="dice", mlp_hidden_dims=list(W1024))
MODELS["widedeep"] = {
    "DeepFM": Spec("DeepFactorizationMachine", "dense", 16, sizes=dict(num_factors=16, mlp_hidden_dims=list(W400))),
    "xDeepFM": Spec("ExtremeDeepFactorizationMachine", "dense", 16,
                    sizes=dict(input_dim=16, cin_layer_dims=[200] * 3, mlp_hidden_dims=list(W400))),
    "AutoIntPlus": Spec("AutoIntPlus", "dense", 16, sizes=dict(input_dim=16, num_heads=2, num_layers=3,
                                                                structure="parallel", gated=True,
                                                                embed_continuous_method="standard",
                                                                mlp_hidden_dims=list(W400))),
    "DCN": Spec("DeepCrossNetwork", "dense", 16, sizes=dict(n_cross_layers=3, mlp_hidden_dims=list(W1024))),
    "DCNv2": Spec("DeepCrossNetworkV2", "dense", 16, sizes=dict(num_cross_layers=3, low_rank=64, num_experts=4,
                                                                 structure="parallel", mlp_hidden_dims=list(W1024))),
    "GDCN": Spec("GatedDeepCrossNetwork", "dense", 16, sizes=dict(num_cross_layers=3, structure="parallel",
                                                                   mlp_hidden_dims=list(W1024))),
    "WideDeep": Spec("TabMlp", "dense", 16, sizes=dict(mlp_hidden_dims=list(W1024))),
    "DIN_h50": Spec("DeepInterestNetwork", "seq", 32, 50, WD_DIN),
    "DIN_h200": Spec("DeepInterestNetwork", "seq", 32, 200, WD_DIN),
    "Transformer_h50": Spec("Transformer", "seq", 64, 50, dict(n_heads=2, n_blocks=2, ff_factor=4)),
}
# RecBole 1.2.1: Spec.sizes = its config (model yaml keys); the dataset is synthetic, 10^6 users and items.
RB_CTR = dict(embedding_size=32, mlp_hidden_size=[256, 256, 256])       # DIN.yaml / DIEN.yaml widths
RB_TF = dict(hidden_size=64, inner_size=256, n_layers=2, n_heads=2)   # SASRec.yaml
MODELS["recbole"] = {
    "DIN_h50": Spec("DIN", "seq", 32, 50, RB_CTR),
    "DIN_h200": Spec("DIN", "seq", 32, 200, RB_CTR),
    "DIEN_GRU_h50": Spec("DIEN", "seq", 32, 50, dict(RB_CTR, gru_type="GRU", alpha=1.0)),
    "SASRec_h50": Spec("SASRec", "seq", 64, 50, RB_TF),
}
# TensorFlow Recommenders 0.7.7: its Ranking model (tfrs.experimental.models) with the feature interaction of each
# family member; sizes: bottom / top stacks (tfrs.layers.blocks.MLP), cross layers (tfrs.layers.dcn.Cross).
MODELS["tfrs"] = {
    "DLRM": Spec("DLRM", "dense", 16, sizes=dict(bottom=[512, 256, 64, 16], top=[512, 256, 1])),
    "DCN": Spec("DCN", "dense", 16, sizes=dict(bottom=[512, 256, 64, 16], top=[1024, 512, 256, 1], cross=3)),
    "DCNv2_lowrank": Spec("DCN", "dense", 16, sizes=dict(bottom=[512, 256, 64, 16], top=[1024, 512, 256, 1],
                                                          cross=3, projection_dim=64)),
}
# PaddleRec (models/ at 656326a): Spec.sizes = the hyper_parameters over make_paddlerec.HP's. The Criteo models
# share one table of sparse_feature_number rows (PaddleRec's hashed slots): the 26 vocabularies laid end to end.
PR_CRITEO = dict(sparse_feature_number=sum(DENSE_VOCABS), sparse_feature_dim=16)
MODELS["paddlerec"] = {
    "DLRM": Spec("DLRM", "dense", 16, sizes=dict(PR_CRITEO, bot_layer_sizes=[512, 256, 64, 16],
                                                  top_layer_sizes=[512, 256, 2])),
    "DCN": Spec("DCN", "dense", 16, sizes=dict(PR_CRITEO, fc_sizes=list(W1024), cross_num=3)),
    "DeepFM": Spec("DeepFM", "dense", 16, sizes=dict(PR_CRITEO, fc_sizes=list(W400))),
    "WideDeep": Spec("WideDeep", "dense", 16, sizes=dict(PR_CRITEO, fc_sizes=list(W1024))),
    "MMoE": Spec("MMoE", "dense", 0, sizes=dict(feature_size=512, expert_num=8, expert_size=256, tower_size=128)),
    "PLE": Spec("PLE", "dense", 0, sizes=dict(feature_size=512, exp_per_task=2, shared_num=4, expert_size=256,
                                               tower_size=128, level_number=2)),
    "DIN_h50": Spec("DIN", "seq", 32, 50, dict(item_emb_size=32, cat_emb_size=32, item_count=ITEM, cat_count=CATE)),
    "BST_h50": Spec("BST", "seq", 32, 50, dict(item_emb_size=32, cat_emb_size=32, position_emb_size=32, item_count=ITEM,
                                                user_count=USER["user_id"], cat_count=CATE, position_count=64,
                                                d_model=96, d_key=24, d_value=24, n_head=4, d_inner_hid=384,
                                                fc_sizes=list(W1024))),
}
LIBS = {  # library -> (venv, fixture module, exporters)
    "deepctr_torch": ("deepctr", "make_exports", ("legacy", "dynamo")),
    "deepctr_tf": ("deepctr", "make_exports", ("tf2onnx",)),
    "torch_rechub": ("torch_rechub", "make_torch_rechub", ("legacy", "dynamo")),
    "fuxictr": ("fuxictr", "make_fuxictr", ("legacy", "dynamo")),
    "torchrec": ("torchrec", "make_torchrec", ("dynamo",)),
    "torchfm": ("torchfm", None, ("legacy", "dynamo")),
    "widedeep": ("widedeep", None, ("legacy", "dynamo")),
    "recbole": ("recbole", "make_recbole", ("legacy", "dynamo")),
    "tfrs": ("tfrs", "make_exports", ("tf2onnx",)),
    "paddlerec": ("paddle3", "make_paddlerec", ("paddle2onnx",)),
}


# ------------------------------------------------------------------------------------------------------ features
def feature_spec(lib: str, spec: Spec) -> list[tuple]:
    """The model's features in the fixtures' (name, kind, vocabulary or width, shared table) form."""
    if spec.family == "dense":
        return ([(f"C{i + 1}", "sparse", v, None) for i, v in enumerate(DENSE_VOCABS)]
                + [(f"I{i + 1}", "dense", 1, None) for i in range(13)])
    if lib == "torch_rechub":
        if spec.model == "SASRec":
            return [("seq", "seq", ITEM, None), ("pos", "seq", ITEM, "seq"), ("neg", "seq", ITEM, "seq")]
        hist = [(p + n, "seq", v, t) for p in ("", "neg_")
                for n, v, t in (("hist_item", ITEM, "target_item"), ("hist_cate", CATE, "target_cate"))]
        return [(n, "sparse", v, None) for n, v in rechub_vocab().items()] + hist
    return ([(n, "sparse", v, None) for n, v in USER.items()]
            + [("item_id", "sparse", ITEM, None), ("cate_id", "sparse", CATE, None),
               ("price", "dense", 1, None), ("score", "dense", 1, None),
               ("hist_item_id", "seq", ITEM, "item_id"), ("hist_cate_id", "seq", CATE, "cate_id")])


def rechub_vocab() -> dict[str, int]:
    return {**USER, "target_item": ITEM, "target_cate": CATE}


def user_side(name: str) -> bool:
    return name.startswith(("user", "hist", "neg_hist", "seq")) or name == "seq_length"


def make_batch(feats: list[tuple], rows: int, hist: int, seed: int, min_len: int = 1) -> dict:
    """Raw feature values: ids int64 (Zipf-skewed, 1..vocab-1; a cate id is a function of its item id), dense
    float32 [rows, d] (log1p of skewed counts, min-max scaled), histories int64 [rows, hist] 0-padded past each
    row's length (`seq_length`); the first rows come in groups that share every user-side feature."""
    import numpy as np
    zipf_ids = load_module("scale", HERE / "scale.py").zipf_ids
    rng = np.random.default_rng(seed)
    lens = np.zeros(rows, np.int64)
    if hist:    # a long tail of short histories, a quarter full, some of the shortest length
        lens = np.clip(rng.geometric(3.0 / hist, rows), min_len, hist)
        lens[rng.random(rows) < 0.25] = hist
        lens[rng.random(rows) < 0.05] = min_len
    pad = np.arange(hist)[None, :] >= lens[:, None]
    d = {}
    for name, kind, v, _ in feats:
        if kind == "dense":
            counts = np.minimum(rng.zipf(1.5, (rows, v)) - 1, 10**5)
            d[name] = (np.log1p(counts) / np.log1p(10**5)).astype(np.float32)
            continue
        shape = (rows, hist) if kind == "seq" else rows
        source = name.replace("cate", "item")
        if source != name and source in d:
            ids = (d[source] * 2654435761 % (v - 1) + 1)
        else:
            ids = zipf_ids(rng, v, shape, 1)
        d[name] = np.where(pad, 0, ids) if kind == "seq" else ids
    if hist:
        d["seq_length"] = lens.astype(np.int64)
    groups, size = SHARED if rows >= SHARED[0] * SHARED[1] else (1, 3)
    for g in range(groups):
        first = g * size
        for name in d:
            if user_side(name):
                d[name][first:first + size] = d[name][first]
    return d


# ------------------------------------------------------------------------------------------------------ saving
def save_external(path: Path) -> None:
    """Rewrite the export as <path> + <path>.data (every tensor of 1 MiB or more), ir_version <= 10."""
    import onnx
    m = onnx.load(str(path))
    m.ir_version = min(m.ir_version, 10)
    for stale in (path, Path(str(path) + ".data")):
        if stale.exists():
            stale.unlink()
    onnx.save_model(m, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=path.name + ".data", size_threshold=INLINE_BYTES)


def ort_diffs(path: Path, batches: list[tuple[dict, list]]) -> tuple[list[float], list[str], list[str]]:
    """Max |onnxruntime - framework| over every output, per (inputs, framework outputs) batch."""
    import numpy as np
    import onnxruntime as ort
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    inputs = [i.name for i in sess.get_inputs()]
    outputs = [o.name for o in sess.get_outputs()]
    diffs = []
    for feeds, refs in batches:
        got = sess.run(None, {k: feeds[k] for k in inputs})
        if len(got) != len(refs):
            raise ValueError(f"{len(got)} ONNX outputs vs {len(refs)} framework outputs")
        diffs.append(max(float(np.abs(g - np.asarray(r).reshape(g.shape)).max()) for g, r in zip(got, refs)))
    return diffs, inputs, outputs


def keep_or_drop(path: Path, batches: list[tuple[dict, list]], res: dict) -> dict:
    """Check the export on both batches; keep it with its .npz/.ref.npz, or remove its files."""
    import numpy as np
    save_external(path)
    first = np.asarray(batches[0][1][0], dtype=np.float64)
    res["output0_quantiles_0_10_50_90_100"] = [round(float(q), 4) for q in np.percentile(first, [0, 10, 50, 90, 100])]
    try:
        diffs, inputs, outputs = ort_diffs(path, batches)
        res.update(max_diff_b256=diffs[0], max_diff_b7=diffs[1], keep=max(diffs) <= TOL)
    except Exception as e:  # noqa: BLE001  (a failure is recorded, not raised)
        res.update(keep=False, error=f"onnxruntime: {type(e).__name__}: {str(e)[:600]}")
    if res["keep"]:
        stem = str(path)[:-len(".onnx")]
        np.savez(stem + ".npz", **{k: batches[0][0][k] for k in inputs})
        np.savez(stem + ".ref.npz", **dict(zip(outputs, batches[0][1])))
        data = Path(str(path) + ".data")
        res["bytes"] = path.stat().st_size + (data.stat().st_size if data.exists() else 0)
    else:
        remove(path)
    return res


def remove(path: Path) -> None:
    stem = str(path)[:-len(".onnx")]
    for f in (str(path), str(path) + ".data", stem + ".npz", stem + ".ref.npz"):
        if os.path.exists(f):
            os.remove(f)


# ------------------------------------------------------------------------------------------------------ libraries
def sizes(fx, spec: Spec) -> dict:
    return {**fx.TOY_SIZES, **spec.sizes}


def deepctr_torch(fx, spec: Spec, exporter: str, path: Path, res: dict) -> list:
    """deepctr-torch: the fixture's builder at production sizes; model(X) with X the flattened feature matrix."""
    import numpy as np
    import torch
    torch.manual_seed(0)
    use_impl = fx.patch_dien_torch_padded() if spec.model.endswith("_padded") else None
    feats = feature_spec("deepctr_torch", spec)
    fc = fx.torch_columns(feats, emb=spec.emb, maxlen=spec.hist or fx.MAXLEN)
    model = fx.build_torch_model(spec.model, fc, sizes(fx, spec))
    fx.init_torch_weights(model, 1234, EMB_STD[spec.family])
    model.eval()
    res["params"] = sum(p.numel() for p in model.parameters())
    fi = model.feature_index
    width = max(e for _, e in fi.values())

    def to_x(raw):
        x = np.zeros((len(next(iter(raw.values()))), width), np.float32)
        for name, (s, e) in fi.items():
            x[:, s:e] = raw[name].reshape(len(x), -1).astype(np.float32)
        return x
    xs = [to_x(make_batch(feats, n, spec.hist, SEED + i)) for i, n in enumerate((BATCH, BATCH2))]

    def eager():
        with torch.no_grad():
            return [[model(torch.from_numpy(x)).numpy()] for x in xs]
    if use_impl:          # references come from the library's own code, the export from the padded rewrite
        use_impl("orig")
    refs = eager()
    if use_impl:
        use_impl("new")
        res["patched_vs_library_max_diff"] = max(float(np.abs(a[0] - b[0]).max()) for a, b in zip(eager(), refs))
    t0 = time.time()
    fx.export_torch(model, torch.from_numpy(xs[0]), str(path), exporter)
    res["export_s"] = round(time.time() - t0, 1)
    return [({"X": x}, r) for x, r in zip(xs, refs)]


def deepctr_tf(fx, spec: Spec, exporter: str, path: Path, res: dict) -> list:
    """DeepCTR (TF/Keras 2): the fixture's builder and serving function at production sizes, through tf2onnx.
    tf2onnx needs more than 23 GB to convert 380 MB of tables (killed here at any try, large_model too), so the
    graph is converted from a twin model with small tables (table k: 101 + 2k rows) and every other weight the
    production model's, and the production tables are then put in its place (`put_tables`). The references are the
    production model's own outputs."""
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf
    import tf2onnx
    tf.random.set_seed(0)
    import deepctr.models  # noqa: F401  (imported before the DIEN patches, as the fixture does)
    patches = fx.patch_deepctr_tf() if spec.model.startswith("DIEN") else []
    if spec.model.endswith("_where"):
        patches.append(fx.patch_rnn_where())
    feats = feature_spec("deepctr_tf", spec)

    def build(f):
        m = fx.build_tf_model(spec.model, fx.tf_columns(f, emb=spec.emb, maxlen=spec.hist or fx.MAXLEN),
                              sizes(fx, spec))
        if spec.model.startswith("DIEN"):
            tf.compat.v1.experimental.output_all_intermediates(False)   # see make_exports.tf_run
        return m
    model = build(feats)
    fx.init_tf_weights(model, 1234, EMB_STD[spec.family])
    res["params"] = int(sum(w.shape.num_elements() for w in model.weights))
    res["tf_patches"] = patches
    _, _, feed, framework = fx.tf_serving(model)
    feeds = [feed(make_batch(feats, n, spec.hist, SEED + i)) for i, n in enumerate((BATCH, BATCH2))]
    refs = [framework(f) for f in feeds]
    twin = build(small_tables(feats))
    tables = copy_weights(model, twin)
    in_sig, serve, _, _ = fx.tf_serving(twin)
    t0 = time.time()
    tf2onnx.convert.from_function(serve, input_signature=in_sig, opset=fx.OPSET, output_path=str(path))
    res["tables_put"] = put_tables(path, tables)
    res["export_s"] = round(time.time() - t0, 1)
    return list(zip(feeds, refs))


def small_tables(feats: list[tuple]) -> list[tuple]:
    """The same features with table k (in order of first use) of 101 + 2k rows: a table's shape names it."""
    rows: dict[str, int] = {}
    out = []
    for name, kind, v, shared in feats:
        if kind != "dense":
            v = rows.setdefault(shared or name, 101 + 2 * len(rows))
        out.append((name, kind, v, shared))
    return out


def copy_weights(model, twin) -> dict:
    """Give the twin every weight of the model (a table: its first rows); return {twin table shape: table}."""
    tables = {}
    for w, t in zip(model.weights, twin.weights):
        if tuple(w.shape) == tuple(t.shape):
            t.assign(w)
        elif tuple(w.shape[1:]) == tuple(t.shape[1:]) and len(w.shape) == 2:
            t.assign(w[:t.shape[0]])
            tables[tuple(t.shape)] = w.numpy()
        else:
            raise ValueError(f"twin model differs: {w.name} {w.shape} vs {t.name} {t.shape}")
    return tables


def put_tables(path: Path, tables: dict) -> int:
    """Replace each initializer of a twin table's shape by the production table; return how many were."""
    import onnx
    from onnx import numpy_helper
    m = onnx.load(str(path))
    put = 0
    for i, t in enumerate(m.graph.initializer):
        if tuple(t.dims) in tables:
            m.graph.initializer[i].CopyFrom(numpy_helper.from_array(tables[tuple(t.dims)], t.name))
            put += 1
    if put < len(tables):
        raise ValueError(f"only {put} of {len(tables)} tables found among the initializers")
    path.unlink()
    onnx.save_model(m, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=path.name + ".data", size_threshold=INLINE_BYTES)
    return put


def torch_rechub(fx, spec: Spec, exporter: str, path: Path, res: dict) -> list:
    """torch-rechub: the fixture's make_model at production sizes, exported through its export() (ONNXExporter)."""
    import torch
    torch.set_num_threads(1)
    z = {**sizes(fx, spec), "vocab": rechub_vocab(), "emb": spec.emb, "emb_tf": spec.emb}
    model = fx.make_model(spec.model, z)
    he_linears(model)
    res["params"] = sum(p.numel() for p in model.parameters())
    feats = feature_spec("torch_rechub", spec)
    data = [make_batch(feats, n, spec.hist, SEED + i, min_len=0) for i, n in enumerate((BATCH, BATCH2))]
    if spec.model == "SASRec":
        for d in data:   # pos = the next item, 0 past the length (as the fixture's gen_data_tf)
            d["pos"] = shift(d["seq"])

    def eager(d):
        with torch.no_grad():
            out = model({k: torch.from_numpy(v) for k, v in d.items()})
        if isinstance(out, tuple) and len(out) == 2 and out[1].dim() == 0:
            out = out[0]   # DIEN's (output, aux loss): the export's wrapper keeps the output
        return [o.numpy().copy() for o in (out if isinstance(out, tuple) else (out,))]
    refs = [eager(d) for d in data]
    if spec.patch == "sasrec_arange":
        patch_sasrec_positions()
        res["patched_vs_library_max_diff"] = max(float(abs(a - b).max()) for d, r in zip(data, refs)
                                                 for a, b in zip(eager(d), r))
    t0 = time.time()
    fx.export(model, spec.model, exporter, str(path), data[0])
    res["export_s"] = round(time.time() - t0, 1)
    return list(zip(data, refs))


def he_linears(model) -> None:
    """Linear weights N(0, 2/fan_in), seeded: with torch's default init (which the fixture keeps) the outputs of a
    1024-512-256 MLP vary by 3e-4 over the batch, too little for a 1e-4 check to mean much."""
    import torch
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.copy_(torch.randn(m.weight.shape, generator=g) * (2.0 / m.weight.shape[1]) ** 0.5)


def patch_sasrec_positions() -> None:
    """WORKAROUND (SASRec_arange): torch-rechub's SASRec.seq_forward makes its positions on the host,
    `np.tile(np.array(range(x.shape[1])), [x.shape[0], 1])`, so both exporters bake the example's [B, T] in (see
    make_torch_rechub.py). The same computation with the positions from torch.arange expanded to the batch, and
    out-of-place products; the library's modules and weights are used unchanged. (The library's `.squeeze()` of
    the [B, T, D] embeddings is left out: a no-op for B, T > 1, as in every batch here.)"""
    import torch
    from torch_rechub.models.matching.sasrec import SASRec

    def seq_forward(self, x, emb):
        seq = x["seq"]
        emb = emb * self.features[0].embed_dim ** 0.5
        positions = torch.arange(seq.shape[1], device=seq.device).unsqueeze(0).expand(seq.shape[0], -1)
        emb = self.emb_dropout(emb + self.position_emb(positions))
        keep = (seq != 0).unsqueeze(-1).to(emb.dtype)
        emb = emb * keep
        t = emb.shape[1]
        attention_mask = ~torch.tril(torch.ones((t, t), dtype=torch.bool, device=emb.device))
        for i in range(len(self.attention_layers)):
            emb = torch.transpose(emb, 0, 1)
            q = self.attention_layernorms[i](emb)
            mha, _ = self.attention_layers[i](q, emb, emb, attn_mask=attention_mask)
            emb = torch.transpose(q + mha, 0, 1)
            emb = self.forward_layers[i](self.forward_layernorms[i](emb)) * keep
        return self.last_layernorm(emb)
    SASRec.seq_forward = seq_forward


def shift(seq):
    """The next item of each position of a right-padded history, 0 at and past its last item."""
    import numpy as np
    nxt = np.zeros_like(seq)
    nxt[:, :-1] = seq[:, 1:]
    return np.where(seq > 0, nxt, 0)


def fuxictr(fx, spec: Spec, exporter: str, path: Path, res: dict) -> list:
    """FuxiCTR 2.3.10 model zoo (snapshot at $FUXICTR_SRC): the zoo class built on a FeatureMap made in code (ids
    with padding 0; histories sharing the target's tables, max_len = the history), the fixture's seeded weights
    (embeddings rescaled to this script's std), wrapped as make_fuxictr does (positional inputs named after the
    features -> the input dict -> y_pred, or click_pred and conversion_pred). Both exporters as the fixture
    exports them (batch dynamic, history length static), with its workarounds: DIEN's padded rewrite (`dien`:
    references from the library's code), onnxscript's zero tolerance, DLRM's masked_select translation (dynamo)."""
    import numpy as np
    import torch
    torch.set_num_threads(1)
    fx.stub_ray()
    cls, mod = fx.load_zoo_model(spec.model)
    feats = feature_spec("fuxictr", spec)
    multitask = spec.model in ("MMoE", "PLE")
    fm = fuxictr_feature_map(spec, feats, multitask)
    common = dict(feature_map=fm, gpu=-1, verbose=0, model_root="/tmp/fuxictr_ckpt", metrics=["AUC"],
                  optimizer="adam", loss="binary_crossentropy", embedding_regularizer=None, net_regularizer=None,
                  learning_rate=1e-3)
    torch.manual_seed(2024)
    model = cls(**common, embedding_dim=spec.emb, **spec.sizes)
    fx.init_weights(model, 1234)          # embeddings N(0, 0.5), padding rows 0, BN statistics, biases
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Embedding):
                m.weight.mul_(EMB_STD[spec.family] / 0.5)
    model.eval()
    res["params"] = sum(p.numel() for p in model.parameters())
    names = [n for n, _, _, _ in feats]
    out_keys = ["click_pred", "conversion_pred"] if multitask else ["y_pred"]
    dense_2d = spec.model == "DLRM"        # DLRM concatenates its numeric inputs on the last axis: [B, 1] each

    def feed(raw):
        return {n: (raw[n] if k != "dense" or dense_2d else raw[n].reshape(-1)) for n, k, _, _ in feats}
    data = [feed(make_batch(feats, n, spec.hist, SEED + i, min_len=0)) for i, n in enumerate((BATCH, BATCH2))]

    def eager(d):
        with torch.no_grad():
            out = model({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in d.items()})
        return [out[k].numpy().copy() for k in out_keys]
    refs = [eager(d) for d in data]
    if spec.patch == "dien":
        use = fx.patch_dien(mod)
        use("patched")
        res["patched_vs_library_max_diff"] = max(float(abs(a - b).max()) for d, r in zip(data, refs)
                                                 for a, b in zip(eager(d), r))
    wrapper = fx.make_wrapper(model, names, out_keys)
    example = tuple(torch.from_numpy(np.ascontiguousarray(data[0][n])) for n in names)
    t0 = time.time()
    if exporter == "legacy":
        torch.onnx.export(wrapper, example, str(path), dynamo=False, opset_version=fx.OPSET, input_names=names,
                          output_names=out_keys, dynamic_axes={n: {0: "batch"} for n in names + out_keys})
    else:
        res["onnxscript_zero_tol_patch"] = fx.patch_onnxscript_zero_tolerance(True) is not None
        batch = torch.export.Dim("batch", min=1, max=65536)
        extra = {"custom_translation_table": fx.masked_select_translation()} if spec.model == "DLRM" else {}
        prog = torch.onnx.export(wrapper, example, dynamo=True, opset_version=fx.DYNAMO_OPSET, input_names=names,
                                 output_names=out_keys, dynamic_shapes=(tuple({0: batch} for _ in names),),
                                 verbose=False, **extra)
        prog.save(str(path))
    res["export_s"] = round(time.time() - t0, 1)
    return list(zip(data, refs))


def fuxictr_feature_map(spec: Spec, feats: list[tuple], multitask: bool):
    from collections import OrderedDict
    from fuxictr.features import FeatureMap
    fm = FeatureMap("production_corpus", "/nonexistent")
    f = OrderedDict()
    for name, kind, v, shared in feats:
        source = "user" if user_side(name) else "item"
        if kind == "sparse":
            f[name] = {"source": source, "type": "categorical", "padding_idx": 0, "vocab_size": v}
        elif kind == "dense":
            f[name] = {"source": "context", "type": "numeric"}
        else:
            f[name] = {"source": source, "type": "sequence", "share_embedding": shared, "padding_idx": 0,
                       "vocab_size": v, "max_len": spec.hist}
    if spec.model == "DIEN":   # DIEN's DNN width counts the negative histories (read only by the aux loss)
        for name, kind, _, _ in feats:
            if kind == "seq":
                f["neg_" + name] = dict(f[name])
    fm.features = f
    fm.labels = ["click", "conversion"] if multitask else ["click"]
    fm.default_emb_dim = spec.emb
    fm.num_fields = fm.get_num_fields()
    fm.set_column_index()
    return fm


def torchrec(fx, spec: Spec, exporter: str, path: Path, res: dict) -> list:
    """torchrec 1.9.2 (fbgemm-gpu-cpu 1.9.0): the fixture's build_dlrm (torchrec.models.dlrm.DLRM over an
    EmbeddingBagCollection, one table per feature) and DLRMPlain front end (dense [B, 13], values [N], lengths
    [26 B] feature-major -> KeyedJaggedTensor), with the 26 Criteo tables and the Kaggle DLRM's arch: bottom
    512-256-64-16, top 512-256-1, embedding 16. Bags: one id per field, 5% empty (missing values), 5% of 2-3 ids.
    Dynamo only: the fixture found the legacy tracer bakes the traced KJT split sizes in (tests/.../broken)."""
    import numpy as np
    import torch
    torch.set_num_threads(1)
    fx.ROWS = list(DENSE_VOCABS)
    fx.F = len(fx.ROWS)
    fx.KEYS = [f"f{i}" for i in range(fx.F)]
    fx.EMB_DIM = spec.emb
    fx.BOTTOM = [*spec.sizes["bottom"], spec.emb]
    fx.TOP = [*spec.sizes["top"], 1]
    w = fx.DLRMPlain(fx.build_dlrm()).eval()
    res["params"] = sum(p.numel() for p in w.parameters())
    feats = feature_spec("torchrec", spec)
    zipf_ids = load_module("scale", HERE / "scale.py").zipf_ids
    data = []
    for i, n in enumerate((BATCH, BATCH2)):
        raw = make_batch(feats, n, 0, SEED + i)
        rng = np.random.default_rng(SEED + 100 + i)
        dense = np.concatenate([raw[f"I{k + 1}"] for k in range(13)], axis=1).astype(np.float32)
        lengths = np.ones((fx.F, n), np.int64)
        lengths[rng.random((fx.F, n)) < 0.05] = 0
        multi = rng.random((fx.F, n)) < 0.05
        lengths[multi] = rng.integers(2, 4, int(multi.sum()))
        values = []
        for f, v in enumerate(fx.ROWS):
            for b in range(n):
                k = int(lengths[f, b])
                if k:
                    values.append(np.concatenate([[raw[f"C{f + 1}"][b]], zipf_ids(rng, v, (k - 1,), 1)]))
        data.append({"dense": dense, "values": np.concatenate(values).astype(np.int64),
                     "lengths": lengths.reshape(-1)})

    def eager(d):
        with torch.no_grad():
            return [w(*(torch.from_numpy(d[k]) for k in fx.INPUT_NAMES)).numpy().copy()]
    refs = [eager(d) for d in data]
    t0 = time.time()
    example = tuple(torch.from_numpy(data[0][k]) for k in fx.INPUT_NAMES)
    batch = torch.export.Dim("batch", min=1, max=65536)
    nvals = torch.export.Dim("nvalues", min=0, max=1 << 24)
    prog = torch.onnx.export(w, example, dynamo=True, opset_version=18, input_names=fx.INPUT_NAMES,
                             output_names=fx.OUTPUT_NAMES, verbose=False,
                             dynamic_shapes={"dense": {0: batch}, "values": {0: nvals}, "lengths": {0: fx.F * batch}})
    prog.save(str(path))
    res["export_s"] = round(time.time() - t0, 1)
    return list(zip(data, refs))


def export_positional(model, example: tuple, names: list[str], out_names: list[str], exporter: str,
                      path: Path) -> None:
    """model(*inputs) to ONNX, the batch axis of every input and output dynamic: legacy (opset 17) or dynamo
    (opset 18), as the fixtures export."""
    import torch
    if exporter == "legacy":
        torch.onnx.export(model, example, str(path), dynamo=False, opset_version=17, input_names=names,
                          output_names=out_names, dynamic_axes={n: {0: "batch"} for n in names + out_names})
    else:
        import inspect
        batch = torch.export.Dim("batch", min=1, max=65536)
        shapes = tuple({0: batch} for _ in names)
        if any(p.kind == p.VAR_POSITIONAL for p in inspect.signature(model.forward).parameters.values()):
            shapes = (shapes,)      # forward(*inputs): one entry, the tuple
        prog = torch.onnx.export(model, example, dynamo=True, opset_version=18, input_names=names,
                                 output_names=out_names, dynamic_shapes=shapes, verbose=False)
        prog.save(str(path))


def seeded_init(model, emb_std: float, seed: int = 1234) -> None:
    """Seeded weights for the libraries without a fixture: embeddings N(0, emb_std) (padding rows 0), Linear and
    Conv1d weights N(0, 2/fan_in), biases N(0, 0.1), BatchNorm statistics and affine terms non-trivial."""
    import torch
    from torch import nn
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Embedding):
                m.weight.copy_(torch.randn(m.weight.shape, generator=g) * emb_std)
                if m.padding_idx is not None:
                    m.weight[m.padding_idx].zero_()
            elif isinstance(m, (nn.Linear, nn.Conv1d)):
                fan_in = m.weight[0].numel()
                m.weight.copy_(torch.randn(m.weight.shape, generator=g) * (2.0 / fan_in) ** 0.5)
                if m.bias is not None:
                    m.bias.copy_(torch.randn(m.bias.shape, generator=g) * 0.1)
            elif isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d)):
                m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=g) * 0.1)
                m.running_var.copy_(torch.rand(m.running_var.shape, generator=g) * 0.5 + 0.75)
                if m.affine:
                    m.weight.copy_(1 + 0.1 * torch.randn(m.weight.shape, generator=g))
                    m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))


def torchfm(fx, spec: Spec, exporter: str, path: Path, res: dict) -> list:
    """torchfm 0.7.0 (rixwew/pytorch-fm): the library's model class on field_dims = the 26 Criteo vocabularies (it
    has no dense inputs), x = int64 [B, 26] (per-field ids; the model adds its field offsets), output sigmoid [B]."""
    import importlib
    import numpy as np
    import torch
    torch.set_num_threads(1)
    module, cls = spec.model.rsplit(".", 1)
    torch.manual_seed(0)
    model = getattr(importlib.import_module(f"torchfm.model.{module}"), cls)(DENSE_VOCABS, **spec.sizes)
    seeded_init(model, EMB_STD[spec.family])
    model.eval()
    res["params"] = sum(p.numel() for p in model.parameters())
    feats = [f for f in feature_spec("torchfm", spec) if f[1] == "sparse"]
    data = [{"x": np.stack([b[n] for n, _, _, _ in feats], axis=1).astype(np.int64)}
            for b in (make_batch(feats, n, 0, SEED + i) for i, n in enumerate((BATCH, BATCH2)))]

    def eager(d):
        with torch.no_grad():
            return [model(torch.from_numpy(d["x"])).numpy().copy()]
    refs = [eager(d) for d in data]
    t0 = time.time()
    export_positional(model, (torch.from_numpy(data[0]["x"]),), ["x"], ["y"], exporter, path)
    res["export_s"] = round(time.time() - t0, 1)
    return list(zip(data, refs))


WD_STUBS = ("torchvision", "transformers", "gensim", "spacy", "cv2", "sentence_transformers", "fastparquet",
            "sentencepiece", "tokenizers", "PIL")


def stub_modules(names) -> None:
    """Inert stand-ins for packages a library imports but its models never use (pytorch-widedeep imports its text
    and image stacks, torchvision, transformers, gensim, spacy, cv2, at package import): any attribute is a class."""
    import importlib.abc
    import importlib.machinery
    import types

    class Meta(type):
        def __getattr__(cls, k):
            return Meta(k, (), {})

        def __getitem__(cls, k):
            return cls

        def __call__(cls, *a, **k):
            return super().__call__()

    class Stub(types.ModuleType):
        def __getattr__(self, k):
            if k.startswith("__"):
                raise AttributeError(k)
            return Meta(k, (), {})

    class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name, path, target=None):
            return importlib.machinery.ModuleSpec(name, self, is_package=True) if name.split(".")[0] in names else None

        def create_module(self, spec):
            m = Stub(spec.name)
            m.__path__ = []
            return m

        def exec_module(self, module):
            pass
    sys.meta_path.insert(0, Finder())


def widedeep(fx, spec: Spec, exporter: str, path: Path, res: dict) -> list:
    """pytorch-widedeep 1.7.0: the library's rec models (DeepFM, xDeepFM, AutoInt+, DCN, DCNv2, GDCN, DIN) as the
    deeptabular component of its WideDeep (which adds the prediction layer); WideDeep = Wide (one weight per id,
    ids offset per field as WidePreprocessor codes them) + TabMlp; Transformer (its basic_transformer: embedding,
    positional encoding, encoder blocks, flattened) as WideDeep's deeptext over the item history. Inputs: the
    dict WideDeep.forward takes, one positional input per key: deeptabular float32 [B, columns] (ids as floats,
    the library's convention), wide int64 [B, 26], deeptext int64 [B, T]. Unused packages stubbed (stub_modules)."""
    import numpy as np
    import torch
    torch.set_num_threads(1)
    stub_modules(WD_STUBS)
    from pytorch_widedeep.models import WideDeep, Wide, TabMlp, rec
    from pytorch_widedeep.models.rec.basic_transformer import Transformer
    feats = feature_spec("widedeep", spec)
    torch.manual_seed(0)
    z = dict(spec.sizes)
    if spec.model == "Transformer":
        cols = [("hist_item_id", "deeptext")]
        model = WideDeep(deeptext=Transformer(vocab_size=ITEM, seq_length=spec.hist, input_dim=spec.emb,
                                              with_pos_encoding=True, **z))
    else:
        tab = []              # (column name, raw feature, position)
        for name, kind, v, _ in feats:
            tab += [(f"{name}_{t}", name, t) for t in range(spec.hist)] if kind == "seq" else [(name, name, None)]
        column_idx = {c: i for i, (c, _, _) in enumerate(tab)}
        sparse = [(n, v) for n, k, v, _ in feats if k == "sparse"]
        cont = [n for n, k, _, _ in feats if k == "dense"]
        pairs = "input_dim" in z or "num_factors" in z
        if spec.model == "DeepInterestNetwork":
            hist = {n: [c for c, f, _ in tab if f == n] for n, k, _, _ in feats if k == "seq"}
            z.update(target_item_col="item_id", user_behavior_confiq=(hist["hist_item_id"], ITEM, spec.emb),
                     other_seq_cols_confiq=[(hist["hist_cate_id"], CATE, spec.emb)],
                     cat_embed_input=[(n, v, spec.emb) for n, v in sparse if n != "item_id"])
        else:
            z["cat_embed_input"] = [(n, v) if pairs else (n, v, spec.emb) for n, v in sparse]
        deep = (TabMlp if spec.model == "TabMlp" else getattr(rec, spec.model))(
            column_idx=column_idx, continuous_cols=cont, **z)
        cols = [(tab, "deeptabular")]
        if spec.model == "TabMlp":
            cols = [("C", "wide")] + cols
            model = WideDeep(wide=Wide(input_dim=sum(v for _, v in sparse), pred_dim=1), deeptabular=deep)
        else:
            model = WideDeep(deeptabular=deep)
    seeded_init(model, EMB_STD[spec.family])
    model.eval()
    res["params"] = sum(p.numel() for p in model.parameters())
    offsets = np.cumsum([0] + [v for _, k, v, _ in feats if k == "sparse"])[:-1]

    def inputs(raw):
        d = {}
        for src, key in cols:
            if key == "deeptext":
                d[key] = raw[src].astype(np.int64)
            elif key == "wide":    # WidePreprocessor: ids coded 1.. over all fields (0 = unseen)
                d[key] = np.stack([raw[f"C{i + 1}"] for i in range(26)], axis=1).astype(np.int64) + offsets
            else:
                d[key] = np.stack([raw[f].reshape(len(raw[f]), -1)[:, t or 0] for _, f, t in src],
                                  axis=1).astype(np.float32)
        return d
    data = [inputs(make_batch(feats, n, spec.hist, SEED + i, min_len=1)) for i, n in enumerate((BATCH, BATCH2))]
    keys = [k for _, k in cols]

    class Wrap(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.wd = model

        def forward(self, *xs):
            return self.wd(dict(zip(keys, xs)))
    wrap = Wrap().eval()

    def eager(d):
        with torch.no_grad():
            return [wrap(*(torch.from_numpy(d[k]) for k in keys)).numpy().copy()]
    refs = [eager(d) for d in data]
    t0 = time.time()
    export_positional(wrap, tuple(torch.from_numpy(data[0][k]) for k in keys), keys, ["y"], exporter, path)
    res["export_s"] = round(time.time() - t0, 1)
    return list(zip(data, refs))


def recbole_dataset(nu: int, ni: int, nc: int, hist: int) -> str:
    """A synthetic RecBole atomic dataset: every user (user_id, gender) and item (item_id, cate_id) listed in the
    feature files (so the tables have nu + 1 and ni + 1 rows), interactions for a few thousand users."""
    import tempfile
    import numpy as np
    d = tempfile.mkdtemp(prefix="recbole_prod_")
    ds = os.path.join(d, "prod")
    os.makedirs(ds)
    rng = np.random.default_rng(0)
    n = 4000
    users, items = rng.integers(1, nu + 1, n), rng.integers(1, ni + 1, n)
    with open(os.path.join(ds, "prod.inter"), "w") as f:
        f.write("user_id:token\titem_id:token\trating:float\ttimestamp:float\n")
        f.write("".join(f"u{u}\ti{i}\t{r}\t{k}\n" for k, (u, i, r) in
                        enumerate(zip(users, items, rng.integers(1, 6, n)))))
    with open(os.path.join(ds, "prod.item"), "w") as f:
        f.write("item_id:token\tcate_id:token\n")
        f.write("".join(f"i{i}\tc{c}\n" for i, c in zip(range(1, ni + 1), rng.integers(1, nc + 1, ni))))
    with open(os.path.join(ds, "prod.user"), "w") as f:
        f.write("user_id:token\tgender:token\n")
        f.write("".join(f"u{u}\tg{g}\n" for u, g in zip(range(1, nu + 1), rng.integers(1, 3, nu))))
    return d


def recbole(fx, spec: Spec, exporter: str, path: Path, res: dict) -> list:
    """RecBole 1.2.1: the model built the RecBole way (Config + create_dataset + dataset.build, as make_recbole.py
    does) on a synthetic dataset of 10^6 users and items and 10^4 categories, MAX_ITEM_LIST_LENGTH = the history,
    the fixture's BatchNorm / LayerNorm randomisation, exported as the fixture exports `predict(interaction)`
    (make_wrapper: positional inputs named after RecBole's fields). Histories 0 past item_length; DIEN and SASRec
    need item_length >= 1, DIN takes empty histories. DIEN: gru_type GRU (the fixture: AUGRU exports with neither
    exporter, GRU with the legacy one)."""
    import numpy as np
    import torch
    torch.set_num_threads(1)
    np.float_, np.complex_, np.unicode_ = np.float64, np.complex128, np.str_   # RecBole 1.2.1 on NumPy 2
    from recbole.config import Config
    from recbole.data import create_dataset
    from recbole.data.transform import construct_transform
    from recbole.utils import get_model
    d = recbole_dataset(USER["user_id"], ITEM, CATE, spec.hist)
    cfg = dict(data_path=d, load_col={"inter": ["user_id", "item_id", "rating", "timestamp"],
                                       "item": ["item_id", "cate_id"], "user": ["user_id", "gender"]},
               MAX_ITEM_LIST_LENGTH=spec.hist, threshold={"rating": 4}, device="cpu", use_gpu=False,
               train_neg_sample_args=None,
               eval_args={"split": {"RS": [0.8, 0.1, 0.1]}, "order": "TO", "group_by": "user", "mode": "labeled"},
               metrics=["AUC", "LogLoss"], valid_metric="AUC", show_progress=False, state="ERROR",
               checkpoint_dir=d, reproducibility=True, seed=0, **spec.sizes)
    t0 = time.time()
    config = Config(model=spec.model, dataset="prod", config_dict=cfg)
    dataset = create_dataset(config)
    dataset.build()
    construct_transform(config)
    res["dataset_s"] = round(time.time() - t0, 1)
    res["tables"] = {"user_num": int(dataset.user_num), "item_num": int(dataset.item_num)}
    torch.manual_seed(0)
    model = get_model(spec.model)(config, dataset)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():   # as make_recbole.make_model
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm1d):
                m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=g) * 0.1)
                m.running_var.copy_(torch.rand(m.running_var.shape, generator=g) + 0.5)
            if spec.model in fx.TRANSFORMERS and isinstance(m, torch.nn.LayerNorm):
                m.weight.copy_(1.0 + 0.1 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    model.eval()
    res["params"] = sum(p.numel() for p in model.parameters())
    names = fx.input_names(spec.model)
    wrapper = fx.make_wrapper(model, names)
    feats = [("user_id", "sparse", int(dataset.user_num), None), ("item_id", "sparse", int(dataset.item_num), None),
             ("hist_item_id", "seq", int(dataset.item_num), "item_id"),
             ("neg_hist_item_id", "seq", int(dataset.item_num), "item_id")]
    rename = {"hist_item_id": "item_id_list", "neg_hist_item_id": "neg_item_id_list", "seq_length": "item_length"}
    data = [{rename.get(k, k): v for k, v in make_batch(feats, n, spec.hist, SEED + i,
                                                         min_len=0 if spec.model == "DIN" else 1).items()}
            for i, n in enumerate((BATCH, BATCH2))]
    data = [{k: d[k] for k in names} for d in data]

    def eager(d):
        with torch.no_grad():
            return [wrapper(*[torch.from_numpy(d[n]) for n in names]).numpy().copy()]
    refs = [eager(d) for d in data]
    t0 = time.time()
    export_positional(wrapper, tuple(torch.from_numpy(data[0][n]) for n in names), names, ["score"], exporter, path)
    res["export_s"] = round(time.time() - t0, 1)
    return list(zip(data, refs))


def tfrs(fx, spec: Spec, exporter: str, path: Path, res: dict) -> list:
    """TensorFlow Recommenders 0.7.7 (tf_keras, TF 2.21): tfrs.experimental.models.Ranking, whose call takes
    {"dense_features": [B, 13], "sparse_features": {name: ids}}: bottom_stack and top_stack tfrs.layers.blocks.MLP,
    feature_interaction DotInteraction (DLRM) or concatenation + 3 tfrs.layers.dcn.Cross (DCN; projection_dim 64:
    DCN-v2's low-rank cross). The embedding layer, which Ranking leaves to the user, is one Keras Embedding per
    field (ids [B, 1]). Served as a tf.function over named inputs (dense_features, C1..C26) and converted with
    tf2onnx from a small-table twin, the production tables put in after (as deepctr_tf); the fixture's seeded
    weights (make_exports.init_tf_weights)."""
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np
    import tensorflow as tf
    import tf2onnx
    import tensorflow_recommenders as tfrs_lib
    from tensorflow_recommenders.experimental.models import Ranking
    tf.random.set_seed(0)
    feats = feature_spec("tfrs", spec)
    sparse = [(n, v) for n, k, v, _ in feats if k == "sparse"]
    z = spec.sizes

    class Embeddings(tf.keras.layers.Layer):
        def __init__(self, vocabs):
            super().__init__()
            self.tables = {n: tf.keras.layers.Embedding(v, spec.emb, name=f"emb_{n}") for n, v in vocabs}

        def call(self, x):
            return {n: t(x[n]) for n, t in self.tables.items()}

    class Fields(tf.keras.layers.Layer):
        """The docstring's `Concatenate()` before the Cross layers, each vector reshaped to [B, emb] first: Ranking
        squeezes the [B, 1, emb] embeddings with tf.squeeze, which under a dynamic batch loses the static shape,
        and Cross needs the concatenation's width."""
        def call(self, xs):
            return tf.concat([tf.reshape(x, [-1, spec.emb]) for x in xs], axis=1)

    def build(vocabs):
        if spec.model == "DLRM":
            inter = tfrs_lib.layers.feature_interaction.DotInteraction()
        else:
            inter = tf.keras.Sequential([Fields()] + [
                tfrs_lib.layers.dcn.Cross(projection_dim=z.get("projection_dim")) for _ in range(z["cross"])])
        m = Ranking(embedding_layer=Embeddings(vocabs),
                    bottom_stack=tfrs_lib.layers.blocks.MLP(units=z["bottom"], final_activation="relu"),
                    feature_interaction=inter,
                    top_stack=tfrs_lib.layers.blocks.MLP(units=z["top"], final_activation="sigmoid"))
        in_sig = [tf.TensorSpec((None, 13), tf.float32, name="dense_features")] + [
            tf.TensorSpec((None, 1), tf.int64, name=n) for n, _ in sparse]

        @tf.function(input_signature=in_sig)
        def serve(dense, *ids):
            return m({"dense_features": dense, "sparse_features": dict(zip([n for n, _ in sparse], ids))})
        serve.get_concrete_function()     # builds the weights
        return m, in_sig, serve
    model, in_sig, serve = build(sparse)
    fx.init_tf_weights(model, 1234, EMB_STD[spec.family])
    res["params"] = int(sum(w.shape.num_elements() for w in model.weights))

    def feed(raw):
        d = {"dense_features": np.concatenate([raw[f"I{k + 1}"] for k in range(13)], axis=1).astype(np.float32)}
        d.update({n: raw[n].reshape(-1, 1).astype(np.int64) for n, _ in sparse})
        return d
    feeds = [feed(make_batch(feats, n, 0, SEED + i)) for i, n in enumerate((BATCH, BATCH2))]
    refs = [[serve(*[tf.constant(f[s.name]) for s in in_sig]).numpy()] for f in feeds]
    twin, twin_sig, twin_serve = build([(n, 101 + 2 * k) for k, (n, _) in enumerate(sparse)])
    tables = copy_weights(model, twin)
    t0 = time.time()
    tf2onnx.convert.from_function(twin_serve, input_signature=twin_sig, opset=fx.OPSET, output_path=str(path))
    res["tables_put"] = put_tables(path, tables)
    res["export_s"] = round(time.time() - t0, 1)
    return list(zip(feeds, refs))


def paddlerec(fx, spec: Spec, exporter: str, path: Path, res: dict) -> list:
    """PaddleRec (paddlepaddle 3.1.1, paddle2onnx 2.1.0): make_paddlerec.build (DygraphModel().create_model, its
    seeded reinit, the output-picking wrapper) with production hyper-parameters, exported as the fixture does:
    paddle.jit.to_static(full_graph=True) -> jit.save -> paddle2onnx.export(opset 13). Criteo models: C1..C26
    int64 [B, 1] ids into the shared table (field k's ids offset by the vocabularies before it), dense_input
    [B, 13]; MMoE / PLE (no tables: PaddleRec's census models) input_data [B, 512]; DIN / BST the fixture's
    inputs (histories, targets, DIN's int64 0 / -1e9 mask and tiled targets, BST's positions), the history axis
    dynamic as in the fixture."""
    import shutil
    import tempfile
    import numpy as np
    import paddle
    import paddle2onnx
    import onnx
    paddle.seed(fx.SEED)
    fx.HP[spec.model] = {**fx.HP[spec.model], **spec.sizes}
    fx.FEAT = spec.sizes.get("feature_size", fx.FEAT)
    w, in_spec, names, _, call = fx.build(spec.model)
    w.eval()
    res["params"] = int(sum(int(np.prod(p.shape)) for p in w.parameters()))
    feats = feature_spec("paddlerec", spec)
    offsets = np.cumsum([0] + DENSE_VOCABS)[:-1]

    def data(i, n):
        raw = make_batch(feats, n, spec.hist, SEED + i)
        if spec.hist:     # DIN: mask int64 0 / -1e9 [B, T, 1] and the targets tiled, as dinReader feeds them
            t, lens = spec.hist, raw["seq_length"]
            pad = np.arange(t)[None, :] >= lens[:, None]
            pos = np.where(pad, 0, np.arange(1, t + 1)[None, :])
            d = {"hist_item_seq": raw["hist_item_id"], "hist_cat_seq": raw["hist_cate_id"],
                 "target_item": raw["item_id"], "target_cat": raw["cate_id"],
                 "mask": np.where(pad, -1e9, 0.0)[:, :, None].astype(np.int64),
                 "target_item_seq": np.repeat(raw["item_id"][:, None], t, axis=1),
                 "target_cat_seq": np.repeat(raw["cate_id"][:, None], t, axis=1),
                 "userid": raw["user_id"][:, None], "position_seq": pos.astype(np.int64),
                 "target_position": (lens + 1)[:, None].astype(np.int64)}
            if spec.model == "BST":
                d["target_item"], d["target_cat"] = d["target_item"][:, None], d["target_cat"][:, None]
            return {k: d[k].astype(np.int64) for k in names}
        if spec.model in ("MMoE", "PLE"):
            rng = np.random.default_rng(SEED + i)
            return {"input_data": rng.normal(size=(n, fx.FEAT)).astype(np.float32)}
        d = {f"C{k + 1}": (raw[f"C{k + 1}"] + offsets[k]).reshape(n, 1).astype(np.int64) for k in range(26)}
        d["dense_input"] = np.concatenate([raw[f"I{k + 1}"] for k in range(13)], axis=1).astype(np.float32)
        return d
    batches = [data(i, n) for i, n in enumerate((BATCH, BATCH2))]
    with paddle.no_grad():
        refs = [[np.asarray(o).copy() for o in fx.to_list(call(w, d))] for d in batches]
    work = tempfile.mkdtemp(prefix="paddlerec_prod_")
    prefix = os.path.join(work, "inference")
    t0 = time.time()
    try:
        st = paddle.jit.to_static(w, input_spec=in_spec, full_graph=True)
        paddle.jit.save(st, prefix)
        model_file = prefix + (".json" if os.path.exists(prefix + ".json") else ".pdmodel")
        tmp = os.path.join(work, "raw.onnx")
        paddle2onnx.export(model_file, prefix + ".pdiparams", save_file=tmp, opset_version=fx.OPSET,
                           enable_onnx_checker=True)
        if not os.path.exists(tmp):
            raise RuntimeError("paddle2onnx wrote no file (see its log)")
        m = onnx.load(tmp)
        onnx.save_model(m, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=path.name + ".data", size_threshold=INLINE_BYTES)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res["export_s"] = round(time.time() - t0, 1)
    return list(zip(batches, refs))


RUNNERS = {"deepctr_torch": deepctr_torch, "deepctr_tf": deepctr_tf, "torch_rechub": torch_rechub, "fuxictr": fuxictr,
           "torchrec": torchrec, "torchfm": torchfm, "widedeep": widedeep, "recbole": recbole, "tfrs": tfrs,
           "paddlerec": paddlerec}


# ------------------------------------------------------------------------------------------------------ driving
def load_module(name: str, path: Path):
    """Import a script by path (benchmarks/ is never put on sys.path: its requests.py would shadow the package)."""
    import importlib.util
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def stem(lib: str, name: str, exporter: str) -> str:
    return f"{lib}_{name}_{exporter}_prod"


def run_one(lib: str, name: str, exporter: str, out: Path) -> dict:
    """In the library's venv: build, export, check, keep or drop one export; write and return its record."""
    fx = load_module(LIBS[lib][1], THIRD / f"{LIBS[lib][1]}.py") if LIBS[lib][1] else None
    spec = MODELS[lib][name]
    path = out / (stem(lib, name, exporter) + ".onnx")
    out.mkdir(parents=True, exist_ok=True)
    remove(path)
    res = {"lib": lib, "model": name, "exporter": exporter, "emb": spec.emb, "hist": spec.hist,
           "sizes": spec.sizes}
    t0 = time.time()
    try:
        batches = RUNNERS[lib](fx, spec, exporter, path, res)
        keep_or_drop(path, batches, res)
    except Exception as e:  # noqa: BLE001
        remove(path)
        msg = " ".join(str(e).split())
        res.update(keep=False, error=f"{type(e).__name__}: {msg[:400]} ... {msg[-600:]}" if len(msg) > 1000
                   else f"{type(e).__name__}: {msg}", traceback=traceback.format_exc()[-2000:])
    res["total_s"] = round(time.time() - t0, 1)
    (out / "results").mkdir(parents=True, exist_ok=True)
    (out / "results" / f"{stem(lib, name, exporter)}.json").write_text(json.dumps(res, indent=1, default=str))
    print(summary(res), flush=True)
    return res


def summary(r: dict) -> str:
    head = f"{stem(r['lib'], r['model'], r['exporter'])}: "
    if not r.get("keep"):
        diffs = f" diffs b256={r.get('max_diff_b256')} b7={r.get('max_diff_b7')}" if "max_diff_b256" in r else ""
        return head + f"FAILED{diffs} {r.get('error', '')}"[:1500]
    return head + (f"kept, {r['bytes'] / 2**20:.0f} MiB, {r['params'] / 1e6:.2f}M params, max diff "
                   f"{r['max_diff_b256']:.1e} (B=256) {r['max_diff_b7']:.1e} (B=7), export {r['export_s']}s, "
                   f"total {r['total_s']}s")


def venv_python(lib: str, given: str | None) -> str:
    if given:
        return given
    py = VENVS / LIBS[lib][0] / "bin" / "python"
    if not py.exists():
        sys.exit(f"no venv for {lib}: {py} (see this script's docstring) - or pass --python")
    return str(py)


def make(lib: str, names: list[str], out: Path, python: str | None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    py = venv_python(lib, python)
    t_lib = time.time()
    for name in names:
        for exporter in LIBS[lib][2]:
            t0 = time.time()
            cmd = [py, str(Path(__file__).resolve()), "_one", lib, name, exporter, "-o", str(out)]
            rc = subprocess.run(cmd, cwd=str(HERE)).returncode
            if rc != 0:   # a hard crash (killed, segfault): record it
                res = {"lib": lib, "model": name, "exporter": exporter, "keep": False,
                       "error": f"subprocess exited rc={rc}", "total_s": round(time.time() - t0, 1)}
                (out / "results").mkdir(exist_ok=True)
                (out / "results" / f"{stem(lib, name, exporter)}.json").write_text(json.dumps(res, indent=1))
                print(summary(res), flush=True)
    print(f"== {lib}: {len(names)} models in {time.time() - t_lib:.0f}s", flush=True)


def list_models() -> None:
    for lib, models in MODELS.items():
        venv, fixture, exporters = LIBS[lib]
        builders = f"builders of {fixture}.py" if fixture else "the library's model classes"
        print(f"{lib}  (venv {VENVS / venv}, {builders}, exporters {', '.join(exporters)})")
        for name, s in models.items():
            hist = f", history {s.hist}" if s.hist else ""
            print(f"  {name:24s} {s.model} [{s.family}] embedding {s.emb}{hist}, {s.sizes}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="the libraries and models")
    mk = sub.add_parser("make", help="export, check and keep the models of one library")
    mk.add_argument("--lib", required=True, choices=sorted(MODELS))
    mk.add_argument("--models", help="comma-separated names (default: all of the library's)")
    mk.add_argument("-o", "--out", type=Path, default=Path("/tmp/prodcorpus"))
    mk.add_argument("--python", help="the library venv's python (default: $CTROPT_VENVS/<venv>/bin/python)")
    one = sub.add_parser("_one")      # internal: one export, in the library's venv
    one.add_argument("lib")
    one.add_argument("model")
    one.add_argument("exporter")
    one.add_argument("-o", "--out", type=Path, required=True)
    a = ap.parse_args(argv)
    if a.cmd == "list":
        list_models()
    elif a.cmd == "_one":
        sys.dont_write_bytecode = True     # nothing written next to the fixture scripts
        sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
        run_one(a.lib, a.model, a.exporter, a.out)
    else:
        names = a.models.split(",") if a.models else list(MODELS[a.lib])
        unknown = [n for n in names if n not in MODELS[a.lib]]
        if unknown:
            sys.exit(f"unknown models for {a.lib}: {unknown}; known: {list(MODELS[a.lib])}")
        make(a.lib, names, a.out, a.python)


if __name__ == "__main__":
    main()
