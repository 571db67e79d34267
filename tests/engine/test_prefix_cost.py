"""The work of a prefix-cache hit does not grow with the prefix: a 1k and a 4k prefix cost the same tokens."""

import jax
import numpy as np
import pytest

import djax
from djax.config import preset
from djax.engine import LLM, EngineConfig, RequestParams

SHAPE = dict(
    max_num_seqs=2, max_model_len=4096, max_num_batched_tokens=256, widths=(1, 128), num_snapshots=32
)
P = RequestParams(max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    cfg = preset("tiny-v4")
    return cfg, djax.init_params(cfg, jax.random.key(0))


def test_hit_cost_constant_in_prefix_length(model):
    rng = np.random.default_rng(3)
    fed, outs = {}, {}
    llm = LLM(model, EngineConfig(**SHAPE))
    for n in (1024, 3968):  # the tiny model has 4096 positions
        prefix = rng.integers(0, 512, size=n).tolist()
        first = prefix + rng.integers(0, 512, size=10).tolist()
        second = prefix + rng.integers(0, 512, size=10).tolist()
        llm.generate([first], P, use_tqdm=False)
        o = llm.generate([second], P, use_tqdm=False)[0]
        assert o.error is None, o.error
        seq = llm.engine.requests[o.request_id][1][0]
        assert o.num_cached_tokens == n
        fed[n], outs[n] = seq.num_fed, (second, o.outputs[0].token_ids)
    assert fed[1024] == fed[3968] == 10 + P.max_tokens - 1
    # and the hit changes nothing: the 1k case again without the cache
    second, toks = outs[1024]
    off = LLM(model, EngineConfig(**SHAPE, enable_prefix_caching=False))
    o = off.generate([second], P, use_tqdm=False)[0]
    assert (
        o.outputs[0].token_ids == toks and off.engine.requests[o.request_id][1][0].num_fed == len(second) + 2
    )
