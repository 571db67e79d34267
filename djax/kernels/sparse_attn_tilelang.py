"""DeepSeek-V4 sparse decode attention in TileLang: an sm_90a cubin launched by the FFI cubin launcher.

Contract: `sparse_attn_ref.sparse_decode_ref`. Why this shape of kernel (see NOTES.md for the Triton numbers):
- Per decode row the keys (ring + top-k picks, K = V) are 640 x 512 bf16 = 640 KB while q is 64 KB, so all
  heads of a row share one CTA (wgmma M = 64 heads) and every gathered key tile is read from memory once.
- Keys stream through a ring of `stages` shared buffers filled by predicated cp.async (zero-fill for masked
  slots, so no stale or NaN bytes ever reach the P @ V product). The pipeline is written by hand (explicit
  commit / wait groups) because a block comes from either the ring or the pool: TileLang's automatic
  `T.Pipelined` only makes unconditional pure copies asynchronous.
- S = Q K^T and acc += P K are wgmma (Q and K in shared, P through a 64 x BLOCK_S bf16 shared tile); the
  warpgroups split the key columns of S and the value columns of acc (64 x 512 f32 in registers: 128 per
  thread with 2 warpgroups). Online softmax in base 2 with the sink seeding the running max and denominator.
- Batch 64 is only 64 CTAs on 132 SMs and small batches far fewer, so `nsplit` > 1 gives each row `nsplit`
  CTAs over balanced ranges of key blocks (flash decoding); they write f32 partial outputs and base-2
  log-sum-exps that `sparse_attn_ref.combine_splits` merges in jnp, or (`Tiling.merge`, warp-specialised
  program) the splits of a row form a thread-block cluster and merge in the kernel after a cluster barrier,
  the partials passing through global memory or (`Tiling.dsmem`) the cluster's shared memory.
`ws_program` is the warp-specialised form (12 warps: a producer warpgroup and two consumers handing off
through mbarriers, no CTA-wide barriers in the loop), the default where it applies; `pair_program`
(`Tiling.dim_pair`) is its form for two CTAs per row that split the head dim instead of the keys (the default
where the grid takes two CTAs per row). None uses TMA by default, so the kernel's parameters stay the plain
device pointers that `djax/ffi/csrc/cubin_launch.cc` passes (operands in call order, then results); with
`Tiling.tma_q` q's parameter is a tensor map and the kernel goes through `djax.ffi.tma`'s launcher.
Compiling needs TileLang 0.1.15 and nvcc, not a GPU.
"""

import functools
import hashlib
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from djax.kernels import tilelang_build
from djax.kernels.dispatch import sm_count
from djax.kernels.sparse_attn_ref import combine_splits
from djax.kernels.tilelang_build import (
    ARCH,
    PEER_ADDRESS,
    POINTER_ONLY,
    lower,
    lowered_on_disk,
    nvcc_cubin,
    pointer_kernel,
    tma_kernel,
    with_cluster,
    with_device_code,
)

HEADS = 64  # wgmma M: one CTA takes 64 heads of one row
_LOG2E = math.log2(math.e)
_ASYNC = {"parallel_async_without_async_commit_wait": True}  # cp.async without an implied commit + wait
_SMEM_LIMIT = 227 * 1024
# The device function's parameters come out sorted by name, so these names spell the launcher's order.
_OPERANDS = ("p0_q", "p1_window", "p2_valid", "p3_pool", "p4_topk", "p5_sinks")
_RESULTS = {
    "plain": ("p6_out",),
    "split": ("p6_part", "p7_lse"),
    "merge": ("p6_out", "p7_part", "p8_lse"),
    "dsmem": ("p6_out", "p8_lse"),  # the merged entry with the unused partial dropped by TileLang
    "push": ("p6_out",),  # and with push the log-sum-exps too
    "pair": ("p6_out",),
}
_MAX_CLUSTER = 8  # the portable thread-block cluster size


@dataclass(frozen=True)
class Tiling:
    """block_s keys per pipeline step, `stages` shared key buffers, threads per CTA (128 per warpgroup),
    nsplit CTAs per (row, 64-head group). Every split writes its partial; merge: the splits of a row run as
    one thread-block cluster and, once all have written, each merges its own slice of the value columns
    in the kernel (warp-specialised program, 2 to 8 splits); otherwise `combine_splits` merges them after.
    dsmem (with merge): the partials stay in shared memory, over the finished key ring, and each split
    reads its slice of the others' through distributed shared memory; only the log-sum-exps go to global
    memory. Needs stages * block_s = 128 (the ring's bytes are exactly the f32 partial's).
    push (with merge, 2 splits): no partial is staged and no cluster barrier follows the key loop. Split 0
    stores the value columns of its softmax warpgroup, split 1 those of its other warpgroup; the warpgroup
    whose columns the other split stores sends its accumulator there straight from its registers
    (st.async into the peer's q buffers, free once the peer's last Q K^T is done), and each softmax
    warpgroup sends its running max and denominator per head the same way (`_PUSH_MERGE`).
    push_bf16 (with push): the values cross as bf16 (half the bytes through the cluster), rounded once more
    before the weighted sum.
    tma_q (warp-specialised program): q comes in by TMA (one elected producer thread, completing on key
    block 0's barrier) instead of 4,096 cp.async, which leaves the producer's cp.async to key block 0 from the
    start. Measured within 1% of the cp.async form (NOTES.md), so an option.
    dim_pair (`pair_program`, 384 threads, nsplit 1): the two CTAs of a cluster each take half of the head
    dim (of q, of every key and of the output) over all of the row's key blocks, and add each other's
    partial scores every block, so q is read once per row and nothing is merged after the loop.
    p_in_exchange (with dim_pair, 64-key blocks): each warpgroup writes a block's P into the first half of the
    exchange buffer it has just read the peer's scores from (free until the peer's scores of two blocks on),
    and the end's max and denominator table goes there too, so P takes no shared memory of its own: the
    16 KB and the table's 1 KB let a fourth key stage fit."""

    block_s: int = 64
    stages: int = 2
    threads: int = 256
    nsplit: int = 1
    merge: bool = False
    dsmem: bool = False
    push: bool = False
    push_bf16: bool = False
    tma_q: bool = False
    dim_pair: bool = False
    p_in_exchange: bool = False

    @property
    def warpgroups(self) -> int:
        return self.threads // 128

    @property
    def ws(self) -> bool:
        """384 threads (12 warps) select the warp-specialised program, `ws_program`."""
        return self.threads == 384


@dataclass(frozen=True)
class CudaKernel:
    """A compiled kernel and what launching it takes: grid (x, y, z), parameter names, CUDA source."""

    cubin: object  # djax.ffi.cubin.Cubin, or with tma_q a djax.ffi.tma.TmaKernel
    grid: tuple[int, int, int]
    params: tuple[str, ...]
    source: str


def _blocks(w: int, t: int, block_s: int) -> tuple[int, int]:
    return -(-w // block_s), -(-t // block_s)


def shared_bytes(k: int, w: int, t: int, tiling: Tiling) -> int:
    """Shared memory the program asks for: q, the key ring, P, the per-slot row table (static shared)."""
    nbw, nbt = _blocks(w, t, tiling.block_s)
    if tiling.dim_pair:
        bs, kh = tiling.block_s, k // 2
        own_p = not tiling.p_in_exchange  # else P and the max and sum table live in the exchange buffer
        # half of q and of the ring, a P per warpgroup, the exchange
        ring = tiling.stages * bs * kh
        dynamic = 2 * (HEADS * kh + ring + own_p * 2 * HEADS * bs) + 4 * _pair_exchange_floats(k, bs)
        # the slot table, the max and sum table and the barriers, which ptxas rounds up to whole kilobytes
        static = 4 * (nbw + nbt) * bs + own_p * 4 * 4 * HEADS + 8 * (2 * tiling.stages + 4)
        return dynamic + -(-static // 1024) * 1024
    # the warp-specialised program's alpha and 1 / l tables, and with merge every split's weights (with
    # push: the max and denominator per head, and the peer's, 4 floats per 2 heads)
    per_merge = 4 if tiling.push else tiling.nsplit
    extra = 4 * HEADS * (2 + (per_merge if tiling.merge else 0)) if tiling.ws else 0
    return (
        2 * (HEADS * k + tiling.stages * tiling.block_s * k + HEADS * tiling.block_s)
        + 4 * ((nbw + nbt) * tiling.block_s)
        + extra
    )


def _pair_exchange_floats(k: int, bs: int) -> int:
    """The pair program's exchange buffer: both warpgroups' peer scores, double-buffered, in the loop; the
    output's bf16 rows (64 x k/2) at the end."""
    return max(4 * HEADS * bs, HEADS * k // 4)


def check_shapes(h: int, k: int, w: int, c: int, t: int, tiling: Tiling) -> None:
    """Raises ValueError for shapes or tilings the kernel does not handle."""
    bs, nwg = tiling.block_s, tiling.warpgroups
    if h % HEADS:
        raise ValueError(f"the TileLang sparse decode needs heads a multiple of {HEADS}, got {h}")
    if tiling.threads not in (256, 384, 512):
        raise ValueError(f"threads must be 256, 384 or 512 (2, 3 or 4 warpgroups), got {tiling.threads}")
    if tiling.ws:  # two consumer warpgroups, each holding half the value columns
        if k % 16 or k // 2 > 256:
            raise ValueError(f"head dim {k} must split into two halves of <= 256, multiples of 8")
        if bs not in (32, 64):
            raise ValueError(f"block_s must be 32 or 64 for the warp-specialised program, got {bs}")
    else:
        if k % (8 * nwg) or k // nwg > 256:
            raise ValueError(f"head dim {k} must split into {nwg} warpgroup slices of <= 256, multiples of 8")
        if HEADS * k // tiling.threads > 128:
            raise ValueError(
                f"head dim {k} needs more than 128 f32 accumulators per thread at {tiling.threads}"
            )
        if bs not in (16, 32, 64, 128) or bs % (8 * nwg):
            raise ValueError(f"block_s must be 16, 32, 64 or 128 and split into {nwg} x 8 columns, got {bs}")
    if tiling.stages < 2:
        raise ValueError(f"stages must be >= 2, got {tiling.stages}")
    if tiling.merge and not (tiling.ws and 2 <= tiling.nsplit <= _MAX_CLUSTER):
        raise ValueError(
            f"merging in the kernel takes the warp-specialised program (384 threads) and 2 to {_MAX_CLUSTER} "
            f"splits (one cluster per row), got {tiling.threads} threads and nsplit {tiling.nsplit}"
        )
    if tiling.dsmem and not (tiling.merge and tiling.stages * bs == 2 * HEADS and k % 64 == 0):
        raise ValueError(
            f"dsmem needs merge, a key ring of exactly {2 * HEADS} keys (stages * block_s), where the f32 "
            f"partial of 64 heads fits, and head dim a multiple of 64 (its swizzle spans 32 columns a half): "
            f"got merge={tiling.merge}, {tiling.stages} x {bs}, head dim {k}"
        )
    if tiling.push and not (tiling.merge and not tiling.dsmem and tiling.nsplit == 2 and k % 64 == 0):
        raise ValueError(
            f"push needs merge (not dsmem), 2 splits (each stores half the value columns) and head dim a "
            f"multiple of 64: got merge={tiling.merge}, dsmem={tiling.dsmem}, nsplit {tiling.nsplit}, "
            f"head dim {k}"
        )
    if tiling.push_bf16 and not tiling.push:
        raise ValueError("push_bf16 needs push")
    if tiling.tma_q and not (tiling.ws and k % 128 == 0):
        raise ValueError(
            f"tma_q takes the warp-specialised program (384 threads) and head dim a multiple of 128 (TMA boxes "
            f"of 64 columns a half): got {tiling.threads} threads, head dim {k}"
        )
    if tiling.dim_pair and not (
        tiling.ws and tiling.nsplit == 1 and not (tiling.merge or tiling.tma_q) and k % 32 == 0
    ):
        raise ValueError(
            f"dim_pair takes the warp-specialised program (384 threads), no splits, merge or tma_q, and head "
            f"dim a multiple of 32 (each warpgroup stores a quarter): got {tiling.threads} threads, nsplit "
            f"{tiling.nsplit}, merge={tiling.merge}, tma_q={tiling.tma_q}, head dim {k}"
        )
    if tiling.p_in_exchange and not (tiling.dim_pair and bs == 64):
        raise ValueError(
            f"p_in_exchange is an option of dim_pair with 64-key blocks (the end's bf16 rows take two of the four "
            f"score buffers, the max and sum table a third): got dim_pair={tiling.dim_pair}, block_s {bs}"
        )
    if tiling.dim_pair and tiling.stages * bs < 2 * HEADS:
        raise ValueError(
            f"dim_pair swaps the f32 accumulator halves through the finished key ring: stages * block_s must "
            f"be >= {2 * HEADS}, got {tiling.stages} x {bs}"
        )
    if min(w, c, t) < 1:
        raise ValueError(f"need W, C, T >= 1, got W={w} C={c} T={t}")
    nb = sum(_blocks(w, t, bs))
    if not 1 <= tiling.nsplit <= nb:
        raise ValueError(f"nsplit must be in [1, {nb}] (key blocks of {bs}), got {tiling.nsplit}")
    if tiling.threads == 512 and nb < 2 * tiling.nsplit:
        # Measured wrong on the H200 (b8, 10 blocks in 10 splits at 16 warps: 0.25 relative error), right
        # with 8 warps and with 2+ blocks per split at 16 warps. Not understood yet, so refused.
        raise ValueError(f"16 warps need 2+ key blocks per split: {nb} blocks in {tiling.nsplit} splits")
    # The 2-warpgroup program reserves room for TileLang's cross-warpgroup reduction workspace, the other
    # warp-specialised ones 1 KB for their barriers; the pair program's count is the whole (a CPU test checks
    # it against the lowered source).
    limit = _SMEM_LIMIT - (0 if tiling.dim_pair else 1024 if tiling.ws else 4096)
    if (smem := shared_bytes(k, w, t, tiling)) > limit:
        raise ValueError(
            f"block_s {bs} x {tiling.stages} stages needs {smem} B of shared memory (> {limit} B)"
        )


def _row_table(w: int, c: int, t: int, bs: int):
    """A macro filling a row's slot table (both programs): slot j of the ring part [0, NBW * bs) is window
    row j when j < W and valid, slot NBW * bs + i is pool row topk[i] when i < T and 0 <= topk[i] < C;
    every other slot is -1 (masked)."""
    import tilelang.language as T

    nbw, nbt = _blocks(w, t, bs)

    @T.macro
    def fill_rows(rows, bx, valid, topk):
        for j in T.Parallel((nbw + nbt) * bs):
            i = T.min(T.max(j - nbw * bs, 0), t - 1)
            rows[j] = T.if_then_else(
                j < nbw * bs,
                T.if_then_else((j < w) & (valid[bx, T.min(j, w - 1)] != 0), j, -1),
                T.if_then_else((j - nbw * bs < t) & (topk[bx, i] >= 0) & (topk[bx, i] < c), topk[bx, i], -1),
            )

    return fill_rows


def _gather(bs: int, kh: int):
    """A macro gathering key block `blk` into ring buffer `st` (both warp-specialised programs): columns
    [col0, col0 + kh) of the rows the slot table names, by predicated cp.async (zero-filled for masked
    slots, so no stale bytes reach P @ K)."""
    import tilelang.language as T

    @T.macro
    def gather(ring, st, src, bx, blk, rows, col0):
        for r, d in T.Parallel(bs, kh, annotations=_ASYNC):
            ring[st, r, d] = T.if_then_else(
                rows[blk * bs + r] >= 0,
                src[bx, T.max(rows[blk * bs + r], 0), col0 + d],
                T.cast(0, "bfloat16"),
            )

    return gather


def _softmax_step(bs: int, qk: float):
    """A macro for one key block's online-softmax update in base 2 (both programs): masks S by the slot
    table from slot `first_slot`, then updates the running max m, the rescale factor alpha and the
    denominator l, leaving P = exp2(S - m) in s. The caller rescales its accumulator by alpha."""
    import tilelang.language as T

    @T.macro
    def softmax_step(s, rows, first_slot, m, m_prev, alpha, rsum, l):
        for hh, r in T.Parallel(HEADS, bs):
            s[hh, r] = T.if_then_else(rows[first_slot + r] >= 0, s[hh, r] * qk, -T.infinity("float32"))
        T.copy(m, m_prev)
        T.reduce_max(s, m, dim=1, clear=False)
        for hh in T.Parallel(HEADS):
            alpha[hh] = T.exp2(m_prev[hh] - m[hh])
        for hh, r in T.Parallel(HEADS, bs):
            s[hh, r] = T.exp2(s[hh, r] - m[hh])
        T.reduce_sum(s, rsum, dim=1)
        for hh in T.Parallel(HEADS):
            l[hh] = l[hh] * alpha[hh] + rsum[hh]

    return softmax_step


def _reciprocal():
    """A macro writing inv = 1 / l per head, 0 where l = 0 (a split with no live key). The outputs are
    scaled by it: one division per head instead of one per output element, whose IEEE division code
    (a slow-path branch per element) made the epilogue longer than the whole key loop on the H200."""
    import tilelang.language as T

    @T.macro
    def reciprocal(l, inv):
        for hh in T.Parallel(HEADS):
            inv[hh] = T.if_then_else(l[hh] > 0, 1.0 / l[hh], 0.0)

    return reciprocal


def _split_range(bz, nb: int, nsplit: int):
    """Split bz's key blocks [lo, lo + n): balanced, every split gets floor or ceil of nb / nsplit >= 1."""
    lo = bz * nb // nsplit
    return lo, (bz + 1) * nb // nsplit - lo


def _operand_types(T, b: int, h: int, k: int, w: int, c: int, t: int, nsplit: int = 1) -> tuple:
    """The TileLang parameter types of `_OPERANDS` and the results (every entry point spells its own
    signature): q, window, valid, pool, topk, sinks, out, and with splits the f32 partials and their lse."""
    bf16, f32 = "bfloat16", "float32"
    return (
        T.Tensor((b, h, k), bf16),
        T.Tensor((b, w, k), bf16),
        T.Tensor((b, w), "int8"),
        T.Tensor((b, c, k), bf16),
        T.Tensor((b, t), "int32"),
        T.Tensor((h,), f32),
        T.Tensor((b, h, k), bf16),
        T.Tensor((b, nsplit, h, k), f32),
        T.Tensor((b, nsplit, h), f32),
    )


def _entry(
    b: int,
    h: int,
    k: int,
    w: int,
    c: int,
    t: int,
    nb: int,
    nsplit: int,
    threads: int,
    plain,
    split,
    merged=None,
):
    """Either program's entry point, parameters as in `_OPERANDS` and `_RESULTS` (TileLang needs one
    function per signature): grid (b, h / 64) running the macro `plain(bx, by, *operands, out)`, or, with
    splits, (b, h / 64, nsplit) running `split(bx, by, bz, lo, n, *operands, part, lse)` over key blocks
    [lo, lo + n) of the nb; with `merged`, `merged(bx, by, bz, lo, n, *operands, out, part, lse)`: the
    partials are scratch and the kernel writes the merged output."""
    import tilelang.language as T

    hg = h // HEADS
    Q_t, Win_t, Valid_t, Pool_t, Topk_t, Sinks_t, Out_t, Part_t, Lse_t = _operand_types(
        T, b, h, k, w, c, t, nsplit
    )
    if nsplit == 1:

        @T.prim_func
        def sparse_decode(
            p0_q: Q_t,
            p1_window: Win_t,
            p2_valid: Valid_t,
            p3_pool: Pool_t,
            p4_topk: Topk_t,
            p5_sinks: Sinks_t,
            p6_out: Out_t,
        ):
            with T.Kernel(b, hg, threads=threads) as (bx, by):
                plain(bx, by, p0_q, p1_window, p2_valid, p3_pool, p4_topk, p5_sinks, p6_out)

        return sparse_decode

    if merged is not None:

        @T.prim_func
        def sparse_decode_merged(
            p0_q: Q_t,
            p1_window: Win_t,
            p2_valid: Valid_t,
            p3_pool: Pool_t,
            p4_topk: Topk_t,
            p5_sinks: Sinks_t,
            p6_out: Out_t,
            p7_part: Part_t,
            p8_lse: Lse_t,
        ):
            with T.Kernel(b, hg, nsplit, threads=threads) as (bx, by, bz):
                lo, n = _split_range(bz, nb, nsplit)
                merged(
                    bx,
                    by,
                    bz,
                    lo,
                    n,
                    p0_q,
                    p1_window,
                    p2_valid,
                    p3_pool,
                    p4_topk,
                    p5_sinks,
                    p6_out,
                    p7_part,
                    p8_lse,
                )

        return sparse_decode_merged

    @T.prim_func
    def sparse_decode_split(
        p0_q: Q_t,
        p1_window: Win_t,
        p2_valid: Valid_t,
        p3_pool: Pool_t,
        p4_topk: Topk_t,
        p5_sinks: Sinks_t,
        p6_part: Part_t,
        p7_lse: Lse_t,
    ):
        with T.Kernel(b, hg, nsplit, threads=threads) as (bx, by, bz):
            lo, n = _split_range(bz, nb, nsplit)
            split(bx, by, bz, lo, n, p0_q, p1_window, p2_valid, p3_pool, p4_topk, p5_sinks, p6_part, p7_lse)

    return sparse_decode_split


def cuda_program(b: int, h: int, k: int, w: int, c: int, t: int, scale: float, tiling: Tiling):
    """The TileLang program for one static shape. Grid (b, h / 64, nsplit); parameters as in `_OPERANDS`.

    Key slots are numbered in block space: the ring takes slots [0, NBW * BS) (slot j is window row j,
    live when j < W and window_valid), the picks take [NBW * BS, NB * BS) (slot NBW * BS + i is pool row
    topk[i], live when i < T and 0 <= topk[i] < C). A block never mixes the two sources.
    """
    check_shapes(h, k, w, c, t, tiling)
    import tilelang.language as T

    bs, ns, nsplit = tiling.block_s, tiling.stages, tiling.nsplit
    nbw, nbt = _blocks(w, t, bs)
    nb = nbw + nbt
    qk = float(scale) * _LOG2E  # softmax in base 2
    fill_rows, softmax_step, reciprocal = _row_table(w, c, t, bs), _softmax_step(bs, qk), _reciprocal()
    gather = _gather(bs, k)
    bf16, f32, i32 = "bfloat16", "float32", "int32"
    policy = T.GemmWarpPolicy.FullCol  # warpgroups split the columns: M is one wgmma tile of 64 heads

    @T.macro
    def issue(bx, rows, k_s, blk, st, win, pool):
        """cp.async of key block `blk` into ring stage `st`; masked slots are zero-filled, not read."""
        if blk < nbw:
            gather(k_s, st, win, bx, blk, rows, 0)
        else:
            gather(k_s, st, pool, bx, blk, rows, 0)

    @T.macro
    def attend(bx, by, lo, n, first, q, win, valid, pool, topk, sinks):
        """Online softmax over key blocks [lo, lo + n); `first` carries the sink's mass (l starts at 1)."""
        q_s = T.alloc_shared((HEADS, k), bf16)
        k_s = T.alloc_shared((ns, bs, k), bf16)
        p_s = T.alloc_shared((HEADS, bs), bf16)
        # static (not dynamic) shared: TileLang's sync planner then sees it cannot alias the cp.async targets
        rows = T.alloc_shared((nb * bs,), i32, scope="shared")
        s = T.alloc_fragment((HEADS, bs), f32)
        acc = T.alloc_fragment((HEADS, k), f32)
        m = T.alloc_fragment((HEADS,), f32)
        m_prev = T.alloc_fragment((HEADS,), f32)
        l = T.alloc_fragment((HEADS,), f32)
        rsum = T.alloc_fragment((HEADS,), f32)
        alpha = T.alloc_fragment((HEADS,), f32)

        fill_rows(rows, bx, valid, topk)
        T.sync_threads()
        for st in T.serial(ns - 1):
            if st < n:
                issue(bx, rows, k_s, lo + st, st, win, pool)
            T.ptx_commit_group()
        T.copy(q[bx, by * HEADS, 0], q_s)
        for hh in T.Parallel(HEADS):
            m[hh] = sinks[by * HEADS + hh] * _LOG2E  # the sink seeds the max in every split: m stays finite
            l[hh] = T.if_then_else(first, 1.0, 0.0)
        T.clear(acc)
        for g in T.serial(n):
            if g + ns - 1 < n:
                issue(bx, rows, k_s, lo + g + ns - 1, (g + ns - 1) % ns, win, pool)
            T.ptx_commit_group()  # possibly empty: keeps one group per step so the wait count is fixed
            T.ptx_wait_group(ns - 1)  # block g has landed
            T.sync_threads()
            T.gemm(q_s, k_s[g % ns, :, :], s, transpose_B=True, clear_accum=True, policy=policy)
            softmax_step(s, rows, (lo + g) * bs, m, m_prev, alpha, rsum, l)
            for hh, d in T.Parallel(HEADS, k):
                acc[hh, d] *= alpha[hh]
            T.copy(s, p_s)
            T.gemm(p_s, k_s[g % ns, :, :], acc, policy=policy)
            T.sync_threads()  # stage g % ns and p_s are overwritten next step
        return acc, m, l

    @T.macro
    def finish_out(out, bx, by, acc, m, l):
        inv = T.alloc_fragment((HEADS,), f32)
        reciprocal(l, inv)
        for hh, d in T.Parallel(HEADS, k):
            acc[hh, d] *= inv[hh]
        T.copy(acc, out[bx, by * HEADS, 0])

    @T.macro
    def finish_split(part, lse, bx, by, bz, acc, m, l):
        inv = T.alloc_fragment((HEADS,), f32)
        reciprocal(l, inv)
        for hh, d in T.Parallel(HEADS, k):
            acc[hh, d] *= inv[hh]
        for hh in T.Parallel(HEADS):
            lse[bx, bz, by * HEADS + hh] = T.if_then_else(l[hh] > 0, m[hh] + T.log2(l[hh]), -T.infinity(f32))
        T.copy(acc, part[bx, bz, by * HEADS, 0])

    @T.macro
    def plain(bx, by, q, win, valid, pool, topk, sinks, out):
        acc, m, l = attend(bx, by, 0, nb, True, q, win, valid, pool, topk, sinks)
        finish_out(out, bx, by, acc, m, l)

    @T.macro
    def split(bx, by, bz, lo, n, q, win, valid, pool, topk, sinks, part, lse):
        acc, m, l = attend(bx, by, lo, n, bz == 0, q, win, valid, pool, topk, sinks)
        finish_split(part, lse, bx, by, bz, acc, m, l)

    return _entry(b, h, k, w, c, t, nb, nsplit, tiling.threads, plain, split)


def ws_program(b: int, h: int, k: int, w: int, c: int, t: int, scale: float, tiling: Tiling):
    """The warp-specialised program: same contract, grid and parameters as `cuda_program`.

    Three warpgroups with fixed roles, handing off through mbarriers instead of CTA-wide barriers:
    - producer (threads 256-383): cp.async of q and of each key block into a ring of `stages` buffers; each
      buffer's `ready` barrier completes when its copies land (cp.async.mbarrier.arrive), its `free` barrier
      when both consumers are done with it.
    - softmax warpgroup (0-127): S = Q K^T for the whole 64 x block_s tile, the online softmax (row max and
      sum stay inside the warpgroup: no shared-memory reductions), P and the rescale factor to shared
      memory, then the left half of the value columns: acc_l += P K[:, :k/2].
    - right warpgroup (128-255): acc_r = alpha * acc_r + P K[:, k/2:] once P is ready.
    The softmax warpgroup's QK^T of block g + 1 overlaps the right warpgroup's PV of block g, and the loads
    run `stages` blocks ahead of both. With `tiling.merge` the splits of a row are one cluster: each writes
    its partial, all meet at the cluster barrier, then each merges its slice of the value columns.
    """
    check_shapes(h, k, w, c, t, tiling)
    import tilelang.language as T

    bs, ns, nsplit = tiling.block_s, tiling.stages, tiling.nsplit
    nbw, nbt = _blocks(w, t, bs)
    nb = nbw + nbt
    kh = k // 2
    qk = float(scale) * _LOG2E
    fill_rows, softmax_step, reciprocal = _row_table(w, c, t, bs), _softmax_step(bs, qk), _reciprocal()
    gather = _gather(bs, kh)
    bf16, f32, i32 = "bfloat16", "float32", "int32"

    merge, dsmem, push, tma_q = tiling.merge, tiling.dsmem, tiling.push, tiling.tma_q
    quads = -(-k // 4 // nsplit)  # with merge: each split merges this many 4-column groups (the last fewer)

    @T.macro
    def finish(out, bx, by, slot, d0, acc, inv):
        """One warpgroup's half of the value columns: normalised (inv = 1 / l), to the output (slot None)
        or the partial of slot `slot`."""
        for hh, d in T.Parallel(HEADS, kh):
            acc[hh, d] *= inv[hh]
        if slot is None:
            T.copy(acc, out[bx, by * HEADS, d0])
        else:
            T.copy(acc, out[bx, slot, by * HEADS, d0])

    @T.macro
    def stage_partial(ring, acc, inv):
        """One warpgroup's half of the value columns, normalised, as f32 over the bytes of its finished key
        ring buffer (`djax_stage`: a `T.view` would inherit the ring's wgmma swizzle, which splits 32-bit
        words), row-major with 8-column groups XOR-swizzled by head so that a fragment's 8 rows per store
        do not share banks; `djax_dsmem_merge` reads with the same swizzle."""
        for hh, d in T.Parallel(HEADS, kh):
            T.call_extern(
                "handle", f"djax_stage<{kh}>", T.address_of(ring[0, 0, 0]), hh, d, acc[hh, d] * inv[hh]
            )

    @T.macro
    def dsmem_merge(out, ring_l, ring_r, wts, bx, by, bz, h0, tid):
        """After the cluster barrier: `merge_slice` with the partials read from every split's shared
        memory (`_DSMEM_MERGE`, CUDA injected into the source: TileLang has no distributed shared-memory
        load)."""
        T.call_extern(
            "handle",
            f"djax_dsmem_merge<{nsplit}, {quads}, {kh}, {k}, {HEADS}>",
            out.data,  # address_of a global element fails to lower here: base and offset
            (bx * h + by * HEADS) * k,
            T.address_of(ring_l[0, 0, 0]),
            T.address_of(ring_r[0, 0, 0]),
            T.address_of(wts[0, 0]),
            bz,
            h0,
            tid,
        )

    @T.macro
    def merge_slice(out, part, wts, bx, by, bz, h0, tid):
        """After the cluster barrier: this split's slice of the value columns (4-column groups
        [bz * quads, (bz + 1) * quads) of the k / 4) for heads h0 .. h0 + 31, merged over every split's
        normalised partial (read back from L2, 16 bytes a thread) with the weights in `wts`; 128 threads,
        `tid` in [0, 128)."""
        acc4 = T.alloc_local((4,), f32)
        # unrolled, so each thread has all its loads in flight at once rather than one L2 round trip each
        for it in T.unroll(-(-HEADS // 2 * quads // 128)):
            i = it * 128 + tid
            if i < HEADS // 2 * quads and bz * quads + i % quads < k // 4:
                hh = h0 + i // quads
                d = (bz * quads + i % quads) * 4
                for v in T.vectorized(4):
                    acc4[v] = 0.0
                for j in T.unroll(nsplit):
                    for v in T.vectorized(4):
                        acc4[v] += part[bx, j, by * HEADS + hh, d + v] * wts[j, hh]
                for v in T.vectorized(4):
                    out[bx, by * HEADS + hh, d + v] = T.cast(acc4[v], bf16)

    @T.macro
    def end_half(out, part, bx, by, bz, d0, acc, ring, inv):
        """A consumer warpgroup's value columns [d0, d0 + k/2) once the loop is done: staged in its ring
        buffer (dsmem), else to the output (one split) or this split's partial."""
        if dsmem:
            stage_partial(ring, acc, inv)
        else:
            finish(out if nsplit == 1 else part, bx, by, None if nsplit == 1 else bz, d0, acc, inv)

    @T.macro
    def merge_heads(out, part, ring_l, ring_r, wts, bx, by, bz, h0, tid):
        """A consumer warpgroup's 32 heads of the merge, once the weights are in `wts`; with dsmem, then
        the cluster barrier that keeps this split's shared memory until every split has read it."""
        if dsmem:
            dsmem_merge(out, ring_l, ring_r, wts, bx, by, bz, h0, tid)
            T.cluster_arrive()
            T.cluster_wait()
        else:
            merge_slice(out, part, wts, bx, by, bz, h0, tid)

    @T.macro
    def push_end(out, bx, by, bz, tid, g, acc, m_at, l_at, q_l, q_r, ml_peer, ring, xbar):
        """With push, consumer warpgroup g's end (`_PUSH_MERGE`): the split that stores g's value columns
        adds the peer's values to its own and stores bf16 (staged in g's key ring, which only g reads
        after the last Q K^T); the other one sends them. m_at, l_at: this split's max and denominator per
        head (registers for g 0, the shared copies for g 1)."""
        T.call_extern(
            "handle",
            f"djax_push_merge<{kh}, {k}, {g}, {int(tiling.push_bf16)}>",
            out.data,  # address_of a global element fails to lower here: base and offset
            (bx * h + by * HEADS) * k,
            acc.data,
            m_at,
            l_at,
            T.address_of(q_l[0, 0]),
            T.address_of(q_r[0, 0]),
            T.address_of(ml_peer[0]),
            T.address_of(ring[0, 0, 0]),
            xbar[0],
            xbar[1],
            xbar[2],
            bz,
            tid,
        )

    @T.macro
    def body(bx, by, bz, lo, n, first, q, win, valid, pool, topk, sinks, out, part, lse):
        q_l = T.alloc_shared((HEADS, kh), bf16)
        q_r = T.alloc_shared((HEADS, kh), bf16)
        k_l = T.alloc_shared((ns, bs, kh), bf16)
        k_r = T.alloc_shared((ns, bs, kh), bf16)
        p_s = T.alloc_shared((HEADS, bs), bf16)
        alpha_s = T.alloc_shared((HEADS,), f32, scope="shared")
        inv_s = T.alloc_shared((HEADS,), f32, scope="shared")
        rows = T.alloc_shared((nb * bs,), i32, scope="shared")
        s = T.alloc_fragment((HEADS, bs), f32)
        acc_l = T.alloc_fragment((HEADS, kh), f32)
        acc_r = T.alloc_fragment((HEADS, kh), f32)
        m = T.alloc_fragment((HEADS,), f32)
        m_prev = T.alloc_fragment((HEADS,), f32)
        l = T.alloc_fragment((HEADS,), f32)
        rsum = T.alloc_fragment((HEADS,), f32)
        alpha = T.alloc_fragment((HEADS,), f32)
        inv = T.alloc_fragment((HEADS,), f32)
        ready = T.alloc_barrier([128] * ns)  # the producer's 128 threads, one cp.async arrive each
        free = T.alloc_barrier([256] * ns)  # both consumer warpgroups
        p_ready = T.alloc_barrier(128)  # softmax warpgroup: P and alpha written
        p_free = T.alloc_barrier(128)  # right warpgroup: done reading P and alpha
        l_ready = T.alloc_barrier(128)  # softmax warpgroup: final 1 / l written
        if push:  # this split's max and denominator per head (for the second warpgroup), the peer's, and
            # the barriers: the peer's values have landed; the peer's q may be written; the peer has ours
            m_s = T.alloc_shared((HEADS,), f32, scope="shared")
            l_s = T.alloc_shared((HEADS,), f32, scope="shared")
            ml_peer = T.alloc_shared((2 * HEADS,), f32, scope="shared")
            xbar = T.alloc_barrier([1, 1, 1])
        elif merge:  # the merge's state: every split's weight per head, its barrier, two scalars
            wts = T.alloc_shared((nsplit, HEADS), f32, scope="shared")
            w_ready = T.alloc_barrier(128)  # softmax warpgroup has written the weights
            top = T.alloc_var(f32)
            tot = T.alloc_var(f32)
        tx = T.get_thread_binding()

        if tma_q:
            # one elected producer thread; the bytes complete on key block 0's barrier, whose phase also
            # waits for that thread's own later arrive, so the expected count is in place before it can end
            if tx >= 256:
                T.tma_copy(q[bx, by * HEADS : (by + 1) * HEADS, 0:kh], q_l, barrier=ready[0])
                T.tma_copy(q[bx, by * HEADS : (by + 1) * HEADS, kh:k], q_r, barrier=ready[0])
        elif tx >= 256:  # q needs no slot table: its copies start first and land with key block 0
            for r, d in T.Parallel(HEADS, kh, annotations=_ASYNC):
                q_l[r, d] = q[bx, by * HEADS + r, d]
            for r, d in T.Parallel(HEADS, kh, annotations=_ASYNC):
                q_r[r, d] = q[bx, by * HEADS + r, kh + d]
        fill_rows(rows, bx, valid, topk)
        T.sync_threads()

        if tx >= 256:
            T.set_max_nreg(80, 0)
            if push:
                if tx == 256:  # the bytes the peer will send here: its half of the values, its max and sum
                    T.mbarrier_arrive_expect_tx(
                        xbar[0], HEADS * k * (1 if tiling.push_bf16 else 2) + 2 * HEADS * 4
                    )
                # every CTA's barriers initialised before the peer sends to them; waited for after the loops
                T.cluster_arrive_relaxed()
            for g in T.serial(n):
                st = g % ns
                T.barrier_wait(free[st], ((g // ns) & 1) ^ 1)
                blk = lo + g
                if blk < nbw:
                    gather(k_l, st, win, bx, blk, rows, 0)
                    gather(k_r, st, win, bx, blk, rows, kh)
                else:
                    gather(k_l, st, pool, bx, blk, rows, 0)
                    gather(k_r, st, pool, bx, blk, rows, kh)
                T.cp_async_barrier_noinc(ready[st])
            if push:
                T.cluster_wait()
            elif merge:  # every thread of the cluster arrives once (twice with dsmem: see below)
                T.cluster_arrive()
                T.cluster_wait()
                if dsmem:
                    T.cluster_arrive()
                    T.cluster_wait()
        elif tx < 128:
            T.set_max_nreg(240, 1)
            if push:
                T.cluster_arrive_relaxed()
            for hh in T.Parallel(HEADS):
                m[hh] = sinks[by * HEADS + hh] * _LOG2E  # the sink seeds the max in every split
                l[hh] = T.if_then_else(first, 1.0, 0.0)
            T.clear(acc_l)
            for g in T.serial(n):
                st = g % ns
                T.barrier_wait(ready[st], (g // ns) & 1)
                T.gemm(q_l, k_l[st, :, :], s, transpose_B=True, clear_accum=True)
                T.gemm(q_r, k_r[st, :, :], s, transpose_B=True)
                softmax_step(s, rows, (lo + g) * bs, m, m_prev, alpha, rsum, l)
                for hh, d in T.Parallel(HEADS, kh):
                    acc_l[hh, d] *= alpha[hh]
                if g > 0:
                    T.barrier_wait(p_free, (g - 1) & 1)  # the right warpgroup has read the previous P
                T.copy(s, p_s)
                T.copy(alpha, alpha_s)
                T.fence_proxy_async()  # P is read by the other warpgroup's wgmma (the async proxy)
                T.barrier_arrive(p_ready)
                T.gemm(p_s, k_l[st, :, :], acc_l)
                T.barrier_arrive(free[st])
            if push:
                # this split's max and denominator, for the other warpgroup (which may store)
                T.copy(m, m_s)
                T.copy(l, l_s)
                T.barrier_arrive(l_ready)
                T.cluster_wait()
                push_end(out, bx, by, bz, tx, 0, acc_l, m.data, l.data, q_l, q_r, ml_peer, k_l, xbar)
            else:
                reciprocal(l, inv)
                T.copy(inv, inv_s)
                T.barrier_arrive(l_ready)
                end_half(out, part, bx, by, bz, 0, acc_l, k_l, inv)
            if nsplit > 1 and not push:
                # With merge, a launch without the cluster would let a split read the others' partials
                # before they are written: the rank check makes that NaN, not a plausible wrong answer.
                live = T.block_rank_in_cluster() == bz if merge else True
                for hh in T.Parallel(HEADS):
                    lse[bx, bz, by * HEADS + hh] = T.if_then_else(
                        live,
                        T.if_then_else(l[hh] > 0, m[hh] + T.log2(l[hh]), -T.infinity(f32)),
                        T.float32(math.nan),
                    )
            if merge and not push:
                T.cluster_arrive()  # release: this split's partial and lse, to the cluster
                T.cluster_wait()  # acquire: every split's
                # weights per head: exp2(lse_j - max) / sum (split 0 holds the sink, so the max is finite;
                # a split with no live key has lse -inf and weight 0)
                if tx < HEADS:
                    top = lse[bx, 0, by * HEADS + tx]
                    for j in T.serial(1, nsplit):
                        top = T.max(top, lse[bx, j, by * HEADS + tx])
                    tot = 0.0
                    for j in T.serial(nsplit):
                        tot += T.exp2(lse[bx, j, by * HEADS + tx] - top)
                    for j in T.serial(nsplit):
                        wts[j, tx] = T.exp2(lse[bx, j, by * HEADS + tx] - top) / tot
                T.barrier_arrive(w_ready)
                T.barrier_wait(w_ready, 0)
                merge_heads(out, part, k_l, k_r, wts, bx, by, bz, 0, tx)
        else:
            T.set_max_nreg(168, 1)
            if push:
                T.cluster_arrive_relaxed()
            T.clear(acc_r)
            for g in T.serial(n):
                st = g % ns
                T.barrier_wait(p_ready, g & 1)
                for hh, d in T.Parallel(HEADS, kh):
                    acc_r[hh, d] *= alpha_s[hh]
                T.gemm(p_s, k_r[st, :, :], acc_r)
                T.barrier_arrive(p_free)
                T.barrier_arrive(free[st])
            T.barrier_wait(l_ready, 0)
            if push:
                T.cluster_wait()
                push_end(
                    out,
                    bx,
                    by,
                    bz,
                    tx - 128,
                    1,
                    acc_r,
                    T.address_of(m_s[0]),
                    T.address_of(l_s[0]),
                    q_l,
                    q_r,
                    ml_peer,
                    k_r,
                    xbar,
                )
            else:
                end_half(out, part, bx, by, bz, kh, acc_r, k_r, inv_s)
            if merge and not push:
                T.cluster_arrive()
                T.cluster_wait()
                T.barrier_wait(w_ready, 0)
                merge_heads(out, part, k_l, k_r, wts, bx, by, bz, HEADS // 2, tx - 128)

    @T.macro
    def plain(bx, by, q, win, valid, pool, topk, sinks, out):
        body(bx, by, 0, 0, nb, True, q, win, valid, pool, topk, sinks, out, None, None)

    @T.macro
    def split(bx, by, bz, lo, n, q, win, valid, pool, topk, sinks, part, lse):
        body(bx, by, bz, lo, n, bz == 0, q, win, valid, pool, topk, sinks, None, part, lse)

    @T.macro
    def merged(bx, by, bz, lo, n, q, win, valid, pool, topk, sinks, out, part, lse):
        body(bx, by, bz, lo, n, bz == 0, q, win, valid, pool, topk, sinks, out, part, lse)

    return _entry(b, h, k, w, c, t, nb, nsplit, 384, plain, split, merged if merge else None)


def pair_program(b: int, h: int, k: int, w: int, c: int, t: int, scale: float, tiling: Tiling):
    """`Tiling.dim_pair`: grid (b, h / 64, 2), the two CTAs of a row (and head group) one cluster, CTA `bz`
    holding columns [bz k/2, (bz + 1) k/2) of q, of every key and of the output.

    Each block's scores are the sum of the two CTAs' partial products over their halves: a consumer
    warpgroup computes its partial S, sends it from its registers into the peer's shared memory (st.async,
    `_PAIR`) and adds the peer's, so both CTAs hold the same S (f32 addition commutes), take the same online
    softmax and apply the same P to their own half of the values. Nothing is merged across the pair after
    the loop, and q's 64 KB are read once per row instead of once per split. Roles, as in `ws_program`: a
    producer warpgroup (cp.async of q's half and of each block's half rows into a ring of `stages` buffers)
    and two consumer warpgroups, which here take alternate key blocks (0 the even ones, 1 the odd ones),
    each with its own running max, denominator and accumulator (64 x k/2 f32), so one's exchange overlaps
    the other's products. At the end each warpgroup hands the other its accumulator for half of the columns
    through the finished key ring, combines the two softmax states for its half and stores bf16.
    """
    check_shapes(h, k, w, c, t, tiling)
    import tilelang.language as T

    bs, ns = tiling.block_s, tiling.stages
    nbw, nbt = _blocks(w, t, bs)
    nb = nbw + nbt
    kh, hg = k // 2, h // HEADS
    qk = float(scale) * _LOG2E
    fill_rows, softmax_step, gather = _row_table(w, c, t, bs), _softmax_step(bs, qk), _gather(bs, kh)
    bf16, f32, i32 = "bfloat16", "float32", "int32"
    Q_t, Win_t, Valid_t, Pool_t, Topk_t, Sinks_t, Out_t, *_ = _operand_types(T, b, h, k, w, c, t)
    xbytes = HEADS * bs * 4  # one warpgroup's partial scores of one block
    lean = tiling.p_in_exchange

    def softmax_state():
        """One consumer warpgroup's fragments: scores, accumulator, max, previous max, denominator, row sums,
        rescale factors (each warpgroup its own, since the two take different threads' registers)."""
        s = T.alloc_fragment((HEADS, bs), f32)
        acc = T.alloc_fragment((HEADS, kh), f32)
        m, m_prev, l, rsum, alpha = (T.alloc_fragment((HEADS,), f32) for _ in range(5))
        return s, acc, m, m_prev, l, rsum, alpha

    @T.macro
    def consumer(g0, tid, bx, by, bz, sinks, out, shared, bars, p_s, state):
        """Consumer warpgroup g0 (0 or 1, `tid` its thread in [0, 128)) over key blocks g0, g0 + 2, ...; `state`:
        its `softmax_state`."""
        q_s, k_s, xs, ml, rows = shared
        ready, free, xbar = bars
        s, acc, m, m_prev, l, rsum, alpha = state
        n = (nb + 1 - g0) // 2
        xs0 = T.address_of(xs[0, 0, 0] if lean else xs[0])  # the score buffers as raw memory
        for hh in T.Parallel(HEADS):
            m[hh] = sinks[by * HEADS + hh] * _LOG2E
            l[hh] = 1.0 if g0 == 0 else 0.0  # the sink's term, counted once
        T.clear(acc)
        T.cluster_wait()  # the peer's barriers are initialised before the first scores go there
        for i in T.serial(n):
            g = 2 * i + g0
            st = g % ns
            x = 2 * g0 + i % 2
            T.barrier_wait(ready[st], (g // ns) & 1)
            T.gemm(q_s, k_s[st, :, :], s, transpose_B=True, clear_accum=True)
            T.call_extern(
                "handle",
                f"djax_pair_send<{HEADS * bs // 128}>",
                s.data,
                xs0,
                xbar[x],
                x,
                bz ^ 1,
                tid,
            )
            T.barrier_wait(xbar[x], (i // 2) & 1)
            T.call_extern("handle", f"djax_pair_add<{HEADS * bs // 128}>", s.data, xs0, x, tid)
            if tid == 0 and i + 2 < n:  # this buffer's next use: the peer sends it after our next scores
                T.mbarrier_arrive_expect_tx(xbar[x], xbytes)
            softmax_step(s, rows, g * bs, m, m_prev, alpha, rsum, l)
            for hh, d in T.Parallel(HEADS, kh):
                acc[hh, d] *= alpha[hh]
            # lean: P in the buffer just read, which the peer writes again only after our next block's scores
            T.copy(s, xs[x, :, 0:bs] if lean else p_s)
            T.fence_proxy_async()  # P is read by wgmma (the async proxy)
            T.gemm(xs[x, :, 0:bs] if lean else p_s, k_s[st, :, :], acc)
            T.barrier_arrive(free[st])
        # the second cluster barrier: every thread arrives once its loop is done, and waits only before
        # leaving, so no CTA leaves while its scores may still be on their way to the peer
        T.cluster_arrive_relaxed()
        T.call_extern(
            "handle",
            f"djax_pair_end<{kh}, {k}, {g0}>",
            out.data,  # address_of a global element fails to lower here: base and offset
            (bx * h + by * HEADS) * k + bz * kh,
            acc.data,
            m.data,
            l.data,
            T.address_of(k_s[0, 0, 0]),
            T.address_of(xs[2, 0, 0] if lean else ml[0]),  # lean: the third score buffer, free at the end
            xs0,
            tid,
        )
        T.cluster_wait()

    @T.prim_func
    def sparse_decode_pair(
        p0_q: Q_t,
        p1_window: Win_t,
        p2_valid: Valid_t,
        p3_pool: Pool_t,
        p4_topk: Topk_t,
        p5_sinks: Sinks_t,
        p6_out: Out_t,
    ):
        with T.Kernel(b, hg, 2, threads=384) as (bx, by, bz):
            q_s = T.alloc_shared((HEADS, kh), bf16)
            k_s = T.alloc_shared((ns, bs, kh), bf16)
            if lean:  # four score buffers of HEADS x bs f32, seen by P as HEADS x 2 bs bf16 (first half: P)
                p0_s = p1_s = ml = None
                xs = T.alloc_shared((4, HEADS, 2 * bs), bf16)
            else:
                p0_s = T.alloc_shared((HEADS, bs), bf16)
                p1_s = T.alloc_shared((HEADS, bs), bf16)
                xs = T.alloc_shared((_pair_exchange_floats(k, bs),), f32)
                ml = T.alloc_shared((4 * HEADS,), f32, scope="shared")
            rows = T.alloc_shared((nb * bs,), i32, scope="shared")
            state0, state1 = softmax_state(), softmax_state()
            ready = T.alloc_barrier([128] * ns)  # the producer's 128 threads, one cp.async arrive each
            free = T.alloc_barrier([128] * ns)  # the warpgroup that took the block
            xbar = T.alloc_barrier([1] * 4)  # the peer's scores landed: [warpgroup][use parity]
            tx = T.get_thread_binding()
            shared, bars = (q_s, k_s, xs, ml, rows), (ready, free, xbar)

            if tx >= 256:  # q's half needs no slot table: its copies start first and land with key block 0
                for r, d in T.Parallel(HEADS, kh, annotations=_ASYNC):
                    q_s[r, d] = p0_q[bx, by * HEADS + r, bz * kh + d]
            fill_rows(rows, bx, p2_valid, p4_topk)
            T.sync_threads()
            if tx == 0 or tx == 128:  # each consumer's first two exchanges (a block of the row's each way)
                for j in T.serial(2):
                    if j < (nb + 1 - tx // 128) // 2:
                        T.mbarrier_arrive_expect_tx(xbar[2 * (tx // 128) + j], xbytes)
            T.cluster_arrive()  # release: the barriers above, to the peer

            if tx >= 256:
                T.set_max_nreg(80, 0)
                for g in T.serial(nb):
                    st = g % ns
                    T.barrier_wait(free[st], ((g // ns) & 1) ^ 1)
                    if g < nbw:
                        gather(k_s, st, p1_window, bx, g, rows, bz * kh)
                    else:
                        gather(k_s, st, p3_pool, bx, g, rows, bz * kh)
                    T.cp_async_barrier_noinc(ready[st])
                T.cluster_wait()
                T.cluster_arrive_relaxed()
                T.cluster_wait()
            elif tx < 128:
                # 2 x 208 + 80 registers a thread is all that a launch at 168 holds: setmaxnreg only hands
                # the consumers what the producer gives back, and asking for more hangs the CTA
                T.set_max_nreg(208, 1)
                consumer(0, tx, bx, by, bz, p5_sinks, p6_out, shared, bars, p0_s, state0)
            else:
                T.set_max_nreg(208, 1)
                consumer(1, tx - 128, bx, by, bz, p5_sinks, p6_out, shared, bars, p1_s, state1)

    return sparse_decode_pair


def lower_cuda(
    b: int, h: int, k: int, w: int, c: int, t: int, scale: float, tiling: Tiling
) -> tuple[str, dict]:
    """CUDA source and launch parameters (name, grid, threads, shared_bytes, params). No GPU needed."""
    program = pair_program if tiling.dim_pair else ws_program if tiling.ws else cuda_program
    # with tma_q TileLang lowers q's copies to TMA (the roles stay the program's own)
    config = {"tl.disable_warp_specialized": True} if tiling.tma_q else POINTER_ONLY
    art = lower(program(b, h, k, w, c, t, scale, tiling), {"kind": "cuda", "arch": ARCH}, config)
    kinds = [
        ("pair", tiling.dim_pair),
        ("plain", tiling.nsplit == 1),
        ("push", tiling.push),
        ("dsmem", tiling.dsmem),
    ]
    kind = next((name for name, hit in kinds if hit), "merge" if tiling.merge else "split")
    # with tma_q q's parameter is a tensor map: the TMA launcher's plan describes every parameter
    source, launch = (tma_kernel if tiling.tma_q else pointer_kernel)(art, _OPERANDS + _RESULTS[kind])
    if tiling.merge:
        source = with_cluster(source, launch["name"], (1, 1, tiling.nsplit))
    if tiling.dsmem:
        source = with_device_code(source, _DSMEM_MERGE)
    if tiling.push:
        source = with_device_code(source, PEER_ADDRESS + _STAGE_STORE + _PUSH_MERGE)
    if tiling.dim_pair:
        source = with_device_code(
            with_cluster(source, launch["name"], (1, 1, 2)), PEER_ADDRESS + _STAGE_STORE + _PAIR
        )
    return source, launch


# The dsmem merge's reads (`Tiling.dsmem`), as CUDA put into the lowered source ahead of the kernel: TileLang
# 0.1.15 has cluster copies that push shared memory to a peer, but no load from a peer's shared memory.
# Thread `tid` of a warpgroup merges (head, 4-column group) pairs tid, tid + 128, ... of heads h0 .. h0 + H/2
# over this split's QUADS column groups, reading each split's normalised partial at the same shared address
# (mapa) and weighting it by wts[split][head]; loads of BATCH pairs are issued before any is used.
_DSMEM_MERGE = r"""
template <int KH>
__device__ __forceinline__ void djax_stage(void* ring, int hh, int d, float v) {
  reinterpret_cast<float*>(ring)[hh * KH + (d ^ ((hh & 3) << 3))] = v;
}

template <int NSPLIT, int QUADS, int KH, int K, int H>
__device__ __forceinline__ void djax_dsmem_merge(const bfloat16_t* out_ro, int out_at, void* ring_l, void* ring_r,
                                                 const float* wts, int rank, int h0, int tid) {
  // TileLang declares the output const: this function is the only writer it does not see
  bfloat16_t* out = const_cast<bfloat16_t*>(out_ro);
  float* mine_l = reinterpret_cast<float*>(ring_l);
  float* mine_r = reinterpret_cast<float*>(ring_r);
  constexpr int ITEMS = H / 2 * QUADS;
  constexpr int ITERS = (ITEMS + 127) / 128;
  constexpr int BATCH = NSPLIT >= 8 ? 1 : 8 / NSPLIT;
#pragma unroll
  for (int it0 = 0; it0 < ITERS; it0 += BATCH) {
    float4 v[BATCH][NSPLIT];
#pragma unroll
    for (int b = 0; b < BATCH; ++b) {
      int i = (it0 + b) * 128 + tid, g = rank * QUADS + i % QUADS;
      if (it0 + b < ITERS && i < ITEMS && g < K / 4) {
        int hh = h0 + i / QUADS, d = g * 4;
        float* half = d < KH ? mine_l : mine_r;
        int dd = d < KH ? d : d - KH;
        uint32_t local = (uint32_t)__cvta_generic_to_shared(half + hh * KH + (dd ^ ((hh & 3) << 3)));
#pragma unroll
        for (int j = 0; j < NSPLIT; ++j) {
          uint32_t remote;
          asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(j));
          asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
                       : "=f"(v[b][j].x), "=f"(v[b][j].y), "=f"(v[b][j].z), "=f"(v[b][j].w)
                       : "r"(remote) : "memory");
        }
      }
    }
#pragma unroll
    for (int b = 0; b < BATCH; ++b) {
      int i = (it0 + b) * 128 + tid, g = rank * QUADS + i % QUADS;
      if (it0 + b < ITERS && i < ITEMS && g < K / 4) {
        int hh = h0 + i / QUADS;
        float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int j = 0; j < NSPLIT; ++j) {
          float wj = wts[j * H + hh];
          a.x += v[b][j].x * wj; a.y += v[b][j].y * wj; a.z += v[b][j].z * wj; a.w += v[b][j].w * wj;
        }
        bfloat16_t o[4] = {bfloat16_t(a.x), bfloat16_t(a.y), bfloat16_t(a.z), bfloat16_t(a.w)};
        *reinterpret_cast<uint2*>(out + out_at + hh * K + g * 4) = *reinterpret_cast<const uint2*>(o);
      }
    }
  }
}
"""


# Both cross-warpgroup ends' store (`_PUSH_MERGE`, `_PAIR`), as CUDA put into the lowered source ahead of
# them:
# NS quads (8 columns each) of heads r0 = 16 w + l / 4 and r0 + 8 a thread, each the weighted sum
# mine own + theirs other per head, staged as bf16 rows of 16 NS bytes (16-byte chunk c of head r at chunk
# c ^ (r mod SW): a warp's 8 heads x 4 lanes write distinct banks), then stored 16 bytes a thread, a warp
# writing whole rows (straight from the wgmma layout every store instruction would write 16 bytes into each
# of 8 rows). `out` points at row 0 of the columns stored; rows are K elements apart. `bar`: the named
# barrier of the 128 threads that stage and store.
_STAGE_STORE = r"""
template <int NS, int K, typename Theirs>
__device__ __forceinline__ void djax_stage_store(bfloat16_t* out, const float* mine, Theirs theirs, const float* own,
                                                 const float* other, char* staged, int bar, int tid) {
  constexpr int SW = NS < 8 ? NS : 8, ROW = 16 * NS;
  const int lane = tid % 32, r0 = 16 * (tid / 32) + lane / 4;
#pragma unroll
  for (int j = 0; j < NS; ++j) {
    const float4 v = theirs(j);
    bfloat16_t top[2] = {bfloat16_t(mine[4 * j] * own[0] + v.x * other[0]),
                         bfloat16_t(mine[4 * j + 1] * own[0] + v.y * other[0])};
    bfloat16_t bottom[2] = {bfloat16_t(mine[4 * j + 2] * own[1] + v.z * other[1]),
                            bfloat16_t(mine[4 * j + 3] * own[1] + v.w * other[1])};
    const int at = ((j ^ (r0 % SW)) * 16) + 4 * (lane % 4);  // heads r0 and r0 + 8 share the swizzle
    *reinterpret_cast<uint32_t*>(staged + r0 * ROW + at) = *reinterpret_cast<const uint32_t*>(top);
    *reinterpret_cast<uint32_t*>(staged + (r0 + 8) * ROW + at) = *reinterpret_cast<const uint32_t*>(bottom);
  }
  asm volatile("bar.sync %0, 128;" ::"r"(bar) : "memory");
#pragma unroll
  for (int i = 0; i < 64 * NS / 128; ++i) {
    const int item = i * 128 + tid, r = item / NS, c = item % NS;
    *reinterpret_cast<uint4*>(out + r * K + 8 * c) =
        *reinterpret_cast<const uint4*>(staged + r * ROW + (c ^ (r % SW)) * 16);
  }
}
"""


# The pushed merge's two ends (`Tiling.push`), as CUDA put into the lowered source ahead of the kernel, called
# by every thread of both consumer warpgroups after their key loops (and the cluster wait that makes the
# peer's barriers visible). `acc` is the warpgroup's NQ x 4 accumulator registers in wgmma's layout: register
# i of lane l in warp w holds head 16 w + l / 4 + 8 ((i / 2) % 2), column 8 (i / 4) + 2 (l % 4) + i % 2 of
# the warpgroup's KH. The sending warpgroup puts quad q of thread t at float4 (q mod NQ/2) 128 + t of the
# peer's q_l (q < NQ/2) or q_r, so the storing thread of the same position reads back exactly its own
# (head, column) values, 16 contiguous bytes a lane. Each softmax warpgroup also sends its running max and
# denominator of heads r and r + 8 (r = 16 w + l / 4) as one float4 at 8 w + l / 4 of the peer's `ml_peer`
# (lanes l % 4 = 0). Three barriers a CTA: `recv_bar` completes when both have landed (expected since the
# start), `may_send` when the peer's last Q K^T is done (its q is free), `done_bar` when the peer has all
# of this split's bytes (so the CTA stays until then). The store combines the two splits' unnormalised
# values: (acc e^{m - M} + acc' e^{m' - M}) / (l e^{m - M} + l' e^{m' - M}), M = max(m, m'), in base 2.
_PUSH_MERGE = r"""
__device__ __forceinline__ uint32_t djax_bf16x2(float a, float b) {
  bfloat16_t h[2] = {bfloat16_t(a), bfloat16_t(b)};
  return *reinterpret_cast<const uint32_t*>(h);
}

template <int KH, int K, int G, bool BF16>
__device__ __forceinline__ void djax_push_merge(const bfloat16_t* out_ro, int out_at, const float* acc,
                                                const void* m_at, const void* l_at, const void* q_l,
                                                const void* q_r, const float* ml_peer, void* stage,
                                                Barrier& recv_bar, Barrier& may_send, Barrier& done_bar, int rank,
                                                int tid) {
  // TileLang declares the output const: this function is the only writer it does not see
  bfloat16_t* out = const_cast<bfloat16_t*>(out_ro);
  const float* m = static_cast<const float*>(m_at);
  const float* l = static_cast<const float*>(l_at);
  constexpr int NQ = KH / 8, HALF = NQ / 2;
  const int w = tid / 32, lane = tid % 32, r0 = 16 * w + lane / 4, peer = rank ^ 1;
  auto slot = [&](int q) {  // quad q's place in q_l / q_r (bf16: quads 2 p and 2 p + 1 at pair p of q_l)
    const char* base = reinterpret_cast<const char*>(q < HALF || BF16 ? q_l : q_r);
    return base + ((BF16 ? q / 2 : q % HALF) * 128 + tid) * 16;
  };
  if (G == 0) {
    // every warp's last Q K^T is complete, so the peer may overwrite this split's q (release: after those reads)
    asm volatile("bar.sync 12, 128;" ::: "memory");
    if (tid == 0) {
      asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];"
                   ::"r"(djax_peer(&may_send, peer)) : "memory");
    }
    if (lane % 4 == 0) {
      asm volatile(
          "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];"
          ::"r"(djax_peer(ml_peer + 4 * (8 * w + lane / 4), peer)), "f"(m[0]), "f"(m[1]), "f"(l[0]),
          "f"(l[1]), "r"(djax_peer(&recv_bar, peer)) : "memory");
    }
  }
  if (G != rank) {  // the peer stores these columns
    may_send.wait(0);
    const uint32_t bar = djax_peer(&recv_bar, peer);
#pragma unroll
    for (int q = 0; q < NQ; q += BF16 ? 2 : 1) {
      if (BF16) {
        const float* a = acc + 4 * q;
        asm volatile(
            "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];"
            ::"r"(djax_peer(slot(q), peer)), "r"(djax_bf16x2(a[0], a[1])), "r"(djax_bf16x2(a[2], a[3])),
            "r"(djax_bf16x2(a[4], a[5])), "r"(djax_bf16x2(a[6], a[7])), "r"(bar) : "memory");
      } else {
        asm volatile(
            "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];"
            ::"r"(djax_peer(slot(q), peer)), "f"(acc[4 * q]), "f"(acc[4 * q + 1]), "f"(acc[4 * q + 2]),
            "f"(acc[4 * q + 3]), "r"(bar) : "memory");
      }
    }
    if (tid == 0) done_bar.wait(0);  // keep this CTA until the peer has every byte
    return;
  }
  // this split's max and denominator of heads r0 and r0 + 8: registers in the softmax warpgroup, shared
  // copies (by head) in the other
  const float m0 = G == 0 ? m[0] : m[r0], m1 = G == 0 ? m[1] : m[r0 + 8];
  const float l0 = G == 0 ? l[0] : l[r0], l1 = G == 0 ? l[1] : l[r0 + 8];
  recv_bar.wait(0);
  if (tid == 0) {
    asm volatile("mbarrier.arrive.relaxed.cluster.shared::cluster.b64 _, [%0];"
                 ::"r"(djax_peer(&done_bar, peer)) : "memory");
  }
  const float4 pm = reinterpret_cast<const float4*>(ml_peer)[8 * w + lane / 4];
  uint32_t crank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(crank));
  // each split's weight per head; a launch without the cluster (rank != split) stores NaN, not a wrong answer
  float own[2], other[2];
  const float mo[2] = {m0, m1}, lo[2] = {l0, l1}, mp[2] = {pm.x, pm.y}, lp[2] = {pm.z, pm.w};
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float top = fmaxf(mo[h], mp[h]), a = exp2f(mo[h] - top), b = exp2f(mp[h] - top);
    const float inv = crank == (uint32_t)rank ? 1.f / (lo[h] * a + lp[h] * b) : __int_as_float(0x7fc00000);
    own[h] = a * inv;
    other[h] = b * inv;
  }
  djax_stage_store<NQ, K>(out + out_at + G * KH, acc, [&](int q) {
    if (BF16) {  // this quad's half of the pair
      const uint2 pair = reinterpret_cast<const uint2*>(slot(q))[q % 2];
      const bfloat16_t* h = reinterpret_cast<const bfloat16_t*>(&pair);
      return make_float4(float(h[0]), float(h[1]), float(h[2]), float(h[3]));
    }
    return *reinterpret_cast<const float4*>(slot(q));
  }, own, other, static_cast<char*>(stage), 12 + G, tid);
}
"""


# The pair program's exchanges (`Tiling.dim_pair`), as CUDA put into the lowered source ahead of the kernel.
# `djax_pair_send` / `djax_pair_add`: a consumer warpgroup's NF partial scores a thread (TileLang's fragment,
# the same layout in both CTAs of the pair) go to exchange buffer x (= 2 warpgroup + use parity) of the peer,
# float4 j of thread t at (x NF/4 + j) 128 + t (a warp's 32 lanes: 512 contiguous bytes), completing bytes on
# the peer's barrier x; the receiver adds them in place. `djax_pair_end`: the accumulator's register i of lane
# l in warp w holds head 16 w + 8 ((i & 3) >> 1) + l / 4, column 8 (i >> 2) + 2 (l & 3) + (i & 1) of the CTA's
# KH (checked by a CPU test against TileLang's own indexing); warpgroup G stores the columns of quads
# [G NQ/2, (G + 1) NQ/2) after taking the other warpgroup's values for them through the finished key ring
# (`swap`: same thread, same positions) and both running maxes and denominators through `ml`:
# out = (acc_0 e^{m_0 - M} + acc_1 e^{m_1 - M}) / (l_0 e^{m_0 - M} + l_1 e^{m_1 - M}), M = max(m_0, m_1),
# in base 2.
_PAIR = r"""
template <int NF>
__device__ __forceinline__ void djax_pair_send(const float* s, void* xs, Barrier& bar, int x, int peer, int tid) {
  const float4* base = reinterpret_cast<const float4*>(xs) + x * (NF / 4) * 128 + tid;
  const uint32_t b = djax_peer(&bar, peer);
#pragma unroll
  for (int j = 0; j < NF / 4; ++j) {
    asm volatile(
        "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];"
        ::"r"(djax_peer(base + j * 128, peer)), "f"(s[4 * j]), "f"(s[4 * j + 1]), "f"(s[4 * j + 2]),
        "f"(s[4 * j + 3]), "r"(b) : "memory");
  }
}

template <int NF>
__device__ __forceinline__ void djax_pair_add(float* s, const void* xs, int x, int tid) {
  const float4* base = reinterpret_cast<const float4*>(xs) + x * (NF / 4) * 128 + tid;
#pragma unroll
  for (int j = 0; j < NF / 4; ++j) {
    const float4 v = base[j * 128];
    s[4 * j] += v.x; s[4 * j + 1] += v.y; s[4 * j + 2] += v.z; s[4 * j + 3] += v.w;
  }
}

template <int KH, int K, int G>
__device__ __forceinline__ void djax_pair_end(const bfloat16_t* out_ro, int out_at, const float* acc, const float* m,
                                              const float* l, void* swap, void* ml_raw, void* stage, int tid) {
  // TileLang declares the output const: this function is the only writer it does not see
  bfloat16_t* out = const_cast<bfloat16_t*>(out_ro);
  float* ml = static_cast<float*>(ml_raw);  // 4 x 64 floats: each warpgroup's max and denominator per head
  constexpr int H = 64, NQ = KH / 8, HALF = NQ / 2;
  const int w = tid / 32, lane = tid % 32, r0 = 16 * w + lane / 4;
  float4* x = reinterpret_cast<float4*>(swap);
  // both warpgroups past their loops: the key ring (`swap`) is free and no scores land in `stage` any more
  asm volatile("bar.sync 14, 256;" ::: "memory");
  if (lane % 4 == 0) {
    ml[G * 2 * H + r0] = m[0];
    ml[G * 2 * H + r0 + 8] = m[1];
    ml[G * 2 * H + H + r0] = l[0];
    ml[G * 2 * H + H + r0 + 8] = l[1];
  }
#pragma unroll
  for (int j = 0; j < HALF; ++j) {  // the other warpgroup's columns, from this one's registers
    const int q = (1 - G) * HALF + j;
    x[(G * HALF + j) * 128 + tid] = make_float4(acc[4 * q], acc[4 * q + 1], acc[4 * q + 2], acc[4 * q + 3]);
  }
  asm volatile("bar.sync 14, 256;" ::: "memory");
  float own[2], other[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int head = r0 + 8 * h;
    const float mo = m[h], lo = l[h], mp = ml[(1 - G) * 2 * H + head], lp = ml[(1 - G) * 2 * H + H + head];
    const float top = fmaxf(mo, mp), a = exp2f(mo - top), b = exp2f(mp - top);
    const float inv = 1.f / (lo * a + lp * b);  // > 0: warpgroup 0's denominator counts the sink
    own[h] = a * inv;
    other[h] = b * inv;
  }
  // bf16 rows of this warpgroup's KH / 2 columns, staged in its half of the exchange buffer
  djax_stage_store<HALF, K>(out + out_at + G * (KH / 2), acc + 4 * G * HALF, [&](int j) {
    return x[((1 - G) * HALF + j) * 128 + tid];
  }, own, other, static_cast<char*>(stage) + G * H * KH, 12 + G, tid);
}
"""


def _lowered_on_disk(b: int, h: int, k: int, w: int, c: int, t: int, scale: float, tiling: Tiling):
    """`lower_cuda`, kept on disk beside the cubins: lowering takes 5-15 s per shape and tiling (key: the
    arguments, TileLang's version, this module and the build helpers)."""
    files = (__file__, tilelang_build.__file__)
    return lowered_on_disk("sparse_decode", (b, h, k, w, c, t, scale, tiling), lower_cuda, files)


@functools.cache
def cuda_kernel(b: int, h: int, k: int, w: int, c: int, t: int, scale: float, tiling: Tiling) -> CudaKernel:
    """Lowers, compiles (no GPU needed, cubin cached on disk by source) and describes one static shape."""
    from djax.ffi.cubin import Cubin

    source, launch = _lowered_on_disk(b, h, k, w, c, t, scale, tiling)
    binary = nvcc_cubin(source)
    key = "tl-" + hashlib.sha256(binary).hexdigest()[:24]
    if tiling.tma_q:
        from djax.ffi.tma import TmaKernel

        tk = TmaKernel.from_launch(key, binary, launch)
        return CudaKernel(tk, launch["grid"], launch["params"], source)
    cub = Cubin(key, launch["name"], binary, launch["threads"], launch["shared_bytes"], extra_null=0)
    return CudaKernel(cub, launch["grid"], launch["params"], source)


def default_tiling(b: int, h: int, k: int, w: int, t: int) -> Tiling | None:
    """The tiling `impl="auto"` uses, or None where the kernel does not apply (then Triton runs).

    From the H200 sweeps (benchmarks/results/kernels_h200_attn_q_early.json, _attn_b8_b32_run1/2.json,
    _attn_dsmem.json, attn_tilings_h200_push_ab.json, _dim_pair_ab.json, _p_in_exchange_ab.json): the
    warp-specialised program with 64-key steps, the grid covering the SMs about once. Where that takes two
    CTAs per row, the pair splitting the head dim, for head dims of 256 and more with each block's P in the
    score buffer just read and 4 stages (b64: 22.55-22.72 us in four of five alternating rounds, 23.79 in one,
    against 23.17-23.28 in 3 stages with P of its own), else in 3 stages (b64: 23.04-23.30 us against
    23.47-23.65 for two key splits pushing each other's halves, five alternating rounds; 23.23-23.36 against
    23.50-23.57 in the run before; the push had been 23.73-23.80 us against 23.95-24.11 through distributed
    shared memory, and that 23.8 us against 28.2 through global memory and 30.1 merged after), and for head
    dims the pair does not take (not a multiple of 32) two key splits merged in the kernel through global
    memory.
    Where more than 8 splits would be taken, 8 merged through global memory (b8: 13.3-13.4 us against
    14.0-14.6 for 10 merged after, three runs; 14.7 through distributed shared memory). Clusters of 4 did
    not fit (b32, 4 splits merged 33.2-34.2 us against 21.1-21.5 merged after), so 3 to 8 splits merge
    after. Where the warp-specialised program does not apply, the 8-warp one with the same splits, merged
    after.
    """
    nb = sum(_blocks(w, t, 64))
    ctas = b * max(h // HEADS, 1)
    sms = sm_count()
    nsplit = max(1, min(nb, round(sms / ctas)))
    if nsplit > _MAX_CLUSTER and ctas * _MAX_CLUSTER <= sms:
        candidates = [Tiling(64, 2, 384, _MAX_CLUSTER, merge=True)]
    elif nsplit == 2:
        # P in the score buffers: measured at head dim 512, run on the GPU at 256 and 512 (smaller heads keep
        # P of their own: with their small key stages shared memory does not bound the ring)
        lean = [Tiling(64, 4, 384, 1, dim_pair=True, p_in_exchange=True)] if k >= 256 else []
        candidates = [*lean, Tiling(64, 3, 384, 1, dim_pair=True), Tiling(64, 2, 384, 2, merge=True)]
    else:
        candidates = [Tiling(64, 2, 384, nsplit)]
    for tiling in [*candidates, Tiling(64, 2, 256, nsplit)]:
        try:
            check_shapes(h, k, w, 1, t, tiling)
        except ValueError:
            continue
        return tiling
    return None


def sparse_decode_tilelang(
    q, window, window_valid, pool, topk, sinks, scale: float, tiling: Tiling = Tiling()
):
    """`sparse_decode_ref`'s contract on a CUDA GPU (sm_90a): returns [b, h, k] bf16.

    q [b, h, k] bf16 with h a multiple of 64; window [b, W, k]; window_valid bool[b, W]; pool [b, C, k];
    topk int32[b, T] (negative or >= C: invalid); sinks f32[h]. Window and pool are cast to bf16.
    """
    from djax.ffi import cubin, tma
    from djax.kernels.sparse_attn import kernel_operands, split_results

    if q.dtype != jnp.bfloat16:
        raise ValueError(f"the TileLang sparse decode takes bf16 q, got {q.dtype}")
    # validity as bool (one byte, read as int8 by the kernel): no conversion kernel ahead of the launch
    args = kernel_operands(q, window, window_valid, pool, topk, sinks, valid_dtype=jnp.bool_)
    b, h, k = q.shape
    w, c, t = window.shape[1], pool.shape[1], topk.shape[1]
    check_shapes(h, k, w, c, t, tiling)
    kern = cuda_kernel(b, h, k, w, c, t, float(scale), tiling)

    def launch(results):  # with tma_q through the TMA launcher, which builds q's tensor map per call
        if tiling.tma_q:
            return tma.launch(kern.cubin, args, results)
        return cubin.launch(kern.cubin, kern.grid, args, results)

    if tiling.nsplit == 1:  # one CTA per row, or with dim_pair a cluster of two
        return launch(jax.ShapeDtypeStruct(q.shape, q.dtype))
    if tiling.push:  # nothing but the output leaves the cluster
        return launch([jax.ShapeDtypeStruct(q.shape, q.dtype)])[0]
    if tiling.merge:  # the partials (and log-sum-exps) are scratch: the kernel has merged them into out
        results = [jax.ShapeDtypeStruct(q.shape, q.dtype), *split_results(q.shape, tiling.nsplit)]
        if tiling.dsmem:  # the partials stayed in shared memory
            del results[1]
        return launch(results)[0]
    part, lse = launch(split_results(q.shape, tiling.nsplit))
    return combine_splits(part, lse).astype(q.dtype)
