"""The TensorFlow zoo's dense rankers: ``wdl``, ``deepfm``, ``dlrm`` and ``mmoe`` (see tf_models.py)."""

from __future__ import annotations

import numpy as np

from .spec import TFModel
from .tf_layers import (_build, _criteo_dense, _dense, _dense_to_sparse, _embedding, _mlp, _multi_hot, _placeholder,
                        _tf, _vocab_sizes, CRITEO_CAT, CRITEO_DENSE)


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
