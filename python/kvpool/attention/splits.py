"""How many KV splits a decode request takes (flash-decoding): the wave model."""

from __future__ import annotations

import math

import torch

from kvpool.attention._common import _cdiv

_SM_COUNT: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


# Most KV splits per request a decode plan takes (an explicit ``num_splits``; the planner never
# picks more than 256). The split merge walks them in steps of at most 256.
MAX_SPLITS = 1024


def default_splits(
    batch: int,
    kv_heads: int,
    max_seq_len: int,
    device: torch.device,
    block_n: int = 128,
    num_warps: int = 4,
    programs_per_sm: int | None = None,
    overhead: int | None = None,
) -> int:
    """KV splits per request for :func:`decode`.

    ``batch * kv_heads * splits`` programs run in waves of so many per multiprocessor: 3 for
    4-warp programs, 12 for 1-warp ones (what their registers and shared memory allow: 146
    registers x 128 threads, 66.5 KiB; 168 x 32, 17-18 KiB; other warp counts: 12 / warps,
    an extrapolation). Each split is rounded up to whole
    ``block_n`` tiles and costs about half a tile more (pipeline fill, partial output). The
    estimated time, waves x (tokens per split + block_n / 2), is minimized (fewest splits on
    ties). With at most 16 programs before splitting (one or two requests) the kernel is
    latency-bound: 4-warp programs take the most splits, at most 128 of at least 256 tokens;
    one-warp programs about ``2 * sqrt(B * kv_heads * max_seq_len)`` programs in all (each
    split's fixed cost, its partial output and its share of the merge, against tokens per
    program), at most one wave and at most 256 splits of at least 128 tokens. Splits are whole
    ``block_n`` tiles and none is empty (the count is what the tiles need).

    Measured on the H200 (benches/attention, 8 KV heads): 4 warps (run 5), B=16 at 8k: 3 splits
    (one wave; 2, 5 and 8 slower); B=1 at 32k: 128 (66, 32 slower). 1 warp, fp8_e4m3 with
    32-token tiles (run 6, ``results/run6_h200/call3_variants.json``): B=64/8k 3 splits 0.336 ms
    (4: 0.396 ms, 1.3 waves; 6 with 3 stages: 0.337; 12: 0.339), B=16/8k 12 splits 0.097 ms
    (3: 0.173, 6: 0.123, 24: 0.101); B=1/32k 256 splits of 16-token tiles 35.8 us (128 splits
    of 32-token tiles: 37.8, 256: 41.8). fp8 with 16-token tiles and 3 stages (run 7,
    ``results/run7_h200``): 16 programs per SM, B=64/8k 4 splits 0.325 ms (3: 0.338).
    One-warp programs at <= 16 programs per split, after the split merge's rewrite (run 10,
    ``results/run10_h200``, sweep of 3-5 split counts per point): B=1/32k 128 splits best
    (nvfp4 26.5 us vs 30.1 at 256; fp8_e4m3 33.1 vs 35.3), B=1/8k 64 (nvfp4 15.0, fp8 16.2),
    B=2/32k 64-128 (nvfp4 40.5, fp8 54.2-55.6), B=1/128k 256 (fp8 91.6 vs 99.7 at 128; nvfp4
    65.5 vs 66.3): 512, 1,024, ~1,500 and 2,048 programs, ``2 * sqrt(B * H * n)``. The
    one-wave cap binds at B=1/128k for the Gluon FP4 model (12 programs per SM: 196 splits,
    not measured; between 128 and 256, which were within 1.3%), not for fp8's 16 (256).

    Parameters
    ----------
    batch, kv_heads : int
        Requests and KV heads per rank (``batch * kv_heads`` programs per split).
    max_seq_len : int
        Longest request in tokens.
    device : torch.device
        Where the kernel runs (its multiprocessor count; 4 for a CPU device).
    block_n : int
        The plan's KV tile in tokens.
    num_warps : int
        The plan's warps per program (1 selects the one-warp limits above).
    programs_per_sm : int, optional
        Programs that fit on one multiprocessor, when known better than ``12 / num_warps``
        (the fp8 one-warp default with 16-token tiles and 3 stages: 128 registers x 32 threads,
        13 KiB of shared memory, so 16).
    overhead : int, optional
        What one program costs besides its tokens, in tokens (default ``block_n // 2``). Used
        by the wave model only (not by the <= 16-program one-warp rule).

    Returns
    -------
    int
        Splits per request, ``1 .. 256``.
    """
    programs = max(batch * kv_heads, 1)
    n = max(int(max_seq_len), 1)
    one_warp = num_warps == 1
    smax = max(1, min(256 if one_warp else 128, n // (128 if one_warp else 256)))
    per_sm = programs_per_sm or max(1, 12 // max(num_warps, 1))
    slots = per_sm * _num_sms(torch.device(device))
    if programs <= 16 and not one_warp:
        return smax
    if programs <= 16:
        s = round(2 * math.sqrt(programs * n) / programs)
        s = max(1, min(s, smax, slots // programs))
        return _cdiv(n, _cdiv(_cdiv(n, s), block_n) * block_n)  # whole tiles, no empty split
    extra = block_n // 2 if overhead is None else overhead
    best, best_cost = 1, None
    for s in range(1, smax + 1):
        chunk = _cdiv(_cdiv(n, s), block_n) * block_n  # tokens per split, whole tiles
        cost = _cdiv(programs * _cdiv(n, chunk), slots) * (chunk + extra)
        if best_cost is None or cost < best_cost:
            best, best_cost = s, cost
    return best
