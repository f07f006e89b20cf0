"""Evaluating part of a graph being rewritten: the nodes between some leaf values and some outputs, copied out
and run with onnxruntime on numpy values (the passes' numeric checks and probes)."""

from __future__ import annotations

import os
import tempfile

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from .. import kernels
from . import strings
from ..graph import PROTOBUF_LIMIT, export_graph, initializer_bytes, save, weights
from ..graph.edit import const_value


class Subgraph:
    """The nodes that compute `outputs` from `leaves` (graphsurgeon values), run on a copy (originals untouched).

    nodes: given, or collected from the outputs back to the leaves; `unresolved`: the values the collected nodes
    read that are neither a leaf, a constant nor made by one of them (values from outside; they make a run fail).
    dtypes: the outputs' dtypes (default: their own, else float32). functions: the graphsurgeon functions the
    nodes call (ai.ctropt fused ops). One session per set of outputs, its leaf dtypes those of the first values.
    """

    def __init__(self, outputs: list[gs.Tensor], leaves: list[gs.Tensor], opset: int, *, nodes: list | None = None,
                 dtypes: list | None = None, functions: list | None = None):
        self.outputs, self.leaves, self.opset, self.functions = list(outputs), list(leaves), opset, functions
        if nodes is None:
            self.nodes, self.unresolved = _collect(self.outputs, self.leaves)
        else:
            self.nodes, self.unresolved = list(nodes), []
        self._dtypes = {id(t): np.dtype(d) for t, d in zip(self.outputs, dtypes or [])}
        self._sessions: dict[tuple, object] = {}

    def uses(self, op: str) -> list[gs.Node]:
        return [n for n in self.nodes if n.op == op]

    def prepare(self, leaf_dtypes: list, outputs: list[gs.Tensor] | None = None):
        """The onnxruntime session computing `outputs` (default: the subgraph's) from leaves of `leaf_dtypes`,
        built on first use; raises ValueError for a value from outside, or what onnxruntime raises."""
        outputs = self.outputs if outputs is None else outputs
        key = tuple(id(t) for t in outputs)
        if key not in self._sessions:
            out_types = [(t, self._dtypes.get(id(t), t.dtype if t.dtype is not None else np.float32)) for t in outputs]
            self._sessions[key] = ort_session(_model(self.nodes, list(zip(self.leaves, leaf_dtypes)), out_types,
                                                     self.opset, self.functions))
        return self._sessions[key]

    def run(self, values: list, outputs: list[gs.Tensor] | None = None) -> list[np.ndarray]:
        """`outputs` (default: the subgraph's) for the leaves' `values`, in order."""
        values = [np.asarray(v) for v in values]
        session = self.prepare([v.dtype for v in values], outputs)
        return session.run(None, {f"leaf{i}": v for i, v in enumerate(values)})


def _collect(outputs: list, leaves: list) -> tuple[list[gs.Node], list[gs.Tensor]]:
    """The nodes from `leaves` to `outputs` (outputs first), and the values they read that are neither leaves,
    constants nor made by a node."""
    leaf_ids = {id(t) for t in leaves}
    nodes, node_ids, seen, unresolved = [], set(), set(), []
    stack = list(outputs)
    while stack:
        t = stack.pop()
        if id(t) in seen or id(t) in leaf_ids or isinstance(t, gs.Constant) or not t.name:
            continue
        seen.add(id(t))
        if not t.inputs:
            unresolved.append(t)
            continue
        n = t.inputs[0]
        if id(n) in node_ids:
            continue
        node_ids.add(id(n))
        nodes.append(n)
        stack.extend(n.inputs)
    return nodes, unresolved


def _model(nodes: list, leaves: list, outputs: list, opset: int, functions: list | None) -> onnx.ModelProto:
    """A model over a copy of `nodes`: the (tensor, dtype) `leaves` become the inputs "leaf0", "leaf1", ... (their
    producers are not run), the (tensor, dtype) `outputs` "out0", ...; any other value the nodes read must be a
    constant (an initializer or a Constant node's output, in any scope) and is inlined, else ValueError."""
    swap = {id(t): gs.Variable(f"leaf{i}", np.dtype(d), None) for i, (t, d) in enumerate(leaves)}
    inputs = list(swap.values())
    for n in nodes:
        for t in n.outputs:
            swap.setdefault(id(t), gs.Variable(f"v{len(swap)}", t.dtype, None))

    def value(t):
        if not t.name or id(t) in swap:
            return swap.get(id(t), t)
        v = const_value(t)
        if v is None:
            raise ValueError(f"{t.name} is neither a leaf, a constant nor made by the nodes")
        swap[id(t)] = gs.Constant(f"c{len(swap)}", np.asarray(v))
        return swap[id(t)]

    copies = [gs.Node(n.op, n.name, dict(n.attrs), [value(t) for t in n.inputs], [swap[id(t)] for t in n.outputs],
                      domain=n.domain) for n in nodes]
    outs = []
    for i, (t, d) in enumerate(outputs):  # through an Identity: an output may be a leaf itself
        outs.append(gs.Variable(f"out{i}", np.dtype(d), None))
        copies.append(gs.Node("Identity", f"out{i}", inputs=[value(t)], outputs=[outs[-1]]))
    g = gs.Graph(nodes=copies, inputs=inputs, outputs=outs, opset=opset, functions=functions)
    g.toposort(mode="nodes")
    model = export_graph(g)
    for domain in {n.domain for n in copies if n.domain} - {o.domain for o in model.opset_import}:
        model.opset_import.append(onnx.helper.make_opsetid(domain, 1))
    model.ir_version = max(8, onnx.helper.find_min_ir_version_for(list(model.opset_import), ignore_unknown=True))
    return model


def ort_session(model: onnx.ModelProto, optimize: bool = True):
    """A quiet one-thread onnxruntime CPU session over `model`, ctropt's kernels registered where it uses them;
    optimize=False keeps every node as it is (all values computed as written). Over 1 GiB of constants (a
    table), it loads from a temporary file with the tensors beside it, as `Runner` does."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 4
    so.intra_op_num_threads = 1
    if not optimize:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    kernels.register_if_used(so, model)
    strings.register_if_used(so, model)
    keep = weights.attach(so, model)  # a weight store's tensors, mapped (graph/weights.py)
    if keep or initializer_bytes(model) <= PROTOBUF_LIMIT // 2:
        session = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        session._ctropt_keep = keep  # the mapped values must outlive the session
        return session
    with tempfile.TemporaryDirectory(prefix="ctropt-run-") as tmp:  # the session holds the tensors once made
        path = save(model, os.path.join(tmp, "model.onnx"), external_data=True)
        return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
