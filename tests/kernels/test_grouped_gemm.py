"""Grouped GEMMs for MoE: references against numpy; Triton kernels (interpreted, f32) against the references;
`moe_experts` with the interpreted kernels against the model's `experts_dense` / `experts_ragged`."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checks import assert_close, needs_triton_interp, random_fp4

from djax.kernels import grouped_gemm_ref as ref
from djax.kernels.grouped_gemm import (
    MASKED_CFGS,
    GemmConfig,
    grouped_gemm,
    grouped_gemm_masked,
    grouped_swiglu,
    grouped_swiglu_masked,
)
from djax.kernels.grouped_gemm_triton import masked_config
from djax.kernels.moe_experts import layout, moe_experts, padded_rows
from djax.models.moe import experts_dense, experts_ragged

SMALL = GemmConfig(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=1)


def _contiguous(rng, sizes, bm, k, n_src=None):
    """m_indices for groups of `sizes` padded to bm, plus one trailing empty tile; rows into n_src rows."""
    mi = []
    for g, s in enumerate(sizes):
        mi += [g] * s + [-1] * (-(-s // bm) * bm - s)
    mi = np.array(mi + [-1] * bm, np.int32)
    rows = None
    if n_src is not None:
        rows = np.where(mi >= 0, rng.integers(0, n_src, mi.size), -1).astype(np.int32)
    return mi, rows


def _np_swiglu(g, u, limit):
    if limit > 0:
        g, u = np.minimum(g, limit), np.clip(u, -limit, limit)
    return g / (1 + np.exp(-g)) * u


def test_refs_match_numpy():
    rng = np.random.default_rng(0)
    g, n, k = 3, 24, 40
    mi, rows = _contiguous(rng, [5, 0, 19], 8, k, n_src=11)
    a = rng.standard_normal((11, k)).astype(np.float32)
    b, b3 = rng.standard_normal((2, g, n, k)).astype(np.float32)
    out = np.asarray(ref.contiguous_ref(*map(jnp.asarray, (a, b, mi, rows))))
    h = np.asarray(ref.swiglu_contiguous_ref(*map(jnp.asarray, (a, b, b3, mi)), 1.0, jnp.asarray(rows)))
    for i in range(mi.size):
        if mi[i] < 0:
            assert np.all(out[i] == 0) and np.all(h[i] == 0)
            continue
        x = a[rows[i]].astype(np.float64)
        np.testing.assert_allclose(out[i], b[mi[i]] @ x, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(h[i], _np_swiglu(b[mi[i]] @ x, b3[mi[i]] @ x, 1.0), rtol=1e-5, atol=1e-5)
    am = rng.standard_normal((g, 8, k)).astype(np.float32)
    cnt = np.array([0, 8, 3], np.int32)
    om = np.asarray(ref.masked_ref(*map(jnp.asarray, (am, b, cnt))))
    for gi in range(g):
        np.testing.assert_allclose(om[gi, : cnt[gi]], am[gi, : cnt[gi]] @ b[gi].T, rtol=1e-5, atol=1e-5)
        assert np.all(om[gi, cnt[gi] :] == 0)


@needs_triton_interp
@pytest.mark.parametrize("with_rows", [False, True])
def test_contiguous_triton_interpreted(with_rows):
    rng = np.random.default_rng(1)
    g, n, k = 4, 48, 40  # n, k not multiples of the 16-wide tiles' count: masked edges
    mi, rows = _contiguous(rng, [5, 0, 20, 3], 16, k, n_src=9 if with_rows else None)
    a = rng.standard_normal((9 if with_rows else mi.size, k)).astype(np.float32)
    b, b3 = rng.standard_normal((2, g, n, k)).astype(np.float32)
    args = [jnp.asarray(v) for v in (a, b, mi)]
    r = None if rows is None else jnp.asarray(rows)
    live = mi >= 0
    out = grouped_gemm(*args, rows=r, impl="interpret", cfg=SMALL)
    assert_close(np.asarray(out)[live], np.asarray(grouped_gemm(*args, rows=r, impl="ref"))[live], 1e-5)
    h = grouped_swiglu(args[0], args[1], jnp.asarray(b3), args[2], 1.5, rows=r, impl="interpret", cfg=SMALL)
    hr = grouped_swiglu(args[0], args[1], jnp.asarray(b3), args[2], 1.5, rows=r, impl="ref")
    assert_close(np.asarray(h)[live], np.asarray(hr)[live], 1e-5)


@needs_triton_interp
@pytest.mark.parametrize("weights", ["plain", "fp4"])
def test_masked_triton_interpreted_skips_dead_tiles(weights):
    """Plain weights with k 48 (a K edge inside the 16-wide steps), and FP4 ones (codes and UE8M0 scales read
    as stored) with k 96 over 32-wide steps."""
    rng = np.random.default_rng(2)
    g, mm, n, k = 4, 32, 32, 48 if weights == "plain" else 96
    cfg = SMALL if weights == "plain" else GemmConfig(16, 16, 32, 4, 1)
    a = jnp.asarray(rng.standard_normal((g, mm, k)), jnp.float32)
    if weights == "plain":
        b, b3 = (jnp.asarray(v) for v in rng.standard_normal((2, g, n, k)).astype(np.float32))
    else:
        b, b3 = random_fp4(rng, (g, n, k)), random_fp4(rng, (g, n, k))
    cnt = jnp.asarray([0, 32, 17, 1], jnp.int32)
    live = np.arange(mm)[None] < np.asarray(cnt)[:, None]
    out = np.asarray(grouped_gemm_masked(a, b, cnt, impl="interpret", cfg=cfg))
    assert_close(out[live], np.asarray(grouped_gemm_masked(a, b, cnt, impl="ref"))[live], 1e-5)
    assert np.isnan(out[0]).all() and np.isnan(out[2, 32 - 1]).all()  # tiles past the count: never written
    h = np.asarray(grouped_swiglu_masked(a, b, b3, cnt, 0.0, impl="interpret", cfg=cfg))
    assert_close(h[live], np.asarray(grouped_swiglu_masked(a, b, b3, cnt, 0.0, impl="ref"))[live], 1e-5)


def test_masked_config_takes_the_widest_tile_dividing_the_rows():
    picks = {mm: masked_config(mm, MASKED_CFGS).block_m for mm in (256, 128, 192, 64, 48, 16)}
    assert picks == {256: 128, 128: 128, 192: 64, 64: 64, 48: 16, 16: 16}
    with pytest.raises(ValueError, match="masked rows per group 40 must be a multiple of 16"):
        masked_config(40, MASKED_CFGS)


@needs_triton_interp
def test_masked_triton_interpreted_without_a_config():
    """48 rows per group: no config takes 16-row tiles (128 and 64 do not divide 48); 40 rows: a clear error."""
    rng = np.random.default_rng(5)
    g, mm, n, k = 3, 48, 40, 72
    a = jnp.asarray(rng.standard_normal((g, mm, k)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((g, n, k)), jnp.float32)
    cnt = jnp.asarray([48, 0, 21], jnp.int32)
    live = np.arange(mm)[None] < np.asarray(cnt)[:, None]
    out = np.asarray(grouped_gemm_masked(a, b, cnt, impl="interpret"))
    assert_close(out[live], np.asarray(grouped_gemm_masked(a, b, cnt, impl="ref"))[live], 1e-5)
    with pytest.raises(ValueError, match="masked rows per group 40"):
        grouped_gemm_masked(a[:, :40], b, cnt, impl="interpret")


@pytest.mark.parametrize("impl", ["ref", pytest.param("interpret", marks=needs_triton_interp)])
def test_layout_groups_are_tile_aligned(impl):
    rng = np.random.default_rng(3)
    n, k, e, bm = 29, 4, 8, 16
    idx = rng.choice([0, 2, 3, 7], (n, k)).astype(np.int32)
    idx[3, 1] = -1  # dropped pick
    lay = layout(jnp.asarray(idx), e, bm, impl)
    rows, mi, pos = (np.asarray(v) for v in lay)
    assert rows.size == padded_rows(n * k, e, bm) and rows.size % bm == 0
    for t in range(n):
        for j in range(k):
            p = pos[t * k + j]
            if idx[t, j] < 0:
                assert p == -1
            else:
                assert rows[p] == t and mi[p] == idx[t, j]
    tiles = mi.reshape(-1, bm)
    for tile in tiles:  # one group per tile, padding only after it
        live = tile[tile >= 0]
        assert len(set(live)) <= 1 and np.all(tile[: live.size] >= 0)
    assert (mi >= 0).sum() == (idx >= 0).sum()


@needs_triton_interp
@pytest.mark.parametrize(
    "n,k,e,bm",
    [
        (1, 6, 256, 16),  # one decode token at V4-Flash's routing
        (37, 6, 256, 16),  # 222 picks: most experts one pick, some two
        (300, 2, 6, 64),  # few experts (not a power of two), groups over several tiles
        (5, 8, 8, 16),  # 40 picks over 8 experts: a power of two, so bin 8 is the next power's
    ],
)
def test_layout_kernel_equals_reference(n, k, e, bm):
    """The one-program layout (interpreted) against the jnp spec, every output exactly, on skewed random
    picks with ids outside [0, e) among them (dropped)."""
    rng = np.random.default_rng(n * e + bm)
    probs = rng.dirichlet(np.full(e, 0.3))
    idx = rng.choice(e, (n, k), p=probs).astype(np.int32)
    bad = rng.random((n, k)) < 0.05
    idx[bad] = rng.choice([-1, e, e + 5, -7], bad.sum())
    want = layout(jnp.asarray(idx), e, bm, "ref")
    got = layout(jnp.asarray(idx), e, bm, "interpret")
    for name, g, w in zip(want._fields, got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=name)


@needs_triton_interp
@pytest.mark.parametrize("n,launched", [(250, True), (300, False), (1100, False)])
def test_layout_past_max_picks_takes_the_reference(n, launched, monkeypatch):
    """Up to `MAX_PICKS` picks the kernel runs; past it (1,200 picks: within the program's CAPACITY; 4,400:
    past that too) the reference's layout, whatever impl asks for."""
    from djax.kernels import moe_layout_triton
    from djax.kernels.moe_layout_triton import CAPACITY, MAX_PICKS

    calls = []
    real = moe_layout_triton.launch_torch
    monkeypatch.setattr(moe_layout_triton, "launch_torch", lambda *a: calls.append(1) or real(*a))
    idx = jnp.asarray(np.random.default_rng(n).integers(0, 16, (n, 4)), jnp.int32)
    assert (idx.size <= MAX_PICKS) == launched and MAX_PICKS < 1200 < CAPACITY < 4400
    got = layout(idx, 16, 64, "interpret")
    want = layout(idx, 16, 64, "ref")
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    assert bool(calls) == launched


def _moe_inputs(rng, n, d, f, e, k, probs):
    idx = np.stack([rng.choice(e, k, replace=False, p=probs) for _ in range(n)]).astype(np.int32)
    w = rng.random((n, k)).astype(np.float32)
    w1, w3 = rng.standard_normal((2, e, f, d)).astype(np.float32) * 0.2
    w2 = rng.standard_normal((e, d, f)).astype(np.float32) * 0.2
    x = rng.standard_normal((n, d)).astype(np.float32)
    return [jnp.asarray(v) for v in (x, w, idx, w1, w2, w3)]


@needs_triton_interp
@pytest.mark.parametrize("limit,n", [(1.5, 37), (0.0, 37), (1.5, 1)])  # 1: a batch-1 decode step
def test_moe_experts_interpreted_matches_model(limit, n):
    rng = np.random.default_rng(4)
    e = 8
    probs = np.array([0.4, 0.3, 0.1, 0, 0.1, 0.1, 0, 0])  # uneven loads, three experts empty
    args = _moe_inputs(rng, n, 64, 32, e, 3, probs)  # 37 tokens: not a multiple of BLOCK_M
    cfg = GemmConfig(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=1)
    out = jax.jit(lambda *a: moe_experts(*a, limit, impl="interpret", cfg=cfg))(*args)
    assert_close(out, jax.jit(lambda *a: experts_dense(*a, limit))(*args), 1e-5)
    assert_close(out, jax.jit(lambda *a: experts_ragged(*a, limit))(*args), 1e-5)


def test_moe_experts_ref_drops_invalid_ids():
    rng = np.random.default_rng(5)
    x, w, idx, w1, w2, w3 = _moe_inputs(rng, 9, 32, 16, 4, 2, None)
    bad = idx.at[0, 1].set(-1).at[4, 0].set(4)
    ours = jax.jit(lambda *a: moe_experts(*a, 1.0))  # "auto": the reference on CPU
    dense = jax.jit(lambda *a: experts_dense(*a, 1.0))
    keep = w.at[0, 1].set(0).at[4, 0].set(0)
    assert_close(ours(x, w, bad, w1, w2, w3), dense(x, keep, jnp.clip(bad, 0, 3), w1, w2, w3), 1e-5)
    assert_close(ours(x, w, idx, w1, w2, w3), dense(x, w, idx, w1, w2, w3), 1e-5)


def _bad_grouped(case):
    """Operands of the bf16 grouped GEMMs with one wrong shape, the op to call, and the error it names."""
    z = lambda *s: jnp.ones(s, jnp.float32)  # noqa: E731
    i = lambda *s: jnp.zeros(s, jnp.int32)  # noqa: E731
    return {
        "b_width": (
            grouped_gemm,
            (z(32, 64), z(2, 16, 48), i(32)),
            "b has shape [2, 16, 48], expected [*, *, 64]",
        ),
        "m_indices": (
            grouped_gemm,
            (z(32, 64), z(2, 16, 64), i(16)),
            "m_indices has shape [16], expected [32]",
        ),
        "rows": (grouped_gemm, (z(9, 64), z(2, 16, 64), i(32), i(16)), "rows has shape [16], expected [32]"),
        "w3": (
            lambda a, w1, w3, m, impl: grouped_swiglu(a, w1, w3, m, 1.0, impl=impl),
            (z(32, 64), z(2, 16, 64), z(2, 8, 64), i(32)),
            "grouped_swiglu: w3 has shape [2, 8, 64], expected [2, 16, 64]",
        ),
        "masked_groups": (
            grouped_gemm_masked,
            (z(2, 16, 64), z(3, 16, 64), i(2)),
            "grouped_gemm_masked: b has shape [3, 16, 64], expected [2, *, 64]",
        ),
        "masked_m": (
            grouped_gemm_masked,
            (z(2, 16, 64), z(2, 16, 64), i(3)),
            "masked_m has shape [3], expected [2]",
        ),
    }[case]


@pytest.mark.parametrize("impl", ["ref", pytest.param("interpret", marks=needs_triton_interp)])
@pytest.mark.parametrize("case", ["b_width", "m_indices", "rows", "w3", "masked_groups", "masked_m"])
def test_grouped_ops_name_a_bad_argument(case, impl):
    """A wrong operand shape fails at the op's entry with a ValueError naming it, for every impl."""
    op, args, match = _bad_grouped(case)
    with pytest.raises(ValueError, match=re.escape(match)):
        op(*args, impl=impl)
