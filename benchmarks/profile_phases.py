"""Where the time goes inside one CTA: phase timestamps of the FP8 decode GEMM (m 64, n 4096, k 7168) and the
sparse decode attention (b 64, 64 heads x 512, W 128, top 512 of 2048; 2 key splits, the merge pushed) at
those tilings.

python benchmarks/profile_phases.py [--out DIR] [--launches 8]      (CUDA GPU, TileLang and nvcc)
python benchmarks/profile_phases.py --build                          (compiles only: no GPU needed)

Each kernel's lowered CUDA gets `clock64()` reads at named points (the thread that reaches the point first
in program order: a consumer's thread 0, the producer's first thread) into a small shared array, and at the
end one thread per chosen CTA (blockIdx.x a multiple of 21, every split) prints them with the CTA's
%globaltimer at its start and at the print. The launches' output is captured from the process's stdout;
the JSON has, per kernel, the median cycles from the CTA's start to each point, the median CTA life in ns
and the SM clock that implies. The instrumented kernels are slower than the real ones (the print, more
registers), so the parts are indicative; the points are where they sit in the lowered source.
"""

import argparse
import datetime
import hashlib
import json
import os
import re
import sys
import tempfile

import numpy as np

DECODE = (64, 4096, 7168)
ATTN = (64, 64, 512, 128, 2048, 512)  # b, h, k, W, C, T
PICK = "blockIdx.x % 21 == 0"

_TIMER = r"""
__device__ __forceinline__ long long djax_globaltimer() {
  long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
"""


def stamp(slot: int, thread: int = 0) -> str:
    return f"if (threadIdx.x == {thread}) djax_t[{slot}] = clock64();"


def insert_after(source: str, anchor: str, code: str, nth: int = 0) -> str:
    """`code` on its own line after the nth occurrence of `anchor` (which must end with a newline)."""
    at = -1
    for _ in range(nth + 1):
        at = source.index(anchor, at + 1)
    at += len(anchor)
    indent = re.match(r" *", anchor.splitlines()[-1]).group(0)
    return source[:at] + indent + code + "\n" + source[at:]


def with_timestamps(source: str, name: str, points: int) -> str:
    """The shared array, the start stamps and, at the kernel's end, the print (after a CTA-wide barrier)."""
    head = source.index('extern "C" __global__ void __launch_bounds__')
    body = source.index("{\n", head) + 2
    n = points + 1
    start = (
        f"  __shared__ long long djax_t[{n + 1}];\n"
        f"  if (threadIdx.x == 0) {{ djax_t[0] = clock64(); djax_t[{n}] = djax_globaltimer(); }}\n"
    )
    source = source[:body] + start + source[body:]
    end = source.rindex("}")  # the kernel is the file's last function
    values = ", ".join(
        [f"djax_t[{j}] - djax_t[0]" for j in range(1, n)] + [f"djax_t[{n}]", "djax_globaltimer()"]
    )
    fmt = " ".join(["%lld"] * (points + 2))
    tail = (
        f"  __syncthreads();\n  if (threadIdx.x == 0 && ({PICK})) "
        f'printf("DJAXT {name} %d %d {fmt}\\n", (int)blockIdx.x, (int)blockIdx.z, {values});\n'
    )
    from djax.kernels.tilelang_build import with_device_code

    return with_device_code(source[:end] + tail + source[end:], _TIMER)


def decode_source():
    """The FP8 decode default (k groups, split 2 summed in a cluster, pushed by bulk copies or straight from
    the registers) with its points; (source, launch, names). The points inside `djax_push_sum` /
    `djax_push_regs` are not stamped (the shared array is the kernel's): "groupN_staged" is where group N
    calls it (its sum staged in shared memory by the bulk push; its k loop done with the register push)."""
    from djax.kernels import fp8_gemm_tilelang as F

    t = F.default_ws_tiling(*DECODE)
    if not t.push_sum:
        raise NotImplementedError(f"the points are placed for the pushed cluster sum, not {t}")
    kps, turns = DECODE[2] // 128 // t.split_k, -(-(DECODE[2] // 128 // t.split_k) // t.k_groups)
    src, launch = F.lowered_on_disk("fp8_gemm_ws", (*DECODE, t), F.lower_ws, F.ws_sources(t))
    names = ["barrier_init_done", "producer_first_tma", "producer_last_tma", "group0_first_block",
             "group0_last_block", "group0_staged", "group1_staged", "group0_end"]  # fmt: skip
    s = insert_after(src, "  tl::fence_barrier_init();\n  __syncthreads();\n", stamp(1))
    ring = t.stages - 1
    s = re.sub(
        rf"(tl::tma_load(?:<[^>]*>)?\(B_desc, full\[\(j & {ring}\)\][^\n]*\n)",  # with or without a cache hint
        rf"\1        if (j == 0) djax_t[2] = clock64(); if (j == {kps - 1}) djax_t[3] = clock64();\n",
        s,
    )
    wait = re.search(r"        full\[\(\(i_2 & \d+\) \* 2\)\]\.wait\([^\n]*\n", s).group(0)
    s = insert_after(s, wait, f"if (threadIdx.x == 0) {{ if (i_2 == 0) djax_t[4] = clock64(); "
                     f"if (i_2 == {turns - 1}) djax_t[5] = clock64(); }}")  # fmt: skip
    # each group's call of the exchange, once its sum is staged (group 0's comes first in the source)
    calls = re.findall(r"      djax_push_(?:sum|regs)<[^\n]*\n", s)
    if len(calls) != 2 or calls[0].split("<")[0] != calls[1].split("<")[0]:  # one function, once per group
        raise NotImplementedError("unexpected calls of the cluster's sum in the lowered source")
    first = s.index(calls[0])
    second = s.index(calls[1], first + 1)
    s = s[:second] + "      " + stamp(7, thread=128) + "\n" + s[second:]
    stamped = f"      {stamp(6)}\n{calls[0]}      {stamp(8)}\n"
    s = s[:first] + stamped + s[first + len(calls[0]) :]
    return with_timestamps(s, "decode", len(names)), launch, names


def attention_source():
    """The sparse decode at b 64 with 2 key splits and the merge pushed from registers (the default before the
    head-dim pair); (source, launch, names).
    The points inside `djax_push_merge` are not stamped (the shared array is the kernel's): each consumer
    warpgroup's call of it ends its CTA's part of the merge (sending for one, storing for the other)."""
    from djax.kernels import sparse_attn_tilelang as S

    b, h, k, w, c, t = ATTN
    tiling = S.Tiling(64, 2, 384, 2, merge=True, push=True)
    blocks = (-(-w // tiling.block_s) + -(-t // tiling.block_s)) // tiling.nsplit  # key blocks per split
    src, launch = S._lowered_on_disk(b, h, k, w, c, t, k**-0.5, tiling)
    names = (
        ["slot_table_done"]
        + [f"producer_issued_{g}" for g in range(blocks)]
        + [f"softmax_ready_{g}" for g in range(blocks)]
        + ["softmax_loop_done", "softmax_merge_done", "other_loop_done", "other_merge_done"]
    )
    ready, done = 2 + blocks, 2 + 2 * blocks
    s = insert_after(src, "  __syncthreads();\n", stamp(1), nth=1)  # the second: after the slot table
    s = insert_after(s, "      tl::mbarrier_cp_async_arrive_noinc(ready[(g & 1)]);\n",
                     "if (threadIdx.x == 256) djax_t[2 + g] = clock64();")  # fmt: skip
    s = insert_after(s, "        ready[(g_1 & 1)].wait(((g_1 >> 1) & 1));\n",
                     f"if (threadIdx.x == 0) djax_t[{ready} + g_1] = clock64();")  # fmt: skip
    s = insert_after(s, "      l_ready[0].arrive();\n", stamp(done))
    calls = re.findall(r"      djax_push_merge<[^\n]*\n", s)
    if len(calls) != 2:  # one call per consumer warpgroup, the softmax one's first
        raise NotImplementedError("unexpected calls of the pushed merge in the lowered source")
    s = s.replace(calls[0], calls[0] + "      " + stamp(done + 1) + "\n", 1)
    s = insert_after(s, "      l_ready[0].wait(0);\n", stamp(done + 2, thread=128))
    s = s.replace(calls[1], calls[1] + "      " + stamp(done + 3, thread=128) + "\n", 1)
    return with_timestamps(s, "attention", len(names)), launch, names


def summarize(lines: list[str], name: str, names: list[str]) -> dict:
    rows = np.array([list(map(int, ln.split()[2:])) for ln in lines if ln.startswith(f"DJAXT {name} ")])
    rows = rows[len(rows) // 4 :]  # past the first launches (module load, cold TLBs)
    cycles, life = rows[:, 2:-2], rows[:, -1] - rows[:, -2]
    return dict(
        ctas_sampled=len(rows),
        cta_life_ns_median=float(np.median(life)),
        sm_clock_ghz=round(float(np.median(cycles[:, -1] / life)), 3),  # the last point: the group's end
        cycles_since_cta_start_median={
            n: int(v) for n, v in zip(names, np.median(cycles, axis=0), strict=True)
        },
    )


def run(out_dir: str, launches: int) -> dict:
    import jax
    import jax.numpy as jnp
    from bench_kernels import attn_sets
    from bench_moe import timing_sets
    from bench_tilelang import make_sets

    from djax.ffi import cubin, tma
    from djax.ffi.cubin import Cubin
    from djax.kernels.sparse_attn import kernel_operands
    from djax.kernels.tilelang_build import nvcc_cubin

    (dsrc, dlaunch, dnames), (asrc, alaunch, anames) = decode_source(), attention_source()
    dbin, abin = nvcc_cubin(dsrc), nvcc_cubin(asrc)
    dkern = tma.TmaKernel("phases-" + hashlib.sha256(dbin).hexdigest()[:16], dlaunch["name"], dbin,
                          dlaunch["grid"], dlaunch["threads"], dlaunch["shared_bytes"], dlaunch["params"])  # fmt: skip
    acub = Cubin("phases-" + hashlib.sha256(abin).hexdigest()[:16], alaunch["name"], abin, alaunch["threads"],
                 alaunch["shared_bytes"], extra_null=0)  # fmt: skip
    m, n, k = DECODE
    b, h, kd = ATTN[:3]
    nsplit = alaunch["grid"][2]

    @jax.jit
    def decode(a, sa, bw, sb):
        out = jax.ShapeDtypeStruct((m, n), jnp.bfloat16)
        return tma.launch(dkern, [a, sa.astype(jnp.float32), bw, sb.astype(jnp.float32)], out)

    @jax.jit
    def attention(q, win, valid, pool, top, sinks):
        args = kernel_operands(q, win, valid, pool, top, sinks, valid_dtype=jnp.bool_)
        outs = [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, nsplit, h), jnp.float32)]
        return cubin.launch(acub, alaunch["grid"], args, outs)[0]

    dsets, asets = make_sets(timing_sets(m), m, n, k), attn_sets(6, *ATTN)
    sys.stdout.flush()
    with tempfile.TemporaryFile("w+") as cap:  # the device printf writes to the process's fd 1
        saved = os.dup(1)
        os.dup2(cap.fileno(), 1)
        try:
            for i in range(launches):
                jax.block_until_ready(decode(*dsets[i % len(dsets)]))
            for i in range(launches):
                jax.block_until_ready(attention(*asets[i % len(asets)]))
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
        cap.seek(0)
        lines = cap.read().splitlines()
    result = dict(
        device=jax.devices()[0].device_kind,
        jax=jax.__version__,
        date=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%MZ"),
        what=__doc__.split("\n\n")[2].replace("\n", " "),
        decode=dict(shape=f"m{m} n{n} k{k}", **summarize(lines, "decode", dnames)),
        attention=dict(shape=f"b{b} h{h} k{kd} W{ATTN[3]} C{ATTN[4]} T{ATTN[5]}", **summarize(lines, "attention", anames)),
    )  # fmt: skip
    with open(os.path.join(out_dir, "phases.json"), "w") as f:
        json.dump(result, f, indent=1)
    return result


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    p.add_argument("--launches", type=int, default=8)
    p.add_argument("--build", action="store_true", help="instrument and compile only")
    args = p.parse_args()
    if args.build:
        from djax.kernels.tilelang_build import nvcc_cubin

        for src, _, names in (decode_source(), attention_source()):
            print(len(nvcc_cubin(src)), "bytes,", len(names), "points")
        return
    print(json.dumps(run(args.out, args.launches), indent=1))


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
