"""MLA decode on Hopper warpgroup MMAs in Gluon (plan ``kernel = "mla_gluon"``, issue 17).

``triton_kernels/mla_gluon.py`` (its docstring has the design): one program = one request x 64
heads x one KV split, two warpgroups splitting the score tile's tokens and the output's value
columns between them, Q staged once in shared memory, the latent tiles gathered row by row
from the page table into a ``cp.async`` ring. Aimed at DeepSeek-V3 at TP 1 (128 heads: two
programs a request, sharing its tiles through L2), where the head-block Triton kernel
(``mla_triton``) reached 244 TFLOP/s bf16 on the H200 (run 14).

Routed by default above 32 heads for bf16, fp16 and fp8_e4m3 caches on a Hopper GPU when no
tile knob or ``dots="fp8"`` is given, unless ``KVPOOL_MLA_GLUON=0`` (:func:`routes_default`,
from run 14's numbers: :data:`DEFAULT_DTYPES`); else opt-in with
``plan_mla_decode(..., kernel="mla_gluon")``. The plan's ``kernel`` field shows which runs.
What it takes, else ValueError naming the value (``mla_triton`` runs everything): bf16, fp16,
fp8_e4m3 and fp8_e5m2 caches (fp8: the ring holds the cache's bytes, each tile is widened to
fp16 in shared memory for the MMAs; the per-tensor scale goes into the scores and the output),
the latent 512 + 64 (DeepSeek, Kimi), any power-of-two page size, 16-byte aligned latent rows,
``dots`` f16, an NVIDIA GPU of compute capability 9.x
(wgmma) with a Triton in ``attention.GLUON_TRITON`` (3.6).

Knobs: ``block_n`` 32 or 64 tokens a tile, ``num_stages`` the ring's tiles (what fits 227 KiB
of shared memory: :data:`STAGES_FIT`, :data:`STAGES_FIT_FP8`), ``num_splits`` (default: the
wave model of :func:`~kvpool.attention.splits.default_splits` over ``B x ceil(H / 64)``
programs, one a multiprocessor). ``block_h`` is 64 and ``num_warps`` 8 (given otherwise:
ValueError). ``pipeline`` (:func:`plan_mla_gluon_decode` only; default off): the
software-pipelined loop, tile i's scores and softmax under tile i - 1's ``P V``
(:data:`STAGES_FIT_FP8_PIPE` for fp8).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpool._torch import torch
from kvpool.attention._common import _cdiv
from kvpool.attention.checks import _check, _check_knob
from kvpool.attention.mla import MLADecodePlan, _check_mla_view, _rank
from kvpool.attention.splits import MAX_SPLITS, default_splits

if TYPE_CHECKING:
    from kvpool.pool import LayerView

KERNEL = "mla_gluon"
#: The latent (kv_lora_rank, qk_rope_head_dim) the kernel is built for (DeepSeek-V2/V3/R1, Kimi).
LATENT = (512, 64)
DTYPES = ("bf16", "fp16", "fp8_e4m3", "fp8_e5m2")
FP8 = ("fp8_e4m3", "fp8_e5m2")
BLOCK_H = 64  # heads a program (the M of one warpgroup MMA)
NUM_WARPS = 8  # two warpgroups
#: Ring stages that fit a block's 227 KiB of shared memory, per tile size, 16-bit caches (Q
#: 72 KiB + stages x block_n x 1,152 bytes + P; compiled for sm_90 with Triton 3.6: 64 x 2
#: takes 224.5 KiB, 32 x 4 220.5 KiB; tests/test_mla_gluon_compile.py).
STAGES_FIT = {32: (2, 3, 4), 64: (2,)}
#: The same for fp8 caches: the ring holds 576 bytes a token, plus one fp16 tile (the MMA
#: operand, widened from the ring): 64 x 2 224.5 KiB, 32 x 6 220.5 KiB.
STAGES_FIT_FP8 = {32: (2, 3, 4, 5, 6), 64: (2,)}
#: ``pipeline`` (tile i's scores under tile i - 1's P V): fp8 holds two widened tiles, so
#: 64-token tiles do not fit and 32-token tiles take up to 4 stages (220.5 KiB); 16-bit caches
#: as :data:`STAGES_FIT`.
STAGES_FIT_FP8_PIPE = {32: (2, 3, 4)}
#: Default (block_n, num_stages): 64-token tiles (the Triton kernel's measured best at 128
#: heads), the only ring that fits them; the fastest in run 14 (sweep_mla_gluon.py).
DEFAULT_TILE = (64, 2)
#: Stages when only ``block_n`` is given (32-token tiles: 3, 188.5 KiB).
DEFAULT_STAGES = {32: 3, 64: 2}


def _device_unfit(device: torch.device) -> str | None:
    """Why the kernel cannot run on ``device`` (a phrase), or None.

    The Gluon decode kernels' rules (CUDA, no interpreter, Triton 3.6) plus compute capability
    9.x (warpgroup MMA).
    """
    from kvpool.attention import variants

    why = variants._gluon_device_unfit(device)
    if why is None and variants._capability(device)[0] != 9:
        why = "a GPU of compute capability other than 9.x (warpgroup MMA is Hopper's)"
    return why


def gluon_unfit(view: LayerView, rank: int) -> str | None:
    """Why ``view`` (an MLA layer of ``kv_lora_rank`` ``rank``) is not for this kernel, or None."""
    if view.dtype not in DTYPES:
        return f"a {view.dtype} cache (mla_gluon takes {', '.join(DTYPES)})"
    if view.dtype in FP8 and view.k_scale is None:
        return f"a {view.dtype} cache without k_scale"
    latent = (rank, view.head_dim - rank)
    if latent != LATENT:
        return (
            f"the latent kv_lora_rank {latent[0]} + qk_rope_head_dim {latent[1]} (mla_gluon "
            f"is built for {LATENT[0]} + {LATENT[1]}: DeepSeek, Kimi)"
        )
    t = view.k
    if (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
        return (
            f"latent rows not 16-byte aligned (row stride {t.stride(0)} values, data pointer "
            f"{t.data_ptr():#x}): cp.async copies 16 bytes"
        )
    return _device_unfit(t.device)


#: ``KVPOOL_MLA_GLUON=0``: MLA decode plans do not take ``mla_gluon`` by default.
MLA_GLUON_ENV = "KVPOOL_MLA_GLUON"
#: The caches it runs by default: measured in run 14 (H200, DeepSeek-V3 TP 1, B=64 x 8k, page
#: 16, benches/attention/results/run14_h200/sweep_mla_gluon_stdout.txt): bf16 0.412 ms = 355
#: TFLOP/s (mla_triton 0.599 ms), fp16 356 (0.982 ms), fp8_e4m3 0.536 ms = 272 (0.947 ms).
#: fp8_e5m2 runs the same code but was not timed: opt-in (``kernel="mla_gluon"``).
DEFAULT_DTYPES = ("bf16", "fp16", "fp8_e4m3")


def routes_default(view, h, rank, kernel, dots, *knobs) -> bool:
    """Whether a plan with no ``kernel``, tile knobs or ``dots="fp8"`` takes ``mla_gluon``.

    ``knobs``: ``block_h``, ``block_n``, ``num_warps``, ``num_stages``, ``asm`` as given.

    It does for more than 32 heads (fewer go to ``mla_small``), a cache of
    :data:`DEFAULT_DTYPES`, a layer and device it runs on (:func:`gluon_unfit`), unless
    :data:`MLA_GLUON_ENV` is ``0``.
    """
    import os

    from kvpool.attention import mla_small

    if kernel is not None or dots not in (None, "f16") or any(k is not None for k in knobs):
        return False
    if h <= mla_small.SMALL_MAX_HEADS or view.dtype not in DEFAULT_DTYPES:
        return False
    if os.environ.get(MLA_GLUON_ENV, "1") == "0":
        return False
    return gluon_unfit(view, rank) is None


@dataclass
class MLAGluonDecodePlan(MLADecodePlan):
    """An :class:`~kvpool.attention.mla.MLADecodePlan` for the ``mla_gluon`` kernel.

    ``pipeline``: the software-pipelined loop (tile i's scores and softmax while tile i - 1's
    ``P V`` runs on the tensor cores, asynchronous warpgroup MMAs); else each tile's MMAs run
    in turn. The other fields as in the parent; ``kernel`` is ``"mla_gluon"``.
    """

    pipeline: bool = False


def stages_fit(dtype: str, pipeline: bool = False) -> dict:
    """``{block_n: ring stages that fit shared memory}`` for a ``dtype`` cache."""
    if dtype in FP8:
        return STAGES_FIT_FP8_PIPE if pipeline else STAGES_FIT_FP8
    return STAGES_FIT


def plan_gluon(
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
    dots=None,
    pipeline=None,
) -> MLAGluonDecodePlan:
    """The ``mla_gluon`` plan, once ``plan_mla_decode`` has checked the view and batch tensors.

    ``ctx``: the longest request in tokens. Raises ValueError for what the kernel does not
    take (module docstring), naming it.
    """
    if pipeline is not None and not isinstance(pipeline, bool):
        raise ValueError(f"`pipeline` = {pipeline!r}: must be a bool")
    pipe = bool(pipeline)
    if dots not in (None, "f16"):
        raise ValueError(f"`dots` = {dots!r}: kernel='mla_gluon' runs 16-bit dots only ('f16')")
    if asm:
        raise ValueError("`asm` = True: kernel='mla_gluon' has no word decode (give None/False)")
    for name, v, fixed in (("block_h", block_h, BLOCK_H), ("num_warps", num_warps, NUM_WARPS)):
        if v is not None and v != fixed:
            raise ValueError(f"`{name}` = {v!r}: kernel='mla_gluon' runs {fixed} only")
    why = gluon_unfit(view, rank)
    if why is not None:
        raise ValueError(f"kernel='mla_gluon' cannot run on {why}; use kernel='mla_triton'")
    fits = stages_fit(view.dtype, pipe)
    bn = (DEFAULT_TILE[0] if DEFAULT_TILE[0] in fits else 32) if block_n is None else block_n
    if bn not in fits:
        raise ValueError(
            f"`block_n` = {bn!r}: kernel='mla_gluon' takes {' or '.join(map(str, fits))} here "
            f"({view.dtype}{', pipeline' if pipe else ''})"
        )
    fit = fits[bn]
    ns = min(DEFAULT_STAGES[bn], fit[-1]) if num_stages is None else num_stages
    if ns not in fit:
        raise ValueError(
            f"`num_stages` = {ns!r} with block_n {bn}: kernel='mla_gluon' fits "
            f"{', '.join(map(str, fit))} stages in shared memory there"
            f"{' (pipeline)' if pipe else ''}"
        )
    dev = view.k.device
    b = page_table.shape[0]
    if num_splits is None:
        num_splits = default_splits(
            b, _cdiv(h, BLOCK_H), ctx, dev, bn, NUM_WARPS, programs_per_sm=1, overhead=2 * bn
        )
    s = _check_knob("num_splits", num_splits, 1, MAX_SPLITS)
    part_out = part_lse = None
    if s > 1:
        part_out = torch.empty(b, h, s, rank, dtype=torch.float32, device=dev)
        part_lse = torch.empty(b, h, s, dtype=torch.float32, device=dev)
    return MLAGluonDecodePlan(
        page_table, seq_lens, h, rank, s, BLOCK_H, bn, NUM_WARPS, ns, False, part_out,
        part_lse, kernel=KERNEL, pipeline=pipe,
    )  # fmt: skip


def plan_mla_gluon_decode(
    view: LayerView,
    num_q_heads: int,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    kv_lora_rank: int | None = None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_stages: int | None = None,
    pipeline: bool | None = None,
) -> MLAGluonDecodePlan:
    """Plan :func:`~kvpool.attention.mla.mla_decode` on ``mla_gluon``, with its ``pipeline``.

    ``plan_mla_decode(kernel="mla_gluon")`` is this without ``pipeline`` (default False). For
    benchmarks and tuning. Knobs and errors as :func:`plan_gluon` and ``plan_mla_decode``.
    """
    rank = _rank(view, kv_lora_rank)
    _check_mla_view(view, rank, kernels=True)
    h = _check_knob("num_q_heads", num_q_heads, 1)
    dev = view.k.device
    _check("page_table", page_table, ndim=2, dtype=torch.int32, device=dev)
    _check("seq_lens", seq_lens, shape=[page_table.shape[0]], dtype=torch.int32, device=dev)
    cap = page_table.shape[1] * view.page_size
    ctx = cap if max_seq_len is None else min(_check_knob("max_seq_len", max_seq_len, 1), cap)
    return plan_gluon(
        view, h, page_table, seq_lens, rank, ctx, num_splits=num_splits, block_n=block_n,
        num_stages=num_stages, pipeline=pipeline,
    )  # fmt: skip


def launch_gluon(
    view: LayerView,
    q: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    plan: MLADecodePlan,
    out: torch.Tensor,
    sm_scale: float,
) -> torch.Tensor:
    """Run ``mla_gluon_decode_kernel`` (and the split merge) for a checked ``mla_decode`` call.

    ``q [B, H, 576]`` fp32/bf16/fp16 (cast to the cache's dtype in the kernel, fp16 for fp8
    caches), ``out [B, H, 512]`` in q's dtype, ``plan`` made by
    ``plan_mla_decode(kernel="mla_gluon")`` or :func:`plan_mla_gluon_decode` for this batch
    (``mla_decode`` has checked shapes and the split workspace). Returns ``out``.
    """
    why = gluon_unfit(view, plan.kv_lora_rank)
    if why is not None:  # (a plan made for another view)
        raise ValueError(f"`plan` names kernel 'mla_gluon', which cannot run on {why}")
    pipe = getattr(plan, "pipeline", False)
    fit = stages_fit(view.dtype, pipe)
    if plan.block_n not in fit or plan.num_stages not in fit[plan.block_n]:
        raise ValueError(
            f"`plan` has block_n {plan.block_n}, num_stages {plan.num_stages}: not an "
            "mla_gluon tile (make it with plan_mla_decode)"
        )
    from kvpool.triton_kernels.mla_gluon import mla_gluon_decode_kernel

    bsz, h, _ = q.shape
    s = plan.num_splits
    fp8 = view.dtype in FP8
    ksc = view.k_scale if fp8 else out  # (16-bit caches: unused)
    mla_gluon_decode_kernel[(_cdiv(h, BLOCK_H), bsz, s)](
        q, view.k, ksc, page_table, seq_lens, out,
        plan.part_out if s > 1 else out, plan.part_lse if s > 1 else out,
        q.stride(0), q.stride(1), view.k.stride(0), page_table.stride(0),
        out.stride(0), out.stride(1), sm_scale, view.page_size.bit_length() - 1, s, h,
        DL=LATENT[0], DR=LATENT[1], BLOCK_N=plan.block_n, STAGES=plan.num_stages,
        FINAL=s == 1, PIPE=pipe, num_warps=NUM_WARPS,
    )  # fmt: skip
    if s > 1:
        from kvpool.attention.launch_decode import _merge

        # (fp8: the latent's scale is V's factor too; 16-bit caches have none)
        _merge(plan, out, None, ksc, fp8, 1.0)
    return out


__all__ = [
    "DEFAULT_TILE",
    "KERNEL",
    "STAGES_FIT",
    "STAGES_FIT_FP8",
    "STAGES_FIT_FP8_PIPE",
    "MLAGluonDecodePlan",
    "gluon_unfit",
    "launch_gluon",
    "plan_gluon",
    "plan_mla_gluon_decode",
    "stages_fit",
]
