"""What the benchmark scripts share: the repository on sys.path (so they run from a checkout) and the model files."""

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
ZOO = ROOT / "ctropt/exporters/zoo/data"
THIRD = ROOT / "tests/data/thirdparty"
