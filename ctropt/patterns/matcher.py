"""Pattern objects, the backtracking matcher, `explain` and the rewrite driver over graphsurgeon graphs."""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterator

import numpy as np
import onnx_graphsurgeon as gs

from ..graph import iter_graphs
from ..graph.edit import add_constant, add_node, const_value, replace_outputs

COMMUTATIVE = {"Add", "Mul", "Max", "Min", "Sum", "Mean", "And", "Or", "Xor", "Equal",
               "BitwiseAnd", "BitwiseOr", "BitwiseXor"}


def is_commutative(op: str) -> bool:
    return op in COMMUTATIVE


class _State:
    """Bindings of one match attempt, plus the record of how far it got (for explain)."""

    def __init__(self, graph_nodes: set[int], tracker: "_Tracker | None"):
        self.graph_nodes = graph_nodes
        self.tracker = tracker
        self.values: dict[str, gs.Tensor] = {}
        self.consts: dict[str, np.ndarray] = {}
        self.nodes: dict[int, gs.Node] = {}  # id(OpPattern) -> node
        self.named_nodes: dict[str, gs.Node] = {}

    def snapshot(self):
        return dict(self.values), dict(self.consts), dict(self.nodes), dict(self.named_nodes)

    def restore(self, snap):
        self.values, self.consts, self.nodes, self.named_nodes = (dict(s) for s in snap)

    def fail(self, reason: str) -> bool:
        if self.tracker is not None:
            self.tracker.record(len(self.nodes), reason, list(self.nodes.values()))
        return False


class _Tracker:
    def __init__(self):
        self.depth, self.reason, self.nodes = -1, "", []

    def record(self, depth, reason, nodes):
        if depth > self.depth:
            self.depth, self.reason, self.nodes = depth, reason, nodes


def _describe(t: gs.Tensor) -> str:
    producer = f" from {t.inputs[0].op} '{t.inputs[0].name}'" if t.inputs else ""
    return f"'{t.name}'{producer}"


# ----------------------------------------------------------------------------------------- patterns


class Pattern:
    """Matches one value (tensor) of a graph."""

    def match(self, value: gs.Tensor, st: _State) -> bool:
        raise NotImplementedError

    def __or__(self, other: "Pattern") -> "Pattern":
        return _Either(self, other)

    def op_patterns(self) -> Iterator["OpPattern"]:
        return iter(())


class Var(Pattern):
    """Any value (captured under `name` when given); `pred(tensor)` narrows it."""

    def __init__(self, name: str | None = None, pred: Callable[[gs.Tensor], bool] | None = None):
        self.name, self.pred = name, pred

    def match(self, value, st):
        if self.pred is not None and not self.pred(value):
            return st.fail(f"{_describe(value)} fails the condition on {self.name or 'a value'}")
        return _bind(self.name, value, st)

    def __repr__(self):
        return self.name or "_"


def Any() -> Var:  # noqa: N802 - reads like a pattern constructor
    """A wildcard: any value, not captured."""
    return Var()


class Const(Var):
    """A constant value (initializer or Constant node, outer scopes included) with optional checks."""

    def __init__(self, name: str | None = None, *, rank: int | None = None, shape: tuple | None = None,
                 dtype=None, value=None, pred: Callable[[np.ndarray], bool] | None = None):
        super().__init__(name)
        self.rank, self.shape, self.dtype, self.value, self.cpred = rank, shape, dtype, value, pred

    def match(self, value, st):
        v = const_value(value)
        what = self.name or "constant"
        if v is None:
            return st.fail(f"{_describe(value)} is not a constant (wanted {what})")
        if self.rank is not None and v.ndim != self.rank:
            return st.fail(f"{what} '{value.name}' has rank {v.ndim}, wanted {self.rank}")
        if self.shape is not None and tuple(v.shape) != tuple(self.shape):
            return st.fail(f"{what} '{value.name}' has shape {v.shape}, wanted {self.shape}")
        if self.dtype is not None and v.dtype != np.dtype(self.dtype):
            return st.fail(f"{what} '{value.name}' has dtype {v.dtype}, wanted {np.dtype(self.dtype)}")
        if self.value is not None and not (v.shape == np.shape(self.value) or v.size == 1) or (
            self.value is not None and not np.all(v == self.value)
        ):
            return st.fail(f"{what} '{value.name}' is {v.ravel()[:4]}, wanted {self.value}")
        if self.cpred is not None and not self.cpred(v):
            return st.fail(f"{what} '{value.name}' fails its condition")
        if not _bind(self.name, value, st):
            return False
        if self.name:
            st.consts[self.name] = v
        return True

    def __repr__(self):
        return f"Const({self.name or ''})"


def _bind(name, value, st) -> bool:
    if name is None:
        return True
    bound = st.values.get(name)
    if bound is not None and bound is not value:
        return st.fail(f"{name} is bound to '{bound.name}' but here it would be '{value.name}'")
    st.values[name] = value
    return True


class _Either(Pattern):
    def __init__(self, *alternatives: Pattern):
        self.alternatives = alternatives

    def match(self, value, st):
        snap = st.snapshot()
        for alt in self.alternatives:
            if alt.match(value, st):
                return True
            st.restore(snap)
        return False

    def op_patterns(self):
        for alt in self.alternatives:
            yield from alt.op_patterns()

    def __repr__(self):
        return " | ".join(map(repr, self.alternatives))


class OpPattern(Pattern):
    """A node of one of `op_types` whose inputs match `inputs` (in either order for commutative ops); an op type
    ending in `*` stands for every op that starts with the rest (`GRUSequence*`: the variants of a custom op)."""

    def __init__(self, op_types: str, inputs: tuple, attrs: dict | None = None, *, name: str | None = None,
                 domain: str | None = None, shared: bool = False, outputs: int | None = None):
        self.op_types = tuple(op_types.split("|"))
        self.prefixes = tuple(t[:-1] for t in self.op_types if t.endswith("*"))
        self.variadic = bool(inputs) and inputs[-1] is Ellipsis
        self.inputs = tuple(i for i in inputs if i is not Ellipsis)
        self.attrs = attrs or {}
        self.name, self.domain, self.shared, self.num_outputs = name, domain, shared, outputs
        self.output_index = 0

    def __getitem__(self, index: int) -> "_OutputOf":
        return _OutputOf(self, index)

    def accepts(self, op: str) -> bool:
        """Whether a node of type `op` may be this pattern's node."""
        return op in self.op_types or (bool(self.prefixes) and op.startswith(self.prefixes))

    def op_patterns(self):
        yield self
        for p in self.inputs:
            yield from p.op_patterns()

    def match(self, value, st):
        return self.match_output(value, 0, st)

    def match_output(self, value, index, st) -> bool:
        if not value.inputs:
            return st.fail(f"{_describe(value)} is not produced by a node (wanted {self.op_types[0]})")
        node = value.inputs[0]
        if id(node) not in st.graph_nodes:
            return st.fail(f"{_describe(value)} is produced in an outer scope (wanted {self.op_types[0]})")
        if index >= len(node.outputs) or node.outputs[index] is not value:
            return st.fail(f"{_describe(value)} is not output {index} of its node")
        bound = st.nodes.get(id(self))
        if bound is not None:
            return True if bound is node else st.fail(f"node '{node.name}' differs from the one bound before")
        if not self.accepts(node.op):
            return st.fail(f"{_describe(value)}: wanted {'|'.join(self.op_types)}")
        if self.domain is not None and ("" if node.domain in (None, "ai.onnx") else node.domain) != self.domain:
            return st.fail(f"node '{node.name}' is in domain {node.domain!r}, wanted {self.domain!r}")
        if self.num_outputs is not None and len(node.outputs) != self.num_outputs:
            return st.fail(f"node '{node.name}' has {len(node.outputs)} outputs, wanted {self.num_outputs}")
        for key, want in self.attrs.items():
            have = node.attrs.get(key)
            ok = want(have) if callable(want) else have == want
            if not ok:
                return st.fail(f"{node.op} '{node.name}': attribute {key}={have!r} fails {want!r}")
        inputs = list(node.inputs)
        while inputs and inputs[-1].name == "" and len(inputs) > len(self.inputs):
            inputs.pop()  # omitted optional inputs
        if len(inputs) < len(self.inputs) or (len(inputs) > len(self.inputs) and not self.variadic):
            return st.fail(f"{node.op} '{node.name}' has {len(inputs)} inputs, wanted {len(self.inputs)}")
        st.nodes[id(self)] = node
        if self.name:
            st.named_nodes[self.name] = node
        orders = [list(range(len(self.inputs)))]
        if node.op in COMMUTATIVE and len(self.inputs) == 2 and not self.variadic and len(inputs) == 2:
            orders.append([1, 0])
        snap = st.snapshot()
        for order in orders:
            if all(p.match(inputs[i], st) for p, i in zip(self.inputs, order)):
                return True
            st.restore(snap)
        del st.nodes[id(self)]
        st.named_nodes.pop(self.name, None)
        return False

    def __repr__(self):
        args = [repr(i) for i in self.inputs] + (["..."] if self.variadic else [])
        return f"{'|'.join(self.op_types)}({', '.join(args)})"


class _OutputOf(Pattern):
    def __init__(self, op: OpPattern, index: int):
        self.op, self.index = op, index

    def match(self, value, st):
        return self.op.match_output(value, self.index, st)

    def op_patterns(self):
        return self.op.op_patterns()

    def __repr__(self):
        return f"{self.op!r}[{self.index}]"


class _OpNamespace:
    """`P.Relu(x)`, `P["MatMul|Gemm"](x, w)`; keyword arguments are attribute checks."""

    def __getattr__(self, op: str):
        if op.startswith("__"):
            raise AttributeError(op)
        return self[op]

    def __getitem__(self, op_types: str):
        def build(*inputs, _name=None, _domain=None, _shared=False, _outputs=None, **attrs):
            return OpPattern(op_types, inputs, attrs, name=_name, domain=_domain, shared=_shared,
                             outputs=_outputs)

        return build


P = _OpNamespace()


# ----------------------------------------------------------------------------------------- matching


@dataclasses.dataclass
class Match:
    """One match: the graph it lives in, the root node, every matched node and the captures; `top` is the
    outermost graph (the one being rewritten: `graph` itself, or the model graph around a Loop/Scan/If body)."""

    graph: gs.Graph
    root: gs.Node
    nodes: list[gs.Node]
    values: dict[str, gs.Tensor]
    consts: dict[str, np.ndarray]
    named_nodes: dict[str, gs.Node]
    top: gs.Graph | None = None

    def __getitem__(self, name: str) -> gs.Tensor:
        return self.values[name]

    def const(self, name: str) -> np.ndarray:
        return self.consts[name]

    def node(self, name: str) -> gs.Node:
        return self.named_nodes[name]

    # building replacements

    def constant(self, name: str, value: np.ndarray) -> gs.Constant:
        return add_constant(self.graph, name, value)

    def op(self, op: str, inputs: list, attrs: dict | None = None, *, outputs: int = 1,
           name: str | None = None, domain: str | None = None, dtype=None, shape=None) -> list[gs.Variable]:
        """Add a node to the match's graph and return its new output tensors."""
        return add_node(self.graph, op, inputs, attrs, outputs=outputs, name=name or f"{self.root.name or op}/{op}",
                        domain=domain, dtype=dtype, shape=shape)


def _root_output(pattern: Pattern) -> tuple[OpPattern, int] | None:
    if isinstance(pattern, OpPattern):
        return pattern, 0
    if isinstance(pattern, _OutputOf):
        return pattern.op, pattern.index
    return None


def _roots(pattern: Pattern) -> list[tuple[OpPattern, int, Pattern]]:
    if isinstance(pattern, _Either):
        return [r for alt in pattern.alternatives for r in _roots(alt)]
    root = _root_output(pattern)
    if root is None:
        raise ValueError(f"a pattern must be rooted at an op, not {pattern!r}")
    return [(root[0], root[1], pattern)]


def _match_at(pattern: Pattern, node: gs.Node, graph: gs.Graph, graph_nodes: set[int],
              tracker: _Tracker | None, top: gs.Graph | None = None) -> Match | None:
    for op_pattern, index, alternative in _roots(pattern):
        if not op_pattern.accepts(node.op) or index >= len(node.outputs):
            continue
        st = _State(graph_nodes, tracker)
        if not alternative.match(node.outputs[index], st):
            continue
        nodes = list(st.nodes.values())
        if _leaks(st, node, graph, alternative, tracker):
            continue
        return Match(graph, node, nodes, st.values, st.consts, st.named_nodes, graph if top is None else top)
    return None


def _leaks(st: _State, root: gs.Node, graph: gs.Graph, pattern: Pattern, tracker) -> bool:
    """True if an inner (non-root, non-shared) node's output is used outside the match."""
    shared = {id(st.nodes[id(p)]) for p in pattern.op_patterns() if p.shared and id(p) in st.nodes}
    matched = {id(n) for n in st.nodes.values()}
    graph_outputs = {id(t) for t in graph.outputs}
    for n in st.nodes.values():
        if n is root or id(n) in shared:
            continue
        for out in n.outputs:
            users = [u for u in out.outputs if id(u) not in matched]
            if users or id(out) in graph_outputs:
                if tracker is not None:
                    where = f"{users[0].op} '{users[0].name}'" if users else "a graph output"
                    tracker.record(len(matched) + 0.5, f"'{out.name}' of {n.op} '{n.name}' is also used by {where}",
                                   list(st.nodes.values()))
                return True
    return False


def find_matches(pattern: Pattern, graph: gs.Graph, *, subgraphs: bool = True) -> list[Match]:
    """All matches in the graph (and its Loop/Scan/If bodies); matches may overlap."""
    found = []
    for g in (iter_graphs(graph) if subgraphs else [graph]):
        ids = {id(n) for n in g.nodes}
        for node in list(g.nodes):
            m = _match_at(pattern, node, g, ids, None, graph)
            if m is not None:
                found.append(m)
    return found


@dataclasses.dataclass
class Explanation:
    """How far the best attempt at a pattern got, and the check that stopped it."""

    matched: bool
    root: str | None
    nodes_matched: list[str]
    reason: str

    def __str__(self):
        if self.matched:
            return f"matches at '{self.root}'"
        if self.root is None:
            return self.reason
        got = ", ".join(self.nodes_matched) or "nothing"
        return f"best attempt at '{self.root}' matched {got}; stopped: {self.reason}"


def explain(pattern: Pattern, graph: gs.Graph, *, subgraphs: bool = True) -> Explanation:
    """Report a match, or the deepest partial attempt and the check that failed."""
    starts = [p for p, _, _ in _roots(pattern)]
    best: tuple[float, gs.Node | None, _Tracker | None] = (-1, None, None)
    for g in (iter_graphs(graph) if subgraphs else [graph]):
        ids = {id(n) for n in g.nodes}
        for node in g.nodes:
            if not any(p.accepts(node.op) for p in starts):
                continue
            tracker = _Tracker()
            m = _match_at(pattern, node, g, ids, tracker, graph)
            if m is not None:
                return Explanation(True, node.name, [n.name for n in m.nodes], "")
            if tracker.depth > best[0]:
                best = (tracker.depth, node, tracker)
    if best[1] is None:
        roots = sorted({op for p in starts for op in p.op_types})
        return Explanation(False, None, [], f"no {'|'.join(roots)} node to start from")
    tracker = best[2]
    return Explanation(False, best[1].name, [f"{n.op} '{n.name}'" for n in tracker.nodes], tracker.reason)


# ----------------------------------------------------------------------------------------- rewriting


@dataclasses.dataclass
class Rewrite:
    """A pattern, a condition (True, or False/a reason string to skip) and a replacement.

    `replace(match)` builds new nodes with `match.op(...)` and returns the tensors that take the place of
    the root node's outputs (one per output; None keeps that output), or None to skip the match. A rewrite
    that edits the root node in place (a Loop body, its inputs), or builds nodes that write the root's old
    outputs and detaches it, returns the root's outputs as they now are (`list(match.root.outputs)`): nothing
    is moved. Rewrites run to a fixpoint, so the condition must decline a node once it is done.
    `subgraphs=False`: the rule looks at the outermost graph only, not in Loop/Scan/If bodies.
    """

    name: str
    pattern: Pattern
    replace: Callable[[Match], list | None]
    condition: Callable[[Match], bool | str] | None = None
    subgraphs: bool = True


def _in_place(node: gs.Node, new: list) -> bool:
    """Whether a replacement is the node's own outputs as they now are (it was edited in place)."""
    return len(new) == len(node.outputs) and all(a is b for a, b in zip(new, node.outputs))


def apply_rewrites(graph: gs.Graph, rules: list[Rewrite], *, max_rounds: int = 20) -> tuple[int, int]:
    """Apply rules until nothing matches; returns (matches, rewrites). Cleans the graph first and between rounds:
    a dead reader would keep a rule that wants a value read once from matching until a second run."""
    matches = rewrites = 0
    graph.cleanup(remove_unused_graph_inputs=False)
    for _ in range(max_rounds):
        changed = 0
        for g in list(iter_graphs(graph)):
            touched: set[int] = set()
            ids = {id(n) for n in g.nodes}
            in_scope = rules if g is graph else [r for r in rules if r.subgraphs]
            for node in list(g.nodes):
                if id(node) in touched or id(node) not in ids:
                    continue
                for rule in in_scope:
                    m = _match_at(rule.pattern, node, g, ids, None, graph)
                    if m is None or any(id(n) in touched for n in m.nodes):
                        continue
                    matches += 1
                    if rule.condition is not None and rule.condition(m) is not True:
                        continue
                    new = rule.replace(m)
                    if new is None:
                        continue
                    if not _in_place(node, new):
                        replace_outputs(g, node, new)
                    touched.update(id(n) for n in m.nodes)
                    changed += 1
                    break
        rewrites += changed
        graph.cleanup(remove_unused_graph_inputs=False).toposort(mode="nodes")
        if not changed:
            break
    return matches, rewrites
