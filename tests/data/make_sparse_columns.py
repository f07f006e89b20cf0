#!/usr/bin/env python
"""Export tf_sparse_columns.onnx: TensorFlow feature-column lookups through tf2onnx, for the
rewrite-sparse-columns tests, with TensorFlow's own outputs beside it.

Inputs (int64, -1 = no id): `one` [B] (identity column, embedding_column dim 3); `bag_sum` [B, 4], `bag_mean`
[B, L], `bag_sqrtn` [B, L] (embedding_column dim 4 with that combiner); `hist` [B, T] (sequence identity
column, embedding dim 2). Outputs: `pooled` (input_layer of the four columns, [B, 15]), `seq` ([B, T, 2]) and
`seq_len` ([B]). Tables are seeded-random and small (11 rows).

Writes tf_sparse_columns.onnx (opset 17), .npz (a batch of 6: an empty row, repeats, both table ends) and
.ref.npz (TensorFlow's outputs for it). Run with ctropt's venv: `python tests/data/make_sparse_columns.py`.
As in thirdparty/make_deeprec.py: Assert nodes are dropped (tf2onnx has no handler) and tf2onnx 1.17's
integer SegmentMax is patched in-process (the sequence length).
"""

import os
import pathlib
import sys

import numpy as np

HERE = pathlib.Path(__file__).parent
sys.path.insert(0, str(HERE / "thirdparty"))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from make_deeprec import patch_tf2onnx_int_segment_max, strip_asserts  # noqa: E402

ROWS = 11


def feeds(batch: int = 6, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    out = {"one": np.where(rng.random(batch) < 0.3, -1, rng.integers(0, ROWS, batch))}
    for name, length in (("bag_sum", 4), ("bag_mean", 5), ("bag_sqrtn", 3), ("hist", 6)):
        ids = np.where(rng.random((batch, length)) < 0.4, -1, rng.integers(0, ROWS, (batch, length)))
        ids[0], ids[1] = -1, ROWS - 1  # an empty row; a full one, all the same id
        ids[2, 0] = 0
        out[name] = ids
    out["one"][:2] = [-1, ROWS - 1]
    return {k: v.astype(np.int64) for k, v in out.items()}


def build(t):
    from tensorflow.python.feature_column.feature_column import _LazyBuilder

    fc = t.feature_column
    feats = {"one": t.placeholder(t.int64, [None], name="one"),
             "bag_sum": t.placeholder(t.int64, [None, 4], name="bag_sum"),
             "bag_mean": t.placeholder(t.int64, [None, None], name="bag_mean"),
             "bag_sqrtn": t.placeholder(t.int64, [None, None], name="bag_sqrtn"),
             "hist": t.placeholder(t.int64, [None, None], name="hist")}
    columns = [fc.embedding_column(fc.categorical_column_with_identity("one", ROWS), 3)]
    columns += [fc.embedding_column(fc.categorical_column_with_identity(f"bag_{c}", ROWS), 4, combiner=c)
                for c in ("sum", "mean", "sqrtn")]
    pooled = t.identity(fc.input_layer(feats, columns), name="pooled")
    hist = fc.embedding_column(fc.sequence_categorical_column_with_identity("hist", ROWS), 2)
    with t.variable_scope("hist"):
        seq, seq_len = hist._get_sequence_dense_tensor(_LazyBuilder(feats))
    return feats, {"pooled": pooled, "seq": t.identity(seq, name="seq"),
                   "seq_len": t.identity(seq_len, name="seq_len")}


def main():
    import onnx
    import tensorflow as tf
    import tf2onnx

    t = tf.compat.v1
    t.disable_v2_behavior()
    patch_tf2onnx_int_segment_max()
    graph = t.Graph()
    with graph.as_default():
        t.set_random_seed(7)
        feats, outputs = build(t)
        with t.Session(graph=graph) as sess:
            sess.run(t.global_variables_initializer())
            data = feeds()
            ref = dict(zip(outputs, sess.run(list(outputs.values()), {feats[k]: v for k, v in data.items()})))
            frozen = t.graph_util.convert_variables_to_constants(sess, graph.as_graph_def(),
                                                               [v.op.name for v in outputs.values()])
    frozen, _ = strip_asserts(frozen)
    model, _ = tf2onnx.convert.from_graph_def(frozen, input_names=[f"{k}:0" for k in feats],
                                              output_names=[f"{k}:0" for k in outputs], opset=17)
    model.ir_version = min(model.ir_version, 10)
    onnx.save(model, HERE / "tf_sparse_columns.onnx")
    np.savez(HERE / "tf_sparse_columns.npz", **{f"{k}:0": v for k, v in data.items()})
    np.savez(HERE / "tf_sparse_columns.ref.npz", **{f"{k}:0": v for k, v in ref.items()})
    print(len(model.graph.node), "nodes")


if __name__ == "__main__":
    main()
