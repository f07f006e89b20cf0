/* GatherRows, GatherRowsInt64: Gather(table, indices, axis=0) of float or int64 rows, a row copied per index with no
 * call in between.
 *
 * onnxruntime's CPU Gather spends about 8 ns per index whatever the row's width (a [1000, 8] table read at
 * [256, 26] indices: about 55 µs), its per-index copy being a function call; a CTR model reads thousands of ids
 * per batch. This kernel copies a row with vector moves, inline.
 *
 * Node (domain "ai.ctropt.kernels", made by gather-rows-kernel):
 *   inputs   0 table [V, ...] (float: GatherRows; int64: GatherRowsInt64, positions the passes gather)
 *            1 indices (int32, int64, or float: read as the Cast to int64 the model made of them), any shape
 *            2 offsets (optional, the indices' type; int64 for float), [K]: K the indices' last dim; index i reads row
 *              indices[i] + offsets[i % K], the sum in the indices' type (fuse-parallel-embeddings' per-field offsets
 *              into one concatenated table, without the Expand and Add that would make them [..., K] first)
 *   attributes sizes (ints, optional, [K], with offsets): each column's field's rows in the joined table. Index i is
 *            then read as that field's own Gather reads it: negative from the end of its sizes[i % K] rows, one outside
 *            [-size, size) an error, wherever the joined table's bounds are; the row is that id + offsets[i % K]
 *            names (string, optional): the input each column's ids come from, a line each (for that error)
 *   outputs  0 Y [indices..., ...]: as Gather(table, indices, axis=0): a negative index counts from the end, one out
 *            of [-V, V) is an error (onnxruntime's message's meaning).
 */
#include <stdio.h>

#include "kernels.h"

#define MAX_RANK 8
#define MAX_BLOCKS 64

typedef struct {
    const float *table;
    const void *indices, *offsets;   /* offsets: NULL when absent */
    const int64_t *sizes;              /* per offsets' column: its field's rows (NULL: the table's bounds only) */
    float *y;
    int64_t count, V, D, K, blocks, bad;   /* D: 4-byte words per row; K: offsets; bad: out of range (+1), 0: none */
    int kind;                          /* of the indices: IDS_INT32, IDS_INT64, IDS_FLOAT */
} Job;

/* Index i (column c of the offsets' K). */
static inline int64_t index_at(const Job *j, int64_t i, int64_t c) {
    return offset_index(j->indices, j->offsets, j->kind, i, c);
}

static void gather_block(void *data, size_t b) {
    Job *j = data;
    const int64_t first = j->count * (int64_t)b / j->blocks, end = j->count * ((int64_t)b + 1) / j->blocks;
    int64_t c = j->K ? first % j->K : 0;   /* the offsets' column, counted along (no division per index) */
    for (int64_t i = first; i < end; ++i, c = c + 1 == j->K ? 0 : c + 1) {
        int64_t at = j->sizes ? field_row(j->indices, j->offsets, j->sizes, j->kind, i, c) : index_at(j, i, c);
        at += at < 0 && !j->sizes ? j->V : 0;   /* a conditional move, not a branch */
        if ((uint64_t)at >= (uint64_t)j->V) {
            __atomic_store_n(&j->bad, i + 1, __ATOMIC_RELAXED);   /* reported after the loop */
            memset(j->y + i * j->D, 0, (size_t)j->D * sizeof(float));
            continue;
        }
        copy_row(j->y + i * j->D, j->table + at * j->D, j->D);
    }
}

typedef struct {
    int64_t *sizes;   /* the sizes attribute (NULL: absent) */
    size_t n_sizes;
    char *names;      /* the names attribute: each column's input, a line each (NULL: absent) */
} RowsKernel;

static OrtStatus *ORT_API_CALL create(const OrtCustomOp *op, const OrtApi *api, const OrtKernelInfo *info,
                                      void **kernel) {
    (void)op;
    (void)api;
    RowsKernel *k = calloc(1, sizeof(RowsKernel));
    if (!k) return ort->CreateStatus(ORT_FAIL, "GatherRows: out of memory");
    OrtStatus *s = ints_attribute(info, "sizes", &k->sizes, &k->n_sizes);
    if (!s) s = string_attribute(info, "names", &k->names);
    if (s) {
        free(k->sizes);
        free(k);
    } else {
        *kernel = k;
    }
    return s;
}

static void ORT_API_CALL destroy_rows(void *kernel) {
    free(((RowsKernel *)kernel)->sizes);
    free(((RowsKernel *)kernel)->names);
    free(kernel);
}

/* The error of index i out of range: of its field's rows where the node has sizes, else of the table's. */
static OrtStatus *out_of_range(const Job *j, const RowsKernel *k, int64_t i) {
    char msg[320];
    const int64_t c = j->K ? i % j->K : 0;
    if (j->sizes)
        field_bounds_message(msg, sizeof msg, "GatherRows", offset_index(j->indices, NULL, j->kind, i, 0), j->sizes[c],
                             c, k->names);
    else
        snprintf(msg, sizeof msg, "GatherRows: indices element out of data bounds, idx=%lld must be within the "
                 "inclusive range [%lld,%lld]", (long long)index_at(j, i, c), (long long)-j->V, (long long)(j->V - 1));
    return error(msg);
}

static OrtStatus *ORT_API_CALL compute(void *kernel, OrtKernelContext *ctx) {
    const RowsKernel *k = kernel;
    size_t rt, ri;
    int64_t dt[MAX_RANK], di[MAX_RANK], out[2 * MAX_RANK];
    ONNXTensorElementDataType tt, ti;
    Job j = {0};
    TRY(read_typed_input(ctx, 0, (const void **)&j.table, dt, &rt, MAX_RANK, "GatherRows: the table has rank > 8", &tt));
    TRY(read_typed_input(ctx, 1, &j.indices, di, &ri, MAX_RANK, "GatherRows: the indices have rank > 8", &ti));
    if (rt < 1) return error("GatherRows: the table needs one axis at least");
    j.kind = ids_kind(ti);
    if (j.kind < 0) return error("GatherRows: indices must be int32, int64 or float");
    const int64_t words = tt == ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 ? 2 : 1;   /* per element */
    size_t n_in;
    TRY(ort->KernelContext_GetInputCount(ctx, &n_in));
    if (n_in > 2) {
        int64_t dk[MAX_RANK];
        size_t rk;
        ONNXTensorElementDataType tk;
        TRY(read_typed_input(ctx, 2, &j.offsets, dk, &rk, MAX_RANK, "GatherRows: the offsets have rank > 8", &tk));
        if (j.offsets && (tk != offsets_type(j.kind) || rk != 1 || ri < 1 || dk[0] != di[ri - 1] || dk[0] < 1))
            return error("GatherRows: offsets must be [K] of the indices' type (int64 for float), K their last dim");
        j.K = j.offsets ? dk[0] : 0;
    }
    if (k->sizes && (!j.offsets || (int64_t)k->n_sizes != j.K))
        return error("GatherRows: sizes must come with offsets, one per offsets' column");
    j.sizes = k->sizes;
    j.V = dt[0], j.D = 1, j.count = 1;
    size_t out_rank = 0;
    for (size_t x = 0; x < ri; ++x) j.count *= out[out_rank++] = di[x];
    for (size_t x = 1; x < rt; ++x) j.D *= out[out_rank++] = dt[x];
    j.D *= words;
    OrtValue *y;
    TRY(ort->KernelContext_GetOutput(ctx, 0, out, out_rank, &y));
    TRY(ort->GetTensorMutableData(y, (void **)&j.y));
    if (j.count == 0) return NULL;
    j.blocks = j.count < MAX_BLOCKS ? j.count : MAX_BLOCKS;   /* rows of no floats too: the indices are checked */
    TRY(ort->KernelContext_ParallelFor(ctx, gather_block, (size_t)j.blocks, 0, &j));
    return j.bad ? out_of_range(&j, k, j.bad - 1) : NULL;
    return NULL;
}

static const char *ORT_API_CALL name(const OrtCustomOp *op) { (void)op; return "GatherRows"; }
static const char *ORT_API_CALL name_int64(const OrtCustomOp *op) { (void)op; return "GatherRowsInt64"; }
static size_t ORT_API_CALL n_inputs(const OrtCustomOp *op) { (void)op; return 3; }
static OrtCustomOpInputOutputCharacteristic ORT_API_CALL input_kind(const OrtCustomOp *op, size_t i) {
    (void)op;
    return i < 2 ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL;
}
static ONNXTensorElementDataType ORT_API_CALL input_type(const OrtCustomOp *op, size_t i) {
    (void)op;   /* the indices' type is read at run time: int32 or int64 */
    return i == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT : ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
}
static ONNXTensorElementDataType ORT_API_CALL input_type_int64(const OrtCustomOp *op, size_t i) {
    (void)op;
    return i == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 : ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
}

OrtCustomOp ctropt_gather_rows = CUSTOM_OP(name, input_type, n_inputs, float_type, one_count, input_kind, required,
                                           create, compute, .KernelDestroy = destroy_rows);
OrtCustomOp ctropt_gather_rows_int64 = CUSTOM_OP(name_int64, input_type_int64, n_inputs, int64_type, one_count, input_kind,
                                                 required, create, compute, .KernelDestroy = destroy_rows);
