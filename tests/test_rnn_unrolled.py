"""fuse_gru_ops / fuse_unrolled_cells: the ONNX GRU op and GRU-family cells unrolled by PyTorch exporters
become one ai.ctropt sequence node with the raw model's outputs (empty, partial and full histories)."""

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from ctropt.graph import check_model, load, to_graph, to_model
from ctropt.ops.rnn import SequenceAttrs, reference
from ctropt.passes.rnn.gru_op import fuse_gru_ops
from ctropt.passes.rnn.unrolled import fuse_unrolled_cells
from ctropt.runtime import Runner
from helpers import F, init, make_model, node, vi

DATA = Path(__file__).parent / "data" / "thirdparty"
ZOO = Path(__file__).parent.parent / "ctropt" / "exporters" / "zoo" / "data"
DOMAIN = "ai.ctropt"
RNG = np.random.default_rng(0)


def onnx_opset(model) -> int:
    return next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))


def fuse(model):
    """Both passes, as the pipeline runs them; returns (fused model, what was fused)."""
    graph = to_graph(model)
    opset = onnx_opset(model)
    done = fuse_gru_ops(graph, opset) + fuse_unrolled_cells(graph, opset)
    out = to_model(graph, like=model)
    check_model(out)
    return out, done


INPUTS = ("X", "W", "R", "B", "sequence_lens", "initial_h", "att", "mask")


def sequence_nodes(model) -> list[dict]:
    """The ai.ctropt nodes: attributes, `inputs` by name of the op's input ("" = not given), `node` itself."""
    return [{"op": n.op_type, **{a.name: helper.get_attribute_value(a) for a in n.attribute},
             "inputs": dict(zip(INPUTS, list(n.input) + [""] * 8)), "node": n}
            for n in model.graph.node if n.domain == DOMAIN]


def kinds(model) -> list[tuple]:
    return sorted((_s(n["kind"]), n["linear_before_reset"], n["att_keep"], _s(n["padded_output"]))
                  for n in sequence_nodes(model))


def _s(v):
    return v.decode() if isinstance(v, bytes) else v


def ops(model) -> list[str]:
    return [n.op_type for n in model.graph.node]


def assert_close(a: dict, b: dict, atol=1e-5):
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_allclose(b[k], a[k], atol=atol, rtol=1e-5, err_msg=k)


def assert_idempotent(fused):
    again, done = fuse(fused)
    assert done == [] and sorted(ops(again)) == sorted(ops(fused))


# ----------------------------------------------------------------------------------------- hand-built GRU ops


def gru_op_model(lbr: int, lens: bool, h0: bool, layout: int = 0, T=5, I=3, H=4):
    """Batch-major X → Transpose → GRU → Squeeze + Transpose (Y) and Squeeze (Y_h), as torch writes nn.GRU."""
    W = RNG.normal(size=(1, 3 * H, I)).astype(np.float32)
    R = RNG.normal(size=(1, 3 * H, H)).astype(np.float32) * 0.5
    B = RNG.normal(size=(1, 6 * H)).astype(np.float32) * 0.3
    inits = [init("W", W), init("R", R), init("B", B), init("ax0", np.array([0])), init("ax1", np.array([1]))]
    inputs = [vi("X", F, ["batch", T, I])]
    nodes = []
    if layout == 0:
        nodes.append(node("Transpose", ["X"], ["Xt"], perm=[1, 0, 2]))
    gru_in = ["Xt" if layout == 0 else "X", "W", "R", "B", "lens" if lens else "", "h0u" if h0 else ""]
    if lens:
        inputs.append(vi("lens", TensorProto.INT32, ["batch"]))
    if h0:
        inputs.append(vi("h0", F, ["batch", H]))
        nodes.append(node("Unsqueeze", ["h0", "ax0" if layout == 0 else "ax1"], ["h0u"]))
    while gru_in and not gru_in[-1]:
        gru_in.pop()
    nodes.append(node("GRU", gru_in, ["Y4", "Yh3"], hidden_size=H, linear_before_reset=lbr, layout=layout))
    if layout == 0:
        nodes += [node("Squeeze", ["Y4", "ax1"], ["Ytb"]), node("Transpose", ["Ytb"], ["Y"], perm=[1, 0, 2]),
                  node("Squeeze", ["Yh3", "ax0"], ["Yh"])]
        outputs = [vi("Y", F, ["batch", T, H]), vi("Yh", F, ["batch", H])]
    else:  # layout 1: Y [B, T, 1, H] squeezed; Y_h [B, 1, H] is a graph output as it is
        nodes += [node("Squeeze", ["Y4", init("ax2", np.array([2])).name], ["Y"]), node("Identity", ["Yh3"], ["Yh"])]
        inits.append(init("ax2", np.array([2])))
        outputs = [vi("Y", F, ["batch", T, H]), vi("Yh", F, ["batch", 1, H])]
    return make_model(nodes, inputs, outputs, inits, opset=17)


def gru_op_feeds(model, T=5, I=3, H=4):
    feeds = {"X": RNG.normal(size=(4, T, I)).astype(np.float32)}
    names = [i.name for i in model.graph.input]
    if "lens" in names:
        feeds["lens"] = np.array([0, T, 2, 1], np.int32)  # empty, full, partial rows
    if "h0" in names:
        feeds["h0"] = RNG.normal(size=(4, H)).astype(np.float32)
    return feeds


@pytest.mark.parametrize("lbr", [0, 1])
@pytest.mark.parametrize("lens, h0", [(False, False), (True, False), (False, True), (True, True)])
def test_gru_op_becomes_gru_sequence(lbr, lens, h0):
    model = gru_op_model(lbr, lens, h0)
    fused, done = fuse(model)
    assert len(done) == 1 and "absorbed" in done[0]
    # Transpose, Squeezes, Unsqueeze of h0 absorbed; onnxruntime's zero state for empty rows given an initial_h kept
    assert sorted(ops(fused)) == ["GRUSequence"] + (["Greater", "Unsqueeze", "Where"] if lens and h0 else [])
    (seq,) = sequence_nodes(fused)
    assert (_s(seq["kind"]), seq["linear_before_reset"], _s(seq["padded_output"])) == ("GRU", lbr, "zero")
    assert seq["inputs"]["X"] == "X" and (seq["inputs"]["sequence_lens"] == "lens") == lens
    assert (seq["inputs"]["initial_h"] == "h0") == h0
    feeds = gru_op_feeds(model)
    assert_close(Runner(model).run(feeds), Runner(fused).run(feeds))
    assert_idempotent(fused)


def test_batch_major_gru_op_with_its_state_as_output():
    """layout=1 and Y_h read as [B, 1, H]: the fused op's [B, H] is unsqueezed back. onnxruntime does not run
    layout=1, so the expected values come from the ONNX GRU's definition (with its zero state for empty rows)."""
    model = gru_op_model(1, lens=True, h0=True, layout=1)
    fused, done = fuse(model)
    assert len(done) == 1 and "GRU" not in ops(fused)
    assert sorted(ops(fused)) == ["GRUSequence", "Greater", "Identity", "Unsqueeze", "Unsqueeze", "Where"]
    feeds = gru_op_feeds(model)
    w = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    Y, Yh = reference(SequenceAttrs("GRU", 4, 1), feeds["X"], w["W"][0].T, w["R"][0].T, w["B"][0],
                      sequence_lens=feeds["lens"], initial_h=feeds["h0"])
    Yh[feeds["lens"] == 0] = 0
    assert_close({"Y": Y, "Yh": Yh[:, None]}, Runner(fused).run(feeds))
    assert_idempotent(fused)


def test_gru_ops_the_fused_op_cannot_express_stay():
    model = gru_op_model(0, lens=False, h0=False)
    gru = next(n for n in model.graph.node if n.op_type == "GRU")
    gru.attribute.append(helper.make_attribute("clip", 1.0))
    assert fuse(model)[1] == []
    bidi = gru_op_model(0, lens=False, h0=False)
    gru = next(n for n in bidi.graph.node if n.op_type == "GRU")
    del gru.attribute[:]
    gru.attribute.extend([helper.make_attribute("hidden_size", 4), helper.make_attribute("direction", "reverse")])
    assert fuse(bidi)[1] == []


def masked_gru_op_model(compare: str = "Less", positions=None, last_state: bool = False, T=5):
    """deepctr-torch DIEN's plain GRU over padded histories: nn.GRU over all T steps, then its outputs times
    ``arange(T) < length`` (the legacy and dynamo exporters write a [1, T] constant; `positions` replaces it)."""
    model = gru_op_model(1, lens=False, h0=False, T=T)
    graph = model.graph
    pos = np.arange(T, dtype=np.int64)[None] if positions is None else np.asarray(positions, np.int64)[None]
    a, b = ("pos", "len2") if compare in ("Less", "LessOrEqual") else ("len2", "pos")
    graph.initializer.extend([init("pos", pos), init("col", np.array([-1, 1], np.int64)),
                              init("ax2", np.array([2], np.int64))])
    graph.input.append(vi("length", TensorProto.INT64, ["batch"]))
    y = next(n for n in graph.node if n.output[0] == "Y")
    y.output[0] = "Y_all"
    graph.node.extend([node("Reshape", ["length", "col"], ["len2"]), node(compare, [a, b], ["valid"]),
                       node("Cast", ["valid"], ["valid_f"], to=TensorProto.FLOAT),
                       node("Unsqueeze", ["valid_f", "ax2"], ["valid3"]), node("Mul", ["Y_all", "valid3"], ["Y"])])
    if not last_state:
        graph.output.remove(next(o for o in graph.output if o.name == "Yh"))
    return model


def _fused_then(model, after):
    """fuse_gru_ops, then `after(graph)` (one of fuse-rnn's follow-ups): (model, what was fused, its notes)."""
    graph = to_graph(model)
    done = fuse_gru_ops(graph, 17)
    notes = after(graph)
    graph.cleanup()
    return to_model(graph, like=model), done, notes


def _fused_with_lengths(model):
    from ctropt.passes.rnn.prefix import lengths_from_output_masks
    return _fused_then(model, lengths_from_output_masks)


@pytest.mark.parametrize("compare", ["Less", "Greater"])
def test_gru_outputs_zeroed_past_the_length_become_sequence_lens(compare):
    """The multiply goes and the layer gets the count of valid steps as sequence_lens (padded steps skipped)."""
    model = masked_gru_op_model(compare)
    fused, done, notes = _fused_with_lengths(model)
    assert len(done) == 1 and len(notes) == 1 and "sequence_lens" in notes[0], notes
    assert "Mul" not in ops(fused)
    (seq,) = sequence_nodes(fused)
    assert seq["inputs"]["sequence_lens"] and _s(seq["padded_output"]) == "zero"
    for lengths in ([0, 5, 2, 1], [7, -1, 3, 4], [5, 5, 5, 5]):  # empty, longer than T, negative, full
        feeds = {"X": RNG.normal(size=(4, 5, 3)).astype(np.float32), "length": np.array(lengths, np.int64)}
        assert_close(Runner(model).run(feeds), Runner(fused).run(feeds))
    again, _, notes2 = _fused_with_lengths(fused)
    assert notes2 == [] and sorted(ops(again)) == sorted(ops(fused))


@pytest.mark.parametrize("why", ["suffix mask", "positions not in order", "last state read"])
def test_gru_outputs_masked_otherwise_keep_the_multiply(why):
    """A mask that is not a prefix of every row (valid steps after padded ones), or a last state that would
    change (it would stop at the length), leaves the layer running every step."""
    model = masked_gru_op_model("Less", positions=[0, 3, 1, 2, 4] if why == "positions not in order" else None,
                                last_state=why == "last state read")
    if why == "suffix mask":  # arange(T) > length: the valid steps are the last ones
        cmp = next(n for n in model.graph.node if n.op_type == "Less")
        cmp.op_type = "Greater"
    _, done, notes = _fused_with_lengths(model)
    assert len(done) == 1 and notes == []


def scaled_gru_op_model(per_step: bool = True, T=5):
    """PaddleRec DIEN: a plain GRU over the history times the attention weights ([B, T, 1]: one per step;
    per_step=False: [B, T, I], one per feature, which is not an AIGRU)."""
    model = gru_op_model(1, lens=False, h0=False, T=T)
    graph = model.graph
    graph.input.append(vi("att", F, ["batch", T, 1 if per_step else 3]))
    tr = next(n for n in graph.node if n.op_type == "Transpose" and n.input[0] == "X")
    tr.input[0] = "X_scaled"
    graph.node.insert(0, node("Mul", ["X", "att"], ["X_scaled"]))
    return model


def _fused_with_attention(model):
    from ctropt.passes.rnn.scaled import attention_from_scaled_inputs
    return _fused_then(model, attention_from_scaled_inputs)


def test_a_gru_over_inputs_scaled_per_step_reads_the_weights_as_an_aigru():
    model = scaled_gru_op_model()
    fused, done, notes = _fused_with_attention(model)
    assert len(done) == 1 and len(notes) == 1 and "AIGRU" in notes[0], notes
    assert "Mul" not in ops(fused)
    (seq,) = sequence_nodes(fused)
    assert _s(seq["kind"]) == "AIGRU" and seq["inputs"]["X"] == "X" and seq["inputs"]["att"]
    for att in (RNG.random((4, 5, 1)), np.zeros((4, 5, 1)), RNG.normal(size=(4, 5, 1)) * 3):
        feeds = {"X": RNG.normal(size=(4, 5, 3)).astype(np.float32), "att": att.astype(np.float32)}
        assert_close(Runner(model).run(feeds), Runner(fused).run(feeds))
    again, _, notes2 = _fused_with_attention(fused)
    assert notes2 == [] and sorted(ops(again)) == sorted(ops(fused))


def test_inputs_scaled_per_feature_keep_the_multiply():
    _, done, notes = _fused_with_attention(scaled_gru_op_model(per_step=False))
    assert len(done) == 1 and notes == []


# ----------------------------------------------------------------------------------------- hand-built unrolled cell


def unrolled_cell_model(T=5, I=3, H=4, masked=True, stacked=True, h0_input=True, tamper_step=None, kind="GRU",
                        inverted=False, blend=None):
    """nn.GRUCell in a Python loop as the legacy exporter writes it: x_t = Gather(X, t, axis 1), Gemm per gate
    block, Split, torch gate order (r, z, n), state kept past the length with Where(mask[:, t:t+1]), states
    stacked with Unsqueeze + Concat; the last state is a graph output too. kind AUGRU: deepctr-torch's
    AUGRUCell (u = a_t * sigmoid(..), h' = (1-u) h + u n); AIGRU: a GRUCell over a_t * x_t. blend (FuxiCTR's DIEN,
    torch): the mask as float [B, T, 1] (blend="cast": Cast of the bool mask; "float": a float input),
    m_t = Gather(M, t, axis 1) [B, 1], s_t = m_t * new + (1 - m_t) * s_{t-1}; a_t = Unsqueeze(Gather(att, t), -1)."""
    Wih = RNG.normal(size=(3 * H, I)).astype(np.float32) * 0.6
    Whh = RNG.normal(size=(3 * H, H)).astype(np.float32) * 0.6
    bih, bhh = (RNG.normal(size=3 * H).astype(np.float32) * 0.2 for _ in range(2))
    inits = [init("Wih", Wih), init("Whh", Whh), init("bih", bih), init("bhh", bhh), init("one", np.float32(1.0)),
             init("split", np.array([H, H, H])), init("ax1", np.array([1])), init("bhh_other", bhh + 0.5)]
    inputs = [vi("X", F, ["batch", T, I])]
    nodes = []
    if masked and blend == "float":
        inputs.append(vi("mask", F, ["batch", T, 1]))
        inits.append(init("ax2", np.array([-1])))
    elif masked:
        inputs.append(vi("mask", TensorProto.BOOL, ["batch", T]))
        if blend == "cast":
            inits.append(init("ax2", np.array([-1])))
            nodes += [node("Cast", ["mask"], ["maskf"], to=TensorProto.FLOAT), node("Unsqueeze", ["maskf", "ax2"], ["M"])]
    if kind != "GRU":
        inputs.append(vi("att", F, ["batch", T]))
    if h0_input:
        inputs.append(vi("h0", F, ["batch", H]))
        h = "h0"
    else:
        nodes += [node("Shape", ["X"], ["shp"], start=0, end=1),
                  node("Concat", ["shp", init("hdim", np.array([H])).name], ["hshape"], axis=0),
                  node("ConstantOfShape", ["hshape"], ["hzero"])]
        inits.append(init("hdim", np.array([H])))
        h = "hzero"
    for t in range(T):
        inits += [init(f"t{t}", np.array(t)), init(f"s{t}", np.array([t])), init(f"e{t}", np.array([t + 1]))]
        p = f"c{t}_"
        bias = "bhh_other" if t == tamper_step else "bhh"
        nodes.append(node("Gather", ["X", f"t{t}"], [p + "x"], axis=1))
        x = p + "x"
        if kind != "GRU" and blend:
            nodes += [node("Gather", ["att", f"t{t}"], [p + "a1"], axis=1), node("Unsqueeze", [p + "a1", "ax2"], [p + "a"])]
        elif kind != "GRU":
            nodes.append(node("Slice", ["att", f"s{t}", f"e{t}", "ax1"], [p + "a"]))
        if kind == "AIGRU":
            nodes.append(node("Mul", [p + "x", p + "a"], [p + "ax"]))
            x = p + "ax"
        nodes += [node("Gemm", [x, "Wih", "bih"], [p + "gi"], transB=1),
                  node("Gemm", [h, "Whh", bias], [p + "gh"], transB=1),
                  helper.make_node("Split", [p + "gi", "split"], [p + "ir", p + "iz", p + "in"], axis=1),
                  helper.make_node("Split", [p + "gh", "split"], [p + "hr", p + "hz", p + "hn"], axis=1),
                  node("Add", [p + "ir", p + "hr"], [p + "ar"]), node("Sigmoid", [p + "ar"], [p + "r"]),
                  node("Add", [p + "iz", p + "hz"], [p + "az"]), node("Sigmoid", [p + "az"], [p + "z"]),
                  node("Mul", [p + "r", p + "hn"], [p + "rh"]), node("Add", [p + "in", p + "rh"], [p + "an"]),
                  node("Tanh", [p + "an"], [p + "n"])]
        if kind == "AUGRU":
            nodes += [node("Mul", [p + "a", p + "z"], [p + "u"]), node("Sub", ["one", p + "u"], [p + "k"]),
                      node("Mul", [p + "k", h], [p + "kh"]), node("Mul", [p + "u", p + "n"], [p + "un"]),
                      node("Add", [p + "kh", p + "un"], [p + "new"])]
        else:
            nodes += [node("Sub", ["one", p + "z"], [p + "u"]), node("Mul", [p + "u", p + "n"], [p + "un"]),
                      node("Mul", [p + "z", h], [p + "zh"]), node("Add", [p + "un", p + "zh"], [p + "new"])]
        out = "h_last" if t == T - 1 else p + "h"
        if masked and blend:
            nodes += [node("Gather", ["M" if blend == "cast" else "mask", f"t{t}"], [p + "m"], axis=1),
                      node("Mul", [p + "m", p + "new"], [p + "mn"]), node("Sub", ["one", p + "m"], [p + "km"]),
                      node("Mul", [h, p + "km"], [p + "kmh"]), node("Add", [p + "mn", p + "kmh"], [out])]
        elif masked:
            nodes.append(node("Slice", ["mask", f"s{t}", f"e{t}", "ax1"], [p + "m"]))
            if inverted:  # the mask marks the padding: Where(m, h, new)
                nodes.append(node("Where", [p + "m", h, p + "new"], [out]))
            else:
                nodes.append(node("Where", [p + "m", p + "new", h], [out]))
        else:
            nodes.append(node("Identity", [p + "new"], [out]))
        if stacked:
            nodes.append(node("Unsqueeze", [out, "ax1"], [p + "y"]))
        h = out
    outputs = [vi("h_last", F, ["batch", H])]
    if stacked:
        nodes.append(node("Concat", [f"c{t}_y" for t in range(T)], ["Y"], axis=1))
        outputs.insert(0, vi("Y", F, ["batch", T, H]))
    return make_model(nodes, inputs, outputs, inits)


def cell_feeds(model, T=5, I=3, H=4):
    feeds = {"X": RNG.normal(size=(5, T, I)).astype(np.float32)}
    names = [i.name for i in model.graph.input]
    if "mask" in names:
        lens = np.array([0, T, 2, 1, 3])
        mask = np.arange(T)[None, :] < lens[:, None]
        mask[4] = [True, False, True, True, False][:T]  # not a prefix: Where keeps the state wherever it is off
        feeds["mask"] = mask
    if "h0" in names:
        feeds["h0"] = RNG.normal(size=(5, H)).astype(np.float32)
    if "att" in names:
        feeds["att"] = RNG.uniform(0, 1, size=(5, T)).astype(np.float32)
    return feeds


@pytest.mark.parametrize("masked, stacked, h0_input", [(True, True, True), (False, True, False),
                                                        (True, False, False), (False, False, True)])
def test_unrolled_cell_becomes_one_sequence_node(masked, stacked, h0_input):
    model = unrolled_cell_model(masked=masked, stacked=stacked, h0_input=h0_input)
    fused, done = fuse(model)
    assert len(done) == 1 and "unrolled over 5 steps" in done[0]
    assert ops(fused) == ["GRUSequence"]
    (seq,) = sequence_nodes(fused)
    assert (_s(seq["kind"]), seq["linear_before_reset"], _s(seq["padded_output"])) == (
        "GRU", 1, "state" if masked else "zero")
    assert seq["inputs"]["X"] == "X" and seq["inputs"]["mask"] == ("mask" if masked else "")
    assert seq["inputs"]["initial_h"] == ("h0" if h0_input else "")
    feeds = cell_feeds(model)
    assert_close(Runner(model).run(feeds), Runner(fused).run(feeds))
    assert_idempotent(fused)


@pytest.mark.parametrize("kind", ["AUGRU", "AIGRU"])
def test_unrolled_attention_cells(kind):
    model = unrolled_cell_model(kind=kind, inverted=kind == "AIGRU")
    fused, done = fuse(model)
    assert len(done) == 1 and f"{kind} cell" in done[0]
    assert sorted(ops(fused)) == [f"{kind}Sequence"] + (["Not"] if kind == "AIGRU" else [])
    (seq,) = sequence_nodes(fused)
    assert (_s(seq["kind"]), seq["att_keep"], _s(seq["padded_output"])) == (kind, 0, "state")
    assert seq["inputs"]["att"] == "att" and seq["inputs"]["X"] == "X"
    feeds = cell_feeds(model)
    assert_close(Runner(model).run(feeds), Runner(fused).run(feeds))
    assert_idempotent(fused)


def test_unrolled_cells_with_a_blend_mask():
    """FuxiCTR's DIEN (torch): the state kept by m_t * new + (1 - m_t) * s with m the bool mask cast to float
    [B, T, 1], the [B] attention step unsqueezed in the cell → one AUGRUSequence with that mask."""
    model = unrolled_cell_model(kind="AUGRU", blend="cast", stacked=False, h0_input=False)
    fused, done = fuse(model)
    assert len(done) == 1 and "AUGRU cell unrolled over 5 steps" in done[0] and "blend mask → mask" in done[0]
    assert sorted(ops(fused)) == ["AUGRUSequence", "Cast", "Squeeze", "Unsqueeze"]
    (seq,) = sequence_nodes(fused)
    assert (_s(seq["kind"]), seq["att_keep"], _s(seq["padded_output"])) == ("AUGRU", 0, "state")
    assert seq["inputs"]["att"] == "att" and seq["inputs"]["X"] == "X" and seq["inputs"]["mask"]
    feeds = cell_feeds(model)  # rows of length 0, 1, 2, 5 and one masked in the middle
    assert_close(Runner(model).run(feeds), Runner(fused).run(feeds))
    assert_idempotent(fused)


def test_a_blend_with_a_mask_that_may_not_be_0_or_1_stays():
    model = unrolled_cell_model(kind="AUGRU", blend="float", stacked=False)
    notes = []
    graph = to_graph(model)
    assert fuse_unrolled_cells(graph, onnx_opset(model), notes=notes) == []
    assert any("nor a 0/1 one" in n for n in notes), notes


def test_steps_with_other_weights_are_not_one_chain():
    model = unrolled_cell_model(tamper_step=3)
    fused, done = fuse(model)
    assert done == [] and sorted(ops(fused)) == sorted(ops(model))


def paddle_cell_model(T=5, I=3, H=4, back_to_batch_major=True, extra_reader=False):
    """paddle.nn.GRUCell in a Python loop as paddle2onnx writes it: the sequence transposed time-major, x_t =
    Squeeze(Slice(Xt, t, t+1, axis 0)), one MatMul + Add per side split into paddle's gate order (r, z, c),
    h' = (h - c) * z + c, h0 = Expand(0, [batch of x_0, H]), states stacked by one Concat(axis 0) per step grown
    from an empty [0, B, H] tensor, transposed back; the last state sliced off that stack."""
    Wx = RNG.normal(size=(I, 3 * H)).astype(np.float32) * 0.6
    Wh = RNG.normal(size=(H, 3 * H)).astype(np.float32) * 0.6
    bx, bh = (RNG.normal(size=3 * H).astype(np.float32) * 0.2 for _ in range(2))
    inits = [init("Wx", Wx), init("Wh", Wh), init("bx", bx), init("bh", bh), init("zero", np.zeros(1, np.float32)),
             init("split", np.array([H, H, H])), init("ax0", np.array([0])), init("ax1", np.array([1])),
             init("hdim", np.array([H])), init("last", np.array([-1])), init("end", np.array([2 ** 31 - 1]))]
    nodes = [node("Transpose", ["X"], ["Xt"], perm=[1, 0, 2])]
    for t in range(T):
        inits += [init(f"s{t}", np.array([t])), init(f"e{t}", np.array([t + 1]))]
        p = f"c{t}_"
        nodes += [node("Slice", ["Xt", f"s{t}", f"e{t}", "ax0", "ax1"], [p + "x1"]),
                  node("Squeeze", [p + "x1", "ax0"], [p + "x"])]
        if t == 0:
            nodes += [node("Shape", ["c0_x"], ["shp"]), node("Slice", ["shp", "ax0", "ax1", "ax0"], ["bdim"]),
                      node("Concat", ["bdim", "hdim"], ["hshape"], axis=0), node("Expand", ["zero", "hshape"], ["h0"]),
                      node("Concat", ["ax0", "bdim", "hdim"], ["eshape"], axis=0),
                      node("Expand", ["zero", "eshape"], ["stack_"])]
        h, prev = ("h0", "stack_") if t == 0 else (f"c{t - 1}_h", f"c{t - 1}_stack")
        nodes += [node("MatMul", [p + "x", "Wx"], [p + "mx"]), node("Add", [p + "mx", "bx"], [p + "gx"]),
                  node("MatMul", [h, "Wh"], [p + "mh"]), node("Add", [p + "mh", "bh"], [p + "gh"]),
                  helper.make_node("Split", [p + "gx", "split"], [p + "xr", p + "xz", p + "xc"], axis=1),
                  helper.make_node("Split", [p + "gh", "split"], [p + "hr", p + "hz", p + "hc"], axis=1),
                  node("Add", [p + "xr", p + "hr"], [p + "ar"]), node("Sigmoid", [p + "ar"], [p + "r"]),
                  node("Add", [p + "xz", p + "hz"], [p + "az"]), node("Sigmoid", [p + "az"], [p + "z"]),
                  node("Mul", [p + "r", p + "hc"], [p + "rh"]), node("Add", [p + "xc", p + "rh"], [p + "ac"]),
                  node("Tanh", [p + "ac"], [p + "c"]), node("Sub", [h, p + "c"], [p + "d"]),
                  node("Mul", [p + "d", p + "z"], [p + "dz"]), node("Add", [p + "dz", p + "c"], [p + "h"]),
                  node("Unsqueeze", [p + "h", "ax0"], [p + "u"]),
                  node("Concat", [prev, p + "u"], [p + "stack"], axis=0)]
    stack = f"c{T - 1}_stack"
    outputs = [vi("h_last", F, ["batch", H])]
    if back_to_batch_major:
        nodes += [node("Transpose", [stack], ["Y"], perm=[1, 0, 2]),
                  node("Slice", ["Y", "last", "end", "ax1", "ax1"], ["Yl"]), node("Squeeze", ["Yl", "ax1"], ["h_last"])]
        outputs.insert(0, vi("Y", F, ["batch", T, H]))
    else:
        nodes += [node("Gather", [stack, init("tl", np.array(T - 1)).name], ["h_last"], axis=0)]
        inits.append(init("tl", np.array(T - 1)))
        outputs.insert(0, vi(stack, F, [T, "batch", H]))
    if extra_reader:  # a step's gate read outside the chain: the chain is left, with the reason in the notes
        outputs.append(vi("c2_z", F, ["batch", H]))
    return make_model(nodes, [vi("X", F, ["batch", T, I])], outputs, inits, opset=13)


@pytest.mark.parametrize("back_to_batch_major", [True, False])
def test_paddle_time_major_cell_becomes_one_sequence_node(back_to_batch_major):
    model = paddle_cell_model(back_to_batch_major=back_to_batch_major)
    fused, done = fuse(model)
    assert len(done) == 1 and "GRU cell unrolled over 5 steps" in done[0]
    assert [o for o in ops(fused) if o in ("GRUSequence", "Tanh", "Sigmoid", "Split", "MatMul")] == ["GRUSequence"]
    if back_to_batch_major:  # the stack's Transpose back is the node's Y; the last state is still sliced off it
        assert sorted(ops(fused)) == ["GRUSequence", "Slice", "Squeeze"]
    (seq,) = sequence_nodes(fused)
    assert (_s(seq["kind"]), seq["linear_before_reset"], _s(seq["padded_output"])) == ("GRU", 1, "zero")
    assert seq["inputs"]["X"] == "X" and seq["inputs"]["initial_h"] == ""
    feeds = {"X": RNG.normal(size=(6, 5, 3)).astype(np.float32)}
    assert_close(Runner(model).run(feeds), Runner(fused).run(feeds))
    assert_idempotent(fused)


def test_chain_left_as_is_says_why():
    model = paddle_cell_model(extra_reader=True)
    graph, notes = to_graph(model), []
    assert fuse_unrolled_cells(graph, 13, notes=notes) == []
    assert len(notes) == 1 and "unrolled over 5 steps" in notes[0] and "reads the chain other than" in notes[0]


def selected_rows_augru_model(T=4, I=3, H=4, unsqueezed=True):
    """torch-rechub's DIEN AUGRU as the legacy exporter writes it: the rows with a history are selected first
    (NonZero(keep) → GatherND), so every step reads a Gather of [N, T, I] (x_t) and of [N, T, 1] (a_t, the
    attention unsqueezed) with N data-dependent; a MatMul per gate and operand (u, r, candidate: six weights, three
    biases), no mask in the recurrence; the last state is written back into zeros [B, H] with ScatterND.
    unsqueezed=False: the attention is a [B, T, 1] input, its rows gathered as they are."""
    w = {k: RNG.normal(size=(I if k[0] == "W" else H, H)).astype(np.float32) * 0.6
         for k in ("Wu", "Uu", "Wr", "Ur", "Wh", "Uh")}
    inits = [init(k, v) for k, v in w.items()] + [
        init(f"b{g}", RNG.normal(size=H).astype(np.float32) * 0.2) for g in "urh"] + [
        init("one", np.float32(1.0)), init("ax_last", np.array([-1])), init("hdim", np.array([H])),
        init("zero_f", np.zeros(1, np.float32))]
    inputs = [vi("X", F, ["batch", T, I]), vi("att", F, ["batch", T] + ([] if unsqueezed else [1])),
              vi("keep", TensorProto.BOOL, ["batch"])]
    nodes = [node("NonZero", ["keep"], ["nz"]), node("Transpose", ["nz"], ["idx"], perm=[1, 0]),
             node("GatherND", ["X", "idx"], ["Xs"]), node("GatherND", ["att", "idx"], ["As"]),
             node("Unsqueeze" if unsqueezed else "Identity", ["As", "ax_last"][:2 if unsqueezed else 1], ["A3"]),
             node("Shape", ["Xs"], ["n"], start=0, end=1), node("Concat", ["n", "hdim"], ["nh"], axis=0),
             node("ConstantOfShape", ["nh"], ["h0"])]
    h = "h0"
    for t in range(T):
        inits.append(init(f"t{t}", np.array(t)))
        p = f"c{t}_"
        nodes += [node("Gather", ["Xs", f"t{t}"], [p + "x"], axis=1),
                  node("Gather", ["A3", f"t{t}"], [p + "a"], axis=1)]
        for g in "ur":
            nodes += [node("MatMul", [p + "x", f"W{g}"], [p + g + "x"]), node("MatMul", [h, f"U{g}"], [p + g + "h"]),
                      node("Add", [p + g + "x", p + g + "h"], [p + g + "s"]),
                      node("Add", [p + g + "s", f"b{g}"], [p + g + "b"]), node("Sigmoid", [p + g + "b"], [p + g])]
        nodes += [node("MatMul", [p + "x", "Wh"], [p + "hx"]), node("MatMul", [h, "Uh"], [p + "hh"]),
                  node("Mul", [p + "r", p + "hh"], [p + "q"]), node("Add", [p + "hx", p + "q"], [p + "hs"]),
                  node("Add", [p + "hs", "bh"], [p + "hb"]), node("Tanh", [p + "hb"], [p + "n"]),
                  node("Mul", [p + "a", p + "u"], [p + "ua"]), node("Sub", ["one", p + "ua"], [p + "k"]),
                  node("Mul", [p + "k", h], [p + "kh"]), node("Mul", [p + "ua", p + "n"], [p + "un"]),
                  node("Add", [p + "kh", p + "un"], [p + "new"])]
        h = p + "new"
    nodes += [node("Shape", ["X"], ["b"], start=0, end=1), node("Concat", ["b", "hdim"], ["bh_shape"], axis=0),
              node("Expand", ["zero_f", "bh_shape"], ["zeros"]), node("ScatterND", ["zeros", "idx", h], ["out"])]
    return make_model(nodes, inputs, [vi("out", F, ["batch", H])], inits)


@pytest.mark.parametrize("unsqueezed", [True, False])
def test_augru_over_selected_rows_with_a_weight_per_gate(unsqueezed):
    """torch-rechub's DIEN: the steps slice sequences of the N selected rows (not the batch), the gates have a
    weight each: one AUGRUSequence over the selected [N, T, I] sequence and [N, T] attention, packed weights."""
    model = selected_rows_augru_model(unsqueezed=unsqueezed)
    fused, done = fuse(model)
    assert len(done) == 1 and "AUGRU cell unrolled over 4 steps" in done[0], done
    assert not {"Tanh", "Sigmoid", "MatMul"} & set(ops(fused))
    att_glue = [] if unsqueezed else ["Identity", "Squeeze"]  # [N, T] read before its Unsqueeze, else squeezed
    assert sorted(ops(fused)) == sorted(["NonZero", "Transpose", "GatherND", "GatherND", "AUGRUSequence", "Shape",
                                         "Concat", "Expand", "ScatterND"] + att_glue)
    (seq,) = sequence_nodes(fused)
    assert (_s(seq["kind"]), seq["att_keep"], _s(seq["padded_output"])) == ("AUGRU", 0, "zero")
    assert seq["inputs"]["X"] == "Xs" and not seq["inputs"]["mask"] and not seq["inputs"]["initial_h"]
    assert seq["inputs"]["att"] == "As" or not unsqueezed
    raw, new = Runner(model), Runner(fused)
    for keep in ([True, False, True, True, False], [False] * 3, [True] * 2):
        feeds = {"X": RNG.normal(size=(len(keep), 4, 3)).astype(np.float32),
                 "att": RNG.uniform(0, 1, size=(len(keep), 4) + (() if unsqueezed else (1,))).astype(np.float32),
                 "keep": np.array(keep)}
        assert_close(raw.run(feeds), new.run(feeds))
    assert_idempotent(fused)


# ----------------------------------------------------------------------------------------- exporters' models


def length_edited(name: str, feeds: dict) -> dict:
    """The stored feeds with history lengths set to 0 (empty), T (full), 1 and partial, padding ids zeroed."""
    feeds = {k: v.copy() for k, v in feeds.items()}
    if "X" in feeds:  # deepctr-torch: one float matrix, seq_length in column 17, histories in 7..16 and 18..27
        X = feeds["X"]
        lens = np.resize([0, 10, 1, 4, 10, 0, 7, 2], len(X))  # pack_padded_sequence (GRU_legacy) drops the
        X[:, 17] = lens                                          # empty rows: its GRUs run over fewer rows
        for cols in (slice(7, 17), slice(18, 28)):
            block = X[:, cols]
            block[np.arange(10)[None, :] >= lens[:, None]] = 0
        return feeds
    if "seq_length" in feeds:  # DeepCTR via tf2onnx: seq_length [B, 1]
        lens = np.resize([0, 10, 1, 4, 10, 0, 7, 2], len(feeds["seq_length"]))
        feeds["seq_length"] = lens.reshape(-1, 1).astype(feeds["seq_length"].dtype)
        for k in ("hist_item_id", "hist_cate_id"):
            feeds[k][np.arange(10)[None, :] >= lens[:, None]] = 0
        return feeds
    lens = np.resize([0, 100, 1, 37, 100, 0, 64, 2], len(feeds["hist_len"]))  # the zoo's dien_torch
    feeds["hist_len"] = lens.astype(feeds["hist_len"].dtype)
    for k in ("hist_item_id", "hist_cate_id"):
        feeds[k][np.arange(100)[None, :] >= lens[:, None]] = 0
    return feeds


def check_export(path: Path, expected_kinds: list[tuple], sigmoids: int):
    model = load(path)
    fused, done = fuse(model)
    assert len(done) == len(expected_kinds), done
    assert kinds(fused) == sorted(expected_kinds)
    names = ops(fused)
    assert "GRU" not in names and "Tanh" not in names and names.count("Sigmoid") == sigmoids
    assert len(fused.graph.node) < len(model.graph.node)
    with np.load(path.with_suffix(".npz")) as data, np.load(str(path).replace(".onnx", ".ref.npz")) as ref:
        feeds, refs = {k: data[k] for k in data.files}, {k: ref[k] for k in ref.files}
    raw, new = Runner(model), Runner(fused)
    assert_close(refs, new.run(feeds))
    edited = length_edited(path.name, feeds)
    assert_close(raw.run(edited), new.run(edited))
    assert_idempotent(fused)
    return fused, done


GRU = ("GRU", 1, 0, "zero")
TF_GRU = ("GRU", 0, 0, "zero")


@pytest.mark.parametrize("name, expected", [
    ("deepctr_torch_DIEN_GRU_legacy", [GRU, GRU]),            # pack_padded_sequence: sequence_lens
    ("deepctr_torch_DIEN_GRU_padded_legacy", [GRU, GRU]),
    ("deepctr_torch_DIEN_GRU_padded_dynamo", [GRU, GRU]),
    ("deepctr_torch_DIEN_AIGRU_padded_legacy", [GRU, GRU]),   # AIGRU = a GRU op over keys * att
    ("deepctr_torch_DIEN_AIGRU_padded_dynamo", [GRU, GRU]),
    ("deepctr_torch_DIEN_AUGRU_padded_legacy", [GRU, ("AUGRU", 1, 0, "state")]),
    ("deepctr_torch_DIEN_AUGRU_padded_dynamo", [GRU, ("AUGRU", 1, 0, "state")]),
    ("deepctr_torch_DIEN_AGRU_padded_legacy", [GRU, ("AGRU", 1, 0, "state")]),
    ("deepctr_torch_DIEN_AGRU_padded_dynamo", [GRU, ("AGRU", 1, 0, "state")]),
    ("deepctr_DIEN_GRU_tf2onnx", [TF_GRU, TF_GRU]),             # tf2onnx: GRU ops masked by sequence_lens
    ("deepctr_DIEN_AIGRU_tf2onnx", [TF_GRU, TF_GRU]),
])
def test_third_party_dien(name, expected):
    fused, done = check_export(DATA / f"{name}.onnx", expected, sigmoids=1 if "torch" in name else 3)
    seqs = sequence_nodes(fused)
    if "tf2onnx" in name or name.endswith("GRU_legacy"):
        assert all(s["inputs"]["sequence_lens"] for s in seqs)  # the lengths went to sequence_lens
    for s in seqs:
        if _s(s["kind"]) in ("AUGRU", "AGRU"):
            assert s["inputs"]["att"] and s["inputs"]["mask"] and not s["inputs"]["sequence_lens"]


def test_torch_rechub_dien():
    """torch-rechub's DIEN (legacy): per feature, a GRU op over the packed rows with a history and an AUGRU
    unrolled over 30 steps of the rows NonZero → GatherND selected, a weight per gate: four sequence ops."""
    path = DATA / "torch_rechub_DIEN_legacy.onnx"
    model = load(path)
    fused, done = fuse(model)
    assert kinds(fused) == sorted([GRU, GRU, ("AUGRU", 1, 0, "zero"), ("AUGRU", 1, 0, "zero")]), done
    assert "Tanh" not in ops(fused) and len(fused.graph.node) < len(model.graph.node) // 3
    with np.load(path.with_suffix(".npz")) as data, np.load(str(path).replace(".onnx", ".ref.npz")) as ref:
        feeds, refs = {k: data[k] for k in data.files}, {k: ref[k] for k in ref.files}
    assert_close(refs, Runner(fused).run(feeds))
    assert_idempotent(fused)

def test_packed_gru_over_fewer_rows_than_the_batch():
    """pack_padded_sequence: rows sorted by length, empty ones dropped, the GRUs run over B' < B rows and
    ScatterND puts the results back. The fused op's function body once named its batch "batch", the model's
    own dim_param: onnxruntime then took the GRU's 11 rows and the model's 13 for one size and failed
    ("Shape mismatch attempting to re-use buffer"), and fuse-rnn was rolled back."""
    import ctropt
    from ctropt.runtime import generate_inputs

    model = load(DATA / "deepctr_torch_DIEN_GRU_legacy.onnx")
    feeds = generate_inputs(model)
    assert len(feeds["X"]) == 13 and (feeds["X"][:, 17] == 0).sum() >= 1  # the history length is column 17
    fused, done = fuse(model)
    assert len(done) == 2 and kinds(fused) == [GRU, GRU]
    assert_close(Runner(model).run(feeds), Runner(fused).run(feeds), atol=1e-5)
    # no named dim inside the op's function body: nothing there may alias a dim of the model
    for f in fused.functions:
        for g in iter_proto_graphs_of(f):
            for v in list(g.input) + list(g.output) + list(g.value_info):
                assert not any(d.dim_param for d in v.type.tensor_type.shape.dim), (f.name, v.name)
    records = {r.name: r for r in ctropt.optimize(model, speed=False).records}
    assert records["fuse-rnn"].status == "applied", records["fuse-rnn"].message


def iter_proto_graphs_of(function):
    """The subgraphs (Scan/Loop/If bodies, nested) of a FunctionProto's nodes."""
    stack = list(function.node)
    while stack:
        n = stack.pop()
        for a in n.attribute:
            subs = [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)
            for g in subs:
                yield g
                stack.extend(g.node)


def test_zoo_dien_torch():
    """nn.GRU (GRU op) + an AUGRUCell unrolled over 100 steps, masked past the length with Where: 6258 nodes."""
    fused, done = check_export(ZOO / "dien_torch.onnx", [GRU, ("AUGRU", 1, 0, "state")], sigmoids=3)
    assert "100 steps" in done[1]
    assert len(fused.graph.node) < 60
    augru = next(s for s in sequence_nodes(fused) if _s(s["kind"]) == "AUGRU")
    gru = next(s for s in sequence_nodes(fused) if _s(s["kind"]) == "GRU")
    assert augru["inputs"]["X"] == gru["node"].output[0]  # the interest extractor's Y feeds the evolution as is
    assert not augru["inputs"]["initial_h"]  # torch.zeros_like: the op's own zero state


# ----------------------------------------------------------------------------------------- torch exporters


@pytest.mark.parametrize("exporter, stack", [("legacy", "stack"), ("dynamo", "cat")])
def test_torch_gru_cell_loop_with_stacked_states(exporter, stack):
    """nn.GRUCell over the steps of a Python loop, kept past each row's length with torch.where, the states
    stacked (torch.stack / torch.cat of unsqueezed) and the last one returned: Y and Y_h of one GRUSequence."""
    torch = pytest.importorskip("torch")
    import io

    class Loop(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.cell = torch.nn.GRUCell(3, 4)

        def forward(self, x, lens):
            h = torch.zeros(x.shape[0], 4)
            mask = torch.arange(x.shape[1]).unsqueeze(0) < lens.unsqueeze(1)
            outs = []
            for t in range(x.shape[1]):
                h = torch.where(mask[:, t:t + 1], self.cell(x[:, t], h), h)
                outs.append(h)
            y = torch.stack(outs, 1) if stack == "stack" else torch.cat([o.unsqueeze(1) for o in outs], 1)
            return y, h

    module = Loop().eval()
    x, lens = torch.randn(5, 6, 3), torch.tensor([0, 6, 2, 1, 4])
    if exporter == "legacy":
        f = io.BytesIO()
        torch.onnx.export(module, (x, lens), f, dynamo=False, opset_version=17, input_names=["x", "lens"],
                          output_names=["y", "h"], dynamic_axes={"x": {0: "b"}, "lens": {0: "b"}})
        model = onnx.load_from_string(f.getvalue())
    else:
        batch = torch.export.Dim("batch", min=2)
        model = torch.onnx.export(module, (x, lens), dynamo=True, opset_version=18, input_names=["x", "lens"],
                                  output_names=["y", "h"], dynamic_shapes=({0: batch}, {0: batch}),
                                  verbose=False).model_proto
    fused, done = fuse(model)
    assert len(done) == 1 and "Y and Y_h" in done[0]
    assert kinds(fused) == [("GRU", 1, 0, "state")]
    assert "Tanh" not in ops(fused) and "Sigmoid" not in ops(fused)
    feeds = {"x": x.numpy(), "lens": lens.numpy()}
    with torch.no_grad():
        y, h = module(x, lens)
    assert_close({"y": y.numpy(), "h": h.numpy()}, Runner(fused).run(feeds))
    assert_idempotent(fused)
