"""Model I/O: validation errors, versions the runtimes accept, external data, safe writes."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper

import ctropt
from ctropt.graph import MAX_IR_VERSION, MAX_ONNX_OPSET, CtroptError, interface, load, save
from helpers import F, init, make_model, node, vi


def relu_model(opset=17, ir=8):
    model = make_model([node("Relu", ["x"], ["y"])], [vi("x", F, ["B", 4])], [vi("y", F, ["B", 4])], opset=opset)
    model.ir_version = ir
    return model


def ort_loads(model) -> bool:
    try:
        ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        return True
    except Exception:
        return False


def test_version_limits_load_on_the_installed_onnxruntime():
    """ctropt writes at most these versions, so the installed onnxruntime must load them. They are onnxruntime
    1.31's limits (it rejects one more of either); 1.32 also loads IR 14 and opset 27."""
    assert ort_loads(relu_model(MAX_ONNX_OPSET, MAX_IR_VERSION))
    if ort.__version__.startswith("1.31."):
        assert not ort_loads(relu_model(MAX_ONNX_OPSET, MAX_IR_VERSION + 1))
        assert not ort_loads(relu_model(MAX_ONNX_OPSET + 1, MAX_IR_VERSION))


def test_save_clamps_the_ir_version_onnx_writes(tmp_path):
    model = relu_model(ir=onnx.IR_VERSION)  # what onnx 1.23 writes by default: IR 14
    path = save(model, tmp_path / "m.onnx")
    assert load(path).ir_version <= MAX_IR_VERSION
    assert ort_loads(onnx.load(path))


def test_external_data_round_trip_keeps_the_interface(tmp_path):
    table = np.random.default_rng(0).standard_normal((1000, 16)).astype(np.float32)
    model = make_model([node("Gather", ["table", "ids"], ["y"])], [vi("ids", onnx.TensorProto.INT64, ["B"]),
                                                                   vi("unused", F, [3])],
                       [vi("y", F, ["B", 16])], [init("table", table)])
    src = save(model, tmp_path / "big.onnx", external_data=True)
    assert (tmp_path / "big.onnx.data").exists() and src.stat().st_size < 10_000
    loaded = load(src)
    result = ctropt.optimize(loaded, passes="all", speed=False)
    out = save(result.model, tmp_path / "big.opt.onnx", external_data=True, protect=(src,))
    again = load(out)
    assert interface(again) == interface(model)
    assert np.array_equal(onnx.numpy_helper.to_array(again.graph.initializer[0]), table)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".ctropt-")]  # no temp files left


def test_save_never_overwrites_the_input(tmp_path):
    src = save(relu_model(), tmp_path / "m.onnx")
    before = src.read_bytes()
    with pytest.raises(CtroptError, match="is the input file"):
        save(relu_model(opset=13), tmp_path / "." / "m.onnx", protect=(src,))
    assert src.read_bytes() == before


@pytest.mark.parametrize("content, message", [
    (b"this is not a model", "not an ONNX model"),
    (b"", "not an ONNX model"),
])
def test_garbage_files(tmp_path, content, message):
    path = tmp_path / "bad.onnx"
    path.write_bytes(content)
    with pytest.raises(CtroptError, match=message):
        load(path)


def test_truncated_file(tmp_path):
    data = relu_model().SerializeToString()
    for cut in (len(data) // 3, len(data) // 2, len(data) - 3):
        path = tmp_path / f"cut{cut}.onnx"
        path.write_bytes(data[:cut])
        with pytest.raises(CtroptError, match="truncated|invalid"):
            load(path)


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(CtroptError, match="no such file"):
        load(tmp_path / "nope.onnx")
    with pytest.raises(CtroptError, match="is a directory"):
        load(tmp_path)


def test_opset_newer_than_supported(tmp_path):
    path = tmp_path / "new.onnx"
    onnx.save(relu_model(opset=MAX_ONNX_OPSET + 1), path)
    with pytest.raises(CtroptError, match=f"opset {MAX_ONNX_OPSET + 1} is newer than supported"):
        load(path)


def test_unknown_custom_domain_and_unknown_op(tmp_path):
    model = relu_model()
    model.graph.node[0].domain = "com.acme"
    model.opset_import.append(helper.make_opsetid("com.acme", 1))
    onnx.save(model, tmp_path / "custom.onnx")
    with pytest.raises(CtroptError, match="custom-op domain 'com.acme'"):
        load(tmp_path / "custom.onnx")
    model = relu_model()
    model.graph.node[0].op_type = "Frobnicate"
    onnx.save(model, tmp_path / "unknown.onnx")
    with pytest.raises(CtroptError, match="unknown ONNX op.*Frobnicate"):
        load(tmp_path / "unknown.onnx")


def test_custom_domain_with_a_function_body_is_fine(tmp_path):
    fn = helper.make_function("com.acme", "Twice", ["a"], ["b"], [helper.make_node("Add", ["a", "a"], ["b"])],
                              [helper.make_opsetid("", 17)])
    model = make_model([helper.make_node("Twice", ["x"], ["y"], domain="com.acme")], [vi("x", F, ["B", 4])],
                       [vi("y", F, ["B", 4])], functions=[fn])
    model.opset_import.append(helper.make_opsetid("com.acme", 1))
    onnx.save(model, tmp_path / "fn.onnx")
    assert load(tmp_path / "fn.onnx").functions[0].name == "Twice"


def test_model_over_2gb_in_one_file(tmp_path):
    path = tmp_path / "huge.onnx"
    with open(path, "wb") as f:
        f.truncate((2 << 30) + 1)  # sparse: no disk used
    with pytest.raises(CtroptError, match="cannot exceed 2 GiB.*external data"):
        load(path)


def test_missing_external_data_file(tmp_path):
    model = make_model([node("Add", ["x", "w"], ["y"])], [vi("x", F, [256])], [vi("y", F, [256])],
                       [init("w", np.ones(256, np.float32))])
    path = save(model, tmp_path / "m.onnx", external_data=True)
    (tmp_path / "m.onnx.data").unlink()
    with pytest.raises(CtroptError, match="external data"):
        load(path)


def test_builder_reuses_the_nodes_it_made_for_the_same_op_inputs_and_attributes():
    import onnx_graphsurgeon as gs

    from ctropt.graph.edit import Builder

    x = gs.Variable("x", np.float32, [4])
    g = gs.Graph(inputs=[x], opset=17)
    b = Builder(g, "a", reuse="lens")
    first = b.op("Cast", [x], {"to": 7})
    assert Builder(g, "b", reuse="lens").op("Cast", [x], {"to": 7}) is first  # another Builder, the same pool
    assert b.op("Cast", [x], {"to": 6}) is not first and b.op("Neg", [x]) is not first
    assert Builder(g, "c").op("Cast", [x], {"to": 7}) is not first  # without `reuse`, always a new node
    assert len(g.nodes) == 4
