"""Rows gathered by index and quantized 1 x 128 to e4m3, optionally through the clamped SwiGLU of two inputs:
what an MoE layer's FP8 experts feed their grouped GEMMs (the tokens laid out in expert-contiguous groups; the
SwiGLU of gate and up with the layout's padding rows as zeros). `quantize_rows_ref` is the spec, in jnp;
`row_quant_triton` does it in one kernel that reads only the rows it keeps."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from djax.kernels.dispatch import interpreted, resolve
from djax.kernels.fp8_gemm_ref import quantize_act, scale_blocks
from djax.kernels.grouped_gemm_ref import swiglu_f32

IMPLS = ("ref", "triton", "interpret")
# The kernel's plain-scale quotient by one reciprocal a row and two fmas (`fp8_quant_triton._markstein_div`, the
# same bits: tested at e4m3 midpoints on an H100) instead of an IEEE division an element; read when a call is
# traced. H100, V4-Flash's experts at prefill (`ab_moe_fp8.py --prefill`, moe_fp8_prefill_h100_row_quant_skip_ab.json,
# two alternating rounds): TileLang's path 1,949.8-1,987.1 us against 2,006.2-2,017.8 at 4,096 tokens,
# 975.6-976.8 against 1,024.2-1,024.4 at 1,024; the Triton path 1,478.3-1,479.0 against 1,491.0-1,496.3 at 2,048,
# 2,476.7-2,507.0 against 2,496.4-2,496.7 at 4,096 (a tie).
MARKSTEIN = True


def _check(x, src, up):
    if x.ndim != 2:
        raise ValueError(f"quantize_rows: x must be [rows, columns], got shape {x.shape}")
    if src.ndim != 1 or not jnp.issubdtype(src.dtype, jnp.integer):
        raise ValueError(f"quantize_rows: src must be a 1-D integer index, got {src.dtype}{src.shape}")
    if up is not None and up.shape != x.shape:
        raise ValueError(f"quantize_rows: up {up.shape} must have x's shape {x.shape}")


def quantize_rows_ref(x, src, ue8m0: bool = False, up=None, limit: float = 0.0):
    """`quantize_rows` in jnp: the rows gathered (zeros where src is out of range), then `quantize_act`."""
    r = x.shape[0]
    live = (src >= 0) & (src < r)
    at = jnp.clip(src, 0, r - 1)
    rows = x[at].astype(jnp.float32) if up is None else swiglu_f32(x[at], up[at], limit)
    return quantize_act(jnp.where(live[:, None], rows, 0.0), ue8m0)


def quantize_rows(
    x, src, ue8m0: bool = False, up=None, limit: float = 0.0, impl: str = "auto", zero_rows: bool = True
):
    """`quantize_act` of the rows x[src]: row i is x[src[i]], or a zero row where src[i] is outside [0, r)
    (x [r, n]). With `up` (x's shape) x is the gate and row i is the clamped SwiGLU of x[src[i]] and up[src[i]]
    (`swiglu_f32`, limit <= 0: no clamp), taken in float32. ue8m0: power-of-two scales, as `quantize_act`.
    Returns (e4m3 [m, n], float32 [m, ceil(n / 128)]) for m = len(src). zero_rows False: the rows whose src is
    out of range are zero rows or left unwritten (any bits), for a consumer that never reads them (the kernel
    skips every run of `row_quant_triton.BLOCK_ROWS` such rows; the reference writes zeros).

    impl "ref" (jnp), "triton" (`row_quant_triton`: one kernel; n a multiple of 128), "interpret" (that kernel in
    Triton's CPU interpreter) or "auto" (Triton on CUDA where n is a multiple of 128, else the reference). Without
    `up` the kernel gives the reference's bits; with it the SwiGLU's exp is the GPU's own, so values near an
    e4m3 rounding boundary may round the other way."""
    _check(x, src, up)
    n = x.shape[1]
    if impl == "auto" and n % 128:
        impl = "ref"
    impl = resolve(impl, IMPLS)
    if impl == "ref":
        return quantize_rows_ref(x, src, ue8m0, up, limit)
    from djax.kernels import row_quant_triton as rk

    m = src.shape[0]
    rounding = "bits" if impl == "interpret" else "cast"
    cx = rk.constexprs(
        m, n, x.shape[0], up is not None, limit, ue8m0, rounding, zero_rows, MARKSTEIN
    )  # checks n
    src = src.astype(jnp.int32)
    s_out = jax.ShapeDtypeStruct((m, scale_blocks(n)), jnp.float32)
    if impl == "interpret":
        out = (jax.ShapeDtypeStruct((m, n), jnp.float32), s_out)
        args = (x, src) if up is None else (x, src, up)
        host = lambda *h: _host(cx, *h)  # noqa: E731  (the constants as traced: the callback runs later)
        q, s = jax.pure_callback(interpreted(host), out, *args)
        return q.astype(jnp.float8_e4m3fn), s  # float32 stand-ins holding e4m3 values: exact
    from djax.ffi import cubin

    out = [jax.ShapeDtypeStruct((m, n), jnp.float8_e4m3fn), s_out]
    args = [x, up if up is not None else x, src]
    names = ["x_ptr", "up_ptr", "src_ptr", "q_ptr", "s_ptr"]
    dtypes = [a.dtype for a in args] + [o.dtype for o in out]
    kern = cubin.compile_triton(rk.quantize_rows_kernel, names, dtypes, cx, num_warps=rk.NUM_WARPS)
    q, s = cubin.launch(kern, rk.grid(m, n), args, out)
    return q, s


def _host(cx, x, src, up=None):
    import torch

    from djax.kernels.row_quant_triton import launch_torch

    t = lambda a, dt=np.float32: torch.from_numpy(np.array(a, dt))  # noqa: E731
    q, s = launch_torch(t(x), t(src, np.int32), cx, None if up is None else t(up))
    return q.numpy(), s.numpy()
