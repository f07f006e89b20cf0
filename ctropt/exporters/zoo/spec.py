"""What a zoo model builder returns, per framework.

A builder is a function of no required arguments that constructs the model with seeded random weights
and returns one of these. The exporter turns it into ONNX and checks it against the framework.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

# sample(batch, seq_len, rng) -> feeds keyed by input name; ids inside their tables' ranges,
# lengths in [0, seq_len] (with an empty and a full history), masks/padding consistent with lengths.
SampleFn = Callable[[int, int, np.random.Generator], dict[str, np.ndarray]]


@dataclasses.dataclass
class Input:
    name: str
    dtype: Any  # numpy dtype
    shape: tuple  # None for a dynamic dim: axis 0 is the batch, axis 1 of histories the sequence length


@dataclasses.dataclass
class TFModel:
    """A TF1-style graph, frozen: variables folded into constants (tf.compat.v1 graph_util)."""

    graph_def: Any  # tf.compat.v1.GraphDef
    inputs: list[Input]  # placeholder names without ':0'
    outputs: list[str]  # tensor names without ':0'
    sample: SampleFn
    has_sequence: bool = False  # True when an input has a dynamic sequence-length axis


@dataclasses.dataclass
class TorchModel:
    """An eval-mode torch.nn.Module whose forward takes the inputs positionally, in this order."""

    module: Any  # torch.nn.Module
    inputs: list[Input]
    outputs: list[str]
    sample: SampleFn
    has_sequence: bool = False
