"""String features: tf2onnx's ai.onnx.contrib ops run by onnxruntime-extensions (hash buckets, vocabularies, split).

The shipped zoo exports (wdl_strings, din_strings) run without TensorFlow; the exact-id checks against TensorFlow
export a small function and skip without it. What runs a model skips where onnxruntime-extensions is not installed
(its library is looked up without importing the package: 0.14's __init__ imports transformers).
"""

from pathlib import Path

import numpy as np
import onnx
import pytest

import ctropt
from ctropt.exporters import zoo
from ctropt.graph import CtroptError, export_graph, interface, load, to_graph
from ctropt.runtime import Runner, compare_outputs, generate_inputs, model_input_facts, strings
from ctropt.runtime.inputs import InputFacts
from ctropt.runtime.session import available_backends

needs_library = pytest.mark.skipif(not strings.available(), reason=f"{strings.PACKAGE} not installed: "
                                   f"pip install '{strings.REQUIREMENT}'")

# what TensorFlow users feed: seen and unseen, empty, other scripts, emoji, long, whitespace
SAMPLE = ["", " ", "us", "de", "zz-unseen", "user_42", "héllo", "日本語", "🙂", "x" * 300, "tab\tsep", "a|b", "a||b|",
          "électronique", "家居"] + [f"u{i:05d}" for i in range(1000)]


def shipped(name):
    path = zoo.shipped_path(name)
    with np.load(path.with_suffix(".npz")) as f, np.load(path.with_suffix(".ref.npz")) as r:
        return load(path), {k: f[k] for k in f.files}, {k: r[k] for k in r.files}


@needs_library
def test_installed_library_hashes_like_tensorflow():
    assert strings.hashes_like_tensorflow(), f"{strings.PACKAGE} {strings.version()} does not hash as TensorFlow"


@needs_library
@pytest.mark.parametrize("name", zoo.STRINGS)
def test_runner_registers_the_library_and_matches_tensorflow(name):
    model, feeds, reference = shipped(name)
    assert strings.uses_strings(model)
    diffs = compare_outputs(reference, Runner(model).run(feeds), atol=1e-5, rtol=0)
    assert all(d.ok for d in diffs), diffs


def test_missing_library_is_a_clear_error(monkeypatch):
    model, _, _ = shipped("wdl_strings")
    monkeypatch.setattr(strings.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(CtroptError, match=r"onnxruntime-extensions is not installed: pip install"):
        Runner(model)


@needs_library
def test_a_library_that_hashes_otherwise_is_refused(monkeypatch):
    model, _, _ = shipped("wdl_strings")
    monkeypatch.setattr(strings, "hashes_like_tensorflow", lambda: False)
    with pytest.raises(CtroptError, match="farmhash"):
        Runner(model)


@needs_library
@pytest.mark.parametrize("name", zoo.STRINGS)
def test_optimize_all_passes_keeps_outputs(name):
    model, feeds, reference = shipped(name)
    result = ctropt.optimize(model, passes=["all"], speed=False)
    assert not result.failed, [(r.name, r.message) for r in result.failed]
    assert interface(result.model) == interface(model)
    assert strings.uses_strings(result.model)
    diffs = compare_outputs(reference, Runner(result.model).run(feeds), atol=1e-5, rtol=0)
    assert all(d.ok for d in diffs), diffs


@needs_library
def test_string_constants_survive_a_graph_round_trip():
    model, feeds, reference = shipped("wdl_strings")
    graph = to_graph(model)
    loaded = [t.values for t in graph.tensors().values() if hasattr(t, "values") and t.values.dtype == object]
    assert loaded, "the export holds string constants (the split separator, the \"\" of the tag mask)"
    again = export_graph(graph)
    onnx.checker.check_model(again)
    assert compare_outputs(reference, Runner(again).run(feeds), atol=1e-6, rtol=0)[0].ok


def test_generated_string_inputs_read_the_graph():
    wdl, din = (load(zoo.shipped_path(n)) for n in zoo.STRINGS)
    facts = model_input_facts(wdl)
    assert facts["tags"].separator == "|" and "us" in facts["country"].vocab and "家居" in facts["category"].vocab
    feeds = generate_inputs(wdl, batch=40)
    assert feeds["tags"].dtype.kind == "U" and any("|" in t for t in feeds["tags"]) and "" in feeds["tags"]
    countries = set(feeds["country"])
    assert countries & set(facts["country"].vocab) and "" in countries and countries - set(facts["country"].vocab) - {""}
    feeds = generate_inputs(din, batch=13, seq_len=9)
    hist = feeds["hist_item_id"]
    assert model_input_facts(din)["hist_item_id"].padded
    lengths = (hist != "").sum(1)
    assert lengths.min() == 0 and lengths.max() == 9
    assert all((row[:n] != "").all() and (row[n:] == "").all() for row, n in zip(hist, lengths))  # padded at the end
    assert ((feeds["hist_cate_id"] != "") == (hist != "")).all()


def test_facts_keep_vocabulary_and_separator_in_metadata():
    facts = InputFacts(vocab=["us", "家居"], separator="|", padded=True)
    assert InputFacts.from_json(facts.to_json()) == facts


# ------------------------------------------------------------------------------------------ against TensorFlow


def _tf_graph(tf):
    """Hash buckets, a vocabulary with an OOV id, one with OOV buckets, and split tokens: ids as outputs."""
    from tensorflow.python.ops import lookup_ops

    s = tf.compat.v1.placeholder(tf.string, [None], name="s")
    tf.strings.to_hash_bucket_fast(s, 1000003, name="hashed")
    init = tf.lookup.KeyValueTensorInitializer(tf.constant(["us", "de", "家居"]), tf.constant([1, 2, 3], tf.int64))
    tf.identity(tf.lookup.StaticHashTable(init, default_value=0).lookup(s), name="vocab")
    tf.identity(lookup_ops.index_table_from_tensor(tf.constant(["us", "de"]), num_oov_buckets=3).lookup(s), "oov")
    tokens = tf.strings.split(s, sep="|").to_tensor(default_value="")
    tf.identity(tf.strings.to_hash_bucket_fast(tokens, 97), name="tokens")
    return tf.compat.v1.tables_initializer(name="init_all_tables")


def _frozen(tf, keep_init=True):
    graph = tf.Graph()
    with graph.as_default():
        init = _tf_graph(tf)
        with tf.compat.v1.Session(graph=graph) as sess:
            names = ["hashed", "vocab", "oov", "tokens"] + (["init_all_tables"] if keep_init else [])
            return tf.compat.v1.graph_util.convert_variables_to_constants(sess, graph.as_graph_def(), names), init


@needs_library
def test_export_ids_equal_tensorflow_on_unseen_and_empty_strings():
    tf = pytest.importorskip("tensorflow")
    from ctropt.exporters.common import check_export
    from ctropt.exporters.tf import from_graph_def

    graph_def, _ = _frozen(tf)
    export = from_graph_def(graph_def, ["s"], ["hashed", "vocab", "oov", "tokens"])
    feeds = {"s": np.array(SAMPLE)}
    want, got = export.run_framework(feeds), Runner(export.model).run(feeds)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    assert got["vocab"][SAMPLE.index("zz-unseen")] == 0 and got["vocab"][SAMPLE.index("家居")] == 3
    checks = check_export(export, lambda b, t, rng: {"s": rng.choice(np.array(SAMPLE), size=b)}, batches=(1, 64))
    assert all(c.ok and c.ids > 0 for c in checks), checks  # ids compared inside the graph too


@needs_library
def test_a_frozen_graph_without_its_table_initializer_is_a_clear_error():
    tf = pytest.importorskip("tensorflow")
    from ctropt.exporters.tf import from_graph_def

    graph_def, _ = _frozen(tf, keep_init=False)
    with pytest.raises(CtroptError, match="table initializer"):
        from_graph_def(graph_def, ["s"], ["vocab"])


# ------------------------------------------------------- DeepRec's string dialect (tests/data/thirdparty/make_deeprec_strings.py)


def _sliced_split(tf, start, size, vocab=True):
    """DeepRec DIN's history: tf.strings.split(s, '\\x02') (a SparseTensor, TF1), tf.sparse.slice, a vocabulary."""
    graph = tf.Graph()
    with graph.as_default():
        s = tf.compat.v1.placeholder(tf.string, [None], name="s")
        sp = tf.compat.v1.strings.split(s, "\x02")
        sp = tf.sparse.slice(sp, start, size)
        tf.identity(sp.indices, name="indices")
        tf.identity(sp.dense_shape, name="shape")
        table = lookup_table = None
        if vocab:
            from tensorflow.python.ops import lookup_ops
            lookup_table = lookup_ops.index_table_from_tensor(tf.constant(["a", "b", "家居"]), default_value=0)
            table = lookup_table.lookup(sp.values)
        tf.identity(table if vocab else tf.strings.to_hash_bucket_fast(sp.values, 50), name="ids")
        keep = ["indices", "shape", "ids"] + (["init_all_tables"] if vocab else [])
        if vocab:
            tf.compat.v1.tables_initializer(name="init_all_tables")
        with tf.compat.v1.Session(graph=graph) as sess:
            return tf.compat.v1.graph_util.convert_variables_to_constants(sess, graph.as_graph_def(), keep)


@needs_library
@pytest.mark.parametrize("start,size", [([0, 0], [4, 3]), ([1, 1], [2, 9]), ([0, 2], [9, 9]), ([5, 0], [2, 2])])
def test_sparse_slice_of_a_split_exports_as_tensorflow_slices(start, size):
    """tf2onnx has no SparseSlice converter; ctropt's handler keeps the entries inside, shifted, in order, and the
    dense shape max(min(start + size, shape) - start, 0)."""
    tf = pytest.importorskip("tensorflow")
    from ctropt.exporters.tf import from_graph_def

    export = from_graph_def(_sliced_split(tf, start, size), ["s"], ["indices", "shape", "ids"])
    assert not any(n.op_type == "SparseSlice" for n in export.model.graph.node)
    feeds = {"s": np.array(["a\x02b\x02c\x02家居", "\x02", "b", "a\x02\x02b\x02", "🙂\x02a\x02zz\x02a\x02b"])}
    want, got = export.run_framework(feeds), Runner(export.model).run(feeds)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@needs_library
@pytest.mark.xfail(strict=True, reason="KNOWN BUG: onnxruntime-extensions' StringSplit makes no token of \"\" where "
                   "TensorFlow's StringSplitV2 with a separator makes one (\"\"): a batch of empty DeepRec DIN "
                   "histories fails in onnxruntime (integer division by zero) where TensorFlow runs")
def test_an_empty_string_splits_into_one_empty_token_as_in_tensorflow():
    tf = pytest.importorskip("tensorflow")
    from ctropt.exporters.tf import from_graph_def

    export = from_graph_def(_sliced_split(tf, [0, 0], [4, 3]), ["s"], ["indices", "shape", "ids"])
    feeds = {"s": np.array(["a\x02b", ""])}
    want, got = export.run_framework(feeds), Runner(export.model).run(feeds)
    np.testing.assert_array_equal(got["indices"], want["indices"])


def test_an_op_tf2onnx_cannot_convert_is_named_at_export(monkeypatch):
    """tf2onnx's table path converts with continue_on_error: an op it has no handler for is left in the model
    under its TensorFlow name; export says which instead of onnxruntime refusing the model later."""
    tf = pytest.importorskip("tensorflow")
    from tf2onnx.handler import tf_op

    from ctropt.exporters import tf as tf_export

    tf_export._tf()  # ctropt's handlers registered: take SparseSlice's away for this test
    for ops in tf_op.get_opsets()[""]:
        if "SparseSlice" in ops:
            monkeypatch.delitem(ops, "SparseSlice")
    with pytest.raises(CtroptError, match=r"no converter for the TensorFlow op\(s\) SparseSlice \(1\)"):
        tf_export.from_graph_def(_sliced_split(tf, [0, 0], [4, 3]), ["s"], ["indices", "shape", "ids"])


def test_split_histories_get_the_vocabulary_and_one_token_count_per_row():
    """Two split histories of one user (DeepRec DIN): tokens are the vocabulary's words (looked up after a
    Compress, the exported tf.sparse.slice) and every row has as many tokens in both (the model concatenates them)."""
    model = load(Path(__file__).parent / "data" / "thirdparty" / "deeprec_DIN_strings_tf2onnx.onnx")
    facts = model_input_facts(model)
    assert facts["HISTORY_ITEM"].separator == "\x02" and "B00001" in facts["HISTORY_ITEM"].vocab
    for seed in range(4):
        feeds = generate_inputs(model, batch=13, seed=seed)
        items, cates = ([len(v.split("\x02")) if v else 0 for v in feeds[k]] for k in ("HISTORY_ITEM",
                                                                                        "HISTORY_CATEGORY"))
        assert items == cates and 0 in items
        tokens = {t for v in feeds["HISTORY_ITEM"] for t in v.split("\x02")}
        assert tokens & set(facts["HISTORY_ITEM"].vocab) and "" in tokens


@needs_library
def test_split_strings_keeps_the_rank_dims_static():
    """A SparseTensor's dense_shape handed to the id model keeps its static length (the rank): OpenVINO refuses a
    Reshape of dynamic rank. The id model of DeepRec DIN then runs in OpenVINO once lowered for it."""
    from ctropt.string_front import split_strings

    model = load(Path(__file__).parent / "data" / "thirdparty" / "deeprec_DIN_strings_tf2onnx.onnx")
    ids, front = split_strings(model)
    dims = {i.name: [d.dim_value or d.dim_param for d in i.type.tensor_type.shape.dim] for i in ids.graph.input}
    assert dims["input_layer/to_sparse_input/dense_shape:0"] == [2]
    assert dims["StringSplit/StringSplitV2:0"][1] == 2 and isinstance(dims["StringSplit/StringSplitV2:0"][0], str)
    if "openvino-cpu" in available_backends():
        feeds = generate_inputs(model, batch=9, seed=1)
        lowered = ctropt.optimize(ids, passes="all", target="openvino", speed=False, feeds=front.ids(feeds)).model
        want = Runner(model).run(feeds)
        got = Runner(lowered, "openvino-cpu").run(front.ids(feeds))
        assert all(d.ok for d in compare_outputs(want, got, atol=1e-5, rtol=1e-4))
