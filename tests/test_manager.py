"""The PassManager: order, verification after every pass, rollback, strict mode, idempotence of `all`."""

import numpy as np
import onnx_graphsurgeon as gs
import pytest

import ctropt
from ctropt.graph import CtroptError, interface
from ctropt.passes import PassFailed, resolve
from helpers import F, init, make_model, node, ops, vi


def model_with_noise():
    return make_model(
        [node("Identity", ["x"], ["a"]), node("Mul", ["a", "one"], ["b"]), node("Relu", ["b"], ["y"])],
        [vi("x", F, ["B", 4])], [vi("y", F, ["B", 4])], [init("one", np.float32(1))])


def break_relu(ctx):
    """Turns Relu into Sigmoid: changes outputs."""
    for n in ctx.graph.nodes:
        if n.op == "Relu":
            n.op = "Sigmoid"
            ctx.rewrites += 1


def test_all_runs_cleanup_passes_in_order_and_verifies_each():
    result = ctropt.optimize(model_with_noise(), passes="all", speed=False)
    assert [r.name for r in result.records] == [p.name for p in resolve("all")]
    assert ops(result.model) == ["Relu"]
    applied = [r for r in result.records if r.status == "applied"]
    assert applied and all(r.max_abs_err is not None for r in applied)
    assert interface(result.model) == interface(model_with_noise())


def test_all_is_idempotent():
    once = ctropt.optimize(model_with_noise(), speed=False).model
    twice = ctropt.optimize(once, speed=False)
    assert all(r.status == "unchanged" for r in twice.records), [(r.name, r.status) for r in twice.records]


def test_a_pass_that_changes_outputs_is_rolled_back(temp_pass):
    temp_pass("test-break-relu", break_relu)
    result = ctropt.optimize(model_with_noise(), passes=["eliminate-identity", "test-break-relu"], speed=False)
    rec = result.records[1]
    assert rec.status == "rolled back" and "outputs changed" in rec.message and rec.rewrites == 0
    assert ops(result.model) == ["Relu"]  # the first pass's work is kept, the broken one is not


def test_strict_turns_rollback_into_an_error(temp_pass):
    temp_pass("test-break-relu", break_relu)
    with pytest.raises(PassFailed, match="test-break-relu rolled back"):
        ctropt.optimize(model_with_noise(), passes=["test-break-relu"], strict=True, speed=False)


def test_a_pass_that_raises_is_reported_not_fatal(temp_pass):
    def explode(ctx):
        raise RuntimeError("boom")

    temp_pass("test-explode", explode)
    result = ctropt.optimize(model_with_noise(), passes=["test-explode", "eliminate-identity"], speed=False)
    assert result.records[0].status == "failed" and "boom" in result.records[0].message
    assert result.records[1].status == "applied"


def test_a_pass_that_renames_an_output_is_rolled_back(temp_pass):
    def rename(ctx):
        ctx.graph.outputs[0].name = "renamed"
        ctx.rewrites += 1

    temp_pass("test-rename", rename)
    result = ctropt.optimize(model_with_noise(), passes=["test-rename"], verify=False, speed=False)
    assert result.records[0].status == "rolled back" and "inputs/outputs" in result.records[0].message


def test_user_inputs_are_used_for_verification(temp_pass):
    def relu_to_abs(ctx):
        """Relu == Abs only on non-negative inputs."""
        for n in ctx.graph.nodes:
            if n.op == "Relu":
                n.op = "Abs"
                ctx.rewrites += 1

    temp_pass("test-relu-to-abs", relu_to_abs)
    positive = {"x": np.abs(np.random.default_rng(0).standard_normal((3, 4))).astype(np.float32)}
    assert ctropt.optimize(model_with_noise(), passes=["test-relu-to-abs"], feeds=positive, speed=False).records[0].status == "applied"
    assert ctropt.optimize(model_with_noise(), passes=["test-relu-to-abs"], speed=False).records[0].status == "rolled back"


def test_pass_objects_can_be_passed_directly_without_registering():
    def fold_mul_one(ctx):
        ctx.apply(ctropt.Rewrite("mul-one", ctropt.P.Mul(ctropt.Var("x"), ctropt.Const("c", value=1.0)),
                                 lambda m: [m["x"]]))

    result = ctropt.optimize(model_with_noise(), passes=[ctropt.Pass("mine", fold_mul_one)], speed=False)
    assert result.records[0].rewrites == 1 and "mine" not in ctropt.REGISTRY


def test_a_pass_that_returns_a_count_is_counted():
    """A whole-graph pass (not a set of rules) returns how many changes it made: matches and rewrites both."""

    def drop_identity(ctx):
        graph = ctx.graph
        graph.nodes[1].inputs[0] = graph.inputs[0]
        graph.cleanup()
        return 1

    result = ctropt.optimize(model_with_noise(), passes=[ctropt.Pass("mine", drop_identity)], speed=False)
    assert (result.records[0].matches, result.records[0].rewrites, result.records[0].status) == (1, 1, "applied")
    ctx = ctropt.PassContext(gs.import_onnx(model_with_noise()))
    ctropt.REGISTRY["eliminate-common-subexpressions"](ctx)
    assert (ctx.matches, ctx.rewrites) == (0, 0)


def test_resolve_errors_and_skip():
    with pytest.raises(CtroptError, match="unknown pass"):
        resolve("eliminate-identity,nope")
    with pytest.raises(CtroptError, match="unknown target"):
        resolve("all", target="tpu")
    names = [p.name for p in resolve("all", skip="fold-constants")]
    assert "fold-constants" not in names and "eliminate-identity" in names


def test_registration_validates_group_and_targets():
    with pytest.raises(ValueError, match="group"):
        ctropt.Pass("x", lambda ctx: None, group="magic")
    with pytest.raises(ValueError, match="targets"):
        ctropt.Pass("x", lambda ctx: None, targets=("gpu",))


def test_unrunnable_input_model_says_how_to_proceed():
    model = make_model([node("Add", ["x", "w"], ["y"])], [vi("x", F, ["B", 4])], [vi("y", F, ["B", 4])],
                       [init("w", np.ones(5, np.float32))])  # shapes can never broadcast
    with pytest.raises(CtroptError, match="--no-verify"):
        ctropt.optimize(model, speed=False)
    assert ctropt.optimize(model, verify=False, speed=False).records


def test_records_hold_the_node_level_change():
    result = ctropt.optimize(model_with_noise(), passes=["eliminate-identity"], speed=False)
    rec = result.records[0]
    assert {op for _, op, _ in rec.diff.removed} == {"Identity", "Mul"} and not rec.diff.added
    assert rec.diff.ops_before["Identity"] == 1 and "Identity" not in rec.diff.ops_after
    assert isinstance(ctropt.patterns.const_value(gs.Constant("c", np.ones(2))), np.ndarray)
