//! Page allocator: a free list plus one reference count per page.
//!
//! Usable pages are `1..=num_pages`; page 0 ([`PADDING_PAGE`]) is the reserved padding page and is
//! never handed out, freed or shared. `alloc` hands pages out with one reference each; `inc_ref`
//! adds a holder; `free` drops one reference and the page returns to the free list when its last
//! reference goes. Every call is atomic: it validates its whole input first and changes nothing
//! on error, so a double free or a repeated id can never put one page on the free list twice
//! (KVB-21, docs/architecture.md). The checks are always on: they cost one pass over the call's pages.
//!
//! ```
//! use kvpool::alloc::PageAllocator;
//! let mut a = PageAllocator::new(4, 16).unwrap();
//! let p = a.alloc(2).unwrap();
//! assert_eq!(a.num_free(), 2);
//! a.free(&p).unwrap();
//! assert!(a.free(&p).is_err()); // double free: rejected, nothing changes
//! assert_eq!(a.num_free(), 4);
//! ```

use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::layout::PADDING_PAGE;

/// A usable page id (never [`PADDING_PAGE`]); `Option<PageId>` stays 4 bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PageId(NonZeroU32);

impl PageId {
    /// The id, or `None` for the padding page.
    pub const fn new(raw: u32) -> Option<Self> {
        match NonZeroU32::new(raw) {
            Some(n) => Some(Self(n)),
            None => None,
        }
    }
    pub const fn get(self) -> u32 {
        self.0.get()
    }
    /// The id as stored in int32 page tables (ids are checked to fit at allocator creation).
    pub const fn as_i32(self) -> i32 {
        self.0.get() as i32
    }
    const fn index(self) -> usize {
        self.0.get() as usize
    }
}

/// Errors of the `alloc` room.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AllocError {
    #[error("`num_pages` must be at least 1, got 0")]
    ZeroPages,
    #[error("`page_size` must be at least 1, got 0")]
    ZeroPageSize,
    #[error("pool of `{num_pages}` pages x `{page_size}` tokens (plus the padding page) has more slots than int32 slot indices can address")]
    TooManySlots { num_pages: u64, page_size: u64 },
    #[error("out of pages: asked for `{requested}`, {free} free, {evictable} more reclaimable by evicting unlocked cache entries")]
    OutOfPages {
        requested: usize,
        free: usize,
        evictable: usize,
    },
    #[error("page `0` is the reserved padding page: it is never allocated, freed or shared")]
    PaddingPage,
    #[error("page `{page}` is out of range: usable pages are 1..={num_pages}")]
    OutOfRange { page: i64, num_pages: u32 },
    #[error("page `{page}` is not allocated (it is free: double free or stale id)")]
    NotAllocated { page: u32 },
    #[error("page `{page}` has no reference left but the prefix cache's: double free (the cache drops its own reference when it evicts)")]
    OnlyCached { page: u32 },
    #[error("page `{page}` is already stored in the prefix cache (under another key)")]
    AlreadyCached { page: u32 },
    #[error("page `{page}` appears more than once in one call")]
    Duplicate { page: u32 },
    #[error("page `{page}` already has the maximum reference count")]
    RefOverflow { page: u32 },
    #[error("`{what}` must not be negative, got `{value}`")]
    Negative { what: &'static str, value: i64 },
    #[error("`{what}` must fit in int64, got `{value}`")]
    TooLarge { what: &'static str, value: String },
    #[error("cannot allocate {bytes} bytes for {what}")]
    NoMemory { what: String, bytes: u64 },
    #[error("page `{page}` was freed and handed out again after this array got it (generation {granted}, now {now}): double free after reuse")]
    Reused { page: u32, granted: u32, now: u32 },
    #[error(
        "page `{page}` is listed {listed} times but has {holders} reference(s) a holder can drop"
    )]
    OverReleased {
        page: u32,
        listed: usize,
        holders: u32,
    },
    #[error("out of state slots: asked for `{requested}`, {free} free (one slot per running request of a model with linear-attention layers)")]
    OutOfStateSlots { requested: usize, free: usize },
    #[error("state slot pool (slot ids are 1..=num_slots; slot 0 is padding): {0}")]
    InStateSlots(Box<AllocError>),
}

/// `len` elements of `T` reserved in a new vector, or [`AllocError::NoMemory`] naming `what`:
/// the sizes that reach here come from the caller, so a failure must be an error, not an abort.
///
/// # Errors
/// [`AllocError::NoMemory`].
pub fn try_vec<T>(len: usize, what: impl FnOnce() -> String) -> Result<Vec<T>, AllocError> {
    let mut v = Vec::new();
    v.try_reserve_exact(len).map_err(|_| AllocError::NoMemory {
        what: what(),
        bytes: (len as u64).saturating_mul(std::mem::size_of::<T>() as u64),
    })?;
    Ok(v)
}

/// A non-negative count from the Python side (`alloc(n)`, `evict(n)`).
///
/// # Errors
/// [`AllocError::Negative`] for `value < 0`.
pub fn count(what: &'static str, value: i64) -> Result<usize, AllocError> {
    usize::try_from(value).map_err(|_| AllocError::Negative { what, value })
}

/// Narrows int64 page ids to the int32 of page tables; a value outside int32 is out of range.
///
/// # Errors
/// [`AllocError::OutOfRange`] for a value that does not fit (the pool size is not known here:
/// `num_pages` is reported as `i32::MAX`).
pub fn narrow_pages(pages: &[i64]) -> Result<Vec<i32>, AllocError> {
    let fits = |v: i64| i64::from(v as i32) == v;
    if pages.iter().fold(true, |ok, &v| ok & fits(v)) {
        return Ok(pages.iter().map(|&v| v as i32).collect());
    }
    let page = pages.iter().copied().find(|&v| !fits(v)).unwrap_or(0);
    Err(AllocError::OutOfRange {
        page,
        num_pages: i32::MAX as u32,
    })
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// A unique id per allocator (and per radix cache epoch), so handles and caches can check that
/// they are used with the object they were made for.
pub(crate) fn next_id() -> u64 {
    NEXT_ID.fetch_add(1, Ordering::Relaxed)
}

/// Per-page reference state in 4 bytes (16 pages per cache line): the holders' references
/// (bits 0..=30; the prefix cache's own reference is not among them) and [`CACHED`] (bit 31)
/// while a prefix cache holds its reference; the page's reference count is `holders + cached`.
type Slot = u32;

const CACHED: u32 = 1 << 31;
const HOLDERS: u32 = CACHED - 1;
/// Largest reference count of a page (holders plus the cache's).
const MAX_REFS: u32 = CACHED - 1;

/// The reference bits of a slot.
const fn refs(s: Slot) -> u32 {
    s
}
/// References held on the page, the cache's included.
const fn ref_total(s: Slot) -> u32 {
    (refs(s) & HOLDERS) + (refs(s) >> 31)
}

/// What an allocator hands out: KV pages, or linear-attention state slots (one per request).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    Page,
    StateSlot,
}

/// The page allocator. Not thread-safe by itself; the Python binding wraps it in a mutex.
#[derive(Debug)]
pub struct PageAllocator {
    id: u64,
    /// Only changes what errors say (pages or state slots); the bookkeeping is the same.
    unit: Unit,
    page_size: u32,
    num_pages: u32,
    /// State per page id; slot 0 (padding) stays 0: no holder, so every check rejects it.
    slots: Vec<Slot>,
    /// Stamp of the last call that checked each page for repeats (`stamp` at the time; never
    /// above it): finds repeated ids in O(n) without allocating. Apart from `slots`, as only
    /// the rarer paths need it.
    seen: Vec<u32>,
    /// Free pages as a stack: `free[..free_len]`, the last entries handed out first. One entry
    /// more than there are pages, so a loop may write the next entry unconditionally and count it
    /// only when the page was freed (no branch, no capacity check per page).
    free: Box<[i32]>,
    free_len: usize,
    stamp: u32,
    /// Cached pages that someone else holds too (holders >= 1): when there are none, evicting a
    /// page always frees it, and the cache can plan evictions without looking at each page.
    shared_cached: usize,
    /// Debug mode only (else empty): per page, how many times it left the free list. An array
    /// handed out records the generations of its pages, so freeing it after its pages were freed
    /// and handed out again is seen (see [`check_grant`](Self::check_grant)).
    gens: Vec<u32>,
}

impl PageAllocator {
    /// An allocator of `num_pages` usable pages (ids `1..=num_pages`) of `page_size` tokens.
    ///
    /// # Errors
    /// [`AllocError::ZeroPages`], [`AllocError::ZeroPageSize`], or
    /// [`AllocError::TooManySlots`] when `(num_pages + 1) * page_size` exceeds the int32 range.
    pub fn new(num_pages: u64, page_size: u64) -> Result<Self, AllocError> {
        Self::with_debug(num_pages, page_size, false)
    }

    /// [`new`](Self::new), with per-page generations kept when `debug` is set (4 bytes a page).
    ///
    /// # Errors
    /// As [`new`](Self::new), plus [`AllocError::NoMemory`] when the per-page state (12 bytes a
    /// page, 16 with `debug`) cannot be allocated.
    pub fn with_debug(num_pages: u64, page_size: u64, debug: bool) -> Result<Self, AllocError> {
        if num_pages == 0 {
            return Err(AllocError::ZeroPages);
        }
        if page_size == 0 {
            return Err(AllocError::ZeroPageSize);
        }
        let slots = num_pages
            .checked_add(1)
            .and_then(|n| n.checked_mul(page_size));
        if slots.is_none_or(|s| s > i32::MAX as u64) {
            return Err(AllocError::TooManySlots {
                num_pages,
                page_size,
            });
        }
        let n = num_pages as u32;
        let len = n as usize + 1;
        let what = |name: &str| format!("the {name} of `num_pages` = {num_pages} pages");
        // Stack order: the first `alloc` returns 1, 2, 3, ...; plus the spare entry.
        let mut free = try_vec::<i32>(len, || what("free list"))?;
        free.extend((1..=n as i32).rev().chain([0]));
        let mut slots = try_vec::<Slot>(len, || what("reference counts"))?;
        slots.resize(len, 0);
        let mut seen = try_vec::<u32>(len, || what("repeat stamps"))?;
        seen.resize(len, 0);
        let mut gens = try_vec::<u32>(if debug { len } else { 0 }, || what("generations"))?;
        gens.resize(gens.capacity().min(len), 0);
        // Touch every memory page of the slots now (a zeroed allocation is mapped lazily), so the
        // first allocations of a serving loop do not take the page faults.
        for s in slots.iter_mut().step_by(1024) {
            *s = std::hint::black_box(0);
        }
        Ok(Self {
            id: next_id(),
            unit: Unit::Page,
            page_size: page_size as u32,
            num_pages: n,
            slots,
            seen,
            free: free.into_boxed_slice(),
            free_len: n as usize,
            stamp: 0,
            shared_cached: 0,
            gens,
        })
    }

    /// A pool of `num_slots` linear-attention state slots (ids `1..=num_slots`; slot 0 is the
    /// padding slot, never handed out): a page allocator of page size 1 whose errors name state
    /// slots ([`AllocError::OutOfStateSlots`], [`AllocError::InStateSlots`]). Slots are
    /// ref-counted like pages, so a prefix cache can hold a saved state as it holds a page.
    ///
    /// # Errors
    /// As [`new`](Self::new).
    pub fn state_slots(num_slots: u64) -> Result<Self, AllocError> {
        let mut a = Self::new(num_slots, 1)?;
        a.unit = Unit::StateSlot;
        Ok(a)
    }

    pub const fn unit(&self) -> Unit {
        self.unit
    }

    /// An error of this allocator, worded for its unit (error paths only).
    #[cold]
    fn unit_err(&self, e: AllocError) -> AllocError {
        match (self.unit, e) {
            (Unit::Page, e) => e,
            (
                Unit::StateSlot,
                AllocError::OutOfPages {
                    requested, free, ..
                },
            ) => AllocError::OutOfStateSlots { requested, free },
            (Unit::StateSlot, e) => AllocError::InStateSlots(Box::new(e)),
        }
    }

    pub const fn num_pages(&self) -> usize {
        self.num_pages as usize
    }
    pub const fn page_size(&self) -> usize {
        self.page_size as usize
    }
    pub const fn num_free(&self) -> usize {
        self.free_len
    }
    /// Pages with at least one reference.
    pub const fn num_used(&self) -> usize {
        self.num_pages as usize - self.free_len
    }
    /// References held on `page` (0 for a free page), the cache's included.
    pub fn ref_count(&self, page: PageId) -> u32 {
        self.slots.get(page.index()).map_or(0, |&s| ref_total(s))
    }
    /// Reference count of every page id, index 0 (padding) included.
    ///
    /// # Errors
    /// [`AllocError::NoMemory`] when the copy cannot be allocated.
    pub fn ref_counts(&self) -> Result<Vec<u32>, AllocError> {
        let mut v = try_vec(self.slots.len(), || "the reference counts".into())?;
        v.extend(self.slots.iter().map(|&s| ref_total(s)));
        Ok(v)
    }

    /// Whether the allocator keeps per-page generations (made with `debug`).
    pub fn debug(&self) -> bool {
        !self.gens.is_empty()
    }

    /// Appends the generation of each page (ids handed out by this allocator) to `out`: what an
    /// array handed out records, for [`check_grant`](Self::check_grant). Nothing in release mode.
    pub fn grant(&self, pages: &[i32], out: &mut Vec<u32>) {
        if self.debug() {
            out.extend(pages.iter().map(|&p| self.gens.get(p as u32 as usize).copied().unwrap_or(0)));
        }
    }

    /// Checks that each page still is in the generation `granted` recorded when it was handed
    /// out (debug mode; always `Ok` otherwise). Pages out of range are left to the call's own
    /// checks.
    ///
    /// # Errors
    /// [`AllocError::Reused`] for the first page freed and handed out again since.
    pub fn check_grant(&self, pages: &[i32], granted: &[u32]) -> Result<(), AllocError> {
        if !self.debug() {
            return Ok(());
        }
        for (&p, &g) in pages.iter().zip(granted) {
            if let Some(&now) = self.gens.get(p as u32 as usize) {
                if now != g {
                    return Err(AllocError::Reused { page: p as u32, granted: g, now });
                }
            }
        }
        Ok(())
    }

    /// A new generation for each page leaving the free list (debug mode).
    fn bump(&mut self, pages: &[i32]) {
        if !self.gens.is_empty() {
            for &p in pages {
                let g = &mut self.gens[p as u32 as usize];
                *g = g.wrapping_add(1);
            }
        }
    }
    /// Whether a prefix cache holds a reference on `page`.
    pub fn is_cached(&self, page: PageId) -> bool {
        self.slots
            .get(page.index())
            .is_some_and(|&s| refs(s) & CACHED != 0)
    }
    /// Whether the cache's reference is the only one on `page` (an id the cache holds).
    pub(crate) fn only_cached(&self, page: i32) -> bool {
        self.slots
            .get(page as u32 as usize)
            .is_some_and(|&s| refs(s) == CACHED)
    }
    pub(crate) const fn id(&self) -> u64 {
        self.id
    }

    /// Hands out `n` pages with one reference each.
    ///
    /// # Errors
    /// [`AllocError::OutOfPages`] when fewer than `n` are free; nothing is allocated then.
    pub fn alloc(&mut self, n: usize) -> Result<Vec<PageId>, AllocError> {
        Ok(self
            .alloc_i32(n)?
            .into_iter()
            .filter_map(|p| PageId::new(p as u32))
            .collect())
    }

    /// [`alloc`](Self::alloc) returning the ids as int32 (page-table entries).
    ///
    /// # Errors
    /// As [`alloc`](Self::alloc).
    pub fn alloc_i32(&mut self, n: usize) -> Result<Vec<i32>, AllocError> {
        // (capped: `n` is the caller's, and a request beyond the free pages fails below)
        let mut out = try_vec(n.min(self.free_len), || format!("`n` = {n} page ids"))?;
        self.alloc_into(&mut out, n)?;
        Ok(out)
    }

    /// Appends `n` newly allocated pages (one reference each) to `out`.
    ///
    /// # Errors
    /// [`AllocError::OutOfPages`] when fewer than `n` are free; nothing is allocated then.
    pub(crate) fn alloc_into(&mut self, out: &mut Vec<i32>, n: usize) -> Result<(), AllocError> {
        if n > self.free_len {
            return Err(self.unit_err(AllocError::OutOfPages {
                requested: n,
                free: self.free_len,
                evictable: 0,
            }));
        }
        let start = self.free_len - n;
        let taken = &self.free[start..self.free_len];
        // A copy (vectorized), then one store per page (a free page's slot is zero).
        out.extend(taken.iter().rev().copied());
        let slots = &mut self.slots[..];
        // Ids on the free list are in range: the bounds check never fails (a cold branch).
        for &p in taken {
            slots[p as u32 as usize] = 1;
        }
        self.free_len = start;
        if self.debug() {
            let taken = self.free[start..start + n].to_vec();
            self.bump(&taken);
        }
        Ok(())
    }

    /// Drops one reference on each page; a page returns to the free list at zero.
    ///
    /// # Errors
    /// The padding page, an id out of range, a free page, a page whose only reference is a prefix
    /// cache's, or an id repeated in `pages` ([`AllocError`]); nothing changes then.
    pub fn free<P: RawPage>(&mut self, pages: &[P]) -> Result<(), AllocError> {
        // One pass that checks and applies each page, counters kept local; on an error the pages
        // already done are rolled back, so the call still changes nothing then.
        let slots = &mut self.slots[..];
        let Dropped {
            done,
            unshared,
            zeroed,
        } = drop_refs(slots, pages);
        // A page listed more often than it has holders runs out of them above. One listed twice
        // while keeping a holder is only seen by stamping: needed only when some page kept one.
        let ok =
            done == pages.len() && (unshared + zeroed == pages.len() || self.stamp_once(pages));
        if !ok {
            for &p in &pages[..done] {
                self.slots[p.index()] += 1;
            }
            let e = self.free_error(pages);
            return Err(self.unit_err(e));
        }
        self.shared_cached -= unshared;
        if zeroed > 0 {
            // Listed once each (checked above): the pages at zero now are the ones freed here.
            let (slots, free) = (&self.slots[..], &mut self.free[..]);
            let mut len = self.free_len;
            for &raw in pages {
                let i = raw.index();
                // In bounds: the spare entry, and a page still held here is not free yet.
                free[len] = i as i32;
                len += usize::from(slots.get(i).is_some_and(|&s| refs(s) == 0));
            }
            self.free_len = len;
        }
        Ok(())
    }

    /// Drops one reference per occurrence of each page: a page may be listed as often as it has
    /// holders (e.g. one shared prefix page in several rows of a page table). The cache's own
    /// reference is never dropped here. Costs O(n log n) in the pages listed.
    ///
    /// # Errors
    /// The padding page, an id out of range, a free page, a page whose only reference is a prefix
    /// cache's, or a page listed more often than it has holders ([`AllocError::OverReleased`]);
    /// nothing changes then; [`AllocError::NoMemory`] when the sorted copy of `pages` cannot be
    /// allocated.
    pub fn free_counted(&mut self, pages: &[i32]) -> Result<(), AllocError> {
        let what = || format!("a sorted copy of {} page ids", pages.len());
        let mut sorted = try_vec(pages.len(), what)?;
        sorted.extend_from_slice(pages);
        sorted.sort_unstable();
        // Validate every distinct page against its number of occurrences, then apply.
        for run in sorted.chunk_by(|a, b| a == b) {
            let p = self.page(run[0]).map_err(|e| self.unit_err(e))?;
            let s = self.slots[p.index()];
            let holders = s & HOLDERS;
            let err = match (holders, s) {
                (0, 0) => Some(AllocError::NotAllocated { page: p.get() }),
                (0, _) => Some(AllocError::OnlyCached { page: p.get() }),
                (h, _) if (h as usize) < run.len() => Some(AllocError::OverReleased {
                    page: p.get(),
                    listed: run.len(),
                    holders: h,
                }),
                _ => None,
            };
            if let Some(e) = err {
                return Err(self.unit_err(e));
            }
        }
        for run in sorted.chunk_by(|a, b| a == b) {
            let i = run[0] as usize;
            let s = &mut self.slots[i];
            *s -= run.len() as u32;
            if *s == CACHED {
                self.shared_cached -= 1;
            } else if *s == 0 {
                self.free[self.free_len] = run[0];
                self.free_len += 1;
            }
        }
        Ok(())
    }

    /// Whether every page (all in range) is listed once; stamps them.
    fn stamp_once<P: RawPage>(&mut self, pages: &[P]) -> bool {
        let stamp = self.next_stamp();
        let seen = &mut self.seen[..];
        pages.iter().all(|&p| {
            let s = &mut seen[p.index()];
            let fresh = *s != stamp;
            *s = stamp;
            fresh
        })
    }

    /// Why `free` refuses `pages` (unchanged): the first bad page in order, as a validating pass
    /// of its own finds it (errors only, so the fast path needs no stamps).
    fn free_error<P: RawPage>(&mut self, pages: &[P]) -> AllocError {
        let stamp = self.next_stamp();
        for &raw in pages {
            let p = match self.page(raw) {
                Ok(p) => p,
                Err(e) => return e,
            };
            if self.seen[p.index()] == stamp {
                return AllocError::Duplicate { page: p.get() };
            }
            match self.slots[p.index()] {
                0 => return AllocError::NotAllocated { page: p.get() },
                CACHED => return AllocError::OnlyCached { page: p.get() },
                _ => self.seen[p.index()] = stamp,
            }
        }
        // Unreachable for a refused call; a conservative answer all the same.
        AllocError::Duplicate {
            page: pages.first().map_or(0, |p| p.to_i64() as u32),
        }
    }

    fn next_stamp(&mut self) -> u32 {
        self.stamp = self.stamp.wrapping_add(1);
        if self.stamp == 0 {
            self.seen.fill(0);
            self.stamp = 1;
        }
        self.stamp
    }

    /// Adds one reference to each page (another holder shares it).
    ///
    /// # Errors
    /// As [`free`](Self::free), plus [`AllocError::RefOverflow`]; nothing changes then.
    pub fn inc_ref<P: RawPage>(&mut self, pages: &[P]) -> Result<(), AllocError> {
        self.check_shareable(pages).map_err(|e| self.unit_err(e))?;
        for &raw in pages {
            let s = &mut self.slots[raw.index()];
            *s += 1;
            if refs(*s) == CACHED | 1 {
                self.shared_cached += 1;
            }
        }
        Ok(())
    }

    /// A usable, in-range page id (not checked for being allocated).
    ///
    /// # Errors
    /// [`AllocError::PaddingPage`] or [`AllocError::OutOfRange`].
    pub fn page<P: RawPage>(&self, raw: P) -> Result<PageId, AllocError> {
        let v = raw.to_i64();
        if v == i64::from(PADDING_PAGE) {
            return Err(AllocError::PaddingPage);
        }
        if v < 0 || v > i64::from(self.num_pages) {
            return Err(AllocError::OutOfRange {
                page: v,
                num_pages: self.num_pages,
            });
        }
        PageId::new(v as u32).ok_or(AllocError::PaddingPage)
    }

    /// Validates that every page is usable, allocated, listed once and below the maximum count.
    /// Changes no reference count.
    fn check_shareable<P: RawPage>(&mut self, pages: &[P]) -> Result<(), AllocError> {
        let stamp = self.next_stamp();
        for &raw in pages {
            let p = self.page(raw)?;
            let count = ref_total(self.slots[p.index()]);
            if count == 0 {
                return Err(AllocError::NotAllocated { page: p.get() });
            }
            let seen = &mut self.seen[p.index()];
            if *seen == stamp {
                return Err(AllocError::Duplicate { page: p.get() });
            }
            if count == MAX_REFS {
                return Err(AllocError::RefOverflow { page: p.get() });
            }
            *seen = stamp;
        }
        Ok(())
    }

    /// The cache's reference: taken on a held page not cached yet, checked by the caller.
    #[cfg(test)]
    pub(crate) fn retain_cached(&mut self, p: PageId) {
        let s = &mut self.slots[p.index()];
        debug_assert!(ref_total(*s) > 0 && refs(*s) & CACHED == 0 && ref_total(*s) < MAX_REFS);
        *s |= CACHED;
        self.shared_cached += 1; // the holder that handed it over still has its reference
    }

    /// Takes the cache's reference on each page, which must be held, not cached yet and listed
    /// once: validation and update in one pass (rolled back on an error, so nothing changes then).
    /// The cache bit is its own duplicate check: a repeated page finds it set.
    pub(crate) fn cache_pages<P: RawPage>(&mut self, pages: &[P]) -> Result<(), AllocError> {
        let slots = &mut self.slots[..];
        let mut k = 0;
        while k < pages.len() {
            let Some(s) = slots.get_mut(pages[k].index()) else {
                break;
            };
            // Held (holders >= 1), not cached (bit 31 clear) and below the maximum: one compare.
            if s.wrapping_sub(1) >= MAX_REFS - 1 {
                break;
            }
            *s |= CACHED;
            k += 1;
        }
        if k < pages.len() {
            for &done in &pages[..k] {
                slots[done.index()] &= !CACHED;
            }
            let e = self.cache_error(pages, k);
            return Err(self.unit_err(e));
        }
        // Every holder that handed a page over still has its reference.
        self.shared_cached += pages.len();
        Ok(())
    }

    /// Why `cache_pages` refused `pages[k]` (the pages before it were fine and rolled back).
    fn cache_error<P: RawPage>(&self, pages: &[P], k: usize) -> AllocError {
        let raw = pages[k];
        let p = match self.page(raw) {
            Ok(p) => p,
            Err(e) => return e,
        };
        if pages[..k].iter().any(|q| q.to_i64() == raw.to_i64()) {
            return AllocError::Duplicate { page: p.get() };
        }
        match ref_total(self.slots[p.index()]) {
            0 => AllocError::NotAllocated { page: p.get() },
            MAX_REFS => AllocError::RefOverflow { page: p.get() },
            _ => AllocError::AlreadyCached { page: p.get() },
        }
    }

    /// Cached pages with another holder besides the cache.
    pub(crate) const fn shared_cached(&self) -> usize {
        self.shared_cached
    }

    /// Drops the cache's reference on a page it holds.
    #[cfg(test)]
    pub(crate) fn release_cached(&mut self, p: PageId) {
        self.release_cached_all(&[p.as_i32()]);
    }

    /// Drops the cache's reference on each page (all held by it, each listed once); the pages
    /// that reached zero go to the free list.
    pub(crate) fn release_cached_all(&mut self, pages: &[i32]) {
        self.release_cached_into(pages, &mut Vec::new(), 0);
    }

    /// [`release_cached_all`](Self::release_cached_all) handing the pages that reach zero
    /// straight out again, allocated: up to `want` entries of `out` in all (one reference each,
    /// appended to `out`), the others to the free list. What eviction followed by `alloc` does,
    /// without the trip through the free list.
    pub(crate) fn release_cached_into(&mut self, pages: &[i32], out: &mut Vec<i32>, want: usize) {
        let slots = &mut self.slots[..];
        let len = self.free_len;
        if self.shared_cached == 0 {
            // No cached page has another holder: every one is freed (a store, then one copy).
            let k = want.saturating_sub(out.len()).min(pages.len());
            let (given, rest) = pages.split_at(k);
            for &p in given {
                let s = &mut slots[p as u32 as usize];
                debug_assert_eq!(refs(*s), CACHED, "page {p}: not the cache's alone");
                *s = 1;
            }
            for &p in rest {
                let s = &mut slots[p as u32 as usize];
                debug_assert_eq!(refs(*s), CACHED, "page {p}: not the cache's alone");
                *s = 0;
            }
            out.extend_from_slice(given);
            self.free[len..len + rest.len()].copy_from_slice(rest);
            self.free_len = len + rest.len();
            self.bump(given);
            return;
        }
        let free = &mut self.free[..];
        let (mut unshared, mut len) = (0usize, len);
        for &p in pages {
            let s = &mut slots[p as u32 as usize];
            debug_assert!(
                refs(*s) & CACHED != 0,
                "release of page {p} the cache does not hold"
            );
            let r = refs(*s) & HOLDERS;
            unshared += usize::from(r != 0);
            if r == 0 && out.len() < want {
                *s = 1;
                out.push(p);
                if let Some(g) = self.gens.get_mut(p as u32 as usize) {
                    *g = g.wrapping_add(1);
                }
                continue;
            }
            *s = r;
            // In bounds: the spare entry, and a page the cache still held is not free yet.
            free[len] = p;
            len += usize::from(r == 0);
        }
        self.shared_cached -= unshared;
        self.free_len = len;
    }
}

/// What [`drop_refs`] did: pages done (all of them unless one failed) and the counts to apply.
struct Dropped {
    done: usize,
    /// Cached pages whose last holder besides the cache left.
    unshared: usize,
    /// Pages whose last reference went: to the free list.
    zeroed: usize,
}

/// `free`'s per-page loop, kept apart so its few values stay in registers: drops one holder's
/// reference on each page, stopping at the first one out of range or with no holder left.
#[inline(never)]
fn drop_refs<P: RawPage>(slots: &mut [Slot], pages: &[P]) -> Dropped {
    let (mut unshared, mut zeroed) = (0usize, 0usize);
    for (k, &raw) in pages.iter().enumerate() {
        // Negative ids map far out of range; the padding page has no holder.
        let Some(s) = slots.get_mut(raw.index()) else {
            return Dropped {
                done: k,
                unshared,
                zeroed,
            };
        };
        if *s & HOLDERS == 0 {
            return Dropped {
                done: k,
                unshared,
                zeroed,
            };
        }
        *s -= 1;
        let r = *s;
        unshared += usize::from(r == CACHED);
        zeroed += usize::from(r == 0);
    }
    Dropped {
        done: pages.len(),
        unshared,
        zeroed,
    }
}

/// Integer types a page id may arrive as (numpy int32 / int64, Rust ids).
pub trait RawPage: Copy {
    fn to_i64(self) -> i64;
    /// The id as a slot index; a negative id maps beyond every pool (so it fails the range check).
    fn index(self) -> usize;
}
impl RawPage for i32 {
    fn to_i64(self) -> i64 {
        i64::from(self)
    }
    fn index(self) -> usize {
        self as u32 as usize
    }
}
impl RawPage for i64 {
    fn to_i64(self) -> i64 {
        self
    }
    fn index(self) -> usize {
        usize::try_from(self).unwrap_or(usize::MAX)
    }
}
impl RawPage for u32 {
    fn to_i64(self) -> i64 {
        i64::from(self)
    }
    fn index(self) -> usize {
        self as usize
    }
}
impl RawPage for PageId {
    fn to_i64(self) -> i64 {
        i64::from(self.get())
    }
    fn index(self) -> usize {
        self.get() as usize
    }
}

#[cfg(test)]
mod tests;
