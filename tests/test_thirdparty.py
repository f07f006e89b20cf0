"""End to end on models exported by third-party CTR libraries (deepctr-torch with both torch.onnx
exporters, DeepCTR for TensorFlow through tf2onnx). The files, a sample batch and the framework's own
outputs are in tests/data/thirdparty (made by make_exports.py there)."""

from pathlib import Path

import numpy as np
import pytest

import ctropt
from ctropt.graph import CtroptError, interface, load
from ctropt.runtime import Runner, compare_outputs

DATA = Path(__file__).parent / "data" / "thirdparty"
MODELS = sorted(p for p in DATA.glob("*.onnx"))


def npz(path):
    with np.load(path) as data:
        return {k: data[k] for k in data.files}


@pytest.mark.parametrize("path", MODELS, ids=lambda p: p.stem)
def test_optimize_all_keeps_outputs_interface_and_runtimes(path):
    raw = load(path)
    result = ctropt.optimize(raw, passes="all")
    assert not result.failed, [(r.name, r.message) for r in result.failed]
    opt = result.model
    assert interface(opt) == interface(raw)

    feeds, framework = npz(path.with_suffix(".npz")), npz(path.with_suffix(".ref.npz"))
    got = Runner(opt).run(feeds)
    diffs = compare_outputs(framework, {k: got[k] for k in framework}, atol=1e-5, rtol=1e-4)
    assert all(d.ok for d in diffs), diffs

    try:
        raw_ov = Runner(raw, "openvino-cpu").run(feeds)
    except CtroptError:
        return  # OpenVINO cannot run this export as it is; the openvino target's lowering owns that
    assert all(d.ok for d in compare_outputs(raw_ov, Runner(opt, "openvino-cpu").run(feeds), atol=1e-5, rtol=1e-4))

    again = ctropt.optimize(opt, passes="all")
    assert all(r.status == "unchanged" for r in again.records), [(r.name, r.status) for r in again.records]


def test_an_export_that_does_not_run_is_refused_with_advice(tmp_path):
    """DeepCTR's DIEN (AUGRU) through tf2onnx fails in onnxruntime at any batch but 16: nothing to verify against."""
    from typer.testing import CliRunner

    from ctropt.cli import app

    broken = DATA / "broken" / "deepctr_DIEN_AUGRU_tf2onnx.onnx"
    with pytest.raises(CtroptError, match="does not run.*--no-verify"):
        ctropt.optimize(load(broken))
    result = CliRunner().invoke(app, ["optimize", str(broken), "-o", str(tmp_path / "o.onnx")])
    assert result.exit_code == 2 and "--no-verify" in result.output and "Traceback" not in result.output
