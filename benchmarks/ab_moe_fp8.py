"""FP8 routed experts side by side in alternating rounds: at decode token counts the Triton kernels' K step; at
prefill (`--prefill`) the Triton kernels against TileLang's grouped GEMMs.

python benchmarks/ab_moe_fp8.py [--tokens 64,32,128,8] [--rounds 3] [--out DIR]   (CUDA GPU)
python benchmarks/ab_moe_fp8.py --prefill [--tokens 4096,1024,16384] [--out DIR]  (CUDA GPU, tilelang)
python benchmarks/ab_moe_fp8.py --plot DIR/moe_fp8_ab.json                         (only the PNG)
(--ue8m0: the weights' scales powers of two, as V4's checkpoints, so the activations' too; `_ue8m0` on the names)

V4-Flash's routed experts (256 of 4,096 x 2,048, top-6, FP8 with 128 x 128 scales) under `bench_moe`'s skewed
routing, `moe_experts_fp8` with its tiles as the model gets them ("default": 16-row tiles, the fused gate/up
kernel's columns from `swiglu_config`, the down GEMM's K split from `fp8_split`) against the same tiles loading
two or four 128-wide K blocks a loop step (block_k 256 or 512: `fp8_gemm_triton.k_step`) in the fused gate/up
kernel, the down GEMM or both, at several stage counts; and the fused kernel as it was, writing the padding rows
of its tiles too (as zeros), where it now writes the picks' rows only. Each variant is checked against the jnp
reference on the first tokens (a wrong one is recorded and not timed); then every round times each once (device
time from a profiler trace, `bench_kernels.bench`), each round starting with the next variant, and records the
largest kernels of each. Writes moe_fp8_ab.json (rewritten after every token count) and its PNG under --out: the
touched experts' FP8 bytes over the time, as a fraction of the run's measured copy bandwidth.
With `--prefill` the variants are the default (the Triton kernels over 64-row groups, as the model takes them),
the same kernels over 128-row groups, and `impl="tilelang"` (128-row groups, gate and up as two TileLang
grouped GEMMs, the down projection TileLang's too); the PNG shows the picks' FLOPs over
the time as a fraction of FP8 peak. Writes moe_fp8_prefill_ab.json and its PNG.
Either way the "activations quantized by XLA (before)" variants trace the program with `moe_experts.ROW_QUANT`
off: the tokens' fp8 rows gathered into TileLang's layout, the SwiGLU's rows gathered, quantized and scattered by
XLA, where one `row_quant` kernel each does it now; "..., fp8 rows as bytes" with `rows.WORDS` off too (XLA's fp8
rows moved element by element, as before they moved as 32-bit words). `--only a,b` keeps the default and the
variants whose names start with a or b.
"""

import argparse
import functools
import os
import sys
import time
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from ab_plot import save, side_by_side_args, timed_rounds  # noqa: E402

D, F, E, K = 4096, 2048, 256, 6  # V4-Flash's routed experts
LIMIT = 10.0  # the SwiGLU clamp, as bench_moe's
IMPL = "triton"  # the kernels' impl ("interpret" runs this script's flow on a CPU at small sizes)
# the activations gathered, quantized and scattered by XLA, as before `row_quant`'s kernel took them; and with
# XLA's fp8 rows moved element by element, as before `rows` moved them as words
XLA = "activations quantized by XLA (before)"
XLA_BYTES = "activations quantized by XLA, fp8 rows as bytes (before)"
# `row_quant`'s plain-scale quotient by an IEEE division an element, as before `row_quant.MARKSTEIN` (the same bits)
IEEE = "row_quant's IEEE division (before)"
RTOL = 2e-2  # the fused kernel rounds gate and up to bf16 where the reference's order differs (bench_moe: 1.4e-2)


def variants(n: int, prefill: bool = False, ue8m0: bool = False) -> dict:
    """name -> `experts`' keywords at n tokens: decode, the kernels' tiles (cfg, swiglu_cfg) and the fused
    kernel's PAD_ROWS; prefill, the layout's tiles or the TileLang path. The IEEE division's variants only with plain
    scales (UE8M0 ones divide by multiplying)."""
    from djax.kernels.grouped_gemm import GemmConfig
    from djax.kernels.moe_experts import fp8_config, swiglu_config

    if prefill:
        rows128 = GemmConfig(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=4)
        out = {
            "default": {},
            XLA: dict(row_quant=False),
            XLA_BYTES: dict(row_quant=False, words=False),
            "triton 128-row groups": dict(cfg=rows128),
            "tilelang": dict(impl="tilelang"),
            f"tilelang, {XLA}": dict(impl="tilelang", row_quant=False),
            f"tilelang, {XLA_BYTES}": dict(impl="tilelang", row_quant=False, words=False),
        }
        if not ue8m0:
            out[IEEE] = dict(markstein=False)
            out[f"tilelang, {IEEE}"] = dict(impl="tilelang", markstein=False)
        return out
    base = fp8_config(n * K, E)
    fused = swiglu_config(base, n * K, E, F)
    out = {
        "default": {},
        "padding rows written (before)": dict(pad_rows=True),
        XLA: dict(row_quant=False),
        XLA_BYTES: dict(row_quant=False, words=False),
    }
    if not ue8m0:
        out[IEEE] = dict(markstein=False)
    for bk, stages in ((256, 4), (256, 3), (512, 2)):
        down = replace(base, block_k=bk, num_stages=stages)
        gate_up = replace(fused, block_k=bk, num_stages=stages)
        out[f"both bk{bk} st{stages}"] = dict(cfg=down, swiglu_cfg=gate_up)
        if (bk, stages) == (256, 4):
            out[f"gate/up bk{bk} st{stages}"] = dict(cfg=base, swiglu_cfg=gate_up)
            out[f"down bk{bk} st{stages}"] = dict(cfg=down, swiglu_cfg=fused)
    out["both bk128 st6"] = dict(cfg=replace(base, num_stages=6), swiglu_cfg=replace(fused, num_stages=6))
    return out


def experts(
    *a, cfg=None, swiglu_cfg=None, pad_rows=False, impl=None, words=True, row_quant=True, markstein=True
):
    """`moe_experts_fp8` with the fused kernel's PAD_ROWS, `rows.WORDS` (fp8 rows gathered and scattered as
    words), `moe_experts.ROW_QUANT` (the activations gathered and quantized by `row_quant`'s kernel) and
    `row_quant.MARKSTEIN` set while it is traced (so compiled into its cubin and its XLA program); impl None:
    IMPL."""
    from djax.kernels import fp8_swiglu_triton as sk
    from djax.kernels import moe_experts, rows
    from djax.kernels import row_quant as rq

    before = sk.PAD_ROWS, rows.WORDS, moe_experts.ROW_QUANT, rq.MARKSTEIN
    sk.PAD_ROWS, rows.WORDS, moe_experts.ROW_QUANT, rq.MARKSTEIN = pad_rows, words, row_quant, markstein
    try:
        return moe_experts.moe_experts_fp8(*a, LIMIT, impl=impl or IMPL, cfg=cfg, swiglu_cfg=swiglu_cfg)
    finally:
        sk.PAD_ROWS, rows.WORDS, moe_experts.ROW_QUANT, rq.MARKSTEIN = before


def plot(result: dict, path: str) -> None:
    from ab_plot import plot_rounds

    if result.get("prefill"):  # compute-bound: the picks' FLOPs against FP8 peak
        from bench_tilelang import FP8_PEAK

        work, ceiling, measure = "flops", FP8_PEAK, "picks' FLOPs / time, of FP8 peak"
        what, target = "Triton against TileLang at prefill", 0.6
    else:  # the touched experts' bytes against the run's copy bandwidth
        work, ceiling, measure = "bytes", result["copy_bw"], "FP8 bytes / time, fraction of copy"
        what, target = "K step of the Triton kernels", 0.7
    panels = [
        (
            f"{row['tokens']} tokens, {row['touched']} experts touched: {measure}",
            lambda us, w=row[work]: w / (us * 1e-6) / ceiling,
            row["rounds"],
        )
        for row in result["rows"]
    ]
    suptitle = f"FP8 routed experts, {what}, {result['device']}, {result['date'][:10]}"
    plot_rounds(panels, "default", target, suptitle, path)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default=None, help="default 64,32,128,8; with --prefill 4096,1024,16384")
    p.add_argument("--prefill", action="store_true", help="the Triton kernels against TileLang's at prefill")
    p.add_argument(
        "--only", default="", help="comma-separated starts of the variant names to keep (and the default)"
    )
    p.add_argument(
        "--ue8m0",
        action="store_true",
        help="weights with UE8M0 (power-of-two) scales, as V4's checkpoints: the activations quantized likewise",
    )
    args = side_by_side_args(p, 3, plot)
    if args is None:
        return
    tokens = args.tokens or ("4096,1024,16384" if args.prefill else "64,32,128,8")
    from bench_kernels import measure_ceilings
    from bench_moe import first_tokens_check, routed_sets
    from bench_tilelang import FP8_PEAK, rel_err

    from djax.kernels.moe_experts import moe_experts_fp8
    from djax.quant import quantize

    os.makedirs(args.out, exist_ok=True)
    copy_bw, _ = measure_ceilings()
    res = dict(device=jax.devices()[0].device_kind, date=time.strftime("%Y-%m-%d %H:%M:%S"), copy_bw=copy_bw)
    res["prefill"], res["ue8m0"] = args.prefill, args.ue8m0
    res["rows"] = []
    print("copy", copy_bw / 1e12, "TB/s", flush=True)
    qs = []
    for i, shape in enumerate(((E, F, D), (E, D, F), (E, F, D))):  # w1, w2, w3 one at a time: 80 GB cards too
        w = (jax.random.normal(jax.random.key(i), shape, jnp.bfloat16) * shape[2] ** -0.5).astype(
            jnp.bfloat16
        )
        qs.append(jax.block_until_ready(quantize(w, scale_fmt="ue8m0" if args.ue8m0 else None)))
        del w
    per_expert = sum(q.nbytes for q in qs) // E
    ref_first, first = first_tokens_check(moe_experts_fp8)
    for n in [int(t) for t in tokens.split(",")]:
        sets, touched = routed_sets(n, D, E, K, (90, 95), qs)
        want = np.asarray(jax.jit(ref_first)(*sets[0]), np.float32)
        row = dict(tokens=n, touched=touched, bytes=touched * per_expert, rel_err={}, rounds=[], kernels={})
        row["flops"] = 2 * n * K * 3 * D * F
        fns = {}
        keep = [part for part in args.only.split(",") if part]
        for name, kw in variants(n, args.prefill, args.ue8m0).items():
            if keep and name != "default" and not name.startswith(tuple(keep)):
                continue
            fn = functools.partial(experts, **kw)
            try:
                got = np.asarray(first(jax.jit(fn)(*sets[0])), np.float32)
                row["rel_err"][name] = err = rel_err(got, want)
            except Exception as e:  # noqa: BLE001 - a config that does not build is recorded, not timed
                row["rel_err"][name] = err = float("inf")
                print(n, name, "failed:", repr(e)[:300], flush=True)
            print(n, name, "rel_err", err, flush=True)
            if err <= RTOL:
                fns[name] = fn
        timed = {name: (fn, sets) for name, fn in fns.items()}
        share = (row["flops"], FP8_PEAK, "FP8 peak") if args.prefill else (row["bytes"], copy_bw, "copy")
        row["rounds"] += timed_rounds(timed, args.rounds, (n,), share, row["kernels"])
        res["rows"].append(row)
        stem = ("moe_fp8_prefill_ab" if args.prefill else "moe_fp8_ab") + ("_ue8m0" if args.ue8m0 else "")
        save(res, args.out, stem, plot)


if __name__ == "__main__":
    main()
