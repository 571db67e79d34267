"""The batch-split expert-parallel decode step keeps its decoder state split: no all-gathers, and the same logits
as one device."""

import textwrap

import pytest

from tests.cpu_devices import run_on_cpu_devices

SCRIPT = textwrap.dedent(
    """
    import re, sys
    import jax, jax.numpy as jnp, numpy as np
    jax.config.update("jax_default_matmul_precision", "highest")
    from jax.sharding import NamedSharding, PartitionSpec as P
    import djax
    from djax.params import init_params_host

    from functools import partial
    from djax.models import deepseek_v4

    def all_gathers(compiled):
        return [ln for ln in compiled.as_text().splitlines() if re.search(r"\\ball-gather(-start)?\\(", ln)]

    # bench_ep's "ep2" layout: experts on "ep", decoder state and tokens split over ("dp", "ep")
    mesh = djax.make_mesh(dp=1, ep=2)
    row = NamedSharding(mesh, P(("dp", "ep")))
    impl = djax.ExpertParallel(mesh, "grouped")
    names = sys.argv[1:]
    slot_writes = names[0] == "--slot-writes"
    if slot_writes:  # these 4 rows' decode steps write their rings by slot, not rebuild them
        deepseek_v4.SLOT_WRITES_FROM_BATCH = 1
        names = names[1:]
    for name in names:
        cfg = djax.preset(name)  # float32
        if name == "tiny-v4":
            # a sliding, a CSA and an HCA layer, the first hash-routed, as in the FP8 configs below: every kind
            # of layer and of router the preset's five hold (its last two repeat a CSA and an HCA layer)
            cfg = cfg.replace(num_hidden_layers=3, compress_ratios=(0, 4, 16), num_hash_layers=1)
        params = jax.device_put(init_params_host(cfg, 0))
        tokens = jax.random.randint(jax.random.key(1), (4, 24), 0, cfg.vocab_size)
        logits, state = djax.prefill(params, tokens, jnp.array([24, 5, 17, 1]), cfg, 64)
        tok = jnp.argmax(logits, -1).astype(jnp.int32)
        split, tok_split = jax.device_put((state, tok), row)  # copies: decode donates its state
        sharded = djax.shard_params(params, cfg, mesh)

        step_split = djax.decode.lower(sharded, tok_split, split, cfg, impl).compile()
        gathers = all_gathers(step_split)
        # V4.1's Engram hashes its token window on the host, once, by design (a pure_callback): the only one allowed
        others = [ln for ln in gathers if "pure_callback" not in ln]
        assert not others, (name, len(others), others[:3])

        if name == "tiny-v4":
            # The decode kernels (here at impl "ref", as the FFI kernels would be) run on each device's rows:
            # djax.kernels.partition gives them a rule, so their operands are not gathered either.
            kern = partial(deepseek_v4.decode_step, cfg=cfg, kernels="ref")
            ref_logits, _ = jax.jit(kern)(params, tok, state)
            kern_split = jax.jit(partial(kern, moe_impl=impl)).lower(sharded, tok_split, split).compile()
            assert not all_gathers(kern_split), all_gathers(kern_split)[:3]
            got, _ = kern_split(sharded, tok_split, jax.device_put(state, row))
            err = float(np.abs(np.asarray(got) - np.asarray(ref_logits)).max() / np.abs(np.asarray(ref_logits)).max())
            assert err <= 1e-5, ("kernels ref", err)

        # The projections' rules do not depend on how the rings are written: checked once, without slot writes
        if name == "tiny-v4" and not slot_writes:
            # FP8 projections (dims multiples of 128) through fp8_quant_gemm's rule (a decode step's few
            # rows): each device quantizes and multiplies its own rows. Three layers: a sliding one, a CSA
            # one and an HCA one, which between them hold every kind of projection
            cfg8 = cfg.replace(hidden_size=256, q_lora_rank=128, num_attention_heads=2, head_dim=64,
                               qk_rope_head_dim=16, o_lora_rank=64, o_groups=2, moe_intermediate_size=128,
                               num_hidden_layers=3, compress_ratios=(0, 4, 16), num_hash_layers=1)
            # (routed experts left unquantized: under ExpertParallel they take the local impl, not the FP8 path
            # a single device's "grouped" takes at decode, which rounds their activations)
            p8 = djax.quantize_projections(init_params_host(cfg8, 0), cfg8, experts=False)
            p8 = jax.device_put(p8)
            _, st8 = djax.prefill(p8, tokens, jnp.array([24, 5, 17, 1]), cfg8, 64)
            kern8 = partial(deepseek_v4.decode_step, cfg=cfg8, kernels="ref")
            ref8, _ = jax.jit(kern8)(p8, tok, st8)
            fp8_calls = []
            from djax.kernels import fp8_gemm as kfp8
            real = kfp8.fp8_quant_gemm
            kfp8.fp8_quant_gemm = lambda *a, **kw: fp8_calls.append(a[0].shape) or real(*a, **kw)
            split8 = jax.jit(partial(kern8, moe_impl=impl)).lower(
                djax.shard_params(p8, cfg8, mesh), tok_split, jax.device_put(st8, row)).compile()
            kfp8.fp8_quant_gemm = real
            # traced whole for the shapes (4 rows), then lowered for one device's 2 rows
            assert {s[0] for s in fp8_calls} == {4, 2}, fp8_calls
            assert not all_gathers(split8), all_gathers(split8)[:3]
            got8, _ = split8(djax.shard_params(p8, cfg8, mesh), tok_split, jax.device_put(st8, row))
            err = float(np.abs(np.asarray(got8) - np.asarray(ref8)).max() / np.abs(np.asarray(ref8)).max())
            assert err <= 1e-5, ("fp8 kernels ref", err)

            # FP8 projections in 32 x 32 blocks (V4.1's) through fp8_weight_gemm's rules, likewise (wo_a too)
            p32 = jax.device_put(djax.quantize_projections(init_params_host(cfg8, 0), cfg8, (32, 32), False))
            ref32, _ = jax.jit(kern8)(p32, tok, st8)
            w_calls = []
            real_w = kfp8.fp8_weight_gemm
            kfp8.fp8_weight_gemm = lambda *a, **kw: w_calls.append(a[0].shape) or real_w(*a, **kw)
            split32 = jax.jit(partial(kern8, moe_impl=impl)).lower(
                djax.shard_params(p32, cfg8, mesh), tok_split, jax.device_put(st8, row)).compile()
            kfp8.fp8_weight_gemm = real_w
            # rows are the second-last dim of both forms ([m, k]; the output LoRA's groups, [g, m, k])
            assert {s[-2] for s in w_calls} == {4, 2} and any(len(s) == 3 for s in w_calls), w_calls
            assert not all_gathers(split32), all_gathers(split32)[:3]
            got32, _ = split32(djax.shard_params(p32, cfg8, mesh), tok_split, jax.device_put(st8, row))
            err = float(np.abs(np.asarray(got32) - np.asarray(ref32)).max() / np.abs(np.asarray(ref32)).max())
            assert err <= 1e-5, ("fp8 32x32 kernels ref", err)

        for step in range(3):
            logits, state = djax.decode(params, tok, state, cfg)
            got, split = step_split(sharded, tok_split, split)
            err = float(np.abs(np.asarray(got) - np.asarray(logits)).max() / np.abs(np.asarray(logits)).max())
            assert err <= 1e-5, (name, step, err)
            for x in jax.tree.leaves(split):  # the new state stays split: the next step takes it as it is
                assert x.sharding.is_equivalent_to(row, x.ndim), (name, x.shape, x.sharding)
            tok = jnp.argmax(logits, -1).astype(jnp.int32)
            tok_split = jax.device_put(tok, row)
        print("ok", name, len(gathers), err)
    """
)


@pytest.mark.parametrize("name", ["tiny-v4", "tiny-v41"])  # one process each: the two can run side by side
@pytest.mark.parametrize("slot_writes", [False, True])
def test_batch_split_decode_keeps_state_split_and_equals_one_device(name, slot_writes):
    out = run_on_cpu_devices(SCRIPT, 2, *(["--slot-writes"] if slot_writes else []), name)
    assert out.count(f"ok {name} ") == 1, out
