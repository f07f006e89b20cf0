"""Generated verification inputs: ids stay inside their tables, lengths and masks agree."""

import numpy as np
import pytest
from onnx import TensorProto, helper

from ctropt.runtime import generate_inputs, run_model
from helpers import F, I64, init, make_model, node, vi


def test_ids_stay_inside_the_table_through_casts_reshapes_and_offsets():
    model = make_model(
        [node("Cast", ["ids"], ["c"], to=TensorProto.INT64), node("Reshape", ["c", "flat"], ["r"]),
         node("Add", ["r", "three"], ["shifted"]), node("Gather", ["table", "shifted"], ["y"], axis=0)],
        [vi("ids", TensorProto.INT32, ["B", 2])], [vi("y", F, None)],
        [init("table", np.zeros((10, 4), np.float32)), init("flat", np.array([-1])), init("three", np.array(3))])
    ids = generate_inputs(model, batch=64)["ids"]
    assert ids.dtype == np.int32 and ids.shape == (64, 2)
    assert ids.min() == 0 and ids.max() == 6  # table of 10 rows, ids shifted by 3: both ends are used


def test_float_matrix_with_id_columns_like_deepctr_torch():
    """X[:, 0:1] and X[:, 1:2] index tables of 5 and 50 rows; X[:, 2:] are dense features."""
    nodes, inits = [], [init("t0", np.zeros((5, 4), np.float32)), init("t1", np.zeros((50, 4), np.float32))]
    for i, rows in enumerate((5, 50)):
        inits += [init(f"s{i}", np.array([i])), init(f"e{i}", np.array([i + 1])), init(f"ax{i}", np.array([1]))]
        nodes += [node("Slice", ["X", f"s{i}", f"e{i}", f"ax{i}"], [f"col{i}"]),
                  node("Cast", [f"col{i}"], [f"id{i}"], to=TensorProto.INT64),
                  node("Gather", [f"t{i}", f"id{i}"], [f"emb{i}"])]
    nodes.append(node("Concat", ["emb0", "emb1"], ["y"], axis=1))
    model = make_model(nodes, [vi("X", F, ["B", 5])], [vi("y", F, None)], inits)
    X = generate_inputs(model, batch=200)["X"]
    assert set(np.unique(X[:, 0])) <= set(range(5)) and X[:, 0].max() == 4
    assert set(np.unique(X[:, 1])) <= set(range(50)) and X[:, 1].max() == 49
    assert not np.all(X[:, 2:] == np.round(X[:, 2:]))  # dense columns stay real-valued
    run_model(model, {"X": X})


def test_ids_used_inside_a_loop_body():
    body = helper.make_graph(
        [node("Gather", ["table", "ids"], ["e"]), node("Add", ["acc_in", "e"], ["acc_out"]),
         node("Identity", ["c_in"], ["c_out"])],
        "body", [vi("i", I64, []), vi("c_in", TensorProto.BOOL, []), vi("acc_in", F, None)],
        [vi("c_out", TensorProto.BOOL, []), vi("acc_out", F, None)])
    model = make_model([node("Loop", ["n", "", "acc0"], ["y"], body=body)],
                       [vi("ids", I64, ["B"]), vi("acc0", F, ["B", 4]), vi("n", I64, [])], [vi("y", F, None)],
                       [init("table", np.zeros((7, 4), np.float32))])
    ids = generate_inputs(model, batch=50)["ids"]
    assert ids.min() == 0 and ids.max() == 6


def test_lengths_masks_and_padded_history_agree():
    """A DIN-style model: history ids [B, T], a mask [B, T] and a length [B]."""
    model = make_model(
        [node("Gather", ["items", "hist"], ["h"]), node("Cast", ["mask"], ["m"], to=TensorProto.FLOAT),
         node("Unsqueeze", ["m", "ax"], ["m3"]), node("Mul", ["h", "m3"], ["hm"]),
         node("ReduceSum", ["hm", "ax1"], ["s"]), node("Cast", ["seq_len"], ["lf"], to=TensorProto.FLOAT),
         node("Unsqueeze", ["lf", "ax1"], ["l2"]), node("Div", ["s", "l2"], ["y"])],
        [vi("hist", I64, ["B", "T"]), vi("mask", TensorProto.BOOL, ["B", "T"]), vi("seq_len", I64, ["B"])],
        [vi("y", F, None)],
        [init("items", np.zeros((30, 4), np.float32)), init("ax", np.array([2])), init("ax1", np.array([1]))])
    feeds = generate_inputs(model, batch=32)
    lengths, mask, hist = feeds["seq_len"], feeds["mask"], feeds["hist"]
    assert mask.shape == hist.shape and mask.dtype == np.bool_
    assert np.array_equal(mask.sum(1), lengths)
    assert np.array_equal(mask, np.arange(mask.shape[1])[None] < lengths[:, None])  # prefix masks
    assert np.all(hist[~mask] == 0) and hist.max() < 30
    assert lengths.max() == mask.shape[1] and lengths.min() == 0  # a full and an empty history


@pytest.mark.parametrize("compare,zero_first", [("Equal", False), ("NotEqual", True), ("Greater", False)])
def test_history_padded_with_the_id_the_graph_masks(compare, zero_first):
    """No length or mask input, but the graph compares the history ids with 0 (FuxiCTR: Equal(ids, 0)): the
    generated histories are prefixes padded with 0, a full and an empty one among them."""
    operands = ["zero", "hist"] if zero_first else ["hist", "zero"]
    model = make_model(
        [node("Gather", ["items", "hist"], ["h"]), node(compare, operands, ["c"]),
         node("Cast", ["c"], ["m"], to=TensorProto.FLOAT), node("Unsqueeze", ["m", "ax"], ["m3"]),
         node("Mul", ["h", "m3"], ["y"])],
        [vi("hist", I64, ["B", "T"])], [vi("y", F, None)],
        [init("items", np.zeros((30, 4), np.float32)), init("ax", np.array([2])), init("zero", np.array(0))])
    hist = generate_inputs(model, batch=64)["hist"]
    assert (hist[1] == 0).all() and (hist[0] != 0).sum() >= hist.shape[1] - 2 and hist.max() < 30  # empty, full
    assert 0.2 < (hist == 0).mean() < 0.8


def test_a_mask_added_to_the_scores_is_zero_or_minus_1e9():
    """PaddleRec's readers feed DIN's mask as 0 (valid) / -1e9 (padded), added to the attention scores."""
    model = make_model(
        [node("Gather", ["items", "hist"], ["h"]), node("ReduceSum", ["h", "ax"], ["s"], keepdims=1),
         node("Cast", ["mask"], ["m"], to=TensorProto.FLOAT), node("Add", ["s", "m"], ["masked"]),
         node("Softmax", ["masked"], ["y"], axis=1)],
        [vi("hist", I64, ["B", "T"]), vi("mask", I64, ["B", "T", 1])], [vi("y", F, None)],
        [init("items", np.ones((30, 4), np.float32)), init("ax", np.array([2]))])
    feeds = generate_inputs(model, batch=32)
    mask, hist = feeds["mask"][..., 0], feeds["hist"]
    assert set(np.unique(mask)) == {0, -1000000000}
    assert np.all(hist[mask != 0] == 0) and (mask[1] != 0).all() and (mask[0] == 0).all()


def test_dims_and_seed_are_honoured():
    model = make_model([node("Relu", ["x"], ["y"])], [vi("x", F, ["batch", "T", 3])], [vi("y", F, None)])
    a = generate_inputs(model, batch=5, seq_len=7)
    assert a["x"].shape == (5, 7, 3)
    assert generate_inputs(model, batch=5, dims={"T": 2})["x"].shape == (5, 2, 3)
    assert np.array_equal(a["x"], generate_inputs(model, batch=5, seq_len=7)["x"])


def test_ids_of_a_sharded_table_stay_below_all_shards_rows_and_an_id_check_is_not_a_length():
    """TF's partitioned variables (DeepRec's fixed_size_partitioner through tf2onnx): ids deduplicated, the shard
    chosen by a Mod, the local id by a Div, routed to each shard by a Compress, one Gather per shard; `id >= 0`
    drops -1 padding. The ids must stay below 5 + 5 rows (past them a generated id indexes no shard), and the
    comparison does not make them lengths."""
    rng = np.random.default_rng(0)
    nodes = [node("Unique", ["ids"], ["uniq"], sorted=1),
             node("Mod", ["uniq", "two"], ["shard"]), node("Div", ["uniq", "two"], ["local"]),
             node("Equal", ["shard", "zero"], ["to0"]), node("Equal", ["shard", "one"], ["to1"]),
             node("Compress", ["local", "to0"], ["local0"], axis=0), node("Compress", ["local", "to1"], ["local1"], axis=0),
             node("Gather", ["t0", "local0"], ["e0"]), node("Gather", ["t1", "local1"], ["e1"]),
             node("Concat", ["e0", "e1"], ["y"], axis=0),
             node("GreaterOrEqual", ["ids", "zero"], ["valid"])]
    model = make_model(nodes, [vi("ids", I64, ["B"])], [vi("y", F, ["N", 4]), vi("valid", TensorProto.BOOL, ["B"])],
                       [init("two", np.int64(2)), init("zero", np.int64(0)), init("one", np.int64(1)),
                        init("t0", rng.normal(size=(5, 4)).astype(np.float32)),
                        init("t1", rng.normal(size=(5, 4)).astype(np.float32))])
    from ctropt.graph import to_graph
    from ctropt.runtime.inputs import analyze_inputs

    facts = analyze_inputs(to_graph(model))["ids"]
    assert facts.upper == 10 and not facts.is_length
    ids = generate_inputs(model, batch=64)["ids"]
    assert ids.min() >= 0 and ids.max() < 10 and ids.max() >= 5  # both shards are exercised
    run_model(model, {"ids": ids})


def test_ids_read_by_ctropt_gather_kernels_stay_in_their_tables():
    """After lowering, a lookup is ctropt's GatherRows (table, ids, per-field offsets) and dedup-user-side's Gather of
    the distinct users' ids a GatherRowsInt64: generated ids stay below the table's rows less the largest offset, so
    a probe of a lowered graph runs."""
    from ctropt import kernels

    nodes = [helper.make_node("Unique", ["user"], ["u", "first", "inverse", "counts"], axis=0, sorted=0),
             helper.make_node("GatherRowsInt64", ["user", "first"], ["distinct"], domain=kernels.DOMAIN),
             helper.make_node("GatherRows", ["table", "distinct"], ["user_emb"], domain=kernels.DOMAIN),
             helper.make_node("GatherRows", ["table", "fields", "offsets"], ["emb"], domain=kernels.DOMAIN)]
    inits = [init("table", np.zeros((10, 4), np.float32)), init("offsets", np.array([0, 4, 7], np.int64))]
    model = make_model(nodes, [vi("user", I64, ["B", 1]), vi("fields", I64, ["B", 3])],
                       [vi("user_emb", F, None), vi("emb", F, None)], inits)
    model.opset_import.append(helper.make_opsetid(kernels.DOMAIN, 1))
    feeds = generate_inputs(model, batch=200)
    assert 0 <= feeds["user"].min() and feeds["user"].max() < 10
    assert 0 <= feeds["fields"].min() and feeds["fields"].max() < 3 and feeds["fields"].max() == 2


def test_a_chain_of_thousands_of_ops_is_read_without_recursion():
    """ids → 3,000 Abs → a Gather: the facts (the table's bound) are read off a chain far deeper than Python's
    recursion limit, as off a short one."""
    from ctropt.runtime import analyze_inputs
    from ctropt.graph import to_graph

    n = 3000
    nodes = [node("Abs", ["ids" if i == 0 else f"a{i - 1}"], [f"a{i}"]) for i in range(n)]
    nodes.append(node("Gather", ["table", f"a{n - 1}"], ["y"], axis=0))
    model = make_model(nodes, [vi("ids", I64, ["B"])], [vi("y", F, ["B", 4])],
                       [init("table", np.ones((17, 4), np.float32))])
    facts = analyze_inputs(to_graph(model))
    assert facts["ids"].upper == 17
    assert generate_inputs(model, batch=5)["ids"].max() < 17
