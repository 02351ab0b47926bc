"""KV events: golden bytes, a real ZMQ subscriber and replay client, resync, bad input, metrics.

The golden payloads are written byte by byte from the msgpack specification and the field order
of vLLM's event classes (vllm/distributed/kv_events.py of vllm-project/vllm: main at 0181ea3 for
the field names, b4e69e0 for the positional layout), not produced by kvpool's encoder. Page
hashes are recomputed with the `xxhash` package from the definition in rust/src/hash.rs.
"""

import struct
import threading
import time

import msgpack
import msgspec
import numpy as np
import pytest
import xxhash
import zmq

import kvpool
from kvpool.events import END_SEQ, EventPublisher, decode_payload, encode_batch, wire_event
from kvpool.metrics import cache_metrics, register_prometheus

SEED = 1234
NS_NONE = b"N" + bytes(8)  # the default namespace's canonical bytes (tag, u64 length 0)


def ns_str(s: str) -> bytes:
    return b"S" + struct.pack("<Q", len(s.encode())) + s.encode()


def ref_hashes(tokens, ps, seed=SEED, ns=NS_NONE, parent=None):
    """kvpool's chained page hashes, from the definition (xxhash package)."""
    prev = parent
    if prev is None:
        prev = xxhash.xxh3_64_intdigest(b"kvpool.page_hash.v1" + ns, seed=seed)
    out = []
    for i in range(len(tokens) // ps):
        page = struct.pack(f"<Q{ps}i", prev, *tokens[i * ps : (i + 1) * ps])
        prev = xxhash.xxh3_64_intdigest(page, seed=seed)
        out.append(prev)
    return out


# --- msgpack by hand (the specification's formats, nothing else) ---


def fixstr(s: str) -> bytes:
    b = s.encode()
    assert len(b) < 32
    return bytes([0xA0 | len(b)]) + b


def u64(v: int) -> bytes:
    assert 2**32 <= v < 2**64  # hashes: uint64 format 0xcf
    return b"\xcf" + v.to_bytes(8, "big")


def fixarray(n: int) -> bytes:
    return bytes([0x90 | n])


def fixmap(n: int) -> bytes:
    return bytes([0x80 | n])


NIL = b"\xc0"
TS = 1.5
TS_BYTES = b"\xcb" + struct.pack(">d", TS)  # float64


def cache_with(ps=2, pages=32, seed=SEED):
    a = kvpool.PageAllocator(pages, ps)
    return a, kvpool.RadixCache(a, kv_events=True, hash_seed=seed)


def insert(a, c, tokens, namespace=None):
    t = np.asarray(tokens, dtype=np.int32)
    p = c.alloc(len(t) // c.page_size)
    c.insert(t, p, namespace)
    a.free(p)


class Sub:
    """A real subscriber: SUB for the stream, DEALER for replay."""

    def __init__(self, pub: EventPublisher, topic=b"kv-events"):
        ctx = zmq.Context.instance()
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.connect(pub.endpoint.replace("0.0.0.0", "127.0.0.1"))
        self.dealer = None
        if pub.replay_endpoint:
            self.dealer = ctx.socket(zmq.DEALER)
            self.dealer.setsockopt(zmq.LINGER, 0)
            self.dealer.connect(pub.replay_endpoint)

    def wait_connected(self, pub, cache):
        # PUB drops messages until the subscription arrives: publish a probe until one lands.
        for _ in range(200):
            pub.publish([("AllBlocksCleared",)])
            pub.flush()
            if self.sub.poll(20):
                while self.sub.poll(50):
                    self.sub.recv_multipart()
                return
        raise AssertionError("subscriber never connected")

    def recv(self, timeout_ms=2000):
        assert self.sub.poll(timeout_ms), "no batch arrived"
        return self.sub.recv_multipart()

    def replay(self, start: int, timeout_ms=2000):
        self.dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            assert self.dealer.poll(timeout_ms), "replay did not end"
            frames = self.dealer.recv_multipart()
            assert frames[0] == b""
            if frames[1] == END_SEQ:
                assert frames[2] == b""
                return out
            out.append((int.from_bytes(frames[1], "big"), frames[2]))

    def close(self):
        self.sub.close(0)
        if self.dealer is not None:
            self.dealer.close(0)


@pytest.fixture
def pub_sub():
    a, c = cache_with()
    pub = EventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", cache=c, bind=True)
    sub = Sub(pub)
    sub.wait_connected(pub, c)
    yield a, c, pub, sub
    sub.close()
    pub.close()


# --- msgspec structs of the subscriber side (vLLM's field order, written for the test) ---


class Ev(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    pass


class BlockStored(Ev):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[bytes, ...] | None] | None = None


class BlockRemoved(Ev):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(Ev):
    pass


class Batch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


def test_golden_frames_array_format(pub_sub):
    a, c, pub, sub = pub_sub
    seq0 = pub.stats()["next_seq"]
    insert(a, c, [1, 2, 3, 4, 5])  # two whole pages; the partial one is not cached
    h = ref_hashes([1, 2, 3, 4], 2)
    assert pub.publish(ts=TS)
    topic, seq, payload = sub.recv()
    assert topic == b"kv-events"
    assert seq == seq0.to_bytes(8, "big")
    event = (fixarray(8) + fixstr("BlockStored") + fixarray(2) + u64(h[0]) + u64(h[1]) + NIL
             + fixarray(4) + b"\x01\x02\x03\x04" + b"\x02" + NIL + fixstr("GPU") + NIL)
    assert payload == fixarray(3) + TS_BYTES + fixarray(1) + event + b"\x00"
    # independent decoders agree
    assert msgpack.unpackb(payload) == [TS, [["BlockStored", h, None, [1, 2, 3, 4], 2, None,
                                              "GPU", None]], 0]
    batch = msgspec.msgpack.decode(payload, type=Batch)
    assert batch.events == [BlockStored(h, None, [1, 2, 3, 4], 2, None, "GPU", None)]
    assert batch.data_parallel_rank == 0
    # eviction, then reset
    assert c.evict(100) == 4
    c.reset()
    assert pub.publish(ts=TS)
    _, seq, payload = sub.recv()
    assert int.from_bytes(seq, "big") == seq0 + 1
    removed = msgpack.unpackb(payload)[1][0]
    assert removed[0] == "BlockRemoved" and sorted(removed[1]) == sorted(h)
    golden = (fixarray(3) + TS_BYTES + fixarray(2) + fixarray(3) + fixstr("BlockRemoved")
              + fixarray(2) + u64(removed[1][0]) + u64(removed[1][1]) + fixstr("GPU")
              + fixarray(1) + b"\xb0AllBlocksCleared" + b"\x00")
    assert payload == golden
    assert msgspec.msgpack.decode(payload, type=Batch).events[1] == AllBlocksCleared()


def test_golden_map_format_and_namespace_extra_keys():
    a, c = cache_with(ps=1)
    insert(a, c, [7, 8], namespace="tenant")
    ns = ns_str("tenant")
    h = ref_hashes([7, 8], 1, ns=ns)
    events = c.take_kv_events()
    assert events == [("BlockStored", h, None, [7, 8], 1, "GPU", ns)]
    payload = encode_batch(events, ts=TS, data_parallel_rank=3, event_format="map")
    extra = fixarray(2) + fixarray(1) + bytes([0xC4, len(ns)]) + ns + NIL  # [(ns,), None]
    event = (fixmap(9) + fixstr("type") + fixstr("BlockStored")
             + fixstr("block_hashes") + fixarray(2) + u64(h[0]) + u64(h[1])
             + fixstr("parent_block_hash") + NIL
             + fixstr("token_ids") + fixarray(2) + b"\x07\x08"
             + fixstr("block_size") + b"\x01"
             + fixstr("lora_id") + NIL + fixstr("medium") + fixstr("GPU")
             + fixstr("lora_name") + NIL + fixstr("extra_keys") + extra)
    assert payload == fixarray(3) + TS_BYTES + fixarray(1) + event + b"\x03"
    # the array form carries the same extra keys as its 9th field
    arr = msgspec.msgpack.decode(encode_batch(events, ts=TS), type=Batch)
    assert arr.events[0].extra_keys == [(ns,), None]
    # a deeper page of the namespace chains from its parent and carries no namespace
    insert(a, c, [7, 8, 9], namespace="tenant")
    ((kind, hs, parent, toks, *_rest, nsb),) = c.take_kv_events()
    assert (kind, hs, parent, toks, nsb) == ("BlockStored", ref_hashes([9], 1, parent=h[1]),
                                             h[1], [9], None)
    assert len(wire_event(("BlockStored", hs, parent, toks, 1, "GPU", None))) == 8
    ts, evs, rank = decode_payload(payload)
    assert (ts, rank, evs[0]["extra_keys"]) == (TS, 3, [[ns], None])


def test_replay_from_a_sequence_number(pub_sub):
    a, c, pub, sub = pub_sub
    first = pub.stats()["next_seq"]
    for i in range(3):
        insert(a, c, [10 + i, 20 + i])
        pub.publish(ts=TS)
    pub.flush()
    live = [sub.recv() for _ in range(3)]
    got = sub.replay(first + 1)
    assert [s for s, _ in got] == [first + 1, first + 2]
    assert [p for _, p in got] == [f[2] for f in live[1:]]
    assert sub.replay(first + 100) == []
    # a malformed request is ignored; the next good one is served
    sub.dealer.send_multipart([b"", b"\x01"])
    assert [s for s, _ in sub.replay(first + 2)] == [first + 2]
    assert pub.stats()["replays_served"] == 2 + 1


def test_slow_subscriber_never_blocks_the_publisher():
    a, c = cache_with(ps=1, pages=4096)
    pub = EventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", hwm=8, buffer_steps=100_000,
                         bind=True)
    sub = Sub(pub)
    sub.sub.setsockopt(zmq.RCVHWM, 4)
    sub.wait_connected(pub, c)
    start = pub.stats()["next_seq"]
    n = 3000
    t0 = time.perf_counter()
    for i in range(n):
        insert(a, c, [i, i + 1])
        assert pub.publish(c.take_kv_events())
    spent = time.perf_counter() - t0
    assert pub.flush(30)
    assert spent < 30  # never waited for the subscriber, which reads nothing meanwhile
    seqs = []
    while sub.sub.poll(200):
        seqs.append(int.from_bytes(sub.recv()[1], "big"))
    assert len(seqs) < n  # the high-water marks dropped messages for the slow subscriber
    assert seqs == sorted(seqs)
    missed = sorted(set(range(start, start + n)) - set(seqs))
    # every missed batch can be replayed
    replayed = dict(sub.replay(missed[0]))
    assert set(missed) <= set(replayed)
    sub.close()
    pub.close()


def test_full_queue_drops_then_resyncs():
    a, c = cache_with(ps=1, pages=64)
    pub = EventPublisher("inproc://kv-resync", cache=c, max_queue=1)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect("inproc://kv-resync")
    insert(a, c, [1, 2, 3])
    events = c.take_kv_events()
    dropped = False
    for _ in range(100_000):
        if not pub.publish(events):
            dropped = True
            break
    assert dropped and pub.needs_resync
    pub.flush()
    while sub.poll(50):
        sub.recv_multipart()
    insert(a, c, [9])
    assert pub.publish()  # a snapshot instead of the pending events
    assert not pub.needs_resync
    pub.flush()
    payload = sub.recv_multipart()[2]
    evs = decode_payload(payload)[1]
    assert evs[0]["type"] == "AllBlocksCleared"
    stored = {h for e in evs[1:] for h in e["block_hashes"]}
    assert stored == set(ref_hashes([1, 2, 3], 1)) | set(ref_hashes([9], 1))
    assert c.take_kv_events() == []  # the snapshot superseded them
    sub.close(0)
    pub.close()


def test_publish_never_waits_on_the_rust_lock_or_the_thread():
    # publish from several threads at once while the cache changes: every batch is sent, in
    # sequence order, and the event stream replays to the tree's state
    a, c = cache_with(ps=1, pages=4096)
    pub = EventPublisher("inproc://kv-threads", cache=c)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect("inproc://kv-threads")
    lock = threading.Lock()

    def work(k):
        for i in range(200):
            with lock:  # the tree and its event order: one writer at a time
                insert(a, c, [k, i])
                pub.publish()

    ts = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert pub.flush()
    seqs, stored = [], set()
    while sub.poll(100):
        _, seq, payload = sub.recv_multipart()
        seqs.append(int.from_bytes(seq, "big"))
        for e in decode_payload(payload)[1]:
            stored |= set(e["block_hashes"])
    assert seqs == list(range(len(seqs))) and len(seqs) == 800
    # What the threads inserted (no eviction: 804 pages of 4096), not what the tree reports.
    want = {h for k in range(4) for i in range(200) for h in ref_hashes([k, i], 1)}
    assert len(want) == 804 and stored == want
    assert want == {h for t, _ in c.leaf_paths() for h in ref_hashes(t.tolist(), 1)}
    sub.close(0)
    pub.close()


def test_snapshot_and_events_off():
    a, c = cache_with(ps=2)
    insert(a, c, [1, 2, 3, 4])
    insert(a, c, [1, 2, 5, 6], namespace=("lora", 1))
    c.take_kv_events()
    snap = c.kv_events_snapshot()
    assert snap[0] == ("AllBlocksCleared",)
    assert {h for e in snap[1:] for h in e[1]} == set(ref_hashes([1, 2, 3, 4], 2)) | set(
        ref_hashes([1, 2, 5, 6], 2, ns=b"T" + struct.pack("<QQ", 8, 2) + b"S"
                   + struct.pack("<Q", 4) + b"lora" + b"I" + struct.pack("<Q", 1) + b"\x01"))
    a2 = kvpool.PageAllocator(8, 2)
    off = kvpool.RadixCache(a2)
    insert(a2, off, [1, 2])
    assert off.take_kv_events() == [] and off.kv_events_snapshot() == []
    assert not off.kv_events and off.hash_seed is None
    assert off.kv_event_counts() == dict.fromkeys(
        ("events", "blocks_stored", "blocks_removed", "overflows"), 0)
    assert c.kv_events and c.hash_seed == SEED


def test_hash_seed_changes_every_hash():
    a, c = cache_with(ps=1, seed=0)
    a2, c2 = cache_with(ps=1, seed=2**64 - 1)
    insert(a, c, [1, 2])
    insert(a2, c2, [1, 2])
    h1, h2 = c.take_kv_events()[0][1], c2.take_kv_events()[0][1]
    assert h1 == ref_hashes([1, 2], 1, seed=0) and h2 == ref_hashes([1, 2], 1, seed=2**64 - 1)
    assert not set(h1) & set(h2)


def test_hybrid_cache_events_for_the_full_space():
    full = kvpool.PageAllocator(32, 2)
    sw = kvpool.PageAllocator(32, 2)
    c = kvpool.RadixCache(full, sliding=[(sw, 4)], kv_events=True, hash_seed=SEED)
    t = np.arange(1, 9, dtype=np.int32)
    p, s = c.alloc(4), c.alloc_sliding(0, 4)
    c.insert(t, p, sliding_pages=[s])
    full.free(p)
    sw.free(s)
    ((kind, hs, *_),) = c.take_kv_events()
    assert kind == "BlockStored" and hs == ref_hashes(t.tolist(), 2)
    c.match_prefix_groups(t[:6])  # may split: no event
    assert c.take_kv_events() == []
    c.evict(100)
    ((kind, removed, medium),) = c.take_kv_events()
    assert (kind, sorted(removed), medium) == ("BlockRemoved", sorted(hs), "GPU")
    c.check_invariants()


@pytest.mark.parametrize("seed", [-1, 2**64, "1", 1.0, True])
def test_bad_hash_seed(seed):
    a = kvpool.PageAllocator(8, 2)
    with pytest.raises(ValueError, match="hash_seed"):
        kvpool.RadixCache(a, kv_events=True, hash_seed=seed)


def test_bad_input():
    a = kvpool.PageAllocator(8, 2)
    with pytest.raises(kvpool.InvalidArgumentError, match="hash_seed.*kv_events"):
        kvpool.RadixCache(a, hash_seed=1)
    with pytest.raises(TypeError):
        kvpool.RadixCache(a, kv_events="yes")
    with pytest.raises(ValueError, match="event_format"):
        EventPublisher("inproc://bad-1", event_format="json")
    with pytest.raises(ValueError, match="buffer_steps"):
        EventPublisher("inproc://bad-2", buffer_steps=0)
    with pytest.raises(zmq.ZMQError):
        EventPublisher("tcp://*:not-a-port")
    with pytest.raises(ValueError, match="not a kvpool KV event"):
        wire_event(("BlockStored", [1]))
    with pytest.raises(ValueError, match="not a kvpool KV event"):
        wire_event(("Evicted", [1], "GPU"))
    with pytest.raises(ValueError, match="not a KV event batch"):
        decode_payload(msgpack.packb({"ts": 1}))
    with pytest.raises(ValueError, match="unknown KV event"):
        decode_payload(msgpack.packb([1.0, [["Stored", 1]], 0]))
    pub = EventPublisher("inproc://bad-3")
    with pytest.raises(ValueError, match="cache"):
        pub.publish()
    with pytest.raises(ValueError, match="cache"):
        pub.resync()
    pub.close()
    with pytest.raises(RuntimeError, match="closed"):
        pub.publish([("AllBlocksCleared",)])


def test_metrics_dict_and_prometheus():
    from prometheus_client import CollectorRegistry, generate_latest

    a, c = cache_with(ps=2, pages=8)
    insert(a, c, [1, 2, 3, 4])  # 2 pages cached, evictable
    m = c.match_prefix(np.array([1, 2, 3, 4, 5], dtype=np.int32))
    c.lock(m[1])
    p = c.alloc(2)  # held by a request
    pub = EventPublisher("inproc://metrics", cache=c)
    pub.publish()
    pub.flush()
    got = cache_metrics(c, pub)
    assert got["prefix_cache_queries"] == 5 and got["prefix_cache_hits"] == 4
    assert got["kv_cache_usage_perc"] == pytest.approx(4 / 8)  # 2 locked + 2 held
    assert got["pool_used_perc"] == pytest.approx(4 / 8)
    assert (got["cached_tokens"], got["protected_tokens"], got["evictable_tokens"]) == (4, 4, 0)
    c.unlock(m[1])
    a.free(p)
    assert cache_metrics(c)["kv_cache_usage_perc"] == 0.0  # evictable cached pages count as free
    c.evict(100)
    got = cache_metrics(c, pub)
    assert (got["blocks_stored"], got["evicted_blocks"], got["kv_event_batches_published"]) == (
        2, 2, 1)
    reg = CollectorRegistry()
    register_prometheus(c, pub, registry=reg, labels={"engine": "0"})
    text = generate_latest(reg).decode()
    assert 'kvpool:prefix_cache_hits_total{engine="0"} 4.0' in text
    assert 'kvpool:kv_cache_usage_perc{engine="0"} 0.0' in text
    assert 'kvpool:evicted_blocks_total{engine="0"} 2.0' in text
    pub.close()


@pytest.mark.parametrize("fmt", ["array", "map"])
def test_packed_in_rust_equals_the_python_encoding(fmt):
    rng = np.random.default_rng(5)
    caches = [cache_with(ps=2, pages=40) for _ in range(2)]
    for _ in range(60):  # the same operations on both caches
        toks = rng.integers(0, 4, int(rng.integers(0, 12))).tolist()
        ns = [None, "x", ("lora", 2)][int(rng.integers(3))]
        for a, c in caches:
            insert(a, c, toks, ns)
        if rng.random() < 0.2:
            for _, c in caches:
                c.evict(6)
    (_, c1), (_, c2) = caches
    tuples = c1.take_kv_events()
    batch = c2.take_kv_events_batch()
    assert len(batch) == len(tuples) > 10
    assert batch.to_list() == tuples
    assert batch.blocks_stored == sum(len(e[1]) for e in tuples if e[0] == "BlockStored")
    assert batch.blocks_removed == sum(len(e[1]) for e in tuples if e[0] == "BlockRemoved") > 0
    want = encode_batch(tuples, ts=TS, data_parallel_rank=0, event_format=fmt)
    assert fixarray(3) + TS_BYTES + batch.encode(fmt) + b"\x00" == want
    snap = encode_batch(c1.kv_events_snapshot(), ts=TS, event_format=fmt)
    got = c2.take_kv_events_batch(snapshot=True).encode(fmt)
    assert fixarray(3) + TS_BYTES + got + b"\x00" == snap
    assert repr(c2.take_kv_events_batch()) == "KvEventBatch(events=0, blocks_stored=0, blocks_removed=0)"
    with pytest.raises(kvpool.InvalidArgumentError, match="event_format"):
        batch.encode("json")
