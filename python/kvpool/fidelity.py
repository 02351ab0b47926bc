"""How much a KV dtype changes a real model's predictions (docs/architecture.md, "Fidelity").

Teacher forcing: the same fixed token sequence runs once with the model's ordinary contiguous
cache (:meth:`kvpool.llama.Llama.forward_reference`, the reference) and once with its keys and
values stored in a :class:`~kvpool.KVPool` of the dtype under test and read back by the pool's
attention; every position's next-token distribution is compared. Reported per dtype:

- ``top1``: fraction of positions whose arg-max token equals the reference's;
- ``kl``: mean KL(reference || cache) in nats;
- ``ppl``: perplexity of the text under the cached run (``ppl_ref`` for the reference);
- ``max_abs_logit_diff``: the largest logit difference (float noise for a cache in the model's
  own dtype).

All tokens of the text go through one extend step that writes every K/V before attention reads
them back from the pool, so each position attends to stored (quantized) keys and values of all
earlier tokens and itself, as in token-by-token decoding.

fp8 and nvfp4 caches need per-layer scales: :func:`calibrate_scales` computes them from reference
K/V with :func:`kvpool.scales.calibrate` (amax / format max, nvfp4's global scale
amax / (6 * 448)).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvpool.sizing import size_for

if TYPE_CHECKING:
    from kvpool.llama import Llama
    from kvpool.pool import KVPool

@dataclass
class Fidelity:
    """Teacher-forced agreement of one KV dtype with the reference (see module doc)."""

    dtype: str
    resolved: str
    tokens: int
    top1: float
    kl: float
    ppl: float
    ppl_ref: float
    max_abs_logit_diff: float

    def as_dict(self) -> dict[str, Any]:
        """Plain dict (JSON-ready)."""
        return asdict(self)


def calibrate_scales(
    past: Sequence[tuple[torch.Tensor, torch.Tensor]], dtype: str
) -> tuple[list[float], list[float]] | None:
    """Calibrate per-layer ``(k_scales, v_scales)`` for ``dtype`` from sample K/V.

    ``past`` holds per layer ``[Hkv, N, D]`` K (after RoPE) and V; None for dtypes without such
    scales.

    fp8: ``amax / format max``; nvfp4: the global scale ``amax / (6 * 448)``. A layer whose
    samples are all zero gets 1.0.
    """
    from kvpool.scales import SCALED_DTYPES, calibrate

    if dtype not in SCALED_DTYPES:
        return None
    return calibrate(((i, k, v) for i, (k, v) in enumerate(past)), len(past), dtype)


def metrics(ref: torch.Tensor, test: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    """Compare ``[N, vocab]`` logits; ``targets[i]`` is the token that follows position ``i``.

    Returns ``top1``, ``kl`` (mean KL(ref || test), nats), ``ppl``, ``ppl_ref``,
    ``max_abs_logit_diff``.
    """
    ref, test = ref.double(), test.double()
    lp_ref, lp = ref.log_softmax(-1), test.log_softmax(-1)
    kl = (lp_ref.exp() * (lp_ref - lp)).sum(-1).clamp_min(0).mean()
    t = targets.to(device=ref.device, dtype=torch.long)[:, None]  # CPU ids, GPU logits
    return {
        "top1": float((ref.argmax(-1) == test.argmax(-1)).double().mean()),
        "kl": float(kl),
        "ppl": math.exp(float(-lp.gather(1, t).mean())),
        "ppl_ref": math.exp(float(-lp_ref.gather(1, t).mean())),
        "max_abs_logit_diff": float((ref - test).abs().max()),
    }


def pool_for(
    model: Llama,
    dtype: str,
    num_tokens: int,
    *,
    page_size: int = 16,
    scales: tuple[list[float], list[float]] | None = None,
) -> KVPool:
    """Make a pool on the model's device holding ``num_tokens`` tokens of ``dtype``."""
    from kvpool.pool import KVPool

    plan = size_for(model.spec, dtype, num_tokens=num_tokens, page_size=page_size)
    pool = KVPool(plan, device=model.device)
    if scales is not None:
        pool.set_kv_scales(*scales, source="calibration")
    return pool


def teacher_forced_logits(model: Llama, pool: KVPool, ids: torch.Tensor) -> torch.Tensor:
    """``[N, vocab]`` logits of every position of ``ids`` with K/V in ``pool`` (pages 1..)."""
    from kvpool.llama import Step

    ps = pool.page_size
    n = ids.numel()
    pages = torch.arange(1, -(-n // ps) + 1, dtype=torch.int32)
    if pages.numel() > pool.num_pages:
        raise ValueError(f"{n} tokens do not fit in a pool of {pool.num_pages} pages of {ps}")
    step = Step.build([pages], [0], [n], ps, device=model.device)
    return model.forward(pool, ids, step, all_logits=True)


def evaluate(
    model: Llama,
    ids: Sequence[int] | torch.Tensor,
    dtypes: Sequence[str],
    *,
    page_size: int = 16,
    calib_ids: Sequence[int] | torch.Tensor | None = None,
    on_dtype: Callable[[Fidelity], None] | None = None,
) -> list[Fidelity]:
    """Teacher-forced fidelity of each KV dtype on ``ids`` (see module doc).

    Parameters
    ----------
    model : Llama
    ids : sequence of int
        The fixed text (at least 2 tokens).
    dtypes : sequence of str
        KV dtypes (``auto`` resolves to the model's compute dtype).
    page_size : int
        Tokens per page of the pools.
    calib_ids : sequence of int, optional
        Text whose reference K/V calibrate fp8/nvfp4 scales (default: ``ids`` itself).
    on_dtype : callable, optional
        Called with each dtype's result as soon as it is measured (progress display).
    """
    ids_t = torch.as_tensor(ids, dtype=torch.int64)
    if ids_t.numel() < 2:
        raise ValueError("fidelity needs a text of at least 2 tokens")
    ref, past = model.forward_reference(ids_t)
    if calib_ids is not None:
        _, past = model.forward_reference(torch.as_tensor(calib_ids, dtype=torch.int64))
    targets = ids_t[1:]
    out = []
    for dtype in dtypes:
        pool = pool_for(
            model,
            dtype,
            ids_t.numel(),
            page_size=page_size,
            scales=calibrate_scales(past, _resolve(model, dtype)),
        )
        logits = teacher_forced_logits(model, pool, ids_t)
        m = metrics(ref[:-1], logits[:-1], targets)
        out.append(Fidelity(dtype, pool.plan.dtype, int(targets.numel()), **m))
        if on_dtype is not None:
            on_dtype(out[-1])
        del pool
    return out


def _resolve(model: Llama, dtype: str) -> str:
    if dtype == "auto":
        return model.spec.dtype
    return "fp8_e4m3" if dtype == "fp8" else dtype
