"""FP8 block-scaled GEMM references against a brute-force numpy sum over scaled 128-wide blocks; the Triton
kernels (interpreted, float32 stand-ins for fp8) against the references."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from checks import assert_close, needs_triton_interp

from djax.kernels.fp8_gemm import fp8_gemm, grouped_contiguous, grouped_masked
from djax.kernels.fp8_gemm_ref import quantize_act, quantize_weight
from djax.kernels.fp8_gemm_triton import DEFAULT_CFG, Fp8Config, dense_config
from djax.kernels.grouped_gemm_triton import GemmConfig

B = 128


def _brute_block_gemm(a, a_s, b, b_s):
    """sum over k blocks of (a_blk @ b_blk^T) * a_scale[m, kb] * b_scale[nb, kb], in float64."""
    m, k = a.shape
    n = b.shape[0]
    af, bf = a.astype(np.float64), b.astype(np.float64)
    out = np.zeros((m, n))
    for kb in range(-(-k // B)):
        ks = slice(kb * B, (kb + 1) * B)
        part = af[:, ks] @ bf[:, ks].T
        for nb in range(-(-n // B)):
            ns = slice(nb * B, (nb + 1) * B)
            out[:, ns] += part[:, ns] * a_s[:, kb, None] * b_s[nb, kb]
    return out


def _fp8(rng, shape):
    return (rng.standard_normal(shape) * 3).astype(ml_dtypes.float8_e4m3fn)


def _scales(rng, shape):
    return rng.uniform(0.01, 2.0, shape).astype(np.float32)


@pytest.mark.parametrize("m,n,k", [(5, 130, 300), (64, 256, 256), (1, 7, 129)])
def test_dense_matches_brute_force(m, n, k):
    rng = np.random.default_rng(m + n + k)
    a, b = _fp8(rng, (m, k)), _fp8(rng, (n, k))
    a_s, b_s = _scales(rng, (m, -(-k // B))), _scales(rng, (-(-n // B), -(-k // B)))
    out = fp8_gemm(*map(jnp.asarray, (a, a_s, b, b_s)), out_dtype=jnp.float32)
    assert_close(out, _brute_block_gemm(a, a_s, b, b_s), 1e-6)


def test_grouped_contiguous_matches_brute_force():
    rng = np.random.default_rng(1)
    g, n, k, m = 3, 136, 200, 40
    a, b = _fp8(rng, (m, k)), _fp8(rng, (g, n, k))
    a_s, b_s = _scales(rng, (m, 2)), _scales(rng, (g, 2, 2))
    m_idx = np.sort(rng.integers(0, g, m)).astype(np.int32)
    m_idx[[5, 17, 39]] = -1  # padding rows
    out = np.asarray(grouped_contiguous(*map(jnp.asarray, (a, a_s, b, b_s, m_idx)), out_dtype=jnp.float32))
    ref = np.zeros((m, n))
    for i in range(m):
        if m_idx[i] >= 0:
            ref[i] = _brute_block_gemm(a[i : i + 1], a_s[i : i + 1], b[m_idx[i]], b_s[m_idx[i]])[0]
    assert_close(out, ref, 1e-6)
    assert np.all(out[m_idx < 0] == 0)


def test_grouped_masked_matches_brute_force():
    rng = np.random.default_rng(2)
    g, mm, n, k = 4, 9, 128, 384
    a, b = _fp8(rng, (g, mm, k)), _fp8(rng, (g, n, k))
    a_s, b_s = _scales(rng, (g, mm, 3)), _scales(rng, (g, 1, 3))
    masked = np.array([0, 9, 3, 1], np.int32)
    out = np.asarray(grouped_masked(*map(jnp.asarray, (a, a_s, b, b_s, masked)), out_dtype=jnp.float32))
    ref = np.zeros((g, mm, n))
    for gi in range(g):
        ref[gi, : masked[gi]] = _brute_block_gemm(a[gi, : masked[gi]], a_s[gi, : masked[gi]], b[gi], b_s[gi])
    assert_close(out, ref, 1e-6)


def test_quantize_roundtrip_is_close():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((6, 300)).astype(np.float32)
    w = rng.standard_normal((200, 300)).astype(np.float32)
    (xq, xs), (wq, ws) = quantize_act(jnp.asarray(x)), quantize_weight(jnp.asarray(w))
    assert xs.shape == (6, 3) and ws.shape == (2, 3)
    out = fp8_gemm(xq, xs, wq, ws, out_dtype=jnp.float32)
    assert_close(out, x.astype(np.float64) @ w.T.astype(np.float64), 0.08)  # e4m3 has a 3-bit mantissa


SMALL = GemmConfig(block_m=16, block_n=32, block_k=128, num_warps=4, num_stages=1)


@needs_triton_interp
def test_triton_interpreted_dense_and_masked():
    rng = np.random.default_rng(4)
    m, n, k = 5, 130, 300  # partial N and K blocks
    a, b = _fp8(rng, (m, k)), _fp8(rng, (n, k))
    a_s, b_s = _scales(rng, (m, 3)), _scales(rng, (2, 3))
    args = list(map(jnp.asarray, (a, a_s, b, b_s)))
    out = fp8_gemm(*args, out_dtype=jnp.float32, impl="interpret", cfg=SMALL)
    assert_close(out, fp8_gemm(*args, out_dtype=jnp.float32, impl="ref"), 1e-6)
    g, mm = 3, 32
    a, b = _fp8(rng, (g, mm, k)), _fp8(rng, (g, n, k))
    a_s, b_s = _scales(rng, (g, mm, 3)), _scales(rng, (g, 2, 3))
    masked = jnp.asarray([0, 32, 5], jnp.int32)
    args = [*map(jnp.asarray, (a, a_s, b, b_s)), masked]
    out = np.asarray(grouped_masked(*args, out_dtype=jnp.float32, impl="interpret", cfg=SMALL))
    live = np.arange(mm)[None] < np.asarray(masked)[:, None]
    assert_close(out[live], np.asarray(grouped_masked(*args, out_dtype=jnp.float32, impl="ref"))[live], 1e-6)


@needs_triton_interp
def test_triton_interpreted_masked_without_a_config():
    """32 rows per group: no config takes 16-row tiles from MASKED_CFGS (128 and 64 do not divide 32)."""
    rng = np.random.default_rng(6)
    g, mm, n, k = 3, 32, 130, 300
    a, b = _fp8(rng, (g, mm, k)), _fp8(rng, (g, n, k))
    a_s, b_s = _scales(rng, (g, mm, 3)), _scales(rng, (g, 2, 3))
    masked = jnp.asarray([7, 32, 0], jnp.int32)
    args = [*map(jnp.asarray, (a, a_s, b, b_s)), masked]
    out = np.asarray(grouped_masked(*args, out_dtype=jnp.float32, impl="interpret"))
    live = np.arange(mm)[None] < np.asarray(masked)[:, None]
    assert_close(out[live], np.asarray(grouped_masked(*args, out_dtype=jnp.float32, impl="ref"))[live], 1e-6)


@needs_triton_interp
def test_triton_interpreted_contiguous():
    rng = np.random.default_rng(5)
    g, n, k = 3, 64, 256
    m_idx = np.array([0] * 7 + [-1] * 9 + [2] * 16 + [2] * 3 + [-1] * 13 + [-1] * 16, np.int32)
    m = m_idx.size
    a, b = _fp8(rng, (m, k)), _fp8(rng, (g, n, k))
    a_s, b_s = _scales(rng, (m, 2)), _scales(rng, (g, 1, 2))
    args = list(map(jnp.asarray, (a, a_s, b, b_s, m_idx)))
    out = np.asarray(grouped_contiguous(*args, out_dtype=jnp.float32, impl="interpret", cfg=SMALL))
    ref = np.asarray(grouped_contiguous(*args, out_dtype=jnp.float32, impl="ref"))
    assert_close(out[m_idx >= 0], ref[m_idx >= 0], 1e-6)
    assert np.isnan(out[-16:]).all()  # the empty tile is skipped


@needs_triton_interp
@pytest.mark.parametrize(
    "m,n,k,cfg",
    [
        # partial M, N and K tiles; 5 K blocks over 3 splits (2, 2, 1)
        (20, 100, 600, Fp8Config(16, 32, 128, 4, 1, split_k=3)),
        # 2 K blocks over 3 splits (1, 1, 0): the empty split writes a zero partial
        (7, 40, 129, Fp8Config(16, 32, 128, 4, 1, split_k=3)),
        # cfg None: the chooser's decode config (64 x 64 tiles); 9 K blocks over its splits
        (37, 192, 1100, None),
        # two K blocks a loop step: 5 blocks over 2 splits (3, 2), so split 0's second step reaches into
        # split 1's first block and must load nothing there; unsplit, the last step runs past K
        (20, 100, 600, Fp8Config(16, 32, 256, 4, 1, split_k=2)),
        (20, 100, 600, Fp8Config(16, 32, 256, 4, 1, split_k=1)),
        # four a step: 9 K blocks over 2 splits (5, 4), K not a multiple of 128
        (37, 192, 1100, Fp8Config(16, 64, 512, 4, 1, split_k=2)),
    ],
)
def test_triton_interpreted_split_k(m, n, k, cfg):
    rng = np.random.default_rng(m * n + k)
    kb = -(-k // B)
    a, b = _fp8(rng, (m, k)), _fp8(rng, (n, k))
    a_s, b_s = _scales(rng, (m, kb)), _scales(rng, (-(-n // B), kb))
    args = list(map(jnp.asarray, (a, a_s, b, b_s)))
    out = fp8_gemm(*args, out_dtype=jnp.float32, impl="interpret", cfg=cfg)
    assert_close(out, fp8_gemm(*args, out_dtype=jnp.float32, impl="ref"), 1e-6)


def test_k_step_takes_whole_scale_blocks():
    """block_k 256 and 512 load 2 and 4 scale blocks a loop step; 128 and less one; other widths are refused
    with the reason."""
    from djax.kernels.fp8_gemm_triton import k_step

    assert [k_step(GemmConfig(16, 64, bk)) for bk in (64, 128, 256, 512)] == [1, 1, 2, 4]
    for bk in (192, 384, 1024):
        with pytest.raises(ValueError, match="block_k must be 128, 256 or 512"):
            k_step(GemmConfig(16, 64, bk))


def test_dense_config_splits_k_for_decode():
    dec = dense_config(64, 4096, 7168)
    assert dec.split_k == 4 and dec.block_m == 64 and 128 % dec.block_n == 0  # the measured best there
    assert dense_config(4096, 4096, 7168) == DEFAULT_CFG and DEFAULT_CFG.split_k == 1
    # K splits until 256 programs (two per SM), as few as give that; each split two K blocks or more
    for (m, n, k), split in {
        (1, 32768, 1024): 1,  # 512 tiles already
        (32, 2048, 4096): 8,  # 32 tiles x 8
        (32, 4096, 2048): 4,
        (128, 4096, 8192): 2,  # 128 x 128 tiles would be 32 programs: 2 x 64 tiles x 2
        (5, 256, 384): 1,  # 3 K blocks: no split leaves two in each
    }.items():
        cfg = dense_config(m, n, k)
        assert cfg.block_m == 64 and cfg.split_k == split, (m, n, k, cfg)
    assert dense_config(128, 32768, 1024) == DEFAULT_CFG  # 256 tiles of 128 x 128 fill the SMs


def test_auto_takes_tilelang_for_large_contiguous_layouts_on_cuda(monkeypatch):
    """grouped_contiguous(impl="auto") on CUDA with TileLang: the TileLang grouped kernel for fp8 operands with
    n, k multiples of 128, a bf16 result and a layout of two waves of its tiles; Triton for a smaller layout,
    another out dtype, or a Triton config; TileLang wherever a tiling is given. Faked backend, stub kernels."""
    import djax.kernels.fp8_gemm as op
    import djax.kernels.fp8_gemm_tilelang as tl_mod
    from djax.kernels import dispatch
    from djax.kernels.fp8_gemm_tilelang import WsTiling

    monkeypatch.setattr(dispatch, "on_cuda", lambda: True)
    monkeypatch.setattr(dispatch, "has_tilelang", lambda: True)
    monkeypatch.setattr(dispatch, "has_triton", lambda: True)
    taken = []
    monkeypatch.setattr(tl_mod, "grouped_contiguous_tilelang", lambda *a: taken.append("tilelang"))
    monkeypatch.setattr(op, "_run", lambda impl, *a: taken.append(impl))
    rng = np.random.default_rng(9)

    def call(m, n, k, out_dtype=jnp.bfloat16, **kw):
        a, b = jnp.asarray(_fp8(rng, (m, k))), jnp.asarray(_fp8(rng, (2, n, k)))
        sa = jnp.asarray(_scales(rng, (m, k // 128)))
        sb = jnp.asarray(_scales(rng, (2, n // 128, k // 128)))
        op.grouped_contiguous(a, sa, b, sb, jnp.zeros((m,), jnp.int32), out_dtype, **kw)
        return taken.pop()

    # 128x256 tiles at n 512: 2 a tile row, so 132 tile rows (16,896 rows) are two waves
    assert call(16896, 512, 256) == "tilelang"
    assert call(16768, 512, 256) == "triton"
    assert call(16896, 384, 256) == "tilelang"  # 128x128 tiles: 3 a tile row
    assert call(16896, 512, 256, jnp.float32) == "triton"
    assert call(16896, 512, 256, cfg=op.FP8_CFG) == "triton"
    assert call(128, 512, 256, tiling=WsTiling(128, 256, 3)) == "tilelang"
    monkeypatch.setattr(dispatch, "has_tilelang", lambda: False)
    assert call(16896, 512, 256) == "triton"


def test_auto_takes_tilelang_at_prefill_shapes_on_cuda(monkeypatch):
    """impl="auto" on CUDA with TileLang installed: the TileLang "ws" kernel for fp8 operands with n, k
    multiples of 128, a bf16 result and at least two waves of its tiles (2 x 132 CTAs), or at decode where
    its default is the k-group kernel; Triton for fewer tiles, other decode shapes, other shapes or dtypes,
    or an explicit Triton config; TileLang wherever a variant is
    asked for; the reference off CUDA. The backend is faked and the kernels are stubs: this checks the
    choice, not the kernels."""
    import djax.kernels.fp8_gemm as op
    import djax.kernels.fp8_gemm_tilelang as tl_mod
    from djax.kernels import dispatch

    monkeypatch.setattr(dispatch, "on_cuda", lambda: True)
    monkeypatch.setattr(dispatch, "has_tilelang", lambda: True)
    monkeypatch.setattr(dispatch, "has_triton", lambda: True)
    taken = []
    monkeypatch.setattr(
        tl_mod, "fp8_gemm_tilelang", lambda *a, **kw: taken.append(("tilelang", kw["variant"]))
    )
    monkeypatch.setattr(op, "_run", lambda impl, *a: taken.append((impl, None)))

    def call(m, n, k, out_dtype=jnp.bfloat16, a_dtype=None, **kw):
        # zeros: the choice reads the operands' shapes and dtypes, never their values (drawing random ones at
        # these sizes, 270M fp8 values in all, was most of the test's time)
        a, b = (jnp.asarray(np.zeros(s, ml_dtypes.float8_e4m3fn)) for s in ((m, k), (n, k)))
        if a_dtype is not None:
            a = a.astype(a_dtype)
        sa = jnp.asarray(np.ones((m, -(-k // 128)), np.float32))
        sb = jnp.asarray(np.ones((-(-n // 128), -(-k // 128)), np.float32))
        fp8_gemm(a, sa, b, sb, out_dtype, **kw)
        return taken.pop() if taken else "ref"

    # 128x256 tiles: 17 x 16 = 272 CTAs at m 2176, n 4096; 16 x 16 = 256 at m 2048, under two waves
    assert call(2176, 4096, 256) == ("tilelang", "ws")
    assert call(2048, 4096, 256) == ("triton", None)
    assert call(64, 4096, 256) == ("triton", None)  # decode
    assert call(64, 4096, 7168) == ("tilelang", "ws")  # decode where the k-group kernel beat Triton
    assert call(5, 4096, 7168) == ("tilelang", "ws")
    assert call(8, 7168, 4096) == ("tilelang", "ws")  # and here, since the register push
    assert call(1, 4096, 8192) == ("tilelang", "ws")  # V4-Flash's output LoRA and shared expert down
    assert call(64, 4096, 2048) == ("tilelang", "ws")
    assert call(64, 16384, 7168) == ("triton", None)
    assert call(2176, 4096, 200) == ("triton", None)  # k not a multiple of 128
    assert call(2176, 4000, 256) == ("triton", None)  # n not a multiple of 128
    assert call(2176, 4096, 256, jnp.float32) == ("triton", None)  # the TileLang kernel writes bf16
    assert call(2176, 4096, 256, a_dtype=jnp.float32) == ("triton", None)  # it takes fp8 e4m3 only
    assert call(2176, 4096, 256, cfg=DEFAULT_CFG) == ("triton", None)  # a Triton config asks for Triton
    assert call(200, 256, 512, variant="ws") == ("tilelang", "ws")  # a TileLang variant asks for TileLang
    monkeypatch.setattr(dispatch, "has_tilelang", lambda: False)
    assert call(2176, 4096, 256) == ("triton", None)
    monkeypatch.setattr(dispatch, "has_tilelang", lambda: True)
    monkeypatch.setattr(dispatch, "on_cuda", lambda: False)
    assert call(2176, 4096, 256) == "ref"


@pytest.mark.parametrize(
    "op, shapes, match",
    [
        (
            "dense",
            ((8, 256), (8, 3), (128, 256), (1, 2)),
            "a_scale has shape \\[8, 3\\], expected \\[8, 2\\]",
        ),
        (
            "dense",
            ((8, 256), (8, 2), (128, 384), (1, 3)),
            "b has shape \\[128, 384\\], expected \\[\\*, 256\\]",
        ),
        (
            "dense",
            ((8, 256), (8, 2), (256, 256), (1, 2)),
            "b_scale has shape \\[1, 2\\], expected \\[2, 2\\]",
        ),
        ("contiguous", ((8, 256), (8, 2), (2, 128, 256), (2, 1, 2), (7,)), "m_indices has shape \\[7\\]"),
        ("contiguous", ((8, 256), (8, 2), (2, 128, 256), (1, 1, 2), (8,)), "b_scale has shape \\[1, 1, 2\\]"),
        ("masked", ((2, 16, 256), (2, 16, 2), (3, 32, 256), (3, 1, 2), (2,)), "b has shape \\[3, 32, 256\\]"),
        ("masked", ((2, 16, 256), (2, 16, 2), (2, 32, 256), (2, 1, 2), (3,)), "masked_m has shape \\[3\\]"),
    ],
)
@pytest.mark.parametrize("impl", ["ref", "interpret"])
def test_fp8_ops_name_a_bad_argument(op, shapes, match, impl):
    """A mis-shaped operand (a scale of the wrong block count above all, which the reference would otherwise
    truncate silently) fails before any kernel runs, with its name, for every impl."""
    dtypes = [jnp.float8_e4m3fn, jnp.float32, jnp.float8_e4m3fn, jnp.float32, jnp.int32]
    args = [jnp.ones(s, d) for s, d in zip(shapes, dtypes)]
    fn = {"dense": fp8_gemm, "contiguous": grouped_contiguous, "masked": grouped_masked}[op]
    with pytest.raises(ValueError, match=match):
        fn(*args, impl=impl)


@needs_triton_interp
@pytest.mark.parametrize("split,block_k", [(2, 128), (3, 128), (2, 256), (1, 512)])
def test_grouped_split_k_matches_unsplit(split, block_k):
    """Split-K in both grouped layouts (partials summed after the kernel): live rows equal the reference;
    rows the kernel skips (padding, past a group's count, an empty tile) stay unwritten (nan), as unsplit.
    5 K blocks over 2 or 3 splits leave the last split short; block_k 256 and 512 load 2 and 4 of them a loop
    step (a step reaching past its split's blocks, or past K)."""
    rng = np.random.default_rng(6 + split + block_k)
    g, n, k = 3, 64, 600
    cfg = Fp8Config(16, 32, block_k, 4, 1, split_k=split)
    m_idx = np.array([1] * 5 + [-1] * 11 + [-1] * 16 + [0] * 16 + [2] * 9 + [-1] * 7, np.int32)
    a, b = _fp8(rng, (m_idx.size, k)), _fp8(rng, (g, n, k))
    args = [
        *map(jnp.asarray, (a, _scales(rng, (m_idx.size, 5)), b, _scales(rng, (g, 1, 5)))),
        jnp.asarray(m_idx),
    ]
    out = np.asarray(grouped_contiguous(*args, out_dtype=jnp.float32, impl="interpret", cfg=cfg))
    ref = np.asarray(grouped_contiguous(*args, out_dtype=jnp.float32, impl="ref"))
    assert_close(out[m_idx >= 0], ref[m_idx >= 0], 1e-6)
    assert np.isnan(out[16:32]).all()  # the tile with no picks is skipped in every split
    mm, masked = 32, np.array([3, 0, 32], np.int32)
    a = _fp8(rng, (g, mm, k))
    args = [*map(jnp.asarray, (a, _scales(rng, (g, mm, 5)), b, _scales(rng, (g, 1, 5)))), jnp.asarray(masked)]
    out = np.asarray(grouped_masked(*args, out_dtype=jnp.float32, impl="interpret", cfg=cfg))
    live = np.arange(mm)[None] < masked[:, None]
    assert_close(out[live], np.asarray(grouped_masked(*args, out_dtype=jnp.float32, impl="ref"))[live], 1e-6)
    assert np.isnan(out[~live]).all()


def test_decode_config_compiles_to_sm90_cubin():
    """The chooser's decode config at m 64, n 4096, k 7168 compiles for sm_90 within its shared memory."""
    from djax.ffi.cubin import MAX_SHARED_BYTES, compile_triton
    from djax.kernels.fp8_gemm_triton import constexprs, fp8_gemm_kernel

    cfg = dense_config(64, 4096, 7168)
    fp8, f32 = jnp.float8_e4m3fn, jnp.float32
    names = ["a_ptr", "as_ptr", "b_ptr", "bs_ptr", "grp_ptr", "c_ptr"]
    dtypes = [fp8, f32, fp8, f32, jnp.int32, f32]
    cx = constexprs(64, 4096, 7168, 0, "dense", cfg)
    k = compile_triton(fp8_gemm_kernel, names, dtypes, cx, cfg.num_warps, cfg.num_stages)
    assert k.binary[:4] == b"\x7fELF" and k.threads == 32 * cfg.num_warps
    assert 0 < k.shared_bytes <= MAX_SHARED_BYTES


def test_interpreted_host_callbacks_take_turns():
    """Host callbacks that run Triton's interpreter hold one lock (the interpreter patches its language module
    while it runs): called from four threads at once, no two run together, and each returns its own result."""
    import threading
    import time

    from djax.kernels.dispatch import interpreted

    running, most, results = [0], [0], {}
    guard = threading.Lock()

    def host(i):
        with guard:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.05)
        with guard:
            running[0] -= 1
        return i * i

    run = interpreted(host)
    threads = [threading.Thread(target=lambda i=i: results.update({i: run(i)})) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert most[0] == 1 and results == {i: i * i for i in range(4)}
