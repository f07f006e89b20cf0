"""Batch buckets: static shapes (fix_shapes), the row-independence check, specialize, BucketedSession, the CLI."""

import gc
import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import ctropt
from ctropt.cli import app
from ctropt.graph import CtroptError, interface, load, save
from ctropt.runtime import Runner, generate_inputs
from ctropt.runtime.buckets import BucketedSession
from ctropt.specialize import fix_shapes, rows_independent, specialize
from helpers import F, I64, init, make_model, node, vi

ROOT = Path(__file__).parent
ZOO = ROOT.parent / "ctropt" / "exporters" / "zoo" / "data"
RNG = np.random.default_rng(0)


def shape_arith_model():
    """Gather → Reshape to [Shape(x)[0], -1] (the exporters' batch arithmetic) → MatMul → Sigmoid."""
    return make_model(
        [node("Gather", ["table", "ids"], ["e"], axis=0), node("Shape", ["e"], ["s"]),
         node("Gather", ["s", "zero"], ["b"], axis=0), node("Unsqueeze", ["b", "zero1"], ["b1"]),
         node("Concat", ["b1", "minus1"], ["shape"], axis=0), node("Reshape", ["e", "shape"], ["flat"]),
         node("MatMul", ["flat", "w"], ["m"]), node("Sigmoid", ["m"], ["y"])],
        [vi("ids", I64, ["batch", 3])], [vi("y", F, ["batch", 1])],
        [init("table", RNG.normal(size=(20, 4)).astype(np.float32)), init("zero", np.array(0, np.int64)),
         init("zero1", np.array([0], np.int64)), init("minus1", np.array([-1], np.int64)),
         init("w", RNG.normal(size=(12, 1)).astype(np.float32))])


def test_fix_shapes_makes_batch_and_history_static():
    model = make_model([node("ReduceSum", ["hist", "ax"], ["y"], keepdims=0)],
                       [vi("hist", F, ["B", "T"])], [vi("y", F, ["B"])], [init("ax", np.array([1]))])
    fixed = fix_shapes(model, 32, seq_len=7)
    assert [d for *_, d in interface(fixed)] == [(32, 7), (32,)]
    assert [d for *_, d in interface(model)] == [("B", "T"), ("B",)]  # the input model is untouched
    assert [d for *_, d in interface(fix_shapes(model, 4))] == [(4, "T"), (4,)]
    wide = make_model([node("Identity", ["x"], ["y"])], [vi("x", F, ["B", "T", "D"])], [vi("y", F, ["B", "T", "D"])])
    assert [d for *_, d in interface(fix_shapes(wide, 8, seq_len=3))] == [(8, 3, "D"), (8, 3, "D")]
    static = make_model([node("Relu", ["x"], ["y"])], [vi("x", F, [2, 3])], [vi("y", F, [2, 3])])
    with pytest.raises(CtroptError, match="no dynamic batch"):
        fix_shapes(static, 8)


def test_rows_independent_catches_batch_statistics():
    per_row = shape_arith_model()
    assert rows_independent(per_row, generate_inputs(per_row, batch=8)) == ""
    batch_norm = make_model([node("ReduceSum", ["x", "ax0"], ["mu"], keepdims=1), node("Sub", ["x", "mu"], ["y"])],
                            [vi("x", F, ["B", 4])], [vi("y", F, ["B", 4])], [init("ax0", np.array([0]))])
    assert "changes with the other rows" in rows_independent(batch_norm, generate_inputs(batch_norm, batch=8))


def test_specialize_folds_shape_arithmetic_and_writes_a_manifest(tmp_path):
    model = shape_arith_model()
    manifest = specialize(model, tmp_path / "b", [1, 4, 16])
    assert [b["batch"] for b in manifest["buckets"]] == [1, 4, 16]
    assert manifest["rows_independent"]
    on_disk = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert on_disk == manifest
    for b in manifest["buckets"]:
        m = load(tmp_path / "b" / b["file"])
        ops = [n.op_type for n in m.graph.node]
        assert "Shape" not in ops and "Concat" not in ops, ops  # the batch arithmetic folded away
        assert [d for *_, d in interface(m)] == [(b["batch"], 3), (b["batch"], 1)]
        assert b["max_abs_err"] <= 1e-6
    assert (tmp_path / "b" / manifest["dynamic"]).is_file()


@pytest.mark.parametrize("source, policy, step", [
    (ZOO / "wdl_tf.onnx", "pad", 1),  # the zoo WDL (tf2onnx, 2198 nodes): every batch
    (ROOT / "data" / "thirdparty" / "deepctr_WDL_tf2onnx.onnx", "measured", 7),  # DeepCTR's WDL: every 7th
])
def test_bucketed_session_equals_the_dynamic_model_for_batches_to_600(tmp_path, source, policy, step):
    raw = load(source)
    specialize(raw, tmp_path, [1, 8, 64, 256])
    session = BucketedSession(tmp_path, threads=1, policy=policy, calibrate_runs=2)
    dynamic = Runner(raw, threads=1)
    feeds = generate_inputs(raw, batch=600, seed=11)
    for n in range(1, 601, step):
        part = {k: v[:n] for k, v in feeds.items()}
        want, got = dynamic.run(part), session.run(part)
        for name in want:
            assert got[name].shape == want[name].shape
            np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=f"{source.name} {n}")


def test_plans_pad_split_and_fall_back_to_the_dynamic_model(tmp_path):
    specialize(shape_arith_model(), tmp_path, [1, 8, 64])
    padded = BucketedSession(tmp_path, policy="pad")
    assert padded.plan(5) == [(5, 8)] and padded.plan(150) == [(64, 64), (64, 64), (22, 64)]
    measured = BucketedSession(tmp_path, policy="measured", calibrate_runs=1)
    measured.costs = {1: 1.0, 8: 2.0, 64: 10.0}  # as if measured
    measured.padded_costs = {8: 2.0, 64: 10.0}
    measured.dynamic_costs = {1: 1.5, 8: 2.05, 64: 12.0}
    assert measured.plan(1) == [(1, 1)] and measured.plan(64) == [(64, 64)]
    assert measured.plan(8) == [(8, None)]  # 2.0 vs 2.05: within the 5 % margin, the dynamic model stays
    assert measured.plan(5) == [(5, None)]  # padding to 8 (2.0) loses to the dynamic model at 5 (~1.8)
    assert measured.plan(60) == [(60, 64)]  # 10 beats ~11.4
    assert measured.plan(130) == [(64, 64), (64, 64), (2, None)]


def test_refusals(tmp_path):
    batch_norm = make_model([node("ReduceSum", ["x", "ax0"], ["mu"], keepdims=1), node("Sub", ["x", "mu"], ["y"])],
                            [vi("x", F, ["B", 4])], [vi("y", F, ["B", 4])], [init("ax0", np.array([0]))])
    manifest = specialize(batch_norm, tmp_path / "bn", [4])
    assert not manifest["rows_independent"]
    with pytest.raises(CtroptError, match="cannot pad requests"):
        BucketedSession(tmp_path / "bn")
    with pytest.raises(CtroptError, match="no manifest"):
        BucketedSession(tmp_path)
    jagged = load(ROOT / "data" / "thirdparty" / "torchrec_dlrm_dynamo.onnx")
    with pytest.raises(CtroptError, match="jagged"):
        specialize(jagged, tmp_path / "j", [4])
    seq = make_model([node("ReduceSum", ["hist", "ax"], ["y"], keepdims=0)],
                     [vi("hist", F, ["B", "T"])], [vi("y", F, ["B"])], [init("ax", np.array([1]))])
    specialize(seq, tmp_path / "seq", [4], seq_len=5)
    session = BucketedSession(tmp_path / "seq", policy="pad")
    assert session.run({"hist": np.ones((3, 5), np.float32)})["y"].tolist() == [5.0] * 3
    with pytest.raises(CtroptError, match="history length 6"):
        session.run({"hist": np.ones((3, 6), np.float32)})
    with pytest.raises(CtroptError, match="missing inputs"):
        session.run({})


def test_padding_buffers_follow_dynamic_history_lengths(tmp_path):
    """A history length left dynamic: the padding buffers follow it; outputs with a dynamic dim and extra inputs
    are fine, a wrong dtype is a clear error."""
    model = make_model([node("ReduceSum", ["hist", "ax"], ["y"], keepdims=0), node("Add", ["hist", "hist"], ["z"]),
                        node("Gather", ["table", "ids"], ["e"], axis=0)],
                       [vi("hist", F, ["B", "T"]), vi("ids", I64, ["B", 2])],
                       [vi("y", F, ["B"]), vi("z", F, ["B", "T"]), vi("e", F, ["B", 2, 3])],
                       [init("ax", np.array([1])), init("table", RNG.normal(size=(9, 3)).astype(np.float32))])
    specialize(model, tmp_path, [4, 16])
    session = BucketedSession(tmp_path, policy="pad")
    dynamic = Runner(model)
    for t in (3, 5, 3):
        for n in (1, 4, 7, 16, 21):
            feeds = {"hist": RNG.normal(size=(n, t)).astype(np.float32), "ids": RNG.integers(0, 9, (n, 2))}
            want, got = dynamic.run(feeds), session.run(feeds)
            for name in want:
                np.testing.assert_array_equal(got[name], want[name], err_msg=f"{name} t={t} n={n}")
    kept = session._buffers[16]["ids"]
    session.run({"hist": np.ones((9, 3), np.float32), "ids": np.zeros((9, 2), np.int64)})
    assert session._buffers[16]["ids"] is kept  # same shape: the buffer is reused
    extra = session.run({"hist": np.ones((4, 3), np.float32), "ids": np.zeros((4, 2), np.int64), "other": np.ones(2)})
    assert extra["y"].tolist() == [3.0] * 4  # inputs the model does not take are ignored, as before
    with pytest.raises(CtroptError, match="failed to run the model.*int32"):
        session.run({"hist": np.ones((9, 3), np.float32), "ids": np.zeros((9, 2), np.int32)})


def _rss_mib() -> float:
    return int(next(ln for ln in open("/proc/self/status") if ln.startswith("VmRSS")).split()[1]) / 1024


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the resident size from /proc")
def test_bucket_sessions_hold_one_copy_of_the_weights(tmp_path):
    """Three buckets and the dynamic model: four onnxruntime sessions, one copy of a 49 MiB table (8 copies
    before: four sessions, and the model bytes onnxruntime's Python session kept for each)."""
    table = RNG.normal(size=(200_000, 64)).astype(np.float32)
    model = make_model([node("Gather", ["table", "ids"], ["e"], axis=0), node("ReduceSum", ["e", "ax"], ["y"],
                                                                                keepdims=0)],
                       [vi("ids", I64, ["B", 2])], [vi("y", F, ["B", 64])], [init("table", table), init("ax", np.array([1]))])
    specialize(model, tmp_path, [1, 4, 16])
    del model
    gc.collect()  # specialize's graphs
    before = _rss_mib()
    session = BucketedSession(tmp_path, policy="measured", calibrate_runs=2)
    grown = _rss_mib() - before
    assert grown < 2 * table.nbytes / 2**20, f"{grown:.0f} MiB for a {table.nbytes / 2**20:.0f} MiB table"
    assert [list(w.shape) for w in session._weights] == [[200_000, 64]]
    ids = RNG.integers(0, 200_000, (9, 2))
    np.testing.assert_allclose(session.run({"ids": ids})["y"], table[ids].sum(1), rtol=1e-6)


def test_cli_specialize(tmp_path):
    src = save(shape_arith_model(), tmp_path / "m.onnx")
    runner = CliRunner()
    r = runner.invoke(app, ["specialize", str(src), "-o", str(tmp_path / "buckets"), "--batch", "1,16"],
                      catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "model.b16.onnx" in r.output and "rows are independent" in r.output
    r = runner.invoke(app, ["specialize", str(src), "-o", str(src), "--batch", "1"], catch_exceptions=False)
    assert r.exit_code == 2 and "is a file" in r.output
    r = runner.invoke(app, ["specialize", str(src), "-o", str(tmp_path / "x"), "--batch", "a,b"],
                      catch_exceptions=False)
    assert r.exit_code == 2 and "comma-separated integers" in r.output
    assert ctropt.load(src)  # the input is untouched


# ----------------------------------------------------------------------------------------- server configs

# OpenVINO Model Server's config schema for model entries (its documented fields; src/schema.cpp upstream)
OVMS_SCHEMA = {
    "type": "object", "required": ["model_config_list"], "additionalProperties": False,
    "properties": {"model_config_list": {"type": "array", "items": {
        "type": "object", "required": ["config"], "additionalProperties": False,
        "properties": {"config": {
            "type": "object", "required": ["name", "base_path"], "additionalProperties": False,
            "properties": {"name": {"type": "string"}, "base_path": {"type": "string"},
                           "batch_size": {"type": ["integer", "string"]}, "model_version_policy": {"type": "object"},
                           "shape": {"type": ["object", "string"]}, "nireq": {"type": "integer", "minimum": 0},
                           "target_device": {"type": "string"}, "plugin_config": {"type": "object"},
                           "stateful": {"type": "boolean"}}}}}}},
}


def _parse_triton(text):
    model_config_pb2 = pytest.importorskip("tritonclient.grpc.model_config_pb2")
    from google.protobuf import text_format

    return text_format.Parse(text, model_config_pb2.ModelConfig())  # raises on any unknown field or bad value


@pytest.mark.parametrize("source", [ZOO / "din_tf.onnx", ROOT / "data" / "thirdparty" / "deepctr_torch_DeepFM_legacy.onnx"])
def test_repository_configs_parse_with_the_servers_schemas(tmp_path, source):
    jsonschema = pytest.importorskip("jsonschema")
    r = CliRunner().invoke(app, ["repository", str(source), "-o", str(tmp_path), "--name", "ctr",
                                 "--batch", "1,32,128"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    config = _parse_triton((tmp_path / "triton" / "ctr" / "config.pbtxt").read_text())
    raw = load(source)
    assert config.name == "ctr" and config.backend == "onnxruntime" and config.max_batch_size == 128
    assert list(config.dynamic_batching.preferred_batch_size) == [1, 32, 128]
    assert [i.name for i in config.input] == [n for k, n, *_ in interface(raw) if k == "input"]
    assert [o.name for o in config.output] == [n for k, n, *_ in interface(raw) if k == "output"]
    triton_model = load(tmp_path / "triton" / "ctr" / "1" / "model.onnx")
    for entry, (_, _, _, dims) in zip(config.input, [x for x in interface(triton_model) if x[0] == "input"]):
        assert len(entry.dims) == max(1, len(dims) - 1)  # batch axis left to Triton
    ovms = json.loads((tmp_path / "ovms" / "config.json").read_text())
    jsonschema.validate(ovms, OVMS_SCHEMA)
    entry = ovms["model_config_list"][0]["config"]
    ov_model = tmp_path / "ovms" / entry["base_path"] / "1" / "model.onnx"
    feeds = generate_inputs(raw, batch=5)
    want = Runner(raw).run(feeds)
    got = Runner(load(ov_model), "openvino-cpu").run(feeds)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-5)


def test_a_repository_with_kernels_names_the_library_and_the_backend_can_load_it(tmp_path):
    import onnxruntime as ort

    r = CliRunner().invoke(app, ["repository", str(ZOO / "dien_tf.onnx"), "-o", str(tmp_path), "--name", "dien",
                                 "--option", "rnn_ort_form=kernel"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    folder = tmp_path / "triton" / "dien"
    config = _parse_triton((folder / "config.pbtxt").read_text())
    (library,) = config.model_operations.op_library_filename
    assert Path(library) == (folder / "libctropt_kernels.so").resolve() and Path(library).exists()
    from ctropt import kernels   # the library registered loads the build for this CPU from beside itself
    assert sorted(p.name for p in folder.glob("libctropt_kernels*.so")) == sorted(p.name for p in kernels.build_paths())
    so = ort.SessionOptions()  # what Triton's onnxruntime backend does with op_library_filename
    so.register_custom_ops_library(library)
    model = folder / "1" / "model.onnx"
    assert any(n.domain == "ai.ctropt.kernels" for n in load(model).graph.node)
    sess = ort.InferenceSession(str(model), so, providers=["CPUExecutionProvider"])
    feeds = generate_inputs(load(ZOO / "dien_tf.onnx"), batch=4)
    want = Runner(load(ZOO / "dien_tf.onnx")).run(feeds)
    for name, got in zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)):
        np.testing.assert_allclose(got, want[name], rtol=1e-4, atol=1e-5)


def test_triton_config_without_batching_for_batch_dependent_models():
    from ctropt.deploy import triton_config

    model = make_model([node("ReduceSum", ["x", "ax0"], ["mu"], keepdims=1), node("Sub", ["x", "mu"], ["y"]),
                        node("ReduceSum", ["x", "ax1"], ["s"], keepdims=0)],
                       [vi("x", F, ["B", 4])], [vi("y", F, ["B", 4]), vi("s", F, ["B"])],
                       [init("ax0", np.array([0])), init("ax1", np.array([1]))])
    unbatched = _parse_triton(triton_config(model, "m", [8], batched=False))
    assert unbatched.max_batch_size == 0 and not unbatched.HasField("dynamic_batching")
    assert list(unbatched.input[0].dims) == [-1, 4]
    batched = _parse_triton(triton_config(model, "m", [8, 2], batched=True))
    assert list(batched.output[1].dims) == [1] and list(batched.output[1].reshape.shape) == []  # a [B] output
    r = CliRunner().invoke(app, ["repository", "nothing.onnx", "-o", "x"], catch_exceptions=False)
    assert r.exit_code == 2 and "Traceback" not in r.output


def test_routing_large_requests_to_a_second_backend_and_the_sweep_that_sets_it(tmp_path):
    """OpenVINO CPU stands in for the GPU here (no GPU on these machines); the routing is the same. The buckets are
    optimized for OpenVINO: standard ops both backends load (`--target ort` may emit ctropt's onnxruntime kernels)."""
    model = shape_arith_model()
    specialize(model, tmp_path / "b", [1, 8, 64], target="openvino")
    session = BucketedSession(tmp_path / "b", policy="pad", gpu_backend="openvino-cpu", gpu_threshold=8)
    feeds = generate_inputs(model, batch=100)
    dynamic = Runner(model)
    for n in (1, 7, 8, 30, 100):
        part = {k: v[:n] for k, v in feeds.items()}
        np.testing.assert_allclose(session.run(part)["y"], dynamic.run(part)["y"], rtol=1e-5, atol=1e-6)
    assert set(session._gpu) == {8, 64} and all(r.backend == "openvino-cpu" for r in session._gpu.values())
    with pytest.raises(CtroptError, match="needs both"):
        BucketedSession(tmp_path / "b", gpu_backend="openvino-cpu")
    src = save(model, tmp_path / "m.onnx")
    r = CliRunner().invoke(app, ["bench", str(src), "--sweep", "openvino-cpu", "--batch", "1,16", "--seconds", "0.1"],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "on openvino-cpu" in r.output and ("gpu_threshold=" in r.output or "keep ort-cpu" in r.output)


def _readme_snippet(tag: str) -> str:
    readme = (ROOT.parent / "README.md").read_text()
    return readme.split(f"<!-- serving: {tag} -->")[1].split("```python")[1].split("```")[0]


def test_the_readme_openvino_and_plain_serving_snippets_run(tmp_path):
    """The README's OpenVINO snippet on a `--target openvino` result, and a model optimized with ort_kernels=off in
    a plain onnxruntime session: both answer as the raw export does, with no library registered."""
    import onnxruntime as ort

    raw = load(ZOO / "dien_tf.onnx")
    feeds = generate_inputs(raw, batch=9)
    want = Runner(raw).run(feeds)
    ov_model = tmp_path / "dien.ov.onnx"
    save(ctropt.optimize(raw, target="openvino", speed=False).model, ov_model)
    scope = {"MODEL": str(ov_model), "FEEDS": feeds}
    exec(_readme_snippet("openvino"), scope)
    for name, got in zip(want, scope["outputs"].values()):
        np.testing.assert_allclose(got, want[name], rtol=1e-4, atol=1e-5)

    r = CliRunner().invoke(app, ["optimize", str(ZOO / "dien_tf.onnx"), "-o", str(tmp_path / "dien.plain.onnx"),
                                 "--option", "ort_kernels=off", "--no-speed-check"])
    assert r.exit_code == 0, r.output
    assert "ctropt kernels path" not in _readme_snippet("openvino")
    session = ort.InferenceSession(str(tmp_path / "dien.plain.onnx"), providers=["CPUExecutionProvider"])
    for name, got in zip([o.name for o in session.get_outputs()], session.run(None, feeds)):
        np.testing.assert_allclose(got, want[name], rtol=1e-4, atol=1e-5)
