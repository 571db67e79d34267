"""benchmarks/profile_phases.py instruments the lowered CUDA of the decode GEMM and sparse decode kernels: every
named point gets its clock64 store exactly once (the per-block points once inside their loops, covering every
trip), and the prints at the kernel's end carry every point plus the end time, in parts that `summarize` joins
back. No GPU or nvcc needed."""

import re
import sys
from pathlib import Path

import pytest
from checks import needs_tilelang

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import profile_phases as P  # noqa: E402


@needs_tilelang
@pytest.mark.parametrize("name", P.KERNELS)
def test_every_point_is_stamped_once(name):
    src, launch, names = P.BUILDERS[name]()
    kernel = src[src.index("__launch_bounds__") :]
    stamps = [int(i) for i in re.findall(r"djax_t\[(\d+)\] = clock64\(\)", kernel)]
    assert stamps.count(0) == 1  # the CTA's start
    fixed = [i for i in stamps if i]
    assert sorted(fixed) == sorted(set(fixed)) and all(1 <= i <= len(names) for i in fixed)
    covered = list(fixed)
    for base, var in re.findall(r"djax_t\[(\d+) \+ (\w+)\] = clock64\(\)", kernel):
        (trips,) = re.findall(rf"for \(int {var} = 0; {var} < (\d+); \+\+{var}\)", kernel)
        covered += [int(base) + j for j in range(int(trips))]
    assert sorted(covered) == list(range(1, len(names) + 1))  # each point once, none left out
    lines = re.findall(r'printf\("DJAXT (\w+) %d %d %lld (\d+) ([^"]*)\\n"', kernel)
    assert {n for n, _, _ in lines} == {name}
    assert [int(part) for _, part, _ in lines] == list(range(len(lines)))
    formats = [f.split() for _, _, f in lines]
    assert all(set(f) == {"%lld"} and len(f) <= P.PER_LINE for f in formats)
    assert sum(map(len, formats)) == len(names) + 1  # every point, then the end time
    assert kernel.rindex("printf") > kernel.rindex("clock64()")  # the prints come after every stamp
    assert launch["threads"] == 384


def test_summarize_joins_each_ctas_parts():
    """Two launches of two CTAs, their parts printed out of order: each CTA's row is its parts in order."""
    names = [f"p{i}" for i in range(5)]  # 5 points and the end time: parts of 4 and 2 with PER_LINE 4
    lines = []
    for launch, t0 in enumerate((1000, 9000)):
        for bz in (0, 1):
            cycles = [(10 + 10 * j) * (1 + launch) + bz for j in range(5)]
            end = t0 + 50 + bz
            start = t0 + bz
            lines.append(f"DJAXT pair 0 {bz} {start} 1 {cycles[4]} {end}")
            lines.append(f"DJAXT pair 0 {bz} {start} 0 {' '.join(map(str, cycles[:4]))}")
    lines.append("unrelated output")
    rows = P.joined_rows(lines, "pair")
    assert rows[0] == [0, 0, 10, 20, 30, 40, 50, 1000, 1050]
    assert rows[3] == [0, 1, 21, 41, 61, 81, 101, 9001, 9051]
    got = P.summarize(lines, "pair", names)
    assert got["ctas_sampled"] == 3  # the first quarter of the rows (one) is left out
    assert got["cta_life_ns_median"] == 50.0
    assert got["cycles_since_cta_start_median"]["p0"] == 20  # median of 11, 20, 21
