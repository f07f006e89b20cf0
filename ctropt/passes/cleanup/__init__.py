"""Cleanup: what the exporters leave (`cleanup.py`: dead and training-only nodes, constants, no-ops, duplicates) and
layout work around elementwise ops (`layout.py`: BatchNormalization as an affine map, transpose pairs, masked row
selections). `tidy` runs the cleanup passes over what another pass built; `slice_bounds` reads a Slice's bounds."""

from . import cleanup, layout  # noqa: F401  (registers the passes)
from .cleanup import slice_bounds, tidy

__all__ = ["slice_bounds", "tidy"]
