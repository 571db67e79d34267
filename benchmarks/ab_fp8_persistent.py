"""The persistent FP8 GEMM (`fp8_gemm_tilelang.persistent_program`) against the "ws" default, side by side.

python benchmarks/ab_fp8_persistent.py [--build]   (--build: lower and compile only, no GPU needed)
At 4096x4096x4096 and 4096x7168x7168: the default tiling (TileLang's own warp specialisation, one CTA per
tile), and the persistent program with its tile stored from registers (3 and 4 stages) or through shared
memory by TMA (3 stages). Every output is checked against the f32 reference; then three rounds, each timing
every variant once (device time from a profiler trace), so drift between rounds shows. Writes
fp8_persistent_ab.json under $OUT (default /tmp).
"""

import functools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import djax.kernels.fp8_gemm_tilelang as F  # noqa: E402

SHAPES = [(4096, 4096, 4096), (4096, 7168, 7168)]
VARIANTS = [("pers_direct_s3", 3, "direct"), ("pers_direct_s4", 4, "direct"), ("pers_tma_s3", 3, "tma")]


def kernel(m, n, k, stages, store):
    """Lowers and compiles one persistent variant (no GPU needed): a `djax.ffi.tma.TmaKernel`."""
    from djax.ffi.tma import TmaKernel, params_from_tilelang

    t = F.WsTiling(128, 256, stages, panel=8, persistent=True)
    program = F.persistent_program(m, n, k, t, store=store)
    art = F._lower(program, {"kind": "cuda", "arch": F._ARCH}, F._WS_PASS_CONFIG)
    fn, launch = F._one_kernel(art)
    (host_fn,) = art.host_mod.functions.values()
    params = params_from_tilelang(fn, host_fn, F._PARAMS)
    binary = F.nvcc_cubin(art.kernel_source)
    key = f"pab-{store}-{stages}-{m}-{n}-{k}"
    return TmaKernel(
        key, launch["name"], binary, launch["grid"], launch["threads"], launch["shared_bytes"], params
    )


def launcher(kern, m, n):
    from djax.ffi import tma

    def run(a, sa, b, sb):
        return tma.launch(kern, [a, sa, b, sb], jax.ShapeDtypeStruct((m, n), jnp.bfloat16))

    return run


def main():
    from bench_kernels import bench
    from bench_tilelang import FP8_PEAK, RTOL, make_sets, rel_err

    from djax.kernels.fp8_gemm_ref import fp8_gemm_ref

    res = dict(device=jax.devices()[0].device_kind, date=time.strftime("%Y-%m-%d %H:%M:%S"), rows=[])
    for m, n, k in SHAPES:
        sets = make_sets(2, m, n, k)
        ref = np.asarray(jax.jit(functools.partial(fp8_gemm_ref, out_dtype=jnp.float32))(*sets[0]))
        fns = {"ws_default": functools.partial(F.fp8_gemm_tilelang, tiling=F.default_ws_tiling(m, n, k))}
        for name, stages, store in VARIANTS:
            fns[name] = launcher(kernel(m, n, k, stages, store), m, n)
        row = dict(m=m, n=n, k=k, rounds=[], rel_err={})
        for name, fn in fns.items():
            out = jax.block_until_ready(jax.jit(fn)(*sets[0]))
            row["rel_err"][name] = err = rel_err(np.asarray(out.astype(jnp.float32)), ref)
            print(m, n, k, name, "rel_err", err, "ok" if err <= RTOL else "WRONG", flush=True)
        for r in range(3):
            rnd = {}
            for name, fn in fns.items():
                if row["rel_err"][name] <= RTOL:
                    wall, dev, _ = bench(fn, sets, trace=True)
                    rnd[name] = round((dev or wall) * 1e6, 2)
            row["rounds"].append(rnd)
            ratios = {
                name: (us, round(2 * m * n * k / (us * 1e-6) / FP8_PEAK, 4)) for name, us in rnd.items()
            }
            print(m, n, k, "round", r, ratios, flush=True)
        res["rows"].append(row)
        with open(os.path.join(os.environ.get("OUT", "/tmp"), "fp8_persistent_ab.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    if "--build" in sys.argv:
        for m, n, k in SHAPES:
            for name, stages, store in VARIANTS:
                kernel(m, n, k, stages, store)
                print("built", name, m, n, k, flush=True)
    else:
        main()
