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


@dataclasses.dataclass
class SpeedVerdict:
    """time(before)/time(after) of two models, paired: > 1 means `after` is faster."""

    ratio: float
    p10: float
    p90: float
    pairs: int
    threshold: float
    low: float  # the median's ~95 % interval
    high: float

    @property
    def slower(self) -> bool:
        """Slower beyond doubt: the whole interval of the median lies below the threshold. A close call (a pass
        at 0.97 on a loaded machine) is kept, so two runs of the same model decide alike."""
        return self.high < self.threshold

    @property
    def faster(self) -> bool:
        """Faster beyond doubt: the whole interval lies at or above the threshold (for a threshold above 1)."""
        return self.low >= self.threshold

    def __str__(self) -> str:
        return f"{self.ratio:.2f}× ({self.p10:.2f}–{self.p90:.2f}, {self.pairs} pairs)"


def median_interval(ratios: np.ndarray, z: float = 1.96) -> tuple[float, float]:
    """A distribution-free ~95 % interval of the median (sign test): the k-th smallest and k-th largest ratio."""
    r = np.sort(ratios)
    k = max(0, int(np.floor((len(r) - z * np.sqrt(len(r))) / 2)))
    return float(r[k]), float(r[len(r) - 1 - k])


def _best_of(runner: Runner, feeds: dict[str, np.ndarray], runs: int) -> float:
    """The fastest of `runs` back-to-back runs: scheduler and cache spikes only ever add time."""
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        runner.run(feeds)
        best = min(best, time.perf_counter() - t0)
    return best


def compare_speed(before: Runner, after: Runner, feeds: dict[str, np.ndarray], *, threshold: float,
                  seconds: float = 1.5, min_pairs: int = 10, max_pairs: int = 1000, warmup: int = 3,
                  best_of: int = 3) -> SpeedVerdict:
    """Paired, interleaved samples of two models until the median ratio's interval lies clear of `threshold`,
    or `seconds` are spent. A sample is the best of `best_of` back-to-back runs: on a 1 ms model single runs
    scatter by ±5 % and put a pass at 0.95x on both sides of 0.97 from one run to the next (DeepCTR DIEN's
    dedup-user-side); best-of-3 samples scatter by ±2 %. A clear case stops after `min_pairs`; a close one
    gets the whole budget and counts as not slower (SpeedVerdict.slower)."""
    for r in (before, after):
        for _ in range(warmup):
            r.run(feeds)
    pairs: list[tuple[float, float]] = []
    start = time.perf_counter()
    while len(pairs) < max_pairs:
        first, second = (before, after) if len(pairs) % 2 == 0 else (after, before)  # A B, B A, ...
        t_first, t_second = _best_of(first, feeds, best_of), _best_of(second, feeds, best_of)
        pairs.append((t_first, t_second) if first is before else (t_second, t_first))
        if len(pairs) >= min_pairs and len(pairs) % 2 == 0:
            ratios = np.array([b / a for b, a in pairs])
            low, high = median_interval(ratios)
            if low >= threshold or high < threshold or time.perf_counter() - start > seconds:
                break
    ratios = np.array([b / a for b, a in pairs])
    return SpeedVerdict(float(np.median(ratios)), float(np.percentile(ratios, 10)), float(np.percentile(ratios, 90)),
                        len(pairs), threshold, *median_interval(ratios))
