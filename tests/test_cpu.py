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
