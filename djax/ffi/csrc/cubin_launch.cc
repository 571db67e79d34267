// CUDA FFI handler that launches a precompiled cubin (Triton or TileLang, compiled ahead for sm_90) on XLA's
// stream. Modules are loaded into each device's primary context from Python (djax_load_cubin) before the
// first call, so the handler itself only looks up a function and enqueues it: no host sync, no allocation,
// safe to capture in a CUDA graph (declared command-buffer compatible).
#include <cstdint>
#include <string>
#include <vector>

#include "cuda_driver.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using djax_cuda::Cuda;
using djax_cuda::Describe;

// Loads `cubin` into the primary context of `device` and remembers function `name` under `key`.
// Returns 0 on success, else writes a message into err (errlen bytes) and returns the CUresult.
extern "C" int djax_load_cubin(const char* key, const void* cubin, const char* name, int device, int shared_bytes,
                               char* err, int errlen) {
  return djax_cuda::LoadCubin("djax_load_cubin", key, cubin, name, device, shared_bytes, err, errlen);
}

// Kernel parameters: every operand's device pointer, then every result's, then `extra_null` null pointers
// (Triton's global and profile scratch, which the kernels we compile never use).
static ffi::Error Launch(CUstream stream, ffi::RemainingArgs args, ffi::RemainingRets rets, std::string_view key,
                         int64_t grid_x, int64_t grid_y, int64_t grid_z, int64_t threads, int64_t shared_bytes,
                         int64_t extra_null) {
  if (!Cuda().ok) return ffi::Error::Internal("cannot open libcuda.so.1");
  CUfunction fn;
  if (std::string msg; !djax_cuda::FindFunction(key, &fn, &msg)) return ffi::Error::Internal(msg);
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
