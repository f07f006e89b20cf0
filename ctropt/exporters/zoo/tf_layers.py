"""The TF1 building blocks the TensorFlow zoo models share: dense layers written out as matmul + bias, MLPs,
embedding tables, BatchNorm, Dice and PReLU, placeholders, freezing a graph into a TFModel, and sample inputs
(Criteo dense features, lengths, multi-hot bags)."""

from __future__ import annotations

import numpy as np

from .spec import Input


CRITEO_CAT = 26
CRITEO_DENSE = 13
HIST_LEN = 100  # default history length of din / dien


def _tf():
    import tensorflow as tf

    return tf


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
