"""Same answers to bad requests (DESIGN principle 8), the fast subset of benchmarks/requests.py for CI: three small
exports (the zoo's DeepFM, PaddleRec's DIEN, FuxiCTR's BST transformer), each against two of its optimized
forms, on the reduced case list (`build_cases(quick=True)`: out-of-range ids, NaN and ±inf, batch 0/1/3/257,
history lengths 0/1/2T, an all-padding row, lengths that contradict the histories, a one-user request, a wrong
dtype), and the zoo's DLRM, whose raw export fails at batch 0 and 1 (a Div by the batch size, a ConstantOfShape of
-1). Every case must end `equal`, `both_raise` or `repaired` (the raw export's own bug, the optimized model
answering as the raw export does for the same rows in a larger batch), and the optimized model must give the same bits run twice and
at 2 threads; the failure message lists each case that does not, with its class and the runtime's message.
`python benchmarks/requests.py` runs the whole corpus with every case family."""

import importlib.util
import sys
from pathlib import Path

import pytest

from ctropt import kernels

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    # appended, not first: benchmarks/requests.py would otherwise shadow the `requests` package for the whole session
    sys.path.append(str(BENCHMARKS))
_spec = importlib.util.spec_from_file_location("ctropt_bench_requests", BENCHMARKS / "requests.py")
harness = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = harness   # dataclasses look their module up by name
_spec.loader.exec_module(harness)

PAIRS = [("deepfm_tf", "default"), ("deepfm_tf", "no_kernels"),
         ("paddlerec_DIEN_paddle2onnx", "default"), ("paddlerec_DIEN_paddle2onnx", "openvino"),
         ("fuxictr_BST_dynamo", "default"), ("fuxictr_BST_dynamo", "user_inputs"), ("dlrm_tf", "default")]


def _path(stem: str) -> Path:
    return next(p for p in (harness.ZOO / f"{stem}.onnx", harness.THIRD / f"{stem}.onnx") if p.exists())


def test_quick_cases_cover_each_family():
    ex = harness.load_export(_path("fuxictr_BST_dynamo"), harness.user_inputs_of("fuxictr_BST_dynamo"))
    families = {c.family for c in harness.build_cases(ex, quick=True)}
    assert {"real", "ids", "floats", "batch", "history", "user", "interface"} <= families
    full = harness.build_cases(ex)
    assert 40 <= len(full) <= 80 and len({c.name for c in full}) == len(full)


def test_classify():
    import numpy as np

    a = {"y": np.array([1.0, np.nan], np.float32)}
    assert harness.classify(a, "", {"y": np.array([1.00001, np.nan], np.float32)}, "", {})[0] == "equal"
    assert harness.classify(a, "", {"y": np.array([1.0, 0.0], np.float32)}, "", {})[0] == "differ"
    assert harness.classify(None, "bad id", a, "", {})[0] == "silent"
    # the raw export fails through its own bug: answering what it answers to the same rows in a request it takes
    assert harness.classify(None, "Div by zero", a, "", {}, witness=dict(a))[0] == "repaired"
    assert harness.classify(None, "Div by zero", a, "", {}, witness={"y": np.array([1.0, 0.0], np.float32)})[0] \
        == "silent"
    assert harness.classify(a, "", None, "bad id", {})[0] == "opt_raises"
    assert harness.classify(None, "bad id", None, "bad id", {})[0] == "both_raise"


def test_a_hanging_case_is_recorded_and_the_next_case_runs(tmp_path):
    """The raw export against itself: a million-row case past a 0.3 s timeout is a hang, and a new worker runs the
    cases after it."""
    raw = _path("deepctr_DeepFM_tf2onnx")
    ex = harness.load_export(raw)
    cases = [harness.build_cases(ex)[0], *harness.batch_cases(ex, (1_000_000,)), harness.build_cases(ex)[0]]
    results, error = harness.Pool(raw, raw, cases, tmp_path, timeout=0.3, memory_gb=6).run()
    assert not error
    assert [r["class"] for r in results] == ["equal", "hang", "equal"], results


@pytest.mark.parametrize("stem,variant", PAIRS, ids=[f"{s}-{v}" for s, v in PAIRS])
def test_bad_requests_answered_as_the_raw_export(stem, variant):
    if variant in ("default", "user_inputs") and kernels.ensure():
        pytest.skip(f"ctropt's kernel library cannot be built here: {kernels.ensure()}")
    row = harness.check(_path(stem), variant, quick=True, timeout=60)
    assert row is not None and not row["error"], row and row["error"]
    assert len(row["results"]) == row["cases"]
    bad = harness.findings(row)
    assert not bad, f"{len(bad)} of {row['cases']} cases:\n" + "\n".join(
        f"  {r['case']}: {r['class']}{' nondeterministic: ' + r['nondet'] if r['nondet'] else ''} {r['msg']}"
        for r in bad)
