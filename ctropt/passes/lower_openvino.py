"""Lowering for `--target openvino`: rewrite what OpenVINO's ONNX frontend or CPU plugin cannot load or run
into equivalent standard ONNX that it can, keeping onnxruntime's outputs exact.

What OpenVINO 2026.4 trips over in exported CTR models, and the pass that fixes it:

- `squeeze-explicit-axes`: Squeeze without axes has a dynamic output rank when a dim is unknown; the CPU
  plugin refuses dynamic-rank Squeeze. The axes become the dims known to be 1.
- `compress-explicit-axis`: Compress without `axis` is converted by OpenVINO as flatten + axis-less Squeeze
  (dynamic rank again). A 1-D input gets axis=0; any other is flattened by a Reshape first.
- `scan-outer-scope-as-state`: OpenVINO's Scan converter counts values a Scan body reads from the outer
  scope as body parameters and so miscounts the states; they become explicit pass-through states.
- `loop-inline-invariant-constants`: weights threaded through a Loop as pass-through carried values are
  read as the constants they are (OpenVINO fuses an AUGRU cell only with constant weights).
- `body-passthrough-identity`: a Loop/Scan body output that is directly a body input (tf2onnx passes
  weights through Keras while-loops that way) makes OpenVINO's file reader add a body parameter and miscount
  the loop-carried values; an Identity in between fixes it.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from ..graph import annotate_shapes, iter_graphs
from ..patterns.matcher import dtype_of, shape_of, unique_name
from .registry import PassContext, register_pass

TARGETS = ("openvino",)


def _opset(ctx: PassContext) -> int:
    return int(getattr(ctx.graph, "opset", None) or 13)


def _annotate_if(ctx: PassContext, untyped) -> None:
    """Fill in dtypes/shapes (onnx shape inference) only if some value a pass needs has no dtype yet."""
    if any(t.dtype is None for g in iter_graphs(ctx.graph) for n in g.nodes for t in untyped(n)):
        annotate_shapes(ctx.graph)


def _is_one(d) -> bool:
    return isinstance(d, (int, np.integer)) and int(d) == 1


def _constant(root: gs.Graph, name: str, value) -> gs.Constant:
    """A constant with this value: an equal one of the main graph (or made before) is reused, as dedup-initializers would."""
    value = np.asarray(value)
    pool = root.__dict__.get("_ctropt_ov_consts")
    if pool is None:
        pool = {}
        for t in root.tensors().values():
            if isinstance(t, gs.Constant) and t.values.size <= 1024:
                v = np.asarray(t.values)  # not ascontiguousarray: it makes a scalar 1-D
                pool.setdefault((v.dtype.str, v.shape, v.tobytes()), t)
        root.__dict__["_ctropt_ov_consts"] = pool
    key = (value.dtype.str, value.shape, value.tobytes())
    if key not in pool:
        pool[key] = gs.Constant(unique_name(root, name), value)
    return pool[key]


def _has_input(node: gs.Node, i: int) -> bool:
    return len(node.inputs) > i and bool(node.inputs[i].name)


# ----------------------------------------------------------------------------------------- Squeeze / Compress


@register_pass("squeeze-explicit-axes", group="lower", targets=TARGETS, order=10, speed=False)
def squeeze_explicit_axes(ctx: PassContext) -> None:
    """Squeeze without axes on a value of known rank names its axes (the dims known to be 1), so its rank is static."""
    new_style = _opset(ctx) >= 13
    for g in iter_graphs(ctx.graph):
        for node in list(g.nodes):
            if node.op != "Squeeze" or _has_input(node, 1) or "axes" in node.attrs:
                continue
            shape = shape_of(node.inputs[0])
            if shape is None:
                continue
            axes = [i for i, d in enumerate(shape) if _is_one(d)]
            if not axes:
                continue
            ctx.matches += 1
            if new_style:
                c = _constant(ctx.graph, f"{node.name}/axes", np.array(axes, dtype=np.int64))
                while len(node.inputs) > 1:
                    node.inputs.pop()
                node.inputs.append(c)
            else:
                node.attrs["axes"] = axes
            ctx.rewrites += 1


@register_pass("compress-explicit-axis", group="lower", targets=TARGETS, order=11, speed=False)
def compress_explicit_axis(ctx: PassContext) -> None:
    """Compress without axis gets axis=0 on its input flattened to 1-D, avoiding OpenVINO's dynamic-rank Squeeze."""
    for g in iter_graphs(ctx.graph):
        for node in list(g.nodes):
            if node.op != "Compress" or "axis" in node.attrs:
                continue
            ctx.matches += 1
            data = node.inputs[0]
            shape = shape_of(data)
            if shape is None or len(shape) != 1:
                flat = gs.Variable(unique_name(ctx.graph, f"{node.name}/flat"), dtype=data.dtype,
                                   shape=None if shape is None else [None])
                minus_one = _constant(ctx.graph, f"{node.name}/minus_one", np.array([-1], dtype=np.int64))
                g.nodes.append(gs.Node("Reshape", unique_name(ctx.graph, f"{node.name}/Reshape"), inputs=[data, minus_one],
                                       outputs=[flat]))
                node.inputs[0] = flat
            node.attrs["axis"] = 0
            ctx.rewrites += 1


# ----------------------------------------------------------------------------------------- Loop / Scan bodies


def _subgraphs(node: gs.Node):
    for value in node.attrs.values():
        for sub in (value if isinstance(value, list) else [value]):
            if isinstance(sub, gs.Graph):
                yield sub


def _graph_tree(graph: gs.Graph):
    yield graph
    for node in graph.nodes:
        for sub in _subgraphs(node):
            yield from _graph_tree(sub)


def _outer_values(body: gs.Graph) -> list[gs.Variable]:
    """Non-constant values the body (or a graph nested in it) reads from scopes around it, in first-use order."""
    local = {id(t) for g in _graph_tree(body) for t in g.inputs}
    local |= {id(t) for g in _graph_tree(body) for n in g.nodes for t in n.outputs}
    found, seen = [], set()
    for g in _graph_tree(body):
        for n in g.nodes:
            for t in n.inputs:
                if isinstance(t, gs.Variable) and t.name and id(t) not in local and id(t) not in seen:
                    seen.add(id(t))
                    found.append(t)
    for t in body.outputs:  # a body output may be an outer value itself
        if isinstance(t, gs.Variable) and id(t) not in local and id(t) not in seen:
            seen.add(id(t))
            found.append(t)
    return found


def _thread_through(graph: gs.Graph, node: gs.Node, body: gs.Graph, outer: gs.Variable, in_pos: int,
                    body_in_pos: int, body_out_pos: int, out_pos: int) -> None:
    """Make `outer` an explicit pass-through state of `node`: node input, body input, body output (Identity), node output."""
    inner = gs.Variable(unique_name(graph, f"{outer.name}/in_body"), dtype=outer.dtype, shape=outer.shape)
    for g in _graph_tree(body):
        for n in g.nodes:
            for i, t in enumerate(n.inputs):
                if t is outer:
                    n.inputs[i] = inner
    for i, t in enumerate(body.outputs):
        if t is outer:
            body.outputs[i] = inner
    passed = gs.Variable(unique_name(graph, f"{outer.name}/passed"), dtype=outer.dtype, shape=outer.shape)
    body.nodes.append(gs.Node("Identity", unique_name(graph, f"{outer.name}/pass"), inputs=[inner], outputs=[passed]))
    body.inputs.insert(body_in_pos, inner)
    body.outputs.insert(body_out_pos, passed)
    node.inputs.insert(in_pos, outer)
    node.outputs.insert(out_pos, gs.Variable(unique_name(graph, f"{node.name}/{outer.name}/final"), dtype=outer.dtype,
                                             shape=outer.shape))


def _explicit_outer_values(ctx: PassContext, op: str = "Scan") -> None:
    _annotate_if(ctx, lambda n: _outer_values(n.attrs["body"]) if n.op == op and "body" in n.attrs else [])
    # Deepest graphs first: making an inner body's outer values explicit can add outer reads to the body around it.
    for g in reversed(list(iter_graphs(ctx.graph))):
        for node in list(g.nodes):
            if node.op != op or "body" not in node.attrs:
                continue
            body = node.attrs["body"]
            outer = [t for t in _outer_values(body) if t.dtype is not None]
            if not outer:
                continue
            ctx.matches += 1
            for t in outer:
                states = len(node.inputs) - int(node.attrs["num_scan_inputs"])
                _thread_through(ctx.graph, node, body, t, states, states, states, states)
            ctx.rewrites += 1


@register_pass("scan-outer-scope-as-state", group="lower", targets=TARGETS, order=20, speed=False)
def scan_outer_scope_as_state(ctx: PassContext) -> None:
    """Values a Scan body reads from the outer scope become explicit pass-through states (OpenVINO miscounts them)."""
    _explicit_outer_values(ctx, "Scan")


@register_pass("loop-inline-invariant-constants", group="lower", targets=TARGETS, order=21, speed=False)
def loop_inline_invariant_constants(ctx: PassContext) -> None:
    """A Loop-carried value the body passes through unchanged and that starts as a constant is read as that constant."""
    for g in iter_graphs(ctx.graph):
        graph_outputs = {id(t) for t in g.outputs}
        for node in g.nodes:
            if node.op != "Loop" or "body" not in node.attrs:
                continue
            body = node.attrs["body"]
            carried = len(node.inputs) - 2
            slots = [k for k in range(carried)
                     if isinstance(node.inputs[2 + k], gs.Constant) and body.outputs[1 + k] is body.inputs[2 + k]
                     and sum(o is body.inputs[2 + k] for o in body.outputs) == 1
                     and (k >= len(node.outputs) or id(node.outputs[k]) not in graph_outputs)]
            if not slots:
                continue
            ctx.matches += 1
            for k in reversed(slots):
                value, inner = node.inputs[2 + k], body.inputs[2 + k]
                for sub in _graph_tree(body):
                    for n in sub.nodes:
                        for i, t in enumerate(n.inputs):
                            if t is inner:
                                n.inputs[i] = value
                if k < len(node.outputs):
                    final = node.outputs[k]
                    for user in list(final.outputs):
                        for i, t in enumerate(user.inputs):
                            if t is final:
                                user.inputs[i] = value
                    del node.outputs[k]
                del body.outputs[1 + k]
                del body.inputs[2 + k]
                del node.inputs[2 + k]
            ctx.rewrites += 1


@register_pass("body-passthrough-identity", group="lower", targets=TARGETS, order=22, speed=False)
def body_passthrough_identity(ctx: PassContext) -> None:
    """A Loop/Scan body output that is a body input itself is routed through an Identity (OpenVINO's file reader needs it)."""
    for g in iter_graphs(ctx.graph):
        for node in g.nodes:
            if node.op not in ("Loop", "Scan") or "body" not in node.attrs:
                continue
            body = node.attrs["body"]
            inputs = {id(t) for t in body.inputs}
            changed = False
            for i, t in enumerate(list(body.outputs)):
                if id(t) in inputs:
                    copy = gs.Variable(unique_name(ctx.graph, f"{t.name}/out"), dtype=dtype_of(t), shape=shape_of(t))
                    body.nodes.append(gs.Node("Identity", unique_name(ctx.graph, f"{t.name}/pass"), inputs=[t],
                                              outputs=[copy]))
                    body.outputs[i] = copy
                    changed = True
            if changed:
                ctx.matches += 1
                ctx.rewrites += 1


# ----------------------------------------------------------------------------------------- GRU sequence_lens


def _direction(node: gs.Node) -> str:
    d = node.attrs.get("direction", "forward")
    return d.decode() if isinstance(d, bytes) else str(d)


@register_pass("gru-sequence-lens-as-mask", group="lower", targets=TARGETS, order=30, speed=False)
def gru_sequence_lens_as_mask(ctx: PassContext) -> None:
    """Forward GRU with sequence_lens (OpenVINO CPU ignores them): run unmasked, zero Y past each length, take Y_h at length-1."""
    for g in iter_graphs(ctx.graph):
        for node in list(g.nodes):
            if (node.op != "GRU" or not _has_input(node, 4) or _direction(node) != "forward"
                    or node.attrs.get("layout", 0) != 0):
                continue
            ctx.matches += 1
            _lower_gru_sequence_lens(ctx.graph, g, node)
            ctx.rewrites += 1


def _lower_gru_sequence_lens(root: gs.Graph, g: gs.Graph, gru: gs.Node) -> None:
    base = gru.name or "GRU"
    hidden = int(gru.attrs["hidden_size"])
    x, lens = gru.inputs[0], gru.inputs[4]
    dtype = dtype_of(x) or np.float32
    graph_outputs = {id(t) for t in g.outputs}

    def used(i):
        t = gru.outputs[i] if len(gru.outputs) > i and gru.outputs[i].name else None
        return t if t is not None and (t.outputs or id(t) in graph_outputs) else None

    y_out, yh_out = used(0), used(1)
    made = g.__dict__.setdefault("_ctropt_ov_made", {})  # shared by GRUs reading the same x / lengths

    def var(name, dt=None, shape=None):
        return gs.Variable(unique_name(root, f"{base}/{name}"), dtype=dt, shape=shape)

    def const(name, value):
        return _constant(root, f"{base}/{name}", np.asarray(value))

    def add(op, inputs, outputs, **attrs):
        key = (op, tuple(id(t) for t in inputs), tuple(sorted(attrs.items())))
        if key in made and not any(outputs[0] is o for o in (y_out, yh_out)):
            return made[key]
        g.nodes.append(gs.Node(op, unique_name(root, f"{base}/{op}"), attrs=attrs, inputs=inputs, outputs=outputs))
        made[key] = outputs[0]
        return outputs[0]

    y_full = var("y_unmasked", dtype, None)
    gru.inputs[4] = gs.Variable.empty()
    gru.outputs.clear()
    gru.outputs.append(y_full)
    zero = const("zero", np.zeros((), dtype=dtype))
    lens64 = lens if dtype_of(lens) is not None and np.dtype(dtype_of(lens)) == np.int64 else \
        add("Cast", [lens], [var("lens", np.int64, None)], to=onnx.TensorProto.INT64)
    if y_out is not None:
        # mask[t, n] = t < lens[n]
        steps = (shape_of(x) or [None])[0]
        if isinstance(steps, (int, np.integer)):
            t_col = const("t_col", np.arange(int(steps), dtype=np.int64)[:, None])
        else:
            steps = add("Gather", [add("Shape", [x], [var("x_shape", np.int64, [3])]),
                                   const("time_axis", np.array(0, np.int64))], [var("steps", np.int64, [])], axis=0)
            t = add("Range", [const("t0", np.array(0, np.int64)), steps, const("t1", np.array(1, np.int64))],
                    [var("t", np.int64, None)])
            t_col = add("Unsqueeze", [t, const("t_axes", np.array([1], np.int64))], [var("t_col", np.int64, None)])
        mask = add("Less", [t_col, lens64], [var("mask", np.bool_, None)])
        mask4 = add("Unsqueeze", [mask, const("mask_axes", np.array([1, 3], np.int64))], [var("mask4", np.bool_, None)])
        add("Where", [mask4, y_full, zero], [y_out])
    if yh_out is not None:
        last = add("Max", [add("Sub", [lens64, const("one", np.array(1, np.int64))], [var("lens_m1", np.int64, None)]),
                           const("zero_i", np.array(0, np.int64))], [var("last", np.int64, None)])
        idx = add("Unsqueeze", [last, const("last_axes", np.array([0, 1, 3], np.int64))], [var("last4", np.int64, None)])
        idx = add("Expand", [idx, const("last_shape", np.array([1, 1, 1, hidden], np.int64))],
                  [var("last_idx", np.int64, None)])
        picked = add("GatherElements", [y_full, idx], [var("y_last", dtype, None)], axis=0)
        picked = add("Squeeze", [picked, const("squeeze_axes", np.array([0], np.int64))], [var("h_last", dtype, None)])
        valid = add("Greater", [lens64, const("zero_len", np.array(0, np.int64))], [var("nonempty", np.bool_, None)])
        valid = add("Unsqueeze", [valid, const("valid_axes", np.array([0, 2], np.int64))],
                    [var("nonempty3", np.bool_, None)])
        add("Where", [valid, picked, zero], [yh_out])


# ----------------------------------------------------------------------------------------- Split + Cast(bool)


@register_pass("split-cast-bool-as-compare", group="lower", targets=TARGETS, order=40, speed=False)
def split_cast_bool_as_compare(ctx: PassContext) -> None:
    """Cast-to-bool of a Split output becomes Not(Equal(x, 0)): OpenVINO CPU otherwise gives every output the first part."""
    _annotate_if(ctx, lambda n: n.outputs if n.op == "Split" else [])
    for g in iter_graphs(ctx.graph):
        replaced = set()
        for node in list(g.nodes):
            if node.op != "Cast" or node.attrs.get("to") != onnx.TensorProto.BOOL:
                continue
            x = node.inputs[0]
            producer = x.inputs[0] if len(x.inputs) == 1 else None
            dtype = dtype_of(x)
            if producer is None or producer.op != "Split" or len(producer.outputs) < 2 or dtype is None:
                continue
            if np.dtype(dtype) == np.bool_:
                continue
            ctx.matches += 1
            base = node.name or "Cast"
            zero = _constant(ctx.graph, f"{base}/zero", np.zeros((), dtype=dtype))
            eq = gs.Variable(unique_name(ctx.graph, f"{base}/is_zero"), dtype=np.bool_, shape=shape_of(x))
            out = node.outputs[0]
            node.outputs.clear()
            g.nodes.append(gs.Node("Equal", unique_name(ctx.graph, f"{base}/Equal"), inputs=[x, zero], outputs=[eq]))
            g.nodes.append(gs.Node("Not", unique_name(ctx.graph, f"{base}/Not"), inputs=[eq], outputs=[out]))
            node.inputs.clear()
            replaced.add(id(node))
            ctx.rewrites += 1
        if replaced:
            g.nodes = [n for n in g.nodes if id(n) not in replaced]
