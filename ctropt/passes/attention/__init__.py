"""Attention and pooling over histories.

- `attention.py`: `remove-attention-padding`, the driver that scores the valid history positions only, over
  `mask_sites.py` (the maskings of per-position scores), `score_region.py` (the region that computes them) and
  `valid_region.py` (that region rebuilt over the valid positions, and checked); its readers `additive_mask.py` (the
  positions an additive mask leaves exactly no weight), `padding_rows.py` (a zero embedding row's padding as an
  explicit mask) and `valid_pooling.py` (the pooling over the valid positions only);
- `query_once.py`: `project-query-once`, the query's part of an attention layer once per row;
- `pooling.py`: `weighted-sum-as-matmul`, weighted sums over the history as one MatMul;
- `attention_core.py`, `token_attention.py`: scaled dot-product attention → ctropt's `AttentionCore` and
  `TokenAttention` kernels.

Imported for registration by ctropt/passes/__init__.py (FAMILIES), module by module: a family's modules import
helpers across families (attention ↔ dense), which package-level imports here would turn into import cycles.
"""
