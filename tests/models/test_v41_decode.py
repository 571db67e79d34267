"""DeepSeek-V4.1 decoder state: decode equals teacher-forced forward; rollback; bounded-replay prefill."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import djax
from djax.config import preset
from djax.models import deepseek_v4 as v4


@pytest.fixture(scope="module")
def model():
    cfg = preset("tiny-v41")
    return cfg, djax.init_params(cfg, jax.random.key(0))


def _decode(params, cfg, state, tokens):
    """Teacher-forced decode of tokens int[b, n] one at a time: logits f32[n, b, v] and the state."""

    def step(state, tok):
        logits, state = v4.decode_step(params, tok, state, cfg)
        return state, logits

    state, logits = jax.lax.scan(step, state, tokens.T)
    return logits, state


def test_layer_reads_nearest_source_at_or_below(model):
    cfg, _ = model
    for i in range(cfg.num_hidden_layers):
        srcs = [s for s in cfg.kv_source_layer_ids if s <= i]
        assert cfg.kv_source(i) == (max(srcs) if cfg.compress_ratios[i] else None)
    state = v4.init_state(cfg, 1, 16)
    owners = [i for i, st in enumerate(state["layers"]) if "pool" in st]
    assert owners == list(cfg.kv_source_layer_ids)  # pools only on sources


def test_reader_layer_uses_its_source_pool(model):
    """Changing only source 3's pool changes layer 4's output; changing source 1's does not."""
    cfg, params = model
    b, t = 1, 9
    x = jax.random.normal(jax.random.key(2), (b, t, cfg.hidden_size))
    state = v4.init_state(cfg, b, 16)
    pos0, valid = jnp.zeros(b, jnp.int32), jnp.full(b, t, jnp.int32)
    outs = []
    for src in (None, 1, 3):
        shared = dict(v4.init_state(cfg, b, 16)["layers"][3])
        shared["pool"] = jax.random.normal(jax.random.key(9), shared["pool"].shape)
        shared["index_pool"] = jax.random.normal(jax.random.key(10), shared["index_pool"].shape)
        if src == 3:
            shared["pool"] = shared["pool"] * 2.0
        sel = {}
        # layer 4 reuses source 3's selection: compute it first as layer 3 would
        scores = jax.random.normal(jax.random.key(11), (b, t, shared["pool"].shape[1]))
        sel[3] = v4.select_entries(scores, cfg.index_topk)
        y, _ = v4.attention_extend(
            params["layers"][4]["attn"], x, state["layers"][4], pos0, valid, cfg, 4, shared, sel
        )
        outs.append(np.asarray(y))
    assert not np.allclose(outs[0], outs[2])
    np.testing.assert_array_equal(outs[0], outs[1])


@pytest.mark.parametrize("slot_writes", [False, True])
def test_decode_through_state_equals_forward(model, slot_writes, monkeypatch):
    """Rows of prompt length 5 and 9, then teacher-forced decode to 40 tokens: past the window (8),
    through ratio-2 and ratio-1 pools, candidate blocks (3 of 4) and index top-6. The steps' rings rebuilt
    (as at these 2 rows) or written by slot (as from `SLOT_WRITES_FROM_BATCH` rows)."""
    if slot_writes:
        monkeypatch.setattr(v4, "SLOT_WRITES_FROM_BATCH", 1)
    cfg, params = model
    total = 40
    tokens = jax.random.randint(jax.random.key(1), (2, total), 0, cfg.vocab_size)
    lengths = jnp.array([5, 9], jnp.int32)
    ref = np.asarray(jax.jit(functools.partial(v4.forward, cfg=cfg))(params, tokens))
    width = 12
    prompt = jnp.where(jnp.arange(width)[None] < lengths[:, None], tokens[:, :width], 0)
    logits, state = jax.jit(functools.partial(v4.prefill, cfg=cfg, max_len=total, keep=0))(
        params, prompt, lengths
    )
    scale = np.abs(ref).max()
    for r, n in enumerate(np.asarray(lengths)):
        np.testing.assert_allclose(np.asarray(logits)[r], ref[r, n - 1], atol=1e-4 * scale, rtol=0)
    # both rows decode the same number of steps, each from its own length
    steps = total - 9
    idx = lengths[:, None] + jnp.arange(steps)
    feed = jnp.take_along_axis(tokens, jnp.clip(idx, 0, total - 1), axis=1)
    decoded, _ = jax.jit(functools.partial(_decode, cfg=cfg))(params, state=state, tokens=feed)
    decoded = np.asarray(decoded)
    for r, n in enumerate(np.asarray(lengths)):
        m = min(steps, total - n)
        err = np.abs(decoded[:m, r] - ref[r, n : n + m]).max(-1)
        assert err.max() <= 1e-4 * scale, (r, int(err.argmax()) + n, err.max(), scale)


@pytest.mark.parametrize("slot_writes", [False, True])
def test_rollback_then_redecode_equals_never_decoded(model, slot_writes, monkeypatch):
    if slot_writes:  # the rings written by slot, their spare slots holding what a rollback reads again
        monkeypatch.setattr(v4, "SLOT_WRITES_FROM_BATCH", 1)
    cfg, params = model
    b, spare = 2, 5
    prompt = jax.random.randint(jax.random.key(4), (b, 10), 0, cfg.vocab_size)
    junk = jax.random.randint(jax.random.key(5), (b, spare), 0, cfg.vocab_size)
    true = jax.random.randint(jax.random.key(6), (b, 8), 0, cfg.vocab_size)
    pf = jax.jit(functools.partial(v4.prefill, cfg=cfg, max_len=40, keep=0, spare=spare))
    _, s0 = pf(params, prompt, jnp.full((b,), 10, jnp.int32))
    step = jax.jit(functools.partial(v4.decode_step, cfg=cfg))

    def dec(state, tokens):
        """Teacher-forced decode of tokens int[b, n], a step at a time: logits [n, b, v] and the state. One
        compiled step serves every n here (a scan over n steps compiles once per n: three programs)."""
        logits = []
        for tok in tokens.T:
            out, state = step(params, tok, state)
            logits.append(out)
        return np.stack(logits), state

    want = dec(s0, true)[0]
    _, s1 = dec(s0, junk)
    back = jnp.array([spare, 3], jnp.int32)  # rows roll back different distances
    s2 = v4.rollback(s1, s1["lengths"] - back)
    # row 1 keeps 2 junk tokens: compare row 0 only after the full rollback, row 1 against its own path
    got = dec(s2, true)[0]
    np.testing.assert_allclose(got[:, 0], want[:, 0], rtol=0, atol=1e-5 * np.abs(want).max())
    _, s1b = dec(s0, junk[:, :2])
    want1 = dec(s1b, true)[0]
    np.testing.assert_allclose(got[:, 1], want1[:, 1], rtol=0, atol=1e-5 * np.abs(want).max())


def test_bounded_replay_prefill(model):
    """Bounded replay keeps every KV-source pool exact, equals exact prefill when the prompt fits in
    `keep`, and otherwise changes the last logits only through the later layers' truncated windows."""
    cfg, params = model
    b, t = 3, 30
    tokens = jax.random.randint(jax.random.key(8), (b, t), 0, cfg.vocab_size)
    assert cfg.replay_keep_tokens == 12
    lengths = jnp.array([30, 17, 12], jnp.int32)  # rows are independent: the last one fits in `keep`
    run = jax.jit(functools.partial(v4.prefill, cfg=cfg, max_len=t), static_argnames="keep")
    exact, s_exact = run(params, tokens, lengths, keep=0)
    approx, s_approx = run(params, tokens, lengths, keep=cfg.replay_keep_tokens)
    for src in cfg.kv_source_layer_ids:
        np.testing.assert_array_equal(
            np.asarray(s_exact["layers"][src]["pool"]), np.asarray(s_approx["layers"][src]["pool"])
        )
    exact, approx = np.asarray(exact), np.asarray(approx)
    # The row that fits in `keep` replays nothing: the exact logits, up to float32 rounding (its batch
    # mates' replay changes the shapes the row is computed in, so not bit for bit).
    np.testing.assert_allclose(approx[2], exact[2], rtol=0, atol=1e-5 * np.abs(exact[2]).max())
    assert np.isfinite(approx).all()
    for row in (0, 1):  # an approximation, not a no-op
        assert not np.allclose(exact[row], approx[row])
