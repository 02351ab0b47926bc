"""The host-memory tier's pool in a plan: pinned host buffers sized byte-exact from the one layout.

A host page holds exactly what a device page of the primary page space holds, byte for byte:
the rows of every per-row buffer (K/V data, FP4 block scales, page-major scales, draft layers).
Per-layer scales and the FP8 workspace are not per page: they stay on the device (a host page
is read back under the same scales). The host buffers are laid out as the device ones with
``host_pages`` usable pages (page 0 unused, so ``slot = page * page_size + offset`` holds for
both), taken from the Rust layout with that page count: the bytes counted are the bytes
allocated. Sizing imports no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

from kvpool import _core

if TYPE_CHECKING:
    from collections.abc import Callable

    from kvpool.sizing import BufferSpec, Plan

#: Buffer roles a host page holds (one page's rows of each).
PER_PAGE_ROLES = ("data", "block_scale", "block_scale_page_major")


class HostPlan(NamedTuple):
    """The host tier's pool of a plan.

    ``num_pages``: usable host pages (ids ``1..num_pages``, the ids of the host
    ``PageAllocator``); ``page_size``: tokens per page (the device's); ``bytes_per_token``:
    bytes a token costs on the host (the per-row buffers of the primary space);
    ``host_bytes``: bytes of every host buffer, ``(num_pages + 1) * page_size *
    bytes_per_token``; ``buffers``: the host buffers (names, dtypes and shapes as the device
    buffers of the same name, with ``(num_pages + 1) * page_size`` rows).
    """

    num_pages: int
    page_size: int
    bytes_per_token: int
    host_bytes: int
    buffers: tuple[BufferSpec, ...]


def _host_buffers(plan: Plan) -> tuple[BufferSpec, ...]:
    return tuple(b for b in plan.buffers if b.role in PER_PAGE_ROLES and b.space == "primary")


def host_plan(
    plan: Plan,
    make: Callable[[int], Plan],
    host_memory: int | None,
    host_pages: int | None,
) -> HostPlan | None:
    """The host pool for ``plan`` in ``host_memory`` bytes (or of exactly ``host_pages`` pages).

    ``make(num_tokens)`` builds a plan of the same geometry and dtype for that many tokens (the
    one layout). Returns None when neither is given.

    Raises
    ------
    SizingError
        Both given, a negative value, or a plan with more than one page space (sliding or
        linear-attention layers: the host tier serves models with one page space).
    BudgetTooSmallError
        ``host_memory`` holds no host page.
    """
    if host_memory is None and host_pages is None:
        return None
    if host_memory is not None and host_pages is not None:
        raise _core.SizingError("give `host_memory` or `host_pages`, not both")
    for name, v in (("host_memory", host_memory), ("host_pages", host_pages)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise _core.SizingError(f"`{name}` must be a non-negative int, got {v!r}")
    spaces = plan.page_spaces
    if len(spaces) != 1:
        raise _core.SizingError(
            f"a host tier needs a model with one page space; this plan has {len(spaces)} "
            f"({', '.join(spaces)}): sliding-window and linear-attention models are not supported"
        )
    ps = plan.page_size
    one = _host_buffers(make(ps))  # one page + the padding page
    page_bytes = sum(b.nbytes for b in one) // 2
    bpt = page_bytes // ps
    if host_pages is None:
        assert host_memory is not None
        host_pages = host_memory // page_bytes - 1
        if host_pages < 1:
            raise _core.BudgetTooSmallError(
                f"`host_memory` = {host_memory} bytes holds no host page: one page costs "
                f"{page_bytes} bytes and the unused page 0 as much again"
            )
    if host_pages == 0:
        return HostPlan(0, ps, bpt, 0, ())
    bufs = _host_buffers(make(host_pages * ps))
    total = sum(b.nbytes for b in bufs)
    if total != (host_pages + 1) * page_bytes:  # the layout is linear in rows
        raise _core.SizingError(f"host layout is not linear in pages ({total} bytes)")
    return HostPlan(host_pages, ps, bpt, total, bufs)


def host_summary(h: HostPlan) -> dict[str, Any]:
    """The host pool's figures as a JSON-ready dict."""
    return {
        "num_pages": h.num_pages,
        "num_tokens": h.num_pages * h.page_size,
        "page_size": h.page_size,
        "bytes_per_token": h.bytes_per_token,
        "host_bytes": h.host_bytes,
    }
