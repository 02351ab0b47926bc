//! Bindings of `alloc`: `PageAllocator`, numpy int32 page arrays in and out.
//!
//! The Rust allocator lives in an `Arc<Mutex<..>>` so a `RadixCache` built over it shares the very
//! same state (see `py/radix.rs`). Locks are taken cache first, allocator second, never the reverse.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use numpy::PyArray1;
use pyo3::prelude::*;

use super::array::{count, ints, Int};
use super::error::to_py;
use crate::alloc::{AllocError, PageAllocator};

pub(crate) type Shared = Arc<Mutex<PageAllocator>>;

/// Locks a mutex; no kvpool operation panics while holding one, so poisoning carries no meaning.
pub(crate) fn guard<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Page allocator over pages `1..=num_pages` of `page_size` tokens (page 0 is padding).
#[pyclass(name = "PageAllocator", module = "kvpool._core", frozen)]
pub(crate) struct PyPageAllocator {
    pub(crate) inner: Shared,
}

#[pymethods]
impl PyPageAllocator {
    #[new]
    fn new(num_pages: Int, page_size: Int) -> PyResult<Self> {
        let (n, ps) = (
            count("num_pages", num_pages.0)?,
            count("page_size", page_size.0)?,
        );
        let a = PageAllocator::new(n as u64, ps as u64).map_err(to_py)?;
        Ok(Self {
            inner: Arc::new(Mutex::new(a)),
        })
    }

    fn alloc<'py>(&self, py: Python<'py>, n: Int) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let pages = guard(&self.inner)
            .alloc_i32(count("n", n.0)?)
            .map_err(to_py)?;
        Ok(PyArray1::from_vec(py, pages))
    }

    fn try_alloc<'py>(
        &self,
        py: Python<'py>,
        n: Int,
    ) -> PyResult<Option<Bound<'py, PyArray1<i32>>>> {
        match guard(&self.inner).alloc_i32(count("n", n.0)?) {
            Ok(pages) => Ok(Some(PyArray1::from_vec(py, pages))),
            Err(AllocError::OutOfPages { .. }) => Ok(None),
            Err(e) => Err(to_py(e)),
        }
    }

    fn free(&self, pages: &Bound<'_, PyAny>) -> PyResult<()> {
        let arr = ints(pages, "pages")?;
        guard(&self.inner).free(&arr.pages("pages")?).map_err(to_py)
    }

    fn inc_ref(&self, pages: &Bound<'_, PyAny>) -> PyResult<()> {
        let arr = ints(pages, "pages")?;
        guard(&self.inner)
            .inc_ref(&arr.pages("pages")?)
            .map_err(to_py)
    }

    fn ref_counts<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<u32>> {
        PyArray1::from_vec(py, guard(&self.inner).ref_counts())
    }

    #[getter]
    fn num_free(&self) -> usize {
        guard(&self.inner).num_free()
    }
    #[getter]
    fn num_used(&self) -> usize {
        guard(&self.inner).num_used()
    }
    #[getter]
    fn num_pages(&self) -> usize {
        guard(&self.inner).num_pages()
    }
    #[getter]
    fn page_size(&self) -> usize {
        guard(&self.inner).page_size()
    }

    fn __repr__(&self) -> String {
        let a = guard(&self.inner);
        format!(
            "PageAllocator(num_pages={}, page_size={}, num_free={})",
            a.num_pages(),
            a.page_size(),
            a.num_free()
        )
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyPageAllocator>()
}
