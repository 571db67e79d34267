// CPU FFI handlers for MoE routing: gather rows into expert order, scatter-add weighted rows back.
// They prove the FFI plumbing (build on first use, registration, custom call) on machines without a GPU.
#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// out[i] = x[idx[i]] for 0 <= idx[i] < n, zeros otherwise. x: [n, d] of any type; idx: s32[m].
static ffi::Error GatherRows(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> idx, ffi::Result<ffi::AnyBuffer> out) {
  auto dims = x.dimensions();
  if (dims.size() != 2) return ffi::Error::InvalidArgument("gather_rows: x must be 2-D");
  if (out->element_type() != x.element_type()) return ffi::Error::InvalidArgument("gather_rows: dtype mismatch");
  const int64_t n = dims[0];
  const int64_t m = static_cast<int64_t>(idx.element_count());
  const size_t row = ffi::ByteWidth(x.element_type()) * static_cast<size_t>(dims[1]);
  if (out->size_bytes() != row * static_cast<size_t>(m)) return ffi::Error::InvalidArgument("gather_rows: bad out shape");
  const char* src = static_cast<const char*>(x.untyped_data());
  char* dst = static_cast<char*>(out->untyped_data());
  const int32_t* ids = idx.typed_data();
  for (int64_t i = 0; i < m; ++i) {
    const int64_t j = ids[i];
    if (j >= 0 && j < n) {
      std::memcpy(dst + i * row, src + j * row, row);
    } else {
      std::memset(dst + i * row, 0, row);
    }
  }
  return ffi::Error::Success();
}

// out[idx[i]] += w[i] * ys[i] over i in [0, m), skipping idx outside [0, n). ys: f32[m, d]; out: f32[n, d].
static ffi::Error ScatterAddRows(ffi::Buffer<ffi::F32> ys, ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::S32> idx,
                                 ffi::ResultBuffer<ffi::F32> out) {
  auto yd = ys.dimensions();
  auto od = out->dimensions();
  if (yd.size() != 2 || od.size() != 2 || yd[1] != od[1]) return ffi::Error::InvalidArgument("scatter_add_rows: shapes");
  const int64_t m = yd[0], d = yd[1], n = od[0];
  if (static_cast<int64_t>(w.element_count()) != m || static_cast<int64_t>(idx.element_count()) != m)
    return ffi::Error::InvalidArgument("scatter_add_rows: w and idx must have one entry per row");
  float* o = out->typed_data();
  std::memset(o, 0, sizeof(float) * static_cast<size_t>(n * d));
  const float* y = ys.typed_data();
  for (int64_t i = 0; i < m; ++i) {
    const int64_t j = idx.typed_data()[i];
    if (j < 0 || j >= n) continue;
    const float wi = w.typed_data()[i];
    for (int64_t c = 0; c < d; ++c) o[j * d + c] += wi * y[i * d + c];
  }
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(DjaxGatherRows, GatherRows,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()          // x
                                  .Arg<ffi::Buffer<ffi::S32>>()   // idx
                                  .Ret<ffi::AnyBuffer>());        // out

XLA_FFI_DEFINE_HANDLER_SYMBOL(DjaxScatterAddRows, ScatterAddRows,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // ys
                                  .Arg<ffi::Buffer<ffi::F32>>()   // w
                                  .Arg<ffi::Buffer<ffi::S32>>()   // idx
                                  .Ret<ffi::Buffer<ffi::F32>>()); // out
