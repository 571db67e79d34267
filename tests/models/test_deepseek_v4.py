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


def test_ring_then_orders_the_ring_and_keeps_the_new_rows_behind_a_barrier():
    """The window's keys: the ring's rows in position order, then the chunk's rows in the ring's dtype. The
    rows pass an optimization barrier, so that their norm and rope are not fused into the concatenation (on
    a GPU XLA then recomputed a row's norm for every element of the window: 14-45 us a layer at batch 1)."""
    rng = np.random.default_rng(5)
    ring = jnp.asarray(rng.standard_normal((2, 8, 4)), jnp.bfloat16)  # slot = position % 8
    start = jnp.asarray([3, 13], jnp.int32)  # positions start .. start + 7
    rows = jnp.asarray(rng.standard_normal((2, 3, 4)), jnp.float32)
    got = np.asarray(v4.ring_then(ring, start, rows).astype(jnp.float32))
    for b in range(2):
        slots = [(int(start[b]) + i) % 8 for i in range(8)]
        want = np.concatenate([np.asarray(ring[b].astype(jnp.float32))[slots], np.asarray(rows[b])], 0)
        np.testing.assert_allclose(got[b], want.astype(jnp.bfloat16).astype(np.float32))
    jaxpr = jax.make_jaxpr(v4.ring_then)(ring, start, rows)
    assert [e.primitive.name for e in jaxpr.jaxpr.eqns].count("optimization_barrier") == 1
