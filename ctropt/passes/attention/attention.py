"""Attention over padded histories: `remove-attention-padding` scores the valid history positions only.

DIN and DIEN score every history position with an MLP over [B, T, 4C] and then mask the padded positions away.
The pass starts at the masking, in the exporters' forms:
- ``Where(valid, s, fill)`` (or ``Where(padded, fill, s)``) with a fill that does not depend on the scores'
  values (zeros_like, ones_like * -2^32+1, a constant);
- ``Mul(s, mask)`` with the mask a Cast of booleans or a mask input (tf2onnx writes ``tf.where`` this way);
- ``s + m`` before a softmax, with m a mask input (PaddleRec's 0 / -1e9) and s bounded by its last layer's
  weights: the positions that get exactly zero weight for every input are the padding (``additive_mask``).
Scores computed flat ([B·T, ...]: FuxiCTR's Gemms over a view, tf2onnx's tensordot in DeepRec) end the region at the
reshape that makes them [B, T], or are scattered back flat when the mask is [B, 1, T]. From the scores it walks
back over the nodes that work position by position. Which axis is the batch and which
the history is measured, not guessed: the graph is run at two sizes (``runtime.probe``). The walk stops at the
region's entries: values of shape [B, T, ...] made outside it (history embeddings, the tiled query, the GRU's
outputs). The region is then rebuilt over the valid positions (flat, b·T + t, found by Compress): each entry read
as [B·T, ...] rows and gathered to [1, N, ...], the same ops, the scores scattered back into zeros of [B, T, ...].
The masking op writes what it wrote before at padded positions, so the outputs are unchanged exactly. Each region is
checked numerically before it is replaced.

This module is the pass (`remove_attention_padding`, one site at a time in `_remove_padding_at`); `mask_sites.py`
finds and measures the sites, `score_region.py` walks the region, `valid_region.py` rebuilds and checks it.
"""

from __future__ import annotations

from ...runtime.probe import try_probe
from ..cleanup import tidy
from ..registry import PassContext, register_pass
from .mask_sites import (_additive_sites, _batch_read_elsewhere, _depends_on, _flat_scores, _order_kept,
                         _positional_scores, _site_sizes, _softmax_over_history, find_sites)
from .padding_rows import insert_padding_masks, padding_candidates, undo
from .score_region import _Axes, find_region, HEAVY_OPS
from .valid_pooling import pool_valid_positions, zero_at_padding
from .valid_region import build_valid_region, check_region, row_constant_entries


@register_pass("remove-attention-padding", group="fusion")
def remove_attention_padding(ctx: PassContext) -> None:
    """Attention MLPs over padded histories ([B, T, ...]) → the same MLP over the N valid positions only."""
    graph = ctx.graph
    sites, candidates = find_sites(graph), padding_candidates(graph)
    additive = _additive_sites(graph)
    if not sites and not candidates and not additive:
        return
    probe, why = try_probe(graph)
    if probe is None:
        ctx.note(why)
        graph.cleanup()  # the valid flags made for additive masks
        return
    masked = {id(s.mask_op.outputs[0]) for s in sites}
    inserted = insert_padding_masks(graph, probe, candidates, lambda w: _depends_on(w, masked))
    if inserted:  # the new masks' values are needed too
        sites = find_sites(graph)
        probe, why = try_probe(graph)
        if probe is None:
            undo(inserted)
            graph.cleanup()
            ctx.note(why)
            return
    sites += [site for site, softmax in additive if _softmax_over_history(site, softmax, probe)]
    opset = int(getattr(graph, "opset", None) or 0)
    graph_outputs = {id(t) for t in graph.outputs}
    done: set[int] = set()
    applied: set[int] = set()  # the mask ops whose region was rebuilt
    for site in sites:
        if id(site.scores) in done:
            continue
        site = _remove_padding_at(ctx, site, probe, opset, graph_outputs)
        if site is not None:
            done.add(id(site.scores))
            applied.add(id(site.mask_op))
    unused = [i for i in inserted if id(i[2]) not in applied]  # masks made explicit that no region took
    undo(unused)
    for _, _, mul in inserted:
        if id(mul) in applied:
            ctx.note(f"{mul.name}: the pooled lookup's zero row is padding, masked explicitly")
    if ctx.rewrites or unused or additive:
        graph.cleanup()
    if ctx.rewrites:
        tidy(ctx)


def _remove_padding_at(ctx: PassContext, site, probe, opset: int, graph_outputs: set[int]):
    """Rebuild the region that computes one site's scores over the valid positions, checked numerically first.
    Returns the site as measured (its scores possibly flat), or None where the region is left as is (with a note
    where there is a reason to give)."""
    graph = ctx.graph
    where = f"{site.mask_op.op} {site.mask_op.name}"
    site = _flat_scores(_positional_scores(site, probe), probe)
    sizes = _site_sizes(site, probe)
    if sizes is None:
        return None  # not a mask over per-position scores
    if site.shape_reads and not _batch_read_elsewhere(graph, site, probe):
        ctx.note(f"left as is: {where}: the mask reads the scores' shape")
        return None
    if not _order_kept(site.chain, probe):
        ctx.note(f"left as is: {where}: the scores reach the mask transposed")
        return None
    region = find_region(site.scores, _Axes(probe, sizes), graph_outputs)
    if region is None or not any(n.op in HEAVY_OPS for n in region.nodes):
        ctx.note(f"left as is: {where}: no position-wise MLP computes the masked scores")
        return None
    tails = {tuple(shape[1 if site.flat else 2:]) for shape in probe.shapes(site.scores)}
    tail = tails.pop() if len(tails) == 1 else None
    built, valid, scattered = build_valid_region(graph, site, region, tail, row_constant_entries(region, probe),
                                                 probe)
    problem = check_region(site, region, built, valid, probe, opset)
    if problem and (built.per_row or built.split):  # without the per-row reads and projections
        built.discard()
        built, valid, scattered = build_valid_region(graph, site, region, tail, probe=probe)
        problem = check_region(site, region, built, valid, probe, opset)
    ctx.matches += 1
    if problem:
        built.discard()
        ctx.note(f"left as is: {where}: {problem}")
        return None
    graph.nodes.extend(built.nodes)
    inside = {id(n) for n in region.nodes}
    for consumer in list(site.scores.outputs):
        if id(consumer) not in inside:
            consumer.inputs[consumer.inputs.index(site.scores)] = scattered
    ctx.rewrites += 1
    pooled = pool_valid_positions(graph, site.mask_op.outputs[0], built, valid, sizes, probe) if opset >= 16 and not site.flat and tail in ((), (1,)) and \
        zero_at_padding(site.mask_op, site.cond, site.negate) else 0
    ops = sum(n.op in HEAVY_OPS for n in region.nodes)
    once = f"; {built.per_row} read once per row" if built.per_row else ""
    once += f", its part of {built.split} layer(s) projected once per row" if built.split else ""
    once += f"; {pooled} pooling(s) of the weights over the valid positions only" if pooled else ""
    ctx.note(f"{where}: {len(region.nodes)} ops ({ops} matmuls) over [B, T, ...] now run on the valid positions "
             f"({len(region.entries)} entries gathered{once})")
    return site
