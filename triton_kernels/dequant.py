"""Dequantize cache slots -> fp32/bf16/fp16 (the unfused reference read path, and tests).

``@triton.jit`` code only; the launcher is ``kvpool.write.dequantize_kv``. Decoding is integer
arithmetic on the stored bytes (no fp8 dtype in the kernel), then fp32 multiplies in the order
of ``kvpool.formats.dequantize``: fp8 ``q * scale``, nvfp4 ``(e2m1 * s) * g``, fp4_mx_block16
``e2m1 * 2^(stored - 127)``. MODE as in ``quant_write``.
"""

import triton
import triton.language as tl


@triton.jit
def _fp8_value(b, MBITS: tl.constexpr, BIAS: tl.constexpr):
    """fp8 byte (int32 0..255) -> fp32 (exact; NaN codes -> NaN, e5m2 inf -> inf)."""
    sign = b >> 7
    mag = b & 0x7F
    e = mag >> MBITS
    m = mag & ((1 << MBITS) - 1)
    EMAX: tl.constexpr = (1 << (7 - MBITS)) - 1
    normal = (sign << 31) | ((e + (127 - BIAS)) << 23) | (m << (23 - MBITS))
    # subnormal: m * 2^(1 - BIAS - MBITS)
    q = (tl.full(b.shape, (128 - BIAS - MBITS) << 23, tl.int32)).to(tl.float32, bitcast=True)
    sub = m.to(tl.float32) * q
    sub = tl.where(sign == 1, -sub, sub)
    v = tl.where(e == 0, sub, normal.to(tl.float32, bitcast=True))
    if MBITS == 3:
        v = tl.where(mag == 0x7F, float("nan"), v)
    else:
        inf_or_nan = tl.where(m == 0, float("inf"), float("nan"))
        inf_or_nan = tl.where(sign == 1, -inf_or_nan, inf_or_nan)
        v = tl.where(e == EMAX, inf_or_nan, v)
    return v


@triton.jit
def _e2m1_value(code):
    """E2M1 code 0..15 (int32) -> fp32."""
    m = code & 7
    e = m >> 1
    frac = (m & 1).to(tl.float32)
    p = tl.where(e == 3, 4.0, tl.where(e == 2, 2.0, 1.0))
    mag = tl.where(e == 0, frac * 0.5, (1.0 + frac * 0.5) * p)
    return tl.where((code & 8) != 0, -mag, mag)


# The slot count changes with every read: not specialized (one compile for every N).
DO_NOT_SPECIALIZE = ("N",)


@triton.jit(do_not_specialize=DO_NOT_SPECIALIZE)
def dequant_kernel(
    loc_ptr,
    N,
    R,
    data_ptr,
    data_row_stride,
    bs_ptr,
    bs_row_stride,
    BS_BY_TOKEN: tl.constexpr,
    scale_ptr,
    out_ptr,
    H: tl.constexpr,
    D: tl.constexpr,
    MODE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Grid ``cdiv(N, BLOCK_T)``; ``out`` is ``[N, H, D]`` contiguous. Slots outside ``[0, R)``
    give zeros (the launcher checks them on the CPU path)."""
    HD: tl.constexpr = H * D
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < N
    slot = tl.load(loc_ptr + t, mask=t_ok, other=-1).to(tl.int64)
    row_ok = t_ok & (slot >= 0) & (slot < R)
    c = tl.arange(0, BLOCK_C)
    c_ok = c < HD
    m2 = row_ok[:, None] & c_ok[None, :]
    if MODE == 0:
        v = tl.load(data_ptr + slot[:, None] * data_row_stride + c[None, :], mask=m2, other=0.0)
        v = v.to(tl.float32)
    elif MODE == 1 or MODE == 2:
        b = tl.load(data_ptr + slot[:, None] * data_row_stride + c[None, :], mask=m2, other=0)
        b = b.to(tl.int32)
        if MODE == 1:
            v = _fp8_value(b, 3, 7)
        else:
            v = _fp8_value(b, 2, 15)
        v = v * tl.load(scale_ptr)
    else:
        byte = tl.load(
            data_ptr + slot[:, None] * data_row_stride + c[None, :] // 2, mask=m2, other=0
        )
        byte = byte.to(tl.int32)
        code = tl.where(c[None, :] % 2 == 0, byte & 0xF, byte >> 4)
        e2m1 = _e2m1_value(code)
        if BS_BY_TOKEN:
            bs_row = t.to(tl.int64)
        else:
            bs_row = slot
        sb = tl.load(bs_ptr + bs_row[:, None] * bs_row_stride + c[None, :] // 16, mask=m2, other=0)
        sb = sb.to(tl.int32)
        if MODE == 3:
            s = _fp8_value(sb, 3, 7)
            v = (e2m1 * s) * tl.load(scale_ptr)
        else:
            s = tl.where(sb == 0, (tl.full(sb.shape, 0x400000, tl.int32)), sb << 23)
            v = e2m1 * s.to(tl.float32, bitcast=True)
    tl.store(
        out_ptr + t.to(tl.int64)[:, None] * HD + c[None, :],
        v.to(out_ptr.dtype.element_ty),
        mask=t_ok[:, None] & c_ok[None, :],
    )
