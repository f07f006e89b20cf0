"""What a model contains, for `ctropt inspect`: ops, interface, embedding tables, recurrent structures,
and which passes would rewrite it."""

from __future__ import annotations

import collections
import dataclasses

import onnx
import onnx_graphsurgeon as gs

from .graph import annotate_shapes, iter_graphs, nodes_near, op_histogram, to_graph, to_model
from .kernels import DOMAIN as KERNELS
from .ops import DOMAIN
from .ops.rnn import SequenceAttrs, is_sequence_node
from .passes.registry import Pass, PassContext
from .graph.edit import const_value
from .runtime.inputs import model_input_facts, store_input_facts

RECURRENT_OPS = {"GRU", "LSTM", "RNN"}
FC_OPS = {"MatMul", "Gemm"}


@dataclasses.dataclass
class Table:
    name: str
    rows: int
    width: int
    lookups: int
    ops: str
    taken_by: str = ""  # the embedding pass that rewrites its lookups, if one does


@dataclasses.dataclass
class Recurrent:
    kind: str
    where: str
    detail: str


def embedding_tables(graph: gs.Graph) -> list[Table]:
    """Constant matrices read by Gather (lookup) or multiplied by a OneHot (indicator/one-hot lookup), with the
    embedding pass that takes their lookups."""
    from .passes.embedding.bags import _bag_loop, padded_bag_tables
    from .passes.embedding.parallel import parallel_lookup_tables

    found: dict[str, list] = collections.defaultdict(list)
    shapes, taken = {}, {}
    for g in iter_graphs(graph):
        for node in g.nodes:
            kind = _lookup_kind(node)
            if kind == "partitioned":
                taken[node.inputs[0].name] = "merge-partitioned-embeddings"
            elif node.op == "Loop" and (bag := _bag_loop(node, g)) is not None:
                for lookup in nodes_near(bag.rows, 3, up=True):  # the rows' Gather, maybe weighted
                    if lookup.op == "Gather" and getattr(const_value(lookup.inputs[0]), "ndim", 0) == 2:
                        taken[lookup.inputs[0].name] = "vectorize-embedding-bags"
            if node.op in ("Gather", "GatherND") and node.inputs:
                table = node.inputs[0]
            elif node.op == "MatMul" and any(t.inputs and t.inputs[0].op == "OneHot" for t in node.inputs[:1]):
                table = node.inputs[1]
            else:
                continue
            value = const_value(table)
            if value is not None and value.ndim == 2 and value.shape[0] > 1:
                found[table.name].append(node.op)
                shapes[table.name] = value.shape
    taken.update((name, "fuse-parallel-embeddings") for name in parallel_lookup_tables(graph))
    taken.update((name, "vectorize-embedding-bags") for name in padded_bag_tables(graph))
    return sorted((Table(name, shapes[name][0], shapes[name][1], len(ops), ",".join(sorted(set(ops))), taken.get(name, ""))
                   for name, ops in found.items()), key=lambda t: (-t.lookups, t.name))


def recurrent_structures(graph: gs.Graph) -> list[Recurrent]:
    """ONNX RNN ops, Loop/Scan bodies that hold a gated cell, and weights shared by many MatMuls (unrolled steps)."""
    out = []
    for g in iter_graphs(graph):
        for node in g.nodes:
            if is_sequence_node(node):
                a = SequenceAttrs.of(node)
                variant = f"{a.kind}, hidden {a.hidden_size}, linear_before_reset {a.linear_before_reset}" + \
                    (f", att_keep {a.att_keep}" if a.kind == "AUGRU" else "")
                out.append(Recurrent(f"fused {node.op} ({DOMAIN})", node.name, variant))
            elif node.domain == KERNELS and node.op == "GRUScan":
                kind = {0: "GRU", 1: "AUGRU", 2: "AUGRU (keep gate scaled)", 3: "AGRU", 4: "AIGRU"}
                out.append(Recurrent(f"lowered GRUScan ({KERNELS})", node.name,
                                     f"{kind.get(node.attrs.get('mode'), '?')}, hidden {node.attrs.get('hidden_size')}"))
            elif node.op in RECURRENT_OPS:
                out.append(Recurrent(f"{node.op} op", node.name, f"hidden {node.attrs.get('hidden_size')}"))
            elif node.op in ("Loop", "Scan") and "body" in node.attrs:
                body = node.attrs["body"]
                ops = collections.Counter(n.op for b in iter_graphs(body) for n in b.nodes)
                gated = ops["Sigmoid"] >= 1 and ops["Tanh"] >= 1
                kind = node.op
                if gated:
                    kind = f"{node.op} with an AUGRU cell" if _attention_scaled_gate(body) else f"{node.op} with a GRU cell"
                out.append(Recurrent(kind, node.name, f"{sum(ops.values())} body nodes; "
                                     f"Sigmoid {ops['Sigmoid']}, Tanh {ops['Tanh']}, MatMul {ops['MatMul']}"))
        users = collections.Counter()
        for node in g.nodes:
            if node.op in FC_OPS and len(node.inputs) > 1 and const_value(node.inputs[1]) is not None:
                users[node.inputs[1].name] += 1
        for weight, count in users.items():
            if count >= 3:
                out.append(Recurrent("unrolled chain", weight, f"weight shared by {count} MatMul/Gemm (one per step)"))
    return out


def _upstream(t: gs.Tensor, hops: int) -> list[gs.Node]:
    return nodes_near(t, hops, up=True)


def _downstream(t: gs.Tensor, hops: int) -> list[gs.Node]:
    return nodes_near(t, hops, up=False)


MASK_OPS = {"Equal", "Not", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "Where"}
SPARSE_ID_OPS = {"Unique", "GatherND", "NonZero"}


def _lookup_kind(node: gs.Node) -> str | None:
    """'partitioned' (a Gather on one shard of a table, stitched back), 'bag' (ids of a bag, reduced per sample)."""
    if node.op != "Gather" or (table := const_value(node.inputs[0])) is None or table.ndim != 2:
        return None
    above = {n.op for n in _upstream(node.inputs[1], 4)}
    below = _downstream(node.outputs[0], 6)
    if "Compress" in above and any(n.op in ("ScatterElements", "ScatterND") for n in below):
        return "partitioned"
    if above & SPARSE_ID_OPS or any(n.op in ("ReduceSum", "ReduceMean") for n in below[:2]) and \
            node.inputs[1].shape is not None and len(node.inputs[1].shape) >= 2:
        return "bag"
    return None


def _is_din_attention_input(concat: gs.Node) -> bool:
    """Concat of q, k, q-k and q*k (in any order, q possibly tiled): the DIN/DIEN attention unit's input."""
    if len(concat.inputs) != 4:
        return False
    producers = [t.inputs[0] if t.inputs else None for t in concat.inputs]
    ops = sorted(p.op for p in producers if p is not None)
    sub = next((p for p in producers if p is not None and p.op == "Sub"), None)
    mul = next((p for p in producers if p is not None and p.op == "Mul"), None)
    if sub is None or mul is None:
        return False
    return {id(t) for t in sub.inputs} == {id(t) for t in mul.inputs} and len(ops) >= 2


def ctr_structures(graph: gs.Graph) -> list[Recurrent]:
    """Partitioned lookups, embedding bags, indicator columns and masked attention, by their exported form."""
    out = []
    stitched: dict[str, set] = collections.defaultdict(set)
    bags: dict[str, int] = collections.Counter()
    for g in iter_graphs(graph):
        for node in g.nodes:
            kind = _lookup_kind(node)
            if kind == "partitioned":
                stitch = next(n for n in _downstream(node.outputs[0], 6) if n.op in ("ScatterElements", "ScatterND"))
                stitched[stitch.name].add((node.inputs[0].name, const_value(node.inputs[0]).shape))
            elif kind == "bag":
                bags[node.inputs[0].name] += 1
            elif node.op == "OneHot" and any(n.op == "ReduceSum" for n in _downstream(node.outputs[0], 3)):
                depth = const_value(node.inputs[1])
                out.append(Recurrent("indicator column", node.name,
                                     f"OneHot(depth {int(depth.ravel()[0]) if depth is not None else '?'}) → ReduceSum"))
            elif node.op == "Concat" and _is_din_attention_input(node):
                scoring = next((n for n in _downstream(node.outputs[0], 30) if n.op in ("Softmax", "Where")), None)
                mask = sorted({n.op for t in (scoring.inputs if scoring else []) for n in _upstream(t, 5)} & MASK_OPS)
                how = f"{scoring.op} over scores masked with {', '.join(mask) or '?'}" if scoring else "mask not found"
                out.append(Recurrent("padded attention", node.name, f"MLP over [q, k, q-k, q*k]; {how}"))
    out += attention_structures(graph)
    for stitch, shards in stitched.items():
        widths = {shape[1] for _, shape in shards}
        rows = sum(shape[0] for _, shape in shards)
        out.append(Recurrent("partitioned lookup", stitch,
                             f"{len(shards)} shards, {rows} rows, width {'/'.join(map(str, sorted(widths)))}"))
    for table, n in bags.items():
        out.append(Recurrent("embedding bag", table, f"{n} lookup(s) reduced per sample"))
    return out


def attention_structures(graph: gs.Graph) -> list[Recurrent]:
    """Scaled dot-product attention, softmax(s · Q·Kᵀ + bias) · V, as attention-core-kernel reads it (and why it
    would not fuse one), and the AttentionCore nodes it made."""
    from .passes.attention.attention_core import CORE_RULES, read_core
    from .patterns import find_matches

    out = []
    if any(n.op == "Softmax" and n.outputs[0].shape is None for n in graph.nodes):
        annotate_shapes(graph)   # the scores' rank, as the pass sees it after infer-shapes
    for node in graph.nodes:
        if node.domain == KERNELS and node.op == "AttentionCore":
            source = "a boolean mask" if len(node.inputs) > 4 and node.inputs[4].name else \
                "a bias" if len(node.inputs) > 3 and node.inputs[3].name else "no mask"
            out.append(Recurrent(f"fused attention ({KERNELS})", node.name, f"AttentionCore, {source}"))
    for m in find_matches(CORE_RULES[0].pattern, graph, subgraphs=False):
        core = read_core(m)
        shape = m.root.outputs[0].shape
        detail = f"softmax(Q·Kᵀ) · V, output {list(shape) if shape is not None else '?'}"
        out.append(Recurrent("dot-product attention", m.node("softmax").name,
                             detail + (f"; not fusable: {core}" if isinstance(core, str) else "")))
    return out


def _attention_scaled_gate(body: gs.Graph) -> bool:
    """A gate (Sigmoid output, possibly split) multiplied by a value sliced from a body input: AUGRU's a*u."""
    gates = set()
    for n in body.nodes:
        if n.op == "Sigmoid":
            gates.add(id(n.outputs[0]))
            gates.update(id(o) for c in n.outputs[0].outputs if c.op in ("Split", "Slice") for o in c.outputs)
    inputs = {id(t) for t in body.inputs}
    for n in body.nodes:
        if n.op != "Mul" or len(n.inputs) != 2:
            continue
        for gate, other in ((n.inputs[0], n.inputs[1]), (n.inputs[1], n.inputs[0])):
            if id(gate) in gates and any(p.op in ("Slice", "Split", "Gather") and id(p.inputs[0]) in inputs
                                         for p in _upstream(other, 2)):
                return True
    return False


@dataclasses.dataclass
class PassPreview:
    name: str
    matches: int
    rewrites: int
    notes: list[str]
    misses: list[str]


def preview_passes(model: onnx.ModelProto, passes: list[Pass], target: str, explain_misses: bool) -> list[PassPreview]:
    """Dry-run the passes in order, each on what the ones before it made (as `optimize` runs them, without the
    numeric check), and report what each would do: a pass that another one enables (cancel-transposes after
    fold-batchnorm, the attention region after both) is shown as it would act in `all`."""
    previews = []
    facts = model_input_facts(model)
    current = to_model(to_graph(model), like=model)
    store_input_facts(current, facts)
    for p in passes:
        ctx = PassContext(to_graph(current), target, input_facts=facts)
        after = current
        try:
            p(ctx)
            after = to_model(ctx.graph, like=current)
            notes = ctx.notes
        except Exception as e:  # a preview must not stop the inspection; the next pass sees the model as it was
            notes = [f"raised {type(e).__name__}: {e}"]
        misses = p.misses(to_graph(current), target) if explain_misses and not ctx.rewrites else []
        previews.append(PassPreview(p.name, ctx.matches, ctx.rewrites, notes, misses))
        current = after
    return previews


def op_counts(model: onnx.ModelProto) -> list[tuple[str, int]]:
    return op_histogram(model).most_common()
