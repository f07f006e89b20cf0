/* TokenAttention: self-attention from the tokens, the Q, K and V projections in the kernel, and a row's work reused
 * by the rows after it that hold most of the same tokens (one user's history with each candidate's own token).
 *
 * Node (domain "ai.ctropt.kernels", made by token-attention):
 *   inputs   0 xq [B, T, D]: the tokens the queries are projected from
 *            1 xkv [B, T, D]: the tokens of the keys and values (empty: xq's)                            optional
 *            2 w [D, C]: the projections' weights, the columns of every head's Q, K and V among them
 *            3 b [C]: their bias                                                                          optional
 *            4 mask (bool), broadcastable to [B, H, T, T] ([H, B, T, T] with mask_hb)                    optional
 *            5 wo [H·dv, N]: the output projection, its rows head by head                               optional
 *            6 bo [N]: its bias                                                                            optional
 *   outputs  0 Y [B, H, T, dv], written as Transpose(Y, y_perm) (given: a permutation of 4 axes);
 *              with wo: Z [B, T, N] ([T, B, N] with out_tb), a token's heads merged, times wo, plus bo (and the
 *              token xq[b, t] itself, with residual)
 *   attributes heads, dk, dv (ints); q_cols, k_cols, v_cols (ints, one per head: its first column in w);
 *            scale (float); mask_value (float), mask_on, mask_replace, mask_hb (ints), as AttentionCore's;
 *            out_tb, residual (ints, 0 or 1)
 *
 * Head h of row b: q_t = xq[b, t]·w[:, q_cols[h] : + dk] + b[..] (k and v from xkv), softmax(scale · q·kᵀ, the mask
 * applied as AttentionCore applies it) · v. A row computed in full keeps its projections (an anchor); a later row
 * whose tokens have the anchor's bits on all but at most a quarter of the positions, and whose mask agrees among those,
 * projects only its own tokens and merges them into the anchor's softmax partials over the shared keys (max, sum,
 * Σ e·v: two partial softmaxes merged, as flash attention does). Equal tokens give equal projections and scores, so
 * the result is the decomposed graph's up to rounding (the order of sums, the merge's rescaling).
 *
 * Every head at once: scores and weights are vectors over (token, head) pairs, and a query's output row (its heads'
 * dv values one after another) is summed LANES columns at a time, each lane taking its head's weight by a permute.
 * Rows are split in blocks for onnxruntime's threads (at most MAX_BLOCKS, by the batch alone); row 0 is computed in
 * full first, and every block starts from the anchors it left, so a batch of one user computes one row in full. Which
 * rows follow which anchor depends on the rows alone: the outputs are the same bits at any thread count.
 */
#include <math.h>

#include "kernels.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define MAX_T 64        /* tokens a row may share with another (the shared set is a bitmask); more: each in full */
#define ANCHORS 4       /* rows kept per block, the most recent computed in full */
#define MAX_BLOCKS 4    /* of rows, for onnxruntime's threads */
#define MAX_OWN (MAX_T / 4 + 1)   /* tokens of its own a row may have to follow an anchor */

typedef struct {
    int64_t heads, dk, dv, cols[3][MAX_T], mask_on, mask_replace, mask_hb, perm[4], has_perm, out_tb, residual;
    float scale, mask_value;
} Kernel;

typedef struct {
    const Kernel *k;
    int64_t B, T, Tp, D, C, H, HP, dk, dv, E, Ep, Pp;   /* Tp, HP, Ep, Pp: T, H, E = H·dv and T·H rounded up to
                                                         * LANES */
    const float *xq, *xkv, *w, *b, *wo, *bo;   /* wo, bo: the output projection [E][N], [N] (NULL: none) */
    int64_t N;
    const uint8_t *mask;
    int64_t ms[4], ys[4];   /* element strides: mask over [B, H, i, j], y over [B, H, t, c] */
    float *y, *room;        /* room: per block, its anchors and scratch */
    int32_t *head_of;       /* [Ep]: the head of each column of an output row (0 past E) */
    int32_t *pair_head;     /* [Pp]: the head of each (query, head) pair, query-major (past T·H: p % H still) */
    int64_t blocks, per_block, direct;   /* direct: y's rows are output rows in whole vectors */
    int follow;                          /* rows may follow anchors: T <= MAX_T, w and b finite */
    struct Anchors *sets;                /* [blocks]: each block's anchors, in its room */
} Job;

typedef struct {   /* a row's projections, and its softmax partials over a set of shared keys */
    int64_t row;   /* -1: none */
    uint64_t keys;
    int finite;    /* its tokens are all finite (else no row follows it: the merge's arithmetic needs finite values) */
    float *q, *k, *v;   /* [T][H][dk], [T][H][dk], [T][H][dv] (then LANES floats of slack) */
    float *qd, *kd;     /* Q and K by depth, (token, head) pairs in lanes [dk][Pp] */
    float *pm, *ps;     /* the partials over `keys` by pair: max, sum [Pp] */
    float *acc;         /* Σ e·v, a query's output row at a time [Tp][Ep] */
    float *pw;          /* with wo: each head's Σ e·v times its rows of wo [Tp][H][N] */
} Anchor;

typedef struct Anchors {
    Anchor an[ANCHORS];
    int next;   /* the anchor a row computed in full replaces */
} Anchors;

typedef struct {   /* a block's scratch */
    float *oq, *ok, *ov;   /* a row's own tokens' projections, as an anchor's q, k, v */
    float *eb, *top, *inv;   /* a query's weights by (key, head) pair [Pp]; their max and 1/Σe by head [HP] */
    float *qt;               /* a query by depth [dk][HP] (as okt) */
    float *cw, *ce;        /* merge weights by pair: of the anchor's partials [Pp], of own V [n][Pp] */
    float *okt;            /* own keys by depth [n][dk][HP] (spread over the lanes where the heads divide LANES) */
    float *row, *tmp;      /* an output row [Ep]; a token's C projections */
    float *rows;           /* with wo: a row's output rows [T][Ep], before the projection */
    float *rown;           /* with wo: each head's own V times its rows of wo [n][H][N] */
} Scratch;

/* The floats an anchor and a block's scratch take. */
static int64_t anchor_floats(const Job *j) {
    return j->T * j->H * (2 * j->dk + j->dv) + LANES + (2 * j->dk + 2) * j->Pp + j->Tp * j->Ep +
           (j->wo ? j->Tp * j->H * j->N : 0);
}
static int64_t scratch_floats(const Job *j) {
    return j->T * j->H * (2 * j->dk + j->dv) + LANES + j->Pp + LANES + (2 + j->dk) * j->HP + (1 + MAX_OWN) * j->Pp +
           LANES + MAX_OWN * j->dk * j->HP + j->Ep + j->C + (j->wo ? j->T * j->Ep + MAX_OWN * j->H * j->N : 0);
}

/* Rows r0 .. r0 + NR of out (os floats apart), columns c0 .. c0 + NV·LANES: bias (0 without) + add's row (as apart;
 * without: 0) + x's row (xs apart)·w, w [D][C]. NR·NV accumulators in registers. */
static inline __attribute__((always_inline)) void affine_block(const float *x, int64_t xs, int64_t D, const float *w,
                                                               int64_t C, const float *bias, const float *add,
                                                               int64_t as, float *out, int64_t os, int64_t r0,
                                                               int64_t c0, const int NR, const int NV) {
    vec acc[4][4];
    for (int r = 0; r < NR; ++r)
        for (int v = 0; v < NV; ++v)
            acc[r][v] = (bias ? load(bias + c0 + v * LANES) : splat(0.0f)) +
                        (add ? load(add + (r0 + r) * as + c0 + v * LANES) : splat(0.0f));
    for (int64_t d = 0; d < D; ++d) {
        vec wv[4];
        for (int v = 0; v < NV; ++v) wv[v] = load(w + d * C + c0 + v * LANES);
        for (int r = 0; r < NR; ++r) {
            const float xd = x[(r0 + r) * xs + d];
            for (int v = 0; v < NV; ++v) acc[r][v] += wv[v] * xd;
        }
    }
    for (int r = 0; r < NR; ++r)
        for (int v = 0; v < NV; ++v) store(out + (r0 + r) * os + c0 + v * LANES, acc[r][v]);
}

/* Rows r0 .. r0 + NR of out (as affine_block), every column in whole vectors, up to three vectors at a time. */
static inline __attribute__((always_inline)) void affine_row_block(const float *x, int64_t xs, int64_t D,
                                                                   const float *w, int64_t C, const float *bias,
                                                                   const float *add, int64_t as, float *out,
                                                                   int64_t os, int64_t r0, const int NR) {
    const int64_t C8 = C / LANES * LANES;
    for (int64_t c0 = 0; c0 < C8; c0 += 3 * LANES) {
        const int64_t nv = (C8 - c0) / LANES;
        if (nv >= 3) affine_block(x, xs, D, w, C, bias, add, as, out, os, r0, c0, NR, 3);
        else if (nv == 2) affine_block(x, xs, D, w, C, bias, add, as, out, os, r0, c0, NR, 2);
        else affine_block(x, xs, D, w, C, bias, add, as, out, os, r0, c0, NR, 1);
    }
}

/* out[r] = bias + add[r] + x[r]·w for R rows (x, add and out rows xs, as and os floats apart; bias, add optional),
 * w [D][C]: four rows and up to three vectors of columns at a time, the columns past the vectors one by one. */
static void affine_rows(const float *x, int64_t xs, int64_t R, int64_t D, const float *w, int64_t C,
                        const float *bias, const float *add, int64_t as, float *out, int64_t os) {
    const int64_t C8 = C / LANES * LANES;
    for (int64_t r0 = 0; r0 < R; r0 += 4) {
        if (R - r0 >= 4) affine_row_block(x, xs, D, w, C, bias, add, as, out, os, r0, 4);
        else
            for (int64_t r = r0; r < R; ++r) affine_row_block(x, xs, D, w, C, bias, add, as, out, os, r, 1);
        for (int64_t r = r0; r < R && r < r0 + 4; ++r)
            for (int64_t c = C8; c < C; ++c) {
                float y = (bias ? bias[c] : 0.0f) + (add ? add[r * as + c] : 0.0f);
                for (int64_t d = 0; d < D; ++d) y += x[r * xs + d] * w[d * C + c];
                out[r * os + c] = y;
            }
    }
}

/* Token t of row b projected: each head's Q into q, K into k, V into v ([H][dk], [H][dk], [H][dv]), from one pass
 * over w's columns (tmp: C floats; xkv read too where it is another tensor). */
static void project(const Job *j, int64_t b, int64_t t, float *q, float *k, float *v, float *tmp) {
    const int64_t H = j->H, dk = j->dk, dv = j->dv;
    for (int pass = 0; pass < (j->xkv == j->xq ? 1 : 2); ++pass) {
        affine_rows((pass ? j->xkv : j->xq) + (b * j->T + t) * j->D, 0, 1, j->D, j->w, j->C, j->b, NULL, 0, tmp, 0);
        for (int64_t h = 0; h < H; ++h) {
            if (pass == 0) memcpy(q + h * dk, tmp + j->k->cols[0][h], (size_t)dk * sizeof(float));
            if (pass == 1 || j->xkv == j->xq) {
                memcpy(k + h * dk, tmp + j->k->cols[1][h], (size_t)dk * sizeof(float));
                memcpy(v + h * dv, tmp + j->k->cols[2][h], (size_t)dv * sizeof(float));
            }
        }
    }
}

/* Whether mask entry (b, h, i, l) is set (the mask's own value, mask_on), and its offset. */
static inline int64_t mask_at(const Job *j, int64_t b, int64_t h, int64_t i, int64_t l) {
    return (j->k->mask_hb ? h * j->ms[0] + b * j->ms[1] : b * j->ms[0] + h * j->ms[1]) + i * j->ms[2] + l * j->ms[3];
}

static inline float masked(const Job *j, float s, int64_t at) {
    if (!j->mask || (j->mask[at] != 0) != (j->k->mask_on != 0)) return s;
    return j->k->mask_replace ? j->k->mask_value : s + j->k->mask_value;
}

/* Per-head values c (HP of them) spread over LANES lanes, `at` the heads of the lanes. */
static inline vec spread_at(const Job *j, const float *c, const int32_t *at) {
#if defined(__AVX2__) && LANES == 8
    if (j->HP == LANES) return (vec)_mm256_permutevar8x32_ps((__m256)load(c), _mm256_loadu_si256((const void *)at));
#endif
    vec r;
    for (int i = 0; i < LANES; ++i) r[i] = c[at[i]];
    return r;
}

/* Per-head values c spread over an output row's columns k·LANES onward: each lane its head's. */
static inline vec spread(const Job *j, const float *c, int64_t k) { return spread_at(j, c, j->head_of + k * LANES); }

/* Where query i of row b's output row is written: in y (direct), in rows (with wo: project_out then projects it),
 * else in `row`, which put_row then copies there. */
static inline float *row_at(const Job *j, int64_t b, int64_t i, float *row, float *rows) {
    return j->direct ? j->y + b * j->ys[0] + i * j->ys[2] : j->wo ? rows + i * j->Ep : row;
}
static void put_row(const Job *j, int64_t b, int64_t i, const float *row) {
    if (j->direct || j->wo) return;
    float *y = j->y + b * j->ys[0] + i * j->ys[2];
    for (int64_t h = 0; h < j->H; ++h)
        for (int64_t c = 0; c < j->dv; ++c) y[h * j->ys[1] + c * j->ys[3]] = row[h * j->dv + c];
}

/* Z's row of token i of row b, N floats (rows B·N apart with out_tb). */
static inline float *z_row(const Job *j, int64_t b, int64_t i) {
    return j->y + (j->k->out_tb ? i * j->B + b : b * j->T + i) * j->N;
}

/* Row b's output rows i0 .. i0 + count (in rows, Ep apart) projected: Z's rows, with the tokens themselves where
 * residual. */
static void project_out(const Job *j, int64_t b, const float *rows, int64_t i0, int64_t count) {
    affine_rows(rows + i0 * j->Ep, j->Ep, count, j->E, j->wo, j->N, j->bo,
                j->k->residual ? j->xq + (b * j->T + i0) * j->D : NULL, j->D, z_row(j, b, i0),
                j->k->out_tb ? j->B * j->N : j->N);
}

/* Query i of head h (q: its dk values) over the keys in `keys` of the anchor: the max and sum of its scores, and
 * out[c] = Σ e·v. */
static void partial(const Job *j, int64_t b, int64_t h, int64_t i, const float *q, uint64_t keys, const Anchor *a,
                    float *max, float *total, float *out) {
    float s[MAX_T], top = -__builtin_inff(), sum = 0.0f;
    const int64_t H = j->H, dk = j->dk, dv = j->dv;
    for (uint64_t left = keys; left; left &= left - 1) {
        const int64_t l = __builtin_ctzll(left);
        const float *k = a->k + (l * H + h) * dk;
        float x = 0.0f;
        for (int64_t d = 0; d < dk; ++d) x += q[d] * k[d];
        s[l] = masked(j, x * j->k->scale, mask_at(j, b, h, i, l));
        top = s[l] > top ? s[l] : top;
    }
    memset(out, 0, (size_t)dv * sizeof(float));
    for (uint64_t left = keys; left && top != -__builtin_inff(); left &= left - 1) {
        const int64_t l = __builtin_ctzll(left);
        const float e = expf(s[l] - top), *v = a->v + (l * H + h) * dv;
        sum += e;
        for (int64_t c = 0; c < dv; ++c) out[c] += e * v[c];
    }
    *max = top;
    *total = sum;
}

/* Whether two tokens of D floats have the same bits (no branch but the loops'). */
static inline int same_token(const float *x, const float *y, int64_t D) {
    int64_t d = 0;
    mask differ = {0};
    for (; d + LANES <= D; d += LANES) differ |= (mask)load(x + d) ^ (mask)load(y + d);
    int32_t any = 0;
    for (; d < D; ++d) {
        int32_t u, v;
        memcpy(&u, x + d, sizeof u);
        memcpy(&v, y + d, sizeof v);
        any |= u ^ v;
    }
    for (int i = 0; i < LANES; ++i) any |= differ[i];
    return !any;
}

/* The positions where row b's tokens (xq's and xkv's) have the anchor's bits; 0 when more than a quarter differ. */
/* Whether row b's token t (xq's, and xkv's) holds finite values only: ±inf or NaN projections break the merge of
 * softmax partials (inf - inf), so such a row is computed in full, as the decomposed graph computes it. */
static int finite_token(const Job *j, int64_t b, int64_t t) {
    return all_finite(j->xq + (b * j->T + t) * j->D, j->D) &&
           (j->xkv == j->xq || all_finite(j->xkv + (b * j->T + t) * j->D, j->D));
}

static uint64_t shared_tokens(const Job *j, int64_t b, int64_t a) {
    uint64_t same = 0;
    const int64_t D = j->D;
    for (int64_t t = 0, differ = 0; t < j->T; ++t) {
        if (same_token(j->xq + (b * j->T + t) * D, j->xq + (a * j->T + t) * D, D) &&
            (j->xkv == j->xq || same_token(j->xkv + (b * j->T + t) * D, j->xkv + (a * j->T + t) * D, D)))
            same |= (uint64_t)1 << t;
        else if (++differ >= (j->T / 4 + 1 < MAX_OWN ? j->T / 4 + 1 : MAX_OWN) || !finite_token(j, b, t))
            return 0;   /* at most a quarter differ, each finite */
    }
    return same;
}

/* Whether rows b and a have the same mask entries on the shared queries and keys (every head): the rows' whole
 * blocks compared first. */
static int same_mask(const Job *j, int64_t b, int64_t a, uint64_t shared) {
    const int64_t row_step = j->k->mask_hb ? j->ms[1] : j->ms[0];
    if (!j->mask || row_step == 0) return 1;
    const int64_t heads = (j->k->mask_hb ? j->ms[0] : j->ms[1]) ? j->H : 1;
    if (!j->k->mask_hb && j->ms[3] == 1 && j->ms[2] == j->T && (heads == 1 || j->ms[1] == j->T * j->T) &&
        !memcmp(j->mask + b * row_step, j->mask + a * row_step, (size_t)(heads * j->T * j->T)))
        return 1;
    for (int64_t h = 0; h < heads; ++h)
        for (uint64_t qs = shared; qs; qs &= qs - 1)
            for (uint64_t ks = shared; ks; ks &= ks - 1) {
                const int64_t i = __builtin_ctzll(qs), l = __builtin_ctzll(ks);
                if ((j->mask[mask_at(j, b, h, i, l)] != 0) != (j->mask[mask_at(j, a, h, i, l)] != 0)) return 0;
            }
    return 1;
}

/* The anchor's Q and K by depth, (token, head) pairs in lanes (zeros past T·H). */
static void transpose_anchor(const Job *j, Anchor *a) {
    const int64_t dk = j->dk, P = j->T * j->H;
    for (int64_t p = 0; p < j->Pp; ++p)
        for (int64_t d = 0; d < dk; ++d) {
            a->qd[d * j->Pp + p] = p < P ? a->q[p * dk + d] : 0.0f;
            a->kd[d * j->Pp + p] = p < P ? a->k[p * dk + d] : 0.0f;
        }
}

/* The anchor's partials over the shared keys for its shared queries. */
static void anchor_partials(const Job *j, Anchor *a, uint64_t shared) {
    const int64_t H = j->H, dk = j->dk, dv = j->dv;
    for (int64_t p = 0; p < j->Pp; ++p) {
        const int64_t i = p / H, h = p % H;
        float *acc = a->acc + i * j->Ep + h * dv;
        if (i < j->T && (shared >> i & 1)) {
            partial(j, a->row, h, i, a->q + p * dk, shared, a, a->pm + p, a->ps + p, acc);
        } else {
            a->pm[p] = -__builtin_inff();
            a->ps[p] = 0.0f;
            if (i < j->T) memset(acc, 0, (size_t)dv * sizeof(float));
        }
        if (j->wo && i < j->T && (shared >> i & 1))   /* by linearity, W_o applied here once per user */
            affine_rows(acc, 0, 1, dv, j->wo + h * dv * j->N, j->N, NULL, NULL, 0, a->pw + p * j->N, 0);
    }
    a->keys = shared;
}

/* A token's per-head vectors ([H][dk] in src) by depth into out [dk][HP]: head h at lane h, or, where the heads
 * divide LANES (every block of (token, head) pairs alike), every lane q holding head q % H, ready to load. */
static void by_depth(const Job *j, const float *src, float *out) {
    const int64_t H = j->H, dk = j->dk, lanes = LANES % H == 0 ? LANES : H;
    for (int64_t q = 0; q < lanes; ++q)
        for (int64_t d = 0; d < dk; ++d) out[d * j->HP + q] = src[(q % H) * dk + d];
}

/* The merge weights of row b's shared queries, every head at once (vectors over (query, head) pairs): the anchor's
 * partials against the row's own keys (n of them: K rows in x->ok at `own`), into x->cw and x->ce. */
static void merge_weights(const Job *j, int64_t b, const Anchor *a, uint64_t shared, const int64_t *own, int n,
                          const Scratch *x) {
    const int64_t H = j->H, HP = j->HP, dk = j->dk, Pp = j->Pp, P = j->T * H, uniform = LANES % H == 0;
    for (int t = 0; t < n; ++t) by_depth(j, x->ok + own[t] * H * dk, x->okt + t * dk * HP);
    for (int64_t p0 = 0; p0 < P; p0 += LANES) {
        const int64_t first = p0 / H, last = (p0 + LANES - 1 < P ? p0 + LANES - 1 : P - 1) / H;
        if (!((shared >> first) & (((uint64_t)2 << (last - first)) - 1))) continue;   /* no shared query */
        const int32_t *heads = j->pair_head + p0;
        vec e[MAX_OWN], top = load(a->pm + p0), w_old;
        for (int t = 0; t < n; ++t) {
            vec s = {0};
            for (int64_t d = 0; d < dk; ++d) {
                const float *k = x->okt + (t * dk + d) * HP;
                s += load(a->qd + d * Pp + p0) * (uniform ? load(k) : spread_at(j, k, heads));
            }
            s *= j->k->scale;
            for (int64_t i = 0, q = first, h = p0 % H; j->mask && i < LANES && p0 + i < P; ++i) {   /* pair q, h */
                s[i] = masked(j, s[i], mask_at(j, b, h, q, own[t]));
                q += h + 1 == H;
                h = h + 1 < H ? h + 1 : 0;
            }
            e[t] = s;
            top = pick(s > top, s, top);
        }
        if (n == 1) {   /* one of the two weights is exp(0) = 1: one exp, of -|difference| */
            const vec diff = e[0] - load(a->pm + p0);
            const mask own_top = diff > 0.0f;
            const vec small = exp_vec(pick(own_top, -diff, diff));   /* NaN (both -inf) stays NaN, as onnxruntime's */
            w_old = pick(own_top, small, splat(1.0f));
            e[0] = pick(own_top, splat(1.0f), small);
        } else {   /* every key masked (-inf - -inf): NaN, as onnxruntime gives */
            w_old = exp_vec(load(a->pm + p0) - top);
            for (int t = 0; t < n; ++t) e[t] = exp_vec(e[t] - top);
        }
        vec sum = load(a->ps + p0) * w_old;
        for (int t = 0; t < n; ++t) sum += e[t];
        const vec inv = 1.0f / sum;
        store(x->cw + p0, w_old * inv);
        for (int t = 0; t < n; ++t) store(x->ce + t * Pp + p0, e[t] * inv);
    }
}

/* With wo, Z's rows of row b's shared queries: the merge's weights times the anchor's partials and the row's own V,
 * each already times wo (bo, and the token where residual, added). */
static void merge_projected(const Job *j, int64_t b, const Anchor *a, uint64_t shared, const int64_t *own, int n,
                            const Scratch *x) {
    const int64_t H = j->H, N = j->N, dv = j->dv, Pp = j->Pp, N8 = N / LANES * LANES;
    for (int t = 0; t < n; ++t)
        for (int64_t h = 0; h < H; ++h)
            affine_rows(x->ov + own[t] * j->E + h * dv, 0, 1, dv, j->wo + h * dv * N, N, NULL, NULL, 0,
                        x->rown + (t * H + h) * N, 0);
    for (uint64_t left = shared; left; left &= left - 1) {
        const int64_t i = __builtin_ctzll(left);
        const float *cw = x->cw + i * H, *pw = a->pw + i * H * N;
        const float *res = j->k->residual ? j->xq + (b * j->T + i) * j->D : NULL;
        float *z = z_row(j, b, i);
        for (int64_t c0 = 0; c0 < N8; c0 += LANES) {
            vec r = (j->bo ? load(j->bo + c0) : splat(0.0f)) + (res ? load(res + c0) : splat(0.0f));
            for (int64_t h = 0; h < H; ++h) r += load(pw + h * N + c0) * cw[h];
            for (int t = 0; t < n; ++t)
                for (int64_t h = 0; h < H; ++h) r += load(x->rown + (t * H + h) * N + c0) * x->ce[t * Pp + i * H + h];
            store(z + c0, r);
        }
        for (int64_t c = N8; c < N; ++c) {
            float r = (j->bo ? j->bo[c] : 0.0f) + (res ? res[c] : 0.0f);
            for (int64_t h = 0; h < H; ++h) r += pw[h * N + c] * cw[h];
            for (int t = 0; t < n; ++t)
                for (int64_t h = 0; h < H; ++h) r += x->rown[(t * H + h) * N + c] * x->ce[t * Pp + i * H + h];
            z[c] = r;
        }
    }
}

/* Row b's shared queries: the anchor's partials over the shared keys merged with the row's n own keys (V rows in
 * x->ov at `own`), each query's output row LANES columns at a time (with wo: merge_projected's rows). */
static void merge(const Job *j, int64_t b, const Anchor *a, uint64_t shared, const int64_t *own, int n,
                  const Scratch *x) {
    const int64_t H = j->H, E = j->E;
    merge_weights(j, b, a, shared, own, n, x);
    if (j->wo) {
        merge_projected(j, b, a, shared, own, n, x);
        return;
    }
    for (uint64_t left = shared; left; left &= left - 1) {
        const int64_t i = __builtin_ctzll(left);
        const float *acc = a->acc + i * j->Ep;
        float *y = row_at(j, b, i, x->row, x->rows);
        for (int64_t k = 0; k * LANES < E; ++k) {
            vec r = spread(j, x->cw + i * H, k) * load(acc + k * LANES);
            for (int t = 0; t < n; ++t)
                r += spread(j, x->ce + t * j->Pp + i * H, k) * load(x->ov + own[t] * E + k * LANES);
            store(y + k * LANES, r);
        }
        put_row(j, b, i, x->row);
    }
}

/* The max (top) or sum of Pp values by (key, head) pair, by head, into out[H]. Where the heads divide LANES each lane
 * keeps one head: the pairs' vectors reduced lane by lane, then the lanes. */
static void by_head(const Job *j, const float *v, int top, float *out) {
    const int64_t H = j->H;
    for (int64_t h = 0; h < H; ++h) out[h] = top ? -__builtin_inff() : 0.0f;
    if (LANES % H) {
        for (int64_t p = 0; p < j->Pp; ++p) {
            const int32_t h = j->pair_head[p];
            out[h] = top ? (v[p] > out[h] ? v[p] : out[h]) : out[h] + v[p];
        }
        return;
    }
    vec r = load(v);
    for (int64_t p0 = LANES; p0 < j->Pp; p0 += LANES) {
        const vec x = load(v + p0);
        r = top ? pick(x > r, x, r) : r + x;
    }
    for (int q = 0; q < LANES; ++q) out[q % H] = top ? (r[q] > out[q % H] ? r[q] : out[q % H]) : out[q % H] + r[q];
}

/* The weights of query i of row b (q: its projection, [H][dk]) over every key, every head at once (vectors over
 * (key, head) pairs): the anchor's K where the row shares its tokens, its own (ok at `own`) where not. Into x->eb
 * (exp of the score less its head's max) and x->inv (1/Σe by head). */
static void own_weights(const Job *j, int64_t b, const Anchor *a, int64_t i, const float *q, const int64_t *own,
                        int n, const float *ok, const Scratch *x) {
    const int64_t H = j->H, HP = j->HP, dk = j->dk, Pp = j->Pp, P = j->T * H, uniform = LANES % H == 0;
    const int32_t *heads = j->pair_head;
    by_depth(j, q, x->qt);
    for (int64_t p0 = 0; p0 < P; p0 += LANES) {
        vec s = {0};
        for (int64_t d = 0; d < dk; ++d)
            s += load(a->kd + d * Pp + p0) * (uniform ? load(x->qt + d * HP) :
                                                        spread_at(j, x->qt + d * HP, heads + p0));
        store(x->eb + p0, s * j->k->scale);
    }
    for (int t = 0; t < n; ++t)
        for (int64_t h = 0; h < H; ++h) {
            const float *k = ok + (own[t] * H + h) * dk;
            float s = 0.0f;
            for (int64_t d = 0; d < dk; ++d) s += q[h * dk + d] * k[d];
            x->eb[own[t] * H + h] = s * j->k->scale;
        }
    for (int64_t l = 0; j->mask && l < j->T; ++l)
        for (int64_t h = 0; h < H; ++h) x->eb[l * H + h] = masked(j, x->eb[l * H + h], mask_at(j, b, h, i, l));
    for (int64_t p = P; p < Pp; ++p) x->eb[p] = -__builtin_inff();   /* past the pairs: e = 0 */
    by_head(j, x->eb, 1, x->top);
    for (int64_t p0 = 0; p0 < Pp; p0 += LANES)   /* every key masked (-inf - -inf): NaN, as onnxruntime gives */
        store(x->eb + p0, exp_vec(load(x->eb + p0) - spread_at(j, x->top, heads + p0)));
    by_head(j, x->eb, 0, x->inv);
    for (int64_t h = 0; h < H; ++h) x->inv[h] = 1.0f / x->inv[h];
}

/* Query i of row b, one of its own tokens (q: its projection, [H][dk]), over every key: the weights, then Σ e·v for
 * every head at once, a V row (the anchor's, or the row's own in x->ov at `own`) LANES columns at a time. */
static void own_query(const Job *j, int64_t b, const Anchor *a, int64_t i, const float *q, const int64_t *own, int n,
                      const Scratch *x) {
    const int64_t T = j->T, H = j->H, E = j->E;
    own_weights(j, b, a, i, q, own, n, x->ok, x);
    uint64_t mine = 0;   /* the keys whose V is the row's own (a row has some only where T ≤ 64) */
    for (int t = 0; t < n; ++t) mine |= (uint64_t)1 << own[t];
    float *y = row_at(j, b, i, x->row, x->rows);
    for (int64_t k = 0; k * LANES < E; ++k) {
        vec acc = {0};
        for (int64_t l = 0; l < T; ++l)
            acc += spread(j, x->eb + l * H, k) * load((n && (mine >> l & 1) ? x->ov : a->v) + l * E + k * LANES);
        store(y + k * LANES, acc * spread(j, x->inv, k));
    }
    put_row(j, b, i, x->row);
}

/* Row b in full: its projections into anchor a (and by head, tokens in lanes), then every query over every key. */
static void full_row(const Job *j, int64_t b, Anchor *a, const Scratch *x) {
    const int64_t T = j->T, H = j->H, dk = j->dk, dv = j->dv;
    for (int64_t t = 0; t < T; ++t)
        project(j, b, t, a->q + t * H * dk, a->k + t * H * dk, a->v + t * H * dv, x->tmp);
    a->row = b;
    a->keys = 0;
    a->finite = 1;
    for (int64_t t = 0; t < T && a->finite; ++t) a->finite = finite_token(j, b, t);
    transpose_anchor(j, a);
    for (int64_t i = 0; i < T; ++i) own_query(j, b, a, i, a->q + i * H * dk, NULL, 0, x);
    if (j->wo) project_out(j, b, x->rows, 0, T);
}

/* Row b from anchor a: the anchor's partials over the shared keys (computed on its first follower), its own tokens
 * projected, merged; its own queries over every key. */
static void follow(const Job *j, int64_t b, Anchor *a, uint64_t shared, const Scratch *x) {
    const int64_t T = j->T, H = j->H, dk = j->dk, dv = j->dv;
    const uint64_t all = T == 64 ? ~(uint64_t)0 : ((uint64_t)1 << T) - 1, mine = all & ~shared;
    int64_t own[MAX_OWN];
    int n = 0;
    if (a->keys != shared) anchor_partials(j, a, shared);
    for (uint64_t left = mine; left; left &= left - 1, ++n) {
        own[n] = __builtin_ctzll(left);
        project(j, b, own[n], x->oq + own[n] * H * dk, x->ok + own[n] * H * dk, x->ov + own[n] * H * dv, x->tmp);
    }
    merge(j, b, a, shared, own, n, x);
    for (int t = 0; t < n; ++t) {
        own_query(j, b, a, own[t], x->oq + own[t] * H * dk, own, n, x);
        if (j->wo) project_out(j, b, x->rows, own[t], 1);
    }
}

/* Block n's anchors, in its room. */
static Anchors *new_anchors(const Job *j, size_t n) {
    const int64_t T = j->T, H = j->H, dk = j->dk, each = anchor_floats(j);
    Anchors *set = &j->sets[n];
    set->next = 0;
    for (int i = 0; i < ANCHORS; ++i) {
        float *at = j->room + (int64_t)n * j->per_block + i * each;
        set->an[i] = (Anchor){.row = -1, .q = at, .k = at + T * H * dk, .v = at + 2 * T * H * dk};
        set->an[i].qd = set->an[i].v + T * H * j->dv + LANES;
        set->an[i].kd = set->an[i].qd + dk * j->Pp;
        set->an[i].pm = set->an[i].kd + dk * j->Pp;
        set->an[i].ps = set->an[i].pm + j->Pp;
        set->an[i].acc = set->an[i].ps + j->Pp;
        set->an[i].pw = set->an[i].acc + j->Tp * j->Ep;
    }
    return set;
}

/* Block n's scratch, in its room after its anchors. */
static Scratch scratch_of(const Job *j, size_t n) {
    const int64_t T = j->T, H = j->H, dk = j->dk, HP = j->HP;
    Scratch x = {.oq = j->room + (int64_t)n * j->per_block + ANCHORS * anchor_floats(j)};
    x.ok = x.oq + T * H * dk;
    x.ov = x.ok + T * H * dk;
    x.eb = x.ov + T * H * j->dv + LANES;
    x.top = x.eb + j->Pp + LANES;
    x.inv = x.top + HP;
    x.qt = x.inv + HP;
    x.cw = x.qt + dk * HP;
    x.ce = x.cw + j->Pp;
    x.okt = x.ce + MAX_OWN * j->Pp + LANES;
    x.row = x.okt + MAX_OWN * dk * HP;
    x.tmp = x.row + j->Ep;
    x.rows = x.tmp + j->C;
    x.rown = x.rows + (j->wo ? T * j->Ep : 0);
    return x;
}

/* Rows first .. end with the anchors of `set`: each follows an anchor whose tokens it shares, or is computed in full
 * (and becomes an anchor). */
static void run_rows(const Job *j, Anchors *set, const Scratch *x, int64_t first, int64_t end) {
    Anchor *an = set->an;
    for (int64_t b = first; b < end; ++b) {
        int followed = 0;
        for (int i = 0; i < ANCHORS && !followed && j->follow; ++i) {   /* else no sets, each row in full */
            const uint64_t shared = an[i].row < 0 || !an[i].finite ? 0 : shared_tokens(j, b, an[i].row);
            if (shared && same_mask(j, b, an[i].row, shared)) {
                follow(j, b, &an[i], shared, x);
                followed = 1;
            }
        }
        if (!followed) {
            full_row(j, b, &an[set->next], x);
            set->next = (set->next + 1) % ANCHORS;
        }
    }
}

/* Block n of the rows, from the anchors row 0 left (copied into its room before): which rows are computed in full,
 * and so every output bit, follows from the rows alone, whatever the threads and their timing. */
static void run_block(void *data, size_t n) {
    const Job *j = data;
    const Scratch x = scratch_of(j, n);
    const int64_t first = j->B * (int64_t)n / j->blocks, end = j->B * ((int64_t)n + 1) / j->blocks;
    run_rows(j, &j->sets[n], &x, first > 0 ? first : 1, end);
}

/* Row 0 in full with block 0's anchors, which every block then starts from (their floats copied into its room). */
static void first_row(const Job *j) {
    const Scratch x = scratch_of(j, 0);
    for (int64_t n = 0; n < j->blocks; ++n) new_anchors(j, (size_t)n);
    run_rows(j, &j->sets[0], &x, 0, 1);
    const size_t floats = (size_t)(ANCHORS * anchor_floats(j));
    for (int64_t n = 1; n < j->blocks; ++n) {
        memcpy(j->room + n * j->per_block, j->room, floats * sizeof(float));
        j->sets[n].next = j->sets[0].next;
        for (int i = 0; i < ANCHORS; ++i) {
            j->sets[n].an[i].row = j->sets[0].an[i].row;
            j->sets[n].an[i].keys = j->sets[0].an[i].keys;
        }
    }
}

/* ---------------------------------------------------------------------------------------------- plumbing */

/* The mask's element strides over [B, H, T, T] ([H, B, T, T] with mask_hb): broadcast where its dim is 1. */
static OrtStatus *mask_strides(Job *j, const int64_t *dims, size_t rank) {
    const int64_t full[4] = {j->k->mask_hb ? j->H : j->B, j->k->mask_hb ? j->B : j->H, j->T, j->T};
    for (int64_t x = 3, step = 1; x >= 0; --x) {
        const int64_t at = x - (4 - (int64_t)rank), dim = at < 0 ? 1 : dims[at];
        if (dim != 1 && dim != full[x]) return error("TokenAttention: the mask does not broadcast to the scores");
        j->ms[x] = dim == 1 ? 0 : step;
        step *= dim;
    }
    return NULL;
}

static OrtStatus *ORT_API_CALL compute(void *kernel, OrtKernelContext *ctx) {
    const Kernel *kn = kernel;
    size_t n_in, rank[7];
    int64_t d[7][4];
    const float *in[7];
    TRY(ort->KernelContext_GetInputCount(ctx, &n_in));
    for (size_t i = 0; i < 7; ++i)
        TRY(read_input(ctx, n_in, i, &in[i], d[i], &rank[i], 4, "TokenAttention: an input has rank > 4"));
    if (rank[0] != 3 || !in[2] || rank[2] != 2) return error("TokenAttention: xq [B, T, D] and w [D, C]");   /* xq may be empty */
    Job j = {.k = kn, .B = d[0][0], .T = d[0][1], .D = d[0][2], .C = d[2][1], .H = kn->heads, .dk = kn->dk,
             .dv = kn->dv, .xq = in[0], .xkv = in[1] ? in[1] : in[0], .w = in[2], .b = in[3],
             .mask = (const uint8_t *)in[4], .wo = in[5], .bo = in[6], .N = in[5] && rank[5] == 2 ? d[5][1] : 0};
    if (in[1] && (rank[1] != 3 || memcmp(d[1], d[0], 3 * sizeof(int64_t))))
        return error("TokenAttention: xkv differs from xq in shape");
    if (d[2][0] != j.D || (in[3] && (rank[3] != 1 || d[3][0] != j.C)))
        return error("TokenAttention: w is not [D, C] or b not [C]");
    for (int x = 0; x < 3; ++x)
        for (int64_t h = 0; h < j.H; ++h)
            if (kn->cols[x][h] < 0 || kn->cols[x][h] + (x == 2 ? j.dv : j.dk) > j.C)
                return error("TokenAttention: a head's columns are outside w");
    if (j.mask) TRY(mask_strides(&j, d[4], rank[4]));
    if (j.wo && (rank[5] != 2 || d[5][0] != j.H * j.dv || (j.bo && (rank[6] != 1 || d[6][0] != j.N)) ||
                 (kn->residual && j.N != j.D)))
        return error("TokenAttention: wo is not [heads·dv, N], bo not [N], or a residual not N wide");
    const int64_t dims[4] = {j.B, j.H, j.T, j.dv}, projected[3] = {kn->out_tb ? j.T : j.B, kn->out_tb ? j.B : j.T, j.N};
    int64_t written[4];
    for (int x = 0; x < 4; ++x) written[x] = dims[kn->has_perm ? kn->perm[x] : x];
    for (int64_t x = 3, step = 1; x >= 0; step *= written[x--]) j.ys[kn->has_perm ? kn->perm[x] : x] = step;
    OrtValue *out;
    TRY(ort->KernelContext_GetOutput(ctx, 0, j.wo ? projected : written, j.wo ? 3 : 4, &out));
    TRY(ort->GetTensorMutableData(out, (void **)&j.y));
    if (j.B == 0 || j.T == 0 || j.H == 0 || j.dv == 0 || (j.wo && j.N == 0)) return NULL;
    j.blocks = j.B < MAX_BLOCKS ? j.B : MAX_BLOCKS;
    j.Tp = (j.T + LANES - 1) / LANES * LANES;
    j.HP = (j.H + LANES - 1) / LANES * LANES;
    j.E = j.H * j.dv;
    j.Ep = (j.E + LANES - 1) / LANES * LANES;
    j.Pp = (j.T * j.H + LANES - 1) / LANES * LANES;
    j.direct = !j.wo && j.ys[3] == 1 && j.ys[1] == j.dv && j.E % LANES == 0;
    j.follow = j.T <= MAX_T && all_finite(j.w, j.D * j.C) && (!j.b || all_finite(j.b, j.C));
    j.per_block = ANCHORS * anchor_floats(&j) + scratch_floats(&j);
    j.room = malloc((size_t)(j.blocks * j.per_block) * sizeof(float));
    j.head_of = malloc((size_t)(j.Ep + j.Pp) * sizeof(int32_t));
    j.pair_head = j.head_of + j.Ep;
    j.sets = malloc((size_t)j.blocks * sizeof(Anchors));
    OrtStatus *s = NULL;
    if (j.room && j.head_of && j.sets) {
        for (int64_t c = 0; c < j.Ep; ++c) j.head_of[c] = c < j.E ? (int32_t)(c / j.dv) : 0;
        for (int64_t p = 0; p < j.Pp; ++p) j.pair_head[p] = (int32_t)(p % j.H);
        first_row(&j);
        s = ort->KernelContext_ParallelFor(ctx, run_block, (size_t)j.blocks, 0, &j);
    } else {
        s = ort->CreateStatus(ORT_FAIL, "TokenAttention: out of memory");
    }
    free(j.room);
    free(j.head_of);
    free(j.sets);
    return s;
}

/* Ints attribute `name` of exactly n values into out (n: H for the columns, 4 for the perm); 0 when absent. */
static OrtStatus *ints(const OrtKernelInfo *info, const char *name, int64_t n, int64_t *out, int *given) {
    size_t count = 0;
    OrtStatus *absent = ort->KernelInfoGetAttributeArray_int64(info, name, NULL, &count);
    if (absent) {
        ort->ReleaseStatus(absent);
        *given = 0;
        return NULL;
    }
    *given = 1;
    if ((int64_t)count != n) return error("TokenAttention: an attribute of the wrong length");
    return ort->KernelInfoGetAttributeArray_int64(info, name, out, &count);
}

static OrtStatus *ORT_API_CALL create(const OrtCustomOp *op, const OrtApi *api, const OrtKernelInfo *info,
                                      void **kernel) {
    (void)op;
    (void)api;
    Kernel *k = calloc(1, sizeof(Kernel));
    if (!k) return ort->CreateStatus(ORT_FAIL, "TokenAttention: out of memory");
    k->heads = int_attribute(info, "heads", 0);
    k->dk = int_attribute(info, "dk", 0);
    k->dv = int_attribute(info, "dv", 0);
    k->mask_on = int_attribute(info, "mask_on", 1);
    k->mask_replace = int_attribute(info, "mask_replace", 0);
    k->mask_hb = int_attribute(info, "mask_hb", 0);
    k->out_tb = int_attribute(info, "out_tb", 0);
    k->residual = int_attribute(info, "residual", 0);
    OrtStatus *s = k->heads < 1 || k->heads > MAX_T || k->dk < 1 || k->dv < 1
                       ? error("TokenAttention: heads (1 to 64), dk and dv are needed") : NULL;
    if (!s) s = ort->KernelInfoGetAttribute_float(info, "scale", &k->scale);
    if (!s) {
        OrtStatus *absent = ort->KernelInfoGetAttribute_float(info, "mask_value", &k->mask_value);
        if (absent) ort->ReleaseStatus(absent);
    }
    static const char *cols[3] = {"q_cols", "k_cols", "v_cols"};
    int given = 0, perm = 0;
    for (int x = 0; x < 3 && !s; ++x)
        if (!(s = ints(info, cols[x], k->heads, k->cols[x], &given)) && !given) s = error("TokenAttention: q/k/v_cols");
    if (!s) s = ints(info, "y_perm", 4, k->perm, &perm);
    k->has_perm = perm;
    for (int x = 0, seen = 0; x < 4 && perm && !s; ++x) {
        if (k->perm[x] < 0 || k->perm[x] > 3 || (seen >> k->perm[x]) & 1) s = error("TokenAttention: y_perm");
        seen |= 1 << (k->perm[x] & 3);
    }
    if (s) {
        free(k);
        return s;
    }
    *kernel = k;
    return NULL;
}

static const char *ORT_API_CALL name(const OrtCustomOp *op) { (void)op; return "TokenAttention"; }

static size_t ORT_API_CALL seven_inputs(const OrtCustomOp *op) { (void)op; return 7; }

static OrtCustomOpInputOutputCharacteristic ORT_API_CALL input_kind(const OrtCustomOp *op, size_t i) {
    (void)op;
    return i == 0 || i == 2 ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL;
}

OrtCustomOp ctropt_token_attention = CUSTOM_OP(name, float_then_mask, seven_inputs, float_type, one_count, input_kind,
                                               required, create, compute);
