#!/usr/bin/env python3
"""How fast the SMs can read from L2 and from DRAM: a ceiling for kernels that stream their operands from L2.

python benchmarks/bench_l2_read.py [--out DIR] [--dram-sizes-mb 8,16,28,32]   (CUDA GPU, triton)

A Triton kernel whose programs (8 per SM) sum f32 words in 8 KB chunks, the chunks dealt round-robin over the
programs, `passes` times over a buffer: buffers of 8-32 MB stay in the 50 MB L2 after the first pass (64
passes, so the first one's DRAM reads weigh little), a 2 GiB buffer is read once from DRAM. Device time from a
profiler trace (`bench_kernels.bench`), bytes read / time. Writes l2_read.json under --out.

Then the DRAM reads of small buffers, cold: each call reads one of enough buffers of that size that together
they pass the L2 several times over, once, with 2, 4 and 8 programs per SM; and XLA's elementwise pass over the
same buffers (read + written). A decode GEMM must read its weights once (FP8 at n 4096: 8, 16, 28 and 32 MiB
at k 2048, 4096, 7168 and 8192), so the fastest of these reads, as a share of the run's copy bandwidth
(`bench_kernels.measure_ceilings`, 2 GiB), is what any kernel at that size can reach at most.

Why: the 128x256 FP8 prefill kernel takes 48 KB from L2 per CTA and k block. At 4096^3 that is 805 MB in
about 117 us, 6.9 TB/s; if that is near what L2 can deliver, only fewer bytes per FLOP (a weight tile
multicast to two CTAs) can make it faster.
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

CHUNK = 2048  # f32 words a program reads per step (8 KB: 16 words a thread at 4 warps)
PROGRAMS_PER_SM = 8


@triton.jit
def read_sum(x_ptr, out_ptr, CHUNKS: tl.constexpr, PASSES: tl.constexpr, CHUNK_WORDS: tl.constexpr):
    """out[program] = the sum of the chunks c = program, program + programs, ... < CHUNKS * PASSES (chunk
    c % CHUNKS of x)."""
    pid = tl.program_id(0)
    acc = tl.zeros([CHUNK_WORDS], tl.float32)
    for i in range(pid, CHUNKS * PASSES, tl.num_programs(0)):
        acc += tl.load(x_ptr + (i % CHUNKS) * CHUNK_WORDS + tl.arange(0, CHUNK_WORDS))
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


def reader(words: int, passes: int, programs: int):
    """fn(x f32[words]) -> f32[programs], the kernel launched through the FFI library."""
    from djax.ffi import cubin

    if words % CHUNK:
        raise ValueError(f"words must be a multiple of {CHUNK}")
    constexprs = dict(CHUNKS=words // CHUNK, PASSES=passes, CHUNK_WORDS=CHUNK)
    kern = cubin.compile_triton(read_sum, ["x_ptr", "out_ptr"], [np.float32, np.float32], constexprs, 4, 3)

    def fn(x):
        return cubin.launch(kern, (programs,), [x], [jax.ShapeDtypeStruct((programs,), jnp.float32)])[0]

    return fn


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    p.add_argument("--dram-sizes-mb", default="8,16,28,32", help="MiB; empty for none")
    args = p.parse_args()
    from bench_kernels import bench, measure_ceilings

    sms = jax.devices()[0].core_count if hasattr(jax.devices()[0], "core_count") else 132
    programs = PROGRAMS_PER_SM * sms
    res = dict(device=jax.devices()[0].device_kind, date=time.strftime("%Y-%m-%d %H:%M:%S"), sms=sms, rows=[])
    for mb, passes in ((8, 64), (16, 64), (32, 64), (2048, 1)):
        words = mb * (1 << 20) // 4
        x = jax.random.uniform(jax.random.key(mb), (words,), jnp.float32)
        fn = reader(words, passes, programs)
        got = float(jnp.sum(jax.jit(fn)(x)))
        want = float(jnp.sum(x)) * passes
        ok = abs(got - want) <= 1e-3 * abs(want)
        wall, dev, _ = bench(fn, [(x,)], trace=True)
        secs = dev or wall
        row = dict(buffer_mb=mb, passes=passes, programs=programs, us=round(secs * 1e6, 2), sum_ok=ok)
        row["tb_per_s"] = round(words * 4 * passes / secs / 1e12, 3)
        res["rows"].append(row)
        print(row, flush=True)
    copy_bw, _ = measure_ceilings()
    res["copy_tb_per_s"] = round(copy_bw / 1e12, 3)
    sizes = [float(v) for v in args.dram_sizes_mb.split(",") if v]
    res["dram_reads"] = dram_read_rows(sizes, sms, res["copy_tb_per_s"])
    with open(os.path.join(args.out, "l2_read.json"), "w") as f:
        json.dump(res, f, indent=1)


def dram_read_rows(sizes_mib, sms, copy_tb_per_s: float) -> list[dict]:
    """Per size: the read kernel's best device time over 2, 4 and 8 programs per SM and XLA's elementwise
    pass, each call on the next of enough buffers to pass the L2 (50 MB) more than three times."""
    from bench_kernels import bench

    rows = []
    for mib in sizes_mib:
        words = int(mib * (1 << 20)) // 4 // CHUNK * CHUNK
        n_sets = max(4, -(-160 * (1 << 20) // (words * 4)))
        xs = [jax.random.uniform(jax.random.key(i), (words,), jnp.float32) for i in range(n_sets)]
        want = float(jnp.sum(xs[0]))
        row = dict(buffer_mib=mib, bytes=words * 4, sets=n_sets, read_us={})
        for per_sm in (2, 4, 8):
            fn = reader(words, 1, per_sm * sms)
            got = float(jnp.sum(jax.jit(fn)(xs[0])))
            if abs(got - want) > 1e-3 * abs(want):
                raise AssertionError(f"read kernel sum {got} != {want} at {mib} MiB")
            wall, dev, _ = bench(fn, [(x,) for x in xs], trace=True)
            row["read_us"][per_sm] = round((dev or wall) * 1e6, 2)
        best = min(row["read_us"].values())
        wall, dev, _ = bench(lambda a: a * 1.0001, [(x,) for x in xs], trace=True)
        row["xla_pass_us"] = round((dev or wall) * 1e6, 2)
        row["best_read_us"] = best
        row["best_read_tb_per_s"] = round(words * 4 / best / 1e6, 3)
        row["best_read_of_copy"] = round(words * 4 / best / 1e6 / copy_tb_per_s, 3)
        row["xla_pass_of_copy"] = round(2 * words * 4 / row["xla_pass_us"] / 1e6 / copy_tb_per_s, 3)
        rows.append(row)
        print(row, flush=True)
        del xs
    return rows


if __name__ == "__main__":
    main()
