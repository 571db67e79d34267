"""FP8 block-scaled GEMM for prefill with each weight tile read from L2 once for two CTAs (TMA multicast).

The 128x256 "ws" kernel moves 48 KB from L2 into each CTA per 128-wide k block (16 KB of A, 32 KB of B) for
8.4 MFLOP of wgmma: at 60% of the FP8 peak that is about 7 TB/s of L2 reads over the 132 SMs, near what the
H200's L2 delivers. Here the two CTAs of a thread-block cluster compute vertically adjacent 128x256 tiles,
which read the same 256 rows of B: the cluster's first CTA loads them once and the TMA unit writes them into
both CTAs' shared memory (multicast), so a CTA takes 32 KB from L2 per k block instead of 48.

Grid: (n / 256) column tiles x tile rows rounded up to a pair, clusters (1, 2, 1). 384 threads a CTA:
- producer warpgroup (threads 256-383): per k block, waits until the stage's buffers are free in both CTAs
  (`empty[s]`, a cluster barrier every consumer warp of the pair arrives on), then loads its own 128 rows of
  A and, in the cluster's first CTA, multicasts the two 128-row slices of B; every CTA expects all 48 KB on
  its own `full[s]`.
- consumer warpgroup c (threads 128c .. 128c + 127): rows 64c .. 64c + 63 of the tile, as the "ws" kernel:
  per k block two 128-column wgmma chains, each followed by DeepGEMM's promotion (partial x activation scale
  x weight scale into an f32 accumulator); lane 0 of each warp then frees the stage in both CTAs. The bf16
  tile goes out through shared memory by TMA.
A cluster barrier after the mbarriers are set up (TileLang's: a peer's multicast and arrivals must find them
ready) and one before the end (no arrival may reach a CTA that has exited) frame the work.
"""

from djax.kernels.tilelang_build import with_cluster

CLUSTER = 2  # CTAs per cluster, stacked along m


def multicast_program(m: int, n: int, k: int, tiling):
    """The TileLang program (operands as `fp8_gemm_tilelang.cuda_program`'s): tiling is a `WsTiling` of
    block 128x256 with `multicast` 2; `panel` > 0 visits the clusters in panels of that many cluster rows."""
    import tilelang.language as T

    from djax.kernels.fp8_gemm_tilelang import BLOCK, operand_types

    kb = k // BLOCK
    ns = max(1, min(tiling.stages, kb))
    tiles_n = n // 256
    pairs = -(-m // 256)  # cluster rows: two 128-row tiles each
    panel = min(tiling.panel or pairs, pairs)
    group = panel * tiles_n  # clusters per panel
    fp8, f32 = "float8_e4m3fn", "float32"

    def cluster_tile(c):
        """(cluster row, tile column) of the c-th cluster in launch order: panels of `panel` cluster rows,
        walked down each column so that clusters in flight share B's columns and A's rows in L2."""
        first = (c // group) * panel
        rows = T.min(pairs - first, panel)
        return first + (c % group) % rows, (c % group) // rows

    @T.macro
    def produce(A, B, a_s, b0, b1, full, empty, m0, n0):
        T.set_max_nreg(40, 0)
        for j in T.serial(kb):
            st, phase = j % ns, ((j // ns) & 1) ^ 1
            k0 = j * BLOCK
            T.mbarrier_wait_parity(empty[st], phase)
            T.tma_copy(A[m0 : m0 + 128, k0 : k0 + BLOCK], a_s[st, :, :], barrier=full[st])
            T.tma_copy(B[n0 : n0 + 128, k0 : k0 + BLOCK], b0[st, :, :], barrier=full[st], cluster_mask=0b11)
            T.tma_copy(
                B[n0 + 128 : n0 + 256, k0 : k0 + BLOCK], b1[st, :, :], barrier=full[st], cluster_mask=0b11
            )
            T.barrier_arrive(full[st])

    @T.macro
    def consume(AS, BS, C, a_s, b0, b1, full, empty, c_w, m0, n0, row0, tx, part, acc0, acc1, s0, s1):
        T.set_max_nreg(232, 1)
        T.clear(acc0)
        T.clear(acc1)
        for j in T.serial(kb):
            st, phase = j % ns, (j // ns) & 1
            # the scales before the wait, so their latency hides under it; rows past m read as 0
            for r in T.Parallel(64):
                s0[r] = AS[m0 + row0 + r, j] * BS[n0 // BLOCK, j]
            for r in T.Parallel(64):
                s1[r] = AS[m0 + row0 + r, j] * BS[n0 // BLOCK + 1, j]
            T.mbarrier_wait_parity(full[st], phase)
            T.gemm(a_s[st, row0 : row0 + 64, :], b0[st, :, :], part, transpose_B=True, clear_accum=True)
            for r, c in T.Parallel(64, BLOCK):
                acc0[r, c] += part[r, c] * s0[r]
            T.gemm(a_s[st, row0 : row0 + 64, :], b1[st, :, :], part, transpose_B=True, clear_accum=True)
            if tx % 32 == 0:  # this warp's wgmmas are done with the stage: free it in both CTAs
                T.mbarrier_arrive(empty[st], 0)
                T.mbarrier_arrive(empty[st], 1)
            for r, c in T.Parallel(64, BLOCK):
                acc1[r, c] += part[r, c] * s1[r]
        T.copy(acc0, c_w[:, 0:BLOCK])
        T.copy(acc1, c_w[:, BLOCK : 2 * BLOCK])
        T.copy(c_w, C[m0 + row0, n0])

    A_t, AS_t, B_t, BS_t, C_t = operand_types(T, m, n, k)

    @T.prim_func
    def fp8_gemm(A: A_t, AS: AS_t, B: B_t, BS: BS_t, C: C_t):
        with T.Kernel(tiles_n, CLUSTER * pairs, threads=384) as (bx, by):
            a_s = T.alloc_shared((ns, 128, BLOCK), fp8)
            b0 = T.alloc_shared((ns, BLOCK, BLOCK), fp8)
            b1 = T.alloc_shared((ns, BLOCK, BLOCK), fp8)
            c0 = T.alloc_shared((64, 2 * BLOCK), "bfloat16")
            c1 = T.alloc_shared((64, 2 * BLOCK), "bfloat16")
            # full: the producer's 128 threads, after one of them set the bytes to expect (A's and B's);
            # empty: lane 0 of the 8 consumer warps of both CTAs
            full = T.alloc_barrier([128] * ns)
            empty = T.alloc_cluster_barrier([8 * CLUSTER] * ns)
            part0, acc00, acc01 = (T.alloc_fragment((64, BLOCK), f32) for _ in range(3))
            part1, acc10, acc11 = (T.alloc_fragment((64, BLOCK), f32) for _ in range(3))
            s00, s01, s10, s11 = (T.alloc_fragment((64,), f32) for _ in range(4))
            rank = T.block_rank_in_cluster()
            row, col = cluster_tile(bx + (by // CLUSTER) * tiles_n)
            m0, n0 = (row * CLUSTER + rank) * 128, col * 256
            tx = T.get_thread_binding()
            # (TileLang itself puts a cluster barrier after setting up a cluster barrier: every CTA's
            # barriers are ready before any multicast or arrival reaches them)
            if tx >= 256:
                produce(A, B, a_s, b0, b1, full, empty, m0, n0)
            elif tx < 128:
                consume(AS, BS, C, a_s, b0, b1, full, empty, c0, m0, n0, 0, tx, part0, acc00, acc01, s00, s01)
            else:
                consume(
                    AS, BS, C, a_s, b0, b1, full, empty, c1, m0, n0, 64, tx, part1, acc10, acc11, s10, s11
                )
            T.cluster_arrive()  # no peer arrives at or writes into this CTA after it exits
            T.cluster_wait()

    return fp8_gemm


def with_cluster_dims(source: str, name: str) -> str:
    """The lowered source with the cluster shape declared on the kernel."""
    return with_cluster(source, name, (1, CLUSTER, 1))
