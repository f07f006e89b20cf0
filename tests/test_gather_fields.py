"""gather-rows-kernel's GatherFields: a lookup of several fields' ids (their Concat, plus per-field offsets),
flattened to [B, K·E] and, where it comes first in a Concat with dense values, those beside it, → one kernel that
reads the ids inputs where they are. Dialects: deepctr through tf2onnx (int32 [B, 1] ids each with its own batch
symbol, the offsets Expanded, a Reshape to [-1, K·E], a Concat with the dense values), PaddleRec (int64 ids, one
batch symbol, a Reshape with 0), a wide part's width-1 lookup flattened alone; the kernel against numpy."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from helpers import F, I64, assert_same_outputs, init, kernel_session, make_model, node, ops, run_pass, vi

from ctropt import kernels

RNG = np.random.default_rng(5)
I32 = onnx.TensorProto.INT32
FIELDS, E, V = 3, 4, 30


def lookup_model(ids_type=I32, own_batch=True, target=(-1, FIELDS * E), dense_first=False, wide=True):
    """Fields' ids [B, 1] → Concat → + Expand(offsets) → Gather (E wide, and 1 wide) → Reshape → Concat with the
    dense [B, 2] → Gemm; the 1-wide lookup → Reshape [-1, F] → Gemm."""
    names = [f"f{i}" for i in range(FIELDS)]
    np_ids = np.int32 if ids_type == I32 else np.int64
    parts = ["dense", "flat"] if dense_first else ["flat", "dense"]
    nodes = [node("Concat", names, ["ids"], axis=1), node("Shape", ["ids"], ["s"]), node("Expand", ["off", "s"], ["offx"]),
             node("Add", ["ids", "offx"], ["at"]), node("Gather", ["t8", "at"], ["e8"]),
             node("Reshape", ["e8", "shape"], ["flat"]), node("Concat", parts, ["x"], axis=1),
             node("Gemm", ["x", "w", "b"], ["y"])]
    outputs = [vi("y", F, ["out", 5])]
    if wide:
        nodes += [node("Gather", ["t1", "at"], ["e1"]), node("Reshape", ["e1", "rows"], ["e1f"]),
                  node("Gemm", ["e1f", "ones"], ["lin"])]
        outputs.append(vi("lin", F, ["out", 1]))
    batch = (lambda i: f"unk_{i}") if own_batch else (lambda i: "B")
    inputs = [vi(n, ids_type, [batch(i), 1]) for i, n in enumerate(names)] + [vi("dense", F, [batch(9), 2])]
    inits = [init("off", np.arange(FIELDS).astype(np_ids) * 10), init("t8", RNG.normal(size=(V, E)).astype(np.float32)),
             init("t1", RNG.normal(size=(V, 1)).astype(np.float32)), init("shape", np.array(target)),
             init("rows", np.array([-1, FIELDS])), init("w", RNG.normal(size=(FIELDS * E + 2, 5)).astype(np.float32)),
             init("b", RNG.normal(size=5).astype(np.float32)), init("ones", np.ones((FIELDS, 1), np.float32))]
    return make_model(nodes, inputs, outputs, inits)


def _feeds(model, batch=6):
    feeds = {}
    for i in model.graph.input:
        t = i.type.tensor_type.elem_type
        feeds[i.name] = RNG.normal(size=(batch, 2)).astype(np.float32) if t == F else \
            RNG.integers(0, 10, (batch, 1)).astype(np.int32 if t == I32 else np.int64)
    return feeds


def _lowered(model):
    out, ctx = run_pass(model, "gather-rows-kernel")
    return out, ctx


@pytest.mark.parametrize("ids_type,own_batch,target", [(I32, True, (-1, FIELDS * E)), (I64, False, (0, FIELDS * E))])
def test_the_fields_lookup_and_the_dense_values_become_one_kernel(ids_type, own_batch, target):
    model = lookup_model(ids_type, own_batch, target)
    out, ctx = _lowered(model)
    assert sorted(ops(out)) == ["GatherFields", "GatherFields", "Gemm", "Gemm"], ops(out)
    deep = next(n for n in out.graph.node if n.op_type == "GatherFields" and n.input[0] == "t8")
    assert list(deep.input[2:]) == [f"f{i}" for i in range(FIELDS)] + ["dense"] and deep.input[1] == "off"
    for batch in (1, 6):
        assert_same_outputs(model, out, _feeds(model, batch), atol=0, rtol=0)
    again, ctx2 = _lowered(out)
    assert ctx2.rewrites == 0 and sorted(ops(again)) == sorted(ops(out))


def test_a_lookup_after_the_dense_values_is_flattened_alone():
    model = lookup_model(dense_first=True, wide=False)
    out, _ = _lowered(model)
    assert sorted(ops(out)) == ["Concat", "GatherFields", "Gemm"], ops(out)
    assert_same_outputs(model, out, _feeds(model), atol=0, rtol=0)


def test_a_reshape_that_does_not_keep_the_rows_stays():
    model = lookup_model(target=(-1, E), wide=False)   # [B·F, E]: not a flattening of each row
    model.graph.node[-2].input[:] = ["flat"]   # the Concat reads only the reshaped lookup; the Gemm reads [B·F, E]
    model.graph.node[-1].input[1] = "w4"
    model.graph.initializer.append(init("w4", RNG.normal(size=(E, 5)).astype(np.float32)))
    out, _ = _lowered(model)
    assert "GatherFields" not in ops(out) and "GatherRows" in ops(out)


@pytest.mark.parametrize("ids_type", [np.int32, np.int64])
def test_gather_fields_matches_numpy(ids_type):
    table, offsets = RNG.normal(size=(40, 3)).astype(np.float32), np.array([0, 10, 25], ids_type)
    t = I32 if ids_type == np.int32 else I64
    s = kernel_session([onnx.helper.make_node("GatherFields", ["t", "off", "a", "b", "d1", "d2"], ["y"],
                                              domain=kernels.DOMAIN)],
                       [vi("a", t, None), vi("b", t, None), vi("d1", F, None), vi("d2", F, None)],
                       [init("t", table), init("off", offsets)])
    for rows in (1, 70):   # 70 rows in up to 64 blocks
        a, b = RNG.integers(-10, 10, (rows, 1)).astype(ids_type), RNG.integers(0, 15, (rows, 2)).astype(ids_type)
        d1, d2 = RNG.normal(size=(rows, 3)).astype(np.float32), RNG.normal(size=rows).astype(np.float32)
        ids = np.concatenate([a, b], 1) + offsets
        want = np.concatenate([table[ids].reshape(rows, -1), d1, d2[:, None]], 1)
        np.testing.assert_array_equal(s.run(None, {"a": a, "b": b, "d1": d1, "d2": d2})[0], want)
    with pytest.raises(Exception, match=r"idx=40 must be within the inclusive range \[-40,39\]"):
        s.run(None, {"a": np.zeros((2, 1), ids_type), "b": np.array([[0, 15], [0, 0]], ids_type), "d1": d1[:2],
                     "d2": d2[:2]})
    with pytest.raises(Exception, match="rows differ"):
        s.run(None, {"a": a[:2], "b": b[:3], "d1": d1[:2], "d2": d2[:2]})
    with pytest.raises(Exception, match="offsets must be"):
        s.run(None, {"a": a, "b": b[:, :1], "d1": d1, "d2": d2})


def test_a_lookup_reshaped_then_flattened_and_a_computed_shape_with_allowzero():
    """deepctr-torch legacy: Reshape to [0, 1, K·E] then Flatten; dynamo: Reshape(allowzero=1) to [-1, K·E]."""
    legacy = lookup_model(target=(0, 1, FIELDS * E), wide=False)
    legacy.graph.node[5].output[0] = "flat3"
    legacy.graph.node.insert(6, node("Flatten", ["flat3"], ["flat"], axis=1))
    dynamo = lookup_model(target=(-1, FIELDS * E), wide=False)
    dynamo.graph.node[5].attribute.append(onnx.helper.make_attribute("allowzero", 1))
    for model in (legacy, dynamo):
        out, _ = _lowered(model)
        assert sorted(ops(out)) == ["GatherFields", "Gemm"], ops(out)
        assert_same_outputs(model, out, _feeds(model), atol=0, rtol=0)


def torch_columns_model():
    """deepctr-torch: one float matrix X [B, F + 2]; the ids' columns Sliced and Cast to int64, offsets added, the
    lookup flattened beside the dense columns' Slice (→ GatherFields), and the same ids read by an FM-style lookup
    kept [B, F, E] (→ GatherRows)."""
    nodes = [node("Slice", ["X", "s0", "sF", "ax"], ["cols"]), node("Cast", ["cols"], ["ids"], to=I64),
             node("Add", ["ids", "off"], ["at"]), node("Gather", ["t8", "at"], ["e8"]),
             node("Reshape", ["e8", "shape"], ["flat"]), node("Slice", ["X", "sF", "sEnd", "ax"], ["dense"]),
             node("Concat", ["flat", "dense"], ["x"], axis=1), node("Gemm", ["x", "w"], ["y"]),
             node("Gather", ["t4", "at"], ["e4"]), node("ReduceSum", ["e4", "ax"], ["pooled"], keepdims=0)]
    return make_model(nodes, [vi("X", F, ["batch", FIELDS + 2])], [vi("y", F, ["batch", 5]),
                                                                       vi("pooled", F, ["batch", E])],
                      [init("s0", np.array([0])), init("sF", np.array([FIELDS])), init("sEnd", np.array([FIELDS + 2])),
                       init("ax", np.array([1])), init("off", np.arange(FIELDS, dtype=np.int64) * 10),
                       init("t8", RNG.normal(size=(V, E)).astype(np.float32)),
                       init("t4", RNG.normal(size=(V, E)).astype(np.float32)),
                       init("shape", np.array([-1, FIELDS * E])),
                       init("w", RNG.normal(size=(FIELDS * E + 2, 5)).astype(np.float32))])


def test_lookups_read_float_ids_where_the_model_casts_them():
    model = torch_columns_model()
    out, _ = _lowered(model)
    assert "Cast" not in ops(out) and {"GatherFields", "GatherRows"} <= set(ops(out)), ops(out)
    fields = next(n for n in out.graph.node if n.op_type == "GatherFields")
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in fields.attribute}
    assert attrs == {"fields": 1, "ranges": [0, FIELDS, FIELDS, FIELDS + 2]} and list(fields.input[2:]) == ["X", "X"]
    x = np.concatenate([RNG.integers(0, 10, (6, FIELDS)), RNG.normal(size=(6, 2))], 1).astype(np.float32)
    x[0, :FIELDS] += 0.75   # fractional ids: truncated as the Cast truncates them
    assert_same_outputs(model, out, {"X": x}, atol=0, rtol=0)
    again, ctx2 = _lowered(out)
    assert ctx2.rewrites == 0 and sorted(ops(again)) == sorted(ops(out))


def test_gather_fields_and_rows_take_float_ids():
    table, offsets = RNG.normal(size=(40, 3)).astype(np.float32), np.array([0, 10], np.int64)
    fields = kernel_session([onnx.helper.make_node("GatherFields", ["t", "off", "a", "d"], ["y"],
                                                   domain=kernels.DOMAIN, fields=1)],
                            [vi("a", F, None), vi("d", F, None)], [init("t", table), init("off", offsets)])
    rows = kernel_session([onnx.helper.make_node("GatherRows", ["t", "a", "off"], ["y"], domain=kernels.DOMAIN)],
                          [vi("a", F, None)], [init("t", table), init("off", offsets)])
    a = np.array([[1.9, 3.0], [-0.7, 12.5], [-3.2, 0.0]], np.float32)   # -3.2 → -3 + 0: from the end
    d = RNG.normal(size=(3, 2)).astype(np.float32)
    at = a.astype(np.int64) + offsets
    np.testing.assert_array_equal(fields.run(None, {"a": a, "d": d})[0], np.concatenate([table[at].reshape(3, -1), d], 1))
    np.testing.assert_array_equal(rows.run(None, {"a": a})[0], table[at])
    for bad in (np.nan, 1e30, 40.0):
        with pytest.raises(Exception, match="out of data bounds|must be within"):
            rows.run(None, {"a": np.array([[bad, 0]], np.float32)})
    with pytest.raises(Exception, match="int64 for float"):
        kernel_session([onnx.helper.make_node("GatherRows", ["t", "a", "off"], ["y"], domain=kernels.DOMAIN)],
                       [vi("a", F, None)], [init("t", table), init("off", offsets.astype(np.int32))]).run(None, {"a": a})


def test_gather_fields_reads_column_ranges():
    table = RNG.normal(size=(40, 3)).astype(np.float32)
    s = kernel_session([onnx.helper.make_node("GatherFields", ["t", "", "X", "X", "d"], ["y"], domain=kernels.DOMAIN,
                                              fields=1, ranges=[1, 3, 3, 5, 0, 2])],
                       [vi("X", F, None), vi("d", F, None)], [init("t", table)])
    x = np.concatenate([RNG.normal(size=(4, 1)), RNG.integers(0, 40, (4, 2)), RNG.normal(size=(4, 2))], 1).astype(np.float32)
    d = RNG.normal(size=(4, 3)).astype(np.float32)
    want = np.concatenate([table[x[:, 1:3].astype(np.int64)].reshape(4, -1), x[:, 3:5], d[:, :2]], 1)
    np.testing.assert_array_equal(s.run(None, {"X": x, "d": d})[0], want)
    with pytest.raises(Exception, match="range is outside"):
        s.run(None, {"X": x[:, :4], "d": d})
