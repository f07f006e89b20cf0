"""The TensorFlow zoo's history models: ``din`` and ``dien`` (DIEN's GRU and AUGRU cells, its attention), as in
the mouna99/dien repository (see tf_models.py)."""

from __future__ import annotations

import numpy as np

from .spec import TFModel
from .tf_layers import _batch_norm, _build, _dense, _dice, _embedding, _lengths, _placeholder, _prelu, _tf, HIST_LEN


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
