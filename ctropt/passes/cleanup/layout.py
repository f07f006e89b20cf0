"""Layout cleanups: inference BatchNormalization as an affine map, and transpose pairs around elementwise work.

PyTorch's Dice over [B, T, H] (deepctr-torch DIN's attention MLP) is exported as Transpose → BatchNormalization
(channels on axis 1) → Sigmoid / Mul / Add → Transpose back. Runtimes do not move a Transpose across a
BatchNormalization, so the pair stays, and passes that follow values position by position (the attention
region of `remove-attention-padding`) stop at it. `fold-batchnorm` writes the normalization as `x * s + t`
(one scale and shift per channel, computed from the running statistics); `cancel-transposes` then removes a
Transpose whose result only flows through elementwise ops into Transposes that undo it, permuting the constants
those ops read instead. It does the same for rows reshaped to rank 3 and back around elementwise ops (Dice between
two FC layers that fuse-fc flattened), so the layers form one 2-D chain; fuse-fc calls it after its rewrites.
`select-masked-rows` turns torch's masked_select over whole rows (deepctr-torch DIEN keeps the users that have
a history this way: NonZero of the row mask expanded to [B, T, E], then one GatherND index per element) into a
Compress of the rows. `einsum-as-matmul` writes an Einsum that is a (batched) matrix product as the MatMul it is
(PaddleRec's AutoInt: ``bnk,kj->bnj`` projections and ``bnik,bnjk->bnij`` scores; onnxruntime's Einsum is 2–3×
slower), so the passes that read attention and FC layers see them.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from ...graph import annotate_shapes
from ...patterns import Const, Match, P, Rewrite, Var
from ...graph.edit import add_constant, const_value, redirect_consumers, shape_of
from ..registry import PassContext, register_pass

ELEMENTWISE = {"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Where", "PRelu",
               "Sigmoid", "Tanh", "Relu", "LeakyRelu", "Elu", "Selu", "HardSigmoid", "Softplus", "Softsign",
               "Neg", "Abs", "Exp", "Log", "Sqrt", "Reciprocal", "Erf", "Identity", "Not", "Cast"}


def _inference_statistics(m) -> bool | str:
    if len(m.root.outputs) != 1 or m.root.attrs.get("training_mode", 0):
        return "training mode (running statistics are outputs)"
    shape = shape_of(m["x"])
    if shape is None or len(shape) < 2:
        return "the input's rank is unknown: the per-channel constants cannot be placed"
    return True


def _batchnorm_as_affine(m) -> list:
    scale, bias, mean, var = (m.const(k).astype(np.float64) for k in ("scale", "bias", "mean", "var"))
    s = scale / np.sqrt(var + m.root.attrs.get("epsilon", 1e-5))
    dtype, out, name = m.const("scale").dtype, m.root.outputs[0], m.root.name
    per_channel = (-1,) + (1,) * (len(shape_of(m["x"])) - 2)
    mul = m.constant(f"{name}/scale", s.reshape(per_channel).astype(dtype))
    add = m.constant(f"{name}/shift", (bias - mean * s).reshape(per_channel).astype(dtype))
    (scaled,) = m.op("Mul", [m["x"], mul], name=f"{name}/Mul", dtype=out.dtype, shape=out.shape)
    return m.op("Add", [scaled, add], name=f"{name}/Add", dtype=out.dtype, shape=out.shape)


BATCHNORM_RULES = (
    Rewrite("batchnorm-affine", P.BatchNormalization(Var("x"), Const("scale"), Const("bias"), Const("mean"),
                                                     Const("var")), _batchnorm_as_affine, _inference_statistics),
)


@register_pass("fold-batchnorm", group="cleanup", speed=True, rules=BATCHNORM_RULES)
def fold_batchnorm(ctx: PassContext) -> None:
    """Inference BatchNormalization with constant statistics → Mul + Add by per-channel constants."""
    if any(n.op == "BatchNormalization" and n.inputs[0].shape is None for n in ctx.graph.nodes):
        annotate_shapes(ctx.graph)  # the rank of the input places the per-channel constants
    ctx.apply(*BATCHNORM_RULES)


def _inverse(perm: list[int]) -> list[int]:
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return inv


class _Transposed:
    """Values are `Transpose(x, perm)`; `Transpose(v, inverse)` gives x back; constants are permuted."""

    def __init__(self, node: gs.Node):
        self.perm = list(node.attrs.get("perm", []))
        self.inverse = _inverse(self.perm)

    def ok(self) -> bool:
        return bool(self.perm)

    def undoes(self, c: gs.Node) -> bool:
        return c.op == "Transpose" and list(c.attrs.get("perm", [])) == self.inverse

    def constant(self, value: np.ndarray) -> np.ndarray | None:
        rank = len(self.perm)
        if value.ndim > rank:
            return None
        return np.transpose(value.reshape((1,) * (rank - value.ndim) + value.shape), self.inverse)

    shape_readers_ok = False


class _Unflattened:
    """Values are rows x[M, H] reshaped to [..., H] (fuse-fc's way back to rank ≥ 3 between FC layers, the
    attention rows [1, N, H]); `Reshape(v, [-1, H])` gives x back; constants act per column."""

    def __init__(self, node: gs.Node):
        src, out = shape_of(node.inputs[0]), shape_of(node.outputs[0])
        self.width = src[-1] if src and len(src) == 2 and out and isinstance(src[-1], int) and out[-1] == src[-1] \
            else None

    def ok(self) -> bool:
        return self.width is not None

    def undoes(self, c: gs.Node) -> bool:
        if c.op != "Reshape":
            return False
        target = const_value(c.inputs[1])
        return target is not None and target.tolist() == [-1, self.width]

    def constant(self, value: np.ndarray) -> np.ndarray | None:
        if value.ndim and (value.shape[-1] not in (1, self.width) or value.size != value.shape[-1]):
            return None
        return value.reshape(value.shape[-1:])

    shape_readers_ok = True  # every value in the region has the entry's shape (constants add no axis)


def _region_after(entry: gs.Node, layout, graph_outputs: set[int]):
    """(elementwise nodes, constants they read, undoing nodes, Shape readers) when everything `entry` makes
    flows through elementwise ops into nodes that undo its layout change; None otherwise."""
    region, exits, consts, shape_readers = {}, [], {}, []
    values, stack = {id(entry.outputs[0])}, [entry.outputs[0]]
    while stack:
        v = stack.pop()
        if id(v) in graph_outputs:
            return None
        for c in v.outputs:
            if id(c) in region or any(c is e for e in exits + shape_readers):
                continue
            if layout.undoes(c) and id(c.outputs[0]) not in graph_outputs:
                exits.append(c)
                continue
            if c.op == "Shape" and layout.shape_readers_ok:
                shape_readers.append(c)
                continue
            if c.op not in ELEMENTWISE or len(c.outputs) != 1 or c.domain not in ("", "ai.onnx", None):
                return None
            for u in c.inputs:
                value = const_value(u) if id(u) not in values else None
                if value is not None:
                    if layout.constant(value) is None:
                        return None
                    consts[id(u)] = u
            region[id(c)] = c
            values.add(id(c.outputs[0]))
            stack.append(c.outputs[0])
    if not exits:
        return None
    # an input that is neither a constant nor (yet) a region value may join the region later in the walk
    for c in region.values():
        if any(id(u) not in values and id(u) not in consts for u in c.inputs):
            return None
    return list(region.values()), list(consts.values()), exits, shape_readers


def _reads(value: gs.Tensor, node: gs.Node) -> bool:
    """Whether `value` is computed from `node`'s outputs."""
    seen, stack = set(), [value]
    while stack:
        t = stack.pop()
        for n in t.inputs:
            if n is node:
                return True
            if id(n) not in seen:
                seen.add(id(n))
                stack.extend(n.inputs)
    return False


LAYOUTS = {"Transpose": _Transposed, "Reshape": _Unflattened, "Unsqueeze": _Unflattened}


def cancel_layout_pairs(graph: gs.Graph) -> int:
    """Remove Transpose/Reshape pairs around elementwise work (see `cancel-transposes`), in one sweep of the
    graph's nodes; returns how many entries (with the ops that undo them) were removed."""
    graph_outputs = {id(t) for t in graph.outputs}
    rewrites = 0
    if any(n.op in ("Reshape", "Unsqueeze") and n.outputs and n.outputs[0].shape is None for n in graph.nodes):
        annotate_shapes(graph)
    for entry in list(graph.nodes):
        if entry.op not in LAYOUTS or not entry.outputs or not entry.inputs:
            continue
        layout = LAYOUTS[entry.op](entry)
        found = _region_after(entry, layout, graph_outputs) if layout.ok() else None
        if found is None:
            continue
        nodes, consts, exits, shape_readers = found
        changed = {id(c): add_constant(graph, f"{c.name}/{entry.op.lower()}d", layout.constant(const_value(c)))
                   for c in consts}
        source, y = entry.inputs[0], entry.outputs[0]
        for n in nodes:
            for i, u in enumerate(list(n.inputs)):
                n.inputs[i] = source if u is y else changed.get(id(u), u)
            for o in n.outputs:
                o.shape = None
        for r in shape_readers:  # through the entry op, fed a value of the same shape made after the region
            r.inputs[0] = y
        undone = [source if e.inputs[0] is y else e.inputs[0] for e in exits]  # what each exit gave back
        if shape_readers and undone[0] is not source and not _reads(undone[0], entry):
            entry.inputs[0] = undone[0]  # the source keeps one reader (an FC's output stays fusable)
        for e, value in zip(exits, undone):
            redirect_consumers(e.outputs[0], value)
        rewrites += 1
    if rewrites:
        graph.cleanup()
        graph.toposort(mode="nodes")
    return rewrites


@register_pass("cancel-transposes", group="cleanup", speed=True)
def cancel_transposes(ctx: PassContext) -> int:
    """Transpose (or a Reshape of rows to rank ≥ 3) → elementwise ops → the op that undoes it: both removed, the
    constants the ops read permuted (or reshaped) instead.

    Not a pattern rule: the region between the pair has any size and shape (`_region_after` walks it), and one
    sweep decides each entry once, on the graph as the entries before it left it."""
    return cancel_layout_pairs(ctx.graph)


def _rows_mask(m: Match) -> bool | str:
    """The mask is bool with a unit dim after the first on each axis of the data (one flag per row)."""
    mask, dims = m["mask"], shape_of(m["mask"])
    if mask.dtype != np.bool_:
        return "the mask is not bool"
    if dims is None or len(dims) != len(shape_of(m["data"]) or []):
        return "the mask's rank is unknown or not the data's"
    return True if all(d == 1 for d in dims[1:]) else "the mask is not one flag per row"


def _compress_rows(m: Match) -> list:
    """The rows whose flag is set, Compressed and flattened (what GatherND of the element indices gives)."""
    data, out, name = m["data"], m.root.outputs[0], m.root.name
    cond, _ = _row_flags(m, name)
    (kept,) = m.op("Compress", [data, cond], {"axis": 0}, name=f"{name}/Compress", dtype=data.dtype)
    return m.op("Reshape", [kept, m.constant(f"{name}/flatten_shape", np.array([-1], np.int64))],
                name=f"{name}/flatten", dtype=out.dtype, shape=out.shape)


def _row_flags(m: Match, name: str) -> tuple:
    """(the mask as one flag per row [B], the data's shape) for a row mask expanded to the data."""
    data, mask = m["data"], m["mask"]
    rank = len(shape_of(data))
    (shape,) = m.op("Shape", [data], name=f"{name}/shape", dtype=np.int64)
    (rows,) = m.op("Gather", [shape, m.constant(f"{name}/axis0", np.array([0], np.int64))], {"axis": 0},
                   name=f"{name}/rows", dtype=np.int64)
    (target,) = m.op("Concat", [rows, m.constant(f"{name}/ones", np.ones(rank - 1, np.int64))], {"axis": 0},
                     name=f"{name}/row_shape", dtype=np.int64)
    (per_row,) = m.op("Expand", [mask, target], name=f"{name}/row_mask", dtype=mask.dtype)
    (flags,) = m.op("Reshape", [per_row, m.constant(f"{name}/flat", np.array([-1], np.int64))],
                    name=f"{name}/condition", dtype=mask.dtype)
    return flags, shape


def _scatter_rows(m: Match) -> list:
    """torch's masked_scatter over whole rows (ScatterND at one index per element of the flagged rows) → the
    same elements written a row at a time: ScatterND at the flagged rows of the updates viewed as rows."""
    data, name = m["data"], m.root.name
    flags, shape = _row_flags(m, name)
    (nonzero,) = m.op("NonZero", [flags], name=f"{name}/flagged", dtype=np.int64)
    (rows,) = m.op("Transpose", [nonzero], {"perm": [1, 0]}, name=f"{name}/row_indices", dtype=np.int64)
    (inner,) = m.op("Slice", [shape, m.constant(f"{name}/one", np.array([1], np.int64)),
                              m.constant(f"{name}/end", np.array([len(shape_of(data))], np.int64))],
                    name=f"{name}/inner", dtype=np.int64)
    (view,) = m.op("Concat", [m.constant(f"{name}/minus_one", np.array([-1], np.int64)), inner], {"axis": 0},
                   name=f"{name}/view", dtype=np.int64)
    (updates,) = m.op("Reshape", [m["updates"], view], name=f"{name}/updates_rows", dtype=data.dtype)
    out = m.root.outputs[0]
    return m.op("ScatterND", [data, rows, updates], name=f"{name}/rows", dtype=out.dtype, shape=out.shape)


def _element_count(m: Match) -> list:
    """The shape [K, rank] of the element indices of flagged rows: K = flagged rows × elements per row."""
    name = m.root.name
    flags, shape = _row_flags(m, name)
    (count,) = m.op("ReduceSum", [m.op("Cast", [flags], {"to": 7}, name=f"{name}/as_int", dtype=np.int64)[0]],
                    {"keepdims": 1}, name=f"{name}/flagged", dtype=np.int64)
    (inner,) = m.op("Slice", [shape, m.constant(f"{name}/one", np.array([1], np.int64)),
                              m.constant(f"{name}/end", np.array([len(shape_of(m["data"]))], np.int64))],
                    name=f"{name}/inner", dtype=np.int64)
    (per_row,) = m.op("ReduceProd", [inner], {"keepdims": 1}, name=f"{name}/per_row", dtype=np.int64)
    (elements,) = m.op("Mul", [count, per_row], name=f"{name}/elements", dtype=np.int64)
    rank = m.constant(f"{name}/rank", np.array([len(shape_of(m["data"]))], np.int64))
    return m.op("Concat", [elements, rank], {"axis": 0}, name=f"{name}/indices_shape", dtype=np.int64)


# torch's masked_select / masked_scatter with a bool mask broadcast over all but the first axis: one index per
# element (the indices may also be counted, by a Shape: masked_scatter's source is sliced to that many)
_DATA_SHAPE = P.Shape(Var("data"), _shared=True, start=lambda v: not v, end=lambda v: v is None)
_ELEMENT_INDICES = P.Transpose(P.NonZero(P.Expand(Var("mask"), _DATA_SHAPE), _shared=True),
                               perm=lambda p: p is None or list(p) == [1, 0], _shared=True)
MASKED_ROWS_RULES = (
    Rewrite("masked-rows-as-compress", P.GatherND(Var("data"), _ELEMENT_INDICES, batch_dims=lambda v: not v),
            _compress_rows, _rows_mask, subgraphs=False),
    Rewrite("masked-scatter-by-rows", P.ScatterND(Var("data"), _ELEMENT_INDICES, Var("updates"),
                                                  reduction=lambda v: v in (None, "none", b"none")),
            _scatter_rows, _rows_mask, subgraphs=False),
    Rewrite("masked-rows-element-count", P.Shape(_ELEMENT_INDICES, start=lambda v: not v, end=lambda v: v is None),
            _element_count, _rows_mask, subgraphs=False),
)


def _mask_over_rows(m: Match) -> np.ndarray | str:
    """A constant mask, broadcast over the data's first axis only, as one flag per element of a row (flat)."""
    mask, dims = const_value(m["mask"]), shape_of(m["data"])
    if dims is None or len(dims) < 2 or not all(isinstance(d, int) for d in dims[1:]):
        return "the data's dims after the first are not known numbers"
    if mask.ndim > len(dims) or (mask.ndim == len(dims) and mask.shape[0] != 1):
        return "the mask varies along the data's first axis"
    if m.root.op == "Compress" and mask.dtype != np.bool_:
        return "Compress's condition is not bool"
    try:
        return np.broadcast_to(mask[0] if mask.ndim == len(dims) else mask, tuple(dims[1:])).reshape(-1)
    except ValueError:
        return "the mask does not broadcast to a row of the data"


def _constant_mask(m: Match) -> bool | str:
    flags = _mask_over_rows(m)
    return flags if isinstance(flags, str) else True


def _gather_masked(m: Match) -> list:
    """The elements a constant mask selects in each row (a row: all but the first axis): one Gather of constant
    indices over the rows viewed flat, then flattened as masked_select gives them."""
    data, out, name = m["data"], m.root.outputs[0], m.root.name
    flags = _mask_over_rows(m)
    (rows,) = m.op("Reshape", [data, m.constant(f"{name}/rows_shape", np.array([-1, flags.size], np.int64))],
                   name=f"{name}/rows", dtype=data.dtype)
    (picked,) = m.op("Gather", [rows, m.constant(f"{name}/selected", np.flatnonzero(flags).astype(np.int64))],
                     {"axis": 1}, name=f"{name}/selected", dtype=data.dtype)
    return m.op("Reshape", [picked, m.constant(f"{name}/flatten_shape", np.array([-1], np.int64))],
                name=f"{name}/flatten", dtype=out.dtype, shape=out.shape)


_FLAT = Const(value=np.array([-1], np.int64))
# masked_select by a constant mask (FuxiCTR's DLRM keeps the upper triangle of its [B, F, F] dot products this way):
# GatherND at the mask's NonZero (the legacy exporter) or a Compress of both flattened (the dynamo exporter)
CONSTANT_MASK_RULES = (
    Rewrite("constant-mask-as-gather", P.GatherND(Var("data"), P.Transpose(P.NonZero(P.Expand(
        Const("mask"), _DATA_SHAPE)), perm=lambda p: p is None or list(p) == [1, 0]), batch_dims=lambda v: not v),
        _gather_masked, _constant_mask, subgraphs=False),
    Rewrite("constant-mask-compress-as-gather", P.Compress(P.Reshape(Var("data"), _FLAT), P.Reshape(P.Expand(
        Const("mask"), _DATA_SHAPE), _FLAT), axis=lambda v: v in (None, 0)),
        _gather_masked, _constant_mask, subgraphs=False),
)


@register_pass("select-masked-rows", group="cleanup", speed=True, rules=MASKED_ROWS_RULES + CONSTANT_MASK_RULES)
def select_masked_rows(ctx: PassContext) -> None:
    """torch's masked_select and masked_scatter over whole rows (GatherND / ScatterND at the NonZero of a row mask
    expanded to the data: one index per element) → the rows Compressed, flattened, or written a row at a time
    (deepctr-torch DIEN packs histories this way, torch-rechub's DIEN unpacks its GRU outputs); masked_select by a
    constant mask over each row → one Gather of the constant indices (FuxiCTR's DLRM interaction: onnxruntime's
    NonZero + GatherND over [B, F, F] took over half its time)."""
    if any(n.op in ("NonZero", "Compress") for n in ctx.graph.nodes):
        annotate_shapes(ctx.graph)  # the mask's rank and unit dims are read from shapes
    ctx.apply(*MASKED_ROWS_RULES, *CONSTANT_MASK_RULES)


def _matmul_of(equation: str) -> tuple[bool, int] | None:
    """(whether B enters transposed, the rank of B) when `lhs,rhs->out` is a matrix product over shared leading batch
    letters: A = batch·i·k, B = batch·k·j (or batch·j·k, or k·j alone), out = batch·i·j; None otherwise."""
    if "->" not in equation or "." in equation:
        return None
    terms, out = equation.replace(" ", "").split("->")
    parts = terms.split(",")
    if len(parts) != 2 or any(len(set(t)) != len(t) for t in (*parts, out)):
        return None
    a, b = parts
    if len(a) < 2 or len(out) != len(a) or a[:-1] != out[:-1]:
        return None
    batch, i, k, j = a[:-2], a[-2], a[-1], out[-1]
    if len({i, k, j}) != 3 or any(c in batch for c in (i, k, j)):
        return None
    if b == batch + k + j or (b == k + j and len(a) >= 2):
        return False, len(b)
    if b == batch + j + k:
        return True, len(b)
    return None


def _einsum_as_matmul(m: Match) -> list | None:
    equation = m.root.attrs.get("equation", "")
    found = _matmul_of(equation.decode() if isinstance(equation, bytes) else equation)
    if found is None or len(m.root.inputs) != 2:
        return None
    transposed, rank = found
    out = m.root.outputs[0]
    a, b = m.root.inputs
    if transposed:
        (b,) = m.op("Transpose", [b], {"perm": list(range(rank - 2)) + [rank - 1, rank - 2]}, dtype=b.dtype)
    (y,) = m.op("MatMul", [a, b], dtype=out.dtype, shape=out.shape)
    return [y]


EINSUM_RULES = (Rewrite("einsum-as-matmul", P.Einsum(Var(), Var()), _einsum_as_matmul),)


@register_pass("einsum-as-matmul", group="cleanup", rules=EINSUM_RULES)
def einsum_as_matmul(ctx: PassContext) -> None:
    """An Einsum that is a batched matrix product (``bnk,kj->bnj``, ``bnik,bnjk->bnij``, ``bij,bjk->bik``) →
    MatMul (with a Transpose of B where it enters as Bᵀ)."""
    ctx.apply(*EINSUM_RULES)
