"""The pattern matcher: operand order, alternatives, captures, multi-output, subgraphs, explain, rewrites."""

import numpy as np
from onnx import TensorProto, helper

import ctropt
from ctropt.graph import to_graph, to_model
from ctropt.patterns import Any, Const, P, Rewrite, Var, apply_rewrites, explain, find_matches
from helpers import F, assert_same_outputs, init, make_model, node, ops, vi

W = np.arange(12, dtype=np.float32).reshape(3, 4) / 10
B = np.ones(4, dtype=np.float32)


def fc(add_order=("mm", "b"), relu=True):
    nodes = [node("MatMul", ["x", "w"], ["mm"]), node("Add", list(add_order), ["pre"])]
    if relu:
        nodes.append(node("Relu", ["pre"], ["y"]))
    return make_model(nodes, [vi("x", F, ["B", 3])], [vi("y" if relu else "pre", F, ["B", 4])],
                      [init("w", W), init("b", B)])


FC = P.Relu(P.Add(P.MatMul(Var("x"), Const("w", rank=2)), Const("b")))


def test_matches_like_the_math_and_captures():
    (m,) = find_matches(FC, to_graph(fc()))
    assert m["x"].name == "x" and m["w"].name == "w"
    assert np.array_equal(m.const("w"), W)
    assert [n.op for n in m.nodes] == ["Relu", "Add", "MatMul"]


def test_commutative_operands_in_either_order():
    assert len(find_matches(FC, to_graph(fc(("b", "mm"))))) == 1
    # Sub is not commutative: swapped operands must not match.
    model = make_model([node("Sub", ["b", "x"], ["y"])], [vi("x", F, [4])], [vi("y", F, [4])], [init("b", B)])
    assert not find_matches(P.Sub(Var("x"), Const("b")), to_graph(model))


def test_op_alternatives_and_either():
    g = to_graph(fc(relu=False))
    assert len(find_matches(P.Add(P["Gemm|MatMul"](Var("x"), Var("w")), Var("b")), g)) == 1
    either = P.Gemm(Var("x"), Const("w"), Const("b")) | P.Add(P.MatMul(Var("x"), Const("w")), Const("b"))
    assert len(find_matches(either, g)) == 1


def test_const_predicates_and_attributes():
    g = to_graph(fc())
    assert not find_matches(P.Relu(P.Add(P.MatMul(Var("x"), Const("w", rank=3)), Any())), g)
    assert not find_matches(P.Relu(P.Add(P.MatMul(Var("x"), Const("w", pred=lambda v: v.min() > 0)), Any())), g)
    soft = make_model([node("Softmax", ["x"], ["y"], axis=1)], [vi("x", F, [2, 3])], [vi("y", F, [2, 3])])
    assert find_matches(P.Softmax(Var("x"), axis=1), to_graph(soft))
    assert not find_matches(P.Softmax(Var("x"), axis=-1), to_graph(soft))
    assert find_matches(P.Softmax(Var("x"), axis=lambda a: a in (1, -1)), to_graph(soft))


def test_same_capture_must_bind_the_same_value():
    model = make_model([node("Mul", ["a", "a"], ["y"])], [vi("a", F, [2])], [vi("y", F, [2])])
    assert find_matches(P.Mul(Var("x"), Var("x")), to_graph(model))
    model = make_model([node("Mul", ["a", "b"], ["y"])], [vi("a", F, [2]), vi("b", F, [2])], [vi("y", F, [2])])
    assert not find_matches(P.Mul(Var("x"), Var("x")), to_graph(model))


def test_multi_output_node():
    model = make_model(
        [node("Split", ["x"], ["s0", "s1"], axis=1, num_outputs=2), node("Mul", ["s1", "s0"], ["y"])],
        [vi("x", F, [2, 4])], [vi("y", F, [2, 2])], opset=18)
    split = P.Split(Var("x"), _outputs=2)
    assert len(find_matches(P.Mul(split[0], split[1]), to_graph(model))) == 1  # Mul is commutative
    assert not find_matches(P.Sub(split[0], split[1]), to_graph(model))
    assert not find_matches(P.Mul(split[0], split[0]), to_graph(model))


def test_single_consumer_unless_shared():
    model = make_model(
        [node("MatMul", ["x", "w"], ["mm"]), node("Add", ["mm", "b"], ["y"]), node("Neg", ["mm"], ["z"])],
        [vi("x", F, ["B", 3])], [vi("y", F, ["B", 4]), vi("z", F, ["B", 4])], [init("w", W), init("b", B)])
    g = to_graph(model)
    assert not find_matches(P.Add(P.MatMul(Var("x"), Const("w")), Const("b")), g)
    assert find_matches(P.Add(P.MatMul(Var("x"), Const("w"), _shared=True), Const("b")), g)
    why = explain(P.Add(P.MatMul(Var("x"), Const("w")), Const("b")), g)
    assert not why.matched and "also used by Neg" in why.reason


def loop_model():
    """A Loop whose body multiplies the carried value by an outer-scope weight and adds an outer bias."""
    body = helper.make_graph(
        [node("MatMul", ["h_in", "w"], ["hw"]), node("Add", ["hw", "bias"], ["h_pre"]),
         node("Tanh", ["h_pre"], ["h_out"]), node("Identity", ["cond_in"], ["cond_out"])],
        "body", [vi("i", TensorProto.INT64, []), vi("cond_in", TensorProto.BOOL, []), vi("h_in", F, None)],
        [vi("cond_out", TensorProto.BOOL, []), vi("h_out", F, None)])
    return make_model(
        [node("Relu", ["b0"], ["bias"]), node("Loop", ["n", "", "h0"], ["h"], body=body)],
        [vi("h0", F, ["B", 4]), vi("n", TensorProto.INT64, [])], [vi("h", F, ["B", 4])],
        [init("w", np.eye(4, dtype=np.float32) * 0.5), init("b0", B)])


def test_matches_inside_loop_bodies_with_outer_scope_values():
    g = to_graph(loop_model())
    pattern = P.Tanh(P.Add(P.MatMul(Var("h"), Const("w")), Var("b")))
    (m,) = find_matches(pattern, g)
    assert m.graph is not g and m["b"].name == "bias" and m["w"].name == "w"
    assert np.allclose(m.const("w"), np.eye(4) * 0.5)
    # Nodes of the outer scope never join a match made inside the body.
    assert not find_matches(P.Tanh(P.Add(P.MatMul(Var("h"), Const("w")), P.Relu(Var()))), g)
    assert not find_matches(pattern, g, subgraphs=False)


def test_explain_reports_the_deepest_attempt():
    why = explain(P.Relu(P.Add(P.MatMul(Var("x"), Const("w", rank=3)), Const("b"))), to_graph(fc()))
    assert not why.matched
    assert why.root == "Relu_y" and "MatMul 'MatMul_mm'" in str(why)
    assert "rank 2, wanted 3" in why.reason
    assert "no Softmax node" in str(explain(P.Softmax(Var()), to_graph(fc())))
    assert explain(FC, to_graph(fc())).matched


def fuse_fc_to_gemm(m):
    (y,) = m.op("Gemm", [m["x"], m["w"], m["b"]], dtype=np.float32)
    (r,) = m.op("Relu", [y], dtype=np.float32)
    return [r]


FC_RULE = Rewrite("fc", FC, fuse_fc_to_gemm, lambda m: m["x"].shape is not None and len(m["x"].shape) == 2)


def test_rewrite_keeps_output_names_and_numerics():
    model = fc(("b", "mm"))
    g = to_graph(model)
    matches, rewrites = apply_rewrites(g, [FC_RULE])
    out = to_model(g, like=model)
    assert (matches, rewrites) == (1, 1)
    assert ops(out) == ["Gemm", "Relu"] and out.graph.output[0].name == "y"
    assert_same_outputs(model, out)
    again = to_graph(out)
    assert apply_rewrites(again, [FC_RULE]) == (0, 0)


def test_condition_can_refuse():
    g = to_graph(fc())
    rule = Rewrite("never", FC, fuse_fc_to_gemm, lambda m: "not today")
    assert apply_rewrites(g, [rule]) == (1, 0)


def test_user_pass_through_python_api():
    @ctropt.register_pass("test-fc-to-gemm", group="fusion", description="MatMul+Add+Relu to Gemm+Relu")
    def fc_to_gemm(ctx):
        ctx.apply(FC_RULE)

    try:
        result = ctropt.optimize(fc(), passes=["test-fc-to-gemm"], speed=False)
        assert ops(result.model) == ["Gemm", "Relu"]
        assert result.records[0].rewrites == 1 and result.records[0].max_abs_err is not None
    finally:
        del ctropt.REGISTRY["test-fc-to-gemm"]


def test_in_place_rules_op_prefixes_and_the_main_graph_only():
    """A rule may edit the node it matched and return its outputs as they are (the node stays, nothing moves; the
    condition declines it once done); `Op*` matches every op type that starts so; subgraphs=False keeps a rule
    out of Loop/Scan/If bodies, for matching and explaining alike."""
    model = loop_model()
    g = to_graph(model)

    def halve_weight(m):
        m.root.inputs[1] = m.constant("w_half", m.const("w") * 0.5)
        return list(m.root.outputs)

    rule = Rewrite("halve", P["Mat*"](Var("h"), Const("w")), halve_weight,
                   lambda m: True if m.const("w")[0, 0] == 0.5 else "halved already")
    assert apply_rewrites(g, [rule]) == (2, 1)  # the second round matches it once more and declines
    body = next(n for n in g.nodes if n.op == "Loop").attrs["body"]
    assert sorted(n.op for n in body.nodes) == ["Add", "Identity", "MatMul", "Tanh"]
    (matmul,) = [n for n in body.nodes if n.op == "MatMul"]
    assert np.allclose(matmul.inputs[1].values, np.eye(4) * 0.25) and matmul.outputs[0].outputs[0].op == "Add"
    only_main = Rewrite("halve-main", rule.pattern, halve_weight, rule.condition, subgraphs=False)
    assert apply_rewrites(to_graph(model), [only_main]) == (0, 0)
    assert "no Mat* node to start from" in str(explain(only_main.pattern, to_graph(model), subgraphs=False))
