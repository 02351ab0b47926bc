"""Extend launcher: checks, then the Triton extend kernel over ragged new tokens."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvpool._host import as_device_tensor
from kvpool._torch import torch
from kvpool.attention._common import (
    _KERNEL_FORMAT,
    _Q_DTYPES,
    Backend,
    _cdiv,
    _compute_dtype,
    _pow2,
    _row_stride,
    _scale_args,
    _tl_dtype,
)
from kvpool.attention.checks import (
    _check,
    _check_batch,
    _check_options,
    _check_unit_inner_strides,
    _check_view,
    _group,
    _out_buffer,
    _sm_scale,
    _use_triton,
)
from kvpool.attention.mla import _refuse
from kvpool.attention.mla_extend import mla_extend
from kvpool.attention.plans import ExtendPlan, _extend_tiles
from kvpool.attention.reference import reference_extend
from kvpool.attention.variants import (
    _asm_default,
    _asm_mode,
    _asm_ok,
    _check_fp4_tile,
    _head_factor,
)

if TYPE_CHECKING:
    from kvpool.pool import LayerView


def extend(
    view: LayerView,
    q: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None = None,
    page_table: torch.Tensor | None = None,
    seq_lens: torch.Tensor | None = None,
    *,
    sm_scale: float | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
    backend: Backend = "auto",
    plan: ExtendPlan | None = None,
    out: torch.Tensor | None = None,
    debug: bool = False,
    kv_lora_rank: int | None = None,
) -> torch.Tensor:
    """Extend attention: new tokens of a ragged batch attend causally to their whole sequence.

    Request ``b``'s new tokens are ``q[cu_seqlens_q[b]:cu_seqlens_q[b+1]]``; they are the last
    ``q_len_b`` of its ``seq_lens[b]`` tokens, whose K/V (prefix and new) are already in the
    cache, so the cached prefix is ``seq_lens[b] - q_len_b`` tokens (0 for a plain prefill).

    Parameters
    ----------
    view : LayerView
        The layer's buffers. An MLA layer (``v`` None) runs
        :func:`kvpool.attention.mla_extend.mla_extend` (``q [T, H, kv_lora_rank +
        qk_rope_head_dim]``, ``sm_scale`` required, output ``[T, H, kv_lora_rank]``).
    q : torch.Tensor
        ``[T, H_q, D]`` fp32/bf16/fp16, ``T = cu_seqlens_q[-1]``.
    cu_seqlens_q : torch.Tensor or numpy.ndarray
        ``[B + 1]`` int32, non-decreasing from 0 (omit when ``plan`` is given).
    page_table : torch.Tensor or numpy.ndarray
        ``[B, max_pages]`` int32.
    seq_lens : torch.Tensor or numpy.ndarray
        ``[B]`` int32, ``seq_lens[b] >= q_len_b``.
    sm_scale, window, sinks, softcap, backend, out
        As in :func:`decode` (``out`` is ``[T, H_q, Dv]``).
    debug : bool
        As in :func:`decode`; also checks ``cu_seqlens_q`` (non-decreasing from 0 to ``T``) and
        ``seq_lens[b] >= q_len_b``. CPU tensors are always checked.
    plan : ExtendPlan, optional
        From :func:`plan_extend`.
    kv_lora_rank : int, optional
        MLA layers only: the latent's value part (see :mod:`kvpool.attention.mla`).

    Returns
    -------
    torch.Tensor
        ``[T, H_q, Dv]`` in ``q``'s dtype.

    Raises
    ------
    ValueError
        A tensor of the wrong shape, dtype or device (the message names it), a bad option;
        bad ``cu_seqlens_q``, ``seq_lens`` or page ids (see ``debug``).
    """
    # numpy batch metadata (what the Rust batch helpers return): to the device once
    page_table = as_device_tensor("page_table", page_table, view.k.device)
    seq_lens = as_device_tensor("seq_lens", seq_lens, view.k.device)
    cu_seqlens_q = as_device_tensor("cu_seqlens_q", cu_seqlens_q, view.k.device)
    if view.v is None:  # MLA: the absorbed latent kernels
        _refuse("extend", window=window, sinks=sinks, softcap=softcap)
        return mla_extend(
            view, q, cu_seqlens_q, page_table, seq_lens, sm_scale=sm_scale,
            kv_lora_rank=kv_lora_rank, backend=backend, plan=plan, out=out, debug=debug,
        )  # fmt: skip
    if kv_lora_rank is not None:
        raise ValueError(f"`kv_lora_rank`: MLA layers only (layer {view.layer} stores K and V)")
    _check_view(view)
    if plan is not None and not isinstance(plan, ExtendPlan):
        raise ValueError(
            f"`plan` is a {type(plan).__name__}: layer {view.layer} needs an ExtendPlan"
        )
    dev = view.k.device
    _check("q", q, ndim=3, dtype=_Q_DTYPES, device=dev)
    t, hq, d = q.shape
    if d != view.head_dim:
        raise ValueError(f"`q` head dim is {d}, the cache stores {view.head_dim}")
    if q.stride(2) != 1:
        raise ValueError("`q` must be contiguous in its last dim")
    g = _group(view, hq)
    if plan is not None:
        cu_seqlens_q = plan.cu_seqlens_q if cu_seqlens_q is None else cu_seqlens_q
        page_table = plan.page_table if page_table is None else page_table
        seq_lens = plan.seq_lens if seq_lens is None else seq_lens
    if cu_seqlens_q is None or page_table is None or seq_lens is None:
        raise ValueError(
            "`cu_seqlens_q`, `page_table` and `seq_lens` are required without a `plan`"
        )
    _check("page_table", page_table, ndim=2, dtype=torch.int32, device=dev)
    bsz = page_table.shape[0]
    _check("cu_seqlens_q", cu_seqlens_q, shape=[bsz + 1], dtype=torch.int32, device=dev)
    _check("seq_lens", seq_lens, shape=[bsz], dtype=torch.int32, device=dev)
    scale = _sm_scale(sm_scale, d)
    window, softcap = _check_options(window, softcap, sinks, hq, dev)
    out = _out_buffer(out, t, hq, view, q)
    if not _use_triton(backend, q):
        out.copy_(
            reference_extend(
                view,
                q,
                cu_seqlens_q,
                page_table,
                seq_lens,
                sm_scale=scale,
                window=window,
                sinks=sinks,
                softcap=softcap,
            )
        )
        return out
    if debug or dev.type != "cuda":  # reads the values: free on CPU tensors, a sync on the GPU
        _check_batch(view, page_table, seq_lens, cu_seqlens_q, t, window)
    if t == 0 or bsz == 0:
        return out
    _check_unit_inner_strides(
        out=out, page_table=page_table, seq_lens=seq_lens, cu_seqlens_q=cu_seqlens_q
    )

    from kvpool.triton_kernels.extend import extend_kernel

    if plan is not None:
        block_t, block_n, nw, ns = plan.block_t, plan.block_n, plan.num_warps, plan.num_stages
        _check_fp4_tile(view, block_n)  # the plan may come from a view of another dtype
        asm = plan.asm and _asm_ok(view)
        work = plan.work
        grid0 = work.shape[0]
        blocks_per_req = 1
    else:
        block_t, block_n, nw, ns = _extend_tiles(
            view.dtype, g, None, None, None, None, _head_factor(view)
        )
        asm = _asm_default(view, "extend")
        work = None
        blocks_per_req = _cdiv(t, block_t)
        grid0 = bsz * blocks_per_req
    if grid0 == 0:
        return out
    fmt, _, has_scale, fp4_mul = _KERNEL_FORMAT[view.dtype]
    cdt = _compute_dtype(view.dtype)
    kbs, vbs, ksc, vsc = _scale_args(view)
    dummy = out
    extend_kernel[(grid0, view.num_kv_heads)](
        q,
        view.k,
        view.v,
        kbs,
        vbs,
        ksc,
        vsc,
        page_table,
        seq_lens,
        cu_seqlens_q,
        work if work is not None else cu_seqlens_q,
        sinks if sinks is not None else dummy,
        out,
        q.stride(0),
        q.stride(1),
        view.k.stride(0),
        view.v.stride(0),
        _row_stride(kbs, view),
        _row_stride(vbs, view),
        page_table.stride(0),
        out.stride(0),
        out.stride(1),
        scale,
        float(softcap or 1.0),
        int(window or 0),
        blocks_per_req,
        view.page_size.bit_length() - 1,
        G=g,
        GP=_pow2(g),
        D=d,
        DV=view.v_head_dim,
        BLOCK_T=block_t,
        BLOCK_N=block_n,
        FMT=fmt,
        CDT=_tl_dtype(cdt),
        IS_F32=cdt == torch.float32,
        HAS_SCALE=has_scale,
        FP4_MUL=fp4_mul,
        HAS_SOFTCAP=softcap is not None,
        HAS_WINDOW=window is not None,
        HAS_SINKS=sinks is not None,
        USE_WORK=work is not None,
        ASM=_asm_mode(asm),
        num_warps=nw,
        num_stages=ns,
    )
    return out
