"""Type stub of the native module ``kvpool._core`` (Rust, PyO3). Byte counts are ``int`` bytes."""

from collections.abc import Callable
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
    "PinBudgetError",
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
    "StateSlotAllocator",
    "RadixNode",
    "RadixCache",
    "KvEventBatch",
    "page_table",
    "pages_needed",
    "assign_pages",
    "extend_slots",
    "grow_pages",
    "decode_slots",
    "release_window_pages",
    "page_hashes",
    "rollback_slots",
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
_KvEventTuple: TypeAlias = (
    tuple[Literal["BlockStored"], list[int], int | None, list[int], int, str, bytes | None]
    | tuple[Literal["BlockRemoved"], list[int], str]
    | tuple[Literal["AllBlocksCleared"]]
)


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

class PinBudgetError(LockError):
    """A ``pin`` that would take the pinned tokens beyond ``max_pinned_tokens`` (nothing
    changed)."""

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

@final
class StateSlotAllocator:
    """Linear-attention state slots ``1..num_slots``, one per running request (slot 0 is padding).

    The same core type as ``PageAllocator`` (a pool of page size 1): atomic, ref-counted, so a
    ``RadixCache`` can hold a saved state (a checkpoint) as it holds a page. Errors name state
    slots: ``OutOfPagesError`` ("out of state slots", ``evictable`` 0) and ``PageError``.

    Parameters
    ----------
    num_slots : int
        Usable slots (slot 0, the padding slot, comes on top), e.g. the plan's state slots.

    Examples
    --------
    >>> import kvpool
    >>> s = kvpool.StateSlotAllocator(4)
    >>> slot = s.alloc(1)  # at admission
    >>> slot.tolist(), s.num_free
    ([1], 3)
    >>> s.free(slot)  # when the request finishes
    """

    def __new__(cls, num_slots: int) -> Self: ...
    def alloc(self, n: int) -> _Int32Array:
        """Hands out ``n`` slots, one reference each.

        Raises
        ------
        OutOfPagesError
            Fewer than ``n`` slots are free (message names state slots; nothing is allocated).
        """
    def try_alloc(self, n: int) -> _Int32Array | None:
        """As ``alloc``, but returns None when fewer than ``n`` slots are free."""
    def free(self, slots: _IntArray) -> None:
        """Drops one reference on each slot; at zero it is free again.

        Raises
        ------
        PageError
            Padding slot 0, out of range, already free, repeated, or held only by the cache
            (nothing changes).
        """
    def inc_ref(self, slots: _IntArray) -> None:
        """Adds one reference to each (allocated, listed once) slot."""
    def ref_counts(self) -> npt.NDArray[np.uint32]:
        """A copy of every slot's reference count, index 0 (padding) included."""
    @property
    def num_free(self) -> int:
        """Slots with no reference."""
    @property
    def num_used(self) -> int:
        """Slots with at least one reference."""
    @property
    def num_slots(self) -> int:
        """Usable slots (ids ``1..num_slots``)."""

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
        The allocator whose pages the cache stores (the full-attention page space).
    page_size : int, optional
        Must equal ``allocator.page_size`` (the default).
    sliding : list of (PageAllocator, int), optional
        Hybrid models: each sliding-window page space's allocator and its window in tokens
        (same page size). Each cached page then also records that group's page (0 where the
        request had released it).
    state_slots : StateSlotAllocator, optional
        Models with linear-attention layers: the state-slot pool. A match then needs a state
        saved exactly at its end (``insert(..., state_slot=...)`` at page-aligned points), so
        without checkpoints every match has length 0 (``has_state_slots`` says so).
    host_allocator : PageAllocator, optional
        A host-memory tier over these host page ids (same page size; not with ``sliding`` or
        ``state_slots``): eviction of an unlocked device leaf then demotes it to host pages
        (``take_demotions`` lists the copies to make), the host tier drops its own LRU entries
        when full, ``match_prefix_host`` finds host pages after the device match and
        ``load_back`` moves them back (see :mod:`kvpool.tier`).
    max_pinned_tokens : int, default 0
        The pin budget in tokens: ``pin`` beyond it raises ``PinBudgetError`` (0: no pins).
    now : callable, optional
        The clock, returning seconds (any origin), e.g. ``time.monotonic`` or a test's fake
        clock; read before any lock is taken. Default: seconds since the cache was made, from
        Rust's monotonic ``std::time::Instant``. An earlier reading than the latest counts as
        the latest.
    kv_events : bool, default False
        Record KV events for KV-aware routers (vLLM's ``enable_kv_cache_events``): each cached
        page keeps its chained hash (``page_hashes``) and every change of the cached pages is
        recorded in the call that makes it, for ``take_kv_events`` (see ``kvpool.events``).
    hash_seed : int, default 0
        Seed of the page hashes (0 .. 2**64 - 1), the same on every instance a router compares;
        only with ``kv_events=True`` (else ``InvalidArgumentError``).

    Notes
    -----
    A hybrid cache (``sliding`` or ``state_slots`` given) matches only as long as every group
    can serve: all full-attention pages of the prefix, the sliding pages of the last ``window``
    tokens before the match point (none released), and a saved state there. ``match_prefix``
    returns that length too; ``match_prefix_groups`` also returns each group's pages and the
    state slot. Eviction releases every group's pages and state slots with the node. Calls that
    touch pages lock the cache, then the full allocator, the sliding ones in order, the state
    pool: the same allocator may not serve two spaces (``InvalidArgumentError``).

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

    def __new__(
        cls,
        allocator: PageAllocator,
        page_size: int | None = None,
        *,
        sliding: list[tuple[PageAllocator, int]] | None = None,
        state_slots: StateSlotAllocator | PageAllocator | None = None,
        host_allocator: PageAllocator | None = None,
        max_pinned_tokens: int | None = None,
        now: Callable[[], float] | None = None,
        kv_events: bool = False,
        hash_seed: int | None = None,
    ) -> Self: ...
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
        *,
        sliding_pages: list[_IntArray] | None = None,
        state_slot: int | None = None,
        priority: int | None = None,
        retention_s: float | None = None,
    ) -> int:
        """Caches the whole pages of ``tokens``; returns how many tokens were already cached.

        ``priority`` (0..100, default 0) and ``retention_s`` (seconds, default None: no decay)
        go to the nodes this call inserts or walks through, until ``retention_s`` after their
        last hit; a lower priority never lowers a node's current one. Insert committed tokens
        only (see ``rollback_slots``).

        ``pages`` has one id per page of ``tokens`` (``len(tokens) // page_size``, or one more
        for the partial last page, which is not cached). The cache takes a reference on the
        pages of the part not cached yet; the others stay the caller's. The caller frees its own
        references as usual.

        ``pages`` may also be a tuple or list of 1-D arrays standing for their concatenation,
        e.g. ``(matched_pages, new_pages)`` as ``match_prefix`` and ``alloc`` returned them: the
        same result, without building the concatenated array (only the pages the cache takes
        are read).

        Hybrid caches: ``sliding_pages`` (required) holds one int32 array per sliding group,
        one entry per page as ``pages`` (the request's sliding page-table row; 0 where
        released); the cache takes a reference on the live ones of the part not cached yet.
        ``state_slot`` (optional) holds the linear-attention state after exactly ``tokens``
        (``len(tokens)`` a positive multiple of ``page_size``): the cache takes a reference on
        it unless a state is saved there already. The caller frees its own references as usual.

        Raises
        ------
        InvalidArgumentError
            Mismatched lengths, a token beyond int32; a missing or misshapen ``sliding_pages``;
            ``state_slot`` on a cache without a state pool or at a point not page-aligned.
        PageError
            A bad page id, or a page of the new part that is free, repeated or already cached
            (``sliding_pages[g]`` named for a sliding page; state slots named as such).
        """
    def match_prefix_groups(
        self, tokens: _IntArray, namespace: _Namespace = None
    ) -> tuple[_Int32Array, RadixNode, int, list[_Int32Array], int]:
        """``match_prefix`` of a hybrid cache, with every group's part.

        Returns ``(pages, node, matched_len, sliding_pages, state_slot)``: ``matched_len`` is
        the longest page-aligned prefix every group serves (see the class notes);
        ``sliding_pages[g]`` has one int32 entry per matched page, the pages of the last
        ``window`` tokens before ``matched_len`` and 0 before them (a request's page-table row;
        its ``first_live`` is the first nonzero entry); ``state_slot`` is the state saved after
        ``matched_len`` tokens (0 for an empty match or no state pool).

        The pages are the cache's, kept by ``lock(node)``. A request that will release its
        sliding pages with ``release_window_pages`` first takes its own reference on the
        matched ones (``allocator.inc_ref(pages[pages != 0])``); it copies the state out of the
        slot into its own (the cache's slot is never written).
        """
    def alloc_sliding(self, group: int, n: int) -> _Int32Array:
        """``alloc`` for sliding group ``group`` (an index into ``sliding``): evicts LRU
        entries until ``n`` pages of that space are free.

        Raises
        ------
        OutOfPagesError
            Not even evicting everything evictable would free enough; nothing changed.
        """
    def alloc_state_slots(self, n: int) -> _Int32Array:
        """``alloc`` for the state-slot pool (evicting checkpoints LRU first).

        Raises
        ------
        OutOfPagesError
            Not enough state slots even after evicting all that is evictable; nothing changed.
        """
    def leaf_paths_groups(
        self, namespace: _Namespace = None
    ) -> list[tuple[_Int32Array, _Int32Array, list[_Int32Array], _Int32Array]]:
        """Every root-to-leaf path as (tokens, pages, sliding pages per group, states), where
        ``states[j]`` is the state slot saved after ``j + 1`` pages (0: none); for tests."""
    @property
    def sliding(self) -> list[tuple[PageAllocator, int]]:
        """The sliding groups' allocators and windows (empty for a plain cache)."""
    @property
    def state_slots(self) -> StateSlotAllocator | PageAllocator | None:
        """The state-slot pool, or None."""
    @property
    def has_state_slots(self) -> bool:
        """Whether matches need a saved linear-attention state: only checkpoints inserted with
        ``state_slot`` can match; with none, every match has length 0."""
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
    def pin(self, node: RadixNode) -> None:
        """Keeps the node's path in the cache across requests until ``unpin`` (apart from locks).

        Raises
        ------
        PinBudgetError
            The pinned tokens would exceed ``max_pinned_tokens``; nothing changed.
        StaleNodeError
            The node is gone.
        InvalidArgumentError
            The node is on the host tier (``load_back`` it first).
        """
    def unpin(self, node: RadixNode) -> None:
        """Releases one ``pin`` of this very node.

        Raises
        ------
        LockError
            The node holds no pin of its own.
        StaleNodeError
            The node is gone.
        """
    def stats(self) -> dict[str, int | dict[int, int]]:
        """Counters: ``evicted_tokens``, ``evicted_nodes``, ``evicted_tokens_by_priority``
        ({priority: tokens}), ``pinned_tokens``, ``max_pinned_tokens``, ``retention_expiries``,
        ``retained_nodes``, and the hit/miss/size properties."""
    def evict(self, num_tokens: int) -> int:
        """Evicts unlocked, unpinned leaves (then their parents), lowest current priority first
        and least recently used within one, until ``num_tokens`` tokens left the cache or
        nothing evictable is left; returns the tokens evicted (whole
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
        """Empties the cache and zeroes the counters (pins are dropped); every handle becomes stale.

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
        """Cached tokens no lock or pin protects."""
    @property
    def protected_size(self) -> int:
        """Cached tokens on locked or pinned paths."""
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
    def match_prefix_host(
        self, tokens: _IntArray, namespace: _Namespace = None
    ) -> tuple[_Int32Array, RadixNode, int]:
        """Host pages that continue the device match of ``tokens`` (a cache with a host tier).

        Returns ``(host_pages, node, host_len)``: int32 host page ids of the tokens after
        ``match_prefix``'s matched length, the node where they end (for ``load_back``; the
        device match's end when ``host_len`` is 0) and their length in tokens. The host edge is
        split where the match ends; no device counter changes.

        Raises
        ------
        InvalidArgumentError
            No host tier; a negative token id.
        """
    def load_back(self, node: RadixNode, pages: _IntArray) -> int:
        """Moves host node ``node`` and its host ancestors back to the device tier.

        ``pages``: device page ids the caller holds and filled with the host pages' bytes, one
        per host page from the device tier down to ``node`` (``match_prefix_host``'s pages, in
        order). The cache takes its reference on them and frees the host pages. Returns the
        tokens moved. Call it once the copies succeeded; on a failed load leave the node on the
        host and recompute.

        Raises
        ------
        StaleNodeError
            The node was dropped (a full host pool) or the cache reset.
        InvalidArgumentError
            The node is on the device; wrong length; no host tier.
        PageError
            A bad device page (padding, out of range, free, repeated, already cached).
        """
    def take_demotions(self) -> tuple[_Int32Array, _Int32Array]:
        """``(device_pages, host_pages)`` demoted since the last call (int32, one shape): copy
        each device page to its host page, in order, before the device page is written again
        (``alloc``, ``try_alloc`` and ``evict`` demote; ``kvpool.tier.HostTier`` copies them).

        Raises
        ------
        InvalidArgumentError
            No host tier.
        """
    def tier_stats(self) -> dict[str, int]:
        """The host tier's counters: ``demoted_pages``, ``dropped_pages`` (evicted with no host
        copy), ``host_evicted_pages``, ``loaded_pages`` (by ``load_back``),
        ``host_query_tokens``, ``host_hit_tokens``, ``host_size`` (tokens on the host now)."""
    @property
    def host_allocator(self) -> PageAllocator | None:
        """The host tier's allocator, or None."""
    @property
    def pinned_tokens(self) -> int:
        """Tokens on pinned paths (each counted once)."""
    @property
    def max_pinned_tokens(self) -> int:
        """The pin budget in tokens."""
    def take_kv_events(self) -> list[_KvEventTuple]:
        """The KV events recorded since the last call, in order (empty without ``kv_events``).

        ``("BlockStored", block_hashes, parent_block_hash, token_ids, block_size, medium,
        namespace)``: uint64 hashes of pages newly cached along one edge, the hash of the page
        before them (None for a namespace's first page), their token ids, the page size,
        the medium (``"GPU"``, or ``"CPU"`` on the host tier), the namespace's canonical bytes
        on a namespace's first page (else None); ``("BlockRemoved", block_hashes, medium)``:
        pages evicted (merged over one call). With a host tier a demotion is ``BlockRemoved``
        (GPU) then ``BlockStored`` (CPU) of the node's pages, ``load_back`` the reverse;
        ``("AllBlocksCleared",)``: ``reset``. More than 2**22 tokens of stored pages left untaken
        are replaced by a snapshot. Built after the cache's lock is released.
        """
    def take_kv_events_batch(self, *, snapshot: bool = False) -> KvEventBatch:
        """``take_kv_events`` (or with ``snapshot`` a snapshot) as a ``KvEventBatch`` held in Rust
        (O(1), no Python object per event)."""
    def kv_events_snapshot(self) -> list[_KvEventTuple]:
        """``("AllBlocksCleared",)`` then every cached page as ``BlockStored`` (parents first);
        drops the pending events."""
    def kv_event_counts(self) -> dict[str, int]:
        """``events``, ``blocks_stored``, ``blocks_removed``, ``overflows`` since the cache was built."""
    @property
    def kv_events(self) -> bool:
        """Whether the cache records KV events."""
    @property
    def hash_seed(self) -> int | None:
        """The seed of the page hashes, or None without KV events."""

@final
class KvEventBatch:
    """KV events taken from a ``RadixCache`` in one call, held in Rust.

    ``len(batch)`` events; ``encode`` writes vLLM's wire form with the GIL released;
    ``to_list()`` gives the tuples of ``take_kv_events``.
    """

    def __len__(self) -> int: ...
    def encode(self, event_format: Literal["array", "map"] = "array") -> bytes:
        """The events as one msgpack array (the second item of a batch payload)."""
    def to_list(self) -> list[_KvEventTuple]:
        """The events as ``take_kv_events`` tuples."""
    @property
    def blocks_stored(self) -> int:
        """Pages the batch announces as stored."""
    @property
    def blocks_removed(self) -> int:
        """Pages the batch announces as removed."""

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

def grow_pages(
    page_table: _Int32Array,
    num_pages: _Int32Array,
    seq_lens: _IntArray,
    page_size: int,
    alloc: Callable[[int], _IntArray],
) -> tuple[npt.NDArray[np.int64], _Int32Array]:
    """Grows a running decode batch's page table in place (``kvpool.running.RunningBatch.grow``).

    Every row ``i`` whose ``num_pages[i]`` pages hold fewer than its ``seq_lens[i]`` tokens
    (``ceil(seq_lens[i] / page_size) - num_pages[i]`` pages short) gets that many pages from
    one call ``alloc(k)`` (``k`` the total, returning ``k`` int32/int64 page ids >= 1, in row
    order), written into ``page_table[i, num_pages[i]:]``; ``num_pages`` grows by them.
    ``page_table`` ``[B, max_pages]`` int32 and ``num_pages`` ``[B]`` int32, both C-contiguous
    and written in place; ``seq_lens`` ``[B]`` int32/int64. Returns ``(rows, pages)``: the
    rows that grew (int64, ascending) and the pages given (empty, and ``alloc`` not called,
    when no row is short).

    Raises ``ValueError`` (kvpool.BatchError) for a negative length or page count, a row that
    would need more than ``max_pages`` entries (``alloc`` not called), or ``alloc`` giving the
    wrong number of pages or page 0; ``TypeError`` for arrays of another kind or read-only;
    ``RuntimeError`` when ``num_pages`` changed while ``alloc`` ran. Sizes, writability and
    widths are checked before ``alloc`` is called; whatever ``alloc`` raises propagates.
    Nothing is written on any error (pages ``alloc`` gave before one are the caller's).

    Examples
    --------
    >>> import numpy as np, kvpool._core as core
    >>> table = np.array([[7, 0], [8, 0]], dtype=np.int32)
    >>> num = np.array([1, 1], dtype=np.int32)
    >>> rows, pages = core.grow_pages(table, num, np.array([17, 5], np.int32), 16,
    ...                               lambda k: np.arange(20, 20 + k, dtype=np.int32))
    >>> rows.tolist(), pages.tolist(), table.tolist(), num.tolist()
    ([0], [20], [[7, 20], [8, 0]], [2, 1])
    """

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

def rollback_slots(
    page_table: _Int32Array,
    seq_lens: _IntArray,
    accepted_lens: _IntArray,
    page_size: int,
    *,
    cached_lens: _IntArray | None = None,
) -> tuple[_Int32Array, _Int32Array]:
    """Speculative-decoding rollback: ``(pages_to_free, new_seq_lens)``, the pages of entries
    ``ceil(accepted / page_size) .. ceil(seq / page_size)`` of each row (int32, batch order)
    and ``accepted_lens`` as int32. The table is only read.

    Raises
    ------
    BatchError
        ``accepted_lens[i] > seq_lens[i]``, ``accepted_lens[i] < cached_lens[i]``, a negative
        length, a padding entry among those to free (nothing returned).
    """

def release_window_pages(
    allocator: PageAllocator,
    page_table: _Int32Array,
    seq_lens: _IntArray,
    window: int,
    *,
    num_draft_tokens: int = 0,
    first_live: _Int32Array | None = None,
) -> int:
    """Frees the pages of a sliding-window page space that no query reads again, for a batch.

    A sliding layer's query at position ``p`` reads positions ``p - window + 1 .. p``. After the
    call, request ``i`` holds exactly the pages that intersect positions
    ``[max(0, seq_lens[i] - window - num_draft_tokens), seq_lens[i] - 1]``: at most
    ``ceil(min(n, window + d) / page_size) + (1 if page_size > 1 else 0)`` pages, what the
    sizing plan counts per request. Released entries of ``page_table`` become 0 (the padding
    page; the kernels never read before the window), so the table keeps its meaning.

    Parameters
    ----------
    allocator : PageAllocator
        The sliding group's allocator (its ``page_size`` is used).
    page_table : ndarray of int32, shape [B, max_pages]
        The group's page table, C-contiguous; updated in place.
    seq_lens : ndarray of int32 or int64, shape [B]
        Tokens per request after the current step, draft tokens included. For a decode step
        (one new token) the call may come before the forward: its query at ``seq_lens - 1``
        reads only kept positions. For an extend step call it after the forward.
    window : int
        The window in tokens (>= 1).
    num_draft_tokens : int, optional
        Tokens of the current step a speculative verify may still roll back: the pages they
        could roll back into are kept; call again with 0 once the step commits.
    first_live : ndarray of int32, shape [B], optional
        The first entry each request may still hold; read and advanced in place, so a call
        costs O(B + pages released) (without it each row is looked at from entry 0). Start at
        0, or at the first nonzero entry of a row from ``match_prefix_groups``.

    Returns
    -------
    int
        References dropped (one per released entry; a page shared by several rows drops one
        reference per row, and a page the prefix cache also holds keeps the cache's).

    Raises
    ------
    BatchError
        Mismatched lengths, negative or too long ``seq_lens``, a row too narrow for its
        request, ``window`` 0, ``first_live`` outside ``0..max_pages``.
    PageError
        ``page_table[i, j]`` names a page out of range, free, held only by the prefix cache, or
        listed more often than it has references. Nothing changes on any error.

    Examples
    --------
    >>> import numpy as np, kvpool
    >>> a = kvpool.PageAllocator(8, 4)
    >>> table = a.alloc(3).reshape(1, 3)  # 10 tokens on pages 1, 2, 3
    >>> first_live = np.zeros(1, dtype=np.int32)
    >>> kvpool.release_window_pages(a, table, np.array([10]), 4, first_live=first_live)
    1
    >>> table.tolist(), first_live.tolist(), a.num_used
    ([[0, 2, 3]], [1], 2)
    """

def page_hashes(
    tokens: _IntArray,
    page_size: int,
    *,
    seed: int,
    namespace: _Namespace = None,
    parent: int | None = None,
) -> npt.NDArray[np.uint64]:
    """Chained 64-bit hashes of the whole pages of ``tokens`` (XXH3-64, seeded; see
    ``help(kvpool.page_hashes)`` for the definition): the keys of KV events and of a shared page
    store, equal in every process that uses the same ``seed``."""
