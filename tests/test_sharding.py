"""Sharding rules: logical -> mesh axes, collisions, divisibility, meshes, and a sharded forward on 4 fake devices."""

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import djax
from djax.sharding import (
    DEFAULT_RULES,
    ShardingRules,
    abstract_mesh,
    constrain,
    logical_to_spec,
    make_mesh,
    param_shardings,
    spec_for,
)
from tests.cpu_devices import run_on_cpu_devices


def test_default_rules():
    assert logical_to_spec(("experts", "expert_mlp", "embed")) == PartitionSpec("ep", None, None)
    assert logical_to_spec(("batch", None, "embed")) == PartitionSpec("dp", None, None)
    assert logical_to_spec(("heads", "q_lora")) == PartitionSpec(None, None)
    assert logical_to_spec(()) == PartitionSpec()
    tp = ShardingRules.tensor_parallel()
    assert logical_to_spec(("o_lora", "heads"), tp) == PartitionSpec(None, "tp")
    assert logical_to_spec(
        ("experts", "embed"), DEFAULT_RULES.replace(experts=("dp", "ep"))
    ) == PartitionSpec(("dp", "ep"), None)
    assert hash(tp) == hash(ShardingRules.tensor_parallel())  # usable as a jit static argument


def test_two_dims_on_one_mesh_axis_is_an_error():
    rules = ShardingRules(heads="tp", o_lora="tp")
    with pytest.raises(ValueError, match=r"'o_lora' and 'heads'.*mesh axis 'tp'"):
        logical_to_spec(("o_lora", "heads"), rules)
    # Through a tuple entry too, and whatever the mesh (the rules themselves are wrong).
    rules = ShardingRules(experts=("dp", "ep"))
    with pytest.raises(ValueError, match="mesh axis 'dp'"):
        logical_to_spec(("batch", "experts"), rules)
    with pytest.raises(ValueError, match="mesh axis 'dp'"):
        spec_for((4, 8), ("batch", "experts"), abstract_mesh(), rules)
    # Whole-model check: a rule set that collides on a declared weight names it.
    with pytest.raises(ValueError, match="mesh axis 'tp'"):
        param_shardings(djax.preset("tiny-v4"), abstract_mesh(tp=2), ShardingRules(heads="tp", o_lora="tp"))


def test_unknown_logical_axis_is_an_error():
    with pytest.raises(ValueError, match="unknown logical axis 'expert'"):
        logical_to_spec(("expert", None))


def test_absent_and_size_one_mesh_axes_are_dropped():
    mesh = abstract_mesh(dp=1, ep=4)
    assert spec_for((8, 6), ("experts", "embed"), mesh) == PartitionSpec("ep", None)
    assert spec_for((3, 5), ("batch", None), mesh) == PartitionSpec(None, None)  # dp has size 1
    rules = ShardingRules(batch="pod")  # not a mesh axis at all
    assert spec_for((3, 5), ("batch", None), mesh, rules) == PartitionSpec(None, None)
    both = DEFAULT_RULES.replace(experts=("dp", "ep"))
    assert spec_for((8, 6), ("experts", None), mesh, both) == PartitionSpec("ep", None)
    assert spec_for((8, 6), ("experts", None), abstract_mesh(dp=2, ep=4), both) == PartitionSpec(
        ("dp", "ep"), None
    )


def test_indivisible_dims_error_or_replicate():
    mesh = abstract_mesh(ep=3)
    with pytest.raises(
        ValueError, match=r"w1: dim 'experts' of size 8 .* not divisible by mesh axes \('ep',\)"
    ):
        spec_for((8, 4), ("experts", None), mesh, name="w1")
    assert spec_for((8, 4), ("experts", None), mesh, indivisible="replicate") == PartitionSpec(None, None)
    with pytest.raises(ValueError, match="indivisible must be one of"):
        spec_for((8, 4), ("experts", None), mesh, indivisible="pad")
    cfg = djax.preset("tiny-v4")  # 8 experts
    with pytest.raises(ValueError, match=r"layers\.0\.ffn\.experts\.w1: dim 'experts' of size 8"):
        param_shardings(cfg, mesh)
    s = param_shardings(cfg, mesh, indivisible="replicate")
    assert s["layers"][0]["ffn"]["experts"]["w1"].spec == PartitionSpec(None, None, None)
    assert param_shardings(cfg, abstract_mesh(ep=8))["layers"][0]["ffn"]["experts"]["w1"].spec[0] == "ep"


def test_make_mesh():
    mesh = make_mesh()
    assert mesh.axis_names == ("dp", "ep", "tp") and mesh.devices.size == 1
    assert tuple(mesh.axis_types) == (AxisType.Auto,) * 3
    with pytest.raises(ValueError, match="needs 4 devices"):
        make_mesh(ep=4, devices=jax.devices()[:1])
    with pytest.raises(ValueError, match="positive ints"):
        make_mesh(dp=0)
    assert abstract_mesh(dp=2, ep=4).shape == {"dp": 2, "ep": 4, "tp": 1}


def test_constrain_single_device():
    x = jnp.arange(12.0).reshape(2, 6)
    assert constrain(x, None, DEFAULT_RULES, "batch", "embed") is x
    mesh = make_mesh()

    @jax.jit
    def f(x):
        return constrain(x * 2, mesh, DEFAULT_RULES, "batch", "embed")

    np.testing.assert_array_equal(np.asarray(f(x)), np.asarray(x) * 2)
    with pytest.raises(ValueError, match="differ in rank"):
        constrain(x, mesh, DEFAULT_RULES, "batch")


# The child process sees 4 CPU devices; this one already initialised jax with one.
_CHILD = textwrap.dedent(
    """
    import jax, numpy as np
    jax.config.update("jax_default_matmul_precision", "highest")
    import djax
    from jax.sharding import NamedSharding, PartitionSpec as P
    from djax.sharding import make_mesh, param_shardings, shard_params, constrain, DEFAULT_RULES

    assert jax.device_count() == 4, jax.devices()
    cfg = djax.preset("tiny-v4")
    key = jax.random.key(0)
    tokens = jax.random.randint(jax.random.key(1), (2, 20), 0, cfg.vocab_size)
    params = djax.init_params(cfg, key)
    ref = np.asarray(djax.forward(params, tokens, cfg))

    mesh = make_mesh(dp=1, ep=4)
    shardings = param_shardings(cfg, mesh)
    sharded = djax.init_params(cfg, key, shardings=shardings)
    # Init under shardings gives the same numbers, laid out as declared.
    for a, b, s in zip(jax.tree.leaves(params), jax.tree.leaves(sharded), jax.tree.leaves(shardings)):
        assert b.sharding == s
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    w1 = sharded["layers"][-1]["ffn"]["experts"]["w1"]
    assert w1.sharding.spec == P("ep", None, None)
    assert {sh.data.shape for sh in w1.addressable_shards} == {(2,) + w1.shape[1:]}
    assert len({sh.device for sh in w1.addressable_shards}) == 4
    wq = sharded["layers"][-1]["attn"]["wq_a"]["weight"]
    assert {sh.data.shape for sh in wq.addressable_shards} == {wq.shape}

    out = np.asarray(djax.forward(sharded, tokens, cfg))
    err = np.abs(out - ref).max()
    scale = np.abs(ref).max()
    assert np.all(np.isfinite(out)) and err <= 1e-5 * scale, (err, scale)

    # shard_params places already-made params identically.
    placed = shard_params(params, cfg, mesh)
    assert all(a.sharding == s for a, s in zip(jax.tree.leaves(placed), jax.tree.leaves(shardings)))
    out2 = np.asarray(djax.forward(placed, tokens, cfg))
    assert np.abs(out2 - ref).max() <= 1e-5 * scale

    # constrain inside jit on a real 2x2 mesh.
    mesh2 = make_mesh(dp=2, ep=2)
    x = jax.numpy.arange(32.0).reshape(4, 8)
    y = jax.jit(lambda x: constrain(x + 1, mesh2, DEFAULT_RULES, "batch", None))(x)
    assert y.sharding.is_equivalent_to(NamedSharding(mesh2, P("dp", None)), 2), y.sharding
    print("OK", err, scale)
    """
)


def test_sharded_forward_equals_unsharded_on_4_cpu_devices():
    assert "OK" in run_on_cpu_devices(_CHILD, 4)


def test_param_shardings_usable_for_real_placement_on_one_device():
    cfg = djax.preset("tiny-v4")
    s = param_shardings(cfg, make_mesh())
    assert all(isinstance(x, NamedSharding) and all(e is None for e in x.spec) for x in jax.tree.leaves(s))
