"""benchmarks/profile_launches.py's and profile_decode.py's trace readers: busy time and idle gaps with
overlapping kernels, kernels summed per name, only the device's stream threads counted."""

import argparse
import gzip
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import profile_launches as pl  # noqa: E402


def _trace(tmp_path):
    """A trace of two steps' kernels on one stream (a and b overlap; gaps of 5 before c and 2 before d), and an
    event on the device's "XLA Ops" thread spanning them, which must not count."""
    meta = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "Stream #1"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 8, "args": {"name": "XLA Ops"}},
    ]
    k = [(0, 10, "a"), (4, 8, "b"), (17, 3, "c"), (22, 4, "d")]  # (start, duration, name)
    events = meta + [{"ph": "X", "pid": 1, "tid": 7, "ts": s, "dur": d, "name": n} for s, d, n in k]
    events.append({"ph": "X", "pid": 1, "tid": 8, "ts": 0, "dur": 100, "name": "op"})
    (tmp_path / "t").mkdir()
    with gzip.open(tmp_path / "t" / "x.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    return tmp_path


@pytest.fixture
def tiny_of_three_layers(monkeypatch):
    """The scripts' tiny model (`--tiny`) with one sliding-window layer where it has two: a hash-routed
    sliding, a CSA and an HCA layer, every kind of layer and router it holds. The end-to-end runs below check
    what the scripts write (labels and fields, timings, tokens equal across option sets, the HLO and its
    fusions' names), none of which depends on the depth; the second sliding layer was only compiled again in
    every program they build."""
    monkeypatch.setitem(pl.bg.TINY, "ratios", (0, 4, 16))


def test_busy_and_gaps_merges_overlaps_and_names_the_gaps(tmp_path):
    r = pl.busy_and_gaps(_trace(tmp_path), steps=2)
    assert r["kernels_per_step"] == 2
    assert r["busy_us_per_step"] == (12 + 3 + 4) / 2  # [0, 12) merged, then c and d
    assert r["idle_us_per_step_within_span"] == (26 - 19) / 2
    assert [(g["us"], g["after"], g["before"]) for g in r["largest_gaps"]] == [(5, "b", "c"), (2, "c", "d")]


def test_kernel_table_sums_the_stream_kernels_only(tmp_path):
    rows, total = pl.profile_decode.kernel_table(_trace(tmp_path))
    assert {r["name"]: r["us"] for r in rows} == {"a": 10, "b": 8, "c": 3, "d": 4}
    assert total == 25


def test_plot_draws_every_workload_from_a_result(tmp_path):
    """The PNG of a result with a refused option set (its error text in place of timings) among the others."""
    r = {"median_step_ms": 1.5, "host_issue_ms_per_step": 0.7, "step_ms": [1.5]}
    res = {
        "date": "2026-12-06",
        "device": "test",
        "chain": {"chain_fp8_default": r, "chain_fp8_no_command_buffers": dict(r, median_step_ms=1.7)},
        "fp8": {"fp8_b1_default": r, "fp8_b1_no_custom_calls_in_command_buffers": "XlaRuntimeError: refused"},
    }
    pl.plot(res, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_main_runs_every_workload_on_the_tiny_model(tmp_path, monkeypatch, tiny_of_three_layers):
    """End to end on the CPU: the chain and the tiny model, bf16 and FP8 (V4's UE8M0 scales), the step with its
    logits kept too, under two option sets (XLA's GPU options parse on the CPU and change nothing there)."""
    args = "--tiny --batch 2 --steps 2 --reps 1 --trace-steps 1 --chain 2 --chain-dim 128 --fp8 --keep-logits"
    args += " --scale-fmt ue8m0"
    argv = [
        "profile_launches.py",
        *args.split(),
        "--variants",
        "default,no_command_buffers",
        "--out",
        str(tmp_path),
    ]
    monkeypatch.setattr(sys, "argv", argv)
    pl.main()
    res = json.loads((tmp_path / "launches.json").read_text())
    assert res["fp8_scale_fmt"] == "ue8m0"
    labels = [k for sec in ("chain", "bf16", "fp8") for k in res[sec]]
    want = [
        f"chain_{k}_{v}"
        for k in ("bf16", "bf16_donated", "fp8", "fp8_donated")
        for v in ("default", "no_command_buffers")
    ]
    want += [
        f"{k}_b2{f}_{v}"
        for k in ("bf16", "fp8")
        for f in ("", "_logits_kept")
        for v in ("default", "no_command_buffers")
    ]
    assert sorted(labels) == sorted(want)
    for sec in ("chain", "bf16", "fp8"):
        for r in res[sec].values():
            assert r["median_step_ms"] > 0 and 0 < r["host_issue_ms_per_step"] <= max(r["step_ms"])


def test_loop_step_figures_take_the_difference_and_leave_an_unseen_loop_blank():
    """A decode step of generate's loop is the difference of two calls over their steps; a loop the profiler
    saw no kernels of (one CUDA graph node) has no busy time, rather than a busy time of zero."""
    seen = {"new_tokens": [4, 12], "ms_per_call_4": 10.0, "ms_per_call_12": 26.0}
    seen |= {"trace_4": {"kernels_per_step": 100, "busy_us_per_step": 9000.0}}
    seen |= {"trace_12": {"kernels_per_step": 180, "busy_us_per_step": 24200.0}}
    r = pl.loop_step_figures(seen)
    assert (r["ms_per_decode_step"], r["kernels_per_decode_step"]) == (2.0, 10.0)
    assert r["gpu_busy_ms_per_decode_step"] == pytest.approx(1.9)
    unseen = dict(seen, trace_12={"kernels_per_step": 100, "busy_us_per_step": 9001.0})
    assert pl.loop_step_figures(unseen)["gpu_busy_ms_per_decode_step"] is None
    # the shorter call's trace without a kernel (no busy time in it): the figures still come out
    empty_first = dict(seen, trace_4={"kernels_per_step": 0})
    assert pl.loop_step_figures(empty_first)["gpu_busy_ms_per_decode_step"] == pytest.approx(24200 / 8 / 1e3)


def test_main_times_generate_loop_under_two_option_sets(tmp_path, monkeypatch, tiny_of_three_layers):
    """`--generate N1 N2` on the CPU: both lengths compiled under each option set, the tokens the same as the
    first set's, a decode step's time from the difference."""
    args = "--tiny --batch 2 --steps 1 --reps 1 --trace-steps 1 --chain 0 --generate 2 4 --prompt 8"
    variants = "default,while_in_command_buffers"
    argv = ["profile_launches.py", *args.split(), "--variants", variants, "--out", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", argv)
    # The decode step's workload, which main runs before generate's loop, is checked end to end by
    # test_main_runs_every_workload_on_the_tiny_model (nothing here reads it): left out, it compiled the tiny
    # model's step once per option set again.
    monkeypatch.setattr(pl, "model", lambda *a, **kw: {})
    pl.main()
    res = json.loads((tmp_path / "launches.json").read_text())["bf16"]
    for v in variants.split(","):
        r = res[f"bf16_generate_b2_{v}"]
        assert (
            r["same_tokens_as_default_2"] and r["same_tokens_as_default_4"]
        )  # the while set's: a real check
        assert r["ms_per_call_4"] > 0 and r["ms_per_call_2"] > 0
        assert {"ms_per_decode_step", "kernels_per_decode_step", "gpu_busy_ms_per_decode_step"} <= set(r)
    # a prompt and N2 past the model's context: refused as djax.generate refuses it, before any compilation
    cfg = pl.bg.make_config(True)
    a = argparse.Namespace(generate=(2, 4), prompt=cfg.max_position_embeddings, batch=[1])
    params = pl.djax.init_params(cfg, pl.jax.random.key(0))
    with pytest.raises(ValueError, match="exceed the context"):
        pl.generate_loop(params, cfg, a, tmp_path, "bf16", ["default"])


def test_fusion_text_finds_the_kernel_by_its_trace_name():
    """The trace names a fusion's kernel with "_" for the "." of its HLO name; the text is its instruction and
    the computation it calls, and None for a kernel no instruction is named after (a custom call's)."""
    hlo = "\n".join(
        [
            "%fused_concatenate.7 (p0: bf16[1,128,512]) -> bf16[1,129,512] {",
            "  ROOT %c = bf16[1,129,512] concatenate(%p0, %p0)",
            "}",
            "ENTRY %main {",
            "  %input_concatenate_fusion.7 = bf16[1,129,512] fusion(%a), kind=kInput, calls=%fused_concatenate.7",
            "  ROOT %input_reduce_fusion = f32[8] fusion(%b), kind=kInput, calls=%fused_reduce",
            "}",
        ]
    )
    got = pl.profile_decode.fusion_text(hlo, "input_concatenate_fusion_7")
    assert got.splitlines()[0].startswith("%input_concatenate_fusion.7 = ")
    assert got.splitlines()[1].startswith("%fused_concatenate.7 ") and got.splitlines()[-1] == "}"
    assert pl.profile_decode.fusion_text(hlo, "input_reduce_fusion").startswith("%input_reduce_fusion = ")
    assert pl.profile_decode.fusion_text(hlo, "fp8_gemm_kernel") is None


def test_fresh_trace_dir_leaves_no_earlier_trace(tmp_path):
    """A second run into the same folder must read its own trace: the readers take the first file they find."""
    old = _trace(tmp_path) / "t"
    assert list(old.rglob("*.trace.json.gz"))
    assert pl.profile_decode.fresh_trace_dir(old) == old and not old.exists()


def test_plot_runs_draws_each_run_beside_the_others(tmp_path):
    """An A/B of a change: per workload a bar per run, a run that lacks a workload left out there."""
    r = {"median_step_ms": 1.5, "host_issue_ms_per_step": 0.7, "step_ms": [1.4, 1.5, 1.6]}
    loop = {"ms_per_decode_step": 1.4, "gpu_busy_ms_per_decode_step": None}  # generate's loop: not a step
    runs = {
        "with": {
            "bf16": {"bf16_b1_default": r, "bf16_generate_b1_default": loop},
            "fp8": {"fp8_b1_default": r},
        },
        "without": {"bf16": {"bf16_b1_default": "XlaRuntimeError: refused"}},
    }
    res = {"date": "2026-12-06", "device": "test", "runs": runs}
    pl.plot_runs(res, str(tmp_path / "ab.png"))
    assert (tmp_path / "ab.png").stat().st_size > 1000
    with pytest.raises(SystemExit, match="--plot-runs"):
        pl.plot(res, str(tmp_path / "p.png"))


def test_profile_decode_writes_the_hlo_of_its_top_fusions(tmp_path, monkeypatch, tiny_of_three_layers):
    """`profile_decode.py --hlo` on the CPU: the step's optimized HLO beside the JSON, and the top kernels that
    are fusions of that HLO carry their text."""
    argv = ["profile_decode.py", "--tiny", "--batch", "2", "--steps", "1", "--hlo", "--out", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", argv)
    pl.profile_decode.main()
    res = json.loads((tmp_path / "profile_decode.json").read_text())
    hlo = (tmp_path / "hlo_b2.txt").read_text()
    assert "ENTRY" in hlo
    with_text = [r for r in res["runs"]["2"]["top"] if "hlo" in r]
    assert with_text and all(r["hlo"].split(" = ")[0].lstrip("%") in hlo for r in with_text)
