"""Each cleanup pass: a tiny input graph, the expected rewritten graph, a numeric check, idempotence."""

import numpy as np
from onnx import TensorProto, helper

from ctropt.graph import interface
from helpers import F, I64, assert_same_outputs, check_pass, init, make_model, node, ops, run_pass, vi

X = [vi("x", F, ["B", 4])]
Y = [vi("y", F, ["B", 4])]


def test_eliminate_dead_nodes_including_loop_bodies_keeps_unused_inputs():
    body = helper.make_graph(
        [node("Neg", ["v_in"], ["v_out"]), node("Exp", ["v_in"], ["dead_in_body"]),
         node("Identity", ["c_in"], ["c_out"])],
        "body", [vi("i", I64, []), vi("c_in", TensorProto.BOOL, []), vi("v_in", F, None)],
        [vi("c_out", TensorProto.BOOL, []), vi("v_out", F, None)])
    model = make_model(
        [node("Relu", ["x"], ["dead"]), node("Loop", ["n", "", "x"], ["y"], body=body)],
        [vi("x", F, ["B", 4]), vi("n", I64, []), vi("unused", F, [3])], Y)
    out, ctx = check_pass(model, "eliminate-dead-nodes", ["Loop"], feeds={
        "x": np.ones((2, 4), np.float32), "n": np.array(3), "unused": np.zeros(3, np.float32)})
    assert ctx.rewrites == 2
    assert [n.op_type for n in out.graph.node[0].attribute[0].g.node] == ["Neg", "Identity"]
    assert [i.name for i in out.graph.input] == ["x", "n", "unused"]


def test_infer_shapes_annotates_intermediates_not_the_interface():
    model = make_model([node("Relu", ["x"], ["r"]), node("Neg", ["r"], ["y"])], X, [vi("y", F, None)])
    out, ctx = run_pass(model, "infer-shapes")
    assert ctx.rewrites == 0 and ctx.notes == ["1 values annotated with their dtypes and shapes"]  # not rewrites
    shapes = {v.name: v for v in out.graph.value_info}
    assert [d.dim_param or d.dim_value for d in shapes["r"].type.tensor_type.shape.dim] == ["B", 4]
    assert interface(out) == interface(model)  # y stays shapeless, as exported
    assert run_pass(out, "infer-shapes")[1].rewrites == 0


def test_prune_inference_dropout():
    model = make_model([node("Dropout", ["x", "ratio"], ["d"]), node("Relu", ["d"], ["y"])], X, Y,
                       [init("ratio", np.float32(0.3))])
    check_pass(model, "prune-training-ops", ["Relu"])


def test_dropout_in_training_mode_is_kept():
    model = make_model([node("Dropout", ["x", "ratio", "train"], ["d"]), node("Relu", ["d"], ["y"])], X, Y,
                       [init("ratio", np.float32(0.3)), init("train", np.bool_(True))])
    assert ops(run_pass(model, "prune-training-ops")[0]) == ["Dropout", "Relu"]


def no_op_model():
    nodes = [
        node("Identity", ["x"], ["a"]),
        node("Cast", ["a"], ["b"], to=TensorProto.FLOAT),
        node("Reshape", ["b", "same_shape"], ["c"]),
        node("Mul", ["one", "c"], ["d"]),  # constant first: Mul is commutative
        node("Add", ["d", "zero"], ["e"]),
        node("Transpose", ["e"], ["f"], perm=[0, 1]),
        node("Unsqueeze", ["f", "ax0"], ["g"]),
        node("Squeeze", ["g", "ax0"], ["h"]),
        node("Concat", ["h"], ["i"], axis=1),
        node("Slice", ["i", "starts", "ends"], ["j"]),
        node("Relu", ["j"], ["y"]),
    ]
    inits = [init("same_shape", np.array([0, 4])), init("one", np.float32(1)), init("zero", np.zeros(4, np.float32)),
             init("ax0", np.array([0])), init("starts", np.array([0])), init("ends", np.array([2**62]))]
    return make_model(nodes, X, Y, inits)


def test_eliminate_identity_removes_every_no_op_form():
    model, _ = run_pass(no_op_model(), "infer-shapes")
    out, ctx = check_pass(model, "eliminate-identity", ["Relu"])
    assert ctx.rewrites == 9  # Squeeze(Unsqueeze(x)) goes in one rewrite


def test_no_op_that_would_broadcast_is_kept():
    model = make_model([node("Add", ["x", "zeros"], ["y"])], [vi("x", F, ["B", 1])], [vi("y", F, ["B", 4])],
                       [init("zeros", np.zeros(4, np.float32))])
    model, _ = run_pass(model, "infer-shapes")
    assert ops(run_pass(model, "eliminate-identity")[0]) == ["Add"]


def test_cast_to_another_type_is_kept():
    model = make_model([node("Cast", ["x"], ["y"], to=TensorProto.INT64)], X, [vi("y", I64, ["B", 4])])
    assert ops(run_pass(model, "eliminate-identity")[0]) == ["Cast"]


def test_identity_feeding_a_graph_output_renames_the_producer():
    model = make_model([node("Relu", ["x"], ["r"]), node("Identity", ["r"], ["y"])], X, Y)
    out, _ = check_pass(model, "eliminate-identity", ["Relu"])
    assert out.graph.node[0].output[0] == "y"


def test_identity_of_a_graph_input_to_an_output_stays():
    model = make_model([node("Identity", ["x"], ["y"])], X, Y)
    assert ops(run_pass(model, "eliminate-identity")[0]) == ["Identity"]


def test_reshape_and_transpose_chains_merge():
    model = make_model(
        [node("Reshape", ["x", "s1"], ["a"]), node("Reshape", ["a", "s2"], ["b"]),
         node("Transpose", ["b"], ["c"], perm=[1, 0]), node("Transpose", ["c"], ["d"], perm=[1, 0]),
         node("Transpose", ["d"], ["e"], perm=[1, 0]), node("Relu", ["e"], ["y"])],
        X, [vi("y", F, [None, None])], [init("s1", np.array([-1])), init("s2", np.array([-1, 2]))])
    check_pass(model, "eliminate-identity", ["Reshape", "Transpose", "Relu"])


def test_reshape_chain_with_copied_dims_is_kept():
    model = make_model([node("Reshape", ["x", "s1"], ["a"]), node("Reshape", ["a", "s2"], ["y"])],
                       X, [vi("y", F, None)], [init("s1", np.array([-1, 2])), init("s2", np.array([0, -1]))])
    assert ops(run_pass(model, "eliminate-identity")[0]) == ["Reshape", "Reshape"]


def test_fold_constants_evaluates_constant_subgraphs():
    model = make_model(
        [node("Constant", [], ["c"], value=helper.make_tensor("v", F, [4], [1, 2, 3, 4])),
         node("Exp", ["c"], ["ec"]), node("Mul", ["ec", "k"], ["w"]), node("Add", ["x", "w"], ["y"])],
        X, Y, [init("k", np.full(4, 0.5, np.float32))])
    check_pass(model, "fold-constants", ["Add"])


def test_fold_constants_respects_the_size_cap():
    model = make_model([node("Tile", ["k", "reps"], ["big"]), node("Gather", ["big", "ids"], ["y"])],
                       [vi("ids", I64, ["B"])], [vi("y", F, ["B", 4])],
                       [init("k", np.ones((1, 4), np.float32)), init("reps", np.array([1000, 1]))])
    assert ops(run_pass(model, "fold-constants", fold_size_cap=1000)[0]) == ["Tile", "Gather"]
    assert ops(run_pass(model, "fold-constants")[0]) == ["Gather"]


def test_dedup_initializers_within_and_into_subgraphs():
    model = make_model([node("Add", ["x", "b1"], ["a"]), node("Add", ["a", "b2"], ["y"])], X, Y,
                       [init("b1", np.ones(4, np.float32)), init("b2", np.ones(4, np.float32))])
    out, ctx = check_pass(model, "dedup-initializers", ["Add", "Add"])
    assert ctx.rewrites == 1 and len(out.graph.initializer) == 1


def test_common_subexpressions_merge_transitively():
    model = make_model(
        [node("Relu", ["x"], ["r1"]), node("Relu", ["x"], ["r2"]), node("Exp", ["r1"], ["e1"]),
         node("Exp", ["r2"], ["e2"]), node("Add", ["e1", "e2"], ["y"]),
         node("Softmax", ["x"], ["s1"], axis=0), node("Softmax", ["x"], ["s2"], axis=1),
         node("Add", ["s1", "s2"], ["z"])],
        X, [vi("y", F, ["B", 4]), vi("z", F, ["B", 4])])
    out, ctx = check_pass(model, "eliminate-common-subexpressions",
                          ["Relu", "Exp", "Add", "Softmax", "Softmax", "Add"])
    assert ctx.rewrites == 2


def test_duplicate_graph_outputs_keep_both_names():
    model = make_model([node("Relu", ["x"], ["y"]), node("Relu", ["x"], ["z"])], X, [vi("y", F, ["B", 4]),
                                                                                      vi("z", F, ["B", 4])])
    out, _ = check_pass(model, "eliminate-common-subexpressions", ["Relu", "Identity"])
    assert [o.name for o in out.graph.output] == ["y", "z"]


def masked_pooling_model():
    """TransAct's readout as torch exports it: the padding mask unsqueezed, expanded by ones and tiled to [B, L, D],
    the sequence filled with 0 then -inf where padded, its first token sliced and its max over L taken."""
    nodes = [node("Unsqueeze", ["pad", "ax2"], ["m3"]), node("Expand", ["m3", "ones3"], ["me"]),
             node("Tile", ["me", "reps"], ["mt"]), node("Where", ["mt", "zero", "x"], ["filled"]),
             node("Slice", ["filled", "s0", "s1", "ax1"], ["first"]),
             node("Where", ["mt", "ninf", "filled"], ["masked"]),
             node("ReduceMax", ["masked"], ["pooled"], axes=[1], keepdims=1),
             node("Concat", ["first", "pooled"], ["y"], axis=1)]
    inits = [init("ax2", np.array([2])), init("ones3", np.ones(3, np.int64)), init("reps", np.array([1, 1, 4])),
             init("zero", np.float32(0)), init("ninf", np.float32(-np.inf)), init("s0", np.array([0])),
             init("s1", np.array([1])), init("ax1", np.array([1]))]
    return make_model(nodes, [vi("pad", TensorProto.BOOL, ["B", 5]), vi("x", F, ["B", 5, 4])],
                      [vi("y", F, ["B", 2, 4])], inits)


def test_masked_fill_reads_the_mask_by_broadcast_and_the_first_tokens_only():
    model, _ = run_pass(masked_pooling_model(), "infer-shapes")
    pad = np.random.default_rng(0).random((3, 5)) < 0.5
    pad[:, 0] = False   # a position that is never padded: the max is finite
    feeds = {"pad": pad, "x": np.random.default_rng(1).standard_normal((3, 5, 4)).astype(np.float32)}
    out, ctx = check_pass(model, "eliminate-identity",
                          ["Unsqueeze", "Slice", "Slice", "Where", "Where", "ReduceMax", "Concat"], feeds)
    where_inputs = [list(n.input) for n in out.graph.node if n.op_type == "Where"]
    assert ["m3", "ninf", "x"] in where_inputs   # the mask read once, untiled; the 0-fill under the -inf one gone
    slices = [n for n in out.graph.node if n.op_type == "Slice"]
    assert {n.input[0] for n in slices} == {"m3", "x"}   # the Where of the first token runs on it only


def test_tile_read_by_an_op_that_needs_its_width_is_kept():
    nodes = [node("Tile", ["m", "reps"], ["mt"]), node("Where", ["mt", "zero", "one"], ["y"])]
    model = make_model(nodes, [vi("m", TensorProto.BOOL, ["B", 5, 1])], [vi("y", F, ["B", 5, 4])],
                       [init("reps", np.array([1, 1, 4])), init("zero", np.float32(0)), init("one", np.float32(1))])
    model, _ = run_pass(model, "infer-shapes")
    assert ops(run_pass(model, "eliminate-identity")[0]) == ["Tile", "Where"]


def test_where_under_another_condition_and_a_slice_of_an_unknown_operand_are_kept():
    nodes = [node("Where", ["c1", "zero", "x"], ["a"]), node("Where", ["c2", "zero", "a"], ["b"]),
             node("Add", ["b", "z"], ["s"]), node("Slice", ["s", "s0", "s1", "ax1"], ["y"])]
    model = make_model(nodes, [vi("c1", TensorProto.BOOL, ["B", 5, 1]), vi("c2", TensorProto.BOOL, ["B", 5, 1]),
                               vi("x", F, ["B", 5, 4]), vi("z", F, None)], [vi("y", F, None)],
                       [init("zero", np.float32(0)), init("s0", np.array([0])), init("s1", np.array([1])),
                        init("ax1", np.array([1]))])
    assert ops(run_pass(model, "eliminate-identity")[0]) == ["Where", "Where", "Add", "Slice"]


def packed_projection_model():
    """torch's packed in-projection of q, k and v (nn.MultiheadAttention, both exporters): [L, B, 3, E] unsqueezed,
    transposed to [3, L, B, 1, E] and squeezed, then each part taken by a Gather of one index."""
    nodes = [node("Unsqueeze", ["x", "ax0"], ["u"]), node("Transpose", ["u"], ["t"], perm=[3, 1, 2, 0, 4]),
             node("Squeeze", ["t", "ax3"], ["s"])]
    for c in range(3):
        nodes += [node("Gather", ["s", f"i{c}"], [f"p{c}"], axis=0), node("Relu", [f"p{c}"], [f"y{c}"])]
    inits = [init("ax0", np.array([0])), init("ax3", np.array([3]))] + [init(f"i{c}", np.array(c)) for c in range(3)]
    return make_model(nodes, [vi("x", F, [5, "B", 3, 4])], [vi(f"y{c}", F, [5, "B", 4]) for c in range(3)], inits)


def test_parts_of_a_packed_projection_are_gathered_where_they_are():
    model, _ = run_pass(packed_projection_model(), "infer-shapes")
    out, ctx = check_pass(model, "eliminate-identity", ["Gather"] * 3 + ["Relu"] * 3)
    assert {tuple(a.i for a in n.attribute) for n in out.graph.node if n.op_type == "Gather"} == {(2,)}
    assert ctx.rewrites == 3


def test_a_part_taken_across_a_permutation_keeps_the_rest_in_order():
    """Transpose(1, 2, 0) then the first axis taken: x's other two axes come out swapped, so a Transpose stays."""
    nodes = [node("Transpose", ["x"], ["t"], perm=[1, 2, 0]), node("Gather", ["t", "i"], ["y"], axis=0)]
    model = make_model(nodes, [vi("x", F, ["A", 3, 4])], [vi("y", F, [4, "A"])], [init("i", np.array(1))])
    model, _ = run_pass(model, "infer-shapes")
    check_pass(model, "eliminate-identity", ["Gather", "Transpose"])


def test_a_packed_value_read_whole_too_is_left():
    model = packed_projection_model()
    model.graph.node.append(node("Relu", ["s"], ["whole"]))
    model.graph.output.append(vi("whole", F, None))
    model, _ = run_pass(model, "infer-shapes")
    assert sorted(ops(run_pass(model, "eliminate-identity")[0])) == sorted(ops(model))


def test_a_slice_reaches_only_the_axes_each_operand_holds():
    """Add(a [1, 1, 3, 4], b [3, 4]) sliced on axes 0 and 3 (b has no axis 0; a's is 1): b is sliced on its own
    last axis only; a step and a negative axis are taken as given; a Slice keeping more than half stays."""
    nodes = [node("Add", ["a", "b"], ["s"]), node("Slice", ["s", "st", "en", "ax", "sp"], ["y"])]
    inits = [init("st", np.array([0, 0])), init("en", np.array([1, 4])), init("ax", np.array([2, -1])),
             init("sp", np.array([1, 2]))]
    model = make_model(nodes, [vi("a", F, [1, 1, 3, 4]), vi("b", F, [3, 4])], [vi("y", F, [1, 1, 1, 2])], inits)
    model, _ = run_pass(model, "infer-shapes")
    feeds = {"a": np.random.default_rng(0).random((1, 1, 3, 4), np.float32),
             "b": np.random.default_rng(1).random((3, 4), np.float32)}
    check_pass(model, "eliminate-identity", ["Slice", "Slice", "Add"], feeds)
    most = make_model(nodes, [vi("a", F, [1, 1, 3, 4]), vi("b", F, [3, 4])], [vi("y", F, None)],
                      [init("st", np.array([1])), init("en", np.array([3])), init("ax", np.array([2])),
                       init("sp", np.array([1]))])
    most, _ = run_pass(most, "infer-shapes")
    assert ops(run_pass(most, "eliminate-identity")[0]) == ["Add", "Slice"]


def test_parts_gathered_first_before_opset_13():
    """Squeeze/Unsqueeze axes are attributes before opset 13: the Unsqueeze that stays is written so."""
    nodes = [node("Unsqueeze", ["x"], ["u"], axes=[0]), node("Gather", ["u", "i"], ["y"], axis=2)]
    model = make_model(nodes, [vi("x", F, [3, 5, 4])], [vi("y", F, [1, 3, 4])], [init("i", np.array(1))], opset=11)
    model, _ = run_pass(model, "infer-shapes")
    out, _ = check_pass(model, "eliminate-identity", ["Gather", "Unsqueeze"])
    assert len(next(n for n in out.graph.node if n.op_type == "Unsqueeze").input) == 1


def keras_dense_model(rows_of: str = "x", rank3: bool = False):
    """tf2onnx's Keras Dense: MatMul, then a Reshape back to Concat(Shape(input)[:-1], [units]) (int32 casts)."""
    shape = [None, 3, 7] if rank3 else [None, 7]
    inputs = [vi("a", F, shape), vi("b", F, [None, 5])]
    flat = [node("Reshape", ["a", "flat"], ["x"])] if rank3 else [node("Relu", ["a"], ["x"])]
    nodes = flat + [
        node("MatMul", ["x", "w"], ["m"]), node("Add", ["m", "bias"], ["h"]), node("Relu", ["h"], ["r"]),
        node("Shape", [rows_of], ["s"]), node("Cast", ["s"], ["s32"], to=TensorProto.INT32),
        node("Gather", ["s32", "free"], ["lead"]) if not rank3 else node("Slice", ["s32", "z", "two"], ["lead"]),
        node("Concat", ["lead", "units"], ["target32"], axis=0), node("Cast", ["target32"], ["target"], to=TensorProto.INT64),
        node("Reshape", ["r", "target"], ["d"]), node("Add", ["d", "b"], ["y"])]
    inits = [init("w", np.full((7, 5), 0.1, np.float32)), init("bias", np.ones(5, np.float32)),
             init("free", np.array([0])), init("units", np.array([5], np.int32)), init("flat", np.array([-1, 7])),
             init("z", np.array([0])), init("two", np.array([2]))]
    return make_model(nodes, inputs, [vi("y", F, [None, 5] if not rank3 else None)], inits)


def test_keras_dense_reshape_to_its_own_rows_goes():
    check_pass(keras_dense_model(), "eliminate-identity", ["Relu", "MatMul", "Add", "Relu", "Add"])


def test_reshape_to_another_values_rows_or_another_rank_is_kept():
    assert "Reshape" in ops(run_pass(keras_dense_model(rows_of="b"), "eliminate-identity")[0])
    feeds = {"a": np.ones((4, 3, 7), np.float32), "b": np.ones((3, 5), np.float32)}
    kept, _ = run_pass(keras_dense_model(rows_of="a", rank3=True), "eliminate-identity")
    assert ops(kept).count("Reshape") == 2
    assert_same_outputs(keras_dense_model(rows_of="a", rank3=True), kept, feeds)


def gathered_parts_model(index_b="i", axis=1, extra_reader=False, b_rows="B", b_table=False):
    """Concat of the rows that one index picks from several values (the distinct users' ids, joined for a lookup)."""
    nodes = [node("Gather", ["a", "i"], ["ga"], axis=0), node("Gather", ["b", index_b], ["gb"], axis=0),
             node("Concat", ["ga", "gb"], ["y"], axis=axis)] + ([node("Neg", ["gb"], ["z"])] if extra_reader else [])
    rows = 10 if b_table else "B"   # with a table of 10 rows: the same rows, so only the constant keeps it
    inputs = [vi("a", I64, [rows, 2]), vi("b", I64, [b_rows, 3]), vi("i", I64, ["n"]), vi("j", I64, ["n"])]
    table = [init("b", np.arange(30).reshape(10, 3))] if b_table else []
    return make_model(nodes, [i for i in inputs if not (b_table and i.name == "b")],
                      [vi("y", I64, None)] + ([vi("z", I64, None)] if extra_reader else []), table)


def test_rows_gathered_alike_are_gathered_once():
    f = {"a": np.arange(8).reshape(4, 2), "b": np.arange(12).reshape(4, 3), "i": np.array([2, 0, 2]),
         "j": np.array([1, 1, 3])}
    for axis in (1, -1):
        check_pass(gathered_parts_model(axis=axis), "eliminate-identity", ["Concat", "Gather"], feeds=f)
    # another index, a part read elsewhere too, values whose rows may differ (a Concat of them would fail), or a
    # constant table (joined, it would be copied whole on every run)
    for kept in (gathered_parts_model(index_b="j"), gathered_parts_model(extra_reader=True),
                 gathered_parts_model(b_rows="C"), gathered_parts_model(b_table=True)):
        assert ops(run_pass(kept, "eliminate-identity")[0]).count("Gather") == 2


def test_sizes_follow_back_through_ops_that_keep_them():
    """graph/dims.same_size: a Gemm's rows (and a layer norm's) are its input's; graph inputs naming a dim alike
    have one size; FusedMatMul with transBatchA moves the rows; a layer norm's mean has its own last axis."""
    from ctropt.graph import to_graph
    from ctropt.graph.dims import same_size

    nodes = [node("Gemm", ["x", "w"], ["g"]), node("Relu", ["g"], ["r"]),
             node("FusedMatMul", ["x3", "w3"], ["f"], domain="com.microsoft", transBatchA=1),
             node("LayerNormalization", ["r", "s", "s"], ["ln", "mean"], axis=-1)]
    model = make_model(nodes, [vi("x", F, ["B", 4]), vi("x3", F, ["B", "T", 4]), vi("z", F, ["B", 4])],
                       [vi("r", F, None), vi("f", F, None), vi("ln", F, None), vi("mean", F, None)],
                       [init("w", np.ones((4, 4), np.float32)), init("w3", np.ones((4, 5), np.float32)),
                        init("s", np.ones(4, np.float32))])
    g = to_graph(model)
    t = {v.name: v for v in g.tensors().values()}
    t["g"].shape = t["r"].shape = t["ln"].shape = ["B", 4]   # as annotate_shapes leaves them
    t["f"].shape, t["mean"].shape = ["T", "B", 5], ["B", 1]
    assert same_size((t["r"], 0), (t["x"], 0)) and same_size((t["ln"], 0), (t["x"], 0))
    assert same_size((t["x"], 0), (t["z"], 0))   # graph inputs naming the dim alike
    assert not same_size((t["f"], 0), (t["x3"], 0)) and not same_size((t["mean"], 1), (t["x"], 1))


def test_sizes_follow_reshapes_and_reductions_and_are_joined_by_a_concat():
    """A Reshape keeps the first axis when the other sizes multiply alike; a ReduceSum keeps the axes it does not
    reduce (shifted without keepdims); inputs with their own batch symbols are one size where a Concat on another
    axis joins values made from them (given the graph), and not otherwise."""
    from ctropt.graph import annotate_shapes, to_graph
    from ctropt.graph.dims import same_size

    nodes = [node("Reshape", ["a", "flat"], ["af"]), node("ReduceSum", ["a", "ax"], ["s"], keepdims=0),
             node("Reshape", ["a", "odd"], ["ao"]), node("Concat", ["af", "b"], ["j"], axis=1),
             node("Relu", ["s"], ["s2"]), node("Relu", ["ao"], ["ao2"])]
    model = make_model(nodes, [vi("a", F, ["A", 3, 4]), vi("b", F, ["Bb", 2]), vi("c", F, ["Cc", 2])],
                       [vi("j", F, None), vi("s2", F, None), vi("ao2", F, None)],
                       [init("flat", np.array([-1, 12])), init("ax", np.array([2])), init("odd", np.array([-1, 6]))])
    g = to_graph(model)
    annotate_shapes(g)
    t = {v.name: v for v in g.tensors().values()}
    assert same_size((t["af"], 0), (t["a"], 0)) and same_size((t["s"], 0), (t["a"], 0))
    assert same_size((t["s"], 1), (t["a"], 1)) and not same_size((t["ao"], 0), (t["a"], 0))
    assert not same_size((t["s"], 0), (t["b"], 0)) and same_size((t["s"], 0), (t["b"], 0), g)
    assert not same_size((t["s"], 0), (t["c"], 0), g)
    whole = make_model([node("ReduceSum", ["a", "none"], ["r"], keepdims=1), node("Relu", ["r"], ["r2"])],
                       [vi("a", F, ["A", 3, 4])], [vi("r2", F, None)], [init("none", np.array([], np.int64))])
    g = to_graph(whole)
    annotate_shapes(g)
    r = next(v for v in g.tensors().values() if v.name == "r")
    assert not same_size((r, 0), (g.inputs[0], 0))   # empty axes: every axis reduced


def packed_columns_model():
    """deepctr-torch: X [B, 6] floats; columns 0..2 sliced one by one, each Cast to int64, joined for one lookup;
    columns 3..5 sliced one by one and joined as the dense values, then Flatten (of a 2-D value) before the DNN."""
    nodes = []
    for c in range(6):
        nodes.append(node("Slice", ["X", f"c{c}", f"c{c + 1}", "ax1", "one"], [f"s{c}"]))
    nodes += [node("Cast", [f"s{c}"], [f"i{c}"], to=TensorProto.INT64) for c in range(3)]
    nodes += [node("Concat", ["i0", "i1", "i2"], ["ids"], axis=1), node("Gather", ["t", "ids"], ["e"]),
              node("Concat", ["s3", "s4", "s5"], ["dense"], axis=1), node("Flatten", ["dense"], ["d"], axis=1)]
    return make_model(nodes, [vi("X", F, ["batch", 6])], [vi("e", F, ["batch", 3, 4]), vi("d", F, ["batch", 3])],
                      [init(f"c{c}", np.array([c])) for c in range(7)] +
                      [init("ax1", np.array([1])), init("one", np.array([1])),
                       init("t", np.random.default_rng(0).normal(size=(10, 4)).astype(np.float32))])


def test_per_column_slices_and_casts_become_one_slice_and_one_cast():
    model = packed_columns_model()
    x = np.concatenate([np.random.default_rng(1).integers(0, 10, (5, 3)), np.random.default_rng(2).normal(size=(5, 3))],
                       1).astype(np.float32)
    once, ctx = check_pass(model, "eliminate-identity", ["Slice", "Cast", "Gather", "Slice"], feeds={"X": x})
    assert_same_outputs(model, once, {"X": x[:1]}, atol=0, rtol=0)
    gaps = packed_columns_model()   # columns 3 and 5 only: not one range
    gaps.graph.node[10].input[:] = ["s3", "s5"]
    gaps.graph.output[1].type.tensor_type.shape.dim[1].dim_value = 2
    out, _ = run_pass(gaps, "eliminate-identity")
    assert ops(out).count("Slice") == 3 and "Concat" in ops(out)


def test_sizes_follow_slices_expands_and_adds_of_one_size():
    """A Slice keeps the axes it does not slice; Expand(x, Shape(y)) has y's size where x has 1; an Add of two
    values of one size (ids + offsets Expanded to the ids' shape) has that size."""
    from ctropt.graph import annotate_shapes, to_graph
    from ctropt.graph.dims import same_size

    nodes = [node("Slice", ["X", "c0", "c3", "ax1"], ["ids"]), node("Shape", ["ids"], ["s"]),
             node("Expand", ["off", "s"], ["offx"]), node("Add", ["ids", "offx"], ["at"]), node("Relu", ["at"], ["y"])]
    model = make_model(nodes, [vi("X", F, ["batch", 6])], [vi("y", F, None)],
                       [init("c0", np.array([0])), init("c3", np.array([3])), init("ax1", np.array([1])),
                        init("off", np.zeros(3, np.float32))])
    g = to_graph(model)
    annotate_shapes(g)
    t = {v.name: v for v in g.tensors().values()}
    assert same_size((t["ids"], 0), (t["X"], 0)) and not same_size((t["ids"], 1), (t["X"], 1))
    assert same_size((t["offx"], 0), (t["X"], 0)) and same_size((t["at"], 0), (t["X"], 0))


def test_size_proofs_through_deep_residual_chains_are_fast():
    """Each Add(x, f(x)) compares its inputs' chains: memoized, 60 levels take milliseconds (walked again per op,
    3^60 walks: this test would not end)."""
    from ctropt.graph import annotate_shapes, to_graph
    from ctropt.graph.dims import same_size

    nodes, cur = [], "x"
    for i in range(60):
        nodes += [node("Relu", [cur], [f"r{i}"]), node("Add", [cur, f"r{i}"], [f"a{i}"])]
        cur = f"a{i}"
    g = to_graph(make_model(nodes + [node("Relu", [cur], ["y"])], [vi("x", F, ["B", 4])], [vi("y", F, None)]))
    annotate_shapes(g)
    t = {v.name: v for v in g.tensors().values()}
    assert same_size((t[cur], 0), (t["x"], 0))



def torch_tensordot_legacy():
    """torch's legacy exporter, deepctr-torch's DCN CrossNet: tensordot(x_l [B, D, 1], w, dims=([1], [0])) as a
    Transpose and Reshapes to targets computed from Shape ops, matmul(x0, ·), then squeeze(dim=2) as an If on the
    size of that axis. The targets are static but for the batch: -1 for it, the If's condition then constant."""
    d = 6
    t = [node("Transpose", ["x"], ["xt"], perm=[0, 2, 1]), node("Shape", ["xt"], ["s"]),
         node("Slice", ["s", "i2", "i3"], ["last"]), node("Concat", ["m1", "last"], ["flat_shape"], axis=0),
         node("Reshape", ["xt", "flat_shape"], ["flat"]), node("MatMul", ["flat", "w"], ["proj"]),
         node("Slice", ["s", "i0", "i2"], ["lead"]), node("Concat", ["lead", "one"], ["back_shape"], axis=0),
         node("Reshape", ["proj", "back_shape"], ["xw"]), node("MatMul", ["x", "xw"], ["dot"]),
         node("Add", ["dot", "x"], ["y3"]), node("Shape", ["y3"], ["s3"]), node("Gather", ["s3", "i2s"], ["last3"]),
         node("Equal", ["last3", "one_s"], ["is_one"])]
    squeeze = helper.make_graph([node("Squeeze", ["y3", "i2"], ["sq"])], "then", [], [vi("sq", F, None)])
    keep = helper.make_graph([node("Identity", ["y3"], ["same"])], "else", [], [vi("same", F, None)])
    t.append(helper.make_node("If", ["is_one"], ["y"], then_branch=squeeze, else_branch=keep))
    return make_model(t, [vi("x", F, ["batch", d, 1])], [vi("y", F, None)],
                      [init("i0", np.array([0])), init("i2", np.array([2])), init("i3", np.array([3])),
                       init("m1", np.array([-1])), init("one", np.array([1])), init("i2s", np.array(2)),
                       init("one_s", np.array(1)), init("w", np.random.default_rng(3).normal(size=(d, 1)).astype(np.float32))])


def test_computed_reshape_targets_become_constants_and_the_squeeze_if_folds():
    import ctropt

    model = torch_tensordot_legacy()
    done = ctropt.optimize(model, passes=["infer-shapes", "fold-constants", "static-reshape-targets"], speed=False).model
    assert "If" not in ops(done) and "Shape" not in ops(done), ops(done)
    sizes = {v.name: [d.dim_value or d.dim_param for d in v.type.tensor_type.shape.dim] for v in done.graph.value_info}
    assert sizes["dot"][1:] == [6, 1] and sizes["y3"][1:] == [6, 1]   # the sizes known before are known after
    targets = [n.input[1] for n in done.graph.node if n.op_type == "Reshape"]
    assert len(targets) == 2 and all(t in {i.name for i in done.graph.initializer} for t in targets)
    feeds = {"x": np.random.default_rng(4).normal(size=(5, 6, 1)).astype(np.float32)}
    assert_same_outputs(model, done, feeds)
    assert interface(done) == interface(model)


def test_static_reshape_targets_is_idempotent_and_keeps_a_target_of_two_unknown_sizes():
    import ctropt

    once = ctropt.optimize(torch_tensordot_legacy(), passes=["infer-shapes", "static-reshape-targets"], speed=False)
    twice = ctropt.optimize(once.model, passes=["static-reshape-targets"], speed=False)
    assert twice.records[-1].rewrites == 0 and ops(twice.model) == ops(once.model)
    two = make_model([node("Shape", ["x"], ["s"]), node("Reshape", ["y", "s"], ["z"])],
                     [vi("x", F, ["a", "b"]), vi("y", F, ["a", "b"])], [vi("z", F, ["a", "b"])])
    assert ops(run_pass(two, "static-reshape-targets")[0]) == ["Shape", "Reshape"]
