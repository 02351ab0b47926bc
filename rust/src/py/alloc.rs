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

use super::array::{count, detachable, grant_of, ints, page_array_granted, Int};
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

/// Page allocator over pages `1..=num_pages` of `page_size` tokens (page 0 is padding).
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

    fn alloc<'py>(&self, py: Python<'py>, n: Int) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let n = count("n", &n)?;
        let (pages, gens) = self.take(py, n).map_err(to_py)?;
        hand_out(py, &self.inner, self.tag, pages, gens)
    }

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

    fn free(&self, py: Python<'_>, pages: &Bound<'_, PyAny>) -> PyResult<()> {
        let arr = ints(pages, "pages")?;
        let p = arr.pages("pages")?;
        let long = p.len() >= DETACH_MIN;
        let gens = self.granted(pages, p.len())?;
        let p = detachable(p, long)?;
        with_lock(py, &self.inner, long, |a| {
            if let Some(g) = &gens {
                a.check_grant(&p, g)?;
            }
            a.free(&p[..])
        })
        .map_err(to_py)
    }

    fn inc_ref(&self, py: Python<'_>, pages: &Bound<'_, PyAny>) -> PyResult<()> {
        let arr = ints(pages, "pages")?;
        let p = arr.pages("pages")?;
        let long = p.len() >= DETACH_MIN;
        let gens = self.granted(pages, p.len())?;
        let p = detachable(p, long)?;
        with_lock(py, &self.inner, long, |a| {
            if let Some(g) = &gens {
                a.check_grant(&p, g)?;
            }
            a.inc_ref(&p[..])
        })
        .map_err(to_py)
    }

    fn ref_counts<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray1<u32>>> {
        let v = with_lock(py, &self.inner, true, |a| a.ref_counts()).map_err(to_py)?;
        Ok(PyArray1::from_vec(py, v))
    }

    #[getter]
    fn num_free(&self, py: Python<'_>) -> usize {
        with_lock(py, &self.inner, false, |a| a.num_free())
    }
    #[getter]
    fn num_used(&self, py: Python<'_>) -> usize {
        with_lock(py, &self.inner, false, |a| a.num_used())
    }
    #[getter]
    fn num_pages(&self, py: Python<'_>) -> usize {
        with_lock(py, &self.inner, false, |a| a.num_pages())
    }
    #[getter]
    fn page_size(&self, py: Python<'_>) -> usize {
        with_lock(py, &self.inner, false, |a| a.page_size())
    }
    #[getter]
    fn debug(&self) -> bool {
        self.tag.is_some()
    }

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
