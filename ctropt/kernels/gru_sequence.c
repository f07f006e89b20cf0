/* ctropt's onnxruntime kernel library: GRUScan runs a whole GRU-family layer (input projection included) in one
 * kernel.
 *
 * Node (domain "ai.ctropt.kernels", made by lower-rnn-ort with rnn_ort_form=kernel):
 *   inputs   0 X [B, T, I]
 *            1 W [I, 3H], 2 R [H, 3H]  input and hidden weights, columns g, r, n (g: see "mode")
 *            3 bias [3H]      added to x·W (the hidden biases of g and r, and of n unless linear_before_reset)
 *            4 Rn_bias [H]    hidden bias of n (linear_before_reset only)                          optional
 *            5 h0 [B, H]      initial state                                                        optional
 *            6 f  [B, T]      per-step attention factor (att, or 1 - att)                          optional
 *            7 lengths [B]    int64: steps t >= lengths[b] keep the state (any length: read as clamped to
 *                             [0, T], as a Scan/Loop's masking does, unless check_lengths)         optional
 *            8 mask [B, T]    float: steps with mask == 0 keep the state (instead of lengths)      optional
 *   outputs  0 Y_h [B, H]     the state after the last valid step
 *            1 Y [B, T, H]    every state (0 at masked steps if padded_output_zero, else the kept state)
 *   attributes hidden_size, linear_before_reset, padded_output_zero,
 *            check_lengths (optional, 0): 1 = a length outside [0, T] is an error, as in the ONNX GRU op the
 *                  layer was read from (its message),
 *            mode: the candidate's weight c in h' = h + c (n - h), with g = sigmoid(x·W_g + h·R_g + bias_g):
 *                  0: c = g (GRU: g is u = 1 - z)   1: c = g f (AUGRU)   2: c = 1 - g f (AUGRU scaling the
 *                  keep gate: g = z, f = 1 - att)   3: c = f (AGRU)   4: c = g, x scaled by f (AIGRU)
 *
 * Rows are independent over the whole sequence, so the kernel runs blocks of ROWS rows from the first step to
 * the block's last valid one (rows sorted by it), with W and R in cache; blocks are spread over onnxruntime's
 * intra-op threads. Steps after a row's last valid one cost nothing, and neither does their input projection (nor,
 * for AIGRU, that of steps after the row's last nonzero factor whose x is finite: their x is scaled to 0; an inf or a
 * NaN scaled by 0 is NaN, as in the op).
 * Each gate's columns start at a multiple of LANES (G = H rounded up, zero weights in between), so a row's update
 * runs LANES columns at a time (AIGRU scales each row of x·W by its factor first).
 */
#include <math.h>

#include "kernels.h"

#define ROWS 6
#define MAX_H 4096
#define MAX_I 4096

typedef struct {
    int64_t hidden, lbr, zero_pad, mode, check_lens;
} Kernel;


static inline vec activate(vec x, int sigmoid) { return sigmoid ? sigmoid_vec(x) : tanh_vec(x); }

typedef struct {
    const Kernel *k;
    int64_t B, T, H, G, HP, NP;   /* G: H rounded up to LANES (each gate's columns); HP, NP: 3G and H rounded up to
                                   * 2 LANES */
    int64_t I;
    const float *x, *bias, *h0, *f, *mask;
    const int64_t *lens;
    int64_t *steps;               /* per row: 1 + its last valid step (no step after it changes the state) */
    int64_t *fed;                 /* AIGRU, per row: 1 + its last step with f != 0 (after it x is scaled to 0) */
    int64_t *order;               /* rows by steps, most first (AIGRU: then by fed) */
    float *Wp, *Rp, *Rnp, *Bp, *rbnp, *yh, *y; /* W, R, bias: each gate's columns at k G, rows of HP; R's n columns
                                               * in rows of NP; Rn_bias padded to G */
    float *scratch;
    int64_t scratch_floats;       /* per block */
} Job;

static int valid(const Job *j, int64_t b, int64_t t) {
    if (j->mask) return j->mask[b * j->T + t] != 0.0f;
    if (j->lens) return t < j->lens[b];
    return 1;
}

static int64_t steps_of(const Job *j, int64_t b) {
    int64_t n = j->T;
    if (j->mask)
        while (n > 0 && j->mask[b * j->T + n - 1] == 0.0f) --n;
    else if (j->lens)
        n = j->lens[b] < 0 ? 0 : (j->lens[b] < n ? j->lens[b] : n);
    return n;
}

/* all_finite: kernels.h */
/* AIGRU: steps from fed[b] on read f x = 0, so x·W is 0 there: f = 0 and x finite (0 times an inf or a NaN is
 * NaN, which the step then reads, as the op's Mul makes it). */
static int64_t fed_of(const Job *j, int64_t b, int64_t steps) {
    int64_t n = steps;
    while (n > 0 && j->f[b * j->T + n - 1] == 0.0f && all_finite(j->x + (b * j->T + n - 1) * j->I, j->I)) --n;
    return n;
}

/* out[r][0:width] = v[r][0:K] · M[:, 0:width] (M: [K, P], out rows P apart; width a multiple of 2 LANES, at most P)
 * for ROWS rows: 2 x ROWS vector accumulators, started at init[0:width] when given (the bias). */
static void rows_times(const float *const v[ROWS], int64_t K, const float *M, int64_t P, int64_t width, float *out,
                       const float *init) {
    for (int64_t j = 0; j < width; j += 2 * LANES) {
        vec a[ROWS][2] = {{{0}}};
        if (init)
            for (int r = 0; r < ROWS; ++r) a[r][0] = load(init + j), a[r][1] = load(init + j + LANES);
        for (int64_t k = 0; k < K; ++k) {
            vec w0 = load(M + k * P + j), w1 = load(M + k * P + j + LANES);
            for (int r = 0; r < ROWS; ++r) {
                float vk = v[r][k];
                a[r][0] += vk * w0;
                a[r][1] += vk * w1;
            }
        }
        for (int r = 0; r < ROWS; ++r) {
            store(out + r * P + j, a[r][0]);
            store(out + r * P + j + LANES, a[r][1]);
        }
    }
}

/* The same for the first n < ROWS rows of a block (small batches, the last block): row by row, two chains over k
 * so that four accumulators hide the FMA latency. */
static void few_rows_times(const float *const v[ROWS], int n, int64_t K, const float *M, int64_t P, int64_t width,
                           float *out, const float *init) {
    for (int r = 0; r < n; ++r)
        for (int64_t j = 0; j < width; j += 2 * LANES) {
            vec a0 = {0}, a1 = {0}, b0 = {0}, b1 = {0};
            if (init) a0 = load(init + j), a1 = load(init + j + LANES);
            int64_t k = 0;
            for (; k + 1 < K; k += 2) {
                a0 += v[r][k] * load(M + k * P + j);
                a1 += v[r][k] * load(M + k * P + j + LANES);
                b0 += v[r][k + 1] * load(M + (k + 1) * P + j);
                b1 += v[r][k + 1] * load(M + (k + 1) * P + j + LANES);
            }
            if (k < K) {
                a0 += v[r][k] * load(M + k * P + j);
                a1 += v[r][k] * load(M + k * P + j + LANES);
            }
            store(out + r * P + j, a0 + b0);
            store(out + r * P + j + LANES, a1 + b1);
        }
}

static void times(const float *const v[ROWS], int n, int64_t K, const float *M, int64_t P, int64_t width, float *out,
                  const float *init) {
    if (n == ROWS) rows_times(v, K, M, P, width, out, init);
    else few_rows_times(v, n, K, M, P, width, out, init);
}

/* One step of one row with linear_before_reset, in one pass over the row's G columns (padding lanes stay 0):
 * g = sigmoid(gx_g + a_g), r = sigmoid(gx_r + a_r), n = tanh(gx_n + r (a_n + Rn_bias)), h += c(g) (n - h). */
static void update_lbr(const Job *j, const float *restrict gx, const float *restrict a, float f, float *restrict h) {
    const int64_t G = j->G;
    const int mode = (int)j->k->mode;
    const vec fv = (vec){0} + f;
    for (int64_t c = 0; c < G; c += LANES) {
        vec g = activate(load(gx + c) + load(a + c), 1);
        vec r = activate(load(gx + G + c) + load(a + G + c), 1);
        vec n = activate(load(gx + 2 * G + c) + r * (load(a + 2 * G + c) + load(j->rbnp + c)), 0);
        if (mode == 1) g = g * fv;
        else if (mode == 2) g = 1.0f - g * fv;
        else if (mode == 3) g = fv;
        vec hv = load(h + c);
        store(h + c, hv + g * (n - hv));
    }
}

/* Without linear_before_reset: the gates and r h in one pass (before (r h)·Rn),
 * then the candidate and the blend in one pass. */
static void gates_r_h(const Job *j, const float *restrict gx, const float *restrict a, float *restrict g,
                      const float *restrict h, float *restrict rh) {
    const int64_t G = j->G;
    for (int64_t c = 0; c < G; c += LANES) {
        store(g + c, activate(load(gx + c) + load(a + c), 1));
        store(rh + c, activate(load(gx + G + c) + load(a + G + c), 1) * load(h + c));
    }
}

static void update_rn(const Job *j, const float *restrict gx, const float *restrict an, const float *restrict g,
                      float f, float *restrict h) {
    const int64_t G = j->G;
    const int mode = (int)j->k->mode;
    const vec fv = (vec){0} + f;
    for (int64_t c = 0; c < G; c += LANES) {
        vec n = activate(load(gx + 2 * G + c) + load(an + c), 0), gv = load(g + c);
        if (mode == 1) gv = gv * fv;
        else if (mode == 2) gv = 1.0f - gv * fv;
        else if (mode == 3) gv = fv;
        vec hv = load(h + c);
        store(h + c, hv + gv * (n - hv));
    }
}

static void run_block(void *data, size_t block) {
    const Job *j = data;
    const int64_t H = j->H, G = j->G, I = j->I, HP = j->HP, NP = j->NP, T = j->T, B = j->B;
    const int mode = (int)j->k->mode, lbr = (int)j->k->lbr;
    const int64_t GP = (2 * G + 2 * LANES - 1) / (2 * LANES) * (2 * LANES);   /* the gates' columns, padded */
    int64_t rows[ROWS];
    static const float zeros[MAX_I] = {0};
    float *h = j->scratch + block * j->scratch_floats;   /* this block's: [ROWS] each of h, rh, accn, gx, acc, g */
    float *rh = h + ROWS * G, *accn = rh + ROWS * G, *gx = accn + ROWS * NP, *acc = gx + ROWS * HP, *g = acc + ROWS * HP;
    const float *xs[ROWS], *hs[ROWS], *rhs[ROWS];
    int n = 0;   /* the block's rows: the first n of rows[] (only the last block has fewer than ROWS) */
    for (int r = 0; r < ROWS; ++r) {
        int64_t i = (int64_t)block * ROWS + r;
        rows[r] = i < B ? j->order[i] : -1;
        n += i < B;
        memset(h + r * G, 0, G * sizeof(float));
        if (rows[r] >= 0 && j->h0) memcpy(h + r * G, j->h0 + rows[r] * H, H * sizeof(float));
        memset(rh + r * G, 0, G * sizeof(float));
        hs[r] = h + r * G;
        rhs[r] = rh + r * G;
        xs[r] = zeros;
    }
    const int64_t last = rows[0] >= 0 ? j->steps[rows[0]] : 0;   /* the block's most (rows are sorted) */
    int64_t fed = last;   /* AIGRU: from this step on every row of the block reads x scaled to 0 */
    if (mode == 4) {
        fed = 0;
        for (int r = 0; r < n; ++r) fed = j->fed[rows[r]] > fed ? j->fed[rows[r]] : fed;
    }
    for (int64_t t = 0; t < last; ++t) {
        for (int r = 0; r < ROWS; ++r)
            if (rows[r] >= 0) xs[r] = j->x + (rows[r] * T + t) * I;
        if (t >= fed) {   /* 0·W + bias */
            for (int r = 0; r < ROWS; ++r) memcpy(gx + r * HP, j->Bp, HP * sizeof(float));
        } else {
            times(xs, n, I, j->Wp, HP, HP, gx, mode == 4 ? NULL : j->Bp);   /* the bias starts the accumulators */
        }
        for (int r = 0; r < ROWS && mode == 4 && t < fed; ++r) {   /* AIGRU: (f x)·W + bias = f (x·W) + bias */
            if (rows[r] < 0) continue;
            const float f = j->f[rows[r] * T + t];
            float *restrict x = gx + r * HP;
            for (int64_t c = 0; c < HP; ++c) x[c] = x[c] * f + j->Bp[c];
        }
        times(hs, n, H, j->Rp, HP, lbr ? HP : GP, acc, NULL);   /* without lbr, h·R_n is not read */
        for (int r = 0; r < ROWS && !lbr; ++r)
            if (rows[r] >= 0) gates_r_h(j, gx + r * HP, acc + r * HP, g + r * 3 * G, h + r * G, rh + r * G);
        if (!lbr) times(rhs, n, H, j->Rnp, NP, NP, accn, NULL);   /* the candidate reads (r * h) · Rn */
        for (int r = 0; r < ROWS; ++r) {
            int64_t b = rows[r];
            if (b < 0 || !valid(j, b, t)) continue;
            const float f = j->f && mode != 4 ? j->f[b * T + t] : 1.0f;
            if (lbr) update_lbr(j, gx + r * HP, acc + r * HP, f, h + r * G);
            else update_rn(j, gx + r * HP, accn + r * NP, g + r * 3 * G, f, h + r * G);
        }
        if (j->y) {
            for (int r = 0; r < ROWS; ++r) {
                int64_t b = rows[r];
                if (b < 0) continue;
                float *yt = j->y + (b * T + t) * H;
                if (valid(j, b, t) || !j->k->zero_pad) memcpy(yt, h + r * G, H * sizeof(float));
                else memset(yt, 0, H * sizeof(float));
            }
        }
    }
    for (int r = 0; r < ROWS; ++r) {
        int64_t b = rows[r];
        if (b < 0) continue;
        memcpy(j->yh + b * H, h + r * G, H * sizeof(float));
        if (j->y)
            for (int64_t t = last; t < T; ++t) {
                float *yt = j->y + (b * T + t) * H;
                if (j->k->zero_pad) memset(yt, 0, H * sizeof(float));
                else memcpy(yt, h + r * G, H * sizeof(float));
            }
    }
}

/* out = the rows (taken in the order `in`, or 0..B-1) sorted by key[b] in [0, T], most first; stable (a counting
 * sort; first: T + 2 scratch counters). */
static void sort_rows(const int64_t *key, const int64_t *in, int64_t B, int64_t T, int64_t *first, int64_t *out) {
    memset(first, 0, ((size_t)T + 2) * sizeof(int64_t));
    for (int64_t b = 0; b < B; ++b) ++first[T - key[b] + 1];
    for (int64_t i = 1; i <= T + 1; ++i) first[i] += first[i - 1];
    for (int64_t i = 0; i < B; ++i) {
        int64_t b = in ? in[i] : i;
        out[first[T - key[b]]++] = b;
    }
}

/* ---------------------------------------------------------------------------------------------- plumbing */

/* M [K, C] with its columns from `from` to `from + C'` copied into [K, P] (zero padding). */
static void pad_columns(float *out, const float *M, int64_t K, int64_t C, int64_t from, int64_t width, int64_t P) {
    for (int64_t r = 0; r < K; ++r) memcpy(out + r * P, M + r * C + from, (size_t)width * sizeof(float));
}

#define N_IN 9

static OrtStatus *ORT_API_CALL compute(void *kernel, OrtKernelContext *ctx) {
    const Kernel *k = kernel;
    size_t n_in, rank[N_IN];
    int64_t d[N_IN][3];
    const float *in[N_IN];
    TRY(ort->KernelContext_GetInputCount(ctx, &n_in));
    for (size_t i = 0; i < N_IN; ++i) TRY(read_input(ctx, n_in, i, &in[i], d[i], &rank[i], 3, "GRUScan: an input has rank > 3"));
    const int64_t H = k->hidden, B = d[0][0], T = d[0][1], I = d[0][2];
    if (H < 1 || H > MAX_H) return error("GRUScan: hidden_size must be in 1..4096");
    if (rank[0] != 3 || I < 1 || I > MAX_I) return error("GRUScan: X must be [B, T, I] with I in 1..4096");
    if (rank[1] != 2 || d[1][0] != I || d[1][1] != 3 * H) return error("GRUScan: W must be [I, 3H]");
    if (rank[2] != 2 || d[2][0] != H || d[2][1] != 3 * H) return error("GRUScan: R must be [H, 3H]");
    if (rank[3] != 1 || d[3][0] != 3 * H) return error("GRUScan: bias must be [3H]");
    if (k->lbr && (!in[4] || d[4][0] != H)) return error("GRUScan: linear_before_reset needs Rn_bias [H]");
    if (in[5] && (rank[5] != 2 || d[5][0] != B || d[5][1] != H)) return error("GRUScan: h0 must be [B, H]");
    if (in[6] && (rank[6] != 2 || d[6][0] != B || d[6][1] != T)) return error("GRUScan: f must be [B, T]");
    if (in[7] && (rank[7] != 1 || d[7][0] != B)) return error("GRUScan: lengths must be [B]");
    if (in[8] && (rank[8] != 2 || d[8][0] != B || d[8][1] != T)) return error("GRUScan: mask must be [B, T]");
    /* an empty tensor's data is NULL too: with no rows (all of them filtered out before the layer) f is
       [0, T] and may read as absent */
    if (k->mode > 0 && !in[6] && B > 0) return error("GRUScan: this mode needs f");
    if (k->check_lens && in[7] && !in[8])
        for (int64_t b = 0; b < B; ++b) {
            const int64_t len = ((const int64_t *)in[7])[b];
            if (len < 0 || len > T) {
                char msg[160];
                snprintf(msg, sizeof msg, "GRUScan: Invalid value/s in sequence_lens. All values must be >= 0 and "
                         "<= seq_length. seq_length=%lld", (long long)T);
                return error(msg);
            }
        }

    size_t n_out;
    TRY(ort->KernelContext_GetOutputCount(ctx, &n_out));
    OrtValue *out;
    int64_t yh_dims[2] = {B, H}, y_dims[3] = {B, T, H};
    const int64_t pad = 2 * LANES;
    const int64_t G = (H + LANES - 1) / LANES * LANES;
    Job j = {.k = k, .B = B, .T = T, .H = H, .G = G, .HP = (3 * G + pad - 1) / pad * pad, .NP = (H + pad - 1) / pad * pad,
             .I = I, .x = in[0], .bias = in[3], .h0 = in[5], .f = in[6], .mask = in[8],
             .lens = (const int64_t *)in[7]};
    TRY(ort->KernelContext_GetOutput(ctx, 0, yh_dims, 2, &out));
    TRY(ort->GetTensorMutableData(out, (void **)&j.yh));
    if (n_out > 1) {
        out = NULL;
        TRY(ort->KernelContext_GetOutput(ctx, 1, y_dims, 3, &out));
        if (out) TRY(ort->GetTensorMutableData(out, (void **)&j.y));
    }
    if (B == 0) return NULL;
    size_t blocks = (size_t)((B + ROWS - 1) / ROWS);
    j.scratch_floats = ROWS * (2 * G + j.NP + 2 * j.HP + 3 * G);
    float *weights = calloc((size_t)((I + H + 1) * j.HP + H * j.NP + G) + blocks * (size_t)j.scratch_floats,
                            sizeof(float));
    int64_t *order = malloc((4 * (size_t)B + (size_t)T + 2) * sizeof(int64_t));
    if (!weights || !order) {
        free(weights);
        free(order);
        return ort->CreateStatus(ORT_FAIL, "GRUScan: out of memory");
    }
    j.Wp = weights;
    j.Rp = j.Wp + I * j.HP;
    j.Rnp = j.Rp + H * j.HP;
    j.Bp = j.Rnp + H * j.NP;
    j.rbnp = j.Bp + j.HP;
    j.scratch = j.rbnp + G;
    for (int64_t g = 0; g < 3; ++g) {   /* gate g's columns at g G */
        memcpy(j.Bp + g * G, in[3] + g * H, (size_t)H * sizeof(float));
        pad_columns(j.Wp + g * G, in[1], I, 3 * H, g * H, H, j.HP);
        pad_columns(j.Rp + g * G, in[2], H, 3 * H, g * H, H, j.HP);
    }
    if (in[4]) memcpy(j.rbnp, in[4], (size_t)H * sizeof(float));
    pad_columns(j.Rnp, in[2], H, 3 * H, 2 * H, H, j.NP);
    int64_t *steps = order + B, *fed = steps + B, *first = fed + B, *by_fed = first + T + 2;
    for (int64_t b = 0; b < B; ++b) {
        steps[b] = steps_of(&j, b);
        fed[b] = k->mode == 4 ? fed_of(&j, b, steps[b]) : steps[b];
    }
    /* rows by their number of steps, most first, and among those (AIGRU) by their fed steps: two stable counting
       sorts, the minor key first */
    sort_rows(fed, NULL, B, T, first, by_fed);
    sort_rows(steps, by_fed, B, T, first, order);
    j.order = order;
    j.steps = steps;
    j.fed = fed;
    OrtStatus *s = ort->KernelContext_ParallelFor(ctx, run_block, blocks, 0, &j);
    free(weights);
    free(order);
    return s;
}

static OrtStatus *ORT_API_CALL create(const OrtCustomOp *op, const OrtApi *api, const OrtKernelInfo *info,
                                      void **kernel) {
    (void)op;
    (void)api;
    Kernel *k = calloc(1, sizeof(Kernel));
    if (!k) return ort->CreateStatus(ORT_FAIL, "GRUScan: out of memory");
    OrtStatus *s = ort->KernelInfoGetAttribute_int64(info, "hidden_size", &k->hidden);
    if (!s) s = ort->KernelInfoGetAttribute_int64(info, "linear_before_reset", &k->lbr);
    if (!s) s = ort->KernelInfoGetAttribute_int64(info, "padded_output_zero", &k->zero_pad);
    if (!s) s = ort->KernelInfoGetAttribute_int64(info, "mode", &k->mode);
    if (!s && (k->mode < 0 || k->mode > 4)) s = error("GRUScan: mode must be 0..4");
    if (!s) k->check_lens = int_attribute(info, "check_lengths", 0);
    if (s) {
        free(k);
        return s;
    }
    *kernel = k;
    return NULL;
}

static const char *ORT_API_CALL name(const OrtCustomOp *op) { (void)op; return "GRUScan"; }
static size_t ORT_API_CALL n_inputs(const OrtCustomOp *op) { (void)op; return N_IN; }
static size_t ORT_API_CALL n_outputs(const OrtCustomOp *op) { (void)op; return 2; }

static ONNXTensorElementDataType ORT_API_CALL input_type(const OrtCustomOp *op, size_t i) {
    (void)op;
    return i == 7 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
}

static OrtCustomOpInputOutputCharacteristic ORT_API_CALL input_kind(const OrtCustomOp *op, size_t i) {
    (void)op;
    return i < 4 ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL;
}

static OrtCustomOpInputOutputCharacteristic ORT_API_CALL output_kind(const OrtCustomOp *op, size_t i) {
    (void)op;
    return i == 0 ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL;
}

OrtCustomOp ctropt_gru_scan = CUSTOM_OP(name, input_type, n_inputs, float_type, n_outputs, input_kind, output_kind, create,
                                         compute);
