import sys
from pathlib import Path

import pytest

import ctropt

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture
def temp_pass():
    """Register passes for one test only."""
    names = []

    def register(name, fn, **kw):
        names.append(name)
        return ctropt.register_pass(name, **kw)(fn)

    yield register
    for n in names:
        ctropt.REGISTRY.pop(n, None)
