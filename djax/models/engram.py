"""Engram n-gram memory (DeepSeek-V4.1): hashed n-gram table rows gated into each residual stream.

Every position t is hashed as the n-grams ending at it (orders 2 .. engram_max_ngram_size) over
compressed token ids (tokens that normalise alike share one id). Order j + 1 XORs the products
id[t - s] * multiplier[s] for s = 0 .. j and takes the result modulo each head's prime bucket
count; a per-(order, head) offset places it in the layer's one big table. The fetched rows
[cols, head_dim] are projected to hc_mult keys and one value; stream k receives
sigmoid(signed_sqrt(<rmsnorm(h_k) q_w, rmsnorm(key_k) k_w> / sqrt(d))) * value.

Hashing is exact 64-bit integer arithmetic on the host (numpy, through a callback when jitted):
the ids are tiny and the tables they index live in host memory anyway.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from djax.config import ModelConfig
from djax.models.layers import linear

HOST = "pinned_host"
CLAMP = 1e-6  # the gate's signed sqrt never sees |dot| below this


# ---- the compressed vocabulary -----------------------------------------------------------------
def compressed_token_map(tokenizer) -> tuple[np.ndarray, int]:
    """Token id -> compressed id, int32[vocab] (ids numbered in order of first use), and the id count.

    DeepSeek's rule: a token's decoded text goes through NFKC, NFD, accent stripping, lower-casing
    and whitespace-run collapsing, then is stripped, except that a text which is exactly one space
    stays one space; tokens with equal results share an id. A token whose text normalises to
    nothing keeps its own text as key; a byte fragment (decodes to U+FFFD) is keyed by its raw token.
    `tokenizer`: a `tokenizers.Tokenizer`.
    """
    from tokenizers import Regex, normalizers

    keep_space = "\ue000"  # a private-use character standing in for a lone space across the strip
    norm = normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), keep_space),
            normalizers.Strip(),
            normalizers.Replace(keep_space, " "),
        ]
    )
    ids: dict[str, int] = {}
    out = []
    for i in range(tokenizer.get_vocab_size(with_added_tokens=True)):
        text = tokenizer.decode([i], skip_special_tokens=False)
        key = tokenizer.id_to_token(i) if "\ufffd" in text else (norm.normalize_str(text) or text)
        out.append(ids.setdefault(key, len(ids)))
    return np.asarray(out, np.int32), len(ids)


# ---- hashing constants -------------------------------------------------------------------------
def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    f = 3
    while f * f <= n:
        if n % f == 0:
            return False
        f += 2
    return True


@functools.cache
def bucket_primes(cfg: ModelConfig) -> np.ndarray:
    """int64[layers, orders, heads]: each (layer, order, head) takes the next unused prime >= engram_vocab_size."""
    used, cur, out = set(), cfg.engram_vocab_size - 1, []
    for _ in cfg.engram_layer_ids:
        layer, cur = [], cfg.engram_vocab_size - 1
        for _ in range(cfg.engram_max_ngram_size - 1):
            heads = []
            for _ in range(cfg.engram_n_heads):
                cur += 1
                while not _is_prime(cur) or cur in used:
                    cur += 1
                used.add(cur)
                heads.append(cur)
            layer.append(heads)
        out.append(layer)
    return np.asarray(out, np.int64).reshape(len(cfg.engram_layer_ids), -1, cfg.engram_n_heads)


def table_offsets(sizes: np.ndarray) -> np.ndarray:
    """Exclusive prefix sums of the flattened (order, head) bucket counts: int64[layers, orders * heads]."""
    flat = sizes.reshape(sizes.shape[0], -1).astype(np.int64)
    return np.concatenate([np.zeros((flat.shape[0], 1), np.int64), np.cumsum(flat, 1)[:, :-1]], axis=1)


@functools.cache
def hash_multipliers(cfg: ModelConfig) -> np.ndarray:
    """int64[layers, max_ngram]: odd, seeded per layer id, small enough that id * multiplier fits in int64."""
    bound = max(1, (np.iinfo(np.int64).max // max(cfg.engram_compressed_vocab_size, 1)) // 2)
    rows = [
        np.random.default_rng(10007 * layer).integers(
            0, bound, size=cfg.engram_max_ngram_size, dtype=np.int64
        )
        for layer in cfg.engram_layer_ids
    ]
    return np.stack(rows) * 2 + 1


def hash_ngrams(
    ngrams: np.ndarray, multipliers: np.ndarray, sizes: np.ndarray, offsets: np.ndarray
) -> np.ndarray:
    """Table rows of n-grams. ngrams int[..., N] (column s = token s back); multipliers int64[L, N];
    sizes int[L, N - 1, H]; offsets int[L, (N - 1) H] -> int64[L, ..., (N - 1) H]."""
    prod = ngrams.astype(np.int64)[None] * multipliers.reshape(
        multipliers.shape[0], *([1] * (ngrams.ndim - 1)), -1
    )
    acc, cols = prod[..., 0], []
    for j in range(1, ngrams.shape[-1]):
        acc = acc ^ prod[..., j]
        size = sizes[:, j - 1].astype(np.int64).reshape(sizes.shape[0], *([1] * (ngrams.ndim - 1)), -1)
        cols.append(acc[..., None] % size)
    return np.concatenate(cols, -1) + offsets.reshape(offsets.shape[0], *([1] * (ngrams.ndim - 1)), -1)


def ngram_windows(ids: np.ndarray, n: int) -> np.ndarray:
    """ids int[b, n - 1 + c] (history then chunk) -> int[b, c, n], column s the id s positions back."""
    c = ids.shape[1] - (n - 1)
    return np.stack([ids[:, n - 1 - s : n - 1 - s + c] for s in range(n)], axis=-1)


def host_hash(cfg: ModelConfig, compressed: np.ndarray) -> np.ndarray:
    """Row ids int32[engram layers, b, c, cols] for compressed ids int[b, n - 1 + c] (pads already in)."""
    primes = bucket_primes(cfg)
    rows = hash_ngrams(
        ngram_windows(np.asarray(compressed), cfg.engram_max_ngram_size),
        hash_multipliers(cfg),
        primes,
        table_offsets(primes),
    )
    return rows.astype(np.int32)


def hash_ids(cfg: ModelConfig, compressed: jax.Array) -> jax.Array:
    """`host_hash` callable under jit: compressed int32[b, n - 1 + c] -> int32[layers, b, c, cols]."""
    b, w = compressed.shape
    shape = (len(cfg.engram_layer_ids), b, w - cfg.engram_max_ngram_size + 1, cfg.engram_columns)
    return jax.pure_callback(
        functools.partial(host_hash, cfg), jax.ShapeDtypeStruct(shape, jnp.int32), compressed
    )


# ---- tables and the gate -----------------------------------------------------------------------
def to_host(table: jax.Array) -> jax.Array:
    """Place an Engram table in host memory (pinned host of its device): it stays out of accelerator memory."""
    dev = next(iter(table.devices()))
    return jax.device_put(table, jax.sharding.SingleDeviceSharding(dev, memory_kind=HOST))


def _on_host(x) -> bool:
    space = getattr(jax.typeof(x), "memory_space", None)
    return space is not None and "host" in str(space).lower()


def fetch_rows(table: jax.Array, ids: jax.Array) -> jax.Array:
    """table[ids] ([..., head_dim]); a host-memory table is gathered on the host and only the rows move."""
    if not _on_host(table):
        return jnp.take(table, ids, axis=0, mode="clip")
    from jax.experimental.compute_on import compute_on

    ids = jax.device_put(ids, jax.memory.Space.Host)
    with compute_on("device_host"):
        rows = jnp.take(table, ids, axis=0, mode="clip")
    return jax.device_put(rows, jax.memory.Space.Device)


def gate(
    h: jax.Array, key: jax.Array, value: jax.Array, q_w: jax.Array, k_w: jax.Array, eps: float
) -> jax.Array:
    """h + sigmoid(signed_sqrt(dot)) * value per stream. h, key: [..., n, d]; value: [..., d]; q_w, k_w: [n, d]."""
    d = h.shape[-1]
    hf, kf = h.astype(jnp.float32), key.astype(jnp.float32)
    rstd = jax.lax.rsqrt(jnp.mean(hf * hf, -1) + eps) * jax.lax.rsqrt(jnp.mean(kf * kf, -1) + eps)
    w = q_w.astype(jnp.float32) * k_w.astype(jnp.float32)
    dot = jnp.sum(hf * w * kf, -1) * rstd * d**-0.5
    score = jax.nn.sigmoid(jnp.sign(dot) * jnp.sqrt(jnp.maximum(jnp.abs(dot), CLAMP)))
    return (hf + score[..., None] * value.astype(jnp.float32)[..., None, :]).astype(h.dtype)


def engram_apply(
    p: dict, h: jax.Array, ids: jax.Array, cfg: ModelConfig, fp8: str | None = None
) -> jax.Array:
    """Add one Engram layer to the streams h [b, c, n, d] given its row ids int32[b, c, cols]. `fp8`: how an
    FP8 wkv runs (`layers.linear`)."""
    n, d = cfg.hc_mult, cfg.hidden_size
    rows = fetch_rows(p["embed"]["weight"], ids).astype(h.dtype)  # [b, c, cols, hd]
    kv = linear(rows.reshape(*rows.shape[:-2], -1), p["wkv"]["weight"], fp8)  # [b, c, (n + 1) d]
    key = kv[..., : n * d].reshape(*kv.shape[:-1], n, d)
    return gate(h, key, kv[..., n * d :], p["q_weight"], p["k_weight"], cfg.rms_norm_eps)
