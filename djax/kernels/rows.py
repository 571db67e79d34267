"""Whole rows of a narrow dtype (fp8, bf16) gathered and scattered as 32-bit words.

XLA's GPU gather and scatter index every element they move: rows of one-byte fp8 moved as uint32 words are a
quarter of the elements, and the prefill MoE layouts move hundreds of megabytes of them (V4-Flash at 4,096
tokens: 57,088 padded rows of 4,096 fp8 activations, which an H100 gathered element-wise in 278 us). The word
view is a bitcast, so the bits moved are the same either way; rows whose bytes are not a multiple of four move
as elements. On an H100 (`ab_moe_fp8.py --prefill`, moe_fp8_prefill_h100_row_quant_ab.json, kernels/NOTES.md)
the words took V4-Flash's 4,096-token gather in 96.1 us and the down projection's scatter in 37.5 where the
bytes took 277.9 and 267.2, and the Triton path's experts 2,650.6-2,684.0 us against 2,743.2-2,777.6; on
TileLang's path XLA fused the rest differently and the words were slower (2,589.3-2,600.9 against
2,427.2-2,436.1). The GPU paths now quantize and move those rows in one kernel (`row_quant`); the words
serve XLA's forms."""

from __future__ import annotations

import jax
import jax.numpy as jnp

# False: rows move element by element (what XLA does with x[idx]); benchmarks set it while tracing the "before"
WORDS = True


def _words(x) -> jax.Array | None:
    """x [r, c] viewed as uint32 [r, c * itemsize / 4], or None where its rows are not whole words (or it is
    already four bytes or wider: nothing to gain)."""
    r, c = x.shape
    size = x.dtype.itemsize
    if not WORDS or size >= 4 or c * size % 4:
        return None
    per = 4 // size
    return jax.lax.bitcast_convert_type(x.reshape(r, c // per, per), jnp.uint32)


def _unwords(w, dtype, c: int) -> jax.Array:
    """`_words`' inverse: uint32 [r, c * itemsize / 4] back to dtype [r, c]."""
    return jax.lax.bitcast_convert_type(w, dtype).reshape(w.shape[0], c)


def take_rows(x, idx) -> jax.Array:
    """x[idx] for x [r, c] and int idx [m] within [0, r): the same bits, moved as words where they can."""
    w = _words(x)
    if w is None:
        return x[idx]
    return _unwords(w[idx], x.dtype, x.shape[1])


def set_rows(base, idx, rows) -> jax.Array:
    """base.at[idx].set(rows, mode="drop") for base [m, c] and rows [len(idx), c] of its dtype: rows whose
    index is m or more are dropped (a negative one counts from the end, as in jnp). The same bits, moved as
    words where they can."""
    wb, wr = _words(base), _words(rows)
    if wb is None or wr is None:
        return base.at[idx].set(rows, mode="drop")
    return _unwords(wb.at[idx].set(wr, mode="drop"), base.dtype, base.shape[1])
