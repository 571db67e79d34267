// CUDA FFI handler that launches a precompiled cubin (Triton or TileLang, compiled ahead for sm_90) on XLA's
// stream. Modules are loaded into each device's primary context from Python (djax_load_cubin) before the
// first call, so the handler itself only looks up a function and enqueues it: no host sync, no allocation,
// safe to capture in a CUDA graph (declared command-buffer compatible).
#include <cuda.h>
#include <dlfcn.h>

#include <cstdint>
#include <cstdio>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {
// The driver is opened at run time, so the library builds where only CUDA's headers exist (no libcuda stub).
struct Driver {
  decltype(&::cuInit) init;
  decltype(&::cuDeviceGet) device_get;
  decltype(&::cuDevicePrimaryCtxRetain) retain;
  decltype(&::cuCtxPushCurrent) push;
  decltype(&::cuCtxPopCurrent) pop;
  decltype(&::cuCtxGetDevice) ctx_device;
  decltype(&::cuModuleLoadData) load;
  decltype(&::cuModuleGetFunction) get_function;
  decltype(&::cuFuncSetAttribute) set_attribute;
  decltype(&::cuLaunchKernel) launch;
  decltype(&::cuGetErrorString) error_string;
  bool ok = false;
};

template <typename F>
void Sym(void* lib, const char* name, F* out) {
  *out = reinterpret_cast<F>(dlsym(lib, name));
}

const Driver& Cuda() {
  static const Driver d = [] {
    Driver d{};
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) return d;
    Sym(lib, "cuInit", &d.init);
    Sym(lib, "cuDeviceGet", &d.device_get);
    Sym(lib, "cuDevicePrimaryCtxRetain", &d.retain);
    Sym(lib, "cuCtxPushCurrent_v2", &d.push);
    Sym(lib, "cuCtxPopCurrent_v2", &d.pop);
    Sym(lib, "cuCtxGetDevice", &d.ctx_device);
    Sym(lib, "cuModuleLoadData", &d.load);
    Sym(lib, "cuModuleGetFunction", &d.get_function);
    Sym(lib, "cuFuncSetAttribute", &d.set_attribute);
    Sym(lib, "cuLaunchKernel", &d.launch);
    Sym(lib, "cuGetErrorString", &d.error_string);
    d.ok = d.init && d.device_get && d.retain && d.push && d.pop && d.ctx_device && d.load && d.get_function &&
           d.set_attribute && d.launch && d.error_string;
    return d;
  }();
  return d;
}

std::mutex g_mu;
std::map<std::pair<std::string, int>, CUfunction> g_functions;  // (key, device ordinal) -> function

std::string Describe(CUresult r) {
  const char* s = nullptr;
  Cuda().error_string(r, &s);
  return s ? s : "unknown CUDA error";
}
}  // namespace

// Loads `cubin` into the primary context of `device` and remembers function `name` under `key`.
// Returns 0 on success, else writes a message into err (errlen bytes) and returns the CUresult.
extern "C" int djax_load_cubin(const char* key, const void* cubin, const char* name, int device, int shared_bytes,
                               char* err, int errlen) {
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (g_functions.count({key, device})) return 0;
  }
  const Driver& cu = Cuda();
  if (!cu.ok) {
    std::snprintf(err, errlen, "djax_load_cubin: cannot open libcuda.so.1");
    return -1;
  }
  CUresult r = cu.init(0);
  CUdevice dev;
  CUcontext ctx = nullptr;
  CUmodule mod;
  CUfunction fn;
  if (r == CUDA_SUCCESS) r = cu.device_get(&dev, device);
  if (r == CUDA_SUCCESS) r = cu.retain(&ctx, dev);
  if (r == CUDA_SUCCESS) r = cu.push(ctx);
  if (r == CUDA_SUCCESS) {
    r = cu.load(&mod, cubin);
    if (r == CUDA_SUCCESS) r = cu.get_function(&fn, mod, name);
    if (r == CUDA_SUCCESS && shared_bytes > 48 * 1024)
      r = cu.set_attribute(fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, shared_bytes);
    CUcontext popped;
    cu.pop(&popped);
  }
  if (r != CUDA_SUCCESS) {
    std::snprintf(err, errlen, "djax_load_cubin(%s on device %d): %s", name, device, Describe(r).c_str());
    return static_cast<int>(r);
  }
  std::lock_guard<std::mutex> lock(g_mu);
  g_functions[{key, device}] = fn;
  return 0;
}

// Kernel parameters: every operand's device pointer, then every result's, then `extra_null` null pointers
// (Triton's global and profile scratch, which the kernels we compile never use).
static ffi::Error Launch(CUstream stream, ffi::RemainingArgs args, ffi::RemainingRets rets, std::string_view key,
                         int64_t grid_x, int64_t grid_y, int64_t grid_z, int64_t threads, int64_t shared_bytes,
                         int64_t extra_null) {
  if (!Cuda().ok) return ffi::Error::Internal("cannot open libcuda.so.1");
  CUdevice dev;
  if (CUresult r = Cuda().ctx_device(&dev); r != CUDA_SUCCESS) return ffi::Error::Internal(Describe(r));
  CUfunction fn;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = g_functions.find({std::string(key), static_cast<int>(dev)});
    if (it == g_functions.end()) return ffi::Error::Internal("cubin not loaded on this device: " + std::string(key));
    fn = it->second;
  }
  std::vector<void*> ptrs;
  ptrs.reserve(args.size() + rets.size() + extra_null);
  for (size_t i = 0; i < args.size(); ++i) {
    auto a = args.get<ffi::AnyBuffer>(i);
    if (!a.has_value()) return a.error();
    ptrs.push_back(a->untyped_data());
  }
  for (size_t i = 0; i < rets.size(); ++i) {
    auto o = rets.get<ffi::AnyBuffer>(i);
    if (!o.has_value()) return o.error();
    ptrs.push_back((*o)->untyped_data());
  }
  for (int64_t i = 0; i < extra_null; ++i) ptrs.push_back(nullptr);
  std::vector<void*> params(ptrs.size());
  for (size_t i = 0; i < ptrs.size(); ++i) params[i] = &ptrs[i];
  CUresult r = Cuda().launch(fn, grid_x, grid_y, grid_z, threads, 1, 1, shared_bytes, stream, params.data(), nullptr);
  if (r != CUDA_SUCCESS) return ffi::Error::Internal("cuLaunchKernel: " + Describe(r));
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(DjaxCubinLaunch, Launch,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<CUstream>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<std::string_view>("key")
                                  .Attr<int64_t>("grid_x")
                                  .Attr<int64_t>("grid_y")
                                  .Attr<int64_t>("grid_z")
                                  .Attr<int64_t>("threads")
                                  .Attr<int64_t>("shared_bytes")
                                  .Attr<int64_t>("extra_null"),
                              {ffi::Traits::kCmdBufferCompatible});
