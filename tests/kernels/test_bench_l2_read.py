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
