"""Shapes and dtypes of a graph's values as far as known: the annotations first, completed by onnx shape inference
where they fall short (run once, when first needed, on the graph as it is then; the graph is not annotated)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from . import export_graph, iter_proto_graphs
from .edit import const_value


class Shapes:
    """Lazy shapes and dtypes of the values of `graph`.

    Static (default): dims are ints or None (unknown or symbolic), the annotation's known dims completed by
    inference over the graph and its subgraphs. symbolic=True, for values of the main graph: dims as annotated or
    inferred there, symbolic ones by name (equal names are equal sizes); Constant nodes' outputs by their value.
    """

    def __init__(self, graph: gs.Graph, symbolic: bool = False):
        self.graph, self.symbolic = graph, symbolic
        self._inferred: dict | None = None

    def infer(self) -> dict:
        """{value name: (dims, dtype)} by onnx shape inference (best effort: empty if it fails), run once."""
        if self._inferred is None:
            self._inferred = {}
            try:
                model = export_graph(self.graph)
                model = onnx.shape_inference.infer_shapes(model, check_type=False, strict_mode=False, data_prop=True)
            except Exception:  # best effort: annotations only
                return self._inferred
            for g in [model.graph] if self.symbolic else iter_proto_graphs(model.graph):
                for vi in list(g.value_info) + list(g.input) + list(g.output):
                    if vi.type.HasField("tensor_type"):
                        self._inferred[vi.name] = self._read(vi.type.tensor_type)
        return self._inferred

    def _read(self, tt) -> tuple:
        dims = None
        if tt.HasField("shape"):
            dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim]
            if not self.symbolic:
                dims = [d if isinstance(d, int) else None for d in dims]
        return dims, onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type) if tt.elem_type else None

    def shape(self, t: gs.Tensor) -> list | None:
        """The dims of `t`, None if even its rank is unknown."""
        if self.symbolic:
            return self._symbolic_shape(t)
        if isinstance(t, gs.Constant):
            return list(t.values.shape)
        own = None if t.shape is None else [d if isinstance(d, (int, np.integer)) and d >= 0 else None
                                            for d in t.shape]
        if own is not None and all(d is not None for d in own):
            return [int(d) for d in own]
        other = self.infer().get(t.name, (None, None))[0]
        if other is None or (own is not None and len(own) != len(other)):
            return own
        if own is None:
            return other
        return [a if a is not None else b for a, b in zip(own, other)]

    def _symbolic_shape(self, t: gs.Tensor) -> list | None:
        v = const_value(t)
        if v is not None:
            return list(v.shape)
        if t.shape is not None and all(d is not None for d in t.shape):
            return list(t.shape)
        return self.infer().get(t.name, (None, None))[0] or (list(t.shape) if t.shape is not None else None)

    def dtype(self, t: gs.Tensor):
        v = const_value(t) if self.symbolic else (t.values if isinstance(t, gs.Constant) else None)
        if v is not None:
            return v.dtype
        if t.dtype is not None:
            return np.dtype(t.dtype)
        d = self.infer().get(t.name, (None, None))[1]
        return None if d is None else np.dtype(d)

    def rank(self, t: gs.Tensor) -> int | None:
        s = self.shape(t)
        return None if s is None else len(s)
