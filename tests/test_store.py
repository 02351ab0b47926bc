"""kvpool.store / kvpool.page_io against a real redis-server on 127.0.0.1 (tests/redis_fixtures.py).

Bytes are compared against the pools' own buffers indexed here by rows (not through page_io),
stored values against values built here from the format's definition (struct, numpy, xxhash:
not the store's encoder), and values read back against the writer's dequantized values.
"""

from __future__ import annotations

import json
import logging
import struct
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("redis")
xxhash = pytest.importorskip("xxhash")

import kvpool  # noqa: E402
from kvpool.page_io import PageLayout  # noqa: E402
from kvpool.store import PageStore, connect  # noqa: E402
from redis_fixtures import free_port, serve, start_redis  # noqa: E402

redis_server = pytest.fixture(scope="session")(serve)

CONFIG = {"name": "tiny-llama", "num_hidden_layers": 3, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 64}  # fmt: skip
PS = 4
CASES = [
    ("bf16", "linear"),
    ("fp16", "linear"),
    ("fp8_e4m3", "linear"),
    ("fp8_e5m2", "linear"),
    ("nvfp4", "linear"),
    ("nvfp4", "page_major"),
    ("nvfp4", "mixed"),
    ("fp4_mx_block16", "linear"),
]
SEED = 1234


def make_pool(dtype, recipe="linear", num_tokens=64, scales=(0.5, 0.25, 2.0)):
    plan = kvpool.size_for(CONFIG, dtype, page_size=PS, num_tokens=num_tokens, nvfp4_recipe=recipe)
    pool = kvpool.KVPool(plan, device="cpu")
    for t in pool.buffers.values():  # junk everywhere, so a missed byte shows
        if t.numel() > 1:
            t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape,
                                                    dtype=torch.uint8))  # fmt: skip
    pool.set_kv_scales(list(scales), [s * 2 for s in scales], source="test")
    return pool


def write_pages(pool, pages, seed=0):
    g = torch.Generator().manual_seed(seed)
    loc = torch.tensor([p * PS + o for p in pages for o in range(PS)], dtype=torch.int64)
    for layer in pool.layers:
        view = pool.layer(layer)
        k = torch.randn(len(loc), view.num_kv_heads, view.head_dim, generator=g).bfloat16()
        v = torch.randn(len(loc), view.num_kv_heads, view.v_head_dim, generator=g).bfloat16()
        pool.write(layer, loc, k, v)
    return loc


def page_rows(pool, page):
    """Every per-page buffer's bytes of ``page``, indexed by rows/blocks here (not page_io)."""
    out = {}
    for b in pool.plan.buffers:
        if b.role in ("data", "block_scale"):
            out[b.name] = pool.buffers[b.name][page * PS : (page + 1) * PS].cpu().clone()
        elif b.role == "block_scale_page_major":
            out[b.name] = pool.buffers[b.name][page].cpu().clone()
    return out


def page_bytes(pool, page):
    """``page``'s bytes as the value format lays them out: the per-page buffers' rows in
    ``plan.buffers`` order, from the pool tensors (not page_io)."""
    rows = page_rows(pool, page).values()
    return b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in rows)


def expected_value(pool, toks, j, page, header):
    """Page ``j``'s value as store.py's docstring defines format version 1, built here with
    struct, numpy and xxhash from the pool tensors (not the store's encoder). ``header``: the
    dict the value must carry (checked by the caller)."""
    hashes = kvpool.page_hashes(toks, PS, seed=SEED)  # (pinned against xxhash by its own tests)
    prefix = xxhash.xxh3_128(seed=SEED)
    for i in range(j + 1):
        prefix.update(struct.pack("<Q", int(hashes[i])))
        prefix.update(np.asarray(toks[i * PS : (i + 1) * PS], "<i4").tobytes())
    hdr = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    scales = b"".join(
        pool.buffers[b.name].cpu().view(torch.uint8).numpy().tobytes()
        for b in pool.plan.buffers
        if b.role == "scale"
    )
    body = (
        b"KVPS"
        + struct.pack("<HI", 1, len(hdr))
        + hdr
        + np.asarray(toks[j * PS : (j + 1) * PS], "<i4").tobytes()
        + prefix.digest()
        + scales
        + page_bytes(pool, page)
    )
    return body + xxhash.xxh3_128_digest(body)


def stored_header(value):
    """The JSON header of a stored value (magic, u16 version, u32 length, then the header)."""
    magic, version, n = struct.unpack_from("<4sHI", value)
    assert (magic, version) == (b"KVPS", 1)
    return json.loads(value[10 : 10 + n])


def check_stored(store, pool, toks, pages, dtype):
    """Every stored value of ``toks`` equals the independently built one (header fields known
    here: format, version, dtype, page size, the page's bytes, the scale count, the fingerprint)."""
    n_scales = sum(b.role == "scale" for b in pool.plan.buffers)
    for j, page in enumerate(pages):
        value = store.client.get(store.key(store.hashes(toks)[j]))
        header = stored_header(value)
        assert header["format"] == "kvpool.page" and header["version"] == 1
        assert (header["dtype"], header["page_size"]) == (dtype, PS)
        assert header["page_bytes"] == len(page_bytes(pool, page))
        assert (header["scales"], header["fingerprint"]) == (n_scales, store.fingerprint)
        assert value == expected_value(pool, toks, j, page, header), f"page {j}"


def same(a, b):
    return a.keys() == b.keys() and all(
        torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a
    )


def tokens(n, offset=0):
    return (np.arange(n, dtype=np.int32) * 7 + 11 + offset) % 32000


@pytest.mark.parametrize("dtype, recipe", CASES)
def test_round_trip_is_byte_exact_for_every_kv_dtype(redis_server, dtype, recipe):
    a = make_pool(dtype, recipe)
    src_pages = [5, 2, 9, 3]
    loc = write_pages(a, src_pages)
    toks = tokens(4 * PS + 2)  # a partial last page, not stored
    prefix = f"t-{dtype}-{recipe}"
    sa = PageStore(a, redis_server.url, seed=SEED, prefix=prefix)
    assert sa.put_pages(toks, np.array(src_pages + [7])) == 4
    assert sa.stats["puts"] == 4
    assert sa.stats == {"puts": 4, "put_bytes": 4 * sa.value_bytes, "lookups": 0, "hits": 0,
                        "misses": 0, "refused": 0, "errors": 0, "skipped": 0}
    assert list(sa.stats) == ["puts", "put_bytes", "lookups", "hits", "misses", "refused",
                              "errors", "skipped"]
    check_stored(sa, a, toks, src_pages, dtype)

    # a pool of another size (same model and layout: same fingerprint), other page ids
    b = make_pool(dtype, recipe, num_tokens=96)
    before = {n: t.clone() for n, t in b.buffers.items()}
    sb = PageStore(b, redis_server.url, seed=SEED, prefix=prefix)
    assert sb.fingerprint == sa.fingerprint
    found = sb.get_prefix(toks)
    assert (found.num_pages, found.stop) == (4, "end")
    assert found.hashes.tolist() == kvpool.page_hashes(toks, PS, seed=SEED).tolist()
    dst_pages = np.array([20, 1, 14, 8])
    sb.load(found, dst_pages)
    for s, d in zip(src_pages, dst_pages, strict=True):
        assert same(page_rows(a, s), page_rows(b, d))
    # values read back equal the writer's
    dloc = torch.tensor([p * PS + o for p in dst_pages for o in range(PS)], dtype=torch.int64)
    for layer in a.layers:
        ka, va = a.dequantize(layer, loc)
        kb, vb = b.dequantize(layer, dloc)
        assert torch.equal(ka, kb) and torch.equal(va, vb)
    # nothing else of b changed
    touched = set(dst_pages.tolist())
    for bs in b.plan.buffers:
        t, t0 = b.buffers[bs.name], before[bs.name]
        if bs.role in ("data", "block_scale"):
            keep = [r for r in range(t.shape[0]) if r // PS not in touched]
        elif bs.role == "block_scale_page_major":
            keep = [r for r in range(t.shape[0]) if r not in touched]
        else:
            keep = list(range(t.shape[0]))
        assert torch.equal(t[keep].view(torch.uint8), t0[keep].view(torch.uint8)), bs.name
    # page_io's bytes are the pages' rows, in the value's order, on both sides
    for layout, pool, pages in [(sa.layout, a, src_pages), (sb.layout, b, dst_pages.tolist())]:
        got = layout.read(pages).numpy()
        assert [row.tobytes() for row in got] == [page_bytes(pool, p) for p in pages]


def test_prefix_stops_at_the_first_miss_and_continues_from_start_page(redis_server):
    a = make_pool("fp8_e4m3")
    write_pages(a, [1, 2, 3, 4, 5, 6])
    sa = PageStore(a, redis_server.url, seed=SEED, prefix="t-stop")
    toks = tokens(6 * PS)
    assert sa.put_pages(toks, np.arange(1, 7)) == 6
    sa.client.delete(sa.key(sa.hashes(toks)[3]))
    f = sa.get_prefix(toks)
    assert (f.num_pages, f.stop, f.num_tokens(PS)) == (3, "absent", 12)
    f = sa.get_prefix(toks, start_page=4)
    assert (f.start_page, f.num_pages, f.stop) == (4, 2, "end")
    assert sa.get_prefix(toks, max_pages=2).num_pages == 2
    # the store never serves another namespace's pages
    assert sa.get_prefix(toks, namespace="lora-1").stop == "absent"
    # start_page skips pages already stored (only the rest is written)
    assert sa.put_pages(toks, np.arange(1, 7), start_page=3) == 3
    assert sa.get_prefix(toks).num_pages == 6
    # puts and loads in chunks of STAGING_PAGES pages
    b = make_pool("fp8_e4m3", num_tokens=96)
    sb = PageStore(b, redis_server.url, seed=SEED, prefix="t-stop")
    sa.STAGING_PAGES = sb.STAGING_PAGES = 4
    other = tokens(6 * PS, offset=3)
    assert sa.put_pages(other, np.array([6, 5, 4, 3, 2, 1])) == 6
    f = sb.get_prefix(other)
    for bad, match in [(np.arange(1, 6), "has 5 ids"), (np.array([1, 2, 3, 4, 5, 5]), "repeats"),
                       (np.array([0, 1, 2, 3, 4, 5]), "page id 0")]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            sb.load(f, bad)
    sb.load(f, np.arange(11, 17))
    for s, d in zip([6, 5, 4, 3, 2, 1], range(11, 17), strict=True):
        assert same(page_rows(a, s), page_rows(b, d)), (s, d)
    check_stored(sa, a, other, [6, 5, 4, 3, 2, 1], "fp8_e4m3")


def _refusal(caplog, store, toks, **kw):
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvpool.store"):
        f = store.get_prefix(toks, **kw)
    return f, caplog.text


def test_corrupt_truncated_and_foreign_values_are_misses_with_a_logged_reason(redis_server, caplog):
    a = make_pool("nvfp4")
    write_pages(a, [1, 2, 3, 4])
    sa = PageStore(a, redis_server.url, seed=SEED, prefix="t-bad")
    toks = tokens(4 * PS)
    sa.put_pages(toks, np.arange(1, 5))
    r = sa.client
    keys = [sa.key(h) for h in sa.hashes(toks)]
    good = r.get(keys[2])
    assert len(good) == sa.value_bytes

    def refused(value, reason):
        r.set(keys[2], value)
        f, log = _refusal(caplog, sa, toks)
        assert (f.num_pages, f.stop[: len(reason)]) == (2, reason), f.stop
        assert reason in log and keys[2] in log
        r.set(keys[2], good)

    flipped = bytearray(good)
    flipped[-1000] ^= 0x10  # one bit of the data
    refused(bytes(flipped), "checksum mismatch")
    refused(good[:-100], "truncated")
    refused(good[:5], "truncated")
    refused(b"hello world, not a page", "not a kvpool page")
    bad_version = bytearray(good)
    bad_version[4] = 9
    refused(bytes(bad_version), "format version 9")
    # a value of another layout (bf16 pool, same model) under this key
    b = make_pool("bf16")
    write_pages(b, [1, 2, 3, 4])
    sb = PageStore(b, redis_server.url, seed=SEED, prefix="t-bad")
    assert sb.fingerprint != sa.fingerprint
    sb.put_pages(toks, np.arange(1, 5))
    refused(r.get(sb.key(sb.hashes(toks)[2])), "foreign: fingerprint " + sb.fingerprint)
    # a 64-bit collision: another sequence's page 2 (same header, valid checksum)
    other = tokens(4 * PS, offset=5)
    sa.put_pages(other, np.arange(1, 5))
    refused(r.get(sa.key(sa.hashes(other)[2])), "tokens differ")
    # same tokens on page 2, different history: the prefix digest tells
    hist = toks.copy()
    hist[0] += 1
    sa.put_pages(hist, np.arange(1, 5))
    refused(r.get(sa.key(sa.hashes(hist)[2])), "prefix digest differs")
    # another pool's per-tensor scales
    c = make_pool("nvfp4", scales=(1.0, 1.0, 1.0))
    sc = PageStore(c, redis_server.url, seed=SEED, prefix="t-bad")
    f, log = _refusal(caplog, sc, toks)
    assert (f.num_pages, f.stop) == (0, "per-tensor scales differ from this pool's")
    assert sa.get_prefix(toks).num_pages == 4  # the good values are intact
    assert sa.stats["refused"] == 8  # the eight `refused(...)` above, one each


def test_eviction_by_the_servers_allkeys_lru():
    server = start_redis(maxmemory="2mb", maxmemory_policy="allkeys-lru", maxmemory_samples=10)
    try:
        a = make_pool("bf16", num_tokens=256)
        write_pages(a, list(range(1, 65)))
        sa = PageStore(a, server.url, seed=SEED)
        assert sa.value_bytes > 6000
        seqs = [tokens(8 * PS, offset=100 * i) for i in range(100)]  # 100 x 8 pages, ~5 MB
        src = [np.arange(1, 9) + 8 * (i % 8) for i in range(100)]
        for i, s in enumerate(seqs):
            if i == 10:
                time.sleep(1.2)  # the server's LRU clock ticks once a second
            assert sa.put_pages(s, src[i]) == 8
        info = server.client().info()
        assert info["evicted_keys"] > 0
        assert info["used_memory"] <= 2 * 2**20 * 1.05
        found = []
        for i, s in enumerate(seqs):  # whatever is found is right; a lookup stops at a miss
            f = sa.get_prefix(s)
            assert f.stop in ("end", "absent")
            assert torch.equal(f.data, sa.layout.read(src[i][: f.num_pages]))
            found.append(f.num_pages)
        assert sum(found) < 800
        assert sum(found[:10]) < sum(found[-10:])  # the least recently used went first
    finally:
        server.stop()


def test_server_down_is_skipped_within_the_timeout(caplog):
    a = make_pool("fp8_e4m3")
    write_pages(a, [1, 2])
    toks = tokens(2 * PS)
    sa = PageStore(a, f"redis://127.0.0.1:{free_port()}/0", seed=SEED,
                   socket_timeout=0.2, socket_connect_timeout=0.2, retry_after=60)  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="kvpool.store"):
        t0 = time.monotonic()
        assert sa.put_pages(toks, np.array([1, 2])) == 0
        assert time.monotonic() - t0 < 1.0
    assert "put of 2 pages failed (ConnectionError" in caplog.text
    assert "skipped for 60.0 s" in caplog.text
    t0 = time.monotonic()
    f = sa.get_prefix(toks)
    assert (f.num_pages, f.stop) == (0, "skipped")
    assert time.monotonic() - t0 < 0.05  # skipped without a connection attempt
    assert sa.stats["errors"] == 1 and sa.stats["skipped"] == 1
    with pytest.raises(ValueError, match="page id 0"):  # bad input still raises while down
        sa.put_pages(toks, np.array([0, 1]))
    # a cluster client connects at first use: that is skipped within the timeout too
    sc = PageStore(a, f"redis+cluster://127.0.0.1:{free_port()}", seed=SEED,
                   socket_timeout=0.2, socket_connect_timeout=0.2)  # fmt: skip
    t0 = time.monotonic()
    assert sc.get_prefix(toks).stop == "skipped"
    assert time.monotonic() - t0 < 1.5


def test_a_server_that_stops_is_skipped_then_used_again(caplog):
    server = start_redis()
    a = make_pool("fp8_e4m3")
    write_pages(a, [1, 2])
    toks = tokens(2 * PS)
    sa = PageStore(a, server.url, seed=SEED, socket_timeout=0.2, socket_connect_timeout=0.2,
                   retry_after=0.3)  # fmt: skip
    assert sa.put_pages(toks, np.array([1, 2])) == 2
    server.stop()
    with caplog.at_level(logging.WARNING, logger="kvpool.store"):
        t0 = time.monotonic()
        assert sa.get_prefix(toks).stop == "skipped"
        assert time.monotonic() - t0 < 1.0
    assert "lookup of 2 pages failed" in caplog.text
    again = start_redis()
    try:
        sb = PageStore(a, again.url, seed=SEED, retry_after=0.3)
        assert sb.put_pages(toks, np.array([1, 2])) == 2
        assert sb.get_prefix(toks).num_pages == 2
    finally:
        again.stop()


def test_a_slow_server_is_skipped_after_the_socket_timeout(redis_server, caplog):
    a = make_pool("fp8_e4m3")
    write_pages(a, [1, 2])
    toks = tokens(2 * PS)
    sa = PageStore(a, redis_server.url, seed=SEED, prefix="t-slow", socket_timeout=0.2,
                   retry_after=0.5)  # fmt: skip
    assert sa.put_pages(toks, np.array([1, 2])) == 2
    admin = redis_server.client()
    admin.execute_command("CLIENT", "PAUSE", 1000, "ALL")  # ends by itself after 1 s
    paused = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="kvpool.store"):
        t0 = time.monotonic()
        f = sa.get_prefix(toks)
        took = time.monotonic() - t0
    assert f.stop == "skipped" and 0.15 < took < 0.8
    assert "failed (TimeoutError" in caplog.text
    time.sleep(max(0.0, paused + 1.1 - time.monotonic()))  # past the pause and retry_after
    assert sa.get_prefix(toks).num_pages == 2


def test_page_io_checks_its_arguments_and_changes_nothing():
    pool = make_pool("nvfp4")
    layout = PageLayout(pool)
    before = {n: t.clone() for n, t in pool.buffers.items()}
    n = pool.plan.num_pages
    for bad, match in [([0], "page id 0"), ([n + 1], f"page id {n + 1}"),
                       ([[1, 2]], "1-D")]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            layout.read(bad)
    data = layout.read([1, 2])
    with pytest.raises(ValueError, match="repeats"):
        layout.write([3, 3], data)
    with pytest.raises(ValueError, match="uint8"):
        layout.write([3], data)
    with pytest.raises(ValueError, match="uint8"):
        layout.write([3, 4], data.view(torch.int8))
    assert all(torch.equal(before[k].view(torch.uint8), t.view(torch.uint8))
               for k, t in pool.buffers.items())  # fmt: skip
    # one section per per-page buffer; page-major scales are one block per page
    roles = {b.name: b.role for b in pool.plan.buffers}
    assert [roles[s.name] for s in layout.sections].count("data") == 2 * CONFIG["num_hidden_layers"]
    assert layout.page_bytes == sum(s.nbytes for s in layout.sections)


def test_hybrid_pools_are_refused_by_name():
    plan = kvpool.size_for("google/gemma-2-9b-it", "bf16", page_size=16, num_tokens=64)
    pool = kvpool.KVPool(plan, device="meta")
    with pytest.raises(ValueError, match="not in the primary page space"):
        PageLayout(pool)


def test_urls_and_arguments():
    pool = make_pool("bf16")
    for bad in ("http://x:1", "127.0.0.1:6379", 6379):
        with pytest.raises(ValueError, match="url"):
            PageStore(pool, bad, seed=1)
    with pytest.raises(ValueError, match="exactly one"):
        PageStore(pool, seed=1)
    # TLS and unix-socket URLs make clients without connecting
    import redis

    assert connect("rediss://example.invalid:6380/2").connection_pool.connection_kwargs["db"] == 2
    assert isinstance(connect("unix:///tmp/none.sock"), redis.Redis)
    s = PageStore(pool, "redis://127.0.0.1:1/0", seed=1)
    # log lines name the server without its password
    assert PageStore(pool, "rediss://app:s3cret@db.example:6380/1", seed=1).server == (
        "rediss://app:***@db.example:6380/1"
    )
    assert PageStore(pool, "redis://:s3cret@h:1/0", seed=1).server == "redis://:***@h:1/0"
    assert s.server == "redis://127.0.0.1:1/0"
    with pytest.raises(ValueError, match="`pages` has 3 ids for 8 tokens"):
        s.put_pages(tokens(8), np.array([1, 2, 3]))
    with pytest.raises(ValueError, match="start_page"):
        s.put_pages(tokens(8), np.array([1, 2]), start_page=3)
    with pytest.raises(ValueError, match="1-D integer"):
        s.get_prefix(np.zeros((2, 2), np.int32))
    with pytest.raises(ValueError, match="seed"):
        PageStore(pool, "redis://127.0.0.1:1/0", seed=-1)


def test_a_cluster_url_spreads_pages_over_the_nodes():
    from redis_fixtures import start_cluster

    nodes = start_cluster(3)
    try:
        a = make_pool("nvfp4")
        write_pages(a, list(range(1, 13)))
        toks = tokens(12 * PS)
        sa = PageStore(a, f"redis+cluster://127.0.0.1:{nodes[0].port}", seed=SEED)
        assert sa.put_pages(toks, np.arange(1, 13)) == 12
        per_node = [s.client().dbsize() for s in nodes]
        assert sum(per_node) == 13 and min(per_node) > 0  # 12 pages + the layout key
        b = make_pool("nvfp4", num_tokens=96)
        sb = PageStore(b, f"redis+cluster://127.0.0.1:{nodes[1].port}", seed=SEED)
        f = sb.get_prefix(toks)
        assert (f.num_pages, f.stop) == (12, "end")
        sb.load(f, np.arange(10, 22))
        assert torch.equal(sb.layout.read(np.arange(10, 22)), sa.layout.read(np.arange(1, 13)))
    finally:
        for s in nodes:
            s.stop()


def test_pool_hooks_and_the_missing_extra(monkeypatch):
    a = make_pool("fp4_mx_block16")
    write_pages(a, [1, 2])
    b = make_pool("fp4_mx_block16", num_tokens=96)
    b.write_pages([7, 3], a.read_pages([1, 2]))
    assert same(page_rows(a, 1), page_rows(b, 7)) and same(page_rows(a, 2), page_rows(b, 3))
    assert a.page_layout is a.page_layout
    import sys

    from kvpool import _deps

    monkeypatch.setitem(sys.modules, "redis", None)
    with pytest.raises(ImportError, match=r"pip install 'kvpool\[store\]'"):
        _deps.require_redis()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, recipe", [("fp8_e4m3", "linear"), ("nvfp4", "mixed")])
def test_a_cuda_pool_round_trips_through_the_store(redis_server, dtype, recipe):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    cpu = make_pool(dtype, recipe)
    write_pages(cpu, [1, 2, 3])
    plan = cpu.plan
    a, b = kvpool.KVPool(plan, device="cuda"), kvpool.KVPool(plan, device="cuda")
    for name, t in cpu.buffers.items():
        a.buffers[name].copy_(t)
        b.buffers[name].copy_(t)
    toks = tokens(3 * PS)
    sa = PageStore(a, redis_server.url, seed=SEED, prefix=f"t-cuda-{dtype}")
    assert sa.put_pages(toks, np.array([1, 2, 3])) == 3
    sb = PageStore(b, redis_server.url, seed=SEED, prefix=f"t-cuda-{dtype}")
    f = sb.get_prefix(toks)
    sb.load(f, np.array([9, 8, 7]))
    for s, d in zip([1, 2, 3], [9, 8, 7], strict=True):
        assert same(page_rows(cpu, s), page_rows(b, d)), (s, d)
    check_stored(sa, cpu, toks, [1, 2, 3], dtype)
