"""Small helpers on graph values that the recurrent readers share: constant ints, a value that is present (named),
and an output taken over by the node that will write it."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from ...graph.edit import const_value


def _ints(t: gs.Tensor | None) -> list[int] | None:
    if t is None:
        return None
    v = const_value(t)
    if v is None or v.dtype.kind not in "iu":
        return None
    return [int(x) for x in np.asarray(v).ravel()]


def _present(t: gs.Tensor | None) -> bool:
    return t is not None and bool(t.name)


def _take_over(t: gs.Tensor) -> gs.Tensor:
    """Detach `t` from its producer so a new node can write it (its name and readers stay)."""
    t.inputs.clear()
    return t
