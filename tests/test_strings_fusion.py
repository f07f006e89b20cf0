"""string-embedding: string chains (tf2onnx's ai.onnx.contrib ops) in fewer, cheaper kernels; ids stay identical.

Each form is a tiny graph written as tf2onnx writes it: a mask `tokens != ""` (StringEqual), a `tf.strings.split`
column made dense (RaggedTensorToTensor: Unique of the row ids, CumSum, ScatterND into "" padding) then hashed or
looked up, pooled by a masked mean or sum or read as ids. Runs skip where onnxruntime-extensions is missing.
"""

from __future__ import annotations

import collections

import numpy as np
import onnx
import pytest
from helpers import F, I64, init, make_model, node, ops, run_pass, vi
from onnx import TensorProto, helper

import ctropt
from ctropt.exporters import zoo
from ctropt.graph import interface, load, to_graph
from ctropt.runtime import Runner, strings

pytestmark = pytest.mark.skipif(not strings.available(), reason=f"{strings.PACKAGE} not installed: "
                                f"pip install '{strings.REQUIREMENT}'")

C = strings.DOMAIN
S = TensorProto.STRING
BUCKETS, D = 97, 4
TABLE = np.random.default_rng(3).normal(size=(BUCKETS, D)).astype(np.float32)
VOCAB = ["us", "de", "家居", ""]
# rows: several tokens, empty tokens (a||b, a trailing |), no token, one, unicode, emoji, a long one
TAGS = np.array(["a|b|c", "", "us", "a||b", "de|", "家居|🙂|x" + "y" * 60, "|", "zz-unseen|us|us|de"], dtype=object)


def string_model(nodes, inputs, outputs, inits=(), opset=17):
    model = make_model(nodes, inputs, outputs, inits, opset=opset)
    model.opset_import.extend([helper.make_opsetid("ai.onnx.ml", 2), helper.make_opsetid(C, 1)])
    return model


def contrib(op, inputs, outputs, **attrs):
    return helper.make_node(op, inputs, outputs, name=f"{op}_{outputs[0]}", domain=C, **attrs)


def text(name, values, shape=None):
    values = [values] if isinstance(values, str) else list(values)
    return helper.make_tensor(name, S, [len(values)] if shape is None else shape, [v.encode() for v in values])


def split_tokens():
    """tf.strings.split(tags, "|").to_tensor(""), as tf2onnx writes RaggedTensorToTensor: the token positions
    recomputed from the row ids (Unique, CumSum of the first occurrences) and the dense shape from their counts."""
    nodes = [
        contrib("StringSplit", ["tags", "sep", "skip_empty"], ["idx", "vals", "dense_shape"]),
        node("Slice", ["dense_shape", "i0", "i1", "i0"], ["nrows"]),
        node("Slice", ["idx", "s00", "e_rows", "a01"], ["rows2"]),
        node("Squeeze", ["rows2", "i1"], ["rows"]),
        node("Unsqueeze", ["rows", "i1"], ["rows_col"]),
        helper.make_node("Unique", ["rows"], ["u", "first", "inv", "counts"], name="Unique", axis=0),
        node("Sub", ["one", "counts"], ["one_minus"]),
        node("Shape", ["rows"], ["nnz"]),
        node("ReduceMax", ["counts"], ["longest"], axes=[0], keepdims=1),
        node("Concat", ["nrows", "longest"], ["shape"], axis=0),
        node("Expand", ["pad", "shape"], ["padding"]),
        node("ConstantOfShape", ["nnz"], ["ones"], value=helper.make_tensor("v", I64, [1], [1])),
        node("Concat", ["i0", "one_minus"], ["steps"], axis=0),
        node("Slice", ["steps", "i0", "im1", "i0"], ["resets"]),
        node("ScatterElements", ["ones", "first", "resets"], ["marks"], axis=0),
        node("CumSum", ["marks", "zero"], ["cols"]),
        node("Unsqueeze", ["cols", "i1"], ["cols_col"]),
        node("Concat", ["rows_col", "cols_col"], ["positions"], axis=1),
        node("ScatterND", ["padding", "positions", "vals"], ["tokens"]),
    ]
    inits = [text("sep", "|"), init("skip_empty", np.array([False])), text("pad", "", []),
             init("i0", np.array([0], np.int64)), init("i1", np.array([1], np.int64)),
             init("im1", np.array([-1], np.int64)), init("s00", np.array([0, 0], np.int64)),
             init("e_rows", np.array([2**31 - 1, 1], np.int64)), init("a01", np.array([0, 1], np.int64)),
             init("one", np.array(1, np.int64)), init("zero", np.array(0, np.int64))]
    return nodes, inits


def ids_of(tokens, out, lookup):
    if lookup == "hash":
        return [contrib("StringToHashBucketFast", [tokens, "buckets"], [out])], [init("buckets", np.array(BUCKETS))]
    return [helper.make_node("CategoryMapper", [tokens], [out], name=f"vocab_{out}", domain="ai.onnx.ml",
                             cats_strings=VOCAB, cats_int64s=[1, 2, 3, 4], default_int64=0)], []


def mask_of(tokens, out):
    """tf.cast(tokens != "", float)[..., None] (tf2onnx: StringEqual, Not, Cast, Unsqueeze, a full strided slice)."""
    nodes = [contrib("StringEqual", [tokens, "pad"], ["is_pad"]), node("Not", ["is_pad"], ["kept"]),
             node("Cast", ["kept"], ["kept_f"], to=F), node("Unsqueeze", ["kept_f", "i2"], ["mask3"]),
             node("Slice", ["mask3", "b0", "big", "ax012", "st1"], [out])]
    inits = [init("i2", np.array([2], np.int64)), init("b0", np.zeros(3, np.int64)),
             init("big", np.full(3, 10**9, np.int64)), init("ax012", np.arange(3, dtype=np.int64)),
             init("st1", np.ones(3, np.int64))]
    return nodes, inits


def pooled_model(lookup="hash", combiner="mean", keepdims=0, opset=17, ids_out=False):
    """A split column's masked mean (or sum) of its tokens' embeddings (`ids_out`: the padded ids an output too,
    as a wide part's second lookup reads them)."""
    nodes, inits = split_tokens()
    more, extra = ids_of("tokens", "ids", lookup)
    table = TABLE[: len(VOCAB) + 1] if lookup == "vocab" else TABLE
    mask, mask_inits = mask_of("tokens", "mask")
    nodes += more + mask + [node("Gather", ["table", "ids"], ["emb"], axis=0), node("Mul", ["emb", "mask"], ["masked"]),
                            node("ReduceSum", ["masked", "i1"], ["summed"], keepdims=keepdims)]
    inits += extra + mask_inits + [init("table", table)]
    out = "summed"
    if combiner == "mean":
        nodes += [node("ReduceSum", ["mask", "i1"], ["count"], keepdims=keepdims),
                  node("Max", ["count", "one_f"], ["count1"]), node("Div", ["summed", "count1"], ["pooled"])]
        inits.append(init("one_f", np.array(1.0, np.float32)))
        out = "pooled"
    shape = ["batch", 1, D] if keepdims else ["batch", D]
    outputs = [vi(out, F, shape)] + ([vi("ids", I64, ["batch", "T"])] if ids_out else [])
    return string_model(nodes, [vi("tags", S, ["batch"])], outputs, inits, opset=opset)


def ids_model(lookup="hash"):
    """tf.strings.split(s).to_tensor("") hashed (or looked up), the ids themselves the output."""
    nodes, inits = split_tokens()
    more, extra = ids_of("tokens", "ids", lookup)
    return string_model(nodes + more, [vi("tags", S, ["batch"])], [vi("ids", I64, ["batch", "T"])], inits + extra)


def equal_model(constant_first=False, pad=("",), shape=()):
    """A padded history's mask: tf.cast(hist != "", float)."""
    args = ["pad", "hist"] if constant_first else ["hist", "pad"]
    nodes = [contrib("StringEqual", args, ["is_pad"]), node("Not", ["is_pad"], ["kept"]),
             node("Cast", ["kept"], ["mask"], to=F)]
    return string_model(nodes, [vi("hist", S, ["batch", "T"])], [vi("mask", F, ["batch", "T"])],
                        [text("pad", pad, list(shape))])


HIST = np.array([["a", "", ""], ["", "", ""], ["家居", "b", "🙂"], ["pad", " ", ""]], dtype=object)


def rewrite(model, feeds, want_ops, exact=True):
    """The pass gives `want_ops` (a multiset), the same outputs (ids and masks exactly) at every batch in
    `feeds`, a second run changes nothing, and the interface stays."""
    done, ctx = run_pass(model, "string-embedding")
    assert ctx.rewrites >= 1
    assert collections.Counter(ops(done)) == collections.Counter(want_ops), ops(done)
    before, after = Runner(model, threads=1), Runner(done, threads=1)
    for f in feeds:
        a, b = before.run(f), after.run(f)
        for k in a:
            if exact or a[k].dtype.kind != "f":
                assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), (k, a[k], b[k])
            else:
                np.testing.assert_allclose(b[k], a[k], rtol=1e-6, atol=1e-7)
    again, ctx2 = run_pass(done, "string-embedding")
    assert ctx2.rewrites == 0 and ops(again) == ops(done)
    assert interface(done) == interface(model)
    onnx.checker.check_model(done, full_check=True)
    return done, ctx


def _batches(values):
    return [{"tags": values}, {"tags": values[:1]}, {"tags": values[2:3]}, {"tags": np.repeat(values[:1], 5)}]


# after the rewrite: the split's tokens at its own indices, hashed (or looked up) before the padding, the mask a
# CategoryMapper lookup; the pooling itself as the model wrote it
DENSE = ["StringSplit", "Expand", "ScatterND", "Expand", "ScatterND", "CategoryMapper", "Cast", "Not", "Cast",
         "Unsqueeze", "Slice", "Gather", "Mul", "ReduceSum"]


@pytest.mark.parametrize("lookup", ["hash", "vocab"])
def test_a_split_columns_masked_mean_keeps_its_pooling_over_ids_padded_after_the_hash(lookup):
    """The pooling stays as written (a mask proven only on probe tokens could be another mask, and ScatterND adds
    race across threads): the rewrite is the positions, the hash before the padding and the mask's lookup, and
    every output is bit-identical."""
    model = pooled_model(lookup)
    id_op = "StringToHashBucketFast" if lookup == "hash" else "CategoryMapper"
    done, ctx = rewrite(model, _batches(TAGS), DENSE + [id_op, "ReduceSum", "Max", "Div"])
    assert "Unique" not in ops(done) and "StringEqual" not in ops(done)


@pytest.mark.parametrize("keepdims", [0, 1])
def test_a_split_columns_masked_sum_keeps_its_dims(keepdims):
    rewrite(pooled_model(combiner="sum", keepdims=keepdims), _batches(TAGS), DENSE + ["StringToHashBucketFast"])


def test_a_mask_that_drops_more_than_the_padding_is_kept_as_written():
    """A mask that also drops "<unk>" (not the padding mask alone): exact, since nothing assumes what it is."""
    model = pooled_model(combiner="sum")
    g = model.graph
    g.node.append(contrib("StringEqual", ["tokens", "unk"], ["is_unk"]))
    g.node.append(helper.make_node("Or", ["is_pad", "is_unk"], ["dropped"], name="or_unk"))
    g.initializer.append(text("unk", "<unk>", []))
    next(n for n in g.node if n.op_type == "Not").input[0] = "dropped"
    order = {n.name: i for i, n in enumerate(g.node)}
    nodes = sorted(g.node, key=lambda n: (order[n.name] if n.op_type != "Not" else order["or_unk"] + 0.5))
    del g.node[:]
    g.node.extend(nodes)
    tags = np.array(["a|<unk>|b", "<unk>", "c", ""], dtype=object)
    done, ctx = run_pass(model, "string-embedding")
    for f in _batches(tags):
        a, b = Runner(model, threads=1).run(f), Runner(done, threads=1).run(f)
        assert np.array_equal(a["summed"], b["summed"])


@pytest.mark.parametrize("lookup", ["hash", "vocab"])
def test_split_tokens_read_as_ids_are_hashed_before_the_padding(lookup):
    """The positions are the split's own indices (the recomputation is dropped), and the padded ids are the ids
    of the tokens padded with the padding's id: identical, "" and unseen tokens included."""
    done, ctx = rewrite(ids_model(lookup), _batches(TAGS), ["StringSplit", "Expand", "ScatterND",
                                                            "StringToHashBucketFast" if lookup == "hash"
                                                            else "CategoryMapper"])
    by_op = {n.op_type: n for n in done.graph.node}
    split, scatter = by_op["StringSplit"], by_op["ScatterND"]
    assert scatter.input[1] == split.output[0] and by_op["Expand"].input[1] == split.output[2]
    assert next(n for n in done.graph.node if n.output[0] == scatter.input[2]).input[0] == split.output[1]


@pytest.mark.parametrize("constant_first", [False, True])
def test_string_equal_with_a_constant_is_a_category_lookup(constant_first):
    feeds = [{"hist": HIST}, {"hist": HIST[:1]}, {"hist": HIST[:, :1]}]
    rewrite(equal_model(constant_first), feeds, ["CategoryMapper", "Cast", "Not", "Cast"])
    rewrite(equal_model(pad=("pad",)), feeds, ["CategoryMapper", "Cast", "Not", "Cast"])


def test_string_equal_with_several_strings_is_left_alone():
    model = equal_model(pad=("", "pad"), shape=(2,))
    done, ctx = run_pass(model, "string-embedding")
    assert ctx.rewrites == 0 and ops(done) == ops(model)


def test_a_constant_with_a_nul_byte_is_left_alone():
    """The contrib StringEqual compares up to a NUL byte, CategoryMapper the whole string: not the same op."""
    model = equal_model(pad=("a\x00b",))
    done, ctx = run_pass(model, "string-embedding")
    assert "StringEqual" in ops(done)
    assert "NUL byte" in " ".join(ctropt.REGISTRY["string-embedding"].misses(to_graph(model), "ort"))


@pytest.mark.parametrize("name,want", [("wdl_strings", {"StringEqual": -1, "Unique": -1, "ReduceSum": 0}),
                                       ("din_strings", {"StringEqual": -1})])
def test_the_zoo_string_models(name, want):
    path = zoo.shipped_path(name)
    model = load(path)
    with np.load(path.with_suffix(".npz")) as f:
        feeds = {k: f[k] for k in f.files}
    done, ctx = run_pass(model, "string-embedding")
    before, after = collections.Counter(ops(model)), collections.Counter(ops(done))
    assert {op: after[op] - before[op] for op in want} == want
    a, b = Runner(model, threads=1).run(feeds), Runner(done, threads=1).run(feeds)
    assert np.array_equal(b["prob"], a["prob"])
    assert run_pass(done, "string-embedding")[1].rewrites == 0


def test_without_the_library_the_padding_is_not_hashed_ahead(monkeypatch):
    """The padding's id is computed with onnxruntime-extensions: without it that rule declines, saying why."""
    model = ids_model()
    monkeypatch.setattr(strings.importlib.util, "find_spec", lambda name: None)
    done, ctx = run_pass(model, "string-embedding")
    assert "Unique" not in ops(done) and ops(done).count("StringToHashBucketFast") == 1
    misses = " ".join(ctropt.REGISTRY["string-embedding"].misses(to_graph(done), "ort"))
    assert "the padding's id cannot be computed" in misses
