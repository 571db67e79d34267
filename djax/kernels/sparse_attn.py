"""Public sparse decode attention op for DeepSeek-V4:
`sparse_decode(..., impl="auto"|"ref"|"triton"|"tilelang"|"rs")`."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from djax.kernels import shapes
from djax.kernels.dispatch import has_tilelang, on_cuda, resolve, sm_count
from djax.kernels.sparse_attn_ref import combine_splits, sparse_decode_ref

# merge_splits' values, each with the TileLang tiling's merge fields it stands for (merge, dsmem, push, push_bf16)
MERGES = {
    False: (False, False, False, False),
    True: (True, False, False, False),
    "dsmem": (True, True, False, False),
    "push": (True, False, True, False),
    "push_bf16": (True, False, True, True),
}


def sparse_decode(
    q,
    window,
    window_valid,
    pool,
    topk,
    sinks,
    scale: float,
    impl: str = "auto",
    block_h: int | None = None,
    block_s: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    nsplit: int | None = None,
    merge_splits: bool | str = False,
    tma_q: bool = False,
    dim_pair: bool = False,
    p_in_exchange: bool = False,
):
    """Decode attention over the SWA ring plus top-k picks from the compressed pool, K = V, with sinks.

    q [b, h, k] bf16; window [b, W, k]; window_valid bool[b, W]; pool [b, C, k]; topk int32[b, T]
    (-1 = invalid pick); sinks f32[h]. Returns [b, h, k] in q's dtype. The Triton kernel needs k a
    power of two and h a multiple of `block_h` (>= 16); a row with nothing valid returns zeros.
    `nsplit` > 1 splits the keys over that many programs per row (flash decoding) and merges them after.
    With no tiling argument given Triton takes `triton_tiling`'s for the shape (splits so that the grid covers
    the SMs); with some given, the others take `FIXED_ARGS` (TileLang always: block_s 64, 2 stages, 8 warps,
    one split).

    impl="auto" on CUDA takes TileLang with its measured default tiling where the kernel applies and
    TileLang is installed, else Triton with the arguments given (`triton_tiling`'s where none are).
    impl="tilelang" (sm_90a; q bf16, h a multiple of 64): one CTA per (row, 64 heads, split) with
    `num_warps` * 32 threads (8 or 16 warps; 12 runs the warp-specialised program, block_s 32 or 64),
    `block_s` keys per step (16/32/64/128) and `num_stages`
    shared key buffers (below 2 is read as 2); `block_h` is ignored. `merge_splits` (12 warps, 2 to 8
    splits): the splits of a row run as one thread-block cluster and merge inside the kernel instead of
    through f32 partials merged after: True exchanges the partials through global memory (L2), "dsmem"
    through distributed shared memory (the cluster's shared memory, over the finished key ring; needs
    num_stages * block_s = 128), "push" (2 splits) each split sending the other the values of the half of
    the columns that the other stores, from registers, with no cluster barrier after the key loop
    ("push_bf16": those values rounded to bf16 on the way, half the bytes). `tma_q` (12 warps, head dim a
    multiple of 128): q comes in by TMA rather than by the producer's cp.async. `dim_pair` (12 warps, no
    splits): two CTAs per row (and 64 heads), one cluster, each taking half of the head dim over all of the
    row's keys and adding the other's partial scores every key block; no merge after the loop.
    `p_in_exchange` (with dim_pair, block_s 64): each block's P goes into the score buffer just read, which
    frees the shared memory for a fourth key stage.
    impl="rs" (sm_90a; q bf16, head dim 512, h a multiple of 64): the CUDA kernel with the keys as wgmma's
    register operand (`sparse_attn_rs`): half key rows by bulk copy, a CTA pair splitting the head dim as
    `dim_pair` does; the tiling arguments do not apply to it. An option, not taken by "auto": slower than
    the TileLang default at b64 on the H200 (30.3-30.4 us against 23.2-23.4, NOTES.md).
    Unsupported shapes raise ValueError.
    """
    shapes.sparse_decode(q, window, window_valid, pool, topk, sinks)
    if not isinstance(merge_splits, bool | str) or merge_splits not in MERGES:
        raise ValueError(f"merge_splits must be one of {tuple(MERGES)}, got {merge_splits!r}")
    options = (("tma_q", tma_q), ("dim_pair", dim_pair), ("p_in_exchange", p_in_exchange))
    for name, flag in options:
        if not isinstance(flag, bool):
            raise ValueError(f"{name} must be a bool, got {flag!r}")
    if impl == "auto" and q.dtype == jnp.bfloat16 and on_cuda() and has_tilelang():
        from djax.kernels import sparse_attn_tilelang

        tiling = sparse_attn_tilelang.default_tiling(
            q.shape[0], q.shape[1], q.shape[2], window.shape[1], topk.shape[1]
        )
        if tiling is not None:
            return sparse_attn_tilelang.sparse_decode_tilelang(
                q, window, window_valid, pool, topk, sinks, scale, tiling
            )
    impl = resolve(impl, ("ref", "triton", "tilelang", "rs"))
    other = {"triton": "the Triton kernel", "rs": "the register-operand kernel"}.get(impl)
    for name, flag in (("merge_splits", merge_splits), *options):
        if flag and other:
            raise ValueError(f"{name} is a TileLang option, which {other} does not take")
    if impl == "ref":
        return sparse_decode_ref(q, window, window_valid, pool, topk, sinks, scale)
    if impl == "rs":
        from djax.kernels.sparse_attn_rs import sparse_decode_rs

        return sparse_decode_rs(q, window, window_valid, pool, topk, sinks, scale)
    given = dict(block_h=block_h, block_s=block_s, num_warps=num_warps, num_stages=num_stages, nsplit=nsplit)
    # the arguments not given take FIXED_ARGS; Triton given none takes its tiling for the shape instead
    kw = {name: FIXED_ARGS[name] if v is None else v for name, v in given.items()}
    if impl == "tilelang":
        from djax.kernels.sparse_attn_tilelang import sparse_decode_tilelang

        del kw["block_h"]  # a CTA takes all 64 heads
        tiling = tilelang_tiling(**kw, merge_splits=merge_splits, **dict(options))
        return sparse_decode_tilelang(q, window, window_valid, pool, topk, sinks, scale, tiling)
    if all(v is None for v in given.values()):
        kw = triton_tiling(*q.shape[:2], window.shape[1], topk.shape[1])
    return _triton(q, window, window_valid, pool, topk, sinks, scale, **kw)


# The tiling arguments a caller does not give where it gives others (for TileLang also where it gives none;
# its stages below 2 read as 2): what `sparse_decode` took for every shape before `triton_tiling`
FIXED_ARGS = dict(block_h=32, block_s=64, num_warps=8, num_stages=1, nsplit=1)


def triton_tiling(b: int, h: int, w: int, t: int) -> dict:
    """The Triton kernel's arguments where `sparse_decode` is given none, for b rows of h heads over a ring of
    w and t picks. Raises ValueError unless h is a multiple of 16 (the kernel's smallest head block).

    From 32 rows of 64-head blocks on, one program takes all 64 heads of a row (each key read once, 8 warps),
    the keys split until the grid has about one program per SM (`dispatch.sm_count`); below, 16 heads a
    program (4 warps) and splits up to about two programs per SM, so that a few rows still spread over the
    GPU. Splits are whole key blocks, none empty. Under a mesh the rows are each device's own.

    H100, 2026-12-06, 64 heads x 512, ring 128 + top-512, device us, two alternating rounds. The sweep
    (`attn_triton_h100_sweep.json`) chose 16 heads with splits below 32 rows (at 32 rows 42.3 us against 35.4
    for 64 heads in 32-key steps, 4 splits; at 16 rows 26.0 against 30.1) and 64 heads from 32 rows (at 128
    rows 64.9 in 64-key steps against 96-138 for 16 or 32). The defaults then against the arguments every
    caller got before (32 heads a program, no split, one stage) and other 64-head tilings
    (`attn_triton_h100_defaults_ab.json`): b1 10.5 against 67.0 (6.4x), b4 15.2 / 95.9, b8 19.0 / 95.8, b16
    26.3 / 97.7, b32 33.6 / 98.6, b64 47.1 / 100.2 (64 heads, 64-key steps in 3 stages 50.6, 32-key 56.5),
    b128 65.3 / 203.6 (53% of copy)."""
    if h % 16:
        raise ValueError(f"the Triton sparse decode takes heads in multiples of 16, got {h}")
    block_h = 64 if h % 64 == 0 and b * (h // 64) >= 32 else 16
    block_s = 64 if block_h == 64 else 32
    key_blocks = -(-max(w + t, 1) // block_s)
    programs = b * (h // block_h)
    per_sm = 1 if block_h == 64 else 2
    nsplit = max(1, min(key_blocks, round(per_sm * sm_count() / programs)))
    nsplit = -(-key_blocks // -(-key_blocks // nsplit))  # whole key blocks a split, none left empty
    warps = 8 if block_h == 64 else 4
    return dict(block_h=block_h, block_s=block_s, num_warps=warps, num_stages=2, nsplit=nsplit)


def tilelang_tiling(
    block_s: int,
    num_stages: int,
    num_warps: int,
    nsplit: int = 1,
    merge_splits: bool | str = False,
    **options: bool,
):
    """The TileLang kernel's `Tiling` for `sparse_decode`'s arguments (stages below 2 read as 2); `options`:
    its boolean fields by name (tma_q, dim_pair, p_in_exchange)."""
    from djax.kernels.sparse_attn_tilelang import Tiling

    merge, dsmem, push, push_bf16 = MERGES[merge_splits]
    stages, threads = max(num_stages, 2), 32 * num_warps
    return Tiling(block_s, stages, threads, nsplit, merge, dsmem, push, push_bf16, **options)


def _triton(
    q, window, window_valid, pool, topk, sinks, scale, block_h, block_s, num_warps, num_stages, nsplit
):
    from djax.ffi import cubin
    from djax.kernels.sparse_attn_triton import constexprs, sparse_decode_kernel, sparse_decode_split_kernel

    b, h, k = q.shape
    args = kernel_operands(q, window, window_valid, pool, topk, sinks)
    names = ["q_ptr", "win_ptr", "valid_ptr", "pool_ptr", "topk_ptr", "sink_ptr"]
    cx = constexprs(h, k, window.shape[1], pool.shape[1], topk.shape[1], scale, block_h, block_s, nsplit)
    dtypes = [a.dtype for a in args]
    if nsplit == 1:
        kern = cubin.compile_triton(
            sparse_decode_kernel, [*names, "out_ptr"], [*dtypes, q.dtype], cx, num_warps, num_stages
        )
        return cubin.launch(kern, (b, h // block_h), args, jax.ShapeDtypeStruct(q.shape, q.dtype))
    f32 = jnp.float32
    kern = cubin.compile_triton(
        sparse_decode_split_kernel,
        [*names, "part_ptr", "lse_ptr"],
        [*dtypes, f32, f32],
        cx,
        num_warps,
        num_stages,
    )
    part, lse = cubin.launch(kern, (b, h // block_h, nsplit), args, split_results(q.shape, nsplit))
    return combine_splits(part, lse).astype(q.dtype)


def kernel_operands(q, window, window_valid, pool, topk, sinks, valid_dtype=jnp.int32) -> list:
    """The kernels' operands in launch order: keys in q's dtype, validity as `valid_dtype`, int32 picks,
    f32 sinks. Raises ValueError for inconsistent shapes."""
    shapes.sparse_decode(q, window, window_valid, pool, topk, sinks)
    return [
        q,
        window.astype(q.dtype),
        window_valid.astype(valid_dtype),
        pool.astype(q.dtype),
        topk.astype(jnp.int32),
        sinks.astype(jnp.float32),
    ]


def split_results(q_shape, nsplit: int) -> list:
    """The split kernels' results: f32 partial outputs [b, nsplit, h, k] and base-2 log-sum-exps [b, nsplit, h]."""
    b, h, k = q_shape
    f32 = jnp.float32
    return [jax.ShapeDtypeStruct((b, nsplit, h, k), f32), jax.ShapeDtypeStruct((b, nsplit, h), f32)]
