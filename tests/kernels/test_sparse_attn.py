"""Sparse decode attention: the jnp reference against brute-force numpy, the model's own _attend, and Triton."""

import jax.numpy as jnp
import numpy as np
import pytest
from checks import assert_close, needs_triton_interp

from djax.kernels.sparse_attn import sparse_decode
from djax.kernels.sparse_attn_ref import sparse_decode_ref


def _inputs(rng, b, h, k, w, c, t, dtype=np.float32):
    q = rng.standard_normal((b, h, k)).astype(dtype)
    win = rng.standard_normal((b, w, k)).astype(dtype)
    valid = rng.random((b, w)) < 0.7
    pool = rng.standard_normal((b, c, k)).astype(dtype)
    topk = rng.integers(-1, c, (b, t)).astype(np.int32)  # about 1/(c+1) of picks invalid
    topk[:, 0] = -1
    valid[-1] = False
    topk[-1] = -1  # the last row has nothing to attend
    sinks = rng.standard_normal(h).astype(np.float32)
    return q, win, valid, pool, topk, sinks


def _brute(q, win, valid, pool, topk, sinks, scale):
    b, h, k = q.shape
    out = np.zeros((b, h, k))
    for i in range(b):
        keys = [win[i, j] for j in range(win.shape[1]) if valid[i, j]]
        keys += [pool[i, j] for j in topk[i] if 0 <= j < pool.shape[1]]
        keys = np.array(keys, np.float64).reshape(-1, k)
        for hh in range(h):
            logits = keys @ q[i, hh].astype(np.float64) * scale
            mx = max(logits.max(initial=-np.inf), sinks[hh])
            p = np.exp(logits - mx)
            out[i, hh] = p @ keys / (p.sum() + np.exp(sinks[hh] - mx))
    return out


@pytest.mark.parametrize("b,h,k,w,c,t", [(3, 4, 16, 13, 40, 21), (2, 8, 32, 128, 7, 9), (4, 2, 8, 1, 3, 1)])
def test_ref_matches_brute_force(b, h, k, w, c, t):
    rng = np.random.default_rng(b * 100 + w)
    args = _inputs(rng, b, h, k, w, c, t)
    out = sparse_decode_ref(*map(jnp.asarray, args), scale=k**-0.5)
    ref = _brute(*args, scale=k**-0.5)
    assert_close(out, ref, 1e-5)
    assert np.all(np.asarray(out)[-1] == 0)  # nothing to attend: all mass on the sink


def test_ref_bf16_close_to_f32():
    rng = np.random.default_rng(7)
    args = _inputs(rng, 2, 8, 64, 16, 50, 24)
    a16 = [
        jnp.asarray(x, jnp.bfloat16) if x.dtype == np.float32 and x.ndim == 3 else jnp.asarray(x)
        for x in args
    ]
    out = sparse_decode_ref(*a16, scale=0.125)
    ref = _brute(
        *[np.asarray(x.astype(jnp.float32)) if x.dtype == jnp.bfloat16 else np.asarray(x) for x in a16],
        scale=0.125,
    )
    assert out.dtype == jnp.bfloat16
    assert_close(out, ref, 1e-2)


def test_ref_matches_model_attend():
    """The kernel spec is the model's decode attention: masked logits, softmax with the sink, K = V."""
    from djax.models.deepseek_v4 import _softmax_with_sink

    rng = np.random.default_rng(3)
    q, win, valid, pool, topk, sinks = map(jnp.asarray, _inputs(rng, 3, 4, 16, 10, 30, 12))
    ok = topk >= 0
    keys = jnp.concatenate([win, jnp.take_along_axis(pool, jnp.maximum(topk, 0)[..., None], axis=1)], axis=1)
    mask = jnp.concatenate([valid, ok], axis=1)
    logits = jnp.einsum("bhk,bsk->bhs", q, keys, precision="highest")[:, :, None] * 0.25  # [b, h, 1, s]
    probs = _softmax_with_sink(jnp.where(mask[:, None, None], logits, -jnp.inf), sinks)
    model = jnp.einsum("bhts,bsk->bhk", probs, keys, precision="highest")
    assert_close(sparse_decode_ref(q, win, valid, pool, topk, sinks, 0.25), model, 1e-6)


@needs_triton_interp
@pytest.mark.parametrize(
    "b,h,k,w,c,t,bh,bs,ns",
    [(3, 32, 32, 13, 40, 21, 16, 16, 1), (2, 16, 64, 20, 9, 5, 16, 8, 1), (3, 16, 32, 13, 40, 21, 16, 8, 3)],
)
def test_triton_interpreted_matches_ref(b, h, k, w, c, t, bh, bs, ns):
    import torch

    from djax.kernels.sparse_attn_triton import launch_torch

    rng = np.random.default_rng(b + w)
    args = _inputs(rng, b, h, k, w, c, t)
    out = launch_torch(*map(torch.from_numpy, args), scale=k**-0.5, block_h=bh, block_s=bs, nsplit=ns)
    ref = sparse_decode_ref(*map(jnp.asarray, args), scale=k**-0.5)
    assert_close(out.numpy(), ref, 1e-5)
    assert np.all(out.numpy()[-1] == 0)


def test_ref_ignores_nan_in_masked_slots():
    """The spec: NaN in ring slots marked not valid, and in the pool row that invalid picks stand in for (row 0),
    changes nothing, as the kernels' zero-filled loads."""
    q, win, valid, pool, picks, sinks = _inputs(np.random.default_rng(6), 3, 16, 32, 13, 40, 21)
    picks = np.where(picks == 0, 1, picks)  # no valid pick of row 0: it is the invalid picks' stand-in here
    assert not valid.all() and (picks < 0).any()
    q, win, valid, pool, topk, sinks = map(jnp.asarray, (q, win, valid, pool, picks, sinks))
    poisoned_win = jnp.where(valid[..., None], win, jnp.nan)
    poisoned_pool = pool.at[:, 0].set(jnp.nan)
    out = sparse_decode_ref(q, poisoned_win, valid, poisoned_pool, topk, sinks, 32**-0.5)
    clean = sparse_decode_ref(q, jnp.where(valid[..., None], win, 0), valid, pool, topk, sinks, 32**-0.5)
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_array_equal(np.asarray(out), np.asarray(clean))


@needs_triton_interp
def test_triton_interpreted_ignores_nan_in_masked_ring_slots():
    """A ring slot marked not valid may hold anything (a stale cache row): NaN there never reaches P @ K."""
    import torch

    from djax.kernels.sparse_attn_triton import launch_torch

    q, win, valid, pool, topk, sinks = _inputs(np.random.default_rng(5), 3, 16, 32, 13, 40, 21)
    poisoned = np.where(valid[..., None], win, np.nan).astype(win.dtype)
    args = (q, poisoned, valid, pool, topk, sinks)
    out = launch_torch(*map(torch.from_numpy, args), scale=32**-0.5, block_h=16, block_s=8, nsplit=1)
    clean = np.where(valid[..., None], win, 0).astype(win.dtype)
    ref = sparse_decode_ref(*map(jnp.asarray, (q, clean, valid, pool, topk, sinks)), scale=32**-0.5)
    assert not valid.all() and np.isfinite(out.numpy()).all()
    assert_close(out.numpy(), ref, 1e-5)


def test_public_op_auto_is_ref_on_cpu():
    rng = np.random.default_rng(11)
    args = list(map(jnp.asarray, _inputs(rng, 2, 4, 16, 5, 6, 3)))
    np.testing.assert_array_equal(sparse_decode(*args, scale=0.3), sparse_decode_ref(*args, scale=0.3))
    with pytest.raises(ValueError):
        sparse_decode(*args, scale=0.3, impl="cuda-magic")
    with pytest.raises(ValueError, match="merge_splits"):  # the Triton kernel has no in-kernel merge
        sparse_decode(*args, scale=0.3, impl="triton", nsplit=2, merge_splits=True)
    with pytest.raises(ValueError, match="merge_splits must be"):
        sparse_decode(*args, scale=0.3, impl="tilelang", nsplit=2, merge_splits="smem")
    with pytest.raises(ValueError, match="tma_q is a TileLang option"):
        sparse_decode(*args, scale=0.3, impl="triton", tma_q=True)
    with pytest.raises(ValueError, match="tma_q must be a bool"):
        sparse_decode(*args, scale=0.3, impl="tilelang", tma_q=1)
    with pytest.raises(ValueError, match="dim_pair is a TileLang option"):
        sparse_decode(*args, scale=0.3, impl="triton", dim_pair=True)
    with pytest.raises(ValueError, match="dim_pair must be a bool"):
        sparse_decode(*args, scale=0.3, impl="tilelang", dim_pair="yes")
    with pytest.raises(ValueError, match="p_in_exchange is a TileLang option"):
        sparse_decode(*args, scale=0.3, impl="triton", p_in_exchange=True)
    with pytest.raises(ValueError, match="p_in_exchange must be a bool"):
        sparse_decode(*args, scale=0.3, impl="tilelang", dim_pair=True, p_in_exchange=1)


def test_auto_on_cuda_hands_the_default_tiling_to_tilelang(monkeypatch):
    """No GPU needed: where the TileLang kernel applies, "auto" passes `default_tiling`'s own Tiling (every
    field, the pair's options among them) to the TileLang launcher, and nothing where it does not (32 heads)."""
    pytest.importorskip("tilelang")
    from djax.kernels import sparse_attn, sparse_attn_tilelang

    monkeypatch.setattr(sparse_attn, "on_cuda", lambda: True)
    monkeypatch.setattr(sparse_attn, "has_tilelang", lambda: True)
    used = []
    monkeypatch.setattr(sparse_attn_tilelang, "sparse_decode_tilelang", lambda *a: used.append(a[-1]) or "tl")
    rng = np.random.default_rng(12)

    def bf16_inputs(h):  # q and keys bf16 (what "auto" hands to the kernels), the sinks f32
        q, win, valid, pool, topk, sinks = _inputs(rng, 64, h, 512, 128, 300, 64)
        keys = [jnp.asarray(x, jnp.bfloat16) for x in (q, win)] + [jnp.asarray(valid)]
        return *keys, jnp.asarray(pool, jnp.bfloat16), jnp.asarray(topk), jnp.asarray(sinks)

    assert sparse_decode(*bf16_inputs(64), scale=0.3) == "tl"
    assert used == [sparse_attn_tilelang.default_tiling(64, 64, 512, 128, 64)] and used[0].p_in_exchange
    # 32 heads: not TileLang's; `resolve` takes it on (Triton on a GPU, here the reference)
    assert sparse_decode(*bf16_inputs(32), scale=0.3).shape == (64, 32, 512) and len(used) == 1


@pytest.mark.parametrize(
    "b, heads, splits",
    [
        (1, 16, 20),
        (2, 16, 20),
        (4, 16, 10),
        (8, 16, 7),
        (16, 16, 4),
        (31, 16, 2),
        (32, 64, 4),
        (64, 64, 2),
        (128, 64, 1),
    ],
)
def test_triton_tiling_spreads_the_rows_with_whole_key_blocks(b, heads, splits):
    """The default tiling at 64 heads: 16 heads a program below 32 rows (splits up to about two programs per
    SM), all 64 from 32 rows (up to about one); the kernel's split length (`constexprs`) then leaves no split
    empty."""
    from djax.kernels.sparse_attn import triton_tiling
    from djax.kernels.sparse_attn_triton import constexprs

    w, t = 128, 512
    kw = triton_tiling(b, 64, w, t)
    assert (kw["block_h"], kw["nsplit"]) == (heads, splits)
    assert (kw["block_s"], kw["num_warps"], kw["num_stages"]) == ((64, 8, 2) if heads == 64 else (32, 4, 2))
    cx = constexprs(64, 512, w, 2048, t, 0.1, kw["block_h"], kw["block_s"], kw["nsplit"])
    if splits > 1:
        assert cx["SPLIT_LEN"] % kw["block_s"] == 0 and (splits - 1) * cx["SPLIT_LEN"] < w + t
        assert splits * cx["SPLIT_LEN"] >= w + t


def test_triton_tiling_takes_heads_in_sixteens():
    """Heads that are no multiple of 64 keep 16 a program at any batch; no multiple of 16 is refused, as is a
    head block the kernel cannot compile."""
    from djax.kernels.sparse_attn import triton_tiling
    from djax.kernels.sparse_attn_triton import constexprs

    assert (
        triton_tiling(128, 48, 128, 512)["block_h"] == 16
        and triton_tiling(128, 128, 128, 512)["block_h"] == 64
    )
    for h in (8, 24):
        with pytest.raises(ValueError, match=f"multiples of 16, got {h}"):
            triton_tiling(4, h, 128, 512)
    for bh, bs in ((8, 32), (24, 32), (16, 24)):
        with pytest.raises(ValueError, match="must be a power of two"):
            constexprs(48, 64, 8, 16, 4, 0.1, bh, bs)


def test_triton_defaults_fill_only_what_is_not_given(monkeypatch):
    """impl="triton" with no tiling argument hands `_triton` `triton_tiling`'s for the shape; with some given,
    the others are `FIXED_ARGS` (what every call took before), not the shape's."""
    from djax.kernels import sparse_attn

    seen = []
    monkeypatch.setattr(sparse_attn, "_triton", lambda *a, **kw: seen.append(kw) or "triton")
    rng = np.random.default_rng(13)
    args = list(map(jnp.asarray, _inputs(rng, 2, 64, 16, 128, 40, 512)))
    assert sparse_decode(*args, scale=0.3, impl="triton") == "triton"
    assert seen[-1] == sparse_attn.triton_tiling(2, 64, 128, 512) and seen[-1]["nsplit"] == 20
    sparse_decode(*args, scale=0.3, impl="triton", block_h=16, nsplit=3)
    assert seen[-1] == {**sparse_attn.FIXED_ARGS, "block_h": 16, "nsplit": 3}


def test_tilelang_without_arguments_takes_the_fixed_tiling(monkeypatch):
    """impl="tilelang" given no tiling argument builds the Tiling it always did (64-key steps, 2 stages, 8 warps,
    one split); the ones given replace those alone."""
    pytest.importorskip("tilelang")
    from djax.kernels import sparse_attn, sparse_attn_tilelang

    used = []
    monkeypatch.setattr(sparse_attn_tilelang, "sparse_decode_tilelang", lambda *a: used.append(a[-1]) or "tl")
    rng = np.random.default_rng(14)
    args = list(map(jnp.asarray, _inputs(rng, 2, 64, 16, 128, 40, 512)))
    assert sparse_decode(*args, scale=0.3, impl="tilelang") == "tl"
    assert used[-1] == sparse_attn.tilelang_tiling(64, 2, 8, 1)
    sparse_decode(*args, scale=0.3, impl="tilelang", num_warps=12, nsplit=2)
    assert used[-1] == sparse_attn.tilelang_tiling(64, 2, 12, 2)


def test_kernel_operands_cast_and_reject_inconsistent_shapes():
    from djax.kernels.sparse_attn import kernel_operands

    b, h, k, w, c, t = 2, 4, 8, 3, 5, 6
    q = jnp.ones((b, h, k), jnp.bfloat16)
    win, pool = jnp.ones((b, w, k), jnp.float32), jnp.ones((b, c, k), jnp.float32)
    valid, top, sinks = jnp.ones((b, w), bool), jnp.zeros((b, t), jnp.int16), jnp.zeros((h,), jnp.bfloat16)
    ops = kernel_operands(q, win, valid, pool, top, sinks)
    assert [o.dtype for o in ops] == [
        jnp.bfloat16,
        jnp.bfloat16,
        jnp.int32,
        jnp.bfloat16,
        jnp.int32,
        jnp.float32,
    ]
    # the TileLang programs read the caller's bool validity directly (one byte): no conversion kernel
    valid_in = jnp.asarray([[1, 0, 3], [0, 0, 2]], jnp.int32)
    np.testing.assert_array_equal(
        kernel_operands(q, win, valid_in, pool, top, sinks, valid_dtype=jnp.bool_)[2], valid_in != 0
    )
    with pytest.raises(ValueError, match="window"):
        kernel_operands(q, win[:, :, :4], valid, pool, top, sinks)
    with pytest.raises(ValueError, match="pool"):
        kernel_operands(q, win, valid, pool[:1], top, sinks)
    with pytest.raises(ValueError, match="topk"):
        kernel_operands(q, win, valid, pool, top[:1], sinks)
    with pytest.raises(ValueError, match="sinks"):
        kernel_operands(q, win, valid, pool, top, sinks[:2])


@pytest.mark.parametrize("n", [1, 2, 5])
def test_combine_splits_matches_softmax_weighting(n):
    """The split merge against numpy: each split's output weighted by its share of the total mass
    2^lse_i / sum_j 2^lse_j; a split with no mass (lse -inf) contributes nothing; jnp and torch agree."""
    import torch

    from djax.kernels.sparse_attn_ref import combine_splits

    rng = np.random.default_rng(n)
    part = rng.standard_normal((3, n, 4, 16)).astype(np.float32)
    lse = (rng.standard_normal((3, n, 4)) * 4).astype(np.float32)
    if n > 1:
        lse[1, 1:, 2] = -np.inf  # row 1, head 2: only split 0 (the sink's) has mass
    mass = np.exp2(lse.astype(np.float64))
    want = (mass[..., None] * part).sum(1) / mass.sum(1)[..., None]
    got = combine_splits(jnp.asarray(part), jnp.asarray(lse))
    assert_close(np.asarray(got), want, 1e-6)
    via_torch = combine_splits(torch.from_numpy(part), torch.from_numpy(lse), torch)
    assert_close(via_torch.numpy(), want, 1e-6)
    if n > 1:
        np.testing.assert_allclose(np.asarray(got)[1, 2], part[1, 0, 2], rtol=1e-6)


@pytest.mark.parametrize(
    "bad, match",
    [
        ("window", "window has shape \\[2, 8, 32\\], expected \\[2, \\*, 64\\]"),
        ("window_valid", "window_valid has shape \\[2, 7\\], expected \\[2, 8\\]"),
        ("pool", "pool has shape \\[3, 16, 64\\], expected \\[2, \\*, 64\\]"),
        ("topk", "topk has shape \\[2\\], expected \\[2, \\*\\]"),
        ("sinks", "sinks has shape \\[4\\], expected \\[16\\]"),
    ],
)
@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_sparse_decode_names_a_bad_argument(bad, match, impl):
    """An operand of the wrong shape fails before any kernel runs, with its name, for every impl."""
    good = dict(
        q=((2, 16, 64), jnp.bfloat16),
        window=((2, 8, 64), jnp.bfloat16),
        window_valid=((2, 8), jnp.bool_),
        pool=((2, 16, 64), jnp.bfloat16),
        topk=((2, 4), jnp.int32),
        sinks=((16,), jnp.float32),
    )
    wrong = dict(window=(2, 8, 32), window_valid=(2, 7), pool=(3, 16, 64), topk=(2,), sinks=(4,))
    args = {
        name: jnp.ones(wrong[name] if name == bad else shape, dtype) for name, (shape, dtype) in good.items()
    }
    with pytest.raises(ValueError, match=match):
        sparse_decode(**args, scale=0.1, impl=impl)
