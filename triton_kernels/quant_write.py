"""Quantized KV write: one fused kernel per layer call (K and V, data and every block-scale layout).

``@triton.jit`` code only; the launcher, its checks and the layout documentation live in
``kvpool.write``. The numerics follow ``kvpool.formats`` (the reference) bit for bit:

- fp8, E2M1 and the e4m3 block scales of nvfp4 are encoded with integer and exact fp32
  arithmetic (round to nearest even, saturating: fp8 by rounding the fp32 bits, E2M1 and e4m3
  by one fp32 addition of a power of two whose ulp is the target's quantum), never with a
  float -> fp8 cast, whose overflow and rounding differ between Triton versions, the CPU
  interpreter and the hardware;
- divisions give the IEEE round-to-nearest quotient, as torch divides: one ``tl.math.div_rn`` per
  scale for its reciprocal, then a multiply and one FMA correction per element (``_div``);
- FP4 tiles without NaN or out-of-range blocks take a short path (``_quant_fp4``); min / max are
  the NaN-ignoring ones (hardware min.f32 / max.f32, the interpreter's fmin / fmax), which the
  NaN and inf rules rely on;
- bytes are stored through uint8 views, so no fp8 dtype appears in a kernel signature (portable
  across Triton 3.6 .. 3.9).

MODE (constexpr): 0 plain cast (fp32/bf16/fp16 pools), 1 fp8_e4m3, 2 fp8_e5m2, 3 nvfp4,
4 fp4_mx_block16.
"""

import triton
import triton.language as tl


@triton.jit
def _rne_code(a, MBITS: tl.constexpr, BIAS: tl.constexpr):
    """Magnitude code (exponent and mantissa bits, no sign) of a minifloat with MBITS mantissa
    bits and exponent bias BIAS, for fp32 ``a`` >= 0 already clamped to the format's max.
    Round to nearest, ties to even. Subnormal range: fp32 addition of a magic number whose ulp is
    the target's quantum (IEEE add rounds to nearest even); normal range: integer rounding of the
    fp32 bits to MBITS mantissa bits."""
    SHIFT: tl.constexpr = 23 - MBITS
    HALF_M1: tl.constexpr = (1 << (SHIFT - 1)) - 1
    REBIAS: tl.constexpr = (127 - BIAS) << MBITS
    MAGIC_EXP: tl.constexpr = 1 - BIAS - MBITS + 23
    MAGIC_BITS: tl.constexpr = (MAGIC_EXP + 127) << 23
    bits = a.to(tl.int32, bitcast=True)
    code_n = ((bits + HALF_M1 + ((bits >> SHIFT) & 1)) >> SHIFT) - REBIAS
    magic = tl.full(a.shape, MAGIC_BITS, tl.int32).to(tl.float32, bitcast=True)
    code_s = (a + magic).to(tl.int32, bitcast=True) - MAGIC_BITS
    min_normal = tl.full(a.shape, (128 - BIAS) << 23, tl.int32).to(tl.float32, bitcast=True)
    return tl.where(a < min_normal, code_s, code_n)


@triton.jit
def _div(x, b, r):
    """IEEE round-to-nearest ``x / b`` for ``b`` > 0 given ``r = div_rn(1, b)`` (b, r broadcast to
    x): ``q = x * r`` then one FMA correction (Markstein), which is correctly rounded when no
    underflow or overflow happens. Quotients of magnitude >= 2^20 skip the correction (every
    format here saturates far below that, and inf / NaN pass through); subnormal quotients may
    differ from the IEEE ones in their last bits but encode to zero either way."""
    q0 = x * r
    e = tl.fma(-q0, b, x)
    q1 = tl.fma(e, r, q0)
    return tl.where(tl.abs(q0) < 1048576.0, q1, q0)


@triton.jit
def _store_block_scales(
    bs_ptr,
    bs_row_stride,
    pm_ptr,
    slot,
    row_ok,
    sbyte,
    H: tl.constexpr,
    D: tl.constexpr,
    PAGE: tl.constexpr,
    NB: tl.constexpr,
    WRITE_LINEAR: tl.constexpr,
    WRITE_PM: tl.constexpr,
    INTERLEAVE: tl.constexpr,
):
    """Store ``sbyte`` [BLOCK_T, NB] (column b = head * (D/16) + j) in each scale layout."""
    b = tl.arange(0, NB)
    b_ok = row_ok[:, None] & (b < H * D // 16)[None, :]
    sb = sbyte.to(tl.uint8)
    if WRITE_LINEAR:
        tl.store(bs_ptr + slot[:, None] * bs_row_stride + b[None, :], sb, mask=b_ok)
    if WRITE_PM:
        DB: tl.constexpr = D // 16
        page = slot // PAGE
        off = slot % PAGE
        bh = b // DB
        bj = b % DB
        base = (page[:, None] * H + bh[None, :]) * (PAGE * DB)
        if INTERLEAVE:
            inner = ((off[:, None] // 4) * DB + bj[None, :]) * 4 + off[:, None] % 4
        else:
            inner = off[:, None] * DB + bj[None, :]
        tl.store(pm_ptr + base + inner, sb, mask=b_ok)


@triton.jit
def _unpack_pair(w, IN_KIND: tl.constexpr):
    """One word of two consecutive input elements -> (element 2i, element 2i+1) as fp32.
    IN_KIND: 0 bf16 pair in an int32, 1 fp16 pair in an int32, 2 fp32 pair in an int64."""
    if IN_KIND == 0:
        lo = (w << 16).to(tl.float32, bitcast=True)
        hi = (w & -65536).to(tl.float32, bitcast=True)
    elif IN_KIND == 1:
        lo = w.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        lo = w.to(tl.int32).to(tl.float32, bitcast=True)
        hi = (w >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    return lo, hi


@triton.jit
def _e2m1_top(p, smask):
    """E2M1 code of ``p`` (fp32 in [0, 6], no NaN) in bits 28-30 of a uint32, OR-ed with
    ``smask`` (the sign in bit 31, or 0); every other bit is zero.

    Round to nearest even at E2M1's quantum 2^(E-1), E = max(floor(log2 p), 0), by one fp32
    addition of M = 2^(E+22), whose ulp is that quantum: y = p + M holds k = RN(p / quantum) in
    its low bits, and the code is k + 2E. Shifted to bit 28, every higher bit of y and M leaves
    the 32-bit word: with m = (E + 127) << 23, (y << 28) + (m << 6) + 2^29 = (k + 2E) << 28
    (E = 0: m << 6 = 0xE0000000; E = 1: 0; E = 2: 0x20000000; all mod 2^32)."""
    b = p.to(tl.uint32, bitcast=True)
    m = tl.maximum(b & 0x7F800000, 0x3F800000)
    y = p + (m + 0x0B000000).to(tl.float32, bitcast=True)
    code = (y.to(tl.uint32, bitcast=True) << 28) + (m << 6) + 0x20000000
    return code | smask


@triton.jit
def _e4m3_rne(s):
    """(e4m3 code, its value) of fp32 ``s`` in [0, 448] (no NaN), round to nearest even.

    As in ``_e2m1_top``: e4m3's quantum is 2^(E-3), E = max(floor(log2 s), -6); y = s + M with
    M = 2^(E+20) rounds s to it, k = bits(y) - bits(M) counts quanta, the code is
    k + 8 (E + 6) (normal: 8 (E + 7) + mantissa, k = 8 + mantissa; subnormal: k), and the value
    is y - M (exact)."""
    b = s.to(tl.int32, bitcast=True)
    m = tl.maximum(b & 0x7F800000, 121 << 23)
    mm = m + (20 << 23)
    mf = mm.to(tl.float32, bitcast=True)
    y = s + mf
    code = y.to(tl.int32, bitcast=True) - mm + (m >> 20) - 8 * 121
    return code, y - mf


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _fp4_params(amax, scale_ptr, MODE: tl.constexpr, SAFE: tl.constexpr):
    """Per-block parameters of an FP4 tile from its block amax [BLOCK_T, NB].

    Returns (scale byte, sign mask, divisor, multiplier, bad): the element quotient is
    x * multiplier (mx: the exact power of two) or x / divisor (nvfp4, with multiplier
    RN(1 / divisor) for the Markstein correction); the sign mask is 0 for nvfp4 blocks whose
    scale rounds to 0 (they store zeros). ``bad`` marks blocks the short path must not take:
    a NaN amax (``amax`` is NaN-propagating there), and blocks where an element's quotient
    could reach 7, so that it would need the clamp to 6 (mx: amax above MX_MAX, inf included,
    or the one subnormal amax whose exponent rounds down; nvfp4: an e4m3 scale that is
    subnormal (relative rounding error up to 1/2) or saturated). Elsewhere every quotient is
    at most 6 (mx) or 6 / (1 - 2^-4) < 7 (nvfp4), and the E2M1 rounding of (6, 7) is 6."""
    if MODE == 3:  # +-inf counts as +-FLT_MAX: the block scale saturates at 448
        nan_blk = amax != amax  # before the NaN-ignoring clamp below, which maps NaN to FLT_MAX
        amax = tl.minimum(amax, 3.4028234663852886e38)
        g = tl.load(scale_ptr)
        gb = tl.full(amax.shape, 1.0, tl.float32) * g
        rgb = tl.math.div_rn(tl.full((1, 1), 1.0, tl.float32), tl.full((1, 1), 1.0, tl.float32) * g)
        rgb = rgb + tl.zeros(amax.shape, tl.float32)
        if SAFE:
            a6 = tl.math.div_rn(amax, tl.full(amax.shape, 6.0, tl.float32))
        else:
            # amax / 6 by multiply + FMA correction: correctly rounded unless the quotient is
            # subnormal, which the caller excludes (g >= 2^-90: s = RN(a6 / g) then stays far
            # below e4m3's smallest step, whatever a6's last bits)
            q6 = amax * 0.16666667163372040
            a6 = tl.fma(tl.fma(-q6, 6.0, amax), 0.16666667163372040, q6)
        # (amax / 6) / g, correctly rounded: an overflowing quotient is NaN after the
        # correction, and min(NaN, 448) = 448
        if SAFE:
            # any g: 1 / g may be subnormal (g > 2^126) or overflow (subnormal g), where the
            # FMA correction below is not exact
            s_raw = tl.math.div_rn(a6, gb)
        else:
            q0 = a6 * rgb
            s_raw = tl.fma(tl.fma(-q0, gb, a6), rgb, q0)
        s_code, s_dec = _e4m3_rne(tl.minimum(s_raw, 448.0))
        zero_blk = s_dec == 0.0
        denom = tl.where(zero_blk, 1.0, s_dec * gb)
        r = tl.math.div_rn(tl.full(denom.shape, 1.0, tl.float32), denom)
        r = tl.where(zero_blk, 0.0, r)  # zero block: every quotient is 0 ...
        smask = tl.where(zero_blk, 0, 0x80000000).to(tl.uint32)  # ... and no sign is stored
        bad = ~zero_blk & ((s_dec < 0.015625) | ~(s_raw <= 448.0))
        return s_code, smask, denom, r, bad | nan_blk
    else:  # mx: inputs clamp to +-MX_MAX = 6 * 2^125 (so does the amax)
        bad = ~(amax <= 2.5521177519070385e38)  # NaN or above MX_MAX
        amax = tl.minimum(amax, 2.5521177519070385e38)
        # stored = ceil(log2(RN(amax / 6))) + 127 from amax's bits: the smallest k with
        # amax <= 6 * 2^k is E - 2 if the mantissa is <= 1.5 else E - 1 (RN cannot cross a power
        # of two: no fp32 amax lies in (6 * 2^k, 6 * 2^k * (1 + 2^-24)]). Exact while amax / 6
        # is normal; below, only amax = 3 * 2^-126 + 2^-148 (bits 0x01400001) differs: its
        # quotient rounds down to 2^-127 (stored 0, not 1). Clamped to [0, 254]; 127 for 0.
        ab = amax.to(tl.int32, bitcast=True)
        edge = ab == 0x01400001
        stored = ((ab + 0x3FFFFF) >> 23) - 2 - edge.to(tl.int32)
        stored = tl.minimum(tl.maximum(stored, 0), 254)
        stored = tl.where(amax == 0.0, 127, stored)
        # 2^(127 - stored): stored <= 252 after the MX_MAX clamp, so the factor is normal
        inv = ((254 - stored) << 23).to(tl.float32, bitcast=True)
        smask = tl.full(amax.shape, 0x80000000, tl.uint32)
        return stored, smask, inv, inv, bad | edge


@triton.jit
def _fp4_store(
    lo,
    hi,
    sbyte,
    smask,
    den,
    r,
    slot,
    row_ok,
    m3,
    pair,
    data_ptr,
    data_row_stride,
    bs_ptr,
    bs_row_stride,
    pm_ptr,
    H: tl.constexpr,
    D: tl.constexpr,
    PAGE: tl.constexpr,
    NB: tl.constexpr,
    MODE: tl.constexpr,
    WRITE_LINEAR: tl.constexpr,
    WRITE_PM: tl.constexpr,
    INTERLEAVE: tl.constexpr,
    SAFE: tl.constexpr,
    ABLATE: tl.constexpr,
):
    """Encode and store one FP4 tile; ``lo`` / ``hi`` [BLOCK_T, NB, 8] are the pairs' two
    elements (fp32), the per-block parameters come from ``_fp4_params``.

    SAFE = False (no block is ``bad``): |x| and the sign bit of x are used as they are and the
    quotient needs no clamp. SAFE = True: NaN elements encode as +0 (max(|x|, 0) maps NaN to 0;
    the sign comes from min(x, FLT_MAX), which maps NaN to +FLT_MAX and keeps every other sign,
    -0 included), and quotients clamp to 6; an inf's nvfp4 quotient is NaN after the correction
    and min(NaN, 6) = 6 (the hardware min and the interpreter's fmin return the non-NaN
    operand)."""
    # the scale bytes first: they are dead before the elements are encoded (fewer registers)
    if ABLATE == 0 or ABLATE == 3:
        _store_block_scales(
            bs_ptr,
            bs_row_stride,
            pm_ptr,
            slot,
            row_ok,
            sbyte,
            H,
            D,
            PAGE,
            NB,
            WRITE_LINEAR,
            WRITE_PM,
            INTERLEAVE,
        )
    sm3 = smask[:, :, None]
    r3 = r[:, :, None]
    if ABLATE == 2:
        byte = (lo + hi).to(tl.int32, bitcast=True) ^ sm3.to(tl.int32, bitcast=True)
    else:
        if SAFE:
            a_lo = tl.maximum(tl.abs(lo), 0.0)
            a_hi = tl.maximum(tl.abs(hi), 0.0)
            s_lo = tl.minimum(lo, 3.4028234663852886e38).to(tl.uint32, bitcast=True) & sm3
            s_hi = tl.minimum(hi, 3.4028234663852886e38).to(tl.uint32, bitcast=True) & sm3
        else:
            a_lo = tl.abs(lo)
            a_hi = tl.abs(hi)
            s_lo = lo.to(tl.uint32, bitcast=True) & sm3
            s_hi = hi.to(tl.uint32, bitcast=True) & sm3
        if MODE == 3 and SAFE:
            # div_rn: the divisor s * g may be subnormal (g < 2^-117), its reciprocal inf;
            # r = 0 marks zero blocks (quotient 0)
            den3 = tl.broadcast_to(den[:, :, None], a_lo.shape)
            q_lo = tl.where(r3 == 0.0, 0.0, tl.math.div_rn(a_lo, den3))
            q_hi = tl.where(r3 == 0.0, 0.0, tl.math.div_rn(a_hi, den3))
        elif MODE == 3:
            den3 = den[:, :, None]
            q_lo = a_lo * r3
            q_hi = a_hi * r3
            q_lo = tl.fma(tl.fma(-q_lo, den3, a_lo), r3, q_lo)
            q_hi = tl.fma(tl.fma(-q_hi, den3, a_hi), r3, q_hi)
        else:
            q_lo = a_lo * r3
            q_hi = a_hi * r3
        if SAFE:
            q_lo = tl.minimum(q_lo, 6.0)
            q_hi = tl.minimum(q_hi, 6.0)
        n_lo = _e2m1_top(q_lo, s_lo)
        n_hi = _e2m1_top(q_hi, s_hi)
        byte = (n_lo >> 28) + (n_hi >> 24)  # nibble(2i) | nibble(2i + 1) << 4
    dst = slot[:, None, None] * data_row_stride + pair[None, :, :]
    tl.store(data_ptr + dst, byte.to(tl.uint8), mask=m3)


@triton.jit
def _quant_fp4(
    w_ptr,
    stride_wt,
    stride_wh,
    slot,
    t,
    row_ok,
    data_ptr,
    data_row_stride,
    bs_ptr,
    bs_row_stride,
    pm_ptr,
    scale_ptr,
    H: tl.constexpr,
    D: tl.constexpr,
    PAGE: tl.constexpr,
    MODE: tl.constexpr,
    WRITE_LINEAR: tl.constexpr,
    WRITE_PM: tl.constexpr,
    INTERLEAVE: tl.constexpr,
    IN_KIND: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    ABLATE: tl.constexpr,
):
    """FP4 tile as [BLOCK_T, NB blocks, 8 pairs]: each pair (elements 2i, 2i+1) is one loaded
    word and gives one stored byte; a thread holds whole blocks (the amax needs no shuffles).

    The block amax is taken NaN-propagating and the per-block parameters flag the blocks the
    short path cannot take (``_fp4_params``); one count per program decides: the common tile
    (no flagged block; nvfp4 also 2^-90 <= g <= 2^100) takes the short path, any other the exact
    sanitizing one (``_fp4_store``, SAFE). ABLATE (benchmarks only): 1 skips the block-scale
    stores, 2 also replaces the element encoding by a trivial combination of the inputs, 3
    takes the short path without the check (wrong for NaN and the flagged blocks)."""
    NB: tl.constexpr = BLOCK_C // 16
    DB: tl.constexpr = D // 16
    b = tl.arange(0, NB)
    w8 = tl.arange(0, 8)
    pair = b[:, None] * 8 + w8[None, :]  # [NB, 8]: pair index within the token (all heads)
    # a block never straddles heads: head and in-head offset come from the block index alone,
    # so the 8 words of a block are provably contiguous and aligned (vectorized 16-byte loads)
    in_head = (b % DB) * 8
    m3 = row_ok[:, None, None] & (b < H * DB)[None, :, None]
    off = (
        t.to(tl.int64)[:, None, None] * stride_wt
        + ((b // DB) * stride_wh + in_head)[None, :, None]
        + w8[None, None, :]
    )
    w = tl.load(w_ptr + off, mask=m3, other=0)
    lo, hi = _unpack_pair(w, IN_KIND)
    amax = tl.reduce(_max_nan(tl.abs(lo), tl.abs(hi)), 2, _max_nan)  # [BLOCK_T, NB]
    sbyte, smask, den, r, bad = _fp4_params(amax, scale_ptr, MODE, False)
    fast = (tl.sum(tl.sum(bad.to(tl.int32), axis=1), axis=0) == 0) | (ABLATE == 3)
    if MODE == 3:
        # the short path divides without div_rn: 1 / g must be normal (g <= 2^100), and for
        # quotients s >= 2^-10 (where e4m3 stops rounding to 0) the residual of the FMA
        # correction of a6 / g must be exact, a multiple of ulp(s) * ulp(g) >= 2^-149: g >= 2^-93
        # (at g = 2^-100 the interpreter shows 1-ulp errors of s near 2^-10)
        g_fast = tl.load(scale_ptr)
        fast = fast & (g_fast >= 8.077935669463161e-28) & (g_fast <= 1.2676506002282294e30)
    if fast:
        _fp4_store(
            lo, hi, sbyte, smask, den, r, slot, row_ok, m3, pair, data_ptr, data_row_stride,
            bs_ptr, bs_row_stride, pm_ptr, H, D, PAGE, NB, MODE, WRITE_LINEAR, WRITE_PM,
            INTERLEAVE, False, ABLATE,
        )  # fmt: skip
    else:
        amax = tl.maximum(tl.max(tl.maximum(tl.abs(lo), tl.abs(hi)), axis=2), 0.0)
        sbyte, smask, den, r, bad = _fp4_params(amax, scale_ptr, MODE, True)
        _fp4_store(
            lo, hi, sbyte, smask, den, r, slot, row_ok, m3, pair, data_ptr, data_row_stride,
            bs_ptr, bs_row_stride, pm_ptr, H, D, PAGE, NB, MODE, WRITE_LINEAR, WRITE_PM,
            INTERLEAVE, True, ABLATE,
        )  # fmt: skip


@triton.jit
def _quant_tensor(
    x_ptr,
    stride_xt,
    stride_xh,
    stride_xd,
    loc_ptr,
    T,
    R,
    data_ptr,
    data_row_stride,
    bs_ptr,
    bs_row_stride,
    pm_ptr,
    scale_ptr,
    pid_t,
    H: tl.constexpr,
    D: tl.constexpr,
    PAGE: tl.constexpr,
    MODE: tl.constexpr,
    WRITE_LINEAR: tl.constexpr,
    WRITE_PM: tl.constexpr,
    INTERLEAVE: tl.constexpr,
    IN_KIND: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    ABLATE: tl.constexpr,
):
    """Quantize BLOCK_T tokens x all heads of one tensor (K or V) and store them at their slots.
    FP4 modes take ``x`` as words of two elements (strides in words, ``stride_xd`` unused)."""
    HD: tl.constexpr = H * D
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < T
    slot = tl.load(loc_ptr + t, mask=t_ok, other=-1).to(tl.int64)
    # out-of-range slots are skipped (no write); the debug mode and the CPU path raise instead
    row_ok = t_ok & (slot >= 0) & (slot < R)
    if MODE >= 3:
        _quant_fp4(
            x_ptr,
            stride_xt,
            stride_xh,
            slot,
            t,
            row_ok,
            data_ptr,
            data_row_stride,
            bs_ptr,
            bs_row_stride,
            pm_ptr,
            scale_ptr,
            H,
            D,
            PAGE,
            MODE,
            WRITE_LINEAR,
            WRITE_PM,
            INTERLEAVE,
            IN_KIND,
            BLOCK_T,
            BLOCK_C,
            ABLATE,
        )
    else:
        c = tl.arange(0, BLOCK_C)
        c_ok = c < HD
        head = c // D
        d = c % D
        x_off = t.to(tl.int64)[:, None] * stride_xt + (head * stride_xh + d * stride_xd)[None, :]
        m2 = row_ok[:, None] & c_ok[None, :]
        x = tl.load(x_ptr + x_off, mask=m2, other=0.0)
        dst = slot[:, None] * data_row_stride + c[None, :]
        if MODE == 0:
            # saturate as formats.quantize: a finite input beyond the cache dtype's max (fp32 or
            # bf16 into fp16, fp32 into bf16) would round to Inf in the cast; NaN and +-Inf
            # pass unchanged, as the plain cast keeps them
            if data_ptr.dtype.element_ty == tl.float16:
                if x.dtype != tl.float16:
                    x = _saturate(x.to(tl.float32), 65504.0)
            elif data_ptr.dtype.element_ty == tl.bfloat16:
                if x.dtype == tl.float32:
                    x = _saturate(x, 3.3895313892515355e38)
            tl.store(data_ptr + dst, x.to(data_ptr.dtype.element_ty), mask=m2)
        else:
            xf = x.to(tl.float32)
            s = tl.load(scale_ptr)
            ones = tl.full(xf.shape, 1.0, tl.float32)
            r = tl.math.div_rn(
                tl.full((1, 1), 1.0, tl.float32), tl.full((1, 1), 1.0, tl.float32) * s
            )
            y = _div(xf, ones * s, ones * r)
            sign = (xf.to(tl.int32, bitcast=True) >> 31) & 1
            if MODE == 1:
                code = _rne_code(tl.minimum(tl.abs(y), 448.0), 3, 7)
            else:
                code = _rne_code(tl.minimum(tl.abs(y), 57344.0), 2, 15)
            b = tl.where(y != y, 0x7F, code | (sign << 7))
            tl.store(data_ptr + dst, b.to(tl.uint8), mask=m2)


@triton.jit
def _saturate(x, m):
    """fp32 ``x`` with finite values beyond +-``m`` set to +-``m``; NaN and +-Inf unchanged."""
    over = (tl.abs(x) > m) & (tl.abs(x) < float("inf"))
    return tl.where(over, tl.where(x > 0, m, -m), x)


# The token count changes every step (T = 1 would even become a constant): not specialized, so
# one compile serves every batch (issue 22). Row counts and strides are fixed per pool/model.
DO_NOT_SPECIALIZE = ("T",)


@triton.jit(do_not_specialize=DO_NOT_SPECIALIZE)
def quant_write_kernel(
    loc_ptr,
    T,
    R,
    k_ptr,
    k_st,
    k_sh,
    k_sd,
    kd_ptr,
    kd_row,
    kbs_ptr,
    kbs_row,
    kpm_ptr,
    ks_ptr,
    v_ptr,
    v_st,
    v_sh,
    v_sd,
    vd_ptr,
    vd_row,
    vbs_ptr,
    vbs_row,
    vpm_ptr,
    vs_ptr,
    H: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    PAGE: tl.constexpr,
    MODE: tl.constexpr,
    WRITE_LINEAR: tl.constexpr,
    WRITE_PM: tl.constexpr,
    K_KIND: tl.constexpr,
    V_KIND: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_CK: tl.constexpr,
    BLOCK_CV: tl.constexpr,
    ABLATE: tl.constexpr = 0,
):
    """Grid ``(cdiv(T, BLOCK_T), 2)`` (axis 1: 0 = K, 1 = V; MLA: 1 program row, K only)."""
    pid_t = tl.program_id(0)
    if tl.program_id(1) == 0:
        _quant_tensor(
            k_ptr,
            k_st,
            k_sh,
            k_sd,
            loc_ptr,
            T,
            R,
            kd_ptr,
            kd_row,
            kbs_ptr,
            kbs_row,
            kpm_ptr,
            ks_ptr,
            pid_t,
            H,
            DK,
            PAGE,
            MODE,
            WRITE_LINEAR,
            WRITE_PM,
            False,
            K_KIND,
            BLOCK_T,
            BLOCK_CK,
            ABLATE,
        )
    else:
        _quant_tensor(
            v_ptr,
            v_st,
            v_sh,
            v_sd,
            loc_ptr,
            T,
            R,
            vd_ptr,
            vd_row,
            vbs_ptr,
            vbs_row,
            vpm_ptr,
            vs_ptr,
            pid_t,
            H,
            DV,
            PAGE,
            MODE,
            WRITE_LINEAR,
            WRITE_PM,
            True,
            V_KIND,
            BLOCK_T,
            BLOCK_CV,
            ABLATE,
        )
