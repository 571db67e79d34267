"""`djax.generate` on the tiny V4 model: bad input, EOS stopping, ignore_eos, reproducible sampling that
does not depend on the rest of the batch, ragged prompts, and generate under an outer jax.jit.

Compiles are the cost here (tens of seconds each on a small CPU), so every run uses the same shapes: a
batch of 3 right-padded to width W, N new tokens, one config (EOS ids are data, not part of the compiled
program). Three programs in all: greedy, sampled, and sampled alone (a batch of 1) under an outer jit.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import djax
from djax.config import preset
from djax.generate import PAD, validate

W = 16  # batch width (pad_to): a row's results must not depend on the padding, so it is kept the same
N = 12  # max_new_tokens
PROMPTS = [[5, 6, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 10, 11], [300]]  # ragged: lengths 3, 11, 1
GREEDY = djax.SamplingParams(ignore_eos=True)
SAMPLED = djax.SamplingParams(temperature=0.9, top_k=200, top_p=0.95, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    cfg = preset("tiny-v4")
    return cfg, djax.init_params(cfg, jax.random.key(0))


def _batch(prompts, seeds=None):
    return djax.Batch.from_lists(prompts, seeds=seeds, pad_to=W)


@pytest.fixture(scope="module")
def greedy_ref(model):
    """Greedy tokens of PROMPTS, run to N tokens whatever they are."""
    cfg, params = model
    out = djax.generate(params, _batch(PROMPTS), cfg, GREEDY, N)
    toks = np.asarray(out.tokens)
    assert toks.shape == (3, N) and np.all((toks >= 0) & (toks < cfg.vocab_size))
    np.testing.assert_array_equal(out.num_tokens, [N] * 3)
    return toks


# ---- bad input -------------------------------------------------------------------------------------
def _raises(match, fn, *args, **kw):
    with pytest.raises(ValueError, match=match):
        fn(*args, **kw)


@pytest.mark.parametrize("bad", [-1, -100, 512, 513, 10**6])
def test_token_outside_vocabulary(model, bad):
    cfg, params = model
    # through Batch.from_lists ...
    with pytest.raises(ValueError, match=f"token id {bad} is outside the vocabulary"):
        djax.generate(params, djax.Batch.from_lists([[1, 2], [3, bad, 4]]), cfg, GREEDY, N)
    # ... and a Batch built by hand
    tokens = jnp.array([[1, 2, 0], [3, bad, 4]], jnp.int32)
    batch = djax.Batch(tokens, jnp.array([2, 3], jnp.int32), jnp.zeros(2, jnp.uint32))
    with pytest.raises(ValueError, match=rf"prompt 1: token id {bad} is outside the vocabulary"):
        djax.generate(params, batch, cfg, GREEDY, N)


def test_token_beyond_int32_does_not_wrap():
    _raises("outside the vocabulary", djax.Batch.from_lists, [[2**32 + 5]])


def test_empty_prompt(model):
    cfg, params = model
    _raises("prompt 1 is empty", djax.Batch.from_lists, [[1, 2], []])
    _raises("no prompts", djax.Batch.from_lists, [])
    batch = djax.Batch(jnp.ones((2, 4), jnp.int32), jnp.array([4, 0], jnp.int32), jnp.zeros(2, jnp.uint32))
    _raises("prompt 1 is empty", djax.generate, params, batch, cfg, GREEDY, N)


def test_prompt_over_the_context(model):
    cfg, params = model
    small = cfg.replace(max_position_embeddings=64)
    _raises(
        "60 prompt tokens \\+ 8 new tokens exceed the context of 64",
        djax.generate,
        params,
        djax.Batch.from_lists([[1], [2] * 60]),
        small,
        GREEDY,
        8,
    )
    # a prompt longer than the context by itself
    _raises(
        "70 prompt tokens .* exceed the context of 64",
        djax.generate,
        params,
        djax.Batch.from_lists([[2] * 70]),
        small,
        GREEDY,
        1,
    )
    # per row: exactly filling the context is fine, one more token is not
    validate(djax.Batch.from_lists([[1], [2] * 52]), small, N)
    _raises("prompt 1: 53 prompt tokens", validate, djax.Batch.from_lists([[1], [2] * 53]), small, N)
    # an explicit max_len is a context too
    _raises("context of 20 tokens", validate, djax.Batch.from_lists([[2] * 10]), cfg, N, max_len=20)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_p=float("nan")), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(top_k=2.5), "top_k"),
    ],
)
def test_invalid_sampling_values(kw, match):
    _raises(match, djax.SamplingParams, **kw)


@pytest.mark.parametrize("n", [0, -3, 2.5])
def test_invalid_max_new_tokens(model, n):
    cfg, params = model
    _raises("max_new_tokens", djax.generate, params, _batch(PROMPTS), cfg, GREEDY, n)


def test_other_bad_input(model):
    cfg, params = model
    _raises("integer token ids", djax.Batch.from_lists, [[1.5, 2.0]])
    _raises("integer token ids", djax.Batch.from_lists, [[[1, 2]]])
    _raises("seed -1", djax.Batch.from_lists, [[1]], seeds=-1)
    _raises("seed 4294967296", djax.Batch.from_lists, [[1]], seeds=2**32)
    _raises("one per prompt", djax.Batch.from_lists, [[1], [2]], seeds=[1, 2, 3])
    _raises("shorter than the longest prompt", djax.Batch.from_lists, [[1] * 20], pad_to=16)
    with pytest.raises(TypeError, match="SamplingParams"):
        djax.generate(params, _batch(PROMPTS), cfg, {"temperature": 1.0}, N)


# ---- greedy: EOS, ignore_eos, ragged prompts -----------------------------------------------------
def _expected(ref: np.ndarray, eos: set[int]):
    """What stopping at the first EOS does to the run-to-N tokens ref [b, N]."""
    toks, counts, by_eos = np.full_like(ref, PAD), [], []
    for r, row in enumerate(ref):
        hits = [i for i, t in enumerate(row) if int(t) in eos]
        n = hits[0] + 1 if hits else len(row)
        toks[r, :n] = row[:n]
        counts.append(n)
        by_eos.append(bool(hits))
    return toks, counts, by_eos


def _check_run(out, ref, eos):
    toks, counts, by_eos = _expected(ref, eos)
    np.testing.assert_array_equal(out.tokens, toks)
    np.testing.assert_array_equal(out.num_tokens, counts)
    np.testing.assert_array_equal(out.finished_by_eos, by_eos)
    assert out.to_lists() == [list(map(int, toks[r, :n])) for r, n in enumerate(counts)]
    return counts


def test_eos_stops_a_row_while_another_continues(model, greedy_ref):
    cfg, params = model
    # an EOS that row 0 produces first at step k >= 2, and row 1 never
    k, t = next(
        (k, int(greedy_ref[0, k]))
        for k in range(2, N - 2)
        if greedy_ref[0, k] not in greedy_ref[0, :k] and greedy_ref[0, k] not in greedy_ref[1]
    )
    out = djax.generate(params, _batch(PROMPTS), cfg.replace(eos_token_id=(t,)), djax.SamplingParams(), N)
    counts = _check_run(out, greedy_ref, {t})
    assert counts[0] == k + 1 and counts[1] == N
    assert np.all(np.asarray(out.tokens)[0, k + 1 :] == PAD)

    # ignore_eos runs every row to max_new_tokens, through the EOS
    out = djax.generate(params, _batch(PROMPTS), cfg.replace(eos_token_id=(t,)), GREEDY, N)
    np.testing.assert_array_equal(out.tokens, greedy_ref)
    np.testing.assert_array_equal(out.num_tokens, [N] * 3)
    assert not np.any(out.finished_by_eos)


def test_every_row_stops_early_with_several_eos_ids(model, greedy_ref):
    """Each row meets one of several EOS ids before N: the loop ends early and every row is right."""
    cfg, params = model
    eos = {int(greedy_ref[0, 1]), int(greedy_ref[1, 4]), int(greedy_ref[2, 0]), 511}
    out = djax.generate(
        params, _batch(PROMPTS), cfg.replace(eos_token_id=tuple(eos)), djax.SamplingParams(), N
    )
    counts = _check_run(out, greedy_ref, eos)
    assert max(counts) <= 5 and all(out.finished_by_eos)


def test_rows_are_independent_of_their_batch(model, greedy_ref):
    """Ragged prompts, each at its own length: reordering the batch (and a repeated row) reorders the output."""
    cfg, params = model
    order = [2, 0, 0]
    out = djax.generate(params, _batch([PROMPTS[i] for i in order]), cfg, GREEDY, N)
    np.testing.assert_array_equal(out.tokens, greedy_ref[order])


def test_validation_is_skipped_under_tracing(model):
    """Inside jit the batch's values are unknown: only the static checks run."""
    cfg, params = model
    batch = _batch(PROMPTS)
    shapes = jax.eval_shape(lambda b: djax.generate(params, b, cfg, GREEDY, N), batch)
    assert shapes.tokens.shape == (3, N) and shapes.num_tokens.shape == (3,)
    with pytest.raises(ValueError, match="max_new_tokens"):
        jax.eval_shape(lambda b: djax.generate(params, b, cfg, GREEDY, 0), batch)


# ---- sampling ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sampled_ref(model):
    cfg, params = model
    out = djax.generate(params, _batch(PROMPTS, seeds=[11, 22, 33]), cfg, SAMPLED, N)
    toks = np.asarray(out.tokens)
    assert np.all((toks >= 0) & (toks < cfg.vocab_size))
    return toks


def test_sampling_is_reproducible(model, sampled_ref):
    cfg, params = model
    out = djax.generate(params, _batch(PROMPTS, seeds=[11, 22, 33]), cfg, SAMPLED, N)
    np.testing.assert_array_equal(out.tokens, sampled_ref)


def test_sampled_row_does_not_depend_on_the_batch(model, sampled_ref):
    cfg, params = model
    # the same prompt and seed at another place among other rows; and the same prompt with another seed
    out = np.asarray(
        djax.generate(
            params, _batch([PROMPTS[1], PROMPTS[2], PROMPTS[0]], [99, 33, 11]), cfg, SAMPLED, N
        ).tokens
    )
    np.testing.assert_array_equal(out[1], sampled_ref[2])
    np.testing.assert_array_equal(out[2], sampled_ref[0])
    assert np.sum(out[0] != sampled_ref[1]) >= N // 2, "another seed should give other tokens"


def test_generate_under_jit_alone_equals_in_batch(model, sampled_ref):
    """Under an outer jax.jit, a prompt alone (a batch of one, same width) with its seed gives the tokens it
    gave in a batch of three. (One compile covers both claims; on a failure, run the eager batch of one.)"""
    cfg, params = model
    run = jax.jit(lambda p, b: djax.generate(p, b, cfg, SAMPLED, N))
    alone = run(params, _batch([PROMPTS[1]], [22]))
    np.testing.assert_array_equal(alone.tokens[0], sampled_ref[1])
    np.testing.assert_array_equal(alone.num_tokens, [N])
