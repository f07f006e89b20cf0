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

The builders live in `tf_rankers.py` (wdl, deepfm, dlrm, mmoe), `tf_sequence.py` (din, dien) and `tf_strings.py`
(wdl_strings, din_strings), over the blocks of `tf_layers.py`; this module names them all (`zoo.builder` reads
them here).
"""

from __future__ import annotations

from .tf_rankers import deepfm, dlrm, mmoe, wdl
from .tf_sequence import dien, din
from .tf_strings import din_strings, wdl_strings

__all__ = ["deepfm", "dien", "din", "din_strings", "dlrm", "mmoe", "wdl", "wdl_strings"]
