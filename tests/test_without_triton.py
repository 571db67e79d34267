"""djax without its `kernels` extra: Triton (and TileLang) are optional, so importing djax and decoding on the
jnp path must not import them (the README's install is `pip install -e .`)."""

import textwrap

from tests.cpu_devices import run_on_cpu_devices

SCRIPT = textwrap.dedent(
    """
    import sys
    sys.modules["triton"] = None  # any `import triton` now raises ImportError
    sys.modules["tilelang"] = None
    import jax, jax.numpy as jnp
    import djax
    from djax.params import init_params_host

    for name in ("tiny-v4", "tiny-v3"):
        cfg = djax.preset(name)
        params = djax.quantize_projections(init_params_host(cfg, 0), cfg)  # FP8 weights: made dense on use
        tokens = jax.random.randint(jax.random.key(0), (2, 8), 0, cfg.vocab_size)
        logits, state = djax.prefill(params, tokens, jnp.array([8, 3]), cfg, 16)
        logits, state = djax.decode(params, jnp.argmax(logits, -1).astype(jnp.int32), state, cfg)
        assert bool(jnp.isfinite(logits).all()), name
        print("ok", name)
    """
)


def test_import_and_decode_without_triton():
    out = run_on_cpu_devices(SCRIPT, 1)
    assert out.count("ok") == 2, out
