"""The inline PTX of the FP4 Gluon decode (``triton_kernels/decode_gluon_fp4.py``), run on the CPU.

The kernel itself needs a GPU (Gluon has no interpreter), but its FP4 decode is a handful of
integer and half-precision instructions in PTX text built by ``_k_block_asm`` /
``_v_block_asm``. A small interpreter for exactly those instructions (written from the PTX ISA's
definitions: ``prmt`` default mode, logical ``shr.b32``, ``cvt.rn.f16x2.e4m3x2``,
``mul.rn.f16x2``, ``fma.rn.bf16x2``) runs the generated text on random blocks; the outputs must
equal, bit for bit (signed zeros included), an independent dequantization
(``formats.E2M1_VALUES``, torch's float8_e4m3fn, powers of two) times the documented factor of
each decode (2^-14, 1/64 or 1), in the documented order: every nibble in every position, every
scale byte (each finite e4m3 byte; each of the 256 exponent bytes of fp4_mx_block16).
A bit error in a mask, shift or ``prmt`` selector fails here, without a GPU.
"""

from __future__ import annotations

import functools
import re

import numpy as np
import pytest
import torch

from kvpool import formats

fp4 = pytest.importorskip("kvpool.triton_kernels.decode_gluon_fp4")

M32 = 0xFFFFFFFF


def _f16(bits: int) -> float:
    return float(np.array([bits], dtype=np.uint16).view(np.float16)[0])


def _f16_bits(x: float) -> int:
    return int(np.array([x], dtype=np.float16).view(np.uint16)[0])


def _bf16(bits: int) -> float:
    i16 = np.array([bits], dtype=np.uint16).view(np.int16)
    return torch.from_numpy(i16).view(torch.bfloat16).float().item()


def _bf16_bits(x: float) -> int:
    return int(torch.tensor([x], dtype=torch.bfloat16).view(torch.int16).item()) & 0xFFFF


def _e4m3(byte: int) -> float:
    return torch.tensor([byte], dtype=torch.uint8).view(torch.float8_e4m3fn).float().item()


@functools.cache
def _parse(asm: str) -> tuple:
    """``(opcode, operands)`` of each instruction of a ``{ ... }`` PTX block (no ``.reg``)."""
    prog = []
    for ins in asm.strip().strip("{}").split(";"):
        ins = ins.strip()
        if ins and not ins.startswith(".reg"):
            op, rest = ins.split(None, 1)
            prog.append((op, tuple(t.strip() for t in re.split(r",(?![^{]*})", rest))))
    return tuple(prog)


def run_ptx(asm: str, args: list[int], n_out: int) -> list[int]:
    """Run the generated PTX block; ``args`` fill ``$n_out...``; returns ``$0..$n_out-1`` as
    16-bit patterns."""
    regs: dict[str, int] = {f"${n_out + i}": a for i, a in enumerate(args)}
    out: dict[int, int] = {}

    def val(tok: str) -> int:
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        return int(tok, 16) if tok.lower().startswith("0x") else int(tok)

    for op, ops in _parse(asm):
        if op in ("mov.b64", "mov.b32") and ops[0].startswith("{"):  # unpack
            parts = [p.strip() for p in ops[0].strip("{}").split(",")]
            v, w = val(ops[1]), (32 if op == "mov.b64" else 16)
            for i, p in enumerate(parts):
                piece = (v >> (w * i)) & ((1 << w) - 1)
                if p.startswith("$"):
                    out[int(p[1:])] = piece
                else:
                    regs[p] = piece
            continue
        d, a = ops[0], [val(t) for t in ops[1:]]
        if op == "mov.b32":
            r = a[0]
        elif op in ("shl.b32",):
            r = (a[0] << a[1]) & M32
        elif op in ("shr.b32", "shr.u32"):  # logical for .b32/.u32
            r = (a[0] & M32) >> a[1]
        elif op == "and.b32":
            r = a[0] & a[1]
        elif op == "or.b32":
            r = a[0] | a[1]
        elif op == "add.u32":
            r = (a[0] + a[1]) & M32
        elif op == "sub.u32":
            r = (a[0] - a[1]) & M32
        elif op == "min.u32":
            r = min(a[0], a[1])
        elif op == "max.u32":
            r = max(a[0], a[1])
        elif op == "prmt.b32":  # default mode: nibble i of c picks byte i; bit 3 = sign fill
            src = (a[0] & M32) | ((a[1] & M32) << 32)
            r = 0
            for i in range(4):
                sel = (a[2] >> (4 * i)) & 0xF
                byte = (src >> (8 * (sel & 7))) & 0xFF
                if sel & 8:
                    byte = 0xFF if byte & 0x80 else 0
                r |= byte << (8 * i)
        elif op == "cvt.rn.f16x2.e4m3x2":  # low byte -> low half
            r = _f16_bits(_e4m3(a[0] & 0xFF)) | (_f16_bits(_e4m3((a[0] >> 8) & 0xFF)) << 16)
        elif op == "mul.rn.f16x2":
            r = 0
            for h in (0, 16):
                x, y = _f16((a[0] >> h) & 0xFFFF), _f16((a[1] >> h) & 0xFFFF)
                r |= _f16_bits(float(np.float16(np.float32(x) * np.float32(y)))) << h
        elif op == "fma.rn.bf16x2":
            r = 0
            for h in (0, 16):
                x, y, z = (_bf16((t >> h) & 0xFFFF) for t in a[:3])
                r |= _bf16_bits(x * y + z) << h  # (exact here: powers of two)
        else:
            raise AssertionError(f"instruction {op!r} not modelled")
        regs[d] = r & M32
    return [out[i] for i in range(n_out)]


def _nibbles(block: int) -> list[int]:
    return [(block >> (4 * i)) & 0xF for i in range(16)]


def _e2m1(nib: int) -> float:
    return (-1.0 if nib & 8 else 1.0) * formats.E2M1_VALUES[nib & 7]


def _scale(byte: int, dec: int) -> float:
    """Block scale as the decode applies it, with the decode's own factor."""
    if dec == 2:  # fp4_mx_block16: 2^(E - 127), exponent bytes above 252 read as 252
        return 2.0 ** (min(byte, 252) - 127)
    return _e4m3(byte) * (2.0**-14 if dec == 0 else 1 / 64)


def _k_nibble(p: int, e: int, dec: int) -> int:
    """Nibble of the block held by pair ``p`` (0..7), half ``e`` (the kernel's q permutation)."""
    if dec == 1:
        a = (0, 4, 1, 5)[p % 4]
        return 8 * (p // 4) + a + 2 * e
    return 8 * (p // 4) + p % 4 + 4 * e


def _bits(x: float, dec: int) -> int:
    """The 16-bit pattern of ``x`` in the decode's type (signed zeros kept)."""
    return _bf16_bits(x) if dec == 2 else _f16_bits(x)


def _blocks(rng, n):
    """Every nibble value in every position (16 rotations), then random blocks."""
    rot = [sum(((i + k) % 16) << (4 * i) for i in range(16)) for k in range(16)]
    return rot + [int(x) for x in rng.integers(0, 2**64, size=n, dtype=np.uint64)]


def _scale_bytes(dec):
    """Every exponent byte for fp4_mx_block16; every finite e4m3 byte for nvfp4."""
    return list(range(256)) if dec == 2 else [b for b in range(256) if b & 0x7F != 0x7F]


@pytest.mark.parametrize("dec", [0, 1, 2])
def test_k_block_ptx_matches_dequantization(dec):
    rng = np.random.default_rng(dec)
    asm = fp4._k_block_asm(dec)
    blocks = _blocks(rng, 4)
    for i, sb in enumerate(_scale_bytes(dec)):
        for block in (blocks[i % 16], blocks[16 + i % 4]) if i % 8 else blocks:
            out = run_ptx(asm, [block, sb], 16)
            nib = _nibbles(block)
            for p in range(8):
                for e in range(2):
                    want = _e2m1(nib[_k_nibble(p, e, dec)]) * _scale(sb, dec)
                    assert out[2 * p + e] == _bits(want, dec), (dec, hex(block), sb, p, e)


@pytest.mark.parametrize("dec", [0, 1, 2])
def test_v_block_ptx_matches_dequantization(dec):
    """Value dim ``c`` of the block (``8 word + nibble``) for the even and the odd token row."""
    rng = np.random.default_rng(10 + dec)
    asm = fp4._v_block_asm(dec)
    blocks = _blocks(rng, 4)
    scales = _scale_bytes(dec)
    for i, se in enumerate(scales):
        so = scales[(7 * i + 3) % len(scales)]
        be, bo = blocks[i % len(blocks)], blocks[(i + 5) % len(blocks)]
        out = run_ptx(asm, [be, bo, se, so], 32)
        ne, no = _nibbles(be), _nibbles(bo)
        for c in range(16):
            assert out[2 * c] == _bits(_e2m1(ne[c]) * _scale(se, dec), dec), (dec, i, c)
            assert out[2 * c + 1] == _bits(_e2m1(no[c]) * _scale(so, dec), dec), (dec, i, c)
