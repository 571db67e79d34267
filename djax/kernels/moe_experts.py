"""Routed MoE experts from grouped GEMMs: sort picks by expert into BLOCK_M-aligned groups, fused gate/up
SwiGLU, down projection, weighted gather-combine. Same contract as `experts_ragged` in djax/models/moe.py.

`moe_experts` takes bf16 weights or FP4 ones with UE8M0 scales (V4.1's routed experts), which its kernels read
as stored and decode tile by tile; an FP8 QArray is made dense first there (a bf16 copy of the whole expert
stack on every call), and `moe_experts_fp8` runs FP8 experts in DeepGEMM's layout as they are stored, through
the block-scaled grouped GEMM, with the activations quantized 1x128 as DeepSeek's inference does."""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from djax.kernels import dispatch, fp8_gemm, moe_layout_triton, row_quant
from djax.kernels.dispatch import interpreted, per_gpu, resolve
from djax.kernels.fp8_gemm_ref import quantize_act
from djax.kernels.fp8_gemm_triton import Fp8Config, fewest_splits
from djax.kernels.grouped_gemm import GemmConfig, grouped_gemm, grouped_swiglu, reads_fp4
from djax.kernels.rows import set_rows
from djax.models.layers import takes_fp8_grouped
from djax.quant import has_ue8m0_scales

# Picks per expert decide the tile height: small tiles waste less padding at decode sizes.
DECODE_CFG = GemmConfig(block_m=16, block_n=128, block_k=128, num_warps=4, num_stages=4)
PREFILL_CFG = GemmConfig(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=4)
# FP8 (block_k is the 128-wide scale block): 16-row tiles (mma.sync) at decode, where an expert has a few
# picks and every padded row is computed; 64-row wgmma tiles at prefill. The fused gate/up kernel takes
# `swiglu_config`'s columns, the down GEMM these. H200, V4-Flash experts (bench_kernels --only moe_fp8,
# kernels_h200_moe_fp8_fused_default.json): 1 / 32 / 128 tokens 56.4 / 243 / 389 us with 16-row tiles (64
# rows: 64.3 / 303 / 440); 4,096 tokens 2,284 us with 64 (128 rows, 8 warps: 2,611).
# FP4 weights read as stored, while there are fewer picks than half the experts (most touched experts get
# one row): 256-wide K steps with 8 warps, so each K step decodes twice the codes. H100, V4.1-Flash experts
# (384 x 2304 x 5120, top-6), three alternating rounds: 1 / 4 / 16 / 32 tokens 81.8-82.5 / 166.9-167.1 /
# 273.9-274.9 / 396.2-398.1 us against 90.3-90.8 / 213.0-215.0 / 292.9-294.0 / 407.7-411.5 with DECODE_CFG;
# at 64 tokens (384 picks) 555.8-563.0 against 545.6-555.9, so DECODE_CFG from there.
FP4_FEW_PICKS_CFG = GemmConfig(block_m=16, block_n=128, block_k=256, num_warps=8, num_stages=3)
FP8_DECODE_CFG = GemmConfig(block_m=16, block_n=128, block_k=128, num_warps=4, num_stages=4)
FP8_PREFILL_CFG = GemmConfig(block_m=64, block_n=128, block_k=128, num_warps=4, num_stages=4)
# `moe_experts_fp8(impl="tilelang")`'s layout: TileLang's grouped GEMMs take 128-row groups (only block_m is
# read; the GEMMs take their own tiles)
TILELANG_LAYOUT_CFG = GemmConfig(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=4)
# From this many picks an expert (n * k / e) `moe_experts_fp8(impl="auto")` takes TileLang's grouped GEMMs
# (`tilelang_takes`). H100, V4-Flash's experts (256 of 4,096 x 2,048, top-6) under bench_moe's skewed routing,
# `ab_moe_fp8.py --prefill`, two alternating rounds. Before `row_quant` (moe_fp8_prefill_h100_ab.json): 4,096
# tokens (96 picks an expert) 2,437.0-2,438.7 us against the Triton kernels' 2,742.5-2,762.1, 1,024 tokens (24)
# 1,214.9-1,215.2 against 1,057.9-1,058.6, hence 96 then. With `row_quant` skipping the layout's empty runs
# and dividing by an IEEE division (moe_fp8_prefill_h100_row_quant_skip_ab.json), plain scales: 4,096 tokens
# 2,006.2-2,017.8 against 2,496.4-2,496.7; 3,072 (72) 1,665.7-1,677.6 against 2,009.0-2,023.5; 2,048 (48)
# 1,354.4-1,359.6 against 1,491.0-1,496.3; 1,024 (24) 1,024.2-1,024.4 against 1,045.6-1,048.7. UE8M0 scales
# (_skip_ue8m0_ab.json): 4,096 1,900.6-1,908.2 against 2,473.8-2,480.9; 2,048 1,268.8-1,269.4 against
# 1,478.3-1,479.1. So from 24, the smallest count measured to win.
TILELANG_MIN_PICKS_PER_EXPERT = 24
# On the kernels' paths the activations the grouped GEMMs read are gathered and quantized by one Triton kernel
# each (`row_quant`): the tokens into the 128-row groups (TileLang's path) and the SwiGLU output (both paths;
# TileLang's takes the SwiGLU of gate and up in that kernel too), padding rows zeros or, in runs with no pick,
# left unwritten (nothing reads them: the GEMMs skip those tiles). False: XLA's
# gathers, quantizations and scatters, as before (the benchmarks set it while tracing the "before" variants).
ROW_QUANT = True
# The Triton path quantizes the down projection's activations by that kernel from this many picks an expert
# (n * k / e); below, XLA's forms (`quantize_down_acts`). H100, V4-Flash's experts under bench_moe's skewed
# routing, `ab_moe_fp8.py`, alternating rounds, the kernel as first measured (it computed every program, live or
# not): 4,096 tokens (96 an expert) 2,525.1-2,546.4 us against XLA's 2,650.6-2,684.0; 2,048 (48) 1,535.4-1,540.3
# against 1,581.3-1,586.8; 1,024 (24) 1,042.7-1,056.0 against 1,042.2-1,051.2; at decode XLA's were faster, 32
# tokens 321.1-321.8 against 331.4-332.6 and 128 tokens 511.1-511.8 against 515.7-516.9
# (moe_fp8_prefill_h100_row_quant_ab.json, _rerun_ab.json, moe_fp8_decode_h100_row_quant_ab.json). So from 48,
# the smallest count measured to win. TileLang's path (from `TILELANG_MIN_PICKS_PER_EXPERT`) always takes it.
ROW_QUANT_MIN_PICKS_PER_EXPERT = 48


class Layout(NamedTuple):
    """Picks placed in expert-contiguous rows, each expert's group padded to a multiple of block_m.

    rows int32[m_pad]: the token of each padded row (-1 for padding); m_indices int32[m_pad]: its expert
    (-1 for padding); pos int32[n*k]: the padded row of pick (token t, choice j) at t*k + j.
    """

    rows: jax.Array
    m_indices: jax.Array
    pos: jax.Array


def padded_rows(n_picks: int, num_experts: int, block_m: int) -> int:
    """Static bound on the padded rows: every non-empty group wastes at most block_m - 1 rows."""
    tiles = -(-(n_picks + min(num_experts, n_picks) * (block_m - 1)) // block_m)
    return max(tiles, 1) * block_m


def layout(idx, num_experts: int, block_m: int, impl: str = "auto") -> Layout:
    """idx int32[n, k] expert per pick (ids outside [0, e) are dropped: pos -1). impl "ref" (`layout_ref`,
    jnp), "triton" (`moe_layout_triton`: one program instead of about ten XLA kernels; up to its
    MAX_PICKS picks, more take the reference), "interpret" (that program in Triton's CPU interpreter) or
    "auto" (Triton on CUDA)."""
    impl = resolve(impl, ("ref", "triton", "interpret"))
    n, k = idx.shape
    if impl == "ref" or n * k > moe_layout_triton.MAX_PICKS:
        return layout_ref(idx, num_experts, block_m)
    m_pad = padded_rows(n * k, num_experts, block_m)
    out = (
        jax.ShapeDtypeStruct((m_pad,), jnp.int32),
        jax.ShapeDtypeStruct((m_pad,), jnp.int32),
        jax.ShapeDtypeStruct((n * k,), jnp.int32),
    )
    idx = idx.astype(jnp.int32)
    if impl == "interpret":

        def host(i):
            import torch

            got = moe_layout_triton.launch_torch(torch.from_numpy(np.array(i)), num_experts, block_m, m_pad)
            return tuple(t.numpy() for t in got)

        return Layout(*jax.pure_callback(interpreted(host), out, idx))
    from djax.ffi import cubin

    cx = moe_layout_triton.constexprs(n * k, k, num_experts, block_m, m_pad)
    names = ["idx_ptr", "rows_ptr", "mind_ptr", "pos_ptr"]
    kern = cubin.compile_triton(moe_layout_triton.layout_kernel, names, [jnp.int32] * 4, cx, num_warps=4)
    return Layout(*cubin.launch(kern, (1,), [idx], list(out)))


def layout_ref(idx, num_experts: int, block_m: int) -> Layout:
    """`layout` in jnp: the spec."""
    n, k = idx.shape
    flat = idx.reshape(-1).astype(jnp.int32)
    ok = (flat >= 0) & (flat < num_experts)
    key = jnp.where(ok, flat, num_experts)
    sizes = jnp.bincount(key, length=num_experts + 1)[:num_experts].astype(jnp.int32)
    padded = -(-sizes // block_m) * block_m
    starts = jnp.cumsum(padded) - padded  # padded start of each group
    first = jnp.cumsum(sizes) - sizes  # unpadded start of each group
    order = jnp.argsort(key, stable=True)  # sorted position -> pick
    sk = key[order]
    ske = jnp.minimum(sk, num_experts - 1)
    dest = jnp.where(sk < num_experts, starts[ske] + jnp.arange(n * k) - first[ske], -1)
    m_pad = padded_rows(n * k, num_experts, block_m)
    drop = jnp.where(dest >= 0, dest, m_pad)  # out of bounds: dropped by the scatter
    rows = jnp.full((m_pad,), -1, jnp.int32).at[drop].set((order // k).astype(jnp.int32), mode="drop")
    m_indices = jnp.full((m_pad,), -1, jnp.int32).at[drop].set(sk, mode="drop")
    pos = jnp.zeros((n * k,), jnp.int32).at[order].set(dest)
    return Layout(rows, m_indices, pos)


def default_config(n_picks: int, num_experts: int, fp4: bool = False) -> GemmConfig:
    """`moe_experts`' tiles when none are given, by picks per expert; fp4: the weights are FP4 read as stored."""
    if fp4 and 2 * n_picks <= num_experts:
        return FP4_FEW_PICKS_CFG
    return DECODE_CFG if n_picks <= 4 * num_experts else PREFILL_CFG


def fp8_config(n_picks: int, num_experts: int) -> GemmConfig:
    """`moe_experts_fp8`'s tiles when none are given: by picks per expert, as `default_config`."""
    return FP8_DECODE_CFG if n_picks <= 4 * num_experts else FP8_PREFILL_CFG


def fp8_split(cfg: GemmConfig, n_picks: int, num_experts: int, n_out: int, k_in: int) -> GemmConfig:
    """The config for one FP8 grouped GEMM of the experts: cfg as given when it names its own K split (an
    `fp8_gemm_triton.Fp8Config`), else cfg split along K as `fp8_gemm_triton.dense_config` splits a dense
    decode GEMM (`fewest_splits`), counting the tiles that can hold picks (at most one per expert picked,
    n_picks or num_experts). At one token a V4-Flash gate projection is 6 experts x 16 column tiles: 96
    programs for 132 SMs unsplit."""
    if isinstance(cfg, Fp8Config):
        return cfg
    tiles = row_tiles(n_picks, num_experts, cfg.block_m) * -(-n_out // cfg.block_n)
    return Fp8Config(**vars(cfg), split_k=fewest_splits(tiles, k_in // 128))


def row_tiles(n_picks: int, num_experts: int, block_m: int) -> int:
    """Row tiles that can hold picks: at most one per expert picked (n_picks or num_experts), and at most
    the padded rows' tiles."""
    return min(n_picks, num_experts, padded_rows(n_picks, num_experts, block_m) // block_m)


def swiglu_config(cfg: GemmConfig, n_picks: int, num_experts: int, n_out: int) -> GemmConfig:
    """The tiles of the fused gate/up kernel (`fp8_gemm.grouped_swiglu_contiguous`, which has no K split): an
    `Fp8Config` as given (a caller's own tiles), else cfg's with half its columns (the kernel keeps two
    accumulators, gate and up), halved again, down to 32, until the tiles that can hold picks (counted as in
    `fp8_split`) make 256 programs on 132 SMs, about two a SM (`dispatch.per_gpu`).

    H200, V4-Flash experts (bench_kernels --only moe_fp8, kernels_h200_moe_fp8_fused_default.json): one
    token 6 experts x 64 tiles of 32 columns, 55.9 us against 57.1 / 59.0 with 64 / 128 columns; 32 tokens
    64 columns 241.4 us against 246.8 / 246.7 with 128 / 32; 4,096 tokens (64-row tiles) 64 columns 2,284
    us against 2,665 with 128."""
    if isinstance(cfg, Fp8Config):
        return cfg
    tiles, block_n = row_tiles(n_picks, num_experts, cfg.block_m), max(cfg.block_n // 2, 32)
    programs = per_gpu(256)
    while block_n > 32 and tiles * -(-n_out // block_n) < programs:
        block_n //= 2
    return replace(cfg, block_n=block_n)


def tilelang_takes(x, n_picks: int, num_experts: int, f: int, cfg, swiglu_cfg) -> bool:
    """Whether `moe_experts_fp8(impl="auto")` takes impl "tilelang": on CUDA with TileLang installed, no tiles
    given, x bf16, x's width and the experts' hidden width f multiples of 128, and at least
    `TILELANG_MIN_PICKS_PER_EXPERT` picks an expert (prefill)."""
    return (
        cfg is None
        and swiglu_cfg is None
        and x.dtype == jnp.bfloat16
        and x.shape[1] % 128 == 0
        and f % 128 == 0
        and n_picks >= TILELANG_MIN_PICKS_PER_EXPERT * num_experts
        and dispatch.on_cuda()
        and dispatch.has_tilelang()
    )


def moe_experts_fp8(
    x,
    weights,
    idx,
    w1,
    w2,
    w3,
    limit: float,
    impl: str = "auto",
    cfg: GemmConfig | None = None,
    swiglu_cfg: GemmConfig | None = None,
) -> jax.Array:
    """Routed experts with FP8 weights (each `takes_fp8_grouped`) read as stored: x and the SwiGLU output are
    quantized to e4m3 per row and 128 columns (power-of-two scales for weights with UE8M0 scales, as
    `layers.linear`); gate (w1), up (w3) and the SwiGLU are one block-scaled kernel over the picks in
    expert-contiguous order (`fp8_gemm.grouped_swiglu_contiguous`, its tiles narrowed by `swiglu_config` where
    too few), the down projection (w2) one grouped GEMM (`fp8_gemm.grouped_contiguous`) split along K where
    its tiles are too few for the SMs (`fp8_split`). Contract as `moe_experts`; impl as in
    `grouped_contiguous` ("ref" the jnp spec); `swiglu_cfg` the fused kernel's tiles (block_m as cfg's), None
    for `swiglu_config`'s. Returns [n, d] in x's dtype.

    impl "tilelang" (prefill; bf16 x, d and f multiples of 128): the picks in 128-row groups, the token rows
    quantized straight into them, gate and up as two TileLang grouped GEMMs, their SwiGLU quantized in the
    layout (both quantizations `row_quant`'s kernel), the down projection TileLang's grouped GEMM too, each
    with its default tiles for the layout (the persistent kernel where it takes it); cfg, if given, must have
    128-row tiles, and swiglu_cfg none. "auto" takes it where `tilelang_takes` says so (prefill: from
    `TILELANG_MIN_PICKS_PER_EXPERT` picks an expert), else Triton. On the Triton path too the down
    projection's activations come from `row_quant`'s kernel at prefill (`ROW_QUANT_MIN_PICKS_PER_EXPERT`).

    Gate and up come out in x's dtype and the SwiGLU runs in float32 before its quantization, as in
    DeepSeek's inference (bf16 linear outputs, then the activation quantized)."""
    for name, w in (("w1", w1), ("w2", w2), ("w3", w3)):
        if not takes_fp8_grouped(w):
            raise ValueError(
                f"moe_experts_fp8: {name} is not an e4m3 QArray [e, out, in] with 128x128 blocks"
            )
    n, d = x.shape
    e, k = w1.shape[0], idx.shape[1]
    if impl == "auto" and tilelang_takes(x, n * k, e, w1.shape[1], cfg, swiglu_cfg):
        impl = "tilelang"
    tilelang = impl == "tilelang"
    if tilelang and (cfg is not None and cfg.block_m != 128 or swiglu_cfg is not None):
        raise ValueError("impl 'tilelang' lays the picks out in 128-row groups and takes no swiglu_cfg")
    if tilelang and x.dtype != jnp.bfloat16:
        raise ValueError(f"impl 'tilelang' writes bfloat16: x must be bfloat16, got {x.dtype}")
    cfg = cfg or (TILELANG_LAYOUT_CFG if tilelang else fp8_config(n * k, e))
    if swiglu_cfg is not None and swiglu_cfg.block_m != cfg.block_m:
        raise ValueError(f"swiglu_cfg's block_m {swiglu_cfg.block_m} must be the layout's, {cfg.block_m}")
    lay = layout(idx, e, cfg.block_m, "auto" if tilelang else impl)
    dt = x.dtype
    ue8m0_in, ue8m0_down = has_ue8m0_scales(w1), has_ue8m0_scales(w2)
    quant = row_quant_impl(impl, d, w1.shape[1])
    if tilelang and quant is not None:
        hq, hs = _tilelang_swiglu_quantized(x, lay, w1, w3, limit, ue8m0_in, ue8m0_down, quant)
    else:
        xq, xs = quantize_act(x, ue8m0=ue8m0_in)
        h = fp8_gemm.grouped_swiglu_contiguous(
            xq,
            xs,
            lay.rows,
            w1.values,
            _scale(w1),
            w3.values,
            _scale(w3),
            lay.m_indices,
            limit,
            dt,
            impl=impl,
            cfg=None if tilelang else swiglu_cfg or swiglu_config(cfg, n * k, e, w1.shape[1]),
        )
        kernel = quant if n * k >= ROW_QUANT_MIN_PICKS_PER_EXPERT * e else None
        hq, hs = quantize_down_acts(h, lay, ue8m0_down, kernel)
    c = None if tilelang else fp8_split(cfg, n * k, e, *w2.shape[1:])
    y = fp8_gemm.grouped_contiguous(
        hq, hs, w2.values, _scale(w2), lay.m_indices, out_dtype=dt, impl=impl, cfg=c
    )
    return _combine(y, lay, weights, n, k, d).astype(dt)


def _scale(w):
    return w.scale.astype(jnp.float32)


def row_quant_impl(impl: str, d: int, f: int) -> str | None:
    """`row_quant.quantize_rows`' impl on `moe_experts_fp8`'s path `impl`, or None where XLA's gathers and
    quantizations run instead: impl "ref", "auto" off CUDA, widths d or f not multiples of 128, `ROW_QUANT`
    off. "interpret" runs that kernel in Triton's interpreter too, every GPU path ("triton", "tilelang",
    "auto" on CUDA) the kernel."""
    if not ROW_QUANT or impl == "ref" or d % 128 or f % 128:
        return None
    if impl == "interpret":
        return "interpret"
    if impl in ("triton", "tilelang"):
        return "triton"
    return "triton" if dispatch.on_cuda() and dispatch.has_triton() else None  # "auto", as `resolve` takes it


def pick_rows(lay: Layout) -> jax.Array:
    """`quantize_rows`' source index for quantizing the layout's rows in place: each pick's row itself, -1 (a
    zero row) for padding."""
    m = lay.m_indices.shape[0]
    return jnp.where(lay.m_indices >= 0, jnp.arange(m, dtype=jnp.int32), -1)


def _tilelang_swiglu_quantized(x, lay: Layout, w1, w3, limit: float, ue8m0_in: bool, ue8m0_down: bool, quant):
    """impl "tilelang"'s gate, up and SwiGLU, returning the down projection's quantized activations: the token
    rows of x quantized straight into the layout's 128-row groups, gate and up as two TileLang grouped GEMMs in
    bf16, then their clamped SwiGLU quantized in the layout, each by `row_quant` (impl `quant`). Neither the
    tokens' fp8 copy nor the float32 SwiGLU reaches memory."""
    from djax.kernels import fp8_gemm_tilelang as tg

    # padding rows: zeros, or left unwritten where a whole run of them is (the layout's tail of empty groups,
    # whose tiles the GEMMs skip; inside a live tile a padding row's product is never read)
    xq, xs = row_quant.quantize_rows(x, lay.rows, ue8m0_in, impl=quant, zero_rows=False)
    gate = tg.grouped_contiguous_tilelang(xq, xs, w1.values, _scale(w1), lay.m_indices)
    up = tg.grouped_contiguous_tilelang(xq, xs, w3.values, _scale(w3), lay.m_indices)
    src = pick_rows(lay)
    return row_quant.quantize_rows(gate, src, ue8m0_down, up=up, limit=limit, impl=quant, zero_rows=False)


# From this many bytes of SwiGLU output the down projection's activations are quantized from the picks' rows
# (`quantize_pick_rows`); below it every row is (`quantize_padded_rows`: two small kernels, where the other way
# adds a scatter's launch). V4-Flash's experts (2,048 columns) cross it at 6 tokens. On an H100: at 32 tokens
# (3,072 padded rows, 25 MB) the FP8 decode step took 4,639.7 us against 4,741.5, with the compressor's
# barrier; at one token (96 rows) the scatter took 3 us a call. Sizes between, and prefill's, not measured.
PICK_ROWS_MIN_BYTES = 4 << 20


def quantize_down_acts(h, lay: Layout, ue8m0: bool, kernel: str | None = None):
    """`quantize_act` of the SwiGLU output h float32[m_pad, f] with its padding rows taken as zeros: what the
    down projection reads. Padding rows must be zeros: a skipped tile leaves its rows unwritten (any bits, nan
    included). kernel: `row_quant`'s impl, one kernel that reads only the picks' rows (runs of padding rows with
    no pick, which no tile reads, it may leave unwritten); None: XLA's two ways, which give the same bits, h's
    size choosing between them (`PICK_ROWS_MIN_BYTES`)."""
    if kernel is not None:
        return row_quant.quantize_rows(h, pick_rows(lay), ue8m0, impl=kernel, zero_rows=False)
    if h.size * h.dtype.itemsize >= PICK_ROWS_MIN_BYTES:
        return quantize_pick_rows(h, lay.pos, ue8m0)
    return quantize_padded_rows(h, lay.m_indices, ue8m0)


def quantize_pick_rows(h, pos, ue8m0: bool):
    """`quantize_down_acts` reading only the picks' rows of h (pos int32[n*k], the padded row of each pick, -1
    for a dropped one) and writing the rest as a zero row quantizes. At decode most rows are padding (32 tokens
    x 6 picks over 256 experts in 16-row tiles: 192 of 3,072 rows), and quantizing every row read the float32
    h twice (its block maxima, then the values)."""
    m, f = h.shape
    q, s = quantize_act(h[jnp.maximum(pos, 0)], ue8m0=ue8m0)
    zero_q, zero_s = quantize_act(jnp.zeros((1, f), h.dtype), ue8m0=ue8m0)  # a padding row's
    dest = jnp.where(pos >= 0, pos, m)  # a dropped pick: out of range, dropped by the scatter
    hq = set_rows(jnp.broadcast_to(zero_q, (m, f)), dest, q)  # fp8 rows as words: `rows`
    hs = jnp.broadcast_to(zero_s, (m, zero_s.shape[1])).at[dest].set(s, mode="drop")
    return hq, hs


def quantize_padded_rows(h, m_indices, ue8m0: bool):
    """`quantize_down_acts` reading every row of h: padding rows (m_indices -1) zeroed, then quantized. The
    twin `quantize_pick_rows` is tested against."""
    return quantize_act(jnp.where((m_indices >= 0)[:, None], h, 0.0), ue8m0=ue8m0)


def _combine(y, lay: Layout, weights, n: int, k: int, d: int) -> jax.Array:
    """sum over each token's picks of its expert's output row times its weight, in float32."""
    picked = y[jnp.maximum(lay.pos, 0)].reshape(n, k, d).astype(jnp.float32)
    w = jnp.where(lay.pos >= 0, weights.reshape(-1), 0.0).reshape(n, k, 1)
    # where, not a product: skipped rows of y hold undefined values (possibly nan)
    return jnp.where(w != 0, picked * w, 0.0).sum(1)


def moe_experts(
    x, weights, idx, w1, w2, w3, limit: float, impl: str = "auto", cfg: GemmConfig | None = None
) -> jax.Array:
    """Routed experts via grouped GEMMs. x: [n, d]; weights f32[n, k]; idx int32[n, k]; w1, w3: [e, f, d];
    w2: [e, d, f], plain (cast to x's dtype) or QArrays: FP4 with UE8M0 scales read as stored by the kernels
    (`grouped_gemm`), others made dense in x's dtype. Returns [n, d] in x's dtype.

    impl as in `grouped_gemm` ("interpret" runs the Triton kernels in the CPU interpreter). Picks with an
    expert id outside [0, e) contribute nothing.
    """
    n, d = x.shape
    e, k = w1.shape[0], idx.shape[1]
    cfg = cfg or default_config(n * k, e, fp4=reads_fp4(w1, w2, w3))
    lay = layout(idx, e, cfg.block_m, impl)
    dt = x.dtype
    h = grouped_swiglu(x, w1, w3, lay.m_indices, limit, lay.rows, impl, cfg)
    y = grouped_gemm(h, w2, lay.m_indices, None, impl, cfg)  # [m_pad, d]
    return _combine(y, lay, weights, n, k, d).astype(dt)


def moe_experts_triton(x, weights, idx, w1, w2, w3, limit: float) -> jax.Array:
    """`moe_experts` with the Triton kernels: the drop-in CUDA twin of djax/models/moe.py's `experts_ragged`."""
    return moe_experts(x, weights, idx, w1, w2, w3, limit, impl="triton")
