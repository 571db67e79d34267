"""The engine on a mesh of 8 fake CPU devices (dp x ep, experts expert-parallel, slots on dp) equals one device.

One subprocess (the device count is fixed at JAX start-up) with two engines of two step widths each: four
compiles of a one-layer model (CSA: paged pools and indexer, a biased router), LLVM optimisation off (the
compiles are most of the time; both engines run under the same flags). The mesh engine runs EPLB-relaid
params, a superset of the plain expert-parallel path.
"""

import textwrap

from tests.cpu_devices import run_on_cpu_devices

SCRIPT = textwrap.dedent(
    """
    import jax, numpy as np
    jax.config.update("jax_default_matmul_precision", "highest")
    import djax
    from djax.engine import LLM, EngineConfig, RequestParams
    from djax.params import init_params_host

    cfg = djax.preset("tiny-v4", num_hidden_layers=1, compress_ratios=(4,), num_hash_layers=0)
    params = init_params_host(cfg, 0)
    ec = EngineConfig(max_num_seqs=4, max_model_len=64, max_num_batched_tokens=32, widths=(1, 8))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, size=n).tolist() for n in (40, 1, 5, 17, 30, 9)]
    prompts.append(prompts[0][:32] + [7, 8, 9])  # a prefix-cache hit of two blocks: a snapshot restored
    greedy = [RequestParams(max_tokens=3 + i % 5, ignore_eos=True) for i in range(len(prompts))]

    def run(params, mesh=None):
        llm = LLM((cfg, params), ec, mesh=mesh)
        step = llm.engine._step
        before = step._cache_size()
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        assert all(o.error is None and o.finished for o in outs)
        # One program per width: the store and tokens come back in the layout they went in.
        assert step._cache_size() - before == len(llm.engine.ec.widths), step._cache_size()
        assert [o.num_cached_tokens for o in outs] == [0] * 6 + [32]
        return [o.outputs[0].token_ids for o in outs], llm.engine

    want, _ = run(params)

    # EPLB-relaid experts (12 physical slots, hot experts replicated) expert-parallel on dp=2 x ep=4.
    mesh = djax.make_mesh(dp=2, ep=4)
    placement = djax.rebalance(np.random.default_rng(1).integers(1, 100, (1, 8)), 12, 1, 1, 4)
    assert placement.logcnt.max() > 1
    placed = djax.apply_placement(djax.shard_params(params, cfg, mesh), cfg, placement, mesh)
    got, eng = run(placed, mesh)
    assert got == want, (got, want)
    assert eng.params is placed and isinstance(eng.moe_impl, djax.ExpertParallel)  # on the mesh: used as given
    store = eng.store
    assert store["counts"].sharding.spec[0] == "dp" and store["slots"]["layers"][0]["window"].sharding.spec[0] == "dp"
    assert store["pages"][0]["pool"].sharding.is_fully_replicated and eng.prev_tok.sharding.spec[0] == "dp"

    # Logical params are placed by shard_params (experts on "ep"); params relaid off the mesh are refused.
    eng = djax.Engine(cfg, params, ec, mesh=djax.make_mesh(dp=1, ep=8))
    assert eng.params["layers"][0]["ffn"]["experts"]["w1"].sharding.spec[0] == "ep"

    def refused(params, ec, match):
        try:
            djax.Engine(cfg, params, ec, mesh=mesh)
        except ValueError as e:
            return match in str(e)

    assert refused(djax.apply_placement(params, cfg, placement), ec, "pass mesh=... to apply_placement")
    assert refused(params, EngineConfig(max_num_seqs=3), "multiple of the mesh's dp=2")
    print("ok")
    """
)


def test_engine_on_mesh_equals_one_device():
    out = run_on_cpu_devices(SCRIPT, 8)
    assert "ok" in out, out
