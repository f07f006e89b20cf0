"""Phase 4 of unrolled.py: what a chain's cell means (the masking peeled off, the cell read by rnn/cell.py, the
step inputs and the attention column) and the numeric check of the first steps against the op's reference."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_graphsurgeon as gs

from ...graph.edit import axes_of, const_value
from ...graph.shapes import Shapes
from ...ops.rnn import reference
from ...runtime.subgraph import Subgraph
from .cell import CellMatch, identify_gru_cell
from .unrolled_steps import _Cell, _Chain, _Group, _Miss, _Steps
from .values import _present


CHECK_STEPS = 3        # steps run in the numeric check
CHECK_TOL = 1e-4


def _read_cell(steps: _Steps, shapes: Shapes, opset: int, chain: _Chain) -> _Cell:
    """Step 1's cell: its masking, its step inputs (x, attention) and what it computes; _Miss if not read."""
    s = chain.states
    masking = _peel_mask(steps, shapes, s)
    if masking is None:
        raise _Miss("the mask is not a [B, T] sequence (Where) nor a 0/1 one, a bool Cast to float (blend)")
    mask_group, invert, h_new1, form = masking
    step_inputs = _step_inputs(steps, shapes, h_new1, s[0])
    if step_inputs is None:
        raise _Miss("the cell's step inputs are not x_t [B, I] (and a_t [B] or [B, 1]) of float32 sequences")
    x_group, x1, att_group, att1 = step_inputs
    H = _last_dim(shapes.shape(s[0])) or _last_dim(shapes.shape(s[1]))
    I = _last_dim(shapes.shape(x_group.source))
    if not H or not I:
        raise _Miss("hidden or input width unknown")
    if att_group is not None and att_group.squeezed and shapes.rank(att_group.source) == 2:
        att1 = _att_column(chain.nodes[1], att1)
    found = _identify_cell(chain.nodes[1], h_new1, s[0], x1, att1, H, I, opset)
    if found is None or list(found.x_columns) != list(range(I)):
        raise _Miss("step 1 is not a GRU-family cell (identify_gru_cell)")
    if (found.attrs.kind == "GRU") != (att_group is None):
        raise _Miss(f"a {found.attrs.kind} cell {'without' if att_group is None else 'with'} an attention sequence")
    attrs = dataclasses.replace(found.attrs, padded_output="state" if mask_group is not None else "zero")
    return _Cell(attrs, found, x_group, att_group, mask_group, invert, H, I, form)


def _peel_mask(steps: _Steps, shapes: Shapes, s: list) -> tuple | None:
    """The masking of step 1: s_t = Where(m_t, h_new, s_{t-1}), or the blend m_t * h_new + (1 - m_t) * s_{t-1}
    of a 0/1 float mask (FuxiCTR's DIEN, torch). Returns (mask group or None, inverted, h_new, form), or None
    if the mask is not a [B, T] (blend: [B, T] or [B, T, 1]) sequence."""
    mask_group, invert, h_new1, form = None, False, s[1], "Where"
    p = s[1].inputs[0] if len(s[1].inputs) == 1 else None
    if p is not None and p.op == "Where" and len(p.inputs) == 3:
        cond, a, b_ = p.inputs
        not_node = None
        if id(cond) not in steps.step_of and len(cond.inputs) == 1 and cond.inputs[0].op == "Not":
            not_node = cond.inputs[0]
            cond = not_node.inputs[0]
        st = steps.step_of.get(id(cond))
        if st is not None and st[0] == 1 and (b_ is s[0] or a is s[0]):
            mask_group = steps.groups[st[1]]
            h_new1 = a if b_ is s[0] else b_
            invert = (a is s[0]) != (not_node is not None)
            if mask_group.squeezed or shapes.rank(mask_group.source) != 2:
                return None
    elif p is not None and p.op == "Add" and len(p.inputs) == 2:
        blend = _blend(steps, s[0], p)
        if blend is not None:
            (mask_group, h_new1), form = blend, "blend"
            if not _binary_mask(mask_group, shapes):
                return None
    return mask_group, invert, h_new1, form


def _blend(steps: _Steps, s0: gs.Tensor, add: gs.Node) -> tuple | None:
    """Add(Mul(m_1, h_new), Mul(Sub(1, m_1), s_0)) in any operand order, m_1 a step-1 slice: (its group, h_new)."""
    muls = [i.inputs[0] if len(i.inputs) == 1 and i.inputs[0].op == "Mul" else None for i in add.inputs]
    if any(m is None for m in muls):
        return None
    for keep, upd in (muls, muls[::-1]):
        if not any(i is s0 for i in keep.inputs):
            continue
        one_minus = keep.inputs[1] if keep.inputs[0] is s0 else keep.inputs[0]
        q = one_minus.inputs[0] if len(one_minus.inputs) == 1 else None
        if q is None or q.op != "Sub" or not _is_one(q.inputs[0]):
            continue
        m = q.inputs[1]
        st = steps.step_of.get(id(m))
        if st is None or st[0] != 1 or not any(i is m for i in upd.inputs):
            continue
        return steps.groups[st[1]], upd.inputs[1] if upd.inputs[0] is m else upd.inputs[0]
    return None


def _is_one(t: gs.Tensor) -> bool:
    v = const_value(t)
    return v is not None and v.size == 1 and float(np.asarray(v).ravel()[0]) == 1.0


def _binary_mask(g: _Group, shapes: Shapes) -> bool:
    """The blend's mask sequence holds only 0 and 1: a bool Cast to float, maybe reshaped, [B, T] sliced to
    [B, 1] or [B, T, 1] gathered to [B, 1]."""
    rank = shapes.rank(g.source)
    if not ((rank == 2 and not g.squeezed) or (rank == 3 and g.squeezed and _last_dim(shapes.shape(g.source)) == 1)):
        return False
    t = g.source
    while len(t.inputs) == 1 and t.inputs[0].op in ("Unsqueeze", "Reshape", "Squeeze", "Identity"):
        t = t.inputs[0].inputs[0]
    p = t.inputs[0] if len(t.inputs) == 1 else None
    return p is not None and p.op == "Cast" and shapes.dtype(p.inputs[0]) == np.bool_ \
        and shapes.dtype(g.source) == np.float32


def _step_inputs(steps: _Steps, shapes: Shapes, h_new1: gs.Tensor, s0: gs.Tensor) -> tuple | None:
    """The step slices step 1's cell reads: (x group, x_1, attention group, a_1), the attention ones None if
    there is none; None if it reads others or not in float32. x_t is a step of a [B, T, I] sequence; a_t one
    of a [B, T] sequence, or of a [B, T, 1] one (torch-rechub's ``att.unsqueeze(-1)`` sliced to [B, 1]) beside
    a wider x. B is whatever rows the sequences hold (rows the graph selected, not necessarily its batch)."""
    cell_leaves = steps.leaves(h_new1, s0, step=1)
    if cell_leaves is None:
        return None
    seqs = [(steps.groups[gi], leaf) for gi, leaf in cell_leaves.items()]
    flat = [p for p in seqs if shapes.rank(p[0].source) == 2]                      # a_t of [B, T]
    wide = [p for p in seqs if shapes.rank(p[0].source) == 3 and p[0].squeezed]   # x_t, or a_t of [B, T, 1]
    if len(flat) + len(wide) != len(seqs):
        return None
    if len(wide) == 2 and not flat:  # x_t beside a_t of [B, T, 1]: the attention is the one a column wide
        columns = [p for p in wide if _last_dim(shapes.shape(p[0].source)) == 1]
        if len(columns) != 1:
            return None
        flat, wide = columns, [p for p in wide if p is not columns[0]]
    if len(wide) != 1 or len(flat) > 1:
        return None
    (x_group, x1), (att_group, att1) = wide[0], flat[0] if flat else (None, None)
    if any(g is not None and shapes.dtype(g.source) != np.float32 for g in (x_group, att_group)):
        return None  # the fused op computes in float32
    return x_group, x1, att_group, att1


def _identify_cell(step_nodes: list[gs.Node], h_new1: gs.Tensor, h: gs.Tensor, x1: gs.Tensor,
                   att1: gs.Tensor | None, H: int, I: int, opset: int) -> CellMatch | None:
    """What step 1's cell computes (identify_gru_cell); a GRU cell over a_t * x_t is an AIGRU."""
    found = identify_gru_cell(h_new1, h, x1, att1, hidden=H, x_width=I, opset=opset, att_column=None)
    if found is None and att1 is not None:
        # AIGRU: the cell is a GRU over a_t * x_t
        scaled = _scaled_input(step_nodes, x1, att1)
        if scaled is not None:
            found = identify_gru_cell(h_new1, h, scaled, None, hidden=H, x_width=I, opset=opset,
                                      att_column=None)
            if found is not None and found.attrs.kind == "GRU":
                found = dataclasses.replace(found, attrs=dataclasses.replace(found.attrs, kind="AIGRU"))
    return found


def _att_column(nodes: list[gs.Node], att: gs.Tensor) -> gs.Tensor:
    """A [B] attention step a_t (Gather of [B, T] at t) that the step reads only as Unsqueeze(a_t, -1): that
    [B, 1] column (torch's ``attn.unsqueeze(-1)``), else `att` as is."""
    ids = {id(n) for n in nodes}
    readers = [n for n in att.outputs if id(n) in ids]
    if len(readers) == 1 and readers[0].op == "Unsqueeze" and axes_of(readers[0]) in ([-1], [1]):
        return readers[0].outputs[0]
    return att


def _scaled_input(nodes: list[gs.Node], x: gs.Tensor, att: gs.Tensor) -> gs.Tensor | None:
    """The output of Mul(x, a) (a = att, or att reshaped/unsqueezed) among a step's nodes, if x is read
    by nothing else in the step."""
    ids = {id(n) for n in nodes}
    for n in nodes:
        if n.op != "Mul" or len(n.inputs) != 2 or not any(i is x for i in n.inputs):
            continue
        other = n.inputs[1] if n.inputs[0] is x else n.inputs[0]
        while other is not att and len(other.inputs) == 1 and other.inputs[0].op in (
                "Unsqueeze", "Reshape", "Identity", "Cast") and id(other.inputs[0]) in ids:
            other = other.inputs[0].inputs[0]
        if other is att and all(u is n for u in x.outputs if id(u) in ids):
            return n.outputs[0]
    return None


def _last_dim(shape) -> int | None:
    if shape and isinstance(shape[-1], (int, np.integer)) and shape[-1] > 0:
        return int(shape[-1])
    return None


def _check(chain: _Chain, cell: _Cell, h0_zero: bool, shapes: Shapes, opset: int) -> bool:
    """Run the exported nodes of the first steps (slices included) on random sequences and compare the state
    with the reference op's."""
    x_group, att_group, mask_group, H, I = cell.x_group, cell.att_group, cell.mask_group, cell.H, cell.I
    K = min(CHECK_STEPS, chain.T)
    T, batch = chain.T, 4
    rng = np.random.default_rng(0)
    nodes = {}
    for ns in chain.nodes[:K]:
        for n in ns:
            nodes[id(n)] = n
    produced = {id(o) for n in nodes.values() for o in n.outputs}
    feeds = {}
    X = rng.normal(size=(batch, T, I)).astype(np.float32)
    feeds[id(x_group.source)] = (x_group.source, X if x_group.axis == 1 else np.ascontiguousarray(X.transpose(1, 0, 2)))
    att = mask = None
    if att_group is not None:
        att = rng.uniform(0.05, 1.0, size=(batch, T)).astype(np.float32)
        dtype = shapes.dtype(att_group.source) or np.float32
        shaped = att.reshape(att.shape + (1,) * ((shapes.rank(att_group.source) or 2) - 2))
        feeds[id(att_group.source)] = (att_group.source, shaped.astype(dtype))
    if mask_group is not None:
        cond = np.ones((batch, T), bool)
        cond[0, :] = False           # an empty row
        cond[1, 1:] = False          # length 1
        cond[3, 2:] = False          # partial
        dtype = shapes.dtype(mask_group.source) or np.bool_
        shaped = cond.reshape(cond.shape + (1,) * ((shapes.rank(mask_group.source) or 2) - 2))
        feeds[id(mask_group.source)] = (mask_group.source, shaped.astype(dtype))
        mask = ~cond if cell.invert else cond
    h0 = None if h0_zero else rng.normal(size=(batch, H)).astype(np.float32)
    if const_value(chain.h0) is None:
        feeds[id(chain.h0)] = (chain.h0, np.zeros((batch, H), np.float32) if h0 is None else h0)
    # the slices that feed these steps
    for g in (x_group, att_group, mask_group):
        if g is None:
            continue
        for t in range(K):
            for o in g.steps[t]:
                for n in g.nodes[id(o)]:
                    nodes[id(n)] = n
    produced = {id(o) for n in nodes.values() for o in n.outputs}
    for n in nodes.values():
        for i in n.inputs:
            if (_present(i) and id(i) not in produced and id(i) not in feeds and const_value(i) is None):
                return False  # a value from elsewhere: not a chain we can run alone
    out = chain.states[K - 1]
    try:
        (got,) = Subgraph([out], [t for t, _ in feeds.values()], opset, nodes=list(nodes.values())).run(
            [v for _, v in feeds.values()])
    except Exception:
        return False
    found = cell.match
    _, want = reference(cell.attrs, X[:, :K], found.W, found.R, found.B, initial_h=h0,
                        att=None if att is None else att[:, :K], mask=None if mask is None else mask[:, :K])
    return got.shape == want.shape and np.allclose(got, want, atol=CHECK_TOL, rtol=CHECK_TOL)
