"""The engine on the tiny V4 model (CPU, float32, greedy unless said): every output equals `djax.generate` run
on that prompt alone, under page pressure (preemption), chunked prefill, prefix hits and async steps.

Compiles dominate on CPU, so every engine here has the same shapes (SHAPE) and reuses one compiled step
(two widths: 1 and 16), and the reference is one `djax.generate` call over every prompt (rows are
independent: the batch-invariance `tests/test_generate.py` checks).
"""

import jax
import numpy as np
import pytest

import djax
from djax.config import preset
from djax.engine import LLM, EngineConfig, RequestParams

N = 12  # max new tokens of the reference
WIDTH = 64  # reference prompt width
# 8 slots of 8 pages of 16 tokens, 20 pages in all: 64 requests of up to 72 tokens must preempt.
SHAPE = dict(max_num_seqs=8, max_model_len=128, num_pages=20, max_num_batched_tokens=128, widths=(1, 16))
GREEDY = RequestParams(max_tokens=N, ignore_eos=True)


def _prompts():
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 61, size=64)
    lengths[:4] = [1, 16, 17, 60]  # edge cases: one token, exactly one block, one past it, long
    prompts = [rng.integers(0, 512, size=int(n)).tolist() for n in lengths]
    prefix = rng.integers(0, 512, size=40).tolist()  # shared by two prompts: a prefix-cache hit
    short = rng.integers(0, 512, size=20).tolist()  # a prefix shorter than one compressed HCA entry x page
    extra = [prefix + [1, 2, 3, 4, 5], prefix + [9, 8, 7, 6, 5, 4, 3], short + [5], short + [6, 7]]
    return prompts, extra


PROMPTS, EXTRA = _prompts()


@pytest.fixture(scope="module")
def model():
    cfg = preset("tiny-v4")
    return cfg, djax.init_params(cfg, jax.random.key(0))


def generate_alone(model, prompts, **kw) -> djax.Generated:
    """N greedy tokens of each prompt by `djax.generate` (EOS ignored), every row on its own, in one call."""
    cfg, params = model
    batch = djax.Batch.from_lists(prompts, pad_to=WIDTH)
    return djax.generate(params, batch, cfg, djax.SamplingParams(ignore_eos=True), N, max_len=128, **kw)


@pytest.fixture(scope="module")
def reference(model):
    """Greedy tokens of every prompt, each row on its own (one compile)."""
    allp = PROMPTS + EXTRA
    return {tuple(p): t for p, t in zip(allp, generate_alone(model, allp).to_lists())}


def _llm(model, **kw):
    return LLM(model, EngineConfig(**{**SHAPE, **kw}))


def _max_tokens(i):
    return 1 + (i * 5) % N


def test_many_requests_under_pressure_equal_alone(model, reference):
    """64 concurrent requests of varied lengths, chunked prefill, page pressure (preemption) == each alone."""
    llm = _llm(model)
    params = [RequestParams(max_tokens=_max_tokens(i), ignore_eos=True) for i in range(len(PROMPTS))]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    sched = llm.engine.sched
    assert sched.num_preemptions > 0, "the test must force preemption"
    assert max(len(p) for p in PROMPTS) > 16  # prompts longer than one chunk: chunked prefill
    for i, (p, o) in enumerate(zip(PROMPTS, outs)):
        assert o.error is None and o.finished
        assert o.outputs[0].token_ids == reference[tuple(p)][: _max_tokens(i)], f"request {i}"
        assert o.outputs[0].finish_reason == "length"
    assert sched.pages.num_free == sched.pages.num_pages and not sched.running  # nothing leaked
    assert (sched.pages.ref == 0).all()


def test_async_off_equals_on(model, reference):
    llm = _llm(model, async_scheduling=False)
    outs = llm.generate(PROMPTS[:12], GREEDY, use_tqdm=False)
    for p, o in zip(PROMPTS[:12], outs):
        assert o.outputs[0].token_ids == reference[tuple(p)]


def test_prefix_hit_equals_uncached(model, reference):
    """A second prompt sharing a 40-token prefix reuses 32 tokens (two blocks); a 20-token prefix reuses 16."""
    llm = _llm(model)
    for p in EXTRA:  # one at a time, so each later prompt can hit the earlier one's blocks
        o = llm.generate([p], GREEDY, use_tqdm=False)[0]
        assert o.outputs[0].token_ids == reference[tuple(p)]
    seqs = [s for _, ss, _ in llm.engine.requests.values() for s in ss]
    assert [s.num_cached for s in seqs] == [0, 32, 0, 16]
    assert seqs[1].num_fed == len(EXTRA[1]) - 32 + N - 1  # the rest of the prompt, then one token per decode
    off = _llm(model, enable_prefix_caching=False)
    o = off.generate([EXTRA[1]], GREEDY, use_tqdm=False)[0]
    assert o.outputs[0].token_ids == reference[tuple(EXTRA[1])] and o.num_cached_tokens == 0


def test_bad_requests_rejected_rest_complete(model, reference):
    good = PROMPTS[:3]
    bad = [
        ([], GREEDY, "empty"),
        ([1, 512], GREEDY, "outside the vocabulary"),
        ([1] * 100, RequestParams(max_tokens=40), "exceed the context"),
        ([1, 2], RequestParams(temperature=-1.0), "temperature"),
        ([1, 2], RequestParams(top_p=0.0), "top_p"),
        ([1, 2], RequestParams(min_p=2.0), "min_p"),
        ([1, 2], RequestParams(repetition_penalty=0.0), "repetition_penalty"),
        ([1, 2], RequestParams(max_tokens=0), "max_tokens"),
        ([1, 2], RequestParams(n=9), "too large for the cache"),
        ([1, 2], RequestParams(logprobs=1000), "logprobs"),
        ([1, 2], RequestParams(seed=-3), "seed"),
        ("text", GREEDY, "tokenizer"),
        ([1, 2], RequestParams(stop=("x",)), "tokenizer"),
    ]
    prompts = [good[0], *[b[0] for b in bad[:7]], good[1], *[b[0] for b in bad[7:]], good[2]]
    params = [GREEDY, *[b[1] for b in bad[:7]], GREEDY, *[b[1] for b in bad[7:]], GREEDY]
    outs = _llm(model).generate(prompts, params, use_tqdm=False)
    errs = [o for o in outs if o.error is not None]
    assert len(errs) == len(bad)
    for o, (_, _, msg) in zip(errs, bad):
        assert msg in o.error, (msg, o.error)
    oks = [o for o in outs if o.error is None]
    assert [o.outputs[0].token_ids for o in oks] == [reference[tuple(p)] for p in good]


def test_sampling_seeded_independent_of_batch_n_logprobs(model):
    llm = _llm(model)
    p = RequestParams(
        max_tokens=6, temperature=0.8, top_k=50, top_p=0.9, min_p=0.01, seed=7, ignore_eos=True, logprobs=3
    )
    alone = llm.generate([PROMPTS[5]], p, use_tqdm=False)[0].outputs[0]
    others = [RequestParams(max_tokens=6, temperature=1.0, seed=i, logprobs=2) for i in range(5)]
    mixed = llm.generate(
        PROMPTS[6:9] + [PROMPTS[5]] + PROMPTS[9:11], others[:3] + [p] + others[3:], use_tqdm=False
    )
    assert mixed[3].outputs[0].token_ids == alone.token_ids
    lp = alone.logprobs
    assert len(lp) == 6 and all(len(e) >= 3 and max(e.values()) <= 0 for e in lp)
    for tok, e in zip(alone.token_ids, lp):
        assert tok in e
    two = llm.generate(
        [PROMPTS[5]],
        RequestParams(max_tokens=6, temperature=1.0, seed=3, n=2, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert len(two.outputs) == 2 and all(len(c.token_ids) == 6 for c in two.outputs)
    assert two.outputs[0].token_ids != two.outputs[1].token_ids


def test_penalties_and_stop_ids(model, reference):
    llm = _llm(model)
    prompt = PROMPTS[3]
    o = llm.generate(
        [prompt], RequestParams(max_tokens=N, repetition_penalty=100.0, ignore_eos=True), use_tqdm=False
    )
    toks = o[0].outputs[0].token_ids
    assert len(set(toks)) == len(toks) and not set(toks) & set(prompt)  # seen tokens are pushed down
    ref = reference[tuple(PROMPTS[0])]
    stop = ref[4]
    o = llm.generate(
        [PROMPTS[0]], RequestParams(max_tokens=N, stop_token_ids=(stop,), ignore_eos=True), use_tqdm=False
    )[0]
    first = ref.index(stop)
    assert o.outputs[0].token_ids == ref[: first + 1] and o.outputs[0].finish_reason == "stop"
    # min_tokens holds a stop id back
    o = llm.generate(
        [PROMPTS[0]],
        RequestParams(max_tokens=N, min_tokens=first + 1, stop_token_ids=(stop,), ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert len(o.outputs[0].token_ids) > first + 1 and stop not in o.outputs[0].token_ids[: first + 1]


def test_text_and_stop_strings(model, reference):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(512)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    llm = LLM(model, EngineConfig(**SHAPE), tokenizer=tok)
    prompt = " ".join(f"t{i}" for i in PROMPTS[0])
    ref = reference[tuple(PROMPTS[0])]
    o = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert o.outputs[0].token_ids == ref and o.outputs[0].text == " ".join(f"t{i}" for i in ref)
    stop = f"t{ref[3]}"
    o = llm.generate(prompt, RequestParams(max_tokens=N, stop=(stop,), ignore_eos=True), use_tqdm=False)[0]
    assert o.outputs[0].finish_reason == "stop" and stop not in o.outputs[0].text
    streamed = list(llm.stream([prompt], GREEDY))
    assert streamed[-1][1].finished and streamed[-1][1].outputs[0].token_ids == ref


def test_expert_counts_equal_generate(model):
    """The engine's router counts for a batch of requests equal `generate`'s over the same prompts (every
    row the same output length, so generate has no finished rows decoding on), then reset to zero."""
    cfg, _ = model
    prompts = PROMPTS[4:10]
    ref = generate_alone(model, prompts, count_experts=True)
    llm = _llm(model, count_experts=True)
    llm.generate(prompts, GREEDY, use_tqdm=False)
    got = llm.engine.expert_counts(reset=True)
    np.testing.assert_array_equal(got, np.asarray(ref.expert_counts))
    fed = sum(len(p) for p in prompts) + len(prompts) * (N - 1)  # the last token is never fed
    assert (got.sum(1) == fed * cfg.num_experts_per_tok).all()
    assert not llm.engine.expert_counts().any()
    with pytest.raises(ValueError, match="count_experts"):
        _llm(model).engine.expert_counts()
