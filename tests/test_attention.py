"""remove-attention-padding and dedup-user-side: tiny graphs in several exporters' dialects, the zoo and
third-party DIN/DIEN exports."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from helpers import F, I64, assert_same_outputs, init, make_model, node, ops, run_pass, vi

import ctropt
from ctropt.exporters import zoo
from ctropt.runtime import generate_inputs, run_model

THIRDPARTY = Path(__file__).parent / "data" / "thirdparty"
C, H = 4, 6


def _scores(rng, q_rows: str, keys: str = "keys", prefix: str = "") -> tuple[list, list]:
    """concat[q, k, q-k, q*k] -> MatMul -> Add -> Sigmoid -> MatMul -> Add: per-position scores [B, T, 1]."""
    nodes = [
        node("Sub", [q_rows, keys], [f"{prefix}d"]),
        node("Mul", [q_rows, keys], [f"{prefix}p"]),
        node("Concat", [q_rows, keys, f"{prefix}d", f"{prefix}p"], [f"{prefix}cat"], axis=-1),
        node("MatMul", [f"{prefix}cat", f"{prefix}w1"], [f"{prefix}h1"]),
        node("Add", [f"{prefix}h1", f"{prefix}b1"], [f"{prefix}h1b"]),
        node("Sigmoid", [f"{prefix}h1b"], [f"{prefix}a1"]),
        node("MatMul", [f"{prefix}a1", f"{prefix}w2"], [f"{prefix}h2"]),
        node("Add", [f"{prefix}h2", f"{prefix}b2"], [f"{prefix}s"]),
    ]
    inits = [init(f"{prefix}w1", rng.normal(size=(4 * C, H)).astype(np.float32)),
             init(f"{prefix}b1", rng.normal(size=H).astype(np.float32)),
             init(f"{prefix}w2", rng.normal(size=(H, 1)).astype(np.float32)),
             init(f"{prefix}b2", rng.normal(size=1).astype(np.float32))]
    return nodes, inits


def din_attention(dialect: str, seed: int = 0):
    """q [B, C], keys [B, T, C] and lengths [B] (or a float mask [B, T]) -> attention-pooled keys [B, C].

    torch: mask from Range/Less, Where(mask, s, zeros_like), no softmax (deepctr-torch, DIN paper);
    tf: tf2onnx's Where as Mul/Add with fill -2^32+1, softmax (the DIEN code's din_attention);
    mask: a float mask input multiplied in.
    """
    rng = np.random.default_rng(seed)
    nodes = [
        node("Shape", ["keys"], ["kshape"]),
        node("Unsqueeze", ["q", "ax1"], ["q1"]),
        node("Expand", ["q1", "kshape"], ["qt"]),
    ]
    inits = [init("ax1", np.array([1], np.int64)), init("ax2", np.array([2], np.int64))]
    mlp, mlp_inits = _scores(rng, "qt")
    nodes += mlp
    inits += mlp_inits
    inputs = [vi("q", F, ["batch", C]), vi("keys", F, ["batch", "seq_len", C])]
    nodes.append(node("Squeeze", ["s", "ax2"], ["s2"]))  # [B, T]
    if dialect in ("torch", "tf"):
        inputs.append(vi("hist_len", I64, ["batch"]))
        nodes += [
            node("Gather", ["kshape", "one"], ["t"], axis=0),
            node("Range", ["zero", "t", "one"], ["steps"]),
            node("Unsqueeze", ["hist_len", "ax1"], ["len1"]),
            node("Less", ["steps", "len1"], ["valid"]),  # [B, T] (steps broadcast over rows)
        ]
        inits += [init("zero", np.array(0, np.int64)), init("one", np.array(1, np.int64))]
    else:
        inputs.append(vi("mask", F, ["batch", "seq_len"]))
    if dialect == "torch":
        nodes += [node("Shape", ["s2"], ["s2shape"]),
                  node("ConstantOfShape", ["s2shape"], ["zeros"]),
                  node("Where", ["valid", "s2", "zeros"], ["masked"])]
        weights = "masked"
    elif dialect == "tf":
        nodes += [node("Shape", ["s2"], ["s2shape"]),
                  node("ConstantOfShape", ["s2shape"], ["ones"], value=init("v", np.ones(1, np.float32))),
                  node("Mul", ["ones", "big"], ["pads"]),
                  node("Cast", ["valid"], ["validf"], to=F),
                  node("Not", ["valid"], ["padded"]),
                  node("Cast", ["padded"], ["paddedf"], to=F),
                  node("Mul", ["validf", "s2"], ["kept"]),
                  node("Mul", ["pads", "paddedf"], ["filled"]),
                  node("Add", ["kept", "filled"], ["masked"]),
                  node("Softmax", ["masked"], ["weights"], axis=-1)]
        inits.append(init("big", np.array(-4294967295.0, np.float32)))
        weights = "weights"
    else:
        nodes.append(node("Mul", ["s2", "mask"], ["weights"]))
        weights = "weights"
    nodes += [node("Unsqueeze", [weights, "ax1"], ["w3"]),  # [B, 1, T]
              node("MatMul", ["w3", "keys"], ["pooled"]),
              node("Squeeze", ["pooled", "ax1"], ["out"])]
    return make_model(nodes, inputs, [vi("out", F, ["batch", C])], inits)


def _feeds(model, lengths, T=7, seed=1):
    rng = np.random.default_rng(seed)
    B = len(lengths)
    lengths = np.asarray(lengths, np.int64)
    feeds = {"q": rng.normal(size=(B, C)).astype(np.float32),
             "keys": rng.normal(size=(B, T, C)).astype(np.float32)}
    names = {i.name for i in model.graph.input}
    if "hist_len" in names:
        feeds["hist_len"] = lengths
    if "mask" in names:
        feeds["mask"] = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float32)
    return feeds


REWRITTEN_EXTRA = ["Size", "Range", "Reshape", "Compress",  # the valid positions, flat (b·T + t; the [B, T] mask as is)
                   "Reshape", "Gather", "Unsqueeze",  # the keys at those positions, read as [B·T, C] rows
                   "Shape", "Gather", "Max", "Div",  # the row of each position: position // max(T, 1)
                   "Gather", "Gather", "Unsqueeze",  # the query: once per row, gathered by row
                   "Gather", "Concat", "Reshape", "Gemm", "Unsqueeze",  # first layer: query part gathered, [k, q*k]·W'
                   "Reshape", "Reshape", "Concat", "ConstantOfShape", "Unsqueeze", "ScatterND",  # scattered back flat
                   "Concat", "Reshape"]  # viewed [B, T] again
REWRITTEN_GONE = ["Expand", "Sub"]  # the tiled query; q - k, now in the weights


def _first_layer(model):
    """(Gemm weights, the ops whose outputs it concatenates, the per-row projection's weights) of the split layer."""
    g = model.graph
    consts = {t.name: onnx.numpy_helper.to_array(t) for t in g.initializer}
    made = {o: n for n in g.node for o in n.output}
    gemm = next(n for n in g.node if n.op_type == "Gemm")
    cat = made[made[gemm.input[0]].input[0]]
    once = next(n for n in g.node if n.op_type == "MatMul" and "project_once" in n.name)
    return consts[gemm.input[1]], [made[u].op_type for u in cat.input], consts[once.input[1]]


@pytest.mark.parametrize("dialect", ["torch", "tf", "mask"])
def test_attention_mlp_runs_on_valid_positions_only(dialect):
    model = din_attention(dialect)
    once, ctx = run_pass(model, "remove-attention-padding")
    assert ctx.rewrites == 1, ctx.notes
    # The MLP's ops are the same, now over [1, N, ...]; around them: positions, the keys gathered, the query read
    # once per row, one scatter. The first layer's query part is computed once per row: concat[q, k, q-k, q*k]·W
    # = Gather(q·(W_q + W_d) + b, row) + concat[k, q*k]·[W_k - W_d; W_p].
    want = ops(model) + REWRITTEN_EXTRA + ["Cast"] * (dialect == "mask")  # a float mask input made bool
    gone = REWRITTEN_GONE + ["Shape"] * (dialect == "mask")  # there, the keys' shape was the Expand's only
    for op in gone + ["Concat", "MatMul", "Add"]:  # and the first layer's Concat, MatMul, bias Add
        want.remove(op)
    if dialect == "torch":  # a zero fill and no softmax: the pooling is a scatter-add over the valid positions too,
        # and nothing reads the masked weights [B, T] any more
        adds = [n for n in once.graph.node if n.op_type == "ScatterND" and
                any(a.name == "reduction" and a.s == b"add" for a in n.attribute)]
        assert len(adds) == 1 and ops(once).count("ScatterND") == 1 and "Where" not in ops(once), ops(once)
    else:
        assert sorted(ops(once)) == sorted(want + ["MatMul", "Add"]), ops(once)  # per-row projection and its bias
    w1 = onnx.numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "w1"))
    w_rest, parts, w_once = _first_layer(once)
    assert parts == ["Unsqueeze", "Mul"]  # k (gathered, [1, N, C]) and q*k
    np.testing.assert_allclose(w_rest, np.concatenate([w1[C:2 * C] - w1[2 * C:3 * C], w1[3 * C:]]), rtol=1e-6)
    np.testing.assert_allclose(w_once, w1[:C] + w1[2 * C:3 * C], rtol=1e-6)
    for lengths in ([7, 0, 3, 7, 1], [0], [7], [0, 0, 0], [2, 5, 7, 0, 4, 4, 1, 6]):
        assert_same_outputs(model, once, _feeds(model, lengths), atol=1e-5, rtol=1e-5)
    twice, ctx2 = run_pass(once, "remove-attention-padding")
    assert ctx2.rewrites == 0 and sorted(ops(twice)) == sorted(ops(once))
    assert ctropt.graph.interface(once) == ctropt.graph.interface(model)


def _tiled_query_features() -> list:
    """q [B, C] tiled over the keys' T by Expand, then cat [B, T, 4C] = concat[q, k, q - k, q * k]."""
    return [node("Shape", ["keys"], ["kshape"]),
            node("Unsqueeze", ["q", "ax1"], ["q1"]),
            node("Expand", ["q1", "kshape"], ["qt"]),
            node("Sub", ["qt", "keys"], ["d"]),
            node("Mul", ["qt", "keys"], ["p"]),
            node("Concat", ["qt", "keys", "d", "p"], ["cat"], axis=-1)]


def flat_din_attention(seed: int = 0):
    """FuxiCTR's DIN attention: the MLP is Gemms over a [B*T, 4C] view, the scores [B*T, 1] are reshaped to [B, T]
    (the shape computed from the keys') and multiplied by Cast(Not(Equal(ids, 0))): id 0 is the padding."""
    rng = np.random.default_rng(seed)
    nodes = _tiled_query_features() + [
        node("Reshape", ["cat", "rows"], ["flat"]),
        node("Gemm", ["flat", "w1", "b1"], ["h1"], transB=1),
        node("Sigmoid", ["h1"], ["a1"]),
        node("Gemm", ["a1", "w2", "b2"], ["s_flat"], transB=1),
        node("Gather", ["kshape", "one"], ["t"], axis=0),
        node("Unsqueeze", ["t", "ax0"], ["t1"]),
        node("Concat", ["minus_one", "t1"], ["bt"], axis=0),
        node("Reshape", ["s_flat", "bt"], ["s2"]),
        node("Equal", ["ids", "zero"], ["padded"]),
        node("Not", ["padded"], ["valid"]),
        node("Cast", ["valid"], ["validf"], to=F),
        node("Mul", ["s2", "validf"], ["weights"]),
        node("Unsqueeze", ["weights", "ax1"], ["w3"]),
        node("MatMul", ["w3", "keys"], ["pooled"]),
        node("Squeeze", ["pooled", "ax1"], ["out"]),
    ]
    inits = [init("ax0", np.array([0], np.int64)), init("ax1", np.array([1], np.int64)),
             init("rows", np.array([-1, 4 * C], np.int64)), init("one", np.array(1, np.int64)),
             init("minus_one", np.array([-1], np.int64)), init("zero", np.array(0, np.int64)),
             init("w1", rng.normal(size=(H, 4 * C)).astype(np.float32)),
             init("b1", rng.normal(size=H).astype(np.float32)),
             init("w2", rng.normal(size=(1, H)).astype(np.float32)), init("b2", rng.normal(size=1).astype(np.float32))]
    inputs = [vi("q", F, ["batch", C]), vi("keys", F, ["batch", "seq_len", C]), vi("ids", I64, ["batch", "seq_len"])]
    return make_model(nodes, inputs, [vi("out", F, ["batch", C])], inits)


def test_flat_scores_reshaped_to_the_history_and_gemm_layers():
    """FuxiCTR's form: the region ends at the reshape to [B, T]; the first Gemm's query part runs once per row."""
    model = flat_din_attention()
    once, ctx = run_pass(model, "remove-attention-padding")
    assert ctx.rewrites == 1, ctx.notes
    assert "Expand" not in ops(once) and any("project_once" in n.name for n in once.graph.node)
    assert any("projected once per row" in n for n in ctx.notes), ctx.notes
    for lengths in ([7, 0, 3, 7, 1], [0], [7], [2, 5, 7, 0, 4, 4, 1, 6]):
        feeds = _feeds(model, lengths)
        feeds["ids"] = np.where(np.arange(7)[None, :] < np.asarray(lengths)[:, None], 5, 0).astype(np.int64)
        assert_same_outputs(model, once, feeds, atol=1e-5, rtol=1e-5)
    twice, ctx2 = run_pass(once, "remove-attention-padding")
    assert ctx2.rewrites == 0 and sorted(ops(twice)) == sorted(ops(once))
    assert ctropt.graph.interface(once) == ctropt.graph.interface(model)
    # the generated inputs pad the history with the id the graph masks (0), so the guard times real padding
    ids = generate_inputs(model, batch=64)["ids"]
    assert 0.2 < (ids == 0).mean() < 0.8 and (ids[1] == 0).all()


@pytest.mark.parametrize("make", [lambda: din_attention("torch"), lambda: din_attention("tf"),
                                  lambda: din_attention("mask"), flat_din_attention])
def test_an_empty_batch_and_empty_histories_answer_as_the_raw_model(make):
    """No valid position at all (batch 0, every history empty, a history axis of length 0): the rebuilt region
    runs on no rows and the outputs are the raw model's (empty, or the pooling of nothing), or both raise. At
    opset 13 (no Reshape allowzero) the scores are written back at (row, step) instead; from opset 16 the pooling
    is a scatter-add of the valid positions."""
    for opset in (13, 15, 17):
        model = make()
        if opset < 14 and any(a.name == "allowzero" for n in model.graph.node for a in n.attribute):
            continue   # the flat form's own Reshapes need opset 14
        model.opset_import[0].version = opset
        once, ctx = run_pass(model, "remove-attention-padding")
        assert ctx.rewrites == 1, ctx.notes
        for lengths, T in (([], 7), ([0, 0], 7), ([0, 3, 7], 7), ([0, 0], 0), ([], 0)):
            feeds = _feeds(model, lengths, T=T)
            if "ids" in {i.name for i in model.graph.input}:
                feeds["ids"] = np.zeros((len(lengths), T), np.int64)
            try:
                ctropt.runtime.run_model(model, feeds)
            except Exception:   # the flat form's raw model fails on T = 0 (a Mul of [B, 0] by [B, 1]): the
                # rewritten one answers as the raw model does for one padded position (README: the policy)
                witness = _feeds(model, lengths, T=1)
                witness["ids"] = np.zeros((len(lengths), 1), np.int64)
                expected = ctropt.runtime.run_model(model, witness)
                got = ctropt.runtime.run_model(once, feeds)
                assert all(np.allclose(expected[k], got[k], atol=1e-5) for k in expected)
                continue
            assert_same_outputs(model, once, feeds, atol=1e-5, rtol=1e-5)


def recbole_din_attention(seed: int = 0):
    """RecBole's SequenceAttLayer: the padded positions are ``arange(T).repeat(scores.size(0), 1) >= length`` (the
    batch size read off the scores' own shape), masked_fill with 0 (Where(padded, 0, s))."""
    model = din_attention("torch", seed)
    g = model.graph
    where = next(n for n in g.node if n.op_type == "Where")
    keep = [n for n in g.node if n.op_type not in ("Less", "Where", "ConstantOfShape") and n.output[0] != "s2shape"]
    del g.node[:]
    g.node.extend(keep)
    g.node.extend([node("Shape", ["s2"], ["s2shape"]), node("Gather", ["s2shape", "zero"], ["n_rows"], axis=0),
                   node("Unsqueeze", ["n_rows", "ax0"], ["n_rows1"]), node("Concat", ["n_rows1", "one1"], ["reps"], axis=0),
                   node("Unsqueeze", ["steps", "ax0"], ["steps2"]), node("Tile", ["steps2", "reps"], ["tiled"]),
                   node("GreaterOrEqual", ["tiled", "len1"], ["padded"]),
                   node("Where", ["padded", "fill", "s2"], ["masked"])])
    g.initializer.extend([init("ax0", np.array([0], np.int64)), init("one1", np.array([1], np.int64)),
                          init("fill", np.array(0.0, np.float32))])
    assert where.output[0] == "masked"
    return ctropt.graph.to_model(ctropt.graph.to_graph(model), like=model)  # nodes in topological order


def test_mask_that_reads_the_batch_size_off_the_scores():
    """The Shape that gives the mask its rows reads a graph input's first dim instead (measured equal to the
    batch at both probe sizes), so the scatter does not read back what it writes, and the region runs."""
    model = recbole_din_attention()
    once, ctx = run_pass(model, "remove-attention-padding")
    assert ctx.rewrites == 1, ctx.notes
    shape = next(n for n in once.graph.node if n.op_type == "Shape" and n.output[0] == "s2shape")
    assert shape.input[0] in {i.name for i in model.graph.input}
    for lengths in ([7, 0, 3, 7, 1], [0], [7], [2, 5, 7, 0, 4, 4, 1, 6]):
        assert_same_outputs(model, once, _feeds(model, lengths), atol=1e-5, rtol=1e-5)
    twice, ctx2 = run_pass(once, "remove-attention-padding")
    assert ctx2.rewrites == 0 and sorted(ops(twice)) == sorted(ops(once))
    assert ctropt.graph.interface(once) == ctropt.graph.interface(model)


def tensordot_din_attention(seed: int = 0):
    """DeepRec's DIN attention through tf2onnx: tensordot writes each layer as Reshape to [1, B*T, K], Squeeze,
    MatMul; the scores [B*T, 1] are reshaped to [B, 1, T] and masked by Cast(mask [B, 1, T])."""
    rng = np.random.default_rng(seed)
    nodes = _tiled_query_features() + [
        node("Reshape", ["cat", "one_rows"], ["cat1"]),
        node("Squeeze", ["cat1", "ax0"], ["flat"]),
        node("MatMul", ["flat", "w1"], ["h1"]),
        node("Sigmoid", ["h1"], ["a1"]),
        node("MatMul", ["a1", "w2"], ["s_flat"]),
        node("Gather", ["kshape", "one"], ["t"], axis=0),
        node("Unsqueeze", ["t", "ax0"], ["t1"]),
        node("Concat", ["minus_one_one", "t1"], ["b1t"], axis=0),
        node("Reshape", ["s_flat", "b1t"], ["s3"]),  # [B, 1, T]
        node("Gather", ["kshape", "one"], ["t_again"], axis=0),
        node("Range", ["zero", "t_again", "one"], ["steps"]),
        node("Unsqueeze", ["hist_len", "ax1"], ["len1"]),
        node("Less", ["steps", "len1"], ["valid"]),
        node("Unsqueeze", ["valid", "ax1"], ["valid3"]),
        node("Cast", ["valid3"], ["validf"], to=F),
        node("Mul", ["validf", "s3"], ["weights"]),
        node("MatMul", ["weights", "keys"], ["pooled"]),
        node("Squeeze", ["pooled", "ax1"], ["out"]),
    ]
    inits = [init("ax0", np.array([0], np.int64)), init("ax1", np.array([1], np.int64)),
             init("one_rows", np.array([1, -1, 4 * C], np.int64)), init("one", np.array(1, np.int64)),
             init("zero", np.array(0, np.int64)), init("minus_one_one", np.array([-1, 1], np.int64)),
             init("w1", rng.normal(size=(4 * C, H)).astype(np.float32)),
             init("w2", rng.normal(size=(H, 1)).astype(np.float32))]
    inputs = [vi("q", F, ["batch", C]), vi("keys", F, ["batch", "seq_len", C]), vi("hist_len", I64, ["batch"])]
    return make_model(nodes, inputs, [vi("out", F, ["batch", C])], inits)


def test_tensordot_layers_and_scores_masked_as_b_1_t():
    """DeepRec's form: positions flat ([1, B*T, K] and [B*T, K]); the scores scattered back flat."""
    model = tensordot_din_attention()
    once, ctx = run_pass(model, "remove-attention-padding")
    assert ctx.rewrites == 1, ctx.notes
    assert "Expand" not in ops(once) and any("project_once" in n.name for n in once.graph.node)
    for lengths in ([7, 0, 3, 7, 1], [0], [7], [2, 5, 7, 0, 4, 4, 1, 6]):
        assert_same_outputs(model, once, _feeds(model, lengths), atol=1e-5, rtol=1e-5)
    twice, ctx2 = run_pass(once, "remove-attention-padding")
    assert ctx2.rewrites == 0 and sorted(ops(twice)) == sorted(ops(once))


def test_a_mask_built_from_the_scores_shape_is_left_alone():
    """RecBole: the mask's batch is read off the scores' shape; scattering the scores would read the mask back."""
    model = flat_din_attention()
    g = model.graph
    eq = next(n for n in g.node if n.op_type == "Equal")
    g.node.extend([node("Shape", ["s2"], ["s2shape"]), node("Expand", ["ids", "s2shape"], ["ids_b"])])
    eq.input[0] = "ids_b"
    model = ctropt.graph.to_model(ctropt.graph.to_graph(model), like=model)
    once, ctx = run_pass(model, "remove-attention-padding")
    assert ctx.rewrites == 0 and sorted(ops(once)) == sorted(ops(model))


def test_scores_normalized_over_the_history_are_left_alone():
    """s - mean over T of s is not position by position: the region check refuses it, saying why."""
    model = din_attention("torch")
    g = model.graph
    add = next(n for n in g.node if n.output[0] == "s")
    add.output[0] = "s_raw"
    g.node.extend([node("ReduceMean", ["s_raw"], ["s_mean"], axes=[1], keepdims=1),
                   node("Sub", ["s_raw", "s_mean"], ["s"])])
    model = ctropt.graph.to_model(ctropt.graph.to_graph(model), like=model)  # topological order again
    once, ctx = run_pass(model, "remove-attention-padding")
    assert ctx.rewrites == 0
    assert any("left as is" in n for n in ctx.notes), ctx.notes


def test_a_fill_computed_from_the_scores_is_not_a_mask():
    model = din_attention("torch")
    where = next(n for n in model.graph.node if n.op_type == "Where")
    where.input[2] = "s2"  # Where(valid, s, s): padded positions keep their scores
    once, ctx = run_pass(model, "remove-attention-padding")
    assert ctx.rewrites == 0 and sorted(ops(once)) == sorted(ops(model))


# ----------------------------------------------------------------------------------------- dedup-user-side


def user_tower(batch_stats: str = "", seed: int = 0):
    """hist ids [B, T] -> embeddings -> MatMul -> ReLU -> sum over T (the user vector); item ids [B] ->
    embeddings; concat -> MatMul -> out. batch_stats "mean": the user vector is centred by the batch mean (a
    Dice/BN with batch statistics at inference); "softmax": a softmax over the batch axis. Both mix rows."""
    rng = np.random.default_rng(seed)
    nodes = [node("Gather", ["table", "hist_ids"], ["hist_emb"]),
             node("MatMul", ["hist_emb", "w_user"], ["hu"]),
             node("Relu", ["hu"], ["hr"]),
             node("ReduceSum", ["hr", "ax1"], ["user"], keepdims=0)]
    if batch_stats == "mean":
        nodes[-1].output[0] = "user_raw"
        nodes += [node("ReduceMean", ["user_raw"], ["bmean"], axes=[0], keepdims=1),
                  node("Sub", ["user_raw", "bmean"], ["user"])]
    elif batch_stats == "softmax":
        nodes[-1].output[0] = "user_raw"
        nodes.append(node("Softmax", ["user_raw"], ["user"], axis=0))
    nodes += [node("Gather", ["table", "item_id"], ["item"]),
              node("Concat", ["user", "item"], ["both"], axis=1),
              node("MatMul", ["both", "w_out"], ["out"])]
    inits = [init("table", rng.normal(size=(50, C)).astype(np.float32)),
             init("w_user", rng.normal(size=(C, C)).astype(np.float32)),
             init("w_out", rng.normal(size=(2 * C, 1)).astype(np.float32)),
             init("ax1", np.array([1], np.int64))]
    inputs = [vi("hist_ids", I64, ["batch", "seq_len"]), vi("item_id", I64, ["batch"])]
    return make_model(nodes, inputs, [vi("out", F, ["batch", 1])], inits)


def _user_feeds(users: list[int], T: int = 5, seed: int = 2):
    rng = np.random.default_rng(seed)
    histories = rng.integers(0, 50, size=(max(users) + 1, T))
    return {"hist_ids": histories[users], "item_id": rng.integers(0, 50, size=len(users))}


def test_user_side_runs_once_per_distinct_user():
    model = user_tower()
    once, ctx = run_pass(model, "dedup-user-side")
    assert ctx.rewrites == 1, ctx.notes
    # Unique over the history rows; the embedding lookup, MatMul, Relu and sum run on the distinct rows (the
    # history ids gathered by Unique's first indices); the user vector is gathered back by the inverse indices. The
    # [B, T] int64 ids are the key as they are (no Reshape or Cast), beside a [B, 1] column of zeros: T may be 0,
    # and onnxruntime's Unique aborts on rows of no width.
    width = ["Shape", "Slice", "Concat", "ConstantOfShape", "Concat"]
    assert sorted(ops(once)) == sorted(ops(model) + ["Unique", "Gather", "Gather"] + width), ops(once)
    for users in ([0, 0, 0, 0], [0, 1, 0, 2, 1], [3], [0, 1, 2, 3]):
        assert_same_outputs(model, once, _user_feeds(users), atol=1e-12, rtol=0)
    empty = {k: v[:, :0] if v.ndim == 2 else v for k, v in _user_feeds([0, 1, 0]).items()}
    assert_same_outputs(model, once, empty, atol=1e-12, rtol=0)
    twice, ctx2 = run_pass(once, "dedup-user-side")
    assert ctx2.rewrites == 0 and sorted(ops(twice)) == sorted(ops(once))
    assert ctropt.graph.interface(once) == ctropt.graph.interface(model)


def stacked_user_tower(layout: str):
    """user_tower's MatMul on the history's rows stacked on the batch axis, then unstacked: "heads" is tf's
    multi-head layout (Concat(Split(x, 2, -1), 0): [2B, T, C/2]), "flat" tensordot's [B·T, C]; "paired" unstacks
    the heads by a Reshape straight to [B, T, C], which makes row b of stacked rows 2b and 2b + 1: it mixes rows."""
    model = user_tower()
    g = model.graph
    first = next(i for i, n in enumerate(g.node) if n.op_type == "MatMul")
    half = init("w_half", np.random.default_rng(5).normal(size=(C // 2, C // 2)).astype(np.float32))
    if layout.startswith("flat"):
        body = [node("Shape", ["hist_emb"], ["emb_shape"]),
                node("Reshape", ["hist_emb", "to_rows"], ["rows"]),
                node("MatMul", ["rows", "w_user"], ["rows_u"]),
                node("Reshape", ["rows_u", "emb_shape"], ["hu"])]
        extra = [init("to_rows", np.array([-1, C], np.int64))]
    else:
        body = [node("Split", ["hist_emb"], ["h0", "h1"], axis=-1),
                node("Concat", ["h0", "h1"], ["stacked"], axis=0),
                node("MatMul", ["stacked", "w_half"], ["stacked_u"])]
        if layout == "heads":
            body += [node("Split", ["stacked_u"], ["u0", "u1"], axis=0),
                     node("Concat", ["u0", "u1"], ["hu"], axis=-1)]
        else:
            body += [node("Shape", ["hist_emb"], ["emb_shape"]),
                     node("Reshape", ["stacked_u", "emb_shape"], ["hu"])]
        extra = [half]
    nodes = list(g.node[:first]) + body + list(g.node[first + 1:])
    if layout == "flat-masked":   # the stacked rows also read by a light branch of their own: ids ≠ 0 as a column
        nodes[nodes.index(next(n for n in nodes if n.op_type == "ReduceSum")) + 1:1] = []
        nodes += [node("Equal", ["hist_ids", "zero"], ["pad"]), node("Not", ["pad"], ["valid"]),
                  node("Cast", ["valid"], ["validf"], to=F), node("Reshape", ["validf", "column"], ["vcol"]),
                  node("Mul", ["rows", "vcol"], ["kept_rows"]), node("Reshape", ["kept_rows", "emb_shape"], ["kept"]),
                  node("ReduceSum", ["kept", "ax1"], ["user2"], keepdims=0)]
        concat = next(n for n in nodes if n.op_type == "Concat" and "item" in n.input)
        concat.input[0] = "user_sum"
        nodes.insert(nodes.index(concat), node("Add", ["user", "user2"], ["user_sum"]))
        extra += [init("zero", np.array(0, np.int64)), init("column", np.array([-1, 1], np.int64))]
    del g.node[:]
    g.node.extend(nodes)
    g.initializer.extend(extra)
    if layout == "flat-output":   # the stacked rows are an output of the graph too
        g.output.append(vi("rows", F, None))
    return model


@pytest.mark.parametrize("layout", ["flat-masked", "flat-output"])
def test_stacked_rows_never_leave_the_user_side(layout):
    """Stacked rows read by a light branch the heavy nodes do not need ("flat-masked": a mask column of the ids): that
    branch runs on the distinct rows too, since only per-row values are gathered back. Stacked rows that are a graph
    output ("flat-output") keep their producer, and what reads them, per row."""
    model = stacked_user_tower(layout)
    once, ctx = run_pass(model, "dedup-user-side")
    for users in ([0, 0, 0, 0], [0, 1, 0, 2, 1], [3], [0, 1, 2, 3]):
        f = _user_feeds(users)
        f["hist_ids"][:, 1] = 0   # some padding
        assert_same_outputs(model, once, f, atol=1e-5, rtol=1e-6)
    mul = next((n for n in once.graph.node if n.op_type == "Mul"), None)
    if layout == "flat-masked":
        assert ctx.rewrites == 1, ctx.notes
        assert not any(n.op_type == "Gather" and n.output[0] in mul.input for n in once.graph.node)
    else:
        assert ctx.rewrites == 0 and "Unique" not in ops(once), ctx.notes


@pytest.mark.parametrize("layout", ["heads", "flat", "paired"])
def test_rows_stacked_on_the_batch_axis_run_once_per_user_when_no_row_mixes(layout):
    model = stacked_user_tower(layout)
    once, ctx = run_pass(model, "dedup-user-side")
    for users in ([0, 0, 0, 0], [0, 1, 0, 2, 1], [3], [0, 1, 2, 3]):
        assert_same_outputs(model, once, _user_feeds(users), atol=1e-12, rtol=0)
    mm = next(n for n in once.graph.node if n.op_type == "MatMul" and "w_" in n.input[1] and n.input[1] != "w_out")
    if layout == "paired":   # measured: the reshape mixes rows, so it and what follows stay per row
        assert any("mixes rows" in n for n in ctx.notes), ctx.notes
        assert not any(n.op_type == "Gather" and n.output[0] == mm.input[0] for n in once.graph.node)
        return
    assert ctx.rewrites == 1, ctx.notes
    # The stacked values stay inside: the history is read on the distinct rows, the user vector gathered back (the
    # key of a history alone with a zero column: its length may be 0).
    width = ["Shape", "Slice", "Concat", "ConstantOfShape", "Concat"]
    assert sorted(ops(once)) == sorted(ops(model) + ["Unique", "Gather", "Gather"] + width), ops(once)
    twice, ctx2 = run_pass(once, "dedup-user-side")
    assert ctx2.rewrites == 0 and sorted(ops(twice)) == sorted(ops(once))


def user_mask_tower():
    """A light user side: hist ids [B, 5] → a padding mask, broadcast to [B, 5, 5], and-ed with a constant pattern,
    tiled over 2 heads ([B, 2, 5, 5]); no matmul. Each row's item scales it: out = Σ mask · item."""
    T = 5
    nodes = [node("Equal", ["hist_ids", "zero"], ["pad"]), node("Unsqueeze", ["pad", "ax1"], ["pad1"]),
             node("Expand", ["pad1", "square"], ["pads"]), node("Not", ["pads"], ["valid"]),
             node("And", ["valid", "pattern"], ["allowed"]), node("Unsqueeze", ["allowed", "ax1"], ["allowed1"]),
             node("Tile", ["allowed1", "heads"], ["mask"]), node("Cast", ["mask"], ["maskf"], to=F),
             node("Gather", ["table", "item_id"], ["item"]), node("Reshape", ["item", "col4"], ["item4"]),
             node("Mul", ["maskf", "item4"], ["scaled"]), node("ReduceSum", ["scaled", "axes"], ["out"], keepdims=0)]
    inits = [init("zero", np.array(0, np.int64)), init("ax1", np.array([1], np.int64)),
             init("square", np.array([1, T, 1], np.int64)), init("pattern", ~np.eye(T, dtype=bool)),
             init("heads", np.array([1, 2, 1, 1], np.int64)), init("table", np.arange(50, dtype=np.float32)[:, None]),
             init("col4", np.array([-1, 1, 1, 1], np.int64)), init("axes", np.array([1, 2, 3], np.int64))]
    inputs = [vi("hist_ids", I64, ["batch", T]), vi("item_id", I64, ["batch"])]
    return make_model(nodes, inputs, [vi("out", F, ["batch"])], inits)


def test_a_light_user_side_runs_once_where_requests_hold_one_user():
    """No matmul on the user side: left per row, unless user inputs are declared (one user per request), where a
    chain that writes more than twice what comes back (the mask tiled over heads and tokens) runs once per user."""
    model = user_mask_tower()
    plain, ctx = run_pass(model, "dedup-user-side")
    assert ctx.rewrites == 0 and any("too light" in n for n in ctx.notes), ctx.notes
    once, ctx = run_pass(model, "dedup-user-side", user_inputs="hist_ids")
    assert ctx.rewrites == 1, ctx.notes
    assert ops(once).count("Unique") == 1 and ops(once).count("Tile") == 1
    cast = next(n for n in once.graph.node if n.op_type == "Cast")   # the mask's float, which reads it alone, too
    assert any(n.op_type == "Gather" and n.input[0] == cast.output[0] for n in once.graph.node)  # gathered back
    for users in ([0, 0, 0, 0], [0, 1, 0, 2, 1], [3]):
        f = _user_feeds(users)
        f["hist_ids"][:, ::2] = 0   # padding
        assert_same_outputs(model, once, f, atol=0, rtol=0)
    twice, ctx2 = run_pass(once, "dedup-user-side", user_inputs="hist_ids")
    assert ctx2.rewrites == 0 and sorted(ops(twice)) == sorted(ops(once))


def test_a_lookup_alone_is_too_light_even_for_one_user():
    """A user's lookup and a Reshape (a view) gathered back would cost what they save: left per row."""
    nodes = [node("Gather", ["table", "user_id"], ["u"]), node("Reshape", ["u", "flat"], ["uv"]),
             node("Gather", ["table", "item_id"], ["i"]), node("Mul", ["uv", "i"], ["ui"]),
             node("ReduceSum", ["ui", "ax1"], ["out"], keepdims=0)]
    inits = [init("table", np.random.default_rng(3).normal(size=(50, C)).astype(np.float32)),
             init("flat", np.array([-1, C], np.int64)), init("ax1", np.array([1], np.int64))]
    model = make_model(nodes, [vi("user_id", I64, ["batch"]), vi("item_id", I64, ["batch"])],
                       [vi("out", F, ["batch"])], inits)
    once, ctx = run_pass(model, "dedup-user-side", user_inputs="user_id")
    assert ctx.rewrites == 0 and sorted(ops(once)) == sorted(ops(model)), ctx.notes


@pytest.mark.parametrize("stats,op,why", [("mean", "ReduceMean", "reduces over the batch"),
                                          ("softmax", "Softmax", "mixes rows")])
def test_batch_statistics_block_dedup_and_say_why(stats, op, why):
    model = user_tower(batch_stats=stats)
    once, ctx = run_pass(model, "dedup-user-side")
    assert any(op in n and why in n for n in ctx.notes), ctx.notes
    for users in ([0, 0, 0, 0], [0, 1, 0, 2, 1], [1, 2]):
        assert_same_outputs(model, once, _user_feeds(users), atol=1e-6)
    # What comes before the batch-wide op may still be deduplicated; the op itself reads every row.
    mixer = next(n for n in once.graph.node if n.op_type == op)
    assert mixer.input[0].startswith("user_side") and "Gather" in mixer.input[0]


# ----------------------------------------------------------------------------------------- real exports


@pytest.mark.parametrize("name", ["din_tf", "dien_tf", "din_torch", "dien_torch"])
def test_zoo_din_dien(name):
    raw = ctropt.load(zoo.DATA / f"{name}.onnx")
    result = ctropt.optimize(raw, speed=False)
    status = {r.name: r.status for r in result.records}
    assert status["remove-attention-padding"] == "applied"
    if name.startswith("dien"):
        assert status["dedup-user-side"] == "applied"  # the interest-extraction GRU
    for kwargs in ({"fill": 0.5}, {"fill": 0.1, "one_user": True}, {"fill": 1.0, "one_user": True}, {}):
        feeds = generate_inputs(raw, batch=9, seq_len=12, **kwargs)
        assert_same_outputs(raw, result.model, feeds)
    ref = dict(np.load(zoo.DATA / f"{name}.ref.npz"))
    got = run_model(result.model, dict(np.load(zoo.DATA / f"{name}.npz")))
    for k, v in ref.items():
        np.testing.assert_allclose(got[k], v, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("stem", ["deepctr_DIN_tf2onnx", "deepctr_torch_DIN_legacy", "deepctr_torch_DIN_dynamo",
                                  "deepctr_torch_DIEN_GRU_padded_dynamo", "deepctr_DIEN_GRU_where_tf2onnx"])
def test_thirdparty_din_dien(stem):
    raw = ctropt.load(THIRDPARTY / f"{stem}.onnx")
    result = ctropt.optimize(raw, speed=False)
    status = {r.name: r.status for r in result.records}
    assert status["remove-attention-padding"] == "applied", result.records
    feeds = generate_inputs(raw, batch=8, fill=0.5, one_user=True)
    assert_same_outputs(raw, result.model, feeds)
    ref = dict(np.load(THIRDPARTY / f"{stem}.ref.npz"))
    got = run_model(result.model, dict(np.load(THIRDPARTY / f"{stem}.npz")))
    for k, v in ref.items():
        np.testing.assert_allclose(got[k], v, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["deepctr_torch_DIN_legacy", "deepctr_torch_DIN_dynamo", "deepctr_DIN_tf2onnx"])
def test_third_party_din_attention_reads_the_query_once_per_row(name):
    """After `all`: the query (torch's Expand, tf2onnx's Concat of T copies) is read once per row and its part of
    the first layer projected once per row; deepctr-torch's Dice (Transpose → BatchNorm1d → mix → Transpose)
    runs on the rows of one 2-D chain, no Transpose or BatchNormalization left in the region."""
    raw = ctropt.load(THIRDPARTY / f"{name}.onnx")
    result = ctropt.optimize(raw, passes="all", speed=False)
    notes = [note for r in result.records if r.name == "remove-attention-padding" for note in r.notes]
    assert any("1 read once per row, its part of 1 layer(s) projected once per row" in n for n in notes), notes
    folded = [r.rewrites for r in result.records if r.name == "fold-fc-affine"]
    assert folded == [2]  # each Dice's normalization, the first layer's through its per-row part too
    g = result.model.graph
    region = [n for n in g.node if "/valid" in n.name]
    assert not [n.name for n in region if n.op_type == "BatchNormalization" or
                (n.op_type == "Transpose" and not n.input[0].endswith("NonZero:0"))]
    assert not [n.name for n in g.node if n.op_type == "Concat" and len(n.input) > 2 and len(set(n.input)) == 1]
    feeds = dict(np.load(THIRDPARTY / f"{name}.npz"))
    assert_same_outputs(raw, result.model, feeds, atol=1e-5, rtol=1e-4)


def test_inspect_previews_the_passes_as_all_runs_them():
    """inspect's dry run chains the passes: cancel-transposes after fold-batchnorm, and the attention region that
    both open up, as in `optimize` (a preview of each pass alone would see neither)."""
    from ctropt.inspect import preview_passes
    from ctropt.passes import resolve

    raw = ctropt.load(THIRDPARTY / "deepctr_torch_DIN_legacy.onnx")
    previews = {p.name: p for p in preview_passes(raw, resolve("all", (), "ort"), "ort", explain_misses=False)}
    assert previews["fold-batchnorm"].rewrites == 2 and previews["cancel-transposes"].rewrites == 2
    assert any("projected once per row" in n for n in previews["remove-attention-padding"].notes)
    assert previews["fold-fc-affine"].rewrites == 2


def zero_row_din_attention(zero_row: bool = True, stacked: bool = False, softmax: bool = False, seed: int = 0):
    """torch-rechub's DIN: no mask at all; the keys are an Embedding(padding_idx=0) lookup whose row 0 is zeros, so
    padded positions add nothing to Σ w·k. `stacked`: the keys picked out of lookups stacked on axis 1."""
    rng = np.random.default_rng(seed)
    table = rng.normal(size=(20, C)).astype(np.float32)
    if zero_row:
        table[0] = 0
    nodes = [node("Gather", ["table", "ids"], ["looked"])]
    if stacked:
        nodes += [node("Gather", ["table2", "ids"], ["other"]), node("Unsqueeze", ["looked", "ax1"], ["l1"]),
                  node("Unsqueeze", ["other", "ax1"], ["o1"]), node("Concat", ["l1", "o1"], ["both"], axis=1),
                  node("Gather", ["both", "zero"], ["keys"], axis=1)]
    else:
        nodes += [node("Identity", ["looked"], ["keys"])]
    nodes += _tiled_query_features()
    mlp, inits = _scores(rng, "qt")
    nodes += mlp[3:]  # the tiled query's Sub/Mul/Concat come from _tiled_query_features
    weights = "s"
    if softmax:
        nodes.append(node("Softmax", ["s"], ["sm"], axis=1))
        weights = "sm"
    nodes += [node("Mul", [weights, "keys"], ["wk"]), node("ReduceSum", ["wk", "ax1"], ["out"], keepdims=0)]
    inits += [init("table", table), init("table2", rng.normal(size=(20, C)).astype(np.float32)),
              init("ax1", np.array([1], np.int64)), init("zero", np.array(0, np.int64))]
    inputs = [vi("q", F, ["batch", C]), vi("ids", I64, ["batch", "seq_len"])]
    return make_model(nodes, inputs, [vi("out", F, ["batch", C])], inits)


def _zero_row_feeds(lengths, T=7, seed=1):
    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths)
    ids = np.where(np.arange(T)[None, :] < lengths[:, None], rng.integers(0, 20, (len(lengths), T)), 0)
    return {"q": rng.normal(size=(len(lengths), C)).astype(np.float32), "ids": ids.astype(np.int64)}


@pytest.mark.parametrize("stacked", [False, True])
def test_a_zero_embedding_row_is_the_padding(stacked):
    """The weights that pool a lookup whose row 0 is zeros are masked by ids != 0 (exact: w·0 = 0), and the MLP then
    runs on the other positions only; the history inputs are generated padded with 0."""
    model = zero_row_din_attention(stacked=stacked)
    once, ctx = run_pass(model, "remove-attention-padding")
    assert ctx.rewrites == 1, ctx.notes
    assert any("zero row is padding" in n for n in ctx.notes), ctx.notes
    assert "Equal" in ops(once) and "Compress" in ops(once)
    # the pooling Σ w·k runs on the valid positions too: a scatter-add of s·k into each row, no ReduceSum over T
    adds = [n for n in once.graph.node if n.op_type == "ScatterND" and
            any(a.name == "reduction" and a.s == b"add" for a in n.attribute)]
    assert len(adds) == 1 and "ReduceSum" not in ops(once), ops(once)
    for lengths in ([7, 0, 3, 7, 1], [0], [7], [2, 5, 7, 0, 4, 4, 1, 6]):
        assert_same_outputs(model, once, _zero_row_feeds(lengths), atol=1e-5, rtol=1e-5)
    twice, ctx2 = run_pass(once, "remove-attention-padding")
    assert ctx2.rewrites == 0 and sorted(ops(twice)) == sorted(ops(once))
    assert ctropt.graph.interface(once) == ctropt.graph.interface(model)
    ids = generate_inputs(model, batch=64)["ids"]
    assert 0.2 < (ids == 0).mean() < 0.8


@pytest.mark.parametrize("why", ["no zero row", "softmax"])
def test_a_lookup_without_a_zero_row_or_weights_normalized_over_padding_stay(why):
    """Without a zero row nothing says which positions are padding; with a softmax the padded scores change the
    weights of the valid positions, so the region is not position-wise: the mask made explicit is taken back."""
    model = zero_row_din_attention(zero_row=why != "no zero row", softmax=why == "softmax")
    once, ctx = run_pass(model, "remove-attention-padding")
    assert ctx.rewrites == 0 and sorted(ops(once)) == sorted(ops(model)), ctx.notes


def test_pooling_stays_where_scatter_cannot_add():
    """Before opset 16 ScatterND has no reduction: the scores run on the valid positions, the pooling stays."""
    model = zero_row_din_attention()
    model.opset_import[0].version = 15
    once, ctx = run_pass(model, "remove-attention-padding")
    assert ctx.rewrites == 1 and "ReduceSum" in ops(once), ctx.notes
    assert_same_outputs(model, once, _zero_row_feeds([7, 0, 3, 7, 1]), atol=1e-5, rtol=1e-5)
