"""String features: tf2onnx's ai.onnx.contrib ops run by onnxruntime-extensions (hash buckets, vocabularies, split).

The shipped zoo exports (wdl_strings, din_strings) run without TensorFlow; the exact-id checks against TensorFlow
export a small function and skip without it. What runs a model skips where onnxruntime-extensions is not installed
(its library is looked up without importing the package: 0.14's __init__ imports transformers).
"""

import numpy as np
import onnx
import pytest

import ctropt
from ctropt.exporters import zoo
from ctropt.graph import CtroptError, export_graph, interface, load, to_graph
from ctropt.runtime import Runner, compare_outputs, generate_inputs, model_input_facts, strings
from ctropt.runtime.inputs import InputFacts

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
