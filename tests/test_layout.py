"""fold-batchnorm and cancel-transposes: Dice as PyTorch exports it over [B, T, H] (Transpose → BatchNormalization
→ elementwise → Transpose back), rows reshaped to rank 3 and back around elementwise ops, and what must stay."""

from __future__ import annotations

import numpy as np
from onnx import numpy_helper
from helpers import F, I64, assert_same_outputs, init, make_model, node, ops, run_pass, vi

import ctropt

H = 5


def dice_3d(seed: int = 0):
    """x [B, T, H] → Linear → Dice (deepctr-torch: transpose, BatchNorm1d over H, mix α·(1-p)·x + p·x, transpose
    back) → Linear → [B, T, 1]."""
    rng = np.random.default_rng(seed)
    nodes = [
        node("MatMul", ["x", "w1"], ["h"]),
        node("Transpose", ["h"], ["ht"], perm=[0, 2, 1]),  # [B, H, T]
        node("BatchNormalization", ["ht", "scale", "bias", "mean", "var"], ["n"], epsilon=1e-3),
        node("Sigmoid", ["n"], ["p"]),
        node("Sub", ["one", "p"], ["q"]),
        node("Mul", ["alpha", "q"], ["aq"]),
        node("Mul", ["aq", "ht"], ["m1"]),
        node("Mul", ["p", "ht"], ["m2"]),
        node("Add", ["m1", "m2"], ["d"]),
        node("Transpose", ["d"], ["dt"], perm=[0, 2, 1]),
        node("MatMul", ["dt", "w2"], ["y"]),
    ]
    inits = [init("w1", rng.normal(size=(3, H)).astype(np.float32)),
             init("w2", rng.normal(size=(H, 1)).astype(np.float32)),
             init("scale", rng.uniform(0.5, 2, H).astype(np.float32)),
             init("bias", rng.normal(size=H).astype(np.float32)),
             init("mean", rng.normal(size=H).astype(np.float32)),
             init("var", rng.uniform(0.5, 2, H).astype(np.float32)),
             init("one", np.array(1.0, np.float32)),
             init("alpha", rng.normal(size=(H, 1)).astype(np.float32))]
    return make_model(nodes, [vi("x", F, ["batch", "seq_len", 3])], [vi("y", F, ["batch", "seq_len", 1])], inits)


def _feeds(batch=4, steps=6, seed=1):
    return {"x": np.random.default_rng(seed).normal(size=(batch, steps, 3)).astype(np.float32)}


def test_fold_batchnorm_is_a_per_channel_affine_map():
    model = dice_3d()
    once, ctx = run_pass(model, "fold-batchnorm")
    assert ctx.rewrites == 1 and "BatchNormalization" not in ops(once)
    assert sorted(ops(once)) == sorted([op for op in ops(model) if op != "BatchNormalization"] + ["Mul", "Add"])
    for feeds in (_feeds(), _feeds(1, 1), _feeds(7, 3, seed=2)):
        assert_same_outputs(model, once, feeds, atol=1e-5, rtol=1e-5)
    twice, ctx2 = run_pass(once, "fold-batchnorm")
    assert ctx2.rewrites == 0 and ops(twice) == ops(once)


def test_batchnorm_with_statistics_from_the_graph_is_kept():
    model = dice_3d()
    model.graph.input.append(vi("mean", F, [H]))
    model.graph.initializer.remove(next(t for t in model.graph.initializer if t.name == "mean"))
    once, ctx = run_pass(model, "fold-batchnorm")
    assert ctx.rewrites == 0 and "BatchNormalization" in ops(once)


def test_transposes_around_dice_cancel_and_its_constants_are_permuted():
    folded, _ = run_pass(dice_3d(), "fold-batchnorm")
    once, ctx = run_pass(folded, "cancel-transposes")
    assert ctx.rewrites == 1
    assert sorted(ops(once)) == sorted(op for op in ops(folded) if op != "Transpose")
    consts = {t.name: t for t in once.graph.initializer}
    mul_alpha = next(n for n in once.graph.node if n.op_type == "Mul" and "aq" in n.output[0])
    alpha = next(consts[i] for i in mul_alpha.input if i in consts)
    assert list(alpha.dims) == [1, 1, H]  # [H, 1] over [B, H, T] is [1, 1, H] over [B, T, H]
    for feeds in (_feeds(), _feeds(1, 1), _feeds(5, 9, seed=3)):
        assert_same_outputs(dice_3d(), once, feeds, atol=1e-5, rtol=1e-5)
    twice, ctx2 = run_pass(once, "cancel-transposes")
    assert ctx2.rewrites == 0 and ops(twice) == ops(once)
    assert ctropt.graph.interface(once) == ctropt.graph.interface(dice_3d())


def test_a_transpose_read_by_anything_but_elementwise_ops_stays():
    """The first Transpose also feeds a MatMul: its layout is needed as is."""
    folded, _ = run_pass(dice_3d(), "fold-batchnorm")
    folded.graph.node.append(node("ReduceSum", ["ht"], ["side"], keepdims=0))
    folded.graph.output.append(vi("side", F, None))
    once, ctx = run_pass(folded, "cancel-transposes")
    assert ctx.rewrites == 0 and ops(once).count("Transpose") == 2


def test_transpose_without_its_inverse_stays():
    model = dice_3d()
    for n in model.graph.node:
        if n.output[0] == "dt":
            n.op_type, n.input[:] = "Identity", ["d"]
            del n.attribute[:]
    model.graph.node[-1].input[1] = "w2t"
    model.graph.initializer.append(init("w2t", np.ones((6, 1), np.float32)))
    folded, _ = run_pass(model, "fold-batchnorm")
    once, ctx = run_pass(folded, "cancel-transposes")
    assert ctx.rewrites == 0 and "Transpose" in ops(once)


def rows_reshaped(seed: int = 0):
    """rows [M, H] → Reshape [-1, 4, H] → elementwise with a per-column constant → Reshape [-1, H] (and a Shape
    reader of the rank-3 value): what fuse-fc leaves between two flattened layers."""
    rng = np.random.default_rng(seed)
    nodes = [
        node("Reshape", ["r", "to3"], ["r3"]),
        node("Sigmoid", ["r3"], ["s"]),
        node("Mul", ["s", "col"], ["m"]),
        node("Add", ["m", "r3"], ["a"]),
        node("Reshape", ["a", "to2"], ["a2"]),
        node("MatMul", ["a2", "w"], ["y"]),
        node("Shape", ["a"], ["shape"]),
    ]
    inits = [init("to3", np.array([-1, 4, H], np.int64)), init("to2", np.array([-1, H], np.int64)),
             init("col", rng.normal(size=(1, 1, H)).astype(np.float32)),
             init("w", rng.normal(size=(H, 2)).astype(np.float32))]
    return make_model(nodes, [vi("r", F, ["rows", H])], [vi("y", F, ["rows", 2]), vi("shape", 7, [3])], inits)


def test_rows_reshaped_around_elementwise_ops_stay_rows():
    model = rows_reshaped()
    once, ctx = run_pass(model, "cancel-transposes")
    assert ctx.rewrites == 1
    assert ops(once).count("Reshape") == 1  # kept for the Shape reader only; the elementwise ops read the rows
    sigmoid = next(n for n in once.graph.node if n.op_type == "Sigmoid")
    assert sigmoid.input[0] == "r"
    feeds = {"r": np.random.default_rng(2).normal(size=(8, H)).astype(np.float32)}
    assert_same_outputs(model, once, feeds, atol=0, rtol=0)
    twice, ctx2 = run_pass(once, "cancel-transposes")
    assert ctx2.rewrites == 0



def test_an_inverse_transpose_reading_the_entry_directly_gets_the_source():
    nodes = [node("Transpose", ["x"], ["xt"], perm=[0, 2, 1]),
             node("Sigmoid", ["xt"], ["s"]),
             node("Transpose", ["s"], ["a"], perm=[0, 2, 1]),
             node("Transpose", ["xt"], ["b"], perm=[0, 2, 1]),
             node("Add", ["a", "b"], ["y"])]
    model = make_model(nodes, [vi("x", F, ["batch", 4, 3])], [vi("y", F, ["batch", 4, 3])])
    once, ctx = run_pass(model, "cancel-transposes")
    assert ctx.rewrites == 1 and sorted(ops(once)) == ["Add", "Sigmoid"]
    feeds = {"x": np.random.default_rng(0).normal(size=(2, 4, 3)).astype(np.float32)}
    assert_same_outputs(model, once, feeds, atol=0, rtol=0)


def masked_select(mask_shape=(-1, 1, 1), lens_dtype=I64):
    """deepctr-torch DIEN's packing of the users that have a history: torch.masked_select(emb, (lens > 0) viewed
    [B, 1, 1]) as the legacy exporter writes it (one GatherND index per selected element), viewed [-1, T, E]."""
    nodes = [
        node("Greater", ["lens", "zero"], ["has"]),
        node("Reshape", ["has", "mask_shape"], ["m"]),
        node("Shape", ["emb"], ["s"]),
        node("Expand", ["m", "s"], ["full"]),
        node("NonZero", ["full"], ["nz"]),
        node("Transpose", ["nz"], ["idx"], perm=[1, 0]),
        node("GatherND", ["emb", "idx"], ["flat"]),
        node("Reshape", ["flat", "packed_shape"], ["packed"]),
    ]
    inits = [init("zero", np.array(0, np.int64 if lens_dtype == I64 else np.float32)),
             init("mask_shape", np.array(mask_shape, np.int64)), init("packed_shape", np.array([-1, 4, 3], np.int64))]
    return make_model(nodes, [vi("emb", F, ["batch", 4, 3]), vi("lens", lens_dtype, ["batch"])],
                      [vi("packed", F, [None, 4, 3])], inits)


def test_masked_select_over_rows_becomes_a_compress():
    model = masked_select()
    once, ctx = run_pass(model, "select-masked-rows")
    assert ctx.rewrites == 1 and not {"NonZero", "GatherND"} & set(ops(once)) and "Compress" in ops(once)
    rng = np.random.default_rng(0)
    for lens in ([0, 3, 0, 4, 1], [2, 2], [0, 0, 0], [5]):
        feeds = {"emb": rng.normal(size=(len(lens), 4, 3)).astype(np.float32), "lens": np.array(lens, np.int64)}
        assert_same_outputs(model, once, feeds, atol=0, rtol=0)
    twice, ctx2 = run_pass(once, "select-masked-rows")
    assert ctx2.rewrites == 0 and ops(twice) == ops(once)


def test_masked_select_of_a_mask_that_is_not_per_row_is_kept():
    """A mask [B, T, 1] selects single steps, not rows: the GatherND stays."""
    model = masked_select(mask_shape=(-1, 4, 1))
    model.graph.node[0].input[0] = "lens_bt"
    model.graph.input[1].CopyFrom(vi("lens_bt", I64, ["batch", 4]))
    once, ctx = run_pass(model, "select-masked-rows")
    assert ctx.rewrites == 0 and "GatherND" in ops(once)


def dlrm_interaction(dialect="legacy", mask=None):
    """FuxiCTR's DLRM: the [B, F, F] dot products of F feature vectors, masked_select by a constant upper-triangle
    mask (an initializer [F, F]), as the legacy exporter writes it (GatherND at the NonZero of the mask expanded to
    the products) or the dynamo exporter does (Compress of both flattened); viewed [-1, K]."""
    f, e = 5, 3
    mask = np.triu(np.ones((f, f), bool), 1) if mask is None else mask
    select = ([node("NonZero", ["full"], ["nz"]), node("Transpose", ["nz"], ["idx"], perm=[1, 0]),
               node("GatherND", ["dots", "idx"], ["flat"])] if dialect == "legacy" else
              [node("Reshape", ["dots", "minus1"], ["dots_flat"]), node("Reshape", ["full", "minus1"], ["mask_flat"]),
               node("Compress", ["dots_flat", "mask_flat"], ["flat"], axis=0)])
    nodes = [node("Transpose", ["x"], ["xt"], perm=[0, 2, 1]), node("MatMul", ["x", "xt"], ["dots"]),
             node("Shape", ["dots"], ["s"]), node("Expand", ["triu_mask", "s"], ["full"]), *select,
             node("Reshape", ["flat", "view_shape"], ["pairs"])]
    inits = [init("triu_mask", mask), init("minus1", np.array([-1], np.int64)),
             init("view_shape", np.array([-1, int(mask.sum()) // (len(mask) if mask.ndim == 3 else 1)], np.int64))]
    return make_model(nodes, [vi("x", F, ["batch", f, e])], [vi("pairs", F, ["batch", None])], inits)


def test_masked_select_by_a_constant_mask_becomes_one_gather():
    for dialect in ("legacy", "dynamo"):
        model = dlrm_interaction(dialect)
        once, ctx = run_pass(model, "select-masked-rows")
        assert ctx.rewrites == 1, dialect
        assert not {"NonZero", "GatherND", "Compress", "Expand"} & set(ops(once)) and "Gather" in ops(once)
        gather = next(n for n in once.graph.node if n.op_type == "Gather")
        indices = next(i for i in once.graph.initializer if i.name == gather.input[1])
        assert numpy_helper.to_array(indices).tolist() == np.flatnonzero(np.triu(np.ones((5, 5)), 1)).tolist()
        for batch in (0, 1, 7):
            feeds = {"x": np.random.default_rng(batch).normal(size=(batch, 5, 3)).astype(np.float32)}
            assert_same_outputs(model, once, feeds, atol=0, rtol=0)
        twice, ctx2 = run_pass(once, "select-masked-rows")
        assert ctx2.rewrites == 0 and ops(twice) == ops(once)


def test_a_constant_mask_that_varies_along_the_batch_axis_is_kept():
    """A mask [2, F, F] selects different elements in each of two rows (only batch 2 runs): not one Gather."""
    mask = np.stack([np.triu(np.ones((5, 5), bool), 1), np.tril(np.ones((5, 5), bool), -1)])
    model = dlrm_interaction(mask=mask)
    model.graph.input[0].CopyFrom(vi("x", F, [2, 5, 3]))
    once, ctx = run_pass(model, "select-masked-rows")
    assert ctx.rewrites == 0 and "GatherND" in ops(once)


def masked_scatter(mask_shape=(-1, 1, 1)):
    """torch-rechub DIEN's unpacking of the GRU outputs of the users that have a history: out = zeros [B, T, E];
    out[(lens > 0) viewed [B, 1, 1] expanded] = packed.view(-1)[:count] (legacy exporter: one ScatterND index per
    element, the source sliced to the number of indices, read off their Shape)."""
    nodes = [
        node("Shape", ["emb"], ["s0"]), node("ConstantOfShape", ["s0"], ["zeros"]),
        node("Greater", ["lens", "zero"], ["has"]), node("Reshape", ["has", "mask_shape"], ["m"]),
        node("Shape", ["zeros"], ["s"]), node("Expand", ["m", "s"], ["full"]),
        node("NonZero", ["full"], ["nz"]), node("Transpose", ["nz"], ["idx"], perm=[1, 0]),
        node("Shape", ["idx"], ["idx_shape"]), node("Gather", ["idx_shape", "zero"], ["count"], axis=0),
        node("Unsqueeze", ["count", "axis0"], ["end"]),
        node("Reshape", ["packed", "flat"], ["packed_flat"]), node("Slice", ["packed_flat", "start", "end"], ["src"]),
        node("ScatterND", ["zeros", "idx", "src"], ["out"]),
    ]
    inits = [init("zero", np.array(0, np.int64)), init("axis0", np.array([0], np.int64)),
             init("start", np.array([0], np.int64)), init("flat", np.array([-1], np.int64)),
             init("mask_shape", np.array(mask_shape, np.int64))]
    return make_model(nodes, [vi("emb", F, ["batch", 4, 3]), vi("lens", I64, ["batch"]),
                              vi("packed", F, ["rows", 4, 3])], [vi("out", F, ["batch", 4, 3])], inits)


def test_masked_scatter_over_rows_writes_rows():
    """The scatter writes whole rows and the count of indices is computed from the flags: no NonZero over
    elements is left (B·T·E flags scanned, K indices written) and the scatter reads R row indices."""
    model = masked_scatter()
    once, ctx = run_pass(model, "select-masked-rows")
    assert ctx.rewrites == 2, ctx.notes
    nonzero = [n for n in once.graph.node if n.op_type == "NonZero"]
    assert len(nonzero) == 1 and "Expand" in ops(once)
    assert any(n.op_type == "ReduceSum" for n in once.graph.node)  # the count of flagged rows × T·E
    rng = np.random.default_rng(1)
    for lens in ([0, 3, 0, 4, 1], [2, 2], [0, 0, 0], [5]):
        rows = sum(x > 0 for x in lens) + 1  # the source may hold more rows than are written
        feeds = {"emb": np.zeros((len(lens), 4, 3), np.float32), "lens": np.array(lens, np.int64),
                 "packed": rng.normal(size=(rows, 4, 3)).astype(np.float32)}
        assert_same_outputs(model, once, feeds, atol=1e-12, rtol=0)
    twice, ctx2 = run_pass(once, "select-masked-rows")
    assert ctx2.rewrites == 0 and ops(twice) == ops(once)


def test_masked_scatter_of_a_mask_that_is_not_per_row_is_kept():
    model = masked_scatter(mask_shape=(-1, 4, 1))
    model.graph.node[2].input[0] = "lens_bt"
    model.graph.input[1].CopyFrom(vi("lens_bt", I64, ["batch", 4]))
    once, ctx = run_pass(model, "select-masked-rows")
    assert ctx.rewrites == 0 and ops(once).count("NonZero") == 1 and "ScatterND" in ops(once)


def einsum_attention(score_eq="bnik,bnjk->bnij"):
    """PaddleRec AutoInt (paddle2onnx): projections `bnk,kj->bnj`, scores `bnik,bnjk->bnij`, then softmax · V."""
    rng = np.random.default_rng(2)
    nodes = [node("Einsum", ["x", "wq"], ["q"], equation="bnk,kj->bnj"),
             node("Einsum", ["x", "wk"], ["k"], equation="bnk,kj->bnj"),
             node("Unsqueeze", ["q", "ax1"], ["q4"]), node("Unsqueeze", ["k", "ax1"], ["k4"]),
             node("Einsum", ["q4", "k4"], ["s"], equation=score_eq), node("Softmax", ["s"], ["p"], axis=-1),
             node("MatMul", ["p", "k4"], ["y"])]
    inits = [init("wq", rng.normal(size=(8, 8)).astype(np.float32)), init("wk", rng.normal(size=(8, 8)).astype(np.float32)),
             init("ax1", np.array([1]))]
    return make_model(nodes, [vi("x", F, ["B", 6, 8])], [vi("y", F, ["B", 1, 6, 8])], inits, opset=13)


def test_einsums_that_are_matrix_products_become_matmuls():
    from helpers import check_pass

    out, ctx = check_pass(einsum_attention(), "einsum-as-matmul",
                          ["MatMul", "MatMul", "Unsqueeze", "Unsqueeze", "Transpose", "MatMul", "Softmax", "MatMul"])
    assert ctx.rewrites == 3
    transposed = next(n for n in out.graph.node if n.op_type == "Transpose")
    assert list(transposed.attribute[0].ints) == [0, 1, 3, 2]


def test_other_einsums_stay():
    """An outer product (xDeepFM's CIN: bhd,bmd->bhmd) and a trace-like contraction are not matrix products."""
    for eq in ("bnid,bnjd->bnijd", "bnii,bnjk->bnij"):
        model = einsum_attention(eq)
        done, ctx = run_pass(model, "einsum-as-matmul")
        assert ops(done).count("Einsum") == 1 and ctx.rewrites == 2
