"""DSpark drafter as a model part: features from the target layers, committed rows, one proposal."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

import djax
from djax.config import preset
from djax.models import deepseek_v4 as v4
from djax.models import dspark


def test_draft_block_from_target_features():
    cfg = preset("tiny-v41")
    params = djax.init_params(cfg, jax.random.key(0))
    b, t = 2, 14
    tokens = jax.random.randint(jax.random.key(1), (b, t), 0, cfg.vocab_size)

    @jax.jit
    def features(params, tokens):
        _, _, aux = v4.run_layers(params, tokens, v4.init_state(cfg, b, t), cfg)
        return dspark.main_features(params["mtp"], aux, cfg)

    main_x = features(params, tokens)
    assert main_x.shape == (b, t, cfg.hidden_size)
    valid = jnp.full((b,), t, jnp.int32)
    one = dspark.commit(params["mtp"], main_x, dspark.init_draft_state(cfg, b), valid, cfg)
    half = dspark.commit(
        params["mtp"], main_x[:, :5], dspark.init_draft_state(cfg, b), jnp.full((b,), 5), cfg
    )
    two = dspark.commit(params["mtp"], main_x[:, 5:], half, jnp.full((b,), t - 5), cfg)
    for r1, r2 in zip(one["layers"], two["layers"]):  # chunked commits equal one commit
        np.testing.assert_allclose(np.asarray(r1), np.asarray(r2), rtol=1e-6, atol=1e-6)
    anchor = jax.random.randint(jax.random.key(2), (b,), 0, cfg.vocab_size)
    draft = jax.jit(functools.partial(dspark.draft, cfg=cfg))  # one jitted function: compiled once for both
    logits, toks, conf = draft(params, anchor, one)
    bs = cfg.dspark_block_size
    assert logits.shape == (b, bs, cfg.vocab_size) and toks.shape == (b, bs) and conf.shape == (b, bs)
    np.testing.assert_array_equal(np.asarray(toks), np.asarray(logits).argmax(-1))
    assert ((np.asarray(conf) > 0) & (np.asarray(conf) < 1)).all()
    # the Markov bias of position j comes from the token before it: a different anchor moves position 0
    other = (anchor + 1) % cfg.vocab_size
    logits2, _, _ = draft(params, other, one)
    assert not np.allclose(np.asarray(logits)[:, 0], np.asarray(logits2)[:, 0])
