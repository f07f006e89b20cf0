/* TokenAttention: self-attention from the tokens, the Q, K and V projections in the kernel, and a row's work reused
 * by the rows after it that hold most of the same tokens (one user's history with each candidate's own token).
 *
 * Node (domain "ai.ctropt.kernels", made by token-attention):
 *   inputs   0 xq [B, T, D]: the tokens the queries are projected from
 *            1 xkv [B, T, D]: the tokens of the keys and values (empty: xq's)                            optional
 *            2 w [D, C]: the projections' weights, the columns of every head's Q, K and V among them
 *            3 b [C]: their bias                                                                          optional
 *            4 mask (bool), broadcastable to [B, H, T, T] ([H, B, T, T] with mask_hb)                    optional
 *   outputs  0 Y [B, H, T, dv], written as Transpose(Y, y_perm) (given: a permutation of 4 axes)
 *   attributes heads, dk, dv (ints); q_cols, k_cols, v_cols (ints, one per head: its first column in w);
 *            scale (float); mask_value (float), mask_on, mask_replace, mask_hb (ints), as AttentionCore's
 *
 * Head h of row b: q_t = xq[b, t]·w[:, q_cols[h] : + dk] + b[..] (k and v from xkv), softmax(scale · q·kᵀ, the mask
 * applied as AttentionCore applies it) · v. A row computed in full keeps its projections (an anchor); a later row
 * whose tokens have the anchor's bits on all but at most a quarter of the positions, and whose mask agrees among those,
 * projects only its own tokens and merges them into the anchor's softmax partials over the shared keys (max, sum,
 * Σ e·v: two partial softmaxes merged, as flash attention does). Equal tokens give equal projections and scores, so
 * the result is the decomposed graph's up to rounding (the order of sums, the merge's rescaling).
 */
#include <math.h>

#include "kernels.h"

#define MAX_T 64        /* tokens a row may share with another (the shared set is a bitmask); more: each in full */
#define ANCHORS 4       /* rows kept per block, the most recent computed in full */
#define MAX_BLOCKS 4    /* of rows: a block finds its anchors within itself */
#define MAX_OWN (MAX_T / 4 + 1)   /* tokens of its own a row may have to follow an anchor */

typedef struct {
    int64_t heads, dk, dv, cols[3][MAX_T], mask_on, mask_replace, mask_hb, perm[4], has_perm;
    float scale, mask_value;
} Kernel;

typedef struct {
    const Kernel *k;
    int64_t B, T, Tp, D, C, H, dk, dv;   /* Tp: T rounded up to LANES */
    const float *xq, *xkv, *w, *b;
    const uint8_t *mask;
    int64_t ms[4], ys[4];   /* element strides: mask over [B, H, i, j], y over [B, H, t, c] */
    float *y, *room;        /* room: per block, its anchors and a row's own projections */
    int64_t blocks, per_block;
} Job;

typedef struct {   /* a row's projections, and its softmax partials over a set of shared keys */
    int64_t row;   /* -1: none */
    uint64_t keys;
    float *q, *k, *v;   /* [T][H][dk], [T][H][dk], [T][H][dv] */
    float *qt, *part;   /* per head, queries in lanes: Q [H][dk][Tp], the partials over `keys`: max and sum
                         * [H][2][Tp], then Σ e·v [H][Tp][dv] */
    float *kt;          /* per head, keys in lanes: K [H][dk][Tp] */
} Anchor;

/* The floats an anchor takes. */
static int64_t anchor_floats(const Job *j) {
    return j->T * j->H * (2 * j->dk + j->dv) + j->H * j->Tp * (2 * j->dk + 2 + j->dv);
}

/* y = a·x + b·z and y += b·z over n floats. The head sizes common in rankers are constants the compiler sees
 * (BY_HEAD_SIZE: the loop unrolled and vectorized, no remainder loop per call), others a plain loop. */
static inline void mix_n(float *restrict y, float a, const float *restrict x, float b, const float *restrict z,
                         int64_t n) {
    for (int64_t c = 0; c < n; ++c) y[c] = a * x[c] + b * z[c];
}
static inline void add_n(float *restrict y, float b, const float *restrict z, int64_t n) {
    for (int64_t c = 0; c < n; ++c) y[c] += b * z[c];
}
#define BY_HEAD_SIZE(n, CALL)                              \
    switch (n) {                                          \
    case 4: CALL(4); break;                               \
    case 6: CALL(6); break;                               \
    case 8: CALL(8); break;                               \
    case 12: CALL(12); break;                             \
    case 16: CALL(16); break;                             \
    case 32: CALL(32); break;                             \
    default: CALL(n);                                     \
    }

/* Token t of row b projected: each head's Q into q, K into k, V into v ([H][dk], [H][dk], [H][dv]), from one pass
 * over w's columns (tmp: C floats; xkv read too where it is another tensor). */
static void project(const Job *j, int64_t b, int64_t t, float *q, float *k, float *v, float *tmp) {
    const int64_t H = j->H, dk = j->dk, dv = j->dv;
    for (int pass = 0; pass < (j->xkv == j->xq ? 1 : 2); ++pass) {
        const float *x = (pass ? j->xkv : j->xq) + (b * j->T + t) * j->D;
        int64_t c0 = 0;
        for (; c0 + 4 * LANES <= j->C; c0 += 4 * LANES) {   /* four vectors of columns in registers */
            vec acc[4];
            for (int r = 0; r < 4; ++r) acc[r] = j->b ? load(j->b + c0 + r * LANES) : splat(0.0f);
            for (int64_t d = 0; d < j->D; ++d)
                for (int r = 0; r < 4; ++r) acc[r] += load(j->w + d * j->C + c0 + r * LANES) * x[d];
            for (int r = 0; r < 4; ++r) store(tmp + c0 + r * LANES, acc[r]);
        }
        for (; c0 + LANES <= j->C; c0 += LANES) {
            vec acc = j->b ? load(j->b + c0) : splat(0.0f);
            for (int64_t d = 0; d < j->D; ++d) acc += load(j->w + d * j->C + c0) * x[d];
            store(tmp + c0, acc);
        }
        for (int64_t c = c0; c < j->C; ++c) tmp[c] = j->b ? j->b[c] : 0.0f;
        for (int64_t d = 0; d < j->D; ++d) {
            const float xd = x[d], *wd = j->w + d * j->C;
            for (int64_t c = c0; c < j->C; ++c) tmp[c] += xd * wd[c];
        }
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

/* Query i of head h (q: its dk values) over the keys in `keys` (K and V rows from `own` where set there, else the
 * anchor's): p[0], p[step] = max, sum; acc[c] = Σ e·v. */
static void partial(const Job *j, int64_t b, int64_t h, int64_t i, const float *q, uint64_t keys, uint64_t own,
                    const Anchor *a, const float *ok, const float *ov, float *p, int64_t step, float *out) {
    float s[MAX_T], top = -__builtin_inff(), sum = 0.0f, acc[j->dv];
    const int64_t H = j->H, dk = j->dk, dv = j->dv;
    for (uint64_t left = keys; left; left &= left - 1) {
        const int64_t l = __builtin_ctzll(left);
        const float *k = (own >> l & 1 ? ok : a->k) + (l * H + h) * dk;
        float x = 0.0f;
        for (int64_t d = 0; d < dk; ++d) x += q[d] * k[d];
        s[l] = masked(j, x * j->k->scale, mask_at(j, b, h, i, l));
        top = s[l] > top ? s[l] : top;
    }
    for (int64_t c = 0; c < dv; ++c) acc[c] = 0.0f;
    for (uint64_t left = keys; left && top != -__builtin_inff(); left &= left - 1) {
        const int64_t l = __builtin_ctzll(left);
        const float e = expf(s[l] - top), *v = (own >> l & 1 ? ov : a->v) + (l * H + h) * dv;
        sum += e;
        for (int64_t c = 0; c < dv; ++c) acc[c] += e * v[c];
    }
    p[0] = top;
    p[step] = sum;
    memcpy(out, acc, (size_t)dv * sizeof(float));
}

/* The positions where row b's tokens (xq's and xkv's) have the anchor's bits; 0 when more than a quarter differ. */
static uint64_t shared_tokens(const Job *j, int64_t b, int64_t a) {
    uint64_t same = 0;
    const size_t bytes = (size_t)j->D * sizeof(float);
    for (int64_t t = 0, differ = 0; t < j->T; ++t) {
        if (!memcmp(j->xq + (b * j->T + t) * j->D, j->xq + (a * j->T + t) * j->D, bytes) &&
            (j->xkv == j->xq || !memcmp(j->xkv + (b * j->T + t) * j->D, j->xkv + (a * j->T + t) * j->D, bytes)))
            same |= (uint64_t)1 << t;
        else if (++differ >= (j->T / 4 + 1 < MAX_OWN ? j->T / 4 + 1 : MAX_OWN))   /* at most a quarter differ */
            return 0;
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

/* The anchor's Q and K by head with the tokens in lanes (zeros past T). */
static void transpose_anchor(const Job *j, Anchor *a) {
    const int64_t H = j->H, dk = j->dk, Tp = j->Tp;
    for (int64_t h = 0; h < H; ++h) {
        float *qt = a->qt + h * dk * Tp, *kt = a->kt + h * dk * Tp;
        for (int64_t i = 0; i < Tp; ++i) {
            for (int64_t d = 0; d < dk; ++d) {
                qt[d * Tp + i] = i < j->T ? a->q[(i * H + h) * dk + d] : 0.0f;
                kt[d * Tp + i] = i < j->T ? a->k[(i * H + h) * dk + d] : 0.0f;
            }
        }
    }
}

/* The anchor's partials over the shared keys for its shared queries (queries in lanes). */
static void anchor_partials(const Job *j, Anchor *a, uint64_t shared) {
    const int64_t H = j->H, dk = j->dk, dv = j->dv, Tp = j->Tp;
    for (int64_t h = 0; h < H; ++h) {
        float *part = a->part + h * 2 * Tp, *acc = a->part + H * 2 * Tp + h * Tp * dv;
        for (int64_t i = 0; i < Tp; ++i) {
            if (i < j->T && (shared >> i & 1)) {
                partial(j, a->row, h, i, a->q + (i * H + h) * dk, shared, 0, a, NULL, NULL, part + i, Tp, acc + i * dv);
            } else {
                part[i] = -__builtin_inff();
                part[Tp + i] = 0.0f;
                memset(acc + i * dv, 0, (size_t)dv * sizeof(float));
            }
        }
    }
    a->keys = shared;
}

/* LANES shared queries of head h from i0 (`lanes`: those to write): the anchor's partials merged with the row's own
 * keys (n of them: K and V rows in ok, ov at `own`), vectors over the queries. */
static void merge_lanes(const Job *j, int64_t b, const Anchor *a, int64_t h, int64_t i0, uint32_t lanes,
                        const int64_t *own, int n, const float *ok, const float *ov) {
    const int64_t H = j->H, dk = j->dk, dv = j->dv, Tp = j->Tp;
    const float *qt = a->qt + h * dk * Tp + i0, *part = a->part + h * 2 * Tp + i0;
    const float *old = a->part + H * 2 * Tp + (h * Tp + i0) * dv;
    vec e[MAX_OWN], top = load(part);
    for (int t = 0; t < n; ++t) {
        const float *k = ok + (own[t] * H + h) * dk;
        vec x = {0};
        for (int64_t d = 0; d < dk; ++d) x += load(qt + d * Tp) * k[d];
        x *= j->k->scale;
        if (j->mask)
            for (int i = 0; i < LANES; ++i)
                x[i] = i0 + i < j->T ? masked(j, x[i], mask_at(j, b, h, i0 + i, own[t])) : x[i];
        e[t] = x;
        top = pick(x > top, x, top);
    }
    const vec w_old = exp_vec(load(part) - top);   /* every key masked (-inf - -inf): NaN, as onnxruntime gives */
    vec sum = load(part + Tp) * w_old;
    for (int t = 0; t < n; ++t) sum += e[t] = exp_vec(e[t] - top);
    const vec inv = 1.0f / sum;
    float *y = j->y + b * j->ys[0] + h * j->ys[1] + i0 * j->ys[2];
    for (int i = 0; i < LANES; ++i) {   /* a query row at a time: its dv values contiguous, in the partials too */
        if (!(lanes >> i & 1)) continue;
        const float *acc = old + i * dv, wo = w_old[i] * inv[i];
        float *yi = y + i * j->ys[2];
        if (n == 1 && j->ys[3] == 1) {   /* the common case, one token of its own: a loop the compiler vectorizes */
            const float *v = ov + (own[0] * H + h) * dv, en = e[0][i] * inv[i];
#define MIX(k) mix_n(yi, wo, acc, en, v, k)
            BY_HEAD_SIZE(dv, MIX)
#undef MIX
            continue;
        }
        for (int64_t c = 0; c < dv; ++c) {
            float x = acc[c] * wo;
            for (int t = 0; t < n; ++t) x += e[t][i] * inv[i] * ov[(own[t] * H + h) * dv + c];
            yi[c * j->ys[3]] = x;
        }
    }
}

static inline float hsum(vec v) {
    float s = 0.0f;
    for (int i = 0; i < LANES; ++i) s += v[i];
    return s;
}

/* Query i of head h of row b, one of its own tokens (q: its projection), over every key, keys in lanes: the
 * anchor's K and V (transposed) where the row shares its tokens, its own (ok, ov at `own`) where not; s: Tp floats. */
static void own_query(const Job *j, int64_t b, const Anchor *a, int64_t h, int64_t i, const float *q,
                      const int64_t *own, int n, const float *ok, const float *ov, float *s) {
    const int64_t H = j->H, dk = j->dk, dv = j->dv, Tp = j->Tp;
    const float *kt = a->kt + h * dk * Tp;
    vec top = splat(-__builtin_inff()), sum = {0};
    for (int64_t l0 = 0; l0 < Tp; l0 += LANES) {
        vec x = {0};
        for (int64_t d = 0; d < dk; ++d) x += load(kt + d * Tp + l0) * q[d];
        store(s + l0, x * j->k->scale);
    }
    for (int t = 0; t < n; ++t) {
        const float *k = ok + (own[t] * H + h) * dk;
        float x = 0.0f;
        for (int64_t d = 0; d < dk; ++d) x += q[d] * k[d];
        s[own[t]] = x * j->k->scale;
    }
    const int64_t row = j->mask ? mask_at(j, b, h, i, 0) : 0;
    for (int64_t l = 0; l < Tp; ++l) s[l] = l < j->T ? masked(j, s[l], row + l * j->ms[3]) : -__builtin_inff();
    for (int64_t l0 = 0; l0 < Tp; l0 += LANES) top = pick(load(s + l0) > top, load(s + l0), top);
    float m = top[0];
    for (int k = 1; k < LANES; ++k) m = top[k] > m ? top[k] : m;
    for (int64_t l0 = 0; l0 < Tp; l0 += LANES) {   /* every key masked (-inf - -inf): NaN, as onnxruntime gives */
        const vec e = exp_vec(load(s + l0) - m);
        store(s + l0, e);
        sum += e;
    }
    const float inv = 1.0f / hsum(sum);
    uint64_t mine = 0;   /* the keys whose V is the row's own (a row has some only where T ≤ 64) */
    for (int t = 0; t < n; ++t) mine |= (uint64_t)1 << own[t];
    float acc[dv], *y = j->y + b * j->ys[0] + h * j->ys[1] + i * j->ys[2];
    memset(acc, 0, sizeof acc);
    for (int64_t l = 0; l < j->T; ++l) {   /* Σ e·v over the keys, a V row at a time */
        const float *v = (n && (mine >> l & 1) ? ov : a->v) + (l * H + h) * dv;
#define ADD(k) add_n(acc, s[l], v, k)
        BY_HEAD_SIZE(dv, ADD)
#undef ADD
    }
    for (int64_t c = 0; c < dv; ++c) y[c * j->ys[3]] = acc[c] * inv;
}

/* Row b in full: its projections into anchor a (and by head, tokens in lanes), then every head's queries over
 * every key (p: room for Tp scores; tmp: for C floats). */
static void full_row(const Job *j, int64_t b, Anchor *a, float *p, float *tmp) {
    const int64_t T = j->T, H = j->H, dk = j->dk, dv = j->dv;
    for (int64_t t = 0; t < T; ++t)
        project(j, b, t, a->q + t * H * dk, a->k + t * H * dk, a->v + t * H * dv, tmp);
    a->row = b;
    a->keys = 0;
    transpose_anchor(j, a);
    for (int64_t h = 0; h < H; ++h)
        for (int64_t i = 0; i < T; ++i) own_query(j, b, a, h, i, a->q + (i * H + h) * dk, NULL, 0, NULL, NULL, p);
}

/* Row b from anchor a: the anchor's partials over the shared keys (computed on its first follower), its own tokens
 * projected into oq, ok, ov, merged; its own queries over every key. */
static void follow(const Job *j, int64_t b, Anchor *a, uint64_t shared, float *oq, float *ok, float *ov, float *p,
                   float *tmp) {
    const int64_t T = j->T, H = j->H, dk = j->dk, dv = j->dv;
    const uint64_t all = T == 64 ? ~(uint64_t)0 : ((uint64_t)1 << T) - 1, mine = all & ~shared;
    int64_t own[MAX_OWN];
    int n = 0;
    if (a->keys != shared) anchor_partials(j, a, shared);
    for (uint64_t left = mine; left; left &= left - 1, ++n) {
        own[n] = __builtin_ctzll(left);
        project(j, b, own[n], oq + own[n] * H * dk, ok + own[n] * H * dk, ov + own[n] * H * dv, tmp);
    }
    for (int64_t h = 0; h < H; ++h) {
        for (int64_t i0 = 0; i0 < T; i0 += LANES) {
            const uint32_t lanes = (uint32_t)(shared >> i0) & (T - i0 < LANES ? (1u << (T - i0)) - 1 : 0xffu);
            if (lanes) merge_lanes(j, b, a, h, i0, lanes, own, n, ok, ov);
        }
        for (int t = 0; t < n; ++t) own_query(j, b, a, h, own[t], oq + (own[t] * H + h) * dk, own, n, ok, ov, p);
    }
}

/* Block n of the rows, with its anchors. */
static void run_block(void *data, size_t n) {
    const Job *j = data;
    const int64_t T = j->T, H = j->H, each = anchor_floats(j);
    float *room = j->room + (int64_t)n * j->per_block;
    Anchor an[ANCHORS];
    for (int i = 0; i < ANCHORS; ++i) {
        float *at = room + i * each;
        an[i] = (Anchor){.row = -1, .q = at, .k = at + T * H * j->dk, .v = at + 2 * T * H * j->dk,
                         .qt = at + T * H * (2 * j->dk + j->dv), .part = at + T * H * (2 * j->dk + j->dv) +
                                                                          H * j->Tp * j->dk};
        an[i].kt = an[i].part + H * j->Tp * (2 + j->dv);   /* after max, sum and Σ e·v */
    }
    float *oq = room + ANCHORS * each, *ok = oq + T * H * j->dk, *ov = ok + T * H * j->dk, *p = ov + T * H * j->dv;
    float *tmp = p + 2 + j->dv + j->Tp;   /* p: a partial, or a row of scores */
    int next = 0;
    for (int64_t b = j->B * (int64_t)n / j->blocks; b < j->B * ((int64_t)n + 1) / j->blocks; ++b) {
        int followed = 0;
        for (int i = 0; i < ANCHORS && !followed && T <= MAX_T; ++i) {   /* longer: no sets, each row in full */
            const uint64_t shared = an[i].row < 0 ? 0 : shared_tokens(j, b, an[i].row);
            if (shared && same_mask(j, b, an[i].row, shared)) {
                follow(j, b, &an[i], shared, oq, ok, ov, p, tmp);
                followed = 1;
            }
        }
        if (!followed) {
            full_row(j, b, &an[next], p, tmp);
            next = (next + 1) % ANCHORS;
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
    size_t n_in, rank[5];
    int64_t d[5][4];
    const float *in[5];
    TRY(ort->KernelContext_GetInputCount(ctx, &n_in));
    for (size_t i = 0; i < 5; ++i)
        TRY(read_input(ctx, n_in, i, &in[i], d[i], &rank[i], 4, "TokenAttention: an input has rank > 4"));
    if (!in[0] || rank[0] != 3 || !in[2] || rank[2] != 2) return error("TokenAttention: xq [B, T, D] and w [D, C]");
    Job j = {.k = kn, .B = d[0][0], .T = d[0][1], .D = d[0][2], .C = d[2][1], .H = kn->heads, .dk = kn->dk,
             .dv = kn->dv, .xq = in[0], .xkv = in[1] ? in[1] : in[0], .w = in[2], .b = in[3],
             .mask = (const uint8_t *)in[4]};
    if (in[1] && (rank[1] != 3 || memcmp(d[1], d[0], 3 * sizeof(int64_t))))
        return error("TokenAttention: xkv differs from xq in shape");
    if (d[2][0] != j.D || (in[3] && (rank[3] != 1 || d[3][0] != j.C)))
        return error("TokenAttention: w is not [D, C] or b not [C]");
    for (int x = 0; x < 3; ++x)
        for (int64_t h = 0; h < j.H; ++h)
            if (kn->cols[x][h] < 0 || kn->cols[x][h] + (x == 2 ? j.dv : j.dk) > j.C)
                return error("TokenAttention: a head's columns are outside w");
    if (j.mask) TRY(mask_strides(&j, d[4], rank[4]));
    const int64_t dims[4] = {j.B, j.H, j.T, j.dv};
    int64_t written[4];
    for (int x = 0; x < 4; ++x) written[x] = dims[kn->has_perm ? kn->perm[x] : x];
    for (int64_t x = 3, step = 1; x >= 0; step *= written[x--]) j.ys[kn->has_perm ? kn->perm[x] : x] = step;
    OrtValue *out;
    TRY(ort->KernelContext_GetOutput(ctx, 0, written, 4, &out));
    TRY(ort->GetTensorMutableData(out, (void **)&j.y));
    if (j.B == 0 || j.T == 0 || j.H == 0 || j.dv == 0) return NULL;
    j.blocks = j.B < MAX_BLOCKS ? j.B : MAX_BLOCKS;
    j.Tp = (j.T + LANES - 1) / LANES * LANES;
    j.per_block = ANCHORS * anchor_floats(&j) + j.T * j.H * (2 * j.dk + j.dv) + 2 + j.dv + j.Tp + j.C + j.T;
    j.room = malloc((size_t)(j.blocks * j.per_block) * sizeof(float));
    if (!j.room) return ort->CreateStatus(ORT_FAIL, "TokenAttention: out of memory");
    OrtStatus *s = ort->KernelContext_ParallelFor(ctx, run_block, (size_t)j.blocks, 0, &j);
    free(j.room);
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

static OrtCustomOpInputOutputCharacteristic ORT_API_CALL input_kind(const OrtCustomOp *op, size_t i) {
    (void)op;
    return i == 0 || i == 2 ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL;
}

OrtCustomOp ctropt_token_attention = CUSTOM_OP(name, float_then_mask, five_inputs, float_type, one_count, input_kind, required,
                                               create, compute);
