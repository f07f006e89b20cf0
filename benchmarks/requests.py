"""Same answers to bad requests (DESIGN principle 8, issue 47): every export of the corpus against its optimized forms
on adversarial variants of the export's real batch.

    python benchmarks/requests.py                                # every export, every variant; prints the table
    python benchmarks/requests.py --only fuxictr_DIN,deepfm_tf   # stems containing one of these
    python benchmarks/requests.py --variants default,openvino    # some of: default, no_kernels, openvino, user_inputs
    python benchmarks/requests.py --log run.jsonl                # also keep every case's result, a JSON line each
    python benchmarks/requests.py --from-log A.jsonl B.jsonl     # the table of every (export, variant) from kept runs
    python benchmarks/requests.py --from-log benchmarks/requests-run.jsonl.gz --write   # RESULTS' summary

RESULTS.md holds the summary (`render`: counts per request family and per optimized form, where the unusual
outcomes come from, every finding) of the committed log, benchmarks/requests-run.jsonl.gz, which keeps every case's
result; a full run's logs (shards joined, gzipped) go there before `--write`.

Per export (the zoo and tests/data/thirdparty, those with a .ref.npz; X.npz beside X.onnx is its real batch), the
variants are made by `ctropt optimize RAW -o OPT --no-speed-check` in a subprocess (into a temporary folder):
`default` (target ort, with ctropt's kernels), `no_kernels` (`--option ort_kernels=off`), `openvino`
(`--target openvino`, run in onnxruntime like the raw export: the point is the graph rewrite, and OpenVINO clamps
out-of-range Gathers itself) and `user_inputs` (`--user-inputs`, for the exports benchmarks/one_user.py lists).

The cases (`build_cases`, 40-80 per export) are the real batch changed one way at a time: out-of-range ids per id
input or packed id column (V = the table size `analyze_inputs` reads off the graph: V, V+1000, -V-1, -1, 2^40 or
2^31-1; NaN, ±inf, fractions for float-packed ids), special floats in one row of the dense inputs (NaN, ±inf,
1e-40, -0.0, ±1e30), batch 0, 1, 3 and 4097 (the real rows tiled), histories of length 0, 1 and 2T where their
axis is dynamic, all-padding rows, lengths that contradict the histories (T+5, 0, -1), unseen and odd strings, one
user for the whole batch, a wrong dtype and a wrong rank.

Outcome per case: `equal` (atol 1e-4, rtol 1e-4, NaN in the same places), `both_raise`, `repaired` (the raw export
raises through its own bug, and the optimized model answers exactly what the raw export answers for the same
request in a form it takes: the same rows within the real batch, or a history of one padded position for one of
length 0), `silent` (the raw export raises, the optimized model answers anything else), `opt_raises` (only the optimized model raises), `differ`, `crash` (the worker
died in the optimized model), `hang` (no answer within --timeout), `raw_crash` (the worker died in the raw export,
after the optimized model answered or raised: the export's own bug, counted apart), `both_crash` (the optimized
model takes the worker down, and so does the raw export run alone on the case). Besides, where the optimized model answers: the same case run again and
at 2 threads must give the same bits (else the case is listed `nondeterministic`, "raw too" when the raw export
also changes with the threads). Per (export, variant) the table also gives the optimized model's size over the
raw export's (`size`: file and external data) and its constants' bytes over the raw export's (`weights`: what
the size is at production scale, where the graph's own bytes are noise).

Isolation: one worker subprocess per (export, variant) loads the raw and optimized sessions once and runs the cases
in order, a JSON line on its stdout per case; the parent waits --timeout seconds per case, and when the worker dies
or hangs records that case (crash / hang) and starts a new worker from the next case. The worker runs the optimized
model first and says so before each step, so a crash or hang names where it happened ("in the optimized model", or
"in the raw export (the optimized model answers)": some raw exports abort onnxruntime at batch 0). Workers run one
at a time (address space capped at --memory-gb), onnxruntime on 1 thread (and 2 for the determinism check).
A run takes 5-25 s per (export, variant) on 2 cores, optimizing included.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import pickle
import re
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx

from common import ROOT, THIRD, ZOO, append_log, commands, provenance, read_log, stamp, write_section  # noqa: E402

from ctropt.graph import iter_proto_graphs, load, to_graph, weights  # noqa: E402
from ctropt.runtime import Runner, analyze_inputs, compare_outputs, summary  # noqa: E402
from ctropt.runtime.inputs import user_input_columns, user_input_names  # noqa: E402

CTROPT = [sys.executable, "-m", "ctropt"]
MARKS = ("<!-- requests table: benchmarks/requests.py writes it -->", "<!-- end of requests table -->")
LOG = Path(__file__).resolve().parent / "requests-run.jsonl.gz"
FAMILIES = ("real", "ids", "floats", "batch", "history", "length", "strings", "user", "interface")  # build_cases'

VARIANTS = {"default": [], "no_kernels": ["--option", "ort_kernels=off"], "openvino": ["--target", "openvino"],
            "user_inputs": None}   # --user-inputs VALUE from one_user.CASES
# raw_crash: the raw export takes onnxruntime down (some abort at batch 0) after the optimized model answered or
# raised: the raw export's own bug, counted apart from ctropt's; both_crash: both take it down
# repaired: the raw export raises through its own bug (a Div by the batch size at batch 0, a GRU's lengths squeezed
# to a scalar at batch 1, a Mul of [B, 0] by [B, T]) and the optimized model answers what the raw export answers for
# the same request in a form it takes (`Case.witness`): the same rows inside the real batch; for a history of
# length 0, a history of one padded position. Without a witness, or answering anything else: silent.
CLASSES = ("equal", "both_raise", "repaired", "silent", "opt_raises", "differ", "crash", "hang", "raw_crash",
           "both_crash")
BAD = ("crash", "hang", "silent", "differ", "opt_raises")   # worst first
ATOL = RTOL = 1e-4
PREFIX = "@@ "   # a worker's result lines; anything else on its stdout is noise


# --------------------------------------------------------------------------------------------- the export's facts

@dataclasses.dataclass
class Export:
    """What the cases need to know about one export: its real batch and its inputs' roles."""

    path: Path
    feeds: dict
    dims: dict            # input -> [int | str | None]
    facts: dict           # input -> ctropt.runtime.inputs.InputFacts
    batch: int            # rows of the real batch
    user_inputs: str | None = None

    def batched(self) -> list[str]:
        return [n for n, a in self.feeds.items() if a.ndim and a.shape[0] == self.batch
                and not isinstance(self.dims[n][0] if self.dims[n] else None, int)]

    def dynamic_axis1(self) -> list[str]:
        """Inputs whose second axis is dynamic, of the history length T the batch has."""
        return [n for n, a in self.feeds.items() if a.ndim >= 2 and a.shape[0] == self.batch and a.shape[1] > 1
                and not isinstance(self.dims[n][1], int) and not self.facts[n].columns]

    def histories(self) -> list[str]:
        return [n for n, a in self.feeds.items() if a.ndim >= 2 and a.shape[0] == self.batch and a.shape[1] > 1
                and not self.facts[n].columns and a.dtype.kind in "iuf"
                and (self.facts[n].padded or self.facts[n].is_mask
                     or re.search(r"hist|seq|his_|_list|mask|src_ids|pos_ids|sent_ids", n, re.I))]

    def lengths(self) -> list[str]:
        return [n for n, a in self.feeds.items() if self.facts[n].is_length and not self.facts[n].columns
                and a.ndim and a.shape[0] == self.batch and a.dtype.kind in "iuf"]

    def is_id(self, name: str) -> bool:
        f, a = self.facts[name], self.feeds[name]
        return a.dtype.kind in "iu" and not (f.is_length or f.is_mask) or a.dtype.kind == "f" and f.upper is not None

    def dense(self) -> list[tuple[str, list | None]]:
        """(float input, its dense columns or None for all): not ids, masks or lengths."""
        out = []
        for n, a in self.feeds.items():
            f = self.facts[n]
            if a.dtype.kind != "f" or f.is_mask or f.is_length or f.upper is not None:
                continue
            if f.columns or f.length_columns:
                cols = [c for c in range(a.shape[-1]) if c not in f.columns and c not in f.length_columns]
                if cols:
                    out.append((n, cols))
            else:
                out.append((n, None))
        return out

    def pad_value(self, name: str):
        """What pads a history: an additive mask's minimum; a negative id that ends the real batch's rows where
        it pads them (DeepRec's sparse columns: -1); else 0."""
        f, a = self.facts[name], self.feeds[name]
        if f.is_mask and f.additive:
            return a.min()
        tail = a[:, -1] if a.ndim == 2 and a.dtype.kind in "iu" else np.zeros(0)
        return int(tail.min()) if tail.size and tail.min() < 0 and (a[:, 0] >= 0).all() else 0


def load_export(path: Path, user_inputs: str | None = None) -> Export:
    model = load(path)
    with np.load(path.with_suffix(".npz")) as data:
        feeds = {i.name: data[i.name] for i in model.graph.input}
    dims = {i.name: [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                     for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    sizes = collections.Counter(a.shape[0] for a in feeds.values() if a.ndim)
    return Export(path, feeds, dims, analyze_inputs(to_graph(model)), sizes.most_common(1)[0][0], user_inputs)


# --------------------------------------------------------------------------------------------------- the cases

@dataclasses.dataclass
class Case:
    name: str
    family: str
    feeds: dict
    witness: dict | None = None    # the same request in a form the raw export may take (see CLASSES: repaired)
    rows: np.ndarray | None = None  # the witness' output rows that answer this case (None: all of them)


def _with(ex: Export, **changed) -> dict:
    feeds = dict(ex.feeds)
    feeds.update(changed)
    return feeds


def _set(a: np.ndarray, index, value) -> np.ndarray:
    """A copy of `a` with a[index] = value; a value the dtype cannot hold is wrapped as numpy casts it."""
    out = a.copy()
    out[index] = np.array(value).astype(a.dtype) if a.dtype.kind in "iu" else value
    return out


def _int_values(dtype, bound: int | None) -> list[tuple[str, int]]:
    huge = ("2^40", 2 ** 40) if np.dtype(dtype).itemsize >= 8 else ("2^31-1", 2 ** 31 - 1)
    if bound is None:
        return [("1e3", 1000), ("1e6", 10 ** 6), huge, ("-1", -1), ("-2^31", -2 ** 31)]
    return [("V", bound), ("V+1000", bound + 1000), ("-V-1", -bound - 1), ("-1", -1), huge]


def id_cases(ex: Export, cap: int = 36) -> list[Case]:
    """Out-of-range ids, one input (or packed float column) at a time, in row 0's first position."""
    slots = []   # (label, input, index, values)
    for n, a in ex.feeds.items():
        f = ex.facts[n]
        if a.dtype.kind == "f" and f.columns:
            for c, bound in sorted(f.columns.items()):
                vals = [("V", bound), ("V+1000", bound + 1000), ("-1", -1), ("-V-1", -bound - 1), ("NaN", np.nan),
                        ("inf", np.inf), ("1e10", 1e10), ("V-0.5", bound - 0.5), ("-0.5", -0.5)]
                slots.append((f"{n}[{c}]", n, (0,) * (a.ndim - 1) + (c,), vals))
        elif a.size and ex.is_id(n):
            vals = _int_values(a.dtype, f.upper) if a.dtype.kind in "iu" else \
                [("V", f.upper), ("-1", -1), ("NaN", np.nan), ("inf", np.inf)]
            slots.append((n, n, (0,) * a.ndim, vals))
    per = max(1, cap // max(1, len(slots)))   # every value for every slot while that fits in `cap`, else a few
    pairs = [(s, s[3][(i + k) % len(s[3])]) for i, s in enumerate(slots) for k in range(min(per, len(s[3])))]
    return [Case(f"id {label}={vname}", "ids", _with(ex, **{n: _set(ex.feeds[n], idx, v)}))
            for (label, n, idx, _), (vname, v) in pairs]


def padded_id_cases(ex: Export, cap: int = 4) -> list[Case]:
    """An out-of-range id (V) where a history holds padding (0 after a row's first position): the raw export looks
    every position up, so it raises; a model that looks up only the valid positions must raise too."""
    slots = [(n, (0, a.shape[1]), ex.facts[n].upper) for n in ex.histories() if ex.is_id(n)
             and ex.facts[n].upper and (a := ex.feeds[n]).ndim == 2]
    slots += [(n, (s, e), b) for n in ex.feeds for s, e in sorted(ex.facts[n].regions) if e - s > 1
              and (b := ex.facts[n].columns.get(s))]
    cases = []
    for n, (s, e), bound in slots[:cap]:
        a = ex.feeds[n]
        padded = np.argwhere(a[:, s + 1:e] == 0)
        if len(padded):
            r, c = padded[0]
            at = (int(r), s + 1 + int(c))
            cases.append(Case(f"id {n}[{at[0]}, {at[1]}] (padding)=V", "ids", _with(ex, **{n: _set(a, at, bound)})))
    return cases


FLOATS = [("NaN", np.nan), ("+inf", np.inf), ("-inf", -np.inf), ("1e-40", 1e-40), ("-0.0", -0.0), ("1e30", 1e30),
          ("-1e30", -1e30)]


def float_cases(ex: Export) -> list[Case]:
    """Special floats in row 0 of every dense float input at once, and NaN / inf in the first one alone."""
    dense = [(n, cols) for n, cols in ex.dense() if ex.feeds[n].size]
    if not dense:
        return []

    def put(targets, value):
        return _with(ex, **{n: _set(ex.feeds[n], (0, cols) if cols else 0, value) for n, cols in targets})

    cases = [Case(f"dense row0={name}", "floats", put(dense, v)) for name, v in FLOATS]
    if len(dense) > 1:
        cases += [Case(f"{dense[0][0]} row0={name}", "floats", put(dense[:1], v)) for name, v in FLOATS[:2]]
    return cases


def batch_cases(ex: Export, sizes=(0, 1, 3, 4097)) -> list[Case]:
    """The real rows tiled (or cut) to each batch size."""
    cases = []
    for size in sizes:
        rows = np.arange(size) % ex.batch
        cases.append(Case(f"batch {size}", "batch", _with(ex, **{n: ex.feeds[n][rows] for n in ex.batched()}),
                          witness=dict(ex.feeds), rows=rows))
    return cases


def _lengths_to(ex: Export, t: int) -> dict:
    """Length inputs and packed length columns clipped to t, so that a shorter history stays consistent."""
    out = {n: np.minimum(ex.feeds[n], t).astype(ex.feeds[n].dtype) for n in ex.lengths()}
    for n, a in ex.feeds.items():
        for c in ex.facts[n].length_columns:
            out[n] = _set(out.get(n, a), (..., c), np.minimum(a[..., c], t))
    return out


def history_cases(ex: Export, lengths=(0, 1, 2)) -> list[Case]:
    """Histories of length 0, 1 and 2T (padded) where their axis is dynamic."""
    names = ex.dynamic_axis1()
    if not names:
        return []
    t = max(ex.feeds[n].shape[1] for n in names)
    cases = []
    for size in lengths:
        new = size * t if size == 2 else size
        cases.append(Case(f"history T={new}", "history", _with(ex, **_histories_to(ex, names, new)),
                          witness=_with(ex, **_histories_to(ex, names, 1, pad=True)) if new == 0 else None))
    return cases


def _histories_to(ex: Export, names: list[str], new: int, pad: bool = False) -> dict:
    """The histories cut (or padded) to `new` positions, lengths clipped to match; `pad`: every position padding."""
    changed = _lengths_to(ex, 0 if pad else new)
    for n in names:
        a = ex.feeds[n]
        if new <= a.shape[1]:
            changed[n] = a[:, :new]
        else:
            fill = np.full((a.shape[0], new - a.shape[1]) + a.shape[2:], ex.pad_value(n), a.dtype)
            changed[n] = np.concatenate([a, fill], axis=1)
        if pad:
            changed[n] = np.full_like(changed[n], ex.pad_value(n))
    return changed


def padding_cases(ex: Export) -> list[Case]:
    """Rows whose every history position is padding (and length 0): row 0, then every row."""
    hist = ex.histories()
    packed = [(n, s, e) for n in ex.feeds for s, e in ex.facts[n].regions if e - s > 1]
    if not hist and not packed:
        return []
    cases = []
    for label, rows in (("row 0", 0), ("all rows", slice(None))):
        changed = {n: _set(ex.feeds[n], rows, ex.pad_value(n)) for n in hist}
        changed.update({n: _set(ex.feeds[n], rows, 0) for n in ex.lengths()})
        for n, s, e in packed:
            changed[n] = _set(changed.get(n, ex.feeds[n]), (rows, slice(s, e)), 0)
        for n in ex.feeds:
            for c in ex.facts[n].length_columns:
                changed[n] = _set(changed.get(n, ex.feeds[n]), (rows, c), 0)
        cases.append(Case(f"all padding, {label}", "history", _with(ex, **changed)))
    return cases


def length_cases(ex: Export) -> list[Case]:
    """Row 0's length contradicting its history (T+5, 0, -1), for up to three length inputs or packed columns."""
    slots = [(n, (0,) * ex.feeds[n].ndim) for n in ex.lengths()]
    slots += [(n, (0, c)) for n in ex.feeds for c in sorted(ex.facts[n].length_columns)]
    hist = ex.histories() + [n for n in ex.feeds if any(e - s > 1 for s, e in ex.facts[n].regions)]
    t = max([ex.feeds[n].shape[1] for n in hist if ex.feeds[n].ndim >= 2] or [1])
    if any(ex.facts[n].regions for n in hist):
        t = max(e - s for n in hist for s, e in ex.facts[n].regions)
    cases = []
    for n, idx in slots[:3]:
        label = n if n in ex.lengths() else f"{n}[{idx[-1]}]"
        for name, value in (("T+5", t + 5), ("0", 0), ("-1", -1)):
            cases.append(Case(f"length {label} row0={name}", "length", _with(ex, **{n: _set(ex.feeds[n], idx, value)})))
    return cases


def string_cases(ex: Export) -> list[Case]:
    names = [n for n, a in ex.feeds.items() if a.dtype.kind in "USO" and a.size]
    if not names:
        return []
    odd = [("''", ""), ("unseen", "zz-never-seen-zz"), ("long", "x" * 10000), ("unicode", "ü漢字\u0000x")]
    cases = [Case(f"string {names[0]} row0={label}", "strings",
                  _with(ex, **{names[0]: _set(ex.feeds[names[0]].astype(object), (0,) * ex.feeds[names[0]].ndim, v)
                               .astype(str)})) for label, v in odd]
    feeds = _with(ex, **{n: np.full_like(ex.feeds[n], "") for n in names})
    cases.append(Case("every string input ''", "strings", feeds, *_alongside(ex, feeds)))
    return cases


def _alongside(ex: Export, feeds: dict) -> tuple[dict, np.ndarray]:
    """A witness for a case whose rows stand alone (see CLASSES: repaired): its rows followed by the real batch's,
    and which of the witness' rows are the case's."""
    rows = len(feeds[ex.batched()[0]])
    return {n: np.concatenate([feeds[n], ex.feeds[n]]) if n in ex.batched() else feeds[n] for n in feeds}, \
        np.arange(rows)


def user_cases(ex: Export) -> list[Case]:
    """One user for every row (the request --user-inputs speeds up: row 0's user inputs, history, lengths and masks
    in every row, as `generate_inputs(one_user=True)` makes it), at the real batch and at 4097 rows."""
    if not ex.user_inputs:
        return []
    whole = user_input_names(ex.user_inputs) | set(ex.histories()) | set(ex.lengths())
    whole |= {n for n in ex.feeds if ex.facts[n].is_mask}
    changed = {n: np.repeat(ex.feeds[n][:1], ex.batch, axis=0) for n in whole if n in ex.batched()}
    columns = user_input_columns(ex.user_inputs)
    for n in ex.feeds:
        f = ex.facts[n]
        history = (c for s, e in f.regions if e - s > 1 for c in range(s, e))   # deepctr-torch's packed histories
        columns.setdefault(n, set()).update(f.length_columns, history)
    for n, cols in columns.items():
        if cols and n not in changed:
            changed[n] = ex.feeds[n].copy()
            changed[n][:, sorted(cols)] = ex.feeds[n][0, sorted(cols)]
    feeds = _with(ex, **changed)
    rows = np.arange(4097) % ex.batch
    big = {n: feeds[n][rows] for n in ex.batched()}
    return [Case("one user", "user", feeds), Case("one user, batch 4097", "user", dict(feeds, **big))]


def interface_cases(ex: Export) -> list[Case]:
    """A wrong dtype (int32 for int64 and back, float64 for float32) and a wrong rank (an axis more, one less)."""
    cases, seen = [], set()
    swap = {np.dtype(np.int64): np.int32, np.dtype(np.int32): np.int64, np.dtype(np.float32): np.float64}
    for n, a in ex.feeds.items():
        if a.dtype in swap and a.dtype not in seen:
            seen.add(a.dtype)
            cases.append(Case(f"dtype {n} {a.dtype}->{np.dtype(swap[a.dtype])}", "interface",
                              _with(ex, **{n: a.astype(swap[a.dtype])})))
    for ndim in sorted({a.ndim for a in ex.feeds.values() if a.ndim})[:2]:
        n = next(k for k, a in ex.feeds.items() if a.ndim == ndim)
        a = ex.feeds[n]
        cases.append(Case(f"rank {n} +1 axis", "interface", _with(ex, **{n: a[..., None]})))
        cases.append(Case(f"rank {n} -1 axis", "interface", _with(ex, **{n: a[..., 0]})))
    return cases


QUICK_IDS = ("=V", "=-V-1", "=-1", "=2^40", "=2^31-1", "=NaN")
QUICK_FLOATS = ("dense row0=NaN", "dense row0=+inf", "dense row0=-inf")


def build_cases(ex: Export, quick: bool = False) -> list[Case]:
    """The cases for one export, the real batch first; `quick`: a reduced list (CI, about 15-20 cases)."""
    real = [Case("real batch", "real", dict(ex.feeds))]
    if quick:
        ids = [c for c in id_cases(ex, cap=12) if c.name.endswith(QUICK_IDS)][:8] + padded_id_cases(ex, cap=1)
        floats = [c for c in float_cases(ex) if c.name in QUICK_FLOATS]
        return (real + ids + floats + batch_cases(ex, (0, 1, 3, 257)) + history_cases(ex) + padding_cases(ex)[:1]
                + length_cases(ex)[:3] + string_cases(ex)[:2] + user_cases(ex)[:1] + interface_cases(ex)[:2])
    return (real + id_cases(ex) + padded_id_cases(ex) + float_cases(ex) + batch_cases(ex) + history_cases(ex)
            + padding_cases(ex) + length_cases(ex) + string_cases(ex) + user_cases(ex) + interface_cases(ex))


# ------------------------------------------------------------------------------------- the worker: one per variant

def _first_line(e: BaseException) -> str:
    """A runtime error in short: `Op 'node': message`, without onnxruntime's boilerplate and source locations."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    text = re.sub(r"^ort-\w+ (failed to run|cannot load) the model: ", "", text)
    text = re.sub(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ", "", text)
    text = re.sub(r"^Non-zero status code returned while running (\S+) node\. Name:'([^']*)' Status Message: ",
                  r"\1 '\2': ", text)
    text = re.sub(r"/onnxruntime_src/\S+:\d+ |onnxruntime::[\w:<>]+\([^)]*\)\s*(const\s*)?", "", text)
    return text[:240]


def _run(runner, feeds: dict):
    try:
        return runner.run(feeds), ""
    except Exception as e:  # noqa: BLE001  (onnxruntime raises several types; the worker must go on)
        return None, _first_line(e)


def _like(raw: dict, opt: dict, ranks: dict) -> dict:
    """The raw outputs in the optimized model's shapes where the raw export computes an output in another rank than
    it declares and the sizes agree (ctropt repairs PaddleRec DIEN aux's declared scalar computed as [1])."""
    return {k: v.reshape(opt[k].shape) if k in opt and v.ndim != ranks.get(k, v.ndim) and v.size == opt[k].size
            else v for k, v in raw.items()}


def classify(raw: dict | None, raw_err: str, opt: dict | None, opt_err: str, ranks: dict,
             witness: dict | None = None) -> tuple[str, str]:
    """(class, short message) of one case; `witness`: the raw export's answer to the same request in a form it
    takes, where it has one."""
    if raw is None and opt is not None and witness is not None:
        diffs = compare_outputs(_like(witness, opt, ranks), opt, atol=ATOL, rtol=RTOL)
        if all(d.ok for d in diffs):
            return "repaired", f"raw raises: {raw_err}; the optimized model answers as the raw export does the same rows"
        return "silent", f"raw raises: {raw_err}; and the optimized model's answer is not the raw export's: {summary(diffs)}"[:240]
    if raw is None:
        return ("both_raise", raw_err) if opt is None else ("silent", f"raw raises: {raw_err}")
    if opt is None:
        return "opt_raises", opt_err
    diffs = compare_outputs(_like(raw, opt, ranks), opt, atol=ATOL, rtol=RTOL)
    return ("equal", "") if all(d.ok for d in diffs) else ("differ", summary(diffs)[:240])


def _same_bits(a: dict, b: dict | None) -> bool:
    return b is not None and a.keys() == b.keys() and all(
        a[k].shape == b[k].shape and a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes() for k in a)


def determinism(sessions: dict, feeds: dict, first: dict) -> str:
    """'' when the optimized model gives the same bits again and at 2 threads; else what changed. The raw export
    at 1 and 2 threads is compared too (made on first need), to tell the optimized model's doing from the runtime's."""
    if not _same_bits(first, _run(sessions["opt"], feeds)[0]):
        return "run twice: different bits"
    if _same_bits(first, _run(sessions["opt2"], feeds)[0]):
        return ""
    if "raw2" not in sessions:
        sessions["raw2"] = Runner(sessions["raw_path"], "ort-cpu", 2)
    raw1, raw2 = _run(sessions["raw"], feeds)[0], _run(sessions["raw2"], feeds)[0]
    return "1 vs 2 threads: different bits" + (" (raw too)" if raw1 is not None and not _same_bits(raw1, raw2) else "")


def _witness(runner, case: dict) -> dict | None:
    """The raw export's answer to the case's witness (see CLASSES: repaired), cut to the case's rows: the outputs
    whose first axis is the witness' batch are cut; None where there is none or the raw export raises on it too."""
    if case["witness"] is None:
        return None
    out = _run(runner, case["witness"])[0]
    if out is None or case["rows"] is None:
        return out
    batch = {a.shape[0] for a in case["witness"].values() if getattr(a, "ndim", 0)}
    return {k: v[case["rows"]] if v.ndim and v.shape[0] in batch else v for k, v in out.items()}


def _emit(record: dict) -> None:
    sys.stdout.write(PREFIX + json.dumps(record) + "\n")
    sys.stdout.flush()


def worker(raw: str, opt: str, cases_file: str, start: int) -> None:
    """Load both models once, run cases[start:] in order, a result line each (see `Pool`)."""
    with open(cases_file, "rb") as f:
        cases = pickle.load(f)
    feeds_list = [c["feeds"] for c in cases]
    try:
        sessions = {"raw": Runner(raw, "ort-cpu", 1), "opt": Runner(opt, "ort-cpu", 1),
                    "opt2": Runner(opt, "ort-cpu", 2), "raw_path": raw}
    except Exception as e:  # noqa: BLE001
        _emit({"load_error": _first_line(e)})
        return
    ranks = {o.name: len(o.type.tensor_type.shape.dim) for o in onnx.load(raw, load_external_data=False).graph.output}
    _emit({"ready": True})
    for i in range(start, len(feeds_list)):
        t0 = time.perf_counter()
        feeds = feeds_list[i]
        _emit({"at": i, "phase": "optimized model"})
        o, o_err = _run(sessions["opt"], feeds)   # first: should the raw export crash, the case still says this
        outcome = f"raises: {o_err}" if o is None else "answers"
        _emit({"at": i, "phase": f"raw export (the optimized model {outcome})"})
        r, r_err = _run(sessions["raw"], feeds)
        cls, msg = classify(r, r_err, o, o_err, ranks, _witness(sessions["raw"], cases[i]) if r is None else None)
        _emit({"at": i, "phase": "determinism check"})
        nondet = determinism(sessions, feeds, o) if o is not None else ""
        _emit({"i": i, "class": cls, "msg": msg, "nondet": nondet, "seconds": round(time.perf_counter() - t0, 3)})


# ----------------------------------------------------------------------------- the parent: timeouts and restarts

class Pool:
    """Runs one variant's cases in worker subprocesses: a new worker from the next case after a crash or a hang."""

    def __init__(self, raw: Path, opt: Path, cases: list[Case], work: Path, timeout: float, memory_gb: float):
        self.raw, self.opt, self.cases, self.timeout, self.memory = raw, opt, cases, timeout, memory_gb
        work.mkdir(exist_ok=True)
        self.cases_file, self.stderr = work / "cases.pkl", work / "worker.stderr"
        with open(self.cases_file, "wb") as f:
            pickle.dump([{"feeds": c.feeds, "witness": c.witness, "rows": c.rows} for c in cases], f)  # plain dicts:
            # the worker runs this file as __main__

    def _limit(self) -> None:   # in the child: cap its memory, so a runaway allocation kills the worker only
        import resource
        cap = int(self.memory * 2 ** 30)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    def _start(self, start: int) -> None:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(self.raw), str(self.opt),
               str(self.cases_file), str(start)]
        with open(self.stderr, "wb") as err:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, preexec_fn=self._limit, cwd=ROOT)
        self.buffer = b""

    def _next(self, timeout: float) -> dict | None:
        """The worker's next record; None after `timeout` s; {'died': returncode} at its end."""
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while True:
                while b"\n" in self.buffer:
                    line, self.buffer = self.buffer.split(b"\n", 1)
                    if line.startswith(PREFIX.encode()):
                        return json.loads(line[len(PREFIX):])
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    return None
                chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
                if not chunk:
                    return {"died": self.proc.wait()}
                self.buffer += chunk

    def _stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.proc.stdout.close()

    def _raw_dies_too(self, i: int) -> bool:
        """Whether the raw export, run in the optimized model's place, takes a worker down on case i as well."""
        other = Pool(self.raw, self.raw, self.cases[i:i + 1], self.cases_file.parent / "alone", self.timeout,
                     self.memory)
        results, error = other.run()
        return not error and bool(results) and results[0]["class"] in ("crash", "both_crash")

    def _death(self, code: int) -> str:
        names = {-s.value: s.name for s in signal.Signals}
        why = f"signal {names.get(code, -code)}" if code < 0 else f"exit {code}"
        tail = [ln for ln in self.stderr.read_text(errors="replace").splitlines() if ln.strip()][-1:]
        return f"worker died ({why})" + (f": {tail[0][:160]}" if tail else "")

    def run(self) -> tuple[list[dict], str]:
        """(a result per case, '' or why the models did not load)."""
        results, i = [], 0
        while i < len(self.cases):
            self._start(i)
            ready = self._next(max(180.0, self.timeout))
            if not ready or "ready" not in ready:
                self._stop()
                return results, (ready or {}).get("load_error") or ("load: " + self._death(ready["died"])
                                                                     if ready else "load: timeout")
            deadline, phase = time.monotonic() + self.timeout, ""
            while i < len(self.cases):
                record = self._next(deadline - time.monotonic())
                if record is not None and "phase" in record:
                    phase = record["phase"]
                    continue
                if record is None or "died" in record:
                    cls, msg = ("hang", f"no answer in {self.timeout:g} s") if record is None else \
                        ("raw_crash" if phase.startswith("raw") else "crash", self._death(record["died"]))
                    if cls == "crash" and self.raw != self.opt and self._raw_dies_too(i):
                        cls, msg = "both_crash", msg + "; the raw export alone dies on it too"
                    results.append({"i": i, "class": cls, "msg": f"{msg}, in the {phase}" if phase else msg,
                                    "nondet": "", "seconds": None})
                    i += 1
                    break
                results.append(record)
                i = record["i"] + 1
                deadline, phase = time.monotonic() + self.timeout, ""
            self._stop()
        return results, ""


# ---------------------------------------------------------------------------------------------- exports, variants

def exports(only: list[str]) -> list[Path]:
    found = sorted(ZOO.glob("*.onnx")) + sorted(THIRD.glob("*.onnx"))
    return [p for p in found if p.with_suffix(".ref.npz").exists() and (not only or any(o in p.stem for o in only))]


def user_inputs_of(stem: str) -> str | None:
    from one_user import CASES
    return dict(CASES).get(stem)


def optimize(raw: Path, out: Path, variant: str, timeout: int = 600) -> str:
    """`ctropt optimize` for one variant in a subprocess: '' when it saved `out`, else why not."""
    extra = VARIANTS[variant] if variant != "user_inputs" else ["--user-inputs", user_inputs_of(raw.stem)]
    try:
        proc = subprocess.run(CTROPT + ["optimize", str(raw), "-o", str(out), "--no-speed-check", *extra],
                              capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return f"optimize: still running after {timeout} s"
    if proc.returncode or not out.exists():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [""]
        return f"optimize: exit {proc.returncode} {tail[0][:160]}"
    return ""


def check(raw: Path, variant: str, quick: bool = False, timeout: float = 60.0, memory_gb: float = 6.0) -> dict | None:
    """One export against one optimized form: {export, variant, cases, error, seconds, results (one per case)};
    None for `user_inputs` on an export one_user.py does not list."""
    ex = load_export(raw, user_inputs_of(raw.stem) if variant == "user_inputs" else None)
    if variant == "user_inputs" and not ex.user_inputs:
        return None
    cases = build_cases(ex, quick=quick)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ctropt-requests-") as tmp:
        opt = Path(tmp) / "opt.onnx"
        error = optimize(raw, opt, variant)
        results, size, constants = [], None, None
        if not error:
            size = model_bytes(opt) / model_bytes(raw)
            constants = weight_bytes(opt) / max(weight_bytes(raw), 1)
            results, error = Pool(raw, opt, cases, Path(tmp), timeout, memory_gb).run()
    for r in results:
        r.update(case=cases[r["i"]].name, family=cases[r["i"]].family)
    return {"export": raw.stem, "variant": variant, "cases": len(cases), "error": error,
            "seconds": round(time.perf_counter() - t0, 1), "size": size, "weights": constants, "results": results}


def model_bytes(path: Path) -> int:
    """A saved model's bytes: its file and the external data its tensors point at."""
    model = onnx.load(str(path), load_external_data=False)
    external = sum(int(dict((e.key, e.value) for e in t.external_data).get("length", 0) or 0)
                   for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL)
    return path.stat().st_size + external


def weight_bytes(path: Path) -> int:
    """The bytes of a saved model's constants (initializers and Constant nodes, subgraphs included): what the
    size is made of at production scale, where the graph's own bytes are noise."""
    model = onnx.load(str(path), load_external_data=False)
    total = 0
    for g in iter_proto_graphs(model.graph):
        tensors = list(g.initializer) + [a.t for n in g.node if n.op_type == "Constant" for a in n.attribute if a.t.dims]
        total += sum(weights.nbytes(t) for t in tensors if t.data_type != onnx.TensorProto.STRING)
    return total


def measure(raw: Path, variants: list[str], args) -> list[dict]:
    """Rows (one per variant) for one export, each printed as it is done."""
    rows = []
    for variant in variants:
        row = check(raw, variant, args.quick, args.timeout, args.memory_gb)
        if row is not None:
            rows.append(row)
            print(f"  {raw.stem} / {variant}: {_counts_text(row)} ({row['seconds']:.0f} s)", flush=True)
    return rows


# ------------------------------------------------------------------------------------------------------- the table

def _counts(row: dict) -> collections.Counter:
    counts = collections.Counter(r["class"] for r in row["results"])
    counts["nondeterministic"] = sum(bool(r["nondet"]) for r in row["results"])
    return counts


def _counts_text(row: dict) -> str:
    if row["error"]:
        return row["error"]
    c = _counts(row)
    return ", ".join(f"{k} {c[k]}" for k in CLASSES + ("nondeterministic",) if c[k])


def findings(row: dict) -> list[dict]:
    """The cases that break the promise, worst first: crash, hang, silent, differ, opt_raises, then nondeterminism."""
    rank = {c: i for i, c in enumerate(BAD)}
    bad = [r for r in row["results"] if r["class"] in rank or r["nondet"]]
    return sorted(bad, key=lambda r: (rank.get(r["class"], len(BAD)), r["i"]))


def table(rows: list[dict], listed: int = 12) -> str:
    head = "| export | variant | cases | " + " | ".join(CLASSES) + " | nondeterministic | size | weights | s |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for row in rows:
        if row["error"]:
            lines.append(f"| {row['export']} | {row['variant']} | {row['cases']} | {row['error'].replace('|', '/')} |"
                         + " |" * (len(CLASSES) + 3) + f" {row['seconds']:.0f} |")
            continue
        c = _counts(row)
        cells = " | ".join(str(c[k]) if c[k] else "·" for k in CLASSES + ("nondeterministic",))
        size = f"{row['size']:.3f}×" if row.get("size") else "·"
        kept = f"{row['weights']:.3f}×" if row.get("weights") else "·"
        lines.append(f"| {row['export']} | {row['variant']} | {row['cases']} | {cells} | {size} | {kept} | "
                     f"{row['seconds']:.0f} |")
    lines.append("")
    lines += totals(rows)
    for row in rows:
        bad = findings(row)
        if bad:
            lines.append(f"- **{row['export']} / {row['variant']}**: {len(bad)} case(s)")
            for r in bad[:listed]:
                what = r["class"] if r["class"] in BAD else ""
                if r["nondet"]:
                    what += (", " if what else "") + f"nondeterministic: {r['nondet']}"
                lines.append(f"  - `{r['case']}`: {what}{' — ' + r['msg'] if r['msg'] and r['class'] in BAD else ''}")
            if len(bad) > listed:
                lines.append(f"  - … {len(bad) - listed} more (`--log` keeps them all)")
    return "\n".join(lines).rstrip()


def totals(rows: list[dict]) -> list[str]:
    """The totals per class over every row, and the largest optimized/raw size and constant-bytes ratios."""
    total = collections.Counter()
    for row in rows:
        total.update(_counts(row))
    sizes = [(row["size"], row["export"], row["variant"]) for row in rows if row.get("size")]
    line = f"Totals over {len(rows)} (export, variant) pairs: " + ", ".join(
        f"{k} {total[k]}" for k in CLASSES + ("nondeterministic",)) + f"; {sum(bool(r['error']) for r in rows)} errors."
    if sizes:
        ratio, export, variant = max(sizes)
        line += f" Largest optimized / raw size: {ratio:.3f}× ({export}, {variant})."
    kept = [(row["weights"], row["export"], row["variant"]) for row in rows if row.get("weights")]
    if kept:
        ratio, export, variant = max(kept)
        line += f" Largest optimized / raw constant bytes: {ratio:.3f}× ({export}, {variant})."
    return [line, ""]


def _count_cells(counts: collections.Counter) -> str:
    return " | ".join(str(counts[k]) if counts[k] else "·" for k in CLASSES + ("nondeterministic",))


def overview(rows: list[dict], listed: int = 12) -> str:
    """The compact table RESULTS holds: cases per request family and per optimized form by outcome, the totals,
    which exports the unusual outcomes come from, and every finding (up to `listed`); the log keeps each case."""
    head = " | ".join(CLASSES) + " | nondeterministic |"
    by_family = collections.defaultdict(collections.Counter)
    for row in rows:
        for r in row["results"]:
            by_family[r["family"]][r["class"]] += 1
            by_family[r["family"]]["nondeterministic"] += bool(r["nondet"])
    families = [f for f in FAMILIES if f in by_family] + sorted(set(by_family) - set(FAMILIES))
    lines = ["| request family | cases | " + head, "|" + "---|" * (head.count("|") + 2)]
    for f in families:
        c = by_family[f]
        lines.append(f"| {f} | {sum(c[k] for k in CLASSES)} | {_count_cells(c)} |")
    lines += ["", "| optimized form | exports | cases | " + head + " largest size | largest weights |",
              "|" + "---|" * (head.count("|") + 5)]
    for variant in [v for v in VARIANTS if any(r["variant"] == v for r in rows)]:
        group = [r for r in rows if r["variant"] == variant]
        c = collections.Counter()
        for row in group:
            c.update(_counts(row))
        size = max((r["size"] for r in group if r.get("size")), default=None)
        kept = max((r["weights"] for r in group if r.get("weights")), default=None)
        lines.append(f"| {variant} | {len(group)} | {sum(r['cases'] for r in group)} | {_count_cells(c)} | "
                     f"{f'{size:.3f}×' if size else '·'} | {f'{kept:.3f}×' if kept else '·'} |")
    lines += [""] + totals(rows)
    for cls in ("repaired", "raw_crash", "both_crash"):
        where = collections.Counter(row["export"] for row in rows for r in row["results"] if r["class"] == cls)
        if where:
            lines.append(f"- `{cls}`: {sum(where.values())} cases, by export (all forms together): "
                         + ", ".join(f"{e} {n}" for e, n in sorted(where.items())) + ".")
    errors = [f"{r['export']} / {r['variant']}: {r['error']}" for r in rows if r["error"]]
    if errors:
        lines.append(f"- errors ({len(errors)}): " + "; ".join(errors) + ".")
    found = [(row, r) for row in rows for r in findings(row)]
    lines.append(f"- findings (crash, hang, silent, differ, opt_raises, nondeterministic): {len(found) or 'none'}.")
    for row, r in found[:listed]:
        what = r["class"] if r["class"] in BAD else ""
        if r["nondet"]:
            what += (", " if what else "") + f"nondeterministic: {r['nondet']}"
        lines.append(f"  - {row['export']} / {row['variant']}, `{r['case']}`: {what}"
                     f"{' — ' + r['msg'] if r['msg'] and r['class'] in BAD else ''}")
    if len(found) > listed:
        lines.append(f"  - … {len(found) - listed} more (the log keeps them all)")
    return "\n".join(lines).rstrip()


def render(log: Path = LOG) -> str:
    """RESULTS' bad-requests section from a log: its commands, dates and CPUs, then the summary."""
    rows = from_logs([log])
    name = f"benchmarks/{log.name}" if log.resolve() == LOG else log.name
    return (f"Command: {commands(rows)}, then `python benchmarks/requests.py --from-log {name} --write` "
            f"({stamp(rows)}). Raw export vs each optimized form on adversarial variants of its real batch, "
            f"onnxruntime CPU; the case counts by outcome. Every case's result: the log "
            f"(`python benchmarks/requests.py --from-log {name}` prints the table per export and form).\n\n"
            + overview(rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma list: stems containing one of these")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of: {', '.join(VARIANTS)}")
    ap.add_argument("--log", type=Path, help="append each (export, variant) with its cases' results (JSON lines)")
    ap.add_argument("--write", action="store_true", help="put the table in benchmarks/RESULTS.md")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds a case may take before it is a hang")
    ap.add_argument("--memory-gb", type=float, default=6.0, help="address-space cap of a worker")
    ap.add_argument("--quick", action="store_true", help="the reduced case list of tests/test_requests.py")
    ap.add_argument("--from-log", type=Path, nargs="+", help="the table from kept runs (each pair's last row), "
                    "without measuring: shards run side by side with --log, joined")
    ap.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(*args.worker[:3], int(args.worker[3]))
    only, variants = [o for o in args.only.split(",") if o], [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        ap.error(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    if args.from_log:
        rows = from_logs(args.from_log)
        print(table(rows))
        if args.write:
            write_section(MARKS, render(args.from_log[0]) if len(args.from_log) == 1 else
                          overview(rows), heading="Bad requests: raw export vs optimized")
        return
    load_before, t0, rows = os.getloadavg(), time.time(), []
    for raw in exports(only):
        done = [{**r, **provenance()} for r in measure(raw, variants, args)]
        rows += done
        if args.log:
            append_log(args.log, done)
    load_after = os.getloadavg()
    print(f"{(time.time() - t0) / 60:.0f} min, load average {load_before[0]:.2f} before, {load_after[0]:.2f} after\n")
    print(table(rows))
    if args.write:
        if not args.log or args.log.resolve() != LOG or only:
            print("--write renders RESULTS from the committed log: a full run with --log benchmarks/"
                  "requests-run.jsonl.gz (or join the shards' logs there, then --from-log it --write)")
            return
        write_section(MARKS, render(LOG), heading="Bad requests: raw export vs optimized")


def from_logs(paths: list[Path]) -> list[dict]:
    """Each (export, variant)'s last row in the logs, sorted by export and variant."""
    last = {}
    for path in paths:
        for row in read_log(path):
            last[(row["export"], row["variant"])] = row
    return sorted(last.values(), key=lambda r: (r["export"], list(VARIANTS).index(r["variant"])))

if __name__ == "__main__":
    main()
