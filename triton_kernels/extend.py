"""Paged extend (prefill with a cached prefix) attention over every KV cache dtype.

``@triton.jit`` code only; the launcher lives in ``kvpool.attention``.

The new tokens' K/V are already in the paged cache (written with ``pool.write``); request ``b``
has ``q_len = cu_seqlens_q[b+1] - cu_seqlens_q[b]`` new tokens, which are the last ``q_len`` of
its ``seq_len`` tokens. Query token ``i`` (0-based within the new ones) sits at position
``seq_len - q_len + i`` and attends causally to positions ``<=`` its own (and, with a window
``W``, ``> pos - W``).

One program = one block of ``BLOCK_T`` new tokens of one request x one KV head, with all ``G``
query heads of that KV head stacked as rows (``BLOCK_M = BLOCK_T * GP`` rows, row
``r = t * GP + g``), so K/V tiles are read once per block for the whole group and the dots have
M >= 64. Tiles are loaded and dequantized by the decode module's ``load_kv_tile``.
"""

import triton
import triton.language as tl

from .decode import load_kv_tile, softmax_logits

# Step-dependent ints are not specialized (Triton makes an int of 1 a constant and records
# divisibility by 16): a serving loop's page-table width, blocks per request and window would
# otherwise compile a new kernel when they change (issue 22, 2.2 s of a first prefill). Strides of
# the pool and of q/out (fixed per model) and page_shift stay specialized.
DO_NOT_SPECIALIZE = ("stride_pt", "window", "blocks_per_req")


@triton.jit(do_not_specialize=DO_NOT_SPECIALIZE)
def extend_kernel(
    Q,
    K,
    V,
    KBS,
    VBS,
    KSC,
    VSC,
    PT,
    SEQ,
    CUQ,
    WORK,
    SINKS,
    OUT,
    stride_qt,
    stride_qh,
    stride_kr,
    stride_vr,
    stride_kbr,
    stride_vbr,
    stride_pt,
    stride_ot,
    stride_oh,
    sm_scale,
    softcap,
    window,
    blocks_per_req,
    page_shift,
    G: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FMT: tl.constexpr,
    CDT: tl.constexpr,
    IS_F32: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    FP4_MUL: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    USE_WORK: tl.constexpr,
    ASM: tl.constexpr,
):
    pid = tl.program_id(0)
    hk = tl.program_id(1)
    if USE_WORK:
        # planned work list: (request, first new token of the block) pairs
        b = tl.load(WORK + 2 * pid)
        t0 = tl.load(WORK + 2 * pid + 1)
    else:
        b = pid // blocks_per_req
        t0 = (pid % blocks_per_req) * BLOCK_T
    q_begin = tl.load(CUQ + b)
    q_len = tl.load(CUQ + b + 1) - q_begin
    if t0 >= q_len:
        return
    seq = tl.load(SEQ + b)
    prefix = seq - q_len

    BLOCK_M: tl.constexpr = BLOCK_T * GP
    offs_m = tl.arange(0, BLOCK_M)
    t_loc = t0 + offs_m // GP
    g = offs_m % GP
    rmask = (t_loc < q_len) & (g < G)
    heads = hk * G + g
    pos = prefix + t_loc
    offs_d = tl.arange(0, D)
    offs_dv = tl.arange(0, DV)
    tok = (q_begin + t_loc).to(tl.int64)
    q = tl.load(
        Q + tok[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=rmask[:, None],
        other=0.0,
    ).to(CDT)

    kf = FP4_MUL
    vf = FP4_MUL
    if HAS_SCALE:
        kf = kf * tl.load(KSC)
        vf = vf * tl.load(VSC)
    qk_scale = sm_scale * kf

    t_last = tl.minimum(t0 + BLOCK_T, q_len) - 1
    hi = prefix + t_last + 1
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(prefix + t0 - window + 1, 0)
        lo = (lo // BLOCK_N) * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DV], tl.float32)
    pt_row = PT + b.to(tl.int64) * stride_pt

    # Tiles that end at or before the block's first query position are visible to every row:
    # no causal mask there (a sliding window masks every tile).
    mid = lo
    if not HAS_WINDOW:
        mid = tl.minimum(((prefix + t0 + 1) // BLOCK_N) * BLOCK_N, hi)
    for s in range(lo, mid, BLOCK_N):
        m_i, l_i, acc = _tile(
            q, m_i, l_i, acc, s, hi, pos, window, pt_row, page_shift, K, V, KBS, VBS, hk,
            stride_kr, stride_vr, stride_kbr, stride_vbr, qk_scale, softcap, BLOCK_N, D, DV,
            FMT, CDT, IS_F32, HAS_SOFTCAP, HAS_WINDOW, ASM, False,
        )  # fmt: skip
    for s in range(mid, hi, BLOCK_N):
        m_i, l_i, acc = _tile(
            q, m_i, l_i, acc, s, hi, pos, window, pt_row, page_shift, K, V, KBS, VBS, hk,
            stride_kr, stride_vr, stride_kbr, stride_vbr, qk_scale, softcap, BLOCK_N, D, DV,
            FMT, CDT, IS_F32, HAS_SOFTCAP, HAS_WINDOW, ASM, True,
        )  # fmt: skip

    if HAS_SINKS:
        sink = tl.load(SINKS + heads, mask=g < G, other=0.0).to(tl.float32) * 1.4426950408889634
        m_s = tl.maximum(m_i, sink)
        l_i = l_i * tl.exp2(m_i - m_s) + tl.exp2(sink - m_s)
        acc = acc * tl.exp2(m_i - m_s)[:, None]
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc * (vf / l_safe)[:, None]
    tl.store(
        OUT + tok[:, None] * stride_ot + heads[:, None] * stride_oh + offs_dv[None, :],
        o.to(OUT.dtype.element_ty),
        mask=rmask[:, None],
    )


@triton.jit
def _tile(
    q,
    m_i,
    l_i,
    acc,
    s,
    hi,
    pos,
    window,
    pt_row,
    page_shift,
    K,
    V,
    KBS,
    VBS,
    hk,
    stride_kr,
    stride_vr,
    stride_kbr,
    stride_vbr,
    qk_scale,
    softcap,
    BLOCK_N: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    FMT: tl.constexpr,
    CDT: tl.constexpr,
    IS_F32: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    ASM: tl.constexpr,
    MASKED: tl.constexpr,
):
    """One KV tile ``[s, s + BLOCK_N)`` of the online softmax. ``MASKED``: apply the causal
    mask, the window and ``j < hi`` (else every row sees the whole tile)."""
    j = s + tl.arange(0, BLOCK_N)
    jm = j < hi
    page = tl.load(pt_row + (j >> page_shift), mask=jm, other=0)
    slot = (page.to(tl.int64) << page_shift) + (j & ((1 << page_shift) - 1))
    k = load_kv_tile(K, KBS, slot, jm, hk, stride_kr, stride_kbr, BLOCK_N, D, FMT, CDT, ASM)
    if IS_F32:
        qk = tl.dot(q, tl.trans(k), input_precision="tf32x3")
    else:
        qk = tl.dot(q, tl.trans(k))
    qk = softmax_logits(qk, qk_scale, softcap, HAS_SOFTCAP)
    if MASKED:
        keep = jm[None, :] & (j[None, :] <= pos[:, None])
        if HAS_WINDOW:
            keep = keep & (j[None, :] > pos[:, None] - window)
        qk = tl.where(keep, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    # rows with nothing visible yet keep m = -inf; exponentiate against 0 there (no NaN)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(qk - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = load_kv_tile(V, VBS, slot, jm, hk, stride_vr, stride_vbr, BLOCK_N, DV, FMT, CDT, ASM)
    if IS_F32:
        pv = tl.dot(p, v, input_precision="tf32x3")
    else:
        pv = tl.dot(p.to(CDT), v)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc
