"""DeepSeek-V3 in pure JAX: MLA with an absorbed latent KV cache, sigmoid group-limited MoE, dense first layers."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np

from djax.config import ModelConfig
from djax.models.layers import (
    apply_rope_interleaved,
    fp8_impl,
    linear,
    rms_norm,
    rope_cos_sin,
    rope_inv_freq,
    swiglu,
    yarn_mscale,
)
from djax.models.moe import moe_with_counts
from djax.params import Param, expert_weights, mlp_weights
from djax.params import linear_weight as _w
from djax.params import norm_weight as _norm
from djax.quant import dense

F32 = jnp.float32
NEG_INF = -jnp.inf


# ---- declaration -----------------------------------------------------------------------------------
def _attention(cfg: ModelConfig) -> dict:
    d, h, c, r = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    n, v = cfg.qk_nope_head_dim, cfg.v_head_dim
    return {
        "wq_a": _w(cfg.q_lora_rank, d, "q_lora", "embed"),
        "q_norm": _norm(cfg.q_lora_rank),
        "wq_b": _w(h * (n + r), cfg.q_lora_rank, "heads", "q_lora"),
        "wkv_a": _w(c + r, d, None, "embed"),  # latent then the shared rope key
        "kv_norm": _norm(c),
        "wkv_b": _w(h * (n + v), c, "heads", None),  # per head: n key rows then v value rows
        "wo": _w(d, h * v, "embed", "heads"),
    }


def _ffn(cfg: ModelConfig, layer: int) -> dict:
    d, f, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts
    if cfg.is_dense_layer(layer):
        fd = cfg.intermediate_size
        return mlp_weights(d, fd)
    fs = f * cfg.n_shared_experts
    return {
        "gate": {
            "weight": Param((e, d), ("experts_r", "embed")),
            "bias": Param((e,), (None,), "float32", "uniform"),
        },
        "experts": expert_weights(e, d, f),
        "shared_experts": mlp_weights(d, fs),
    }


def declare(cfg: ModelConfig, with_mtp: bool = True) -> dict:
    """Every weight, named as in DeepSeek's converted checkpoints (experts stacked on a leading axis).

    The MTP layer (`model.layers.{num_hidden_layers}` on disk) is not declared for V3: decoding does not
    use it, and `canonical_name(..., cfg)` skips its tensors. `with_mtp` is accepted for interface parity.
    """
    del with_mtp
    d, v = cfg.hidden_size, cfg.vocab_size
    return {
        "embed": {"weight": Param((v, d), ("vocab", "embed"))},
        "layers": [
            {"attn_norm": _norm(d), "ffn_norm": _norm(d), "attn": _attention(cfg), "ffn": _ffn(cfg, i)}
            for i in range(cfg.num_hidden_layers)
        ],
        "norm": _norm(d),
        "head": {"weight": Param((v, d), ("vocab", "embed"))},
    }


# ---- checkpoint names ------------------------------------------------------------------------------
# HF module name -> DeepSeek name (the same table as DeepSeek's inference/convert.py).
_RENAMES = {
    "self_attn": "attn",
    "mlp": "ffn",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "q_a_proj": "wq_a",
    "q_a_layernorm": "q_norm",
    "q_b_proj": "wq_b",
    "kv_a_proj_with_mqa": "wkv_a",
    "kv_a_layernorm": "kv_norm",
    "kv_b_proj": "wkv_b",
    "o_proj": "wo",
    "gate_proj": "w1",
    "down_proj": "w2",
    "up_proj": "w3",
    "e_score_correction_bias": "bias",
    "embed_tokens": "embed",
    "lm_head": "head",
}
_SKIP = re.compile(r"rotary_emb|inv_freq|(^|\.)(enorm|hnorm|eh_proj|shared_head)\.")
_EXPERT = re.compile(r"^(layers\.\d+\.ffn\.experts\.\d+\.w[123])\.weight$")


def canonical_name(hf_name: str, cfg: ModelConfig | None = None) -> str | None:
    """The dotted name in `declare`'s tree of a checkpoint tensor (HF or DeepSeek spelling); None = skip.

    Routed experts come per expert as `layers.N.ffn.experts.E.w1` (the loader stacks E into
    `layers.N.ffn.experts.w1`). FP8 scales (`*.weight_scale_inv` / `*.scale`) map to the weight's name
    plus `.scale`. With `cfg`, tensors of layers >= num_hidden_layers (the MTP layer) are skipped.
    """
    name = hf_name.removeprefix("model.")
    if _SKIP.search(name):
        return None
    scale = name.endswith(".weight_scale_inv") or name.endswith(".scale")
    name = re.sub(r"\.(weight_scale_inv|scale)$", ".weight", name)
    name = ".".join(_RENAMES.get(part, part) for part in name.split("."))
    m = re.match(r"layers\.(\d+)\.", name)
    if cfg is not None and m and int(m.group(1)) >= cfg.num_hidden_layers:
        return None
    e = _EXPERT.match(name)
    if e:
        name = e.group(1)
    return name + ".scale" if scale else name


# ---- rotary tables and softmax scale ------------------------------------------------------------------
def _rope(cfg: ModelConfig) -> tuple[np.ndarray, float]:
    """YaRN inverse frequencies over the rope dims and the cos/sin magnitude HF's YaRN applies."""
    inv = rope_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta, cfg, yarn=True)
    if cfg.rope_factor <= 1.0:
        return inv, 1.0
    f = cfg.rope_factor
    if cfg.mscale and cfg.mscale_all_dim:
        return inv, yarn_mscale(f, cfg.mscale) / yarn_mscale(f, cfg.mscale_all_dim)
    return inv, yarn_mscale(f)


def softmax_scale(cfg: ModelConfig) -> float:
    """1/sqrt(nope + rope), times mscale(factor, mscale_all_dim)^2 under YaRN (as HF and DeepSeek do)."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    if cfg.rope_factor > 1.0 and cfg.mscale_all_dim:
        scale *= yarn_mscale(cfg.rope_factor, cfg.mscale_all_dim) ** 2
    return scale


def _rotate(x: jax.Array, pos: jax.Array, cfg: ModelConfig, heads: bool) -> jax.Array:
    """Interleaved-pair rope on x's trailing rope dims at positions pos (x: [..., (h,) r], pos: x.shape[:-1 or -2])."""
    inv, mag = _rope(cfg)
    cos, sin = rope_cos_sin(pos, inv, mag)
    if heads:
        cos, sin = cos[..., None, :], sin[..., None, :]
    return apply_rope_interleaved(x, cos, sin)


# ---- MLA ------------------------------------------------------------------------------------------------
def _project(p: dict, x: jax.Array, pos: jax.Array, cfg: ModelConfig, fp8: str | None = None):
    """x [..., d] -> q_nope [..., h, n], q_rope [..., h, r] (roped), latent [..., c] (normed), k_rope [..., r].
    `fp8`: how FP8 projections run (`layers.linear`)."""
    h, n, r, c = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    q = rms_norm(linear(x, p["wq_a"]["weight"], fp8), p["q_norm"]["weight"], cfg.rms_norm_eps)
    q = linear(q, p["wq_b"]["weight"], fp8).reshape(*x.shape[:-1], h, n + r)
    q_nope, q_rope = q[..., :n], _rotate(q[..., n:], pos, cfg, heads=True)
    kv = linear(x, p["wkv_a"]["weight"], fp8)  # [..., c + r]
    latent = rms_norm(kv[..., :c], p["kv_norm"]["weight"], cfg.rms_norm_eps)
    k_rope = _rotate(kv[..., c:], pos, cfg, heads=False)
    return q_nope, q_rope, latent, k_rope


def _wkv_b(p: dict, cfg: ModelConfig, dtype) -> tuple[jax.Array, jax.Array]:
    """wkv_b split per head into its key half [h, n, c] and value half [h, v, c]."""
    w = dense(p["wkv_b"]["weight"], dtype).reshape(cfg.num_attention_heads, -1, cfg.kv_lora_rank)
    return w[:, : cfg.qk_nope_head_dim], w[:, cfg.qk_nope_head_dim :]


def attention_sequence(p: dict, x: jax.Array, cfg: ModelConfig, fp8: str | None = None):
    """Causal MLA over x [b, t, d] from position 0, keys and values expanded per head (the reference form).
    `fp8`: how FP8 projections run (`layers.linear`; wkv_b, used per head, is made dense).

    Returns (out [b, t, d], latent [b, t, c], k_rope [b, t, r]) — the last two are what the cache keeps.
    """
    b, t, _ = x.shape
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    q_nope, q_rope, latent, k_rope = _project(p, x, pos, cfg, fp8)
    w_k, w_v = _wkv_b(p, cfg, x.dtype)
    k_nope = jnp.einsum("bsc,hnc->bshn", latent, w_k)  # [b, s, h, n]
    values = jnp.einsum("bsc,hvc->bshv", latent, w_v)  # [b, s, h, v]
    logits = jnp.einsum("bthn,bshn->bhts", q_nope.astype(F32), k_nope.astype(F32))
    logits += jnp.einsum("bthr,bsr->bhts", q_rope.astype(F32), k_rope.astype(F32))
    causal = jnp.arange(t)[None, :] <= jnp.arange(t)[:, None]  # [t, s]
    probs = jax.nn.softmax(jnp.where(causal, logits * softmax_scale(cfg), NEG_INF), axis=-1)
    o = jnp.einsum("bhts,bshv->bthv", probs, values.astype(F32)).astype(x.dtype)  # [b, t, h, v]
    return linear(o.reshape(b, t, -1), p["wo"]["weight"], fp8), latent, k_rope


def attention_decode(
    p: dict, x: jax.Array, st: dict, pos: jax.Array, cfg: ModelConfig, fp8: str | None = None
):
    """One token per row, absorbed form. x: [b, d]; pos: int[b]. Returns (out [b, d], updated layer state).

    q_nope goes through wkv_b's key half into latent space, attention runs over the latent cache, and the
    latent-space output goes through wkv_b's value half: no per-head keys or values are ever built.
    `fp8`: how FP8 projections run (`layers.linear`; wkv_b, used per head, is made dense).
    """
    b = x.shape[0]
    q_nope, q_rope, latent, k_rope = _project(p, x, pos, cfg, fp8)  # [b, h, n], [b, h, r], [b, c], [b, r]
    rows = jnp.arange(b)
    cache_lat = st["kv_latent"].at[rows, pos].set(latent.astype(st["kv_latent"].dtype))  # [b, s, c]
    cache_rope = st["k_rope"].at[rows, pos].set(k_rope.astype(st["k_rope"].dtype))  # [b, s, r]
    w_k, w_v = _wkv_b(p, cfg, x.dtype)
    q_lat = jnp.einsum("bhn,hnc->bhc", q_nope, w_k)  # [b, h, c]
    logits = jnp.einsum("bhc,bsc->bhs", q_lat.astype(F32), cache_lat.astype(F32))
    logits += jnp.einsum("bhr,bsr->bhs", q_rope.astype(F32), cache_rope.astype(F32))
    visible = jnp.arange(cache_lat.shape[1])[None, :] <= pos[:, None]  # [b, s]
    probs = jax.nn.softmax(jnp.where(visible[:, None], logits * softmax_scale(cfg), NEG_INF), axis=-1)
    o_lat = jnp.einsum("bhs,bsc->bhc", probs, cache_lat.astype(F32)).astype(x.dtype)  # [b, h, c]
    o = jnp.einsum("bhc,hvc->bhv", o_lat, w_v)  # [b, h, v]
    return linear(o.reshape(b, -1), p["wo"]["weight"], fp8), {"kv_latent": cache_lat, "k_rope": cache_rope}


# ---- the whole model -----------------------------------------------------------------------------------
def _ffn_block(lp: dict, x: jax.Array, cfg: ModelConfig, moe_impl: str, fp8: str | None = None) -> jax.Array:
    """`fp8`: how FP8 weights in DeepGEMM's layout run (`moe.moe_with_counts`, `layers.swiglu`)."""
    y = rms_norm(x, lp["ffn_norm"]["weight"], cfg.rms_norm_eps)
    f = lp["ffn"]
    if "experts" in f:
        return x + moe_with_counts(y, f, cfg, None, moe_impl, fp8=fp8)[0]
    return x + swiglu(y, f["w1"]["weight"], f["w2"]["weight"], f["w3"]["weight"], fp8=fp8)


def _logits(params: dict, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    x = rms_norm(x, params["norm"]["weight"], cfg.rms_norm_eps)
    return linear(x, params["head"]["weight"]).astype(F32)


def _embed(params: dict, tokens: jax.Array, cfg: ModelConfig) -> jax.Array:
    return dense(params["embed"]["weight"], jnp.dtype(cfg.dtype))[tokens]


def hidden_sequence(
    params: dict, tokens: jax.Array, cfg: ModelConfig, moe_impl: str = "grouped", kernels: str = "auto"
):
    """Every layer over tokens int[b, t] from position 0. Returns (hidden [b, t, d], [(latent, k_rope)] per layer).
    kernels ("auto", "ref", "off": `layers.KERNEL_CHOICES`): how the FP8 weights in DeepGEMM's layout run."""
    x = _embed(params, tokens, cfg)  # [b, t, d]
    fp8 = fp8_impl(x.dtype, kernels)
    caches = []
    for i, lp in enumerate(params["layers"]):
        with jax.named_scope(f"layer{i}"):
            y, latent, k_rope = attention_sequence(
                lp["attn"], rms_norm(x, lp["attn_norm"]["weight"], cfg.rms_norm_eps), cfg, fp8
            )
            x = _ffn_block(lp, x + y, cfg, moe_impl, fp8)
            caches.append((latent, k_rope))
    return x, caches


def forward(
    params: dict, tokens: jax.Array, cfg: ModelConfig, moe_impl: str = "grouped", kernels: str = "auto"
) -> jax.Array:
    """Teacher-forced logits f32[b, t, vocab] for tokens int[b, t] (no cache); `kernels` as `hidden_sequence`."""
    x, _ = hidden_sequence(params, tokens, cfg, moe_impl, kernels)
    return _logits(params, x, cfg)


# ---- decoder state ---------------------------------------------------------------------------------------
def init_state(cfg: ModelConfig, batch: int, max_len: int) -> dict:
    """Zeroed state: per layer the normed latent [b, max_len, kv_lora_rank] and roped key [b, max_len, r].

    Slot s of row r holds position s; slots >= lengths[r] are never attended to.
    """
    dt = jnp.dtype(cfg.dtype)
    layers = [
        {
            "kv_latent": jnp.zeros((batch, max_len, cfg.kv_lora_rank), dt),
            "k_rope": jnp.zeros((batch, max_len, cfg.qk_rope_head_dim), dt),
        }
        for _ in range(cfg.num_hidden_layers)
    ]
    return {"layers": layers, "lengths": jnp.zeros((batch,), jnp.int32)}


def prefill(
    params: dict,
    tokens: jax.Array,
    lengths: jax.Array,
    cfg: ModelConfig,
    max_len: int,
    moe_impl="grouped",
    kernels: str = "auto",
):
    """Run right-padded prompts tokens int[b, t] with true lengths int[b]; return (logits f32[b, v] at lengths-1, state).

    The state holds max(max_len, t) positions; the padding's entries are written but stay invisible.
    `kernels` as `hidden_sequence`.
    """
    b, t = tokens.shape
    x, caches = hidden_sequence(params, tokens, cfg, moe_impl, kernels)
    last = jnp.take_along_axis(x, (lengths - 1)[:, None, None], axis=1)[:, 0]  # [b, d]
    state = init_state(cfg, b, max(max_len, t))
    for st, (latent, k_rope) in zip(state["layers"], caches):
        st["kv_latent"] = st["kv_latent"].at[:, :t].set(latent.astype(st["kv_latent"].dtype))
        st["k_rope"] = st["k_rope"].at[:, :t].set(k_rope.astype(st["k_rope"].dtype))
    state["lengths"] = lengths.astype(jnp.int32)
    return _logits(params, last, cfg), state


def decode_step(
    params: dict,
    tokens: jax.Array,
    state: dict,
    cfg: ModelConfig,
    moe_impl: str = "grouped",
    kernels: str = "auto",
):
    """Feed tokens int[b] at positions state['lengths']; return (logits f32[b, v], state with lengths + 1).

    kernels ("auto", "ref", "off": `layers.KERNEL_CHOICES`): how the FP8 weights in DeepGEMM's layout run
    (projections through `fp8_gemm`, routed experts through the FP8 grouped GEMMs); the attention is jnp."""
    pos = state["lengths"]
    x = _embed(params, tokens, cfg)  # [b, d]
    fp8 = fp8_impl(x.dtype, kernels)
    new_layers = []
    for i, (lp, st) in enumerate(zip(params["layers"], state["layers"])):
        with jax.named_scope(f"layer{i}"):
            y, st = attention_decode(
                lp["attn"], rms_norm(x, lp["attn_norm"]["weight"], cfg.rms_norm_eps), st, pos, cfg, fp8
            )
            x = _ffn_block(lp, x + y, cfg, moe_impl, fp8)
            new_layers.append(st)
    return _logits(params, x, cfg), {"layers": new_layers, "lengths": pos + 1}
