"""The PassManager: runs passes in order, verifies outputs after each one, rolls back failures."""

from __future__ import annotations

import dataclasses
import hashlib
import time
from typing import Callable

import numpy as np
import onnx

from ..graph import CtroptError, annotate_shapes, interface, iter_proto_graphs, node_count, to_graph, to_model
from ..runtime import (DEFAULT_ATOL, DEFAULT_BATCH, DEFAULT_RTOL, Runner, compare_outputs, generate_inputs,
                       model_input_facts, store_input_facts, summary)
from ..report.diff import ModelDiff, diff_models
from .registry import Pass, PassContext, resolve


@dataclasses.dataclass
class PassRecord:
    """What one pass did: statistics, the node-level change, the numeric check and the time it took."""

    name: str
    status: str  # applied | unchanged | rolled back | failed | skipped
    matches: int = 0
    rewrites: int = 0
    nodes_before: int = 0
    nodes_after: int = 0
    max_abs_err: float | None = None
    seconds: float = 0.0
    message: str = ""
    notes: list[str] = dataclasses.field(default_factory=list)
    misses: list[str] = dataclasses.field(default_factory=list)  # a pass that did not fire: its closest attempts
    diff: ModelDiff | None = None  # what it changed (also for a rolled-back pass: what it tried)
    speedup: float | None = None  # time before / after, paired (PassManager(bench=...))
    speedup_p10: float | None = None
    speedup_p90: float | None = None


@dataclasses.dataclass
class OptimizeResult:
    model: onnx.ModelProto
    records: list[PassRecord]
    verified: bool

    @property
    def failed(self) -> list[PassRecord]:
        return [r for r in self.records if r.status in ("rolled back", "failed")]


class PassFailed(CtroptError):
    pass


class PassManager:
    """Run passes on a model; after each pass compare every output with the original's and roll back on error.

    feeds: inputs to verify with (default: generated, `batch` rows, and one row as well); verify=False skips
    the numeric check (the interface check still runs). strict=True raises PassFailed instead of rolling back.
    bench(before, after) -> (median, p10, p90) of paired time ratios: measured for every applied pass (a
    CtroptError from it becomes a "not timed" note).
    """

    def __init__(self, passes="all", *, skip=(), target: str = "ort", feeds: dict[str, np.ndarray] | None = None,
                 batch: int = DEFAULT_BATCH, atol: float = DEFAULT_ATOL, rtol: float = DEFAULT_RTOL, verify: bool = True,
                 strict: bool = False, options: dict | None = None,
                 on_pass: Callable[[Pass, PassRecord | None], None] | None = None,
                 bench: Callable[[onnx.ModelProto, onnx.ModelProto], tuple[float, float, float]] | None = None):
        self.passes = resolve(passes, skip, target)
        self.target, self.feeds, self.batch = target, feeds, batch
        self.atol, self.rtol, self.verify, self.strict = atol, rtol, verify, strict
        self.options = options or {}
        self.on_pass, self.bench = on_pass, bench
        self.input_facts = None  # the model's runtime.inputs facts, set by run for the passes

    def _input_options(self) -> dict:
        """A static history length asked of the lowering is the one the generated inputs use."""
        seq_len = self.options.get("static_seq_len")
        return {"seq_len": int(seq_len)} if seq_len else {}

    def run(self, model: onnx.ModelProto) -> OptimizeResult:
        original_interface = interface(model)
        reference = feeds = None
        if self.verify:
            feeds = [self.feeds if self.feeds is not None else generate_inputs(model, batch=self.batch,
                                                                                   **self._input_options())]
            try:
                runner = Runner(model)
                reference = [runner.run(feeds[0])]
            except CtroptError as e:
                raise CtroptError(f"cannot verify: the input model does not run ({e}); "
                                  "pass --no-verify to optimize without the numeric check") from None
            if self.feeds is None and self.batch != 1:  # one row too: batch-1 special cases are where rewrites break
                one = generate_inputs(model, batch=1, seed=1, **self._input_options())
                try:
                    reference.append(runner.run(one))
                    feeds.append(one)
                except CtroptError:  # some exports run only at the batch they were traced with
                    pass
        records = []
        current = to_model(to_graph(model), like=model)  # one normalizing round trip, so passes compare like with like
        self.input_facts = model_input_facts(model)
        store_input_facts(current, self.input_facts)  # id bounds outlive rewrites that hide them (fused tables)
        for p in self.passes:
            if self.on_pass:
                self.on_pass(p, None)
            record, current, reference = self._run_one(p, current, original_interface, feeds, reference)
            records.append(record)
            if self.on_pass:
                self.on_pass(p, record)
        return OptimizeResult(current, records, self.verify)

    def _run_one(self, p: Pass, before: onnx.ModelProto, original_interface, feeds, reference):
        """Run one pass; returns its record, the model to go on with and the outputs later passes must keep."""
        t0 = time.perf_counter()
        nodes_before = node_count(before)
        record = PassRecord(p.name, "applied", nodes_before=nodes_before, nodes_after=nodes_before)
        try:
            graph = to_graph(before)
            ctx = PassContext(graph, self.target, dict(self.options), input_facts=self.input_facts)
            p(ctx)
            if ctx.rewrites:
                annotate_shapes(ctx.graph)  # new values get dtypes/shapes, so later passes (and reruns) see them
            after = to_model(ctx.graph, like=before)
            record.matches, record.rewrites, record.notes = ctx.matches, ctx.rewrites, ctx.notes
        except CtroptError:
            raise
        except Exception as e:  # a broken pass must not take the model down with it
            return self._reject(record, before, t0, "failed", f"raised {type(e).__name__}: {e}"), before, reference
        if _fingerprint(after) == _fingerprint(before):
            record.status, record.seconds = "unchanged", time.perf_counter() - t0
            record.misses = p.misses(ctx.graph, self.target) if not ctx.rewrites and p.group != "cleanup" else []
            return record, before, reference
        record.diff = diff_models(before, after)
        if interface(after) != original_interface:
            return self._reject(record, before, t0, "rolled back", "changed the model's inputs/outputs"), before, reference
        if reference is not None:
            atol = 1e300 if not p.exact else self.atol
            try:
                runner = Runner(after)
                outputs = [runner.run(f) for f in feeds]
                checks = [(len(next(iter(f.values()), [])), compare_outputs(r, o, atol=atol, rtol=self.rtol))
                          for f, r, o in zip(feeds, reference, outputs)]
            except CtroptError as e:
                return self._reject(record, before, t0, "rolled back", str(e)), before, reference
            record.max_abs_err = max((d.max_abs for _, diffs in checks for d in diffs), default=0.0)
            for rows, diffs in checks:
                if not all(d.ok for d in diffs):
                    return self._reject(record, before, t0, "rolled back",
                                        f"outputs changed (batch {rows}): {summary(diffs)}"), before, reference
            if not p.exact:  # the pass gated its own accuracy; later passes must keep these outputs
                reference = outputs
        record.nodes_after = node_count(after)
        record.seconds = time.perf_counter() - t0
        if self.bench is not None:
            try:
                record.speedup, record.speedup_p10, record.speedup_p90 = self.bench(before, after)
            except CtroptError as e:  # e.g. OpenVINO cannot load the graph before lowering
                record.notes = record.notes + [f"not timed: {str(e).splitlines()[0][:200]}"]
        return record, after, reference

    def _reject(self, record: PassRecord, before, t0, status: str, message: str) -> PassRecord:
        record.status, record.message = status, message
        record.rewrites = 0
        record.seconds = time.perf_counter() - t0
        if self.strict:
            raise PassFailed(f"pass {record.name} {status}: {message}")
        return record


def _fingerprint(model: onnx.ModelProto) -> str:
    """A hash of the graph's structure (nodes, initializer names/shapes, typed values), not of tensor bytes."""
    h = hashlib.sha1()
    for g in iter_proto_graphs(model.graph):
        for n in g.node:
            h.update(n.SerializeToString(deterministic=True) if not _has_big_attr(n) else n.name.encode())
        for t in g.initializer:
            h.update(f"{t.name}:{t.data_type}:{list(t.dims)}".encode())
        for v in list(g.input) + list(g.output) + list(g.value_info):
            h.update(v.SerializeToString(deterministic=True))
    return h.hexdigest()


def _has_big_attr(node: onnx.NodeProto) -> bool:
    return any(a.type == onnx.AttributeProto.TENSOR and len(a.t.raw_data) > 1 << 20 for a in node.attribute)


def optimize(model: onnx.ModelProto, passes="all", **kwargs) -> OptimizeResult:
    """Python API: `ctropt.optimize(model, passes=["eliminate-identity", my_pass], target="ort")`."""
    return PassManager(passes, **kwargs).run(model)
