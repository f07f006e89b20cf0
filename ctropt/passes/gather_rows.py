"""`gather-rows-kernel`: embedding lookups (Gather of float rows on axis 0) → ctropt's ``GatherRows`` kernel for
onnxruntime.

A CTR model reads thousands of ids per batch (fields × batch, histories × batch), and onnxruntime's CPU Gather costs
about 8 ns per index whatever the row's width, its per-index copy being a function call: a [1000, 8] table read at
[256, 26] ids takes about 50 µs, a quarter of an optimized PaddleRec DeepFM (1 thread). The kernel copies each row
inline, 3–5× faster (`benchmarks/RESULTS.md`). Any float table of rank 2 and more, constant or computed, with int32
or int64 indices; an index out of range is an error there as here.
"""

from __future__ import annotations

import numpy as np

from .. import kernels
from ..graph.edit import dtype_of, rank_of
from ..patterns import Match, P, Rewrite, Var
from .registry import PassContext, register_pass


def _is_row_lookup(m: Match) -> bool | str:
    table, ids, rank = m["table"], m["ids"], rank_of(m["table"])
    if dtype_of(table) is None or np.dtype(dtype_of(table)) != np.float32 or rank is None or rank < 2:
        return "not a float32 table of rank 2 or more"
    if dtype_of(ids) is None or np.dtype(dtype_of(ids)) not in (np.int32, np.int64):
        return "indices of unknown type"
    if m.root.attrs.get("axis", 0) % rank != 0:
        return "not a lookup of rows (axis 0)"
    return True


def _to_kernel(m: Match) -> list:
    out = m.root.outputs[0]
    return m.op("GatherRows", [m["table"], m["ids"]], name=f"{m.root.name}/GatherRows", domain=kernels.DOMAIN,
                dtype=out.dtype, shape=out.shape)


GATHER_RULES = (Rewrite("gather-rows", P.Gather(Var("table"), Var("ids")), _to_kernel, _is_row_lookup, subgraphs=False),)


@register_pass("gather-rows-kernel", group="lower", targets=("ort",), rules=GATHER_RULES)
def gather_rows_kernel(ctx: PassContext) -> None:
    """Gather of float rows (embedding lookups) → ctropt's GatherRows kernel, where its library loads."""
    if any(n.op == "Gather" for n in ctx.graph.nodes):
        kernels.apply_rules(ctx, GATHER_RULES, "lookups")
