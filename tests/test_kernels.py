"""ctropt's onnxruntime kernel library: GRUScan against the sequence op's numpy meaning, lower-rnn-ort's
kernel form on every variant and masking, zoo and third-party DIEN exports end to end, and the errors.

The library is built here (gcc and the C API header ctropt ships) unless gcc is missing; .ci/run sets
CTROPT_KERNEL_TESTS=required, so there a failed build fails."""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import ctropt
from ctropt import kernels
from ctropt.graph import CtroptError, interface, load, to_model
from ctropt.ops.rnn import SequenceAttrs
from ctropt.passes.rnn.lower_ort import lower_sequence_node
from ctropt.runtime import Runner, compare_outputs
from tests.helpers import built_kernels, make_model
from tests.test_rnn_op import H, MASKING, VARIANTS, _layer

ZOO = Path(ctropt.__file__).parent / "exporters" / "zoo" / "data"
THIRDPARTY = Path(__file__).parent / "data" / "thirdparty"


@pytest.fixture(scope="module", autouse=True)
def library(tmp_path_factory):
    yield from built_kernels(tmp_path_factory)


def _session(model: onnx.ModelProto, threads: int = 1) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    kernels.register(so)
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _npz(path):
    with np.load(path) as data:
        return {k: data[k] for k in data.files}


@pytest.mark.parametrize("kind,lbr,keep,pad", VARIANTS)
def test_kernel_form_matches_the_reference(kind, lbr, keep, pad):
    """Every kind, gate layout and padded-output rule; lengths (0, T, partial), a mask, or neither; with and
    without h0 and all states; the whole batch and sub-batches (a block of rows shorter than the kernel's, no rows)."""
    rng = np.random.default_rng(1)
    for (with_lens, with_mask), with_h0, want_y in itertools.product(MASKING, (0, 1), (0, 1)):
        g, n, feeds, want = _layer(SequenceAttrs(kind, H, lbr, keep, pad), with_lens, with_mask, with_h0, want_y, rng)
        lower_sequence_node(g, n, "kernel")
        g.cleanup()
        model = to_model(g, make_model([], [], []))
        onnx.checker.check_model(model)
        assert [x.op_type for x in model.graph.node if x.domain == kernels.DOMAIN] == ["GRUScan"]
        assert not {"Scan", "Loop", "GRU", "Gemm", "MatMul"} & {x.op_type for x in model.graph.node}
        sess = _session(model)
        for rows in (slice(None), slice(0, 1), slice(1, 3), slice(0, 0)):
            got = sess.run(None, {k: v[rows] for k, v in feeds.items()})
            for a, b in zip(got, want):
                np.testing.assert_allclose(a, b[rows], atol=2e-6)


@pytest.mark.parametrize("lbr", [0, 1])
@pytest.mark.parametrize("kind", ["GRU", "AUGRU", "AGRU", "AIGRU"])
def test_kernel_vector_update_matches_the_reference(kind, lbr, monkeypatch):
    """H = 16, two whole vectors per gate (the other tests' H = 3 runs in one padded vector): each row's update in
    vector passes (linear_before_reset: gates, candidate and blend in one, update_lbr; else gates and r·h, then
    candidate and blend: gates_r_h, update_rn; AIGRU scales x·W first); lengths, a mask or neither, padded outputs
    zero or kept."""
    import tests.test_rnn_op as rnn_op

    monkeypatch.setattr(rnn_op, "H", 16)
    rng = np.random.default_rng(2)
    keeps = (0, 1) if kind == "AUGRU" else (0,)  # att_keep: AUGRU's gate scaling (mode 1 or 2)
    for (with_lens, with_mask), keep, pad in itertools.product(MASKING, keeps, ("zero", "state")):
        g, n, feeds, want = _layer(SequenceAttrs(kind, 16, lbr, keep, pad), with_lens, with_mask, 1, 1, rng)
        lower_sequence_node(g, n, "kernel")
        g.cleanup()
        got = _session(to_model(g, make_model([], [], []))).run(None, feeds)
        for a, b in zip(got, want):  # sums of 16 terms: float32 rounding reaches 2e-6
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
def test_rows_of_every_length_in_one_batch(threads):
    """Rows run sorted by their number of steps, in blocks spread over the threads: a shuffled batch with every
    length 0..T, and a batch of empty rows only (Y_h = h0, Y = 0 everywhere)."""
    from ctropt.ops.rnn import reference

    rng = np.random.default_rng(2)
    attrs = SequenceAttrs("AUGRU", H, 1)
    g, n, feeds, _ = _layer(attrs, 1, 0, 1, 1, rng)
    weights = [np.asarray(t.values) for t in n.inputs[1:4]]
    lower_sequence_node(g, n, "kernel")
    g.cleanup()
    sess = _session(to_model(g, make_model([], [], [])), threads)
    steps, width = feeds["X"].shape[1:]
    for lens in (rng.permutation(np.arange(3 * (steps + 1)) % (steps + 1)), np.zeros(13, np.int64)):
        batch = len(lens)
        f = {"X": rng.normal(size=(batch, steps, width)).astype(np.float32),
             "att": rng.uniform(size=(batch, steps)).astype(np.float32), "lens": lens.astype(np.int64),
             "h0": rng.normal(size=(batch, H)).astype(np.float32)}
        y, y_h = sess.run(None, f)
        want_y, want_h = reference(attrs, f["X"], *weights, sequence_lens=f["lens"], initial_h=f["h0"], att=f["att"])
        np.testing.assert_allclose(y, want_y, atol=2e-6)
        np.testing.assert_allclose(y_h, want_h, atol=2e-6)


@pytest.mark.parametrize("lengths", [False, True])
def test_aigru_rows_fed_zeros_after_their_last_weight(lengths, monkeypatch):
    """AIGRU (PaddleRec DIEN: a GRU over softmax-weighted inputs, padded positions weighted 0): after a row's last
    nonzero weight its input is 0, so the kernel skips x·W there (rows sorted by that step too); zeros inside a row,
    a row weighted 0 everywhere, and lengths that end before or after the last weight."""
    import tests.test_rnn_op as rnn_op
    from ctropt.ops.rnn import reference

    monkeypatch.setattr(rnn_op, "H", 16)
    rng = np.random.default_rng(5)
    attrs = SequenceAttrs("AIGRU", 16, 1)
    g, n, feeds, _ = _layer(attrs, int(lengths), 0, 1, 1, rng)
    weights = [np.asarray(t.values) for t in n.inputs[1:4]]
    lower_sequence_node(g, n, "kernel")
    g.cleanup()
    sess = _session(to_model(g, make_model([], [], [])))
    steps, width = feeds["X"].shape[1:]
    batch = 3 * (steps + 1)
    fed = rng.permutation(np.arange(batch) % (steps + 1))
    att = rng.uniform(size=(batch, steps)) * (np.arange(steps)[None] < fed[:, None]) * (rng.random((batch, steps)) > 0.2)
    f = {"X": rng.normal(size=(batch, steps, width)).astype(np.float32), "att": att.astype(np.float32),
         "h0": rng.normal(size=(batch, 16)).astype(np.float32)}
    if lengths:
        f["lens"] = rng.integers(0, steps + 1, size=batch).astype(np.int64)
    y, y_h = sess.run(None, f)
    want_y, want_h = reference(attrs, f["X"], *weights, sequence_lens=f.get("lens"), initial_h=f["h0"], att=f["att"])
    np.testing.assert_allclose(y, want_y, atol=1e-5)
    np.testing.assert_allclose(y_h, want_h, atol=1e-5)


@pytest.mark.parametrize("path", [ZOO / "dien_tf.onnx", ZOO / "dien_torch.onnx",
                                  THIRDPARTY / "deepctr_DIEN_AUGRU_where_tf2onnx.onnx",
                                  THIRDPARTY / "deepctr_torch_DIEN_AIGRU_padded_legacy.onnx"], ids=lambda p: p.stem)
def test_dien_exports_with_the_kernel_form(path):
    """`all` with rnn_ort_form=kernel: every recurrent layer is one GRUScan, no loop is left, the interface is
    kept, outputs equal the framework's (shipped inputs), and ctropt's Runner registers the library itself."""
    raw = load(path)
    result = ctropt.optimize(raw, passes="all", options={"rnn_ort_form": "kernel"}, speed=False)
    assert not result.failed, [(r.name, r.message) for r in result.failed]
    opt = result.model
    assert interface(opt) == interface(raw)
    from ctropt.graph import op_histogram

    ops = op_histogram(opt)
    assert ops[f"{kernels.DOMAIN}::GRUScan"] == 2 and not {"Scan", "Loop", "GRU"} & set(ops), ops
    from ctropt.graph import to_graph
    from ctropt.inspect import recurrent_structures

    assert [r.kind for r in recurrent_structures(to_graph(opt))] == [f"lowered GRUScan ({kernels.DOMAIN})"] * 2
    feeds = _npz(path.with_suffix(".npz"))
    framework = _npz(path.with_suffix(".ref.npz"))
    got = Runner(opt).run(feeds)
    diffs = compare_outputs(framework, {k: got[k] for k in framework}, atol=1e-5, rtol=1e-4)
    assert all(d.ok for d in diffs), diffs
    again = ctropt.optimize(opt, passes="all", options={"rnn_ort_form": "kernel"}, speed=False)
    assert all(r.status == "unchanged" for r in again.records), [(r.name, r.status) for r in again.records]


def test_the_library_is_built_on_first_use(tmp_path, monkeypatch):
    g, n, feeds, _ = _layer(SequenceAttrs("GRU", H), 1, 0, 0, 0, np.random.default_rng(3))
    lower_sequence_node(g, n, "kernel")
    monkeypatch.setenv("CTROPT_KERNELS_DIR", str(tmp_path))
    monkeypatch.setattr(kernels, "_BUILD_FAILED", [])
    assert not kernels.available()
    Runner(to_model(g, make_model([], [], []))).run(feeds)
    assert kernels.available() and kernels.library_path().parent == tmp_path


def test_a_model_with_kernels_and_no_compiler_is_a_clear_error(tmp_path, monkeypatch):
    g, n, feeds, _ = _layer(SequenceAttrs("GRU", H), 1, 0, 0, 0, np.random.default_rng(3))
    lower_sequence_node(g, n, "kernel")
    model = to_model(g, make_model([], [], []))
    _no_compiler(tmp_path, monkeypatch)
    with pytest.raises(CtroptError, match="kernel library cannot be built here: .*no-such-cc not found"):
        Runner(model).run(feeds)


def _no_compiler(tmp_path, monkeypatch):
    monkeypatch.setenv("CTROPT_KERNELS_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setattr(kernels, "_BUILD_FAILED", [])


def test_the_kernel_form_without_the_library_is_a_clear_error(tmp_path, monkeypatch):
    _no_compiler(tmp_path, monkeypatch)
    with pytest.raises(CtroptError, match="rnn_ort_form=kernel needs .* cannot be built here: .*no-such-cc not found"):
        ctropt.optimize(load(ZOO / "dien_tf.onnx"), passes="all", options={"rnn_ort_form": "kernel"}, speed=False)


def test_by_default_the_kernel_form_when_the_library_loads_else_standard_ops_and_a_note():
    fast = ctropt.optimize(load(ZOO / "dien_tf.onnx"), passes="all", speed=False)
    assert any(n.domain == kernels.DOMAIN for n in fast.model.graph.node)
    (record,) = [r for r in fast.records if r.name == "lower-rnn-ort"]
    assert any("GRUScan kernels" in note for note in record.notes)


def test_without_a_compiler_the_default_is_standard_ops_with_a_note(tmp_path, monkeypatch):
    _no_compiler(tmp_path, monkeypatch)
    raw = load(ZOO / "dien_tf.onnx")
    plain = ctropt.optimize(raw, passes="all", speed=False)
    assert not kernels.uses_kernels(plain.model)
    (record,) = [r for r in plain.records if r.name == "lower-rnn-ort"]
    assert record.status == "applied" and any("not available" in note for note in record.notes), record.notes


def test_bad_shapes_are_refused_by_the_kernel():
    g, n, feeds, _ = _layer(SequenceAttrs("GRU", H), 1, 0, 0, 0, np.random.default_rng(4))
    lower_sequence_node(g, n, "kernel")
    sess = _session(to_model(g, make_model([], [], [])))
    with pytest.raises(Exception, match="GRUScan: lengths must be \\[B\\]"):
        sess.run(None, {"X": feeds["X"], "lens": feeds["lens"][:2]})


def test_build_without_the_header_says_where_it_looked(monkeypatch, tmp_path):
    monkeypatch.setenv("CTROPT_KERNELS_DIR", str(tmp_path))
    with pytest.raises(CtroptError, match="onnxruntime_c_api.h not found.*fetch_ort_headers"):
        kernels.build(include=tmp_path)


def test_optimize_says_which_form_the_recurrent_layers_took(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from ctropt.cli import app

    args = ["optimize", str(ZOO / "dien_tf.onnx"), "-o", str(tmp_path / "k.onnx"), "--no-speed-check"]
    r = CliRunner().invoke(app, args, catch_exceptions=False)
    text = " ".join(r.output.split())
    assert r.exit_code == 0 and "GRUScan," in text and "run as ctropt's kernels" in text, r.output
    _no_compiler(tmp_path, monkeypatch)
    r = CliRunner().invoke(app, args[:3] + [str(tmp_path / "s.onnx"), "--no-speed-check"], catch_exceptions=False)
    text = " ".join(r.output.split())
    assert r.exit_code == 0 and "lower-rnn-ort: standard ops: ctropt's kernel library is not available" in text, text
    assert "GRUScan" not in text


def test_a_read_only_install_builds_into_the_users_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("CTROPT_KERNELS_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(kernels.os, "access", lambda path, mode: False)  # site-packages not writable
    monkeypatch.setattr(kernels, "HERE", tmp_path / "site-packages")   # and no library came with the wheel
    assert kernels.library_path() == tmp_path / "ctropt" / "libctropt_kernels.so"
    assert (kernels.include_dir() / kernels.HEADER).exists()  # the header ctropt ships, at the least


def test_one_build_per_instruction_set_and_the_same_answers_on_each(monkeypatch):
    """The library onnxruntime registers picks the widest build this CPU runs (AVX-512, AVX2 + FMA, the x86-64
    baseline); $CTROPT_KERNELS_ISA forces one. Every build this CPU can run gives the zoo DIEN's outputs (GRUScan,
    AttentionCore, GatherRows, ...) as the framework does; an unknown build is a clear error."""
    raw = load(ZOO / "dien_tf.onnx")
    opt = ctropt.optimize(raw, speed=False).model
    assert kernels.uses_kernels(opt)
    feeds, framework = _npz(ZOO / "dien_tf.npz"), _npz(ZOO / "dien_tf.ref.npz")
    order = [isa for isa, _ in kernels.isas()]
    best = kernels.chosen_isa()
    for isa in order[order.index(best):]:
        monkeypatch.setenv("CTROPT_KERNELS_ISA", isa)
        assert kernels.chosen_isa() == isa
        got = Runner(opt).run(feeds)
        diffs = compare_outputs(framework, {k: got[k] for k in framework}, atol=1e-5, rtol=1e-4)
        assert all(d.ok for d in diffs), (isa, diffs)
    monkeypatch.setenv("CTROPT_KERNELS_ISA", "sse9")
    with pytest.raises(CtroptError, match="cannot load the sse9 build"):
        Runner(opt).run(feeds)


# pythons with older onnxruntimes, os.pathsep-separated (.ci/run makes 1.17.3 and 1.20.1)
OLD_ORT = [p for p in os.environ.get("CTROPT_OLD_ORT_PYTHON", "").split(os.pathsep) if p]


@pytest.mark.skipif(not OLD_ORT, reason="CTROPT_OLD_ORT_PYTHON (pythons with older onnxruntimes) is not set")
@pytest.mark.parametrize("python", OLD_ORT or [None])
def test_an_older_onnxruntime_runs_the_kernels(tmp_path, python):
    """The library uses the newest C API version both sides know (built with API 21 headers): Triton's and the
    distributions' onnxruntime 1.16-1.20 register it and run the zoo DIEN's GRUScan, GatherRows, ... as the
    framework does (onnxruntime 1.17.3 said `The requested API version [21] is not available` before)."""
    out = tmp_path / "dien.opt.onnx"
    ctropt.graph.save(ctropt.optimize(load(ZOO / "dien_tf.onnx"), speed=False).model, out)
    script = ("import sys, numpy as np, onnxruntime as ort\n"
              "so = ort.SessionOptions(); so.register_custom_ops_library(sys.argv[2])\n"
              "s = ort.InferenceSession(sys.argv[1], so, providers=['CPUExecutionProvider'])\n"
              "f = dict(np.load(sys.argv[3])); y = s.run(None, {i.name: f[i.name] for i in s.get_inputs()})[0]\n"
              "np.save(sys.argv[4], y); print(ort.__version__)\n")
    done = subprocess.run([python, "-c", script, str(out), str(kernels.library_path()), str(ZOO / "dien_tf.npz"),
                           str(tmp_path / "y.npy")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not done.stdout.startswith(ort.__version__.rsplit(".", 1)[0])   # another onnxruntime than this one
    framework = _npz(ZOO / "dien_tf.ref.npz")
    np.testing.assert_allclose(np.load(tmp_path / "y.npy"), next(iter(framework.values())), atol=1e-5, rtol=1e-4)


@pytest.mark.skipif(not shutil.which("aarch64-linux-gnu-gcc"), reason="no aarch64 cross compiler (.ci/run installs one)")
def test_the_library_builds_for_aarch64(tmp_path):
    """The same sources compile for aarch64 (a cross compiler: gcc-aarch64-linux-gnu): its one build and the
    library that loads it, ELF files for AArch64 (e_machine 183). Not run here (no aarch64 onnxruntime)."""
    lib = kernels.build(compiler="aarch64-linux-gnu-gcc", folder=tmp_path, machine="aarch64")
    built = sorted(p.name for p in tmp_path.glob("*.so"))
    assert built == ["libctropt_kernels.base.so", "libctropt_kernels.so"] and lib == tmp_path / "libctropt_kernels.so"
    for name in built:
        header = (tmp_path / name).read_bytes()[:20]
        assert header[:4] == b"\x7fELF" and int.from_bytes(header[18:20], "little") == 183, name


def test_the_model_says_what_it_needs_and_the_readme_fix_works(tmp_path):
    """An optimized model with ctropt's kernels names the library, its version and ops in its metadata; a plain
    onnxruntime session fails as the README's troubleshooting quotes, and registering `ctropt kernels path` fixes
    it (the README's Python snippet, as it is written there)."""
    from typer.testing import CliRunner

    from ctropt.cli import app

    out = tmp_path / "dien.opt.onnx"
    ctropt.graph.save(ctropt.optimize(load(ZOO / "dien_tf.onnx"), speed=False).model, out)
    meta = {p.key: p.value for p in onnx.load(str(out)).metadata_props}
    assert meta["ctropt.kernels.library"] == "libctropt_kernels.so" and "GRUScan" in meta["ctropt.kernels.ops"]
    assert "register_custom_ops_library" in meta["ctropt.kernels.how"]
    with pytest.raises(Exception, match=r"ai\.ctropt\.kernels:\w+\(-1\) is not a registered function/op"):
        ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    path = CliRunner().invoke(app, ["kernels", "path"]).output.strip()
    assert path == str(kernels.library_path())
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    snippet = readme.split("<!-- serving: python -->")[1].split("```python")[1].split("```")[0]
    scope = {"MODEL": str(out), "LIBRARY": path, "FEEDS": _npz(ZOO / "dien_tf.npz")}
    exec(snippet, scope)
    framework = _npz(ZOO / "dien_tf.ref.npz")
    np.testing.assert_allclose(scope["outputs"][0], next(iter(framework.values())), atol=1e-5, rtol=1e-4)
