"""Paged decode in Gluon with wider steps: several 16-token tiles per ring stage and several KV
heads per program, for every Gluon cache format (issue 17, head_dim 64).

``@gluon.jit`` code only; the planner and launcher are ``kvpool.attention.gluon_knobs``
(``plan_decode(..., gluon_knobs=GluonKnobs(multi=True, ...))``). Same operands and layouts as
``decode_gluon.py`` (fp8, and bf16/fp16: ``WIDE``) and ``decode_gluon_fp4.py`` (nvfp4,
fp4_mx_block16: ``FP4``), whose tile helpers this calls: one warp, ``mma.sync.m16n8k16``, K words
straight into K^T's B fragment, V^T as the PV dot's A side, P^T from S's accumulator.

Why: at head_dim 64 a token row of one KV head is 64 bytes (fp8) or 32 + 4 (FP4), so a
16-token tile moves 1-2 KiB and the fixed cost of a step (a page id load, two barriers, the
copy issue and wait, a cross-lane max and sum, the lazy-rescale test) dominates: the measured
kernels ran fp8 at 2.47 TB/s and nvfp4 at 2.25 TB/s of their bytes (run 13, H200, B=64 x 8k)
against ~4 TB/s for bf16 with the same structure and twice the bytes per tile. Bytes in flight
are not the limit: 4 splits put 15.5 one-warp programs on an SM, each with 2 tiles (4 KiB of
fp8) in its 3-stage ring, 62 KiB per SM against the ~30 KiB that 4 TB/s needs at ~1 us of
latency. Each program's step is: 128 tiles in 0.216 ms, 1.7 us (~3,300 cycles) per tile for
~210 SASS instructions, the SM issuing ~1 of its 4 instructions a cycle: a serial chain per tile
(copy wait, shared loads, 12 MMAs, shuffles for the row max, the lazy-rescale test and the row
sum, exp2s, a page id loaded one tile ahead) at any head_dim, so bytes per step set the rate
(head_dim 128: 1.58 us per 4 KiB tile). This kernel puts more bytes in each step:

- ``SUB`` (1, 2, 4) 16-token tiles per ring stage: one barrier pair, one copy wait and one row
  max (taken over the tiles' scores elementwise first) per ``16 SUB`` tokens; the tiles' QK and
  PV dots are independent work for the warp to overlap.
- ``HPP`` (1, 2) KV heads per program: a token's KV heads are adjacent in the pool
  (``[slot, head, head_dim]``), so one page id serves both; their two softmax chains interleave
  and share one lazy-rescale test. Grid ``(H_kv / HPP, B, splits)`` (KV heads fastest).
- ``STAGES`` ring stages, ``STAGES - 1`` in flight: bytes in flight per program
  ``(STAGES - 1) x SUB x HPP x`` the tile's bytes. A stage's page ids are loaded ``AHEAD``
  (1, 2) stages before its copies are issued (a page-id load must land within that many
  stages' work, or the issue waits on it).
- ``TMA``: the data rows by TMA boxes (one 16-row box per tile, head and K/V: no per-lane
  address math; sm_90+), else ``cp.async`` (16-byte pieces, rows past the end clamped). FP4 block
  scales always come by ``cp.async`` (4-byte pieces, clamped rows).
- The softmax runs on S's rows of the group only (8 of the MMA's 16 for groups <= 8, as the FP4
  kernel; the fp8 kernel exponentiates all 16), its row sums stay per lane until the end (no
  cross-lane sum per step), ``ex2.approx.ftz``.

Tiles start at multiples of 16 and need pages of >= 16 tokens (one page id per tile). TMA boxes
fetch a tile's 16 rows whole: rows past the split's end or before a window's first token are
read (within the tile's page). Their scores are masked; for fp8 and 16-bit caches their V words
are zeroed on such edge tiles (those bytes may be NaN: 0 * NaN would reach the output); E2M1
codes are finite and FP4 scale rows are clamped. No copy is in flight when a program exits.
Masking otherwise as in ``decode.py`` (KVB-16).
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
    _fold_sinks,
    _geometry_ok,
    _k_words_layout,
    _log2_scores,
    _program,
    _ring_layout,
    _rows0to7,
    _store_out,
    _store_partial,
    _tile_row0,
    _v_operand_wide,
    _v_words_layout,
)
from .decode_gluon import _k_operand as _k_operand8
from .decode_gluon import _v_operand as _v_operand8
from .decode_gluon_fp4 import _exp2, _pv, _scores, _smem_tile
from .decode_gluon_fp4 import _issue as _issue4
from .decode_gluon_fp4_layouts import (
    _fp4_k_layout,
    _fp4_row_swizzle,
    _fp4_scale_copy_layout,
    _fp4_softmax_layout,
    _fp4_v_layout,
)


@triton.constexpr_function
def _row_bytes(d, wide, fp4):
    """Bytes of one KV head's data row: ``d / 2`` (FP4), ``d`` (fp8), ``2 d`` (16-bit)."""
    return d // 2 if fp4 else (2 * d if wide else d)


@triton.constexpr_function
def _steps_ok(sub, hpp, stages, ahead):
    """Whether the kernel takes ``SUB`` tiles a stage, ``HPP`` heads a program, ``STAGES``
    ring stages and page ids ``AHEAD`` stages before their copies."""
    return sub in (1, 2, 4) and hpp in (1, 2) and stages >= 2 and ahead in (1, 2)


@triton.constexpr_function
def _operands(fp4, mx, wide):
    """The MMA operands' type: bf16 for bf16 and fp4_mx_block16 caches, else fp16."""
    return gl.bfloat16 if (mx if fp4 else wide == 2) else gl.float16


@triton.constexpr_function
def _tma_layout(row_bytes):
    """TMA box layout of ``16 x row_bytes`` bytes: the row's swizzle (none for 32-byte rows)."""
    return gl.NVMMASharedLayout(
        swizzle_byte_width=row_bytes if row_bytes >= 64 else 0, element_bitwidth=8, rank=2
    )


@gluon.jit
def _load_q(Q, b, hk, stride_qb, stride_qh, group, G: gl.constexpr, D: gl.constexpr,
            CDT: gl.constexpr, FP4: gl.constexpr, DEC_K: gl.constexpr):  # fmt: skip
    """KV head ``hk``'s query rows ``[16, D]`` (the A operand, head dims in the order of the
    format's K^T: ``decode_gluon`` / ``decode_gluon_fp4``); rows >= ``group`` (the runtime G,
    which the compiler cannot fold into q's zero registers) are zero."""
    qr = gl.arange(0, 16, layout=gl.SliceLayout(1, QOP))
    qc = gl.arange(0, D, layout=gl.SliceLayout(0, QOP))
    if FP4:
        qs = qc // 16
        qp = 2 * (qs % 4) + (qc // 8) % 2
        qe = qc % 2
        if DEC_K != 1:
            nib = qp % 4 + 4 * qe
        else:
            nib = 4 * (qp % 2) + (qp % 4) // 2 + 2 * qe
        phys = (D // 4) * ((qc // 2) % 4) + 16 * (qs // 4) + 8 * (qp // 4) + nib
    else:
        phys = (D // 4) * ((qc // 2) % 4) + 4 * (qc // 16) + 2 * ((qc // 8) % 2) + qc % 2
    return gl.load(
        Q + b * stride_qb + (hk * G + qr)[:, None] * stride_qh + phys[None, :],
        mask=(qr < group)[:, None],
        other=0.0,
    ).to(CDT)


@gluon.jit
def _issue8(bufs, slot, bar, s, end, lo, row0, kw_ptr, vw_ptr, srk, srv, descs, col,
            NW: gl.constexpr, GUARD: gl.constexpr, WINDOW: gl.constexpr,
            TMA: gl.constexpr):  # fmt: skip
    """fp8 / 16-bit: one tile's K and V rows of one head into ring slot ``slot``: two TMA boxes
    from ``row0`` (column ``col`` bytes) on ``bar``, or cp.async of rows ``row0 + r`` with ``r``
    clamped to the tile's tokens in ``[lo, end)`` (words at ``kw_ptr`` / ``vw_ptr``, row strides
    ``srk`` / ``srv`` words; the caller commits)."""
    kd, vd = bufs
    if TMA:
        kdesc, vdesc = descs
        r = row0.to(gl.int32)
        tma.async_copy_global_to_shared(kdesc, [r, col], bar, kd.index(slot))
        tma.async_copy_global_to_shared(vdesc, [r, col], bar, vd.index(slot))
    else:
        KL: gl.constexpr = _k_words_layout(NW)
        VL: gl.constexpr = _v_words_layout(NW)
        lim = end - 1 - s
        if GUARD:  # (the prologue: an empty request)
            lim = gl.maximum(lim, 0)
        rk = gl.minimum(gl.arange(0, 16, layout=gl.SliceLayout(1, KL)), lim)
        rv = gl.minimum(gl.arange(0, 16, layout=gl.SliceLayout(1, VL)), lim)
        if WINDOW:
            rk = gl.maximum(rk, lo - s)
            rv = gl.maximum(rv, lo - s)
        ck = gl.arange(0, NW, layout=gl.SliceLayout(0, KL))
        cv = gl.arange(0, NW, layout=gl.SliceLayout(0, VL))
        async_copy.async_copy_global_to_shared(
            kd.index(slot), (kw_ptr + row0 * srk) + ((rk * srk)[:, None] + ck[None, :])
        )
        async_copy.async_copy_global_to_shared(
            vd.index(slot), (vw_ptr + row0 * srv) + ((rv * srv)[:, None] + cv[None, :])
        )


@gluon.jit
def _words(buf, slot, L: gl.constexpr, NW: gl.constexpr, TMA: gl.constexpr):
    """A ring slot's ``[16, NW]`` words in register layout ``L`` (TMA's byte boxes read as
    int32 in the same swizzle, ``decode_gluon._ring_layout``)."""
    x = buf.index(slot)
    if TMA:
        x = x._reinterpret(gl.int32, [16, NW], _ring_layout(NW))
    return x.load(L)


@gluon.jit
def _tile_scores(q, bufs, slot, s, sc, sm, FP4: gl.constexpr, E5M2: gl.constexpr,
                 WIDE: gl.constexpr, DEC_K: gl.constexpr, D: gl.constexpr, NH: gl.constexpr,
                 TMA: gl.constexpr, HAS_SOFTCAP: gl.constexpr,
                 HAS_WINDOW: gl.constexpr):  # fmt: skip
    """Scores ``[NH, 16]`` (log2 units, masked) of the tile in ring slot ``slot`` at token ``s``."""
    S8: gl.constexpr = _fp4_softmax_layout(NH)
    if FP4:
        kx, ks = _smem_tile(bufs, 0, slot, _fp4_k_layout(D), _fp4_row_swizzle(D), TMA, D)
        out = _scores(q, kx, ks, s, sc, sm, MMA, KOP, S8, DEC_K, HAS_SOFTCAP, HAS_WINDOW, D, NH)
    else:
        NW: gl.constexpr = D // 2 if WIDE else D // 4
        kw = _words(bufs[0], slot, _k_words_layout(NW), NW, TMA)
        kt = _k_operand8(kw, KOP, E5M2, D, WIDE)
        sacc = mma_v2(q, kt, gl.zeros([16, 16], gl.float32, layout=MMA))
        if NH == 8:
            sacc = gl.convert_layout(_rows0to7(sacc, 16), S8, assert_trivial=True)
        qk_scale, softcap, end, lo = sm
        out = _log2_scores(sacc, s, sc, qk_scale, softcap, end, lo, HAS_SOFTCAP, HAS_WINDOW)
    return out


@gluon.jit
def _tile_pv(acc, p, bufs, slot, s, end, lo, FP4: gl.constexpr, E5M2: gl.constexpr,
             WIDE: gl.constexpr, DEC_V: gl.constexpr, D: gl.constexpr, TMA: gl.constexpr,
             CDT: gl.constexpr):  # fmt: skip
    """``acc += V^T P^T`` for the tile in ring slot ``slot`` at token ``s`` (``p`` ``[NH, 16]``).
    fp8 / 16-bit by TMA: on a tile with rows outside ``[lo, end)`` those rows' V words are
    zeroed first (the box read them; p is 0 there but the bytes may be NaN)."""
    if FP4:
        vx, vs = _smem_tile(bufs, 1, slot, _fp4_v_layout(D), _fp4_row_swizzle(D), TMA, D)
        acc = _pv(acc, vx, vs, p, VOP, POP, CDT, DEC_V, D)
    else:
        NW: gl.constexpr = D // 2 if WIDE else D // 4
        VL: gl.constexpr = _v_words_layout(NW)
        vw = _words(bufs[1], slot, VL, NW, TMA)
        if TMA:
            if (s + 16 > end) | (s < lo):
                r = s + gl.arange(0, 16, layout=gl.SliceLayout(1, VL))
                vw = gl.where(((r < end) & (r >= lo))[:, None], vw, 0)
        if WIDE:
            vt = _v_operand_wide(vw, VOP, D, WIDE)
        else:
            vt = _v_operand8(vw, VOP, E5M2, D)
        pt = gl.convert_layout(gl.permute(p.to(CDT), [1, 0]), POP, assert_trivial=True)
        acc = mma_v2(vt, pt, acc)
    return acc


@gluon.jit
def _head_scores(q, bufs, base, s, sc, sm, SUB: gl.constexpr, HPP: gl.constexpr,
                 FP4: gl.constexpr, E5M2: gl.constexpr, WIDE: gl.constexpr,
                 DEC_K: gl.constexpr, D: gl.constexpr, NH: gl.constexpr, TMA: gl.constexpr,
                 HAS_SOFTCAP: gl.constexpr, HAS_WINDOW: gl.constexpr):  # fmt: skip
    """One head's scores of a stage's ``SUB`` tiles (slots ``base + u HPP``; unused ones repeat
    the first) and their row max (elementwise over the tiles, then one cross-lane max)."""
    s0 = _tile_scores(q, bufs, base, s, sc, sm, FP4, E5M2, WIDE, DEC_K, D, NH, TMA,
                      HAS_SOFTCAP, HAS_WINDOW)  # fmt: skip
    s1 = s0
    s2 = s0
    s3 = s0
    mx = s0
    if SUB >= 2:
        s1 = _tile_scores(q, bufs, base + HPP, s + 16, sc, sm, FP4, E5M2, WIDE, DEC_K, D, NH,
                          TMA, HAS_SOFTCAP, HAS_WINDOW)  # fmt: skip
        mx = gl.maximum(mx, s1)
    if SUB == 4:
        s2 = _tile_scores(q, bufs, base + 2 * HPP, s + 32, sc, sm, FP4, E5M2, WIDE, DEC_K, D,
                          NH, TMA, HAS_SOFTCAP, HAS_WINDOW)  # fmt: skip
        s3 = _tile_scores(q, bufs, base + 3 * HPP, s + 48, sc, sm, FP4, E5M2, WIDE, DEC_K, D,
                          NH, TMA, HAS_SOFTCAP, HAS_WINDOW)  # fmt: skip
        mx = gl.maximum(mx, gl.maximum(s2, s3))
    return s0, s1, s2, s3, gl.max(mx, axis=1)


@gluon.jit
def _head_pv(acc, l_p, m_i, s0, s1, s2, s3, bufs, base, s, end, lo, SUB: gl.constexpr,
             HPP: gl.constexpr, FP4: gl.constexpr, E5M2: gl.constexpr, WIDE: gl.constexpr,
             DEC_V: gl.constexpr, D: gl.constexpr, TMA: gl.constexpr,
             CDT: gl.constexpr):  # fmt: skip
    """One head's ``p = 2^(s - m)`` of a stage's tiles into its per-lane row sums ``l_p``
    ``[NH, 16]`` and ``acc``."""
    p = _exp2(s0 - m_i[:, None])
    lp = p
    acc = _tile_pv(acc, p, bufs, base, s, end, lo, FP4, E5M2, WIDE, DEC_V, D, TMA, CDT)
    if SUB >= 2:
        p = _exp2(s1 - m_i[:, None])
        lp = lp + p
        acc = _tile_pv(acc, p, bufs, base + HPP, s + 16, end, lo, FP4, E5M2, WIDE, DEC_V, D,
                       TMA, CDT)  # fmt: skip
    if SUB == 4:
        p = _exp2(s2 - m_i[:, None])
        lp = lp + p
        acc = _tile_pv(acc, p, bufs, base + 2 * HPP, s + 32, end, lo, FP4, E5M2, WIDE, DEC_V,
                       D, TMA, CDT)  # fmt: skip
        p = _exp2(s3 - m_i[:, None])
        lp = lp + p
        acc = _tile_pv(acc, p, bufs, base + 3 * HPP, s + 48, end, lo, FP4, E5M2, WIDE, DEC_V,
                       D, TMA, CDT)  # fmt: skip
    return acc, l_p + lp


@gluon.jit
def _rescaled(m_i, l_p, acc, m_new):
    """The running max moved to ``m_new``: ``l_p`` and ``acc`` (per head) scaled to it."""
    alpha = _exp2(m_i - m_new)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(0, MMA))[None, :]
    return m_new, l_p * alpha[:, None], acc


@gluon.jit
def _stage_rows(s, last, end, pt_row, page_shift, page_mask, SUB: gl.constexpr,
                GUARD: gl.constexpr):  # fmt: skip
    """First cache rows (int64) of the stage's tiles at ``s + 16 u`` (clamped to the last tile
    ``last``; ``GUARD``: page 0 for an empty request); unused ones repeat the first."""
    r0 = _tile_row0(gl.minimum(s, last), end, pt_row, page_shift, page_mask, GUARD)
    r1 = r0
    r2 = r0
    r3 = r0
    if SUB >= 2:
        r1 = _tile_row0(gl.minimum(s + 16, last), end, pt_row, page_shift, page_mask, GUARD)
    if SUB == 4:
        r2 = _tile_row0(gl.minimum(s + 32, last), end, pt_row, page_shift, page_mask, GUARD)
        r3 = _tile_row0(gl.minimum(s + 48, last), end, pt_row, page_shift, page_mask, GUARD)
    return r0, r1, r2, r3


@gluon.jit
def _issue_stage(bufs, bars, stage, s, last, end, lo, rows, ptrs, strides, descs, col,
                 SUB: gl.constexpr, HPP: gl.constexpr, FP4: gl.constexpr, D: gl.constexpr,
                 NW: gl.constexpr, RB: gl.constexpr, GUARD: gl.constexpr,
                 WINDOW: gl.constexpr, TMA: gl.constexpr):  # fmt: skip
    """Copies of ring stage ``stage``: its ``SUB`` tiles (at ``s + 16 u``, clamped to ``last``;
    first rows ``rows``) for each of the ``HPP`` heads (slot ``(stage SUB + u) HPP + h``), the
    TMA barrier armed for all of their boxes; one cp.async commit group when any is used."""
    if TMA:
        mbarrier.expect(bars.index(stage), SUB * HPP * 2 * 16 * RB)
    r0, r1, r2, r3 = rows
    CD: gl.constexpr = _fp4_k_layout(D)  # (FP4: the data and scale copies' lane maps)
    CS: gl.constexpr = _fp4_scale_copy_layout(D)
    for u in gl.static_range(SUB):
        su = gl.minimum(s + 16 * u, last)
        if u == 0:
            row0 = r0
        elif u == 1:
            row0 = r1
        elif u == 2:
            row0 = r2
        else:
            row0 = r3
        for h in gl.static_range(HPP):
            slot = (stage * SUB + u) * HPP + h
            if FP4:
                kx_ptr, vx_ptr, ks_ptr, vs_ptr = ptrs
                hp = (kx_ptr + h * (D // 16), vx_ptr + h * (D // 16), ks_ptr + h * (D // 16),
                      vs_ptr + h * (D // 16))  # fmt: skip
                hd = None
                if TMA:
                    hd = (descs[0], descs[1], bars, col + h * RB)
                _issue4(
                    bufs, slot, stage, su, end, lo, row0, hp, strides,
                    gl.arange(0, 16, layout=gl.SliceLayout(1, CD)),
                    gl.arange(0, D // 16, layout=gl.SliceLayout(0, CD)),
                    gl.arange(0, 16, layout=gl.SliceLayout(1, CS)),
                    gl.arange(0, D // 16, layout=gl.SliceLayout(0, CS)),
                    GUARD, WINDOW, hd, TMA,
                )  # fmt: skip
            else:
                kw_ptr, vw_ptr = ptrs
                srk, srv = strides
                _issue8(bufs, slot, bars.index(stage), su, end, lo, row0, kw_ptr + h * NW,
                        vw_ptr + h * NW, srk, srv, descs, col + h * RB, NW, GUARD, WINDOW,
                        TMA)  # fmt: skip
    if FP4 or not TMA:
        async_copy.commit_group()


@gluon.jit
def _finish(acc, l_p, m_i, b, hk, split, num_splits, OUT, PO, PL, SINKS, stride_ob, stride_oh,
            out_mul, part_mul, G: gl.constexpr, NH: gl.constexpr, D: gl.constexpr,
            GH: gl.constexpr, FINAL: gl.constexpr, HAS_SINKS: gl.constexpr,
            HEAD_FAST: gl.constexpr):  # fmt: skip
    """KV head ``hk``'s output: ``acc [D, NH]`` over its row sums (the per-lane ``l_p`` summed),
    times ``out_mul`` (``FINAL``, sinks folded) or ``part_mul`` (a split's partial output and
    log2-sum-exp for ``decode.merge_kernel``; ``GH`` = G x HPP, the query heads per program).
    Value dims in the kernels' order: logical row ``16m + 8r + g`` stored at
    ``(D / 8) g + 2m + r``."""
    l8 = gl.convert_layout(gl.sum(l_p, axis=1), gl.SliceLayout(0, MMA))
    m8 = gl.convert_layout(m_i, gl.SliceLayout(0, MMA))
    orow = gl.arange(0, D, layout=gl.SliceLayout(1, MMA))
    ocol = gl.arange(0, NH, layout=gl.SliceLayout(0, MMA))
    dv = (D // 8) * (orow % 8) + 2 * (orow // 16) + (orow // 8) % 2
    hmask = ocol < G
    heads = hk * G + ocol
    l_safe = gl.where(l8 > 0, l8, 1.0)
    if FINAL:
        if HAS_SINKS:
            acc, l8 = _fold_sinks(acc, l8, m8, SINKS, heads, hmask)
            l_safe = gl.where(l8 > 0, l8, 1.0)
        _store_out(OUT, acc * (out_mul / l_safe)[None, :], b, heads, hmask, dv, stride_ob,
                   stride_oh)  # fmt: skip
    else:
        o = acc * (part_mul / l_safe)[None, :]
        _store_partial(PO, PL, o, l8, m8, b, heads, hmask, dv, split, num_splits, GH, HEAD_FAST)


@gluon.jit(do_not_specialize=["group"])  # (a group of 1 would become a constant)
def decode_kernel(
    Q, K, V, KBS, VBS, KSC, VSC, PT, SEQ, SINKS, OUT, PO, PL,
    stride_qb, stride_qh, stride_kr, stride_vr, stride_ksr, stride_vsr, stride_pt, stride_ob,
    stride_oh, sm_scale, softcap, window, page_shift, num_splits, group,
    KD=None,
    VD=None,
    G: gl.constexpr = 8,
    D: gl.constexpr = 64,
    FINAL: gl.constexpr = False,
    FP4: gl.constexpr = False,
    E5M2: gl.constexpr = False,
    WIDE: gl.constexpr = 0,
    DEC_K: gl.constexpr = 1,
    DEC_V: gl.constexpr = 1,
    HAS_SOFTCAP: gl.constexpr = False,
    HAS_WINDOW: gl.constexpr = False,
    HAS_SINKS: gl.constexpr = False,
    STAGES: gl.constexpr = 3,
    SUB: gl.constexpr = 2,
    HPP: gl.constexpr = 1,
    RESCALE: gl.constexpr = 8.0,
    TMA: gl.constexpr = True,
    HEAD_FAST: gl.constexpr = True,
    AHEAD: gl.constexpr = 1,
):  # fmt: skip
    """Grid ``(H_kv / HPP, B, splits)`` (``HEAD_FAST``; else ``(B, H_kv / HPP, splits)``).

    ``Q [B, H_q, D]`` (16-bit), ``K``/``V`` the cache rows ``[R, H_kv, row]`` (fp8 / 16-bit /
    FP4 bytes), ``KBS``/``VBS`` FP4 block scales (bytes, row strides ``stride_ksr``/``_vsr``;
    unused otherwise), ``KSC``/``VSC`` per-tensor scales (fp8, nvfp4; mx: the scale rows,
    unused), ``PT [B, pages]`` int32, ``SEQ [B]`` int32, ``SINKS [H_q]``, ``OUT [B, H_q, D]``,
    ``PO``/``PL`` the split workspaces; ``KD``/``VD`` TMA descriptors of K/V as ``[R, H_kv x
    row]`` bytes with ``16 x row`` boxes (``TMA``). Strides in elements of each tensor's
    dtype; ``page_shift`` log2 of the page size (>= 16)."""
    BN: gl.constexpr = 16
    gl.static_assert(_geometry_ok(D, G), "D 64, 128 or 256; G 1..16")
    gl.static_assert(_steps_ok(SUB, HPP, STAGES, AHEAD), "SUB 1/2/4 HPP 1/2 STAGES 2+ AHEAD 1/2")
    NH: gl.constexpr = 8 if G <= 8 else 16
    S8: gl.constexpr = _fp4_softmax_layout(NH)
    MX: gl.constexpr = FP4 and DEC_K == 2
    CDT: gl.constexpr = _operands(FP4, MX, WIDE)
    NW: gl.constexpr = D // 2 if WIDE else D // 4  # (fp8 / 16-bit: words of a head's row)
    RB: gl.constexpr = _row_bytes(D, WIDE, FP4)
    # FP4: the decode's 2^-14 (DEC 0) or 1/64 (DEC 1) undone with the global scales; partial
    # outputs in the merge's units (E2M1 / 64); mx: exact values
    KMUL: gl.constexpr = 16384.0 if DEC_K == 0 else (64.0 if DEC_K == 1 else 1.0)
    VMUL: gl.constexpr = 16384.0 if DEC_V == 0 else (64.0 if DEC_V == 1 else 1.0)

    page_mask = (1 << page_shift) - 1
    b, hp, split, lo, start, end = _program(
        SEQ, window, num_splits, HEAD_FAST, HAS_WINDOW, BN * SUB
    )
    hk = hp * HPP  # the program's first KV head
    if FP4:
        if MX:
            qk_scale = sm_scale
            out_mul = 1.0
            part_mul = 1.0
        else:
            qk_scale = sm_scale * gl.load(KSC) * KMUL
            out_mul = gl.load(VSC) * VMUL
            part_mul = VMUL / 64.0
    elif WIDE:
        qk_scale = sm_scale
        out_mul = 1.0
        part_mul = 1.0
    else:
        qk_scale = sm_scale * gl.load(KSC)
        out_mul = gl.load(VSC)
        part_mul = 1.0
    sm = (qk_scale, softcap, end, lo)
    sc = gl.arange(0, BN, layout=gl.SliceLayout(0, S8))
    pt_row = PT + b.to(gl.int64) * stride_pt

    q0 = _load_q(Q, b, hk, stride_qb, stride_qh, group, G, D, CDT, FP4, DEC_K)
    m0 = gl.full([NH], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S8))
    l0 = gl.zeros([NH, BN], gl.float32, layout=S8)
    acc0 = gl.zeros([D, NH], gl.float32, layout=MMA)
    if HPP == 2:
        q1 = _load_q(Q, b, hk + 1, stride_qb, stride_qh, group, G, D, CDT, FP4, DEC_K)
        m1 = m0
        l1 = l0
        acc1 = acc0

    # the ring: STAGES stages of SUB tiles of HPP heads, one mbarrier per stage (TMA)
    NB: gl.constexpr = STAGES * SUB * HPP
    if FP4:
        SS: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
        if TMA:
            kd = gl.allocate_shared_memory(gl.uint8, [NB, BN, RB], _tma_layout(RB))
            vd = gl.allocate_shared_memory(gl.uint8, [NB, BN, RB], _tma_layout(RB))
        else:
            SD: gl.constexpr = _fp4_row_swizzle(D)
            kd = gl.allocate_shared_memory(gl.int64, [NB, BN, D // 16], SD)
            vd = gl.allocate_shared_memory(gl.int64, [NB, BN, D // 16], SD)
        bufs = (
            kd,
            vd,
            gl.allocate_shared_memory(gl.uint8, [NB, BN, D // 16], SS),
            gl.allocate_shared_memory(gl.uint8, [NB, BN, D // 16], SS),
        )
        ptrs = (
            K.to(gl.pointer_type(gl.int64), bitcast=True) + hk * (D // 16),
            V.to(gl.pointer_type(gl.int64), bitcast=True) + hk * (D // 16),
            KBS + hk * (D // 16),
            VBS + hk * (D // 16),
        )
        strides = (stride_kr // 8, stride_vr // 8, stride_ksr, stride_vsr)
    else:
        if TMA:
            kd = gl.allocate_shared_memory(gl.uint8, [NB, BN, RB], _tma_layout(RB))
            vd = gl.allocate_shared_memory(gl.uint8, [NB, BN, RB], _tma_layout(RB))
        else:
            kd = gl.allocate_shared_memory(gl.int32, [NB, BN, NW], _ring_layout(NW))
            vd = gl.allocate_shared_memory(gl.int32, [NB, BN, NW], _ring_layout(NW))
        bufs = (kd, vd)
        ptrs = (
            K.to(gl.pointer_type(gl.int32), bitcast=True) + hk * NW,
            V.to(gl.pointer_type(gl.int32), bitcast=True) + hk * NW,
        )
        # (row strides in cache elements: bytes, or 16-bit values)
        strides = (stride_kr // (2 if WIDE else 4), stride_vr // (2 if WIDE else 4))
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    descs = None
    if TMA:
        for j in gl.static_range(STAGES):
            mbarrier.init(bars.index(j), count=1)
        fence_async_shared()
        descs = (KD, VD)
    col = hk * RB  # (TMA: the first head's byte column)

    # tiles past the end (the ring's tail, splits without tiles) repeat the last 16-aligned
    # tile, so every box stays in the request's last page (an empty request: page 0)
    last = gl.maximum(end - 1, 0) // BN * BN
    TS: gl.constexpr = BN * SUB  # tokens a stage
    for j in gl.static_range(STAGES - 1):
        rows = _stage_rows(start + j * TS, last, end, pt_row, page_shift, page_mask, SUB, True)
        _issue_stage(bufs, bars, j, start + j * TS, last, end, lo, rows, ptrs, strides, descs,
                     col, SUB, HPP, FP4, D, NW, RB, True, HAS_WINDOW, TMA)  # fmt: skip
    rows = _stage_rows(start + (STAGES - 1) * TS, last, end, pt_row, page_shift, page_mask, SUB,
                       True)  # fmt: skip
    if AHEAD == 2:  # (the fill after next too: page ids two stages before their copies)
        rows2 = _stage_rows(start + STAGES * TS, last, end, pt_row, page_shift, page_mask, SUB,
                            True)  # fmt: skip
    i = 0
    for s in range(start, end, TS):
        gl.thread_barrier()  # every lane is done with the stage refilled now
        if TMA:  # (its shared-memory reads, then async-proxy writes)
            fence_async_shared()
        fill = (i + STAGES - 1) % STAGES
        _issue_stage(bufs, bars, fill, s + (STAGES - 1) * TS, last, end, lo, rows, ptrs, strides,
                     descs, col, SUB, HPP, FP4, D, NW, RB, False, HAS_WINDOW, TMA)  # fmt: skip
        # the next fill's page ids, a stage ahead (past the end: the last tile, unused)
        if AHEAD == 2:
            rows = rows2
            rows2 = _stage_rows(s + (STAGES + 1) * TS, last, end, pt_row, page_shift, page_mask,
                                SUB, False)  # fmt: skip
        else:
            rows = _stage_rows(s + STAGES * TS, last, end, pt_row, page_shift, page_mask, SUB,
                               False)  # fmt: skip
        st = i % STAGES
        if FP4 or not TMA:
            async_copy.wait_group(STAGES - 1)
            gl.thread_barrier()  # the cp.async pieces of every lane are visible
        if TMA:
            mbarrier.wait(bars.index(st), (i // STAGES) & 1)
        i += 1
        base = st * SUB * HPP
        a0, a1, a2, a3, mx0 = _head_scores(q0, bufs, base, s, sc, sm, SUB, HPP, FP4, E5M2, WIDE,
                                           DEC_K, D, NH, TMA, HAS_SOFTCAP,
                                           HAS_WINDOW)  # fmt: skip
        mn0 = gl.maximum(m0, mx0)
        if HPP == 2:
            b0, b1, b2, b3, mx1 = _head_scores(q1, bufs, base + 1, s, sc, sm, SUB, HPP, FP4,
                                               E5M2, WIDE, DEC_K, D, NH, TMA, HAS_SOFTCAP,
                                               HAS_WINDOW)  # fmt: skip
            mn1 = gl.maximum(m1, mx1)
        if RESCALE >= 0:
            # lazy: the running maxima move only when a row grew by more than RESCALE (log2
            # units; p <= 2^RESCALE), one test for both heads; exact (the same stale max
            # serves p, l and acc)
            grow = gl.max(mn0 - m0, axis=0)
            if HPP == 2:
                grow = gl.maximum(grow, gl.max(mn1 - m1, axis=0))
            if grow > RESCALE:
                m0, l0, acc0 = _rescaled(m0, l0, acc0, mn0)
                if HPP == 2:
                    m1, l1, acc1 = _rescaled(m1, l1, acc1, mn1)
        else:
            m0, l0, acc0 = _rescaled(m0, l0, acc0, mn0)
            if HPP == 2:
                m1, l1, acc1 = _rescaled(m1, l1, acc1, mn1)
        acc0, l0 = _head_pv(acc0, l0, m0, a0, a1, a2, a3, bufs, base, s, end, lo, SUB, HPP, FP4,
                            E5M2, WIDE, DEC_V, D, TMA, CDT)  # fmt: skip
        if HPP == 2:
            acc1, l1 = _head_pv(acc1, l1, m1, b0, b1, b2, b3, bufs, base + 1, s, end, lo, SUB,
                                HPP, FP4, E5M2, WIDE, DEC_V, D, TMA, CDT)  # fmt: skip
    # the STAGES - 1 stages issued past the last one: none may land after the program exits
    if FP4 or not TMA:
        async_copy.wait_group(0)
    if TMA:
        for j in gl.static_range(STAGES - 1):
            mbarrier.wait(bars.index((i + j) % STAGES), ((i + j) // STAGES) & 1)
        for j in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(j))

    GH: gl.constexpr = G * HPP
    _finish(acc0, l0, m0, b, hk, split, num_splits, OUT, PO, PL, SINKS, stride_ob, stride_oh,
            out_mul, part_mul, G, NH, D, GH, FINAL, HAS_SINKS, HEAD_FAST)  # fmt: skip
    if HPP == 2:
        _finish(acc1, l1, m1, b, hk + 1, split, num_splits, OUT, PO, PL, SINKS, stride_ob,
                stride_oh, out_mul, part_mul, G, NH, D, GH, FINAL, HAS_SINKS,
                HEAD_FAST)  # fmt: skip
