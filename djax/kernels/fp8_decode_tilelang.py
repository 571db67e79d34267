"""FP8 block-scaled GEMM for decode (m <= 64) with the k blocks dealt out to several consumer warpgroups.

At decode the weights stream from memory once and each CTA's work is a chain of dependent k blocks (wait for
the block, wgmma, wait for the wgmma, promote into the f32 accumulator); for Triton's unsplit kernel that
chain, not the bytes in flight, set the pace (NOTES.md). Here `k_groups` consumer warpgroups take turns over
the CTA's k blocks (block j goes to warpgroup j mod k_groups), each into its own accumulator, so each chain
is k_groups times shorter; the producer warpgroup keeps one TMA ring in block order for all of them. At the
end the warpgroups sum their accumulators through shared memory. With `split_k` > 1 the splits of a column
tile are one thread-block cluster: each split leaves its sum in shared memory, and after the cluster
barrier every split adds up its share of the rows from all of them (distributed shared memory) and writes
bf16. No partials leave the chip and no second kernel runs.

On the H200 the shorter chains did not make the split kernel's k loop faster (four groups were no better
than two); what pays is the sum in the cluster, which replaces XLA's sum of f32 partials (NOTES.md).

With `push_sum` no cluster barrier follows the k loop: the pulled sum needs a releasing one (its stores to
shared memory must be visible to the peers' loads), and on the H200 that is a GPU-scope MEMBAR before every
arrive and an L1 invalidation after every wait, about 1.2 us at the end of a 10 us kernel. Instead each
split sends its values for the other splits' rows by bulk copy (the async proxy, ordered after the staging
stores by a proxy fence and a barrier of the consumer threads), which completes bytes on the owner's
mbarrier; a relaxed remote arrive back tells the sender that its staged values may go. With `push_regs`
(the default where push_sum is) nothing is staged first: the warps holding another split's rows send their
accumulator registers there by st.async, and the warps holding this split's rows add up a share of them.

TileLang writes the program (`decode_program`); the cluster shape and the cross-split sum are CUDA put into
the lowered source (`with_cluster_sum`), as for the sparse decode's merge: TileLang 0.1.15 has no load from
a peer's shared memory.
"""

from djax.kernels.tilelang_build import PEER_ADDRESS, with_cluster, with_device_code

_CLUSTER_SUM = r"""
template <int SPLIT, int BN, int THREADS>
__device__ __forceinline__ void djax_cluster_sum(const bfloat16_t* out_ro, int m, int n, int col0, const float* xfer,
                                                 int rank, int tid) {
  // TileLang declares the output const: this function is the only writer it does not see
  bfloat16_t* out = const_cast<bfloat16_t*>(out_ro);
  constexpr int ROWS = 64 / SPLIT;      // rows of the tile this split writes
  constexpr int ITEMS = ROWS * BN / 4;  // 4-column groups
  constexpr int ITERS = (ITEMS + THREADS - 1) / THREADS;
  uint32_t base = (uint32_t)__cvta_generic_to_shared(xfer);
  // every split's values first, so that all of this thread's remote loads are in flight at once
  float4 v[ITERS][SPLIT];
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    int i = tid + it * THREADS;
    if (i < ITEMS) {
      int r = rank * ROWS + i / (BN / 4), c = (i % (BN / 4)) * 4;
      uint32_t local = base + (uint32_t)((r * BN + c) * 4);
#pragma unroll
      for (int j = 0; j < SPLIT; ++j) {
        uint32_t remote;
        asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(j));
        asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
                     : "=f"(v[it][j].x), "=f"(v[it][j].y), "=f"(v[it][j].z), "=f"(v[it][j].w) : "r"(remote) : "memory");
      }
    }
  }
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    int i = tid + it * THREADS;
    int r = rank * ROWS + i / (BN / 4), c = (i % (BN / 4)) * 4;
    if (i < ITEMS && r < m) {
      float4 a = v[it][0];
#pragma unroll
      for (int j = 1; j < SPLIT; ++j) {
        a.x += v[it][j].x; a.y += v[it][j].y; a.z += v[it][j].z; a.w += v[it][j].w;
      }
      bfloat16_t o[4] = {bfloat16_t(a.x), bfloat16_t(a.y), bfloat16_t(a.z), bfloat16_t(a.w)};
      *reinterpret_cast<uint2*>(out + (size_t)r * n + col0 + c) = *reinterpret_cast<const uint2*>(o);
    }
  }
}
"""

_PUSH_SUM = r"""
// The pushed sum (`WsTiling.push_sum`), for all 128 KG consumer threads once consumer warpgroup g has staged
// its 64 x BN accumulator at xs + g 64 BN (row-major, 8-column groups XOR-swizzled by (row & 3), as the reads
// here). Split `rank` stores rows [rank R, (rank + 1) R); the other splits' values for them arrive in `recv`,
// KG slots of R x BN per other split s (s in rank order, skipping this one), and complete `recv_bar`
// (expecting them since the kernel's start). `done_bar` counts the other splits that have theirs.
template <int SPLIT, int KG, int BN>
__device__ __forceinline__ int djax_push_slot(int sender, int owner, int g) {
  return ((sender < owner ? sender : sender - 1) * KG + g) * (64 / SPLIT) * BN;
}

template <int SPLIT>
__device__ __forceinline__ void djax_arrive_at_peers(Barrier& bar, int rank) {  // that barrier of every other split
  uint32_t local = (uint32_t)__cvta_generic_to_shared(&bar);
#pragma unroll
  for (int o = 0; o < SPLIT; ++o) {
    if (o != rank) {
      asm volatile("mbarrier.arrive.relaxed.cluster.shared::cluster.b64 _, [%0];" ::"r"(djax_peer(local, o))
                   : "memory");
    }
  }
}

template <int BN>
__device__ __forceinline__ int djax_push_at(int item) {  // where 4-column group `item` of the rows sits
  int rr = item / (BN / 4);
  return rr * BN + (((item % (BN / 4)) * 4) ^ ((rr & 3) << 3));
}

template <int SPLIT, int KG, int BN>
__device__ __forceinline__ void djax_push_sum(const bfloat16_t* out_ro, int m, int n, int col0, const float* xs,
                                              const float* recv, Barrier& recv_bar, Barrier& done_bar, int rank,
                                              int tid) {
  // TileLang declares the output const: this function is the only writer it does not see
  bfloat16_t* out = const_cast<bfloat16_t*>(out_ro);
  constexpr int R = 64 / SPLIT, THREADS = 128 * KG, ITEMS = R * BN / 4, ITERS = (ITEMS + THREADS - 1) / THREADS;
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the staging stores, to the bulk copies
  asm volatile("bar.sync 11, %0;" ::"n"(THREADS) : "memory");
  uint32_t xs_s = (uint32_t)__cvta_generic_to_shared(xs), recv_s = (uint32_t)__cvta_generic_to_shared(recv);
  if (tid == 0) {
    uint32_t bar = (uint32_t)__cvta_generic_to_shared(&recv_bar);
#pragma unroll
    for (int o = 0; o < SPLIT; ++o) {
      if (o == rank) continue;
#pragma unroll
      for (int g = 0; g < KG; ++g) {
        uint32_t src = xs_s + (uint32_t)((g * 64 + o * R) * BN * 4);
        uint32_t dst = recv_s + (uint32_t)(djax_push_slot<SPLIT, KG, BN>(rank, o, g) * 4);
        asm volatile(
            "cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
            ::"r"(djax_peer(dst, o)), "r"(src), "n"(R * BN * 4), "r"(djax_peer(bar, o)) : "memory");
      }
    }
  }
  float4 v[ITERS][SPLIT * KG];  // every value of a thread's items loaded before any is added
  // this split's own values first: they are in its shared memory already
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    int i = tid + it * THREADS;
    if (i < ITEMS) {
#pragma unroll
      for (int g = 0; g < KG; ++g) {
        v[it][g] = *reinterpret_cast<const float4*>(xs + g * 64 * BN + rank * R * BN + djax_push_at<BN>(i));
      }
    }
  }
  recv_bar.wait(0);
  // this split's bytes have all landed, so its copies out of the other splits' `xs` are done: tell them now,
  // while this split adds and stores
  if (tid == 0) djax_arrive_at_peers<SPLIT>(done_bar, rank);
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    int i = tid + it * THREADS;
    if (i < ITEMS) {
      int at = djax_push_at<BN>(i);
#pragma unroll
      for (int j = KG; j < SPLIT * KG; ++j) {  // the received slots, in their order
        v[it][j] = *reinterpret_cast<const float4*>(recv + (j - KG) * R * BN + at);
      }
    }
  }
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    int i = tid + it * THREADS;
    int r = rank * R + i / (BN / 4), c = (i % (BN / 4)) * 4;
    if (i < ITEMS && r < m) {
      float4 a = v[it][0];
#pragma unroll
      for (int j = 1; j < SPLIT * KG; ++j) {
        a.x += v[it][j].x; a.y += v[it][j].y; a.z += v[it][j].z; a.w += v[it][j].w;
      }
      bfloat16_t o[4] = {bfloat16_t(a.x), bfloat16_t(a.y), bfloat16_t(a.z), bfloat16_t(a.w)};
      *reinterpret_cast<uint2*>(out + (size_t)r * n + col0 + c) = *reinterpret_cast<const uint2*>(o);
    }
  }
  // keep this CTA (its `xs`) until every other split has its bytes
  if (tid == 0) done_bar.wait(0);
}
"""


_PUSH_REGS = r"""
// The pushed sum straight from the accumulator registers (`WsTiling.push_regs`), called by every consumer
// thread right after its k loop, with `acc` its NREG = BN / 2 accumulator registers in wgmma's layout (warp w
// of a warpgroup holds rows 16 w .. 16 w + 15; register i of lane l: row 16 w + l / 4 + 8 ((i / 2) % 2),
// column 8 (i / 4) + 2 (l % 4) + i % 2). Warps whose rows another split stores send all their registers there
// by st.async (from registers into the owner's `recv`, completing bytes on its `recv_bar`). Warps of this
// split's rows sum: group g takes register quads [g Q, (g + 1) Q), Q = NREG / 4 / KG, and stages the other
// groups' quads in its slot of `loc`. Every buffer is laid out [quad][warp of the rows][lane] x float4, so
// each thread reads and writes 16 contiguous bytes beside its lane's (no bank conflicts) and reads back
// exactly the registers of its own (row, column) positions. No staging of the whole tile, no proxy fence,
// no bulk copy.
template <int SPLIT, int KG, int BN, int G>
__device__ __forceinline__ void djax_push_regs(const bfloat16_t* out_ro, int m, int n, int col0,
                                               const float* acc, const float* recv, const float* loc_ro,
                                               Barrier& recv_bar, Barrier& done_bar, int rank, int tid) {
  // TileLang declares the output const: this function is the only writer it does not see
  bfloat16_t* out = const_cast<bfloat16_t*>(out_ro);
  float* loc = const_cast<float*>(loc_ro);
  constexpr int R = 64 / SPLIT, WR = R / 16, NQ = BN / 8, Q = NQ / KG, SLOT = R * BN;
  static_assert(R % 16 == 0 && NQ % KG == 0, "a split's rows are whole warps, a group's share whole quads");
  constexpr int g = G;  // the caller's consumer warpgroup, known when compiling: `acc` stays in registers
  const int w = (tid % 128) / 32, lane = tid % 32, owner = w / WR, wl = w % WR;
  auto at = [&](int q) { return ((q * WR + wl) * 32 + lane) * 4; };  // quad q's float offset in a slot
  if (owner != rank) {
    uint32_t bar = djax_peer((uint32_t)__cvta_generic_to_shared(&recv_bar), owner);
    const float* slot = recv + djax_push_slot<SPLIT, KG, BN>(rank, owner, g);
    uint32_t dst = djax_peer((uint32_t)__cvta_generic_to_shared(slot), owner);
#pragma unroll
    for (int q = 0; q < NQ; ++q) {
      asm volatile(
          "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];"
          ::"r"(dst + (uint32_t)(at(q) * 4)), "f"(acc[4 * q]), "f"(acc[4 * q + 1]), "f"(acc[4 * q + 2]),
          "f"(acc[4 * q + 3]), "r"(bar) : "memory");
    }
    // keep this CTA until the owners have every byte (their arrives on `done_bar` below)
    if (g == 0 && wl == 0 && lane == 0) done_bar.wait(0);
    return;
  }
#pragma unroll
  for (int q = 0; q < NQ; ++q) {  // the other groups' quads, for them
    if (q / Q != g) {
      *reinterpret_cast<float4*>(loc + g * SLOT + at(q)) = *reinterpret_cast<const float4*>(acc + 4 * q);
    }
  }
  // every group's staging of this split's rows
  asm volatile("bar.sync 11, %0;" ::"n"(KG * WR * 32) : "memory");
  float4 v[Q][SPLIT * KG - 1];  // every value loaded before any is added
#pragma unroll
  for (int j = 0; j < Q; ++j) {
    int q = g * Q + j;
#pragma unroll
    for (int h = 0, e = 0; h < KG; ++h) {
      if (h != g) v[j][e++] = *reinterpret_cast<const float4*>(loc + h * SLOT + at(q));
    }
  }
  recv_bar.wait(0);
  // every other split's bytes have landed here: tell them they may exit
  if (g == 0 && wl == 0 && lane == 0) djax_arrive_at_peers<SPLIT>(done_bar, rank);
#pragma unroll
  for (int j = 0; j < Q; ++j) {
    int q = g * Q + j;
#pragma unroll
    for (int s = 0; s < (SPLIT - 1) * KG; ++s) {
      v[j][KG - 1 + s] = *reinterpret_cast<const float4*>(recv + s * SLOT + at(q));
    }
  }
  const int r0 = 16 * w + lane / 4;
#pragma unroll
  for (int j = 0; j < Q; ++j) {
    int q = g * Q + j;
    float4 a = *reinterpret_cast<const float4*>(acc + 4 * q);
#pragma unroll
    for (int e = 0; e < SPLIT * KG - 1; ++e) {
      a.x += v[j][e].x; a.y += v[j][e].y; a.z += v[j][e].z; a.w += v[j][e].w;
    }
    int c = col0 + 8 * q + 2 * (lane % 4);
    if (r0 < m) {
      bfloat16_t o[2] = {bfloat16_t(a.x), bfloat16_t(a.y)};
      *reinterpret_cast<uint32_t*>(out + (size_t)r0 * n + c) = *reinterpret_cast<const uint32_t*>(o);
    }
    if (r0 + 8 < m) {
      bfloat16_t o[2] = {bfloat16_t(a.z), bfloat16_t(a.w)};
      *reinterpret_cast<uint32_t*>(out + (size_t)(r0 + 8) * n + c) = *reinterpret_cast<const uint32_t*>(o);
    }
  }
}
"""


def consumer_registers(k_groups: int) -> int:
    """Registers a consumer thread may take (setmaxnreg) once the producer is down to 40. ptxas gives every
    thread of a kernel with setmaxnreg the launch bound's share of the 64K (a multiple of 8), and an increase
    past what the producer freed would wait forever."""
    threads = 128 * (k_groups + 1)
    launched = 65536 // threads // 8 * 8
    return min(240, (launched * threads - 40 * 128) // (128 * k_groups) // 8 * 8)


def decode_program(m: int, n: int, k: int, tiling):
    """The TileLang program: out bf16[m, n] = a fp8[m, k] . b fp8[n, k]^T with DeepGEMM's scales (a_scale
    f32[m, k/128] per row and k block, b_scale f32[n/128, k/128] per 128x128 block), m <= 64.

    Grid (n / block_n, 1, split_k), 128 (k_groups + 1) threads:
    - producer warpgroup (the last 128 threads): per k block of the split, TMA loads of A's m rows (the
      shared rows past m are never written; their results are not stored) and B's block_n rows into a
      `stages`-deep ring; `full[s]` completes when the bytes land, `empty[s]` when the warpgroup that took
      the block is done with it.
    - consumer warpgroup g: k blocks g, g + k_groups, ... of the split, each one wgmma chain (64 x block_n
      x 128) and its promotion (x activation scale x weight scale) into its own accumulator; then groups
      1.. write theirs to shared memory and group 0 adds them up.
    - with split_k > 1, group 0 writes the split's sum to `xfer`, every thread of the cluster meets at the
      cluster barrier, the consumer warpgroups of split z sum rows [64 z / split_k, 64 (z + 1) / split_k)
      over all splits (`djax_cluster_sum`, every remote load of a thread in flight at once) and write bf16;
      a second cluster barrier (relaxed: no wait for those stores) keeps every split's shared memory alive
      until the others have read it."""
    import tilelang.language as T

    from djax.kernels.fp8_gemm_tilelang import BLOCK, operand_types

    bn, ns, split, kg = tiling.block_n, tiling.stages, tiling.split_k, tiling.k_groups
    kb = k // BLOCK
    kps = kb // split  # k blocks per split
    turns = -(-kps // kg)  # k blocks per consumer warpgroup, at most
    producer = 128 * kg  # first thread of the producer warpgroup
    fp8, f32 = "float8_e4m3fn", "float32"
    consumer_regs = consumer_registers(kg)
    push = tiling.push_sum
    rows = 64 // split  # rows of the tile each split stores
    a_rows = min(64, m)  # rows in A's TMA box: only those A has (see WsTiling)
    keep, drop = ("evict_last", "evict_first") if tiling.cache_hints else (None, None)

    @T.macro
    def produce(A, B, a_s, b_s, full, empty, bx, bz):
        for j in T.serial(kps):
            st = j % ns
            T.barrier_wait(empty[st], ((j // ns) & 1) ^ 1)
            k0 = (bz * kps + j) * BLOCK
            T.tma_copy(
                A[0:a_rows, k0 : k0 + BLOCK], a_s[st, 0:a_rows, :], barrier=full[st], eviction_policy=keep
            )
            T.tma_copy(
                B[bx * bn : bx * bn + bn, k0 : k0 + BLOCK],
                b_s[st, :, :],
                barrier=full[st],
                eviction_policy=drop,
            )
            T.barrier_arrive(full[st])

    @T.macro
    def consume(AS, BS, a_s, b_s, sa, sb, full, empty, bx, bz, g, part, acc, scale):
        # this group's scales, all loaded at once into shared memory (one round trip, not one per k block);
        # rows past m read as 0, turns past the split's last block repeat its scales (never used)
        for i, r in T.Parallel(turns, 64):
            sa[g, i, r] = AS[r, bz * kps + T.min(i * kg + g, kps - 1)]
        for i in T.Parallel(turns):
            sb[g, i] = BS[bx * bn // BLOCK, bz * kps + T.min(i * kg + g, kps - 1)]
        T.clear(acc)
        for i in T.serial(turns):
            j = i * kg + g
            if j < kps:
                st = j % ns
                for r in T.Parallel(64):
                    scale[r] = sa[g, i, r] * sb[g, i]
                T.barrier_wait(full[st], (j // ns) & 1)
                T.gemm(a_s[st, :, :], b_s[st, :, :], part, transpose_B=True, clear_accum=True)
                T.barrier_arrive(empty[st])
                for r, c in T.Parallel(64, bn):
                    acc[r, c] += part[r, c] * scale[r]

    @T.macro
    def push_end(C, sums, xfer, bars, bx, bz, tx, g, acc):
        """Consumer warpgroup g's end with the pushed sum: its accumulator staged in `sums` (every group's,
        in turn; `xfer` receives the other splits' values, completing bars[0]; bars[1] counts the other
        splits done with this one's), then `djax_push_sum` with every consumer thread; with push_regs nothing
        is staged first and `djax_push_regs` takes the accumulator itself (`sums` holds only the split's rows
        there). The split is blockIdx.z (the cluster spans z), not the cluster-rank register, which TileLang
        reads at every use."""
        if tiling.push_regs:
            fn = f"djax_push_regs<{split}, {kg}, {bn}, {g}>"
            values = (acc.data, T.address_of(xfer[0]), T.address_of(sums[0]))
        else:
            for r, c in T.Parallel(64, bn):
                sums[g * 64 * bn + r * bn + T.bitwise_xor(c, (r & 3) * 8)] = acc[r, c]
            fn = f"djax_push_sum<{split}, {kg}, {bn}>"
            values = (T.address_of(sums[0]), T.address_of(xfer[0]))
        # both take the output first and the barriers, split and thread last
        T.call_extern("handle", fn, C.data, m, n, bx * bn, *values, bars[0], bars[1], bz, tx)

    @T.macro
    def consumer(
        AS, BS, C, a_s, b_s, sa, sb, sums, xfer, full, empty, summed, bx, bz, tx, g, part, acc, scale
    ):
        """Consumer warpgroup g: its k blocks, then its share of the sums and, for group 0, the store."""
        T.set_max_nreg(consumer_regs, 1)
        if push:
            if g == 0:  # the bytes the other splits will send here
                if tx == 0:
                    T.mbarrier_arrive_expect_tx(summed[0], (split - 1) * kg * rows * bn * 4)
            # every CTA's barriers initialised (TileLang's fence.mbarrier_init.release.cluster, then these
            # relaxed arrives) before any split sends to them; waited for after the k loop. Waited for here,
            # ahead of the scale loads, it made the whole k loop about 0.9 us slower on the H200 (NOTES.md)
            T.cluster_arrive_relaxed()
        consume(AS, BS, a_s, b_s, sa, sb, full, empty, bx, bz, g, part, acc, scale)
        if push:
            T.cluster_wait()
            push_end(C, sums, xfer, summed, bx, bz, tx, g, acc)
        else:
            if g > 0:
                T.copy(acc, sums[g - 1, :, :])
                T.barrier_arrive(summed)
            else:
                T.barrier_wait(summed, 0)
                for r, c in T.Parallel(64, bn):
                    for h in T.unroll(kg - 1):
                        acc[r, c] += sums[h, r, c]
                if split == 1:
                    T.copy(acc, C[0, bx * bn])  # rows past m are not stored
                else:
                    for r, c in T.Parallel(64, bn):
                        xfer[r * bn + c] = acc[r, c]
            if split > 1:
                T.cluster_arrive()  # release: this split's sum, to the cluster
                T.cluster_wait()  # acquire: every split's
                # every consumer warpgroup takes a share of the rows (tx counts the consumer threads from 0)
                T.call_extern(
                    "handle",
                    f"djax_cluster_sum<{split}, {bn}, {128 * kg}>",
                    C.data,
                    m,
                    n,
                    bx * bn,
                    T.address_of(xfer[0]),
                    T.block_rank_in_cluster(),
                    tx,
                )
                # relaxed: this barrier only keeps the CTA's shared memory alive until the peers have read it,
                # and a release here would first wait until the bf16 stores above reach global memory
                T.cluster_arrive_relaxed()
                T.cluster_wait()

    @T.macro
    def group(bufs, g, part, acc, scale):
        """`consumer` for the groups there are; nothing for g >= k_groups (no thread reaches those)."""
        if g < kg:
            consumer(*bufs, g, part, acc, scale)

    @T.macro
    def produce_all(A, B, a_s, b_s, full, empty, bx, bz):
        T.set_max_nreg(40, 0)
        if push:  # every thread of the cluster meets at the one cluster barrier (see consumer)
            T.cluster_arrive_relaxed()
        produce(A, B, a_s, b_s, full, empty, bx, bz)
        if push:
            T.cluster_wait()
        elif split > 1:  # every thread of the cluster meets at both cluster barriers
            T.cluster_arrive()
            T.cluster_wait()
            T.cluster_arrive_relaxed()
            T.cluster_wait()

    A_t, AS_t, B_t, BS_t, C_t = operand_types(T, m, n, k)

    @T.prim_func
    def fp8_gemm(A: A_t, AS: AS_t, B: B_t, BS: BS_t, C: C_t):
        with T.Kernel(n // bn, 1, split, threads=producer + 128) as (bx, by, bz):
            a_s = T.alloc_shared((ns, 64, BLOCK), fp8)
            b_s = T.alloc_shared((ns, bn, BLOCK), fp8)
            sa = T.alloc_shared((kg, turns, 64), f32)  # each group's activation scales, per turn and row
            sb = T.alloc_shared((kg, turns), f32)  # and weight scales, per turn
            full = T.alloc_barrier([128] * ns)  # the producer's 128 threads
            empty = T.alloc_barrier([128] * ns)  # the consumer warpgroup that took the block
            if push:
                # every group's accumulator, swizzled; with push_regs each group's quads of this split's rows
                sums = T.alloc_shared((kg * (rows if tiling.push_regs else 64) * bn,), f32)
                xfer = T.alloc_shared(((split - 1) * kg * rows * bn,), f32)  # the other splits' values
                # the other splits' values have landed (its arrival: the expectation of their bytes); the
                # other splits have theirs
                summed = T.alloc_barrier([1, split - 1])
            else:
                sums = T.alloc_shared((kg - 1, 64, bn), f32)  # groups 1..: their accumulators, for group 0
                # the split's sum, row-major, read by the cluster
                xfer = T.alloc_shared((64 * bn,), f32) if split > 1 else None
                summed = T.alloc_barrier(128 * (kg - 1))  # groups 1.. have written `sums`
            # one set of registers per consumer warpgroup (each is laid out for its own 128 threads)
            p0, p1, p2, p3 = (T.alloc_fragment((64, bn), f32) for _ in range(4))
            c0, c1, c2, c3 = (T.alloc_fragment((64, bn), f32) for _ in range(4))
            s0, s1, s2, s3 = (T.alloc_fragment((64,), f32) for _ in range(4))
            tx = T.get_thread_binding()
            bufs = (AS, BS, C, a_s, b_s, sa, sb, sums, xfer, full, empty, summed, bx, bz, tx)
            # one if / elif chain over the roles (separate ifs would get a CTA-wide barrier between them)
            if tx >= producer:
                produce_all(A, B, a_s, b_s, full, empty, bx, bz)
            elif tx < 128:
                group(bufs, 0, p0, c0, s0)
            elif tx < 256:
                group(bufs, 1, p1, c1, s1)
            elif tx < 384:
                group(bufs, 2, p2, c2, s2)
            else:
                group(bufs, 3, p3, c3, s3)

    return fp8_gemm


def with_cluster_sum(source: str, name: str, split: int, push: bool = False) -> str:
    """The lowered source with the cluster shape (1, 1, split) declared on the kernel and the cluster sum's
    device code (`djax_cluster_sum`, or with `push` `djax_push_sum`) ahead of it."""
    code = PEER_ADDRESS + _PUSH_SUM + _PUSH_REGS if push else _CLUSTER_SUM
    return with_device_code(with_cluster(source, name, (1, 1, split)), code)
