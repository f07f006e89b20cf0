/* FMInteraction: a factorization machine's second order, (Σ_f e_f)² − Σ_f e_f² per embedding column, over a row's F
 * field embeddings [F, D], scaled and summed over the columns where the model does so.
 *
 * Every DeepFM export writes it as five ops or more: a ReduceSum over the fields, its square (Mul or Pow), the
 * square of the embeddings, their ReduceSum, the Sub; then often a Mul by 1/2 and a ReduceSum over the columns. Each
 * is a pass over the batch with onnxruntime's per-node cost; the kernel reads the embeddings once.
 *
 * Node (domain "ai.ctropt.kernels", made by fm-interaction-kernel):
 *   input    0 E [B, F, D] (float)
 *   attributes keepdims (int): the fields' axis kept as 1 ([B, 1, D]) or not ([B, D]);
 *            scale (float, default 1): the result times scale;
 *            reduce (int): 0, or the columns summed: 1 without their axis, 2 keeping it as 1
 *   outputs  0 Y: [B, 1, D] or [B, D]; with reduce, that shape's last axis dropped (1) or 1 (2)
 * The sums' order differs from onnxruntime's (the fields summed in order, the columns a vector of lanes at a time);
 * the square of the sum is rounded as its Mul rounds it (no fused multiply-add with the Sub).
 */
#include "kernels.h"

#define MAX_BLOCKS 64

typedef struct {
    int64_t keepdims, reduce;
    float scale;
} FmKernel;

typedef struct {
    const float *e;
    float *y;
    int64_t rows, F, D, blocks, reduce;
    float scale;
} Job;

/* rounded(): kernels.h (the square of the sum rounded as the Mul this replaces rounds it, and overflowing to inf as
 * it does: inf - inf is NaN there, where s·s - q in one FMA would be -inf). */
static void fm_block(void *data, size_t blk) {
    Job *j = data;
    const int64_t first = j->rows * (int64_t)blk / j->blocks, end = j->rows * ((int64_t)blk + 1) / j->blocks;
    const int64_t F = j->F, D = j->D;
    for (int64_t b = first; b < end; ++b) {
        const float *e = j->e + b * F * D;
        float *y = j->reduce ? j->y + b : j->y + b * D, total = 0;
        vec lanes = {0};
        int64_t c = 0;
        for (; c + LANES <= D; c += LANES) {
            vec s = {0}, q = {0};
            for (int64_t f = 0; f < F; ++f) {
                const vec v = load(e + f * D + c);
                s += v;
                q += v * v;
            }
            const vec r = (rounded(s * s) - q) * j->scale;
            if (j->reduce) lanes += r;
            else store(y + c, r);
        }
        for (; c < D; ++c) {
            float s = 0, q = 0;
            for (int64_t f = 0; f < F; ++f) {
                const float v = e[f * D + c];
                s += v;
                q += v * v;
            }
            const float r = (rounded1(s * s) - q) * j->scale;
            if (j->reduce) total += r;
            else y[c] = r;
        }
        if (j->reduce) {
            for (int l = 0; l < LANES; ++l) total += lanes[l];
            *y = total;
        }
    }
}

static OrtStatus *ORT_API_CALL compute(void *kernel, OrtKernelContext *ctx) {
    const FmKernel *k = kernel;
    int64_t d[3];
    size_t rank;
    Job j = {.reduce = k->reduce, .scale = k->scale};
    TRY(read_input(ctx, 1, 0, &j.e, d, &rank, 3, "FMInteraction: E must be [B, F, D]"));
    if (rank != 3) return error("FMInteraction: E must be [B, F, D]");   /* data NULL: empty */
    j.rows = d[0], j.F = d[1], j.D = d[2];
    int64_t out[3] = {j.rows, 1, j.D};
    size_t ro = k->keepdims ? 3 : 2;
    if (!k->keepdims) out[1] = j.D;
    if (k->reduce == 1) ro -= 1;
    else if (k->reduce == 2) out[ro - 1] = 1;
    OrtValue *y;
    TRY(ort->KernelContext_GetOutput(ctx, 0, out, ro, &y));
    TRY(ort->GetTensorMutableData(y, (void **)&j.y));
    if (j.rows == 0 || (!j.reduce && j.D == 0)) return NULL;
    j.blocks = j.rows < MAX_BLOCKS ? j.rows : MAX_BLOCKS;
    return ort->KernelContext_ParallelFor(ctx, fm_block, (size_t)j.blocks, 0, &j);
}

static OrtStatus *ORT_API_CALL create(const OrtCustomOp *op, const OrtApi *api, const OrtKernelInfo *info,
                                      void **kernel) {
    (void)op;
    (void)api;
    FmKernel *k = calloc(1, sizeof(FmKernel));
    if (!k) return ort->CreateStatus(ORT_FAIL, "FMInteraction: out of memory");
    OrtStatus *s = ort->KernelInfoGetAttribute_int64(info, "keepdims", &k->keepdims);
    if (!s) s = ort->KernelInfoGetAttribute_int64(info, "reduce", &k->reduce);
    if (!s) s = ort->KernelInfoGetAttribute_float(info, "scale", &k->scale);
    if (!s && (k->reduce < 0 || k->reduce > 2)) s = error("FMInteraction: reduce must be 0, 1 or 2");
    if (s) {
        free(k);
        return s;
    }
    *kernel = k;
    return NULL;
}

static const char *ORT_API_CALL name(const OrtCustomOp *op) { (void)op; return "FMInteraction"; }

OrtCustomOp ctropt_fm_interaction = CUSTOM_OP(name, float_type, one_count, float_type, one_count, required, required,
                                              create, compute);
