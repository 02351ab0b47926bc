"""Speculative decoding through the pool's calls: draft, verify with `extend`, rollback, insert.

A toy target model (the next token is a hash of the sequence) and a toy draft that proposes the
target's token half of the time. The "KV" of a slot is the token written there, so the test can
check that every committed position's slot holds its token, that rejected drafts never enter
the radix tree, that `rollback_slots` never returns a page the tree holds, and that no page
leaks.
"""

import kvpool
import numpy as np
import pytest

PS = 4
K = 3  # draft tokens per step
VOCAB = 1000


def target(seq):
    """The toy target model: the next token after `seq`."""
    return (sum((i + 1) * t for i, t in enumerate(seq[-8:])) * 2654435761) % VOCAB


class Request:
    def __init__(self, prompt):
        self.tokens = list(prompt)  # committed tokens; the last one's KV is not written yet
        self.seq = 0  # tokens with KV written
        self.cached = 0  # prefix the tree may hold (matched, then inserted)
        self.node = None


def run(n_requests=6, steps=12, seed=0):
    rng = np.random.default_rng(seed)
    a = kvpool.PageAllocator(256, PS)
    cache = kvpool.RadixCache(a, PS)
    kv = np.full((a.num_pages + 1) * PS, -1, dtype=np.int64)  # slot -> token written there
    max_pages = 64
    table = np.zeros((n_requests, max_pages), dtype=np.int32)
    shared = rng.integers(0, VOCAB, 10).tolist()  # a common prefix, so later requests hit
    reqs = []
    drafted = accepted = 0
    lens = lambda xs: np.array(xs, dtype=np.int32)  # noqa: E731
    for i in range(n_requests):
        prompt = shared + rng.integers(0, VOCAB, 3 + i).tolist()
        r = Request(prompt)
        pages, r.node, n = cache.match_prefix(np.array(prompt[:-1], dtype=np.int32))
        cache.lock(r.node)
        a.inc_ref(pages)  # the request's own reference on the matched pages
        table[i, : len(pages)] = pages
        # Prefill the rest of the prompt but its last token (which feeds the first step).
        new = cache.alloc(int(kvpool.pages_needed(lens([n]), lens([len(prompt) - 1]), PS)[0]))
        kvpool.assign_pages(table[i : i + 1], lens([n]), lens([len(prompt) - 1]), new, PS)
        slots = kvpool.extend_slots(table[i : i + 1], lens([n]), lens([len(prompt) - 1]), PS)
        kv[slots] = prompt[n : len(prompt) - 1]
        r.seq = len(prompt) - 1
        cache.insert(np.array(prompt[: r.seq], dtype=np.int32), table[i, : -(-r.seq // PS)])
        r.cached = r.seq // PS * PS
        reqs.append(r)
    for _ in range(steps):
        # Draft: K tokens per request, each the target's with probability 1/2.
        drafts = []
        for r in reqs:
            d, ctx = [], list(r.tokens)
            for _ in range(K):
                t = target(ctx)
                t = t if rng.random() < 0.5 else (t + 1) % VOCAB
                d.append(t)
                ctx.append(t)
            drafts.append(d)
        prefix = lens([r.seq for r in reqs])
        seq = prefix + 1 + K  # the last committed token and the K drafts
        new = cache.alloc(int(kvpool.pages_needed(prefix, seq, PS).sum()))
        kvpool.assign_pages(table, prefix, seq, new, PS)
        # Verify: one extend step writes the KV of every input token.
        slots = kvpool.extend_slots(table, prefix, seq, PS)
        kv[slots] = [t for r, d in zip(reqs, drafts, strict=True) for t in [r.tokens[-1], *d]]
        acc = []
        for r, d in zip(reqs, drafts, strict=True):
            m = 0
            while m < K and d[m] == target(r.tokens + d[:m]):
                m += 1
            drafted += K
            accepted += m
            r.tokens += d[:m] + [target(r.tokens + d[:m])]  # accepted drafts, then the bonus
            acc.append(r.seq + 1 + m)  # KV written and kept: the last token and m drafts
        tree_pages = {p for _, pg in cache.leaf_paths() for p in pg.tolist()}
        free, new_lens = kvpool.rollback_slots(table, seq, lens(acc), PS, cached_lens=lens([r.cached for r in reqs]))
        # Independent expectation: each row's entries ceil(acc / PS) .. ceil(seq / PS), batch order.
        want = [int(p) for i, (q, s) in enumerate(zip(acc, seq.tolist(), strict=True))
                for p in table[i, -(-q // PS) : -(-s // PS)]]
        assert free.tolist() == want
        assert new_lens.tolist() == acc
        assert not set(free.tolist()) & tree_pages, "rollback returned a page the tree holds"
        a.free(free)
        for r, n in zip(reqs, new_lens.tolist(), strict=True):
            r.seq = n
        # Commit: insert only tokens whose KV is written and accepted.
        for i, r in enumerate(reqs):
            row = table[i, : -(-r.seq // PS)]
            cache.insert(np.array(r.tokens[: r.seq], dtype=np.int32), row)
            r.cached = r.seq // PS * PS
        cache.check_invariants()
        for i, r in enumerate(reqs):
            pos = np.arange(r.seq)
            got = kv[table[i, pos // PS].astype(np.int64) * PS + pos % PS]
            assert got.tolist() == r.tokens[: r.seq], "a committed position lost its KV"
    # The tree holds committed tokens only, each page's KV being its tokens.
    for toks, pages in cache.leaf_paths():
        slots = (pages.astype(np.int64)[:, None] * PS + np.arange(PS)).ravel()
        assert kv[slots].tolist() == toks.tolist()
        assert any(r.tokens[: len(toks)] == toks.tolist() for r in reqs)
    # Requests finish: their own references go, the locks too; then the tree empties: no leak.
    for i, r in enumerate(reqs):
        a.free(table[i, : -(-r.seq // PS)])
        cache.unlock(r.node)
    cache.evict(10**9)
    assert a.num_free == a.num_pages and cache.total_size == 0
    return accepted / drafted, cache


def test_toy_draft_right_half_the_time():
    rate, cache = run()
    assert 0.2 < rate < 0.6  # each draft token right with probability 1/2; accepted in a row
    assert cache.hit_tokens > 0  # later requests matched the shared prefix


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_toy_draft_seeds(seed):
    run(n_requests=3, steps=8, seed=seed)


def test_rollback_bad_input_names_the_value_and_returns_nothing():
    table = np.array([[5, 6, 7]], dtype=np.int32)
    before = table.copy()
    lens = lambda *x: np.array(x, dtype=np.int32)  # noqa: E731
    with pytest.raises(kvpool.BatchError, match=r"`accepted_lens\[0\]` = 9 exceeds `seq_lens\[0\]` = 8"):
        kvpool.rollback_slots(table, lens(8), lens(9), PS)
    with pytest.raises(kvpool.BatchError, match=r"`accepted_lens\[0\]` = 3 is below `cached_lens\[0\]` = 4"):
        kvpool.rollback_slots(table, lens(8), lens(3), PS, cached_lens=lens(4))
    with pytest.raises(kvpool.BatchError, match=r"`accepted_lens\[0\]` is negative: `-1`"):
        kvpool.rollback_slots(table, lens(8), lens(-1), PS)
    with pytest.raises(kvpool.BatchError, match=r"`page_table\[0, 2\]` = `0`"):
        kvpool.rollback_slots(np.array([[5, 6, 0]], dtype=np.int32), lens(12), lens(1), PS)
    with pytest.raises(kvpool.BatchError, match="max_pages"):
        kvpool.rollback_slots(table, lens(13), lens(1), PS)
    with pytest.raises(kvpool.ArrayTypeError):
        kvpool.rollback_slots(table.astype(np.int64), lens(8), lens(3), PS)
    assert (table == before).all()
    free, new = kvpool.rollback_slots(table, lens(12), lens(5), PS)
    assert (free.tolist(), new.tolist(), free.dtype, new.dtype) == ([7], [5], np.int32, np.int32)
    free, new = kvpool.rollback_slots(table, np.array([12]), np.array([4]), PS)  # int64 lens
    assert free.tolist() == [6, 7]
