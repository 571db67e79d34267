"""DeepSeek-V4 in pure JAX: declaration, teacher-forced forward, prefill into a decoder state, one-token decode.

Layer i attends over a sliding window of the last `sliding_window` tokens (its own "window" ring)
and, when `compress_ratios[i] = m > 0`, over compressed entries: entry w pools tokens
[w m, (w + 1) m) (CSA, m = 4: also the previous window, through a second projection) and is
visible to query t only when w < (t + 1) // m. CSA layers pick their entries with a lightning
indexer (own compressor at index_head_dim, top `index_topk`); HCA layers see all visible entries.
The residual is `hc_mult` streams mixed by mHC around every block.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from djax.config import CSA, SLIDING, ModelConfig
from djax.models.layers import (
    apply_rope_interleaved,
    linear,
    rms_norm,
    rope_cos_sin,
    rope_inv_freq,
    unit_rms_norm,
)
from djax.models.mhc import hc_head, hc_post, hc_pre
from djax.models.moe import moe
from djax.params import Param
from djax.quant import dense

F32 = jnp.float32
NEG_INF = -jnp.inf


# ---- declaration -----------------------------------------------------------------------------------
def _w(o: int, i: int, ax_o: str | None, ax_i: str | None) -> dict:
    return {"weight": Param((o, i), (ax_o, ax_i))}


def _norm(n: int) -> dict:
    return {"weight": Param((n,), (None,), "float32", "ones")}


def _compressor(cfg: ModelConfig, ratio: int, width: int, overlap: bool) -> dict:
    c = 2 if overlap else 1
    d = cfg.hidden_size
    return {
        "wkv": _w(c * width, d, None, "embed"),
        "wgate": _w(c * width, d, None, "embed"),
        "ape": Param((ratio, c * width), (None, None), "float32", "uniform"),
        "norm": _norm(width),
    }


def _attention(cfg: ModelConfig, ratio: int, layer_type: str) -> dict:
    d, h, k = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    g, ol = cfg.o_groups, cfg.o_lora_rank
    p = {
        "wq_a": _w(cfg.q_lora_rank, d, "q_lora", "embed"),
        "q_norm": _norm(cfg.q_lora_rank),
        "wq_b": _w(h * k, cfg.q_lora_rank, "heads", "q_lora"),
        "wkv": _w(k, d, None, "embed"),
        "kv_norm": _norm(k),
        "wo_a": _w(g * ol, h * k // g, "o_lora", "heads"),
        "wo_b": _w(d, g * ol, "embed", "o_lora"),
        "attn_sink": Param((h,), (None,), "float32", "uniform"),
    }
    if ratio:
        p["compressor"] = _compressor(cfg, ratio, k, overlap=layer_type == CSA)
    if layer_type == CSA:
        p["indexer"] = {
            "wq_b": _w(cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank, None, "q_lora"),
            "weights_proj": _w(cfg.index_n_heads, d, None, "embed"),
            "compressor": _compressor(cfg, ratio, cfg.index_head_dim, overlap=True),
        }
    return p


def _ffn(cfg: ModelConfig, hashed: bool) -> dict:
    d, f, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts
    gate = {"weight": Param((e, d), ("experts_r", "embed"))}
    if hashed:
        gate["tid2eid"] = Param(
            (cfg.vocab_size, cfg.num_experts_per_tok), ("vocab", None), "int32", "hash", e
        )
    else:
        gate["bias"] = Param((e,), (None,), "float32", "uniform")
    fs = f * cfg.n_shared_experts
    return {
        "gate": gate,
        "experts": {
            "w1": Param((e, f, d), ("experts", "expert_mlp", "embed")),
            "w2": Param((e, d, f), ("experts", "embed", "expert_mlp")),
            "w3": Param((e, f, d), ("experts", "expert_mlp", "embed")),
        },
        "shared_experts": {
            "w1": _w(fs, d, "mlp", "embed"),
            "w2": _w(d, fs, "embed", "mlp"),
            "w3": _w(fs, d, "mlp", "embed"),
        },
    }


def _hc(cfg: ModelConfig, prefix: str) -> dict:
    n, d = cfg.hc_mult, cfg.hidden_size
    m = (2 + n) * n
    return {
        f"{prefix}_fn": Param((m, n * d), (None, None), "float32"),
        f"{prefix}_base": Param((m,), (None,), "float32", "uniform"),
        f"{prefix}_scale": Param((3,), (None,), "float32", "ones"),
    }


def _block(cfg: ModelConfig, ratio: int, layer_type: str, hashed: bool) -> dict:
    d = cfg.hidden_size
    return {
        "attn_norm": _norm(d),
        "ffn_norm": _norm(d),
        "attn": _attention(cfg, ratio, layer_type),
        "ffn": _ffn(cfg, hashed),
        **_hc(cfg, "hc_attn"),
        **_hc(cfg, "hc_ffn"),
    }


def _head_hc(cfg: ModelConfig, prefix: str) -> dict:
    n, d = cfg.hc_mult, cfg.hidden_size
    return {
        f"{prefix}_fn": Param((n, n * d), (None, None), "float32"),
        f"{prefix}_base": Param((n,), (None,), "float32", "uniform"),
        f"{prefix}_scale": Param((1,), (None,), "float32", "ones"),
    }


def declare(cfg: ModelConfig, with_mtp: bool = True) -> dict:
    """Every weight of the model, named as in DeepSeek's checkpoints (experts stacked on a leading axis)."""
    d, v = cfg.hidden_size, cfg.vocab_size
    tree = {
        "embed": {"weight": Param((v, d), ("vocab", "embed"))},
        "layers": [
            _block(cfg, cfg.compress_ratios[i], cfg.layer_type(i), cfg.is_hash_layer(i))
            for i in range(cfg.num_hidden_layers)
        ],
        "norm": _norm(d),
        "head": {"weight": Param((v, d), ("vocab", "embed"))},
        **_head_hc(cfg, "hc_head"),
    }
    if with_mtp and cfg.num_nextn_predict_layers:
        # The multi-token-prediction layer(s): a sliding-window block fed by the embedding of the next
        # token and the main model's last hidden streams. Declared and loaded; not used for decoding yet.
        tree["mtp"] = [
            {
                **_block(cfg, 0, SLIDING, False),
                "e_proj": _w(d, d, "embed", None),
                "h_proj": _w(d, d, "embed", None),
                "enorm": _norm(d),
                "hnorm": _norm(d),
                "norm": _norm(d),
                **_head_hc(cfg, "hc_head"),
            }
            for _ in range(cfg.num_nextn_predict_layers)
        ]
    return tree


# ---- rotary tables -------------------------------------------------------------------------------
def _rope(cfg: ModelConfig, layer_type: str) -> np.ndarray:
    """Sliding-only layers: plain RoPE at rope_theta. Compressed layers: YaRN at compress_rope_theta."""
    if layer_type == SLIDING:
        return rope_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta)
    return rope_inv_freq(cfg.qk_rope_head_dim, cfg.compress_rope_theta, cfg, yarn=True)


def _rotate(
    x: jax.Array, pos: jax.Array, inv_freq: np.ndarray, heads: bool, inverse: bool = False
) -> jax.Array:
    """Rope on the trailing rope dims of x at integer positions `pos` (x: [..., (h,) k], pos: x.shape[:-1 or -2])."""
    cos, sin = rope_cos_sin(pos, inv_freq)
    if inverse:
        sin = -sin
    if heads:
        cos, sin = cos[..., None, :], sin[..., None, :]
    return apply_rope_interleaved(x, cos.astype(x.dtype).astype(F32), sin.astype(x.dtype).astype(F32))


# ---- positions held by rings ------------------------------------------------------------------------------
def ordered_ring(ring: jax.Array, start: jax.Array) -> jax.Array:
    """A ring [b, R, ...] (slot = position % R) as the R positions start .. start + R - 1 in order."""
    r = ring.shape[1]
    slots = jnp.mod(start[:, None] + jnp.arange(r), r)
    return jnp.take_along_axis(ring, slots.reshape(*slots.shape, *([1] * (ring.ndim - 2))), axis=1)


def refill_ring(seq: jax.Array, first: jax.Array, size: int) -> jax.Array:
    """The ring of `size` slots holding seq[:, first : first + size] (seq position index + offset = slot order)."""
    idx = first[:, None] + jnp.arange(size)  # [b, size], indices into seq
    rows = jnp.take_along_axis(seq, jnp.clip(idx, 0, seq.shape[1] - 1)[..., None], axis=1)
    return rows


def _place_ring(rows: jax.Array, first_pos: jax.Array) -> jax.Array:
    """Put rows [b, R, c] holding positions first_pos .. first_pos + R - 1 into their slots (position % R)."""
    r = rows.shape[1]
    slots = jnp.mod(first_pos[:, None] + jnp.arange(r), r)
    return jnp.zeros_like(rows).at[jnp.arange(rows.shape[0])[:, None], slots].set(rows)


# ---- compressor: softmax-gated pooling of windows ---------------------------------------------------------
def pool_windows(kv: jax.Array, gate: jax.Array, norm_w: jax.Array, eps: float) -> jax.Array:
    """One compressed entry per window. kv: [..., L, k]; gate: f32[..., L, k] (ape added, -inf = absent)."""
    wts = jax.nn.softmax(gate, axis=-2).astype(kv.dtype)
    return rms_norm(jnp.sum(kv * wts, axis=-2), norm_w, eps)


def compressor_extend(
    p: dict, x, st: dict, names, pos0, valid, cfg: ModelConfig, ratio: int, overlap: bool, width: int
):
    """Feed the chunk x [b, c, d] (positions pos0 + j, the first `valid` real) to one compressor.

    The compressor's ring keeps the raw projections of the last R positions (R = 2 ratio with
    overlap, else ratio): enough to close any window that ends inside the chunk. Entry w pools
    window w (and, with overlap, window w - 1's first half-projection) and is written to the pool
    once position (w + 1) ratio - 1 has been seen. Updates st in place (a dict copy).
    """
    pool_k, kv_k, gate_k = names
    b, c, _ = x.shape
    ring = st[kv_k].shape[1]
    m = ratio
    raw_kv = linear(x, p["wkv"]["weight"]).astype(st[kv_k].dtype)
    raw_gate = linear(x, p["wgate"]["weight"]).astype(st[gate_k].dtype)
    start = pos0 - ring  # position of combined index 0
    comb_kv = jnp.concatenate([ordered_ring(st[kv_k], start), raw_kv], axis=1)  # [b, R + c, C]
    comb_gate = jnp.concatenate([ordered_ring(st[gate_k], start), raw_gate], axis=1)
    nw = -(-c // m) + 1  # windows that can close inside this chunk
    w = pos0[:, None] // m + jnp.arange(nw)  # [b, nw]
    cur = (w * m - start[:, None])[..., None] + jnp.arange(m)  # [b, nw, m] combined indices

    def take(a, idx):
        flat = jnp.clip(idx, 0, a.shape[1] - 1).reshape(b, -1)
        return jnp.take_along_axis(a, flat[..., None], axis=1).reshape(*idx.shape, a.shape[-1])

    kv, gate = take(comb_kv, cur), take(comb_gate, cur).astype(F32) + p["ape"]
    if overlap:
        prev_kv, prev_gate = take(comb_kv, cur - m), take(comb_gate, cur - m).astype(F32) + p["ape"]
        prev_gate = jnp.where((w > 0)[..., None, None], prev_gate[..., :width], NEG_INF)
        kv = jnp.concatenate([prev_kv[..., :width], kv[..., width:]], axis=2)
        gate = jnp.concatenate([prev_gate, gate[..., width:]], axis=2)
    entries = pool_windows(kv, gate, p["norm"]["weight"], cfg.rms_norm_eps)  # [b, nw, width]
    entries = _rotate(entries, w * m, _rope(cfg, CSA), heads=False)
    closes = (w + 1) * m <= (pos0 + valid)[:, None]
    rows = jnp.arange(b)[:, None]
    pool = st[pool_k]
    target = jnp.where(closes, w, pool.shape[1])  # out of range: dropped
    st[pool_k] = pool.at[rows, target].set(entries.astype(pool.dtype), mode="drop")
    first = valid  # the new ring holds positions pos0 + valid - R .. pos0 + valid - 1
    st[kv_k] = _place_ring(refill_ring(comb_kv, first, ring), pos0 + valid - ring)
    st[gate_k] = _place_ring(refill_ring(comb_gate, first, ring), pos0 + valid - ring)


# ---- lightning indexer ------------------------------------------------------------------------------
def index_scores(q: jax.Array, keys: jax.Array, weights: jax.Array, cfg: ModelConfig) -> jax.Array:
    """sum_h w[h] relu(q_h . k) scaled. q: [b, t, H, c]; keys: [b, C, c]; weights: [b, t, H] -> f32[b, t, C]."""
    s = jnp.einsum("bthc,bsc->bths", q.astype(F32), keys.astype(F32))
    s = jax.nn.relu(s) * cfg.index_head_dim**-0.5
    w = weights.astype(F32) * cfg.index_n_heads**-0.5
    return jnp.einsum("bths,bth->bts", s, w)


def _indexer_query(p: dict, x: jax.Array, q_res: jax.Array, pos: jax.Array, cfg: ModelConfig):
    q = linear(q_res, p["wq_b"]["weight"])
    q = q.reshape(*q.shape[:-1], cfg.index_n_heads, cfg.index_head_dim)
    q = _rotate(q, pos, _rope(cfg, CSA), heads=True)
    return q, linear(x, p["weights_proj"]["weight"])


# ---- attention ----------------------------------------------------------------------------------------------
def _q_kv(p: dict, x: jax.Array, pos: jax.Array, cfg: ModelConfig, inv_freq):
    h, k = cfg.num_attention_heads, cfg.head_dim
    q_res = rms_norm(linear(x, p["wq_a"]["weight"]), p["q_norm"]["weight"], cfg.rms_norm_eps)
    q = linear(q_res, p["wq_b"]["weight"]).reshape(*x.shape[:-1], h, k)
    q = _rotate(unit_rms_norm(q, cfg.rms_norm_eps), pos, inv_freq, heads=True)
    kv = rms_norm(linear(x, p["wkv"]["weight"]), p["kv_norm"]["weight"], cfg.rms_norm_eps)
    kv = _rotate(kv, pos, inv_freq, heads=False)
    return q_res, q, kv


def _output(p: dict, o: jax.Array, pos: jax.Array, cfg: ModelConfig, inv_freq) -> jax.Array:
    """De-rotate the output's rope slice at the query position, then the grouped output LoRA."""
    o = _rotate(o, pos, inv_freq, heads=True, inverse=True)
    g = cfg.o_groups
    grouped = o.reshape(*o.shape[:-2], g, -1)  # [..., g, h k / g]
    wa = dense(p["wo_a"]["weight"], o.dtype).reshape(g, cfg.o_lora_rank, -1)
    y = jnp.einsum("...gi,goi->...go", grouped, wa)
    return linear(y.reshape(*y.shape[:-2], -1), p["wo_b"]["weight"])


def _softmax_with_sink(logits: jax.Array, sinks: jax.Array) -> jax.Array:
    """Softmax over the last axis with one extra per-head sink logit in the denominator. logits f32[b, h, t, s]."""
    sink = jnp.broadcast_to(sinks.astype(F32)[None, :, None, None], (*logits.shape[:-1], 1))
    return jax.nn.softmax(jnp.concatenate([logits, sink], axis=-1), axis=-1)[..., :-1]


def attention_extend(p: dict, x: jax.Array, st: dict, pos0, valid, cfg: ModelConfig, layer: int):
    """Attention for a chunk x [b, c, d] at positions pos0[b] + j given the layer's decoder state.

    Keys: the sliding window (ring of the previous `sliding_window` positions plus the chunk) and,
    on compressed layers, the pool entries visible to each query (CSA: the indexer's top-k of them).
    Only the first valid[b] chunk positions of a row are written to its state. Returns (out [b, c, d], state).
    """
    st = dict(st)
    b, c, _ = x.shape
    ltype, ratio = cfg.layer_type(layer), cfg.compress_ratios[layer]
    inv_freq = _rope(cfg, ltype)
    pos = pos0[:, None] + jnp.arange(c)  # [b, c]
    q_res, q, kv = _q_kv(p, x, pos, cfg, inv_freq)  # q [b, c, h, k]; kv [b, c, k]
    win = cfg.sliding_window
    keys = jnp.concatenate([ordered_ring(st["window"], pos0 - win), kv.astype(st["window"].dtype)], axis=1)
    kpos = pos0[:, None] - win + jnp.arange(win + c)  # [b, W + c]
    dist = pos[:, :, None] - kpos[:, None, :]
    win_mask = (dist >= 0) & (dist < win) & (kpos[:, None, :] >= 0)  # [b, c, W + c]
    st["window"] = _place_ring(refill_ring(keys, valid, win), pos0 + valid - win)
    scale = cfg.head_dim**-0.5
    logits = [jnp.einsum("bthk,bsk->bhts", q.astype(F32), keys.astype(F32)) * scale]
    masks, values = [win_mask], [keys]
    if ratio:
        compressor_extend(
            p["compressor"],
            x,
            st,
            ("pool", "ring_kv", "ring_gate"),
            pos0,
            valid,
            cfg,
            ratio,
            ltype == CSA,
            cfg.head_dim,
        )
        pool = st["pool"]
        cap = pool.shape[1]
        visible = jnp.arange(cap)[None, None, :] < ((pos + 1) // ratio)[..., None]  # [b, c, cap]
        if ltype == CSA:
            ip = p["indexer"]
            compressor_extend(
                ip["compressor"],
                x,
                st,
                ("index_pool", "iring_kv", "iring_gate"),
                pos0,
                valid,
                cfg,
                ratio,
                True,
                cfg.index_head_dim,
            )
            iq, iw = _indexer_query(ip, x, q_res, pos, cfg)
            scores = jnp.where(visible, index_scores(iq, st["index_pool"], iw, cfg), NEG_INF)
            _, top = jax.lax.top_k(scores, min(cfg.index_topk, cap))  # [b, c, k]
            if c == 1:  # decode: read only the chosen entries
                sel = jnp.take_along_axis(pool, top[:, 0, :, None], axis=1)  # [b, k, hd]
                logits.append(jnp.einsum("bthk,bsk->bhts", q.astype(F32), sel.astype(F32)) * scale)
                masks.append(jnp.take_along_axis(visible, top, axis=2))
                values.append(sel)
            else:
                chosen = (
                    jnp.zeros((b, c, cap), bool)
                    .at[jnp.arange(b)[:, None, None], jnp.arange(c)[None, :, None], top]
                    .set(True)
                )
                logits.append(jnp.einsum("bthk,bsk->bhts", q.astype(F32), pool.astype(F32)) * scale)
                masks.append(visible & chosen)
                values.append(pool)
        else:
            logits.append(jnp.einsum("bthk,bsk->bhts", q.astype(F32), pool.astype(F32)) * scale)
            masks.append(visible)
            values.append(pool)
    mask = jnp.concatenate(masks, axis=-1)
    probs = _softmax_with_sink(
        jnp.where(mask[:, None], jnp.concatenate(logits, axis=-1), NEG_INF), p["attn_sink"]
    )
    o = jnp.einsum("bhts,bsk->bthk", probs, jnp.concatenate(values, axis=1).astype(F32)).astype(x.dtype)
    return _output(p, o, pos, cfg, inv_freq), st


# ---- the whole model -----------------------------------------------------------------------------------
def _embed(params: dict, tokens: jax.Array, cfg: ModelConfig) -> jax.Array:
    x = dense(params["embed"]["weight"], jnp.dtype(cfg.dtype))[tokens]
    return jnp.broadcast_to(x[..., None, :], (*x.shape[:-1], cfg.hc_mult, x.shape[-1]))


def _hc_args(lp: dict, prefix: str, cfg: ModelConfig):
    return (
        lp[f"{prefix}_fn"],
        lp[f"{prefix}_base"],
        lp[f"{prefix}_scale"],
        cfg.hc_sinkhorn_iters,
        cfg.hc_eps,
        cfg.rms_norm_eps,
    )


def logits_from_hidden(params: dict, h: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Collapse the streams h [..., n, d], final norm, head: f32[..., vocab]."""
    x = hc_head(
        h, params["hc_head_fn"], params["hc_head_base"], params["hc_head_scale"], cfg.hc_eps, cfg.rms_norm_eps
    )
    x = rms_norm(x, params["norm"]["weight"], cfg.rms_norm_eps)
    return linear(x, params["head"]["weight"]).astype(F32)


def extend(
    params: dict, tokens: jax.Array, state: dict, cfg: ModelConfig, valid=None, moe_impl: str = "grouped"
):
    """Feed a chunk tokens int[b, c] at positions state['lengths'] + j; the first valid[b] are real.

    The one step function behind forward, prefill, chunked prefill and decode. Returns the last
    layer's streams [b, c, n, d] and the state with lengths += valid (rows with valid 0 are untouched).
    """
    b, c = tokens.shape
    valid = jnp.full((b,), c, jnp.int32) if valid is None else valid.astype(jnp.int32)
    pos0 = state["lengths"]
    h = _embed(params, tokens, cfg)
    new_layers = []
    for i, (lp, st) in enumerate(zip(params["layers"], state["layers"])):
        with jax.named_scope(f"layer{i}"):
            x, post, comb = hc_pre(h, *_hc_args(lp, "hc_attn", cfg))
            y, st = attention_extend(
                lp["attn"], rms_norm(x, lp["attn_norm"]["weight"], cfg.rms_norm_eps), st, pos0, valid, cfg, i
            )
            h = hc_post(y, h, post, comb)
            x, post, comb = hc_pre(h, *_hc_args(lp, "hc_ffn", cfg))
            y = moe(rms_norm(x, lp["ffn_norm"]["weight"], cfg.rms_norm_eps), lp["ffn"], cfg, tokens, moe_impl)
            h = hc_post(y, h, post, comb)
            new_layers.append(st)
    return h, {"layers": new_layers, "lengths": pos0 + valid}


def forward(params: dict, tokens: jax.Array, cfg: ModelConfig, moe_impl: str = "grouped") -> jax.Array:
    """Teacher-forced logits f32[b, t, vocab] for tokens int[b, t] from position 0 (a throwaway state)."""
    b, t = tokens.shape
    h, _ = extend(params, tokens, init_state(cfg, b, t), cfg, moe_impl=moe_impl)
    return logits_from_hidden(params, h, cfg)


# ---- decoder state ---------------------------------------------------------------------------------------
def init_state(cfg: ModelConfig, batch: int, max_len: int) -> dict:
    """Empty decoder state for `batch` rows of up to `max_len` tokens.

    Per layer: "window" [b, sliding_window, k] ring of roped K=V rows (slot = position % window);
    on compressed layers "pool" [b, ceil(max_len / m), k] of compressed entries and the pending
    raw projections "ring_kv" / "ring_gate" [b, R, c k] (R = 2m for CSA, m for HCA); on CSA
    layers the indexer's "index_pool" / "iring_kv" / "iring_gate" likewise. "lengths" int32[b].
    """
    dt = jnp.dtype(cfg.dtype)
    k, ik = cfg.head_dim, cfg.index_head_dim
    layers = []
    for i in range(cfg.num_hidden_layers):
        ltype, m = cfg.layer_type(i), cfg.compress_ratios[i]
        st = {"window": jnp.zeros((batch, cfg.sliding_window, k), dt)}
        if m:
            c = 2 if ltype == CSA else 1
            ring = 2 * m if ltype == CSA else m
            cap = max(1, -(-max_len // m))
            st.update(
                pool=jnp.zeros((batch, cap, k), dt),
                ring_kv=jnp.zeros((batch, ring, c * k), dt),
                ring_gate=jnp.zeros((batch, ring, c * k), dt),
            )
            if ltype == CSA:
                st.update(
                    index_pool=jnp.zeros((batch, cap, ik), dt),
                    iring_kv=jnp.zeros((batch, ring, 2 * ik), dt),
                    iring_gate=jnp.zeros((batch, ring, 2 * ik), dt),
                )
        layers.append(st)
    return {"layers": layers, "lengths": jnp.zeros((batch,), jnp.int32)}


def prefill(
    params: dict, tokens: jax.Array, lengths: jax.Array, cfg: ModelConfig, max_len: int, moe_impl="grouped"
):
    """Right-padded prompts tokens [b, t] with true lengths [b] -> (logits f32[b, v] at each last token, state)."""
    b, t = tokens.shape
    h, state = extend(params, tokens, init_state(cfg, b, max(max_len, t)), cfg, lengths, moe_impl)
    last = jnp.take_along_axis(h, (lengths - 1)[:, None, None, None], axis=1)[:, 0]
    return logits_from_hidden(params, last, cfg), state


def decode_step(params: dict, tokens: jax.Array, state: dict, cfg: ModelConfig, moe_impl: str = "grouped"):
    """Feed tokens int[b] at positions state['lengths']; return (logits f32[b, v], state with lengths + 1)."""
    h, state = extend(params, tokens[:, None], state, cfg, moe_impl=moe_impl)
    return logits_from_hidden(params, h[:, 0], cfg), state


# ---- checkpoint names ---------------------------------------------------------------------------------------
# DeepSeek's on-disk names are the tree's names; these fix the spellings HF transformers' save_pretrained
# leaves behind (a `model.` prefix, its own names for a few top-level tensors, `attn.norm` for kv_norm).
_RENAMES = (
    (r"^model\.", ""),
    (r"^embed_tokens\.", "embed."),
    (r"^lm_head\.", "head."),
    (r"^hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"^((?:layers|mtp)\.\d+\.attn)\.norm\.", r"\1.kv_norm."),
    (r"(\.experts\.\d+\.w[123])\.weight$", r"\1"),
)


def canonical_name(name: str, config: ModelConfig | None = None) -> str | None:
    """The tree name of a checkpoint tensor (experts as `...experts.E.w1`), or None for tensors djax skips."""
    import re

    for pat, rep in _RENAMES:
        name = re.sub(pat, rep, name)
    return name
