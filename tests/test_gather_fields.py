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
