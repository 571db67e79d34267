"""forward and generate with the experts expert-parallel on 8 fake CPU devices equal one device."""

import textwrap

from tests.cpu_devices import run_on_cpu_devices

SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    jax.config.update("jax_default_matmul_precision", "highest")
    from jax.sharding import NamedSharding, PartitionSpec as P
    import djax

    # 8 experts; a CSA and an HCA layer, the first hash-routed (the learned router is the second's)
    cfg = djax.preset("tiny-v4", num_hidden_layers=2, compress_ratios=(4, 16), num_hash_layers=1)
    params = djax.init_params(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (8, 24), 0, cfg.vocab_size)
    ref = np.asarray(djax.forward(params, tokens, cfg))
    prompts = [[int(t) for t in np.asarray(tokens[i, : 3 + i])] for i in range(8)]
    batch = djax.Batch.from_lists(prompts)
    want = djax.generate(params, batch, cfg, max_new_tokens=8).to_lists()
    for dp, ep in ((2, 4), (8, 1), (1, 8)):
        mesh = djax.make_mesh(dp=dp, ep=ep)
        sharded = djax.shard_params(params, cfg, mesh)
        on_dp = NamedSharding(mesh, P("dp"))
        got = np.asarray(djax.forward(sharded, jax.device_put(tokens, on_dp), cfg, mesh=mesh))
        err = np.abs(got - ref).max() / np.abs(ref).max()
        assert err <= 1e-5, (dp, ep, err)
        b = djax.Batch(*(jax.device_put(a, on_dp) for a in (batch.tokens, batch.lengths, batch.seeds)))
        out = djax.generate(sharded, b, cfg, max_new_tokens=8, mesh=mesh).to_lists()
        assert out == want, (dp, ep, out, want)
        print("ok", dp, ep, err)
    """
)


def test_forward_and_generate_expert_parallel_equal_one_device():
    out = run_on_cpu_devices(SCRIPT, 8)
    assert out.count("ok") == 3, out
