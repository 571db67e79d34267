"""Engram hashing and gate against vectors from deepseek-ai/TileKernels' torch reference; host-memory tables."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from djax.config import preset
from djax.models import engram

DATA = np.load(Path(__file__).parent.parent / "data" / "engram_vectors.npz")


def test_hash_matches_tilekernels():
    d = DATA
    np.testing.assert_array_equal(engram.table_offsets(d["vocab_sizes"]), d["offsets"])
    rows = engram.hash_ngrams(d["ngram_ids"], d["multipliers"], d["vocab_sizes"], d["offsets"])
    np.testing.assert_array_equal(rows, d["rows"])


def test_gate_matches_tilekernels():
    d = DATA
    bf = jnp.bfloat16
    out = engram.gate(
        jnp.asarray(d["h"], bf), jnp.asarray(d["k"], bf), jnp.asarray(d["v"], bf),
        jnp.asarray(d["wh"], bf), jnp.asarray(d["we"], bf), float(d["eps"]),
    )  # fmt: skip
    assert np.float32(d["clamp"]) == np.float32(engram.CLAMP)
    got, want = np.asarray(out.astype(jnp.float32)), d["out"]
    # Both round an f32 result to bf16 once: allow one bf16 step, nothing more.
    np.testing.assert_allclose(got, want, rtol=2**-8, atol=2**-8 * np.abs(want).max() * 2**-4)
    assert np.mean(got == want) > 0.99


def test_layout_and_ngram_windows():
    cfg = preset("tiny-v41")
    primes = engram.bucket_primes(cfg)
    assert tuple(primes.reshape(len(cfg.engram_layer_ids), -1).sum(1)) == cfg.engram_num_embeddings
    assert len(set(primes.ravel())) == primes.size and (primes >= cfg.engram_vocab_size).all()
    m = engram.hash_multipliers(cfg)
    assert (m % 2 == 1).all() and m.shape == (2, cfg.engram_max_ngram_size)
    ids = np.random.default_rng(0).integers(0, 300, (2, 2 + 5))
    w = engram.ngram_windows(ids, 3)  # [b, 5, 3]
    np.testing.assert_array_equal(w[:, :, 0], ids[:, 2:])
    np.testing.assert_array_equal(w[:, :, 2], ids[:, :5])
    rows = engram.host_hash(cfg, ids)
    assert rows.shape == (2, 2, 5, cfg.engram_columns)
    assert (rows >= 0).all() and (rows < np.asarray(cfg.engram_num_embeddings)[:, None, None, None]).all()


def test_host_table_brings_only_rows_to_device():
    """The table lives in pinned host memory (supported on CPU by jax 0.10.2); a jitted lookup gathers
    on the host and returns the rows in device memory, equal to a device-side gather."""
    table = jax.random.normal(jax.random.key(3), (1000, 16))
    host = engram.to_host(table)
    assert host.sharding.memory_kind == engram.HOST
    ids = jax.random.randint(jax.random.key(4), (3, 5, 6), 0, 1000)
    got = jax.jit(engram.fetch_rows)(host, ids)
    assert got.sharding.memory_kind == "device"
    np.testing.assert_array_equal(np.asarray(got), np.asarray(table)[np.asarray(ids)])
