"""The grouped GEMMs' expert-contiguous layout of the picks (`moe_experts.layout`) as one Triton program.

In jnp the layout is a bincount, two cumulative sums, an argsort, a gather and three scatters: about ten
XLA kernels that each take a few microseconds at decode sizes, where the picks are a handful of rows. One
program does it all: per-expert counts by `tl.histogram`, the padded group starts by `tl.cumsum`, the picks
in stable expert order by sorting (expert, pick) packed into one int32, and the three outputs stored. A
pick's padded row is its sorted position plus the padding of the groups before its expert.

Sized for decode: every pick is one lane of the program (`CAPACITY`), taken up to `MAX_PICKS`. On the H200
(`bench_kernels.py --only moe_fp8`, V4-Flash routing, top-6 of 256): 1.7 / 3.2 / 8.6 us for 1 / 32 / 128
tokens against 13.2 / 14.7 / 18.2 us for XLA's ops, the same output.
"""

from __future__ import annotations

import triton
import triton.language as tl

CAPACITY = 4096  # lanes of the one program: the picks, rounded up to a power of two
# `moe_experts.layout` takes the kernel up to this many picks (at most CAPACITY). One H100, V4-Flash's routing
# under bench_moe's skew, `ab_moe_layout.py` (moe_layout_h100_ab.json, three alternating rounds, device us):
# 192 picks 3.4-6.3 against XLA's 14.3-14.4, 768 picks 8.8-12.2 against 17.3-17.4, 1,020 picks 9.1-12.4 against
# 18.4-18.6 (16- to 128-row groups); past 1,024 lanes the sort costs more than XLA's ops: 1,536 picks 26.6-30.5
# against 23.0-23.2, 2,046 picks 26.9 against 25.6; at 3,072 the kernel took 106.7-109.4 us inside the MoE
# layer (moe_fp8_prefill_h100_markstein_small_ab.json, 512 tokens).
MAX_PICKS = 1024
INIT = tl.constexpr(1024)  # padded rows set to -1 per step before the picks' rows are written


@triton.jit
def layout_kernel(
    idx_ptr,  # int32[P]: expert per pick (token-major)
    rows_ptr,  # int32[M_PAD]: token of each padded row, -1 for padding
    mind_ptr,  # int32[M_PAD]: expert of each padded row, -1 for padding
    pos_ptr,  # int32[P]: padded row of each pick, -1 for a dropped one
    P: tl.constexpr,
    K: tl.constexpr,
    E: tl.constexpr,
    BLOCK_M: tl.constexpr,
    M_PAD: tl.constexpr,
    PB: tl.constexpr,  # next power of two >= P
    EB: tl.constexpr,  # next power of two > E: bin E counts the dropped picks and the idle lanes
):
    for r0 in range(0, M_PAD, INIT):
        r = r0 + tl.arange(0, INIT)
        none = tl.full([INIT], -1, tl.int32)
        tl.store(rows_ptr + r, none, mask=r < M_PAD)
        tl.store(mind_ptr + r, none, mask=r < M_PAD)
    tl.debug_barrier()  # the padding's -1 lands before any pick's row overwrites it
    i = tl.arange(0, PB)
    ex = tl.load(idx_ptr + i, mask=i < P, other=E)
    key = tl.where((ex >= 0) & (ex < E), ex, E)  # ids outside [0, E) are dropped
    e = tl.arange(0, EB)
    sizes = tl.where(e < E, tl.histogram(key, EB), 0)
    pad = (sizes + BLOCK_M - 1) // BLOCK_M * BLOCK_M - sizes
    shift = tl.cumsum(pad, 0) - pad  # padding rows ahead of each expert's group
    packed = tl.sort(key * PB + i)  # stable by construction: ties in expert keep pick order
    sk = packed // PB
    pick = packed % PB
    live = sk < E
    dest = i + tl.gather(shift, sk, 0)  # sorted position i, past the padding of the groups before
    tl.store(rows_ptr + dest, pick // K, mask=live)
    tl.store(mind_ptr + dest, sk, mask=live)
    tl.store(pos_ptr + pick, tl.where(live, dest, -1), mask=pick < P)


def constexprs(n_picks: int, k: int, num_experts: int, block_m: int, m_pad: int) -> dict:
    if n_picks > CAPACITY:
        raise ValueError(f"the layout kernel takes at most {CAPACITY} picks, got {n_picks}")
    return dict(
        P=n_picks,
        K=k,
        E=num_experts,
        BLOCK_M=block_m,
        M_PAD=m_pad,
        PB=triton.next_power_of_2(max(n_picks, 2)),
        EB=triton.next_power_of_2(num_experts + 1),
    )


def launch_torch(idx, num_experts: int, block_m: int, m_pad: int):
    """Runs the kernel on a torch int32[n, k] (GPU, or CPU under TRITON_INTERPRET=1): (rows, m_indices, pos)."""
    import torch

    n, k = idx.shape
    rows = torch.empty(m_pad, dtype=torch.int32, device=idx.device)
    mind = torch.empty_like(rows)
    pos = torch.empty(n * k, dtype=torch.int32, device=idx.device)
    cx = constexprs(n * k, k, num_experts, block_m, m_pad)
    layout_kernel[(1,)](idx.to(torch.int32).contiguous().view(-1), rows, mind, pos, **cx, num_warps=4)
    return rows, mind, pos
