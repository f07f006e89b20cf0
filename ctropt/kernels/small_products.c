/* SumAxes and SmallMatMul: sums and products of many small matrices, one kernel call for the whole batch.
 *
 * onnxruntime's CPU ReduceSum over a middle axis ([A, R, C] summed over R, C > 1 or trailing axes of 1) and its MatMul
 * of batched operands run one sgemm call per matrix: for the pooling of a CTR model's fields or history
 * (R = 5–50, C = 1–16) or an MMoE gate's weighted sum of experts ([1, E] × [E, D] per row), the calls' overhead is
 * the whole cost (ReduceSum of [256, 50, 8] over axis 1: about 45 µs; of [256, 26, 1]: about 40 µs). These kernels
 * loop over the batch themselves, LANES columns at a time.
 *
 * Nodes (domain "ai.ctropt.kernels", made by small-products-kernel):
 *   SumAxes     input X (float); attributes axis, count, keepdims (ints): the sum over the `count` axes from `axis`,
 *               as ReduceSum(X, axes = [axis, axis + count)) with keepdims.
 *   SmallMatMul inputs A [..., M, K], B [..., K, N] (float, rank 2 and more; the leading axes broadcast as numpy's):
 *               Y [..., M, N], as MatMul(A, B).
 * The rounding differs from onnxruntime's only by the order of the sums.
 */
#include "kernels.h"

#define MAX_RANK 8
#define MAX_BLOCKS 64

/* ---------------------------------------------------------------------------------------------- SumAxes */

typedef struct {
    int64_t axis, count, keepdims;
} SumKernel;

typedef struct {
    const float *x;
    float *y;
    int64_t rows, R, C, blocks;
} SumJob;

/* y[0..C) = the sum over r < R of x[r·C + c], for C dividing LANES: the R·C floats summed a vector at a time (each lane
 * keeps one column, as LANES is a multiple of C), then the lanes of each column added. */
static void sum_narrow(const float *x, int64_t R, int64_t C, float *y) {
    const int64_t n = R * C, full = n / LANES * LANES;
    vec acc[4] = {{0}, {0}, {0}, {0}};
    int64_t i = 0;
    for (; i + 4 * LANES <= full; i += 4 * LANES)
        for (int u = 0; u < 4; ++u) acc[u] += load(x + i + u * LANES);
    for (; i < full; i += LANES) acc[0] += load(x + i);
    vec total = acc[0] + acc[1] + acc[2] + acc[3];
    float s[LANES] = {0};   /* the columns' sums in registers: y written once (a chain of adds through y stalls) */
    for (int l = 0; l < LANES; ++l) s[l & (C - 1)] += total[l];   /* C divides LANES: a power of 2 */
    for (; i < n; ++i) s[i & (C - 1)] += x[i];
    for (int64_t c = 0; c < C; ++c) y[c] = s[c];
}

/* y[0..C) = the sum over r < R of x[r·C + c]: LANES columns at a time, four rows in flight. */
static void sum_wide(const float *x, int64_t R, int64_t C, float *y) {
    int64_t c = 0;
    for (; c + LANES <= C; c += LANES) {
        vec acc[4] = {{0}, {0}, {0}, {0}};
        int64_t r = 0;
        for (; r + 4 <= R; r += 4)
            for (int u = 0; u < 4; ++u) acc[u] += load(x + (r + u) * C + c);
        for (; r < R; ++r) acc[0] += load(x + r * C + c);
        store(y + c, acc[0] + acc[1] + acc[2] + acc[3]);
    }
    for (; c < C; ++c) {
        float s = 0.0f;
        for (int64_t r = 0; r < R; ++r) s += x[r * C + c];
        y[c] = s;
    }
}

static void sum_block(void *data, size_t b) {
    const SumJob *j = data;
    const int narrow = j->C < LANES && LANES % j->C == 0;
    for (int64_t a = j->rows * (int64_t)b / j->blocks; a < j->rows * ((int64_t)b + 1) / j->blocks; ++a) {
        const float *x = j->x + a * j->R * j->C;
        if (narrow)
            sum_narrow(x, j->R, j->C, j->y + a * j->C);
        else
            sum_wide(x, j->R, j->C, j->y + a * j->C);
    }
}

static OrtStatus *ORT_API_CALL sum_compute(void *kernel, OrtKernelContext *ctx) {
    const SumKernel *k = kernel;
    size_t n_in, rank;
    int64_t d[MAX_RANK], out[MAX_RANK];
    const float *x;
    TRY(ort->KernelContext_GetInputCount(ctx, &n_in));
    TRY(read_input(ctx, n_in, 0, &x, d, &rank, MAX_RANK, "SumAxes: the input has rank > 8"));
    if (k->axis + k->count > (int64_t)rank) return error("SumAxes: the axes go past the input's rank");
    SumJob j = {.rows = 1, .R = 1, .C = 1};
    size_t out_rank = 0;
    for (size_t a = 0; a < rank; ++a) {
        const int summed = (int64_t)a >= k->axis && (int64_t)a < k->axis + k->count;
        if (summed) j.R *= d[a];
        else if ((int64_t)a < k->axis) j.rows *= d[a];
        else j.C *= d[a];
        if (!summed) out[out_rank++] = d[a];
        else if (k->keepdims) out[out_rank++] = 1;
    }
    OrtValue *y;
    TRY(ort->KernelContext_GetOutput(ctx, 0, out, out_rank, &y));
    TRY(ort->GetTensorMutableData(y, (void **)&j.y));
    j.x = x;
    if (j.rows == 0 || j.C == 0) return NULL;
    if (j.R == 0) {
        memset(j.y, 0, (size_t)(j.rows * j.C) * sizeof(float));
        return NULL;
    }
    j.blocks = j.rows < MAX_BLOCKS ? j.rows : MAX_BLOCKS;
    return ort->KernelContext_ParallelFor(ctx, sum_block, (size_t)j.blocks, 0, &j);
}

static OrtStatus *ORT_API_CALL sum_create(const OrtCustomOp *op, const OrtApi *api, const OrtKernelInfo *info,
                                          void **kernel) {
    (void)op;
    (void)api;
    SumKernel *k = calloc(1, sizeof(SumKernel));
    if (!k) return ort->CreateStatus(ORT_FAIL, "SumAxes: out of memory");
    OrtStatus *s = ort->KernelInfoGetAttribute_int64(info, "axis", &k->axis);
    if (!s) s = ort->KernelInfoGetAttribute_int64(info, "count", &k->count);
    if (!s) s = ort->KernelInfoGetAttribute_int64(info, "keepdims", &k->keepdims);
    if (!s && (k->axis < 0 || k->count < 1)) s = error("SumAxes: axis must be >= 0 and count >= 1");
    if (s) {
        free(k);
        return s;
    }
    *kernel = k;
    return NULL;
}

/* ---------------------------------------------------------------------------------------------- SmallMatMul */

typedef struct {
    const float *a, *b;
    float *y;
    int64_t M, K, N, batches, blocks, lead_rank;
    int64_t lead[MAX_RANK], as[MAX_RANK], bs[MAX_RANK];   /* the output's leading axes; A's and B's strides (0: broadcast) */
} MatJob;

/* y[m] = a[m, :] · b[:, 0] (N = 1): LANES of K at a time where K has as many. */
static void product_column(const float *restrict a, const float *restrict b, float *restrict y, int64_t M, int64_t K) {
    for (int64_t m = 0; m < M; ++m) {
        const float *am = a + m * K;
        float s = 0.0f;
        int64_t k = 0;
        if (K >= LANES) {
            vec acc = {0};
            for (; k + LANES <= K; k += LANES) acc += load(am + k) * load(b + k);
            for (int l = 0; l < LANES; ++l) s += acc[l];
        }
        for (; k < K; ++k) s += am[k] * b[k];
        y[m] = s;
    }
}

/* Rows m0 .. m0 + rows (at most 4) of y = a × b, columns n .. n + LANES: one accumulator per row, so the rows' sums
 * run in parallel (a lone row splits its sum in four). */
static inline void product_lanes(const float *restrict a, const float *restrict b, float *restrict y, int64_t m0,
                                 int rows, int64_t n, int64_t K, int64_t N) {
    vec s[4] = {{0}, {0}, {0}, {0}};
    int64_t k = 0;
    if (rows == 1) {   /* one row (a weighted sum of B's rows): four of K at a time, into four sums */
        for (; k + 4 <= K; k += 4)
            for (int u = 0; u < 4; ++u) s[u] += ((vec){0} + a[m0 * K + k + u]) * load(b + (k + u) * N + n);
        s[0] += s[1] + s[2] + s[3];
    }
    for (; k < K; ++k) {
        const vec bk = load(b + k * N + n);
        for (int r = 0; r < rows; ++r) s[r] += ((vec){0} + a[(m0 + r) * K + k]) * bk;
    }
    for (int r = 0; r < rows; ++r) store(y + (m0 + r) * N + n, s[r]);
}

/* y = a [M, K] × b [K, N]: LANES columns of up to four rows at a time, the last columns one by one. */
static void product(const float *restrict a, const float *restrict b, float *restrict y, int64_t M, int64_t K,
                    int64_t N) {
    if (K == 1 && N == 1) {
        for (int64_t m = 0; m < M; ++m) y[m] = a[m] * b[0];
        return;
    }
    if (K == 1) {   /* an outer product */
        for (int64_t m = 0; m < M; ++m)
            for (int64_t n = 0; n < N; ++n) y[m * N + n] = a[m] * b[n];
        return;
    }
    if (N == 1) {
        product_column(a, b, y, M, K);
        return;
    }
    int64_t n = 0;
    for (; n + LANES <= N; n += LANES) {
        int64_t m = 0;
        for (; m + 4 <= M; m += 4) product_lanes(a, b, y, m, 4, n, K, N);
        if (m < M) product_lanes(a, b, y, m, (int)(M - m), n, K, N);
    }
    for (; n < N; ++n)
        for (int64_t m = 0; m < M; ++m) {
            float s = 0.0f;
            for (int64_t k = 0; k < K; ++k) s += a[m * K + k] * b[k * N + n];
            y[m * N + n] = s;
        }
}

static void product_block(void *data, size_t blk) {
    const MatJob *j = data;
    const int64_t first = j->batches * (int64_t)blk / j->blocks, end = j->batches * ((int64_t)blk + 1) / j->blocks;
    int64_t at[MAX_RANK], a_off = 0, b_off = 0;
    for (int64_t x = j->lead_rank - 1, rest = first; x >= 0; --x) {   /* the first batch's index, axis by axis */
        at[x] = rest % j->lead[x];
        rest /= j->lead[x];
        a_off += at[x] * j->as[x];
        b_off += at[x] * j->bs[x];
    }
    for (int64_t i = first; i < end; ++i) {
        product(j->a + a_off, j->b + b_off, j->y + i * j->M * j->N, j->M, j->K, j->N);
        for (int64_t x = j->lead_rank - 1; x >= 0; --x) {   /* the next index: the last axis first, carrying */
            a_off += j->as[x];
            b_off += j->bs[x];
            if (++at[x] < j->lead[x]) break;
            a_off -= at[x] * j->as[x];
            b_off -= at[x] * j->bs[x];
            at[x] = 0;
        }
    }
}

/* The leading axes of A (rank ra) and B (rank rb) broadcast into the job, with their element strides. */
static OrtStatus *broadcast(MatJob *j, const int64_t *da, size_t ra, const int64_t *db, size_t rb, int64_t *out) {
    const size_t la = ra - 2, lb = rb - 2, lead = la > lb ? la : lb;
    int64_t sa = j->M * j->K, sb = j->K * j->N;
    j->lead_rank = (int64_t)lead;
    j->batches = 1;
    for (size_t x = lead; x-- > 0;) {
        const int64_t ea = x + la >= lead ? da[x + la - lead] : 1, eb = x + lb >= lead ? db[x + lb - lead] : 1;
        if (ea != eb && ea != 1 && eb != 1) return error("SmallMatMul: the leading axes of A and B do not broadcast");
        j->lead[x] = out[x] = ea == 1 ? eb : ea;
        j->as[x] = ea == 1 ? 0 : sa;
        j->bs[x] = eb == 1 ? 0 : sb;
        sa *= ea;
        sb *= eb;
        j->batches *= j->lead[x];
    }
    return NULL;
}

static OrtStatus *ORT_API_CALL product_compute(void *kernel, OrtKernelContext *ctx) {
    (void)kernel;
    size_t n_in, ra, rb;
    int64_t da[MAX_RANK], db[MAX_RANK], out[MAX_RANK];
    MatJob j;
    TRY(ort->KernelContext_GetInputCount(ctx, &n_in));
    TRY(read_input(ctx, n_in, 0, &j.a, da, &ra, MAX_RANK, "SmallMatMul: A has rank > 8"));
    TRY(read_input(ctx, n_in, 1, &j.b, db, &rb, MAX_RANK, "SmallMatMul: B has rank > 8"));
    if (ra < 2 || rb < 2) return error("SmallMatMul: A and B need two axes at least");
    j.M = da[ra - 2], j.K = da[ra - 1], j.N = db[rb - 1];
    if (db[rb - 2] != j.K) return error("SmallMatMul: A's columns differ from B's rows");
    TRY(broadcast(&j, da, ra, db, rb, out));
    out[j.lead_rank] = j.M;
    out[j.lead_rank + 1] = j.N;
    OrtValue *y;
    TRY(ort->KernelContext_GetOutput(ctx, 0, out, (size_t)j.lead_rank + 2, &y));
    TRY(ort->GetTensorMutableData(y, (void **)&j.y));
    if (j.batches == 0 || j.M == 0 || j.N == 0) return NULL;
    if (j.K == 0) {
        memset(j.y, 0, (size_t)(j.batches * j.M * j.N) * sizeof(float));
        return NULL;
    }
    j.blocks = j.batches < MAX_BLOCKS ? j.batches : MAX_BLOCKS;
    return ort->KernelContext_ParallelFor(ctx, product_block, (size_t)j.blocks, 0, &j);
}

/* ---------------------------------------------------------------------------------------------- registration */

static const char *ORT_API_CALL sum_name(const OrtCustomOp *op) { (void)op; return "SumAxes"; }
static const char *ORT_API_CALL product_name(const OrtCustomOp *op) { (void)op; return "SmallMatMul"; }
static size_t ORT_API_CALL n_two(const OrtCustomOp *op) { (void)op; return 2; }

OrtCustomOp ctropt_sum_axes = CUSTOM_OP(sum_name, float_type, one_count, float_type, one_count, required, required, sum_create,
                                         sum_compute);

OrtCustomOp ctropt_small_matmul = CUSTOM_OP(product_name, float_type, n_two, float_type, one_count, required, required,
                                             no_attributes, product_compute);
