"""Indexer scoring and top-k: references against brute-force numpy; Triton kernels (interpreted) against them."""

import jax.numpy as jnp
import numpy as np
import pytest
from checks import assert_close, needs_triton_interp

from djax.kernels.indexer import indexer_topk
from djax.kernels.indexer_ref import index_scores_ref
from djax.kernels.topk import topk
from djax.kernels.topk_ref import topk_ref


def _brute_scores(q, keys, w, lengths):
    b, s = keys.shape[:2]
    out = np.full((b, s), -np.inf)
    for i in range(b):
        for j in range(min(lengths[i], s)):
            dots = q[i].astype(np.float64) @ keys[i, j].astype(np.float64)
            out[i, j] = np.sum(w[i] * np.maximum(dots, 0))
    return out


def _brute_topk(x, k, lengths):
    b, s = x.shape
    vals = np.full((b, k), -np.inf, np.float32)
    idx = np.full((b, k), -1, np.int32)
    for i in range(b):
        n = s if lengths is None else min(lengths[i], s)
        order = sorted(range(n), key=lambda j: (-x[i, j], j))[:k]  # ties: lower index first
        for r, j in enumerate(order):
            if x[i, j] != -np.inf:
                vals[i, r], idx[i, r] = x[i, j], j
    return vals, idx


def _scores_inputs(rng, b, h, c, s):
    q = rng.standard_normal((b, h, c)).astype(np.float32)
    keys = rng.standard_normal((b, s, c)).astype(np.float32)
    w = rng.standard_normal((b, h)).astype(np.float32)
    lengths = rng.integers(0, s + 1, b).astype(np.int32)
    lengths[0], lengths[-1] = s, 0  # one full row, one with nothing valid
    return q, keys, w, lengths


def _topk_inputs(rng, b, s):
    x = rng.standard_normal((b, s)).astype(np.float32)
    x[0, 3] = -np.inf
    x[-1, : s // 3] = x[-1, s // 2]  # a run of ties
    lengths = rng.integers(0, s + 1, b).astype(np.int32)
    lengths[0], lengths[1] = s, 0
    return x, lengths


@pytest.mark.parametrize("b,h,c,s", [(3, 4, 8, 37), (2, 16, 32, 130)])
def test_scores_ref_matches_brute_force(b, h, c, s):
    args = _scores_inputs(np.random.default_rng(s), b, h, c, s)
    assert_close(index_scores_ref(*map(jnp.asarray, args)), _brute_scores(*args), 1e-6)


@pytest.mark.parametrize("b,s,k", [(4, 50, 7), (3, 300, 64), (3, 20, 32)])  # k > s in the last
def test_topk_ref_matches_brute_force(b, s, k):
    x, lengths = _topk_inputs(np.random.default_rng(s + k), b, s)
    for lens in (lengths, None):
        vals, idx = topk_ref(jnp.asarray(x), k, None if lens is None else jnp.asarray(lens))
        bv, bi = _brute_topk(x, k, lens)
        np.testing.assert_array_equal(np.asarray(vals), bv)
        np.testing.assert_array_equal(np.asarray(idx), bi)


def test_indexer_topk_auto_is_ref_on_cpu():
    q, keys, w, lengths = map(jnp.asarray, _scores_inputs(np.random.default_rng(5), 3, 4, 8, 40))
    vals, idx = indexer_topk(q, keys, w, lengths, 16)
    rv, ri = topk_ref(index_scores_ref(q, keys, w, lengths), 16)
    np.testing.assert_array_equal(idx, ri)
    np.testing.assert_array_equal(vals, rv)
    assert np.all(np.asarray(idx)[-1] == -1)


@needs_triton_interp
@pytest.mark.parametrize("b,h,c,s,bs", [(3, 16, 32, 200, 64), (2, 32, 16, 50, 16)])
def test_scores_triton_interpreted(b, h, c, s, bs):
    import torch

    from djax.kernels.indexer_triton import launch_torch

    args = _scores_inputs(np.random.default_rng(b * s), b, h, c, s)
    out = launch_torch(*map(torch.from_numpy, args), block_s=bs)
    assert_close(out.numpy(), index_scores_ref(*map(jnp.asarray, args)), 1e-5)


@needs_triton_interp
@pytest.mark.parametrize("b,s,k,block", [(3, 1000, 100, 256), (3, 40, 64, 32), (2, 515, 512, 128)])
def test_topk_triton_interpreted(b, s, k, block):
    import torch

    from djax.kernels.topk_triton import launch_torch

    x, lengths = _topk_inputs(np.random.default_rng(s), b, s)
    for lens in (lengths, None):
        vals, idx = launch_torch(
            torch.from_numpy(x), k, None if lens is None else torch.from_numpy(lens), block
        )
        rv, ri = topk_ref(jnp.asarray(x), k, None if lens is None else jnp.asarray(lens))
        np.testing.assert_array_equal(vals.numpy(), np.asarray(rv))
        np.testing.assert_array_equal(idx.numpy(), np.asarray(ri))


def test_topk_public_op_rejects_unknown_impl():
    with pytest.raises(ValueError):
        topk(jnp.zeros((1, 4)), 2, impl="radix")
