"""Embedding passes: many per-feature lookups into one.

CTR models look up one table per feature (Wide&Deep: 26 deep + 26 wide lookups), tables split in shards,
bags of ids per sample and multi-hot indicator columns. `merge-partitioned-embeddings` joins the shards,
`vectorize-embedding-bags` replaces per-sample bag loops by one scatter (one for all the tables of a bag
collection) and segment-summed padded bags by a Gather + row sum, `rewrite-indicator-columns` replaces
OneHot + ReduceSum by a scatter, `rewrite-sparse-columns` replaces TensorFlow feature-column lookups
(NonZero, Unique, segment sums, empty rows zeroed) by a Gather on the table and a zero row, and
`fuse-parallel-embeddings` turns the lookups of one batch into tables of one width into a single Gather on the
concatenated table (seed 003: 26 lookups → one gather).

One module per pass: `partitioned.py`, `bags.py`, `sparse_columns.py`, `indicator.py`, `parallel.py`, and
`strings.py` (`string-embedding`: a string column's hash or lookup, Gather and pooling in cheaper kernels).
"""

from . import bags, indicator, parallel, partitioned, sparse_columns, strings  # noqa: F401  (registers the passes)
