"""Comparing the outputs of two models on the same inputs."""

from __future__ import annotations

import dataclasses

import numpy as np

DEFAULT_ATOL = 1e-4
DEFAULT_RTOL = 1e-4


@dataclasses.dataclass
class OutputDiff:
    name: str
    shape: tuple
    max_abs: float
    max_rel: float
    ok: bool
    reason: str = ""


def compare_outputs(ref: dict[str, np.ndarray], got: dict[str, np.ndarray], *, atol: float = DEFAULT_ATOL,
                    rtol: float = DEFAULT_RTOL) -> list[OutputDiff]:
    """Per output: |got - ref| <= atol + rtol * |ref| elementwise, NaN where and only where ref has NaN."""
    diffs = []
    for name, a in ref.items():
        if name not in got:
            diffs.append(OutputDiff(name, np.shape(a), float("inf"), float("inf"), False, "missing output"))
            continue
        b = got[name]
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape:
            diffs.append(OutputDiff(name, a.shape, float("inf"), float("inf"), False,
                                    f"shape {b.shape} != {a.shape}"))
            continue
        if a.dtype != b.dtype:
            diffs.append(OutputDiff(name, a.shape, float("inf"), float("inf"), False,
                                    f"dtype {b.dtype} != {a.dtype}"))
            continue
        if a.dtype.kind not in "fc":
            equal = bool(np.array_equal(a, b))
            diffs.append(OutputDiff(name, a.shape, 0.0 if equal else float("inf"), 0.0 if equal else float("inf"),
                                    equal, "" if equal else "values differ"))
            continue
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        nan_a, nan_b = np.isnan(a64), np.isnan(b64)
        same = np.where(nan_a | nan_b, nan_a == nan_b, np.isclose(b64, a64, rtol=rtol, atol=atol, equal_nan=True))
        finite = np.isfinite(a64) & np.isfinite(b64)
        err = np.abs(a64 - b64)[finite]
        rel = (err / np.maximum(np.abs(a64[finite]), atol)) if err.size else err
        ok = bool(same.all())
        diffs.append(OutputDiff(name, a.shape, float(err.max()) if err.size else 0.0,
                                float(rel.max()) if rel.size else 0.0, ok,
                                "" if ok else f"{int((~same).sum())} of {same.size} values differ"))
    return diffs


def all_ok(diffs: list[OutputDiff]) -> bool:
    return all(d.ok for d in diffs)


def summary(diffs: list[OutputDiff]) -> str:
    bad = [d for d in diffs if not d.ok]
    if not bad:
        worst = max((d.max_abs for d in diffs), default=0.0)
        return f"all {len(diffs)} outputs match (max abs err {worst:.2e})"
    return "; ".join(f"output {d.name}: {d.reason} (max abs err {d.max_abs:.3g})" for d in bad)
