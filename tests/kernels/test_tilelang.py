"""The TileLang FP8 block-scaled GEMM: CUDA lowering and sm_90a cubin, AscendC lowering, and (GPU) values vs the ref.

Two CUDA variants: "pointer" (cp.async, raw pointers, djax/ffi/csrc/cubin_launch.cc) and "ws" (TMA + warp
specialisation; its CUtensorMap parameters are encoded per call by djax/ffi/csrc/tma_launch.cc from a plan that
djax.ffi.tma reads off TileLang's host module).

TileLang 0.1.15 (the version gpu-carry.sh packs) is in the `test` extra; these tests skip where it is not
installed.
"""

import dataclasses
import functools
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checks import ascend_backend_missing, assert_close, needs_tilelang

from djax.ffi import build
from djax.kernels.fp8_gemm_ref import fp8_gemm_ref, quantize_act, quantize_weight
from djax.kernels.fp8_gemm_tilelang import WS_VARIANTS, WsTiling

needs_nvcc = pytest.mark.skipif(
    build.cuda_include() is None or shutil.which("nvcc") is None, reason="needs nvcc and cuda.h"
)
needs_cuda_h = pytest.mark.skipif(build.cuda_include() is None, reason="needs CUDA's cuda.h")


@pytest.fixture(scope="module", autouse=True)
def _lower_each_program_once():
    """TileLang lowers a program in about a second, and these tests lowered many programs more than once: the
    tiling options applied to the lowered source (early_store, half_tiles) leave the program as it was, a
    compiled kernel's test lowers its program again, and some tests lower what another lowers. Here a program
    is lowered once per module for its TVMScript text, target and pass options (the lowering's whole input);
    what follows the lowering (source edits, launch plans, nvcc) runs in every test as before."""
    from djax.kernels import fp8_gemm_tilelang as tl_mod

    lowered, real = {}, tl_mod.lower

    def lower(program, target, pass_config):
        key = (program.script(), repr(sorted(target.items())), repr(sorted(pass_config.items())))
        if key not in lowered:
            lowered[key] = real(program, target, pass_config)
        return lowered[key]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tl_mod, "lower", lower)
        yield


@needs_tilelang
def test_default_tiling_fits_shapes():
    from djax.kernels.fp8_gemm_tilelang import default_tiling

    decode = default_tiling(64, 4096, 7168)
    assert (decode.block_m, decode.threads) == (64, 128) and 128 % decode.block_n == 0
    prefill = default_tiling(4096, 4096, 4096)
    assert (prefill.block_m, prefill.block_n, prefill.threads) == (128, 128, 256)
    assert default_tiling(8, 128, 128).stages == 1  # never more stages than k blocks


@needs_tilelang
def test_cuda_lowering_gives_pointer_only_kernel():
    """No GPU needed: TileLang lowers to CUDA source whose entry takes exactly the five device pointers the FFI
    launcher passes (TMA off), with wgmma for Hopper and guards for a partial m tile."""
    from djax.kernels.fp8_gemm_tilelang import Tiling, lower_cuda

    src, launch = lower_cuda(40, 256, 384, Tiling(64, 64, 2))
    assert launch["name"] == "fp8_gemm_kernel"
    assert launch["params"] == ("A", "AS", "B", "BS", "C")
    assert launch["grid"] == (256 // 64, 1, 1) and launch["threads"] == 128
    assert launch["shared_bytes"] >= 2 * (64 + 64) * 128  # two stages of fp8 tiles
    assert 'extern "C" __global__' in src and "fp8_gemm_kernel(" in src
    assert "wgmma" in src and "CUtensorMap" not in src
    assert "cp_async_gs_conditional" in src  # rows past m are masked


@needs_tilelang
@pytest.mark.slow
@pytest.mark.skipif(build.cuda_include() is None or shutil.which("nvcc") is None, reason="needs nvcc")
def test_cubin_for_sm90_without_a_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("DJAX_FFI_CACHE", str(tmp_path / "ffi"))
    from djax.kernels.fp8_gemm_tilelang import Tiling, cuda_kernel

    k = cuda_kernel.__wrapped__(64, 128, 256, Tiling(64, 64, 2))
    assert k.cubin.binary[:4] == b"\x7fELF" and k.cubin.name.encode() in k.cubin.binary
    assert k.cubin.threads == 128 and k.cubin.extra_null == 0 and k.grid == (2, 1, 1)
    assert list((tmp_path / "tilelang").glob("kernel-*.cubin"))  # cached for the next process
    # The lowering too: a second build lowers nothing and gives the same kernel.
    from djax.kernels import fp8_gemm_tilelang

    assert list((tmp_path / "tilelang").glob("fp8_gemm_pointer-*.json"))
    monkeypatch.setattr(fp8_gemm_tilelang, "lower_cuda", lambda *a: pytest.fail("lowered again"))
    again = cuda_kernel.__wrapped__(64, 128, 256, Tiling(64, 64, 2))
    assert again.cubin == k.cubin and again.grid == k.grid and again.params == k.params


@needs_cuda_h
def test_tma_launch_library_builds(tmp_path, monkeypatch):
    """The TMA launcher builds from cuda.h alone (the driver is dlopened at run time) and exports the handler,
    the loader and the host-side plan checker."""
    monkeypatch.setenv("DJAX_FFI_CACHE", str(tmp_path))
    lib = build.library.__wrapped__("tma_launch", cuda=True)
    for sym in ("DjaxTmaLaunch", "djax_tma_load_cubin", "djax_tma_check_plan"):
        assert hasattr(lib, sym)


def _sizes(m, n, k, split=1):
    """Bytes of the FFI buffers in order: A, AS, B, BS, then the result (bf16, or f32 partials when split)."""
    out = split * m * n * 4 if split > 1 else m * n * 2
    return [m * k, m * (k // 128) * 4, n * k, (n // 128) * (k // 128) * 4, out]


@needs_tilelang
@needs_cuda_h
@pytest.mark.parametrize(
    "m,n,k,tiling",
    [(4096, 4096, 4096, None), (200, 512, 1024, None), (64, 4096, 4096, "split")],
)
def test_ws_descriptors_match_kernel(m, n, k, tiling):
    """No GPU needed: the TMA + warp-specialised kernel's parameters, as the launcher will pass them, are the
    two scale pointers and three tensor maps describing A, B and the result with their true (unpadded) extents,
    boxes matching the tile sizes and 128-byte swizzle; the C++ plan checker accepts them over buffers of the
    right sizes and rejects a result buffer one row short."""
    from djax.ffi import tma
    from djax.kernels.fp8_gemm_tilelang import WsTiling, default_ws_tiling, lower_ws

    if tiling == "split":
        t = WsTiling(64, 128, 4, split_k=4)
    else:  # one B load per k block: the 128-wide tilings (the 256-wide ones load B in two slices)
        t = default_ws_tiling(m, n, k)
        t = t if t.block_n <= 128 else WsTiling(128, 128, 3, panel=8)
    src, launch = lower_ws(m, n, k, t)
    assert launch["threads"] == t.consumer_threads + 128  # one producer warpgroup
    assert launch["grid"] == (n // t.block_n, -(-m // t.block_m), t.split_k)
    assert launch["shared_bytes"] >= t.stages * (t.block_m + t.block_n) * 128
    maps = {p.buffer: p for p in launch["params"] if isinstance(p, tma.TensorMap)}
    ptrs = [p for p in launch["params"] if not isinstance(p, tma.TensorMap)]
    assert sorted(ptrs) == [1, 3] and sorted(maps) == [0, 2, 4]  # AS, BS pointers; A, B, C tensor maps
    a, b, c = maps[0], maps[2], maps[4]
    assert (a.dtype, a.dims, a.strides, a.box) == (0, (k, m), (1, k), (128, t.block_m))
    assert (b.dtype, b.dims, b.strides, b.box) == (0, (k, n), (1, k), (128, t.block_n))
    assert a.swizzle == b.swizzle == 3 and a.interleave == 0 and a.element_strides == (1, 1)
    if t.split_k > 1:
        assert (c.dtype, c.dims, c.strides[:2]) == (7, (n, m, t.split_k), (4, 4 * n))  # f32 partials
    else:
        assert (c.dtype, c.dims, c.strides) == (9, (n, m), (2, 2 * n))  # bf16
    # the source takes exactly these parameters: descriptors by value, the scales by pointer
    assert src.count("__grid_constant__ const CUtensorMap") == 2 * 3  # declaration and definition
    assert "wgmma" in src and "tma_load" in src and "tma_store" in src
    kern = tma.TmaKernel("x", launch["name"], b"", launch["grid"], launch["threads"], 0, launch["params"])
    assert tma.check(kern, _sizes(m, n, k, t.split_k)) == 5
    short = _sizes(m, n, k, t.split_k)
    short[4] -= 64
    with pytest.raises(ValueError, match="spans"):
        tma.check(kern, short)


@needs_tilelang
def test_ws_lowering_is_kept_on_disk(tmp_path, monkeypatch):
    """The second lowering of a shape comes from disk, tensor maps included, equal to the first; another shape
    or tiling lowers afresh."""
    monkeypatch.setenv("DJAX_FFI_CACHE", str(tmp_path / "ffi"))
    from djax.ffi.tma import TensorMap
    from djax.kernels import fp8_gemm_tilelang as tl_mod

    calls = []

    def counting(*args):
        calls.append(args)
        return tl_mod.lower_ws(*args)

    t = tl_mod.WsTiling(128, 128, 3, panel=8)
    first = tl_mod.lowered_on_disk("fp8_gemm_ws", (200, 512, 1024, t), counting, (tl_mod.__file__,))
    again = tl_mod.lowered_on_disk("fp8_gemm_ws", (200, 512, 1024, t), counting, (tl_mod.__file__,))
    assert len(calls) == 1 and again == first
    assert any(isinstance(p, TensorMap) for p in again[1]["params"])
    tl_mod.lowered_on_disk(
        "fp8_gemm_ws", (200, 512, 1024, tl_mod.WsTiling(128, 128, 4)), counting, (tl_mod.__file__,)
    )
    assert len(calls) == 2


@needs_tilelang
@needs_nvcc
@pytest.mark.slow
@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_ws_cubins_for_sm90_without_a_gpu(tmp_path, monkeypatch, phase):
    """The first prefill and decode "ws" tilings compile to sm_90a cubins (about 7 s each)."""
    monkeypatch.setenv("DJAX_FFI_CACHE", str(tmp_path / "ffi"))
    from djax.kernels.fp8_gemm_tilelang import WS_VARIANTS, ws_kernel

    m, n, k = (256, 512, 512) if phase == "prefill" else (64, 1024, 1024)
    kern = ws_kernel.__wrapped__(m, n, k, WS_VARIANTS[phase][0])
    assert kern.binary[:4] == b"\x7fELF" and kern.name.encode() in kern.binary
    assert kern.threads in (256, 384) and kern.shared_bytes > 48 * 1024


NEW_WS = [
    t
    for ts in WS_VARIANTS.values()
    for t in ts
    if (t.smem_scales or t.block_n > 128 or t.warpgroups) and not t.persistent  # (its own test below)
]
PERSISTENT = [t for ts in WS_VARIANTS.values() for t in ts if t.persistent]


@needs_tilelang
@needs_cuda_h
@pytest.mark.parametrize("tiling", NEW_WS, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [200, 5])
def test_ws_new_layouts_lower(tiling, m):
    """No GPU needed: 128x256 tiles (two 128-column slices per warpgroup: two B loads and two wgmma chains per
    k block), two side-by-side consumer warpgroups, and scales in shared memory (AS and BS become TMA tensor
    maps over the CTA's k range, no per-block global loads) lower to kernels whose launch plan the C++ checker
    accepts, with m not a multiple of the block."""
    from djax.ffi import tma
    from djax.kernels.fp8_gemm_tilelang import lower_ws

    n, k = 1024, 1024
    src, launch = lower_ws(m, n, k, tiling)
    assert launch["threads"] == tiling.consumer_threads + 128
    assert launch["grid"] == (n // tiling.block_n, -(-m // tiling.block_m), tiling.split_k)
    assert (
        launch["shared_bytes"]
        >= min(tiling.stages, 8 // tiling.split_k) * (tiling.block_m + tiling.block_n) * 128
    )
    assert launch["shared_bytes"] <= 227 * 1024  # the H200's opt-in limit per block
    maps = {p.buffer: p for p in launch["params"] if isinstance(p, tma.TensorMap)}
    # A's box: m rows when A is one partial tile (no box past A's end), else the tile's block_m
    rows = min(m, tiling.block_m)
    assert maps[0].box == (128, rows) and re.search(rf"expect_t\w*\({rows * 128}\);", src)
    if tiling.smem_scales:
        # each scale tile arrives once, by a tensor map or (a contiguous, in-bounds region) a 1-D bulk copy
        assert {0, 2, 4} <= set(maps)
        kss = -(-(k // 128 // tiling.split_k) // 4) * 4
        if m > tiling.block_m:  # rows past m in the last tile row: only a tensor map zero-fills them
            assert (maps[1].dtype, maps[1].dims, maps[1].box) == (7, (k // 128, m), (kss, tiling.block_m))
        elif 1 in maps:  # the m rows there are
            assert (maps[1].dtype, maps[1].dims, maps[1].box) == (7, (k // 128, m), (kss, m))
        else:
            assert f"{m * kss * 4});" in next(ln for ln in src.splitlines() if "(&(AS[" in ln)
        for line in src.splitlines():
            if "AS[" in line or "BS[" in line:
                assert "tma_load" in line, line
    else:
        assert sorted(maps) == [0, 2, 4]
    assert maps[2].box == (128, tiling.block_n // tiling.slices)
    assert "wgmma" in src and "warpgroup_reg_alloc" in src
    if tiling.slices == 2:
        assert src.count("tl::tma_load(B_desc") == 2
    kern = tma.TmaKernel("x", launch["name"], b"", launch["grid"], launch["threads"], 0, launch["params"])
    assert tma.check(kern, _sizes(m, n, k, tiling.split_k)) == 5


@needs_tilelang
@needs_cuda_h
@pytest.mark.parametrize("tiling", PERSISTENT, ids=lambda t: t.name)
@pytest.mark.parametrize("m,n,k", [(4096, 4096, 4096), (2100, 4096, 512), (100, 512, 1024)])
def test_persistent_lowers_with_the_default_plan(tiling, m, n, k):
    """No GPU needed: the persistent kernel is launched with the plan of TileLang's one-tile-a-CTA lowering of
    the same tiles (A's box of m rows when A is one partial tile, the bytes the kernel expects), one CTA per SM
    or per tile where there are fewer tiles, its ring and its own 64 KB of staging, and its constants for the
    shape; the C++ checker accepts the plan."""
    from djax.ffi import tma
    from djax.kernels.dispatch import sm_count
    from djax.kernels.fp8_gemm_tilelang import lower_ws

    src, launch = lower_ws(m, n, k, tiling)
    tiles = -(-m // 128) * (n // 256)
    assert launch["threads"] == 384 and launch["params"][1].box == (128, min(m, 128))
    assert launch["grid"] == (min(tiles, sm_count()), 1, 1)
    assert launch["shared_bytes"] == 3 * 3 * 128 * 128 + 2 * 128 * 256 <= 227 * 1024
    atomic = int(tiling.persistent == "atomic")
    for define in (f"DJAX_M {m}", f"DJAX_N_TILES {n // 256}", f"DJAX_KB {k // 128}", "DJAX_STAGES 3"):
        assert f"#define {define}\n" in src
    assert f"#define DJAX_A_ROWS {min(m, 128)}\n" in src and f"#define DJAX_ATOMIC {atomic}\n" in src
    kern = tma.TmaKernel("x", launch["name"], b"", launch["grid"], launch["threads"], 0, launch["params"])
    assert tma.check(kern, _sizes(m, n, k)) == 5


@needs_tilelang
@needs_nvcc
@pytest.mark.slow
def test_persistent_cubins_for_sm90_without_a_gpu(tmp_path, monkeypatch):
    """Both schedules compile to sm_90a cubins; the atomic one keeps its tile counter in the module."""
    monkeypatch.setenv("DJAX_FFI_CACHE", str(tmp_path / "ffi"))
    from djax.kernels.dispatch import sm_count
    from djax.kernels.fp8_gemm_tilelang import ws_kernel

    for tiling in PERSISTENT:
        kern = ws_kernel.__wrapped__(2100, 4096, 512, tiling)
        assert kern.binary[:4] == b"\x7fELF" and kern.name.encode() in kern.binary
        assert kern.grid == (min(272, sm_count()), 1, 1) and kern.shared_bytes == 212992
        assert (b"next_tile" in kern.binary) == (tiling.persistent == "atomic")


def test_persistent_refusals():
    from djax.kernels.fp8_gemm_tilelang import WsTiling, check_ws_tiling, ws_program

    good = WsTiling(128, 256, 3, 8, scales_ahead=True, persistent="atomic")
    check_ws_tiling(100, 512, 1024, good)
    assert good.name == "ws128x256s3_p8_sa_pers_atomic"
    for bad in (
        WsTiling(128, 128, 3, 8, scales_ahead=True, persistent="atomic"),  # 128x256 tiles only
        WsTiling(128, 256, 3, 8, persistent="static"),  # its k loop loads the scales ahead
        WsTiling(128, 256, 3, 8, scales_ahead=True, early_store=True, persistent="static"),
        WsTiling(128, 256, 3, 8, split_k=2, scales_ahead=True, persistent="static"),
        WsTiling(128, 256, 4, 8, scales_ahead=True, persistent="static"),  # 4 stages + staging: 256 KB
        WsTiling(128, 256, 3, 8, scales_ahead=True, persistent="dynamic"),
        WsTiling(128, 256, 3, -1, scales_ahead=True, persistent="static"),  # a tile order past the grid
    ):
        with pytest.raises(ValueError):
            check_ws_tiling(4096, 4096, 4096, bad)
    with pytest.raises(ValueError, match="multiple of 256"):
        check_ws_tiling(4096, 384, 4096, good)
    with pytest.raises(ValueError, match="one tile a CTA"):  # TileLang's grouped program is one tile a CTA
        ws_program(256, 512, 512, good, groups=2)
    with pytest.raises(ValueError, match="half tiles"):  # the dense GEMM has no padding rows
        check_ws_tiling(4096, 4096, 4096, dataclasses.replace(good, half_tiles=True))
    grouped = dataclasses.replace(good, half_tiles=True)
    check_ws_tiling(4096, 4096, 4096, grouped, groups=256)
    for m, groups, match in [
        (4000, 4, "multiple of 128"),  # the grouped layout's rows are whole tiles
        (4096, 0x10000, "at most 65535 groups"),  # a group shares an int with its tile row in the list
        (128 * 5000, 4, "does not fit in shared memory"),  # the list of 5,000 tile rows beside the ring
    ]:
        with pytest.raises(ValueError, match=match):
            check_ws_tiling(m, 4096, 4096, grouped, groups=groups)
    one_stage = dataclasses.replace(grouped, stages=1)
    check_ws_tiling(128 * 16383, 4096, 4096, one_stage, groups=4)
    with pytest.raises(ValueError, match="fewer than 16384 tile rows"):  # 14 bits of tile row in the list
        check_ws_tiling(128 * 16384, 4096, 4096, one_stage, groups=4)
    with pytest.raises(ValueError, match="1 to 3 stages"):
        check_ws_tiling(4096, 4096, 4096, dataclasses.replace(grouped, stages=4), groups=4)


GROUPED_PERSISTENT = [
    WsTiling(128, 256, 3, 8, scales_ahead=True, half_tiles=half, persistent=walk)
    for walk in ("static", "atomic")
    for half in (True, False)
]


@needs_tilelang
@needs_cuda_h
@pytest.mark.parametrize("tiling", GROUPED_PERSISTENT, ids=lambda t: t.name)
@pytest.mark.parametrize("m,n,k,groups", [(57088, 2048, 4096, 256), (1024, 512, 1024, 4)])
def test_grouped_persistent_lowers_with_the_grouped_plan(tiling, m, n, k, groups):
    """No GPU needed: the grouped persistent kernel takes the launch plan of TileLang's grouped program for
    the same tiles (B's tensor map over every group, MI last), one CTA per SM or per tile, the ring and staging
    as the dense kernel, its constants (groups, half tiles), and its parameters are that program's; the C++
    checker accepts the plan."""
    from djax.ffi import tma
    from djax.kernels.dispatch import sm_count
    from djax.kernels.fp8_gemm_tilelang import lower_ws

    src, launch = lower_ws(m, n, k, tiling, groups)
    plain_src, plain = lower_ws(m, n, k, dataclasses.replace(tiling, persistent=""), groups)
    assert (
        launch["name"] == plain["name"] == "fp8_gemm_grouped_kernel" and launch["params"] == plain["params"]
    )
    assert launch["params"][3].dims == (k, n, groups) and launch["params"][3].box == (128, 128, 1)
    assert launch["grid"] == (min(m // 128 * n // 256, sm_count()), 1, 1)
    assert launch["shared_bytes"] == 3 * 3 * 128 * 128 + 2 * 128 * 256
    for define in (f"DJAX_M {m}", f"DJAX_GROUPS {groups}", f"DJAX_HALF_TILES {int(tiling.half_tiles)}"):
        assert f"#define {define}\n" in src
    assert "DJAX_GROUPS 0" in lower_ws(m, n, k, dataclasses.replace(tiling, half_tiles=False))[0]
    kern = tma.TmaKernel("x", launch["name"], b"", launch["grid"], launch["threads"], 0, launch["params"])
    sizes = [
        m * k,
        m * (k // 128) * 4,
        groups * n * k,
        groups * (n // 128) * (k // 128) * 4,
        4 * m,
        2 * m * n,
    ]
    assert tma.check(kern, sizes) == 6


def test_grouped_default_is_the_persistent_kernel_where_it_takes_the_layout():
    """Given the layout's rows, the grouped default is the persistent kernel with the atomic walk and whole
    tiles (measured faster at every layout), over the same tiles as the one-tile-a-CTA kernel, which stays
    the default without the rows (half tiles up to k 4096), with 128-column tiles, for a layout whose list
    of tile rows does not fit beside the ring (4,800 tile rows do, 4,801 do not) and past 65,535 groups."""
    from djax.kernels.fp8_gemm_tilelang import WsTiling, default_grouped_tiling

    one_a_cta = default_grouped_tiling(2048, 4096)
    assert one_a_cta == WsTiling(128, 256, 3, 8, scales_ahead=True, half_tiles=True)
    persistent = dataclasses.replace(one_a_cta, persistent="atomic", half_tiles=False)
    assert default_grouped_tiling(2048, 4096, 57088) == persistent
    assert default_grouped_tiling(4096, 7168, 32768) == persistent
    assert default_grouped_tiling(2048, 4096, 4800 * 128) == persistent
    assert default_grouped_tiling(2048, 4096, 4801 * 128) == one_a_cta
    assert default_grouped_tiling(2048, 4096, 57088, groups=65535) == persistent
    assert default_grouped_tiling(2048, 4096, 57088, groups=65536) == one_a_cta
    assert default_grouped_tiling(384, 4096, 57088) == default_grouped_tiling(384, 4096)
    assert default_grouped_tiling(384, 4096).block_n == 128


@needs_tilelang
@needs_cuda_h
def test_grouped_gemm_without_a_tiling_lowers_the_persistent_kernel():
    """`lower_ws` with no tiling (as `grouped_contiguous_tilelang` calls it) lowers the grouped default for
    the layout's rows: the persistent kernel's atomic walk, one CTA per SM."""
    from djax.kernels.dispatch import sm_count
    from djax.kernels.fp8_gemm_tilelang import lower_ws

    src, launch = lower_ws(57088, 2048, 4096, None, 256)
    assert launch["name"] == "fp8_gemm_grouped_kernel" and launch["grid"] == (sm_count(), 1, 1)
    assert "#define DJAX_ATOMIC 1\n" in src and "#define DJAX_HALF_TILES 0\n" in src


@needs_tilelang
@needs_nvcc
@pytest.mark.slow
def test_grouped_persistent_cubins_for_sm90_without_a_gpu(tmp_path, monkeypatch):
    """Both walks, with and without half tiles, compile to sm_90a cubins of the grouped kernel, with the same
    dynamic shared memory as the dense one (the grouped walk's list is static)."""
    monkeypatch.setenv("DJAX_FFI_CACHE", str(tmp_path / "ffi"))
    from djax.kernels.fp8_gemm_tilelang import ws_kernel

    for tiling in GROUPED_PERSISTENT:
        kern = ws_kernel.__wrapped__(1408, 512, 1024, tiling, 6)
        assert kern.binary[:4] == b"\x7fELF" and b"fp8_gemm_grouped_kernel" in kern.binary
        assert kern.grid == (22, 1, 1) and kern.shared_bytes == 212992
        assert (b"next_tile" in kern.binary) == (tiling.persistent == "atomic")


K_GROUPS = [t for t in WS_VARIANTS["decode"] if t.k_groups > 1]


@needs_tilelang
@needs_cuda_h
@pytest.mark.parametrize("tiling", K_GROUPS, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [64, 5])
def test_ws_k_groups_lower(tiling, m):
    """No GPU needed: the decode program with k_groups consumer warpgroups taking turns over the k blocks lowers
    to one producer plus k_groups consumer warpgroups with no CTA-wide barrier after the roles split (one would
    deadlock the producer against its ring); a split tile is one cluster of split_k CTAs (declared in the source)
    whose sum is written as bf16 by `djax_cluster_sum`, so the result is a plain pointer of m x n bf16; A and B
    come by TMA, and the C++ checker accepts the launch plan over buffers of the right sizes."""
    from djax.ffi import tma
    from djax.kernels.fp8_gemm_tilelang import lower_ws

    n, k = 1024, 2048
    src, launch = lower_ws(m, n, k, tiling)
    assert launch["threads"] == 128 * (tiling.k_groups + 1)
    assert launch["grid"] == (n // tiling.block_n, 1, tiling.split_k)
    assert src.count("__syncthreads()") == 1  # after the barriers' init, before the roles split
    clustered = tiling.split_k > 1
    assert (f"__cluster_dims__(1, 1, {tiling.split_k})" in src) == clustered
    if tiling.push_regs:
        # every consumer warpgroup hands its registers to djax_push_regs (its group index compiled in, so they
        # stay registers): st.async to the owners' mbarriers, no staging loop, no bulk copy
        for g in range(tiling.k_groups):
            call = f"djax_push_regs<{tiling.split_k}, {tiling.k_groups}, {tiling.block_n}, {g}>(C, {m}, {n},"
            assert src.count(call) == 1 and f", c{g}, (&(((float*)xfer)[0]))" in src
        assert "djax_push_sum<" not in src.split('extern "C" __global__')[-1]
        assert "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32" in src
        assert not re.search(r"\(\(float\*\)sums\)\[[^;]*\] = ", src)  # nothing staged by TileLang
        rows, slots = 64 // tiling.split_k, (tiling.split_k - 1) * tiling.k_groups
        assert f"summed[0].arrive_and_expect_tx({slots * rows * tiling.block_n * 4});" in src
        assert src.count("tl::cluster_wait();") == tiling.k_groups + 1 and "tl::cluster_arrive();" not in src
    elif tiling.push_sum:
        # every consumer warpgroup stages its sum and joins djax_push_sum, which sends the other splits' rows in
        # bulk copies completing their mbarrier (expecting every other split's warpgroups' bytes); one
        # cluster barrier only, relaxed, at the start (the barriers' init), and no releasing arrive anywhere
        push = f"djax_push_sum<{tiling.split_k}, {tiling.k_groups}, {tiling.block_n}>(C,"
        assert src.count(push) == tiling.k_groups and "djax_cluster_sum<" not in src
        rows, slots = 64 // tiling.split_k, (tiling.split_k - 1) * tiling.k_groups
        assert f"summed[0].arrive_and_expect_tx({slots * rows * tiling.block_n * 4});" in src
        assert "cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes" in src
        assert "mbarrier.arrive.relaxed.cluster.shared::cluster.b64" in src
        assert src.count("tl::cluster_arrive_relaxed();") == tiling.k_groups + 1
        assert src.count("tl::cluster_wait();") == tiling.k_groups + 1 and "tl::cluster_arrive();" not in src
    else:
        # every consumer warpgroup takes a share of the cluster sum; the last barrier does not wait for its
        # stores
        sums = f"djax_cluster_sum<{tiling.split_k}, {tiling.block_n}, {128 * tiling.k_groups}>(C,"
        assert src.count(sums) == (tiling.k_groups if clustered else 0)
        assert src.count("tl::cluster_arrive_relaxed();") == (tiling.k_groups + 1 if clustered else 0)
    # the k coordinate of B's loads: split z's j-th block is z kps + j
    kps = k // 128 // tiling.split_k
    step = "(j * 128)" if tiling.split_k == 1 else f"((((int)blockIdx.z) * {kps * 128}) + (j * 128))"
    hint_a, hint_b = ("<tl::CacheHintSm90::EVICT_LAST>", "<tl::CacheHintSm90::EVICT_FIRST>")
    if not tiling.cache_hints:  # L2 asked to keep A (every column tile reads it) and let the weights go first
        hint_a = hint_b = ""
    assert src.count(f"tl::tma_load{hint_a}(A_desc") == 1 and src.count(f"tl::tma_load{hint_b}(B_desc") == 1
    assert step in src.split(f"tl::tma_load{hint_b}(B_desc", 1)[1].split("\n", 1)[0]
    assert src.count("warpgroup_reg_alloc") == tiling.k_groups
    maps = {p.buffer: p for p in launch["params"] if isinstance(p, tma.TensorMap)}
    assert sorted(maps) == [0, 2] and 4 in launch["params"]  # A, B by TMA; the bf16 result a pointer
    # A's box spans A's rows (never past its end), B's the tile's columns
    assert maps[0].box == (128, min(m, 64)) and maps[2].box == (128, tiling.block_n)
    assert re.search(rf"expect_t\w*\({min(m, 64) * 128}\);", src)
    kern = tma.TmaKernel("x", launch["name"], b"", launch["grid"], launch["threads"], 0, launch["params"])
    assert tma.check(kern, _sizes(m, n, k)) == 5
    with pytest.raises(ValueError):
        tma.check(kern, _sizes(m - 1 if m > 1 else 2, n, k))


@needs_tilelang
@pytest.mark.parametrize("block_m,stages,consumers", [(128, 3, 256), (64, 2, 128)])  # two warpgroups, one
def test_ws_early_store_reorders_only_the_epilogue(block_m, stages, consumers):
    """No GPU needed: the early-store source is TileLang's with the first slice's TMA stores moved ahead of
    the second slice's staging, issued and waited for by one thread (a bulk-async group belongs to the
    thread that committed it), and one wait at the end instead of two; for two consumer warpgroups or one."""
    from collections import Counter

    from djax.kernels.fp8_gemm_tilelang import WsTiling, lower_ws, with_early_store

    m, n, k = 256, 512, 1024
    tiling = WsTiling(block_m, 256, stages, 8, scales_ahead=True)
    base, launch = lower_ws(m, n, k, tiling)
    early, launch_es = lower_ws(m, n, k, dataclasses.replace(tiling, early_store=True))
    assert launch_es == launch and early == with_early_store(base) != base
    assert (base.count("tma_store_wait"), early.count("tma_store_wait")) == (2, 1)
    assert base.count("tma_store_arrive") == early.count("tma_store_arrive") == 2
    # the first slice's stores come before the second slice is staged, after the barrier ending the first's
    tail = early[early.index("ptx_stmatrix") :]
    first_store, second_staging = (
        tail.index("tl::tma_store(C_desc, (&(((bfloat16_t*)c_s)"),
        tail.index("c1_s)["),
    )
    assert tail.index("c_s)[") < tail.index("__sync_thread_partial") < first_store < second_staging
    assert tail.index("tma_store_wait") > tail.index("tl::tma_store(C_desc, (&(((bfloat16_t*)c1_s)")
    assert early.count("if (((int)threadIdx.x) == 128) {") == 2 and "tl_shuffle_elect" not in tail
    # otherwise the same lines: the elected block's guard and its first wait exchanged for a second block
    added = Counter(early.splitlines()) - Counter(base.splitlines())
    removed = Counter(base.splitlines()) - Counter(early.splitlines())
    assert added == Counter(
        {"    if (((int)threadIdx.x) == 128) {": 2, "      tl::fence_proxy_async();": 1, "    }": 1}
    )
    assert removed == Counter(
        {f"    if (tl::tl_shuffle_elect<{consumers}>()) {{": 1, "      tl::tma_store_wait<0, true>();": 1}
    )
    with pytest.raises(NotImplementedError, match="epilogue"):  # one slice: nothing to reorder
        with_early_store(lower_ws(m, n, k, WsTiling(128, 128, 3))[0])


@needs_tilelang
def test_ws_tiling_validation_and_defaults():
    from djax.kernels.fp8_gemm_tilelang import MEASURED_WS_BEST, WsTiling, check_ws_tiling, default_ws_tiling

    for bad in (WsTiling(128, 192, 3), WsTiling(192, 128, 3), WsTiling(128, 128, 3, warpgroups=1)):
        with pytest.raises(ValueError):
            check_ws_tiling(256, 1024, 1024, bad)
    with pytest.raises(ValueError, match="smem_scales"):
        check_ws_tiling(64, 1024, 384, WsTiling(64, 128, 4, smem_scales=True))  # 3 k blocks: stride 12 bytes
    with pytest.raises(ValueError, match="block_n"):
        check_ws_tiling(64, 384, 1024, WsTiling(64, 256, 4, warpgroups=2))
    for bad in (
        WsTiling(64, 64, 8, k_groups=5),  # 2-4 consumer warpgroups
        WsTiling(64, 64, 8, split_k=3, k_groups=2),  # a cluster of 1, 2 or 4
        WsTiling(64, 128, 8, k_groups=4),  # 104 registers a consumer: not two 64x128 f32 tiles
        WsTiling(64, 128, 8, k_groups=2),  # 192 KB of ring + 32 KB of sums + 14.6 KB of scales
        WsTiling(64, 64, 8, k_groups=2, smem_scales=True),
        WsTiling(64, 64, 6, k_groups=4),  # a ring buffer shared by two groups
    ):
        with pytest.raises(ValueError):
            check_ws_tiling(64, 4096, 7168, bad)
    with pytest.raises(ValueError, match="m <= 64"):
        check_ws_tiling(65, 4096, 7168, WsTiling(64, 64, 8, k_groups=2))
    assert WsTiling(64, 64, 8, split_k=2, k_groups=4).name == "ws64x64s8_k2_g4"
    pr = WsTiling(64, 64, 8, split_k=4, k_groups=4, push_sum=True, push_regs=True)
    check_ws_tiling(64, 4096, 2048, pr)
    with pytest.raises(ValueError, match="a k block per group"):  # 4 k blocks over 4 splits of 4 groups
        check_ws_tiling(64, 4096, 512, pr)
    with pytest.raises(ValueError, match="push_regs needs push_sum"):
        check_ws_tiling(64, 4096, 7168, WsTiling(64, 64, 8, split_k=2, k_groups=2, push_regs=True))
    with pytest.raises(ValueError, match="push_regs needs push_sum"):  # 64 / 8 quads over 3 groups
        check_ws_tiling(
            64, 4096, 7168, WsTiling(64, 64, 6, split_k=2, k_groups=3, push_sum=True, push_regs=True)
        )
    with pytest.raises(ValueError, match="push_sum is for"):
        check_ws_tiling(64, 4096, 7168, WsTiling(64, 64, 8, split_k=2, push_regs=True))
    assert pr.name == "ws64x64s8_k4_g4_ps_pr"
    with pytest.raises(ValueError, match="cache_hints is an option of the k-group program"):
        check_ws_tiling(64, 4096, 7168, WsTiling(64, 64, 8, split_k=2, cache_hints=True))
    assert WsTiling(64, 64, 8, split_k=2, k_groups=2, cache_hints=True).name == "ws64x64s8_k2_g2_ch"
    with pytest.raises(ValueError, match="push_sum"):  # nothing to push without a split
        check_ws_tiling(64, 4096, 7168, WsTiling(64, 64, 8, k_groups=2, push_sum=True))
    with pytest.raises(ValueError, match="push_sum"):  # only the k-group program has a cluster sum
        check_ws_tiling(64, 4096, 7168, WsTiling(64, 64, 8, split_k=2, push_sum=True))
    with pytest.raises(ValueError, match="shared memory"):  # 128 KB ring + 64 KB staged + 32 KB received
        check_ws_tiling(64, 4096, 7168, WsTiling(64, 64, 8, split_k=2, k_groups=4, push_sum=True))
    assert WsTiling(64, 64, 8, split_k=2, k_groups=2, push_sum=True).name == "ws64x64s8_k2_g2_ps"
    assert WsTiling(128, 256, 3, 8, scales_ahead=True).name == "ws128x256s3_p8_sa"
    with pytest.raises(ValueError, match="scales_ahead"):  # the scales come from one place
        check_ws_tiling(4096, 4096, 4096, WsTiling(128, 256, 3, smem_scales=True, scales_ahead=True))
    with pytest.raises(ValueError, match="no other options"):  # the decode program reads its own scales
        check_ws_tiling(64, 4096, 7168, WsTiling(64, 64, 8, split_k=2, k_groups=2, scales_ahead=True))
    assert WsTiling(128, 256, 3).slices == 2 and WsTiling(64, 256, 3, warpgroups=2).slices == 1
    edits = WsTiling(64, 256, 2, 8, scales_ahead=True, early_store=True)
    assert edits.name == "ws64x256s2_p8_sa_es"
    check_ws_tiling(4096, 4096, 4096, edits)
    for bad in (WsTiling(128, 128, 3, early_store=True), WsTiling(128, 256, 3, split_k=2, early_store=True)):
        with pytest.raises(ValueError, match="early_store needs two 128-column slices"):
            check_ws_tiling(4096, 4096, 4096, bad)
    assert WsTiling(64, 256, 5, split_k=2, warpgroups=2, smem_scales=True).name == "ws64x256s5_k2_w2_ss"
    for (regime, n, k), t in MEASURED_WS_BEST.items():
        assert default_ws_tiling(64 if regime == "decode" else 4096, n, k) == t
        for m in (1, 8, 64) if regime == "decode" else (4096,):  # every measured default is a valid tiling
            check_ws_tiling(m, n, k, t)
    assert default_ws_tiling(4096, 8192, 8192) == WsTiling(128, 256, 3, panel=8, scales_ahead=True)  # 256 | n
    assert default_ws_tiling(4096, 1152, 2048) == WsTiling(
        128, 128, 4
    )  # else 128 wide; small weights: no raster
    assert default_ws_tiling(4096, 8064, 8192).panel == 8  # 63 x 128 wide, weights over half the L2


@needs_tilelang
@needs_cuda_h
def test_accumulator_layout_is_the_one_push_regs_assumes():
    """djax_push_regs reads the accumulator's registers by position: register i of lane l in warp w holds row
    16 w + 8 ((i & 3) >> 1) + l / 4, column 8 (i >> 2) + 2 (l & 3) + (i & 1) (wgmma's layout). The bulk push
    stages the same registers through TileLang's own indexing; its lowered store says where TileLang puts
    each register, and it must be that layout (swizzled by (row & 3) << 3)."""
    from djax.kernels.fp8_gemm_tilelang import WsTiling, lower_ws

    src, _ = lower_ws(64, 1024, 2048, WsTiling(64, 64, 8, split_k=2, k_groups=2, push_sum=True))
    (index,) = re.findall(r"\(\(float\*\)sums\)\[(.*)\] = c0\[i_5\];", src)
    index = index.replace("((int)threadIdx.x)", "tx")
    assert set(re.sub(r"\b(tx|i_5)\b|\d+", "", index)) <= set("()+*&^> ")  # plain integer arithmetic
    for tx in range(128):
        for i_5 in range(32):
            w, lane = tx // 32, tx % 32
            row = 16 * w + 8 * ((i_5 & 3) >> 1) + lane // 4
            col = 8 * (i_5 >> 2) + 2 * (lane & 3) + (i_5 & 1)
            assert eval(index, {}, {"tx": tx, "i_5": i_5}) == row * 64 + (col ^ ((row & 3) << 3))


@needs_tilelang
@needs_nvcc
@pytest.mark.slow
# nvcc takes seconds per kernel: one per new layout (128-column slices + shared-memory scales; 2 warpgroups;
# k groups summed in a cluster)
@pytest.mark.parametrize(
    "tiling",
    [
        t
        for t in NEW_WS + K_GROUPS
        if t.name in ("ws128x256s3_p8_ss", "ws64x256s5_k2_w2_ss", "ws64x64s8_k2_g4", "ws64x64s8_k4_g4_ps_pr")
    ],
    ids=lambda t: t.name,
)
def test_ws_new_cubins_for_sm90_without_a_gpu(tmp_path, monkeypatch, tiling):
    monkeypatch.setenv("DJAX_FFI_CACHE", str(tmp_path / "ffi"))
    from djax.kernels.fp8_gemm_tilelang import ws_kernel

    m = 64 if tiling.block_m == 64 else 256
    kern = ws_kernel.__wrapped__(m, 1024, 2048, tiling)
    assert kern.binary[:4] == b"\x7fELF" and kern.name.encode() in kern.binary


@needs_tilelang
@needs_cuda_h
@pytest.mark.parametrize("n", [2048, 384])
def test_grouped_program_lowers_with_tile_skip_and_3d_weights(n):
    """No GPU needed: the grouped contiguous program (MoE prefill) takes A, its scales, the weights of every
    group as one 3-D tensor map [g, n, k] whose box covers one group, their scales and the rows' groups by
    pointer; its producer loads the tile's group's weights (the group read from m_indices as the third
    coordinate), and the whole tile is skipped when its first row is padding. The C++ plan checker accepts it
    over buffers of the right sizes."""
    from djax.ffi import tma
    from djax.kernels.fp8_gemm_tilelang import default_grouped_tiling, lower_ws

    m, k, g = 1024, 1024, 8
    t = default_grouped_tiling(n, k)
    assert t.block_n == (256 if n % 256 == 0 else 128)
    src, launch = lower_ws(m, n, k, t, g)
    assert launch["grid"] == (n // t.block_n, m // 128, 1) and launch["threads"] == 384
    maps = {p.buffer: p for p in launch["params"] if isinstance(p, tma.TensorMap)}
    ptrs = [p for p in launch["params"] if not isinstance(p, tma.TensorMap)]
    assert sorted(ptrs) == [1, 3, 4] and sorted(maps) == [0, 2, 5]  # AS, BS, MI pointers; A, B, C maps
    b = maps[2]
    assert (b.dims, b.strides, b.box) == ((k, n, g), (1, k, n * k), (128, min(t.block_n, 128), 1))
    assert "if (0 <= MI[(((int)blockIdx.y) * 128)])" in src  # the skip of a padding tile
    loads = re.findall(r"tma_load\(B_desc, [^;]*;", src)
    assert loads and all(x.endswith("MI[(((int)blockIdx.y) * 128)]);") for x in loads)
    kern = tma.TmaKernel("x", launch["name"], b"", launch["grid"], launch["threads"], 0, launch["params"])
    sizes = [m * k, m * (k // 128) * 4, g * n * k, g * (n // 128) * (k // 128) * 4, 4 * m, 2 * m * n]
    assert tma.check(kern, sizes) == 6


@needs_tilelang
@needs_nvcc
@pytest.mark.parametrize("n", [512, 384])  # two 128-column slices a warpgroup; one
def test_grouped_half_tiles_give_the_idle_warpgroup_a_loop_of_barriers(tmp_path, monkeypatch, n):
    """No GPU needed: with `half_tiles` the consumer branch computes once whether its warpgroup's 64 rows are
    padding (the second warpgroup, m_indices -1 at the tile's row 64); if so it runs a loop of only the k
    loop's stage waits and arrivals, in their order, and skips the lowered k loop. Everything else is
    the plain lowering. The cubin compiles."""
    monkeypatch.setenv("DJAX_FFI_CACHE", str(tmp_path / "ffi"))
    from djax.kernels.fp8_gemm_tilelang import default_grouped_tiling, lower_ws, ws_kernel

    t = default_grouped_tiling(n, 1024)
    # the default up to k 4096, where it was measured faster (at k 7168 it was slower)
    assert t.half_tiles and default_grouped_tiling(n, 4096).half_tiles
    assert not default_grouped_tiling(n, 7168).half_tiles
    plain, _ = lower_ws(1024, n, 1024, dataclasses.replace(t, half_tiles=False), 4)
    src, _ = lower_ws(1024, n, 1024, t, 4)
    flag = (
        "const bool djax_idle_half = (((((int)threadIdx.x) >> 7) + 1) & 1) == 1 && "
        "MI[((((int)blockIdx.y) * 128) + 64)] < 0;"
    )
    assert src.count(flag) == 1 and src.index(flag) > src.index("tl::warpgroup_reg_alloc<240>();")
    idle = re.search(
        r"if \(djax_idle_half\) \{\n *#pragma unroll 1\n *for \(int j_1 = 0; j_1 < 8; \+\+j_1\) \{\n(.*?)\}",
        src,
        re.S,
    )
    statements = [x.strip() for x in idle.group(1).strip().split("\n")]
    assert all(x.startswith("mbarrier[") for x in statements)
    waits = [x for x in statements if ".wait(" in x]  # A and B share one barrier a stage; or A, B, B's slice
    assert len(waits) == (3 if n % 256 == 0 else 1) and len(statements) == 2 * len(waits)
    lowered = "if (!djax_idle_half) for (int j_1 = 0; j_1 < 8; ++j_1) {"
    assert src.count(lowered) == 1
    # without the flag, the idle loop and the lowered loop's guard, the source is the plain one
    cut = src[: src.index(flag)] + src[src.index(lowered) :]
    assert cut.replace("if (!djax_idle_half) ", "") == plain
    kern = ws_kernel.__wrapped__(1024, n, 1024, t, 4)
    assert kern.binary[:4] == b"\x7fELF"


@needs_tilelang
def test_grouped_program_refuses_what_it_does_not_do():
    from djax.kernels.fp8_gemm_tilelang import WsTiling, ws_program

    for t, m in [
        (WsTiling(128, 256, 3, split_k=2), 1024),
        (WsTiling(128, 256, 3, early_store=True), 1024),
        (WsTiling(128, 128, 3, smem_scales=True), 1024),
        (WsTiling(128, 256, 3), 1000),  # rows not whole tiles
    ]:
        with pytest.raises(ValueError, match="grouped program"):
            ws_program(m, 512, 1024, t, groups=4)
    with pytest.raises(ValueError, match="half_tiles"):  # only the grouped program has padding rows
        ws_program(1024, 512, 1024, WsTiling(128, 256, 3, half_tiles=True))
    with pytest.raises(ValueError, match="half_tiles"):  # one warpgroup of 64 rows: no half to skip
        ws_program(1024, 512, 1024, WsTiling(64, 256, 3, half_tiles=True), groups=4)


@needs_tilelang
def test_ascend_lowering_emits_ascendc():
    """TileLang's "ascend" target lowers the program to AscendC source (bisheng, absent here, compiles it)."""
    if reason := ascend_backend_missing():
        pytest.skip(reason)
    from djax.kernels.fp8_gemm_tilelang import ascend_source

    src = ascend_source(128, 128, 256)
    assert "tl_templates/ascend" in src
    assert 'extern "C" __global__' in src and "fp8_gemm_kernel(" in src
    assert "__gm__ fp8_e4_t* A" in src and "__gm__ bfloat16_t* C" in src
    assert "ASC_IS_AIC" in src and "ASC_IS_AIV" in src  # Cube GEMM and Vector promotion in one mixed kernel
    assert "ascend_gemm_l1" in src and "asc_copy_l0c2ub" in src


def _inputs(seed, m, n, k):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[:, :128] *= 30.0  # scales that differ between k blocks exercise the promotion
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    a, sa = quantize_act(jnp.asarray(x))
    b, sb = quantize_weight(jnp.asarray(w))
    return a, sa, b, sb


@needs_tilelang
@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(64, 4096, 7168), (5, 1024, 512), (200, 512, 1024), (512, 2048, 4096)])
def test_tilelang_fp8_gemm_matches_ref_on_gpu(m, n, k):
    if jax.default_backend() != "gpu":
        pytest.skip("needs a CUDA GPU")
    from djax.kernels.fp8_gemm_tilelang import fp8_gemm_tilelang

    a, sa, b, sb = _inputs(m + n + k, m, n, k)
    out = jax.jit(fp8_gemm_tilelang)(a, sa, b, sb)
    ref = jax.jit(fp8_gemm_ref)(a, sa, b, sb)
    assert out.dtype == jnp.bfloat16 and out.shape == (m, n)
    assert_close(np.asarray(out.astype(jnp.float32)), np.asarray(ref.astype(jnp.float32)), rtol=1e-2)


# bf16 output: the kernel's f32 result (within 4e-4 of the f32 reference: Hopper's fp8 MMA accumulator keeps about
# 14 mantissa bits and the kernel promotes every 128 k) is rounded to bf16, which adds at most half an ulp, 2^-9.
BF16_OUT_RTOL = 4e-4 + 2.0**-9


def _ws_cases():
    shapes = {
        # 2100x4096: 272 tiles of 128x256, more than one wave of CTAs, the last tile row partial; 100 rows:
        # one partial tile row, whose A box spans A's 100 rows
        "prefill": [(200, 512, 1024), (512, 2048, 4096), (2100, 4096, 512), (100, 512, 1024)],
        "decode": [(64, 4096, 7168), (5, 1024, 512), (200, 1024, 1024)],
    }
    return [
        pytest.param(t, *s, id=f"{t.name}-{s[0]}x{s[1]}x{s[2]}")
        for phase, ts in WS_VARIANTS.items()
        for t in ts
        for s in shapes[phase]
        if _ws_fits(t, *s)  # the refusals are test_ws_tiling_validation_and_defaults' (CPU)
    ]


def _ws_fits(tiling, m, n, k) -> bool:
    from djax.kernels.fp8_gemm_tilelang import check_ws_tiling

    try:
        check_ws_tiling(m, n, k, tiling)
    except ValueError:
        return False
    return True


@needs_tilelang
@pytest.mark.gpu
@pytest.mark.parametrize("tiling,m,n,k", _ws_cases())
def test_tilelang_ws_matches_ref_on_gpu(tiling, m, n, k):
    """Every "ws" tiling on fresh random inputs, m not a multiple of the tile included (200, 5), against the f32
    reference."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a CUDA GPU")
    from djax.kernels.fp8_gemm_tilelang import fp8_gemm_tilelang

    a, sa, b, sb = _inputs(hash(tiling) % 1000 + m + n + k, m, n, k)
    out = jax.jit(functools.partial(fp8_gemm_tilelang, tiling=tiling))(a, sa, b, sb)
    ref = jax.jit(functools.partial(fp8_gemm_ref, out_dtype=jnp.float32))(a, sa, b, sb)
    assert out.dtype == jnp.bfloat16 and out.shape == (m, n)
    assert_close(np.asarray(out.astype(jnp.float32)), np.asarray(ref), rtol=BF16_OUT_RTOL)


@needs_tilelang
@pytest.mark.gpu
@pytest.mark.parametrize("tiling", PERSISTENT, ids=lambda t: t.name)
def test_persistent_kernel_again_and_again(tiling):
    """One persistent kernel (272 tiles over the SMs: two or three a CTA) three times in one jit over different
    inputs, then three steps of a scan (XLA may run it from a command buffer): every call computes every tile,
    so the atomic schedule's tile counter is back at zero after each launch."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a CUDA GPU")
    _persistent_again_and_again(tiling, 2100, 4096, 512)


@needs_tilelang
@pytest.mark.gpu
@pytest.mark.parametrize("schedule", ["static", "atomic"])
@pytest.mark.parametrize(
    "m,n,k,panel",
    [
        (2100, 4096, 128, 8),  # one k block a tile, fewer than the stages: the next tile taken in its first
        (4000, 2048, 256, 0),  # row-major tile order, the last tile row partial
        (8192, 1024, 384, 3),  # panels of 3 tile rows, the last panel of 1
    ],
)
def test_persistent_kernel_short_k_and_tile_orders(schedule, m, n, k, panel):
    """Tiles of 1 to 3 k blocks (the ring runs on across tiles whose k loop is no longer than it) and the
    other tile orders, 256 or 272 tiles (about two a CTA), each call against the reference."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a CUDA GPU")
    from djax.kernels.fp8_gemm_tilelang import WsTiling

    _persistent_again_and_again(WsTiling(128, 256, 3, panel, scales_ahead=True, persistent=schedule), m, n, k)


def _persistent_again_and_again(tiling, m, n, k):
    from djax.kernels.fp8_gemm_tilelang import fp8_gemm_tilelang

    calls = [_inputs(seed, m, n, k) for seed in (31, 32, 33)]
    gemm = functools.partial(fp8_gemm_tilelang, tiling=tiling)
    ref = jax.jit(functools.partial(fp8_gemm_ref, out_dtype=jnp.float32))
    outs = jax.jit(lambda calls: [gemm(*x) for x in calls])(calls)
    stacked = [jnp.stack(parts) for parts in zip(*calls)]
    _, scanned = jax.jit(lambda xs: jax.lax.scan(lambda c, x: (c, gemm(*x)), 0, xs))(stacked)
    for i, x in enumerate(calls):
        want = np.asarray(ref(*x))
        assert_close(np.asarray(outs[i].astype(jnp.float32)), want, rtol=BF16_OUT_RTOL)
        assert_close(np.asarray(scanned[i].astype(jnp.float32)), want, rtol=BF16_OUT_RTOL)


@needs_tilelang
@pytest.mark.gpu
@pytest.mark.parametrize(
    "impl, m, n, k",
    [
        ("tilelang", 200, 1024, 1024),
        ("auto", 2176, 4096, 512),
        ("auto", 64, 4096, 7168),
        ("auto", 8, 7168, 4096),
        ("auto", 1, 4096, 8192),  # V4-Flash's output LoRA at batch 1
        ("auto", 64, 4096, 2048),  # and its shared expert's down projection
    ],
)
def test_tilelang_ws_default_through_public_op_in_a_loop(impl, m, n, k):
    """impl="tilelang", variant="ws" (or "auto", which takes it at a shape of 272 tiles, and at decode as the
    k-group kernel whose splits meet in a cluster, at 8 rows too) through the public op, called twice inside
    one jit over different buffers (fresh descriptors per call), and inside a scan (XLA may run it from a
    command buffer)."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a CUDA GPU")
    from djax.kernels.fp8_gemm import auto_takes_tilelang, fp8_gemm

    x1, x2 = _inputs(7, m, n, k), _inputs(8, m, n, k)
    if impl == "auto":
        assert auto_takes_tilelang(x1[0], x1[2], jnp.bfloat16)
        f = functools.partial(fp8_gemm, impl="auto")
    else:
        f = functools.partial(fp8_gemm, impl="tilelang", variant="ws")
    o1, o2 = jax.jit(lambda p, q: (f(*p), f(*q)))(x1, x2)
    ref1 = np.asarray(fp8_gemm_ref(*x1, out_dtype=jnp.float32))
    assert_close(np.asarray(o1.astype(jnp.float32)), ref1, BF16_OUT_RTOL)
    assert_close(
        np.asarray(o2.astype(jnp.float32)),
        np.asarray(fp8_gemm_ref(*x2, out_dtype=jnp.float32)),
        BF16_OUT_RTOL,
    )

    def body(c, _):
        return c, f(*x1).astype(jnp.float32)

    _, ys = jax.jit(lambda: jax.lax.scan(body, 0, None, length=3))()
    for y in np.asarray(ys):
        assert_close(y, ref1, BF16_OUT_RTOL)
