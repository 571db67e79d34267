"""The cubin edit of `sass_yield` on a kernel Triton compiles here (no GPU needed): only the scheduling hints of
the chosen FFMAs change, every other byte stays, and the edit refuses what it cannot do."""

import os
from pathlib import Path

import numpy as np
import pytest

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from djax.kernels import sass_yield as S  # noqa: E402


@triton.jit
def _scale_add(x_ptr, s_ptr, y_ptr, BLOCK: tl.constexpr):
    # 4,096 values over 128 threads: a run of 32 FMAs a thread, all with the same scale operand
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs)
    s = tl.load(s_ptr + tl.program_id(0))
    tl.store(y_ptr + offs, tl.fma(x, s, x))


@triton.jit
def _copy(x_ptr, y_ptr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs))


def _cubin(kernel, names):
    from djax.ffi import cubin

    # under TRITON_INTERPRET=1 a child process compiles, importing this module by name
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(
            "PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])
        )
        return cubin.compile_triton(kernel, names, [np.float32] * len(names), {"BLOCK": 4096}, 4).binary


@pytest.fixture(scope="module")
def fma_cubin():
    return _cubin(_scale_add, ["x_ptr", "s_ptr", "y_ptr"])


def _words(cubin, ins):
    at = S.text_sections(cubin)[ins.function] + ins.offset
    return cubin[at : at + 16]


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_edit_changes_only_the_chosen_ffmas_hints(fma_cubin, fraction):
    before = S.instructions(S.disassemble(fma_cubin))
    runs = S.ffma_runs(before)
    assert runs and all(len(r) >= S.MIN_RUN for r in runs)
    chosen = {ins.offset for r in runs for ins in r[: round(len(r) * fraction)] if ins.high & S.REUSE_BITS}
    assert chosen  # ptxas marked some of them for reuse: there is something to edit
    for ins in before:  # the listing's words are the cubin's
        assert _words(fma_cubin, ins) == ins.low.to_bytes(8, "little") + ins.high.to_bytes(8, "little")

    out = S.yield_in_ffma_runs(fma_cubin, fraction)
    after = S.instructions(S.disassemble(out))
    assert len(after) == len(before)
    changed = 0
    for old, new in zip(before, after, strict=True):
        assert (new.offset, new.low) == (old.offset, old.low)
        assert new.text.replace(".reuse", "") == old.text.replace(".reuse", "")  # the same instruction
        if old.offset in chosen:
            assert new.high == old.high & ~S.REUSE_BITS & ~S.KEEP_ISSUING_BIT != old.high
            assert ".reuse" not in new.text
            changed += 1
        else:
            assert new.high == old.high
    assert changed == len(chosen)
    # nothing else in the file moved: 8 bytes (one upper word) per edited instruction at most
    differing = sum(a != b for a, b in zip(fma_cubin, out, strict=True))
    assert 0 < differing <= 8 * changed


def test_edit_refuses_what_it_cannot_do(fma_cubin):
    for fraction in (0.0, 1.5):
        with pytest.raises(ValueError, match="fraction"):
            S.yield_in_ffma_runs(fma_cubin, fraction)
    copy = _cubin(_copy, ["x_ptr", "y_ptr"])
    with pytest.raises(ValueError, match="no run of 16 or more FFMAs"):
        S.yield_in_ffma_runs(copy, 0.5)
    # a listing that does not describe this cubin is caught before anything is written
    listing = S.instructions(S.disassemble(fma_cubin))
    run = S.ffma_runs(listing)[0]
    first = next(i for i in run if i.high & S.REUSE_BITS)
    wrong = [
        i if i is not first else S.Instruction(i.function, i.offset, i.text, i.low ^ 1, i.high)
        for i in listing
    ]
    with pytest.raises(ValueError, match="differ from the listing"):
        S.yield_in_ffma_runs(fma_cubin, 1.0, wrong)
    with pytest.raises(ValueError, match="not a 64-bit little-endian ELF"):
        S.text_sections(b"not an elf" * 10)


def test_listing_parse():
    sass = (
        "\tcode for sm_90a\n\t\tFunction : k\n"
        "        /*0000*/                   FFMA R1, R2, R3.reuse, R1 ;   /* 0x0000000302017223 */\n"
        "                                                                 /* 0x080fe20000000001 */\n"
        "        /*0010*/                   EXIT ;                        /* 0x000000000000794d */\n"
        "                                                                 /* 0x000fea0003800000 */\n"
    )
    a, b = S.instructions(sass)
    assert (a.function, a.offset, a.text) == ("k", 0, "FFMA R1, R2, R3.reuse, R1 ;")
    assert (a.low, a.high) == (0x0000000302017223, 0x080FE20000000001) and a.high & S.REUSE_BITS
    assert (b.offset, b.text) == (0x10, "EXIT ;")
    with pytest.raises(ValueError, match="ends inside an instruction"):
        S.instructions(sass.rsplit("\n", 2)[0])
    with pytest.raises(ValueError, match="before any 'Function :' line"):
        S.instructions(sass.split("Function : k\n", 1)[1])


def test_cached_edit_is_kept_on_disk(fma_cubin, tmp_path, monkeypatch):
    monkeypatch.setenv("DJAX_FFI_CACHE", str(tmp_path / "ffi"))
    out = S.cached_yield_in_ffma_runs(fma_cubin, 0.5)
    (kept,) = (tmp_path / "tilelang").glob("kernel-*-yield.cubin")
    assert kept.read_bytes() == out == S.yield_in_ffma_runs(fma_cubin, 0.5)
    monkeypatch.setattr(S, "cuobjdump", lambda: pytest.fail("a kept edit needs no cuobjdump"))
    assert S.cached_yield_in_ffma_runs(fma_cubin, 0.5) == out
