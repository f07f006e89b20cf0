/* The C API version to ask onnxruntime for: 1.N serves versions 1..N (asking for a newer one prints an error), so
 * N, or ORT_API_VERSION (these headers') where onnxruntime is newer or says something else. dispatch.c and
 * register.c share it. */
#ifndef CTROPT_API_VERSION_H
#define CTROPT_API_VERSION_H

#include <stdint.h>
#include <stdio.h>

#include "onnxruntime_c_api.h"

static inline uint32_t ctropt_api_version(const OrtApiBase *base) {
    unsigned major = 0, minor = 0;
    const char *text = base->GetVersionString ? base->GetVersionString() : NULL;
    if (!text || sscanf(text, "%u.%u", &major, &minor) != 2 || major != 1) return ORT_API_VERSION;
    return minor < ORT_API_VERSION ? minor : ORT_API_VERSION;
}

#endif
