"""Cache metrics under vLLM's names, as a dict and (optionally) through ``prometheus_client``.

:func:`cache_metrics` reads a ``RadixCache``'s counters (and an ``EventPublisher``'s) into a
flat dict; :func:`register_prometheus` exports the same values on every scrape. Names follow
vLLM's metrics where one exists (``vllm:kv_cache_usage_perc``, ``vllm:prefix_cache_queries``,
``vllm:prefix_cache_hits``, defined in vLLM's v1 metrics loggers); the others are
kvpool's. Keys (gauges unless marked counter):

- ``kv_cache_usage_perc``: fraction 0..1 of the device pool's pages in use, counted as vLLM
  does (:func:`kv_cache_usage`; ``HostTier.metrics`` reports the same value);
- ``pool_used_perc``: fraction 0..1 of pages not on the allocator's free list (cached included);
- ``prefix_cache_queries`` (counter, tokens): tokens asked of ``match_prefix``;
- ``prefix_cache_hits`` (counter, tokens): tokens ``match_prefix`` served from the cache;
- ``cached_tokens``, ``evictable_tokens``, ``protected_tokens``: ``total_size``,
  ``evictable_size``, ``protected_size`` (tokens); ``cache_nodes``: ``num_nodes``;
- ``free_pages``, ``num_pages``: the allocator's (pages);
- with ``kv_events=True`` only: ``kv_events_recorded`` (counter, events), ``blocks_stored`` and
  ``evicted_blocks`` (counters, pages announced as stored / removed), ``kv_event_overflows``
  (counter: pending buffers replaced by a snapshot);
- with a publisher: ``kv_events_published`` (counter, events), ``kv_event_batches_published``,
  ``kv_event_batches_dropped`` (queue full), ``kv_event_replays`` (counters).

Counters count from the cache's construction; ``reset`` zeroes the cache's hit and query counts
(not the event counts).
"""

from __future__ import annotations

from typing import Any

from kvpool._deps import missing

__all__ = ["COUNTERS", "cache_metrics", "kv_cache_usage", "register_prometheus"]

COUNTERS = frozenset({
    "prefix_cache_queries", "prefix_cache_hits", "kv_events_recorded", "blocks_stored",
    "evicted_blocks", "kv_event_overflows", "kv_events_published", "kv_event_batches_published",
    "kv_event_batches_dropped", "kv_event_replays",
})
"""The keys of :func:`cache_metrics` that are counters (monotonic); the others are gauges."""

_HELP = {
    "kv_cache_usage_perc": "KV-cache usage, 1 = all pages in use (evictable cached pages free).",
    "pool_used_perc": "Pages not on the free list, cached ones included (1 = none free).",
    "prefix_cache_queries": "Tokens queried from the prefix cache.",
    "prefix_cache_hits": "Tokens served by the prefix cache.",
    "cached_tokens": "Tokens cached.",
    "evictable_tokens": "Cached tokens no lock protects.",
    "protected_tokens": "Cached tokens on locked paths.",
    "cache_nodes": "Radix tree nodes holding tokens.",
    "free_pages": "Pages on the allocator's free list.",
    "num_pages": "Usable pages of the allocator.",
    "kv_events_recorded": "KV events the cache recorded.",
    "blocks_stored": "Pages announced as stored by KV events.",
    "evicted_blocks": "Pages evicted (announced as removed by KV events).",
    "kv_event_overflows": "Pending KV-event buffers replaced by a snapshot.",
    "kv_events_published": "KV events published.",
    "kv_event_batches_published": "KV event batches published.",
    "kv_event_batches_dropped": "KV event batches dropped (queue full).",
    "kv_event_replays": "Replay requests served.",
}


def kv_cache_usage(cache: Any) -> float:
    """The ``kv_cache_usage_perc`` gauge (vLLM's) of ``cache``'s device pool: used / usable pages.

    The one definition of the gauge (:func:`cache_metrics` and ``HostTier.metrics`` both report
    it). vLLM counts a cached block no request references as free, since it is reused on demand;
    here the pages of evictable tree nodes (``evictable_size // page_size``: unlocked, unpinned)
    count as free with the allocator's free list, and the pages of locked or pinned paths and
    those requests hold count as used. A page a request holds on an unlocked path is counted
    free (the cache cannot tell it apart), hence the clamp at 0.

    Parameters
    ----------
    cache : RadixCache
        Any cache (with or without a host tier: host pages are not the device pool's).

    Returns
    -------
    float
        In 0..1 (an allocator has at least one usable page).
    """
    a = cache.allocator
    free = a.num_free + cache.evictable_size // cache.page_size
    return max(0.0, 1.0 - free / a.num_pages)


def cache_metrics(cache: Any, publisher: Any = None) -> dict[str, float]:
    """The metrics of ``cache`` (and ``publisher``) as a flat dict (see the module's table).

    Parameters
    ----------
    cache : RadixCache
        Any cache; the event counters appear only with ``kv_events=True``.
    publisher : EventPublisher, optional
        Adds the publisher's counters.

    Returns
    -------
    dict of str to float
        Gauges and counters; fractions in 0..1, sizes in tokens or pages.
    """
    a = cache.allocator
    pages, free = a.num_pages, a.num_free
    evictable = cache.evictable_size
    hits, misses = cache.hit_tokens, cache.miss_tokens
    m: dict[str, float] = {
        "kv_cache_usage_perc": kv_cache_usage(cache),
        "pool_used_perc": 1.0 - free / pages,
        "prefix_cache_queries": hits + misses,
        "prefix_cache_hits": hits,
        "cached_tokens": cache.total_size,
        "evictable_tokens": evictable,
        "protected_tokens": cache.protected_size,
        "cache_nodes": cache.num_nodes,
        "free_pages": free,
        "num_pages": pages,
    }
    if cache.kv_events:
        n = cache.kv_event_counts()
        m["kv_events_recorded"] = n["events"]
        m["blocks_stored"] = n["blocks_stored"]
        m["evicted_blocks"] = n["blocks_removed"]
        m["kv_event_overflows"] = n["overflows"]
    if publisher is not None:
        s = publisher.stats()
        m["kv_events_published"] = s["events_published"]
        m["kv_event_batches_published"] = s["batches_published"]
        m["kv_event_batches_dropped"] = s["batches_dropped"]
        m["kv_event_replays"] = s["replays_served"]
    return m


def register_prometheus(
    cache: Any,
    publisher: Any = None,
    *,
    registry: Any = None,
    namespace: str = "kvpool",
    labels: dict[str, str] | None = None,
) -> Any:
    """Exports :func:`cache_metrics` through ``prometheus_client``, read at every scrape.

    Metric names are ``<namespace>:<key>`` as vLLM's are ``vllm:<key>`` (counters get
    prometheus_client's ``_total`` suffix in the exposition, as vLLM's do).

    Parameters
    ----------
    cache, publisher
        As for :func:`cache_metrics`.
    registry : prometheus_client.CollectorRegistry, optional
        Default: prometheus_client's global ``REGISTRY``.
    namespace : str
        The name prefix.
    labels : dict of str to str, optional
        Constant labels on every metric (e.g. ``{"engine": "0"}``).

    Returns
    -------
    object
        The registered collector (``registry.unregister(collector)`` removes it).

    Raises
    ------
    ImportError
        prometheus_client missing (``pip install 'kvpool[metrics]'``).
    """
    try:
        from prometheus_client import REGISTRY
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    except ImportError as e:
        raise missing("prometheus_client", "metrics", "kvpool.metrics.register_prometheus") from e
    names = sorted((labels or {}).keys())
    values = [labels[k] for k in names] if labels else []

    class _Collector:
        def collect(self) -> Any:
            for key, v in cache_metrics(cache, publisher).items():
                kind = CounterMetricFamily if key in COUNTERS else GaugeMetricFamily
                fam = kind(f"{namespace}:{key}", _HELP.get(key, key), labels=names)
                fam.add_metric(values, float(v))
                yield fam

    collector = _Collector()
    (registry if registry is not None else REGISTRY).register(collector)
    return collector
