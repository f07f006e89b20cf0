#!/usr/bin/env python
"""Export third-party CTR models (deepctr-torch, DeepCTR/TF) to ONNX and check them
in ONNX Runtime and OpenVINO.

Environment (a venv of its own, not ctropt's): torch==2.13.0, tensorflow-cpu 2.21, tf_keras, tf2onnx 1.17,
onnx, onnxscript, onnxruntime, openvino, and deepctr-torch 0.3.0 + deepctr 0.9.4 installed with --no-deps
(then tqdm, scikit-learn, requests, h5py by hand; DeepCTR needs TF_USE_LEGACY_KERAS=1 with tf_keras).

Usage (from this directory):
    python make_exports.py            # everything + REPORT tables
    python make_exports.py torch DIN  # one library / one model (both exporters)
    python make_exports.py tf DIEN_AUGRU
    python make_exports.py report     # regenerate results table only

DIEN needs patches to export at all (kept in this file, none to library code): deepctr-torch's
pack_padded_sequence path fails in both torch exporters (`_padded` variants replace it by masked padded code
with the same weights); DeepCTR's DIEN needs TF internals that moved in 2.21 re-added, and its AUGRU/AGRU
exports fail in onnxruntime at any batch but 16 (`_where` variants fix the row select). tests/data/thirdparty
keeps the exports that run, and broken/ one that does not.

Every (library, model) runs in its own subprocess (TF and torch are never loaded in the
same process; a crash in one model does not stop the rest).  Per-export results are written
to results/<lib>_<model>_<exporter>.json and collected into results_table.md, which
REPORT.md includes.

Outputs per export, in this directory:
    <lib>_<model>_<exporter>.onnx     the model (ir_version clamped to <= 10 for ORT 1.31)
    <lib>_<model>_<exporter>.npz      sample batch (B=8), keys = ONNX graph input names
    <lib>_<model>_<exporter>.ref.npz  framework outputs, keys = ONNX graph output names
Nothing is downloaded at run time: all weights are random (seeded).
"""
import json
import os
import subprocess
import sys
import time
import traceback
from collections import Counter

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
RES_DIR = os.path.join(HERE, "results")
OPSET = 17          # legacy torch exporter and tf2onnx
DYNAMO_OPSET = 18   # dynamo exporter: its native opset. At 17 the exporter down-converts and
                    # leaves opset-18-only Split(num_outputs=..) nodes -> invalid model (REPORT.md)
B = 8          # saved sample batch
B2 = 5         # second batch: checks that the dynamic batch / sequence lengths really generalise
MAXLEN = 10
EMB = 8

TORCH_MODELS = ["WDL", "DeepFM", "DCN", "MMOE", "DIN",
                "DIEN_GRU", "DIEN_AUGRU", "DIEN_AGRU", "DIEN_AIGRU",
                # same DIEN models with pack_padded_sequence replaced by mask-based padded code
                # (export-friendly monkeypatch, see patch_dien_torch_padded)
                "DIEN_GRU_padded", "DIEN_AUGRU_padded", "DIEN_AGRU_padded", "DIEN_AIGRU_padded"]
TF_MODELS = ["WDL", "DeepFM", "DCN", "MMOE", "DIN",
             "DIEN_GRU", "DIEN_AUGRU", "DIEN_AGRU", "DIEN_AIGRU",
             # + rnn_v2's v1-style row Select rewritten as broadcasting SelectV2 (patch_rnn_where)
             "DIEN_GRU_where", "DIEN_AUGRU_where", "DIEN_AGRU_where", "DIEN_AIGRU_where",
             "BST"]

# ----------------------------------------------------------------------------- feature spec
# (name, kind, vocab/dim, embedding_name)
BASE_FEATS = [
    ("user_id", "sparse", 1000, None),
    ("item_id", "sparse", 500, None),
    ("cate_id", "sparse", 100, None),
    ("gender", "sparse", 3, None),
    ("age", "sparse", 10, None),
    ("price", "dense", 1, None),
    ("score", "dense", 1, None),
]
SEQ_FEATS = [
    ("hist_item_id", "seq", 500, "item_id"),
    ("hist_cate_id", "seq", 100, "cate_id"),
]
LENGTH_NAME = "seq_length"


def gen_data(spec, batch, rng, min_len=1):
    """Raw feature values: sparse ids int64 [B], dense float32 [B, d], seq ids int64 [B, T]
    (0-padded after the sequence length), seq_length int64 [B]."""
    d = {}
    lens = rng.integers(min_len, MAXLEN + 1, size=batch)
    for name, kind, v, _ in spec:
        if kind == "sparse":
            d[name] = rng.integers(1, v, size=batch).astype(np.int64)
        elif kind == "dense":
            d[name] = rng.normal(size=(batch, v)).astype(np.float32)
        elif kind == "seq":
            ids = rng.integers(1, v, size=(batch, MAXLEN)).astype(np.int64)
            ids[np.arange(MAXLEN)[None, :] >= lens[:, None]] = 0
            d[name] = ids
    if any(k == "seq" for _, k, _, _ in spec):
        d[LENGTH_NAME] = lens.astype(np.int64)
    return d


# ----------------------------------------------------------------------------- ONNX checks
def walk_nodes(graph):
    """All nodes, including those inside Loop/Scan/If bodies and model-local functions."""
    for n in graph.node:
        yield n
        for a in n.attribute:
            if a.type == 5:      # GRAPH
                yield from walk_nodes(a.g)
            elif a.type == 10:   # GRAPHS
                for g in a.graphs:
                    yield from walk_nodes(g)


def model_stats(m):
    nodes = list(walk_nodes(m.graph))
    for f in m.functions:   # dynamo exporter may leave local functions
        for n in f.node:
            nodes.append(n)
    top = len(m.graph.node)
    hist = Counter(n.op_type if not n.domain or n.domain == "ai.onnx" else f"{n.domain}:{n.op_type}"
                   for n in nodes)
    sub = Counter()
    for n in m.graph.node:
        for a in n.attribute:
            if a.type in (5, 10):
                gs = [a.g] if a.type == 5 else list(a.graphs)
                for g in gs:
                    sub.update(x.op_type for x in walk_nodes(g))
    opsets = {o.domain or "ai.onnx": o.version for o in m.opset_import}
    return dict(nodes_total=len(nodes), nodes_top=top, op_hist=dict(hist.most_common()),
                subgraph_ops=dict(sub.most_common()), n_functions=len(m.functions),
                opsets=opsets, ir_version=m.ir_version,
                inputs=[(i.name, i.type.tensor_type.elem_type,
                         [dd.dim_param or dd.dim_value for dd in i.type.tensor_type.shape.dim])
                        for i in m.graph.input],
                outputs=[o.name for o in m.graph.output])


def max_err(outs, refs):
    e = 0.0
    for k, v in refs.items():
        o = np.asarray(outs[k], dtype=np.float64)
        r = np.asarray(v, dtype=np.float64)
        if o.shape != r.shape:
            if o.size == r.size:
                o = o.reshape(r.shape)
            else:
                return float("inf"), f"shape mismatch for {k}: {o.shape} vs {r.shape}"
        e = max(e, float(np.max(np.abs(o - r))) if r.size else 0.0)
    return e, None


def check_export(path, inputs, refs, inputs2, refs2):
    import onnx
    res = {}
    m = onnx.load(path)
    res["size_bytes"] = os.path.getsize(path)
    res.update(model_stats(m))
    try:
        onnx.checker.check_model(m)
        res["onnx_checker"] = "ok"
    except Exception as e:  # noqa
        res["onnx_checker"] = f"{type(e).__name__}: {str(e)[:300]}"
    # ---------------- ORT
    try:
        import onnxruntime as ort
        s = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        names = [o.name for o in s.get_outputs()]
        outs = dict(zip(names, s.run(None, inputs)))
        res["ort_ok"] = True
        res["ort_err"], msg = max_err(outs, refs)
        if msg:
            res["ort_note"] = msg
        try:
            outs2 = dict(zip(names, s.run(None, inputs2)))
            res["ort_err_b2"], msg = max_err(outs2, refs2)
            if msg:
                res["ort_note_b2"] = msg
        except Exception as e:  # noqa
            res["ort_err_b2"] = None
            res["ort_b2_error"] = f"{type(e).__name__}: {str(e)[:500]}"
    except Exception as e:  # noqa
        res["ort_ok"] = False
        res["ort_error"] = f"{type(e).__name__}: {str(e)[:800]}"
    # ---------------- OpenVINO
    try:
        import openvino as ov
        core = ov.Core()
        cm = core.compile_model(path, "CPU")
        res["ov_ok"] = True

        def ov_run(inp):
            r = cm(inp)
            out = {}
            for o in cm.outputs:
                for nm in o.get_names():
                    if nm in refs:
                        out[nm] = r[o]
            return out
        try:
            res["ov_err"], msg = max_err(ov_run(inputs), refs)
            if msg:
                res["ov_note"] = msg
        except Exception as e:  # noqa
            res["ov_err"] = None
            res["ov_infer_error"] = f"{type(e).__name__}: {str(e)[:800]}"
        try:
            res["ov_err_b2"], _ = max_err(ov_run(inputs2), refs2)
        except Exception as e:  # noqa
            res["ov_err_b2"] = None
            res["ov_b2_error"] = f"{type(e).__name__}: {str(e)[:500]}"
    except Exception as e:  # noqa
        res["ov_ok"] = False
        res["ov_error"] = f"{type(e).__name__}: {str(e)[:1500]}"
    return res


def finalize_onnx(path):
    """Clamp IR version (onnx 1.23 writes IR 14, ORT 1.31 reads <= 13)."""
    import onnx
    m = onnx.load(path)
    orig = m.ir_version
    m.ir_version = min(m.ir_version, 10)
    onnx.save(m, path)
    return orig


def write_result(lib, model, exporter, res):
    os.makedirs(RES_DIR, exist_ok=True)
    res.update(lib=lib, model=model, exporter=exporter)
    with open(os.path.join(RES_DIR, f"{lib}_{model}_{exporter}.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    short = {k: res.get(k) for k in ("nodes_total", "ort_ok", "ort_err", "ort_err_b2", "ov_ok",
                                      "ov_err", "ov_err_b2", "export_error", "ov_error", "ort_error")}
    print(f"[{lib}/{model}/{exporter}] {short}", flush=True)


# ----------------------------------------------------------------------------- torch
def init_torch_weights(model, seed, emb_std=0.3):
    """deepctr's init_std=1e-4 makes every output ~sigmoid(0); use larger seeded weights so
    numerical comparisons are meaningful (embeddings N(0, emb_std))."""
    import torch
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                std = emb_std if "embedding" in name else 1.0 / np.sqrt(p.shape[-1])
                p.copy_(torch.randn(p.shape, generator=g) * std)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1 + (1.0 if name.endswith("bn.weight") else 0.0))


def patch_dien_torch_padded():
    """WORKAROUND: deepctr-torch DIEN uses pack_padded_sequence + data-dependent row filtering
    (keys_length > 0, masked_select) and, for AGRU/AUGRU, a Python loop over
    PackedSequence.batch_sizes.  Neither torch exporter handles that (see REPORT.md).  This
    monkeypatch replaces InterestExtractor.forward / InterestEvolving.forward with an
    equivalent padded implementation: run the GRU over all T steps, mask by
    t < keys_length, pick the state at keys_length-1, and zero rows with keys_length == 0.
    The weights / sub-modules of the library model are used unchanged."""
    import torch
    from deepctr_torch.models import dien as D

    def extractor_forward(self, keys, keys_length, neg_keys=None):
        B, T, H = keys.size()
        mask = (torch.arange(T, device=keys.device).unsqueeze(0) < keys_length.view(-1, 1)).to(keys.dtype)
        interests, _ = self.gru(keys)
        return interests * mask.unsqueeze(-1), torch.zeros((1,), device=keys.device)

    def evolving_forward(self, query, keys, keys_length, mask=None):
        B, H = query.size()
        T = keys.size(1)
        valid = (keys_length > 0).to(query.dtype).view(-1, 1)
        klen = torch.clamp(keys_length, min=1)
        q = query.unsqueeze(1)
        step_mask = torch.arange(T, device=keys.device).unsqueeze(0) < klen.view(-1, 1)   # [B, T]
        last = (klen - 1).view(-1, 1, 1).expand(-1, 1, H)
        if self.gru_type == "GRU":
            interests, _ = self.interest_evolution(keys)
            interests = interests * step_mask.unsqueeze(-1).to(keys.dtype)
            out = self.attention(q, interests, klen.unsqueeze(1)).squeeze(1)
        elif self.gru_type == "AIGRU":
            att = self.attention(q, keys, klen.unsqueeze(1))                  # [B, 1, T]
            interests = keys * att.transpose(1, 2)
            states, _ = self.interest_evolution(interests)                    # [B, T, H]
            out = torch.gather(states, 1, last).squeeze(1)
        else:  # AGRU / AUGRU: DynamicGRU's cell applied step by step
            att = self.attention(q, keys, klen.unsqueeze(1)).squeeze(1)       # [B, T]
            cell = self.interest_evolution.rnn
            h = torch.zeros(B, H, dtype=keys.dtype, device=keys.device)
            for t in range(T):
                nh = cell(keys[:, t], h, att[:, t])
                h = torch.where(step_mask[:, t:t + 1], nh, h)
            out = h
        return out * valid

    orig = (D.InterestExtractor.forward, D.InterestEvolving.forward)
    new = (extractor_forward, evolving_forward)

    def use(which):
        D.InterestExtractor.forward, D.InterestEvolving.forward = orig if which == "orig" else new
    return use


# Layer sizes of the toy exports; benchmarks/production_corpus.py passes its own.
TOY_SIZES = dict(hid=(32, 16), cross_num=2, experts=3, expert_hid=None, gate=(16,), tower=(8,), att=(16, 8),
                 cin=(16, 16), low_rank=8, heads=2, transformer_num=1)


def torch_columns(spec, emb=EMB, maxlen=MAXLEN):
    """deepctr-torch feature columns of a (name, kind, vocab/dim, embedding_name) spec."""
    from deepctr_torch.inputs import SparseFeat, DenseFeat, VarLenSparseFeat
    c = []
    for name, kind, v, emb_name in spec:
        if kind == "sparse":
            c.append(SparseFeat(name, v, embedding_dim=emb))
        elif kind == "dense":
            c.append(DenseFeat(name, v))
        elif kind == "seq":
            c.append(VarLenSparseFeat(SparseFeat(name, v, embedding_dim=emb, embedding_name=emb_name),
                                      maxlen=maxlen, length_name=LENGTH_NAME))
    return c


def build_torch_model(model_name, fc, sizes=TOY_SIZES, history=("item_id", "cate_id")):
    """A deepctr-torch model of the given name on feature columns `fc` (the toy layer sizes by default)."""
    from deepctr_torch import models as M
    z = sizes
    hid = z["hid"]
    if model_name == "WDL":
        return M.WDL(fc, fc, dnn_hidden_units=hid, seed=1)
    if model_name == "DeepFM":
        return M.DeepFM(fc, fc, dnn_hidden_units=hid, seed=1)
    if model_name == "DCN":
        return M.DCN(fc, fc, cross_num=z["cross_num"], dnn_hidden_units=hid, seed=1)
    if model_name == "DCNMix":
        return M.DCNMix(fc, fc, cross_num=z["cross_num"], dnn_hidden_units=hid, low_rank=z["low_rank"],
                        num_experts=z["experts"], seed=1)
    if model_name == "xDeepFM":
        return M.xDeepFM(fc, fc, dnn_hidden_units=hid, cin_layer_size=z["cin"], seed=1)
    if model_name == "MMOE":
        from deepctr_torch.models.multitask import MMOE
        return MMOE(fc, num_experts=z["experts"], expert_dnn_hidden_units=z["expert_hid"] or hid,
                    gate_dnn_hidden_units=z["gate"], tower_dnn_hidden_units=z["tower"], seed=1)
    if model_name == "DIN":
        return M.DIN(fc, list(history), dnn_hidden_units=hid, att_hidden_size=z["att"], seed=1)
    if model_name.startswith("DIEN_"):
        return M.DIEN(fc, list(history), gru_type=model_name.split("_")[1],
                      dnn_hidden_units=hid, att_hidden_units=z["att"], seed=1)
    raise ValueError(model_name)


def export_torch(model, X, path, exporter):
    """model(X) -> y to ONNX at `path`, batch axis dynamic: legacy (dynamo=False, opset 17) or dynamo (opset 18)."""
    import torch
    if exporter == "legacy":
        torch.onnx.export(model, (X,), path, dynamo=False, opset_version=OPSET,
                          input_names=["X"], output_names=["y"],
                          dynamic_axes={"X": {0: "batch"}, "y": {0: "batch"}})
    else:
        batch = torch.export.Dim("batch", min=1, max=65536)
        prog = torch.onnx.export(model, (X,), dynamo=True, opset_version=DYNAMO_OPSET,
                                 input_names=["X"], output_names=["y"],
                                 dynamic_shapes={"X": {0: batch}}, verbose=False)
        prog.save(path)


def torch_run(model_name):
    import torch
    torch.manual_seed(0)
    use_impl = patch_dien_torch_padded() if model_name.endswith("_padded") else None
    seq = model_name.startswith("DI") or model_name == "BST"
    spec = BASE_FEATS + (SEQ_FEATS if seq else [])
    model = build_torch_model(model_name, torch_columns(spec))
    init_torch_weights(model, 1234)
    model.eval()
    fi = model.feature_index
    width = max(e for _, e in fi.values())

    def to_X(raw):
        batch = len(next(iter(raw.values())))
        X = np.zeros((batch, width), np.float32)
        for name, (s, e) in fi.items():
            X[:, s:e] = raw[name].reshape(batch, -1).astype(np.float32)
        return X

    rng = np.random.default_rng(42)
    X1 = to_X(gen_data(spec, B, rng))
    X2 = to_X(gen_data(spec, B2, np.random.default_rng(7)))
    patch_diff = None
    if use_impl:   # references always come from the UNPATCHED library code
        use_impl("orig")
    with torch.no_grad():
        ref1 = model(torch.from_numpy(X1)).numpy()
        ref2 = model(torch.from_numpy(X2)).numpy()
    if use_impl:
        use_impl("new")
        with torch.no_grad():
            patch_diff = max(float(np.abs(model(torch.from_numpy(X1)).numpy() - ref1).max()),
                             float(np.abs(model(torch.from_numpy(X2)).numpy() - ref2).max()))
    layout = {name: list(se) for name, se in fi.items()}

    for exporter in ("legacy", "dynamo"):
        stem = f"deepctr_torch_{model_name}_{exporter}"
        path = os.path.join(HERE, stem + ".onnx")
        res = {"X_layout": layout, "framework_out_shape": list(ref1.shape)}
        if patch_diff is not None:
            res["patched_vs_library_max_diff"] = patch_diff
        t0 = time.time()
        try:
            if os.path.exists(path):
                os.remove(path)
            export_torch(model, torch.from_numpy(X1), path, exporter)
            res["export_s"] = round(time.time() - t0, 2)
            res["orig_ir_version"] = finalize_onnx(path)
        except Exception as e:  # noqa
            res["export_s"] = round(time.time() - t0, 2)
            tb = traceback.format_exc()
            res["export_error"] = f"{type(e).__name__}: {str(e)[:1500]}"
            res["export_traceback_tail"] = tb[-3000:]
            write_result("deepctr_torch", model_name, exporter, res)
            continue
        import onnx
        m = onnx.load(path)
        in_names = [i.name for i in m.graph.input]
        out_names = [o.name for o in m.graph.output]
        inputs = {in_names[0]: X1}
        inputs2 = {in_names[0]: X2}
        refs = {out_names[0]: ref1}
        refs2 = {out_names[0]: ref2}
        np.savez(os.path.join(HERE, stem + ".npz"), **inputs)
        np.savez(os.path.join(HERE, stem + ".ref.npz"), **refs)
        res.update(check_export(path, inputs, refs, inputs2, refs2))
        write_result("deepctr_torch", model_name, exporter, res)


# ----------------------------------------------------------------------------- TF / DeepCTR
def patch_deepctr_tf():
    """WORKAROUND: deepctr/contrib/rnn_v2.py (used by DIEN's DynamicGRU) calls TF-internal
    symbols that TF 2.21 moved or removed.  Re-add them from the public API before DIEN is
    built.  No library file is modified."""
    import tensorflow as tf
    from tensorflow.python.ops import array_ops, control_flow_ops
    from tensorflow.python.util import nest
    patched = []
    for mod, name, val in [
        (array_ops, "stack", tf.stack),
        (array_ops, "unstack", tf.unstack),
        (control_flow_ops, "Assert", tf.debugging.Assert),
        (control_flow_ops, "cond", tf.compat.v1.cond),
        (control_flow_ops, "while_loop", tf.compat.v1.while_loop),
        (nest, "is_sequence", getattr(nest, "is_nested", None)),
    ]:
        if not hasattr(mod, name) and val is not None:
            setattr(mod, name, val)
            patched.append(f"{mod.__name__}.{name}")
    # rnn_v2.dynamic_rnn does varscope.set_caching_device(lambda op: op.device); the legacy
    # GRUCell then creates its variables under init_scope (eager) where TF 2.21 raises
    # "RuntimeError: tf.device does not support functions when eager execution is enabled."
    # -> ignore callable caching devices.
    from tensorflow.python.ops import variable_scope as vs
    if not getattr(vs.VariableScope.set_caching_device, "_ctropt_patched", False):
        orig = vs.VariableScope.set_caching_device

        def set_caching_device(self, caching_device):
            if callable(caching_device):
                return None
            return orig(self, caching_device)
        set_caching_device._ctropt_patched = True
        vs.VariableScope.set_caching_device = set_caching_device
        patched.append("VariableScope.set_caching_device(ignore callables)")
    # deepctr/models/sequence/dien.py ends with a TF1 idiom
    #   tf.compat.v1.keras.backend.get_session().run(tf.compat.v1.global_variables_initializer())
    # which in eager TF2 raises "RuntimeError: The Session graph is empty..." -> no-op session
    # (Keras variables are already initialised eagerly).
    kb = tf.compat.v1.keras.backend

    class _NoSession:
        def run(self, *a, **k):
            return None
    kb.get_session = lambda *a, **k: _NoSession()
    patched.append("tf.compat.v1.keras.backend.get_session -> no-op session")
    return patched


def patch_rnn_where():
    """WORKAROUND (optional, *_where variants): deepctr.contrib.rnn_v2._rnn_step copies state
    through finished sequences with v1 array_ops.where(cond[B], x[B,H], y[B,H]) (row select).
    tf2onnx turns that Select inside the while-loop body into a Mul/Where with cond shaped
    [B] broadcast against [B,H] -> ORT: 'Attempting to broadcast an axis by a dimension other
    than 1. 8 by 16'.  Give rnn_v2 a private array_ops whose where() reshapes cond to [B,1]
    and uses broadcasting tf.where (SelectV2).  Semantics unchanged."""
    import types
    import tensorflow as tf
    from tensorflow.python.ops import array_ops
    from deepctr.contrib import rnn_v2
    proxy = types.ModuleType("array_ops_ctropt_proxy")
    proxy.__dict__.update(array_ops.__dict__)

    def where(condition, x=None, y=None, name=None):
        x = tf.convert_to_tensor(x) if x is not None else None
        # (cond comes from tf.squeeze(seq_len[B,1]) without axis -> its static rank is unknown)
        if x is not None and condition.shape.rank in (None, 1) and (x.shape.rank is None or x.shape.rank > 1):
            if x.shape.rank is not None:
                condition = tf.reshape(condition, [-1] + [1] * (x.shape.rank - 1))
            else:   # rank unknown inside the while body
                condition = tf.reshape(condition, tf.concat([[-1], tf.ones([tf.rank(x) - 1], tf.int32)], 0))
            return tf.where(condition, x, y, name=name)
        return array_ops.where(condition, x, y, name=name)
    proxy.where = where
    rnn_v2.array_ops = proxy
    return "deepctr.contrib.rnn_v2.array_ops.where -> broadcasting tf.where with cond[B,1]"


def tf_columns(spec, emb=EMB, maxlen=MAXLEN):
    """DeepCTR feature columns of a (name, kind, vocab/dim, embedding_name) spec."""
    from deepctr.feature_column import SparseFeat, DenseFeat, VarLenSparseFeat
    fc = []
    for name, kind, v, emb_name in spec:
        if kind == "sparse":
            fc.append(SparseFeat(name, v, embedding_dim=emb))
        elif kind == "dense":
            fc.append(DenseFeat(name, v))
        elif kind == "seq":
            fc.append(VarLenSparseFeat(SparseFeat(name, v, embedding_dim=emb, embedding_name=emb_name),
                                       maxlen=maxlen, length_name=LENGTH_NAME))
    return fc


def build_tf_model(model_name, fc, sizes=TOY_SIZES, history=("item_id", "cate_id")):
    """A DeepCTR (TF) model of the given name on feature columns `fc` (the toy layer sizes by default)."""
    from deepctr import models as M
    z = sizes
    hid = z["hid"]
    if model_name == "WDL":
        return M.WDL(fc, fc, dnn_hidden_units=hid, seed=1)
    if model_name == "DeepFM":
        return M.DeepFM(fc, fc, dnn_hidden_units=hid, seed=1)
    if model_name == "DCN":
        return M.DCN(fc, fc, cross_num=z["cross_num"], dnn_hidden_units=hid, seed=1)
    if model_name == "xDeepFM":
        return M.xDeepFM(fc, fc, dnn_hidden_units=hid, cin_layer_size=z["cin"], seed=1)
    if model_name == "MMOE":
        from deepctr.models.multitask import MMOE
        return MMOE(fc, num_experts=z["experts"], expert_dnn_hidden_units=z["expert_hid"] or hid,
                    gate_dnn_hidden_units=z["gate"], tower_dnn_hidden_units=z["tower"], seed=1)
    if model_name == "DIN":
        return M.DIN(fc, list(history), dnn_hidden_units=hid, att_hidden_size=z["att"], seed=1)
    if model_name.startswith("DIEN_"):
        return M.DIEN(fc, list(history), gru_type=model_name.split("_")[1],
                      dnn_hidden_units=hid, att_hidden_units=z["att"], seed=1)
    if model_name == "BST":
        # history = concat(hist_item_id, hist_cate_id) embeddings -> 2*EMB = 16 wide; 2 heads of 8.
        # BST reads features["seq_length"] (LENGTH_NAME) for both of its masks.
        return M.BST(fc, list(history), transformer_num=z["transformer_num"], att_head_num=z["heads"],
                     dnn_hidden_units=hid, seed=1)
    raise ValueError(model_name)


def init_tf_weights(model, seed, emb_std=0.3):
    """Seeded, larger-than-default weights (see init_torch_weights); BatchNorm statistics made non-trivial."""
    rng_w = np.random.default_rng(seed)
    new_w = []
    for w in model.weights:
        shp = tuple(w.shape)
        nm = w.name
        if "moving_variance" in nm:
            a = 1.0 + np.abs(rng_w.normal(size=shp)) * 0.1
        elif "moving_mean" in nm:
            a = rng_w.normal(size=shp) * 0.1
        elif len(shp) >= 2:
            std = emb_std if "emb" in nm else 1.0 / np.sqrt(shp[0])
            a = rng_w.normal(size=shp) * std
        else:
            a = rng_w.normal(size=shp) * 0.1
        new_w.append(a.astype(w.dtype.as_numpy_dtype))
    for w, a in zip(model.weights, new_w):
        w.assign(a)


def tf_serving(model):
    """The Keras model served with a dynamic batch: (input signature, the serving tf.function, feed(raw) -> inputs
    named and shaped as the signature, framework(inputs) -> list of numpy outputs)."""
    import tensorflow as tf
    kin = list(model.inputs)

    def feed(raw):
        d = {}
        for i in kin:
            nm = i.name.split(":")[0]
            a = raw[nm]
            shp = [s for s in i.shape[1:]]
            a = a.reshape((a.shape[0],) + tuple(shp))
            d[nm] = a.astype(i.dtype.as_numpy_dtype)
        return d

    in_sig = [tf.TensorSpec((None,) + tuple(i.shape[1:]), i.dtype, name=i.name.split(":")[0]) for i in kin]

    @tf.function(input_signature=in_sig)
    def serve(*args):
        out = model(list(args), training=False)
        return out

    def framework(raw):
        out = serve(*[tf.constant(raw[s.name]) for s in in_sig])
        if isinstance(out, (list, tuple)):
            return [o.numpy() for o in out]
        return [out.numpy()]
    return in_sig, serve, feed, framework


def tf_run(model_name):
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")   # DeepCTR 0.9.4 is Keras-2 code
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf
    tf.random.set_seed(0)
    import deepctr.models  # noqa: F401  (imported before the DIEN patches, as it always was)
    seq = model_name.startswith("DI") or model_name == "BST"
    spec = BASE_FEATS + (SEQ_FEATS if seq else [])
    fc = tf_columns(spec)
    res = {}
    if model_name.startswith("DIEN"):
        res["tf_patches"] = patch_deepctr_tf()
    if model_name.endswith("_where"):
        res["tf_patches"].append(patch_rnn_where())
    t0 = time.time()
    try:
        model = build_tf_model(model_name, fc)
    except Exception as e:  # noqa
        res["export_error"] = f"model build failed: {type(e).__name__}: {str(e)[:1500]}"
        res["export_traceback_tail"] = traceback.format_exc()[-3000:]
        write_result("deepctr", model_name, "tf2onnx", res)
        return
    res["build_s"] = round(time.time() - t0, 2)
    if model_name.startswith("DIEN"):
        # dien.py calls tf.compat.v1.experimental.output_all_intermediates(True); with it the
        # while-loops keep gradient intermediates in TensorLists that tf2onnx emits as
        # unconvertible EmptyTensorList/TensorListPushBack ops -> switch it back off.
        tf.compat.v1.experimental.output_all_intermediates(False)
        res["tf_patches"].append("output_all_intermediates(False) after DIEN()")
    init_tf_weights(model, 1234)

    # Keras input name -> (shape without batch, dtype)
    kin = list(model.inputs)
    res["keras_inputs"] = [(i.name, list(i.shape), str(i.dtype.name)) for i in kin]
    in_sig, serve, feed, framework = tf_serving(model)
    raw1 = feed(gen_data(spec, B, np.random.default_rng(42)))
    raw2 = feed(gen_data(spec, B2, np.random.default_rng(7)))
    ref1 = framework(raw1)
    ref2 = framework(raw2)
    res["framework_out_shape"] = [list(r.shape) for r in ref1]
    stem = f"deepctr_{model_name}_tf2onnx"
    path = os.path.join(HERE, stem + ".onnx")
    t0 = time.time()
    try:
        import tf2onnx
        if os.path.exists(path):
            os.remove(path)
        proto, _ = tf2onnx.convert.from_function(serve, input_signature=in_sig, opset=OPSET,
                                                 output_path=path)
        res["export_s"] = round(time.time() - t0, 2)
        res["orig_ir_version"] = finalize_onnx(path)
    except Exception as e:  # noqa
        res["export_s"] = round(time.time() - t0, 2)
        res["export_error"] = f"{type(e).__name__}: {str(e)[:1500]}"
        res["export_traceback_tail"] = traceback.format_exc()[-3000:]
        write_result("deepctr", model_name, "tf2onnx", res)
        return
    import onnx
    m = onnx.load(path)
    in_names = [i.name for i in m.graph.input]
    out_names = [o.name for o in m.graph.output]
    sig_names = [s.name for s in in_sig]
    if sorted(in_names) != sorted(sig_names):
        res["input_name_note"] = f"ONNX inputs {in_names} != Keras inputs {sig_names}"
    inputs = {n: raw1[n] for n in in_names if n in raw1}
    inputs2 = {n: raw2[n] for n in in_names if n in raw2}
    refs = dict(zip(out_names, ref1))
    refs2 = dict(zip(out_names, ref2))
    np.savez(os.path.join(HERE, stem + ".npz"), **inputs)
    np.savez(os.path.join(HERE, stem + ".ref.npz"), **refs)
    res.update(check_export(path, inputs, refs, inputs2, refs2))
    write_result("deepctr", model_name, "tf2onnx", res)


# ----------------------------------------------------------------------------- report
def fmt_err(x):
    if x is None:
        return "-"
    return f"{x:.1e}"


def auto_notes(r):
    n = []
    h = r.get("op_hist", {})
    for op in ("GRU", "Loop", "Scan", "If", "NonZero", "Where", "ScatterND", "TopK", "Unique",
               "SequenceConstruct", "Range", "Compress"):
        if h.get(op):
            n.append(f"{op}x{h[op]}")
    if r.get("n_functions"):
        n.append(f"{r['n_functions']} local functions")
    if r.get("subgraph_ops"):
        n.append("subgraph ops: " + ",".join(f"{k}x{v}" for k, v in list(r["subgraph_ops"].items())[:6]))
    if r.get("onnx_checker") not in (None, "ok"):
        n.append("checker: " + r["onnx_checker"][:80])
    return "; ".join(n)


def report():
    rows = []
    for fn in sorted(os.listdir(RES_DIR)):
        if fn.endswith(".json"):
            with open(os.path.join(RES_DIR, fn)) as f:
                rows.append(json.load(f))
    order = {m: i for i, m in enumerate(TORCH_MODELS)}
    rows.sort(key=lambda r: (r["lib"] != "deepctr_torch", order.get(r["model"], 99), r["exporter"]))
    lines = ["| lib | model | exporter | file | size KB | nodes (top/total) | top ops | ORT ok | ORT err B8 | "
             "ORT err B5 | OV ok | OV err B8 | OV err B5 | auto notes |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    errs = []
    for r in rows:
        stem = f"{r['lib']}_{r['model']}_{r['exporter']}"
        if "export_error" in r:
            lines.append(f"| {r['lib']} | {r['model']} | {r['exporter']} | EXPORT FAILED | - | - | - | - | - | - | - | - | - | see below |")
            errs.append((stem, "export", r["export_error"]))
            continue
        top = ", ".join(f"{k}:{v}" for k, v in list(r["op_hist"].items())[:7])
        ort_ok = "yes" if r.get("ort_ok") else "NO"
        ov_ok = "yes" if r.get("ov_ok") else "NO"
        if not r.get("ort_ok"):
            errs.append((stem, "ORT", r.get("ort_error")))
        if not r.get("ov_ok"):
            errs.append((stem, "OpenVINO compile", r.get("ov_error")))
        for k in ("ort_b2_error", "ov_infer_error", "ov_b2_error"):
            if r.get(k):
                errs.append((stem, k, r[k]))
        lines.append(
            f"| {r['lib']} | {r['model']} | {r['exporter']} | {stem}.onnx | {r['size_bytes'] / 1024:.0f} | "
            f"{r['nodes_top']}/{r['nodes_total']} | {top} | {ort_ok} | {fmt_err(r.get('ort_err'))} | "
            f"{fmt_err(r.get('ort_err_b2'))} | {ov_ok} | {fmt_err(r.get('ov_err'))} | "
            f"{fmt_err(r.get('ov_err_b2'))} | {auto_notes(r)} |")
    out = "\n".join(lines) + "\n\n### Errors (verbatim, truncated)\n\n"
    for stem, what, msg in errs:
        msg = msg or ""
        if "## Exception summary" in msg:   # torch.export boilerplate: keep the real reason
            msg = "TorchExportError: " + msg.split("## Exception summary", 1)[1].split("consider using", 1)[0]
        msg = " ".join(msg.replace("\x1b[96m", "").replace("\x1b[0m", "").split())
        out += f"- **{stem}** ({what}): `{msg[:1200]}`\n"
    with open(os.path.join(HERE, "results_table.md"), "w") as f:
        f.write(out)
    print(out)


def main():
    args = sys.argv[1:]
    if args and args[0] == "report":
        report()
        return
    if len(args) >= 2 and args[0] in ("torch", "tf"):
        (torch_run if args[0] == "torch" else tf_run)(args[1])
        return
    libs = [args[0]] if args else ["torch", "tf"]
    for lib in libs:
        for mname in (TORCH_MODELS if lib == "torch" else TF_MODELS):
            t0 = time.time()
            p = subprocess.run([sys.executable, os.path.abspath(__file__), lib, mname], cwd=HERE)
            print(f"== {lib} {mname}: rc={p.returncode} {time.time() - t0:.0f}s", flush=True)
            if p.returncode != 0:
                # hard crash (segfault etc.): record it
                for ex in (("legacy", "dynamo") if lib == "torch" else ("tf2onnx",)):
                    libname = "deepctr_torch" if lib == "torch" else "deepctr"
                    fn = os.path.join(RES_DIR, f"{libname}_{mname}_{ex}.json")
                    if not os.path.exists(fn):
                        write_result(libname, mname, ex, {"export_error": f"subprocess exited rc={p.returncode}"})
    report()


if __name__ == "__main__":
    main()
