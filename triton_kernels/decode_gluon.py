"""Paged decode over fp8 caches in Gluon (Triton's layout-explicit dialect), no layout changes.

``@gluon.jit`` code only; the launcher and its checks live in ``kvpool.attention`` (plans with
``gluon=True``: NVIDIA sm_89+, fp8_e4m3/fp8_e5m2 (bf16/fp16 at head_dim 64: ``WIDE``), head_dim
``D`` 64, 128 or 256, query group ``G`` <= 16, 16-byte aligned K/V rows; Triton 3.6,
``attention.GLUON_TRITON``: 3.9 removed the cp.async call below).

Head_dim and group (issue 17) are constants: a lane reads ``D / 4`` contiguous bytes of a K row
and ``D / 8`` of a V row (the permutations below with 32 -> ``D / 4`` words, 16 -> ``D / 8``),
the QK dot takes ``D / 16`` k-steps and the PV dot ``D / 16`` M-tiles; groups of 9..16 make the
PV dot 16 heads wide (``NH``), P^T then all 16 rows of S's accumulator (also free). ``WIDE``
(16-bit caches): the K words are the B fragment's registers as stored, V's two token rows are
interleaved by half-word moves; no scales. Head_dim 128 with a group of <= 8 compiles to the
same PTX instructions as before these constants.

One warp = one request x one KV head x one split (grid ``(B, H_kv, splits)`` as in
``decode.py``, or ``(H_kv, B, splits)`` with ``HEAD_FAST``; same split outputs, merged by
``decode.merge_kernel``). Each 16-token tile goes
from global memory straight into the tensor-core fragments of ``mma.sync.m16n8k16`` (fp16 in,
fp32 accumulate), with every layout written out so that Triton moves no data between layouts:

- QK: ``S = q K^T``, the query group padded to 16 rows. Head dims are taken in a permuted order,
  logical ``k = 16s + 8h + 2t + e`` <-> stored ``d = 32t + 4s + 2h + e`` (lane ``4g + t``), so each
  lane reads 32 contiguous bytes of a token and every pair of fp8 bytes converts
  (``cvt.rn.f16x2.e4m3x2``, or byte moves for e5m2) into one register of K^T's B fragment. q is
  read with the same permutation, so ``q . k`` is unchanged.
- PV: ``O^T = V^T P^T``, the value dims on the MMA's M side, the group on N (padded to 8). An A
  fragment register holds two *tokens* of one value dim: the words of two token rows are
  interleaved with ``prmt`` and converted in pairs. Value dims are permuted (logical row
  ``16m + 8r + g`` <-> stored ``16g + 4jw + 2bh + r``, ``m = 2jw + bh``) so a lane reads 16
  contiguous bytes per token; the output is written back in stored order.
- P^T's B fragment is S's accumulator (rows 0..7) register for register; only the per-head
  rescale factor crosses lanes (a shuffle).
- Loads: with ``STAGES`` (3 for e4m3 caches) a ring of tiles in shared memory filled by
  ``cp.async`` (raw words only; the page ids of the tile issued next are loaded one iteration
  earlier), read back in the layouts above; with ``STAGES=0`` and ``PREFETCH`` the next tile's
  words are loaded into registers before this tile's math (e5m2 caches: with the ring their
  byte-move decode needs 137 registers, too many for run 7's 16 programs per SM; with run 8's
  split model of 12 per SM it takes the ring as well: 0.274 vs 0.278 ms at B=64/8k).
- Addressing (run 8): tiles start at multiples of 16 (tokens before a sliding window's start are
  masked), so with page_size >= 16 (``PAGED``) a tile lies in one page: one page id, a 64-bit
  tile base and 32-bit lane offsets (``_tile_rows``, ``_addr``; shared with
  ``decode_gluon_fp4.py``); rows past the last token repeat it (masked scores) instead of masked
  loads. ``HEAD_FAST``: grid ``(H_kv, B, splits)``, a request's heads side by side. ``RESCALE``
  >= 0: the softmax rescales ``acc``/``l`` only when a row max grew by more than it (exact).

Why (benches/attention/results/run7_h200): the Triton kernel converts the dequantized V tile and
P through shared memory for the MMA operands and spends ~800 instructions per 32-token tile;
this one ~420 per 16-token tile. B=64/8k, call 10
(``gluon_ring/call10_ring_check_and_sweep.json``, 3 splits): ring 0.286 ms (126 registers,
13 KiB of shared memory, 16 programs per SM), register prefetch 0.299 ms (146 registers); the
Triton kernel 0.326-0.327 ms in the full benches (``gluon/`` and ``gluon_ring/stdout.txt``, not
the same run). Run 8 (``results/run8_h200/NOTES.md``, calls 9-10): one page id per tile and the
head-fast grid, e4m3 0.266-0.272 ms (1.81x SDPA on contiguous bf16), e5m2 (+ lazy rescale)
0.269-0.277 ms (1.78-1.79x) with register prefetch, 0.274 ms (1.80x) with the ring (call 12,
now its default).

Masking as in ``decode.py``: rows past ``seq_len`` are neither read nor scored (KVB-16, docs/architecture.md).
"""

import triton  # noqa: F401  (Gluon needs Triton's runtime)
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

# One mma.sync m16n8k16 layout (one warp) for both dots of both Gluon decode kernels (QK:
# [16 heads, 16 tokens]; PV: [128, 8 heads]) and its operand layouts: Q and V^T as the A side,
# K^T and P^T as the B side, two fp16 per 32-bit register.
_MMA_LAYOUT = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
MMA = gl.constexpr(_MMA_LAYOUT)
QOP = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=_MMA_LAYOUT, k_width=2))
KOP = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=_MMA_LAYOUT, k_width=2))
VOP = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=_MMA_LAYOUT, k_width=2))
POP = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=_MMA_LAYOUT, k_width=2))


@gluon.jit
def _k_words_f16(w, E5M2: gl.constexpr):
    """Word of 4 fp8 codes -> 4 fp16 (exact); e5m2 is the high byte of an fp16 (byte moves)."""
    if E5M2:
        return gl.inline_asm_elementwise(
            asm="{ .reg .b32 z, f0, f1; mov.b32 z, 0; prmt.b32 f0, $4, z, 0x1404; "
            "prmt.b32 f1, $4, z, 0x3424; mov.b32 {$0, $1}, f0; mov.b32 {$2, $3}, f1; }",
            constraints="=h,=h,=h,=h,r",
            args=[w],
            dtype=(gl.float16, gl.float16, gl.float16, gl.float16),
            is_pure=True,
            pack=1,
        )
    return gl.inline_asm_elementwise(
        asm="{ .reg .b16 l, h; .reg .b32 f0, f1; mov.b32 {l, h}, $4; "
        "cvt.rn.f16x2.e4m3x2 f0, l; cvt.rn.f16x2.e4m3x2 f1, h; "
        "mov.b32 {$0, $1}, f0; mov.b32 {$2, $3}, f1; }",
        constraints="=h,=h,=h,=h,r",
        args=[w],
        dtype=(gl.float16, gl.float16, gl.float16, gl.float16),
        is_pure=True,
        pack=1,
    )


@gluon.jit
def _v_pairs_f16(we, wo, E5M2: gl.constexpr):
    """Words of two token rows -> for each byte b, (even row, odd row) as fp16: y[2b + e]."""
    if E5M2:
        return gl.inline_asm_elementwise(
            asm="{ .reg .b32 z, p0, p1, f0, f1, f2, f3; mov.b32 z, 0; "
            "prmt.b32 p0, $8, $9, 0x5140; prmt.b32 p1, $8, $9, 0x7362; "
            "prmt.b32 f0, p0, z, 0x1404; prmt.b32 f1, p0, z, 0x3424; "
            "prmt.b32 f2, p1, z, 0x1404; prmt.b32 f3, p1, z, 0x3424; "
            "mov.b32 {$0, $1}, f0; mov.b32 {$2, $3}, f1; "
            "mov.b32 {$4, $5}, f2; mov.b32 {$6, $7}, f3; }",
            constraints="=h,=h,=h,=h,=h,=h,=h,=h,r,r",
            args=[we, wo],
            dtype=(gl.float16,) * 8,
            is_pure=True,
            pack=1,
        )
    return gl.inline_asm_elementwise(
        asm="{ .reg .b32 p0, p1, f0, f1, f2, f3; .reg .b16 l0, h0, l1, h1; "
        "prmt.b32 p0, $8, $9, 0x5140; prmt.b32 p1, $8, $9, 0x7362; "
        "mov.b32 {l0, h0}, p0; mov.b32 {l1, h1}, p1; "
        "cvt.rn.f16x2.e4m3x2 f0, l0; cvt.rn.f16x2.e4m3x2 f1, h0; "
        "cvt.rn.f16x2.e4m3x2 f2, l1; cvt.rn.f16x2.e4m3x2 f3, h1; "
        "mov.b32 {$0, $1}, f0; mov.b32 {$2, $3}, f1; mov.b32 {$4, $5}, f2; mov.b32 {$6, $7}, f3; }",
        constraints="=h,=h,=h,=h,=h,=h,=h,=h,r,r",
        args=[we, wo],
        dtype=(gl.float16,) * 8,
        is_pure=True,
        pack=1,
    )


@triton.constexpr_function
def _geometry_ok(d, g):
    """Whether the Gluon decode kernels take head_dim ``d`` and query group ``g``."""
    return d in (64, 128, 256) and 1 <= g <= 16


@triton.constexpr_function
def _k_words_layout(n):
    """K words ``[16 tokens, n]`` (``n`` words a head's row: head_dim / 4 for fp8, / 2 for
    16-bit caches): lane ``4g + t`` holds rows g, g+8 and words ``(n / 4) t`` on (a quarter of
    the token's row, contiguous)."""
    return gl.BlockedLayout(
        size_per_thread=[1, n // 4], threads_per_warp=[8, 4], warps_per_cta=[1, 1], order=[1, 0]
    )


@triton.constexpr_function
def _v_words_layout(n):
    """V words ``[16 tokens, n]`` (``n`` words a row, as :func:`_k_words_layout`): ``w = n / 8``
    contiguous words per register group (128-bit loads from 4 on), then the odd token of the
    pair, then the token 8 rows down; lane ``4g + t`` -> tokens ``2t``, words ``w g``."""
    w = n // 8
    regs = [[0, 1 << i] for i in range(w.bit_length() - 1)] + [[1, 0], [8, 0]]
    return gl.DistributedLinearLayout(
        reg_bases=regs,
        lane_bases=[[2, 0], [4, 0], [0, w], [0, 2 * w], [0, 4 * w]],
        warp_bases=[],
        block_bases=[],
        shape=[16, n],
    )


@triton.constexpr_function
def _operand_dtype(wide):
    """The MMA operands' type: fp16 (fp8 and fp16 caches), bf16 (``wide`` 2: bf16 caches)."""
    return gl.bfloat16 if wide == 2 else gl.float16


@triton.constexpr_function
def _ring_layout(n):
    """Shared layout of a ring stage's ``[16, n]`` words (rows of >= 128 bytes: 8 phases; 64
    bytes: two rows a 128-byte line, TMA's 64-byte pattern)."""
    if n == 16:
        return gl.SwizzledSharedLayout(vec=4, per_phase=2, max_phase=4, order=[1, 0])
    return gl.SwizzledSharedLayout(vec=4, per_phase=1, max_phase=8, order=[1, 0])


@gluon.jit
def _halves(w, WIDE: gl.constexpr):
    """Words of two 16-bit values -> (low, high) as fp16 (``WIDE`` 1) or bf16 (2; register
    moves)."""
    return gl.inline_asm_elementwise(
        asm="mov.b32 {$0, $1}, $2;",
        constraints="=h,=h,r",
        args=[w],
        dtype=(gl.bfloat16 if WIDE == 2 else gl.float16,) * 2,
        is_pure=True,
        pack=1,
    )


@gluon.jit
def _k_operand(
    w, BOP: gl.constexpr, E5M2: gl.constexpr, D: gl.constexpr = 128, WIDE: gl.constexpr = 0
):
    """Raw K words ``[16 tokens, D / 4]`` (lane ``4g + t``: rows g, g+8; words ``(D / 16) t``
    on) -> K^T ``[D, 16]`` fp16 as the B operand of the QK MMA (logical head dims, see the
    module). ``WIDE`` (16-bit caches, 1 fp16, 2 bf16): words ``[16, D / 2]``, each one
    register of the operand as it is."""
    if WIDE:
        o0, o1 = _halves(w, WIDE)
        x = gl.join(o0, o1)  # [16, D / 2, 2]: d = 2 word + e
        x = gl.reshape(x, [16, 4, D // 16, 2, 2])  # (tok, t, s, h, e)
    else:
        o0, o1, o2, o3 = _k_words_f16(w, E5M2)
        x = gl.join(gl.join(o0, o2), gl.join(o1, o3))  # [16, D / 4, 2, 2]: d = 4 word + 2j + k
        x = gl.reshape(x, [16, 4, D // 16, 2, 2])  # (tok, t, s, h, e)
    x = gl.permute(x, [0, 2, 3, 1, 4])  # (tok, s, h, t, e)
    x = gl.reshape(x, [16, D])
    return gl.convert_layout(gl.permute(x, [1, 0]), BOP, assert_trivial=True)


@gluon.jit
def _v_operand_wide(w, AOP: gl.constexpr, D: gl.constexpr, WIDE: gl.constexpr):
    """16-bit caches: V words ``[16 tokens, D / 2]`` (lane ``4g + t``: rows 2t, 2t+1, 2t+8,
    2t+9; words ``(D / 16) g`` on) -> V^T ``[D, 16]`` as the A operand of the PV MMA: logical
    row ``16m + 8r + g`` is element ``r`` of word ``(D / 16) g + m`` (stored
    ``(D / 8) g + 2m + r``), the two tokens of a register from two rows' words."""
    x = gl.reshape(w, [2, 4, 2, D // 2])  # (hh, t, e, word)
    x = gl.permute(x, [0, 1, 3, 2])  # (hh, t, word, e)
    we, wo = gl.split(x)
    e0, e1 = _halves(we, WIDE)
    o0, o1 = _halves(wo, WIDE)
    y = gl.join(gl.join(e0, e1), gl.join(o0, o1))  # (hh, t, word, r, e)
    y = gl.reshape(y, [2, 4, 8, D // 16, 2, 2])  # (hh, t, g, m, r, e)
    y = gl.permute(y, [3, 4, 2, 0, 1, 5])  # (m, r, g, hh, t, e)
    y = gl.reshape(y, [D, 16])
    return gl.convert_layout(y, AOP, assert_trivial=True)


@gluon.jit
def _v_operand(w, AOP: gl.constexpr, E5M2: gl.constexpr, D: gl.constexpr = 128):
    """Raw V words ``[16 tokens, D / 4]`` (lane ``4g + t``: rows 2t, 2t+1, 2t+8, 2t+9; words
    ``(D / 32) g`` on) -> V^T ``[D, 16]`` fp16 as the A operand of the PV MMA (logical value
    rows)."""
    x = gl.reshape(w, [2, 4, 2, D // 4])  # (hh, t, e, word)
    x = gl.permute(x, [0, 1, 3, 2])  # (hh, t, word, e)
    we, wo = gl.split(x)
    y0, y1, y2, y3, y4, y5, y6, y7 = _v_pairs_f16(we, wo, E5M2)  # y[2b + e]
    # tl.join adds the new axis last, so the outermost join picks the lowest bit of y's index
    y = gl.join(
        gl.join(gl.join(y0, y4), gl.join(y2, y6)), gl.join(gl.join(y1, y5), gl.join(y3, y7))
    )
    # [hh, t, word, bh, r, e]: y index 2b + e, b = 2 bh + r
    y = gl.reshape(y, [2, 4, 8, D // 32, 2, 2, 2])  # (hh, t, g, jw, bh, r, e)
    y = gl.permute(y, [3, 4, 5, 2, 0, 1, 6])  # (jw, bh, r, g, hh, t, e)
    y = gl.reshape(y, [D, 16])
    return gl.convert_layout(y, AOP, assert_trivial=True)


@gluon.jit
def _program(SEQ, window, num_splits, HEAD_FAST: gl.constexpr, HAS_WINDOW: gl.constexpr,
             TILE: gl.constexpr):  # fmt: skip
    """This program's request ``b``, KV head ``hk`` and split, the window's first token ``lo``
    (0 without one) and its split's tokens ``[start, end)``. Tiles start at multiples of 16
    (tokens before ``lo`` are masked): with page_size >= 16 a tile then lies in one page. A split
    is a whole number of ``TILE``-token steps. ``HEAD_FAST``: grid (H_kv, B, splits), a
    request's KV heads run side by side; else (B, H_kv, splits)."""
    if HEAD_FAST:
        b = gl.program_id(1)
        hk = gl.program_id(0)
    else:
        b = gl.program_id(0)
        hk = gl.program_id(1)
    split = gl.program_id(2)
    seq = gl.load(SEQ + b)
    lo = 0
    if HAS_WINDOW:
        lo = gl.maximum(seq - window, 0)
    lo16 = lo // 16 * 16
    chunk = gl.cdiv(gl.cdiv(seq - lo16, num_splits), TILE) * TILE
    start = lo16 + split * chunk
    end = gl.minimum(start + chunk, seq)
    return b, hk, split, lo, start, end


@gluon.jit
def _log2_scores(sacc, s, sc, qk_scale, softcap, end, lo, HAS_SOFTCAP: gl.constexpr,
                 HAS_WINDOW: gl.constexpr):  # fmt: skip
    """Raw scores ``[rows, tokens]`` of the tile at token ``s`` (columns ``s + sc``) scaled to
    log2 units, soft-capped if asked (Gemma 2: ``c * tanh(x / c)``), -inf past ``end`` and
    before a window's first token ``lo``."""
    if HAS_SOFTCAP:  # c * tanh(x / c), in log2 units; tanh(x) = 1 - 2 / (exp(2x) + 1)
        sacc = (1.0 - 2.0 / (gl.exp(2.0 * (sacc * (qk_scale / softcap))) + 1.0)) * (
            softcap * 1.4426950408889634
        )
    else:
        sacc = sacc * (qk_scale * 1.4426950408889634)
    valid = (s + sc) < end
    if HAS_WINDOW:
        valid = valid & ((s + sc) >= lo)
    return gl.where(valid[None, :], sacc, float("-inf"))


@gluon.jit
def _fold_sinks(acc, l8, m8, SINKS, heads, hmask):
    """Attention sinks (one logit per query head, natural-log units) folded into the final
    ``acc`` ``[D, NH heads]`` and its row sums ``l8`` (``m8``: the running max, log2 units)."""
    sink = gl.load(SINKS + heads, mask=hmask, other=0.0).to(gl.float32) * 1.4426950408889634
    m_s = gl.maximum(m8, sink)
    l8 = l8 * gl.exp2(m8 - m_s) + gl.exp2(sink - m_s)
    acc = acc * gl.exp2(m8 - m_s)[None, :]
    return acc, l8


@gluon.jit
def _store_out(OUT, o, b, heads, hmask, dv, stride_ob, stride_oh):
    """The output rows of a one-split program: ``o`` ``[D, NH heads]`` fp32 (value dims in the
    kernel's order, stored at ``dv``), heads past the group masked."""
    gl.store(
        OUT + b * stride_ob + heads[None, :] * stride_oh + dv[:, None],
        o.to(OUT.dtype.element_ty),
        mask=hmask[None, :],
    )


@gluon.jit
def _store_partial(PO, PL, o, l8, m8, b, heads, hmask, dv, split, num_splits, G: gl.constexpr,
                   HEAD_FAST: gl.constexpr):  # fmt: skip
    """A split's normalized partial output ``o`` and its log2-sum-exp (from the row sums ``l8``
    and max ``m8``; -inf for a split without tokens) for ``decode.merge_kernel``."""
    l_safe = gl.where(l8 > 0, l8, 1.0)
    lse = gl.where(l8 > 0, m8 + gl.log2(l_safe), float("-inf"))
    row = (b * (G * gl.num_programs(0 if HEAD_FAST else 1)) + heads) * num_splits + split
    gl.store(PO + row[None, :].to(gl.int64) * o.shape[0] + dv[:, None], o, mask=hmask[None, :])
    gl.store(PL + row, lse, mask=hmask)


@gluon.jit
def _tile_row0(s, end, pt_row, page_shift, page_mask, GUARD: gl.constexpr = False):
    """First cache row (int64) of the 16-aligned tile at token ``s`` (page_size >= 16: the tile
    lies in one page). ``GUARD`` (prologue): page 0 for an empty request (``end`` 0)."""
    if GUARD:
        page = gl.load(pt_row + (s >> page_shift), mask=s < end, other=0)
    else:
        page = gl.load(pt_row + (s >> page_shift))
    return page.to(gl.int64) * (page_mask + 1) + (s & page_mask)


@gluon.jit
def _tile_rows(
    s,
    end,
    pt_row,
    page_shift,
    page_mask,
    r,
    lo,
    PAGED: gl.constexpr,
    GUARD: gl.constexpr,
    WINDOW: gl.constexpr,
):
    """Where tokens ``s + min(r, end - 1 - s)`` live: rows past the last token repeat it (their
    scores are masked), so no load is masked and no slot past ``seq_len`` is read; with a
    ``WINDOW`` rows before its first token ``lo`` repeat that one (a tile starts at a multiple of
    16, possibly before ``lo``: those pages may be freed, their rows anything). ``PAGED``:
    ``(row0, rc)``, the tile's first row (int64, one page id) and 32-bit row offsets; else
    ``(0, row)``, a page id per token. ``GUARD`` (prologue): tiles past the end of the request,
    or an empty request (row 0 of page 0)."""
    lim = end - 1 - s
    if GUARD:
        lim = gl.maximum(lim, 0)
    rc = gl.minimum(r, lim)
    if WINDOW:  # (lo <= end - 1 in every split that has tiles; lo - s <= 0 otherwise)
        rc = gl.maximum(rc, lo - s)
    if PAGED:
        row0 = _tile_row0(s, end, pt_row, page_shift, page_mask, GUARD)
        rows = rc
    else:
        t = s + rc
        if GUARD:
            page = gl.load(pt_row + (t >> page_shift), mask=t < end, other=0)
        else:
            page = gl.load(pt_row + (t >> page_shift))
        row0 = 0
        rows = page.to(gl.int64) * (page_mask + 1) + (t & page_mask)
    return row0, rows


@gluon.jit
def _kv_rows(
    s,
    end,
    pt_row,
    page_shift,
    page_mask,
    kr,
    vr,
    lo,
    PAGED: gl.constexpr,
    GUARD: gl.constexpr,
    WINDOW: gl.constexpr,
):
    """:func:`_tile_rows` of the tile at ``s`` for K's rows ``kr`` and V's ``vr``:
    ``(k_row0, k_rows, v_row0, v_rows)``."""
    k0, rk = _tile_rows(s, end, pt_row, page_shift, page_mask, kr, lo, PAGED, GUARD, WINDOW)
    v0, rv = _tile_rows(s, end, pt_row, page_shift, page_mask, vr, lo, PAGED, GUARD, WINDOW)
    return k0, rk, v0, rv


@gluon.jit
def _addr(ptr, sr, row0, rows, c, PAGED: gl.constexpr):
    """Addresses of columns ``c`` of the rows of :func:`_tile_rows` (row stride ``sr``)."""
    if PAGED:
        return (ptr + row0 * sr) + ((rows * sr)[:, None] + c[None, :])
    return ptr + rows[:, None] * sr + c[None, :]


@gluon.jit
def _rows0to7(x, N: gl.constexpr):
    """Rows 0..7 of ``x [16, N]`` (row bit 3 is held in registers: a relabeling, no data moves)."""
    return gl.split(gl.permute(gl.reshape(x, [2, 8, N]), [1, 2, 0]))[0]


@gluon.jit
def _first8(x):
    """Elements 0..7 of a per-row vector ``x [16]`` of the accumulator layout (a relabeling)."""
    return gl.split(gl.permute(gl.reshape(x, [2, 8]), [1, 0]))[0]


@gluon.jit
def _per_head(x, NH: gl.constexpr):
    """A per-row vector ``x [16]`` of the accumulator layout as the per-head (column) vector of
    the PV accumulator ``[D, NH]``: rows 0..7 (NH 8) or all 16 (one shuffle either way)."""
    if NH == 8:
        y = gl.convert_layout(_first8(x), gl.SliceLayout(0, MMA))
    else:
        y = gl.convert_layout(x, gl.SliceLayout(0, MMA))
    return y


@gluon.jit
def _issue(ks, vs, stage, k_addr, v_addr):
    """cp.async of one tile's K and V words into ring stage ``stage`` (one commit group)."""
    async_copy.async_copy_global_to_shared(ks.index(stage), k_addr)
    async_copy.async_copy_global_to_shared(vs.index(stage), v_addr)
    async_copy.commit_group()


@gluon.jit(do_not_specialize=["group"])  # (a group of 1 would become a constant)
def decode_kernel(
    Q,
    K,
    V,
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
    stride_pt,
    stride_ob,
    stride_oh,
    sm_scale,
    softcap,
    window,
    page_shift,
    num_splits,
    group,
    G: gl.constexpr,
    FINAL: gl.constexpr,
    PREFETCH: gl.constexpr,
    E5M2: gl.constexpr,
    HAS_SOFTCAP: gl.constexpr,
    HAS_WINDOW: gl.constexpr,
    HAS_SINKS: gl.constexpr,
    STAGES: gl.constexpr = 0,
    PAGED: gl.constexpr = False,
    RESCALE: gl.constexpr = -1.0,
    HEAD_FAST: gl.constexpr = False,
    D: gl.constexpr = 128,
    WIDE: gl.constexpr = 0,
):
    BN: gl.constexpr = 16
    # head_dim D (64, 128, 256); the PV dot's N side: 8 heads, or 16 for groups of 9..16
    gl.static_assert(_geometry_ok(D, G), "D 64, 128 or 256; G 1..16")
    NH: gl.constexpr = 8 if G <= 8 else 16
    # (the planner gives every Gluon plan a ring or register prefetch)
    gl.static_assert(STAGES > 0 or PREFETCH, "STAGES > 0 or PREFETCH")
    # (MMA, QOP, KOP, VOP, POP: the module's shared mma.sync layouts)
    # 16-bit caches (WIDE 1 fp16, 2 bf16): operands as stored, rows of D / 2 words, no scales
    CDT: gl.constexpr = _operand_dtype(WIDE)
    NW: gl.constexpr = D // 2 if WIDE else D // 4  # 32-bit words of a head's row
    KL: gl.constexpr = _k_words_layout(NW)
    VL: gl.constexpr = _v_words_layout(NW)

    page_mask = (1 << page_shift) - 1
    b, hk, split, lo, start, end = _program(SEQ, window, num_splits, HEAD_FAST, HAS_WINDOW, BN)
    if WIDE:
        qk_scale = sm_scale
    else:
        qk_scale = sm_scale * gl.load(KSC)

    # q (A operand, logical head dims): rows >= G are zero; bounded by the runtime ``group``
    # (= G), which the compiler cannot fold: with the constant, ptxas re-creates q's zero
    # registers before every MMA
    qr = gl.arange(0, 16, layout=gl.SliceLayout(1, QOP))
    qc = gl.arange(0, D, layout=gl.SliceLayout(0, QOP))
    phys = (D // 4) * ((qc // 2) % 4) + 4 * (qc // 16) + 2 * ((qc // 8) % 2) + qc % 2
    q = gl.load(
        Q + b * stride_qb + (hk * G + qr)[:, None] * stride_qh + phys[None, :],
        mask=(qr < group)[:, None],
        other=0.0,
    ).to(CDT)

    kr = gl.arange(0, BN, layout=gl.SliceLayout(1, KL))
    kc = gl.arange(0, NW, layout=gl.SliceLayout(0, KL))
    vr = gl.arange(0, BN, layout=gl.SliceLayout(1, VL))
    vc = gl.arange(0, NW, layout=gl.SliceLayout(0, VL))
    sc = gl.arange(0, BN, layout=gl.SliceLayout(0, MMA))
    kw_ptr = K.to(gl.pointer_type(gl.int32), bitcast=True) + hk * NW
    vw_ptr = V.to(gl.pointer_type(gl.int32), bitcast=True) + hk * NW
    pt_row = PT + b.to(gl.int64) * stride_pt
    # (row strides in elements of the cache: bytes, or 16-bit values)
    srk = stride_kr // (2 if WIDE else 4)
    srv = stride_vr // (2 if WIDE else 4)

    m_i = gl.full([16], float("-inf"), gl.float32, layout=gl.SliceLayout(1, MMA))
    l_i = gl.zeros([16], gl.float32, layout=gl.SliceLayout(1, MMA))
    acc = gl.zeros([D, NH], gl.float32, layout=MMA)

    if STAGES > 0:
        # ring of STAGES tiles in shared memory filled by cp.async; the page ids of the tile
        # issued next are loaded one iteration earlier (registers), so no issue waits on them
        SW: gl.constexpr = _ring_layout(NW)
        ks = gl.allocate_shared_memory(gl.int32, [STAGES, BN, NW], SW)
        vs = gl.allocate_shared_memory(gl.int32, [STAGES, BN, NW], SW)
        for j in gl.static_range(STAGES - 1):
            sj = gl.maximum(gl.minimum(start + j * BN, end - 1), 0)
            k0, rk, v0, rv = _kv_rows(
                sj, end, pt_row, page_shift, page_mask, kr, vr, lo, PAGED, True, HAS_WINDOW
            )
            _issue(
                ks,
                vs,
                j,
                _addr(kw_ptr, srk, k0, rk, kc, PAGED),
                _addr(vw_ptr, srv, v0, rv, vc, PAGED),
            )
        sn = gl.maximum(gl.minimum(start + (STAGES - 1) * BN, end - 1), 0)
        nk0, nk, nv0, nv = _kv_rows(
            sn, end, pt_row, page_shift, page_mask, kr, vr, lo, PAGED, True, HAS_WINDOW
        )
    i = 0
    if STAGES == 0:
        s0 = gl.maximum(gl.minimum(start, end - 1), 0)
        k0, rk, v0, rv = _kv_rows(
            s0, end, pt_row, page_shift, page_mask, kr, vr, lo, PAGED, True, HAS_WINDOW
        )
        kw_n = gl.load(_addr(kw_ptr, srk, k0, rk, kc, PAGED))
        vw_n = gl.load(_addr(vw_ptr, srv, v0, rv, vc, PAGED))
    for s in range(start, end, BN):
        if STAGES > 0:
            gl.thread_barrier()  # every lane is done with the stage refilled now
            _issue(
                ks,
                vs,
                (i + STAGES - 1) % STAGES,
                _addr(kw_ptr, srk, nk0, nk, kc, PAGED),
                _addr(vw_ptr, srv, nv0, nv, vc, PAGED),
            )
            # (past the end: the split's last token again, unused)
            sn = gl.minimum(s + STAGES * BN, end - 1)
            nk0, nk, nv0, nv = _kv_rows(
                sn, end, pt_row, page_shift, page_mask, kr, vr, lo, PAGED, False, HAS_WINDOW
            )
            async_copy.wait_group(STAGES - 1)
            gl.thread_barrier()  # the tile's words, copied by every lane, are visible
            kw = ks.index(i % STAGES).load(KL)
            vw = vs.index(i % STAGES).load(VL)
            i += 1
        else:
            kw, vw = kw_n, vw_n
            sl = gl.minimum(s + BN, end - 1)  # the next tile (past the end: unused)
            k0, rk, v0, rv = _kv_rows(
                sl, end, pt_row, page_shift, page_mask, kr, vr, lo, PAGED, False, HAS_WINDOW
            )
            kw_n = gl.load(_addr(kw_ptr, srk, k0, rk, kc, PAGED))
            vw_n = gl.load(_addr(vw_ptr, srv, v0, rv, vc, PAGED))

        kt = _k_operand(kw, KOP, E5M2, D, WIDE)
        sacc = mma_v2(q, kt, gl.zeros([16, BN], gl.float32, layout=MMA))
        sacc = _log2_scores(sacc, s, sc, qk_scale, softcap, end, lo, HAS_SOFTCAP, HAS_WINDOW)
        m_new = gl.maximum(m_i, gl.max(sacc, axis=1))
        if RESCALE >= 0:
            # lazy rescale: the running max moves only when some row grew by more than
            # RESCALE (log2 units), so p <= 2^RESCALE (fp16) and acc/l are rescaled rarely;
            # exact, since the same (stale) max serves p, l and acc
            if gl.max(m_new - m_i, axis=0) > RESCALE:
                alpha = gl.exp2(m_i - m_new)
                l_i = l_i * alpha
                m_i = m_new
                acc = acc * _per_head(alpha, NH)[None, :]
            p = gl.exp2(sacc - m_i[:, None])
            l_i = l_i + gl.sum(p, axis=1)
        else:
            alpha = gl.exp2(m_i - m_new)
            p = gl.exp2(sacc - m_new[:, None])
            l_i = l_i * alpha + gl.sum(p, axis=1)
            m_i = m_new
            acc = acc * _per_head(alpha, NH)[None, :]
        # P^T: rows 0..7 of p (a group of 16: all rows), as the B operand of the PV dot
        if NH == 8:
            p8 = _rows0to7(p.to(CDT), BN)
        else:
            p8 = p.to(CDT)
        pt = gl.convert_layout(gl.permute(p8, [1, 0]), POP, assert_trivial=True)
        if WIDE:
            vt = _v_operand_wide(vw, VOP, D, WIDE)
        else:
            vt = _v_operand(vw, VOP, E5M2, D)
        acc = mma_v2(vt, pt, acc)

    # acc is [value dim (logical), head]: logical 16m + 8r + g -> stored 16g + 4jw + 2bh + r,
    # m = 2jw + bh
    l8 = _per_head(l_i, NH)
    m8 = _per_head(m_i, NH)
    orow = gl.arange(0, D, layout=gl.SliceLayout(1, MMA))
    ocol = gl.arange(0, NH, layout=gl.SliceLayout(0, MMA))
    mm = orow // 16
    dv = (D // 8) * (orow % 8) + 4 * (mm // 2) + 2 * (mm % 2) + (orow // 8) % 2
    hmask = ocol < G
    l_safe = gl.where(l8 > 0, l8, 1.0)
    heads = hk * G + ocol
    if FINAL:
        if HAS_SINKS:
            acc, l8 = _fold_sinks(acc, l8, m8, SINKS, heads, hmask)
            l_safe = gl.where(l8 > 0, l8, 1.0)
        if WIDE:
            o = acc / l_safe[None, :]
        else:
            o = acc * (gl.load(VSC) / l_safe)[None, :]
        _store_out(OUT, o, b, heads, hmask, dv, stride_ob, stride_oh)
    else:
        o = acc / l_safe[None, :]
        _store_partial(PO, PL, o, l8, m8, b, heads, hmask, dv, split, num_splits, G, HEAD_FAST)
