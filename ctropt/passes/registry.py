"""Pass objects, the registry and the context a pass runs in."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import pathlib
import re
import sys
from typing import Callable

import onnx_graphsurgeon as gs

from ..graph import CtroptError
from ..patterns import Rewrite, apply_rewrites, explain, find_matches

GROUPS = ("cleanup", "fusion", "quantize", "lower")
TARGETS = ("any", "ort", "openvino")
DEVICES = ("cpu", "cuda")  # where an ort-target model runs: ctropt's kernels and INT8 are CPU-only, FP16 CUDA-only


@dataclasses.dataclass
class PassContext:
    """What a pass sees: the graph to rewrite in place, the target, options, and its statistics."""

    graph: gs.Graph
    target: str = "ort"
    options: dict = dataclasses.field(default_factory=dict)
    matches: int = 0
    rewrites: int = 0
    notes: list[str] = dataclasses.field(default_factory=list)
    input_facts: dict | None = None  # the raw model's runtime.inputs facts, for passes that generate inputs
    device: str = "cpu"  # where the model will run (DEVICES)

    def apply(self, *rules: Rewrite) -> int:
        """Run pattern rewrites to a fixpoint over the graph and its subgraphs (a rule with subgraphs=False: the
        graph only), counting matches and rewrites; returns the rewrites."""
        matches, rewrites = apply_rewrites(self.graph, list(rules))
        self.matches += matches
        self.rewrites += rewrites
        return rewrites

    def count(self, changes: int) -> None:
        """Record what a whole-graph pass changed (each change one match and one rewrite)."""
        self.matches += changes
        self.rewrites += changes

    def note(self, text: str) -> None:
        self.notes.append(text)


def describe(doc: str) -> str:
    """A pass's description for users: its docstring's first paragraph in one line, without reST markup and
    without the references to this project's seed notes."""
    first = inspect.cleandoc(doc).split("\n\n")[0]
    text = re.sub(r"\s*\(seeds? [0-9, ]+\)", "", " ".join(first.split()))
    return re.sub(r"`+([^`]*)`+", r"\1", text)


@dataclasses.dataclass
class Pass:
    """A named graph transformation: `fn(ctx)` rewrites `ctx.graph` in place. What it did is counted in `ctx`:
    a pass of pattern rules through `ctx.apply(*rules)` (matches and rewrites); a whole-graph pass (dead nodes,
    shape inference, constant folding, CSE) by returning how many changes it made, which calling the Pass adds
    to both `ctx.matches` and `ctx.rewrites`."""

    name: str
    fn: Callable[[PassContext], int | None]
    group: str = "fusion"
    targets: tuple[str, ...] = ("any",)
    description: str = ""
    order: int = 100
    default: bool = True  # part of `all`; opt-in passes (e.g. INT8) say False
    exact: bool = True  # False: outputs change by design (INT8); the pass gates its own accuracy
    rules: "tuple[Rewrite, ...] | Callable[[str], list[Rewrite]]" = ()  # pattern rules (or target → rules), for explain
    speed: bool | None = None  # there for speed: the speed guard times it (None: fusion and lower passes are)
    devices: tuple[str, ...] = DEVICES  # the devices whose models it may rewrite
    options: dict = dataclasses.field(default_factory=dict)  # a plugin's own --option keys: key → meaning

    def rules_for(self, target: str) -> list[Rewrite]:
        """The pattern rules this pass applies for `target` (to explain why it did not fire)."""
        return list(self.rules(target) if callable(self.rules) else self.rules)

    def misses(self, graph: gs.Graph, target: str) -> list[str]:
        """Why this pass's rules do not fire on `graph`: per rule, the condition that declined each match, or
        how far the best attempt got and the check that stopped it."""
        misses = []
        for rule in self.rules_for(target):
            declined = []
            if rule.condition is not None:
                for m in find_matches(rule.pattern, graph, subgraphs=rule.subgraphs):
                    try:
                        verdict = rule.condition(m)
                    except Exception as e:  # a condition that cannot judge this match declines it
                        verdict = f"condition raised {type(e).__name__}"
                    if verdict is not True:
                        declined.append(f"'{m.root.name}'" + (f" ({verdict})" if isinstance(verdict, str) else ""))
            if declined:
                misses.append(f"{rule.name}: matched {len(declined)}, declined: {', '.join(declined[:5])}"
                              + (f" and {len(declined) - 5} more" if len(declined) > 5 else ""))
            else:
                misses.append(f"{rule.name}: {explain(rule.pattern, graph, subgraphs=rule.subgraphs)}")
        return misses

    def __post_init__(self):
        if self.group not in GROUPS:
            raise ValueError(f"pass {self.name}: group must be one of {GROUPS}")
        bad = [t for t in self.targets if t not in TARGETS]
        if bad:
            raise ValueError(f"pass {self.name}: unknown targets {bad}; use {TARGETS}")
        if not self.description:
            self.description = describe(self.fn.__doc__ or "")
        if self.speed is None:
            self.speed = self.group in ("fusion", "lower")
        if not self.devices or any(d not in DEVICES for d in self.devices):
            raise ValueError(f"pass {self.name}: devices must be some of {DEVICES}")

    def __call__(self, ctx: PassContext) -> None:
        """Run the pass on `ctx`; a count it returns is added to ctx.matches and ctx.rewrites."""
        changed = self.fn(ctx)
        if isinstance(changed, int) and not isinstance(changed, bool):
            ctx.count(changed)

    def applies_to(self, target: str) -> bool:
        return "any" in self.targets or target in self.targets

    @property
    def sort_key(self):
        return (GROUPS.index(self.group), self.order, self.name)


REGISTRY: dict[str, Pass] = {}

# The built-in pipeline in one place: where each pass runs within its group (groups run cleanup → fusion →
# quantize → lower). A plugin pass gives its own `order` to run between these (default 100: after them).
PIPELINE_ORDER = {
    # cleanup: what the exporters leave (dead and training-only nodes, constants, no-ops, duplicates)
    "eliminate-dead-nodes": 1, "infer-shapes": 2, "prune-training-ops": 5, "fold-constants": 8,
    "eliminate-identity": 10, "fold-batchnorm": 12, "einsum-as-matmul": 11, "cancel-transposes": 13, "select-masked-rows": 14,
    "dedup-initializers": 25, "eliminate-common-subexpressions": 30,
    # fusion: tables first (they change the lookups the others read), then sequences, attention, FC layers
    "string-embedding": 3, "merge-partitioned-embeddings": 5, "vectorize-embedding-bags": 10, "rewrite-sparse-columns": 12,
    "rewrite-indicator-columns": 15, "fuse-rnn": 30, "compute-read-rows-only": 34, "dedup-user-side": 35, "remove-attention-padding": 40,
    "project-query-once": 42, "weighted-sum-as-matmul": 45, "lookup-selected-rows": 46, "fuse-parallel-embeddings": 50,
    "fuse-fc": 60, "fold-fc-affine": 62, "static-reshape-targets": 63,
    # lower: the fused ops for the target first, then the forms OpenVINO cannot load or runs wrong
    "lower-rnn-ort": 1, "lower-rnn-openvino": 1, "attention-core-kernel": 2, "token-attention": 2.5, "fm-interaction-kernel": 2, "small-products-kernel": 3, "gather-rows-kernel": 4, "gated-sum-kernel": 4, "unique-rows-kernel": 4, "residual-add-as-sum": 5, "layer-norm-kernel": 6, "mul-add-kernel": 7, "dot-sum-kernel": 8, "squeeze-explicit-axes": 10, "compress-explicit-axis": 11,
    "body-inputs-own-names": 19, "scan-outer-scope-as-state": 20, "loop-inline-invariant-constants": 21,
    "body-passthrough-identity": 22, "concat-into-if-branches": 23, "gru-sequence-lens-as-mask": 30,
    "split-cast-bool-as-compare": 40, "topk-ties-by-index": 41,
}


def register_pass(name: str, *, group: str = "fusion", targets: tuple[str, ...] = ("any",), order: int | None = None,
                  description: str = "", default: bool = True, rules=(), exact: bool = True, speed: bool | None = None,
                  devices: tuple[str, ...] = DEVICES, options: dict[str, str] | None = None):
    """Decorator: register `fn(ctx)` as a pass. Returns the Pass (usable directly in `optimize`).

    rules: the pattern rules (`Rewrite`s) the pass applies with `ctx.apply(*rules)`, or a function target → rules;
    `ctropt inspect --explain` reports, for a pass that does not fire, why each rule did not. A pass that is not
    a set of rules (a whole-graph tool: dead nodes, shapes, folding, CSE) returns the number of changes it made
    instead: calling the Pass adds it to ctx.matches and ctx.rewrites.

    speed: whether the speed guard times the pass against its input (default: fusion and lower passes; a pass
    that makes a model load or compute right on its target, rather than faster, says False).
    devices: the devices (`--device`) whose models the pass may rewrite (default: all).
    options: the `--option` keys a plugin pass reads from ctx.options, each with a one-line meaning (ctropt's own
    keys are listed in ctropt.cli.PASS_OPTIONS); `ctropt optimize --option` refuses a key nobody declared."""

    def wrap(fn: Callable[[PassContext], int | None]) -> Pass:
        place = order if order is not None else PIPELINE_ORDER.get(name, 100)
        p = Pass(name, fn, group, tuple(targets), description, place, default, exact,
                 rules if callable(rules) else tuple(rules), speed, tuple(devices), dict(options or {}))
        REGISTRY[name] = p
        return p

    return wrap


def rewrite_pass(name: str, *rules: Rewrite, group: str = "fusion", targets=("any",), order: int | None = None,
                 description: str = "", default: bool = True) -> Pass:
    """Register a pass that only applies pattern rules."""

    def run(ctx: PassContext) -> None:
        ctx.apply(*rules)

    run.__doc__ = description
    return register_pass(name, group=group, targets=targets, order=order, description=description,
                         default=default, rules=rules)(run)


def load_plugin(module: str) -> None:
    """Import a user module (dotted name or path to a .py file) whose passes register themselves."""
    try:
        if module.endswith(".py"):
            path = pathlib.Path(module)
            spec = importlib.util.spec_from_file_location(path.stem, path)
            if spec is None or not path.exists():
                raise ImportError(f"no such file {module}")
            mod = importlib.util.module_from_spec(spec)
            sys.modules[path.stem] = mod
            spec.loader.exec_module(mod)
        else:
            importlib.import_module(module)
    except Exception as e:  # a plugin can fail in any way; report it, don't crash
        raise CtroptError(f"cannot load plugin {module}: {type(e).__name__}: {e}") from None


def resolve(passes="all", skip=(), target: str = "ort", device: str = "cpu") -> list[Pass]:
    """Turn `all`, a comma list, or a list of names/Pass objects into the passes to run, in order: a list with
    `all` in the pipeline's order (groups, then PIPELINE_ORDER), any other list as given. A pass named for a
    device it does not serve is an error; `all` leaves such passes out."""
    if target not in TARGETS[1:]:
        raise CtroptError(f"unknown target {target!r}; choose one of {', '.join(TARGETS[1:])}")
    if device not in DEVICES:
        raise CtroptError(f"unknown device {device!r}; choose one of {', '.join(DEVICES)}")
    if device != "cpu" and target != "ort":
        raise CtroptError(f"--device {device} is for --target ort (onnxruntime's CUDA execution provider)")
    if isinstance(passes, str):
        passes = [p.strip() for p in passes.split(",") if p.strip()]
    skip = [s.strip() for s in (skip.split(",") if isinstance(skip, str) else skip) if s.strip()]
    unknown = [n for n in list(skip) + [p for p in passes if isinstance(p, str) and p != "all"] if n not in REGISTRY]
    if unknown:
        raise CtroptError(f"unknown pass(es): {', '.join(unknown)}; `ctropt passes` lists them")
    chosen: list[Pass] = []
    for p in passes:
        if p == "all":
            chosen += sorted((q for q in REGISTRY.values()
                              if q.default and q.applies_to(target) and device in q.devices), key=lambda q: q.sort_key)
        else:
            chosen.append(REGISTRY[p] if isinstance(p, str) else p)
            if device not in chosen[-1].devices:
                raise CtroptError(f"{chosen[-1].name} is for --device {' or '.join(chosen[-1].devices)}, "
                                  f"not {device}")
    seen, result = set(), []
    for p in chosen:
        if p.name not in skip and p.name not in seen:
            seen.add(p.name)
            result.append(p)
    if "all" in passes:   # `all,quantize-int8`: the extra pass in its place in the pipeline (before the lowering)
        result.sort(key=lambda q: q.sort_key)
    return result
