"""lookup-selected-rows: a row selection of history lookups viewed as [B·T, D] rows → the lookups of the selected
ids only; and eliminate-identity's `stacked-part` (torch.stack of lookups, then one of them by index)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import F, I64, assert_same_outputs, init, make_model, node, ops, run_pass, vi

import ctropt

D, V = 4, 11
RNG = np.random.default_rng(5)
ITEMS, CATS = RNG.normal(size=(V, D)).astype(np.float32), RNG.normal(size=(V, 3)).astype(np.float32)
INPUTS = [vi("item_ids", I64, ["batch", "seq_len"]), vi("cat_ids", I64, ["batch", "seq_len"]),
          vi("rows", I64, ["n"])]


def concat_form(reader: str | None = None):
    """torch (FuxiCTR): the item and category lookups of one history, Concat on the last axis, viewed as rows and
    cut down to the selected rows. `reader`: an op that also reads the whole concatenation."""
    nodes = [node("Gather", ["items", "item_ids"], ["e_item"]), node("Gather", ["cats", "cat_ids"], ["e_cat"]),
             node("Concat", ["e_item", "e_cat"], ["e"], axis=-1), node("Reshape", ["e", "as_rows"], ["e_rows"]),
             node("Gather", ["e_rows", "rows"], ["y"], axis=0)]
    outputs = [vi("y", F, ["n", D + 3])]
    if reader:
        nodes.append(node(reader, ["e"], ["whole"], axes=[1], keepdims=0))
        outputs.append(vi("whole", F, ["batch", D + 3]))
    inits = [init("items", ITEMS), init("cats", CATS), init("as_rows", np.array([-1, D + 3], np.int64))]
    return make_model(nodes, INPUTS, outputs, inits)


def stacked_form():
    """torch (torch-rechub): torch.stack of the lookups on axis 1, each history read back by index (x[:, 0]),
    viewed as rows [B·T, D] (its width) and selected."""
    nodes = [node("Gather", ["items", "item_ids"], ["e_item"]), node("Gather", ["items", "cat_ids"], ["e_cat"]),
             node("Unsqueeze", ["e_item", "ax1"], ["u_item"]), node("Unsqueeze", ["e_cat", "ax1"], ["u_cat"]),
             node("Concat", ["u_item", "u_cat"], ["stacked"], axis=1),
             node("Gather", ["stacked", "zero"], ["first"], axis=1), node("Gather", ["stacked", "one"], ["second"], axis=1),
             node("Reshape", ["first", "as_rows"], ["r1"]), node("Reshape", ["second", "as_rows"], ["r2"]),
             node("Gather", ["r1", "rows"], ["y1"], axis=0), node("Gather", ["r2", "rows"], ["y2"], axis=0)]
    inits = [init("items", ITEMS), init("ax1", np.array([1], np.int64)), init("zero", np.array(0, np.int64)),
             init("one", np.array(1, np.int64)), init("as_rows", np.array([-1, D], np.int64))]
    return make_model(nodes, INPUTS, [vi("y1", F, ["n", D]), vi("y2", F, ["n", D])], inits)


def tf2onnx_form():
    """tf2onnx (DeepRec's tensordot over the history): one lookup, Reshape to [-1, D], rows gathered as [N, 1]."""
    nodes = [node("Gather", ["items", "item_ids"], ["e"]), node("Reshape", ["e", "as_rows"], ["e_rows"]),
             node("Unsqueeze", ["rows", "ax1"], ["rows2"]), node("Gather", ["e_rows", "rows2"], ["y"], axis=0)]
    inits = [init("items", ITEMS), init("as_rows", np.array([-1, D], np.int64)), init("ax1", np.array([1], np.int64))]
    return make_model(nodes, INPUTS, [vi("y", F, ["n", 1, D])], inits)


def _feeds(B, T, seed=0):
    rng = np.random.default_rng(seed)
    rows = np.sort(rng.choice(B * T, size=max(1, B * T // 2), replace=False))
    return {"item_ids": rng.integers(0, V, (B, T)), "cat_ids": rng.integers(0, V, (B, T)), "rows": rows}


# every id still checked against the table: its largest and smallest looked up, no row kept, joined empty
CHECKED = ["ReduceMax", "ReduceMin", "Max", "Min", "Concat", "Gather", "Slice", "Cast", "Reshape", "Concat"]


@pytest.mark.parametrize("make,want", [
    # per history: its ids flattened and selected, then the lookup; the parts concatenated again
    (concat_form, (["Reshape", "Gather", "Gather"] + CHECKED) * 2 + ["Concat"]),
    (tf2onnx_form, ["Unsqueeze", "Reshape", "Gather", "Gather"] + CHECKED),
])
def test_only_the_selected_rows_are_looked_up(make, want):
    model = make()
    done, ctx = run_pass(model, "lookup-selected-rows")
    assert ctx.rewrites >= 1
    assert sorted(ops(done)) == sorted(want), ops(done)
    for B, T in ((4, 5), (1, 7), (6, 1)):
        assert_same_outputs(model, done, _feeds(B, T))
    again, ctx2 = run_pass(done, "lookup-selected-rows")
    assert ctx2.rewrites == 0 and ops(again) == ops(done)
    assert ctropt.graph.interface(done) == ctropt.graph.interface(model)


def test_a_stacked_lookup_read_back_by_index_is_the_lookup():
    model = stacked_form()
    plain, ctx = run_pass(model, "eliminate-identity")
    assert "Concat" not in ops(plain) and "Unsqueeze" not in ops(plain), ops(plain)
    done, ctx = run_pass(plain, "lookup-selected-rows")
    assert ctx.rewrites == 2 and sorted(ops(done)) == sorted(["Gather"] * 4 + ["Reshape"] * 2 + CHECKED * 2)
    assert_same_outputs(model, done, _feeds(5, 6))


@pytest.mark.parametrize("bad", [V, -V - 1, 1 << 40])
def test_an_id_out_of_the_table_at_a_row_not_selected_still_raises(bad):
    """A padded history position is not looked up any more, but its id is still checked, as the raw lookup did."""
    model = concat_form()
    done, _ = run_pass(model, "lookup-selected-rows")
    feeds = _feeds(4, 5)
    unselected = next(i for i in range(20) if i not in set(feeds["rows"]))
    feeds["item_ids"].flat[unselected] = bad
    for m in (model, done):
        with pytest.raises(Exception, match="out of data bounds"):
            ctropt.runtime.run_model(m, feeds)


@pytest.mark.parametrize("index,parts", [(1, ["A", "xu"]), (-2, ["xu", "A"])])
def test_an_index_into_a_concat_with_a_wider_part_is_not_a_stacked_value(index, parts):
    """Concat(A [2, 3], Unsqueeze(x)) on axis 0: index 1 is A's second row, not x."""
    nodes = [node("Unsqueeze", ["x", "ax0"], ["xu"]), node("Concat", parts, ["cat"], axis=0),
             node("Gather", ["cat", "i"], ["y"], axis=0), node("Relu", ["y"], ["z"])]
    model = make_model(nodes, [vi("x", F, [3]), vi("A", F, [2, 3])], [vi("z", F, [3])],
                       [init("ax0", np.array([0], np.int64)), init("i", np.array(index, np.int64))])
    done, ctx = run_pass(model, "eliminate-identity")
    assert "Concat" in ops(done)
    assert_same_outputs(model, done, {"x": np.array([1, 2, 3], np.float32),
                                      "A": np.array([[10, 20, 30], [40, 50, 60]], np.float32)})


def test_a_lookup_also_read_whole_or_viewed_otherwise_stays():
    whole = concat_form(reader="ReduceSum")
    done, ctx = run_pass(whole, "lookup-selected-rows")
    assert ctx.rewrites == 0 and sorted(ops(done)) == sorted(ops(whole))
    halves = tf2onnx_form()  # rows of half an embedding: not one position per row
    next(t for t in halves.graph.initializer if t.name == "as_rows").CopyFrom(
        init("as_rows", np.array([-1, D // 2], np.int64)))
    done, ctx = run_pass(halves, "lookup-selected-rows")
    assert ctx.rewrites == 0


def test_in_the_pipeline_outputs_and_interface_hold():
    model = stacked_form()
    result = ctropt.optimize(model, passes="all", speed=False)
    record = next(r for r in result.records if r.name == "lookup-selected-rows")
    assert record.status == "applied", (record.status, record.notes)
    assert_same_outputs(model, result.model, _feeds(7, 9))
    assert ctropt.graph.interface(result.model) == ctropt.graph.interface(model)
