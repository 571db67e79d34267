"""DeepSeek-V4 sparse decode attention in TileLang's Ascend dialect: AscendC source, for Ascend 950 NPUs.

Contract: `sparse_attn_ref.sparse_decode_ref` (q [b, h, k] bf16, h a multiple of 64). There is no Ascend
hardware or CANN toolchain here: the program is lowered to AscendC source (checked in CI) and has never been
compiled by `bisheng` or run on an NPU.

How it maps onto the Ascend core (one Cube + two Vector units per AI core, persistent over (row, 64 heads)):
- Cube: gathers each block of `block_s` keys row by row from the ring or the pool into L1 (one DMA per
  row, the pool row read from `topk` by the scalar unit) and computes S = Q K^T and P V. The Cube's L1
  GEMM takes only B stored [N, K], so the keys are gathered twice: as K for S and transposed (V^T) for PV.
- Vector (each of the two units owns 32 of the 64 heads): masks S by the slot table, runs the online
  softmax in base 2 (the sink seeds the running max and the denominator), sends P back to L1 for the
  Cube, and keeps the f32 output accumulator in its unified buffer, rescaled block by block.
Masked slots read a clamped row (pool row 0, as the reference does) and get zero weight; unlike the CUDA
kernels they are not zero-filled, so a non-finite value stored in such a row would reach P V, exactly as
in the reference.
"""

from djax.kernels.sparse_attn_tilelang import _LOG2E, HEADS, _blocks  # HEADS: the Cube's M, 64 heads a task
from djax.kernels.tilelang_build import POINTER_ONLY, lower


def check_shapes(h: int, k: int, w: int, c: int, t: int, block_s: int) -> None:
    """Raises ValueError for shapes the Ascend program does not handle."""
    if h % HEADS:
        raise ValueError(f"the Ascend sparse decode needs heads a multiple of {HEADS}, got {h}")
    if k % 16 or block_s % 16:
        raise ValueError(
            f"head dim and block_s must be multiples of 16 (the Cube's fractal), got {k}, {block_s}"
        )
    if min(w, c, t) < 1:
        raise ValueError(f"need W, C, T >= 1, got W={w} C={c} T={t}")


def ascend_program(
    b: int, h: int, k: int, w: int, c: int, t: int, scale: float, block_s: int = 64, cores: int = 32
):
    """The TileLang program for one static shape; parameters q, window, valid (int32), pool, topk, sinks,
    out, as the CUDA kernels take them."""
    check_shapes(h, k, w, c, t, block_s)
    import tilelang.ascend.language as T

    bs, half, groups = block_s, HEADS // 2, h // HEADS
    nbw, nbt = _blocks(w, t, bs)
    qk = float(scale) * _LOG2E
    bf16, f32, i32 = "bfloat16", "float32", "int32"

    @T.prim_func
    def sparse_decode(
        q: T.Tensor((b, h, k), bf16),
        window: T.Tensor((b, w, k), bf16),
        valid: T.Tensor((b, w), i32),
        pool: T.Tensor((b, c, k), bf16),
        topk: T.Tensor((b, t), i32),
        sinks: T.Tensor((h,), f32),
        out: T.Tensor((b, h, k), bf16),
    ):
        with T.Kernel(cores) as core:
            q_l1 = T.alloc_l1((HEADS, k), bf16)
            k_l1 = T.alloc_l1((bs, k), bf16)
            vt_l1 = T.alloc_l1((k, bs), bf16)  # the same keys, transposed: PV's B operand [N, K]
            p_l1 = T.alloc_l1((HEADS, bs), bf16)
            s_l0c = T.alloc_l0c((HEADS, bs), f32)
            o_l0c = T.alloc_l0c((HEADS, k), f32)
            # unified-buffer tiles: each Vector unit holds its half of the heads
            s_ub = T.alloc_shared((half, bs), f32)
            p_ub = T.alloc_shared((half, bs), bf16)
            pv_ub = T.alloc_shared((half, k), f32)
            acc = T.alloc_shared((half, k), f32)
            o_ub = T.alloc_shared((half, k), bf16)
            sink = T.alloc_shared((half,), f32)
            m = T.alloc_shared((half,), f32)
            l = T.alloc_shared((half,), f32)
            alpha = T.alloc_shared((half,), f32)
            valid_ub = T.alloc_shared((w,), i32)
            topk_ub = T.alloc_shared((t,), i32)
            for task in T.Persistent([b * groups], cores, core):
                bx, h0 = task // groups, task % groups * HEADS
                T.copy(q[bx, h0 : h0 + HEADS, 0:k], q_l1)
                T.dual_copy(sinks[h0 : h0 + HEADS], sink)
                T.copy(valid[bx, 0:w], valid_ub)
                T.copy(topk[bx, 0:t], topk_ub)
                with T.SimtVF(threads=half):
                    for i in T.Parallel(half):
                        m[i] = sink[i] * _LOG2E
                        l[i] = 1.0  # the sink's own term: exp2(m - m)
                with T.SimtVF(threads=128):
                    for i, d in T.Parallel(half, k):
                        acc[i, d] = 0.0
                for g in T.serial(nbw + nbt):
                    for r in T.serial(bs):
                        if g < nbw:
                            row = T.max(T.min(g * bs + r, w - 1), 0)
                            T.copy(window[bx, row : row + 1, 0:k], k_l1[r : r + 1, 0:k])
                            T.copy(window[bx, row : row + 1, 0:k], vt_l1[0:k, r : r + 1], transpose=True)
                        else:
                            pick = topk[bx, T.min((g - nbw) * bs + r, t - 1)]
                            row = T.max(T.min(T.if_then_else(pick < c, pick, 0), c - 1), 0)
                            T.copy(pool[bx, row : row + 1, 0:k], k_l1[r : r + 1, 0:k])
                            T.copy(pool[bx, row : row + 1, 0:k], vt_l1[0:k, r : r + 1], transpose=True)
                    T.gemm(q_l1, k_l1, s_l0c, transpose_B=True, clear_accum=True)
                    T.dual_copy(s_l0c, s_ub)
                    with T.SimtVF(threads=half):
                        for i in T.Parallel(half):
                            # one head per thread: mask, new running max, P = exp2(S - m), the denominator
                            m_new = T.alloc_var(f32)
                            total = T.alloc_var(f32)
                            m_new = m[i]
                            for r in T.serial(bs):
                                j = g * bs + r
                                ring_live = (j < w) & (valid_ub[T.min(j, w - 1)] != 0)
                                pick = topk_ub[T.min(T.max(j - nbw * bs, 0), t - 1)]
                                pick_live = (j - nbw * bs < t) & (pick >= 0) & (pick < c)
                                live = T.if_then_else(g < nbw, ring_live, pick_live)
                                s_ub[i, r] = T.if_then_else(live, s_ub[i, r] * qk, -T.infinity(f32))
                                m_new = T.max(m_new, s_ub[i, r])
                            alpha[i] = T.exp2(m[i] - m_new)
                            total = 0.0
                            for r in T.serial(bs):
                                e = T.exp2(s_ub[i, r] - m_new)
                                p_ub[i, r] = T.cast(e, bf16)
                                total = total + e
                            l[i] = l[i] * alpha[i] + total
                            m[i] = m_new
                    T.dual_copy(p_ub, p_l1)
                    T.gemm(p_l1, vt_l1, o_l0c, transpose_B=True, clear_accum=True)
                    T.dual_copy(o_l0c, pv_ub)
                    with T.SimtVF(threads=128):
                        for i, d in T.Parallel(half, k):
                            acc[i, d] = acc[i, d] * alpha[i] + pv_ub[i, d]
                with T.SimtVF(threads=128):
                    for i, d in T.Parallel(half, k):
                        o_ub[i, d] = T.cast(acc[i, d] * (1.0 / l[i]), bf16)  # l >= 1
                T.dual_copy(o_ub, out[bx, h0 : h0 + HEADS, 0:k])

    return sparse_decode


def ascend_source(
    b: int, h: int, k: int, w: int, c: int, t: int, scale: float, block_s: int = 64, cores: int = 32
) -> str:
    """AscendC source of the program (TileLang's "ascend" target; compiling it needs CANN's bisheng)."""
    program = ascend_program(b, h, k, w, c, t, scale, block_s, cores)
    return lower(program, {"kind": "ascend"}, POINTER_ONLY).kernel_source
