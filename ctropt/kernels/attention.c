/* AttentionCore: softmax(scale · Q·Kᵀ + bias_scale · bias) · V over the last two axes, every head in one kernel.
 *
 * Node (domain "ai.ctropt.kernels", made by attention-core-kernel):
 *   inputs   0 Q [..., S, dk]
 *            1 K [..., L, dk]
 *            2 V [..., L, dv]
 *            3 bias, broadcastable to [..., S, L]                                                    optional
 *            4 mask (bool), broadcastable to [..., S, L]: adds mask_value where mask == mask_on (or, with
 *              mask_replace, the score there is mask_value: tf's Cast(m)·s + Cast(Not(m))·c)        optional
 *              (the Where(mask, -inf, 0) an export builds as the bias, without running it); not with a bias
 *   outputs  0 Y [..., S, dv]
 *   "...": up to two leading axes. Q, K, V and the bias broadcast as the decomposed graph does (numpy's rules: the
 *            bias may widen the leading axes, and the query rows when Q has one).
 *   attributes scale, bias_scale, mask_value (floats), mask_on, mask_replace (ints); q_perm, k_perm, v_perm (ints, optional): the
 *            input is read as Transpose(input, perm) (a layout the export made with a Transpose, or Kᵀ given: K = Kᵀ
 *            with its last two axes swapped), by strides, without copying it; q_select, k_select, v_select (ints
 *            [axis, index], optional): the input (rank 5 at most) is read as Gather(input, index, axis) first (Q, K
 *            and V packed in one projection, as torch's nn.MultiheadAttention writes them); y_perm (ints,
 *            optional): the output is written as Transpose(Y, y_perm) (heads merged back by the export)
 *
 * A row of scores is what onnxruntime computes for the decomposed form (its MatMul, Mul, Add and Softmax): the row's
 * max subtracted, exp, the sum, times 1/sum; a row of -inf (all masked) gives NaN here as there, and so does a key
 * weighed 0 whose V holds an inf or a NaN (0 · inf). An input with no elements (no rows) gives the empty or zero Y
 * the decomposed form gives. The rounding differs only by the order of sums. One head at a time: its Kᵀ and V copied
 * into zero-padded scratch, so each loop runs LANES columns at a time with up to BLOCK vectors of accumulators in
 * registers; blocks of heads are spread over onnxruntime's intra-op threads.
 */
#include <math.h>

#include "kernels.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define COLUMNS 8   /* of V at a time, each a vector of accumulators (over LANES query rows) */
#define MAX_DIM (1 << 20)
#define MAX_BLOCKS 64   /* of heads, each with its scratch */

typedef struct {
    float scale, bias_scale, mask_value;
    int64_t mask_on, mask_replace, perm[4][4], perm_rank[4];   /* perms of Q, K, V, Y; rank 0: none */
    int64_t select[3][2];                        /* axis and index of Q, K, V read first; axis -1: none */
} Kernel;

typedef int32_t ivec __attribute__((vector_size(LANES * sizeof(float))));

/* Lane i: base[at[i]], `at` the offsets of a block's rows (lanes past its last row repeat it: read, never kept). */
static inline vec gather(const float *base, const int64_t *at) {
#if defined(__AVX2__) && LANES == 8
    if (at[LANES - 1] <= INT32_MAX) {
        const __m256i idx = _mm256_setr_epi32((int)at[0], (int)at[1], (int)at[2], (int)at[3], (int)at[4], (int)at[5],
                                              (int)at[6], (int)at[7]);
        return (vec)_mm256_i32gather_ps(base, idx, 4);
    }
#endif
    vec v;
    for (int i = 0; i < LANES; ++i) v[i] = base[at[i]];
    return v;
}


typedef struct {
    const Kernel *k;
    int64_t S, L, dk, dv, lead[2];   /* lead: the output's leading axes */
    const float *q, *kk, *v, *bias;
    const uint8_t *mask, *mask_end;       /* or the mask (bs: its strides) */
    int64_t qs[4], ks[4], vs[4], bs[4], ys[4];   /* element strides per axis [lead, lead, row, column] (0: broadcast) */
    float *y, *scratch;
    int64_t heads, blocks, scratch_floats;   /* scratch per block: scores [L][LANES], Q rows
                                                * transposed [dk][LANES], the keys kept [L] */
} Job;

/* For a block of LANES query rows (a lane each): y[row][c0 : c0 + w] = inv · Σ_l e[l] V[l][c0 : c0 + w], w vectors of
 * accumulators in registers (w a constant where it is inlined), then each lane's values to its row. */
static inline __attribute__((always_inline)) void weigh_values(const Job *j, const float *e, const int64_t *keys,
                                                                int64_t kept, vec inv, const float *v, int64_t c0,
                                                                const int w, int rows, float *y) {
    vec acc[COLUMNS] = {{0}};
    for (int64_t i = 0; i < kept; ++i) {
        const vec p = load(e + i * LANES);
        const float *vl = v + keys[i] * j->vs[2] + c0 * j->vs[3];
        for (int c = 0; c < w; ++c) acc[c] += p * vl[c * j->vs[3]];
    }
    for (int c = 0; c < w; ++c) {
        acc[c] *= inv;
        for (int i = 0; i < rows; ++i) y[i * j->ys[2] + (c0 + c) * j->ys[3]] = acc[c][i];
    }
}

/* Column l of the bias for a block's rows (at: their offsets from bias or mask, the block's first row's):
 * bias_scale · bias, or mask_value where the mask is mask_on (`on`: those lanes). */
static inline vec bias_column(const Job *j, const float *bias, const uint8_t *flags, int64_t l, const int64_t *at,
                              mask *on) {
    if (bias) return j->k->bias_scale * gather(bias + l * j->bs[3], at);
    const uint8_t *m = flags + l * j->bs[3];
    mask set;
#if defined(__AVX2__) && LANES == 8
    if (at[LANES - 1] <= INT32_MAX - 4 && m + at[LANES - 1] + 4 <= j->mask_end) {   /* 4 bytes at each flag */
        const __m256i idx = _mm256_setr_epi32((int)at[0], (int)at[1], (int)at[2], (int)at[3], (int)at[4], (int)at[5],
                                              (int)at[6], (int)at[7]);
        set = (mask)_mm256_i32gather_epi32((const int *)m, idx, 1) & 0xff;
        set = set != 0;
    } else
#endif
    {
        for (int i = 0; i < LANES; ++i) set[i] = m[at[i]] != 0 ? -1 : 0;
    }
    if (!j->k->mask_on) set = ~set;
    *on = set;
    return pick(set, splat(j->k->mask_value), splat(0.0f));
}

/* Whether row l of V holds only finite values (a key weighed 0 then adds 0 to every output: 0 · inf is NaN). */
static int finite_values(const Job *j, const float *v, int64_t l) {
    for (int64_t c = 0; c < j->dv; ++c)
        if (!isfinite(v[l * j->vs[2] + c * j->vs[3]])) return 0;
    return 1;
}

/* Scores of a block of LANES query rows (lane i: row i; qt: the rows' Q transposed, [dk][LANES]; bias or flags (the
 * mask): see bias_column, both NULL without) into e [kept][LANES], scaled and biased, for the keys kept (their indices into
 * keys): a key the bias masks (-inf) for every row of the block weighs 0 in each softmax, so it is skipped (key
 * padding, the future under a causal mask), unless its row of V holds an inf or a NaN (0 times it is NaN in
 * onnxruntime's MatMul: kept, so here too). Returns their max per lane. */
static vec scores(const Job *j, const float *qt, const float *k, const float *v, const float *bias,
                  const uint8_t *flags, const int64_t *at, float *e, int64_t *keys, int64_t *kept) {
    const int64_t dk = j->dk, k_step = j->ks[3], k_row = j->ks[2];
    const vec none = splat(-__builtin_inff());
    vec top = none;
    *kept = 0;
    for (int64_t l = 0; l < j->L; ++l) {
        vec b = {0};
        mask on = {0};
        if (bias || flags) {
            b = bias_column(j, bias, flags, l, at, &on);
            mask masked = b == none;
            int all = 1;
            for (int i = 0; i < LANES; ++i) all &= masked[i] != 0;
            if (all && finite_values(j, v, l)) continue;
        }
        const float *kl = k + l * k_row;
        vec x = {0}, x2 = {0};   /* two chains over the depth */
        int64_t d = 0;
        for (; d + 1 < dk; d += 2) {
            x += load(qt + d * LANES) * kl[d * k_step];
            x2 += load(qt + (d + 1) * LANES) * kl[(d + 1) * k_step];
        }
        if (d < dk) x += load(qt + d * LANES) * kl[d * k_step];
        x = (x + x2) * j->k->scale;
        x = j->k->mask_replace ? pick(on, b, x) : x + b;
        store(e + *kept * LANES, x);
        keys[(*kept)++] = l;
        top = pick(x > top, x, top);
    }
    return top;
}

/* Head n: its query rows LANES at a time, each row's softmax in a lane (no reductions across lanes). */
static void run_head(const Job *j, int64_t n, float *e) {
    const int64_t S = j->S, L = j->L, dk = j->dk, dv = j->dv;
    const int64_t i0 = n / j->lead[1], i1 = n % j->lead[1];
    const float *q = j->q + i0 * j->qs[0] + i1 * j->qs[1];
    const float *k = j->kk + i0 * j->ks[0] + i1 * j->ks[1];
    const float *v = j->v + i0 * j->vs[0] + i1 * j->vs[1];
    const int64_t at0 = i0 * j->bs[0] + i1 * j->bs[1];
    const float *bias = j->bias ? j->bias + at0 : NULL;
    const uint8_t *flags = j->mask ? j->mask + at0 : NULL;
    float *y = j->y + i0 * j->ys[0] + i1 * j->ys[1], *qt = e + L * LANES;
    int64_t *keys = (int64_t *)(qt + dk * LANES), kept;
    for (int64_t s0 = 0; s0 < S; s0 += LANES) {
        const int rows = S - s0 < LANES ? (int)(S - s0) : LANES;
        int64_t q_at[LANES], bias_at[LANES];
        for (int i = 0; i < LANES; ++i) {
            q_at[i] = (i < rows ? i : rows - 1) * j->qs[2];
            bias_at[i] = (i < rows ? i : rows - 1) * j->bs[2];
        }
        for (int64_t d = 0; d < dk; ++d) store(qt + d * LANES, gather(q + s0 * j->qs[2] + d * j->qs[3], q_at));
        const vec top = scores(j, qt, k, v, bias ? bias + s0 * j->bs[2] : NULL, flags ? flags + s0 * j->bs[2] : NULL,
                               bias_at, e, keys, &kept);
        vec sum = {0};
        for (int64_t l = 0; l < kept; ++l) {
            const vec x = exp_vec(load(e + l * LANES) - top);
            store(e + l * LANES, x);
            sum += x;
        }
        const vec inv = 1.0f / sum;
        float *ys = y + s0 * j->ys[2];
        int64_t c = 0;
        for (; c + COLUMNS <= dv; c += COLUMNS) weigh_values(j, e, keys, kept, inv, v, c, COLUMNS, rows, ys);
        switch (dv - c) {   /* the last columns, with as many accumulators */
            case 7: weigh_values(j, e, keys, kept, inv, v, c, 7, rows, ys); break;
            case 6: weigh_values(j, e, keys, kept, inv, v, c, 6, rows, ys); break;
            case 5: weigh_values(j, e, keys, kept, inv, v, c, 5, rows, ys); break;
            case 4: weigh_values(j, e, keys, kept, inv, v, c, 4, rows, ys); break;
            case 3: weigh_values(j, e, keys, kept, inv, v, c, 3, rows, ys); break;
            case 2: weigh_values(j, e, keys, kept, inv, v, c, 2, rows, ys); break;
            case 1: weigh_values(j, e, keys, kept, inv, v, c, 1, rows, ys); break;
            default: break;
        }
    }
}

/* Block b of the heads, with its own scratch. */
static void run_block(void *data, size_t b) {
    const Job *j = data;
    for (int64_t n = j->heads * (int64_t)b / j->blocks; n < j->heads * ((int64_t)b + 1) / j->blocks; ++n)
        run_head(j, n, j->scratch + (int64_t)b * j->scratch_floats);
}

/* ---------------------------------------------------------------------------------------------- plumbing */

/* dims (rank r) right-aligned to `want` axes (missing leading ones are 1) */
static void align(const int64_t *dims, size_t r, size_t want, int64_t *out) {
    for (size_t i = 0; i < want; ++i) out[i] = i + r < want ? 1 : dims[i + r - want];
}

/* An input of dims (rank r) read as Gather(input, index, axis) (select {axis, index}; axis -1: not) and then as
 * Transpose(., perm) (perm NULL: as it is), right-aligned to 4 axes: its dims and element strides (missing leading
 * axes: 1 and 0). Returns the offset of its first element. */
static int64_t viewed(const int64_t *all, size_t r, const int64_t select[2], const int64_t *perm, int64_t *out,
                      int64_t *strides) {
    int64_t own[5], dims[5], step = 1, offset = 0;
    size_t kept = 0;
    for (size_t x = r; x-- > 0; step *= all[x])
        if ((int64_t)x == select[0]) offset = select[1] * step;
    step = 1;
    for (size_t x = r; x-- > 0; step *= all[x])
        if ((int64_t)x != select[0]) ++kept;
    step = 1;
    for (size_t x = r, y = kept; x-- > 0; step *= all[x]) {
        if ((int64_t)x == select[0]) continue;
        --y;
        own[y] = step;
        dims[y] = all[x];
    }
    for (size_t x = 0; x < 4; ++x) {
        const int64_t from = x + kept < 4 ? -1 : perm ? perm[x + kept - 4] : (int64_t)(x + kept - 4);
        out[x] = from < 0 ? 1 : dims[from];
        strides[x] = from < 0 ? 0 : own[from];
    }
    return offset;
}

/* The inputs' layout into the job: Q, K, V and the bias or mask broadcast as numpy does (the bias may widen the
 * leading axes, and the query rows when Q has one), their element strides, and the output's rank. */
static OrtStatus *layout(const Kernel *kn, const float *in[5], size_t rank[5], int64_t d[5][5], Job *j,
                         size_t *out_rank) {
    int64_t a[4][4], st[3][4], lead[2], offset[3];
    if (in[3] && in[4]) return error("AttentionCore: a bias or a mask, not both");
    if (in[4]) {   /* the mask in the bias's place (its slot: shapes, strides) */
        in[3] = in[4];
        rank[3] = rank[4];
        memcpy(d[3], d[4], sizeof d[3]);
    }
    for (int i = 0; i < 3; ++i) {
        const size_t kept = rank[i] - (kn->select[i][0] >= 0 ? 1 : 0);
        if (!in[i] || kept < 2) return error("AttentionCore: Q, K and V need two axes at least");
        if (kept > 4) return error("AttentionCore: an input has rank > 4");
        if (kn->select[i][0] >= (int64_t)rank[i] || kn->select[i][1] >= (kn->select[i][0] >= 0 ? d[i][kn->select[i][0]] : 1))
            return error("AttentionCore: a select outside its input");
        if (kn->perm_rank[i] && (size_t)kn->perm_rank[i] != kept) return error("AttentionCore: a perm of another rank");
        offset[i] = viewed(d[i], rank[i], kn->select[i], kn->perm_rank[i] ? kn->perm[i] : NULL, a[i], st[i]);
        rank[i] = kept;
    }
    align(d[3], rank[3], 4, a[3]);
    const int64_t S = a[0][2] == 1 && in[3] ? a[3][2] : a[0][2], dk = a[0][3], L = a[1][2], dv = a[2][3];
    if (a[1][3] != dk) return error("AttentionCore: Q and K differ in depth");
    if (a[2][2] != L) return error("AttentionCore: K and V differ in length");
    if (S > MAX_DIM || L > MAX_DIM || dk > MAX_DIM || dv > MAX_DIM) return error("AttentionCore: an axis is too long");
    *out_rank = 2;
    for (int i = 0; i < 4; ++i) *out_rank = rank[i] > *out_rank ? rank[i] : *out_rank;
    *j = (Job){.k = kn, .S = S, .L = L, .dk = dk, .dv = dv, .q = in[0] + offset[0], .kk = in[1] + offset[1],
               .v = in[2] + offset[2],
               .bias = in[4] ? NULL : in[3], .mask = in[4] ? (const uint8_t *)in[4] : NULL};
    if (j->mask) {
        int64_t bytes = 1;
        for (size_t x = 0; x < rank[4]; ++x) bytes *= d[4][x];
        j->mask_end = j->mask + bytes;
    }
    for (int x = 0; x < 2; ++x) {
        lead[x] = 1;
        for (int i = 0; i < 4; ++i) {
            if (a[i][x] != 1 && lead[x] != 1 && a[i][x] != lead[x])
                return error("AttentionCore: the leading axes of Q, K, V and the bias do not broadcast");
            if (a[i][x] != 1) lead[x] = a[i][x];
        }
    }
    int64_t *strides[3] = {j->qs, j->ks, j->vs};
    for (int i = 0; i < 3; ++i)
        for (int x = 0; x < 4; ++x) strides[i][x] = x < 2 && a[i][x] == 1 ? 0 : st[i][x];
    if (a[0][2] == 1) j->qs[2] = 0;   /* one query row, repeated over the bias's rows */
    const int64_t full[4] = {lead[0], lead[1], S, L};
    for (int64_t x = 3, step = 1; x >= 0 && in[3]; step *= a[3][x--]) {
        if (a[3][x] != 1 && a[3][x] != full[x]) return error("AttentionCore: the bias or mask does not broadcast to the scores");
        j->bs[x] = a[3][x] == 1 ? 0 : step;
    }
    j->lead[0] = lead[0];
    j->lead[1] = lead[1];
    return NULL;
}

/* The output's dims (`written`: Y's [lead, lead, S, dv] cut to out_rank, permuted by y_perm) and Y's element strides
 * in it. */
static OrtStatus *output_layout(const Kernel *kn, Job *j, size_t out_rank, int64_t written[4]) {
    const int64_t y_dims[4] = {j->lead[0], j->lead[1], j->S, j->dv}, *y_perm = kn->perm_rank[3] ? kn->perm[3] : NULL;
    if (y_perm && (size_t)kn->perm_rank[3] != out_rank) return error("AttentionCore: y_perm of another rank");
    for (size_t x = 0; x < out_rank; ++x) written[x] = y_dims[4 - out_rank + (y_perm ? y_perm[x] : (int64_t)x)];
    for (int64_t x = (int64_t)out_rank - 1, step = 1; x >= 0; step *= written[x--])
        j->ys[4 - out_rank + (y_perm ? y_perm[x] : x)] = step;
    for (size_t x = 0; x < 4 - out_rank; ++x) j->ys[x] = 0;
    return NULL;
}

static OrtStatus *ORT_API_CALL compute(void *kernel, OrtKernelContext *ctx) {
    size_t n_in, rank[5], out_rank = 2;
    int64_t d[5][5], written[4];
    const float *in[5];
    Job j;
    TRY(ort->KernelContext_GetInputCount(ctx, &n_in));
    static const float no_data = 0.0f;
    for (size_t i = 0; i < 5; ++i) {
        TRY(read_input(ctx, n_in, i, &in[i], d[i], &rank[i], i < 3 ? 5 : 4, "AttentionCore: an input has rank > 4"));
        if (!in[i] && rank[i]) in[i] = &no_data;   /* empty: onnxruntime gives a value it made no data */
    }
    TRY(layout(kernel, in, rank, d, &j, &out_rank));
    TRY(output_layout(kernel, &j, out_rank, written));
    OrtValue *out;
    TRY(ort->KernelContext_GetOutput(ctx, 0, written, out_rank, &out));
    TRY(ort->GetTensorMutableData(out, (void **)&j.y));
    j.heads = j.lead[0] * j.lead[1];
    if (j.heads == 0 || j.S == 0 || j.dv == 0) return NULL;
    if (j.L == 0) {   /* softmax over no columns: onnxruntime's Softmax gives an empty row, its MatMul zeros */
        memset(j.y, 0, (size_t)(j.heads * j.S * j.dv) * sizeof(float));
        return NULL;
    }
    j.blocks = j.heads < MAX_BLOCKS ? j.heads : MAX_BLOCKS;
    j.scratch_floats = (j.L + j.dk) * LANES + 2 * j.L;   /* and the keys kept, L int64 */
    j.scratch = calloc((size_t)(j.blocks * j.scratch_floats), sizeof(float));
    if (!j.scratch) return ort->CreateStatus(ORT_FAIL, "AttentionCore: out of memory");
    OrtStatus *s = ort->KernelContext_ParallelFor(ctx, run_block, (size_t)j.blocks, 0, &j);
    free(j.scratch);
    return s;
}

static OrtStatus *ORT_API_CALL create(const OrtCustomOp *op, const OrtApi *api, const OrtKernelInfo *info,
                                      void **kernel) {
    (void)op;
    (void)api;
    Kernel *k = calloc(1, sizeof(Kernel));
    if (!k) return ort->CreateStatus(ORT_FAIL, "AttentionCore: out of memory");
    OrtStatus *s = ort->KernelInfoGetAttribute_float(info, "scale", &k->scale);
    if (!s) s = ort->KernelInfoGetAttribute_float(info, "bias_scale", &k->bias_scale);
    k->mask_on = 1;   /* optional: a mask's attributes */
    OrtStatus *absent = s ? NULL : ort->KernelInfoGetAttribute_float(info, "mask_value", &k->mask_value);
    if (absent) ort->ReleaseStatus(absent);
    absent = s ? NULL : ort->KernelInfoGetAttribute_int64(info, "mask_on", &k->mask_on);
    if (absent) ort->ReleaseStatus(absent);
    k->mask_replace = s ? 0 : int_attribute(info, "mask_replace", 0);
    static const char *selects[3] = {"q_select", "k_select", "v_select"};
    for (int i = 0; i < 3 && !s; ++i) {
        size_t n = 0;
        k->select[i][0] = -1;
        OrtStatus *absent = ort->KernelInfoGetAttributeArray_int64(info, selects[i], NULL, &n);
        if (absent) {
            ort->ReleaseStatus(absent);
            continue;
        }
        s = n == 2 ? ort->KernelInfoGetAttributeArray_int64(info, selects[i], k->select[i], &n)
                   : error("AttentionCore: a select is [axis, index]");
        if (!s && (k->select[i][0] < 0 || k->select[i][0] > 4 || k->select[i][1] < 0))
            s = error("AttentionCore: a select's axis or index is negative");
    }
    static const char *perms[4] = {"q_perm", "k_perm", "v_perm", "y_perm"};
    for (int i = 0; i < 4 && !s; ++i) {
        size_t n = 0;
        OrtStatus *absent = ort->KernelInfoGetAttributeArray_int64(info, perms[i], NULL, &n);   /* its length */
        if (absent) {   /* not given: read as it is */
            ort->ReleaseStatus(absent);
            continue;
        }
        if (n > 4) s = error("AttentionCore: a perm is longer than 4");
        if (!s) s = ort->KernelInfoGetAttributeArray_int64(info, perms[i], k->perm[i], &n);
        k->perm_rank[i] = (int64_t)n;
        for (size_t x = 0, seen = 0; x < n && !s; ++x) {
            if (k->perm[i][x] < 0 || k->perm[i][x] >= (int64_t)n || (seen >> k->perm[i][x]) & 1)
                s = error("AttentionCore: a perm is not a permutation");
            else
                seen |= (size_t)1 << k->perm[i][x];
        }
    }
    if (s) {
        free(k);
        return s;
    }
    *kernel = k;
    return NULL;
}

static const char *ORT_API_CALL name(const OrtCustomOp *op) { (void)op; return "AttentionCore"; }

static OrtCustomOpInputOutputCharacteristic ORT_API_CALL input_kind(const OrtCustomOp *op, size_t i) {
    (void)op;
    return i < 3 ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL;
}


OrtCustomOp ctropt_attention_core = CUSTOM_OP(name, float_then_mask, five_inputs, float_type, one_count, input_kind, required, create,
                                               compute);
