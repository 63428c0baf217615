/* A stand-in for libcuda.so.1 that runs jnova launcher tests on a CPU.
 *
 * "Modules" are the PTX text; a function is one of the host kernels below, looked up by entry name;
 * cuLaunchKernel runs it on host memory (XLA's CPU buffers) over grid.x * block.x elements, so a
 * test checks the launcher's parameter order, aliasing and geometry through real results. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef void (*HostKernel)(unsigned n, void** params);

static void mock_add(unsigned n, void** params) { /* (a, b) -> out */
  const float* a = *(float**)params[0];
  const float* b = *(float**)params[1];
  float* out = *(float**)params[2];
  for (unsigned i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

static void mock_axpy_inplace(unsigned n, void** params) { /* (x, y) -> y aliased: y += 2 x */
  const float* x = *(float**)params[0];
  float* y_in = *(float**)params[1];
  float* y_out = *(float**)params[2];
  for (unsigned i = 0; i < n; ++i) y_out[i] = y_in[i] + 2.0f * x[i];
}

enum { MANY = 300 };  /* more buffers than the launcher keeps on its stack */
static void mock_sum_many(unsigned n, void** params) { /* (x_0 .. x_299) -> out */
  float* out = *(float**)params[MANY];
  for (unsigned i = 0; i < n; ++i) {
    float total = 0.0f;
    for (int p = 0; p < MANY; ++p) total += (*(float**)params[p])[i];
    out[i] = total;
  }
}

/* A tensor map as this stand-in encodes it (the real CUtensorMap is opaque): what the launcher passed. */
typedef struct {
  float* address;
  uint32_t dtype, rank, swizzle, aligned;
  uint64_t dims[5], strides[4];
  uint32_t box[5];
} MockMap;

static void mock_through_map(unsigned n, void** params) { /* (a) -> out, with a's tensor map after out */
  const MockMap* map = (const MockMap*)params[2];
  float* out = *(float**)params[1];
  float extra = (float)(map->dims[0] + map->dims[1] + map->strides[0] + map->box[0] + map->box[1] + map->dtype +
                        map->swizzle + map->rank + 1000 * !(((uintptr_t)params[2] & 63) == 0));
  for (unsigned i = 0; i < n; ++i) out[i] = map->address[i] + extra;
}

static long loads, launches;
static int context = 1, depth, max_dynamic_shared;
static int64_t last_launch[7];

long mock_loads(void) { return loads; }
long mock_launches(void) { return launches; }
int mock_max_dynamic_shared(void) { return max_dynamic_shared; }
int mock_context_depth(void) { return depth; }
void mock_set_context(int c) { context = c; }
void mock_last_launch(int64_t* out) { memcpy(out, last_launch, sizeof last_launch); }

static int capturing;
CUresult cuStreamGetCtx(void* stream, void** ctx) {  /* refused during capture, as CUDA may */
  (void)stream;
  if (capturing) return 900; /* CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED */
  *ctx = (void*)(intptr_t)(0x1000 * context);
  return 0;
}
void mock_set_capturing(int c) { capturing = c; }
CUresult cuStreamIsCapturing(void* stream, int* status) { (void)stream; *status = capturing; return 0; }
CUresult cuCtxGetCurrent(void** ctx) { *ctx = (void*)(intptr_t)(0x1000 * context); return 0; }
CUresult cuCtxPushCurrent_v2(void* ctx) { (void)ctx; ++depth; return 0; }
CUresult cuCtxPopCurrent_v2(void** ctx) { *ctx = NULL; --depth; return 0; }
CUresult cuModuleLoadData(void** module, const void* image) {
  if (strstr(image, "MOCK_INVALID_PTX") != NULL) return 218; /* CUDA_ERROR_INVALID_PTX */
  ++loads;
  *module = (void*)image;
  return 0;
}
CUresult cuModuleGetFunction(void** function, void* module, const char* name) {
  (void)module;
  if (strcmp(name, "mock_add") == 0) *function = (void*)mock_add;
  else if (strcmp(name, "mock_axpy_inplace") == 0) *function = (void*)mock_axpy_inplace;
  else if (strcmp(name, "mock_sum_many") == 0) *function = (void*)mock_sum_many;
  else if (strcmp(name, "mock_through_map") == 0) *function = (void*)mock_through_map;
  else return 500; /* CUDA_ERROR_NOT_FOUND */
  return 0;
}
CUresult cuFuncSetAttribute(void* function, int attribute, int value) {
  (void)function;
  if (attribute == 8) max_dynamic_shared = value;
  return 0;
}
CUresult cuLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned smem, void* stream, void** params, void** extra) {
  (void)stream, (void)extra;
  int64_t launch[7] = {gx, gy, gz, bx, by, bz, smem};
  memcpy(last_launch, launch, sizeof launch);
  ++launches;
  ((HostKernel)f)(gx * bx, params);
  return 0;
}
CUresult cuGetErrorString(CUresult error, const char** text) {
  *text = error == 218 ? "mock: invalid PTX" : error == 500 ? "mock: named symbol not found" : "mock: error";
  return 0;
}
CUresult cuTensorMapEncodeTiled(void* map, int dtype, uint32_t rank, void* address, const uint64_t* dims,
                                const uint64_t* strides, const uint32_t* box, const uint32_t* element_strides,
                                int interleave, int swizzle, int l2_promotion, int oob_fill) {
  (void)element_strides, (void)interleave, (void)l2_promotion, (void)oob_fill;
  if (rank < 1 || rank > 5) return 1; /* CUDA_ERROR_INVALID_VALUE */
  MockMap m = {address, (uint32_t)dtype, rank, (uint32_t)swizzle, 0, {0}, {0}, {0}};
  for (uint32_t i = 0; i < rank; ++i) m.dims[i] = dims[i], m.box[i] = box[i];
  for (uint32_t i = 0; i + 1 < rank; ++i) m.strides[i] = strides[i];
  memcpy(map, &m, sizeof m);
  return 0;
}
