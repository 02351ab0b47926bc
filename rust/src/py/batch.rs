//! Bindings of `batch`: page table and slot indices, numpy int32 out (or into caller buffers).

use numpy::{PyArray1, PyArray2, PyArrayMethods};
use pyo3::prelude::*;

use super::alloc::DETACH_MIN;
use super::array::{count, detachable, ints, slice_mut, table, writable, zeros, Int};
use super::error::{array_type_error, to_py};
use crate::batch;

fn out1<'py>(
    py: Python<'py>,
    out: Option<Bound<'py, PyAny>>,
    len: usize,
) -> PyResult<Bound<'py, PyArray1<i32>>> {
    match out {
        None => zeros::<PyArray1<i32>>(py, &[len]),
        Some(o) => o.cast_into::<PyArray1<i32>>().map_err(|e| {
            array_type_error(
                py,
                format!(
                    "`out` must be a 1-D numpy int32 array, got {}",
                    e.into_inner().get_type()
                ),
            )
        }),
    }
}

fn write1(
    out: &Bound<'_, PyArray1<i32>>,
    f: impl FnOnce(&mut [i32]) -> Result<(), batch::BatchError>,
) -> PyResult<()> {
    let mut w = writable(out, "out")?;
    f(slice_mut(&mut w, "out")?).map_err(to_py)
}

/// `f` on the entries of a page table from [`table`], borrowed read-only from numpy.
fn read_table<R>(
    t: &Bound<'_, PyArray2<i32>>,
    f: impl FnOnce(&[i32]) -> PyResult<R>,
) -> PyResult<R> {
    let py = t.py();
    let r = t
        .try_readonly()
        .map_err(|e| array_type_error(py, format!("`page_table`: {e}")))?;
    let tab = r
        .as_slice()
        .map_err(|_| array_type_error(py, "`page_table` must be C-contiguous".into()))?;
    f(tab)
}

/// `[B, max_pages]` int32 page table from per-request page arrays, padded with page 0.
#[pyfunction]
#[pyo3(signature = (pages, max_pages=None, *, out=None))]
fn page_table<'py>(
    py: Python<'py>,
    pages: Vec<Bound<'py, PyAny>>,
    max_pages: Option<Int>,
    out: Option<Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyArray2<i32>>> {
    let arrs = pages
        .iter()
        .map(|p| ints(p, "pages[i]"))
        .collect::<PyResult<Vec<_>>>()?;
    let rows = arrs
        .iter()
        .map(|a| a.pages("pages[i]"))
        .collect::<PyResult<Vec<_>>>()?;
    let refs: Vec<&[i32]> = rows.iter().map(|r| &r[..]).collect();
    let out = match out {
        Some(o) => table(&o, "out")?.0.clone(),
        None => {
            let width = match &max_pages {
                Some(m) => count("max_pages", m)?,
                None => refs.iter().map(|r| r.len()).max().unwrap_or(0),
            };
            zeros::<PyArray2<i32>>(py, &[refs.len(), width])?
        }
    };
    let width = out.dims()[1];
    if let Some(m) = max_pages {
        if count("max_pages", &m)? != width {
            return Err(to_py(batch::BatchError::Length {
                what: "out columns (max_pages)",
                expected: m.value as usize,
                got: width,
            }));
        }
    }
    {
        let mut w = writable(&out, "out")?;
        batch::page_table(&refs, width, slice_mut(&mut w, "out")?).map_err(to_py)?;
    }
    Ok(out)
}

/// New pages per request to grow from `prefix_lens` to `seq_lens` tokens.
#[pyfunction]
fn pages_needed<'py>(
    py: Python<'py>,
    prefix_lens: &Bound<'py, PyAny>,
    seq_lens: &Bound<'py, PyAny>,
    page_size: Int,
) -> PyResult<Bound<'py, PyArray1<i32>>> {
    let (p, s) = (
        ints(prefix_lens, "prefix_lens")?,
        ints(seq_lens, "seq_lens")?,
    );
    let v = batch::pages_needed(
        &p.lens("prefix_lens")?,
        &s.lens("seq_lens")?,
        count("page_size", &page_size)?,
    )
    .map_err(to_py)?;
    Ok(PyArray1::from_vec(py, v))
}

/// Writes `new_pages` into the page-table entries each request grows into (in place).
#[pyfunction]
fn assign_pages(
    page_table: &Bound<'_, PyAny>,
    prefix_lens: &Bound<'_, PyAny>,
    seq_lens: &Bound<'_, PyAny>,
    new_pages: &Bound<'_, PyAny>,
    page_size: Int,
) -> PyResult<()> {
    let (t, _, width) = table(page_table, "page_table")?;
    let (p, s, n) = (
        ints(prefix_lens, "prefix_lens")?,
        ints(seq_lens, "seq_lens")?,
        ints(new_pages, "new_pages")?,
    );
    let (p, s, n) = (
        p.lens("prefix_lens")?,
        s.lens("seq_lens")?,
        n.pages("new_pages")?,
    );
    let ps = count("page_size", &page_size)?;
    let mut w = writable(t, "page_table")?;
    batch::assign_pages(slice_mut(&mut w, "page_table")?, width, &p, &s, &n, ps).map_err(to_py)
}

/// Slot indices of tokens `prefix_lens[i]..seq_lens[i]` of every request, in batch order.
#[pyfunction]
#[pyo3(signature = (page_table, prefix_lens, seq_lens, page_size, *, out=None))]
fn extend_slots<'py>(
    py: Python<'py>,
    page_table: &Bound<'py, PyAny>,
    prefix_lens: &Bound<'py, PyAny>,
    seq_lens: &Bound<'py, PyAny>,
    page_size: Int,
    out: Option<Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyArray1<i32>>> {
    let (t, _, width) = table(page_table, "page_table")?;
    let (p, s) = (
        ints(prefix_lens, "prefix_lens")?,
        ints(seq_lens, "seq_lens")?,
    );
    let (p, s) = (p.lens("prefix_lens")?, s.lens("seq_lens")?);
    let ps = count("page_size", &page_size)?;
    let total = batch::num_new_tokens(&p, &s).map_err(to_py)?;
    // (before the output exists: a request the table cannot hold allocates nothing)
    batch::check_width(Some(&p), &s, width, ps).map_err(to_py)?;
    let out = out1(py, out, total)?;
    read_table(t, |tab| {
        // A long prefill releases the GIL: the lengths (checked above, O(batch)) are copied
        // first, the table is only read, in place; the output is written in place. Neither may
        // be written by another thread during the call.
        let long = total >= DETACH_MIN;
        let (p, s) = (detachable(p, long)?, detachable(s, long)?);
        write1(&out, |o| {
            if long {
                py.detach(|| batch::extend_slots(tab, width, &p, &s, ps, o))
            } else {
                batch::extend_slots(tab, width, &p, &s, ps, o)
            }
        })
    })?;
    Ok(out)
}

/// Slot of each request's last token (position `seq_lens[i] - 1`), for a decode step.
#[pyfunction]
#[pyo3(signature = (page_table, seq_lens, page_size, *, out=None))]
fn decode_slots<'py>(
    py: Python<'py>,
    page_table: &Bound<'py, PyAny>,
    seq_lens: &Bound<'py, PyAny>,
    page_size: Int,
    out: Option<Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyArray1<i32>>> {
    let (t, rows, width) = table(page_table, "page_table")?;
    let s = ints(seq_lens, "seq_lens")?;
    let s = s.lens("seq_lens")?;
    let ps = count("page_size", &page_size)?;
    let out = out1(py, out, rows)?;
    read_table(t, |tab| {
        write1(&out, |o| batch::decode_slots(tab, width, &s, ps, o))
    })?;
    Ok(out)
}

/// Speculative-decoding rollback: the pages wholly past each request's accepted length.
///
/// Request `i` keeps tokens `0..accepted_lens[i]`; its page-table entries from
/// `ceil(accepted_lens[i] / page_size)` to `ceil(seq_lens[i] / page_size) - 1` hold rejected
/// draft tokens only, and their pages are returned for `allocator.free` (the page holding the
/// last accepted token stays; the next step overwrites its rejected tail). The table is only
/// read: its entries from `ceil(new_seq_lens[i] / page_size)` on are no longer the request's
/// (`assign_pages` overwrites them next step).
///
/// Pages shared with the radix tree are never among them when the serving loop inserts only
/// committed tokens: the tree holds whole pages below the request's committed length, and
/// `accepted_lens` is at least that. Pass that length as `cached_lens` to have it checked (the
/// matched length plus what earlier steps inserted).
///
/// Parameters
/// ----------
/// page_table : numpy.ndarray
///     int32, shape `[B, max_pages]`, C-contiguous: each request's pages after the verify step.
/// seq_lens : numpy.ndarray
///     int32 or int64, shape `[B]`: tokens written per request, drafts included.
/// accepted_lens : numpy.ndarray
///     int32 or int64, shape `[B]`: tokens kept per request (`<= seq_lens`).
/// page_size : int
///     Tokens per page.
/// cached_lens : numpy.ndarray, optional
///     int32 or int64, shape `[B]`: the prefix each request shares with the tree; a rollback
///     below it is refused.
///
/// Returns
/// -------
/// tuple
///     `(pages_to_free, new_seq_lens)`: int32 page ids in batch order, shape `(total,)`, and
///     int32 `accepted_lens`, shape `[B]`. A page shared by two rows (`inc_ref`) is listed once
///     per row.
///
/// Raises
/// ------
/// BatchError
///     `accepted_lens[i]` beyond `seq_lens[i]` or below `cached_lens[i]`, a negative length,
///     mismatched lengths, more pages than `max_pages` columns, a padding entry (0) among those
///     to free: naming the request and the value; nothing is returned.
/// ArrayTypeError
///     An array of the wrong dtype, rank or memory order.
///
/// Examples
/// --------
/// Serving loop of a speculative step (draft, verify with `extend`, rollback, insert), for a
/// request at `seq` tokens with `k` drafts:
///
/// 1. `new = cache.alloc(pages_needed(seq, seq + k))`; `assign_pages(...)`;
/// 2. the verify forward writes KV at `extend_slots(table, seq, seq + k, page_size)`;
/// 3. verification keeps `accepted` tokens: `free, lens = rollback_slots(table, seq + k,
///    accepted, page_size)`; `allocator.free(free)`;
/// 4. `cache.insert(tokens[:accepted], row_pages)`: committed tokens only.
///
/// >>> import numpy as np, kvpool
/// >>> table = np.array([[11, 12, 13], [21, 0, 0]], dtype=np.int32)
/// >>> lens = lambda *x: np.array(x, dtype=np.int32)
/// >>> free, new = kvpool.rollback_slots(table, lens(10, 3), lens(5, 3), 4)
/// >>> free.tolist(), new.tolist()
/// ([13], [5, 3])
#[pyfunction]
#[pyo3(signature = (page_table, seq_lens, accepted_lens, page_size, *, cached_lens=None))]
fn rollback_slots<'py>(
    py: Python<'py>,
    page_table: &Bound<'py, PyAny>,
    seq_lens: &Bound<'py, PyAny>,
    accepted_lens: &Bound<'py, PyAny>,
    page_size: Int,
    cached_lens: Option<&Bound<'py, PyAny>>,
) -> PyResult<(Bound<'py, PyArray1<i32>>, Bound<'py, PyArray1<i32>>)> {
    let (t, _, width) = table(page_table, "page_table")?;
    let (s, a) = (
        ints(seq_lens, "seq_lens")?,
        ints(accepted_lens, "accepted_lens")?,
    );
    let (s, a) = (s.lens("seq_lens")?, a.lens("accepted_lens")?);
    let c = cached_lens.map(|c| ints(c, "cached_lens")).transpose()?;
    let c = c.as_ref().map(|c| c.lens("cached_lens")).transpose()?;
    let ps = count("page_size", &page_size)?;
    let (free, lens) = read_table(t, |tab| {
        batch::rollback_slots(tab, width, &s, &a, ps, c.as_deref()).map_err(to_py)
    })?;
    Ok((PyArray1::from_vec(py, free), PyArray1::from_vec(py, lens)))
}

/// Grows a running decode batch's page table in place: pages for every row whose pages do not
/// hold its `seq_lens` tokens, from `alloc(k)`, written after the row's `num_pages` pages.
#[pyfunction]
fn grow_pages<'py>(
    page_table: &Bound<'py, PyAny>,
    num_pages: &Bound<'py, PyAny>,
    seq_lens: &Bound<'py, PyAny>,
    page_size: Int,
    alloc: &Bound<'py, PyAny>,
) -> PyResult<(Bound<'py, PyArray1<i64>>, Bound<'py, PyArray1<i32>>)> {
    let py = page_table.py();
    let (t, rows_in, width) = table(page_table, "page_table")?;
    let num = num_pages
        .cast::<PyArray1<i32>>()
        .map_err(|_| array_type_error(py, "`num_pages` must be a 1-D numpy int32 array".into()))?;
    let ps = count("page_size", &page_size)?;
    // Everything is checked before `alloc` runs (its pages would be lost on a later refusal):
    // the sizes, that both arrays can be written, the short rows. The arrays are released while
    // `alloc` runs (it may be any Python code); `num_pages` must be as it was afterwards.
    let (short, before) = {
        drop(writable(t, "page_table")?);
        let mut r = writable(num, "num_pages")?;
        let have = slice_mut(&mut r, "num_pages")?;
        if have.len() != rows_in {
            return Err(to_py(batch::BatchError::Length {
                what: "num_pages",
                expected: rows_in,
                got: have.len(),
            }));
        }
        let seq = ints(seq_lens, "seq_lens")?;
        let seq = seq.lens("seq_lens")?;
        let short = batch::rows_short(have, &seq, ps, width).map_err(to_py)?;
        (short, have.to_vec())
    };
    let rows: Vec<i64> = short.iter().map(|&(r, _)| r as i64).collect();
    if short.is_empty() {
        return Ok((
            PyArray1::from_vec(py, rows),
            PyArray1::from_vec(py, Vec::new()),
        ));
    }
    let total: usize = short.iter().map(|&(_, n)| n).sum();
    let got = alloc.call1((total,))?;
    let pages = ints(&got, "alloc(k)")?.pages("alloc(k)")?.into_owned();
    let mut tw = writable(t, "page_table")?;
    let tab = slice_mut(&mut tw, "page_table")?;
    let mut nw = writable(num, "num_pages")?;
    let have = slice_mut(&mut nw, "num_pages")?;
    if *have != before[..] {
        return Err(pyo3::exceptions::PyRuntimeError::new_err(
            "`num_pages` changed while `alloc` ran: nothing written (the pages it gave are the \
             caller's to free)",
        ));
    }
    batch::append_pages(tab, width, have, &short, &pages).map_err(to_py)?;
    Ok((PyArray1::from_vec(py, rows), PyArray1::from_vec(py, pages)))
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(page_table, m)?)?;
    m.add_function(wrap_pyfunction!(pages_needed, m)?)?;
    m.add_function(wrap_pyfunction!(assign_pages, m)?)?;
    m.add_function(wrap_pyfunction!(extend_slots, m)?)?;
    m.add_function(wrap_pyfunction!(decode_slots, m)?)?;
    m.add_function(wrap_pyfunction!(rollback_slots, m)?)?;
    m.add_function(wrap_pyfunction!(grow_pages, m)?)?;
    Ok(())
}
