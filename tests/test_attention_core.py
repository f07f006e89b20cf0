"""attention-core-kernel: softmax(s · Q·Kᵀ + bias) · V → ctropt's AttentionCore kernel, in the dialects of torch
(legacy: scaled Q; SDPA: √s on Q and on Kᵀ; a bias made from a key-padding or causal mask), FuxiCTR AutoInt (Div of
the scores), tf2onnx (a subtracted bias, Kᵀ given) and paddle2onnx (no scale); the kernel against numpy."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from helpers import F, init, make_model, node, ops, run_pass, vi

import ctropt
from ctropt import kernels
from ctropt.runtime import run_model

RNG = np.random.default_rng(7)
B, H, L, DK, DV = 3, 2, 11, 6, 10


def reference(q, k, v, scale, bias=None, bias_scale=1.0):
    s = scale * q.astype(np.float64) @ np.swapaxes(k.astype(np.float64), -1, -2)
    if bias is not None:
        s = s + bias_scale * bias
    e = np.exp(s - s.max(-1, keepdims=True))
    return (e / e.sum(-1, keepdims=True)) @ v


def qkv_inputs(rank=4):
    lead = ["batch", H][: rank - 2]
    return [vi("q", F, lead + [L, DK]), vi("k", F, lead + [L, DK]), vi("v", F, lead + [L, DV])]


def feeds(rank=4, bias_shape=None, lengths=None):
    lead = [B, H][: rank - 2]
    f = {"q": RNG.normal(size=lead + [L, DK]).astype(np.float32), "k": RNG.normal(size=lead + [L, DK]).astype(np.float32),
         "v": RNG.normal(size=lead + [L, DV]).astype(np.float32)}
    if bias_shape is not None:
        f["bias"] = RNG.normal(size=bias_shape).astype(np.float32)
    if lengths is not None:
        f["lengths"] = np.asarray(lengths, np.int64)
    return f


def torch_legacy():
    """nn.MultiheadAttention (legacy): Q scaled, K transposed, an additive mask, softmax, · V."""
    nodes = [node("Mul", ["q", "s"], ["qs"]), node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             node("MatMul", ["qs", "kt"], ["qk"]), node("Add", ["qk", "bias"], ["x"]),
             node("Softmax", ["x"], ["p"], axis=-1), node("MatMul", ["p", "v"], ["y"])]
    return make_model(nodes, qkv_inputs() + [vi("bias", F, ["batch", 1, L, L])], [vi("y", F, ["batch", H, L, DV])],
                      [init("s", np.array(DK ** -0.5, np.float32))])


def torch_sdpa_key_padding():
    """SDPA (dynamo): √s on Q and on Kᵀ; the bias a Where over a key-padding mask built from lengths."""
    nodes = [node("Mul", ["q", "r"], ["qs"]), node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             node("Mul", ["kt", "r"], ["kts"]), node("MatMul", ["qs", "kts"], ["qk"]),
             node("Range", ["zero", "len", "one"], ["pos"]), node("Unsqueeze", ["lengths", "ax1"], ["l2"]),
             node("Less", ["pos", "l2"], ["valid"]), node("Reshape", ["valid", "shape4"], ["valid4"]),
             node("Where", ["valid4", "fzero", "minf"], ["bias"]), node("Add", ["qk", "bias"], ["x"]),
             node("Softmax", ["x"], ["p"], axis=3), node("MatMul", ["p", "v"], ["y"])]
    inits = [init("r", np.array(DK ** -0.25, np.float32)), init("zero", np.array(0, np.int64)),
             init("len", np.array(L, np.int64)), init("one", np.array(1, np.int64)), init("ax1", np.array([1], np.int64)),
             init("shape4", np.array([-1, 1, 1, L], np.int64)), init("fzero", np.array(0.0, np.float32)),
             init("minf", np.array(-np.inf, np.float32))]
    return make_model(nodes, qkv_inputs() + [vi("lengths", onnx.TensorProto.INT64, ["batch"])],
                      [vi("y", F, ["batch", H, L, DV])], inits)


def autoint():
    """FuxiCTR AutoInt: the scores divided by √dk, no mask, [B, H, fields, d]."""
    nodes = [node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]), node("MatMul", ["q", "kt"], ["qk"]),
             node("Div", ["qk", "c"], ["x"]), node("Softmax", ["x"], ["p"], axis=-1), node("MatMul", ["p", "v"], ["y"])]
    return make_model(nodes, qkv_inputs(), [vi("y", F, ["batch", H, L, DV])], [init("c", np.array(DK ** 0.5, np.float32))])


def tf2onnx_subtracted():
    """tf2onnx (Keras-style, [B·H, L, d]): Kᵀ given as a value, (1 - mask)·10000 subtracted, default axis."""
    nodes = [node("MatMul", ["q", "kt"], ["qk"]), node("Mul", ["qk", "s"], ["qks"]), node("Sub", ["one", "m"], ["inv"]),
             node("Mul", ["inv", "big"], ["pen"]), node("Sub", ["qks", "pen"], ["x"]), node("Softmax", ["x"], ["p"]),
             node("MatMul", ["p", "v"], ["y"])]
    inputs = [vi("q", F, ["n", L, DK]), vi("kt", F, ["n", DK, L]), vi("v", F, ["n", L, DV]), vi("m", F, ["n", 1, L])]
    inits = [init("s", np.array(0.3, np.float32)), init("one", np.array(1.0, np.float32)),
             init("big", np.array(10000.0, np.float32))]
    return make_model(nodes, inputs, [vi("y", F, ["n", L, DV])], inits, opset=13)


def paddle_unscaled():
    """paddle2onnx: MatMul of Q and a transposed K, the softmax straight on it."""
    nodes = [node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]), node("MatMul", ["q", "kt"], ["x"]),
             node("Softmax", ["x"], ["p"], axis=-1), node("MatMul", ["p", "v"], ["y"])]
    return make_model(nodes, qkv_inputs(), [vi("y", F, ["batch", H, L, DV])])


def torch_sequence_first():
    """nn.MultiheadAttention (dynamo, batch_first=False): Q, K, V made [N, L, d] from [L, N, d] by Transposes, Kᵀ by
    one straight to [N, d, L]; the mask a bias per head; the result back to [L, N, d]."""
    nodes = [node("Transpose", ["q"], ["qn"], perm=[1, 0, 2]), node("Mul", ["qn", "s"], ["qs"]),
             node("Transpose", ["k"], ["kt"], perm=[1, 2, 0]), node("MatMul", ["qs", "kt"], ["qk"]),
             node("Add", ["qk", "bias"], ["x"]), node("Softmax", ["x"], ["p"], axis=-1),
             node("Transpose", ["v"], ["vn"], perm=[1, 0, 2]), node("MatMul", ["p", "vn"], ["o"]),
             node("Transpose", ["o"], ["y"], perm=[1, 0, 2])]
    inputs = [vi("q", F, [L, "n", DK]), vi("k", F, [L, "n", DK]), vi("v", F, [L, "n", DV]), vi("bias", F, ["n", L, L])]
    return make_model(nodes, inputs, [vi("y", F, [L, "n", DV])], [init("s", np.array(0.4, np.float32))])


def tf_feeds():
    m = (RNG.random((B * H, 1, L)) < 0.6).astype(np.float32)
    return {"q": RNG.normal(size=(B * H, L, DK)).astype(np.float32),
            "kt": RNG.normal(size=(B * H, DK, L)).astype(np.float32),
            "v": RNG.normal(size=(B * H, L, DV)).astype(np.float32), "m": m}


def _perm(core, key):
    return next((list(a.ints) for a in core.attribute if a.name == key), None)


def _check(model, f, k_perm=None):
    done, ctx = run_pass(model, "attention-core-kernel")
    assert ctx.rewrites == 1 and ops(done).count("AttentionCore") == 1
    assert "Softmax" not in ops(done) and "MatMul" not in ops(done), ops(done)
    core = next(n for n in done.graph.node if n.op_type == "AttentionCore")
    assert _perm(core, "k_perm") == k_perm   # K read through Kᵀ's layout, with no Transpose run
    want, got = run_model(model, f), run_model(done, f)
    for a, b in ((want[k], got[k]) for k in want):
        assert np.array_equal(np.isnan(a), np.isnan(b))
        np.testing.assert_allclose(np.nan_to_num(b), np.nan_to_num(a), atol=2e-6, rtol=1e-5)
    again, ctx2 = run_pass(done, "attention-core-kernel")
    assert ctx2.rewrites == 0 and ops(again) == ops(done)
    assert ctropt.graph.interface(done) == ctropt.graph.interface(model)
    return done


@pytest.fixture(autouse=True)
def _library():
    if kernels.ensure():
        pytest.skip(f"ctropt's kernel library cannot be built here: {kernels.ensure()}")


def test_torch_legacy_scaled_query_and_additive_mask():
    _check(torch_legacy(), feeds(bias_shape=[B, 1, L, L]))


@pytest.mark.parametrize("lengths", [[L, 5, 1], [0, L, 3]], ids=["full-and-partial", "an-empty-history"])
def test_torch_sdpa_key_padding_mask(lengths):
    """An empty history masks every key: the softmax of a row of -inf is NaN, in the kernel as in onnxruntime."""
    done = _check(torch_sdpa_key_padding(), feeds(lengths=lengths))
    assert "Where" not in ops(done)   # the kernel reads the boolean mask itself: -inf where it is false
    core = next(n for n in done.graph.node if n.op_type == "AttentionCore")
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in core.attribute}
    assert len(core.input) == 5 and core.input[3] == "" and attrs["mask_on"] == 0 and attrs["mask_value"] == -np.inf


def masked_fill(zeros_shape):
    """FuxiCTR (torch masked_fill): Where(mask, -inf, zeros) as the bias, the mask a boolean input [n, L, L]."""
    nodes = [node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]), node("MatMul", ["q", "kt"], ["qk"]),
             node("Expand", ["fzero", "zshape"], ["zeros"]), node("Where", ["m", "minf", "zeros"], ["bias"]),
             node("Add", ["qk", "bias"], ["x"]), node("Softmax", ["x"], ["p"], axis=-1), node("MatMul", ["p", "v"], ["y"])]
    inputs = [vi("q", F, ["n", L, DK]), vi("k", F, ["n", L, DK]), vi("v", F, ["n", L, DV]),
              vi("m", onnx.TensorProto.BOOL, ["n", L, L])]
    inits = [init("fzero", np.array(0.0, np.float32)), init("minf", np.array(-np.inf, np.float32)),
             init("zshape", np.array(zeros_shape, np.int64))]
    return make_model(nodes, inputs, [vi("y", F, None)], inits)


def test_a_where_mask_is_read_as_a_boolean_mask():
    """Where(mask, -inf, 0) as the bias: the kernel reads the mask (no Where run); zeros that would widen the result
    keep the Where as a float bias."""
    f = {k: RNG.normal(size=(B * H, L, d)).astype(np.float32) for k, d in (("q", DK), ("k", DK), ("v", DV))}
    f["m"] = RNG.random((B * H, L, L)) < 0.4
    f["m"][:, :, 0] = False
    done = _check(masked_fill([1, 1, 1]), f)
    assert "Where" not in ops(done) and "Expand" not in ops(done)
    wide = masked_fill([2, 1, 1, 1])
    f["m"] = f["m"][:1]
    done = _check(wide, {**f, "q": f["q"][:1], "k": f["k"][:1], "v": f["v"][:1]})
    assert "Where" in ops(done)


def cast_mask(form):
    """A mask's 0/1 floats times a constant as the bias: tf2onnx's Sub(scores, c·Cast(Not(m))) (DeepRec BST) and
    BERT's Add(scores, (1 - Cast(m))·-10000); `inf`: c·Cast(m) with c = -inf (∞·0 is NaN: stays a float bias)."""
    if form == "tf2onnx":
        nodes = [node("Not", ["m"], ["nm"]), node("Cast", ["nm"], ["f"], to=onnx.TensorProto.FLOAT),
                 node("Mul", ["c", "f"], ["pen"]), node("Sub", ["qk", "pen"], ["x"])]
        c = 4294967295.0
    else:
        nodes = [node("Cast", ["m"], ["f"], to=onnx.TensorProto.FLOAT), node("Sub", ["one", "f"], ["inv"]),
                 node("Mul", ["inv", "c"], ["pen"]), node("Add", ["qk", "pen"], ["x"])]
        c = -np.inf if form == "inf" else -10000.0
    nodes = [node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]), node("MatMul", ["q", "kt"], ["qk"])] + nodes + \
        [node("Softmax", ["x"], ["p"], axis=-1), node("MatMul", ["p", "v"], ["y"])]
    inputs = [vi("q", F, ["n", L, DK]), vi("k", F, ["n", L, DK]), vi("v", F, ["n", L, DV]),
              vi("m", onnx.TensorProto.BOOL, ["n", 1, L])]
    inits = [init("c", np.array(c, np.float32)), init("one", np.array(1.0, np.float32))]
    return make_model(nodes, inputs, [vi("y", F, None)], inits)


@pytest.mark.parametrize("form", ["tf2onnx", "bert", "inf"])
def test_a_constant_times_a_cast_mask_is_read_as_the_mask(form):
    """c·Cast(Not(m)) subtracted, or (1 - Cast(m))·c added: the kernel reads m (the Cast, Not and Mul are not run);
    an infinite c stays a float bias (∞·0 is NaN there, and must stay so)."""
    f = {k: RNG.normal(size=(B * H, L, d)).astype(np.float32) for k, d in (("q", DK), ("k", DK), ("v", DV))}
    f["m"] = RNG.random((B * H, 1, L)) < 0.6
    f["m"][:, :, 0] = True
    done = _check(cast_mask(form), f)
    core = next(n for n in done.graph.node if n.op_type == "AttentionCore")
    if form == "inf":
        assert "Cast" in ops(done) and len(core.input) == 4
        return
    assert not {"Cast", "Not", "Mul"} & set(ops(done)) and core.input[4] == "m"
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in core.attribute}
    assert attrs["mask_on"] == 0 and attrs["mask_value"] == pytest.approx(-4294967295.0 if form == "tf2onnx" else -1e4)


def stacked_heads(mask_rows):
    """tf (DeepRec BST, the Keras-era transformers): heads split off the last axis and stacked on the batch axis,
    concat(split(x, H, -1), 0), for Q, K and V; Kᵀ by a Transpose; a key mask tiled over the heads ([H·B, 1 or L, L],
    `mask_rows`) as c·Cast(Not(m)) subtracted; the heads merged back by concat(split(y, H, 0), -1)."""
    nodes = []
    for x in "qkv":
        nodes += [node("Split", [x, "sizes"], [f"{x}{h}" for h in range(H)], axis=-1),
                  node("Concat", [f"{x}{h}" for h in range(H)], [f"{x}s"], axis=0)]
    nodes += [node("Transpose", ["ks"], ["kt"], perm=[0, 2, 1]), node("MatMul", ["qs", "kt"], ["qk"]),
              node("Mul", ["qk", "s"], ["qks"]), node("Tile", ["m", "reps"], ["mt"]), node("Not", ["mt"], ["nm"]),
              node("Cast", ["nm"], ["f"], to=onnx.TensorProto.FLOAT), node("Mul", ["c", "f"], ["pen"]),
              node("Sub", ["qks", "pen"], ["x"]), node("Softmax", ["x"], ["p"], axis=-1),
              node("MatMul", ["p", "vs"], ["ys"]), node("Split", ["ys", "parts"], [f"y{h}" for h in range(H)], axis=0),
              node("Concat", [f"y{h}" for h in range(H)], ["y"], axis=-1)]
    inputs = [vi("q", F, ["b", L, H * DK]), vi("k", F, ["b", L, H * DK]), vi("v", F, ["b", L, H * DK]),
              vi("m", onnx.TensorProto.BOOL, ["b", mask_rows, L])]
    inits = [init("sizes", np.array([DK] * H, np.int64)), init("s", np.array(0.5, np.float32)),
             init("reps", np.array([H, 1, 1], np.int64)), init("c", np.array(4294967295.0, np.float32)),
             init("parts", np.array([B] * H, np.int64))]
    return make_model(nodes, inputs, [vi("y", F, ["b", L, H * DK])], inits)


@pytest.mark.parametrize("mask_rows", [1, L])
def test_heads_stacked_on_the_batch_axis_are_read_in_place(mask_rows):
    """concat(split(x, H, -1), 0): the kernel reads x as [B, L, H, d] with its heads first and writes the merged
    [B, L, H·d]; no Split or Concat runs, and the mask tiled to [H·B, ., L] is read as [H, B, ., L]."""
    f = {k: RNG.normal(size=(B, L, H * DK)).astype(np.float32) for k in "qkv"}
    f["m"] = RNG.random((B, mask_rows, L)) < 0.6
    f["m"][..., 0] = True
    done = _check(stacked_heads(mask_rows), f, k_perm=[2, 0, 1, 3])
    assert not {"Split", "Concat", "Not", "Cast"} & set(ops(done)), ops(done)
    assert ops(done).count("Reshape") == 5   # Q, K and V split into heads, the mask regrouped, Y merged


def packed_projection(masked, merged_back=True):
    """torch nn.MultiheadAttention (FuxiCTR BST, dynamo): one projection [L, B, 3, D], Q, K and V each a Gather of
    index 0, 1, 2 on its axis 2 and the heads split into the batch, Reshape [L, B·H, d]; sequence-first, so each is
    transposed; optionally a [B·H, L, L] boolean mask; the heads merged back by a Transpose."""
    nodes = [node("Gather", ["p", f"i{c}"], [f"g{c}"], axis=2) for c in range(3)] + \
        [node("Reshape", [f"g{c}", "heads"], [f"h{c}"]) for c in range(3)] + \
        [node("Transpose", ["h0"], ["q"], perm=[1, 0, 2]), node("Transpose", ["h1"], ["kt"], perm=[1, 2, 0]),
         node("Transpose", ["h2"], ["v"], perm=[1, 0, 2]), node("MatMul", ["q", "kt"], ["qk"]),
         node("Mul", ["qk", "s"], ["x0"])]
    if masked:
        nodes += [node("Where", ["m", "minf", "zero"], ["bias"]), node("Add", ["x0", "bias"], ["x"])]
    nodes += [node("Softmax", ["x" if masked else "x0"], ["pr"], axis=-1), node("MatMul", ["pr", "v"], ["yh"])]
    nodes += [node("Transpose", ["yh"], ["y"], perm=[1, 0, 2])] if merged_back else \
        [node("Relu", ["yh"], ["y"])]   # read by another op: the kernel writes [B·H, L, d] itself
    inputs = [vi("p", F, [L, "b", 3, H * DK])] + ([vi("m", onnx.TensorProto.BOOL, ["bh", L, L])] if masked else [])
    inits = [init(f"i{c}", np.array(c, np.int64)) for c in range(3)] + \
        [init("heads", np.array([L, -1, DK], np.int64)), init("s", np.array(DK ** -0.5, np.float32)),
         init("minf", np.array(-np.inf, np.float32)), init("zero", np.array(0.0, np.float32))]
    return make_model(nodes, inputs, [vi("y", F, [L, "bh", DK] if merged_back else ["bh", L, DK])], inits)


def test_packed_q_k_and_v_whose_output_another_op_reads():
    """No Transpose after the attention: the kernel's [B, H, L, d] is reshaped to the [B·H, L, d] the Relu reads."""
    f = {"p": RNG.normal(size=(L, B, 3, H * DK)).astype(np.float32)}
    model, _ = run_pass(packed_projection(False, merged_back=False), "infer-shapes")
    done = _check(model, f, k_perm=[1, 2, 0, 3])
    assert "Relu" in ops(done) and "Gather" not in ops(done)


@pytest.mark.parametrize("masked", [False, True])
def test_q_k_and_v_packed_in_one_projection_are_read_in_place(masked):
    """The kernel reads Q, K and V out of the packed projection (its last axis split into heads, a select of axis 2)
    and writes the heads merged back; no Gather runs, and the mask is read as [B, H, L, L]."""
    f = {"p": RNG.normal(size=(L, B, 3, H * DK)).astype(np.float32)}
    if masked:
        f["m"] = RNG.random((B * H, L, L)) < 0.3
        f["m"][..., 0] = False
    model, _ = run_pass(packed_projection(masked), "infer-shapes")
    done = _check(model, f, k_perm=[1, 2, 0, 3])
    core = next(n for n in done.graph.node if n.op_type == "AttentionCore")
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in core.attribute}
    assert "Gather" not in ops(done) and [attrs[f"{x}_select"] for x in "qkv"] == [[2, 0], [2, 1], [2, 2]]
    assert attrs["y_perm"] == [2, 0, 1, 3] and ops(done).count("Reshape") == 3 + masked + 1


def deepctr_attention(scale_after=False):
    """deepctr's Transformer through tf2onnx (its BST): heads stacked on the batch axis; the key mask as tf's
    where(m, s, pad) written Cast(m)·s + Cast(Not(m))·pad (pad = ConstantOfShape(Shape(s))·-2³²); the row's max
    subtracted (GlobalMaxPool) before the softmax (or, scale_after, the selected scores scaled); the probabilities
    times a query mask per row, [H·B, L, 1]."""
    nodes = []
    for x in "qkv":
        nodes += [node("Split", [x, "sizes"], [f"{x}{h}" for h in range(H)], axis=-1),
                  node("Concat", [f"{x}{h}" for h in range(H)], [f"{x}s"], axis=0)]
    nodes += [node("Transpose", ["ks"], ["kt"], perm=[0, 2, 1]), node("MatMul", ["qs", "kt"], ["qk"]),
              node("Mul", ["qk", "s"], ["sc"]), node("Tile", ["m", "reps"], ["mt"]),
              node("Cast", ["mt"], ["keep"], to=onnx.TensorProto.FLOAT), node("Not", ["mt"], ["nm"]),
              node("Cast", ["nm"], ["drop"], to=onnx.TensorProto.FLOAT), node("Shape", ["sc"], ["shape"]),
              node("ConstantOfShape", ["shape"], ["ones"], value=onnx.helper.make_tensor("v", F, [1], [1.0])),
              node("Mul", ["ones", "c"], ["pad"]), node("Mul", ["keep", "sc"], ["a"]), node("Mul", ["drop", "pad"], ["b"]),
              node("Add", ["a", "b"], ["x"])]
    nodes += [node("Mul", ["x", "s2"], ["xs"])] if scale_after else \
        [node("GlobalMaxPool", ["x"], ["top"]), node("Sub", ["x", "top"], ["xs"])]   # a scale, or the max off
    nodes += [node("Softmax", ["xs"], ["p"], axis=-1), node("Tile", ["rows", "reps2"], ["rt"]),
              node("Unsqueeze", ["rt", "last"], ["r3"]), node("Mul", ["p", "r3"], ["pr"]),
              node("MatMul", ["pr", "vs"], ["ys"]), node("Split", ["ys", "parts"], [f"y{h}" for h in range(H)], axis=0),
              node("Concat", [f"y{h}" for h in range(H)], ["y"], axis=-1)]
    inputs = [vi(x, F, ["b", L, H * DK]) for x in "qkv"] + [vi("m", onnx.TensorProto.BOOL, ["b", L, L]),
                                                            vi("rows", F, ["b", L])]
    inits = [init("sizes", np.array([DK] * H, np.int64)), init("s", np.array(0.5, np.float32)),
             init("reps", np.array([H, 1, 1], np.int64)), init("c", np.array(-4294967296.0, np.float32)),
             init("parts", np.array([B] * H, np.int64)), init("last", np.array([-1], np.int64)),
             init("reps2", np.array([H, 1], np.int64)), init("s2", np.array(0.25, np.float32))]
    return make_model(nodes, inputs, [vi("y", F, ["b", L, H * DK])], inits)


@pytest.mark.parametrize("scale_after", [False, True])
def test_deepctrs_attention_selected_mask_max_and_query_rows(scale_after):
    """deepctr's dialect: the where(m, s, pad) read as the mask with mask_replace (the score is pad where masked), the
    max the softmax subtracts dropped (the kernel subtracts it), the query rows' mask applied to the output; an
    empty history (every key masked) is a uniform softmax, as in the export."""
    f = {k: RNG.normal(size=(B, L, H * DK)).astype(np.float32) for k in "qkv"}
    lengths = np.array([L, 4, 0])
    f["m"] = np.broadcast_to(np.arange(L)[None, None] < lengths[:, None, None], (B, L, L)).copy()
    f["rows"] = (np.arange(L)[None] < lengths[:, None]).astype(np.float32)
    model, _ = run_pass(deepctr_attention(scale_after), "infer-shapes")
    done = _check(model, f, k_perm=[2, 0, 1, 3])
    core = next(n for n in done.graph.node if n.op_type == "AttentionCore")
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in core.attribute}
    assert attrs["mask_replace"] == 1 and attrs["mask_on"] == 0 and core.input[4] != ""
    assert not {"GlobalMaxPool", "Split", "Concat", "ConstantOfShape", "Not"} & set(ops(done)), ops(done)


def test_torch_sequence_first_layout_read_through_strides():
    f = {n: RNG.normal(size=(L, B * H, d)).astype(np.float32) for n, d in (("q", DK), ("k", DK), ("v", DV))}
    f["bias"] = np.where(RNG.random((B * H, L, L)) < 0.3, -np.inf, 0).astype(np.float32)
    f["bias"][:, :, 0] = 0.0
    done = _check(torch_sequence_first(), f, k_perm=[1, 0, 2])
    assert "Transpose" not in ops(done)
    core = next(n for n in done.graph.node if n.op_type == "AttentionCore")
    assert _perm(core, "q_perm") == [1, 0, 2] and _perm(core, "v_perm") == [1, 0, 2] and _perm(core, "y_perm") == [1, 0, 2]


def test_inspect_shows_the_attention_and_the_fused_node():
    from ctropt.graph import to_graph
    from ctropt.inspect import ctr_structures

    model = torch_legacy()
    raw = [(s.kind, s.detail) for s in ctr_structures(to_graph(model))]
    assert raw == [("dot-product attention", "softmax(Q·Kᵀ) · V, output ['batch', 2, 11, 10]")]
    done, _ = run_pass(model, "attention-core-kernel")
    assert [(s.kind, s.detail) for s in ctr_structures(to_graph(done))] == [
        ("fused attention (ai.ctropt.kernels)", "AttentionCore, a bias")]
    other_axis = paddle_unscaled()
    other_axis.graph.node[2].attribute[0].i = 2
    assert "not fusable: not a softmax over the last axis" in ctr_structures(to_graph(other_axis))[0].detail


def test_autoint_divided_scores():
    _check(autoint(), feeds())


def test_tf2onnx_subtracted_mask_and_given_transposed_keys():
    _check(tf2onnx_subtracted(), tf_feeds(), k_perm=[0, 2, 1])


def test_paddle_without_scale():
    _check(paddle_unscaled(), feeds())


def test_not_an_attention_core():
    """Softmax on another axis, the probabilities read twice, a bias that broadcasts the scores larger: left."""
    other_axis = paddle_unscaled()
    other_axis.graph.node[2].attribute[0].i = 2
    twice = paddle_unscaled()
    twice.graph.output.append(vi("p", F, ["batch", H, L, L]))
    wide = torch_legacy()
    wide.graph.input[3].CopyFrom(vi("bias", F, [2, "batch", H, L, L]))
    wide.graph.output[0].CopyFrom(vi("y", F, None))
    for model in (other_axis, twice, wide):
        done, ctx = run_pass(model, "attention-core-kernel")
        assert ctx.rewrites == 0 and "AttentionCore" not in ops(done)


def test_softmax_before_opset_13_flattens_from_axis_1():
    """Without `axis`, an opset 11 Softmax normalizes over H·S·L of [B, H, S, L], not over L: left; with axis=3 it is
    the last-axis softmax and fused."""
    flat = paddle_unscaled()
    del flat.graph.node[2].attribute[:]
    flat.opset_import[0].version = 11
    done, ctx = run_pass(flat, "attention-core-kernel")
    assert ctx.rewrites == 0
    last = paddle_unscaled()
    last.graph.node[2].attribute[0].i = 3
    last.opset_import[0].version = 11
    _check(last, feeds())


def test_a_bias_or_a_scale_that_broadcasts_the_result_larger():
    """A bias with a batch axis over Q, K, V without one, a rank-4 bias over rank-3 heads: the kernel broadcasts as
    the Add does. A one-value constant of rank 4 scaling rank-3 Q stays in the graph (the kernel reads its product)."""
    batch_bias = torch_legacy()
    for i, t in enumerate([vi("q", F, [1, H, L, DK]), vi("k", F, [1, H, L, DK]), vi("v", F, [1, H, L, DV])]):
        batch_bias.graph.input[i].CopyFrom(t)
    batch_bias.graph.output[0].CopyFrom(vi("y", F, None))
    f = feeds(bias_shape=[B, 1, L, L])
    f.update({k: f[k][:1] for k in "qkv"})
    done = _check(batch_bias, f)
    assert run_model(done, f)["y"].shape == (B, H, L, DV)
    rank3 = tf2onnx_subtracted()
    rank3.graph.input[3].CopyFrom(vi("m", F, [1, 1, 1, L]))
    rank3.graph.output[0].CopyFrom(vi("y", F, None))
    f = tf_feeds()
    f["m"] = f["m"][:1, None]
    done = _check(rank3, f, k_perm=[0, 2, 1])
    assert run_model(done, f)["y"].shape == (1, B * H, L, DV)
    raised = autoint()
    raised.graph.input[0].CopyFrom(vi("q", F, [H, L, DK]))
    raised.graph.node.insert(0, node("Mul", ["q", "c4"], ["q4"]))
    raised.graph.node[2].input[0] = "q4"
    raised.graph.initializer.append(init("c4", np.array([[[[0.7]]]], np.float32)))
    raised.graph.output[0].CopyFrom(vi("y", F, None))
    f = feeds()
    f["q"] = f["q"][0]
    done = _check(raised, f)
    assert "Mul" in ops(done) and run_model(done, f)["y"].shape == (B, H, L, DV)


def test_without_the_library_standard_ops_and_a_note(monkeypatch):
    monkeypatch.setattr(kernels, "ensure", lambda: "no gcc")
    done, ctx = run_pass(autoint(), "attention-core-kernel")
    assert ctx.rewrites == 0 and "Softmax" in ops(done) and any("not available" in n for n in ctx.notes)
    with pytest.raises(ctropt.CtroptError, match="cannot be built"):
        run_pass(autoint(), "attention-core-kernel", attention_ort_form="kernel")
    done, ctx = run_pass(autoint(), "attention-core-kernel", attention_ort_form="standard")
    assert ctx.rewrites == 0


def _kernel_model(q_shape, k_shape, v_shape, bias_shape=None, scale=0.5, bias_scale=1.0, feeds=None, **perms):
    ins = ["q", "k", "v"] + (["bias"] if bias_shape else [])
    shapes = [q_shape, k_shape, v_shape] + ([bias_shape] if bias_shape else [])
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("AttentionCore", ins, ["y"], domain=kernels.DOMAIN, scale=scale, bias_scale=bias_scale,
                               **perms)],
        "core", [vi(n, F, s) for n, s in zip(ins, shapes)], [vi("y", F, None)])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17),
                                                         onnx.helper.make_opsetid(kernels.DOMAIN, 1)])
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    kernels.register(so)
    session = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    f = feeds or {n: RNG.normal(size=s).astype(np.float32) for n, s in zip(ins, shapes)}
    return session.run(None, f)[0], f


@pytest.mark.parametrize("shapes", [
    ([4, 3, 17, 5], [4, 3, 9, 5], [4, 3, 9, 19], [4, 1, 17, 9]),   # S > LANES, dv with a remainder, bias per row
    ([2, 1, 8], [2, 30, 8], [2, 30, 8], [2, 1, 30]),                # one query row (a target over its history)
    ([5, 2, 7, 4], [1, 2, 7, 4], [5, 1, 7, 3], [1, 1, 1, 7]),        # leading axes broadcast, one bias for all
    ([6, 16], [40, 16], [40, 33], None),                             # rank 2, no bias
    ([2, 1, 8], [2, 30, 8], [2, 30, 8], [3, 2, 5, 30]),              # the bias widens the rows and adds an axis
])
@pytest.mark.parametrize("layout", ["as-is", "transposed"])
def test_the_kernel_matches_numpy(shapes, layout):
    """Each input as it is, or given in another layout and read through a perm (Kᵀ; Q and V with their first and
    last axes swapped), the output written in another (its first two axes swapped)."""
    q, k, v, bias = shapes
    perms = {}
    if layout == "transposed":
        r = len(q)
        swap_last, swap_ends = list(range(r - 2)) + [r - 1, r - 2], [r - 1] + list(range(1, r - 1)) + [0]
        q, k, v = [q[a] for a in swap_ends], [k[a] for a in swap_last], [v[a] for a in swap_ends]
        out_rank = max(len(q), len(k), len(v), len(bias or []))
        perms = {"q_perm": swap_ends, "k_perm": swap_last, "v_perm": swap_ends,
                 "y_perm": [1, 0] + list(range(2, out_rank))}
    got, f = _kernel_model(q, k, v, bias, scale=0.4, bias_scale=-1.0, **perms)
    view = lambda key: np.transpose(f[key], perms[f"{key}_perm"]) if perms else f[key]  # noqa: E731
    want = reference(view("q"), view("k"), view("v"), 0.4, f.get("bias"), -1.0)
    if perms:
        want = np.transpose(want, perms["y_perm"])
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("rows", [3, 8, 13])
def test_the_kernel_skips_keys_masked_for_every_row(rows):
    """Keys the bias masks with -inf for every row of a block of 8 (key padding, the causal future) are skipped; the
    result is the same as computing them, and a row masked everywhere is NaN as in onnxruntime."""
    lengths = np.array([L, 4, 1, 0])
    allowed = (np.arange(L)[None, None] < lengths[:, None, None]) & np.tril(np.ones((rows, L), bool))[None]
    got, f = _kernel_model([4, 2, rows, DK], [4, 2, L, DK], [4, 2, L, DV], [4, 1, rows, L])
    f["bias"] = np.where(allowed, 0, -np.inf).astype(np.float32)[:, None]
    got, _ = _kernel_model([4, 2, rows, DK], [4, 2, L, DK], [4, 2, L, DV], [4, 1, rows, L], feeds=f)
    with np.errstate(invalid="ignore"):
        want = reference(f["q"], f["k"], f["v"], 0.5, f["bias"])
    assert np.array_equal(np.isnan(got), np.isnan(want)) and np.isnan(got[3]).all() and not np.isnan(got[:3]).any()
    np.testing.assert_allclose(np.nan_to_num(got), np.nan_to_num(want), atol=2e-6, rtol=1e-5)


def test_the_kernel_refuses_shapes_that_do_not_fit():
    with pytest.raises(Exception, match="K and V differ in length"):
        _kernel_model([2, 4, 8], [2, 5, 8], [2, 6, 8])
    with pytest.raises(Exception, match="does not broadcast to the scores"):
        _kernel_model([2, 4, 8], [2, 5, 8], [2, 5, 8], [2, 3, 5])
    with pytest.raises(Exception, match="not a permutation"):
        _kernel_model([2, 4, 8], [2, 5, 8], [2, 5, 8], q_perm=[0, 0, 1])
