"""fuse_recurrent_loops on the tf2onnx dialects: Scan (TF dynamic_rnn), Loop (Keras GRU, DeepCTR DIEN `_where`),
and hand-built Scan/Loop layers for the masking variants, batch-major scans and a dynamic length."""

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from ctropt.graph import to_graph, to_model
from ctropt.passes.rnn.loops import fuse_recurrent_loops
from ctropt.runtime import compare_outputs, generate_inputs, run_model
from helpers import F, I64, init, make_model, node, vi

ROOT = Path(__file__).parent
THIRDPARTY = ROOT / "data" / "thirdparty"
ZOO = ROOT.parent / "ctropt" / "exporters" / "zoo" / "data"


def fuse(model):
    graph = to_graph(model)
    notes: list[str] = []
    lines = fuse_recurrent_loops(graph, graph.opset, notes)
    out = to_model(graph, like=model)
    if lines:
        assert ("ai.ctropt", 1) in [(o.domain, o.version) for o in out.opset_import]
    return out, lines, notes


def recurrent(model):
    return [n for n in model.graph.node if n.op_type in ("Loop", "Scan")]


def sequence_nodes(model):
    return [n for n in model.graph.node if n.domain == "ai.ctropt"]


def attrs(n):
    values = {a.name: helper.get_attribute_value(a) for a in n.attribute}
    return {k: v.decode() if isinstance(v, bytes) else v for k, v in values.items()}


def expose(model):
    """The model with every used output of its Scan/Loop nodes as an extra graph output (all steps, padded ones
    included, and final states are then compared, not just what the model makes of them)."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    used = {i for n in model.graph.node for i in n.input}
    outputs = {o.name for o in model.graph.output}
    for n in recurrent(model):
        for o in n.output:
            if o in used and o not in outputs:
                model.graph.output.append(helper.make_empty_tensor_value_info(o))
    return model


def with_lengths(model, lengths, seed=0):
    """Generated inputs whose sequence lengths (and prefix masks) are `lengths`."""
    lengths = np.asarray(lengths)
    feeds = generate_inputs(model, batch=len(lengths), seed=seed)
    for name, value in feeds.items():
        if "len" in name.lower():
            feeds[name] = lengths.reshape(value.shape).astype(value.dtype)
        elif "mask" in name.lower() and value.ndim == 2:
            feeds[name] = (np.arange(value.shape[1])[None, :] < lengths[:, None]).astype(value.dtype)
    return feeds


def assert_same(a, b, feeds, atol=1e-5):
    diffs = compare_outputs(run_model(a, feeds), run_model(b, feeds), atol=atol, rtol=1e-5)
    assert all(d.ok for d in diffs), diffs


def npz(path):
    with np.load(path) as data:
        return {k: data[k] for k in data.files}


# ------------------------------------------------------------------------------------------ exported models

# path, T, [(kind, att_keep, linear_before_reset)] in graph order, with lengths?
FIXTURES = {
    "dien_tf_scan": (ZOO / "dien_tf.onnx", 10, [("GRU", 0, 0), ("AUGRU", 1, 0)], True),
    "keras_gru_loop": (ROOT / "data" / "keras_gru_tf2onnx.onnx", 6, [("GRU", 0, 1), ("GRU", 0, 1)], False),
    "deepctr_GRU_where": (THIRDPARTY / "deepctr_DIEN_GRU_where_tf2onnx.onnx", 10, [("GRU", 0, 0), ("GRU", 0, 0)], True),
    "deepctr_AUGRU_where": (THIRDPARTY / "deepctr_DIEN_AUGRU_where_tf2onnx.onnx", 10,
                            [("GRU", 0, 0), ("AUGRU", 1, 0)], True),
    "deepctr_AGRU_where": (THIRDPARTY / "deepctr_DIEN_AGRU_where_tf2onnx.onnx", 10, [("GRU", 0, 0), ("AGRU", 0, 0)],
                           True),
    # AIGRU = a plain GRU over a*x: the Mul before the Loop folds into the op.
    "deepctr_AIGRU_where": (THIRDPARTY / "deepctr_DIEN_AIGRU_where_tf2onnx.onnx", 10,
                            [("GRU", 0, 0), ("AIGRU", 0, 0)], True),
}


@pytest.mark.parametrize("case", list(FIXTURES))
def test_exported_layers_become_sequence_ops_with_the_same_outputs(case):
    path, T, kinds, has_lengths = FIXTURES[case]
    raw = onnx.load(path)
    fused, lines, notes = fuse(raw)
    assert len(lines) == len(kinds) and not notes, (lines, notes)
    assert not recurrent(fused)
    nodes = sequence_nodes(fused)
    assert [(attrs(n)["kind"], attrs(n)["att_keep"], attrs(n)["linear_before_reset"]) for n in nodes] == kinds
    for n in nodes:
        assert n.op_type == f"{attrs(n)['kind']}Sequence"
        assert attrs(n)["padded_output"] == "zero"  # dynamic_rnn and DeepCTR's SelectV2 write zeros
        assert (len(n.input) > 4 and n.input[4] != "") == has_lengths

    # every output, the layers' own included (each step, padded ones too), on lengths 0..T
    exposed = expose(raw)
    exposed_fused, lines2, _ = fuse(exposed)
    assert len(lines2) == len(kinds) and not recurrent(exposed_fused)
    feed_sets = [generate_inputs(raw, batch=13)]
    if has_lengths:
        feed_sets += [with_lengths(raw, [0, T, 1, T - 1, 3]), with_lengths(raw, [0] * 3, seed=1),
                      with_lengths(raw, [T] * 3, seed=2)]
    for feeds in feed_sets:
        assert_same(exposed, exposed_fused, feeds)
        assert_same(raw, fused, feeds)

    ref = path.with_suffix(".ref.npz")
    if ref.exists():
        framework = npz(ref)
        got = run_model(fused, npz(path.with_suffix(".npz")))
        diffs = compare_outputs(framework, {k: got[k] for k in framework}, atol=1e-5, rtol=1e-4)
        assert all(d.ok for d in diffs), diffs

    again, lines3, notes3 = fuse(fused)
    assert lines3 == [] and not notes3
    assert [n.op_type for n in again.graph.node] == [n.op_type for n in fused.graph.node]


@pytest.mark.parametrize("path", [THIRDPARTY / "deepctr_DIEN_AIGRU_tf2onnx.onnx",  # ONNX GRU ops, no Scan/Loop
                                  THIRDPARTY / "torchrec_dlrm_dynamo.onnx"],  # Loops that are not recurrent
                         ids=lambda p: p.stem)
def test_models_without_recurrent_loops_are_left_alone(path):
    raw = onnx.load(path)
    out, lines, notes = fuse(raw)
    assert lines == [] and notes == []
    assert sorted(n.op_type for n in out.graph.node) == sorted(n.op_type for n in raw.graph.node)


# ------------------------------------------------------------------------------------------ hand-built layers

H, I, T = 3, 4, 5
_rng = np.random.default_rng(7)
WEIGHTS = {k: (_rng.normal(scale=0.6, size=s)).astype(np.float32)
           for k, s in [("Wz", (I, H)), ("Wr", (I, H)), ("Wn", (I, H)), ("Rz", (H, H)), ("Rr", (H, H)),
                        ("Rn", (H, H)), ("bz", (H,)), ("br", (H,)), ("bn", (H,))]}


def cell(h, x, out, att=None):
    """One GRU step (ONNX formula, a MatMul per gate) reading the weights from the main graph; with `att`, the
    paper's AUGRU: h + a*(1-z)*(n - h)."""
    def affine(gate, hh):
        return [node("MatMul", [x, f"W{gate}"], [f"xw{gate}"]), node("MatMul", [hh, f"R{gate}"], [f"hr{gate}"]),
                node("Add", [f"xw{gate}", f"hr{gate}"], [f"s{gate}"]), node("Add", [f"s{gate}", f"b{gate}"],
                                                                             [f"p{gate}"])]
    gates = (affine("z", h) + [node("Sigmoid", ["pz"], ["z"])] + affine("r", h) + [node("Sigmoid", ["pr"], ["r"])]
             + [node("Mul", ["r", h], ["rh"])] + affine("n", "rh") + [node("Tanh", ["pn"], ["n"]),
                                                                       node("Sub", ["one", "z"], ["u"])])
    if att is not None:
        return gates + [node("Sub", ["n", h], ["d"]), node("Mul", ["u", att], ["ua"]),
                        node("Mul", ["ua", "d"], ["uad"]), node("Add", [h, "uad"], [out])]
    return gates + [node("Mul", ["z", h], ["zh"]), node("Mul", ["u", "n"], ["un"]), node("Add", ["zh", "un"], [out])]


def zeros_like_state():
    """h0 = zeros [B, H] made from the input's shape (as exporters write the zero state)."""
    return [node("Shape", ["x"], ["x_shape"]), node("Slice", ["x_shape", "i0", "i1"], ["batch"]),
            node("Concat", ["batch", "hsize"], ["h0_shape"], axis=0),
            helper.make_node("ConstantOfShape", ["h0_shape"], ["h0"], name="h0_zeros",
                             value=helper.make_tensor("v", F, [1], [0.0]))]


def common_inits():
    return [init(k, v) for k, v in WEIGHTS.items()] + [
        init("one", np.float32(1.0)), init("zero", np.float32(0.0)), init("i0", np.array([0])),
        init("i1", np.array([1])), init("hsize", np.array([H])), init("t0", np.int64(0)), init("step", np.int64(1))]


def scan_model(y_mode="zero", lens="int64", h0="input", batch_major=False, att=False):
    """A dynamic_rnn-like Scan: counter, state, one scanned input (two with `att`: scores [B, T, 1] scanned too);
    valid = t < seq_len as a Where mask.

    y_mode: "zero" (output 0 past the length), "state" (the kept state), "one" (1.0: neither),
    "unmasked_state" (state not kept past the length, output zeroed)."""
    body_nodes = cell("h", "x_t", "c", "a_t" if att else None) + [node("Add", ["t", "step"], ["t_next"])]
    if lens is not None:
        t_cmp = "t" if lens == "int64" else "t_f"
        if lens != "int64":
            body_nodes.append(node("Cast", ["t"], ["t_f"], to=F))
        body_nodes += [node("Less", [t_cmp, "seq_len"], ["valid1"]), node("Unsqueeze", ["valid1", "i1"], ["valid"])]
        h_next = "c" if y_mode == "unmasked_state" else "h_next"
        if y_mode != "unmasked_state":
            body_nodes.append(node("Where", ["valid", "c", "h"], ["h_next"]))
        if y_mode == "state":
            body_nodes.append(node("Identity", ["h_next"], ["y"]))
        else:
            body_nodes.append(node("Where", ["valid", "c", "one" if y_mode == "one" else "zero"], ["y"]))
    else:
        h_next = "c"
        body_nodes.append(node("Identity", ["c"], ["y"]))
    scanned = [vi("x_t", F, ["B", I])] + ([vi("a_t", F, ["B", 1])] if att else [])
    body = helper.make_graph(body_nodes, "step", [vi("t", I64, []), vi("h", F, ["B", H])] + scanned,
                             [vi("t_next", I64, []), vi(h_next, F, ["B", H]), vi("y", F, ["B", H])])
    nodes = [] if h0 == "input" else zeros_like_state()
    if batch_major:
        axes = {"scan_input_axes": [1] * len(scanned), "scan_output_axes": [1]}
        nodes += [helper.make_node("Scan", ["t0", "h0", "x"] + (["att"] if att else []), ["t_last", "h_last", "y_seq"],
                                   name="rnn", body=body, num_scan_inputs=len(scanned), **axes),
                  node("Identity", ["y_seq"], ["y_bm"])]
    else:
        nodes += [node("Transpose", ["x"], ["x_tm"], perm=[1, 0, 2])]
        nodes += [node("Transpose", ["att"], ["att_tm"], perm=[1, 0, 2])] if att else []
        nodes += [helper.make_node("Scan", ["t0", "h0", "x_tm"] + (["att_tm"] if att else []),
                                   ["t_last", "h_last", "y_tm"], name="rnn", body=body, num_scan_inputs=len(scanned)),
                  node("Transpose", ["y_tm"], ["y_bm"], perm=[1, 0, 2])]
    nodes.append(node("Identity", ["h_last"], ["h_final"]))
    inputs = [vi("x", F, ["B", T, I])] + ([vi("att", F, ["B", T, 1])] if att else [])
    if lens is not None:
        inputs.append(vi("seq_len", I64 if lens == "int64" else F, ["B"]))
    if h0 == "input":
        inputs.append(vi("h0", F, ["B", H]))
    return make_model(nodes, inputs, [vi("y_bm", F, ["B", T, H]), vi("h_final", F, ["B", H])], common_inits())


def loop_model(stop_early=False, mask=False, h0_input=False):
    """A Keras-like Loop over a dynamic T: no M, cond = t + 1 < T with T = Shape(x_time_major)[0], x_t = Gather.

    With `mask` (Keras' masked GRU): m_t = Gather(mask [T, B, 1], t), and besides the state h the previous output
    o is carried; both keep their value where m_t is false, and the output is o. With `h0_input` the state starts
    from an input while o starts at zeros (Keras with initial_state): the outputs before the first valid step are
    then neither zeros nor the state."""
    body_nodes = [node("Gather", ["x_tm", "t"], ["x_t"], axis=0)] + cell("h", "x_t", "c") + [
        node("Add", ["t", "step"], ["t_next"]),
        node("Add", ["t_next", "step"], ["t_next2"]) if stop_early else node("Identity", ["t_next"], ["t_next2"]),
        node("Less", ["t_next2", "steps"], ["go"])]
    carried_in, carried_out = [vi("t", I64, []), vi("h", F, ["B", H])], [vi("t_next", I64, [])]
    if mask:
        body_nodes += [node("Gather", ["mask_tm", "t"], ["m_t"], axis=0), node("Where", ["m_t", "c", "h"], ["h_next"]),
                       node("Where", ["m_t", "c", "o"], ["o_next"]), node("Identity", ["o_next"], ["y"])]
        carried_in.insert(1, vi("o", F, ["B", H]))
        carried_out += [vi("o_next", F, ["B", H]), vi("h_next", F, ["B", H])]
    else:
        body_nodes.append(node("Identity", ["c"], ["y"]))
        carried_out.append(vi("c", F, ["B", H]))
    body = helper.make_graph(body_nodes, "step", [vi("i", I64, []), vi("cond", TensorProto.BOOL, [])] + carried_in,
                             [vi("go", TensorProto.BOOL, [])] + carried_out + [vi("y", F, ["B", H])])
    nodes = zeros_like_state() + [
        node("Transpose", ["x"], ["x_tm"], perm=[1, 0, 2]), node("Shape", ["x_tm"], ["tm_shape"]),
        node("Slice", ["tm_shape", "i0", "i1"], ["steps1"]), node("Squeeze", ["steps1", "i0"], ["steps"]),
        node("Less", ["t0", "steps"], ["go0"])]
    inputs = [vi("x", F, ["B", "T", I])]
    if mask:
        nodes += [node("Unsqueeze", ["mask", "i2"], ["mask3"]),
                  node("Transpose", ["mask3"], ["mask_tm"], perm=[1, 0, 2]), node("Identity", ["h0"], ["o0"]),
                  helper.make_node("Loop", ["", "go0", "t0", "o0", "h_init" if h0_input else "h0"],
                                   ["t_last", "h_last", "s_last", "y_tm"], name="rnn", body=body)]
        inputs.append(vi("mask", TensorProto.BOOL, ["B", "T"]))
        inputs += [vi("h_init", F, ["B", H])] if h0_input else []
    else:
        nodes.append(helper.make_node("Loop", ["", "go0", "t0", "h0"], ["t_last", "h_last", "y_tm"], name="rnn",
                                      body=body))
    nodes += [node("Transpose", ["y_tm"], ["y_bm"], perm=[1, 0, 2]), node("Identity", ["h_last"], ["h_final"])]
    return make_model(nodes, inputs, [vi("y_bm", F, ["B", "T", H]), vi("h_final", F, ["B", H])],
                      common_inits() + [init("i2", np.array([2]))])


def hand_feeds(model, lengths=(0, T, 1, T - 1, 2, T + 3, 3), steps=T, seed=3):
    rng = np.random.default_rng(seed)
    B = len(lengths)
    feeds = {"x": rng.normal(size=(B, steps, I)).astype(np.float32)}
    names = {i.name: i for i in model.graph.input}
    if "seq_len" in names:
        dt = np.int64 if names["seq_len"].type.tensor_type.elem_type == I64 else np.float32
        feeds["seq_len"] = np.asarray(lengths, dt)
    if "h0" in names:
        feeds["h0"] = rng.normal(size=(B, H)).astype(np.float32)
    if "att" in names:
        feeds["att"] = rng.uniform(size=(B, steps, 1)).astype(np.float32)
    if "mask" in names:  # any pattern, not only prefixes: empty, full, gaps
        feeds["mask"] = rng.random((B, steps)) < 0.5
        feeds["mask"][0], feeds["mask"][-1] = False, True
    return feeds


@pytest.mark.parametrize("y_mode,lens,h0,batch_major,att", [
    ("zero", "int64", "input", False, False),
    ("state", "int64", "zeros", True, False),
    ("zero", "float", "zeros", False, False),
    ("zero", None, "input", True, False),
    ("zero", "int64", "zeros", False, True),
    ("state", None, "input", True, True),
])
def test_hand_built_scan_fuses_with_its_masking(y_mode, lens, h0, batch_major, att):
    raw = scan_model(y_mode, lens, h0, batch_major, att)
    fused, lines, notes = fuse(raw)
    assert len(lines) == 1 and not notes and not recurrent(fused), (lines, notes)
    (n,) = sequence_nodes(fused)
    a = attrs(n)
    kind = "AUGRU" if att else "GRU"
    assert (n.op_type, a["kind"], a["hidden_size"], a["linear_before_reset"], a["att_keep"]) == \
        (f"{kind}Sequence", kind, H, 0, 0)
    if att:  # the scores [B, T, 1] read as [B, T] from before their Transpose
        assert n.input[6] != "" and "Transpose" not in [m.op_type for m in fused.graph.node if n.input[6] in m.output]
    names = list(n.input) + [""] * 8
    if lens is not None or y_mode == "zero":
        assert a["padded_output"] == y_mode
    assert (names[4] != "") == (lens is not None)
    assert (names[5] == "h0") == (h0 == "input")
    assert names[0] == "x"  # batch-major input read directly, the time-major one from before its Transpose
    if lens == "float":  # t < len  <=>  t < ceil(len)
        assert "Ceil" in [m.op_type for m in fused.graph.node]
    lengths = (0, 5, 1.5, 4, 2.2, 7, 0.5) if lens == "float" else (0, T, 1, T - 1, 2, T + 3, 3)
    assert_same(raw, fused, hand_feeds(raw, lengths))
    assert_same(raw, fused, hand_feeds(raw, (0, 0, 0), seed=4))
    assert_same(raw, fused, hand_feeds(raw, (T, T), seed=5))
    again, lines2, _ = fuse(fused)
    assert lines2 == [] and [m.op_type for m in again.graph.node] == [m.op_type for m in fused.graph.node]


@pytest.mark.parametrize("y_mode,reason", [
    ("one", "neither zeros nor the kept state"),
    ("unmasked_state", "the new state is not where(valid step, cell, h)"),
])
def test_masking_that_is_neither_zero_nor_state_stays_unfused(y_mode, reason):
    raw = scan_model(y_mode)
    out, lines, notes = fuse(raw)
    assert lines == [] and len(notes) == 1 and reason in notes[0], notes
    assert sorted(n.op_type for n in out.graph.node) == sorted(n.op_type for n in raw.graph.node)


def test_loop_over_a_dynamic_length_fuses_and_runs_any_length():
    raw = loop_model()
    fused, lines, notes = fuse(raw)
    assert len(lines) == 1 and not notes and not recurrent(fused), (lines, notes)
    (n,) = sequence_nodes(fused)
    assert attrs(n)["kind"] == "GRU" and n.input[0] == "x" and len(n.input) == 4  # no lengths, zero initial state
    for steps in (1, 2, 7):
        assert_same(raw, fused, hand_feeds(raw, (0, 0, 0, 0), steps=steps, seed=steps))


def test_keras_masked_loop_carrying_the_previous_output_fuses_with_its_mask():
    raw = loop_model(mask=True)
    fused, lines, notes = fuse(raw)
    assert len(lines) == 1 and not notes and not recurrent(fused), (lines, notes)
    (n,) = sequence_nodes(fused)
    assert attrs(n)["padded_output"] == "state"  # masked steps repeat the previous output
    assert n.input[7] != "" and n.input[4] == ""  # a mask, not lengths
    for steps in (1, 4, 7):
        assert_same(raw, fused, hand_feeds(raw, (0,) * 6, steps=steps, seed=steps))


def test_keras_masked_loop_from_an_initial_state_stays_unfused():
    raw = loop_model(mask=True, h0_input=True)
    out, lines, notes = fuse(raw)
    assert lines == [] and len(notes) == 1 and "does not start as the state" in notes[0], notes
    assert recurrent(out)


def test_loop_that_stops_before_the_last_step_stays_unfused():
    raw = loop_model(stop_early=True)
    out, lines, notes = fuse(raw)
    assert lines == [] and len(notes) == 1 and "Loop runs" in notes[0], notes
    assert recurrent(out)


# ----------------------------------------------------------------------------------------- the reader's phases alone


def _phases_until(model, last: str):
    """The hand-built Scan read by rnn/loops' phases, up to `last`: what each phase found, by name."""
    import numpy as np

    from ctropt.graph.shapes import Shapes
    from ctropt.passes.rnn import loops

    graph = to_graph(model)
    (scan,) = [n for n in graph.nodes if n.op == "Scan"]
    shapes, opset, found = Shapes(graph), graph.opset, {}
    inits, b_in, b_out, scan_outs, out_axes, slices, slice_srcs, in_axes = loops._interface(scan, shapes, opset)
    found["interface"] = (inits, b_in, b_out, slice_srcs)
    finals = list(scan.outputs[:len(inits)])
    counters, invariants, floats, grown = found["roles"] = loops._carried_roles(graph, inits, b_in, b_out, finals)
    if last == "roles":
        return found
    copy = loops._probe_copy(scan, inits, counters, invariants)
    rng = np.random.default_rng(0)
    x_step, extra = found["step inputs"] = loops._per_step_inputs(scan, copy, slice_srcs, in_axes, b_in, floats,
                                                                 shapes, opset, rng)
    if last == "step inputs":
        return found
    cell = found["cell"] = loops._find_cell(copy, x_step, extra, b_in, inits, floats, shapes, opset)
    if last == "cell":
        return found
    found["masking"] = loops._masking(copy, cell, x_step, [0], shapes, opset, rng)
    return found


def test_phase_roles_tells_the_counter_from_the_state():
    counters, invariants, floats, grown = _phases_until(scan_model(), "roles")["roles"]
    assert list(counters) == [0] and not invariants and floats == [1] and not grown  # carried: t (counter), h (state)


def test_phase_step_inputs_finds_the_scanned_input_and_its_time_axis():
    x_step, extra = _phases_until(scan_model(batch_major=True), "step inputs")["step inputs"]
    assert (x_step.source.name, x_step.time_axis, x_step.width) == ("x", 1, I) and extra is None


def test_phase_cell_reads_the_gru_by_meaning():
    cell = _phases_until(scan_model(att=True), "cell")["cell"]
    assert (cell.match.attrs.kind, cell.H, cell.state) == ("AUGRU", H, 1) and cell.att is not None


def test_phase_masking_reads_the_lengths_and_what_padded_steps_give():
    outer, padded = _phases_until(scan_model("state"), "masking")["masking"]
    assert outer.lens is not None and outer.lens.name == "seq_len" and padded == "state"


# ----------------------------------------------------------------------------------------- paddle2onnx's while


def paddle_loop_model(start_rows=0):
    """paddle2onnx's form of a ``while`` over a GRU cell (PaddleRec's dynamic-length DIEN): the counter goes through
    ``scale`` (Cast → Mul 1 → Add 1 → Cast), x_t = x_tm[ar[t]] with ar = Range(0, T, 1) read by Slices, the
    outputs grow a stack by Concat from an empty start (`start_rows` rows otherwise), and two values are written
    each step but read by no one (an int and a float)."""
    body_nodes = [
        node("Cast", ["t"], ["t_f"], to=F), node("Mul", ["t_f", "one"], ["t_m"]), node("Add", ["t_m", "one"], ["t_a"]),
        node("Cast", ["t_a"], ["t_next"], to=I64), node("Unsqueeze", ["t", "i0"], ["t_b"]),
        node("Unsqueeze", ["t_next", "i0"], ["t_e"]), node("Slice", ["ar", "t_b", "t_e", "i0"], ["s1"]),
        node("Squeeze", ["s1", "i0"], ["s"]), node("Add", ["s", "step"], ["s_end"]),
        node("Unsqueeze", ["s", "i0"], ["s_b"]), node("Unsqueeze", ["s_end", "i0"], ["s_e"]),
        node("Slice", ["x_tm", "s_b", "s_e", "i0"], ["x_t1"]), node("Squeeze", ["x_t1", "i0"], ["x_t"])] + \
        cell("h", "x_t", "c") + [
        node("Unsqueeze", ["c", "i0"], ["piece"]), node("Identity", ["stk"], ["stk_in"]),
        node("Concat", ["stk_in", "piece"], ["stk_next"], axis=0), node("Less", ["t_next", "steps"], ["go"])]
    carried = [vi("t", I64, []), vi("stk", F, [None, "B", H]), vi("h", F, ["B", H]), vi("di", I64, []),
               vi("df", F, ["B", I])]
    body = helper.make_graph(body_nodes, "while", [vi("i", I64, []), vi("cond", TensorProto.BOOL, [])] + carried,
                             [vi("go", TensorProto.BOOL, []), vi("t_next", I64, []), vi("stk_next", F, [None, "B", H]),
                              vi("c", F, ["B", H]), vi("s", I64, []), vi("x_t", F, ["B", I])])
    nodes = zeros_like_state() + [
        node("Transpose", ["x"], ["x_tm"], perm=[1, 0, 2]), node("Shape", ["x_tm"], ["tm_shape"]),
        node("Slice", ["tm_shape", "i0", "i1"], ["len1"]), node("Squeeze", ["len1", "i0"], ["len"]),
        node("Range", ["t0", "len", "step"], ["ar"]), node("Shape", ["ar"], ["ar_shape"]),
        node("Slice", ["ar_shape", "i0", "i1"], ["steps1"]), node("Squeeze", ["steps1", "i0"], ["steps"]),
        node("Less", ["t0", "steps"], ["go0"]), node("Concat", ["rows", "batch", "hsize"], ["stk_shape"], axis=0),
        node("Expand", ["zero1", "stk_shape"], ["stk0"]), node("Gather", ["x_tm", "t0"], ["x0"], axis=0),
        helper.make_node("Loop", ["", "go0", "t0", "stk0", "h0", "t0", "x0"],
                         ["t_last", "stk_last", "h_last", "s_last", "x_last"], name="rnn", body=body),
        node("Transpose", ["stk_last"], ["y_bm"], perm=[1, 0, 2]), node("Identity", ["h_last"], ["h_final"])]
    return make_model(nodes, [vi("x", F, ["B", "T", I])], [vi("y_bm", F, ["B", None, H]), vi("h_final", F, ["B", H])],
                      common_inits() + [init("rows", np.array([start_rows])), init("zero1", np.zeros(1, np.float32))])


def test_paddle_while_with_a_grown_stack_fuses_and_runs_any_length():
    raw = paddle_loop_model()
    fused, lines, notes = fuse(raw)
    assert len(lines) == 1 and not notes and not recurrent(fused), (lines, notes)
    (n,) = sequence_nodes(fused)
    assert attrs(n)["kind"] == "GRU" and n.input[0] == "x"
    for steps in (1, 2, 7):
        assert_same(raw, fused, hand_feeds(raw, (0, 0, 0, 0), steps=steps, seed=steps))
    again, lines2, _ = fuse(fused)
    assert lines2 == [] and [m.op_type for m in again.graph.node] == [m.op_type for m in fused.graph.node]


def test_paddle_while_whose_stack_starts_with_rows_stays_unfused():
    raw = paddle_loop_model(start_rows=1)
    fused, lines, notes = fuse(raw)
    assert lines == [] and len(notes) == 1 and "grows from a start that is not empty" in notes[0], notes
    assert recurrent(fused)
