"""Recurrent layers (GRU, AUGRU, AGRU, AIGRU): `fuse-rnn` reads each layer, in any exporter's dialect, into one
ai.ctropt sequence op; `lower-rnn-ort` and `lower-rnn-openvino` turn those into what each runtime runs fastest.

- `fuse.py`: the fuse-rnn pass, dispatching to the dialect readers;
- `loops.py` (Scan/Loop bodies; its phases in `loop_*.py`), `gru_op.py` (ONNX GRU ops) and `unrolled.py` (cells
  unrolled over time; its phases in `unrolled_*.py`): where a layer is;
- `cell.py`: what its cell computes, read by meaning (gates probed as affine maps, checked numerically);
- `lower_ort.py`, `lower_openvino.py`: the lowerings.
"""

from . import fuse, lower_openvino, lower_ort  # noqa: F401  (registers the passes)
