"""The wheel carries the kernel library prebuilt (setup.py, ctropt/kernels/compiling.py): installed in a fresh venv
where no compiler can be found, ctropt optimizes the zoo DIEN into ctropt's kernels and runs it as the framework
does. The dependencies come from this environment (PYTHONPATH), ctropt from the wheel."""

import site
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHECK = """
import numpy as np, ctropt
from pathlib import Path
from ctropt import kernels
from ctropt.graph import load
from ctropt.runtime import Runner
assert "site-packages" in ctropt.__file__, ctropt.__file__
assert kernels.available() and kernels.library_path().parent == Path(kernels.__file__).parent
zoo = Path(ctropt.__file__).parent / "exporters" / "zoo" / "data"
opt = ctropt.optimize(load(zoo / "dien_tf.onnx"), speed=False).model
assert kernels.uses_kernels(opt)
got = Runner(opt).run(dict(np.load(zoo / "dien_tf.npz")))
ref = dict(np.load(zoo / "dien_tf.ref.npz"))
print(max(float(np.abs(got[k] - ref[k]).max()) for k in ref))
"""


def test_the_wheel_brings_the_library_and_runs_without_a_compiler(tmp_path):
    wheels = tmp_path / "wheels"
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(wheels)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    (wheel,) = wheels.glob("ctropt-*.whl")
    assert "-py3-none-linux" in wheel.name   # a platform wheel (it holds compiled libraries), any Python 3
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    done = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", str(wheel)], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    isolated = {"PATH": str(env_dir / "bin"), "HOME": str(tmp_path), "CC": str(tmp_path / "no-compiler"),
                "PYTHONPATH": site.getsitepackages()[0]}   # no gcc on PATH, no $CC: nothing could build the library
    done = subprocess.run([str(python), "-c", CHECK], capture_output=True, text=True, env=isolated, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert float(done.stdout.split()[-1]) < 1e-5
