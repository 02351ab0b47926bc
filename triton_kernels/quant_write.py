"""Quantized KV write: one fused kernel per layer call (K and V, data and every block-scale layout).

``@triton.jit`` code only; the launcher, its checks and the layout documentation live in
``kvpool.write``. The numerics follow ``kvpool.formats`` (the reference) bit for bit:

- fp8 and the e4m3 block scales of nvfp4 are encoded with integer arithmetic on the fp32 bits
  (round to nearest even, saturating), never with a float -> fp8 cast, whose overflow and
  rounding differ between Triton versions, the CPU interpreter and the hardware;
- divisions give the IEEE round-to-nearest quotient, as torch divides: one ``tl.math.div_rn`` per
  scale for its reciprocal, then a multiply and one FMA correction per element (``_div``);
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
def _e4m3_value(code):
    """Non-negative e4m3 code (int32, < 0x7F) -> its fp32 value (exact)."""
    e = code >> 3
    m = code & 7
    normal = ((e + 120) << 23) | (m << 20)
    sub = m.to(tl.float32) * 0.001953125  # m * 2^-9
    return tl.where(e == 0, sub, normal.to(tl.float32, bitcast=True))


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
def _e2m1_nibble(q, x):
    """E2M1 code (nibble) of ``q`` (already divided by the block scale), sign from ``x``."""
    sign = (x.to(tl.int32, bitcast=True) >> 28) & 8
    return _rne_code(tl.minimum(tl.abs(q), 6.0), 1, 1) | sign


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
):
    """FP4 tile as [BLOCK_T, NB blocks, 8 pairs]: each pair (elements 2i, 2i+1) is one loaded
    word, so packing nibbles needs no reshape or split; block amax is a reduction over axis 2."""
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
    lo = tl.where(lo != lo, 0.0, lo)  # FP4 has no NaN: NaN -> 0
    hi = tl.where(hi != hi, 0.0, hi)
    if MODE == 3:  # +-inf -> +-FLT_MAX: the block scale saturates at 448
        lo = tl.minimum(tl.maximum(lo, -3.4028234663852886e38), 3.4028234663852886e38)
        hi = tl.minimum(tl.maximum(hi, -3.4028234663852886e38), 3.4028234663852886e38)
    else:  # +-MX_MAX = 6 * 2^125: the largest magnitude whose block decodes finite in fp32
        lo = tl.minimum(tl.maximum(lo, -2.5521177519070385e38), 2.5521177519070385e38)
        hi = tl.minimum(tl.maximum(hi, -2.5521177519070385e38), 2.5521177519070385e38)
    amax = tl.max(tl.maximum(tl.abs(lo), tl.abs(hi)), axis=2)  # [BLOCK_T, NB]
    if MODE == 3:
        g = tl.load(scale_ptr)
        gb = tl.full(amax.shape, 1.0, tl.float32) * g
        s = tl.math.div_rn(tl.math.div_rn(amax, tl.full(amax.shape, 6.0, tl.float32)), gb)
        s_code = _rne_code(tl.minimum(s, 448.0), 3, 7)
        s_dec = _e4m3_value(s_code)
        zero_blk = s_dec == 0.0
        denom = tl.where(zero_blk, 1.0, s_dec * gb)
        r = tl.math.div_rn(tl.full(denom.shape, 1.0, tl.float32), denom)
        den3 = tl.broadcast_to(denom[:, :, None], lo.shape)
        r3 = tl.broadcast_to(r[:, :, None], lo.shape)
        q_lo = _div(lo, den3, r3)
        q_hi = _div(hi, den3, r3)
        sbyte = s_code
    else:
        rq = tl.math.div_rn(amax, tl.full(amax.shape, 6.0, tl.float32))
        rb = rq.to(tl.int32, bitcast=True)
        e_field = (rb >> 23) & 0xFF
        mant = rb & 0x7FFFFF
        stored = tl.where(
            e_field == 0, (mant > 0x400000).to(tl.int32), e_field + (mant != 0).to(tl.int32)
        )
        stored = tl.minimum(stored, 254)
        stored = tl.where(amax == 0.0, 127, stored)
        # 2^(127 - stored): stored <= 252 after the MX_MAX clamp, so the factor is normal
        inv = ((254 - stored) << 23).to(tl.float32, bitcast=True)
        q_lo = lo * inv[:, :, None]
        q_hi = hi * inv[:, :, None]
        zero_blk = amax != amax  # never: an mx block always stores its codes
        sbyte = stored
    packed = _e2m1_nibble(q_lo, lo) | (_e2m1_nibble(q_hi, hi) << 4)
    packed = tl.where(zero_blk[:, :, None], 0, packed)
    dst = slot[:, None, None] * data_row_stride + pair[None, :, :]
    tl.store(data_ptr + dst, packed.to(tl.uint8), mask=m3)
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
        )
