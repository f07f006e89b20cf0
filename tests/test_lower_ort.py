"""residual-add-as-sum: the residual Add a layer norm reads becomes a Sum, which onnxruntime does not fuse into its
(slower) SkipLayerNormalization; torch's LayerNormalization op and the decomposed form of legacy exports."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from helpers import F, assert_same_outputs, init, make_model, node, ops, run_pass, vi

import ctropt

D = 8
RNG = np.random.default_rng(4)
GAMMA, BETA = RNG.normal(size=D).astype(np.float32), RNG.normal(size=D).astype(np.float32)
INPUTS = [vi("x", F, ["batch", 5, D]), vi("skip", F, ["batch", 5, D])]
OUTPUTS = [vi("y", F, ["batch", 5, D])]


def layer_norm_op(reader: str | None = None):
    """torch dynamo / opset 17: Add(x, skip) → LayerNormalization. `reader`: the sum also goes on to that op."""
    nodes = [node("Add", ["x", "skip"], ["s"]), node("LayerNormalization", ["s", "gamma", "beta"], ["y"], axis=-1)]
    outputs = list(OUTPUTS)
    if reader:
        nodes.append(node(reader, ["s"], ["other"]))
        outputs.append(vi("other", F, ["batch", 5, D]))
    return make_model(nodes, INPUTS, outputs, [init("gamma", GAMMA), init("beta", BETA)])


def decomposed():
    """torch legacy / tf2onnx: mean, centred, variance, epsilon, sqrt, divide, scale and shift, over Add(x, skip)."""
    nodes = [node("Add", ["x", "skip"], ["s"]), node("ReduceMean", ["s"], ["mu"], axes=[-1]),
             node("Sub", ["s", "mu"], ["d"]), node("Pow", ["d", "two"], ["d2"]),
             node("ReduceMean", ["d2"], ["var"], axes=[-1]), node("Add", ["var", "eps"], ["ve"]),
             node("Sqrt", ["ve"], ["sd"]), node("Div", ["d", "sd"], ["n"]), node("Mul", ["n", "gamma"], ["ng"]),
             node("Add", ["ng", "beta"], ["y"])]
    inits = [init("gamma", GAMMA), init("beta", BETA), init("two", np.array(2.0, np.float32)),
             init("eps", np.array(1e-5, np.float32))]
    return make_model(nodes, INPUTS, OUTPUTS, inits)


def _feeds(batch=3):
    return {"x": RNG.normal(size=(batch, 5, D)).astype(np.float32),
            "skip": RNG.normal(size=(batch, 5, D)).astype(np.float32)}


def _ort_ops(model) -> list[str]:
    """The ops onnxruntime runs after its own fusions (level all)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        so = ort.SessionOptions()
        so.optimized_model_filepath = f"{tmp}/opt.onnx"
        ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        import onnx

        return [n.op_type for n in onnx.load(f"{tmp}/opt.onnx").graph.node]


@pytest.mark.parametrize("make", [layer_norm_op, decomposed])
def test_a_residual_a_layer_norm_reads_becomes_a_sum(make):
    model = make()
    done, ctx = run_pass(model, "residual-add-as-sum")
    assert ctx.rewrites == 1
    assert ops(done).count("Sum") == 1 and ops(done)[0] == "Sum" and len(ops(done)) == len(ops(model))
    assert_same_outputs(model, done, _feeds(), atol=1e-5, rtol=1e-5)  # the raw model runs onnxruntime's fused kernel
    again, ctx2 = run_pass(done, "residual-add-as-sum")
    assert ctx2.rewrites == 0 and ops(again) == ops(done)
    assert ctropt.graph.interface(done) == ctropt.graph.interface(model)


def test_onnxruntime_no_longer_fuses_it_into_skip_layer_normalization():
    model = layer_norm_op()
    assert "SkipLayerNormalization" in _ort_ops(model)
    done, _ = run_pass(model, "residual-add-as-sum")
    assert "SkipLayerNormalization" not in _ort_ops(done) and "LayerNormalization" in _ort_ops(done)


def test_a_bias_or_a_sum_no_layer_norm_reads_stays():
    bias = make_model([node("Add", ["x", "b"], ["s"]), node("LayerNormalization", ["s", "gamma", "beta"], ["y"])],
                      INPUTS[:1], OUTPUTS, [init("b", GAMMA), init("gamma", GAMMA), init("beta", BETA)])
    plain = make_model([node("Add", ["x", "skip"], ["s"]), node("Relu", ["s"], ["y"])], INPUTS, OUTPUTS)
    for model in (bias, plain):
        done, ctx = run_pass(model, "residual-add-as-sum")
        assert ctx.rewrites == 0 and ops(done) == ops(model)


def test_only_for_onnxruntime():
    model = layer_norm_op(reader="Relu")
    assert "Sum" in ops(ctropt.optimize(model, passes="all", target="ort", speed=False).model)
    assert "Sum" not in ops(ctropt.optimize(model, passes="all", target="openvino", speed=False).model)
