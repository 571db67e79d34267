"""On a CUDA GPU: each Triton kernel, compiled ahead and launched through the FFI handler, against its reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checks import assert_close, sparse_decode_inputs

from djax.kernels.indexer import index_scores, indexer_topk
from djax.kernels.indexer_ref import index_scores_ref
from djax.kernels.sparse_attn import sparse_decode
from djax.kernels.sparse_attn_ref import sparse_decode_ref
from djax.kernels.topk import topk
from djax.kernels.topk_ref import topk_ref
from djax.sampling import filter_logits

pytestmark = pytest.mark.gpu
BF16 = jnp.bfloat16


def test_sm_count_is_the_devices_own():
    """The default grids are sized from the GPU's own SM count: JAX's CUDA device reports it (were it not to,
    every grid would silently take the 132 of the GPUs the tilings were measured on)."""
    from djax.kernels import dispatch

    sms = getattr(jax.devices()[0], "core_count", None)
    assert isinstance(sms, int) and sms > 0
    assert dispatch.on_cuda() and dispatch.sm_count() == sms


@pytest.mark.parametrize(
    "block_h,block_s,warps,nsplit", [(16, 32, 4, 1), (32, 64, 8, 1), (64, 16, 8, 1), (32, 64, 8, 4)]
)
def test_sparse_decode_triton_matches_ref(block_h, block_s, warps, nsplit):
    args = sparse_decode_inputs(block_h, 5, 64, 512, 128, 1000, 512)
    scale = 512**-0.5
    fast = jax.jit(
        lambda *a: sparse_decode(
            *a, scale=scale, impl="triton", block_h=block_h, block_s=block_s, num_warps=warps, nsplit=nsplit
        )
    )(*args)
    ref = sparse_decode_ref(*[a.astype(jnp.float32) if a.dtype == BF16 else a for a in args], scale)
    assert fast.dtype == BF16
    assert_close(fast.astype(jnp.float32), ref, 1e-2)
    assert np.all(np.asarray(fast[-1], np.float32) == 0)


@pytest.mark.parametrize("b, heads, splits", [(2, 16, 20), (9, 16, 7), (40, 64, 3), (140, 64, 1)])
def test_sparse_decode_triton_default_tiling_matches_ref(b, heads, splits):
    """No tiling arguments: `triton_tiling`'s for the shape (16 heads a program with 20 splits of one 32-key
    block, or 7 whose last has two blocks; 64 heads with 3 splits of 4, 4 and 2 64-key blocks, or none), the
    last row with nothing to attend."""
    from djax.kernels import dispatch
    from djax.kernels.sparse_attn import triton_tiling

    kw = triton_tiling(b, 64, 128, 512)
    if dispatch.sm_count() == 132:  # the counts are the rule's on 132 SMs; other GPUs get their own
        assert (kw["block_h"], kw["nsplit"]) == (heads, splits)
    args = sparse_decode_inputs(b, b, 64, 512, 128, 1000, 512)
    scale = 512**-0.5
    fast = jax.jit(lambda *a: sparse_decode(*a, scale=scale, impl="triton"))(*args)
    ref = sparse_decode_ref(*[a.astype(jnp.float32) if a.dtype == BF16 else a for a in args], scale)
    assert fast.dtype == BF16
    assert_close(fast.astype(jnp.float32), ref, 1e-2)
    assert np.all(np.asarray(fast[-1], np.float32) == 0)


def test_index_scores_triton_matches_ref():
    rng = np.random.default_rng(1)
    b, h, c, s = 4, 64, 128, 3001
    q = jnp.asarray(rng.standard_normal((b, h, c)), BF16)
    keys = jnp.asarray(rng.standard_normal((b, s, c)), BF16)
    w = jnp.asarray(rng.standard_normal((b, h)), jnp.float32)
    lengths = jnp.asarray([s, 0, 17, 2048], jnp.int32)
    assert_close(
        jax.jit(lambda *a: index_scores(*a, impl="triton"))(q, keys, w, lengths),
        index_scores_ref(q, keys, w, lengths),
        1e-5,
    )


@pytest.mark.parametrize(
    "b,s,k,method",
    [
        (3, 70000, 512, "chunked"),
        (5, 1000, 512, "chunked"),
        (4, 129280, 50, "chunked"),
        (1, 262144, 512, "grid"),
        (2, 129280, 2048, "grid"),
        (3, 5000, 64, "grid"),
        (2, 600, 700, "grid"),  # k > s
    ],
)
def test_topk_triton_matches_ref_exactly(b, s, k, method):
    rng = np.random.default_rng(s)
    x = rng.standard_normal((b, s)).astype(np.float32)
    x[0, : s // 4] = x[0, 7]  # ties
    lengths = jnp.asarray(rng.integers(0, s + 1, b), jnp.int32)
    for lens in (lengths, None):
        vals, idx = jax.jit(lambda a, ln: topk(a, k, ln, impl="triton", method=method))(jnp.asarray(x), lens)
        rv, ri = topk_ref(jnp.asarray(x), k, lens)
        np.testing.assert_array_equal(np.asarray(vals), np.asarray(rv))
        np.testing.assert_array_equal(np.asarray(idx), np.asarray(ri))


def test_indexer_topk_auto_uses_fast_path_and_agrees():
    rng = np.random.default_rng(2)
    b, h, c, s = 2, 64, 128, 5000
    q = jnp.asarray(rng.standard_normal((b, h, c)), BF16)
    keys = jnp.asarray(rng.standard_normal((b, s, c)), BF16)
    w = jnp.asarray(rng.random((b, h)), jnp.float32)
    lengths = jnp.asarray([s, 300], jnp.int32)
    _, idx = jax.jit(lambda *a: indexer_topk(*a, 512))(q, keys, w, lengths)
    _, ri = jax.jit(lambda *a: indexer_topk(*a, 512, impl="ref"))(q, keys, w, lengths)
    idx, ri = np.asarray(idx), np.asarray(ri)
    # Row 1 has only 300 valid entries: both pad with -1 in the same places.
    np.testing.assert_array_equal(idx < 0, ri < 0)
    assert (ri[1] >= 0).sum() == 300
    # Scores agree to float32 rounding, so the picked sets may differ only at near-ties.
    for i in range(b):
        want = set(ri[i][ri[i] >= 0])
        assert len(set(idx[i][idx[i] >= 0]) & want) / len(want) > 0.99


def test_topk_grid_twice_in_one_jit_and_in_a_loop():
    """The grid form updates a zeroed work buffer in place (an aliased FFI result): two calls in one jit and
    one per iteration of a loop must each start from zeros."""
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((2, 70000)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((2, 70000)), jnp.float32)

    def two(a, c):
        return topk(a, 512, impl="triton", method="grid"), topk(c, 512, impl="triton", method="grid")

    for (vals, idx), src in zip(jax.jit(two)(x, y), (x, y), strict=True):
        rv, ri = topk_ref(src, 512)
        np.testing.assert_array_equal(np.asarray(vals), np.asarray(rv))
        np.testing.assert_array_equal(np.asarray(idx), np.asarray(ri))

    def loop(a):
        def body(i, acc):
            return acc + topk(jnp.roll(a, i, axis=1), 64, impl="triton", method="grid")[0]

        return jax.lax.fori_loop(0, 3, body, jnp.zeros((2, 64), jnp.float32))

    want = sum(topk_ref(jnp.roll(x, i, axis=1), 64)[0] for i in range(3))
    np.testing.assert_array_equal(np.asarray(jax.jit(loop)(x)), np.asarray(want))


@pytest.mark.parametrize("b,top_k", [(64, 50), (1, 50), (4, 400)])
def test_sampling_top_k_through_the_kernels_matches_lax_top_k(b, top_k):
    """The sampler's top-k filter on vocabulary-sized rows (129,280) takes the radix-select kernels under
    "auto"; it must keep exactly the logits lax.top_k keeps."""
    from djax.config import SamplingParams

    x = jnp.asarray(np.random.default_rng(b).standard_normal((b, 129280)), jnp.float32)
    sp = SamplingParams(temperature=0.7, top_k=top_k)
    fast = jax.jit(lambda a: filter_logits(a, sp))(x)
    ref = jax.jit(lambda a: filter_logits(a, sp, impl="ref"))(x)
    np.testing.assert_array_equal(np.asarray(fast), np.asarray(ref))
    assert np.all(np.isfinite(np.asarray(fast)).sum(-1) == top_k)
