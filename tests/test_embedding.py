"""fuse-parallel-embeddings on every dialect of 'look up each feature, concatenate'."""

from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto

import ctropt
from ctropt.graph import load
from helpers import F, I64, assert_same_outputs, check_pass, init, make_model, node, ops, run_pass, vi

RNG = np.random.default_rng(0)
TABLES = [init(f"t{i}", RNG.standard_normal((rows, 4)).astype(np.float32)) for i, rows in enumerate((5, 9, 7))]


def feeds_with_boundaries(model, ids_shape, dtype=np.int64):
    """Ids at both ends of every table (0 and rows-1), and -1 (Gather reads it from the end)."""
    feeds = {}
    for i, rows in enumerate((5, 9, 7)):
        ids = np.array([0, rows - 1, -1, 2][: int(np.prod(ids_shape))]).reshape(ids_shape)
        feeds[f"id{i}"] = ids.astype(dtype)
    feeds.update({i.name: RNG.standard_normal((2, 3)).astype(np.float32) for i in model.graph.input
                  if i.name == "dense"})
    return feeds


def stacked_model(dtype=TensorProto.INT64):
    """Keras/tf2onnx and torch form: ids [B, 1] → Gather → [B, 1, D], Concat on axis 1, with a dense input between."""
    nodes = [node("Gather", [f"t{i}", f"id{i}"], [f"e{i}"]) for i in range(3)]
    nodes += [node("Concat", ["e0", "e1", "e2"], ["emb"], axis=1), node("Flatten", ["emb"], ["y"], axis=1)]
    inputs = [vi(f"id{i}", dtype, ["B", 1]) for i in range(3)]
    return make_model(nodes, inputs, [vi("y", F, ["B", 12])], TABLES)


def test_stacked_lookups_become_one_gather():
    model = stacked_model()
    out, ctx = check_pass(model, "fuse-parallel-embeddings", ["Concat", "Mod", "Add", "Gather", "Flatten"],
                          feeds=feeds_with_boundaries(stacked_model(), (2, 1)))
    assert ctx.rewrites == 1 and ctx.matches == 3


def test_int32_ids_need_no_casts():
    model = stacked_model(TensorProto.INT32)
    out, _ = check_pass(model, "fuse-parallel-embeddings", ["Concat", "Mod", "Add", "Gather", "Flatten"],
                        feeds=feeds_with_boundaries(model, (2, 1), np.int32))


def test_unsqueezed_lookups_and_a_shared_table():
    """tf1 form: ids [B] → Gather → Unsqueeze(1) → Concat(1); the item table is read by two features."""
    nodes = [node("Gather", ["t0", "id0"], ["e0"]), node("Gather", ["t1", "id1"], ["e1"]),
             node("Gather", ["t1", "id2"], ["e2"])]
    nodes += [node("Unsqueeze", [f"e{i}", "ax1"], [f"u{i}"]) for i in range(3)]
    nodes += [node("Concat", ["u0", "u1", "u2"], ["y"], axis=1)]
    model = make_model(nodes, [vi(f"id{i}", I64, ["B"]) for i in range(3)], [vi("y", F, ["B", 3, 4])],
                       TABLES[:2] + [init("ax1", np.array([1]))])
    feeds = {"id0": np.array([0, 4]), "id1": np.array([8, -1]), "id2": np.array([0, 3])}
    out, _ = check_pass(model, "fuse-parallel-embeddings",
                        ["Unsqueeze", "Unsqueeze", "Unsqueeze", "Concat", "Mod", "Add", "Gather"], feeds=feeds)
    table = next(t for t in out.graph.initializer if t.dims[0] > 9)
    assert list(table.dims) == [5 + 9, 4]  # the shared table is stored once


def test_flat_lookups_joined_on_the_last_axis_with_dense_features_around():
    """torch form: ids [B] → [B, D] pieces, Concat(-1) with dense features: the run of lookups is fused."""
    nodes = [node("Gather", [f"t{i}", f"id{i}"], [f"e{i}"]) for i in range(3)]
    nodes += [node("Concat", ["dense", "e0", "e1", "e2", "dense"], ["y"], axis=-1)]
    model = make_model(nodes, [vi(f"id{i}", I64, ["B"]) for i in range(3)] + [vi("dense", F, ["B", 3])],
                       [vi("y", F, ["B", 18])], TABLES)
    feeds = feeds_with_boundaries(model, (2,))
    out, _ = check_pass(model, "fuse-parallel-embeddings",
                        ["Unsqueeze"] * 3 + ["Concat", "Mod", "Add", "Gather", "Reshape", "Concat"], feeds=feeds)


def test_lookups_used_elsewhere_or_of_other_widths_are_left_alone():
    wide = init("wide", RNG.standard_normal((6, 8)).astype(np.float32))
    nodes = [node("Gather", ["t0", "id0"], ["e0"]), node("Gather", ["wide", "id1"], ["e1"]),
             node("Gather", ["t1", "id2"], ["e2"]), node("Concat", ["e0", "e1", "e2"], ["y"], axis=-1),
             node("Neg", ["e2"], ["z"])]
    model = make_model(nodes, [vi(f"id{i}", I64, ["B"]) for i in range(3)],
                       [vi("y", F, ["B", 16]), vi("z", F, ["B", 4])], TABLES[:2] + [wide])
    out, ctx = run_pass(model, "fuse-parallel-embeddings")
    assert ctx.rewrites == 0 and ops(out) == ops(model)


def test_not_in_all_by_default():
    assert not ctropt.REGISTRY["fuse-parallel-embeddings"].default


DATA = Path(__file__).parent / "data" / "thirdparty"


@pytest.mark.parametrize("name, gathers", [("deepctr_WDL_tf2onnx", 5), ("deepctr_torch_WDL_legacy", 3),
                                           ("deepctr_torch_WDL_dynamo", 2), ("deepctr_torch_DeepFM_dynamo", 6)])
def test_third_party_exports(name, gathers):
    model = load(DATA / f"{name}.onnx")
    result = ctropt.optimize(model, passes=["all", "fuse-parallel-embeddings"])
    rec = result.records[-1]
    assert rec.name == "fuse-parallel-embeddings" and rec.status == "applied", (rec.status, rec.message)
    assert ops(result.model).count("Gather") == gathers
    with np.load(DATA / f"{name}.npz") as data:
        assert_same_outputs(model, result.model, {k: data[k] for k in data.files})
