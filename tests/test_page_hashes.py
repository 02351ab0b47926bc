"""kvpool.page_hashes against an independent XXH3 implementation (the `xxhash` package)."""

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

import kvpool

DOMAIN = b"kvpool.page_hash.v1"
# The tagged encoding of namespace None: tag b"N", payload length 0 as a little-endian u64.
NS_NONE = b"N" + (0).to_bytes(8, "little")


def reference(tokens, page_size, seed, ns_bytes=NS_NONE):
    prev = xxhash.xxh3_64_intdigest(DOMAIN + ns_bytes, seed=seed)
    out = []
    arr = np.asarray(tokens, dtype="<i4")
    for i in range(len(arr) // page_size):
        page = arr[i * page_size : (i + 1) * page_size].tobytes()
        prev = xxhash.xxh3_64_intdigest(prev.to_bytes(8, "little") + page, seed=seed)
        out.append(prev)
    return out


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**31 - 1), max_size=70),
    page_size=st.sampled_from([1, 2, 16]),
    seed=st.integers(0, 2**64 - 1),
)
def test_matches_independent_xxh3(tokens, page_size, seed):
    got = kvpool.page_hashes(np.array(tokens, dtype=np.int64), page_size, seed=seed)
    assert got.dtype == np.uint64
    assert got.tolist() == reference(tokens, page_size, seed)


def test_namespace_encoding_and_chaining():
    t = np.arange(64, dtype=np.int32)
    # str namespace: tag b"S", length, utf-8 bytes
    ns = b"S" + (6).to_bytes(8, "little") + b"lora-1"
    assert kvpool.page_hashes(t, 16, seed=3, namespace="lora-1").tolist() == reference(t, 16, 3, ns)
    assert kvpool.page_hashes(t, 16, seed=3, namespace="lora-1")[0] != kvpool.page_hashes(t, 16, seed=3)[0]
    whole = kvpool.page_hashes(t, 16, seed=3)
    tail = kvpool.page_hashes(t[32:], 16, seed=3, parent=int(whole[1]))
    assert tail.tolist() == whole[2:].tolist()
    # a long call (GIL released) gives the same values
    long = np.arange(40_000, dtype=np.int32) % 50_000
    assert kvpool.page_hashes(long, 16, seed=9).tolist() == reference(long, 16, 9)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(seed=-1), "`seed` must be an int in 0 .. 2\\*\\*64 - 1, got -1"),
        (dict(seed=2**64), "`seed`"),
        (dict(seed=True), "got True"),
        (dict(seed=1.5), "got 1.5"),
        (dict(seed=0, parent=-2), "`parent`"),
        # numpy scalars: an out-of-range one is named by its value, a bool one is refused
        (dict(seed=np.int64(-1)), "`seed` must be an int in 0 .. 2\\*\\*64 - 1, got -1$"),
        (dict(seed=np.bool_(True)), "`seed` must be an int in 0 .. 2\\*\\*64 - 1, got "),
        (
            dict(seed=0, parent=2**64),
            "`parent` must be an int in 0 .. 2\\*\\*64 - 1, got 18446744073709551616$",
        ),
    ],
)
def test_bad_seed_or_parent(kwargs, match):
    with pytest.raises(ValueError, match=match):
        kvpool.page_hashes(np.arange(4, dtype=np.int32), 2, **kwargs)


def test_numpy_integer_seeds_are_accepted():
    t = np.arange(4, dtype=np.int32)
    want = kvpool.page_hashes(t, 2, seed=2**64 - 1).tolist()
    assert kvpool.page_hashes(t, 2, seed=np.uint64(2**64 - 1)).tolist() == want
    assert want == reference(t, 2, 2**64 - 1)


def test_bad_tokens_and_page_size():
    with pytest.raises(kvpool.InvalidArgumentError, match="page_size"):
        kvpool.page_hashes(np.arange(4, dtype=np.int32), 0, seed=0)
    with pytest.raises(kvpool.InvalidArgumentError, match="-1"):
        kvpool.page_hashes(np.array([1, -1], dtype=np.int32), 1, seed=0)
    with pytest.raises(kvpool.InvalidArgumentError, match="4294967296"):
        kvpool.page_hashes(np.array([2**32], dtype=np.int64), 1, seed=0)
