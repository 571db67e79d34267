"""Times each djax kernel against XLA's lowering of its jnp reference: time, TFLOP/s, GB/s, roofline ratio.

python benchmarks/bench_kernels.py [--out DIR] [--small] [--only attn,index,topk,moe,fp8,...] [--defaults-only]
(on a CUDA GPU; writes kernels_<device>.json and .png; the MoE and FP8 cases are in bench_moe.py)

Each fast output is checked against the reference first (rel_err). Times are device time per call (the
kernels of one pass over the input sets, from a profiler trace) where a GPU trace is available, with the
wall time per call beside it. Ratios: `roofline` against the ceilings below, `vs_measured_copy` against
the copy bandwidth measured at the start of the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import tempfile
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from bench_moe import (  # noqa: E402 (the script's directory is on sys.path)
    fp8_cases,
    fp8_grouped_ep_cases,
    moe_cases,
    moe_fp4_cases,
    moe_fp8_cases,
    rel_err,
)
from profile_decode import kernel_table  # noqa: E402

from djax.kernels.indexer import index_scores, indexer_topk
from djax.kernels.sparse_attn import sparse_decode
from djax.kernels.topk import chunk_size, grid_chunk, topk

BF16 = jnp.bfloat16
COPY_BW = 4.3e12  # measured device copy bandwidth on the lent H200 (bytes read + written per second)
BF16_RATE = 790e12  # measured dense bf16 matmul rate on the lent H200
FP8_PEAK = 1979e12  # H100 and H200 (SXM) spec sheet, dense fp8: the ceiling for the fp8 kernels' FLOPs


def roof_ceilings(device_kind: str, measured_bw: float, measured_rate: float) -> tuple[float, float]:
    """(copy bandwidth, bf16 rate) the `roofline` column divides by: the fixed H200 figures above on an H200
    (so that its runs compare with each other), the run's own measurements on any other card (4.3 TB/s is
    out of an H100's reach: against it every H100 row would read low)."""
    if "H200" in device_kind:
        return COPY_BW, BF16_RATE
    return measured_bw, measured_rate


# TileLang sparse decode tilings (block_s, stages, warps, splits per row, merged in the kernel: True through
# global memory, "dsmem" through the cluster's shared memory) worth timing per batch size (12 warps: the
# warp-specialised program)
TILELANG_TILINGS = {
    64: [
        (64, 2, 12, 1, False),
        (64, 2, 12, 2, False),
        (64, 2, 12, 2, True),
        (64, 2, 12, 2, "dsmem"),
        (64, 2, 12, 2, "push"),
        (64, 2, 12, 2, "push_bf16"),
        (64, 2, 12, 3, "dsmem"),
        (32, 4, 12, 2, "dsmem"),
    ],
    32: [(64, 2, 12, 4, False), (64, 2, 12, 2, True), (64, 2, 12, 2, "dsmem"), (64, 2, 12, 4, "dsmem")],
    8: [(64, 2, 12, 10, False), (64, 2, 12, 8, True), (64, 2, 12, 8, "dsmem"), (64, 2, 12, 5, "dsmem")],
}


def is_default(variant: str) -> bool:
    """The rows `--defaults-only` keeps: XLA's references and ceilings, "auto" (what the public op takes by
    default) and each kernel's own default configuration."""
    return variant.startswith(("xla", "ceiling", "auto")) or "default" in variant


def bench(fn, sets, reps: int = 7, trace: bool = False):
    """Median seconds per call of `fn` over rotating input sets (so repeated calls do not hit L2).

    With trace=True also the device seconds per call: the kernels' own time summed from a profiler trace of
    one pass (None off GPU). Wall time includes the host's dispatch of the jit, which small kernels do not
    amortise; inside a model step the kernels run back to back, so device time is the figure to compare.
    """
    many = jax.jit(lambda ss: [fn(*s) for s in ss])
    jax.block_until_ready(many(sets))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(many(sets))
        times.append((time.perf_counter() - t0) / len(sets))
    wall = float(np.median(times))
    if not trace:
        return wall
    if jax.default_backend() != "gpu":
        return wall, None, {}
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            jax.block_until_ready(many(sets))
        table, busy_us = kernel_table(Path(tmp))  # GPU stream threads only
    # the largest kernels per call (up to 12): where a variant's time goes (the kernel itself, a split merge, glue)
    kernels = {r["name"][:80]: round(r["us"] / len(sets), 2) for r in table[:12]}
    return wall, (busy_us * 1e-6 / len(sets)) if busy_us else None, kernels


def measure_ceilings():
    """(copy bandwidth, bf16 matmul rate) measured now. The copy is the faster of an XLA elementwise pass
    over 2 GiB and a device-to-device memcpy (torch, where it is installed with CUDA): bytes read + written."""
    x = jnp.ones((1 << 29,), jnp.float32) + 1  # 2 GiB
    t = bench(lambda a: a * 1.0001, [(x,)], reps=5)
    bw = 2 * x.size * 4 / t
    del x
    try:
        import torch

        src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        ts = []
        for _ in range(12):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src)
            torch.cuda.synchronize()
            ts.append(time.perf_counter() - t0)
        bw = max(bw, 2 * src.numel() / float(np.median(ts[2:])))
        del src, dst
    except Exception as e:  # noqa: BLE001 - torch without CUDA: the XLA figure stands
        print(f"no torch copy: {e!r}")
    a = jax.random.normal(jax.random.key(0), (8192, 8192), BF16)
    t = bench(lambda p, q: p @ q, [(a, a)], reps=5)
    return bw, 2 * 8192**3 / t


def attn_cost(b, h, k, w, t):
    """FLOPs (Q K^T and P K over every key) and the bytes that must move (keys, q, out, slots)."""
    return 4 * b * h * (w + t) * k, 2 * b * (w + t) * k + 2 * 2 * b * h * k + 4 * b * (w + t)


def attn_sets(n_sets, b, h, k, w, c, t, seed=0):
    rng = np.random.default_rng(seed)
    sets = []
    for _ in range(n_sets):
        q = jnp.asarray(rng.standard_normal((b, h, k)), BF16)
        win = jnp.asarray(rng.standard_normal((b, w, k)), BF16)
        valid = jnp.asarray(rng.random((b, w)) < 0.98)
        pool = jnp.asarray(rng.standard_normal((b, c, k)), BF16)
        top = jnp.asarray(np.where(rng.random((b, t)) < 0.02, -1, rng.integers(0, c, (b, t))), jnp.int32)
        sinks = jnp.asarray(rng.standard_normal(h), jnp.float32)
        sets.append((q, win, valid, pool, top, sinks))
    return sets


def attn_ceilings(record, sets, scale, flops, nbytes, shape, ref_time, check):
    """What bounds the sparse decode: XLA reading the same gathered rows (take + sum: the gather alone, no
    attention), and the warp-specialised kernel on picks in index order (sorted, and all-contiguous rows)
    to separate the random-row access pattern from the kernel."""
    f32 = jnp.float32

    def gather_only(q, win, valid, pool, top, sinks):
        rows = jnp.take_along_axis(pool, jnp.clip(top, 0, pool.shape[1] - 1)[..., None], axis=1)
        return rows.astype(f32).sum(1) + win.astype(f32).sum(1)

    record(
        "sparse_decode",
        shape,
        "ceiling: XLA gather of the same rows (no attention)",
        gather_only,
        sets,
        0,
        nbytes,
        ref_time,
    )
    ws = dict(scale=scale, impl="tilelang", block_s=64, num_stages=2, num_warps=12)
    for ns in (1, 2):
        record(
            "sparse_decode",
            shape,
            f"tilelang bs64 st2 w12 split{ns}, picks sorted per row",
            lambda q, win, valid, pool, top, sinks, ns=ns: sparse_decode(
                q, win, valid, pool, jnp.sort(top, axis=1), sinks, nsplit=ns, **ws
            ),
            sets,
            flops,
            nbytes,
            ref_time,
            check,
        )
    contiguous = [
        (*s[:4], jnp.broadcast_to(jnp.arange(s[4].shape[1], dtype=jnp.int32), s[4].shape), s[5]) for s in sets
    ]
    record(
        "sparse_decode",
        shape,
        "tilelang bs64 st2 w12 split1, picks = rows 0..T-1 (contiguous)",
        lambda *a: sparse_decode(*a, nsplit=1, **ws),
        contiguous,
        flops,
        nbytes,
        ref_time,
        (lambda *a: sparse_decode(*a, scale=scale, impl="ref"), lambda out: out),
    )


def run(
    out_dir: str,
    small: bool = False,
    only: tuple[str, ...] = ("attn", "index", "topk", "moe", "fp8"),
    attn_batches: tuple[int, ...] = (64, 8),
    attn_sweep: bool = True,
    fp8_shapes: tuple[tuple[int, int, int], ...] | None = None,
    defaults_only: bool = False,
):
    dev = jax.devices()[0]
    rows, errors = [], []
    started = time.perf_counter()
    bw, rate = measure_ceilings() if not small else (COPY_BW, BF16_RATE)
    roof_bw, roof_rate = roof_ceilings(dev.device_kind, bw, rate)
    print(
        f"device {dev.device_kind}: copy {bw / 1e12:.2f} TB/s, bf16 matmul {rate / 1e12:.0f} TFLOP/s (measured now)"
    )

    def record(kernel, shape, variant, fn, sets, flops, nbytes, ref_time=None, check=None):
        """check: (ref_fn, select) -> the relative error of fn vs ref_fn on sets[0] over select(output).
        With defaults_only, only what a caller gets by default is timed (see `is_default`)."""
        if defaults_only and not is_default(variant):
            return None
        # fp8_weight: FP8 weights into bf16 dots
        peak = FP8_PEAK if kernel.startswith("fp8") and kernel != "fp8_weight" else roof_rate
        err = None
        try:
            if check is not None:
                err = rel_err(fn, *check, sets[0])
            wall, dev, kernels = bench(fn, sets, trace=True)
            t = dev or wall
        except Exception as e:  # noqa: BLE001 - keep timing the other variants
            errors.append(dict(kernel=kernel, shape=shape, variant=variant, error=repr(e)[:2000]))
            traceback.print_exc()
            print(f"{kernel} {shape} {variant}: FAILED {repr(e)[:200]}", flush=True)
            return None
        print(f"{kernel} {shape} {variant}: {t * 1e6:.1f} us (wall {wall * 1e6:.1f}), err {err}", flush=True)
        row = dict(
            kernel=kernel,
            shape=shape,
            variant=variant,
            time_us=t * 1e6,
            wall_us=wall * 1e6,
            time_is="device" if dev else "wall",
            tflops=flops / t / 1e12,
            gbps=nbytes / t / 1e9,
            roofline=max(flops / peak, nbytes / roof_bw) / t,
            speedup_vs_xla_ref=(ref_time / t) if ref_time else None,
            vs_peak=flops / t / peak,
            vs_measured_copy=nbytes / t / bw,
            rel_err=err,
            kernels_us=kernels,
            # seconds since the run began, compiles included: where a run's time limit goes
            elapsed_s=round(time.perf_counter() - started, 1),
        )
        rows.append(row)
        save()  # after every row: a run stopped by a time limit keeps what it measured
        return t

    os.makedirs(out_dir, exist_ok=True)
    tag = dev.device_kind.lower().replace("nvidia", "").strip().replace(" ", "_") or "gpu"
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%MZ")

    def save():
        """Rewrites the JSON with every row so far: a run stopped by a time limit keeps what it measured."""
        result = dict(
            device=dev.device_kind,
            date=stamp,
            jax=jax.__version__,
            measured_copy_bw=bw,
            measured_bf16_rate=rate,
            roofline_copy_bw=roof_bw,
            roofline_bf16_rate=roof_rate,
            fp8_peak=FP8_PEAK,
            sections=list(only),
            rows=rows,
            errors=errors,
        )
        with open(os.path.join(out_dir, f"kernels_{tag}.json"), "w") as f:
            json.dump(result, f, indent=1)

    if "attn" in only:
        # (a) sparse decode attention: b=64, 64 heads x 512, SWA 128 + top-512 of an 8k context (ratio 4 -> 2048)
        h, k, w, c, t = (64, 512, 128, 2048, 512) if not small else (16, 64, 16, 64, 32)
        scale = k**-0.5
        for b in attn_batches:
            sets = attn_sets(24 if b == 64 else 32, b, h, k, w, c, t)
            flops, nbytes = attn_cost(b, h, k, w, t)
            shape = f"b{b} h{h} k{k} W{w} top{t} of {c}"
            check = (lambda *a: sparse_decode(*a, scale=scale, impl="ref"), lambda out: out)
            tr = record(
                "sparse_decode",
                shape,
                "xla_ref",
                lambda *a: sparse_decode(*a, scale=scale, impl="ref"),
                sets,
                flops,
                nbytes,
            )
            triton = (
                [(32, 64, 8, 2, 1), (64, 32, 8, 2, 4)] if b == 64 else [(64, 32, 8, 2, 4), (16, 32, 4, 2, 8)]
            )
            triton = triton if attn_sweep else []
            for bh, bs, nw, st, ns in triton:
                record(
                    "sparse_decode",
                    shape,
                    f"triton bh{bh} bs{bs} w{nw} st{st} split{ns}",
                    lambda *a, bh=bh, bs=bs, nw=nw, st=st, ns=ns: sparse_decode(
                        *a,
                        scale=scale,
                        impl="triton",
                        block_h=bh,
                        block_s=bs,
                        num_warps=nw,
                        num_stages=st,
                        nsplit=ns,
                    ),
                    sets,
                    flops,
                    nbytes,
                    tr,
                    check,
                )
            # TileLang: all 64 heads of a row per CTA (block_s keys per step, stages, warps, splits per row)
            tilelang = TILELANG_TILINGS.get(b, []) if attn_sweep else []
            for bs, st, nw, ns, merge in tilelang if not small else []:
                record(
                    "sparse_decode",
                    shape,
                    f"tilelang bs{bs} st{st} w{nw} split{ns}"
                    + {False: "", True: " merged"}.get(merge, f" merged {merge}"),
                    lambda *a, bs=bs, st=st, nw=nw, ns=ns, merge=merge: sparse_decode(
                        *a,
                        scale=scale,
                        impl="tilelang",
                        block_s=bs,
                        num_stages=st,
                        num_warps=nw,
                        nsplit=ns,
                        merge_splits=merge,
                    ),
                    sets,
                    flops,
                    nbytes,
                    tr,
                    check,
                )

            record(
                "sparse_decode",
                shape,
                "auto (the default tiling)",
                lambda *a: sparse_decode(*a, scale=scale),
                sets,
                flops,
                nbytes,
                tr,
                check,
            )
            if b == 64 and not small and attn_sweep:
                attn_ceilings(record, sets, scale, flops, nbytes, shape, tr, check)

    if "attn_blocks" in only:
        # (a') where the sparse decode's time goes at b 64: the default tiling over 1 to 5 key blocks per split
        # (the slope is a block's cost with the grid resident, the intercept what does not depend on the keys),
        # then, at one block per split, the ways a split can end, side by side
        b, h, k, c = (64, 64, 512, 2048) if not small else (2, 16, 64, 64)
        scale = k**-0.5
        pairs = (
            [(64, 64), (128, 128), (128, 256), (128, 384), (128, 512)] if not small else [(16, 16), (16, 48)]
        )
        endings = {
            "2 splits merged through global memory": dict(num_warps=12, nsplit=2, merge_splits=True),
            "2 splits merged after": dict(num_warps=12, nsplit=2),
            "one CTA per row": dict(num_warps=12, nsplit=1),
        }
        for i, (w, t) in enumerate(pairs):
            sets = attn_sets(24, b, h, k, w, c, t)
            flops, nbytes = attn_cost(b, h, k, w, t)
            shape = f"b{b} h{h} k{k} W{w} top{t} of {c}"
            check = (lambda *a: sparse_decode(*a, scale=scale, impl="ref"), lambda out: out)
            auto = lambda *a: sparse_decode(*a, scale=scale)  # noqa: E731
            record(
                "sparse_decode", shape, "auto (the default tiling)", auto, sets, flops, nbytes, None, check
            )
            if i > 0 or small:  # the endings at one block per split only (TileLang: not on CPU)
                continue
            for name, kw in endings.items():
                fn = lambda *a, kw=kw: sparse_decode(*a, scale=scale, impl="tilelang", **kw)  # noqa: E731
                record(
                    "sparse_decode",
                    shape,
                    f"tilelang bs64 st2 w12: {name}",
                    fn,
                    sets,
                    flops,
                    nbytes,
                    None,
                    check,
                )

    if "index" in only:
        save()
        # (b) indexer scoring (64 heads x 128) and top-512; vocab top-k
        rng = np.random.default_rng(1)
        h, c = (64, 128) if not small else (16, 32)
        for b, s in [(64, 2048), (8, 65536)] if not small else [(2, 300)]:
            sets = [
                (
                    jnp.asarray(rng.standard_normal((b, h, c)), BF16),
                    jnp.asarray(rng.standard_normal((b, s, c)), BF16),
                    jnp.asarray(rng.random((b, h)), jnp.float32),
                    jnp.full((b,), s, jnp.int32),
                )
                for _ in range(16)
            ]
            flops, nbytes = 2 * b * h * s * c, 2 * b * s * c + 4 * b * s + 2 * b * h * c
            shape = f"b{b} H{h} c{c} s{s}"
            ref = lambda *a: index_scores(*a, impl="ref")  # noqa: E731
            check = (ref, lambda out: out)  # every entry is live (lengths = s): no -inf
            tr = record("index_scores", shape, "xla_ref", ref, sets, flops, nbytes)
            for bs in (64, 128):
                record(
                    "index_scores",
                    shape,
                    f"triton bs{bs}",
                    lambda *a, bs=bs: index_scores(*a, impl="triton", block_s=bs),
                    sets,
                    flops,
                    nbytes,
                    tr,
                    check,
                )
            record("index_scores", shape, "auto", lambda *a: index_scores(*a), sets, flops, nbytes, tr, check)
            kk = min(512, s)
            # the selected values (descending): indices of tied scores may differ, the values may not
            check = (lambda *a, kk=kk: indexer_topk(*a, kk, impl="ref")[0], lambda out: out[0])
            tr = record(
                "indexer_topk",
                shape + f" k{kk}",
                "xla_ref",
                lambda *a, kk=kk: indexer_topk(*a, kk, impl="ref"),
                sets,
                flops,
                nbytes,
            )
            record(
                "indexer_topk",
                shape + f" k{kk}",
                "triton",
                lambda *a, kk=kk: indexer_topk(*a, kk, impl="triton"),
                sets,
                flops,
                nbytes,
                tr,
                check,
            )
            record(
                "indexer_topk",
                shape + f" k{kk}",
                "auto",
                lambda *a, kk=kk: indexer_topk(*a, kk),
                sets,
                flops,
                nbytes,
                tr,
                check,
            )

    if "topk" in only:
        save()
        rng = np.random.default_rng(2)
        # (b, s, k, first-stage chunk sizes of the two-stage kernel around the rule's, `topk.chunk_size`). Few
        # long rows are where one program per row leaves the GPU idle; "auto" is what callers get.
        sizes = (
            [
                (64, 2048, 512, []),
                (64, 129280, 50, [65536, 16384]),
                (1, 262144, 512, [2048, 4096, 8192]),
                (2, 262144, 512, [4096, 8192]),
                (4, 262144, 512, [4096, 8192, 16384]),
                (8, 262144, 512, [8192, 16384, 32768]),
                (1, 129280, 50, [1024, 2048, 4096]),
            ]
            if not small
            else [(2, 3000, 64, [1024])]
        )
        for b, s, k, chunks in sizes:
            sets = [(jnp.asarray(rng.standard_normal((b, s)), jnp.float32),) for _ in range(16)]
            nbytes = 4 * b * s + 8 * b * k
            shape = f"b{b} s{s} k{k}"
            check = (lambda x, k=k: topk(x, k, impl="ref")[1], lambda out: out[1])  # indices: exact or not
            tr = record(
                "topk", shape, "xla lax.top_k", lambda x, k=k: topk(x, k, impl="ref"), sets, 0, nbytes
            )
            variants = [
                (f"triton 1-stage blk{blk} w16", dict(block=blk, chunk=s, method="chunked"))
                for blk in (2048, 4096)
            ]
            # the grid form: each row's select spread over many programs
            for c, w in [(None, 4)] + ([(None, 8), (2048, 4)] if b <= 8 else []):
                name = f"triton grid chunk{c or grid_chunk(b, s)} w{w}"
                variants.append((name, dict(method="grid", chunk=c, num_warps=w)))
            chunked = dict(block=2048, method="chunked")
            variants += [(f"triton chunk{c} blk2048 w16", dict(chunked, chunk=c)) for c in chunks]
            rule = chunk_size(b, s, k)
            if rule < s:  # the merge by lax.top_k instead of the kernel, at the rule's chunk
                variants.append((f"triton chunk{rule} merge lax", dict(chunked, chunk=rule, merge="ref")))
            for name, kw in variants:
                record(
                    "topk",
                    shape,
                    name,
                    lambda x, k=k, kw=kw: topk(x, k, impl="triton", **{"num_warps": 16, **kw}),
                    sets,
                    0,
                    nbytes,
                    tr,
                    check,
                )
            record("topk", shape, "auto", lambda x, k=k: topk(x, k), sets, 0, nbytes, tr, check)

    fp8 = functools.partial(fp8_cases, shapes=fp8_shapes) if fp8_shapes else fp8_cases
    cases = {
        "moe": moe_cases,
        "fp8": fp8,
        "fp8_grouped_ep": fp8_grouped_ep_cases,
        "fp8_linear": fp8_linear_cases,
        "fp8_weight": fp8_weight_cases,
        "moe_fp8": moe_fp8_cases,
        "moe_fp4": moe_fp4_cases,
    }
    for section in (s for s in cases if s in only):
        save()
        cases[section](record, small)

    save()
    print(
        f"\n{'kernel':14} {'shape':28} {'variant':34} {'us':>9} {'TFLOP/s':>8} {'GB/s':>7} {'roof':>5} "
        f"{'/peak':>5} {'/copy':>5} {'vs xla':>6} {'err':>8}"
    )
    for r in rows:
        sp = f"{r['speedup_vs_xla_ref']:.2f}" if r["speedup_vs_xla_ref"] else "-"
        er = f"{r['rel_err']:.1e}" if r["rel_err"] is not None else "-"
        print(
            f"{r['kernel']:14} {r['shape']:28} {r['variant']:34} {r['time_us']:9.1f} {r['tflops']:8.1f} "
            f"{r['gbps']:7.0f} {r['roofline']:5.2f} {r['vs_peak']:5.2f} {r['vs_measured_copy']:5.2f} {sp:>6} {er:>8}"
        )
    print(f"{len(errors)} errors")
    plot(rows, os.path.join(out_dir, f"kernels_{tag}.png"), roof_bw, roof_rate)


# V4-Flash projections a decode step reads (out, in): q LoRA up, output LoRA down, shared expert up and down
FP8_LINEAR_SHAPES = [(32768, 1024), (4096, 8192), (2048, 4096), (4096, 2048)]
# V4.1-Flash's (hidden 5120, q LoRA 1280, shared expert 2304), whose FP8 blocks are 32 x 32
FP8_WEIGHT_SHAPES = [(32768, 1280), (5120, 8192), (2304, 5120), (5120, 2304)]


def fp8_linear_cases(record, small: bool, section="fp8_linear", block=(128, 128), batches=(1, 32, 128)):
    """The model's `linear` with an FP8 weight (e4m3, `block` scales) at decode batch sizes: made dense on
    use (the path without kernels), the kernel "auto" takes (128 x 128 blocks: activations quantized 1x128 +
    `fp8_gemm`; other blocks: `fp8_weight_gemm`, activations as they are) and, for scale, the same product
    with a bf16 weight (what a bf16 checkpoint reads)."""
    from djax.models.layers import linear
    from djax.quant import QArray, quantize

    def fp8_linear(fp8):  # the model's linear on an FP8 weight given as (values, scale)
        return lambda x, v, s, wb: linear(x, QArray(v, s, block), fp8=fp8)

    kernel = "act quant + fp8_gemm (auto)" if block == (128, 128) else "fp8_weight_gemm (auto)"
    shapes = (FP8_LINEAR_SHAPES if block == (128, 128) else FP8_WEIGHT_SHAPES) if not small else [(256, 256)]
    for (n, k), m in [(s, m) for s in shapes for m in (batches if not small else (4,))]:
        sets = []
        for i in range(4):
            w = quantize(jax.random.normal(jax.random.key(70 + i), (n, k), jnp.float32) * 0.02, block)
            x = jax.random.normal(jax.random.key(80 + i), (m, k), jnp.float32).astype(BF16)
            sets.append((x, w.values, w.scale, w.dense(BF16)))
        scales = 4 * -(-n // block[0]) * -(-k // block[1])
        flops, nbytes = 2 * m * n * k, n * k + scales + 2 * m * (n + k)
        shape = f"m{m} n{n} k{k}"
        t_dense = record(section, shape, "dense on use (no kernels)", fp8_linear(None), sets, flops, nbytes)
        ref = (fp8_linear("ref"), lambda y: y)
        record(section, shape, kernel, fp8_linear("auto"), sets, flops, nbytes, t_dense, ref)
        bf16 = lambda x, v, s, wb: linear(x, wb)  # noqa: E731
        record(section, shape, "bf16 weight (2x the bytes)", bf16, sets, flops, nbytes + n * k, t_dense)


def fp8_weight_cases(record, small: bool):
    """`fp8_linear_cases` for V4.1's 32 x 32-block FP8 projections, up to the rows `linear` reads them as
    stored (FP8_WEIGHT_MAX_ROWS); then the output LoRA's grouped half (wo_a: 8 groups of 1024 x 4096, V4.1's
    and V4-Flash's alike) in 32 x 32 and 128 x 128 blocks through `grouped_linear`: made dense on use, all
    groups in one `fp8_weight_gemm` call, and a bf16 weight."""
    from djax.kernels.fp8_gemm import fp8_weight_gemm
    from djax.kernels.fp8_weight_triton import weight_config
    from djax.models.layers import grouped_linear
    from djax.quant import QArray, quantize

    batches = (1, 32, 128, 256) if not small else (4,)
    fp8_linear_cases(record, small, "fp8_weight", (32, 32), batches)
    # other tiles for the decode sizes, by the op itself: the FP8 GEMM's 6 stages (one program an SM) and
    # 16-row tiles (mma.sync, a quarter of a's shared memory)
    shapes, ms = (FP8_WEIGHT_SHAPES[:2], (1, 32)) if not small else ([(256, 256)], (4,))
    for (n, k), m in [(s, m) for s in shapes for m in ms]:
        w = quantize(jax.random.normal(jax.random.key(99), (n, k), jnp.float32) * 0.02, (32, 32))
        sets = [
            (jax.random.normal(jax.random.key(60 + j), (m, k), jnp.float32).astype(BF16),) for j in range(4)
        ]
        flops, nbytes = 2 * m * n * k, n * k + 4 * (n // 32) * (k // 32) + 2 * m * (n + k)
        base = weight_config(m, n, k)
        for name, cfg in (
            ("default (auto's tiles)", base),
            ("6 stages", dataclasses.replace(base, num_stages=6)),
            ("16-row tiles, 6 stages", dataclasses.replace(base, block_m=16, num_stages=6)),
        ):
            op = lambda x, cfg=cfg, w=w: fp8_weight_gemm(x, w.values, w.scale, (32, 32), cfg=cfg)  # noqa: E731
            ref = lambda x, w=w: fp8_weight_gemm(x, w.values, w.scale, (32, 32), impl="ref")  # noqa: E731
            record(
                "fp8_weight",
                f"m{m} n{n} k{k}",
                f"op: {name}",
                op,
                sets,
                flops,
                nbytes,
                None,
                (ref, lambda y: y),
            )
    g, o, i = (8, 1024, 4096) if not small else (2, 128, 256)
    for block, m in [(b, m) for b in ((32, 32), (128, 128)) for m in batches]:
        sets = []
        for j in range(4):
            w = quantize(jax.random.normal(jax.random.key(90 + j), (g * o, i), jnp.float32) * 0.02, block)
            rows = jax.random.normal(jax.random.key(95 + j), (m, g, i), jnp.float32).astype(BF16)
            sets.append((rows, w.values, w.scale, w.dense(BF16)))
        scales = 4 * (g * o // block[0]) * (i // block[1])
        flops, nbytes = 2 * m * g * o * i, g * o * i + scales + 2 * m * g * (o + i)
        shape = f"wo_a m{m} g{g} o{o} i{i} b{block[0]}"

        def run(fp8, block=block):
            return lambda x, v, s, wb: grouped_linear(x, QArray(v, s, block), fp8)

        t_dense = record("fp8_weight", shape, "dense on use (no kernels)", run(None), sets, flops, nbytes)
        check = (run("ref"), lambda y: y)
        record(
            "fp8_weight", shape, "fp8_weight_gemm (auto)", run("auto"), sets, flops, nbytes, t_dense, check
        )
        bf16 = lambda x, v, s, wb: grouped_linear(x, wb)  # noqa: E731
        record(
            "fp8_weight", shape, "bf16 weight (2x the bytes)", bf16, sets, flops, nbytes + g * o * i, t_dense
        )


def plot(rows, path, roof_bw: float = COPY_BW, roof_rate: float = BF16_RATE):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    labels = [f"{r['kernel']} {r['shape']}\n{r['variant']}" for r in rows]
    fig, ax = plt.subplots(figsize=(10, 0.32 * len(rows) + 1))
    ax.barh(
        range(len(rows)),
        [r["roofline"] for r in rows],
        color=["grey" if "xla" in r["variant"] else "C0" for r in rows],
    )
    ax.set_yticks(range(len(rows)), labels, fontsize=6)
    ax.invert_yaxis()
    ax.set_xlabel(
        f"fraction of roofline (max of bytes / {roof_bw / 1e12:.2f} TB/s, FLOPs / peak: "
        f"{roof_rate / 1e12:.0f} bf16, {FP8_PEAK / 1e12:.0f} fp8 TFLOP/s)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--small", action="store_true", help="tiny shapes: a smoke run of the script on CPU")
    ap.add_argument("--attn-batches", default="64,8", help="batch sizes of the attn section")
    ap.add_argument(
        "--attn-default-only",
        action="store_true",
        help="attn section: only XLA's reference and the default tiling (no variant sweep, no ceilings)",
    )
    ap.add_argument(
        "--only",
        default="attn,index,topk,moe,fp8",
        help="comma list of sections: attn (sparse decode attention), index (indexer scores + top-k), topk, moe, "
        "fp8, attn_blocks (not in the default: the sparse decode at b 64 over 1 to 5 key blocks per split), "
        "fp8_linear (not in the default: the model's FP8 projections with and without fp8_gemm), fp8_weight (not "
        "in the default: V4.1's 32 x 32-block FP8 projections with and without fp8_weight_gemm), moe_fp8 (not in "
        "the default: routed experts with FP8 weights, made dense on use or read by the FP8 grouped GEMMs), moe_fp4 "
        "(not in the default: V4.1-Flash's FP4 routed experts, made dense on use or read as stored), "
        "fp8_grouped_ep (not in the default: FP8 grouped contiguous at few groups of many rows, an "
        "expert-parallel rank's local experts)",
    )
    ap.add_argument(
        "--defaults-only",
        action="store_true",
        help="time only XLA's references and ceilings, \"auto\" and each kernel's default configuration (every "
        "section: one run of every kernel as a caller gets it)",
    )
    ap.add_argument(
        "--fp8-shapes",
        default="",
        help="fp8 section: comma list of m x n x k for its dense GEMMs instead of its own (e.g. 8x4096x8192)",
    )
    args = ap.parse_args()
    run(
        args.out,
        args.small,
        tuple(args.only.split(",")),
        tuple(int(b) for b in args.attn_batches.split(",")),
        not (args.attn_default_only or args.defaults_only),
        tuple(tuple(int(d) for d in s.split("x")) for s in args.fp8_shapes.split(",") if s) or None,
        args.defaults_only,
    )
