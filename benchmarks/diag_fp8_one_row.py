#!/usr/bin/env python3
"""Where `linear(x, w, fp8="auto")` and `fp8="ref"` differ at one row: the activations' quantization (against
numpy's e4m3 rounding), the GEMM kernel against the jnp reference on the same quantized inputs, and each
`linear` against the reference with a float32 result. Writes fp8_linear_<device>_one_row_reference.json.

    python benchmarks/diag_fp8_one_row.py --out $OUT
"""

import argparse
import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from djax.kernels.fp8_gemm import fp8_gemm
from djax.kernels.fp8_gemm_ref import quantize_act
from djax.models.layers import linear
from djax.quant import quantize


def numpy_quant(x):
    m, k = x.shape
    g = np.asarray(x, np.float32).reshape(m, k // 128, 128)
    s = np.maximum(np.abs(g).max(-1, keepdims=True), np.float32(1e-12)) / np.float32(448.0)
    return (g / s).astype(ml_dtypes.float8_e4m3fn).reshape(m, k), s[..., 0]


def rel(o, r) -> float:
    o, r = np.asarray(o, np.float64), np.asarray(r, np.float64)
    return float(np.linalg.norm(o - r) / np.linalg.norm(r))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = ap.parse_args()
    n, k = 2048, 4096
    w = quantize(jax.random.normal(jax.random.key(70), (n, k), jnp.float32) * 0.02)
    out = {}
    for m in (1, 2, 32):
        x = jax.random.normal(jax.random.key(80), (m, k), jnp.float32).astype(jnp.bfloat16)
        a, s = jax.jit(quantize_act)(x)
        na, ns = numpy_quant(np.asarray(x, np.float32))

        def gemm(impl, a=a, s=s):
            f32 = jnp.float32
            return jax.jit(lambda a, s: fp8_gemm(a, s, w.values, w.scale, out_dtype=f32, impl=impl))(a, s)

        ref = gemm("ref")
        lin_ref = jax.jit(lambda x: linear(x, w, fp8="ref"))(x)
        lin_auto = jax.jit(lambda x: linear(x, w, fp8="auto"))(x)
        out[m] = dict(
            quant_elems_differing=int((np.asarray(a).astype(np.float32) != na.astype(np.float32)).sum()),
            scale_maxdiff=float(np.abs(np.asarray(s) - ns).max()),
            gemm_auto_vs_ref=rel(gemm("auto"), ref),
            linear_auto_vs_ref=rel(lin_auto, lin_ref),
            linear_ref_vs_gemm_ref=rel(lin_ref, ref),
            linear_auto_vs_gemm_ref=rel(lin_auto, ref),
        )
        print(m, out[m], flush=True)
    tag = jax.devices()[0].device_kind.lower().replace("nvidia", "").strip().replace(" ", "_")
    path = os.path.join(args.out, f"fp8_linear_{tag}_one_row_reference.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
