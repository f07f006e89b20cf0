"""pack-inputs: per-feature inputs → one [B, F] input per dtype, split inside the graph, verified through the
adapter; on hand-built graphs (both Split/Squeeze opset forms), DeepCTR's tf2onnx exports and the zoo."""

from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from ctropt.cli import app
from ctropt.graph import CtroptError, interface, load, save
from ctropt.packing import Packing, pack_inputs, verify_packing
from ctropt.runtime import Runner, generate_inputs
from helpers import F, I64, init, make_model, node, vi

ROOT = Path(__file__).parent
THIRD = ROOT / "data" / "thirdparty"
ZOO = ROOT.parent / "ctropt" / "exporters" / "zoo" / "data"


def features_model(opset=17):
    """Three int64 [B, 1] ids, a float [B] and a float [B, 1] feature, and a [B, T] history that stays apart."""
    table = np.random.default_rng(0).normal(size=(10, 2)).astype(np.float32)
    nodes = [node("Gather", ["table", f"id{i}"], [f"e{i}"], axis=0) for i in range(3)]
    if opset < 13:  # axes as attributes
        unsqueeze = node("Unsqueeze", ["age"], ["age2"], axes=[1])
        reduce = node("ReduceSum", ["hist"], ["h"], keepdims=1, axes=[1])
    else:
        unsqueeze = node("Unsqueeze", ["age", "one"], ["age2"])
        reduce = node("ReduceSum", ["hist", "ax"], ["h"], keepdims=1)
    nodes += [node("Concat", ["e0", "e1", "e2"], ["emb"], axis=1), unsqueeze, reduce,
              node("Concat", ["age2", "price", "h"], ["dense"], axis=1),
              node("Flatten", ["emb"], ["flat"], axis=1), node("Concat", ["flat", "dense"], ["y"], axis=1)]
    inits = [init("table", table), init("one", np.array([1], np.int64)), init("ax", np.array([1], np.int64))]
    return make_model(nodes, [vi(f"id{i}", I64, ["B", 1]) for i in range(3)]
                      + [vi("age", F, ["B"]), vi("price", F, ["B", 1]), vi("hist", F, ["B", "T"])],
                      [vi("y", F, ["B", 9])], inits, opset=opset)


@pytest.mark.parametrize("opset", [11, 17])
def test_packs_per_feature_inputs_by_dtype(opset):
    model = features_model(opset)
    packed, packing = pack_inputs(model)
    assert packing.groups == {"packed_int64": ["id0", "id1", "id2"], "packed_float32": ["age", "price"]}
    assert packing.flat == ["age"]
    assert [(n, d) for k, n, _, d in interface(packed) if k == "input"] == [
        ("packed_int64", ("B", 3)), ("packed_float32", ("B", 2)), ("hist", ("B", "T"))]
    assert [n.op_type for n in packed.graph.node][:3] == ["Split", "Split", "Squeeze"]
    assert interface(packed)[-1] == interface(model)[-1]  # outputs untouched
    feeds = generate_inputs(model, batch=6)
    np.testing.assert_array_equal(Runner(packed).run(packing.pack(feeds))["y"], Runner(model).run(feeds)["y"])
    assert verify_packing(model, packed, packing) == 0.0
    again, nothing = pack_inputs(packed)  # idempotent: one input per dtype is left
    assert not nothing.groups and again is packed


@pytest.mark.parametrize("source, expected", [
    (THIRD / "deepctr_WDL_tf2onnx.onnx", 2),  # 7 inputs, int32 and float32: one per dtype
    (THIRD / "deepctr_DeepFM_tf2onnx.onnx", 2),
    (THIRD / "deepctr_DIN_tf2onnx.onnx", 4),  # + the two history inputs [B, T], which stay
    (ZOO / "wdl_tf.onnx", None),
])
def test_deepctr_and_zoo_exports_keep_one_input_per_dtype(source, expected):
    model = load(source)
    packed, packing = pack_inputs(model)
    inputs = [(n, e, d) for k, n, e, d in interface(packed) if k == "input"]
    per_feature = [x for x in inputs if x[0] not in packing.groups and len(x[2]) <= 2 and (len(x[2]) == 1 or x[2][1] == 1)]
    assert not per_feature  # nothing per-feature left unpacked
    assert len({e for n, e, _ in inputs if n in packing.groups}) == len(packing.groups)  # one per dtype
    if expected is not None:
        assert len(inputs) == expected
    assert verify_packing(model, packed, packing) == 0.0


def test_adapter_file_and_cli(tmp_path):
    src = save(features_model(), tmp_path / "m.onnx")
    runner = CliRunner()
    r = runner.invoke(app, ["pack-inputs", str(src)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "6 → 3 inputs" in r.output and "packed_int64" in r.output
    adapter = Packing.load(tmp_path / "m.packed.pack.json")
    assert adapter.groups["packed_int64"] == ["id0", "id1", "id2"]
    r = runner.invoke(app, ["verify", str(src), str(tmp_path / "m.packed.onnx")], catch_exceptions=False)
    assert r.exit_code == 2 and "--packing" in r.output
    r = runner.invoke(app, ["verify", str(src), str(tmp_path / "m.packed.onnx"), "--packing",
                            str(tmp_path / "m.packed.pack.json")], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["pack-inputs", str(tmp_path / "m.packed.onnx")], catch_exceptions=False)
    assert r.exit_code == 2 and "nothing to pack" in r.output
    r = runner.invoke(app, ["pack-inputs", str(src), "-o", str(src)], catch_exceptions=False)
    assert r.exit_code == 2 and "is the input file" in r.output
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(CtroptError, match="not a packing file"):
        Packing.load(tmp_path / "bad.json")
    with pytest.raises(CtroptError, match="missing inputs: age, id1, id2, price"):
        adapter.pack({"id0": np.zeros((2, 1), np.int64)})
