"""MoE grouped GEMM and FP8 GEMM cases of bench_kernels.py at DeepSeek-V4-Flash shapes (d 4096, f 2048,
e 256, top-6): each fast output is checked against a reference before it is timed (relative error recorded)."""

from __future__ import annotations

from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np

from djax.kernels.dispatch import has_tilelang
from djax.kernels.fp8_gemm import fp8_gemm, grouped_contiguous, grouped_masked
from djax.kernels.fp8_gemm_ref import quantize_act, quantize_weight
from djax.kernels.grouped_gemm import GemmConfig, grouped_gemm_masked, grouped_swiglu_masked
from djax.kernels.moe_experts import DECODE_CFG, layout, moe_experts, padded_rows
from djax.models.moe import experts_batched, experts_dense, experts_gather, experts_ragged

BF16 = jnp.bfloat16
LIMIT = 10.0
CHECK_TOKENS = 128  # rows are independent: the slow dense twin checks the first ones
PREFILL_CFGS = [
    GemmConfig(64, 128, 64, 4, 4),
    GemmConfig(128, 128, 64, 8, 3),
    GemmConfig(64, 64, 64, 4, 4),
]
DECODE_CFGS = [DECODE_CFG, GemmConfig(16, 64, 128, 4, 4), GemmConfig(64, 128, 64, 4, 4)]
FP8_CFGS = [GemmConfig(128, 128, 128, 8, 4), GemmConfig(64, 128, 128, 4, 4)]


def rel_err(fn, ref_fn, select, s) -> float:
    out = np.asarray(select(jax.jit(fn)(*s)), np.float32)
    ref = np.asarray(jax.jit(ref_fn)(*s), np.float32)
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def _routing(key, n, e, k):
    """Skewed top-k routing (some experts hot, some nearly idle), weights normalised like V4."""
    k1, k2 = jax.random.split(key)
    logits = jax.random.normal(k1, (n, e)) + 2.0 * jax.random.normal(k2, (e,))
    vals, idx = jax.lax.top_k(logits, k)
    w = jax.nn.softmax(vals, -1)
    return w.astype(jnp.float32), idx.astype(jnp.int32)


def routed_sets(n, d, e, k, seeds, weights, count: int = 4):
    """`count` timing sets (x, routing weights, picks, *weights) of n tokens with skewed routing (seeds: the
    routing's and x's first keys), and how many experts the first set touches."""
    sets = []
    for s in range(count):
        w, idx = _routing(jax.random.key(seeds[0] + s), n, e, k)
        x = jax.random.normal(jax.random.key(seeds[1] + s), (n, d), BF16)
        sets.append((x, w, idx, *weights))
    touched = int((np.bincount(np.asarray(sets[0][2]).ravel(), minlength=e) > 0).sum())
    return sets, touched


def _weights(key, e, d, f):
    k1, k2, k3 = jax.random.split(key, 3)
    scale = d**-0.5
    w1 = (jax.random.normal(k1, (e, f, d), BF16) * scale).astype(BF16)
    w3 = (jax.random.normal(k3, (e, f, d), BF16) * scale).astype(BF16)
    w2 = (jax.random.normal(k2, (e, d, f), BF16) * f**-0.5).astype(BF16)
    return w1, w2, w3


def moe_cases(record, small: bool):
    d, f, e, k = (4096, 2048, 256, 6) if not small else (64, 32, 8, 2)
    w1, w2, w3 = _weights(jax.random.key(0), e, d, f)
    wbytes = 3 * e * f * d * 2

    def dense_first(x, w, i, *ws):
        c = min(CHECK_TOKENS, x.shape[0])
        return experts_dense(x[:c], w[:c], i[:c], *ws, LIMIT)

    def first(out):
        return out[: min(CHECK_TOKENS, out.shape[0])]

    for n in (1024, 4096) if not small else (40,):
        sets, touched = routed_sets(n, d, e, k, (10, 20), (w1, w2, w3))
        flops, nbytes = 2 * n * k * d * f * 3, touched * wbytes // e + 4 * n * d
        shape = f"n{n} d{d} f{f} e{e} k{k}"
        check = (dense_first, first)
        # XLA's baseline is every expert on every token (reads each expert once). Its ragged_dot is not timed
        # on GPUs: XLA lowers it densely there too, but over n*k token copies (6x the batched FLOPs), which
        # at these sizes runs for minutes. The CPU smoke run (small) still times it.
        tr = record(
            "moe_experts",
            shape,
            "xla batched einsum",
            lambda *a: experts_batched(*a, LIMIT),
            sets,
            flops,
            nbytes,
            check=check,
        )
        if small:
            record(
                "moe_experts",
                shape,
                "xla ragged_dot_general",
                lambda *a: experts_ragged(*a, LIMIT),
                sets,
                flops,
                nbytes,
                tr,
                check,
            )
        variants = [(f"triton {tiles(c)}", c) for c in PREFILL_CFGS + ([DECODE_CFG] if small else [])]
        experts_rows(record, "moe_experts", shape, variants, sets, flops, nbytes, tr, check)

    # decode, batch 64: contiguous moe_experts vs the model's decode paths, then the masked layout alone
    n = 64 if not small else 8
    sets = []
    for s in range(4):
        w, idx = _routing(jax.random.key(30 + s), n, e, k)
        sets.append((jax.random.normal(jax.random.key(40 + s), (n, d), BF16), w, idx, w1, w2, w3))
    counts = np.bincount(np.asarray(sets[0][2]).ravel(), minlength=e)
    flops, nbytes = 2 * n * k * d * f * 3, int((counts > 0).sum()) * wbytes // e
    shape = f"decode n{n} d{d} f{f} e{e} k{k}"
    check = (dense_first, first)
    tr = record(
        "moe_experts",
        shape,
        "xla batched einsum",
        lambda *a: experts_batched(*a, LIMIT),
        sets,
        flops,
        nbytes,
        check=check,
    )
    record("moe_experts", shape, "xla gather", lambda *a: experts_gather(*a, LIMIT), sets, flops, nbytes, tr)
    for cfg in DECODE_CFGS:
        tag = f"bm{cfg.block_m} bn{cfg.block_n} bk{cfg.block_k} w{cfg.num_warps} st{cfg.num_stages}"
        record(
            "moe_experts",
            shape,
            f"triton {tag}",
            lambda *a, cfg=cfg: moe_experts(*a, LIMIT, impl="triton", cfg=cfg),
            sets,
            flops,
            nbytes,
            tr,
            check,
        )
    record("moe_experts", shape, "auto", lambda *a: moe_experts(*a, LIMIT), sets, flops, nbytes, tr, check)

    max_m = n  # capacity: every token may pick the same expert
    msets = []
    for x, _, idx, *_ in sets:
        lay = layout(idx, e, 1)  # unpadded expert order
        cnt = jnp.bincount(idx.ravel(), length=e).astype(jnp.int32)
        starts = jnp.cumsum(cnt) - cnt
        slot = jnp.arange(n * k) - starts[lay.m_indices[: n * k]]
        xm = jnp.zeros((e, max_m, d), BF16).at[lay.m_indices[: n * k], slot].set(x[lay.rows[: n * k]])
        msets.append((xm, w1, w3, w2, cnt))
    live = np.arange(max_m)[None] < np.asarray(msets[0][4])[:, None]

    def masked_pair(xm, w1, w3, w2, cnt, impl, cfg=None):
        h = grouped_swiglu_masked(xm, w1, w3, cnt, LIMIT, impl=impl, cfg=cfg)
        return grouped_gemm_masked(h, w2, cnt, impl=impl, cfg=cfg)

    shape = f"masked e{e} M{max_m} d{d} f{f} (n{n} k{k})"
    tr = record(
        "grouped_masked",
        shape,
        "xla einsum (all rows)",
        lambda *a: masked_pair(*a, "ref"),
        msets,
        flops,
        nbytes,
    )
    for cfg in DECODE_CFGS:
        if max_m % cfg.block_m:
            continue
        record(
            "grouped_masked",
            shape,
            f"triton bm{cfg.block_m} bn{cfg.block_n} bk{cfg.block_k}",
            lambda *a, cfg=cfg: masked_pair(*a, "triton", cfg),
            msets,
            flops,
            nbytes,
            tr,
            (lambda *a: masked_pair(*a, "ref")[live], lambda out: out[live]),
        )
    record(
        "grouped_masked",
        shape,
        "auto",
        lambda *a: masked_pair(*a, "auto"),
        msets,
        flops,
        nbytes,
        tr,
        (lambda *a: masked_pair(*a, "ref")[live], lambda out: out[live]),
    )


def timing_sets(m: int) -> int:
    """FP8 GEMM input sets a timing rotates through: at decode (m <= 64) six, since two sets of weights at n 4096
    would stay in the 50 MB L2; at prefill two (the GEMM is compute-bound)."""
    return 6 if m <= 64 else 2


def fp8_cases(record, small: bool, shapes=None):
    """FP8 block-scaled: dense (m x 4096 x 7168 at m 64, 8, 1 and 4096, 64 x 4096 x 4096, m x 7168 x 4096 at m 64
    and 8; or `shapes`, (m, n, k) each), grouped contiguous and masked at the MoE w1 shape."""
    from djax.kernels.fp8_gemm_triton import Fp8Config, dense_config, split_k

    # decode (m = 64): 64-row tiles (the smallest wgmma M) with narrower N tiles and K splits give
    # 32-512 programs at n = 4096 on 132 SMs; deeper pipelines keep more weight bytes in flight
    decode_cfgs = [
        Fp8Config(64, 128, 128, 4, 4, split_k=2),
        Fp8Config(64, 128, 128, 4, 4, split_k=4),
        Fp8Config(64, 64, 128, 4, 5, split_k=1),
        Fp8Config(64, 64, 128, 4, 4, split_k=2),
        Fp8Config(64, 64, 128, 4, 6, split_k=2),
        Fp8Config(64, 64, 128, 4, 6, split_k=4),
        Fp8Config(64, 32, 128, 4, 6, split_k=1),
        Fp8Config(64, 32, 128, 4, 6, split_k=2),
        Fp8Config(64, 32, 128, 4, 5, split_k=4),
        # one CTA per SM with a deep ring: as many weight bytes in flight as two CTAs of 6 stages, and no
        # (or a smaller) f32 partial sum after the kernel
        Fp8Config(64, 32, 128, 4, 12, split_k=1),
        Fp8Config(64, 32, 128, 4, 16, split_k=1),
        Fp8Config(64, 64, 128, 4, 12, split_k=2),
    ]

    def tag(cfg):
        return f"bm{cfg.block_m} bn{cfg.block_n} w{cfg.num_warps} st{cfg.num_stages} split{split_k(cfg)}"

    f32 = jnp.float32
    decode = [
        (64, 4096, 7168),
        (64, 4096, 4096),
        (8, 4096, 7168),
        (1, 4096, 7168),
        (64, 7168, 4096),
        (8, 7168, 4096),
    ]
    shapes = shapes or decode + [(4096, 4096, 7168)]
    for m, n, kk in shapes if not small else [(40, 64, 256)]:
        sets = []
        for s in range(timing_sets(m)):
            a, a_s = quantize_act(jax.random.normal(jax.random.key(50 + s), (m, kk), f32))
            b, b_s = quantize_weight(jax.random.normal(jax.random.key(60 + s), (n, kk), f32))
            sets.append((a, a_s, b, b_s))
        flops, nbytes = 2 * m * n * kk, m * kk + n * kk + 2 * m * n
        shape = f"m{m} n{n} k{kk}"
        tr = record(
            "fp8_gemm",
            shape,
            "xla fp8 dot, per-tensor scale",
            lambda a, a_s, b, b_s: (
                jnp.dot(a, b.T, preferred_element_type=f32) * a_s[0, 0] * b_s[0, 0]
            ).astype(BF16),
            sets,
            flops,
            nbytes,
        )
        if m <= 64:
            # What any kernel needs at this size just to stream the weights once: XLA's max over their bytes
            # (as uint32). At tens of MB a pass pays launch and ramp-up that the 2 GiB copy figure hides.
            record(
                "fp8_gemm",
                shape,
                "ceiling: read the weights once (xla max)",
                lambda a, a_s, b, b_s: jax.lax.bitcast_convert_type(
                    b.reshape(*b.shape[:-1], b.shape[-1] // 4, 4), jnp.uint32
                ).max(),
                sets,
                0,
                nbytes,
            )
        record(
            "fp8_gemm",
            shape,
            "xla jnp ref (dequant f32)",
            lambda *a: fp8_gemm(*a, impl="ref"),
            sets,
            flops,
            nbytes,
            tr,
        )
        cfgs = FP8_CFGS + (decode_cfgs if m <= 64 else [])
        default = dense_config(m, n, kk)  # what cfg=None runs: timed here, and marked
        if tag(default) not in map(tag, cfgs):
            cfgs = cfgs + [default]
        for cfg in cfgs:
            record(
                "fp8_gemm",
                shape,
                f"triton {tag(cfg)}" + (" (default)" if tag(cfg) == tag(default) else ""),
                lambda *a, cfg=cfg: fp8_gemm(*a, impl="triton", cfg=cfg),
                sets,
                flops,
                nbytes,
                tr,
                (lambda *a: fp8_gemm(*a, impl="ref"), lambda out: out),
            )
        if has_tilelang() and not small:  # side by side with Triton and XLA at the same shapes
            from djax.kernels.fp8_gemm_tilelang import default_ws_tiling

            record(
                "fp8_gemm",
                shape,
                f"tilelang {default_ws_tiling(m, n, kk).name} (its default)",
                lambda *a: fp8_gemm(*a, impl="tilelang", variant="ws"),
                sets,
                flops,
                nbytes,
                tr,
                (lambda *a: fp8_gemm(*a, impl="ref"), lambda out: out),
            )
        record(
            "fp8_gemm",
            shape,
            "auto",
            lambda *a: fp8_gemm(*a),
            sets,
            flops,
            nbytes,
            tr,
            (lambda *a: fp8_gemm(*a, impl="ref"), lambda out: out),
        )

    # grouped, w1 of V4-Flash: contiguous at prefill n=4096 top-6 (rows padded to 128), masked at decode; w2
    # (the down projection, [e, d, f]) contiguous at prefill
    d, f, e, k = (4096, 2048, 256, 6) if not small else (256, 128, 4, 2)
    w1 = quantize_weight(jax.random.normal(jax.random.key(70), (e, f, d), BF16))

    def one(mode, n, weight=w1):
        b, b_s = weight
        f, d = b.shape[1:]
        w, idx = _routing(jax.random.key(80), n, e, k)
        if mode == "contiguous":
            lay = layout(idx, e, 128)
            x = jax.random.normal(jax.random.key(81), (n, d), f32)
            a, a_s = quantize_act(jnp.where((lay.rows >= 0)[:, None], x[jnp.maximum(lay.rows, 0)], 0))
            groups = lay.m_indices
            rows = min(1024, groups.shape[0])
            sel = np.asarray(groups[:rows]) >= 0
            check = (
                lambda a, a_s, b, b_s, g: grouped_contiguous(
                    a[:rows], a_s[:rows], b, b_s, g[:rows], impl="ref"
                )[sel],
                lambda out: out[:rows][sel],
            )
            fast, ref = grouped_contiguous, None
        else:
            max_m = n
            a, a_s = quantize_act(jax.random.normal(jax.random.key(82), (e, max_m, d), f32))
            groups = jnp.bincount(idx.ravel(), length=e).astype(jnp.int32)
            live = np.arange(max_m)[None] < np.asarray(groups)[:, None]
            check = (lambda *z: grouped_masked(*z, impl="ref")[live], lambda out: out[live])
            fast, ref = grouped_masked, grouped_masked
        sets = [(a, a_s, b, b_s, groups)]
        touched = int((np.bincount(np.asarray(idx).ravel(), minlength=e) > 0).sum())
        flops, nbytes = 2 * n * k * d * f, touched * f * d
        shape = f"{mode} n{n} e{e} f{f} d{d} k{k}"
        tr = None
        if ref is not None:
            tr = record(
                "fp8_grouped", shape, "xla jnp ref", lambda *z: ref(*z, impl="ref"), sets, flops, nbytes
            )
        for cfg in FP8_CFGS + [GemmConfig(16, 128, 128, 4, 4)]:
            if mode == "masked" and max_m % cfg.block_m or mode == "contiguous" and 128 % cfg.block_m:
                continue
            record(
                "fp8_grouped",
                shape,
                f"triton bm{cfg.block_m} bn{cfg.block_n} w{cfg.num_warps} st{cfg.num_stages}",
                lambda *z, cfg=cfg: fast(*z, impl="triton", cfg=cfg),
                sets,
                flops,
                nbytes,
                tr,
                check,
            )
        if mode == "contiguous" and not small:  # TileLang's grouped kernel, bf16 out: its default and others
            from djax.kernels.fp8_gemm_tilelang import WsTiling, default_grouped_tiling

            default = default_grouped_tiling(f, d, groups.shape[0])
            # the one-tile-a-CTA kernel of the same tiles; 64-row tiles skip the second half of a 128-row
            # group's padding (a tile starting on padding)
            others = [
                replace(default, persistent=""),
                WsTiling(64, 256, 4, panel=8, scales_ahead=True),
                WsTiling(128, 128, 4, panel=8, scales_ahead=True),
            ]
            for t in [default, *others]:
                record(
                    "fp8_grouped",
                    shape,
                    f"tilelang {t.name}" + (" (its default)" if t == default else ""),
                    lambda *z, t=t: grouped_contiguous(*z, impl="tilelang", tiling=t),
                    sets,
                    flops,
                    nbytes,
                    tr,
                    check,
                )
        record("fp8_grouped", shape, "auto", lambda *z: fast(*z), sets, flops, nbytes, tr, check)

    one("contiguous", 4096 if not small else 40)
    if not small:
        one("contiguous", 4096, quantize_weight(jax.random.normal(jax.random.key(71), (e, d, f), BF16)))
    one("masked", 64 if not small else 8)


# Contiguous layouts of few groups with many rows each, what one expert-parallel rank's local experts take at
# prefill: the shapes DeepGEMM times its contiguous kernel at (groups x mean rows, n, k), and V4-Flash's 32 local
# experts of 256 on 8 ranks at 4,096 tokens a rank (top-6: about 768 rows each), gate or up (n 2048, k 4096)
# and down (n 4096, k 2048)
GROUPED_EP_SHAPES = [
    (4, 8192, 4096, 7168),
    (8, 4096, 4096, 7168),
    (4, 8192, 7168, 2048),
    (8, 4096, 7168, 2048),
    (32, 768, 2048, 4096),
    (32, 768, 4096, 2048),
]


def group_sizes(groups: int, mean: int, seed: int) -> np.ndarray:
    """Rows per group, uneven as routing makes them: uniform in [0.7, 1.3] x mean (fixed by seed)."""
    rng = np.random.default_rng(seed)
    return np.maximum(1, (mean * rng.uniform(0.7, 1.3, groups)).astype(np.int64))


def contiguous_indices(sizes: np.ndarray, block_m: int = 128) -> np.ndarray:
    """m_indices of the contiguous layout: each group's rows, then -1 up to the next multiple of block_m
    (no rows past the last group: the row count is exact, as a rank that knows its received tokens has)."""
    return np.concatenate(
        [np.r_[np.full(r, g), np.full(-r % block_m, -1)] for g, r in enumerate(sizes)]
    ).astype(np.int32)


def fp8_grouped_ep_cases(record, small: bool):
    """FP8 grouped contiguous at `GROUPED_EP_SHAPES`: XLA's per-tensor FP8 dot per group (cuBLAS, one scale per
    tensor: a bound, not the same work), TileLang's default, its dense kernel over the same rows (FLOPs of every
    row there), "auto" and Triton's default. FLOPs count the groups' rows, not their padding. Checked against the
    reference on the first 1,024 rows."""
    f32 = jnp.float32
    shapes = GROUPED_EP_SHAPES if not small else [(3, 100, 256, 256)]
    for i, (groups, mean, n, k) in enumerate(shapes):
        sizes = group_sizes(groups, mean, seed=groups + mean + n + k)  # one layout per shape
        mi = contiguous_indices(sizes)
        m = mi.size
        # (first row, rows) of each group, for XLA's per-group dots
        spans = [(int(np.argmax(mi == g)), int(r)) for g, r in enumerate(sizes)]
        b, b_s = quantize_weight(jax.random.normal(jax.random.key(100 + i), (groups, n, k), BF16))
        sets = []
        for s in range(timing_sets(m)):
            x = jax.random.normal(jax.random.key(110 + s), (m, k), f32)
            a, a_s = quantize_act(jnp.where((mi >= 0)[:, None], x, 0))
            sets.append((a, a_s, b, b_s, jnp.asarray(mi)))
        picks = int(sizes.sum())
        flops, nbytes = 2 * picks * n * k, m * k + groups * n * k + 2 * m * n
        shape = f"contiguous g{groups} x~{mean} ({m} rows, {picks} live) n{n} k{k}"
        rows = min(1024, m)
        sel = mi[:rows] >= 0
        check = (
            lambda a, a_s, b, b_s, g, rows=rows, sel=sel: grouped_contiguous(
                a[:rows], a_s[:rows], b, b_s, g[:rows], impl="ref"
            )[sel],
            lambda out, rows=rows, sel=sel: out[:rows][sel],
        )

        def per_group(a, a_s, b, b_s, g, spans=spans):
            return jnp.concatenate(
                [
                    (
                        jnp.dot(a[s : s + r], b[j].T, preferred_element_type=f32) * a_s[0, 0] * b_s[j, 0, 0]
                    ).astype(BF16)
                    for j, (s, r) in enumerate(spans)
                ]
            )

        tr = record(
            "fp8_grouped", shape, "xla fp8 dot per group, per-tensor scale", per_group, sets, flops, nbytes
        )
        variants = []
        if has_tilelang() and not small:
            variants.append(("tilelang (its default)", dict(impl="tilelang")))
            # what grouping costs: the dense kernel over the same rows with one weight matrix (not checked)
            record(
                "fp8_grouped",
                shape,
                "tilelang dense kernel, group 0's weight for every row",
                lambda a, a_s, b, b_s, g: fp8_gemm(a, a_s, b[0], b_s[0], impl="tilelang", variant="ws"),
                sets,
                2 * m * n * k,
                nbytes,
                tr,
            )
        variants += [("auto", {}), ("triton (its default)", dict(impl="triton"))]
        for name, kw in variants:
            record(
                "fp8_grouped",
                shape,
                name,
                lambda *z, kw=kw: grouped_contiguous(*z, **kw),
                sets,
                flops,
                nbytes,
                tr,
                check,
            )


def layout_rows(record, shape, idx_sets, e, bm):
    """The picks' padded expert layout alone (`moe_experts.layout`): XLA's ops against the one Triton
    program, checked equal. Bytes: idx read, rows, m_indices and pos written."""
    n_picks = idx_sets[0][0].size
    nb = 4 * (2 * n_picks + 2 * padded_rows(n_picks, e, bm))

    def flat(lay):
        return jnp.concatenate([v.astype(jnp.float32) for v in lay])

    def ref(i):
        return layout(i, e, bm, "ref")

    t_ref = record("moe_layout", shape, "xla (jnp spec)", ref, idx_sets, 0, nb)
    check = (lambda i: flat(ref(i)), flat)
    record(
        "moe_layout",
        shape,
        "triton one program",
        lambda i: layout(i, e, bm, "triton"),
        idx_sets,
        0,
        nb,
        t_ref,
        check,
    )


def first_tokens_check(experts, tokens: int = 4):
    """`record`'s check for a routed-experts op: its jnp reference (impl "ref"; one row per pick, as the
    reference ignores tiles) on the first tokens, against the same rows of the fast output. Rows are
    independent, so a few check the layout, the kernels and the combine."""
    exact = GemmConfig(block_m=1)

    def ref_first(x, w, i, *ws):
        return experts(x[:tokens], w[:tokens], i[:tokens], *ws, LIMIT, impl="ref", cfg=exact)

    return ref_first, lambda out: out[:tokens]


def moe_fp8_cases(record, small: bool):
    """Routed experts with FP8 weights (e4m3, 128x128 scales: an FP8 checkpoint's experts) at V4-Flash shapes,
    decode and prefill token counts: made dense on use then the bf16 grouped GEMMs (what the model ran before
    `moe_experts_fp8`; the speed-up column is over it), read as stored by the FP8 grouped GEMMs
    (`moe_experts_fp8`, per tiling), and for scale the bf16 kernels on bf16 weights (a bf16 checkpoint).
    Checked against `moe_experts_fp8`'s jnp reference on the first tokens."""
    from djax.kernels.fp8_gemm_triton import Fp8Config
    from djax.kernels.moe_experts import FP8_DECODE_CFG, FP8_PREFILL_CFG, fp8_config, moe_experts_fp8
    from djax.kernels.moe_layout_triton import MAX_PICKS
    from djax.quant import quantize

    d, f, e, k = (4096, 2048, 256, 6) if not small else (256, 128, 8, 2)
    w1, w2, w3 = _weights(jax.random.key(0), e, d, f)
    q1, q2, q3 = (quantize(w) for w in (w1, w2, w3))
    per_expert = {"fp8": sum(q.nbytes for q in (q1, q2, q3)) // e, "bf16": 3 * f * d * 2}
    check = first_tokens_check(moe_experts_fp8)

    def bf16_kernels(*a):  # FP8 weights are made dense on use
        return moe_experts(*a, LIMIT, impl="triton")

    variants = [
        ("fp8 dense on use, triton bf16 kernels", "fp8"),
        ("bf16 weights, triton bf16 kernels", "bf16"),
    ]
    # a plain GemmConfig gets each GEMM's K split from `fp8_split`; an Fp8Config names its own (decode sizes)
    tilings = [
        FP8_DECODE_CFG,
        GemmConfig(16, 64, 128, 4, 4),
        FP8_PREFILL_CFG,
        GemmConfig(128, 128, 128, 8, 4),
    ]
    forced = [Fp8Config(**vars(FP8_DECODE_CFG), split_k=s) for s in (1, 2, 4)]
    for n in (1, 32, 128, 4096) if not small else (3, 40):
        sets, touched = routed_sets(n, d, e, k, (90, 95), (q1, q2, q3))
        bf16_sets = [(x, w, idx, w1, w2, w3) for x, w, idx, *_ in sets]
        flops = 2 * n * k * d * f * 3
        shape = f"n{n} d{d} f{f} e{e} k{k}"
        tr = None
        for name, wdt in variants:
            t = record(
                "moe_experts_fp8",
                shape,
                name,
                bf16_kernels,
                sets if wdt == "fp8" else bf16_sets,
                flops,
                touched * per_expert[wdt],
                tr,
                check if wdt == "fp8" else None,
            )
            tr = tr or t
        default = fp8_config(n * k, e)
        if n * k <= MAX_PICKS:
            layout_rows(record, shape, [(s[2],) for s in sets], e, default.block_m)
        for cfg in tilings + (forced if n <= 32 else forced[:1]):
            tag = tiles(cfg)
            tag += f" split {cfg.split_k}" if isinstance(cfg, Fp8Config) else ""
            record(
                "moe_experts_fp8",
                shape,
                f"fp8 grouped {tag}" + (" (default)" if cfg == default else ""),
                lambda *a, cfg=cfg: moe_experts_fp8(*a, LIMIT, impl="triton", cfg=cfg),
                sets,
                flops,
                touched * per_expert["fp8"],
                tr,
                check,
            )
        record(
            "moe_experts_fp8",
            shape,
            "fp8 grouped, gate and up as two GEMMs (before the fused kernel)",
            lambda *a, c=default: experts_fp8_unfused(*a, cfg=c),
            sets,
            flops,
            touched * per_expert["fp8"],
            tr,
            check,
        )
        for c, fused in fused_variants(default) if n <= 32 or n >= 4096 else ():
            record(
                "moe_experts_fp8",
                shape,
                f"fp8 grouped {tiles(c)}, fused gate/up {tiles(fused)}",
                lambda *a, c=c, f=fused: moe_experts_fp8(*a, LIMIT, impl="triton", cfg=c, swiglu_cfg=f),
                sets,
                flops,
                touched * per_expert["fp8"],
                tr,
                check,
            )


def fp4_experts(small: bool):
    """V4.1-Flash's routed experts as FP4 (d 5120, f 2304, e 384, top-6; tiny shapes with small): (d, f, e,
    k, (w1, w2, w3) as FP4 QArrays with UE8M0 scales, FP4 bytes per expert). Every e2m1 code; scales 2^-9 ..
    2^-7, so O(1) activations stay O(1) through both GEMMs at these widths."""
    from djax.fp4 import random_fp4

    d, f, e, k = (5120, 2304, 384, 6) if not small else (256, 128, 8, 2)
    keys = jax.random.split(jax.random.key(7), 3)
    q1, q3 = random_fp4(keys[0], (e, f, d), 118, 121), random_fp4(keys[1], (e, f, d), 118, 121)
    q2 = random_fp4(keys[2], (e, d, f), 118, 121)
    return d, f, e, k, (q1, q2, q3), sum(q.nbytes for q in (q1, q2, q3)) // e


def moe_fp4_cases(record, small: bool):
    """Routed experts with FP4 weights (V4.1-Flash: d 5120, f 2304, e 384, top-6; e2m1 codes with per-32
    UE8M0 scales) at decode and prefill token counts: made dense on use then the bf16 grouped GEMMs (the path
    before the kernels read FP4; the speed-up column is over it), read as stored by the same kernels (FP4
    tiles decoded in registers by `fp4_decode`'s PTX, per tiling; "auto" the default; and the default tiling
    decoding code by code), and for scale the bf16 kernels on bf16 weights. Bytes: the touched experts' FP4 codes and scales. Checked against the jnp reference (the stack
    made dense) on the first tokens."""
    from djax.kernels.grouped_gemm_triton import Fp4Config
    from djax.kernels.moe_experts import FP4_FEW_PICKS_CFG, PREFILL_CFG, default_config
    from djax.quant import dense

    d, f, e, k, (q1, q2, q3), fp4_bytes = fp4_experts(small)
    per_expert = {"fp4": fp4_bytes, "bf16": 3 * f * d * 2}
    check = first_tokens_check(moe_experts)

    def dense_on_use(x, w, i, *ws):
        return moe_experts(x, w, i, *(dense(q, x.dtype) for q in ws), LIMIT, impl="triton")

    # FP4 tiles take a third of bf16's shared memory, so deeper pipelines fit: 8 stages at decode; 8 warps
    # hold twice the warps an SM runs at decode, where one CTA of 4 warps an SM decodes the tiles
    tilings = [
        DECODE_CFG,
        replace(DECODE_CFG, num_stages=8),
        replace(DECODE_CFG, num_warps=8),
        FP4_FEW_PICKS_CFG,
        GemmConfig(16, 64, 128, 4, 4),
        PREFILL_CFG,
        GemmConfig(64, 128, 128, 4, 4),
    ]
    b1, b2, b3 = (dense(q, BF16) for q in (q1, q2, q3))
    for n in (1, 64, 4096) if not small else (3, 40):
        sets, touched = routed_sets(n, d, e, k, (60, 65), (q1, q2, q3))
        flops = 2 * n * k * d * f * 3
        nbytes = touched * per_expert["fp4"]
        shape = f"n{n} d{d} f{f} e{e} k{k}"
        tr = record(
            "moe_fp4", shape, "fp4 dense on use, triton bf16 kernels", dense_on_use, sets, flops, nbytes
        )
        record(
            "moe_fp4",
            shape,
            "bf16 weights, triton bf16 kernels",
            lambda *a: moe_experts(*a, LIMIT, impl="triton"),
            [(x, w, idx, b1, b2, b3) for x, w, idx, *_ in sets],
            flops,
            touched * per_expert["bf16"],
            tr,
        )
        default = default_config(n * k, e, fp4=True)
        label = lambda c: f"fp4 read as stored {tiles(c)}"  # noqa: E731
        variants = [(label(c) + (" (default)" if c == default else ""), c) for c in tilings]
        bits = Fp4Config(**vars(default), fp4_decode="bits")
        variants.append((label(default) + ", decoded code by code (not the PTX)", bits))
        experts_rows(record, "moe_fp4", shape, variants, sets, flops, nbytes, tr, check)


def tiles(cfg) -> str:
    """A config's tiles as the rows name them (the K step where it is not the FP8 kernels' fixed 128)."""
    bk = "" if cfg.block_k == 128 else f" bk{cfg.block_k}"
    return f"bm{cfg.block_m} bn{cfg.block_n}{bk} w{cfg.num_warps} st{cfg.num_stages}"


def experts_rows(record, kernel, shape, variants, sets, flops, nbytes, ref_time, check):
    """`moe_experts` with the Triton kernels timed at each (variant name, config), then as "auto" gets it."""
    for variant, cfg in variants:
        fn = lambda *a, cfg=cfg: moe_experts(*a, LIMIT, impl="triton", cfg=cfg)  # noqa: E731
        record(kernel, shape, variant, fn, sets, flops, nbytes, ref_time, check)
    record(kernel, shape, "auto", lambda *a: moe_experts(*a, LIMIT), sets, flops, nbytes, ref_time, check)


def fused_variants(default):
    """(cfg, swiglu_cfg) pairs: at decode (16-row tiles) the fused kernel's column tiles 128, 64, 32 with the
    down GEMM as by default; at prefill the default's 64-row tiles with 128 columns, and 128-row tiles with
    128 or 64."""
    if default.block_m == 16:
        return [(default, replace(default, block_n=bn)) for bn in (128, 64, 32)]
    big = GemmConfig(128, 128, 128, 8, 4)
    return [(default, replace(default, block_n=128)), (big, big), (big, replace(big, block_n=64))]


def experts_fp8_unfused(x, weights, idx, w1, w2, w3, cfg):
    """`moe_experts_fp8` as it ran before its gate/up kernel: gate and up as two grouped GEMMs (each split
    along K by `fp8_split`) over a gathered copy of the quantized tokens, then XLA's SwiGLU."""
    from djax.kernels.moe_experts import _combine, fp8_split
    from djax.models.layers import swiglu_act

    n, k, e = x.shape[0], idx.shape[1], w1.shape[0]
    lay = layout(idx, e, cfg.block_m, "triton")
    xq, xs = quantize_act(x)
    src = jnp.maximum(lay.rows, 0)

    def gemm(a, a_scale, w):
        c = fp8_split(cfg, n * k, e, *w.shape[1:])
        scale = w.scale.astype(jnp.float32)
        return grouped_contiguous(a, a_scale, w.values, scale, lay.m_indices, x.dtype, "triton", c)

    gate, up = gemm(xq[src], xs[src], w1), gemm(xq[src], xs[src], w3)
    h = swiglu_act(gate.astype(jnp.float32), up.astype(jnp.float32), LIMIT)
    h = jnp.where((lay.m_indices >= 0)[:, None], h, 0)
    y = gemm(*quantize_act(h), w2)
    return _combine(y, lay, weights, n, k, x.shape[1]).astype(x.dtype)
