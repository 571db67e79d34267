// The CUDA driver entry points the launchers use, opened at run time (so the libraries build where only CUDA's
// headers exist: no libcuda stub), and the registry of loaded kernels: a cubin is loaded into a device's
// primary context once, from Python before the first call, so a handler only looks its function up.
// Each launcher library includes this header and gets its own registry.
#pragma once

#include <cuda.h>
#include <dlfcn.h>

#include <cstdio>
#include <map>
#include <mutex>
#include <string>
#include <utility>

namespace djax_cuda {
namespace {  // internal linkage: every launcher library keeps its own driver table and registry

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
  decltype(&::cuTensorMapEncodeTiled) encode_tiled;  // may be null on an old driver: checked where needed
  decltype(&::cuGetErrorString) error_string;
  bool ok = false;  // every entry point but encode_tiled was found
};

template <typename F>
inline void Sym(void* lib, const char* name, F* out) {
  *out = reinterpret_cast<F>(dlsym(lib, name));
}

inline const Driver& Cuda() {
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
    Sym(lib, "cuTensorMapEncodeTiled", &d.encode_tiled);
    Sym(lib, "cuGetErrorString", &d.error_string);
    d.ok = d.init && d.device_get && d.retain && d.push && d.pop && d.ctx_device && d.load && d.get_function &&
           d.set_attribute && d.launch && d.error_string;
    return d;
  }();
  return d;
}

inline std::string Describe(CUresult r) {
  const char* s = nullptr;
  if (Cuda().error_string) Cuda().error_string(r, &s);
  return s ? s : "unknown CUDA error";
}

inline std::mutex& RegistryMutex() {
  static std::mutex mu;
  return mu;
}

inline std::map<std::pair<std::string, int>, CUfunction>& Registry() {  // (key, device ordinal) -> function
  static std::map<std::pair<std::string, int>, CUfunction> functions;
  return functions;
}

// Loads `cubin` into the primary context of `device`, sets the dynamic shared memory limit (here, once, never
// in a handler) and remembers function `name` under `key`. Returns 0 on success, else writes a message (naming
// `who`) into err (errlen bytes) and returns the CUresult, or -1 without a usable driver.
inline int LoadCubin(const char* who, const char* key, const void* cubin, const char* name, int device,
                     int shared_bytes, char* err, int errlen) {
  {
    std::lock_guard<std::mutex> lock(RegistryMutex());
    if (Registry().count({key, device})) return 0;
  }
  const Driver& cu = Cuda();
  if (!cu.ok) {
    std::snprintf(err, errlen, "%s: cannot open libcuda.so.1", who);
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
    // Always, not only above 48 KB: without the opt-in, static and dynamic shared memory together must fit
    // in 48 KB, so a kernel with exactly 48 KB of dynamic memory plus static mbarriers fails to launch.
    if (r == CUDA_SUCCESS && shared_bytes > 0)
      r = cu.set_attribute(fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, shared_bytes);
    CUcontext popped;
    cu.pop(&popped);
  }
  if (r != CUDA_SUCCESS) {
    std::snprintf(err, errlen, "%s(%s on device %d): %s", who, name, device, Describe(r).c_str());
    return static_cast<int>(r);
  }
  std::lock_guard<std::mutex> lock(RegistryMutex());
  Registry()[{key, device}] = fn;
  return 0;
}

// The function loaded under `key` for the current context's device, or an error message.
inline bool FindFunction(std::string_view key, CUfunction* fn, std::string* msg) {
  CUdevice dev;
  if (CUresult r = Cuda().ctx_device(&dev); r != CUDA_SUCCESS) return (*msg = Describe(r), false);
  std::lock_guard<std::mutex> lock(RegistryMutex());
  auto it = Registry().find({std::string(key), static_cast<int>(dev)});
  if (it == Registry().end()) return (*msg = "cubin not loaded on this device: " + std::string(key), false);
  *fn = it->second;
  return true;
}

}  // namespace
}  // namespace djax_cuda
