"""Train the embedded tiny models on the Python stdlib, and evaluate them.

djax-tiny-v4 (`--arch v4`, the default): the DeepSeek-V4-Flash architecture at toy size.

    python scripts/train_tiny.py train --out runs/djax-tiny-v4 --steps 826 --max-shard-mb 12
    python scripts/train_tiny.py repack --src runs/djax-tiny-v4 --out djax/assets/djax-tiny-v4
    python scripts/train_tiny.py evaluate --checkpoint djax/assets/djax-tiny-v4 --hf

The shipped weights came from the first line on one H200 (161 s of training at 196 ms/step, seed 0,
the CPython 3.11.7 standard library passed as --stdlib; that run gave `--seconds 230` and the
budget came to 826 steps, the same schedule as `--steps 826`); its log is the asset's train_log.json.

djax-tiny (`--arch v41`): the DeepSeek-V4.1 architecture at toy size (TINY_V41: compressed KV shared
across layers at ratios 2 and 1, the two-level indexer, Engram n-gram memory, deferred mHC; no
DSpark drafter yet).

    python scripts/train_tiny.py train --arch v41 --out runs/djax-tiny --steps 1843 --batch 120 --max-shard-mb 12
    python scripts/train_tiny.py repack --src runs/djax-tiny --out djax/assets/djax-tiny
    python scripts/train_tiny.py evaluate --checkpoint djax/assets/djax-tiny --max-files 50

The shipped weights came from the first line's schedule on one H200 (seed 0, the CPython 3.11.7
standard library as --stdlib; `--seconds 380` came to 1843 steps at 180 ms/step, 364 s of training
after a 49 s first step). That run's time limit stopped it in the held-out evaluation after the
weights were saved, so the asset's train_log.json is read off its progress bar. The training step
keeps mHC's Sinkhorn loop rolled (`hc_sinkhorn_unroll=False`): unrolled, the V4.1 step (seven
layers in order, forward and backward) held twice the kernels and took 9 minutes to compile.

(HF transformers has no V4.1 class, so `evaluate --hf` is for djax-tiny-v4 only.)

The corpus is `stdlib_corpus.py`'s (held-out split fixed by file name), tokenized with the shipped
byte-level BPE tokenizer, one `<bos> file <eos>` document after another. Training: AdamW (optax)
on random windows of the training stream, drawn from the seed; warmup then cosine decay. Besides
the next-token loss, two pieces of DeepSeek's recipe that gradients alone do not give: the router
bias of the learned MoE layers follows the auxiliary-loss-free balancing rule (bias += rate *
sign(mean load - load)), and the lightning indexer learns from a KL loss towards the main
attention's distribution over the compressed entries (its inputs detached, as in DeepSeek-V3.2),
since its top-k choice passes no gradient: V4's indexer at each CSA layer; V4.1's at each index
source, whose query weights learn from its own layer's attention and whose key projection (on the
KV source's compressor latent) from every index source reading that pool. The V4.1 KL target is the
attention over all visible entries, the candidate-block restriction of the two-level indexer aside.
The V4 step runs a scanned twin of the model's blocks; the V4.1 step runs the model's own blocks
in layer order (`train_forward_v41`, tested equal to `deepseek_v4.forward`). The weights are saved
in bf16 (the norms, mHC and biases in float32; V4.1's Engram token map as int32) with config.json's
dtype float32: djax and HF transformers compute in float32 by default.

V4.1's Engram hashes n-grams of compressed token ids. DeepSeek builds the token -> compressed id map
from its tokenizer (text normalisation); djax declares it as the int32 tensor `engram_token_map`
and builds it with `djax.models.engram.compressed_token_map` (the shipped tokenizer: 8192 -> 4986
ids). It ships in model.safetensors like any weight.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stdlib_corpus import corpus_files  # noqa: E402

import djax  # noqa: E402
from djax.config import CSA  # noqa: E402
from djax.models import deepseek_v4 as v4  # noqa: E402
from djax.models import engram  # noqa: E402
from djax.models.engram import compressed_token_map  # noqa: E402
from djax.models.layers import rms_norm  # noqa: E402
from djax.models.mhc import hc_post, hc_pre  # noqa: E402
from djax.models.moe import moe, route  # noqa: E402

ASSETS = Path(__file__).resolve().parents[1] / "djax" / "assets"
ASSET = ASSETS / "djax-tiny-v4"  # also where the shared tokenizer lives
BOS, EOS = 0, 1

# Every V4 layer type at a size that ships (< 25 MB in bf16) and decodes fast on a laptop CPU:
# two sliding-window-only layers, then CSA (ratio 4, indexer keeping 16 entries) and HCA (ratio 16)
# alternating; mHC with 4 streams; 8 routed experts (top 2) + 1 shared; the first 2 MoE layers hashed.
TINY_V4 = djax.ModelConfig(
    vocab_size=8192,
    hidden_size=256,
    num_hidden_layers=6,
    num_attention_heads=4,
    head_dim=64,
    qk_rope_head_dim=16,
    q_lora_rank=128,
    o_lora_rank=64,
    o_groups=2,
    sliding_window=64,
    compress_ratios=(0, 0, 4, 16, 4, 16),
    index_n_heads=8,
    index_head_dim=32,
    index_topk=16,
    hc_mult=4,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    moe_intermediate_size=128,
    num_hash_layers=2,
    num_nextn_predict_layers=0,
    rope_factor=4.0,
    original_max_position_embeddings=1024,
    # HF transformers' YaRN is only consistent with the factor when max = factor * original.
    max_position_embeddings=4096,
    bos_token_id=BOS,
    eos_token_id=(EOS,),
    dtype="float32",
)


def _sized_engram_tables(cfg: djax.ModelConfig) -> djax.ModelConfig:
    """The config with each Engram layer's table rows set to the sum of its (order, head) prime buckets."""
    primes = engram.bucket_primes(cfg).reshape(len(cfg.engram_layer_ids), -1)
    return cfg.replace(engram_num_embeddings=tuple(int(r) for r in primes.sum(1)))


# Every V4.1 feature at a size that ships (< 25 MB in bf16, Engram tables included) and decodes fast on
# a laptop CPU: a sliding-window layer, then three layers on one ratio-2 pool (KV source 1) and three on
# one ratio-1 pool (KV source 4). Index sources 1, 4 and 6; layer 4 is also the candidate source, so
# layer 6 picks its entries inside layer 4's best blocks; 2, 3 and 5 reuse the selection below them.
# Engram (2- and 3-grams, 4 hash heads) before layers 1 and 4; mHC with 4 streams, deferred; 8 routed
# experts (top 2) + 1 shared, no hash layers; no DSpark drafter yet.
TINY_V41 = _sized_engram_tables(
    djax.ModelConfig(
        model_type="deepseek_v41",
        vocab_size=8192,
        hidden_size=256,
        num_hidden_layers=7,
        num_attention_heads=4,
        head_dim=64,
        qk_rope_head_dim=16,
        q_lora_rank=128,
        o_lora_rank=64,
        o_groups=2,
        sliding_window=64,
        compress_ratios=(0, 2, 2, 2, 1, 1, 1),
        kv_source_layer_ids=(1, 4),
        index_source_layer_ids=(1, 4, 6),
        candidate_source_layer_id=4,
        candidate_topk_blocks=8,
        candidate_block_size=8,
        index_n_heads=8,
        index_head_dim=32,
        index_topk=32,
        hc_mult=4,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        moe_intermediate_size=96,
        num_hash_layers=0,
        num_nextn_predict_layers=0,
        rope_factor=4.0,
        original_max_position_embeddings=1024,
        max_position_embeddings=4096,
        engram_layer_ids=(1, 4),
        engram_num_embeddings=(0, 0),  # set from the bucket primes
        engram_max_ngram_size=3,
        engram_n_heads=4,
        engram_head_dim=32,
        engram_vocab_size=1009,
        # Before a document's <bos> the training stream holds the previous one's <eos>: the same
        # n-grams as a prompt's start, where the history is padding.
        engram_pad_id=EOS,
        engram_compressed_vocab_size=4986,  # `engram_token_map` of the shipped tokenizer
        replay_keep_tokens=76,  # sliding_window + 12, as V4.1-Flash's 140 = 128 + 12
        bos_token_id=BOS,
        eos_token_id=(EOS,),
        dtype="float32",
    )
)
ARCHS = {"v4": (TINY_V4, "djax-tiny-v4"), "v41": (TINY_V41, "djax-tiny")}


# ---- data --------------------------------------------------------------------------------------------
def load_tokenizer(path: str | Path | None = None):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path or ASSET / "tokenizer.json"))


def encode_files(tokenizer, texts: list[str]) -> list[np.ndarray]:
    """Each text as int32 ids `<bos> ... <eos>` (the tokenizer prepends bos)."""
    return [np.asarray([*e.ids, EOS], np.int32) for e in tokenizer.encode_batch(texts)]


def engram_token_map(tokenizer) -> tuple[np.ndarray, int]:
    """Engram's token -> compressed id map int32[vocab] and the id count (DeepSeek's normalisation rule)."""
    return compressed_token_map(tokenizer)


def file_windows(ids: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """One token stream cut into windows: inputs int32[m, seq_len] (0-padded), targets int32[m, seq_len] (-1 = none).

    Window j predicts tokens j seq_len + 1 .. (j + 1) seq_len from the window's own tokens only.
    """
    inputs, targets = [], []
    for s in range(0, len(ids) - 1, seq_len):
        x, y = ids[s : s + seq_len], ids[s + 1 : s + seq_len + 1]
        inputs.append(np.pad(x, (0, seq_len - len(x))))
        targets.append(np.pad(y, (0, seq_len - len(y)), constant_values=-1))
    return np.stack(inputs).astype(np.int32), np.stack(targets).astype(np.int32)


def heldout_windows(tokenizer, stdlib: str | None, seq_len: int, max_files: int | None = None):
    """The held-out files cut into windows (`file_windows` of each file's stream `<bos> ... <eos>`, stacked)."""
    files = corpus_files(stdlib, "heldout")[:max_files]
    pieces = [file_windows(ids, seq_len) for ids in encode_files(tokenizer, [t for _, t in files])]
    return np.concatenate([x for x, _ in pieces]), np.concatenate([y for _, y in pieces])


def nll_sum(logits: np.ndarray | jax.Array, targets) -> tuple[float, int]:
    """Summed negative log-likelihood (float64) of targets (-1 = skip) under logits [..., v], and the count."""
    logits = np.asarray(logits, np.float64)
    targets = np.asarray(targets)
    mask = targets >= 0
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    picked = np.take_along_axis(logits, np.maximum(targets, 0)[..., None], -1)[..., 0]
    return float(((lse - picked) * mask).sum()), int(mask.sum())


# ---- the training forward: the model's own blocks, plus what the recipe needs -------------------------
def _attention_kl(q, pool, visible, scores, head_dim: int):
    """KL(main attention over the visible pool entries || softmax of the indexer scores), mean over queries.

    q: [b, t, h, k] main queries; pool: [b, C, k]; visible: bool[b, t, C]; scores: f32[b, t, C]. The
    target is each head's softmax over the visible entries, averaged over heads, without gradient.
    """
    logits = jnp.einsum("bthk,bsk->bhts", q, pool) * head_dim**-0.5
    target = jax.nn.softmax(jnp.where(visible[:, None], logits, -jnp.inf), axis=-1).mean(1)
    target = jax.lax.stop_gradient(jnp.where(visible, target, 0.0))  # [b, t, C]
    logp = jax.nn.log_softmax(jnp.where(visible, scores, -jnp.inf), axis=-1)
    kl = jnp.sum(jnp.where(visible, target * (jnp.log(jnp.maximum(target, 1e-30)) - logp), 0.0), -1)
    has = visible.any(-1)
    return jnp.sum(jnp.where(has, kl, 0.0)) / jnp.maximum(has.sum(), 1)


def _route_load(xn, gate: dict, cfg) -> jax.Array:
    """Fraction of the routed slots that go to each expert, f32[e], for the MoE input xn [..., d] (no gradient)."""
    _, idx = route(jax.lax.stop_gradient(xn).reshape(-1, xn.shape[-1]), gate, cfg)
    return jnp.zeros((cfg.n_routed_experts,), jnp.float32).at[idx.reshape(-1)].add(1.0) / idx.size


def _indexer_kl(p: dict, xn, st0: dict, pool, cfg, layer: int):
    """KL(main attention over the visible compressed entries || indexer distribution), mean over queries.

    The target is each head's softmax over the visible pool entries, averaged over heads; the
    indexer sees detached inputs, so this loss trains the indexer alone.
    """
    b, t, _ = xn.shape
    ratio = cfg.compress_ratios[layer]
    pos = jnp.broadcast_to(jnp.arange(t)[None], (b, t))
    xs = jax.lax.stop_gradient(xn)
    q_res, q, _ = v4._q_kv(p, xs, pos, cfg, v4._rope(cfg, CSA))
    pool = jax.lax.stop_gradient(pool)
    cap = pool.shape[1]
    visible = jnp.arange(cap)[None, None, :] < ((pos + 1) // ratio)[..., None]  # [b, t, cap]
    st = {k: st0[k] for k in ("index_pool", "iring_kv", "iring_gate")}
    ip = p["indexer"]
    zero = jnp.zeros((b,), jnp.int32)
    v4.compressor_extend(
        ip["compressor"],
        xs,
        st,
        ("index_pool", "iring_kv", "iring_gate"),
        zero,
        zero + t,
        cfg,
        ratio,
        True,
        cfg.index_head_dim,
    )
    iq, iw = v4._indexer_query(ip, xs, q_res, pos, cfg)
    return _attention_kl(q, pool, visible, v4.index_scores(iq, st["index_pool"], iw, cfg), cfg.head_dim)


def _kind(cfg, i: int) -> tuple:
    return cfg.layer_type(i), cfg.compress_ratios[i], cfg.is_hash_layer(i)


def layer_segments(cfg) -> list[tuple[int, int, int]]:
    """The layers as (start, period, repeats) runs of a repeating pattern of layer kinds, in order.

    Each run becomes one `lax.scan` over its repeats, so the step compiles one body per pattern
    rather than one per layer (TINY_V4: layers 0-1 as 2 x [sliding], layers 2-5 as 2 x [CSA, HCA]).
    """
    n, i, out = cfg.num_hidden_layers, 0, []
    while i < n:
        best = (1, 1)
        for period in range(1, 4):
            reps = 1
            while i + (reps + 1) * period <= n and all(
                _kind(cfg, i + reps * period + j) == _kind(cfg, i + j) for j in range(period)
            ):
                reps += 1
            if reps > 1 and period * reps > best[0] * best[1]:
                best = (period, reps)
        out.append((i, *best))
        i += best[0] * best[1]
    return out


def _layer(lp: dict, st0: dict, h, tokens, pos0, valid, cfg, i: int, moe_impl: str):
    """One block as `deepseek_v4.extend` runs it; also the indexer KL (CSA) and the expert load (learned MoE)."""
    kl = load = None
    x, post, comb = hc_pre(h, *v4._hc_args(lp, "hc_attn", cfg))
    xn = rms_norm(x, lp["attn_norm"]["weight"], cfg.rms_norm_eps)
    y, st = v4.attention_extend(lp["attn"], xn, st0, pos0, valid, cfg, i)
    if cfg.layer_type(i) == CSA:
        kl = _indexer_kl(lp["attn"], xn, st0, st["pool"], cfg, i)
    h = hc_post(y, h, post, comb)
    x, post, comb = hc_pre(h, *v4._hc_args(lp, "hc_ffn", cfg))
    xn = rms_norm(x, lp["ffn_norm"]["weight"], cfg.rms_norm_eps)
    h = hc_post(moe(xn, lp["ffn"], cfg, tokens, moe_impl), h, post, comb)
    if not cfg.is_hash_layer(i):
        load = _route_load(xn, lp["ffn"]["gate"], cfg)
    return h, kl, load


def train_forward(params: dict, tokens: jax.Array, cfg, moe_impl: str = "dense"):
    """`deepseek_v4.forward`, also returning the mean KL loss of the CSA indexers and each learned MoE
    layer's expert load (fraction of routed slots per expert, f32[layers, e], in segment order).

    The same blocks as `deepseek_v4.extend` from an empty state, with repeating layers scanned;
    training uses the dense MoE twin (plain matmuls).
    """
    b, t = tokens.shape
    state = v4.init_state(cfg, b, t)
    pos0, valid = state["lengths"], jnp.full((b,), t, jnp.int32)
    h = v4._embed(params, tokens, cfg)
    kls, loads = [], []

    def stack(trees):
        return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)

    for start, period, reps in layer_segments(cfg):
        xs = [
            (
                stack([params["layers"][start + r * period + j] for r in range(reps)]),
                stack([state["layers"][start + r * period + j] for r in range(reps)]),
            )
            for j in range(period)
        ]

        def body(h, xs, start=start):
            outs = []
            for j, (lp, st0) in enumerate(xs):
                h, kl, load = _layer(lp, st0, h, tokens, pos0, valid, cfg, start + j, moe_impl)
                outs.append((kl, load))
            return h, outs

        h, outs = jax.lax.scan(body, h, xs)
        for kl, load in outs:
            kls += [] if kl is None else [kl]
            loads += [] if load is None else [load]
    logits = v4.logits_from_hidden(params, h, cfg)
    kl = jnp.mean(jnp.concatenate(kls)) if kls else jnp.float32(0.0)
    return logits, kl, jnp.concatenate(loads) if loads else jnp.zeros((0, cfg.n_routed_experts))


# ---- V4.1: the model's own layer loop, plus the expert loads and the indexer KL ------------------------
def _detached_index_keys(p: dict, xn, st0: dict, cfg, layer: int) -> jax.Array:
    """KV source `layer`'s index keys [b, C, index_head_dim] over the chunk xn [b, t, d] from position 0,
    with the compressor and its input detached: the KL reaches the key projection (wk, k_norm) only."""
    b, t, _ = xn.shape
    zero = jnp.zeros((b,), jnp.int32)
    st = dict(st0)
    ix = p["indexer"]
    v4.compressor_extend(
        jax.lax.stop_gradient(p["compressor"]), jax.lax.stop_gradient(xn), st,
        ("pool", "ring_kv", "ring_gate"), zero, zero + t, cfg, cfg.compress_ratios[layer], False,
        cfg.head_dim, index=(ix["wk"], ix["k_norm"]),
    )  # fmt: skip
    return st["index_pool"]


def _indexer_kl_v41(p: dict, xn, pool, keys, cfg, layer: int):
    """Index source `layer`: KL(its main attention over the visible entries of its KV source's pool ||
    its indexer's distribution over them), with the index keys `keys` of `_detached_index_keys`."""
    b, t, _ = xn.shape
    pos = jnp.broadcast_to(jnp.arange(t)[None], (b, t))
    xs = jax.lax.stop_gradient(xn)
    q_res, q, _ = v4._q_kv(p, xs, pos, cfg, v4._rope(cfg, cfg.layer_type(layer)))
    pool = jax.lax.stop_gradient(pool)
    visible = jnp.arange(pool.shape[1])[None, None, :] < ((pos + 1) // cfg.compress_ratios[layer])[..., None]
    iq, iw = v4._indexer_query(p["indexer"], xs, jax.lax.stop_gradient(q_res), pos, cfg)
    return _attention_kl(q, pool, visible, v4.index_scores(iq, keys, iw, cfg), cfg.head_dim)


def train_forward_v41(params: dict, tokens: jax.Array, cfg, moe_impl: str = "dense"):
    """`deepseek_v4.forward` of a V4.1 config (`run_layers`' calls, in layer order, from an empty state),
    also returning the mean indexer KL over the index sources and each layer's expert load f32[layers, e]."""
    b, t = tokens.shape
    state = v4.init_state(cfg, b, t)
    pos0, valid = state["lengths"], jnp.full((b,), t, jnp.int32)
    h = v4._embed(params, tokens, cfg)
    pre = jnp.full((b, t, cfg.hc_mult), 1.0 / cfg.hc_mult, jnp.float32)
    ids = v4._engram_ids(params, tokens, state, cfg) if cfg.engram_layer_ids else None
    done, sel, keys, kls, loads = [], {}, {}, [], []
    for i, (lp, st0) in enumerate(zip(params["layers"], state["layers"])):
        if "engram" in lp:
            h = engram.engram_apply(lp["engram"], h, ids[cfg.engram_layer_ids.index(i)], cfg)
        x, post, comb, pre = v4._sublayer_mix(h, pre, lp, "hc_attn", cfg)
        xn = rms_norm(x, lp["attn_norm"]["weight"], cfg.rms_norm_eps)
        src = cfg.kv_source(i)
        shared = done[src] if src is not None and src < i else None
        y, st = v4.attention_extend(lp["attn"], xn, st0, pos0, valid, cfg, i, shared, sel)
        if src == i:
            keys[i] = _detached_index_keys(lp["attn"], xn, st0, cfg, i)
        if i in cfg.index_source_layer_ids:
            pool = (st if src == i else done[src])["pool"]
            kls.append(_indexer_kl_v41(lp["attn"], xn, pool, keys[src], cfg, i))
        h = hc_post(y, h, post, comb)
        x, post, comb, pre = v4._sublayer_mix(h, pre, lp, "hc_ffn", cfg)
        xn = rms_norm(x, lp["ffn_norm"]["weight"], cfg.rms_norm_eps)
        h = hc_post(moe(xn, lp["ffn"], cfg, tokens, moe_impl), h, post, comb)
        loads.append(_route_load(xn, lp["ffn"]["gate"], cfg))
        done.append(st)
    h = (pre[..., None] * h).astype(h.dtype)  # the last sublayer's pre weights the streams for the head
    kl = jnp.mean(jnp.stack(kls)) if kls else jnp.float32(0.0)
    return v4.logits_from_hidden(params, h, cfg), kl, jnp.stack(loads)


def _split(params):
    """(float leaves, integer leaves) of the params, each with None where the other has a leaf."""
    floating = jax.tree.map(lambda x: x if jnp.issubdtype(x.dtype, jnp.floating) else None, params)
    ints = jax.tree.map(lambda x: None if jnp.issubdtype(x.dtype, jnp.floating) else x, params)
    return floating, ints


def _merge(floating, ints):
    return jax.tree.map(lambda f, i: f if i is None else i, floating, ints, is_leaf=lambda x: x is None)


def _gate_biases(cfg) -> list[int]:
    """The learned-routing layers in the order the training forward reports their loads."""
    if cfg.is_v41:  # no hash layers; `train_forward_v41` goes in layer order
        return list(range(cfg.num_hidden_layers))
    order = [
        start + r * period + j
        for start, period, reps in layer_segments(cfg)
        for j in range(period)
        for r in range(reps)
    ]
    return [i for i in order if not cfg.is_hash_layer(i)]


def flat_layout(floating, cfg):
    """The trainable weights as one vector: (vector f32[n], unravel, weight-decay mask f32[n], bias offsets).

    The optimizer works on the one vector, so the step holds a handful of large ops rather than a
    dozen per weight (its compile time is dominated by that otherwise). Decay applies to matrices
    only; the bias offsets (one per learned-routing layer, in `_gate_biases` order) let the
    balancing rule update the router biases in place.
    """
    from jax.flatten_util import ravel_pytree

    vec, unravel = ravel_pytree(floating)
    mask = ravel_pytree(jax.tree.map(lambda x: jnp.full(x.shape, float(x.ndim >= 2), jnp.float32), floating))[
        0
    ]
    offsets = []
    for i in _gate_biases(cfg):
        marker = jax.tree.map(jnp.zeros_like, floating)
        marker["layers"][i]["ffn"]["gate"]["bias"] = jnp.ones_like(marker["layers"][i]["ffn"]["gate"]["bias"])
        offsets.append(int(jnp.argmax(ravel_pytree(marker)[0])))
    return vec, unravel, mask, offsets


def make_optimizer():
    import optax

    # The learning rate and weight decay are applied in the step: the schedule is set after timing.
    return optax.chain(optax.clip_by_global_norm(1.0), optax.scale_by_adam(b1=0.9, b2=0.95, eps=1e-8))


def make_train_step(cfg, tx, unravel, ints, decay_mask, bias_offsets, args):
    """One jitted AdamW step on the flat weight vector over a batch of random windows of `data`."""
    e = cfg.n_routed_experts
    fwd = train_forward_v41 if cfg.is_v41 else train_forward

    def loss_fn(vec, tokens):
        logits, kl, loads = fwd(_merge(unravel(vec), ints), tokens[:, :-1], cfg)
        logp = jax.nn.log_softmax(logits, axis=-1)
        ce = -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))
        return ce + args.indexer_loss_weight * kl, (ce, kl, loads)

    @partial(jax.jit, donate_argnums=(0, 1))
    def step(vec, opt_state, data, key, lr):
        starts = jax.random.randint(key, (args.batch,), 0, data.shape[0] - args.seq_len - 1)
        tokens = jax.vmap(lambda s: jax.lax.dynamic_slice(data, (s,), (args.seq_len + 1,)))(starts)
        (_, (ce, kl, loads)), grad = jax.value_and_grad(loss_fn, has_aux=True)(vec, tokens.astype(jnp.int32))
        updates, new_opt = tx.update(grad, opt_state, vec)
        new_vec = vec - lr * (updates + args.weight_decay * decay_mask * vec)
        # Auxiliary-loss-free balancing: push under-loaded experts' selection bias up, over-loaded down.
        for j, off in enumerate(bias_offsets):
            new_vec = new_vec.at[off : off + e].add(
                args.balance_rate * jnp.sign(jnp.mean(loads[j]) - loads[j])
            )
        grad_norm = jnp.sqrt(jnp.sum(grad * grad))
        ok = jnp.isfinite(ce) & jnp.isfinite(grad_norm)
        metrics = {
            "loss": ce,
            "indexer_kl": kl,
            "max_load": jnp.max(loads) * e,
            "grad_norm": grad_norm,
            "skipped": ~ok,
        }
        keep = partial(jax.tree.map, lambda new, old: jnp.where(ok, new, old))
        return keep(new_vec, vec), keep(new_opt, opt_state), metrics

    return step


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warmup over `warmup` steps, then cosine decay to a tenth of the peak at `total`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


@partial(jax.jit, static_argnames="cfg")
def _eval_logits(params, tokens, cfg):
    # The routed experts as plain XLA batched GEMMs (8 experts: cheap), so the number does not hang on
    # the GPU kernels; the tests score it again through djax's default path.
    return v4.forward(params, tokens, cfg, moe_impl="batched")


def djax_perplexity(params, cfg, inputs, targets, batch: int = 8, progress: bool = False) -> dict:
    """Held-out perplexity from djax's forward (float64 accumulation of float32 logits).

    Matrix products at full float32 precision (no TF32 on GPUs), so a CPU run reproduces a GPU's number.
    """
    from tqdm import tqdm

    total, count = 0.0, 0
    for s in tqdm(range(0, len(inputs), batch), desc="djax eval", disable=not progress):
        x, y = inputs[s : s + batch], targets[s : s + batch]
        if len(x) < batch:  # one compiled shape
            x = np.concatenate([x, np.zeros((batch - len(x), x.shape[1]), x.dtype)])
            y = np.concatenate([y, np.full((batch - len(y), y.shape[1]), -1, y.dtype)])
        with jax.default_matmul_precision("highest"):
            n, c = nll_sum(_eval_logits(params, jnp.asarray(x), cfg), y)
        total, count = total + n, count + c
    return {"nll": total / count, "perplexity": math.exp(total / count), "tokens": count}


def heldout_check(tokenizer, stdlib: str | None, params, cfg, seq_len: int = 256, windows: int = 2) -> dict:
    """A small held-out sample that tests can score again: the first held-out file's first `windows`
    windows of `seq_len` (its token ids recorded, so no stdlib is needed to rebuild them) and djax's
    perplexity on them (`file_windows` of the ids)."""
    name, text = corpus_files(stdlib, "heldout")[0]
    ids = encode_files(tokenizer, [text])[0][: windows * seq_len + 1]
    inputs, targets = file_windows(ids, seq_len)
    ev = djax_perplexity(params, cfg, inputs, targets, batch=len(inputs))
    return {"file": name, "seq_len": seq_len, "ids": ids.tolist(), **ev}


def hf_perplexity(path, inputs, targets, batch: int = 8, progress: bool = False) -> dict:
    """The same held-out perplexity from HF transformers' DeepseekV4ForCausalLM (float32, CPU)."""
    import torch
    import transformers
    from tqdm import tqdm

    model = transformers.DeepseekV4ForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    total, count = 0.0, 0
    for s in tqdm(range(0, len(inputs), batch), desc="HF eval", disable=not progress):
        with torch.no_grad():
            logits = model(torch.tensor(inputs[s : s + batch], dtype=torch.long)).logits.numpy()
        n, c = nll_sum(logits, targets[s : s + batch])
        total, count = total + n, count + c
    return {"nll": total / count, "perplexity": math.exp(total / count), "tokens": count}


def shippable(params, cfg):
    """Weight matrices (the config-dtype weights) in bf16; float32-declared weights and int tables as they are."""
    decl = v4.declare(cfg, with_mtp=False)
    return jax.tree.map(
        lambda p, x: x.astype(jnp.bfloat16) if p.dtype is None else x,
        decl,
        params,
        is_leaf=djax.params.is_param,
    )


# ---- commands ----------------------------------------------------------------------------------------------
def cmd_train(args) -> int:
    import optax  # noqa: F401  (fail early where optax is missing)
    from tqdm import tqdm

    from djax.checkpoint import save_pretrained

    t_start = time.time()
    cfg = ARCHS[args.arch][0]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(args.tokenizer)
    shutil.copy(args.tokenizer or ASSET / "tokenizer.json", out / "tokenizer.json")
    if cfg.engram_layer_ids:
        token_map, n_compressed = engram_token_map(tokenizer)
        cfg = cfg.replace(engram_compressed_vocab_size=n_compressed)
    train_files = corpus_files(args.stdlib, "train")
    stream = np.concatenate(encode_files(tokenizer, [t for _, t in train_files]))
    print(
        f"corpus: {len(train_files)} train files, {len(stream):,} tokens; djax {djax.__file__}; {jax.devices()}",
        flush=True,
    )
    data = jnp.asarray(stream.astype(np.uint16))

    key = jax.random.key(args.seed)
    params = djax.init_params(cfg, jax.random.fold_in(key, 0))
    for i in _gate_biases(cfg):  # the balancing rule starts from no preference
        gate = params["layers"][i]["ffn"]["gate"]
        for name in ("bias", "bias_vl"):  # V4.1's image-token bias: unused for text, shipped as zeros
            if name in gate:
                gate[name] = jnp.zeros_like(gate[name])
    if cfg.engram_layer_ids:
        params["engram_token_map"] = jnp.asarray(token_map)
    fp, ints = _split(params)
    vec, unravel, decay_mask, bias_offsets = flat_layout(fp, cfg)
    del params, fp
    tx = make_optimizer()
    opt_state = tx.init(vec)
    # The Sinkhorn loop stays rolled in the training step (half the kernels for the GPU to compile).
    train_cfg = cfg.replace(hc_sinkhorn_unroll=False)
    step_fn = make_train_step(train_cfg, tx, unravel, ints, decay_mask, bias_offsets, args)
    data_key = jax.random.fold_in(key, 1)

    total = args.steps
    log, t_train, t_timed = [], None, None
    bar = tqdm(total=total, desc="train", unit="step", mininterval=5)
    step = 0
    while step < total:
        lr = lr_at(step, total, args.lr, args.warmup)
        vec, opt_state, m = step_fn(vec, opt_state, data, jax.random.fold_in(data_key, step), jnp.float32(lr))
        step += 1
        if step == 1:
            jax.block_until_ready(m)
            t_train = time.time()
            print(f"first step (compile) done at {t_train - t_start:.1f} s", flush=True)
        if step == args.timing_steps + 1 and args.seconds:
            jax.block_until_ready(m)
            dt = (time.time() - t_train) / args.timing_steps
            left = args.seconds - (time.time() - t_start)
            total = max(step + 1, min(total, step + int(left / dt)))
            t_timed = dt
            bar.total = total
            print(f"{dt * 1e3:.1f} ms/step: training {total} steps", flush=True)
        if step % args.log_every == 0 or step == total:
            m = jax.device_get(m)
            rec = {"step": step, "lr": lr, **{k: float(v) for k, v in m.items()}}
            rec["elapsed_s"] = round(time.time() - t_train, 2)
            log.append(rec)
            bar.set_postfix(loss=f"{rec['loss']:.3f}", kl=f"{rec['indexer_kl']:.3f}")
        bar.update(1)
    jax.block_until_ready(vec)
    bar.close()
    train_seconds = time.time() - t_train
    params = _merge(unravel(vec), ints)

    ship = shippable(params, cfg)
    save_pretrained(
        ship, cfg, out, max_shard_bytes=(args.max_shard_mb << 20) if args.max_shard_mb else 4 << 30
    )
    ev = None
    as_f32 = jax.tree.map(lambda x: x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x, ship)
    if args.heldout_files != 0:
        t_eval = time.time()
        inputs, targets = heldout_windows(tokenizer, args.stdlib, args.seq_len, args.heldout_files)
        ev = djax_perplexity(as_f32, cfg, inputs, targets, batch=32)
        ev["files"] = len(corpus_files(args.stdlib, "heldout")[: args.heldout_files])
        ev["seconds"] = round(time.time() - t_eval, 1)
    summary = {
        "arch": args.arch,
        "seed": args.seed,
        "steps": total,
        "batch": args.batch,
        "seq_len": args.seq_len,
        "tokens_seen": total * args.batch * args.seq_len,
        "train_tokens": int(len(stream)),
        "peak_lr": args.lr,
        "warmup": args.warmup,
        "weight_decay": args.weight_decay,
        "balance_rate": args.balance_rate,
        "indexer_loss_weight": args.indexer_loss_weight,
        "ms_per_step": None if t_timed is None else round(t_timed * 1e3, 2),
        "train_seconds": round(train_seconds, 1),
        "wall_seconds": round(time.time() - t_start, 1),
        "device": str(jax.devices()[0].device_kind),
        "final_train_loss": log[-1]["loss"] if log else None,
        "heldout_djax_bf16_weights": ev,
        "heldout_check": heldout_check(tokenizer, args.stdlib, as_f32, cfg),
        "log": log,
    }
    (out / "train_log.json").write_text(json.dumps(summary, indent=1) + "\n")
    short = {k: v for k, v in summary.items() if k != "log"}
    short["heldout_check"] = {k: v for k, v in summary["heldout_check"].items() if k != "ids"}
    print(json.dumps(short, indent=1))
    return 0


def cmd_repack(args) -> int:
    """One model.safetensors from a sharded save (the GPU run writes shards under the transfer limit)."""
    from djax.checkpoint import INDEX
    from djax.safetensors_io import SafetensorsFile, save_file

    src, out = Path(args.src), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = (
        sorted(set(json.loads((src / INDEX).read_text())["weight_map"].values()))
        if (src / INDEX).exists()
        else ["model.safetensors"]
    )
    tensors = {}
    for n in names:
        f = SafetensorsFile(src / n)
        tensors.update({k: np.array(f.get(k)) for k in f.keys()})
    save_file(dict(sorted(tensors.items())), out / "model.safetensors")
    for name in ("config.json", "tokenizer.json", "train_log.json"):
        if (src / name).exists() and (src / name).resolve() != (out / name).resolve():
            shutil.copy(src / name, out / name)
    print(f"{out}: {len(tensors)} tensors, {(out / 'model.safetensors').stat().st_size / 1e6:.2f} MB")
    return 0


def cmd_evaluate(args) -> int:
    cfg, params = djax.load_checkpoint(args.checkpoint, progress=False)
    if args.hf and cfg.is_v41:
        raise SystemExit(
            "--hf: HF transformers has no DeepSeek-V4.1 class; evaluate a V4.1 checkpoint without it"
        )
    tokenizer = load_tokenizer(Path(args.checkpoint) / "tokenizer.json")
    inputs, targets = heldout_windows(tokenizer, args.stdlib, args.seq_len, args.max_files)
    result = {
        "checkpoint": Path(args.checkpoint).name,
        "heldout_files": len(corpus_files(args.stdlib, "heldout")[: args.max_files]),
        "windows": len(inputs),
        "seq_len": args.seq_len,
    }
    t = time.time()
    result["djax"] = djax_perplexity(params, cfg, inputs, targets, args.batch, progress=True)
    result["djax"]["seconds"] = round(time.time() - t, 1)
    if args.hf:
        t = time.time()
        result["hf"] = hf_perplexity(args.checkpoint, inputs, targets, args.batch, progress=True)
        result["hf"]["seconds"] = round(time.time() - t, 1)
        result["relative_difference"] = abs(result["djax"]["perplexity"] / result["hf"]["perplexity"] - 1)
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train djax-tiny-v4 or djax-tiny and save it (HF layout)")
    t.add_argument("--out", required=True)
    t.add_argument(
        "--arch",
        choices=sorted(ARCHS),
        default="v4",
        help="v4: djax-tiny-v4 (TINY_V4); v41: djax-tiny (TINY_V41, DeepSeek-V4.1)",
    )
    t.add_argument("--stdlib", help="stdlib directory (default: the running interpreter's)")
    t.add_argument("--tokenizer", help="tokenizer.json (default: the shipped one)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--steps", type=int, default=2000)
    t.add_argument(
        "--seconds",
        type=float,
        help="end training this many seconds after the start: --steps is cut after timing the first steps "
        "(the log records the steps run; --steps N reproduces the run)",
    )
    t.add_argument("--timing-steps", type=int, default=20)
    t.add_argument("--batch", type=int, default=128)
    t.add_argument("--seq-len", type=int, default=512)
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--warmup", type=int, default=100)
    t.add_argument("--weight-decay", type=float, default=0.1)
    t.add_argument("--balance-rate", type=float, default=1e-3)
    t.add_argument("--indexer-loss-weight", type=float, default=1.0)
    t.add_argument("--log-every", type=int, default=50)
    t.add_argument("--max-shard-mb", type=int, help="write shards of at most this size")
    t.add_argument("--heldout-files", type=int, help="evaluate on the first N held-out files only (0: skip)")
    t.set_defaults(func=cmd_train)
    r = sub.add_parser("repack", help="merge a sharded save into one model.safetensors")
    r.add_argument("--src", required=True)
    r.add_argument("--out", required=True)
    r.set_defaults(func=cmd_repack)
    e = sub.add_parser("evaluate", help="held-out perplexity by djax (and HF transformers with --hf)")
    e.add_argument("--checkpoint", default=str(ASSET))
    e.add_argument("--stdlib")
    e.add_argument("--seq-len", type=int, default=512)
    e.add_argument("--batch", type=int, default=8)
    e.add_argument("--max-files", type=int)
    e.add_argument("--hf", action="store_true")
    e.add_argument("--json", help="write the result here")
    e.set_defaults(func=cmd_evaluate)
    args = ap.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
