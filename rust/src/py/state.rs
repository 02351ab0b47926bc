//! Bindings of the linear-attention state pool: `StateSlotAllocator`, a `PageAllocator` of page
//! size 1 under another name, whose errors name state slots.

use std::sync::{Arc, Mutex};

use numpy::PyArray1;
use pyo3::prelude::*;

use super::alloc::{guard, Shared};
use super::array::{count, ints, Int};
use super::error::to_py;
use crate::alloc::{AllocError, PageAllocator};

/// State slots `1..=num_slots` (slot 0 is padding), one per running request, ref-counted.
#[pyclass(name = "StateSlotAllocator", module = "kvpool._core", frozen)]
pub(crate) struct PyStateSlotAllocator {
    pub(crate) inner: Shared,
}

#[pymethods]
impl PyStateSlotAllocator {
    #[new]
    fn new(num_slots: Int) -> PyResult<Self> {
        let n = count("num_slots", num_slots.0)?;
        let a = PageAllocator::state_slots(n as u64).map_err(to_py)?;
        Ok(Self {
            inner: Arc::new(Mutex::new(a)),
        })
    }

    fn alloc<'py>(&self, py: Python<'py>, n: Int) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let n = count("n", n.0)?;
        let r = guard(&self.inner).alloc_i32(n);
        Ok(PyArray1::from_vec(py, r.map_err(to_py)?))
    }

    fn try_alloc<'py>(
        &self,
        py: Python<'py>,
        n: Int,
    ) -> PyResult<Option<Bound<'py, PyArray1<i32>>>> {
        let n = count("n", n.0)?;
        let r = guard(&self.inner).alloc_i32(n);
        match r {
            Ok(slots) => Ok(Some(PyArray1::from_vec(py, slots))),
            Err(AllocError::OutOfStateSlots { .. }) => Ok(None),
            Err(e) => Err(to_py(e)),
        }
    }

    fn free(&self, slots: &Bound<'_, PyAny>) -> PyResult<()> {
        let arr = ints(slots, "slots")?;
        let s = arr.pages("slots")?;
        let r = guard(&self.inner).free(&s);
        r.map_err(to_py)
    }

    fn inc_ref(&self, slots: &Bound<'_, PyAny>) -> PyResult<()> {
        let arr = ints(slots, "slots")?;
        let s = arr.pages("slots")?;
        let r = guard(&self.inner).inc_ref(&s);
        r.map_err(to_py)
    }

    fn ref_counts<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<u32>> {
        let v = guard(&self.inner).ref_counts();
        PyArray1::from_vec(py, v)
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
    fn num_slots(&self) -> usize {
        guard(&self.inner).num_pages()
    }

    fn __repr__(&self) -> String {
        let (n, f) = {
            let a = guard(&self.inner);
            (a.num_pages(), a.num_free())
        };
        format!("StateSlotAllocator(num_slots={n}, num_free={f})")
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyStateSlotAllocator>()
}
