"""A device pool too small for a multi-turn workload, replayed with and without a host-memory tier.

Sessions share a system prompt; each turn sends the whole conversation so far plus new user
tokens and appends an answer. Sessions take turns, so the working set (every session's
conversation) is about 3x the device pool: without a host tier the LRU drops a session's pages
before its next turn comes; with one they are demoted to the host pool and loaded back.

No model runs: each computed page is filled with bytes derived from the tokens up to its end
(what a causal model's KV depends on), and every page a request reuses, from the device or
loaded from the host, is checked to hold exactly those bytes. Runs on CPU in a few seconds:

    python examples/host_tier.py [--dtype fp8_e4m3] [--sessions 6] [--turns 8]

prints one line ``host_tier: hit_rate_without=<fraction> hit_rate_with=<fraction>``, where the
hit rate is the fraction of prompt tokens that were not recomputed (device hits, plus tokens
loaded from the host).
"""

from __future__ import annotations

import argparse
import zlib

import kvpool
import numpy as np
import torch
from kvpool.tier import HostPool, HostTier, TierMatch


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dtype", default="fp8_e4m3", help="KV dtype of the pool")
    p.add_argument("--page-size", type=int, default=4, help="tokens per page")
    p.add_argument("--device-pages", type=int, default=64, help="usable pages of the device pool")
    p.add_argument("--host-pages", type=int, default=256, help="pages of the host pool")
    p.add_argument("--sessions", type=int, default=6, help="conversations replayed in turn")
    p.add_argument("--turns", type=int, default=8, help="turns per conversation")
    p.add_argument("--system", type=int, default=16, help="tokens of the shared system prompt")
    p.add_argument("--user", type=int, default=8, help="new user tokens per turn")
    p.add_argument("--answer", type=int, default=8, help="answer tokens per turn")
    p.add_argument("--device", default="cpu", help="where the device pool lives")
    return p


SPEC = kvpool.ModelSpec.from_dict({"num_hidden_layers": 2, "hidden_size": 128,
                                   "num_attention_heads": 4, "num_key_value_heads": 2,
                                   "head_dim": 16}, name="toy")


def workload(a: argparse.Namespace) -> list[tuple[np.ndarray, np.ndarray]]:
    """(prompt, answer) token arrays in replay order: turn t of every session, then t + 1."""
    rng = np.random.default_rng(0)
    system = rng.integers(0, 30000, a.system)
    history = [system.copy() for _ in range(a.sessions)]
    out = []
    for _ in range(a.turns):
        for s in range(a.sessions):
            prompt = np.concatenate([history[s], rng.integers(0, 30000, a.user)]).astype(np.int32)
            answer = rng.integers(0, 30000, a.answer).astype(np.int32)
            out.append((prompt, answer))
            history[s] = np.concatenate([prompt, answer])
    return out


class Pages:
    """Fills and checks page bytes: page j of a sequence holds bytes seeded by its prefix."""

    def __init__(self, pool: kvpool.KVPool, host: HostPool):
        self.views = [dev for pairs in host.layers.values() for dev, _ in pairs]
        self.ps = pool.page_size

    def _expected(self, prefix: np.ndarray) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(zlib.crc32(prefix.tobytes()))
        return [torch.randint(0, 256, v[0].reshape(-1).view(torch.uint8).shape, generator=g,
                              dtype=torch.uint8) for v in self.views]

    def fill(self, seq: np.ndarray, pages: np.ndarray, first: int) -> None:
        for j in range(first, len(pages)):
            for v, b in zip(self.views, self._expected(seq[:(j + 1) * self.ps]), strict=True):
                v[int(pages[j])].reshape(-1).view(torch.uint8).copy_(b)

    def check(self, seq: np.ndarray, pages: np.ndarray) -> None:
        for j in range(len(pages)):
            for v, b in zip(self.views, self._expected(seq[:(j + 1) * self.ps]), strict=True):
                got = v[int(pages[j])].reshape(-1).view(torch.uint8).cpu()
                assert torch.equal(got, b), f"page {j} of a reused prefix holds other bytes"


def replay(a: argparse.Namespace, with_host: bool) -> tuple[float, dict]:
    plan = kvpool.size_for(SPEC, a.dtype, num_tokens=a.device_pages * a.page_size,
                           page_size=a.page_size, host_pages=a.host_pages)
    pool = kvpool.KVPool(plan, device=a.device)
    host = HostPool(pool)
    pages_io = Pages(pool, host)
    if with_host:
        tier = HostTier(pool, host_pool=host)
        cache, alloc = tier.cache, tier.allocator
    else:
        tier = None
        alloc = kvpool.PageAllocator(plan.num_pages, plan.page_size)
        cache = kvpool.RadixCache(alloc)
    ps, asked, reused = plan.page_size, 0, 0
    for prompt, answer in workload(a):
        seq = np.concatenate([prompt, answer])
        if tier is not None:
            m = tier.match(prompt)
        else:
            p, node, n = cache.match_prefix(prompt)
            m = TierMatch(p, node, n, np.zeros(0, np.int32), node, 0)
        cache.lock(m.node)
        load = tier.load(m) if tier is not None else None
        loaded = load.device_pages if load is not None else np.zeros(0, np.int32)
        locked = [m.node]
        if load is not None and load.loaded_back:
            cache.lock(m.host_node)
            locked.append(m.host_node)
        prefix = np.concatenate([m.pages, loaded]).astype(np.int32)
        cached = len(prefix) * ps
        pages_io.check(seq, prefix)
        need = -(-len(seq) // ps) - len(prefix)
        own = tier.alloc(need) if tier is not None else cache.alloc(need)
        all_pages = np.concatenate([prefix, own]).astype(np.int32)
        pages_io.fill(seq, all_pages, len(prefix))  # prefill of the rest, then the answer
        asked += len(prompt)
        reused += cached
        cache.insert(seq, (m.pages, loaded, own))
        for node in reversed(locked):
            cache.unlock(node)
        alloc.free(own)
        if len(loaded):
            alloc.free(loaded)
        cache.check_invariants()
    metrics = tier.metrics() if tier is not None else {}
    return reused / asked, metrics


def main(argv: list[str] | None = None) -> tuple[float, float]:
    a = parser().parse_args(argv)
    without, _ = replay(a, with_host=False)
    with_, _ = replay(a, with_host=True)
    print(f"host_tier: hit_rate_without={without:.4f} hit_rate_with={with_:.4f}")
    return without, with_


if __name__ == "__main__":
    main()
