"""Decode through djax.kernels (kernels="ref": sparse_decode, index_scores, topk references) equals the
model's own jnp decode path ("off") on CPU in float32."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from djax.config import CSA, preset
from djax.kernels import indexer as kindexer
from djax.kernels import sparse_attn
from djax.kernels import topk as ktopk
from djax.models import deepseek_v4 as v4
from djax.params import init_params_host

AHEAD, STEPS = 4, 32  # row 1 decodes AHEAD tokens alone, then both rows decode STEPS tokens
FAST_COMPILE = {"xla_backend_optimization_level": 0}  # halves the compile; both modes get the same codegen

# Fewer layers than the presets (compile time), each kind still there. V4: SWA, CSA (ratio 4, indexer),
# HCA (ratio 16). V4.1: a ratio-2 source with its own indexer, a ratio-1 source that is also the candidate
# source, and a reader whose indexer is limited to the candidate blocks.
CONFIGS = {
    "tiny-v4": dict(num_hidden_layers=3, compress_ratios=(0, 4, 16), num_hash_layers=1),
    "tiny-v41": dict(
        num_hidden_layers=4,
        compress_ratios=(0, 2, 1, 1),
        kv_source_layer_ids=(1, 2),
        index_source_layer_ids=(1, 2, 3),
        candidate_source_layer_id=2,
        engram_layer_ids=(1,),
        engram_num_embeddings=(152,),
        dspark_target_layer_ids=(2, 3),
    ),
}


def _run(params, cfg, tokens, valid, kernels):
    """Decode tokens int[b, n] one step at a time from an empty state, row r real at step j when
    valid[j, r]: logits f32[n, b, v]. Every step is a chunk of one (the decode path)."""

    def step(state, xs):
        tok, ok = xs
        h, state = v4.extend(params, tok[:, None], state, cfg, ok, kernels=kernels)
        return state, v4.logits_from_hidden(params, h[:, 0], cfg)

    state = v4.init_state(cfg, tokens.shape[0], AHEAD + STEPS + 8)
    return jax.lax.scan(step, state, (tokens.T, valid))[1]


def _counting(monkeypatch, module, name, calls):
    fn = getattr(module, name)

    def wrapped(*args, **kwargs):
        calls.append((name, kwargs.get("impl")))
        return fn(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapped)


@pytest.mark.parametrize("name", ["tiny-v4", "tiny-v41"])
def test_decode_through_kernel_refs_equals_jnp_path(name, monkeypatch):
    """Rows of different lengths (row 0 starts AHEAD tokens later): row 0's first steps see no pool
    entry at all (V4: ratio 4 until position 3, ratio 16 until 15; V4.1: ratio 2 at position 0), later
    ones more entries than the indexer keeps (V4.1: also past the candidate blocks)."""
    cfg = preset(name).replace(num_nextn_predict_layers=0, **CONFIGS[name])
    params = init_params_host(cfg)
    n = AHEAD + STEPS
    tokens = jax.random.randint(jax.random.key(1), (2, n), 0, cfg.vocab_size)
    valid = jnp.ones((n, 2), jnp.int32).at[:AHEAD, 0].set(0)
    layers = cfg.num_hidden_layers
    if cfg.is_v41:
        indexers = len(cfg.index_source_layer_ids)
    else:
        indexers = sum(cfg.layer_type(i) == CSA for i in range(layers))

    calls = []
    for module, fn in ((sparse_attn, "sparse_decode"), (kindexer, "index_scores"), (ktopk, "topk")):
        _counting(monkeypatch, module, fn, calls)
    out = {}
    for mode in ("off", "ref"):
        calls.clear()
        run = jax.jit(lambda p, t, v, mode=mode: _run(p, cfg, t, v, mode)).lower(params, tokens, valid)
        out[mode] = np.asarray(run.compile(FAST_COMPILE)(params, tokens, valid))
        want = 0 if mode == "off" else layers + 2 * indexers  # each traced once inside the scan
        assert len(calls) == want, (mode, calls)
        assert all(impl == "ref" for _, impl in calls)
    # The same float32 math in another order (scales folded into the indexer weights, one softmax over the
    # window and the gathered picks): 3e-7 / 4e-7 of the largest logit measured. A sink scaled by 0.99 or
    # indexer weights off by 1e-3 fail this bound.
    scale = np.abs(out["off"]).max()
    err = np.abs(out["ref"] - out["off"]).max()
    assert err <= 2e-5 * scale, (err, scale)
