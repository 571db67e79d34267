"""DeepSeek-V4 in pure JAX: declaration, teacher-forced forward, prefill into a decoder state, one-token decode.

Layer i attends over a sliding window of the last `sliding_window` tokens (its own "window" ring)
and, when `compress_ratios[i] = m > 0`, over compressed entries: entry w pools tokens
[w m, (w + 1) m) (CSA, m = 4: also the previous window, through a second projection) and is
visible to query t only when w < (t + 1) // m. CSA layers pick their entries with a lightning
indexer (own compressor at index_head_dim, top `index_topk`); HCA layers see all visible entries.
The residual is `hc_mult` streams mixed by mHC around every block.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from djax.config import CSA, SLIDING, ModelConfig
from djax.kernels import partition as kpartition
from djax.models import engram
from djax.models.layers import (
    apply_rope_interleaved,
    decode_impl,
    fp8_impl,
    grouped_linear,
    linear,
    linear_pair,
    rms_norm,
    rope_cos_sin,
    rope_inv_freq,
    top_k,
    unit_rms_norm,
)
from djax.models.mhc import hc_head, hc_post, hc_pre, sinkhorn
from djax.models.moe import moe_with_counts
from djax.params import Param, expert_weights, mlp_weights
from djax.params import linear_weight as _w
from djax.params import norm_weight as _norm
from djax.quant import dense

F32 = jnp.float32
NEG_INF = -jnp.inf

# `kernels`, an argument of the step functions: how decode steps (chunks of one token) run attention and the
# indexer, and every chunk the FP8 weights in DeepGEMM's layout (`layers.KERNEL_CHOICES`, `layers.decode_impl`,
# `layers.fp8_impl`).


# ---- declaration -----------------------------------------------------------------------------------
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


def _shared_attention(cfg: ModelConfig, i: int) -> dict:
    """V4.1 attention: no per-layer compressor unless layer i is a KV source; indexer on index sources only."""
    p = _attention(cfg, 0, SLIDING)
    k, ik, m = cfg.head_dim, cfg.index_head_dim, cfg.compress_ratios[i]
    if i in cfg.kv_source_layer_ids:
        # Ratio 2 gates a pair of tokens; ratio 1 is a plain projection (one latent per token).
        p["compressor"] = {"wkv": _w(k, cfg.hidden_size, None, "embed"), "norm": _norm(k)}
        if m > 1:
            p["compressor"]["wgate"] = _w(k, cfg.hidden_size, None, "embed")
    if i in cfg.index_source_layer_ids:
        p["indexer"] = {
            "wq_b": _w(cfg.index_n_heads * ik, cfg.q_lora_rank, None, "q_lora"),
            "weights_proj": _w(cfg.index_n_heads, cfg.hidden_size, None, "embed"),
        }
        if i in cfg.kv_source_layer_ids:  # index keys derive from the compressor latent
            p["indexer"].update(wk=_w(ik, k, None, None), k_norm=_norm(ik))
    return p


def _engram(cfg: ModelConfig, rows: int) -> dict:
    n, d, cols = cfg.hc_mult, cfg.hidden_size, cfg.engram_columns
    return {
        "embed": {"weight": Param((rows, cfg.engram_head_dim), (None, None))},
        "wkv": _w((n + 1) * d, cols * cfg.engram_head_dim, None, None),
        "q_weight": Param((n, d), (None, None), "float32", "ones"),
        "k_weight": Param((n, d), (None, None), "float32", "uniform"),
    }


def _ffn(cfg: ModelConfig, hashed: bool, experts: int | None = None) -> dict:
    d, f, e = cfg.hidden_size, cfg.moe_intermediate_size, experts or cfg.n_routed_experts
    gate = {"weight": Param((e, d), ("experts_r", "embed"))}
    if hashed:
        gate["tid2eid"] = Param(
            (cfg.vocab_size, cfg.num_experts_per_tok), ("vocab", None), "int32", "hash", e
        )
    else:
        gate["bias"] = Param((e,), (None,), "float32", "uniform")
        if cfg.is_v41:  # V4.1's selection bias for image tokens; djax reads text only, kept for loading
            gate["bias_vl"] = Param((e,), (None,), "float32", "uniform")
    fs = f * cfg.n_shared_experts
    return {
        "gate": gate,
        "experts": expert_weights(e, d, f),
        "shared_experts": mlp_weights(d, fs),
    }


def _hc(cfg: ModelConfig, prefix: str) -> dict:
    n, d = cfg.hc_mult, cfg.hidden_size
    m = (2 + n) * n
    return {
        f"{prefix}_fn": Param((m, n * d), (None, None), "float32"),
        f"{prefix}_base": Param((m,), (None,), "float32", "uniform"),
        f"{prefix}_scale": Param((3,), (None,), "float32", "ones"),
    }


def _block(cfg: ModelConfig, ratio: int, layer_type: str, hashed: bool, i: int = -1, experts=None) -> dict:
    d = cfg.hidden_size
    b = {
        "attn_norm": _norm(d),
        "ffn_norm": _norm(d),
        "attn": _shared_attention(cfg, i) if cfg.is_v41 and i >= 0 else _attention(cfg, ratio, layer_type),
        "ffn": _ffn(cfg, hashed, experts),
        **_hc(cfg, "hc_attn"),
        **_hc(cfg, "hc_ffn"),
    }
    if i in cfg.engram_layer_ids:
        b["engram"] = _engram(cfg, cfg.engram_num_embeddings[cfg.engram_layer_ids.index(i)])
    return b


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
            _block(cfg, cfg.compress_ratios[i], cfg.layer_type(i), cfg.is_hash_layer(i), i)
            for i in range(cfg.num_hidden_layers)
        ],
        "norm": _norm(d),
        "head": {"weight": Param((v, d), ("vocab", "embed"))},
    }
    if not cfg.hc_deferred:
        tree.update(_head_hc(cfg, "hc_head"))
    if cfg.engram_layer_ids:
        # Token id -> compressed (normalised) id. DeepSeek derives it from the tokenizer; djax saves it, and
        # load_checkpoint builds it from tokenizer.json when a checkpoint lacks it (engram.compressed_token_map).
        tree["engram_token_map"] = Param((v,), (None,), "int32", "hash", cfg.engram_compressed_vocab_size)
    if cfg.is_v41:
        if with_mtp and cfg.num_nextn_predict_layers:
            from djax.models.dspark import declare_drafter

            tree["mtp"] = declare_drafter(cfg)
        return tree
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


def ring_then(ring: jax.Array, start: jax.Array, rows: jax.Array) -> jax.Array:
    """`ordered_ring(ring, start)` followed by rows [b, c, ...] (in the ring's dtype): the window's keys.

    The barrier keeps what computes `rows` (a projection's norm and rope) out of the concatenation's kernel.
    Fused into it, XLA's GPU emitter recomputed a row's norm, and the FP8 GEMM's split-k sum, for every
    element of the window: at batch 1, 14 us a layer with bf16 weights and 45 with FP8, against a few apart."""
    rows = jax.lax.optimization_barrier(rows.astype(ring.dtype))
    return jnp.concatenate([ordered_ring(ring, start), rows], axis=1)


def refill_ring(seq: jax.Array, first: jax.Array, size: int) -> jax.Array:
    """The ring of `size` slots holding seq[:, first : first + size] (seq position index + offset = slot order)."""
    idx = first[:, None] + jnp.arange(size)  # [b, size], indices into seq
    rows = jnp.take_along_axis(seq, jnp.clip(idx, 0, seq.shape[1] - 1)[..., None], axis=1)
    return rows


def _place_ring(rows: jax.Array, first_pos: jax.Array) -> jax.Array:
    """Put rows [b, R, c] holding positions first_pos .. first_pos + R - 1 into their slots (position % R).

    A gather (slot s takes row (s - first_pos) % R), not a scatter at explicit [arange(b), slot] indices:
    with the batch split over devices the partitioner keeps a batched gather split, but it would
    all-gather a scatter's operands (the whole ring) on every device.
    """
    r = rows.shape[1]
    src = jnp.mod(jnp.arange(r) - first_pos[:, None], r)  # [b, R]
    return jnp.take_along_axis(rows, src.reshape(*src.shape, *([1] * (rows.ndim - 2))), axis=1)


def slot_positions(newest: jax.Array, size: int) -> jax.Array:
    """The position each slot of a ring of `size` slots holds once `newest` int[b] is its newest: slot s holds
    the one p <= newest with p = s (mod size) and p > newest - size. int[b, size]; below 0 for slots no
    position has reached yet."""
    return newest[:, None] - jnp.mod(newest[:, None] - jnp.arange(size), size)


# From this many rows a one-token step writes its rows into the rings' slots (`write_slot`) instead of
# rebuilding each ring around the new row (`ring_then`, `refill_ring`). Profiled side by side on an H100
# (NOTES.md): 0.5-2.7% less GPU time a step at 8, 32 and 64 rows, 0.5-0.8% more at one row, where the
# attention kernel then reads the window from DRAM rather than from L2, where the rebuild had just put it.
SLOT_WRITES_FROM_BATCH = 8


def by_slot(x: jax.Array) -> bool:
    """Whether the step over chunk x [b, c, d] writes its rings by slot: one token, enough rows."""
    return x.shape[1] == 1 and x.shape[0] >= SLOT_WRITES_FROM_BATCH


def write_slot(ring: jax.Array, pos: jax.Array, valid: jax.Array, row: jax.Array) -> jax.Array:
    """The ring [b, R, ...] with row [b, 1, ...] written into slot pos % R of the rows whose `valid` > 0 (the
    others keep theirs): one token's step, in place of rebuilding the ring around it."""
    r = ring.shape[1]
    return _set_rows(ring, jnp.where(valid > 0, jnp.mod(pos, r), r)[:, None], row)


def _set_rows(a: jax.Array, idx: jax.Array, values: jax.Array) -> jax.Array:
    """a[..., idx[..., j], :] = values[..., j, :] per leading index (idx's leading dims lead a); indices out
    of range are dropped.

    A scatter vmapped over the leading dims, which makes them batching dims of the scatter: the
    partitioner keeps a split batch split. Indexed by an explicit jnp.arange(b) instead, the scatter
    would all-gather its operand (a whole decoder-state pool) on every device.
    """

    def one(a, i, v):
        return a.at[i].set(v, mode="drop")

    for _ in range(idx.ndim - 1):
        one = jax.vmap(one)
    return one(a, idx, values.astype(a.dtype))


# ---- compressor: softmax-gated pooling of windows ---------------------------------------------------------
def pool_windows(kv: jax.Array, gate: jax.Array, norm_w: jax.Array, eps: float) -> jax.Array:
    """One compressed entry per window. kv: [..., L, k]; gate: f32[..., L, k] (ape added, -inf = absent)."""
    wts = jax.nn.softmax(gate, axis=-2).astype(kv.dtype)
    return rms_norm(jnp.sum(kv * wts, axis=-2), norm_w, eps)


def compressor_extend(
    p: dict,
    x,
    st: dict,
    names,
    pos0,
    valid,
    cfg: ModelConfig,
    ratio: int,
    overlap: bool,
    width: int,
    index=None,
    fp8: str | None = None,
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
    # The barriers keep what computes the projections (an FP8 GEMM's split-K sum) out of the gathers below,
    # which read every ring slot: fused into them, XLA's GPU emitter computed the projection again for each
    # element of the windows and the new ring (a ratio-128 layer at batch 32 on an H100: 72.6 us a step with
    # FP8 weights, their splits summed each time, 37.2 with bf16 weights; behind the barrier 7.0 and 8.7).
    if "wgate" in p:
        raw_kv, raw_gate = linear_pair(x, p["wkv"]["weight"], p["wgate"]["weight"], fp8)
        raw_kv, raw_gate = raw_kv.astype(st[kv_k].dtype), raw_gate.astype(st[gate_k].dtype)
        raw_kv, raw_gate = jax.lax.optimization_barrier((raw_kv, raw_gate))
    else:  # ratio 1: a window of one token, its softmax weight is 1
        raw_kv = jax.lax.optimization_barrier(linear(x, p["wkv"]["weight"], fp8).astype(st[kv_k].dtype))
        raw_gate = jnp.zeros_like(raw_kv).astype(st[gate_k].dtype)
    ape = p["ape"] if "ape" in p else 0.0
    # Windows ending inside the chunk: w * m + m - 1 in pos0 .. pos0 + c - 1, so at most ceil(c / m) of them
    # from window pos0 // m on.
    w = pos0[:, None] // m + jnp.arange(-(-c // m))  # [b, nw]
    first = (w * m)[..., None] + jnp.arange(m)  # [b, nw, m] positions of each window

    def take(a, idx):
        flat = jnp.clip(idx, 0, a.shape[1] - 1).reshape(b, -1)
        return jnp.take_along_axis(a, flat[..., None], axis=1).reshape(*idx.shape, a.shape[-1])

    slots = by_slot(x)
    if slots:  # one token: its row goes into its slot and the windows are read from the rings by slot
        st[kv_k] = write_slot(st[kv_k], pos0, valid, raw_kv)
        st[gate_k] = write_slot(st[gate_k], pos0, valid, raw_gate)
        comb_kv, comb_gate = st[kv_k], st[gate_k]
        cur = jnp.mod(first, ring)
        prev = jnp.mod(first - m, ring)
    else:  # the ring in position order, then the chunk (combined index 0 is position pos0 - R)
        start = pos0 - ring
        comb_kv = jnp.concatenate([ordered_ring(st[kv_k], start), raw_kv], axis=1)  # [b, R + c, C]
        comb_gate = jnp.concatenate([ordered_ring(st[gate_k], start), raw_gate], axis=1)
        cur = first - start[:, None, None]
        prev = cur - m
    kv, gate = take(comb_kv, cur), take(comb_gate, cur).astype(F32) + ape
    if overlap:
        prev_kv, prev_gate = take(comb_kv, prev), take(comb_gate, prev).astype(F32) + ape
        prev_gate = jnp.where((w > 0)[..., None, None], prev_gate[..., :width], NEG_INF)
        kv = jnp.concatenate([prev_kv[..., :width], kv[..., width:]], axis=2)
        gate = jnp.concatenate([prev_gate, gate[..., width:]], axis=2)
    latent = pool_windows(kv, gate, p["norm"]["weight"], cfg.rms_norm_eps)  # [b, nw, width]
    entries = _rotate(latent, w * m, _rope(cfg, CSA), heads=False)
    closes = (w + 1) * m <= (pos0 + valid)[:, None]
    pool = st[pool_k]
    target = jnp.where(closes, w, pool.shape[1])  # out of range: dropped
    st[pool_k] = _set_rows(pool, target, entries)
    if index is not None:  # V4.1: the index key is a projection of the (un-rotated) latent
        wk, k_norm = index
        ikey = rms_norm(linear(latent, wk["weight"], fp8), k_norm["weight"], cfg.rms_norm_eps)
        ikey = _rotate(ikey, w * m, _rope(cfg, CSA), heads=False)
        st["index_pool"] = _set_rows(st["index_pool"], target, ikey)
    if not slots:  # the new ring holds positions pos0 + valid - R .. pos0 + valid - 1
        st[kv_k] = _place_ring(refill_ring(comb_kv, valid, ring), pos0 + valid - ring)
        st[gate_k] = _place_ring(refill_ring(comb_gate, valid, ring), pos0 + valid - ring)


# ---- lightning indexer ------------------------------------------------------------------------------
def index_scores(q: jax.Array, keys: jax.Array, weights: jax.Array, cfg: ModelConfig) -> jax.Array:
    """sum_h w[h] relu(q_h . k) scaled. q: [b, t, H, c]; keys: [b, C, c]; weights: [b, t, H] -> f32[b, t, C]."""
    s = jnp.einsum("bthc,bsc->bths", q.astype(F32), keys.astype(F32))
    s = jax.nn.relu(s) * cfg.index_head_dim**-0.5
    w = weights.astype(F32) * cfg.index_n_heads**-0.5
    return jnp.einsum("bths,bth->bts", s, w)


def _pow2(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


def _fp8_impl(x: jax.Array, kernels: str) -> str | None:
    """The `fp8_gemm` impl for the FP8 projections of a chunk x [b, c, d] of any length under `kernels`, or
    None: the weights made dense on use ("off", and "auto" off CUDA)."""
    return fp8_impl(x.dtype, kernels)


def _index_impl(c: int, q: jax.Array, kernels: str) -> str | None:
    """Kernel impl for the indexer's scores at decode (q [b, t, H, c]); the Triton kernel needs H, c powers of two."""
    return decode_impl(c, q.dtype, _pow2(q.shape[-2]) and _pow2(q.shape[-1]), kernels)


def _visible_scores(iq, ipool, iw, pos, ratio: int, cfg: ModelConfig, impl: str | None) -> jax.Array:
    """Indexer scores f32[b, t, C] of the pool entries visible to each query (-inf elsewhere)."""
    if impl is None:
        visible = jnp.arange(ipool.shape[1])[None, None, :] < ((pos + 1) // ratio)[..., None]
        return jnp.where(visible, index_scores(iq, ipool, iw, cfg), NEG_INF)
    # Decode: the visible entries are a prefix of the pool; the kernel wants the scales inside the weights.
    w = iw[:, 0].astype(F32) * (cfg.index_n_heads**-0.5 * cfg.index_head_dim**-0.5)
    return kpartition.index_scores(impl)(iq[:, 0], ipool, w, (pos[:, 0] + 1) // ratio)[:, None]


def _topk_picks(scores: jax.Array, k: int, impl: str) -> tuple[jax.Array, jax.Array]:
    """`select_entries` for one query (scores f32[b, 1, C]) through the top-k kernel: (top, eligible)."""
    _, idx = kpartition.topk(impl)(scores[:, 0], min(k, scores.shape[-1]))
    return jnp.maximum(idx, 0)[:, None], (idx >= 0)[:, None]


def _indexer_query(p: dict, x: jax.Array, q_res: jax.Array, pos: jax.Array, cfg: ModelConfig, fp8=None):
    q = linear(q_res, p["wq_b"]["weight"], fp8)
    q = q.reshape(*q.shape[:-1], cfg.index_n_heads, cfg.index_head_dim)
    q = _rotate(q, pos, _rope(cfg, CSA), heads=True)
    return q, linear(x, p["weights_proj"]["weight"], fp8)


# ---- attention ----------------------------------------------------------------------------------------------
def _q_kv(p: dict, x: jax.Array, pos: jax.Array, cfg: ModelConfig, inv_freq, fp8=None):
    h, k = cfg.num_attention_heads, cfg.head_dim
    q_a, kv = linear_pair(x, p["wq_a"]["weight"], p["wkv"]["weight"], fp8)
    q_res = rms_norm(q_a, p["q_norm"]["weight"], cfg.rms_norm_eps)
    q = linear(q_res, p["wq_b"]["weight"], fp8).reshape(*x.shape[:-1], h, k)
    if cfg.q_head_norm:
        q = unit_rms_norm(q, cfg.rms_norm_eps)
    q = _rotate(q, pos, inv_freq, heads=True)
    kv = rms_norm(kv, p["kv_norm"]["weight"], cfg.rms_norm_eps)
    kv = _rotate(kv, pos, inv_freq, heads=False)
    return q_res, q, kv


def _output(p: dict, o: jax.Array, pos: jax.Array, cfg: ModelConfig, inv_freq, fp8=None) -> jax.Array:
    """De-rotate the output's rope slice at the query position, then the grouped output LoRA."""
    o = _rotate(o, pos, inv_freq, heads=True, inverse=True)
    grouped = o.reshape(*o.shape[:-2], cfg.o_groups, -1)  # [..., g, h k / g]
    y = grouped_linear(grouped, p["wo_a"]["weight"], fp8)  # [..., g, o_lora]
    return linear(y.reshape(*y.shape[:-2], -1), p["wo_b"]["weight"], fp8)


def _softmax_with_sink(logits: jax.Array, sinks: jax.Array) -> jax.Array:
    """Softmax over the last axis with one extra per-head sink logit in the denominator. logits f32[b, h, t, s]."""
    sink = jnp.broadcast_to(sinks.astype(F32)[None, :, None, None], (*logits.shape[:-1], 1))
    return jax.nn.softmax(jnp.concatenate([logits, sink], axis=-1), axis=-1)[..., :-1]


def _candidate_blocks(scores: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Two-level indexer, first level: bool[b, t, C] marking the positions of the `candidate_topk_blocks`
    blocks of `candidate_block_size` compressed positions whose best (max) score is highest."""
    bs = cfg.candidate_block_size
    cap = scores.shape[-1]
    nb = -(-cap // bs)
    padded = jnp.pad(scores, ((0, 0), (0, 0), (0, nb * bs - cap)), constant_values=NEG_INF)
    block = padded.reshape(*scores.shape[:-1], nb, bs).max(-1)  # [b, t, nb]
    best, top = top_k(block, min(cfg.candidate_topk_blocks, nb))
    keep = _set_rows(jnp.zeros(block.shape, bool), top, jnp.isfinite(best))
    return jnp.repeat(keep, bs, axis=-1)[..., :cap]


def select_entries(scores: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """Top-k of f32[b, t, C] scores (-inf = not eligible): (indices int32[b, t, k], eligible bool[b, t, k])."""
    best, top = top_k(scores, min(k, scores.shape[-1]))
    return top, jnp.isfinite(best)


def _shared_compressed(
    p, x, q_res, pos, pos0, valid, st, shared, sel, cfg: ModelConfig, layer: int, kernels: str = "auto"
):
    """V4.1 compressed keys of `layer`: (pool [b, C, k], top [b, t, k], eligible [b, t, k]).

    A KV-source layer runs its compressor into its own state; other layers read the pools of their
    source (`shared`, already advanced over this chunk). Index sources score the visible entries
    (after the candidate source, only inside its candidate blocks); other layers reuse the nearest
    index source's selection through `sel`.
    """
    ratio, src = cfg.compress_ratios[layer], cfg.kv_source(layer)
    fp8 = _fp8_impl(x, kernels)
    if src == layer:
        ix = p["indexer"]
        compressor_extend(
            p["compressor"], x, st, ("pool", "ring_kv", "ring_gate"), pos0, valid, cfg, ratio, False,
            cfg.head_dim, index=(ix["wk"], ix["k_norm"]), fp8=fp8,
        )  # fmt: skip
        shared = st
    pool, ipool = shared["pool"], shared["index_pool"]
    if layer in cfg.index_source_layer_ids:
        iq, iw = _indexer_query(p["indexer"], x, q_res, pos, cfg, fp8)
        impl = _index_impl(x.shape[1], iq, kernels)
        scores = _visible_scores(iq, ipool, iw, pos, ratio, cfg, impl)
        cs = cfg.candidate_source_layer_id
        if layer == cs:
            sel["candidates"] = _candidate_blocks(scores, cfg)
        elif 0 <= cs < layer and cfg.kv_source(cs) == src:
            scores = jnp.where(sel["candidates"], scores, NEG_INF)
        pick = select_entries if impl is None else functools.partial(_topk_picks, impl=impl)
        sel[layer] = pick(scores, cfg.index_topk)
    top, ok = sel[cfg.index_source(layer)]
    return pool, top, ok


def attention_extend(
    p: dict,
    x: jax.Array,
    st: dict,
    pos0,
    valid,
    cfg: ModelConfig,
    layer: int,
    shared=None,
    sel=None,
    floor=None,
    kernels: str = "auto",
):
    """Attention for a chunk x [b, c, d] at positions pos0[b] + j given the layer's decoder state.

    Keys: the sliding window (ring of the previous positions plus the chunk; keys below `floor[b]`,
    default 0, are masked) and, on compressed layers, the pool entries visible to each query (CSA
    and V4.1: the indexer's top-k of them). Only the first valid[b] chunk positions of a row are
    written to its state. V4.1 readers get their source's state in `shared` and the selections of
    earlier index sources in `sel` (a dict, updated). Returns (out [b, c, d], state).
    """
    st = dict(st)
    b, c, _ = x.shape
    ltype, ratio = cfg.layer_type(layer), cfg.compress_ratios[layer]
    inv_freq = _rope(cfg, ltype)
    pos = pos0[:, None] + jnp.arange(c)  # [b, c]
    fp8 = _fp8_impl(x, kernels)
    q_res, q, kv = _q_kv(p, x, pos, cfg, inv_freq, fp8)  # q [b, c, h, k]; kv [b, c, k]
    win, r = cfg.sliding_window, st["window"].shape[1]  # a ring larger than the window allows rollback
    if by_slot(x):  # one token: its key into its slot, the ring is then the window (key order is immaterial)
        st["window"] = keys = write_slot(st["window"], pos0, valid, kv)
        kpos = slot_positions(pos0 + jnp.minimum(valid, 1) - 1, r)  # [b, R]
    else:  # the ring in position order, then the chunk
        keys = ring_then(st["window"], pos0 - r, kv)
        kpos = pos0[:, None] - r + jnp.arange(r + c)  # [b, R + c]
        st["window"] = _place_ring(refill_ring(keys, valid, r), pos0 + valid - r)
    dist = pos[:, :, None] - kpos[:, None, :]
    lo = jnp.zeros_like(pos0) if floor is None else floor
    win_mask = (dist >= 0) & (dist < win) & (kpos >= lo[:, None])[:, None, :]  # [b, c, keys]
    scale = cfg.head_dim**-0.5
    comp = None  # (pool [b, C, k], top int[b, c, T] or None for every visible entry, eligible bool[b, c, T or C])
    if ratio and cfg.is_v41:
        comp = _shared_compressed(p, x, q_res, pos, pos0, valid, st, shared, sel, cfg, layer, kernels)
    elif ratio:
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
            fp8=fp8,
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
                fp8=fp8,
            )
            iq, iw = _indexer_query(ip, x, q_res, pos, cfg, fp8)
            impl = _index_impl(c, iq, kernels)
            scores = _visible_scores(iq, st["index_pool"], iw, pos, ratio, cfg, impl)
            if impl is None:
                _, top = top_k(scores, min(cfg.index_topk, cap))  # [b, c, k]
                comp = (pool, top, jnp.take_along_axis(visible, top, axis=2))
            else:
                comp = (pool, *_topk_picks(scores, cfg.index_topk, impl))
        else:
            comp = (pool, None, visible)
    h, k = q.shape[-2:]
    impl = decode_impl(c, q.dtype, h % 32 == 0 and _pow2(k), kernels)
    if impl is not None:  # decode through the kernel (sparse_decode_ref's math = the softmax below)
        o = _sparse_decode(q, keys, win_mask, comp, p["attn_sink"], scale, impl)
        return _output(p, o, pos, cfg, inv_freq, fp8), st
    logits = [jnp.einsum("bthk,bsk->bhts", q.astype(F32), keys.astype(F32)) * scale]
    masks, values = [win_mask], [keys]
    if comp is not None and comp[1] is None:  # HCA: every visible entry
        pool, _, visible = comp
        logits.append(jnp.einsum("bthk,bsk->bhts", q.astype(F32), pool.astype(F32)) * scale)
        masks.append(visible)
        values.append(pool)
    elif comp is not None:
        _add_selected(q, *comp, scale, logits, masks, values)
    mask = jnp.concatenate(masks, axis=-1)
    probs = _softmax_with_sink(
        jnp.where(mask[:, None], jnp.concatenate(logits, axis=-1), NEG_INF), p["attn_sink"]
    )
    o = jnp.einsum("bhts,bsk->bthk", probs, jnp.concatenate(values, axis=1).astype(F32)).astype(x.dtype)
    return _output(p, o, pos, cfg, inv_freq, fp8), st


def _sparse_decode(q, keys, win_mask, comp, sinks, scale: float, impl: str) -> jax.Array:
    """The decode step's attention through `sparse_decode`: q [b, 1, h, k]; keys [b, W, k] (the window's
    ring with the new key in its slot, W = R, or the ring in position order then the new key, W = R + 1:
    `by_slot`); win_mask bool[b, 1, W]; comp as in `attention_extend`. Returns o [b, 1, h, k]."""
    b = q.shape[0]
    if comp is None:  # a sliding-only layer: one invalid pick (no zero-size buffers for the kernel)
        pool, picks = keys[:, :1], jnp.full((b, 1), -1, jnp.int32)
    elif comp[1] is None:  # HCA: every visible entry
        pool, _, visible = comp
        picks = jnp.where(visible[:, 0], jnp.arange(pool.shape[1]), -1)
    else:
        pool, top, ok = comp
        picks = jnp.where(ok[:, 0], top[:, 0], -1)
    o = kpartition.sparse_decode(impl)(
        q[:, 0], keys, win_mask[:, 0], pool, picks.astype(jnp.int32), sinks, scale
    )
    return o[:, None].astype(q.dtype)


def _add_selected(q, pool, top, ok, scale, logits, masks, values):
    """Append the keys of the chosen pool entries: gathered for one query, a mask over the pool for a chunk."""
    b, c = top.shape[:2]
    if c == 1:  # decode: read only the chosen entries
        sel = jnp.take_along_axis(pool, top[:, 0, :, None], axis=1)  # [b, k, hd]
        logits.append(jnp.einsum("bthk,bsk->bhts", q.astype(F32), sel.astype(F32)) * scale)
        masks.append(ok)
        values.append(sel)
    else:
        cap = pool.shape[1]
        chosen = (
            jnp.zeros((b, c, cap), bool)
            .at[jnp.arange(b)[:, None, None], jnp.arange(c)[None, :, None], top]
            .set(ok)
        )
        logits.append(jnp.einsum("bthk,bsk->bhts", q.astype(F32), pool.astype(F32)) * scale)
        masks.append(chosen)
        values.append(pool)


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
        cfg.hc_sinkhorn_unroll,
    )


def hc_mix(
    h: jax.Array, fn, base, scale, iters: int, eps: float, norm_eps: float, unroll: bool | None = None
):
    """mHC coefficients of streams h [..., n, d] without collapsing: (pre f32[..., n], post, comb f32[..., n, n])."""
    n = h.shape[-2]
    flat = h.reshape(*h.shape[:-2], -1).astype(F32)
    flat = flat * jax.lax.rsqrt(jnp.mean(flat * flat, axis=-1, keepdims=True) + norm_eps)
    mix = flat @ fn.astype(F32).T
    pre = jax.nn.sigmoid(mix[..., :n] * scale[0] + base[:n]) + eps
    post = 2.0 * jax.nn.sigmoid(mix[..., n : 2 * n] * scale[1] + base[n : 2 * n])
    comb = sinkhorn(
        (mix[..., 2 * n :] * scale[2] + base[2 * n :]).reshape(*mix.shape[:-1], n, n), iters, eps, unroll
    )
    return pre, post, comb


def _collapse(h: jax.Array, pre: jax.Array) -> jax.Array:
    return jnp.sum(pre[..., None] * h, axis=-2).astype(h.dtype)


def _sublayer_mix(h: jax.Array, pre, lp: dict, prefix: str, cfg: ModelConfig):
    """(block input, post, comb, pre for the next sublayer). Deferred mHC: the mix of this sublayer's
    input streams gives its post / comb and the next sublayer's pre; its own pre came from before."""
    if not cfg.hc_deferred:
        x, post, comb = hc_pre(h, *_hc_args(lp, prefix, cfg))
        return x, post, comb, None
    nxt, post, comb = hc_mix(h, *_hc_args(lp, prefix, cfg))
    return _collapse(h, pre), post, comb, nxt


def logits_from_hidden(params: dict, h: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Collapse the streams h [..., n, d], final norm, head: f32[..., vocab].

    With deferred mHC, `extend` has already weighted the streams by the last sublayer's pre, so the
    collapse is a sum (V4.1 has no hc_head tensors)."""
    if cfg.hc_deferred:
        x = jnp.sum(h.astype(F32), axis=-2).astype(h.dtype)
    else:
        x = hc_head(
            h,
            params["hc_head_fn"],
            params["hc_head_base"],
            params["hc_head_scale"],
            cfg.hc_eps,
            cfg.rms_norm_eps,
        )
    x = rms_norm(x, params["norm"]["weight"], cfg.rms_norm_eps)
    return linear(x, params["head"]["weight"]).astype(F32)


def _engram_ids(params: dict, tokens: jax.Array, state: dict, cfg: ModelConfig):
    """Row ids int32[engram layers, b, c, cols] of the chunk, from the token history in the state."""
    n = cfg.engram_max_ngram_size
    hist = state["history"][:, state["history"].shape[1] - (n - 1) :]
    # Entries for positions before 0 are none, whatever a reused row holds there.
    hist = jnp.where(state["lengths"][:, None] - (n - 1) + jnp.arange(n - 1) >= 0, hist, -1)
    win = jnp.concatenate([hist, tokens], axis=1)
    tmap = params["engram_token_map"]
    comp = jnp.where(win >= 0, tmap[jnp.clip(win, 0, tmap.shape[0] - 1)], tmap[cfg.engram_pad_id])
    return engram.hash_ids(cfg, comp.astype(jnp.int32))


def _take_tail(x: jax.Array, start: jax.Array, keep: int, axis: int = 1) -> jax.Array:
    idx = start[:, None] + jnp.arange(keep)
    idx = idx.reshape(idx.shape + (1,) * (x.ndim - axis - 1))
    if axis == 1:
        return jnp.take_along_axis(x, idx, axis=1)
    return jnp.take_along_axis(x, idx[None], axis=axis)


def run_layers(
    params: dict,
    tokens,
    state: dict,
    cfg: ModelConfig,
    valid=None,
    moe_impl="grouped",
    keep: int = 0,
    kernels: str = "auto",
):
    """`extend` plus what the drafter needs: (streams, state, {target layer: mean attention input [b, c', d]}).

    keep > 0 (SWA bounded replay, prefill only): layers after the last KV source run over only the
    last `keep` real tokens of each row, their window keys starting at that replay start; the streams
    returned are then those `keep` positions (row r's last real token at min(valid[r], keep) - 1).
    A state holding "expert_counts" int32[layers, e] gets its valid tokens' router choices added.
    kernels: how decode steps run attention and the indexer, and every chunk its FP8 weights in DeepGEMM's
    layout (see `layers.KERNEL_CHOICES`).
    """
    b, c = tokens.shape
    valid = jnp.full((b,), c, jnp.int32) if valid is None else valid.astype(jnp.int32)
    pos0 = state["lengths"]
    h = _embed(params, tokens, cfg)
    pre = jnp.full((b, c, cfg.hc_mult), 1.0 / cfg.hc_mult, F32) if cfg.hc_deferred else None
    new_state = {"lengths": pos0 + valid}
    ids = None
    if cfg.engram_layer_ids:
        ids = _engram_ids(params, tokens, state, cfg)
        hist = jnp.concatenate([state["history"], tokens], axis=1)
        new_state["history"] = refill_ring(hist[..., None], valid, state["history"].shape[1])[..., 0]
    toks, p0, vl, floor = tokens, pos0, valid, None
    new_layers, sel, aux, counts = [], {}, {}, []
    for i, (lp, st) in enumerate(zip(params["layers"], state["layers"])):
        if keep and c > keep and i == cfg.last_kv_source + 1:  # bounded replay from here on
            start = jnp.clip(valid - keep, 0, c - keep)
            h, pre, toks = (
                _take_tail(h, start, keep),
                _take_tail(pre, start, keep),
                _take_tail(tokens, start, keep),
            )
            ids = None if ids is None else _take_tail(ids, start, keep, axis=2)
            tail = functools.partial(_take_tail, start=start, keep=keep)
            sel = {k: tuple(map(tail, v)) if isinstance(v, tuple) else tail(v) for k, v in sel.items()}
            p0, vl = pos0 + start, valid - start
            floor = jnp.where(start > 0, p0, 0)
        with jax.named_scope(f"layer{i}"):
            if "engram" in lp:
                e_ids = ids[cfg.engram_layer_ids.index(i)]
                h = engram.engram_apply(lp["engram"], h, e_ids, cfg, _fp8_impl(h, kernels))
            if i in cfg.dspark_target_layer_ids:
                aux[i] = jnp.mean(h.astype(F32), axis=-2).astype(h.dtype)
            x, post, comb, pre = _sublayer_mix(h, pre, lp, "hc_attn", cfg)
            src = cfg.kv_source(i) if cfg.is_v41 else None
            shared = new_layers[src] if src is not None and src < i else None
            y, st = attention_extend(
                lp["attn"], rms_norm(x, lp["attn_norm"]["weight"], cfg.rms_norm_eps), st, p0, vl, cfg, i,
                shared, sel, floor, kernels,
            )  # fmt: skip
            h = hc_post(y, h, post, comb)
            x, post, comb, pre = _sublayer_mix(h, pre, lp, "hc_ffn", cfg)
            real = jnp.arange(toks.shape[1])[None, :] < vl[:, None]
            xn = rms_norm(x, lp["ffn_norm"]["weight"], cfg.rms_norm_eps)
            y, cnt = moe_with_counts(xn, lp["ffn"], cfg, toks, moe_impl, real, _fp8_impl(xn, kernels))
            counts.append(cnt)
            h = hc_post(y, h, post, comb)
            new_layers.append(st)
    if cfg.hc_deferred:  # the last sublayer's pre weights the streams for the head
        h = (pre[..., None] * h).astype(h.dtype)
    new_state["layers"] = new_layers
    if "expert_counts" in state:
        new_state["expert_counts"] = state["expert_counts"] + jnp.stack(counts)
    return h, new_state, aux


def extend(
    params: dict,
    tokens: jax.Array,
    state: dict,
    cfg: ModelConfig,
    valid=None,
    moe_impl: str = "grouped",
    keep=0,
    kernels: str = "auto",
):
    """Feed a chunk tokens int[b, c] at positions state['lengths'] + j; the first valid[b] are real.

    The one step function behind forward, prefill, chunked prefill and decode. Returns the last
    layer's streams [b, c, n, d] and the state with lengths += valid (rows with valid 0 are untouched).
    `keep` > 0 turns on SWA bounded replay (see `run_layers`); `kernels` picks the decode kernels and how
    FP8 weights run ("auto", "ref", "off": see `layers.KERNEL_CHOICES`).
    """
    h, state, _ = run_layers(params, tokens, state, cfg, valid, moe_impl, keep, kernels)
    return h, state


def forward(
    params: dict, tokens: jax.Array, cfg: ModelConfig, moe_impl: str = "grouped", kernels: str = "auto"
) -> jax.Array:
    """Teacher-forced logits f32[b, t, vocab] for tokens int[b, t] from position 0 (a throwaway state);
    `kernels` as `extend`'s."""
    b, t = tokens.shape
    h, _ = extend(params, tokens, init_state(cfg, b, t), cfg, moe_impl=moe_impl, kernels=kernels)
    return logits_from_hidden(params, h, cfg)


# ---- decoder state ---------------------------------------------------------------------------------------
def init_state(cfg: ModelConfig, batch: int, max_len: int, spare: int = 0) -> dict:
    """Empty decoder state for `batch` rows of up to `max_len` tokens, rollback-able by up to `spare` tokens.

    Per layer: "window" [b, sliding_window + spare, k] ring of roped K=V rows (slot = position % size);
    on layers owning a compressor (V4: every compressed layer; V4.1: KV sources only) "pool"
    [b, ceil(max_len / m), k] of compressed entries and the pending raw projections "ring_kv" /
    "ring_gate" [b, R + spare, c k] (R = 2m for CSA, m otherwise); CSA layers and V4.1 KV sources
    also "index_pool" [b, C, index_head_dim] (CSA: with "iring_kv" / "iring_gate"). With Engram,
    "history" int32[b, max_ngram - 1 + spare] holds the tokens before the next position (-1 = none).
    "lengths" int32[b].
    """
    dt = jnp.dtype(cfg.dtype)
    k, ik = cfg.head_dim, cfg.index_head_dim
    layers = []
    for i in range(cfg.num_hidden_layers):
        ltype, m = cfg.layer_type(i), cfg.compress_ratios[i]
        st = {"window": jnp.zeros((batch, cfg.sliding_window + spare, k), dt)}
        owns = m and (not cfg.is_v41 or i in cfg.kv_source_layer_ids)
        if owns:
            c = 2 if ltype == CSA else 1
            ring = (2 * m if ltype == CSA else m) + spare
            cap = max(1, -(-max_len // m))
            st.update(
                pool=jnp.zeros((batch, cap, k), dt),
                ring_kv=jnp.zeros((batch, ring, c * k), dt),
                ring_gate=jnp.zeros((batch, ring, c * k), dt),
            )
            if cfg.is_v41:
                st["index_pool"] = jnp.zeros((batch, cap, ik), dt)
            elif ltype == CSA:
                st.update(
                    index_pool=jnp.zeros((batch, cap, ik), dt),
                    iring_kv=jnp.zeros((batch, ring, 2 * ik), dt),
                    iring_gate=jnp.zeros((batch, ring, 2 * ik), dt),
                )
        layers.append(st)
    state = {"layers": layers, "lengths": jnp.zeros((batch,), jnp.int32)}
    if cfg.engram_layer_ids:
        state["history"] = jnp.full((batch, cfg.engram_max_ngram_size - 1 + spare), -1, jnp.int32)
    return state


def rollback(state: dict, lengths: jax.Array) -> dict:
    """The state as it was at the earlier `lengths` int32[b] (each at most `spare` tokens back).

    Nothing is erased: window and compressor rings keep `spare` extra slots, so the rows the next
    step reads are still there; pool entries past the new length are invisible until rewritten
    (with the same values) as their windows close again; the token history shifts back.
    """
    out = dict(state)
    back = state["lengths"] - lengths
    if "history" in state:
        hist = state["history"]
        idx = jnp.arange(hist.shape[1])[None, :] - back[:, None]
        out["history"] = jnp.where(idx >= 0, jnp.take_along_axis(hist, jnp.clip(idx, 0), axis=1), -1)
    out["lengths"] = lengths.astype(jnp.int32)
    return out


def prefill(
    params: dict,
    tokens: jax.Array,
    lengths: jax.Array,
    cfg: ModelConfig,
    max_len: int,
    moe_impl="grouped",
    keep: int | None = None,
    spare: int = 0,
    count_experts: bool = False,
    kernels: str = "auto",
):
    """Right-padded prompts tokens [b, t] with true lengths [b] -> (logits f32[b, v] at each last token, state).

    keep: SWA bounded replay length (None: the config's `replay_keep_tokens`; 0: exact prefill).
    count_experts: the state carries "expert_counts" int32[layers, e], the router's choices so far.
    kernels: how the FP8 weights in DeepGEMM's layout run (`extend`'s).
    """
    b, t = tokens.shape
    keep = cfg.replay_keep_tokens if keep is None else keep
    keep = keep if cfg.is_v41 and keep and t > keep else 0
    state = init_state(cfg, b, max(max_len, t), spare)
    if count_experts:
        state["expert_counts"] = jnp.zeros((cfg.num_hidden_layers, cfg.n_routed_experts), jnp.int32)
    h, state = extend(params, tokens, state, cfg, lengths, moe_impl, keep, kernels)
    last = (jnp.minimum(lengths, keep) if keep else lengths) - 1
    h = jnp.take_along_axis(h, last[:, None, None, None], axis=1)[:, 0]
    return logits_from_hidden(params, h, cfg), state


def decode_step(
    params: dict,
    tokens: jax.Array,
    state: dict,
    cfg: ModelConfig,
    moe_impl: str = "grouped",
    kernels: str = "auto",
):
    """Feed tokens int[b] at positions state['lengths']; return (logits f32[b, v], state with lengths + 1)."""
    h, state = extend(params, tokens[:, None], state, cfg, moe_impl=moe_impl, kernels=kernels)
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


# ---- sizes --------------------------------------------------------------------------------------------------
def _category(name: str) -> str:
    if name.startswith("mtp."):
        return "drafter"
    if ".engram." in name:
        return "engram"
    if ".ffn.experts." in name:
        return "experts"
    if ".attn." in name:
        return "attention"
    return "other"


def bytes_by_category(cfg: ModelConfig) -> dict[str, dict[str, int]]:
    """Parameters and bytes per category: experts, attention, engram, drafter, other.

    Bytes are in the declared dtypes, except routed experts of a config with `expert_dtype="fp4"`
    (V4.1-Flash), which count at their packed FP4 size (0.5 byte a value + a UE8M0 byte per 32).

    Works from the declaration alone (nothing is allocated), so it runs for the full-size models.
    """
    from djax.fp4 import stored_nbytes
    from djax.params import _dtype, flatten_names

    out: dict[str, dict[str, int]] = {}
    for name, p in flatten_names(declare(cfg)).items():
        n = int(np.prod(p.shape))
        row = out.setdefault(_category(name), {"params": 0, "bytes": 0})
        row["params"] += n
        row["bytes"] += stored_nbytes(name, p.shape, _dtype(p, cfg).itemsize, cfg.expert_dtype)
    return out
