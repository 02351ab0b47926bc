//! Bindings of `alloc`: `PageAllocator`, numpy int32 page arrays in and out.
//!
//! The Rust allocator lives in an `Arc<Mutex<..>>` so a `RadixCache` built over it shares the very
//! same state (see `py/radix.rs`). Locks are taken cache first, allocator second, never the reverse.
//!
//! Locks and Python: no Python object is created and no Python code runs while a lock is held
//! (the cyclic GC can run a `__del__` at any allocation, and one that calls back into kvpool would
//! wait on the lock its own thread holds). Every method therefore converts its arguments first,
//! runs the Rust work in [`with_lock`] (a closure that returns plain Rust data and core errors and
//! cannot touch Python: the GIL may be released in it), and builds arrays and exceptions after.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError, TryLockError};

use numpy::PyArray1;
use pyo3::prelude::*;

use super::array::{count, grant_of, ints, page_array_granted, Int};
use super::error::to_py;
use crate::alloc::{AllocError, PageAllocator};

pub(crate) type Shared = Arc<Mutex<PageAllocator>>;

/// Work of at least this many elements (pages, tokens) runs with the GIL released: below it the
/// release and re-acquisition cost more than the work, and a thread that releases the GIL waits
/// for it again behind other Python threads (up to the switch interval).
pub(crate) const DETACH_MIN: usize = 1 << 14;

/// Locks a mutex; no kvpool operation panics while holding one, so poisoning carries no meaning.
pub(crate) fn guard<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The lock of `m` if it is free now.
pub(crate) fn try_guard<T>(m: &Mutex<T>) -> Option<MutexGuard<'_, T>> {
    match m.try_lock() {
        Ok(g) => Some(g),
        Err(TryLockError::Poisoned(p)) => Some(p.into_inner()),
        Err(TryLockError::WouldBlock) => None,
    }
}

/// Runs `f` on the locked value. Long work (`long`) runs with the GIL released; short work keeps
/// the GIL when the lock is free and releases it only to wait for the lock (a thread holding
/// the GIL never blocks on a lock another thread holds while it runs detached).
///
/// `f` is `Send`, so it cannot hold a `Python` token: nothing in it can create a Python object.
pub(crate) fn with_lock<T: Send, R: Send>(
    py: Python<'_>,
    m: &Mutex<T>,
    long: bool,
    f: impl FnOnce(&mut T) -> R + Send,
) -> R {
    if !long {
        if let Some(mut g) = try_guard(m) {
            return f(&mut g);
        }
    }
    py.detach(|| f(&mut guard(m)))
}

/// Pages a call took from `alloc`, handed to the caller as a numpy array (with the generations
/// `gens` recorded in debug mode).
///
/// A pending signal is handled first: when its handler raises (Ctrl-C's KeyboardInterrupt) the
/// pages are given back and the error propagates, so a call either returns its pages or leaves
/// the allocator as it was. (CPython checks signals again once the call returned, before the
/// array is bound to a name: a signal that arrives in that window of a few instructions cannot
/// be seen here.)
pub(crate) fn hand_out<'py>(
    py: Python<'py>,
    alloc: &Shared,
    tag: Option<i32>,
    pages: Vec<i32>,
    gens: Vec<u32>,
) -> PyResult<Bound<'py, PyArray1<i32>>> {
    let undo = |pages: &[i32]| {
        let long = pages.len() >= DETACH_MIN;
        // (pages this call took hold a reference of the caller's: giving them back cannot fail)
        let _ = with_lock(py, alloc, long, |a| a.free(pages));
    };
    if let Err(e) = py.check_signals() {
        undo(&pages);
        return Err(e);
    }
    match tag {
        None => Ok(PyArray1::from_vec(py, pages)),
        Some(tag) => page_array_granted(py, tag, &pages, &gens).inspect_err(|_| undo(&pages)),
    }
}

/// Pages `1..num_pages` of `page_size` tokens with reference counts (page 0 is padding).
///
/// Every call is atomic: it validates its whole input first and changes nothing on error.
///
/// Parameters
/// ----------
/// num_pages : int
///     Usable pages (page 0, the padding page, comes on top). `(num_pages + 1) * page_size` must
///     fit in int32 slot indices. The allocator keeps 12 bytes a page (16 with `debug`).
/// page_size : int
///     Tokens per page.
/// debug : bool, default False
///     Record a generation per page in the arrays `alloc` hands out (and `RadixCache.alloc`), so
///     that `free` / `inc_ref` of such an array (or a view of it) after its pages were freed and
///     handed out again raises `PageError` instead of taking another holder's reference. Not
///     caught: copies or concatenations of a stale array (`np.array(p)`, `np.concatenate`, rows of a
///     page table), and a stale free before the pages were handed out again (that one is a plain
///     double free, refused in every mode). Costs nothing when off.
///
/// Raises
/// ------
/// InvalidArgumentError
///     Zero or negative sizes, more slots than int32 holds, an integer beyond int64.
/// MemoryError
///     The per-page state cannot be allocated.
///
/// Notes
/// -----
/// Threading: an allocator may be shared by threads (and with `RadixCache` objects built on it);
/// each call takes its mutex and is atomic. Calls whose work grows with the input (`alloc`/`free`/
/// `inc_ref` of 16,384 pages or more, `ref_counts`, construction of a large pool) release the GIL;
/// shorter ones keep it unless they must wait for the mutex. Arrays passed in are read (and copied)
/// with the GIL released: do not write a `free` argument from another thread during the call. Races
/// between calls are the caller's to close (two threads freeing one request's pages: the second
/// gets `PageError`).
///
/// Examples
/// --------
/// >>> import kvpool
/// >>> a = kvpool.PageAllocator(4, 16)
/// >>> p = a.alloc(2)
/// >>> p.tolist(), a.num_free
/// ([1, 2], 2)
/// >>> a.free(p)
/// >>> a.num_free
/// 4
#[pyclass(name = "PageAllocator", module = "kvpool._core", frozen)]
pub(crate) struct PyPageAllocator {
    pub(crate) inner: Shared,
    /// The allocator id's low 31 bits in debug mode: the mark of the arrays it hands out.
    pub(crate) tag: Option<i32>,
}

impl PyPageAllocator {
    /// `n` pages taken (with their generations in debug mode), as plain Rust data.
    fn take(&self, py: Python<'_>, n: usize) -> Result<(Vec<i32>, Vec<u32>), AllocError> {
        with_lock(py, &self.inner, n >= DETACH_MIN, |a| {
            let pages = a.alloc_i32(n)?;
            let mut gens = Vec::new();
            a.grant(&pages, &mut gens);
            Ok((pages, gens))
        })
    }

    /// The generations `pages` (the argument object) recorded when handed out, in debug mode.
    pub(crate) fn granted(&self, obj: &Bound<'_, PyAny>, len: usize) -> PyResult<Option<Vec<u32>>> {
        match self.tag {
            Some(tag) => grant_of(obj, tag, len),
            None => Ok(None),
        }
    }
}

#[pymethods]
impl PyPageAllocator {
    #[new]
    #[pyo3(signature = (num_pages, page_size, debug=false))]
    fn new(py: Python<'_>, num_pages: Int, page_size: Int, debug: bool) -> PyResult<Self> {
        let (n, ps) = (
            count("num_pages", &num_pages)?,
            count("page_size", &page_size)?,
        );
        // (the per-page state is written once: seconds for 2^31 pages, without the GIL)
        let build = || PageAllocator::with_debug(n as u64, ps as u64, debug);
        let a = if n >= DETACH_MIN { py.detach(build) } else { build() }.map_err(to_py)?;
        let tag = debug.then(|| (a.id() & 0x7fff_ffff) as i32);
        Ok(Self {
            inner: Arc::new(Mutex::new(a)),
            tag,
        })
    }

    /// Hands out `n` pages, one reference each.
    ///
    /// Parameters
    /// ----------
    /// n : int
    ///     Pages wanted (>= 0).
    ///
    /// Returns
    /// -------
    /// numpy.ndarray
    ///     int32 page ids, shape `(n,)`.
    ///
    /// Raises
    /// ------
    /// OutOfPagesError
    ///     Fewer than `n` pages are free (nothing is allocated).
    /// InvalidArgumentError
    ///     `n` is negative or beyond int64.
    /// MemoryError
    ///     The array of ids cannot be allocated (nothing is allocated).
    /// KeyboardInterrupt
    ///     Ctrl-C during the call: the pages are given back before it propagates.
    fn alloc<'py>(&self, py: Python<'py>, n: Int) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let n = count("n", &n)?;
        let (pages, gens) = self.take(py, n).map_err(to_py)?;
        hand_out(py, &self.inner, self.tag, pages, gens)
    }

    /// As `alloc`, but returns None when fewer than `n` pages are free.
    fn try_alloc<'py>(
        &self,
        py: Python<'py>,
        n: Int,
    ) -> PyResult<Option<Bound<'py, PyArray1<i32>>>> {
        let n = count("n", &n)?;
        match self.take(py, n) {
            Ok((pages, gens)) => hand_out(py, &self.inner, self.tag, pages, gens).map(Some),
            Err(AllocError::OutOfPages { .. }) => Ok(None),
            Err(e) => Err(to_py(e)),
        }
    }

    /// Drops one reference on each page; a page returns to the free list at zero.
    ///
    /// Parameters
    /// ----------
    /// pages : numpy.ndarray
    ///     1-D int32 or int64 page ids, C-contiguous, each listed once.
    ///
    /// Raises
    /// ------
    /// PageError
    ///     Padding page, out of range, already free, repeated in `pages`, a page whose only
    ///     remaining reference is the cache's, or (debug mode) an array whose pages were freed and
    ///     handed out again since it got them (nothing changes).
    /// ArrayTypeError
    ///     `pages` is not a contiguous 1-D int32/int64 numpy array.
    fn free(&self, py: Python<'_>, pages: &Bound<'_, PyAny>) -> PyResult<()> {
        let arr = ints(pages, "pages")?;
        let view = arr.view("pages")?;
        let gens = self.granted(pages, view.len())?;
        // (copied, then checked and applied: with the GIL released when long)
        with_lock(py, &self.inner, view.long(), |a| {
            let p = view.pages_stable()?;
            if let Some(g) = &gens {
                a.check_grant(&p, g)?;
            }
            a.free(&p[..])
        })
        .map_err(to_py)
    }

    /// Adds one reference to each (allocated, listed once) page: another holder shares it.
    ///
    /// Raises
    /// ------
    /// PageError
    ///     As `free`, or a page at the maximum count (nothing changes).
    fn inc_ref(&self, py: Python<'_>, pages: &Bound<'_, PyAny>) -> PyResult<()> {
        let arr = ints(pages, "pages")?;
        let view = arr.view("pages")?;
        let gens = self.granted(pages, view.len())?;
        // (copied, then checked and applied: with the GIL released when long)
        with_lock(py, &self.inner, view.long(), |a| {
            let p = view.pages_stable()?;
            if let Some(g) = &gens {
                a.check_grant(&p, g)?;
            }
            a.inc_ref(&p[..])
        })
        .map_err(to_py)
    }

    /// A copy of every page's reference count, index 0 (padding) included.
    ///
    /// Returns
    /// -------
    /// numpy.ndarray
    ///     uint32, shape `(num_pages + 1,)`.
    fn ref_counts<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray1<u32>>> {
        let v = with_lock(py, &self.inner, true, |a| a.ref_counts()).map_err(to_py)?;
        Ok(PyArray1::from_vec(py, v))
    }

    /// Pages with no reference.
    #[getter]
    fn num_free(&self, py: Python<'_>) -> usize {
        with_lock(py, &self.inner, false, |a| a.num_free())
    }
    /// Pages with at least one reference (`num_free + num_used == num_pages`).
    #[getter]
    fn num_used(&self, py: Python<'_>) -> usize {
        with_lock(py, &self.inner, false, |a| a.num_used())
    }
    /// Usable pages (ids `1..num_pages`).
    #[getter]
    fn num_pages(&self, py: Python<'_>) -> usize {
        with_lock(py, &self.inner, false, |a| a.num_pages())
    }
    /// Tokens per page.
    #[getter]
    fn page_size(&self, py: Python<'_>) -> usize {
        with_lock(py, &self.inner, false, |a| a.page_size())
    }
    /// Whether the allocator was made with `debug=True` (generation checks on free).
    #[getter]
    fn debug(&self) -> bool {
        self.tag.is_some()
    }

    /// `PageAllocator(num_pages=..., page_size=..., num_free=...)`.
    fn __repr__(&self, py: Python<'_>) -> String {
        let (n, ps, free) = with_lock(py, &self.inner, false, |a| {
            (a.num_pages(), a.page_size(), a.num_free())
        });
        let debug = if self.tag.is_some() { ", debug=True" } else { "" };
        format!("PageAllocator(num_pages={n}, page_size={ps}, num_free={free}{debug})")
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyPageAllocator>()
}
