/* GatherFields: several fields' ids looked up in one table, and dense columns, written side by side into one row per
 * example: Concat(Reshape(Gather(table, Concat(ids_1, …, ids_F) + offsets), [B, K·D]), x_1, …, x_m) on axis 1.
 *
 * A dense ranker's DNN input is its sparse fields' embeddings, flattened, beside its dense values. onnxruntime runs
 * that as the ids' Concat, the lookup, the flattening Reshape and the Concat with the dense values: four ops, each a
 * pass over the batch with its own per-node cost (about 2 µs each at batch 256 in a 15-node model). This kernel reads
 * each field's ids where they are and writes each output row once.
 *
 * Node (domain "ai.ctropt.kernels", made by gather-rows-kernel):
 *   inputs   0 table [V, ...] (float)
 *            1 offsets (optional), [K] of the ids' type (int64 for float ids), K the fields' columns in all: column
 *              c of the ids reads row ids + offsets[c], the sum in the ids' type (fuse-parallel-embeddings' offsets)
 *            2… the ids of F ≥ 1 fields (int32, int64 or float, one type; each [B] or [B, k]), then m ≥ 0 dense
 *              values (float; each [B] or [B, w]); float ids are read as the Cast to int64 the model made of them
 *   attributes fields (int, optional): F; without it the inputs' type tells which is which (int ids, float values)
 *            ranges (ints, optional): two per part, the columns [start, end) of its input it reads (deepctr-torch's
 *              ids and dense values: columns of one matrix); without it each part whole
 *            sizes (ints, optional, [K], with offsets): each id column's field's rows in the table; an id is then read
 *              as that field's own Gather reads it (negative from the end of its rows, one outside [-size, size) an
 *              error), at the field's rows from offsets[c]
 *            names (string, optional): the input each id column comes from, a line each (for that error)
 *   outputs  0 Y [B, K·D + Σ w] (D: a table row's size): as the ops above compute it; an index out of [-V, V) is an
 *            error (onnxruntime's message's meaning)
 */
#include <stdio.h>

#include "kernels.h"

#define MAX_PARTS 512
#define MAX_BLOCKS 64

typedef struct {
    const float *table;
    const void *offsets;
    const int64_t *sizes;              /* per id column: its field's rows (NULL: the table's bounds only) */
    const void *part[MAX_PARTS];       /* ids, then dense values */
    int64_t width[MAX_PARTS];          /* columns of each part read */
    int64_t stride[MAX_PARTS], start[MAX_PARTS];   /* its input's columns, the first read */
    int64_t fields, parts, rows, K, V, D, W, blocks, bad;   /* K: ids' columns; W: the output's; bad: row·K + column + 1 */
    float *y;
    int kind;                          /* of the ids: IDS_INT32, IDS_INT64, IDS_FLOAT */
} Job;

/* Row b's k-th id of field f (column c of all the ids'). */
static inline int64_t id_at(const Job *j, int64_t f, int64_t b, int64_t k, int64_t c) {
    return offset_index(j->part[f], j->offsets, j->kind, b * j->stride[f] + j->start[f] + k, c);
}

static void fields_block(void *data, size_t blk) {
    Job *j = data;
    const int64_t first = j->rows * (int64_t)blk / j->blocks, end = j->rows * ((int64_t)blk + 1) / j->blocks;
    for (int64_t b = first; b < end; ++b) {
        float *to = j->y + b * j->W;
        int64_t c = 0;   /* the ids' column, over all fields */
        for (int64_t f = 0; f < j->fields; ++f) {
            for (int64_t k = 0; k < j->width[f]; ++k, ++c, to += j->D) {
                int64_t at = j->sizes ? field_row(j->part[f], j->offsets, j->sizes, j->kind,
                                                  b * j->stride[f] + j->start[f] + k, c) : id_at(j, f, b, k, c);
                at += at < 0 && !j->sizes ? j->V : 0;
                if ((uint64_t)at >= (uint64_t)j->V) {
                    __atomic_store_n(&j->bad, b * j->K + c + 1, __ATOMIC_RELAXED);
                    memset(to, 0, (size_t)j->D * sizeof(float));
                    continue;
                }
                copy_row(to, j->table + at * j->D, j->D);
            }
        }
        for (int64_t p = j->fields; p < j->parts; ++p) {
            memcpy(to, (const float *)j->part[p] + b * j->stride[p] + j->start[p], (size_t)j->width[p] * sizeof(float));
            to += j->width[p];
        }
    }
}

typedef struct {
    int64_t fields;                /* the id parts, -1: by their type (int32 or int64) */
    int64_t ranges[2 * MAX_PARTS]; /* each part's columns read, [start, end) */
    size_t n_ranges;               /* 0: every part whole */
    int64_t *sizes;                /* the sizes attribute (NULL: absent) */
    size_t n_sizes;
    char *names;                   /* the names attribute: each id column's input, a line each (NULL: absent) */
} FieldsKernel;

/* Part p's rows and the columns read ([B] or [B, w], a range of them where the node gives ranges) into the job; its
 * type into *type. */
static OrtStatus *read_part(OrtKernelContext *ctx, const FieldsKernel *k, Job *j, int64_t p,
                            ONNXTensorElementDataType *type) {
    int64_t d[2];
    size_t r = 0;   /* stays 0 for a missing part; an empty one (batch 0) has no data but its rank */
    TRY(read_typed_input(ctx, (size_t)p + 2, &j->part[p], d, &r, 2, "GatherFields: a part has rank > 2", type));
    if (r < 1) return error("GatherFields: a part is missing or a scalar");
    if (p > 0 && d[0] != j->rows) return error("GatherFields: the parts' rows differ");
    j->rows = d[0];
    j->stride[p] = r == 2 ? d[1] : 1;
    const int64_t start = k->n_ranges ? k->ranges[2 * p] : 0, end = k->n_ranges ? k->ranges[2 * p + 1] : j->stride[p];
    if (start < 0 || start > end || end > j->stride[p]) return error("GatherFields: a part's range is outside its columns");
    j->start[p] = start, j->width[p] = end - start;
    return NULL;
}

/* The parts' kinds: the first `fields` parts ids (any one kind, float too), the rest float; or, with fields -1, int
 * parts ids and float parts dense, the ids first. */
static OrtStatus *read_parts(OrtKernelContext *ctx, const FieldsKernel *k, Job *j, int64_t *dense) {
    ONNXTensorElementDataType t, ids_type = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
    const int64_t fields = k->fields;
    if (k->n_ranges && k->n_ranges != 2 * (size_t)j->parts) return error("GatherFields: ranges must be two per part");
    for (int64_t p = 0; p < j->parts; ++p) {
        TRY(read_part(ctx, k, j, p, &t));
        const int kind = ids_kind(t);
        const int ids = fields >= 0 ? p < fields : kind == IDS_INT32 || kind == IDS_INT64;
        if (ids && (kind < 0 || j->fields != p || (p && t != ids_type))) return error("GatherFields: ids of one type, before the dense values");
        if (!ids && t != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT) return error("GatherFields: a part is neither ids nor float");
        if (ids) ids_type = t, j->kind = kind, j->fields++, j->K += j->width[p];
        else *dense += j->width[p];
    }
    return j->fields ? NULL : error("GatherFields: no ids");
}

static OrtStatus *ORT_API_CALL compute(void *kernel, OrtKernelContext *ctx) {
    size_t n_in, rt;
    int64_t dt[8], dense = 0;
    ONNXTensorElementDataType tt, t;
    Job j = {0};
    TRY(read_typed_input(ctx, 0, (const void **)&j.table, dt, &rt, 8, "GatherFields: the table has rank > 8", &tt));
    if (rt < 1) return error("GatherFields: the table needs one axis at least");
    TRY(ort->KernelContext_GetInputCount(ctx, &n_in));
    if (n_in < 3 || n_in - 2 > MAX_PARTS) return error("GatherFields: 1 to 512 parts");
    j.parts = (int64_t)n_in - 2;
    TRY(read_parts(ctx, kernel, &j, &dense));
    int64_t dk[1];
    size_t rk;
    TRY(read_typed_input(ctx, 1, &j.offsets, dk, &rk, 1, "GatherFields: the offsets have rank > 1", &t));
    if (j.offsets && (t != offsets_type(j.kind) || rk != 1 || dk[0] != j.K))
        return error("GatherFields: offsets must be [K] of the ids' type (int64 for float ids)");
    const FieldsKernel *fk = kernel;
    if (fk->sizes && (!j.offsets || (int64_t)fk->n_sizes != j.K))
        return error("GatherFields: sizes must come with offsets, one per id column");
    j.sizes = fk->sizes;
    j.V = dt[0], j.D = 1;
    for (size_t x = 1; x < rt; ++x) j.D *= dt[x];
    j.W = j.K * j.D + dense;
    const int64_t out[2] = {j.rows, j.W};
    OrtValue *y;
    TRY(ort->KernelContext_GetOutput(ctx, 0, out, 2, &y));
    TRY(ort->GetTensorMutableData(y, (void **)&j.y));
    if (j.rows == 0) return NULL;
    j.blocks = j.rows < MAX_BLOCKS ? j.rows : MAX_BLOCKS;
    TRY(ort->KernelContext_ParallelFor(ctx, fields_block, (size_t)j.blocks, 0, &j));
    if (j.bad) {
        const int64_t b = (j.bad - 1) / j.K, c = (j.bad - 1) % j.K;
        int64_t f = 0, k = c;
        while (k >= j.width[f]) k -= j.width[f++];
        char msg[320];
        const int64_t i = b * j.stride[f] + j.start[f] + k;
        if (j.sizes)
            field_bounds_message(msg, sizeof msg, "GatherFields", offset_index(j.part[f], NULL, j.kind, i, 0),
                                 j.sizes[c], c, fk->names);
        else
            snprintf(msg, sizeof msg, "GatherFields: indices element out of data bounds, idx=%lld must be within the "
                     "inclusive range [%lld,%lld]", (long long)id_at(&j, f, b, k, c), (long long)-j.V,
                     (long long)(j.V - 1));
        return error(msg);
    }
    return NULL;
}

static OrtStatus *ORT_API_CALL create(const OrtCustomOp *op, const OrtApi *api, const OrtKernelInfo *info,
                                      void **kernel) {
    (void)op;
    (void)api;
    FieldsKernel *k = calloc(1, sizeof(FieldsKernel));
    if (!k) return ort->CreateStatus(ORT_FAIL, "GatherFields: out of memory");
    k->fields = int_attribute(info, "fields", -1);   /* absent: the ids by their type */
    OrtStatus *s = ort->KernelInfoGetAttributeArray_int64(info, "ranges", NULL, &k->n_ranges);
    if (s) {   /* absent: every part whole */
        ort->ReleaseStatus(s);
        k->n_ranges = 0;
    } else if (k->n_ranges > 2 * MAX_PARTS) {
        free(k);
        return error("GatherFields: ranges must be two per part");
    } else if (k->n_ranges && (s = ort->KernelInfoGetAttributeArray_int64(info, "ranges", k->ranges, &k->n_ranges))) {
        free(k);
        return s;
    }
    if ((s = ints_attribute(info, "sizes", &k->sizes, &k->n_sizes)) || (s = string_attribute(info, "names", &k->names))) {
        free(k->sizes);
        free(k);
        return s;
    }
    *kernel = k;
    return NULL;
}

static void ORT_API_CALL destroy_fields(void *kernel) {
    free(((FieldsKernel *)kernel)->sizes);
    free(((FieldsKernel *)kernel)->names);
    free(kernel);
}

static const char *ORT_API_CALL name(const OrtCustomOp *op) { (void)op; return "GatherFields"; }
static size_t ORT_API_CALL n_inputs(const OrtCustomOp *op) { (void)op; return 3; }
static OrtCustomOpInputOutputCharacteristic ORT_API_CALL input_kind(const OrtCustomOp *op, size_t i) {
    (void)op;
    return i == 0 ? INPUT_OUTPUT_REQUIRED : i == 1 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_VARIADIC;
}
static ONNXTensorElementDataType ORT_API_CALL input_type(const OrtCustomOp *op, size_t i) {
    (void)op;   /* the ids' and the parts' types are read at run time */
    return i == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT : ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
}
static int ORT_API_CALL mixed(const OrtCustomOp *op) { (void)op; return 0; }

OrtCustomOp ctropt_gather_fields = {
    .version = ORT_API_VERSION, .GetName = name, .GetInputType = input_type, .GetInputTypeCount = n_inputs,
    .GetOutputType = float_type, .GetOutputTypeCount = one_count, .GetInputCharacteristic = input_kind,
    .GetOutputCharacteristic = required, .CreateKernelV2 = create, .KernelComputeV2 = compute,
    .KernelDestroy = destroy_fields, COMMON_CALLBACKS,
    .GetVariadicInputHomogeneity = mixed,   /* ids and floats in the one variadic list (overrides COMMON_CALLBACKS) */
};
