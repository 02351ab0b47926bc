"""MLA attention over the paged latent cache, in the absorbed form (decode split-KV, extend).

``@triton.jit`` code only; the launchers and their checks live in ``kvpool.attention.mla``.

Each token's cache row is one latent of ``DL + DR`` values (``DL`` = kv_lora_rank, the
compressed KV; ``DR`` = qk_rope_head_dim, the shared rotary key), stored in any KV dtype. With
W_UK folded into the query and W_UV into the output projection (DeepSeek-V2, arXiv 2405.04434,
section 2.1; the form FlashMLA runs), every query head attends to the same rows: K is the whole
latent row, V its first ``DL`` values. So a program takes a block of ``BLOCK_H`` heads of one
request and reads each latent tile once for all of them: ``S = q_nope K_nope^T + q_rope
K_rope^T`` is a ``[BLOCK_H x (DL + DR)] x [(DL + DR) x BLOCK_N]`` tensor-core product and
``O += P K_nope`` a ``[BLOCK_H x BLOCK_N] x [BLOCK_N x DL]`` one.

The row is read as two power-of-two pieces (``DL`` then ``DR`` values; 512 + 64 for DeepSeek):
Triton tiles are powers of two and 576 is not. Dequantization reuses ``decode.load_raw`` /
``decode.dequant`` (FP4 in registers; the per-tensor fp8 scale and the nvfp4 global scale are
folded into the softmax scale and the output, as in ``decode``). Masking as in ``decode``: no
slot at or past ``seq_len`` is read, no page-table entry past ``ceil(seq_len / page_size)``.

``F8DOT`` (decode, fp8 caches): the dots run on fp8 tensor cores straight on the cache's bytes
(``mla_tile_step_f8``): q is quantized once per program to e4m3 with one fp32 scale per
(request, head), P to e4m3 as ``P * 448``; no element of the cache is converted.
"""

import triton
import triton.language as tl

from .decode import dequant, load_raw

LOG2E = tl.constexpr(1.4426950408889634)  # (compiled Triton refuses plain globals in @jit)
E4M3_MAX = tl.constexpr(448.0)  # the largest finite e4m3 value


@triton.jit
def split_range(SEQ, b, split, num_splits, BLOCK_N: tl.constexpr):
    """Request ``b``'s tokens ``start .. end - 1`` of KV split ``split`` (chunks of whole tiles;
    a split past the sequence gets ``start >= end``)."""
    seq = tl.load(SEQ + b)
    chunk = tl.cdiv(tl.cdiv(seq, num_splits), BLOCK_N) * BLOCK_N
    start = split * chunk
    return start, tl.minimum(start + chunk, seq)


@triton.jit
def latent_factors(KSC, sm_scale, HAS_SCALE: tl.constexpr, FP4_MUL: tl.constexpr):
    """``(kf, qk_scale)``: the value factor folded out of the dots (the fp8 per-tensor scale or
    the nvfp4 global scale, times FP4's 64) and the softmax scale in log2 units including it."""
    kf = FP4_MUL
    if HAS_SCALE:
        kf = kf * tl.load(KSC)
    return kf, sm_scale * kf * LOG2E


@triton.jit
def tile_slots(pt_row, s, end, page_shift, page_mask, BLOCK_N: tl.constexpr):
    """Slots (int64) and mask of the tokens ``s .. s + BLOCK_N - 1`` below ``end``; the page
    table is read only for those."""
    t = s + tl.arange(0, BLOCK_N)
    tm = t < end
    page = tl.load(pt_row + (t >> page_shift), mask=tm, other=0)
    return page.to(tl.int64) * (page_mask + 1) + (t & page_mask), tm


@triton.jit
def latent_tile(
    KV,
    KBS,
    slot,
    mask,
    stride_kr,
    stride_kbr,
    OFF: tl.constexpr,
    D: tl.constexpr,
    BN: tl.constexpr,
    FMT: tl.constexpr,
    CDT: tl.constexpr,
    ASM: tl.constexpr,
):
    """Values ``OFF .. OFF + D - 1`` of latent rows ``slot`` as ``[BN, D]`` in CDT (masked rows
    read as 0). FP4 rows hold ``OFF / 2`` bytes and ``OFF / 16`` block scales before the piece
    (``OFF`` is a multiple of 16, so the piece starts on a byte and a block boundary)."""
    if FMT >= 2:
        ptr = KV + OFF // 2
        bs = KBS + OFF // 16
    else:
        ptr = KV + OFF
        bs = KBS
    x, s = load_raw(ptr, bs, slot, mask, 0, stride_kr, stride_kbr, D, FMT, ASM)
    return dequant(x, s, BN, D, FMT, CDT, False, ASM, KV.dtype.element_ty == tl.float8e5)


@triton.jit
def latent_raw(
    KV,
    slot,
    mask,
    stride_kr,
    OFF: tl.constexpr,
    D: tl.constexpr,
    EMU: tl.constexpr,
    EVICT: tl.constexpr,
):
    """Values ``OFF .. OFF + D - 1`` of fp8 latent rows ``slot`` as stored, ``[BN, D]`` (masked
    rows 0): the operand of an fp8 dot. ``EMU``: as fp32 (the interpreter's fp8 dots are wrong,
    its fp8 -> fp32 conversion of finite codes is exact). ``EVICT``: the load's L1 hint."""
    d = tl.arange(0, D)
    x = tl.load(
        KV + OFF + slot[:, None] * stride_kr + d[None, :],
        mask=mask[:, None],
        other=0.0,
        eviction_policy=EVICT,
    )
    if EMU:
        return x.to(tl.float32)
    return x


@triton.jit
def round_e4m3(x, EMU: tl.constexpr):
    """fp32 ``x`` (finite, ``|x| <= 448``) rounded to e4m3, to nearest even (the cvt the GPU
    runs). ``EMU``: the same values as fp32, computed on the bits: the interpreter's fp32 ->
    fp8 cast drops the carry when the mantissa rounds up into the next power of two (seen with
    triton 3.9: 1.97 -> 1.0)."""
    if EMU:
        e = tl.maximum(((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)  # subnormals
        ulp = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 3 mantissa bits
        r = (x / ulp + 12582912.0) - 12582912.0  # 1.5 * 2^23: round to an integer, ties even
        return r * ulp
    return x.to(tl.float8e4nv)


@triton.jit
def mla_tile_step(
    q_n,
    q_r,
    m_i,
    l_i,
    acc,
    KV,
    KBS,
    pt_row,
    s,
    end,
    pos,
    stride_kr,
    stride_kbr,
    qk_scale,
    page_shift,
    page_mask,
    DL: tl.constexpr,
    DR: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    FMT: tl.constexpr,
    CDT: tl.constexpr,
    IS_F32: tl.constexpr,
    ASM: tl.constexpr,
):
    """One online-softmax step of every query row over the latent tokens ``s .. s + BLOCK_N -
    1`` (those at or past ``end`` masked): returns the updated ``(m_i, l_i, acc)``.

    Rows: ``q_n [R, DL]`` / ``q_r [R, DR]`` in CDT, ``m_i`` / ``l_i [R]`` and ``acc [R, DL]``
    fp32 (``m_i`` and ``l_i`` in log2 units: ``qk_scale`` includes ``LOG2E``). ``pt_row``
    points at the request's page-table row. ``CAUSAL``: row ``r`` also masks the tokens past
    its position ``pos[r]`` (extend); else ``pos`` is unused (decode). ``page_mask`` =
    ``(1 << page_shift) - 1``, computed once by the caller outside its loop."""
    slot, tm = tile_slots(pt_row, s, end, page_shift, page_mask, BLOCK_N)
    kn = latent_tile(KV, KBS, slot, tm, stride_kr, stride_kbr, 0, DL, BLOCK_N, FMT, CDT, ASM)
    kr = latent_tile(KV, KBS, slot, tm, stride_kr, stride_kbr, DL, DR, BLOCK_N, FMT, CDT, ASM)
    if IS_F32:
        qk = tl.dot(q_n, tl.trans(kn), input_precision="tf32x3")
        qk = tl.dot(q_r, tl.trans(kr), acc=qk, input_precision="tf32x3")
    else:
        qk = tl.dot(q_n, tl.trans(kn))
        qk = tl.dot(q_r, tl.trans(kr), acc=qk)
    if CAUSAL:
        t = s + tl.arange(0, BLOCK_N)
        keep = tm[None, :] & (t[None, :] <= pos[:, None])
    else:
        keep = tm[None, :]
    qk = tl.where(keep, qk * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(qk - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if IS_F32:
        acc = tl.dot(p, kn, acc=acc * alpha[:, None], input_precision="tf32x3")
    else:
        acc = tl.dot(p.to(CDT), kn, acc=acc * alpha[:, None])
    return m_new, l_i, acc


@triton.jit
def mla_tile_step_f8(
    q_n,
    q_r,
    m_i,
    l_i,
    acc,
    KV,
    pt_row,
    s,
    end,
    stride_kr,
    qk_row,
    page_shift,
    page_mask,
    DL: tl.constexpr,
    DR: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EMU: tl.constexpr,
):
    """``mla_tile_step`` (decode) with fp8 dots over raw fp8 latent tiles: ``q_n`` / ``q_r``
    e4m3, ``qk_row [R]`` each row's factor from the dot to log2 units (q's scale x sm_scale x
    the k scale x LOG2E). ``acc`` accumulates ``P * E4M3_MAX`` (P <= 1 after the running max;
    the whole e4m3 range, so small weights keep 3 mantissa bits down to 2^-6 / 448) rounded to
    e4m3, dotted with the tile's first ``DL`` values: the caller divides by ``E4M3_MAX``.
    ``EMU``: the operands are fp32 holding the same fp8 values, the dots fp32 (interpreter)."""
    slot, tm = tile_slots(pt_row, s, end, page_shift, page_mask, BLOCK_N)
    kn = latent_raw(KV, slot, tm, stride_kr, 0, DL, EMU, "")
    kr = latent_raw(KV, slot, tm, stride_kr, DL, DR, EMU, "")
    # V = the same bytes as kn, loaded again (from L2): an fp8 wgmma takes B K-major, so V goes
    # to shared memory transposed, through registers; one load with both uses would keep kn
    # out of the pipeliner's async copies too (Triton 3.6). (The eviction hint, L1 only, also
    # keeps the two loads from being merged.)
    v = latent_raw(KV, slot, tm, stride_kr, 0, DL, EMU, "evict_first")
    qk = tl.dot(q_n, tl.trans(kn))
    qk = tl.dot(q_r, tl.trans(kr), acc=qk)
    qk = tl.where(tm[None, :], qk * qk_row[:, None], float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(qk - m_safe[:, None])  # in [0, 1]
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(round_e4m3(p * E4M3_MAX, EMU), v, acc=acc * alpha[:, None])
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["stride_pt", "num_splits"])  # (they change between steps)
def mla_decode_kernel(
    Q,
    KV,
    KBS,
    KSC,
    PT,
    SEQ,
    OUT,
    PO,
    PL,
    stride_qb,
    stride_qh,
    stride_kr,
    stride_kbr,
    stride_pt,
    stride_ob,
    stride_oh,
    sm_scale,
    page_shift,
    num_splits,
    H,
    DL: tl.constexpr,
    DR: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FINAL: tl.constexpr,
    FMT: tl.constexpr,
    CDT: tl.constexpr,
    IS_F32: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    FP4_MUL: tl.constexpr,
    ASM: tl.constexpr,
    F8DOT: tl.constexpr = 0,
):
    """Grid ``(cdiv(H, BLOCK_H), B, num_splits)``: the head blocks of a request run side by side,
    so the latent tiles they share are read from DRAM once and from L2 by the others.

    ``FINAL`` (one split): write ``out [B, H, DL]``; else the split's normalized partial output
    ``PO [B*H, num_splits, DL]`` fp32 and its log2-sum-exp ``PL [B*H, num_splits]`` (an empty
    split stores (0, -inf)) for ``decode.merge_kernel``, which applies the V factor.

    ``F8DOT`` (fp8 caches; 1 on the GPU, 2 emulated for the interpreter; CDT fp32): fp8 dots
    (``mla_tile_step_f8``); each head's q row is scaled by ``amax / 448`` (1 for a zero row)
    and rounded to e4m3 once, the scale folded into the row's softmax factor."""
    hb = tl.program_id(0)
    b = tl.program_id(1)
    split = tl.program_id(2)
    page_mask = (1 << page_shift) - 1
    start, end = split_range(SEQ, b, split, num_splits, BLOCK_N)

    kf, qk_scale = latent_factors(KSC, sm_scale, HAS_SCALE, FP4_MUL)

    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    offs_l = tl.arange(0, DL)
    offs_r = tl.arange(0, DR)
    qrow = Q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh
    q_n = tl.load(qrow + offs_l[None, :], mask=hmask[:, None], other=0.0).to(CDT)
    q_r = tl.load(qrow + DL + offs_r[None, :], mask=hmask[:, None], other=0.0).to(CDT)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, DL], tl.float32)
    pt_row = PT + b.to(tl.int64) * stride_pt
    if F8DOT:  # (CDT is fp32 then)
        amax = tl.maximum(tl.max(tl.abs(q_n), 1), tl.max(tl.abs(q_r), 1))
        sq = tl.where(amax > 0, amax / E4M3_MAX, 1.0)
        q_n = round_e4m3(q_n / sq[:, None], F8DOT == 2)
        q_r = round_e4m3(q_r / sq[:, None], F8DOT == 2)
        qk_row = sq * qk_scale
        for s in range(start, end, BLOCK_N):
            m_i, l_i, acc = mla_tile_step_f8(
                q_n, q_r, m_i, l_i, acc, KV, pt_row, s, end, stride_kr, qk_row, page_shift,
                page_mask, DL, DR, BLOCK_N, F8DOT == 2,
            )  # fmt: skip
        acc = acc * (1.0 / E4M3_MAX)
    else:
        for s in range(start, end, BLOCK_N):
            m_i, l_i, acc = mla_tile_step(
                q_n, q_r, m_i, l_i, acc, KV, KBS, pt_row, s, end, end, stride_kr, stride_kbr,
                qk_scale, page_shift, page_mask, DL, DR, BLOCK_N, False, FMT, CDT, IS_F32, ASM,
            )  # fmt: skip

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    if FINAL:
        o = acc * (kf / l_safe)[:, None]
        tl.store(
            OUT + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_l[None, :],
            o.to(OUT.dtype.element_ty),
            mask=hmask[:, None],
        )
    else:
        o = acc / l_safe[:, None]
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        row = (b * H + heads).to(tl.int64) * num_splits + split
        tl.store(PO + row[:, None] * DL + offs_l[None, :], o, mask=hmask[:, None])
        tl.store(PL + row, lse, mask=hmask)


@triton.jit(do_not_specialize=["stride_pt", "blocks_per_req"])  # (they change between steps)
def mla_extend_kernel(
    Q,
    KV,
    KBS,
    KSC,
    PT,
    SEQ,
    CU,
    WORK,
    OUT,
    stride_qt,
    stride_qh,
    stride_kr,
    stride_kbr,
    stride_pt,
    stride_ot,
    stride_oh,
    sm_scale,
    blocks_per_req,
    page_shift,
    H,
    DL: tl.constexpr,
    DR: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FMT: tl.constexpr,
    CDT: tl.constexpr,
    IS_F32: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    FP4_MUL: tl.constexpr,
    USE_WORK: tl.constexpr,
    ASM: tl.constexpr,
):
    """Grid ``(work items, cdiv(H, BLOCK_H))``: ``BLOCK_T`` new tokens x ``BLOCK_H`` heads of one
    request per program (``BLOCK_T * BLOCK_H`` rows, row ``r`` = token ``r // BLOCK_H``, head
    ``r % BLOCK_H``), causal over the request's cached prefix and new tokens.

    ``USE_WORK``: ``WORK [n, 2]`` int32 lists (request, first new token of the block) of every
    non-empty block; else program ``i`` takes request ``i // blocks_per_req``, block
    ``i % blocks_per_req`` and exits when that block holds no new token."""
    pid = tl.program_id(0)
    hb = tl.program_id(1)
    if USE_WORK:
        b = tl.load(WORK + 2 * pid)
        t0 = tl.load(WORK + 2 * pid + 1)
    else:
        b = pid // blocks_per_req
        t0 = (pid % blocks_per_req) * BLOCK_T
    q0 = tl.load(CU + b)
    q_len = tl.load(CU + b + 1) - q0
    if t0 >= q_len:
        return
    seq = tl.load(SEQ + b)
    page_mask = (1 << page_shift) - 1

    kf, qk_scale = latent_factors(KSC, sm_scale, HAS_SCALE, FP4_MUL)

    rows = tl.arange(0, BLOCK_T * BLOCK_H)
    tok = t0 + rows // BLOCK_H
    heads = hb * BLOCK_H + rows % BLOCK_H
    rmask = (tok < q_len) & (heads < H)
    pos = seq - q_len + tok  # each row's position in its sequence
    offs_l = tl.arange(0, DL)
    offs_r = tl.arange(0, DR)
    qrow = Q + (q0 + tok).to(tl.int64)[:, None] * stride_qt + heads[:, None] * stride_qh
    q_n = tl.load(qrow + offs_l[None, :], mask=rmask[:, None], other=0.0).to(CDT)
    q_r = tl.load(qrow + DL + offs_r[None, :], mask=rmask[:, None], other=0.0).to(CDT)

    m_i = tl.full([BLOCK_T * BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_T * BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_T * BLOCK_H, DL], tl.float32)
    pt_row = PT + b.to(tl.int64) * stride_pt
    end = tl.minimum(seq, seq - q_len + t0 + BLOCK_T)  # the block's last position + 1
    for s in range(0, end, BLOCK_N):
        m_i, l_i, acc = mla_tile_step(
            q_n, q_r, m_i, l_i, acc, KV, KBS, pt_row, s, end, pos, stride_kr, stride_kbr,
            qk_scale, page_shift, page_mask, DL, DR, BLOCK_N, True, FMT, CDT, IS_F32, ASM,
        )  # fmt: skip

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc * (kf / l_safe)[:, None]
    orow = OUT + (q0 + tok).to(tl.int64)[:, None] * stride_ot + heads[:, None] * stride_oh
    tl.store(orow + offs_l[None, :], o.to(OUT.dtype.element_ty), mask=rmask[:, None])
