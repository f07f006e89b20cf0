"""layer-norm-kernel: LayerNormalization over the last axis, with the residual Sum (after residual-add-as-sum) or Add
before it → ctropt's LayerNorm kernel; in the forms the exporters write (torch: scale and bias, opset 17; a norm
without bias; widths the kernel keeps in registers and others), against onnxruntime's own op; what stays."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import F, check_pass, init, make_model, node, ops, run_pass, vi

from ctropt import REGISTRY
from ctropt.graph import annotate_shapes, to_graph

RNG = np.random.default_rng(5)


def block_norm(width: int, residual: str | None = "Sum", bias: bool = True, eps: float = 1e-5):
    """y = LayerNorm(a (+ b)) over [B, T, width], as a transformer block's residual norm."""
    nodes, x = [], "a"
    if residual:
        nodes.append(node(residual, ["a", "b"], ["s"]))
        x = "s"
    inputs = [x, "g"] + (["beta"] if bias else [])
    nodes.append(node("LayerNormalization", inputs, ["n"], axis=-1, epsilon=eps))
    nodes.append(node("Relu", ["n"], ["y"]))
    inits = [init("g", RNG.normal(1, 0.2, width).astype(np.float32))]
    if bias:
        inits.append(init("beta", RNG.normal(0, 0.2, width).astype(np.float32)))
    return make_model(nodes, [vi("a", F, ["B", 7, width]), vi("b", F, ["B", 7, width])],
                      [vi("y", F, ["B", 7, width])], inits)


def _feeds(width: int, scale: float = 1.0) -> dict:
    return {k: (RNG.normal(3, 2, (5, 7, width)) * scale).astype(np.float32) for k in "ab"}


@pytest.mark.parametrize("width", [8, 32, 64, 20, 3])
def test_residual_sum_and_norm_in_one_kernel(width):
    """Widths of 8·N up to 64 are normalized in registers, others through a row buffer: the same outputs."""
    out, _ = check_pass(block_norm(width), "layer-norm-kernel", ["LayerNorm", "Relu"], _feeds(width))
    kernel = next(n for n in out.graph.node if n.op_type == "LayerNorm")
    assert list(kernel.input) == ["a", "g", "beta", "b"]


def test_a_residual_add_a_norm_without_bias_and_one_without_residual():
    out, _ = check_pass(block_norm(16, residual="Add", bias=False), "layer-norm-kernel", ["LayerNorm", "Relu"],
                        _feeds(16))
    assert list(next(n for n in out.graph.node if n.op_type == "LayerNorm").input) == ["a", "g", "", "b"]
    out, _ = check_pass(block_norm(24, residual=None, eps=1e-3), "layer-norm-kernel", ["LayerNorm", "Relu"],
                        _feeds(24, scale=1e-2))
    assert list(next(n for n in out.graph.node if n.op_type == "LayerNorm").input) == ["a", "g", "beta"]


@pytest.mark.parametrize("b_dims", [["N", 7, 16], ["B", 7, 1]])
def test_a_residual_whose_sizes_are_named_apart_is_taken_where_a_run_shows_one_shape(b_dims):
    """The residual's two values with sizes the annotations name differently ('N' and 'B', as a Transpose's 'unk__10'
    and a Concat's 'batch' in FuxiCTR's legacy BST): a run of the graph at two sizes shows them of one shape, so
    the Sum goes into the kernel. A value broadcast over the width ([B, 7, 1]) keeps its Sum."""
    model = block_norm(16)
    model.graph.input[1].CopyFrom(vi("b", F, b_dims))
    feeds = {"a": _feeds(16)["a"], "b": _feeds(16)["b"][..., :b_dims[-1]]}
    folded = b_dims[-1] == 16
    out, ctx = check_pass(model, "layer-norm-kernel", ["LayerNorm", "Relu"] + ([] if folded else ["Sum"]), feeds)
    kernel = next(n for n in out.graph.node if n.op_type == "LayerNorm")
    assert list(kernel.input) == (["a", "g", "beta", "b"] if folded else ["s", "g", "beta"])


def test_a_sum_read_elsewhere_stays_apart():
    model = block_norm(32)
    model.graph.node.append(node("Neg", ["s"], ["y2"]))
    model.graph.output.append(vi("y2", F, ["B", 7, 32]))
    out, _ = check_pass(model, "layer-norm-kernel", ["Sum", "LayerNorm", "Relu", "Neg"], _feeds(32))
    assert list(next(n for n in out.graph.node if n.op_type == "LayerNorm").input) == ["s", "g", "beta"]


def test_norms_that_stay():
    """Over another axis than the last, with its mean read, of a width not known: left, each with its reason."""
    other_axis = block_norm(32)
    other_axis.graph.node[1].attribute[0].i = 1
    with_mean = block_norm(32)
    with_mean.graph.node[1].output.append("mean")
    with_mean.graph.node.append(node("Neg", ["mean"], ["y2"]))
    with_mean.graph.output.append(vi("y2", F, None))
    unknown = make_model([node("LayerNormalization", ["a", "g"], ["y"], axis=-1)], [vi("a", F, ["B", "W"])],
                         [vi("y", F, ["B", "W"])], [init("g", np.ones(4, np.float32))])
    for model, why in ((other_axis, "last axis"), (with_mean, "mean"), (unknown, "width")):
        done, ctx = run_pass(model, "layer-norm-kernel")
        assert ctx.rewrites == 0 and "LayerNorm" not in ops(done)
        graph = to_graph(model)
        annotate_shapes(graph)   # as the pass does before it matches
        assert why in " ".join(REGISTRY["layer-norm-kernel"].misses(graph, "ort"))


def written_out_norm(axes=(-1,), width: int = 16):
    """paddle2onnx (opset 13): ReduceMean, Sub, Pow 2, ReduceMean, Add eps, Sqrt, Div, Mul scale, Add bias."""
    nodes = [node("ReduceMean", ["x"], ["mean"], axes=list(axes), keepdims=1), node("Sub", ["x", "mean"], ["d"]),
             node("Pow", ["d", "two"], ["d2"]), node("ReduceMean", ["d2"], ["var"], axes=list(axes), keepdims=1),
             node("Add", ["var", "eps"], ["ve"]), node("Sqrt", ["ve"], ["std"]), node("Div", ["d", "std"], ["n"]),
             node("Mul", ["n", "g"], ["ng"]), node("Add", ["ng", "beta"], ["y"])]
    inits = [init("two", np.array(2, np.float32)), init("eps", np.array(1e-5, np.float32)),
             init("g", RNG.normal(1, 0.2, width).astype(np.float32)),
             init("beta", RNG.normal(0, 0.2, width).astype(np.float32))]
    return make_model(nodes, [vi("x", F, ["B", 39, width])], [vi("y", F, ["B", 39, width])], inits, opset=13)


def test_a_norm_written_out_by_paddle2onnx():
    feeds = {"x": RNG.normal(2, 3, (4, 39, 16)).astype(np.float32)}
    model, _ = run_pass(written_out_norm(), "infer-shapes")
    out, _ = check_pass(model, "layer-norm-kernel", ["LayerNorm"], feeds)
    assert next(n for n in out.graph.node if n.op_type == "LayerNorm").input[0] == "x"
    other_axis, _ = run_pass(written_out_norm(axes=(1,)), "infer-shapes")
    done, ctx = run_pass(other_axis, "layer-norm-kernel")
    assert ctx.rewrites == 0 and "LayerNorm" not in ops(done)


def test_a_norms_mean_as_a_graph_output_and_a_scale_that_is_a_column_stay():
    with_mean = block_norm(32)
    with_mean.graph.node[1].output.append("mean")
    with_mean.graph.output.append(vi("mean", F, None))
    column, _ = run_pass(written_out_norm(width=16), "infer-shapes")
    g = next(i for i in column.graph.initializer if i.name == "g")
    g.dims[:] = [16, 1]   # broadcast along axis -2 in the original: not the kernel's per-column scale
    column.graph.input[0].type.tensor_type.shape.dim[1].dim_value = 16
    for model in (with_mean, column):
        done, ctx = run_pass(model, "layer-norm-kernel")
        assert ctx.rewrites == 0 and "LayerNorm" not in ops(done)


def batchnorm_norm(width: int = 16, axes=(0, 2, 3), count: float | None = None):
    """tf2onnx's Keras LayerNormalization (DeepRec BST): x reshaped to [1, N, D, 1], BatchNormalization with scale
    Expand(1), bias Expand(0), mean Squeeze(ReduceMean) and var ReduceSumSquare(x - mean) / D, reshaped back, then
    the layer's own Mul and Add."""
    nodes = [node("Reshape", ["x", "to4"], ["x4"]), node("ReduceMean", ["x4"], ["m4"], axes=list(axes), keepdims=1),
             node("Sub", ["x4", "m4"], ["d"]), node("ReduceSumSquare", ["d"], ["ss"], axes=list(axes), keepdims=0),
             node("Div", ["ss", "count"], ["var"]), node("Squeeze", ["m4", "sq"], ["mean"]),
             node("Shape", ["mean"], ["n"]), node("Expand", ["one", "n"], ["ones"]),
             node("Expand", ["zero", "n"], ["zeros"]),
             node("BatchNormalization", ["x4", "ones", "zeros", "mean", "var"], ["y4"], epsilon=1e-3),
             node("Reshape", ["y4", "back"], ["n3"]), node("Mul", ["n3", "g"], ["ng"]), node("Add", ["ng", "beta"], ["y"])]
    inits = [init("to4", np.array([1, -1, width, 1], np.int64)), init("sq", np.array([0, 2, 3], np.int64)),
             init("count", np.array(count or width, np.float32)), init("one", np.array([1.0], np.float32)),
             init("zero", np.array([0.0], np.float32)), init("back", np.array([-1, 39, width], np.int64)),
             init("g", RNG.normal(1, 0.2, width).astype(np.float32)),
             init("beta", RNG.normal(0, 0.2, width).astype(np.float32))]
    return make_model(nodes, [vi("x", F, ["B", 39, width])], [vi("y", F, ["B", 39, width])], inits, opset=13)


def test_a_norm_written_as_a_batchnorm_over_rows_by_tf2onnx():
    """Keras LayerNormalization as tf2onnx writes it → the LayerNorm kernel (scale 1, bias 0; the layer's Mul and Add
    stay); a variance divided by another count is not a layer norm and stays."""
    feeds = {"x": RNG.normal(2, 3, (4, 39, 16)).astype(np.float32)}
    model, _ = run_pass(batchnorm_norm(), "infer-shapes")
    out, _ = check_pass(model, "layer-norm-kernel", ["LayerNorm", "Mul", "Add"], feeds)
    assert next(
        n for n in out.graph.node if n.op_type == "LayerNorm").input[0] == "x"
    other, _ = run_pass(batchnorm_norm(count=15.0), "infer-shapes")
    done, ctx = run_pass(other, "layer-norm-kernel")
    assert ctx.rewrites == 0 and "LayerNorm" not in ops(done)
