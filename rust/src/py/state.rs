//! Bindings of the linear-attention state pool: `StateSlotAllocator`, a `PageAllocator` of page
//! size 1 under another name, whose errors name state slots. Locking as in `py/alloc.rs`: the
//! Rust work runs in [`with_lock`], arrays and exceptions are built after the lock drops.

use std::sync::{Arc, Mutex};

use numpy::PyArray1;
use pyo3::prelude::*;

use super::alloc::{hand_out, with_lock, Shared, DETACH_MIN};
use super::array::{count, ints, Int};
use super::error::to_py;
use crate::alloc::{AllocError, PageAllocator};

/// State slots `1..=num_slots` (slot 0 is padding), one per running request of a model with
/// linear-attention (Mamba, GatedDeltaNet) layers, ref-counted like pages.
///
/// A slot indexes the `conv_state` / `ssm_state` buffers of every linear-attention layer. A radix
/// cache built with `state_slots=` holds a reference on each saved state it stores.
///
/// Parameters
/// ----------
/// num_slots : int
///     Usable slots (slot 0, the padding slot, comes on top); `Plan.num_state_slots`.
///
/// Raises
/// ------
/// InvalidArgumentError
///     Zero, negative or too many slots (beyond int32), an integer beyond int64.
/// MemoryError
///     The per-slot state (12 bytes a slot) cannot be allocated.
///
/// Notes
/// -----
/// Threading: as `PageAllocator` (each call takes the pool's mutex and is atomic; `alloc` /
/// `free` / `inc_ref` of 16,384 slots or more, `ref_counts` and construction of a large pool
/// release the GIL).
///
/// Examples
/// --------
/// >>> import kvpool
/// >>> s = kvpool.StateSlotAllocator(4)
/// >>> slots = s.alloc(2)
/// >>> slots.tolist(), s.num_free
/// ([1, 2], 2)
/// >>> s.free(slots)
#[pyclass(name = "StateSlotAllocator", module = "kvpool._core", frozen)]
pub(crate) struct PyStateSlotAllocator {
    pub(crate) inner: Shared,
}

impl PyStateSlotAllocator {
    fn take(&self, py: Python<'_>, n: usize) -> Result<Vec<i32>, AllocError> {
        with_lock(py, &self.inner, n >= DETACH_MIN, |a| a.alloc_i32(n))
    }

    /// `free` / `inc_ref`: `f` on a copy of the slots of `slots`.
    fn each(
        &self,
        py: Python<'_>,
        slots: &Bound<'_, PyAny>,
        f: impl FnOnce(&mut PageAllocator, &[i32]) -> Result<(), AllocError> + Send,
    ) -> PyResult<()> {
        let arr = ints(slots, "slots")?;
        let view = arr.view("slots")?;
        // (copied, then checked and applied: with the GIL released when long)
        with_lock(py, &self.inner, view.long(), |a| f(a, &view.pages_stable()?)).map_err(to_py)
    }
}

#[pymethods]
impl PyStateSlotAllocator {
    #[new]
    fn new(py: Python<'_>, num_slots: Int) -> PyResult<Self> {
        let n = count("num_slots", &num_slots)?;
        let build = || PageAllocator::state_slots(n as u64);
        let a = if n >= DETACH_MIN {
            py.detach(build)
        } else {
            build()
        }
        .map_err(to_py)?;
        Ok(Self {
            inner: Arc::new(Mutex::new(a)),
        })
    }

    /// Hands out `n` state slots, one reference each.
    ///
    /// Returns
    /// -------
    /// numpy.ndarray
    ///     int32 slot ids, shape `(n,)`.
    ///
    /// Raises
    /// ------
    /// OutOfPagesError
    ///     Fewer than `n` slots are free (the message names state slots; nothing is allocated).
    /// InvalidArgumentError
    ///     `n` is negative or beyond int64.
    /// KeyboardInterrupt
    ///     Ctrl-C during the call: the slots are given back before it propagates.
    fn alloc<'py>(&self, py: Python<'py>, n: Int) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let n = count("n", &n)?;
        let slots = self.take(py, n).map_err(to_py)?;
        hand_out(py, &self.inner, None, slots, Vec::new())
    }

    /// As `alloc`, but returns None when fewer than `n` slots are free.
    fn try_alloc<'py>(
        &self,
        py: Python<'py>,
        n: Int,
    ) -> PyResult<Option<Bound<'py, PyArray1<i32>>>> {
        let n = count("n", &n)?;
        match self.take(py, n) {
            Ok(slots) => hand_out(py, &self.inner, None, slots, Vec::new()).map(Some),
            Err(AllocError::OutOfStateSlots { .. }) => Ok(None),
            Err(e) => Err(to_py(e)),
        }
    }

    /// Drops one reference on each slot; a slot returns to the free list at zero.
    ///
    /// Parameters
    /// ----------
    /// slots : numpy.ndarray
    ///     1-D int32 or int64 slot ids, C-contiguous, each listed once.
    ///
    /// Raises
    /// ------
    /// PageError
    ///     Padding slot 0, out of range, already free, repeated, or held only by a prefix cache
    ///     (the message names state slots; nothing changes).
    fn free(&self, py: Python<'_>, slots: &Bound<'_, PyAny>) -> PyResult<()> {
        self.each(py, slots, |a, s| a.free(s))
    }

    /// Adds one reference to each (allocated, listed once) slot: another holder shares it.
    ///
    /// Raises
    /// ------
    /// PageError
    ///     As `free`, or a slot at the maximum count (nothing changes).
    fn inc_ref(&self, py: Python<'_>, slots: &Bound<'_, PyAny>) -> PyResult<()> {
        self.each(py, slots, |a, s| a.inc_ref(s))
    }

    /// A copy of every slot's reference count, index 0 (padding) included.
    ///
    /// Returns
    /// -------
    /// numpy.ndarray
    ///     uint32, shape `(num_slots + 1,)`.
    fn ref_counts<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray1<u32>>> {
        let v = with_lock(py, &self.inner, true, |a| a.ref_counts()).map_err(to_py)?;
        Ok(PyArray1::from_vec(py, v))
    }

    /// Slots with no reference.
    #[getter]
    fn num_free(&self, py: Python<'_>) -> usize {
        with_lock(py, &self.inner, false, |a| a.num_free())
    }
    /// Slots with at least one reference (`num_free + num_used == num_slots`).
    #[getter]
    fn num_used(&self, py: Python<'_>) -> usize {
        with_lock(py, &self.inner, false, |a| a.num_used())
    }
    /// Usable slots (ids `1..num_slots`).
    #[getter]
    fn num_slots(&self, py: Python<'_>) -> usize {
        with_lock(py, &self.inner, false, |a| a.num_pages())
    }

    /// `StateSlotAllocator(num_slots=..., num_free=...)`.
    fn __repr__(&self, py: Python<'_>) -> String {
        let (n, f) = with_lock(py, &self.inner, false, |a| (a.num_pages(), a.num_free()));
        format!("StateSlotAllocator(num_slots={n}, num_free={f})")
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyStateSlotAllocator>()
}
