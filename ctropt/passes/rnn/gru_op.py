"""The ONNX GRU op → one ai.ctropt `GRUSequence`.

:func:`fuse_gru_ops` turns each ONNX ``GRU`` node (forward, one layer, default activations, no clip) into a
``GRUSequence``: weights in the canonical layout (W [I, 3H] = W_onnx[0].T, R = R_onnx[0].T, B = B_onnx[0]),
``sequence_lens`` carried as is, with lengths_checked (the GRU op rejects lengths outside [0, T]; the op's "zero"
padded output is the GRU op's own meaning; with an initial_h, onnxruntime's GRU gives rows of length 0 the state 0,
which a Where keeps). The time-major glue exporters write around the op (Transpose [B,T,I]→[T,B,I] before, Squeeze
of the direction axis and Transpose back after, dynamo's Transpose/Reshape/Transpose) is absorbed; where it cannot
be, a Transpose/Unsqueeze makes the value the old consumers expect.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from ...graph.edit import Builder, axes_of, const_value, is_all_zeros, unique_name
from ...graph.shapes import Shapes
from ...ops.rnn import SequenceAttrs, add_sequence_node
from ...runtime.subgraph import Subgraph
from ...graph import topological_order
from .values import _present, _take_over


def fuse_gru_ops(graph: gs.Graph, opset: int) -> list[str]:
    """ONNX GRU nodes (forward, one layer, default activations, no clip) → GRUSequence. Returns what was fused."""
    done: list[str] = []
    shapes = Shapes(graph, symbolic=True)
    ordered = topological_order(list(graph.nodes))
    for node in [n for n in ordered if n.op == "GRU" and n.domain in (None, "", "ai.onnx")]:
        what = _fuse_gru_op(graph, node, opset, shapes)
        if what:
            done.append(what)
    if done:
        graph.cleanup(remove_unused_graph_inputs=False)
        graph.toposort(mode="nodes")  # "full" recurses forever on graphs with If/Loop plus functions (gs 0.6.1)
    return done


def _gru_op_weights(node: gs.Node):
    a = node.attrs
    if a.get("direction", "forward") not in ("forward", b"forward"):
        return None
    acts = a.get("activations")
    if acts is not None and [str(x).lower() for x in acts] != ["sigmoid", "tanh"]:
        return None
    if a.get("clip") is not None or a.get("activation_alpha") or a.get("activation_beta"):
        return None
    if len(node.inputs) < 3:
        return None
    W, R = const_value(node.inputs[1]), const_value(node.inputs[2])
    if W is None or R is None or W.ndim != 3 or R.ndim != 3 or W.shape[0] != 1 or R.shape[0] != 1:
        return None
    H = int(R.shape[2])
    if int(a.get("hidden_size", H)) != H or W.shape[1] != 3 * H or R.shape[1] != 3 * H:
        return None
    B = np.zeros(6 * H, np.float32)
    if len(node.inputs) > 3 and _present(node.inputs[3]):
        b = const_value(node.inputs[3])
        if b is None or b.shape != (1, 6 * H):
            return None
        B = b[0]
    if W.dtype != np.float32 or R.dtype != np.float32:
        return None
    return H, np.ascontiguousarray(W[0].T), np.ascontiguousarray(R[0].T), np.asarray(B, np.float32)


def _fuse_gru_op(graph: gs.Graph, node: gs.Node, opset: int, shapes: Shapes) -> str | None:
    weights = _gru_op_weights(node)
    if weights is None:
        return None
    H, W, R, B = weights
    layout = int(node.attrs.get("layout", 0))
    lbr = int(node.attrs.get("linear_before_reset", 0))
    ins = list(node.inputs) + [gs.Variable.empty()] * (6 - len(node.inputs))
    X, lens, h0 = ins[0], ins[4], ins[5]
    outs = list(node.outputs) + [gs.Variable.empty()] * (2 - len(node.outputs))
    graph_outputs = {id(t) for t in graph.outputs}
    used = [_present(t) and (bool(t.outputs) or id(t) in graph_outputs) for t in outs]
    if not any(used):
        return None
    b = Builder(graph, node.name or "gru", opset=opset)
    Xb, hb = _batch_major_inputs(b, X, h0, layout)

    # lengths_checked: the GRU op raises on lengths outside [0, T] ("Invalid value/s in sequence_lens"), so does the op
    attrs = SequenceAttrs("GRU", H, lbr, 0, "zero", lengths_checked=int(_present(lens)))
    inputs = {"X": Xb, "W": b.const("W", W), "R": b.const("R", R), "B": b.const("B", B)}
    if _present(lens):
        inputs["sequence_lens"] = lens
    if hb is not None:
        inputs["initial_h"] = hb
    Y, Y_h = outs[0], outs[1]
    outputs = {}
    y_labels = ["T", "D", "B", "H"] if layout == 0 else ["B", "T", "D", "H"]
    yh_labels = ["D", "B", "H"] if layout == 0 else ["B", "D", "H"]
    plans = []
    if used[0]:
        tgt, labels = _follow_layout(graph, Y, y_labels, shapes, opset)
        plans.append(("Y", tgt, labels, ["B", "T", "H"]))
    if used[1]:
        tgt, labels = _follow_layout(graph, Y_h, yh_labels, shapes, opset)
        plans.append(("Y_h", tgt, labels, ["B", "H"]))
    glue = []
    for key, tgt, labels, canon in plans:
        if labels == canon:
            outputs[key] = _take_over(tgt)
        else:
            fresh = gs.Variable(unique_name(graph, f"{node.name or 'gru'}/{key}"), dtype=np.float32)
            outputs[key] = fresh
            glue.append((fresh, tgt, labels, canon))
    name = unique_name(graph, f"{node.name or 'gru'}/GRUSequence")
    # the GRU node goes away now: its outputs may be taken over below
    graph.nodes = [n for n in graph.nodes if n is not node]
    node.inputs.clear()
    node.outputs.clear()
    final_h = None
    if "Y_h" in outputs and _present(lens) and hb is not None:
        # onnxruntime's GRU gives rows of length 0 the state 0, not initial_h: keep that
        final_h, outputs["Y_h"] = outputs["Y_h"], gs.Variable(unique_name(graph, f"{name}/Y_h"), dtype=np.float32)
    add_sequence_node(graph, attrs, inputs, outputs, name)
    if final_h is not None:
        some = b.op("Greater", [lens, b.const("zero_len", np.zeros(1, shapes.dtype(lens) or np.int32))],
                    dtype=np.bool_)
        some = b.axes_op("Unsqueeze", some, [1], dtype=np.bool_)
        b.op("Where", [some, outputs["Y_h"], b.const("zero_state", np.zeros(1, np.float32))], out=final_h)
    for fresh, tgt, labels, canon in glue:
        _make_layout(b, fresh, canon, tgt, labels)
    how = "absorbed" if not glue else "kept as Transpose/Unsqueeze for other readers"
    lens_note = ", sequence_lens" if "sequence_lens" in inputs else ""
    h0_note = ", initial_h" if hb is not None else ""
    return (f"GRU '{node.name}' → GRUSequence (H={H}, linear_before_reset={lbr}{lens_note}{h0_note}; "
            f"time-major layout {how})")


def _batch_major_inputs(b: Builder, X: gs.Tensor, h0: gs.Tensor, layout: int):
    """(X [B, T, I], initial_h [B, H] or None where absent or zero): the exporter's time-major glue read back, or
    a Transpose / Squeeze."""
    if layout == 1:
        Xb = X
    elif len(X.inputs) == 1 and X.inputs[0].op == "Transpose" and list(X.inputs[0].attrs.get("perm", [])) == [1, 0, 2]:
        Xb = X.inputs[0].inputs[0]
    else:
        Xb = b.op("Transpose", [X], {"perm": [1, 0, 2]}, dtype=np.float32)
    hb = None
    if _present(h0) and not is_all_zeros(h0):
        axis = 0 if layout == 0 else 1
        p = h0.inputs[0] if len(h0.inputs) == 1 else None
        if p is not None and p.op == "Unsqueeze" and axes_of(p) in ([axis], [axis - 3]):
            hb = p.inputs[0]
        else:
            hb = b.axes_op("Squeeze", h0, [axis], dtype=np.float32)
    return Xb, hb


def _follow_layout(graph: gs.Graph, t: gs.Tensor, labels: list[str], shapes: Shapes, opset: int):
    """Walk from a GRU output through the ops that only drop the direction axis or permute axes (each value read
    by that op alone, or by Shape nodes that feed only that op's shape): the furthest value and its axis labels."""
    graph_outputs = {id(x) for x in graph.outputs}
    canon = [x for x in ("B", "T", "H") if x in labels]
    while labels != canon and id(t) not in graph_outputs:
        users = list(t.outputs)
        main = [u for u in users if u.op in ("Squeeze", "Transpose", "Reshape")]
        if len(main) != 1:
            break
        u = main[0]
        others = [x for x in users if x is not u]
        if others and not (u.op == "Reshape" and _only_feed(others, u, 1)):
            break
        if u.inputs[0] is not t or len(u.outputs) != 1:
            break
        new = None
        if u.op == "Squeeze":
            axes = axes_of(u)
            if axes is not None and len(axes) == 1 and "D" in labels and axes[0] % len(labels) == labels.index("D"):
                new = [x for x in labels if x != "D"]
        elif u.op == "Transpose":
            perm = u.attrs.get("perm")
            if perm is not None and sorted(perm) == list(range(len(labels))):
                new = [labels[p] for p in perm]
        elif u.op == "Reshape" and "D" in labels and _drops_axis(t, u, labels.index("D"), shapes, opset):
            new = [x for x in labels if x != "D"]
        if new is None:
            break
        t, labels = u.outputs[0], new
    return t, labels


def _drops_axis(t: gs.Tensor, reshape: gs.Node, d: int, shapes: Shapes, opset: int) -> bool:
    """True if `reshape` only removes the size-1 axis `d` of `t`: by the annotated shapes, or else by running
    the shape computation (from Shape(t) and constants) on a value of `t` with made-up sizes for unknown axes."""
    s_in, s_out = shapes.shape(t), shapes.shape(reshape.outputs[0])
    if s_in is None or len(s_in) <= d or s_in[d] not in (1, None):
        return False
    dropped = s_in[:d] + s_in[d + 1:]
    if s_out is not None and len(s_out) == len(dropped) and all(
            x is not None and x == y for x, y in zip(s_out, dropped)):
        return s_in[d] == 1
    primes = iter((7, 11, 13, 17, 19))
    dims = [1 if i == d else (int(x) if isinstance(x, (int, np.integer)) and x > 0 else next(primes))
            for i, x in enumerate(s_in)]
    target = reshape.inputs[1]
    v = const_value(target)
    if v is None:
        nodes, seen, stack = [], set(), [target]
        while stack:
            x = stack.pop()
            if x is t or id(x) in seen or const_value(x) is not None:
                continue
            seen.add(id(x))
            if len(x.inputs) != 1 or len(seen) > 64:
                return False
            n = x.inputs[0]
            if n.op not in ("Shape", "Slice", "Gather", "Concat", "Mul", "Reshape", "Unsqueeze", "Squeeze", "Cast"):
                return False
            nodes.append(n)
            stack.extend(n.inputs)
        try:
            (v,) = Subgraph([target], [t], opset, nodes=nodes).run([np.zeros(dims, np.float32)])
        except Exception:
            return False
    v = [int(x) for x in np.asarray(v).ravel()]
    if not int(reshape.attrs.get("allowzero", 0)):
        v = [dims[i] if x == 0 and i < len(dims) else x for i, x in enumerate(v)]
    if v.count(-1) == 1:
        known = int(np.prod([x for x in v if x != -1]))
        v[v.index(-1)] = int(np.prod(dims)) // known if known else -1
    return v == dims[:d] + dims[d + 1:]


def _only_feed(nodes: list[gs.Node], target: gs.Node, index: int) -> bool:
    """True if everything `nodes` compute flows only into input `index` of `target`."""
    seen, stack = set(), list(nodes)
    while stack:
        n = stack.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        if len(seen) > 64 or n.op not in ("Shape", "Slice", "Gather", "Concat", "Mul", "Reshape", "Unsqueeze",
                                          "Squeeze", "Cast", "Constant"):
            return False
        for o in n.outputs:
            if not o.outputs:
                return False
            for c in o.outputs:
                if c is target:
                    if target.inputs[index] is not o:
                        return False
                else:
                    stack.append(c)
    return True


def _make_layout(b: Builder, src: gs.Tensor, src_labels: list[str], out: gs.Tensor, labels: list[str]) -> None:
    """Write `out` (axes `labels`, maybe with a size-1 direction axis D) from `src` (axes `src_labels`)."""
    core = [x for x in labels if x != "D"]
    perm = [src_labels.index(x) for x in core]
    _take_over(out)
    steps = []
    if perm != list(range(len(perm))):
        steps.append(("Transpose", perm))
    if "D" in labels:
        steps.append(("Unsqueeze", [labels.index("D")]))
    if not steps:
        b.op("Identity", [src], out=out)
        return
    v = src
    for i, (op, arg) in enumerate(steps):
        last = i == len(steps) - 1
        if op == "Transpose":
            v = b.op("Transpose", [v], {"perm": arg}, out=out if last else None, dtype=np.float32)
        else:
            v = b.axes_op("Unsqueeze", v, arg, out=out if last else None, dtype=np.float32)
