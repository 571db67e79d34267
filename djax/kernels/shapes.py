"""Shape checks at the public ops' entry, for every impl: a wrong operand fails at trace time with a
ValueError naming it, instead of broadcasting, truncating a scale or surfacing as an einsum error."""

from __future__ import annotations

import operator

import jax.numpy as jnp

from djax.kernels.fp8_gemm_ref import scale_blocks


def expect(op: str, name: str, x, shape: tuple) -> None:
    """Raises ValueError unless x.shape == shape (None in `shape` matches any size)."""
    ok = x.ndim == len(shape) and all(want is None or got == want for got, want in zip(x.shape, shape))
    if not ok:
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{op}: {name} has shape {list(x.shape)}, expected {want}")


def fp8_dense(a, a_scale, b, b_scale) -> None:
    """a [m, k], a_scale [m, ceil(k/128)], b [n, k], b_scale [ceil(n/128), ceil(k/128)]."""
    expect("fp8_gemm", "a", a, (None, None))
    m, k = a.shape
    expect("fp8_gemm", "b", b, (None, k))
    expect("fp8_gemm", "a_scale", a_scale, (m, scale_blocks(k)))
    expect("fp8_gemm", "b_scale", b_scale, (scale_blocks(b.shape[0]), scale_blocks(k)))


def fp8_quant(a, b, b_scale, op: str = "fp8_quant_gemm", names: tuple[str, str] = ("b", "b_scale")) -> None:
    """a [m, k] (not quantized), b [n, k] e4m3, b_scale [n / 128, k / 128]; n (at least 128) and k multiples of
    128. `op` and `names` (b's and b_scale's) name them in the errors."""
    expect(op, "a", a, (None, None))
    m, k = a.shape
    expect(op, names[0], b, (None, k))
    n = b.shape[0]
    if n % 128 or k % 128 or n == 0:
        raise ValueError(
            f"{op}: n {n} and k {k} must be multiples of 128 (whole 128 x 128 scale blocks), n not 0"
        )
    expect(op, names[1], b_scale, (n // 128, k // 128))
    if b.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"{op}: {names[0]} must hold float8_e4m3fn codes, got {b.dtype}")


def fp8_weight(a, b, b_scale, block) -> None:
    """a [m, k], b [n, k] e4m3 codes, b_scale [ceil(n / block[0]), ceil(k / block[1])], block two positive
    ints; or each with a leading group dim g (a [g, m, k], b [g, n, k], b_scale [g, ...])."""
    op = "fp8_weight_gemm"
    if len(block) != 2 or not all(isinstance(x, int) and x > 0 for x in block):
        raise ValueError(f"{op}: block must be two positive ints, got {block!r}")
    if a.ndim not in (2, 3):
        raise ValueError(f"{op}: a must be [m, k] or [groups, m, k], got shape {list(a.shape)}")
    lead = tuple(a.shape[:-2])
    k = a.shape[-1]
    expect(op, "b", b, (*lead, None, k))
    expect(op, "b_scale", b_scale, (*lead, -(-b.shape[-2] // block[0]), -(-k // block[1])))
    if b.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"{op}: b must hold float8_e4m3fn codes, got {b.dtype}")


def fp8_contiguous(a, a_scale, b, b_scale, m_indices) -> None:
    """a [m, k] (rows sorted by group), b [g, n, k], scales as for fp8_dense per group, m_indices [m]."""
    op = "grouped_contiguous"
    expect(op, "a", a, (None, None))
    m, k = a.shape
    expect(op, "b", b, (None, None, k))
    g, n = b.shape[:2]
    expect(op, "a_scale", a_scale, (m, scale_blocks(k)))
    expect(op, "b_scale", b_scale, (g, scale_blocks(n), scale_blocks(k)))
    expect(op, "m_indices", m_indices, (m,))


def fp8_swiglu_contiguous(a, a_scale, rows, w1, s1, w3, s3, m_indices) -> None:
    """a [t, k] token rows, a_scale [t, ceil(k/128)], rows [m], w1 and w3 [g, f, k], s1 and s3
    [g, ceil(f/128), ceil(k/128)], m_indices [m]."""
    op = "grouped_swiglu_contiguous"
    expect(op, "a", a, (None, None))
    t, k = a.shape
    expect(op, "a_scale", a_scale, (t, scale_blocks(k)))
    expect(op, "rows", rows, (None,))
    expect(op, "m_indices", m_indices, rows.shape)
    expect(op, "w1", w1, (None, None, k))
    expect(op, "w3", w3, w1.shape)
    g, f = w1.shape[:2]
    expect(op, "s1", s1, (g, scale_blocks(f), scale_blocks(k)))
    expect(op, "s3", s3, s1.shape)


def fp8_masked(a, a_scale, b, b_scale, masked_m) -> None:
    """a [g, M, k], b [g, n, k], a_scale [g, M, ceil(k/128)], b_scale [g, ceil(n/128), ceil(k/128)],
    masked_m [g]."""
    op = "grouped_masked"
    expect(op, "a", a, (None, None, None))
    g, rows, k = a.shape
    expect(op, "b", b, (g, None, k))
    expect(op, "a_scale", a_scale, (g, rows, scale_blocks(k)))
    expect(op, "b_scale", b_scale, (g, scale_blocks(b.shape[1]), scale_blocks(k)))
    expect(op, "masked_m", masked_m, (g,))


def grouped_contiguous(op: str, a, weights: dict, m_indices, rows) -> None:
    """The bf16 grouped GEMMs' contiguous layout: a [m, k] (or [t, k] gathered through rows [m]), m_indices
    [m], every weight [g, n, k] alike (`weights` by name; QArrays by their logical shapes)."""
    expect(op, "a", a, (None, None))
    _same_weights(op, weights, (None, None, a.shape[1]))
    expect(op, "m_indices", m_indices, (None,) if rows is not None else (a.shape[0],))
    if rows is not None:
        expect(op, "rows", rows, m_indices.shape)


def grouped_masked(op: str, a, weights: dict, masked_m) -> None:
    """The bf16 grouped GEMMs' masked layout: a [g, M, k], every weight [g, n, k] alike, masked_m [g]."""
    expect(op, "a", a, (None, None, None))
    g, _, k = a.shape
    _same_weights(op, weights, (g, None, k))
    expect(op, "masked_m", masked_m, (g,))


def _same_weights(op: str, weights: dict, shape: tuple) -> None:
    first = None
    for name, w in weights.items():
        expect(op, name, w, shape if first is None else first)
        first = first or tuple(w.shape)


def topk(scores, k, lengths) -> None:
    """scores [b, s]; k a non-negative int (it may exceed s: the missing picks are -1); lengths [b] or None."""
    expect("topk", "scores", scores, (None, None))
    try:
        valid = not isinstance(k, bool) and operator.index(k) >= 0
    except TypeError:
        valid = False
    if not valid:
        raise ValueError(f"topk: k must be a non-negative int, got {k!r}")
    if lengths is not None:
        expect("topk", "lengths", lengths, (scores.shape[0],))


def sparse_decode(q, window, window_valid, pool, topk, sinks) -> None:
    """q [b, h, d]; window [b, W, d]; window_valid [b, W]; pool [b, C, d]; topk [b, T]; sinks [h]."""
    op = "sparse_decode"
    expect(op, "q", q, (None, None, None))
    b, h, d = q.shape
    expect(op, "window", window, (b, None, d))
    expect(op, "window_valid", window_valid, (b, window.shape[1]))
    expect(op, "pool", pool, (b, None, d))
    expect(op, "topk", topk, (b, None))
    expect(op, "sinks", sinks, (h,))


def index_scores(q, keys, weights, lengths) -> None:
    """q [b, H, c]; keys [b, s, c]; weights [b, H]; lengths [b]."""
    op = "index_scores"
    expect(op, "q", q, (None, None, None))
    b, h, c = q.shape
    expect(op, "keys", keys, (b, None, c))
    expect(op, "weights", weights, (b, h))
    expect(op, "lengths", lengths, (b,))
