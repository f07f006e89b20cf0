"""Phases 2 and 3 of loops.py: where a recurrent body's cell is (read by rnn/cell.py), and how the step masks it
(the new state and each stacked output, checked by running the step on random states, inputs and lengths)."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_graphsurgeon as gs

from ...graph.edit import is_all_zeros
from ...graph.shapes import Shapes
from ...runtime.subgraph import Subgraph
from .cell import CellMatch, identify_gru_cell
from .loop_dims import _dim
from .loop_plan import _Skip, _Step
from .loop_roles import _binary, _BodyCopy


_PROBE_BATCH = 8
_MAX_CANDIDATES = 8


@dataclasses.dataclass
class _Cell:
    """The cell found in the body copy: its `match`, the tensor `new` that is its output, the carried value `state`
    it updates (of width H), the per-step score `att` and `mask` (None if absent), the copies of the state."""

    match: CellMatch
    new: gs.Tensor
    state: int
    H: int
    att: _Step | None
    mask: _Step | None
    aliases: list


def _search_cell(copy: _BodyCopy, x_step: _Step, extra: _Step | None, b_in: list, inits: list, floats: list,
                 shapes: Shapes, opset: int) -> tuple[CellMatch, gs.Tensor, int, _Step | None, int]:
    """The first tensor after the Tanh that reads as a GRU-family cell of one float carried value, the narrow
    per-step input (if any) as the attention score, else as none: (match, tensor, state, score step, H)."""
    options = [(k, a) for k in floats for a in ([extra] if extra is not None and extra.dtype != np.bool_ else [])
               + [None]]
    for state, att_step in options:
        H = _dim(b_in[state], -1, shapes) or _dim(inits[state], -1, shapes)
        if not H:
            continue
        for cand in _candidates(copy.graph, copy.carried_out[state], opset):
            cell = identify_gru_cell(cand, copy.carried_in[state], x_step.leaf, att_step.leaf if att_step else None,
                                     hidden=H, x_width=x_step.width, opset=opset,
                                     att_column=None if att_step else -2)
            if cell is not None:
                return cell, cand, state, att_step, H
    raise _Skip("no GRU-family cell found in the body")


def _find_cell(copy: _BodyCopy, x_step: _Step, extra: _Step | None, b_in: list, inits: list, floats: list,
               shapes: Shapes, opset: int) -> _Cell:
    """The cell (:func:`_search_cell`); a narrow per-step input that is not the score must be a 0/1 mask, and a
    second float value (Keras' previous output) a copy of the state: starting equal (updated alike: see _masking)."""
    match, new, state, att_step, H = _search_cell(copy, x_step, extra, b_in, inits, floats, shapes, opset)
    mask_step = extra if extra is not None and att_step is None else None
    if mask_step is not None and not _binary(mask_step.source, shapes):
        raise _Skip(f"per-step value {mask_step.source.name} is neither an attention score nor a 0/1 mask")
    aliases = [k for k in floats if k != state]
    for k in aliases:
        if not (inits[k] is inits[state] or (is_all_zeros(inits[k]) and is_all_zeros(inits[state]))):
            raise _Skip(f"a second recurrent value {b_in[k].name} that does not start as the state")
    return _Cell(match, new, state, H, att_step, mask_step, aliases)


def _candidates(bc: gs.Graph, h_out: gs.Tensor, opset: int) -> list[gs.Tensor]:
    """Tensors after the Tanh on the way to the new state: the cell's output is one of them (Adds first)."""
    upstream = {id(t) for n in Subgraph([h_out], [], opset).nodes for t in n.outputs}
    found, seen = [], set()
    frontier = [n.outputs[0] for n in bc.nodes if n.op == "Tanh"]
    for depth in range(6):
        nxt = []
        for t in frontier:
            for c in t.outputs:
                for o in c.outputs:
                    if id(o) in seen:
                        continue
                    seen.add(id(o))
                    nxt.append(o)
                    if id(o) in upstream:
                        found.append((c.op not in ("Add", "Sub", "Sum"), depth, o))
        frontier = nxt
    found.sort(key=lambda f: (f[0], f[1]))
    return [o for _, _, o in found[:_MAX_CANDIDATES]]


@dataclasses.dataclass
class _Outer:
    """Outer values the step reads besides its leaves: proven zeros and the sequence lengths, as (leaf, outer)."""

    zeros: list
    lens_c: list
    lens: gs.Tensor | None
    lens_rank: int


def _masking(copy: _BodyCopy, cell: _Cell, x_step: _Step, used_stacked: list, shapes: Shapes, opset: int,
             rng) -> tuple[_Outer, str]:
    """The masking and the outputs, by running the step: (its outer values, the padded_output of its stacked ones)."""
    step_leaves = [copy.carried_in[cell.state]] + [copy.carried_in[k] for k in cell.aliases] + [x_step.leaf] + \
        [s.leaf for s in (cell.att, cell.mask) if s is not None] + copy.base_leaves
    outs = [cell.new, copy.carried_out[cell.state]] + [copy.carried_out[k] for k in cell.aliases] + \
        [copy.scan_outs[j] for j in used_stacked]
    outer = _outer_values(Subgraph(outs, step_leaves, opset).unresolved, copy.outer_of, cell.mask, shapes)
    probe = Subgraph(outs, step_leaves + [u for u, _ in outer.zeros] + [u for u, _ in outer.lens_c], opset)
    if probe.unresolved:
        raise _Skip("the step uses values from outside")
    return outer, _padded_output(probe, copy, cell, x_step, outer, used_stacked, shapes, rng)


def _outer_values(unresolved: list, outer_of: dict, mask_step: _Step | None, shapes: Shapes) -> _Outer:
    """The values from outside that the step uses: each must be all zeros or (one of them) the sequence lengths,
    an integer or float tensor of rank 1 or [B, 1] (checked by the probe); not with a per-step mask."""
    zeros, lens_c = [], []
    for u in unresolved:
        outer = outer_of.get(id(u))
        if outer is None:
            raise _Skip(f"the step uses {u.name}, which is not an input of the loop")
        dt = shapes.dtype(outer)
        if is_all_zeros(outer):
            zeros.append((u, outer))
        elif dt is not None and (np.issubdtype(dt, np.integer) or np.issubdtype(dt, np.floating)):
            lens_c.append((u, outer))  # the lengths, if the probe agrees
        else:
            raise _Skip(f"the step uses {outer.name}, neither lengths nor zeros")
    if len({id(o) for _, o in lens_c}) > 1:
        raise _Skip("more than one candidate for the sequence lengths")
    lens = lens_c[0][1] if lens_c else None
    if lens is not None and mask_step is not None:
        raise _Skip("both lengths and a per-step mask")
    lens_rank = len(shapes.shape(lens) or [0]) if lens is not None else 0
    if lens is not None and lens_rank not in (1, 2):
        raise _Skip("sequence lengths of rank other than 1 or [B, 1]")
    return _Outer(zeros, lens_c, lens, lens_rank)


def _probe_feeds(t: int, copy: _BodyCopy, cell: _Cell, x_step: _Step, outer: _Outer, shapes: Shapes,
                 rng) -> tuple[np.ndarray, list, np.ndarray]:
    """Random values for the step at t (drawn from `rng` in the order of the leaves): (h, the feeds, valid), with
    valid [B, 1] = t < len, or m_t, or all true."""
    B, H = _PROBE_BATCH, cell.H
    hv = rng.normal(size=(B, H)).astype(np.float32)
    feeds = [hv] + [hv] * len(cell.aliases) + [rng.normal(size=(B, x_step.width)).astype(x_step.dtype)]
    if cell.att is not None:
        feeds.append(rng.uniform(0.05, 0.95, size=(B, 1) if cell.att.rank == 2 else (B,)).astype(cell.att.dtype))
    valid = np.ones((B, 1), bool)
    if cell.mask is not None:
        mv = rng.random(B) < 0.5
        mv[:2] = [True, False]
        valid = mv[:, None]
        feeds.append(mv.reshape((B, 1) if cell.mask.rank == 2 else (B,)).astype(cell.mask.dtype))
    feeds += copy.t_feeds(t)
    for u, o in outer.zeros:
        rank = len(shapes.shape(o) or [0, 0])
        feeds.append(np.zeros((B, H) if rank == 2 else (H,) if rank == 1 else (B,) + (1,) * (rank - 1),
                              dtype=shapes.dtype(o) or np.float32))
    if outer.lens is not None:
        lens_float = np.issubdtype(shapes.dtype(outer.lens), np.floating)
        lv = np.array([0, t, t + 1, t + 5, max(t - 1, 0), 1] + ([t + 0.5, t - 0.5] if lens_float else [t + 2, -1]))
        valid = (t < lv)[:, None]
        feeds += [lv.reshape((B,) if outer.lens_rank == 1 else (B, 1)).astype(shapes.dtype(o))
                  for _, o in outer.lens_c]
    return hv, feeds, valid


def _padded_output(probe: Subgraph, copy: _BodyCopy, cell: _Cell, x_step: _Step, outer: _Outer, used_stacked: list,
                   shapes: Shapes, rng) -> str:
    """Runs the step at t = 0, 3, 7: the new state (and its copies) must be where(valid, cell, h) (the cell's output
    if nothing masks), each used stacked output where(valid, cell, 0) ("zero") or where(valid, cell, h) ("state");
    the padded_output that all of them agree on ("zero" first)."""
    B, H = _PROBE_BATCH, cell.H
    masked = outer.lens is not None or cell.mask is not None
    padded = {j: {"zero", "state"} for j in used_stacked}
    for t in (0, 3, 7):
        hv, feeds, valid = _probe_feeds(t, copy, cell, x_step, outer, shapes, rng)
        try:
            vals = probe.run(feeds)
        except Exception as e:
            raise _Skip(f"the step does not run on probe values ({str(e).splitlines()[0][:120]})") from None
        c = np.asarray(vals[0], np.float32).reshape(B, H)
        kept = np.where(valid, c, hv)
        for v in vals[1:2 + len(cell.aliases)]:
            if not np.allclose(np.asarray(v, np.float32).reshape(B, H), kept, atol=1e-6, rtol=1e-6):
                raise _Skip("the new state is not where(valid step, cell, h)" if masked
                            else "the new state is not the cell's output")
        for j, y in zip(used_stacked, vals[2 + len(cell.aliases):]):
            y = np.asarray(y, np.float32).reshape(B, H)
            if not np.allclose(y, np.where(valid, c, 0.0), atol=1e-6, rtol=1e-6):
                padded[j].discard("zero")
            if not np.allclose(y, kept, atol=1e-6, rtol=1e-6):
                padded[j].discard("state")
    kinds = set.intersection(*padded.values()) if padded else {"zero", "state"}
    if not kinds:
        raise _Skip("padded steps' outputs are neither zeros nor the kept state")
    return "zero" if "zero" in kinds else "state"
