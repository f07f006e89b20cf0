"""What reading a recurrent Scan/Loop finds (`_Plan`, its per-step inputs `_Step`), and `_Skip`, the refusal with
its reason."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_graphsurgeon as gs

from .cell import CellMatch


class _Skip(Exception):
    """This layer is not fused; the message says why."""


@dataclasses.dataclass
class _Step:
    """A per-step input of the cell: `leaf` (in the body copy) is `source` at step t along `time_axis`."""

    leaf: gs.Tensor
    source: gs.Tensor
    time_axis: int
    width: int
    rank: int  # of the leaf's value: 2 ([B, w]) or 1 ([B])
    dtype: np.dtype
    scanned: bool = False  # a Scan slice (same length as the scan by construction)


@dataclasses.dataclass
class _Plan:
    cell: CellMatch
    x: _Step
    att: _Step | None
    mask: _Step | None
    lens: gs.Tensor | None
    lens_rank: int
    h0: gs.Tensor | None
    padded: str
    stacked: list  # (node output, time axis of it)
    finals: list   # node outputs that are the final state
    passthrough: list  # (node output, outer init)
    trim: list = dataclasses.field(default_factory=list)  # ids of steps whose [B, T'] input is cut to X's T
