"""Editing graphsurgeon graphs: constants' values, shapes and dtypes as far as known, new nodes and constants
with unique names, and moving readers from one value to another. Used by the pattern layer and every pass."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from . import iter_graphs


def axes_of(node: gs.Node) -> list[int] | None:
    """The axes of a Squeeze/Unsqueeze/ReduceSum: a constant input from opset 13, the attribute before; None when
    not constant (or absent)."""
    if len(node.inputs) > 1 and node.inputs[1].name:
        value = const_value(node.inputs[1])
    else:
        value = node.attrs.get("axes")
    return None if value is None else [int(a) for a in np.ravel(value)]


def stacked_part(gather: gs.Node) -> gs.Tensor | None:
    """x_c for ``Gather(Concat(Unsqueeze(x_0, k), …, axis=k), c, axis=k)`` with c a constant (torch.stack, then
    ``x[:, c]``): every part is one wide on the axis, so index c is part c. Axes compare after normalizing when the
    Concat's rank is known, as written otherwise."""
    cat = gather.inputs[0].inputs[0] if gather.inputs[0].inputs else None
    index = const_value(gather.inputs[1])
    if cat is None or cat.op != "Concat" or index is None or index.size != 1:
        return None
    rank = len(shape_of(cat.outputs[0]) or [])

    def norm(a: int) -> int:
        return a % rank if rank else a

    axis, c = norm(cat.attrs.get("axis", 0)), int(index.ravel()[0])
    if norm(gather.attrs.get("axis", 0)) != axis or not -len(cat.inputs) <= c < len(cat.inputs):
        return None
    for part in cat.inputs:
        made = part.inputs[0] if part.inputs else None
        axes = axes_of(made) if made is not None and made.op == "Unsqueeze" else None
        if axes is None or [norm(a) for a in axes] != [axis]:
            return None
    return cat.inputs[c].inputs[0].inputs[0]


def const_value(t: gs.Tensor) -> np.ndarray | None:
    """The value of a constant tensor: an initializer or the output of a Constant node, in any scope."""
    if isinstance(t, gs.Constant):
        return t.values
    if len(t.inputs) == 1 and t.inputs[0].op == "Constant":
        attrs = t.inputs[0].attrs
        if "value" in attrs:
            v = attrs["value"]
            return v.values if isinstance(v, gs.Constant) else np.asarray(v)
        for key, dtype in (("value_float", np.float32), ("value_int", np.int64),
                           ("value_floats", np.float32), ("value_ints", np.int64)):
            if key in attrs:
                return np.asarray(attrs[key], dtype=dtype)
    return None


def is_all_zeros(t: gs.Tensor, depth: int = 0) -> bool:
    """True if `t` is all zeros by construction (a constant, ConstantOfShape(0), or Expand/Reshape/... of one)."""
    if depth > 12:
        return False
    v = const_value(t)
    if v is not None:
        return v.size == 0 or (np.issubdtype(v.dtype, np.number) and not np.any(v))
    if len(t.inputs) != 1:
        return False
    n = t.inputs[0]
    if n.op == "ConstantOfShape":
        value = n.attrs.get("value")
        if value is None:
            return True
        arr = value.values if isinstance(value, gs.Constant) else np.asarray(value)
        return not np.any(arr)
    if n.op in ("Expand", "Tile", "Reshape", "Identity", "Cast", "Squeeze", "Unsqueeze", "Transpose", "Flatten",
                "Slice", "Neg", "Abs", "Relu") and n.inputs:
        return is_all_zeros(n.inputs[0], depth + 1)
    return False


def shape_of(t: gs.Tensor) -> list | None:
    """The (possibly symbolic) shape of a value or constant, None when unknown."""
    shape = t.values.shape if isinstance(t, gs.Constant) else t.shape
    return None if shape is None else list(shape)


def rank_of(t: gs.Tensor) -> int | None:
    shape = shape_of(t)
    return None if shape is None else len(shape)


def dtype_of(t: gs.Tensor):
    return t.values.dtype if isinstance(t, gs.Constant) else t.dtype


# ----------------------------------------------------------------------------------------- state


def add_constant(graph: gs.Graph, name: str, value: np.ndarray) -> gs.Constant:
    """A new constant with a name unique in `graph`."""
    return gs.Constant(unique_name(graph, name), np.ascontiguousarray(value))


def add_node(graph: gs.Graph, op: str, inputs: list, attrs: dict | None = None, *, outputs: int = 1,
             name: str | None = None, domain: str | None = None, dtype=None, shape=None) -> list[gs.Variable]:
    """Append a node to `graph` (names made unique) and return its new output tensors, always as a list."""
    made = Builder(graph).op(op, inputs, attrs, outputs=outputs, name=name, domain=domain, dtype=dtype, shape=shape)
    return made if outputs > 1 else [made]


_DEFAULT = object()


class Builder:
    """New nodes (appended to `graph`, or to `nodes`) and constants named `prefix/...`, unique in `root` (default
    `graph`); outputs of `dtype` unless told. In a gs.Function constants are Constant nodes. `share`: small
    constants shared by value within `graph`; `reuse`: a node that a Builder of the same `reuse` made before in
    `graph` (same op, inputs and attributes) is reused instead of made again; `fold(op, inputs, attrs)`: the
    outputs' values if known (no node); `opset`: the one `axes_op` writes for (default: the root graph's)."""

    def __init__(self, graph: gs.Graph, prefix: str = "", dtype=None, *, root: gs.Graph | None = None,
                 nodes: list | None = None, share: str | None = None, reuse: str | None = None, fold=None,
                 opset: int | None = None):
        self.graph, self.prefix, self.dtype, self.share, self.reuse, self.fold = graph, prefix, dtype, share, reuse, fold
        self.root = graph if root is None else root
        self.opset = opset if opset is not None else int(getattr(self.root, "opset", None) or 13)
        self._nodes = nodes

    @property
    def nodes(self) -> list:
        """Where new nodes go: the list given, else the graph's node list (read at each use: passes replace it)."""
        return self.graph.nodes if self._nodes is None else self._nodes

    @nodes.setter
    def nodes(self, nodes: list) -> None:
        self._nodes = nodes

    def name(self, what: str) -> str:
        """`prefix/what`, unique in the root graph."""
        return unique_name(self.root, f"{self.prefix}/{what}" if self.prefix else what)

    def op(self, op: str, inputs: list, attrs: dict | None = None, *, outputs: int = 1, name: str | None = None,
           dtype=_DEFAULT, shape=None, out=None, domain: str | None = None):
        """A new node `op` (named `name` or `op`); its output, a list when it has several, or `out` (tensors it
        then writes)."""
        if self.fold is not None and out is None:
            values = self.fold(op, inputs, attrs or {})
            if values is not None:
                folded = [gs.Constant(self.name("folded"), np.ascontiguousarray(v)) for v in values]
                return folded if outputs > 1 else folded[0]
        made = key = None
        if self.reuse is not None and out is None:
            made = self.graph.__dict__.setdefault("_ctropt_shared_nodes", {})  # per graph, like shared constants
            key = (self.reuse, op, domain, outputs, tuple(id(t) for t in inputs), repr(sorted((attrs or {}).items())))
            if key in made:
                return made[key]
        node = self.name(name or op)
        if out is None:
            dtype = self.dtype if dtype is _DEFAULT else dtype
            outs = [gs.Variable(unique_name(self.root, f"{node}:{i}"), dtype=dtype, shape=shape)
                    for i in range(outputs)]
        else:
            outs = list(out) if isinstance(out, (list, tuple)) else [out]
        self.nodes.append(gs.Node(op, node, attrs=attrs or {}, inputs=list(inputs), outputs=outs, domain=domain))
        result = outs if len(outs) > 1 else outs[0]
        if made is not None:
            made[key] = result
        return result

    def axes_op(self, op: str, x: gs.Tensor, axes: list[int], attrs: dict | None = None, **kw):
        """Squeeze/Unsqueeze/ReduceSum of `x` over `axes`: a constant input from opset 13, the attribute before."""
        if self.opset >= 13:
            return self.op(op, [x, self.const("axes", np.array(axes, np.int64))], attrs, **kw)
        return self.op(op, [x], {**(attrs or {}), "axes": list(axes)}, **kw)

    def const(self, name: str, value, dtype=None) -> gs.Tensor:
        """A constant named `prefix/name` (0-d values stay 0-d)."""
        value = np.array(value, dtype=dtype, order="C")
        if isinstance(self.graph, gs.Function):
            out = gs.Variable(self.name(name), dtype=value.dtype, shape=value.shape)
            self.nodes.append(gs.Node("Constant", self.name("Constant"),
                                      attrs={"value": gs.Constant(self.name("value"), value)}, outputs=[out]))
            return out
        if self.share is None or value.size > 1024:
            return gs.Constant(self.name(name), value)
        pool = self.graph.__dict__.setdefault("_ctropt_shared_consts", {})  # per graph: a body keeps its own
        key = (self.share, value.dtype.str, value.shape, value.tobytes())
        if key not in pool:
            pool[key] = gs.Constant(unique_name(self.root, f"{self.share}/{name}"), value)
        return pool[key]


def unique_name(graph: gs.Graph, name: str) -> str:
    """A name no tensor or node of `graph` or its subgraphs uses yet (collected once per graph, then kept up to date)."""
    taken = graph.__dict__.get("_ctropt_names")  # not getattr: graphsurgeon's __getattr__ logs misses as errors
    if taken is None:
        taken = {n for g in iter_graphs(graph) for n in g.tensors()} | {n.name for g in iter_graphs(graph) for n in g.nodes}
        graph.__dict__["_ctropt_names"] = taken
    candidate, i = name, 0
    while candidate in taken:
        i += 1
        candidate = f"{name}_{i}"
    taken.add(candidate)
    return candidate


def replace_outputs(graph: gs.Graph, root: gs.Node, new: list) -> None:
    """Make `new[i]` take the place of `root.outputs[i]`; graph outputs keep their names."""
    graph_outputs = {id(t) for t in graph.outputs}
    for old, repl in zip(list(root.outputs), new):
        if repl is None or repl is old:
            continue
        if id(old) not in graph_outputs:
            redirect_consumers(old, repl)
        elif renameable(graph, repl):
            # The node that makes `repl` writes the graph output instead; `repl`'s readers follow.
            producer = repl.inputs[0]
            redirect_consumers(repl, old)
            old.inputs.clear()
            producer.outputs[producer.outputs.index(repl)] = old
        else:
            old.inputs.clear()
            graph.nodes.append(gs.Node("Identity", unique_name(graph, f"{old.name}/keep"), inputs=[repl], outputs=[old]))
    root.outputs.clear()


def read_once(t: gs.Tensor, graph: gs.Graph) -> bool:
    """`t` has one reader, a node (not also a graph output): a rewrite of that reader may drop it."""
    return len(t.outputs) == 1 and not any(o is t for o in graph.outputs)


def renameable(graph: gs.Graph, t: gs.Tensor) -> bool:
    """True if `t` is made by a node of `graph` and is not itself a graph output (so it may take another name)."""
    if len(t.inputs) != 1 or any(o is t for o in graph.outputs):
        return False
    producer = t.inputs[0]
    return any(n is producer for n in graph.nodes)


def redirect_consumers(old: gs.Tensor, new: gs.Tensor) -> None:
    """Every node that reads `old` (in any scope) reads `new` instead."""
    for user in list(old.outputs):
        for i, t in enumerate(user.inputs):
            if t is old:
                user.inputs[i] = new
