"""What changed between two models: nodes in every scope, initializers, op counts, and the changed regions.

A region is one connected piece of change in one graph scope (the main graph or a Loop/Scan/If body): the
nodes a pass removed, added or rewired there, joined through the values they share. Each region carries a
small before and after drawing (its nodes plus one hop of unchanged context), so the report never has to
hold or lay out the whole model.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib

import onnx

from ..graph import iter_proto_graphs, op_name as _op

MAIN = "main"
MAX_DRAWN = 60  # nodes of one side of a region drawn; the rest are counted in `hidden`
MAX_CONTEXT = 8  # unchanged neighbours drawn around a region, per direction
MAX_REGIONS = 40  # regions drawn per diff (all are listed)
MAX_BODY = 80  # nodes drawn of a Loop/Scan/If body that appeared or vanished with its node


@dataclasses.dataclass
class DrawNode:
    id: str
    op: str
    name: str
    role: str  # removed | added | changed | context | input | output
    detail: str = ""
    body: "Drawing | None" = None  # the Loop/Scan/If body of a node that appeared or vanished


@dataclasses.dataclass
class Drawing:
    nodes: list[DrawNode]
    edges: list[tuple[str, str, str]]  # (from id, to id, value name)
    hidden: int = 0  # region nodes left out of the drawing

    def names(self) -> list[str]:
        return [n.name for n in self.nodes]


@dataclasses.dataclass
class Region:
    scope: str
    removed: list[tuple[str, str]]  # (op, name)
    added: list[tuple[str, str]]
    changed: list[tuple[str, str]]  # same name and op, other inputs/outputs/attributes
    before: Drawing | None = None
    after: Drawing | None = None
    keys_before: list[str] = dataclasses.field(default_factory=list, repr=False)
    keys_after: list[str] = dataclasses.field(default_factory=list, repr=False)

    rewiring: list[str] = dataclasses.field(default_factory=list)  # what changed on each rewired node

    @property
    def summary(self) -> str:
        return self.describe()

    def describe(self, limit: int = 0) -> str:
        """`MatMul, Add, Relu → Gemm (+2 rewired)`: op types removed and added, in graph order, repeats
        counted; with `limit`, at most that many op types per side (the most frequent)."""
        def ops(nodes):
            counts = collections.Counter(op for op, _ in nodes)
            keep = set(op for op, _ in counts.most_common(limit)) if limit else set(counts)
            text = ", ".join(f"{op} ×{n}" if n > 1 else op for op, n in counts.items() if op in keep) or "nothing"
            return text + (f", … {len(counts) - len(keep)} more op types" if len(keep) < len(counts) else "")
        if not self.removed and not self.added:
            return f"rewired {ops(self.changed)}"
        return f"{ops(self.removed)} → {ops(self.added)}" + (f" (+{len(self.changed)} rewired)" if self.changed else "")


@dataclasses.dataclass
class ModelDiff:
    removed: list[tuple[str, str, str]]  # (scope, op, name)
    added: list[tuple[str, str, str]]
    changed: list[tuple[str, str, str]]
    initializers_added: list[str]
    initializers_removed: list[str]
    initializers_changed: list[str]  # same name, other dtype/shape/values
    ops_before: dict[str, int]
    ops_after: dict[str, int]
    regions: list[Region]  # all of them; the first MAX_REGIONS carry drawings
    value_types: int = 0  # values whose recorded dtype/shape (value_info) appeared or changed

    @property
    def empty(self) -> bool:
        return not (self.removed or self.added or self.changed or self.initializers_added
                    or self.initializers_removed or self.initializers_changed or self.value_types)

    def op_delta(self) -> list[tuple[str, int, int]]:
        """(op, count before, count after) for every op whose count changed, biggest change first."""
        ops = set(self.ops_before) | set(self.ops_after)
        rows = [(op, self.ops_before.get(op, 0), self.ops_after.get(op, 0)) for op in ops]
        return sorted((r for r in rows if r[1] != r[2]), key=lambda r: (-abs(r[2] - r[1]), r[0]))


# ----------------------------------------------------------------------------------------- reading a model


def _key(n: onnx.NodeProto) -> str:
    return n.name or f"<{n.op_type}>{n.output[0] if n.output else ''}"


def _signature(n: onnx.NodeProto) -> bytes:
    """The node apart from its subgraphs (those are compared scope by scope)."""
    h = hashlib.sha1(f"{n.domain}|{n.op_type}|{list(n.input)}|{list(n.output)}".encode())
    for a in n.attribute:
        if a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS):
            h.update(a.name.encode())
        else:
            h.update(a.SerializeToString(deterministic=True))
    return h.digest()


@dataclasses.dataclass
class _Scope:
    graph: onnx.GraphProto
    nodes: dict[str, onnx.NodeProto]  # key -> node, in graph order
    hubs: set[str]  # graph inputs and initializers: shared by too much to link regions through
    owner: tuple[str, str] | None  # (scope path, node key) of the Loop/Scan/If node this body belongs to

    @functools.cached_property
    def producer(self) -> dict[str, str]:
        return {o: k for k, n in self.nodes.items() for o in n.output if o}

    @functools.cached_property
    def inputs(self) -> set[str]:
        return {v.name for v in self.graph.input} - {t.name for t in self.graph.initializer}

    @functools.cached_property
    def outputs(self) -> set[str]:
        return {v.name for v in self.graph.output}

    @functools.cached_property
    def consumers(self) -> dict[str, list[str]]:
        found: dict[str, list[str]] = collections.defaultdict(list)
        for k, n in self.nodes.items():
            for v in n.input:
                found[v].append(k)
        return found


def _scopes(model: onnx.ModelProto) -> dict[str, _Scope]:
    """Every graph scope by path: `main`, `main/Scan 'rnn'.body`, ..."""
    out: dict[str, _Scope] = {}

    def walk(g: onnx.GraphProto, path: str, outer_hubs: set[str], owner):
        hubs = outer_hubs | {t.name for t in g.initializer} | {v.name for v in g.input}
        hubs |= {o for n in g.node if n.op_type == "Constant" for o in n.output}
        nodes: dict[str, onnx.NodeProto] = {}
        for n in g.node:  # names should be unique; a repeated one gets a suffix rather than hiding a node
            key = _key(n)
            nodes[key if key not in nodes else f"{key}#{len(nodes)}"] = n
        out[path] = _Scope(g, nodes, hubs, owner)
        for n in g.node:
            for a in n.attribute:
                subs = [a.g] if a.type == onnx.AttributeProto.GRAPH else (
                    list(a.graphs) if a.type == onnx.AttributeProto.GRAPHS else [])
                for i, sub in enumerate(subs):
                    suffix = f"[{i}]" if a.type == onnx.AttributeProto.GRAPHS else ""
                    walk(sub, f"{path}/{n.op_type} '{_key(n)}'.{a.name}{suffix}", hubs, (path, _key(n)))

    walk(model.graph, MAIN, set(), None)
    return out


def _initializers(model: onnx.ModelProto) -> dict[str, bytes]:
    found = {}
    for g in iter_proto_graphs(model.graph):
        for t in g.initializer:
            payload = t.raw_data or t.SerializeToString(deterministic=True)
            found[t.name] = hashlib.sha1(f"{t.data_type}|{list(t.dims)}".encode() + payload).digest()
    return found


def _histogram(scopes: dict[str, _Scope]) -> dict[str, int]:
    return dict(collections.Counter(_op(n) for s in scopes.values() for n in s.nodes.values()))


# ----------------------------------------------------------------------------------------- the diff


def diff_models(before: onnx.ModelProto, after: onnx.ModelProto) -> ModelDiff:
    """Compare two models node by node in every scope (nodes are matched by name, else by first output)."""
    sb, sa = _scopes(before), _scopes(after)
    removed, added, changed = [], [], []
    regions: list[Region] = []
    for path in list(sb) + [p for p in sa if p not in sb]:
        b, a = sb.get(path), sa.get(path)
        bn, an = (b.nodes if b else {}), (a.nodes if a else {})
        gone = [k for k in bn if k not in an or _op(an[k]) != _op(bn[k])]
        new = [k for k in an if k not in bn or _op(an[k]) != _op(bn[k])]
        rewired = [k for k in bn if k in an and _op(an[k]) == _op(bn[k]) and _signature(an[k]) != _signature(bn[k])]
        removed += [(path, _op(bn[k]), bn[k].name) for k in gone]
        added += [(path, _op(an[k]), an[k].name) for k in new]
        changed += [(path, _op(an[k]), an[k].name) for k in rewired]
        if b is not None and a is not None and (gone or new or rewired):
            regions += _regions(path, b, a, gone, new, set(rewired))
        # A scope only on one side came or went with its owner node: its owner's drawing shows it.
    ib, ia = _initializers(before), _initializers(after)
    for r in regions[:MAX_REGIONS]:
        _draw(r, sb, sa)
    return ModelDiff(removed, added, changed,
                     sorted(set(ia) - set(ib)), sorted(set(ib) - set(ia)),
                     sorted(k for k in set(ib) & set(ia) if ib[k] != ia[k]),
                     _histogram(sb), _histogram(sa), regions, _value_types(before, after))


def _value_types(before: onnx.ModelProto, after: onnx.ModelProto) -> int:
    def types(m):
        return {v.name: v.type.SerializeToString(deterministic=True)
                for g in iter_proto_graphs(m.graph) for v in g.value_info}
    b, a = types(before), types(after)
    return sum(1 for k, t in a.items() if b.get(k) != t)


def _regions(path: str, b: _Scope, a: _Scope, gone: list, new: list, rewired: set) -> list[Region]:
    """Group one scope's changed nodes into connected regions (through shared values that are not hubs)."""
    parent: dict[tuple[str, str], tuple[str, str]] = {}

    def find(x):
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def union(x, y):
        parent[find(x)] = find(y)

    items = [("b", k) for k in gone + sorted(rewired)] + [("a", k) for k in new + sorted(rewired)]
    for k in rewired:
        union(("b", k), ("a", k))
    by_value: dict[str, list] = collections.defaultdict(list)
    for side, k in items:
        scope, node = (b, b.nodes[k]) if side == "b" else (a, a.nodes[k])
        for v in list(node.input) + list(node.output):
            if v and v not in scope.hubs:
                by_value[v].append((side, k))
    for members in by_value.values():
        for m in members[1:]:
            union(members[0], m)
    groups: dict = collections.defaultdict(list)
    for it in items:
        groups[find(it)].append(it)
    order = {k: i for i, k in enumerate(b.nodes)}
    order_a = {k: i for i, k in enumerate(a.nodes)}
    regions = []
    for members in sorted(groups.values(), key=lambda ms: min(order.get(k, order_a.get(k, 0)) for _, k in ms)):
        kb = sorted((k for s, k in members if s == "b"), key=order.__getitem__)
        ka = sorted((k for s, k in members if s == "a"), key=order_a.__getitem__)
        regions.append(Region(
            path,
            [(_op(b.nodes[k]), b.nodes[k].name) for k in kb if k not in rewired],
            [(_op(a.nodes[k]), a.nodes[k].name) for k in ka if k not in rewired],
            [(_op(a.nodes[k]), a.nodes[k].name) for k in ka if k in rewired],
            rewiring=[f"{_op(a.nodes[k])} '{a.nodes[k].name}': {_rewiring(b.nodes[k], a.nodes[k])}"
                      for k in ka if k in rewired],
            keys_before=kb, keys_after=ka))
    return regions


def _rewiring(b: onnx.NodeProto, a: onnx.NodeProto) -> str:
    """`input 1 'w__dup' → 'w'`, `attribute axis`: what differs between two versions of a node."""
    out = []
    for kind, old, new in (("input", b.input, a.input), ("output", b.output, a.output)):
        for i in range(max(len(old), len(new))):
            x, y = (old[i] if i < len(old) else "∅"), (new[i] if i < len(new) else "∅")
            if x != y:
                out.append(f"{kind} {i} '{x}' → '{y}'")
    attrs_b = {x.name: x.SerializeToString(deterministic=True) for x in b.attribute}
    attrs_a = {x.name: x.SerializeToString(deterministic=True) for x in a.attribute}
    out += [f"attribute {k}" for k in sorted(set(attrs_b) | set(attrs_a)) if attrs_b.get(k) != attrs_a.get(k)]
    return "; ".join(out) or "subgraph"


def _draw(region: Region, sb: dict[str, _Scope], sa: dict[str, _Scope]) -> None:
    changed = set(region.keys_before) & set(region.keys_after)
    region.before = _drawing(region.scope, region.keys_before, changed, "removed", sb)
    region.after = _drawing(region.scope, region.keys_after, changed, "added", sa)


def _drawing(path: str, keys: list[str], changed: set[str], role: str, scopes: dict[str, _Scope], *,
             context: bool = True) -> Drawing:
    """The region's nodes in scope `path` (graph order, capped), one hop of unchanged neighbours, and the
    values that join them; graph inputs/outputs the region touches appear as input/output boxes."""
    scope = scopes[path]
    hidden = max(0, len(keys) - MAX_DRAWN)
    region = keys[:MAX_DRAWN]
    producer, consumers = scope.producer, scope.consumers
    chosen = set(region)
    nodes = [DrawNode(k, _op(scope.nodes[k]), scope.nodes[k].name, "changed" if k in changed else role,
                      _detail(scope.nodes[k]), None if k in changed else _body(path, k, scopes)) for k in region]
    if context:
        ups, downs = [], []
        for k in region:
            n = scope.nodes[k]
            ups += [producer[v] for v in n.input if v in producer and producer[v] not in chosen]
            downs += [c for v in n.output for c in consumers.get(v, ()) if c not in chosen]
        for k in list(dict.fromkeys(ups))[:MAX_CONTEXT] + list(dict.fromkeys(downs))[:MAX_CONTEXT]:
            if k not in chosen:
                chosen.add(k)
                nodes.append(DrawNode(k, _op(scope.nodes[k]), scope.nodes[k].name, "context", _detail(scope.nodes[k])))
    edges = []
    graph_inputs, graph_outputs = scope.inputs, scope.outputs
    io: dict[str, DrawNode] = {}
    for k in list(chosen):
        n = scope.nodes[k]
        for v in n.input:
            if v in producer and producer[v] in chosen:
                edges.append((producer[v], k, v))
            elif v in graph_inputs and k in region:
                io.setdefault("in:" + v, DrawNode("in:" + v, "input", v, "input", v))
                edges.append(("in:" + v, k, v))
        for v in n.output:
            if v in graph_outputs and k in region:
                io.setdefault("out:" + v, DrawNode("out:" + v, "output", v, "output", v))
                edges.append((k, "out:" + v, v))
    return Drawing(nodes + list(io.values()), edges, hidden)


def _detail(n: onnx.NodeProto) -> str:
    attrs = [a.name for a in n.attribute if a.type not in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)]
    lines = [f"{_op(n)} '{n.name}'", "in: " + ", ".join(i or "∅" for i in n.input), "out: " + ", ".join(n.output)]
    if attrs:
        lines.append("attrs: " + ", ".join(attrs))
    return "\n".join(lines)


def _body(path: str, key: str, scopes: dict[str, _Scope]) -> Drawing | None:
    """The first subgraph of a Loop/Scan/If node, drawn whole (capped), for a node that came or went."""
    for sub, scope in scopes.items():
        if scope.owner == (path, key):
            d = _drawing(sub, list(scope.nodes)[:MAX_BODY], set(), "body", scopes, context=False)
            d.hidden = max(0, len(scope.nodes) - MAX_BODY)
            return d
    return None
