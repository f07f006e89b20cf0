/* DotSum: y = bias + Σₖ Xₖ·wₖ, one value per row, optionally through a sigmoid: the width-1 GEMMs of a ranker's
 * logit (wide and deep parts, FM's first order, a tower's head, a DCN cross layer's xₗ·w) in one pass.
 *
 * onnxruntime's CPU Gemm packs B and runs its GEMM kernel for N = 1 as for any N: about 3 µs for [256, 47] × [47, 1]
 * and 15 µs for [256, 221] × [221, 1], where the multiply-adds take well under a microsecond; a logit written as a
 * chain of such Gemms and a Sigmoid pays that, and a node's cost, for each. This kernel reads each row once.
 *
 * Node (domain "ai.ctropt.kernels", made by dot-sum-kernel):
 *   inputs   0 bias: one float (any shape of one element)
 *            1… pairs Xₖ [..., Kₖ] and wₖ [Kₖ] (float, k ≥ 1; a [..., 1] value added as it is: X [..., 1], w [1]);
 *              every Xₖ has the same rows (the product of its leading dims)
 *   attributes sigmoid (int, 0 or 1): y through 1 / (1 + e^-y)
 *   outputs  0 Y: X₁'s dims with the last 1
 * The sums' order differs from onnxruntime's GEMM's (each row's products summed a vector of lanes at a time); an inf
 * or a NaN in X is multiplied once, as there (a row's last LANES, read again for its tail, count its new lanes only).
 */
#include <stdio.h>

#include "kernels.h"

#define MAX_TERMS 64
#define MAX_RANK 8
#define MAX_BLOCKS 64
#define ROWS_PER_BLOCK 64   /* at least: a block's sigmoid runs on whole vectors */

typedef struct {
    int64_t sigmoid;
} DotKernel;

typedef struct {
    const float *x[MAX_TERMS], *w[MAX_TERMS];
    int64_t K[MAX_TERMS];
    vec tail[MAX_TERMS];   /* K ≥ LANES: w's last LANES, 0 where the loop of whole vectors has read x already */
    mask fresh[MAX_TERMS]; /* and those lanes of x: the others read as 0 (an inf or NaN read twice is not 0·inf) */
    int64_t terms, rows, blocks, sigmoid;
    float bias, *y;
} Job;

static inline float lanes_sum(vec v) {
    v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
    v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
    return v[0] + v[1];
}

/* A row of K floats times term t's w: whole vectors, then the row's last LANES (its fresh lanes, the others 0) times
 * the tail (K ≥ LANES), or one by one (K < LANES). */
static inline float dot(const Job *j, int64_t t, const float *x) {
    const int64_t K = j->K[t];
    const float *w = j->w[t];
    if (K < LANES) {
        float s = 0;
        for (int64_t k = 0; k < K; ++k) s += x[k] * w[k];
        return s;
    }
    vec acc = load(x) * load(w);
    int64_t k = LANES;
    for (; k + LANES <= K; k += LANES) acc += load(x + k) * load(w + k);
    if (k < K) acc += pick(j->fresh[t], load(x + K - LANES), splat(0.0f)) * j->tail[t];
    return lanes_sum(acc);
}

static void dot_block(void *data, size_t b) {
    Job *j = data;
    const int64_t first = j->rows * (int64_t)b / j->blocks, end = j->rows * ((int64_t)b + 1) / j->blocks;
    for (int64_t r = first; r < end; ++r) {
        float s = j->bias;
        for (int64_t t = 0; t < j->terms; ++t) s += dot(j, t, j->x[t] + r * j->K[t]);
        j->y[r] = s;
    }
    if (!j->sigmoid) return;
    int64_t r = first;
    for (; r + LANES <= end; r += LANES) store(j->y + r, sigmoid_vec(load(j->y + r)));
    if (r < end) {   /* the rest through a vector of their own */
        vec v = {0};
        memcpy(&v, j->y + r, (size_t)(end - r) * sizeof(float));
        v = sigmoid_vec(v);
        memcpy(j->y + r, &v, (size_t)(end - r) * sizeof(float));
    }
}

/* Term t's X (input 2t + 1) and w (input 2t + 2) into the job; X₁'s dims into out (its last made 1). */
static OrtStatus *read_term(OrtKernelContext *ctx, Job *j, int64_t t, int64_t *out, size_t *ro) {
    int64_t dx[MAX_RANK], dw[MAX_RANK], rows = 1, n = 1;
    size_t rx, rw;
    TRY(read_input(ctx, (size_t)(2 * t + 3), (size_t)(2 * t + 1), &j->x[t], dx, &rx, MAX_RANK, "DotSum: an X has rank > 8"));
    TRY(read_input(ctx, (size_t)(2 * t + 3), (size_t)(2 * t + 2), &j->w[t], dw, &rw, MAX_RANK, "DotSum: a w has rank > 8"));
    if (rx < 1) return error("DotSum: an X is a scalar");   /* data NULL: empty (onnxruntime's own empty values) */
    for (size_t a = 0; a + 1 < rx; ++a) rows *= dx[a];
    for (size_t a = 0; a < rw; ++a) n *= dw[a];
    j->K[t] = dx[rx - 1];
    if (n != j->K[t]) return error("DotSum: a w's size is not its X's last dim");
    const int64_t K = j->K[t], fresh = K % LANES;   /* the tail's new columns */
    for (int l = 0; l < LANES; ++l) {
        j->fresh[t][l] = K >= LANES && l >= LANES - fresh ? -1 : 0;
        j->tail[t][l] = j->fresh[t][l] ? j->w[t][K - LANES + l] : 0.0f;
    }
    if (t == 0) {
        j->rows = rows, *ro = rx;
        memcpy(out, dx, rx * sizeof(int64_t));
        out[rx - 1] = 1;
    } else if (rows != j->rows) {
        return error("DotSum: the Xs' rows differ");
    }
    return NULL;
}

static OrtStatus *ORT_API_CALL compute(void *kernel, OrtKernelContext *ctx) {
    size_t n_in, rb, ro = 0;
    int64_t db[MAX_RANK], out[MAX_RANK], nb = 1;
    const float *bias;
    Job j = {.sigmoid = ((DotKernel *)kernel)->sigmoid};
    TRY(ort->KernelContext_GetInputCount(ctx, &n_in));
    if (n_in < 3 || n_in % 2 == 0 || (n_in - 1) / 2 > MAX_TERMS) return error("DotSum: a bias and 1 to 64 pairs X, w");
    TRY(read_input(ctx, n_in, 0, &bias, db, &rb, MAX_RANK, "DotSum: the bias has rank > 8"));
    for (size_t a = 0; a < rb; ++a) nb *= db[a];
    if (!bias || nb != 1) return error("DotSum: the bias must be one value");
    j.bias = bias[0];
    j.terms = (int64_t)(n_in - 1) / 2;
    for (int64_t t = 0; t < j.terms; ++t) TRY(read_term(ctx, &j, t, out, &ro));
    OrtValue *y;
    TRY(ort->KernelContext_GetOutput(ctx, 0, out, ro, &y));
    TRY(ort->GetTensorMutableData(y, (void **)&j.y));
    if (j.rows == 0) return NULL;
    j.blocks = (j.rows + ROWS_PER_BLOCK - 1) / ROWS_PER_BLOCK;
    j.blocks = j.blocks < MAX_BLOCKS ? j.blocks : MAX_BLOCKS;
    return ort->KernelContext_ParallelFor(ctx, dot_block, (size_t)j.blocks, 0, &j);
}

static OrtStatus *ORT_API_CALL create(const OrtCustomOp *op, const OrtApi *api, const OrtKernelInfo *info,
                                      void **kernel) {
    (void)op;
    (void)api;
    DotKernel *k = calloc(1, sizeof(DotKernel));
    if (!k) return ort->CreateStatus(ORT_FAIL, "DotSum: out of memory");
    k->sigmoid = int_attribute(info, "sigmoid", 0);
    *kernel = k;
    return NULL;
}

static const char *ORT_API_CALL name(const OrtCustomOp *op) { (void)op; return "DotSum"; }

OrtCustomOp ctropt_dot_sum = CUSTOM_OP(name, float_type, one_count, float_type, one_count, variadic, required, create,
                                       compute);
