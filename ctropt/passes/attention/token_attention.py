"""`token-attention`: self-attention whose Q, K and V are linear projections of the tokens → ctropt's
``TokenAttention`` kernel, which projects in the kernel and does a row's work once for the rows that share it.

In one ranking request every candidate row holds the same user history, and in BST-style models only the
candidate's own token differs: the history tokens' projections and their scores among themselves are the same in
every row, and the rows after the first only add their own token (one projection, one key per query row, one
query row over every key: the kernel merges two partial softmaxes as flash attention does). Runs where user inputs
are declared (`--user-inputs`: one user per request); the speed guard times it on such requests.

Found from an AttentionCore (attention-core-kernel's, in any dialect it reads) by what feeds it: each of Q, K and V
is a Gemm or MatMul by a constant (with its bias) of a token tensor [B, T, D], through Reshape, Transpose and
(un)squeezes only, Q's tokens and the keys' possibly two tensors (deepctr adds a position to each apart). Which
columns of the projections each head reads, and how the kernel's heads are laid out (batch then heads, or heads
then batch as tf stacks them), is read off a run of that part of the graph on two random rows, and the rewrite is
made only where the projections reproduce it. A boolean mask is kept as AttentionCore reads it; a float
bias (not a mask) is not handled.

The output projection that follows (the heads merged by layout ops, a Gemm or MatMul by a constant, its bias, then
layout ops to the first other op, torch's sequence-first Transposes among them) goes into the kernel too: it
writes the projected rows in the order that op reads them ([B, T, N] or [T, B, N]), and adds the tokens themselves
where that op is their residual Add. By linearity the kernel applies W_o to the shared history's partial sums once
per user, so a candidate's row costs a weighted sum of projected rows, not a projection. Which rows and columns
land where is read off a run of those layout ops on numbered values.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from ... import kernels
from ...graph import annotate_shapes_if_bare
from ...graph.edit import add_constant, add_node, const_value, replace_outputs, shape_of
from ...runtime.subgraph import Subgraph
from .additive_mask import LAYOUT
from ..dense.fc import per_column
from .query_once import layer_weights
from ..registry import PassContext, register_pass

PROBE_ROWS, PROBE_TOKENS = 2, 7


def _layout(node: gs.Node | None) -> bool:
    """Whether node only moves values: a Reshape, Transpose, (un)squeeze, or a Gather of one constant index."""
    if node is None:
        return False
    if node.op == "Gather":
        index = const_value(node.inputs[1])
        return index is not None and index.ndim == 0
    return node.op in LAYOUT


def _through_layout(t: gs.Tensor, stop) -> gs.Tensor | None:
    """The first value from t back through layout ops (their first input) for which stop(value) holds."""
    for _ in range(16):
        if stop(t):
            return t
        node = t.inputs[0] if t.inputs else None
        if not _layout(node):
            return None
        t = node.inputs[0]
    return None


def _projection(t: gs.Tensor) -> tuple[gs.Tensor, np.ndarray, np.ndarray] | None:
    """t = x·W + b: a MatMul or a plain Gemm by constants (`query_once.layer_weights`), then an Add of a constant per
    column or none: (x, W [D, C] float32, b [C])."""
    node = t.inputs[0] if t.inputs else None
    added = None
    if node is not None and node.op == "Add":
        k = next((i for i in (0, 1) if const_value(node.inputs[i]) is not None), None)
        if k is None or not node.inputs[1 - k].inputs:
            return None
        added, node = node.inputs[k], node.inputs[1 - k].inputs[0]
    w, b = layer_weights(node)
    if w is None or w.ndim != 2 or w.dtype != np.float32:
        return None
    bias = _bias(b, added, w.shape[1])
    return None if bias is None else (node.inputs[0], w, bias)


def _bias(b: np.ndarray | None, added: gs.Tensor | None, width: int) -> np.ndarray | None:
    """A layer's bias [width] (float32): its own (`layer_weights`' b) plus the constant Add after it, None when that
    constant does not act per column."""
    c = per_column(added, width) if added is not None else 0.0
    own = np.zeros(width) if b is None else np.broadcast_to(np.reshape(b, -1), (width,))
    return None if c is None else (own + c).astype(np.float32)


def _tokens(x: gs.Tensor, width: int) -> gs.Tensor | None:
    """The token tensor [B, T, D] the projection's input x is a layout of (B the batch: not a fixed size)."""
    def fits(t):
        shape = shape_of(t)
        return shape is not None and len(shape) == 3 and not isinstance(shape[0], int) and \
            (shape[2] == width or not isinstance(shape[2], int))
    return _through_layout(x, fits)


def _view(value: np.ndarray, attrs: dict, key: str) -> np.ndarray:
    """A kernel input as AttentionCore reads it: select, then perm, right-aligned to 4 axes."""
    sel = attrs.get(f"{key}_select")
    if sel is not None:
        value = np.take(value, sel[1], axis=sel[0])
    perm = attrs.get(f"{key}_perm")
    if perm is not None:
        value = np.transpose(value, perm)
    return value.reshape((1,) * (4 - value.ndim) + value.shape)


def _heads(view: np.ndarray, projected: np.ndarray, width: int) -> tuple[str, list[int], bool] | None:
    """How the kernel's units [l0, l1] lay out (batch, head) — "bh" or "hb", the two merged into one axis or not —
    and each head's first column in the projections, read off the probe: view[unit] == projected[b][:, col :
    col + width] (up to rounding: random values, so no other column comes near); None otherwise."""
    rows = projected.shape[0]
    merged = view.shape[0] == 1 and view.shape[1] % rows == 0   # one head: [1, B] read as [B, 1] merged
    for order in ("bh", "hb"):
        heads = view.shape[1] // rows if merged else view.shape[1] if order == "bh" else view.shape[0]
        if merged:
            view = view.reshape(((rows, heads) if order == "bh" else (heads, rows)) + view.shape[2:])
        l0, l1 = view.shape[:2]
        if (l0, l1) != ((rows, heads) if order == "bh" else (heads, rows)):
            continue
        cols = []
        for h in range(heads):
            found = None
            for col in range(projected.shape[2] - width + 1):
                if all(np.allclose(view[(b, h) if order == "bh" else (h, b)], projected[b][:, col:col + width],
                                   rtol=1e-4, atol=1e-5) for b in range(rows)):
                    found = col
                    break
            if found is None:
                break
            cols.append(found)
        if len(cols) == heads:
            return order, cols, merged
        if merged:
            view = view.reshape((1, rows * heads) + view.shape[2:])
    return None


def _read(core: gs.Node) -> dict | str:
    """The tokens, weights, head columns and layout of an AttentionCore fed by projections; a reason otherwise."""
    ins = core.inputs
    if len(ins) > 3 and ins[3].name:
        return "a float bias"
    found = []
    for t in ins[:3]:
        src = _through_layout(t, lambda v: _projection(v) is not None)
        proj = _projection(src) if src is not None else None
        if proj is None:
            return "Q, K or V is not a projection of tokens"
        found.append(proj)
    probe = [_tokens(x, w.shape[0]) for x, w, _ in found]
    if any(p is None for p in probe) or probe[1] is not probe[2]:
        return "the projections' inputs are not one token tensor [B, T, D] for the keys and values"
    return {"found": found, "xq": probe[0], "xkv": probe[1], "width": found[0][1].shape[0]}


def _columns(core: gs.Node, read: dict, opset: int) -> dict | str:
    """Runs the part of the graph from the tokens to Q, K and V on random rows: the weights of every projection side
    by side, each head's columns, and the layout of the kernel's heads."""
    xq, xkv, found = read["xq"], read["xkv"], read["found"]
    leaves = [xq] if xq is xkv else [xq, xkv]
    sub = Subgraph(list(core.inputs[:3]), leaves, opset)
    if sub.unresolved:
        return "Q, K or V reads values besides the tokens"
    tokens, width = shape_of(xq)[1], read["width"]
    tokens = tokens if isinstance(tokens, int) else PROBE_TOKENS   # a history of any length: probed at one
    rng = np.random.default_rng(0)
    values = [rng.normal(size=(PROBE_ROWS, tokens, width)).astype(np.float32) for _ in leaves]
    try:
        q, k, v = sub.run(values)
    except Exception as e:   # noqa: BLE001  (onnxruntime's own errors: not this form)
        return f"the part from the tokens to Q, K and V does not run alone ({str(e).splitlines()[0][:80]})"
    weights, biases = [], []
    for _, w, b in found:   # each distinct projection once, side by side
        if not any(np.array_equal(w, o) and np.array_equal(b, ob) for o, ob in zip(weights, biases)):
            weights.append(w)
            biases.append(b)
    w_all, b_all = np.concatenate(weights, 1).astype(np.float32), np.concatenate(biases).astype(np.float32)
    projected = [values[0] @ w_all + b_all, values[-1] @ w_all + b_all]
    layout, cols = None, []
    for key, value, source in (("q", q, projected[0]), ("k", k, projected[1]), ("v", v, projected[1])):
        view = _view(value, core.attrs, key)
        got = _heads(view, source.astype(np.float32), view.shape[3])
        if got is None or (layout is not None and got[::2] != layout):
            return "the projections do not reproduce the kernel's Q, K and V"
        layout = got[::2]
        cols.append(got[1])
    if len({len(c) for c in cols}) != 1:
        return "Q, K and V with different head counts"
    mask = core.inputs[4] if len(core.inputs) > 4 and core.inputs[4].name else None
    rank = max([2, len(shape_of(mask) or []) if mask is not None else 0] +   # AttentionCore's output rank
               [x.ndim - (1 if core.attrs.get(f"{key}_select") else 0) for key, x in zip("qkv", (q, k, v))])
    perm = core.attrs.get("y_perm") or [0, 1, 2]
    if not layout[1] and rank != 4:
        return "the output not of rank 4"
    if layout[1] and (rank != 3 or (perm.index(0) < perm.index(1) and not isinstance(shape_of(xq)[1], int))):
        return "heads merged into the batch, the output not of rank 3 or its tokens' count unknown"
    shape = shape_of(mask) if mask is not None else []
    if layout[1] and (shape is None or (len(shape) >= 3 and shape[-3] != 1 and
                                        not all(isinstance(d, int) for d in shape[-2:]))):
        return "heads merged into the batch, with a mask of unknown size"
    return {"w": w_all, "b": b_all, "cols": cols, "order": layout[0], "merged": layout[1],
            "dk": _view(q, core.attrs, "q").shape[3], "dv": _view(v, core.attrs, "v").shape[3]}


def _rewrite(core: gs.Node, read: dict, cols: dict, graph: gs.Graph) -> gs.Node:
    """TokenAttention in the AttentionCore's place, writing its output's layout (heads merged into the batch: the
    kernel's [B, H, T, dv] written so that a Reshape merges them, the mask regrouped likewise)."""
    attrs, name, out = core.attrs, core.name or "attention", core.outputs[0]
    heads, hb, merged = len(cols["cols"][0]), cols["order"] == "hb", cols["merged"]
    mask = core.inputs[4] if len(core.inputs) > 4 and core.inputs[4].name else gs.Variable.empty()
    new = {"heads": heads, "dk": int(cols["dk"]), "dv": int(cols["dv"]), "q_cols": cols["cols"][0],
           "k_cols": cols["cols"][1], "v_cols": cols["cols"][2], "scale": float(attrs["scale"])}
    if mask.name:
        new.update(mask_value=float(attrs.get("mask_value", 0.0)), mask_on=int(attrs.get("mask_on", 1)),
                   mask_replace=int(attrs.get("mask_replace", 0)), mask_hb=int(hb))
        shape = shape_of(mask) or []
        if merged and len(shape) >= 3 and shape[-3] != 1:   # [.., B·H, S, L] → [B, H, S, L] (or [H, B, ..])
            regroup = add_constant(graph, f"{name}/mask_by_head", np.array([heads, -1] if hb else [-1, heads], np.int64))
            tail = add_constant(graph, f"{name}/mask_rows", np.array(shape[-2:], np.int64))
            (target,) = _op(graph, "Concat", [regroup, tail], {"axis": 0}, f"{name}/mask_shape", np.int64)
            (mask,) = _op(graph, "Reshape", [mask, target], {}, f"{name}/mask_by_head", np.bool_)
    perm = attrs.get("y_perm") or list(range(3 if merged else 4))
    if merged:   # the output's B·H axis → the kernel's (B, H) or (H, B)
        axes = {0: [1, 0] if hb else [0, 1], 1: [2], 2: [3]}
        y_perm = [a for p in perm for a in axes[p]]
    else:
        y_perm = [{0: 1, 1: 0}.get(p, p) for p in perm] if hb else list(perm)
    if y_perm != [0, 1, 2, 3]:
        new["y_perm"] = y_perm
    xkv = gs.Variable.empty() if read["xkv"] is read["xq"] else read["xkv"]
    w = add_constant(graph, f"{name}/projections", cols["w"])
    b = add_constant(graph, f"{name}/bias", cols["b"])
    (y,) = _op(graph, "TokenAttention", [read["xq"], xkv, w, b, mask], new, f"{name}/TokenAttention", np.float32,
               domain=kernels.DOMAIN, shape=None if merged else out.shape)
    ta = y.inputs[0]
    if merged:   # written [.., B, H, ..] → the output's [.., B·H, ..] (its T and dv as the tokens' and V's)
        at, sizes = perm.index(0), {1: (shape_of(read["xq"]) or [0, 0])[1], 2: int(cols["dv"])}
        target = add_constant(graph, f"{name}/merge", np.array(
            [0 if i < at else -1 if i == at else int(sizes[perm[i]]) for i in range(3)], np.int64))
        (y,) = _op(graph, "Reshape", [y, target], {}, f"{name}/merge", np.float32, shape=out.shape)
    replace_outputs(graph, core, [y])
    graph.nodes.remove(core)
    return ta


def _only_reader(t: gs.Tensor, graph: gs.Graph) -> gs.Node | None:
    """The one node reading t besides Shape nodes (None: another reader, or t an output of the graph)."""
    readers = [n for n in t.outputs if n.op != "Shape"]
    return readers[0] if len(readers) == 1 and not any(t is o for o in graph.outputs) else None


def _forward_layout(t: gs.Tensor, graph: gs.Graph) -> tuple[gs.Tensor, list[gs.Tensor]]:
    """From t forward through layout ops that are the only readers: the last value, and the values on the way."""
    passed = [t]
    for _ in range(16):
        n = _only_reader(t, graph)
        if not _layout(n) or n.inputs[0] is not t:
            break
        t = n.outputs[0]
        passed.append(t)
    return t, passed


def _output_projection(y: gs.Tensor, graph: gs.Graph, width: int):
    """What follows the attention's output y: the projection's input p, W_o [width, E], its bias, the value u the
    projected rows end in (after layout ops), and the values between whose shapes Shape nodes may read."""
    p, passed = _forward_layout(y, graph)
    proj = _only_reader(p, graph)
    w, b = layer_weights(proj) if proj is not None and proj.inputs[0] is p else (None, None)
    if w is None or w.ndim != 2 or w.dtype != np.float32 or w.shape[0] != width:
        return None
    bias, z = _bias(b, None, w.shape[1]), proj.outputs[0]
    add = _only_reader(z, graph)
    if add is not None and add.op == "Add" and not any(n.op == "Shape" for n in z.outputs):
        k = next((i for i in (0, 1) if const_value(add.inputs[i]) is not None), None)
        added = _bias(b, add.inputs[k], w.shape[1]) if k is not None and add.inputs[1 - k] is z else None
        if added is not None:
            bias, z = added, add.outputs[0]
    u, after = _forward_layout(z, graph)
    return p, w, bias, z, u, passed + after


def _row_order(rows: np.ndarray, B: int, T: int) -> str | None:
    """"bt" or "tb": the order of the (b, t) pairs `rows` [B·T, 2] lists."""
    b, t = np.meshgrid(np.arange(B), np.arange(T), indexing="ij")
    for order, pairs in (("bt", np.stack([b.ravel(), t.ravel()], 1)), ("tb", np.stack([b.T.ravel(), t.T.ravel()], 1))):
        if np.array_equal(rows, pairs):
            return order
    return None


def _projection_layout(ta: gs.Node, found, opset: int) -> dict | str:
    """Runs the layout ops from the kernel's output to W_o's input, and from W_o's output to u, on numbered values:
    W_o's rows by (head, column), the rows' order (b, t) or (t, b) and u's rank."""
    p, w, _, z, u, passed = found
    H, dv = ta.attrs["heads"], ta.attrs["dv"]
    perm = ta.attrs.get("y_perm") or [0, 1, 2, 3]
    inputs = [t for t in ta.inputs[:2] if t.name]   # the tokens: what shapes on the way may be read from
    T, width = (shape_of(inputs[0]) or [0, 0])[1], const_value(ta.inputs[2]).shape[0]
    T = T if isinstance(T, int) else PROBE_TOKENS
    sizes = {T, H, dv, H * dv, width, w.shape[1]}   # a batch of none of these sizes: no Shape is read as another's
    B = next((b for b in (5, 7, 11, 13, 17, 19, 23, 29, 31) if b not in sizes), 37)
    if B * H * T * dv >= 1 << 24:
        return "too many values to number exactly in float32"
    values = [np.random.default_rng(1).normal(size=(B, T, width)).astype(np.float32) for _ in inputs]
    code = np.transpose(np.arange(B * H * T * dv, dtype=np.float32).reshape(B, H, T, dv), perm)
    try:
        chain, after = Subgraph([p], [ta.outputs[0]] + inputs, opset), Subgraph([u], [z] + inputs, opset)
        if chain.unresolved or after.unresolved:
            return "the layout ops around the projection read values besides the tokens"
        pv = chain.run([code] + values)[0]
        if pv.shape[-1] != H * dv or pv.size != code.size:
            return "the heads are not merged into W_o's rows"
        idx = pv.reshape(-1, H * dv).astype(np.int64)
        b, h, t, c = idx // (H * T * dv), idx // (T * dv) % H, idx // dv % T, idx % dv
        if (b != b[:, :1]).any() or (t != t[:, :1]).any() or (h != h[:1]).any() or (c != c[:1]).any() or \
                len(set(zip(h[0], c[0]))) != H * dv:
            return "a row of W_o's input mixes tokens"
        zc = np.arange(pv.size // (H * dv) * w.shape[1], dtype=np.float32).reshape(pv.shape[:-1] + (w.shape[1],))
        uv = zc if u is z else after.run([zc] + values)[0]
        shaped = [v for v in passed if any(n.op == "Shape" for n in v.outputs)]
        if shaped and any(x.shape != uv.shape for x in Subgraph(shaped, [ta.outputs[0]] + inputs, opset).run(
                [code] + values)):
            return "a Shape node reads a value of another shape on the way"
    except Exception as e:   # noqa: BLE001  (onnxruntime's own errors: not this form)
        return f"the layout ops around the projection do not run alone ({str(e).splitlines()[0][:80]})"
    E = w.shape[1]
    first = uv.reshape(-1, E).astype(np.int64)
    if uv.shape[-1] != E or (first != first[:, :1] + np.arange(E)).any() or (first[:, 0] % E).any():
        return "the projected rows are not kept whole"
    order = _row_order(np.stack([b[:, 0], t[:, 0]], 1)[first[:, 0] // E], B, T)
    if order is None or uv.shape not in (((B, T) if order == "bt" else (T, B)) + (E,), (B * T, E)):
        return "the projected rows are not in (batch, token) or (token, batch) order"
    wo = np.zeros((H, dv, E), np.float32)
    wo[h[0], c[0]] = w
    return {"wo": wo.reshape(H * dv, E), "tb": order == "tb", "rank": uv.ndim}


def _residual(ta: gs.Node, u: gs.Tensor, layout: dict, graph: gs.Graph) -> gs.Node | None:
    """The Add of the tokens themselves to the projected rows u (a residual the kernel can add), or None."""
    add, xq, width = _only_reader(u, graph), ta.inputs[0], const_value(ta.inputs[2]).shape[0]   # w: [D, C]
    if add is None or add.op != "Add" or layout["tb"] or layout["rank"] != 3 or \
            {id(t) for t in add.inputs} != {id(u), id(xq)} or width != layout["wo"].shape[1]:
        return None
    return add


def _fold_output_projection(ta: gs.Node, graph: gs.Graph, opset: int) -> str:
    """The output projection that follows (the heads merged by layout ops, a Gemm or MatMul by W_o, its bias, layout
    ops) into the kernel: it writes the projected rows as the graph's next op reads them ([B, T, N] or [T, B, N]),
    and adds the tokens where that op is their residual Add. Why not, or ""."""
    found = _output_projection(ta.outputs[0], graph, ta.attrs["heads"] * ta.attrs["dv"])
    if found is None:
        return "no output projection follows"
    _, _, bias, _, u, passed = found
    layout = _projection_layout(ta, found, opset)
    if isinstance(layout, str):
        return layout
    name, N = ta.name, layout["wo"].shape[1]
    ta.attrs.pop("y_perm", None)
    ta.attrs["out_tb"] = int(layout["tb"])
    ta.inputs.extend([add_constant(graph, f"{name}/out_weights", layout["wo"]),
                      add_constant(graph, f"{name}/out_bias", bias)])
    add = _residual(ta, u, layout, graph)
    chain = passed + [u] + ([add.outputs[0]] if add is not None else [])
    if add is not None:
        ta.attrs["residual"] = 1
    final = chain[-1]
    for v in chain[:-1]:   # Shape nodes on the way read the same shape off the final value (measured)
        for n in [n for n in v.outputs if n.op == "Shape"]:
            n.inputs[0] = final
    final.inputs.clear()
    if layout["rank"] == 3:
        ta.outputs[0] = final
    else:   # written [B, T, N] ([T, B, N]): the rows of u [B·T, N] (in that order)
        ta.outputs[0].shape = None
        rows = add_constant(graph, f"{name}/rows", np.array([-1, N], np.int64))
        (out,) = _op(graph, "Reshape", [ta.outputs[0], rows], {}, f"{name}/rows", np.float32)
        out.inputs[0].outputs[0] = final
    return ""


def _op(graph: gs.Graph, op: str, inputs: list, attrs: dict, name: str, dtype, domain: str | None = None,
        shape=None) -> list[gs.Variable]:
    return add_node(graph, op, inputs, attrs, name=name, domain=domain, dtype=dtype, shape=shape)


@register_pass("token-attention", group="lower", targets=("ort",))
def token_attention(ctx: PassContext) -> None:
    """Attention whose Q, K and V project the tokens → ctropt's TokenAttention kernel (the projections in it, a row's
    work shared with the rows holding the same history), where user inputs are declared and its library loads."""
    if not ctx.options.get("user_inputs") or not kernels.ready(ctx, "token attention"):
        return
    annotate_shapes_if_bare(ctx.graph)
    for core in [n for n in ctx.graph.nodes if n.op == "AttentionCore" and n.domain == kernels.DOMAIN]:
        read = _read(core)
        cols = _columns(core, read, int(ctx.graph.opset or 17)) if isinstance(read, dict) else read
        if isinstance(cols, str):
            ctx.note(f"{core.name}: left as AttentionCore ({cols})")
            continue
        ta = _rewrite(core, read, cols, ctx.graph)
        ctx.count(1)
        why = _fold_output_projection(ta, ctx.graph, int(ctx.graph.opset or 17))
        if why:
            ctx.note(f"{core.name}: the output projection left apart ({why})")
    if ctx.rewrites:
        ctx.graph.cleanup().toposort()   # the projections and their layouts, read by nothing now
