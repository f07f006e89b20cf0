"""TensorFlow reference CTR models, TF1 graph style (as DeepRec's modelzoo and the DIEN paper's code).

Every builder constructs its model in a fresh ``tf.Graph`` with ``tf.compat.v1`` ops only (no Keras:
dense layers are matmul + bias written out, as ``tf.layers.dense`` lowered them), initialises the
variables with seeded random initializers, freezes them into constants
(``tf.compat.v1.graph_util.convert_variables_to_constants``) and returns a :class:`TFModel`.

- ``wdl``: Wide&Deep on the Criteo layout (DeepRec modelzoo/wide_and_deep): 26 categorical id inputs
  ``C1..C26`` and 13 dense inputs ``I1..I13``; **partitioned** embedding tables (2-4 shards each, looked
  up through ``embedding_lookup`` on the PartitionedVariable: DynamicPartition / Gather per shard /
  DynamicStitch); wide = per-feature weights + dense linear, deep = MLP 1024-512-256 → ``prob``.
- ``deepfm``: DeepFM (DeepRec modelzoo/deepfm): first- and second-order FM over 26 field embeddings and a
  deep MLP; a multi-hot ``tags`` feature goes through an **IndicatorColumn** exactly as TF builds it
  (SparseTensor → sparse_tensor_to_dense → one_hot → reduce_sum) → ``prob``.
- ``dlrm``: DLRM (DeepRec modelzoo/dlrm): dense [B, 13] → bottom MLP, 8 multi-hot bags (ids [B, L] padded
  with -1) pooled by ``embedding_lookup_sparse`` (sum), ``safe_embedding_lookup_sparse`` (sum / mean) and
  gather + ``unsorted_segment_sum`` (sum / mean), pairwise dot interaction, top MLP → ``prob``.
- ``din``: DIN as in the DIEN repository's ``Model_DIN`` (mouna99/dien ``din_attention``): padded history
  [B, T] with a float mask, attention MLP 80-40-1 over concat[q, k, q-k, q*k] ([B, T, 4C]), masked
  softmax, weighted sum, BN + MLP 200-80 with Dice (inference-time moving statistics) → sigmoid ``prob``.
- ``dien``: DIEN as mouna99/dien ``Model_DIN_V2_Gru_Vec_attGru``: GRU interest extraction with
  ``dynamic_rnn(GRUCell(36))``, ``din_fcn_attention`` scores, AUGRU interest evolution with
  ``dynamic_rnn(VecAttGRUCell(36))`` (the attention score rides along as an extra input feature, which is
  what the original's patched rnn.py passes per step), BN + MLP 200-80 with Dice → softmax over 2 classes
  ``y_hat`` (column 0 = click, as the original's targets). Built with TF1 control flow (as the original
  graph): tf2onnx turns each dynamic_rnn into a Scan whose body holds the cell.
- ``mmoe``: MMoE (DeepRec modelzoo/mmoe): shared embeddings + dense, 4 expert MLPs, per-task softmax gates,
  two towers → ``ctr`` and ``cvr``.

``sample(batch, seq_len, rng)`` gives valid feeds: ids inside their tables, multi-hot/bag padding -1,
history lengths in [0, T] with an empty and a full history when batch >= 2, masks and padded ids (0)
consistent with the lengths.

Where tf2onnx 1.17 exports the TF code wrongly, the models avoid it (and say so where it happens):
``one_hot`` of the -1 that IndicatorColumn pads with (ONNX OneHot wraps negative indices),
``embedding_lookup_sparse`` with the mean / sqrtn combiners (NaN for empty rows), segment sums over a bag
with no id in the whole batch (onnxruntime error), and TF2's While/TensorList form of dynamic_rnn (left
TensorListReserve / TensorListSetItem unconverted: an invalid model).
"""

from __future__ import annotations

import numpy as np

from .spec import Input, TFModel

CRITEO_CAT = 26
CRITEO_DENSE = 13
HIST_LEN = 100  # default history length of din / dien


def _tf():
    import tensorflow as tf

    return tf


# --------------------------------------------------------------------------------------------- helpers


def _vocab_sizes(n: int, seed: int, low: int = 200, high: int = 2000) -> list[int]:
    """Per-feature vocabulary sizes, varied but fixed by the seed."""
    rng = np.random.default_rng(1000 + seed)
    return [int(v) for v in rng.integers(low, high, size=n)]


def _dense(x, units: int, name: str, activation=None, stddev: float | None = None):
    """A fully connected layer as tf.layers.dense lowered it: MatMul (Tensordot for rank 3) + BiasAdd."""
    tf = _tf()
    fan_in = int(x.shape[-1])
    std = stddev if stddev is not None else float(np.sqrt(2.0 / (fan_in + units)))
    with tf.compat.v1.variable_scope(name):
        kernel = tf.compat.v1.get_variable(
            "kernel", [fan_in, units], initializer=tf.compat.v1.truncated_normal_initializer(stddev=std))
        bias = tf.compat.v1.get_variable(
            "bias", [units], initializer=tf.compat.v1.random_normal_initializer(stddev=0.05))
        if x.shape.rank == 2:
            y = tf.nn.bias_add(tf.matmul(x, kernel), bias)
        else:
            y = tf.tensordot(x, kernel, axes=1) + bias
        return activation(y) if activation is not None else y


def _mlp(x, units, name: str, activation=None, stddev_scale: float = 1.0):
    tf = _tf()
    activation = activation or tf.nn.relu
    for i, n in enumerate(units):
        fan_in = int(x.shape[-1])
        x = _dense(x, n, f"{name}/layer{i}", activation, stddev=stddev_scale * float(np.sqrt(2.0 / fan_in)))
    return x


def _embedding(name: str, vocab: int, dim: int, stddev: float = 0.1, shards: int | None = None):
    tf = _tf()
    partitioner = tf.compat.v1.fixed_size_partitioner(shards) if shards else None
    return tf.compat.v1.get_variable(
        name, [vocab, dim], initializer=tf.compat.v1.random_normal_initializer(stddev=stddev),
        partitioner=partitioner)


def _batch_norm(x, name: str, epsilon: float = 1e-3):
    """tf.layers.batch_normalization at inference: moving statistics, gamma and beta (non-fused, 2-D)."""
    tf = _tf()
    n = int(x.shape[-1])
    with tf.compat.v1.variable_scope(name):
        gamma = tf.compat.v1.get_variable("gamma", [n], initializer=tf.compat.v1.random_uniform_initializer(0.8, 1.2))
        beta = tf.compat.v1.get_variable("beta", [n], initializer=tf.compat.v1.random_normal_initializer(stddev=0.05))
        mean = tf.compat.v1.get_variable("moving_mean", [n],
                                         initializer=tf.compat.v1.random_normal_initializer(stddev=0.05))
        var = tf.compat.v1.get_variable("moving_variance", [n],
                                        initializer=tf.compat.v1.random_uniform_initializer(0.5, 1.5))
        return tf.compat.v1.nn.batch_normalization(x, mean, var, beta, gamma, epsilon)


def _dice(x, name: str, epsilon: float = 1e-9):
    """Dice of DIN: p = sigmoid(BN(x)) (moving mean/variance, no affine), out = p*x + (1-p)*alpha*x."""
    tf = _tf()
    n = int(x.shape[-1])
    with tf.compat.v1.variable_scope(name):
        alpha = tf.compat.v1.get_variable("alpha", [n], initializer=tf.compat.v1.random_uniform_initializer(-0.5, 0.5))
        mean = tf.compat.v1.get_variable("moving_mean", [n],
                                         initializer=tf.compat.v1.random_normal_initializer(stddev=0.1))
        var = tf.compat.v1.get_variable("moving_variance", [n],
                                        initializer=tf.compat.v1.random_uniform_initializer(0.5, 2.0))
        x_normed = tf.compat.v1.nn.batch_normalization(x, mean, var, None, None, epsilon)
        x_p = tf.sigmoid(x_normed)
        return alpha * (1.0 - x_p) * x + x_p * x


def _prelu(x, name: str):
    """PReLU of the DIEN code (utils.prelu): max(0, x) + alpha * min(0, x)."""
    tf = _tf()
    with tf.compat.v1.variable_scope(name):
        alpha = tf.compat.v1.get_variable("prelu", [int(x.shape[-1])],
                                          initializer=tf.compat.v1.constant_initializer(0.1))
        return tf.maximum(0.0, x) + alpha * tf.minimum(0.0, x)


def _dense_to_sparse(ids, missing: int = -1):
    """A dense [B, K] id matrix with `missing` markers → SparseTensor, as feature columns receive it."""
    tf = _tf()
    indices = tf.where(tf.not_equal(ids, missing))
    values = tf.gather_nd(ids, indices)
    return tf.SparseTensor(indices, values, tf.shape(ids, out_type=tf.int64))


def _freeze(graph, sess, outputs: list[str]):
    tf = _tf()
    return tf.compat.v1.graph_util.convert_variables_to_constants(sess, graph.as_graph_def(), outputs)


def _build(body, seed: int, control_flow_v1: bool = False):
    """Run `body()` in a fresh seeded graph; initialise, freeze; body returns (inputs, outputs). Lookup tables'
    initializers stay in the frozen graph as the op 'init_all_tables' (as a SavedModel's main_op keeps them).

    control_flow_v1: build loops as TF 1.x did (Enter/Merge/Switch/NextIteration/Exit + TensorArrayV3,
    what the original DIEN graph holds) instead of TF2's While + TensorList, by switching
    control_flow_util.ENABLE_CONTROL_FLOW_V2 off while the graph is built (and back afterwards).
    """
    tf = _tf()
    from tensorflow.python.ops import control_flow_util

    saved = control_flow_util.ENABLE_CONTROL_FLOW_V2
    graph = tf.Graph()
    try:
        if control_flow_v1:
            control_flow_util.ENABLE_CONTROL_FLOW_V2 = False
        with graph.as_default():
            tf.compat.v1.set_random_seed(seed)
            inputs, outputs = body()
            keep = list(outputs)
            if tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.TABLE_INITIALIZERS):  # frozen with the tables
                keep.append(tf.compat.v1.tables_initializer(name="init_all_tables").name)
            with tf.compat.v1.Session(graph=graph) as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                frozen = _freeze(graph, sess, keep)
    finally:
        control_flow_util.ENABLE_CONTROL_FLOW_V2 = saved
    return frozen, inputs


def _placeholder(name: str, dtype, shape) -> tuple:
    tf = _tf()
    return tf.compat.v1.placeholder(tf.as_dtype(dtype), shape, name=name), Input(name, np.dtype(dtype), tuple(shape))


def _criteo_dense(rng, batch):
    """Criteo integer features after the usual log(1 + x) transform."""
    return np.log1p(rng.exponential(5.0, size=batch)).astype(np.float32)


def _lengths(batch: int, seq_len: int, rng, low: int = 0) -> np.ndarray:
    lengths = rng.integers(low, seq_len + 1, size=batch)
    if batch >= 2:
        lengths[0], lengths[1] = low, seq_len
    return lengths


def _multi_hot(batch: int, width: int, vocab: int, rng, nonempty_batch: bool = False) -> np.ndarray:
    """[B, width] int64 ids in [0, vocab), -1 after each row's count (count in [0, width], with an empty and
    a full row when batch >= 2). nonempty_batch: a batch of one row gets at least one id."""
    counts = _lengths(batch, width, rng)
    if nonempty_batch and batch == 1:
        counts = np.maximum(counts, 1)
    valid = np.arange(width)[None, :] < counts[:, None]
    return np.where(valid, rng.integers(0, vocab, size=(batch, width)), -1).astype(np.int64)


# --------------------------------------------------------------------------------------------- wdl


def wdl(seed: int = 0, emb_dim: int = 16, hidden=(1024, 512, 256)) -> TFModel:
    """Wide&Deep on Criteo, as DeepRec's modelzoo/wide_and_deep (feature columns written out by hand).

    Embedding tables (deep, dim 16) and wide weights (dim 1) are partitioned variables
    (fixed_size_partitioner, 2-4 shards); deep tables are looked up with partition_strategy='div', wide
    weights with 'mod' (the two layouts tf.nn.embedding_lookup supports).
    """
    tf = _tf()
    vocabs = _vocab_sizes(CRITEO_CAT, seed, 200, 1500)
    shards = [2 + (i % 3) for i in range(CRITEO_CAT)]

    def body():
        cats = [_placeholder(f"C{i + 1}", np.int64, (None,)) for i in range(CRITEO_CAT)]
        dense = [_placeholder(f"I{i + 1}", np.float32, (None,)) for i in range(CRITEO_DENSE)]
        dense_x = tf.stack([p for p, _ in dense], axis=1, name="dense_features")  # [B, 13]

        with tf.compat.v1.variable_scope("linear"):
            wide_terms = []
            for i, (ids, _) in enumerate(cats):
                w = _embedding(f"C{i + 1}_weights", vocabs[i], 1, stddev=0.3, shards=shards[i])
                wide_terms.append(tf.compat.v1.nn.embedding_lookup(w, ids, partition_strategy="mod"))
            dense_w = tf.compat.v1.get_variable(
                "dense_weights", [CRITEO_DENSE, 1], initializer=tf.compat.v1.random_normal_initializer(stddev=0.1))
            bias = tf.compat.v1.get_variable("bias_weights", [1], initializer=tf.compat.v1.zeros_initializer())
            wide_logit = tf.nn.bias_add(tf.add_n(wide_terms) + tf.matmul(dense_x, dense_w), bias)

        with tf.compat.v1.variable_scope("dnn"):
            embs = []
            for i, (ids, _) in enumerate(cats):
                table = _embedding(f"C{i + 1}_embedding", vocabs[i], emb_dim, stddev=0.3, shards=shards[i])
                embs.append(tf.compat.v1.nn.embedding_lookup(table, ids, partition_strategy="div"))
            net = tf.concat(embs + [dense_x], axis=1, name="input_layer")
            net = _mlp(net, hidden, "hiddenlayer")
            deep_logit = _dense(net, 1, "logits")

        tf.sigmoid(wide_logit + deep_logit, name="prob")
        return [i for _, i in cats] + [i for _, i in dense], ["prob"]

    graph_def, inputs = _build(body, seed)

    def sample(batch: int, seq_len=None, rng=None) -> dict:
        rng = rng if rng is not None else np.random.default_rng(0)
        feeds = {f"C{i + 1}": rng.integers(0, v, size=batch).astype(np.int64) for i, v in enumerate(vocabs)}
        feeds.update({f"I{i + 1}": _criteo_dense(rng, batch) for i in range(CRITEO_DENSE)})
        return feeds

    return TFModel(graph_def, inputs, ["prob"], sample)


# --------------------------------------------------------------------------------------------- deepfm


def deepfm(seed: int = 0, emb_dim: int = 16, hidden=(1024, 256, 32), tag_vocab: int = 100,
           tag_width: int = 5, indicator_default: int | None = None) -> TFModel:
    """DeepFM on Criteo, as DeepRec's modelzoo/deepfm, plus a multi-hot ``tags`` IndicatorColumn.

    FM: first order (per-feature weights + dense linear) and second order 0.5*((sum v)^2 - sum v^2) over the
    26 field embeddings; deep: MLP over [embeddings, dense, multi-hot tags]. The indicator column is built
    as feature_column's IndicatorColumn: ids [B, K] (-1 = missing) → SparseTensor →
    sparse_tensor_to_dense → one_hot(depth) → reduce_sum over K → [B, depth].

    The dense default of the missing slots is ``depth`` (``indicator_default=None``), not the -1
    IndicatorColumn uses: TF's one_hot gives a zero row for both, but tf2onnx maps one_hot to ONNX OneHot,
    which counts negative indices from the end, so -1 exports as a one at depth-1 (pass
    ``indicator_default=-1`` to reproduce the exact TF code and that mismatch).
    """
    default = tag_vocab if indicator_default is None else indicator_default
    tf = _tf()
    vocabs = _vocab_sizes(CRITEO_CAT, seed + 1, 100, 1500)

    def body():
        cats = [_placeholder(f"C{i + 1}", np.int64, (None,)) for i in range(CRITEO_CAT)]
        dense = [_placeholder(f"I{i + 1}", np.float32, (None,)) for i in range(CRITEO_DENSE)]
        tags = _placeholder("tags", np.int64, (None, tag_width))
        dense_x = tf.stack([p for p, _ in dense], axis=1, name="dense_features")

        with tf.compat.v1.variable_scope("indicator_tags"):  # feature_column.indicator_column
            sp = _dense_to_sparse(tags[0])
            dense_ids = tf.compat.v1.sparse_tensor_to_dense(sp, default_value=default)
            one_hot = tf.one_hot(dense_ids, depth=tag_vocab, on_value=1.0, off_value=0.0)
            multi_hot = tf.reduce_sum(one_hot, axis=[-2])  # [B, tag_vocab]

        with tf.compat.v1.variable_scope("fm"):
            first = []
            vs = []
            for i, (ids, _) in enumerate(cats):
                w = _embedding(f"C{i + 1}_linear", vocabs[i], 1, stddev=0.1)
                first.append(tf.compat.v1.nn.embedding_lookup(w, ids))
                v = _embedding(f"C{i + 1}_embedding", vocabs[i], emb_dim, stddev=0.08)
                vs.append(tf.compat.v1.nn.embedding_lookup(v, ids))
            dense_w = tf.compat.v1.get_variable(
                "dense_linear", [CRITEO_DENSE, 1], initializer=tf.compat.v1.random_normal_initializer(stddev=0.1))
            first_order = tf.add_n(first) + tf.matmul(dense_x, dense_w)  # [B, 1]
            fields = tf.stack(vs, axis=1)  # [B, F, E]
            sum_sq = tf.square(tf.reduce_sum(fields, axis=1))
            sq_sum = tf.reduce_sum(tf.square(fields), axis=1)
            second_order = 0.5 * tf.reduce_sum(sum_sq - sq_sum, axis=1, keepdims=True)  # [B, 1]

        with tf.compat.v1.variable_scope("dnn"):
            net = tf.concat([tf.reshape(fields, [-1, CRITEO_CAT * emb_dim]), dense_x, multi_hot], axis=1)
            net = _mlp(net, hidden, "hiddenlayer")
            deep_logit = _dense(net, 1, "logits")

        tf.sigmoid(first_order + second_order + deep_logit, name="prob")
        return [i for _, i in cats] + [i for _, i in dense] + [tags[1]], ["prob"]

    graph_def, inputs = _build(body, seed)

    def sample(batch: int, seq_len=None, rng=None) -> dict:
        rng = rng if rng is not None else np.random.default_rng(0)
        feeds = {f"C{i + 1}": rng.integers(0, v, size=batch).astype(np.int64) for i, v in enumerate(vocabs)}
        feeds.update({f"I{i + 1}": _criteo_dense(rng, batch) for i in range(CRITEO_DENSE)})
        feeds["tags"] = _multi_hot(batch, tag_width, tag_vocab, rng)
        return feeds

    return TFModel(graph_def, inputs, ["prob"], sample)


# --------------------------------------------------------------------------------------------- dlrm


def dlrm(seed: int = 0, emb_dim: int = 16, bottom=(512, 256, 64), top=(512, 256)) -> TFModel:
    """DLRM as DeepRec's modelzoo/dlrm, with multi-hot embedding bags.

    dense [B, 13] → bottom MLP 512-256-64-16; 8 bags ``bag1..bag8`` of ids [B, L_i] padded with -1, pooled
    per sample: bags 1-3 by ``embedding_lookup_sparse`` (sum: SparseSegmentSum, padded to the batch as
    its output stops at the last non-empty row), bags 4-5 by ``safe_embedding_lookup_sparse``
    (EmbeddingColumn's path, empty rows → 0; sum / mean), bags 6-8 by gather + ``unsorted_segment_sum``
    (sum, mean via per-row counts, sum); dot interaction of the 9 vectors (strictly lower triangle of
    Z = X Xᵀ, 36 values) concatenated with the bottom output → top MLP 512-256 → 1 → sigmoid ``prob``.

    Not used because tf2onnx exports them wrongly: embedding_lookup_sparse's mean / sqrtn combiners (NaN
    for an empty row in ONNX, 0 in TF); and every segment-sum lowering fails in onnxruntime when a bag has
    no id in the whole batch, so ``sample`` never makes such a batch.
    """
    tf = _tf()
    n_bags = 8
    vocabs = _vocab_sizes(n_bags, seed + 2, 300, 3000)
    widths = [3, 5, 8, 4, 10, 6, 2, 7]

    def body():
        dense = _placeholder("dense", np.float32, (None, CRITEO_DENSE))
        bags = [_placeholder(f"bag{i + 1}", np.int64, (None, widths[i])) for i in range(n_bags)]
        x = dense[0]
        with tf.compat.v1.variable_scope("bottom_mlp"):
            x = _mlp(x, bottom, "mlp")
            x = _dense(x, emb_dim, "out", tf.nn.relu, stddev=float(np.sqrt(2.0 / bottom[-1])))
        batch = tf.shape(dense[0])[0]
        pooled = []
        with tf.compat.v1.variable_scope("embeddings"):
            for i, (ids, _) in enumerate(bags):
                table = _embedding(f"bag{i + 1}_embedding", vocabs[i], emb_dim, stddev=0.3)
                if i < 5:
                    sp = _dense_to_sparse(ids)
                    if i < 3:
                        # sum only: tf2onnx lowers SparseSegmentMean/SqrtN dividing by the id count, so
                        # an empty row gives NaN in ONNX where TF gives 0 (see the module docstring)
                        combiner = "sum"
                        # rows with no ids come out of SparseSegment* only up to the last non-empty row:
                        # pad to the batch (what feature columns' safe lookup does with fill_empty_rows)
                        e = tf.compat.v1.nn.embedding_lookup_sparse(table, sp, None, combiner=combiner)
                        e = tf.pad(e, [[0, batch - tf.shape(e)[0]], [0, 0]])
                    else:
                        e = tf.compat.v1.nn.safe_embedding_lookup_sparse(
                            table, sp, None, combiner=("sum", "mean")[i - 3])
                else:
                    where = tf.where(ids >= 0)  # [N, 2]: (row, position)
                    flat_ids = tf.gather_nd(ids, where)
                    rows = tf.cast(where[:, 0], tf.int32)
                    vecs = tf.gather(table, flat_ids)
                    e = tf.math.unsorted_segment_sum(vecs, rows, batch)
                    if i == 6:  # mean combiner
                        counts = tf.math.unsorted_segment_sum(tf.ones_like(flat_ids, tf.float32), rows, batch)
                        e = e / tf.maximum(counts, 1.0)[:, None]
                pooled.append(tf.reshape(e, [-1, emb_dim]))
        with tf.compat.v1.variable_scope("interaction"):
            t = tf.stack([x] + pooled, axis=1)  # [B, 9, E]
            z = tf.matmul(t, t, transpose_b=True)  # [B, 9, 9]
            n = n_bags + 1
            li = [r * n + c for r in range(n) for c in range(r)]
            flat = tf.reshape(z, [-1, n * n])
            zflat = tf.gather(flat, li, axis=1)  # [B, 36]
            r = tf.concat([x, zflat], axis=1)
        with tf.compat.v1.variable_scope("top_mlp"):
            r = _mlp(r, top, "mlp")
            logit = _dense(r, 1, "logits")
        tf.sigmoid(logit, name="prob")
        return [dense[1]] + [i for _, i in bags], ["prob"]

    graph_def, inputs = _build(body, seed)

    def sample(batch: int, seq_len=None, rng=None) -> dict:
        rng = rng if rng is not None else np.random.default_rng(0)
        feeds = {"dense": np.log1p(rng.exponential(5.0, size=(batch, CRITEO_DENSE))).astype(np.float32)}
        for i in range(n_bags):
            # rows may be empty, but not a whole bag: tf2onnx's segment-sum lowerings fail in onnxruntime
            # when a bag has no id in the entire batch (a negative ConstantOfShape / MatMul broadcast error)
            feeds[f"bag{i + 1}"] = _multi_hot(batch, widths[i], vocabs[i], rng, nonempty_batch=True)
        return feeds

    return TFModel(graph_def, inputs, ["prob"], sample)


# --------------------------------------------------------------------------------------------- din / dien


N_UID, N_MID, N_CAT = 1000, 5000, 200
DIEN_EMB = 18
DIEN_HIDDEN = 36


def _history_inputs(with_seq_len: bool):
    uid = _placeholder("uid_batch_ph", np.int32, (None,))
    mid = _placeholder("mid_batch_ph", np.int32, (None,))
    cat = _placeholder("cat_batch_ph", np.int32, (None,))
    mid_his = _placeholder("mid_his_batch_ph", np.int32, (None, None))
    cat_his = _placeholder("cat_his_batch_ph", np.int32, (None, None))
    mask = _placeholder("mask", np.float32, (None, None))
    ph = [uid, mid, cat, mid_his, cat_his, mask]
    if with_seq_len:
        ph.append(_placeholder("seq_len_ph", np.int32, (None,)))
    return ph


def _history_embeddings(ph):
    """The Embedding_layer of the DIEN code's Model: uid / mid / cat tables, item_eb and item_his_eb."""
    tf = _tf()
    uid, mid, cat, mid_his, cat_his = (p for p, _ in ph[:5])
    with tf.compat.v1.variable_scope("Embedding_layer"):
        uid_var = _embedding("uid_embedding_var", N_UID, DIEN_EMB, stddev=0.1)
        mid_var = _embedding("mid_embedding_var", N_MID, DIEN_EMB, stddev=0.1)
        cat_var = _embedding("cat_embedding_var", N_CAT, DIEN_EMB, stddev=0.1)
        uid_eb = tf.compat.v1.nn.embedding_lookup(uid_var, uid)
        item_eb = tf.concat([tf.compat.v1.nn.embedding_lookup(mid_var, mid),
                             tf.compat.v1.nn.embedding_lookup(cat_var, cat)], 1)
        item_his_eb = tf.concat([tf.compat.v1.nn.embedding_lookup(mid_var, mid_his),
                                 tf.compat.v1.nn.embedding_lookup(cat_var, cat_his)], 2)
        item_his_eb_sum = tf.reduce_sum(item_his_eb, 1)
    return uid_eb, item_eb, item_his_eb, item_his_eb_sum


def _fcn_net(inp, n_out: int, use_dice: bool = True, out_stddev: float = 0.1):
    """build_fcn_net of the DIEN code: BN → dense 200 → Dice → dense 80 → Dice → dense n_out."""
    tf = _tf()
    bn1 = _batch_norm(inp, "bn1")
    dnn1 = _dense(bn1, 200, "f1")
    dnn1 = _dice(dnn1, "dice_1") if use_dice else _prelu(dnn1, "prelu1")
    dnn2 = _dense(dnn1, 80, "f2")
    dnn2 = _dice(dnn2, "dice_2") if use_dice else _prelu(dnn2, "prelu2")
    return _dense(dnn2, n_out, "f3", stddev=out_stddev)


def _history_sample(with_seq_len: bool):
    def sample(batch: int, seq_len=None, rng=None) -> dict:
        rng = rng if rng is not None else np.random.default_rng(0)
        seq_len = HIST_LEN if seq_len is None else seq_len
        lengths = _lengths(batch, seq_len, rng)
        valid = np.arange(seq_len)[None, :] < lengths[:, None]
        feeds = {
            "uid_batch_ph": rng.integers(0, N_UID, size=batch).astype(np.int32),
            "mid_batch_ph": rng.integers(1, N_MID, size=batch).astype(np.int32),
            "cat_batch_ph": rng.integers(1, N_CAT, size=batch).astype(np.int32),
            "mid_his_batch_ph": np.where(valid, rng.integers(1, N_MID, size=(batch, seq_len)), 0).astype(np.int32),
            "cat_his_batch_ph": np.where(valid, rng.integers(1, N_CAT, size=(batch, seq_len)), 0).astype(np.int32),
            "mask": valid.astype(np.float32),
        }
        if with_seq_len:
            feeds["seq_len_ph"] = lengths.astype(np.int32)
        return feeds

    return sample


def din(seed: int = 0, seq_len: int = HIST_LEN) -> TFModel:
    """DIN as the DIEN repository's Model_DIN (mouna99/dien, script/model.py + utils.din_attention).

    Inputs as the original's placeholders (int32 ids, float mask [B, T], T dynamic). Attention: queries tiled
    to [B, T, 36], din_all = concat[q, k, q-k, q*k] ([B, T, 144]) → dense 80 sigmoid → 40 sigmoid → 1;
    scores where(mask, s, -2^32+1) → softmax → matmul with the history (mode SUM). Then
    concat[uid, item, sum of history, attention] → BN → 200 Dice → 80 Dice → 1 → sigmoid ``prob``
    (DeepRec's DIN head; the original has a 2-way softmax). ``seq_len`` only sets the sample default.
    """
    tf = _tf()

    def body():
        ph = _history_inputs(False)
        mask_in = ph[5][0]
        uid_eb, item_eb, item_his_eb, item_his_eb_sum = _history_embeddings(ph)
        with tf.compat.v1.variable_scope("Attention_layer"):
            facts = item_his_eb
            mask = tf.equal(mask_in, tf.ones_like(mask_in))
            queries = tf.tile(item_eb, [1, tf.shape(facts)[1]])
            queries = tf.reshape(queries, tf.shape(facts))
            din_all = tf.concat([queries, facts, queries - facts, queries * facts], axis=-1)
            d1 = _dense(din_all, 80, "f1_att", tf.nn.sigmoid)
            d2 = _dense(d1, 40, "f2_att", tf.nn.sigmoid)
            d3 = _dense(d2, 1, "f3_att", stddev=1.0)
            scores = tf.reshape(d3, [-1, 1, tf.shape(facts)[1]])
            key_masks = tf.expand_dims(mask, 1)  # [B, 1, T]
            paddings = tf.ones_like(scores) * (-2 ** 32 + 1)
            scores = tf.where(key_masks, scores, paddings)
            scores = tf.nn.softmax(scores)
            output = tf.matmul(scores, facts)  # [B, 1, 36]
            att_fea = tf.reduce_sum(output, 1)
        inp = tf.concat([uid_eb, item_eb, item_his_eb_sum, att_fea], -1)
        logit = _fcn_net(inp, 1, out_stddev=0.4)
        tf.sigmoid(logit, name="prob")
        return [i for _, i in ph], ["prob"]

    graph_def, inputs = _build(body, seed)
    sample = _history_sample(False)
    return TFModel(graph_def, inputs, ["prob"], lambda b, t=None, rng=None: sample(b, seq_len if t is None else t, rng),
                   has_sequence=True)


def _rnn_cells():
    """GRUCell (TF's math) and the DIEN code's VecAttGRUCell, as RNNCell subclasses.

    Keras 3 removed tf.compat.v1.nn.rnn_cell.GRUCell; these keep its math and variable layout
    (gates/kernel, gates/bias (init 1.0), candidate/kernel, candidate/bias). The variables are created in
    the constructor (outside dynamic_rnn's while loop) and ``__call__`` runs ``call`` directly, as the
    original VecAttGRUCell does.
    """
    tf = _tf()
    from tensorflow.python.ops.rnn_cell_impl import RNNCell

    class GRUCell(RNNCell):
        """tf.nn.rnn_cell.GRUCell: r, u = sigmoid([x, h] Wg + bg); c = tanh([x, r*h] Wc + bc);
        new_h = u*h + (1-u)*c."""

        def __init__(self, num_units: int, input_size: int, scope: str):
            super().__init__(name=scope)
            self._num_units = num_units
            n_in = input_size + num_units
            std = float(np.sqrt(1.0 / n_in))
            with tf.compat.v1.variable_scope(scope):
                with tf.compat.v1.variable_scope("gates"):
                    self._gate_kernel = tf.compat.v1.get_variable(
                        "kernel", [n_in, 2 * num_units], initializer=tf.compat.v1.random_normal_initializer(stddev=std))
                    self._gate_bias = tf.compat.v1.get_variable(
                        "bias", [2 * num_units], initializer=tf.compat.v1.constant_initializer(1.0))
                with tf.compat.v1.variable_scope("candidate"):
                    self._candidate_kernel = tf.compat.v1.get_variable(
                        "kernel", [n_in, num_units], initializer=tf.compat.v1.random_normal_initializer(stddev=std))
                    self._candidate_bias = tf.compat.v1.get_variable(
                        "bias", [num_units], initializer=tf.compat.v1.random_normal_initializer(stddev=0.1))

        @property
        def state_size(self):
            return self._num_units

        @property
        def output_size(self):
            return self._num_units

        def __call__(self, inputs, state, scope=None):
            return self.call(inputs, state)

        def _gates(self, inputs, state):
            gate_inputs = tf.nn.bias_add(tf.matmul(tf.concat([inputs, state], 1), self._gate_kernel),
                                         self._gate_bias)
            value = tf.sigmoid(gate_inputs)
            r, u = tf.split(value=value, num_or_size_splits=2, axis=1)
            r_state = r * state
            candidate = tf.nn.bias_add(tf.matmul(tf.concat([inputs, r_state], 1), self._candidate_kernel),
                                       self._candidate_bias)
            return u, tf.tanh(candidate)

        def call(self, inputs, state):
            u, c = self._gates(inputs, state)
            new_h = u * state + (1 - u) * c
            return new_h, new_h

    class VecAttGRUCell(GRUCell):
        """The DIEN code's VecAttGRUCell (AUGRU): u = (1 - a) * u; new_h = u*h + (1-u)*c.

        The attention score a is the last feature of ``inputs`` (dynamic_rnn passes one input tensor; the
        original's patched rnn.py passes att_scores[:, t] beside it: the same per-step values).
        """

        def call(self, inputs, state):
            x, att_score = inputs[:, :-1], inputs[:, -1:]
            u, c = self._gates(x, state)
            u = (1.0 - att_score) * u
            new_h = u * state + (1 - u) * c
            return new_h, new_h

    return GRUCell, VecAttGRUCell


def _din_fcn_attention(query, facts, mask_in, stag: str):
    """utils.din_fcn_attention of the DIEN code, mode LIST with return_alphas (softmax_stag=1)."""
    tf = _tf()
    mask = tf.equal(mask_in, tf.ones_like(mask_in))
    facts_size = int(facts.shape[-1])
    query = _dense(query, facts_size, "f1" + stag)
    query = _prelu(query, "prelu" + stag)
    queries = tf.tile(query, [1, tf.shape(facts)[1]])
    queries = tf.reshape(queries, tf.shape(facts))
    din_all = tf.concat([queries, facts, queries - facts, queries * facts], axis=-1)
    d1 = _dense(din_all, 80, "f1_att" + stag, tf.nn.sigmoid)
    d2 = _dense(d1, 40, "f2_att" + stag, tf.nn.sigmoid)
    d3 = _dense(d2, 1, "f3_att" + stag, stddev=1.0)
    scores = tf.reshape(d3, [-1, 1, tf.shape(facts)[1]])
    key_masks = tf.expand_dims(mask, 1)
    paddings = tf.ones_like(scores) * (-2 ** 32 + 1)
    scores = tf.where(key_masks, scores, paddings)
    scores = tf.nn.softmax(scores)
    scores = tf.reshape(scores, [-1, tf.shape(facts)[1]])
    output = facts * tf.expand_dims(scores, -1)
    output = tf.reshape(output, tf.shape(facts))
    return output, scores


def dien(seed: int = 0, seq_len: int = HIST_LEN) -> TFModel:
    """DIEN as mouna99/dien's Model_DIN_V2_Gru_Vec_attGru (no auxiliary loss at inference).

    Inputs as the original: uid/mid/cat [B], mid_his/cat_his [B, T], mask [B, T], seq_len [B] (int32 ids,
    T dynamic). Embedding 18 (item+category → 36) → dynamic_rnn(GRUCell(36), sequence_length=seq_len) →
    din_fcn_attention scores (masked softmax) → dynamic_rnn(VecAttGRUCell(36)) over the GRU outputs with
    the scores → concat[uid, item, final AUGRU state, history sum] → BN → 200 Dice → 80 Dice → 2 →
    softmax + 1e-8 ``y_hat`` [B, 2] (column 0 = click). ``seq_len`` only sets the sample default.
    """
    tf = _tf()
    from tensorflow.python.ops.rnn import dynamic_rnn

    GRUCell, VecAttGRUCell = _rnn_cells()

    def body():
        ph = _history_inputs(True)
        mask_in, seq_len_ph = ph[5][0], ph[6][0]
        uid_eb, item_eb, item_his_eb, item_his_eb_sum = _history_embeddings(ph)
        with tf.compat.v1.name_scope("rnn_1"):
            rnn_outputs, _ = dynamic_rnn(GRUCell(DIEN_HIDDEN, 2 * DIEN_EMB, "gru1"), inputs=item_his_eb,
                                         sequence_length=seq_len_ph, dtype=tf.float32, scope="gru1")
        with tf.compat.v1.variable_scope("Attention_layer_1"):
            _, alphas = _din_fcn_attention(item_eb, rnn_outputs, mask_in, stag="1_1")
        with tf.compat.v1.name_scope("rnn_2"):
            att_inputs = tf.concat([rnn_outputs, tf.expand_dims(alphas, -1)], axis=-1)  # [B, T, 36 + 1]
            _, final_state2 = dynamic_rnn(VecAttGRUCell(DIEN_HIDDEN, DIEN_HIDDEN, "gru2"), inputs=att_inputs,
                                          sequence_length=seq_len_ph, dtype=tf.float32, scope="gru2")
        inp = tf.concat([uid_eb, item_eb, final_state2, item_his_eb_sum], 1)
        logits = _fcn_net(inp, 2)
        tf.add(tf.nn.softmax(logits), 0.00000001, name="y_hat")
        return [i for _, i in ph], ["y_hat"]

    graph_def, inputs = _build(body, seed, control_flow_v1=True)
    sample = _history_sample(True)
    return TFModel(graph_def, inputs, ["y_hat"], lambda b, t=None, rng=None: sample(b, seq_len if t is None else t, rng),
                   has_sequence=True)


# --------------------------------------------------------------------------------------------- mmoe


def mmoe(seed: int = 0, emb_dim: int = 16, n_experts: int = 4, expert_units=(256, 128),
         tower_units=(64, 32)) -> TFModel:
    """MMoE as DeepRec's modelzoo/mmoe (Taobao/Ali-CCP-style features, ctr and cvr tasks).

    8 categorical ids (user, item, category, shop, brand, ...) → embeddings (16), 4 dense features; shared
    input → 4 expert MLPs 256-128 (relu); per task a softmax gate over the experts (dense on the input),
    the gate-weighted sum of the expert outputs → tower 64-32 → sigmoid: outputs ``ctr`` and ``cvr``.
    """
    tf = _tf()
    names = ["user_id", "item_id", "cate_id", "shop_id", "brand_id", "age_level", "gender", "city_level"]
    vocabs = [2000, 4000, 300, 800, 600, 10, 3, 6]

    def body():
        cats = [_placeholder(n, np.int64, (None,)) for n in names]
        dense = _placeholder("dense", np.float32, (None, 4))
        with tf.compat.v1.variable_scope("input_layer"):
            embs = [tf.compat.v1.nn.embedding_lookup(_embedding(f"{n}_embedding", v, emb_dim, stddev=0.3), ids)
                    for n, v, (ids, _) in zip(names, vocabs, cats)]
            net = tf.concat(embs + [dense[0]], axis=1)
        with tf.compat.v1.variable_scope("experts"):
            experts = tf.stack([_mlp(net, expert_units, f"expert_{k}") for k in range(n_experts)], axis=1)
        outs = []
        for task in ("ctr", "cvr"):
            with tf.compat.v1.variable_scope(f"{task}_tower"):
                gate = tf.nn.softmax(_dense(net, n_experts, "gate", stddev=0.3))  # [B, E]
                mixed = tf.reduce_sum(experts * tf.expand_dims(gate, -1), axis=1)  # [B, 128]
                x = _mlp(mixed, tower_units, "tower")
                logit = _dense(x, 1, "logits", stddev=0.5)
            outs.append(tf.sigmoid(logit, name=task))
        return [i for _, i in cats] + [dense[1]], ["ctr", "cvr"]

    graph_def, inputs = _build(body, seed)

    def sample(batch: int, seq_len=None, rng=None) -> dict:
        rng = rng if rng is not None else np.random.default_rng(0)
        feeds = {n: rng.integers(0, v, size=batch).astype(np.int64) for n, v in zip(names, vocabs)}
        feeds["dense"] = rng.normal(0.0, 1.0, size=(batch, 4)).astype(np.float32)
        return feeds

    return TFModel(graph_def, inputs, ["ctr", "cvr"], sample)


# --------------------------------------------------------------------------------------------- string features

STR_EMB = 8
COUNTRIES = ["us", "de", "fr", "gb", "jp", "cn", "br", "in", "es", "it", "kr", "mx", "ca", "au", "ru", "tr",
             "nl", "se", "pl", "ch"]
CATEGORIES = [f"cat_{i:02d}" for i in range(40)] + ["électronique", "家居", "спорт", "本"]
DEVICES = ["iPhone 14", "iPhone 15 Pro", "Pixel 7", "SM-G991B", "Redmi Note 12", "小米 13", "HUAWEI P60", "Galaxy Ü"]
TAGS = ["sports", "music", "news", "travel", "food", "tech", "movies", "games", "fashion", "auto", "音乐", "éco"]


def _string_placeholder(name: str, shape) -> tuple:
    tf = _tf()
    return tf.compat.v1.placeholder(tf.string, shape, name=name), Input(name, np.dtype(object), tuple(shape))


def _hash_embedding(strings, buckets: int, name: str, dim: int = STR_EMB):
    """categorical_column_with_hash_bucket + embedding_column: to_hash_bucket_fast, then the table's rows."""
    tf = _tf()
    ids = tf.strings.to_hash_bucket_fast(strings, buckets, name=f"{name}_hash")
    return tf.compat.v1.nn.embedding_lookup(_embedding(f"{name}_embedding", buckets, dim, stddev=0.3), ids), ids


def _vocab_ids(strings, vocab: list[str], name: str):
    """A StringLookup-like vocabulary: word i -> i + 1, unknown (and "") -> 0 (the OOV row)."""
    tf = _tf()
    init = tf.lookup.KeyValueTensorInitializer(tf.constant(vocab), tf.range(1, len(vocab) + 1, dtype=tf.int64))
    return tf.lookup.StaticHashTable(init, default_value=0, name=f"{name}_vocab").lookup(strings)


def _draw(rng, pool, size, unseen: float = 0.1, empty: float = 0.05) -> np.ndarray:
    """Strings from `pool` as traffic sends them: some never seen in training (new ids, other scripts), some ""."""
    shape = size if isinstance(size, tuple) else (size,)
    out = np.array(pool, dtype=object)[rng.integers(0, len(pool), size=shape)]
    roll = rng.random(shape)
    fresh = [f"new_{rng.integers(1 << 40)}", "ünseen", "未知の値", "🙂"]
    out = np.where(roll < unseen, np.array(fresh, dtype=object)[rng.integers(0, len(fresh), size=shape)], out)
    out = np.where(roll > 1 - empty, "", out)
    flat = out.reshape(-1)
    if flat.size >= 2:  # an unseen and an empty string in every batch of two rows or more
        flat[:2] = [fresh[int(rng.integers(0, len(fresh)))], ""]
    return out.astype(str)


def _joined_tags(rng, batch: int, width: int = 4) -> np.ndarray:
    """0..width tags joined by '|' (an empty row, a full row, a trailing separator: an empty token)."""
    counts = _lengths(batch, width, rng)
    rows = ["|".join(_draw(rng, TAGS, int(c), empty=0.0)) for c in counts]
    if batch >= 3:
        rows[2] += "|"
    return np.array(rows, dtype=str)


def wdl_strings(seed: int = 0, hidden=(64, 32)) -> TFModel:
    """Wide&Deep on raw strings, feature columns written out as TF builds them (DeepRec's WDL on Taobao logs).

    Hash-bucket columns (to_hash_bucket_fast) ``user_id`` (1000), ``item_id`` (2000), ``site_domain`` (300),
    ``device_model`` (200); vocabulary columns ``country`` (a StaticHashTable: OOV -> 0) and ``category``
    (index_table_from_tensor with 2 OOV buckets, as categorical_column_with_vocabulary_list builds it); ``tags``,
    '|'-joined, split by tf.strings.split into a padded [B, L] (to_tensor) and mean-pooled over the non-empty
    tokens; ``dense`` [B, 4]. Wide: a weight per id + dense linear; deep: embeddings (8) + dense → MLP → ``prob``.
    """
    tf = _tf()
    from tensorflow.python.ops import lookup_ops

    hashed = {"user_id": 1000, "item_id": 2000, "site_domain": 300, "device_model": 200}

    def body():
        ph = {n: _string_placeholder(n, (None,)) for n in list(hashed) + ["country", "category", "tags"]}
        dense = _placeholder("dense", np.float32, (None, 4))
        embs, wide = [], []
        for name, buckets in hashed.items():
            emb, ids = _hash_embedding(ph[name][0], buckets, name)
            embs.append(emb)
            wide.append(tf.compat.v1.nn.embedding_lookup(_embedding(f"{name}_weights", buckets, 1, 0.3), ids))
        country = _vocab_ids(ph["country"][0], COUNTRIES, "country")
        category = lookup_ops.index_table_from_tensor(tf.constant(CATEGORIES), num_oov_buckets=2,
                                                      name="category_lookup").lookup(ph["category"][0])
        for name, ids, rows in (("country", country, len(COUNTRIES) + 1), ("category", category, len(CATEGORIES) + 2)):
            embs.append(tf.compat.v1.nn.embedding_lookup(_embedding(f"{name}_embedding", rows, STR_EMB, 0.3), ids))
            wide.append(tf.compat.v1.nn.embedding_lookup(_embedding(f"{name}_weights", rows, 1, 0.3), ids))
        tokens = tf.strings.split(ph["tags"][0], sep="|").to_tensor(default_value="")  # [B, L]
        tag_emb, _ = _hash_embedding(tokens, 100, "tags")
        valid = tf.cast(tf.not_equal(tokens, ""), tf.float32)[:, :, None]
        embs.append(tf.reduce_sum(tag_emb * valid, 1) / tf.maximum(tf.reduce_sum(valid, 1), 1.0))
        dense_w = tf.compat.v1.get_variable("dense_weights", [4, 1],
                                            initializer=tf.compat.v1.random_normal_initializer(stddev=0.1))
        wide_logit = tf.add_n(wide) + tf.matmul(dense[0], dense_w)
        net = _mlp(tf.concat(embs + [dense[0]], axis=1), hidden, "dnn")
        tf.sigmoid(wide_logit + _dense(net, 1, "logits", stddev=0.5), name="prob")
        return [i for _, i in ph.values()] + [dense[1]], ["prob"]

    graph_def, inputs = _build(body, seed)

    def sample(batch: int, seq_len=None, rng=None) -> dict:
        rng = rng if rng is not None else np.random.default_rng(0)
        feeds = {"user_id": _draw(rng, [f"u{i:05d}" for i in range(3000)], batch),
                 "item_id": _draw(rng, [f"item-{i}" for i in range(5000)], batch),
                 "site_domain": _draw(rng, [f"site{i}.example.com" for i in range(400)] + ["新闻.cn"], batch),
                 "device_model": _draw(rng, DEVICES, batch),
                 "country": _draw(rng, COUNTRIES, batch, unseen=0.15),
                 "category": _draw(rng, CATEGORIES, batch, unseen=0.15),
                 "tags": _joined_tags(rng, batch)}
        feeds["dense"] = rng.normal(0.0, 1.0, size=(batch, 4)).astype(np.float32)
        return {i.name: feeds[i.name] for i in inputs}

    return TFModel(graph_def, inputs, ["prob"], sample)


def din_strings(seed: int = 0, seq_len: int = HIST_LEN) -> TFModel:
    """DIN on raw strings: ``user_id`` / ``item_id`` hashed (1000 / 2000 buckets), ``cate_id`` looked up in a
    vocabulary (OOV -> 0), and the behaviour history as [B, T] strings padded with "" (``hist_item_id`` hashed
    into the item table, ``hist_cate_id`` looked up in the category vocabulary); the mask is
    ``hist_item_id != ""``. Attention as ``din`` (MLP 32-16-1 over [q, k, q-k, q*k], masked softmax), then
    [user, item, masked history sum, attention] → MLP 64-32 → ``prob``. ``seq_len`` only sets the sample default.
    """
    tf = _tf()

    def body():
        ph = [_string_placeholder(n, s) for n, s in (("user_id", (None,)), ("item_id", (None,)), ("cate_id", (None,)),
                                                    ("hist_item_id", (None, None)), ("hist_cate_id", (None, None)))]
        user, item, cate, hist_item, hist_cate = (p for p, _ in ph)
        with tf.compat.v1.variable_scope("Embedding_layer"):
            user_eb, _ = _hash_embedding(user, 1000, "uid")
            item_table = _embedding("mid_embedding", 2000, STR_EMB, stddev=0.3)
            cate_table = _embedding("cat_embedding", len(CATEGORIES) + 1, STR_EMB, stddev=0.3)
            lookup = tf.compat.v1.nn.embedding_lookup

            def item_eb(items, cates):
                return tf.concat([lookup(item_table, tf.strings.to_hash_bucket_fast(items, 2000)),
                                  lookup(cate_table, _vocab_ids(cates, CATEGORIES, "cate"))], -1)

            query, facts = item_eb(item, cate), item_eb(hist_item, hist_cate)  # [B, 16], [B, T, 16]
        mask = tf.not_equal(hist_item, "")  # [B, T]
        facts_sum = tf.reduce_sum(facts * tf.cast(mask, tf.float32)[:, :, None], 1)
        with tf.compat.v1.variable_scope("Attention_layer"):
            queries = tf.reshape(tf.tile(query, [1, tf.shape(facts)[1]]), tf.shape(facts))
            din_all = tf.concat([queries, facts, queries - facts, queries * facts], axis=-1)
            d = _dense(_dense(din_all, 32, "f1_att", tf.nn.sigmoid), 16, "f2_att", tf.nn.sigmoid)
            scores = tf.reshape(_dense(d, 1, "f3_att", stddev=1.0), [-1, 1, tf.shape(facts)[1]])
            scores = tf.where(mask[:, None, :], scores, tf.ones_like(scores) * (-2 ** 32 + 1))
            att = tf.reduce_sum(tf.matmul(tf.nn.softmax(scores), facts), 1)
        net = _mlp(tf.concat([user_eb, query, facts_sum, att], -1), (64, 32), "dnn")
        tf.sigmoid(_dense(net, 1, "logits", stddev=0.5), name="prob")
        return [i for _, i in ph], ["prob"]

    graph_def, inputs = _build(body, seed)

    def sample(batch: int, t=None, rng=None) -> dict:
        rng = rng if rng is not None else np.random.default_rng(0)
        t = seq_len if t is None else t
        items = [f"item-{i}" for i in range(5000)]
        valid = np.arange(t)[None, :] < _lengths(batch, t, rng)[:, None]
        hist_item = np.where(valid, _draw(rng, items, (batch, t), empty=0.0), "")
        hist_cate = np.where(valid, _draw(rng, CATEGORIES, (batch, t), unseen=0.05, empty=0.0), "")
        return {"user_id": _draw(rng, [f"u{i:05d}" for i in range(3000)], batch), "item_id": _draw(rng, items, batch),
                "cate_id": _draw(rng, CATEGORIES, batch, unseen=0.15), "hist_item_id": hist_item.astype(str),
                "hist_cate_id": hist_cate.astype(str)}

    return TFModel(graph_def, inputs, ["prob"], sample, has_sequence=True)


__all__ = ["deepfm", "dien", "din", "din_strings", "dlrm", "mmoe", "wdl", "wdl_strings"]
