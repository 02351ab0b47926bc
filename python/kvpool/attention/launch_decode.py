"""Decode launcher: checks, then the Triton or Gluon split kernel and the split merge."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvpool import _launch
from kvpool._host import as_device_tensor
from kvpool._torch import torch
from kvpool.attention import gluon_knobs, replay, variants
from kvpool.attention._common import (
    _FP4,
    _KERNEL_FORMAT,
    _Q_DTYPES,
    Backend,
    _compute_dtype,
    _interpreting,
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
from kvpool.attention.mla import _refuse, mla_decode
from kvpool.attention.plans import DecodePlan, plan_decode
from kvpool.attention.reference import reference_decode
from kvpool.attention.variants import (
    _asm_mode,
    _asm_ok,
    _capability,
    _check_fp4_tile,
    _gluon_unfit,
)

if TYPE_CHECKING:
    from kvpool.pool import LayerView


def decode(
    view: LayerView,
    q: torch.Tensor,
    page_table: torch.Tensor | None = None,
    seq_lens: torch.Tensor | None = None,
    *,
    sm_scale: float | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
    backend: Backend = "auto",
    plan: DecodePlan | None = None,
    out: torch.Tensor | None = None,
    debug: bool = False,
    kv_lora_rank: int | None = None,
) -> torch.Tensor:
    """Decode attention of one new token per request over the paged cache of one layer.

    Parameters
    ----------
    view : LayerView
        The layer's buffers (any KV dtype). An MLA layer (``v`` None) runs
        :func:`kvpool.attention.mla.mla_decode`: ``q [B, H, kv_lora_rank + qk_rope_head_dim]``
        with W_UK absorbed, ``sm_scale`` required, no ``window``/``sinks``/``softcap``, output
        ``[B, H, kv_lora_rank]``.
    q : torch.Tensor
        ``[B, H_q, D]`` fp32/bf16/fp16, ``H_q`` a multiple of the KV heads; the query of the
        token at position ``seq_len - 1`` (its K/V already written).
    page_table : torch.Tensor or numpy.ndarray
        ``[B, max_pages]`` int32 (omit when ``plan`` is given). Numpy int32 arrays (what the
        batch helpers return) are copied to the pool's device (pinned, ``non_blocking``: no
        sync); a plan holds them already copied, once per batch.
    seq_lens : torch.Tensor or numpy.ndarray
        ``[B]`` int32, each in ``1 .. max_pages * page_size`` (omit when ``plan`` is given).
    sm_scale : float, optional
        Softmax scale, finite and > 0 (None: ``1 / sqrt(D)``).
    window : int, optional
        Sliding window in tokens (the query's own token included), an int >= 1 (Python or
        numpy; not a bool or float).
    sinks : torch.Tensor, optional
        ``[H_q]`` per-head sink logits (natural-log units).
    softcap : float, optional
        Logit soft-capping ``c`` (``c * tanh(x / c)``), finite and > 0.
    backend : {"auto", "triton", "torch"}
        ``auto``: Triton for CUDA tensors, else the torch reference.
    plan : DecodePlan, optional
        From :func:`plan_decode`, shared by every layer of the batch.
    out : torch.Tensor, optional
        ``[B, H_q, Dv]`` in ``q``'s dtype to write into.
    debug : bool
        Also check the batch's values on the GPU kernel path (a host sync): ``seq_lens`` in
        ``1 .. max_pages * page_size`` and the page ids they read in ``0 .. num_pages - 1``
        (page 0, the padding page, serves padded requests: its contents are garbage). CPU
        tensors are always checked.
    kv_lora_rank : int, optional
        MLA layers only: the latent's value part (see :mod:`kvpool.attention.mla`).

    Returns
    -------
    torch.Tensor
        ``[B, H_q, Dv]`` in ``q``'s dtype.

    Raises
    ------
    ValueError
        A tensor of the wrong shape, dtype or device (the message names it), a bad option
        (``sm_scale``, ``softcap``, ``window``: bools, strings, NaN/Inf, out of range); bad
        ``seq_lens`` or page ids (see ``debug``); for the kernels also ``q``, ``out`` or
        ``page_table`` not contiguous in the last dim, ``seq_lens`` not contiguous, and a
        ``plan`` made for another batch or one whose kernel cannot run this layer (a Gluon plan
        on a bf16 or fp32 view, another head_dim, ...).
    """
    key = None
    if (plan is not None and page_table is None and seq_lens is None and not debug
            and kv_lora_rank is None and view.v is not None):  # fmt: skip
        # a planned call of a kind seen before: replay its launches (attention/replay.py)
        done, key = replay.lookup(
            view, q, plan, out, sinks, sm_scale, window, softcap, backend, _MERGE_PDL
        )
        if done is not None:
            return done
    # numpy batch metadata (what the Rust batch helpers return): to the device once
    page_table = as_device_tensor("page_table", page_table, view.k.device)
    seq_lens = as_device_tensor("seq_lens", seq_lens, view.k.device)
    if view.v is None:  # MLA: the absorbed latent kernels
        _refuse("decode", window=window, sinks=sinks, softcap=softcap)
        return mla_decode(
            view, q, page_table, seq_lens, sm_scale=sm_scale, kv_lora_rank=kv_lora_rank,
            backend=backend, plan=plan, out=out, debug=debug,
        )  # fmt: skip
    if kv_lora_rank is not None:
        raise ValueError(f"`kv_lora_rank`: MLA layers only (layer {view.layer} stores K and V)")
    _check_view(view)
    if plan is not None and not isinstance(plan, DecodePlan):
        raise ValueError(
            f"`plan` is a {type(plan).__name__}: layer {view.layer} needs a DecodePlan"
        )
    dev = view.k.device
    _check("q", q, ndim=3, dtype=_Q_DTYPES, device=dev)
    bsz, hq, d = q.shape
    if d != view.head_dim:
        raise ValueError(f"`q` head dim is {d}, the cache stores {view.head_dim}")
    if q.stride(2) != 1:
        raise ValueError("`q` must be contiguous in its last dim")
    g = _group(view, hq)
    if plan is not None:
        if page_table is None:
            page_table = plan.page_table
        if seq_lens is None:
            seq_lens = plan.seq_lens
        if plan.num_q_heads != hq:
            raise ValueError(f"`plan` was made for {plan.num_q_heads} query heads, `q` has {hq}")
    if page_table is None or seq_lens is None:
        raise ValueError("`page_table` and `seq_lens` are required without a `plan`")
    _check("page_table", page_table, shape=[bsz, None], dtype=torch.int32, device=dev)
    _check("seq_lens", seq_lens, shape=[bsz], dtype=torch.int32, device=dev)
    scale = _sm_scale(sm_scale, d)
    window, softcap = _check_options(window, softcap, sinks, hq, dev)
    out = _out_buffer(out, bsz, hq, view, q)
    if not _use_triton(backend, q):
        out.copy_(
            reference_decode(
                view,
                q,
                page_table,
                seq_lens,
                sm_scale=scale,
                window=window,
                sinks=sinks,
                softcap=softcap,
            )
        )
        return out
    if bsz == 0:
        return out
    _check_unit_inner_strides(out=out, page_table=page_table, seq_lens=seq_lens)
    if debug or dev.type != "cuda":  # reads the values: free on CPU tensors, a sync on the GPU
        _check_batch(view, page_table, seq_lens, window=window)
    if plan is None:
        plan = plan_decode(view, hq, page_table, seq_lens)
    elif plan.page_table.shape[0] != bsz:
        raise ValueError(f"`plan` was made for {plan.page_table.shape[0]} requests, `q` has {bsz}")
    if plan.group_pad < g:
        raise ValueError(f"`plan` pads the query group to {plan.group_pad} rows, the group is {g}")
    # a plan may come from a view of another dtype or geometry (it is shared across layers)
    if plan.gluon and (unfit := _gluon_unfit(view, g)) is not None:
        raise ValueError(f"`plan` uses the Gluon kernel, which does not run {unfit}")
    if plan.gluon and plan.knobs is not None:
        if (unfit := gluon_knobs.knobs_unfit(view, g, plan.knobs)) is not None:
            raise ValueError(f"`plan` uses the Gluon kernel, which does not run {unfit}")
    if not plan.gluon:  # (the Gluon kernel's 16-token tiles are its own code)
        _check_fp4_tile(view, plan.block_n)
    if plan.num_splits > 1 and (
        plan.part_out is None
        or tuple(plan.part_out.shape) != (bsz, hq, plan.num_splits, view.v_head_dim)
        or plan.part_out.device != dev
    ):
        got = None if plan.part_out is None else tuple(plan.part_out.shape)
        raise ValueError(
            f"`plan` split workspace is {got}, this batch needs "
            f"{(bsz, hq, plan.num_splits, view.v_head_dim)} on {dev} (plan made for another view?)"
        )

    from kvpool.triton_kernels.decode import decode_kernel

    fmt, _, has_scale, fp4_mul = _KERNEL_FORMAT[view.dtype]
    cdt = _compute_dtype(view.dtype)
    kbs, vbs, ksc, vsc = _scale_args(view)
    s = plan.num_splits
    gp = plan.group_pad
    dummy = out
    calls: list = []  # (kernel, grid, args, kwargs) each, launched (and recorded) below
    if plan.gluon:
        _launch_gluon(
            view, q, page_table, seq_lens, plan, out, scale, softcap, window, sinks, calls=calls
        )
    else:
        _launch.call(
            calls,
            decode_kernel,
            (bsz, view.num_kv_heads, s),
            q,
            view.k,
            view.v,
            kbs,
            vbs,
            ksc,
            vsc,
            page_table,
            seq_lens,
            sinks if sinks is not None else dummy,
            out,
            plan.part_out if s > 1 else dummy,
            plan.part_lse if s > 1 else dummy,
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
            view.page_size.bit_length() - 1,
            s,
            G=g,
            GP=gp,
            D=d,
            DV=view.v_head_dim,
            BLOCK_N=plan.block_n,
            FINAL=s == 1,
            FMT=fmt,
            CDT=_tl_dtype(cdt),
            IS_F32=cdt == torch.float32,
            USE_DOT=plan.use_dot,
            HAS_SCALE=has_scale,
            FP4_MUL=fp4_mul,
            HAS_SOFTCAP=softcap is not None,
            HAS_WINDOW=window is not None,
            HAS_SINKS=sinks is not None,
            PREFETCH=plan.prefetch,
            ABLATE=plan.ablate,
            ASM=_asm_mode(plan.asm and _asm_ok(view)),
            SWAP=plan.swap,
            PAGE_AHEAD=plan.num_stages >= 3 and not plan.prefetch,
            num_warps=plan.num_warps,
            num_stages=plan.num_stages,
            **({} if plan.maxnreg is None else {"maxnreg": plan.maxnreg}),
        )
    if s > 1 and plan.ablate != 4:  # ablate 4 (benchmarks only): leave the merge out
        _merge(plan, out, sinks, vsc, has_scale, fp4_mul, calls=calls)
    replay.record_decode(view, key, calls, q, plan, out, sinks, page_table, seq_lens)
    return out


# Launch the split merge as a programmatic dependent of the split kernel where the GPU can
# (compute capability 9.x and 10.x; see _merge). A module switch for benchmarks' A/B runs
# (benches/attention, section ``small``).
_MERGE_PDL = True


def _merge(
    plan: DecodePlan, out, sinks, vsc, has_scale: bool, fp4_mul: float, calls: list | None = None
) -> None:
    """Launch ``decode.merge_kernel`` over the plan's split workspace into ``out [B, H_q, Dv]``.

    With ``calls`` (a list) the launch is appended to it instead (:func:`kvpool._launch.call`).

    Grid ``(B, H_q, Dv / BLOCK_DV)`` with the tiles of :func:`_merge_tiles` (a small batch
    spreads over ``Dv / 32`` programs per (request, query head)). On compute capability 9.x and
    10.x the merge is launched as a programmatic dependent (PDL) of the split kernel, the
    launch just before it on the stream: its launch overlaps the split kernel's tail and it
    waits (``griddepcontrol.wait``) for the split grid to complete before reading anything.
    Measured gain on the H200: 0.0-0.5 us (benches/attention, run 10).
    """
    from kvpool.triton_kernels.decode import merge_kernel

    bsz, hq, dv = out.shape
    sp, block_dv, warps = _merge_tiles(bsz * hq, plan.num_splits, dv)
    # compute capability 9.x / 10.x only: PDL launches failed under graph capture on SM120 in
    # a peer engine (sgl-project/sglang#18596), and nothing here was measured there
    pdl = _MERGE_PDL and not _interpreting() and _capability(out.device)[0] in (9, 10)
    _launch.call(
        calls,
        merge_kernel,
        (bsz, hq, dv // block_dv),
        plan.part_out,
        plan.part_lse,
        sinks if sinks is not None else out,
        vsc,
        out,
        out.stride(0),
        out.stride(1),
        hq,
        plan.num_splits,
        DV=dv,
        BLOCK_DV=block_dv,
        SP=sp,
        HAS_SCALE=has_scale,
        FP4_MUL=fp4_mul,
        HAS_SINKS=sinks is not None,
        PDL=pdl,
        num_warps=warps,
        **({"launch_pdl": True} if pdl else {}),
    )


def _merge_tiles(rows: int, splits: int, dv: int) -> tuple[int, int, int]:
    """``(SP, BLOCK_DV, num_warps)`` of the split merge for ``rows`` = B x H_q.

    SP: splits per step, a power of two in 16..256. BLOCK_DV: output columns per program,
    32 (``dv`` if narrower) below 4,096 rows, so that a small batch spreads over more programs;
    from 4,096 rows as many as keep a step at 8,192 values (all ``dv`` for up to 64 splits at
    ``dv`` 128), at least 32. Warps: one per 1,024 values of a step, 1..4 (a step of 8,192
    fp32 values is 64 registers per thread at 4 warps; the old one-step ``256 x 128`` tile
    spilled).
    """
    sp = min(max(16, _pow2(splits)), 256)
    narrow = min(dv, 32)
    block_dv = narrow if rows < 4096 else min(dv, max(narrow, 8192 // sp))
    return sp, block_dv, max(1, min(4, sp * block_dv // 1024))


def _launch_gluon(
    view, q, page_table, seq_lens, plan, out, scale, softcap, window, sinks, calls=None
):
    """Launch the fp8 or FP4 Gluon decode kernel (the caller merges the splits).

    With ``calls`` (a list) the launch is appended to it instead (:func:`kvpool._launch.call`).

    fp8: ``decode_gluon.decode_kernel`` (options ``_GLUON_FP8_OPTIONS``); nvfp4 and
    fp4_mx_block16: ``decode_gluon_fp4.decode_kernel`` (``_GLUON_FP4_OPTIONS``). Both run the KV
    head fastest in the grid (batch on grid y) up to 65,535 requests, the grid's y limit;
    larger batches keep the batch on x.
    """
    knobs = plan.knobs
    if knobs is not None and knobs.multi:
        gluon_knobs.launch_multi(
            view, q, page_table, seq_lens, plan, out, scale, softcap, window, sinks, calls=calls
        )
        return
    # (the measured kernels: knobs override their TMA choice and lazy-rescale threshold)
    rescale = {} if knobs is None or knobs.rescale is None else {"RESCALE": float(knobs.rescale)}
    bsz, hq, _ = q.shape
    s = plan.num_splits
    head = (q, view.k, view.v)
    tail = (
        page_table,
        seq_lens,
        sinks if sinks is not None else out,
        out,
        plan.part_out if s > 1 else out,
        plan.part_lse if s > 1 else out,
        q.stride(0),
        q.stride(1),
        view.k.stride(0),
        view.v.stride(0),
    )
    opts = dict(
        G=hq // view.num_kv_heads,
        FINAL=s == 1,
        HAS_SOFTCAP=softcap is not None,
        HAS_WINDOW=window is not None,
        HAS_SINKS=sinks is not None,
        D=view.head_dim,
        num_warps=1,
        **({} if plan.maxnreg is None else {"maxnreg": plan.maxnreg}),
    )
    rest = (
        page_table.stride(0),
        out.stride(0),
        out.stride(1),
        scale,
        float(softcap or 1.0),
        int(window or 0),
        view.page_size.bit_length() - 1,
        s,
        hq // view.num_kv_heads,
    )
    if view.dtype in _FP4:
        from kvpool.triton_kernels.decode_gluon_fp4 import decode_kernel

        kbs, vbs = view.k_block_scale.view(torch.uint8), view.v_block_scale.view(torch.uint8)
        paged = view.page_size >= 16  # one page per 16-token tile (the ring needs it)
        # the ring copies scale rows in 4-byte pieces: Triton must see 16-byte aligned rows
        # (an odd KV head count, e.g. 1 under tensor parallelism, takes register prefetch)
        ring = paged and not plan.prefetch
        ring = ring and all(t.stride(0) % 16 == 0 and t.data_ptr() % 16 == 0 for t in (kbs, vbs))
        # head_dim 256: the ring only (register prefetch would spill)
        if view.head_dim == 256 and not ring:
            raise ValueError(
                f"`plan.prefetch` = {plan.prefetch}: FP4 caches at head_dim 256 take the Gluon "
                "kernel's ring (pages of >= 16 tokens, 16-byte aligned scale rows)"
            )
        hf, ablate, use_tma, _ = variants._GLUON_FP4_OPTIONS
        if knobs is not None and knobs.tma is not None:
            use_tma = knobs.tma
        hf = hf and bsz <= 65535
        # plan.block_n: 16 or 32 tokens per ring stage (register prefetch: 16)
        if plan.block_n not in (16, 32):
            raise ValueError(
                f"`plan.block_n` = {plan.block_n}: the FP4 Gluon kernel takes 16 or 32"
            )
        extra = {"SUB": plan.block_n // 16 if ring else 1}
        if ring and use_tma and _has_tma(view.k.device):
            extra.update(TMA=True, KD=_tma_desc(view.k), VD=_tma_desc(view.v))
        grid = (view.num_kv_heads, bsz, s) if hf else (bsz, view.num_kv_heads, s)
        mx = view.dtype == "fp4_mx_block16"  # (exact bf16 values, no global scales)
        dec = (2, 2) if mx else variants._GLUON_FP4_DEC
        ksc, vsc = (kbs, vbs) if mx else (view.k_scale, view.v_scale)
        _launch.call(
            calls, decode_kernel, grid,
            *head, kbs, vbs, ksc, vsc, *tail, kbs.stride(0), vbs.stride(0), *rest,
            DEC_K=dec[0], DEC_V=dec[1], PAGED=paged,
            STAGES=plan.num_stages if ring else 0, HEAD_FAST=hf,
            ABLATE=ablate, **extra, **opts, **rescale,
        )  # fmt: skip
        return
    from kvpool.triton_kernels.decode_gluon import decode_kernel

    paged, lazy, hf = variants._GLUON_FP8_OPTIONS[view.dtype]
    lazy = rescale.get("RESCALE", lazy)
    hf = hf and bsz <= 65535
    grid = (view.num_kv_heads, bsz, s) if hf else (bsz, view.num_kv_heads, s)
    # 16-bit caches (WIDE 1 fp16, 2 bf16): no scales (placeholders)
    wide = {"fp16": 1, "bf16": 2}.get(view.dtype, 0)
    ksc, vsc = (out, out) if wide else (view.k_scale, view.v_scale)
    _launch.call(
        calls, decode_kernel, grid,
        *head, ksc, vsc, *tail, *rest, WIDE=wide,
        PREFETCH=plan.prefetch, STAGES=0 if plan.prefetch else plan.num_stages,
        E5M2=view.dtype == "fp8_e5m2", PAGED=paged and view.page_size >= 16, RESCALE=lazy,
        HEAD_FAST=hf, **opts,
    )  # fmt: skip


def _has_tma(device: torch.device) -> bool:
    """Whether CUDA ``device`` has the Tensor Memory Accelerator (compute capability 9.0+)."""
    return _capability(device) >= (9, 0)


def _tma_desc(t: torch.Tensor):
    """TMA descriptor of an FP4 data buffer for the Gluon decode kernel's ring.

    ``t`` is ``[R, H, w]`` uint8 (``w`` = head_dim / 2: 32, 64 or 128 bytes), described as
    ``[R, H * w]`` with 16 x ``w`` boxes and the ``w``-byte swizzle (none for 32).
    """
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    w = t.shape[2]
    sw = w if w >= 64 else 0  # (head_dim 64: unswizzled 32-byte rows, decode_gluon_fp4)
    layout = gl.NVMMASharedLayout(swizzle_byte_width=sw, element_bitwidth=8, rank=2)
    shape = [t.shape[0], t.shape[1] * t.shape[2]]
    return TensorDescriptor(t, shape, [t.stride(0), 1], [16, w], layout)
