"""benchmarks/profile_phases.py instruments the lowered CUDA of the decode GEMM and sparse decode defaults: every
named point gets its clock64 store exactly once (the per-block points once inside their loops), and the print
at the kernel's end carries every point plus the two timer readings. No GPU or nvcc needed."""

import re
import sys
from pathlib import Path

import pytest
from checks import needs_tilelang

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import profile_phases as P  # noqa: E402


@needs_tilelang
@pytest.mark.parametrize("build", [P.decode_source, P.attention_source], ids=["decode", "attention"])
def test_every_point_is_stamped_once(build):
    src, launch, names = build()
    kernel = src[src.index("__launch_bounds__") :]
    stamps = [int(i) for i in re.findall(r"djax_t\[(\d+)\] = clock64\(\)", kernel)]
    assert stamps.count(0) == 1  # the CTA's start
    fixed = [i for i in stamps if i]
    looped = re.findall(r"djax_t\[(\d+) \+ (g|g_1)\] = clock64\(\)", kernel)
    per_loop = len(names) - len(fixed)  # points stamped from inside a loop, one per iteration
    assert sorted(fixed) == sorted(set(fixed)) and all(1 <= i <= len(names) for i in fixed)
    covered = set(fixed) | {
        int(base) + j for base, _ in looped for j in range(per_loop // max(1, len(looped)))
    }
    assert covered == set(range(1, len(names) + 1))
    (fmt,) = re.findall(r'printf\("DJAXT \w+ %d %d ([^"]*)\\n"', kernel)
    assert fmt.split() == ["%lld"] * (len(names) + 2)
    assert kernel.rindex("printf") > kernel.rindex("clock64()")  # the print comes after every stamp
    assert launch["threads"] == 384
