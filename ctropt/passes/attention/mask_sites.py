"""Where `remove-attention-padding` starts: the sites that mask per-position scores (`Where`, `Mul` by a mask, an
additive mask before a softmax), and what the probe measures of each (flat or [B, T] scores, sizes, order)."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_graphsurgeon as gs

from ...graph.edit import const_value
from ...runtime.inputs import analyze_inputs
from ...runtime.probe import Probe
from .additive_mask import LAYOUT, additive_masks, valid_flags


LAYOUT_OPS = LAYOUT  # ops that move values without changing them


@dataclasses.dataclass
class Site:
    """One masking of per-position scores: `mask_op` reads `scores` (through layout ops) and `cond`."""

    mask_op: gs.Node
    scores: gs.Tensor  # S, [B, T] or [B, T, 1, ...]: where the position-wise region ends
    cond: gs.Tensor  # same shape as the masked value
    negate: bool  # valid positions are where cond is false (Where(padded, fill, s))
    chain: list[gs.Node]  # layout ops from S to the masked value
    flat: bool = False  # S is [B·T, ...] (set once the probe has measured it)
    shape_reads: bool = False  # the mask reads a shape off the scores (`_batch_read_elsewhere` fixes that)


def _depends_on(t: gs.Tensor, targets: set[int], depth: int = 0, shapes: bool = False) -> bool:
    """Whether `t`'s values depend on any of `targets` (reading only a shape counts only with `shapes`)."""
    if id(t) in targets:
        return True
    if depth > 40 or not t.inputs:
        return False
    n = t.inputs[0]
    if (n.op == "Shape" or n.op == "Size") and not shapes:
        return False
    return any(_depends_on(u, targets, depth + 1, shapes) for u in n.inputs)


def _bool_mask(m: gs.Tensor, mask_inputs: set[str]) -> bool:
    """A mask input, or a Cast (of booleans: checked on the probe's values, `_site_sizes`)."""
    if m.name in mask_inputs:
        return True
    n = m.inputs[0] if m.inputs else None
    return n is not None and n.op == "Cast" and n.inputs[0].dtype in (np.bool_, None)


def _walk_to_scores(x: gs.Tensor, mask_op: gs.Node) -> tuple[gs.Tensor, list[gs.Node]] | None:
    """From the masked value back over layout ops whose values are read only by the next op (or by Shape)."""
    chain, t, reader = [], x, mask_op
    while True:
        others = [c for c in t.outputs if c is not reader and c.op not in ("Shape", "Size")]
        if others:
            return None
        n = t.inputs[0] if t.inputs else None
        if n is None:
            return None
        if n.op not in LAYOUT_OPS:
            return t, chain
        chain.insert(0, n)
        t, reader = n.inputs[0], n


def find_sites(graph: gs.Graph) -> list[Site]:
    mask_inputs = {name for name, f in analyze_inputs(graph).items() if f.is_mask}
    sites = []
    for n in graph.nodes:
        candidates = []
        if n.op == "Where" and len(n.inputs) == 3:
            c, a, b = n.inputs
            candidates = [(a, c, False, b), (b, c, True, a)]
        elif n.op == "Mul" and len(n.inputs) == 2:
            a, b = n.inputs
            candidates = [(x, m, False, None) for x, m in ((a, b), (b, a)) if _bool_mask(m, mask_inputs)]
        for x, cond, negate, fill in candidates:
            if const_value(x) is not None:
                continue
            found = _walk_to_scores(x, n)
            if found is None:
                continue
            scores, chain = found
            region_values = {id(scores)} | {id(c.outputs[0]) for c in chain}
            if fill is not None and _depends_on(fill, region_values):
                continue
            if _depends_on(cond, region_values):
                continue
            # even a shape read off the scores would be a cycle (the scatter reads the mask): fixed once probed
            reads_shape = _depends_on(cond, region_values, shapes=True)
            sites.append(Site(n, scores, cond, negate, chain, shape_reads=reads_shape))
    return sites


def _first_dim_only(shape: gs.Node) -> bool:
    """The Shape node's value is read only for its first dim (Gather of index 0, Slice [0:1], or start 0 end 1)."""
    if shape.attrs.get("start", 0) == 0 and shape.attrs.get("end") == 1:
        return True
    for c in shape.outputs[0].outputs:
        args = [const_value(u) for u in c.inputs[1:]]
        if c.op == "Gather" and c.attrs.get("axis", 0) == 0 and args[0] is not None and args[0].size == 1 and \
                int(args[0].ravel()[0]) == 0:
            continue
        if c.op == "Slice" and len(args) >= 2 and all(a is not None and a.size == 1 for a in args[:2]) and \
                (int(args[0].ravel()[0]), int(args[1].ravel()[0])) == (0, 1) and (len(args) < 3 or args[2] is None
                                                                             or args[2].ravel().tolist() == [0]):
            continue
        return False
    return True


def _batch_read_elsewhere(graph: gs.Graph, site: Site, probe: Probe) -> bool:
    """Shapes that the mask reads off the scores (RecBole: ``mask.repeat(scores.size(0), 1)``), only for the
    batch size, read it off a graph input with that first dim in every probe run instead; whether the mask is then
    free of the scores."""
    region_values = {id(site.scores)} | {id(c.outputs[0]) for c in site.chain}
    reads, stack, seen = [], [site.cond], set()
    while stack:
        t = stack.pop()
        n = t.inputs[0] if t.inputs else None
        if n is None or id(n) in seen:
            continue
        seen.add(id(n))
        if n.op == "Shape" and id(n.inputs[0]) in region_values:
            reads.append(n)
        else:
            stack.extend(u for u in n.inputs if u.name)
    batch = [probe.value(site.scores, run).shape[0] for run in range(len(probe.runs))]
    sources = [x for x in graph.inputs if all(
        probe.value(x, run) is not None and probe.value(x, run).ndim and probe.value(x, run).shape[0] == b
        for run, b in enumerate(batch))]
    if not sources or len(set(batch)) < 2 or not all(_first_dim_only(n) for n in reads):
        return False
    for n in reads:  # an input of the same rank if there is one: the Shape's value keeps its length
        rank = probe.value(n.inputs[0]).ndim
        n.inputs[0] = next((x for x in sources if probe.value(x).ndim == rank), sources[0])
        if probe.value(n.inputs[0]).ndim != rank:
            n.outputs[0].shape = None  # read only at 0, but its declared length is the old rank
    return not _depends_on(site.cond, region_values, shapes=True)


def _positional_scores(site: Site, probe: Probe) -> Site:
    """The site with its scores moved along the layout chain to the first value shaped [B, T, ...] like the mask,
    when the scores are computed flat ([B·T, ...], then reshaped: torch's Linear over a [B·T, C] view)."""
    values = [site.scores] + [n.outputs[0] for n in site.chain]
    for k, t in enumerate(values):
        ok = True
        for run in range(len(probe.runs)):
            cond, value = probe.value(site.cond, run), probe.value(t, run)
            if cond is None or value is None or cond.ndim < 2 or not cond.shape[0] or \
                    tuple(value.shape[:2]) != (cond.shape[0], cond.size // cond.shape[0]):
                ok = False
                break
        if ok:
            return dataclasses.replace(site, scores=t, chain=site.chain[k:])
    return site


def _site_sizes(site: Site, probe: Probe) -> list[tuple[int, int]] | None:
    """(B, T) of each probe run, read off the mask; None when the mask is not [B, ...T...] like the scores."""
    sizes = []
    for run in range(len(probe.runs)):
        cond, scores = probe.value(site.cond, run), probe.value(site.scores, run)
        x = site.chain[-1].outputs[0] if site.chain else site.scores
        x_value = probe.value(x, run)
        if cond is None or scores is None or x_value is None or cond.shape != x_value.shape or cond.ndim < 2:
            return None
        cast = site.cond.inputs[0] if site.cond.inputs and site.cond.inputs[0].op == "Cast" else None
        source = probe.value(cast.inputs[0], run) if cast is not None and site.mask_op.op == "Mul" else cond
        if source is None or source.dtype not in (np.bool_, np.float32, np.float64):
            return None
        batch = cond.shape[0]
        if batch == 0 or cond.size % batch or scores.ndim < 2 or scores.size != cond.size:
            return None
        steps = cond.size // batch
        if tuple(scores.shape[:2]) != (batch, steps) and not (site.flat and scores.shape[0] == batch * steps):
            return None
        sizes.append((batch, steps))
    return sizes


def _flat_scores(site: Site, probe: Probe) -> Site:
    """The site marked flat when its scores are [B·T, ...] and no value of its chain is [B, T, ...] (DeepRec's
    attention: the MLP over [B·T, C] rows, the scores reshaped to [B, 1, T] for a mask of that shape)."""
    cond, scores = probe.value(site.cond), probe.value(site.scores)
    if cond is None or scores is None or cond.ndim < 2 or not cond.shape[0] or scores.ndim < 1:
        return site
    batch, steps = cond.shape[0], cond.size // cond.shape[0]
    positional = scores.ndim >= 2 and tuple(scores.shape[:2]) == (batch, steps)
    return dataclasses.replace(site, flat=not positional and scores.shape[0] == batch * steps)


def _additive_sites(graph: gs.Graph) -> list[tuple[Site, gs.Node]]:
    """Additive masks before a softmax over bounded scores (`additive_mask`), as sites: the valid flags are the
    condition; the Add then writes 0 + m at the positions that get no weight."""
    sites = []
    for add, x, mask, bound, scale, shift, softmax in additive_masks(graph, _depends_on):
        found = _walk_to_scores(x, add)
        if found is not None:
            valid = valid_flags(graph, mask, bound, scale, shift)
            sites.append((Site(add, found[0], valid, False, found[1]), softmax))
    return sites


def _softmax_over_history(site: Site, softmax: gs.Node, probe: Probe) -> bool:
    """The softmax normalizes over one row's positions, the mask's row: its axis holds all of the row's T."""
    for run in range(len(probe.runs)):
        x, mask = probe.value(softmax.inputs[0], run), probe.value(site.cond, run)
        if x is None or mask is None or not mask.shape[0]:
            return False
        axis = softmax.attrs.get("axis", -1) % x.ndim
        steps = mask.size // mask.shape[0]
        if x.shape[0] != mask.shape[0] or x.shape[axis] != steps or x.size != mask.size or axis == 0:
            return False
    return True


def _order_kept(chain: list[gs.Node], probe: Probe) -> bool:
    """The layout ops keep the positions in row-major (batch, history) order: transposes move unit axes only."""
    for n in chain:
        if n.op != "Transpose":
            continue
        shape = probe.value(n.inputs[0]).shape
        perm = n.attrs.get("perm", list(range(len(shape)))[::-1])
        moved = [p for p in perm if shape[p] != 1]
        if moved != sorted(moved):
            return False
    return True
