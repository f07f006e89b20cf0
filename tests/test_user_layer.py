"""--user-inputs: the first FC layer over user and item features split into x_u·W_u + x_i·W_i, in the dialects of
PaddleRec (per-feature lookups reshaped to [B, E], concatenated with the dense values), FuxiCTR (torch.stack of
[B, E] embeddings, flattened, Gemm with transB), deepctr (Concat of [B, 1, E] lookups, Flatten, Concat with the
dense values) and tf2onnx (lookups joined on their last axis, Tensordot's Reshape to the shape it has); then dedup-user-side runs the user part once per distinct user; the facts, the generated one-user
inputs and the CLI."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from helpers import F, I64, assert_same_outputs, init, make_model, node, ops, run_pass, vi
from typer.testing import CliRunner

import ctropt
from ctropt.cli import app
from ctropt.graph import annotate_shapes, save, to_graph, to_model
from ctropt.passes.dense.user_layer import layer_parts, split_user_layers
from ctropt.runtime import generate_inputs
from ctropt.runtime.inputs import stored_input_facts

RNG = np.random.default_rng(11)
E, H, ROWS = 4, 16, 30
USERS, ITEMS = ["u0", "u1"], ["i0", "i1"]


def _tables():
    return [init(f"t_{n}", RNG.normal(size=(ROWS, E)).astype(np.float32)) for n in USERS + ITEMS]


def paddle_form():
    """[B, 1] ids → Gather [B, 1, E] → Reshape [B, E]; Concat(1) with dense [B, 3] → MatMul → Add → Relu."""
    nodes = []
    for n in USERS + ITEMS:
        nodes += [node("Gather", [f"t_{n}", n], [f"e_{n}"]), node("Reshape", [f"e_{n}", "flat"], [f"r_{n}"])]
    nodes += [node("Concat", [f"r_{n}" for n in ["u0", "i0", "u1", "i1"]] + ["dense"], ["x"], axis=1),
              node("MatMul", ["x", "w"], ["h"]), node("Add", ["h", "b"], ["hb"]), node("Relu", ["hb"], ["y"])]
    inputs = [vi(n, I64, ["B", 1]) for n in USERS + ITEMS] + [vi("dense", F, ["B", 3])]
    return make_model(nodes, inputs, [vi("y", F, ["B", H])],
                      _tables() + [init("flat", np.array([-1, E])), init("w", RNG.normal(size=(4 * E + 3, H)).astype(np.float32)),
                                   init("b", RNG.normal(size=H).astype(np.float32))])


def fuxictr_form():
    """[B] ids → Gather [B, E] → Unsqueeze(1) → Concat(1) [B, 4, E] → Reshape [B, 4E] → Gemm(transB, bias)."""
    nodes = []
    for n in USERS + ITEMS:
        nodes += [node("Gather", [f"t_{n}", n], [f"e_{n}"]), node("Unsqueeze", [f"e_{n}", "ax1"], [f"s_{n}"])]
    nodes += [node("Concat", [f"s_{n}" for n in ["i0", "u0", "i1", "u1"]], ["stack"], axis=1),
              node("Reshape", ["stack", "flat"], ["x"]),
              node("Gemm", ["x", "w", "b"], ["y"], transB=1)]
    inputs = [vi(n, I64, ["B"]) for n in USERS + ITEMS]
    return make_model(nodes, inputs, [vi("y", F, ["B", H])],
                      _tables() + [init("ax1", np.array([1])), init("flat", np.array([-1, 4 * E])),
                                   init("w", RNG.normal(size=(H, 4 * E)).astype(np.float32)),
                                   init("b", RNG.normal(size=H).astype(np.float32))])


def deepctr_form():
    """[B, 1] ids → Gather [B, 1, E] → Concat(1) [B, 4, E] → Flatten → Concat(-1) with dense → MatMul."""
    nodes = [node("Gather", [f"t_{n}", n], [f"e_{n}"]) for n in USERS + ITEMS]
    nodes += [node("Concat", [f"e_{n}" for n in USERS + ITEMS], ["emb"], axis=1), node("Flatten", ["emb"], ["flat"], axis=1),
              node("Concat", ["flat", "dense"], ["x"], axis=-1), node("MatMul", ["x", "w"], ["y"])]
    inputs = [vi(n, I64, ["B", 1]) for n in USERS + ITEMS] + [vi("dense", F, ["B", 2])]
    return make_model(nodes, inputs, [vi("y", F, ["B", H])],
                      _tables() + [init("w", RNG.normal(size=(4 * E + 2, H)).astype(np.float32))])


def tf2onnx_form():
    """deepctr through tf2onnx: [B, 1, E] lookups → Concat(2) [B, 1, 4E] → Reshape [B, 4E] → Concat(1) with dense →
    Tensordot's Reshape to the shape it has → MatMul."""
    nodes = [node("Gather", [f"t_{n}", n], [f"e_{n}"]) for n in USERS + ITEMS]
    nodes += [node("Concat", [f"e_{n}" for n in ["u0", "i0", "i1", "u1"]], ["emb"], axis=2),
              node("Reshape", ["emb", "flat"], ["embf"]), node("Concat", ["embf", "dense"], ["x"], axis=1),
              node("Reshape", ["x", "same"], ["xr"]), node("MatMul", ["xr", "w"], ["y"])]
    inputs = [vi(n, I64, ["B", 1]) for n in USERS + ITEMS] + [vi("dense", F, ["B", 2])]
    return make_model(nodes, inputs, [vi("y", F, ["B", H])],
                      _tables() + [init("flat", np.array([-1, 4 * E])), init("same", np.array([-1, 4 * E + 2])),
                                   init("w", RNG.normal(size=(4 * E + 2, H)).astype(np.float32))])


def _split(model, named=("u0", "u1")):
    graph = to_graph(model)
    annotate_shapes(graph)
    done = len(split_user_layers(graph, set(named)))
    graph.cleanup()
    return done, to_model(graph, like=model)


def _one_user_feeds(model, batch=6, users=("u0", "u1")):
    return generate_inputs(model, batch=batch, one_user=True, user_inputs=list(users))


@pytest.mark.parametrize("build,parts", [(paddle_form, 5), (fuxictr_form, 4), (deepctr_form, 5), (tf2onnx_form, 5)])
def test_the_first_layer_splits_into_user_and_item_parts(build, parts):
    model = build()
    graph = to_graph(model)
    annotate_shapes(graph)
    layer = next(n for n in graph.nodes if n.op in ("MatMul", "Gemm"))
    assert len(layer_parts(layer.inputs[0])) == parts
    done, once = _split(model)
    assert done == 1
    layers = [n for n in once.graph.node if n.op_type in ("MatMul", "Gemm")]
    item, user = layers[1], layers[0]   # the item GEMM adds the user half (and the bias, if any) as its C
    assert len(layers) == 2 and item.op_type == "Gemm" and item.input[2] == user.output[0] and "Add" not in ops(once)
    assert len(user.input) == (3 if build in (paddle_form, fuxictr_form) else 2)
    for feeds in (generate_inputs(model, batch=7), _one_user_feeds(model)):
        assert_same_outputs(model, once, feeds, atol=1e-5, rtol=1e-5)
    again, twice = _split(once)
    assert again == 0 and sorted(ops(twice)) == sorted(ops(once))


@pytest.mark.parametrize("opset,bias,alpha", [(9, True, 1.5), (11, False, 0.5), (17, False, 2.0)])
def test_a_gemm_splits_valid_in_its_opset(opset, bias, alpha):
    """Before opset 11 Gemm's C is required: the item half's C is the user half (a Gemm with the layer's bias and
    beta, or a MatMul by alpha·W_u without one)."""
    model = fuxictr_form()
    gemm = model.graph.node[-1]
    gemm.attribute.append(onnx.helper.make_attribute("alpha", alpha))
    if not bias:
        del gemm.input[2]
    model.opset_import[0].version = opset
    if opset < 13:   # Unsqueeze's axes an attribute
        for n in model.graph.node:
            if n.op_type == "Unsqueeze":
                del n.input[1]
                n.attribute.append(onnx.helper.make_attribute("axes", [1]))
    done, once = _split(model)
    assert done == 1 and onnx.checker.check_model(once, full_check=True) is None
    assert_same_outputs(model, once, _one_user_feeds(model), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("named", [(), ("u0", "u1", "i0", "i1", "dense")])
def test_a_layer_with_no_user_part_or_only_user_parts_stays(named):
    done, once = _split(paddle_form(), named)
    assert done == 0 and ops(once).count("MatMul") == 1


def test_dedup_runs_the_user_part_once_per_distinct_user():
    model = paddle_form()
    once, ctx = run_pass(model, "dedup-user-side", user_inputs="u0,u1")
    assert ctx.rewrites == 1 and "Unique" in ops(once), ctx.notes
    assert any("split into a user part" in n for n in ctx.notes), ctx.notes
    for feeds in (generate_inputs(model, batch=9), _one_user_feeds(model, batch=9)):
        assert_same_outputs(model, once, feeds, atol=1e-5, rtol=1e-5)
    plain, ctx = run_pass(model, "dedup-user-side")   # no user inputs named: nothing to split
    assert ctx.rewrites == 0 and sorted(ops(plain)) == sorted(ops(model))


def test_unknown_user_inputs_are_an_error():
    with pytest.raises(ctropt.CtroptError, match="nope, which the model has not as inputs"):
        ctropt.optimize(paddle_form(), speed=False, options={"user_inputs": "u0,nope"})


def test_one_user_inputs_repeat_row_0_of_the_user_inputs_only():
    feeds = _one_user_feeds(paddle_form(), batch=8)
    for n in USERS:
        assert (feeds[n] == feeds[n][0]).all()
    assert len(np.unique(feeds["i0"])) > 1


def test_cli_stores_the_user_inputs_and_bench_one_user_reads_them(tmp_path):
    src = save(paddle_form(), tmp_path / "m.onnx")
    out = tmp_path / "m.opt.onnx"
    r = CliRunner().invoke(app, ["optimize", str(src), "-o", str(out), "--user-inputs", "u0,u1"], catch_exceptions=False)
    text = " ".join(r.output.split())
    assert r.exit_code == 0 and "one user × 256 candidates" in text, r.output
    assert {k for k, f in stored_input_facts(ctropt.load(out)).items() if f.is_user} == {"u0", "u1"}
    r = CliRunner().invoke(app, ["bench", str(src), str(out), "--one-user", "--batch", "16", "--seconds", "0.1"],
                           catch_exceptions=False)
    assert r.exit_code == 0 and ("B is" in r.output or "A is" in r.output), r.output
    r = CliRunner().invoke(app, ["optimize", str(src), "-o", str(tmp_path / "x.onnx"), "--user-inputs", "zz"])
    assert r.exit_code == 2 and "zz, which the model has not as inputs" in " ".join(r.output.split())


def torch_packed_form():
    """deepctr-torch: one float matrix X [B, 5] (user id, item id, user age, item id again, a dense value); each
    sparse column sliced, Cast to int64, looked up; the embeddings and the dense column concatenated → Gemm → Relu."""
    nodes, parts = [], []
    for col, table in ((0, "t_u0"), (1, "t_i0"), (2, "t_u1"), (3, "t_i1")):
        nodes += [node("Slice", ["X", f"c{col}", f"c{col + 1}", "ax1"], [f"s{col}"]),
                  node("Cast", [f"s{col}"], [f"ids{col}"], to=onnx.TensorProto.INT64),
                  node("Gather", [table, f"ids{col}"], [f"e{col}"]), node("Reshape", [f"e{col}", "flat"], [f"r{col}"])]
        parts.append(f"r{col}")
    nodes += [node("Slice", ["X", "c4", "c5", "ax1"], ["dense"]), node("Concat", parts + ["dense"], ["x"], axis=1),
              node("Gemm", ["x", "w", "b"], ["h"]), node("Relu", ["h"], ["y"])]
    inits = _tables() + [init(f"c{i}", np.array([i])) for i in range(6)] + [
        init("ax1", np.array([1])), init("flat", np.array([-1, E])),
        init("w", RNG.normal(size=(4 * E + 1, H)).astype(np.float32)), init("b", RNG.normal(size=H).astype(np.float32))]
    return make_model(nodes, [vi("X", F, ["batch", 5])], [vi("y", F, ["batch", H])], inits)


def _packed_feeds(batch, one_user):
    x = np.concatenate([RNG.integers(0, ROWS, (batch, 4)), RNG.normal(size=(batch, 1))], 1).astype(np.float32)
    if one_user:
        x[:, [0, 2]] = x[0, [0, 2]]
    return {"X": x}


def test_columns_of_a_packed_input_are_declared_user_side():
    """`X[0],X[2]` (or `X[0:1]`): the slices that read only those columns are the user's; the first layer splits and
    its user part runs once per distinct user (keyed by the float columns' bits: UniqueRowsFloat)."""
    model = torch_packed_form()
    once, ctx = run_pass(model, "dedup-user-side", user_inputs="X[0],X[2:3]")
    assert ctx.rewrites == 1 and "Unique" in ops(once), ctx.notes
    assert any("split into a user part" in n for n in ctx.notes), ctx.notes
    for feeds in (_packed_feeds(9, False), _packed_feeds(9, True)):
        assert_same_outputs(model, once, feeds, atol=1e-5, rtol=1e-5)
    lowered, _ = run_pass(once, "unique-rows-kernel")
    assert "UniqueRowsFloat" in ops(lowered)
    for feeds in (_packed_feeds(9, False), _packed_feeds(9, True)):
        assert_same_outputs(model, lowered, feeds, atol=1e-5, rtol=1e-5)
    feeds = generate_inputs(model, batch=8, one_user=True, user_inputs="X[0],X[2:3]")["X"]
    assert (feeds[:, [0, 2]] == feeds[0, [0, 2]]).all() and len(np.unique(feeds[:, 1])) > 1


@pytest.mark.parametrize("spec,why", [("X[a]", "write a column as NAME"), ("X[3:2]", "write a column as NAME"),
                                      ("Y[0]", "Y, which the model has not as inputs"), ("X[9]", "within its width")])
def test_malformed_or_unknown_columns_are_an_error(spec, why):
    with pytest.raises(ctropt.CtroptError, match=why):
        generate_inputs(torch_packed_form(), batch=4, one_user=True, user_inputs=spec)
