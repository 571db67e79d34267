"""V4.1 compressor (pair mean, one latent per token) and two-level top-k against brute-force numpy."""

import jax
import jax.numpy as jnp
import numpy as np

import djax
from djax.config import preset
from djax.models import deepseek_v4 as v4


def _rms(x, w, eps):
    return w * x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps)


def _np_pool(x, wkv, wgate, norm, ratio, eps):
    """Brute force: entry w = rmsnorm(sum_j softmax_j(gate[wm + j]) * kv[wm + j]) per channel."""
    kv, gate = x @ wkv.T, (x @ wgate.T if wgate is not None else np.zeros((x.shape[0], wkv.shape[0])))
    out = []
    for w in range(x.shape[0] // ratio):
        g = gate[w * ratio : (w + 1) * ratio]
        e = np.exp(g - g.max(0))
        out.append(_rms((e / e.sum(0) * kv[w * ratio : (w + 1) * ratio]).sum(0), norm, eps))
    return np.stack(out)


def test_pair_mean_and_per_token_compressors_match_numpy():
    cfg = preset("tiny-v41")
    params = djax.init_params(cfg, jax.random.key(0))
    b, t = 2, 11
    x = jax.random.normal(jax.random.key(5), (b, t, cfg.hidden_size))
    for layer, ratio in ((1, 2), (3, 1)):
        p = params["layers"][layer]["attn"]["compressor"]
        st = v4.init_state(cfg, b, 16)["layers"][layer]
        st = dict(st)
        ix = params["layers"][layer]["attn"]["indexer"]
        v4.compressor_extend(
            p, x, st, ("pool", "ring_kv", "ring_gate"), jnp.zeros(b, jnp.int32), jnp.full(b, t, jnp.int32),
            cfg, ratio, False, cfg.head_dim, index=(ix["wk"], ix["k_norm"]),
        )  # fmt: skip
        n = t // ratio
        wg = np.asarray(p["wgate"]["weight"]) if "wgate" in p else None
        for r in range(b):
            want = _np_pool(np.asarray(x[r]), np.asarray(p["wkv"]["weight"]), wg, np.asarray(p["norm"]["weight"]),
                            ratio, cfg.rms_norm_eps)  # fmt: skip
            pos = jnp.arange(n) * ratio
            want = np.asarray(v4._rotate(jnp.asarray(want), pos, v4._rope(cfg, v4.CSA), heads=False))
            np.testing.assert_allclose(np.asarray(st["pool"][r, :n]), want, rtol=1e-5, atol=1e-5)
            assert not np.asarray(st["pool"][r, n:]).any()  # the open window is not written


def test_compressor_projections_pass_a_barrier():
    """The compressor's projections (kv and gate, or kv alone at ratio 1) pass one optimization barrier before
    the gathers that read every ring slot, so that an FP8 GEMM's split-K sum is not fused into them (on a GPU
    XLA then summed the splits again for each element of the windows and the new ring)."""
    cfg = preset("tiny-v41")
    params = djax.init_params(cfg, jax.random.key(0))
    b = 2
    x = jax.random.normal(jax.random.key(5), (b, 1, cfg.hidden_size))
    for layer, ratio in ((1, 2), (3, 1)):
        p = params["layers"][layer]["attn"]["compressor"]
        st = dict(v4.init_state(cfg, b, 16)["layers"][layer])

        def extend(x, st, p=p, ratio=ratio):
            st = dict(st)
            v4.compressor_extend(
                p, x, st, ("pool", "ring_kv", "ring_gate"), jnp.full(b, 5, jnp.int32), jnp.ones(b, jnp.int32),
                cfg, ratio, False, cfg.head_dim,
            )  # fmt: skip
            return st

        eqns = jax.make_jaxpr(extend)(x, st).jaxpr.eqns
        barriers = [e for e in eqns if e.primitive.name == "optimization_barrier"]
        assert len(barriers) == 1, (layer, len(barriers))
        assert len(barriers[0].invars) == (2 if "wgate" in p else 1)


def _np_two_level(scores, visible, blocks, block_size, k, candidates=None):
    """Brute force per query: blocks ranked by their best visible score; top-k inside the kept ones."""
    cap = scores.shape[-1]
    s = np.where(visible, scores, -np.inf)
    if candidates is not None:
        s = np.where(candidates, s, -np.inf)
    best = [max(s[i : i + block_size]) for i in range(0, cap, block_size)]
    order = sorted(range(len(best)), key=lambda i: -best[i])[:blocks]
    cand = np.zeros(cap, bool)
    for blk in order:
        if np.isfinite(best[blk]):
            cand[blk * block_size : (blk + 1) * block_size] = True
    chosen = [i for i in sorted(range(cap), key=lambda i: -s[i])[:k] if np.isfinite(s[i])]
    return cand, set(chosen)


def test_two_level_topk_matches_brute_force():
    cfg = preset("tiny-v41", candidate_topk_blocks=3, candidate_block_size=4, index_topk=5)
    rng = np.random.default_rng(7)
    b, t, cap = 2, 6, 37
    scores = rng.standard_normal((b, t, cap)).astype(np.float32)
    visible = np.arange(cap)[None, None] < rng.integers(1, cap + 1, (b, t, 1))
    s = jnp.where(jnp.asarray(visible), jnp.asarray(scores), -jnp.inf)
    cand = np.asarray(v4._candidate_blocks(s, cfg))
    top, ok = v4.select_entries(jnp.where(jnp.asarray(cand), s, -jnp.inf), cfg.index_topk)
    top, ok = np.asarray(top), np.asarray(ok)
    for r in range(b):
        for q in range(t):
            want_cand, _ = _np_two_level(scores[r, q], visible[r, q], 3, 4, 5)
            np.testing.assert_array_equal(cand[r, q], want_cand)
            _, want = _np_two_level(scores[r, q], visible[r, q], 3, 4, 5, candidates=want_cand)
            assert set(top[r, q][ok[r, q]].tolist()) == want
