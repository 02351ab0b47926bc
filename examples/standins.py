"""Thin stand-ins for kvpool pieces that land on other branches, used only until they arrive.

Each one follows the documented API (issues 3, 4 and 5; shared/DESIGN.md) and is used only when
the real one is missing: ``kvpool.PageAllocator`` / ``kvpool.RadixCache`` (Rust, issue 3),
``KVPool.write`` (quantized write, issue 4), ``KVPool.decode`` / ``KVPool.extend`` (attention,
issue 5). They handle the unscaled dtypes (fp32, bf16, fp16) and per-tensor fp8 only.
"""

from __future__ import annotations

import types
from itertools import count

import numpy as np
import torch
import torch.nn.functional as F

import kvpool

# ------------------------------------------------------------------ allocator + radix cache


class PageAllocator:
    """Pages ``1..num_pages`` with reference counts (page 0 is the padding page)."""

    def __init__(self, num_pages: int, page_size: int):
        self.num_pages, self.page_size = num_pages, page_size
        self.refs = np.zeros(num_pages + 1, dtype=np.int64)
        self.free_list = list(range(num_pages, 0, -1))

    def num_free(self) -> int:
        return len(self.free_list)

    def num_used(self) -> int:
        return self.num_pages - len(self.free_list)

    def alloc(self, n: int) -> np.ndarray:
        if n > len(self.free_list):
            raise MemoryError(f"out of pages: asked {n}, free {len(self.free_list)}")
        out = np.array([self.free_list.pop() for _ in range(n)], dtype=np.int32)
        self.refs[out] = 1
        return out

    def inc_ref(self, pages) -> None:
        self.refs[np.asarray(pages, dtype=np.int64)] += 1

    def free(self, pages) -> None:
        for p in np.asarray(pages, dtype=np.int64).tolist():
            if p <= 0 or self.refs[p] <= 0:
                raise ValueError(f"double free or bad page `{p}`")
            self.refs[p] -= 1
            if self.refs[p] == 0:
                self.free_list.append(p)


class _Node:
    __slots__ = ("key", "page", "parent", "children", "lock", "last")

    def __init__(self, key, page, parent):
        self.key, self.page, self.parent = key, page, parent
        self.children: dict = {}
        self.lock, self.last = 0, 0


class RadixCache:
    """One node per page (a page-granular trie); LRU eviction of unlocked leaves."""

    def __init__(self, allocator: PageAllocator, page_size: int):
        self.a, self.ps = allocator, page_size
        self.root = _Node(None, 0, None)
        self.root.lock = 1
        self.clock = count(1)
        self.hit_tokens = self.miss_tokens = 0

    def _walk(self, tokens):
        node, pages, ps = self.root, [], self.ps
        toks = [int(t) for t in tokens]
        for i in range(0, len(toks) // ps * ps, ps):
            child = node.children.get(tuple(toks[i : i + ps]))
            if child is None:
                break
            node = child
            pages.append(node.page)
        return node, pages

    def match_prefix(self, tokens):
        node, pages = self._walk(tokens)
        t = next(self.clock)
        n = node
        while n is not None:
            n.last = t
            n = n.parent
        matched = len(pages) * self.ps
        self.hit_tokens += matched
        self.miss_tokens += len(tokens) - matched
        return np.array(pages, dtype=np.int32), node, matched

    def insert(self, tokens, pages) -> int:
        toks = [int(t) for t in tokens]
        node, present = self.root, 0
        t = next(self.clock)
        for j, i in enumerate(range(0, len(toks) // self.ps * self.ps, self.ps)):
            key = tuple(toks[i : i + self.ps])
            child = node.children.get(key)
            if child is None:
                child = _Node(key, int(pages[j]), node)
                node.children[key] = child
                self.a.inc_ref([child.page])
            else:
                present += self.ps
            child.last = t
            node = child
        return present

    def lock(self, node) -> None:
        while node is not None:
            node.lock += 1
            node = node.parent

    def unlock(self, node) -> None:
        while node is not None:
            if node.lock <= 0:
                raise ValueError("unlock below zero")
            node.lock -= 1
            node = node.parent

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    @property
    def evictable_size(self) -> int:
        return sum(self.ps for n in self._nodes() if n.lock == 0)

    @property
    def protected_size(self) -> int:
        return sum(self.ps for n in self._nodes() if n.lock > 0)

    @property
    def total_size(self) -> int:
        return sum(self.ps for _ in self._nodes())

    def evict(self, num_tokens: int) -> int:
        freed = 0
        while freed < num_tokens:
            leaves = [n for n in self._nodes() if not n.children and n.lock == 0]
            if not leaves:
                break
            n = min(leaves, key=lambda x: x.last)
            del n.parent.children[n.key]
            self.a.free([n.page])
            freed += self.ps
        return freed

    def alloc(self, n: int) -> np.ndarray:
        short = n - self.a.num_free()
        if short > 0:
            self.evict(short * self.ps)
        return self.a.alloc(n)


def cache_classes():
    """The real ``(PageAllocator, RadixCache)`` when kvpool has them, else the stand-ins."""
    if hasattr(kvpool, "RadixCache") and hasattr(kvpool, "PageAllocator"):
        return kvpool.PageAllocator, kvpool.RadixCache
    return PageAllocator, RadixCache


# ------------------------------------------------------------------ write + attention

_FP8_MAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}


def _store(view, name, x):
    buf = getattr(view, name)
    if view.dtype in _FP8_MAX:
        s = getattr(view, f"{name}_scale")
        m = _FP8_MAX[view.dtype]
        return (x.float() / s).clamp(-m, m).to(buf.dtype)
    if view.dtype in ("fp32", "bf16", "fp16"):
        return x.to(buf.dtype)
    raise NotImplementedError(f"stand-in write: `{view.dtype}` waits for the quantized write")


def _load(view, name, slots):
    x = getattr(view, name)[slots].float()
    if view.dtype in _FP8_MAX:
        x = x * getattr(view, f"{name}_scale")
    return x


def _write(pool, layer, loc, k, v):
    view = pool.layer(layer)
    view.k[loc] = _store(view, "k", k)
    view.v[loc] = _store(view, "v", v)


def _attend(pool, layer, q, page_table, seq_lens, extend_lens, sm_scale):
    view, ps = pool.layer(layer), pool.page_size
    outs, row = [], 0
    for b in range(seq_lens.numel()):
        n, e = int(seq_lens[b]), int(extend_lens[b])
        pos = torch.arange(n, device=q.device)
        slots = page_table[b].long()[pos // ps] * ps + pos % ps
        k, v = _load(view, "k", slots), _load(view, "v", slots)  # [n, Hkv, D]
        qb = q[row : row + e].float().transpose(0, 1)  # [Hq, e, D]
        rep = qb.shape[0] // k.shape[1]
        k = k.transpose(0, 1).repeat_interleave(rep, 0)
        v = v.transpose(0, 1).repeat_interleave(rep, 0)
        mask = torch.ones(e, n, dtype=torch.bool, device=q.device).tril(n - e)
        o = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, scale=sm_scale)
        outs.append(o.transpose(0, 1).to(q.dtype))
        row += e
    return torch.cat(outs)


def _decode(pool, layer, q, page_table, seq_lens, *, sm_scale=None):
    ones = torch.ones_like(seq_lens)
    return _attend(pool, layer, q, page_table, seq_lens, ones, sm_scale)


def _extend(pool, layer, q, page_table, seq_lens, extend_lens, *, sm_scale=None):
    return _attend(pool, layer, q, page_table, seq_lens, extend_lens, sm_scale)


def install(pool):
    """Give ``pool`` stand-in ``write`` / ``decode`` / ``extend`` where the real ones are missing."""
    for name, fn in (("write", _write), ("decode", _decode), ("extend", _extend)):
        if not hasattr(pool, name):
            setattr(pool, name, types.MethodType(fn, pool))
    return pool
