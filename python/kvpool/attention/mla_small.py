"""MLA decode with few heads per rank (plan ``kernel = "mla_small"``): tokens on the MMA's M.

DeepSeek-V3/R1 at TP 8 run 16 heads per rank, Kimi-K2 at TP 8 eight. The head-block kernel
(``mla_triton``, :mod:`kvpool.attention.mla`) puts heads on the tensor-core M dimension, a
quarter of a 64-row Hopper warpgroup MMA at 16 heads, and reached 0.72 TB/s of fp8 latent bytes
on the H200 (DeepSeek TP 8, B=64 x 8k, run 12: about 17% of the copy bandwidth).
``triton_kernels/mla_small.py`` swaps the operands: ``S^T = K q^T`` with the latent tile's
tokens on M and the heads (padded to ``block_h``) on N, ``O^T += K_nope^T P^T`` with the latent
on M. One program takes every head of one request over one KV split; the splits are merged by
``decode.merge_kernel`` as for the other kernels.

Routing (:func:`kvpool.attention.mla.plan_mla_decode`): layers with at most
:data:`SMALL_MAX_HEADS` heads per rank take this kernel unless ``kernel="mla_triton"`` is
passed or the environment sets ``KVPOOL_MLA_SMALL=0`` (every MLA decode plan then takes the
head-block kernel, for side-by-side runs); ``kernel="mla_small"`` forces it up to 64 heads.
Extend keeps the head-block kernel.

Variants (plan fields): ``block_n`` tokens a tile, ``num_warps``, ``num_stages`` (Triton's
pipeliner: with the page-table indirection it keeps one tile in flight through ``cp.async``
whatever the count above 2), and ``prefetch``: the kernel loads tile ``i + 1``'s bytes into
registers while it computes on tile ``i`` and carries the dequantized tile across the loop,
which makes Triton stage it in shared memory as the A operand of both warpgroup MMAs
(``benches/attention/sweep_mla_small.py`` measures them).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpool._torch import torch
from kvpool.attention._common import _pow2
from kvpool.attention.checks import _check, _check_knob
from kvpool.attention.mla import (
    MLADecodePlan,
    _asm_ok,
    _check_mla_view,
    _kernel_consts,
    _rank,
    _scales,
)
from kvpool.attention.splits import MAX_SPLITS, default_splits
from kvpool.attention.variants import _check_fp4_tile

if TYPE_CHECKING:
    from kvpool.pool import LayerView

#: Most heads per rank routed to ``mla_small`` by default (DeepSeek-V3 TP 8: 16, TP 4: 32;
#: Kimi-K2 TP 8: 8). Above, a head block fills the warpgroup MMA's 64 rows by itself.
SMALL_MAX_HEADS = 32
#: Most heads ``kernel="mla_small"`` takes: the ``O^T`` accumulator is ``kv_lora_rank x
#: block_h`` fp32 (512 x 64: 128 registers a thread at 8 warps).
SMALL_BLOCK_H_MAX = 64
#: ``KVPOOL_MLA_SMALL=0``: MLA decode plans take ``mla_triton`` unless ``kernel=`` says otherwise.
MLA_SMALL_ENV = "KVPOOL_MLA_SMALL"
KERNELS = ("mla_triton", "mla_small", "mla_gluon")  # (mla_gluon: routed before)

#: Default tile of 16-bit caches: 32 tokens, 4 warps, 3 stages, no register prefetch. Compiled
#: for sm_90 with Triton 3.6 at DeepSeek's latent (512 + 64) and 16 heads: 180 (bf16) to 255
#: (fp4_mx_block16) registers a thread without spills and 55-69 KiB of shared memory, so two
#: programs a multiprocessor; 64-token tiles at 4 warps spill (fp8: 960 bytes a thread). Heads
#: padded to 32 or 64 double or quadruple the ``O^T`` accumulator: 4 warps spill there, so those
#: plans take :data:`WIDE_WARPS`. H200, B=64 x 8k, run 14 (benches/attention/results/run14_h200):
#: bf16 0.257 ms (56% of the copy bandwidth in latent bytes; the head-block kernel 0.277 ms).
DEFAULT_TILE = (32, 4, 3, False)
#: Default tile of fp8 and FP4 caches: the register prefetch at 32 tokens, 4 warps, 1 stage.
#: Run 14 at DeepSeek TP 8: fp8_e4m3 0.273 ms against 0.380 for :data:`DEFAULT_TILE` and 0.421
#: for the head-block kernel; nvfp4 0.392 / 0.420 / 0.483 ms.
QUANT_TILE = (32, 4, 1, True)
WIDE_WARPS = 8


@dataclass
class MLASmallDecodePlan(MLADecodePlan):
    """An :class:`~kvpool.attention.mla.MLADecodePlan` for the ``mla_small`` kernel.

    ``block_h``: the heads padded to a power of two (8..64, >= the heads; one program takes
    them all). ``prefetch``: the register-prefetch variant (module docstring). The other fields
    as in the parent; ``kernel`` is ``"mla_small"``.
    """

    prefetch: bool = False


def routes_small(num_q_heads: int, kernel: str | None) -> bool:
    """Whether an MLA decode plan for ``num_q_heads`` heads takes ``mla_small``.

    ``kernel``: None (the default rule, module docstring), ``"mla_small"`` or ``"mla_triton"``.
    Raises ValueError for another name, or ``"mla_small"`` above :data:`SMALL_BLOCK_H_MAX` heads.
    """
    if kernel is None:
        return num_q_heads <= SMALL_MAX_HEADS and os.environ.get(MLA_SMALL_ENV, "1") != "0"
    if kernel not in KERNELS:
        raise ValueError(f"`kernel` = {kernel!r}: MLA decode kernels are {', '.join(KERNELS)}")
    if kernel == "mla_small" and num_q_heads > SMALL_BLOCK_H_MAX:
        raise ValueError(
            f"`kernel` = 'mla_small' with {num_q_heads} heads: it takes at most "
            f"{SMALL_BLOCK_H_MAX} (one program holds a kv_lora_rank x heads fp32 accumulator)"
        )
    return kernel == "mla_small"


def _programs_per_sm(block_n: int, num_warps: int) -> int:
    """Programs a multiprocessor holds, from the sm_90 compiles (see :data:`DEFAULT_TILE`).

    Two of <= 32-token tiles at <= 4 warps (<= 255 registers x 128 threads, <= 69 KiB), else
    one (8-warp programs take 153-218 registers; 64-token tiles at 4 warps 255).
    """
    return 2 if num_warps <= 4 and block_n <= 32 else 1


def plan_small(
    view: LayerView,
    h: int,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    rank: int,
    ctx: int,
    *,
    num_splits=None,
    block_h=None,
    block_n=None,
    num_warps=None,
    num_stages=None,
    asm=None,
    prefetch=None,
) -> MLASmallDecodePlan:
    """The ``mla_small`` plan, once the caller has checked the view and batch tensors.

    ``ctx``: the longest request in tokens. Knobs as :func:`plan_mla_small_decode`.
    """
    if h > SMALL_BLOCK_H_MAX:
        raise ValueError(f"`num_q_heads` = {h}: mla_small takes at most {SMALL_BLOCK_H_MAX}")
    hp_min = max(8, _pow2(h))
    if block_h is None:
        bh = max(16, hp_min)
    else:
        bh = _check_knob("block_h", block_h, hp_min, SMALL_BLOCK_H_MAX, pow2=True)
    bn0, nw0, ns0, pf0 = (
        QUANT_TILE if view.dtype.startswith(("fp8", "nvfp4", "fp4")) else DEFAULT_TILE
    )
    bn = _check_knob("block_n", bn0 if block_n is None else block_n, 16, 256, pow2=True)
    _check_fp4_tile(view, bn)
    if bh > 16:  # (the wide accumulator: 8 warps, and so no prefetch, below)
        nw0, ns0, pf0 = WIDE_WARPS, DEFAULT_TILE[2], False
    nw = _check_knob("num_warps", nw0 if num_warps is None else num_warps, 1, 16, pow2=True)
    ns = _check_knob("num_stages", ns0 if num_stages is None else num_stages, 1, 8)
    if prefetch is not None and not isinstance(prefetch, bool):
        raise ValueError(f"`prefetch` = {prefetch!r}: must be a bool")
    # (the default prefetch only where it runs: given num_warps > 4, the plan goes without it)
    pf = (pf0 and nw <= 4) if prefetch is None else prefetch
    if pf and nw > 4:
        # run 14 (H200, Triton 3.6): the prefetch at 64 tokens x 8 warps returned wrong outputs
        # (relative error 5) for every dtype, while 32 x 4 matched the reference
        raise ValueError(
            f"`prefetch` with `num_warps` = {nw}: the register prefetch runs with at most 4 warps "
            "(8 warps computed wrong outputs on the H200 with Triton 3.6); give num_warps <= 4 "
            "or prefetch=False"
        )
    dev = view.k.device
    b = page_table.shape[0]
    if num_splits is None:
        # (a split also writes a partial output of heads x kv_lora_rank fp32 and merges it:
        # about two tiles' worth of time besides its tokens)
        per_sm = _programs_per_sm(bn, nw)
        num_splits = default_splits(b, 1, ctx, dev, bn, nw, programs_per_sm=per_sm, overhead=2 * bn)
    s = _check_knob("num_splits", num_splits, 1, MAX_SPLITS)
    part_out = part_lse = None
    if s > 1:
        part_out = torch.empty(b, h, s, rank, dtype=torch.float32, device=dev)
        part_lse = torch.empty(b, h, s, dtype=torch.float32, device=dev)
    use_asm = _asm_ok(view) if asm is None else bool(asm) and _asm_ok(view)
    return MLASmallDecodePlan(
        page_table, seq_lens, h, rank, s, bh, bn, nw, ns, use_asm, part_out, part_lse,
        kernel="mla_small", prefetch=pf,
    )  # fmt: skip


def plan_mla_small_decode(
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
    prefetch: bool | None = None,
) -> MLASmallDecodePlan:
    """Plan :func:`~kvpool.attention.mla.mla_decode` on the ``mla_small`` kernel.

    For benchmarks and tuning: ``plan_mla_decode`` routes to it by default (module docstring).

    Knobs: ``block_h`` the heads' padding (a power of two in 8..64, >= the heads; default the
    heads' power of two, at least 16), ``block_n`` (a power of two in 16..256; >= 32 for FP4 on
    the GPU), ``num_warps`` (1..16), ``num_stages`` (1..8), ``prefetch``; defaults
    :data:`DEFAULT_TILE` (:data:`WIDE_WARPS` warps when ``block_h`` > 16). ``num_splits``
    1..1,024 (default: the wave model of :func:`~kvpool.attention.splits.default_splits` over
    ``B`` programs a split, two a multiprocessor for 32-token 4-warp programs, else one).
    ``kv_lora_rank``, ``max_seq_len`` and ``asm`` as in ``plan_mla_decode``.

    Raises
    ------
    ValueError
        As ``plan_mla_decode``; a knob out of range (named); more than 64 heads.
    """
    rank = _rank(view, kv_lora_rank)
    _check_mla_view(view, rank, kernels=True)
    h = _check_knob("num_q_heads", num_q_heads, 1)
    dev = view.k.device
    _check("page_table", page_table, ndim=2, dtype=torch.int32, device=dev)
    _check("seq_lens", seq_lens, shape=[page_table.shape[0]], dtype=torch.int32, device=dev)
    cap = page_table.shape[1] * view.page_size
    ctx = cap if max_seq_len is None else min(_check_knob("max_seq_len", max_seq_len, 1), cap)
    return plan_small(
        view, h, page_table, seq_lens, rank, ctx, num_splits=num_splits, block_h=block_h,
        block_n=block_n, num_warps=num_warps, num_stages=num_stages, asm=asm, prefetch=prefetch,
    )  # fmt: skip


def launch_small(
    view: LayerView,
    q: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    plan: MLADecodePlan,
    out: torch.Tensor,
    sm_scale: float,
) -> torch.Tensor:
    """Run ``mla_small_decode_kernel`` (and the split merge) for a checked ``mla_decode`` call.

    ``q [B, H, Dl + Dr]``, ``out [B, H, Dl]`` in q's dtype, ``plan`` a
    :class:`MLASmallDecodePlan` for this batch (``mla_decode`` has checked shapes, the plan's
    batch and heads, FP4 tiles and the split workspace). Returns ``out``.
    """
    if not isinstance(plan, MLASmallDecodePlan) or plan.block_h < plan.num_q_heads:
        raise ValueError(
            f"`plan` names kernel 'mla_small' but is a {type(plan).__name__} with block_h "
            f"{plan.block_h} for {plan.num_q_heads} heads: make it with plan_mla_decode"
        )
    from kvpool.attention.launch_decode import _merge
    from kvpool.triton_kernels.mla_small import mla_small_decode_kernel

    bsz, h, _ = q.shape
    s = plan.num_splits
    kbs, ksc, kbs_stride = _scales(view)
    consts = _kernel_consts(view, plan.kv_lora_rank, plan.asm)
    mla_small_decode_kernel[(bsz, s)](
        q, view.k, kbs, ksc, page_table, seq_lens, out,
        plan.part_out if s > 1 else out, plan.part_lse if s > 1 else out,
        q.stride(0), q.stride(1), view.k.stride(0), kbs_stride, page_table.stride(0),
        out.stride(0), out.stride(1), sm_scale, view.page_size.bit_length() - 1, s, h,
        HP=plan.block_h, BLOCK_N=plan.block_n, FINAL=s == 1, PREFETCH=plan.prefetch, **consts,
        num_warps=plan.num_warps, num_stages=plan.num_stages,
    )  # fmt: skip
    if s > 1:
        # (the latent is K and V: its fp8 scale / nvfp4 global scale is V's factor too)
        _merge(plan, out, None, ksc, consts["HAS_SCALE"], consts["FP4_MUL"])
    return out


__all__ = [
    "KERNELS",
    "MLA_SMALL_ENV",
    "SMALL_MAX_HEADS",
    "MLASmallDecodePlan",
    "launch_small",
    "plan_mla_small_decode",
    "routes_small",
]
