"""The speed guard: a pass that is there for speed stays only when the target's runtime measures it not slower.

Numerics are checked after every pass; speed is checked like them. After a speed pass has passed the numeric
check, its result is timed against the last *checkpoint* (the last model measured, at first the input) on the
target's CPU runtime: paired, interleaved runs (`runtime.bench.compare_speed`) on generated inputs at
`SpeedCheck.batch` rows (256: a serving batch), one thread. A fusion that leaves ops of the domain ai.ctropt
(function ops, not lowered yet) is measured together with the lowering that removes them ("fuse, then lower"):
the checkpoint waits, and the group is kept or rolled back as one. A pass in between that neither adds nor
lowers fused ops is timed alone against its input (both run the fused ops' function bodies).

Noise: the guard rolls a result back only when it is slower beyond doubt: the whole ~95 % interval of the
median time ratio (sign test) lies below `1 - margin` (margin 0.03). A sample is the best of 3 back-to-back runs
of each model (single runs of a 1 ms model scatter by ±5 %, which put DeepCTR DIEN's dedup-user-side at 0.95×
on both sides of the threshold from one run to the next). Pairs are taken until the interval lies clear of the
threshold, at least 10 and up to `seconds` (1.5 s) per decision: clear cases stop early, close ones get the
whole budget and are kept. `benchmarks/corpus.py --twice` runs the whole corpus twice and compares decisions.

Pass by pass, the guard misses a pass that is slower alone but that a later pass needs (fold-batchnorm's
Mul + Add, which fold-fc-affine then folds into the FC): when it rolled anything back, the manager also applies
every verified pass in one line and keeps that result when it is faster beyond doubt (`PassManager._try_every_pass`).
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
import onnx

from ..graph import CtroptError, iter_proto_nodes
from ..runtime import Runner, compare_outputs, generate_inputs
from ..runtime.session import check_backend
from ..runtime.bench import SpeedVerdict, compare_speed
from ..runtime.inputs import DEFAULT_SEQ_LEN, stored_input_facts


@dataclasses.dataclass
class SpeedCheck:
    """How the guard measures. enforce=False measures and records only (`--bench-passes`)."""

    batch: int = 256
    threads: int = 1
    margin: float = 0.03
    seconds: float = 1.5
    seq_len: int | None = None
    feeds: dict[str, np.ndarray] | None = None
    enforce: bool = True

    @property
    def threshold(self) -> float:
        return 1.0 - self.margin


def fused_op_counts(model: onnx.ModelProto) -> collections.Counter:
    """How many calls of each of the model's own functions (ai.ctropt fused ops a lowering pass still has to
    replace) it makes; empty when it makes none."""
    local = {(f.domain, f.name) for f in model.functions}
    return collections.Counter((n.domain, n.op_type) for n in iter_proto_nodes(model.graph)
                               if local and (n.domain, n.op_type) in local)


class SpeedGuard:
    """Checkpoints and measurements for one PassManager run on one target."""

    def __init__(self, check: SpeedCheck, target: str, model: onnx.ModelProto, device: str = "cpu"):
        self.check = check
        self.backend = "openvino-cpu" if target == "openvino" else f"ort-{device}"
        check_backend(self.backend)  # the GPU: where onnxruntime has no CUDA provider the caller turns the guard off
        one_user = any(f.is_user for f in stored_input_facts(model).values())   # declared: requests of one user
        self.feeds = check.feeds if check.feeds is not None else generate_inputs(
            model, batch=check.batch, seed=2, seq_len=check.seq_len or DEFAULT_SEQ_LEN, one_user=one_user)
        self._runners: dict[int, tuple[onnx.ModelProto, Runner]] = {}  # the model is kept so its id stays its own
        self.result_wrong = False  # the last try_measure's result gives wrong outputs on the target's runtime

    def where(self) -> str:
        return f"{self.backend}, batch {len(next(iter(self.feeds.values()), []))}, {self.check.threads} thread(s)"

    def runner(self, model: onnx.ModelProto) -> Runner:
        """A session per model, kept while the model is a checkpoint (the next measurement's `before`)."""
        key = id(model)
        if key not in self._runners:
            self._runners[key] = (model, Runner(model, self.backend, threads=self.check.threads))
        return self._runners[key][1]

    def loads(self, model: onnx.ModelProto) -> bool:
        """Whether the target's runtime loads and runs the model on the guard's inputs."""
        try:
            self.runner(model).run(self.feeds)
            return True
        except CtroptError:
            return False

    def forget_except(self, *models: onnx.ModelProto) -> None:
        keep = {id(m) for m in models}
        self._runners = {k: v for k, v in self._runners.items() if k in keep}

    def measure(self, before: onnx.ModelProto, after: onnx.ModelProto, threshold: float | None = None) -> SpeedVerdict:
        """time(before)/time(after); CtroptError when either cannot run on the target's runtime."""
        verdict = compare_speed(self.runner(before), self.runner(after), self.feeds,
                                threshold=threshold or self.check.threshold, seconds=self.check.seconds)
        self.forget_except(before, after)
        return verdict

    def try_measure(self, before, after, threshold: float | None = None) -> tuple[SpeedVerdict | None, str]:
        """The verdict, or None and why not. `result_wrong` tells afterwards whether `after` (alone: `before` is
        right) gives wrong outputs on the target's runtime, which the manager then rolls back."""
        self.result_wrong = False
        try:
            wrong = self._wrong_on_target(before, after)
            if wrong:
                self.result_wrong = wrong.startswith("the result")
                return None, f"not timed: {wrong}"
            return self.measure(before, after, threshold), ""
        except CtroptError as e:  # e.g. OpenVINO cannot load the graph before its lowering
            return None, f"not timed: {str(e).splitlines()[0][:200]}"

    def _wrong_on_target(self, before, after) -> str:
        """On OpenVINO, a model may run fast because it runs wrong (zoo wdl_tf's raw export: an empty output at
        batch 256, 0.19× "faster"): both sides are checked against onnxruntime's outputs (where every model the
        manager keeps is verified) before they are timed, and a wrong side is never kept for speed."""
        if self.backend.startswith("ort"):
            return ""
        truth = Runner(after, "ort-cpu", threads=self.check.threads).run(self.feeds)
        for side, model in (("the model before", before), ("the result", after)):
            got = self.runner(model).run(self.feeds)
            if not all(d.ok for d in compare_outputs(truth, {k: got[k] for k in truth if k in got}, atol=1e-4, rtol=1e-3)):
                return f"{side} gives wrong outputs on {self.backend}"
        return ""
