"""benchmarks/bench_l2_read.py's read kernel sums what it reads: every chunk, `passes` times, dealt round-robin
over the programs (Triton's interpreter on CPU), and it compiles for sm_90 without a GPU."""

import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_l2_read as l2  # noqa: E402


@pytest.mark.parametrize("programs", [3, 8])  # fewer programs than chunks, and more
def test_read_sum_covers_every_chunk_passes_times(programs):
    chunks, passes = 5, 3
    x = np.random.default_rng(programs).standard_normal(chunks * l2.CHUNK).astype(np.float32)
    out = torch.zeros(programs, dtype=torch.float32)
    l2.read_sum[(programs,)](torch.from_numpy(x), out, chunks, passes, l2.CHUNK)
    sums = x.reshape(chunks, l2.CHUNK).sum(1, dtype=np.float64)
    want = [sum(sums[i % chunks] for i in range(p, chunks * passes, programs)) for p in range(programs)]
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-3)


def test_reader_compiles_for_sm90(monkeypatch):
    from djax.ffi import cubin

    # under the interpreter a child process compiles, importing the benchmark module by name
    monkeypatch.setenv("PYTHONPATH", str(Path(l2.__file__).parent))

    kern = cubin.compile_triton(
        l2.read_sum,
        ["x_ptr", "out_ptr"],
        [np.float32] * 2,
        dict(CHUNKS=4, PASSES=2, CHUNK_WORDS=l2.CHUNK),
        4,
        3,
    )
    assert kern.binary[:4] == b"\x7fELF" and kern.threads == 128
    with pytest.raises(ValueError, match="multiple of"):
        l2.reader(l2.CHUNK + 1, 1, 8)


def test_dram_read_rows_take_the_fastest_read_against_copy(monkeypatch):
    """The small-buffer rows: enough buffers to pass the L2 several times, the best of the programs-per-SM
    counts, and bytes / time as a share of the copy figure (the GPU parts faked: a reader whose time depends
    on its program count, and XLA's pass)."""
    import bench_kernels
    import jax.numpy as jnp

    def fake_reader(words, passes, programs):
        fn = lambda x: jnp.sum(x).reshape(1)  # noqa: E731 - the sum check compares with jnp's
        fn.us = {264: 5.0, 528: 4.0, 1056: 4.5}[programs]
        return fn

    monkeypatch.setattr(l2, "reader", fake_reader)
    monkeypatch.setattr(
        bench_kernels, "bench", lambda fn, sets, trace=False: (1.0, getattr(fn, "us", 8.0) * 1e-6, {})
    )
    (row,) = l2.dram_read_rows([8.0], 132, 2.0)
    assert row["bytes"] == 8 << 20 and row["sets"] * row["bytes"] > 3 * 50e6
    assert row["read_us"] == {2: 5.0, 4: 4.0, 8: 4.5} and row["best_read_us"] == 4.0
    assert row["best_read_tb_per_s"] == round((8 << 20) / 4.0 / 1e6, 3)
    assert row["best_read_of_copy"] == round((8 << 20) / 4.0 / 1e6 / 2.0, 3)
    assert row["xla_pass_of_copy"] == round(2 * (8 << 20) / 8.0 / 1e6 / 2.0, 3)
