"""A straightforward pure-Python radix prefix cache and page allocator: the baseline of the bench.

Same semantics as kvpool's Rust cache (page-granular keys, split on a match that ends inside an
edge, lock counts along the path, LRU eviction of unlocked leaves, cache.alloc evicting first),
written the way a Python serving engine writes it: nodes with dict children keyed by the first
page of tokens, keys as Python lists, a heap of leaves built at each eviction. No validation
beyond what the algorithm needs; it exists to be timed against, not to be used.
"""

import heapq
import itertools


class PyAllocator:
    def __init__(self, num_pages, page_size):
        self.page_size = page_size
        self.free_pages = list(range(num_pages, 0, -1))
        self.refs = [0] * (num_pages + 1)

    @property
    def num_free(self):
        return len(self.free_pages)

    def alloc(self, n):
        if n > len(self.free_pages):
            return None
        out = self.free_pages[len(self.free_pages) - n :][::-1]
        del self.free_pages[len(self.free_pages) - n :]
        for p in out:
            self.refs[p] = 1
        return out

    def free(self, pages):
        for p in pages:
            self.refs[p] -= 1
            if self.refs[p] == 0:
                self.free_pages.append(p)

    def inc_ref(self, pages):
        for p in pages:
            self.refs[p] += 1


class Node:
    __slots__ = ("parent", "key", "pages", "children", "lock", "last_access")

    def __init__(self, parent, key, pages, last_access):
        self.parent = parent
        self.key = key
        self.pages = pages
        self.children = {}
        self.lock = 0
        self.last_access = last_access


class PyRadixCache:
    def __init__(self, allocator, page_size):
        self.alloc_ = allocator
        self.page_size = page_size
        self.root = Node(None, [], [], 0)
        self.clock = itertools.count(1)
        self.evictable_size = 0
        self.protected_size = 0
        self.hit_tokens = 0
        self.miss_tokens = 0

    def _first(self, key, i=0):
        return tuple(key[i : i + self.page_size])

    @staticmethod
    def _common(a, b):
        n = min(len(a), len(b))
        i = 0
        while i < n and a[i] == b[i]:
            i += 1
        return i

    def _split(self, child, m):
        ps = self.page_size
        mid = Node(child.parent, child.key[:m], child.pages[: m // ps], child.last_access)
        mid.lock = child.lock
        child.parent.children[self._first(mid.key)] = mid
        child.key = child.key[m:]
        child.pages = child.pages[m // ps :]
        child.parent = mid
        mid.children[self._first(child.key)] = child
        return mid

    def match_prefix(self, tokens):
        key = tokens.tolist()
        ps = self.page_size
        aligned = len(key) // ps * ps
        now = next(self.clock)
        node, pos, pages = self.root, 0, []
        while pos < aligned:
            child = node.children.get(self._first(key, pos))
            if child is None:
                break
            m = self._common(child.key, key[pos:aligned]) // ps * ps
            pages += child.pages[: m // ps]
            pos += m
            whole = m == len(child.key)
            if not whole:
                child = self._split(child, m)
            child.last_access = now
            node = child
            if not whole:
                break
        self.hit_tokens += pos
        self.miss_tokens += len(key) - pos
        return pages, node, pos

    def insert(self, tokens, pages):
        if isinstance(pages, tuple):  # parts of the page list, as kvpool accepts them
            pages = list(itertools.chain(*pages))
        key = tokens.tolist()
        ps = self.page_size
        aligned = len(key) // ps * ps
        now = next(self.clock)
        node, pos = self.root, 0
        while pos < aligned:
            child = node.children.get(self._first(key, pos))
            if child is None:
                break
            m = self._common(child.key, key[pos:aligned]) // ps * ps
            pos += m
            whole = m == len(child.key)
            if not whole:
                child = self._split(child, m)
            child.last_access = now
            node = child
            if not whole:
                break
        if pos < aligned:
            new = pages[pos // ps : aligned // ps]
            self.alloc_.inc_ref(new)
            leaf = Node(node, key[pos:aligned], new, now)
            node.children[self._first(leaf.key)] = leaf
            self.evictable_size += aligned - pos
        return pos

    def lock(self, node):
        while node is not self.root:
            if node.lock == 0:
                self.evictable_size -= len(node.key)
                self.protected_size += len(node.key)
            node.lock += 1
            node = node.parent

    def unlock(self, node):
        while node is not self.root:
            node.lock -= 1
            if node.lock == 0:
                self.evictable_size += len(node.key)
                self.protected_size -= len(node.key)
            node = node.parent

    def _leaves(self):
        out, stack = [], [self.root]
        while stack:
            n = stack.pop()
            if not n.children:
                if n is not self.root and n.lock == 0:
                    out.append(n)
            else:
                stack.extend(n.children.values())
        return out

    def evict(self, num_tokens, until_free_pages=None):
        heap = [(n.last_access, id(n), n) for n in self._leaves()]
        heapq.heapify(heap)
        evicted = 0
        while heap:
            if until_free_pages is None and evicted >= num_tokens:
                break
            if until_free_pages is not None and self.alloc_.num_free >= until_free_pages:
                break
            _, _, n = heapq.heappop(heap)
            self.alloc_.free(n.pages)
            evicted += len(n.key)
            self.evictable_size -= len(n.key)
            parent = n.parent
            del parent.children[self._first(n.key)]
            if parent is not self.root and not parent.children and parent.lock == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return evicted

    def alloc(self, n):
        if self.alloc_.num_free < n:
            self.evict(0, until_free_pages=n)
        pages = self.alloc_.alloc(n)
        if pages is None:
            raise MemoryError(f"out of pages: asked for {n}")
        return pages

    @property
    def total_size(self):
        return self.evictable_size + self.protected_size
