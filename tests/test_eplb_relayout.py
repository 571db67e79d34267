"""Run-time expert re-layout by an EPLB placement, and the model's router counts."""

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import djax
from djax.models import deepseek_v4
from djax.models import moe as moe_mod
from djax.params import init_params_host
from djax.step import _forward
from tests.cpu_devices import run_on_cpu_devices


def _cfg():
    base = djax.preset("tiny-v4")  # 8 experts, top-2
    return base.replace(num_hidden_layers=2, compress_ratios=(0, 0))  # a hash layer, then a biased router


@pytest.fixture(scope="module")
def model():
    cfg = _cfg()
    return cfg, init_params_host(cfg, 0)


def _placement(seed: int, layers: int = 2, slots: int = 12):
    load = np.random.default_rng(seed).integers(1, 100, (layers, 8))
    return djax.rebalance(load, slots, 1, 1, 4)


def test_to_physical_spreads_tokens_over_replicas():
    p2l, cnt = np.array([0, 1, 2, 0, 0, 2]), np.array([3, 1, 2])  # expert 0 has 3 replicas, expert 2 two
    experts = {"log2phy": jnp.asarray(djax.eplb._log2phy(p2l, cnt, 4), jnp.int32), "logcnt": jnp.asarray(cnt)}
    idx = jnp.array([[0, 2]] * 6 + [[1, 0]] * 6, jnp.int32)
    phys = np.asarray(moe_mod.to_physical(idx, experts))
    assert np.all(p2l[phys] == np.asarray(idx))  # every copy lands on a replica of its expert
    assert sorted(phys[:6, 0].tolist()) == [0, 0, 3, 3, 4, 4]  # expert 0's six tokens: two per replica
    assert sorted(phys[:6, 1].tolist()) == [2, 2, 2, 5, 5, 5]


def test_placed_forward_equals_logical_and_swaps_without_recompiling(model):
    cfg, params = model
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (4, 16)).astype(np.int32)
    ref = np.asarray(djax.forward(params, tokens, cfg, moe_impl="gather"))
    placed = djax.apply_placement(params, cfg, _placement(0))
    ex = placed["layers"][1]["ffn"]["experts"]
    assert ex["w1"].shape[0] == 12 and ex["log2phy"].shape == (8, 5)
    # Replicas hold identical weights and each (token, choice) reads one expert: bit-identical.
    np.testing.assert_array_equal(np.asarray(djax.forward(placed, tokens, cfg, moe_impl="gather")), ref)
    compiled = _forward._cache_size()
    swapped = djax.apply_placement(placed, cfg, _placement(1))  # from a placed layout, same slot count
    np.testing.assert_array_equal(np.asarray(djax.forward(swapped, tokens, cfg, moe_impl="gather")), ref)
    assert _forward._cache_size() == compiled
    back = djax.apply_placement(swapped, cfg, None)
    for lp, lq in zip(params["layers"], back["layers"], strict=True):
        assert set(lq["ffn"]["experts"]) == {"w1", "w2", "w3"}
        for w in ("w1", "w2", "w3"):
            np.testing.assert_array_equal(lq["ffn"]["experts"][w], lp["ffn"]["experts"][w])


def test_apply_placement_rejects_a_placement_missing_an_expert(model):
    cfg, params = model
    bad = djax.Placement(np.array([0, 1, 2, 3, 4, 5, 6, 6]), None, np.array([1, 1, 1, 1, 1, 1, 2, 0]))
    with pytest.raises(ValueError, match="every one of the 8 experts"):
        djax.apply_placement(params, cfg, bad)


def test_router_counts_equal_brute_force_from_route(model, monkeypatch):
    cfg, params = model
    seen, route = [], moe_mod.route

    def spy(x, gate, cfg, token_ids=None):
        w, idx = route(x, gate, cfg, token_ids)
        seen.append(idx)
        return w, idx

    monkeypatch.setattr(moe_mod, "route", spy)
    tokens = np.random.default_rng(2).integers(0, cfg.vocab_size, (3, 16)).astype(np.int32)
    lengths = jnp.array([16, 5, 9], jnp.int32)

    @jax.jit
    def run(params, tokens, lengths):
        seen.clear()
        _, st = deepseek_v4.prefill(params, tokens, lengths, cfg, 32, "grouped", count_experts=True)
        return st["expert_counts"], list(seen)

    counts, idx = run(params, tokens, lengths)
    assert counts.shape == (2, 8) and len(idx) == 2
    real = np.arange(16)[None, :] < np.asarray(lengths)[:, None]
    for layer in range(2):
        want = djax.expert_counts(np.asarray(idx[layer]).reshape(3, 16, -1), 8, real)
        np.testing.assert_array_equal(np.asarray(counts[layer]), want)
    load = djax.ExpertLoad(8, 2)
    load.add_counts(counts)
    load.add_counts(counts)
    np.testing.assert_array_equal(load.counts, 2 * np.asarray(counts))


SCRIPT = textwrap.dedent(
    """
    import jax, numpy as np
    jax.config.update("jax_default_matmul_precision", "highest")
    from jax.sharding import NamedSharding, PartitionSpec as P
    import djax
    from djax.generate import _generate
    from djax.params import init_params_host

    # One sliding-window layer with a biased router: the cheapest model that routes (compile time).
    cfg = djax.preset("tiny-v4", num_hidden_layers=1, compress_ratios=(0,), num_hash_layers=0)
    params = init_params_host(cfg, 0)
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (8, 16)).astype(np.int32)
    ref = np.asarray(djax.forward(params, tokens, cfg))
    batch = djax.Batch.from_lists([[int(t) for t in np.asarray(tokens[i, : 3 + i])] for i in range(8)])
    greedy = djax.SamplingParams(ignore_eos=True)
    want = djax.generate(params, batch, cfg, greedy, max_new_tokens=6, count_experts=True)
    counts = np.asarray(want.expert_counts)
    # Every prompt token and every decode step of every row, top-2, in each layer.
    assert np.all(counts.sum(-1) == 2 * (int(batch.lengths.sum()) + 8 * 5)), counts

    # Measured load -> EPLB placement on 12 slots over ep=4 -> relaid experts on the mesh.
    load = djax.ExpertLoad(8, 1)
    load.add_counts(counts)
    placement = load.rebalance(12, 1, 1, 4)
    assert placement.logcnt.max() > 1
    mesh = djax.make_mesh(dp=2, ep=4)
    placed = djax.apply_placement(djax.shard_params(params, cfg, mesh), cfg, placement, mesh)
    w1 = placed["layers"][0]["ffn"]["experts"]["w1"]
    assert w1.shape[0] == 12 and w1.sharding.spec[0] == "ep", w1.sharding
    on_dp = NamedSharding(mesh, P("dp"))
    got = np.asarray(djax.forward(placed, jax.device_put(tokens, on_dp), cfg, mesh=mesh))
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert err <= 1e-5, err
    b = djax.Batch(*(jax.device_put(a, on_dp) for a in (batch.tokens, batch.lengths, batch.seeds)))
    out = djax.generate(placed, b, cfg, greedy, max_new_tokens=6, mesh=mesh, count_experts=True)
    assert out.to_lists() == want.to_lists(), (out.to_lists(), want.to_lists())
    np.testing.assert_array_equal(np.asarray(out.expert_counts), counts)
    # A new layout with as many slots swaps in between calls without recompiling.
    compiled = _generate._cache_size()
    again = djax.apply_placement(placed, cfg, djax.rebalance(counts[:, ::-1], 12, 1, 1, 4), mesh)
    out = djax.generate(again, b, cfg, greedy, max_new_tokens=6, mesh=mesh, count_experts=True)
    assert out.to_lists() == want.to_lists()
    assert _generate._cache_size() == compiled
    print("ok", err)
    """
)


def test_relaid_expert_parallel_equals_one_device():
    out = run_on_cpu_devices(SCRIPT, 8)
    assert "ok" in out, out
