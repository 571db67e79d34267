"""The engine on the tiny V4.1 model (shared compressed pools, two-level indexer, Engram's token history):
outputs under page pressure, chunked prefill and prefix hits equal `djax.generate` run on each prompt alone.

The engine prefills exactly, chunk by chunk; `djax.generate` would use SWA bounded replay on prompts longer
than `replay_keep_tokens` (the V4.1 default), so the reference here turns it off.
"""

import jax
import pytest

import djax
from djax.config import preset
from djax.engine import LLM, EngineConfig, RequestParams
from tests.engine.test_engine import EXTRA, PROMPTS, SHAPE, N, generate_alone


@pytest.fixture(scope="module")
def model():
    cfg = preset("tiny-v41", replay_keep_tokens=0)
    assert cfg.engram_layer_ids and cfg.is_v41
    return cfg, djax.init_params(cfg, jax.random.key(0))


def test_v41_requests_under_pressure_and_prefix_hits_equal_alone(model):
    prompts = PROMPTS[:24] + EXTRA
    ref = generate_alone(model, prompts).to_lists()
    # 24 requests at once on 20 pages of 16 tokens: preemption and chunked prefill.
    llm = LLM(model, EngineConfig(**SHAPE))
    outs = llm.generate(prompts[:24], RequestParams(max_tokens=N, ignore_eos=True), use_tqdm=False)
    assert llm.engine.sched.num_preemptions > 0, "the test must force preemption"
    for i, o in enumerate(outs):
        assert o.error is None and o.outputs[0].token_ids == ref[i], f"request {i}"
    # One at a time: the later prompts of EXTRA hit the earlier ones' blocks (Engram's history restored too).
    for p, want in zip(EXTRA, ref[24:]):
        o = llm.generate([p], RequestParams(max_tokens=N, ignore_eos=True), use_tqdm=False)[0]
        assert o.outputs[0].token_ids == want
    cached = [o.num_cached_tokens for o in llm.generate(EXTRA, RequestParams(max_tokens=1), use_tqdm=False)]
    assert all(c > 0 for c in cached), cached
