"""Expert-parallel MoE (all_to_all dispatch / combine in shard_map) against the one-device slow twin, on 8 fake CPU devices."""

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from djax.models import moe
from djax.models.moe_ep import capacity, dropped_copies, moe_ep
from djax.sharding import make_mesh
from tests.cpu_devices import run_on_cpu_devices

_CHILD = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    jax.config.update("jax_default_matmul_precision", "highest")
    from djax.models import moe
    from djax.models.moe_ep import moe_ep, dropped_copies
    from djax.quant import quantize
    from djax.sharding import make_mesh

    assert len(jax.devices()) == 8
    E, F, D, K, LIMIT = 16, 24, 32, 2, 1.5

    def inputs(n, seed, skew=False):
        rng = np.random.default_rng(seed)
        x = jnp.asarray(rng.standard_normal((n, D)), jnp.float32)
        w1 = jnp.asarray(rng.standard_normal((E, F, D)) * D**-0.5, jnp.float32)
        w3 = jnp.asarray(rng.standard_normal((E, F, D)) * D**-0.5, jnp.float32)
        w2 = jnp.asarray(rng.standard_normal((E, D, F)) * F**-0.5, jnp.float32)
        p = np.linspace(3.0, 0.2, E) if skew else np.ones(E)  # skew: low experts hot
        idx = jnp.asarray(np.stack([rng.choice(E, K, replace=False, p=p / p.sum()) for _ in range(n)]), jnp.int32)
        weights = jnp.asarray(rng.uniform(0.1, 1.0, (n, K)), jnp.float32)
        return x, weights, idx, w1, w2, w3

    def close(got, want, what):
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        err = np.abs(got - want).max()
        scale = np.abs(want).max()
        assert scale > 0.1, (what, scale)  # never compare zeros
        assert err <= 1e-5 * scale, (what, err, scale)
        return err / scale

    def compiled(mesh, args, cf=None, impl="grouped"):
        return jax.jit(lambda *a: moe_ep(*a, LIMIT, mesh, cf, impl)).lower(*args).compile()

    def run(mesh, args, cf=None, impl="grouped"):
        return compiled(mesh, args, cf, impl)(*args)

    # n not divisible by dp * ep in two cases (padding rows are never sent nor counted).
    meshes = [((1, 8, 1), 64, (0.5, 1.0)), ((2, 4, 1), 60, (0.5,)), ((1, 2, 1), 40, (0.5,)), ((2, 2, 2), 38, (0.5,))]
    for (dp, ep, tp), n, factors in meshes:
        mesh = make_mesh(dp=dp, ep=ep, tp=tp)
        args = inputs(n, seed=10 * ep + dp)
        want = moe.experts_dense(*args, LIMIT)
        # Default capacity: nothing dropped, equals one device.
        fn = compiled(mesh, args)
        assert "all-to-all" in fn.as_text(), (dp, ep)  # the exchange really is all_to_all
        out, dropped = fn(*args)
        assert out.shape == (n, D) and int(dropped) == 0, (dp, ep, int(dropped))
        r = close(out, want, (dp, ep, tp, "full"))
        # Small capacity on skewed routing: the reported drops equal a brute-force count, and the
        # output equals one device with exactly the dropped copies' weights zeroed.
        sk = inputs(n, seed=100 + ep, skew=True)
        for cf in factors:
            out, dropped = run(mesh, sk, cf)
            keep, n_drop = dropped_copies(sk[2], E, dict(mesh.shape), cf)
            assert int(dropped) == n_drop, (dp, ep, cf, int(dropped), n_drop)
            assert cf > 0.5 or n_drop > 0, (dp, ep, "no drops to test")
            x, w, i, a1, a2, a3 = sk
            close(out, moe.experts_dense(x, w * keep, i, a1, a2, a3, LIMIT), (dp, ep, tp, cf))
            if n_drop:  # and the drops matter: the full answer differs
                assert np.abs(np.asarray(out) - np.asarray(moe.experts_dense(*sk, LIMIT))).max() > 1e-3
        print("mesh", dp, ep, tp, "ok", r)

    # The other local implementations (ragged grouped GEMM, dense scan) behind the same exchange.
    mesh = make_mesh(dp=2, ep=4)
    args = inputs(48, seed=5)
    want = moe.experts_dense(*args, LIMIT)
    for impl in ("ragged", "dense"):
        out, dropped = run(mesh, args, impl=impl)
        assert int(dropped) == 0
        close(out, want, impl)

    # Quantized expert weights (QArray: values and block scales both sharded on the expert axis).
    x, w, i, a1, a2, a3 = args
    q1, q2, q3 = (quantize(a, (8, 8)) for a in (a1, a2, a3))
    want = moe.experts_dense(x, w, i, q1.dense(jnp.float32), q2.dense(jnp.float32), q3.dense(jnp.float32), LIMIT)
    out, dropped = run(make_mesh(ep=8), (x, w, i, q1, q2, q3))
    assert int(dropped) == 0
    close(out, want, "quantized")
    print("OK")
    """
)


def test_moe_ep_equals_one_device_on_8_cpu_devices():
    assert "OK" in run_on_cpu_devices(_CHILD, 8)


def test_moe_ep_on_one_device_mesh():
    rng = np.random.default_rng(0)
    e, f, d, k, n = 4, 8, 16, 2, 10
    x = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)
    w1 = jnp.asarray(rng.standard_normal((e, f, d)) * d**-0.5, jnp.float32)
    w3 = jnp.asarray(rng.standard_normal((e, f, d)) * d**-0.5, jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((e, d, f)) * f**-0.5, jnp.float32)
    idx = jnp.asarray(np.stack([rng.permutation(e)[:k] for _ in range(n)]), jnp.int32)
    weights = jnp.asarray(rng.uniform(0.1, 1.0, (n, k)), jnp.float32)
    want = moe.experts_dense(x, weights, idx, w1, w2, w3, 0.0)
    mesh = make_mesh()
    out, dropped = jax.jit(lambda *a: moe_ep(*a, 0.0, mesh))(x, weights, idx, w1, w2, w3)
    assert int(dropped) == 0
    np.testing.assert_allclose(
        np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max())
    )


def test_capacity_and_errors():
    assert capacity(8, 2, 4, None) == 16
    assert capacity(8, 2, 4, 1.0) == 4
    assert capacity(8, 2, 4, 0.01) == 1
    assert capacity(8, 2, 4, 100.0) == 16
    with pytest.raises(ValueError, match="capacity_factor"):
        capacity(8, 2, 4, 0.0)
    keep, n_drop = dropped_copies(np.array([[0, 1], [0, 1], [1, 0]]), 2, {"ep": 1}, 0.5)
    assert n_drop == 3 and keep.tolist() == [[True, True], [True, False], [False, False]]
    x = jnp.ones((4, 8))
    w = jnp.ones((3, 8, 8))
    with pytest.raises(ValueError, match="3 experts do not divide"):
        moe_ep(x, jnp.ones((4, 1)), jnp.zeros((4, 1), jnp.int32), w, w, w, 0.0, _FakeMesh())


class _FakeMesh:
    axis_names = ("dp", "ep", "tp")
    shape = {"dp": 1, "ep": 2, "tp": 1}
