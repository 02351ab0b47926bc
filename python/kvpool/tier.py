"""The host-memory tier: a pinned host pool mirroring a ``KVPool``, demotions and loads.

Pages the device pool evicts are demoted to host pages instead of dropped: their bytes (the
quantized data and block scales, unchanged: fp8 and FP4 pages move 2x and 3.56x fewer bytes
than bf16 ones) are copied to the host pool, and the radix node records that it is on the host
(``RadixCache(..., host_allocator=...)``, see ``rust/src/radix/tier.rs``). A later request whose
prefix continues on the host loads those pages back instead of recomputing them.

- :class:`HostPool`: the host buffers, one per per-page device buffer (``plan.host.buffers``;
  ``nbytes == plan.host_bytes``), pinned when the pool is on CUDA.
- :class:`HostTier`: the cache, the allocators and both pools. Every call that may evict
  (:meth:`HostTier.alloc`, :meth:`HostTier.try_alloc`, :meth:`HostTier.evict`) enqueues the
  demotion copies (device to host, non-blocking, on the current stream) before it returns, so
  before the freed device pages can be written again. :meth:`HostTier.match` gives the device
  match and the host pages after it; :meth:`HostTier.load` starts their load.
- :class:`PageLoad`: one load, with one copy per contiguous run of pages and buffer, enqueued
  layer by layer on a side stream with an event per layer: the forward calls
  :meth:`PageLoad.wait` before a layer's attention, so ``extend`` of layer i overlaps the load
  of layer i + 1. On CPU the copies are plain (the tests run there).

A load that fails (no device pages, a copy that raises) leaves the node on the host and the
request recomputes (:meth:`HostTier.load` returns None).

A GPU stream note: demotions run on the current stream; a load's side stream first waits for
the current stream (a demotion into a host page, or out of a device page, that the load then
touches is complete first), and the host pages a load reads hold a reference of the load until
its copies have run (:meth:`HostTier.poll`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvpool import _core
from kvpool._torch import torch
from kvpool.metrics import kv_cache_usage

if TYPE_CHECKING:
    from kvpool.pool import KVPool
    from kvpool.sizing import Plan


def runs(src: np.ndarray, dst: np.ndarray) -> list[tuple[int, int, int]]:
    """Contiguous runs of a page mapping: ``(src_start, dst_start, length)`` triples.

    ``src[i] -> dst[i]`` pairs are grouped while both ids step by one, so each run is one copy
    of ``length`` pages. ``src`` and ``dst`` are 1-D int arrays of one length.
    """
    src = np.asarray(src, dtype=np.int64)
    dst = np.asarray(dst, dtype=np.int64)
    if src.shape != dst.shape or src.ndim != 1:
        raise ValueError(f"`src` {src.shape} and `dst` {dst.shape} must be 1-D and of one shape")
    if len(src) == 0:
        return []
    brk = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate([[0], brk])
    ends = np.concatenate([brk, [len(src)]])
    return [(int(src[s]), int(dst[s]), int(e - s)) for s, e in zip(starts, ends, strict=True)]


def _paged(t: torch.Tensor, role: str, page_size: int) -> torch.Tensor:
    """``t`` with pages as its first dimension (page-major scales already have them)."""
    if role == "block_scale_page_major":
        return t
    return t.view(t.shape[0] // page_size, page_size, *t.shape[1:])


class HostPool:
    """Host buffers holding ``plan.host_pages`` pages of every per-page buffer of ``pool``.

    Parameters
    ----------
    pool : KVPool
        The device pool (its plan's ``host``, from ``size_for(..., host_memory=...)`` or
        ``host_pages=...``, gives the host layout).
    pin_memory : bool, optional
        Page-locked host memory (default: when ``pool`` is on CUDA; needed for non-blocking
        copies).

    Attributes
    ----------
    buffers : dict of str to torch.Tensor
        Host tensors named as the device buffers they mirror (``layers.3.k``, ...), rows
        ``(host_pages + 1) * page_size`` (page 0 unused); ``sum(nbytes) == plan.host_bytes``.

    Raises
    ------
    ValueError
        The plan has no host pool.
    """

    def __init__(self, pool: KVPool, pin_memory: bool | None = None):
        plan: Plan = pool.plan
        if plan.host is None or plan.host.num_pages == 0:
            raise ValueError(
                "the plan has no host pool: size_for(..., host_memory=...) or host_pages=..."
            )
        self.plan = plan
        self.num_pages = plan.host.num_pages
        self.page_size = plan.page_size
        pin = pool.device.type == "cuda" if pin_memory is None else bool(pin_memory)
        self.pinned = pin
        self.buffers: dict[str, torch.Tensor] = {}
        #: per layer key (group, layer): [(device paged view, host paged view)] in plan order
        self.layers: dict[tuple[str, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for b in plan.host.buffers:
            dev = pool.buffers[b.name]
            host = torch.empty(b.shape, dtype=dev.dtype, device="cpu", pin_memory=pin)
            self.buffers[b.name] = host
            pair = (_paged(dev, b.role, self.page_size), _paged(host, b.role, self.page_size))
            self.layers.setdefault((b.group, b.layer), []).append(pair)

    @property
    def nbytes(self) -> int:
        """Bytes of every host buffer (``plan.host_bytes``)."""
        return sum(t.nbytes for t in self.buffers.values())

    def copy_pages(self, src: np.ndarray, dst: np.ndarray, *, to_host: bool,
                   layers: Any = None, non_blocking: bool = True) -> int:
        """Copies pages ``src[i] -> dst[i]`` of every buffer (of ``layers`` keys, default all).

        ``to_host``: device pages to host pages (else host to device). One ``copy_`` per
        contiguous run and buffer, on the current stream. Returns the copies made.
        """
        rs = runs(src, dst)
        n = 0
        for key in self.layers if layers is None else layers:
            for dev, host in self.layers[key]:
                a, b = (dev, host) if to_host else (host, dev)
                for s, d, k in rs:
                    b[d:d + k].copy_(a[s:s + k], non_blocking=non_blocking)
                    n += 1
        return n


@dataclass
class TierMatch:
    """:meth:`HostTier.match`: the device match and the host pages after it.

    ``pages``/``node``/``matched``: as ``RadixCache.match_prefix`` (device pages, int32);
    ``host_pages``: int32 host page ids continuing it; ``host_node``: where they end (for
    ``load_back``); ``host_len``: their tokens.
    """

    pages: np.ndarray
    node: Any
    matched: int
    host_pages: np.ndarray
    host_node: Any
    host_len: int


class PageLoad:
    """A load of host pages into device pages, enqueued layer by layer (see :meth:`HostTier.load`).

    Attributes
    ----------
    device_pages : numpy.ndarray
        int32 device pages holding the loaded prefix, in path order (the request holds one
        reference on each and frees it as usual; the cache holds its own once loaded back).
    tokens : int
        Tokens loaded (``len(device_pages) * page_size``).
    loaded_back : bool
        Whether the node moved to the device tier (False when it was dropped from the host
        meanwhile: the pages still hold the right bytes, the request keeps them and its insert
        caches them).

    Notes
    -----
    On CUDA the copies run on the tier's side stream: a request that stops before its forward
    (cancelled) calls :meth:`wait_all` before it frees ``device_pages``, so that no later
    write to them on the current stream races with the load.
    """

    def __init__(self, tier: HostTier, device_pages: np.ndarray, host_pages: np.ndarray,
                 events: dict[tuple[str, int], Any]):
        self._tier = tier
        self.device_pages = device_pages
        self.host_pages = host_pages
        self.tokens = len(device_pages) * tier.page_size
        self.loaded_back = False
        self._events = events

    def wait(self, layer: int, group: str | None = None) -> None:
        """Makes the current stream wait for the load of ``layer`` (call before its attention).

        ``group``: the plan's group name of the layer (default: the first group holding it).
        Nothing to wait for on CPU.
        """
        for (g, i), ev in self._events.items():
            if i == layer and (group is None or g == group) and ev is not None:
                torch.cuda.current_stream(ev.device).wait_event(ev)

    def wait_all(self) -> None:
        """Makes the current stream wait for every layer's load."""
        for ev in self._events.values():
            if ev is not None:
                torch.cuda.current_stream(ev.device).wait_event(ev)


class HostTier:
    """A radix cache with a host-memory tier over a device pool and its host pool.

    Parameters
    ----------
    pool : KVPool
        The device pool; its plan must have a host pool (``size_for(..., host_memory=...)``).
    allocator : PageAllocator, optional
        The device pages' allocator (default: a new one of ``plan.num_pages``).
    host_pool : HostPool, optional
        Default: a new one (pinned on CUDA).

    Attributes
    ----------
    cache : RadixCache
        Built with ``host_allocator``; use it for ``lock``, ``unlock``, ``insert``,
        ``match_prefix``. Allocate through :meth:`alloc` (it copies demoted pages).
    allocator, host_allocator : PageAllocator
    pool : KVPool
    host : HostPool
    """

    def __init__(self, pool: KVPool, allocator: Any = None, host_pool: HostPool | None = None):
        self.pool = pool
        self.host = host_pool if host_pool is not None else HostPool(pool)
        self.page_size = pool.page_size
        self.allocator = allocator if allocator is not None else _core.PageAllocator(
            pool.num_pages, pool.page_size)
        self.host_allocator = _core.PageAllocator(self.host.num_pages, self.page_size)
        self.cache = _core.RadixCache(self.allocator, host_allocator=self.host_allocator)
        cuda = pool.device.type == "cuda"
        self._stream = torch.cuda.Stream(device=pool.device) if cuda else None
        self._held: list[tuple[Any, np.ndarray]] = []  # (event, host pages a load still reads)
        self.failed_loads = 0
        self.demotion_copies = 0

    # --- device pages, demotions ---

    def flush_demotions(self) -> int:
        """Enqueues the copies of the pages demoted since the last call (current stream).

        Returns the pages copied. :meth:`alloc`, :meth:`try_alloc` and :meth:`evict` call it.
        """
        dev, host = self.cache.take_demotions()
        if len(dev):
            self.demotion_copies += self.host.copy_pages(dev, host, to_host=True)
        return len(dev)

    def alloc(self, n: int) -> np.ndarray:
        """``cache.alloc(n)``, demoting (not dropping) what it evicts; int32 page ids ``(n,)``.

        Raises
        ------
        OutOfPagesError
            Not even evicting everything unlocked would free enough; nothing changed.
        """
        self.poll()
        try:
            return self.cache.alloc(n)
        finally:
            self.flush_demotions()

    def try_alloc(self, n: int) -> np.ndarray | None:
        """As :meth:`alloc`, None instead of ``OutOfPagesError``."""
        self.poll()
        try:
            return self.cache.try_alloc(n)
        finally:
            self.flush_demotions()

    def evict(self, num_tokens: int) -> int:
        """``cache.evict(num_tokens)`` with demotion; returns the tokens that left the device."""
        try:
            return self.cache.evict(num_tokens)
        finally:
            self.flush_demotions()

    # --- matches and loads ---

    def match(self, tokens: np.ndarray, namespace: Any = None) -> TierMatch:
        """The device match of ``tokens`` (``match_prefix``) and the host pages after it."""
        pages, node, matched = self.cache.match_prefix(tokens, namespace)
        hp, hnode, hlen = self.cache.match_prefix_host(tokens, namespace)
        return TierMatch(pages, node, matched, hp, hnode, hlen)

    def load(self, m: TierMatch) -> PageLoad | None:
        """Starts loading ``m``'s host pages into new device pages; None: recompute instead.

        Takes ``len(m.host_pages)`` device pages (:meth:`alloc`: may demote other entries;
        lock ``m.node`` first so the device match stays), enqueues one copy per contiguous run
        and buffer, layer by layer (CUDA: on the tier's side stream, after the current stream,
        with an event per layer), then moves the node to the device tier
        (``cache.load_back``). The request's prefix is then ``m.matched + load.tokens`` tokens
        over ``concat(m.pages, load.device_pages)``.

        Returns None, leaving the node on the host, when there is nothing to load, the device
        has no room, or a copy raises (counted in ``failed_loads``).
        """
        hp = np.asarray(m.host_pages, dtype=np.int32)
        if m.host_len == 0 or len(hp) == 0:
            return None
        self.host_allocator.inc_ref(hp)  # the load's reference: no demotion reuses them
        dev = None
        try:
            dev = self.try_alloc(len(hp))
            if dev is None:
                raise MemoryError("no device pages for the load")
            events = self._enqueue(hp, dev)
        except Exception:
            self.failed_loads += 1
            if dev is not None:
                self.allocator.free(dev)
            self.host_allocator.free(hp)
            return None
        load = PageLoad(self, dev, hp, events)
        try:
            self.cache.load_back(m.host_node, dev)
            load.loaded_back = True
        except (_core.StaleNodeError, _core.InvalidArgumentError):
            pass  # dropped or split away meanwhile: the bytes are right, insert caches them
        last = next(reversed(events.values()), None) if events else None
        self._held.append((last, hp))
        self.poll()
        return load

    def _enqueue(self, hp: np.ndarray, dev: np.ndarray) -> dict[tuple[str, int], Any]:
        events: dict[tuple[str, int], Any] = {}
        if self._stream is None:
            for key in self.host.layers:
                self.host.copy_pages(hp, dev, to_host=False, layers=[key])
                events[key] = None
            return events
        self._stream.wait_stream(torch.cuda.current_stream(self.pool.device))
        with torch.cuda.stream(self._stream):
            for key in self.host.layers:
                self.host.copy_pages(hp, dev, to_host=False, layers=[key])
                ev = torch.cuda.Event()
                ev.record(self._stream)
                events[key] = ev
        return events

    def poll(self) -> None:
        """Drops the loads' references on host pages whose copies have run."""
        keep = []
        for ev, hp in self._held:
            if ev is None or ev.query():
                self.host_allocator.free(hp)
            else:
                keep.append((ev, hp))
        self._held = keep

    # --- metrics ---

    def metrics(self) -> dict[str, float]:
        """Counters and gauges as a dict, under vLLM's names where they exist.

        ``kv_cache_usage_perc`` (vLLM's gauge: :func:`kvpool.metrics.kv_cache_usage`, the
        device pool's used pages / usable pages, evictable cached pages counted free),
        ``prefix_cache_queries`` / ``prefix_cache_hits`` (tokens asked of / served by the
        device match), ``host_cache_queries`` / ``host_cache_hits`` (tokens after the device
        match / found on the host), ``demotions`` (pages device -> host), ``loads`` (pages host
        -> device), ``evictions`` (device pages dropped with no host copy),
        ``host_evictions`` (host pages dropped), ``host_usage_perc``, ``failed_loads``.
        """
        s = self.cache.tier_stats()
        c = self.cache
        return {
            "kv_cache_usage_perc": kv_cache_usage(c),
            "prefix_cache_queries": c.hit_tokens + c.miss_tokens,
            "prefix_cache_hits": c.hit_tokens,
            "host_cache_queries": s["host_query_tokens"],
            "host_cache_hits": s["host_hit_tokens"],
            "demotions": s["demoted_pages"],
            "loads": s["loaded_pages"],
            "evictions": s["dropped_pages"],
            "host_evictions": s["host_evicted_pages"],
            "host_usage_perc": self.host_allocator.num_used / max(1, self.host_allocator.num_pages),
            "failed_loads": self.failed_loads,
        }
