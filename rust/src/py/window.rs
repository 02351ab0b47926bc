//! Bindings of `window`: `release_window_pages` over numpy int32 page tables, in place.

use numpy::{PyArray1, PyArrayMethods};
use pyo3::prelude::*;

use super::alloc::{guard, PyPageAllocator};
use super::array::{count, ints, table, Int};
use super::error::{array_type_error, to_py};
use crate::window;

/// Frees the sliding-window pages no query reads again, for a whole batch (see `_core.pyi`).
#[pyfunction]
#[pyo3(signature = (allocator, page_table, seq_lens, window, *, num_draft_tokens=None, first_live=None))]
fn release_window_pages(
    allocator: &Bound<'_, PyPageAllocator>,
    page_table: &Bound<'_, PyAny>,
    seq_lens: &Bound<'_, PyAny>,
    window: Int,
    num_draft_tokens: Option<Int>,
    first_live: Option<&Bound<'_, PyAny>>,
) -> PyResult<usize> {
    let py = page_table.py();
    let (t, _, width) = table(page_table, "page_table")?;
    let s = ints(seq_lens, "seq_lens")?;
    let s = s.lens("seq_lens")?;
    let (w, d) = (
        count("window", window.0)?,
        count("num_draft_tokens", num_draft_tokens.map_or(0, |d| d.0))?,
    );
    let fl = first_live
        .map(|f| {
            f.cast::<PyArray1<i32>>().map_err(|_| {
                array_type_error(py, "`first_live` must be a 1-D numpy int32 array".into())
            })
        })
        .transpose()?;
    let mut tw = t
        .try_readwrite()
        .map_err(|e| array_type_error(py, format!("`page_table`: {e}")))?;
    let tab = tw
        .as_slice_mut()
        .map_err(|_| array_type_error(py, "`page_table` must be C-contiguous".into()))?;
    let mut fw = fl
        .map(|f| {
            f.try_readwrite()
                .map_err(|e| array_type_error(py, format!("`first_live`: {e}")))
        })
        .transpose()?;
    let fs = match fw.as_mut() {
        Some(w) => Some(
            w.as_slice_mut()
                .map_err(|_| array_type_error(py, "`first_live` must be C-contiguous".into()))?,
        ),
        None => None,
    };
    // Computed under the allocator's lock; the error becomes a Python object after it is dropped.
    let shared = &allocator.get().inner;
    let r = {
        let mut a = guard(shared);
        window::release_window_pages(&mut a, tab, width, &s, w, d, fs)
    };
    r.map_err(to_py)
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(release_window_pages, m)?)
}
