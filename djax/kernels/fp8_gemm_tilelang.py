"""FP8 block-scaled GEMM written in TileLang: an sm_90a cubin launched by the FFI cubin launcher, or AscendC.

One TileLang program per backend, both specialised to static (m, n, k):
- CUDA: cp.async multi-stage pipeline into shared memory, wgmma (fp8 e4m3 x e4m3 -> f32) over each 128-wide
  k block into a fresh register tile, then DeepGEMM's promotion: the block's partial sum times its activation
  scale (per row) and weight scale (per 128x128 block) is added into a separate f32 accumulator.
  TMA and warp specialisation are switched off so that the kernel's parameters are the five device pointers
  (operands, then the result) that `djax/ffi/csrc/cubin_launch.cc` passes, as for Triton's kernels.
- Ascend (AscendC source only; no Ascend hardware here): the Cube core does the block GEMM into L0C, the two
  Vector cores each take half the rows of the partial sum and apply the same promotion in their unified buffer.

The "ws" CUDA variant (`ws_program`, `WsTiling`) is the same arithmetic with TileLang's Hopper lowering left on:
TMA loads of the fp8 tiles into a `stages`-deep ring, a producer warpgroup and one consumer warpgroup per 64 rows
(automatic warp specialisation, mbarrier handshakes), each consumer issuing m64nNk32 wgmmas over the full tile
width, the scales for the k block loaded before its wgmmas (their latency hides under the MMA), a TMA store of
the bf16 tile, an optional rasterised block order (L2 reuse at prefill) and an optional split of k (decode:
f32 partials summed by XLA). Newer `WsTiling` options: 128x256 tiles (each warpgroup's 64x256 computed per k
block in two 128-column slices), two consumer warpgroups side by side at decode, the CTA's scales loaded
once into shared memory by TMA (`smem_scales`), and at decode consumer warpgroups taking turns over the k
blocks with the k splits summed in a thread-block cluster (`k_groups`, the program in
`fp8_decode_tilelang.py`). Its kernel takes `CUtensorMap` descriptors, so it is launched by
`djax/ffi/csrc/tma_launch.cc` (`djax.ffi.tma`), which encodes them per call from XLA's buffer addresses.

Compiling needs TileLang 0.1.15 and, for the cubin, nvcc (13.0 here and on the H200 image), not a GPU.
"""

import functools
import hashlib
import re
from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp

from djax.kernels import tilelang_build
from djax.kernels.dispatch import sm_count
from djax.kernels.tilelang_build import (
    ARCH,
    HOPPER,
    POINTER_ONLY,
    lower,
    lowered_on_disk,
    nvcc_cubin,
    pointer_kernel,
    tma_kernel,
)

BLOCK = 128  # scale granularity along k (and along n for the weights)
_PARAMS = ("A", "AS", "B", "BS", "C")  # kernel parameter order: operands in call order, then the result
_GROUPED_PARAMS = ("A", "AS", "B", "BS", "MI", "C")  # the grouped contiguous program's


@dataclass(frozen=True)
class Tiling:
    """CUDA tile sizes: block_m rows x block_n columns per CTA, 64 rows per warpgroup."""

    block_m: int
    block_n: int
    stages: int

    @property
    def threads(self) -> int:
        return 128 * (self.block_m // 64)


@dataclass(frozen=True)
class CudaKernel:
    """A compiled kernel and everything needed to launch it: grid (x, y, z), threads per CTA (x only),
    dynamic shared memory in bytes, parameter names in order, and the CUDA source it came from."""

    cubin: object  # djax.ffi.cubin.Cubin
    grid: tuple[int, int, int]
    params: tuple[str, ...]
    source: str


@dataclass(frozen=True)
class WsTiling:
    """Tiles of the TMA + warp-specialised variant: block_m rows x block_n columns per CTA, a `stages`-deep TMA
    ring, `panel` > 0 rasterises the block order in panels of that many tiles (L2 reuse), `split_k` > 1 splits k
    over the grid's z (f32 partials).

    block_n divides 128 (one weight scale per tile) or is 256 (two). `warpgroups` consumer warpgroups (0: one per
    64 rows) split the tile by rows when there are block_m / 64 of them, else by columns (block_m 64 with two
    warpgroups of 64 x block_n/2 each: decode). A warpgroup whose share is wider than 128 columns computes each
    k block's partial in 128-column slices (one wgmma chain and promotion per slice) so that partial (64 regs)
    and promoted accumulator (64 per slice) fit under setmaxnreg's 240. `smem_scales` loads the CTA's activation
    and weight scales for its whole k range into shared memory (TMA, once) instead of from global memory in
    every k block, taking their latency off the consumers' per-block critical path.

    `k_groups` > 1 (decode, block_m 64): that many consumer warpgroups take turns over the k blocks and sum
    their accumulators at the end, and the `split_k` splits of a tile sum theirs inside one thread-block
    cluster, so the result is bf16 from the one kernel (`fp8_decode_tilelang`).

    `scales_ahead` loads the next k block's scales while this one's wgmmas run (from global memory, one k
    block ahead) instead of in the block that uses them, whose promotion would otherwise wait on them.

    `early_store` (two 128-column slices a warpgroup, no split): the first slice's TMA store is issued as
    soon as that slice is staged, under the second slice's staging, and one wait covers both stores
    (`with_early_store`).

    `push_sum` (k_groups > 1 with a split of k): the cluster's sum is pushed, not pulled. Every consumer
    warpgroup stages its accumulator in its own shared memory and one thread sends each other split the
    rows it stores by bulk copy into that split's shared memory, completing bytes on its mbarrier; the
    owner's consumer threads add all warpgroups' and splits' values and store bf16. No cluster barrier
    follows the k loop (`fp8_decode_tilelang`).

    `push_regs` (with push_sum): the values go to their owner straight from the accumulator registers
    (st.async into its shared memory), and the owner's warpgroups each add up a share of its columns: no
    staging of the whole tile, no proxy fence, no bulk copy (`djax_push_regs`).

    `cache_hints` (k_groups > 1): A's TMA loads ask L2 to keep A (every column tile reads it: evict_last)
    and the weights' to let them go first (each byte read once: evict_first).

    `half_tiles` (the grouped program, 128-row tiles): in a tile whose second 64 rows are all padding, the
    warpgroup of those rows skips its wgmmas and promotions (it still waits and arrives on every stage, and
    stores zeros for its rows), so the first warpgroup has the tensor cores to itself (`with_half_tiles`).
    With groups padded to 128 rows, the last tile of a group of r rows is such a tile when r mod 128 is
    1 to 64.

    `persistent` ("static" or "atomic"; 128x256 tiles with the scales ahead): one CTA per SM walks the tiles
    instead of one CTA a tile, its ring running on across tiles and each tile's store drained under the next
    one's k loop; it takes the next tile in a fixed order or from a counter in global memory
    (`fp8_persistent`, a CUDA kernel of its own with the default's k loop). With "atomic", launches of one
    compiled kernel must not overlap (XLA's one stream and default command-buffer mode keep them in order).
    The grouped program takes it too (with or without `half_tiles`): the walk then covers only the tiles whose
    first row has a group.

    With m under block_m (decode), A's TMA box (and with smem_scales its scales') spans A's m rows, not
    block_m: a box reaching past the end of A is filled slowly (at m 8, n 4096, k 7168 the decode GEMM took
    14.3-14.6 us with 64-row boxes and 9.9-10.1 with 8 on the H200). The shared rows past m are never written
    and the accumulator rows they feed never stored."""

    block_m: int
    block_n: int
    stages: int
    panel: int = 0
    split_k: int = 1
    warpgroups: int = 0
    smem_scales: bool = False
    k_groups: int = 1
    scales_ahead: bool = False
    early_store: bool = False
    push_sum: bool = False
    push_regs: bool = False
    cache_hints: bool = False
    half_tiles: bool = False
    persistent: str = ""

    @property
    def consumer_wgs(self) -> int:
        if self.k_groups > 1:
            return self.k_groups
        return self.warpgroups or self.block_m // 64

    @property
    def consumer_threads(self) -> int:
        return 128 * self.consumer_wgs

    @property
    def by_rows(self) -> bool:
        """Warpgroups split the tile by rows (FullRow) rather than by columns (FullCol)."""
        return self.consumer_wgs == self.block_m // 64

    @property
    def slices(self) -> int:
        """128-column slices each k block's partial is computed in (1: the whole tile in one wgmma chain)."""
        wg_cols = self.block_n if self.by_rows else self.block_n // self.consumer_wgs
        return max(1, wg_cols // BLOCK)

    @property
    def sums_in_cluster(self) -> bool:
        """The splits of a tile add up inside the kernel, in one thread-block cluster (the k-group program);
        otherwise, with split_k > 1, each split writes an f32 partial that XLA sums after the kernel."""
        return self.k_groups > 1 and self.split_k > 1

    @property
    def name(self) -> str:
        tail = (f"_p{self.panel}" if self.panel else "") + (f"_k{self.split_k}" if self.split_k > 1 else "")
        tail += (f"_w{self.warpgroups}" if self.warpgroups else "") + ("_ss" if self.smem_scales else "")
        tail += f"_g{self.k_groups}" if self.k_groups > 1 else ""
        tail += "_sa" if self.scales_ahead else ""
        tail += "_es" if self.early_store else ""
        tail += "_ps" if self.push_sum else ""
        tail += "_pr" if self.push_regs else ""
        tail += "_ch" if self.cache_hints else ""
        tail += "_ht" if self.half_tiles else ""
        tail += f"_pers_{self.persistent}" if self.persistent else ""
        return f"ws{self.block_m}x{self.block_n}s{self.stages}{tail}"


# The k-group decode kernel every measured decode shape with n 4096 (k 2048 to 8192) or n 7168, k 4096 takes:
# two consumer warpgroups over k, 2 splits summed in their cluster by pushing registers, cache hints on the loads
K_GROUP_DECODE = WsTiling(64, 64, 8, split_k=2, k_groups=2, push_sum=True, push_regs=True, cache_hints=True)

# Best "ws" tiling measured on an H200 per (regime, n, k) (bench_tilelang.py, device time; regime: m <= 64 is
# decode): decode from benchmarks/results/tilelang_fp8_gemm_h200_decode.json (n 4096, k 7168 from
# tilelang_fp8_gemm_h200_decode_kgroups.json), prefill from tilelang_fp8_gemm_h200_prefill.json (one run
# each). Neighbours within about 1% are within a run's noise: at prefill the same tiles with shared-memory
# scales took 337.4 us (7168) and 125.1 us (4096).
MEASURED_WS_BEST = {
    # scales a k block ahead, side by side with the same tiles without (tilelang_fp8_gemm_h200_ahead_ab.json,
    # m=4096): 331.2-332.0 us against 335.9-337.5 (64.2% of FP8 peak); at 4096^3 117.2-117.7 against
    # 117.5-119.0 (59.2%)
    ("prefill", 7168, 7168): WsTiling(128, 256, 3, panel=8, scales_ahead=True),
    # the first slice's TMA store issued under the second slice's staging, side by side in three runs
    # (tilelang_fp8_gemm_h200_early_store_yield_ab.json, _two_ctas_ab.json, _clocks_persistent.json):
    # 117.1-117.7, 117.4-117.9 and 116.4-117.1 us against 118.9-120.3, 118.0-120.6 and 117.7-117.9 at
    # 4096^3; at k 7168 it was 0.4-0.9% slower every time, so not taken there
    # (that early store was the default here until 2026-12-07.) One CTA per SM walking the tiles in a fixed
    # order (fp8_persistent), side by side with the early store on an 80 GB H100 in 7 rounds over two calls
    # (tilelang_fp8_gemm_h100_persistent_ab.json, _more_ab.json): 114.8-116.2 us against 115.8-118.0 at
    # 4096^3 (60.2% of FP8 peak at the median), 222.5-224.4 against 226.3-227.3 at m 8192; on a second H100
    # 118.1-118.7 against 118.9-119.3 and 230.3-231.4 against 232.6-233.4 (_second_machine_ab.json). Taking
    # each next tile from a counter instead tied it at 4096^3 and was 0.5-1% faster at m 8192; at k 7168 the
    # persistent kernel tied or lost up to 1.3%, so it is not taken there
    ("prefill", 4096, 4096): WsTiling(128, 256, 3, panel=8, scales_ahead=True, persistent="static"),
    ("decode", 16384, 7168): WsTiling(64, 128, 8, smem_scales=True),  # 32.2 us
    # two consumer warpgroups over k, the 2 splits summed in their cluster, the sum pushed by bulk copy:
    # 11.27-11.38 us against 11.46-11.60 pulled (tilelang_fp8_gemm_h200_decode_push3_ab.json; with the early
    # arrive, a tie, _push_early_ab.json), which was 11.99 us against 12.82 for the split summed by XLA after
    # and pushed straight from the registers (st.async): 10.66-10.93 us against 11.08-11.29 by bulk copy, four
    # alternating rounds (tilelang_fp8_gemm_h200_decode_push_regs_ab.json); with L2 asked to keep A and to let
    # the weights go first, 10.52-10.66 us against 10.78-10.98, and at m 8 9.80-9.96 against 10.05-10.24 (one
    # round of five 10.45), five rounds (tilelang_fp8_gemm_h200_decode_cache_hints_ab.json)
    ("decode", 4096, 7168): K_GROUP_DECODE,
    # the same: 8.03-8.12 us against 8.86-8.94 for 64x64 split 2 summed by XLA and 8.17-8.46 pulled; with the
    # early arrive 7.99-8.19 against 8.10-8.27; from the registers 7.53-7.72 against 7.98-8.07; with the cache
    # hints 7.40-7.59 against 7.61-7.73 (the same five rounds)
    ("decode", 4096, 4096): K_GROUP_DECODE,
    # the register push, side by side with 64x128 and scales in shared memory (13.9 us in that first run), five
    # rounds (tilelang_fp8_gemm_h200_decode_n7168_ab.json): at m 64 13.23-13.58 us against 13.82-14.07, at m 8
    # 12.20-12.38 against 13.78-14.04, at m 1 12.03-12.23 against 13.77-13.87; with the cache hints at m 64
    # 13.10-13.25 against 13.37-13.62, five rounds (tilelang_fp8_gemm_h200_decode_cache_hints_more_ab.json)
    ("decode", 7168, 4096): K_GROUP_DECODE,
    # V4-Flash's output LoRA (k 8192) and shared expert down (k 2048) projections: the same kernel against
    # Triton's best configuration in one bench_kernels run (kernels_h200_fp8_v4flash_decode.json): k 8192 at
    # m 1 / 8 / 64 10.56 / 11.08 / 11.58 us against 11.82 / 12.25 / 14.20; k 2048 at m 8 / 64 4.83 / 5.37
    # against 5.81 / 5.95. With the cache hints (the same five rounds): k 8192 at m 1 10.49-10.60 against
    # 10.73-10.89, k 2048 at m 64 5.02-5.11 against 5.05-5.18
    ("decode", 4096, 8192): K_GROUP_DECODE,
    ("decode", 4096, 2048): K_GROUP_DECODE,
}


def default_ws_tiling(m: int, n: int, k: int) -> WsTiling:
    """The measured best for a known (regime, n, k) (`MEASURED_WS_BEST`), else: prefill 128x256 (two
    consumer warpgroups, 128-column slices) in 3 stages rasterised in panels of 8 with the scales loaded a
    k block ahead, the best at the three measured prefill shapes, where 256 divides n; else 128x128,
    rasterised with 3 stages when the weights (n k bytes) overflow about half the 50 MB L2, else 4 stages
    unrasterised.
    Decode (m <= 64): one consumer warpgroup and enough CTAs (narrower n tiles, then split-k) to put one on
    about every SM, since every weight byte must stream through some SM."""
    kb = k // BLOCK
    regime = "decode" if m <= 64 else "prefill"
    best = MEASURED_WS_BEST.get((regime, n, k))
    if best is not None and n % best.block_n == 0 and kb % best.split_k == 0:
        return best
    if m > 64:
        if n % 256 == 0:
            return WsTiling(128, 256, max(1, min(3, kb)), panel=8, scales_ahead=True)
        if n * k > 32 << 20:
            return WsTiling(128, 128, max(1, min(3, kb)), panel=8)
        return WsTiling(128, 128, max(1, min(4, kb)))
    for block_n, split in ((128, 1), (64, 1), (128, 2), (64, 2), (128, 4), (32, 1), (64, 4)):
        if kb % split == 0 and (n // block_n) * split >= 0.9 * sm_count():
            return WsTiling(64, block_n, max(1, min(6, kb // split)), split_k=split)
    return WsTiling(64, 32, max(1, min(6, kb)))


WS_VARIANTS = {  # tilings worth timing (measured best first, then the newer ones); bench and tests use these
    "prefill": (
        WsTiling(128, 128, 3, 8),
        WsTiling(128, 128, 4, 0),
        # 128x256: each consumer warpgroup 64x256 in two 128-column slices (acc 2x64 + partial 64 registers)
        WsTiling(128, 256, 3, 8),
        WsTiling(128, 256, 4, 8),
        WsTiling(128, 256, 3, 8, smem_scales=True),
        WsTiling(128, 256, 4, 8, smem_scales=True),
        WsTiling(128, 128, 4, 8, smem_scales=True),
        # the next k block's scales loaded a block ahead (the prefill default since; measured against the
        # same tiles without, tilelang_fp8_gemm_h200_ahead_ab.json)
        WsTiling(128, 256, 3, 8, scales_ahead=True),
        # the first slice's TMA store issued under the second slice's staging, one wait for both
        WsTiling(128, 256, 3, 8, scales_ahead=True, early_store=True),
        # one CTA per SM walking its tiles in a fixed order, or taking each next one from a counter
        WsTiling(128, 256, 3, 8, scales_ahead=True, persistent="static"),
        WsTiling(128, 256, 3, 8, scales_ahead=True, persistent="atomic"),
    ),
    "decode": (
        WsTiling(64, 32, 8),
        WsTiling(64, 64, 6, split_k=2),
        WsTiling(64, 128, 6, split_k=4),
        # scales in shared memory: no global load on the consumer's per-k-block path
        WsTiling(64, 128, 8, smem_scales=True),
        # (64x128 split 4 with scales in shared memory stopped with an illegal instruction at k 7168: dropped)
        WsTiling(64, 64, 8, split_k=2, smem_scales=True),
        # two consumer warpgroups side by side (64x128 each): twice the MMA + promotion throughput per CTA
        WsTiling(64, 256, 5, split_k=2, warpgroups=2, smem_scales=True),
        # consumer warpgroups taking turns over the k blocks; the splits of a tile sum in their cluster
        WsTiling(64, 64, 8, split_k=2, k_groups=2),
        WsTiling(64, 64, 8, split_k=2, k_groups=4),
        WsTiling(64, 32, 8, k_groups=4),
        WsTiling(64, 128, 6, k_groups=2),
        # the cluster's sum pushed by bulk copy into the owners' shared memory (no cluster barrier at the end)
        WsTiling(64, 64, 8, split_k=2, k_groups=2, push_sum=True),
        # pushed straight from the accumulator registers (st.async), each group adding up a share of the columns
        WsTiling(64, 64, 8, split_k=2, k_groups=2, push_sum=True, push_regs=True),
        WsTiling(64, 64, 8, split_k=4, k_groups=4, push_sum=True, push_regs=True),
        # L2 asked to keep A and to evict the streamed weights first
        K_GROUP_DECODE,
    ),
}


def default_grouped_tiling(n: int, k: int, m: int | None = None, groups: int = 1) -> WsTiling:
    """The grouped contiguous program's tiles (MoE prefill, every group a whole number of 128-row tiles):
    the dense prefill default's 128x256 where 256 divides n, else 128x128; 3 stages, panels of 8, the
    scales a k block ahead. Up to k 4096 the second warpgroup idles where its rows are padding
    (`half_tiles`), measured side by side (tilelang_fp8_gemm_h200_grouped_half_tiles*_ab.json): 6-7% faster
    at V4-Flash's experts on one GPU (k 4096 and 2048), 2.6-3% on an expert-parallel rank's 32 of them,
    1.4% at n 7168, k 2048; at n 4096, k 7168 it was 4-14% slower, even in a layout with no idle half.

    Given the layout's rows `m` (and its number of weight matrices, `groups`), 128x256 tiles run in the
    persistent kernel with the atomic walk (`fp8_persistent`: one CTA per SM over the live tiles only)
    wherever it takes the layout (its list of tile rows fits in shared memory: up to about 600k rows; at most
    65,535 groups), and there with whole tiles at every k. One H100, 2026-12-07, two rounds in each of two
    calls (tilelang_fp8_gemm_h100_grouped_persistent_half_tiles_ab.json, _default_ab.json), best rounds
    against one tile a CTA with the rule above: V4-Flash's experts on one GPU 2.9-3.2% faster at gate/up
    (n 2048, k 4096; 41.6-41.8% of FP8 peak) and 9.2-10.0% at down (n 4096, k 2048; 40.2-40.4%), the six
    expert-parallel layouts 4.5-14.5% (54.7-63.7% of peak). Half tiles in the persistent kernel were 1.4-10.5%
    slower at every layout; its static walk from 0.9% faster to 2.3% slower."""
    block_n = 256 if n % 256 == 0 else 128
    tiling = WsTiling(128, block_n, 3, panel=8, scales_ahead=True, half_tiles=k <= 4096)
    if m is None or block_n != 256:
        return tiling
    from djax.kernels import fp8_persistent

    persistent = replace(tiling, persistent="atomic", half_tiles=False)
    try:
        fp8_persistent.check(m, n, k, persistent, groups)
    except ValueError:  # (a layout too long for the walk's list)
        return tiling
    return persistent


def default_tiling(m: int, n: int, k: int) -> Tiling:
    """Decode (m <= 64): one warpgroup of 64 rows and the widest n tile that still gives about one CTA per SM
    (the weights stream from memory, so idle SMs are lost bandwidth); prefill: two warpgroups, 128x128."""
    stages = max(1, min(4 if m <= 64 else 3, k // BLOCK))
    if m > 64:
        return Tiling(128, 128, stages)
    for block_n in (128, 64, 32):
        if -(-m // 64) * (n // block_n) >= 0.9 * sm_count():
            return Tiling(64, block_n, stages)
    return Tiling(64, 32, stages)


def operand_types(T, m: int, n: int, k: int, out_shape=None, out_dtype: str = "bfloat16") -> tuple:
    """The types of the programs' five parameters, in the launchers' order (`_PARAMS`), for TileLang's
    language module T (CUDA or Ascend): A fp8[m, k], AS f32[m, k/128], B fp8[n, k], BS f32[n/128, k/128],
    C out_dtype[out_shape] (default bf16[m, n])."""
    fp8, f32, kb = "float8_e4m3fn", "float32", k // BLOCK
    return (
        T.Tensor((m, k), fp8),
        T.Tensor((m, kb), f32),
        T.Tensor((n, k), fp8),
        T.Tensor((n // BLOCK, kb), f32),
        T.Tensor(out_shape or (m, n), out_dtype),
    )


def check_shapes(m: int, n: int, k: int) -> None:
    if k % BLOCK or n % BLOCK:
        raise ValueError(f"the TileLang fp8 GEMM needs n and k multiples of {BLOCK}, got n={n} k={k}")


def cuda_program(m: int, n: int, k: int, tiling: Tiling):
    """The TileLang program for CUDA. a fp8[m, k]; a_scale f32[m, k/128]; b fp8[n, k] (k-major, as wgmma
    wants both operands); b_scale f32[n/128, k/128]; out bf16[m, n]. Partial m tiles are guarded."""
    import tilelang.language as T

    check_shapes(m, n, k)
    bm, bn, kb = tiling.block_m, tiling.block_n, k // BLOCK
    fp8, f32 = "float8_e4m3fn", "float32"

    A_t, AS_t, B_t, BS_t, C_t = operand_types(T, m, n, k)

    @T.prim_func
    def fp8_gemm(A: A_t, AS: AS_t, B: B_t, BS: BS_t, C: C_t):
        with T.Kernel(n // bn, T.ceildiv(m, bm), threads=tiling.threads) as (bx, by):
            a_s = T.alloc_shared((bm, BLOCK), fp8)
            b_s = T.alloc_shared((bn, BLOCK), fp8)
            part = T.alloc_fragment((bm, bn), f32)
            acc = T.alloc_fragment((bm, bn), f32)
            c_s = T.alloc_shared((bm, bn), "bfloat16")
            T.clear(acc)
            for i in T.Pipelined(kb, num_stages=tiling.stages):
                T.copy(A[by * bm, i * BLOCK], a_s)
                T.copy(B[bx * bn, i * BLOCK], b_s)
                T.gemm(a_s, b_s, part, transpose_B=True, clear_accum=True)
                # block_n divides 128, so one weight scale covers the whole tile
                for r, c in T.Parallel(bm, bn):
                    acc[r, c] += part[r, c] * AS[by * bm + r, i] * BS[bx * bn // BLOCK, i]
            T.copy(acc, c_s)
            T.copy(c_s, C[by * bm, bx * bn])

    return fp8_gemm


def check_ws_tiling(m: int, n: int, k: int, tiling: WsTiling, groups: int = 0) -> None:
    check_shapes(m, n, k)
    if tiling.persistent:
        from djax.kernels import fp8_persistent

        fp8_persistent.check(m, n, k, tiling, groups)
    if tiling.cache_hints and tiling.k_groups < 2:
        raise ValueError(f"cache_hints is an option of the k-group program (k_groups > 1): {tiling}")
    if tiling.k_groups > 1:
        t = tiling
        if (
            m > 64
            or t.block_m != 64
            or t.block_n not in (32, 64, 128)
            or t.warpgroups
            or t.smem_scales
            or t.scales_ahead
        ):
            raise ValueError(
                f"k_groups needs m <= 64, block_m 64, block_n 32, 64 or 128 and no other options: {t}"
            )
        if not 2 <= t.k_groups <= 4 or t.split_k not in (1, 2, 4):
            raise ValueError(f"k_groups must be 2-4 and split_k 1, 2 or 4 (a cluster): {t}")
        if t.push_sum and t.split_k == 1:
            raise ValueError(f"push_sum sums the splits of a cluster: it needs split_k 2 or 4: {t}")
        if t.push_regs and (not t.push_sum or (t.block_n // 8) % t.k_groups):
            # each group adds up whole quads (4 registers, 16 bytes) of the accumulator's block_n / 2
            raise ValueError(f"push_regs needs push_sum and block_n / 8 a multiple of k_groups: {t}")
        if t.push_regs and k // BLOCK // t.split_k < t.k_groups:
            # a group without a k block has no wgmma to give its registers their layout, and nothing to add
            raise ValueError(f"push_regs needs a k block per group in every split: {t} at k={k}")
        if t.stages % t.k_groups:
            # every ring buffer must belong to one group: a group waiting on a buffer's next phase while
            # another group's phase of it is still pending would pass the parity wait at once (H200: a
            # 7-stage ring of two groups read unfinished buffers and ended in a launch failure)
            raise ValueError(f"stages must be a multiple of k_groups: {t}")
        if n % t.block_n or (k // BLOCK) % t.split_k:
            raise ValueError(f"{t} does not tile n={n}, k={k}")
        from djax.kernels.fp8_decode_tilelang import consumer_registers

        if t.block_n + 40 > consumer_registers(t.k_groups):  # accumulator + partial, 64 x block_n f32 each
            raise ValueError(f"{t}: a consumer's registers do not hold two 64x{t.block_n} f32 tiles")
        ring = t.stages * (64 + t.block_n) * BLOCK
        if t.push_sum:  # every group's accumulator staged (push_regs: the split's rows of it), and the other
            # splits' values for this one's rows
            staged = 64 // t.split_k if t.push_regs else 64
            sums = 4 * t.block_n * t.k_groups * (staged + (t.split_k - 1) * (64 // t.split_k))
        else:  # other groups' sums, the split's
            sums = 4 * 64 * t.block_n * (t.k_groups - (t.split_k == 1))
        scales = 4 * 65 * t.k_groups * -(-(k // BLOCK // t.split_k) // t.k_groups)
        need = ring + sums + scales
        if need > 227 * 1024:
            raise ValueError(
                f"{t} needs {need} bytes of shared memory at k={k}, over the 227 KB a CTA may have"
            )
        return
    bm, bn, wgs = tiling.block_m, tiling.block_n, tiling.consumer_wgs
    if bm not in (64, 128) or not (bn == 2 * BLOCK or (BLOCK % bn == 0 and bn % 16 == 0)):
        raise ValueError(
            f"WsTiling needs block_m 64 or 128 and block_n dividing {BLOCK} or {2 * BLOCK}: {tiling}"
        )
    if not (tiling.by_rows or (bm == 64 and wgs == 2 and bn >= 64)):
        raise ValueError(f"{wgs} consumer warpgroups do not tile {bm}x{bn}: {tiling}")
    if n % bn:
        raise ValueError(f"block_n={bn} does not divide n={n}")
    if tiling.scales_ahead and tiling.smem_scales:
        raise ValueError(
            f"scales_ahead reads the scales from global memory, smem_scales from shared: {tiling}"
        )
    if (k // BLOCK) % tiling.split_k:
        raise ValueError(f"split_k={tiling.split_k} does not divide the {k // BLOCK} k blocks")
    if tiling.push_sum or tiling.push_regs:
        raise ValueError(f"push_sum is for the k-group decode program (k_groups > 1): {tiling}")
    if tiling.early_store and (tiling.slices != 2 or tiling.split_k > 1 or not tiling.by_rows):
        raise ValueError(f"early_store needs two 128-column slices per warpgroup and no split of k: {tiling}")
    if tiling.smem_scales and (k // BLOCK) % 4:
        # TMA needs the scale rows' stride (k / 128 floats) to be a multiple of 16 bytes
        raise ValueError(f"smem_scales needs k a multiple of {4 * BLOCK}: {tiling} at k={k}")
    if tiling.smem_scales and (k // BLOCK // tiling.split_k) % 4:
        # A split's scale columns padded up to a 16-byte TMA box: on the H200 this kernel stopped with an
        # illegal instruction (64x4096x7168, split_k 4: 14 k blocks per split). Not understood; refused.
        raise ValueError(f"smem_scales needs a multiple of 4 k blocks per split: {tiling} at k={k}")


def ws_program(m: int, n: int, k: int, tiling: WsTiling, groups: int = 0):
    """The CUDA program for TileLang's TMA + warp-specialised lowering (same operands as `cuda_program`). With
    split_k > 1 the result is f32 partials P[split_k, m, n] (each split sums its share of the k blocks).
    See `WsTiling` for the warpgroup layouts, 128-column slices and shared-memory scales.

    groups > 0: the grouped GEMM in the contiguous layout (MoE prefill): B fp8[groups, n, k], BS f32[groups,
    n/128, k/128] and one more operand before the result, MI int32[m], the group of each row of A (-1:
    padding). A tile computes its rows with the weights of its first row's group; a tile whose first row is
    padding returns at once (its rows are left unwritten), so groups must start at multiples of block_m."""
    import tilelang.language as T

    check_ws_tiling(m, n, k, tiling)
    if groups and (
        tiling.split_k > 1
        or tiling.smem_scales
        or tiling.early_store
        or tiling.persistent
        or m % tiling.block_m
    ):
        raise ValueError(
            f"the grouped program takes whole tiles of rows (m {m} a multiple of block_m), no split of k, no "
            f"shared-memory scales, no early store and one tile a CTA: {tiling}"
        )
    if tiling.half_tiles and not (groups and tiling.block_m == 128 and tiling.by_rows):
        raise ValueError(f"half_tiles is for the grouped program's 128-row tiles (two warpgroups): {tiling}")
    if tiling.k_groups > 1:
        from djax.kernels.fp8_decode_tilelang import decode_program

        return decode_program(m, n, k, tiling)
    bm, bn, split = tiling.block_m, tiling.block_n, tiling.split_k
    kb = k // BLOCK
    kps = kb // split  # k blocks per split
    stages = max(1, min(tiling.stages, kps))
    nsb = max(1, bn // BLOCK)  # weight-scale blocks the tile spans
    sliced = tiling.slices == 2
    sw = bn // tiling.slices  # slice width
    ss = tiling.smem_scales
    kss = -(-kps // 4) * 4  # scale columns loaded: the TMA box's inner extent must be a multiple of 16 bytes
    policy = T.GemmWarpPolicy.FullRow if tiling.by_rows else T.GemmWarpPolicy.FullCol
    fp8, f32 = "float8_e4m3fn", "float32"
    out_shape, out_dtype = ((split, m, n), f32) if split > 1 else ((m, n), "bfloat16")
    a_rows = min(bm, m)  # rows in A's TMA box: m when it is one partial tile (see WsTiling)

    A_t, AS_t, B_t, BS_t, C_t = operand_types(T, m, n, k, out_shape, out_dtype)
    if groups:
        B_t, BS_t = T.Tensor((groups, n, k), fp8), T.Tensor((groups, n // BLOCK, kb), f32)

    def w(MI, by, *ix):
        """The index of a weight (or weight-scale) element: with groups, in the tile's group."""
        return (MI[by * bm], *ix) if groups else ix

    @T.macro
    def load_scales(AS, BS, MI, s0, s1, bx, by, i):
        """Activation x weight scale of k block i for the tile's rows: s0 for its (first) weight-scale block,
        s1 for its second when block_n is 256."""
        for r in T.Parallel(bm):
            s0[r] = AS[by * bm + r, i] * BS[w(MI, by, bx * bn // BLOCK, i)]
        if nsb == 2:
            for r in T.Parallel(bm):
                s1[r] = AS[by * bm + r, i] * BS[w(MI, by, bx * nsb + 1, i)]

    @T.macro
    def load_ahead(AS, BS, MI, sa, sb, sb1, bx, by, i):
        """k block i's scales, not multiplied: sa the rows' activation scales, sb (sb1) the weight scale of
        the tile's first (second) weight-scale block, the same in every entry."""
        for r in T.Parallel(bm):
            sa[r] = AS[by * bm + r, i]
        for r in T.Parallel(bm):
            sb[r] = BS[w(MI, by, bx * bn // BLOCK, i)]
        if nsb == 2:
            for r in T.Parallel(bm):
                sb1[r] = BS[w(MI, by, bx * nsb + 1, i)]

    def live(MI, by):
        """Whether the tile has rows to compute: always, or with groups unless its first row is padding."""
        return MI[by * bm] >= 0 if groups else True

    @T.macro
    def tile(A, AS, B, BS, MI, C, bx, by, bz):
        a_s = T.alloc_shared((bm, BLOCK), fp8)
        b_s = T.alloc_shared((sw, BLOCK), fp8)
        b1_s = T.alloc_shared((sw, BLOCK), fp8)  # second 128-column slice (unused unless sliced)
        part = T.alloc_fragment((bm, sw), f32)
        acc = T.alloc_fragment((bm, sw), f32)
        acc1 = T.alloc_fragment((bm, sw), f32)
        scale = T.alloc_fragment((bm,), f32)
        scale1 = T.alloc_fragment((bm,), f32)
        # scales_ahead: the next k block's activation and weight scales as loaded (multiplied only when
        # used: a product at load time would wait for the loads before this block's wgmmas are issued)
        ahead_a = T.alloc_fragment((bm,), f32)
        ahead_b = T.alloc_fragment((bm,), f32)
        ahead_b1 = T.alloc_fragment((bm,), f32)
        # columns past this split's kps hold the next split's scales (or TMA's zero fill), never read
        as_s = T.alloc_shared((bm, kss), f32)
        bs_s = T.alloc_shared((nsb, kss), f32)
        c_s = T.alloc_shared((bm, sw), out_dtype)
        c1_s = T.alloc_shared((bm, sw), out_dtype)
        if tiling.panel:
            T.use_swizzle(tiling.panel)
        if live(MI, by):  # a tile of padding rows has nothing to compute or store
            if ss:  # the whole k range's scales, once (TMA; rows past m in a later tile row fill with 0)
                T.copy(AS[by * bm : by * bm + a_rows, bz * kps : bz * kps + kss], as_s[0:a_rows, :])
                T.copy(BS[bx * bn // BLOCK, bz * kps], bs_s)
            if tiling.scales_ahead:
                load_ahead(AS, BS, MI, ahead_a, ahead_b, ahead_b1, bx, by, bz * kps)
            T.clear(acc)
            if sliced:
                T.clear(acc1)
            for j in T.Pipelined(kps, num_stages=stages):
                i = bz * kps + j
                T.copy(A[by * bm : by * bm + a_rows, i * BLOCK : (i + 1) * BLOCK], a_s[0:a_rows, :])
                T.copy(B[w(MI, by, bx * bn, i * BLOCK)], b_s)
                if sliced:
                    T.copy(B[w(MI, by, bx * bn + sw, i * BLOCK)], b1_s)
                # before the wgmmas, so the loads' latency hides under them; rows past m read as 0.
                # scale: the tile's (first) weight-scale block, scale1: its second when block_n is 256
                if ss:
                    for r in T.Parallel(bm):
                        scale[r] = as_s[r, j] * bs_s[0, j]
                    if nsb == 2:
                        for r in T.Parallel(bm):
                            scale1[r] = as_s[r, j] * bs_s[1, j]
                elif tiling.scales_ahead:
                    # this block's came in during the last one; the next block's (the last block's again
                    # past the end: any finite value) load under this block's wgmmas
                    for r in T.Parallel(bm):
                        scale[r] = ahead_a[r] * ahead_b[r]
                    if nsb == 2:
                        for r in T.Parallel(bm):
                            scale1[r] = ahead_a[r] * ahead_b1[r]
                    load_ahead(
                        AS, BS, MI, ahead_a, ahead_b, ahead_b1, bx, by, T.min(i + 1, bz * kps + kps - 1)
                    )
                else:
                    load_scales(AS, BS, MI, scale, scale1, bx, by, i)
                T.gemm(a_s, b_s, part, transpose_B=True, clear_accum=True, policy=policy)
                if nsb == 2 and not sliced:  # warpgroups side by side: each one's columns in one scale block
                    for r, c in T.Parallel(bm, sw):
                        acc[r, c] += part[r, c] * T.if_then_else(c < BLOCK, scale[r], scale1[r])
                else:
                    for r, c in T.Parallel(bm, sw):
                        acc[r, c] += part[r, c] * scale[r]
                if sliced:
                    T.gemm(a_s, b1_s, part, transpose_B=True, clear_accum=True, policy=policy)
                    for r, c in T.Parallel(bm, sw):
                        acc1[r, c] += part[r, c] * scale1[r]
            T.copy(acc, c_s)
            if sliced:
                T.copy(acc1, c1_s)
            if split > 1:
                T.copy(c_s, C[bz, by * bm, bx * bn])
                if sliced:
                    T.copy(c1_s, C[bz, by * bm, bx * bn + sw])
            else:
                T.copy(c_s, C[by * bm, bx * bn])
                if sliced:
                    T.copy(c1_s, C[by * bm, bx * bn + sw])

    if groups:

        @T.prim_func
        def fp8_gemm_grouped(A: A_t, AS: AS_t, B: B_t, BS: BS_t, MI: T.Tensor((m,), "int32"), C: C_t):
            with T.Kernel(n // bn, m // bm, 1, threads=tiling.consumer_threads) as (bx, by, bz):
                tile(A, AS, B, BS, MI, C, bx, by, bz)

        return fp8_gemm_grouped

    @T.prim_func
    def fp8_gemm(A: A_t, AS: AS_t, B: B_t, BS: BS_t, C: C_t):
        with T.Kernel(n // bn, T.ceildiv(m, bm), split, threads=tiling.consumer_threads) as (bx, by, bz):
            tile(A, AS, B, BS, None, C, bx, by, bz)

    return fp8_gemm


def ascend_program(m: int, n: int, k: int, block_m: int = 128, block_n: int = 128, cores: int = 32):
    """The same GEMM in TileLang's Ascend dialect: a persistent 1-D grid of AI cores over output tiles.
    Needs m % block_m == 0 and block_n == 128."""
    import tilelang.ascend.language as T

    check_shapes(m, n, k)
    if m % block_m or block_n != BLOCK:
        raise ValueError(f"Ascend program needs m % {block_m} == 0 and block_n == {BLOCK}")
    kb, n_tiles, half = k // BLOCK, n // block_n, block_m // 2
    fp8, f32 = "float8_e4m3fn", "float32"

    A_t, AS_t, B_t, BS_t, C_t = operand_types(T, m, n, k)

    @T.prim_func
    def fp8_gemm(A: A_t, AS: AS_t, B: B_t, BS: BS_t, C: C_t):
        with T.Kernel(cores) as core:
            a_l1 = T.alloc_l1((block_m, BLOCK), fp8)
            b_l1 = T.alloc_l1((block_n, BLOCK), fp8)
            part_l0c = T.alloc_l0c((block_m, block_n), f32)
            # unified-buffer tiles hold one Vector core's half of the rows
            part = T.alloc_shared((half, block_n), f32)
            acc = T.alloc_shared((half, block_n), f32)
            a_sc = T.alloc_shared((half, kb), f32)
            b_sc = T.alloc_shared((2, kb), f32)  # one row used; two keep the copy 32-byte aligned
            out = T.alloc_shared((half, block_n), "bfloat16")
            for tile in T.Persistent([m // block_m * n_tiles], cores, core):
                r0, c0 = tile // n_tiles * block_m, tile % n_tiles * block_n
                T.dual_copy(AS[r0 : r0 + block_m, 0:kb], a_sc)
                T.copy(BS[c0 // BLOCK : c0 // BLOCK + 1, 0:kb], b_sc[0:1, 0:kb])
                with T.SimtVF(threads=128):
                    for r, c in T.Parallel(half, block_n):
                        acc[r, c] = 0.0
                for i in T.Pipelined(kb, num_stages=2):
                    T.copy(A[r0, i * BLOCK], a_l1)
                    T.copy(B[c0, i * BLOCK], b_l1)
                    T.gemm(a_l1, b_l1, part_l0c, transpose_B=True, clear_accum=True)
                    T.dual_copy(part_l0c, part)
                    with T.SimtVF(threads=128):
                        for r, c in T.Parallel(half, block_n):
                            acc[r, c] += part[r, c] * a_sc[r, i] * b_sc[0, i]
                with T.SimtVF(threads=128):
                    for r, c in T.Parallel(half, block_n):
                        out[r, c] = T.cast(acc[r, c], "bfloat16")
                T.dual_copy(out, C[r0 : r0 + block_m, c0 : c0 + block_n])

    return fp8_gemm


def ascend_source(m: int, n: int, k: int) -> str:
    """AscendC source of the Ascend program (TileLang's "ascend" target; compiling it needs CANN's bisheng)."""
    return lower(ascend_program(m, n, k), {"kind": "ascend"}, POINTER_ONLY).kernel_source


def lower_cuda(m: int, n: int, k: int, tiling: Tiling | None = None) -> tuple[str, dict]:
    """CUDA source and launch parameters (grid, threads, shared_bytes, params, name). No GPU needed."""
    tiling = tiling or default_tiling(m, n, k)
    return pointer_kernel(
        lower(cuda_program(m, n, k, tiling), {"kind": "cuda", "arch": ARCH}, POINTER_ONLY), _PARAMS
    )


def lower_ws(m: int, n: int, k: int, tiling: WsTiling | None = None, groups: int = 0) -> tuple[str, dict]:
    """CUDA source and launch description of the TMA + warp-specialised variant: grid, threads (producer
    warpgroup included), shared_bytes, name, and params (per kernel parameter: an FFI buffer index for a pointer,
    or a `djax.ffi.tma.TensorMap`). groups > 0: the grouped contiguous program (`ws_program`). No GPU needed."""
    tiling = tiling or (default_grouped_tiling(n, k, m, groups) if groups else default_ws_tiling(m, n, k))
    if tiling.persistent:  # (a CUDA kernel of its own, on the plan of TileLang's lowering of the same tiles)
        from djax.kernels import fp8_persistent

        return fp8_persistent.lower(m, n, k, tiling, groups)
    art = lower(ws_program(m, n, k, tiling, groups), {"kind": "cuda", "arch": ARCH}, HOPPER)
    source, launch = tma_kernel(art, _GROUPED_PARAMS if groups else _PARAMS)
    if tiling.sums_in_cluster:
        from djax.kernels.fp8_decode_tilelang import with_cluster_sum

        source = with_cluster_sum(source, launch["name"], tiling.split_k, tiling.push_sum)
    if tiling.early_store:
        source = with_early_store(source)
    if tiling.half_tiles:
        source = with_half_tiles(source)
    return source, launch


_STORE_WAIT = "      tl::tma_store_arrive();\n      tl::tma_store_wait<0, true>();\n"
_STORING_THREAD = "    if (((int)threadIdx.x) == 128) {\n      tl::fence_proxy_async();\n"


def with_early_store(source: str) -> str:
    """The lowered source of a tile computed in two 128-column slices with its epilogue reordered. TileLang
    stages both slices of the bf16 tile in shared memory (a barrier of the consumer threads after each), then
    one thread stores the first slice by TMA, waits until TMA has read it, stores the second and waits again.
    Here that thread issues the first slice's stores right after the barrier that ends its staging, so TMA
    reads it while the consumers stage the second slice into its own buffer, and one wait at the end covers
    both store groups (the CTA may not exit while TMA still reads its shared memory). Both groups are issued
    by the same thread, the first consumer thread, which the wait needs: a bulk-async group belongs to the
    thread that committed it."""
    found = re.findall(r"tl_shuffle_elect<(\d+)>\(\)\) \{\n      tl::fence_proxy_async\(\);", source)
    if len(found) != 1:
        raise NotImplementedError("unexpected epilogue in the lowered source: not one elected store block")
    consumers = found[0]
    sync = f"    tl::__sync_thread_partial(3, {consumers});\n"
    head = f"    if (tl::tl_shuffle_elect<{consumers}>()) {{\n      tl::fence_proxy_async();\n"
    stores = source.find(head)
    if stores < 0 or source.count(_STORE_WAIT) != 2:
        raise NotImplementedError("unexpected epilogue in the lowered source: not two store groups")
    first_end = source.index(_STORE_WAIT, stores)
    second_end = source.index(_STORE_WAIT, first_end + len(_STORE_WAIT))
    first = source[stores + len(head) : first_end]  # the first slice's store loop
    second = source[first_end + len(_STORE_WAIT) : second_end]
    close = second_end + len(_STORE_WAIT) + len("    }\n")
    if source[second_end + len(_STORE_WAIT) : close] != "    }\n":
        raise NotImplementedError("unexpected end of the store block in the lowered source")
    if source[stores - len(sync) : stores] != sync:
        raise NotImplementedError("no barrier before the store block in the lowered source")
    between = source.rindex(sync, 0, stores - len(sync))  # the barrier after the first slice's staging
    if "c_s" not in first or "c1_s" in first or "c1_s" not in second or "c1_s" not in source[between:stores]:
        raise NotImplementedError("the slices' stores are not in the expected order in the lowered source")
    early = _STORING_THREAD + first + "      tl::tma_store_arrive();\n    }\n"
    last = _STORING_THREAD + second + _STORE_WAIT + "    }\n"
    at = between + len(sync)
    return source[:at] + early + source[at:stores] + last + source[close:]


# The lowered source's 64-row half of a 128-row tile that a consumer warpgroup computes (its A operand starts
# that many 8192-byte halves into the stage), and the grouped program's test of a tile's first row
_ROW_HALF = "(((((int)threadIdx.x) >> 7) + 1) & 1)"
_LIVE_TILE = "if (0 <= MI[(((int)blockIdx.y) * 128)]) {"
_IDLE = "djax_idle_half"


def _block_end(source: str, open_at: int) -> int:
    """The index just past the brace that closes the one at `open_at`."""
    depth = 0
    for i in range(open_at, len(source)):
        depth += {"{": 1, "}": -1}.get(source[i], 0)
        if depth == 0:
            return i + 1
    raise NotImplementedError("unbalanced braces in the lowered source")


def with_half_tiles(source: str) -> str:
    """The grouped program's lowered source (128-row tiles, each consumer warpgroup 64 rows) with the second
    warpgroup idle in a tile whose rows 64-127 are padding (m_indices -1 there: its group has 1 to 64 rows in
    the tile). The consumers' k loop is kept as lowered for a warpgroup with rows, and an idle one runs a copy
    of it holding only its stage barrier operations, in their order: it still waits for every stage and
    arrives on its release (a stage is free once both warpgroups arrived, so an early arrival would count
    toward the wrong phase), and its accumulators, cleared before the loop, stage zeros for its rows. The
    first warpgroup then has the tensor cores alone. (Guarding each wgmma block and promotion inside the one
    loop instead made the kernel 1-5% slower: ptxas scheduled the loop differently.) The lowered loop runs
    inside `if (!idle)`; with its bound 0 when idle instead it was 1.2% slower at V4-Flash."""
    consumer = "tl::warpgroup_reg_alloc<240>();\n"
    if source.count(consumer) != 1 or source.count(_LIVE_TILE) != 1:
        raise NotImplementedError(
            "unexpected grouped program in the lowered source: no single consumer branch"
        )
    alloc = source.index(consumer)
    head = re.compile(r"for \(int (j_\d+) = 0; \1 < (\d+); \+\+\1\) ").search(source, alloc)
    if head is None:
        raise NotImplementedError("no k loop in the lowered source's consumer branch")
    loop, end = head.start(), _block_end(source, head.end())
    body = source[head.end() : end]
    chains = body.count("tl::warpgroup_arrive();")  # one wgmma chain per 128-column slice
    if not chains or body.count(f"({_ROW_HALF} * 8192)") != chains:
        raise NotImplementedError("the consumer warpgroups do not take 64-row halves of the tile's A operand")
    barriers = re.findall(r"mbarrier\[[^\]]+\]\.(?:wait\([^;]*\)|arrive\(\));", body)
    waits = sum(".wait(" in b for b in barriers)
    if not waits or waits == len(barriers) or body.count("mbarrier[") != len(barriers):
        raise NotImplementedError("unexpected stage barriers in the lowered source's consumer loop")
    indent = source[source.rindex("\n", 0, loop) + 1 : loop]
    idle = f"\n{indent}    ".join([source[loop : head.end()] + "{", *barriers]) + f"\n{indent}  }}"
    # per thread, as lowered: read through a shuffle from lane 0 (the compiler then keeps the k loop's index,
    # barrier addresses and descriptors in uniform registers) it was 2% slower at V4-Flash's expert shapes and
    # still slower than whole tiles at k 7168 (tilelang_fp8_gemm_h200_grouped_half_tiles_shfl_ab.json)
    flag = f"const bool {_IDLE} = {_ROW_HALF} == 1 && MI[((((int)blockIdx.y) * 128) + 64)] < 0;"
    branch = (
        f"{flag}\n{indent}if ({_IDLE}) {{\n{indent}  #pragma unroll 1\n{indent}  {idle}\n{indent}}}\n{indent}"
    )
    return source[:loop] + branch + f"if (!{_IDLE}) " + source[loop:]


@functools.cache
def cuda_kernel(m: int, n: int, k: int, tiling: Tiling | None = None) -> CudaKernel:
    """Lowers, compiles (no GPU needed) and describes the kernel for one static shape."""
    from djax.ffi.cubin import Cubin

    tiling = tiling or default_tiling(m, n, k)
    source, launch = lowered_on_disk(
        "fp8_gemm_pointer", (m, n, k, tiling), lower_cuda, (__file__, tilelang_build.__file__)
    )
    binary = nvcc_cubin(source)
    key = "tl-" + hashlib.sha256(binary).hexdigest()[:24]
    cub = Cubin(key, launch["name"], binary, launch["threads"], launch["shared_bytes"], extra_null=0)
    return CudaKernel(cub, launch["grid"], launch["params"], source)


def ws_sources(tiling: WsTiling) -> tuple[str, ...]:
    """The modules whose text the "ws" lowering of `tiling` depends on (part of its disk cache key)."""
    if tiling.persistent:
        from djax.kernels import fp8_persistent  # the kernel and its constants

        return (__file__, tilelang_build.__file__, fp8_persistent.__file__, str(fp8_persistent.SOURCE))
    if tiling.k_groups == 1:
        return (__file__, tilelang_build.__file__)
    from djax.kernels import fp8_decode_tilelang  # the program and its cluster code

    return (__file__, tilelang_build.__file__, fp8_decode_tilelang.__file__)


@functools.cache
def ws_kernel(m: int, n: int, k: int, tiling: WsTiling | None = None, groups: int = 0):
    """Lowers and compiles (no GPU needed) the TMA + warp-specialised variant: a `djax.ffi.tma.TmaKernel`.
    groups > 0: the grouped contiguous program over `groups` weight matrices."""
    from djax.ffi.tma import TmaKernel

    tiling = tiling or (default_grouped_tiling(n, k, m, groups) if groups else default_ws_tiling(m, n, k))
    if groups:
        source, launch = lowered_on_disk(
            "fp8_grouped_ws", (m, n, k, tiling, groups), lower_ws, ws_sources(tiling)
        )
    else:
        source, launch = lowered_on_disk("fp8_gemm_ws", (m, n, k, tiling), lower_ws, ws_sources(tiling))
    if tiling.persistent:  # one CTA per SM of this GPU
        from djax.kernels import fp8_persistent

        launch = {**launch, "grid": (fp8_persistent.ctas(m, n), 1, 1)}
    binary = nvcc_cubin(source)
    key = "tlws-" + hashlib.sha256(binary).hexdigest()[:24]
    return TmaKernel.from_launch(key, binary, launch)


VARIANTS = ("pointer", "ws")


def fp8_gemm_tilelang(
    a,
    a_scale,
    b,
    b_scale,
    out_dtype=jnp.bfloat16,
    tiling: Tiling | WsTiling | None = None,
    variant: str | None = None,
):
    """out[m, n] = sum_k a[m, k] b[n, k] with DeepGEMM's scales, on a CUDA GPU (sm_90).

    a fp8_e4m3fn[m, k]; a_scale f32[m, k/128]; b fp8_e4m3fn[n, k]; b_scale f32[n/128, k/128]; returns
    bf16[m, n]. n and k must be multiples of 128 (see `fp8_gemm_ref.fp8_gemm_ref` for the general case).
    variant "pointer" (default; cp.async, no TMA, `Tiling`) or "ws" (TMA + warp specialisation, `WsTiling`);
    a WsTiling alone selects "ws".
    """
    from djax.ffi import cubin

    m, k = a.shape
    n = b.shape[0]
    check_shapes(m, n, k)
    if jnp.dtype(out_dtype) != jnp.bfloat16:
        raise ValueError("the TileLang fp8 GEMM writes bfloat16")
    if a.dtype != jnp.float8_e4m3fn or b.dtype != jnp.float8_e4m3fn or b.shape[1] != k:
        raise ValueError(f"need fp8_e4m3fn a[m, k], b[n, k]; got {a.dtype}{a.shape}, {b.dtype}{b.shape}")
    if a_scale.shape != (m, k // BLOCK) or b_scale.shape != (n // BLOCK, k // BLOCK):
        raise ValueError(f"scale shapes {a_scale.shape}, {b_scale.shape} do not match m={m} n={n} k={k}")
    variant = variant or ("ws" if isinstance(tiling, WsTiling) else "pointer")
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    args = [a, a_scale.astype(jnp.float32), b, b_scale.astype(jnp.float32)]
    if variant == "ws":
        from djax.ffi import tma

        if tiling is not None and not isinstance(tiling, WsTiling):
            raise TypeError(f"variant 'ws' takes a WsTiling, got {tiling!r}")
        t = tiling or default_ws_tiling(m, n, k)
        kern = ws_kernel(m, n, k, t)
        if t.split_k == 1 or t.sums_in_cluster:
            return tma.launch(kern, args, jax.ShapeDtypeStruct((m, n), jnp.bfloat16))
        part = tma.launch(kern, args, jax.ShapeDtypeStruct((t.split_k, m, n), jnp.float32))
        return part.sum(0).astype(jnp.bfloat16)
    if tiling is not None and not isinstance(tiling, Tiling):
        raise TypeError(f"variant 'pointer' takes a Tiling, got {tiling!r}")
    kern = cuda_kernel(m, n, k, tiling)
    return cubin.launch(kern.cubin, kern.grid, args, jax.ShapeDtypeStruct((m, n), jnp.bfloat16))


def grouped_contiguous_tilelang(a, a_scale, b, b_scale, m_indices, tiling: WsTiling | None = None):
    """`fp8_gemm_ref.grouped_contiguous_ref`'s contract on a CUDA GPU (sm_90): out[r] = a[r] b[m_indices[r]]^T
    with DeepGEMM's scales, in bf16, by the grouped "ws" program (`ws_program` with groups).

    a fp8_e4m3fn[m, k] with rows sorted by group, every group starting at a multiple of the tiling's block_m
    (128) and m a multiple of it; a_scale f32[m, k/128]; b fp8_e4m3fn[g, n, k]; b_scale f32[g, n/128, k/128];
    m_indices int32[m], -1 for padding. A tile takes its first row's group; a tile whose first row is padding
    is skipped and its rows are left unwritten (the reference zeros them); padding rows inside a live tile
    get that group's product of their row of a, or 0 in a half the tiling's `half_tiles` leaves idle."""
    from djax.ffi import tma

    m, k = a.shape
    g, n = b.shape[:2]
    check_shapes(m, n, k)
    t = tiling or default_grouped_tiling(n, k, m, g)
    if a.dtype != jnp.float8_e4m3fn or b.dtype != jnp.float8_e4m3fn or b.shape[2] != k:
        raise ValueError(f"need fp8_e4m3fn a[m, k], b[g, n, k]; got {a.dtype}{a.shape}, {b.dtype}{b.shape}")
    if m % t.block_m:
        raise ValueError(f"the contiguous layout's rows ({m}) must be a multiple of the tile's {t.block_m}")
    if a_scale.shape != (m, k // BLOCK) or b_scale.shape != (g, n // BLOCK, k // BLOCK):
        raise ValueError(
            f"scale shapes {a_scale.shape}, {b_scale.shape} do not match m={m} g={g} n={n} k={k}"
        )
    kern = ws_kernel(m, n, k, t, g)
    f32 = jnp.float32
    args = [a, a_scale.astype(f32), b, b_scale.astype(f32), m_indices.astype(jnp.int32)]
    return tma.launch(kern, args, jax.ShapeDtypeStruct((m, n), jnp.bfloat16))
