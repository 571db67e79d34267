"""The side-by-side scripts' shared parts (benchmarks/ab_plot.py), the grouped one's layouts
(benchmarks/ab_fp8_grouped.py) and the attention one's variant names, on the CPU: the order of a round's
timings, --plot, the rows checked and the variants timed."""

import functools
import json
import sys
from dataclasses import replace
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from checks import needs_triton_interp

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import ab_plot  # noqa: E402


def test_one_round_starts_each_round_with_the_next_variant():
    traced = []

    def variant(name):
        def fn(x):
            traced.append(name)  # runs when `bench` traces its jit, once per call of bench
            return x + 1.0

        return fn, [(jnp.arange(4.0),)]

    timed = {name: variant(name) for name in "abc"}
    for rnd, first in [(0, "a"), (1, "b"), (2, "c"), (4, "b")]:
        traced.clear()
        times = ab_plot.one_round(timed, rnd)
        start = "abc".index(first)
        assert traced == list("abc"[start:] + "abc"[:start])
        assert sorted(times) == ["a", "b", "c"] and all(t > 0 for t in times.values())
    kernels = {"a": ["earlier"]}
    ab_plot.one_round(timed, 0, kernels)  # each variant's largest kernels appended (none recorded on a CPU)
    assert kernels == {"a": ["earlier", {}], "b": [{}], "c": [{}]}


def test_timed_rounds_yields_each_round_and_prints_the_shares(monkeypatch, capsys):
    calls = []

    def fake_round(timed, rnd, kernels=None):
        calls.append((rnd, kernels))
        return {name: 2.0 * (rnd + 1) for name in timed}  # microseconds

    monkeypatch.setattr(ab_plot, "one_round", fake_round)
    kernels = {}
    rounds = list(ab_plot.timed_rounds({"a": None, "b": None}, 3, (64, "x"), (1e6, 1e12, "copy"), kernels))
    assert rounds == [{"a": 2.0, "b": 2.0}, {"a": 4.0, "b": 4.0}, {"a": 6.0, "b": 6.0}]
    assert calls == [(0, kernels), (1, kernels), (2, kernels)]
    lines = capsys.readouterr().out.splitlines()
    # 1 MB in 2 us is 0.5 TB/s: half of a 1 TB/s ceiling
    assert lines[0] == "64 x round 0 {'a': 2.0, 'b': 2.0} of copy {'a': 0.5, 'b': 0.5}"
    assert list(ab_plot.timed_rounds({"a": None}, 1, ("m",))) == [{"a": 2.0}]
    assert capsys.readouterr().out == "m round 0 {'a': 2.0}\n"  # no share given: times only


def test_side_by_side_args_replots_and_stops(tmp_path, monkeypatch):
    import argparse

    drawn = []
    saved = tmp_path / "run.json"
    saved.write_text(json.dumps({"rows": [1]}))
    monkeypatch.setattr(sys, "argv", ["x", "--plot", str(saved)])
    assert ab_plot.side_by_side_args(argparse.ArgumentParser(), 3, lambda r, p: drawn.append((r, p))) is None
    assert drawn == [({"rows": [1]}, str(tmp_path / "run.png"))]
    monkeypatch.setattr(sys, "argv", ["x", "--rounds", "4", "--build"])
    args = ab_plot.side_by_side_args(argparse.ArgumentParser(), 3)
    assert (args.rounds, args.build) == (4, True)


@pytest.fixture(scope="module")
def grouped():
    import ab_fp8_grouped

    return ab_fp8_grouped


def test_grouped_check_rows_cover_tiles_with_an_idle_half(grouped):
    """The checked rows are whole 128-row tiles of 16 groups, half of them groups whose last tile has padding
    in rows 64-127 (the tiles `half_tiles` computes with one warpgroup)."""
    sizes = [1, 300, 128, 77, 2000, 64, 65, 130] + [129] * 12
    mi = np.concatenate([np.r_[np.full(r, g), np.full(-r % 128, -1)] for g, r in enumerate(sizes)])
    rows = grouped.check_rows(mi)
    tiles = mi[rows].reshape(-1, 128)
    assert rows.size % 128 == 0 and np.all(rows % 128 == np.arange(rows.size) % 128)
    assert len(np.unique(mi[rows][mi[rows] >= 0])) == grouped.CHECK_GROUPS
    idle = (tiles[:, 0] >= 0) & (tiles[:, 64] < 0)
    assert idle.sum() >= grouped.CHECK_GROUPS // 2


def test_grouped_variants_flip_half_tiles_and_set_the_persistent_default_beside_one_tile_a_cta(grouped):
    # a group of 200 rows padded to 256, then 3 tiles of padding
    mi = np.r_[np.full(200, 0), np.full(56, -1), np.full(384, -1)]
    names = {name: (t, rows) for name, t, rows in grouped.variants(mi, 2048, 4096)}
    assert set(names) == {
        "default",
        "half_tiles",
        "persistent static",
        "one tile a CTA",
        "one tile a CTA, whole tiles",
    }
    assert all(rows == mi.size for _, rows in names.values())
    default = names["default"][0]
    assert default.persistent == "atomic" and not default.half_tiles
    assert names["half_tiles"][0] == replace(default, half_tiles=True)
    assert names["persistent static"][0] == replace(default, persistent="static")
    one_a_cta = names["one tile a CTA"][0]  # half tiles up to k 4096
    assert one_a_cta == replace(default, persistent="", half_tiles=True)
    assert names["one tile a CTA, whole tiles"][0] == replace(one_a_cta, half_tiles=False)
    names = {name: t for name, t, _ in grouped.variants(mi[:256], 4096, 7168)}
    assert not names["one tile a CTA"].half_tiles and "one tile a CTA, half_tiles" in names
    names = {name: t for name, t, _ in grouped.variants(mi[:256], 384, 4096)}
    assert set(names) == {"default", "whole tiles"}  # 128x128 tiles: no persistent kernel
    assert not names["default"].persistent and names["default"].half_tiles


def test_fp4_tilings_parse_and_plot(tmp_path, monkeypatch):
    """ab_fp4_tilings' tiling names become the configs they name, and --plot draws an earlier run's rows
    (the first tiling as the baseline)."""
    import ab_fp4_tilings

    from djax.kernels.grouped_gemm_triton import GemmConfig

    assert ab_fp4_tilings.parse_tiling("16x128x256w8s3") == GemmConfig(16, 128, 256, 8, 3)
    rows = [
        dict(n=1, cfg=c, round=r, us=us + r, of_copy=0.5 * 80 / (us + r))
        for r in range(2)
        for c, us in (("a", 80.0), ("b", 90.0))
    ]
    run = tmp_path / "run.json"
    run.write_text(json.dumps(dict(device="gpu", copy=3e12, rows=rows)))
    monkeypatch.setattr(sys, "argv", ["ab_fp4_tilings.py", "--plot", str(run)])
    ab_fp4_tilings.main()
    assert (tmp_path / "run.png").stat().st_size > 0


def test_attn_variants_name_triton_tilings_and_tilelang_ones():
    """ab_attn_tilings' variant names: a Triton tiling spelled out becomes sparse_decode's Triton arguments, a
    named TileLang variant its arguments on top of the shared ones, anything else a clear error."""
    import ab_attn_tilings

    assert ab_attn_tilings.variant("tr16x32w4s2n8") == dict(
        impl="triton", block_h=16, block_s=32, num_warps=4, num_stages=2, nsplit=8
    )
    assert ab_attn_tilings.variant("tr64x64w8s3n1")["block_h"] == 64
    pair = ab_attn_tilings.variant("pair3")
    assert pair["impl"] == "tilelang" and pair["dim_pair"] and pair["num_stages"] == 3
    for bad in ("tr16x32w4s2", "triton", "pair9"):
        with pytest.raises(ValueError, match="unknown variant"):
            ab_attn_tilings.variant(bad)


def test_fp8_quant_gemm_sweep_and_run(tmp_path, monkeypatch):
    """ab_fp8_quant_gemm: the sweep's tiles (16-row, and 8- and 16-row with the dot swapped; splits that keep two
    K blocks, never the default)
    and a run on the CPU, where every variant takes the references: each checked and timed, the JSON and the
    PNG written."""
    import ab_fp8_quant_gemm as ab

    from djax.kernels import fp8_quant_triton as qk
    from djax.kernels.fp8_quant_triton import quant_config

    before = (qk.MARKSTEIN, qk.NEWTON)
    flags = ab.traced_with(lambda: (qk.MARKSTEIN, qk.NEWTON), MARKSTEIN=False, NEWTON=not qk.NEWTON)()
    assert (
        flags == (False, not before[1]) and (qk.MARKSTEIN, qk.NEWTON) == before
    )  # set while traced, restored
    tiles = ab.sweep(1, 512, 4096)
    default = quant_config(1, 512, 4096)
    assert tiles and all(c != default for _, c in tiles)
    assert {(c.block_m, c.swap_ab) for _, c in tiles} == {(16, False), (8, True), (16, True)}
    assert {c.block_m for _, c in ab.sweep(9, 512, 4096)} == {16}
    assert all(4096 // 128 % c.split_k == 0 and 4096 // 128 // c.split_k >= 2 for _, c in tiles)
    # one shape, three input sets, one swept tile at two rows (each variant is compiled and traced on the CPU)
    argv = "--shapes 256x256 --rows 2 --sweep-rows 2 --rounds 1 --weight-mb 0 --out".split() + [str(tmp_path)]
    monkeypatch.setattr(sys, "argv", ["ab_fp8_quant_gemm.py", *argv])
    monkeypatch.setattr(ab, "sweep", lambda m, n, k, sweep=ab.sweep: sweep(m, n, k)[:1])
    import bench_kernels

    monkeypatch.setattr(bench_kernels, "measure_ceilings", lambda: (3e12, 8e14))  # a 2 GiB pass: not on CI
    ab.main()
    res = json.loads((tmp_path / "fp8_quant_gemm_ab.json").read_text())
    (row,) = res["rows"]
    assert (row["m"], row["n"], row["k"]) == (2, 256, 256)
    names = set(row["rel_err"])
    assert {"two-step", "quant default", "quant default ue8m0", "bf16 weight"} <= names
    assert {"quant default ieee (before)", "quant default markstein div (before)"} <= names
    assert len(names) == 8 and "quant m16 n64 s1 ue8m0" in names and res["copy_bw"] == 3e12
    assert all(row["rel_err"][n] == 0.0 for n in names if n != "bf16 weight")  # the same jnp reference
    assert set(row["rounds"][0]) == names and all(t > 0 for t in row["rounds"][0].values())
    assert (tmp_path / "fp8_quant_gemm_ab.png").stat().st_size > 0


def test_fp8_quant_gemm_pairs_run(tmp_path, monkeypatch):
    """ab_fp8_quant_gemm --pairs on the CPU, where both variants take the references: two calls against one
    pair call, UE8M0 and (up to 32 rows) plain scales, each checked against the two references and timed."""
    import ab_fp8_quant_gemm as ab
    import bench_kernels

    argv = "--pairs 256+128x256 --rows 2 --rounds 1 --weight-mb 0 --out".split() + [str(tmp_path)]
    monkeypatch.setattr(sys, "argv", ["ab_fp8_quant_gemm.py", *argv])
    monkeypatch.setattr(bench_kernels, "measure_ceilings", lambda: (3e12, 8e14))
    ab.main()
    res = json.loads((tmp_path / "fp8_quant_gemm_pair_ab.json").read_text())
    (row,) = res["rows"]
    assert (row["m"], row["n"], row["n1"], row["k"]) == (2, 384, 256, 256)
    names = {"two calls ue8m0", "pair ue8m0", "two calls plain", "pair plain", "pair plain ieee (before)"}
    names |= {"pair plain markstein div (before)"}
    assert set(row["rel_err"]) == names and all(e == 0.0 for e in row["rel_err"].values())
    assert set(row["rounds"][0]) == names and all(t > 0 for t in row["rounds"][0].values())
    assert (tmp_path / "fp8_quant_gemm_pair_ab.png").stat().st_size > 0


@needs_triton_interp
def test_moe_fp8_variants_and_run(tmp_path, monkeypatch):
    """ab_moe_fp8: the variants' K steps (both kernels, one of them, the stage counts), the fused kernel and
    the activations' quantization as they were, and the prefill variants; then runs on the CPU at small expert shapes through Triton's interpreter
    (decode, then --prefill with one Triton variant), each variant checked against the reference on the first
    tokens and timed, the JSON and the PNG written."""
    import ab_moe_fp8 as ab
    import bench_kernels

    full = ab.variants
    v = full(64)
    assert v["default"] == {} and v["padding rows written (before)"] == dict(pad_rows=True)
    assert v[ab.XLA] == dict(row_quant=False) and v[ab.XLA_BYTES] == dict(row_quant=False, words=False)
    tiles = {name: (kw["cfg"], kw["swiglu_cfg"]) for name, kw in v.items() if "cfg" in kw}
    steps = {name: (c.block_k, f.block_k, c.num_stages) for name, (c, f) in tiles.items()}
    assert steps["both bk256 st4"] == (256, 256, 4) and steps["both bk512 st2"] == (512, 512, 2)
    assert steps["gate/up bk256 st4"] == (128, 256, 4) and steps["down bk256 st4"] == (256, 128, 4)
    assert len(v) == 11 and steps["both bk128 st6"] == (128, 128, 6)
    assert v[ab.IEEE] == dict(markstein=False) and ab.IEEE not in full(64, ue8m0=True)
    assert all(c.block_m == f.block_m == 16 for c, f in tiles.values())
    prefill = full(4096, prefill=True)
    assert prefill["default"] == {} and prefill["tilelang"] == dict(impl="tilelang")
    assert prefill["triton 128-row groups"]["cfg"].block_m == 128 and len(prefill) == 9
    assert prefill[f"tilelang, {ab.IEEE}"] == dict(impl="tilelang", markstein=False)
    assert len(full(4096, prefill=True, ue8m0=True)) == 7
    assert prefill[ab.XLA] == dict(row_quant=False)
    assert prefill[f"tilelang, {ab.XLA_BYTES}"] == dict(impl="tilelang", row_quant=False, words=False)
    monkeypatch.setattr(ab, "D", 256)
    monkeypatch.setattr(ab, "F", 128)
    monkeypatch.setattr(ab, "E", 8)
    monkeypatch.setattr(ab, "K", 2)
    monkeypatch.setattr(ab, "IMPL", "interpret")
    kept = ("default", "padding rows written (before)", "both bk256 st4")
    monkeypatch.setattr(
        ab, "variants", lambda n, prefill, ue8m0: {k: full(n, prefill, ue8m0)[k] for k in kept}
    )
    monkeypatch.setattr(bench_kernels, "measure_ceilings", lambda: (3e12, 8e14))  # a 2 GiB pass: not on CI
    # one timed pass over the sets where a GPU run takes seven: each pass is four interpreted calls
    monkeypatch.setattr(bench_kernels, "bench", functools.partial(bench_kernels.bench, reps=1))
    monkeypatch.setattr(
        sys, "argv", ["ab_moe_fp8.py", "--tokens", "3", "--rounds", "1", "--out", str(tmp_path)]
    )
    ab.main()
    res = json.loads((tmp_path / "moe_fp8_ab.json").read_text())
    (row,) = res["rows"]
    assert row["tokens"] == 3 and 0 < row["touched"] <= 6 and row["bytes"] > 0 and res["copy_bw"] == 3e12
    assert set(row["rel_err"]) == set(kept) and all(e <= ab.RTOL for e in row["rel_err"].values())
    assert set(row["rounds"][0]) == set(kept) and all(t > 0 for t in row["rounds"][0].values())
    assert row["kernels"] == {name: [{}] for name in kept}  # one round's kernels each (none on a CPU)
    assert (tmp_path / "moe_fp8_ab.png").stat().st_size > 0
    # --prefill: the default and the variant --only names (TileLang's need a GPU), the FLOPs as the PNG's measure
    kept = ("default", ab.XLA)
    monkeypatch.setattr(ab, "variants", full)
    argv = [
        "--prefill",
        "--tokens",
        "24",
        "--rounds",
        "1",
        "--out",
        str(tmp_path),
        "--only",
        ab.XLA,
        "--ue8m0",
    ]
    monkeypatch.setattr(sys, "argv", ["ab_moe_fp8.py", *argv])
    ab.main()
    res = json.loads((tmp_path / "moe_fp8_prefill_ab_ue8m0.json").read_text())
    assert res["ue8m0"]
    (row,) = res["rows"]
    assert res["prefill"] and row["tokens"] == 24 and row["flops"] == 2 * 24 * 2 * 3 * 256 * 128
    assert set(row["rounds"][0]) == set(kept) and all(e <= ab.RTOL for e in row["rel_err"].values())


@needs_triton_interp
def test_moe_layout_checks_and_times_both(tmp_path, monkeypatch):
    """ab_moe_layout: the kernel (past MAX_PICKS too, for the A/B) and XLA's ops, each checked equal on every
    output, timed, the JSON and the PNG written; MAX_PICKS as it was after."""
    import ab_moe_layout as ab
    import bench_kernels

    from djax.kernels import moe_layout_triton

    monkeypatch.setattr(ab, "IMPL", "interpret")
    monkeypatch.setattr(
        moe_layout_triton, "MAX_PICKS", 16
    )  # 5 tokens x 6 picks: past it, the kernel still runs
    monkeypatch.setattr(bench_kernels, "bench", functools.partial(bench_kernels.bench, reps=1))
    launches = []
    real = moe_layout_triton.launch_torch
    monkeypatch.setattr(moe_layout_triton, "launch_torch", lambda *a: launches.append(1) or real(*a))
    argv = ["--tokens", "5", "--block-m", "16", "--rounds", "1", "--out", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", ["ab_moe_layout.py", *argv])
    ab.main()
    assert moe_layout_triton.MAX_PICKS == 16 and launches  # the kernel ran, not the reference in its place
    res = json.loads((tmp_path / "moe_layout_ab.json").read_text())
    (row,) = res["rows"]
    assert row["picks"] == 30 and row["block_m"] == 16 and row["equal"] == {"kernel": True}
    assert set(row["rounds"][0]) == {"kernel", "xla"} and all(t > 0 for t in row["rounds"][0].values())
    assert (tmp_path / "moe_layout_ab.png").stat().st_size > 0
