"""Decoding DeepSeek-V4 through the decoder state equals the teacher-forced forward; greedy generate equals its rollout."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import djax
from djax.config import preset
from djax.models import deepseek_v4 as v4


@pytest.fixture(scope="module")
def model():
    cfg = preset("tiny-v4")
    return cfg, djax.init_params(cfg, jax.random.key(0))


@pytest.mark.parametrize("slot_writes", [False, True])
def test_decode_through_state_equals_forward(model, slot_writes, monkeypatch):
    """Two rows with different prompt lengths, then 620 teacher-forced decode steps: far past the
    window (8), 150+ CSA windows with an indexer keeping 4 of them, 38 HCA windows. The steps' rings
    rebuilt (as at these 2 rows) or written by slot (as from `SLOT_WRITES_FROM_BATCH` rows)."""
    if slot_writes:
        monkeypatch.setattr(v4, "SLOT_WRITES_FROM_BATCH", 1)
    cfg, params = model
    total = 640
    tokens = jax.random.randint(jax.random.key(1), (2, total), 0, cfg.vocab_size)
    lengths = jnp.array([5, 11], jnp.int32)
    ref = np.asarray(djax.forward(params, tokens, cfg))  # [2, total, v]

    width = 16
    prompt = jnp.where(jnp.arange(width)[None] < lengths[:, None], tokens[:, :width], 0)
    logits, state = djax.prefill(params, prompt, lengths, cfg, total)
    steps = total - int(lengths.max())

    def step(state, _):
        tok = jnp.take_along_axis(tokens, state["lengths"][:, None], axis=1)[:, 0]
        logits, state = v4.decode_step(params, tok, state, cfg)
        return state, logits

    _, decoded = jax.jit(lambda s: jax.lax.scan(step, s, None, length=steps))(state)
    decoded = np.asarray(decoded)  # [steps, 2, v]
    scale = np.abs(ref).max()
    for r, n in enumerate(np.asarray(lengths)):
        np.testing.assert_allclose(np.asarray(logits)[r], ref[r, n - 1], atol=1e-4 * scale, rtol=0)
        got = decoded[:, r]  # logits at positions n .. n + steps - 1
        want = ref[r, n : n + steps]
        err = np.abs(got - want).max(axis=-1)
        assert err.max() <= 1e-4 * scale, (r, int(err.argmax()) + n, err.max(), scale)


def test_greedy_generate_equals_forward_rollout(model):
    cfg, params = model
    prompts = [[5, 6, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 10, 11]]
    out = djax.generate(params, djax.Batch.from_lists(prompts), cfg, djax.SamplingParams(), 24)
    assert out.tokens.shape == (2, 24)
    width = 48  # one padded width: the forward is causal, so trailing padding changes no earlier logit
    for r, p in enumerate(prompts):
        seq = list(p)
        for _ in range(24):
            padded = jnp.asarray([seq + [0] * (width - len(seq))])
            logits = djax.forward(params, padded, cfg)
            seq.append(int(jnp.argmax(logits[0, len(seq) - 1])))
        n = int(out.num_tokens[r])
        assert out.to_lists()[r] == seq[len(p) : len(p) + n]
