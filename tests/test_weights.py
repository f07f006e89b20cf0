"""The weight store (graph/weights.py, issue 48): large tensors stay in one file while the passes run, are read as
memory maps, joined tables are views of what is there, and `ctropt optimize` keeps external data."""

import os
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto
from typer.testing import CliRunner

import ctropt
from ctropt.cli import app
from ctropt.graph import weights
from ctropt.runtime import Runner
from helpers import F, I64, init, make_model, node, vi

ROWS = (70_000, 90_000, 80_000)   # tables of 1.1-1.4 MB: over weights.THRESHOLD
WIDTH = 4


def lookups_model() -> onnx.ModelProto:
    """Three id inputs [B, 1], each looked up in its table [rows, 4], concatenated and summed with a dense input
    through a small Gemm: fuse-parallel-embeddings joins the tables."""
    rng = np.random.default_rng(0)
    tables = [init(f"t{i}", rng.standard_normal((rows, WIDTH)).astype(np.float32)) for i, rows in enumerate(ROWS)]
    nodes = [node("Gather", [f"t{i}", f"id{i}"], [f"e{i}"]) for i in range(3)]
    nodes += [node("Concat", ["e0", "e1", "e2"], ["emb"], axis=1), node("Flatten", ["emb"], ["flat"], axis=1),
              node("Gemm", ["flat", "w"], ["y"])]
    inputs = [vi(f"id{i}", I64, ["B", 1]) for i in range(3)]
    w = init("w", rng.standard_normal((3 * WIDTH, 2)).astype(np.float32))
    return make_model(nodes, inputs, [vi("y", F, ["B", 2])], tables + [w])


def feeds(batch=5, seed=1):
    rng = np.random.default_rng(seed)
    return {f"id{i}": rng.integers(-rows, rows, (batch, 1)) for i, rows in enumerate(ROWS)}


def test_adopt_lays_tables_of_one_width_out_in_lookup_order_and_joining_them_is_a_view():
    model = lookups_model()
    with weights.WeightStore.opened() as store:
        store.adopt(model)
        stored = {t.name: weights.external_ref(t) for t in weights.stored(model)}
        assert set(stored) == {"t0", "t1", "t2"}   # w (48 bytes) stays inline
        assert stored["t1"][1] == stored["t0"][1] + stored["t0"][2] and stored["t2"][1] == stored["t1"][1] + stored["t1"][2]
        arrays = [store.array(t) for t in weights.stored(model)]
        end = store._end
        joined = store.join(arrays)
        assert store._end == end and store.reference(joined) is not None   # nothing written: a view
        assert np.array_equal(joined, np.concatenate(arrays))
        mixed = store.join([arrays[2], arrays[0]])   # not in file order: written once
        assert store._end > end and np.array_equal(mixed, np.concatenate([arrays[2], arrays[0]]))
        inline = store.inline(model)
        assert not weights.stored(inline)
        assert all(np.array_equal(onnx.numpy_helper.to_array(a), onnx.numpy_helper.to_array(b))
                   for a, b in zip(inline.graph.initializer, lookups_model().graph.initializer))
        folder = store.folder
    assert not folder.exists()


def test_the_api_keeps_large_tensors_in_a_store_and_gives_them_back_inline():
    model = lookups_model()
    result = ctropt.optimize(model, speed=False)
    assert any(r.name == "fuse-parallel-embeddings" and r.status == "applied" for r in result.records)
    assert not weights.stored(result.model)
    expected, got = Runner(model).run(feeds()), Runner(result.model).run(feeds())
    assert np.allclose(expected["y"], got["y"], atol=1e-5)


@pytest.mark.parametrize("target", ["ort", "openvino"])
def test_optimize_keeps_external_data_and_leaves_no_work_folder(tmp_path, target):
    """An input with external data: the result has its tensors in OUT.data (unchanged names), loads in
    onnxruntime (ctropt's kernels registered) and OpenVINO, answers as the input, and the work folder is gone."""
    model = lookups_model()
    src = tmp_path / "in" / "m.onnx"
    src.parent.mkdir()
    onnx.save_model(model, str(src), save_as_external_data=True, location="m.onnx.data", size_threshold=1024)
    out = tmp_path / "out" / "m.opt.onnx"
    out.parent.mkdir()
    result = CliRunner().invoke(app, ["optimize", str(src), "-o", str(out), "--target", target, "--no-speed-check"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "(1/" in result.output   # a line per pass off a terminal
    assert sorted(p.name for p in out.parent.iterdir()) == ["m.opt.onnx", "m.opt.onnx.data"]
    saved = onnx.load(str(out), load_external_data=False)
    assert weights.stored(saved) and all(weights.external_ref(t)[0] == "m.opt.onnx.data" for t in weights.stored(saved))
    expected = Runner(str(src)).run(feeds())
    for backend in ("ort-cpu", "openvino-cpu"):
        if target == "ort" and backend == "openvino-cpu":
            continue   # ctropt's kernels are onnxruntime's
        got = Runner(str(out), backend).run(feeds())
        assert np.allclose(expected["y"], got["y"], atol=1e-5), backend


def test_a_killed_runs_work_folder_goes_when_the_next_one_opens(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    orphan = tmp_path / f"{weights.PREFIX}{dead.pid}-abc"
    orphan.mkdir()
    (orphan / weights.MADE).write_bytes(b"x")
    live = tmp_path / f"{weights.PREFIX}{os.getppid()}-abc"   # a live process's folder stays
    live.mkdir()
    with weights.WeightStore.opened(near=tmp_path) as store:
        assert not orphan.exists() and live.exists() and store.folder.parent == tmp_path


def test_truncated_external_data_is_a_clear_error(tmp_path):
    src = tmp_path / "m.onnx"
    onnx.save_model(lookups_model(), str(src), save_as_external_data=True, location="m.onnx.data", size_threshold=1024)
    data = tmp_path / "m.onnx.data"
    data.write_bytes(data.read_bytes()[:1000])
    result = CliRunner().invoke(app, ["optimize", str(src), "-o", str(tmp_path / "o.onnx")])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "external data" in result.output or "ends before" in result.output, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "m.onnx.data"]
