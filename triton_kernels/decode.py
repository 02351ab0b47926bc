"""Paged decode attention over every KV cache dtype (split-KV / flash-decoding).

``@triton.jit`` code only; the launcher and its checks live in ``kvpool.attention``.

One program = one request x one KV head x one split of the request's tokens, and it computes all
query heads of that KV head (GQA), so each KV byte is read once per split. K and V are loaded
straight from the paged cache and dequantized in registers; per-tensor factors (fp8 scales, the
nvfp4 global scale) are folded into the softmax scale (K) and into the output (V), never applied
per value.

Format codes (``FMT``): 0 = fp32/bf16/fp16 as stored, 1 = fp8 (e4m3fn or e5m2), 2 = nvfp4,
3 = fp4_mx_block16. Inside the kernel an FP4 element is held as ``e2m1 / 64`` (the nibble mapped
onto an e4m3 byte and converted by the hardware: exact, subnormals included); the factor 64 goes
into the folded factors for nvfp4 and into the power-of-two block scale for mx.

Masking: token positions are clamped to ``[start, end)`` with ``end <= seq_len`` and every load
(page-table entries, K, V, block scales) is masked by it, so no slot past ``seq_len`` is read and
no page-table entry past ``ceil(seq_len / page_size)`` is dereferenced (CASES.md KVB-16).
"""

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def e2m1_div64_f16(b, BN: tl.constexpr, D: tl.constexpr):
    """Packed FP4 bytes ``[BN, D/2]`` (uint8, element 2i in the low nibble) -> ``[BN, D]`` fp16
    holding ``e2m1 / 64`` exactly: nibble ``s e1 e0 m`` becomes the e4m3 byte
    ``s 000 e1e0 m 00`` (same exponent/mantissa bits, bias 7 instead of 1), which the hardware
    converts to fp16 in pairs."""
    lo = ((b & 0x8) << 4) | ((b & 0x7) << 2)
    hi = (b & 0x80) | ((b >> 2) & 0x1C)
    lo = lo.to(tl.float8e4nv, bitcast=True).to(tl.float16)
    hi = hi.to(tl.float8e4nv, bitcast=True).to(tl.float16)
    return tl.join(lo, hi).reshape(BN, D)


@triton.jit
def load_kv_tile(
    ptr, bs_ptr, slot, mask, head, stride_row, stride_bs_row,
    BN: tl.constexpr, D: tl.constexpr, FMT: tl.constexpr, CDT: tl.constexpr,
):
    """Rows ``slot`` (int64 ``[BN]``, masked by ``mask``) of one KV head -> ``[BN, D]`` in CDT.

    FMT 0/1: the stored value (fp8 without its per-tensor scale). FMT 2 (nvfp4):
    ``e2m1 / 64 * block_scale`` (exact in fp16; global scale and 64 folded by the caller).
    Block scales come as uint8 (nvfp4: e4m3 bits, reinterpreted here). FMT 3 (mx): ``e2m1 * 2^(e - 127)`` exact, for stored exponents up to 248.
    Masked rows are 0 and their memory is not touched.
    """
    if FMT < 2:
        d = tl.arange(0, D)
        x = tl.load(ptr + slot[:, None] * stride_row + head * D + d[None, :],
                    mask=mask[:, None], other=0.0)
        return x.to(CDT)
    else:
        d2 = tl.arange(0, D // 2)
        b = tl.load(ptr + slot[:, None] * stride_row + head * (D // 2) + d2[None, :],
                    mask=mask[:, None], other=0)
        e = e2m1_div64_f16(b, BN, D)
        j = tl.arange(0, D // 16)
        s = tl.load(bs_ptr + slot[:, None] * stride_bs_row + head * (D // 16) + j[None, :],
                    mask=mask[:, None], other=0)
        if FMT == 2:
            x = e.reshape(BN, D // 16, 16) * s.to(tl.float8e4nv, bitcast=True).to(tl.float16)[:, :, None]
            return x.reshape(BN, D).to(CDT)
        else:
            # 2^(e - 127) * 64 = 2^(e - 121), built from the exponent bits (exact, no exp2).
            ex = tl.minimum(s.to(tl.int32), 248) + 6
            sf = (ex << 23).to(tl.float32, bitcast=True)
            x = e.to(tl.float32).reshape(BN, D // 16, 16) * sf[:, :, None]
            return x.reshape(BN, D).to(CDT)


@triton.jit
def softmax_logits(qk, qk_scale, softcap, HAS_SOFTCAP: tl.constexpr):
    """Raw ``q . k`` (stored units) -> logits in log2 units. ``qk_scale`` is
    ``sm_scale * k_factor`` (natural units); soft-capping is ``c * tanh(x / c)``."""
    if HAS_SOFTCAP:
        x = qk * (qk_scale / softcap)
        # tanh(x) = 1 - 2 / (exp(2x) + 1): saturates cleanly to +-1 for large |x|
        t = 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)
        return t * (softcap * 1.4426950408889634)
    else:
        return qk * (qk_scale * 1.4426950408889634)


@triton.jit
def decode_kernel(
    Q, K, V, KBS, VBS, KSC, VSC, PT, SEQ, SINKS, OUT, PO, PL,
    stride_qb, stride_qh, stride_kr, stride_vr, stride_kbr, stride_vbr, stride_pt,
    stride_ob, stride_oh,
    sm_scale, softcap, window,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    FMT: tl.constexpr, CDT: tl.constexpr, IS_F32: tl.constexpr, USE_DOT: tl.constexpr,
    HAS_SCALE: tl.constexpr, FP4_MUL: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    b = tl.program_id(0)
    hk = tl.program_id(1)
    split = tl.program_id(2)

    seq = tl.load(SEQ + b)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(seq - window, 0)
    chunk = tl.cdiv(tl.cdiv(seq - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = lo + split * chunk
    end = tl.minimum(start + chunk, seq)

    kf = FP4_MUL
    vf = FP4_MUL
    if HAS_SCALE:
        kf = kf * tl.load(KSC)
        vf = vf * tl.load(VSC)
    qk_scale = sm_scale * kf

    offs_g = tl.arange(0, GP)
    offs_d = tl.arange(0, D)
    offs_dv = tl.arange(0, DV)
    gmask = offs_g < G
    heads = hk * G + offs_g
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=gmask[:, None], other=0.0)
    if USE_DOT:
        q = q.to(CDT)
    else:
        q = q.to(tl.float32)

    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, DV], tl.float32)
    pt_row = PT + b.to(tl.int64) * stride_pt

    for s in range(start, end, BLOCK_N):
        t = s + tl.arange(0, BLOCK_N)
        tm = t < end
        page = tl.load(pt_row + t // PAGE, mask=tm, other=0)
        slot = page.to(tl.int64) * PAGE + (t % PAGE)
        k = load_kv_tile(K, KBS, slot, tm, hk, stride_kr, stride_kbr, BLOCK_N, D, FMT, CDT)
        if USE_DOT:
            if IS_F32:
                qk = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                qk = tl.dot(q, tl.trans(k))
        else:
            qk = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], 2)
        qk = softmax_logits(qk, qk_scale, softcap, HAS_SOFTCAP)
        qk = tl.where(tm[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = load_kv_tile(V, VBS, slot, tm, hk, stride_vr, stride_vbr, BLOCK_N, DV, FMT, CDT)
        if USE_DOT:
            if IS_F32:
                pv = tl.dot(p, v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(CDT), v)
        else:
            pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], 1)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    if NUM_SPLITS == 1:
        if HAS_SINKS:
            sink = tl.load(SINKS + heads, mask=gmask, other=0.0).to(tl.float32) * 1.4426950408889634
            m_s = tl.maximum(m_i, sink)
            l_i = l_i * tl.exp2(m_i - m_s) + tl.exp2(sink - m_s)
            acc = acc * tl.exp2(m_i - m_s)[:, None]
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        o = acc * (vf / l_safe)[:, None]
        tl.store(OUT + b * stride_ob + heads[:, None] * stride_oh + offs_dv[None, :],
                 o.to(OUT.dtype.element_ty), mask=gmask[:, None])
    else:
        # normalized partial output and its log2-sum-exp; an empty split stores (0, -inf)
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        o = acc / l_safe[:, None]
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        row = (b * (G * tl.num_programs(1)) + heads) * NUM_SPLITS + split
        tl.store(PO + row[:, None].to(tl.int64) * DV + offs_dv[None, :], o, mask=gmask[:, None])
        tl.store(PL + row, lse, mask=gmask)


@triton.jit
def merge_kernel(
    PO, PL, SINKS, VSC, OUT, stride_ob, stride_oh, Hq,
    DV: tl.constexpr, NUM_SPLITS: tl.constexpr, SP: tl.constexpr,
    HAS_SCALE: tl.constexpr, FP4_MUL: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    """Reduction stage of split-KV decode: one program per (request, query head) combines the
    ``NUM_SPLITS`` normalized partial outputs by their log2-sum-exp, adds the sink (if any) to the
    denominator, applies the folded V factor and writes the output in its dtype."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    row = b * Hq + h
    offs_s = tl.arange(0, SP)
    smask = offs_s < NUM_SPLITS
    offs_dv = tl.arange(0, DV)
    lse = tl.load(PL + row * NUM_SPLITS + offs_s, mask=smask, other=float("-inf"))
    m = tl.max(lse, 0)
    if HAS_SINKS:
        sink = tl.load(SINKS + h).to(tl.float32) * 1.4426950408889634
        m = tl.maximum(m, sink)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m_safe)
    den = tl.sum(w, 0)
    if HAS_SINKS:
        den += tl.exp2(sink - m_safe)
    o = tl.load(PO + (row * NUM_SPLITS + offs_s)[:, None].to(tl.int64) * DV + offs_dv[None, :],
                mask=smask[:, None], other=0.0)
    vf = FP4_MUL
    if HAS_SCALE:
        vf = vf * tl.load(VSC)
    den = tl.where(den > 0, den, 1.0)
    out = tl.sum(w[:, None] * o, 0) * (vf / den)
    tl.store(OUT + b * stride_ob + h * stride_oh + offs_dv, out.to(OUT.dtype.element_ty))
