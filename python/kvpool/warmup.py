"""What a serving loop's decode steps compile: the distinct kernel variants of a range of batches.

Triton compiles one kernel per set of constexprs (and per specialization of the int arguments;
the kernels leave the step-dependent ints unspecialized, issue 22). A planned decode's
constexprs follow its plan: the kernel (Triton or Gluon), tile, warps, stages, whether it splits
(``num_splits == 1`` writes the output directly) and the split merge's tiles. The page table's
width and the batch size change them only through the plan, so a warm-up needs one decode per
distinct variant, not one per shape: :func:`decode_shapes` finds a ``(batch, width)`` for each.

Extend plans take their tiles from the geometry alone (one variant per layer dtype), and the
write kernel one per layer dtype and input dtype: one prefill step of any shape compiles them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from kvpool._torch import torch

if TYPE_CHECKING:
    from kvpool.pool import LayerView


def decode_variant(plan: Any, batch: int, num_q_heads: int, v_head_dim: int) -> tuple:
    """A hashable key of what a planned decode compiles (equal keys: no new compile).

    Every plan field that is not a tensor, with ``num_splits`` replaced by whether it is 1
    (the split count is an unspecialized int of the kernels; splitting or not is a constexpr)
    and, when it splits, the split merge's tiles (``launch_decode._merge_tiles`` of
    ``batch * num_q_heads`` rows).
    """
    from kvpool.attention.launch_decode import _merge_tiles

    items = []
    splits = 1
    for f in dataclasses.fields(plan):
        v = getattr(plan, f.name)
        if f.name == "num_splits":
            splits = int(v)
        elif v is None or not isinstance(v, torch.Tensor):
            items.append((f.name, v))
    merge = None if splits == 1 else _merge_tiles(batch * num_q_heads, splits, v_head_dim)
    return (type(plan).__name__, splits == 1, merge, *items)


def geometric(n: int, steps_per_octave: int = 4) -> list[int]:
    """Ints 1 .. ``n``: all up to 11, then about 19% apart (at 4 steps an octave).

    Each int while the geometric step is under 2, then the geometric grid; ``n`` included.

    The batch sizes and page-table widths :func:`decode_shapes` tries.
    """
    out, x, r = [], 1, 2 ** (1 / steps_per_octave)
    while x < n:
        out.append(x)
        x = max(x + 1, int(x * r))
    return [*out, n] if n >= 1 else []


def decode_shapes(
    view: LayerView,
    num_q_heads: int,
    batches: Iterable[int],
    max_pages: int,
    plan_options: Mapping[str, Any] | None = None,
) -> list[tuple[int, int]]:
    """One ``(batch, page-table width)`` per distinct decode variant of default plans.

    Plans :func:`kvpool.attention.plan_decode` (no ``max_seq_len``: the table's capacity, as a
    serving step without it plans) for every batch in ``batches`` and widths from 1 to
    ``max_pages`` pages on a geometric grid (the split heuristics change slowly with the
    length; a variant seen only between two grid points is missed and compiles when first
    met), and keeps the first shape of each :func:`decode_variant`.

    Parameters
    ----------
    view : LayerView
        A layer of the pool (its geometry and device).
    num_q_heads : int
        Query heads per rank.
    batches : iterable of int
        Batch sizes a step may have (e.g. the decode graph buckets or 1 .. max_running).
    max_pages : int
        The widest page table a step may pass.
    plan_options : mapping, optional
        Keyword arguments of ``plan_decode`` the serving loop passes.

    Returns
    -------
    list of (int, int)
        ``(batch, width)`` pairs, smallest batch first.

    Raises
    ------
    ValueError
        ``max_pages`` or a batch below 1 (named), or what ``plan_decode`` raises.
    """
    from kvpool.attention import plan_decode

    bs = sorted(set(batches))
    if not bs or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in bs):
        raise ValueError(f"`batches` = {bs!r}: must be ints >= 1")
    if isinstance(max_pages, bool) or not isinstance(max_pages, int) or max_pages < 1:
        raise ValueError(f"`max_pages` = {max_pages!r}: must be an int >= 1")
    dev = view.k.device
    widths = geometric(max_pages)
    seen: dict[tuple, tuple[int, int]] = {}
    for b in bs:
        sl = torch.ones(b, dtype=torch.int32, device=dev)
        table = torch.zeros(b, max_pages, dtype=torch.int32, device=dev)
        for w in widths:
            plan = plan_decode(view, num_q_heads, table[:, :w], sl, **dict(plan_options or {}))
            key = decode_variant(plan, b, num_q_heads, view.v_head_dim)
            seen.setdefault(key, (b, w))
    return list(seen.values())
