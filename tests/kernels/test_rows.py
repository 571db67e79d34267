"""`rows`: fp8 and bf16 rows gathered and scattered as 32-bit words give the same bits as XLA's element-wise
gather and scatter (the spec), on fresh random rows, with repeated, dropped and out-of-range indices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from djax.kernels import rows


def _bits(x) -> np.ndarray:
    return np.asarray(x).view(np.uint8)


@pytest.mark.parametrize(
    "dtype, cols, as_words",
    [
        (jnp.float8_e4m3fn, 256, True),
        (jnp.bfloat16, 6, True),
        (jnp.float8_e4m3fn, 6, False),
        (jnp.float32, 5, False),
    ],
)
def test_take_and_set_rows_match_element_wise(dtype, cols, as_words):
    rng = np.random.default_rng(cols)
    x = jnp.asarray(rng.standard_normal((40, cols)) * 3, dtype)
    assert (rows._words(x) is not None) == as_words  # the widths that move as words do
    idx = jnp.asarray(rng.integers(0, 40, 97), jnp.int32)  # repeats included
    np.testing.assert_array_equal(_bits(jax.jit(rows.take_rows)(x, idx)), _bits(x[idx]))
    base = jnp.broadcast_to(jnp.asarray(rng.standard_normal((1, cols)), dtype), (60, cols))
    dest = jnp.asarray(rng.permutation(90)[:40], jnp.int32)  # a third past the end: dropped
    dest = dest.at[3].set(-5)  # negative: from the end, as jnp takes it
    got = jax.jit(rows.set_rows)(base, dest, x)
    np.testing.assert_array_equal(_bits(got), _bits(base.at[dest].set(x, mode="drop")))
    assert not np.array_equal(_bits(got), _bits(base))  # some rows landed


def test_words_off_moves_elements(monkeypatch):
    """`rows.WORDS` False (the benchmarks' "before"): the plain gather, no bitcast in the program."""
    x = jnp.ones((4, 8), jnp.float8_e4m3fn)
    idx = jnp.arange(4, dtype=jnp.int32)

    def program():  # traced afresh each call (a new function: no cached trace)
        return jax.jit(lambda x, i: rows.take_rows(x, i)).lower(x, idx).as_text()

    assert "bitcast_convert" in program()
    monkeypatch.setattr(rows, "WORDS", False)
    assert "bitcast_convert" not in program()
