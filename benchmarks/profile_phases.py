"""Where the time goes inside one CTA: phase timestamps of the FP8 decode GEMM (m 64, n 4096, k 7168) and the
sparse decode attention (b 64, 64 heads x 512, W 128, top 512 of 2048) in two forms: "attention", 2 key
splits with the merge pushed (the default before the CTA pair), and "pair", the default since (the head
dim split over a CTA pair, 4 key stages, P in the score buffers).

python benchmarks/profile_phases.py [--out DIR] [--launches 8] [--kernels decode,attention,pair]   (CUDA GPU)
python benchmarks/profile_phases.py --build                          (compiles only: no GPU needed)

Each kernel's lowered CUDA gets `clock64()` reads at named points (the thread that reaches the point first
in program order: a consumer's thread 0, the producer's first thread) into a small array (shared memory, or
global memory where the kernel takes all the shared memory), and at the end one thread per chosen CTA
(blockIdx.x a multiple of 21, every split) prints them with the CTA's %globaltimer at its start and at the
print. The launches' output is captured from the process's stdout; the JSON has, per kernel, the median
cycles from the CTA's start to each point, the median CTA life in ns and the SM clock that implies. The
instrumented kernels are slower than the real ones (the print, more registers), so the parts are
indicative; the points are where they sit in the lowered source.
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
PER_LINE = 24  # values a printf line carries (device printf takes at most 32 arguments)

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


def with_timestamps(source: str, name: str, points: int, rows_in_global: int = 0) -> str:
    """The stamps' array, the start stamps and, at the kernel's end, the print (after a CTA-wide barrier).

    The array is in shared memory, or, with `rows_in_global` (the grid's CTA count), one row per CTA of a
    global array, for kernels whose shared memory is all taken. Device printf takes at most 32 arguments, so
    the values go out in lines of up to `PER_LINE`, each led by the CTA's start time (which tells launches
    apart) and its part number; `summarize` joins them."""
    head = source.index('extern "C" __global__ void __launch_bounds__')
    body = source.index("{\n", head) + 2
    n = points + 1
    if rows_in_global:
        cta = "(blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x"
        decl = f"  long long* djax_t = djax_t_rows[{cta}];\n"
    else:
        decl = f"  __shared__ long long djax_t[{n + 1}];\n"
    start = decl + f"  if (threadIdx.x == 0) {{ djax_t[0] = clock64(); djax_t[{n}] = djax_globaltimer(); }}\n"
    source = source[:body] + start + source[body:]
    end = source.rindex("}")  # the kernel is the file's last function
    values = [f"djax_t[{j}] - djax_t[0]" for j in range(1, n)] + ["djax_globaltimer()"]
    prints = []
    for part, at in enumerate(range(0, len(values), PER_LINE)):
        chunk = values[at : at + PER_LINE]
        fmt = " ".join(["%lld"] * len(chunk))
        prints.append(
            f'printf("DJAXT {name} %d %d %lld {part} {fmt}\\n", (int)blockIdx.x, (int)blockIdx.z, '
            f"djax_t[{n}], {', '.join(chunk)});"
        )
    tail = (
        f"  __syncthreads();\n  if (threadIdx.x == 0 && ({PICK})) {{\n    "
        + "\n    ".join(prints)
        + "\n  }\n"
    )
    from djax.kernels.tilelang_build import with_device_code

    timer = _TIMER + (
        f"__device__ long long djax_t_rows[{rows_in_global}][{n + 1}];\n" if rows_in_global else ""
    )
    return with_device_code(source[:end] + tail + source[end:], timer)


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


def pair_source():
    """The sparse decode default at b 64 (the head dim split over a CTA pair, 4 key stages, each block's P in
    the score buffer just read) with its points; (source, launch, names). Per block: the producer's copies
    issued, and for the consumer warpgroup that takes it (0 the even blocks, 1 the odd ones) the block
    landed, its partial scores computed, the peer's added, and its P V done; then each warpgroup's loop end
    and the end of its `djax_pair_end` (the halves swapped, combined and stored). The stamps live in global
    memory: the kernel takes all the shared memory a CTA may have."""
    from djax.kernels import sparse_attn_tilelang as S

    b, h, k, w, c, t = ATTN
    tiling = S.default_tiling(b, h, k, w, t)
    if not (tiling.dim_pair and tiling.p_in_exchange):
        raise NotImplementedError(
            f"the points are placed for the CTA pair with P in the buffers, not {tiling}"
        )
    blocks = sum(S._blocks(w, t, tiling.block_s))
    src, launch = S._lowered_on_disk(b, h, k, w, c, t, k**-0.5, tiling)
    head = src.index('extern "C" __global__ void __launch_bounds__')
    pre, s = src[:head], src[head:]  # the kernel only: the device functions hold the same statements
    per = -(-blocks // 2)  # blocks a consumer warpgroup takes
    phases = ("ready", "scores", "peer_added", "done")
    names = ["slot_table_done"] + [f"producer_issued_{g}" for g in range(blocks)]
    names += [f"wg{wg}_{ph}_{i}" for wg in (0, 1) for ph in phases for i in range(per)]
    names += ["wg0_loop_done", "wg0_end_done", "wg1_loop_done", "wg1_end_done"]
    s = insert_after(s, "  __syncthreads();\n", stamp(1), nth=1)  # the second: after the slot table
    s = insert_after(s, "      tl::mbarrier_cp_async_arrive_noinc(ready[(blk & 3)]);\n",
                     "if (threadIdx.x == 256) djax_t[2 + blk] = clock64();")  # fmt: skip
    loops = re.findall(rf"for \(int (i_\d+) = 0; \1 < {per}; \+\+\1\) {{\n        ready\[", s)
    sends = re.findall(r"        djax_pair_send<[^\n]*\n", s)
    ends = re.findall(r"      djax_pair_end<[^\n]*\n", s)
    if len(loops) != 2 or len(sends) != 2 or len(ends) != 2:  # one loop, send and end per consumer warpgroup
        raise NotImplementedError("unexpected consumer loops in the pair's lowered source")
    for wg, (i, send, end) in enumerate(zip(loops, sends, ends, strict=True)):
        base = 2 + blocks + wg * len(phases) * per
        lead = f"if (threadIdx.x == {128 * wg}) djax_t[{{}} + {i}] = clock64();"
        wait = re.search(rf"        ready\[[^\n]*\]\.wait\(\(\({i} >> 1\) & 1\)\);\n", s).group(0)
        s = insert_after(s, wait, lead.format(base))
        s = s.replace(send, "        " + lead.format(base + per) + "\n" + send, 1)
        xwait = re.search(rf"        xbar\[[^\n]*\]\.wait\(\(\({i} >> 1\) & 1\)\);\n", s).group(0)
        s = insert_after(s, xwait, lead.format(base + 2 * per))
        free = re.search(rf"        free\[[^\n]*{i}[^\n]*\]\.arrive\(\);\n", s).group(0)
        s = insert_after(s, free, lead.format(base + 3 * per))
        loop_done, end_done = len(names) - 3 + 2 * wg, len(names) - 2 + 2 * wg
        s = s.replace(
            end,
            "      " + stamp(loop_done, 128 * wg) + "\n" + end + "      " + stamp(end_done, 128 * wg) + "\n",
            1,
        )
    ctas = b * (h // S.HEADS) * 2
    return with_timestamps(pre + s, "pair", len(names), rows_in_global=ctas), launch, names


def joined_rows(lines: list[str], name: str) -> list[list[int]]:
    """Per CTA launch, in the order printed: [blockIdx.x, blockIdx.z, the points' cycles..., start time, end
    time], its printed parts joined (a CTA's parts share its start time)."""
    parts: dict[tuple[int, int, int], dict[int, list[int]]] = {}
    for ln in lines:
        if ln.startswith(f"DJAXT {name} "):
            bx, bz, t0, part, *values = map(int, ln.split()[2:])
            parts.setdefault((bx, bz, t0), {})[part] = values
    rows = []
    for (bx, bz, t0), got in parts.items():
        values = [v for p in sorted(got) for v in got[p]]
        rows.append([bx, bz, *values[:-1], t0, values[-1]])
    return rows


def summarize(lines: list[str], name: str, names: list[str]) -> dict:
    rows = np.array(joined_rows(lines, name))
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


BUILDERS = {"decode": decode_source, "attention": attention_source, "pair": pair_source}
KERNELS = tuple(BUILDERS)


def run(out_dir: str, launches: int, kernels: tuple[str, ...] = KERNELS) -> dict:
    import jax
    import jax.numpy as jnp
    from bench_kernels import attn_sets
    from bench_moe import timing_sets
    from bench_tilelang import make_sets

    from djax.ffi import cubin, tma
    from djax.ffi.cubin import Cubin
    from djax.kernels.sparse_attn import kernel_operands
    from djax.kernels.tilelang_build import nvcc_cubin

    m, n, k = DECODE
    b, h, kd = ATTN[:3]
    calls, shapes, names = {}, {}, {}
    for name in kernels:
        src, launch, names[name] = BUILDERS[name]()
        binary = nvcc_cubin(src)
        key = "phases-" + hashlib.sha256(binary).hexdigest()[:16]
        if name == "decode":
            kern = tma.TmaKernel(key, launch["name"], binary, launch["grid"], launch["threads"],
                                 launch["shared_bytes"], launch["params"])  # fmt: skip

            def decode(a, sa, bw, sb, kern=kern):
                out = jax.ShapeDtypeStruct((m, n), jnp.bfloat16)
                return tma.launch(kern, [a, sa.astype(jnp.float32), bw, sb.astype(jnp.float32)], out)

            calls[name] = (jax.jit(decode), make_sets(timing_sets(m), m, n, k))
            shapes[name] = f"m{m} n{n} k{k}"
            continue
        cub = Cubin(key, launch["name"], binary, launch["threads"], launch["shared_bytes"], extra_null=0)
        # the pushed merge returns the output and the splits' log-sum-exps (scratch); the pair the output
        lse = [] if name == "pair" else [jax.ShapeDtypeStruct((b, launch["grid"][2], h), jnp.float32)]

        def attention(q, win, valid, pool, top, sinks, cub=cub, grid=launch["grid"], lse=lse):
            args = kernel_operands(q, win, valid, pool, top, sinks, valid_dtype=jnp.bool_)
            return cubin.launch(cub, grid, args, [jax.ShapeDtypeStruct(q.shape, q.dtype), *lse])[0]

        calls[name] = (jax.jit(attention), attn_sets(6, *ATTN))
        shapes[name] = f"b{b} h{h} k{kd} W{ATTN[3]} C{ATTN[4]} T{ATTN[5]}"
    sys.stdout.flush()
    with tempfile.TemporaryFile("w+") as cap:  # the device printf writes to the process's fd 1
        saved = os.dup(1)
        os.dup2(cap.fileno(), 1)
        try:
            for fn, sets in calls.values():
                for i in range(launches):
                    jax.block_until_ready(fn(*sets[i % len(sets)]))
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
    )
    for name in kernels:
        result[name] = dict(shape=shapes[name], **summarize(lines, name, names[name]))
    with open(os.path.join(out_dir, "phases.json"), "w") as f:
        json.dump(result, f, indent=1)
    return result


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    p.add_argument("--launches", type=int, default=8)
    p.add_argument("--build", action="store_true", help="instrument and compile only")
    p.add_argument("--kernels", default=",".join(KERNELS), help=f"a subset of {','.join(KERNELS)}")
    args = p.parse_args()
    kernels = tuple(args.kernels.split(","))
    if unknown := set(kernels) - set(KERNELS):
        p.error(f"unknown kernels {sorted(unknown)}; known: {', '.join(KERNELS)}")
    if args.build:
        from djax.kernels.tilelang_build import nvcc_cubin

        for name in kernels:
            src, _, names = BUILDERS[name]()
            print(name, len(nvcc_cubin(src)), "bytes,", len(names), "points")
        return
    print(json.dumps(run(args.out, args.launches, kernels), indent=1))


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
