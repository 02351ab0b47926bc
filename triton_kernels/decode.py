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
no page-table entry past ``ceil(seq_len / page_size)`` is dereferenced (KVB-16,
docs/architecture.md).
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
def load_raw(
    ptr,
    bs_ptr,
    slot,
    mask,
    head,
    stride_row,
    stride_bs_row,
    D: tl.constexpr,
    FMT: tl.constexpr,
    ASM: tl.constexpr = 0,
):
    """Stored bytes of rows ``slot`` (int64 ``[BN]``, masked by ``mask``) of one KV head:
    ``(data, block_scale)``; data ``[BN, D]`` as stored (``[BN, D/2]`` uint8 for FP4), block
    scales ``[BN, D/16]`` uint8 for FP4 (a placeholder otherwise). Masked rows are not read."""
    if FMT == 1 and ASM:  # fp8 bytes as int32 words (rows are 4-byte aligned: D % 4 == 0)
        d4 = tl.arange(0, D // 4)
        wp = ptr.to(tl.pointer_type(tl.int32), bitcast=True)
        x = tl.load(
            wp + slot[:, None] * (stride_row // 4) + head * (D // 4) + d4[None, :],
            mask=mask[:, None],
            other=0,
        )
        return x, mask
    elif FMT < 2:
        d = tl.arange(0, D)
        x = tl.load(
            ptr + slot[:, None] * stride_row + head * D + d[None, :], mask=mask[:, None], other=0.0
        )
        return x, mask
    else:
        if ASM:  # the same bytes as int32 words (rows are 4-byte aligned: D/2 % 4 == 0)
            d8 = tl.arange(0, D // 8)
            wp = ptr.to(tl.pointer_type(tl.int32), bitcast=True)
            x = tl.load(
                wp + slot[:, None] * (stride_row // 4) + head * (D // 8) + d8[None, :],
                mask=mask[:, None],
                other=0,
            )
        else:
            d2 = tl.arange(0, D // 2)
            x = tl.load(
                ptr + slot[:, None] * stride_row + head * (D // 2) + d2[None, :],
                mask=mask[:, None],
                other=0,
            )
        j = tl.arange(0, D // 16)
        s = tl.load(
            bs_ptr + slot[:, None] * stride_bs_row + head * (D // 16) + j[None, :],
            mask=mask[:, None],
            other=0,
        )
        return x, s


@triton.jit
def byte_e4m3_f16(x, shift: tl.constexpr):
    return ((x >> shift) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)


@triton.jit
def e2m1_words_f16(
    w, s16, BN: tl.constexpr, D: tl.constexpr, SCALED: tl.constexpr, EMULATE: tl.constexpr = False
):
    """GPU fast path of the FP4 decode: packed words ``[BN, D/8]`` int32 (8 nibbles each,
    element ``8j + 2i`` in the low nibble of byte ``i`` of word ``j``) -> ``[BN, D]`` fp16.

    One inline-PTX block per word: the nibbles are mapped onto e4m3 bytes with 32-bit logic
    (4 bytes at a time), converted in pairs by ``cvt.rn.f16x2.e4m3x2`` (exact, = e2m1 / 64) and,
    if ``SCALED``, multiplied in pairs (``mul.f16x2``) by ``s16`` (the word's block scale, fp16,
    broadcast to ``[BN, D/8]``; exact: a 2-bit times a 4-bit significand).
    ``EMULATE``: the same word logic and output order in plain Triton ops (the CPU interpreter
    cannot run PTX; tests use it to check everything around the asm block).
    """
    if EMULATE:
        lo = ((w & 0x08080808) << 4) | ((w & 0x07070707) << 2)
        hi = (w & -0x7F7F7F80) | ((w >> 2) & 0x1C1C1C1C)  # -0x7F7F7F80 = 0x80808080 as int32
        o0 = byte_e4m3_f16(lo, 0)
        o2 = byte_e4m3_f16(lo, 8)
        o4 = byte_e4m3_f16(lo, 16)
        o6 = byte_e4m3_f16(lo, 24)
        o1 = byte_e4m3_f16(hi, 0)
        o3 = byte_e4m3_f16(hi, 8)
        o5 = byte_e4m3_f16(hi, 16)
        o7 = byte_e4m3_f16(hi, 24)
        if SCALED:
            o0, o1, o2, o3 = o0 * s16, o1 * s16, o2 * s16, o3 * s16
            o4, o5, o6, o7 = o4 * s16, o5 * s16, o6 * s16, o7 * s16
    elif SCALED:
        o0, o1, o2, o3, o4, o5, o6, o7 = tl.inline_asm_elementwise(
            asm="{ .reg .b32 lo, hi, t, f0, f1, f2, f3, sc; .reg .b16 l0, l1, h0, h1; "
            "mov.b32 sc, {$9, $9}; "
            "and.b32 t, $8, 0x08080808; shl.b32 lo, t, 4; and.b32 t, $8, 0x07070707; "
            "shl.b32 t, t, 2; or.b32 lo, lo, t; and.b32 hi, $8, 0x80808080; "
            "shr.u32 t, $8, 2; and.b32 t, t, 0x1C1C1C1C; or.b32 hi, hi, t; "
            "mov.b32 {l0, l1}, lo; mov.b32 {h0, h1}, hi; "
            "cvt.rn.f16x2.e4m3x2 f0, l0; cvt.rn.f16x2.e4m3x2 f1, l1; "
            "cvt.rn.f16x2.e4m3x2 f2, h0; cvt.rn.f16x2.e4m3x2 f3, h1; "
            "mul.rn.f16x2 f0, f0, sc; mul.rn.f16x2 f1, f1, sc; "
            "mul.rn.f16x2 f2, f2, sc; mul.rn.f16x2 f3, f3, sc; "
            "mov.b32 {$0, $2}, f0; mov.b32 {$4, $6}, f1; "
            "mov.b32 {$1, $3}, f2; mov.b32 {$5, $7}, f3; }",
            constraints="=h,=h,=h,=h,=h,=h,=h,=h,r,h",
            args=[w, s16],
            dtype=(
                tl.float16,
                tl.float16,
                tl.float16,
                tl.float16,
                tl.float16,
                tl.float16,
                tl.float16,
                tl.float16,
            ),
            is_pure=True,
            pack=1,
        )
    else:
        o0, o1, o2, o3, o4, o5, o6, o7 = tl.inline_asm_elementwise(
            asm="{ .reg .b32 lo, hi, t, f0, f1, f2, f3; .reg .b16 l0, l1, h0, h1; "
            "and.b32 t, $8, 0x08080808; shl.b32 lo, t, 4; and.b32 t, $8, 0x07070707; "
            "shl.b32 t, t, 2; or.b32 lo, lo, t; and.b32 hi, $8, 0x80808080; "
            "shr.u32 t, $8, 2; and.b32 t, t, 0x1C1C1C1C; or.b32 hi, hi, t; "
            "mov.b32 {l0, l1}, lo; mov.b32 {h0, h1}, hi; "
            "cvt.rn.f16x2.e4m3x2 f0, l0; cvt.rn.f16x2.e4m3x2 f1, l1; "
            "cvt.rn.f16x2.e4m3x2 f2, h0; cvt.rn.f16x2.e4m3x2 f3, h1; "
            "mov.b32 {$0, $2}, f0; mov.b32 {$4, $6}, f1; "
            "mov.b32 {$1, $3}, f2; mov.b32 {$5, $7}, f3; }",
            constraints="=h,=h,=h,=h,=h,=h,=h,=h,r",
            args=[w],
            dtype=(
                tl.float16,
                tl.float16,
                tl.float16,
                tl.float16,
                tl.float16,
                tl.float16,
                tl.float16,
                tl.float16,
            ),
            is_pure=True,
            pack=1,
        )
    # tl.join adds a new *last* axis, so the outermost join picks the lowest index bit:
    # [..., p, q, r] holds element 8j + 4p + 2q + r
    x = tl.join(
        tl.join(tl.join(o0, o4), tl.join(o2, o6)), tl.join(tl.join(o1, o5), tl.join(o3, o7))
    )
    return x.reshape(BN, D)


@triton.jit
def fp8_words_f16(w, BN: tl.constexpr, D: tl.constexpr, E5M2: tl.constexpr, EMULATE: tl.constexpr):
    """Word-level fp8 decode: words ``[BN, D/4]`` int32 (element ``4j + i`` in byte ``i`` of word
    ``j``) -> ``[BN, D]`` fp16, exact. e4m3: ``cvt.rn.f16x2.e4m3x2`` on each half-word (inline
    PTX; ``EMULATE``: per-byte conversion in plain Triton for the interpreter); e5m2: the byte is
    the high byte of the fp16 (integer shifts). Converting in the load layout keeps Triton from
    moving the conversion behind the dot's shared-memory operand load, where it reads fp8 V
    tiles one byte at a time (seen in the PTX for sm_90: 128 ``ld.shared.b8`` per thread and
    128-token tile)."""
    if E5M2:
        o0 = ((w << 8) & 0xFF00).to(tl.int16).to(tl.float16, bitcast=True)
        o1 = (w & 0xFF00).to(tl.int16).to(tl.float16, bitcast=True)
        o2 = ((w >> 8) & 0xFF00).to(tl.int16).to(tl.float16, bitcast=True)
        o3 = ((w >> 16) & 0xFF00).to(tl.int16).to(tl.float16, bitcast=True)
    elif EMULATE:
        o0 = byte_e4m3_f16(w, 0)
        o1 = byte_e4m3_f16(w, 8)
        o2 = byte_e4m3_f16(w, 16)
        o3 = byte_e4m3_f16(w, 24)
    else:
        o0, o1, o2, o3 = tl.inline_asm_elementwise(
            asm="{ .reg .b16 l, h; .reg .b32 f0, f1; mov.b32 {l, h}, $4; "
            "cvt.rn.f16x2.e4m3x2 f0, l; cvt.rn.f16x2.e4m3x2 f1, h; "
            "mov.b32 {$0, $1}, f0; mov.b32 {$2, $3}, f1; }",
            constraints="=h,=h,=h,=h,r",
            args=[w],
            dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
            is_pure=True,
            pack=1,
        )
    # [..., p, q] holds element 4j + 2p + q (tl.join adds the new last axis)
    return tl.join(tl.join(o0, o2), tl.join(o1, o3)).reshape(BN, D)


@triton.jit
def dequant(
    x,
    s,
    BN: tl.constexpr,
    D: tl.constexpr,
    FMT: tl.constexpr,
    CDT: tl.constexpr,
    SKIP_SCALE: tl.constexpr = False,
    ASM: tl.constexpr = 0,
    E5M2: tl.constexpr = False,
):
    """``load_raw`` output -> ``[BN, D]`` in CDT.

    FMT 0/1: the stored value (fp8 without its per-tensor scale). FMT 2 (nvfp4):
    ``e2m1 / 64 * block_scale`` (exact in fp16; global scale and 64 folded by the caller).
    FMT 3 (mx): ``e2m1 * 2^(e - 127)`` exact, for stored exponents up to 248 (larger ones,
    |x| > 6 * 2^121, are clamped). Block scales come as uint8 (nvfp4: e4m3 bits, reinterpreted
    here). ``SKIP_SCALE`` (benchmark ablation only) leaves the FP4 block scale out. ``ASM``
    (FP4, fp8): ``x`` holds int32 words, decoded by ``e2m1_words_f16`` / ``fp8_words_f16`` (1:
    inline PTX on the GPU, 2: its plain-Triton emulation for the interpreter); ``E5M2``: the fp8
    words hold e5m2 bytes.
    """
    if FMT == 1 and ASM:
        return fp8_words_f16(x, BN, D, E5M2, ASM == 2).to(CDT)
    elif FMT < 2:
        return x.to(CDT)
    else:
        if ASM:
            if FMT == 2 and not SKIP_SCALE:
                sw = tl.broadcast_to(
                    s.to(tl.float8e4nv, bitcast=True).to(tl.float16)[:, :, None], (BN, D // 16, 2)
                ).reshape(BN, D // 8)
                return e2m1_words_f16(x, sw, BN, D, True, ASM == 2).to(CDT)
            e = e2m1_words_f16(x, x, BN, D, False, ASM == 2)
        else:
            e = e2m1_div64_f16(x, BN, D)
        if SKIP_SCALE:
            return e.to(CDT)
        if FMT == 2:
            y = (
                e.reshape(BN, D // 16, 16)
                * s.to(tl.float8e4nv, bitcast=True).to(tl.float16)[:, :, None]
            )
            return y.reshape(BN, D).to(CDT)
        else:
            # 2^(e - 127) * 64 = 2^(e - 121), built from the exponent bits (exact, no exp2).
            ex = tl.minimum(s.to(tl.int32), 248) + 6
            sf = (ex << 23).to(tl.float32, bitcast=True)
            y = e.to(tl.float32).reshape(BN, D // 16, 16) * sf[:, :, None]
            return y.reshape(BN, D).to(CDT)


@triton.jit
def load_kv_tile(
    ptr,
    bs_ptr,
    slot,
    mask,
    head,
    stride_row,
    stride_bs_row,
    BN: tl.constexpr,
    D: tl.constexpr,
    FMT: tl.constexpr,
    CDT: tl.constexpr,
    ASM: tl.constexpr = 0,
):
    """``load_raw`` then ``dequant``: rows ``slot`` of one KV head as ``[BN, D]`` in CDT."""
    x, s = load_raw(ptr, bs_ptr, slot, mask, head, stride_row, stride_bs_row, D, FMT, ASM)
    return dequant(x, s, BN, D, FMT, CDT, False, ASM, ptr.dtype.element_ty == tl.float8e5)


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


# Step-dependent ints are not specialized (an int of 1 becomes a constant, others carry their
# divisibility by 16): the page-table width, the split count and the window may change from one
# serving step to the next, and each change would compile a new kernel (issue 22). The pool's
# strides, q/out strides (fixed per model) and page_shift stay specialized.
DO_NOT_SPECIALIZE = ("stride_pt", "window", "num_splits")
MERGE_DO_NOT_SPECIALIZE = ("num_splits",)


@triton.jit(do_not_specialize=DO_NOT_SPECIALIZE)
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
    stride_kbr,
    stride_vbr,
    stride_pt,
    stride_ob,
    stride_oh,
    sm_scale,
    softcap,
    window,
    page_shift,
    num_splits,
    G: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FINAL: tl.constexpr,
    FMT: tl.constexpr,
    CDT: tl.constexpr,
    IS_F32: tl.constexpr,
    USE_DOT: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    FP4_MUL: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    PREFETCH: tl.constexpr,
    ABLATE: tl.constexpr,
    ASM: tl.constexpr,
    SWAP: tl.constexpr = False,
    PAGE_AHEAD: tl.constexpr = False,
):
    """Grid ``(B, H_kv, num_splits)``. ``FINAL`` (num_splits == 1): write the normalized output;
    else the split's normalized partial output and log2-sum-exp for ``merge_kernel``.

    ``PREFETCH``: issue the next tile's page-table, K and V loads before this tile's math
    (register double buffering). ``ABLATE`` (benchmarks only; 0 in real use) leaves one stage
    out to measure what it costs: 1 = FP4 block-scale multiply, 2 = the dots (tiles still
    dequantized, consumed by row sums: costs shuffles of its own), 3 = dequantization and dots
    (raw loads only). fp32 caches use 3-pass tf32 dots (fp32-level accuracy on tensor cores).
    ``SWAP`` (with ``USE_DOT``; no ``PREFETCH``, ``ABLATE`` 0 or 1): transposed dots, the KV tile
    as the MMA's M side. ``PAGE_AHEAD`` (no ``PREFETCH``): the page ids of tile ``i + 1`` are
    loaded during tile ``i``, so the K/V loads of a tile do not wait on a load of their own
    iteration and Triton's pipeliner can keep ``num_stages - 1`` tiles in flight (without it the
    page-id load takes one of the stages and the ring stays one tile deep).
    """
    b = tl.program_id(0)
    hk = tl.program_id(1)
    split = tl.program_id(2)
    page_mask = (1 << page_shift) - 1

    seq = tl.load(SEQ + b)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(seq - window, 0)
    chunk = tl.cdiv(tl.cdiv(seq - lo, num_splits), BLOCK_N) * BLOCK_N
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
    q = tl.load(
        Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=gmask[:, None],
        other=0.0,
    )
    if USE_DOT:
        q = q.to(CDT)
    else:
        q = q.to(tl.float32)

    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, DV], tl.float32)
    pt_row = PT + b.to(tl.int64) * stride_pt

    if SWAP:
        # Transposed tiles: S^T = K q^T and O^T = V^T P^T, so the KV tile is the M side of the
        # MMA and the query group its N side (padded to 8 by the hardware shape m16n8k16, not
        # to 16 rows): half the tensor-core work of the padded-group form, and the softmax runs
        # on [BLOCK_N, GP] instead of [16, BLOCK_N].
        qt = tl.trans(q)  # [D, GP]
        acc_t = tl.zeros([DV, GP], tl.float32)
        if PAGE_AHEAD:
            t0 = start + tl.arange(0, BLOCK_N)
            page_a = tl.load(pt_row + (t0 >> page_shift), mask=t0 < end, other=0)
        for s in range(start, end, BLOCK_N):
            t = s + tl.arange(0, BLOCK_N)
            tm = t < end
            if PAGE_AHEAD:
                page = page_a
                t1 = t + BLOCK_N
                page_a = tl.load(pt_row + (t1 >> page_shift), mask=t1 < end, other=0)
            else:
                page = tl.load(pt_row + (t >> page_shift), mask=tm, other=0)
            slot = page.to(tl.int64) * (page_mask + 1) + (t & page_mask)
            kx, ks = load_raw(K, KBS, slot, tm, hk, stride_kr, stride_kbr, D, FMT, ASM)
            k = dequant(
                kx, ks, BLOCK_N, D, FMT, CDT, ABLATE == 1, ASM, K.dtype.element_ty == tl.float8e5
            )
            if IS_F32:
                qk_t = tl.dot(k, qt, input_precision="tf32x3")
            else:
                qk_t = tl.dot(k, qt)
            qk_t = softmax_logits(qk_t, qk_scale, softcap, HAS_SOFTCAP)
            qk_t = tl.where(tm[:, None], qk_t, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk_t, 0))
            alpha = tl.exp2(m_i - m_new)
            p_t = tl.exp2(qk_t - m_new[None, :])
            l_i = l_i * alpha + tl.sum(p_t, 0)
            vx, vs = load_raw(V, VBS, slot, tm, hk, stride_vr, stride_vbr, DV, FMT, ASM)
            v = dequant(
                vx, vs, BLOCK_N, DV, FMT, CDT, ABLATE == 1, ASM, V.dtype.element_ty == tl.float8e5
            )
            if IS_F32:
                pv_t = tl.dot(tl.trans(v), p_t, input_precision="tf32x3")
            else:
                pv_t = tl.dot(tl.trans(v), p_t.to(CDT))
            acc_t = acc_t * alpha[None, :] + pv_t
            m_i = m_new
        acc = tl.trans(acc_t)
    else:
        if PREFETCH:
            # software pipeline: raw K/V one tile ahead, page ids two tiles ahead, so no load
            # waits on another load issued in the same iteration
            t = start + tl.arange(0, BLOCK_N)
            tm = t < end
            page = tl.load(pt_row + (t >> page_shift), mask=tm, other=0)
            slot = page.to(tl.int64) * (page_mask + 1) + (t & page_mask)
            kx, ks = load_raw(K, KBS, slot, tm, hk, stride_kr, stride_kbr, D, FMT, ASM)
            vx, vs = load_raw(V, VBS, slot, tm, hk, stride_vr, stride_vbr, DV, FMT, ASM)
            t1 = t + BLOCK_N
            page_next = tl.load(pt_row + (t1 >> page_shift), mask=t1 < end, other=0)
        elif PAGE_AHEAD:
            t0 = start + tl.arange(0, BLOCK_N)
            page_a = tl.load(pt_row + (t0 >> page_shift), mask=t0 < end, other=0)

        for s in range(start, end, BLOCK_N):
            t = s + tl.arange(0, BLOCK_N)
            tm = t < end
            if PREFETCH:
                tn = t + BLOCK_N
                tnm = tn < end
                sn = page_next.to(tl.int64) * (page_mask + 1) + (tn & page_mask)
                kxn, ksn = load_raw(K, KBS, sn, tnm, hk, stride_kr, stride_kbr, D, FMT, ASM)
                vxn, vsn = load_raw(V, VBS, sn, tnm, hk, stride_vr, stride_vbr, DV, FMT, ASM)
                tnn = tn + BLOCK_N
                page_nn = tl.load(pt_row + (tnn >> page_shift), mask=tnn < end, other=0)
            else:
                if PAGE_AHEAD:
                    page = page_a
                    t1 = t + BLOCK_N
                    page_a = tl.load(pt_row + (t1 >> page_shift), mask=t1 < end, other=0)
                else:
                    page = tl.load(pt_row + (t >> page_shift), mask=tm, other=0)
                slot = page.to(tl.int64) * (page_mask + 1) + (t & page_mask)
                kx, ks = load_raw(K, KBS, slot, tm, hk, stride_kr, stride_kbr, D, FMT, ASM)
            if ABLATE == 3:
                qk = tl.zeros([GP, BLOCK_N], tl.float32) + tl.sum(kx.to(tl.float32), 1)[None, :]
            else:
                k = dequant(
                    kx,
                    ks,
                    BLOCK_N,
                    D,
                    FMT,
                    CDT,
                    ABLATE == 1,
                    ASM,
                    K.dtype.element_ty == tl.float8e5,
                )
                if ABLATE == 2:
                    qk = tl.zeros([GP, BLOCK_N], tl.float32) + tl.sum(k.to(tl.float32), 1)[None, :]
                elif USE_DOT:
                    if IS_F32:
                        qk = tl.dot(q, tl.trans(k), input_precision="tf32x3")
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
            if not PREFETCH:
                vx, vs = load_raw(V, VBS, slot, tm, hk, stride_vr, stride_vbr, DV, FMT, ASM)
            if ABLATE == 3:
                pv = tl.zeros([GP, DV], tl.float32) + tl.sum(tl.sum(vx.to(tl.float32), 1), 0)
            else:
                v = dequant(
                    vx,
                    vs,
                    BLOCK_N,
                    DV,
                    FMT,
                    CDT,
                    ABLATE == 1,
                    ASM,
                    V.dtype.element_ty == tl.float8e5,
                )
                if ABLATE == 2:
                    pv = tl.zeros([GP, DV], tl.float32) + tl.sum(v.to(tl.float32), 0)[None, :]
                elif USE_DOT:
                    if IS_F32:
                        pv = tl.dot(p, v, input_precision="tf32x3")
                    else:
                        pv = tl.dot(p.to(CDT), v)
                else:
                    pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], 1)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
            if PREFETCH:
                kx, ks, vx, vs = kxn, ksn, vxn, vsn
                page_next = page_nn

    if FINAL:
        if HAS_SINKS:
            sink = tl.load(SINKS + heads, mask=gmask, other=0.0).to(tl.float32) * 1.4426950408889634
            m_s = tl.maximum(m_i, sink)
            l_i = l_i * tl.exp2(m_i - m_s) + tl.exp2(sink - m_s)
            acc = acc * tl.exp2(m_i - m_s)[:, None]
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        o = acc * (vf / l_safe)[:, None]
        tl.store(
            OUT + b * stride_ob + heads[:, None] * stride_oh + offs_dv[None, :],
            o.to(OUT.dtype.element_ty),
            mask=gmask[:, None],
        )
    else:
        # normalized partial output and its log2-sum-exp; an empty split stores (0, -inf)
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        o = acc / l_safe[:, None]
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        row = (b * (G * tl.num_programs(1)) + heads) * num_splits + split
        tl.store(PO + row[:, None].to(tl.int64) * DV + offs_dv[None, :], o, mask=gmask[:, None])
        tl.store(PL + row, lse, mask=gmask)


@triton.jit(do_not_specialize=MERGE_DO_NOT_SPECIALIZE)
def merge_kernel(
    PO,
    PL,
    SINKS,
    VSC,
    OUT,
    stride_ob,
    stride_oh,
    Hq,
    num_splits,
    DV: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    SP: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    FP4_MUL: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Reduction stage of split-KV decode.

    One program per (request, query head, ``BLOCK_DV`` output columns) combines the
    ``num_splits`` normalized partial outputs (``PO [B*Hq, num_splits, DV]`` fp32) by their
    log2-sum-exp (``PL [B*Hq, num_splits]``), ``SP`` splits per step with an online rescale,
    adds the sink (if any) to the denominator, applies the folded V factor and writes the
    output in its dtype. Steps of ``SP x BLOCK_DV`` values (at most 8,192: 64 fp32 per thread
    at 4 warps; the launcher's ``_merge_tiles``) keep the tile in registers; the old one-step
    ``num_splits x DV`` tile spilled from 256 splits on (2.8 KiB of stack per thread, sm_90).
    ``PDL``: launched as a programmatic dependent of the split kernel; wait for its grid
    before reading anything."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    row = b * Hq + h
    offs_s = tl.arange(0, SP)
    offs_dv = tl.program_id(2) * BLOCK_DV + tl.arange(0, BLOCK_DV)
    if PDL:
        tl.extra.cuda.gdc_wait()
    m = tl.full([], float("-inf"), tl.float32)
    den = tl.zeros([], tl.float32)
    acc = tl.zeros([BLOCK_DV], tl.float32)
    for s0 in range(0, num_splits, SP):
        idx = s0 + offs_s
        smask = idx < num_splits
        lse = tl.load(PL + row * num_splits + idx, mask=smask, other=float("-inf"))
        o = tl.load(
            PO + (row * num_splits + idx)[:, None].to(tl.int64) * DV + offs_dv[None, :],
            mask=smask[:, None],
            other=0.0,
        )
        m_new = tl.maximum(m, tl.max(lse, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)  # 0 while every split so far was empty
        w = tl.exp2(lse - m_safe)  # an empty split (lse -inf) weighs 0; its o is 0, not NaN
        den = den * alpha + tl.sum(w, 0)
        acc = acc * alpha + tl.sum(w[:, None] * o, 0)
        m = m_new
    if HAS_SINKS:
        sink = tl.load(SINKS + h).to(tl.float32) * 1.4426950408889634
        m_new = tl.maximum(m, sink)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        den = den * alpha + tl.exp2(sink - m_safe)
        acc = acc * alpha
    vf = FP4_MUL
    if HAS_SCALE:
        vf = vf * tl.load(VSC)
    den = tl.where(den > 0, den, 1.0)
    out = acc * (vf / den)
    tl.store(OUT + b * stride_ob + h * stride_oh + offs_dv, out.to(OUT.dtype.element_ty))
