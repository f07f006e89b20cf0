"""The portable kernel library (the build the dispatcher picks here) against a -march=native build of the same
sources, paired (onnxruntime, 1 thread, batch 256, interleaved), on optimized corpus models and the 10^7-row DIN of
benchmarks/scale.py (made first: `python benchmarks/scale.py make --kind din --rows 10000000 -o /tmp/scale`).

    python benchmarks/portable_kernels.py        # prints time(native) / time(portable) per model
"""
import os
import shutil
import tempfile
from pathlib import Path
import ctropt
from ctropt import kernels
from ctropt.kernels import compiling
from ctropt.graph import load
from ctropt.runtime import Runner, generate_inputs
from ctropt.runtime.bench import compare_speed
folder = Path(tempfile.mkdtemp())
for p in kernels.build_paths() + [compiling.stamp(kernels.library_path())]:
    shutil.copy(p, folder / p.name)
compiling._compile("gcc", ["-O3", "-shared", "-fPIC", "-Wno-psabi", f"-I{kernels.include_dir()}", "-march=native",
                           *map(str, compiling.SOURCES), "-lm"], folder / "libctropt_kernels.native.so")
os.environ["CTROPT_KERNELS_DIR"] = str(folder)
ROOT = Path(__file__).resolve().parents[1]
ZOO, THIRD = ROOT / "ctropt/exporters/zoo/data", ROOT / "tests/data/thirdparty"
models = [ZOO / "dien_tf.onnx", ZOO / "din_tf.onnx", ZOO / "deepfm_tf.onnx", ZOO / "dlrm_tf.onnx", ZOO / "mmoe_tf.onnx",
          THIRD / "fuxictr_BST_dynamo.onnx", THIRD / "deepctr_torch_DIEN_GRU_legacy.onnx"]
models += [p for p in [Path("/tmp/scale/din_r10000000_w16.onnx")] if p.exists()]
for path in models:
    raw = load(path)
    opt = ctropt.optimize(raw, speed=False).model
    feeds = generate_inputs(raw, batch=256, seed=5)
    runners = {}
    portable = kernels.chosen_isa()
    for isa in ("native", portable):
        os.environ["CTROPT_KERNELS_ISA"] = isa
        runners[isa] = Runner(opt, threads=1)
        runners[isa].run(feeds)
    v = compare_speed(runners["native"], runners[portable], feeds, threshold=1.0, seconds=6, min_pairs=30)
    print(f"{path.stem}: portable ({portable} build) vs native: {v.ratio:.3f}× ({v.p10:.3f}–{v.p90:.3f}, {v.pairs} pairs)", flush=True)
