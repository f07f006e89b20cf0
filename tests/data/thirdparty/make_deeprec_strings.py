#!/usr/bin/env python
"""Export DeepRec modelzoo models that read raw string features (TensorFlow 1 graphs) to ONNX with ctropt's
exporter (tf2onnx with the ai.onnx.contrib opset), check the ids computed from strings and the outputs against
TensorFlow's, and write the fixtures tests/test_thirdparty.py runs.

Source followed: DeepRec-AI/DeepRec, ``modelzoo/<model>/train.py`` with the ``--tf`` (stock TensorFlow) code
paths, as in make_deeprec.py (whose model code this reuses), but with the scripts' string feature columns as
written instead of integer ids.  Files / commits read (as stored by the code index):
    WDL     modelzoo/wide_and_deep/train.py  22c94947a62a953583f965bec7f6d1caad478da3
    DIN     modelzoo/din/train.py            5c8eb4fc0743b35cdd172a559ee1297785ac0070
No third-party code is loaded or copied; nothing is downloaded (weights seeded-random, data synthetic).

    WDL     the 26 Criteo categorical columns arrive as strings (``tf.io.decode_csv`` with default ' ') and
            are ``categorical_column_with_hash_bucket(name, hash_bucket_size, dtype=tf.string)`` (the script's
            10000 buckets scaled to make_deeprec's BUCKETS), shared by the deep part (``embedding_column``,
            mean) and the linear part (``linear_model``, sum); the first N_CAT (6) of them, as make_deeprec.
            Feature columns drop "" (their ignore value) before hashing: an empty string has no embedding.
    DIN     UID / ITEM / CATEGORY ``categorical_column_with_vocabulary_file(..., default_value=0)`` (UID through
            ``embedding_column``), HISTORY_ITEM / HISTORY_CATEGORY raw '\\x02'-joined strings split inside the
            model (``tf.strings.split(feature, '\\x02')`` then ``tf.sparse.slice`` to MAX_SEQ_LENGTH, as
            ``_embedding_input_layer`` does) and looked up by ``sequence_categorical_column_with_vocabulary_file``;
            vocabulary files of 300 / 500 / 40 words written to a temporary directory.  (The script's separator is
            an invisible '\\x02' between the quotes, as in the Amazon/Taobao data files it reads.)

Deliberate differences from the training scripts (besides make_deeprec's: small sizes, fixed partitioners,
inference-only graph, Assert nodes dropped, tf2onnx's integer SegmentMax patched):
  * DIN's ``tf.sparse.slice`` takes its batch size from ``tf.shape(UID)[0]`` (the script reads it off the
    label, which is no model input at serving time).

Environment: ctropt's own venv (tensorflow-cpu 2.21, tf2onnx 1.17, onnxruntime-extensions 0.14) plus tf_keras
2.21 for ``tf.compat.v1.layers`` (e.g. the copy in /work/venvs/deeprec: put a directory holding a ``tf_keras``
link on PYTHONPATH).  Usage (from the repository root):
    PYTHONPATH=.:tests/data/thirdparty:/tmp/tfk .venv/bin/python tests/data/thirdparty/make_deeprec_strings.py
    PYTHONPATH=.:tests/data/thirdparty:/tmp/tfk .venv/bin/ctropt export make_deeprec_strings:wdl -o wdl.onnx
(one model per process when run as a script; ``make_deeprec_strings:wdl`` / ``:din`` return ctropt TFModels).

Written here for each model when the export check passes (ids equal, outputs within 1e-5 at batch 1, 7, 256):
    deeprec_<Model>_strings_tf2onnx.onnx      opset 17 + ai.onnx.contrib 1
    deeprec_<Model>_strings_tf2onnx.npz       sample batch (B=8, unseen / empty / ' ' / unicode strings)
    deeprec_<Model>_strings_tf2onnx.ref.npz   TensorFlow's outputs on it
"""
import os
import subprocess
import sys
import tempfile

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import numpy as np  # noqa: E402

import make_deeprec as dr  # noqa: E402  (the numeric fixtures' script, beside this one)

HERE = os.path.dirname(os.path.abspath(__file__))
SEED = 2024
B = 8
MAX_SEQ_LENGTH = 50
SEP = "\x02"
N_UID, N_MID, N_CAT = 300, 500, 40
# strings traffic sends that training never saw, and the empty / decode_csv-default ones
UNSEEN = ["unseen_7f3a", "ünbekannt", "未知の値", "🙂", "x" * 40]
MISSING = ["", " "]


def _draw(rng, pool, shape, unseen=0.1, missing=0.05):
    pool = np.array(pool, dtype=object)
    out = pool[rng.integers(0, len(pool), size=shape)]
    roll = rng.random(shape)
    out = np.where(roll < unseen, np.array(UNSEEN, dtype=object)[rng.integers(0, len(UNSEEN), size=shape)], out)
    out = np.where(roll > 1 - missing, np.array(MISSING, dtype=object)[rng.integers(0, 2, size=shape)], out)
    flat = out.reshape(-1)
    if flat.size >= 3:  # every batch of three or more has an unseen, an empty and a ' ' value
        flat[:3] = [UNSEEN[int(rng.integers(0, len(UNSEEN)))], "", " "]
    return out.astype(str)


def _freeze(t, graph, sess, outputs):
    keep = [o.op.name for o in outputs]
    if t.get_collection(t.GraphKeys.TABLE_INITIALIZERS):
        keep.append(t.tables_initializer(name="init_all_tables").name)
    frozen = t.graph_util.convert_variables_to_constants(sess, graph.as_graph_def(), keep)
    return dr.strip_asserts(frozen)[0]


def _build(builder):
    import tensorflow as tf
    from ctropt.exporters.zoo.spec import Input, TFModel

    t = tf.compat.v1
    t.disable_v2_behavior()
    dr.patch_tf2onnx_int_segment_max()
    graph = t.Graph()
    with graph.as_default():
        t.set_random_seed(SEED)
        feats, outputs, sample = builder(t)
        with t.Session(graph=graph) as sess:
            sess.run([t.global_variables_initializer(), t.tables_initializer()])
            dr.randomize_extra_state(t, sess, np.random.default_rng(SEED + 1))
            frozen = _freeze(t, graph, sess, list(outputs.values()))
    inputs = [Input(p.op.name, np.dtype(object) if p.dtype == t.string else np.dtype(p.dtype.as_numpy_dtype),
                    tuple(p.shape.as_list())) for p in feats.values()]
    return TFModel(frozen, inputs, [o.op.name for o in outputs.values()], sample)


# ============================================================================ WDL: hash-bucket columns
CRITEO_WORDS = [f"{(i * 2654435761) % (1 << 32):08x}" for i in range(3000)]   # Criteo's hashed 8-hex tokens


def _wdl_graph(t):
    """modelzoo/wide_and_deep/train.py: build_feature_columns (--tf path: string hash-bucket columns) +
    WDL._create_model (the graph code of make_deeprec.build_wdl)."""
    feats = {c: t.placeholder(t.float32, [None], name=c) for c in dr.CONTINUOUS_COLUMNS}
    feats.update({c: t.placeholder(t.string, [None], name=c) for c in dr.CATEGORICAL_COLUMNS})
    mins_list = [0.0, -3.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    range_list = [1539.0, 22069.0, 65535.0, 561.0, 2655388.0, 233523.0, 26297.0, 5106.0,
                  24376.0, 9.0, 181.0, 1807.0, 6879.0]

    def make_minmaxscaler(mn, rg):
        def minmaxscaler(col):
            return (col - mn) / rg
        return minmaxscaler

    wide_columns, deep_columns = [], []
    for name in dr.CONTINUOUS_COLUMNS + dr.CATEGORICAL_COLUMNS:
        if name in dr.CATEGORICAL_COLUMNS:
            cat = t.feature_column.categorical_column_with_hash_bucket(name, hash_bucket_size=dr.BUCKETS[name],
                                                                      dtype=t.string)
            wide_columns.append(cat)
            deep_columns.append(t.feature_column.embedding_column(cat, dimension=dr.WDL_EMB[name], combiner="mean"))
        else:
            i = dr.CONTINUOUS_COLUMNS.index(name)
            col = t.feature_column.numeric_column(name, normalizer_fn=make_minmaxscaler(mins_list[i], range_list[i]),
                                                  shape=(1,))
            wide_columns.append(col)
            deep_columns.append(col)
    ilp, dlp = dr.input_partitioner(t), dr.dense_partitioner(t)

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
    return feats, {"probability": t.math.sigmoid(logits)}, wdl_sample


def wdl_sample(batch, seq_len=None, rng=None):
    rng = rng if rng is not None else np.random.default_rng(0)
    d = {c: rng.exponential(1.0, size=batch).astype(np.float32) for c in dr.CONTINUOUS_COLUMNS}
    d.update({c: _draw(rng, CRITEO_WORDS[: 3 * dr.BUCKETS[c]], batch) for c in dr.CATEGORICAL_COLUMNS})
    return d


def wdl():
    return _build(_wdl_graph)


# ============================================================================ DIN: vocabulary files + split
def _words(prefix, n):
    return [f"{prefix}{i:05d}" for i in range(n)]


UIDS, MIDS, CATS = _words("A", N_UID), _words("B", N_MID), _words("Cat_", N_CAT - 3) + ["Books", "Électronique", "家居"]
VOCAB_DIR = tempfile.mkdtemp(prefix="deeprec_din_voc_")


def _vocab_file(name, words):
    path = os.path.join(VOCAB_DIR, name)
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(words) + "\n")
    return path


def _din_graph(t):
    """modelzoo/din/train.py: build_feature_columns (vocabulary files) + DIN._embedding_input_layer (split,
    sparse.slice) + DIN._create_model (make_deeprec.build_din's graph code)."""
    uid_file, mid_file, cat_file = (_vocab_file(n, w) for n, w in
                                    (("uid_voc.txt", UIDS), ("mid_voc.txt", MIDS), ("cat_voc.txt", CATS)))
    fc = t.feature_column
    feats = {"UID": t.placeholder(t.string, [None], name="UID"),
             "ITEM": t.placeholder(t.string, [None], name="ITEM"),
             "CATEGORY": t.placeholder(t.string, [None], name="CATEGORY"),
             "HISTORY_ITEM": t.placeholder(t.string, [None], name="HISTORY_ITEM"),
             "HISTORY_CATEGORY": t.placeholder(t.string, [None], name="HISTORY_CATEGORY")}
    uid_cate_column = fc.categorical_column_with_vocabulary_file("UID", uid_file, default_value=0)
    fcs = {"uid_emb_column": fc.embedding_column(uid_cate_column, dimension=8),
           "item_cate_column": fc.categorical_column_with_vocabulary_file("ITEM", mid_file, default_value=0),
           "category_cate_column": fc.categorical_column_with_vocabulary_file("CATEGORY", cat_file, default_value=0),
           "his_item_cate_column": fc.sequence_categorical_column_with_vocabulary_file(
               "HISTORY_ITEM", mid_file, default_value=0),
           "his_category_cate_column": fc.sequence_categorical_column_with_vocabulary_file(
               "HISTORY_CATEGORY", cat_file, default_value=0)}
    features = dict(feats)
    batch_size = t.shape(feats["UID"])[0]
    for key in ("HISTORY_ITEM", "HISTORY_CATEGORY"):    # DIN._embedding_input_layer's first lines
        features[key] = t.strings.split(features[key], SEP)
        features[key] = t.sparse.slice(features[key], [0, 0], [batch_size, MAX_SEQ_LENGTH])
    m = dr._SeqModelParts(t, features, fcs, embedding_dim=8, hidden_size=16, attention_size=16)
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
    return feats, {"probability": t.math.sigmoid(logits)}, din_sample


def din_sample(batch, seq_len=None, rng=None):
    rng = rng if rng is not None else np.random.default_rng(0)
    width = seq_len or 20
    lengths = rng.integers(1, width + 1, size=batch)
    lengths[0] = width
    hist_item, hist_cate = [], []
    for n in lengths:
        hist_item.append(SEP.join(_draw(rng, MIDS, (int(n),), missing=0.0)))
        hist_cate.append(SEP.join(_draw(rng, CATS, (int(n),), missing=0.0)))
    if batch >= 2:   # a history longer than MAX_SEQ_LENGTH (sliced), and one with an empty token ("a\x02\x02b")
        hist_item[1] = SEP.join(_draw(rng, MIDS, (MAX_SEQ_LENGTH + 7,), missing=0.0))
        hist_cate[1] = SEP.join(_draw(rng, CATS, (MAX_SEQ_LENGTH + 7,), missing=0.0))
    if batch >= 3:
        hist_item[2] = SEP.join([MIDS[1], "", MIDS[2]])
        hist_cate[2] = SEP.join([CATS[1], "", CATS[2]])
    return {"UID": _draw(rng, UIDS, batch), "ITEM": _draw(rng, MIDS, batch), "CATEGORY": _draw(rng, CATS, batch),
            "HISTORY_ITEM": np.array(hist_item, dtype=str), "HISTORY_CATEGORY": np.array(hist_cate, dtype=str)}


def din():
    return _build(_din_graph)


# ============================================================================ export / check / write
BUILDERS = {"WDL": wdl, "DIN": din}


def export(name):
    import onnx

    from ctropt.exporters import check_export
    from ctropt.exporters.zoo import export_spec
    from ctropt.graph import save

    spec = BUILDERS[name]()
    result = export_spec(spec)
    checks = check_export(result, lambda b, t, rng: spec.sample(b, t, rng))
    for c in checks:
        print(f"[deeprec/{name} strings] batch {c.batch}: max abs err {c.max_abs_err:.2e}, "
              f"{c.ids} ids from strings {'equal' if c.ok else 'DIFFER'} {c.detail}", flush=True)
    if not all(c.ok for c in checks):
        raise SystemExit(f"{name}: the export does not reproduce TensorFlow; nothing written")
    stem = os.path.join(HERE, f"deeprec_{name}_strings_tf2onnx")
    result.model.ir_version = min(result.model.ir_version, 10)
    save(result.model, stem + ".onnx")
    onnx.checker.check_model(onnx.load(stem + ".onnx"))
    feeds = spec.sample(B, None, np.random.default_rng(42))
    np.savez(stem + ".npz", **feeds)
    np.savez(stem + ".ref.npz", **result.run_framework(feeds))
    print(f"[deeprec/{name} strings] wrote {stem}.onnx ({os.path.getsize(stem + '.onnx')} bytes), .npz, .ref.npz")


def main(argv):
    if argv and argv[0] == "--child":
        export(argv[1])
        return
    names = argv or list(BUILDERS)
    for n in names:
        if n not in BUILDERS:
            raise SystemExit(f"unknown model {n}; choose from {list(BUILDERS)}")
    for n in names:   # one model per subprocess (disable_v2_behavior and the patches are process-wide)
        subprocess.run([sys.executable, os.path.abspath(__file__), "--child", n], check=True)


if __name__ == "__main__":
    main(sys.argv[1:])
