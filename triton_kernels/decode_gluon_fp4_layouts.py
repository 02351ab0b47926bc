"""The layouts of the FP4 Gluon decode (``decode_gluon_fp4.py``): which lane holds which K and V
blocks of a 16-token tile, the rings' shared-memory swizzles and TMA box widths, the softmax's
score layout. Functions of the head_dim ``d`` (64, 128 or 256) and the group padding ``nh``
(8 or 16), evaluated at compile time (``triton.constexpr_function``); the kernel's docstring
gives the design they serve.
"""

import triton
from triton.experimental.gluon import language as gl

from .decode_gluon import _MMA_LAYOUT


@triton.constexpr_function
def _fp4_k_layout(d):
    """K blocks ``[16 tokens, d / 16]`` (int64; also their scale bytes): lane ``4g + t`` ->
    tokens g, g + 8; blocks ``(d / 64) t`` on (head_dim 128: 2t, 2t + 1)."""
    return gl.BlockedLayout(
        size_per_thread=[1, d // 64], threads_per_warp=[8, 4], warps_per_cta=[1, 1], order=[1, 0]
    )


@triton.constexpr_function
def _fp4_v_layout(d):
    """V data of one 16-token tile: head_dim >= 128, blocks ``[16 tokens, d / 16]`` int64 (and
    their scale bytes), lane ``4g + t`` -> tokens 2t, 2t + 1, 2t + 8, 2t + 9 and blocks
    ``(d / 128) g`` on; head_dim 64, 32-bit words ``[16 tokens, 4 blocks, 2 halves]`` with
    lane ``4g + t`` on half ``g % 2`` of block ``g // 2`` (its scales: SliceLayout 2)."""
    if d == 64:
        return gl.DistributedLinearLayout(
            reg_bases=[[1, 0, 0], [8, 0, 0]],
            lane_bases=[[2, 0, 0], [4, 0, 0], [0, 0, 1], [0, 1, 0], [0, 2, 0]],
            warp_bases=[],
            block_bases=[],
            shape=[16, 4, 2],
        )
    b = d // 128
    regs = [[0, 1 << i] for i in range(b.bit_length() - 1)] + [[1, 0], [8, 0]]
    return gl.DistributedLinearLayout(
        reg_bases=regs,
        lane_bases=[[2, 0], [4, 0], [0, b], [0, 2 * b], [0, 4 * b]],
        warp_bases=[],
        block_bases=[],
        shape=[16, d // 16],
    )


@triton.constexpr_function
def _fp4_v_rowcol_layout(d):
    """The 2-D layout V's row and block indices slice: ``_fp4_v_layout`` (head_dim 64: its
    scale slice, SliceLayout 2)."""
    if d == 64:
        return gl.SliceLayout(2, _fp4_v_layout(64))
    return _fp4_v_layout(d)


@triton.constexpr_function
def _fp4_v64_words_layout():
    """head_dim 64: a V tile's words ``[16 tokens, 8]`` read from the ring, lane ``4g + t`` ->
    tokens 2t, 2t + 1, 2t + 8, 2t + 9, word g (reshaped to ``_fp4_v_layout(64)``: a
    relabeling)."""
    return gl.DistributedLinearLayout(
        reg_bases=[[1, 0], [8, 0]],
        lane_bases=[[2, 0], [4, 0], [0, 1], [0, 2], [0, 4]],
        warp_bases=[],
        block_bases=[],
        shape=[16, 8],
    )


@triton.constexpr_function
def _fp4_tma_swizzle(d):
    """TMA swizzle (bytes) of a ring's ``16 x d / 2``-byte data boxes (``_fp4_row_swizzle``)."""
    return d // 2 if d >= 128 else 0


@triton.constexpr_function
def _fp4_v64(which, d):
    """Whether a ring read is head_dim 64's V (``which`` 1): words, not blocks."""
    return which == 1 and d == 64


@triton.constexpr_function
def _fp4_v64_swizzle():
    """head_dim 64: ``_fp4_row_swizzle(64)`` in 32-bit words (none)."""
    return gl.SwizzledSharedLayout(vec=4, per_phase=1, max_phase=1, order=[1, 0])


@triton.constexpr_function
def _fp4_row_swizzle(d):
    """Ring layout of ``[16, d / 16]`` int64 blocks: TMA's swizzle of ``d / 2``-byte rows (64:
    16-byte chunk c of row r at ``c ^ (r // 2) % 4``; 128: at ``c ^ r % 8``; 32: none, which
    Triton's NVMMA layout refuses for 16 x 32-byte boxes: a warp's K reads are 256 contiguous
    bytes, its V reads 2-way conflicted)."""
    if d == 64:
        return gl.SwizzledSharedLayout(vec=2, per_phase=1, max_phase=1, order=[1, 0])
    if d == 256:
        return gl.SwizzledSharedLayout(vec=2, per_phase=1, max_phase=8, order=[1, 0])
    return gl.SwizzledSharedLayout(vec=2, per_phase=2, max_phase=4, order=[1, 0])


@triton.constexpr_function
def _fp4_scale_copy_layout(d):
    """Scale rows ``[16, d / 16]`` bytes copied as 4-byte pieces."""
    return gl.BlockedLayout(
        size_per_thread=[1, 4],
        threads_per_warp=[32 // (d // 64), d // 64],
        warps_per_cta=[1, 1],
        order=[1, 0],
    )


@triton.constexpr_function
def _fp4_softmax_layout(nh):
    """Layout of the scores the softmax runs on: S's rows 0..7 (a group of <= 8; rows 8..15 of
    the MMA tile are q's zero padding: a relabeling of S's accumulator registers), or all 16
    rows (the MMA accumulator itself)."""
    if nh == 16:
        return _MMA_LAYOUT
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 8]],
        lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]],
        warp_bases=[],
        block_bases=[],
        shape=[8, 16],
    )
