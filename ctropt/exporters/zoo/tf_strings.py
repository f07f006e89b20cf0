"""The TensorFlow zoo's string-feature models: ``wdl_strings`` and ``din_strings`` (hash buckets, vocabularies,
split tag columns), with inputs drawn as traffic sends them (unseen and empty strings, other scripts)."""

from __future__ import annotations

import numpy as np

from .spec import Input, TFModel
from .tf_layers import _build, _dense, _embedding, _lengths, _mlp, _placeholder, _tf, HIST_LEN


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
