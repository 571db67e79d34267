"""Where the time goes in the register-operand sparse decode attention (`djax/kernels/sparse_decode_rs.cu`):
phase timestamps of one CTA at b 64 (64 heads x 512, W 128, top 512 of 2,048), beside the plain kernel's and
the TileLang default's device time.

python benchmarks/profile_rs_phases.py [--out DIR]      (CUDA GPU, nvcc where the cubins are not cached)
python benchmarks/profile_rs_phases.py --build          (compiles only: no GPU needed)

A copy of the kernel's source gets `clock64()` reads at named points into a small shared array (consumer
warpgroup 0's thread 0, warpgroup 1's thread 0 at its block starts and ends, the producer's first thread), and
CTA (0, 0, 0) writes them, less its start, over the first 256 bytes of its output. The instrumented kernel is
a little slower than the plain one; the points are where they sit in the source. Writes rs_phases.json.
"""

import argparse
import datetime
import functools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax  # noqa: E402
import numpy as np  # noqa: E402

from djax.kernels import sparse_attn_rs as rs  # noqa: E402

B, H, K, W, C, T = 64, 64, 512, 128, 2048, 512
SCALE = K**-0.5
NB = rs._blocks(W, T)
# name -> (index in the stamp array, count): per-block points are indexed by the warpgroup's own block count
POINTS = {
    "q_ready": (1, 1),
    "wg0_block_ready": (2, 5),
    "wg0_scores_done": (7, 5),
    "wg0_exchanged": (12, 5),
    "wg0_p_written": (17, 5),
    "wg0_block_done": (22, 5),
    "wg1_block_ready": (30, 5),
    "wg1_block_done": (35, 5),
    "loop_done": (40, 1),
    "swapped": (41, 1),
    "stored": (42, 1),
    "slots_done": (48, 1),
    "block_issued": (49, NB),
}


def _insert(src: str, anchor: str, text: str, after: bool = True) -> str:
    if src.count(anchor) != 1:
        raise ValueError(f"anchor not found once in the kernel source: {anchor[:60]!r}")
    return src.replace(anchor, anchor + text if after else text + anchor)


def stamped_source(src: str) -> str:
    """The kernel's source with the stamps of `POINTS` (the anchors are lines of the source)."""
    s = _insert(
        src,
        "  const int wg = threadIdx.x / 128, t = threadIdx.x % 128, w = t / 32, lane = t % 32;\n",
        "  __shared__ unsigned stamps[64];\n"
        "  const bool rec = bx == 0 && by == 0 && z == 0;\n"
        "#define STAMP_BY(tid, k) \\\n"
        "  do { if (rec && threadIdx.x == tid) stamps[k] = (unsigned)clock64(); } while (0)\n"
        "#define STAMP(k) STAMP_BY(0, k)\n"
        "#define STAMP1(k) STAMP_BY(128, k)\n"
        "#define PSTAMP(k) STAMP_BY(256, k)\n"
        "  if (threadIdx.x == 0) stamps[63] = (unsigned)clock64();\n",
    )
    s = _insert(
        s, "    __syncwarp();\n    for (int g = 0; g < NB; ++g) {\n", "    PSTAMP(48);\n", after=False
    )
    s = _insert(s, "      const int row = slots[g * BS + r];\n", "      PSTAMP(49 + g);\n", after=False)
    s = _insert(s, "  named_sync(1, 256);\n\n  float m[16]", "  STAMP(1);\n", after=False)
    s = _insert(
        s, "    mbar_wait(full0 + 8 * st, (g / STAGES) & 1);\n", "    STAMP(2 + n); STAMP1(30 + n);\n"
    )
    s = _insert(s, "    fence_regs(s);\n#pragma unroll\n    for (int b2", "    STAMP(7 + n);\n", after=False)
    s = _insert(s, "    mbar_wait(xbar, (n / 2) & 1);\n", "    STAMP(12 + n);\n")
    s = _insert(s, "    named_sync(2 + wg, 128);\n\n    // O^T", "    STAMP(17 + n);\n", after=False)
    s = _insert(
        s, "  }\n\n  // the denominator per head", "    STAMP(22 + n); STAMP1(35 + n);\n", after=False
    )
    s = _insert(s, "  // the two warpgroups' states:", "  STAMP(40);\n", after=False)
    s = _insert(s, "  float own[16], other[16];\n", "  STAMP(41);\n", after=False)
    last = "  cluster_sync();  // no CTA leaves while its peer may still send to it\n}\n"
    tail = (
        "  STAMP(42);\n  cluster_sync();  // no CTA leaves while its peer may still send to it\n"
        "  if (rec && threadIdx.x == 0)\n"
        "    for (int k = 0; k < 64; ++k) reinterpret_cast<unsigned*>(out)[k] = stamps[k] - stamps[63];\n}\n"
    )
    if not s.endswith(last):
        raise ValueError("the kernel's source does not end as expected")
    return s[: -len(last)] + tail


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    p.add_argument("--build", action="store_true", help="compile only")
    args = p.parse_args()
    plain, stamped = (rs.cuda_kernel(H, W, C, T, SCALE, edit) for edit in (None, stamped_source))
    if args.build:
        print("built", plain.key, stamped.key)
        return
    from bench_kernels import attn_sets, bench

    from djax.kernels.sparse_attn import sparse_decode

    sets = attn_sets(24, B, H, K, W, C, T)
    fns = {
        "rs": functools.partial(rs.sparse_decode_rs, scale=SCALE),
        "rs_stamped": functools.partial(rs.sparse_decode_rs, scale=SCALE, edit=stamped_source),
        "auto": functools.partial(sparse_decode, scale=SCALE),
    }
    times = {name: [] for name in fns}
    for _ in range(3):
        for name, fn in fns.items():
            wall, dev, _ = bench(fn, sets, trace=True)
            times[name].append(round((dev or wall) * 1e6, 2))
        print({n: v[-1] for n, v in times.items()}, flush=True)
    raw = np.asarray(jax.jit(fns["rs_stamped"])(*sets[0])).reshape(-1).view(np.uint32)[:64].astype(np.int64)
    raw = np.where(raw >= 2**31, raw - 2**32, raw)
    points = {name: raw[i : i + n].tolist() for name, (i, n) in POINTS.items()}
    print(json.dumps(points), flush=True)
    res = dict(
        device=jax.devices()[0].device_kind,
        date=datetime.datetime.now().isoformat(timespec="seconds"),
        shape=dict(b=B, h=H, k=K, W=W, C=C, T=T),
        device_us=times,
        cycles_from_cta_start=points,
    )
    with open(os.path.join(args.out, "rs_phases.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
