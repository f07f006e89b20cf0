/* A build's entry point: onnxruntime calls RegisterCustomOps (through dispatch.c) when the library is registered
 * in a session. The C API is versioned and only grows: the newest version both sides know is used, down to
 * MIN_API_VERSION (onnxruntime 1.16: the V2 kernel callbacks), so a build made with these headers (API 21) runs in
 * the onnxruntime 1.16-1.20 that Triton and distributions ship; the ops say that version too, so an older
 * onnxruntime reads only the fields it knows. */
#include "api_version.h"
#include "kernels.h"

#define MIN_API_VERSION 16

const OrtApi *ort;

static OrtCustomOp *const OPS[] = {&ctropt_gru_scan, &ctropt_attention_core, &ctropt_sum_axes, &ctropt_small_matmul,
                                   &ctropt_gather_rows, &ctropt_gather_rows_int64, &ctropt_gather_fields,
                                   &ctropt_unique_rows, &ctropt_unique_rows_float, &ctropt_layer_norm,
                                   &ctropt_mul_add, &ctropt_dot_sum, &ctropt_fm_interaction, &ctropt_gated_sum,
                                   &ctropt_token_attention};

ORT_EXPORT OrtStatus *ORT_API_CALL RegisterCustomOps(OrtSessionOptions *options, const OrtApiBase *base) {
    uint32_t version = ctropt_api_version(base);
    ort = base->GetApi(version);
    if (!ort) return NULL;
    if (version < MIN_API_VERSION) return ort->CreateStatus(ORT_FAIL, "ctropt's kernels need onnxruntime 1.16 or newer");
    OrtCustomOpDomain *domain = NULL;
    TRY(ort->CreateCustomOpDomain("ai.ctropt.kernels", &domain));
    for (size_t i = 0; i < sizeof OPS / sizeof *OPS; ++i) {
        OPS[i]->version = version;
        TRY(ort->CustomOpDomain_Add(domain, OPS[i]));
    }
    return ort->AddCustomOpDomain(options, domain);
}
