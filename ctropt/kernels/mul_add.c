/* MulAdd: y = a * b + c (+ d), the elementwise tail of a cross layer (DCN: x0 · s + b + xₗ with s = xₗ·w per row;
 * DCNv2: x0 ⊙ (W xₗ + b) + xₗ), in one pass where onnxruntime makes two or three.
 *
 * onnxruntime runs each elementwise op as its own pass over [N, D], and a vector that broadcasts along the rows
 * (a bias [D]) a row at a time: a PaddleRec DCN cross layer's three ops over [256, 221] take 1.68× the kernel's time
 * (benchmarks/small_ops.py). Rounded as the ops it replaces: the product, then each sum in turn (no fused multiply-add;
 * a value broadcast keeps its sign of zero), so equal to them bit for bit; no rows (an empty input) give an empty y.
 *
 * Node (domain "ai.ctropt.kernels", made by mul-add-kernel):
 *   inputs   0 a, 1 b, 2 c, 3 d (optional): float, each broadcastable to the output [..., D] in one of four ways,
 *            checked at run time: the output's shape (a full value), [..., 1] with the output's leading dims (a
 *            value per row), [D] with leading 1s (a value per column), or one value
 *   outputs  0 y: the numpy broadcast of the inputs' shapes
 */
#include <stdio.h>

#include "kernels.h"


#define MAX_RANK 8
#define MAX_BLOCKS 64
#define MAX_INPUTS 4

typedef struct {
    const float *p[MAX_INPUTS];
    int64_t row_step[MAX_INPUTS], col_step[MAX_INPUTS];   /* elements per row and per column: D/1/0 and 1/0 */
    size_t n;                                             /* inputs */
    float *y;
    int64_t rows, D, blocks;
} Job;

/* rounded(): kernels.h (the product rounded as the Mul this replaces rounds it). */

/* x in every lane: a broadcast, not (vec){0} + x (0 + -0.0 is +0.0, and -0.0 · b is not +0.0 · b). */
static inline vec broadcast(float x) {
    vec v;
    for (int l = 0; l < LANES; ++l) v[l] = x;
    return v;
}

/* Operand k at columns c.. of a row: its own values (col_step 1) or the row's one value, broadcast. */
static inline vec at(const Job *j, size_t k, const float *const *p, const vec *splat, int64_t c) {
    return j->col_step[k] ? load(p[k] + c) : splat[k];
}

static void mul_add_block(void *data, size_t b) {
    Job *j = data;
    const int64_t first = j->rows * (int64_t)b / j->blocks, end = j->rows * ((int64_t)b + 1) / j->blocks;
    const float *p[MAX_INPUTS];
    vec splat[MAX_INPUTS];
    for (int64_t r = first; r < end; ++r) {
        for (size_t k = 0; k < j->n; ++k) {
            p[k] = j->p[k] + r * j->row_step[k];
            splat[k] = broadcast(p[k][0]);
        }
        float *y = j->y + r * j->D;
        int64_t c = 0;
        for (; c + LANES <= j->D; c += LANES) {
            vec v = rounded(at(j, 0, p, splat, c) * at(j, 1, p, splat, c)) + at(j, 2, p, splat, c);
            store(y + c, j->n > 3 ? v + at(j, 3, p, splat, c) : v);
        }
        for (; c < j->D; ++c) {
            float v = rounded1(p[0][c * j->col_step[0]] * p[1][c * j->col_step[1]]) + p[2][c * j->col_step[2]];
            y[c] = j->n > 3 ? v + p[3][c * j->col_step[3]] : v;
        }
    }
}

/* How input k (dims d, rank rk) reads the output [rows, D] (dims out, rank ro): its row and column steps. */
static OrtStatus *steps(Job *j, size_t k, const int64_t *d, size_t rk, const int64_t *out, size_t ro) {
    int64_t numel = 1, lead_ones = 1, lead_same = rk == ro;
    for (size_t x = 0; x < rk; ++x) {
        numel *= d[x];
        if (x + 1 < rk) {
            lead_ones &= d[x] == 1;
            lead_same &= d[x] == out[x];
        }
    }
    const int64_t last = rk ? d[rk - 1] : 1;
    if (numel == 1) {
        j->row_step[k] = j->col_step[k] = 0;
    } else if (lead_same && last == j->D) {
        j->row_step[k] = j->D, j->col_step[k] = 1;
    } else if (lead_ones && last == j->D) {
        j->row_step[k] = 0, j->col_step[k] = 1;
    } else if (lead_same && last == 1) {
        j->row_step[k] = 1, j->col_step[k] = 0;
    } else {
        char msg[128];
        snprintf(msg, sizeof msg, "MulAdd: input %zu broadcasts along an inner axis, which the kernel does not take", k);
        return error(msg);
    }
    return NULL;
}

static OrtStatus *ORT_API_CALL compute(void *kernel, OrtKernelContext *ctx) {
    (void)kernel;
    size_t n_in, rank[MAX_INPUTS], ro = 0;
    int64_t dims[MAX_INPUTS][MAX_RANK], out[MAX_RANK];
    Job j = {0};
    TRY(ort->KernelContext_GetInputCount(ctx, &n_in));
    j.n = n_in > MAX_INPUTS ? MAX_INPUTS : n_in;
    for (size_t k = 0; k < j.n; ++k) {
        TRY(read_input(ctx, j.n, k, &j.p[k], dims[k], &rank[k], MAX_RANK, "MulAdd: an input has rank > 8"));
        if (!j.p[k] && !rank[k]) return error("MulAdd: an input is missing");   /* data NULL with dims: empty */
        ro = rank[k] > ro ? rank[k] : ro;
    }
    for (size_t x = 0; x < ro; ++x) {   /* numpy broadcasting, aligned on the last axis */
        out[x] = 1;
        for (size_t k = 0; k < j.n; ++k) {
            const int64_t at = (int64_t)x - (int64_t)(ro - rank[k]);
            const int64_t d = at < 0 ? 1 : dims[k][at];
            if (d != 1 && out[x] != 1 && d != out[x]) return error("MulAdd: the inputs do not broadcast");
            if (d != 1) out[x] = d;
        }
    }
    j.D = ro ? out[ro - 1] : 1;
    j.rows = 1;
    for (size_t x = 0; x + 1 < ro; ++x) j.rows *= out[x];
    for (size_t k = 0; k < j.n; ++k) {
        int64_t padded[MAX_RANK];   /* the input's dims with the output's rank: leading 1s */
        for (size_t x = 0; x < ro; ++x) padded[x] = x < ro - rank[k] ? 1 : dims[k][x - (ro - rank[k])];
        TRY(steps(&j, k, padded, ro, out, ro));
    }
    OrtValue *y;
    TRY(ort->KernelContext_GetOutput(ctx, 0, out, ro, &y));
    TRY(ort->GetTensorMutableData(y, (void **)&j.y));
    if (j.rows == 0 || j.D == 0) return NULL;
    j.blocks = j.rows < MAX_BLOCKS ? j.rows : MAX_BLOCKS;
    return ort->KernelContext_ParallelFor(ctx, mul_add_block, (size_t)j.blocks, 0, &j);
}

static const char *ORT_API_CALL name(const OrtCustomOp *op) { (void)op; return "MulAdd"; }
static size_t ORT_API_CALL n_inputs(const OrtCustomOp *op) { (void)op; return MAX_INPUTS; }
static OrtCustomOpInputOutputCharacteristic ORT_API_CALL input_kind(const OrtCustomOp *op, size_t i) {
    (void)op;
    return i < 3 ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL;
}

OrtCustomOp ctropt_mul_add = CUSTOM_OP(name, float_type, n_inputs, float_type, one_count, input_kind, required,
                                       no_attributes, compute);
