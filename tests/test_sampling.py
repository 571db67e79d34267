"""Token choice: top-k / top-p filtering against a brute-force numpy version, the sampled distribution
against the softmax, per-row seeds, and greedy = argmax."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from djax.config import SamplingParams
from djax.sampling import filter_logits, row_keys
from djax.sampling import sample as _sample

sample = jax.jit(_sample, static_argnames="sampling")  # one compile per shape instead of op-by-op dispatch


def _logits(seed: int, b: int = 6, v: int = 40, scale: float = 3.0) -> np.ndarray:
    """Continuous random logits: exact ties have probability 0 (checked anyway)."""
    x = (scale * np.random.default_rng(seed).standard_normal((b, v))).astype(np.float32)
    assert all(len(np.unique(r)) == v for r in x)
    return x


def _reference(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Brute force, one row at a time in float64: the kept set, then -inf outside it."""
    out = np.full(logits.shape, -np.inf)
    for r, row in enumerate(logits.astype(np.float64) / temperature):
        order = np.argsort(-row)
        kept = order[:top_k] if 0 < top_k < len(row) else order
        if top_p < 1.0:
            p = np.exp(row[kept] - row[kept].max())
            p /= p.sum()
            # the smallest prefix of the sorted survivors whose mass reaches top_p
            before = np.concatenate([[0.0], np.cumsum(p)[:-1]])
            assert np.all(np.abs(before - top_p) > 1e-5), "a nucleus boundary too close to call in float32"
            kept = kept[before < top_p]
        out[r, kept] = row[kept]
    return out


def _check(logits, temperature, top_k, top_p):
    sp = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    got = np.asarray(filter_logits(jnp.asarray(logits), sp))
    want = _reference(logits, temperature, top_k, top_p)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    np.testing.assert_allclose(got[np.isfinite(got)], want[np.isfinite(want)], rtol=1e-6)
    return got


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("top_k", [1, 2, 7, 39, 40, 100])
def test_top_k_matches_brute_force(temperature, top_k):
    got = _check(_logits(top_k), temperature, top_k, 1.0)
    assert np.all(np.isfinite(got).sum(-1) == min(top_k, 40))


@pytest.mark.parametrize("temperature", [1.0, 2.5])
@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.5, 0.8, 0.95, 0.999])
def test_top_p_matches_brute_force(temperature, top_p):
    _check(_logits(int(top_p * 1000)), temperature, 0, top_p)


@pytest.mark.parametrize(("top_k", "top_p"), [(5, 0.7), (12, 0.9), (3, 0.999)])
def test_top_k_then_top_p_matches_brute_force(top_k, top_p):
    _check(_logits(top_k + 100), 1.3, top_k, top_p)


@pytest.mark.parametrize(
    "sp", [SamplingParams(temperature=1.0, top_p=1e-6), SamplingParams(temperature=1.0, top_k=1)]
)
def test_tiny_top_p_and_top_k_1_keep_only_the_argmax(sp):
    logits = _logits(7, scale=0.1)  # a flat distribution: the argmax has little mass
    got = np.asarray(filter_logits(jnp.asarray(logits), sp))
    want = np.full(logits.shape, -np.inf)
    rows = np.arange(len(logits))
    want[rows, logits.argmax(-1)] = logits[rows, logits.argmax(-1)]
    np.testing.assert_array_equal(got, want)
    # so sampling always returns the argmax, whatever the seed
    seeds = jnp.arange(len(logits), dtype=jnp.uint32)
    for step in range(3):
        np.testing.assert_array_equal(sample(jnp.asarray(logits), seeds, step, sp), logits.argmax(-1))


def test_greedy_is_argmax():
    logits = _logits(3, b=8, v=300)
    for seeds in (jnp.zeros(8, jnp.uint32), jnp.arange(8, dtype=jnp.uint32) * 7919):
        got = sample(jnp.asarray(logits), seeds, jnp.int32(5), SamplingParams())
        assert got.dtype == jnp.int32
        np.testing.assert_array_equal(got, logits.argmax(-1))


N_SAMPLES = 40_000
Z = 5.0  # per-cell bound in standard errors: two-sided p = 5.7e-7 a cell, < 1e-5 for all cells of a test


def _frequencies(logits: np.ndarray, sp: SamplingParams) -> np.ndarray:
    """Empirical frequencies of N_SAMPLES draws, one seed each (one row per seed, vmapped in `sample`)."""
    seeds = jnp.arange(N_SAMPLES, dtype=jnp.uint32)
    draws = sample(jnp.broadcast_to(jnp.asarray(logits), (N_SAMPLES, len(logits))), seeds, jnp.int32(0), sp)
    return np.bincount(np.asarray(draws), minlength=len(logits)) / N_SAMPLES


def _assert_matches(freq: np.ndarray, p: np.ndarray):
    """Each frequency is within Z standard errors sqrt(p (1 - p) / n) of its probability (a binomial
    proportion; n = 40000 makes the normal approximation good for p >= 0.01); zero-probability tokens never occur."""
    se = np.sqrt(p * (1 - p) / N_SAMPLES)
    assert np.all(freq[p == 0] == 0), freq
    assert np.all(np.abs(freq - p) <= Z * se + 1e-12), (freq, p, np.abs(freq - p) / np.maximum(se, 1e-12))


def test_sampled_frequencies_match_softmax():
    logits = np.array([2.0, 1.0, 0.5, 0.0, -0.5, -1.5], np.float32)
    p = np.exp(logits - logits.max())
    p /= p.sum()
    freq = _frequencies(logits, SamplingParams(temperature=1.0))
    _assert_matches(freq, p)
    # the bound is tight enough to tell a different temperature apart
    q = np.exp(2 * (logits - logits.max()))
    q /= q.sum()
    assert np.abs(freq - q).max() > 10 * Z * np.sqrt(q * (1 - q) / N_SAMPLES).max()


def test_sampled_frequencies_with_temperature_and_top_k():
    logits = np.array([1.0, 2.0, 0.3, -1.0, 1.5, 0.0], np.float32)
    t = 0.7
    p = np.exp((logits - logits.max()) / t)
    p[np.argsort(-logits)[3:]] = 0.0  # top_k = 3
    p /= p.sum()
    _assert_matches(_frequencies(logits, SamplingParams(temperature=t, top_k=3)), p)


def test_row_samples_do_not_depend_on_the_batch():
    """Row r with seed s draws the same tokens alone or inside a bigger batch, at every step."""
    logits = jnp.asarray(_logits(11, b=5, v=1000, scale=0.5))
    seeds = jnp.array([3, 17, 2**31 + 5, 2**32 - 1, 0], jnp.uint32)
    sp = SamplingParams(temperature=1.0, top_k=500, top_p=0.9)
    for step in range(4):
        together = np.asarray(sample(logits, seeds, jnp.int32(step), sp))
        for r in range(5):
            alone = sample(logits[r : r + 1], seeds[r : r + 1], jnp.int32(step), sp)
            assert int(alone[0]) == together[r], (step, r)
        # reversed batch order: the same draws, reversed
        np.testing.assert_array_equal(sample(logits[::-1], seeds[::-1], jnp.int32(step), sp), together[::-1])


def test_seeds_and_steps_change_the_draws():
    logits = jnp.zeros((1, 1000), jnp.float32)  # uniform: a collision has probability 1e-3 a draw
    sp = SamplingParams(temperature=1.0)

    def draws(seed):
        return [int(sample(logits, jnp.array([seed], jnp.uint32), jnp.int32(s), sp)[0]) for s in range(8)]

    a, b = draws(1), draws(2)
    assert a == draws(1)  # reproducible
    assert sum(x != y for x, y in zip(a, b)) >= 6  # different seeds, different draws
    assert len(set(a)) >= 6  # the step changes the key


def test_row_keys_accept_signed_and_unsigned_seeds():
    a = jax.random.key_data(row_keys(jnp.array([0, 5, 2**31 - 1], jnp.int32), jnp.int32(3)))
    b = jax.random.key_data(row_keys(jnp.array([0, 5, 2**31 - 1], jnp.uint32), jnp.int32(3)))
    np.testing.assert_array_equal(a, b)
    assert len({tuple(k) for k in np.asarray(a)}) == 3
