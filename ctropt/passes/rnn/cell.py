"""Recognise a GRU-family cell by what it computes, whatever ops the exporter wrote it with.

A cell is the subgraph from its step inputs (the previous state h, the step's input x and, for the
attention kinds, the score a) to the new state. Exporters write it in many ways: one MatMul over
concat[x, h] or separate ones, Gemm with transposed weights, a joint Sigmoid split in two or one per gate,
gates in any order, biases split between input and hidden parts, the reset gate applied before or after
the hidden MatMul. Instead of one pattern per dialect, :func:`identify_gru_cell` reads the cell by meaning:

1. every Sigmoid input is an affine map of (x, h): probing it with the unit vectors recovers its weights;
2. the reset gate r is the Sigmoid output that multiplies into the candidate's Tanh (the product q = r*o);
   cutting the graph at q, the Tanh input is affine in (x, q): its weights give W_n and either R_n
   (o is h: linear_before_reset=0) or the identity, with o = h R_n + Rb_n (linear_before_reset=1);
3. the remaining gate block and the kind (GRU, AUGRU in both the paper's and DIEN's TF form, AGRU) are the
   hypothesis whose canonical cell (``ctropt.ops.rnn.reference``) reproduces the subgraph's output on
   random inputs. Nothing is accepted without that numeric check.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_graphsurgeon as gs

from ...ops.rnn import SequenceAttrs, reference
from ...runtime.subgraph import Subgraph

TOL = 1e-4


@dataclasses.dataclass
class CellMatch:
    attrs: SequenceAttrs  # kind, hidden_size, linear_before_reset, att_keep (padded_output is the caller's)
    W: np.ndarray         # [I, 3H]
    R: np.ndarray         # [H, 3H]
    B: np.ndarray         # [6H]
    x_columns: list[int]  # columns of the x leaf that are the cell's input
    att_column: int | None  # column of the x leaf that carries the attention score, if packed there
    nodes: list[gs.Node]  # the cell's nodes (from the leaves to the new state)


def _region(out: gs.Tensor, leaves: list[gs.Tensor], opset: int) -> Subgraph | None:
    """The nodes between the leaves and `out`, or None when they read a value from outside the cell that is not a
    leaf (an omitted optional input included) or hold control flow."""
    region, leaf_ids = Subgraph([out], leaves, opset), {id(t) for t in leaves}
    outside = region.unresolved or any(isinstance(t, gs.Variable) and not t.name and not t.inputs and
                                       id(t) not in leaf_ids for n in region.nodes for t in n.inputs)
    control_flow = any(isinstance(v, gs.Graph) for n in region.nodes for v in n.attrs.values())
    return None if outside or control_flow else region


def _run(region: Subgraph, outputs: list[gs.Tensor], values: list[np.ndarray]) -> list[np.ndarray]:
    """`outputs` on float32 leaf values, as float32 [rows, -1]."""
    got = region.run([v.astype(np.float32) for v in values], outputs)
    return [np.asarray(v, np.float32).reshape(len(values[0]), -1) for v in got]


def _affine(region: Subgraph, out: gs.Tensor, base: list[np.ndarray], probe: list[int], widths: list[int], rng):
    """Probe `out` as an affine map of the leaves listed in `probe` (others held at `base`): coefficients per
    probed leaf and the bias, or None if it is not affine."""
    n = 1 + sum(widths[i] for i in probe)
    values = [np.zeros((n, b.shape[1]), np.float32) if i in probe else np.repeat(b[:1], n, axis=0)
              for i, b in enumerate(base)]
    row = 1
    for i in probe:
        for j in range(widths[i]):
            values[i][row, j] = 1.0
            row += 1
    (y,) = _run(region, [out], values)
    bias = y[0]
    coefs, row = [], 1
    for i in probe:
        coefs.append(y[row:row + widths[i]] - bias)
        row += widths[i]
    # check on random points
    test = [b.copy() for b in base]
    for i in probe:
        test[i] = rng.normal(size=base[i].shape).astype(np.float32)
    (y2,) = _run(region, [out], test)
    pred = bias + sum(test[i] @ c for i, c in zip(probe, coefs))
    if not np.allclose(y2, pred, atol=TOL * 10, rtol=TOL * 10):
        return None
    return coefs, bias


def _downstream_of(node: gs.Node, region_nodes: list[gs.Node]) -> set[int]:
    ids = {id(n) for n in region_nodes}
    seen, stack = set(), list(node.outputs)
    while stack:
        t = stack.pop()
        for c in t.outputs:
            if id(c) in ids and id(c) not in seen:
                seen.add(id(c))
                stack.extend(c.outputs)
    return seen


def identify_gru_cell(h_new: gs.Tensor, h: gs.Tensor, x: gs.Tensor, att: gs.Tensor | None = None, *,
                      hidden: int | None = None, x_width: int | None = None, opset: int = 17,
                      att_column: int | None = -2) -> CellMatch | None:
    """The canonical GRU-family cell that `h_new = cell(h, x[, att])` computes, or None.

    `h` [B, H] and `x` [B, I] (or [B, 1, I]) are leaf tensors of the cell; `att` [B, 1] or [B] a separate
    attention leaf. When the score rides in `x` as a column (TF DIEN's VecAttGRUCell), pass no `att`:
    the last then the first column are tried as the score (`att_column=-2`, the default); pass
    `att_column=None` to forbid that.
    """
    H = hidden or _width(h)
    I_in = x_width or _width(x)
    if not H or not I_in:
        return None
    if att is None and att_column == -2:
        for col in (None, I_in - 1, 0) if I_in > 1 else (None,):
            found = identify_gru_cell(h_new, h, x, None, hidden=H, x_width=I_in, opset=opset, att_column=col)
            if found is not None:
                return found
        return None
    if att is not None:
        att_column = None
    leaves = [h, x] + ([att] if att is not None else [])
    region = _region(h_new, leaves, opset)
    if region is None or not region.uses("Tanh") or not region.uses("Sigmoid"):
        return None
    rng = np.random.default_rng(0)
    widths = [H, I_in] + ([1] if att is not None else [])
    x_cols = [j for j in range(I_in) if att_column is None or j != att_column % I_in]

    def leaves_at(hv, xv, av):
        vals = [hv, xv.copy()]
        if att_column is not None:
            vals[1][:, att_column % I_in] = av[:, 0]
        if att is not None:
            vals.append(av)
        return vals

    a0 = np.full((1, 1), 0.37, np.float32)
    base = leaves_at(np.zeros((1, H), np.float32), np.zeros((1, I_in), np.float32), a0)
    try:
        return _identify(region, leaves_at, base, widths, x_cols, H, I_in, att is not None or att_column is not None,
                         rng, att_column, h_new)
    except Exception:  # a region that does not run (shapes, dtypes) is not a cell we can read
        return None


def _width(t: gs.Tensor) -> int | None:
    shape = t.shape
    if shape and isinstance(shape[-1], (int, np.integer)) and shape[-1] > 0:
        return int(shape[-1])
    return None


def _identify(region, leaves_at, base, widths, x_cols, H, I_in, has_att, rng, att_column, h_new):
    """The phases of the module docstring on a runnable region; `rng` is consumed by them in turn."""
    sigmoids = region.uses("Sigmoid")
    tanhs = region.uses("Tanh")
    if len(tanhs) != 1:
        return None
    tanh = tanhs[0]
    # 1. gate pre-activations: affine in (h, x)
    gates = _gate_maps(region, sigmoids, base, widths, x_cols, H, rng)
    if gates is None:
        return None
    # 2. the reset gate: the Sigmoid-fed operand of a Mul on the way to the Tanh
    mul = _reset_product(region, sigmoids, tanh)
    if mul is None:
        return None
    mul_node, r_t, o_t = mul
    sample = leaves_at(rng.normal(size=(32, H)).astype(np.float32), rng.normal(size=(32, I_in)).astype(np.float32),
                       rng.uniform(size=(32, 1)).astype(np.float32))
    reset = _reset_columns(region, sigmoids, r_t, o_t, sample, H)
    if reset is None:
        return None
    r_idx, o_val = reset
    # 3. the candidate: cut at q = r*o, the Tanh input is affine in (x, q)
    candidate = _candidate(region, tanh, mul_node, o_t, o_val, sample, base, widths, x_cols, H, I_in, rng)
    if candidate is None:
        return None
    # 4. the update gate and the kind: the hypothesis that reproduces the cell
    return _test_kinds(region, h_new, sample, gates, r_idx, candidate, x_cols, att_column, H, I_in, has_att)


def _gate_maps(region, sigmoids, base, widths, x_cols, H, rng):
    """Every Sigmoid input as an affine map of (h, x): (coef_h [H, k], coef_x [I, k], bias [k]) with the
    sigmoids' columns side by side, or None if one is not affine or they are not H or 2H columns."""
    gate_cols = []   # (coef_h [H, k], coef_x [I, k], bias [k]) per sigmoid
    for s in sigmoids:
        aff = _affine(region, s.inputs[0], base, [0, 1], widths, rng)
        if aff is None:
            return None
        (ch, cx), b = aff
        gate_cols.append((ch, cx[x_cols], b))
    Gh = np.concatenate([g[0] for g in gate_cols], axis=1)
    Gx = np.concatenate([g[1] for g in gate_cols], axis=1)
    Gb = np.concatenate([g[2] for g in gate_cols])
    if Gh.shape[1] not in (H, 2 * H):
        return None
    return Gh, Gx, Gb


def _reset_product(region, sigmoids, tanh):
    """The Mul on the way to the Tanh with exactly one Sigmoid-fed operand: (the Mul, r, o) for q = r*o, or
    None."""
    upstream_of_tanh = {id(n) for n in Subgraph([tanh.inputs[0]], region.leaves, region.opset).nodes}
    sig_down = set()
    for s in sigmoids:
        sig_down |= _downstream_of(s, region.nodes) | {id(s)}
    mul = None
    for n in region.nodes:
        if n.op == "Mul" and id(n) in upstream_of_tanh and len(n.inputs) == 2:
            fed = [bool(t.inputs) and id(t.inputs[0]) in sig_down for t in n.inputs]
            if sum(fed) == 1:
                mul = (n, n.inputs[fed.index(True)], n.inputs[fed.index(False)])
    return mul


def _reset_columns(region, sigmoids, r_t, o_t, sample, H):
    """The sigmoid columns that are r on `sample`, one per column of r, and the value of o there; None if r is
    not H wide or a column of it is no sigmoid column."""
    sig_vals = np.concatenate(_run(region, [s.outputs[0] for s in sigmoids], sample), axis=1)
    r_val, o_val = _run(region, [r_t, o_t], sample)
    if r_val.shape[1] != H:
        return None
    r_idx = []
    for j in range(H):
        hits = np.where(np.abs(sig_vals - r_val[:, j:j + 1]).max(axis=0) < 1e-6)[0]
        if not len(hits):
            return None
        r_idx.append(int(hits[0]))
    return r_idx, o_val


def _candidate(region, tanh, mul_node, o_t, o_val, sample, base, widths, x_cols, H, I_in, rng):
    """The candidate's blocks from the Tanh input, affine in (x, q) once cut at q: (W_n, b_n, linear_before_reset,
    R_n, Rb_n), o being h (linear_before_reset=0) or h R_n + Rb_n (linear_before_reset=1); None otherwise."""
    cut = _region(tanh.inputs[0], [region.leaves[0], region.leaves[1], mul_node.outputs[0]] + region.leaves[2:],
                  region.opset)
    if cut is None:
        return None
    cbase = [base[0], base[1], np.zeros((1, H), np.float32)] + base[2:]
    aff = _affine(cut, tanh.inputs[0], cbase, [0, 1, 2], [H, I_in, H] + widths[2:], rng)
    if aff is None:
        return None
    (ch, cx, cq), cb = aff
    if np.abs(ch).max() > TOL:
        return None
    Wn, bn = cx[x_cols], cb
    if np.allclose(o_val, sample[0], atol=1e-6):          # o is h: linear_before_reset = 0
        lbr, Rn, Rbn = 0, cq, np.zeros(H, np.float32)
    else:
        aff_o = _affine(region, o_t, base, [0, 1], widths, rng)
        if aff_o is None or np.abs(aff_o[0][1]).max() > TOL or not np.allclose(cq, np.eye(H), atol=TOL):
            return None
        lbr, Rn, Rbn = 1, aff_o[0][0], aff_o[1]
    return Wn, bn, lbr, Rn, Rbn


def _test_kinds(region, h_new, sample, gates, r_idx, candidate, x_cols, att_column, H, I_in, has_att):
    """The update gate (the gate columns that are not r, or none, either sign) and the kind whose canonical cell
    reproduces `h_new` on `sample`: the CellMatch, or None."""
    Gh, Gx, Gb = gates
    Wn, bn, lbr, Rn, Rbn = candidate
    rest = [k for k in range(Gh.shape[1]) if k not in set(r_idx)]
    Wr, Rr, br = Gx[:, r_idx], Gh[:, r_idx], Gb[r_idx]
    (want,) = _run(region, [h_new], sample)
    hv, xv = sample[0], sample[1][:, x_cols]
    av = sample[1][:, [att_column % I_in]] if att_column is not None else (sample[2] if len(sample) > 2 else None)
    z_options = [(Gx[:, rest], Gh[:, rest], Gb[rest])] if len(rest) == H else [
        (np.zeros((len(x_cols), H), np.float32), np.zeros((H, H), np.float32), np.zeros(H, np.float32))]
    kinds = [("AUGRU", 0), ("AUGRU", 1), ("AGRU", 0)] if has_att else [("GRU", 0)]
    for (Wz, Rz, bz) in z_options:
        for sign in (1.0, -1.0):
            W = np.concatenate([sign * Wz, Wr, Wn], axis=1).astype(np.float32)
            R = np.concatenate([sign * Rz, Rr, Rn], axis=1).astype(np.float32)
            B = np.concatenate([sign * bz, br, bn, np.zeros(2 * H, np.float32), Rbn]).astype(np.float32)
            for kind, keep in kinds:
                attrs = SequenceAttrs(kind, H, lbr, keep)
                _, got = reference(attrs, xv[:, None, :], W, R, B, initial_h=hv,
                                   att=None if av is None else av.reshape(-1, 1))
                if np.allclose(got, want.reshape(got.shape), atol=TOL, rtol=TOL):
                    return CellMatch(attrs, W, R, B, x_cols, att_column if att_column is None else att_column % I_in,
                                     region.nodes)
    return None
