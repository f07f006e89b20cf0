#!/usr/bin/env python
"""Export DeepRec modelzoo models (TensorFlow 1 graphs) to ONNX with tf2onnx, with TensorFlow's own
reference outputs, and check them in ONNX Runtime and OpenVINO.

Source followed: DeepRec-AI/DeepRec, ``modelzoo/<model>/train.py`` with the ``--tf`` (stock TensorFlow)
code paths.  Those files are long training scripts (argparse globals, dataset pipelines, DeepRec-only
options), so this script does not import them: it reproduces only their model-building graph code
(``_create_model`` and the helpers it calls: same variable scopes, layers, ops, feature-column calls and
partitioner placement) with small sizes.  Files / commits read (as stored by the code index):
    WDL     modelzoo/wide_and_deep/train.py  22c94947a62a953583f965bec7f6d1caad478da3
    DLRM    modelzoo/dlrm/train.py           004952c04889b308224f2ac320d7ff9b33aa1176
    DeepFM  modelzoo/deepfm/train.py         11e849ff64c23fd977e84b0ddecb5882bdc8d893
    DIN     modelzoo/din/train.py            5c8eb4fc0743b35cdd172a559ee1297785ac0070
    DIEN    modelzoo/dien/train.py           3040512a942267b06552dce05f83ff8684400e5d
    MMoE    modelzoo/mmoe/train.py           11e849ff64c23fd977e84b0ddecb5882bdc8d893
    BST     modelzoo/bst/train.py            4c4bdf04a654d4158bf19c580bc1119d2b4664b5
    DCNv2   modelzoo/dcnv2/train.py          004952c04889b308224f2ac320d7ff9b33aa1176
No third-party code is loaded or copied; nothing is downloaded (all weights seeded-random, data synthetic).

Deliberate differences from the training scripts (all needed for an ONNX export, none changes a layer):
  * String features become integer ids: ``categorical_column_with_hash_bucket(dtype=string)`` /
    ``*_with_vocabulary_file`` -> ``categorical_column_with_identity`` (and the ``sequence_`` variant),
    because tf2onnx cannot convert StringToHashBucketFast and the vocabulary lookup leaves a string NotEqual
    that onnxruntime rejects.  Histories (DIN/DIEN) arrive as a dense int64 [B, T] matrix padded with -1
    (the identity column drops -1 and builds the SparseTensor, like the ``tf.strings.split`` output the
    scripts feed); ``tf.sparse.slice`` to MAX_SEQ_LENGTH is omitted (T is the max length here).
  * Small sizes: hash buckets / vocabularies <= 1000, embedding dims 8/16, small MLPs, and only the first
    6 of the 26 Criteo categorical columns (DEEPREC_N_CAT; the 13 numeric ones are all kept).
  * Partitioners: the scripts pass ``min_max_variable_partitioner(max_partitions=#ps)`` as
    input_layer_partitioner / dense_layer_partitioner when run with parameter servers; here
    ``fixed_size_partitioner(3)`` (embedding input layer) and ``fixed_size_partitioner(2)`` (dense layers)
    emulate a 3-/2-PS job, giving the sharded-table dialect (ConcatV2 of shards, DynamicPartition /
    DynamicStitch for embedding_lookup over shards) that such users ship.
  * Built for inference: BatchNorm layers built with ``training=False`` (the scripts build the graph once
    with ``is_training=True``); loss/optimizer/metrics/summaries and DIEN's auxiliary loss (not on the
    prediction path) are not built.  BN moving statistics and gammas/betas are given random values.
  * tf.contrib pieces gone from TF 2 are reproduced: DIEN's ``_Linear`` (concat -> MatMul -> BiasAdd) and
    BST's ``tf.contrib.feature_column.sequence_input_layer`` (concat of the sequence embedding columns'
    ``_get_sequence_dense_tensor``); BST's ``tf.keras.layers.LayerNormalization`` comes from tf_keras.
  * MMoE / BST keep a subset of the Taobao ad columns; BST's max_seqence_length is 30 (batch-33 check data
    has 37-step tag lists, so both branches of its tf.cond pad/slice are exercised).
  * Conversion: Assert nodes (DIN/DIEN/BST sequence-length equality checks) are dropped from the frozen
    graph (tf2onnx has no Assert handler); tf2onnx 1.17's integer SegmentMax bug is patched in-process
    (see patch_tf2onnx_int_segment_max); nothing else is changed.

Environment (a venv of its own, not ctropt's), e.g. /work/venvs/deeprec:
    tensorflow-cpu==2.21.0 tf_keras==2.21.0 tf2onnx==1.17.0 onnx onnxruntime openvino numpy
TF runs through ``tf.compat.v1`` with ``disable_v2_behavior()`` (v1 control flow: DIEN's dynamic_rnn
becomes a Scan/Loop after tf2onnx); ``tf.compat.v1.layers`` needs tf_keras (TF_USE_LEGACY_KERAS=1, set below).

Usage (from this directory):
    /work/venvs/deeprec/bin/python make_deeprec.py             # all models, each in its own subprocess
    /work/venvs/deeprec/bin/python make_deeprec.py WDL DIEN    # some of them

Per export, written here only when onnxruntime reproduces TF within 1e-5 at batch 8 and at batches 5 and 33
(other data, other history lengths):
    deeprec_<Model>_tf2onnx.onnx      frozen graph -> tf2onnx (opset 17, dynamic batch / history length),
                                      ir_version clamped to <= 10
    deeprec_<Model>_tf2onnx.npz       sample batch (B=8), keys = ONNX graph input names
    deeprec_<Model>_tf2onnx.ref.npz   TF session.run outputs of the original graph, keys = ONNX output names
A JSON summary per model is printed (and written to $DEEPREC_RESULTS, default /tmp/deeprec_results).

Exports:
    WDL     N_CAT (default 6 of the 26) categorical (identity, partitioned embedding_column mean + linear_model sum) + 13 numeric
            (min-max normalizer) Criteo columns; deep tower 64-32-16 + linear part -> sigmoid.
    DLRM    13 numeric -> bottom MLP (dense+BN) 32-16; N_CAT embedding_column(16, mean) (unpartitioned, as in
            the script); dot interaction (MatMul, band_part lower-triangle boolean_mask); top MLP 32-16.
    DeepFM  N_CAT embedding_column(16) + 13 numeric, shared by linear / FM / deep inputs (partitioned), deep MLP with BN,
            FM second order, final MLP with BN.
    DIN     UID/ITEM/CATEGORY + HISTORY_ITEM/HISTORY_CATEGORY (variable length), partitioned item/category
            tables via safe_embedding_lookup_sparse, DIN attention (PReLU, 80-40 sigmoid MLP, masked softmax),
            BN + 200-80-2-1 top MLP.
    DIEN    as DIN plus GRU (dynamic_rnn, sequence_length) interest extractor, attention scores and the
            AUGRU (VecAttGRUCell) interest evolution dynamic_rnn; final state into the top MLP (2 Scan nodes).
    MMoE    6 id columns (one multi-valued tag list, mean combiner) + price, partitioned embeddings, 4 experts
            32-16, per-task softmax gates, ctr/cvr towers 16-8 -> probability [B, 2].
    BST     7 id columns + 2 tag sequences (sequence embedding columns), tf.cond pad/slice to 29 steps,
            4-head self-attention, 2x add&LayerNorm, feed-forward, final MLP 32-16 with BN.
    DCNv2   WDL's columns, stacked twice (separate dnn/ and cross/ partitioned tables), DNN 64-32-16 and
            2 full-rank cross layers (x0 * dense(x) + x0), logits added.
"""
import json
import os
import subprocess
import sys
import time
import traceback

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import numpy as np  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
RES_DIR = os.environ.get("DEEPREC_RESULTS", "/tmp/deeprec_results")
OPSET = 17
TOL = 1e-5
B = 8                       # saved sample batch
CHECK_BATCHES = (5, 33)     # extra batches with other data (and other history lengths)
HIST_T = {8: 20, 5: 12, 33: 37}   # padded history length per batch (histories 10-50 steps)
SEED = 2024
MODELS = ["WDL", "DLRM", "DeepFM", "DIN", "DIEN", "MMoE", "BST", "DCNv2"]

# Criteo columns (wide_and_deep / dlrm / deepfm)
CONTINUOUS_COLUMNS = ["I" + str(i) for i in range(1, 14)]
# The scripts use all 26 Criteo categorical columns; each sharded feature column costs ~300 ONNX nodes, so
# only the first N_CAT (default 6) are kept to stay well under 1 MB per export (set DEEPREC_N_CAT=26 for all).
N_CAT_COLS = int(os.environ.get("DEEPREC_N_CAT", "6"))
CATEGORICAL_COLUMNS = ["C" + str(i) for i in range(1, N_CAT_COLS + 1)]
# small stand-ins for the scripts' hash-bucket sizes (all <= 1000)
_BUCKETS = [1000, 300, 100, 600, 50, 20, 700, 400, 20, 700, 500, 1000, 600,
            100, 100, 900, 50, 500, 400, 20, 1000, 100, 100, 800, 300, 700]
BUCKETS = dict(zip(CATEGORICAL_COLUMNS, _BUCKETS))
# wide_and_deep uses 64/128-dim embeddings: scaled to 8/16
WDL_EMB = {c: (16 if BUCKETS[c] >= 600 else 8) for c in CATEGORICAL_COLUMNS}
# DIN / DIEN vocabularies
N_UID, N_MID, N_CAT = 1000, 1000, 100


def tf1():
    import tensorflow as tf
    t = tf.compat.v1
    t.disable_v2_behavior()
    return t


def input_partitioner(t):
    return t.fixed_size_partitioner(3)


def dense_partitioner(t):
    return t.fixed_size_partitioner(2)


# ============================================================================ Criteo-style models
def criteo_placeholders(t):
    feats = {}
    for c in CONTINUOUS_COLUMNS:
        feats[c] = t.placeholder(t.float32, [None], name=c)
    for c in CATEGORICAL_COLUMNS:
        feats[c] = t.placeholder(t.int64, [None], name=c)
    return feats


def criteo_data(batch, rng):
    d = {}
    for c in CONTINUOUS_COLUMNS:
        d[c] = rng.exponential(1.0, size=batch).astype(np.float32)
    for c in CATEGORICAL_COLUMNS:
        d[c] = rng.integers(0, BUCKETS[c], size=batch).astype(np.int64)
    return d


def build_wdl(t):
    """modelzoo/wide_and_deep/train.py: build_feature_columns (--tf path) + WDL._create_model."""
    feats = criteo_placeholders(t)
    mins_list = [0.0, -3.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    range_list = [1539.0, 22069.0, 65535.0, 561.0, 2655388.0, 233523.0, 26297.0, 5106.0,
                  24376.0, 9.0, 181.0, 1807.0, 6879.0]

    def make_minmaxscaler(mn, rg):
        def minmaxscaler(col):
            return (col - mn) / rg
        return minmaxscaler

    wide_columns, deep_columns = [], []
    for name in CONTINUOUS_COLUMNS + CATEGORICAL_COLUMNS:
        if name in CATEGORICAL_COLUMNS:
            cat = t.feature_column.categorical_column_with_identity(name, num_buckets=BUCKETS[name])
            wide_columns.append(cat)
            deep_columns.append(t.feature_column.embedding_column(cat, dimension=WDL_EMB[name],
                                                                  combiner="mean"))
        else:
            i = CONTINUOUS_COLUMNS.index(name)
            col = t.feature_column.numeric_column(name, normalizer_fn=make_minmaxscaler(mins_list[i], range_list[i]),
                                                  shape=(1,))
            wide_columns.append(col)
            deep_columns.append(col)
    ilp, dlp = input_partitioner(t), dense_partitioner(t)

    def _dnn(dnn_input, units, layer_name):
        for layer_id, n in enumerate(units):
            with t.variable_scope(layer_name + "_%d" % layer_id, partitioner=dlp,
                                  reuse=t.AUTO_REUSE) as dnn_layer_scope:
                dnn_input = t.layers.dense(dnn_input, units=n, activation=t.nn.relu,
                                           kernel_initializer=t.glorot_uniform_initializer(),
                                           name=dnn_layer_scope)
        return dnn_input

    with t.variable_scope("dnn"):
        with t.variable_scope("input_from_feature_columns", partitioner=ilp, reuse=t.AUTO_REUSE):
            net = t.feature_column.input_layer(features=feats, feature_columns=deep_columns)
        with t.variable_scope("dnn_layers", partitioner=dlp, reuse=t.AUTO_REUSE):
            net = _dnn(net, [64, 32, 16], "hiddenlayer")
            with t.variable_scope("logits") as dnn_logits_scope:
                dnn_logits = t.layers.dense(net, units=1, activation=None, name=dnn_logits_scope)
    with t.variable_scope("linear", partitioner=dlp):
        linear_logits = t.feature_column.linear_model(units=1, features=feats, feature_columns=wide_columns,
                                                      sparse_combiner="sum", weight_collections=None,
                                                      trainable=True)
    logits = t.add_n([dnn_logits, linear_logits])
    probability = t.math.sigmoid(logits)
    return feats, {"probability": probability}, criteo_data


def build_dlrm(t):
    """modelzoo/dlrm/train.py: build_feature_columns (--tf path) + DLRM._create_model, interaction 'dot'."""
    feats = criteo_placeholders(t)
    dense_column, sparse_column = [], []
    for name in CONTINUOUS_COLUMNS + CATEGORICAL_COLUMNS:
        if name in CATEGORICAL_COLUMNS:
            cat = t.feature_column.categorical_column_with_identity(name, num_buckets=BUCKETS[name])
            sparse_column.append(t.feature_column.embedding_column(cat, dimension=16, combiner="mean"))
        else:
            dense_column.append(t.feature_column.numeric_column(name, shape=(1,)))
    ilp, dlp = input_partitioner(t), dense_partitioner(t)
    mlp_bot, mlp_top = [32, 16], [32, 16]
    is_training = False

    def _dot_op(features):
        batch_size = t.shape(features)[0]
        matrixdot = t.matmul(features, features, transpose_b=True)
        feature_dim = matrixdot.shape[-1]
        ones_mat = t.ones_like(matrixdot)
        lower_tri_mat = ones_mat - t.linalg.band_part(ones_mat, 0, -1)
        lower_tri_mask = t.cast(lower_tri_mat, t.bool)
        result = t.boolean_mask(matrixdot, lower_tri_mask)
        output_dim = feature_dim * (feature_dim - 1) // 2
        return t.reshape(result, (batch_size, output_dim))

    with t.variable_scope("input_layer", reuse=t.AUTO_REUSE):
        with t.variable_scope("dense_input_layer", partitioner=ilp, reuse=t.AUTO_REUSE):
            dense_inputs = t.feature_column.input_layer(feats, dense_column)
        with t.variable_scope("sparse_input_layer", reuse=t.AUTO_REUSE):
            column_tensors = {}
            t.feature_column.input_layer(features=feats, feature_columns=sparse_column,
                                         cols_to_output_tensors=column_tensors)
    with t.variable_scope("mlp_bot_layer", partitioner=dlp, reuse=t.AUTO_REUSE):
        for layer_id, n in enumerate(mlp_bot):
            with t.variable_scope("mlp_bot_hiddenlayer_%d" % layer_id, reuse=t.AUTO_REUSE) as sc:
                dense_inputs = t.layers.dense(dense_inputs, units=n, activation=t.nn.relu, name=sc)
                dense_inputs = t.layers.batch_normalization(dense_inputs, training=is_training, trainable=True)
    with t.variable_scope("Op_dot_layer", reuse=t.AUTO_REUSE):
        mlp_input = [dense_inputs]
        for cols in sparse_column:
            mlp_input.append(column_tensors[cols])
        mlp_input = t.stack(mlp_input, axis=1)
        mlp_input = _dot_op(mlp_input)
        mlp_input = t.concat([dense_inputs, mlp_input], 1)
    with t.variable_scope("mlp_top_layer", partitioner=dlp, reuse=t.AUTO_REUSE):
        for layer_id, n in enumerate(mlp_top):
            with t.variable_scope("mlp_top_hiddenlayer_%d" % layer_id, reuse=t.AUTO_REUSE) as sc:
                # (sic) the script feeds mlp_input to every top layer, so only the last one is used
                mlp_logits = t.layers.dense(mlp_input, units=n, activation=t.nn.relu, name=sc)
    with t.variable_scope("logits", reuse=t.AUTO_REUSE) as logits_scope:
        logits = t.layers.dense(mlp_logits, units=1, activation=None, name=logits_scope)
        probability = t.math.sigmoid(logits)
    return feats, {"probability": probability}, criteo_data


def build_deepfm(t):
    """modelzoo/deepfm/train.py: build_feature_columns (--tf path) + DeepFM._create_model (use_bn=True)."""
    feats = criteo_placeholders(t)
    wide_column, deep_column, fm_column = [], [], []
    for name in CONTINUOUS_COLUMNS + CATEGORICAL_COLUMNS:
        if name in CATEGORICAL_COLUMNS:
            cat = t.feature_column.categorical_column_with_identity(name, num_buckets=BUCKETS[name])
            emb = t.feature_column.embedding_column(cat, dimension=16, combiner="mean")
            wide_column.append(emb)
            deep_column.append(emb)
            fm_column.append(emb)
        else:
            col = t.feature_column.numeric_column(name, shape=(1,))
            wide_column.append(col)
            deep_column.append(col)
    ilp, dlp = input_partitioner(t), dense_partitioner(t)
    is_training = False

    def _dnn(dnn_input, units, layer_name):
        for layer_id, n in enumerate(units):
            with t.variable_scope(layer_name + "_%d" % layer_id, partitioner=dlp,
                                  reuse=t.AUTO_REUSE) as sc:
                dnn_input = t.layers.dense(dnn_input, units=n, activation=t.nn.relu, name=sc)
                dnn_input = t.layers.batch_normalization(dnn_input, training=is_training, trainable=True)
        return dnn_input

    with t.variable_scope("input_layer", partitioner=ilp, reuse=t.AUTO_REUSE):
        fm_cols = {}
        dnn_input = t.feature_column.input_layer(feats, deep_column)
        wide_input = t.feature_column.input_layer(feats, wide_column, cols_to_output_tensors=fm_cols)
        fm_input = t.stack([fm_cols[c] for c in fm_column], 1)
    with t.variable_scope("dnn"):
        dnn_output = _dnn(dnn_input, [32, 16, 8], "dnn_layer")
    with t.variable_scope("linear", reuse=t.AUTO_REUSE):
        linear_output = t.reduce_sum(wide_input, axis=1, keepdims=True)
    with t.variable_scope("fm", reuse=t.AUTO_REUSE):
        sum_square = t.square(t.reduce_sum(fm_input, axis=1))
        square_sum = t.reduce_sum(t.square(fm_input), axis=1)
        fm_output = 0.5 * t.subtract(sum_square, square_sum)
    all_input = t.concat([dnn_output, linear_output, fm_output], 1)
    with t.variable_scope("final_dnn"):
        dnn_logits = _dnn(all_input, [16, 8], "final_dnn")
    logits = t.layers.dense(dnn_logits, units=1)
    probability = t.math.sigmoid(logits)
    return feats, {"probability": probability}, criteo_data


# ============================================================================ DIN / DIEN
def seq_placeholders(t):
    return {
        "UID": t.placeholder(t.int64, [None], name="UID"),
        "ITEM": t.placeholder(t.int64, [None], name="ITEM"),
        "CATEGORY": t.placeholder(t.int64, [None], name="CATEGORY"),
        # dense [B, T] id matrix padded with -1 (dropped by the identity column)
        "HISTORY_ITEM": t.placeholder(t.int64, [None, None], name="HISTORY_ITEM"),
        "HISTORY_CATEGORY": t.placeholder(t.int64, [None, None], name="HISTORY_CATEGORY"),
    }


def seq_data(batch, rng):
    T = HIST_T.get(batch, 16)
    lens = rng.integers(1, T + 1, size=batch)
    lens[0] = T                      # at least one full row: the padded width is the max length
    lens[-1] = 1 if batch > 1 else T
    pad = np.arange(T)[None, :] >= lens[:, None]
    hi = rng.integers(0, N_MID, size=(batch, T)).astype(np.int64)
    hc = rng.integers(0, N_CAT, size=(batch, T)).astype(np.int64)
    hi[pad] = -1
    hc[pad] = -1
    return {"UID": rng.integers(0, N_UID, size=batch).astype(np.int64),
            "ITEM": rng.integers(0, N_MID, size=batch).astype(np.int64),
            "CATEGORY": rng.integers(0, N_CAT, size=batch).astype(np.int64),
            "HISTORY_ITEM": hi, "HISTORY_CATEGORY": hc}


def seq_feature_columns(t, emb_dim):
    uid = t.feature_column.categorical_column_with_identity("UID", num_buckets=N_UID)
    return {
        "uid_emb_column": t.feature_column.embedding_column(uid, dimension=emb_dim),
        "item_cate_column": t.feature_column.categorical_column_with_identity("ITEM", num_buckets=N_MID),
        "category_cate_column": t.feature_column.categorical_column_with_identity("CATEGORY", num_buckets=N_CAT),
        "his_item_cate_column": t.feature_column.sequence_categorical_column_with_identity(
            "HISTORY_ITEM", num_buckets=N_MID),
        "his_category_cate_column": t.feature_column.sequence_categorical_column_with_identity(
            "HISTORY_CATEGORY", num_buckets=N_CAT),
    }


class _SeqModelParts:
    """Shared helpers of modelzoo/din/train.py and modelzoo/dien/train.py (identical in both files)."""

    def __init__(self, t, feats, fcs, embedding_dim, hidden_size, attention_size):
        self.t = t
        self._feature = dict(feats)
        self._uid_emb_column = fcs["uid_emb_column"]
        self._item_cate_column = fcs["item_cate_column"]
        self._his_item_cate_column = fcs["his_item_cate_column"]
        self._category_cate_column = fcs["category_cate_column"]
        self._his_category_cate_column = fcs["his_category_cate_column"]
        self._embedding_dim = embedding_dim
        self._hidden_size = hidden_size
        self._attention_size = attention_size
        self._input_layer_partitioner = input_partitioner(t)
        self._dense_layer_partitioner = dense_partitioner(t)
        self._data_type = t.float32

    def _assert_all_equal_and_return(self, tensors, name=None):
        t = self.t
        with t.name_scope(name, "assert_all_equal", values=tensors):
            if len(tensors) == 1:
                return tensors[0]
            assert_equal_ops = [t.debugging.assert_equal(tensors[0], x) for x in tensors[1:]]
            with t.control_dependencies(assert_equal_ops):
                return t.identity(tensors[0])

    def _prelu(self, x, scope=""):
        t = self.t
        with t.variable_scope(name_or_scope=scope, default_name="prelu"):
            alpha = t.get_variable("prelu_" + scope, shape=x.get_shape()[-1], dtype=x.dtype,
                                   initializer=t.constant_initializer(0.1))
            pos = t.nn.relu(x)
            neg = alpha * (x - abs(x)) * t.constant(0.5, dtype=x.dtype)
            return pos + neg

    def _attention(self, query, facts, attention_size, mask, stag="null", mode="SUM", softmax_stag=1,
                   time_major=False, return_alphas=False, forCnn=False):
        t = self.t
        if isinstance(facts, tuple):
            facts = t.concat(facts, 2)
        if len(facts.get_shape().as_list()) == 2:
            facts = t.expand_dims(facts, 1)
        facts_size = facts.get_shape().as_list()[-1]
        query = t.layers.dense(query, facts_size, activation=None, name="f1" + stag)
        query = self._prelu(query)
        queries = t.tile(query, [1, t.shape(facts)[1]])
        queries = t.reshape(queries, t.shape(facts))
        din_all = t.concat([queries, facts, queries - facts, queries * facts], axis=-1)
        d_layer_1_all = t.layers.dense(din_all, 80, activation=t.nn.sigmoid, name="f1_att" + stag)
        d_layer_2_all = t.layers.dense(d_layer_1_all, 40, activation=t.nn.sigmoid, name="f2_att" + stag)
        d_layer_3_all = t.layers.dense(d_layer_2_all, 1, activation=None, name="f3_att" + stag)
        d_layer_3_all = t.reshape(d_layer_3_all, [-1, 1, t.shape(facts)[1]])
        scores = d_layer_3_all
        key_masks = t.expand_dims(mask, 1)
        paddings = t.ones_like(scores) * (-2 ** 32 + 1)
        if not forCnn:
            scores = t.where(key_masks, scores, paddings)
        if softmax_stag:
            scores = t.nn.softmax(scores)
        if mode == "SUM":
            output = t.matmul(scores, facts)
        else:
            scores = t.reshape(scores, [-1, t.shape(facts)[1]])
            output = facts * t.expand_dims(scores, -1)
            output = t.reshape(output, t.shape(facts))
        if return_alphas:
            return output, scores
        return output

    def _top_fc_layer(self, inputs):
        t = self.t
        bn1 = t.layers.batch_normalization(inputs=inputs, name="bn1")
        dnn1 = t.nn.relu(t.layers.dense(bn1, 200, activation=None, name="dnn1"))
        dnn2 = t.nn.relu(t.layers.dense(dnn1, 80, activation=None, name="dnn2"))
        dnn3 = t.layers.dense(dnn2, 2, activation=None, name="dnn3")
        return t.layers.dense(dnn3, 1, activation=None, name="logits")

    def _get_embedding_input(self, builder, feature_column, embedding_table, get_seq_len=False):
        t = self.t
        from tensorflow.python.feature_column import utils as fc_utils
        sparse_tensors = feature_column._get_sparse_tensors(builder)
        embedding = t.nn.safe_embedding_lookup_sparse(embedding_weights=embedding_table,
                                                      sparse_ids=sparse_tensors.id_tensor,
                                                      sparse_weights=sparse_tensors.weight_tensor)
        if get_seq_len:
            return embedding, fc_utils.sequence_length_from_sparse_tensor(sparse_tensors.id_tensor)
        return embedding

    def _embedding_input_layer(self):
        t = self.t
        from tensorflow.python.feature_column.feature_column import _LazyBuilder
        uid_emb = t.feature_column.input_layer(self._feature, self._uid_emb_column)
        item_embedding_var = t.get_variable("item_embedding_var",
                                            [self._item_cate_column._num_buckets, self._embedding_dim])
        category_embedding_var = t.get_variable("category_embedding_var",
                                                [self._category_cate_column._num_buckets, self._embedding_dim])
        builder = _LazyBuilder(self._feature)
        item_embedding = self._get_embedding_input(builder, self._item_cate_column, item_embedding_var)
        category_embedding = self._get_embedding_input(builder, self._category_cate_column,
                                                       category_embedding_var)
        item_emb = t.concat([item_embedding, category_embedding], 1)
        his_item_embedding, his_item_sequence_length = self._get_embedding_input(
            builder, self._his_item_cate_column, item_embedding_var, get_seq_len=True)
        his_category_embedding, his_category_sequence_length = self._get_embedding_input(
            builder, self._his_category_cate_column, category_embedding_var, get_seq_len=True)
        his_item_emb = t.concat([his_item_embedding, his_category_embedding], 2)
        sequence_length = self._assert_all_equal_and_return(
            [his_item_sequence_length, his_category_sequence_length])
        return uid_emb, item_emb, his_item_emb, sequence_length


def build_din(t):
    """modelzoo/din/train.py: DIN._create_model (--tf path)."""
    feats = seq_placeholders(t)
    m = _SeqModelParts(t, feats, seq_feature_columns(t, 8), embedding_dim=8, hidden_size=16, attention_size=16)
    with t.variable_scope("input_layer", partitioner=m._input_layer_partitioner, reuse=t.AUTO_REUSE):
        uid_emb, item_emb, his_item_emb, sequence_length = m._embedding_input_layer()
        item_his_eb_sum = t.reduce_sum(his_item_emb, 1)
        mask = t.sequence_mask(sequence_length)
    with t.variable_scope("attention_layer"):
        attention_output = m._attention(item_emb, his_item_emb, m._attention_size, mask)
        att_fea = t.reduce_sum(attention_output, 1)
    top_input = t.concat([uid_emb, item_emb, item_his_eb_sum, item_emb * item_his_eb_sum, att_fea], 1)
    with t.variable_scope("top_mlp_layer", partitioner=m._dense_layer_partitioner, reuse=t.AUTO_REUSE):
        logits = m._top_fc_layer(top_input)
    probability = t.math.sigmoid(logits)
    return feats, {"probability": probability}, seq_data


def make_vec_att_gru_cell(t):
    """modelzoo/dien/train.py VecAttGRUCell (AUGRU), with tf.contrib's _Linear reproduced."""

    class _Linear(object):
        def __init__(self, args, output_size, build_bias, bias_initializer=None, kernel_initializer=None):
            shapes = [a.get_shape() for a in args]
            total = sum(int(s[1]) for s in shapes)
            dtype = args[0].dtype
            scope = t.get_variable_scope()
            with t.variable_scope(scope) as outer_scope:
                self._weights = t.get_variable("kernel", [total, output_size], dtype=dtype,
                                               initializer=kernel_initializer)
                if build_bias:
                    with t.variable_scope(outer_scope) as inner_scope:
                        inner_scope.set_partitioner(None)
                        if bias_initializer is None:
                            bias_initializer = t.constant_initializer(0.0, dtype=dtype)
                        self._biases = t.get_variable("bias", [output_size], dtype=dtype,
                                                      initializer=bias_initializer)
            self._build_bias = build_bias

        def __call__(self, args):
            res = t.matmul(t.concat(args, 1), self._weights)
            if self._build_bias:
                res = t.nn.bias_add(res, self._biases)
            return res

    class VecAttGRUCell(t.nn.rnn_cell.RNNCell):
        def __init__(self, num_units, activation=None, reuse=None, kernel_initializer=None,
                     bias_initializer=None):
            super(VecAttGRUCell, self).__init__(_reuse=reuse)
            self._num_units = num_units
            self._activation = activation or t.math.tanh
            self._kernel_initializer = kernel_initializer
            self._bias_initializer = bias_initializer
            self._gate_linear = None
            self._candidate_linear = None

        @property
        def state_size(self):
            return self._num_units

        @property
        def output_size(self):
            return self._num_units

        def __call__(self, inputs, state):
            return self.call(inputs, state)

        def call(self, inputs, state, att_score=None):
            _inputs = inputs[0]
            att_score = inputs[1]
            if self._gate_linear is None:
                bias_ones = self._bias_initializer
                if self._bias_initializer is None:
                    bias_ones = t.constant_initializer(1.0, dtype=_inputs.dtype)
                with t.variable_scope("gates"):
                    self._gate_linear = _Linear([_inputs, state], 2 * self._num_units, True,
                                                bias_initializer=bias_ones,
                                                kernel_initializer=self._kernel_initializer)
            value = t.math.sigmoid(self._gate_linear([_inputs, state]))
            r, u = t.split(value=value, num_or_size_splits=2, axis=1)
            r_state = r * state
            if self._candidate_linear is None:
                with t.variable_scope("candidate"):
                    self._candidate_linear = _Linear([_inputs, r_state], self._num_units, True,
                                                     bias_initializer=self._bias_initializer,
                                                     kernel_initializer=self._kernel_initializer)
            c = self._activation(self._candidate_linear([_inputs, r_state]))
            u = (1.0 - att_score) * u
            new_h = u * state + (1 - u) * c
            return new_h, new_h

    return VecAttGRUCell


def build_dien(t):
    """modelzoo/dien/train.py: DIEN._create_model (--tf path), without the auxiliary-loss branch."""
    feats = seq_placeholders(t)
    m = _SeqModelParts(t, feats, seq_feature_columns(t, 8), embedding_dim=8, hidden_size=16, attention_size=16)
    VecAttGRUCell = make_vec_att_gru_cell(t)
    with t.variable_scope("input_layer", partitioner=m._input_layer_partitioner, reuse=t.AUTO_REUSE):
        uid_emb, item_emb, his_item_emb, sequence_length = m._embedding_input_layer()
        item_his_eb_sum = t.reduce_sum(his_item_emb, 1)
        mask = t.sequence_mask(sequence_length)
    with t.variable_scope("rnn_1"):
        run_output_1, _ = t.nn.dynamic_rnn(t.nn.rnn_cell.GRUCell(m._hidden_size), inputs=his_item_emb,
                                           sequence_length=sequence_length, dtype=m._data_type, scope="gru1")
    with t.variable_scope("attention_layer"):
        _, alphas = m._attention(item_emb, run_output_1, m._attention_size, mask, softmax_stag=1,
                                 stag="1_1", mode="LIST", return_alphas=True)
    with t.variable_scope("rnn_2"):
        _, final_state2 = t.nn.dynamic_rnn(VecAttGRUCell(m._hidden_size),
                                           inputs=[run_output_1, t.expand_dims(alphas, -1)],
                                           sequence_length=sequence_length, dtype=m._data_type, scope="gru2")
    top_input = t.concat([uid_emb, item_emb, item_his_eb_sum, item_emb * item_his_eb_sum, final_state2], 1)
    with t.variable_scope("top_mlp_layer", partitioner=m._dense_layer_partitioner, reuse=t.AUTO_REUSE):
        logits = m._top_fc_layer(top_input)
    probability = t.math.sigmoid(logits)
    return feats, {"probability": probability}, seq_data


def build_dcnv2(t):
    """modelzoo/dcnv2/train.py: build_feature_columns (--tf path) + DCN._create_model (projection_dim=None)."""
    feats = criteo_placeholders(t)
    mins_list = [0.0, -3.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    range_list = [1539.0, 22069.0, 65535.0, 561.0, 2655388.0, 233523.0, 26297.0, 5106.0,
                  24376.0, 9.0, 181.0, 1807.0, 6879.0]

    def make_minmaxscaler(mn, rg):
        def minmaxscaler(col):
            return (col - mn) / rg
        return minmaxscaler

    emb_stacking_columns = []
    for name in CONTINUOUS_COLUMNS + CATEGORICAL_COLUMNS:
        if name in CATEGORICAL_COLUMNS:
            cat = t.feature_column.categorical_column_with_identity(name, num_buckets=BUCKETS[name])
            emb_stacking_columns.append(t.feature_column.embedding_column(cat, dimension=WDL_EMB[name],
                                                                          combiner="mean"))
        else:
            i = CONTINUOUS_COLUMNS.index(name)
            emb_stacking_columns.append(t.feature_column.numeric_column(
                name, normalizer_fn=make_minmaxscaler(mins_list[i], range_list[i]), shape=(1,)))
    ilp, dlp = input_partitioner(t), dense_partitioner(t)
    projection_dim = None

    def _dnn(dnn_input, units, layer_name):
        for layer_id, n in enumerate(units):
            with t.variable_scope(layer_name + "_%d" % layer_id, partitioner=dlp, reuse=t.AUTO_REUSE) as sc:
                dnn_input = t.layers.dense(dnn_input, units=n, activation=t.nn.relu,
                                           kernel_initializer=t.glorot_uniform_initializer(), name=sc)
        return dnn_input

    def _cross_net(cross_input, layer_num=2, layer_name=""):
        x = cross_input
        for layer_id in range(layer_num):
            with t.variable_scope(layer_name + "_%d" % layer_id, partitioner=dlp, reuse=t.AUTO_REUSE) as sc:
                last_dim = cross_input.shape[-1]
                if projection_dim is None:
                    cross_input = t.layers.dense(cross_input, units=last_dim,
                                                 kernel_initializer=t.glorot_uniform_initializer(), name=sc)
                else:
                    cross_input = t.layers.dense(cross_input, units=projection_dim,
                                                 kernel_initializer=t.glorot_uniform_initializer())
                    cross_input = t.layers.dense(cross_input, units=last_dim,
                                                 kernel_initializer=t.glorot_uniform_initializer())
                cross_input = x * cross_input + x
        return cross_input

    with t.variable_scope("dnn"):
        with t.variable_scope("input_from_feature_columns", partitioner=ilp, reuse=t.AUTO_REUSE):
            net = t.feature_column.input_layer(features=feats, feature_columns=emb_stacking_columns)
        with t.variable_scope("dnn_layers", partitioner=dlp, reuse=t.AUTO_REUSE):
            net = _dnn(net, [64, 32, 16], "hiddenlayer")
            with t.variable_scope("logits") as sc:
                dnn_logits = t.layers.dense(net, units=1, activation=None, name=sc)
    with t.variable_scope("cross", partitioner=dlp):
        with t.variable_scope("input_from_feature_columns", partitioner=ilp, reuse=t.AUTO_REUSE):
            net = t.feature_column.input_layer(features=feats, feature_columns=emb_stacking_columns)
        with t.variable_scope("cross_layers", partitioner=dlp, reuse=t.AUTO_REUSE):
            net = _cross_net(net, layer_name="crosslayer")
            with t.variable_scope("logits") as sc:
                cross_logits = t.layers.dense(net, units=1, activation=None, name=sc)
    logits = t.add_n([dnn_logits, cross_logits])
    probability = t.math.sigmoid(logits)
    return feats, {"probability": probability}, criteo_data


# ============================================================================ MMoE (Taobao ad columns)
# modelzoo/mmoe/train.py uses 16 hashed columns (+ the 'price' identity column); a subset is kept, with the
# '|'-separated tag list as a multi-valued id matrix padded with -1 (combiner 'mean').
MMOE_HASH = {"pid": 10, "adgroup_id": 1000, "cate_id": 500, "user_id": 1000, "age_level": 10,
             "tag_category_list": 500}
MMOE_MULTI = {"tag_category_list": 5}   # max tags per row (dynamic width)


def build_mmoe(t):
    """modelzoo/mmoe/train.py: build_feature_cols (--tf path) + MMOE._create_model."""
    feats = {}
    for c in MMOE_HASH:
        shape = [None, None] if c in MMOE_MULTI else [None]
        feats[c] = t.placeholder(t.int64, shape, name=c)
    feats["price"] = t.placeholder(t.int64, [None], name="price")
    EMBEDDING_DIM = 8
    feature_cols = []
    for c, n in MMOE_HASH.items():
        cat = t.feature_column.categorical_column_with_identity(c, num_buckets=n)
        feature_cols.append(t.feature_column.embedding_column(cat, dimension=EMBEDDING_DIM, combiner="mean"))
    feature_cols.append(t.feature_column.embedding_column(
        t.feature_column.categorical_column_with_identity("price", 50), dimension=EMBEDDING_DIM, combiner="mean"))
    num_experts, expert_hidden_units = 4, [32, 16]
    towers = [("ctr", "clk", [16, 8]), ("cvr", "buy", [16, 8])]
    DNN_ACTIVATION = t.nn.relu
    ilp, dlp = input_partitioner(t), dense_partitioner(t)

    key_dict = {}
    with t.variable_scope("input_layer", partitioner=ilp, reuse=t.AUTO_REUSE):
        input_emb = t.feature_column.input_layer(feats, feature_cols, cols_to_output_tensors=key_dict)
    with t.variable_scope("MMOE", partitioner=dlp, reuse=t.AUTO_REUSE):
        experts = []
        for i in range(1, num_experts + 1):
            with t.variable_scope(f"expert_{i}"):
                expert_features = input_emb
                for layer_id, n in enumerate(expert_hidden_units):
                    with t.variable_scope(f"expert_{i}_layer_{layer_id}", reuse=t.AUTO_REUSE) as sc:
                        expert_features = t.layers.dense(expert_features, units=n, activation=None,
                                                         name=f"{sc.name}/dense")
                        expert_features = DNN_ACTIVATION(expert_features, name=f"{sc.name}/act")
                experts.append(expert_features)
        experts_features = t.stack(experts, axis=1)
        outs = []
        for tower in towers:
            tower_name, hidden_units = tower[0], tower[2]
            with t.variable_scope(f"{tower_name}_gate", reuse=t.AUTO_REUSE):
                gate = t.layers.dense(input_emb, units=num_experts, name=f"{tower_name}_gate")
                gate = t.nn.softmax(gate, axis=1)
                gate = t.expand_dims(gate, -1)
            with t.variable_scope(tower_name):
                tower_input = t.multiply(experts_features, gate)
                tower_input = t.reduce_sum(tower_input, axis=1)
                tower_features = tower_input
                for layer_id, n in enumerate(hidden_units):
                    with t.variable_scope(f"{tower_name}_layer_{layer_id}", reuse=t.AUTO_REUSE) as sc:
                        tower_features = t.layers.dense(tower_features, units=n, name=f"{sc.name}/dense")
                        tower_features = DNN_ACTIVATION(tower_features, name=f"{sc.name}/act")
                final_tower_predict = t.layers.dense(inputs=tower_features, units=1, activation=None,
                                                     name=f"{tower_name}_output")
                outs.append(final_tower_predict)
        tower_stack = t.stack(outs, axis=1)
        logits = t.squeeze(tower_stack, [2])
        probability = t.math.sigmoid(logits)
    return feats, {"probability": probability}, mmoe_data


def mmoe_data(batch, rng):
    d = {}
    for c, n in MMOE_HASH.items():
        if c in MMOE_MULTI:
            L = MMOE_MULTI[c] + (batch % 3)          # other widths at other batches
            lens = rng.integers(1, L + 1, size=batch)
            lens[0] = L
            ids = rng.integers(0, n, size=(batch, L)).astype(np.int64)
            ids[np.arange(L)[None, :] >= lens[:, None]] = -1
            d[c] = ids
        else:
            d[c] = rng.integers(0, n, size=batch).astype(np.int64)
    d["price"] = rng.integers(0, 50, size=batch).astype(np.int64)
    return d


# ============================================================================ BST (Taobao ad columns)
# modelzoo/bst/train.py: 15 user/item hashed columns (a subset kept) + the '|'-separated tag lists as
# sequence columns (dense id matrices padded with -1); max_seqence_length 30 instead of 50.
BST_UNSEQ = {"user_id": 1000, "age_level": 10, "adgroup_id": 1000, "cate_id": 500, "brand": 500,
             "price": 50, "pid": 10}
BST_TAG = {"tag_category_list": 500, "tag_brand_list": 500}
BST_KEY = ["cate_id", "brand"]
BST_MAX_SEQ = 30


def build_bst(t):
    """modelzoo/bst/train.py: BST._create_model (--tf path, use_bn=True, multi_head_size=4)."""
    from tensorflow.python.feature_column.feature_column import _LazyBuilder
    feats = {c: t.placeholder(t.int64, [None], name=c) for c in BST_UNSEQ}
    for c in BST_TAG:
        feats[c] = t.placeholder(t.int64, [None, None], name=c)
    EMBEDDING_DIM = 8
    unseq_column = [t.feature_column.embedding_column(
        t.feature_column.categorical_column_with_identity(c, num_buckets=n), dimension=EMBEDDING_DIM,
        combiner="mean") for c, n in BST_UNSEQ.items()]
    col_by_name = dict(zip(BST_UNSEQ, unseq_column))
    tag_column = [t.feature_column.embedding_column(
        t.feature_column.sequence_categorical_column_with_identity(c, num_buckets=n), dimension=EMBEDDING_DIM)
        for c, n in BST_TAG.items()]
    key_column = [col_by_name[k] for k in BST_KEY]
    final_hidden_units, seq_size, head_count = [32, 16], BST_MAX_SEQ, 4
    ilp, dlp = input_partitioner(t), dense_partitioner(t)
    is_training = False

    def sequence_input_layer(features, feature_columns):
        """tf.contrib.feature_column.sequence_input_layer (TF 1.15), reproduced: concat of the sequence
        dense tensors, sequence length asserted equal across columns."""
        builder = _LazyBuilder(features)
        outs, lens = [], []
        for col in sorted(feature_columns, key=lambda c: c.name):
            with t.variable_scope(None, default_name=col._var_scope_name):
                dense, seq_len = col._get_sequence_dense_tensor(builder)
                outs.append(dense)
                lens.append(seq_len)
        with t.name_scope("assert_all_equal"):
            asserts = [t.debugging.assert_equal(lens[0], x) for x in lens[1:]]
            with t.control_dependencies(asserts):
                seq_len = t.identity(lens[0])
        return t.concat(outs, -1), seq_len

    def _add_and_norm(net_1, net_2, emb_dim, name="add_and_norm"):
        with t.variable_scope(name):
            net = t.add(net_1, net_2)
            import tf_keras
            net = tf_keras.layers.LayerNormalization(axis=2)(net)
        return net

    def _multihead_attention(id_cols, head_count, emb_dim, seq_len, seq_size, name="multi_head_att_net"):
        with t.variable_scope(name):
            query_net = t.layers.dense(id_cols, units=emb_dim, activation=t.nn.relu, name=name + "_query")
            key_net = t.layers.dense(id_cols, units=emb_dim, activation=t.nn.relu, name=name + "_key")
            value_net = t.layers.dense(id_cols, units=emb_dim, activation=t.nn.relu, name=name + "_value")
            query_net = t.concat(t.split(query_net, head_count, axis=-1), axis=0)
            key_net = t.concat(t.split(key_net, head_count, axis=-1), axis=0)
            value_net = t.concat(t.split(value_net, head_count, axis=-1), axis=0)
            scores = t.matmul(query_net, key_net, transpose_b=True)
            hist_mask = t.sequence_mask(seq_len, maxlen=seq_size - 1)
            cur_id_mask = t.ones([t.shape(hist_mask)[0], 1], dtype=t.bool)
            mask = t.concat([cur_id_mask, hist_mask], axis=1)
            masks = t.reshape(t.tile(mask, [head_count, seq_size]), (-1, seq_size, seq_size))
            padding_mask = t.math.logical_not(masks)
            scores -= 1.e9 * t.cast(padding_mask, dtype=scores.dtype)
            scores = t.nn.softmax(scores)
            att_res_net = t.matmul(scores, value_net)
            att_res_net = t.concat(t.split(att_res_net, head_count, axis=0), axis=2)
            att_res_net = t.layers.dense(att_res_net, units=emb_dim, activation=t.nn.relu,
                                         name="multi_head_attention")
        return att_res_net

    def _bst_tower(bst_fea, seq_size, head_count, name):
        cur_id, hist_id_col, seq_len = bst_fea["key"], bst_fea["hist_seq_emb"], bst_fea["hist_seq_len"]
        cur_batch_max_seq_len = t.shape(hist_id_col)[1]
        hist_id_col = t.cond(
            t.constant(seq_size) > cur_batch_max_seq_len,
            lambda: t.pad(hist_id_col, [[0, 0], [0, seq_size - cur_batch_max_seq_len - 1], [0, 0]], "CONSTANT"),
            lambda: t.slice(hist_id_col, [0, 0, 0], [-1, seq_size - 1, -1]))
        all_ids = t.concat([hist_id_col, t.expand_dims(cur_id, 1)], axis=1)
        emb_dim = int(all_ids.shape[2])
        attention_net = _multihead_attention(all_ids, head_count, emb_dim, seq_len, seq_size)
        tmp_net = _add_and_norm(all_ids, attention_net, emb_dim, name="add_and_norm_1")
        ff1 = t.layers.dense(tmp_net, units=emb_dim, activation=t.nn.relu, name="feed_forward_net_1")
        ff = t.layers.dense(ff1, units=emb_dim, activation=None, name="feed_forward_net_2")
        net = _add_and_norm(tmp_net, ff, emb_dim, name="add_and_norm_2")
        return t.reshape(net, [-1, seq_size * emb_dim])

    with t.variable_scope("input_layer", partitioner=ilp):
        key_dict = {}
        with t.variable_scope("unseq_input_layer", reuse=t.AUTO_REUSE):
            unseq_emb = t.feature_column.input_layer(feats, unseq_column, cols_to_output_tensors=key_dict)
        with t.variable_scope("bst_input_layer", reuse=t.AUTO_REUSE):
            with t.variable_scope("tag_input_layer", reuse=t.AUTO_REUSE):
                tag_emb, tag_len = sequence_input_layer(feats, tag_column)
            with t.variable_scope("key_input_layer", reuse=t.AUTO_REUSE):
                key_emb = t.concat([key_dict[k] for k in key_column], axis=-1)
        bst_tower_fea = {"key": key_emb, "hist_seq_emb": tag_emb, "hist_seq_len": tag_len}
    with t.variable_scope("bst_tower", partitioner=dlp, reuse=t.AUTO_REUSE):
        bst_output = _bst_tower(bst_tower_fea, seq_size=seq_size, head_count=head_count, name="bst")
    net = t.concat([unseq_emb, bst_output], axis=1)
    with t.variable_scope("final_dnn_layer", partitioner=dlp, reuse=t.AUTO_REUSE):
        for idx, units in enumerate(final_hidden_units):
            with t.variable_scope("final_dnn_%d" % idx, reuse=t.AUTO_REUSE):
                net = t.layers.dense(net, units=units, activation=None)
                net = t.layers.batch_normalization(net, training=is_training, trainable=True)
                net = t.nn.relu(net)
    logits = t.layers.dense(inputs=net, units=1)
    probability = t.math.sigmoid(logits)
    return feats, {"probability": probability}, bst_data


def bst_data(batch, rng):
    T = HIST_T.get(batch, 16)     # 20 / 12 / 37: 37 > BST_MAX_SEQ - 1 takes the tf.cond slice branch
    lens = rng.integers(1, T + 1, size=batch)
    lens[0] = T
    pad = np.arange(T)[None, :] >= lens[:, None]
    d = {c: rng.integers(0, n, size=batch).astype(np.int64) for c, n in BST_UNSEQ.items()}
    for c, n in BST_TAG.items():
        ids = rng.integers(0, n, size=(batch, T)).astype(np.int64)
        ids[pad] = -1
        d[c] = ids
    return d


BUILDERS = {"WDL": build_wdl, "DLRM": build_dlrm, "DeepFM": build_deepfm, "DIN": build_din, "DIEN": build_dien,
            "MMoE": build_mmoe, "BST": build_bst, "DCNv2": build_dcnv2}


# ============================================================================ export / check
def randomize_extra_state(t, sess, rng):
    """BN moving stats / gamma / beta get non-trivial seeded values (defaults would make BN an identity)."""
    for v in t.global_variables():
        n = v.op.name
        shape = v.get_shape().as_list()
        if n.endswith("moving_mean"):
            v.load(rng.normal(0, 0.2, size=shape).astype(np.float32), sess)
        elif n.endswith("moving_variance"):
            v.load(rng.uniform(0.5, 1.5, size=shape).astype(np.float32), sess)
        elif n.endswith("gamma"):
            v.load(rng.uniform(0.8, 1.2, size=shape).astype(np.float32), sess)
        elif n.endswith("beta"):
            v.load(rng.normal(0, 0.1, size=shape).astype(np.float32), sess)


def strip_asserts(graph_def):
    """Drop Assert nodes (and control inputs on them): tf2onnx has no Assert handler."""
    from tensorflow.core.framework import graph_pb2
    asserts = {n.name for n in graph_def.node if n.op == "Assert"}
    out = graph_pb2.GraphDef()
    out.versions.CopyFrom(graph_def.versions)
    out.library.CopyFrom(graph_def.library)
    for n in graph_def.node:
        if n.name in asserts:
            continue
        nn = out.node.add()
        nn.CopyFrom(n)
        del nn.input[:]
        nn.input.extend([i for i in n.input if not (i.startswith("^") and i[1:] in asserts)])
    return out, len(asserts)


def patch_tf2onnx_int_segment_max():
    """WORKAROUND (converter bug, not model code): tf2onnx 1.17's Segment* handler takes the identity value of an
    integer SegmentMax/Min from ``np.iinfo(dtype).min`` (a Python int) and then calls ``.tolist()`` on it, so
    the SegmentMax of ``feature_column.utils.sequence_length_from_sparse_tensor`` (DIN/DIEN history lengths) is
    left unconverted.  Give the handler module an ``iinfo`` whose min/max are numpy scalars."""
    import types
    import tf2onnx.onnx_opset.reduction as R

    class _Np(object):
        def __getattr__(self, k):
            return getattr(np, k)

        @staticmethod
        def iinfo(dt):
            i = np.iinfo(dt)
            return types.SimpleNamespace(min=np.array(i.min, dtype=dt), max=np.array(i.max, dtype=dt),
                                         bits=i.bits, dtype=i.dtype)
    R.np = _Np()


def walk_nodes(graph):
    for n in graph.node:
        yield n
        for a in n.attribute:
            if a.type == 5:
                yield from walk_nodes(a.g)
            elif a.type == 10:
                for g in a.graphs:
                    yield from walk_nodes(g)


def max_err(outs, refs):
    e = 0.0
    for k, r in refs.items():
        o = np.asarray(outs[k], np.float64)
        r = np.asarray(r, np.float64)
        if o.shape != r.shape:
            return float("inf")
        e = max(e, float(np.max(np.abs(o - r))) if r.size else 0.0)
    return e


def run_model(name):
    import tensorflow as tf  # noqa: F401
    t = tf1()
    import onnx
    import tf2onnx
    patch_tf2onnx_int_segment_max()

    res = {"model": name}
    graph = t.Graph()
    with graph.as_default():
        t.set_random_seed(SEED)
        feats, outputs, gen = BUILDERS[name](t)
        sess = t.Session(graph=graph, config=t.ConfigProto(intra_op_parallelism_threads=1,
                                                           inter_op_parallelism_threads=1))
        sess.run([t.global_variables_initializer(), t.local_variables_initializer(), t.tables_initializer()])
        randomize_extra_state(t, sess, np.random.default_rng(SEED + 1))
        res["partitioned_variables"] = sorted({v.op.name.rsplit("/part_", 1)[0] for v in t.global_variables()
                                               if "/part_" in v.op.name})
        out_names = [v.name for v in outputs.values()]
        in_names = [p.name for p in feats.values()]

        def tf_run(data):
            fd = {feats[k]: v for k, v in data.items()}
            vals = sess.run(list(outputs.values()), feed_dict=fd)
            return dict(zip(out_names, vals))

        datasets = {B: gen(B, np.random.default_rng(42))}
        for i, b in enumerate(CHECK_BATCHES):
            datasets[b] = gen(b, np.random.default_rng(100 + i))
        refs = {b: tf_run(d) for b, d in datasets.items()}

        frozen = t.graph_util.convert_variables_to_constants(sess, graph.as_graph_def(),
                                                           [v.op.name for v in outputs.values()])
    frozen, n_assert = strip_asserts(frozen)
    res["tf_asserts_stripped"] = n_assert
    t0 = time.time()
    model_proto, _ = tf2onnx.convert.from_graph_def(frozen, input_names=in_names, output_names=out_names,
                                                    opset=OPSET)
    res["convert_s"] = round(time.time() - t0, 1)
    res["orig_ir_version"] = model_proto.ir_version
    model_proto.ir_version = min(model_proto.ir_version, 10)
    stem = f"deeprec_{name}_tf2onnx"
    tmp = os.path.join(RES_DIR, stem + ".onnx")
    onnx.save(model_proto, tmp)
    m = onnx.load(tmp)
    onnx.checker.check_model(m)
    nodes = list(walk_nodes(m.graph))
    res.update(nodes_top=len(m.graph.node), nodes_total=len(nodes),
               opset={o.domain or "ai.onnx": o.version for o in m.opset_import}, ir_version=m.ir_version,
               size_bytes=os.path.getsize(tmp),
               inputs=[(i.name, i.type.tensor_type.elem_type,
                        [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim]) for i in m.graph.input],
               outputs=[o.name for o in m.graph.output])
    from collections import Counter
    res["op_hist"] = dict(Counter(n.op_type for n in nodes).most_common())

    onnx_in = {i.name: i for i in m.graph.input}
    np_dtype = {1: np.float32, 7: np.int64, 6: np.int32}

    def feed(data):
        out = {}
        for k, v in data.items():
            nm = feats[k].name
            out[nm] = np.asarray(v, np_dtype[onnx_in[nm].type.tensor_type.elem_type])
        return out

    import onnxruntime as ort
    s = ort.InferenceSession(tmp, providers=["CPUExecutionProvider"])
    onames = [o.name for o in s.get_outputs()]
    res["ort_err"] = {}
    for b, d in datasets.items():
        try:
            res["ort_err"][b] = max_err(dict(zip(onames, s.run(None, feed(d)))), refs[b])
        except Exception as e:  # noqa
            res["ort_err"][b] = f"{type(e).__name__}: {str(e)[:400]}"
    ok = all(isinstance(v, float) and v <= TOL for v in res["ort_err"].values())
    res["kept"] = ok
    # ---- OpenVINO (recorded, not required)
    try:
        import openvino as ov
        cm = ov.Core().compile_model(tmp, "CPU")
        res["ov_load"] = "ok"
        res["ov_err"] = {}
        for b, d in datasets.items():
            try:
                r = cm(feed(d))
                outs = {}
                for o in cm.outputs:
                    for nm in o.get_names():
                        if nm in out_names:
                            outs[nm] = r[o]
                res["ov_err"][b] = max_err(outs, refs[b])
            except Exception as e:  # noqa
                res["ov_err"][b] = f"{type(e).__name__}: {str(e)[:300]}"
    except Exception as e:  # noqa
        res["ov_load"] = f"{type(e).__name__}: {str(e)[:600]}"
    if ok:
        path = os.path.join(HERE, stem + ".onnx")
        onnx.save(m, path)
        np.savez(os.path.join(HERE, stem + ".npz"), **feed(datasets[B]))
        np.savez(os.path.join(HERE, stem + ".ref.npz"), **{k: np.asarray(v) for k, v in refs[B].items()})
        res["written"] = [stem + ext for ext in (".onnx", ".npz", ".ref.npz")]
    return res


def child(name):
    os.makedirs(RES_DIR, exist_ok=True)
    try:
        res = run_model(name)
    except Exception as e:  # noqa
        res = {"model": name, "error": f"{type(e).__name__}: {str(e)[:1500]}",
               "traceback_tail": traceback.format_exc()[-3000:]}
    with open(os.path.join(RES_DIR, f"deeprec_{name}.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    short = {k: res.get(k) for k in ("nodes_total", "opset", "size_bytes", "ort_err", "kept", "ov_load",
                                      "ov_err", "error")}
    print(f"[deeprec/{name}] {json.dumps(short, default=str)}", flush=True)


def main(argv):
    if argv and argv[0] == "--child":
        child(argv[1])
        return
    names = argv or MODELS
    for n in names:
        if n not in BUILDERS:
            raise SystemExit(f"unknown model {n}; choose from {list(BUILDERS)}")
    for n in names:   # one model per subprocess, one at a time
        subprocess.run([sys.executable, os.path.abspath(__file__), "--child", n], check=False)


if __name__ == "__main__":
    main(sys.argv[1:])
