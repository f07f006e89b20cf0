"""Generating verification inputs that exercise a CTR model the way real traffic does.

Integer ids stay inside the table they index (the id is followed through Cast/Reshape/Slice/Squeeze/
Add/... to its Gather, into Loop/Scan bodies too); ids stored as float columns of one matrix (as
deepctr-torch does) get a range per column; sequence lengths and masks agree row by row, and padded
history positions hold id 0 (also where no length or mask is an input but the graph masks ids equal to 0).

An optimized model keeps its raw model's facts in its metadata (`store_input_facts`): after a rewrite such as
fuse-parallel-embeddings the ids reach one concatenated table through offsets, and the per-table bounds can no
longer be read off the graph.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from ..graph import CtroptError, to_graph
from ..graph.edit import const_value

# Ops an id passes through unchanged in value (shape may change).
_PASS_THROUGH = {"Cast", "Identity", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Expand", "Tile",
                 "Transpose", "Concat", "Floor", "Round", "Abs", "Clip", "Max", "Relu", "Split", "Gather",
                 "GatherElements", "GatherND", "Slice", "Where", "Ceil",
                 "GatherRowsInt64"}   # ctropt's kernel: dedup-user-side's Gather of the distinct users' ids
_COMPARE = {"Less", "LessOrEqual", "Greater", "GreaterOrEqual"}
DEFAULT_SEQ_LEN = 10
# Odd and prime, so a batch axis is never mistaken for a model axis of the same size (exporters do mix
# them up: a tf2onnx DIEN export runs at batch 16 = hidden 16 and fails at any other batch).
DEFAULT_BATCH = 13
FACTS_KEY = "ctropt.input_facts"


@dataclasses.dataclass
class InputFacts:
    """What the graph tells about one input."""

    upper: int | None = None  # exclusive upper bound for ids in the whole tensor
    columns: dict[int, int] = dataclasses.field(default_factory=dict)  # column -> exclusive bound (last axis)
    regions: set[tuple[int, int]] = dataclasses.field(default_factory=set)  # column ranges read as ids
    is_length: bool = False
    length_columns: set[int] = dataclasses.field(default_factory=set)
    is_mask: bool = False
    padded: bool = False  # ids compared with 0 to mask a history (0 is its padding: FuxiCTR's Equal(ids, 0))
    additive: bool = False  # a mask added to the scores: 0 where valid, -1e9 where padded (PaddleRec's readers)
    zero_row: bool = False  # looked up in a table whose row 0 is zeros (torch's padding_idx=0)
    is_user: bool = False  # declared user side (`--user-inputs`): one value per user, the same for a request's rows
    user_columns: set[int] = dataclasses.field(default_factory=set)  # columns declared user side (`--user-inputs X[0:3]`)
    vocab: list[str] = dataclasses.field(default_factory=list)  # strings a vocabulary (CategoryMapper) knows (some)
    separator: str | None = None  # strings split on this (StringSplit): each value joins several tokens

    def bound(self, bound: int, region: tuple[int, int] | None):
        bound = max(int(bound), 1)
        if region is None:
            self.upper = bound if self.upper is None else min(self.upper, bound)
        else:
            self.regions.add(region)
            for c in range(*region):
                self.columns[c] = min(self.columns.get(c, bound), bound)

    def length(self, region: tuple[int, int] | None):
        if region is None:
            self.is_length = True
        else:
            self.length_columns.update(range(*region))

    def history_len(self, default: int) -> int:
        """The padded length T of id histories stored as columns (deepctr-torch: one slice of T columns)."""
        return max((e - s for s, e in self.regions if e - s > 1), default=default)

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["columns"] = {str(c): b for c, b in self.columns.items()}
        d["regions"], d["length_columns"] = sorted(self.regions), sorted(self.length_columns)
        d["user_columns"] = sorted(self.user_columns)
        return d

    @classmethod
    def from_json(cls, d: dict) -> "InputFacts":
        return cls(d.get("upper"), {int(c): int(b) for c, b in d.get("columns", {}).items()},
                   {tuple(r) for r in d.get("regions", [])}, bool(d.get("is_length")),
                   set(d.get("length_columns", [])), bool(d.get("is_mask")), bool(d.get("padded")),
                   bool(d.get("additive")), is_user=bool(d.get("is_user")),
                   user_columns={int(c) for c in d.get("user_columns", [])}, vocab=list(d.get("vocab", [])),
                   separator=d.get("separator"))


def store_input_facts(model: onnx.ModelProto, facts: dict[str, InputFacts]) -> None:
    """Keep `facts` (the raw model's) in `model`'s metadata, replacing any stored before."""
    kept = [p for p in model.metadata_props if p.key != FACTS_KEY]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    entry = model.metadata_props.add()
    entry.key, entry.value = FACTS_KEY, json.dumps({k: f.to_json() for k, f in facts.items()}, sort_keys=True)


def stored_input_facts(model: onnx.ModelProto) -> dict[str, InputFacts]:
    """The facts an optimized model carries from its raw model ({} if none or unreadable)."""
    for p in model.metadata_props:
        if p.key == FACTS_KEY:
            try:
                return {k: InputFacts.from_json(v) for k, v in json.loads(p.value).items()}
            except (ValueError, TypeError, AttributeError):
                return {}
    return {}


def model_input_facts(model: onnx.ModelProto, graph: gs.Graph | None = None,
                      user_inputs: str | list[str] = ()) -> dict[str, InputFacts]:
    """Facts for every input of `model`: the stored ones where it has them, else read off its graph; the inputs
    named in `user_inputs` (a comma list or names) marked user side."""
    facts = analyze_inputs(graph if graph is not None else to_graph(model))
    stored = stored_input_facts(model)
    facts = {k: stored.get(k, f) for k, f in facts.items()}
    named, columns = user_input_names(user_inputs), user_input_columns(user_inputs)
    unknown = sorted((named | set(columns)) - set(facts))
    if unknown:
        raise CtroptError(f"--user-inputs names {', '.join(unknown)}, which the model has not as inputs "
                          f"(its inputs: {', '.join(facts)})")
    for name in named:
        facts[name].is_user = True
    shapes = {i.name: list(i.shape or []) for i in (graph if graph is not None else to_graph(model)).inputs}
    for name, cols in columns.items():
        width = shapes[name][1] if len(shapes[name]) == 2 else None
        if len(shapes[name]) != 2 or isinstance(width, int) and max(cols) >= width:
            raise CtroptError(f"--user-inputs {name}[...]: columns of a [batch, width] input, within its width "
                              f"(its shape: {shapes[name]})")
        facts[name].user_columns |= cols
    return facts


def _items(user_inputs: str | list[str] | tuple) -> list[str]:
    names = user_inputs.split(",") if isinstance(user_inputs, str) else list(user_inputs)
    return [n.strip() for n in names if n and n.strip()]


def user_input_names(user_inputs: str | list[str] | tuple = ()) -> set[str]:
    """The names in a comma list (or a list of names); columns (``X[0]``, ``X[3:5]``) are not names."""
    return {n for n in _items(user_inputs) if not n.endswith("]")}


def user_input_columns(user_inputs: str | list[str] | tuple = ()) -> dict[str, set[int]]:
    """{input: columns} for the items that name columns of a packed [batch, width] input: ``X[0]`` (column 0) or
    ``X[3:5]`` (columns 3 and 4, as Python slices them); a malformed item is an error."""
    columns: dict[str, set[int]] = {}
    for item in _items(user_inputs):
        if not item.endswith("]"):
            continue
        match = re.fullmatch(r"(.+)\[(\d+)(?::(\d+))?\]", item)
        if match is None or (match[3] is not None and int(match[3]) <= int(match[2])):
            raise CtroptError(f"--user-inputs {item}: write a column as NAME[i] or columns as NAME[i:j] (j > i)")
        end = int(match[3]) if match[3] is not None else int(match[2]) + 1
        if end - int(match[2]) > 1 << 20:
            raise CtroptError(f"--user-inputs {item}: more than 2^20 columns")
        columns.setdefault(match[1], set()).update(range(int(match[2]), end))
    return columns


def analyze_inputs(graph: gs.Graph) -> dict[str, InputFacts]:
    facts = {}
    for inp in graph.inputs:
        f = InputFacts()
        _follow(inp, 0, None, f, set(), inp.shape)
        shape = list(inp.shape or [])
        if f.zero_row and len(shape) == 2 and shape[1] != 1:  # a [B, T] history padded with the zero row's id
            f.padded = True
        if f.upper is None and not f.columns:
            _sharded_bound(inp, f)
        if "len" in inp.name.lower() and inp.dtype is not None and np.issubdtype(inp.dtype, np.number):
            f.is_length = True
        if "mask" in inp.name.lower() and f.upper is None and not f.columns:
            f.is_mask = True
            f.additive = _added(inp)
        facts[inp.name] = f
    return facts


def _follow(start: gs.Tensor, offset: int, region, facts: InputFacts, seen: set, shape) -> None:
    """What the graph does with an input's values (read from `start`, `offset` added, columns `region`): the
    tables that bound them, the comparisons that make them lengths, masks or padded histories. A work list, not
    recursion: a chain of thousands of ops is a graph like any other."""
    todo = [(start, offset, region, shape)]
    while todo:
        t, offset, region, shape = todo.pop()
        key = (id(t), offset, region)
        if key in seen or len(seen) > 5000:
            continue
        seen.add(key)
        first = len(todo)
        _follow_readers(t, offset, region, facts, shape, todo)
        todo[first:] = todo[first:][::-1]   # the first reader's values are followed first, as recursion did


def _follow_readers(t: gs.Tensor, offset: int, region, facts: InputFacts, shape, todo: list) -> None:
    for node in list(t.outputs):
        pos = [i for i, x in enumerate(node.inputs) if x is t]
        op = node.op
        if op in ("Gather", "GatherRows", "GatherRowsInt64") and 1 in pos:   # ctropt's: axis 0, offsets per field
            table = const_value(node.inputs[0])
            if table is not None and table.ndim >= 1:
                axis = node.attrs.get("axis", 0)
                shift = const_value(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2].name else None
                facts.bound(table.shape[axis] - offset - (int(shift.max()) if shift is not None and shift.size else 0),
                            region)
                if axis == 0 and region is None and offset == 0 and table.ndim == 2 and table.shape[0] > 1 and \
                        not table[0].any():
                    facts.zero_row = True  # row 0 is all zeros: padding_idx=0
        elif op == "OneHot" and 0 in pos:
            depth = const_value(node.inputs[1])
            if depth is not None:
                facts.bound(int(np.asarray(depth).ravel()[0]) - offset, region)
        elif op in ("Add", "Sub") and len(node.inputs) == 2:
            other = const_value(node.inputs[1 - pos[0]])
            if other is not None and other.size == 1:
                c = int(np.asarray(other).ravel()[0])
                delta = c if op == "Add" else (-c if pos[0] == 0 else None)
                if delta is not None:
                    todo.append((node.outputs[0], offset + delta, region, None))
        elif op == "Slice" and pos == [0]:
            todo.append((node.outputs[0], offset, _slice_region(node, region, shape), None))
        elif _compares_with_zero(node, pos) and region is None and offset == 0:
            facts.padded = True
        elif op in ("CategoryMapper", "StringSplit") and pos == [0]:
            _string_facts(node, facts)
        elif (op in _COMPARE and not _validity_check(node, pos)) or (op in ("GRU", "LSTM", "RNN") and 4 in pos):
            facts.length(region)
        elif op in ("Loop", "Scan"):
            for p in pos:
                inner = _body_input(node, p)
                if inner is not None:
                    todo.append((inner, offset, region, None))
        elif op in _PASS_THROUGH and (0 in pos or op in ("Concat", "Max", "Where")):
            for out in node.outputs:
                todo.append((out, offset, region if op != "Transpose" else None, None))


_CARRY = {"Cast", "Reshape", "Unsqueeze", "Squeeze", "Transpose", "Expand", "Tile", "Identity", "Flatten"}


def _added(t: gs.Tensor, depth: int = 0) -> bool:
    """The mask reaches the scores through an Add (after casts and layout ops): an additive mask."""
    readers = [n for n in t.outputs if n.op not in ("Shape", "Size")]
    if depth > 8 or not readers:
        return False
    if all(n.op == "Add" for n in readers):
        return True
    return all(n.op in _CARRY and n.inputs[0] is t and _added(n.outputs[0], depth + 1) for n in readers)


def _compares_with_zero(node: gs.Node, pos: list[int]) -> bool:
    """`id == 0`, `id != 0` or `id > 0`: the graph masks a history whose padding id is 0 (or "": StringEqual)."""
    if len(node.inputs) != 2 or len(pos) != 1:
        return False
    other = const_value(node.inputs[1 - pos[0]])
    if other is None or other.size != 1:
        return False
    value = np.asarray(other).ravel()[0]
    if other.dtype.kind in "OUS":
        return node.op in ("Equal", "StringEqual") and (value.decode() if isinstance(value, bytes) else value) == ""
    return float(value) == 0 and (node.op in ("Equal", "NotEqual") or (node.op, pos[0]) in (("Greater", 0), ("Less", 1)))


VOCAB_KEPT = 256  # vocabulary strings kept in the facts (and in an optimized model's metadata)


def _string_facts(node: gs.Node, facts: InputFacts) -> None:
    """A vocabulary's strings (CategoryMapper) or the separator a string is split on (StringSplit)."""
    def text(v):
        return v.decode() if isinstance(v, bytes) else str(v)

    if node.op == "CategoryMapper":
        known = [text(v) for v in node.attrs.get("cats_strings", [])]
        facts.vocab = (facts.vocab + [v for v in known if v not in facts.vocab])[:VOCAB_KEPT]
    elif len(node.inputs) > 1:
        sep = const_value(node.inputs[1])
        if sep is not None and sep.size == 1:
            facts.separator = text(np.asarray(sep).ravel()[0])
        if len(node.outputs) > 1:
            _token_vocab(node.outputs[1], facts, set())


def _token_vocab(t: gs.Tensor, facts: InputFacts, seen: set) -> None:
    """The vocabulary a split's tokens are looked up in, through the ops that select or reshape them (DeepRec's
    `tf.sparse.slice` of a `tf.strings.split` history is a Compress of the tokens): the tokens are its words."""
    if id(t) in seen or len(seen) > 200:
        return
    seen.add(id(t))
    for node in list(t.outputs):
        if node.op == "CategoryMapper":
            _string_facts(node, facts)
        elif node.inputs and node.inputs[0] is t and node.op in _PASS_THROUGH | {"Compress"}:
            for out in node.outputs:
                _token_vocab(out, facts, seen)


def _validity_check(node: gs.Node, pos: list[int]) -> bool:
    """`id >= 0` or `id > -1` (TF's sparse columns drop -1 padding so) checks ids, not lengths. (`id < 0`, Keras
    3's wrap of negative ids, stays read as a length: that keeps generated ids small where no table bounds them.)"""
    if len(node.inputs) != 2 or len(pos) != 1:
        return False
    keeps_valid = (pos[0] == 0 and node.op in ("GreaterOrEqual", "Greater")) or \
        (pos[0] == 1 and node.op in ("LessOrEqual", "Less"))
    other = const_value(node.inputs[1 - pos[0]])
    return keeps_valid and other is not None and other.size >= 1 and bool(np.all(np.asarray(other) <= 0))


# What a sharded lookup does to an id on its way to a shard (TF's partitioned variables: ids deduplicated, the
# shard chosen by a floordiv or mod, the id made local by a Sub or floordiv, routed by DynamicPartition).
_SHARD_WAY = {"Div", "Mod", "Sub", "Compress", "Mul", "Add"}


def _sharded_bound(inp: gs.Tensor, facts: InputFacts) -> None:
    """An id that reaches no table unchanged but, after a Unique and a Div/Mod split, reaches several constant
    tables (the shards of one partitioned table: DeepRec's fixed_size_partitioner, embedding_lookup_sparse through
    tf2onnx) stays below the rows of all the shards reached from that Unique together; the smallest such sum
    when the id feeds several lookups (DeepRec WDL: an embedding column and a linear one)."""
    # (id of the lookup's Unique, width) → {id of the routed ids: rows of the shards they index}
    shards: dict[tuple, dict[int, list[int]]] = {}
    seen, todo = set(), [(inp, None)]
    while todo and len(seen) < 5000:
        t, lookup = todo.pop()
        if (id(t), lookup) in seen:
            continue
        seen.add((id(t), lookup))
        for node in t.outputs:
            pos = [i for i, x in enumerate(node.inputs) if x is t]
            if node.op == "Gather" and 1 in pos and lookup is not None:
                table = const_value(node.inputs[0])
                if table is not None and table.ndim == 2 and node.attrs.get("axis", 0) == 0:
                    shards.setdefault((lookup, table.shape[1]), {}).setdefault(id(t), []).append(table.shape[0])
            elif node.op == "Unique":
                todo.append((node.outputs[0], id(node)))
            elif node.op in _SHARD_WAY or (node.op in _PASS_THROUGH and 0 in pos):
                todo += [(out, lookup) for out in node.outputs]
    # shards of tables looked up alike share their routed ids (tf2onnx merges the two input layers' identical
    # routing in DeepRec DeepFM): per routed-ids tensor one shard, so one table's rows are the sum over them
    sums = [sum(min(rows) for rows in by_ids.values()) for by_ids in shards.values() if len(by_ids) >= 2]
    if sums:
        facts.bound(min(sums), None)


def _slice_region(node: gs.Node, region, shape):
    """Column range kept by a constant Slice on the last axis of the input (deepctr-torch's X[:, a:b])."""
    starts, ends = (const_value(x) for x in node.inputs[1:3])
    axes = const_value(node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3].name else None
    steps = const_value(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4].name else None
    if starts is None or ends is None or starts.size != 1 or (steps is not None and int(steps.ravel()[0]) != 1):
        return region
    axis = int(axes.ravel()[0]) if axes is not None else 0
    rank = len(shape) if shape is not None else None
    if rank is None or axis not in (rank - 1, -1):
        return region
    start, end = int(starts.ravel()[0]), int(ends.ravel()[0])
    width = shape[-1] if isinstance(shape[-1], int) else None
    if start < 0 or end < 0:
        if width is None:
            return region
        start, end = start % width if start < 0 else start, end % width if end < 0 else end
    end = min(end, width) if width is not None else end
    if region is not None:
        start, end = region[0] + start, min(region[1], region[0] + end)
    return (start, end)


def _body_input(node: gs.Node, pos: int) -> gs.Tensor | None:
    body = node.attrs.get("body")
    if body is None:
        return None
    if node.op == "Loop":
        return body.inputs[pos] if pos >= 2 and pos < len(body.inputs) else None
    return body.inputs[pos] if pos < len(body.inputs) else None


def _resolve_shape(vi_shape, batch: int, seq_len: int, dims: dict[str, int]) -> list[int]:
    shape = []
    for axis, d in enumerate(vi_shape or []):
        multiple = re.fullmatch(r"(\d+)\s*\*\s*\w+", d) if isinstance(d, str) else None
        if isinstance(d, int) and d >= 0:
            shape.append(d)
        elif isinstance(d, str) and d in dims:
            shape.append(dims[d])
        elif multiple and axis == 0:  # torch.export names such dims "6*batch"
            shape.append(int(multiple.group(1)) * batch)
        else:
            shape.append(batch if axis == 0 else seq_len)
    return shape


def _jagged_values(graph: gs.Graph, facts: dict[str, InputFacts]) -> list[tuple[str, str]]:
    """(values input, lengths input) pairs of a jagged batch (torchrec's KeyedJaggedTensor): a 1-D id input whose
    length is its own dynamic dim (not the batch's) holds sum(lengths) ids."""
    batch_dims = {i.shape[0] for i in graph.inputs if i.shape and len(i.shape) >= 2 and isinstance(i.shape[0], str)}
    lengths = [i.name for i in graph.inputs if facts[i.name].is_length and i.shape and len(i.shape) == 1]
    values = [i.name for i in graph.inputs if i.shape and len(i.shape) == 1 and not facts[i.name].is_length
              and isinstance(i.shape[0], str) and i.shape[0] not in batch_dims and "*" not in i.shape[0]
              and i.dtype is not None and np.issubdtype(i.dtype, np.integer)]
    return list(zip(values, lengths)) if len(lengths) == len(values) else []


def generate_inputs(model: onnx.ModelProto, *, batch: int = DEFAULT_BATCH, seq_len: int = DEFAULT_SEQ_LEN,
                    seed: int = 0, dims: dict[str, int] | None = None, fill: float | None = None,
                    one_user: bool = False, user_inputs: str | list[str] = ()) -> dict[str, np.ndarray]:
    """One batch of inputs for every graph input, keyed by input name.

    Histories are 0..T long with a full and an empty one in the batch; with `fill` (0..1] they are fill*T long on
    average (uniform in a band around it, none forced). `one_user`: every row has row 0's history, lengths, mask
    and user-side inputs (named `user_inputs`, declared so in the model's metadata, or named like a user id): one
    request ranking `batch` candidates for one user. Id ranges stored in the model's metadata (an optimized model's)
    take precedence over what its graph shows.
    """
    graph = to_graph(model)
    facts = model_input_facts(model, graph, user_inputs)
    rng = np.random.default_rng(seed)
    shapes = {i.name: _resolve_shape(i.shape, batch, seq_len, dims or {}) for i in graph.inputs}
    time_len = max([s[1] for s in shapes.values() if len(s) >= 2] or [seq_len])
    lengths = _history_lengths(rng, batch, time_len, fill, one_user)
    has_lengths = any(f.is_length or f.is_mask or f.padded for f in facts.values())
    feeds = {}
    jagged = dict(_jagged_values(graph, facts))
    for inp in sorted(graph.inputs, key=lambda i: i.name in jagged):  # lengths before the values they count
        f, shape = facts[inp.name], shapes[inp.name]
        if inp.name in jagged:
            shape = [int(feeds[jagged[inp.name]].sum())]
        dtype = np.dtype(inp.dtype) if inp.dtype is not None else np.dtype(np.float32)
        feeds[inp.name] = _one_input(rng, dtype, shape, f, lengths, time_len, has_lengths, (fill, one_user))
        if one_user:
            _same_user(feeds[inp.name], inp.name, f, batch, time_len, slice(None))
        elif fill is None and batch >= 4:  # rows 0 and 3 are one user (full history): dedup must keep them apart
            _same_user(feeds[inp.name], inp.name, f, batch, time_len, [3])
    return {i.name: feeds[i.name] for i in graph.inputs}


def _history_lengths(rng, batch: int, time_len: int, fill: float | None, one_user: bool) -> np.ndarray:
    if fill is None:
        lengths = rng.integers(0, time_len + 1, size=batch)
        lengths[: min(batch, 2)] = [time_len, 0][: min(batch, 2)]  # a full and an empty history
    else:
        low, high = max(0.0, 2 * fill - 1) * time_len, min(1.0, 2 * fill) * time_len
        lengths = rng.integers(int(round(low)), int(round(high)) + 1, size=batch)
    if one_user:
        lengths[:] = int(round(fill * time_len)) if fill is not None else lengths[0]
    elif fill is None and batch >= 4:
        lengths[3] = lengths[0]
    return lengths


def _same_user(values: np.ndarray, name: str, f: InputFacts, batch: int, time_len: int, rows) -> None:
    """Row 0's user side in `rows`: histories, lengths, masks, user-named inputs (columns when packed)."""
    if values.ndim == 0 or values.shape[0] != batch:
        return
    history = values.ndim >= 2 and values.shape[1] == time_len and time_len > 1 and not (f.columns or f.regions)
    if f.is_length or f.is_mask or history or f.is_user or "user" in name.lower() or "uid" in name.lower():
        values[rows] = values[0]
        return
    columns = sorted(f.length_columns | f.user_columns | {c for s, e in f.regions if e - s > 1 for c in range(s, e)})
    if columns and values.ndim == 2:
        values[rows, columns] = values[0, columns]


def _one_input(rng, dtype, shape, f: InputFacts, lengths, time_len, has_lengths, fill_user) -> np.ndarray:
    prefix = None
    if len(shape) >= 2 and shape[0] == len(lengths):
        prefix = np.arange(shape[1])[None, :] < lengths[:, None]
        prefix = prefix.reshape(prefix.shape + (1,) * (len(shape) - 2))
    if f.is_length and not f.columns and shape and shape[0] == len(lengths):
        return np.broadcast_to(lengths.reshape((-1,) + (1,) * (len(shape) - 1)), shape).astype(dtype)
    if f.is_length and not f.columns and len(shape) == 1:  # lengths of jagged bags: [0, T], some empty
        high = min(time_len, f.upper - 1) if f.upper is not None else time_len
        counts = rng.integers(0, high + 1, size=shape)
        counts[: max(1, shape[0] // 5)] = 0
        return rng.permutation(counts).astype(dtype)
    if f.is_mask and prefix is not None:
        mask = np.where(prefix, 0, -1e9) if f.additive else prefix
        return np.broadcast_to(mask, shape).astype(dtype)
    if dtype == np.bool_:
        return rng.random(shape) < 0.5
    if dtype.kind in "OUS":
        return _strings(rng, shape, f, prefix if has_lengths and len(shape) >= 2 else None,
                        lengths if len(shape) == 1 and shape[0] == len(lengths) else None)
    if np.issubdtype(dtype, np.integer) or f.upper is not None:
        high = f.upper if f.upper is not None else 100
        ids = rng.integers(0, high, size=shape)
        _both_ends(ids.reshape(-1), high, rng)
        if has_lengths and prefix is not None and ids.ndim >= 2:
            ids = np.where(np.broadcast_to(prefix, shape), ids, 0)
        return ids.astype(dtype)
    values = rng.uniform(-1.0, 1.0, size=shape).astype(dtype)
    for col, bound in f.columns.items():
        if shape and col < shape[-1]:
            column = rng.integers(0, bound, size=values[..., col].shape)
            _both_ends(column.reshape(-1), bound, rng)
            values[..., col] = column
    if f.length_columns and len(shape) == 2:
        _length_columns(values, f, lengths if f.history_len(time_len) == time_len else None, rng, fill_user)
    return values


UNSEEN = ["unseen-7f3a", "ünïcödé", "日本語の値", "🙂", "x" * 40]  # strings no vocabulary holds


def _strings(rng, shape, f: InputFacts, prefix, lengths=None) -> np.ndarray:
    """String features as traffic sends them: a vocabulary's words (or ids like 's123' where the graph hashes),
    about 10 % unseen (other scripts too) and 5 % empty, at least one of each; where the graph splits on a
    separator, each row joins as many tokens as the batch's history lengths say (0..T, an empty and a full row: every
    split column of a row has one count, as a model that splits several histories of one user expects, DeepRec's DIN
    asserting them equal), one row with a trailing separator (an empty token); "" past each row's length in a padded
    history.
    """
    pool = np.array(f.vocab or [f"s{i}" for i in range(500)], dtype=object)

    def draw(size):
        out = pool[rng.integers(0, len(pool), size=size)]
        roll = rng.random(size)
        out = np.where(roll < 0.1, np.array(UNSEEN, dtype=object)[rng.integers(0, len(UNSEEN), size=size)], out)
        return np.where(roll > 0.95, "", out)

    if f.separator is not None:
        counts = lengths if lengths is not None else rng.integers(0, 5, size=int(np.prod(shape)))
        rows = [list(draw(int(c))) for c in counts]
        rows = [[pool[0]] if row == [""] else row for row in rows]  # "" joined alone would be no token at all
        tokens = [(r, k) for r, row in enumerate(rows) for k in range(len(row))]
        if len(tokens) >= 2:  # an unseen and an empty token, the rows' token counts kept
            for (r, k), word in zip((tokens[i] for i in rng.choice(len(tokens), 2, replace=False)),
                                    [UNSEEN[int(rng.integers(len(UNSEEN)))], ""]):
                rows[r][k] = word if word or len(rows[r]) > 1 else rows[r][k]
        values = np.array([f.separator.join(row) for row in rows], dtype=object).reshape(shape)
        if values.size >= 3:
            values.flat[2] += f.separator
        return values.astype(str)
    values = draw(shape)
    flat = values.reshape(-1)
    if flat.size >= 2:
        flat[rng.choice(flat.size, 2, replace=False)] = [UNSEEN[int(rng.integers(len(UNSEEN)))], ""]
    if prefix is not None:
        valid = np.broadcast_to(prefix, shape)
        values = np.where(valid, np.where(values == "", pool[0], values), "")  # "" is the padding only
    return values.astype(str)


def _both_ends(flat: np.ndarray, high: int, rng) -> None:
    """Put ids 0 and high-1 (the table's first and last rows) at two random places."""
    if flat.size >= 2:
        flat[rng.choice(flat.size, 2, replace=False)] = [0, high - 1]


def _length_columns(values: np.ndarray, f: InputFacts, lengths, rng, fill_user) -> None:
    """Length columns in [0, T], and the history columns of T ids zero past each row's length."""
    T = f.history_len(0)
    if lengths is None:
        lengths = _history_lengths(rng, values.shape[0], T, *fill_user)
    for c in f.length_columns:
        values[:, c] = lengths
    for start, end in f.regions:
        if end - start == T and T > 1:
            values[:, start:end] = np.where(np.arange(T)[None, :] < lengths[:, None], values[:, start:end], 0)


def read_npz(path: str | os.PathLike, what: str) -> dict[str, np.ndarray]:
    """Every array of an .npz, or a one-line error naming what it was meant to hold."""
    import zipfile

    wanted = f"{what} go in an .npz written by numpy.savez(path, NAME=array, ...), one array per input name"
    if not Path(path).is_file():
        raise CtroptError(f"{path}: cannot read {what} (no such file)")
    if not zipfile.is_zipfile(path):  # np.load would try it as a pickle and talk of allow_pickle
        raise CtroptError(f"{path}: not an .npz file; {wanted}")
    try:
        with np.load(path, allow_pickle=False) as data:
            return {k: data[k] for k in data.files}
    except ValueError as e:
        if "allow_pickle" in str(e):
            raise CtroptError(f"{path}: holds an object array, which ctropt does not unpickle; {wanted} (strings "
                              "as a numpy str array, e.g. np.array(['a', 'b']))") from None
        raise CtroptError(f"{path}: cannot read {what} ({e})") from None
    except (OSError, zipfile.BadZipFile) as e:
        raise CtroptError(f"{path}: cannot read {what} ({e})") from None


def load_inputs(path: str | os.PathLike, model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """User inputs from an .npz whose keys are graph input names."""
    feeds = read_npz(path, "inputs")
    initializers = {t.name for t in model.graph.initializer}
    names = [i.name for i in model.graph.input if i.name not in initializers]
    missing = [n for n in names if n not in feeds]
    extra = [k for k in feeds if k not in names]
    if missing or extra:
        raise CtroptError(f"{path}: keys must be the graph inputs {names}; missing {missing}, unexpected {extra}")
    return feeds
