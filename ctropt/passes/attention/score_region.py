"""The region that computes a site's scores position by position: walked back from the scores to its entries,
the [B, T, ...] values made outside it (which axes are positions is measured by the probe)."""

from __future__ import annotations

import dataclasses

import onnx_graphsurgeon as gs

from ...graph.edit import const_value
from ...runtime.probe import Probe


HEAVY_OPS = {"MatMul", "Gemm", "Conv", "MatMulInteger", "QLinearMatMul"}
OPAQUE_OPS = {"Loop", "Scan", "If"}  # their bodies are not read position by position


@dataclasses.dataclass
class Region:
    nodes: list[gs.Node]  # in graph order
    entries: list[gs.Tensor]  # [B, T, ...] values made outside the region


class _Axes:
    """Which values carry the (batch, history) positions, by their shapes in both probe runs."""

    def __init__(self, probe: Probe, bt: list[tuple[int, int]]):
        self.probe, self.bt = probe, bt

    def positional(self, t: gs.Tensor) -> bool:
        shapes = self.probe.shapes(t)
        return shapes is not None and all(len(s) >= 2 and tuple(s[:2]) == bt for s, bt in zip(shapes, self.bt))

    def flat(self, t: gs.Tensor) -> bool:
        """[B·T, ...], or [1, B·T, ...] (tf2onnx's tensordot)."""
        shapes = self.probe.shapes(t)
        return shapes is not None and all(len(s) >= 1 and (s[0] == b * t or tuple(s[:2]) == (1, b * t))
                                          for s, (b, t) in zip(shapes, self.bt))


def _walk_region(scores: gs.Tensor, axes: _Axes, forced: set[int]) -> Region | None:
    """The nodes between the entries and `scores` that work position by position (memoized backward walk)."""
    state: dict[int, str] = {}  # id(tensor) -> "const" | "node" | "entry" | "fail"

    def visit(t: gs.Tensor) -> bool:
        key = id(t)
        if key in state:
            return state[key] != "fail"
        if const_value(t) is not None:
            state[key] = "const"
            return True
        n = t.inputs[0] if t.inputs else None
        movable = n is not None and key not in forced and n.op not in OPAQUE_OPS and n.domain in ("", "ai.onnx", None)
        kind = axes.positional(t) or axes.flat(t) or (axes.probe.shape_like(t) and not axes.positional(t))
        if movable and kind:
            state[key] = "node"  # provisional: a cycle cannot occur in a DAG
            if all(visit(u) for u in n.inputs if u.name):
                for o in n.outputs:
                    state.setdefault(id(o), "node")
                return True
        ok = axes.positional(t) and t is not scores
        state[key] = "entry" if ok else "fail"
        return ok

    if not visit(scores) or state[id(scores)] != "node":
        return None
    nodes, entries, seen = {}, {}, set()
    stack = [scores]
    while stack:  # what S needs, through included nodes only (a failed branch leaves strays behind)
        t = stack.pop()
        if id(t) in seen:
            continue
        seen.add(id(t))
        s = state.get(id(t))
        if s == "entry":
            entries[id(t)] = t
        elif s == "node":
            n = t.inputs[0]
            nodes[id(n)] = n
            stack.extend(u for u in n.inputs if u.name)
    return Region(list(nodes.values()), list(entries.values()))


def _light_shape(t: gs.Tensor, axes: _Axes, inside: set[int]) -> bool:
    """A shape-like value made in the region without a heavy op: outside readers keep the original nodes."""
    if not axes.probe.shape_like(t):
        return False
    stack, seen = [t], set()
    while stack:
        u = stack.pop()
        n = u.inputs[0] if u.inputs else None
        if n is None or id(n) not in inside or id(n) in seen:
            continue
        seen.add(id(n))
        if n.op in HEAVY_OPS:
            return False
        stack.extend(x for x in n.inputs if n.op not in ("Shape", "Size"))
    return True


def find_region(scores: gs.Tensor, axes: _Axes, graph_outputs: set[int]) -> Region | None:
    """The region, with every value it makes that something outside reads turned into an entry (a light shape
    computation is left to be computed twice)."""
    forced: set[int] = set()
    while True:
        region = _walk_region(scores, axes, forced)
        if region is None:
            return None
        inside = {id(n) for n in region.nodes}
        leaks = {id(t) for n in region.nodes for t in n.outputs if t is not scores and
                 (id(t) in graph_outputs or any(id(c) not in inside for c in t.outputs)) and
                 (id(t) in graph_outputs or not _light_shape(t, axes, inside))}
        if not leaks - forced:
            return region
        forced |= leaks
