"""Engram hashing and gate against vectors from deepseek-ai/TileKernels' torch reference; host-memory tables."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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


def test_token_map_follows_the_normalisation_and_is_built_on_load_when_absent(tmp_path):
    """The compressed vocabulary: brute force over the rule's cases, then a checkpoint without the
    tensor loads with the map built from its tokenizer.json (and says why when it cannot)."""
    import shutil

    from tokenizers import Tokenizer

    import djax
    from djax.checkpoint import CheckpointError
    from djax.params import flatten_names
    from djax.safetensors_io import SafetensorsFile, save_file
    from tests.test_checkpoint import random_params
    from tests.test_fp4 import SMALL

    tok_file = Path(djax.__file__).parent / "assets" / "djax-tiny-v4" / "tokenizer.json"
    tok = Tokenizer.from_file(str(tok_file))
    tmap, count = engram.compressed_token_map(tok)
    one = lambda s: tmap[tok.token_to_id(s)]  # noqa: E731  (byte-level spellings: Ġ is a space)
    assert one("Ġself") == one("self")  # surrounding whitespace stripped
    assert one("Ġ") == one("ĠĠ") == one("Ċ") != one("self")  # whitespace runs collapse to one space
    assert len(set(tmap.tolist())) == count and tmap.max() == count - 1
    assert [int(tmap[i]) for i in range(3)] == [0, 1, 2]  # ids in order of first use

    cfg = SMALL.replace(vocab_size=tok.get_vocab_size(), engram_layer_ids=(0,), engram_num_embeddings=(152,))
    cfg = cfg.replace(engram_compressed_vocab_size=count)
    params = random_params(cfg, 3)
    params["engram_token_map"] = jnp.asarray(tmap)
    djax.save_pretrained(params, cfg, tmp_path)
    f = tmp_path / "model.safetensors"
    src = SafetensorsFile(f)
    tensors = {k: np.array(src.get(k)) for k in src.keys() if k != "engram_token_map"}
    del src
    save_file(tensors, f)
    with pytest.raises(CheckpointError, match="engram_token_map.*no tokenizer.json"):
        djax.load_checkpoint(tmp_path, progress=False)
    shutil.copy(tok_file, tmp_path / "tokenizer.json")
    _, loaded = djax.load_checkpoint(tmp_path, progress=False)
    np.testing.assert_array_equal(np.asarray(loaded["engram_token_map"]), tmap)
    want, got = flatten_names(params), flatten_names(loaded)
    for k in want:
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]), err_msg=k)
    cfg_file = tmp_path / "config.json"
    cfg_file.write_text(
        cfg_file.read_text().replace(
            f'"engram_compressed_vocab_size": {count}', '"engram_compressed_vocab_size": 7'
        )
    )
    with pytest.raises(CheckpointError, match="engram_compressed_vocab_size 7"):
        djax.load_checkpoint(tmp_path, progress=False)
