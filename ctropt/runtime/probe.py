"""Run a graph being rewritten on generated inputs and keep every value of its main graph, at two sizes, so a
pass can tell by measurement which axis of a value is the batch and which the history (sequence) axis."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from ..graph import runnable_model
from .inputs import generate_inputs
from .subgraph import ort_session

# Two (batch, history length) settings with different values, so a dim equal to the batch in both runs is it.
PROBE_SIZES = ((13, 10), (6, 7))


def all_values(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every graph input and node output of the main graph, by name (onnxruntime, 1 thread)."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    names = [i.name for i in model.graph.input] + [o for n in model.graph.node for o in n.output if o]
    del model.graph.output[:]
    model.graph.output.extend(onnx.helper.make_empty_tensor_value_info(n) for n in dict.fromkeys(names))
    sess = ort_session(model, optimize=False)  # every value must stay
    out_names = [o.name for o in sess.get_outputs()]
    return dict(zip(out_names, sess.run(None, {k: v for k, v in feeds.items()})))


@dataclasses.dataclass
class Probe:
    """Values of the main graph at two sizes; `runs[i]` maps a value name to its array."""

    runs: list[dict[str, np.ndarray]]
    feeds: list[dict[str, np.ndarray]]

    def shapes(self, t: gs.Tensor) -> list[tuple] | None:
        if isinstance(t, gs.Constant):
            return [t.values.shape] * len(self.runs)
        if not all(t.name in r for r in self.runs):
            return None
        return [r[t.name].shape for r in self.runs]

    def shape_like(self, t: gs.Tensor) -> bool:
        """A small integer vector or scalar: a shape or an index computed from one."""
        v = self.value(t)
        return v is not None and v.ndim <= 1 and v.size <= 8 and np.issubdtype(v.dtype, np.integer)

    def value(self, t: gs.Tensor, run: int = 0) -> np.ndarray | None:
        if isinstance(t, gs.Constant):
            return t.values
        return self.runs[run].get(t.name)


def probe_graph(graph: gs.Graph) -> Probe:
    """Run `graph` (not modified) at PROBE_SIZES; raises what onnxruntime raises when it cannot."""
    model = runnable_model(graph)
    runs, feeds = [], []
    for batch, seq_len in PROBE_SIZES:
        f = generate_inputs(model, batch=batch, seq_len=seq_len)
        feeds.append(f)
        runs.append(all_values(model, f))
    return Probe(runs, feeds)


def try_probe(graph: gs.Graph) -> tuple[Probe | None, str]:
    """`probe_graph`, or None and why a pass must leave the graph as it is."""
    try:
        return probe_graph(graph), ""
    except Exception as e:  # whatever onnxruntime raises for a graph it cannot run
        return None, f"left as is: the graph does not run on generated inputs ({str(e).splitlines()[0][:160]})"
