"""Exporters: every TensorFlow source form through tf2onnx, both torch.onnx exporters, and the numeric
check that catches a wrong export. Skipped where the framework is not installed (CI installs both)."""

import numpy as np
import onnx
import pytest
from typer.testing import CliRunner

from ctropt.cli import app
from ctropt.exporters import check_export
from ctropt.graph import CtroptError

runner = CliRunner()


def sample(batch, seq_len, rng):
    return {"ids": rng.integers(0, 50, size=(batch, 3)).astype(np.int64),
            "dense": rng.standard_normal((batch, 4)).astype(np.float32)}


def interface(model):
    def dims(v):
        return [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]

    return {v.name: dims(v) for v in list(model.graph.input) + list(model.graph.output)}


# ----------------------------------------------------------------------------------------- TensorFlow


@pytest.fixture(scope="module")
def tf():
    return pytest.importorskip("tensorflow")


def tf1_graph(tf):
    """A tiny TF1 CTR graph: embedding lookup + dense → logistic output, variables in a session."""
    graph = tf.Graph()
    with graph.as_default():
        ids = tf.compat.v1.placeholder(tf.int64, [None, 3], name="ids")
        dense = tf.compat.v1.placeholder(tf.float32, [None, 4], name="dense")
        init = tf.compat.v1.random_normal_initializer(seed=1)
        table = tf.compat.v1.get_variable("table", [50, 8], initializer=init)
        w = tf.compat.v1.get_variable("w", [3 * 8 + 4, 1], initializer=init)
        emb = tf.reshape(tf.nn.embedding_lookup(table, ids), [-1, 24])
        tf.sigmoid(tf.matmul(tf.concat([emb, dense], 1), w), name="prob")
        sess = tf.compat.v1.Session(graph=graph)
        sess.run(tf.compat.v1.global_variables_initializer())
    return graph, sess


def test_tf1_checkpoint_and_frozen_pb(tf, tmp_path):
    from ctropt.exporters import tf as tfx

    graph, sess = tf1_graph(tf)
    with graph.as_default():
        tf.compat.v1.train.Saver().save(sess, str(tmp_path / "model.ckpt"))
        frozen = tf.compat.v1.graph_util.convert_variables_to_constants(sess, graph.as_graph_def(), ["prob"])
    (tmp_path / "frozen.pb").write_bytes(frozen.SerializeToString())
    for path in (tmp_path / "model.ckpt.meta", tmp_path / "frozen.pb"):
        exp = tfx.export_path(path, ["ids", "dense"], ["prob"])
        assert interface(exp.model) == {"ids": ["batch", 3], "dense": ["batch", 4], "prob": ["batch", 1]}
        assert all(c.ok and c.max_abs_err <= 1e-5 for c in check_export(exp, sample))
    with pytest.raises(CtroptError, match="--input and --output"):
        tfx.export_path(tmp_path / "frozen.pb")


def keras_model(tf):
    keras = tf.keras
    ids = keras.Input((3,), dtype="int64", name="ids")
    dense = keras.Input((4,), name="dense")
    emb = keras.layers.Flatten()(keras.layers.Embedding(50, 8)(ids))
    out = keras.layers.Dense(1, activation="sigmoid", name="head")(keras.layers.Concatenate()([emb, dense]))
    return keras.Model([ids, dense], out)


def test_keras_model_file_function_and_saved_model(tf, tmp_path):
    from ctropt.exporters import tf as tfx

    model = keras_model(tf)
    exp = tfx.from_keras(model)  # tf2onnx's own from_keras fails on Keras 3
    assert [i.name for i in exp.model.graph.input] == ["ids", "dense"]
    assert all(c.ok for c in check_export(exp, sample))

    model.save(tmp_path / "m.keras")
    assert all(c.ok for c in check_export(tfx.export_path(tmp_path / "m.keras"), sample))

    module = tf.Module()
    module.model = model
    specs = [tf.TensorSpec([None, 3], tf.int64, name="ids"), tf.TensorSpec([None, 4], tf.float32, name="dense")]
    module.serve = tf.function(lambda ids, dense: {"prob": model([ids, dense])}, input_signature=specs)
    tf.saved_model.save(module, str(tmp_path / "saved"), signatures={"serving_default": module.serve})
    exp = tfx.export_path(tmp_path / "saved")
    assert sorted(i.name for i in exp.model.graph.input) == ["dense", "ids"]
    assert all(c.ok for c in check_export(exp, sample))


def test_wrong_export_is_reported_loudly(tf, tmp_path):
    """The check compares with the framework; a tampered export must fail it."""
    from ctropt.exporters import tf as tfx

    exp = tfx.from_keras(keras_model(tf))
    weights = max(exp.model.graph.initializer, key=lambda t: len(t.raw_data))
    weights.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(weights) * 1.01, weights.name))
    assert not all(c.ok for c in check_export(exp, sample))


# ----------------------------------------------------------------------------------------- PyTorch


@pytest.fixture(scope="module")
def torch():
    return pytest.importorskip("torch")


def torch_module(torch):
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.emb = torch.nn.Embedding(50, 8)
            self.fc = torch.nn.Linear(3 * 8 + 4, 1)

        def forward(self, ids, dense):
            return torch.sigmoid(self.fc(torch.cat([self.emb(ids).flatten(1), dense], 1)))

    return Model()


@pytest.mark.parametrize("exporter", ["legacy", "dynamo"])
def test_torch_exporters_with_dynamic_batch(torch, exporter):
    from ctropt.exporters.torch import export_module

    example = sample(2, None, np.random.default_rng(0))
    exp = export_module(torch_module(torch), example, ["prob"], exporter=exporter)
    assert interface(exp.model) == {"ids": ["batch", 3], "dense": ["batch", 4], "prob": ["batch", 1]}
    checks = check_export(exp, sample)
    assert [c.batch for c in checks] == [1, 7, 256] and all(c.ok for c in checks)


def test_export_cli_on_a_keras_file(tf, tmp_path):
    keras_model(tf).save(tmp_path / "m.keras")
    result = runner.invoke(app, ["export", str(tmp_path / "m.keras"), "-o", str(tmp_path / "m.onnx"),
                                 "--batch", "1,7"])
    assert result.exit_code == 0, result.output
    assert "tf2onnx vs framework" in result.output and "yes" in result.output
    assert onnx.load(tmp_path / "m.onnx").graph.input[0].name == "ids"
