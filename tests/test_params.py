"""Params declared once: abstract trees of the full-size models without allocation, counts, shardings, init."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import djax
from djax.models import model_module
from djax.params import abstract_params, declare, init_params, is_param, param_axes
from djax.sharding import ShardingRules, abstract_mesh, param_shardings

FULL = ["deepseek-v4-flash", "deepseek-v3"]


def _count(tree) -> int:
    return sum(int(np.prod(p.shape)) for p in jax.tree.leaves(tree, is_leaf=is_param))


@pytest.mark.parametrize("name", FULL)
def test_full_size_abstract_tree_allocates_nothing(name):
    cfg = djax.preset(name)
    live = len(jax.live_arrays())
    tree = abstract_params(cfg)
    leaves = jax.tree.leaves(tree)
    assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    assert len(jax.live_arrays()) == live
    # Same structure as the declaration and the axes tree.
    assert jax.tree.structure(tree) == jax.tree.structure(declare(cfg), is_leaf=is_param)
    axes = jax.tree.leaves(param_axes(cfg), is_leaf=lambda x: isinstance(x, tuple))
    assert [len(a) for a in axes] == [x.ndim for x in leaves]
    big = tree["layers"][-1]["ffn"]["experts"]["w1"]
    assert big.shape == (256, cfg.moe_intermediate_size, cfg.hidden_size) and big.dtype == jnp.bfloat16


def test_parameter_counts_match_published_sizes():
    # V4-Flash: 284B published; the main model (no MTP) declares 284.3B, the MTP layer adds ~6.6B.
    v4 = djax.preset("deepseek-v4-flash")
    main = _count(model_module(v4).declare(v4, with_mtp=False))
    with_mtp = _count(declare(v4))
    assert abs(main / 284e9 - 1) < 0.03, main
    assert abs(with_mtp / 284e9 - 1) < 0.03, with_mtp
    assert with_mtp > main
    # V3: 671B published (main model; the 14B MTP module is not declared for V3).
    v3 = djax.preset("deepseek-v3")
    assert abs(_count(declare(v3)) / 671e9 - 1) < 0.03


@pytest.mark.parametrize("name", FULL)
def test_full_size_shardings_expert_parallel(name):
    cfg = djax.preset(name)
    mesh = abstract_mesh(ep=8)
    shardings = param_shardings(cfg, mesh)
    decl = declare(cfg)
    flat_s = jax.tree_util.tree_flatten_with_path(shardings)[0]
    flat_p = jax.tree.leaves(decl, is_leaf=is_param)
    assert len(flat_s) == len(flat_p)
    sharded_bytes = 0
    for (path, s), p in zip(flat_s, flat_p, strict=True):
        name_ = jax.tree_util.keystr(path)
        assert isinstance(s, NamedSharding)
        if p.axes and p.axes[0] == "experts":
            assert s.spec == PartitionSpec("ep", None, None), name_
            sharded_bytes += int(np.prod(p.shape))
        else:
            # Attention, norms, router, shared experts, embeddings: replicated under the default rules.
            assert all(e is None for e in s.spec), (name_, s.spec)
    attn = shardings["layers"][-1]["attn"]
    assert all(all(e is None for e in s.spec) for s in jax.tree.leaves(attn))
    # Routed experts are the bulk of the model: > 90% of the weights split 8 ways.
    assert sharded_bytes > 0.9 * _count(decl)
    # The sharded abstract tree carries the shardings, still without allocating.
    tree = abstract_params(cfg, shardings)
    w1 = tree["layers"][-1]["ffn"]["experts"]["w1"]
    assert w1.sharding.shard_shape(w1.shape)[0] == 256 // 8


def test_full_size_shardings_dp_ep_tp():
    cfg = djax.preset("deepseek-v4-flash")
    mesh = abstract_mesh(dp=2, ep=4, tp=2)
    s = param_shardings(cfg, mesh, ShardingRules.tensor_parallel())
    layer = s["layers"][5]
    assert layer["ffn"]["experts"]["w1"].spec == PartitionSpec("ep", "tp", None)
    assert layer["ffn"]["experts"]["w2"].spec == PartitionSpec("ep", None, "tp")
    assert layer["attn"]["wq_b"]["weight"].spec == PartitionSpec("tp", None)
    assert layer["attn"]["wo_a"]["weight"].spec == PartitionSpec(None, "tp")
    assert layer["ffn"]["shared_experts"]["w1"]["weight"].spec == PartitionSpec("tp", None)
    assert all(e is None for e in s["embed"]["weight"].spec)


@pytest.fixture(scope="module")
def tiny_v4_params():
    cfg = djax.preset("tiny-v4")
    return cfg, init_params(cfg, jax.random.key(0))


def test_init_matches_abstract_and_is_deterministic(tiny_v4_params):
    cfg, params = tiny_v4_params
    abstract = abstract_params(cfg)
    assert jax.tree.structure(params) == jax.tree.structure(abstract)
    for x, a in zip(jax.tree.leaves(params), jax.tree.leaves(abstract), strict=True):
        assert x.shape == a.shape and x.dtype == a.dtype
    again = init_params(cfg, jax.random.key(0))
    for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(again), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_init_values_follow_the_declaration(tiny_v4_params):
    cfg, params = tiny_v4_params
    decl = declare(cfg)
    seen = set()
    leaves = jax.tree.leaves(params)
    for i, (p, x) in enumerate(zip(jax.tree.leaves(decl, is_leaf=is_param), leaves, strict=True)):
        x = np.asarray(x)
        seen.add(p.init)
        if p.init == "ones":
            assert np.all(x == 1)
        elif p.init == "zeros":
            assert np.all(x == 0)
        elif p.init == "hash":
            assert x.min() >= 0 and x.max() < p.high and len(np.unique(x)) > 1
        else:  # normal / uniform: random, not constant, small
            assert np.std(x) > 0 and np.all(np.isfinite(x)) and np.abs(x).max() < 1, (i, p)
    assert {"normal", "ones", "hash", "uniform"} <= seen
    # Distinct leaves of one shape get distinct values (each leaf its own folded key).
    w1 = [np.asarray(layer["ffn"]["experts"]["w1"]) for layer in params["layers"]]
    assert not np.array_equal(w1[0], w1[1])
