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
from djax.models.layers import apply_rope_interleaved, linear, rms_norm, rope_cos_sin, rope_inv_freq, unit_rms_norm
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
        gate["tid2eid"] = Param((cfg.vocab_size, cfg.num_experts_per_tok), ("vocab", None), "int32", "hash", e)
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
        "shared_experts": {"w1": _w(fs, d, "mlp", "embed"), "w2": _w(d, fs, "embed", "mlp"), "w3": _w(fs, d, "mlp", "embed")},
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


def _rotate(x: jax.Array, pos: jax.Array, inv_freq: np.ndarray, heads: bool, inverse: bool = False) -> jax.Array:
    """Rope on the trailing rope dims of x at integer positions `pos` (x: [..., (h,) k], pos: x.shape[:-1 or -2])."""
    cos, sin = rope_cos_sin(pos, inv_freq)
    if inverse:
        sin = -sin
    if heads:
        cos, sin = cos[..., None, :], sin[..., None, :]
    return apply_rope_interleaved(x, cos.astype(x.dtype).astype(F32), sin.astype(x.dtype).astype(F32))


# ---- compressor: softmax-gated pooling of windows ---------------------------------------------------------
def pool_windows(kv: jax.Array, gate: jax.Array, norm_w: jax.Array, eps: float) -> jax.Array:
    """One compressed entry per window. kv: [..., L, k]; gate: f32[..., L, k] (ape added, -inf = absent)."""
    wts = jax.nn.softmax(gate, axis=-2).astype(kv.dtype)
    return rms_norm(jnp.sum(kv * wts, axis=-2), norm_w, eps)


def compress_sequence(x: jax.Array, p: dict, cfg: ModelConfig, ratio: int, overlap: bool, width: int):
    """Compressed entries for every complete window of x [b, t, d]: [b, t // ratio, width], roped at w * ratio.

    Also returns the raw projections (kv, gate) [b, t, c * width] that the decoder state keeps.
    """
    b, t, _ = x.shape
    kv_all = linear(x, p["wkv"]["weight"])
    gate_all = linear(x, p["wgate"]["weight"])
    n = t // ratio
    c = kv_all.shape[-1]
    kv = kv_all[:, : n * ratio].reshape(b, n, ratio, c)
    gate = gate_all[:, : n * ratio].reshape(b, n, ratio, c).astype(F32) + p["ape"]
    if overlap:
        # Entry w pools window w-1's first half-projection with window w's second one.
        shift = ((0, 0), (1, 0), (0, 0), (0, 0))
        prev_kv = jnp.pad(kv[..., :width], shift)[:, :n]
        prev_gate = jnp.pad(gate[..., :width], shift, constant_values=NEG_INF)[:, :n]
        kv = jnp.concatenate([prev_kv, kv[..., width:]], axis=2)
        gate = jnp.concatenate([prev_gate, gate[..., width:]], axis=2)
    entries = pool_windows(kv, gate, p["norm"]["weight"], cfg.rms_norm_eps)  # [b, n, width]
    pos = jnp.broadcast_to(jnp.arange(n) * ratio, (b, n))
    entries = _rotate(entries, pos, _rope(cfg, CSA), heads=False)
    return entries, kv_all, gate_all


def compress_from_ring(ring_kv, ring_gate, p: dict, cfg: ModelConfig, ratio: int, overlap: bool, width: int, w):
    """The entry of window w [b] from the raw-projection ring ([b, 2 ratio or ratio, c * width], slot = pos % len)."""
    b = ring_kv.shape[0]
    gate = ring_gate.astype(F32)
    if overlap:
        cur = (w % 2)[:, None] * ratio + jnp.arange(ratio)  # [b, ratio] slots of window w
        prev = ((w + 1) % 2)[:, None] * ratio + jnp.arange(ratio)
        take = jax.vmap(lambda a, i: a[i])
        kv = jnp.concatenate([take(ring_kv, prev)[..., :width], take(ring_kv, cur)[..., width:]], axis=1)
        g_prev = take(gate, prev)[..., :width] + p["ape"][:, :width]
        g_prev = jnp.where((w > 0)[:, None, None], g_prev, NEG_INF)
        g = jnp.concatenate([g_prev, take(gate, cur)[..., width:] + p["ape"][:, width:]], axis=1)
    else:
        kv, g = ring_kv, gate + p["ape"]
    entry = pool_windows(kv, g, p["norm"]["weight"], cfg.rms_norm_eps)  # [b, width]
    del b
    return _rotate(entry, w * ratio, _rope(cfg, CSA), heads=False)


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


# ---- attention core -------------------------------------------------------------------------------------
def _attend(q, keys, mask, sinks, scale):
    """Shared K=V attention with per-head sinks. q: [b, t, h, k]; keys: [b, t, s, k]; mask: bool[b, t, s]."""
    logits = jnp.einsum("bthk,btsk->bhts", q.astype(F32), keys.astype(F32)) * scale
    logits = jnp.where(mask[:, None], logits, NEG_INF)
    sink = jnp.broadcast_to(sinks.astype(F32)[None, :, None, None], (*logits.shape[:-1], 1))
    full = jnp.concatenate([logits, sink], axis=-1)
    probs = jax.nn.softmax(full, axis=-1)[..., :-1]
    return jnp.einsum("bhts,btsk->bthk", probs, keys.astype(F32)).astype(q.dtype)


def _attend_seq(q, kv, comp, win_mask, comp_mask, sinks, scale):
    """Sequence form: kv [b, t, k] shared by all queries; comp [b, C, k]; masks bool[b, t, t] and [b, t, C]."""
    ql = jnp.einsum("bthk,bsk->bhts", q.astype(F32), kv.astype(F32)) * scale
    parts, masks, vals = [ql], [win_mask], [kv]
    if comp is not None:
        parts.append(jnp.einsum("bthk,bsk->bhts", q.astype(F32), comp.astype(F32)) * scale)
        masks.append(comp_mask)
        vals.append(comp)
    logits = jnp.concatenate(parts, axis=-1)
    mask = jnp.concatenate(masks, axis=-1)
    logits = jnp.where(mask[:, None], logits, NEG_INF)
    sink = jnp.broadcast_to(sinks.astype(F32)[None, :, None, None], (*logits.shape[:-1], 1))
    probs = jax.nn.softmax(jnp.concatenate([logits, sink], axis=-1), axis=-1)[..., :-1]
    values = jnp.concatenate(vals, axis=1).astype(F32)
    return jnp.einsum("bhts,bsk->bthk", probs, values).astype(q.dtype)


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


def attention_sequence(p: dict, x: jax.Array, cfg: ModelConfig, layer: int):
    """Attention over a whole sequence from position 0. x: [b, t, d]. Returns (out [b, t, d], cache material)."""
    b, t, _ = x.shape
    ltype, ratio = cfg.layer_type(layer), cfg.compress_ratios[layer]
    inv_freq = _rope(cfg, ltype)
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    q_res, q, kv = _q_kv(p, x, pos, cfg, inv_freq)
    qi, ki = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
    win_mask = jnp.broadcast_to((ki <= qi) & (ki > qi - cfg.sliding_window), (b, t, t))
    material = {"kv": kv}
    comp, comp_mask = None, None
    if ratio:
        comp, raw_kv, raw_gate = compress_sequence(x, p["compressor"], cfg, ratio, ltype == CSA, cfg.head_dim)
        material.update(comp=comp, raw_kv=raw_kv, raw_gate=raw_gate)
        n = comp.shape[1]
        visible = jnp.arange(n)[None, :] < ((jnp.arange(t) + 1) // ratio)[:, None]  # [t, C]
        comp_mask = jnp.broadcast_to(visible, (b, t, n))
        if ltype == CSA and n:
            ip = p["indexer"]
            keys, ikv, igate = compress_sequence(x, ip["compressor"], cfg, ratio, True, cfg.index_head_dim)
            material.update(icomp=keys, iraw_kv=ikv, iraw_gate=igate)
            iq, iw = _indexer_query(ip, x, q_res, pos, cfg)
            scores = jnp.where(comp_mask, index_scores(iq, keys, iw, cfg), NEG_INF)
            k = min(cfg.index_topk, n)
            _, top = jax.lax.top_k(scores, k)  # [b, t, k]
            chosen = jnp.zeros((b, t, n), bool).at[jnp.arange(b)[:, None, None], jnp.arange(t)[None, :, None], top].set(True)
            comp_mask = comp_mask & chosen
        elif ltype == CSA:
            material.update(icomp=jnp.zeros((b, 0, cfg.index_head_dim), x.dtype))
            ikv = linear(x, p["indexer"]["compressor"]["wkv"]["weight"])
            igate = linear(x, p["indexer"]["compressor"]["wgate"]["weight"])
            material.update(iraw_kv=ikv, iraw_gate=igate)
    o = _attend_seq(q, kv, comp, win_mask, comp_mask, p["attn_sink"], cfg.head_dim**-0.5)
    return _output(p, o, pos, cfg, inv_freq), material


# ---- the whole model -----------------------------------------------------------------------------------
def _embed(params: dict, tokens: jax.Array, cfg: ModelConfig) -> jax.Array:
    e = params["embed"]["weight"]
    x = dense(e, jnp.dtype(cfg.dtype))[tokens]
    return jnp.broadcast_to(x[..., None, :], (*x.shape[:-1], cfg.hc_mult, x.shape[-1]))


def _hc_args(lp: dict, prefix: str, cfg: ModelConfig):
    return lp[f"{prefix}_fn"], lp[f"{prefix}_base"], lp[f"{prefix}_scale"], cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps


def _ffn_block(lp: dict, h: jax.Array, tokens: jax.Array, cfg: ModelConfig, moe_impl: str) -> jax.Array:
    x, post, comb = hc_pre(h, *_hc_args(lp, "hc_ffn", cfg))
    y = moe(rms_norm(x, lp["ffn_norm"]["weight"], cfg.rms_norm_eps), lp["ffn"], cfg, tokens, moe_impl)
    return hc_post(y, h, post, comb)


def _logits(params: dict, h: jax.Array, cfg: ModelConfig) -> jax.Array:
    x = hc_head(h, params["hc_head_fn"], params["hc_head_base"], params["hc_head_scale"], cfg.hc_eps, cfg.rms_norm_eps)
    x = rms_norm(x, params["norm"]["weight"], cfg.rms_norm_eps)
    return linear(x, params["head"]["weight"]).astype(F32)


def hidden_sequence(params: dict, tokens: jax.Array, cfg: ModelConfig, moe_impl: str = "grouped"):
    """Run every layer over tokens [b, t] from position 0. Returns (streams [b, t, n, d], per-layer material)."""
    h = _embed(params, tokens, cfg)
    materials = []
    for i, lp in enumerate(params["layers"]):
        with jax.named_scope(f"layer{i}"):
            x, post, comb = hc_pre(h, *_hc_args(lp, "hc_attn", cfg))
            y, mat = attention_sequence(lp["attn"], rms_norm(x, lp["attn_norm"]["weight"], cfg.rms_norm_eps), cfg, i)
            h = hc_post(y, h, post, comb)
            h = _ffn_block(lp, h, tokens, cfg, moe_impl)
            materials.append(mat)
    return h, materials


def forward(params: dict, tokens: jax.Array, cfg: ModelConfig, moe_impl: str = "grouped") -> jax.Array:
    """Teacher-forced logits f32[b, t, vocab] for tokens int[b, t] (no cache)."""
    h, _ = hidden_sequence(params, tokens, cfg, moe_impl)
    return _logits(params, h, cfg)


# ---- decoder state ---------------------------------------------------------------------------------------
def init_state(cfg: ModelConfig, batch: int, max_len: int) -> dict:
    """Zeroed decoder state for `batch` rows of up to `max_len` tokens (see module docstring)."""
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


def _ring_gather(seq: jax.Array, lengths: jax.Array, size: int) -> jax.Array:
    """Ring of `size` slots (slot = position % size) holding the last `size` positions < length of seq [b, t, c]."""
    s = jnp.arange(size)
    last = lengths[:, None] - 1
    src = last - jnp.mod(last - s[None, :], size)  # [b, size]
    src = jnp.clip(src, 0, seq.shape[1] - 1)
    return jnp.take_along_axis(seq, src[..., None], axis=1)


def _fill_pool(pool: jax.Array, entries: jax.Array) -> jax.Array:
    n = min(entries.shape[1], pool.shape[1])
    return pool.at[:, :n].set(entries[:, :n].astype(pool.dtype))


def prefill(params: dict, tokens: jax.Array, lengths: jax.Array, cfg: ModelConfig, max_len: int, moe_impl="grouped"):
    """Run right-padded prompts tokens [b, t] with true lengths [b]; return (last logits f32[b, v], state)."""
    b, t = tokens.shape
    h, materials = hidden_sequence(params, tokens, cfg, moe_impl)
    last = jnp.take_along_axis(h, (lengths - 1)[:, None, None, None], axis=1)[:, 0]
    logits = _logits(params, last, cfg)
    state = init_state(cfg, b, max(max_len, t))
    for i, (st, mat) in enumerate(zip(state["layers"], materials)):
        st["window"] = _ring_gather(mat["kv"], lengths, cfg.sliding_window).astype(st["window"].dtype)
        if "pool" in st:
            ring = st["ring_kv"].shape[1]
            st["pool"] = _fill_pool(st["pool"], mat["comp"])
            st["ring_kv"] = _ring_gather(mat["raw_kv"], lengths, ring).astype(st["ring_kv"].dtype)
            st["ring_gate"] = _ring_gather(mat["raw_gate"], lengths, ring).astype(st["ring_gate"].dtype)
        if "index_pool" in st:
            st["index_pool"] = _fill_pool(st["index_pool"], mat["icomp"])
            st["iring_kv"] = _ring_gather(mat["iraw_kv"], lengths, ring).astype(st["iring_kv"].dtype)
            st["iring_gate"] = _ring_gather(mat["iraw_gate"], lengths, ring).astype(st["iring_gate"].dtype)
        del i
    state["lengths"] = lengths.astype(jnp.int32)
    return logits, state


def _set_row(buf: jax.Array, idx: jax.Array, val: jax.Array, when: jax.Array | None = None) -> jax.Array:
    """buf[r, idx[r]] = val[r] for every row r (only where `when[r]`)."""
    rows = jnp.arange(buf.shape[0])
    if when is not None:
        val = jnp.where(when[:, None], val.astype(buf.dtype), buf[rows, idx])
    return buf.at[rows, idx].set(val.astype(buf.dtype))


def _push_compressed(st: dict, keys: tuple[str, str, str], x, pos, p, cfg, ratio, overlap, width):
    """Add token x [b, d] at pos [b] to a compressor's ring; close its window into the pool when it ends."""
    pool_k, kv_k, gate_k = keys
    ring = st[kv_k].shape[1]
    slot = pos % ring
    st[kv_k] = _set_row(st[kv_k], slot, linear(x, p["wkv"]["weight"]))
    st[gate_k] = _set_row(st[gate_k], slot, linear(x, p["wgate"]["weight"]))
    w = pos // ratio
    entry = compress_from_ring(st[kv_k], st[gate_k], p, cfg, ratio, overlap, width, w)
    closing = (pos + 1) % ratio == 0
    st[pool_k] = _set_row(st[pool_k], jnp.minimum(w, st[pool_k].shape[1] - 1), entry, closing)


def attention_decode(p: dict, x: jax.Array, st: dict, pos: jax.Array, cfg: ModelConfig, layer: int):
    """One new token per row. x: [b, d]; pos: int[b] its position. Returns (out [b, d], updated layer state)."""
    st = dict(st)
    ltype, ratio = cfg.layer_type(layer), cfg.compress_ratios[layer]
    inv_freq = _rope(cfg, ltype)
    q_res, q, kv = _q_kv(p, x, pos, cfg, inv_freq)  # q: [b, h, k]; kv: [b, k]
    w_size = cfg.sliding_window
    st["window"] = _set_row(st["window"], pos % w_size, kv)
    slots = jnp.arange(w_size)
    held = pos[:, None] - jnp.mod(pos[:, None] - slots[None, :], w_size)  # position each slot holds
    keys, mask = [st["window"]], [held >= 0]
    if ratio:
        _push_compressed(st, ("pool", "ring_kv", "ring_gate"), x, pos, p["compressor"], cfg, ratio, ltype == CSA, cfg.head_dim)
        cap = st["pool"].shape[1]
        visible = jnp.arange(cap)[None, :] < ((pos + 1) // ratio)[:, None]  # [b, cap]
        if ltype == CSA:
            ip = p["indexer"]
            _push_compressed(st, ("index_pool", "iring_kv", "iring_gate"), x, pos, ip["compressor"], cfg, ratio, True,
                             cfg.index_head_dim)
            iq, iw = _indexer_query(ip, x[:, None], q_res[:, None], pos[:, None], cfg)
            scores = jnp.where(visible, index_scores(iq, st["index_pool"], iw, cfg)[:, 0], NEG_INF)
            _, top = jax.lax.top_k(scores, min(cfg.index_topk, cap))  # [b, k]
            keys.append(jnp.take_along_axis(st["pool"], top[..., None], axis=1))
            mask.append(jnp.take_along_axis(visible, top, axis=1))
        else:
            keys.append(st["pool"])
            mask.append(visible)
    allk = jnp.concatenate(keys, axis=1)[:, None]  # [b, 1, s, k]
    o = _attend(q[:, None], allk, jnp.concatenate(mask, axis=1)[:, None], p["attn_sink"], cfg.head_dim**-0.5)
    return _output(p, o[:, 0], pos, cfg, inv_freq), st


def decode_step(params: dict, tokens: jax.Array, state: dict, cfg: ModelConfig, moe_impl: str = "grouped"):
    """Feed tokens int[b] at positions state['lengths']; return (logits f32[b, v], state with lengths + 1)."""
    pos = state["lengths"]
    h = _embed(params, tokens, cfg)  # [b, n, d]
    new_layers = []
    for i, (lp, st) in enumerate(zip(params["layers"], state["layers"])):
        with jax.named_scope(f"layer{i}"):
            x, post, comb = hc_pre(h, *_hc_args(lp, "hc_attn", cfg))
            y, st = attention_decode(lp["attn"], rms_norm(x, lp["attn_norm"]["weight"], cfg.rms_norm_eps), st, pos, cfg, i)
            h = hc_post(y, h, post, comb)
            h = _ffn_block(lp, h, tokens, cfg, moe_impl)
            new_layers.append(st)
    return _logits(params, h, cfg), {"layers": new_layers, "lengths": pos + 1}


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
