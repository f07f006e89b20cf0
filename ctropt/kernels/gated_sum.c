/* GatedSum: a mixture of experts' output, y = Σₑ g[:, e] · xₑ, each row's experts weighted by its gate and summed
 * (MMoE's and PLE's per-task mix).
 *
 * Exporters write the mix as a stack of the experts (an Unsqueeze each and a Concat, or a Concat and a Reshape), the
 * gate made a row ([B, 1, E], through Unsqueeze/Squeeze/Reshape), a batched MatMul and a Squeeze: eight to twelve
 * nodes for two tasks, each a pass over the batch with onnxruntime's per-node cost. The kernel reads each expert
 * where it is and writes the mix once.
 *
 * The gate's own last ops can go in too: the Softmax that makes it, and the projection before that (a gate's last
 * layer, [B, H] × [H, E] + b, for E ≤ 8: onnxruntime's GEMM at N = 3 costs as much as at N = 64).
 *
 * Node (domain "ai.ctropt.kernels", made by gated-sum-kernel):
 *   inputs   0 g: B·E floats, row-major by row then expert (any shape: [B, E], [B, 1, E], ...); with project, h [B, H]
 *            with project: 1 W [H, E], 2 b [E] (float)
 *            then the E experts xₑ: float, each B·D values, [..., D] (D: the first expert's last dim)
 *   attributes keepdims (int): Y is [B, 1, D] (1) or [B, D] (0)
 *            softmax (int, optional): the gate is softmax(g) over each row's E values
 *            project (int, optional): g = h·W + b first (then softmax; E ≤ 8)
 *   outputs  0 Y
 * Each row's sum runs over the experts in order, as the MatMul's does (its rounding may differ by the order of its
 * blocking).
 */
#include <math.h>

#include "kernels.h"

#define MAX_EXPERTS 256
#define MAX_RANK 8
#define MAX_BLOCKS 64
#define CHUNK_VALUES 512   /* gate values computed at once (a chunk of rows) */

typedef struct {
    int64_t keepdims, softmax, project;
} GatedKernel;

typedef struct {
    const float *g, *x[MAX_EXPERTS], *W, *b;
    vec *Wp, bias;   /* project: W's rows and b, each padded to LANES (b's lanes past E: -inf) */
    float *y;
    int64_t rows, E, D, H, blocks, softmax;
} Job;

/* Rows [first, first + n) of the gate into w (n·E values): h·W + b (project) or g, then, with softmax, each row's
 * softmax: its max subtracted, exp over all n·E values a vector at a time, each row divided by its sum. */
static void chunk_gates(const Job *j, int64_t first, int64_t n, float *w) {
    const int64_t E = j->E;
    if (j->Wp) {
        for (int64_t r = 0; r < n; ++r) {
            vec acc = j->bias;
            const float *h = j->g + (first + r) * j->H;
            for (int64_t k = 0; k < j->H; ++k) acc += j->Wp[k] * h[k];
            for (int64_t e = 0; e < E; ++e) w[r * E + e] = acc[e];
        }
    } else {
        memcpy(w, j->g + first * E, (size_t)(n * E) * sizeof(float));
    }
    if (!j->softmax && !j->Wp) return;
    for (int64_t r = 0; r < n; ++r) {
        float m = w[r * E];
        for (int64_t e = 1; e < E; ++e) m = w[r * E + e] > m ? w[r * E + e] : m;
        for (int64_t e = 0; e < E; ++e) w[r * E + e] -= m;
    }
    int64_t i = 0;
    for (; i + LANES <= n * E; i += LANES) store(w + i, exp_vec(load(w + i)));
    for (; i < n * E; ++i) w[i] = expf(w[i]);
    for (int64_t r = 0; r < n; ++r) {
        float s = 0;
        for (int64_t e = 0; e < E; ++e) s += w[r * E + e];
        for (int64_t e = 0; e < E; ++e) w[r * E + e] /= s;
    }
}

/* Row b of the output: Σₑ g[e] · xₑ[b]. */
static void mix_row(const Job *j, int64_t b, const float *g) {
    const int64_t D = j->D;
    float *y = j->y + b * D;
    int64_t c = 0;
    for (; c + LANES <= D; c += LANES) {
        vec acc = load(j->x[0] + b * D + c) * g[0];
        for (int64_t e = 1; e < j->E; ++e) acc += load(j->x[e] + b * D + c) * g[e];
        store(y + c, acc);
    }
    for (; c < D; ++c) {
        float acc = j->x[0][b * D + c] * g[0];
        for (int64_t e = 1; e < j->E; ++e) acc += j->x[e][b * D + c] * g[e];
        y[c] = acc;
    }
}

static void gated_block(void *data, size_t blk) {
    Job *j = data;
    const int64_t first = j->rows * (int64_t)blk / j->blocks, end = j->rows * ((int64_t)blk + 1) / j->blocks;
    const int64_t chunk = CHUNK_VALUES / j->E > 0 ? CHUNK_VALUES / j->E : 1;
    float w[CHUNK_VALUES > MAX_EXPERTS ? CHUNK_VALUES : MAX_EXPERTS];
    for (int64_t b = first; b < end; b += chunk) {
        const int64_t n = end - b < chunk ? end - b : chunk;
        chunk_gates(j, b, n, w);
        for (int64_t r = 0; r < n; ++r) mix_row(j, b + r, w + r * j->E);
    }
}

static int64_t numel(const int64_t *d, size_t rank) {
    int64_t n = 1;
    for (size_t a = 0; a < rank; ++a) n *= d[a];
    return n;
}

/* project: W [H, E] and b [E] (inputs 1 and 2) into the job, H and E checked against h (its numel into *gate). */
static OrtStatus *read_projection(OrtKernelContext *ctx, size_t n_in, Job *j, int64_t *gate) {
    int64_t d[MAX_RANK];
    size_t rank;
    TRY(read_input(ctx, n_in, 1, &j->W, d, &rank, MAX_RANK, "GatedSum: W has rank > 8"));
    if (rank != 2 || d[1] != j->E || j->E > LANES) return error("GatedSum: W must be [H, E], E ≤ 8");
    j->H = d[0];
    TRY(read_input(ctx, n_in, 2, &j->b, d, &rank, MAX_RANK, "GatedSum: b has rank > 8"));
    if (!j->b || numel(d, rank) != j->E) return error("GatedSum: b must be [E]");
    *gate = j->H ? *gate / j->H * j->E : 0;   /* h [B, H]: as B·E gate values */
    j->Wp = aligned_alloc(sizeof(vec), (size_t)(j->H ? j->H : 1) * sizeof(vec));
    if (!j->Wp) return ort->CreateStatus(ORT_FAIL, "GatedSum: out of memory");
    j->bias = splat(-INFINITY);
    for (int64_t e = 0; e < j->E; ++e) j->bias[e] = j->b[e];
    for (int64_t k = 0; k < j->H; ++k) {
        j->Wp[k] = splat(0.0f);
        for (int64_t e = 0; e < j->E; ++e) j->Wp[k][e] = j->W[k * j->E + e];
    }
    return NULL;
}

/* The experts (from input `first`), the output, the mix; the gate read into the job already (its numel: gate). */
static OrtStatus *mix(OrtKernelContext *ctx, const GatedKernel *k, Job *j, size_t n_in, size_t first, int64_t gate) {
    int64_t d[MAX_RANK];
    size_t rank;
    for (int64_t e = 0; e < j->E; ++e) {
        TRY(read_input(ctx, n_in, first + (size_t)e, &j->x[e], d, &rank, MAX_RANK, "GatedSum: an expert has rank > 8"));
        if (rank < 1) return error("GatedSum: an expert is a scalar");   /* data NULL: empty */
        if (e == 0) j->D = d[rank - 1], j->rows = j->D ? numel(d, rank) / j->D : 0;
        else if (numel(d, rank) != j->rows * j->D) return error("GatedSum: the experts' sizes differ");
    }
    if (gate != j->rows * j->E) return error("GatedSum: the gate is not one value per row and expert");
    const int64_t out[3] = {j->rows, 1, j->D}, flat[2] = {j->rows, j->D};
    OrtValue *y;
    TRY(k->keepdims ? ort->KernelContext_GetOutput(ctx, 0, out, 3, &y) : ort->KernelContext_GetOutput(ctx, 0, flat, 2, &y));
    TRY(ort->GetTensorMutableData(y, (void **)&j->y));
    if (j->rows == 0 || j->D == 0) return NULL;
    j->blocks = (j->rows + 63) / 64;   /* 64 rows a block at least: a chunk's exp runs on whole vectors */
    j->blocks = j->blocks < MAX_BLOCKS ? j->blocks : MAX_BLOCKS;
    return ort->KernelContext_ParallelFor(ctx, gated_block, (size_t)j->blocks, 0, j);
}

static OrtStatus *ORT_API_CALL compute(void *kernel, OrtKernelContext *ctx) {
    const GatedKernel *k = kernel;
    size_t n_in, rank, first = k->project ? 3 : 1;   /* the first expert's input */
    int64_t d[MAX_RANK], gate;
    Job j = {.softmax = k->softmax};
    TRY(ort->KernelContext_GetInputCount(ctx, &n_in));
    if (n_in < first + 1 || n_in - first > MAX_EXPERTS) return error("GatedSum: a gate and 1 to 256 experts");
    j.E = (int64_t)(n_in - first);
    TRY(read_input(ctx, n_in, 0, &j.g, d, &rank, MAX_RANK, "GatedSum: the gate has rank > 8"));
    gate = numel(d, rank);
    if (k->project) {
        if (rank != 2) return error("GatedSum: h must be [B, H]");
        TRY(read_projection(ctx, n_in, &j, &gate));
    }
    OrtStatus *s = mix(ctx, k, &j, n_in, first, gate);
    free(j.Wp);
    return s;
}

static OrtStatus *ORT_API_CALL create(const OrtCustomOp *op, const OrtApi *api, const OrtKernelInfo *info,
                                      void **kernel) {
    (void)op;
    (void)api;
    GatedKernel *k = calloc(1, sizeof(GatedKernel));
    if (!k) return ort->CreateStatus(ORT_FAIL, "GatedSum: out of memory");
    OrtStatus *s = ort->KernelInfoGetAttribute_int64(info, "keepdims", &k->keepdims);
    if (s) {
        free(k);
        return s;
    }
    k->softmax = int_attribute(info, "softmax", 0);
    k->project = int_attribute(info, "project", 0);
    *kernel = k;
    return NULL;
}

static const char *ORT_API_CALL name(const OrtCustomOp *op) { (void)op; return "GatedSum"; }

OrtCustomOp ctropt_gated_sum = CUSTOM_OP(name, float_type, one_count, float_type, one_count, variadic, required,
                                         create, compute);
