"""MoE routing permute/unpermute: reference against brute-force numpy, the C++ FFI path against the reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checks import assert_close

from djax.kernels.moe_routing import permute, routing, unpermute


def _inputs(rng, n=11, d=6, k=3, e=5):
    x = rng.standard_normal((n, d)).astype(np.float32)
    idx = np.stack([rng.permutation(e)[:k] for _ in range(n)]).astype(np.int32)
    idx[2, 1] = -1  # a dropped pick
    w = rng.random((n, k)).astype(np.float32)
    return x, idx, w, e


def test_routing_ref_matches_brute_force():
    x, idx, w, e = _inputs(np.random.default_rng(0))
    r = routing(jnp.asarray(idx), jnp.asarray(w), e)
    rows = sorted(
        ((idx[t, j], t, w[t, j]) for t in range(len(x)) for j in range(idx.shape[1]) if idx[t, j] >= 0),
        key=lambda row: (row[0], row[1]),
    )
    np.testing.assert_array_equal(np.asarray(r.token)[: len(rows)], [t for _, t, _ in rows])
    np.testing.assert_array_equal(np.asarray(r.token)[len(rows) :], -1)
    np.testing.assert_array_equal(np.asarray(r.weight)[: len(rows)], [wt for _, _, wt in rows])
    np.testing.assert_array_equal(r.sizes, np.bincount(idx[idx >= 0], minlength=e))
    xs = np.asarray(permute(jnp.asarray(x), r, impl="ref"))
    np.testing.assert_array_equal(xs[: len(rows)], x[[t for _, t, _ in rows]])
    np.testing.assert_array_equal(xs[len(rows) :], 0)


def test_unpermute_ref_matches_brute_force():
    x, idx, w, e = _inputs(np.random.default_rng(1))
    r = routing(jnp.asarray(idx), jnp.asarray(w), e)
    ys = np.random.default_rng(2).standard_normal((idx.size, x.shape[1])).astype(np.float32)
    ref = np.zeros(x.shape)
    for i, (t, wt) in enumerate(zip(np.asarray(r.token), np.asarray(r.weight))):
        if t >= 0:
            ref[t] += wt * ys[i]
    assert_close(unpermute(jnp.asarray(ys), r, len(x), impl="ref"), ref, 1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_ffi_matches_ref(dtype):
    x, idx, w, e = _inputs(np.random.default_rng(3), n=33, d=16, k=4, e=9)
    xj = jnp.asarray(x, dtype)
    r = routing(jnp.asarray(idx), jnp.asarray(w), e)
    xs_ffi = jax.jit(lambda a, rr: permute(a, rr, impl="ffi"))(xj, r)
    np.testing.assert_array_equal(xs_ffi, permute(xj, r, impl="ref"))
    ys = jnp.asarray(np.random.default_rng(4).standard_normal(xs_ffi.shape), dtype)
    out = jax.jit(lambda a, rr: unpermute(a, rr, len(x), impl="ffi"))(ys, r)
    assert out.dtype == dtype
    assert_close(out, unpermute(ys, r, len(x), impl="ref"), 1e-6 if dtype == jnp.float32 else 1e-2)


def test_roundtrip_is_weighted_sum():
    x, idx, w, e = _inputs(np.random.default_rng(5))
    r = routing(jnp.asarray(idx), jnp.asarray(w), e)
    back = unpermute(permute(jnp.asarray(x), r), r, len(x))
    assert_close(back, x * np.where(idx >= 0, w, 0).sum(1, keepdims=True), 1e-6)
