"""The reference model zoo: shipped exports (no framework needed) and rebuilds from TensorFlow/PyTorch."""

import numpy as np
import pytest
from typer.testing import CliRunner

import ctropt
from ctropt.cli import app
from ctropt.exporters import zoo
from ctropt.graph import CtroptError, interface, load, to_graph
from ctropt.inspect import ctr_structures, recurrent_structures
from ctropt.runtime import Runner, compare_outputs, strings

SHIPPED = [(name, fw) for name, e in zoo.ENTRIES.items() for fw in e.frameworks]
runner = CliRunner()

# What `ctropt inspect` must find in each export: (kind, how many at least).
STRUCTURES = {
    ("wdl", "tf"): [("partitioned lookup", 52)],
    ("deepfm", "tf"): [("indicator column", 1)],
    ("dlrm", "tf"): [("embedding bag", 8)],
    ("din", "tf"): [("padded attention", 1)],
    ("dien", "tf"): [("padded attention", 1), ("Scan with a GRU cell", 1), ("Scan with an AUGRU cell", 1)],
    ("din", "torch"): [("padded attention", 1)],
    ("dien", "torch"): [("GRU op", 1), ("unrolled chain", 2)],
    ("mmoe", "tf"): [],
    ("wdl_strings", "tf"): [],
    ("din_strings", "tf"): [("padded attention", 1)],
}
NEEDS_STRINGS = "onnxruntime-extensions is not installed (string features)"


def npz(path):
    with np.load(path) as data:
        return {k: data[k] for k in data.files}


@pytest.mark.parametrize("name, framework", SHIPPED)
def test_shipped_export_matches_its_framework_and_optimizes(name, framework):
    if name in zoo.STRINGS and not strings.available():
        pytest.skip(NEEDS_STRINGS)
    path = zoo.shipped_path(name, framework)
    model = load(path)
    feeds, framework_out = npz(path.with_suffix(".npz")), npz(path.with_suffix(".ref.npz"))
    diffs = compare_outputs(framework_out, Runner(model).run(feeds), atol=1e-5, rtol=0)
    assert all(d.ok for d in diffs), diffs

    graph = to_graph(model)
    found = [s.kind for s in ctr_structures(graph) + recurrent_structures(graph)]
    for kind, count in STRUCTURES[(name, framework)]:
        assert found.count(kind) >= count, (kind, found)

    result = ctropt.optimize(model, speed=False)
    assert not result.failed, [(r.name, r.message) for r in result.failed]
    assert interface(result.model) == interface(model)


def test_zoo_cli_list_and_shipped_build(tmp_path):
    listing = runner.invoke(app, ["zoo", "list"])
    assert listing.exit_code == 0 and all(name in listing.output for name in zoo.ENTRIES)
    out = tmp_path / "dien.onnx"
    result = runner.invoke(app, ["zoo", "build", "dien", "-o", str(out), "--shipped"])
    assert result.exit_code == 0, result.output
    assert out.read_bytes() == zoo.shipped_path("dien").read_bytes()
    assert "no zoo model" in runner.invoke(app, ["zoo", "build", "nope", "-o", str(out)]).output
    assert "not torch" in runner.invoke(app, ["zoo", "build", "wdl", "-o", str(out), "--framework", "torch"]).output
    with pytest.raises(CtroptError, match="no zoo model"):
        zoo.entry("nope")


@pytest.mark.parametrize("name", [n for n, e in zoo.ENTRIES.items() if "tf" in e.frameworks])
def test_rebuild_from_tensorflow_matches_at_every_batch_and_length(name):
    pytest.importorskip("tensorflow")
    if name in zoo.STRINGS and not strings.available():
        pytest.skip(NEEDS_STRINGS)
    _, _, checks = zoo.build_and_check(name, "tf")
    expected = 6 if zoo.ENTRIES[name].sequence else 3  # batch 1, 7, 256 (x two history lengths)
    assert len(checks) == expected and all(c.ok and c.max_abs_err <= 1e-5 for c in checks), checks


@pytest.mark.parametrize("name", [n for n, e in zoo.ENTRIES.items() if "torch" in e.frameworks])
def test_rebuild_from_pytorch_matches_at_every_batch_and_length(name):
    pytest.importorskip("torch")
    _, _, checks = zoo.build_and_check(name, "torch")
    assert len(checks) == 6 and all(c.ok and c.max_abs_err <= 1e-5 for c in checks), checks


def test_zoo_build_cli_rebuilds_and_checks(tmp_path):
    pytest.importorskip("tensorflow")
    result = runner.invoke(app, ["zoo", "build", "din", "-o", str(tmp_path / "din.onnx"), "--rebuild"])
    assert result.exit_code == 0, result.output
    assert "built and exported" in result.output and "NO" not in result.output


def test_din_through_the_dynamo_exporter():
    pytest.importorskip("torch")
    result, _, checks = zoo.build_and_check("din", "torch", exporter="dynamo")
    assert all(c.ok for c in checks), checks
    assert {o.domain or "": o.version for o in result.model.opset_import}[""] == 18
