"""Serving a directory of batch buckets (`ctropt specialize`): run each request on the static model of a bucket
that holds it (padded, then sliced), split requests larger than the largest bucket, optionally route large
batches to a second backend (the GPU) above a threshold. On onnxruntime the sessions share one copy of the
weights the models have in common."""

from __future__ import annotations

import bisect
import gc
import hashlib
import json
import os
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper

from ..graph import CtroptError, load
from .inputs import generate_inputs
from .bench import bench
from .session import BACKENDS, Runner

POLICIES = ("pad", "measured")
SHARE_BYTES = 4096  # initializers at least this big that several bucket models hold are stored once
MARGIN = 0.95  # a bucket is used by the measured policy only when timed at least 5 % faster
CALIBRATE_SECONDS = 0.05  # per paired timing at start-up (and at least `calibrate_runs` runs each)


class BucketedSession:
    """`BucketedSession("buckets/").run(feeds)`: the dynamic model's outputs, from static-batch models.

    policy "pad": every request runs on the smallest bucket that holds it (seed 002). policy "measured"
    (default): each bucket and the optimized dynamic model are timed when the session starts (`calibrate_runs`
    runs each, on this machine and these threads); a request then runs padded on its bucket only where that
    was measured faster than the dynamic model unpadded (static shapes save most at small batches, padding
    costs most at large ones). Splitting a request over several small buckets is not tried: per-run timings
    are too noisy to trust such plans (they measured slower).
    backend/threads: where the models run. gpu_backend + gpu_threshold: requests of at least that many rows
    run there instead (seed 002's CPU/GPU split: the batch where `ctropt bench` on both backends crosses).
    A model whose rows depend on each other (batch statistics) is refused, since padding would change them.
    Padding writes into buffers the session keeps, so use one session per thread.
    """

    def __init__(self, directory: str | os.PathLike, backend: str = "ort-cpu", threads: int = 0, *,
                 policy: str = "measured", calibrate_runs: int = 15, gpu_backend: str | None = None,
                 gpu_threshold: int | None = None):
        directory = Path(directory)
        path = directory / "manifest.json"
        if not path.is_file():
            raise CtroptError(f"{directory}: no manifest.json (make one with `ctropt specialize`)")
        if policy not in POLICIES:
            raise CtroptError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
        self.manifest = json.loads(path.read_text())
        if not self.manifest["rows_independent"]:
            raise CtroptError(f"cannot pad requests for this model: {self.manifest['why_not']}")
        if (gpu_backend is None) != (gpu_threshold is None):
            raise CtroptError("CPU/GPU routing needs both gpu_backend and gpu_threshold")
        self.sizes = sorted(b["batch"] for b in self.manifest["buckets"])
        self.files = {b["batch"]: directory / b["file"] for b in self.manifest["buckets"]}
        dynamic_file = directory / self.manifest["dynamic"]
        models = {b: load(f) for b, f in self.files.items()}
        if policy == "measured":
            models[None] = load(dynamic_file)
        # The weights every model has are held once, shared by all the sessions (onnxruntime).
        shared, self._weights = (_shared_initializers(list(models.values())) if BACKENDS[backend][0] == "ort"
                                 else ([{}] * len(models), []))
        share = dict(zip(models, shared))
        # Sessions from the files: given bytes, onnxruntime's Python session keeps them (one more copy each).
        self.runners = {b: Runner(str(self.files[b]), backend, threads, initializers=share[b]) for b in self.sizes}
        self.gpu_backend, self.gpu_threshold, self.threads = gpu_backend, gpu_threshold, threads
        self._gpu: dict[int, Runner] = {}
        self.inputs = [i["name"] for i in self.manifest["inputs"]]
        self.seq_len = self.manifest.get("seq_len")
        self.policy = policy
        self.dynamic = None
        self.costs: dict[int, float] = {}  # bucket -> seconds per run at exactly its batch
        self.padded_costs: dict[int, float] = {}  # bucket -> seconds per padded request (pad, run, slice)
        self._buffers: dict[int, dict[str, np.ndarray]] = {}  # bucket -> input buffers padding is written into
        self.dynamic_costs: dict[int, float] = {}  # rows -> seconds per run of the dynamic model
        if policy == "measured":
            self.dynamic = Runner(str(dynamic_file), backend, threads, initializers=share[None])
            feeds = generate_inputs(models[self.sizes[-1]], batch=self.sizes[-1], seq_len=self.seq_len or 10)
        # The sessions hold what they need: the protos (and the input analysis' graphs, in reference cycles)
        # would be one more copy of every weight until the collector ran.
        del models
        gc.collect()
        if policy == "measured":
            self._calibrate(calibrate_runs, feeds)

    def _calibrate(self, runs: int, feeds: dict[str, np.ndarray]) -> None:
        """Time each bucket at its batch and the padded path into it (from mid-way below: padding, run, slicing),
        each paired with the dynamic model on the same rows (alternating, so drift hits both alike)."""
        below = 0
        for b in self.sizes:
            part = {k: v[:b] for k, v in feeds.items()}
            self.costs[b], self.dynamic_costs[b] = _medians(bench([self.runners[b], self.dynamic], part, b,
                                                                  seconds=CALIBRATE_SECONDS, min_runs=runs))
            take = (below + b) // 2 + 1
            if take < b:
                short = {k: v[:take] for k, v in feeds.items()}
                padded, dynamic = _medians(bench([_PaddedRun(self, take, b), self.dynamic], short, take,
                                                 seconds=CALIBRATE_SECONDS, min_runs=runs))
                self.padded_costs[b] = padded * self.dynamic_cost(take) / dynamic  # on the same scale as the rest
            below = b

    def dynamic_cost(self, rows: int) -> float:
        """The dynamic model's expected time at `rows`: linear between the measured sizes."""
        sizes = self.sizes
        if rows <= sizes[0]:
            return self.dynamic_costs[sizes[0]]
        i = min(bisect.bisect_left(sizes, rows), len(sizes) - 1)
        lo, hi = sizes[i - 1], sizes[i]
        c_lo, c_hi = self.dynamic_costs[lo], self.dynamic_costs[hi]
        return c_lo + (c_hi - c_lo) * (rows - lo) / (hi - lo)

    def bucket_for(self, rows: int) -> int:
        """The smallest bucket holding `rows` (the largest when none does: the request is split)."""
        i = bisect.bisect_left(self.sizes, rows)
        return self.sizes[min(i, len(self.sizes) - 1)]

    def plan(self, rows: int) -> list[tuple[int, int | None]]:
        """(rows, bucket) per run for a request; bucket None = the dynamic model, unpadded."""
        runs, left = [], rows
        while left > self.sizes[-1]:  # larger than every bucket: full chunks first
            runs.append((self.sizes[-1], self._choose(self.sizes[-1])))
            left -= self.sizes[-1]
        return runs + [(left, self._choose(left))]

    def _choose(self, rows: int) -> int | None:
        """The bucket for `rows`, or None (the dynamic model) where it was measured faster. A bucket must win
        by MARGIN: timings taken at start-up are noisy, and the dynamic model is the safe side."""
        bucket = self.bucket_for(rows)
        if self.policy == "pad" or (self.gpu_threshold is not None and rows >= self.gpu_threshold):
            return bucket  # padded (on the GPU: the timings were taken on the CPU backend)
        cost = self.costs[bucket] if rows == bucket else self.padded_costs.get(bucket, self.costs[bucket])
        return bucket if cost < MARGIN * self.dynamic_cost(rows) else None

    def _runner(self, bucket: int | None, rows: int) -> Runner:
        if bucket is None:
            return self.dynamic
        if self.gpu_threshold is not None and rows >= self.gpu_threshold:
            if bucket not in self._gpu:
                self._gpu[bucket] = Runner(str(self.files[bucket]), self.gpu_backend, self.threads)
            return self._gpu[bucket]
        return self.runners[bucket]

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        try:
            rows = {len(feeds[n]) for n in self.inputs}
        except KeyError:
            raise CtroptError(f"missing inputs: {', '.join(n for n in self.inputs if n not in feeds)}") from None
        if len(rows) != 1:
            raise CtroptError(f"inputs disagree on the batch size: {sorted(rows)}")
        (n,) = rows
        if n == 0:
            raise CtroptError("an empty request (batch 0)")
        if self.seq_len is not None:
            self._check_history(feeds)
        plan = self.plan(n)
        if len(plan) == 1:
            (take, bucket), feeds = plan[0], {k: feeds[k] for k in self.inputs}
            return self.dynamic.run(feeds) if bucket is None else self._run_padded(feeds, take, bucket)
        parts, start = [], 0
        for take, bucket in plan:
            chunk = {k: feeds[k][start:start + take] for k in self.inputs}
            parts.append(self.dynamic.run(chunk) if bucket is None else self._run_padded(chunk, take, bucket))
            start += take
        if len(parts) == 1:
            return parts[0]
        return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

    def _run_padded(self, chunk: dict[str, np.ndarray], take: int, bucket: int) -> dict[str, np.ndarray]:
        """Run `take` rows on a bucket: written into the bucket's input buffers, the rest filled with copies of
        the last real row (ids stay valid; rows are independent, so they change nothing), outputs sliced."""
        runner = self._runner(bucket, take)
        if take == bucket:
            return runner.run(chunk)
        buffers = self._buffers.setdefault(bucket, {})
        for k, v in chunk.items():
            buf = buffers.get(k)
            if buf is None or buf.shape[1:] != v.shape[1:] or buf.dtype != v.dtype:
                buf = buffers[k] = np.empty((bucket,) + v.shape[1:], v.dtype)
            buf[:take] = v
            buf[take:] = v[take - 1]
        out = runner.run(buffers)
        return {k: v[:take] for k, v in out.items()}

    def _check_history(self, feeds) -> None:
        for name in self.inputs:
            shape = np.shape(feeds[name])
            if len(shape) >= 2 and shape[1] != self.seq_len:
                raise CtroptError(f"input {name!r} has history length {shape[1]}, the buckets were made for "
                                  f"{self.seq_len}; specialize with that --seq-len or leave it dynamic")


class _PaddedRun:
    """The padded path into one bucket (pad, run, slice), as something `bench` times like a Runner."""

    def __init__(self, session: BucketedSession, take: int, bucket: int):
        self.session, self.take, self.bucket = session, take, bucket

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.session._run_padded(feeds, self.take, self.bucket)


def _shared_initializers(models: list) -> tuple[list[dict], list[np.ndarray]]:
    """Per model, {name: OrtValue} for its initializers that another model holds too (same name, dtype, shape
    and bytes; at least SHARE_BYTES), each backed by one array for all; and those arrays (keep them alive)."""
    count, keyed = {}, []
    for model in models:
        keys = {}
        for t in model.graph.initializer:
            if t.data_location == onnx.TensorProto.EXTERNAL:
                continue
            data = t.raw_data or numpy_helper.to_array(t).tobytes()
            if len(data) >= SHARE_BYTES:
                key = (t.name, t.data_type, tuple(t.dims), hashlib.blake2b(data, digest_size=16).digest())
                keys[t.name] = key
                count[key] = count.get(key, 0) + 1
        keyed.append((model, keys))
    arrays, values, per_model = [], {}, []
    for model, keys in keyed:
        mine = {}
        for t in model.graph.initializer:
            key = keys.get(t.name)
            if key is None or count[key] < 2:
                continue
            if key not in values:
                arrays.append(np.ascontiguousarray(numpy_helper.to_array(t)))
                values[key] = ort.OrtValue.ortvalue_from_numpy(arrays[-1])
            mine[t.name] = values[key]
        per_model.append(mine)
    return per_model, arrays


def _medians(result) -> tuple[float, float]:
    """Median seconds per run of the two models of a paired `bench`."""
    a, b = result.latency
    return a.p50_ms / 1e3, b.p50_ms / 1e3
