// FP8 block-scaled GEMM for prefill as a persistent kernel: one CTA per SM walks 128x256 output tiles.
//
// The k loop is that of the TileLang "ws" prefill default (WsTiling(128, 256, 3, panel=8, scales_ahead=True),
// as TileLang 0.1.15 lowers it): a producer thread fills a ring of DJAX_STAGES stages by TMA (A's 128 rows,
// B's two 128-row slices, each with its own full and empty barrier), two consumer warpgroups each compute 64
// rows of the tile as two 128-column wgmma chains per k block and promote them with DeepGEMM's scales, read a
// k block ahead. The two slices' wgmma chains, promotions and stores are written out twice as TileLang lowers
// them: the same steps as lambdas compiled to different SASS (ptxas scheduled them otherwise), and this form is
// the one measured. What differs is around the loop:
// - the ring's position runs on across tiles, so the next tile's first k blocks load during this tile's last
//   promotions and epilogue;
// - each tile's bf16 result goes out of a staging buffer of its own by TMA, and that store is waited for only
//   before the next tile's result is staged there (and before the CTA exits);
// - the tile a CTA takes next is either fixed (DJAX_ATOMIC 0: tiles c, c + CTAs, ...) or taken from a counter
//   in global memory (DJAX_ATOMIC 1), so that an SM that runs ahead takes more tiles, as the hardware's block
//   scheduler gives a freed SM the next CTA of a one-tile-a-CTA grid.
//
// The producer thread hands each tile index to the consumers through a two-slot ring in shared memory (its
// own full and empty barriers); an index past the last tile ends the walk. The consumers take the next
// index in the tile's last k block, so that the next tile's first scales load under that block's wgmmas.
//
// The grouped contiguous GEMM (DJAX_GROUPS > 0: MoE prefill, B fp8[groups, n, k], BS f32[groups, n/128, k/128],
// MI int32[m] the group of each row, -1 for padding) walks only the live tiles: the producer warpgroup first
// lists, in shared memory, the tile rows whose first row has a group (in order), and the walk runs over those
// rows times the tile columns, so tiles of padding cost no turn of the walk. Each list entry holds the tile
// row, its group and whether row 64 is padding (so, in the contiguous layout, rows 64-127); with
// DJAX_HALF_TILES the second consumer warpgroup then only keeps the stage barriers' order for that tile (its
// rows come out 0), and the first has the tensor cores alone. A group number past the last group reads zero
// weights (TMA fills out-of-bounds boxes with zeros) times the last group's scales, so its rows come out 0,
// as in the reference.
//
// The counter (DJAX_ATOMIC 1) lives in the module (zero when it is loaded) and is zero again when a launch
// ends: every CTA takes exactly one index past the last tile, then counts itself done, and the CTA that
// counts last resets both. So launches of one loaded kernel must not overlap (XLA runs a device's kernels on
// one stream, and its default command-buffer mode keeps them in order), and a launch that aborts part way
// leaves the counter set for the module's life.
//
// Defined by the caller (djax/kernels/fp8_persistent.py): DJAX_M (rows of A), DJAX_N_TILES (n / 256),
// DJAX_KB (k / 128), DJAX_STAGES, DJAX_PANEL (tile rows per rasterisation panel, 0: row-major order),
// DJAX_A_ROWS (rows of A's TMA box: 128, or m when A is one partial tile), DJAX_ATOMIC, DJAX_GROUPS (0: the
// dense GEMM) and DJAX_HALF_TILES.
#include <tl_templates/cuda/instruction/wgmma.h>
#include <tl_templates/cuda/intrin.h>
#include <tl_templates/cuda/barrier.h>
#include <tl_templates/cuda/copy_sm90.h>
#include <tl_templates/cuda/cuda_fp8.h>
#include <tl_templates/cuda/ldsm.h>

namespace {

constexpr int M = DJAX_M, M_TILES = (DJAX_M + 127) / 128, N_TILES = DJAX_N_TILES;
constexpr int TILES = M_TILES * N_TILES, KB = DJAX_KB, S = DJAX_STAGES, PANEL = DJAX_PANEL;
constexpr int BOX = 16384;                   // bytes (fp8 elements) of one 128 x 128 stage buffer
constexpr int A_BYTES = DJAX_A_ROWS * 128;   // bytes A's TMA box brings
constexpr bool WHOLE_TILES = DJAX_M % 128 == 0;  // no row past m to guard
constexpr int GROUPS = DJAX_GROUPS;          // weight matrices of the grouped GEMM; 0: dense
constexpr bool HALF_TILES = DJAX_HALF_TILES;  // (grouped) the second warpgroup idles where its rows are padding
// a live tile row's entry in the grouped walk's list: tile row, whether rows 64-127 are padding, group
constexpr int ROW_SHIFT = 17, IDLE_BIT = 1 << 16, GROUP_MASK = 0xffff;
static_assert(GROUPS == 0 || M_TILES < (1 << (31 - ROW_SHIFT)), "a tile row must fit its entry's 14 bits");
// barriers: full and empty per stage for A, B's first slice, B's second; then the tile-index ring's
enum { FULL_A = 0, FULL_B = S, FULL_B1 = 2 * S, EMPTY_A = 3 * S, EMPTY_B = 4 * S, EMPTY_B1 = 5 * S };
enum { TILE_FULL = 6 * S, TILE_EMPTY = 6 * S + 2, BARRIERS = 6 * S + 4 };

#if DJAX_ATOMIC
// the tile index a CTA takes next, and how many CTAs have taken their last one
__device__ int next_tile = 0;
__device__ int ctas_done = 0;
#endif

// (tile column, tile row) of the t-th tile in TileLang's rasterization2DRow<PANEL> order (that of the
// one-tile-a-CTA default's block indices): panels of PANEL tile rows, column by column, snaking.
// `tiles` is TILES for the dense GEMM and the live tile rows times N_TILES for the grouped one, whose `by` is
// then the position in the list of live tile rows.
__device__ __forceinline__ void tile_coords(int t, int tiles, int& bx, int& by) {
  if constexpr (PANEL == 0) {
    bx = t % N_TILES;
    by = t / N_TILES;
  } else {
    constexpr int panel_size = (PANEL > 0 ? PANEL : 1) * N_TILES;  // (checked even where PANEL is 0)
    const int panels = (tiles + panel_size - 1) / panel_size;
    const int panel = t / panel_size, offset = t % panel_size;
    const int stride = panel + 1 < panels ? PANEL : (tiles - panel * panel_size) / N_TILES;
    bx = (panel & 1) ? N_TILES - 1 - offset / stride : offset / stride;
    by = offset % stride + panel * PANEL;
  }
}

#if DJAX_GROUPS
// Lists the tile rows whose first row has a group, in order, as entries of live_rows; returns how many.
// Called by the producer warpgroup's 128 threads, each reading the first row's group (and row 64's) of every
// 128th tile row, a chunk of tile rows at a time with their loads issued together.
__device__ __noinline__ int list_live_rows(const int* __restrict__ MI, int* live_rows, int* warp_live) {
  constexpr int CHUNK = 8;  // tile rows a thread reads at once
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  int count = 0;
  for (int r0 = 0; r0 < M_TILES; r0 += 128 * CHUNK) {
    int first[CHUNK], second[CHUNK];
    #pragma unroll
    for (int i = 0; i < CHUNK; ++i) {
      const int r = r0 + i * 128 + tid;
      first[i] = r < M_TILES ? MI[r * 128] : -1;
      second[i] = r < M_TILES && HALF_TILES ? MI[r * 128 + 64] : 0;
    }
    #pragma unroll
    for (int i = 0; i < CHUNK; ++i) {
      const int r = r0 + i * 128 + tid;
      const bool live = first[i] >= 0;
      const unsigned ballot = __ballot_sync(0xffffffffu, live);
      if (lane == 0) warp_live[warp] = __popc(ballot);
      asm volatile("bar.sync 1, 128;" ::: "memory");
      int at = count + __popc(ballot & ((1u << lane) - 1u));
      #pragma unroll
      for (int w = 0; w < 4; ++w) {
        at += w < warp ? warp_live[w] : 0;
        count += warp_live[w];
      }
      if (live) live_rows[at] = (r << ROW_SHIFT) | (second[i] < 0 ? IDLE_BIT : 0) | min(first[i], GROUP_MASK);
      asm volatile("bar.sync 1, 128;" ::: "memory");  // warp_live is written again, live_rows read after
    }
  }
  return count;
}
#endif

}  // namespace

#if DJAX_GROUPS
#define DJAX_KERNEL fp8_gemm_grouped_kernel
#define DJAX_MI_PARAM , const int* __restrict__ MI
#else
#define DJAX_KERNEL fp8_gemm_kernel
#define DJAX_MI_PARAM
#endif

// (the parameters are those of TileLang's lowering of the same tiles one a CTA, whose launch plan is reused)
extern "C" __global__ void __launch_bounds__(384, 1) DJAX_KERNEL(const float* __restrict__ AS, __grid_constant__ const CUtensorMap A_desc, const float* __restrict__ BS, __grid_constant__ const CUtensorMap B_desc, __grid_constant__ const CUtensorMap C_desc DJAX_MI_PARAM) {
  extern __shared__ __align__(1024) uchar buf_dyn_shmem[];
  fp8_e4_t* a_s = (fp8_e4_t*)buf_dyn_shmem;
  fp8_e4_t* b_s = a_s + S * BOX;
  fp8_e4_t* b1_s = b_s + S * BOX;
  bfloat16_t* c_s = (bfloat16_t*)(b1_s + S * BOX);  // the tile's first 128 columns, two 64-column boxes
  bfloat16_t* c1_s = c_s + 16384;                   // its second 128
  __shared__ __align__(16) uint64_t mbarrier_mem[BARRIERS];
  __shared__ volatile int tile_slot[2];
  __shared__ volatile int tile_entry[2];  // (grouped) the handed-over tile's entry in the list of live tile rows
  __shared__ int live_rows[GROUPS ? M_TILES : 1];
  __shared__ int warp_live[4];
  auto mbarrier = reinterpret_cast<Barrier*>(mbarrier_mem);
  if (tl::tl_shuffle_elect<0>()) {
    tl::prefetch_tma_descriptor(A_desc);
    tl::prefetch_tma_descriptor(B_desc);
    tl::prefetch_tma_descriptor(C_desc);
  }
  if (tl::tl_shuffle_elect<0>()) {
    for (int i = 0; i < 3 * S; ++i) mbarrier[i].init(1);  // the producer's arrive with the bytes to expect
    for (int i = 3 * S; i < 6 * S; ++i) mbarrier[i].init(256);  // every consumer thread
    mbarrier[TILE_FULL].init(1);
    mbarrier[TILE_FULL + 1].init(1);
    mbarrier[TILE_EMPTY].init(256);
    mbarrier[TILE_EMPTY + 1].init(256);
  }
  tl::fence_barrier_init();
  __syncthreads();
  if (((int)threadIdx.x) < 128) {
#if DJAX_GROUPS
    const int live_tiles = list_live_rows(MI, live_rows, warp_live) * N_TILES;
#else
    constexpr int live_tiles = TILES;
#endif
    tl::warpgroup_reg_dealloc<40>();
    if (((int)threadIdx.x) == 0) {
      // a 128-row slice of B's k block: of the tile's group's weights for the grouped GEMM (a 3-D map)
      auto load_b = [&](Barrier& bar, fp8_e4_t* dst, int k0, int n0, int group) {
        if constexpr (GROUPS > 0) {
          tl::tma_load(B_desc, bar, dst, k0, n0, group);
        } else {
          tl::tma_load(B_desc, bar, dst, k0, n0);
        }
      };
      int g = 0;  // k blocks loaded so far: the ring's position, across tiles
      for (int it = 0;; ++it) {
        const int slot = it & 1;
        mbarrier[TILE_EMPTY + slot].wait(((it >> 1) & 1) ^ 1);
#if DJAX_ATOMIC
        const int t = atomicAdd(&next_tile, 1);
#else
        const int t = ((int)blockIdx.x) + it * ((int)gridDim.x);
#endif
        int bx, by, group = 0;
        if constexpr (GROUPS > 0) {
          int entry = 0;
          bx = -1;  // the end of the walk
          if (t < live_tiles) {
            tile_coords(t, live_tiles, bx, by);
            entry = live_rows[by];
          }
          tile_slot[slot] = bx;
          tile_entry[slot] = entry;
          by = entry >> ROW_SHIFT;
          group = entry & GROUP_MASK;
        } else {
          tile_slot[slot] = t;
        }
        asm volatile("" ::: "memory");  // the stores before the arrive (TileLang's barrier asm has no clobber)
        mbarrier[TILE_FULL + slot].arrive();
        if (t >= live_tiles) break;
        if constexpr (GROUPS == 0) tile_coords(t, TILES, bx, by);
        for (int j = 0; j < KB; ++j, ++g) {
          const int s = g % S, phase = ((g / S) & 1) ^ 1;
          mbarrier[EMPTY_A + s].wait(phase);
          mbarrier[FULL_A + s].arrive_and_expect_tx(A_BYTES);
          tl::tma_load(A_desc, mbarrier[FULL_A + s], a_s + s * BOX, j * 128, by * 128);
          mbarrier[EMPTY_B + s].wait(phase);
          mbarrier[FULL_B + s].arrive_and_expect_tx(BOX);
          load_b(mbarrier[FULL_B + s], b_s + s * BOX, j * 128, bx * 256, group);
          mbarrier[EMPTY_B1 + s].wait(phase);
          mbarrier[FULL_B1 + s].arrive_and_expect_tx(BOX);
          load_b(mbarrier[FULL_B1 + s], b1_s + s * BOX, j * 128, bx * 256 + 128, group);
        }
      }
#if DJAX_ATOMIC
      __threadfence();  // this CTA's last take of next_tile before its count in ctas_done
      if (atomicAdd(&ctas_done, 1) == ((int)gridDim.x) - 1) {
        __threadfence();  // every other CTA's counts before the reset
        atomicExch(&next_tile, 0);
        atomicExch(&ctas_done, 0);
      }
#endif
    }
  } else {
    tl::warpgroup_reg_alloc<232>();
    // this thread's two fragment rows: warp w of the consumers holds rows 16 w + lane / 4 and 8 more
    const int row = ((((int)threadIdx.x) >> 5) - 4) * 16 + ((((int)threadIdx.x) & 31) >> 2);
    const int half = (((((int)threadIdx.x) >> 7) + 1) & 1);  // the warpgroup's 64-row half of A's stage
    float ahead_a[2];
    float ahead_b[2];
    float ahead_b1[2];
    float acc[64];
    float acc1[64];
    float scale[2];
    float scale1[2];
    float part[64];
    int g = 0;  // k blocks consumed so far, across tiles
    // the scales of k block jn of the tile at (bx, by), loaded a k block before they are used
    auto load_ahead = [&](int bx, int by, int jn) {
      const int r0 = by * 128 + row;
      ahead_a[0] = WHOLE_TILES || r0 < M ? AS[r0 * KB + jn] : 0.f;  // 0 past m
      ahead_a[1] = WHOLE_TILES || r0 + 8 < M ? AS[(r0 + 8) * KB + jn] : 0.f;
      ahead_b[0] = ahead_b[1] = BS[bx * 2 * KB + jn];  // the tile's two 128-column weight-scale blocks
      ahead_b1[0] = ahead_b1[1] = BS[(bx * 2 + 1) * KB + jn];
    };
    // what the producer handed over in ring slot it & 1: the tile index (dense) or the tile column, -1 at the
    // end (grouped, with the tile row's entry in the list of live rows in e)
    auto take_tile = [&](int it, int& e) {
      mbarrier[TILE_FULL + (it & 1)].wait((it >> 1) & 1);
      asm volatile("" ::: "memory");  // the loads after the wait
      const int t = tile_slot[it & 1];
      if constexpr (GROUPS > 0) e = tile_entry[it & 1];
      mbarrier[TILE_EMPTY + (it & 1)].arrive();
      return t;
    };
    auto walking = [](int t) { return GROUPS > 0 ? t >= 0 : t < TILES; };
    // the tile's column and row, and the column of its weight scales (grouped: among all groups' columns)
    auto coords = [&](int t, int e, int& bx, int& by, int& sbx) {
      if constexpr (GROUPS > 0) {
        bx = t;
        by = e >> ROW_SHIFT;
        sbx = min(e & GROUP_MASK, GROUPS - 1) * N_TILES + t;  // (a group past the last loads zero weights)
      } else {
        tile_coords(t, TILES, bx, by);
      }
    };
    // the column of the tile's weight scales (dense: its own column; the grouped column kept apart from bx only
    // there, so that the dense kernel's compiled code stays as measured)
    auto scale_col = [](int bx, int sbx) { return GROUPS > 0 ? sbx : bx; };
    int e = 0, t = take_tile(0, e), bx, by, sbx = 0;
    if (walking(t)) {
      coords(t, e, bx, by, sbx);
      load_ahead(scale_col(bx, sbx), by, 0);
    }
    for (int it = 0; walking(t); ++it) {
      int e_next = e, t_next = t, bx_next = bx, by_next = by, sbx_next = sbx;
      #pragma unroll
      for (int i = 0; i < 64; ++i) {
        acc[i] = 0.f;
        acc1[i] = 0.f;
      }
      // (grouped, half tiles) where rows 64-127 are padding, the second warpgroup keeps only the stage
      // barriers' order (a stage is free once both warpgroups arrived, so it must still wait for each) and
      // stages zeros for those rows
      if (HALF_TILES && half == 1 && (e & IDLE_BIT)) {
        #pragma unroll 1
        for (int j = 0; j < KB; ++j, ++g) {
          const int s = g % S, phase = (g / S) & 1;
          mbarrier[FULL_A + s].wait(phase);
          mbarrier[FULL_B + s].wait(phase);
          mbarrier[EMPTY_B + s].arrive();
          mbarrier[FULL_B1 + s].wait(phase);
          mbarrier[EMPTY_A + s].arrive();
          mbarrier[EMPTY_B1 + s].arrive();
        }
        t_next = take_tile(it + 1, e_next);
        if (walking(t_next)) {
          coords(t_next, e_next, bx_next, by_next, sbx_next);
          load_ahead(scale_col(bx_next, sbx_next), by_next, 0);
        }
      } else
      for (int j = 0; j < KB; ++j, ++g) {
        const int s = g % S, phase = (g / S) & 1;
        // this block's scales came in during the last one; the next block's load under this one's wgmmas,
        // in the last block the next tile's first (the producer handed its index over a ring ahead)
        scale[0] = ahead_a[0] * ahead_b[0];
        scale[1] = ahead_a[1] * ahead_b[1];
        scale1[0] = ahead_a[0] * ahead_b1[0];
        scale1[1] = ahead_a[1] * ahead_b1[1];
        if (j + 1 < KB) {
          load_ahead(scale_col(bx, sbx), by, j + 1);
        } else {
          t_next = take_tile(it + 1, e_next);
          if (walking(t_next)) {
            coords(t_next, e_next, bx_next, by_next, sbx_next);
            load_ahead(scale_col(bx_next, sbx_next), by_next, 0);
          }
        }
        mbarrier[FULL_A + s].wait(phase);
        mbarrier[FULL_B + s].wait(phase);
        {
          tl::GmmaDescriptor desc_a;
          tl::GmmaDescriptor desc_b;
          tl::initialize_wgmma_descriptor<1, 1, 64>(desc_a, a_s);
          tl::increase_descriptor_offset<int>(desc_a, s * BOX);
          tl::initialize_wgmma_descriptor<1, 1, 64>(desc_b, b_s);
          tl::increase_descriptor_offset<int>(desc_b, s * BOX);
          tl::warpgroup_fence_operand(reinterpret_cast<float*>(part + 0), 128);
          tl::warpgroup_arrive();
          #pragma unroll
          for (int ki = 0; ki < 4; ++ki) {
            tl::wgmma_ss<tl::DataType::kFloat8_e4m3, tl::DataType::kFloat8_e4m3, tl::DataType::kFloat32, 64, 128, 32, false, false, 1, 1>(uint64_t(desc_a + ((half * 8192 + ki * 32) >> 4)), uint64_t(desc_b + ((ki * 32) >> 4)), ((uint32_t*)(part + 0)), ((0 < ki) ? 1 : 0));
          }
          tl::warpgroup_commit_batch();
          tl::warpgroup_wait<0>();
          tl::warpgroup_fence_operand(reinterpret_cast<float*>(part + 0), 128);
        }
        mbarrier[EMPTY_B + s].arrive();  // B's first slice is free once its chain is done
        #pragma unroll
        for (int i = 0; i < 32; ++i) {
          acc[i * 2] += part[i * 2] * scale[i & 1];
          acc[i * 2 + 1] += part[i * 2 + 1] * scale[i & 1];
        }
        mbarrier[FULL_B1 + s].wait(phase);
        {
          tl::GmmaDescriptor desc_a_1;
          tl::GmmaDescriptor desc_b_1;
          tl::initialize_wgmma_descriptor<1, 1, 64>(desc_a_1, a_s);
          tl::increase_descriptor_offset<int>(desc_a_1, s * BOX);
          tl::initialize_wgmma_descriptor<1, 1, 64>(desc_b_1, b1_s);
          tl::increase_descriptor_offset<int>(desc_b_1, s * BOX);
          tl::warpgroup_fence_operand(reinterpret_cast<float*>(part + 0), 128);
          tl::warpgroup_arrive();
          #pragma unroll
          for (int ki = 0; ki < 4; ++ki) {
            tl::wgmma_ss<tl::DataType::kFloat8_e4m3, tl::DataType::kFloat8_e4m3, tl::DataType::kFloat32, 64, 128, 32, false, false, 1, 1>(uint64_t(desc_a_1 + ((half * 8192 + ki * 32) >> 4)), uint64_t(desc_b_1 + ((ki * 32) >> 4)), ((uint32_t*)(part + 0)), ((0 < ki) ? 1 : 0));
          }
          tl::warpgroup_commit_batch();
          tl::warpgroup_wait<0>();
          tl::warpgroup_fence_operand(reinterpret_cast<float*>(part + 0), 128);
        }
        mbarrier[EMPTY_A + s].arrive();
        mbarrier[EMPTY_B1 + s].arrive();
        #pragma unroll
        for (int i = 0; i < 32; ++i) {
          acc1[i * 2] += part[i * 2] * scale1[i & 1];
          acc1[i * 2 + 1] += part[i * 2 + 1] * scale1[i & 1];
        }
      }
      // the last tile's stores must have read the staging buffers before they are written again (the wait
      // is the storing thread's: a bulk-async group belongs to the thread that committed it)
      if (((int)threadIdx.x) == 128) {
        tl::tma_store_wait<0, true>();
      }
      tl::__sync_thread_partial(3, 256);
      #pragma unroll
      for (int i_6 = 0; i_6 < 8; ++i_6) {
        tl::ptx_stmatrix_m8n8_x4((&(c_s[((((((((i_6 >> 2) * 8192) + ((((int)threadIdx.x) >> 5) * 1024)) + ((((int)threadIdx.x) & 15) * 64)) + (((((((int)threadIdx.x) & 7) >> 2) + ((i_6 & 3) >> 1)) & 1) * 32)) + (((((((int)threadIdx.x) & 3) >> 1) + (i_6 & 1)) & 1) * 16)) + (((((((int)threadIdx.x) & 31) >> 4) + (((int)threadIdx.x) & 1)) & 1) * 8)) - 4096)])), __pack_half2(((bfloat16_t)acc[(i_6 * 8)]), ((bfloat16_t)acc[((i_6 * 8) + 1)])), __pack_half2(((bfloat16_t)acc[((i_6 * 8) + 2)]), ((bfloat16_t)acc[((i_6 * 8) + 3)])), __pack_half2(((bfloat16_t)acc[((i_6 * 8) + 4)]), ((bfloat16_t)acc[((i_6 * 8) + 5)])), __pack_half2(((bfloat16_t)acc[((i_6 * 8) + 6)]), ((bfloat16_t)acc[((i_6 * 8) + 7)])));
      }
      tl::__sync_thread_partial(3, 256);
      if (((int)threadIdx.x) == 128) {
        tl::fence_proxy_async();
        #pragma unroll
        for (int i_8 = 0; i_8 < 2; ++i_8) {
          tl::tma_store(C_desc, (&(c_s[(i_8 * 8192)])), ((bx * 256) + (i_8 * 64)), (by * 128));
        }
        tl::tma_store_arrive();
      }
      #pragma unroll
      for (int i_7 = 0; i_7 < 8; ++i_7) {
        tl::ptx_stmatrix_m8n8_x4((&(c1_s[((((((((i_7 >> 2) * 8192) + ((((int)threadIdx.x) >> 5) * 1024)) + ((((int)threadIdx.x) & 15) * 64)) + (((((((int)threadIdx.x) & 7) >> 2) + ((i_7 & 3) >> 1)) & 1) * 32)) + (((((((int)threadIdx.x) & 3) >> 1) + (i_7 & 1)) & 1) * 16)) + (((((((int)threadIdx.x) & 31) >> 4) + (((int)threadIdx.x) & 1)) & 1) * 8)) - 4096)])), __pack_half2(((bfloat16_t)acc1[(i_7 * 8)]), ((bfloat16_t)acc1[((i_7 * 8) + 1)])), __pack_half2(((bfloat16_t)acc1[((i_7 * 8) + 2)]), ((bfloat16_t)acc1[((i_7 * 8) + 3)])), __pack_half2(((bfloat16_t)acc1[((i_7 * 8) + 4)]), ((bfloat16_t)acc1[((i_7 * 8) + 5)])), __pack_half2(((bfloat16_t)acc1[((i_7 * 8) + 6)]), ((bfloat16_t)acc1[((i_7 * 8) + 7)])));
      }
      tl::__sync_thread_partial(3, 256);
      if (((int)threadIdx.x) == 128) {
        tl::fence_proxy_async();
        #pragma unroll
        for (int i_9 = 0; i_9 < 2; ++i_9) {
          tl::tma_store(C_desc, (&(c1_s[(i_9 * 8192)])), (((bx * 256) + (i_9 * 64)) + 128), (by * 128));
        }
        tl::tma_store_arrive();
      }
      e = e_next;
      t = t_next;
      bx = bx_next;
      by = by_next;
      sbx = sbx_next;
    }
    if (((int)threadIdx.x) == 128) {
      tl::tma_store_wait<0, true>();  // no store may still read shared memory when the CTA exits
    }
  }
}
