"""Type stub of the native module ``kvpool._core`` (Rust, PyO3). Byte counts are ``int`` bytes."""

from typing import Literal, TypeAlias, final

import numpy as np
import numpy.typing as npt
from typing_extensions import Self

_KvDtypeName = Literal[
    "auto", "fp32", "bf16", "fp16", "fp8", "fp8_e4m3", "fp8_e5m2", "nvfp4", "fp4_mx_block16"
]
_Nvfp4RecipeName = Literal["linear", "page_major", "mixed", "linear_workspace"]

__all__ = [
    "KvDtypeError",
    "ModelConfigError",
    "LayoutError",
    "SizingError",
    "BudgetTooSmallError",
    "OutOfPagesError",
    "PageError",
    "InvalidArgumentError",
    "StaleNodeError",
    "LockError",
    "CacheBusyError",
    "CacheCorruptError",
    "BatchError",
    "ArrayTypeError",
    "KV_DTYPES",
    "ModelGeometry",
    "Plan",
    "kv_budget_bytes",
    "plan",
    "PageAllocator",
    "RadixNode",
    "RadixCache",
    "page_table",
    "pages_needed",
    "assign_pages",
    "extend_slots",
    "decode_slots",
]

KV_DTYPES: list[str]
"""The KV cache dtypes kvpool can size and store (``auto`` aside)."""

class KvDtypeError(ValueError): ...
class ModelConfigError(ValueError): ...
class LayoutError(ValueError): ...
class SizingError(ValueError): ...
class BudgetTooSmallError(SizingError): ...

@final
class ModelGeometry:
    """Attention geometry (global, before TP sharding).

    ``linear_state``: per rank ``(conv_dim, conv_kernel - 1, conv dtype, num_v_heads,
    k_head_dim, v_head_dim, ssm dtype)`` (dtypes fp32/bf16/fp16); without it,
    ``linear_conv_bytes``/``linear_ssm_bytes`` store the state as raw bytes.
    ``layer_windows``: per-layer window (overrides ``sliding_window``); ``kv_shared_sources``:
    shared layer -> source layer; ``draft``: the draft model's geometry.
    """

    def __new__(
        cls,
        *,
        layer_kinds: list[Literal["full", "sliding", "linear", "shared"]],
        num_attention_heads: int,
        num_kv_heads: int,
        head_dim: int,
        v_head_dim: int,
        sliding_window: int | None = None,
        kv_lora_rank: int | None = None,
        qk_rope_head_dim: int | None = None,
        linear_conv_bytes: int = 0,
        linear_ssm_bytes: int = 0,
        layer_windows: list[int | None] | None = None,
        sliding_head_dim: int | None = None,
        sliding_v_head_dim: int | None = None,
        kv_shared_sources: dict[int, int] | None = None,
        linear_state: tuple[int, int, str, int, int, int, str] | None = None,
        draft: ModelGeometry | None = None,
    ) -> Self: ...
    def kv_heads_per_rank(self, tp_size: int) -> int: ...
    @property
    def num_layers(self) -> int: ...

#: (name, layer, tensor, role, torch dtype, shape, nbytes, group, space)
_BufferRow = tuple[str, int | None, str, str, str, list[int], int, str, str]
#: (name, kind, layers, space, kv_heads, head_dim, v_head_dim, bytes per row, bytes)
_GroupRow = tuple[str, str, list[int], str | None, int, int, int, int, int]
#: (name, kind, page_size, num_pages, rows, bytes per row, bytes, headroom pages,
#:  capped_by_int32, requests of context_len tokens)
_SpaceRow = tuple[str, str, int, int, int, int, int, int, bool, int]

@final
class Plan:
    """A sized pool (see ``kvpool.Plan`` for the documented wrapper)."""

    @property
    def num_tokens(self) -> int: ...
    @property
    def num_pages(self) -> int: ...
    @property
    def num_state_slots(self) -> int: ...
    @property
    def page_size(self) -> int: ...
    @property
    def context_len(self) -> int: ...
    @property
    def chunked_prefill_size(self) -> int | None: ...
    @property
    def num_draft_tokens(self) -> int: ...
    @property
    def kv_heads_per_rank(self) -> int: ...
    @property
    def budget_bytes(self) -> int: ...
    @property
    def bytes_per_token(self) -> int: ...
    @property
    def fixed_bytes(self) -> int: ...
    @property
    def total_bytes(self) -> int: ...
    @property
    def k_bytes(self) -> int: ...
    @property
    def v_bytes(self) -> int: ...
    @property
    def scale_bytes(self) -> int: ...
    @property
    def workspace_bytes(self) -> int: ...
    @property
    def state_bytes(self) -> int: ...
    @property
    def nvfp4_recipe(self) -> _Nvfp4RecipeName: ...
    @property
    def dtype(self) -> str: ...
    @property
    def layer_dtypes(self) -> list[str | None]: ...
    @property
    def shared_sources(self) -> list[int | None]: ...
    @property
    def buffers(self) -> list[_BufferRow]: ...
    @property
    def groups(self) -> list[_GroupRow]: ...
    @property
    def page_spaces(self) -> list[_SpaceRow]: ...
    def request_bytes(self, n: int) -> int: ...
    def requests_fit(self, n: int) -> int: ...
    def linear_state_bytes(self) -> tuple[int, int]: ...

def kv_budget_bytes(total_memory: int, available_memory: int, mem_frac: float) -> int: ...
def plan(
    geometry: ModelGeometry,
    dtype: _KvDtypeName,
    *,
    model_dtype: str = "bf16",
    page_size: int = 1,
    tp_size: int = 1,
    nvfp4_recipe: _Nvfp4RecipeName = "linear",
    overrides: list[tuple[int, str]] = ...,
    sliding_dtype: str | None = None,
    budget: int | None = None,
    num_tokens: int | None = None,
    context_len: int = 8192,
    chunked_prefill_size: int | None = ...,  # 8192
    num_draft_tokens: int = 0,
) -> Plan: ...


_Int32Array: TypeAlias = npt.NDArray[np.int32]
_IntArray: TypeAlias = npt.NDArray[np.int32] | npt.NDArray[np.int64]
_Namespace: TypeAlias = None | int | str | bytes | tuple["_Namespace", ...]


# --- exceptions ----------------------------------------------------------------------------------

class OutOfPagesError(MemoryError):
    """Not enough free pages; nothing was allocated or evicted.

    Attributes
    ----------
    requested : int
        Pages asked for.
    free : int
        Pages free in the allocator at the time.
    evictable : int
        Pages that evicting every unlocked cache entry would have returned (0 for
        ``PageAllocator.alloc``).
    """

    requested: int
    free: int
    evictable: int

class PageError(ValueError):
    """A page id that cannot be used here: padding page 0, out of range, free (double free),
    repeated within one call, held only by the cache, or already cached under another key."""

class InvalidArgumentError(ValueError):
    """A bad argument: negative count, zero sizes, mismatched tokens/pages lengths, a token
    beyond int32, a cache page size that differs from the allocator's, a namespace of an
    unsupported type."""

class StaleNodeError(KeyError):
    """A node handle whose node was evicted, whose cache was reset, or that belongs to another
    cache."""

class LockError(ValueError):
    """``unlock`` without a matching ``lock`` on the same node (the count would go below zero)."""

class CacheBusyError(RuntimeError):
    """The cache cannot do this (``reset``) while locks are held."""

class CacheCorruptError(RuntimeError):
    """``RadixCache.check_invariants`` found a broken invariant (a bug in kvpool)."""

class BatchError(ValueError):
    """Inconsistent batch metadata: lengths, page-table width, missing pages, slot overflow."""

class ArrayTypeError(TypeError, ValueError):
    """An array argument of the wrong dtype, rank or memory order (or not a numpy array)."""

# --- allocator -----------------------------------------------------------------------------------

@final
class PageAllocator:
    """Pages ``1..num_pages`` of ``page_size`` tokens with reference counts.

    Every call is atomic: it validates its whole input first and changes nothing on error.

    Parameters
    ----------
    num_pages : int
        Usable pages (page 0, the padding page, comes on top). ``(num_pages + 1) * page_size``
        must fit in int32 slot indices.
    page_size : int
        Tokens per page.
    debug : bool, default False
        Record a generation per page in the arrays handed out, so that freeing such an array
        (or a view of it) after its pages were handed out again raises ``PageError``. Copies
        and concatenations of a stale array are not caught.

    Examples
    --------
    >>> import kvpool
    >>> a = kvpool.PageAllocator(4, 16)
    >>> p = a.alloc(2)
    >>> p.tolist(), a.num_free
    ([1, 2], 2)
    >>> a.free(p)
    >>> a.num_free
    4
    """

    def __new__(cls, num_pages: int, page_size: int, debug: bool = False) -> Self: ...
    def alloc(self, n: int) -> _Int32Array:
        """Hands out ``n`` pages, one reference each.

        Raises
        ------
        OutOfPagesError
            Fewer than ``n`` pages are free (nothing is allocated).
        InvalidArgumentError
            ``n`` is negative.
        """
    def try_alloc(self, n: int) -> _Int32Array | None:
        """As ``alloc``, but returns None when fewer than ``n`` pages are free."""
    def free(self, pages: _IntArray) -> None:
        """Drops one reference on each page; a page returns to the free list at zero.

        Raises
        ------
        PageError
            Padding page, out of range, already free, repeated in ``pages``, or a page whose
            only remaining reference is the cache's (nothing changes).
        ArrayTypeError
            ``pages`` is not a contiguous 1-D int32/int64 numpy array.
        """
    def inc_ref(self, pages: _IntArray) -> None:
        """Adds one reference to each (allocated, listed once) page: another holder shares it."""
    def ref_counts(self) -> npt.NDArray[np.uint32]:
        """A copy of every page's reference count, index 0 (padding) included."""
    @property
    def num_free(self) -> int:
        """Pages with no reference."""
    @property
    def num_used(self) -> int:
        """Pages with at least one reference (``num_free + num_used == num_pages``)."""
    @property
    def num_pages(self) -> int:
        """Usable pages (ids ``1..num_pages``)."""
    @property
    def page_size(self) -> int:
        """Tokens per page."""
    @property
    def debug(self) -> bool:
        """Whether generation checks are on (``debug=True``)."""

# --- radix cache ---------------------------------------------------------------------------------

@final
class RadixNode:
    """An opaque handle to a cache node, from ``match_prefix``; hashable, comparable.

    It stays valid while the node exists (later splits and inserts keep it valid); after the
    node is evicted or the cache reset, using it raises ``StaleNodeError``.
    """

@final
class RadixCache:
    """Radix prefix cache over token ids, at page granularity, sharing ``allocator``.

    Both objects wrap one Rust allocator: requests allocate and free through either. The cache
    keeps its own reference on every page it stores; ``evict`` drops it. A partial last page is
    never cached. Equal tokens in different namespaces never match.

    Parameters
    ----------
    allocator : PageAllocator
        The allocator whose pages the cache stores.
    page_size : int, optional
        Must equal ``allocator.page_size`` (the default).

    Examples
    --------
    >>> import numpy as np, kvpool
    >>> a = kvpool.PageAllocator(8, 2)
    >>> c = kvpool.RadixCache(a)
    >>> tokens = np.array([5, 6, 7, 8, 9], dtype=np.int32)
    >>> pages = c.alloc(3)
    >>> c.insert(tokens, pages)  # caches the 2 whole pages; returns tokens already present
    0
    >>> a.free(pages)  # the request's references; the cache keeps its own
    >>> cached, node, n = c.match_prefix(tokens)
    >>> cached.tolist(), n
    ([1, 2], 4)
    """

    def __new__(cls, allocator: PageAllocator, page_size: int | None = None) -> Self: ...
    def match_prefix(
        self, tokens: _IntArray, namespace: _Namespace = None
    ) -> tuple[_Int32Array, RadixNode, int]:
        """Longest cached page-aligned prefix of ``tokens``.

        Returns ``(pages, node, matched_len)``: the page ids (int32), a handle to the node where
        the match ends (lock it to keep the pages), the matched length in tokens. A match ending
        inside an edge splits it there. Takes no lock; updates LRU times and hit/miss counters.

        ``namespace`` keys separate trees: None, an int, str, bytes, or (nested) tuples of those,
        e.g. ``(("lora", adapter_id), ("salt", cache_salt))``. Values are tag-encoded, so
        ``("lora", 1)`` and ``("salt", "1")`` (or ``1`` and ``"1"``) never collide; values equal
        in Python (``1 == True``) are one namespace.
        """
    def insert(
        self,
        tokens: _IntArray,
        pages: _IntArray | tuple[_IntArray, ...] | list[_IntArray],
        namespace: _Namespace = None,
    ) -> int:
        """Caches the whole pages of ``tokens``; returns how many tokens were already cached.

        ``pages`` has one id per page of ``tokens`` (``len(tokens) // page_size``, or one more
        for the partial last page, which is not cached). The cache takes a reference on the
        pages of the part not cached yet; the others stay the caller's. The caller frees its own
        references as usual.

        ``pages`` may also be a tuple or list of 1-D arrays standing for their concatenation,
        e.g. ``(matched_pages, new_pages)`` as ``match_prefix`` and ``alloc`` returned them: the
        same result, without building the concatenated array (only the pages the cache takes
        are read).

        Raises
        ------
        InvalidArgumentError
            Mismatched lengths, a token beyond int32.
        PageError
            A bad page id, or a page of the new part that is free, repeated or already cached.
        """
    def lock(self, node: RadixNode) -> None:
        """Protects the node and its path to the root from eviction (counted)."""
    def unlock(self, node: RadixNode) -> None:
        """Releases one ``lock`` of this very node.

        Raises
        ------
        LockError
            The node holds no lock of its own.
        StaleNodeError
            The node is gone.
        """
    def evict(self, num_tokens: int) -> int:
        """Evicts least-recently-used unlocked leaves (then their parents) until ``num_tokens``
        tokens left the cache or nothing evictable is left; returns the tokens evicted (whole
        nodes, so possibly more than asked)."""
    def alloc(self, n: int) -> _Int32Array:
        """Allocates ``n`` pages, evicting LRU entries first when fewer are free.

        Raises
        ------
        OutOfPagesError
            Not even evicting everything evictable would free enough; nothing changed.
        """
    def try_alloc(self, n: int) -> _Int32Array | None:
        """As ``alloc``, but returns None instead of raising ``OutOfPagesError``."""
    def reset(self) -> None:
        """Empties the cache and zeroes the counters; every handle becomes stale.

        Raises
        ------
        CacheBusyError
            A lock is held.
        """
    def check_invariants(self) -> None:
        """Checks the tree's structure against the allocator (O(tree), for tests)."""
    def leaf_paths(self, namespace: _Namespace = None) -> list[tuple[_Int32Array, _Int32Array]]:
        """Every root-to-leaf path of a namespace as (tokens, pages), for tests and debugging."""
    @property
    def allocator(self) -> PageAllocator:
        """The shared allocator."""
    @property
    def page_size(self) -> int:
        """Tokens per page."""
    @property
    def evictable_size(self) -> int:
        """Cached tokens no lock protects."""
    @property
    def protected_size(self) -> int:
        """Cached tokens on locked paths."""
    @property
    def total_size(self) -> int:
        """All cached tokens (``evictable_size + protected_size``)."""
    @property
    def hit_tokens(self) -> int:
        """Tokens ``match_prefix`` served from the cache."""
    @property
    def miss_tokens(self) -> int:
        """Tokens asked of ``match_prefix`` and not served (partial last pages included)."""
    @property
    def num_nodes(self) -> int:
        """Nodes holding tokens."""

# --- batch helpers -------------------------------------------------------------------------------

def page_table(
    pages: list[_IntArray], max_pages: int | None = None, *, out: _Int32Array | None = None
) -> _Int32Array:
    """The ``[B, max_pages]`` int32 page table of a batch, rows padded with page 0.

    ``max_pages`` defaults to the longest row (or ``out``'s width); ``out`` is filled in place.
    """

def pages_needed(prefix_lens: _IntArray, seq_lens: _IntArray, page_size: int) -> _Int32Array:
    """New pages per request to grow from ``prefix_lens`` to ``seq_lens`` tokens:
    ``ceil(seq / page_size) - ceil(prefix / page_size)``."""

def assign_pages(
    page_table: _Int32Array, prefix_lens: _IntArray, seq_lens: _IntArray, new_pages: _IntArray, page_size: int
) -> None:
    """Writes ``new_pages`` (batch order, ``pages_needed`` each) into the row entries
    ``ceil(prefix / page_size) .. ceil(seq / page_size)`` of ``page_table``, in place."""

def extend_slots(
    page_table: _Int32Array,
    prefix_lens: _IntArray,
    seq_lens: _IntArray,
    page_size: int,
    *,
    out: _Int32Array | None = None,
) -> _Int32Array:
    """Slot indices (``page * page_size + offset``) of tokens ``prefix_lens[i]..seq_lens[i]``
    of every request, concatenated in batch order; the last partial page fills first.

    Examples
    --------
    >>> import numpy as np, kvpool
    >>> table = np.array([[7, 8]], dtype=np.int32)
    >>> lens = lambda *x: np.array(x, dtype=np.int32)
    >>> kvpool.extend_slots(table, lens(3), lens(6), 4).tolist()  # page 7 offset 3, then page 8
    [31, 32, 33]
    """

def decode_slots(
    page_table: _Int32Array, seq_lens: _IntArray, page_size: int, *, out: _Int32Array | None = None
) -> _Int32Array:
    """Slot of each request's last token (position ``seq_lens[i] - 1``) for a decode step."""
