"""DSpark drafter (DeepSeek-V4.1) as a model part: three sliding-window blocks fed by the target's features.

Every committed position p has one key row per drafter layer, projected from
main_x[p] = main_norm(main_proj(concat_l mean_streams(attention input of target layer l at p))).
A proposal feeds the block [anchor, noise, ..., noise] at positions L .. L + B - 1: each query sees
the committed rows in its window and every block position (the block attends both ways). The
shared head gives per-position logits; the Markov head adds a rank-r bigram bias from the
previous token (the anchor, then each drafted token), and the confidence head scores each position.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from djax.config import SLIDING, ModelConfig
from djax.models import deepseek_v4 as v4
from djax.models.layers import linear, rms_norm
from djax.models.moe import moe

F32 = jnp.float32


def declare_drafter(cfg: ModelConfig) -> list[dict]:
    """The `mtp.N` layers: sliding-window blocks with a dspark_n_routed_experts MoE, plus their heads."""
    d, v, r = cfg.hidden_size, cfg.vocab_size, cfg.dspark_markov_rank
    layers = [
        v4._block(cfg, 0, SLIDING, False, -1, cfg.dspark_n_routed_experts)
        for _ in range(cfg.num_nextn_predict_layers)
    ]
    t = len(cfg.dspark_target_layer_ids)
    layers[0].update(main_proj=v4._w(d, t * d, "embed", None), main_norm=v4._norm(d))
    layers[-1].update(
        norm=v4._norm(d),
        markov_head={"embed": v4._w(v, r, "vocab", None), "head": v4._w(v, r, "vocab", None)},
        confidence_head={"proj": v4._w(1, d + r, None, None)},
    )
    return layers


def _draft_cfg(cfg: ModelConfig) -> ModelConfig:
    return cfg.replace(num_experts_per_tok=cfg.dspark_num_experts_per_tok)


def init_draft_state(cfg: ModelConfig, batch: int) -> dict:
    """Per drafter layer a ring "window" [b, sliding_window, k] of committed key rows; "lengths" int32[b]."""
    dt = jnp.dtype(cfg.dtype)
    rings = [
        jnp.zeros((batch, cfg.sliding_window, cfg.head_dim), dt) for _ in range(cfg.num_nextn_predict_layers)
    ]
    return {"layers": rings, "lengths": jnp.zeros((batch,), jnp.int32)}


def main_features(mtp: list, aux: dict, cfg: ModelConfig) -> jax.Array:
    """main_x [b, c, d] from the target layers' mean attention inputs (`run_layers`' third output)."""
    cat = jnp.concatenate([aux[i] for i in cfg.dspark_target_layer_ids], axis=-1)
    return rms_norm(
        linear(cat, mtp[0]["main_proj"]["weight"]), mtp[0]["main_norm"]["weight"], cfg.rms_norm_eps
    )


def commit(mtp: list, main_x: jax.Array, dstate: dict, valid: jax.Array, cfg: ModelConfig) -> dict:
    """Write the key rows of c committed positions (main_x [b, c, d], first valid[b] real) into the rings."""
    pos0 = dstate["lengths"]
    pos = pos0[:, None] + jnp.arange(main_x.shape[1])
    inv = v4._rope(cfg, SLIDING)
    rings = []
    for lp, ring in zip(mtp, dstate["layers"]):
        kv = rms_norm(
            linear(main_x, lp["attn"]["wkv"]["weight"]), lp["attn"]["kv_norm"]["weight"], cfg.rms_norm_eps
        )
        kv = v4._rotate(kv, pos, inv, heads=False)
        w = ring.shape[1]
        rows = v4.ring_then(ring, pos0 - w, kv)
        rings.append(v4._place_ring(v4.refill_ring(rows, valid, w), pos0 + valid - w))
    return {"layers": rings, "lengths": pos0 + valid}


def _attend(p: dict, x: jax.Array, ring: jax.Array, pos0: jax.Array, cfg: ModelConfig) -> jax.Array:
    b, c, _ = x.shape
    inv = v4._rope(cfg, SLIDING)
    pos = pos0[:, None] + jnp.arange(c)
    _, q, kv = v4._q_kv(p, x, pos, cfg, inv)
    w = ring.shape[1]
    keys = v4.ring_then(ring, pos0 - w, kv)
    kpos = pos0[:, None] - w + jnp.arange(w)
    past = (kpos >= 0)[:, None, :] & (pos[:, :, None] - kpos[:, None, :] < cfg.sliding_window)
    mask = jnp.concatenate([past, jnp.ones((b, c, c), bool)], axis=-1)  # the block attends both ways
    logits = jnp.einsum("bthk,bsk->bhts", q.astype(F32), keys.astype(F32)) * cfg.head_dim**-0.5
    probs = v4._softmax_with_sink(jnp.where(mask[:, None], logits, -jnp.inf), p["attn_sink"])
    o = jnp.einsum("bhts,bsk->bthk", probs, keys.astype(F32)).astype(x.dtype)
    return v4._output(p, o, pos, cfg, inv)


def draft(params: dict, anchor: jax.Array, dstate: dict, cfg: ModelConfig, moe_impl: str = "grouped"):
    """One proposal of dspark_block_size positions after the committed ones.

    anchor int[b]: the token just produced by the target (not yet committed). Returns (logits
    f32[b, B, vocab] with the Markov bias, greedy tokens int32[b, B], confidence f32[b, B] in (0, 1)).
    """
    mtp, dc = params["mtp"], _draft_cfg(cfg)
    b, bs = anchor.shape[0], cfg.dspark_block_size
    tokens = jnp.concatenate(
        [anchor[:, None], jnp.full((b, bs - 1), cfg.dspark_noise_token_id, anchor.dtype)], 1
    )
    h = v4._embed(params, tokens, cfg)
    pre = jnp.full((b, bs, cfg.hc_mult), 1.0 / cfg.hc_mult, F32)
    for lp, ring in zip(mtp, dstate["layers"]):
        x, post, comb, pre = v4._sublayer_mix(h, pre, lp, "hc_attn", cfg)
        y = _attend(
            lp["attn"], rms_norm(x, lp["attn_norm"]["weight"], cfg.rms_norm_eps), ring, dstate["lengths"], cfg
        )
        h = v4.hc_post(y, h, post, comb)
        x, post, comb, pre = v4._sublayer_mix(h, pre, lp, "hc_ffn", cfg)
        h = v4.hc_post(
            moe(rms_norm(x, lp["ffn_norm"]["weight"], cfg.rms_norm_eps), lp["ffn"], dc, tokens, moe_impl),
            h,
            post,
            comb,
        )
    last = mtp[-1]
    hid = rms_norm(
        jnp.sum(pre[..., None] * h, axis=-2).astype(h.dtype), last["norm"]["weight"], cfg.rms_norm_eps
    )
    base = linear(hid, params["head"]["weight"]).astype(F32)  # [b, B, V]
    mk = last["markov_head"]

    def step(prev, j):
        e = mk["embed"]["weight"][prev].astype(F32)  # [b, r]
        lg = base[:, j] + e @ mk["head"]["weight"].astype(F32).T
        conf = jax.nn.sigmoid(
            jnp.concatenate([hid[:, j].astype(F32), e], -1)
            @ last["confidence_head"]["proj"]["weight"].astype(F32).T
        )[:, 0]
        tok = jnp.argmax(lg, -1).astype(jnp.int32)
        return tok, (lg, tok, conf)

    _, (lg, tok, conf) = jax.lax.scan(step, anchor.astype(jnp.int32), jnp.arange(bs))
    return jnp.moveaxis(lg, 0, 1), tok.T, conf.T
