"""Which global KV heads each tensor-parallel rank holds, and that rank's slice of a K/V tensor.

The split is the one vLLM's ``QKVParallelLinear`` and SGLang use, so a pool shard lines up with
the rank's K/V projection: with ``tp_size <= num_kv_heads`` (``tp_size`` dividing it) rank ``r``
holds the contiguous heads ``r * h .. (r + 1) * h - 1``, ``h = num_kv_heads // tp_size``; with
``tp_size > num_kv_heads`` (a multiple of it) each head is replicated on ``tp_size //
num_kv_heads`` consecutive ranks and rank ``r`` holds head ``r // (tp_size // num_kv_heads)``.
MLA models keep one latent per token, replicated on every rank (head 0 of 1).
"""

from __future__ import annotations

from typing import Any

from kvpool._args import as_index
from kvpool._core import ModelConfigError


def _count(name: str, v: Any, minimum: int) -> int:
    try:
        n = as_index(v)
    except TypeError:
        raise ValueError(f"`{name}` must be an integer, got {v!r}") from None
    if n < minimum:
        raise ValueError(f"`{name}` must be >= {minimum}, got {n}")
    return n


def kv_heads_of_rank(spec: Any, tp_size: int, rank: int) -> range:
    """The global KV heads tensor-parallel rank ``rank`` of ``tp_size`` holds.

    Parameters
    ----------
    spec : ModelSpec
        The model (``num_kv_heads`` and ``is_mla`` are read).
    tp_size : int
        Ranks of the tensor-parallel group (under DP attention: the attention TP size).
    rank : int
        This rank, ``0 <= rank < tp_size``.

    Returns
    -------
    range
        Global head indices, ``len == plan.kv_heads_per_rank`` (``range(0, 1)`` for MLA).

    Raises
    ------
    ModelConfigError
        ``tp_size`` neither divides ``num_kv_heads`` nor is a multiple of it (as ``size_for``).
    ValueError
        ``tp_size`` < 1, ``rank`` outside ``0..tp_size - 1``, or not integers.
    """
    tp = _count("tp_size", tp_size, 1)
    r = _count("rank", rank, 0)
    if r >= tp:
        raise ValueError(f"`rank` = {r} is outside 0..{tp - 1} (tp_size {tp})")
    if spec.is_mla:
        return range(0, 1)
    h = spec.num_kv_heads
    if tp <= h:
        if h % tp:
            raise ModelConfigError(f"tp_size `{tp}` does not divide the {h} KV heads")
        per = h // tp
        return range(r * per, (r + 1) * per)
    if tp % h:
        raise ModelConfigError(
            f"tp_size `{tp}` exceeds the {h} KV heads and is not a multiple of them"
        )
    head = r // (tp // h)
    return range(head, head + 1)


def shard_kv_heads(x: Any, spec: Any, tp_size: int, rank: int) -> Any:
    """Rank ``rank``'s slice of a full ``[T, num_kv_heads, D]`` K or V tensor.

    Parameters
    ----------
    x : torch.Tensor or numpy.ndarray
        ``[T, num_kv_heads, D]`` (MLA: ``[T, 1, kv_lora_rank + qk_rope_head_dim]``), any dtype.
    spec, tp_size, rank
        As :func:`kv_heads_of_rank`.

    Returns
    -------
    torch.Tensor or numpy.ndarray
        ``[T, len(heads), D]``, a view of ``x`` (basic slicing: the heads are contiguous).

    Raises
    ------
    ValueError
        ``x`` is not 3-d or its head axis is not ``num_kv_heads`` (1 for MLA).
    """
    heads = kv_heads_of_rank(spec, tp_size, rank)
    want = 1 if spec.is_mla else spec.num_kv_heads
    shape = tuple(getattr(x, "shape", ()))
    if len(shape) != 3 or shape[1] != want:
        raise ValueError(f"`x` must be [T, {want}, D] (all KV heads), got shape {list(shape)}")
    return x[:, heads.start : heads.stop]
