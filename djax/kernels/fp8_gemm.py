"""Public FP8 block-scaled GEMM ops (dense, grouped contiguous, grouped masked, and the experts' gate and up
with their SwiGLU in the contiguous layout): impl "auto"|"ref"|"triton"|"tilelang" (dense only)|"interpret"
(the Triton kernel in its CPU interpreter via a host callback, float32 stand-ins; for tests). And
`fp8_weight_gemm`: FP8 weights with block scales of any shape against unquantized activations.

The Triton kernels leave skipped rows (padding, rows past a group's count) unwritten; the reference zeros them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from djax.kernels import dispatch, shapes
from djax.kernels import fp8_swiglu_triton as sk
from djax.kernels.dispatch import interpreted, resolve, sm_count
from djax.kernels.fp8_gemm_ref import (
    fp8_gemm_ref,
    fp8_weight_gemm_ref,
    grouped_contiguous_ref,
    grouped_masked_ref,
    grouped_swiglu_contiguous_ref,
    quantize_act,
)
from djax.kernels.fp8_gemm_triton import DEFAULT_CFG as FP8_CFG
from djax.kernels.fp8_gemm_triton import dense_config, split_k
from djax.kernels.grouped_gemm_ref import swiglu_f32
from djax.kernels.grouped_gemm_triton import GemmConfig, masked_config

IMPLS = ("ref", "triton", "tilelang", "interpret")
GROUPED_IMPLS = ("ref", "triton", "interpret")
SWIGLU_IMPLS = GROUPED_IMPLS + ("tilelang",)
WEIGHT_IMPLS = ("ref", "triton", "interpret")
QUANT_IMPLS = ("ref", "triton", "interpret")
CONTIGUOUS_IMPLS = ("ref", "triton", "tilelang", "interpret")
# Masked layout without a config: the widest of these tiles whose height divides the rows per group. H200,
# V4-Flash's gate/up shape at 64 rows per group (kernels_h200_fp8_grouped_tilelang.json): 64-row tiles
# 97.2 us, 16-row 104.4 us.
MASKED_CFGS = (FP8_CFG, GemmConfig(64, 128, 128, 4, 4), GemmConfig(16, 128, 128, 4, 4))


def fp8_gemm(
    a,
    a_scale,
    b,
    b_scale,
    out_dtype=jnp.bfloat16,
    impl: str = "auto",
    cfg: GemmConfig | None = None,
    tiling=None,
    variant: str | None = None,
):
    """out[m, n] = sum_k a[m, k] b[n, k] with 1x128 / 128x128 scales; see `fp8_gemm_ref.fp8_gemm_ref`.

    impl "tilelang": the TileLang kernel (bf16 out, n and k multiples of 128; needs the `tilelang` extra);
    `variant` "pointer" (default: cp.async, launched with raw pointers) or "ws" (TMA + warp specialisation,
    launched with TMA descriptors by djax.ffi.tma), `tiling` a `fp8_gemm_tilelang.Tiling` / `WsTiling`
    (None: the variant's default for the shape).

    impl "triton" / "interpret": `cfg` a GemmConfig or `fp8_gemm_triton.Fp8Config` (split_k > 1: f32
    partials over K splits, summed here); None: `fp8_gemm_triton.dense_config(m, n, k)`.

    impl "auto" on CUDA: TileLang's "ws" kernel where `auto_takes_tilelang` says so (prefill shapes), or
    TileLang wherever a `tiling` or `variant` is given and it is installed, else Triton (`cfg` given: always)."""
    shapes.fp8_dense(a, a_scale, b, b_scale)
    if impl == "auto" and cfg is None:
        if tiling is not None or variant is not None:  # TileLang's options: take it where it runs
            if dispatch.on_cuda() and dispatch.has_tilelang():
                impl = "tilelang"
        elif auto_takes_tilelang(a, b, out_dtype):
            impl, variant = "tilelang", "ws"
    impl = resolve(impl, IMPLS)
    if impl == "ref":
        return fp8_gemm_ref(a, a_scale, b, b_scale, out_dtype)
    if impl == "tilelang":
        from djax.kernels.fp8_gemm_tilelang import fp8_gemm_tilelang

        return fp8_gemm_tilelang(a, a_scale, b, b_scale, out_dtype, tiling=tiling, variant=variant)
    cfg = cfg or dense_config(a.shape[0], b.shape[0], a.shape[1])
    return _run(impl, "dense", a, a_scale, b[None], b_scale[None], None, out_dtype, cfg)


def fp8_weight_gemm(a, b, b_scale, block, impl: str = "auto", cfg=None, decode: str | None = None):
    """a @ w^T for an FP8 weight read as stored: b's e4m3 codes [n, k] with one float32 scale per block[0] x
    block[1] block (any block shape, e.g. V4.1's 32 x 32), a [m, k] not quantized; or g independent products
    in one launch (a [g, m, k], b [g, n, k], b_scale [g, ...]). See `fp8_gemm_ref.fp8_weight_gemm_ref`.
    Returns a's dtype [m, n] (or [g, m, n]).

    impl "triton" (`fp8_weight_triton`; block[1] must divide the config's K step, 128 by default),
    "interpret" (that kernel in Triton's CPU interpreter, bf16 operands as float32 stand-ins), "ref", or
    "auto" (Triton on CUDA). cfg: an `Fp8Config` (None: `fp8_weight_triton.weight_config`); decode: how the
    kernel makes the codes float ("cast" or "bits"; None: "cast" compiled, "bits" interpreted)."""
    from djax.kernels import fp8_weight_triton as wk

    block = tuple(block)
    shapes.fp8_weight(a, b, b_scale, block)
    impl = resolve(impl, WEIGHT_IMPLS)
    if impl == "ref":
        return fp8_weight_gemm_ref(a, b, b_scale, block)
    plain = a.ndim == 2
    if plain:
        a, b, b_scale = a[None], b[None], b_scale[None]
    g, m, k = a.shape
    n = b.shape[1]
    cfg = cfg or wk.weight_config(m, n, k, g)
    decode = decode or ("bits" if impl == "interpret" else "cast")
    cx = wk.constexprs(m, n, k, block, decode, cfg, g)  # checks the config at trace time, before any callback
    splits = split_k(cfg)
    out = _result((g, m, n), a.dtype, splits)
    args = [a, jax.lax.bitcast_convert_type(b, jnp.uint8), b_scale.astype(jnp.float32)]
    if impl == "interpret":
        host = lambda *h: _host_weight(block, cfg, decode, out.dtype, *h)  # noqa: E731
        c = jax.pure_callback(interpreted(host), out, *args)
    else:
        names = ["a_ptr", "b_ptr", "bs_ptr", "c_ptr"]
        c = _launch(wk.fp8_weight_gemm_kernel, names, args, out, cx, cfg, wk.grid(m, n, cfg, g))
    c = _summed(c, splits, a.dtype)
    return c[0] if plain else c


def fp8_quant_gemm(
    a, b, b_scale, ue8m0: bool = False, impl: str = "auto", cfg=None, rounding: str | None = None
):
    """`fp8_gemm(*quantize_act(a, ue8m0), b, b_scale)` in a's dtype, with a's 1 x 128 quantization done inside
    the GEMM kernel (`fp8_quant_triton`): one kernel (and the split-K sum) where the two-step form runs the
    quantization's kernels first. For the few rows of a decode step. a [m, k] bf16; b e4m3 [n, k] with 128 x
    128 scales b_scale [n / 128, k / 128]; n and k multiples of 128. With ue8m0 (power-of-two scales) the
    kernel multiplies by each scale's exact inverse; with plain scales it gives the IEEE quotient (by one
    reciprocal a row, `fp8_quant_triton.MARKSTEIN` and `NEWTON`).

    impl "triton", "interpret" (that kernel in Triton's CPU interpreter, float32 stand-ins), "ref" (the
    two-step jnp reference), or "auto" (Triton on CUDA). cfg: an `Fp8Config` or `fp8_quant_triton.QuantConfig`
    (its `swap_ab`: the dot taken as b a^T; None: `fp8_quant_triton.quant_config`); rounding: how the kernel
    rounds a / scale to e4m3 ("cast" or "bits"; None: "cast" compiled, "bits" interpreted)."""
    shapes.fp8_quant(a, b, b_scale)
    impl = resolve(impl, QUANT_IMPLS)
    if impl == "ref":
        return fp8_gemm_ref(*quantize_act(a, ue8m0), b, b_scale, a.dtype)
    return _quant_gemm(a, [(b, b_scale)], ue8m0, impl, cfg, rounding)


def fp8_quant_gemm_pair(
    a,
    b,
    b_scale,
    b2,
    b2_scale,
    ue8m0: bool = False,
    impl: str = "auto",
    cfg=None,
    rounding: str | None = None,
):
    """`(fp8_quant_gemm(a, b, b_scale, ue8m0), fp8_quant_gemm(a, b2, b2_scale, ue8m0))` in one launch: two
    projections of the same activations (a decode step's wq_a and wkv, a compressor's wkv and wgate), each
    program reading one weight, so the pair pays one kernel's start and one split-K sum. b [n, k] and b2
    [n2, k] as `fp8_quant_gemm`'s b, both with 128 x 128 scales; impl, cfg (None: `quant_config` of n + n2
    columns) and rounding as there. Returns ([m, n], [m, n2]) in a's dtype."""
    shapes.fp8_quant(a, b, b_scale, "fp8_quant_gemm_pair")
    shapes.fp8_quant(a, b2, b2_scale, "fp8_quant_gemm_pair", ("b2", "b2_scale"))
    impl = resolve(impl, QUANT_IMPLS)
    if impl == "ref":
        a8, a_scale = quantize_act(a, ue8m0)
        return tuple(fp8_gemm_ref(a8, a_scale, w, s, a.dtype) for w, s in ((b, b_scale), (b2, b2_scale)))
    c = _quant_gemm(a, [(b, b_scale), (b2, b2_scale)], ue8m0, impl, cfg, rounding)
    n1 = b.shape[0]
    return c[:, :n1], c[:, n1:]


def _quant_gemm(a, weights: list, ue8m0: bool, impl: str, cfg, rounding: str | None):
    """The quantizing kernel (impl "triton" or "interpret") over one weight, or two side by side in one launch
    (the pair kernel): weights [(b, b_scale)] or [(b, b_scale), (b2, b2_scale)], checked by the caller. Returns
    [m, n (+ n2)] in a's dtype, the split-K partials summed."""
    from djax.kernels import fp8_quant_triton as qk

    m, k = a.shape
    n = sum(w.shape[0] for w, _ in weights)
    pair = len(weights) == 2
    cfg = cfg or qk.quant_config(m, n, k)
    rounding = rounding or ("bits" if impl == "interpret" else "cast")
    # checks the config at trace time, before any callback
    newton = False if impl == "interpret" else None  # the Newton step's PTX runs compiled only
    cx = qk.constexprs(m, n, k, ue8m0, rounding, cfg, weights[0][0].shape[0] if pair else None, newton=newton)
    splits = split_k(cfg)
    out = _result((m, n), a.dtype, splits)
    args = [a] + [x for w, scale in weights for x in (w, scale.astype(jnp.float32))]
    if impl == "interpret":
        host = lambda *h: _host_quant(cx, cfg, out.dtype, *h)  # noqa: E731  (cx as traced: the callback runs later)
        c = jax.pure_callback(interpreted(host), out, *args)
    else:
        names = ["a_ptr", "b_ptr", "bs_ptr"] + (["b2_ptr", "bs2_ptr"] if pair else []) + ["c_ptr"]
        kernel = qk.fp8_quant_gemm_pair_kernel if pair else qk.fp8_quant_gemm_kernel
        c = _launch(kernel, names, args, out, cx, cfg, qk.grid(m, n, cfg))
    return _summed(c, splits, a.dtype)


def auto_takes_tilelang(a, b, out_dtype) -> bool:
    """Whether impl="auto" runs the TileLang "ws" kernel: on CUDA with TileLang (and nvcc) installed, for fp8
    e4m3 operands with n and k multiples of 128 and a bf16 result, where it was measured faster than Triton:
    at prefill when the default tiling's CTAs fill the GPU at least twice over (on 132 SMs, at 128x256 tiles
    and n 4,096: m above 2,048), at decode (m <= 64) where the default tiling is the k-group kernel (n 4096
    with k 2048, 4096, 7168 or 8192, n 7168 with k 4096).

    H200, 2026-12-01 (device time): TileLang 1,169 TFLOP/s at 4096x4096x4096 (512 CTAs) and 1,238 at
    4096x7168x7168 (896 CTAs; bench_tilelang.py), Triton 928 at 4096x4096x7168 (bench_kernels.py); at m 64,
    n 4096, k 7168 the k-group kernel 11.9 us against Triton's 13.0 in one bench_kernels run
    (kernels_h200_fp8_kgroups.json); 2026-12-02, with the cluster's sum pushed
    (kernels_h200_fp8_push_early.json): 11.17 against 12.87 us at k 7168, 7.97 against 9.64 (Triton's best
    configuration there 9.39) at k 4096; pushed from the registers (kernels_h200_fp8_push_regs.json): 10.84
    against 12.97 and 7.86 against 9.60; 2026-12-03, with A's TMA box cut to A's rows
    (kernels_h200_fp8_trim_n7168.json): at k 7168 10.68 against 12.97 (m 64), 10.13 against 11.30 (m 8), 9.61
    against 10.87 (m 1); at n 7168, k 4096 13.70 against 16.03 (m 64), 12.37 against 13.25 (m 8); at n 4096
    (kernels_h200_fp8_v4flash_decode.json), k 8192 11.58 / 11.08 / 10.56 against 14.37 / 12.25 / 11.82
    (m 64 / 8 / 1), k 2048 5.37 / 4.83 against 7.05 / 5.84 (m 64 / 8), and Triton's best configurations there
    14.20, 12.25, 11.82, 5.95, 5.81. Between m = 64 and 4,096 neither was measured: there the TileLang tiles,
    twice as wide, leave more SMs idle than Triton's, so those m stay on Triton, as do the other decode shapes
    (within a few percent of Triton, which compiles a new shape faster: each TileLang program is specialised
    to its (m, n, k))."""
    from djax.kernels.fp8_gemm_tilelang import default_ws_tiling

    m, k = a.shape
    n = b.shape[0]
    fits = n % 128 == 0 and k % 128 == 0 and jnp.dtype(out_dtype) == jnp.bfloat16
    fits = fits and a.dtype == b.dtype == jnp.float8_e4m3fn and b.shape[1] == k
    if not fits:
        return False
    t = default_ws_tiling(m, n, k)
    if m <= 64:
        faster = t.k_groups > 1
    else:
        faster = -(-m // t.block_m) * (n // t.block_n) * t.split_k >= 2 * sm_count()
    return faster and dispatch.on_cuda() and dispatch.has_tilelang()


def contiguous_takes_tilelang(a, b, out_dtype) -> bool:
    """Whether `grouped_contiguous(impl="auto")` (no Triton config given) runs the TileLang grouped kernel: on
    CUDA with TileLang (and nvcc) installed, for fp8 e4m3 operands with n and k multiples of 128, a bf16 result,
    and a layout of at least two waves of its tiles (m / 128 x n / block_n >= 2 x SMs), as for the dense rule.
    Its tiles are 128 rows, as the Triton default's, so the layout's contract (groups starting at multiples of
    128) is the same either way.

    H200, 2026-12-03 (`kernels_h200_fp8_grouped_tilelang.json`, V4-Flash's experts at 4,096 tokens, top-6 of
    256, skewed routing): gate/up shape (n 2048, k 4096) 525.9 us against Triton's 603.2 (its best tiles;
    650.1 its default), down (n 4096, k 2048) 562.5 against 641.9 (716.5); with idle half tiles (2026-12-04,
    `tilelang_fp8_gemm_h200_grouped_half_tiles_ab.json`) 488.5-489.5 and 528.8-530.1 us. Smaller layouts were
    not measured. Since 2026-12-07 the kernel taken is the persistent one (`default_grouped_tiling` for the
    layout's rows), 3-10% faster than those tiles one a CTA at these shapes on an H100."""
    from djax.kernels.fp8_gemm_tilelang import default_grouped_tiling

    m, k = a.shape
    n = b.shape[1]
    fits = n % 128 == 0 and k % 128 == 0 and m % 128 == 0 and jnp.dtype(out_dtype) == jnp.bfloat16
    fits = fits and a.dtype == b.dtype == jnp.float8_e4m3fn
    if not fits or m // 128 * (n // default_grouped_tiling(n, k).block_n) < 2 * sm_count():
        return False
    return dispatch.on_cuda() and dispatch.has_tilelang()


def grouped_contiguous(
    a,
    a_scale,
    b,
    b_scale,
    m_indices,
    out_dtype=jnp.bfloat16,
    impl: str = "auto",
    cfg: GemmConfig | None = None,
    tiling=None,
):
    """See `fp8_gemm_ref.grouped_contiguous_ref`. Triton: groups start at multiples of cfg.block_m and
    m is a multiple of it (a tile whose first row is -1 is skipped). impl "tilelang": the grouped TMA +
    warp-specialised kernel (`fp8_gemm_tilelang.grouped_contiguous_tilelang`; bf16 out, n and k multiples of
    128, groups starting at multiples of its 128-row tiles), `tiling` its `WsTiling` (None: its default).
    impl "auto" on CUDA: TileLang where `contiguous_takes_tilelang` says so or a `tiling` is given, else Triton
    (`cfg` given: always)."""
    shapes.fp8_contiguous(a, a_scale, b, b_scale, m_indices)
    if impl == "auto" and cfg is None and (tiling is not None or contiguous_takes_tilelang(a, b, out_dtype)):
        if dispatch.on_cuda() and dispatch.has_tilelang():
            impl = "tilelang"
    impl = resolve(impl, CONTIGUOUS_IMPLS)
    if impl == "ref":
        return grouped_contiguous_ref(a, a_scale, b, b_scale, m_indices, out_dtype)
    if impl == "tilelang":
        from djax.kernels.fp8_gemm_tilelang import grouped_contiguous_tilelang

        if jnp.dtype(out_dtype) != jnp.bfloat16:
            raise ValueError(f"the TileLang grouped GEMM writes bfloat16, got out_dtype {out_dtype}")
        return grouped_contiguous_tilelang(a, a_scale, b, b_scale, m_indices, tiling)
    return _run(impl, "contiguous", a, a_scale, b, b_scale, m_indices, out_dtype, cfg)


def grouped_swiglu_contiguous(
    a,
    a_scale,
    rows,
    w1,
    s1,
    w3,
    s3,
    m_indices,
    limit: float,
    gate_dtype=jnp.bfloat16,
    impl: str = "auto",
    cfg: GemmConfig | None = None,
):
    """An MoE layer's gate and up projections and its SwiGLU in one pass; see
    `fp8_gemm_ref.grouped_swiglu_contiguous_ref`. Triton (`fp8_swiglu_triton`): groups start at multiples of
    cfg.block_m, m is a multiple of it, cfg.block_n divides 128 (no K split); padding rows are left
    unwritten (the down projection's quantization takes them as zeros without reading them). impl "tilelang"
    (`swiglu_contiguous_tilelang`; bf16 gate_dtype, f and k multiples of 128, groups starting at multiples of
    128 rows): gate and up as two TileLang grouped GEMMs, the SwiGLU in XLA; padding rows 0. "auto" is
    Triton's."""
    shapes.fp8_swiglu_contiguous(a, a_scale, rows, w1, s1, w3, s3, m_indices)
    impl = resolve(impl, SWIGLU_IMPLS)
    gate_dtype = jnp.dtype(gate_dtype)
    sk.rounding(gate_dtype.name)  # one the kernel can round to, whichever impl runs
    if impl == "ref":
        return grouped_swiglu_contiguous_ref(a, a_scale, rows, w1, s1, w3, s3, m_indices, limit, gate_dtype)
    if impl == "tilelang":
        if gate_dtype != jnp.bfloat16:
            raise ValueError(f"the TileLang grouped GEMMs write bfloat16, got gate_dtype {gate_dtype}")
        return swiglu_contiguous_tilelang(a, a_scale, rows, w1, s1, w3, s3, m_indices, limit)
    cfg = cfg or FP8_CFG
    f32, i32 = jnp.float32, jnp.int32
    m, (_, n, k) = rows.shape[0], w1.shape
    cx = sk.constexprs(m, n, k, limit, gate_dtype.name, cfg)  # checks the config at trace time
    args = [
        a,
        a_scale.astype(f32),
        rows.astype(i32),
        w1,
        s1.astype(f32),
        w3,
        s3.astype(f32),
        m_indices.astype(i32),
    ]
    out = jax.ShapeDtypeStruct((m, n), f32)
    if impl == "interpret":
        host = lambda *h: _host_swiglu(limit, gate_dtype.name, cfg, *h)  # noqa: E731
        return jax.pure_callback(interpreted(host), out, *args)
    names = ["a_ptr", "as_ptr", "rows_ptr", "w1_ptr", "s1_ptr", "w3_ptr", "s3_ptr", "grp_ptr", "h_ptr"]
    return _launch(sk.fp8_swiglu_kernel, names, args, out, cx, cfg, sk.grid(m, n, cfg))


def swiglu_contiguous_tilelang(a, a_scale, rows, w1, s1, w3, s3, m_indices, limit: float):
    """`grouped_swiglu_contiguous` by TileLang's grouped GEMM (`fp8_gemm_tilelang.grouped_contiguous_tilelang`,
    its default tiles for the layout): the token rows gathered into the layout (a TMA load reads rows in
    place), gate and up as two grouped GEMMs rounded to bf16 (as the reference rounds them), then the clamped
    SwiGLU and the padding rows' zeros, which XLA fuses into what reads them. Returns f32[m, f]."""
    from djax.kernels.fp8_gemm_tilelang import grouped_contiguous_tilelang
    from djax.kernels.rows import take_rows

    live = (m_indices >= 0) & (rows >= 0)
    src = jnp.maximum(rows, 0)
    # padding rows read token 0 (computed, then zeroed): a tile takes whatever its rows hold
    a, a_scale = take_rows(a, src), a_scale[src]  # fp8 rows as words: `rows`
    gate = grouped_contiguous_tilelang(a, a_scale, w1, s1, m_indices)
    up = grouped_contiguous_tilelang(a, a_scale, w3, s3, m_indices)
    return jnp.where(live[:, None], swiglu_f32(gate, up, limit), 0.0)


def grouped_masked(
    a,
    a_scale,
    b,
    b_scale,
    masked_m,
    out_dtype=jnp.bfloat16,
    impl: str = "auto",
    cfg: GemmConfig | None = None,
):
    """See `fp8_gemm_ref.grouped_masked_ref`. Triton: M is a multiple of cfg.block_m (no cfg: of 16, the
    tiles taken from MASKED_CFGS)."""
    shapes.fp8_masked(a, a_scale, b, b_scale, masked_m)
    impl = resolve(impl, GROUPED_IMPLS)
    if impl == "ref":
        return grouped_masked_ref(a, a_scale, b, b_scale, masked_m, out_dtype)
    return _run(impl, "masked", a, a_scale, b, b_scale, masked_m, out_dtype, cfg)


def _run(impl, mode, a, a_scale, b, b_scale, groups, out_dtype, cfg):
    from djax.kernels import fp8_gemm_triton as tk

    cfg = cfg or (masked_config(a.shape[1], MASKED_CFGS) if mode == "masked" else FP8_CFG)
    f32 = jnp.float32
    nb, n, k = b.shape
    mg = a.shape[1] if mode == "masked" else 0
    m = nb * mg if mode == "masked" else a.shape[0]
    cx = tk.constexprs(m, n, k, mg, mode, cfg)  # checks the config at trace time, before any callback
    splits = split_k(cfg)
    out = _result((*a.shape[:-1], n), out_dtype, splits)
    groups = jnp.zeros((1,), jnp.int32) if groups is None else groups.astype(jnp.int32)
    args = [a, a_scale.astype(f32), b, b_scale.astype(f32), groups]
    if impl == "interpret":
        c = jax.pure_callback(interpreted(lambda *h: _host(mode, cfg, out.dtype, *h)), out, *args)
    else:
        names = ["a_ptr", "as_ptr", "b_ptr", "bs_ptr", "grp_ptr", "c_ptr"]
        c = _launch(tk.fp8_gemm_kernel, names, args, out, cx, cfg, tk.grid(m, n, cfg))
    return _summed(c, splits, out_dtype)


def _result(shape: tuple, dtype, splits: int) -> jax.ShapeDtypeStruct:
    """A Triton GEMM's output: `shape` in `dtype`, or with K split the float32 partials [splits, *shape] each
    split writes (`_summed` adds them and casts after the kernel)."""
    return (
        jax.ShapeDtypeStruct(shape, dtype)
        if splits == 1
        else jax.ShapeDtypeStruct((splits, *shape), jnp.float32)
    )


def _summed(c, splits: int, dtype):
    """`_result`'s output as the product: the partials summed in float32, then cast to `dtype`."""
    return c if splits == 1 else c.sum(0).astype(dtype)


def _launch(kernel, names, args, out, constexprs, cfg, grid):
    """A Triton kernel compiled ahead (for its operands' and result's dtypes) and launched through the FFI
    library on XLA's buffers: `names` its pointer parameters, operands then the result."""
    from djax.ffi import cubin

    dtypes = [x.dtype for x in args] + [out.dtype]
    kern = cubin.compile_triton(kernel, names, dtypes, constexprs, cfg.num_warps, cfg.num_stages)
    return cubin.launch(kern, grid, args, out)


def _torch(x, dtype=np.float32):
    """A host callback's operand as a CPU torch tensor (fp8 as float32 stand-ins for the interpreter)."""
    import torch

    return torch.from_numpy(np.array(x, dtype))


def _host(mode, cfg, out_dtype, a, a_scale, b, b_scale, groups):
    from djax.kernels.fp8_gemm_triton import launch_torch

    if mode == "dense":
        b, b_scale = b[0], b_scale[0]
    g = None if mode == "dense" else _torch(groups, np.int32)
    out = launch_torch(_torch(a), _torch(a_scale), _torch(b), _torch(b_scale), g, mode, cfg)
    return out.numpy().astype(out_dtype)


def _host_weight(block, cfg, decode, out_dtype, a, codes, scale):
    from djax.kernels.fp8_weight_triton import launch_torch

    out = launch_torch(_torch(a), _torch(codes, np.uint8), _torch(scale), block, cfg, decode)
    return out.numpy().astype(out_dtype)


def _host_quant(cx, cfg, out_dtype, a, b, scale, b2=None, scale2=None):
    from djax.kernels.fp8_quant_triton import launch_torch

    second = None if b2 is None else (_torch(b2), _torch(scale2))
    out = launch_torch(_torch(a), _torch(b), _torch(scale), cx, cfg, second)
    return out.numpy().astype(out_dtype)


def _host_swiglu(limit, gate_dtype, cfg, a, a_scale, rows, w1, s1, w3, s3, groups):
    t, i = _torch, lambda x: _torch(x, np.int32)  # noqa: E731
    h = sk.launch_torch(
        t(a), t(a_scale), i(rows), t(w1), t(s1), t(w3), t(s3), i(groups), limit, gate_dtype, cfg
    )
    return h.numpy()
