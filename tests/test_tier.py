"""The host-memory tier: sizing, bad input, byte-exact copies per KV dtype, loads and fallbacks.

The radix bookkeeping of both tiers is pinned by tests/test_tier_state_machine.py and the Rust
unit tests (rust/src/radix/tier_tests.rs); this file pins the Python side on CPU tensors.
"""

import json
import runpy
import subprocess
import sys

import kvpool
import numpy as np
import pytest
import torch
from kvpool import (
    BudgetTooSmallError,
    InvalidArgumentError,
    PageAllocator,
    PageError,
    RadixCache,
    SizingError,
    StaleNodeError,
)
from kvpool.tier import HostPool, HostTier, runs

SPEC = kvpool.ModelSpec.from_dict({"num_hidden_layers": 2, "hidden_size": 256,
                                   "num_attention_heads": 4, "num_key_value_heads": 2,
                                   "head_dim": 64}, name="toy")
ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


def plan_for(dtype, *, pages=16, host_pages=24, page_size=4, **kw):
    return kvpool.size_for(SPEC, dtype, num_tokens=pages * page_size, page_size=page_size,
                           host_pages=host_pages, **kw)


# --- sizing ---


@pytest.mark.parametrize("dtype", kvpool.KV_DTYPES)
def test_host_pool_is_sized_byte_exact_from_the_device_layout(dtype):
    plan = plan_for(dtype)
    rows = (plan.host_pages + 1) * plan.page_size
    # every per-row buffer of the device pool, with the host's rows; no per-layer scales
    dev = [b for b in plan.buffers if b.role in ("data", "block_scale", "block_scale_page_major")]
    assert [b.name for b in plan.host.buffers] == [b.name for b in dev]
    for h, d in zip(plan.host.buffers, dev, strict=True):
        assert h.dtype == d.dtype and h.shape[1:] == d.shape[1:]
        first = rows // plan.page_size if h.role == "block_scale_page_major" else rows
        assert h.shape[0] == first
    assert plan.host_bytes == rows * plan.host.bytes_per_token
    # the host page holds what the device's rows hold: bytes_per_token minus the workspace
    ws = plan.workspace_bytes // ((plan.num_pages + 1) * plan.page_size)
    assert plan.host.bytes_per_token == plan.bytes_per_token - ws
    pool = kvpool.KVPool(plan, device="cpu")
    assert HostPool(pool).nbytes == plan.host_bytes
    # Hand-worked for the toy model (2 layers x K, V x 2 KV heads x head_dim 64) and 25 host
    # pages of 4 tokens: bf16 2 bytes an element; fp8 1; nvfp4 half a byte + one e4m3 scale a 16.
    by_hand = {"bf16": 2 * 2 * 2 * 64 * 2, "fp8_e4m3": 2 * 2 * 2 * 64,
               "nvfp4": 2 * 2 * 2 * (64 // 2 + 64 // 16)}
    if dtype in by_hand:
        assert plan.host.bytes_per_token == by_hand[dtype]
        assert plan.host_bytes == 25 * 4 * by_hand[dtype]


def test_host_memory_gives_the_most_pages_that_fit():
    plan = kvpool.size_for(SPEC, "nvfp4", num_tokens=64, page_size=16, host_memory=1 << 20)
    page = plan.page_size * plan.host.bytes_per_token
    assert plan.host_bytes <= 1 << 20 < plan.host_bytes + page
    assert plan.host_bytes == (plan.host_pages + 1) * page
    # recipes with page-major scales count them too
    pm = kvpool.size_for(SPEC, "nvfp4", num_tokens=64, page_size=16, host_memory=1 << 20,
                         nvfp4_recipe="mixed")
    assert any(b.role == "block_scale_page_major" for b in pm.host.buffers)
    assert not any(b.role == "workspace" for b in pm.host.buffers)
    assert sum(b.nbytes for b in pm.host.buffers) == pm.host_bytes
    d = plan.to_dict()["host"]
    assert d["host_bytes"] == plan.host_bytes and d["num_pages"] == plan.host_pages
    assert kvpool.size_for(SPEC, "bf16", num_tokens=64).host is None
    assert kvpool.size_for(SPEC, "bf16", num_tokens=64).host_bytes == 0


def test_host_sizing_bad_input():
    with pytest.raises(SizingError, match="not both"):
        kvpool.size_for(SPEC, "bf16", num_tokens=64, host_memory=1 << 20, host_pages=3)
    with pytest.raises(SizingError, match="host_pages"):
        kvpool.size_for(SPEC, "bf16", num_tokens=64, host_pages=-1)
    with pytest.raises(SizingError, match="host_memory"):
        kvpool.size_for(SPEC, "bf16", num_tokens=64, host_memory=1.5)
    with pytest.raises(BudgetTooSmallError, match="holds no host page"):
        kvpool.size_for(SPEC, "bf16", num_tokens=64, host_memory=100)
    hybrid = kvpool.ModelSpec.from_pretrained("google/gemma-2-9b-it")
    with pytest.raises(SizingError, match="one page space"):
        kvpool.size_for(hybrid, "bf16", num_tokens=4096, host_memory=1 << 30)


def test_cli_host_memory(capsys):
    from kvpool.cli import main

    assert main(["size", "Qwen/Qwen3-8B", "--gpu", "H200", "--kv-cache-dtype", "fp8_e4m3",
                 "--host-memory", "8"]) == 0
    out = capsys.readouterr().out
    want = kvpool.size_for("Qwen/Qwen3-8B", "fp8_e4m3", gpu="H200", host_memory=8 << 30)
    assert f"host tier fp8_e4m3: 8.00 GiB pinned = {want.host_pages:,} pages x 1" in out
    assert main(["size", "Qwen/Qwen3-8B", "--gpu", "H200", "--kv-cache-dtype", "nvfp4",
                 "--host-memory", "8", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)[0]["host"]
    assert got["host_bytes"] == (got["num_pages"] + 1) * got["bytes_per_token"] <= 8 << 30


# --- bad input to the cache ---


def tiered(dev=8, host=8, ps=1):
    a, h = PageAllocator(dev, ps), PageAllocator(host, ps)
    return a, h, RadixCache(a, host_allocator=h)


def demoted(tokens=(1, 2, 3)):
    """A cache whose path `tokens` was demoted; returns (a, h, cache, host pages, node)."""
    a, h, c = tiered(4, 8)
    t = np.array(tokens, np.int32)
    p = c.alloc(len(t))
    c.insert(t, p)
    a.free(p)
    c.evict(len(t))
    d, hp = c.take_demotions()
    assert np.array_equal(d, p) and len(hp) == len(t)
    got, node, n = c.match_prefix_host(t)
    assert n == len(t) and np.array_equal(got, hp)
    return a, h, c, hp, node


def test_construction_bad_input():
    a = PageAllocator(4, 1)
    with pytest.raises(InvalidArgumentError, match="same allocator"):
        RadixCache(a, host_allocator=a)
    with pytest.raises(InvalidArgumentError, match="page_size"):
        RadixCache(a, host_allocator=PageAllocator(4, 2))
    with pytest.raises(InvalidArgumentError, match="hybrid"):
        RadixCache(a, sliding=[(PageAllocator(4, 1), 8)], host_allocator=PageAllocator(4, 1))
    with pytest.raises(TypeError):
        RadixCache(a, host_allocator=kvpool.StateSlotAllocator(4))
    plain = RadixCache(a)
    assert plain.host_allocator is None and plain.tier_stats()["demoted_pages"] == 0
    with pytest.raises(InvalidArgumentError, match="no host tier"):
        plain.match_prefix_host(np.array([1], np.int32))
    with pytest.raises(InvalidArgumentError, match="no host tier"):
        plain.take_demotions()


def test_load_back_bad_input_changes_nothing():
    a, h, c, hp, node = demoted()
    dev = c.alloc(3)
    c.take_demotions()
    before = (a.num_used, h.num_used, c.tier_stats(), c.total_size)
    with pytest.raises(InvalidArgumentError, match="has 2 entries, but node"):
        c.load_back(node, dev[:2])
    with pytest.raises(PageError, match="padding"):
        c.load_back(node, np.array([dev[0], 0, dev[2]], np.int32))
    with pytest.raises(PageError, match="more than once|already"):
        c.load_back(node, np.array([dev[0], dev[0], dev[2]], np.int32))
    free = np.setdiff1d(np.arange(1, 5), np.concatenate([dev]))
    if len(free):
        with pytest.raises(PageError, match="not allocated"):
            c.load_back(node, np.array([dev[0], dev[1], free[0]], np.int32))
    with pytest.raises(InvalidArgumentError, match="on the host tier"):
        c.lock(node)
    assert (a.num_used, h.num_used, c.tier_stats(), c.total_size) == before
    c.check_invariants()
    assert c.load_back(node, dev) == 3
    with pytest.raises(InvalidArgumentError, match="on the device tier"):
        c.load_back(node, dev)
    c.lock(node)
    c.unlock(node)
    c.reset()
    with pytest.raises(StaleNodeError):
        c.load_back(node, dev)
    a.free(dev)
    assert (a.num_used, h.num_used) == (0, 0)


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_a_long_load_back_checks_and_applies_its_own_copy(dtype):
    """16,384 pages (DETACH_MIN): the ids are copied, narrowed and checked with the GIL released
    (rust/src/py/radix_tier.rs `load`); the errors and the result are the short path's."""
    n = 1 << 14
    a, h = PageAllocator(n, 1), PageAllocator(n, 1)
    c = RadixCache(a, host_allocator=h)
    toks = np.arange(n, dtype=np.int32)
    p = c.alloc(n)
    c.insert(toks, p)
    a.free(p)
    assert c.evict(n) == n
    d, hp = c.take_demotions()
    assert len(d) == n
    got, node, hn = c.match_prefix_host(toks)
    assert hn == n and np.array_equal(got, hp)
    dev = c.alloc(n)
    before = (a.num_used, h.num_used, c.tier_stats(), c.total_size)
    repeated = dev.astype(dtype)
    repeated[-1] = repeated[0]
    with pytest.raises(PageError, match="more than once|already"):
        c.load_back(node, repeated)
    if dtype is np.int64:
        wide = dev.astype(np.int64)
        wide[n // 2] = 1 << 40
        with pytest.raises(PageError, match=str(1 << 40)):
            c.load_back(node, wide)
    assert (a.num_used, h.num_used, c.tier_stats(), c.total_size) == before
    assert c.load_back(node, dev.astype(dtype)) == n
    m, _, mn = c.match_prefix(toks)
    assert mn == n and np.array_equal(m, dev)
    assert (h.num_used, c.tier_stats()["loaded_pages"]) == (0, n)
    c.check_invariants()
    a.free(dev)
    assert a.num_used == n  # the tree's references only


def test_runs_group_contiguous_pages():
    assert runs(np.array([3, 4, 5, 9, 10]), np.array([7, 8, 9, 1, 2])) == [(3, 7, 3), (9, 1, 2)]
    assert runs(np.array([3, 4]), np.array([7, 9])) == [(3, 7, 1), (4, 9, 1)]
    assert runs(np.zeros(0, np.int32), np.zeros(0, np.int32)) == []
    with pytest.raises(ValueError, match="one shape"):
        runs(np.array([1, 2]), np.array([1]))


def test_host_pool_needs_a_host_plan():
    pool = kvpool.KVPool(kvpool.size_for(SPEC, "bf16", num_tokens=16), device="cpu")
    with pytest.raises(ValueError, match="no host pool"):
        HostPool(pool)


# --- bytes through the tier, per dtype ---


def fill_random(tier, pages, seed):
    g = torch.Generator().manual_seed(seed)
    for pairs in tier.host.layers.values():
        for dev, _ in pairs:
            for p in pages:
                v = dev[int(p)].reshape(-1).view(torch.uint8)
                v.copy_(torch.randint(0, 256, v.shape, generator=g, dtype=torch.uint8))


def page_bytes(views, pages):
    return [v[torch.as_tensor(np.asarray(pages, np.int64))].reshape(-1).view(torch.uint8).clone()
            for v in views]


@pytest.mark.parametrize("dtype,recipe", [(d, "linear") for d in kvpool.KV_DTYPES]
                         + [("nvfp4", "mixed"), ("nvfp4", "page_major")])
def test_demote_and_load_move_every_byte_unchanged(dtype, recipe):
    plan = plan_for(dtype, nvfp4_recipe=recipe)
    pool = kvpool.KVPool(plan, device="cpu")
    tier = HostTier(pool)
    devs = [d for pairs in tier.host.layers.values() for d, _ in pairs]
    hosts = [h for pairs in tier.host.layers.values() for _, h in pairs]
    tokens = np.arange(40, dtype=np.int32)  # 10 pages of 4
    own = tier.alloc(10)
    fill_random(tier, own, seed=1)
    want = page_bytes(devs, own)
    tier.cache.insert(tokens, own)
    tier.allocator.free(own)
    # fill the device pool with another prompt: every page of the first is demoted
    other = tier.alloc(16)
    m = tier.metrics()
    assert m["demotions"] == 10 and m["evictions"] == 0
    assert tier.demotion_copies > 0
    tier.allocator.free(other)
    got_host = tier.match(tokens)
    assert got_host.matched == 0 and got_host.host_len == 40
    assert [torch.equal(a, b) for a, b in zip(page_bytes(hosts, got_host.host_pages), want,
                                               strict=True)] == [True] * len(want)
    # scramble the device pool, then load back
    fill_random(tier, np.arange(1, plan.num_pages + 1), seed=2)
    tier.cache.lock(got_host.node)
    load = tier.load(got_host)
    assert load is not None and load.loaded_back and load.tokens == 40
    load.wait(0)
    load.wait_all()
    got = page_bytes(devs, load.device_pages)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    pages, node, n = tier.cache.match_prefix(tokens)
    assert n == 40 and np.array_equal(pages, load.device_pages)
    tier.cache.unlock(got_host.node)
    tier.allocator.free(load.device_pages)
    tier.poll()
    m = tier.metrics()
    assert m["loads"] == 10 and m["host_cache_hits"] == 40 and m["failed_loads"] == 0
    # the loaded path is unlocked and its request freed its pages: evictable, so free (vLLM)
    assert m["kv_cache_usage_perc"] == 0.0 and tier.cache.evictable_size == 40
    tier.cache.check_invariants()


def test_kv_cache_usage_has_one_definition():
    """``HostTier.metrics`` and ``cache_metrics`` report vLLM's gauge: used / usable device pages,
    pages only evictable tree nodes hold counted free (the tier used to count them used)."""
    from kvpool.metrics import cache_metrics, kv_cache_usage

    tier = HostTier(kvpool.KVPool(plan_for("bf16"), device="cpu"))
    c, a = tier.cache, tier.allocator
    toks = np.arange(16, dtype=np.int32)  # 4 pages of 4
    p = tier.alloc(4)
    c.insert(toks, p)
    a.free(p)  # 4 cached pages, evictable
    held = tier.alloc(3)  # a request's pages
    _, node, n = c.match_prefix(toks[:8])
    c.lock(node)  # the first 2 cached pages are protected
    assert n == 8 and a.num_used == 7
    want = (3 + 2) / a.num_pages  # held + locked; the 2 evictable cached pages are free
    assert tier.metrics()["kv_cache_usage_perc"] == pytest.approx(want)
    assert cache_metrics(c)["kv_cache_usage_perc"] == pytest.approx(want)
    assert kv_cache_usage(c) == tier.metrics()["kv_cache_usage_perc"]
    c.unlock(node)
    a.free(held)
    assert tier.metrics()["kv_cache_usage_perc"] == 0.0  # everything cached is evictable
    assert tier.evict(16) == 16  # demoted: the host pages are not the device pool's
    assert tier.metrics()["kv_cache_usage_perc"] == cache_metrics(c)["kv_cache_usage_perc"] == 0.0


def test_one_copy_per_contiguous_run_and_buffer():
    plan = plan_for("fp8_e4m3")
    tier = HostTier(kvpool.KVPool(plan, device="cpu"))
    n_buffers = sum(len(p) for p in tier.host.layers.values())
    assert n_buffers == 2 * 2  # 2 layers x (k, v)
    n = tier.host.copy_pages(np.array([1, 2, 3, 7]), np.array([4, 5, 6, 1]), to_host=True)
    assert n == 2 * n_buffers


class FailingLoads(HostPool):
    """A host pool whose loads fail (a fault injected into the copy, as a bad transfer raises)."""

    def copy_pages(self, src, dst, *, to_host, **kw):
        if not to_host:
            raise RuntimeError("injected copy failure")
        return super().copy_pages(src, dst, to_host=to_host, **kw)


def test_a_failed_load_leaves_the_node_on_the_host_and_recomputes():
    plan = plan_for("bf16")
    pool = kvpool.KVPool(plan, device="cpu")
    tier = HostTier(pool, host_pool=FailingLoads(pool))
    tokens = np.arange(16, dtype=np.int32)
    own = tier.alloc(4)
    tier.cache.insert(tokens, own)
    tier.allocator.free(own)
    tier.evict(16)
    used = (tier.allocator.num_used, tier.host_allocator.num_used)
    m = tier.match(tokens)
    assert m.host_len == 16
    assert tier.load(m) is None
    assert (tier.allocator.num_used, tier.host_allocator.num_used) == used
    again = tier.match(tokens)
    assert again.host_len == 16 and np.array_equal(again.host_pages, m.host_pages)
    assert tier.metrics()["failed_loads"] == 1
    # the request recomputes and inserts: its pages replace the host copy
    own = tier.alloc(4)
    tier.cache.insert(tokens, own)
    tier.allocator.free(own)
    assert tier.cache.match_prefix(tokens)[2] == 16
    assert tier.host_allocator.num_used == 0
    tier.cache.check_invariants()


def test_load_protects_host_pages_until_copied():
    """The load holds a reference on the host pages it reads until poll() sees the copies done."""
    plan = plan_for("bf16", pages=4, host_pages=4)
    tier = HostTier(kvpool.KVPool(plan, device="cpu"))
    tokens = np.arange(8, dtype=np.int32)
    own = tier.alloc(2)
    tier.cache.insert(tokens, own)
    tier.allocator.free(own)
    tier.evict(8)
    m = tier.match(tokens)
    tier.host_allocator.inc_ref(m.host_pages)  # a load in flight elsewhere
    load = tier.load(m)
    assert load is not None
    assert tier.host_allocator.num_used == 2  # still held by the other reader
    tier.host_allocator.free(m.host_pages)
    assert tier.host_allocator.num_used == 0
    tier.allocator.free(load.device_pages)


# --- the example ---


def test_example_host_tier_prints_one_line_and_gains():
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "host_tier.py")],
                         capture_output=True, text=True, check=True, timeout=600).stdout
    lines = out.strip().splitlines()
    assert len(lines) == 1, out
    import re

    mt = re.fullmatch(r"host_tier: hit_rate_without=(0\.\d+|1\.0+) hit_rate_with=(0\.\d+|1\.0+)",
                      lines[0])
    assert mt, lines[0]
    without, with_ = float(mt[1]), float(mt[2])
    assert with_ > without + 0.3
    assert "examples/host_tier.py" in (ROOT / "README.md").read_text()


def test_example_runs_for_every_dtype_in_process():
    ns = runpy.run_path(str(ROOT / "examples" / "host_tier.py"))
    for dtype in ("bf16", "nvfp4", "fp4_mx_block16"):
        without, with_ = ns["main"](["--dtype", dtype, "--sessions", "4", "--turns", "4"])
        assert with_ >= without


# --- on a GPU: pinned host pool, copies on the current stream, loads on a side stream ---


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp8_e4m3", "nvfp4", "fp4_mx_block16"])
def test_gpu_demote_and_load_are_byte_exact_and_asynchronous(dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    plan = plan_for(dtype, pages=16, host_pages=32, page_size=16)
    pool = kvpool.KVPool(plan, device="cuda")
    tier = HostTier(pool)
    assert tier.host.pinned and all(t.is_pinned() for t in tier.host.buffers.values())
    devs = [d for pairs in tier.host.layers.values() for d, _ in pairs]
    tokens = np.arange(160, dtype=np.int32)  # 10 pages of 16
    own = tier.alloc(10)
    g = torch.Generator(device="cuda").manual_seed(1)
    for d in devs:
        for p in own:
            v = d[int(p)].reshape(-1).view(torch.uint8)
            v.copy_(torch.randint(0, 256, v.shape, generator=g, dtype=torch.uint8, device="cuda"))
    want = page_bytes(devs, own)
    tier.cache.insert(tokens, own)
    tier.allocator.free(own)
    other = tier.alloc(16)  # demotes all 10; the copies run before these pages are written
    for d in devs:
        for p in other:
            d[int(p)].reshape(-1).view(torch.uint8).fill_(0)
    tier.allocator.free(other)
    m = tier.match(tokens)
    assert m.host_len == 160
    tier.cache.lock(m.node)
    load = tier.load(m)
    assert load is not None
    for layer in pool.layers:
        load.wait(layer)
    got = page_bytes(devs, load.device_pages)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    tier.cache.unlock(m.node)
    tier.allocator.free(load.device_pages)
    torch.cuda.synchronize()
    tier.poll()
    assert tier.host_allocator.num_used == 0


@pytest.mark.parametrize("dtype,recipe", [(d, "linear") for d in kvpool.KV_DTYPES]
                         + [("nvfp4", "mixed"), ("nvfp4", "page_major")])
def test_host_pages_hold_the_page_store_layout(dtype, recipe):
    # the tier (plan.host.buffers) and the page store (PageLayout) pick the same per-page
    # buffers in the same order: a host page's bytes, buffer after buffer, are read_pages' row
    plan = plan_for(dtype, nvfp4_recipe=recipe)
    pool = kvpool.KVPool(plan, device="cpu")
    host = HostPool(pool)
    names = [s.name for s in pool.page_layout.sections]
    assert names == [b.name for b in plan.host.buffers] == list(host.buffers)
    g = torch.Generator().manual_seed(3)
    for name in names:
        v = pool.buffers[name].view(torch.uint8)
        v.copy_(torch.randint(0, 256, v.shape, generator=g, dtype=torch.uint8))
    src, dst = np.array([3, 5, 6], np.int32), np.array([2, 9, 1], np.int32)
    host.copy_pages(src, dst, to_host=True, non_blocking=False)
    rows = [host.buffers[n].view(torch.uint8).reshape(host.num_pages + 1, -1) for n in names]
    got = torch.cat([r[torch.as_tensor(dst, dtype=torch.int64)] for r in rows], dim=1)
    assert got.shape == (3, pool.page_layout.page_bytes)
    assert torch.equal(got, pool.read_pages(src))
