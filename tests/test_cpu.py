"""The CPU's precision paths (runtime/cpu.py): read from /proc/cpuinfo's text, printed by optimize, in the metadata."""

from ctropt.runtime.cpu import METADATA_KEY, cpu_info, parse

XEON_AMX = "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Processor\nflags\t\t: fpu avx2 avx512f avx512_vnni " \
           "avx512_bf16 amx_bf16 amx_tile amx_int8\n"
EPYC_512 = "model name\t: AMD EPYC 9R14\nflags\t\t: avx2 avx512f avx512_vnni avx512_bf16\n"
EPYC_AVX2 = "model name\t: AMD EPYC 7R13 Processor\nflags\t\t: sse4_2 avx2 fma\n"
ARM = "processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\nCPU implementer\t: 0x41\n"


def test_each_of_the_project_cpus_says_what_it_does_fast():
    assert parse(XEON_AMX).summary() == "Intel(R) Xeon(R) Processor: AVX-512; INT8 AMX-INT8; BF16 AMX-BF16"
    assert parse(EPYC_512).summary() == "AMD EPYC 9R14: AVX-512; INT8 AVX-512 VNNI; BF16 AVX512_BF16"
    assert parse(EPYC_AVX2).summary() == \
        "AMD EPYC 7R13 Processor: AVX2; INT8 without VNNI/AMX (no fast path); BF16 none"
    assert parse(ARM).int8 is None and parse(ARM).vectors == "baseline" and parse(ARM).name


def test_optimize_prints_the_cpu_and_stores_it(tmp_path):
    import onnx
    from typer.testing import CliRunner

    from ctropt.cli import app
    from helpers import F, init, make_model, node, vi
    import numpy as np

    model = make_model([node("MatMul", ["x", "w"], ["m"]), node("Relu", ["m"], ["y"])], [vi("x", F, ["B", 4])],
                       [vi("y", F, ["B", 3])], [init("w", np.ones((4, 3), np.float32))])
    onnx.save(model, tmp_path / "m.onnx")
    r = CliRunner().invoke(app, ["optimize", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "o.onnx"),
                                 "--no-speed-check"])
    assert r.exit_code == 0, r.output
    assert f"cpu: {cpu_info().summary()}" in " ".join(r.output.split())
    meta = {p.key: p.value for p in onnx.load(str(tmp_path / "o.onnx")).metadata_props}
    assert meta[METADATA_KEY] == cpu_info().summary()


def _tiny(tmp_path):
    import numpy as np
    import onnx

    from helpers import F, init, make_model, node, vi

    model = make_model([node("MatMul", ["x", "w"], ["m"]), node("Relu", ["m"], ["y"])], [vi("x", F, ["B", 64])],
                       [vi("y", F, ["B", 64])], [init("w", np.random.default_rng(0).normal(size=(64, 64))
                                                     .astype(np.float32))])
    onnx.save(model, tmp_path / "m.onnx")
    np.savez(tmp_path / "calib.npz", x=np.random.default_rng(1).normal(size=(64, 64)).astype(np.float32))
    return tmp_path / "m.onnx"


def test_precision_auto_says_why_it_stays_fp32_and_what_it_tried(tmp_path, monkeypatch):
    import onnx
    from typer.testing import CliRunner

    from ctropt.cli import app
    from ctropt.runtime import cpu

    path = _tiny(tmp_path)
    run = lambda *a: CliRunner().invoke(app, ["optimize", str(path), "-o", str(tmp_path / "o.onnx"),  # noqa: E731
                                              "--no-speed-check", "--precision", *a])
    text = lambda r: " ".join(r.output.split())  # noqa: E731
    monkeypatch.setattr(cpu, "cpu_info", lambda: cpu.parse(XEON_AMX))
    r = run("auto")
    assert r.exit_code == 0 and "precision: f32 (auto: the CPU has AMX-INT8, but no calibration data" in text(r)
    meta = {p.key: p.value for p in onnx.load(str(tmp_path / "o.onnx")).metadata_props}
    assert meta["ctropt.precision"].startswith("f32 (auto: the CPU has AMX-INT8, but no calibration data")
    r = run("auto", "--calib", str(tmp_path / "calib.npz"))   # INT8 tried: the gate's verdict is what is stored
    assert r.exit_code == 0, r.output
    meta = {p.key: p.value for p in onnx.load(str(tmp_path / "o.onnx")).metadata_props}
    assert "auto: the CPU has AMX-INT8, calibration calib.npz" in meta["ctropt.precision"]
    monkeypatch.setattr(cpu, "cpu_info", lambda: cpu.parse(EPYC_AVX2))
    r = run("auto", "--calib", str(tmp_path / "calib.npz"))
    assert "precision: f32 (auto: this CPU has no VNNI or AMX" in text(r)
    r = run("bf16")
    assert r.exit_code == 2 and "not built yet" in r.output
    r = run("int4")
    assert r.exit_code == 2 and "--precision must be one of" in r.output
