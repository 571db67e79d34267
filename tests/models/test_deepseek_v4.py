"""DeepSeek-V4 in djax against HF transformers, and decoding through the state against the forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from djax.checkpoint import load_checkpoint
from djax.config import preset
from djax.models import deepseek_v4 as v4
from djax.params import init_params

pytest.importorskip("torch")
pytest.importorskip("transformers")
from tests.hf_reference import hf_logits, save_hf_v4  # noqa: E402


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    cfg = preset("tiny-v4")
    path = tmp_path_factory.mktemp("v4")
    model = save_hf_v4(cfg, path)
    loaded_cfg, params = load_checkpoint(path, progress=False)
    return cfg, loaded_cfg, params, model


def test_config_round_trips_through_hf(hf_pair):
    cfg, loaded_cfg, _, _ = hf_pair
    assert loaded_cfg == cfg


def test_forward_matches_hf(hf_pair):
    _, cfg, params, model = hf_pair
    # 70 tokens: past the window (8), 17 CSA windows with an indexer keeping 4, 4 HCA windows.
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 70))
    ref = hf_logits(model, tokens)
    out = np.asarray(jax.jit(lambda p, t: v4.forward(p, t, cfg))(params, jnp.asarray(tokens)))
    err = np.abs(out - ref).max()
    assert err <= 1e-4 * np.abs(ref).max(), (err, np.abs(ref).max())


def test_moe_grouped_equals_dense():
    cfg = preset("tiny-v4")
    params = init_params(cfg, jax.random.key(3))
    tokens = jax.random.randint(jax.random.key(4), (2, 24), 0, cfg.vocab_size)
    a, b = (
        jax.jit(lambda p, t, m=m: v4.forward(p, t, cfg, moe_impl=m))(params, tokens)
        for m in ("grouped", "dense")
    )
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5 * float(jnp.abs(b).max()))
