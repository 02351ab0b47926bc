"""MLA extend: new tokens of a ragged batch attend causally over the latent cache.

The contract (absorbed form, shapes, ``sm_scale``, ``kv_lora_rank``) is
:mod:`kvpool.attention.mla`'s; this module holds extend's plan and launcher (the head-block
Triton kernel ``kvpool.triton_kernels.mla.mla_extend_kernel``: ``block_t`` new tokens x
``block_h`` heads a program).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvpool._torch import torch
from kvpool.attention._common import Backend, _cdiv, _pow2
from kvpool.attention.checks import (
    _check,
    _check_batch,
    _check_cu_seqlens,
    _check_knob,
    _check_unit_inner_strides,
    _use_triton,
)
from kvpool.attention.mla import (
    _asm_ok,
    _check_mla_view,
    _check_q,
    _kernel_consts,
    _mla_scale,
    _out,
    _rank,
    _scales,
)
from kvpool.attention.reference import reference_mla_extend
from kvpool.attention.variants import _check_fp4_tile

if TYPE_CHECKING:
    from kvpool.pool import LayerView


@dataclass
class MLAExtendPlan:
    """Launch metadata of :func:`mla_extend` for one batch.

    ``work`` ``[n, 2]`` int32 lists (request, first new token) of every non-empty block of
    ``block_t`` new tokens; the other fields as in :class:`MLADecodePlan`.
    """

    cu_seqlens_q: torch.Tensor
    page_table: torch.Tensor
    seq_lens: torch.Tensor
    num_q_heads: int
    kv_lora_rank: int
    work: torch.Tensor
    block_t: int
    block_h: int
    block_n: int
    num_warps: int
    num_stages: int
    asm: bool
    kernel: str = "mla_triton"


# ----------------------------------------------------------------------------- checks


def _extend_tiles(h: int, block_t, block_h, block_n, num_warps, num_stages):
    bh = min(64, _pow2(h)) if block_h is None else _check_knob("block_h", block_h, 1, 128, True)
    bt = max(1, 64 // bh) if block_t is None else _check_knob("block_t", block_t, 1, pow2=True)
    if bt * bh < 16:
        raise ValueError(
            f"`block_t` x `block_h` = {bt} x {bh}: a program needs >= 16 rows (tensor-core tiles)"
        )
    bn = _check_knob("block_n", 32 if block_n is None else block_n, 16, pow2=True)
    nw = _check_knob("num_warps", 8 if num_warps is None else num_warps, 1, 32, pow2=True)
    ns = _check_knob("num_stages", 2 if num_stages is None else num_stages, 1)
    return bt, bh, bn, nw, ns


def plan_mla_extend(
    view: LayerView,
    num_q_heads: int,
    cu_seqlens_q: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    kv_lora_rank: int | None = None,
    block_t: int | None = None,
    block_h: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    asm: bool | None = None,
    host_cu_seqlens_q=None,
) -> MLAExtendPlan:
    """Plan :func:`mla_extend` for one batch: the (request, token block) pairs with new tokens.

    Reads ``cu_seqlens_q`` on the host once (a device sync), or ``host_cu_seqlens_q`` (numpy,
    the same values) without touching the device. Defaults: ``block_h`` the heads' power of
    two up to 64, ``block_t`` ``64 / block_h`` tokens (64 rows a program), ``block_n`` 32, 8
    warps, 2 stages. Raises ValueError as :func:`plan_mla_decode`, and for ``cu_seqlens_q`` not
    non-decreasing from 0.
    """
    rank = _rank(view, kv_lora_rank)
    _check_mla_view(view, rank, kernels=True)
    h = _check_knob("num_q_heads", num_q_heads, 1)
    dev = view.k.device
    bt, bh, bn, nw, ns = _extend_tiles(h, block_t, block_h, block_n, num_warps, num_stages)
    _check_fp4_tile(view, bn)
    _check("cu_seqlens_q", cu_seqlens_q, ndim=1, dtype=torch.int32, device=dev)
    if host_cu_seqlens_q is not None:
        cu_host = torch.from_numpy(host_cu_seqlens_q.astype("int64"))
    else:
        cu_host = cu_seqlens_q.cpu()
    _check_cu_seqlens(cu_host.long(), None)
    # (request, first new token) of every block, request-major: numpy, no loop per block
    lens = np.diff(cu_host.numpy().astype(np.int64))
    nb = -(-lens // bt)
    starts = np.arange(int(nb.sum())) - np.repeat(np.cumsum(nb) - nb, nb)
    work = np.stack([np.repeat(np.arange(len(lens)), nb), starts * bt], 1).astype(np.int32)
    work_t = torch.from_numpy(work).to(dev)
    asm = _asm_ok(view) if asm is None else bool(asm) and _asm_ok(view)
    return MLAExtendPlan(
        cu_seqlens_q, page_table, seq_lens, h, rank, work_t, bt, bh, bn, nw, ns, asm
    )


# ----------------------------------------------------------------------------- launchers


def mla_extend(
    view: LayerView,
    q: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None = None,
    page_table: torch.Tensor | None = None,
    seq_lens: torch.Tensor | None = None,
    *,
    sm_scale: float | None = None,
    kv_lora_rank: int | None = None,
    backend: Backend = "auto",
    plan: MLAExtendPlan | None = None,
    out: torch.Tensor | None = None,
    debug: bool = False,
) -> torch.Tensor:
    """Absorbed MLA extend: ragged new tokens attend causally to their prefix and themselves.

    ``q [T, H, Dl + Dr]`` (request ``b``'s new tokens ``q[cu_seqlens_q[b]:cu_seqlens_q[b+1]]``,
    the last ``q_len_b`` of its ``seq_lens[b]`` tokens, latents written) -> ``[T, H, Dl]`` in
    q's dtype. Other arguments and errors as in :func:`mla_decode` and
    :func:`kvpool.attention.extend`; ``plan`` from :func:`plan_mla_extend`.
    """
    scale = _mla_scale(sm_scale)
    if plan is not None and not isinstance(plan, MLAExtendPlan):
        raise ValueError(f"`plan` is a {type(plan).__name__}: MLA layers need an MLAExtendPlan")
    if plan is not None:
        cu_seqlens_q = plan.cu_seqlens_q if cu_seqlens_q is None else cu_seqlens_q
        page_table = plan.page_table if page_table is None else page_table
        seq_lens = plan.seq_lens if seq_lens is None else seq_lens
        kv_lora_rank = plan.kv_lora_rank if kv_lora_rank is None else kv_lora_rank
    rank = _rank(view, kv_lora_rank, out)
    triton = _use_triton(backend, q)
    _check_mla_view(view, rank, kernels=triton)
    _check_q(q, view)
    if cu_seqlens_q is None or page_table is None or seq_lens is None:
        raise ValueError(
            "`cu_seqlens_q`, `page_table` and `seq_lens` are required without a `plan`"
        )
    dev = view.k.device
    t, h, _ = q.shape
    _check("page_table", page_table, ndim=2, dtype=torch.int32, device=dev)
    bsz = page_table.shape[0]
    _check("cu_seqlens_q", cu_seqlens_q, shape=[bsz + 1], dtype=torch.int32, device=dev)
    _check("seq_lens", seq_lens, shape=[bsz], dtype=torch.int32, device=dev)
    out = _out(out, t, h, rank, q)
    if not triton:
        ref = reference_mla_extend(
            view, q, cu_seqlens_q, page_table, seq_lens, sm_scale=scale, kv_lora_rank=rank
        )
        return out.copy_(ref)
    if debug or dev.type != "cuda":
        _check_batch(view, page_table, seq_lens, cu_seqlens_q, t)
    if t == 0 or bsz == 0:
        return out
    _check_unit_inner_strides(
        out=out, page_table=page_table, seq_lens=seq_lens, cu_seqlens_q=cu_seqlens_q
    )
    if plan is not None:
        if (plan.num_q_heads, plan.kv_lora_rank) != (h, rank):
            raise ValueError(
                f"`plan` was made for {plan.num_q_heads} heads, kv_lora_rank "
                f"{plan.kv_lora_rank}; this call has {h}, {rank}"
            )
        bt, bh, bn, nw, ns = (
            plan.block_t,
            plan.block_h,
            plan.block_n,
            plan.num_warps,
            plan.num_stages,
        )
        work, asm, grid0, per_req = plan.work, plan.asm, plan.work.shape[0], 1
    else:
        bt, bh, bn, nw, ns = _extend_tiles(h, None, None, None, None, None)
        work, asm = None, _asm_ok(view)
        per_req = _cdiv(t, bt)
        grid0 = bsz * per_req
    _check_fp4_tile(view, bn)
    if grid0 == 0:
        return out

    from kvpool.triton_kernels.mla import mla_extend_kernel

    kbs, ksc, kbs_stride = _scales(view)
    mla_extend_kernel[(grid0, _cdiv(h, bh))](
        q, view.k, kbs, ksc, page_table, seq_lens, cu_seqlens_q,
        work if work is not None else cu_seqlens_q, out,
        q.stride(0), q.stride(1), view.k.stride(0), kbs_stride, page_table.stride(0),
        out.stride(0), out.stride(1), scale, per_req, view.page_size.bit_length() - 1, h,
        BLOCK_H=bh, BLOCK_T=bt, BLOCK_N=bn, USE_WORK=work is not None,
        **_kernel_consts(view, rank, asm), num_warps=nw, num_stages=ns,
    )  # fmt: skip
    return out
