"""Sparse decode attention with the keys as wgmma's register operand: `sparse_decode_rs.cu` (CUDA, sm_90a)
compiled per shape by nvcc and launched by the FFI cubin launcher on XLA's stream.

Contract: `sparse_attn_ref.sparse_decode_ref` at head dim 512 with bf16 q. Each half key row comes in by one
bulk copy (512 bytes) instead of 32 cp.async of 16 bytes, which pace the TileLang kernels' key loop; since
wgmma's shared-memory operands cannot read linear rows, the kernel computes S^T = K Q^T and O^T += V^T P^T
with the keys loaded into registers by ldmatrix. Two CTAs per (row, 64 heads), one cluster, each over half of
the head dim and all of the row's keys, adding each other's partial scores every block (the TileLang pair's
scheme). The file's header says how the work is laid out. Compiling needs nvcc only.

Measured on the H200 at b64 (`benchmarks/results/attn_tilings_h200_rs_ab.json`): 30.3-30.4 us against
23.2-23.4 for the TileLang default, so `impl="auto"` does not take it; `rs_phases_h200.json` shows why (the
consumers' chain a block, not the loads, paces it). NOTES.md has the analysis.
"""

from __future__ import annotations

import functools
import hashlib
import math
from pathlib import Path

import jax
import jax.numpy as jnp

SOURCE = Path(__file__).with_name("sparse_decode_rs.cu")
HEADS = 64  # heads per CTA (wgmma N)
HEAD_DIM = 512  # the kernel's fixed head dim (256 a CTA)
THREADS = 384  # two consumer warpgroups and a producer
BLOCK = 64  # keys per step (wgmma M of S^T)
STAGES = 3
_ROW = HEAD_DIM + 16  # half a key row in shared memory, padded against ldmatrix bank conflicts
_SMEM_LIMIT = 227 * 1024


def _blocks(w: int, t: int) -> int:
    return -(-w // BLOCK) + -(-t // BLOCK)


def shared_bytes(w: int, t: int) -> int:
    """Dynamic shared memory (the `.cu`'s offsets): q's half, P^T per warpgroup, the peer's partial scores
    (double-buffered per warpgroup), the key stages, column maxima, the slot table, both warpgroups' max and
    denominator, barriers, and 1 KB to align the base."""
    return (
        HEADS * HEAD_DIM
        + 2 * HEADS * BLOCK * 2
        + 2 * 2 * HEADS * BLOCK * 4
        + STAGES * BLOCK * _ROW
        + 2 * 2 * 4 * 64 * 4
        + _blocks(w, t) * BLOCK * 4
        + 2 * 2 * 64 * 4
        + (2 * STAGES + 4) * 8
        + 1024
    )


def check_shapes(h: int, k: int, w: int, c: int, t: int) -> None:
    """Raises ValueError for shapes the kernel does not take."""
    if k != HEAD_DIM:
        raise ValueError(f"the register-operand sparse decode takes head dim {HEAD_DIM}, got {k}")
    if h % HEADS:
        raise ValueError(f"the register-operand sparse decode needs heads a multiple of {HEADS}, got {h}")
    if min(w, c, t) < 1:
        raise ValueError(f"need W, C, T >= 1, got W={w} C={c} T={t}")
    if (smem := shared_bytes(w, t)) > _SMEM_LIMIT:
        raise ValueError(f"{_blocks(w, t)} key blocks need {smem} B of shared memory (> {_SMEM_LIMIT} B)")


@functools.cache
def cuda_kernel(h: int, w: int, c: int, t: int, scale: float, edit=None):
    """Compiles the kernel for one static shape (no GPU needed; the cubin is cached on disk by source).
    `edit`, a function of the source text, compiles a changed copy (benchmarks/profile_rs_phases.py's
    stamps)."""
    from djax.ffi.cubin import Cubin
    from djax.kernels.tilelang_build import nvcc_cubin

    defines = {"SD_H": h, "SD_W": w, "SD_C": c, "SD_T": t, "SD_QK": f"{float(scale) * math.log2(math.e)!r}f"}
    head = "".join(f"#define {name} {value}\n" for name, value in defines.items())
    source = SOURCE.read_text()
    binary = nvcc_cubin(head + (edit(source) if edit else source), tilelang_headers=False)
    key = "rs-" + hashlib.sha256(binary).hexdigest()[:24]
    return Cubin(key, "sparse_decode_rs", binary, THREADS, shared_bytes(w, t), extra_null=0)


def sparse_decode_rs(q, window, window_valid, pool, topk, sinks, scale: float, edit=None):
    """`sparse_decode_ref`'s contract on a CUDA GPU (sm_90a): returns [b, h, 512] bf16.

    q [b, h, 512] bf16 with h a multiple of 64; window [b, W, 512]; window_valid bool[b, W]; pool
    [b, C, 512]; topk int32[b, T] (negative or >= C: invalid); sinks f32[h]. Keys are cast to bf16.
    `edit`: as in `cuda_kernel`."""
    from djax.ffi import cubin
    from djax.kernels.sparse_attn import kernel_operands

    if q.dtype != jnp.bfloat16:
        raise ValueError(f"the register-operand sparse decode takes bf16 q, got {q.dtype}")
    args = kernel_operands(q, window, window_valid, pool, topk, sinks, valid_dtype=jnp.bool_)
    b, h, k = q.shape
    w, c, t = window.shape[1], pool.shape[1], topk.shape[1]
    check_shapes(h, k, w, c, t)
    kern = cuda_kernel(h, w, c, t, float(scale), edit)
    return cubin.launch(kern, (b, h // HEADS, 2), args, jax.ShapeDtypeStruct(q.shape, q.dtype))
