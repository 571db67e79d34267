"""Sharded evaluation: per-sequence log-likelihoods against a brute-force forward, padding invariance, the CLI."""

import json
import math
import textwrap

import jax
import numpy as np
import pytest

import djax
from djax.evaluate import chunk_tokens, evaluate
from tests.cpu_devices import run_on_cpu_devices


def _small_config():
    # tiny-v4 cut to 3 layers (sliding, CSA, HCA; one hash-routed layer): faster to compile on CPU.
    return djax.preset("tiny-v4", num_hidden_layers=3, compress_ratios=(0, 4, 16), num_hash_layers=1)


def _numpy_params(cfg, seed=0):
    """Random weights made in numpy from the declarations (no per-shape jit compiles)."""
    from djax.params import declare, is_param

    rng = np.random.default_rng(seed)

    def one(p):
        dt = np.dtype(p.dtype if p.dtype is not None else cfg.dtype)
        if p.init == "ones":
            return np.ones(p.shape, dt)
        if p.init == "zeros":
            return np.zeros(p.shape, dt)
        if p.init == "hash":
            return rng.integers(0, p.high, p.shape).astype(dt)
        if p.init == "uniform":
            return rng.uniform(-0.5, 0.5, p.shape).astype(dt)
        return (0.05 * rng.standard_normal(p.shape)).astype(dt)

    return jax.tree.map(one, declare(cfg), is_leaf=is_param)


DATA_LENGTHS = (5, 12, 1, 12, 5)


@pytest.fixture(scope="module")
def model():
    cfg = _small_config()
    params = _numpy_params(cfg)
    rng = np.random.default_rng(0)
    data = [rng.integers(0, cfg.vocab_size, n).tolist() for n in DATA_LENGTHS]
    return cfg, params, data


def _brute(params, cfg, data):
    """log-likelihood of each sequence from djax.forward on the unpadded sequence (same lengths batched)."""
    out = {}
    for n in sorted(set(DATA_LENGTHS) - {1}):
        rows = [i for i, s in enumerate(data) if len(s) == n]
        tokens = np.asarray([data[i] for i in rows], np.int32)
        logits = np.asarray(djax.forward(params, tokens, cfg), np.float64)
        logp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
        for r, i in enumerate(rows):
            out[i] = float(sum(logp[r, j - 1, data[i][j]] for j in range(1, n)))
    return [out.get(i, 0.0) for i in range(len(data))]


@pytest.fixture(scope="module")
def unsharded(model):
    cfg, params, data = model
    # 5 sequences in batches of 4: the second batch has 3 padding rows; lengths 5 and 1 padded to 12.
    return evaluate(params, cfg, data, batch_size=4, seq_len=12, progress=False)


def test_matches_brute_force_with_padding(model, unsharded):
    cfg, params, data = model
    res = unsharded
    want = _brute(params, cfg, data)
    np.testing.assert_allclose(res["loglik"], want, rtol=1e-5, atol=1e-4)
    assert res["tokens"] == [4, 11, 0, 11, 4]
    assert res["total_tokens"] == 30
    assert res["total_loglik"] == pytest.approx(sum(res["loglik"]))
    assert res["perplexity"] == pytest.approx(math.exp(-sum(res["loglik"]) / 30))
    assert res["loglik"][2] == 0.0


def test_errors_and_chunks(model):
    cfg, params, _ = model
    with pytest.raises(ValueError, match="longer than seq_len"):
        evaluate(params, cfg, [[1, 2, 3]], seq_len=2, progress=False)
    with pytest.raises(ValueError, match="token ids"):
        evaluate(params, cfg, [[1, cfg.vocab_size]], progress=False)
    assert chunk_tokens(list(range(7)), 3) == [[0, 1, 2], [3, 4, 5]]
    assert chunk_tokens(list(range(8)), 3) == [[0, 1, 2], [3, 4, 5], [6, 7]]


_CHILD = textwrap.dedent(
    """
    import json, sys
    import jax, numpy as np
    jax.config.update("jax_default_matmul_precision", "highest")
    import djax
    from djax.evaluate import evaluate
    from tests.test_evaluate import _numpy_params, _small_config
    assert len(jax.devices()) == 4
    inp = json.loads(sys.stdin.read())
    cfg = _small_config()
    params = _numpy_params(cfg)
    mesh = djax.make_mesh(dp=2, ep=2)
    out = evaluate(params, cfg, inp["data"], mesh=mesh, batch_size=4, seq_len=12, progress=False)
    np.testing.assert_allclose(out["loglik"], inp["loglik"], rtol=1e-5, atol=1e-4)
    assert out["tokens"] == inp["tokens"]
    print("OK", out["perplexity"])
    """
)


def test_sharded_dp2_ep2_equals_unsharded_on_4_cpu_devices(model, unsharded):
    _, _, data = model
    inp = json.dumps({"data": data, "loglik": unsharded["loglik"], "tokens": unsharded["tokens"]})
    assert "OK" in run_on_cpu_devices(_CHILD, 4, stdin=inp, timeout=300)


def test_cli_eval_default_checkpoint(tmp_path, capsys):
    from djax.cli import main

    f = tmp_path / "text.txt"
    f.write_text("def read_file(path):\n    with open(path) as f:\n        return f.read()\n" * 3)
    assert main(["eval", "--file", str(f), "--seq-len", "12", "--batch-size", "4"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["windows"] >= 2 and out["total_tokens"] > 0
    assert out["perplexity"] == pytest.approx(math.exp(-out["total_loglik"] / out["total_tokens"]))
