//! Bindings of `window`: `release_window_pages` over numpy int32 page tables, in place.

use numpy::PyArray1;
use pyo3::prelude::*;

use super::alloc::{with_lock, PyPageAllocator, DETACH_MIN};
use super::array::{count, detachable, ints, slice_mut, table, writable, Int};
use super::error::{array_type_error, to_py};
use crate::window;

/// Frees the pages of a sliding-window page space that no query reads again, for a batch.
///
/// A sliding layer's query at position `p` reads positions `p - window + 1 .. p`. After the
/// call, request `i` holds exactly the pages that intersect positions
/// `[max(0, seq_lens[i] - window - num_draft_tokens), seq_lens[i] - 1]`: at most
/// `ceil(min(n, window + d) / page_size) + (1 if page_size > 1 else 0)` pages, what the
/// sizing plan counts per request. Released entries of `page_table` become 0 (the padding
/// page; the kernels never read before the window), so the table keeps its meaning.
///
/// Parameters
/// ----------
/// allocator : PageAllocator
///     The sliding group's allocator (its `page_size` is used).
/// page_table : ndarray of int32, shape [B, max_pages]
///     The group's page table, C-contiguous; updated in place.
/// seq_lens : ndarray of int32 or int64, shape [B]
///     Tokens per request after the current step, draft tokens included. For a decode step
///     (one new token) the call may come before the forward: its query at `seq_lens - 1`
///     reads only kept positions. For an extend step call it after the forward.
/// window : int
///     The window in tokens (>= 1).
/// num_draft_tokens : int, optional
///     Tokens of the current step a speculative verify may still roll back: the pages they
///     could roll back into are kept; call again with 0 once the step commits.
/// first_live : ndarray of int32, shape [B], optional
///     The first entry each request may still hold; read and advanced in place, so a call
///     costs O(B + pages released) (without it each row is looked at from entry 0). Start at
///     0, or at the first nonzero entry of a row from `match_prefix_groups`.
///
/// Notes
/// -----
/// Threading: the call takes the allocator's mutex; a batch of 16,384 entries or more (rows
/// without `first_live`, else requests) runs with the GIL released, reading and writing
/// `page_table` and `first_live` in place: no other thread may use them during the call.
///
/// Returns
/// -------
/// int
///     References dropped (one per released entry; a page shared by several rows drops one
///     reference per row, and a page the prefix cache also holds keeps the cache's).
///
/// Raises
/// ------
/// BatchError
///     Mismatched lengths, negative or too long `seq_lens`, a row too narrow for its
///     request, `window` 0, `first_live` outside `0..max_pages`.
/// PageError
///     `page_table[i, j]` names a page out of range, free, held only by the prefix cache, or
///     listed more often than it has references. Nothing changes on any error.
///
/// Examples
/// --------
/// >>> import numpy as np, kvpool
/// >>> a = kvpool.PageAllocator(8, 4)
/// >>> table = a.alloc(3).reshape(1, 3)  # 10 tokens on pages 1, 2, 3
/// >>> first_live = np.zeros(1, dtype=np.int32)
/// >>> kvpool.release_window_pages(a, table, np.array([10]), 4, first_live=first_live)
/// 1
/// >>> table.tolist(), first_live.tolist(), a.num_used
/// ([[0, 2, 3]], [1], 2)
#[pyfunction]
#[pyo3(signature = (allocator, page_table, seq_lens, window, *, num_draft_tokens=Int::ZERO, first_live=None))]
#[pyo3(
    text_signature = "(allocator, page_table, seq_lens, window, *, num_draft_tokens=0, first_live=None)"
)]
fn release_window_pages(
    allocator: &Bound<'_, PyPageAllocator>,
    page_table: &Bound<'_, PyAny>,
    seq_lens: &Bound<'_, PyAny>,
    window: Int,
    num_draft_tokens: Int,
    first_live: Option<&Bound<'_, PyAny>>,
) -> PyResult<usize> {
    let py = page_table.py();
    let (t, rows, width) = table(page_table, "page_table")?;
    let s = ints(seq_lens, "seq_lens")?;
    let s = s.lens("seq_lens")?;
    let w = count("window", &window)?;
    let d = count("num_draft_tokens", &num_draft_tokens)?;
    let fl = first_live
        .map(|f| {
            f.cast::<PyArray1<i32>>().map_err(|_| {
                array_type_error(py, "`first_live` must be a 1-D numpy int32 array".into())
            })
        })
        .transpose()?;
    // The work: every entry without `first_live`, about one per request with it.
    let long = if fl.is_some() { rows } else { rows * width } >= DETACH_MIN;
    let s = detachable(s, long)?;
    let mut tw = writable(t, "page_table")?;
    let tab = slice_mut(&mut tw, "page_table")?;
    let mut fw = fl.map(|f| writable(f, "first_live")).transpose()?;
    let fs = match fw.as_mut() {
        Some(w) => Some(slice_mut(w, "first_live")?),
        None => None,
    };
    // Computed under the allocator's lock; the error becomes a Python object after it drops.
    let shared = &allocator.get().inner;
    with_lock(py, shared, long, |a| {
        window::release_window_pages(a, tab, width, &s, w, d, fs)
    })
    .map_err(to_py)
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(release_window_pages, m)?)
}
