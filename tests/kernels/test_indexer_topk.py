"""Indexer scoring and top-k: references against brute-force numpy; Triton kernels (interpreted) against them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checks import assert_close, needs_triton_interp

from djax.kernels import topk as topk_module
from djax.kernels.indexer import indexer_topk
from djax.kernels.indexer_ref import index_scores_ref
from djax.kernels.topk import chunk_size, chunked_topk, topk
from djax.kernels.topk_ref import topk_ref


def _brute_scores(q, keys, w, lengths):
    b, s = keys.shape[:2]
    out = np.full((b, s), -np.inf)
    for i in range(b):
        for j in range(min(lengths[i], s)):
            dots = q[i].astype(np.float64) @ keys[i, j].astype(np.float64)
            out[i, j] = np.sum(w[i] * np.maximum(dots, 0))
    return out


def _brute_topk(x, k, lengths):
    b, s = x.shape
    vals = np.full((b, k), -np.inf, np.float32)
    idx = np.full((b, k), -1, np.int32)
    for i in range(b):
        n = s if lengths is None else min(lengths[i], s)
        order = sorted(range(n), key=lambda j: (-x[i, j], j))[:k]  # ties: lower index first
        for r, j in enumerate(order):
            if x[i, j] != -np.inf:
                vals[i, r], idx[i, r] = x[i, j], j
    return vals, idx


def _scores_inputs(rng, b, h, c, s):
    q = rng.standard_normal((b, h, c)).astype(np.float32)
    keys = rng.standard_normal((b, s, c)).astype(np.float32)
    w = rng.standard_normal((b, h)).astype(np.float32)
    lengths = rng.integers(0, s + 1, b).astype(np.int32)
    lengths[0], lengths[-1] = s, 0  # one full row, one with nothing valid
    return q, keys, w, lengths


def _topk_inputs(rng, b, s):
    x = rng.standard_normal((b, s)).astype(np.float32)
    x[0, 3] = -np.inf
    x[-1, : s // 3] = x[-1, s // 2]  # a run of ties
    lengths = rng.integers(0, s + 1, b).astype(np.int32)
    lengths[0], lengths[1] = s, 0
    return x, lengths


@pytest.mark.parametrize("b,h,c,s", [(3, 4, 8, 37), (2, 16, 32, 130)])
def test_scores_ref_matches_brute_force(b, h, c, s):
    args = _scores_inputs(np.random.default_rng(s), b, h, c, s)
    assert_close(index_scores_ref(*map(jnp.asarray, args)), _brute_scores(*args), 1e-6)


@pytest.mark.parametrize("b,s,k", [(4, 50, 7), (3, 300, 64), (3, 20, 32)])  # k > s in the last
def test_topk_ref_matches_brute_force(b, s, k):
    x, lengths = _topk_inputs(np.random.default_rng(s + k), b, s)
    for lens in (lengths, None):
        vals, idx = topk_ref(jnp.asarray(x), k, None if lens is None else jnp.asarray(lens))
        bv, bi = _brute_topk(x, k, lens)
        np.testing.assert_array_equal(np.asarray(vals), bv)
        np.testing.assert_array_equal(np.asarray(idx), bi)


def test_indexer_topk_auto_is_ref_on_cpu():
    q, keys, w, lengths = map(jnp.asarray, _scores_inputs(np.random.default_rng(5), 3, 4, 8, 40))
    vals, idx = indexer_topk(q, keys, w, lengths, 16)
    rv, ri = topk_ref(index_scores_ref(q, keys, w, lengths), 16)
    np.testing.assert_array_equal(idx, ri)
    np.testing.assert_array_equal(vals, rv)
    assert np.all(np.asarray(idx)[-1] == -1)


@needs_triton_interp
@pytest.mark.parametrize("b,h,c,s,bs", [(3, 16, 32, 200, 64), (2, 32, 16, 50, 16)])
def test_scores_triton_interpreted(b, h, c, s, bs):
    import torch

    from djax.kernels.indexer_triton import launch_torch

    args = _scores_inputs(np.random.default_rng(b * s), b, h, c, s)
    out = launch_torch(*map(torch.from_numpy, args), block_s=bs)
    assert_close(out.numpy(), index_scores_ref(*map(jnp.asarray, args)), 1e-5)


@needs_triton_interp
@pytest.mark.parametrize("b,s,k,block", [(3, 1000, 100, 256), (3, 40, 64, 32), (2, 515, 512, 128)])
def test_topk_triton_interpreted(b, s, k, block):
    import torch

    from djax.kernels.topk_triton import launch_torch

    x, lengths = _topk_inputs(np.random.default_rng(s), b, s)
    for lens in (lengths, None):
        vals, idx = launch_torch(
            torch.from_numpy(x), k, None if lens is None else torch.from_numpy(lens), block
        )
        rv, ri = topk_ref(jnp.asarray(x), k, None if lens is None else jnp.asarray(lens))
        np.testing.assert_array_equal(vals.numpy(), np.asarray(rv))
        np.testing.assert_array_equal(idx.numpy(), np.asarray(ri))


def _interpreted_launch(block):
    """`chunked_topk`'s launcher on the interpreted kernel: jnp arrays in and out."""
    import torch

    from djax.kernels.topk_triton import launch_torch

    def launch(x, k, lengths, chunk):
        lens = None if lengths is None else torch.from_numpy(np.array(lengths))
        vals, idx = launch_torch(torch.from_numpy(np.array(x)), k, lens, block, chunk)
        return jnp.asarray(vals.numpy()), jnp.asarray(idx.numpy())

    return launch


def _chunked_inputs(rng, b, s):
    """Values on a grid of 1/4 (ties at the k-th value across chunks), the row maximum repeated in several
    chunks, a run of -inf, and (b > 1) a last row with fewer valid entries than k."""
    # + 0.0 turns -0.0 into 0.0: Python's order (the brute force) ties them, lax.top_k's puts -0.0 below.
    x = np.round(rng.standard_normal((b, s)) * 4).astype(np.float32) / 4 + np.float32(0.0)
    x[0, rng.integers(0, s, 8)] = x[0].max()
    x[0, s // 2 : s // 2 + 40] = -np.inf
    lengths = rng.integers(s // 2, s + 1, b).astype(np.int32)
    lengths[-1] = 5 if b > 1 else s - 7
    return x, lengths


@needs_triton_interp
@pytest.mark.parametrize(
    "b,s,k,chunk,merge,use_len",
    [
        (1, 1000, 20, 128, "triton", True),  # one row; 1000 is not a multiple of the chunk
        (2, 250, 60, 64, "triton", True),  # k close to the chunk
        (2, 150, 64, 32, "ref", False),  # chunks shorter than k keep all their entries
        (2, 450, 16, 100, "ref", True),
    ],
)
def test_topk_chunked_interpreted(b, s, k, chunk, merge, use_len):
    x, lengths = _chunked_inputs(np.random.default_rng(s + k), b, s)
    lens = lengths if use_len else None
    jl = None if lens is None else jnp.asarray(lens)
    vals, idx = chunked_topk(_interpreted_launch(64), jnp.asarray(x), k, jl, chunk, merge)
    bv, bi = _brute_topk(x, k, lens)
    np.testing.assert_array_equal(np.asarray(vals), bv)
    np.testing.assert_array_equal(np.asarray(idx), bi)
    rv, ri = topk_ref(jnp.asarray(x), k, jl)
    np.testing.assert_array_equal(np.asarray(vals), np.asarray(rv))
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(ri))


@needs_triton_interp
def test_topk_chunked_merge_chunks_again(monkeypatch):
    # Small chunks and program target, so that the rule chunks the candidates too: 1000 -> 8 x 8 -> 2 x 8 -> 8.
    monkeypatch.setattr(topk_module, "MIN_CHUNK", 32)
    monkeypatch.setattr(topk_module, "CHUNK_ALIGN", 32)
    monkeypatch.setattr(topk_module, "TARGET_PROGRAMS", 8)
    assert chunk_size(1, 1000, 8) == 128 and chunk_size(1, 64, 8) == 32 and chunk_size(1, 16, 8) == 16
    x, lengths = _chunked_inputs(np.random.default_rng(3), 1, 1000)
    vals, idx = chunked_topk(_interpreted_launch(128), jnp.asarray(x), 8, jnp.asarray(lengths))
    bv, bi = _brute_topk(x, 8, lengths)
    np.testing.assert_array_equal(np.asarray(vals), bv)
    np.testing.assert_array_equal(np.asarray(idx), bi)


def _to_torch(a):
    import torch

    return torch.from_numpy(np.ascontiguousarray(a))


@needs_triton_interp
@pytest.mark.parametrize(
    "b,s,k,chunk",
    [
        (1, 1000, 20, 128),  # 1000 is not a multiple of the chunk
        (2, 450, 60, 64),
        (1, 300, 300, 64),  # k = s: every entry, -inf ones last
        (2, 250, 1, 32),
        (3, 200, 64, 200),  # one chunk a row
    ],
)
def test_topk_grid_interpreted(b, s, k, chunk):
    from djax.kernels.topk_triton import launch_grid_torch

    x, lengths = _chunked_inputs(np.random.default_rng(s + k), b, s)
    for lens in (lengths, None):
        vals, idx = launch_grid_torch(
            _to_torch(x), k, None if lens is None else _to_torch(lens), chunk, block=32
        )
        bv, bi = _brute_topk(x, k, lens)
        np.testing.assert_array_equal(vals.numpy(), bv)
        np.testing.assert_array_equal(idx.numpy(), bi)
    # Continuous values, and a cluster that differs only in the low mantissa bits (the last pass's digit).
    rng = np.random.default_rng(k)
    y = rng.standard_normal((b, s)).astype(np.float32)
    cluster = rng.choice(s, min(s, 2 * k), replace=False)
    bits = np.float32(3.0).view(np.int32) + rng.integers(0, 600, (b, cluster.size)).astype(np.int32)
    y[:, cluster] = bits.view(np.float32)
    vals, idx = launch_grid_torch(_to_torch(y), k, None, chunk, block=32)
    bv, bi = _brute_topk(y, k, None)
    np.testing.assert_array_equal(vals.numpy(), bv)
    np.testing.assert_array_equal(idx.numpy(), bi)
    # Signed zeros: ordered as lax.top_k orders them (-0.0 below 0.0).
    x[:, ::3] = np.where(x[:, ::3] == 0, np.float32(-0.0), x[:, ::3])
    assert np.signbit(x[x == 0]).any() and not np.signbit(x[x == 0]).all()
    vals, idx = launch_grid_torch(_to_torch(x), k, None, chunk, block=32)
    rv, ri = topk_ref(jnp.asarray(x), k)
    np.testing.assert_array_equal(np.signbit(vals.numpy()), np.signbit(np.asarray(rv)))
    np.testing.assert_array_equal(idx.numpy(), np.asarray(ri))


@pytest.mark.parametrize("b,s,k,chunk", [(64, 129280, 50, 16384), (64, 2048, 512, 2048)])
def test_topk_kernel_compiles_for_sm90(b, s, k, chunk):
    """The chunked form's kernel at the vocab shape (8 chunks a row) and at one program per row compiles
    ahead to an sm_90 cubin for the FFI launcher, as `topk._launch` builds it."""
    pytest.importorskip("triton")
    from djax.kernels.topk import compile_step
    from djax.kernels.topk_triton import constexprs, num_programs, topk_kernel

    cx = constexprs(s, k, True, 1024, chunk)
    n = num_programs(s, chunk)
    args = [jax.ShapeDtypeStruct((b, s), jnp.float32), jax.ShapeDtypeStruct((b,), jnp.int32)]
    outs = [((b, n * k), "float32"), ((b, n * k), "int32"), ((b * n, cx["KP"]), "uint64")]
    kern, types, aliases = compile_step(topk_kernel, args, outs, cx, 8)
    assert kern.name == "topk_kernel" and kern.binary[:4] == b"\x7fELF" and not aliases
    assert [t.shape for t in types] == [(b, n * k), (b, n * k), (b * n, cx["KP"])]


def test_topk_grid_steps_compile_for_sm90():
    """Every step of the grid form at a full-size shape (one row of 262,144, k 512, lengths) compiles ahead
    to an sm_90 cubin that the FFI launcher can run (no Triton scratch memory)."""
    pytest.importorskip("triton")
    from djax.kernels.topk import compile_step, grid_chunk
    from djax.kernels.topk_triton import WORK_WIDTH, grid_select

    built = []

    def run(kernel, grid, args, outs, cx):
        kern, types, aliases = compile_step(kernel, args, outs, cx, 4)
        built.append((kern.name, grid, kern.binary[:4], aliases))
        return types

    x = jax.ShapeDtypeStruct((1, 262144), jnp.float32)
    lens = jax.ShapeDtypeStruct((1,), jnp.int32)
    work = jax.ShapeDtypeStruct((1, int(WORK_WIDTH)), jnp.int32)
    vals, idx = grid_select(run, x, lens, work, 512, grid_chunk(1, 262144), True)
    assert (vals.shape, vals.dtype, idx.shape, idx.dtype) == ((1, 512), jnp.float32, (1, 512), jnp.int32)
    names = [n for n, _, _, _ in built]
    assert names == ["grid_hist_kernel"] * 4 + ["grid_collect_kernel", "sort_picks_kernel"]
    assert all(elf == b"\x7fELF" for _, _, elf, _ in built)
    assert [g for _, g, _, _ in built[-2:]] == [(256,), (1,)]
    # The work buffer (operand 2) is updated in place by every histogram pass and by the collecting step.
    assert [a for _, _, _, a in built] == [{2: 0}] * 5 + [{}]


@pytest.mark.parametrize(
    "rows,length,want",
    [(1, 262144, 1024), (8, 262144, 2048), (16, 262144, 4096), (1, 3000, 1024), (2048, 4096, 4096)],
)
def test_grid_chunk_rule(rows, length, want):
    from djax.kernels.topk import GRID_MAX_CHUNKS, grid_chunk
    from djax.kernels.topk_triton import MAX_GRID_CHUNKS

    assert GRID_MAX_CHUNKS == MAX_GRID_CHUNKS

    chunk = grid_chunk(rows, length)
    assert chunk == want and chunk % 1024 == 0
    assert -(-length // chunk) <= MAX_GRID_CHUNKS


@pytest.mark.parametrize("impl, method", [("ref", "auto"), ("triton", "grid"), ("triton", "chunked")])
def test_topk_of_zero_entries_launches_nothing(impl, method):
    vals, idx = topk(jnp.ones((2, 3000)), 0, impl=impl, method=method)
    assert (vals.shape, vals.dtype, idx.shape, idx.dtype) == ((2, 0), jnp.float32, (2, 0), jnp.int32)


def test_topk_grid_refuses_too_many_chunks_and_unknown_method():
    from djax.kernels.topk_triton import grid_select

    x = jax.ShapeDtypeStruct((1, 5000), jnp.float32)
    with pytest.raises(ValueError, match="5000 chunks; at most 1024"):
        grid_select(None, x, None, None, 4, 1, False)
    with pytest.raises(ValueError, match="k <= the row length, got k 5001"):
        grid_select(None, x, None, None, 5001, 1024, False)
    with pytest.raises(ValueError, match="method must be"):
        topk(jnp.ones((1, 8)), 2, impl="ref", method="radix")


def _ref_launch(x, k, lengths, chunk):
    """The kernel's chunked contract in jnp: each chunk's top k, columns counted in the row, -1 at -inf."""
    b, s = x.shape
    n = -(-s // chunk)
    if lengths is not None:
        x = jnp.where(jnp.arange(s)[None, :] < lengths[:, None], x, -jnp.inf)
    x = jnp.pad(x, ((0, 0), (0, n * chunk - s)), constant_values=-jnp.inf)
    vals, idx = topk_ref(x.reshape(b * n, chunk), k)
    idx = jnp.where(idx < 0, -1, idx + (jnp.arange(b * n) % n * chunk)[:, None])
    return vals.reshape(b, n * k), idx.reshape(b, n * k)


@pytest.mark.parametrize("b,s,k", [(1, 70000, 512), (3, 20000, 64)])
def test_chunked_topk_rule_under_jit(b, s, k):
    # Full-size rows through the default rule (chunks of chunks for the first) with the kernel's contract.
    assert chunk_size(b, s, k) < s
    x, lengths = _chunked_inputs(np.random.default_rng(b), b, s)
    fn = jax.jit(lambda a, ln: chunked_topk(_ref_launch, a, k, ln))
    for lens in (jnp.asarray(lengths), None):
        vals, idx = fn(jnp.asarray(x), lens)
        rv, ri = topk_ref(jnp.asarray(x), k, lens)
        np.testing.assert_array_equal(np.asarray(vals), np.asarray(rv))
        np.testing.assert_array_equal(np.asarray(idx), np.asarray(ri))


@pytest.mark.parametrize(
    "rows,length,k,want",
    [
        (1, 262144, 512, 2048),  # the 4k floor: 128 programs
        (4, 262144, 512, 2048),
        (8, 262144, 512, 4096),
        (1, 129280, 50, 1024),
        (64, 129280, 50, 16384),
        (64, 2048, 512, 2048),  # one stage
        (256, 262144, 512, 131072),
        (512, 262144, 512, 262144),  # enough rows for one program each
    ],
)
def test_chunk_size_fills_the_gpu_and_shrinks_the_row(rows, length, k, want):
    chunk = chunk_size(rows, length, k)
    assert chunk == want
    if chunk < length:
        n = -(-length // chunk)
        assert rows * n >= 64 and n * k <= length // 3


def test_auto_rule_keeps_lax_top_k_only_where_no_kernel_was_measured_faster():
    from djax.kernels.topk import auto_takes_kernel, takes_grid

    assert auto_takes_kernel(1, 262144, 512) and takes_grid(1, 262144, 512)  # 24.2 against 55.3 us
    assert auto_takes_kernel(1, 129280, 50) and takes_grid(1, 129280, 50)  # 19.4 against 51.3 us
    assert not auto_takes_kernel(1, 1500, 512)  # too short for two grid chunks, k over 64: not measured
    assert auto_takes_kernel(1, 1500, 50) and not takes_grid(1, 1500, 50)
    assert takes_grid(8, 262144, 512) and not takes_grid(9, 262144, 512)
    assert not auto_takes_kernel(64, 129280, 4096)  # the kernels' one-program sort: lax.top_k above 2,048
    assert auto_takes_kernel(8, 262144, 512) and auto_takes_kernel(64, 2048, 512)


def test_topk_public_op_rejects_unknown_impl():
    with pytest.raises(ValueError):
        topk(jnp.zeros((1, 4)), 2, impl="radix")


@pytest.mark.parametrize(
    "scores, k, lengths, match",
    [
        (np.zeros(10), 3, None, "scores has shape \\[10\\]"),
        (np.zeros((2, 10)), 3, np.zeros(3, np.int32), "lengths has shape \\[3\\], expected \\[2\\]"),
        (np.zeros((2, 10)), -1, None, "k must be a non-negative int"),
        (np.zeros((2, 10)), 2.5, None, "k must be a non-negative int"),
    ],
)
@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_topk_names_a_bad_argument(scores, k, lengths, match, impl):
    """Bad input fails before any kernel runs, with the argument named, for every impl."""
    lengths = None if lengths is None else jnp.asarray(lengths)
    with pytest.raises(ValueError, match=match):
        topk(jnp.asarray(scores, jnp.float32), k, lengths, impl=impl)


@pytest.mark.parametrize(
    "shapes, match",
    [
        (((2, 4, 8), (2, 16, 4), (2, 4), (2,)), "keys has shape \\[2, 16, 4\\], expected \\[2, \\*, 8\\]"),
        (((2, 4, 8), (2, 16, 8), (2, 5), (2,)), "weights has shape \\[2, 5\\], expected \\[2, 4\\]"),
        (((2, 4, 8), (2, 16, 8), (2, 4), (3,)), "lengths has shape \\[3\\], expected \\[2\\]"),
    ],
)
def test_index_scores_names_a_bad_argument(shapes, match):
    q, keys, weights, lengths = (
        jnp.ones(s, jnp.int32 if i == 3 else jnp.float32) for i, s in enumerate(shapes)
    )
    with pytest.raises(ValueError, match=match):
        indexer_topk(q, keys, weights, lengths, 2, impl="ref")
