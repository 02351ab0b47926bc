"""Hypothesis state machine: the KV event stream replayed into a model equals the tree's pages.

The model is what a router keeps: the set of stored block hashes (with each one's parent and
tokens), changed only by the events (`BlockStored` adds, `BlockRemoved` removes,
`AllBlocksCleared` empties). After every step of random inserts, matches (which split edges),
locks, evictions, allocations that evict, and resets, the events are drained and applied, and:

- every `BlockStored` hash is new, its parent is stored (or None for a namespace's first page),
  and the hashes recompute from the parent (or the namespace's root) and the tokens with the
  `xxhash` package;
- every `BlockRemoved` hash is stored;
- the model's hashes equal `kvpool.page_hashes` of every leaf path of every namespace, and the
  tokens the model holds for each hash equal that path's page;
- a full snapshot replayed into an empty model gives the same model.
"""

import os
import struct

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import kvpool
from kvpool import CacheBusyError, OutOfPagesError

PROFILES = {
    "ci": dict(max_examples=60, stateful_step_count=40, derandomize=True),
    "long": dict(max_examples=1000, stateful_step_count=100),
}
SETTINGS = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    **PROFILES[os.environ.get("KVPOOL_HYPOTHESIS_PROFILE", "ci")],
)
SEED = 99
NAMESPACES = [None, ("lora", 1), "salt"]
# canonical namespace bytes (rust/src/radix/namespace.rs), written out for the hash check
NS_BYTES = {
    None: b"N" + bytes(8),
    ("lora", 1): b"T" + struct.pack("<QQ", 8, 2) + b"S" + struct.pack("<Q", 4) + b"lora"
    + b"I" + struct.pack("<Q", 1) + b"\x01",
    "salt": b"S" + struct.pack("<Q", 4) + b"salt",
}


def chain(prev, tokens, ps):
    out = []
    for i in range(len(tokens) // ps):
        prev = xxhash.xxh3_64_intdigest(
            struct.pack(f"<Q{ps}i", prev, *tokens[i * ps : (i + 1) * ps]), seed=SEED)
        out.append(prev)
    return out


def root(ns_bytes):
    return xxhash.xxh3_64_intdigest(b"kvpool.page_hash.v1" + ns_bytes, seed=SEED)


class Model:
    def __init__(self, ps):
        self.ps = ps
        self.blocks: dict[int, tuple[int | None, tuple[int, ...]]] = {}

    def apply(self, events):
        for e in events:
            if e[0] == "BlockStored":
                _, hashes, parent, tokens, block_size, medium, ns = e
                assert block_size == self.ps and medium == "GPU"
                assert len(tokens) == len(hashes) * self.ps
                if parent is None:
                    assert ns is None or ns in NS_BYTES.values()
                    prev = root(ns if ns is not None else NS_BYTES[None])
                else:
                    assert ns is None
                    assert parent in self.blocks, "parent of a stored block is not stored"
                    prev = parent
                assert chain(prev, tokens, self.ps) == hashes
                for i, h in enumerate(hashes):
                    assert h not in self.blocks, "block stored twice"
                    self.blocks[h] = (prev if i == 0 else hashes[i - 1],
                                      tuple(tokens[i * self.ps : (i + 1) * self.ps]))
            elif e[0] == "BlockRemoved":
                assert e[2] == "GPU"
                for h in e[1]:
                    assert h in self.blocks, "removed block was not stored"
                    del self.blocks[h]
            else:
                assert e == ("AllBlocksCleared",)
                self.blocks.clear()


class EventsMachine(RuleBasedStateMachine):
    PS = 1

    def __init__(self):
        super().__init__()
        self.alloc = kvpool.PageAllocator(24, self.PS)
        self.cache = kvpool.RadixCache(self.alloc, kv_events=True, hash_seed=SEED)
        self.model = Model(self.PS)
        self.seqs: list[list[int]] = [[]]
        self.locked: list = []

    def _tokens(self, data):
        base = data.draw(st.sampled_from(self.seqs))
        cut = data.draw(st.integers(0, len(base)))
        tail = data.draw(st.lists(st.integers(0, 3), max_size=4 * self.PS))
        return base[:cut] + tail

    @rule(data=st.data(), ns=st.sampled_from(NAMESPACES))
    def insert(self, data, ns):
        tokens = self._tokens(data)
        n = len(tokens) // self.PS
        try:
            pages = self.cache.alloc(n)  # may evict
        except OutOfPagesError:
            return
        self.cache.insert(np.array(tokens, dtype=np.int32), pages, ns)
        self.alloc.free(pages)
        self.seqs.append(tokens)

    @rule(data=st.data(), ns=st.sampled_from(NAMESPACES), lock=st.booleans())
    def match(self, data, ns, lock):
        _, node, n = self.cache.match_prefix(np.array(self._tokens(data), dtype=np.int32), ns)
        if lock and n:
            self.cache.lock(node)
            self.locked.append(node)

    @precondition(lambda self: self.locked)
    @rule(data=st.data())
    def unlock(self, data):
        node = self.locked.pop(data.draw(st.integers(0, len(self.locked) - 1)))
        self.cache.unlock(node)

    @rule(n=st.integers(0, 12))
    def evict(self, n):
        self.cache.evict(n)

    @rule()
    def reset(self):
        if self.locked:
            with pytest.raises(CacheBusyError):
                self.cache.reset()
        else:
            self.cache.reset()

    @rule()
    def snapshot_equals_the_stream(self):
        self.model.apply(self.cache.take_kv_events())
        snap = Model(self.PS)
        snap.apply(self.cache.kv_events_snapshot())
        assert snap.blocks == self.model.blocks
        assert self.cache.take_kv_events() == []

    @invariant()
    def stream_equals_tree(self):
        self.model.apply(self.cache.take_kv_events())
        want = {}
        for ns in NAMESPACES:
            for toks, _pages in self.cache.leaf_paths(ns):
                hs = kvpool.page_hashes(toks, self.PS, seed=SEED, namespace=ns).tolist()
                for i, h in enumerate(hs):
                    want[h] = tuple(toks[i * self.PS : (i + 1) * self.PS].tolist())
        assert {h: t for h, (_, t) in self.model.blocks.items()} == want
        self.cache.check_invariants()


class EventsMachinePs2(EventsMachine):
    PS = 2


TestEventsPs1 = EventsMachine.TestCase
TestEventsPs1.settings = SETTINGS
TestEventsPs2 = EventsMachinePs2.TestCase
TestEventsPs2.settings = SETTINGS
