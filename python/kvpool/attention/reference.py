"""Torch reference paths: dequantize with :mod:`kvpool.formats`, then attention in fp32."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvpool import formats
from kvpool._torch import torch
from kvpool.attention.checks import _check_batch, _check_options, _sm_scale

if TYPE_CHECKING:
    from kvpool.pool import LayerView


def _gather_dequant(view: LayerView, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the given slots, dequantized to fp32 ``[L, H, D]`` / ``[L, H, Dv]``."""
    h = view.num_kv_heads
    out = []
    for data, bs, sc in (
        (view.k, view.k_block_scale, view.k_scale),
        (view.v, view.v_block_scale, view.v_scale),
    ):
        x = data[slots]
        b = None
        if bs is not None:
            b = bs[slots].reshape(len(slots), h, -1)
        scale = sc.reshape(()) if sc is not None else 1.0
        out.append(formats.dequantize(x, b, view.dtype, scale=scale))
    return out[0], out[1]


def _attend(q, k, v, pos, *, sm_scale, window, sinks, softcap):
    """fp32 attention of ``q [n, H_q, D]`` at positions ``pos [n]`` over ``k/v [L, H, *]``."""
    hq, hk = q.shape[1], k.shape[1]
    g = hq // hk
    k = k.repeat_interleave(g, dim=1)  # [L, H_q, D]
    v = v.repeat_interleave(g, dim=1)
    s = torch.einsum("nhd,lhd->hnl", q.float(), k) * sm_scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    j = torch.arange(k.shape[0], device=q.device)
    keep = j[None, :] <= pos[:, None]
    if window is not None:
        keep &= j[None, :] > pos[:, None] - window
    s = s.masked_fill(~keep[None], float("-inf"))
    if sinks is not None:
        sink = sinks.float()[:, None, None].expand(hq, s.shape[1], 1)
        p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
    else:
        p = torch.softmax(s, dim=-1)
    return torch.einsum("hnl,lhd->nhd", p, v)


def _slots(view: LayerView, page_table: torch.Tensor, b: int, lo: int, n: int) -> torch.Tensor:
    """Slots of request ``b``'s tokens ``lo .. n - 1`` (ids checked by :func:`_check_batch`)."""
    ps = view.page_size
    pos = torch.arange(lo, n, device=page_table.device)
    pages = page_table[b, pos // ps].long()
    return pages * ps + pos % ps


def reference_decode(
    view, q, page_table, seq_lens, *, sm_scale=None, window=None, sinks=None, softcap=None
) -> torch.Tensor:
    """Torch reference of :func:`decode`: dequantize, then attention in fp32.

    Each request's slots are dequantized with :mod:`kvpool.formats`; only slots below
    ``seq_len`` are read. Returns ``[B, H_q, Dv]`` fp32. Raises ValueError on bad options,
    ``seq_lens`` or page ids (:func:`_check_batch`).
    """
    scale = _sm_scale(sm_scale, q.shape[-1])
    window, softcap = _check_options(window, softcap, None, q.shape[1], q.device)
    # the reference reads on the host anyway: a page id outside the pool would index out of
    # range (an IndexError from deep in torch) or, when negative or 0, read wrong rows silently
    _check_batch(view, page_table, seq_lens, window=window)
    lens = seq_lens.cpu().tolist()
    res = torch.empty(q.shape[0], q.shape[1], view.v_head_dim, dtype=torch.float32, device=q.device)
    for b, n in enumerate(lens):
        # (slots before the window are never read: their pages may be gone, as in the kernels)
        lo = 0 if window is None else max(n - window, 0)
        k, v = _gather_dequant(view, _slots(view, page_table, b, lo, n))
        pos = torch.tensor([n - 1 - lo], device=q.device)  # (positions from lo)
        res[b] = _attend(
            q[b : b + 1], k, v, pos, sm_scale=scale, window=window, sinks=sinks, softcap=softcap
        )[0]
    return res


def reference_extend(
    view,
    q,
    cu_seqlens_q,
    page_table,
    seq_lens,
    *,
    sm_scale=None,
    window=None,
    sinks=None,
    softcap=None,
) -> torch.Tensor:
    """Torch reference of :func:`extend`: dequantize, then causal attention in fp32.

    Returns ``[T, H_q, Dv]`` fp32. Raises ValueError on bad options, ``cu_seqlens_q``,
    ``seq_lens`` or page ids (:func:`_check_batch`).
    """
    scale = _sm_scale(sm_scale, q.shape[-1])
    window, softcap = _check_options(window, softcap, None, q.shape[1], q.device)
    _check_batch(view, page_table, seq_lens, cu_seqlens_q, q.shape[0], window)
    cu = cu_seqlens_q.cpu().tolist()
    lens = seq_lens.cpu().tolist()
    res = torch.zeros(q.shape[0], q.shape[1], view.v_head_dim, dtype=torch.float32, device=q.device)
    for b, n in enumerate(lens):
        a, e = cu[b], cu[b + 1]
        if e == a:
            continue
        # (slots before the first query's window are never read, as in the kernels)
        p0 = n - (e - a)
        lo = 0 if window is None else max(p0 + 1 - window, 0)
        k, v = _gather_dequant(view, _slots(view, page_table, b, lo, n))
        pos = torch.arange(p0, n, device=q.device) - lo  # (positions from lo)
        res[a:e] = _attend(
            q[a:e], k, v, pos, sm_scale=scale, window=window, sinks=sinks, softcap=softcap
        )
    return res


def _latent(view: LayerView, slots: torch.Tensor) -> torch.Tensor:
    """MLA latent rows of the given slots, dequantized to fp32 ``[L, kv_lora_rank + rope]``."""
    x = view.k[slots]
    b = None
    if view.k_block_scale is not None:
        b = view.k_block_scale[slots].reshape(len(slots), 1, -1)
    scale = view.k_scale.reshape(()) if view.k_scale is not None else 1.0
    return formats.dequantize(x, b, view.dtype, scale=scale)[:, 0]


def _attend_latent(q, lat, pos, *, sm_scale, kv_lora_rank):
    """fp32 absorbed MLA attention of ``q [n, H, Dl + Dr]`` at positions ``pos [n]``.

    Over the latent rows ``lat [L, Dl + Dr]``: K is the whole row, V its first ``kv_lora_rank``.
    """
    s = torch.einsum("nhd,ld->nhl", q.float(), lat) * sm_scale
    keep = torch.arange(lat.shape[0], device=q.device)[None, :] <= pos[:, None]  # [n, L]
    s = s.masked_fill(~keep[:, None, :], float("-inf"))
    return torch.einsum("nhl,ld->nhd", torch.softmax(s, dim=-1), lat[:, :kv_lora_rank])


def reference_mla_decode(view, q, page_table, seq_lens, *, sm_scale, kv_lora_rank):
    """Torch reference of :func:`kvpool.attention.mla.mla_decode`: dequantize, attend in fp32.

    ``q [B, H, Dl + Dr]``; returns ``[B, H, kv_lora_rank]`` fp32. Only slots below ``seq_len`` are
    read. Raises ValueError on bad ``seq_lens`` or page ids (:func:`_check_batch`).
    """
    _check_batch(view, page_table, seq_lens)
    res = torch.empty(q.shape[0], q.shape[1], kv_lora_rank, dtype=torch.float32, device=q.device)
    for b, n in enumerate(seq_lens.cpu().tolist()):
        lat = _latent(view, _slots(view, page_table, b, 0, n))
        pos = torch.tensor([n - 1], device=q.device)
        res[b] = _attend_latent(
            q[b : b + 1], lat, pos, sm_scale=sm_scale, kv_lora_rank=kv_lora_rank
        )[0]
    return res


def reference_mla_extend(view, q, cu_seqlens_q, page_table, seq_lens, *, sm_scale, kv_lora_rank):
    """Torch reference of :func:`kvpool.attention.mla_extend.mla_extend`: causal, fp32.

    ``q [T, H, Dl + Dr]``; returns ``[T, H, kv_lora_rank]`` fp32. Raises ValueError on bad
    ``cu_seqlens_q``, ``seq_lens`` or page ids (:func:`_check_batch`).
    """
    _check_batch(view, page_table, seq_lens, cu_seqlens_q, q.shape[0])
    cu = cu_seqlens_q.cpu().tolist()
    res = torch.zeros(q.shape[0], q.shape[1], kv_lora_rank, dtype=torch.float32, device=q.device)
    for b, n in enumerate(seq_lens.cpu().tolist()):
        a, e = cu[b], cu[b + 1]
        if e == a:
            continue
        lat = _latent(view, _slots(view, page_table, b, 0, n))
        pos = torch.arange(n - (e - a), n, device=q.device)
        res[a:e] = _attend_latent(q[a:e], lat, pos, sm_scale=sm_scale, kv_lora_rank=kv_lora_rank)
    return res
