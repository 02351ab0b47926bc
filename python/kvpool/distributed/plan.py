"""One KV pool plan agreed by every rank of a tensor-parallel group, and DP attention's capacity.

Ranks that size their pools apart can disagree on the page count (their free memory differs by
the CUDA context, NCCL buffers, fragmentation), and then page ids that rank 0's allocator hands
out overflow another rank's shard. SGLang therefore sizes from the *minimum* memory over the TP
group (``get_available_gpu_memory(..., distributed=True)``: an all-reduce with MIN, once for the
memory before the weights load and once after). :func:`agree_plan` does the same, then checks
that every rank made the same plan, and raises the same error on every rank when one cannot.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvpool._args import as_index
from kvpool._core import ModelConfigError, SizingError
from kvpool.config import ModelSpec
from kvpool.distributed import _collective as col
from kvpool.distributed.heads import kv_heads_of_rank
from kvpool.gpus import gpu_memory

if TYPE_CHECKING:
    from kvpool.sizing import Plan

#: Inputs every rank must give alike, compared before sizing (first collective).
INPUT_FIELDS = [
    "model", "geometry", "tp_size", "dp_attention", "dp_size", "dtype", "mem_frac",
    "page_size", "available_memory given", "options",
]  # fmt: skip
#: The plan every rank made, compared after sizing (second collective).
PLAN_FIELDS = [
    "model", "tp_size", "dp_size", "dtype", "page_size", "num_pages", "num_tokens",
    "total_bytes", "buffers",
]  # fmt: skip
_MEMORY_KEYS = ("total_memory", "available_memory", "gpu")


@dataclass(frozen=True)
class GroupPlan:
    """The plan of one rank of a tensor-parallel group, and what the group holds in total.

    Attributes
    ----------
    plan : Plan
        This rank's pool (``KVPool(plan, device)``); the same on every rank. Under DP attention
        it is sized for the attention TP group (``plan.tp_size == attn_tp_size``).
    rank : int
        This rank in the group (the TP rank).
    tp_size : int
        Ranks in the group.
    dp_attention : bool
        Whether each attention-DP rank holds different requests (SGLang's
        ``--enable-dp-attention``).
    dp_size : int
        Attention data-parallel ranks (1 without DP attention); ``tp_size % dp_size == 0``.
    memory_rank : int or None
        The rank whose memory the plan was sized from (the smallest; None for a plan of a given
        ``num_tokens``).
    total_memory, available_memory : int or None
        The minima over the group, in bytes, that ``size_for`` got (None when not used).
    fingerprint : str
        sha256 (hex) of :attr:`fields`; equal on every rank.
    fields : dict
        The compared figures: model, tp_size, dp_size, dtype, page_size, num_pages, num_tokens,
        total_bytes and a hash of the buffer list.
    """

    plan: Plan
    rank: int
    tp_size: int
    dp_attention: bool = False
    dp_size: int = 1
    memory_rank: int | None = None
    total_memory: int | None = None
    available_memory: int | None = None
    fields: dict[str, Any] = field(default_factory=dict, repr=False)
    fingerprint: str = ""

    @property
    def attn_tp_size(self) -> int:
        """Ranks that split one request's KV heads: ``tp_size // dp_size``."""
        return self.tp_size // self.dp_size

    @property
    def attn_tp_rank(self) -> int:
        """The rank within its attention TP group (SGLang: ``tp_rank % attn_tp_size``)."""
        return self.rank % self.attn_tp_size

    @property
    def dp_rank(self) -> int:
        """The attention-DP rank (which requests' KV this rank holds): ``rank // attn_tp_size``."""
        return self.rank // self.attn_tp_size

    @property
    def kv_heads(self) -> range:
        """Global KV heads this rank's pool holds (:func:`kv_heads_of_rank`)."""
        return kv_heads_of_rank(self.plan.spec, self.attn_tp_size, self.attn_tp_rank)

    @property
    def num_tokens_per_rank(self) -> int:
        """Token slots of one rank's pool (``plan.num_tokens``)."""
        return self.plan.num_tokens

    @property
    def num_tokens_total(self) -> int:
        """Distinct tokens the group holds at once: ``num_tokens * dp_size``.

        Without DP attention every rank holds (its heads of) the same tokens, so the group
        holds one pool's worth; under DP attention each attention-DP rank holds its own.
        """
        return self.plan.num_tokens * self.dp_size

    def requests_fit(self, context_len: int) -> int:
        """Requests of ``context_len`` tokens one rank's pool holds (whole pages each)."""
        return self.plan.requests_fit(context_len)

    def requests_fit_total(self, context_len: int) -> int:
        """Requests of ``context_len`` tokens the group holds: ``requests_fit * dp_size``."""
        return self.plan.requests_fit(context_len) * self.dp_size


def _sha(x: Any) -> str:
    return hashlib.sha256(repr(x).encode()).hexdigest()[:16]


def _load_spec(model: Any, model_dtype: str | None) -> ModelSpec:
    """The spec ``size_for`` would build (so ranks compare names and geometry before sizing)."""
    if isinstance(model, ModelSpec):
        return model if model_dtype is None else model.with_dtype(model_dtype)
    if isinstance(model, dict):
        return ModelSpec.from_dict(model, dtype=model_dtype)
    if isinstance(model, (str, os.PathLike)):
        return ModelSpec.from_pretrained(model, dtype=model_dtype)
    raise ModelConfigError(
        f"`model` must be a ModelSpec, a config dict, a path or a hub id, got {model!r}"
    )


def _geometry(spec: ModelSpec) -> str:
    return _sha(
        (spec.layer_kinds, spec.num_attention_heads, spec.num_kv_heads, spec.head_dim,
         spec.v_head_dim, spec.sliding_window, spec.kv_lora_rank, spec.qk_rope_head_dim,
         spec.dtype, sorted(spec.linear_attention.items()))
    )  # fmt: skip


def _bytes(name: str, v: Any) -> int:
    try:
        n = as_index(v)
    except TypeError:
        raise SizingError(f"`{name}` must be an integer (bytes), got {v!r}") from None
    if n < 0:
        raise SizingError(f"`{name}` must be >= 0 bytes, got {n}")
    return n


def _measure_free_memory() -> int:
    """Free bytes of this rank's current CUDA device (before the weights load, as SGLang)."""
    import torch

    if not torch.cuda.is_available():
        raise SizingError(
            "no memory figures given and no CUDA device to measure: pass `gpu=` or "
            "`total_memory=` (and `available_memory=` or `weights=`) in bytes on every rank"
        )
    return int(torch.cuda.mem_get_info(torch.cuda.current_device())[0])


def _local_memory(kw: dict[str, Any]) -> tuple[int | None, int | None]:
    """The local ``(total_memory, available_memory)``: given, from ``gpu=``, or measured."""
    gpu, total, avail = (kw.get(k) for k in ("gpu", "total_memory", "available_memory"))
    if kw.get("num_tokens") is not None:
        return None, None  # a plan of a given size needs no memory figures
    if gpu is not None and total is not None:
        raise SizingError("give either `gpu` or `total_memory`, not both")
    if gpu is not None:
        total = gpu_memory(gpu)
    if total is None:
        if avail is not None:
            raise SizingError("`available_memory` needs `total_memory` (or `gpu`) beside it")
        total = _measure_free_memory()
    total = _bytes("total_memory", total)
    return total, None if avail is None else _bytes("available_memory", avail)


def _dp_size(tp: int, dp_attention: bool, dp_size: Any) -> int:
    if not dp_attention:
        if dp_size not in (None, 1):
            raise ValueError(
                f"`dp_size` = {dp_size!r} needs `dp_attention=True` (replicas of a whole model "
                "size their own pools)"
            )
        return 1
    dp = tp if dp_size is None else as_index(dp_size)
    if dp < 1 or tp % dp:
        raise ValueError(f"`dp_size` = {dp} must be >= 1 and divide tp_size {tp}")
    return dp


def tp_plan(
    model: ModelSpec | dict | str | os.PathLike[str],
    dtype: str = "auto",
    mem_frac: float = 0.9,
    *,
    tp_size: int,
    rank: int = 0,
    dp_attention: bool = False,
    dp_size: int | None = None,
    **size_for_kwargs: Any,
) -> GroupPlan:
    """The plan of one rank of a TP group from memory figures already agreed (no collectives).

    :func:`agree_plan` calls this with the group's minimum memory; call it directly to see a
    group's plan offline (e.g. from ``gpu="H200"``).

    Parameters
    ----------
    model, dtype, mem_frac, **size_for_kwargs
        As :func:`kvpool.size_for` (``tp_size`` is taken from here, see below).
    tp_size : int
        Ranks of the TP group.
    rank : int
        The rank the plan is for (only :attr:`GroupPlan.kv_heads` and ``dp_rank`` depend on it).
    dp_attention : bool
        SGLang's ``--enable-dp-attention``: the group's ranks form ``dp_size`` attention-DP
        ranks of ``tp_size // dp_size`` ranks each; each attention-DP rank holds different
        requests. The pool is sized for ``tp_size // dp_size`` ranks (KV heads split over them;
        an MLA latent is held once per attention-DP rank, not once per rank), while the weights
        are still split over all ``tp_size`` ranks (``weights / tp_size`` each; the attention
        weights SGLang replicates under DP attention are not added; pass
        ``available_memory`` measured after loading to count them).
    dp_size : int, optional
        Attention-DP ranks (default ``tp_size``, as ``--tp 8 --dp 8``); must divide ``tp_size``.

    Returns
    -------
    GroupPlan

    Raises
    ------
    ValueError
        ``dp_size`` without ``dp_attention``, or not dividing ``tp_size``.
    KvDtypeError, ModelConfigError, LayoutError, SizingError, BudgetTooSmallError
        As :func:`kvpool.size_for`.
    """
    from kvpool.sizing import size_for

    tp = as_index(tp_size)
    if tp < 1:
        raise ModelConfigError(f"`tp_size` must be >= 1, got {tp}")
    dp = _dp_size(tp, dp_attention, dp_size)
    kw = dict(size_for_kwargs)
    spec = _load_spec(model, kw.pop("model_dtype", None))
    attn_tp = tp // dp
    if attn_tp != tp and kw.get("available_memory") is None and kw.get("num_tokens") is None:
        # size_for divides the weights by the tp_size it gets (attn_tp here); hand it a figure
        # that divides to weights / tp, the share each rank holds of the TP-split weights.
        from kvpool.weights import weight_bytes

        w = kw.get("weights")
        w = weight_bytes(spec)[0] if w is None or w == "auto" else w
        try:
            kw["weights"] = -(-as_index(w) // tp) * attn_tp
        except TypeError:
            pass  # not an integer: size_for names it
    plan = size_for(spec, dtype, mem_frac, tp_size=attn_tp, **kw)
    fields = {
        "model": spec.name, "tp_size": tp, "dp_size": dp, "dtype": plan.dtype,
        "page_size": plan.page_size, "num_pages": plan.num_pages,
        "num_tokens": plan.num_tokens, "total_bytes": plan.total_bytes,
        "buffers": _sha(plan.buffers),
    }  # fmt: skip
    return GroupPlan(
        plan=plan,
        rank=as_index(rank),
        tp_size=tp,
        dp_attention=bool(dp_attention),
        dp_size=dp,
        total_memory=kw.get("total_memory"),
        available_memory=kw.get("available_memory"),
        fields=fields,
        fingerprint=_sha(sorted(fields.items())),
    )


def agree_plan(
    model: ModelSpec | dict | str | os.PathLike[str],
    dtype: str = "auto",
    mem_frac: float = 0.9,
    *,
    group: Any = None,
    tp_size: int | None = None,
    dp_attention: bool = False,
    dp_size: int | None = None,
    timeout: float | None = None,
    **size_for_kwargs: Any,
) -> GroupPlan:
    """Size one KV pool plan that every rank of ``group`` agrees on (a collective: call on all).

    1. Each rank takes its memory figures: ``total_memory``/``available_memory`` as given (each
       rank passes its own), ``gpu=``, or the free memory of its current CUDA device.
    2. One all-gather of every rank's inputs and figures: ranks that differ in model (name or
       geometry), ``tp_size``, ``dtype``, ``mem_frac``, ``page_size`` or other sizing options
       raise :class:`RankMismatchError` naming each field and rank; a rank whose inputs failed
       (unknown model, no memory figures) makes every rank raise its error.
    3. Every rank sizes from the minimum ``total_memory`` and the minimum ``available_memory``
       over the group (SGLang's two MIN all-reduces), so every rank gets the plan of the rank
       with the least memory.
    4. One more all-gather of the plan's fingerprint (model, tp_size, dtype, page_size,
       num_pages, num_tokens, total_bytes, a hash of the buffer list) and an ok flag: a rank that
       cannot make the plan (``BudgetTooSmallError``) makes every rank raise it; a differing
       plan raises :class:`RankMismatchError` on every rank.

    Parameters
    ----------
    model, dtype, mem_frac, **size_for_kwargs
        As :func:`kvpool.size_for` (``total_memory``, ``available_memory``, ``gpu``,
        ``weights``, ``page_size``, ``num_tokens``, ...).
    group : torch.distributed.ProcessGroup, optional
        The TP group (default: the whole world). A gloo group gathers on the CPU (SGLang uses
        its CPU group for this); an NCCL group needs ``torch.cuda.set_device`` first.
    tp_size : int, optional
        Must equal the group's size (default: the group's size).
    dp_attention, dp_size
        DP attention for MLA models (see :func:`tp_plan`): the caller then routes each request
        to one attention-DP rank and keeps one allocator and radix cache per attention-DP rank;
        the group holds ``num_tokens_total = num_tokens * dp_size`` distinct tokens.
    timeout : float, optional
        Seconds to wait for every rank to arrive (gloo: a ``monitored_barrier`` naming the
        ranks that did not; give the same value on every rank). Collectives also fail after the
        group's own timeout (``init_process_group(timeout=...)``).

    Returns
    -------
    GroupPlan
        Equal on every rank but for ``rank`` (and what depends on it: ``kv_heads``).

    Raises
    ------
    RankMismatchError
        Ranks gave different inputs, or made different plans (every rank raises it).
    CollectiveError
        A rank died, or did not arrive within ``timeout`` / the group's timeout.
    BudgetTooSmallError, SizingError, ModelConfigError, KvDtypeError, LayoutError, ValueError
        Raised on every rank when one rank's inputs or plan failed (message names the rank).
    RuntimeError
        torch.distributed is not initialized (raised locally, before any collective).
    ValueError
        ``timeout`` not a positive number of seconds (raised locally, before any collective).
    """
    rank, world, backend = col.group_info(group)
    kw = dict(size_for_kwargs)
    mine: BaseException | None = None
    raw = model if isinstance(model, (str, os.PathLike)) else type(model).__name__
    intent: dict[str, Any] = {
        "model": os.fspath(raw) if isinstance(raw, os.PathLike) else raw,
        "tp_size": world if tp_size is None else tp_size,
        "dp_attention": dp_attention,
        "dp_size": dp_size,
        "dtype": dtype,
        "mem_frac": mem_frac,
        "page_size": kw.get("page_size", 1),
        "available_memory given": kw.get("available_memory") is not None,
        "options": repr(sorted((k, v) for k, v in kw.items() if k not in _MEMORY_KEYS)),
    }
    memory: tuple[int | None, int | None] = (None, None)
    tp = world
    wait = col.seconds("timeout", timeout)  # local and first: every rank must barrier alike
    try:
        tp = as_index(intent["tp_size"])
        spec = _load_spec(model, kw.pop("model_dtype", None))
        intent.update(model=spec.name, geometry=_geometry(spec))
        if tp != world:
            raise ModelConfigError(
                f"`tp_size` = {tp} on rank {rank}, but the group has {world} ranks "
                "(pass the TP group as `group`)"
            )
        memory = _local_memory(kw)
    except Exception as e:  # shared with every rank below, then raised there and here
        mine = e
    col.barrier(group, backend, wait, "agree_plan")
    rows = col.all_gather(
        group,
        {"intent": intent, "memory": memory, "error": mine and col.error_of(mine)},
        "agree_plan",
    )
    diffs = col.mismatches([r["intent"] for r in rows], INPUT_FIELDS)
    if diffs:
        raise col.RankMismatchError(
            "agree_plan: ranks disagree on the plan's inputs: " + "; ".join(diffs)
        ) from mine
    col.raise_errors([r["error"] for r in rows], "agree_plan", mine)

    totals = [r["memory"][0] for r in rows]
    avails = [r["memory"][1] for r in rows]
    memory_rank = None
    if totals[0] is not None:
        key = avails if avails[0] is not None else totals
        memory_rank = min(range(world), key=lambda r: key[r])
        kw["total_memory"] = min(totals)
        kw["available_memory"] = None if avails[0] is None else min(avails)
    kw.pop("gpu", None)
    gp: GroupPlan | None = None
    try:
        gp = tp_plan(
            spec, dtype, mem_frac, tp_size=tp, rank=rank,
            dp_attention=dp_attention, dp_size=dp_size, **kw,
        )  # fmt: skip
    except Exception as e:
        mine = e
    where = "" if memory_rank is None else f" (sized from rank {memory_rank}'s memory)"
    rows = col.all_gather(
        group,
        {"fields": gp and gp.fields, "error": None if gp else col.error_of(mine)},  # type: ignore[arg-type]
        "agree_plan",
    )
    col.raise_errors([r["error"] for r in rows], "agree_plan" + where, mine)
    diffs = col.mismatches([r["fields"] for r in rows], PLAN_FIELDS)
    if diffs:
        raise col.RankMismatchError(
            "agree_plan: ranks made different plans from the same inputs (different kvpool "
            "versions or model files?): " + "; ".join(diffs)
        )
    assert gp is not None
    return GroupPlan(
        plan=gp.plan,
        rank=rank,
        tp_size=gp.tp_size,
        dp_attention=gp.dp_attention,
        dp_size=gp.dp_size,
        memory_rank=memory_rank,
        total_memory=kw.get("total_memory"),
        available_memory=kw.get("available_memory"),
        fields=gp.fields,
        fingerprint=gp.fingerprint,
    )
