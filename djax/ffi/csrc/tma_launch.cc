// CUDA FFI handler that launches a precompiled cubin whose parameters mix device pointers and TMA descriptors
// (`__grid_constant__ const CUtensorMap`, as TileLang's Hopper kernels take them) on XLA's stream.
//
// The cubin is loaded into each device's primary context from Python (djax_tma_load_cubin) before the first
// call, with the dynamic shared memory attribute set there. Per call the handler only encodes the tensor maps
// from the buffer addresses XLA gives it (cuTensorMapEncodeTiled: host-side arithmetic, no device work, no
// sync, no allocation) and enqueues the kernel; cuLaunchKernel copies the 128-byte descriptors into the
// parameter buffer by value, so the launch is safe to capture in a CUDA graph (declared command-buffer
// compatible; a re-recorded command buffer calls the handler again and re-encodes the new addresses).
//
// The `plan` attribute lists the kernel parameters in order, each as int64 words:
//   pointer:    0, buffer
//   tensor map: 1, buffer, dtype, rank, dims[rank], strides[rank], box[rank], element_strides[rank],
//               interleave, swizzle, l2_promotion, oob_fill
// `buffer` indexes the operands followed by the results. dims / box / element strides are innermost first;
// strides are in bytes with strides[0] the element size (cuTensorMapEncodeTiled takes strides[1:]).
#include <cstdint>
#include <cstdio>
#include <string>

#include "cuda_driver.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using djax_cuda::Cuda;
using djax_cuda::Describe;

namespace {
constexpr int kMaxParams = 16;
constexpr int kMaxMaps = 8;

bool HaveTma() { return Cuda().ok && Cuda().encode_tiled; }

int64_t ElementBytes(int64_t dtype) {
  switch (dtype) {
    case CU_TENSOR_MAP_DATA_TYPE_UINT8:
      return 1;
    case CU_TENSOR_MAP_DATA_TYPE_UINT16:
    case CU_TENSOR_MAP_DATA_TYPE_FLOAT16:
    case CU_TENSOR_MAP_DATA_TYPE_BFLOAT16:
      return 2;
    case CU_TENSOR_MAP_DATA_TYPE_UINT32:
    case CU_TENSOR_MAP_DATA_TYPE_INT32:
    case CU_TENSOR_MAP_DATA_TYPE_FLOAT32:
    case CU_TENSOR_MAP_DATA_TYPE_FLOAT32_FTZ:
    case CU_TENSOR_MAP_DATA_TYPE_TFLOAT32:
    case CU_TENSOR_MAP_DATA_TYPE_TFLOAT32_FTZ:
      return 4;
    case CU_TENSOR_MAP_DATA_TYPE_UINT64:
    case CU_TENSOR_MAP_DATA_TYPE_INT64:
    case CU_TENSOR_MAP_DATA_TYPE_FLOAT64:
      return 8;
    default:
      return 0;
  }
}

struct Buffer {
  void* data;
  size_t bytes;
};

// Encodes one tensor map from plan words w[0..] (after the kind word) into `map`, or only validates the words
// when `map` is null. Returns the words consumed, or -1 with a message.
int EncodeTiled(const int64_t* w, size_t left, const Buffer* bufs, size_t nbufs, CUtensorMap* map,
                std::string* msg) {
  if (left < 3) return (*msg = "plan: truncated tensor map", -1);
  int64_t buf = w[0], dtype = w[1], rank = w[2];
  if (rank < 1 || rank > 5) return (*msg = "plan: tensor map rank must be 1..5", -1);
  size_t need = 3 + 4 * static_cast<size_t>(rank) + 4;
  if (left < need) return (*msg = "plan: truncated tensor map", -1);
  if (buf < 0 || static_cast<size_t>(buf) >= nbufs) return (*msg = "plan: tensor map buffer out of range", -1);
  int64_t esize = ElementBytes(dtype);
  if (esize == 0) return (*msg = "plan: unsupported tensor map dtype " + std::to_string(dtype), -1);
  const int64_t* dims = w + 3;
  const int64_t* strides = dims + rank;
  const int64_t* box = strides + rank;
  const int64_t* estr = box + rank;
  const int64_t* tail = estr + rank;
  cuuint64_t g_dim[5], g_stride[5];
  cuuint32_t b_dim[5], e_str[5];
  int64_t extent = esize;  // bytes spanned by the described tensor
  for (int64_t i = 0; i < rank; ++i) {
    if (dims[i] < 1 || box[i] < 1 || estr[i] < 1) return (*msg = "plan: non-positive tensor map extent", -1);
    g_dim[i] = static_cast<cuuint64_t>(dims[i]);
    g_stride[i] = static_cast<cuuint64_t>(strides[i]);
    b_dim[i] = static_cast<cuuint32_t>(box[i]);
    e_str[i] = static_cast<cuuint32_t>(estr[i]);
    extent += (dims[i] - 1) * strides[i];
  }
  if (strides[0] != esize) return (*msg = "plan: innermost tensor map stride must be the element size", -1);
  const Buffer& b = bufs[buf];
  if (static_cast<size_t>(extent) > b.bytes)
    return (*msg = "tensor map spans " + std::to_string(extent) + " bytes of a " + std::to_string(b.bytes) +
                   "-byte buffer",
            -1);
  if (reinterpret_cast<uintptr_t>(b.data) % 16)
    return (*msg = "tensor map base address is not 16-byte aligned", -1);
  for (int64_t i = 1; i < rank; ++i)
    if (strides[i] % 16) return (*msg = "tensor map strides must be multiples of 16 bytes", -1);
  if (box[0] * esize % 16) return (*msg = "tensor map inner box must be a multiple of 16 bytes", -1);
  if (map == nullptr) return static_cast<int>(need);
  CUresult r = Cuda().encode_tiled(
      map, static_cast<CUtensorMapDataType>(dtype), static_cast<cuuint32_t>(rank), b.data, g_dim, g_stride + 1,
      b_dim, e_str, static_cast<CUtensorMapInterleave>(tail[0]), static_cast<CUtensorMapSwizzle>(tail[1]),
      static_cast<CUtensorMapL2promotion>(tail[2]), static_cast<CUtensorMapFloatOOBfill>(tail[3]));
  if (r != CUDA_SUCCESS) return (*msg = "cuTensorMapEncodeTiled: " + Describe(r), -1);
  return static_cast<int>(need);
}
}  // namespace

// Loads `cubin` into the primary context of `device` and remembers function `name` under `key`; sets the
// dynamic shared memory limit (once, here, never in the handler). Returns 0 on success, else writes a message
// into err (errlen bytes) and returns the CUresult.
extern "C" int djax_tma_load_cubin(const char* key, const void* cubin, const char* name, int device,
                                   int shared_bytes, char* err, int errlen) {
  if (!HaveTma()) {
    std::snprintf(err, errlen, "djax_tma_load_cubin: cannot open libcuda.so.1 (or it lacks cuTensorMapEncodeTiled)");
    return -1;
  }
  return djax_cuda::LoadCubin("djax_tma_load_cubin", key, cubin, name, device, shared_bytes, err, errlen);
}

// Host-only self-check, no GPU or driver needed: parses `plan` over fake 16-byte aligned addresses and the
// given buffer sizes and validates every tensor map as the handler would, without encoding it (the driver does
// that). Returns the number of kernel parameters, or -1 with a message.
extern "C" int djax_tma_check_plan(const int64_t* plan, int64_t plan_len, const int64_t* buffer_bytes,
                                   int64_t nbufs, char* err, int errlen) {
  if (nbufs > kMaxParams) return std::snprintf(err, errlen, "too many buffers"), -1;
  Buffer bufs[kMaxParams];
  for (int64_t i = 0; i < nbufs; ++i)
    bufs[i] = {reinterpret_cast<void*>(static_cast<uintptr_t>(0x10000000ull * (i + 1))),
               static_cast<size_t>(buffer_bytes[i])};
  size_t pos = 0, n = static_cast<size_t>(plan_len);
  int nparams = 0;
  while (pos < n) {
    int64_t kind = plan[pos++];
    if (kind == 0) {
      if (pos >= n || plan[pos] < 0 || plan[pos] >= nbufs) return std::snprintf(err, errlen, "plan: bad pointer"), -1;
      ++pos;
    } else if (kind == 1) {
      std::string msg;
      int used = EncodeTiled(plan + pos, n - pos, bufs, nbufs, nullptr, &msg);
      if (used < 0) return std::snprintf(err, errlen, "%s", msg.c_str()), -1;
      pos += used;
    } else {
      return std::snprintf(err, errlen, "plan: unknown parameter kind %lld", static_cast<long long>(kind)), -1;
    }
    ++nparams;
  }
  return nparams;
}

static ffi::Error Launch(CUstream stream, ffi::RemainingArgs args, ffi::RemainingRets rets, std::string_view key,
                         int64_t grid_x, int64_t grid_y, int64_t grid_z, int64_t threads, int64_t shared_bytes,
                         ffi::Span<const int64_t> plan) {
  if (!HaveTma()) return ffi::Error::Internal("cannot open libcuda.so.1 (or it lacks cuTensorMapEncodeTiled)");
  CUfunction fn;
  if (std::string msg; !djax_cuda::FindFunction(key, &fn, &msg)) return ffi::Error::Internal(msg);
  size_t nbufs = args.size() + rets.size();
  if (nbufs > kMaxParams) return ffi::Error::InvalidArgument("too many buffers");
  Buffer bufs[kMaxParams];
  for (size_t i = 0; i < args.size(); ++i) {
    auto a = args.get<ffi::AnyBuffer>(i);
    if (!a.has_value()) return a.error();
    bufs[i] = {a->untyped_data(), a->size_bytes()};
  }
  for (size_t i = 0; i < rets.size(); ++i) {
    auto o = rets.get<ffi::AnyBuffer>(i);
    if (!o.has_value()) return o.error();
    bufs[args.size() + i] = {(*o)->untyped_data(), (*o)->size_bytes()};
  }
  alignas(64) CUtensorMap maps[kMaxMaps];
  void* ptrs[kMaxParams];
  void* params[kMaxParams];
  int nparams = 0, nmaps = 0;
  size_t pos = 0;
  const int64_t* w = plan.begin();
  const size_t n = plan.size();
  while (pos < n) {
    if (nparams == kMaxParams) return ffi::Error::InvalidArgument("plan: too many kernel parameters");
    int64_t kind = w[pos++];
    if (kind == 0) {
      if (pos >= n || w[pos] < 0 || static_cast<size_t>(w[pos]) >= nbufs)
        return ffi::Error::InvalidArgument("plan: bad pointer entry");
      ptrs[nparams] = bufs[w[pos++]].data;
      params[nparams] = &ptrs[nparams];
    } else if (kind == 1) {
      if (nmaps == kMaxMaps) return ffi::Error::InvalidArgument("plan: too many tensor maps");
      std::string msg;
      int used = EncodeTiled(w + pos, n - pos, bufs, nbufs, &maps[nmaps], &msg);
      if (used < 0) return ffi::Error::InvalidArgument(msg);
      pos += used;
      params[nparams] = &maps[nmaps++];
    } else {
      return ffi::Error::InvalidArgument("plan: unknown parameter kind " + std::to_string(kind));
    }
    ++nparams;
  }
  CUresult r = Cuda().launch(fn, grid_x, grid_y, grid_z, threads, 1, 1, shared_bytes, stream, params, nullptr);
  if (r != CUDA_SUCCESS) return ffi::Error::Internal("cuLaunchKernel: " + Describe(r));
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(DjaxTmaLaunch, Launch,
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
                                  .Attr<ffi::Span<const int64_t>>("plan"),
                              {ffi::Traits::kCmdBufferCompatible});
