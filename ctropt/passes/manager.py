"""The PassManager: runs passes in order, verifies outputs after each one, rolls back failures."""

from __future__ import annotations

import dataclasses
import hashlib
import time
from typing import Callable

import numpy as np
import onnx

from ..graph import (CtroptError, annotate_shapes, interface, iter_proto_graphs, node_count, to_graph, to_model,
                     weights)
from ..runtime import (DEFAULT_ATOL, DEFAULT_BATCH, DEFAULT_RTOL, Runner, compare_outputs, generate_inputs,
                       model_input_facts, store_input_facts, summary)
from .. import kernels
from ..runtime import cpu
from ..report.diff import ModelDiff, diff_models
from ..runtime.bench import SpeedVerdict
from .registry import Pass, PassContext, resolve
from .speed import SpeedCheck, SpeedGuard, fused_op_counts


@dataclasses.dataclass
class PassRecord:
    """What one pass did: statistics, the node-level change, the numeric check and the time it took."""

    name: str
    status: str  # applied | unchanged | rolled back | failed | slower (rolled back by the speed guard) | skipped
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
    speedup: float | None = None  # time before / after, paired (the speed guard), also for a group it was in
    speedup_p10: float | None = None
    speedup_p90: float | None = None


@dataclasses.dataclass
class OptimizeResult:
    model: onnx.ModelProto
    records: list[PassRecord]
    verified: bool
    speed: SpeedVerdict | None = None  # the whole result against the input, on the target's runtime
    speed_note: str = ""  # why the whole result was not timed, or that the input was kept as faster
    kept_input: bool = False  # the optimized model measured slower than the input: the input is the result
    repairs: list[str] = dataclasses.field(default_factory=list)  # what was fixed in the export before any pass

    @property
    def failed(self) -> list[PassRecord]:
        return [r for r in self.records if r.status in ("rolled back", "failed")]


class PassFailed(CtroptError):
    pass


class PassManager:
    """Run passes on a model; after each pass compare every output with the original's and roll back on error.

    feeds: inputs to verify with (default: generated, `batch` rows, and one row as well); verify=False skips
    the numeric check (the interface check still runs). strict=True raises PassFailed instead of rolling back.
    speed: a SpeedCheck (or True for the default one): the speed guard (passes/speed.py) times every applied
    speed pass against the last checkpoint and rolls back what is slower, then the whole result against the
    input; with `enforce=False` it times every applied pass and only records the ratios.
    """

    def __init__(self, passes="all", *, skip=(), target: str = "ort", feeds: dict[str, np.ndarray] | None = None,
                 batch: int = DEFAULT_BATCH, atol: float = DEFAULT_ATOL, rtol: float = DEFAULT_RTOL, verify: bool = True,
                 strict: bool = False, options: dict | None = None,
                 on_pass: Callable[[Pass, PassRecord | None], None] | None = None,
                 speed: SpeedCheck | bool | None = None, device: str = "cpu"):
        self.passes = resolve(passes, skip, target, device)
        self.target, self.device, self.feeds, self.batch = target, device, feeds, batch
        self.atol, self.rtol, self.verify, self.strict = atol, rtol, verify, strict
        self.options = dict(options or {})
        if device == "cuda":
            if self.options.get("ort_kernels", "off") != "off":
                raise CtroptError("ctropt's kernels are CPU code: --device cuda needs ort_kernels=off")
            self.options["ort_kernels"] = "off"
        self.on_pass = on_pass
        self.speed = SpeedCheck() if speed is True else (speed or None)
        self.input_facts = None  # the model's runtime.inputs facts, set by run for the passes
        self.check_validity = True  # the input passes onnx's full checker, so every pass's result must (set by run)

    def _input_options(self) -> dict:
        """A static history length asked of the lowering is the one the generated inputs use."""
        seq_len = self.options.get("static_seq_len")
        return {"seq_len": int(seq_len)} if seq_len else {}

    def run(self, model: onnx.ModelProto) -> OptimizeResult:
        """Optimize `model`. Its large tensors are kept in a weight store (graph/weights.py) while the passes run:
        the active one (`ctropt optimize` opens one beside the output), else one of its own, whose tensors the
        result then carries in the proto again."""
        if weights.active() is not None or not any(
                weights.external_ref(t) is None and weights.nbytes(t) >= weights.THRESHOLD for t in model.graph.initializer):
            result = self._run(model)
        else:
            with weights.WeightStore.opened() as store:
                copy = onnx.ModelProto()
                copy.CopyFrom(model)
                result = self._run(store.adopt(copy))
                result.model = store.inline(result.model)
        kernels.describe(result.model)  # the metadata names the kernel library the result needs, if any
        cpu.describe(result.model)  # and the CPU it was measured on
        return result

    def _run(self, model: onnx.ModelProto) -> OptimizeResult:
        problem = invalid_reason(model)
        model, repairs = reshape_outputs_as_declared(model) if problem else (model, [])
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
        # an input the checker refuses (and no repair fixed) is kept as valid as it was
        self.check_validity = problem is None or bool(repairs)
        current = to_model(to_graph(model), like=model)  # one normalizing round trip, so passes compare like with like
        self.input_facts = model_input_facts(model, user_inputs=self.options.get("user_inputs", ""))
        store_input_facts(current, self.input_facts)  # id bounds outlive rewrites that hide them (fused tables)
        start = current
        guard = SpeedGuard(self.speed, self.target, start, self.device) if self.speed else None
        current, records = self._run_line(start, reference, feeds, original_interface, guard, self.on_pass)
        if self.target == "openvino":
            current, records = self._loadable_on_openvino(guard, start, current, records, reference, feeds,
                                                          original_interface)
        result = OptimizeResult(current, records, self.verify, repairs=repairs)
        if guard is not None:
            self._try_every_pass(guard, start, reference, feeds, original_interface, result)
            self._check_whole(guard, start, result)
        return result

    def _run_line(self, current, reference, feeds, original_interface, guard: SpeedGuard | None, on_pass):
        """Every pass in turn on `current` (each verified, and timed when `guard` is given): the result and the
        records."""
        records = []
        pending = _Pending(current, reference)
        for p in self.passes:
            if on_pass:
                on_pass(p, None)
            before, kept = current, reference
            record, current, reference = self._run_one(p, current, original_interface, feeds, reference)
            records.append(record)
            if guard is not None and record.status == "applied":
                current, reference = self._guard(guard, p, record, pending, (before, kept), (current, reference))
            if on_pass:
                on_pass(p, record)
        if guard is not None and pending.timed:  # a fusion no lowering followed: timed as it is
            current, reference = self._settle(guard, pending, current, reference)
        return current, records

    def _loadable_on_openvino(self, guard: SpeedGuard | None, start, current, records, reference, feeds, interface_):
        """--target openvino: a result OpenVINO cannot load, from an input it loads, is made again without the
        fusion that broke loading (each applied fusion left out in turn, in the order they ran; the first line
        that loads is kept). Lowering passes fix forms OpenVINO refuses, so loading is judged on the whole line."""
        loads = guard.loads if guard is not None else _openvino_loader(feeds[0] if feeds else
                                                                       generate_inputs(start, batch=self.batch))
        if loads(current) or not loads(start):
            return current, records
        every = self.passes
        group = {p.name: p.group for p in every}
        try:
            for i, r in enumerate(records):
                if r.status != "applied" or group.get(r.name) != "fusion":
                    continue
                self.passes = [p for p in every if p.name != r.name]
                again, rerun = self._run_line(start, reference, feeds, interface_, guard, None)
                if loads(again):
                    r.status, r.rewrites, r.nodes_after = "rolled back", 0, r.nodes_before
                    r.max_abs_err = r.speedup = r.speedup_p10 = r.speedup_p90 = None
                    r.message = "OpenVINO cannot load the result with it (the rest made again without it)"
                    return again, rerun[:i] + [r] + rerun[i:]
        finally:
            self.passes = every
        return current, records

    def _try_every_pass(self, guard: SpeedGuard, start, reference, feeds, original_interface, result) -> None:
        """Pass by pass, the guard misses a pass that is slower alone but makes a later one pay (deepctr-torch DIN:
        fold-batchnorm's Mul + Add, 0.94× alone, which fold-fc-affine later folds into the FC; with every pass the
        result is 1.25× the pass-by-pass one). When it rolled
        something back, every verified pass is also applied in one line, and that result is kept instead when it
        is faster than the pass-by-pass one beyond doubt (the whole interval above 1 + margin)."""
        slower = {r.name: r for r in result.records if r.status == "slower"}
        if not slower or not guard.check.enforce:
            return
        spinner = (lambda p, record: record is None and self.on_pass(p, None)) if self.on_pass else None
        model, records = self._run_line(start, reference, feeds, original_interface, None, spinner)
        if _fingerprint(model) == _fingerprint(result.model):
            return
        verdict, note = guard.try_measure(result.model, model, threshold=1.0 + guard.check.margin)
        if verdict is None or not verdict.faster:
            for r in slower.values():
                r.notes = r.notes + [note or f"every verified pass applied in one line measured {verdict} against "
                                     "the pass-by-pass result: not kept"]
            return
        for r in records:
            alone = slower.get(r.name)
            if alone is not None and r.status == "applied":
                r.speedup, r.speedup_p10, r.speedup_p90 = alone.speedup, alone.speedup_p10, alone.speedup_p90
                r.message = (f"kept although {alone.speedup:.2f}× alone: with every verified pass applied the result "
                             f"is {verdict} faster than pass by pass")
        result.model, result.records = model, records

    def _guard(self, guard: SpeedGuard, p: Pass, record: PassRecord, pending: "_Pending", before, after):
        """After an applied pass: move the checkpoint, wait for a lowering, or time the group since it.
        `before` and `after` are (model, outputs to keep) pairs."""
        timed = bool(p.speed) or not guard.check.enforce
        fused, fused_after = fused_op_counts(before[0]), fused_op_counts(after[0])
        if timed and fused and fused == fused_after:
            # between a fusion and its lowering, a pass that neither adds nor lowers fused ops is timed alone:
            # both sides run the same fused ops (their function bodies)
            return self._settle(guard, _Pending(*before, [(record, True)]), *after)
        pending.records.append((record, timed))
        if not pending.timed:  # nothing to time since the checkpoint: move it
            pending.reset(*after)
            return after
        if fused_after:  # fuse, then lower: timed together with the lowering
            return after
        return self._settle(guard, pending, *after)

    def _settle(self, guard: SpeedGuard, pending: "_Pending", current, reference):
        """Time the passes since the checkpoint as one step; keep them, or roll them back when slower."""
        t0 = time.perf_counter()
        verdict, note = guard.try_measure(pending.model, current)
        group = [r for r, _ in pending.records]
        others = f" (timed together with {', '.join(r.name for r in group[:-1])})" if len(group) > 1 else ""
        for r in group:
            if verdict is None:
                r.notes = r.notes + [note]
            else:
                r.speedup, r.speedup_p10, r.speedup_p90 = verdict.ratio, verdict.p10, verdict.p90
        group[-1].seconds += time.perf_counter() - t0
        if verdict is None and guard.result_wrong:  # verified in onnxruntime, wrong where it is to run
            for r in group:
                r.status, r.rewrites, r.nodes_after = "rolled back", 0, r.nodes_before
                r.message = f"{note.removeprefix('not timed: ')}{others}: rolled back"
            current, reference = pending.model, pending.reference
        elif verdict is not None and verdict.slower and guard.check.enforce:
            for r in group:
                r.status, r.rewrites, r.nodes_after = "slower", 0, r.nodes_before
                r.message = f"rolled back: {verdict} on {guard.where()}{others}"
            current, reference = pending.model, pending.reference
        pending.reset(current, reference)
        return current, reference

    def _check_whole(self, guard: SpeedGuard, start: onnx.ModelProto, result: OptimizeResult) -> None:
        """The whole result against the input: if it is still slower, the input is the result (and says so)."""
        if not any(r.status == "applied" for r in result.records):
            return
        result.speed, note = guard.try_measure(start, result.model)
        if result.speed is None:
            result.speed_note = note
        elif result.speed.slower and guard.check.enforce:
            result.model, result.kept_input = start, True
            result.speed_note = (f"the optimized model measured slower than the input ({result.speed} on "
                                 f"{guard.where()}): the input is kept")

    def _run_one(self, p: Pass, before: onnx.ModelProto, original_interface, feeds, reference):
        """Run one pass; returns its record, the model to go on with and the outputs later passes must keep."""
        t0 = time.perf_counter()
        nodes_before = node_count(before)
        record = PassRecord(p.name, "applied", nodes_before=nodes_before, nodes_after=nodes_before)
        try:
            graph = to_graph(before)
            ctx = PassContext(graph, self.target, dict(self.options), input_facts=self.input_facts, device=self.device)
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
        problem = invalid_reason(after) if self.check_validity else None
        if problem:  # e.g. an op or attribute newer than the model's opset
            return self._reject(record, before, t0, "rolled back", f"made the model invalid: {problem}"), before, reference
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
        return record, after, reference

    def _reject(self, record: PassRecord, before, t0, status: str, message: str) -> PassRecord:
        record.status, record.message = status, message
        record.rewrites = 0
        record.seconds = time.perf_counter() - t0
        if self.strict:
            raise PassFailed(f"pass {record.name} {status}: {message}")
        return record


@dataclasses.dataclass
class _Pending:
    """The speed guard's checkpoint (the last model timed, with the outputs later passes must keep) and the
    records of the passes applied since, each with whether it is timed."""

    model: onnx.ModelProto
    reference: list | None
    records: list[tuple[PassRecord, bool]] = dataclasses.field(default_factory=list)

    @property
    def timed(self) -> bool:
        return any(t for _, t in self.records)

    def reset(self, model, reference) -> None:
        self.model, self.reference, self.records = model, reference, []


def _openvino_loader(feeds: dict[str, np.ndarray]) -> Callable[[onnx.ModelProto], bool]:
    """Whether OpenVINO's CPU loads and runs a model on `feeds` (the loading check without a speed guard)."""

    def loads(model: onnx.ModelProto) -> bool:
        try:
            Runner(model, "openvino-cpu", threads=1).run(feeds)
            return True
        except CtroptError:
            return False

    return loads


def invalid_reason(model: onnx.ModelProto) -> str | None:
    """Why onnx's full checker (node schemas at the model's opsets, strict shape inference) refuses the model. A
    model whose tensors a weight store holds is checked from the store's folder (the checker reads its files)."""
    store = weights.active()
    path = store.path_for(model) if store is not None and weights.stored(model) else None
    try:
        onnx.checker.check_model(str(path) if path else model, full_check=True)
    except Exception as e:  # checker and shape-inference errors
        return str(e).strip().splitlines()[0][:300]
    finally:
        if path is not None:
            path.unlink()
    return None


def reshape_outputs_as_declared(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str]]:
    """An export onnx's full checker refuses because an output declared with static dims is computed with other dims
    of the same size (paddle2onnx declares PaddleRec DIEN's aux loss a scalar, as paddle gives it, and computes [1])
    gets a Reshape to the declared dims. Returns the model (the input itself when nothing is repaired) and what was
    repaired. Call it on a model the checker refuses."""
    declared = {}
    for o in model.graph.output:
        t = o.type.tensor_type
        if t.HasField("shape") and all(d.HasField("dim_value") for d in t.shape.dim):
            declared[o.name] = [d.dim_value for d in t.shape.dim]
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    for o in probe.graph.output:
        if o.name in declared:
            o.type.tensor_type.ClearField("shape")
    try:
        inferred = onnx.shape_inference.infer_shapes(probe, data_prop=True).graph.output
    except Exception:  # inference is best effort
        return model, []
    repaired, repairs = onnx.ModelProto(), []
    repaired.CopyFrom(model)
    for o in inferred:
        t = o.type.tensor_type
        if o.name not in declared or not t.HasField("shape") or not all(d.HasField("dim_value") for d in t.shape.dim):
            continue
        dims = [d.dim_value for d in t.shape.dim]
        if dims != declared[o.name] and np.prod(dims) == np.prod(declared[o.name]):
            computed = f"{o.name}/as_computed"
            for n in repaired.graph.node:
                n.output[:] = [computed if x == o.name else x for x in n.output]
                n.input[:] = [computed if x == o.name else x for x in n.input]
            repaired.graph.initializer.append(onnx.numpy_helper.from_array(
                np.array(declared[o.name], np.int64), f"{o.name}/declared_shape"))
            repaired.graph.node.append(onnx.helper.make_node(
                "Reshape", [computed, f"{o.name}/declared_shape"], [o.name], name=f"{o.name}/as_declared"))
            repairs.append(f"output {o.name} is declared {declared[o.name]} but the export computes {dims}: "
                           "reshaped to its declared dims")
    if not repairs or invalid_reason(repaired) is not None:
        return model, []
    return repaired, repairs


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


def optimize(model: onnx.ModelProto, passes="all", *, speed: SpeedCheck | bool | None = True,
             **kwargs) -> OptimizeResult:
    """Python API: `ctropt.optimize(model, passes=["eliminate-identity", my_pass], target="ort")`; with the
    speed guard on, as `ctropt optimize` runs it (speed=False turns it off)."""
    return PassManager(passes, speed=speed, **kwargs).run(model)
