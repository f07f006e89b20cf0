"""Tiny hand-built graphs for the tests."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import ctropt
from ctropt.graph import to_graph, to_model
from ctropt.runtime import compare_outputs, generate_inputs, run_model

F = TensorProto.FLOAT
I64 = TensorProto.INT64


def vi(name, elem=F, shape=None):
    return helper.make_tensor_value_info(name, elem, shape)


def init(name, array):
    return numpy_helper.from_array(np.asarray(array), name)


def make_model(nodes, inputs, outputs, initializers=(), opset=17, functions=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], functions=list(functions))
    model.ir_version = 8
    return model


def node(op, inputs, outputs, name=None, **attrs):
    return helper.make_node(op, inputs, outputs, name=name or f"{op}_{outputs[0]}", **attrs)


def ops(model) -> list[str]:
    """Op types of the main graph, in order."""
    return [n.op_type for n in model.graph.node]


def run_pass(model, name, target="ort", **options):
    """Run one registered pass without the manager; returns (new model, ctx)."""
    graph = to_graph(model)
    ctx = ctropt.PassContext(graph, target=target, options=options)
    ctropt.REGISTRY[name](ctx)
    return to_model(ctx.graph, like=model), ctx


def assert_same_outputs(a, b, feeds=None, **tol):
    feeds = feeds if feeds is not None else generate_inputs(a, batch=4)
    diffs = compare_outputs(run_model(a, feeds), run_model(b, feeds), **tol)
    assert all(d.ok for d in diffs), diffs


def check_pass(model, name, expected_ops, feeds=None):
    """The pass gives `expected_ops`, the same outputs, and a second run changes nothing."""
    once, ctx = run_pass(model, name)
    assert sorted(ops(once)) == sorted(expected_ops), ops(once)
    assert_same_outputs(model, once, feeds)
    twice, ctx2 = run_pass(once, name)
    assert ctx2.rewrites == 0
    assert sorted(ops(twice)) == sorted(ops(once))
    assert ctropt.graph.interface(once) == ctropt.graph.interface(model)
    return once, ctx


def kernel_session(nodes, inputs, inits=(), out_type=F, threads=2):
    """An onnxruntime session (2 threads unless told) over nodes that may be ctropt's kernels, the library
    registered; one output, y."""
    import onnxruntime as ort

    from ctropt import kernels

    graph = helper.make_graph(nodes, "k", inputs, [vi("y", out_type, None)], list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(kernels.DOMAIN, 1)])
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    kernels.register(so)
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def built_kernels(tmp_path_factory):
    """The kernel library (a module fixture's body): the one already built, else built into a temporary folder,
    else skipped (required where CTROPT_KERNEL_TESTS=required)."""
    import os
    import shutil

    import pytest

    from ctropt import kernels

    saved = os.environ.get("CTROPT_KERNELS_DIR")
    if not kernels.available():
        if shutil.which("gcc") is None and os.environ.get("CTROPT_KERNEL_TESTS") != "required":
            pytest.skip("gcc not found: the kernel library cannot be built here")
        os.environ["CTROPT_KERNELS_DIR"] = str(tmp_path_factory.mktemp("kernels"))
        kernels.build()
    yield kernels.library_path()
    if saved is None:
        os.environ.pop("CTROPT_KERNELS_DIR", None)
    else:
        os.environ["CTROPT_KERNELS_DIR"] = saved
