"""FP4 (e2m1) weight codes to bf16 in registers, four packed bytes (eight codes) at a time: the PTX the
Triton grouped GEMMs inline on CUDA (`grouped_gemm_triton._fp4_tile`, FP4_ASM).

Why: decoding code by code costs about 16 integer and float operations a value, while reading FP4 at the
H200's copy bandwidth leaves an SM about 2 integer operations a value (33 values a clock against 64 integer
lanes). This sequence works on 32-bit words, two values a half-word: about 2.75 integer operations and one
bf16x2 multiply a value.

The trick: an e2m1 code s|e1 e0|m placed in a bf16's bits as sign (bit 15), exponent's two low bits and the
mantissa's top bit (bits 8..6) reads as the code's value times 2^-126, the same factor for the subnormal code
(0.5, exponent 0) as for the normal ones; one exact multiply by 2^126, then one by the group's UE8M0 scale.

The sequence is written once, as `PROGRAM`: `ptx()` renders it for `tl.inline_asm_elementwise` and `emulate`
runs the same instructions in numpy, which the CPU tests check bit for bit against the format computed in numpy
(the interpreter cannot run inline PTX; on a GPU the kernels' tests check the real thing).
"""

from __future__ import annotations

import numpy as np

# Operands of the inline asm (pack 4: four packed bytes a call): outputs $0, $1 = the low-nibble codes of
# bytes 0-1 and 2-3 (bf16x2 each), $2, $3 = the high-nibble codes; inputs $4 = the four bytes, $5, $6 = the
# scales of bytes 0-1 and 2-3 as bf16x2.
CONSTRAINTS = "=r,=r,=r,=r,r,r,r"
MAG = 0x01C001C0  # bits 8..6 of each half: exponent's low two bits and the mantissa's top bit
SIGN = 0x80008000
TWO_POW_126 = 0x7E807E80  # bf16x2 2^126: bias 127 (bf16) against the code's exponent bias of 1

# (op, destination, sources...): prmt selects bytes of {a, b} (a's 0-3, b's 4-7) by the selector's nibbles,
# here two bytes into the low bytes of the two half-words (zero above them); then each nibble's code, low
# (bit 0) then high (bit 4), becomes a bf16x2 word.
PROGRAM = []
for selector, outputs, scale in ((0x4140, ("$0", "$2"), "$5"), (0x4342, ("$1", "$3"), "$6")):
    PROGRAM.append(("prmt", "y", "$4", "zero", selector))
    for out, nibble in zip(outputs, (0, 4)):
        PROGRAM += [
            ("shl", "t", "y", 6 - nibble),  # the code's magnitude bits to 8..6
            ("and", "t", "t", MAG),
            ("shl", "u", "y", 12 - nibble),  # its sign bit to 15
            ("and", "u", "u", SIGN),
            ("or", "v", "t", "u"),
            ("mul.bf16x2", "v", "v", "bias"),
            ("mul.bf16x2", out, "v", scale),
        ]
TEMPS = ("zero", "bias", "y", "t", "u", "v")
INIT = {"zero": 0, "bias": TWO_POW_126}


def _operand(x) -> str:
    return x if isinstance(x, str) else hex(x)


def ptx() -> str:
    """The PROGRAM as a PTX block for `tl.inline_asm_elementwise` with CONSTRAINTS and pack 4."""
    lines = ["{", f".reg .b32 {', '.join(TEMPS)};"]
    lines += [f"mov.b32 {r}, {hex(v)};" for r, v in INIT.items()]
    for op, dst, *src in PROGRAM:
        mnemonic = {"mul.bf16x2": "mul.rn.bf16x2"}.get(op, f"{op}.b32")
        lines.append(f"{mnemonic} {dst}, {', '.join(_operand(s) for s in src)};")
    lines.append("}")
    return "\n".join(lines)


def _bf16x2_mul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """mul.rn.bf16x2 on uint32 words: each half times the other's, rounded to nearest even (subnormals kept)."""
    out = np.zeros_like(a)
    for shift in (0, 16):  # (overflow to inf and nan are the IEEE results the GPU gives too)
        x = (((a >> shift) & 0xFFFF) << 16).view(np.float32)
        y = (((b >> shift) & 0xFFFF) << 16).view(np.float32)
        with np.errstate(over="ignore", invalid="ignore"):
            p = (x.astype(np.float64) * y.astype(np.float64)).astype(np.float32).view(np.uint32)
        # round the float32 product to bf16 (nearest even); nan stays a quiet nan
        r = ((p + 0x7FFF + ((p >> 16) & 1)) >> 16) & 0xFFFF
        r = np.where(np.isnan(p.view(np.float32)), 0x7FC0, r).astype(np.uint32)
        out |= r << shift
    return out


def emulate(words: np.ndarray, scale01: np.ndarray, scale23: np.ndarray) -> tuple[np.ndarray, ...]:
    """Runs PROGRAM in numpy: uint32 words of four packed bytes and the bf16x2 scale words -> the four output
    words ($0, $1, $2, $3), as the GPU would compute them."""
    regs = {"$4": words.astype(np.uint32), "$5": scale01.astype(np.uint32), "$6": scale23.astype(np.uint32)}
    regs.update({r: np.full_like(regs["$4"], v) for r, v in INIT.items()})
    val = lambda s: regs[s] if isinstance(s, str) else np.uint32(s)  # noqa: E731
    for op, dst, *src in PROGRAM:
        a, b = val(src[0]), val(src[1])
        if op == "prmt":
            sel, pool = (
                src[2],
                [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)],
            )
            regs[dst] = sum((pool[(sel >> (4 * i)) & 7] << np.uint32(8 * i)) for i in range(4)).astype(
                np.uint32
            )
        elif op == "shl":
            regs[dst] = (a << np.uint32(b)).astype(np.uint32)
        elif op == "and":
            regs[dst] = a & b
        elif op == "or":
            regs[dst] = a | b
        else:
            regs[dst] = _bf16x2_mul(a, np.broadcast_to(b, a.shape).astype(np.uint32))
    return tuple(regs[r] for r in ("$0", "$1", "$2", "$3"))
