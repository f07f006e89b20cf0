/* GatedSum: a mixture of experts' output, y = Σₑ g[:, e] · xₑ, each row's experts weighted by its gate and summed
 * (MMoE's and PLE's per-task mix).
 *
 * Exporters write the mix as a stack of the experts (an Unsqueeze each and a Concat, or a Concat and a Reshape), the
 * gate made a row ([B, 1, E], through Unsqueeze/Squeeze/Reshape), a batched MatMul and a Squeeze: eight to twelve
 * nodes for two tasks, each a pass over the batch with onnxruntime's per-node cost. The kernel reads each expert
 * where it is and writes the mix once.
 *
 * Node (domain "ai.ctropt.kernels", made by gated-sum-kernel):
 *   inputs   0 g: B·E floats, row-major by row then expert (any shape: [B, E], [B, 1, E], ...)
 *            1… the E experts xₑ: float, each B·D values, [..., D] (D: the first expert's last dim)
 *   attributes keepdims (int): Y is [B, 1, D] (1) or [B, D] (0)
 *   outputs  0 Y
 * Each row's sum runs over the experts in order, as the MatMul's does (its rounding may differ by the order of its
 * blocking).
 */
#include "kernels.h"

#define MAX_EXPERTS 256
#define MAX_RANK 8
#define MAX_BLOCKS 64

typedef struct {
    int64_t keepdims;
} GatedKernel;

typedef struct {
    const float *g, *x[MAX_EXPERTS];
    float *y;
    int64_t rows, E, D, blocks;
} Job;

static void gated_block(void *data, size_t blk) {
    Job *j = data;
    const int64_t first = j->rows * (int64_t)blk / j->blocks, end = j->rows * ((int64_t)blk + 1) / j->blocks;
    const int64_t D = j->D;
    for (int64_t b = first; b < end; ++b) {
        const float *g = j->g + b * j->E;
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
}

static int64_t numel(const int64_t *d, size_t rank) {
    int64_t n = 1;
    for (size_t a = 0; a < rank; ++a) n *= d[a];
    return n;
}

static OrtStatus *ORT_API_CALL compute(void *kernel, OrtKernelContext *ctx) {
    size_t n_in, rank;
    int64_t d[MAX_RANK], gate;
    Job j = {0};
    TRY(ort->KernelContext_GetInputCount(ctx, &n_in));
    if (n_in < 2 || n_in - 1 > MAX_EXPERTS) return error("GatedSum: a gate and 1 to 256 experts");
    j.E = (int64_t)n_in - 1;
    TRY(read_input(ctx, n_in, 0, &j.g, d, &rank, MAX_RANK, "GatedSum: the gate has rank > 8"));
    gate = numel(d, rank);
    for (int64_t e = 0; e < j.E; ++e) {
        TRY(read_input(ctx, n_in, (size_t)e + 1, &j.x[e], d, &rank, MAX_RANK, "GatedSum: an expert has rank > 8"));
        if (!j.x[e] || rank < 1) return error("GatedSum: an expert is missing or a scalar");
        if (e == 0) j.D = d[rank - 1], j.rows = j.D ? numel(d, rank) / j.D : 0;
        else if (numel(d, rank) != j.rows * j.D) return error("GatedSum: the experts' sizes differ");
    }
    if (!j.g || gate != j.rows * j.E) return error("GatedSum: the gate is not one value per row and expert");
    const int64_t out[3] = {j.rows, 1, j.D}, flat[2] = {j.rows, j.D};
    OrtValue *y;
    TRY(((GatedKernel *)kernel)->keepdims ? ort->KernelContext_GetOutput(ctx, 0, out, 3, &y)
                                          : ort->KernelContext_GetOutput(ctx, 0, flat, 2, &y));
    TRY(ort->GetTensorMutableData(y, (void **)&j.y));
    if (j.rows == 0 || j.D == 0) return NULL;
    j.blocks = j.rows < MAX_BLOCKS ? j.rows : MAX_BLOCKS;
    return ort->KernelContext_ParallelFor(ctx, gated_block, (size_t)j.blocks, 0, &j);
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
    *kernel = k;
    return NULL;
}

static const char *ORT_API_CALL name(const OrtCustomOp *op) { (void)op; return "GatedSum"; }
static size_t ORT_API_CALL one_count(const OrtCustomOp *op) { (void)op; return 1; }
static OrtCustomOpInputOutputCharacteristic ORT_API_CALL input_kind(const OrtCustomOp *op, size_t i) {
    (void)op;
    (void)i;
    return INPUT_OUTPUT_VARIADIC;
}

OrtCustomOp ctropt_gated_sum = CUSTOM_OP(name, float_type, one_count, float_type, one_count, input_kind, required,
                                         create, compute);
