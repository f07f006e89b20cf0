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
- ``hash-before-padding`` / ``vocabulary-before-padding``: what still reads the padded tokens hashes or looks up
  the tokens first and pads the ids with the padding's own id (computed by running the op on it).

Measured (onnxruntime 1.32 CPU, 1 thread, batch 256, paired, on the zoo's exports after every other pass):
wdl_strings 1.09× for the StringEqual rule alone, 1.27× with the split's indices, 1.36× with hash and lookup
before the padding; din_strings 1.14× (one user 1.17×; its string history comes padded, so only the StringEqual
rule applies). Pooling a split column over its tokens only (ScatterND with reduction add) gave wdl another 1.06×
and was taken out: its mask was proven on probe tokens only (a mask that also drops "<unk>", or the first K tokens,
passes the probes and is not the padding mask), and onnxruntime's CPU ScatterND adds race across threads. Tried and left out, measured slower or no faster: one hash call over the
concatenated columns of the same bucket count (or of all columns, with the least common multiple of the bucket
counts and a Mod per column: (h mod M) mod n = h mod n when n divides M) 0.95-0.98×; hashing only the distinct
strings (Unique, hash, Gather by the inverse) 0.56-0.76× at batch 256 and 1.0-1.09× when every row has the same
user; StringLength instead of StringEqual 0.77×; the vocabulary-with-OOV-buckets select (CategoryMapper,
Equal, Not, Cast, Mul, Add) as one Where 1.00×.

Ids stay identical, and every value after them is computed by the same ops as before.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs
from onnx import TensorProto

from ...graph import annotate_shapes_if_bare, iter_graphs
from ...graph.edit import Builder, const_value, rank_of
from ...patterns import Const, Match, P, Rewrite, Var
from ...runtime.subgraph import Subgraph
from ..registry import PassContext, register_pass

CONTRIB = "ai.onnx.contrib"
ML = "ai.onnx.ml"
# (row lengths) of the probe layouts: empty rows first, last and in a row, one row, a row of one token
PROBE_LENGTHS = ((2, 0, 1, 3, 0, 1), (1,), (0, 0, 4), (3, 3, 1, 0), (0, 2, 0, 5, 5, 1, 0), (9, 0, 12, 1))


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
        text = _as_text(c.ravel()[0])
    except UnicodeDecodeError:
        return "the constant is not UTF-8 text"
    if "\x00" in text:
        return "the constant holds a NUL byte (the contrib op compares up to it, CategoryMapper the whole string)"
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


# ----------------------------------------------------------------------------------------- hashing before the padding


def _ids_op_reason(node: gs.Node) -> str | None:
    if node.op == "StringToHashBucketFast" and node.domain == CONTRIB and const_value(node.inputs[1]) is not None:
        return None
    if node.op == "CategoryMapper" and node.domain == ML and node.attrs.get("cats_strings"):
        return None
    return f"the ids come from {node.op} ({node.domain or 'ai.onnx'}), not a hash or vocabulary of the tokens"


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
    b = Builder(m.graph, node.name, root=m.top, dtype=np.int64)
    ids = b.op(node.op, [m["values"], *node.inputs[1:]], dict(node.attrs), domain=node.domain, name="values")
    fill = b.const("padding_id", _padding_id(m).astype(np.int64))
    padding = b.op("Expand", [fill, m["shape"]], name="padding")
    return [b.op("ScatterND", [padding, m["positions"], ids], shape=out.shape, name="padded")]


PADDING_RULES = (
    Rewrite("hash-before-padding", P.StringToHashBucketFast(_padded(), Const("buckets"), _domain=CONTRIB),
            _before_padding, _before_padding_condition),
    Rewrite("vocabulary-before-padding", P.CategoryMapper(_padded(), _domain=ML), _before_padding,
            _before_padding_condition),
)

STRING_RULES = COMPARE_RULES + POSITION_RULES + PADDING_RULES


@register_pass("string-embedding", group="fusion", targets=("ort",), devices=("cpu",), rules=STRING_RULES)
def string_embedding(ctx: PassContext) -> None:
    """A string column's chain in fewer, cheaper kernels: StringEqual with a constant as onnxruntime's
    CategoryMapper, a split column's tokens placed at the split's own indices, hashes and vocabularies before the
    padding (onnxruntime-extensions' string ops)."""
    if not any(n.domain == CONTRIB for g in iter_graphs(ctx.graph) for n in g.nodes):
        return
    annotate_shapes_if_bare(ctx.graph)
    ctx.apply(*COMPARE_RULES, *POSITION_RULES)
    ctx.apply(*PADDING_RULES)
