//! Bindings of `radix`: `RadixCache` and its node handles (namespaces from Python values:
//! `namespace.rs`).
//!
//! Sharing: `RadixCache(allocator)` keeps a clone of the allocator's `Arc<Mutex<PageAllocator>>`,
//! so both Python objects see one allocator (requests allocate and free through either). The tree
//! has its own mutex; calls that touch both lock the cache first, then the allocator.

use std::sync::Mutex;

use numpy::PyArray1;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};

use super::alloc::{guard, hand_out, try_guard, with_lock, PyPageAllocator, Shared, DETACH_MIN};
use super::array::{count, ints, page_array, Int};
use super::error::{to_py, InvalidArgumentError};
use super::namespace::namespace;
use crate::alloc::{try_vec, AllocError, PageAllocator};
use crate::radix::{Handle, RadixCache, RadixError};

#[path = "radix_events.rs"]
mod events;
#[path = "radix_groups.rs"]
mod groups;
use groups::Groups;
#[path = "radix_tier.rs"]
mod tier;
#[path = "radix_retention.rs"]
mod retention;
use retention::Clock;

/// An opaque handle to a cache node, from `match_prefix`; hashable, comparable.
///
/// It stays valid while the node exists (later splits and inserts keep it valid); after the node is
/// evicted or the cache reset, using it raises `StaleNodeError`.
#[pyclass(name = "RadixNode", module = "kvpool._core", frozen, eq, hash)]
#[derive(PartialEq, Eq, Hash)]
pub(crate) struct PyRadixNode(Handle);

#[pymethods]
impl PyRadixNode {
    /// `RadixNode(slot)`.
    fn __repr__(&self) -> String {
        format!("RadixNode({})", self.0.node().get())
    }
}

/// `insert`'s `pages`: one array, or the items of a tuple / list of arrays standing for their
/// concatenation.
fn page_parts<'py>(pages: &Bound<'py, PyAny>) -> Vec<Bound<'py, PyAny>> {
    if let Ok(tup) = pages.cast::<PyTuple>() {
        tup.iter().collect()
    } else if let Ok(list) = pages.cast::<PyList>() {
        list.iter().collect()
    } else {
        vec![pages.clone()]
    }
}

/// Radix prefix cache over token ids, at page granularity, sharing `allocator`.
///
/// Both objects wrap one Rust allocator: requests allocate and free through either. The cache keeps
/// its own reference on every page it stores; `evict` drops it. A partial last page is never
/// cached. Equal tokens in different namespaces never match.
///
/// Parameters
/// ----------
/// allocator : PageAllocator
///     The allocator whose pages the cache stores.
/// page_size : int, optional
///     Must equal `allocator.page_size` (the default).
/// sliding : list of (PageAllocator, int), optional
///     Hybrid models: each sliding-window group's allocator (same page size) and window in
///     tokens. Matches then end where every group still holds its window's pages.
/// state_slots : StateSlotAllocator, optional
///     Hybrid models with linear-attention layers: the state-slot pool. Matches then end only at
///     states saved by `insert(..., state_slot=...)`.
/// max_pinned_tokens : int, default 0
///     The pin budget in tokens: `pin` beyond it raises `PinBudgetError` (0: no pins).
/// now : callable, optional
///     The clock, returning seconds as a float (any origin), e.g. `time.monotonic` or a test's
///     fake clock; called once per call that matches, inserts, evicts or allocates, before any
///     lock is taken. Default: seconds since the cache was made, from Rust's monotonic
///     `std::time::Instant`. A reading earlier than the latest is taken as the latest.
/// kv_events : bool, default False
///     Record KV events for KV-aware routers (vLLM's `enable_kv_cache_events`): each cached page
///     keeps its chained hash (`kvpool.page_hashes`) and every change of the cached pages is
///     recorded in the call that makes it, for `take_kv_events` (see `kvpool.events`).
/// hash_seed : int, default 0
///     Seed of the page hashes (0 .. 2**64 - 1), the same on every instance a router compares;
///     only with `kv_events=True`.
///
/// Raises
/// ------
/// InvalidArgumentError
///     A page size that differs from the allocator's, a window of 0, a sliding allocator of
///     another page size, one allocator passed for two spaces, `hash_seed` without `kv_events`.
/// ValueError
///     `hash_seed` not an int in 0 .. 2**64 - 1.
///
/// Notes
/// -----
/// Threading: a cache may be shared by threads. Each call takes the cache's mutex (then the
/// allocator's) and is atomic, so calls on one cache run one at a time; calls on different caches,
/// and Python code in other threads, run alongside the long ones: `match_prefix` and `insert` of
/// 16,384 tokens or more, `evict` of as many, `alloc` of 16,384 pages or more, `reset`,
/// `check_invariants` and `leaf_paths` release the GIL; they read (and copy) their array arguments
/// with it released, so do not write an argument from another thread during the call.
/// Sequences of calls are not atomic: another thread may evict the node `match_prefix` returned
/// before `lock` takes it (`StaleNodeError`: treat it as a miss and match again), or take the pages
/// an `evict` freed. No Python code runs while a mutex is held, so a `__del__` or signal handler
/// may call into kvpool at any time. A hybrid cache locks the cache, then the full allocator, the
/// sliding ones in order and the state pool (the one lock order).
///
/// Retention: `insert(..., priority=p, retention_s=r)` gives the nodes it inserts or walks
/// through priority `p` (0..100, higher is kept longer) until `r` seconds after their last hit
/// (an insert or `match_prefix` through them renews it); then it decays to 0. A lower priority
/// never lowers a node's current one; the same priority keeps the longer retention. Eviction
/// takes unlocked, unpinned leaves lowest current priority first, least recently used within one
/// priority, at O(log leaves) per node. `pin(node)` keeps a path across requests, counted apart
/// from locks, within `max_pinned_tokens` (a token pinned through two nodes counts once);
/// pinned tokens count in `protected_size`. `stats()` reports evictions per priority, pinned
/// tokens and retention expiries.
///
/// Examples
/// --------
/// >>> import numpy as np, kvpool
/// >>> a = kvpool.PageAllocator(8, 2)
/// >>> c = kvpool.RadixCache(a)
/// >>> tokens = np.array([5, 6, 7, 8, 9], dtype=np.int32)
/// >>> pages = c.alloc(3)
/// >>> c.insert(tokens, pages)  # caches the 2 whole pages; returns tokens already present
/// 0
/// >>> a.free(pages)  # the request's references; the cache keeps its own
/// >>> cached, node, n = c.match_prefix(tokens)
/// >>> cached.tolist(), n
/// ([1, 2], 4)
#[pyclass(name = "RadixCache", module = "kvpool._core", frozen)]
pub(crate) struct PyRadixCache {
    alloc: Shared,
    allocator: Py<PyPageAllocator>,
    cache: Mutex<RadixCache>,
    /// Hybrid models: the sliding groups' and the state pool's allocators (see `radix_groups.rs`).
    groups: Groups,
    /// The host tier's allocator (see `radix_tier.rs`).
    host: Option<tier::Host>,
    /// Where the time comes from (see `radix_retention.rs`).
    clock: Clock,
}

type MatchTuple<'py> = (Bound<'py, PyArray1<i32>>, PyRadixNode, usize);
type PathPair<'py> = (Bound<'py, PyArray1<i32>>, Bound<'py, PyArray1<i32>>);

impl PyRadixCache {
    /// Runs `f` with the cache and then the allocator locked, as [`with_lock`] does for one
    /// (short work keeps the GIL only when both locks are free now).
    fn with_both<R: Send>(
        &self,
        py: Python<'_>,
        long: bool,
        f: impl FnOnce(&mut RadixCache, &mut PageAllocator) -> R + Send,
    ) -> R {
        if !long {
            if let Some(mut c) = try_guard(&self.cache) {
                if let Some(mut a) = try_guard(&self.alloc) {
                    return f(&mut c, &mut a);
                }
            }
        }
        py.detach(|| f(&mut guard(&self.cache), &mut guard(&self.alloc)))
    }

    /// `alloc` / `try_alloc`: `None` when out of pages and `soft`.
    fn take<'py>(
        &self,
        py: Python<'py>,
        n: &Int,
        soft: bool,
    ) -> PyResult<Option<Bound<'py, PyArray1<i32>>>> {
        let n = count("n", n)?;
        if self.has_tier() {
            return self.take_tiered(py, n, soft);
        }
        let long = n >= DETACH_MIN;
        let t = self.time(py)?;
        let r = if self.groups.is_hybrid() {
            self.with_spaces(py, long, |c, a, o| {
                c.set_now(t);
                let pages = c.alloc_i32_with(a, o, n)?;
                let mut gens = Vec::new();
                a.grant(&pages, &mut gens);
                Ok::<_, RadixError>((pages, gens))
            })
        } else {
            self.with_both(py, long, |c, a| {
                c.set_now(t);
                let pages = c.alloc_i32(a, n)?;
                let mut gens = Vec::new();
                a.grant(&pages, &mut gens);
                Ok::<_, RadixError>((pages, gens))
            })
        };
        match r {
            Ok((pages, gens)) => {
                let tag = self.allocator.get().tag;
                hand_out(py, &self.alloc, tag, pages, gens).map(Some)
            }
            Err(RadixError::Page(AllocError::OutOfPages { .. })) if soft => Ok(None),
            Err(e) => Err(to_py(e)),
        }
    }
}

#[pymethods]
impl PyRadixCache {
    #[new]
    #[pyo3(signature = (allocator, page_size=None, *, sliding=None, state_slots=None, host_allocator=None, max_pinned_tokens=None, now=None, kv_events=false, hash_seed=None))]
    fn new(
        allocator: Bound<'_, PyPageAllocator>,
        page_size: Option<Int>,
        sliding: Option<Vec<(Bound<'_, PyPageAllocator>, Int)>>,
        state_slots: Option<Bound<'_, PyAny>>,
        host_allocator: Option<Bound<'_, PyPageAllocator>>,
        max_pinned_tokens: Option<Int>,
        now: Option<Bound<'_, PyAny>>,
        kv_events: bool,
        hash_seed: Option<Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let py = allocator.py();
        let alloc = allocator.get().inner.clone();
        let groups = Groups::from_py(&alloc, sliding, state_slots)?;
        let host = tier::Host::from_py(&alloc, host_allocator, groups.is_hybrid())?;
        let ps = page_size.map(|p| count("page_size", &p)).transpose()?;
        let max_pinned = count("max_pinned_tokens", &max_pinned_tokens.unwrap_or(Int::ZERO))?;
        let clock = Clock::from_py(now)?;
        let mut cache = groups.build(py, &alloc, ps).map_err(to_py)?;
        events::configure(&mut cache, kv_events, hash_seed.as_ref())?;
        let this = Self {
            alloc,
            allocator: allocator.unbind(),
            cache: Mutex::new(cache.with_max_pinned_tokens(max_pinned)),
            groups,
            host,
            clock,
        };
        this.enable_tier(py)?;
        Ok(this)
    }

    /// Longest cached page-aligned prefix of `tokens`.
    ///
    /// Parameters
    /// ----------
    /// tokens : numpy.ndarray
    ///     1-D int32 or int64 token ids.
    /// namespace : None, int, str, bytes or (nested) tuple of those
    ///     Keys separate trees, e.g. `(("lora", adapter_id), ("salt", cache_salt))`. Values are
    ///     tag-encoded, so `("lora", 1)` and `("salt", "1")` (or `1` and `"1"`) never collide; values
    ///     equal in Python (`1 == True`) are one namespace.
    ///
    /// Returns
    /// -------
    /// tuple
    ///     `(pages, node, matched_len)`: the page ids (int32, shape `(matched_len // page_size,)`),
    ///     a handle to the node where the match ends (lock it to keep the pages), the matched length
    ///     in tokens. A match ending inside an edge splits it there. Takes no lock; updates LRU times
    ///     and hit/miss counters.
    #[pyo3(signature = (tokens, namespace=None))]
    fn match_prefix<'py>(
        &self,
        py: Python<'py>,
        tokens: &Bound<'py, PyAny>,
        namespace: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<MatchTuple<'py>> {
        let ns = self::namespace(namespace)?;
        let arr = ints(tokens, "tokens")?;
        let view = arr.view("tokens")?;
        let now = self.time(py)?;
        // (read in place, checked, the result made, all with the GIL released when long)
        let (pages, node, len) = with_lock(py, &self.cache, view.long(), |c| {
            c.set_now(now);
            let n = view.len();
            let mut pages =
                try_vec::<i32>(n / c.page_size(), || format!("the pages of {n} tokens"))?;
            let (node, len) = view.with_tokens(|t| {
                c.match_prefix_with(&ns, t, |p| pages.extend_from_slice(p))
            })?;
            Ok::<_, RadixError>((pages, node, len))
        })
        .map_err(to_py)?;
        Ok((PyArray1::from_vec(py, pages), PyRadixNode(node), len))
    }

    /// Caches the whole pages of `tokens`; returns how many tokens were already cached.
    ///
    /// `priority` (int 0..100, default 0) and `retention_s` (seconds >= 0, default None: no
    /// decay) are given to the nodes this call inserts or walks through (see the class notes).
    /// Insert only committed tokens: a speculative step's rejected drafts never enter the tree
    /// (see `rollback_slots`).
    ///
    /// `pages` has one id per page of `tokens` (`len(tokens) // page_size`, or one more for the
    /// partial last page, which is not cached). The cache takes a reference on the pages of the part
    /// not cached yet; the others stay the caller's, who frees its own references as usual. `pages`
    /// may also be a tuple or list of 1-D arrays standing for their concatenation, e.g.
    /// `(matched_pages, new_pages)`: the same result, without building the concatenated array.
    ///
    /// A hybrid cache also takes, per sliding group, `sliding_pages[g]` (one int32 id per entry of
    /// `pages`, 0 where `release_window_pages` released it; the tree references the live ones of
    /// the new part) and `state_slot`, a slot holding the linear-attention state after exactly
    /// `tokens` (`len(tokens)` a positive multiple of the page size; 0 or None: no checkpoint).
    ///
    /// Raises
    /// ------
    /// InvalidArgumentError
    ///     Mismatched lengths, a token beyond int32, a `sliding_pages` count or length that does
    ///     not match the groups, a `state_slot` not at a page boundary or without a state pool,
    ///     a `priority` outside 0..100, a negative or NaN `retention_s`, a clock reading that is
    ///     not finite.
    /// PageError
    ///     A bad page id, or a page of the new part that is free, repeated or already cached.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (tokens, pages, namespace=None, *, sliding_pages=None, state_slot=None, priority=None, retention_s=None))]
    fn insert(
        &self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        pages: &Bound<'_, PyAny>,
        namespace: Option<&Bound<'_, PyAny>>,
        sliding_pages: Option<Vec<Bound<'_, PyAny>>>,
        state_slot: Option<Int>,
        priority: Option<&Bound<'_, PyAny>>,
        retention_s: Option<f64>,
    ) -> PyResult<usize> {
        let retain = retention::retain(priority, retention_s)?;
        if self.groups.is_hybrid() || sliding_pages.is_some() || state_slot.is_some() {
            let args = (sliding_pages, state_slot, retain);
            return self.insert_groups(py, tokens, pages, namespace, args);
        }
        let ns = self::namespace(namespace)?;
        let t = ints(tokens, "tokens")?;
        // One array, or a tuple / list of arrays standing for their concatenation (what a serving
        // loop holds: the matched pages, then the new ones), never built.
        let items = page_parts(pages);
        let single = items.len() == 1 && pages.cast::<PyTuple>().is_err() && pages.cast::<PyList>().is_err();
        let arrays = items
            .iter()
            .enumerate()
            // The error names the part (rare path: the name is only built then).
            .map(|(i, a)| match ints(a, "pages") {
                Err(_) if !single => ints(a, &format!("pages[{i}]")),
                r => r,
            })
            .collect::<PyResult<Vec<_>>>()?;
        let toks = t.view("tokens")?;
        let parts = arrays
            .iter()
            .map(|a| a.view("pages"))
            .collect::<PyResult<Vec<_>>>()?;
        let long = toks.len() + parts.iter().map(|p| p.len()).sum::<usize>() >= DETACH_MIN;
        let now = self.time(py)?;
        // (checked and copied with the GIL released when long: see `detach.rs`)
        let run = move |c: &mut RadixCache,
                        a: &mut PageAllocator,
                        h: Option<&mut PageAllocator>|
              -> Result<usize, RadixError> {
            let toks = toks.tokens_stable()?;
            let parts = parts
                .iter()
                .map(|p| p.pages_stable())
                .collect::<Result<Vec<_>, _>>()?;
            let parts: Vec<&[i32]> = parts.iter().map(|p| &p[..]).collect();
            c.set_now(now);
            match h {
                Some(h) => c.insert_tiered_retained(a, h, &ns, &toks, &parts, retain),
                None => c.insert_parts_retained(a, &ns, &toks, &parts, retain),
            }
        };
        if self.has_tier() {
            return self.tiered(py, long, |c, a, h| run(c, a, Some(h)));
        }
        self.with_both(py, long, |c, a| run(c, a, None))
            .map_err(to_py)
    }

    /// Protects the node and its path to the root from eviction (counted).
    ///
    /// Raises
    /// ------
    /// StaleNodeError
    ///     The node was evicted (e.g. by another thread between `match_prefix` and `lock`: treat it
    ///     as a miss), the cache was reset, or the handle is another cache's.
    fn lock(&self, py: Python<'_>, node: &PyRadixNode) -> PyResult<()> {
        let h = node.0;
        with_lock(py, &self.cache, false, |c| c.lock(h)).map_err(to_py)
    }

    /// Releases one `lock` of this very node.
    ///
    /// Raises
    /// ------
    /// LockError
    ///     The node holds no lock of its own.
    /// StaleNodeError
    ///     The node is gone.
    fn unlock(&self, py: Python<'_>, node: &PyRadixNode) -> PyResult<()> {
        let h = node.0;
        with_lock(py, &self.cache, false, |c| c.unlock(h)).map_err(to_py)
    }

    /// Keeps the node and its path to the root in the cache until `unpin(node)`, across requests
    /// (counted apart from locks). The tokens it newly pins count against `max_pinned_tokens`.
    ///
    /// Raises
    /// ------
    /// PinBudgetError
    ///     The pinned tokens would exceed `max_pinned_tokens`; nothing changed.
    /// StaleNodeError
    ///     The node is gone (evicted, reset, another cache's).
    fn pin(&self, py: Python<'_>, node: &PyRadixNode) -> PyResult<()> {
        self.pin_node(py, node, true)
    }

    /// Releases one `pin` of this very node.
    ///
    /// Raises
    /// ------
    /// LockError
    ///     The node holds no pin of its own.
    /// StaleNodeError
    ///     The node is gone.
    fn unpin(&self, py: Python<'_>, node: &PyRadixNode) -> PyResult<()> {
        self.pin_node(py, node, false)
    }

    /// Retention and eviction counters in one dict (expired retentions decayed first).
    ///
    /// Returns
    /// -------
    /// dict
    ///     `evicted_tokens`, `evicted_nodes` (since creation or `reset`);
    ///     `evicted_tokens_by_priority` ({priority: tokens} at the priority each node had when
    ///     evicted, nonzero only); `pinned_tokens`, `max_pinned_tokens`; `retention_expiries`
    ///     (nodes whose priority decayed to 0); `retained_nodes` (nodes above priority 0 now);
    ///     and `hit_tokens`, `miss_tokens`, `evictable_size`, `protected_size`, `total_size`
    ///     as the properties.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, pyo3::types::PyDict>> {
        self.stats_dict(py)
    }

    /// Evicts unlocked, unpinned leaves (then their parents), lowest current priority first and
    /// least recently used within one priority, until `num_tokens` tokens left the cache or
    /// nothing evictable is left; returns the tokens evicted (whole nodes, so
    /// possibly more than asked). A hybrid cache releases every group's pages and state slots of
    /// the nodes it evicts.
    fn evict(&self, py: Python<'_>, num_tokens: Int) -> PyResult<usize> {
        let n = count("num_tokens", &num_tokens)?;
        let t = self.time(py)?;
        if self.has_tier() {
            let f = |c: &mut RadixCache, a: &mut _, h: &mut _| {
                c.set_now(t);
                c.evict_tiered(a, h, n)
            };
            return self.tiered(py, n >= DETACH_MIN, f);
        }
        if self.groups.is_hybrid() {
            return self
                .with_spaces(py, n >= DETACH_MIN, |c, a, o| {
                    c.set_now(t);
                    c.evict_with(a, o, n)
                })
                .map_err(to_py);
        }
        self.with_both(py, n >= DETACH_MIN, |c, a| {
            c.set_now(t);
            c.evict(a, n)
        })
        .map_err(to_py)
    }

    /// Allocates `n` pages, evicting LRU entries first when fewer are free.
    ///
    /// Raises
    /// ------
    /// OutOfPagesError
    ///     Not even evicting everything evictable would free enough; nothing changed.
    /// KeyboardInterrupt
    ///     Ctrl-C during the call: the pages are given back (entries it evicted stay evicted).
    fn alloc<'py>(&self, py: Python<'py>, n: Int) -> PyResult<Bound<'py, PyArray1<i32>>> {
        // (never None: only `soft` turns out-of-pages into None)
        self.take(py, &n, false)?
            .ok_or_else(|| InvalidArgumentError::new_err("unreachable"))
    }

    /// As `alloc`, but returns None instead of raising `OutOfPagesError`.
    fn try_alloc<'py>(
        &self,
        py: Python<'py>,
        n: Int,
    ) -> PyResult<Option<Bound<'py, PyArray1<i32>>>> {
        self.take(py, &n, true)
    }

    /// Empties the cache and zeroes the counters (pins are dropped); every handle becomes stale.
    ///
    /// Raises
    /// ------
    /// CacheBusyError
    ///     A lock is held.
    fn reset(&self, py: Python<'_>) -> PyResult<()> {
        if self.has_tier() {
            let f = |c: &mut RadixCache, a: &mut _, h: &mut _| c.reset_tiered(a, h);
            return self.tiered(py, true, f);
        }
        if self.groups.is_hybrid() {
            return self
                .with_spaces(py, true, |c, a, o| c.reset_with(a, o))
                .map_err(to_py);
        }
        self.with_both(py, true, |c, a| c.reset(a)).map_err(to_py)
    }

    /// Checks the tree's structure against the allocator (O(tree), for tests).
    ///
    /// Raises
    /// ------
    /// CacheCorruptError
    ///     An invariant is broken (a bug in kvpool).
    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        if self.has_tier() {
            let f = |c: &mut RadixCache, a: &mut _, h: &mut _| c.check_invariants_tiered(a, h);
            return self.tiered(py, true, f);
        }
        if self.groups.is_hybrid() {
            return self
                .with_spaces(py, true, |c, a, o| c.check_invariants_with(a, o))
                .map_err(to_py);
        }
        self.with_both(py, true, |c, a| c.check_invariants(a))
            .map_err(to_py)
    }

    /// Every root-to-leaf path of a namespace as (tokens, pages) int32 arrays, for tests and debugging.
    #[pyo3(signature = (namespace=None))]
    fn leaf_paths<'py>(
        &self,
        py: Python<'py>,
        namespace: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Vec<PathPair<'py>>> {
        let ns = self::namespace(namespace)?;
        let paths = with_lock(py, &self.cache, true, |c| c.leaf_paths(&ns));
        Ok(paths
            .into_iter()
            .map(|(t, p)| (PyArray1::from_vec(py, t), page_array(py, &p)))
            .collect())
    }

    /// The shared allocator.
    #[getter]
    fn allocator(&self, py: Python<'_>) -> Py<PyPageAllocator> {
        self.allocator.clone_ref(py)
    }
    /// Tokens per page.
    #[getter]
    fn page_size(&self, py: Python<'_>) -> usize {
        with_lock(py, &self.cache, false, |c| c.page_size())
    }
    /// Cached tokens no lock or pin protects.
    #[getter]
    fn evictable_size(&self, py: Python<'_>) -> usize {
        with_lock(py, &self.cache, false, |c| c.evictable_size())
    }
    /// Cached tokens on locked or pinned paths.
    #[getter]
    fn protected_size(&self, py: Python<'_>) -> usize {
        with_lock(py, &self.cache, false, |c| c.protected_size())
    }
    /// All cached tokens (`evictable_size + protected_size`).
    #[getter]
    fn total_size(&self, py: Python<'_>) -> usize {
        with_lock(py, &self.cache, false, |c| c.total_size())
    }
    /// Tokens `match_prefix` served from the cache.
    #[getter]
    fn hit_tokens(&self, py: Python<'_>) -> u64 {
        with_lock(py, &self.cache, false, |c| c.hit_tokens())
    }
    /// Tokens asked of `match_prefix` and not served (partial last pages included).
    #[getter]
    fn miss_tokens(&self, py: Python<'_>) -> u64 {
        with_lock(py, &self.cache, false, |c| c.miss_tokens())
    }
    /// Nodes holding tokens.
    #[getter]
    fn num_nodes(&self, py: Python<'_>) -> usize {
        with_lock(py, &self.cache, false, |c| c.num_nodes())
    }
    /// Tokens on pinned paths (each counted once).
    #[getter]
    fn pinned_tokens(&self, py: Python<'_>) -> usize {
        with_lock(py, &self.cache, false, |c| c.pinned_tokens())
    }
    /// The pin budget in tokens.
    #[getter]
    fn max_pinned_tokens(&self, py: Python<'_>) -> usize {
        with_lock(py, &self.cache, false, |c| c.max_pinned_tokens())
    }

    // --- KV events (see `radix_events.rs`) ---

    /// The KV events recorded since the last call, in order, as plain tuples (empty when the
    /// cache was built without `kv_events=True`). Built after the cache's lock is released.
    ///
    /// Returns
    /// -------
    /// list of tuple
    ///     ``("BlockStored", block_hashes, parent_block_hash, token_ids, block_size, medium,
    ///     namespace)``: the uint64 hashes (list of int) of pages newly cached along one edge, the
    ///     hash of the page before them (None for a namespace's first page), their token ids
    ///     (``len(block_hashes) * block_size``), the page size, the medium (``"GPU"``, or
    ///     ``"CPU"`` on the host tier), and the namespace's canonical bytes on a namespace's first
    ///     page (None otherwise and for the default namespace); ``("BlockRemoved", block_hashes,
    ///     medium)``: pages evicted (merged over one call); with a host tier a demotion is
    ///     ``BlockRemoved`` (GPU) then ``BlockStored`` (CPU), `load_back` the reverse;
    ///     ``("AllBlocksCleared",)``: `reset`. After more than 2**22 tokens of stored pages
    ///     piled up untaken, the pending events are replaced by a snapshot (as
    ///     `kv_events_snapshot`).
    fn take_kv_events<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        self.events_take(py, false)
    }

    /// `take_kv_events` (or, with `snapshot`, `kv_events_snapshot`) as a `KvEventBatch` held in
    /// Rust: O(1), no Python object per event; `batch.encode(event_format)` writes vLLM's wire
    /// form with the GIL released (what `kvpool.events.EventPublisher` sends).
    #[pyo3(signature = (*, snapshot=false))]
    fn take_kv_events_batch(&self, py: Python<'_>, snapshot: bool) -> events::PyKvEventBatch {
        self.events_batch(py, snapshot)
    }

    /// A full resync: ``("AllBlocksCleared",)`` followed by every cached page as ``BlockStored``
    /// (one event per node, parents first), in the form of `take_kv_events`. Drops the pending
    /// events, which the snapshot supersedes; empty when KV events are off.
    fn kv_events_snapshot<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        self.events_take(py, true)
    }

    /// What KV events recorded since the cache was built: a dict of ``events``,
    /// ``blocks_stored``, ``blocks_removed`` (pages) and ``overflows`` (pending buffers replaced
    /// by a snapshot); zeros when KV events are off.
    fn kv_event_counts<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        self.events_counts(py)
    }

    /// Whether the cache records KV events (`kv_events=True`).
    #[getter]
    fn kv_events(&self, py: Python<'_>) -> bool {
        with_lock(py, &self.cache, false, |c| c.kv_events_enabled())
    }
    /// The seed of the page hashes, or None without KV events.
    #[getter]
    fn hash_seed(&self, py: Python<'_>) -> Option<u64> {
        with_lock(py, &self.cache, false, |c| c.hash_seed())
    }

    // --- hybrid models (see `radix_groups.rs`) ---

    /// Longest prefix of `tokens` that every group of a hybrid cache can serve.
    ///
    /// Full attention needs every page of the prefix, a sliding group of window `w` the pages of
    /// the last `w` tokens before the match point, a state-slot pool the state saved after exactly
    /// that many tokens (a checkpoint `insert(..., state_slot=...)` made). The edge is split where
    /// the match ends. On a plain cache it is `match_prefix` with no sliding pages and state 0.
    ///
    /// Parameters
    /// ----------
    /// tokens : numpy.ndarray
    ///     1-D int32 or int64 token ids.
    /// namespace : None, int, str, bytes or (nested) tuple of those
    ///     As for `match_prefix`.
    ///
    /// Returns
    /// -------
    /// tuple
    ///     `(pages, node, matched_len, sliding_pages, state_slot)`: full-attention page ids (int32,
    ///     shape `(matched_len // page_size,)`), the node handle, the matched length in tokens, one
    ///     int32 array per sliding group of the same shape (the window's pages; 0 before the
    ///     window), and the saved state slot (0: none). The pages and the slot are the cache's:
    ///     lock the node to keep them, `inc_ref` the sliding pages a request will release.
    #[pyo3(signature = (tokens, namespace=None))]
    fn match_prefix_groups<'py>(
        &self,
        py: Python<'py>,
        tokens: &Bound<'py, PyAny>,
        namespace: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<groups::GroupMatchTuple<'py>> {
        self.match_groups(py, tokens, namespace)
    }

    /// Allocates `n` pages of sliding group `group`, evicting LRU entries first when fewer are
    /// free in that group's allocator.
    ///
    /// Returns
    /// -------
    /// numpy.ndarray
    ///     int32 page ids of `sliding[group]`'s allocator, shape `(n,)`.
    ///
    /// Raises
    /// ------
    /// OutOfPagesError
    ///     Not even evicting everything evictable would free enough; nothing changed.
    /// InvalidArgumentError
    ///     No such group; a negative `n` or `group`.
    /// KeyboardInterrupt
    ///     Ctrl-C during the call: the pages are given back.
    fn alloc_sliding<'py>(
        &self,
        py: Python<'py>,
        group: Int,
        n: Int,
    ) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let g = count("group", &group)?;
        self.alloc_group(py, Some(g), &n)
    }

    /// Allocates `n` state slots from the cache's state-slot pool, evicting LRU entries (and the
    /// states they saved) first when fewer are free.
    ///
    /// Returns
    /// -------
    /// numpy.ndarray
    ///     int32 slot ids, shape `(n,)`.
    ///
    /// Raises
    /// ------
    /// OutOfPagesError
    ///     Not even evicting everything evictable would free enough slots; nothing changed.
    /// InvalidArgumentError
    ///     The cache has no state-slot pool; a negative `n`.
    /// KeyboardInterrupt
    ///     Ctrl-C during the call: the slots are given back.
    fn alloc_state_slots<'py>(
        &self,
        py: Python<'py>,
        n: Int,
    ) -> PyResult<Bound<'py, PyArray1<i32>>> {
        self.alloc_group(py, None, &n)
    }

    /// Every root-to-leaf path of a namespace with every group's pages, for tests and debugging.
    ///
    /// Returns
    /// -------
    /// list of tuple
    ///     `(tokens, pages, sliding_pages, states)`: int32 arrays; `sliding_pages` one array per
    ///     sliding group (one entry per page, 0 where released); `states[j]` the slot saved after
    ///     `j + 1` pages (0: none).
    #[pyo3(signature = (namespace=None))]
    fn leaf_paths_groups<'py>(
        &self,
        py: Python<'py>,
        namespace: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Vec<groups::GroupPathTuple<'py>>> {
        self.paths_groups(py, namespace)
    }

    /// The sliding groups as `(allocator, window)` pairs, in the order given (empty: none).
    #[getter]
    fn sliding(&self, py: Python<'_>) -> Vec<(Py<PyPageAllocator>, usize)> {
        self.sliding_objs(py)
    }
    /// The state-slot pool passed as `state_slots`, or None.
    #[getter]
    fn state_slots(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        self.state_obj(py)
    }
    /// Whether the cache has a state-slot pool (matches then end at saved states only).
    #[getter]
    fn has_state_slots(&self, py: Python<'_>) -> bool {
        with_lock(py, &self.cache, false, |c| c.has_state_slots())
    }

    // --- the host-memory tier (see `radix_tier.rs`) ---

    /// Host pages that continue the device match of `tokens` (a cache with `host_allocator`).
    ///
    /// The device part is walked as `match_prefix` does (no device counter changes); the host
    /// edge is split where the match ends. Updates access times and `tier_stats`.
    ///
    /// Parameters
    /// ----------
    /// tokens : numpy.ndarray
    ///     1-D int32 or int64 token ids.
    /// namespace : None, int, str, bytes or (nested) tuple of those
    ///     As for `match_prefix`.
    ///
    /// Returns
    /// -------
    /// tuple
    ///     `(host_pages, node, host_len)`: host page ids (int32, shape `(host_len // page_size,)`)
    ///     of the tokens after `match_prefix`'s matched length, the node where they end (pass it
    ///     to `load_back`; the device match's end when `host_len` is 0) and their length in tokens.
    ///
    /// Raises
    /// ------
    /// InvalidArgumentError
    ///     The cache has no host tier; a negative token id.
    #[pyo3(signature = (tokens, namespace=None))]
    fn match_prefix_host<'py>(
        &self,
        py: Python<'py>,
        tokens: &Bound<'py, PyAny>,
        namespace: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<tier::HostMatchTuple<'py>> {
        self.match_host(py, tokens, namespace)
    }

    /// Moves host node `node` and its host ancestors back to the device tier.
    ///
    /// `pages` are device page ids the caller holds and has filled with the host pages' bytes,
    /// one per host page from the device tier down to `node` (the `host_pages` of
    /// `match_prefix_host`, in order). The cache takes its reference on them (the caller frees
    /// its own as usual) and frees the host pages. Call it only once the copies succeeded: on a
    /// failed load, leave the node on the host and recompute.
    ///
    /// Returns
    /// -------
    /// int
    ///     Tokens moved to the device.
    ///
    /// Raises
    /// ------
    /// StaleNodeError
    ///     The node was dropped (e.g. from a full host pool) or the cache reset: recompute.
    /// InvalidArgumentError
    ///     The node is on the device; `pages` has the wrong length; no host tier.
    /// PageError
    ///     A device page that is the padding page, out of range, free, repeated or already cached.
    fn load_back(&self, py: Python<'_>, node: &PyRadixNode, pages: &Bound<'_, PyAny>) -> PyResult<usize> {
        self.load(py, node, pages)
    }

    /// The demotions since the last call: `(device_pages, host_pages)`, int32 arrays of one shape.
    ///
    /// Copy device page `device_pages[i]` to host page `host_pages[i]` (in order: a host page
    /// listed twice takes the later copy) before any of those device pages is written again:
    /// `alloc`, `try_alloc` and `evict` may demote, and `alloc` hands the freed pages straight
    /// out. `kvpool.tier.HostTier` does it for every call.
    fn take_demotions<'py>(&self, py: Python<'py>) -> PyResult<tier::Demotions<'py>> {
        self.demotions(py)
    }

    /// The host tier's counters (zeros without one), as a dict of int: `demoted_pages`,
    /// `dropped_pages` (evicted with no host copy), `host_evicted_pages`, `loaded_pages`,
    /// `host_query_tokens`, `host_hit_tokens`, `host_size` (tokens on the host now).
    fn tier_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, pyo3::types::PyDict>> {
        self.tier_stats_dict(py)
    }

    /// The host tier's allocator, or None.
    #[getter]
    fn host_allocator(&self, py: Python<'_>) -> Option<Py<PyPageAllocator>> {
        self.host_obj(py)
    }

    /// `RadixCache(page_size=..., total_size=..., protected_size=...)`.
    fn __repr__(&self, py: Python<'_>) -> String {
        let (ps, total, protected) = with_lock(py, &self.cache, false, |c| {
            (c.page_size(), c.total_size(), c.protected_size())
        });
        format!("RadixCache(page_size={ps}, total_size={total}, protected_size={protected})")
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyRadixNode>()?;
    m.add_class::<events::PyKvEventBatch>()?;
    m.add_class::<PyRadixCache>()
}
