"""An edit of a compiled sm_90 kernel's scheduling hints: the FFMA runs of the FP8 GEMMs' promotion made to
let the warp scheduler switch warps.

In the FP8 block-scaled GEMM each consumer warpgroup follows its wgmma chain with a run of 64 or more FFMAs
(the promotion: accumulator += partial x scale). ptxas marks about every second one of them with an operand
reuse flag, and an instruction whose operand is to be reused must not give up the issue slot (the reuse
cache belongs to the warp), so the run keeps the scheduler on one warp for pairs of instructions while the
other warpgroup waits to issue its wgmmas. DeepGEMM (`deep_gemm/jit/interleave_ffma.py`) found that clearing
those flags in the first part of each run, which lets every instruction there yield, is worth a few percent
on its kernels. This module does the same edit on our cubins: it reads the instruction words of the kernel's
text section as `cuobjdump -sass` lists them, and in each run of at least `MIN_RUN` consecutive FFMAs clears,
in the first `fraction` of the run, the four reuse bits and the "do not yield" bit of every FFMA that carries
a reuse flag. Neither bit changes what an instruction computes: the reuse cache is a hint (a register not in it
is read from the register file), and yielding only lets another warp issue in between.

Sm_90 instruction words are 128 bits, little-endian; in the upper 64 bits, bits 58-61 are the four operand
reuse flags and bit 45 is set where the warp is to keep issuing (clear: the scheduler may switch).
"""

import functools
import hashlib
import os
import re
import shutil
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path

MIN_RUN = 16  # shorter FFMA runs are left alone (they are not a promotion)
REUSE_BITS = 0xF << 58
KEEP_ISSUING_BIT = 1 << 45


@dataclass(frozen=True)
class Instruction:
    function: str
    offset: int  # bytes from the start of the function's text section
    text: str  # the disassembly, without the words
    low: int
    high: int


def cuobjdump() -> str:
    """cuobjdump beside nvcc ($CUDA_HOME/bin, /usr/local/cuda/bin), else on PATH, else the one Triton ships."""
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and (Path(root) / "bin" / "cuobjdump").exists():
            return str(Path(root) / "bin" / "cuobjdump")
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import triton

        shipped = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        if shipped.exists():
            return str(shipped)
    except ImportError:
        pass
    raise RuntimeError("cuobjdump not found: set CUDA_HOME or install triton (it ships one)")


_LINE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*/\*\s*(0x[0-9a-f]{16})\s*\*/\s*$")
_HIGH = re.compile(r"^\s*/\*\s*(0x[0-9a-f]{16})\s*\*/\s*$")


def instructions(sass: str) -> list[Instruction]:
    """Every instruction of `cuobjdump -sass` output: each is listed on two lines, the first with its offset,
    text and lower word, the second with its upper word."""
    out, function, pending = [], None, None
    for line in sass.splitlines():
        if "Function :" in line:
            function = line.split("Function :", 1)[1].strip()
            continue
        if pending is not None:
            high = _HIGH.match(line)
            if high is None:
                raise ValueError(f"expected the upper word after {pending}: {line!r}")
            offset, text, low = pending
            out.append(Instruction(function, offset, text, low, int(high.group(1), 16)))
            pending = None
            continue
        first = _LINE.match(line)
        if first is not None:
            if function is None:
                raise ValueError("an instruction before any 'Function :' line")
            pending = (int(first.group(1), 16), first.group(2), int(first.group(3), 16))
    if pending is not None:
        raise ValueError("the listing ends inside an instruction")
    return out


def ffma_runs(listing: list[Instruction], min_run: int = MIN_RUN) -> list[list[Instruction]]:
    """Maximal runs of consecutive FFMAs (within one function) at least `min_run` long."""
    runs, current = [], []
    for ins in listing + [None]:
        is_ffma = ins is not None and ins.text.split()[0] == "FFMA"
        if is_ffma and current and current[-1].function == ins.function:
            current.append(ins)
            continue
        if len(current) >= min_run:
            runs.append(current)
        current = [ins] if is_ffma else []
    return runs


def text_sections(elf: bytes) -> dict[str, int]:
    """File offset of each function's text section (".text.<function>") in a 64-bit little-endian ELF."""
    if elf[:4] != b"\x7fELF" or elf[4] != 2 or elf[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF (a cubin)")
    (shoff,) = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)

    def header(i):  # name, offset
        name, _, _, _, offset = struct.unpack_from("<IIQQQ", elf, shoff + i * shentsize)
        return name, offset

    names_at = header(shstrndx)[1]
    out = {}
    for i in range(shnum):
        name_at, offset = header(i)
        end = elf.index(b"\0", names_at + name_at)
        name = elf[names_at + name_at : end].decode()
        if name.startswith(".text."):
            out[name[len(".text.") :]] = offset
    return out


def edited(ins: Instruction) -> int:
    """The upper word with the reuse flags and the keep-issuing bit cleared."""
    return ins.high & ~REUSE_BITS & ~KEEP_ISSUING_BIT


def yield_in_ffma_runs(cubin: bytes, fraction: float, listing: list[Instruction] | None = None) -> bytes:
    """`cubin` with, in the first `fraction` (0-1] of every FFMA run of at least MIN_RUN, each FFMA that has
    a reuse flag made to yield instead. Checks that every word it edits is where the listing says."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    if listing is None:
        listing = instructions(disassemble(cubin))
    runs = ffma_runs(listing)
    if not runs:
        raise ValueError(f"no run of {MIN_RUN} or more FFMAs in the kernel: nothing to edit")
    sections = text_sections(cubin)
    out = bytearray(cubin)
    for run in runs:
        for ins in run[: round(len(run) * fraction)]:
            if not ins.high & REUSE_BITS:
                continue
            at = sections[ins.function] + ins.offset
            if out[at : at + 16] != ins.low.to_bytes(8, "little") + ins.high.to_bytes(8, "little"):
                raise ValueError(f"{ins.function}+{ins.offset:#x}: the cubin's words differ from the listing")
            out[at + 8 : at + 16] = edited(ins).to_bytes(8, "little")
    return bytes(out)


def disassemble(cubin: bytes) -> str:
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        run = subprocess.run([cuobjdump(), "-sass", f.name], capture_output=True, text=True)
    if run.returncode:
        raise RuntimeError(f"cuobjdump failed: {run.stderr[-2000:]}")
    return run.stdout


@functools.cache
def _module_text() -> str:
    return Path(__file__).read_text()


def cached_yield_in_ffma_runs(cubin: bytes, fraction: float) -> bytes:
    """`yield_in_ffma_runs`, kept on disk beside TileLang's cubins (keyed by the cubin, the fraction and
    this module), so that a machine without cuobjdump can launch an edited kernel built elsewhere."""
    from djax.ffi.build import cache_dir

    key = hashlib.sha256(cubin + f"{fraction!r}".encode() + _module_text().encode()).hexdigest()[:24]
    out = cache_dir().parent / "tilelang" / f"kernel-{key}-yield.cubin"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        part = out.with_suffix(f".{os.getpid()}.part")
        part.write_bytes(yield_in_ffma_runs(cubin, fraction))
        os.replace(part, out)
    return out.read_bytes()
