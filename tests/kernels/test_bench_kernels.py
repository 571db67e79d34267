"""benchmarks/bench_kernels.py's roofline ceilings follow the card: the fixed H200 figures on an H200 (its runs
compare with each other), the run's own measured copy bandwidth and bf16 rate elsewhere (an H100 cannot reach the
H200's 4.3 TB/s, so against it every row would read low)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_kernels as K  # noqa: E402


def test_roof_ceilings_are_the_h200_figures_only_on_an_h200():
    assert K.roof_ceilings("NVIDIA H200", 4.1e12, 610e12) == (K.COPY_BW, K.BF16_RATE)
    assert K.roof_ceilings("NVIDIA H100 80GB HBM3", 2.96e12, 655e12) == (2.96e12, 655e12)
    assert K.roof_ceilings("cpu", 1e10, 1e12) == (1e10, 1e12)
