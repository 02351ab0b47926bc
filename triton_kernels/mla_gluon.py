"""MLA decode, 64 heads a program, in Gluon on Hopper warpgroup MMAs (``kernel="mla_gluon"``).

``@gluon.jit`` code only; the planner and launcher live in ``kvpool.attention.mla_gluon``
(bf16/fp16/fp8 caches, DeepSeek/Kimi's latent ``DL`` 512 + ``DR`` 64, sm_90, Triton 3.6).

Absorbed MLA (see ``mla.py``): every head of a request attends to the same latent rows, K = the
whole row of ``DL + DR`` values, V = its first ``DL``. One program = one request x ``BLOCK_H``
= 64 heads x one KV split, 8 warps = two warpgroups (grid ``(cdiv(H, 64), B, splits)``: at 128
heads the two head blocks of a request run side by side and share its tiles through L2).

Why (issue 17): Triton's head-block kernel with 64 heads and 8 warps let both warpgroups compute
the same 64 x 64 score tile and overlapped the loads poorly (244 TFLOP/s bf16 on the H200 at
DeepSeek TP 1, B=64 x 8k). Here the work is split between the warpgroups without duplication,
by the accumulator layouts (``warps_per_cta [4, 2]``: warps 0-3 = warpgroup 0 on the M side,
the two warpgroups side by side on N):

- ``S = Q K^T`` ``[64 heads, BLOCK_N tokens]``: Q (``[64, DL]`` and ``[64, DR]``, cast to the
  cache's dtype) is staged once in shared memory as the A operand; K^T is the tile in shared
  memory seen transposed (K-major B). Warpgroup ``w`` computes tokens ``w * BLOCK_N / 2 ..``;
  the row max / sum of the softmax cross the two warpgroups through shared memory (the
  compiler's reductions).
- ``P`` (the cache's dtype) goes to shared memory, the A operand of ``O += P V``, ``O [64, DL]``
  fp32: warpgroup ``w`` holds value columns ``w * DL / 2 ..`` (``[64, 256]``, 128 registers a
  thread). V is the same shared tile's first ``DL`` columns (N-major B): read from global once.
- Loads: a ring of ``STAGES`` tiles (``[BLOCK_N, DL]`` and ``[BLOCK_N, DR]``) filled by
  ``cp.async`` with one row address per token from the page table (any page size), so tile
  ``i + STAGES - 1``'s copies run under tile ``i``'s MMAs; the page ids of the tile issued next
  are loaded one iteration ahead. Rows past ``seq_len`` repeat the last token (their scores
  are masked), so no load is masked and no slot at or past ``seq_len`` is read.
- fp8 caches (e4m3, e5m2): the ring holds the cache's bytes (half the shared memory a stage);
  each tile is widened to fp16 into one more shared buffer, the MMAs' operand (Hopper's fp8
  MMA takes B K-major only, and V = the tile is N-major); the per-tensor scale multiplies the
  scores and the output (split outputs: the merge applies it).

Online softmax in log2 units as the repo's other kernels. ``FINAL`` (one split): ``out [B, H,
DL]``; else the split's normalized partial output ``PO [B*H, num_splits, DL]`` fp32 and its
log2-sum-exp ``PL [B*H, num_splits]`` (an empty split: (0, -inf)) for ``decode.merge_kernel``.

Shared memory: Q 72 KiB + ``STAGES`` x ``BLOCK_N`` x 1,152 bytes (fp8: 576, plus one fp16 tile)
+ P (``64 x BLOCK_N`` x 2): 64-token tiles fit 2 stages, 32-token tiles 2..4 (fp8: 2..6) in
227 KiB a block; one program a multiprocessor.
"""

import triton  # noqa: F401  (Gluon needs Triton's runtime)
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

LOG2E = gl.constexpr(1.4426950408889634)
BLOCK_H = gl.constexpr(64)  # heads a program: the M of one warpgroup MMA


@triton.constexpr_function
def _acc_layout(n):
    """Accumulator ``[64, n]`` of both warpgroups side by side on N (``n / 2`` columns each)."""
    return gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, n // 2, 16]
    )


@triton.constexpr_function
def _row_layout(n, v=8, rows=64):
    """Loads of ``[rows, n]`` values, ``v`` (16 bytes) a lane: a warp along one row (``n``
    >= 32 v) or along several rows of ``n`` values, the 8 warps on rows. ``v`` shrinks where
    the 256 threads would otherwise cover more than the tile (duplicate copies)."""
    v = min(v, n * rows // 256)
    if n >= 32 * v:
        return gl.BlockedLayout([1, v], [1, 32], [8, 1], [1, 0])
    return gl.BlockedLayout([1, v], [32 * v // n, n // v], [8, 1], [1, 0])


@gluon.jit
def _widen(src, dst, LAYOUT: gl.constexpr, BN: gl.constexpr, ROWS: gl.constexpr):
    """fp8 cache tile ``src [BN, n]`` in shared memory -> fp16 ``dst`` (the MMA operand),
    ``ROWS`` rows at a time (few registers: the O accumulator holds 128 a thread)."""
    for r in gl.static_range(0, BN, ROWS):
        x = src.slice(r, ROWS, dim=0).load(LAYOUT)
        dst.slice(r, ROWS, dim=0).store(x.to(gl.float16))


@gluon.jit
def _rows(s, end, pt_row, page_shift, page_mask, r):
    """Cache rows (int64) of tokens ``s + r``, clamped to ``[0, end - 1]`` (rows past the end
    repeat the last token; an empty request reads row 0 of page 0, never used)."""
    t = gl.maximum(gl.minimum(s + r, end - 1), 0)
    page = gl.load(pt_row + (t >> page_shift), mask=t < end, other=0)
    return page.to(gl.int64) * (page_mask + 1) + (t & page_mask)


@gluon.jit
def _issue(kn_s, kr_s, stage, KV, stride_kr, rows_n, rows_r, cn, cr, DL: gl.constexpr):
    """cp.async of one tile's rows (``rows_n`` in the ``DL`` piece's load layout, ``rows_r``
    in the ``DR`` piece's) into ring stage ``stage``: one commit group."""
    async_copy.async_copy_global_to_shared(
        kn_s.index(stage), KV + (rows_n * stride_kr)[:, None] + cn[None, :]
    )
    async_copy.async_copy_global_to_shared(
        kr_s.index(stage), KV + DL + (rows_r * stride_kr)[:, None] + cr[None, :]
    )
    async_copy.commit_group()


@gluon.jit
def _softmax(sacc, s, cols, end, qk_scale, m_i, l_i):
    """Online-softmax step over the raw scores ``sacc [64, BN]`` of the tile at token ``s``
    (columns ``s + cols`` at or past ``end`` masked), log2 units: ``(p, m_new, l_new, alpha)``.
    A tile without tokens (an empty split's peeled first tile) gives p = 0, alpha = 0."""
    sacc = gl.where(((s + cols) < end)[None, :], sacc * qk_scale, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(sacc, axis=1))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_safe)
    p = gl.exp2(sacc - m_safe[:, None])
    return p, m_new, l_i * alpha + gl.sum(p, axis=1), alpha


@gluon.jit
def _operands(kn_s, kr_s, wn_s, wr_s, st, wb, FP8: gl.constexpr, GN: gl.constexpr,
              GR: gl.constexpr, BN: gl.constexpr):  # fmt: skip
    """The MMA operands of the landed tile in ring stage ``st``: the stage itself (16-bit
    caches), or (fp8) the tile widened into fp16 buffer ``wb`` (fenced, all threads synced)."""
    kn = kn_s.index(st)
    kr = kr_s.index(st)
    if FP8:
        wn = wn_s.index(wb)
        wr = wr_s.index(wb)
        _widen(kn, wn, GN, BN, 16)
        _widen(kr, wr, GR, BN, BN)
        fence_async_shared()
        gl.thread_barrier()  # the whole fp16 tile is in shared memory
        kn = wn
        kr = wr
    return kn, kr


@gluon.jit
def _pipelined(qn_s, qr_s, kn_s, kr_s, wn_s, wr_s, p_s, KV, stride_kr, start, end, pt_row,
               page_shift, page_mask, rn, rr, cn, cr, nrn, nrr, m_i, l_i, acc, s_zero, cols,
               qk_scale, DL: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr,
               FP8: gl.constexpr, GN: gl.constexpr, GR: gl.constexpr,
               O_L: gl.constexpr):  # fmt: skip
    """``PIPE``: tile i's scores and softmax run while tile i - 1's ``P V`` is on the tensor
    cores (asynchronous warpgroup MMAs). Tile 0 is peeled (its ``P V`` runs in iteration 1,
    the last tile's after the loop); every stage is filled up front and tile i - 1's stage is
    refilled (with tile i - 1 + STAGES) once its ``P V`` is done. Returns ``(m, l, acc)``."""
    async_copy.wait_group(STAGES - 1)
    fence_async_shared()
    gl.thread_barrier()
    kn, kr = _operands(kn_s, kr_s, wn_s, wr_s, 0, 0, FP8, GN, GR, BN)
    sacc = warpgroup_mma(qn_s, kn.permute((1, 0)), s_zero, use_acc=False)
    sacc = warpgroup_mma(qr_s, kr.permute((1, 0)), sacc)
    p, m_i, l_i, alpha = _softmax(sacc, start, cols, end, qk_scale, m_i, l_i)
    p_s.store(p.to(p_s.dtype))
    fence_async_shared()
    gl.thread_barrier()  # P of tile 0 in shared memory
    i = 1
    for s in range(start + BN, end, BN):
        async_copy.wait_group(STAGES - 2)  # tile i has landed
        fence_async_shared()
        gl.thread_barrier()
        kn, kr = _operands(kn_s, kr_s, wn_s, wr_s, i % STAGES, i % 2, FP8, GN, GR, BN)
        if FP8:
            v = wn_s.index((i - 1) % 2)
        else:
            v = kn_s.index((i - 1) % STAGES)
        ts = warpgroup_mma(qn_s, kn.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        ts = warpgroup_mma(qr_s, kr.permute((1, 0)), ts, is_async=True)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
        to = warpgroup_mma(p_s, v, acc, is_async=True)  # tile i - 1's P V
        sacc = warpgroup_mma_wait(1, deps=[ts])  # (the scores' groups were committed first)
        p, m_i, l_i, alpha = _softmax(sacc, s, cols, end, qk_scale, m_i, l_i)
        acc = warpgroup_mma_wait(0, deps=[to])
        gl.thread_barrier()  # both warpgroups are done with P and tile i - 1
        p_s.store(p.to(p_s.dtype))
        _issue(kn_s, kr_s, (i - 1) % STAGES, KV, stride_kr, nrn, nrr, cn, cr, DL)
        sn = s + STAGES * BN  # (tile i + STAGES; past the end: the last token again, unused)
        nrn = _rows(sn, end, pt_row, page_shift, page_mask, rn)
        nrr = _rows(sn, end, pt_row, page_shift, page_mask, rr)
        fence_async_shared()
        gl.thread_barrier()  # P of tile i in shared memory
        i += 1
    if FP8:
        v = wn_s.index((i - 1) % 2)
    else:
        v = kn_s.index((i - 1) % STAGES)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
    acc = warpgroup_mma(p_s, v, acc)
    return m_i, l_i, acc


@gluon.jit(do_not_specialize=["stride_pt", "num_splits"])  # (they change between steps)
def mla_gluon_decode_kernel(
    Q,
    KV,
    KSC,
    PT,
    SEQ,
    OUT,
    PO,
    PL,
    stride_qb,
    stride_qh,
    stride_kr,
    stride_pt,
    stride_ob,
    stride_oh,
    sm_scale,
    page_shift,
    num_splits,
    H,
    DL: gl.constexpr,
    DR: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    FINAL: gl.constexpr,
    PIPE: gl.constexpr = False,
):
    """Grid ``(cdiv(H, 64), B, num_splits)``, 8 warps. ``Q [B, H, DL + DR]`` (any float
    dtype; cast to the cache's, fp16 for fp8), ``KV [R, DL + DR]`` bf16/fp16/fp8 rows (stride
    ``stride_kr`` values, 16-byte aligned), ``KSC`` fp8's per-tensor scale (unused for 16-bit
    caches), ``PT [B, max_pages]`` / ``SEQ [B]`` int32, ``OUT [B, H, DL]``; ``PO`` / ``PL`` as
    in the module docstring (unused with ``FINAL``; fp8: without the scale, the merge's)."""
    gl.static_assert(DL == 512 and DR == 64, "the latent is 512 + 64 values (DeepSeek/Kimi)")
    gl.static_assert(STAGES >= 2, "a ring of >= 2 stages")
    gl.static_assert(BLOCK_N == 32 or BLOCK_N == 64, "32- or 64-token tiles")
    # fp8 caches: the ring holds the cache's bytes; each tile is widened to fp16 in shared
    # memory (one buffer) for the MMAs, the scale folded into the scores and the output
    FP8: gl.constexpr = KV.dtype.element_ty.is_fp8()
    CDT: gl.constexpr = gl.float16 if FP8 else KV.dtype.element_ty
    S_L: gl.constexpr = _acc_layout(BLOCK_N)
    O_L: gl.constexpr = _acc_layout(DL)
    LN: gl.constexpr = _row_layout(DL)
    LR: gl.constexpr = _row_layout(DR)
    V8: gl.constexpr = 16 if FP8 else 8  # cache values a 16-byte copy
    GN: gl.constexpr = _row_layout(DL, V8, BLOCK_N)  # (the ring's copies)
    GR: gl.constexpr = _row_layout(DR, V8, BLOCK_N)
    SW_N: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, DL], CDT)
    SW_R: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, DR], CDT)
    SW_P: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], CDT)

    hb = gl.program_id(0)
    b = gl.program_id(1)
    split = gl.program_id(2)
    page_mask = (1 << page_shift) - 1
    seq = gl.load(SEQ + b)
    chunk = gl.cdiv(gl.cdiv(seq, num_splits), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = gl.minimum(start + chunk, seq)
    pt_row = PT + b.to(gl.int64) * stride_pt
    kf = 1.0
    if FP8:
        kf = gl.load(KSC)
    qk_scale = sm_scale * kf * LOG2E

    # Q once into shared memory (A operand of S), heads past H zero
    qh = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, LN))
    qc = gl.arange(0, DL, layout=gl.SliceLayout(0, LN))
    qrow = Q + b.to(gl.int64) * stride_qb + qh[:, None] * stride_qh
    qn = gl.load(qrow + qc[None, :], mask=(qh < H)[:, None], other=0.0).to(CDT)
    qn_s = gl.allocate_shared_memory(CDT, [BLOCK_H, DL], SW_N, qn)
    qhr = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, LR))
    qcr = gl.arange(0, DR, layout=gl.SliceLayout(0, LR))
    qrow_r = Q + b.to(gl.int64) * stride_qb + qhr[:, None] * stride_qh + DL
    qr = gl.load(qrow_r + qcr[None, :], mask=(qhr < H)[:, None], other=0.0).to(CDT)
    qr_s = gl.allocate_shared_memory(CDT, [BLOCK_H, DR], SW_R, qr)

    if FP8:
        C8: gl.constexpr = KV.dtype.element_ty
        G8N: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, DL], C8)
        G8R: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, DR], C8)
        kn_s = gl.allocate_shared_memory(C8, [STAGES, BLOCK_N, DL], G8N)
        kr_s = gl.allocate_shared_memory(C8, [STAGES, BLOCK_N, DR], G8R)
        # (PIPE: tile i - 1's widened copy is V while tile i is widened)
        WB: gl.constexpr = 2 if PIPE else 1
        wn_s = gl.allocate_shared_memory(CDT, [WB, BLOCK_N, DL], SW_N)
        wr_s = gl.allocate_shared_memory(CDT, [WB, BLOCK_N, DR], SW_R)
    else:
        kn_s = gl.allocate_shared_memory(CDT, [STAGES, BLOCK_N, DL], SW_N)
        kr_s = gl.allocate_shared_memory(CDT, [STAGES, BLOCK_N, DR], SW_R)
        wn_s = kn_s  # (unused)
        wr_s = kr_s
    p_s = gl.allocate_shared_memory(CDT, [BLOCK_H, BLOCK_N], SW_P)

    rn = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, GN))
    cn = gl.arange(0, DL, layout=gl.SliceLayout(0, GN))
    rr = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, GR))
    cr = gl.arange(0, DR, layout=gl.SliceLayout(0, GR))
    # PIPE: every stage filled up front (tile i - 1's stage stays V while tile i is scored)
    PRE: gl.constexpr = STAGES if PIPE else STAGES - 1
    for j in gl.static_range(PRE):
        sj = start + j * BLOCK_N
        _issue(
            kn_s, kr_s, j, KV, stride_kr,
            _rows(sj, end, pt_row, page_shift, page_mask, rn),
            _rows(sj, end, pt_row, page_shift, page_mask, rr),
            cn, cr, DL,
        )  # fmt: skip
    sn = start + PRE * BLOCK_N
    nrn = _rows(sn, end, pt_row, page_shift, page_mask, rn)
    nrr = _rows(sn, end, pt_row, page_shift, page_mask, rr)

    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_L))
    l_i = gl.zeros([BLOCK_H], gl.float32, layout=gl.SliceLayout(1, S_L))
    acc = gl.zeros([BLOCK_H, DL], gl.float32, layout=O_L)
    s_zero = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=S_L)
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_L))
    fence_async_shared()  # (Q's stores before the MMAs' reads; a barrier follows)
    if PIPE:
        m_i, l_i, acc = _pipelined(
            qn_s, qr_s, kn_s, kr_s, wn_s, wr_s, p_s, KV, stride_kr, start, end, pt_row,
            page_shift, page_mask, rn, rr, cn, cr, nrn, nrr, m_i, l_i, acc, s_zero, cols,
            qk_scale, DL, BLOCK_N, STAGES, FP8, GN, GR, O_L,
        )  # fmt: skip
    else:
        i = 0
        for s in range(start, end, BLOCK_N):
            # every warp is done with tile i - 1 (its stage is refilled now, and P rewritten
            # below): the MMAs are synchronous
            gl.thread_barrier()
            _issue(kn_s, kr_s, (i + STAGES - 1) % STAGES, KV, stride_kr, nrn, nrr, cn, cr, DL)
            sn = s + STAGES * BLOCK_N  # (past the end: the last token again, unused)
            nrn = _rows(sn, end, pt_row, page_shift, page_mask, rn)
            nrr = _rows(sn, end, pt_row, page_shift, page_mask, rr)
            async_copy.wait_group(STAGES - 1)
            # each thread's cp.async writes (generic proxy) ordered before the MMAs' async-proxy
            # reads, then every thread's rows visible: fence by the writer, then the barrier
            fence_async_shared()
            gl.thread_barrier()
            kn, kr = _operands(kn_s, kr_s, wn_s, wr_s, i % STAGES, 0, FP8, GN, GR, BLOCK_N)
            sacc = warpgroup_mma(qn_s, kn.permute((1, 0)), s_zero, use_acc=False)
            sacc = warpgroup_mma(qr_s, kr.permute((1, 0)), sacc)
            p, m_i, l_i, alpha = _softmax(sacc, s, cols, end, qk_scale, m_i, l_i)

            p_s.store(p.to(CDT))
            fence_async_shared()
            gl.thread_barrier()  # both warpgroups' halves of P are in shared memory
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
            acc = warpgroup_mma(p_s, kn, acc)
            i += 1
    async_copy.wait_group(0)  # (no copy outlives the program)

    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, O_L))
    m_o = gl.convert_layout(m_i, gl.SliceLayout(1, O_L))
    heads = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, O_L))
    oc = gl.arange(0, DL, layout=gl.SliceLayout(0, O_L))
    hmask = heads < H
    l_safe = gl.where(l_o > 0, l_o, 1.0)
    o = acc / l_safe[:, None]
    if FINAL:
        if FP8:
            o = o * kf  # (V's factor; the merge applies it to split outputs)
        optr = OUT + b.to(gl.int64) * stride_ob + heads[:, None] * stride_oh + oc[None, :]
        gl.store(optr, o.to(OUT.dtype.element_ty), mask=hmask[:, None])
    else:
        lse = gl.where(l_o > 0, m_o + gl.log2(l_safe), float("-inf"))
        row = (b * H + heads).to(gl.int64) * num_splits + split
        gl.store(PO + row[:, None] * DL + oc[None, :], o, mask=hmask[:, None])
        gl.store(PL + row, lse, mask=hmask)
