"""Public grouped GEMMs for MoE experts: contiguous and masked layouts, plain or with the fused gate/up SwiGLU.

impl: "auto" (Triton on CUDA, else ref), "ref", "triton" (cubin launched on XLA's stream), or "interpret"
(the Triton kernel run by its CPU interpreter through a host callback; needs TRITON_INTERPRET=1, for tests).
Rows the Triton kernels skip (padding rows, rows past a group's count) are left unwritten: their contents
are undefined ("interpret" returns nan there), where the reference returns 0.

Weights are arrays or `QArray`s. FP4 ones with UE8M0 scales (V4.1's routed experts, `quant.is_ue8m0_fp4`) are
read as stored by the Triton kernels, which decode each tile in registers (on CUDA by inline PTX,
`fp4_decode`; a config `Fp4Config(..., fp4_decode="bits")` decodes code by code instead, its slow twin); the
reference, and every impl for other quantized weights, makes them dense in a's dtype first (exactly the values
the kernels decode).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from djax import fp4
from djax.kernels import grouped_gemm_ref as ref
from djax.kernels import shapes
from djax.kernels.dispatch import interpreted, resolve
from djax.kernels.grouped_gemm_triton import Fp4Config, GemmConfig, masked_config
from djax.quant import dense, is_ue8m0_fp4

__all__ = [
    "Fp4Config",
    "GemmConfig",
    "grouped_gemm",
    "grouped_gemm_masked",
    "grouped_swiglu",
    "grouped_swiglu_masked",
]

IMPLS = ("ref", "triton", "interpret")
# Masked layout without a config: the widest of these tiles whose height divides the rows per group. H200,
# V4-Flash's experts (gate/up + down) at 64 rows per group (kernels_h200.json): 64-row tiles 569 us,
# 16-row 573 us.
MASKED_CFGS = (GemmConfig(), GemmConfig(64, 128, 64, 4, 4), GemmConfig(16, 128, 128, 4, 4))


def grouped_gemm(a, b, m_indices, rows=None, impl: str = "auto", cfg: GemmConfig | None = None):
    """Contiguous layout: out[i] = a[rows[i]] @ b[m_indices[i]]^T.

    a bf16[m, k] (or [n, k] gathered through rows int32[m], -1 = zero row); b bf16[g, n_out, k] (or a QArray);
    m_indices int32[m]: rows sorted by group, every group starting at a multiple of cfg.block_m, -1 for
    padding (a tile whose first row is -1 is skipped). m must be a multiple of cfg.block_m. Returns [m, n_out].
    """
    shapes.grouped_contiguous("grouped_gemm", a, {"b": b}, m_indices, rows)
    impl = resolve(impl, IMPLS)
    if impl == "ref":
        return ref.contiguous_ref(a, dense(b, a.dtype), m_indices, rows)
    return _run(impl, a, b, None, m_indices, rows, False, 0.0, cfg)


def grouped_gemm_masked(a, b, masked_m, impl: str = "auto", cfg: GemmConfig | None = None):
    """Masked layout (decode): a bf16[g, M, k], the first masked_m[g] rows of group g live; b bf16[g, n, k].
    M must be a multiple of cfg.block_m (no cfg: of 16, the tiles taken from MASKED_CFGS). Returns [g, M, n]."""
    shapes.grouped_masked("grouped_gemm_masked", a, {"b": b}, masked_m)
    impl = resolve(impl, IMPLS)
    if impl == "ref":
        return ref.masked_ref(a, dense(b, a.dtype), masked_m)
    return _run(impl, a, b, None, masked_m, None, True, 0.0, cfg)


def grouped_swiglu(
    a, w1, w3, m_indices, limit: float, rows=None, impl: str = "auto", cfg: GemmConfig | None = None
):
    """Contiguous layout, gate and up fused: silu(min(a w1^T, limit)) * clip(a w3^T, -limit, limit) per row
    (no clamp when limit <= 0). w1, w3 bf16[g, f, k]. Layout rules as `grouped_gemm`. Returns [m, f]."""
    shapes.grouped_contiguous("grouped_swiglu", a, {"w1": w1, "w3": w3}, m_indices, rows)
    impl = resolve(impl, IMPLS)
    if impl == "ref":
        return ref.swiglu_contiguous_ref(a, dense(w1, a.dtype), dense(w3, a.dtype), m_indices, limit, rows)
    return _run(impl, a, w1, w3, m_indices, rows, False, limit, cfg)


def grouped_swiglu_masked(
    a, w1, w3, masked_m, limit: float, impl: str = "auto", cfg: GemmConfig | None = None
):
    """Masked layout, gate and up fused. a bf16[g, M, k]; w1, w3 bf16[g, f, k]. Returns [g, M, f]."""
    shapes.grouped_masked("grouped_swiglu_masked", a, {"w1": w1, "w3": w3}, masked_m)
    impl = resolve(impl, IMPLS)
    if impl == "ref":
        return ref.swiglu_masked_ref(a, dense(w1, a.dtype), dense(w3, a.dtype), masked_m, limit)
    return _run(impl, a, w1, w3, masked_m, None, True, limit, cfg)


def reads_fp4(*ws) -> bool:
    """Whether the kernels read these weights as stored FP4: every one FP4 with UE8M0 scales (one of them
    otherwise, and all are made dense)."""
    return all(is_ue8m0_fp4(w) for w in ws)


def _weights(a, b, b3):
    """The kernels' weight operands: (values..., scale exponent bytes...) read as stored when every weight is
    FP4 the kernels read, else the weights made dense in a's dtype and no scales."""
    ws = [b] if b3 is None else [b, b3]
    if reads_fp4(*ws):
        return [w.values for w in ws], [fp4.exponent_bytes(w.scale) for w in ws]
    return [dense(w, a.dtype) for w in ws], []


def _run(impl, a, b, b3, groups, rows, masked, limit, cfg):
    cfg = cfg or (masked_config(a.shape[1], MASKED_CFGS) if masked else GemmConfig())
    weights, scales = _weights(a, b, b3)
    groups = groups.astype(jnp.int32)
    rows = None if rows is None else rows.astype(jnp.int32)
    nb, n, k = weights[0].shape
    k = 2 * k if scales else k
    out_shape = (nb, a.shape[1], n) if masked else (groups.shape[0], n)
    from djax.kernels import grouped_gemm_triton as tk

    mg = a.shape[1] if masked else 0
    m = nb * mg if masked else groups.shape[0]
    asm = tk.fp4_asm(cfg, impl != "interpret", jnp.dtype(a.dtype).name)
    cx = tk.constexprs(m, n, k, mg, masked, rows is not None, cfg, bool(scales), asm)  # checked at trace time
    if impl == "interpret":
        return _interpret(a, weights, scales, groups, rows, masked, limit, cfg, out_shape)
    from djax.ffi import cubin

    fused = b3 is not None
    # the scale pointers are unread without FP4: any int32 buffer stands in
    scales = scales or [groups] * len(weights)
    args = [a, groups if rows is None else rows, *weights, *scales, groups]
    wnames = ["w1_ptr", "w3_ptr", "s1_ptr", "s3_ptr"] if fused else ["b_ptr", "bs_ptr"]
    names = ["a_ptr", "rows_ptr", *wnames, "grp_ptr", "h_ptr" if fused else "c_ptr"]
    if fused:
        fn, cx = tk.grouped_swiglu_kernel, {**cx, "LIMIT": float(limit)}
    else:
        fn = tk.grouped_gemm_kernel
    kern = cubin.compile_triton(
        fn, names, [x.dtype for x in args] + [a.dtype], cx, cfg.num_warps, cfg.num_stages
    )
    return cubin.launch(kern, tk.grid(m, n, cfg), args, jax.ShapeDtypeStruct(out_shape, a.dtype))


def _interpret(a, weights, scales, groups, rows, masked, limit, cfg, out_shape):
    def host(a, weights, scales, groups, rows):
        import torch

        from djax.kernels.grouped_gemm_triton import launch_torch

        f32 = lambda x: torch.from_numpy(np.array(x, np.float32))  # noqa: E731
        raw = lambda x: torch.from_numpy(np.array(x))  # noqa: E731
        # FP4 codes and scales go in as their bytes; other weights as float32 stand-ins
        w = [raw(x) if scales else f32(x) for x in weights]
        out = launch_torch(
            f32(a),
            w[0],
            raw(groups),
            None if rows is None else raw(rows),
            masked,
            w[1] if len(w) > 1 else None,
            limit,
            cfg,
            [raw(x) for x in scales] or None,
        )
        return out.numpy().astype(a.dtype)

    out = jax.ShapeDtypeStruct(out_shape, a.dtype)
    return jax.pure_callback(interpreted(host), out, a, weights, scales, groups, rows)
