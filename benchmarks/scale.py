"""Production-size CTR models for the scale benchmark: gigabyte embedding tables, made in bounded memory and time.

    python benchmarks/scale.py make --kind dlrm --rows 100000 --width 16 -o /tmp/scale      # ~178 MB
    python benchmarks/scale.py make --kind dlrm --rows 1000000 --width 16 -o /tmp/scale     # ~1.8 GB
    python benchmarks/scale.py make --kind din --rows 10000000 --width 16 -o /tmp/scale     # item table 640 MB
    python benchmarks/scale.py check /tmp/scale/dlrm_r100000_w16.onnx
    python benchmarks/scale.py run [--write]      # make (if missing), optimize and measure the four cases
    python benchmarks/scale.py table [--log benchmarks/scale-run.json] [--write]   # the table from a kept run

`run --write` keeps the run in benchmarks/scale-run.json, the log RESULTS' Scale section is rendered from.

Kinds:
  dlrm  DeepFM/DLRM-style ranker: inputs sparse_0..sparse_25 (int64 [B]) and dense (float [B, 13]); per field a
        first-order table [rows, 1] and an embedding table [rows, width]; FM second-order term over the 26
        embeddings; MLP 1024-512-256-1 over concat(dense, embeddings); output `prob` [B, 1].
  din   DIN: inputs user_id, item_id, cate_id (int64 [B]), hist_item, hist_cate (int64 [B, T], 0 = padding);
        item table [rows, width] shared by item_id and hist_item, cate table [1000, width], user table
        [100000, width]; local activation unit 80-40-1 over [q, k, q-k, q*k], masked where hist_item == 0,
        weighted sum pooling; MLP 200-80-1; output `prob` [B, 1].

How: the torch module is exported by the legacy exporter (opset 17, dynamic batch / history axes) with small
tables, in a spawned child process so torch's memory never adds to the writer's. Each table (a Gather data input
whose first dim is a marker row count) is then replaced by one of the real row count, its values (normal * 0.01,
float32, seeded) generated and written in chunks of at most 64 MB straight into `<name>.onnx.data`, each tensor
at a 4096-byte aligned offset. Any tensor of 1 MiB or more goes to that file; smaller ones stay inline. Beside
the model, `<name>.npz` holds a batch of 256 rows (Zipf-like ids below each table's row count) that `check` runs
with onnxruntime, printing load time and peak RSS. Memory while making stays near 64 MB plus the small model.
"""

from __future__ import annotations

import argparse
import multiprocessing
import resource
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper
from onnx.external_data_helper import set_external_data

OPSET = 17
FIELDS = 26
DENSE = 13
BATCH = 256
HIST = 50
CATES = 1000
USERS = 100_000
# Row counts the tables are exported with; each marks which table a Gather data input is (none equals CATES).
SMALL_ITEM = 997
SMALL_USER = 991
ALIGN = 4096
CHUNK_BYTES = 64 << 20
INLINE_BYTES = 1 << 20
SEED = 0


def peak_rss_mb(who: int = resource.RUSAGE_SELF) -> float:
    """Peak resident set size in MB (Linux reports KiB)."""
    return resource.getrusage(who).ru_maxrss / 1024


# ---------------------------------------------------------------------------------------------------- torch models


def _modules(kind: str, width: int):
    """The torch module of `kind` with small tables, and its example inputs, input names and dynamic axes."""
    import torch
    from torch import nn

    def mlp(sizes, act):
        layers = []
        for a, b in zip(sizes, sizes[1:]):
            layers += [nn.Linear(a, b), act()]
        return nn.Sequential(*layers[:-1])

    class DLRM(nn.Module):
        def __init__(self):
            super().__init__()
            self.first = nn.ModuleList(nn.Embedding(SMALL_ITEM, 1) for _ in range(FIELDS))
            self.emb = nn.ModuleList(nn.Embedding(SMALL_ITEM, width) for _ in range(FIELDS))
            self.mlp = mlp([DENSE + FIELDS * width, 1024, 512, 256, 1], nn.ReLU)
            self.bias = nn.Parameter(torch.zeros(1))

        def forward(self, dense, *sparse):
            first = torch.cat([t(s) for t, s in zip(self.first, sparse)], 1).sum(1, keepdim=True)
            e = torch.stack([t(s) for t, s in zip(self.emb, sparse)], 1)  # [B, F, W]
            fm = 0.5 * (e.sum(1).pow(2) - e.pow(2).sum(1)).sum(1, keepdim=True)
            deep = self.mlp(torch.cat([dense, e.flatten(1)], 1))
            return torch.sigmoid(first + fm + deep + self.bias)

    class DIN(nn.Module):
        def __init__(self):
            super().__init__()
            self.user = nn.Embedding(SMALL_USER, width)
            self.item = nn.Embedding(SMALL_ITEM, width)
            self.cate = nn.Embedding(CATES, width)
            self.att = mlp([8 * width, 80, 40, 1], nn.PReLU)
            self.mlp = mlp([5 * width, 200, 80, 1], nn.PReLU)

        def forward(self, user_id, item_id, cate_id, hist_item, hist_cate):
            q = torch.cat([self.item(item_id), self.cate(cate_id)], -1)  # [B, 2W]
            k = torch.cat([self.item(hist_item), self.cate(hist_cate)], -1)  # [B, T, 2W]
            qe = q.unsqueeze(1).expand_as(k)
            score = self.att(torch.cat([qe, k, qe - k, qe * k], -1))  # [B, T, 1]
            score = torch.where((hist_item != 0).unsqueeze(-1), score, torch.zeros_like(score))
            pooled = (score * k).sum(1)  # [B, 2W]
            return torch.sigmoid(self.mlp(torch.cat([self.user(user_id), q, pooled], -1)))

    torch.manual_seed(SEED)
    ids = lambda *shape: torch.randint(1, SMALL_USER, shape)  # noqa: E731
    if kind == "dlrm":
        names = ["dense"] + [f"sparse_{i}" for i in range(FIELDS)]
        args = (torch.randn(4, DENSE),) + tuple(ids(4) for _ in range(FIELDS))
        axes = {n: {0: "batch"} for n in names}
        return DLRM().eval(), args, names, axes
    names = ["user_id", "item_id", "cate_id", "hist_item", "hist_cate"]
    args = (ids(4), ids(4), ids(4), ids(4, 7), ids(4, 7))
    axes = {n: {0: "batch"} for n in names[:3]} | {n: {0: "batch", 1: "hist"} for n in names[3:]}
    return DIN().eval(), args, names, axes


def _export(kind: str, width: int, path: str) -> None:
    """Export `kind` with small tables to `path` (runs in a spawned child)."""
    import torch

    torch.set_num_threads(1)
    module, args, names, axes = _modules(kind, width)
    axes["prob"] = {0: "batch"}
    with torch.no_grad():
        torch.onnx.export(module, args, path, dynamo=False, opset_version=OPSET, input_names=names,
                          output_names=["prob"], dynamic_axes=axes)
    print(f"export child: peak RSS {peak_rss_mb():.0f} MB", flush=True)


def export_small(kind: str, width: int, path: Path) -> onnx.ModelProto:
    """The exporter's own graph of `kind`, with small tables, exported without torch in this process."""
    child = multiprocessing.get_context("spawn").Process(target=_export, args=(kind, width, str(path)))
    child.start()
    child.join()
    if child.exitcode != 0:
        raise RuntimeError(f"export of {kind} failed (exit code {child.exitcode})")
    model = onnx.load_model(str(path))
    path.unlink()
    return model


# ------------------------------------------------------------------------------------------- resizing the tables


def table_rows(model: onnx.ModelProto, resize: dict[int, int]) -> dict[str, int]:
    """Initializer name -> real row count, for each Gather data input whose first dim is a key of `resize`."""
    inits = {t.name: t for t in model.graph.initializer}
    found = {}
    for node in model.graph.node:
        t = inits.get(node.input[0]) if node.op_type == "Gather" else None
        if t is not None and len(t.dims) == 2 and t.dims[0] in resize:
            found[t.name] = resize[t.dims[0]]
    return found


def _write_random(f, rows: int, width: int, rng: np.random.Generator) -> None:
    """Write rows x width float32 values normal * 0.01 to `f`, in chunks of at most CHUNK_BYTES."""
    step = max(1, CHUNK_BYTES // (4 * width))
    for start in range(0, rows, step):
        chunk = rng.standard_normal((min(step, rows - start), width), dtype=np.float32)
        chunk *= 0.01
        chunk.tofile(f)


def _to_external(t: TensorProto, f, location: str, write) -> None:
    """Pad `f` to ALIGN, call write(f), and point `t` at the bytes written."""
    offset = -(-f.tell() // ALIGN) * ALIGN
    f.write(b"\0" * (offset - f.tell()))
    write(f)
    _clear_data(t)
    t.raw_data = b""  # set_external_data wants the field present
    set_external_data(t, location, offset=offset, length=f.tell() - offset)
    t.ClearField("raw_data")


def _clear_data(t: TensorProto) -> None:
    for field in ("raw_data", "float_data", "int32_data", "int64_data", "double_data", "uint64_data"):
        t.ClearField(field)


def _resize(t: TensorProto, rows: int, f, location: str, rng: np.random.Generator) -> None:
    """Make table `t` one of `rows` random rows, written to `f` unless it is under INLINE_BYTES."""
    assert t.data_type == TensorProto.FLOAT and len(t.dims) == 2, t.name
    width = t.dims[1]
    _clear_data(t)
    del t.dims[:]
    t.dims.extend([rows, width])
    if 4 * rows * width >= INLINE_BYTES:
        _to_external(t, f, location, lambda f: _write_random(f, rows, width, rng))
    else:
        t.raw_data = (rng.standard_normal((rows, width), dtype=np.float32) * 0.01).tobytes()


def resize_tables(model: onnx.ModelProto, rows: dict[str, int], data: Path, seed: int = SEED) -> int:
    """Resize the tables named in `rows` (name -> row count) in place and move every tensor of INLINE_BYTES or
    more to the external file `data`. Returns the bytes written."""
    with open(data, "wb") as f:
        for i, t in enumerate(model.graph.initializer):
            if t.name in rows:
                _resize(t, rows[t.name], f, data.name, np.random.default_rng([seed, i]))
            elif t.data_location != TensorProto.EXTERNAL:
                arr = numpy_helper.to_array(t)
                if arr.nbytes >= INLINE_BYTES:
                    _to_external(t, f, data.name, arr.tofile)
        return f.tell()


# ------------------------------------------------------------------------------------------------- batch and make


def zipf_ids(rng: np.random.Generator, n: int, shape, low: int = 0) -> np.ndarray:
    """Ids in [low, n), Zipf-like (a few hot ids), scattered over the table by a multiplicative hash."""
    span = n - low
    rank = (rng.zipf(1.2, shape) - 1) % span
    return (low + rank * 2654435761 % span).astype(np.int64)


def make_batch(kind: str, rows: int, seed: int = SEED) -> dict[str, np.ndarray]:
    """A batch of BATCH rows for `kind` with tables of `rows` rows; DIN histories of HIST, 0-padded."""
    rng = np.random.default_rng(seed)
    if kind == "dlrm":
        feeds = {"dense": rng.standard_normal((BATCH, DENSE), dtype=np.float32)}
        return feeds | {f"sparse_{i}": zipf_ids(rng, rows, BATCH) for i in range(FIELDS)}
    pad = np.arange(HIST)[None, :] >= rng.integers(1, HIST + 1, (BATCH, 1))
    return {
        "user_id": zipf_ids(rng, USERS, BATCH, 1),
        "item_id": zipf_ids(rng, rows, BATCH, 1),
        "cate_id": rng.integers(1, CATES, BATCH),
        "hist_item": np.where(pad, 0, zipf_ids(rng, rows, (BATCH, HIST), 1)),
        "hist_cate": np.where(pad, 0, rng.integers(1, CATES, (BATCH, HIST))),
    }


def make(kind: str, rows: int, width: int, out_dir: Path) -> Path:
    """Write `<kind>_r<rows>_w<width>.onnx` (+ `.onnx.data`, `.npz`) under `out_dir`; return the model's path."""
    if kind not in ("dlrm", "din"):
        raise ValueError(f"unknown kind {kind!r}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{kind}_r{rows}_w{width}.onnx"
    data = path.with_name(path.name + ".data")
    t0 = time.perf_counter()
    model = export_small(kind, width, path.with_suffix(".small.onnx"))
    t1 = time.perf_counter()
    resize = {SMALL_ITEM: rows} | ({SMALL_USER: USERS} if kind == "din" else {})
    tables = table_rows(model, resize)
    expected = 2 * FIELDS if kind == "dlrm" else 2
    if len(tables) != expected:
        raise RuntimeError(f"found {len(tables)} tables in the export, expected {expected}: {sorted(tables)}")
    written = resize_tables(model, tables, data)
    onnx.save_model(model, str(path))
    np.savez(path.with_suffix(".npz"), **make_batch(kind, rows))
    t2 = time.perf_counter()
    print(f"made {path}: export {t1 - t0:.1f} s, tables {t2 - t1:.1f} s; {path.stat().st_size / 1e6:.1f} MB "
          f"+ {written / 1e6:.1f} MB data; peak RSS {peak_rss_mb():.0f} MB "
          f"(export child {peak_rss_mb(resource.RUSAGE_CHILDREN):.0f} MB)")
    return path


# ---------------------------------------------------------------------------------------------------------- check


def check(path: Path) -> None:
    """Load `path` with onnxruntime by path, run its `.npz` batch, print load time, run time and peak RSS."""
    import onnxruntime as ort

    path = Path(path)
    onnx.checker.check_model(str(path))
    proto = onnx.load_model(str(path), load_external_data=False)
    print(f"{path.name}: {len(proto.graph.node)} nodes; inputs {[i.name for i in proto.graph.input]}; "
          f"outputs {[o.name for o in proto.graph.output]}")
    del proto
    feeds = dict(np.load(path.with_suffix(".npz")))
    so = ort.SessionOptions()
    so.intra_op_num_threads = so.inter_op_num_threads = 1
    t0 = time.perf_counter()
    session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    t1 = time.perf_counter()
    (prob,) = session.run(None, feeds)
    t2 = time.perf_counter()
    if prob.shape != (BATCH, 1) or not np.all((prob >= 0) & (prob <= 1)):
        raise RuntimeError(f"bad output: shape {prob.shape}, range {prob.min()}..{prob.max()}")
    print(f"onnxruntime {ort.__version__}: load {t1 - t0:.2f} s, run {t2 - t1:.3f} s, prob mean "
          f"{prob.mean():.4f} std {prob.std():.4f}; peak RSS {peak_rss_mb():.0f} MB")


# ------------------------------------------------------------------------------------------------------- measure

CASES = (("dlrm", 100_000, 16), ("dlrm", 1_000_000, 16), ("dlrm", 2_000_000, 32), ("din", 10_000_000, 16))
MARKS = ("<!-- scale table: benchmarks/scale.py writes it -->", "<!-- end of scale table -->")
LOG = Path(__file__).resolve().parent / "scale-run.json"


def optimize_measured(path: Path, out: Path) -> dict:
    """`ctropt optimize` (the defaults, the made batch as --inputs) under /usr/bin/time: wall s, peak RSS MB, and
    the output's size; raises when it fails or leaves its work folder behind."""
    import subprocess
    import sys

    cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "ctropt", "optimize", str(path), "-o", str(out),
           "--inputs", str(path.with_suffix(".npz"))]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    if proc.returncode:
        raise RuntimeError(f"optimize failed: {(proc.stdout + proc.stderr)[-600:]}")
    stats = dict(line.strip().rsplit(": ", 1) for line in proc.stderr.splitlines() if ": " in line)
    h, m, s = (["0"] + stats["Elapsed (wall clock) time (h:mm:ss or m:ss)"].split(":"))[-3:]
    left = sorted(p.name for p in out.parent.glob(".ctropt-work-*"))
    if left:
        raise RuntimeError(f"work folders left behind: {left}")
    data = out.with_name(out.name + ".data")
    return {"wall": int(h) * 3600 + int(m) * 60 + float(s), "rss_mb": int(stats["Maximum resident set size (kbytes)"]) / 1024,
            "out_mb": (out.stat().st_size + (data.stat().st_size if data.exists() else 0)) / 1e6,
            "closing": next((ln for ln in proc.stdout.splitlines() if "nodes, verified" in ln), "").strip()}


def paired(raw: Path, opt: Path, batch: int) -> str:
    """Raw vs optimized, interleaved on one thread, at `batch` rows (the made batch tiled): the median ratio."""
    from ctropt.runtime import Runner
    from ctropt.runtime.bench import compare_speed

    feeds = {k: v[np.arange(batch) % len(v)] for k, v in np.load(raw.with_suffix(".npz")).items()}
    verdict = compare_speed(Runner(str(raw), threads=1), Runner(str(opt), threads=1), feeds, threshold=1.0,
                            seconds=10, min_pairs=20)
    return f"{verdict.ratio:.2f}× ({verdict.p10:.2f}–{verdict.p90:.2f})"


def measure(kind: str, rows: int, width: int, folder: Path) -> dict:
    """One case: made if missing, optimized, checked against the raw model on its batch, timed."""
    from ctropt.runtime import Runner, compare_outputs

    raw = folder / f"{kind}_r{rows}_w{width}.onnx"
    if not raw.exists():
        make(kind, rows, width, folder)
    size = (raw.stat().st_size + raw.with_name(raw.name + ".data").stat().st_size) / 1e6
    out = folder / "out" / f"{raw.stem}.opt.onnx"
    out.parent.mkdir(exist_ok=True)
    row = {"model": f"{kind}, {rows:,} rows × {width}", "size_mb": size, **optimize_measured(raw, out)}
    feeds = dict(np.load(raw.with_suffix(".npz")))
    diffs = compare_outputs(Runner(str(raw), threads=1).run(feeds), Runner(str(out), threads=1).run(feeds))
    row["checked"] = f"{max(d.max_abs for d in diffs):.1e}" + ("" if all(d.ok for d in diffs) else " DIFFER")
    row["b256"], row["b2048"] = paired(raw, out, 256), paired(raw, out, 2048)
    return row


def _cell(v) -> str:
    return v if isinstance(v, str) else f"{v[0]:.2f}× ({v[1]:.2f}–{v[2]:.2f})"


def table(data: dict) -> str:
    """The section from a run's log: {date, cpu, command, python, load_after, rows}."""
    head = (f"Command: `{data['command']}` ({data['date']}, {data['cpu']}, {data['python']}, load average "
            f"{data['load_after']:.2f} at the end). `ctropt optimize MODEL --inputs MODEL.npz` with the defaults (speed "
            "guard on) under `/usr/bin/time -v`; outputs: max abs difference, raw vs optimized, on the made batch; "
            "speed: raw / optimized time, paired and interleaved, onnxruntime CPU, 1 thread (10th–90th percentile).\n\n"
            "| model | size MB | optimize s | peak RSS MB | RSS / size | output MB | outputs | batch 256 | batch 2048 |\n"
            "|---|---|---|---|---|---|---|---|---|\n")
    return head + "\n".join(
        f"| {r['model']} | {r['size_mb']:.0f} | {r['wall']:.1f} | {r['rss_mb']:.0f} | {r['rss_mb'] / r['size_mb']:.2f} | "
        f"{r['out_mb']:.0f} | {r['checked']} | {_cell(r['b256'])} | {_cell(r['b2048'])} |" for r in data["rows"])


def render(log: Path = LOG) -> str:
    from common import read_log

    return table(read_log(log))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("make", help="make a model, its external data and its batch")
    m.add_argument("--kind", choices=("dlrm", "din"), default="dlrm")
    m.add_argument("--rows", type=int, required=True, help="rows of each big table (dlrm: all 52; din: item)")
    m.add_argument("--width", type=int, default=16)
    m.add_argument("-o", "--out-dir", type=Path, default=Path("/tmp/scale"))
    m.add_argument("--check", action="store_true", help="then run check on it")
    c = sub.add_parser("check", help="load a made model with onnxruntime and run its batch")
    c.add_argument("path", type=Path)
    r = sub.add_parser("run", help="make (if missing), optimize and measure each case; print the table")
    r.add_argument("--only", default="", help="comma list of case numbers (0-3: 178 MB, 1.8 GB, 6.6 GB, DIN)")
    r.add_argument("-o", "--out-dir", type=Path, default=Path("/tmp/scale"))
    r.add_argument("--write", action="store_true", help="keep the run in benchmarks/scale-run.json and put the "
                   "table in benchmarks/RESULTS.md")
    t = sub.add_parser("table", help="the table from a kept run's log")
    t.add_argument("--log", type=Path, default=LOG)
    t.add_argument("--write", action="store_true", help="put the table in benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    if args.command in ("run", "table"):
        import os
        import platform

        from common import provenance, write_log, write_section

        if args.command == "run":
            picked = [CASES[int(i)] for i in args.only.split(",")] if args.only else list(CASES)
            rows = []
            for case in picked:
                rows.append(measure(*case, args.out_dir))
                print(rows[-1], flush=True)
            data = {**provenance(), "python": platform.python_version(), "load_after": os.getloadavg()[0],
                    "rows": rows}
            text = table(data)
            if args.write:
                write_log(LOG, data)
        else:
            text = render(args.log)
        print(text)
        if args.write:
            write_section(MARKS, text, heading="Scale: gigabyte tables optimized in bounded memory and time")
    elif args.command == "make":
        path = make(args.kind, args.rows, args.width, args.out_dir)
        if args.check:
            check(path)
    else:
        check(args.path)


if __name__ == "__main__":
    main()
