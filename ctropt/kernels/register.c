/* The library's entry point: onnxruntime calls RegisterCustomOps when the library is registered in a session. */
#include "kernels.h"

const OrtApi *ort;

ORT_EXPORT OrtStatus *ORT_API_CALL RegisterCustomOps(OrtSessionOptions *options, const OrtApiBase *base) {
    ort = base->GetApi(ORT_API_VERSION);
    if (!ort) return NULL;   /* an onnxruntime older than these headers: nothing can be reported */
    OrtCustomOpDomain *domain = NULL;
    TRY(ort->CreateCustomOpDomain("ai.ctropt.kernels", &domain));
    TRY(ort->CustomOpDomain_Add(domain, &ctropt_gru_scan));
    TRY(ort->CustomOpDomain_Add(domain, &ctropt_attention_core));
    TRY(ort->CustomOpDomain_Add(domain, &ctropt_sum_axes));
    TRY(ort->CustomOpDomain_Add(domain, &ctropt_small_matmul));
    TRY(ort->CustomOpDomain_Add(domain, &ctropt_gather_rows));
    TRY(ort->CustomOpDomain_Add(domain, &ctropt_gather_rows_int64));
    TRY(ort->CustomOpDomain_Add(domain, &ctropt_gather_fields));
    TRY(ort->CustomOpDomain_Add(domain, &ctropt_unique_rows));
    TRY(ort->CustomOpDomain_Add(domain, &ctropt_unique_rows_float));
    TRY(ort->CustomOpDomain_Add(domain, &ctropt_layer_norm));
    TRY(ort->CustomOpDomain_Add(domain, &ctropt_mul_add));
    TRY(ort->CustomOpDomain_Add(domain, &ctropt_dot_sum));
    TRY(ort->CustomOpDomain_Add(domain, &ctropt_fm_interaction));
    TRY(ort->CustomOpDomain_Add(domain, &ctropt_gated_sum));
    TRY(ort->CustomOpDomain_Add(domain, &ctropt_token_attention));
    return ort->AddCustomOpDomain(options, domain);
}
