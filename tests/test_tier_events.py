"""KV events on a cache with a host tier and retention (all three together): a demotion is
BlockRemoved on GPU then BlockStored on CPU of the node's pages, load_back the reverse, a host
entry dropped BlockRemoved on CPU; the events replayed give the snapshot's (hash, medium) set.

Hashes are recomputed with the `xxhash` package from the definition in rust/src/hash.rs.
"""

import struct

import numpy as np
import xxhash
from kvpool import PageAllocator, RadixCache

SEED = 99
NS_NONE = b"N" + bytes(8)


def ref_hashes(tokens, ps=1, seed=SEED):
    prev = xxhash.xxh3_64_intdigest(b"kvpool.page_hash.v1" + NS_NONE, seed=seed)
    out = []
    for i in range(len(tokens) // ps):
        prev = xxhash.xxh3_64_intdigest(struct.pack(f"<Q{ps}i", prev, *tokens[i * ps:(i + 1) * ps]),
                                        seed=seed)
        out.append(prev)
    return out


def toks(*v):
    return np.array(v, dtype=np.int32)


def cache(dev, host, **kw):
    return RadixCache(PageAllocator(dev, 1), 1, host_allocator=PageAllocator(host, 1),
                      kv_events=True, hash_seed=SEED, **kw)


def put(c, tokens, **kw):
    pages = c.alloc(len(tokens))
    c.insert(tokens, pages, **kw)
    c.allocator.free(pages)
    c.take_demotions()
    c.check_invariants()


def apply(seen, events):
    for e in events:
        if e[0] == "BlockStored":
            for h in e[1]:
                assert (h, e[5]) not in seen
                seen.add((h, e[5]))
        elif e[0] == "BlockRemoved":
            for h in e[1]:
                seen.remove((h, e[2]))
        else:
            seen.clear()


def synced(c, seen):
    apply(seen, c.take_kv_events())
    want = set()
    apply(want, c.kv_events_snapshot())
    return seen == want


def test_demotion_load_back_and_drop_with_retention_and_pins():
    c = cache(4, 4, max_pinned_tokens=2)
    seen = set()
    put(c, toks(1, 2), priority=50)
    put(c, toks(3, 4))
    node = c.match_prefix(toks(1, 2))[1]
    c.pin(node)
    assert synced(c, seen)
    put(c, toks(5, 6))  # [1, 2] is older but pinned and of a higher priority: [3, 4] goes down
    ev = c.take_kv_events()
    h34 = ref_hashes([3, 4])
    assert ev[0] == ("BlockRemoved", h34, "GPU")
    assert ev[1] == ("BlockStored", h34, None, [3, 4], 1, "CPU", None)
    assert ev[2][0] == "BlockStored" and ev[2][5] == "GPU" and ev[2][3] == [5, 6]
    apply(seen, ev)
    assert (h34[0], "CPU") in seen and (ref_hashes([1, 2])[0], "GPU") in seen
    host, hnode, n = c.match_prefix_host(toks(3, 4))
    assert n == 2
    c.unpin(node)
    dev = c.alloc(2)  # demotes [5, 6] (priority 0, the LRU of the two device leaves)
    assert synced(c, seen)
    assert c.load_back(hnode, dev) == 2
    c.allocator.free(dev)
    ev = c.take_kv_events()
    assert ev[:2] == [("BlockRemoved", h34, "CPU"),
                      ("BlockStored", h34, None, [3, 4], 1, "GPU", None)]
    apply(seen, ev)
    assert synced(c, seen)
    put(c, toks(7, 8))  # host: [5, 6]; a demotion makes room by dropping host entries
    put(c, toks(9, 9))
    assert synced(c, seen)
    assert c.tier_stats()["host_evicted_pages"] > 0
    stats = c.kv_event_counts()
    assert stats["blocks_stored"] - stats["blocks_removed"] == len(seen)
    c.reset()
    assert c.take_kv_events() == [("AllBlocksCleared",)]
    assert c.kv_events and c.host_allocator is not None
