"""Latency and throughput, and the paired ratio of two models measured in one run.

Machines are noisy, so a speed claim is the median of per-pair ratios: models A and B run alternately
(A B, then B A, ...) on the same inputs with the same session options, and each pair gives time(A)/time(B).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import numpy as np

from .session import Runner


@dataclasses.dataclass
class Latency:
    runs: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    throughput: float  # samples per second at the median latency

    @classmethod
    def of(cls, seconds: list[float], batch: int) -> "Latency":
        ms = np.asarray(seconds) * 1e3
        p50, p90, p99 = (float(np.percentile(ms, q)) for q in (50, 90, 99))
        return cls(len(ms), p50, p90, p99, batch / (p50 / 1e3) if p50 > 0 else float("inf"))


@dataclasses.dataclass
class BenchResult:
    batch: int
    latency: list[Latency]  # one per model
    ratio: float | None = None  # median of time(A)/time(B): > 1 means B is faster
    ratio_p10: float | None = None
    ratio_p90: float | None = None


def bench(runners: list[Runner], feeds: dict[str, np.ndarray], batch: int, *, seconds: float = 3.0,
          min_runs: int = 10, max_runs: int = 10000, warmup: int = 3,
          on_step: Callable[[float], None] | None = None) -> BenchResult:
    """Time one or two models on `feeds` for about `seconds` (at least `min_runs` each), interleaved."""
    for r in runners:
        for _ in range(warmup):
            r.run(feeds)
    times: list[list[float]] = [[] for _ in runners]
    start = time.perf_counter()
    i = 0
    while i < max_runs and (i < min_runs or time.perf_counter() - start < seconds):
        order = range(len(runners)) if i % 2 == 0 else reversed(range(len(runners)))  # A B, B A, ...
        for k in order:
            t0 = time.perf_counter()
            runners[k].run(feeds)
            times[k].append(time.perf_counter() - t0)
        i += 1
        if on_step:
            on_step(min(1.0, (time.perf_counter() - start) / seconds))
    result = BenchResult(batch, [Latency.of(t, batch) for t in times])
    if len(runners) == 2:
        ratios = np.asarray(times[0]) / np.asarray(times[1])
        result.ratio = float(np.median(ratios))
        result.ratio_p10, result.ratio_p90 = (float(np.percentile(ratios, q)) for q in (10, 90))
    return result
