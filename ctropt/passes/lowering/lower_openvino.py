"""Lowering for `--target openvino`: rewrite what OpenVINO's ONNX frontend or CPU plugin cannot load or run
into equivalent standard ONNX that it can, keeping onnxruntime's outputs exact.

What OpenVINO 2026.4 trips over in exported CTR models, and the pass that fixes it:

- `squeeze-explicit-axes`: Squeeze without axes has a dynamic output rank when a dim is unknown; the CPU
  plugin refuses dynamic-rank Squeeze. The axes become the dims known to be 1.
- `compress-explicit-axis`: Compress without `axis` is converted by OpenVINO as flatten + axis-less Squeeze
  (dynamic rank again). A 1-D input gets axis=0; any other is flattened by a Reshape first. The condition is
  flattened too: onnxruntime reads any condition as flat (paddle2onnx's masked_select passes a [B, F, F] mask:
  PaddleRec DLRM), but OpenVINO gathers by NonZero of the condition as it is, so a rank-3 mask gives [3, n]
  selected values, and the Reshape after it 3x the rows (the CPU plugin's Concat then refuses the shapes).
- `body-inputs-own-names`: paddle2onnx names a while loop's body inputs after the outer values that feed them
  (the Loop's cond and carried inputs). OpenVINO's ONNX frontend takes a body parameter whose name is a tensor
  of the enclosing graph for an invariant input read from there, so it finds fewer loop-carried parameters than
  carried inputs and refuses the Loop ("canonical inputs size (7), does not match ... (9)": PaddleRec DIEN with
  dynamic history length). A renamed body input is the same value: onnxruntime's outputs do not change.
- `scan-outer-scope-as-state`: OpenVINO's Scan converter counts values a Scan body reads from the outer
  scope as body parameters and so miscounts the states; they become explicit pass-through states.
- `loop-inline-invariant-constants`: weights threaded through a Loop as pass-through carried values are
  read as the constants they are (OpenVINO fuses an AUGRU cell only with constant weights).
- `body-passthrough-identity`: a Loop/Scan body output that is directly a body input (tf2onnx passes
  weights through Keras while-loops that way) makes OpenVINO's file reader add a body parameter and miscount
  the loop-carried values; an Identity in between fixes it.
- `concat-into-if-branches`: the CPU plugin gives garbage (values up to 1e37, different from run to run) for an
  If output that a Concat reads (tf.cond pad-or-truncate of a history before the target item is appended: DeepRec
  BST). With the Concat moved into both branches, the If's output is the Concat's and the values are exact.
- `topk-ties-by-index`: ONNX's TopK puts equal values in index order; OpenVINO's CPU plugin orders them at random,
  differently from run to run. tf2onnx sorts segment ids with a full-length TopK (SegmentMax, the sparse lookups of
  TF feature columns: DeepRec BST), so rows are scattered to the wrong places. The keys become distinct, rank·n +
  index (rank from a sorted Unique), whose TopK has no ties; exact on onnxruntime (int64), and in OpenVINO, which
  runs int64 as int32, while n² < 2³¹ (n, the entries sorted, up to 46340).

Each pass is pattern rules: the node to change (for the Loop/Scan/If passes the one node whose body is edited in
place, for `gru-sequence-lens-as-mask` the GRU), a condition that says why a node needs no change (shown by
`ctropt inspect --explain`; it declines a node once it is done) and the edit.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from ...graph import annotate_shapes, iter_graphs
from ...patterns.matcher import Any, P, Match, Rewrite, Var
from ...graph.edit import Builder, dtype_of, rank_of, redirect_consumers, shape_of, unique_name
from ..registry import PassContext, register_pass

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


def _ones_known(m: Match) -> bool | str:
    if "axes" in m.root.attrs:
        return "its axes are named"
    shape = shape_of(m["x"])
    if shape is None:
        return "the input's rank is unknown"
    return True if any(_is_one(d) for d in shape) else "no dim of the input is known to be 1"


def _squeeze_named_axes(m: Match) -> list:
    out = m.root.outputs[0]
    axes = [i for i, d in enumerate(shape_of(m["x"])) if _is_one(d)]
    if int(getattr(m.graph, "opset", None) or 13) >= 13:
        return m.op("Squeeze", [m["x"], _constant(m.graph, f"{m.root.name}/axes", np.array(axes, np.int64))],
                    name=m.root.name, dtype=out.dtype, shape=out.shape)
    return m.op("Squeeze", [m["x"]], {"axes": axes}, name=m.root.name, dtype=out.dtype, shape=out.shape)


SQUEEZE_RULES = (Rewrite("squeeze-without-axes", P.Squeeze(Var("x")), _squeeze_named_axes, _ones_known),)


@register_pass("squeeze-explicit-axes", group="lower", targets=TARGETS, speed=False, rules=SQUEEZE_RULES)
def squeeze_explicit_axes(ctx: PassContext) -> None:
    """Squeeze without axes on a value of known rank names its axes (the dims known to be 1), so its rank is static."""
    ctx.apply(*SQUEEZE_RULES)


def _flattened(m: Match, t: gs.Tensor, name: str) -> gs.Variable:
    """`t` reshaped to 1-D, next to the match."""
    base = m.root.name or m.root.op
    minus_one = _constant(m.graph, f"{base}/minus_one", np.array([-1], dtype=np.int64))
    (flat,) = m.op("Reshape", [t, minus_one], name=f"{base}/{name}", dtype=dtype_of(t), shape=[None])
    return flat


def _compress_not_plain(m: Match) -> bool | str:
    """True unless the Compress has an axis and a condition of rank 1 (then OpenVINO reads it as onnxruntime does)."""
    if "axis" in m.root.attrs and rank_of(m["condition"]) == 1:
        return "has an axis and a 1-D condition already"
    return True


def _compress_on_flat(m: Match) -> list:
    """Compress(x, condition) as onnxruntime reads it: without an axis on x flattened, the condition always flat."""
    data, condition, axis = m["x"], m["condition"], m.root.attrs.get("axis")
    if axis is None and rank_of(data) != 1:
        data = _flattened(m, data, "flat")
    if rank_of(condition) != 1:
        condition = _flattened(m, condition, "flat_condition")
    out = m.root.outputs[0]
    (y,) = m.op("Compress", [data, condition], {"axis": 0 if axis is None else axis}, dtype=out.dtype, shape=out.shape)
    return [y]


COMPRESS_RULES = (
    Rewrite("compress-on-flat", P.Compress(Var("x"), Var("condition")), _compress_on_flat, _compress_not_plain),
)


@register_pass("compress-explicit-axis", group="lower", targets=TARGETS, speed=False, rules=COMPRESS_RULES)
def compress_explicit_axis(ctx: PassContext) -> None:
    """Compress gets an axis (0, on its input flattened to 1-D when it had none) and a 1-D condition."""
    _annotate_if(ctx, lambda n: n.inputs[:2] if n.op == "Compress" else [])
    ctx.apply(*COMPRESS_RULES)


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


def _scopes(top: gs.Graph, g: gs.Graph) -> list[gs.Graph]:
    """The graphs from `top` down to `g`, each holding the node whose body is the next; [] if g is not in top."""
    if g is top:
        return [top]
    for node in top.nodes:
        for sub in _subgraphs(node):
            chain = _scopes(sub, g)
            if chain:
                return [top] + chain
    return []


def _shadowing_inputs(m: Match) -> list[gs.Tensor]:
    """The Loop/Scan's body inputs named like a value of the graph around it or of a scope around that one."""
    visible = {name for scope in _scopes(m.top, m.graph) for name in scope.tensors()}
    return [t for sub in _subgraphs(m.root) for t in sub.inputs if t.name in visible]


def _has_shadowing_inputs(m: Match) -> bool | str:
    return True if _shadowing_inputs(m) else "no body input is named like a value around the body"


def _rename_body_inputs(m: Match) -> list:
    for t in _shadowing_inputs(m):
        t.name = unique_name(m.top, f"{t.name}/body")
    return list(m.root.outputs)  # edited in place


BODY_NAME_RULES = (
    Rewrite("body-input-named-like-outer-value", P["Loop|Scan"](...), _rename_body_inputs, _has_shadowing_inputs),
)


@register_pass("body-inputs-own-names", group="lower", targets=TARGETS, speed=False, rules=BODY_NAME_RULES)
def body_inputs_own_names(ctx: PassContext) -> None:
    """A Loop/Scan body input named like a value around the body gets a name of its own (OpenVINO reads the outer one).

    paddle2onnx's while loops name their body inputs after the values that feed them."""
    ctx.apply(*BODY_NAME_RULES)


def _typed_outer_values(node: gs.Node) -> list[gs.Variable]:
    """The values of scopes around it that the body of `node` reads and whose dtype is known."""
    return [t for t in _outer_values(node.attrs["body"]) if t.dtype is not None]


def _reads_outer_values(m: Match) -> bool | str:
    """The Scan's body reads typed values from outside, and no Scan nested in it still does (the deepest go first:
    making an inner body's outer values explicit can add outer reads to the body around it)."""
    if "body" not in m.root.attrs:
        return "no body"
    if not _typed_outer_values(m.root):
        return "its body reads no typed value of the scopes around it"
    inner = [n for g in _graph_tree(m.root.attrs["body"]) for n in g.nodes
             if n.op == "Scan" and "body" in n.attrs and _typed_outer_values(n)]
    return f"the Scan '{inner[0].name}' in its body goes first" if inner else True


def _outer_values_as_states(m: Match) -> list:
    node, body = m.root, m.root.attrs["body"]
    for t in _typed_outer_values(node):
        states = len(node.inputs) - int(node.attrs["num_scan_inputs"])
        _thread_through(m.top, node, body, t, states, states, states, states)
    return list(node.outputs)  # edited in place: the states added


SCAN_STATE_RULES = (
    Rewrite("scan-outer-value-as-state", P.Scan(...), _outer_values_as_states, _reads_outer_values),
)


@register_pass("scan-outer-scope-as-state", group="lower", targets=TARGETS, speed=False, rules=SCAN_STATE_RULES)
def scan_outer_scope_as_state(ctx: PassContext) -> None:
    """Values a Scan body reads from the outer scope become explicit pass-through states (OpenVINO miscounts them)."""
    _annotate_if(ctx, lambda n: _outer_values(n.attrs["body"]) if n.op == "Scan" and "body" in n.attrs else [])
    ctx.apply(*SCAN_STATE_RULES)


def _constant_slots(m: Match) -> list[int]:
    """The Loop's carried values that start as a constant, that its body passes through unchanged (as one body
    output), and whose final value is not a graph output."""
    node, body = m.root, m.root.attrs["body"]
    graph_outputs = {id(t) for t in m.graph.outputs}
    return [k for k in range(len(node.inputs) - 2)
            if isinstance(node.inputs[2 + k], gs.Constant) and body.outputs[1 + k] is body.inputs[2 + k]
            and sum(o is body.inputs[2 + k] for o in body.outputs) == 1
            and (k >= len(node.outputs) or id(node.outputs[k]) not in graph_outputs)]


def _has_constant_slots(m: Match) -> bool | str:
    if "body" not in m.root.attrs:
        return "no body"
    return True if _constant_slots(m) else "no carried value is a constant the body passes through"


def _inline_constant_slots(m: Match) -> list:
    node, body = m.root, m.root.attrs["body"]
    for k in reversed(_constant_slots(m)):
        value, inner = node.inputs[2 + k], body.inputs[2 + k]
        for sub in _graph_tree(body):
            for n in sub.nodes:
                for i, t in enumerate(n.inputs):
                    if t is inner:
                        n.inputs[i] = value
        if k < len(node.outputs):
            redirect_consumers(node.outputs[k], value)
            del node.outputs[k]
        del body.outputs[1 + k]
        del body.inputs[2 + k]
        del node.inputs[2 + k]
    return list(node.outputs)  # edited in place: the slots gone


LOOP_CONSTANT_RULES = (
    Rewrite("loop-constant-passed-through", P.Loop(...), _inline_constant_slots, _has_constant_slots),
)


@register_pass("loop-inline-invariant-constants", group="lower", targets=TARGETS, speed=False,
               rules=LOOP_CONSTANT_RULES)
def loop_inline_invariant_constants(ctx: PassContext) -> None:
    """A Loop-carried value the body passes through unchanged and that starts as a constant is read as that constant."""
    ctx.apply(*LOOP_CONSTANT_RULES)


def _has_passthrough(m: Match) -> bool | str:
    body = m.root.attrs.get("body")
    if body is None:
        return "no body"
    inputs = {id(t) for t in body.inputs}
    return True if any(id(t) in inputs for t in body.outputs) else "no body output is a body input itself"


def _identity_for_passthrough(m: Match) -> list:
    body = m.root.attrs["body"]
    inputs = {id(t) for t in body.inputs}
    for i, t in enumerate(list(body.outputs)):
        if id(t) in inputs:
            copy = gs.Variable(unique_name(m.top, f"{t.name}/out"), dtype=dtype_of(t), shape=shape_of(t))
            Builder(body, root=m.top).op("Identity", [t], name=f"{t.name}/pass", out=[copy])
            body.outputs[i] = copy
    return list(m.root.outputs)  # edited in place


PASSTHROUGH_RULES = (
    Rewrite("body-output-is-body-input", P["Loop|Scan"](...), _identity_for_passthrough, _has_passthrough),
)


@register_pass("body-passthrough-identity", group="lower", targets=TARGETS, speed=False, rules=PASSTHROUGH_RULES)
def body_passthrough_identity(ctx: PassContext) -> None:
    """A Loop/Scan body output that is a body input itself is routed through an Identity (OpenVINO's file reader needs it)."""
    ctx.apply(*PASSTHROUGH_RULES)


def _read_by_one_concat(m: Match) -> bool | str:
    out = m.root.outputs[0]
    if any(o is out for o in m.graph.outputs):
        return "its output is a graph output"
    if len(out.outputs) != 1 or out.outputs[0].op != "Concat":
        return "its output is not read by one Concat only"
    ranks = {rank_of(t) for t in out.outputs[0].inputs if t is not out}
    ranks |= {rank_of(m.root.attrs[b].outputs[0]) for b in ("then_branch", "else_branch")}
    if len(ranks - {None}) > 1:  # RecBole DIEN: squeeze(1) exported as If(dim == 1, Squeeze, Identity)
        return "a branch gives another rank than the Concat's other inputs (a Concat there would not load)"
    return True


def _concat_in_branches(m: Match) -> list:
    node, out = m.root, m.root.outputs[0]
    cat = out.outputs[0]
    for branch in ("then_branch", "else_branch"):
        body = node.attrs[branch]
        result = gs.Variable(unique_name(m.top, f"{cat.name}/{branch}"), dtype=dtype_of(cat.outputs[0]))
        inputs = [body.outputs[0] if t is out else t for t in cat.inputs]
        Builder(body, root=m.top).op("Concat", inputs, dict(cat.attrs), name=f"{cat.name}/{branch}", out=[result])
        body.outputs[0] = result
    m.graph.nodes.remove(node)
    m.graph.nodes[m.graph.nodes.index(cat)] = node  # after what the Concat's other inputs need
    node.outputs = list(cat.outputs)
    cat.inputs.clear()
    cat.outputs.clear()
    return list(node.outputs)  # the If now gives the Concat's result


IF_CONCAT_RULES = (Rewrite("if-read-by-concat", P.If(Any(), _outputs=1), _concat_in_branches, _read_by_one_concat),)


@register_pass("concat-into-if-branches", group="lower", targets=TARGETS, speed=False, rules=IF_CONCAT_RULES)
def concat_into_if_branches(ctx: PassContext) -> None:
    """An If output read only by a Concat: the Concat runs in both branches and the If gives its result."""
    ctx.apply(*IF_CONCAT_RULES)


# ----------------------------------------------------------------------------------------- GRU sequence_lens


def _direction(node: gs.Node) -> str:
    d = node.attrs.get("direction", "forward")
    return d.decode() if isinstance(d, bytes) else str(d)


def _forward_with_lengths(m: Match) -> bool | str:
    if not _has_input(m.root, 4):
        return "no sequence_lens"
    if _direction(m.root) != "forward":
        return f"direction {_direction(m.root)}"
    return "batch-major layout" if m.root.attrs.get("layout", 0) != 0 else True


def _lengths_after_gru(m: Match) -> list:
    _lower_gru_sequence_lens(m.top, m.graph, m.root)
    return list(m.root.outputs)  # edited in place: unmasked, its old outputs computed after it


GRU_LENGTH_RULES = (Rewrite("gru-with-sequence-lens", P.GRU(...), _lengths_after_gru, _forward_with_lengths),)


@register_pass("gru-sequence-lens-as-mask", group="lower", targets=TARGETS, speed=False, rules=GRU_LENGTH_RULES)
def gru_sequence_lens_as_mask(ctx: PassContext) -> None:
    """Forward GRU with sequence_lens (OpenVINO CPU ignores them): run unmasked, zero Y past each length, take Y_h at length-1."""
    ctx.apply(*GRU_LENGTH_RULES)


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
    b = Builder(g, base, root=root, reuse="gru-lengths")  # what GRUs reading the same x / lengths compute, once
    y_full = gs.Variable(unique_name(root, f"{base}/y_unmasked"), dtype=dtype)
    gru.inputs[4] = gs.Variable.empty()
    gru.outputs.clear()
    gru.outputs.append(y_full)
    zero = _constant(root, f"{base}/zero", np.zeros((), dtype=dtype))
    lens64 = lens if dtype_of(lens) is not None and np.dtype(dtype_of(lens)) == np.int64 else \
        b.op("Cast", [lens], {"to": onnx.TensorProto.INT64}, dtype=np.int64)
    if y_out is not None:
        # mask[t, n] = t < lens[n]
        steps = (shape_of(x) or [None])[0]
        if isinstance(steps, (int, np.integer)):
            t_col = _constant(root, f"{base}/t_col", np.arange(int(steps), dtype=np.int64)[:, None])
        else:
            steps = b.op("Gather", [b.op("Shape", [x], dtype=np.int64, shape=[3]),
                                    _constant(root, f"{base}/time_axis", np.array(0, np.int64))],
                         {"axis": 0}, dtype=np.int64, shape=[])
            t = b.op("Range", [_constant(root, f"{base}/t0", np.array(0, np.int64)), steps,
                               _constant(root, f"{base}/t1", np.array(1, np.int64))], dtype=np.int64)
            t_col = b.op("Unsqueeze", [t, _constant(root, f"{base}/t_axes", np.array([1], np.int64))], dtype=np.int64)
        mask = b.op("Less", [t_col, lens64], dtype=np.bool_)
        mask4 = b.op("Unsqueeze", [mask, _constant(root, f"{base}/mask_axes", np.array([1, 3], np.int64))],
                     dtype=np.bool_)
        b.op("Where", [mask4, y_full, zero], out=y_out)
    if yh_out is not None:
        last = b.op("Max", [b.op("Sub", [lens64, _constant(root, f"{base}/one", np.array(1, np.int64))],
                                 dtype=np.int64),
                            _constant(root, f"{base}/zero_i", np.array(0, np.int64))], dtype=np.int64)
        idx = b.op("Unsqueeze", [last, _constant(root, f"{base}/last_axes", np.array([0, 1, 3], np.int64))],
                   dtype=np.int64)
        idx = b.op("Expand", [idx, _constant(root, f"{base}/last_shape", np.array([1, 1, 1, hidden], np.int64))],
                   dtype=np.int64)
        picked = b.op("GatherElements", [y_full, idx], {"axis": 0}, dtype=dtype)
        picked = b.op("Squeeze", [picked, _constant(root, f"{base}/squeeze_axes", np.array([0], np.int64))],
                      dtype=dtype)
        valid = b.op("Greater", [lens64, _constant(root, f"{base}/zero_len", np.array(0, np.int64))], dtype=np.bool_)
        valid = b.op("Unsqueeze", [valid, _constant(root, f"{base}/valid_axes", np.array([0, 2], np.int64))],
                     dtype=np.bool_)
        b.op("Where", [valid, picked, zero], out=yh_out)


# ----------------------------------------------------------------------------------------- Split + Cast(bool)


def _non_bool_split_part(m: Match) -> bool | str:
    x = m["x"]
    producer = x.inputs[0] if len(x.inputs) == 1 else None
    if producer is None or producer.op != "Split" or len(producer.outputs) < 2:
        return "not a part of a Split"
    dtype = dtype_of(x)
    return True if dtype is not None and np.dtype(dtype) != np.bool_ else "a bool or untyped part"


def _not_equal_zero(m: Match) -> list:
    x, base = m["x"], m.root.name or "Cast"
    zero = _constant(m.graph, f"{base}/zero", np.zeros((), dtype=dtype_of(x)))
    (eq,) = m.op("Equal", [x, zero], name=f"{base}/Equal", dtype=np.bool_, shape=shape_of(x))
    return m.op("Not", [eq], name=f"{base}/Not", dtype=np.bool_, shape=m.root.outputs[0].shape)


SPLIT_BOOL_RULES = (Rewrite("cast-split-part-to-bool", P.Cast(Var("x"), to=onnx.TensorProto.BOOL), _not_equal_zero,
                            _non_bool_split_part),)


@register_pass("split-cast-bool-as-compare", group="lower", targets=TARGETS, speed=False,
               rules=SPLIT_BOOL_RULES)
def split_cast_bool_as_compare(ctx: PassContext) -> None:
    """Cast-to-bool of a Split output becomes Not(Equal(x, 0)): OpenVINO CPU otherwise gives every output the first part."""
    _annotate_if(ctx, lambda n: n.outputs if n.op == "Split" else [])
    ctx.apply(*SPLIT_BOOL_RULES)


# ----------------------------------------------------------------------------------------- TopK ties


def _sorts_integers_by_value(m: Match) -> bool | str:
    """A sorted TopK over a 1-D integer vector (where ties are common: ids, segment ids)."""
    if int(m.root.attrs.get("sorted", 1)) != 1:
        return "unsorted: any order of ties is right"
    dtype, shape = dtype_of(m["x"]), shape_of(m["x"])
    if dtype is None or np.dtype(dtype) not in (np.dtype(np.int32), np.dtype(np.int64)):
        return f"sorts {dtype}, not int32/int64"
    if shape is None or len(shape) != 1:
        return "input not known to be 1-D"
    if _ties_broken_already(m["x"]):
        return "keys already distinct (rank·n + index)"
    return True


def _ties_broken_already(x: gs.Tensor) -> bool:
    """x is rank·n + Range(n), the distinct keys `_topk_ties_by_index` sorts."""
    add = x.inputs[0] if len(x.inputs) == 1 else None
    return add is not None and add.op == "Add" and any(len(t.inputs) == 1 and t.inputs[0].op == "Range"
                                                       for t in add.inputs)


def _value_ranks(m: Match, x: gs.Tensor, largest: bool) -> gs.Variable:
    """Each element's place among x's distinct values (0 for the smallest, or for the largest when `largest`)."""
    i64, one = np.int64, _constant(m.graph, "one_i64", np.int64(1))
    keys = x if np.dtype(dtype_of(x)) == np.int64 else m.op("Cast", [x], {"to": onnx.TensorProto.INT64}, dtype=i64)[0]
    distinct, _, rank, _ = m.op("Unique", [keys], {"sorted": 1}, outputs=4, dtype=i64)
    if not largest:
        return rank
    (count,) = m.op("Size", [distinct], dtype=i64, shape=[])
    (last,) = m.op("Sub", [count, one], dtype=i64, shape=[])
    return m.op("Sub", [last, rank], dtype=i64)[0]


def _topk_ties_by_index(m: Match) -> list:
    """TopK(x, k) as onnxruntime computes it (ties in index order): TopK of the distinct keys rank·n + index, whose
    order has no ties, then x gathered in that order."""
    x, i64 = m["x"], np.int64
    rank = _value_ranks(m, x, bool(int(m.root.attrs.get("largest", 1))))
    (n,) = m.op("Size", [x], dtype=i64, shape=[])
    zero, one = _constant(m.graph, "zero_i64", i64(0)), _constant(m.graph, "one_i64", i64(1))
    (index,) = m.op("Range", [zero, n, one], dtype=i64, shape=[None])
    (scaled,) = m.op("Mul", [rank, n], dtype=i64, shape=[None])
    (distinct_keys,) = m.op("Add", [scaled, index], dtype=i64, shape=[None])
    _, order = m.op("TopK", [distinct_keys, m["k"]], {"axis": 0, "largest": 0, "sorted": 1}, outputs=2, dtype=i64)
    (values,) = m.op("Gather", [x, order], {"axis": 0}, dtype=dtype_of(x), shape=[None])
    return [values, order]


TOPK_RULES = (
    Rewrite("topk-ties-by-index", P.TopK(Var("x"), Var("k")), _topk_ties_by_index, _sorts_integers_by_value),
)


@register_pass("topk-ties-by-index", group="lower", targets=TARGETS, speed=False, rules=TOPK_RULES)
def topk_ties_by_index(ctx: PassContext) -> None:
    """A sorted TopK over integers keeps ties in index order, as ONNX says (OpenVINO CPU orders them at random)."""
    _annotate_if(ctx, lambda n: n.inputs[:1] if n.op == "TopK" else [])
    ctx.apply(*TOPK_RULES)
