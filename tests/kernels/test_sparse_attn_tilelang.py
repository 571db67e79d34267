"""The TileLang sparse decode kernel: CUDA lowering (pointer-only parameters, launch shape, cp.async + wgmma),
the sm_90a cubin, clear errors for unsupported shapes, the AscendC lowering, and (GPU) values against
sparse_decode_ref.

Skips where tilelang (not in the `test` extra's minimal install) or nvcc is missing. Lowering takes a few
seconds per program, so the CPU tests lower few programs and share them through `lower_cuda`'s cache here.
"""

import functools
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checks import ascend_backend_missing, assert_close, needs_tilelang, sparse_decode_inputs

from djax.ffi import build
from djax.kernels.sparse_attn import sparse_decode
from djax.kernels.sparse_attn_ref import sparse_decode_ref

needs_nvcc = pytest.mark.skipif(
    build.cuda_include() is None or shutil.which("nvcc") is None, reason="needs nvcc"
)
OPERANDS = ("p0_q", "p1_window", "p2_valid", "p3_pool", "p4_topk", "p5_sinks")
BF16 = jnp.bfloat16


@functools.cache
def _lowered(shape, block_s, stages, threads, nsplit, merge=False, dsmem=False, push=False, bf16=False):
    from djax.kernels.sparse_attn_tilelang import Tiling, lower_cuda

    return lower_cuda(*shape, 0.0625, Tiling(block_s, stages, threads, nsplit, merge, dsmem, push, bf16))


@needs_tilelang
def test_lowering_plain_kernel():
    """b 3, W 100 and T 77 (not multiples of 32): 1-D blocks, one CTA per (row, 64 heads), only pointers."""
    src, launch = _lowered((3, 64, 128, 100, 300, 77), 32, 2, 256, 1)
    assert launch["name"] == "sparse_decode_kernel"
    assert launch["params"] == (*OPERANDS, "p6_out")
    assert launch["grid"] == (3, 1, 1) and launch["threads"] == 256
    assert launch["shared_bytes"] >= 2 * (64 * 128 + 2 * 32 * 128)  # q and two key stages, bf16
    assert 'extern "C" __global__' in src and "CUtensorMap" not in src
    assert "wgmma" in src and "cp_async_gs_conditional" in src  # predicated (zero-fill) gather
    assert "cp_async_wait<1>" in src  # two stages: one block in flight while the other is used


@needs_tilelang
def test_lowering_split_kernel_with_head_groups():
    """128 heads = 2 head groups, 3 uneven splits of 7 key blocks: partials and log-sum-exps as results."""
    src, launch = _lowered((3, 128, 128, 100, 300, 77), 32, 3, 256, 3)
    assert launch["name"] == "sparse_decode_split_kernel"
    assert launch["params"] == (*OPERANDS, "p6_part", "p7_lse")
    assert launch["grid"] == (3, 2, 3) and launch["threads"] == 256
    assert launch["shared_bytes"] <= 227 * 1024
    assert "cp_async_wait<2>" in src and "wgmma" in src and "CUtensorMap" not in src


@needs_tilelang
def test_lowering_warp_specialised_kernel():
    """12 warps: a producer warpgroup gathering keys (cp.async arriving on mbarriers) and two consumer
    warpgroups with rebalanced registers, handing P over through mbarriers rather than CTA barriers."""
    src, launch = _lowered((3, 64, 128, 100, 300, 77), 32, 2, 384, 2)
    assert launch["name"] == "sparse_decode_split_kernel" and launch["threads"] == 384
    assert launch["params"] == (*OPERANDS, "p6_part", "p7_lse") and launch["grid"] == (3, 1, 2)
    assert "mbarrier_cp_async_arrive_noinc" in src and "cp_async_gs_conditional" in src
    assert "warpgroup_reg_alloc<240>" in src and "warpgroup_reg_dealloc" in src and "wgmma" in src
    # the producer starts q's copies before the slot table is filled; after that the roles never wait
    # for the whole CTA
    assert src.count("if (256 <= ((int)threadIdx.x))") == 2
    first, roles = src.index("if (256 <= ((int)threadIdx.x))"), src.rindex("if (256 <= ((int)threadIdx.x))")
    assert "q_l" in src[first : src.index("__syncthreads", first)]
    assert "__syncthreads" not in src[roles:]


@needs_tilelang
def test_lowering_merged_splits_kernel():
    """Splits merged in the kernel: the 3 splits of a row are one thread-block cluster declared in the
    source (the FFI launcher's plain cuLaunchKernel honours it); the output comes first, then the scratch
    partials; every thread arrives at the cluster barrier once (each warpgroup on its own path), then both
    consumer warpgroups merge this split's third of the columns (11 of the 32 groups of 4; the last split
    10) with 16-byte loads of the partials."""
    src, launch = _lowered((3, 64, 128, 100, 300, 77), 32, 2, 384, 3, True)
    assert launch["name"] == "sparse_decode_merged_kernel" and launch["grid"] == (3, 1, 3)
    assert launch["params"] == (*OPERANDS, "p6_out", "p7_part", "p8_lse")
    assert "__launch_bounds__(384, 1) __cluster_dims__(1, 1, 3) sparse_decode_merged_kernel(" in src
    assert src.count("tl::cluster_arrive();") == 3 and src.count("tl::cluster_wait();") == 3
    assert "block_rank_in_cluster()" in src  # a launch without the cluster poisons the merge with NaN
    assert "*(float4*)(p7_part + " in src


@needs_tilelang
def test_lowering_dsmem_merged_kernel():
    """Splits merged through distributed shared memory: the same cluster, but no partials in global memory
    (TileLang drops the unused parameter, so the launcher passes out and the log-sum-exps); each consumer
    warpgroup stages its normalised half over its own key ring, and after the cluster barrier merges its
    slice from every split's shared memory (mapa + ld.shared::cluster); a second cluster barrier keeps
    every split resident until the others have read it."""
    src, launch = _lowered((3, 64, 128, 100, 300, 77), 32, 4, 384, 3, True, True)
    assert launch["name"] == "sparse_decode_merged_kernel" and launch["grid"] == (3, 1, 3)
    assert launch["params"] == (*OPERANDS, "p6_out", "p8_lse")
    assert "__launch_bounds__(384, 1) __cluster_dims__(1, 1, 3) sparse_decode_merged_kernel(" in src
    assert src.count("tl::cluster_arrive();") == 6 and src.count("tl::cluster_wait();") == 6
    assert "p7_part" not in src and "block_rank_in_cluster()" in src
    kernel = src[src.index('extern "C" __global__') :]
    assert kernel.count("djax_stage<64>(") == 2  # k 128: each warpgroup's 64 value columns
    assert kernel.count("djax_dsmem_merge<3, 11, 64, 128, 64>(") == 2  # 11 of 32 column groups of 4
    assert "ld.shared::cluster.v4.f32" in src and "mapa.shared::cluster" in src


@needs_tilelang
def test_lowering_push_merged_kernel():
    """Splits merged by pushing: the 2 splits of a row are one cluster, only the output is a result (no
    partials, no log-sum-exps), each CTA expects the peer's half of the values (64 heads x 64 columns f32)
    and its max and denominator (64 x 2 f32) on one barrier, every thread meets the cluster barrier once
    and relaxed (no releasing cluster barrier after the loop), and both consumer warpgroups end in
    `djax_push_merge`, the softmax one (0) with its registers, the other (1) with the shared copies."""
    src, launch = _lowered((3, 64, 128, 100, 300, 77), 64, 2, 384, 2, True, False, True)
    assert launch["name"] == "sparse_decode_merged_kernel" and launch["grid"] == (3, 1, 2)
    assert launch["params"] == (*OPERANDS, "p6_out")
    assert "__launch_bounds__(384, 1) __cluster_dims__(1, 1, 2) sparse_decode_merged_kernel(" in src
    kernel = src[src.index('extern "C" __global__') :]
    assert "tl::cluster_arrive();" not in kernel and kernel.count("tl::cluster_arrive_relaxed();") == 3
    assert kernel.count("tl::cluster_wait();") == 3
    assert f"arrive_and_expect_tx({64 * 64 * 4 + 64 * 2 * 4})" in kernel
    for g in (0, 1):  # the values in f32
        assert kernel.count(f"djax_push_merge<64, 128, {g}, 0>(") == 1
    assert "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32" in src and "p8_lse" not in src
    bf16, _ = _lowered((3, 64, 128, 100, 300, 77), 64, 2, 384, 2, True, False, True, True)
    assert f"arrive_and_expect_tx({64 * 64 * 2 + 64 * 2 * 4})" in bf16  # the values as bf16: half the bytes
    assert "djax_push_merge<64, 128, 0, 1>(" in bf16 and "djax_push_merge<64, 128, 1, 1>(" in bf16


@needs_tilelang
def test_lowering_tma_q_kernel():
    """tma_q: q's parameter is a tensor map over q [b, h, k] (boxes of 64 heads x 64 columns, 128-byte
    swizzle, the layout wgmma reads), one elected producer thread issues its 2 x (k / 128) boxes completing
    on key block 0's barrier (which then also expects q's bytes), and no cp.async reads q any more."""
    from djax.ffi.tma import TensorMap
    from djax.kernels.sparse_attn_tilelang import Tiling, lower_cuda

    shape = (3, 128, 512, 100, 300, 77)
    src, launch = lower_cuda(*shape, 0.0625, Tiling(64, 2, 384, 2, True, False, True, False, True))
    qmap, *rest = launch["params"]
    assert isinstance(qmap, TensorMap) and qmap.buffer == 0 and qmap.dims == (512, 128, 3)
    assert qmap.box == (64, 64, 1) and qmap.swizzle == 3 and tuple(rest) == (1, 2, 3, 4, 5, 6)
    kernel = src[src.index('extern "C" __global__') :]
    assert "p0_q[" not in kernel and kernel.count("ready[0].expect_transaction(32768);") == 2
    loads = re.findall(r"tl::tma_load\(p0_q_desc, ready\[0\], [^;]*\(\(int\)blockIdx.y\) \* 64\)", kernel)
    assert len(loads) == 2 and "tl_shuffle_elect<128>()" in kernel  # q_l's and q_r's loops, at the head group
    # the same program otherwise: the keys' cp.async gathers are unchanged
    plain, _ = _lowered(shape, 64, 2, 384, 2, True, False, True)
    gathers = "tl::cp_async_gs_conditional<16>"
    assert kernel.count(gathers) == plain[plain.index('extern "C" __global__') :].count(gathers) > 0


@needs_tilelang
def test_lowering_dim_pair_kernel():
    """dim_pair: grid (b, h / 64, 2), the pair one cluster, only the output as a result; CTA z reads columns
    [256 z, 256 z + 256) of q (16 cp.async a producer thread) and of every key row (32-key blocks of half
    rows: 8 a thread); each consumer warpgroup sends its 64 x 32 partial scores (16 floats a thread) to the
    peer's buffer of its own and adds the peer's, on barriers armed for 8 KB (the first two uses at the
    start, each later one after the use two before: 7 blocks here, 4 and 3); the two warpgroups take
    alternate blocks and end in `djax_pair_end` (warpgroup 1 with its
    thread index from 0)."""
    src, launch = _lowered_pair((3, 128, 512, 100, 300, 77), 32, 4)
    assert launch["name"] == "sparse_decode_pair_kernel" and launch["grid"] == (3, 2, 2)
    assert launch["params"] == (*OPERANDS, "p6_out")
    assert "__launch_bounds__(384, 1) __cluster_dims__(1, 1, 2) sparse_decode_pair_kernel(" in src
    kernel = src[src.index('extern "C" __global__ void __launch') :]
    assert "(((int)blockIdx.z) * 256)" in kernel and kernel.count("tl::cp_async_gs_conditional<16>") == 2
    loops = re.findall(r"for \(int i\w* = 0; i\w* < (\d+); \+\+i\w*\) \{\s+tl::cp_async_gs(\w*)<16>", kernel)
    assert loops == [("16", ""), ("8", "_conditional"), ("8", "_conditional")]  # q, then window and pool
    assert kernel.count("arrive_and_expect_tx(8192)") == 3
    # the re-arms: by the first thread of each warpgroup, uses 2 and 3 of warpgroup 0's 4, use 2 of 1's 3
    assert re.search(r"\(\(\(\(int\)threadIdx.x\) == 0\) && \(i_\d+ < 2\)\)", kernel)
    assert re.search(r"\(\(\(\(int\)threadIdx.x\) == 128\) && \(i_\d+ < 1\)\)", kernel)
    for g, frag, tid in ((0, "s", "((int)threadIdx.x)"), (1, "s_1", "(((int)threadIdx.x) - 128)")):
        assert f"djax_pair_end<256, 512, {g}>(" in kernel
        assert re.search(
            rf"djax_pair_send<16>\({frag}, .*, \(\(\(int\)blockIdx.z\) \^ 1\), {re.escape(tid)}\);", kernel
        )
        assert re.search(rf"djax_pair_add<16>\({frag}, .*, {re.escape(tid)}\);", kernel)
    assert kernel.count("tl::cluster_arrive();") == 1 and kernel.count("tl::cluster_arrive_relaxed();") == 3
    assert kernel.count("tl::cluster_wait();") == 6  # twice in each of the three roles
    assert "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32" in src
    # the per-head registers djax_pair_end reads as heads r0 and r0 + 8: TileLang's own indexing of the sinks
    (expr,) = re.findall(r"\bm\[i_\d+\] = \(p5_sinks\[(.*)\] \*", kernel)
    for tx in range(128):
        for i in range(2):
            env = {"tx": tx, "i": i, "by": 0}
            e = re.sub(r"\bi_\d+\b", "i", expr).replace("((int)threadIdx.x)", "tx")
            assert (
                eval(e.replace("((int)blockIdx.y)", "by"), {}, env) == 16 * (tx // 32) + 8 * i + tx % 32 // 4
            )


@functools.cache
def _lowered_pair(shape, block_s, stages, pie=False):
    from djax.kernels.sparse_attn_tilelang import Tiling, lower_cuda

    return lower_cuda(*shape, 0.0625, Tiling(block_s, stages, 384, 1, dim_pair=True, p_in_exchange=pie))


def _static_shared(source):
    """The names of a lowered kernel's static shared arrays and their bytes (int, float and uint64_t arrays)."""
    arrays = re.findall(r"__shared__ __align__\(\d+\) (\w+) (\w+)\[(\d+)\];", source)
    return {name for _, name, _ in arrays}, sum(
        int(n) * (8 if ty == "uint64_t" else 4) for ty, _, n in arrays
    )


@needs_tilelang
def test_lowering_dim_pair_p_in_exchange():
    """p_in_exchange: no P buffers and no max/sum table of their own; each warpgroup writes a block's P into
    the first 8 KB of the score buffer it has just read (warpgroup 0's buffers 0-1, 1's 2-3, by the block's
    parity) and its P K wgmma reads it there; the end's table is the third buffer. At the benchmark's shape the
    fourth stage fits: the only static shared arrays are the slot table and the barriers, and the whole is
    within the 227 KB a CTA may have."""
    from djax.kernels.sparse_attn_tilelang import Tiling, shared_bytes

    src, launch = _lowered_pair((64, 64, 512, 128, 2048, 512), 64, 4, True)
    kernel = src[src.index('extern "C" __global__ void __launch') :]
    assert "p0_s" not in kernel and "ml[" not in kernel
    names, static_bytes = _static_shared(kernel)
    assert names == {"ready_mem", "free_mem", "xbar_mem", "rows"}
    assert launch["shared_bytes"] == 2 * (64 * 256 + 4 * 64 * 256) + 4 * 64 * 64 * 4  # q, 4 stages, scores
    # the count check_shapes holds against the 227 KB a CTA may have: the static part rounded up to 1 KB (as
    # ptxas reports it: 3,072 bytes here)
    whole = shared_bytes(512, 128, 512, Tiling(64, 4, 384, 1, dim_pair=True, p_in_exchange=True))
    assert whole == launch["shared_bytes"] + -(-static_bytes // 1024) * 1024 == 227 * 1024
    for g, buffer in ((0, "(i_6 & 1)"), (1, "((i_15 & 1) + 2)")):
        offset = "(i_6 & 1) * 16384" if g == 0 else "((i_15 & 1) * 16384) + 32768"
        assert f"tl::increase_descriptor_offset<int>(desc_a_{2 * g + 1}, ({offset}));" in kernel, g
        assert f"djax_pair_add<32>(s{'_1' if g else ''}, xs0{'_1' if g else ''}, {buffer}," in kernel
        assert f"djax_pair_end<256, 512, {g}>(" in kernel
    assert kernel.count("(&(((bfloat16_t*)xs)[16384])), xs0") == 2  # the table at byte 32768, staging at 0
    plain_src, plain = _lowered_pair((64, 64, 512, 128, 2048, 512), 64, 3)
    plain_static = _static_shared(plain_src)[1]  # the max and sum table among them
    assert shared_bytes(512, 128, 512, Tiling(64, 3, 384, 1, dim_pair=True)) == (
        plain["shared_bytes"] + -(-plain_static // 1024) * 1024
    )


@needs_tilelang
def test_register_layouts_are_the_ones_push_merge_assumes():
    """djax_push_merge reads the accumulator and the per-head max and denominator by register position: an
    accumulator's register i of lane l in warp w is head 16 w + 8 ((i & 3) >> 1) + l / 4, column 8 (i >> 2) +
    2 (l & 3) + (i & 1); a per-head fragment's register i is head 16 w + 8 i + l / 4. TileLang's own indexing
    says where it puts them: the dsmem program's staging call (head and column of every accumulator
    register) and the push program's copy of the max to shared memory."""
    dsmem, _ = _lowered((3, 64, 128, 100, 300, 77), 32, 4, 384, 3, True, True)
    push, _ = _lowered((3, 64, 128, 100, 300, 77), 64, 2, 384, 2, True, False, True)
    (head, col) = re.findall(
        r"djax_stage<64>\(\(&\(\(\(bfloat16_t\*\)k_l\)\[0\]\)\), (.*), (.*), \(acc_l\[i_\d+\]", dsmem
    )[0]
    (mhead, reg) = re.findall(r"m_s\[(.*)\] = m_at\[(i_\d+)\];", push)[0]
    for tx in range(128):
        w, lane = tx // 32, tx % 32
        for i in range(32):
            env = {"tx": tx, "i": i}
            got = [
                eval(re.sub(r"\bi_\d+\b", "i", e).replace("((int)threadIdx.x)", "tx"), {}, env)
                for e in (head, col)
            ]
            assert got == [16 * w + 8 * ((i & 3) >> 1) + lane // 4, 8 * (i >> 2) + 2 * (lane & 3) + (i & 1)]
        for i in range(2):
            expr = mhead.replace(reg, "i").replace("((int)threadIdx.x)", "tx")
            assert eval(expr, {}, {"tx": tx, "i": i}) == 16 * w + 8 * i + lane // 4


@needs_tilelang
@pytest.mark.parametrize(
    "shape,tiling,match",
    [
        ((2, 48, 512, 128, 64, 64), (64, 2, 256, 1), "multiple of 64"),
        ((2, 64, 512, 128, 64, 64), (64, 3, 256, 1), "shared memory"),
        ((2, 64, 1024, 128, 64, 64), (64, 2, 256, 1), "head dim"),
        ((2, 64, 512, 128, 64, 64), (48, 2, 256, 1), "block_s"),
        ((2, 64, 512, 128, 64, 64), (64, 2, 128, 1), "threads"),
        ((2, 64, 512, 128, 64, 64), (128, 2, 384, 1), "block_s"),  # warp-specialised: 32 or 64
        ((2, 64, 512, 128, 64, 64), (64, 3, 384, 1), "shared memory"),
        ((2, 64, 512, 128, 64, 64), (64, 2, 256, 4), "nsplit"),  # only 3 key blocks
        ((2, 64, 512, 128, 64, 64), (64, 1, 256, 1), "stages"),
        ((8, 64, 512, 128, 2048, 512), (64, 2, 512, 10), "16 warps"),  # one block per split
        ((8, 64, 512, 128, 2048, 512), (64, 2, 384, 1, True), "merging"),  # nothing to merge
        ((8, 64, 512, 128, 2048, 512), (64, 2, 384, 9, True), "merging"),  # past the portable cluster
        ((8, 64, 512, 128, 2048, 512), (64, 2, 256, 2, True), "merging"),  # not warp-specialised
        ((8, 64, 512, 128, 2048, 512), (64, 2, 384, 2, False, True), "dsmem"),  # nothing to merge
        ((8, 64, 512, 128, 2048, 512), (32, 2, 384, 2, True, True), "dsmem"),  # ring of 64 keys
        ((8, 64, 96, 128, 2048, 512), (64, 2, 384, 2, True, True), "dsmem"),  # head dim 96
        ((8, 64, 512, 128, 2048, 512), (64, 2, 384, 3, True, False, True), "push"),  # 2 splits only
        ((8, 64, 512, 128, 2048, 512), (64, 2, 384, 2, False, False, True), "push"),  # nothing to merge
        ((8, 64, 512, 128, 2048, 512), (64, 2, 384, 2, True, True, True), "push"),  # dsmem too
        ((8, 64, 96, 128, 2048, 512), (64, 2, 384, 2, True, False, True), "push"),  # head dim 96
        ((8, 64, 512, 128, 2048, 512), (64, 2, 384, 2, True, False, False, True), "push_bf16 needs push"),
        ((8, 64, 512, 128, 2048, 512), (64, 2, 256, 2, False, False, False, False, True), "tma_q"),
        ((8, 64, 192, 128, 2048, 512), (64, 2, 384, 2, False, False, False, False, True), "tma_q"),
        ((8, 64, 512, 128, 2048, 512), (64, 2, 256, 1, False, False, False, False, False, True), "dim_pair"),
        ((8, 64, 512, 128, 2048, 512), (64, 2, 384, 2, False, False, False, False, False, True), "dim_pair"),
        ((8, 64, 512, 128, 2048, 512), (64, 2, 384, 1, False, False, False, False, True, True), "dim_pair"),
        ((8, 64, 80, 128, 2048, 512), (64, 2, 384, 1, False, False, False, False, False, True), "dim_pair"),
        ((8, 64, 512, 128, 2048, 512), (64, 4, 384, 1, False, False, False, False, False, True), "shared"),
        ((8, 64, 512, 128, 2048, 512), (32, 3, 384, 1, False, False, False, False, False, True), "dim_pair"),
        ((8, 64, 512, 128, 2048, 512), (32, 6, 384, 1, *[False] * 5, True, True), "p_in_exchange"),
        (
            (8, 64, 512, 128, 2048, 512),
            (64, 2, 384, 2, True, False, True, *[False] * 3, True),
            "p_in_exchange",
        ),
        ((8, 64, 512, 128, 2048, 512), (64, 5, 384, 1, *[False] * 5, True, True), "shared"),
    ],
)
def test_unsupported_shapes_raise_value_error(shape, tiling, match):
    from djax.kernels.sparse_attn_tilelang import Tiling, cuda_program

    with pytest.raises(ValueError, match=match):
        cuda_program(*shape, 0.1, Tiling(*tiling))


@needs_tilelang
@needs_nvcc
@pytest.mark.slow
def test_cubin_for_sm90_at_benchmark_shape(tmp_path, monkeypatch):
    """The benchmark's shape (b 64, h 64, k 512, W 128, C 2048, T 512) compiles to an sm_90a cubin."""
    monkeypatch.setenv("DJAX_FFI_CACHE", str(tmp_path / "ffi"))
    from djax.kernels.sparse_attn_tilelang import Tiling, cuda_kernel

    k = cuda_kernel.__wrapped__(64, 64, 512, 128, 2048, 512, 512**-0.5, Tiling(64, 2, 256, 2))
    assert k.cubin.binary[:4] == b"\x7fELF" and k.cubin.name.encode() in k.cubin.binary
    assert k.cubin.threads == 256 and k.cubin.extra_null == 0 and k.grid == (64, 1, 2)
    assert k.cubin.shared_bytes > 48 * 1024  # the launcher raises the dynamic shared memory limit
    assert list((tmp_path / "tilelang").glob("*.cubin"))


def _check(args, scale, **tiling):
    out = jax.jit(lambda *a: sparse_decode(*a, scale=scale, impl="tilelang", **tiling))(*args)
    ref = sparse_decode_ref(*[a.astype(jnp.float32) if a.dtype == BF16 else a for a in args], scale)
    assert out.dtype == BF16 and out.shape == args[0].shape
    assert_close(out.astype(jnp.float32), ref, 1e-2)
    assert np.all(np.asarray(out[-1], np.float32) == 0)  # nothing valid: all mass on the sink


@needs_tilelang
@pytest.mark.gpu
@pytest.mark.parametrize(
    "block_s,stages,warps,nsplit,merge",
    [
        (64, 2, 8, 1, False),
        (32, 4, 8, 1, False),
        (64, 2, 16, 1, False),
        (16, 3, 8, 1, False),
        (64, 2, 8, 2, False),
        (32, 3, 8, 3, False),
        (32, 4, 16, 3, False),
        (64, 2, 12, 1, False),
        (32, 4, 12, 1, False),
        (64, 2, 12, 3, False),
        (32, 3, 12, 5, False),
        (64, 2, 12, 2, True),
        (32, 3, 12, 5, True),
        (32, 2, 12, 7, True),
        (64, 2, 12, 2, "dsmem"),
        (32, 4, 12, 3, "dsmem"),
        (32, 4, 12, 7, "dsmem"),
        (64, 2, 12, 2, "push"),
        (32, 3, 12, 2, "push"),
        (64, 2, 12, 2, "push_bf16"),
    ],
)
def test_tilelang_matches_ref_odd_shapes(block_s, stages, warps, nsplit, merge):
    """b 3, W 100, T 77, C 300: neither W nor T is a multiple of block_s; 128 heads = 2 head groups.
    With splits merged in the kernel (each split merges its slice of the value columns over every split's
    partial, through global memory or, "dsmem", the cluster's shared memory): up to 7 splits of one 32-key
    block each; 3 splits take 11, 11 and 10 groups of 4 columns, split 1's crossing the two warpgroups'
    halves; in the last row nothing is live, so every split but split 0 (the sink's) has weight 0."""
    args = sparse_decode_inputs(block_s + nsplit + len(str(merge)), 3, 128, 512, 100, 300, 77)
    tiling = dict(block_s=block_s, num_stages=stages, num_warps=warps, nsplit=nsplit, merge_splits=merge)
    _check(args, 512**-0.5, **tiling)


@needs_tilelang
@pytest.mark.gpu
@pytest.mark.parametrize(
    "b,nsplit,block_s,warps,merge",
    [
        (64, 1, 64, 8, False),
        (64, 2, 64, 8, False),
        (8, 10, 64, 8, False),
        (8, 16, 32, 8, False),
        (64, 1, 64, 12, False),
        (64, 2, 64, 12, False),
        (8, 10, 64, 12, False),
        (64, 2, 64, 12, True),
        (64, 4, 64, 12, True),
        (8, 8, 64, 12, True),
        (64, 2, 64, 12, "dsmem"),
        (64, 4, 64, 12, "dsmem"),
        (8, 8, 64, 12, "dsmem"),
        (64, 2, 64, 12, "push"),
        (8, 2, 64, 12, "push"),
        (64, 2, 64, 12, "push_bf16"),
    ],
)
def test_tilelang_matches_ref_benchmark_shape(b, nsplit, block_s, warps, merge):
    """The benchmark's shape (h 64, k 512, W 128, C 2048, T 512) with the split counts the sweep times."""
    args = sparse_decode_inputs(b + nsplit + len(str(merge)), b, 64, 512, 128, 2048, 512)
    tiling = dict(block_s=block_s, num_stages=2, num_warps=warps, nsplit=nsplit, merge_splits=merge)
    _check(args, 512**-0.5, **tiling)


@needs_tilelang
@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape,nsplit,merge",
    [
        ((3, 128, 512, 100, 300, 77), 1, False),
        ((3, 128, 512, 100, 300, 77), 3, False),
        ((3, 128, 512, 100, 300, 77), 3, True),
        ((3, 128, 512, 100, 300, 77), 2, "push"),
        ((3, 128, 256, 100, 300, 77), 2, "push_bf16"),
        ((64, 64, 512, 128, 2048, 512), 2, "push"),
        ((8, 64, 512, 128, 2048, 512), 8, True),
    ],
)
def test_tma_q_matches_ref(shape, nsplit, merge):
    """q loaded by TMA: two head groups (the box's head coordinate), head dims 512 and 256, every way of
    ending, and the benchmark's shape at b 64 and 8 with their default splits."""
    args = sparse_decode_inputs(shape[0] + nsplit + len(str(merge)), *shape)
    _check(
        args, 512**-0.5, block_s=64, num_stages=2, num_warps=12, nsplit=nsplit, merge_splits=merge, tma_q=True
    )


@needs_tilelang
@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape,block_s,stages,pie",
    [
        ((3, 128, 512, 100, 300, 77), 64, 2, False),  # two head groups, W and T not multiples of the block
        ((3, 128, 512, 100, 300, 77), 64, 3, False),  # three stages: each ring slot serves both warpgroups
        ((3, 128, 256, 100, 300, 77), 32, 4, False),  # head dim 256, 32-key blocks (7 blocks: 4 and 3)
        ((64, 64, 512, 128, 2048, 512), 32, 8, False),
        ((2, 64, 512, 60, 300, 5), 64, 2, False),  # one block each way
        ((64, 64, 512, 128, 2048, 512), 64, 2, False),  # the benchmark's shape
        ((64, 64, 512, 128, 2048, 512), 64, 3, False),
        ((8, 64, 512, 128, 2048, 512), 64, 2, False),
        # P in the score buffer just read: the odd shapes (head dims 512 and 256), one block each way, the
        # model's ring of 129, and the benchmark's shape with the fourth stage it makes room for
        ((3, 128, 512, 100, 300, 77), 64, 3, True),
        ((3, 128, 256, 100, 300, 77), 64, 4, True),
        ((2, 64, 512, 60, 300, 5), 64, 2, True),
        ((4, 64, 512, 129, 1000, 512), 64, 4, True),
        ((64, 64, 512, 128, 2048, 512), 64, 4, True),
        ((8, 64, 512, 128, 2048, 512), 64, 4, True),
    ],
)
def test_dim_pair_matches_ref(shape, block_s, stages, pie):
    """The head dim split over a CTA pair, scores summed through the cluster every block."""
    args = sparse_decode_inputs(shape[0] + block_s + stages + pie, *shape)
    _check(
        args, 512**-0.5, block_s=block_s, num_stages=stages, num_warps=12, dim_pair=True, p_in_exchange=pie
    )


@needs_tilelang
@pytest.mark.gpu
@pytest.mark.parametrize(
    "kernel",
    [
        dict(impl="tilelang", block_s=64, num_stages=4, num_warps=12, dim_pair=True, p_in_exchange=True),
        dict(impl="tilelang", block_s=64, num_stages=3, num_warps=12, dim_pair=True),
        dict(impl="tilelang", block_s=64, num_stages=2, num_warps=12, nsplit=2, merge_splits="push"),
        dict(impl="tilelang", block_s=64, num_stages=2, num_warps=12, nsplit=8, merge_splits=True),
        dict(impl="triton", block_h=32, block_s=64, num_warps=8),
    ],
)
def test_nan_in_masked_ring_slots_never_reaches_the_output(kernel):
    """Ring slots marked not valid may hold anything (a stale or never written cache row): NaN there must not
    reach P @ K. Expected: the reference on the same inputs with those rows zeroed (their weight is 0)."""
    q, win, valid, pool, top, sinks = sparse_decode_inputs(11, 8, 64, 512, 129, 1000, 512)
    poisoned = jnp.where(valid[..., None], win, jnp.nan)
    out = jax.jit(lambda *a: sparse_decode(*a, scale=512**-0.5, **kernel))(
        q, poisoned, valid, pool, top, sinks
    )
    f32 = jnp.float32
    clean = jnp.where(valid[..., None], win, 0).astype(f32)
    ref = sparse_decode_ref(q.astype(f32), clean, valid, pool.astype(f32), top, sinks, 512**-0.5)
    assert np.isfinite(np.asarray(out, np.float32)).all()
    assert_close(out.astype(jnp.float32), ref, 1e-2)


@needs_tilelang
@pytest.mark.gpu
def test_tilelang_large_logits_and_ring_129():
    """Scores far above the sink (the sink's term underflows) and the model's ring of R + 1 = 129 slots."""
    args = list(sparse_decode_inputs(5, 4, 64, 512, 129, 1000, 512))
    args[0] = args[0] * 16  # logits ~ N(0, 16^2): far above the sink, exp without the max would overflow
    _check(args, 512**-0.5, block_s=64, num_stages=2, num_warps=8, nsplit=1)
    _check(args, 512**-0.5, block_s=64, num_stages=2, num_warps=8, nsplit=4)
    _check(args, 512**-0.5, block_s=64, num_stages=2, num_warps=12, nsplit=3)
    _check(args, 512**-0.5, block_s=64, num_stages=2, num_warps=12, nsplit=3, merge_splits=True)
    _check(args, 512**-0.5, block_s=64, num_stages=2, num_warps=12, nsplit=3, merge_splits="dsmem")
    _check(args, 512**-0.5, block_s=64, num_stages=2, num_warps=12, nsplit=2, merge_splits="push")
    _check(args, 512**-0.5, block_s=64, num_stages=2, num_warps=12, dim_pair=True)
    _check(args, 512**-0.5, block_s=64, num_stages=4, num_warps=12, dim_pair=True, p_in_exchange=True)


def test_default_tiling_covers_the_sms_once_and_declines_other_heads():
    from djax.kernels.sparse_attn_tilelang import default_tiling

    b64, b8 = default_tiling(64, 64, 512, 128, 512), default_tiling(8, 64, 512, 128, 512)
    # warp-specialised, 128 CTAs: a pair per row splitting the head dim, P in the score buffers, 4 stages of 64 keys
    assert (b64.block_s, b64.stages, b64.threads, b64.nsplit, b64.dim_pair) == (64, 4, 384, 1, True)
    assert b64.p_in_exchange
    assert default_tiling(64, 64, 96, 128, 512).dim_pair  # any head dim that is a multiple of 32
    small = default_tiling(64, 64, 64, 128, 512)  # the tiny models' heads: P of its own, 3 stages
    assert (small.dim_pair, small.stages, small.p_in_exchange) == (True, 3, False)
    gmem = default_tiling(64, 64, 80, 128, 512)  # head dim 80: two key splits merged through global memory
    assert (gmem.nsplit, gmem.merge, gmem.push, gmem.dim_pair) == (2, True, False, False)
    assert default_tiling(128, 64, 512, 128, 512).nsplit == 1  # 128 rows fill the SMs alone
    # 10 key blocks, more splits than a portable cluster holds: 8 splits merged in the kernel, 64 CTAs
    assert b8.threads == 384 and (b8.nsplit, b8.merge, b8.dsmem) == (8, True, False)
    b32 = default_tiling(32, 64, 512, 128, 512)
    assert (b32.nsplit, b32.merge) == (4, False)  # clusters of 4 did not fit one wave: merged after
    assert (default_tiling(20, 64, 512, 128, 512).nsplit, default_tiling(20, 64, 512, 128, 512).merge) == (
        7,
        False,
    )
    assert default_tiling(1, 64, 512, 129, 1).nsplit == 4  # a sliding layer: 3 ring blocks + 1 pick block
    assert default_tiling(1, 64, 512, 129, 1).merge is False
    assert default_tiling(4, 64, 1024, 128, 512) is None  # head dim over 512: neither program applies
    assert default_tiling(4, 32, 512, 128, 512) is None  # not a multiple of 64 heads: Triton runs instead


@needs_tilelang
@pytest.mark.gpu
@pytest.mark.parametrize("b", [8, 60])
def test_auto_takes_tilelang_default_tiling(monkeypatch, b):
    """impl="auto" on the GPU: the default tiling (12 warps, split over the SMs: 8 splits merged after at
    b 8, a CTA pair per row splitting the head dim at b 60) against the reference."""
    from djax.kernels import sparse_attn_tilelang

    used = []
    run = sparse_attn_tilelang.sparse_decode_tilelang
    monkeypatch.setattr(
        sparse_attn_tilelang, "sparse_decode_tilelang", lambda *a: used.append(a[-1]) or run(*a)
    )
    args = sparse_decode_inputs(9 + b, b, 64, 512, 129, 700, 300)
    out = jax.jit(lambda *a: sparse_decode(*a, scale=512**-0.5, impl="auto"))(*args)
    ref = sparse_decode_ref(*[a.astype(jnp.float32) if a.dtype == BF16 else a for a in args], 512**-0.5)
    tiling = sparse_attn_tilelang.default_tiling(b, 64, 512, 129, 300)
    assert used == [tiling] and tiling.dim_pair == (b == 60), used
    assert_close(out.astype(jnp.float32), ref, 1e-2)


@needs_tilelang
def test_lowering_is_kept_on_disk(tmp_path, monkeypatch):
    """A second process finds the lowered source on disk (lowering takes seconds per shape); the key
    covers the shape, the scale and the tiling."""
    from djax.kernels import sparse_attn_tilelang as tl

    monkeypatch.setenv("DJAX_FFI_CACHE", str(tmp_path / "ffi"))
    calls = []

    def fake_lower(*args):
        calls.append(args)
        return f"source {len(calls)}", {"name": "k", "grid": (3, 1, 2), "threads": 384, "params": ("p0_q",)}

    monkeypatch.setattr(tl, "lower_cuda", fake_lower)
    shape, tiling = (3, 64, 128, 100, 300, 77), tl.Tiling(32, 2, 384, 2)
    first = tl._lowered_on_disk(*shape, 0.0625, tiling)
    assert tl._lowered_on_disk(*shape, 0.0625, tiling) == first and len(calls) == 1
    assert first == ("source 1", {"name": "k", "grid": (3, 1, 2), "threads": 384, "params": ("p0_q",)})
    tl._lowered_on_disk(*shape, 0.125, tiling)
    tl._lowered_on_disk(*shape, 0.0625, tl.Tiling(64, 2, 384, 2))
    assert len(calls) == 3 and len(list((tmp_path / "tilelang").glob("sparse_decode-*.json"))) == 3


@needs_tilelang
def test_ascend_lowering_emits_ascendc():
    """TileLang's "ascend" target lowers the sparse decode to one mixed AscendC kernel (no NPU or bisheng
    here: the source is what can be checked). Odd shapes: W and T not multiples of the 64-key block, 128
    heads (two tasks per row). The Cube side gathers key rows by index (pool rows from `topk`) into L1, once
    as K and once transposed, runs both GEMMs and sends S and P V to the Vector units' buffers; the Vector
    side writes P back to L1 and stores the output."""
    if reason := ascend_backend_missing():
        pytest.skip(reason)
    from djax.kernels.sparse_attn_ascend import ascend_source, check_shapes

    b, h, k, w, c, t = 3, 128, 512, 100, 300, 77
    src = ascend_source(b, h, k, w, c, t, k**-0.5)
    assert "tl_templates/ascend" in src
    entry = src[src.index('extern "C" __global__') :]
    params = entry[entry.index("sparse_decode_kernel(") : entry.index("{")]
    for decl in (
        "bfloat16_t* q",
        "bfloat16_t* window",
        "int32_t* valid",
        "bfloat16_t* pool",
        "int32_t* topk",
    ):
        assert f"__gm__ {decl}" in params, params
    assert "__gm__ float* sinks" in params and "__gm__ bfloat16_t* out" in params
    cube, vector = entry[entry.index("ASC_IS_AIC") :], entry[entry.index("ASC_IS_AIV") :]
    cube = cube[: cube.index("ASC_IS_AIV")] if "ASC_IS_AIV" in cube else cube
    assert f"ascend_gemm_l1<64, {k}, 64," in cube  # S = Q K^T: M 64 heads, K the head dim, N 64 keys
    assert f"ascend_gemm_l1<64, 64, {k}," in cube  # P V: K 64 keys, N the head dim
    assert "topk[" in cube and "asc_copy_gm2l1_nd2nz" in cube and "asc_copy_gm2l1_dn2nz" in cube
    assert f"min(((g * 64) + r), {w - 1})" in cube  # ring rows past W clamp to the last row (masked)
    assert f"{c - 1}), 0)" in cube  # picks clamp into [0, C)
    assert cube.count("asc_copy_l0c2ub") == 2  # S and P V to the two Vector units (the Cube's fixpipe)
    assert "asc_copy_ub2l1" in vector and "asc_copy_ub2gm" in vector  # P to the Cube, the output out
    assert "exp2f" in src
    with pytest.raises(ValueError, match="multiple of 64"):
        check_shapes(32, k, w, c, t, 64)
    with pytest.raises(ValueError, match="multiples of 16"):
        check_shapes(64, 520, w, c, t, 64)
