"""Probe kernel (benchmarks only): fp8 paged decode with TMA tile loads.

One program = one request x one KV head x one split, as in ``triton_kernels/decode.py``; each
full tile of ``BN`` tokens (``BN`` divides page_size, so a tile never straddles pages) is one
TMA box ``[BN, D]`` per K and V, read through host tensor descriptors over the cache's
``[rows, H*D]`` view (fp8 bytes, or int32 words with ``WORDS`` for the word decode of the
shipped kernel). Triton's pipeliner turns the descriptor loads into ``cp.async.bulk.tensor``
with mbarriers. The last, partial tile uses masked plain loads (no slot past seq_len is read).
``ABLATE`` 3: raw loads only (tiles summed instead of dotted), as in the shipped kernel.
"""

import triton
import triton.language as tl
from kvpool.triton_kernels.decode import dequant, fp8_words_f16, load_raw


@triton.jit
def tma_decode_kernel(
    Q,
    KD,
    VD,
    K,
    V,
    KSC,
    VSC,
    PT,
    SEQ,
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
    num_splits,
    PSHIFT: tl.constexpr,
    G: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    BN: tl.constexpr,
    FINAL: tl.constexpr,
    NS: tl.constexpr,
    ABLATE: tl.constexpr,
    WORDS: tl.constexpr = False,
):
    b = tl.program_id(0)
    hk = tl.program_id(1)
    split = tl.program_id(2)
    PS: tl.constexpr = 1 << PSHIFT
    seq = tl.load(SEQ + b)
    chunk = tl.cdiv(tl.cdiv(seq, num_splits), BN) * BN
    start = split * chunk
    end = tl.minimum(start + chunk, seq)
    kf = tl.load(KSC)
    vf = tl.load(VSC)
    qk_scale = sm_scale * kf * 1.4426950408889634
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
    qt = tl.trans(q.to(tl.float16))
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc_t = tl.zeros([DV, GP], tl.float32)
    pt_row = PT + b.to(tl.int64) * stride_pt
    nfull = tl.maximum(end - start, 0) // BN
    for i in tl.range(0, nfull, num_stages=NS):
        s = start + i * BN
        page = tl.load(pt_row + (s >> PSHIFT))
        row = page * PS + (s & (PS - 1))
        if WORDS:
            k = fp8_words_f16(KD.load([row, hk * (D // 4)]), BN, D, False, False)
            v = fp8_words_f16(VD.load([row, hk * (DV // 4)]), BN, DV, False, False)
        else:
            k = KD.load([row, hk * D])
            v = VD.load([row, hk * DV])
        if ABLATE == 3:
            qk_t = tl.zeros([BN, GP], tl.float32) + tl.sum(k.to(tl.float32), 1)[:, None]
        else:
            qk_t = tl.dot(k.to(tl.float16), qt)
        qk_t = qk_t * qk_scale
        m_new = tl.maximum(m_i, tl.max(qk_t, 0))
        alpha = tl.exp2(m_i - m_new)
        p_t = tl.exp2(qk_t - m_new[None, :])
        l_i = l_i * alpha + tl.sum(p_t, 0)
        if ABLATE == 3:
            pv_t = tl.zeros([DV, GP], tl.float32) + tl.sum(v.to(tl.float32), 0)[:, None]
        else:
            pv_t = tl.dot(tl.trans(v.to(tl.float16)), p_t.to(tl.float16))
        acc_t = acc_t * alpha[None, :] + pv_t
        m_i = m_new
    # tail (masked plain loads: nothing past seq_len is read)
    s = start + nfull * BN
    if s < end:
        t = s + tl.arange(0, BN)
        tm = t < end
        page = tl.load(pt_row + (t >> PSHIFT), mask=tm, other=0)
        slot = page.to(tl.int64) * PS + (t & (PS - 1))
        kx, ks = load_raw(K, K, slot, tm, hk, stride_kr, 0, D, 1, 1)
        k = dequant(kx, ks, BN, D, 1, tl.float16, False, 1, False)
        vx, vs = load_raw(V, V, slot, tm, hk, stride_vr, 0, DV, 1, 1)
        v = dequant(vx, vs, BN, DV, 1, tl.float16, False, 1, False)
        qk_t = tl.dot(k.to(tl.float16), qt) * qk_scale
        qk_t = tl.where(tm[:, None], qk_t, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk_t, 0))
        alpha = tl.exp2(m_i - m_new)
        p_t = tl.exp2(qk_t - m_new[None, :])
        l_i = l_i * alpha + tl.sum(p_t, 0)
        pv_t = tl.dot(tl.trans(v.to(tl.float16)), p_t.to(tl.float16))
        acc_t = acc_t * alpha[None, :] + pv_t
        m_i = m_new
    acc = tl.trans(acc_t)
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    if FINAL:
        o = acc * (vf / l_safe)[:, None]
        tl.store(
            OUT + b * stride_ob + heads[:, None] * stride_oh + offs_dv[None, :],
            o.to(OUT.dtype.element_ty),
            mask=gmask[:, None],
        )
    else:
        o = acc / l_safe[:, None]
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        row = (b * (G * tl.num_programs(1)) + heads) * num_splits + split
        tl.store(PO + row[:, None].to(tl.int64) * DV + offs_dv[None, :], o, mask=gmask[:, None])
        tl.store(PL + row, lse, mask=gmask)
