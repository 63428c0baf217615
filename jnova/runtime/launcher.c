/* jnova's kernel launcher: an XLA FFI handler that launches one registered jnova kernel.
 *
 * Built by jnova/runtime/launcher.py with the host C compiler against the XLA FFI C API headers
 * that jaxlib ships (jax.ffi.include_dir()), loaded with ctypes and registered as the CUDA
 * custom-call target "jnova_launch".
 *
 * Why not jaxlib's PTX kernel call: its handler copies and hashes the whole compressed call
 * (PTX included) into a std::string, takes a global mutex, looks the dictionary attribute up by
 * name and allocates two vectors on every launch, and the PTX travels in every call of the HLO.
 * Here a launch is: the kernel's id (63 bits) and launch geometry read from the call's attributes,
 * a lock-free table lookup, the CUfunction of the stream's context, one cuLaunchKernel.
 *
 * Kernels are registered from Python (jnova_register) when a step is lowered, with their PTX;
 * the module is loaded (the driver assembles the PTX, and keeps the result in its own disk
 * cache) in each CUDA context: by the initialize stage where the handler has one (captured
 * launches: a module cannot be loaded while XLA captures the stream), else by the first launch.
 * The handler is command-buffer compatible: XLA records its launch into the CUDA graphs it runs
 * steps as. The attributes of a call:
 *   kernel_id  u64 scalar          the registered kernel
 *   launch     i64[7] array        grid x, y, z, block x, y, z, dynamic shared memory bytes
 * Buffers are the operands then the results, one pointer parameter each, 16-byte aligned. A kernel
 * registered with tensor maps (TMA descriptors) takes one CUtensorMap by value after them per map:
 * the launcher encodes each from its buffer's address at every launch (cuTensorMapEncodeTiled, host
 * only), and the record stage hands them to XLA as host values, re-encoded when buffers move.
 *
 * Where the jaxlib has the FFI record stage (record_c_api.h, jaxlib 0.11), the handler also records
 * its launch into XLA's command buffer itself: a kernel node that XLA creates and updates like its
 * own kernels' (a captured launch is a child graph, re-captured when its buffers move). In steady
 * state XLA updates neither, and a GPT-2 step dispatches alike either way (benchmarks/results).
 * jaxlib's Python registration takes no record stage, so that handler is registered through the
 * FFI API of a running call: jnova_bootstrap, a call jnova runs once a process, registers it.
 *
 * The CUDA driver is opened with dlopen at jnova_launcher_init, so building needs no CUDA headers
 * and a machine without a GPU can build, load and register (it cannot launch).
 */
#include <dlfcn.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "xla/ffi/api/c_api.h"

/* The record stage, where the headers have it in the one version this code is written against (the
 * API is still changing upstream; another version builds without it, and launches are captured). */
#if defined(__has_include)
#if __has_include("xla/ffi/api/record_c_api.h")
#include "xla/ffi/api/record_c_api.h"
#if XLA_FFI_Extension_Record_MajorVersion == 0 && XLA_FFI_Extension_Record_MinorVersion == 1
#define JNOVA_RECORD 1
#endif
#endif
#endif
#ifndef JNOVA_RECORD
#define JNOVA_RECORD 0
#endif

/* ------------------------------------------------------------------ the CUDA driver, by dlopen */
typedef int CUresult;
typedef void* CUcontext;
typedef void* CUmodule;
typedef void* CUfunction;
typedef void* CUstream;

enum { CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8, STATIC_SHARED_LIMIT = 48 * 1024 };

static struct {
  CUresult (*stream_get_ctx)(CUstream, CUcontext*);
  CUresult (*stream_is_capturing)(CUstream, int*);
  CUresult (*ctx_get_current)(CUcontext*);
  CUresult (*ctx_push_current)(CUcontext);
  CUresult (*ctx_pop_current)(CUcontext*);
  CUresult (*module_load_data)(CUmodule*, const void*);
  CUresult (*module_get_function)(CUfunction*, CUmodule, const char*);
  CUresult (*func_set_attribute)(CUfunction, int, int);
  CUresult (*launch_kernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                            unsigned, CUstream, void**, void**);
  CUresult (*get_error_string)(CUresult, const char**);
  /* optional (CUDA 12): only kernels with tensor maps need it */
  CUresult (*tensor_map_encode_tiled)(void*, int, uint32_t, void*, const uint64_t*, const uint64_t*,
                                      const uint32_t*, const uint32_t*, int, int, int, int);
} cu;

static char init_error[512];

/* Opens the driver library `path` (libcuda.so.1, or a stand-in in tests). 0 on success, -1 when the
 * library cannot be opened (no driver: a machine without a GPU), -2 when it lacks a function the
 * launcher needs; the reason is in jnova_launcher_error(). */
int jnova_launcher_init(const char* path) {
  void* lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (lib == NULL) {
    snprintf(init_error, sizeof init_error, "dlopen(%s): %s", path, dlerror());
    return -1;
  }
  __typeof__(cu) found;  /* committed only when every symbol is there */
#define JNOVA_SYMBOL(field, name)                                                  \
  *(void**)(&found.field) = dlsym(lib, name);                                      \
  if (found.field == NULL) {                                                       \
    snprintf(init_error, sizeof init_error, "%s has no symbol %s", path, name);    \
    return -2;                                                                     \
  }
  JNOVA_SYMBOL(stream_get_ctx, "cuStreamGetCtx")
  JNOVA_SYMBOL(stream_is_capturing, "cuStreamIsCapturing")
  JNOVA_SYMBOL(ctx_get_current, "cuCtxGetCurrent")
  JNOVA_SYMBOL(ctx_push_current, "cuCtxPushCurrent_v2")
  JNOVA_SYMBOL(ctx_pop_current, "cuCtxPopCurrent_v2")
  JNOVA_SYMBOL(module_load_data, "cuModuleLoadData")
  JNOVA_SYMBOL(module_get_function, "cuModuleGetFunction")
  JNOVA_SYMBOL(func_set_attribute, "cuFuncSetAttribute")
  JNOVA_SYMBOL(launch_kernel, "cuLaunchKernel")
  JNOVA_SYMBOL(get_error_string, "cuGetErrorString")
#undef JNOVA_SYMBOL
  *(void**)(&found.tensor_map_encode_tiled) = dlsym(lib, "cuTensorMapEncodeTiled");
  cu = found;
  return 0;
}

const char* jnova_launcher_error(void) { return init_error; }

/* ------------------------------------------------------------------ the kernel table */
enum { TABLE_SIZE = 1 << 14, MAX_CONTEXTS = 16, STACK_PARAMS = 256, MAX_PARAMS = 4096 };

/* A tensor map's registration: which buffer, and the arguments of cuTensorMapEncodeTiled besides the
 * address (interleave none, element strides 1, L2 promotion 256 B, out-of-bounds elements read as 0). */
enum { MAX_TENSOR_MAPS = 8, MAX_RANK = 5, MAP_WORDS = 5 + MAX_RANK + (MAX_RANK - 1) + MAX_RANK };
typedef struct {
  int64_t buffer;  /* the call's buffer whose address it describes */
  int64_t param;   /* the kernel parameter it is passed as: a kernel's maps are its last parameters */
  int64_t dtype, rank, swizzle;
  uint64_t dims[MAX_RANK];         /* innermost first */
  uint64_t strides[MAX_RANK - 1];  /* bytes, of dimensions 1 .. rank - 1 */
  uint32_t box[MAX_RANK];
} TensorMapSpec;

typedef struct {
  _Alignas(64) unsigned char bytes[128];  /* CUtensorMap */
} TensorMap;

typedef struct {
  CUcontext context;
  CUfunction function;
} ContextFunction;

typedef struct {
  uint64_t id;
  char* name;
  char* image;  /* NUL-terminated PTX */
  size_t image_size;
  int num_maps;
  TensorMapSpec maps[MAX_TENSOR_MAPS];
  atomic_int num_functions;
  ContextFunction functions[MAX_CONTEXTS];
} Kernel;

/* Open addressing on the id; slots are published with release stores and read with acquire loads,
 * so launches never lock. Registration and module loading take `mutex`. */
static _Atomic(Kernel*) table[TABLE_SIZE];
static int num_kernels;
static pthread_mutex_t mutex = PTHREAD_MUTEX_INITIALIZER;
static atomic_long num_module_loads, num_launches, num_record_creates, num_record_updates;

static Kernel* find(uint64_t id) {
  for (uint64_t i = 0; i < TABLE_SIZE; ++i) {
    Kernel* k = atomic_load_explicit(&table[(id + i) & (TABLE_SIZE - 1)], memory_order_acquire);
    if (k == NULL || k->id == id) return k;
  }
  return NULL;
}

static void decode_maps(int num_maps, const int64_t* words, TensorMapSpec* out) {
  memset(out, 0, num_maps * sizeof *out);
  for (int m = 0; m < num_maps; ++m) {
    const int64_t* w = words + m * MAP_WORDS;
    TensorMapSpec* t = &out[m];
    t->buffer = w[0], t->param = w[1], t->dtype = w[2], t->rank = w[3], t->swizzle = w[4];
    for (int i = 0; i < MAX_RANK; ++i) t->dims[i] = (uint64_t)w[5 + i], t->box[i] = (uint32_t)w[14 + i];
    for (int i = 0; i < MAX_RANK - 1; ++i) t->strides[i] = (uint64_t)w[10 + i];
  }
}

/* Registers kernel `id` (entry `name`, PTX `image` of `size` bytes) with `num_maps` tensor maps
 * (MAP_WORDS words each: buffer, param, dtype, rank, swizzle, dims[5], strides[4], box[5]).
 * Registering an id again with the same kernel does nothing. 0 on success, -1 when the id is taken by
 * another kernel, -2 when the table is full, -3 when out of memory, -4 for more than MAX_TENSOR_MAPS
 * maps, a map of a rank the driver does not take, or maps that are not the last parameters in order. */
int jnova_register(uint64_t id, const char* name, const char* image, size_t size, int num_maps,
                   const int64_t* map_words) {
  if (num_maps < 0 || num_maps > MAX_TENSOR_MAPS) return -4;
  TensorMapSpec maps[MAX_TENSOR_MAPS];
  decode_maps(num_maps, map_words, maps);
  for (int m = 0; m < num_maps; ++m)
    if (maps[m].rank < 1 || maps[m].rank > MAX_RANK || maps[m].param != maps[0].param + m || maps[0].param < 0)
      return -4;
  pthread_mutex_lock(&mutex);
  int status = 0;
  Kernel* k = find(id);
  if (k != NULL) {
    if (k->image_size != size || memcmp(k->image, image, size) != 0 || strcmp(k->name, name) != 0 ||
        k->num_maps != num_maps || memcmp(k->maps, maps, num_maps * sizeof *maps) != 0)
      status = -1;
  } else if (num_kernels >= TABLE_SIZE * 3 / 4) {
    status = -2;
  } else {
    k = calloc(1, sizeof *k);
    size_t name_size = strlen(name) + 1;
    char* name_copy = malloc(name_size);
    char* image_copy = malloc(size + 1);
    if (k == NULL || name_copy == NULL || image_copy == NULL) {
      free(k), free(name_copy), free(image_copy);
      status = -3;
    } else {
      memcpy(name_copy, name, name_size);
      memcpy(image_copy, image, size);
      image_copy[size] = '\0';
      k->id = id, k->name = name_copy, k->image = image_copy, k->image_size = size;
      k->num_maps = num_maps;
      memcpy(k->maps, maps, num_maps * sizeof *maps);
      uint64_t i = 0;
      while (atomic_load_explicit(&table[(id + i) & (TABLE_SIZE - 1)], memory_order_relaxed) != NULL) ++i;
      atomic_store_explicit(&table[(id + i) & (TABLE_SIZE - 1)], k, memory_order_release);
      ++num_kernels;
    }
  }
  pthread_mutex_unlock(&mutex);
  return status;
}

int jnova_is_registered(uint64_t id) { return find(id) != NULL; }

/* Modules loaded so far (all kernels, all contexts): a kernel loads once per context. */
long jnova_module_loads(void) { return atomic_load(&num_module_loads); }

/* What the handler has done so far: launches by the execute stage (captured ones included), kernel
 * nodes created and updated by the record stage. */
void jnova_counts(long out[3]) {
  out[0] = atomic_load(&num_launches);
  out[1] = atomic_load(&num_record_creates);
  out[2] = atomic_load(&num_record_updates);
}

/* 1 when this build has the record stage. */
int jnova_has_record_stage(void) { return JNOVA_RECORD; }

/* ------------------------------------------------------------------ the FFI handler */
static XLA_FFI_Error* error(const XLA_FFI_Api* api, XLA_FFI_Error_Code code, const char* message) {
  XLA_FFI_Error_Create_Args args = {XLA_FFI_Error_Create_Args_STRUCT_SIZE, NULL, message, code};
  return api->XLA_FFI_Error_Create(&args);
}

static XLA_FFI_Error* driver_error(const XLA_FFI_Api* api, CUresult r, const char* call, const Kernel* k) {
  const char* text = NULL;
  if (cu.get_error_string == NULL || cu.get_error_string(r, &text) != 0 || text == NULL) text = "unknown error";
  char message[512];
  snprintf(message, sizeof message, "jnova kernel %s: %s failed: %s (CUDA error %d)", k->name, call, text, r);
  return error(api, XLA_FFI_Error_Code_INTERNAL, message);
}

/* The kernel's function in `context`, loading its module there on first use, unless the stream is
 * being captured (`capturing`): the driver cannot load a module then. */
static XLA_FFI_Error* function_for(const XLA_FFI_Api* api, Kernel* k, CUcontext context, int smem, int capturing,
                                   CUfunction* out) {
  int n = atomic_load_explicit(&k->num_functions, memory_order_acquire);
  for (int i = 0; i < n; ++i)
    if (k->functions[i].context == context) return *out = k->functions[i].function, NULL;

  pthread_mutex_lock(&mutex);
  XLA_FFI_Error* err = NULL;
  n = atomic_load_explicit(&k->num_functions, memory_order_acquire);
  for (int i = 0; i < n; ++i)
    if (k->functions[i].context == context) {
      *out = k->functions[i].function;
      goto done;
    }
  if (n == MAX_CONTEXTS) {
    err = error(api, XLA_FFI_Error_Code_RESOURCE_EXHAUSTED, "jnova launcher: more than 16 CUDA contexts");
    goto done;
  }
  if (capturing) {
    char message[512];
    snprintf(message, sizeof message,
             "jnova kernel %s: XLA is capturing the stream and the kernel's module is not loaded in this "
             "context (a module cannot be loaded during capture); the launcher registered with its record "
             "stage loads modules at the first launch (JNOVA_LAUNCHER_RECORD=0 loads them before capture)",
             k->name);
    err = error(api, XLA_FFI_Error_Code_FAILED_PRECONDITION, message);
    goto done;
  }
  CUresult r = cu.ctx_push_current(context);
  if (r != 0) {
    err = driver_error(api, r, "cuCtxPushCurrent", k);
    goto done;
  }
  CUmodule module;
  CUfunction function;
  if ((r = cu.module_load_data(&module, k->image)) != 0) err = driver_error(api, r, "cuModuleLoadData", k);
  else if ((r = cu.module_get_function(&function, module, k->name)) != 0)
    err = driver_error(api, r, "cuModuleGetFunction", k);
  else if (smem > STATIC_SHARED_LIMIT &&
           (r = cu.func_set_attribute(function, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem)) != 0)
    err = driver_error(api, r, "cuFuncSetAttribute(max dynamic shared memory)", k);
  CUcontext popped;
  cu.ctx_pop_current(&popped);
  if (err == NULL) {
    atomic_fetch_add(&num_module_loads, 1);
    k->functions[n] = (ContextFunction){context, function};
    atomic_store_explicit(&k->num_functions, n + 1, memory_order_release);
    *out = function;
  }
done:
  pthread_mutex_unlock(&mutex);
  return err;
}

static int name_is(const XLA_FFI_ByteSpan* name, const char* expected) {
  size_t len = strlen(expected);
  return name->len == len && memcmp(name->ptr, expected, len) == 0;
}

static XLA_FFI_Error* populate_metadata(const XLA_FFI_Api* api, XLA_FFI_Metadata_Extension* extension) {
  if (extension->extension_base.struct_size < XLA_FFI_Metadata_Extension_STRUCT_SIZE ||
      extension->metadata->struct_size < XLA_FFI_Metadata_STRUCT_SIZE)
    return error(api, XLA_FFI_Error_Code_INVALID_ARGUMENT, "jnova launcher: metadata struct too small");
  extension->metadata->api_version =
      (XLA_FFI_Api_Version){XLA_FFI_Api_Version_STRUCT_SIZE, NULL, XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR};
  /* XLA may record the launch into a command buffer (a CUDA graph) by capturing the stream: XLA runs
   * steps as command buffers by default, and a call that cannot be recorded splits them. */
  extension->metadata->traits = XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE;
  return NULL;
}

/* What both stages need: the kernel, its launch geometry, the stream and the kernel's function in the
 * stream's context (its module loaded there on first use). */
typedef struct {
  Kernel* kernel;
  const int64_t* geometry;  /* grid x y z, block x y z, dynamic shared memory */
  CUstream stream;
  CUfunction function;
} Call;

/* The call's kernel and launch geometry, from its attributes. */
static XLA_FFI_Error* decode(XLA_FFI_CallFrame* frame, Call* call) {
  const XLA_FFI_Api* api = frame->api;
  const XLA_FFI_Scalar* kernel_id = NULL;
  const XLA_FFI_Array* launch = NULL;
  for (int64_t i = 0; i < frame->attrs.size; ++i) {
    const XLA_FFI_ByteSpan* name = frame->attrs.names[i];
    if (frame->attrs.types[i] == XLA_FFI_AttrType_SCALAR && name_is(name, "kernel_id"))
      kernel_id = frame->attrs.attrs[i];
    else if (frame->attrs.types[i] == XLA_FFI_AttrType_ARRAY && name_is(name, "launch"))
      launch = frame->attrs.attrs[i];
  }
  if (kernel_id == NULL || kernel_id->dtype != XLA_FFI_DataType_U64 || launch == NULL ||
      launch->dtype != XLA_FFI_DataType_S64 || launch->size != 7)
    return error(api, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                 "jnova launcher: the call needs attributes kernel_id (u64) and launch (i64[7])");
  uint64_t id = *(const uint64_t*)kernel_id->value;
  call->geometry = launch->data;
  call->kernel = find(id);
  if (call->kernel == NULL) {
    char message[256];
    snprintf(message, sizeof message,
             "jnova kernel %016" PRIx64 " is not registered in this process: it is registered when "
             "jnova lowers the step (a serialized executable needs the step lowered again)", id);
    return error(api, XLA_FFI_Error_Code_NOT_FOUND, message);
  }
  return NULL;
}

/* decode(), then the stream and the kernel's function in the stream's context. */
static XLA_FFI_Error* resolve(XLA_FFI_CallFrame* frame, Call* call) {
  const XLA_FFI_Api* api = frame->api;
  XLA_FFI_Error* err = decode(frame, call);
  if (err != NULL) return err;
  if (cu.launch_kernel == NULL)
    return error(api, XLA_FFI_Error_Code_FAILED_PRECONDITION,
                 "jnova launcher: the CUDA driver was not opened (jnova_launcher_init)");

  call->stream = NULL;
#ifndef JNOVA_LAUNCHER_HOST_TEST  /* tests run this handler on XLA's CPU backend, which has no stream */
  XLA_FFI_Stream_Get_Args stream_args = {XLA_FFI_Stream_Get_Args_STRUCT_SIZE, NULL, frame->ctx, NULL};
  err = api->XLA_FFI_Stream_Get(&stream_args);
  if (err != NULL) return err;
  call->stream = stream_args.stream;
#endif
  /* While XLA records a command buffer the stream is being captured, and cuStreamGetCtx must not be
   * asked then (a CUDA bug jaxlib works around the same way): the context is the current one. */
  int capturing = 0;
  CUresult r = cu.stream_is_capturing(call->stream, &capturing);
  if (r != 0) return driver_error(api, r, "cuStreamIsCapturing", call->kernel);
  CUcontext context;
  r = capturing ? cu.ctx_get_current(&context) : cu.stream_get_ctx(call->stream, &context);
  if (r != 0) return driver_error(api, r, capturing ? "cuCtxGetCurrent" : "cuStreamGetCtx", call->kernel);
  return function_for(api, call->kernel, context, (int)call->geometry[6], capturing, &call->function);
}

static XLA_FFI_Error* prologue(XLA_FFI_CallFrame* frame, XLA_FFI_ExecutionStage stage, int* done) {
  *done = 1;
  if (frame->extension_start != NULL && frame->extension_start->type == XLA_FFI_Extension_Metadata)
    return populate_metadata(frame->api, (XLA_FFI_Metadata_Extension*)frame->extension_start);
  if (frame->stage != stage)
    return error(frame->api, XLA_FFI_Error_Code_INVALID_ARGUMENT, "jnova launcher: called in the wrong stage");
  *done = 0;
  return NULL;
}

/* The initialize stage: loads the kernel's module before XLA captures the call into a command buffer
 * (module loading is not allowed while a stream is captured). XLA runs it before every execution of
 * the step, for every call: the handler registered with its record stage has none (its launches are
 * recorded, not captured), which saves ~1.5 us of host time per call and step. */
XLA_FFI_Error* jnova_launch_initialize(XLA_FFI_CallFrame* frame) {
  int done;
  XLA_FFI_Error* err = prologue(frame, XLA_FFI_ExecutionStage_INITIALIZE, &done);
  if (done) return err;
  Call call;
  return resolve(frame, &call);
}

static XLA_FFI_Error* launch(XLA_FFI_CallFrame* frame, const Call* call, int64_t num_params, void** pointers,
                             void** params);

/* The execute stage: one launch (or, while XLA records a command buffer, one captured launch). */
XLA_FFI_Error* jnova_launch(XLA_FFI_CallFrame* frame) {
  int done;
  XLA_FFI_Error* err = prologue(frame, XLA_FFI_ExecutionStage_EXECUTE, &done);
  if (done) return err;
  Call call;
  if ((err = resolve(frame, &call)) != NULL) return err;
  /* A horizontally fused kernel (an optimizer's updates) takes hundreds of buffers; the driver's limit
   * on a launch's parameters (32 KiB on Volta and later with CUDA 12.1) is the real bound. */
  int64_t num_params = frame->args.size + frame->rets.size;
  if (num_params > MAX_PARAMS)
    return error(frame->api, XLA_FFI_Error_Code_INVALID_ARGUMENT, "jnova launcher: more than 4096 buffers");
  /* One array: the buffers' addresses, then the parameters pointing at them and at the tensor maps. */
  void* stack_slots[2 * STACK_PARAMS + MAX_TENSOR_MAPS];
  void** slots = num_params <= STACK_PARAMS ? stack_slots
                                            : malloc((2 * num_params + MAX_TENSOR_MAPS) * sizeof(void*));
  if (slots == NULL)
    return error(frame->api, XLA_FFI_Error_Code_RESOURCE_EXHAUSTED, "jnova launcher: out of memory");
  err = launch(frame, &call, num_params, slots, slots + num_params);
  if (slots != stack_slots) free(slots);
  return err;
}

/* The call's buffers, operands then results: `pointers[i]` is buffer i's device address. Every one
 * must be a buffer, 16-byte aligned. */
static XLA_FFI_Error* buffers(XLA_FFI_CallFrame* frame, const Kernel* k, int64_t num_params, void** pointers) {
  const XLA_FFI_Api* api = frame->api;
  uintptr_t misaligned = 0;
  for (int64_t i = 0; i < num_params; ++i) {
    int is_arg = i < frame->args.size;
    int64_t j = is_arg ? i : i - frame->args.size;
    if (is_arg ? frame->args.types[j] != XLA_FFI_ArgType_BUFFER : frame->rets.types[j] != XLA_FFI_RetType_BUFFER)
      return error(api, XLA_FFI_Error_Code_INVALID_ARGUMENT, "jnova launcher: every operand and result is a buffer");
    XLA_FFI_Buffer* buffer = is_arg ? frame->args.args[j] : frame->rets.rets[j];
    pointers[i] = buffer->data;
    misaligned |= (uintptr_t)buffer->data;
  }
  if (misaligned & 15) {
    char message[256];
    snprintf(message, sizeof message, "jnova kernel %s: a buffer is not 16-byte aligned", k->name);
    return error(api, XLA_FFI_Error_Code_INVALID_ARGUMENT, message);
  }
  return NULL;
}

/* The kernel's parameters before its tensor maps: the buffers it declares (a call may have more). */
static int64_t pointer_params(const Kernel* k, int64_t num_buffers) {
  return k->num_maps ? k->maps[0].param : num_buffers;
}

/* The kernel's tensor maps, encoded from its buffers' addresses `pointers`. */
static XLA_FFI_Error* encode_maps(const XLA_FFI_Api* api, const Kernel* k, int64_t num_params, void** pointers,
                                  TensorMap* maps) {
  if (pointer_params(k, num_params) > num_params) {
    char message[256];
    snprintf(message, sizeof message, "jnova kernel %s: declares %" PRId64 " buffer parameters, the call has %" PRId64,
             k->name, pointer_params(k, num_params), num_params);
    return error(api, XLA_FFI_Error_Code_INVALID_ARGUMENT, message);
  }
  if (k->num_maps > 0 && cu.tensor_map_encode_tiled == NULL) {
    char message[256];
    snprintf(message, sizeof message, "jnova kernel %s takes tensor maps, and this CUDA driver has no "
             "cuTensorMapEncodeTiled (CUDA 12 or later)", k->name);
    return error(api, XLA_FFI_Error_Code_FAILED_PRECONDITION, message);
  }
  for (int m = 0; m < k->num_maps; ++m) {
    const TensorMapSpec* t = &k->maps[m];
    if (t->buffer < 0 || t->buffer >= num_params) {
      char message[256];
      snprintf(message, sizeof message, "jnova kernel %s: tensor map %d is of buffer %" PRId64 ", the call has %" PRId64,
               k->name, m, t->buffer, num_params);
      return error(api, XLA_FFI_Error_Code_INVALID_ARGUMENT, message);
    }
    static const uint32_t ones[MAX_RANK] = {1, 1, 1, 1, 1};
    CUresult r = cu.tensor_map_encode_tiled(maps[m].bytes, (int)t->dtype, (uint32_t)t->rank, pointers[t->buffer],
                                            t->dims, t->strides, t->box, ones, /*interleave=*/0, (int)t->swizzle,
                                            /*l2 promotion 256 B=*/3, /*out of bounds: zeros=*/0);
    if (r != 0) return driver_error(api, r, "cuTensorMapEncodeTiled", k);
  }
  return NULL;
}

static XLA_FFI_Error* launch(XLA_FFI_CallFrame* frame, const Call* call, int64_t num_params, void** pointers,
                             void** params) {
  /* The kernel's parameter i is buffer i's pointer, which cuLaunchKernel reads through params[i],
   * then its tensor maps by value. */
  TensorMap maps[MAX_TENSOR_MAPS];
  XLA_FFI_Error* err = buffers(frame, call->kernel, num_params, pointers);
  if (err == NULL) err = encode_maps(frame->api, call->kernel, num_params, pointers, maps);
  if (err == NULL) {
    int64_t first_map = pointer_params(call->kernel, num_params);
    for (int64_t i = 0; i < first_map; ++i) params[i] = &pointers[i];
    for (int m = 0; m < call->kernel->num_maps; ++m) params[first_map + m] = maps[m].bytes;
    const int64_t* g = call->geometry;
    CUresult r = cu.launch_kernel(call->function, (unsigned)g[0], (unsigned)g[1], (unsigned)g[2], (unsigned)g[3],
                                  (unsigned)g[4], (unsigned)g[5], (unsigned)g[6], call->stream, params, NULL);
    if (r != 0) err = driver_error(frame->api, r, "cuLaunchKernel", call->kernel);
    else atomic_fetch_add_explicit(&num_launches, 1, memory_order_relaxed);
  }
  return err;
}

#if JNOVA_RECORD
/* The record stage: XLA is creating or updating the command buffer (a CUDA graph) the call belongs
 * to. Create: one kernel node from the kernel's PTX (XLA loads it once per executor, keyed by the
 * image's address, which the table keeps for the process), after the nodes XLA says it depends on.
 * Update: the node's buffers, when their addresses changed. XLA does the rest as for its own kernels. */
XLA_FFI_Error* jnova_launch_record(XLA_FFI_CallFrame* frame) {
  int done;
  XLA_FFI_Error* err = prologue(frame, XLA_FFI_ExecutionStage_RECORD, &done);
  if (done) return err;
  const XLA_FFI_Api* api = frame->api;
  XLA_FFI_InvokeContext_FindExtension_Args find = {XLA_FFI_InvokeContext_FindExtension_Args_STRUCT_SIZE, NULL,
                                                   frame->ctx, XLA_FFI_Extension_Record, NULL};
  if ((err = api->XLA_FFI_InvokeContext_FindExtension(&find)) != NULL) return err;
  if (find.extension == NULL)
    return error(api, XLA_FFI_Error_Code_FAILED_PRECONDITION, "jnova launcher: record stage without a record extension");
  if (find.extension->id.major_version != XLA_FFI_Extension_Record_MajorVersion ||
      find.extension->id.minor_version != XLA_FFI_Extension_Record_MinorVersion) {
    char message[256];
    snprintf(message, sizeof message,
             "jnova launcher: XLA's record extension is version %d.%d, the launcher was built for %d.%d "
             "(JNOVA_LAUNCHER_RECORD=0 launches without it)", (int)find.extension->id.major_version,
             (int)find.extension->id.minor_version, XLA_FFI_Extension_Record_MajorVersion,
             XLA_FFI_Extension_Record_MinorVersion);
    return error(api, XLA_FFI_Error_Code_FAILED_PRECONDITION, message);
  }
  XLA_FFI_RecordFrame* record = ((const XLA_FFI_Record_Extension*)find.extension)->record_frame;

  Call call;
  if ((err = decode(frame, &call)) != NULL) return err;
  int64_t num_params = frame->args.size + frame->rets.size;
  if (num_params > MAX_PARAMS)
    return error(api, XLA_FFI_Error_Code_INVALID_ARGUMENT, "jnova launcher: more than 4096 buffers");
  void* stack_pointers[STACK_PARAMS];
  XLA_FFI_KernelArg stack_args[STACK_PARAMS + MAX_TENSOR_MAPS];
  TensorMap maps[MAX_TENSOR_MAPS];  /* XLA copies host values */
  int on_heap = num_params > STACK_PARAMS;
  void** pointers = on_heap ? malloc(num_params * sizeof(void*)) : stack_pointers;
  XLA_FFI_KernelArg* args =
      on_heap ? malloc((num_params + MAX_TENSOR_MAPS) * sizeof(XLA_FFI_KernelArg)) : stack_args;
  if (pointers == NULL || args == NULL) {
    err = error(api, XLA_FFI_Error_Code_RESOURCE_EXHAUSTED, "jnova launcher: out of memory");
    goto done;
  }
  if ((err = buffers(frame, call.kernel, num_params, pointers)) != NULL) goto done;
  if ((err = encode_maps(api, call.kernel, num_params, pointers, maps)) != NULL) goto done;
  int64_t first_map = pointer_params(call.kernel, num_params);
  for (int64_t i = 0; i < first_map; ++i)
    args[i] = (XLA_FFI_KernelArg){pointers[i], 0, XLA_FFI_KernelArgType_DevicePtr};
  for (int m = 0; m < call.kernel->num_maps; ++m)
    args[first_map + m] = (XLA_FFI_KernelArg){maps[m].bytes, sizeof maps[m].bytes, XLA_FFI_KernelArgType_HostValue};
  XLA_FFI_KernelArgs kernel_args = {args, first_map + call.kernel->num_maps};
  const Kernel* k = call.kernel;
  const int64_t* g = call.geometry;
  if (record->action == XLA_FFI_RecordAction_Create) {
    if (*record->num_commands >= record->max_commands) {
      err = error(api, XLA_FFI_Error_Code_RESOURCE_EXHAUSTED, "jnova launcher: no room for the launch's command");
      goto done;
    }
    XLA_FFI_LaunchDims dims = {{(int32_t)g[0], (int32_t)g[1], (int32_t)g[2]},
                               {(int32_t)g[3], (int32_t)g[4], (int32_t)g[5]}, {0, 0, 0}};
    const XLA_FFI_Command* command = NULL;
    err = record->api->create_launch(record->record_ctx, k->name, k->image, (int64_t)k->image_size,
                                     XLA_FFI_SourceFormat_PTX, dims, (uint32_t)g[6], /*uses_pdl=*/0,
                                     &kernel_args, NULL, 0, &command);
    if (err == NULL && command == NULL)
      err = error(api, XLA_FFI_Error_Code_INTERNAL, "jnova launcher: XLA created no command for the launch");
    if (err == NULL) {
      record->commands[(*record->num_commands)++] = command;
      atomic_fetch_add_explicit(&num_record_creates, 1, memory_order_relaxed);
    }
  } else {
    if (*record->num_commands != 1) {
      err = error(api, XLA_FFI_Error_Code_INTERNAL, "jnova launcher: update of a call that did not record one command");
      goto done;
    }
    err = record->api->update_launch(record->record_ctx, record->commands[0], &kernel_args);
    if (err == NULL) atomic_fetch_add_explicit(&num_record_updates, 1, memory_order_relaxed);
  }
done:
  if (on_heap) free(pointers), free(args);
  return err;
}
#endif

/* ------------------------------------------------------------------ registration through a call */
static char bootstrap_target[64], bootstrap_platform[32];
static atomic_int bootstrap_status;  /* 0 not run, 1 registered, -1 failed (reason in init_error) */

/* What jnova_bootstrap registers: the launcher as `target` for `platform` ("CUDA"; "Host" in tests). */
void jnova_bootstrap_configure(const char* target, const char* platform) {
  snprintf(bootstrap_target, sizeof bootstrap_target, "%s", target);
  snprintf(bootstrap_platform, sizeof bootstrap_platform, "%s", platform);
}

int jnova_bootstrap_status(void) { return atomic_load(&bootstrap_status); }

/* An FFI call whose only effect is to register the launcher, with every stage it has, through the
 * FFI API XLA hands its calls (jaxlib's Python registration takes no record stage). Runs once. */
XLA_FFI_Error* jnova_bootstrap(XLA_FFI_CallFrame* frame) {
  if (frame->extension_start != NULL && frame->extension_start->type == XLA_FFI_Extension_Metadata)
    return populate_metadata(frame->api, (XLA_FFI_Metadata_Extension*)frame->extension_start);
  pthread_mutex_lock(&mutex);
  XLA_FFI_Error* err = NULL;
  if (atomic_load(&bootstrap_status) == 0) {
    XLA_FFI_Handler_Bundle bundle = {0};
    bundle.execute = jnova_launch;
#if JNOVA_RECORD
    bundle.record = jnova_launch_record;
#else
    bundle.initialize = jnova_launch_initialize;  /* launches are captured: load modules before */
#endif
    XLA_FFI_Handler_Register_Args args = {XLA_FFI_Handler_Register_Args_STRUCT_SIZE, NULL,
                                          {bootstrap_target, strlen(bootstrap_target)},
                                          {bootstrap_platform, strlen(bootstrap_platform)},
                                          bundle, XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE};
    err = frame->api->XLA_FFI_Handler_Register(&args);
    atomic_store(&bootstrap_status, err == NULL ? 1 : -1);
  }
  pthread_mutex_unlock(&mutex);
  return err;
}
