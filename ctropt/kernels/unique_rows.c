/* UniqueRows: Unique(X, axis=0, sorted=0) of int64 rows by hashing, the key dedup-user-side builds.
 *
 * dedup-user-side finds the distinct users of a batch with a Unique over the rows of their ids and histories
 * ([B, K] int64, K up to a few hundred). onnxruntime's CPU Unique with an axis sorts and compares rows through
 * generic iterators: 14–80 µs at B = 256 (1 thread), paid on every request. This kernel hashes each row once into
 * an open-addressing table and compares rows only on a hash match; a row equal to the one before it (a request's
 * candidates, one user) is not hashed.
 *
 * Node (domain "ai.ctropt.kernels", made by unique-rows-kernel):
 *   inputs   X_1 … X_n [B, K_i] (int64, n ≥ 1: the parts of the key, read as their Concat on axis 1, which is not
 *            made; UniqueRowsFloat: one float32 X, rows compared as their bits)
 *   outputs  0 Y [U, K]: the distinct rows (K = Σ K_i) in the order of their first occurrence
 *            1 indices [U]: where each first occurs   2 inverse_indices [B]: the row of Y each row of X is
 *            3 counts [U] (all int64, as ONNX Unique with axis=0, sorted=0)
 */
#include <stdio.h>

#include "kernels.h"

#define MAX_PARTS 64

typedef struct {   /* the key's rows: n parts side by side, part i [B, k[i]] */
    const int64_t *x[MAX_PARTS];
    int64_t k[MAX_PARTS], n, K;
} Rows;

/* Row b's hash: four independent multiply-xor chains over each part's columns (so they run in parallel), then
 * mixed. */
static uint64_t row_hash(const Rows *r, int64_t b) {
    const uint64_t m = 0x9e3779b97f4a7c15ULL;
    uint64_t h[4] = {(uint64_t)r->K, 0x632be59bd9b4e019ULL, 0x85ebca6bULL, 0xc2b2ae35ULL};
    for (int64_t i = 0; i < r->n; ++i) {
        const int64_t K = r->k[i], *row = r->x[i] + b * K;
        int64_t k = 0;
        for (; k + 4 <= K; k += 4)
            for (int u = 0; u < 4; ++u) h[u] = (h[u] ^ (uint64_t)row[k + u]) * m;
        for (; k < K; ++k) h[0] = (h[0] ^ (uint64_t)row[k]) * m;
    }
    uint64_t x = h[0] ^ (h[1] << 1 | h[1] >> 63) ^ (h[2] << 7 | h[2] >> 57) ^ (h[3] << 13 | h[3] >> 51);
    x ^= x >> 31;
    x *= 0xff51afd7ed558ccdULL;
    return x ^ (x >> 29);
}

static OrtStatus *output(OrtKernelContext *ctx, size_t i, const int64_t *dims, size_t rank, int64_t **data) {
    OrtValue *v;
    TRY(ort->KernelContext_GetOutput(ctx, i, dims, rank, &v));
    return ort->GetTensorMutableData(v, (void **)data);
}

/* Whether rows a and b hold the same values in every part. */
static int same_rows(const Rows *r, int64_t a, int64_t b) {
    for (int64_t i = 0; i < r->n; ++i)
        if (memcmp(r->x[i] + a * r->k[i], r->x[i] + b * r->k[i], (size_t)r->k[i] * sizeof(int64_t))) return 0;
    return 1;
}

/* first[u]: the first row of distinct row u; inverse[b]: the distinct row of row b; returns U (-1: out of memory). */
static int64_t distinct_rows(const Rows *r, int64_t B, int64_t *first, int64_t *inverse) {
    int64_t size = 16;
    while (size < 2 * B) size *= 2;
    int64_t *slot = malloc((size_t)size * sizeof(int64_t));   /* a distinct row's number, -1: empty */
    uint64_t *hashes = malloc((size_t)(B ? B : 1) * sizeof(uint64_t));
    if (!slot || !hashes) {
        free(slot);
        free(hashes);
        return -1;
    }
    memset(slot, 0xff, (size_t)size * sizeof(int64_t));
    int64_t U = 0;
    for (int64_t b = 0; b < B; ++b) {
        if (b && same_rows(r, b - 1, b)) {   /* as the row before (one user's rows) */
            inverse[b] = inverse[b - 1];
            continue;
        }
        const uint64_t h = row_hash(r, b);
        int64_t at = (int64_t)(h & (uint64_t)(size - 1));
        for (;; at = (at + 1) & (size - 1)) {
            const int64_t u = slot[at];
            if (u < 0) {   /* a new row */
                slot[at] = U;
                hashes[U] = h;
                first[U] = b;
                inverse[b] = U++;
                break;
            }
            if (hashes[u] == h && same_rows(r, first[u], b)) {
                inverse[b] = u;
                break;
            }
        }
    }
    free(slot);
    free(hashes);
    return U;
}

/* The four outputs for the [B, K] rows `r` (int64; `bits`: one part's rows as float32, compared as their bits) and
 * their distinct rows' numbers; Y is written from the rows as given (float32 where `bits`). */
static OrtStatus *unique(OrtKernelContext *ctx, const Rows *r, const float *bits, int64_t B) {
    const int64_t K = r->K;
    int64_t *first = malloc((size_t)(B ? B : 1) * sizeof(int64_t)), *inverse;
    if (!first) return ort->CreateStatus(ORT_FAIL, "UniqueRows: out of memory");
    int64_t dims[2] = {B, K};
    OrtStatus *s = output(ctx, 2, &dims[0], 1, &inverse);
    const int64_t U = s ? 0 : distinct_rows(r, B, first, inverse);
    if (!s && U < 0) s = ort->CreateStatus(ORT_FAIL, "UniqueRows: out of memory");
    int64_t *y, *indices, *counts;
    const int64_t y_dims[2] = {U, K};
    if (!s) s = output(ctx, 0, y_dims, 2, &y);   /* float32 rows where `bits`: the same bytes per element, halved */
    if (!s) s = output(ctx, 1, &U, 1, &indices);
    if (!s) s = output(ctx, 3, &U, 1, &counts);
    if (!s) {
        for (int64_t u = 0; u < U; ++u) {
            if (bits) memcpy((float *)y + u * K, bits + first[u] * K, (size_t)K * sizeof(float));
            for (int64_t i = 0, at = 0; !bits && i < r->n; at += r->k[i++])
                memcpy(y + u * K + at, r->x[i] + first[u] * r->k[i], (size_t)r->k[i] * sizeof(int64_t));
            indices[u] = first[u];
            counts[u] = 0;
        }
        for (int64_t b = 0; b < B; ++b) ++counts[inverse[b]];
    }
    free(first);
    return s;
}

/* Input i's data and dims, rank 2 (`op`: the op's name, for the message). */
static OrtStatus *read_rows(OrtKernelContext *ctx, const char *op, size_t i, const void **x, int64_t *dims) {
    size_t rank;
    char msg[64];
    snprintf(msg, sizeof msg, "%s: X must have rank 2", op);
    TRY(read_typed_input(ctx, i, x, dims, &rank, 2, msg, NULL));
    return rank == 2 ? NULL : error(msg);
}

static OrtStatus *ORT_API_CALL compute(void *kernel, OrtKernelContext *ctx) {
    (void)kernel;
    size_t n_in;
    int64_t dims[2], B = 0;
    Rows r = {.K = 0};
    TRY(ort->KernelContext_GetInputCount(ctx, &n_in));
    if (n_in < 1 || n_in > MAX_PARTS) return error("UniqueRows: 1 to 64 parts of the key");
    for (size_t i = 0; i < n_in; ++i) {
        TRY(read_rows(ctx, "UniqueRows", i, (const void **)&r.x[i], dims));
        if (i && dims[0] != B) return error("UniqueRows: the key's parts have different rows");
        B = dims[0];
        r.k[i] = dims[1];
        r.K += dims[1];
    }
    r.n = (int64_t)n_in;
    return unique(ctx, &r, NULL, B);
}

/* float32 rows: distinct by their bits (-0 and 0 apart, a NaN equal to itself): rows found equal are equal values,
 * which is what deduplication needs; each float's bits widened to an int64 word for the hashing above. */
static OrtStatus *ORT_API_CALL compute_float(void *kernel, OrtKernelContext *ctx) {
    (void)kernel;
    int64_t dims[2];
    const float *x;
    TRY(read_rows(ctx, "UniqueRowsFloat", 0, (const void **)&x, dims));
    const int64_t n = dims[0] * dims[1];
    int64_t *words = malloc((size_t)(n ? n : 1) * sizeof(int64_t));
    if (!words) return ort->CreateStatus(ORT_FAIL, "UniqueRowsFloat: out of memory");
    for (int64_t i = 0; i < n; ++i) {
        uint32_t w;
        memcpy(&w, x + i, sizeof w);
        words[i] = (int64_t)w;
    }
    const Rows r = {.x = {words}, .k = {dims[1]}, .n = 1, .K = dims[1]};
    OrtStatus *s = unique(ctx, &r, x, dims[0]);
    free(words);
    return s;
}

static const char *ORT_API_CALL name(const OrtCustomOp *op) { (void)op; return "UniqueRows"; }
static const char *ORT_API_CALL name_float(const OrtCustomOp *op) { (void)op; return "UniqueRowsFloat"; }
static size_t ORT_API_CALL n_outputs(const OrtCustomOp *op) { (void)op; return 4; }
static ONNXTensorElementDataType ORT_API_CALL float_then_int64(const OrtCustomOp *op, size_t i) {
    (void)op;
    return i == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT : ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
}

OrtCustomOp ctropt_unique_rows = CUSTOM_OP(name, int64_type, one_count, int64_type, n_outputs, variadic, required,
                                           no_attributes, compute);
OrtCustomOp ctropt_unique_rows_float = CUSTOM_OP(name_float, float_type, one_count, float_then_int64, n_outputs, required,
                                                 required, no_attributes, compute_float);
