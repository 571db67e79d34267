"""FP8 block-scaled GEMM for prefill as a persistent kernel whose tile epilogue overlaps the next tile.

At 4096^3 the 128x256 "ws" kernel (TileLang's own warp specialisation, one tile per CTA) spends about 4.6 us
of every tile on work that does not depend on k: a fit of its times at k 4096 and 7168 (same 512 tiles) gives
0.77 us per k block and 4.6 us per tile, 16% of the tile at k 4096 (NOTES.md). In that time the CTA starts,
waits for its first stage, drains its last wgmmas and stores its bf16 tile (TMA, then a wait until the store
has read shared memory, then exit), with the tensor cores of its SM idle.

Here one CTA per SM walks its tiles (c, c + CTAs, ...; `persistent_tiles`), with the warp specialisation
written out:
- producer warpgroup (threads 256-383): per k block, TMA loads of the tile's two 64-row halves of A and two
  128-row slices of B into a `stages`-deep ring whose step count runs on across tiles, so the next tile's
  first k blocks load while the consumers finish this one;
- consumer warpgroup c (threads 128c .. 128c + 127): rows 64c .. 64c + 63 of the tile, its 256 columns as two
  128-column wgmma chains per k block with DeepGEMM's promotion, the scales loaded a k block ahead (as the
  "ws" default); the bf16 tile goes out of a staging buffer of its own by TMA.

`async_store`: the store is not waited for where it is issued: the wait (the elected thread's bulk group; the
warpgroup's barrier after it) moves to just before the next tile's bf16 tile is written into the same
staging buffer, and once more before the CTA exits, so the store drains under the next tile's k loop
(`with_async_store`, a change to the lowered source: TileLang waits right after every TMA store).

An earlier persistent form (commit 8042f17) tied the default at 4096^3: it waited for every store, and its
consumers multiplied each k block's scales before issuing the block's wgmmas, which then waited for the loads.
"""

from djax.kernels.dispatch import H200_SMS

BLOCK = 128


def persistent_tiles(m: int, n: int) -> tuple[int, int, int]:
    """(tiles, CTAs, tiles per CTA at most): 128x256 output tiles, one CTA per SM (fewer when there are fewer
    tiles); CTA c takes tiles c, c + CTAs, c + 2 CTAs, ..."""
    tiles = -(-m // 128) * (n // 256)
    ctas = min(tiles, H200_SMS)
    return tiles, ctas, -(-tiles // ctas)


def persistent_program(m: int, n: int, k: int, tiling):
    """The TileLang program (operands as `fp8_gemm_tilelang.cuda_program`'s) for a `WsTiling` of 128x256 tiles
    with `persistent` set; `panel` > 0 visits the tiles in groups of that many tile rows, row fastest, so the
    CTAs in flight share A's rows and B's columns in L2."""
    import tilelang.language as T

    from djax.kernels.fp8_gemm_tilelang import operand_types

    kb = k // BLOCK
    ns = tiling.stages
    tiles_m, tiles_n = -(-m // 128), n // 256
    tiles, ctas, per_cta = persistent_tiles(m, n)
    panel = min(tiling.panel or tiles_m, tiles_m)
    group = panel * tiles_n  # tiles per group of `panel` tile rows
    fp8, f32 = "float8_e4m3fn", "float32"

    def tile_of(t):
        """(tile row, tile column) of the t-th tile in visiting order."""
        first = (t // group) * panel
        rows = T.min(tiles_m - first, panel)
        return first + (t % group) % rows, (t % group) // rows

    @T.macro
    def produce(A, B, a0, a1, b0, b1, fa, ea, f0, e0, f1, e1, bx):
        for it in T.serial(per_cta):
            if bx + it * ctas < tiles:
                tm, tn = tile_of(bx + it * ctas)
                for j in T.serial(kb):
                    g = it * kb + j  # the ring's step count runs on across tiles
                    st, phase = g % ns, ((g // ns) & 1) ^ 1
                    k0, m0, n0 = j * BLOCK, tm * 128, tn * 256
                    T.barrier_wait(ea[st], phase)
                    T.tma_copy(A[m0 : m0 + 64, k0 : k0 + BLOCK], a0[st, :, :], barrier=fa[st])
                    T.tma_copy(A[m0 + 64 : m0 + 128, k0 : k0 + BLOCK], a1[st, :, :], barrier=fa[st])
                    T.barrier_arrive(fa[st])
                    T.barrier_wait(e0[st], phase)
                    T.tma_copy(B[n0 : n0 + 128, k0 : k0 + BLOCK], b0[st, :, :], barrier=f0[st])
                    T.barrier_arrive(f0[st])
                    T.barrier_wait(e1[st], phase)
                    T.tma_copy(B[n0 + 128 : n0 + 256, k0 : k0 + BLOCK], b1[st, :, :], barrier=f1[st])
                    T.barrier_arrive(f1[st])

    @T.macro
    def load_scales(AS, BS, sa, sb0, sb1, tm, tn, row0, j):
        """k block j's scales as loaded: the rows' activation scales, the two weight-scale blocks' (the same
        in every entry); rows past m read as 0."""
        for r in T.Parallel(64):
            sa[r] = AS[tm * 128 + row0 + r, j]
        for r in T.Parallel(64):
            sb0[r] = BS[tn * 2, j]
        for r in T.Parallel(64):
            sb1[r] = BS[tn * 2 + 1, j]

    @T.macro
    def consume(AS, BS, C, a_s, b0, b1, bars, c_w, bx, row0, regs):
        fa, ea, f0, e0, f1, e1 = bars
        part, acc0, acc1, sa, sb0, sb1, s0, s1 = regs
        for it in T.serial(per_cta):
            if bx + it * ctas < tiles:
                tm, tn = tile_of(bx + it * ctas)
                T.clear(acc0)
                T.clear(acc1)
                load_scales(AS, BS, sa, sb0, sb1, tm, tn, row0, 0)
                for j in T.serial(kb):
                    g = it * kb + j
                    st, phase = g % ns, (g // ns) & 1
                    # this block's scales came in during the last one; the next block's load under this one
                    for r in T.Parallel(64):
                        s0[r] = sa[r] * sb0[r]
                    for r in T.Parallel(64):
                        s1[r] = sa[r] * sb1[r]
                    load_scales(AS, BS, sa, sb0, sb1, tm, tn, row0, T.min(j + 1, kb - 1))
                    T.barrier_wait(fa[st], phase)
                    T.barrier_wait(f0[st], phase)
                    T.gemm(a_s[st, :, :], b0[st, :, :], part, transpose_B=True, clear_accum=True)
                    T.barrier_arrive(e0[st])  # B's first slice is free once its wgmma chain is done
                    for r, c in T.Parallel(64, BLOCK):
                        acc0[r, c] += part[r, c] * s0[r]
                    T.barrier_wait(f1[st], phase)
                    T.gemm(a_s[st, :, :], b1[st, :, :], part, transpose_B=True, clear_accum=True)
                    T.barrier_arrive(ea[st])
                    T.barrier_arrive(e1[st])
                    for r, c in T.Parallel(64, BLOCK):
                        acc1[r, c] += part[r, c] * s1[r]
                T.copy(acc0, c_w[:, 0:BLOCK])
                T.copy(acc1, c_w[:, BLOCK : 2 * BLOCK])
                T.copy(c_w, C[tm * 128 + row0, tn * 256])

    A_t, AS_t, B_t, BS_t, C_t = operand_types(T, m, n, k)

    @T.prim_func
    def fp8_gemm(A: A_t, AS: AS_t, B: B_t, BS: BS_t, C: C_t):
        with T.Kernel(ctas, threads=384) as bx:
            a0 = T.alloc_shared((ns, 64, BLOCK), fp8)
            a1 = T.alloc_shared((ns, 64, BLOCK), fp8)
            b0 = T.alloc_shared((ns, BLOCK, BLOCK), fp8)
            b1 = T.alloc_shared((ns, BLOCK, BLOCK), fp8)
            c0 = T.alloc_shared((64, 2 * BLOCK), "bfloat16")
            c1 = T.alloc_shared((64, 2 * BLOCK), "bfloat16")
            # full: the producer's 128 threads arrive after one of them set the bytes to expect; empty: the
            # consumers' 256 threads (A and B's second slice after both chains, B's first after the first)
            fa, f0, f1 = (T.alloc_barrier([128] * ns) for _ in range(3))
            ea, e0, e1 = (T.alloc_barrier([256] * ns) for _ in range(3))
            bars = (fa, ea, f0, e0, f1, e1)
            # one set of registers per consumer warpgroup (each is laid out for its own 128 threads)
            regs0 = tuple(T.alloc_fragment((64, BLOCK), f32) for _ in range(3))
            regs0 += tuple(T.alloc_fragment((64,), f32) for _ in range(5))
            regs1 = tuple(T.alloc_fragment((64, BLOCK), f32) for _ in range(3))
            regs1 += tuple(T.alloc_fragment((64,), f32) for _ in range(5))
            tx = T.get_thread_binding()
            if tx >= 256:
                T.set_max_nreg(40, 0)
                produce(A, B, a0, a1, b0, b1, *bars, bx)
            elif tx < 128:
                T.set_max_nreg(232, 1)
                consume(AS, BS, C, a0, b0, b1, bars, c0, bx, 0, regs0)
            else:
                T.set_max_nreg(232, 1)
                consume(AS, BS, C, a1, b0, b1, bars, c1, bx, 64, regs1)

    return fp8_gemm


def _block_end(source: str, at: int) -> int:
    """The index just past the brace that closes the block whose opening brace is the first at or after `at`
    (the lowered source has no braces in strings or comments)."""
    depth, i = 0, source.index("{", at)
    while True:
        if source[i] == "{":
            depth += 1
        elif source[i] == "}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1


def with_async_store(source: str) -> str:
    """The lowered persistent program with each consumer warpgroup's TMA store no longer waited for where it is
    issued. TileLang writes, per tile and warpgroup after the k loop: a barrier of the warpgroup's 128
    threads, the bf16 tile into its staging buffer (with barriers), then one elected thread's TMA store,
    commit and wait. Here that wait moves ahead of the epilogue's first barrier, so the next tile's write into
    the staging buffer waits for the previous store to have read it (the barrier holds the other threads),
    and after the tile loop, so that no store still reads shared memory when the CTA exits. Threads with no
    store outstanding pass the wait at once. With one tile per CTA the source is left as it is."""
    wait = "tl::tma_store_wait<0, true>();"
    consumers = [i for i in range(len(source)) if source.startswith("tl::warpgroup_reg_alloc<", i)]
    if len(consumers) != 2 or source.count(wait) != 2:
        raise NotImplementedError("expected two consumer warpgroups, each with one TMA store wait")
    out = source
    if "for (int it" not in source[consumers[0] :]:
        return source  # one tile per CTA (TileLang dropped the loop): nothing for a store to overlap
    for c in reversed(consumers):  # from the end, so the earlier offsets stay valid
        tiles = out.index("for (int it", c)
        tiles_end = _block_end(out, tiles)
        k_loop_end = _block_end(out, out.index("for (int j", tiles))
        epilogue = out[k_loop_end:tiles_end]
        if epilogue.count(wait) != 1 or "tl::__sync_thread_partial(" not in epilogue:
            raise NotImplementedError("unexpected epilogue in the lowered persistent program")
        epilogue = epilogue.replace(wait, "")
        first = epilogue.index("tl::__sync_thread_partial(")
        epilogue = epilogue[:first] + wait + "\n          " + epilogue[first:]
        out = out[:k_loop_end] + epilogue + "\n      " + wait + out[tiles_end:]
    return out
