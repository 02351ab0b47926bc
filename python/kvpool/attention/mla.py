"""MLA attention over the paged latent cache (DeepSeek-V2/V3/R1, Kimi-K2), in the absorbed form.

Contract (DeepSeek-V2, arXiv 2405.04434, section 2.1 and its appendix on absorbed inference;
the form FlashMLA and FlashInfer's MLA kernels run):

- The cache holds one latent row per token: ``c_kv`` (``kv_lora_rank`` values, 512 for every
  bundled MLA model) followed by the rotary key ``k_rope`` (``qk_rope_head_dim``, 64), written
  by :meth:`kvpool.KVPool.write` as ``k [T, 1, kv_lora_rank + qk_rope_head_dim]``. The layer's
  :class:`~kvpool.pool.LayerView` has ``k [R, 1, Dl + Dr]`` (FP4: ``[R, 1, (Dl + Dr) / 2]``
  uint8 with block scales, nvfp4 ``[R, 1, (Dl + Dr) / 16]`` e4m3, mx ``[R, (Dl + Dr) / 16]``
  uint8), ``v`` None, ``num_kv_heads`` 1; fp8 caches a per-tensor ``k_scale``, nvfp4 its global
  scale there.
- The caller absorbs ``W_UK`` into the query and ``W_UV`` into the output projection: per head,
  ``q = [q_nope @ W_UK^T, q_rope]`` of ``kv_lora_rank + qk_rope_head_dim`` values (``q_rope``
  after rotary embedding), and the output ``o [kv_lora_rank]`` becomes the head's value through
  ``o @ W_UV``. Then every head attends to the same rows: ``K`` = the whole latent row,
  ``V`` = its first ``kv_lora_rank`` values, ``o = softmax(sm_scale * q . K) V``.
- ``sm_scale`` is the caller's: ``1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)`` (= 1/sqrt(192)
  for DeepSeek) times ``mscale^2`` where the model uses YaRN rope scaling (DeepSeek-V3/R1 and
  Kimi-K2 do: ``mscale = 0.1 * mscale_all_dim * ln(factor) + 1``). It is required: no default
  from the shapes would be right for those models.
- Shapes: decode ``q [B, H, Dl + Dr]`` -> ``[B, H, Dl]``; extend ``q [T, H, Dl + Dr]`` ragged by
  ``cu_seqlens_q`` -> ``[T, H, Dl]``, causal over the cached prefix and the new tokens (whose
  latents are already written). q fp32/bf16/fp16, output in q's dtype. ``page_table``,
  ``seq_lens``, ``cu_seqlens_q`` as in :func:`kvpool.attention.decode` / ``extend``.
- ``kv_lora_rank``: the view stores only ``Dl + Dr``; it is taken from ``kv_lora_rank=``, else
  from ``out``'s last dim, else ``head_dim - 64`` (``qk_rope_head_dim`` is 64 in every MLA model
  released so far: DeepSeek-V2, V3, R1, Kimi-K2).

Kernels (``kvpool.triton_kernels.mla``, plan ``kernel = "mla_triton"``): decode splits each
request's tokens (flash-decoding, merged by ``decode.merge_kernel``), one program per (block of
``block_h`` heads, request, split) reading each latent tile once for its heads (tensor-core
dots ``[block_h x 576] x [576 x block_n]``); extend takes ``block_t`` new tokens x ``block_h``
heads per program. Every dtype is dequantized in registers (FP4 included), except with decode's
``dots="fp8"`` (fp8 caches: fp8 dots on the raw bytes, :mod:`~kvpool.attention.mla_dots`). The
kernels need ``kv_lora_rank`` and ``qk_rope_head_dim`` powers of two >= 16 (Triton tiles); the torch
reference (:func:`~kvpool.attention.reference.reference_mla_decode`) takes any geometry.
Extend's plan and launcher live in :mod:`kvpool.attention.mla_extend`. Extend runs the absorbed
form too (about 3.4x the FLOPs of the expanded form at DeepSeek's
shapes: fine for chunks of new tokens over a long prefix, not the fastest for a long plain
prefill).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpool._torch import torch
from kvpool.attention._common import (
    _FP4,
    _KERNEL_FORMAT,
    _Q_DTYPES,
    _STORAGE,
    Backend,
    _cdiv,
    _compute_dtype,
    _pow2,
    _tl_dtype,
)
from kvpool.attention.checks import (
    _check,
    _check_batch,
    _check_knob,
    _check_unit_inner_strides,
    _positive_real,
    _use_triton,
)
from kvpool.attention.mla_dots import _check_dots, _dots_consts
from kvpool.attention.reference import reference_mla_decode
from kvpool.attention.splits import MAX_SPLITS, default_splits
from kvpool.attention.variants import _asm_mode, _check_fp4_tile

if TYPE_CHECKING:
    from kvpool.pool import LayerView

#: qk_rope_head_dim of every MLA model released so far (the default split of a latent row).
MLA_ROPE_DIM = 64


@dataclass
class MLADecodePlan:
    """Launch metadata of :func:`mla_decode` for one batch, reused by every MLA layer.

    Attributes
    ----------
    page_table, seq_lens : torch.Tensor
        ``[B, max_pages]`` / ``[B]`` int32.
    num_q_heads, kv_lora_rank : int
        Heads per rank and the latent's value part (``Dl``).
    num_splits : int
        KV splits per request; 1 writes the output directly.
    block_h, block_n, num_warps, num_stages : int
        Heads per program (a power of two >= 16), KV tile in tokens, launch options.
    asm : bool
        fp8/FP4: decode 32-bit words of the cache (inline PTX; the interpreter emulates it).
    part_out, part_lse : torch.Tensor or None
        fp32 split workspaces ``[B, H, num_splits, Dl]`` / ``[B, H, num_splits]``.
    kernel : str
        The kernel variant that runs: ``"mla_triton"``, ``"mla_gluon"`` (or ``"mla_small"``, a
        :class:`kvpool.attention.mla_small.MLASmallDecodePlan`).
    dots : str
        ``"f16"`` (dequantize in registers, 16-bit dots) or ``"fp8"`` (fp8 caches: fp8 dots on
        the raw cache; :mod:`kvpool.attention.mla_dots`).
    """

    page_table: torch.Tensor
    seq_lens: torch.Tensor
    num_q_heads: int
    kv_lora_rank: int
    num_splits: int
    block_h: int
    block_n: int
    num_warps: int
    num_stages: int
    asm: bool
    part_out: torch.Tensor | None
    part_lse: torch.Tensor | None
    kernel: str = "mla_triton"
    dots: str = "f16"


def _rank(view: LayerView, kv_lora_rank, out=None) -> int:
    """``kv_lora_rank`` checked against the view (see the module docstring for the default)."""
    d = view.head_dim
    if kv_lora_rank is None:
        kv_lora_rank = out.shape[-1] if isinstance(out, torch.Tensor) else d - MLA_ROPE_DIM
    r = _check_knob("kv_lora_rank", kv_lora_rank, 1)
    if r >= d:
        raise ValueError(
            f"`kv_lora_rank` = {r}: must be less than the latent's {d} values "
            "(kv_lora_rank + qk_rope_head_dim)"
        )
    return r


def _check_mla_view(view: LayerView, rank: int, kernels: bool) -> None:
    """ValueError unless ``view`` is an MLA layer the reference (if ``kernels``: Triton) reads.

    Checks the latent's shape, dtype and scales, and for the kernels its geometry.
    """
    if not view.is_mla:
        raise ValueError(f"`view` (layer {view.layer}) is not an MLA layer (it has `v`)")
    if view.dtype not in _KERNEL_FORMAT:
        raise ValueError(
            f"`view.dtype` = {view.dtype!r} is not a KV dtype ({', '.join(_KERNEL_FORMAT)})"
        )
    d, fp4 = view.head_dim, view.dtype in _FP4
    _check("view.k", view.k, shape=[None, 1, d // 2 if fp4 else d], dtype=_STORAGE[view.dtype])
    if view.k.stride(2) != 1:
        raise ValueError(f"`view.k` must be contiguous within a row (strides {view.k.stride()})")
    if fp4:
        bs = view.k_block_scale
        if bs is None:
            raise ValueError(f"`view` is {view.dtype} but has no block scales")
        if bs.shape[0] != view.k.shape[0] or bs[0].numel() != d // 16 or not bs.is_contiguous():
            raise ValueError(
                f"`view.k_block_scale` must hold {d // 16} contiguous scales per row, "
                f"got shape {list(bs.shape)}"
            )
    if _KERNEL_FORMAT[view.dtype][2] and view.k_scale is None:
        raise ValueError(f"`view` is {view.dtype} but has no k_scale")
    if not kernels:
        return
    rope = d - rank
    for name, n in (("kv_lora_rank", rank), ("qk_rope_head_dim", rope)):
        if n < 16 or n & (n - 1):
            raise ValueError(
                f"MLA latent of {d} values = kv_lora_rank {rank} + qk_rope_head_dim {rope}: "
                f"the MLA kernels need both powers of two >= 16 (DeepSeek/Kimi: 512 + 64); "
                f"{name} = {n} is not (backend='torch' runs any geometry)"
            )
    ps = view.page_size
    if ps < 1 or ps & (ps - 1):
        raise ValueError(f"`view.page_size` = {ps}: the kernels need a power of two")


def _mla_scale(sm_scale) -> float:
    if sm_scale is None:
        raise ValueError(
            "`sm_scale` is required for MLA layers: 1/sqrt(qk_nope_head_dim + qk_rope_head_dim) "
            "(1/sqrt(192) for DeepSeek), times mscale^2 with YaRN rope scaling (DeepSeek-V3/R1, "
            "Kimi-K2: mscale = 0.1 * mscale_all_dim * ln(factor) + 1)"
        )
    return _positive_real("sm_scale", sm_scale)


def _check_q(q, view: LayerView) -> None:
    _check("q", q, ndim=3, dtype=_Q_DTYPES, device=view.k.device)
    if q.shape[2] != view.head_dim:
        raise ValueError(
            f"`q` has {q.shape[2]} values per head, the MLA latent {view.head_dim} "
            "(kv_lora_rank + qk_rope_head_dim: q_nope absorbed through W_UK, then q_rope)"
        )
    if q.stride(2) != 1:
        raise ValueError("`q` must be contiguous in its last dim")


def _out(out, rows: int, h: int, rank: int, q: torch.Tensor) -> torch.Tensor:
    shape = [rows, h, rank]
    if out is None:
        return torch.empty(shape, dtype=q.dtype, device=q.device)
    _check("out", out, shape=shape, dtype=q.dtype, device=q.device)
    return out


def _refuse(kind: str, **options) -> None:
    given = [k for k, v in options.items() if v is not None]
    if given:
        raise ValueError(
            f"{', '.join(f'`{k}`' for k in given)}: not supported on MLA layers "
            f"({kind}; DeepSeek and Kimi use none of them)"
        )


def _asm_ok(view: LayerView) -> bool:
    """Word-level decode: fp8/FP4 latent rows starting on 4-byte boundaries (as in a pool)."""
    t = view.k
    return view.dtype in ("fp8_e4m3", "fp8_e5m2", *_FP4) and (
        t.stride(0) * t.element_size() % 4 == 0 and t.data_ptr() % 4 == 0
    )


def _block_h(h: int, block_h, dots=None) -> int:
    if block_h is None:  # (fp8 products run on wgmma only, which takes 64 rows)
        return 64 if dots == "fp8" else min(64, max(16, _pow2(h)))
    return _check_knob("block_h", block_h, 16, 128, pow2=True)


# ----------------------------------------------------------------------------- plans


def plan_mla_decode(
    view: LayerView,
    num_q_heads: int,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    kv_lora_rank: int | None = None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    block_h: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    asm: bool | None = None,
    kernel: str | None = None,
    dots: str | None = None,
) -> MLADecodePlan:
    """Plan :func:`mla_decode` for one batch (any MLA layer of the pool may use it).

    ``kernel``: ``"mla_triton"`` (this module's head-block kernel), ``"mla_small"``
    (:mod:`kvpool.attention.mla_small`, tokens on M; its knobs are documented there) or
    ``"mla_gluon"`` (Hopper, bf16/fp16/fp8: :mod:`kvpool.attention.mla_gluon`). Default:
    ``mla_small`` for at most 32 heads per rank (DeepSeek-V3 and Kimi-K2 at TP 8) unless
    ``KVPOOL_MLA_SMALL=0`` or ``dots="fp8"``; ``mla_gluon`` above 32 heads for
    bf16/fp16/fp8_e4m3 caches on a Hopper GPU when none of ``block_h``, ``block_n``,
    ``num_warps``, ``num_stages``, ``asm`` is given and ``dots`` is not ``"fp8"``, unless
    ``KVPOOL_MLA_GLUON=0`` (:func:`kvpool.attention.mla_gluon.routes_default`); else
    ``mla_triton``. The plan's ``kernel`` names the one that runs.

    Defaults: ``block_h`` the heads' power of two in 16..64 (64 for 128 heads: two programs
    per request and split), ``block_n`` 64 tokens with 64-head programs and 32 below (H200,
    DeepSeek-V3 at B=64 x 8k, run 12: 64 x 64 tiles 0.625 ms bf16 / 1.03 fp8 / 1.39 nvfp4
    against 0.904 / 1.56 / 1.86 with 32-token tiles), 8 warps from 64 heads a program (4
    below), 2 stages, the word decode
    for fp8/FP4, splits from :func:`~kvpool.attention.splits.default_splits` over
    ``B x ceil(H / block_h)`` programs, ``dots="f16"``. ``max_seq_len`` as in
    :func:`plan_decode`. ``dots="fp8"`` (fp8 caches) runs the dots on fp8 tensor cores over the
    raw cache, with q and P rounded to e4m3 (:mod:`kvpool.attention.mla_dots`: accuracy,
    limits); ``asm`` is then False (nothing is decoded) and ``block_h`` 64 at any head count
    (Triton 3.6 runs fp8 products on wgmma, 64 rows; below, on mma.sync, it converts them to
    fp16 first).

    Raises
    ------
    ValueError
        A tensor of the wrong shape/dtype/device, a geometry the kernels do not cover (named,
        with what they support), a knob out of range (``block_h`` a power of two in 16..128,
        ``block_n`` >= 16, 32 for FP4 on the GPU, ``num_splits`` 1..1024), ``dots`` not
        ``"f16"``/``"fp8"``, ``"fp8"`` on a cache that is not fp8 or below 32 values/tokens.
    """
    rank = _rank(view, kv_lora_rank)
    _check_mla_view(view, rank, kernels=True)
    h = _check_knob("num_q_heads", num_q_heads, 1)
    dev = view.k.device
    _check("page_table", page_table, ndim=2, dtype=torch.int32, device=dev)
    _check("seq_lens", seq_lens, shape=[page_table.shape[0]], dtype=torch.int32, device=dev)
    b = page_table.shape[0]
    cap = page_table.shape[1] * view.page_size
    ctx = cap if max_seq_len is None else min(_check_knob("max_seq_len", max_seq_len, 1), cap)
    from kvpool.attention import mla_gluon, mla_small

    if kernel is not None and (not isinstance(kernel, str) or kernel not in mla_small.KERNELS):
        # (checked before routing: with dots="fp8" no later check reads it)
        raise ValueError(
            f"`kernel` = {kernel!r}: MLA decode kernels are {', '.join(mla_small.KERNELS)}"
        )
    if kernel == "mla_gluon" or mla_gluon.routes_default(
        view, h, rank, kernel, dots, block_h, block_n, num_warps, num_stages, asm
    ):  # (Hopper warpgroup MMAs: kvpool.attention.mla_gluon)
        return mla_gluon.plan_gluon(
            view, h, page_table, seq_lens, rank, ctx, num_splits=num_splits, block_h=block_h,
            block_n=block_n, num_warps=num_warps, num_stages=num_stages, asm=asm, dots=dots,
        )  # fmt: skip
    if dots != "fp8":  # (the value checked before routing; fp8's tile limits below)
        _check_dots(view, dots, rank, block_n or 32)
    if kernel == "mla_small" and dots == "fp8":
        raise ValueError(
            "kernel='mla_small' has no fp8 dots (dots='fp8' runs on kernel='mla_triton'); "
            "give dots='f16' or kernel='mla_triton'"
        )
    # few heads: tokens on the MMA's M (fp8 dots are the head-block kernel's)
    if dots != "fp8" and mla_small.routes_small(h, kernel):
        return mla_small.plan_small(
            view, h, page_table, seq_lens, rank, ctx, num_splits=num_splits, block_h=block_h,
            block_n=block_n, num_warps=num_warps, num_stages=num_stages, asm=asm,
        )  # fmt: skip
    bh = _block_h(h, block_h, dots)
    bn_default = 64 if bh >= 64 else 32
    block_n = _check_knob("block_n", bn_default if block_n is None else block_n, 16, pow2=True)
    _check_fp4_tile(view, block_n)
    dots = _check_dots(view, dots, rank, block_n)
    nw = 8 if bh >= 64 else 4
    nw = _check_knob("num_warps", nw if num_warps is None else num_warps, 1, 32, pow2=True)
    # 16-bit caches at 64-head blocks: 3 stages (run 14, DeepSeek TP 1, B=64 x 8k: bf16 0.603 ms
    # against 0.628 with 2; 244 TFLOP/s)
    ns0 = 3 if view.dtype in ("bf16", "fp16") and bh >= 64 else 2
    ns = _check_knob("num_stages", ns0 if num_stages is None else num_stages, 1)
    if num_splits is None:
        num_splits = default_splits(b, _cdiv(h, bh), ctx, dev, block_n, nw)
    num_splits = _check_knob("num_splits", num_splits, 1, MAX_SPLITS)
    part_out = part_lse = None
    if num_splits > 1:
        part_out = torch.empty(b, h, num_splits, rank, dtype=torch.float32, device=dev)
        part_lse = torch.empty(b, h, num_splits, dtype=torch.float32, device=dev)
    if asm is None:  # fp8: Triton's own fp8 -> fp16 conversion (run 14: 0.957 ms against 1.03
        # with the word decode at DeepSeek TP 1, B=64 x 8k, e4m3 and e5m2); FP4: the word decode
        asm = _asm_ok(view) and not view.dtype.startswith("fp8")
    asm = bool(asm) and _asm_ok(view)
    return MLADecodePlan(
        page_table, seq_lens, h, rank, num_splits, bh, block_n, nw, ns, asm and dots == "f16",
        part_out, part_lse, dots=dots,
    )  # fmt: skip


def _kernel_consts(view: LayerView, rank: int, asm: bool) -> dict:
    fmt, _, has_scale, fp4_mul = _KERNEL_FORMAT[view.dtype]
    cdt = _compute_dtype(view.dtype)
    return dict(
        DL=rank,
        DR=view.head_dim - rank,
        FMT=fmt,
        CDT=_tl_dtype(cdt),
        IS_F32=cdt == torch.float32,
        HAS_SCALE=has_scale,
        FP4_MUL=fp4_mul,
        ASM=_asm_mode(asm and _asm_ok(view)),
    )


def _scales(view: LayerView):
    kbs = view.k_block_scale.view(torch.uint8) if view.k_block_scale is not None else view.k
    ksc = view.k_scale if view.k_scale is not None else view.k
    return kbs, ksc, (kbs.stride(0) if view.k_block_scale is not None else 0)


def mla_decode(
    view: LayerView,
    q: torch.Tensor,
    page_table: torch.Tensor | None = None,
    seq_lens: torch.Tensor | None = None,
    *,
    sm_scale: float | None = None,
    kv_lora_rank: int | None = None,
    backend: Backend = "auto",
    plan: MLADecodePlan | None = None,
    out: torch.Tensor | None = None,
    debug: bool = False,
) -> torch.Tensor:
    """Absorbed MLA decode: one new token per request over an MLA layer's latent cache.

    Parameters
    ----------
    view : LayerView
        An MLA layer (``v`` None, ``k`` the latent ``[R, 1, Dl + Dr]``; every KV dtype).
    q : torch.Tensor
        ``[B, H, Dl + Dr]`` fp32/bf16/fp16: per head ``[q_nope W_UK, q_rope]`` (module docstring).
    page_table, seq_lens : torch.Tensor
        ``[B, max_pages]`` / ``[B]`` int32 (omit with a ``plan``); ``seq_lens`` >= 1, the new
        token's latent written.
    sm_scale : float
        Required (module docstring: 1/sqrt(192) x mscale^2 for DeepSeek-V3).
    kv_lora_rank : int, optional
        ``Dl`` (default: ``out``'s last dim, else ``head_dim - 64``).
    backend, plan, out, debug
        As in :func:`kvpool.attention.decode`; ``plan`` from :func:`plan_mla_decode`; ``out``
        ``[B, H, Dl]`` in q's dtype.

    Returns
    -------
    torch.Tensor
        ``[B, H, Dl]`` in q's dtype, to be multiplied by ``W_UV`` per head by the caller.

    Raises
    ------
    ValueError
        No ``sm_scale``; wrong shapes/dtypes/devices (named); a geometry the kernels do not
        cover; a plan made for another batch or rank; bad ``seq_lens`` or page ids (CPU
        tensors always, CUDA with ``debug``).
    """
    scale = _mla_scale(sm_scale)
    if plan is not None and not isinstance(plan, MLADecodePlan):
        raise ValueError(f"`plan` is a {type(plan).__name__}: MLA layers need an MLADecodePlan")
    if plan is not None:
        page_table = plan.page_table if page_table is None else page_table
        seq_lens = plan.seq_lens if seq_lens is None else seq_lens
        kv_lora_rank = plan.kv_lora_rank if kv_lora_rank is None else kv_lora_rank
    rank = _rank(view, kv_lora_rank, out)
    triton = _use_triton(backend, q)
    _check_mla_view(view, rank, kernels=triton)
    _check_q(q, view)
    if page_table is None or seq_lens is None:
        raise ValueError("`page_table` and `seq_lens` are required without a `plan`")
    dev = view.k.device
    bsz, h, _ = q.shape
    _check("page_table", page_table, shape=[bsz, None], dtype=torch.int32, device=dev)
    _check("seq_lens", seq_lens, shape=[bsz], dtype=torch.int32, device=dev)
    out = _out(out, bsz, h, rank, q)
    if not triton:
        ref = reference_mla_decode(view, q, page_table, seq_lens, sm_scale=scale, kv_lora_rank=rank)
        return out.copy_(ref)
    if bsz == 0:
        return out
    _check_unit_inner_strides(out=out, page_table=page_table, seq_lens=seq_lens)
    if debug or dev.type != "cuda":
        _check_batch(view, page_table, seq_lens)
    if plan is None:
        plan = plan_mla_decode(view, h, page_table, seq_lens, kv_lora_rank=rank)
    if (plan.num_q_heads, plan.kv_lora_rank, plan.page_table.shape[0]) != (h, rank, bsz):
        raise ValueError(
            f"`plan` was made for {plan.page_table.shape[0]} requests x {plan.num_q_heads} heads, "
            f"kv_lora_rank {plan.kv_lora_rank}; this call has {bsz} x {h}, {rank}"
        )
    _check_fp4_tile(view, plan.block_n)
    _check_dots(view, plan.dots, rank, plan.block_n)
    s = plan.num_splits
    if s > 1 and (plan.part_out is None or plan.part_out.device != dev):
        raise ValueError(f"`plan` has no split workspace on {dev}")

    if plan.kernel == "mla_small":
        from kvpool.attention.mla_small import launch_small

        return launch_small(view, q, page_table, seq_lens, plan, out, scale)
    if plan.kernel == "mla_gluon":
        from kvpool.attention.mla_gluon import launch_gluon

        return launch_gluon(view, q, page_table, seq_lens, plan, out, scale)

    from kvpool.triton_kernels.mla import mla_decode_kernel

    kbs, ksc, kbs_stride = _scales(view)
    consts = {**_kernel_consts(view, rank, plan.asm), **_dots_consts(plan.dots)}
    mla_decode_kernel[(_cdiv(h, plan.block_h), bsz, s)](
        q, view.k, kbs, ksc, page_table, seq_lens, out,
        plan.part_out if s > 1 else out, plan.part_lse if s > 1 else out,
        q.stride(0), q.stride(1), view.k.stride(0), kbs_stride, page_table.stride(0),
        out.stride(0), out.stride(1), scale, view.page_size.bit_length() - 1, s, h,
        BLOCK_H=plan.block_h, BLOCK_N=plan.block_n, FINAL=s == 1, **consts,
        num_warps=plan.num_warps, num_stages=plan.num_stages,
    )  # fmt: skip
    if s > 1:
        from kvpool.attention.launch_decode import _merge

        # (the latent is K and V: its fp8 scale / nvfp4 global scale is V's factor too)
        _merge(plan, out, None, ksc, consts["HAS_SCALE"], consts["FP4_MUL"])
    return out
