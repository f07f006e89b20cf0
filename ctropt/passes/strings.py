"""`string-embedding`: a string column's chain, from the raw strings to the pooled embedding, in fewer and cheaper
kernels (in the spirit of Meituan's StringEmbedding: hash or look up, Gather, pool).

tf2onnx writes TensorFlow's string features with onnxruntime-extensions' ``ai.onnx.contrib`` ops
(``StringToHashBucketFast``, ``StringSplit``, ``StringEqual``) and ``ai.onnx.ml`` ``CategoryMapper``; a
``tf.strings.split`` column pooled as users write it (``to_tensor()``, ``!= ""`` mask, masked mean) becomes:
StringSplit → RaggedTensorToTensor (Unique of the row ids, CumSum of the first occurrences, ScatterND of the tokens
into a [B, T] tensor filled with "") → hash and Gather of every padded position, StringEqual(tokens, "") → Not →
Cast → mask, ReduceSum(emb · mask) / max(ReduceSum(mask), 1). Per string, the contrib kernels cost about twice
onnxruntime's own string kernels (StringEqual against "" 191 µs, CategoryMapper 91 µs on DIN's [256, 10] history,
1 thread), and every padded position is hashed and compared. The rules:

- ``string-equal-as-lookup``: StringEqual(x, one constant string) → Cast(CategoryMapper(x, {c: 1}, default 0),
  bool), onnxruntime's own kernel.
- ``split-tokens-from-indices``: the padded tokens scattered at the split's own (row, token) indices and dense
  shape, which StringSplit outputs, instead of the ones the exporter recomputes from the row ids (Unique, CumSum,
  ...: 13 nodes); the recomputation is checked to equal them on probe layouts before it is dropped.
- ``split-tokens-pooled`` / ``split-tokens-counted``: a sum over the token axis of the lookups of the padded tokens
  times a mask that is 1 exactly where a token is not the padding (checked by running the mask on probe tokens) →
  the lookups of the split's tokens only, summed per row by ScatterND(reduction="add"); the mask's sum the same
  way. The padded [B, T] strings, their hash and their mask go away.
- ``hash-before-padding`` / ``vocabulary-before-padding``: what still reads the padded tokens hashes or looks up
  the tokens first and pads the ids with the padding's own id (computed by running the op on it).

Measured (onnxruntime 1.32 CPU, 1 thread, batch 256, paired, on the zoo's exports after every other pass):
wdl_strings 1.09× for the StringEqual rule alone, 1.27× with the split's indices, 1.36× with hash and lookup
before the padding, 1.43× with the pooling rules (one user per request 1.44×, batch 1 1.25×); din_strings 1.14×
(one user 1.17×; its string history comes padded, so only the StringEqual rule applies). Tried and left out, measured slower or no faster: one hash call over the
concatenated columns of the same bucket count (or of all columns, with the least common multiple of the bucket
counts and a Mod per column: (h mod M) mod n = h mod n when n divides M) 0.95-0.98×; hashing only the distinct
strings (Unique, hash, Gather by the inverse) 0.56-0.76× at batch 256 and 1.0-1.09× when every row has the same
user; StringLength instead of StringEqual 0.77×; the vocabulary-with-OOV-buckets select (CategoryMapper,
Equal, Not, Cast, Mul, Add) as one Where 1.00×.

Ids stay identical; a masked sum adds the same products in the same order (equal on the zoo's models, in any
case within float rounding). ScatterND adds from opset 16: older models keep the dense pooling.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs
from onnx import TensorProto, helper

from ..graph import annotate_shapes_if_bare, iter_graphs
from ..graph.edit import Builder, axes_of, const_value, rank_of
from ..patterns import Const, Match, P, Rewrite, Var
from ..runtime.subgraph import Subgraph
from .registry import PassContext, register_pass

CONTRIB = "ai.onnx.contrib"
ML = "ai.onnx.ml"
PREFIX = "string-embedding"
# (row lengths) of the probe layouts: empty rows first, last and in a row, one row, a row of one token
PROBE_LENGTHS = ((2, 0, 1, 3, 0, 1), (1,), (0, 0, 4), (3, 3, 1, 0), (0, 2, 0, 5, 5, 1, 0))
PROBE_TOKENS = ("a", "", "日本語", "b|c", "🙂", "x" * 40, "pad")


class _NoReduction:
    """ScatterND's reduction attribute is absent or "none" (a plain scatter)."""

    def __call__(self, value) -> bool:
        return value in (None, "none")

    def __repr__(self) -> str:
        return "none"


_no_reduction = _NoReduction()


def _one_string(v: np.ndarray) -> bool:
    return v.size == 1 and v.dtype.kind in "OSU"


# A split's tokens, padded: ScatterND(Expand(fill, dense shape), indices, tokens) with StringSplit's own outputs.
_SPLIT = P.StringSplit(Var("text"), ..., _domain=CONTRIB, _shared=True, _name="split")
_TOKENS = P.ScatterND(P.Expand(Const("fill", pred=_one_string), _SPLIT[2]), _SPLIT[0], _SPLIT[1],
                      reduction=_no_reduction, _shared=True, _name="tokens")


def _split_of_tokens(t: gs.Tensor) -> gs.Node | None:
    """The StringSplit whose padded tokens `t` is (the form `_TOKENS` matches), else None."""
    scatter = t.inputs[0] if len(t.inputs) == 1 else None
    if scatter is None or scatter.op != "ScatterND" or not _no_reduction(scatter.attrs.get("reduction")):
        return None
    data, indices, values = scatter.inputs
    split = values.inputs[0] if len(values.inputs) == 1 else None
    if split is None or split.op != "StringSplit" or split.domain != CONTRIB or len(split.outputs) != 3:
        return None
    expand = data.inputs[0] if len(data.inputs) == 1 else None
    fill = const_value(expand.inputs[0]) if expand is not None and expand.op == "Expand" else None
    if fill is None or not _one_string(fill):
        return None
    if indices is not split.outputs[0] or values is not split.outputs[1] or expand.inputs[1] is not split.outputs[2]:
        return None
    return split


def _fill_of_tokens(t: gs.Tensor):
    """The padding string of split tokens `t`: ScatterND(Expand(fill, shape), ...)'s fill."""
    expand = t.inputs[0].inputs[0].inputs[0]
    return const_value(expand.inputs[0]).ravel()[0]


def _as_text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


# ----------------------------------------------------------------------------------------- StringEqual


def _compare_condition(m: Match) -> bool | str:
    c, x = m.const("c"), m["x"]
    if const_value(x) is not None:
        return "both operands are constants (constant folding's job)"
    if c.ndim and (rank_of(x) is None or rank_of(x) < c.ndim):
        return f"a constant of rank {c.ndim} against a value of unknown or lower rank (the result's shape)"
    try:
        _as_text(c.ravel()[0])
    except UnicodeDecodeError:
        return "the constant is not UTF-8 text"
    return True


def _compare_as_lookup(m: Match) -> list:
    """StringEqual(x, c) → Cast(CategoryMapper(x, {c: 1}, default 0), bool)."""
    out = m.root.outputs[0]
    b = Builder(m.graph, m.root.name, root=m.top)
    found = b.op("CategoryMapper", [m["x"]], {"cats_strings": [_as_text(m.const("c").ravel()[0])], "cats_int64s": [1],
                                              "default_int64": 0}, domain=ML, dtype=np.int64, name="lookup")
    return [b.op("Cast", [found], {"to": TensorProto.BOOL}, dtype=np.bool_, shape=out.shape, name="equal")]


_C = Const("c", pred=_one_string)
COMPARE_RULES = (
    Rewrite("string-equal-as-lookup",
            P.StringEqual(Var("x"), _C, _domain=CONTRIB) | P.StringEqual(_C, Var("x"), _domain=CONTRIB),
            _compare_as_lookup, _compare_condition),
)


# ----------------------------------------------------------------------------------------- split positions


def _probe_layout(lengths) -> tuple[np.ndarray, np.ndarray]:
    """StringSplit's indices [nnz, 2] (row, token) and dense shape [rows, longest] for rows of `lengths`."""
    indices = np.array([(r, j) for r, n in enumerate(lengths) for j in range(n)], np.int64).reshape(-1, 2)
    return indices, np.array([len(lengths), max(lengths)], np.int64)


def _positions_condition(m: Match) -> bool | str:
    split = m.node("split")
    positions, shape = m["positions"], m["shape"]
    if positions is split.outputs[0] and shape is split.outputs[2]:
        return "already at the split's own indices"
    leaves = [split.outputs[0], split.outputs[2]]
    region = Subgraph([positions, shape], leaves, m.top.opset, dtypes=[np.int64, np.int64])
    if region.unresolved:
        return "the positions depend on more than the split's indices and dense shape"
    try:
        for lengths in PROBE_LENGTHS:
            indices, dense = _probe_layout(lengths)
            got_positions, got_shape = region.run([indices, dense])
            if not (np.array_equal(got_positions, indices) and np.array_equal(got_shape, dense)):
                return "the positions are not the split's (row, token) indices"
    except Exception as e:  # a region that does not evaluate on its own
        return f"the positions do not evaluate on probe layouts ({type(e).__name__})"
    return True


def _positions_from_split(m: Match) -> list:
    """ScatterND(Expand(fill, S'), I', tokens) → ScatterND(Expand(fill, split's shape), split's indices, tokens)."""
    split, out = m.node("split"), m.root.outputs[0]
    b = Builder(m.graph, m.root.name, root=m.top, dtype=out.dtype)
    padding = b.op("Expand", [m["fill"], split.outputs[2]], name="padding")
    return [b.op("ScatterND", [padding, split.outputs[0], split.outputs[1]], shape=out.shape, name="tokens")]


POSITION_RULES = (
    Rewrite("split-tokens-from-indices",
            P.ScatterND(P.Expand(Const("fill", pred=_one_string), Var("shape")), Var("positions"), _SPLIT[1],
                        reduction=_no_reduction),
            _positions_from_split, _positions_condition),
)


# ----------------------------------------------------------------------------------------- pooling


def _tokens_behind(t: gs.Tensor, hops: int = 12) -> gs.Tensor | None:
    """The padded split tokens `t` is computed from (within `hops` nodes; constants aside), None when it reads
    anything else or nothing of the kind."""
    found, stack, seen = [], [t], set()
    while stack:
        v = stack.pop()
        if id(v) in seen or const_value(v) is not None or not v.name:
            continue
        seen.add(id(v))
        if _split_of_tokens(v) is not None:
            found.append(v)
            continue
        if len(v.inputs) != 1 or len(seen) > hops:
            return None
        stack.extend(v.inputs[0].inputs)
    return found[0] if len(found) == 1 else None


def _probe_tokens(fill) -> list[np.ndarray]:
    """Token arrays [rows, T] with the padding and other strings (empty, other scripts, long) in each."""
    pool = [fill if i % 3 == 0 else s for i, s in enumerate(PROBE_TOKENS * 3)]
    return [np.array(pool[k:k + rows * width], dtype=object).reshape(rows, width)
            for k, (rows, width) in enumerate(((3, 4), (1, 1), (2, 5), (1, 6)))]


def _mask_axes(weight: gs.Tensor, tokens: gs.Tensor, opset: int) -> int | str:
    """How many unit axes follow [rows, T] in `weight` (0 or 1), when it is 1 exactly where a token is not the
    padding and 0 where it is (run on probe tokens); else why not."""
    fill = _as_text(_fill_of_tokens(tokens))
    dtype = _float_type(weight, tokens, opset)
    if isinstance(dtype, str):
        return dtype
    region = Subgraph([weight], [tokens], opset, dtypes=[dtype])
    if region.unresolved:
        return "the weights read more than the tokens"
    axes = set()
    try:
        for probe in _probe_tokens(fill):
            (got,) = region.run([probe])
            if got.shape[:2] != probe.shape or got.shape[2:] not in ((), (1,)):
                return "the weights are not shaped [rows, T] or [rows, T, 1] like the tokens"
            if not np.array_equal(got.reshape(probe.shape), (probe != fill).astype(dtype)):
                return "the weights are not 1 exactly where a token is not the padding"
            axes.add(got.ndim - 2)
    except Exception as e:  # the region does not evaluate on its own
        return f"the weights do not evaluate on probe tokens ({type(e).__name__})"
    return axes.pop() if len(axes) == 1 else "the weights' rank changes with the tokens"


def _float_type(weight: gs.Tensor, tokens: gs.Tensor, opset: int) -> np.dtype | str:
    """The weights' float type: as annotated, else the one their region runs with (shape inference stops at
    onnxruntime-extensions' ops, so what they feed often has none)."""
    if weight.dtype is not None:
        dtype = np.dtype(weight.dtype)
        return dtype if dtype.kind == "f" else "the weights are not float"
    for dtype in (np.float32, np.float16, np.float64):
        try:
            Subgraph([weight], [tokens], opset, dtypes=[dtype]).prepare([np.dtype(object)])
            return np.dtype(dtype)
        except Exception:  # onnxruntime refuses an output declared with another type: try the next
            continue
    return "the weights are not float"


def _token_axis(m: Match, rank: int) -> bool | str:
    axes = axes_of(m.root)
    if axes is None or [a % rank for a in axes] != [1]:
        return "not a sum over the token axis (axis 1)"
    if m.top.opset < 16:
        return f"ScatterND adds only from opset 16 (the model has {m.top.opset})"
    return True


def _pooled_condition(m: Match) -> bool | str:
    lookup, table = m.node("lookup"), m.const("table")
    if lookup.attrs.get("axis", 0) != 0 or table.dtype.kind != "f":
        return "not a lookup of float table rows"
    reason = _ids_op_reason(m.node("ids"))
    if reason:
        return reason
    verdict = _token_axis(m, 3)
    if verdict is not True:
        return verdict
    tokens = m.node("tokens").outputs[0]
    if _tokens_behind(m["weight"]) is not tokens:
        return "the weights are not computed from the same tokens"
    axes = _mask_axes(m["weight"], tokens, m.top.opset)
    if axes != 1:
        return axes if isinstance(axes, str) else "the weights are not [rows, T, 1]"
    return True


def _ids_op_reason(node: gs.Node) -> str | None:
    if node.op == "StringToHashBucketFast" and node.domain == CONTRIB and const_value(node.inputs[1]) is not None:
        return None
    if node.op == "CategoryMapper" and node.domain == ML and node.attrs.get("cats_strings"):
        return None
    return f"the ids come from {node.op} ({node.domain or 'ai.onnx'}), not a hash or vocabulary of the tokens"


def _per_token(m: Match, tokens: gs.Tensor, dtype) -> tuple:
    """(builder, split, per-token weight [nnz, 1] of `dtype`, token rows [nnz, 1], rows [1]), shared by the rules."""
    split = _split_of_tokens(tokens)
    fill = _as_text(_fill_of_tokens(tokens))
    b = Builder(m.graph, PREFIX, root=m.top, share=PREFIX, reuse=PREFIX)
    zero, one = b.const("zero", np.array([0], np.int64)), b.const("one", np.array([1], np.int64))
    rows = b.op("Slice", [split.outputs[0], zero, one, one], dtype=np.int64, shape=["tokens", 1], name="token_rows")
    batch = b.op("Slice", [split.outputs[2], zero, one], dtype=np.int64, shape=[1], name="rows")
    kept = b.op("CategoryMapper", [split.outputs[1]], {"cats_strings": [fill], "cats_int64s": [0],
                                                       "default_int64": 1}, domain=ML, dtype=np.int64,
                name="not_padding")
    weight = b.op("Cast", [kept], {"to": _onnx_type(dtype)}, dtype=dtype, name="token_weight")
    weight = b.op("Unsqueeze", [weight, one], dtype=dtype, shape=["tokens", 1], name="token_weight_column")
    return b, split, weight, rows, batch


def _onnx_type(dtype) -> int:
    return helper.np_dtype_to_tensor_dtype(np.dtype(dtype))


def _segment_sum(m: Match, b: Builder, per_token: gs.Tensor, rows: gs.Tensor, batch: gs.Tensor, tail: list,
                 dtype) -> list:
    """Σ over each row's tokens of `per_token` [nnz, *tail] → [rows, *tail] (keepdims: [rows, 1, *tail])."""
    out = m.root.outputs[0]
    shape = b.op("Concat", [batch, b.const("tail", np.array(tail, np.int64))], {"axis": 0}, dtype=np.int64,
                 name="sum_shape")
    zeros = b.op("ConstantOfShape", [shape], {"value": gs.Constant(b.name("zero"), np.zeros(1, dtype))},
                 dtype=dtype, name="zeros")
    keep = m.root.attrs.get("keepdims", 1)
    summed = b.op("ScatterND", [zeros, rows, per_token], {"reduction": "add"}, dtype=dtype,
                  shape=None if keep else out.shape, name=f"{m.root.name}/segment_sum")
    if keep:
        summed = b.op("Unsqueeze", [summed, b.const("one", np.array([1], np.int64))], dtype=dtype, shape=out.shape,
                      name=f"{m.root.name}/keepdims")
    return [summed]


def _pooled(m: Match) -> list:
    """Σ_t lookup(tokens[b, t]) · weight[b, t] → Σ over row b's split tokens of lookup(token) · weight(token)."""
    table, ids = m["table"], m.node("ids")
    dtype = np.dtype(m.const("table").dtype)
    b, split, weight, rows, batch = _per_token(m, m.node("tokens").outputs[0], dtype)
    token_ids = b.op(ids.op, [split.outputs[1], *ids.inputs[1:]], dict(ids.attrs), domain=ids.domain,
                     dtype=np.int64, name=f"{m.root.name}/token_ids")
    looked_up = b.op("Gather", [table, token_ids], {"axis": 0}, dtype=dtype, name=f"{m.root.name}/token_rows")
    weighted = b.op("Mul", [looked_up, weight], dtype=dtype, name=f"{m.root.name}/weighted")
    return _segment_sum(m, b, weighted, rows, batch, [int(m.const("table").shape[1])], dtype)


def _counted_condition(m: Match) -> bool | str:
    tokens = _tokens_behind(m["weight"])
    if tokens is None:
        return "not computed from a split's padded tokens"
    axes = _mask_axes(m["weight"], tokens, m.top.opset)
    if isinstance(axes, str):
        return axes
    return _token_axis(m, 2 + axes)


def _counted(m: Match) -> list:
    """Σ_t weight[b, t] → Σ over row b's split tokens of weight(token)."""
    weight, tokens = m["weight"], _tokens_behind(m["weight"])
    dtype = _float_type(weight, tokens, m.top.opset)
    b, _, per_token, rows, batch = _per_token(m, tokens, dtype)
    tail = [1] * _mask_axes(weight, tokens, m.top.opset)
    if not tail:
        per_token = b.op("Squeeze", [per_token, b.const("one", np.array([1], np.int64))], dtype=dtype,
                         name="token_weight_flat")
    return _segment_sum(m, b, per_token, rows, batch, tail, dtype)


def _read_tokens(t: gs.Tensor) -> bool:
    return _tokens_behind(t, hops=12) is not None


_TOKEN_IDS = P["StringToHashBucketFast|CategoryMapper"](_TOKENS, ..., _name="ids", _shared=True)
POOL_RULES = (
    Rewrite("split-tokens-pooled",
            P.ReduceSum(P.Mul(P.Gather(Const("table", rank=2), _TOKEN_IDS, _name="lookup"), Var("weight")), ...),
            _pooled, _pooled_condition),
    Rewrite("split-tokens-counted", P.ReduceSum(Var("weight", pred=_read_tokens), ...), _counted, _counted_condition),
)


# ----------------------------------------------------------------------------------------- before the padding


def _padded():
    """Any value padded with one constant: ScatterND(Expand(fill, shape), positions, values)."""
    return P.ScatterND(P.Expand(Const("fill", pred=lambda v: v.size == 1), Var("shape")), Var("positions"),
                       Var("values"), reduction=_no_reduction, _shared=True, _name="padded")


def _padding_id(m: Match) -> np.ndarray:
    """The op's value on the padding: the op itself run on the fill constant."""
    out = m.root.outputs[0]
    region = Subgraph([out], [m.node("padded").outputs[0]], m.top.opset, dtypes=[np.int64])
    if region.unresolved:
        raise ValueError("the op reads more than the padded value")
    (value,) = region.run([np.asarray(m.const("fill"), dtype=object)])
    return value


def _before_padding_condition(m: Match) -> bool | str:
    reason = _ids_op_reason(m.root)
    if reason:
        return reason
    if np.asarray(m.const("fill")).dtype.kind not in "OSU":
        return "the padding is not a string"
    try:
        _padding_id(m)
    except Exception as e:  # onnxruntime-extensions missing, or the op does not run on its own
        return f"the padding's id cannot be computed ({type(e).__name__}: {str(e)[:80]})"
    return True


def _before_padding(m: Match) -> list:
    """op(ScatterND(Expand(fill, S), I, values)) → ScatterND(Expand(op(fill), S), I, op(values)) for an elementwise
    op (a hash, a vocabulary)."""
    out, node = m.root.outputs[0], m.root
    shared = Builder(m.graph, PREFIX, root=m.top, share=PREFIX, reuse=PREFIX)  # the pooling's ids, if it made them
    ids = shared.op(node.op, [m["values"], *node.inputs[1:]], dict(node.attrs), domain=node.domain, dtype=np.int64,
                    name=f"{node.name}/values")
    b = Builder(m.graph, node.name, root=m.top, dtype=np.int64)
    fill = b.const("padding_id", _padding_id(m).astype(np.int64))
    padding = b.op("Expand", [fill, m["shape"]], name="padding")
    return [b.op("ScatterND", [padding, m["positions"], ids], shape=out.shape, name="padded")]


PADDING_RULES = (
    Rewrite("hash-before-padding", P.StringToHashBucketFast(_padded(), Const("buckets"), _domain=CONTRIB),
            _before_padding, _before_padding_condition),
    Rewrite("vocabulary-before-padding", P.CategoryMapper(_padded(), _domain=ML), _before_padding,
            _before_padding_condition),
)

STRING_RULES = COMPARE_RULES + POSITION_RULES + POOL_RULES + PADDING_RULES


@register_pass("string-embedding", group="fusion", targets=("ort",), devices=("cpu",), rules=STRING_RULES)
def string_embedding(ctx: PassContext) -> None:
    """A string column's chain in fewer, cheaper kernels: StringEqual with a constant as onnxruntime's
    CategoryMapper, a split column's tokens looked up and pooled per row without padding them, hashes and
    vocabularies before the padding (onnxruntime-extensions' string ops)."""
    if not any(n.domain == CONTRIB for g in iter_graphs(ctx.graph) for n in g.nodes):
        return
    annotate_shapes_if_bare(ctx.graph)
    ctx.apply(*COMPARE_RULES, *POSITION_RULES)
    ctx.apply(*POOL_RULES)  # on the padded tokens, before the ops that read them move past the padding
    ctx.apply(*PADDING_RULES)
