"""MLA decode for few heads per rank (8..32: DeepSeek-V3 and Kimi-K2 at TP 8), tokens on M.

``@triton.jit`` code only; the launcher lives in ``kvpool.attention.mla_small``.

``mla.mla_decode_kernel`` puts a block of heads on the tensor-core M dimension (>= 16 rows).
With 16 heads a program fills a quarter of a 64-row Hopper warpgroup MMA, keeps the whole query
``[16, 576]`` in registers as the A operand and is latency-bound. Here the operands are swapped
so that the long dimensions sit on M and the heads on N (8..256 on Hopper, 8+ for ``mma.sync``):

    S^T [BLOCK_N, HP]  = K_nope [BLOCK_N, DL] . q_nope^T [DL, HP] + K_rope . q_rope^T
    P^T                = exp2(S^T * qk_scale - m[None, :])       (softmax along tokens, axis 0)
    O^T [DL, HP]      += K_nope^T [DL, BLOCK_N] . P^T [BLOCK_N, HP]

``HP`` is the head count padded to a power of two (>= 16; padded query rows are zeros and
their columns are never stored). The query is the B operand of the first product and stays in
shared memory for the whole loop; the latent tile is the A operand of both products. The
accumulator ``O^T`` is ``DL x HP`` fp32 (512 x 16: 64 registers a thread at 4 warps).

Each latent row is read as two power-of-two pieces (``DL`` then ``DR`` values) by
``mla.latent_tile``, which dequantizes in registers with the helpers of ``decode`` (fp8 and FP4
word decodes; the per-tensor fp8 scale and the nvfp4 global scale are folded into the softmax
scale and into the output, or left to ``decode.merge_kernel`` for split runs). Masking as in
``decode``: no slot at or past ``seq_len`` is read, no page-table entry past
``ceil(seq_len / page_size)``.
"""

import triton
import triton.language as tl

from .decode import dequant, load_raw
from .mla import latent_factors, latent_tile, split_range, tile_slots

LOG2E = tl.constexpr(1.4426950408889634)  # (compiled Triton refuses plain globals in @jit)


@triton.jit
def latent_raw(
    KV,
    KBS,
    slot,
    mask,
    stride_kr,
    stride_kbr,
    OFF: tl.constexpr,
    D: tl.constexpr,
    FMT: tl.constexpr,
    ASM: tl.constexpr,
):
    """The stored bytes of ``mla.latent_tile``'s piece (``decode.load_raw``'s ``(data, block
    scales)``), to be decoded later by ``decode.dequant``: the prefetch variant issues a tile's
    loads one iteration before it decodes them."""
    if FMT >= 2:
        return load_raw(KV + OFF // 2, KBS + OFF // 16, slot, mask, 0, stride_kr, stride_kbr, D,
                        FMT, ASM)  # fmt: skip
    return load_raw(KV + OFF, KBS, slot, mask, 0, stride_kr, stride_kbr, D, FMT, ASM)


@triton.jit
def small_step(
    kn, kr, q_nt, q_rt, m_i, l_i, acc, tm, qk_scale, CDT: tl.constexpr, IS_F32: tl.constexpr
):
    """One online-softmax update of every head column over a dequantized tile ``kn [BLOCK_N,
    DL]`` / ``kr [BLOCK_N, DR]`` (rows where ``tm`` is false masked): ``(m_i, l_i, acc)``,
    ``m_i`` / ``l_i [HP]`` in log2 units, ``acc`` = O^T ``[DL, HP]`` fp32."""
    if IS_F32:
        qk = tl.dot(kn, q_nt, input_precision="tf32x3")
        qk = tl.dot(kr, q_rt, acc=qk, input_precision="tf32x3")
    else:
        qk = tl.dot(kn, q_nt)
        qk = tl.dot(kr, q_rt, acc=qk)
    qk = tl.where(tm[:, None], qk * qk_scale, float("-inf"))  # [BLOCK_N, HP]
    m_new = tl.maximum(m_i, tl.max(qk, 0))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(qk - m_safe[None, :])
    l_i = l_i * alpha + tl.sum(p, 0)
    if IS_F32:
        acc = tl.dot(tl.trans(kn), p, acc=acc * alpha[None, :], input_precision="tf32x3")
    else:
        acc = tl.dot(tl.trans(kn), p.to(CDT), acc=acc * alpha[None, :])
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["stride_pt", "num_splits"])
def mla_small_decode_kernel(
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
    HP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FINAL: tl.constexpr,
    FMT: tl.constexpr,
    CDT: tl.constexpr,
    IS_F32: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    FP4_MUL: tl.constexpr,
    ASM: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """Grid ``(B, num_splits)``: one program = every head of one request over one KV split.

    ``Q [B, H, DL + DR]`` (unit inner stride), ``OUT [B, H, DL]``. ``FINAL`` (one split): write
    ``OUT``; else the split's normalized partial output ``PO [B*H, num_splits, DL]`` fp32 and
    its log2-sum-exp ``PL [B*H, num_splits]`` (an empty split stores (0, -inf)), the layout and
    units of ``decode.merge_kernel``, which applies the V factor. ``stride_pt`` and
    ``num_splits`` change from step to step (the page table's width, the split model), so they
    are not specialized (no recompiles when they hit 1 or a multiple of 16)."""
    b = tl.program_id(0)
    split = tl.program_id(1)
    page_mask = (1 << page_shift) - 1
    E5M2: tl.constexpr = KV.dtype.element_ty == tl.float8e5
    start, end = split_range(SEQ, b, split, num_splits, BLOCK_N)

    kf, qk_scale = latent_factors(KSC, sm_scale, HAS_SCALE, FP4_MUL)

    heads = tl.arange(0, HP)
    hmask = heads < H
    offs_l = tl.arange(0, DL)
    offs_r = tl.arange(0, DR)
    # the query transposed, [D, HP]: the B operand of S^T = K q^T (padded heads read as 0)
    qcol = Q + b.to(tl.int64) * stride_qb + heads[None, :] * stride_qh
    q_nt = tl.load(qcol + offs_l[:, None], mask=hmask[None, :], other=0.0).to(CDT)
    q_rt = tl.load(qcol + DL + offs_r[:, None], mask=hmask[None, :], other=0.0).to(CDT)

    m_i = tl.full([HP], float("-inf"), tl.float32)
    l_i = tl.zeros([HP], tl.float32)
    acc = tl.zeros([DL, HP], tl.float32)  # O^T
    pt_row = PT + b.to(tl.int64) * stride_pt
    if PREFETCH:
        # Tile i + 1's bytes are loaded while tile i is used, and the tile the dots read is a
        # loop-carried value: Triton then stages it through shared memory as an A operand of
        # both warpgroup MMAs (a value dequantized in the loop body would be held in registers
        # as a register A operand, [BLOCK_N, DL] for S^T and [DL, BLOCK_N] for O^T: spills).
        slot, tm = tile_slots(pt_row, start, end, page_shift, page_mask, BLOCK_N)
        xn, sn = latent_raw(KV, KBS, slot, tm, stride_kr, stride_kbr, 0, DL, FMT, ASM)
        xr, sr = latent_raw(KV, KBS, slot, tm, stride_kr, stride_kbr, DL, DR, FMT, ASM)
        kn = dequant(xn, sn, BLOCK_N, DL, FMT, CDT, False, ASM, E5M2)
        kr = dequant(xr, sr, BLOCK_N, DR, FMT, CDT, False, ASM, E5M2)
        slot, tm_next = tile_slots(pt_row, start + BLOCK_N, end, page_shift, page_mask, BLOCK_N)
        for s in range(start, end, BLOCK_N):
            xn, sn = latent_raw(KV, KBS, slot, tm_next, stride_kr, stride_kbr, 0, DL, FMT, ASM)
            xr, sr = latent_raw(KV, KBS, slot, tm_next, stride_kr, stride_kbr, DL, DR, FMT, ASM)
            slot, tm_after = tile_slots(
                pt_row, s + 2 * BLOCK_N, end, page_shift, page_mask, BLOCK_N
            )
            m_i, l_i, acc = small_step(kn, kr, q_nt, q_rt, m_i, l_i, acc, tm, qk_scale, CDT,
                                       IS_F32)  # fmt: skip
            kn = dequant(xn, sn, BLOCK_N, DL, FMT, CDT, False, ASM, E5M2)
            kr = dequant(xr, sr, BLOCK_N, DR, FMT, CDT, False, ASM, E5M2)
            tm = tm_next
            tm_next = tm_after
    else:
        for s in range(start, end, BLOCK_N):
            slot, tm = tile_slots(pt_row, s, end, page_shift, page_mask, BLOCK_N)
            kn = latent_tile(KV, KBS, slot, tm, stride_kr, stride_kbr, 0, DL, BLOCK_N, FMT, CDT,
                             ASM)  # fmt: skip
            kr = latent_tile(KV, KBS, slot, tm, stride_kr, stride_kbr, DL, DR, BLOCK_N, FMT,
                             CDT, ASM)  # fmt: skip
            m_i, l_i, acc = small_step(kn, kr, q_nt, q_rt, m_i, l_i, acc, tm, qk_scale, CDT,
                                       IS_F32)  # fmt: skip

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    if FINAL:
        o = acc * (kf / l_safe)[None, :]
        tl.store(
            OUT + b.to(tl.int64) * stride_ob + heads[None, :] * stride_oh + offs_l[:, None],
            o.to(OUT.dtype.element_ty),
            mask=hmask[None, :],
        )
    else:
        o = acc / l_safe[None, :]
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        row = (b * H + heads).to(tl.int64) * num_splits + split
        tl.store(PO + row[None, :] * DL + offs_l[:, None], o, mask=hmask[None, :])
        tl.store(PL + row, lse, mask=hmask)
