// DeepSeek-V4 sparse decode attention with the keys as wgmma's register operand (sm_90a).
//
// Contract: djax/kernels/sparse_attn_ref.py's sparse_decode_ref at head dim 512, bf16. Compiled per shape
// with -D SD_H (heads), SD_W (ring slots), SD_C (pool rows per batch row), SD_T (picks) and SD_QK
// (scale * log2 e).
//
// Why this form: the TileLang kernels gather key rows by 16-byte cp.async into the swizzled layout that
// wgmma's shared-memory operands need, and the SM's cp.async rate paces their key loop. Here a key row's
// half (512 bytes) comes in by one bulk copy into a padded linear row, which no wgmma shared operand can
// read, so the products are turned round and the keys become the register operand, loaded by ldmatrix
// (which takes any row addresses):
//   S^T [keys x heads] = K [keys x dims] Q^T        (A = K rows by ldmatrix, B = q in shared memory)
//   O^T [dims x heads] += V^T [dims x keys] P^T     (A = the same rows by ldmatrix.trans, B = P^T in shared)
// Grid (B, H / 64, 2), the two CTAs of a (row, 64 heads) one cluster: CTA z takes dims [256 z, 256 z + 256)
// of q, of every key and of the output, over all of the row's key blocks. A block's scores are the sum of
// both CTAs' partial products, so each sends its partial S^T to the peer (st.async into its shared memory)
// and adds the peer's: both hold the same scores (f32 addition commutes), take the same online softmax
// (columns = heads) and apply the same P^T to their own dims. Nothing is merged across the pair after the
// loop. In a CTA: warpgroups 0 and 1 take alternate key blocks, each with its own softmax state and
// accumulator, so one's exchange and softmax overlap the other's products; at the end they combine the two
// states, each for half of the CTA's dims. Warpgroup 2 is the producer (slot table, bulk copies, zero rows
// for masked slots). On the H200 at b64 it is slower than the TileLang pair (NOTES.md): the loads keep up,
// the consumers' per-block chain (exchange and softmax above all) does not.
#include <cstdint>

#include <cuda_bf16.h>

namespace {

constexpr int H = SD_H, W = SD_W, C = SD_C, T = SD_T;
constexpr float QK = SD_QK;
constexpr int K = 512, KH = 256, BS = 64, STAGES = 3;
// bytes per half key row in shared memory: +16 so that ldmatrix's 8 rows fall in 8 bank groups
constexpr int ROW = KH * 2 + 16;
constexpr int NBW = (W + BS - 1) / BS, NBT = (T + BS - 1) / BS, NB = NBW + NBT;

// Shared memory, offsets from a 1024-byte aligned base (the swizzled buffers need that alignment): q's half
// (4 chunks of [64 heads][64 dims], 128-byte swizzle); P^T per warpgroup ([64 heads][64 keys] bf16, 128-byte
// swizzle); the peer's partial scores ([warpgroup][use parity], 64 x 64 f32); STAGES x 64 half key rows of
// ROW bytes; column maxima ([warpgroup][parity][4 warps][64]); the slot table (pool or ring row, -1
// masked); both warpgroups' max and denominator per head; barriers full[STAGES], empty[STAGES],
// exchanged[2][2].
constexpr int Q_OFF = 0;
constexpr int P_OFF = Q_OFF + 64 * KH * 2;
constexpr int X_OFF = P_OFF + 2 * 64 * BS * 2;
constexpr int KV_OFF = X_OFF + 2 * 2 * 64 * BS * 4;
constexpr int RED_OFF = KV_OFF + STAGES * BS * ROW;
constexpr int SLOT_OFF = RED_OFF + 2 * 2 * 4 * 64 * 4;
constexpr int ML_OFF = SLOT_OFF + NB * BS * 4;
constexpr int BAR_OFF = ML_OFF + 2 * 2 * 64 * 4;
static_assert(P_OFF % 1024 == 0 && KV_OFF % 1024 == 0, "swizzled buffers need 1024-byte alignment");
static_assert(STAGES * BS * ROW >= 2 * 2 * 64 * 64 * 4,
              "the warpgroups swap half accumulators over the ring");

constexpr uint32_t X_BYTES = 64 * BS * 4;  // one warpgroup's partial scores of one block

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_wait(uint32_t bar, int parity) {
  asm volatile(
      "{\n .reg .pred p;\n"
      "WAIT_%=:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      " @!p bra WAIT_%=;\n}" ::"r"(bar),
      "r"(parity)
      : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

__device__ __forceinline__ void mbar_arrive_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void bulk_copy(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
      "l"(src), "r"(bytes), "r"(bar)
      : "memory");
}

__device__ __forceinline__ uint32_t peer_addr(uint32_t addr, uint32_t rank) {
  uint32_t out;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(out) : "r"(addr), "r"(rank));
  return out;
}

__device__ __forceinline__ void push4(uint32_t addr, float a, float b, float c, float d, uint32_t bar) {
  asm volatile(
      "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];"
      ::"r"(addr), "f"(a), "f"(b), "f"(c), "f"(d), "r"(bar)
      : "memory");
}

__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

__device__ __forceinline__ void named_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(count) : "memory");
}

__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// v[2 j + e] holds head 8 j + 2 (lane % 4) + e of this thread's rows: combines (op: fmaxf or a sum) each head's
// values over the lanes of a warp (shuffles across lane / 4), then over the warpgroup's 4 warps through `red`
// (64 floats a warp), so that every thread ends with each of its heads' values over all 64 rows
template <class Op>
__device__ __forceinline__ void heads_over_rows(float (&v)[16], float* red, int w, int lane, int wg, Op op) {
#pragma unroll
  for (int c = 0; c < 16; ++c) {
    v[c] = op(v[c], __shfl_xor_sync(0xffffffffu, v[c], 4));
    v[c] = op(v[c], __shfl_xor_sync(0xffffffffu, v[c], 8));
    v[c] = op(v[c], __shfl_xor_sync(0xffffffffu, v[c], 16));
  }
  if (lane < 4) {
#pragma unroll
    for (int j = 0; j < 8; ++j)
      *reinterpret_cast<float2*>(red + w * 64 + 8 * j + 2 * lane) = make_float2(v[2 * j], v[2 * j + 1]);
  }
  named_sync(2 + wg, 128);
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    float2 all = *reinterpret_cast<const float2*>(red + 8 * j + 2 * (lane & 3));
#pragma unroll
    for (int ww = 1; ww < 4; ++ww) {
      const float2 o = *reinterpret_cast<const float2*>(red + ww * 64 + 8 * j + 2 * (lane & 3));
      all.x = op(all.x, o.x), all.y = op(all.y, o.y);
    }
    v[2 * j] = all.x, v[2 * j + 1] = all.y;
  }
}

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

// A K-major operand with 128-byte swizzle: rows of 128 bytes, groups of 8 rows 1,024 bytes apart.
__device__ __forceinline__ uint64_t sw128_desc(uint32_t addr) {
  return static_cast<uint64_t>((addr >> 4) & 0x3FFF) | (static_cast<uint64_t>(1) << 16) |
         (static_cast<uint64_t>(1024 >> 4) << 32) | (static_cast<uint64_t>(1) << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// Keeps the compiler from moving reads of registers an in-flight wgmma writes (or reads) across a wait.
template <int N>
__device__ __forceinline__ void fence_regs(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
__device__ __forceinline__ void fence_regs(uint32_t (&r)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

// D[64 x 64] (+)= A[64 x 16] B[16 x 64]: A bf16 from registers, B a shared-memory descriptor, f32 accumulate.
__device__ __forceinline__ void wgmma_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t desc,
                                         int accumulate) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),
        "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),
        "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),
        "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(accumulate));
}

}  // namespace

// Accumulator fragments of m64n64 (per thread 32 floats): d[4 j + 2 hi + e] is row 16 warp + lane / 4 + 8 hi,
// column 8 j + 2 (lane % 4) + e. In S^T and O^T the column is the head, so each thread's 16 heads are fixed.
extern "C" __global__ void __launch_bounds__(384, 1) __cluster_dims__(1, 1, 2)
    sparse_decode_rs(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ window,
                     const int8_t* __restrict__ valid, const __nv_bfloat16* __restrict__ pool,
                     const int32_t* __restrict__ topk, const float* __restrict__ sinks,
                     __nv_bfloat16* __restrict__ out) {
  extern __shared__ __align__(1024) uint8_t raw_smem[];
  uint8_t* smem = raw_smem + ((1024 - (smem_addr(raw_smem) & 1023)) & 1023);
  const uint32_t base = smem_addr(smem);
  int* slots = reinterpret_cast<int*>(smem + SLOT_OFF);
  float* ml = reinterpret_cast<float*>(smem + ML_OFF);
  const uint32_t full0 = base + BAR_OFF, empty0 = full0 + 8 * STAGES, xbar0 = empty0 + 8 * STAGES;

  const int bx = blockIdx.x, by = blockIdx.y, z = blockIdx.z;
  const int wg = threadIdx.x / 128, t = threadIdx.x % 128, w = t / 32, lane = t % 32;

  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full0 + 8 * s, 4);   // one arrive per producer warp
      mbar_init(empty0 + 8 * s, 4);  // one per warp of the consumer warpgroup that took the block
    }
    for (int g = 0; g < 2; ++g)
      for (int x = 0; x < 2; ++x) {
        mbar_init(xbar0 + 8 * (2 * g + x), 1);
        if (x < (NB + 1 - g) / 2) mbar_arrive_tx(xbar0 + 8 * (2 * g + x), X_BYTES);  // its first use
      }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  cluster_sync();  // both CTAs' barriers exist before anything is sent to them

  if (wg == 2) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    // slot table, this warp's 16 rows of every block: the ring's row j or the pool's row topk[i], -1 masked
#pragma unroll 3  // every lane's loads issued before any is used: one round trip, not one per slot
    for (int s = lane; s < NB * 16; s += 32) {
      const int g = s / 16, r = 16 * w + s % 16;
      int row = -1;
      if (g < NBW) {
        const int j = g * BS + r;
        if (j < W && valid[bx * W + j]) row = j;
      } else {
        const int j = (g - NBW) * BS + r;
        if (j < T) {
          const int v = topk[bx * T + j];
          if (v >= 0 && v < C) row = v;
        }
      }
      slots[g * BS + r] = row;
    }
    __syncwarp();
    for (int g = 0; g < NB; ++g) {
      const int st = g % STAGES, r = 16 * w + (lane % 16);
      if (g >= STAGES) mbar_wait(empty0 + 8 * st, (g / STAGES - 1) & 1);
      const int row = slots[g * BS + r];
      const bool mine = lane < 16, live = mine && row >= 0;
      uint8_t* dst = smem + KV_OFF + st * BS * ROW + r * ROW;
      if (mine && !live) {  // masked slots read as zeros, never stale bytes (P is 0 there, 0 * NaN is not)
        uint4* d4 = reinterpret_cast<uint4*>(dst);
#pragma unroll 8
        for (int c = 0; c < KH * 2 / 16; ++c) d4[c] = make_uint4(0, 0, 0, 0);
      }
      const unsigned live_mask = __ballot_sync(0xffffffffu, live);
      __syncwarp();
      if (lane == 0) mbar_arrive_tx(full0 + 8 * st, __popc(live_mask) * KH * 2);
      if (live) {
        const __nv_bfloat16* src = g < NBW ? window + (static_cast<size_t>(bx) * W + row) * K
                                           : pool + (static_cast<size_t>(bx) * C + row) * K;
        bulk_copy(smem_addr(dst), src + z * KH, KH * 2, full0 + 8 * st);
      }
    }
    cluster_sync();  // no CTA leaves while its peer may still send to it
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
  // q's dims [256 z, 256 z + 256) into 128-byte swizzled chunks: 16-byte chunk u of 64-dim chunk c at head n
  // lies at c * 8 KB + n * 128 + ((u ^ n % 8) * 16), the layout TMA's swizzle would give
  {
    const int tid = threadIdx.x;  // both warpgroups load, both read all of it
#pragma unroll
    for (int it = 0; it < 8; ++it) {
      const int idx = it * 256 + tid, head = idx / 32, cc = idx % 32, c = cc / 8, u = cc % 8;
      const uint32_t dst = base + Q_OFF + c * 8192 + head * 128 + ((u ^ (head & 7)) << 4);
      const __nv_bfloat16* src = q + (static_cast<size_t>(bx) * H + by * 64 + head) * K + z * KH + cc * 8;
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
    }
  }
  asm volatile("cp.async.wait_all;\nfence.proxy.async.shared::cta;" ::: "memory");
  named_sync(1, 256);

  float m[16], l[16], acc[4][32];
#pragma unroll
  for (int c = 0; c < 16; ++c) {
    const int col = 8 * (c / 2) + 2 * (lane % 4) + c % 2;
    m[c] = sinks[by * 64 + col] * 1.4426950408889634f;
    l[c] = (wg == 0 && w == 0 && lane < 4) ? 1.f : 0.f;  // the sink's term, once per head
  }
#pragma unroll
  for (int mt = 0; mt < 4; ++mt)
#pragma unroll
    for (int i = 0; i < 32; ++i) acc[mt][i] = 0.f;

  const uint32_t k_lane = (16 * w + (lane & 7) + 8 * ((lane >> 3) & 1)) * ROW + 8 * (lane >> 4) * 2;
  const uint32_t v_lane = ((lane & 7) + 8 * (lane >> 4)) * ROW + (16 * w + 8 * ((lane >> 3) & 1)) * 2;
  const int r0 = 16 * w + (lane >> 2);
  const uint32_t peer = z ^ 1, p_s = base + P_OFF + wg * 64 * BS * 2;
  const int nloc = (NB + 1 - wg) / 2;

  for (int n = 0; n < nloc; ++n) {
    const int g = 2 * n + wg, st = g % STAGES, x = n % 2;
    const uint32_t kv = base + KV_OFF + st * BS * ROW, xbar = xbar0 + 8 * (2 * wg + x);
    float4* xs = reinterpret_cast<float4*>(smem + X_OFF + (2 * wg + x) * X_BYTES);
    mbar_wait(full0 + 8 * st, (g / STAGES) & 1);

    // S^T partial over this CTA's 256 dims: 16 k-steps in 8 groups of 2, A fragments double-buffered
    // (a group's registers are reloaded only once the wgmmas reading them are done)
    float s[32];
    uint32_t a[2][2][4];
#pragma unroll
    for (int grp = 0; grp < 8; ++grp) {
      if (grp >= 2) {
        wgmma_wait<1>();
        fence_regs(a[grp & 1][0]);
        fence_regs(a[grp & 1][1]);
      }
#pragma unroll
      for (int kq = 0; kq < 2; ++kq) ldsm_x4(a[grp & 1][kq], kv + k_lane + (grp * 2 + kq) * 32);
      wgmma_fence();
#pragma unroll
      for (int kq = 0; kq < 2; ++kq) {
        const int kk = grp * 2 + kq;  // dims [16 kk, 16 kk + 16): 64-dim chunk kk / 4, 32 bytes a step
        wgmma_rs(s, a[grp & 1][kq], sw128_desc(base + Q_OFF + (kk / 4) * 8192 + (kk % 4) * 32), kk);
      }
      wgmma_commit();
    }
    wgmma_wait<0>();
    fence_regs(s);
#pragma unroll
    for (int b2 = 0; b2 < 2; ++b2) {
      fence_regs(a[b2][0]);
      fence_regs(a[b2][1]);
    }

    // the peer's warpgroup of the same index holds the other half of the same block's scores, element for
    // element in the same threads: send ours, add theirs
    {
      const uint32_t rx = peer_addr(smem_addr(xs), peer) + t * 16, rbar = peer_addr(xbar, peer);
#pragma unroll
      for (int j = 0; j < 8; ++j)
        push4(rx + j * 128 * 16, s[4 * j], s[4 * j + 1], s[4 * j + 2], s[4 * j + 3], rbar);
    }
    mbar_wait(xbar, (n / 2) & 1);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float4 v = xs[j * 128 + t];
      s[4 * j] += v.x, s[4 * j + 1] += v.y, s[4 * j + 2] += v.z, s[4 * j + 3] += v.w;
    }
    // this buffer's next use: the peer sends into it only after it has our next block's scores, which we
    // send after the reads above
    if (t == 0 && n + 2 < nloc) mbar_arrive_tx(xbar, X_BYTES);

    // online softmax over keys (rows), per head (column), base 2
    const int* sl = slots + g * BS;
    const bool v0 = sl[r0] >= 0, v1 = sl[r0 + 8] >= 0;
    float mx[16];
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float x0 = v0 ? s[4 * j + e] * QK : -INFINITY, x1 = v1 ? s[4 * j + 2 + e] * QK : -INFINITY;
        s[4 * j + e] = x0;
        s[4 * j + 2 + e] = x1;
        mx[2 * j + e] = fmaxf(x0, x1);
      }
    heads_over_rows(mx, reinterpret_cast<float*>(smem + RED_OFF) + (wg * 2 + x) * 256, w, lane, wg,
                    [](float p, float q) { return fmaxf(p, q); });
    float alpha[16];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float n0 = fmaxf(m[2 * j], mx[2 * j]), n1 = fmaxf(m[2 * j + 1], mx[2 * j + 1]);
      alpha[2 * j] = exp2_approx(m[2 * j] - n0), alpha[2 * j + 1] = exp2_approx(m[2 * j + 1] - n1);
      m[2 * j] = n0, m[2 * j + 1] = n1;
    }
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float p0 = exp2_approx(s[4 * j + e] - m[2 * j + e]);
        const float p1 = exp2_approx(s[4 * j + 2 + e] - m[2 * j + e]);
        s[4 * j + e] = p0, s[4 * j + 2 + e] = p1;
        l[2 * j + e] = l[2 * j + e] * alpha[2 * j + e] + p0 + p1;
      }
#pragma unroll
    for (int mt = 0; mt < 4; ++mt)
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int y = 0; y < 4; ++y) acc[mt][4 * j + y] *= alpha[2 * j + y % 2];

    // P^T [heads][keys] bf16, 128-byte swizzle, in this warpgroup's own buffer
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int y = 0; y < 4; ++y) {
        const int key = r0 + 8 * (y / 2), head = 8 * j + 2 * (lane & 3) + y % 2;
        const int at = head * 128 + (((key >> 3) ^ (head & 7)) << 4) + (key & 7) * 2;
        *reinterpret_cast<__nv_bfloat16*>(smem + (p_s - base) + at) = __float2bfloat16(s[4 * j + y]);
      }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // P^T is read by wgmma (the async proxy)
    named_sync(2 + wg, 128);

    // O^T += V^T P^T over the CTA's dims: 4 m-tiles of 64 dims x 4 k-steps of 16 keys, in 8 groups of 2
#pragma unroll
    for (int grp = 0; grp < 8; ++grp) {
      const int mt = grp / 2;
      if (grp >= 2) {
        wgmma_wait<1>();
        fence_regs(a[grp & 1][0]);
        fence_regs(a[grp & 1][1]);
      }
#pragma unroll
      for (int kq = 0; kq < 2; ++kq) {
        const int kk = (grp % 2) * 2 + kq;
        ldsm_x4_trans(a[grp & 1][kq], kv + v_lane + kk * 16 * ROW + mt * 128);
      }
      wgmma_fence();
#pragma unroll
      for (int kq = 0; kq < 2; ++kq) {
        const int kk = (grp % 2) * 2 + kq;
        wgmma_rs(acc[mt], a[grp & 1][kq], sw128_desc(p_s + kk * 32), 1);
      }
      wgmma_commit();
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(empty0 + 8 * st);  // this warp's ldmatrix reads of the block are done
    wgmma_wait<0>();
#pragma unroll
    for (int mt = 0; mt < 4; ++mt) fence_regs(acc[mt]);
  }

  // the denominator per head over the warpgroup's rows
  heads_over_rows(l, reinterpret_cast<float*>(smem + RED_OFF) + (wg * 2 + nloc % 2) * 256, w, lane, wg,
                  [](float p, float q) { return p + q; });

  // the two warpgroups' states: warpgroup g stores m-tiles 2 g and 2 g + 1 (dims [128 g, 128 g + 128) of the
  // CTA's half) and hands the other its two through the key ring, free once both loops are done
  named_sync(1, 256);
  float4* swap = reinterpret_cast<float4*>(smem + KV_OFF);
#pragma unroll
  for (int h2 = 0; h2 < 2; ++h2)
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      float v[4];  // m-tile 2 (1 - wg) + h2, registers indexed statically
#pragma unroll
      for (int y = 0; y < 4; ++y) v[y] = wg ? acc[h2][4 * j + y] : acc[2 + h2][4 * j + y];
      swap[((wg * 2 + h2) * 8 + j) * 128 + t] = make_float4(v[0], v[1], v[2], v[3]);
    }
  if (w == 0 && lane < 4) {
#pragma unroll
    for (int c = 0; c < 16; ++c) {
      const int col = 8 * (c / 2) + 2 * lane + c % 2;
      ml[wg * 128 + col] = m[c];
      ml[wg * 128 + 64 + col] = l[c];
    }
  }
  named_sync(1, 256);
  float own[16], other[16];
#pragma unroll
  for (int c = 0; c < 16; ++c) {
    const int col = 8 * (c / 2) + 2 * (lane & 3) + c % 2;
    const float mp = ml[(1 - wg) * 128 + col], lp = ml[(1 - wg) * 128 + 64 + col], top = fmaxf(m[c], mp);
    const float a0 = exp2_approx(m[c] - top), b0 = exp2_approx(mp - top);
    const float inv = 1.f / (l[c] * a0 + lp * b0);  // > 0: warpgroup 0's denominator counts the sink
    own[c] = a0 * inv, other[c] = b0 * inv;
  }
  // bf16 rows [64 heads][128 dims] of this warpgroup, staged over P^T and the exchange buffers (free now) in
  // rows of 272 bytes, then stored 256 bytes a head
  uint8_t* stage = smem + P_OFF + wg * 64 * 272;
#pragma unroll
  for (int h2 = 0; h2 < 2; ++h2)
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float4 v = swap[(((1 - wg) * 2 + h2) * 8 + j) * 128 + t];
      const float pv[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int y = 0; y < 4; ++y) {
        const int c = 2 * j + y % 2, dim = h2 * 64 + r0 + 8 * (y / 2), head = 8 * j + 2 * (lane & 3) + y % 2;
        const float mine = wg ? acc[2 + h2][4 * j + y] : acc[h2][4 * j + y];  // m-tile 2 wg + h2
        const float o = mine * own[c] + pv[y] * other[c];
        *reinterpret_cast<__nv_bfloat16*>(stage + head * 272 + dim * 2) = __float2bfloat16(o);
      }
    }
  named_sync(2 + wg, 128);
#pragma unroll 4
  for (int rr = 0; rr < 8; ++rr) {
    const int head = 16 * w + 2 * rr + lane / 16;
    const uint4 v = *reinterpret_cast<const uint4*>(stage + head * 272 + (lane % 16) * 16);
    const size_t row = static_cast<size_t>(bx) * H + by * 64 + head;
    uint4* dst = reinterpret_cast<uint4*>(out + row * K + z * KH + wg * 128);
    dst[lane % 16] = v;
  }
  cluster_sync();  // no CTA leaves while its peer may still send to it
}
