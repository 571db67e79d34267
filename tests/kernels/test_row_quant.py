"""`row_quant.quantize_rows`: rows gathered by index (out-of-range indices give zero rows), optionally through the
clamped SwiGLU of gate and up, quantized 1 x 128 to e4m3. The jnp reference against numpy written from the
rules; the Triton kernel (interpreted, and on a CUDA GPU) against the reference: the same bits without the
SwiGLU, within one e4m3 step with it (its exp is not XLA's)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checks import needs_triton_interp

from djax.kernels import row_quant_triton
from djax.kernels.row_quant import quantize_rows, quantize_rows_ref
from tests.fp8_numpy import hard_rows, quantize_f32


def _inputs(seed, r, n, m, dtype=jnp.bfloat16):
    """x and up [r, n] (never zero), src [m] with -1, r and far out-of-range indices and repeats among them."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((r, n)) * 3, dtype)
    up = jnp.asarray(rng.standard_normal((r, n)) * 3, dtype)
    src = rng.integers(0, r, m).astype(np.int32)
    src[:5] = [-1, r, r + 100, -r - 5, 0]
    src[5] = src[6]
    return x, up, jnp.asarray(src)


def _np_rows(x, src, up=None, limit=0.0):
    """The rows in float64 (from x's own values), zeros where src is outside [0, r); with up the clamped SwiGLU."""
    x = np.asarray(x, np.float64)
    r = x.shape[0]
    live = (src >= 0) & (src < r)
    at = np.clip(src, 0, r - 1)
    rows = x[at]
    if up is not None:
        u = np.asarray(up, np.float64)[at]
        if limit > 0:
            rows, u = np.minimum(rows, limit), np.clip(u, -limit, limit)
        rows = rows / (1 + np.exp(-rows)) * u
    return np.where(live[:, None], rows, 0.0)


def _bits(q):
    return np.asarray(q).view(np.uint8)


def _within_one_step(q, s, q_ref, s_ref):
    """q * s within one e4m3 step of q_ref * s_ref (the reference's own scale, the kernel's within an ulp)."""
    np.testing.assert_allclose(np.asarray(s), np.asarray(s_ref), rtol=2.0**-22)
    got = np.asarray(q, np.float64) * np.repeat(np.asarray(s, np.float64), 128, -1)
    want = np.asarray(q_ref, np.float64) * np.repeat(np.asarray(s_ref, np.float64), 128, -1)
    step = np.maximum(np.abs(want) * 2.0**-3, np.repeat(np.asarray(s_ref, np.float64), 128, -1) * 2.0**-9)
    assert (np.abs(got - want) <= step * (1 + 1e-6)).all()


@pytest.mark.parametrize("ue8m0", [False, True])
def test_ref_matches_numpy(ue8m0):
    """Gathered rows quantized bit for bit as the stated rule; zero rows for the out-of-range indices."""
    x, _, src = _inputs(1, 50, 384, 90)
    q, s = jax.jit(quantize_rows_ref, static_argnums=2)(x, src, ue8m0)
    want_q, want_s = quantize_f32(_np_rows(x, np.asarray(src)), ue8m0)
    np.testing.assert_array_equal(np.asarray(s), want_s)
    np.testing.assert_array_equal(_bits(q), _bits(want_q))
    assert not np.asarray(q, np.float32)[:4].any() and np.asarray(q, np.float32)[4:].any()


@pytest.mark.parametrize("ue8m0", [False, True])
def test_ref_swiglu_within_one_step_of_numpy(ue8m0):
    """With up: the clamped SwiGLU (float64 here) quantized: each value within one e4m3 step of it."""
    x, up, src = _inputs(2, 50, 256, 90)
    q, s = quantize_rows_ref(x, src, ue8m0, up=up, limit=4.0)
    rows = _np_rows(x, np.asarray(src), up, 4.0)
    want_q, want_s = quantize_f32(rows, ue8m0)
    _within_one_step(q, s, want_q, want_s)


@needs_triton_interp
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("ue8m0", [False, True])
def test_interpreted_kernel_is_the_reference(dtype, ue8m0):
    """The kernel in Triton's interpreter: the reference's bits, rows not a multiple of its BLOCK_ROWS."""
    m = row_quant_triton.BLOCK_ROWS + 13
    x, _, src = _inputs(3, 40, 384, m, dtype)
    q, s = quantize_rows(x, src, ue8m0, impl="interpret")
    q_ref, s_ref = quantize_rows_ref(x, src, ue8m0)
    assert q.dtype == jnp.float8_e4m3fn and q.shape == (m, 384) and s.shape == (m, 3)
    np.testing.assert_array_equal(np.asarray(s), np.asarray(s_ref))
    np.testing.assert_array_equal(_bits(q), _bits(q_ref))


@needs_triton_interp
@pytest.mark.parametrize("limit", [0.0, 4.0])
def test_interpreted_swiglu_within_one_step(limit):
    x, up, src = _inputs(4, 40, 256, 77)
    q, s = quantize_rows(x, src, True, up=up, limit=limit, impl="interpret")
    _within_one_step(q, s, *quantize_rows_ref(x, src, True, up=up, limit=limit))
    assert not np.asarray(q, np.float32)[:4].any()


@needs_triton_interp
def test_interpreted_kernel_skips_runs_of_empty_rows():
    """zero_rows False: a program whose rows are all out of range writes nothing (nan here, where the launcher
    fills its outputs with nan); out-of-range rows beside live ones are zeros; live rows the reference's bits."""
    b = row_quant_triton.BLOCK_ROWS
    x, _, src = _inputs(7, 40, 256, 3 * b + 5)
    src = src.at[b : 2 * b].set(-1).at[3 * b :].set(40)  # the second program's rows and the last's: none live
    q, s = quantize_rows(x, src, False, impl="interpret", zero_rows=False)
    q_ref, s_ref = quantize_rows_ref(x, src, False)
    q, s = np.asarray(q, np.float32), np.asarray(s)
    skipped = np.zeros(len(src), bool)
    skipped[b : 2 * b] = skipped[3 * b :] = True
    assert np.isnan(q[skipped]).all() and np.isnan(s[skipped]).all()
    np.testing.assert_array_equal(q[~skipped], np.asarray(q_ref, np.float32)[~skipped])
    np.testing.assert_array_equal(s[~skipped], np.asarray(s_ref)[~skipped])
    assert not q[:4].any() and q[4:b].any()  # out-of-range rows in a live program: zeros


def _assert_rule_bits(q, s, x):
    """q and s are `quantize_f32`'s of rows x (numpy's IEEE division), bit for bit; NaN where it has NaN (a NaN's
    sign bit aside)."""
    want_q, want_s = quantize_f32(np.asarray(x, np.float32), False)
    np.testing.assert_array_equal(np.asarray(s), want_s)
    got, want = np.asarray(q, np.float32), want_q.astype(np.float32)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want)
    np.testing.assert_array_equal(_bits(q)[ok], _bits(want_q)[ok])


@needs_triton_interp
def test_interpreted_markstein_quotient_is_the_division(monkeypatch):
    """`row_quant.MARKSTEIN` (one reciprocal a row and two fmas for the plain scales' division) and the IEEE
    division: the rule's bits on quotients at e4m3 rounding midpoints and on the corner values of `hard_rows`.
    The rule's, not `quantize_rows_ref`'s: XLA's CPU backend turns that division into a product with the
    reciprocal, which rounds some of these quotients the other way."""
    from djax.kernels import row_quant

    x = hard_rows(8, 48)
    src = jnp.arange(48, dtype=jnp.int32)
    assert np.isnan(quantize_f32(x, False)[0][5].astype(np.float32)).sum() == 1  # the infinity's row
    for markstein in (False, True):
        monkeypatch.setattr(row_quant, "MARKSTEIN", markstein)
        q, s = quantize_rows(jnp.asarray(x), src, impl="interpret")
        _assert_rule_bits(q, s, x)


@needs_triton_interp
def test_interpreted_markstein_is_read_when_traced(monkeypatch):
    """The interpreter's callback runs after tracing: it takes the kernel's constants, `MARKSTEIN` among them,
    as they were when the call was traced."""
    from djax.kernels import row_quant

    seen = []
    real = row_quant_triton.launch_torch
    monkeypatch.setattr(
        row_quant_triton,
        "launch_torch",
        lambda x, src, cx, up=None: seen.append(cx["MARKSTEIN"]) or real(x, src, cx, up),
    )
    x, _, src = _inputs(10, 8, 128, 10)

    def traced_without(x, src):
        monkeypatch.setattr(row_quant, "MARKSTEIN", False)
        try:
            return quantize_rows(x, src, impl="interpret")
        finally:
            monkeypatch.setattr(row_quant, "MARKSTEIN", True)

    jax.block_until_ready(jax.jit(traced_without)(x, src))
    assert seen == [False] and row_quant.MARKSTEIN


def test_bad_input_is_refused():
    x, up, src = _inputs(5, 8, 256, 10)
    with pytest.raises(ValueError, match="x must be"):
        quantize_rows(x[0], src)
    with pytest.raises(ValueError, match="src must be"):
        quantize_rows(x, src[None])
    with pytest.raises(ValueError, match="src must be"):
        quantize_rows(x, src.astype(jnp.float32))
    with pytest.raises(ValueError, match="up"):
        quantize_rows(x, src, up=up[:, :128])
    with pytest.raises(ValueError, match="128-column blocks"):
        quantize_rows(x[:, :200], src, impl="interpret")
    with pytest.raises(ValueError, match="impl"):
        quantize_rows(x, src, impl="pallas")


@pytest.mark.gpu
@pytest.mark.parametrize("ue8m0", [False, True])
def test_kernel_on_gpu_is_the_reference(ue8m0):
    """On a CUDA GPU: the reference's bits without the SwiGLU (V4-Flash's token width, rows past a whole
    program); within one e4m3 step with it."""
    x, up, src = _inputs(6, 300, 4096, 1000)
    q, s = jax.jit(quantize_rows, static_argnums=2, static_argnames="impl")(x, src, ue8m0, impl="triton")
    q_ref, s_ref = quantize_rows_ref(x, src, ue8m0)
    np.testing.assert_array_equal(np.asarray(s), np.asarray(s_ref))
    np.testing.assert_array_equal(_bits(q), _bits(q_ref))
    g, u = x[:, :2048], up[:, :2048]
    q, s = jax.jit(lambda *a: quantize_rows(*a, ue8m0, up=u, limit=10.0, impl="triton"))(g, src)
    _within_one_step(q, s, *quantize_rows_ref(g, src, ue8m0, up=u, limit=10.0))


@pytest.mark.gpu
@pytest.mark.parametrize("markstein", [False, True])
def test_markstein_quotient_on_gpu_is_the_division(markstein, monkeypatch):
    """On a CUDA GPU, plain scales: the kernel with the IEEE division and with `row_quant.MARKSTEIN` give the
    rule's bits on `hard_rows` (midpoints, corner values; 4,096 rows at V4-Flash's width, gathered in a
    shuffled order)."""
    from djax.kernels import row_quant

    x = hard_rows(9, 4096, 4096)
    order = np.random.default_rng(9).permutation(4096).astype(np.int32)
    monkeypatch.setattr(row_quant, "MARKSTEIN", markstein)
    q, s = jax.jit(lambda a, i: quantize_rows(a, i, impl="triton"))(jnp.asarray(x), jnp.asarray(order))
    _assert_rule_bits(q, s, x[order])
