"""The few collectives kvpool's distributed helpers share: gather, compare, raise on every rank.

Every decision taken after a collective is computed from the gathered values alone, so every
rank reaches the same verdict and raises the same error; no rank raises before a collective the
others are waiting in (that would leave them waiting for the group's timeout).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from kvpool import _core

#: Exceptions a failing rank's error is re-raised as on every rank (by class name), so a rank
#: that cannot fit the plan raises ``BudgetTooSmallError`` everywhere, not only on itself.
_KNOWN: dict[str, type[Exception]] = {
    e.__name__: e
    for e in (
        _core.BudgetTooSmallError,
        _core.SizingError,
        _core.ModelConfigError,
        _core.KvDtypeError,
        _core.LayoutError,
        MemoryError,
        ValueError,
        TypeError,
    )
}


class CollectiveError(RuntimeError):
    """A collective failed: a rank died, or did not join within the timeout.

    The group is not usable afterwards (destroy it and start again); the message names the
    operation and, where the backend says so, the rank.
    """


class RankMismatchError(ValueError):
    """Ranks of one group called the same operation with different inputs or results.

    The message names every field that differs and the value each rank holds; every rank of the
    group raises it.
    """


def group_info(group: Any) -> tuple[int, int, str]:
    """``(rank in group, group size, backend name)``; raises if torch.distributed is not set up."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized: call torch.distributed.init_process_group "
            "(backend 'gloo' on CPU, 'nccl' on GPUs) on every rank first"
        )
    return dist.get_rank(group), dist.get_world_size(group), str(dist.get_backend(group))


def seconds(name: str, timeout: Any) -> timedelta | None:
    """``timeout`` (seconds or a timedelta, > 0) as a timedelta; None stays None."""
    if timeout is None:
        return None
    if isinstance(timeout, timedelta):
        t = timeout
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        t = timedelta(seconds=float(timeout))
    else:
        raise ValueError(f"`{name}` must be seconds (a number) or a timedelta, got {timeout!r}")
    if t.total_seconds() <= 0:
        raise ValueError(f"`{name}` must be > 0 seconds, got {timeout!r}")
    return t


def barrier(group: Any, backend: str, timeout: timedelta | None, what: str) -> None:
    """Wait until every rank has arrived at ``what``, naming the ranks that did not (gloo only).

    ``monitored_barrier`` is gloo's; other backends skip it and rely on the group's timeout.
    """
    if timeout is None or backend != "gloo":
        return
    import torch.distributed as dist

    try:
        dist.monitored_barrier(group, timeout=timeout, wait_all_ranks=True)
    except RuntimeError as e:
        raise CollectiveError(
            f"{what}: not every rank arrived within {timeout.total_seconds():g} s "
            f"(a rank died, hangs, or does not call {what}): {e}"
        ) from e


def all_gather(group: Any, obj: Any, what: str) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order; :class:`CollectiveError` on failure.

    Gloo groups gather on the CPU; NCCL groups need ``torch.cuda.set_device`` called first
    (``all_gather_object``'s rule).
    """
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size(group)
    try:
        dist.all_gather_object(out, obj, group=group)
    except RuntimeError as e:
        raise CollectiveError(
            f"{what}: the all-gather failed (a rank died, or did not reach {what} within the "
            f"group's timeout): {e}"
        ) from e
    return out


def ranks_text(ranks: list[int]) -> str:
    """``rank 1`` / ``ranks 0, 2``."""
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def mismatches(rows: list[dict[str, Any]], fields: list[str]) -> list[str]:
    """One phrase per field whose value differs across ranks: value -> the ranks holding it.

    Fields missing on some rank (its inputs failed before that field was known) are skipped.
    """
    out = []
    for f in fields:
        if not all(f in row for row in rows):
            continue
        by_value: dict[str, list[int]] = {}
        for r, row in enumerate(rows):
            by_value.setdefault(repr(row.get(f)), []).append(r)
        if len(by_value) > 1:
            parts = [f"{v} on {ranks_text(rs)}" for v, rs in by_value.items()]
            out.append(f"`{f}` is " + " but ".join(parts))
    return out


def error_of(e: BaseException) -> tuple[str, str]:
    """A local error as ``(class name, message)``, small and picklable."""
    return (type(e).__name__, str(e))


def raise_errors(errors: list[tuple[str, str] | None], what: str, mine: BaseException | None):
    """Raise on every rank when any rank failed: the first failing rank's class and message.

    ``mine`` (this rank's own exception, if any) is chained as the cause. Classes outside
    :data:`_KNOWN` become :class:`CollectiveError`.
    """
    failed = [r for r, e in enumerate(errors) if e is not None]
    if not failed:
        return
    name, msg = errors[failed[0]]  # type: ignore[misc]
    same = [r for r in failed if errors[r] == errors[failed[0]]]
    others = [r for r in failed if r not in same]
    text = f"{what} failed on {ranks_text(same)}: {msg}"
    if others:
        text += f" (and on {ranks_text(others)}: {'; '.join(errors[r][1] for r in others)})"  # type: ignore[index]
    cls = _KNOWN.get(name, CollectiveError)
    raise cls(text) from mine


def on_every_rank(fn: Any, *, group: Any = None, what: str | None = None) -> Any:
    """Run ``fn()`` on this rank; if it raised on any rank of ``group``, raise on every rank.

    One all-gather of an ok flag (and the error's class and message) after ``fn`` returns, so a
    rank that cannot allocate its shard (``KVPool(plan, "cuda")`` out of memory) stops the whole
    group, not only itself while the others wait in their first collective. Call it on every
    rank.

    Parameters
    ----------
    fn : callable
        No arguments; its result is returned on the ranks where every rank succeeded.
    group : torch.distributed.ProcessGroup, optional
        Default: the whole world.
    what : str, optional
        Named in the error (default: ``fn``'s name).

    Raises
    ------
    Exception
        The first failing rank's error class (kvpool's sizing errors, ValueError, TypeError; else
        :class:`CollectiveError`), its message prefixed with the failing ranks, on every rank.
    CollectiveError
        The all-gather failed (a rank died or timed out).
    """
    what = what or getattr(fn, "__name__", "fn")
    group_info(group)
    mine, out = None, None
    try:
        out = fn()
    except Exception as e:
        mine = e
    errors = all_gather(group, mine and error_of(mine), what)
    raise_errors(errors, what, mine)
    return out
