"""benchmarks/bench_generate.py's FP8 model (`--fp8`): the programs of parts decode_dequant and prefill_dequant
read none of the quantized weights as stored (`dense_on_use` re-blocks them, `no_fp8_weight_reads` keeps
`fp8_weight_gemm` off them while tracing), while the same weights as quantized take the kernels."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp

import djax
from djax.kernels import fp8_gemm as kfp8
from djax.models import deepseek_v4 as v4
from djax.params import init_params_host


def test_dense_on_use_programs_read_no_fp8_weights(monkeypatch):
    # imported here: the script sets XLA's GPU memory options when imported
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import bench_generate as bg

    calls = []
    for op in (
        "fp8_gemm",
        "fp8_quant_gemm",
        "fp8_weight_gemm",
        "grouped_contiguous",
        "grouped_swiglu_contiguous",
    ):
        fn = getattr(kfp8, op)
        monkeypatch.setattr(kfp8, op, lambda *a, fn=fn, op=op, **kw: calls.append(op) or fn(*a, **kw))
    cfg = bg.make_config(tiny=True).replace(hidden_size=256, q_lora_rank=128, o_lora_rank=128)
    params = djax.quantize_projections(init_params_host(cfg, 0), cfg)
    state = v4.init_state(cfg, 2, 16)
    tokens = jnp.zeros((2,), jnp.int32)

    def traced(p):
        calls.clear()
        jax.eval_shape(lambda p, t, s: v4.decode_step(p, t, s, cfg, kernels="ref"), p, tokens, state)
        return set(calls)

    # the decode step's two rows quantized inside the GEMM; wo_a (1 x 128 x 128 blocks a group) too
    assert {"fp8_quant_gemm", "fp8_weight_gemm"} <= traced(params)
    dense = bg.dense_on_use(params)
    assert "fp8_weight_gemm" in traced(dense)  # 64 x 64 blocks alone: the weight-only kernel reads them
    with bg.no_fp8_weight_reads():
        assert traced(dense) == set()
    assert "fp8_weight_gemm" in traced(dense)  # the setting restored


def test_main_writes_the_named_result_with_the_dequant_part(tmp_path, monkeypatch):
    """The script end to end on the tiny config: the result file takes --name (a loop over the dequant
    programs once overwrote it), and holds the decode step with the kernels and with the weights made dense."""
    import json

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import bench_generate as bg

    argv = [
        "bench_generate.py",
        "--tiny",
        "--fp8",
        "--parts",
        "decode,decode_dequant",
        "--decode-batches",
        "2",
    ]
    monkeypatch.setattr(sys, "argv", [*argv, "--name", "named", "--out", str(tmp_path)])
    bg.main()
    assert sorted(p.name for p in tmp_path.glob("*.json")) == ["generate_named.json"]
    result = json.loads((tmp_path / "generate_named.json").read_text())
    assert result["decode_fp8_gemm_speedup"]["2"] > 0
    # the roofline counts the experts djax's own step touched, measured per layer, not uniform routing's
    cfg = bg.make_config(tiny=True)
    touched = result["djax"]["decode"]["2"]["experts_touched_per_layer"]
    assert len(touched) == cfg.num_hidden_layers
    assert all(cfg.num_experts_per_tok <= n <= 2 * cfg.num_experts_per_tok for n in touched)
    assert result["roofline"]["djax"]["2"]["experts_per_layer"] == touched
