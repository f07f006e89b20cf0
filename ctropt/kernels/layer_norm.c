/* LayerNorm: LayerNormalization over the last axis, of X or of X + R (the residual add before it), one row in
 * registers.
 *
 * Transformer blocks of CTR models normalize short rows (D = 16–64) of many tokens (B·T = 5–13 thousand at batch
 * 256): onnxruntime's CPU LayerNormalization takes about 7× a copy of its input there ([5376, 32]: 166 µs, a copy
 * 23 µs), and the residual add before it (kept apart from it by residual-add-as-sum: onnxruntime's fused
 * SkipLayerNormalization is slower still) another pass. This kernel reads each row once, adds the residual,
 * and computes the mean and then the variance from the row held in registers (widths of 8 to 64).
 *
 * Node (domain "ai.ctropt.kernels", made by layer-norm-kernel):
 *   inputs   0 X [..., D]
 *            1 scale [D]
 *            2 bias [D] (optional)
 *            3 R, X's shape (optional): the residual added to X first
 *   attributes epsilon (float)
 *   outputs  0 Y, X's shape: (S - mean(S)) / sqrt(var(S) + epsilon) · scale + bias, S = X (+ R), per row of D
 */
#include <math.h>

#include "kernels.h"

#define MAX_RANK 8
#define MAX_BLOCKS 64

typedef struct {
    float epsilon;
} Kernel;

typedef struct {
    const float *x, *r, *scale, *bias;
    float *y, *scratch, epsilon;   /* scratch: a row of S per block */
    int64_t rows, D, blocks;
} Job;

static inline float hsum(vec v) {   /* 8 lanes → 1: three shuffles and adds */
    vec h = v + __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
    h += __builtin_shufflevector(h, h, 2, 3, 0, 1, 6, 7, 4, 5);
    h += __builtin_shufflevector(h, h, 1, 0, 3, 2, 5, 4, 7, 6);
    return h[0];
}

/* Rows of N full vectors (D = 8·N ≤ 64): the row stays in registers, N a constant for each caller. */
static inline __attribute__((always_inline)) void norm_rows_in_registers(const Job *j, int64_t first, int64_t end,
                                                                         const int N) {
    vec scale[8], bias[8], s[8];
    for (int k = 0; k < N; ++k) {
        scale[k] = load(j->scale + 8 * k);
        bias[k] = j->bias ? load(j->bias + 8 * k) : (vec){0};
    }
    const float inv_d = 1.0f / (float)j->D;
    for (int64_t row = first; row < end; ++row) {
        const float *x = j->x + row * j->D;
        vec acc = {0}, sq = {0};
        for (int k = 0; k < N; ++k) {
            s[k] = load(x + 8 * k);
            if (j->r) s[k] += load(j->r + row * j->D + 8 * k);
            acc += s[k];
        }
        const float mean = hsum(acc) * inv_d;
        for (int k = 0; k < N; ++k) {
            s[k] -= mean;
            sq += s[k] * s[k];
        }
        const float inv = 1.0f / sqrtf(hsum(sq) * inv_d + j->epsilon);
        float *y = j->y + row * j->D;
        for (int k = 0; k < N; ++k) store(y + 8 * k, s[k] * inv * scale[k] + bias[k]);
    }
}

/* Any other width: S written to `s` (one row) between the passes. */
static void norm_row(const Job *j, int64_t row, float *s) {
    const float *x = j->x + row * j->D, *r = j->r ? j->r + row * j->D : NULL;
    float *y = j->y + row * j->D;
    const int64_t D = j->D, full = D - D % LANES;
    vec acc = {0};
    float total = 0.0f;
    for (int64_t k = 0; k < full; k += LANES) {
        vec v = load(x + k);
        if (r) v += load(r + k);
        store(s + k, v);
        acc += v;
    }
    for (int64_t k = full; k < D; ++k) total += s[k] = x[k] + (r ? r[k] : 0.0f);
    const float mean = (hsum(acc) + total) / (float)D;
    vec sq = {0};
    total = 0.0f;
    for (int64_t k = 0; k < full; k += LANES) {
        vec d = load(s + k) - mean;
        sq += d * d;
    }
    for (int64_t k = full; k < D; ++k) total += (s[k] - mean) * (s[k] - mean);
    const float inv = 1.0f / sqrtf((hsum(sq) + total) / (float)D + j->epsilon);
    for (int64_t k = 0; k < full; k += LANES) {
        vec v = (load(s + k) - mean) * inv * load(j->scale + k);
        if (j->bias) v += load(j->bias + k);
        store(y + k, v);
    }
    for (int64_t k = full; k < D; ++k) y[k] = (s[k] - mean) * inv * j->scale[k] + (j->bias ? j->bias[k] : 0.0f);
}

/* The widths of these models' blocks, normalized in registers (no row buffer). */
static int in_registers(int64_t D) { return D == 8 || D == 16 || D == 24 || D == 32 || D == 48 || D == 64; }

static void norm_block(void *data, size_t b) {
    const Job *j = data;
    const int64_t first = j->rows * (int64_t)b / j->blocks, end = j->rows * ((int64_t)b + 1) / j->blocks;
    switch (j->D) {
        case 8: norm_rows_in_registers(j, first, end, 1); return;
        case 16: norm_rows_in_registers(j, first, end, 2); return;
        case 24: norm_rows_in_registers(j, first, end, 3); return;
        case 32: norm_rows_in_registers(j, first, end, 4); return;
        case 48: norm_rows_in_registers(j, first, end, 6); return;
        case 64: norm_rows_in_registers(j, first, end, 8); return;
    }
    for (int64_t row = first; row < end; ++row) norm_row(j, row, j->scratch + (int64_t)b * j->D);
}

static OrtStatus *ORT_API_CALL compute(void *kernel, OrtKernelContext *ctx) {
    size_t n_in, rank, rs, rb, rr;
    int64_t dims[MAX_RANK], ds[MAX_RANK], db[MAX_RANK], dr[MAX_RANK];
    Job j = {.epsilon = ((const Kernel *)kernel)->epsilon};
    TRY(ort->KernelContext_GetInputCount(ctx, &n_in));
    TRY(read_input(ctx, n_in, 0, &j.x, dims, &rank, MAX_RANK, "LayerNorm: X has rank > 8"));
    TRY(read_input(ctx, n_in, 1, &j.scale, ds, &rs, MAX_RANK, "LayerNorm: the scale has rank > 8"));
    TRY(read_input(ctx, n_in, 2, &j.bias, db, &rb, MAX_RANK, "LayerNorm: the bias has rank > 8"));
    TRY(read_input(ctx, n_in, 3, &j.r, dr, &rr, MAX_RANK, "LayerNorm: R has rank > 8"));
    if (rank < 1) return error("LayerNorm: X needs one axis at least");
    j.D = dims[rank - 1], j.rows = 1;
    for (size_t x = 0; x + 1 < rank; ++x) j.rows *= dims[x];
    int64_t n_scale = 1, n_bias = 1;
    for (size_t x = 0; x < rs; ++x) n_scale *= ds[x];
    for (size_t x = 0; x < rb; ++x) n_bias *= db[x];
    if (!j.scale || n_scale != j.D || (j.bias && n_bias != j.D)) return error("LayerNorm: scale and bias must hold D values");
    if (j.r) {
        int same = rr == rank;
        for (size_t x = 0; same && x < rank; ++x) same = dr[x] == dims[x];
        if (!same) return error("LayerNorm: R must have X's shape");
    }
    OrtValue *y;
    TRY(ort->KernelContext_GetOutput(ctx, 0, dims, rank, &y));
    TRY(ort->GetTensorMutableData(y, (void **)&j.y));
    if (j.rows == 0 || j.D == 0) return NULL;
    j.blocks = j.rows < MAX_BLOCKS ? j.rows : MAX_BLOCKS;
    if (!in_registers(j.D)) {
        j.scratch = malloc((size_t)(j.blocks * j.D) * sizeof(float));
        if (!j.scratch) return ort->CreateStatus(ORT_FAIL, "LayerNorm: out of memory");
    }
    OrtStatus *s = ort->KernelContext_ParallelFor(ctx, norm_block, (size_t)j.blocks, 0, &j);
    free(j.scratch);
    return s;
}

static OrtStatus *ORT_API_CALL create(const OrtCustomOp *op, const OrtApi *api, const OrtKernelInfo *info,
                                      void **kernel) {
    (void)op;
    (void)api;
    Kernel *k = calloc(1, sizeof(Kernel));
    if (!k) return ort->CreateStatus(ORT_FAIL, "LayerNorm: out of memory");
    OrtStatus *s = ort->KernelInfoGetAttribute_float(info, "epsilon", &k->epsilon);
    if (s) {
        free(k);
        return s;
    }
    *kernel = k;
    return NULL;
}

static const char *ORT_API_CALL name(const OrtCustomOp *op) { (void)op; return "LayerNorm"; }
static size_t ORT_API_CALL n_inputs(const OrtCustomOp *op) { (void)op; return 4; }
static OrtCustomOpInputOutputCharacteristic ORT_API_CALL input_kind(const OrtCustomOp *op, size_t i) {
    (void)op;
    return i >= 2 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
}

OrtCustomOp ctropt_layer_norm = CUSTOM_OP(name, float_type, n_inputs, float_type, one_count, input_kind, required,
                                          create, compute);
