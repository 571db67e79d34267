#!/usr/bin/env python3
"""How fast one CTA per SM can gather rows of 1 KB into shared memory: the sparse decode attention's key loads.

python benchmarks/bench_gather.py [--out DIR] [--build]   (CUDA GPU, nvcc; --build compiles only)

128 CTAs (batch 64 with 2 splits) each gather 5 blocks of 64 random rows of 512 bf16 (1 KB, the key width)
from a 128 MB pool (64 rows' regions of 2,048 entries, as the compressed cache) into a ring of 64 KB stages,
a consumer warpgroup reading each block once and freeing its stage. Ways of loading a block:
- `cp_async`: 4,096 copies of 16 bytes by the 128 producer threads into the 128-byte-swizzled K-major layout
  wgmma reads (the attention kernel's way), 2 or 3 stages;
- `tma_box`: one TMA tensor copy per 128 bytes (a 64 x 1 box, 128-byte swizzle), 512 per block, landing in
  the same layout: TMA swizzles by the destination's shared-memory address, so a one-row box at row r of an
  8-row atom lands where wgmma expects it (the layout is checked);
- `bulk`: one bulk copy of 1 KB per row (cp.async.bulk), linear rows, 2 or 3 stages: wgmma cannot read that
  layout, so a kernel would still have to rearrange it in shared memory;
- `bulk_relaid`: that rearrangement: blocks of 32 rows by bulk copy into a linear ring of two 32 KB stages,
  which the producer threads copy, 16 bytes at a time, into the swizzled layout of a second such ring;
- `mixed_N`: the first N rows of each block by TMA boxes, the others by cp.async, both into the swizzled
  layout and completing on one barrier: whether the two paths' limits add up;
- `cp_async_l2_128`, `_l2_256`, `cp_async_ca`: the kernel's cp.async with an L2 prefetch-size hint (the whole
  128- or 256-byte span fetched on a miss) or through L1 (.ca) instead of L2 only (.cg);
- `half_*`: the CTA pair's loads (the attention's default): each CTA of a pair gathers its half (512 bytes) of
  the pair's 640 rows, 10 blocks of 64 into 4 stages of 32 KB, rows with n % 37 == 5 masked (zero-filled, not
  read): `half_cp_async` as the pair does, `half_bulk` one bulk copy per half row (linear, none masked: the
  ceiling at that size), `half_bulk_relaid_lagN` those bulk copies, each landing in its 8-row group's kilobytes,
  rewritten in place into the swizzled layout by the producer's warps (a group each at a time, no barrier
  across warps), N blocks behind the copies they issue (the attention's `bulk_keys` option).
CTA 0's last block is compared with the layout expected from the pool. Time: the first CTA's start to the
last CTA's end (%globaltimer), median of 25 launches over alternating pools and index sets; bytes are the
rows read (masked rows are not). Writes gather.json (and gather.png) under --out.
"""

import argparse
import datetime
import hashlib
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

CTAS, BLOCKS, ROW_ELEMS, REGION = 128, 5, 512, 2048
STAGE_BYTES = 64 * ROW_ELEMS * 2
VARIANTS = {  # kernel name: (mode, stages); mode 0 cp.async, 1 one TMA box per 128 bytes, 2 a bulk copy per row
    "cp_async": (0, 2),
    "cp_async_3_stages": (0, 3),
    "tma_box": (1, 2),
    "bulk": (2, 2),
    "bulk_3_stages": (2, 3),
    "bulk_relaid": (3, 2),  # bulk copies into a linear ring, rearranged by the producer into a swizzled one
    "mixed_16": (4, 2),  # mode 4: TMA boxes for the block's first N rows, cp.async for the rest
    "mixed_24": (4, 2),
    "mixed_32": (4, 2),
    "cp_async_l2_128": (0, 2),  # the same cp.async with .L2::128B (the kernel template argument HINT)
    "cp_async_l2_256": (0, 2),
    "cp_async_ca": (0, 2),
    # the CTA pair's half rows (512 bytes), 10 blocks of 64 a CTA into 4 stages of 32 KB; modes 5-7 = half modes 0-2
    "half_cp_async": (5, 4),
    "half_bulk": (6, 4),
    "half_bulk_relaid_lag2": (7, 4),
    "half_bulk_relaid_lag3": (7, 4),
}
HALF_BLOCKS, HALF_STAGE_BYTES = 10, 32 * 1024

SOURCE = r"""
#include <cstdint>
#include <cuda.h>
#define BLOCKS 5
#define STAGE_BYTES 65536

__device__ __forceinline__ uint32_t smem(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ long long gtime() {
  long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ void bar_init(uint64_t* b, int n) {
  asm volatile("mbarrier.init.shared.b64 [%0], %1;" ::"r"(smem(b)), "r"(n));
}
__device__ __forceinline__ void bar_wait(uint64_t* b, int parity) {
  asm volatile("{\n .reg .pred p;\n W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra W;\n}"
               ::"r"(smem(b)), "r"(parity) : "memory");
}
__device__ __forceinline__ void bar_arrive(uint64_t* b) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem(b)) : "memory");
}
__device__ __forceinline__ void bar_expect(uint64_t* b, int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem(b)), "r"(bytes) : "memory");
}

// The consumer warpgroup (threads 0-127) of every variant: reads each block of the ring once (a checksum, so the
// loads cannot be skipped), CTA 0 dumps its last block for the layout check, frees the stage; then the CTA's end
// time.
template <int NBLK, int STAGES, int BYTES>
__device__ __forceinline__ void consume(const unsigned char* ring, uint64_t* full, uint64_t* empty, unsigned* sums,
                                        long long* times, uint16_t* dump) {
  int tid = threadIdx.x, bid = blockIdx.x;
  unsigned acc = 0;
  for (int g = 0; g < NBLK; ++g) {
    int st = g % STAGES;
    bar_wait(&full[st], (g / STAGES) & 1);
    const uint4* v = reinterpret_cast<const uint4*>(ring + st * BYTES);
#pragma unroll 4
    for (int q = 0; q < BYTES / 16 / 128; ++q) {
      uint4 x = v[q * 128 + tid];
      acc += x.x ^ x.y ^ x.z ^ x.w;
    }
    if (g == NBLK - 1 && bid == 0) {
      const uint16_t* s16 = reinterpret_cast<const uint16_t*>(ring + st * BYTES);
      for (int q = tid; q < BYTES / 2; q += 128) dump[q] = s16[q];
    }
    bar_arrive(&empty[st]);
  }
  sums[bid * 128 + tid] = acc;
  asm volatile("bar.sync 1, 128;" ::: "memory");
  if (tid == 0) times[2 * bid + 1] = gtime();
}

// Threads 128-255 load, 0-127 read each block (a checksum) and free its stage. Stage layout for modes 0 and 1:
// 8 chunks of 64 columns, each 64 rows x 128 bytes, 16-byte units XOR-swizzled by (row & 7); mode 2: 64 rows of
// 1 KB.
// a 16-byte cp.async of mode 0: HINT 0 .cg, 1 .cg with .L2::128B, 2 .cg with .L2::256B, 3 .ca
template <int HINT>
__device__ __forceinline__ void copy16(uint32_t dst, const void* src) {
  if (HINT == 1) asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
  else if (HINT == 2) asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
  else if (HINT == 3) asm volatile("cp.async.ca.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
  else asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}

template <int MODE, int STAGES, int TMA_ROWS = 0, int HINT = 0>
__device__ __forceinline__ void gather(const CUtensorMap* desc, const uint16_t* pool, const int* idx, unsigned* sums,
                                       long long* times, uint16_t* dump) {
  extern __shared__ __align__(1024) unsigned char buf[];
  __shared__ __align__(8) uint64_t full[STAGES], empty[STAGES];
  int tid = threadIdx.x, bid = blockIdx.x;
  if (tid == 0) {
    times[2 * bid] = gtime();
    for (int s = 0; s < STAGES; ++s) {
      bar_init(&full[s], MODE == 0 || MODE == 4 ? 128 : 1);
      bar_init(&empty[s], 128);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    if (MODE == 1 || MODE == 4) asm volatile("prefetch.tensormap [%0];" ::"l"(desc) : "memory");
  }
  __syncthreads();
  const int* rows = idx + bid * BLOCKS * 64;
  if (tid >= 128) {
    int p = tid - 128;
    for (int g = 0; g < BLOCKS; ++g) {
      int st = g % STAGES;
      bar_wait(&empty[st], ((g / STAGES) & 1) ^ 1);
      uint32_t base = smem(buf) + st * STAGE_BYTES;
      if (MODE == 2) {
        if (p == 0) bar_expect(&full[st], STAGE_BYTES);
        if (p < 64) {
          asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], 1024, [%2];"
                       ::"r"(base + p * 1024), "l"(pool + (size_t)rows[g * 64 + p] * 512), "r"(smem(&full[st]))
                       : "memory");
        }
      } else if (MODE == 1) {
        if (p == 0) bar_expect(&full[st], STAGE_BYTES);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          int i = q * 128 + p, r = i / 8, c = i % 8;
          asm volatile(
              "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
              ::"r"(base + c * 8192 + r * 128), "l"(desc), "r"(c * 64), "r"(rows[g * 64 + r]), "r"(smem(&full[st]))
              : "memory");
        }
      } else if (MODE == 4) {
        // the expected bytes before this thread's own arrive below, which the phase waits for
        if (p == 0)
          asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;"
                       ::"r"(smem(&full[st])), "r"(TMA_ROWS * 1024) : "memory");
#pragma unroll
        for (int q = 0; q < (TMA_ROWS * 8 + 127) / 128; ++q) {
          int i = q * 128 + p, r = i / 8, c = i % 8;
          if (i < TMA_ROWS * 8)
            asm volatile(
              "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
              ::"r"(base + c * 8192 + r * 128), "l"(desc), "r"(c * 64), "r"(rows[g * 64 + r]), "r"(smem(&full[st]))
              : "memory");
        }
#pragma unroll 8
        for (int q = 0; q < (64 - TMA_ROWS) / 2; ++q) {
          int i = q * 128 + p, r = TMA_ROWS + i / 64, u = i % 64, c = u / 8, j = u % 8;
          uint32_t dst = base + c * 8192 + r * 128 + ((j ^ (r & 7)) * 16);
          asm volatile("cp.async.cg.shared.global [%0], [%1], 16;"
                       ::"r"(dst), "l"(pool + (size_t)rows[g * 64 + r] * 512 + u * 8) : "memory");
        }
        asm volatile("cp.async.mbarrier.arrive.noinc.shared.b64 [%0];" ::"r"(smem(&full[st])) : "memory");
      } else {
#pragma unroll 8
        for (int q = 0; q < 32; ++q) {
          int i = q * 128 + p, r = i / 64, u = i % 64, c = u / 8, j = u % 8;
          uint32_t dst = base + c * 8192 + r * 128 + ((j ^ (r & 7)) * 16);
          copy16<HINT>(dst, pool + (size_t)rows[g * 64 + r] * 512 + u * 8);
        }
        asm volatile("cp.async.mbarrier.arrive.noinc.shared.b64 [%0];" ::"r"(smem(&full[st])) : "memory");
      }
    }
  } else {
    consume<BLOCKS, STAGES, STAGE_BYTES>(buf, full, empty, sums, times, dump);
  }
}

// Bulk copies of whole rows into a linear staging ring, then the producer threads rearrange each block into the
// swizzled layout of a second ring, which the consumers read: blocks of 32 rows (32 KB), two stages of each
// ring, 128 KB of shared memory in all.
__device__ __forceinline__ void gather_relaid(const uint16_t* pool, const int* idx, unsigned* sums, long long* times,
                                              uint16_t* dump) {
  constexpr int ROWS = 32, NB = BLOCKS * 64 / ROWS, BYTES = ROWS * 1024;
  extern __shared__ __align__(1024) unsigned char buf[];
  __shared__ __align__(8) uint64_t staged[2], ready[2], empty[2];
  int tid = threadIdx.x, bid = blockIdx.x;
  const int* rows = idx + bid * BLOCKS * 64;
  if (tid == 0) {
    times[2 * bid] = gtime();
    for (int s = 0; s < 2; ++s) {
      bar_init(&staged[s], 1);
      bar_init(&ready[s], 128);
      bar_init(&empty[s], 128);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  uint32_t stage0 = smem(buf);
  if (tid >= 128) {
    int p = tid - 128;
    for (int g = 0; g < 2; ++g) {  // the first two blocks' rows
      if (p == 0) bar_expect(&staged[g], BYTES);
      if (p < ROWS)
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], 1024, [%2];"
                     ::"r"(stage0 + g * BYTES + p * 1024), "l"(pool + (size_t)rows[g * ROWS + p] * 512),
                     "r"(smem(&staged[g])) : "memory");
    }
    for (int g = 0; g < NB; ++g) {
      int s = g & 1;
      bar_wait(&staged[s], (g >> 1) & 1);
      bar_wait(&empty[s], ((g >> 1) & 1) ^ 1);
#pragma unroll
      for (int q = 0; q < ROWS * 64 / 128; ++q) {  // 16-byte unit u of linear row r -> chunk u / 8, swizzled slot
        int i = q * 128 + p, r = i / 64, u = i % 64, c = u / 8, j = u % 8;
        uint4 v = *reinterpret_cast<const uint4*>(buf + s * BYTES + r * 1024 + u * 16);
        *reinterpret_cast<uint4*>(buf + 2 * BYTES + s * BYTES + c * ROWS * 128 + r * 128 + ((j ^ (r & 7)) * 16)) = v;
      }
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // as wgmma (the async proxy) would need
      bar_arrive(&ready[s]);
      asm volatile("bar.sync 2, 128;" ::: "memory");  // every producer thread has read the staged block
      if (g + 2 < NB) {
        if (p == 0) bar_expect(&staged[s], BYTES);
        if (p < ROWS)
          asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], 1024, [%2];"
                       ::"r"(stage0 + s * BYTES + p * 1024), "l"(pool + (size_t)rows[(g + 2) * ROWS + p] * 512),
                       "r"(smem(&staged[s])) : "memory");
      }
    }
  } else {
    consume<NB, 2, BYTES>(buf + 2 * BYTES, ready, empty, sums, times, dump);
  }
}

// The CTA pair's loads: CTA 2p + z gathers columns [256 z, 256 z + 256) (512 bytes) of the pair's 640 rows, 10
// blocks of 64, into a ring of 32 KB stages laid out as the attention's half tiles (4 chunks of 64 columns, each
// 64 rows x 128 bytes, 16-byte units XOR-swizzled by row & 7). Row n of the pair's 640 is masked when n % 37 == 5
// (its slot zero-filled, as the kernels do for invalid picks). MODE 0: cp.async of 16 bytes (zero-filled when
// masked), the pair's way; 1: one bulk copy of 512 bytes per row into linear rows (all rows, no masking: the
// ceiling of bulk copies at this size); 2: the same bulk copies (masked rows skipped), each row landing in its
// 8-row group's kilobytes (row 8 G + e at chunk e / 2's kilobyte of group G, half e % 2), then, LAG blocks
// behind the copies, each producer warp rewrites its groups in place into the swizzled layout (each lane
// reading its 8 units of a group, __syncwarp, then writing them at their slots, masked rows as zeros), as the
// attention's `bulk_keys` option does.
#define HALF_BLOCKS 10
#define HALF_STAGE 32768
__device__ __forceinline__ bool half_row_valid(int n) { return n % 37 != 5; }

template <int MODE, int STAGES, int LAG>
__device__ __forceinline__ void gather_half(const uint16_t* pool, const int* idx, unsigned* sums, long long* times,
                                            uint16_t* dump) {
  extern __shared__ __align__(1024) unsigned char buf[];
  __shared__ __align__(8) uint64_t staged[STAGES], ready[STAGES], empty[STAGES];
  int tid = threadIdx.x, bid = blockIdx.x;
  const int* rows = idx + (bid & ~1) * BLOCKS * 64;  // the pair's 640 rows (the idx rows of CTAs 2p and 2p + 1)
  const uint16_t* src = pool + (bid & 1) * 256;      // this CTA's half of every row
  if (tid == 0) {
    times[2 * bid] = gtime();
    for (int s = 0; s < STAGES; ++s) {
      bar_init(&staged[s], 64);
      bar_init(&ready[s], 128);
      bar_init(&empty[s], 128);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (tid >= 128) {
    int p = tid - 128;
    if (MODE == 0) {
      for (int g = 0; g < HALF_BLOCKS; ++g) {
        int st = g % STAGES;
        bar_wait(&empty[st], ((g / STAGES) & 1) ^ 1);
        uint32_t base = smem(buf) + st * HALF_STAGE;
#pragma unroll 8
        for (int q = 0; q < 16; ++q) {
          int i = q * 128 + p, r = i / 32, u = i % 32, c = u / 8, j = u % 8, n = g * 64 + r;
          uint32_t dst = base + c * 8192 + r * 128 + ((j ^ (r & 7)) * 16);
          asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                       ::"r"(dst), "l"(src + (size_t)rows[n] * 512 + u * 8), "r"(half_row_valid(n) ? 16 : 0)
                       : "memory");
        }
        asm volatile("cp.async.mbarrier.arrive.noinc.shared.b64 [%0];" ::"r"(smem(&ready[st])) : "memory");
      }
    } else {
      for (int g = 0; g < HALF_BLOCKS + LAG; ++g) {
        if (g < HALF_BLOCKS && p < 64) {  // block g's rows, one bulk copy each
          int st = g % STAGES, n = g * 64 + p, grp = p / 8, e = p % 8;
          bar_wait(&empty[st], ((g / STAGES) & 1) ^ 1);
          uint32_t bar = smem(&staged[st]);
          // MODE 1: linear rows; MODE 2: each row in its group's kilobytes
          uint32_t at = MODE == 1 ? p * 512 : (e / 2) * 8192 + grp * 1024 + (e % 2) * 512;
          if (MODE == 1 || half_row_valid(n)) {
            asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], 512;" ::"r"(bar) : "memory");
            asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], 512, [%2];"
                         ::"r"(smem(buf) + st * HALF_STAGE + at), "l"(src + (size_t)rows[n] * 512), "r"(bar)
                         : "memory");
          } else {
            bar_arrive(&staged[st]);
          }
        }
        int gg = g - LAG;
        if (gg >= 0) {  // block gg landed: rearrange it (MODE 2) and hand it to the consumers
          int st = gg % STAGES;
          bar_wait(&staged[st], (gg / STAGES) & 1);
          if (MODE == 2) {
            int warp = p / 32, lane = p % 32;
            for (int grp = warp; grp < 8; grp += 4) {
              unsigned char* base = buf + st * HALF_STAGE + grp * 1024;
              uint4 v[8];
#pragma unroll
              for (int m = 0; m < 8; ++m)  // row e = m of the group, unit lane
                v[m] = *reinterpret_cast<const uint4*>(base + (m / 2) * 8192 + (m % 2) * 512 + lane * 16);
              __syncwarp();  // the group's units all read before any is overwritten
#pragma unroll
              for (int m = 0; m < 8; ++m) {
                uint4 x = half_row_valid(gg * 64 + grp * 8 + m) ? v[m] : make_uint4(0, 0, 0, 0);
                *reinterpret_cast<uint4*>(base + (lane / 8) * 8192 + m * 128 + (((lane % 8) ^ m) * 16)) = x;
              }
            }
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // as wgmma (the async proxy) would need
          }
          bar_arrive(&ready[st]);
        }
      }
    }
  } else {
    consume<HALF_BLOCKS, STAGES, HALF_STAGE>(buf, ready, empty, sums, times, dump);
  }
}

#define GATHER_HALF(name, mode, stages, lag)                                                                \
  extern "C" __global__ void __launch_bounds__(256, 1) name(const CUtensorMap __grid_constant__ desc,      \
      const uint16_t* pool, const int* idx, unsigned* sums, long long* times, uint16_t* dump) {            \
    gather_half<mode, stages, lag>(pool, idx, sums, times, dump);                                           \
  }
GATHER_HALF(half_cp_async, 0, 4, 0)
GATHER_HALF(half_bulk, 1, 4, 2)
GATHER_HALF(half_bulk_relaid_lag2, 2, 4, 2)
GATHER_HALF(half_bulk_relaid_lag3, 2, 4, 3)

extern "C" __global__ void __launch_bounds__(256, 1) bulk_relaid(const CUtensorMap __grid_constant__ desc,
    const uint16_t* pool, const int* idx, unsigned* sums, long long* times, uint16_t* dump) {
  gather_relaid(pool, idx, sums, times, dump);
}

#define GATHER(name, mode, stages, rows, hint)                                                              \
  extern "C" __global__ void __launch_bounds__(256, 1) name(const CUtensorMap __grid_constant__ desc,      \
      const uint16_t* pool, const int* idx, unsigned* sums, long long* times, uint16_t* dump) {            \
    gather<mode, stages, rows, hint>(&desc, pool, idx, sums, times, dump);                                  \
  }
GATHER(cp_async, 0, 2, 0, 0)
GATHER(cp_async_3_stages, 0, 3, 0, 0)
GATHER(tma_box, 1, 2, 0, 0)
GATHER(bulk, 2, 2, 0, 0)
GATHER(bulk_3_stages, 2, 3, 0, 0)
GATHER(mixed_16, 4, 2, 16, 0)
GATHER(mixed_24, 4, 2, 24, 0)
GATHER(mixed_32, 4, 2, 32, 0)
GATHER(cp_async_l2_128, 0, 2, 0, 1)
GATHER(cp_async_l2_256, 0, 2, 0, 2)
GATHER(cp_async_ca, 0, 2, 0, 3)
"""


def compile_cubin() -> bytes:
    from djax.kernels.dispatch import nvcc_path

    nvcc = nvcc_path()
    if nvcc is None:
        raise RuntimeError("nvcc not found: set CUDA_HOME")
    with tempfile.TemporaryDirectory() as tmp:
        src, out = os.path.join(tmp, "gather.cu"), os.path.join(tmp, "gather.cubin")
        with open(src, "w") as f:
            f.write(SOURCE)
        run = subprocess.run(
            [nvcc, "-cubin", "-arch=sm_90a", "-O3", src, "-o", out], capture_output=True, text=True
        )
        if run.returncode:
            raise RuntimeError(f"nvcc failed:\n{run.stderr[-3000:]}")
        with open(out, "rb") as f:
            return f.read()


def swizzled(block: np.ndarray) -> np.ndarray:
    """Rows of 64 x `chunks` values as the attention's key ring holds them (512 values: 8 chunks; the CTA pair's
    half rows of 256: 4): each chunk of 64 columns, the rows' 128 bytes, 16-byte units (8 values) XOR-swizzled
    by row & 7; flat."""
    rows, chunks = block.shape[0], block.shape[1] // 64
    units = block.reshape(rows, chunks, 8, 8)  # row, chunk, unit, value
    out = np.empty((chunks, rows, 8, 8), block.dtype)  # chunk, row, unit slot, value
    for r in range(rows):
        out[:, r, np.arange(8) ^ (r & 7)] = units[r]
    return out.reshape(-1)


def half_row_valid(n: np.ndarray) -> np.ndarray:
    """The half-row variants' mask over a pair's 640 rows (the kernel's `half_row_valid`)."""
    return n % 37 != 5


def expected_dump(mode: int, pool: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """What CTA 0's last block must hold in shared memory, flat, for a variant's mode."""
    if mode < 5:  # whole rows: CTA 0's 5th block
        last = pool[idx[0, (BLOCKS - 1) * 64 :]]
        if mode == 3:  # the last 32 rows, in a 32 KB stage
            return swizzled(last[32:])
        return last.reshape(-1) if mode == 2 else swizzled(last)
    n = np.arange((HALF_BLOCKS - 1) * 64, HALF_BLOCKS * 64)  # the pair's last block of its 640 rows
    block = pool[idx[:2].reshape(-1)[n], :256].copy()  # CTA 0: the first half of each row
    if mode == 6:  # linear rows, none masked
        return block.reshape(-1)
    block[~half_row_valid(n)] = 0
    return swizzled(block)


def run(out_dir: str) -> dict:
    import jax

    jax.config.update("jax_enable_x64", True)  # the %globaltimer stamps are int64
    import jax.numpy as jnp

    from djax.ffi import tma

    binary = compile_cubin()
    pool_rows = 64 * REGION
    desc = tma.TensorMap(buffer=0, dtype=9, dims=(ROW_ELEMS, pool_rows), strides=(2, 2 * ROW_ELEMS), box=(64, 1),
                         element_strides=(1, 1), interleave=0, swizzle=3, l2_promotion=2, oob_fill=0)  # fmt: skip
    rng = np.random.default_rng(0)
    pools = [rng.integers(0, 65535, (pool_rows, ROW_ELEMS), dtype=np.uint16) for _ in range(2)]
    idxs = [
        np.stack([(c // 2) * REGION + rng.choice(REGION, BLOCKS * 64, replace=False) for c in range(CTAS)]).astype(np.int32)
        for _ in range(4)
    ]  # fmt: skip
    dev_pools, dev_idxs = [jnp.asarray(p) for p in pools], [jnp.asarray(i) for i in idxs]
    outs = [
        jax.ShapeDtypeStruct((CTAS * 128,), jnp.uint32),
        jax.ShapeDtypeStruct((2 * CTAS,), jnp.int64),
        jax.ShapeDtypeStruct((STAGE_BYTES // 2,), jnp.uint16),
    ]
    gathered = CTAS * BLOCKS * 64 * ROW_ELEMS * 2
    masked = CTAS // 2 * int((~half_row_valid(np.arange(HALF_BLOCKS * 64))).sum()) * ROW_ELEMS * 2
    result = dict(
        device=jax.devices()[0].device_kind,
        jax=jax.__version__,
        date=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%MZ"),
        what=__doc__.split("\n\n")[2].replace("\n", " "),
        bytes_gathered=gathered,
        variants={},
    )
    for name, (mode, stages) in VARIANTS.items():
        key = f"gather-{name}-{hashlib.sha256(binary).hexdigest()[:16]}"
        # mode 3: four 32 KB stages; the half-row modes: 32 KB stages
        shared = 2 * STAGE_BYTES if mode == 3 else stages * (HALF_STAGE_BYTES if mode >= 5 else STAGE_BYTES)
        kern = tma.TmaKernel(key, name, binary, (CTAS, 1, 1), 256, shared, (desc, 0, 1, 2, 3, 4))
        fn = jax.jit(lambda p, i, kern=kern: tma.launch(kern, [p, i], outs))
        _, _, dump = fn(dev_pools[0], dev_idxs[0])
        want = expected_dump(mode, pools[0], idxs[0])
        layout_ok = bool((np.asarray(dump)[: want.size] == want).all())
        moved = gathered - masked if mode in (5, 7) else gathered  # masked rows are not read
        spans = []
        for it in range(30):
            _, t, _ = fn(dev_pools[it % 2], dev_idxs[it % 4])
            t = np.asarray(t).reshape(CTAS, 2)
            spans.append(int(t[:, 1].max() - t[:, 0].min()))
        spans = spans[5:]
        us = float(np.median(spans)) / 1e3
        result["variants"][name] = dict(
            stages=stages,
            layout_ok=layout_ok,
            us_median=us,
            us_min=min(spans) / 1e3,
            bytes=moved,
            tb_per_s=moved / us / 1e6,
        )
        print(name, result["variants"][name], flush=True)
    with open(os.path.join(out_dir, "gather.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot(result, os.path.join(out_dir, "gather.png"))
    return result


def plot(result: dict, path: str) -> None:
    """One bar per way of loading: TB/s of rows gathered. Skipped where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    names = list(result["variants"])
    rates = [result["variants"][n]["tb_per_s"] for n in names]
    fig, ax = plt.subplots(figsize=(7, 2.8))
    ax.barh(names, rates, color="tab:blue")
    for y, (n, r) in enumerate(zip(names, rates, strict=True)):
        ax.text(r, y, f" {r:.2f} TB/s, {result['variants'][n]['us_median']:.1f} us", va="center", fontsize=8)
    ax.set_xlabel("rows gathered into shared memory, TB/s (128 CTAs x 320 KB)")
    ax.set_xlim(0, max(rates) * 1.45)
    ax.set_title(f"{result['device']}, {result['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    p.add_argument("--build", action="store_true", help="compile only (nvcc, no GPU)")
    args = p.parse_args()
    if args.build:
        print(len(compile_cubin()), "bytes")
        return
    run(args.out)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
