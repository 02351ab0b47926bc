"""Paged decode over FP4 caches (nvfp4, fp4_mx_block16) in Gluon: nibbles straight into
tensor-core fragments.

``@gluon.jit`` code only; the launcher and its checks live in ``kvpool.attention`` (plans with
``gluon=True`` on FP4 caches; the same device and geometry limits as the fp8 kernel in
``decode_gluon.py``, whose design this follows: one warp per (request, KV head, split), 16-token
tiles, ``mma.sync.m16n8k16`` with fp16 operands, head dims and value dims permuted so that every
layout conversion is free, P^T taken from S's accumulator). Head_dim ``D`` 64, 128 or 256 and
groups up to 16 as in the fp8 kernel: a K row of ``D / 16`` blocks (``D / 64`` per lane), a
V row of ``D / 128`` blocks per lane; at head_dim 64 a lane holds half a V block (a 32-bit
word per token, ``_v_block_asm(dec, words=1)``, its block's scale read by two lanes; the ring
reads V's words as ``[16, 8]`` int32 and relabels them) and the ring's TMA boxes are 16 x 32
bytes, unswizzled; at 256 they are 16 x 128 bytes with the 128-byte swizzle (register prefetch
would spill there). Head_dim 128 with groups <= 8: PTX unchanged.

What differs for FP4 (the cache row of one head: 64 bytes of E2M1 nibbles, element ``2i`` in the
low nibble of byte ``i``, and 8 bytes of e4m3 block scales, one per 16 values):

- The unit of a load is a *block*: 16 nibbles (one int64) and its scale byte. A lane reads whole
  blocks (K: 2 blocks of 2 tokens, one 128-bit load each; V: 1 block of 4 tokens), so each
  register it decodes needs the one scale of its block.
- Decode (``DEC`` 0, integer): two nibbles ``A`` (bits 12-15 of a word) and ``B`` (bits 28-31)
  become the fp16 pair ``(A, B) * 2^-14`` exactly by moving bits: the sign to bit 15/31, the
  magnitude ``e1 e0 m`` to bits 9-11/25-27 (fp16 exponent bits 10-11 and the top mantissa bit: the
  E2M1 subnormal 0.5 lands on the fp16 subnormal 2^-15, so one rule serves every code).
  ``DEC`` 1: each nibble is moved onto an e4m3 byte ``s 0 0 e1 e0 m 0 0`` (= E2M1 / 64) and
  converted in pairs by ``cvt.rn.f16x2.e4m3x2``; fewer integer instructions, more conversions.
  Either way the pair is then multiplied by the block scale (``mul.rn.f16x2``; exact: a 2-bit by
  a 4-bit significand, products >= 2^-24, the smallest fp16 subnormal), and the global scale
  and the decode's 2^14 (or 64) are folded into the softmax scale (K) and the output (V).
- fp4_mx_block16 (``DEC`` 2): the power-of-two scales span 2^-127..2^125, beyond fp16, so
  the operands are bf16: the nibble's bits placed as a bf16 (``E2M1 * 2^-126``, the subnormal
  0.5 on bf16's 2^-127), then two exact ``fma.rn.bf16x2`` by ``2^min(E - 1, 127)`` and
  ``2^max(E - 128, 0)`` (one factor would overflow for E > 128): exact values, no global scale,
  bf16 MMAs (as the Triton kernel's mx path, which clamps exponents above 248, |x| > 6 * 2^121;
  this one is exact up to 252, the largest the write path stores). Run 8, call 14: B=64/8k
  0.297 ms (1.66x SDPA) vs 0.465 for the Triton kernel. ``tests/test_gluon_fp4_ptx.py`` runs
  the generated PTX of every decode on the CPU against the formats, bit for bit.
- V^T's A fragment needs two tokens per register: ``prmt`` puts byte ``j`` of two token rows
  into bytes 1 and 3 (and byte ``j'`` into 0 and 2) of one word, which then yields four
  registers by shifts.

Loads: with ``STAGES`` (2 by default; page_size >= 16, so that a 16-aligned tile lies in one
page: ``PAGED``) a ring in shared memory of stages of ``SUB`` 16-token tiles (1 or 2; two share
one barrier, one copy issue and one max reduction per 32 tokens), one page id per tile loaded
an iteration ahead. The data rows come by TMA boxes (``TMA``, sm_90+: 16 rows x 64 bytes of one
head, 64-byte swizzle, one mbarrier per stage) or by ``cp.async`` (16-byte pieces), the scale
rows by ``cp.async`` (4-byte pieces); with ``STAGES=0`` the next tile goes into registers
(smaller pages: a page id per token). Tiles start at multiples of 16 (tokens before a sliding
window's start are masked); scale rows (and cp.async data rows) past the last token repeat it,
so no load is masked; stages past the end repeat the last tile, and every copy has landed
before the program exits. The grid runs the KV head fastest (``HEAD_FAST``): a request's heads
share token rows and 32-byte scale sectors. The softmax runs on S's 8 rows of the query group
and rescales ``acc`` only when a row's max grew by more than ``RESCALE`` (log2 units; exact:
the same stale max serves p, l and acc, p <= 2^RESCALE in fp16). ``ABLATE=1`` (probes only)
keeps the loads and drops the math.

Why (``benches/attention/results/run9_h200/NOTES.md``, H200, B=64/8k): 0.216 ms vs the Triton
kernel's 0.424 (2.28x SDPA on contiguous bf16 instead of 1.16x). Run 8's cp.async ring was bound
by its loads (0.245 ms, loads alone as long); TMA boxes fetch the same token-major tiles in
0.171-0.177 ms, and the ~430 SASS instructions per 16-token tile (decode ~250 of them) now
bound the kernel.

Masking as in ``decode.py`` (KVB-16, docs/architecture.md): rows past ``seq_len`` are never
scored (p = 0); their scale rows are never read. A TMA box fetches its tile's 16 data rows
whole, so data rows past ``seq_len`` (or before a window) in the tile's page are read: E2M1
codes are all finite, so p = 0 keeps them out of the output whatever they hold.
"""

import triton  # noqa: F401  (Gluon needs Triton's runtime)
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from .decode_gluon import (
    KOP,
    MMA,
    POP,
    QOP,
    VOP,
    _addr,
    _fold_sinks,
    _geometry_ok,
    _log2_scores,
    _program,
    _rows0to7,
    _store_out,
    _store_partial,
    _tile_row0,
    _tile_rows,
)
from .decode_gluon_fp4_layouts import (
    _fp4_k_layout,
    _fp4_row_swizzle,
    _fp4_scale_copy_layout,
    _fp4_softmax_layout,
    _fp4_tma_swizzle,
    _fp4_v64,
    _fp4_v64_swizzle,
    _fp4_v64_words_layout,
    _fp4_v_layout,
    _fp4_v_rowcol_layout,
)
from .decode_gluon_fp4_ptx import _k_block_asm, _v_block_asm

# --- inline PTX, built once at import (decode_gluon_fp4_ptx.py) -------------------------

# (jit code reads module globals only as constexpr)
_K_ASM0 = gl.constexpr(_k_block_asm(0))
_K_ASM1 = gl.constexpr(_k_block_asm(1))
_V_ASM0 = gl.constexpr(_v_block_asm(0))
_V_ASM1 = gl.constexpr(_v_block_asm(1))
_K_ASM2 = gl.constexpr(_k_block_asm(2))
_V_ASM2 = gl.constexpr(_v_block_asm(2))
_K_CONSTRAINTS = gl.constexpr(",".join(["=h"] * 16 + ["l", "r"]))
_V_CONSTRAINTS = gl.constexpr(",".join(["=h"] * 32 + ["l", "l", "r", "r"]))
_VH_ASM0 = gl.constexpr(_v_block_asm(0, 1))
_VH_ASM1 = gl.constexpr(_v_block_asm(1, 1))
_VH_ASM2 = gl.constexpr(_v_block_asm(2, 1))
_VH_CONSTRAINTS = gl.constexpr(",".join(["=h"] * 16 + ["r", "r", "r", "r"]))


@gluon.jit
def _exp2(x):
    """2^x in fp32 with subnormal results flushed to zero (``ex2.approx.ftz.f32``: one MUFU
    instruction; without ``.ftz`` ptxas adds a range check and two multiplies). Softmax terms
    below 2^-126 would be fp16 zeros in P (bf16, fp4_mx_block16's P, keeps subnormals to 2^-133:
    dropping terms < 2^-126 of a sum whose largest term is >= 1 moves it less than its ulp)."""
    return gl.inline_asm_elementwise(
        asm="ex2.approx.ftz.f32 $0, $1;",
        constraints="=f,f",
        args=[x],
        dtype=gl.float32,
        is_pure=True,
        pack=1,
    )


@gluon.jit
def _tree4(a0, a1, a2, a3):
    """``[..., 2, 2]`` holding ``a[2i + j]`` at ``[..., i, j]`` (``join`` adds the last axis)."""
    return gl.join(gl.join(a0, a2), gl.join(a1, a3))


@gluon.jit
def _tree8(a0, a1, a2, a3, a4, a5, a6, a7):
    return gl.join(_tree4(a0, a2, a4, a6), _tree4(a1, a3, a5, a7))


@gluon.jit
def _tree16(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15):
    return gl.join(
        _tree8(a0, a2, a4, a6, a8, a10, a12, a14), _tree8(a1, a3, a5, a7, a9, a11, a13, a15)
    )


@gluon.jit
def _k_operand(x, s, BOP: gl.constexpr, DEC: gl.constexpr, D: gl.constexpr = 128):
    """K blocks ``[16 tokens, 8 blocks]`` int64 (lane ``4g + t``: tokens g, g+8; blocks 2t, 2t+1)
    and their scale bytes -> K^T ``[128, 16]`` fp16, the B operand of the QK MMA: logical
    ``k = 16s + 8h + 2t + e`` is pair ``p = 2(s % 4) + h`` of block ``2t + s // 4``."""
    o = gl.inline_asm_elementwise(
        asm=_K_ASM0 if DEC == 0 else (_K_ASM1 if DEC == 1 else _K_ASM2),
        constraints=_K_CONSTRAINTS,
        args=[x, s],
        dtype=(gl.bfloat16 if DEC == 2 else gl.float16,) * 16,
        is_pure=True,
        pack=1,
    )
    y = _tree16(
        o[0], o[1], o[2], o[3], o[4], o[5], o[6], o[7],
        o[8], o[9], o[10], o[11], o[12], o[13], o[14], o[15],
    )  # fmt: skip
    # (tok, t, i, s % 4, h, e): block (D / 64) t + i, p = 2(s % 4) + h
    y = gl.reshape(y, [16, 4, D // 64, 4, 2, 2])
    y = gl.permute(y, [0, 2, 3, 4, 1, 5])  # (tok, i, s % 4, h, t, e)
    y = gl.reshape(y, [16, D])
    return gl.convert_layout(gl.permute(y, [1, 0]), BOP, assert_trivial=True)


@gluon.jit
def _v_operand(x, s, AOP: gl.constexpr, DEC: gl.constexpr, D: gl.constexpr = 128):
    """V blocks ``[16 tokens, 8 blocks]`` int64 (lane ``4g + t``: tokens 2t, 2t+1, 2t+8, 2t+9;
    block g) and their scale bytes -> V^T ``[128, 16]`` fp16, the A operand of the PV MMA:
    logical row ``16m + 8r + g`` is value dim ``2m + r`` of block g (stored ``16g + 2m + r``)."""
    if D == 64:
        y = _v_operand_half(x, s, DEC)
    else:
        y = _v_operand_blocks(x, s, DEC, D)
    return gl.convert_layout(y, AOP, assert_trivial=True)


@gluon.jit
def _v_operand_half(x, s, DEC: gl.constexpr):
    """head_dim 64: words ``[16 tokens, 4 blocks, 2 halves]`` and their blocks' scale bytes
    ``[16, 4]`` -> V^T ``[64, 16]``: logical row ``16m + 8r + g`` is nibble ``2m + r`` of half
    ``g % 2`` of block ``g // 2`` (stored ``8g + 2m + r``)."""
    s = gl.broadcast(s[:, :, None], x)[0]
    x = gl.permute(gl.reshape(x, [2, 4, 2, 4, 2]), [0, 1, 3, 4, 2])  # (hh, t, blk, half, e)
    xe, xo = gl.split(x)
    s = gl.permute(gl.reshape(s, [2, 4, 2, 4, 2]), [0, 1, 3, 4, 2])
    se, so = gl.split(s)
    o = gl.inline_asm_elementwise(
        asm=_VH_ASM0 if DEC == 0 else (_VH_ASM1 if DEC == 1 else _VH_ASM2),
        constraints=_VH_CONSTRAINTS,
        args=[xe, xo, se, so],
        dtype=(gl.bfloat16 if DEC == 2 else gl.float16,) * 16,
        is_pure=True,
        pack=1,
    )
    # o[2c + e]: value dim c of the half block, token row e of the pair
    y = gl.join(
        _tree8(o[0], o[2], o[4], o[6], o[8], o[10], o[12], o[14]),
        _tree8(o[1], o[3], o[5], o[7], o[9], o[11], o[13], o[15]),
    )  # (hh, t, blk, half, m, r, e)
    y = gl.reshape(y, [2, 4, 8, 4, 2, 2])  # (hh, t, g, m, r, e)
    y = gl.permute(y, [3, 4, 2, 0, 1, 5])  # (m, r, g, hh, t, e)
    return gl.reshape(y, [64, 16])


@gluon.jit
def _v_operand_blocks(x, s, DEC: gl.constexpr, D: gl.constexpr):
    """head_dim >= 128: V blocks ``[16 tokens, D / 16]`` and their scale bytes -> V^T
    ``[D, 16]``: logical row ``16m + 8r + g`` is value dim ``2m + r`` of lane g's
    ``D / 128`` blocks (stored ``(D / 8) g + 2m + r``)."""
    x = gl.permute(gl.reshape(x, [2, 4, 2, D // 16]), [0, 1, 3, 2])  # (hh, t, blk, e)
    xe, xo = gl.split(x)
    s = gl.permute(gl.reshape(s, [2, 4, 2, D // 16]), [0, 1, 3, 2])
    se, so = gl.split(s)
    o = gl.inline_asm_elementwise(
        asm=_V_ASM0 if DEC == 0 else (_V_ASM1 if DEC == 1 else _V_ASM2),
        constraints=_V_CONSTRAINTS,
        args=[xe, xo, se, so],
        dtype=(gl.bfloat16 if DEC == 2 else gl.float16,) * 32,
        is_pure=True,
        pack=1,
    )
    # o[2c + e]: value dim c, token row e of the pair
    y = gl.join(
        _tree16(
            o[0], o[2], o[4], o[6], o[8], o[10], o[12], o[14],
            o[16], o[18], o[20], o[22], o[24], o[26], o[28], o[30],
        ),
        _tree16(
            o[1], o[3], o[5], o[7], o[9], o[11], o[13], o[15],
            o[17], o[19], o[21], o[23], o[25], o[27], o[29], o[31],
        ),
    )  # fmt: skip
    if D == 128:
        y = gl.reshape(y, [2, 4, 8, 8, 2, 2])  # (hh, t, g, m, r, e)
        y = gl.permute(y, [3, 4, 2, 0, 1, 5])  # (m, r, g, hh, t, e)
    else:  # block 2g + bm, m = 8 bm + m'
        y = gl.reshape(y, [2, 4, 8, D // 128, 8, 2, 2])  # (hh, t, g, bm, m', r, e)
        y = gl.permute(y, [3, 4, 5, 2, 0, 1, 6])  # (bm, m', r, g, hh, t, e)
    return gl.reshape(y, [D, 16])


@gluon.jit
def _load_tile(
    x_ptr,
    s_ptr,
    s,
    end,
    pt_row,
    page_shift,
    page_mask,
    sr,
    ssr,
    r,
    c,
    lo,
    PAGED: gl.constexpr,
    GUARD: gl.constexpr,
    WINDOW: gl.constexpr,
):
    """Blocks (int64) and scale bytes (as int32) of tokens ``s + r``, columns ``c``: rows past
    the last token (and before a window's first) repeat it and ``PAGED`` tiles take one page id
    (``decode_gluon._tile_rows``)."""
    row0, rows = _tile_rows(s, end, pt_row, page_shift, page_mask, r, lo, PAGED, GUARD, WINDOW)
    x = gl.load(_addr(x_ptr, sr, row0, rows, c, PAGED))
    sb = gl.load(_addr(s_ptr, ssr, row0, rows, c, PAGED))
    return x, sb.to(gl.int32)


@gluon.jit
def _load_kv(
    ptrs,
    strides,
    s,
    end,
    lo,
    pt_row,
    page_shift,
    page_mask,
    kr,
    kc,
    vr,
    vc,
    PAGED: gl.constexpr,
    GUARD: gl.constexpr,
    WINDOW: gl.constexpr,
    VL: gl.constexpr = None,
):
    """``_load_tile`` of K (rows ``kr``, blocks ``kc``) and of V: ``(kx, ks, vx, vs)``; with
    ``VL`` (head_dim 64) V by :func:`_load_v_half`."""
    kx_ptr, vx_ptr, ks_ptr, vs_ptr = ptrs
    srk, srv, ssk, ssv = strides
    kx, ks = _load_tile(
        kx_ptr, ks_ptr, s, end, pt_row, page_shift, page_mask, srk, ssk, kr, kc, lo, PAGED, GUARD,
        WINDOW,
    )  # fmt: skip
    if VL is None:
        vx, vs = _load_tile(
            vx_ptr, vs_ptr, s, end, pt_row, page_shift, page_mask, srv, ssv, vr, vc, lo, PAGED,
            GUARD, WINDOW,
        )  # fmt: skip
    else:
        vx, vs = _load_v_half(
            vx_ptr, vs_ptr, s, end, pt_row, page_shift, page_mask, srv, ssv, vr, vc, lo, PAGED,
            GUARD, WINDOW, VL,
        )  # fmt: skip
    return kx, ks, vx, vs


@gluon.jit
def _load_v_half(
    x_ptr,
    s_ptr,
    s,
    end,
    pt_row,
    page_shift,
    page_mask,
    sr,
    ssr,
    r,
    c,
    lo,
    PAGED: gl.constexpr,
    GUARD: gl.constexpr,
    WINDOW: gl.constexpr,
    VL: gl.constexpr,
):
    """head_dim 64: V words ``[16 tokens, 4 blocks, 2 halves]`` (int32, ``x_ptr`` and row stride
    ``sr`` in words) in ``VL`` and the blocks' scale bytes ``[16, 4]`` (as int32, SliceLayout 2
    of ``VL``; two lanes read each), rows as in :func:`_load_tile`."""
    row0, rows = _tile_rows(s, end, pt_row, page_shift, page_mask, r, lo, PAGED, GUARD, WINDOW)
    sb = gl.load(_addr(s_ptr, ssr, row0, rows, c, PAGED))
    h = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, VL)))
    off = (rows * sr)[:, None, None] + (2 * c)[None, :, None] + h[None, None, :]
    x = gl.load((x_ptr + row0 * sr) + off)
    return x, sb.to(gl.int32)


@gluon.jit
def _expect(descs, stage, SUB: gl.constexpr, TMA: gl.constexpr, D: gl.constexpr = 128):
    """TMA: arm stage ``stage``'s mbarrier for its SUB tiles' K and V data boxes (``16 x D / 2``
    bytes each)."""
    if TMA:
        mbarrier.expect(descs[2].index(stage), SUB * 2 * 16 * (D // 2))


@gluon.jit
def _issue(
    bufs,
    slot,
    stage,
    s,
    end,
    lo,
    row0,
    ptrs,
    strides,
    rd,
    cd,
    rs,
    cs,
    GUARD: gl.constexpr,
    WINDOW: gl.constexpr,
    descs,
    TMA: gl.constexpr,
):
    """Copies of one 16-token tile into ring slot ``slot`` (of stage ``stage``): the scale rows
    by cp.async at rows ``row0`` + the offsets of ``decode_gluon._tile_rows`` (clamped to the
    last token and to a window's first: no scale row past ``seq_len`` or before the window is
    read); the data rows likewise by cp.async, or (``TMA``) as two 16 x 64-byte TMA boxes from
    ``row0``, which take the tile's rows past the end or before the window too: E2M1 codes are
    all finite and those rows' p is 0. The caller commits the cp.async group."""
    kd, vd, ksm, vsm = bufs
    kx_ptr, vx_ptr, ks_ptr, vs_ptr = ptrs
    srk, srv, ssk, ssv = strides
    lim = end - 1 - s
    if GUARD:  # the prologue: an empty request (``end`` 0)
        lim = gl.maximum(lim, 0)
    os_ = gl.minimum(rs, lim)
    if WINDOW:
        os_ = gl.maximum(os_, lo - s)
    os_ = os_[:, None]
    if TMA:
        kdesc, vdesc, bars, col = descs
        bar = bars.index(stage)
        tma.async_copy_global_to_shared(kdesc, [row0.to(gl.int32), col], bar, kd.index(slot))
        tma.async_copy_global_to_shared(vdesc, [row0.to(gl.int32), col], bar, vd.index(slot))
    else:
        od = gl.minimum(rd, lim)
        if WINDOW:
            od = gl.maximum(od, lo - s)
        od = od[:, None]
        async_copy.async_copy_global_to_shared(
            kd.index(slot), (kx_ptr + row0 * srk) + (od * srk + cd[None, :])
        )
        async_copy.async_copy_global_to_shared(
            vd.index(slot), (vx_ptr + row0 * srv) + (od * srv + cd[None, :])
        )
    async_copy.async_copy_global_to_shared(
        ksm.index(slot), (ks_ptr + row0 * ssk) + (os_ * ssk + cs[None, :])
    )
    async_copy.async_copy_global_to_shared(
        vsm.index(slot), (vs_ptr + row0 * ssv) + (os_ * ssv + cs[None, :])
    )


@gluon.jit
def _smem_tile(
    bufs,
    which: gl.constexpr,
    slot,
    L: gl.constexpr,
    SD: gl.constexpr,
    TMA: gl.constexpr,
    D: gl.constexpr = 128,
):
    """Blocks (int64) and scale bytes (int32) of ring slot ``slot`` of K (``which`` 0) or V (1)
    in the register layout ``L`` (TMA's byte boxes read as int64 blocks: same swizzle)."""
    x = bufs[which].index(slot)
    V64: gl.constexpr = _fp4_v64(which, D)
    if V64:  # (V as words [16, 4 blocks, 2 halves], L 3-D)
        if TMA:
            x = x._reinterpret(gl.int32, [16, x.shape[1] // 4], _fp4_v64_swizzle())
        else:
            x = x._reinterpret(gl.int32, [16, x.shape[1] * 2], _fp4_v64_swizzle())
        w = gl.reshape(x.load(_fp4_v64_words_layout()), [16, 4, 2])
        out = gl.convert_layout(w, L, assert_trivial=True)
        sc = bufs[3].index(slot).load(gl.SliceLayout(2, L)).to(gl.int32)
    else:
        if TMA:
            x = x._reinterpret(gl.int64, [16, x.shape[1] // 8], SD)
        out = x.load(L)
        sc = bufs[2 + which].index(slot).load(L).to(gl.int32)
    return out, sc


@gluon.jit
def _checksum(kx, ks, vx, vs):
    """Benchmarks only (``ABLATE=1``): a value that depends on every loaded word."""
    t = gl.sum(gl.sum(kx ^ ks.to(gl.int64), 1), 0) + gl.sum(gl.sum(vx ^ vs.to(gl.int64), 1), 0)
    return t.to(gl.float32)


@gluon.jit
def _scores(
    q,
    kx,
    ks,
    s,
    sc,
    sm,
    MMA: gl.constexpr,
    KOP: gl.constexpr,
    S8: gl.constexpr,
    DEC_K: gl.constexpr,
    HAS_SOFTCAP: gl.constexpr,
    HAS_WINDOW: gl.constexpr,
    D: gl.constexpr = 128,
    NH: gl.constexpr = 8,
):
    """Scores of the query group against the 16-token tile at ``s`` in log2 units, ``[NH, 16]``
    fp32 (S's rows 0..7, or all 16), soft-capped if asked, -inf past the end and before the
    window."""
    qk_scale, softcap, end, lo = sm
    kt = _k_operand(kx, ks, KOP, DEC_K, D)
    sacc = mma_v2(q, kt, gl.zeros([16, 16], gl.float32, layout=MMA))
    if NH == 8:
        sacc = gl.convert_layout(_rows0to7(sacc, 16), S8, assert_trivial=True)
    return _log2_scores(sacc, s, sc, qk_scale, softcap, end, lo, HAS_SOFTCAP, HAS_WINDOW)


@gluon.jit
def _rescale(m_i, l_i, acc, m_new, RESCALE: gl.constexpr, MMA: gl.constexpr):
    """Lazy softmax rescale: the running max moves only when some row grew by more than
    RESCALE (log2 units), so p stays <= 2^RESCALE (fp16) and acc and l are rescaled rarely;
    exact, since the same (stale) max serves p, l and acc."""
    if gl.max(m_new - m_i, axis=0) > RESCALE:
        alpha = _exp2(m_i - m_new)
        l_i = l_i * alpha
        m_i = m_new
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(0, MMA))[None, :]
    return m_i, l_i, acc


@gluon.jit
def _pv(
    acc,
    vx,
    vs,
    p,
    VOP: gl.constexpr,
    POP: gl.constexpr,
    CDT: gl.constexpr,
    DEC_V: gl.constexpr,
    D: gl.constexpr = 128,
):
    """``acc += V^T P^T`` for one 16-token tile (P: ``[NH, 16]`` fp32, S8's layout)."""
    pt = gl.convert_layout(gl.permute(p.to(CDT), [1, 0]), POP, assert_trivial=True)
    return mma_v2(_v_operand(vx, vs, VOP, DEC_V, D), pt, acc)


@gluon.jit(do_not_specialize=["group"])  # (a group of 1 would become a constant)
def decode_kernel(
    Q,
    K,
    V,
    KBS,
    VBS,
    KSC,
    VSC,
    PT,
    SEQ,
    SINKS,
    OUT,
    PO,
    PL,
    stride_qb,
    stride_qh,
    stride_kr,
    stride_vr,
    stride_ksr,
    stride_vsr,
    stride_pt,
    stride_ob,
    stride_oh,
    sm_scale,
    softcap,
    window,
    page_shift,
    num_splits,
    group,
    G: gl.constexpr,
    FINAL: gl.constexpr,
    DEC_K: gl.constexpr,
    DEC_V: gl.constexpr,
    HAS_SOFTCAP: gl.constexpr,
    HAS_WINDOW: gl.constexpr,
    HAS_SINKS: gl.constexpr,
    PAGED: gl.constexpr,
    STAGES: gl.constexpr = 0,
    RESCALE: gl.constexpr = 8.0,
    HEAD_FAST: gl.constexpr = False,
    ABLATE: gl.constexpr = 0,
    KD=None,
    VD=None,
    TMA: gl.constexpr = False,
    SUB: gl.constexpr = 1,
    D: gl.constexpr = 128,
):
    BN: gl.constexpr = 16
    # head_dim D (64, 128, 256); the PV dot's N side: 8 heads, or 16 for groups of 9..16
    gl.static_assert(_geometry_ok(D, G), "D 64, 128 or 256; G 1..16")
    NH: gl.constexpr = 8 if G <= 8 else 16
    NBK: gl.constexpr = D // 16  # blocks (and scale bytes) of a head's row
    # (MMA, QOP, KOP, VOP, POP: decode_gluon's shared mma.sync layouts)
    KL: gl.constexpr = _fp4_k_layout(D)
    VL: gl.constexpr = _fp4_v_layout(D)
    # the decode's 2^-14 (DEC 0) or 1/64 (DEC 1), undone with the global scales
    # (DEC 2, fp4_mx_block16: exact values in bf16, no global scale, partials in true units)
    MX: gl.constexpr = DEC_K == 2
    gl.static_assert((DEC_K == 2) == (DEC_V == 2), "DEC 2 (bf16 operands) for both K and V")
    CDT: gl.constexpr = gl.bfloat16 if MX else gl.float16
    KMUL: gl.constexpr = 16384.0 if DEC_K == 0 else (64.0 if DEC_K == 1 else 1.0)
    VMUL: gl.constexpr = 16384.0 if DEC_V == 0 else (64.0 if DEC_V == 1 else 1.0)
    PMUL: gl.constexpr = 1.0 if MX else VMUL / 64.0

    # (a ring stage is SUB tiles: splits in whole stages)
    gl.static_assert(SUB == 1 or (SUB == 2 and STAGES > 0), "SUB: 1, or 2 with the ring")
    page_mask = (1 << page_shift) - 1
    b, hk, split, lo, start, end = _program(
        SEQ, window, num_splits, HEAD_FAST, HAS_WINDOW, BN * SUB
    )
    if MX:
        qk_scale = sm_scale
    else:
        qk_scale = sm_scale * gl.load(KSC) * KMUL

    # q (A operand) in the permuted head-dim order of _k_operand: logical k = 16s + 8h + 2t + e
    # -> pair p = 2(s % 4) + h of block 2t + s // 4 -> stored 32t + 16(s // 4) + 8(p // 4) + nib
    qr = gl.arange(0, 16, layout=gl.SliceLayout(1, QOP))
    qc = gl.arange(0, D, layout=gl.SliceLayout(0, QOP))
    qs = qc // 16
    qp = 2 * (qs % 4) + (qc // 8) % 2
    qe = qc % 2
    if DEC_K != 1:  # (0 and 2 pair nibbles p, p + 4)
        nib = qp % 4 + 4 * qe
    else:
        nib = 4 * (qp % 2) + (qp % 4) // 2 + 2 * qe
    phys = (D // 4) * ((qc // 2) % 4) + 16 * (qs // 4) + 8 * (qp // 4) + nib
    # rows >= G are zero; bounded by the runtime ``group`` (= G), which the compiler cannot fold:
    # with the constant, ptxas re-creates q's zero registers before every MMA (~20 moves a tile)
    q = gl.load(
        Q + b * stride_qb + (hk * G + qr)[:, None] * stride_qh + phys[None, :],
        mask=(qr < group)[:, None],
        other=0.0,
    ).to(CDT)

    # the softmax's scores: S's rows 0..7 (G <= 8), or all 16 (``_fp4_softmax_layout``)
    S8: gl.constexpr = _fp4_softmax_layout(NH)
    sc = gl.arange(0, BN, layout=gl.SliceLayout(0, S8))
    kx_ptr = K.to(gl.pointer_type(gl.int64), bitcast=True) + hk * NBK
    if D == 64 and STAGES == 0:  # (V as 32-bit words: half a block per lane)
        vx_ptr = V.to(gl.pointer_type(gl.int32), bitcast=True) + hk * (2 * NBK)
    else:
        vx_ptr = V.to(gl.pointer_type(gl.int64), bitcast=True) + hk * NBK
    ks_ptr = KBS + hk * NBK
    vs_ptr = VBS + hk * NBK
    pt_row = PT + b.to(gl.int64) * stride_pt
    srk = stride_kr // 8
    if D == 64 and STAGES == 0:
        srv = stride_vr // 4
    else:
        srv = stride_vr // 8

    m_i = gl.full([NH], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S8))
    l_i = gl.zeros([NH], gl.float32, layout=gl.SliceLayout(1, S8))
    acc = gl.zeros([D, NH], gl.float32, layout=MMA)

    ptrs = (kx_ptr, vx_ptr, ks_ptr, vs_ptr)
    strides = (srk, srv, stride_ksr, stride_vsr)
    sm = (qk_scale, softcap, end, lo)
    if STAGES > 0:
        # ring of STAGES stages of SUB 16-token tiles in shared memory (PAGED only: one page id
        # per tile, loaded one iteration before its tile is issued). TMA: the data rows by TMA
        # boxes (one mbarrier per stage), the scale rows by cp.async; else all by cp.async
        SD: gl.constexpr = _fp4_row_swizzle(D)
        SS: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
        # copy layouts: K/V blocks as 16-byte pieces (D / 64 blocks per lane, KL), scale rows as
        # 4-byte pieces
        CS: gl.constexpr = _fp4_scale_copy_layout(D)
        NB: gl.constexpr = STAGES * SUB
        descs = None
        if TMA:
            # TMA's 64-byte swizzle is SD's (16-byte chunk c of row r at c ^ (r // 2) % 4)
            TL: gl.constexpr = gl.NVMMASharedLayout(
                swizzle_byte_width=_fp4_tma_swizzle(D), element_bitwidth=8, rank=2
            )
            bufs = (
                gl.allocate_shared_memory(gl.uint8, [NB, BN, D // 2], TL),
                gl.allocate_shared_memory(gl.uint8, [NB, BN, D // 2], TL),
                gl.allocate_shared_memory(gl.uint8, [NB, BN, NBK], SS),
                gl.allocate_shared_memory(gl.uint8, [NB, BN, NBK], SS),
            )
            bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            for j in gl.static_range(STAGES):
                mbarrier.init(bars.index(j), count=1)
            fence_async_shared()
            descs = (KD, VD, bars, hk * (D // 2))
        else:
            bufs = (
                gl.allocate_shared_memory(gl.int64, [NB, BN, NBK], SD),
                gl.allocate_shared_memory(gl.int64, [NB, BN, NBK], SD),
                gl.allocate_shared_memory(gl.uint8, [NB, BN, NBK], SS),
                gl.allocate_shared_memory(gl.uint8, [NB, BN, NBK], SS),
            )
        # tiles past the end (the ring's tail, splits without tiles) repeat the last 16-aligned
        # tile, so TMA boxes stay in the request's last page (an empty request: row 0 of page 0)
        last = gl.maximum(end - 1, 0) // BN * BN
        rd = gl.arange(0, BN, layout=gl.SliceLayout(1, KL))
        cd = gl.arange(0, NBK, layout=gl.SliceLayout(0, KL))
        rs = gl.arange(0, BN, layout=gl.SliceLayout(1, CS))
        cs = gl.arange(0, NBK, layout=gl.SliceLayout(0, CS))
        for j in gl.static_range(STAGES - 1):
            _expect(descs, j, SUB, TMA, D)
            for u in gl.static_range(SUB):
                sj = gl.minimum(start + (j * SUB + u) * BN, last)
                row0 = _tile_row0(sj, end, pt_row, page_shift, page_mask, True)
                _issue(
                    bufs, j * SUB + u, j, sj, end, lo, row0, ptrs, strides, rd, cd, rs, cs,
                    True, HAS_WINDOW, descs, TMA,
                )  # fmt: skip
            async_copy.commit_group()
        # the next stage's tiles and page ids (the second only with SUB 2)
        s_n = gl.minimum(start + (STAGES - 1) * SUB * BN, last)
        row_n = _tile_row0(s_n, end, pt_row, page_shift, page_mask, True)
        s_n2 = s_n
        row_n2 = row_n
        if SUB == 2:
            s_n2 = gl.minimum(start + ((STAGES - 1) * SUB + 1) * BN, last)
            row_n2 = _tile_row0(s_n2, end, pt_row, page_shift, page_mask, True)
        i = 0
        for s in range(start, end, BN * SUB):
            gl.thread_barrier()  # every lane is done with the stage refilled now
            if TMA:  # (ordinary shared-memory reads of that stage, then async-proxy writes)
                fence_async_shared()
            fill = (i + STAGES - 1) % STAGES
            _expect(descs, fill, SUB, TMA, D)
            _issue(
                bufs, fill * SUB, fill, s_n, end, lo, row_n, ptrs, strides, rd, cd, rs, cs,
                False, HAS_WINDOW, descs, TMA,
            )  # fmt: skip
            if SUB == 2:
                _issue(
                    bufs, fill * SUB + 1, fill, s_n2, end, lo, row_n2, ptrs, strides, rd, cd,
                    rs, cs, False, HAS_WINDOW, descs, TMA,
                )  # fmt: skip
            async_copy.commit_group()
            s_n = gl.minimum(s + STAGES * SUB * BN, last)
            row_n = _tile_row0(s_n, end, pt_row, page_shift, page_mask)
            if SUB == 2:
                s_n2 = gl.minimum(s + (STAGES * SUB + 1) * BN, last)
                row_n2 = _tile_row0(s_n2, end, pt_row, page_shift, page_mask)
            async_copy.wait_group(STAGES - 1)
            gl.thread_barrier()  # the tile, copied by every lane, is visible
            st = i % STAGES
            if TMA:
                mbarrier.wait(bars.index(st), (i // STAGES) & 1)
            i += 1
            kx, ks = _smem_tile(bufs, 0, st * SUB, KL, SD, TMA, D)
            if ABLATE == 1:  # benchmarks only: the loads, no math (the result is wrong)
                vx, vs = _smem_tile(bufs, 1, st * SUB, VL, SD, TMA, D)
                acc = acc + _checksum(kx, ks, vx, vs)
                if SUB == 2:
                    kx, ks = _smem_tile(bufs, 0, st * SUB + 1, KL, SD, TMA, D)
                    vx, vs = _smem_tile(bufs, 1, st * SUB + 1, VL, SD, TMA, D)
                    acc = acc + _checksum(kx, ks, vx, vs)
            else:
                sa = _scores(
                    q, kx, ks, s, sc, sm, MMA, KOP, S8, DEC_K, HAS_SOFTCAP, HAS_WINDOW, D, NH
                )
                if SUB == 2:
                    kx, ks = _smem_tile(bufs, 0, st * SUB + 1, KL, SD, TMA, D)
                    sb = _scores(
                        q, kx, ks, s + BN, sc, sm, MMA, KOP, S8, DEC_K, HAS_SOFTCAP, HAS_WINDOW,
                        D, NH,
                    )  # fmt: skip
                    m_new = gl.maximum(m_i, gl.max(gl.maximum(sa, sb), axis=1))
                else:
                    m_new = gl.maximum(m_i, gl.max(sa, axis=1))
                m_i, l_i, acc = _rescale(m_i, l_i, acc, m_new, RESCALE, MMA)
                pa = _exp2(sa - m_i[:, None])
                vx, vs = _smem_tile(bufs, 1, st * SUB, VL, SD, TMA, D)
                acc = _pv(acc, vx, vs, pa, VOP, POP, CDT, DEC_V, D)
                if SUB == 2:
                    pb = _exp2(sb - m_i[:, None])
                    l_i = l_i + gl.sum(pa + pb, axis=1)
                    vx, vs = _smem_tile(bufs, 1, st * SUB + 1, VL, SD, TMA, D)
                    acc = _pv(acc, vx, vs, pb, VOP, POP, CDT, DEC_V, D)
                else:
                    l_i = l_i + gl.sum(pa, axis=1)
        # the STAGES - 1 stages issued past the last tile: no copy may land in shared memory
        # after the program exits (another program on the SM may own those bytes then)
        async_copy.wait_group(0)
        if TMA:
            for j in gl.static_range(STAGES - 1):
                mbarrier.wait(bars.index((i + j) % STAGES), ((i + j) // STAGES) & 1)
            for j in gl.static_range(STAGES):
                mbarrier.invalidate(bars.index(j))
    else:
        # (a split past the end, or an empty request, reads the last row, or row 0 of page 0)
        # (head_dim 64: V's rows and blocks from its 3-D layout's scale slice)
        VR: gl.constexpr = _fp4_v_rowcol_layout(D)
        VH: gl.constexpr = VL if D == 64 else None
        kr = gl.arange(0, BN, layout=gl.SliceLayout(1, KL))
        kc = gl.arange(0, NBK, layout=gl.SliceLayout(0, KL))
        vr = gl.arange(0, BN, layout=gl.SliceLayout(1, VR))
        vc = gl.arange(0, NBK, layout=gl.SliceLayout(0, VR))
        s0 = gl.maximum(gl.minimum(start, end - 1), 0)
        kx_n, ks_n, vx_n, vs_n = _load_kv(
            ptrs, strides, s0, end, lo, pt_row, page_shift, page_mask, kr, kc, vr, vc, PAGED, True,
            HAS_WINDOW, VH,
        )  # fmt: skip
        for s in range(start, end, BN):
            kx, ks, vx, vs = kx_n, ks_n, vx_n, vs_n
            # the next tile (past ``end`` it re-reads this tile's last row; its result is unused)
            nxt = gl.minimum(s + BN, end - 1)
            kx_n, ks_n, vx_n, vs_n = _load_kv(
                ptrs, strides, nxt, end, lo, pt_row, page_shift, page_mask, kr, kc, vr, vc, PAGED,
                False, HAS_WINDOW, VH,
            )  # fmt: skip
            if ABLATE == 1:  # benchmarks only: the loads, no math (the result is wrong)
                acc = acc + _checksum(kx, ks, vx, vs)
            else:
                sa = _scores(
                    q, kx, ks, s, sc, sm, MMA, KOP, S8, DEC_K, HAS_SOFTCAP, HAS_WINDOW, D, NH
                )
                m_new = gl.maximum(m_i, gl.max(sa, axis=1))
                m_i, l_i, acc = _rescale(m_i, l_i, acc, m_new, RESCALE, MMA)
                pa = _exp2(sa - m_i[:, None])
                l_i = l_i + gl.sum(pa, axis=1)
                acc = _pv(acc, vx, vs, pa, VOP, POP, CDT, DEC_V, D)

    # acc is [value dim (logical), head]: logical 16m + 8r + g -> stored 16g + 2m + r
    l8 = gl.convert_layout(l_i, gl.SliceLayout(0, MMA))
    m8 = gl.convert_layout(m_i, gl.SliceLayout(0, MMA))
    orow = gl.arange(0, D, layout=gl.SliceLayout(1, MMA))
    ocol = gl.arange(0, NH, layout=gl.SliceLayout(0, MMA))
    dv = (D // 8) * (orow % 8) + 2 * (orow // 16) + (orow // 8) % 2
    hmask = ocol < G
    l_safe = gl.where(l8 > 0, l8, 1.0)
    heads = hk * G + ocol
    if FINAL:
        if HAS_SINKS:
            acc, l8 = _fold_sinks(acc, l8, m8, SINKS, heads, hmask)
            l_safe = gl.where(l8 > 0, l8, 1.0)
        if MX:
            vf = 1.0
        else:
            vf = gl.load(VSC) * VMUL
        o = acc * (vf / l_safe)[None, :]
        _store_out(OUT, o, b, heads, hmask, dv, stride_ob, stride_oh)
    else:
        # partial outputs in the units of the merge (decode.merge_kernel: E2M1 / 64)
        o = acc * (PMUL / l_safe)[None, :]
        _store_partial(PO, PL, o, l8, m8, b, heads, hmask, dv, split, num_splits, G, HEAD_FAST)
