"""Quantized KV write: one fused kernel per layer call (K and V, data and every block-scale layout).

``@triton.jit`` code only; the launcher, its checks and the layout documentation live in
``kvpool.write``. The numerics follow ``kvpool.formats`` (the reference) bit for bit:

- fp8 and the e4m3 block scales of nvfp4 are encoded with integer arithmetic on the fp32 bits
  (round to nearest even, saturating), never with a float -> fp8 cast, whose overflow and
  rounding differ between Triton versions, the CPU interpreter and the hardware;
- divisions are IEEE round-to-nearest (``tl.math.div_rn``), as torch divides;
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
def _fp8_byte(y, MBITS: tl.constexpr, BIAS: tl.constexpr, VMAX: tl.constexpr):
    """fp32 ``y`` -> fp8 byte (int32 0..255): saturating at +-VMAX (+-inf too), RNE, NaN -> 0x7F."""
    sign = (y.to(tl.int32, bitcast=True) >> 31) & 1
    a = tl.minimum(tl.abs(y), VMAX)
    code = _rne_code(a, MBITS, BIAS) | (sign << 7)
    return tl.where(y != y, 0x7F, code)


@triton.jit
def _e4m3_value(code):
    """Non-negative e4m3 code (int32, < 0x7F) -> its fp32 value (exact)."""
    e = code >> 3
    m = code & 7
    normal = ((e + 120) << 23) | (m << 20)
    sub = m.to(tl.float32) * 0.001953125  # m * 2^-9
    return tl.where(e == 0, sub, normal.to(tl.float32, bitcast=True))


@triton.jit
def _quant_tensor(
    x_ptr, stride_xt, stride_xh, stride_xd,
    loc_ptr, T, R,
    data_ptr, data_row_stride,
    bs_ptr, bs_row_stride,
    pm_ptr,
    scale_ptr,
    pid_t,
    H: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
    MODE: tl.constexpr, WRITE_LINEAR: tl.constexpr, WRITE_PM: tl.constexpr,
    INTERLEAVE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Quantize BLOCK_T tokens x all heads of one tensor (K or V) and store them at their slots."""
    HD: tl.constexpr = H * D
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < T
    slot = tl.load(loc_ptr + t, mask=t_ok, other=-1).to(tl.int64)
    # out-of-range slots are skipped (no write); the debug mode and the CPU path raise instead
    row_ok = t_ok & (slot >= 0) & (slot < R)
    c = tl.arange(0, BLOCK_C)
    c_ok = c < HD
    head = c // D
    d = c % D
    x_off = t.to(tl.int64)[:, None] * stride_xt + (head * stride_xh + d * stride_xd)[None, :]
    m2 = row_ok[:, None] & c_ok[None, :]
    x = tl.load(x_ptr + x_off, mask=m2, other=0.0)
    if MODE == 0:
        dst = slot[:, None] * data_row_stride + c[None, :]
        tl.store(data_ptr + dst, x.to(data_ptr.dtype.element_ty), mask=m2)
    elif MODE == 1 or MODE == 2:
        xf = x.to(tl.float32)
        s = tl.load(scale_ptr)
        y = tl.math.div_rn(xf, tl.full(xf.shape, 1.0, tl.float32) * s)
        if MODE == 1:
            b = _fp8_byte(y, 3, 7, 448.0)
        else:
            b = _fp8_byte(y, 2, 15, 57344.0)
        dst = slot[:, None] * data_row_stride + c[None, :]
        tl.store(data_ptr + dst, b.to(tl.uint8), mask=m2)
    else:
        NB: tl.constexpr = BLOCK_C // 16
        xf = x.to(tl.float32)
        xf = tl.where(xf != xf, 0.0, xf)  # FP4 has no NaN: NaN -> 0
        xf = tl.minimum(tl.maximum(xf, -3.4028234663852886e38), 3.4028234663852886e38)  # +-inf -> +-FLT_MAX
        amax = tl.max(tl.reshape(tl.abs(xf), (BLOCK_T, NB, 16)), axis=2)
        if MODE == 3:
            g = tl.load(scale_ptr)
            gb = tl.full(amax.shape, 1.0, tl.float32) * g
            s = tl.math.div_rn(tl.math.div_rn(amax, tl.full(amax.shape, 6.0, tl.float32)), gb)
            s_code = _rne_code(tl.minimum(s, 448.0), 3, 7)
            s_dec = _e4m3_value(s_code)
            denom = s_dec * gb
            zero_blk = s_dec == 0.0
            denom = tl.where(zero_blk, 1.0, denom)
            den_full = tl.reshape(tl.broadcast_to(denom[:, :, None], (BLOCK_T, NB, 16)), (BLOCK_T, BLOCK_C))
            q = tl.math.div_rn(xf, den_full)
            keep = tl.reshape(
                tl.broadcast_to((s_dec != 0.0)[:, :, None], (BLOCK_T, NB, 16)), (BLOCK_T, BLOCK_C)
            )
            sbyte = s_code
        else:
            r = tl.math.div_rn(amax, tl.full(amax.shape, 6.0, tl.float32))
            rb = r.to(tl.int32, bitcast=True)
            e_field = (rb >> 23) & 0xFF
            mant = rb & 0x7FFFFF
            stored = tl.where(e_field == 0, (mant > 0x400000).to(tl.int32), e_field + (mant != 0).to(tl.int32))
            stored = tl.minimum(stored, 254)
            stored = tl.where(amax == 0.0, 127, stored)
            # 2^(127 - stored): stored <= 253 for finite input, so the factor is a normal float
            inv = ((254 - stored) << 23).to(tl.float32, bitcast=True)
            inv_full = tl.reshape(tl.broadcast_to(inv[:, :, None], (BLOCK_T, NB, 16)), (BLOCK_T, BLOCK_C))
            q = xf * inv_full
            keep = xf == xf
            sbyte = stored
        sign = (xf.to(tl.int32, bitcast=True) >> 31) & 1
        code = _rne_code(tl.minimum(tl.abs(q), 6.0), 1, 1) | (sign << 3)
        code = tl.where(keep, code, 0)
        lo, hi = tl.split(tl.reshape(code, (BLOCK_T, BLOCK_C // 2, 2)))
        packed = (lo | (hi << 4)).to(tl.uint8)
        c2 = tl.arange(0, BLOCK_C // 2)
        dst = slot[:, None] * data_row_stride + c2[None, :]
        tl.store(data_ptr + dst, packed, mask=row_ok[:, None] & (c2 < HD // 2)[None, :])
        # block scales: column b = head * (D/16) + j
        b = tl.arange(0, NB)
        b_ok = row_ok[:, None] & (b < HD // 16)[None, :]
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
def quant_write_kernel(
    loc_ptr, T, R,
    k_ptr, k_st, k_sh, k_sd,
    kd_ptr, kd_row, kbs_ptr, kbs_row, kpm_ptr, ks_ptr,
    v_ptr, v_st, v_sh, v_sd,
    vd_ptr, vd_row, vbs_ptr, vbs_row, vpm_ptr, vs_ptr,
    H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, PAGE: tl.constexpr,
    MODE: tl.constexpr, WRITE_LINEAR: tl.constexpr, WRITE_PM: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_CK: tl.constexpr, BLOCK_CV: tl.constexpr,
):
    """Grid ``(cdiv(T, BLOCK_T), 2)`` (axis 1: 0 = K, 1 = V; MLA: 1 program row, K only)."""
    pid_t = tl.program_id(0)
    if tl.program_id(1) == 0:
        _quant_tensor(
            k_ptr, k_st, k_sh, k_sd, loc_ptr, T, R, kd_ptr, kd_row, kbs_ptr, kbs_row, kpm_ptr,
            ks_ptr, pid_t, H, DK, PAGE, MODE, WRITE_LINEAR, WRITE_PM, False, BLOCK_T, BLOCK_CK,
        )
    else:
        _quant_tensor(
            v_ptr, v_st, v_sh, v_sd, loc_ptr, T, R, vd_ptr, vd_row, vbs_ptr, vbs_row, vpm_ptr,
            vs_ptr, pid_t, H, DV, PAGE, MODE, WRITE_LINEAR, WRITE_PM, True, BLOCK_T, BLOCK_CV,
        )
