"""Decode and extend plans: launch metadata that depends on the batch, not on the layer."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvpool._host import as_device_tensor
from kvpool._launch import Generation
from kvpool._torch import torch
from kvpool.attention import gluon_knobs as knobs_mod
from kvpool.attention import splits, variants
from kvpool.attention._common import _FP4, _pow2
from kvpool.attention.checks import (
    _check,
    _check_cu_seqlens_host,
    _check_knob,
    _check_view,
    _group,
)
from kvpool.attention.gluon_knobs import GluonKnobs
from kvpool.attention.mla import MLADecodePlan, plan_mla_decode
from kvpool.attention.mla_extend import MLAExtendPlan, plan_mla_extend
from kvpool.attention.splits import MAX_SPLITS, default_splits
from kvpool.attention.variants import (
    _GLUON_OVERHEAD,
    _SWAP_DEFAULT,
    GROUP_PAD_MAX,
    _asm_default,
    _asm_ok,
    _check_fp4_tile,
    _gluon_unfit,
    _head_factor,
    _min_block_n,
)

if TYPE_CHECKING:
    from kvpool.pool import LayerView


@dataclass
class DecodePlan(Generation):
    """Launch metadata of :func:`decode` for one batch, reused by every layer.

    Every attribute set gives the plan a new generation (:class:`kvpool._launch.Generation`):
    the record key cached on it is made again after a change.

    Attributes
    ----------
    page_table : torch.Tensor
        ``[B, max_pages]`` int32.
    seq_lens : torch.Tensor
        ``[B]`` int32.
    num_splits : int
        KV splits per request (flash-decoding); 1 writes the output directly.
    block_n, num_warps, num_stages : int
        Kernel tile (tokens per step) and launch options. With ``num_stages >= 3`` (and no
        ``prefetch``) the kernel loads each tile's page ids one tile ahead, so Triton's pipeliner
        keeps ``num_stages - 1`` K/V tiles in flight through ``cp.async``.
    use_dot : bool
        Tensor-core dots (query group padded to ``group_pad`` rows) or CUDA-core FMA.
    prefetch : bool
        Issue the next tile's loads before the current tile's math (register double buffer).
    asm : bool
        FP4 and fp8: decode 32-bit words of the cache with inline PTX (GPU; the CPU interpreter
        runs a plain-Triton emulation); else plain Triton ops on the stored dtype.
    swap : bool
        Transposed dots (``S^T = K q^T``, ``O^T = V^T P^T``): the KV tile is the tensor-core
        tile's M side and the query group its N side (padded to 8, not 16). Needs ``use_dot``,
        no ``prefetch``.
    ablate : int
        Benchmarks only: leave one kernel stage out (0 = none; 1-3 see ``decode_kernel``; 4 = the
        split merge). Results are wrong when nonzero.
    maxnreg : int or None
        Register cap per thread for the split kernel (Triton's ``maxnreg``, 24..255; None: the
        compiler's choice). Fewer registers let more programs share a multiprocessor.
    group_pad : int
        Rows the query group is padded to in the kernel (a power of two >= the group): by
        default ``max(16, group)`` rounded up to a power of two for untransposed dots, the
        group's power of two for transposed dots and FMA; 16 makes Triton use Hopper's
        warpgroup MMA for transposed dots (slower for fp8 on the H200, run 6 call 2).
    part_out, part_lse : torch.Tensor or None
        fp32 workspaces ``[B, H_q, num_splits, Dv]`` / ``[B, H_q, num_splits]`` (split > 1).
    gluon : bool
        Launch a Gluon kernel (``triton_kernels/decode_gluon.py`` for fp8 and, at head_dim 64,
        bf16/fp16; ``decode_gluon_fp4.py`` for nvfp4 and fp4_mx_block16; head_dim 64, 128 or
        256, query groups up to 16 (8 at 256; ``variants._GLUON_GROUPS``), 16-token tiles into
        tensor-core fragments without layout conversions, one warp per program; a ring of
        ``num_stages`` stages in shared memory (fp8: 3 cp.async stages; FP4: 2 stages of
        ``block_n`` / 16 tiles, data by TMA on sm_90+, with page_size >= 16 and 16-byte aligned
        scale rows, always at head_dim 256; else register prefetch, ``prefetch``) instead of
        the Triton one; the other kernel options are unused.
    kernel : str
        The kernel variant that runs, so a fallback is never silent: ``"gluon_fp8"``,
        ``"gluon_fp4"`` (the Gluon kernels at head_dim 128 with a group of <= 8), the same with
        ``"_hd64"`` / ``"_hd256"`` and ``"_g16"`` (groups of 9..16) appended, ``"gluon_bf16_hd64"``
        / ``"gluon_fp16_hd64"``, or ``"triton_generic"`` (``decode.decode_kernel``); ``"_multi"``
        appended for ``decode_gluon_multi.py`` (``knobs.multi``).
    knobs : GluonKnobs or None
        The Gluon variant's knobs (:mod:`kvpool.attention.gluon_knobs`; None: the measured
        kernels' defaults). ``block_n`` is then the tokens of a ring stage (16 per tile) and
        ``num_stages`` the ring's stages.
    """

    page_table: torch.Tensor
    seq_lens: torch.Tensor
    num_q_heads: int
    num_splits: int
    block_n: int
    num_warps: int
    num_stages: int
    use_dot: bool
    prefetch: bool
    asm: bool
    swap: bool
    ablate: int
    group_pad: int
    maxnreg: int | None
    part_out: torch.Tensor | None
    part_lse: torch.Tensor | None
    gluon: bool = False
    kernel: str = "triton_generic"
    knobs: GluonKnobs | None = None


def _split_workspace(b: int, hq: int, splits: int, dv: int, dev: torch.device):
    """The split merge's fp32 inputs: ``[b, hq, splits, dv]`` and ``[b, hq, splits]``.

    ``(None, None)`` for one split: the kernel then writes the output directly.
    """
    if splits == 1:
        return None, None
    return (
        torch.empty(b, hq, splits, dv, dtype=torch.float32, device=dev),
        torch.empty(b, hq, splits, dtype=torch.float32, device=dev),
    )


def _gluon_plan(view, num_q_heads, page_table, seq_lens, ctx, num_splits, knobs=None) -> DecodePlan:
    """:func:`plan_decode` for the Gluon kernel (one warp per program).

    ``block_n`` is 16, or 32 for FP4 ring stages of two 16-token tiles; ``knobs``
    (:class:`GluonKnobs`, checked by the caller) override the ring and the split model.
    """
    b, dev = page_table.shape[0], view.k.device
    stages, per_sm, maxnreg = variants._gluon_config(view.dtype)
    group = num_q_heads // view.num_kv_heads
    base = variants._gluon_base(view, group)
    if not base:
        # other head_dims and groups of 9..16 (their own registers; FP4: two 16-token tiles a
        # ring stage)
        per_sm = variants._gluon_programs_per_sm(view, group)
    given = num_splits
    if num_splits is None:
        num_splits = default_splits(b, view.num_kv_heads, ctx, dev, 16, 1, per_sm, _GLUON_OVERHEAD)
    num_splits = _check_knob("num_splits", num_splits, 1, MAX_SPLITS)
    block_n = 16
    if not base:
        block_n = 32 if view.dtype in _FP4 and stages > 0 else 16
        if block_n == 32 and given is None:
            num_splits = default_splits(
                b, view.num_kv_heads, ctx, dev, 32, 1, per_sm, _GLUON_OVERHEAD
            )
    elif view.dtype in _FP4 and variants._GLUON_FP4_OPTIONS[3] == 2:
        # two 16-token tiles per ring stage (nvfp4 140 registers: 14 programs per SM instead of
        # 16), except where only one tile a stage keeps the grid in one wave (run 9, call 4:
        # 256 splits at B=1/32k, 2,048 programs, 31.6 us vs 35.3; two tiles faster at every
        # other measured shape; since run 10 the planner takes 128 splits there, so this is
        # mostly an explicit num_splits' case); splits then in whole 32-token stages
        sms = splits._num_sms(torch.device(dev))
        programs = b * view.num_kv_heads * num_splits
        two = 16 if maxnreg is not None and maxnreg <= 128 else 14  # two-tile programs per SM
        block_n = 16 if two * sms < programs <= 16 * sms else 32
        if block_n == 32 and given is None:
            num_splits = default_splits(
                b, view.num_kv_heads, ctx, dev, 32, 1, per_sm, _GLUON_OVERHEAD
            )
    name = variants._gluon_kernel_name(view, group)
    if knobs is not None:
        stages, block_n, per_sm, maxnreg = knobs_mod.plan_fields(
            view, group, knobs, stages, per_sm, maxnreg, block_n
        )
        if given is None:
            heads = view.num_kv_heads // knobs.heads
            num_splits = default_splits(b, heads, ctx, dev, block_n, 1, per_sm, _GLUON_OVERHEAD)
        name += "_multi" if knobs.multi else ""
    part_out, part_lse = _split_workspace(b, num_q_heads, num_splits, view.v_head_dim, dev)
    return DecodePlan.fresh(
        page_table=page_table,
        seq_lens=seq_lens,
        num_q_heads=num_q_heads,
        num_splits=num_splits,
        block_n=block_n,
        num_warps=1,
        num_stages=max(stages, 1),
        use_dot=True,
        prefetch=stages == 0,
        asm=True,
        swap=False,
        ablate=0,
        group_pad=16,
        maxnreg=maxnreg,
        part_out=part_out,
        part_lse=part_lse,
        gluon=True,
        kernel=name,
        knobs=knobs,
    )


def _refuse_knobs(**knobs) -> None:
    """ValueError naming the decode knobs given that MLA plans do not take."""
    given = [k for k, v in knobs.items() if v is not None]
    if given:
        raise ValueError(
            f"{', '.join(given)}: options of the GQA decode kernels, not of the MLA kernel "
            "(it takes num_splits, block_n, num_warps, num_stages, asm; "
            "see kvpool.attention.mla.plan_mla_decode for block_h)"
        )


def plan_decode(
    view: LayerView,
    num_q_heads: int,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    use_dot: bool | None = None,
    prefetch: bool | None = None,
    asm: bool | None = None,
    swap: bool | None = None,
    group_pad: int | None = None,
    maxnreg: int | None = None,
    ablate: int = 0,
    gluon: bool | None = None,
    kv_lora_rank: int | None = None,
    gluon_knobs: GluonKnobs | dict | str | None = None,
) -> DecodePlan | MLADecodePlan:
    """Plan :func:`decode` for one batch (any layer with ``view``'s geometry may use it).

    Parameters
    ----------
    view : LayerView
        Any layer of the pool (only its geometry is used).
    num_q_heads : int
        Query heads per rank.
    page_table, seq_lens : torch.Tensor or numpy.ndarray
        As in :func:`decode`; numpy int32 arrays (what :func:`kvpool.page_table` returns) are
        copied to ``view``'s device here, once per batch (pinned, ``non_blocking``: no sync),
        and the plan keeps the device copies.
    max_seq_len : int, optional
        Longest request in tokens, if known on the host; sizes the splits (default: the page
        table's capacity, ``max_pages * page_size``). No device value is read.
    num_splits, block_n, num_warps, num_stages, use_dot, prefetch, asm, swap : optional
        Override the heuristics (benchmarks, tuning). ``block_n`` is in tokens (a power of two
        >= 16; >= 32 for FP4 caches on the GPU), ``num_warps`` a power of two in 1..32,
        ``num_splits`` in 1..``MAX_SPLITS`` (1,024). ``asm=True`` is ignored where the word
        decode does not apply (see :class:`DecodePlan`).
        The one-warp default (``num_warps=1``; fp8: 16-token tiles and 3 stages, FP4: 32-token
        tiles and 2 stages) applies with ``use_dot``, the word decode, no ``prefetch`` and heads
        <= 128 wide; otherwise 4 warps.
    group_pad : int, optional
        Rows the query group is padded to in the kernel: a power of two >= the group
        (``num_q_heads / kv_heads``) and at most :data:`GROUP_PAD_MAX` (256), or the group's
        own power of two when the group is larger. Padding only has to reach a tensor-core
        tile (16 rows for untransposed dots, 8 transposed, 64 per Hopper warpgroup MMA); 256
        is four warpgroup tiles, and rows beyond it only grow the per-program fp32
        accumulator (``group_pad x head_dim``) and score tile: spills or a failed compile
        (512 x 128 fp32 is 256 KiB, an H200 multiprocessor's whole register file).
        Default: ``max(16, group)`` rounded up to a power of two for untransposed dots, the
        group's power of two otherwise.
    maxnreg : int, optional
        Register cap per thread of the split kernel, 24..255 (ptxas, sm_90, raises smaller
        caps to 24 and ignores larger ones). Default None: no cap. For experiments: at 128 on
        the H200 (run 6, call 2) it slowed one-warp programs (fp8 0.351 -> 0.377 ms) and sped
        up 2-warp ones, which stayed slower than the one-warp default.
    ablate : int
        Benchmarks only (see :class:`DecodePlan`).
    gluon : bool, optional
        Use the Gluon kernel. Default: where it can run (fp8 or FP4 caches, bf16/fp16 at
        head_dim 64, CUDA compute capability 8.9+ NVIDIA, head_dim 64, 128 or 256, query group
        <= 16 (<= 8 at 256), 16-byte aligned K/V rows, a Triton in ``GLUON_TRITON``,
        ``KVPOOL_GLUON_WIDE`` not 0 off head_dim 128 with groups <= 8; see ``_gluon_unfit``), no
        Triton knob above is given, and for fp8 and 16-bit caches the batch has more than 16
        programs per split (B x KV heads) and the longest request is at least 2,048 tokens
        (at B=1 and at 1k tokens the Triton kernel is as fast or faster; the FP4 Gluon kernel
        is faster at every batch, run 8 calls 11 and 14).
        Run 7 on the H200 (``benches/attention/results/run7_h200/gluon_ring/stdout.txt``, one
        run): e4m3 B=64/8k 0.276-0.278 ms vs 0.327 for the Triton kernel (1.74-1.75x SDPA on
        contiguous bf16 instead of 1.48x). Run 8 (``results/run8_h200/NOTES.md``): e4m3
        0.266-0.272 ms (1.81x), e5m2 0.274 ms (1.80x, ring); nvfp4 B=64/8k 0.243-0.245 ms vs
        0.421-0.425 (1.96-2.01x SDPA instead of 1.15x). Run 9 (``results/run9_h200``, TMA
        tiles, two tiles a ring stage): nvfp4 0.216-0.217 ms (2.24-2.28x), fp4_mx_block16
        0.270 (1.80x). True where it cannot run raises ValueError naming why; False runs the
        Triton kernel (a side-by-side comparison: ``bench_gluon_geometries.py``). Head_dim
        64 / 256 and groups of 9..16 (issue 17) are compiled and checked for sm_90 on the CPU
        (``tests/test_gluon_compile.py``), not yet measured on a GPU.

    gluon_knobs : GluonKnobs, dict or str, optional
        A Gluon decode variant (:mod:`kvpool.attention.gluon_knobs`: ring stages, tiles a
        stage, KV heads a program, TMA, ...): implies ``gluon=True``; ValueError where it
        cannot run. Default: ``KVPOOL_GLUON_KNOBS`` or the measured head_dim-64 table where
        they fit the layer, else the kernels' defaults.

    Returns
    -------
    DecodePlan
        With workspaces allocated on ``view``'s device when ``num_splits > 1``.

    Raises
    ------
    ValueError
        A tensor of the wrong shape, dtype or device; ``num_q_heads`` not a multiple of the KV
        heads; a knob that is not an int (bools included) or out of range; an FP4 tile
        shorter than 32 tokens on the GPU; ``swap`` with ``use_dot=False``, ``prefetch`` or
        ``ablate > 1``; ``gluon=True`` where the Gluon kernel cannot run, or with a Triton
        knob. The message names the value.

    An MLA layer (``v`` None) is planned by :func:`kvpool.attention.mla.plan_mla_decode`
    (``num_splits``, ``block_n``, ``num_warps``, ``num_stages``, ``asm``, ``kv_lora_rank``
    apply; the other knobs are refused).
    """
    # numpy batch metadata (what the Rust batch helpers return): to the device once
    page_table = as_device_tensor("page_table", page_table, view.k.device)
    seq_lens = as_device_tensor("seq_lens", seq_lens, view.k.device)
    if view.v is None:
        _refuse_knobs(
            use_dot=use_dot, prefetch=prefetch, swap=swap, group_pad=group_pad, maxnreg=maxnreg,
            ablate=ablate or None, gluon=gluon, gluon_knobs=gluon_knobs,
        )  # fmt: skip
        return plan_mla_decode(
            view, num_q_heads, page_table, seq_lens, kv_lora_rank=kv_lora_rank,
            max_seq_len=max_seq_len, num_splits=num_splits, block_n=block_n, num_warps=num_warps,
            num_stages=num_stages, asm=asm,
        )  # fmt: skip
    defaults = (num_splits is None and block_n is None and num_warps is None
                and num_stages is None and use_dot is None and prefetch is None and asm is None
                and swap is None and group_pad is None and maxnreg is None and not ablate
                and gluon is None and gluon_knobs is None)  # fmt: skip
    memo = _memo_key(view, num_q_heads, page_table, seq_lens, max_seq_len) if defaults else None
    if memo is not None:
        hit = _PLAN_MEMO.get(memo)
        if hit is not None:
            cls, fields = hit
            part = _split_workspace(page_table.shape[0], num_q_heads, fields["num_splits"],
                                    view.v_head_dim, view.k.device)  # fmt: skip
            return cls.fresh(page_table=page_table, seq_lens=seq_lens, part_out=part[0],
                             part_lse=part[1], **fields)  # fmt: skip
    _check_view(view)
    g = _group(view, num_q_heads)
    dev = view.k.device
    _check("page_table", page_table, ndim=2, dtype=torch.int32, device=dev)
    _check("seq_lens", seq_lens, shape=[page_table.shape[0]], dtype=torch.int32, device=dev)
    b = page_table.shape[0]
    cap = page_table.shape[1] * view.page_size
    ctx = cap if max_seq_len is None else min(_check_knob("max_seq_len", max_seq_len, 1), cap)
    knobs = {
        "block_n": block_n,
        "num_warps": num_warps,
        "num_stages": num_stages,
        "use_dot": use_dot,
        "prefetch": prefetch,
        "asm": asm,
        "swap": swap,
        "group_pad": group_pad,
        "maxnreg": maxnreg,
        "ablate": ablate or None,
    }
    given = [k for k, v in knobs.items() if v is not None]
    if gluon is not None and not isinstance(gluon, bool):
        raise ValueError(f"`gluon` = {gluon!r}: must be a bool or None")
    if gluon_knobs is not None:
        if gluon is False:
            raise ValueError("`gluon_knobs` are options of the Gluon kernel (`gluon=False` given)")
        gluon = True
    unfit = _gluon_unfit(view, g)
    if gluon is None:
        # fp8, run 7 grid (H200): 7-14% faster than the Triton kernel from 8k tokens on at
        # B >= 16; at 1k no gain (B=64, 128) or a loss (B=16: 25.3 vs 22.7 us); at <= 16
        # programs the Triton kernel is as fast or faster (run 8 call 11: B=1/32k e4m3 40.6 vs
        # 35.5 us, e5m2 42.4 vs 35.5). FP4: faster at every small batch too (nvfp4, call 11,
        # B=1..4 x 1k..32k: 13.7 vs 17.3 us at B=1/1k, 31.7 vs 45.4 at B=1/32k; mx, call 14)
        small = b * view.num_kv_heads <= 16 or ctx < 2048
        gluon = unfit is None and not given and (view.dtype in _FP4 or not small)
    elif gluon and unfit is not None:
        raise ValueError(f"`gluon=True`: the Gluon decode kernel does not run {unfit}")
    elif gluon and given:
        raise ValueError(f"`gluon=True` takes no Triton kernel options, got {', '.join(given)}")
    if gluon:
        knobs = knobs_mod.pick(view, g, gluon_knobs)
        plan = _gluon_plan(view, num_q_heads, page_table, seq_lens, ctx, num_splits, knobs)
        return _memoize(memo, plan)
    if use_dot is None:
        use_dot = True
    # Measured on the H200 (benches/attention, run 5 at B=64/8k): fp8 is fastest with the word
    # decode, transposed dots, 128-token tiles and 2 stages (0.40 ms vs 0.43 ms); FP4 with the
    # word decode and 128-token tiles, untransposed; 16-bit caches with transposed dots.
    fp8 = view.dtype in ("fp8_e4m3", "fp8_e5m2")
    if asm is None:
        asm = use_dot and _asm_default(view, "decode")
    asm = bool(asm) and _asm_ok(view)  # what the kernel will run (asm=True on bf16: off)
    if num_warps is not None:
        num_warps = _check_knob("num_warps", num_warps, 1, 32, pow2=True)
    # Run 6 (H200, call 12, same run): with 8-bit and 4-bit caches one-warp programs on 32-token
    # tiles beat 4-warp programs on 128-token tiles (B=64/8k: fp8_e4m3 0.367 -> 0.335 ms, nvfp4
    # 0.480 -> 0.424, fp4_mx 0.527 -> 0.464): 12 programs per multiprocessor instead of 3, the
    # same number of warps, and no barriers between warps in the softmax. Heads wider than 128
    # keep 4-warp tiles.
    one_warp = (
        use_dot and asm and not prefetch and _head_factor(view) == 1 and num_warps in (None, 1)
    )
    if num_warps is None:
        num_warps = 1 if one_warp else 4
    if swap is None:
        swap = use_dot and not prefetch and ablate <= 1 and view.dtype in _SWAP_DEFAULT
    # Run 7 (H200, benches/attention/results/run7_h200): fp8 one-warp programs on 16-token tiles
    # with 3 stages (page ids one tile ahead: two tiles in flight) use 128 registers instead of
    # 168-182, so 16 programs share a multiprocessor instead of 11-12: B=64/8k 0.325 ms vs 0.335
    # (4 splits, one wave), B=16/8k 0.093 vs 0.096 ms, B=1/32k unchanged (35.4 us).
    fp8_ring = one_warp and fp8 and block_n in (None, 16) and num_stages in (None, 3)
    if block_n is None:
        if one_warp:
            block_n = 16 if fp8_ring else 32
        else:
            block_n = max(
                _min_block_n(view.dtype),
                ((128 if fp8 or asm else 64) if use_dot else 32) // _head_factor(view),
            )
    if num_stages is None:
        num_stages = 3 if fp8_ring else 2
    num_stages = _check_knob("num_stages", num_stages, 1)
    block_n = _check_knob("block_n", block_n, 16, pow2=True)
    if num_splits is None:
        per_sm = 16 if fp8_ring and swap and maxnreg is None else None
        num_splits = default_splits(b, view.num_kv_heads, ctx, dev, block_n, num_warps, per_sm)
    num_splits = _check_knob("num_splits", num_splits, 1, MAX_SPLITS)
    _check_fp4_tile(view, block_n)
    if swap and (not use_dot or prefetch or ablate > 1):
        raise ValueError("`swap` needs use_dot=True, prefetch=False and ablate 0 or 1")
    if group_pad is None:
        group_pad = max(16, _pow2(g)) if use_dot and not swap else _pow2(g)
    try:
        group_pad = _check_knob("group_pad", group_pad, g, pow2=True)
    except ValueError as e:
        raise ValueError(f"{e} (the query group is {g})") from None
    if group_pad > max(GROUP_PAD_MAX, _pow2(g)):
        raise ValueError(
            f"`group_pad` = {group_pad}: must be at most {max(GROUP_PAD_MAX, _pow2(g))} (the "
            f"query group is {g}; rows past {GROUP_PAD_MAX} are padding that only costs "
            "registers and shared memory)"
        )
    if maxnreg is not None:
        maxnreg = _check_knob("maxnreg", maxnreg, 24, 255)
    part_out, part_lse = _split_workspace(b, num_q_heads, num_splits, view.v_head_dim, dev)
    plan = DecodePlan.fresh(
        page_table=page_table,
        seq_lens=seq_lens,
        num_q_heads=num_q_heads,
        num_splits=num_splits,
        block_n=block_n,
        num_warps=num_warps,
        num_stages=num_stages,
        use_dot=use_dot,
        prefetch=bool(prefetch),
        asm=asm,
        swap=bool(swap),
        ablate=int(ablate),
        group_pad=group_pad,
        maxnreg=maxnreg,
        part_out=part_out,
        part_lse=part_lse,
    )
    return _memoize(memo, plan)


# plan_decode's choices for a batch shape it has planned before (the default knobs only):
# {key: (plan class, fields other than the batch tensors)}; a serving loop plans the same few
# shapes every step, and the choice (kernel, tiles, splits, checks passed) costs ~12 us of
# host time (benches/step).
_PLAN_MEMO: dict[tuple, tuple] = {}
_BATCH_FIELDS = frozenset(("page_table", "seq_lens", "part_out", "part_lse", "_gen"))


def clear_plan_memo() -> None:
    """Forget the choices :func:`plan_decode` remembers per batch shape.

    They are keyed on what the choice reads (``_memo_key``). Only needed after editing a
    tuning table of :mod:`kvpool.attention.variants` or :mod:`kvpool.attention.gluon_knobs`
    in place, other than the Gluon ring configs (which the key reads), as a probe or a test
    may do: the next plans are chosen afresh.
    """
    _PLAN_MEMO.clear()


def _memo_key(view, num_q_heads, page_table, seq_lens, max_seq_len) -> tuple | None:
    """What plan_decode's choice with default knobs reads, or None (not memoized).

    The view's generation (:class:`kvpool._launch.Generation`: unique to the object and its
    fields), the batch tensors' shapes, strides, dtypes and devices, ``num_q_heads`` and
    ``max_seq_len`` with their types (``True == 1`` and ``48.0 == 48``, which a fresh plan
    refuses), the environment and the module state the choice reads that tests and probes
    change: the Gluon fit check and the SM count (by identity), the view dtype's Gluon ring
    config and the FP4 options. Other tuning tables are taken as constants
    (:func:`clear_plan_memo` after editing one).
    """
    gen = view.__dict__.get("_gen")
    tensor = torch.Tensor
    if gen is None or type(page_table) is not tensor or type(seq_lens) is not tensor:
        return None
    dt = view.dtype
    key = (
        gen, num_q_heads, type(num_q_heads), page_table.shape, page_table.stride(),
        page_table.dtype, page_table.device, seq_lens.shape, seq_lens.stride(), seq_lens.dtype,
        seq_lens.device, max_seq_len, type(max_seq_len), _memo_env(),
        # (what tests and probes swap or edit: the fit check, the SM count, the ring configs)
        _gluon_unfit, splits._num_sms, variants._GLUON_CONFIG.get(dt),
        variants._GLUON_16BIT.get(dt), variants._GLUON_FP4_OPTIONS,
    )  # fmt: skip
    try:
        hash(key)
    except TypeError:  # (an unhashable max_seq_len: checked, and refused, as usual)
        return None
    return key


_ENV_NAMES = ("TRITON_INTERPRET", variants.GLUON_WIDE_ENV, knobs_mod.KNOBS_ENV)
_ENV_BYTES = tuple(n.encode() for n in _ENV_NAMES)
# (os.environ's own dict, which its item assignment updates: ``os.environ.get`` encodes the
# name and goes through the Mapping machinery, ~0.5 us a name)
_ENV_DATA = getattr(os.environ, "_data", None) if os.name == "posix" else None


def _memo_env() -> tuple:
    """The environment variables the plan choice reads (values as os.environ holds them)."""
    d = _ENV_DATA
    if type(d) is dict:
        return (d.get(_ENV_BYTES[0]), d.get(_ENV_BYTES[1]), d.get(_ENV_BYTES[2]))
    return tuple(map(os.environ.get, _ENV_NAMES))


def _memoize(key: tuple | None, plan: DecodePlan) -> DecodePlan:
    """Keep ``plan``'s choice under ``key`` (when not None); return ``plan``."""
    if key is not None:
        if len(_PLAN_MEMO) >= 256:  # (bounded: a loop meets few batch shapes)
            _PLAN_MEMO.clear()
        fields = {k: v for k, v in plan.__dict__.items() if k not in _BATCH_FIELDS}
        _PLAN_MEMO[key] = (type(plan), fields)
    return plan


@dataclass
class ExtendPlan:
    """Launch metadata of :func:`extend` for one batch, reused by every layer.

    Attributes
    ----------
    cu_seqlens_q, page_table, seq_lens : torch.Tensor
        As in :func:`extend`.
    work : torch.Tensor or None
        ``[n, 2]`` int32 (request, first new token of the block) of every non-empty block;
        None launches one program per possible block and lets empty ones exit.
    block_t, block_n, num_warps, num_stages : int
        New tokens per program (times the padded group = rows), KV tile, launch options.
    asm : bool
        FP4 and fp8: word-level decode with inline PTX (see :class:`DecodePlan`); on by default
        for FP4 caches, off for fp8 (slower in extend).
    kernel : str
        The kernel variant: ``"triton_generic"`` (``extend.extend_kernel``).
    """

    cu_seqlens_q: torch.Tensor
    page_table: torch.Tensor
    seq_lens: torch.Tensor
    work: torch.Tensor | None
    block_t: int
    block_n: int
    num_warps: int
    num_stages: int
    asm: bool = False
    kernel: str = "triton_generic"


def _extend_tiles(
    dtype: str, group: int, block_t, block_n, num_warps, num_stages, head_factor: int = 1
):
    """Extend tile defaults, measured on the H200 (benches/attention, run 5).

    4k prefix + 512 new tokens, B=16, 32 q / 8 KV heads. 16-bit caches: 128 rows of (token,
    head) per program over 8 warps, 128-token KV tiles, 3 stages (bf16 1.85 -> 1.76 ms, fp16
    2.05 -> 1.77 ms); fp8: 128 rows over 8 warps, 128-token tiles, 2 stages (2.08 -> 2.01 ms);
    FP4 (with the word decode): 64 rows, 128-token tiles (3.71 -> 2.11 ms); fp32: 64 rows,
    64-token tiles (larger ones do not fit in shared memory).
    """
    gp = _pow2(group)
    wide = dtype in ("bf16", "fp16", "fp8_e4m3", "fp8_e5m2")
    rows = max(16, (128 if wide else 64) // head_factor)
    if block_t is None:
        block_t = max(1, rows // gp) if gp <= rows else 1
    if block_n is None:
        block_n = max(_min_block_n(dtype), (64 if dtype == "fp32" else 128) // head_factor)
    if num_stages is None:
        num_stages = 3 if dtype in ("bf16", "fp16") and head_factor == 1 else 2
    if num_warps is None:
        num_warps = 8 if wide and block_t * gp >= 128 else 4
    return block_t, block_n, num_warps, num_stages


def plan_extend(
    view: LayerView,
    num_q_heads: int,
    cu_seqlens_q: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    block_t: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    asm: bool | None = None,
    kv_lora_rank: int | None = None,
    host_cu_seqlens_q: np.ndarray | None = None,
) -> ExtendPlan | MLAExtendPlan:
    """Plan :func:`extend` for one batch: the list of non-empty (request, token block) pairs.

    Reads ``cu_seqlens_q`` on the host once (one sync per batch, not per layer; none when it
    is a numpy array or ``host_cu_seqlens_q``, its host copy, is given) and checks it
    (ValueError unless non-decreasing from 0). ``cu_seqlens_q``, ``page_table`` and
    ``seq_lens`` may be numpy int32 arrays (the batch helpers' output): copied to ``view``'s
    device once here (pinned, ``non_blocking``); the plan keeps the copies. The work list is
    built with numpy and copied through pinned memory (no sync). Tile options left as None
    take the measured defaults (``_extend_tiles``); ``asm=None`` the default decode path of
    the dtype (word-level for FP4). An MLA layer is planned by
    :func:`kvpool.attention.mla_extend.plan_mla_extend`.

    ``host_cu_seqlens_q``: ``[B + 1]`` int32/int64 numpy, the same values as
    ``cu_seqlens_q`` (a device tensor, e.g. from one packed copy of the step's metadata),
    read instead of it. It must equal it (not checked on the device: that would sync).
    """
    # numpy batch metadata (what the Rust batch helpers return): to the device once
    page_table = as_device_tensor("page_table", page_table, view.k.device)
    seq_lens = as_device_tensor("seq_lens", seq_lens, view.k.device)
    cu_np = cu_seqlens_q if isinstance(cu_seqlens_q, np.ndarray) else None  # (read as is)
    if host_cu_seqlens_q is not None:
        ok = (np.int32, np.int64)
        if not isinstance(host_cu_seqlens_q, np.ndarray) or host_cu_seqlens_q.dtype not in ok:
            raise ValueError(
                f"`host_cu_seqlens_q` is {type(host_cu_seqlens_q).__name__} "
                f"{getattr(host_cu_seqlens_q, 'dtype', '')}: expected a numpy int32/int64 array"
            )
        cu_np = host_cu_seqlens_q
    cu_seqlens_q = as_device_tensor("cu_seqlens_q", cu_seqlens_q, view.k.device)
    if view.v is None:
        return plan_mla_extend(
            view, num_q_heads, cu_seqlens_q, page_table, seq_lens, kv_lora_rank=kv_lora_rank,
            block_t=block_t, block_n=block_n, num_warps=num_warps, num_stages=num_stages, asm=asm,
            host_cu_seqlens_q=cu_np,
        )  # fmt: skip
    _check_view(view)
    g = _group(view, num_q_heads)
    dev = view.k.device
    block_t, block_n, num_warps, num_stages = _extend_tiles(
        view.dtype, g, block_t, block_n, num_warps, num_stages, _head_factor(view)
    )
    _check_fp4_tile(view, block_n)
    _check("cu_seqlens_q", cu_seqlens_q, ndim=1, dtype=torch.int32, device=dev)
    if cu_np is not None and cu_np.shape != tuple(cu_seqlens_q.shape):
        raise ValueError(
            f"`host_cu_seqlens_q` has shape {cu_np.shape}, `cu_seqlens_q` "
            f"{tuple(cu_seqlens_q.shape)}"
        )
    cu_host = cu_seqlens_q.cpu().numpy() if cu_np is None else cu_np
    cu_host = cu_host.astype(np.int64, copy=False)
    _check_cu_seqlens_host(cu_host)  # read on the host here anyway
    work_t = _work_list(cu_host, block_t, dev)
    return ExtendPlan(
        cu_seqlens_q,
        page_table,
        seq_lens,
        work_t,
        block_t,
        block_n,
        num_warps,
        num_stages,
        _asm_default(view, "extend") if asm is None else bool(asm) and _asm_ok(view),
    )


def _work_list(cu: np.ndarray, block_t: int, dev: torch.device) -> torch.Tensor:
    """``[n, 2]`` int32 on ``dev``: ``(request, first new token)`` of every non-empty block.

    Blocks of ``block_t`` new tokens, request after request (``cu``: checked
    ``cu_seqlens_q``).
    """
    q_len = np.diff(cu)
    blocks = -(-q_len // block_t)
    n = int(blocks.sum())
    work = np.empty((n, 2), np.int32)
    work[:, 0] = np.repeat(np.arange(q_len.shape[0], dtype=np.int32), blocks)
    first = np.cumsum(blocks) - blocks  # each request's first block in the list
    work[:, 1] = (np.arange(n) - np.repeat(first, blocks)) * block_t
    t = torch.from_numpy(work)
    if dev.type == "cuda":
        return t.pin_memory().to(dev, non_blocking=True)
    return t.to(dev)
