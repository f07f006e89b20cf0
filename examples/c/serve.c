/* Serving a ctropt-optimized model from C through onnxruntime's C API, with ctropt's kernel library.
 *
 *   gcc -O2 -I"$(ctropt kernels path --include)" serve.c -o serve \
 *       -L"$ORT_LIB_DIR" -l:libonnxruntime.so.1 -Wl,-rpath,"$ORT_LIB_DIR"
 *   ./serve model.opt.onnx "$(ctropt kernels path)" in.bin out.bin
 *
 * in.bin / out.bin: a uint32 tensor count, then per tensor a uint32 name length, the name, the int32 ONNX element
 * type, a uint32 rank, int64 dims and the raw little-endian data (tests/test_serving_c.py writes and reads them).
 * ORT_LIB_DIR: the lib folder of an onnxruntime release (1.21 or newer: the header is API 21); the Python wheel's
 * onnxruntime/capi holds libonnxruntime.so.1.32.0, which needs a link named libonnxruntime.so.1 beside it. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include "onnxruntime_c_api.h"

static const OrtApi *ort;

#define CHECK(expr)                                              \
  do {                                                           \
    OrtStatus *status_ = (expr);                                 \
    if (status_) {                                               \
      fprintf(stderr, "%s\n", ort->GetErrorMessage(status_));    \
      ort->ReleaseStatus(status_);                               \
      exit(1);                                                   \
    }                                                            \
  } while (0)

static void read_exactly(void *p, size_t n, FILE *f) {
  if (n && fread(p, 1, n, f) != n) { fprintf(stderr, "truncated input file\n"); exit(1); }
}

static size_t element_size(int type) {
  switch (type) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT: case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32: return 4;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64: case ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE: return 8;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL: case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8: return 1;
    default: fprintf(stderr, "element type %d is not handled here\n", type); exit(1);
  }
}

/* One tensor of in.bin as an OrtValue over memory this program owns (freed at exit). */
static OrtValue *read_tensor(FILE *f, const OrtMemoryInfo *cpu, char **name) {
  uint32_t length, rank;
  int32_t type;
  read_exactly(&length, 4, f);
  *name = calloc(length + 1, 1);
  read_exactly(*name, length, f);
  read_exactly(&type, 4, f);
  read_exactly(&rank, 4, f);
  int64_t dims[16], count = 1;
  if (rank > 16) { fprintf(stderr, "rank %u\n", rank); exit(1); }
  read_exactly(dims, 8 * (size_t)rank, f);
  for (uint32_t d = 0; d < rank; d++) count *= dims[d];
  size_t bytes = (size_t)count * element_size(type);
  void *data = malloc(bytes ? bytes : 1);
  read_exactly(data, bytes, f);
  OrtValue *value = NULL;
  CHECK(ort->CreateTensorWithDataAsOrtValue(cpu, data, bytes, dims, rank, (ONNXTensorElementDataType)type, &value));
  return value;
}

static void write_tensor(FILE *f, const char *name, const OrtValue *value) {
  OrtTensorTypeAndShapeInfo *info;
  ONNXTensorElementDataType type;
  size_t rank, count;
  int64_t dims[16];
  void *data;
  CHECK(ort->GetTensorTypeAndShape(value, &info));
  CHECK(ort->GetTensorElementType(info, &type));
  CHECK(ort->GetDimensionsCount(info, &rank));
  CHECK(ort->GetDimensions(info, dims, rank));
  CHECK(ort->GetTensorShapeElementCount(info, &count));
  CHECK(ort->GetTensorMutableData((OrtValue *)value, &data));
  ort->ReleaseTensorTypeAndShapeInfo(info);
  uint32_t length = 0, rank32 = (uint32_t)rank;
  int32_t type32 = (int32_t)type;
  while (name[length]) length++;
  fwrite(&length, 4, 1, f);
  fwrite(name, 1, length, f);
  fwrite(&type32, 4, 1, f);
  fwrite(&rank32, 4, 1, f);
  fwrite(dims, 8, rank, f);
  fwrite(data, element_size(type), count, f);
}

int main(int argc, char **argv) {
  if (argc != 5) { fprintf(stderr, "usage: %s MODEL.onnx LIBRARY.so IN.bin OUT.bin\n", argv[0]); return 2; }
  ort = OrtGetApiBase()->GetApi(ORT_API_VERSION);
  OrtEnv *env;
  OrtSessionOptions *options;
  OrtSession *session;
  CHECK(ort->CreateEnv(ORT_LOGGING_LEVEL_WARNING, "serve", &env));
  CHECK(ort->CreateSessionOptions(&options));
  CHECK(ort->SetIntraOpNumThreads(options, 1));
  CHECK(ort->RegisterCustomOpsLibrary_V2(options, argv[2]));  /* ctropt's kernels: before the session */
  CHECK(ort->CreateSession(env, argv[1], options, &session));

  OrtMemoryInfo *cpu;
  CHECK(ort->CreateCpuMemoryInfo(OrtArenaAllocator, OrtMemTypeDefault, &cpu));
  FILE *in = fopen(argv[3], "rb");
  if (!in) { perror(argv[3]); return 1; }
  uint32_t n_in;
  read_exactly(&n_in, 4, in);
  char **in_names = calloc(n_in, sizeof *in_names);
  OrtValue **inputs = calloc(n_in, sizeof *inputs);
  for (uint32_t i = 0; i < n_in; i++) inputs[i] = read_tensor(in, cpu, &in_names[i]);
  fclose(in);

  size_t n_out;
  OrtAllocator *allocator;
  CHECK(ort->SessionGetOutputCount(session, &n_out));
  CHECK(ort->GetAllocatorWithDefaultOptions(&allocator));
  char **out_names = calloc(n_out, sizeof *out_names);
  OrtValue **outputs = calloc(n_out, sizeof *outputs);
  for (size_t i = 0; i < n_out; i++) CHECK(ort->SessionGetOutputName(session, i, allocator, &out_names[i]));
  CHECK(ort->Run(session, NULL, (const char *const *)in_names, (const OrtValue *const *)inputs, n_in,
                 (const char *const *)out_names, n_out, outputs));

  FILE *out = fopen(argv[4], "wb");
  if (!out) { perror(argv[4]); return 1; }
  uint32_t n_out32 = (uint32_t)n_out;
  fwrite(&n_out32, 4, 1, out);
  for (size_t i = 0; i < n_out; i++) write_tensor(out, out_names[i], outputs[i]);
  fclose(out);
  for (size_t i = 0; i < n_out; i++) ort->ReleaseValue(outputs[i]);
  for (uint32_t i = 0; i < n_in; i++) ort->ReleaseValue(inputs[i]);
  ort->ReleaseMemoryInfo(cpu);
  ort->ReleaseSession(session);
  ort->ReleaseSessionOptions(options);
  ort->ReleaseEnv(env);
  return 0;
}
