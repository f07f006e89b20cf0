/* What ctropt's kernels share: onnxruntime's C API (`ort`, set by RegisterCustomOps in register.c), vectors of
 * LANES floats (gcc/clang vector extensions: the compiler picks the instructions of each build's -march), and the
 * OrtCustomOp callbacks every kernel answers alike. */
#ifndef CTROPT_KERNELS_H
#define CTROPT_KERNELS_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "onnxruntime_c_api.h"

#define LANES 8

extern const OrtApi *ort;
extern OrtCustomOp ctropt_gru_scan, ctropt_attention_core, ctropt_sum_axes, ctropt_small_matmul,
    ctropt_gather_rows, ctropt_gather_rows_int64, ctropt_unique_rows, ctropt_unique_rows_float, ctropt_layer_norm,
    ctropt_mul_add, ctropt_gather_fields,
    ctropt_dot_sum, ctropt_fm_interaction, ctropt_gated_sum, ctropt_token_attention;

typedef float vec __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t mask __attribute__((vector_size(LANES * sizeof(float))));

static inline vec load(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store(float *p, vec v) { memcpy(p, &v, sizeof v); }

/* The types of ids GatherRows and GatherFields read: int32, int64, or float32 (deepctr-torch's id columns, which
 * the model casts to int64: truncated toward zero as that Cast does, out of int64's range read as INT64_MIN). */
enum { IDS_INT32, IDS_INT64, IDS_FLOAT };

/* The kind of ids of an element type, -1 for none; the offsets' type for them (a float id's offsets are int64). */
static inline int ids_kind(ONNXTensorElementDataType t) {
    return t == ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32 ? IDS_INT32 : t == ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 ? IDS_INT64
           : t == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT ? IDS_FLOAT : -1;
}
static inline ONNXTensorElementDataType offsets_type(int kind) {
    return kind == IDS_INT32 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32 : ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
}

/* Index i of ids of `kind`, plus offsets[c] where there are offsets, added in the ids' own type (as Add would; a
 * float id cast to int64 first): GatherRows' and GatherFields' lookups at fuse-parallel-embeddings' offsets. */
static inline int64_t offset_index(const void *ids, const void *offsets, int kind, int64_t i, int64_t c) {
    if (kind == IDS_INT32) {
        const uint32_t at = (uint32_t)((const int32_t *)ids)[i];
        return (int32_t)(offsets ? at + (uint32_t)((const int32_t *)offsets)[c] : at);
    }
    uint64_t at;
    if (kind == IDS_INT64) {
        at = (uint64_t)((const int64_t *)ids)[i];
    } else {
        const float v = ((const float *)ids)[i];
        at = v > -9.2233720e18f && v < 9.2233720e18f ? (uint64_t)(int64_t)v : (uint64_t)INT64_MIN;
    }
    return (int64_t)(offsets ? at + (uint64_t)((const int64_t *)offsets)[c] : at);
}

/* With per-column sizes (fuse-parallel-embeddings' fields in one joined table): id i of column c as its field's own
 * Gather reads it (negative: from the end of the field's sizes[c] rows), at the field's rows from offsets[c]; -1 for
 * an id outside [-sizes[c], sizes[c]), where that Gather raises. A float id is truncated as the model's Cast does. */
static inline int64_t field_row(const void *ids, const void *offsets, const int64_t *sizes, int kind, int64_t i,
                                int64_t c) {
    int64_t id = offset_index(ids, NULL, kind, i, 0);
    id += id < 0 ? sizes[c] : 0;
    if ((uint64_t)id >= (uint64_t)sizes[c]) return -1;
    return id + (!offsets ? 0 : kind == IDS_INT32 ? ((const int32_t *)offsets)[c] : ((const int64_t *)offsets)[c]);
}

/* The message of an id out of its field's rows: onnxruntime Gather's meaning, the column of the ids, and the input
 * it came from (`names`: one line per column, NULL where not known). */
static inline void field_bounds_message(char *msg, size_t size, const char *op, int64_t id, int64_t rows, int64_t c,
                                        const char *names) {
    const char *name = names;
    for (int64_t line = 0; name && line < c; ++line) name = (name = strchr(name, '\n')) ? name + 1 : NULL;
    const int len = name ? (int)(strchr(name, '\n') ? strchr(name, '\n') - name : (ptrdiff_t)strlen(name)) : 0;
    snprintf(msg, size, "%s: indices element out of data bounds, idx=%lld must be within the inclusive range "
             "[%lld,%lld] (column %lld of the ids%s%.*s)", op, (long long)id, (long long)-rows, (long long)(rows - 1),
             (long long)c, name ? ": input " : "", len, name ? name : "");
}

/* A row of D 4-byte words (float or half an int64: copied as bits). */
static inline void copy_row(float *restrict to, const float *restrict from, int64_t D) {
    switch (D) {
        case 1: memcpy(to, from, sizeof(float)); break;
        case 2: memcpy(to, from, 2 * sizeof(float)); break;
        case 4: memcpy(to, from, 4 * sizeof(float)); break;
        case 8: store(to, load(from)); break;
        case 16: store(to, load(from)); store(to + 8, load(from + 8)); break;
        default:
            if (D < LANES) {
                memcpy(to, from, (size_t)D * sizeof(float));
                break;
            }
            for (int64_t k = 0; k + LANES <= D; k += LANES) store(to + k, load(from + k));
            store(to + D - LANES, load(from + D - LANES));   /* the tail: the last LANES again, overlapping */
    }
}

static inline vec splat(float f) { return (vec){0} + f; }

/* A value as a value of its own: an empty asm the compiler cannot see through keeps it from being contracted with
 * the next add or sub into a fused multiply-add (gcc and clang alike), so a product is rounded as the Mul a kernel
 * replaces rounds it. A whole vector fits one register with AVX ("x"); elsewhere (the x86-64 baseline build,
 * aarch64) it goes through memory ("m"), where no fused multiply-add is made anyway without FMA. */
#if defined(__AVX__)
#define VALUE_BARRIER "+x"
#else
#define VALUE_BARRIER "+m"
#endif
static inline vec rounded(vec v) {
    __asm__("" : VALUE_BARRIER(v));
    return v;
}
static inline float rounded1(float v) {
#if defined(__x86_64__) || defined(__i386__)
    __asm__("" : "+x"(v));
#elif defined(__aarch64__)
    __asm__("" : "+w"(v));
#else
    __asm__("" : "+m"(v));
#endif
    return v;
}

/* Whether n floats are all finite (no ±inf, no NaN): their exponent bits are not all ones. */
static inline int all_finite(const float *x, int64_t n) {
    uint32_t worst = 0;
    for (int64_t i = 0; i < n; ++i) {
        uint32_t u;
        memcpy(&u, x + i, sizeof u);
        worst |= (u & 0x7f800000u) == 0x7f800000u;
    }
    return !worst;
}
static inline vec pick(mask m, vec a, vec b) { return (vec)(((mask)a & m) | ((mask)b & ~m)); }

/* exp on LANES values at most 0 (the row's max subtracted): Cephes' expf (x = n ln2 + r, a degree-5 polynomial in r;
 * about 1 ulp). Below -87.3 the result is a denormal, as onnxruntime's: computed at x + 32 ln2 and scaled by 2^-32
 * (one rounding); 0 below -103.98 (so -inf gives 0); NaN (a row of -inf) stays NaN through the arithmetic. */
static inline vec exp_vec(vec x) {
    mask tiny = x < -87.3f, gone = x < -103.98f;
    vec c = pick(gone, splat(-87.3f), pick(tiny, x + 22.1807098f, x));
    vec fx = c * 1.44269504088896341f + 0.5f;
    vec fl = __builtin_convertvector(__builtin_convertvector(fx, mask), vec);   /* toward 0, then down: floor */
    fl = pick(fl > fx, fl - 1.0f, fl);
    vec r = c - fl * 0.693359375f + fl * 2.12194440e-4f;
    vec y = r * 1.9875691500e-4f + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * (r * r) + r + 1.0f;
    mask bits = (__builtin_convertvector(fl, mask) + 127) << 23;
    y = y * (vec)bits;
    y = pick(tiny, y * 2.3283064365386963e-10f, y);   /* 2^-32 */
    return pick(gone, splat(0.0f), y);
}

/* tanh on LANES values at once: the rational approximation (clamped to [-9, 9]) with the float coefficients of
 * Eigen and onnxruntime's MLAS; NaN stays NaN. */
static inline vec tanh_vec(vec x) {
    mask low = x < -9.0f, high = x > 9.0f;
    vec lo = splat(-9.0f), hi = splat(9.0f);   /* not x * 0 / 9: inf * 0 is NaN */
    x = (vec)(((mask)x & ~(low | high)) | ((mask)lo & low) | ((mask)hi & high));
    vec x2 = x * x;
    vec p = x2 * -2.76076847742355e-16f + 2.00018790482477e-13f;
    p = p * x2 - 8.60467152213735e-11f;
    p = p * x2 + 5.12229709037114e-08f;
    p = p * x2 + 1.48572235717979e-05f;
    p = p * x2 + 6.37261928875436e-04f;
    p = p * x2 + 4.89352455891786e-03f;
    p = p * x;
    vec q = x2 * 1.19825839466702e-06f + 1.18534705686654e-04f;
    q = q * x2 + 2.26843463243900e-03f;
    q = q * x2 + 4.89352518554385e-03f;
    return p / q;
}

/* The logistic sigmoid, 1 / (1 + e^-x), as tanh(x / 2) / 2 + 1/2. */
static inline vec sigmoid_vec(vec x) { return tanh_vec(x * 0.5f) * 0.5f + 0.5f; }

#define TRY(call)                          \
    do {                                   \
        OrtStatus *status_ = (call);       \
        if (status_) return status_;       \
    } while (0)

static inline OrtStatus *error(const char *msg) { return ort->CreateStatus(ORT_INVALID_ARGUMENT, msg); }

static inline ONNXTensorElementDataType ORT_API_CALL float_type(const OrtCustomOp *op, size_t i) {
    (void)op;
    (void)i;
    return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
}
static inline ONNXTensorElementDataType ORT_API_CALL int64_type(const OrtCustomOp *op, size_t i) {
    (void)op;
    (void)i;
    return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
}
/* The attention kernels' five inputs, the last a boolean mask. */
static inline size_t ORT_API_CALL five_inputs(const OrtCustomOp *op) { (void)op; return 5; }
static inline ONNXTensorElementDataType ORT_API_CALL float_then_mask(const OrtCustomOp *op, size_t i) {
    (void)op;
    return i == 4 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
}
static inline void ORT_API_CALL destroy(void *kernel) { free(kernel); }
static inline const char *ORT_API_CALL provider(const OrtCustomOp *op) { (void)op; return "CPUExecutionProvider"; }
static inline OrtMemType ORT_API_CALL memory(const OrtCustomOp *op, size_t i) {
    (void)op;
    (void)i;
    return OrtMemTypeDefault;
}
static inline int ORT_API_CALL one(const OrtCustomOp *op) { (void)op; return 1; }
static inline int ORT_API_CALL last_opset(const OrtCustomOp *op) { (void)op; return 0x7fffffff; }
static inline size_t ORT_API_CALL no_pairs(int **in, int **out) { *in = *out = NULL; return 0; }
static inline void ORT_API_CALL free_pairs(int *in, int *out) { (void)in; (void)out; }

static inline OrtCustomOpInputOutputCharacteristic ORT_API_CALL required(const OrtCustomOp *op, size_t i) {
    (void)op;
    (void)i;
    return INPUT_OUTPUT_REQUIRED;
}
/* One input (a variadic list: its inputs all of its type) or one output. */
static inline size_t ORT_API_CALL one_count(const OrtCustomOp *op) { (void)op; return 1; }
static inline OrtCustomOpInputOutputCharacteristic ORT_API_CALL variadic(const OrtCustomOp *op, size_t i) {
    (void)op;
    (void)i;
    return INPUT_OUTPUT_VARIADIC;
}

/* CreateKernelV2 of a kernel without attributes (its state: one byte, for KernelDestroy to free). */
static inline OrtStatus *ORT_API_CALL no_attributes(const OrtCustomOp *op, const OrtApi *api,
                                                    const OrtKernelInfo *info, void **kernel) {
    (void)op;
    (void)api;
    (void)info;
    *kernel = calloc(1, 1);
    return *kernel ? NULL : ort->CreateStatus(ORT_FAIL, "ctropt kernels: out of memory");
}

/* An optional int attribute of a node, `fallback` where it is absent. */
static inline int64_t int_attribute(const OrtKernelInfo *info, const char *name, int64_t fallback) {
    int64_t value;
    OrtStatus *s = ort->KernelInfoGetAttribute_int64(info, name, &value);
    if (!s) return value;
    ort->ReleaseStatus(s);
    return fallback;
}

/* An optional ints attribute of a node: *values calloc'd (the caller frees it), NULL and *n = 0 where absent. */
static inline OrtStatus *ints_attribute(const OrtKernelInfo *info, const char *name, int64_t **values, size_t *n) {
    *values = NULL;
    *n = 0;
    OrtStatus *s = ort->KernelInfoGetAttributeArray_int64(info, name, NULL, n);
    if (s) {
        ort->ReleaseStatus(s);
        *n = 0;
        return NULL;
    }
    if (!*n) return NULL;
    *values = calloc(*n, sizeof(int64_t));
    if (!*values) return ort->CreateStatus(ORT_FAIL, "ctropt kernels: out of memory");
    s = ort->KernelInfoGetAttributeArray_int64(info, name, *values, n);
    if (s) {
        free(*values);
        *values = NULL;
    }
    return s;
}

/* An optional string attribute of a node: *value calloc'd (the caller frees it), NULL where absent. */
static inline OrtStatus *string_attribute(const OrtKernelInfo *info, const char *name, char **value) {
    size_t n = 0;
    *value = NULL;
    OrtStatus *s = ort->KernelInfoGetAttribute_string(info, name, NULL, &n);
    if (s) {
        ort->ReleaseStatus(s);
        return NULL;
    }
    *value = calloc(n + 1, 1);
    if (!*value) return ort->CreateStatus(ORT_FAIL, "ctropt kernels: out of memory");
    s = ort->KernelInfoGetAttribute_string(info, name, *value, &n);
    if (s) {
        free(*value);
        *value = NULL;
    }
    return s;
}

/* The fields of an OrtCustomOp that every kernel fills alike (after .version, .GetName and its own callbacks). */
#define COMMON_CALLBACKS                         \
    .GetExecutionProviderType = provider,        \
    .GetInputMemoryType = memory,                \
    .GetVariadicInputMinArity = one,             \
    .GetVariadicOutputMinArity = one,            \
    .GetVariadicInputHomogeneity = one,          \
    .GetVariadicOutputHomogeneity = one,         \
    .GetStartVersion = one,                      \
    .GetEndVersion = last_opset,                 \
    .GetMayInplace = no_pairs,                   \
    .GetAliasMap = no_pairs,                     \
    .ReleaseMayInplace = free_pairs,             \
    .ReleaseAliasMap = free_pairs

/* An OrtCustomOp: its name, inputs' types, counts and characteristics, outputs' types (float_type: all float) and
 * characteristics, create and compute; then fields of its own (e.g. .KernelDestroy), overriding those above. */
#define CUSTOM_OP(name_, input_type_, n_inputs_, output_type_, n_outputs_, input_kind_, output_kind_, create_, compute_, ...) \
    {                                                                                                          \
        .version = ORT_API_VERSION, .GetName = name_, .GetInputType = input_type_, .GetInputTypeCount = n_inputs_, \
        .GetOutputType = output_type_, .GetOutputTypeCount = n_outputs_, .GetInputCharacteristic = input_kind_, \
        .GetOutputCharacteristic = output_kind_, .CreateKernelV2 = create_, .KernelComputeV2 = compute_,        \
        .KernelDestroy = destroy, COMMON_CALLBACKS, __VA_ARGS__                                                \
    }

/* Input i's data, its dims into `dims` (room for max_rank) and, given `type`, its element type. */
static inline OrtStatus *read_typed_input(OrtKernelContext *ctx, size_t i, const void **data, int64_t *dims,
                                          size_t *rank, size_t max_rank, const char *too_high,
                                          ONNXTensorElementDataType *type) {
    const OrtValue *v = NULL;
    TRY(ort->KernelContext_GetInput(ctx, i, &v));
    if (!v) return NULL;
    OrtTensorTypeAndShapeInfo *info;
    TRY(ort->GetTensorTypeAndShape(v, &info));
    OrtStatus *s = ort->GetDimensionsCount(info, rank);
    if (!s && *rank > max_rank) s = error(too_high);
    if (!s) s = ort->GetDimensions(info, dims, *rank);
    if (!s && type) s = ort->GetTensorElementType(info, type);
    ort->ReleaseTensorTypeAndShapeInfo(info);
    if (s) return s;
    return ort->GetTensorMutableData((OrtValue *)v, (void **)data);
}

/* Float input i (NULL data and rank 0 when absent), its dims into `dims` (room for max_rank). */
static inline OrtStatus *read_input(OrtKernelContext *ctx, size_t n_in, size_t i, const float **data, int64_t *dims,
                                   size_t *rank, size_t max_rank, const char *too_high) {
    *data = NULL;
    *rank = 0;
    if (i >= n_in) return NULL;
    return read_typed_input(ctx, i, (const void **)data, dims, rank, max_rank, too_high, NULL);
}

#endif
