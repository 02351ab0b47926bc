//! Page allocator: a free list plus one reference count per page.
//!
//! Usable pages are `1..=num_pages`; page 0 ([`PADDING_PAGE`]) is the reserved padding page and is
//! never handed out, freed or shared. `alloc` hands pages out with one reference each; `inc_ref`
//! adds a holder; `free` drops one reference and the page returns to the free list when its last
//! reference goes. Every call is atomic: it validates its whole input first and changes nothing
//! on error, so a double free or a repeated id can never put one page on the free list twice
//! (CASES.md KVB-21). The checks are always on: they cost one pass over the call's pages.
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

/// Per-page state, kept together so one page costs one cache line touch.
#[derive(Debug, Clone, Copy, Default)]
struct Slot {
    /// Reference count in the low 31 bits; bit 31 set while a prefix cache holds one of them.
    refs: u32,
    /// Stamp of the last call that saw the page: detects repeated ids in O(n), no allocation.
    seen: u32,
}

const CACHED: u32 = 1 << 31;
const MAX_REFS: u32 = CACHED - 1;

impl Slot {
    const fn count(self) -> u32 {
        self.refs & MAX_REFS
    }
    const fn cached(self) -> bool {
        self.refs & CACHED != 0
    }
}

/// What a validated call is about to do with its pages.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Use {
    /// Drop one of the caller's references (not the cache's).
    Free,
    /// Add one reference.
    Share,
    /// Add the cache's reference (the page must not be cached yet).
    Cache,
}

/// The page allocator. Not thread-safe by itself; the Python binding wraps it in a mutex.
#[derive(Debug)]
pub struct PageAllocator {
    id: u64,
    page_size: u32,
    num_pages: u32,
    /// State per page id; index 0 (padding) stays unused.
    slots: Vec<Slot>,
    /// Free pages, used as a stack (the last entries are handed out first).
    free: Vec<PageId>,
    stamp: u32,
    /// Cached pages that someone else holds too (count >= 2): when there are none, evicting a
    /// page always frees it, and the cache can plan evictions without looking at each page.
    shared_cached: usize,
}

impl PageAllocator {
    /// An allocator of `num_pages` usable pages (ids `1..=num_pages`) of `page_size` tokens.
    ///
    /// # Errors
    /// [`AllocError::ZeroPages`], [`AllocError::ZeroPageSize`], or
    /// [`AllocError::TooManySlots`] when `(num_pages + 1) * page_size` exceeds the int32 range.
    pub fn new(num_pages: u64, page_size: u64) -> Result<Self, AllocError> {
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
        // Stack order: the first `alloc` returns 1, 2, 3, ...
        let free = (1..=n).rev().filter_map(PageId::new).collect();
        Ok(Self {
            id: next_id(),
            page_size: page_size as u32,
            num_pages: n,
            slots: vec![Slot::default(); n as usize + 1],
            free,
            stamp: 0,
            shared_cached: 0,
        })
    }

    pub const fn num_pages(&self) -> usize {
        self.num_pages as usize
    }
    pub const fn page_size(&self) -> usize {
        self.page_size as usize
    }
    pub fn num_free(&self) -> usize {
        self.free.len()
    }
    /// Pages with at least one reference.
    pub fn num_used(&self) -> usize {
        self.num_pages as usize - self.free.len()
    }
    /// References held on `page` (0 for a free page), the cache's included.
    pub fn ref_count(&self, page: PageId) -> u32 {
        self.slots.get(page.index()).map_or(0, |s| s.count())
    }
    /// Reference count of every page id, index 0 (padding) included.
    pub fn ref_counts(&self) -> Vec<u32> {
        self.slots.iter().map(|s| s.count()).collect()
    }
    /// Whether a prefix cache holds a reference on `page`.
    pub fn is_cached(&self, page: PageId) -> bool {
        self.slots.get(page.index()).is_some_and(|s| s.cached())
    }
    pub(crate) const fn id(&self) -> u64 {
        self.id
    }

    /// Hands out `n` pages with one reference each.
    ///
    /// # Errors
    /// [`AllocError::OutOfPages`] when fewer than `n` are free; nothing is allocated then.
    pub fn alloc(&mut self, n: usize) -> Result<Vec<PageId>, AllocError> {
        self.take(n, |p| p)
    }

    /// [`alloc`](Self::alloc) returning the ids as int32 (page-table entries) in one pass.
    ///
    /// # Errors
    /// As [`alloc`](Self::alloc).
    pub fn alloc_i32(&mut self, n: usize) -> Result<Vec<i32>, AllocError> {
        self.take(n, PageId::as_i32)
    }

    fn take<T>(&mut self, n: usize, f: impl Fn(PageId) -> T) -> Result<Vec<T>, AllocError> {
        if n > self.free.len() {
            return Err(AllocError::OutOfPages {
                requested: n,
                free: self.free.len(),
                evictable: 0,
            });
        }
        let start = self.free.len() - n;
        // A slice, not the Vec: its pointer and length stay in registers through the loop.
        let slots = &mut self.slots[..];
        let out: Vec<T> = self.free[start..]
            .iter()
            .rev()
            .map(|&p| {
                slots[p.index()].refs = 1;
                f(p)
            })
            .collect();
        self.free.truncate(start);
        Ok(out)
    }

    /// Drops one reference on each page; a page returns to the free list at zero.
    ///
    /// # Errors
    /// The padding page, an id out of range, a free page, a page whose only reference is a prefix
    /// cache's, or an id repeated in `pages` ([`AllocError`]); nothing changes then.
    pub fn free<P: RawPage>(&mut self, pages: &[P]) -> Result<(), AllocError> {
        // One pass that checks and applies each page (counters kept local, so the loop carries
        // no store); on an error the pages already done are rolled back, so the call still
        // changes nothing then. Pages that reached zero go to the free list afterwards.
        let stamp = self.next_stamp();
        let slots = &mut self.slots[..];
        let (mut unshared, mut freed) = (0usize, 0usize);
        for (k, &raw) in pages.iter().enumerate() {
            // A negative id maps to an index out of range, like any id above num_pages.
            let v = usize::try_from(raw.to_i64()).unwrap_or(usize::MAX);
            let ok = v != 0
                && slots
                    .get(v)
                    .is_some_and(|s| s.seen != stamp && s.count() > u32::from(s.cached()));
            if !ok {
                for &done in &pages[..k] {
                    slots[done.to_i64() as usize].refs += 1;
                }
                return Err(self.held_error(raw, stamp, Use::Free));
            }
            let s = &mut slots[v];
            let refs = s.refs - 1;
            *s = Slot { refs, seen: stamp };
            unshared += usize::from(refs == CACHED | 1);
            freed += usize::from(refs == 0);
        }
        self.shared_cached -= unshared;
        if freed > 0 {
            // Listed once each (checked above): the pages at zero now are the ones freed here.
            let slots = &self.slots;
            self.free.extend(pages.iter().filter_map(|&raw| {
                let i = raw.to_i64() as u32;
                if slots[i as usize].refs == 0 {
                    PageId::new(i)
                } else {
                    None
                }
            }));
        }
        Ok(())
    }

    /// The error [`check_held`](Self::check_held) reports for `raw` (known to fail) in the call
    /// of stamp `stamp`.
    fn held_error<P: RawPage>(&self, raw: P, stamp: u32, what: Use) -> AllocError {
        let p = match self.page(raw) {
            Ok(p) => p,
            Err(e) => return e,
        };
        let s = self.slots[p.index()];
        let count = s.count();
        // A repeat of an id this call already applied: report it as the repeat it is.
        if s.seen == stamp {
            return AllocError::Duplicate { page: p.get() };
        }
        if count == 0 {
            return AllocError::NotAllocated { page: p.get() };
        }
        match what {
            Use::Free => AllocError::OnlyCached { page: p.get() },
            Use::Share | Use::Cache if count == MAX_REFS => {
                AllocError::RefOverflow { page: p.get() }
            }
            _ => AllocError::AlreadyCached { page: p.get() },
        }
    }

    fn next_stamp(&mut self) -> u32 {
        self.stamp = self.stamp.wrapping_add(1);
        if self.stamp == 0 {
            self.slots.iter_mut().for_each(|s| s.seen = 0);
            self.stamp = 1;
        }
        self.stamp
    }

    /// Adds one reference to each page (another holder shares it).
    ///
    /// # Errors
    /// As [`free`](Self::free), plus [`AllocError::RefOverflow`]; nothing changes then.
    pub fn inc_ref<P: RawPage>(&mut self, pages: &[P]) -> Result<(), AllocError> {
        self.check_held(pages, Use::Share)?;
        for &raw in pages {
            let s = &mut self.slots[raw.to_i64() as usize];
            s.refs += 1;
            if s.refs == CACHED | 2 {
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

    /// Validates that every page is usable, allocated and listed once, and allowed for `what`.
    /// Changes no reference count.
    pub(crate) fn check_held<P: RawPage>(
        &mut self,
        pages: &[P],
        what: Use,
    ) -> Result<(), AllocError> {
        let stamp = self.next_stamp();
        for &raw in pages {
            let p = self.page(raw)?;
            let s = &mut self.slots[p.index()];
            let count = s.count();
            if count == 0 {
                return Err(AllocError::NotAllocated { page: p.get() });
            }
            if s.seen == stamp {
                return Err(AllocError::Duplicate { page: p.get() });
            }
            match what {
                Use::Free if count == u32::from(s.cached()) => {
                    return Err(AllocError::OnlyCached { page: p.get() })
                }
                Use::Share | Use::Cache if count == MAX_REFS => {
                    return Err(AllocError::RefOverflow { page: p.get() })
                }
                Use::Cache if s.cached() => {
                    return Err(AllocError::AlreadyCached { page: p.get() })
                }
                _ => {}
            }
            s.seen = stamp;
        }
        Ok(())
    }

    /// The cache's reference: taken on a held page not cached yet, checked by the caller.
    #[cfg(test)]
    pub(crate) fn retain_cached(&mut self, p: PageId) {
        let s = &mut self.slots[p.index()];
        debug_assert!(s.count() > 0 && !s.cached() && s.count() < MAX_REFS);
        s.refs = (s.refs + 1) | CACHED;
        self.shared_cached += 1; // the holder that handed it over still has its reference
    }

    /// Takes the cache's reference on each page, which must be held, not cached yet and listed
    /// once: validation and update in one pass (rolled back on an error, so nothing changes then).
    /// Returns the pages as ids.
    pub(crate) fn cache_pages<P: RawPage>(
        &mut self,
        pages: &[P],
    ) -> Result<Vec<PageId>, AllocError> {
        let stamp = self.next_stamp();
        let slots = &mut self.slots[..];
        for (k, &raw) in pages.iter().enumerate() {
            let v = usize::try_from(raw.to_i64()).unwrap_or(usize::MAX);
            // Held (count >= 1), not cached (bit 31 clear) and below the maximum: one compare.
            let ok = v != 0
                && slots
                    .get(v)
                    .is_some_and(|s| s.seen != stamp && s.refs.wrapping_sub(1) < MAX_REFS - 1);
            if !ok {
                for &done in &pages[..k] {
                    let s = &mut slots[done.to_i64() as usize];
                    s.refs = (s.refs & MAX_REFS) - 1;
                }
                return Err(self.held_error(raw, stamp, Use::Cache));
            }
            let s = &mut slots[v];
            *s = Slot {
                refs: (s.refs + 1) | CACHED,
                seen: stamp,
            };
        }
        // Every holder that handed a page over still has its reference.
        self.shared_cached += pages.len();
        // All validated as usable ids above.
        Ok(pages
            .iter()
            .map(|&raw| PageId(NonZeroU32::new(raw.to_i64() as u32).unwrap_or(NonZeroU32::MIN)))
            .collect())
    }

    /// Cached pages with another holder besides the cache.
    pub(crate) const fn shared_cached(&self) -> usize {
        self.shared_cached
    }

    /// Drops the cache's reference on a page it holds.
    #[cfg(test)]
    pub(crate) fn release_cached(&mut self, p: PageId) {
        self.release_cached_all(&[p]);
    }

    /// Drops the cache's reference on each page (all held by it, each listed once). Slots are
    /// updated in one tight pass; the pages that reached zero then go to the free list.
    pub(crate) fn release_cached_all(&mut self, pages: &[PageId]) {
        let slots = &mut self.slots[..];
        let (mut unshared, mut freed) = (0usize, 0usize);
        for &p in pages {
            let s = &mut slots[p.index()];
            debug_assert!(
                s.cached() && s.count() > 0,
                "release of page {} the cache does not hold",
                p.get()
            );
            let count = s.count();
            unshared += usize::from(count >= 2);
            s.refs = count.saturating_sub(1);
            freed += usize::from(s.refs == 0);
        }
        self.shared_cached -= unshared;
        if freed == pages.len() {
            self.free.extend_from_slice(pages);
        } else if freed > 0 {
            let slots = &self.slots;
            self.free
                .extend(pages.iter().copied().filter(|p| slots[p.index()].refs == 0));
        }
    }
}

/// Integer types a page id may arrive as (numpy int32 / int64, Rust ids).
pub trait RawPage: Copy {
    fn to_i64(self) -> i64;
}
impl RawPage for i32 {
    fn to_i64(self) -> i64 {
        i64::from(self)
    }
}
impl RawPage for i64 {
    fn to_i64(self) -> i64 {
        self
    }
}
impl RawPage for u32 {
    fn to_i64(self) -> i64 {
        i64::from(self)
    }
}
impl RawPage for PageId {
    fn to_i64(self) -> i64 {
        i64::from(self.get())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(v: &[PageId]) -> Vec<u32> {
        v.iter().map(|p| p.get()).collect()
    }

    #[test]
    fn option_page_id_is_four_bytes() {
        assert_eq!(std::mem::size_of::<Option<PageId>>(), 4);
    }

    #[test]
    fn new_rejects_bad_sizes() {
        assert_eq!(PageAllocator::new(0, 1).unwrap_err(), AllocError::ZeroPages);
        assert_eq!(
            PageAllocator::new(1, 0).unwrap_err(),
            AllocError::ZeroPageSize
        );
        // (3 + 1) * 2^29 = 2^31 > i32::MAX; one page less fits.
        assert!(matches!(
            PageAllocator::new(3, 1 << 29),
            Err(AllocError::TooManySlots { .. })
        ));
        assert!(PageAllocator::new(2, 1 << 29).is_ok());
        assert!(matches!(
            PageAllocator::new(u64::MAX, 2),
            Err(AllocError::TooManySlots { .. })
        ));
    }

    #[test]
    fn alloc_hands_out_pages_one_to_n_never_padding() {
        let mut a = PageAllocator::new(4, 1).unwrap();
        assert_eq!(ids(&a.alloc(3).unwrap()), vec![1, 2, 3]);
        assert_eq!(a.num_free(), 1);
        assert_eq!(a.num_used(), 3);
        let err = a.alloc(2).unwrap_err();
        assert_eq!(
            err,
            AllocError::OutOfPages {
                requested: 2,
                free: 1,
                evictable: 0
            }
        );
        assert_eq!(a.num_free(), 1, "failed alloc changes nothing");
        assert_eq!(ids(&a.alloc(1).unwrap()), vec![4]);
        assert!(a.alloc(0).unwrap().is_empty());
    }

    /// CASES.md KVB-21, for both page sizes.
    #[test]
    fn kvb21_double_free_never_aliases_a_page() {
        for ps in [1, 16] {
            let mut a = PageAllocator::new(4, ps).unwrap();
            let p = a.alloc(1).unwrap();
            a.free(&p).unwrap();
            assert_eq!(
                a.free(&p).unwrap_err(),
                AllocError::NotAllocated { page: p[0].get() }
            );
            assert_eq!(a.num_free(), 4);
            let x = a.alloc(2).unwrap();
            let y = a.alloc(2).unwrap();
            let mut all = ids(&x);
            all.extend(ids(&y));
            all.sort_unstable();
            all.dedup();
            assert_eq!(all.len(), 4, "four distinct pages");
            assert!(matches!(
                a.alloc(1),
                Err(AllocError::OutOfPages {
                    requested: 1,
                    free: 0,
                    ..
                })
            ));
            let q = x[0];
            assert_eq!(
                a.free(&[q, q]).unwrap_err(),
                AllocError::Duplicate { page: q.get() }
            );
            assert_eq!(a.ref_count(q), 1, "q untouched by the rejected call");

            let mut a = PageAllocator::new(4, ps).unwrap();
            let p = a.alloc(1).unwrap();
            a.inc_ref(&p).unwrap();
            assert_eq!(a.ref_count(p[0]), 2);
            a.free(&p).unwrap();
            assert_eq!(a.num_free(), 3);
            a.free(&p).unwrap();
            assert_eq!(
                a.num_free(),
                4,
                "returned exactly once, on the second release"
            );
            assert!(a.free(&p).is_err());
            assert_eq!(a.num_free(), 4);
        }
    }

    #[test]
    fn free_is_atomic_on_any_bad_id() {
        let mut a = PageAllocator::new(4, 1).unwrap();
        let p = a.alloc(2).unwrap();
        for bad in [
            vec![1i64, 0],
            vec![1, 5],
            vec![1, -1],
            vec![1, 3],
            vec![2, 1, 2],
        ] {
            assert!(a.free(&bad).is_err(), "{bad:?}");
            assert_eq!(a.num_free(), 2);
            assert_eq!(a.ref_count(p[0]), 1);
            assert_eq!(a.ref_count(p[1]), 1);
        }
        assert_eq!(a.free(&[0i32]).unwrap_err(), AllocError::PaddingPage);
        assert_eq!(
            a.free(&[9i32]).unwrap_err(),
            AllocError::OutOfRange {
                page: 9,
                num_pages: 4
            }
        );
        assert!(a.inc_ref(&[3i32]).is_err(), "cannot share a free page");
    }

    #[test]
    fn a_cached_reference_cannot_be_freed_by_a_holder() {
        let mut a = PageAllocator::new(2, 1).unwrap();
        let p = a.alloc(1).unwrap();
        a.retain_cached(p[0]);
        a.free(&p).unwrap();
        assert_eq!(
            a.free(&p).unwrap_err(),
            AllocError::OnlyCached { page: p[0].get() }
        );
        assert_eq!(a.ref_count(p[0]), 1);
        a.release_cached(p[0]);
        assert_eq!(a.num_free(), 2);
    }

    #[test]
    fn stamp_wraparound_keeps_duplicate_detection() {
        let mut a = PageAllocator::new(2, 1).unwrap();
        let p = a.alloc(2).unwrap();
        a.stamp = u32::MAX;
        a.slots[1].seen = 1; // a stale stamp that would alias after the wrap
        assert!(a.inc_ref(&p).is_ok());
        assert_eq!(a.stamp, 1);
        assert!(a.inc_ref(&[p[0], p[0]]).is_err());
    }

    #[test]
    fn helpers() {
        assert_eq!(count("n", 3), Ok(3));
        assert_eq!(
            count("n", -1),
            Err(AllocError::Negative {
                what: "n",
                value: -1
            })
        );
        assert_eq!(narrow_pages(&[1, 2]), Ok(vec![1, 2]));
        assert!(narrow_pages(&[1 << 40]).is_err());
    }
}
