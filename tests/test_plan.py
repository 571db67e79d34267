"""Memory plans: tiny-v4 numbers against hand computation; the full presets plan without allocating."""

import json
import resource

import jax
import pytest

import djax
from djax.params import count_bytes
from djax.plan import GiB, format_table, plan, standard_plans, state_bytes, weight_bytes

# tiny-v4: hidden 64, 8 experts of width 32 (w1, w2, w3: 3 x 32 x 64 each), f32; 5 layers + 1 MTP layer,
# all MoE. Experts: 6 layers x 8 experts x 3 * 32 * 64 * 4 bytes.
TINY_EXPERT_BYTES = 6 * 8 * 3 * 32 * 64 * 4  # 1_179_648

# Decoder state per request at context 32 (f32, head_dim 32, window 8, index_head_dim 16):
#   every layer: window [8, 32]                                             -> 256 floats
#   CSA (m=4, cap 8, ring 8, 2 halves): pool [8,32] + ring_kv/gate [8,64] x 2
#        + index_pool [8,16] + iring_kv/gate [8,32] x 2                     -> 1920 floats
#   HCA (m=16, cap 2, ring 16): pool [2,32] + ring_kv/gate [16,32] x 2      -> 1088 floats
#   ratios (0, 4, 16, 4, 16): 5 windows, 2 CSA, 2 HCA; lengths int32        -> + 4 bytes
TINY_STATE_PER_ROW = (5 * 256 + 2 * 1920 + 2 * 1088) * 4 + 4  # 29_188


def test_tiny_matches_hand_computation():
    cfg = djax.preset("tiny-v4")
    total = count_bytes(cfg)
    w = weight_bytes(cfg, 1, 2)
    assert w["total"] == total
    assert w["experts_per_device"] == TINY_EXPERT_BYTES // 2
    assert w["other_per_device"] == total - TINY_EXPERT_BYTES
    assert state_bytes(cfg, 1, 32) == TINY_STATE_PER_ROW
    assert state_bytes(cfg, 3, 32) == 3 * TINY_STATE_PER_ROW

    p = plan(cfg, 4, ep=4, dp=2, context=32, batch=6)
    assert p["batch_per_device"] == 3
    assert p["expert_weights_per_device_bytes"] == TINY_EXPERT_BYTES // 4
    assert p["other_weights_per_device_bytes"] == total - TINY_EXPERT_BYTES
    assert p["weights_per_device_bytes"] == total - TINY_EXPERT_BYTES + TINY_EXPERT_BYTES // 4
    assert p["state_per_device_bytes"] == 3 * TINY_STATE_PER_ROW
    assert p["state_per_request_bytes"] == TINY_STATE_PER_ROW
    assert p["total_per_device_bytes"] == p["weights_per_device_bytes"] + 3 * TINY_STATE_PER_ROW

    # defaults: dp = ep = num_devices
    d = plan(cfg, 8, context=32, batch=8)
    assert (d["dp"], d["ep"], d["batch_per_device"]) == (8, 8, 1)
    assert d["expert_weights_per_device_bytes"] == TINY_EXPERT_BYTES // 8


def test_invalid_plans():
    cfg = djax.preset("tiny-v4")
    with pytest.raises(ValueError, match="divide"):
        plan(cfg, 8, ep=3, dp=1, context=32, batch=1)
    with pytest.raises(ValueError, match="batch"):
        plan(cfg, 4, ep=4, dp=4, context=32, batch=6)
    with pytest.raises(ValueError, match="divisible"):  # 8 experts do not split over ep=16
        plan(cfg, 16, ep=16, dp=1, context=32, batch=1)


def test_full_presets_allocate_nothing():
    live = len(jax.live_arrays())
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    names, rows = standard_plans(context=65536, batch=64)
    assert len(jax.live_arrays()) == live
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 1024 * 1024  # < 1 GiB grown
    assert names == ["deepseek-v4-flash"] * 2 + ["deepseek-v4.1-flash"] * 2
    v4_8, v4_16 = rows[0], rows[1]
    # experts halve from 8 to 16 devices, the replicated rest stays; state halves with dp
    assert v4_8["expert_weights_per_device_bytes"] == 2 * v4_16["expert_weights_per_device_bytes"]
    assert v4_8["other_weights_per_device_bytes"] == v4_16["other_weights_per_device_bytes"]
    assert v4_8["state_per_device_bytes"] == 2 * v4_16["state_per_device_bytes"]
    for r in rows:
        assert r["weights_total_bytes"] > 100 * GiB  # hundreds of billions of parameters, nothing allocated
    table = format_table(rows, names)
    assert "deepseek-v4.1-flash" in table and "GiB" in table


def test_cli_plan(capsys):
    from djax.cli import main

    argv = ["plan", "--preset", "deepseek-v4-flash", "--devices", "8", "--context", "65536", "--batch", "64"]
    assert main(argv) == 0
    assert "deepseek-v4-flash" in capsys.readouterr().out
    assert main([*argv, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 1 and rows[0]["num_devices"] == 8 and rows[0]["batch_per_device"] == 8
    assert (
        rows[0]["total_per_device_bytes"]
        == rows[0]["weights_per_device_bytes"] + rows[0]["state_per_device_bytes"]
    )
