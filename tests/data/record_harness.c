/* Drives the launcher's record stage (jnova_launch_record) as XLA's command-buffer recording does,
 * with a stand-in for XLA's record API that keeps what it is asked: the launcher library (argv[1]) is
 * called with real FFI call frames, and every check failure prints "FAIL <what>" and exits 1.
 * Built by tests/test_launcher.py against the jaxlib's FFI headers, where they have the record stage. */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/record_c_api.h"

#define CHECK(cond)                                      \
  do {                                                   \
    if (!(cond)) {                                       \
      printf("FAIL %s (line %d)\n", #cond, __LINE__);    \
      exit(1);                                           \
    }                                                    \
  } while (0)

/* ---------------------------------------------------------------- XLA's side, recorded */
struct XLA_FFI_Error { char message[512]; };

static XLA_FFI_Error* error_create(XLA_FFI_Error_Create_Args* args) {
  XLA_FFI_Error* e = calloc(1, sizeof *e);
  snprintf(e->message, sizeof e->message, "%s", args->message);
  return e;
}

static XLA_FFI_Extension* extension;  /* what FindExtension answers */
static XLA_FFI_Error* find_extension(XLA_FFI_InvokeContext_FindExtension_Args* args) {
  args->extension = (args->extension_type == XLA_FFI_Extension_Record) ? extension : NULL;
  return NULL;
}

static struct {
  int creates, updates;
  char name[128];
  const void* data;
  int64_t size;
  XLA_FFI_SourceFormat format;
  XLA_FFI_LaunchDims dims;
  uint32_t smem;
  int32_t pdl;
  uint32_t num_dependencies;
  int64_t num_args;
  void* pointers[8];
  const XLA_FFI_Command* updated;
} seen;

static int command_storage;  /* its address is the command XLA hands back */

static void keep_args(const XLA_FFI_KernelArgs* args) {
  seen.num_args = args->num_args;
  for (int64_t i = 0; i < args->num_args && i < 8; ++i) {
    CHECK(args->args[i].type == XLA_FFI_KernelArgType_DevicePtr && args->args[i].size == 0);
    seen.pointers[i] = (void*)args->args[i].arg_address;
  }
}

static XLA_FFI_Error* create_launch(XLA_FFI_RecordContext* ctx, const char* name, const void* data, int64_t size,
                                    XLA_FFI_SourceFormat format, XLA_FFI_LaunchDims dims, uint32_t smem,
                                    int32_t pdl, const XLA_FFI_KernelArgs* args,
                                    const XLA_FFI_Command* const* deps, uint32_t num_deps,
                                    const XLA_FFI_Command** out) {
  (void)ctx, (void)deps;
  seen.creates++;
  snprintf(seen.name, sizeof seen.name, "%s", name);
  seen.data = data, seen.size = size, seen.format = format, seen.dims = dims, seen.smem = smem, seen.pdl = pdl;
  seen.num_dependencies = num_deps;
  keep_args(args);
  *out = (const XLA_FFI_Command*)&command_storage;
  return NULL;
}

static XLA_FFI_Error* update_launch(XLA_FFI_RecordContext* ctx, const XLA_FFI_Command* command,
                                    const XLA_FFI_KernelArgs* args) {
  (void)ctx;
  seen.updates++;
  seen.updated = command;
  keep_args(args);
  return NULL;
}

/* ---------------------------------------------------------------- a call frame */
typedef XLA_FFI_Error* Handler(XLA_FFI_CallFrame*);

static XLA_FFI_Buffer buffer_at(void* data) {
  XLA_FFI_Buffer b = {XLA_FFI_Buffer_STRUCT_SIZE, NULL, XLA_FFI_DataType_F32, data, 1, NULL};
  return b;
}

int main(int argc, char** argv) {
  CHECK(argc == 2);
  void* lib = dlopen(argv[1], RTLD_NOW);
  CHECK(lib != NULL);
  int (*reg)(uint64_t, const char*, const char*, size_t) = (int (*)(uint64_t, const char*, const char*, size_t))dlsym(lib, "jnova_register");
  Handler* record = (Handler*)dlsym(lib, "jnova_launch_record");
  void (*counts)(long*) = (void (*)(long*))dlsym(lib, "jnova_counts");
  CHECK(reg != NULL && record != NULL && counts != NULL);

  const char ptx[] = "// a kernel's PTX";
  uint64_t id = 0x1234567890abcdefULL & 0x7fffffffffffffffULL;
  CHECK(reg(id, "kernel_entry", ptx, sizeof ptx - 1) == 0);

  XLA_FFI_Api api;
  memset(&api, 0, sizeof api);
  api.struct_size = XLA_FFI_Api_STRUCT_SIZE;
  api.XLA_FFI_Error_Create = error_create;
  api.XLA_FFI_InvokeContext_FindExtension = find_extension;

  XLA_FFI_RecordApi record_api;
  memset(&record_api, 0, sizeof record_api);
  record_api.create_launch = create_launch;
  record_api.update_launch = update_launch;
  const XLA_FFI_Command* commands[16] = {NULL};
  int64_t num_commands = 0;
  XLA_FFI_RecordFrame record_frame = {(XLA_FFI_RecordContext*)&api, &record_api, XLA_FFI_RecordAction_Create,
                                      commands, &num_commands, 16};
  XLA_FFI_Record_Extension record_ext;
  record_ext.extension_base = (XLA_FFI_Extension){sizeof record_ext,
      {XLA_FFI_Extension_Record, XLA_FFI_Extension_Record_MajorVersion, XLA_FFI_Extension_Record_MinorVersion}, NULL};
  record_ext.record_frame = &record_frame;
  extension = &record_ext.extension_base;

  /* Attributes (sorted by name, as XLA passes them): kernel_id, launch. */
  uint64_t id_value = id;
  int64_t geometry[7] = {7, 2, 1, 128, 1, 1, 100 * 1024};
  XLA_FFI_Scalar id_attr = {XLA_FFI_DataType_U64, &id_value};
  XLA_FFI_Array launch_attr = {XLA_FFI_DataType_S64, 7, geometry};
  XLA_FFI_ByteSpan id_name = {"kernel_id", 9}, launch_name = {"launch", 6};
  XLA_FFI_ByteSpan* names[2] = {&id_name, &launch_name};
  XLA_FFI_AttrType attr_types[2] = {XLA_FFI_AttrType_SCALAR, XLA_FFI_AttrType_ARRAY};
  void* attrs[2] = {&id_attr, &launch_attr};

  static _Alignas(16) char memory[4][256];
  XLA_FFI_Buffer a = buffer_at(memory[0]), b = buffer_at(memory[1]), out = buffer_at(memory[2]);
  void* arg_ptrs[2] = {&a, &b};
  XLA_FFI_ArgType arg_types[2] = {XLA_FFI_ArgType_BUFFER, XLA_FFI_ArgType_BUFFER};
  void* ret_ptrs[1] = {&out};
  XLA_FFI_RetType ret_types[1] = {XLA_FFI_RetType_BUFFER};

  XLA_FFI_CallFrame frame;
  memset(&frame, 0, sizeof frame);
  frame.struct_size = XLA_FFI_CallFrame_STRUCT_SIZE;
  frame.api = &api;
  frame.stage = XLA_FFI_ExecutionStage_RECORD;
  frame.args = (XLA_FFI_Args){XLA_FFI_Args_STRUCT_SIZE, NULL, 2, arg_types, arg_ptrs};
  frame.rets = (XLA_FFI_Rets){XLA_FFI_Rets_STRUCT_SIZE, NULL, 1, ret_types, ret_ptrs};
  frame.attrs = (XLA_FFI_Attrs){XLA_FFI_Attrs_STRUCT_SIZE, NULL, 2, attr_types, names, attrs};

  /* Create: one launch command, of the registered PTX, geometry and buffers in order. */
  CHECK(record(&frame) == NULL);
  CHECK(seen.creates == 1 && num_commands == 1 && commands[0] == (const XLA_FFI_Command*)&command_storage);
  CHECK(strcmp(seen.name, "kernel_entry") == 0);
  CHECK(seen.format == XLA_FFI_SourceFormat_PTX && seen.size == (int64_t)(sizeof ptx - 1));
  CHECK(memcmp(seen.data, ptx, sizeof ptx) == 0);  /* NUL-terminated too */
  CHECK(seen.dims.grid.x == 7 && seen.dims.grid.y == 2 && seen.dims.grid.z == 1);
  CHECK(seen.dims.block.x == 128 && seen.dims.block.y == 1 && seen.dims.block.z == 1);
  CHECK(seen.dims.cluster.x == 0 && seen.smem == 100 * 1024 && seen.pdl == 0 && seen.num_dependencies == 0);
  CHECK(seen.num_args == 3 && seen.pointers[0] == memory[0] && seen.pointers[1] == memory[1] &&
        seen.pointers[2] == memory[2]);
  const void* first_image = seen.data;

  /* Update: the same command, the buffers' new addresses. */
  record_frame.action = XLA_FFI_RecordAction_Update;
  a.data = memory[3], out.data = memory[0];
  CHECK(record(&frame) == NULL);
  CHECK(seen.creates == 1 && seen.updates == 1 && seen.updated == (const XLA_FFI_Command*)&command_storage);
  CHECK(seen.num_args == 3 && seen.pointers[0] == memory[3] && seen.pointers[1] == memory[1] &&
        seen.pointers[2] == memory[0]);

  /* A second create of the same kernel hands XLA the same image (XLA loads it once, by address). */
  record_frame.action = XLA_FFI_RecordAction_Create;
  num_commands = 0;
  CHECK(record(&frame) == NULL && seen.creates == 2 && seen.data == first_image);

  long c[3];
  counts(c);
  CHECK(c[0] == 0 && c[1] == 2 && c[2] == 1);

  /* A misaligned buffer is refused, and nothing is recorded. */
  num_commands = 0;
  a.data = memory[3] + 4;
  XLA_FFI_Error* e = record(&frame);
  CHECK(e != NULL && strstr(e->message, "16-byte aligned") != NULL && seen.creates == 2 && num_commands == 0);
  a.data = memory[3];

  /* An unregistered kernel names the id. */
  id_value = 42;
  e = record(&frame);
  CHECK(e != NULL && strstr(e->message, "000000000000002a is not registered") != NULL);
  id_value = id;

  /* Another version of the record extension is refused with the way out. */
  record_ext.extension_base.id.minor_version += 1;
  e = record(&frame);
  CHECK(e != NULL && strstr(e->message, "JNOVA_LAUNCHER_RECORD=0") != NULL);
  record_ext.extension_base.id.minor_version -= 1;

  /* No room left for the command. */
  num_commands = 16;
  e = record(&frame);
  CHECK(e != NULL && strstr(e->message, "no room") != NULL);

  /* The wrong stage. */
  num_commands = 0;
  frame.stage = XLA_FFI_ExecutionStage_EXECUTE;
  e = record(&frame);
  CHECK(e != NULL && strstr(e->message, "wrong stage") != NULL);

  printf("ok\n");
  return 0;
}
