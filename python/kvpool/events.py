"""KV events for KV-aware routers: a ``RadixCache``'s changes published as vLLM's ZMQ stream.

A cache built with ``RadixCache(allocator, kv_events=True, hash_seed=SEED)`` records, in the
call that changes the tree, which pages it stored and dropped (``cache.take_kv_events()``).
:class:`EventPublisher` sends them the way vLLM's ``ZmqEventPublisher`` does, so routers that
consume vLLM's stream (llm-d's kv-cache indexer, NVIDIA Dynamo's KV router, vLLM's router)
can place requests on the instance that holds their prefix.

Wire format. Source: vLLM's event classes and ``ZmqEventPublisher`` in
vllm/distributed/kv_events.py, read at two commits of vllm-project/vllm (no code taken): field
names and order, the map form and the replay protocol at main's 0181ea3,

https://github.com/vllm-project/vllm/blob/0181ea3173e53eea8cf04a86891488e3dc89bb34/vllm/distributed/kv_events.py

and the positional (array) layout as it was before vLLM's PR #42892, at b4e69e0:

https://github.com/vllm-project/vllm/blob/b4e69e0af33f4698e157a262cc787fe61983cd3d/vllm/distributed/kv_events.py

- A PUB socket sends each batch as three frames: the topic (UTF-8), the sequence number (8 bytes,
  big-endian, from 0) and the msgpack payload ``[ts, [event, ...], data_parallel_rank]`` (a
  float64 UNIX time, the events, an int).
- ``event_format="array"`` (the default): each event is a tagged msgpack array, msgspec's
  ``array_like=True, tag=True`` encoding that vLLM used up to v0.23 and that every router
  version decodes: ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
  lora_id, medium, lora_name(, extra_keys)]``, ``["BlockRemoved", block_hashes, medium]``,
  ``["AllBlocksCleared"]``. ``extra_keys`` is a trailing default field: omitted when None, as
  msgspec's ``omit_defaults`` does.
- ``event_format="map"``: each event is a tagged map, the form vLLM publishes since its PR
  #42892 removed ``array_like`` from the event structs: ``{"type": "BlockStored",
  "block_hashes": ..., "parent_block_hash": ..., "token_ids": ..., "block_size": ...,
  "lora_id": ..., "medium": ..., "lora_name": ...(, "extra_keys": ...)}``, and so on.
- Block hashes are kvpool's chained page hashes (``kvpool.page_hashes``: XXH3-64 under the
  cache's ``hash_seed``), unsigned 64-bit ints; ``parent_block_hash`` is None for a namespace's
  first page. ``lora_id`` and ``lora_name`` are None: a namespace is the caller's key, carried in
  ``extra_keys`` (one entry per block, vLLM's meaning): on a namespace's first page the tuple
  ``(namespace_bytes,)``, the canonical bytes the chain's root hash is computed from; None on
  every other page; no ``extra_keys`` at all for the default namespace. ``medium`` is ``"GPU"``,
  ``"CPU"`` for pages on a host-memory tier (a demotion: removed on GPU, stored on CPU).
- Replay: a ROUTER socket on ``replay_endpoint``; a client (DEALER, or REQ for one reply) sends
  ``[b"", start_seq as 8 bytes big-endian]`` and receives, per buffered batch with a sequence
  number >= start, ``[b"", seq, payload]``, then ``[b"", (-1 as 8 bytes big-endian signed), b""]``.
  Its send high-water mark holds a whole buffer; a client that cannot take it gets a replay cut
  short (no end marker: it asks again), never a stalled stream.

The publisher never blocks the caller: ``publish`` only enqueues (a bounded queue; a full one
drops the batch and marks the stream for a resync), a background thread encodes and sends with
non-blocking sends on a PUB socket whose high-water mark drops messages for a slow subscriber.
"""

from __future__ import annotations

import logging
import queue
import struct
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

from kvpool._core import KvEventBatch
from kvpool._deps import require

__all__ = [
    "END_SEQ",
    "EVENT_FORMATS",
    "EventPublisher",
    "decode_payload",
    "encode_batch",
    "wire_event",
]

log = logging.getLogger("kvpool.events")

EVENT_FORMATS = ("array", "map")
"""The event encodings: ``array`` (tagged arrays, vLLM <= v0.23) and ``map`` (tagged maps)."""

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The sequence frame that ends a replay."""

_STORED = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
           "lora_name", "extra_keys")
_REMOVED = ("block_hashes", "medium")
_FIELDS = {"BlockStored": _STORED, "BlockRemoved": _REMOVED, "AllBlocksCleared": ()}


def _msgspec() -> Any:
    return require("msgspec.msgpack", "events", "kvpool.events", package="msgspec")


def _zmq() -> Any:
    return require("zmq", "events", "kvpool.events.EventPublisher", package="pyzmq")


def _check_format(event_format: str) -> None:
    if event_format not in EVENT_FORMATS:
        raise ValueError(f"`event_format` must be one of {EVENT_FORMATS}, got {event_format!r}")


def wire_event(event: Sequence[Any], event_format: str = "array") -> list[Any] | dict[str, Any]:
    """One event of ``RadixCache.take_kv_events()`` as vLLM's wire structure (before msgpack).

    Parameters
    ----------
    event : tuple
        ``("BlockStored", block_hashes, parent_block_hash, token_ids, block_size, medium,
        namespace)``, ``("BlockRemoved", block_hashes, medium)`` or ``("AllBlocksCleared",)``.
    event_format : {"array", "map"}
        Tagged array (vLLM <= v0.23) or tagged map (``"type"`` key).

    Returns
    -------
    list or dict
        The fields in vLLM's order (see the module docstring).

    Raises
    ------
    ValueError
        An unknown event type or format, or a tuple of the wrong length.
    """
    _check_format(event_format)
    kind = event[0] if len(event) else None
    if kind == "BlockStored" and len(event) == 7:
        _, hashes, parent, tokens, block_size, medium, ns = event
        fields: list[Any] = [hashes, parent, tokens, block_size, None, medium, None]
        if ns is not None:
            fields.append([(ns,)] + [None] * (len(hashes) - 1))
    elif kind == "BlockRemoved" and len(event) == 3:
        fields = [event[1], event[2]]
    elif kind == "AllBlocksCleared" and len(event) == 1:
        fields = []
    else:
        raise ValueError(f"not a kvpool KV event: {tuple(event)!r:.200}")
    if event_format == "array":
        return [kind, *fields]
    return {"type": kind, **dict(zip(_FIELDS[kind], fields, strict=False))}


def encode_batch(
    events: Iterable[Sequence[Any]],
    *,
    ts: float | None = None,
    data_parallel_rank: int = 0,
    event_format: str = "array",
) -> bytes:
    """The msgpack payload ``[ts, [events...], data_parallel_rank]`` of one batch.

    Parameters
    ----------
    events : iterable of tuple
        Events as ``RadixCache.take_kv_events()`` returns them.
    ts : float, optional
        UNIX time in seconds (float64 on the wire); default now.
    data_parallel_rank : int
        The rank announced with the batch.
    event_format : {"array", "map"}
        See :func:`wire_event`.

    Returns
    -------
    bytes
        The third frame of a published batch.
    """
    enc = _msgspec()
    wire = [wire_event(e, event_format) for e in events]
    return enc.encode([time.time() if ts is None else float(ts), wire, int(data_parallel_rank)])


def decode_payload(payload: bytes) -> tuple[float, list[dict[str, Any]], int | None]:
    """A batch payload (either event format) as ``(ts, events, data_parallel_rank)``.

    Each event becomes a dict with a ``"type"`` key and vLLM's field names (absent trailing
    fields absent), whichever format it came in: a convenience for Python subscribers.

    Raises
    ------
    ValueError
        The payload is not a batch of known events.
    """
    obj = _msgspec().decode(payload)
    if not isinstance(obj, list) or len(obj) not in (2, 3) or not isinstance(obj[1], list):
        raise ValueError("not a KV event batch: expected [ts, [events...], data_parallel_rank]")
    out = []
    for e in obj[1]:
        if isinstance(e, dict) and e.get("type") in _FIELDS:
            out.append(dict(e))
        elif isinstance(e, list) and e and e[0] in _FIELDS:
            out.append({"type": e[0], **dict(zip(_FIELDS[e[0]], e[1:], strict=False))})
        else:
            raise ValueError(f"unknown KV event {e!r:.200}")
    return float(obj[0]), out, (obj[2] if len(obj) == 3 else None)


def _binds(endpoint: str) -> bool:
    # vLLM's convention: a wildcard address, ipc:// and inproc:// bind; a host address connects.
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class EventPublisher:
    """Publishes KV events as vLLM's ZMQ stream: PUB frames, a replay ROUTER, a bounded buffer.

    Parameters
    ----------
    endpoint : str
        PUB address, e.g. ``"tcp://*:5557"`` (a wildcard, ``ipc://`` or ``inproc://`` address
        binds; a host address such as ``"tcp://10.0.0.2:5557"`` connects to a subscriber that
        binds, as vLLM does). ``"tcp://*:*"`` binds a free port (see :attr:`endpoint`).
    replay_endpoint : str, optional
        ROUTER address (always bound) that replays buffered batches from a sequence number.
    topic : str
        The first frame of every batch.
    data_parallel_rank : int
        Announced in every batch.
    buffer_steps : int
        Batches kept for replay (the oldest go first).
    hwm : int
        ZMQ send high-water mark of the PUB socket: a subscriber that falls this many messages
        behind loses messages (sequence numbers show the gap; replay or resync recovers).
    max_queue : int
        Batches waiting for the sending thread; beyond, ``publish`` drops the batch, returns
        False and sets :attr:`needs_resync`.
    event_format : {"array", "map"}
        Tagged arrays (vLLM <= v0.23, the default) or tagged maps (vLLM since PR #42892).
    cache : RadixCache, optional
        The cache whose events are published: ``publish()`` with no argument takes them, and a
        pending resync is sent automatically on the next ``publish``.
    bind : bool, optional
        Force binding (True) or connecting (False) the PUB socket instead of the convention.
    context : zmq.Context, optional
        Default ``zmq.Context.instance()``.

    Raises
    ------
    ValueError
        A bad ``event_format`` or a negative size.
    zmq.ZMQError
        An address that cannot be bound or connected.
    ImportError
        pyzmq or msgspec missing (``pip install 'kvpool[events]'``).

    Examples
    --------
    >>> import numpy as np, kvpool
    >>> from kvpool.events import EventPublisher
    >>> a = kvpool.PageAllocator(16, 2)
    >>> cache = kvpool.RadixCache(a, kv_events=True, hash_seed=1)
    >>> with EventPublisher("inproc://doc-events", cache=cache) as pub:
    ...     p = cache.alloc(2)
    ...     _ = cache.insert(np.array([1, 2, 3, 4], dtype=np.int32), p)
    ...     pub.publish()  # takes cache.take_kv_events(), enqueues one batch
    True
    """

    def __init__(
        self,
        endpoint: str = "tcp://*:5557",
        replay_endpoint: str | None = None,
        *,
        topic: str = "kv-events",
        data_parallel_rank: int = 0,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        max_queue: int = 10_000,
        event_format: str = "array",
        cache: Any = None,
        bind: bool | None = None,
        context: Any = None,
    ) -> None:
        _check_format(event_format)
        for name, v in (("buffer_steps", buffer_steps), ("hwm", hwm), ("max_queue", max_queue)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"`{name}` must be a positive int, got {v!r}")
        zmq = _zmq()
        self._enc = _msgspec()
        self._zmq = zmq
        self.topic = topic
        self.data_parallel_rank = int(data_parallel_rank)
        self.event_format = event_format
        self.cache = cache
        self._topic = topic.encode("utf-8")
        self._queue: queue.Queue[tuple[float, Any] | None] = queue.Queue(max_queue)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        self._needs_resync = False
        self._closed = False
        self._lock = threading.Lock()
        self.counts = dict.fromkeys(
            ("batches_published", "events_published", "blocks_stored", "blocks_removed",
             "batches_dropped", "replays_served", "send_errors"), 0)
        ctx = context or zmq.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._replay = None
        try:
            self._pub.setsockopt(zmq.SNDHWM, hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            if _binds(endpoint) if bind is None else bind:
                self._pub.bind(endpoint)
                self.endpoint = self._pub.getsockopt(zmq.LAST_ENDPOINT).decode()
            else:
                self._pub.connect(endpoint)
                self.endpoint = endpoint
            self.replay_endpoint = None
            if replay_endpoint is not None:
                self._replay = ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                # a whole buffer fits one replay; a full or gone client raises instead of
                # losing messages silently (then that replay is cut short, never the stream)
                self._replay.setsockopt(zmq.SNDHWM, buffer_steps + 2)
                self._replay.setsockopt(zmq.ROUTER_MANDATORY, 1)
                self._replay.bind(replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt(zmq.LAST_ENDPOINT).decode()
        except BaseException:
            self._pub.close(0)
            if self._replay is not None:
                self._replay.close(0)
            raise
        self._thread = threading.Thread(target=self._run, name="kvpool-events", daemon=True)
        self._thread.start()

    # --- the caller's side (never blocks) ---

    @property
    def needs_resync(self) -> bool:
        """A batch was dropped (queue full): subscribers' view is stale until :meth:`resync`."""
        return self._needs_resync

    def publish(self, events: Sequence[Any] | None = None, *, ts: float | None = None) -> bool:
        """Enqueues one batch; returns at once.

        Parameters
        ----------
        events : list of tuple or KvEventBatch, optional
            ``cache.take_kv_events()`` (tuples), or ``cache.take_kv_events_batch()`` (held in
            Rust: the sending thread encodes it with the GIL released). Default: a batch taken
            from the ``cache`` given at construction. No events publish nothing.
        ts : float, optional
            The batch's UNIX time; default now.

        Returns
        -------
        bool
            False when the queue was full and the batch was dropped (then :attr:`needs_resync`
            is set; with a ``cache`` the next ``publish`` sends a snapshot instead).

        Raises
        ------
        RuntimeError
            The publisher is closed.
        ValueError
            No events and no ``cache``.
        """
        if self._closed:
            raise RuntimeError("EventPublisher is closed")
        if self._needs_resync and self.cache is not None:
            return self.resync()
        if events is None:
            if self.cache is None:
                raise ValueError("publish() without events needs the `cache` of the publisher")
            events = self.cache.take_kv_events_batch()
        if isinstance(events, KvEventBatch):
            return len(events) == 0 or self._put(events, ts)
        if not events:
            return True
        return self._put(list(events), ts)

    def resync(self, cache: Any = None) -> bool:
        """Publishes a full snapshot: ``AllBlocksCleared``, then every cached page.

        The snapshot is ``cache.kv_events_snapshot()`` (every page as ``BlockStored``), which
        drops the cache's pending events.

        Parameters
        ----------
        cache : RadixCache, optional
            Default: the publisher's ``cache``.

        Returns
        -------
        bool
            False when the queue was full (the resync stays pending).

        Raises
        ------
        ValueError
            No cache to snapshot.
        """
        cache = cache if cache is not None else self.cache
        if cache is None:
            raise ValueError("resync() needs a cache (none given to the publisher)")
        self._needs_resync = False
        return self._put(cache.take_kv_events_batch(snapshot=True), None)

    def _put(self, events: Any, ts: float | None) -> bool:
        try:
            self._queue.put_nowait((time.time() if ts is None else float(ts), events))
            return True
        except queue.Full:
            self._needs_resync = True
            self.counts["batches_dropped"] += 1
            log.warning("kvpool.events: queue full, batch of %d events dropped", len(events))
            return False

    def flush(self, timeout: float = 5.0) -> bool:
        """Waits until every enqueued batch was sent; False on timeout."""
        end = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < end:
            time.sleep(0.001)
        return not self._queue.unfinished_tasks

    def close(self, timeout: float = 1.0) -> None:
        """Sends what is queued (up to ``timeout`` s), stops the thread, closes the sockets."""
        if self._closed:
            return
        self._closed = True
        self.flush(timeout)
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._pub.close(0)
            if self._replay is not None:
                self._replay.close(0)

    def __enter__(self) -> EventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> dict[str, int]:
        """Counters: batches published and dropped, events and blocks sent, replays served."""
        return {**self.counts, "next_seq": self._seq, "buffered_batches": len(self._buffer)}

    # --- the sending thread ---

    def _run(self) -> None:
        while True:
            if self._replay is not None:
                self._serve_replays()
            try:
                item = self._queue.get(timeout=0.01)
            except queue.Empty:
                continue
            try:
                if item is None:
                    return
                self._send(*item)
            except Exception:  # keep the stream alive; the counter shows it
                self.counts["send_errors"] += 1
                log.exception("kvpool.events: sending a batch failed")
            finally:
                self._queue.task_done()

    def _send(self, ts: float, events: Any) -> None:
        c = self.counts
        if isinstance(events, KvEventBatch):  # encoded in Rust (GIL released), spliced in
            payload = b"".join((b"\x93\xcb", struct.pack(">d", ts),
                                events.encode(self.event_format),
                                self._enc.encode(self.data_parallel_rank)))
            n, stored, removed = len(events), events.blocks_stored, events.blocks_removed
        else:
            wire = [wire_event(e, self.event_format) for e in events]
            payload = self._enc.encode([ts, wire, self.data_parallel_rank])
            n = len(events)
            stored = sum(len(e[1]) for e in events if e[0] == "BlockStored")
            removed = sum(len(e[1]) for e in events if e[0] == "BlockRemoved")
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, payload))
        try:
            # PUB never blocks: at the high-water mark ZMQ drops the message for that subscriber.
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload),
                                     flags=self._zmq.NOBLOCK)
        except self._zmq.Again:
            pass
        c["batches_published"] += 1
        c["events_published"] += n
        c["blocks_stored"] += stored
        c["blocks_removed"] += removed

    def _serve_replays(self) -> None:
        zmq, sock = self._zmq, self._replay
        assert sock is not None
        while sock.poll(0):
            frames = sock.recv_multipart()
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                log.warning("kvpool.events: bad replay request (%d frames) ignored", len(frames))
                continue
            ident, start = frames[0], int.from_bytes(frames[2], "big", signed=True)
            # (counted before the END frame goes out: a client that reads stats() after END sees it)
            self.counts["replays_served"] += 1
            try:
                for seq, payload in list(self._buffer):
                    if seq >= start:
                        sock.send_multipart((ident, b"", seq.to_bytes(8, "big"), payload),
                                            flags=zmq.NOBLOCK, copy=False)
                sock.send_multipart((ident, b"", END_SEQ, b""), flags=zmq.NOBLOCK)
            except zmq.ZMQError as e:  # EAGAIN: too slow; EHOSTUNREACH: gone
                log.warning("kvpool.events: replay cut short (%s)", e)
