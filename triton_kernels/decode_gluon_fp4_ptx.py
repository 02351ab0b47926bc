"""The inline PTX of the FP4 Gluon decode (``decode_gluon_fp4.py``): text built once at import.

Plain Python (no Triton): each function returns a ``{ ... }`` block of PTX for
``inline_asm_elementwise``. ``tests/test_gluon_fp4_ptx.py`` runs every block on the CPU against
the formats' own dequantization, bit for bit.
"""

def _bits_pair(x: str, out: str, bf16: bool = False) -> str:
    """PTX: fp16 pair (nibble at bits 12-15, nibble at 28-31 of ``x``) * 2^-14 into ``out``;
    ``bf16``: the bf16 pair * 2^-126 (magnitude to bits 6-8: E2M1's subnormal 0.5 lands on
    bf16's subnormal 2^-127)."""
    sh, mask = (6, "0x01C001C0") if bf16 else (3, "0x0E000E00")
    return (
        f"shr.b32 t, {x}, {sh}; and.b32 t, t, {mask}; "
        f"and.b32 {out}, {x}, 0x80008000; or.b32 {out}, {out}, t; "
    )


def _mx_scale(e: str, a: str, b: str) -> str:
    """PTX: bf16 bits of ``2^min(E - 1, 127)`` into ``a`` and ``2^max(E - 128, 0)`` into ``b``
    for the fp4_mx_block16 exponent byte ``e`` (``2^(E - 127)`` over the decode's 2^-126 in two
    exact factors: one would overflow bf16 for E > 128); bytes above 252 (never written) as
    252. ``e`` must be zero-extended (the kernel widens the uint8 scale bytes to int32)."""
    return (
        f"min.u32 {a}, {e}, 252; max.u32 {b}, {a}, 128; add.u32 {a}, {a}, 126; "
        f"min.u32 {a}, {a}, 254; shl.b32 {a}, {a}, 7; sub.u32 {b}, {b}, 1; shl.b32 {b}, {b}, 7; "
    )


def _scaled(f: str, dec: int) -> str:
    """PTX: ``f`` times the block scale (``sc``; mx: ``sc`` then ``sc2``, exact)."""
    if dec == 2:
        return f"fma.rn.bf16x2 {f}, {f}, sc, nz; fma.rn.bf16x2 {f}, {f}, sc2, nz; "
    return f"mul.rn.f16x2 {f}, {f}, sc; "


def _e4m3_word(w: str) -> str:
    """PTX: the 8 nibbles of ``w`` as e4m3 bytes (low nibbles -> ``lo``, high -> ``hi``)."""
    return (
        f"and.b32 t, {w}, 0x08080808; shl.b32 lo, t, 4; and.b32 t, {w}, 0x07070707; "
        f"shl.b32 t, t, 2; or.b32 lo, lo, t; and.b32 hi, {w}, 0x80808080; "
        f"shr.u32 t, {w}, 2; and.b32 t, t, 0x1C1C1C1C; or.b32 hi, hi, t; "
        "mov.b32 {l0, l1}, lo; mov.b32 {h0, h1}, hi; "
    )


def _k_block_asm(dec: int) -> str:
    """One K block (int64 ``$16``, scale byte ``$17``) -> 16 fp16 ``$0..$15``: pair ``p`` (8 per
    block, 4 per word) in ``$2p, $2p+1``. ``dec`` 0: pair ``p`` of word ``p // 4`` holds nibbles
    ``(p % 4, p % 4 + 4)``; 1: nibbles ``(a, a + 2)``, ``a = (0, 4, 1, 5)[p % 4]``; 2
    (fp4_mx_block16): as 0, in bf16, exact values ``E2M1 * 2^(E - 127)``."""
    head = (
        "{ .reg .b32 w0, w1, t, x, sd, sc, sc2, nz, lo, hi, f0, f1, f2, f3; "
        ".reg .b16 sl, sh, l0, l1, h0, h1; mov.b64 {w0, w1}, $16; "
    )
    if dec == 2:
        head += _mx_scale("$17", "sd", "t") + (
            "prmt.b32 sc, sd, sd, 0x1010; prmt.b32 sc2, t, t, 0x1010; mov.b32 nz, 0x80008000; "
        )
    else:
        head += "prmt.b32 sd, $17, 0, 0; mov.b32 {sl, sh}, sd; cvt.rn.f16x2.e4m3x2 sc, sl; "
    body = ""
    for j, w in enumerate(("w0", "w1")):
        if dec in (0, 2):
            for p in range(4):
                o = 4 * j + p
                src = w if p == 3 else "x"
                if p < 3:
                    body += f"shl.b32 x, {w}, {12 - 4 * p}; "
                body += _bits_pair(src, "f0", dec == 2) + _scaled("f0", dec)
                body += f"mov.b32 {{${2 * o}, ${2 * o + 1}}}, f0; "
        else:
            body += _e4m3_word(w)
            body += (
                "cvt.rn.f16x2.e4m3x2 f0, l0; cvt.rn.f16x2.e4m3x2 f1, l1; "
                "cvt.rn.f16x2.e4m3x2 f2, h0; cvt.rn.f16x2.e4m3x2 f3, h1; "
            )
            for p, f in enumerate(("f0", "f1", "f2", "f3")):
                o = 4 * j + p
                body += _scaled(f, dec) + f"mov.b32 {{${2 * o}, ${2 * o + 1}}}, {f}; "
    return head + body + "}"


def _v_block_asm(dec: int, words: int = 2) -> str:
    """One V block of two token rows (int64 ``$32``, ``$33``; scale bytes ``$34``, ``$35``) ->
    32 fp16 (``dec`` 2: bf16): value dim ``c`` of the block (``8 word + nibble``) as
    ``($2c, $2c+1)`` = (even row, odd row). ``words`` 1 (head_dim 64: a lane holds half a
    block): one 32-bit word of each row (``$16``, ``$17``; scale bytes ``$18``, ``$19``) -> 16
    values, value dim ``c`` = nibble ``c`` of the word."""
    n = 16 * words
    head = (
        "{ .reg .b32 e0, e1, o0, o1, t, x, y, p, sd, sc, sc2, nz, lo, hi, f0, f1, f2, f3; "
        ".reg .b16 sl, sh, l0, l1, h0, h1; "
    )
    if words == 2:
        head += f"mov.b64 {{e0, e1}}, ${n}; mov.b64 {{o0, o1}}, ${n + 1}; "
    else:
        head += f"mov.b32 e0, ${n}; mov.b32 o0, ${n + 1}; "
    se, so = f"${n + 2}", f"${n + 3}"
    if dec == 2:  # (even row's factor in the low half)
        head += (
            _mx_scale(se, "sd", "t")
            + _mx_scale(so, "x", "y")
            + ("prmt.b32 sc, sd, x, 0x5410; prmt.b32 sc2, t, y, 0x5410; mov.b32 nz, 0x80008000; ")
        )
    else:
        head += f"prmt.b32 sd, {se}, {so}, 0x0040; mov.b32 {{sl, sh}}, sd; "
        head += "cvt.rn.f16x2.e4m3x2 sc, sl; "
    body = ""
    for j, (we, wo) in enumerate((("e0", "o0"), ("e1", "o1"))[:words]):
        if dec in (0, 2):
            # x: bytes (we.b0, we.b1, wo.b0, wo.b1) -> nibbles 3, 2, 1, 0 by shifts 0, 4, 8, 12;
            # y: the same for bytes 2, 3 -> nibbles 7, 6, 5, 4
            body += f"prmt.b32 x, {we}, {wo}, 0x5410; prmt.b32 y, {we}, {wo}, 0x7632; "
            for n in range(8):
                src, sh = ("x", 12 - 4 * n) if n < 4 else ("y", 12 - 4 * (n - 4))
                c = 8 * j + n
                if sh:
                    body += f"shl.b32 p, {src}, {sh}; "
                body += _bits_pair("p" if sh else src, "f0", dec == 2) + _scaled("f0", dec)
                body += f"mov.b32 {{${2 * c}, ${2 * c + 1}}}, f0; "
        else:
            for half, sel in ((0, "0x5140"), (1, "0x7362")):
                body += f"prmt.b32 p, {we}, {wo}, {sel}; " + _e4m3_word("p")
                body += (
                    "cvt.rn.f16x2.e4m3x2 f0, l0; cvt.rn.f16x2.e4m3x2 f1, l1; "
                    "cvt.rn.f16x2.e4m3x2 f2, h0; cvt.rn.f16x2.e4m3x2 f3, h1; "
                )
                # l0: nibble 0 of byte pair (dim 4 half + 0), h0: 1, l1: 2, h1: 3
                for n, f in enumerate(("f0", "f2", "f1", "f3")):
                    c = 8 * j + 4 * half + n
                    body += _scaled(f, dec) + f"mov.b32 {{${2 * c}, ${2 * c + 1}}}, {f}; "
    return head + body + "}"
