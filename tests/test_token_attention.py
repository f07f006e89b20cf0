"""token-attention: self-attention whose Q, K and V are projections of the tokens → ctropt's TokenAttention kernel,
which projects in the kernel and reuses a row's work for the rows after it that share most of its tokens (one
user's history, each candidate's own token); the kernel against numpy, rows shared or not, masks of each form."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from helpers import F, init, kernel_session, make_model, node, ops, run_pass, vi

import ctropt
from ctropt import kernels
from ctropt.runtime import run_model

RNG = np.random.default_rng(11)
B, T, D, H, DK, DV = 40, 9, 10, 2, 4, 5


@pytest.fixture(autouse=True)
def _library():
    if not kernels.available() and kernels.ensure():
        pytest.skip("ctropt's kernel library cannot be built here")


def reference(xq, xkv, w, b, cols, scale, mask=None, value=0.0, on=1, replace=0, hb=False, dv=DV):
    """numpy in float64: per row and head, softmax(scale·q·kᵀ, masked) · v."""
    proj = xq.astype(np.float64) @ w + b, xkv.astype(np.float64) @ w + b
    q = np.stack([proj[0][..., c:c + DK] for c in cols[0]], 1)
    k = np.stack([proj[1][..., c:c + DK] for c in cols[1]], 1)
    v = np.stack([proj[1][..., c:c + dv] for c in cols[2]], 1)
    s = scale * q @ np.swapaxes(k, -1, -2)
    if mask is not None:
        m = np.broadcast_to(np.swapaxes(mask, 0, 1) if hb else mask, s.shape) if mask.ndim == 4 else \
            np.broadcast_to(mask, s.shape)
        hit = (m != 0) == bool(on)
        s = np.where(hit, value, s) if replace else np.where(hit, s + value, s)
    with np.errstate(invalid="ignore"):
        e = np.exp(s - s.max(-1, keepdims=True))
        return (e / e.sum(-1, keepdims=True)) @ v


def run_kernel(feeds, attrs, with_kv=False, mask_shape=None, threads=2):
    projected = "wo" in feeds
    names = ["xq", "xkv" if with_kv else "", "w", "b", "mask" if mask_shape else ""] + \
        (["wo", "bo"] if projected else [])
    while not names[-1]:
        names.pop()
    inputs = [vi("xq", F, ["b", None, D]), vi("w", F, [D, None]), vi("b", F, [None])]
    if with_kv:
        inputs.append(vi("xkv", F, ["b", None, D]))
    if mask_shape:
        inputs.append(vi("mask", onnx.TensorProto.BOOL, mask_shape))
    if projected:
        inputs += [vi("wo", F, [None, None]), vi("bo", F, [None])]
    session = kernel_session([onnx.helper.make_node("TokenAttention", names, ["y"], domain=kernels.DOMAIN, **attrs)],
                             inputs, threads=threads)
    return session.run(None, {k: v for k, v in feeds.items() if k in [i.name for i in inputs]})[0]


def one_user(shape, own=(T - 1,), users=1):
    """Rows whose tokens equal the first row of their user's except at `own` (the candidate's), `users` users in
    turn."""
    x = RNG.normal(size=shape).astype(np.float32)
    for r in range(shape[0]):
        keep = [t for t in range(T) if t not in own]
        x[r, keep] = x[r % users, keep]
    return x


@pytest.mark.parametrize("case", ["one-user", "two-users", "first-token", "two-own", "all-differ", "key-padding",
                                  "replace", "empty-history", "mask-per-head-hb", "own-kv", "perm", "rows",
                                  "rows-masked", "many-heads", "projected", "projected-residual-tb",
                                  "projected-two-own", "three-heads", "projected-three-heads-masked",
                                  "mask-one-head-empty"])
def test_the_kernel_matches_numpy(case):
    """The row-ordered cases write y as [B, T, H, dv] in whole vectors (the heads' values of a query one row);
    many-heads has more heads than a vector's lanes, three-heads heads that do not divide them; the others write
    through a scratch row. The projected ones write [B, T, N] (or [T, B, N]): the heads merged, times wo, plus bo
    (and the token itself). mask-one-head-empty masks every key of one head's query: NaN there only."""
    own = (0,) if case == "first-token" else (T - 2, T - 1) if case.endswith("two-own") else (T - 1,)
    xq = one_user((B, T, D), own, users=2 if case == "two-users" else 1)
    if case == "all-differ":
        xq = RNG.normal(size=(B, T, D)).astype(np.float32)
    xkv = one_user((B, T, D), own) if case == "own-kv" else xq
    heads, dv = (2, 4) if case.startswith("rows") else (9, 3) if case == "many-heads" else \
        (3, 4) if "three-heads" in case else (H, DV)
    C = 2 * heads * DK + heads * dv + 2
    w, b = RNG.normal(size=(D, C)).astype(np.float32), RNG.normal(size=C).astype(np.float32)
    cols = [[h * DK for h in range(heads)], [(heads + h) * DK + 1 for h in range(heads)],   # heads apart, columns
            [2 * heads * DK + 2 + h * dv for h in range(heads)]]                             # between
    attrs = {"heads": heads, "dk": DK, "dv": dv, "q_cols": cols[0], "k_cols": cols[1], "v_cols": cols[2],
             "scale": 0.4}
    feeds, mask_shape, ref_mask = {"xq": xq, "xkv": xkv, "w": w, "b": b}, None, {}
    lengths = np.where(np.arange(B) % 3 == 0, T, 5)
    if case in ("key-padding", "replace", "empty-history", "rows-masked", "projected-three-heads-masked"):
        valid = np.arange(T)[None] < (lengths if case != "empty-history" else np.zeros(B, int))[:, None]
        valid[:, list(own)] = case != "empty-history"
        feeds["mask"] = valid[:, None, None, :]
        mask_shape = [B, 1, 1, T]
        attrs.update(mask_value=-1e9 if case == "replace" else -np.inf, mask_on=0, mask_replace=int(case == "replace"))
        ref_mask = dict(mask=feeds["mask"], value=attrs["mask_value"], on=0, replace=attrs["mask_replace"])
    if case == "mask-per-head-hb":
        m = RNG.random((H, 1, T, T)) < 0.3
        m[..., 0] = False
        feeds["mask"] = np.broadcast_to(m, (H, B, T, T)).copy()
        mask_shape = [H, B, T, T]
        attrs.update(mask_value=-np.inf, mask_on=1, mask_hb=1)
        ref_mask = dict(mask=feeds["mask"], value=-np.inf, on=1, hb=True)
    if case == "mask-one-head-empty":   # head 0's query 2 sees no key; head 1 keeps key 0
        m = RNG.random((1, H, T, T)) < 0.3
        m[:, 1, :, 0], m[:, 0, 2, :] = False, True
        feeds["mask"] = np.broadcast_to(m, (B, H, T, T)).copy()
        mask_shape = [B, H, T, T]
        attrs.update(mask_value=-np.inf, mask_on=1)
        ref_mask = dict(mask=feeds["mask"], value=-np.inf, on=1)
    perm = [2, 0, 1, 3] if case == "perm" else [0, 2, 1, 3] if case.startswith("rows") or case == "three-heads" \
        else None
    if perm:
        attrs["y_perm"] = perm
    if case.startswith("projected"):
        N = D if "residual" in case else 13
        feeds.update(wo=RNG.normal(size=(heads * dv, N)).astype(np.float32), bo=RNG.normal(size=N).astype(np.float32))
        attrs.update(out_tb=int(case.endswith("tb")), residual=int("residual" in case))
    got = run_kernel(feeds, attrs, with_kv=case == "own-kv", mask_shape=mask_shape)
    want = reference(xq, xkv, w, b, cols, 0.4, **ref_mask, dv=dv)
    if perm:
        want = np.transpose(want, perm)
    if case.startswith("projected"):
        want = np.transpose(want, [0, 2, 1, 3]).reshape(B, T, heads * dv) @ feeds["wo"] + feeds["bo"]
        want = want + (xq if attrs["residual"] else 0)
        want = np.swapaxes(want, 0, 1) if attrs["out_tb"] else want
    assert got.shape == want.shape
    assert np.array_equal(np.isnan(got), np.isnan(want)) and \
        np.isnan(got).any() == (case in ("empty-history", "mask-one-head-empty"))
    np.testing.assert_allclose(np.nan_to_num(got), np.nan_to_num(want), atol=3e-5, rtol=1e-4)


@pytest.mark.parametrize("users", [1, 3])
def test_the_same_bits_at_any_thread_count_and_run(users):
    """Which rows follow which anchor follows from the rows alone: 1 and 2 threads, run after run, give the same
    bits (issue 47: it depended on which block finished first)."""
    rows = 203
    xq = RNG.normal(size=(rows, T, D)).astype(np.float32)
    for r in range(rows):
        xq[r, :T - 1] = xq[r % users, :T - 1]
    C = 2 * H * DK + H * DV
    feeds = {"xq": xq, "w": RNG.normal(size=(D, C)).astype(np.float32), "b": RNG.normal(size=C).astype(np.float32)}
    attrs = {"heads": H, "dk": DK, "dv": DV, "q_cols": [0, DK], "k_cols": [2 * DK, 3 * DK],
             "v_cols": [4 * DK, 4 * DK + DV], "scale": 0.4}
    first = run_kernel(feeds, attrs, threads=1)
    for threads in (1, 2, 2, 2):
        assert np.array_equal(run_kernel(feeds, attrs, threads=threads), first)


def test_an_empty_batch_gives_an_empty_output():
    C = 2 * H * DK + H * DV
    feeds = {"xq": np.zeros((0, T, D), np.float32), "w": RNG.normal(size=(D, C)).astype(np.float32),
             "b": np.zeros(C, np.float32)}
    attrs = {"heads": H, "dk": DK, "dv": DV, "q_cols": [0, DK], "k_cols": [2 * DK, 3 * DK],
             "v_cols": [4 * DK, 4 * DK + DV], "scale": 0.4}
    assert run_kernel(feeds, attrs).shape == (0, H, T, DV)


def test_more_tokens_than_a_row_can_share_are_computed_in_full():
    """Past 64 tokens the shared set no longer fits the kernel's bitmask: every row in full, still numpy's."""
    long = 70
    x = RNG.normal(size=(4, long, D)).astype(np.float32)
    x[:, :-1] = x[0, :-1]
    w, b = RNG.normal(size=(D, 2 * H * DK + H * DV)).astype(np.float32), np.zeros(2 * H * DK + H * DV, np.float32)
    cols = [[0, DK], [2 * DK, 3 * DK], [4 * DK, 4 * DK + DV]]
    attrs = {"heads": H, "dk": DK, "dv": DV, "q_cols": cols[0], "k_cols": cols[1], "v_cols": cols[2], "scale": 0.4}
    got = run_kernel({"xq": x, "w": w, "b": b}, attrs)
    np.testing.assert_allclose(got, reference(x, x, w, b, cols, 0.4), atol=3e-5, rtol=1e-4)


# The pass, on a small graph per dialect: the attention as the exporter writes it, made an AttentionCore by
# attention-core-kernel first (as the pipeline does), then token-attention with user inputs declared.
TOK, WIDTH, HEADS, DEPTH = 7, 8, 2, 4   # tokens, token width, heads, head depth


def _w(shape, seed):
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def paddle_three_projections():
    """paddle2onnx (PaddleRec BST): three MatMul + Add of the tokens [B, T, D], heads split by Reshape [0, 0, H, d]
    and Transpose (0, 2, 1, 3); no mask; the heads merged back by Transpose and Reshape."""
    nodes = []
    for x in "qkv":
        nodes += [node("MatMul", ["x", f"w{x}"], [f"{x}p"]), node("Add", [f"{x}p", f"b{x}"], [f"{x}b"]),
                  node("Reshape", [f"{x}b", "heads"], [f"{x}h"]),
                  node("Transpose", [f"{x}h"], [f"{x}t"], perm=[0, 2, 3, 1] if x == "k" else [0, 2, 1, 3])]
    nodes += [node("MatMul", ["qt", "kt"], ["s"]), node("Mul", ["s", "scale"], ["ss"]),
              node("Softmax", ["ss"], ["p"], axis=-1), node("MatMul", ["p", "vt"], ["o"]),
              node("Transpose", ["o"], ["ot"], perm=[0, 2, 1, 3]), node("Reshape", ["ot", "merge"], ["y"])]
    inits = [init(f"w{x}", _w((WIDTH, WIDTH), i)) for i, x in enumerate("qkv")] + \
        [init(f"b{x}", _w((WIDTH,), 9 + i)) for i, x in enumerate("qkv")] + \
        [init("heads", np.array([0, 0, HEADS, DEPTH], np.int64)), init("scale", np.array(0.5, np.float32)),
         init("merge", np.array([0, 0, WIDTH], np.int64))]
    return make_model(nodes, [vi("x", F, ["b", TOK, WIDTH])], [vi("y", F, ["b", TOK, WIDTH])], inits)


def torch_packed_sequence_first():
    """torch nn.MultiheadAttention (FuxiCTR BST, dynamo): the tokens transposed to [T, B, D], one packed projection,
    Q, K and V a Gather each out of [T, B, 3, D], heads split into the batch [T, B·H, d]; a [B·H, T, T] boolean mask
    as Where(m, -inf, 0); the heads merged back by a Transpose."""
    nodes = [node("Transpose", ["x"], ["xs"], perm=[1, 0, 2]), node("MatMul", ["xs", "w"], ["p"]),
             node("Add", ["p", "bias"], ["pb"]), node("Reshape", ["pb", "packed"], ["p4"])]
    for c, x in enumerate("qkv"):
        nodes += [node("Gather", ["p4", f"i{c}"], [f"{x}g"], axis=2), node("Reshape", [f"{x}g", "heads"], [f"{x}h"])]
    nodes += [node("Transpose", ["qh"], ["qt"], perm=[1, 0, 2]), node("Transpose", ["kh"], ["kt"], perm=[1, 2, 0]),
              node("Transpose", ["vh"], ["vt"], perm=[1, 0, 2]), node("Mul", ["qt", "scale"], ["qs"]),
              node("MatMul", ["qs", "kt"], ["s"]), node("Where", ["m", "minf", "zero"], ["bias_m"]),
              node("Add", ["s", "bias_m"], ["sb"]), node("Softmax", ["sb"], ["pr"], axis=-1),
              node("MatMul", ["pr", "vt"], ["o"]), node("Transpose", ["o"], ["y"], perm=[1, 0, 2])]
    inits = [init("w", _w((WIDTH, 3 * WIDTH), 1)), init("bias", _w((3 * WIDTH,), 2)),
             init("packed", np.array([TOK, -1, 3, WIDTH], np.int64)), init("heads", np.array([TOK, -1, DEPTH], np.int64)),
             init("scale", np.array(0.5, np.float32)), init("minf", np.array(-np.inf, np.float32)),
             init("zero", np.array(0.0, np.float32))] + [init(f"i{c}", np.array(c, np.int64)) for c in range(3)]
    inputs = [vi("x", F, ["b", TOK, WIDTH]), vi("m", onnx.TensorProto.BOOL, ["bh", TOK, TOK])]
    return make_model(nodes, inputs, [vi("y", F, [TOK, "bh", DEPTH])], inits)


def torch_heads_merged_into_batch():
    """torch's legacy MultiheadAttention with its projections apart: each [T, B, D] reshaped to [T, B·H, d], the
    heads merged into the batch axis as one (the kernel's heads [1, B·H]); a [B·H, T, T] mask; merged back by a
    Transpose to [T, B·H, d]."""
    nodes = [node("Transpose", ["x"], ["xs"], perm=[1, 0, 2])]
    for x in "qkv":
        nodes += [node("MatMul", ["xs", f"w{x}"], [f"{x}p"]), node("Add", [f"{x}p", f"b{x}"], [f"{x}b"]),
                  node("Reshape", [f"{x}b", "heads"], [f"{x}h"])]
    nodes += [node("Transpose", ["qh"], ["qt"], perm=[1, 0, 2]), node("Transpose", ["kh"], ["kt"], perm=[1, 2, 0]),
              node("Transpose", ["vh"], ["vt"], perm=[1, 0, 2]), node("MatMul", ["qt", "kt"], ["s"]),
              node("Where", ["m", "minf", "zero"], ["bias_m"]), node("Add", ["s", "bias_m"], ["sb"]),
              node("Softmax", ["sb"], ["pr"], axis=-1), node("MatMul", ["pr", "vt"], ["o"]),
              node("Transpose", ["o"], ["y"], perm=[1, 0, 2])]
    inits = [init(f"w{x}", _w((WIDTH, WIDTH), i)) for i, x in enumerate("qkv")] + \
        [init(f"b{x}", _w((WIDTH,), 9 + i)) for i, x in enumerate("qkv")] + \
        [init("heads", np.array([TOK, -1, DEPTH], np.int64)), init("minf", np.array(-np.inf, np.float32)),
         init("zero", np.array(0.0, np.float32))]
    inputs = [vi("x", F, ["b", TOK, WIDTH]), vi("m", onnx.TensorProto.BOOL, ["bh", TOK, TOK])]
    return make_model(nodes, inputs, [vi("y", F, [TOK, "bh", DEPTH])], inits)


def tf_two_token_tensors():
    """deepctr (tf2onnx): queries from x + p_q, keys and values from x + p_k, MatMuls without bias, heads stacked on
    the batch axis (concat(split(., H, -1), 0)) and merged back (concat(split(., H, 0), -1))."""
    nodes = [node("Add", ["x", "pq"], ["xq"]), node("Add", ["x", "pk"], ["xk"]),
             node("MatMul", ["xq", "wq"], ["q"]), node("MatMul", ["xk", "wk"], ["k"]), node("MatMul", ["xk", "wv"], ["v"])]
    for x in "qkv":
        nodes += [node("Split", [x, "sizes"], [f"{x}{h}" for h in range(HEADS)], axis=-1),
                  node("Concat", [f"{x}{h}" for h in range(HEADS)], [f"{x}s"], axis=0)]
    nodes += [node("Transpose", ["ks"], ["kt"], perm=[0, 2, 1]), node("MatMul", ["qs", "kt"], ["s"]),
              node("Mul", ["s", "scale"], ["ss"]), node("Softmax", ["ss"], ["p"], axis=-1),
              node("MatMul", ["p", "vs"], ["o"]), node("Split", ["o", "parts"], [f"o{h}" for h in range(HEADS)], axis=0),
              node("Concat", [f"o{h}" for h in range(HEADS)], ["y"], axis=-1)]
    inits = [init("pq", _w((1, TOK, WIDTH), 1)), init("pk", _w((1, TOK, WIDTH), 2))] + \
        [init(f"w{x}", _w((WIDTH, WIDTH), 3 + i)) for i, x in enumerate("qkv")] + \
        [init("sizes", np.array([DEPTH] * HEADS, np.int64)), init("scale", np.array(0.5, np.float32)),
         init("parts", np.array([3] * HEADS, np.int64))]
    return make_model(nodes, [vi("x", F, ["b", TOK, WIDTH])], [vi("y", F, ["b", TOK, WIDTH])], inits)


def one_head_residual():
    """One head on rank-3 values (AutoInt-like, or a 1-head transformer): Q, K, V = x·W + b of [B, T, D], the
    output added to x (its rank must stay 3)."""
    nodes = []
    for x in "qkv":
        nodes += [node("MatMul", ["x", f"w{x}"], [f"{x}p"]), node("Add", [f"{x}p", f"b{x}"], [x])]
    nodes += [node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]), node("MatMul", ["q", "kt"], ["s"]),
              node("Mul", ["s", "scale"], ["ss"]), node("Softmax", ["ss"], ["p"], axis=-1),
              node("MatMul", ["p", "v"], ["o"]), node("Add", ["o", "x"], ["y"])]
    inits = [init(f"w{x}", _w((WIDTH, WIDTH), i)) for i, x in enumerate("qkv")] + \
        [init(f"b{x}", _w((WIDTH,), 9 + i)) for i, x in enumerate("qkv")] + [init("scale", np.array(0.3, np.float32))]
    return make_model(nodes, [vi("x", F, ["b", TOK, WIDTH])], [vi("y", F, ["b", TOK, WIDTH])], inits)


def _feeds(model, rows, one_user):
    x = RNG.normal(size=(rows, TOK, WIDTH)).astype(np.float32)
    if one_user:   # one user's history, each row's own last token
        x[:, :-1] = x[0, :-1]
    f = {"x": x}
    if any(i.name == "m" for i in model.graph.input):
        lengths = np.where(np.arange(rows) % 2 == 0, TOK, 3)
        valid = np.arange(TOK)[None] < lengths[:, None]
        f["m"] = np.repeat(~valid[:, None, :], HEADS, axis=0).repeat(TOK, axis=1).reshape(rows * HEADS, TOK, TOK)
    return f


@pytest.mark.parametrize("dialect", [paddle_three_projections, torch_packed_sequence_first,
                                     torch_heads_merged_into_batch, tf_two_token_tensors, one_head_residual])
def test_attention_of_projected_tokens_becomes_token_attention(dialect):
    """Each dialect's attention → one TokenAttention reading the tokens (no projection left), the same outputs on
    one-user rows and on rows all different, and a second run changes nothing."""
    model = dialect()
    core, _ = run_pass(model, "attention-core-kernel")
    done, ctx = run_pass(core, "token-attention", user_inputs="x")
    assert ctx.rewrites == 1 and ops(done).count("TokenAttention") == 1, ctx.notes
    assert not {"AttentionCore", "MatMul", "Gemm", "Softmax"} & set(ops(done)), ops(done)
    rows = 3 if dialect is tf_two_token_tensors else 6
    for one_user in (True, False):
        f = _feeds(model, rows, one_user)
        want, got = run_model(model, f), run_model(done, f)
        for k in want:
            np.testing.assert_allclose(got[k], want[k], atol=2e-5, rtol=1e-4)
    again, ctx2 = run_pass(done, "token-attention", user_inputs="x")
    assert ctx2.rewrites == 0 and ops(again) == ops(done)
    assert ctropt.graph.interface(done) == ctropt.graph.interface(model)


def projected(dialect, form):
    """The dialect's attention followed by its output projection as exporters write it: "paddle" a MatMul, the bias
    added, then the residual x added; "torch" (nn.MultiheadAttention, sequence first) [T, B, D] → Reshape [T·B, D]
    → Gemm → Reshape [T, B, D] → Transpose to [B, T, D]; "tf" a MatMul without bias."""
    model = dialect()
    g = model.graph
    g.output[0].name = "z"
    del g.output[0].type.tensor_type.shape.dim[:]
    if form == "paddle":
        nodes = [node("MatMul", ["y", "wo"], ["yo"]), node("Add", ["yo", "bo"], ["yb"]), node("Add", ["yb", "x"], ["z"])]
        inits = [init("wo", _w((WIDTH, WIDTH), 20)), init("bo", _w((WIDTH,), 21))]
    elif form == "torch":
        nodes = [node("Reshape", ["y", "rows"], ["yr"]), node("Gemm", ["yr", "wo", "bo"], ["yo"], transB=1),
                 node("Reshape", ["yo", "tbd"], ["yt"]), node("Transpose", ["yt"], ["z"], perm=[1, 0, 2])]
        inits = [init("wo", _w((WIDTH, WIDTH), 20)), init("bo", _w((WIDTH,), 21)),
                 init("rows", np.array([-1, WIDTH], np.int64)), init("tbd", np.array([TOK, -1, WIDTH], np.int64))]
    elif form == "torch-rows":   # the projected rows [T·B, D] are the graph's output: (t, b) order, rank 2
        nodes = [node("Reshape", ["y", "rows"], ["yr"]), node("Gemm", ["yr", "wo", "bo"], ["z"], transB=1)]
        inits = [init("wo", _w((WIDTH, WIDTH), 20)), init("bo", _w((WIDTH,), 21)),
                 init("rows", np.array([-1, WIDTH], np.int64))]
    elif form == "paddle-shape":   # a Transpose to [T, B, D] whose shape, read by a Shape node, is the target after
        nodes = [node("Transpose", ["y"], ["yt"], perm=[1, 0, 2]), node("Shape", ["yt"], ["dims"]),
                 node("Reshape", ["yt", "rows"], ["yr"]), node("Gemm", ["yr", "wo", "bo"], ["yo"]),
                 node("Reshape", ["yo", "dims"], ["z"])]
        inits = [init("wo", _w((WIDTH, WIDTH), 20)), init("bo", _w((WIDTH,), 21)),
                 init("rows", np.array([-1, WIDTH], np.int64))]
    else:
        nodes, inits = [node("MatMul", ["y", "wo"], ["z"])], [init("wo", _w((WIDTH, WIDTH), 20))]
    g.node.extend(nodes)
    g.initializer.extend(inits)
    return model


@pytest.mark.parametrize("dialect,form", [(paddle_three_projections, "paddle"), (torch_packed_sequence_first, "torch"),
                                          (torch_heads_merged_into_batch, "torch"), (tf_two_token_tensors, "tf"),
                                          (torch_packed_sequence_first, "torch-rows"),
                                          (paddle_three_projections, "paddle-shape")])
def test_the_output_projection_goes_into_the_kernel(dialect, form):
    """The output projection that follows, in each exporter's form (a MatMul and its bias; torch's sequence-first
    Reshape, Gemm, Reshape and Transposes; rows of rank 2), goes into the kernel, which writes the projected rows as
    the graph reads them ([B, T, D], or [T, B, D] with out_tb) and adds the residual tokens where they are added next
    (paddle). Same outputs; idempotent."""
    model = projected(dialect, form)
    core, _ = run_pass(model, "attention-core-kernel")
    done, ctx = run_pass(core, "token-attention", user_inputs="x")
    assert ctx.rewrites == 1 and not any("left apart" in n for n in ctx.notes), ctx.notes
    ta = next(n for n in done.graph.node if n.op_type == "TokenAttention")
    last = next(n for n in done.graph.node if "z" in n.output)   # rank 2: a Reshape of the kernel's [T, B, D]
    assert last is ta or (form == "torch-rows" and last.op_type == "Reshape" and last.input[0] == ta.output[0])
    assert not {"Gemm", "MatMul", "Transpose"} & set(ops(done)), ops(done)
    attrs = {a.name: a.i for a in ta.attribute if a.type == onnx.AttributeProto.INT}
    assert attrs["out_tb"] == (form in ("torch-rows", "paddle-shape")) and \
        attrs.get("residual", 0) == (form == "paddle") and len(ta.input) == 7, attrs
    rows = 3 if dialect is tf_two_token_tensors else 6
    for one_user in (True, False):
        f = _feeds(model, rows, one_user)
        want, got = run_model(model, f), run_model(done, f)
        np.testing.assert_allclose(got["z"], want["z"], atol=5e-5, rtol=1e-4)
    again, ctx2 = run_pass(done, "token-attention", user_inputs="x")
    assert ctx2.rewrites == 0 and ops(again) == ops(done)
    assert ctropt.graph.interface(done) == ctropt.graph.interface(model)


def test_only_where_user_inputs_are_declared():
    """Without --user-inputs the requests are not one user's: the AttentionCore stays."""
    core, _ = run_pass(paddle_three_projections(), "attention-core-kernel")
    done, ctx = run_pass(core, "token-attention")
    assert ctx.rewrites == 0 and "AttentionCore" in ops(done)


def test_a_value_that_is_not_a_projection_stays_with_its_reason():
    """Q, K and V given as inputs (no projection of tokens in the graph): left as AttentionCore, with a note."""
    nodes = [node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]), node("MatMul", ["q", "kt"], ["s"]),
             node("Softmax", ["s"], ["p"], axis=-1), node("MatMul", ["p", "v"], ["y"])]
    model = make_model(nodes, [vi(x, F, ["b", TOK, DEPTH]) for x in "qkv"], [vi("y", F, ["b", TOK, DEPTH])])
    core, _ = run_pass(model, "attention-core-kernel")
    done, ctx = run_pass(core, "token-attention", user_inputs="q")
    assert ctx.rewrites == 0 and any("not a projection of tokens" in n for n in ctx.notes)
