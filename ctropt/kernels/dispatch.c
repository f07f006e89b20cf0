/* The library onnxruntime registers (libctropt_kernels.so): it picks, when the library is registered, the build of
 * the kernels for the widest vector instructions this CPU has, loads it from beside itself and hands it the call.
 * The builds (libctropt_kernels.<isa>.so) are the same sources compiled for x86-64-v4 (AVX-512), x86-64-v3
 * (AVX2 + FMA) and the x86-64 baseline (any other x86-64 CPU; the only one elsewhere, aarch64 included).
 * $CTROPT_KERNELS_ISA (avx512, avx2, base) forces one. Built for the baseline, so it loads on any CPU. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "api_version.h"

typedef OrtStatus *(ORT_API_CALL *Register)(OrtSessionOptions *, const OrtApiBase *);

/* The build this CPU runs best, as its file's infix. */
static const char *best_isa(void) {
    const char *forced = getenv("CTROPT_KERNELS_ISA");
    if (forced && *forced) return forced;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512cd"))
        return "avx512";
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("bmi") &&
        __builtin_cpu_supports("bmi2"))
        return "avx2";
#endif
    return "base";
}

/* An error onnxruntime reports (through the API version it serves). */
static OrtStatus *failure(const OrtApiBase *base, const char *message) {
    const OrtApi *api = base->GetApi(ctropt_api_version(base));
    return api ? api->CreateStatus(ORT_FAIL, message) : NULL;
}

/* The build registering loads here (for `ctropt kernels status` and the tests). */
ORT_EXPORT const char *ctropt_kernels_isa(void) { return best_isa(); }

ORT_EXPORT OrtStatus *ORT_API_CALL RegisterCustomOps(OrtSessionOptions *options, const OrtApiBase *base) {
    Dl_info self;
    char path[4096], message[4400];
    const char *isa = best_isa();
    if (!dladdr((void *)RegisterCustomOps, &self) || !self.dli_fname) return failure(base, "ctropt kernels: dladdr failed");
    const char *slash = strrchr(self.dli_fname, '/');
    int folder = slash ? (int)(slash - self.dli_fname) : 1;
    snprintf(path, sizeof path, "%.*s/libctropt_kernels.%s.so", folder, slash ? self.dli_fname : ".", isa);
    void *build = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!build) {
        snprintf(message, sizeof message, "ctropt kernels: cannot load the %s build: %s", isa, dlerror());
        return failure(base, message);
    }
    Register registered = (Register)dlsym(build, "RegisterCustomOps");
    if (!registered) return failure(base, "ctropt kernels: the build has no RegisterCustomOps");
    return registered(options, base);
}
