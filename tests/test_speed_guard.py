"""The speed guard: a speed pass stays only when the target's runtime measures it not slower; fusions are timed
with the lowering that follows them; the whole result is timed against the input and the input kept when it is
faster. The passes here make a model many times slower or faster (a heavy branch whose product is multiplied
by 0), so the decisions do not depend on this machine's noise."""

import numpy as np
from typer.testing import CliRunner

import ctropt
from ctropt.cli import app
from ctropt.passes.speed import SpeedCheck
from helpers import F, make_model, node, ops, vi

RNG = np.random.default_rng(0)
WIDTH = 256


def light():
    return make_model([node("Relu", ["x"], ["y"])], [vi("x", F, ["B", WIDTH])], [vi("y", F, ["B", WIDTH])])


def add_heavy_zero_branch(ctx, last, prefix: str) -> None:
    """`last`'s output := its value + 0 * (x·W1·W2·W3·W4): the same values, many times the work."""
    import onnx_graphsurgeon as gs

    from ctropt.graph.edit import add_node

    out, h = last.outputs[0], ctx.graph.inputs[0]
    for i in range(4):
        w = gs.Constant(f"{prefix}w{i}", (RNG.normal(size=(WIDTH, WIDTH)) / np.sqrt(WIDTH) / 2).astype(np.float32))
        (h,) = add_node(ctx.graph, "MatMul", [h, w], dtype=np.float32)
    (zeroed,) = add_node(ctx.graph, "Mul", [h, gs.Constant(f"{prefix}zero", np.zeros(1, np.float32))],
                         dtype=np.float32)
    last.outputs = [gs.Variable(f"{prefix}before", np.float32)]
    ctx.graph.nodes.append(gs.Node("Add", f"{prefix}add", inputs=[last.outputs[0], zeroed], outputs=[out]))
    ctx.matches = ctx.rewrites = 1


def slow_down(ctx):
    """y := Relu(x) + 0 * (x·W1·W2·W3·W4)."""
    if not any(n.op == "MatMul" for n in ctx.graph.nodes):
        add_heavy_zero_branch(ctx, next(n for n in ctx.graph.nodes if n.op == "Relu"), "")


def speed_up(ctx):
    """Removes a heavy branch whose product is multiplied by 0: y = Relu(x) again."""
    add = next((n for n in ctx.graph.nodes if n.op == "Add"), None)
    if add is None:
        return
    relu_out = next(t for t in add.inputs if t.inputs and t.inputs[0].op == "Relu")
    out = add.outputs[0]
    relu_out.inputs[0].outputs = [out]
    add.outputs = []
    ctx.graph.cleanup()
    ctx.matches = ctx.rewrites = 1


FAST_CHECK = SpeedCheck(batch=64, seconds=0.5)


def test_a_pass_that_slows_the_model_is_rolled_back_and_says_by_how_much(temp_pass):
    p = temp_pass("t-slow-down", slow_down)
    for _ in range(2):  # the same decision on a second run
        result = ctropt.optimize(light(), passes=[p], speed=FAST_CHECK)
        (rec,) = result.records
        assert rec.status == "slower" and rec.speedup < 0.5, rec
        assert rec.message.startswith("rolled back: 0.") and "ort-cpu, batch 64" in rec.message
        assert ops(result.model) == ["Relu"] and not result.failed
    kept = ctropt.optimize(light(), passes=[p], speed=False)
    assert kept.records[0].status == "applied" and "MatMul" in ops(kept.model)


def test_a_pass_that_speeds_the_model_up_is_kept_with_its_ratio(temp_pass):
    slow = ctropt.optimize(light(), passes=[temp_pass("t-slow-down", slow_down)], speed=False).model
    result = ctropt.optimize(slow, passes=[temp_pass("t-speed-up", speed_up)], speed=FAST_CHECK)
    (rec,) = result.records
    assert rec.status == "applied" and rec.speedup > 2, rec
    assert ops(result.model) == ["Relu"]
    assert result.speed is not None and result.speed.ratio > 2 and not result.kept_input


def test_a_pass_the_guard_does_not_time_is_caught_by_the_whole_model_check(temp_pass):
    """speed=False passes (they fix loading, not speed) are not timed alone; the result against the input is."""
    p = temp_pass("t-slow-untimed", slow_down, speed=False)
    result = ctropt.optimize(light(), passes=[p], speed=FAST_CHECK)
    assert result.records[0].status == "applied" and result.records[0].speedup is None
    assert result.kept_input and ops(result.model) == ["Relu"]
    assert "slower than the input" in result.speed_note


def test_measure_only_records_ratios_and_keeps_everything(temp_pass):
    p = temp_pass("t-slow-down", slow_down)
    result = ctropt.optimize(light(), passes=[p], speed=SpeedCheck(batch=64, seconds=0.5, enforce=False))
    assert result.records[0].status == "applied" and result.records[0].speedup < 0.5
    assert not result.kept_input and "MatMul" in ops(result.model)


def test_a_fusion_is_timed_with_the_lowering_that_follows_it():
    """fuse-rnn leaves ai.ctropt function ops; lower-rnn-ort replaces them: one measurement for both."""
    from ctropt.exporters import zoo

    raw = ctropt.load(zoo.DATA / "dien_tf.onnx")
    result = ctropt.optimize(raw, passes="fuse-rnn,fuse-fc,lower-rnn-ort", speed=SpeedCheck(batch=32, seconds=0.3))
    rec = {r.name: r for r in result.records}
    assert rec["fuse-rnn"].speedup is not None and rec["fuse-rnn"].speedup == rec["lower-rnn-ort"].speedup
    assert rec["fuse-rnn"].status == rec["lower-rnn-ort"].status
    assert rec["fuse-fc"].speedup != rec["fuse-rnn"].speedup  # timed alone, between the fusion and its lowering


def add_second_branch(ctx):
    """Slower alone: a second heavy branch multiplied by 0, which `drop_heavy_after_second` needs to fire."""
    if not any(n.name == "second_add" for n in ctx.graph.nodes):
        add_heavy_zero_branch(ctx, ctx.graph.outputs[0].inputs[0], "second_")


def drop_heavy_after_second(ctx):
    """Fires only after `add_second_branch`: y = Relu(x), both heavy branches gone."""
    if not any(n.name == "second_add" for n in ctx.graph.nodes):
        return
    relu = next(n for n in ctx.graph.nodes if n.op == "Relu")
    out = ctx.graph.outputs[0]
    out.inputs[0].outputs = []
    relu.outputs = [out]
    ctx.graph.cleanup()
    ctx.matches = ctx.rewrites = 1


def test_a_pass_slower_alone_is_kept_when_a_later_pass_needs_it(temp_pass):
    """Pass by pass the guard rolls `add_second_branch` back, and `drop_heavy_after_second` never fires; with every
    verified pass in one line the result is many times faster, so that line is the result."""
    slow = ctropt.optimize(light(), passes=[temp_pass("t-slow-down", slow_down)], speed=False).model
    passes = [temp_pass("t-enable", add_second_branch), temp_pass("t-payoff", drop_heavy_after_second)]
    result = ctropt.optimize(slow, passes=passes, speed=FAST_CHECK)
    enable, payoff = result.records
    assert enable.status == payoff.status == "applied", result.records
    assert enable.speedup < 0.9 and enable.message.startswith("kept although 0.")
    assert ops(result.model) == ["Relu"] and result.speed.ratio > 2 and not result.kept_input


def test_cli_says_what_was_rolled_back_for_speed_and_turns_it_off(tmp_path):
    import onnx

    src = tmp_path / "m.onnx"
    onnx.save(light(), src)
    plugin = tmp_path / "slowpass.py"
    plugin.write_text("import ctropt\nfrom test_speed_guard import slow_down\n"
                      "ctropt.register_pass('t-cli-slow', group='fusion')(slow_down)\n")
    try:
        args = ["optimize", str(src), "--passes", "t-cli-slow", "--plugin", str(plugin), "--speed-batch", "64"]
        res = CliRunner().invoke(app, args + ["-o", str(tmp_path / "a.onnx")])
        assert res.exit_code == 0, res.output
        assert "slower" in res.output and "rolled back: 0." in res.output
        assert ops(onnx.load(tmp_path / "a.onnx")) == ["Relu"]
        res = CliRunner().invoke(app, args + ["--no-speed-check", "-o", str(tmp_path / "b.onnx")])
        assert res.exit_code == 0 and "MatMul" in ops(onnx.load(tmp_path / "b.onnx"))
    finally:
        ctropt.REGISTRY.pop("t-cli-slow", None)


def wrap_relu_in_scaler(ctx):
    """y := Relu(Scaler(x)): the same values, in an ai.onnx.ml op that OpenVINO cannot load."""
    import onnx_graphsurgeon as gs

    relu = next(n for n in ctx.graph.nodes if n.op == "Relu")
    if relu.inputs[0].inputs:
        return
    scaled = gs.Variable("scaled", np.float32)
    ctx.graph.nodes.append(gs.Node("Scaler", "scaler", {"scale": [1.0], "offset": [0.0]}, [relu.inputs[0]], [scaled],
                                   domain="ai.onnx.ml"))
    relu.inputs[0] = scaled
    ctx.matches = ctx.rewrites = 1


def test_openvino_target_leaves_out_the_fusion_that_makes_the_result_unloadable(temp_pass):
    """A result OpenVINO cannot load, from an input it loads, is made again without the fusion that broke it."""
    breaker = temp_pass("t-breaks-openvino", wrap_relu_in_scaler)
    tidy = temp_pass("t-keeps-loading", lambda ctx: None)
    result = ctropt.optimize(light(), passes=[breaker, tidy], target="openvino", speed=FAST_CHECK)
    rec = result.records[0]
    assert rec.status == "rolled back" and "OpenVINO cannot load" in rec.message, rec
    assert [r.name for r in result.records] == ["t-breaks-openvino", "t-keeps-loading"]
    assert ops(result.model) == ["Relu"]
    ort_only = ctropt.optimize(light(), passes=[breaker], target="ort", speed=False)
    assert ort_only.records[0].status == "applied" and "Scaler" in ops(ort_only.model)


def test_openvino_loading_is_checked_without_the_speed_guard_too(temp_pass):
    breaker = temp_pass("t-breaks-openvino-unguarded", wrap_relu_in_scaler)
    result = ctropt.optimize(light(), passes=[breaker], target="openvino", speed=False)
    assert result.records[0].status == "rolled back" and ops(result.model) == ["Relu"]
    unregistered = ctropt.Pass("t-unregistered-breaker", wrap_relu_in_scaler)
    result = ctropt.optimize(light(), passes=[unregistered], target="openvino", speed=False)
    assert result.records[0].status == "rolled back"
