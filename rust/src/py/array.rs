//! numpy in and out for the bookkeeping rooms: 1-D int32/int64 arrays borrowed without copies
//! (int64 is narrowed once where the core works in int32) or, when short, copied out in one memcpy
//! (cheaper than registering a numpy borrow, about a thousand instructions); int32 results moved
//! into numpy.

use std::borrow::Cow;

use numpy::{PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray1, PyUntypedArrayMethods};
use pyo3::prelude::*;

use super::error::{array_type_error, to_py};
use crate::alloc::{self, PageId};
use crate::radix;

/// A 1-D integer array, borrowed or (short int32 ones) copied.
pub(crate) enum Ints<'py> {
    /// A short int32 array's values; `None` when it is not contiguous.
    Short(Python<'py>, Option<Vec<i32>>),
    I32(PyReadonlyArray1<'py, i32>),
    I64(PyReadonlyArray1<'py, i64>),
}

/// Up to this many elements an int32 array is copied rather than borrowed.
const COPY_MAX: usize = 2048;

fn describe(obj: &Bound<'_, PyAny>) -> String {
    match (obj.getattr("dtype"), obj.getattr("ndim")) {
        (Ok(d), Ok(n)) => format!("an array of dtype `{d}` with {n} dimension(s)"),
        _ => format!(
            "`{}`",
            obj.get_type()
                .name()
                .map(|n| n.to_string())
                .unwrap_or_else(|_| "?".into())
        ),
    }
}

/// Borrows (or, when short, copies) `obj` as a 1-D int32 or int64 numpy array.
pub(crate) fn ints<'py>(obj: &Bound<'py, PyAny>, name: &str) -> PyResult<Ints<'py>> {
    let busy = |e: numpy::BorrowError| array_type_error(obj.py(), format!("`{name}`: {e}"));
    if let Ok(a) = obj.cast::<PyArray1<i32>>() {
        if a.len() <= COPY_MAX {
            return Ok(Ints::Short(obj.py(), a.to_vec().ok()));
        }
        return Ok(Ints::I32(a.try_readonly().map_err(busy)?));
    }
    if let Ok(a) = obj.cast::<PyArray1<i64>>() {
        return Ok(Ints::I64(a.try_readonly().map_err(busy)?));
    }
    Err(array_type_error(
        obj.py(),
        format!(
            "`{name}` must be a 1-D numpy array of int32 or int64, got {}",
            describe(obj)
        ),
    ))
}

fn contiguous(py: Python<'_>, name: &str) -> PyErr {
    array_type_error(
        py,
        format!("`{name}` must be C-contiguous; pass np.ascontiguousarray(...)"),
    )
}

impl Ints<'_> {
    fn py(&self) -> Python<'_> {
        match self {
            Self::Short(py, _) => *py,
            Self::I32(a) => a.py(),
            Self::I64(a) => a.py(),
        }
    }

    /// int32 values, borrowed for int32 input; int64 input is narrowed by `narrow`, whose error
    /// names the room's bad value.
    fn int32s<E: Into<crate::Error>>(
        &self,
        name: &str,
        narrow: fn(&[i64]) -> Result<Vec<i32>, E>,
    ) -> PyResult<Cow<'_, [i32]>> {
        match self {
            Self::Short(py, v) => v
                .as_deref()
                .map(Cow::Borrowed)
                .ok_or_else(|| contiguous(*py, name)),
            Self::I32(a) => a
                .as_slice()
                .map(Cow::Borrowed)
                .map_err(|_| contiguous(self.py(), name)),
            Self::I64(a) => {
                let s = a.as_slice().map_err(|_| contiguous(self.py(), name))?;
                narrow(s).map(Cow::Owned).map_err(to_py)
            }
        }
    }

    /// Token ids as int32 (borrowed for int32 input).
    pub(crate) fn tokens(&self, name: &str) -> PyResult<Cow<'_, [i32]>> {
        self.int32s(name, radix::narrow_tokens)
    }

    /// Page ids as int32 (borrowed for int32 input).
    pub(crate) fn pages(&self, name: &str) -> PyResult<Cow<'_, [i32]>> {
        self.int32s(name, alloc::narrow_pages)
    }

    /// Lengths as int64 (borrowed for int64 input).
    pub(crate) fn lens(&self, name: &str) -> PyResult<Cow<'_, [i64]>> {
        match self {
            Self::I64(a) => a
                .as_slice()
                .map(Cow::Borrowed)
                .map_err(|_| contiguous(self.py(), name)),
            Self::Short(py, v) => {
                let s = v.as_deref().ok_or_else(|| contiguous(*py, name))?;
                Ok(Cow::Owned(s.iter().map(|&v| i64::from(v)).collect()))
            }
            Self::I32(a) => {
                let s = a.as_slice().map_err(|_| contiguous(self.py(), name))?;
                Ok(Cow::Owned(s.iter().map(|&v| i64::from(v)).collect()))
            }
        }
    }
}

/// One part of a page list given in parts: an int32 array, checked (type, contiguity) but not
/// read until its entries are needed, or int64 ids narrowed at once.
pub(crate) enum Part<'py> {
    Lazy(Bound<'py, PyArray1<i32>>),
    Owned(Vec<i32>),
}

impl Part<'_> {
    pub(crate) fn len(&self) -> usize {
        match self {
            Self::Lazy(a) => a.len(),
            Self::Owned(v) => v.len(),
        }
    }
}

/// `obj` as a [`Part`]: a C-contiguous 1-D int32 array (not read now) or int64 one (narrowed).
pub(crate) fn page_part<'py>(obj: &Bound<'py, PyAny>, name: &str) -> PyResult<Part<'py>> {
    if let Ok(a) = obj.cast::<PyArray1<i32>>() {
        if !a.is_contiguous() {
            return Err(contiguous(obj.py(), name));
        }
        return Ok(Part::Lazy(a.clone()));
    }
    Ok(Part::Owned(ints(obj, name)?.pages(name)?.into_owned()))
}

/// Entries `start..end` (in range) of the concatenation of `parts`, reading only the parts that
/// hold them (a short whole part is copied in one go, a long one borrowed for the copy).
pub(crate) fn part_range(
    parts: &[Part<'_>],
    start: usize,
    end: usize,
    name: &str,
) -> PyResult<Vec<i32>> {
    let mut out = Vec::new();
    let mut off = 0;
    for part in parts {
        let n = part.len();
        let (lo, hi) = (start.max(off) - off, end.min(off + n).saturating_sub(off));
        off += n;
        if lo >= hi {
            continue;
        }
        match part {
            Part::Owned(v) => out.extend_from_slice(&v[lo..hi]),
            Part::Lazy(a) if n <= COPY_MAX || (lo, hi) == (0, n) => {
                let all = a.to_vec().map_err(|_| contiguous(a.py(), name))?;
                if out.is_empty() && (lo, hi) == (0, n) {
                    out = all;
                } else {
                    out.extend_from_slice(&all[lo..hi]);
                }
            }
            Part::Lazy(a) => {
                let r = a
                    .try_readonly()
                    .map_err(|e| array_type_error(a.py(), format!("`{name}`: {e}")))?;
                let s = r.as_slice().map_err(|_| contiguous(a.py(), name))?;
                out.extend_from_slice(&s[lo..hi]);
            }
        }
    }
    Ok(out)
}

/// A C-contiguous 2-D int32 array (a page table), as (array, rows, cols).
pub(crate) fn table<'a, 'py>(
    obj: &'a Bound<'py, PyAny>,
    name: &str,
) -> PyResult<(&'a Bound<'py, PyArray2<i32>>, usize, usize)> {
    let a = obj.cast::<PyArray2<i32>>().map_err(|_| {
        array_type_error(
            obj.py(),
            format!(
                "`{name}` must be a 2-D numpy int32 array, got {}",
                describe(obj)
            ),
        )
    })?;
    if !a.is_c_contiguous() {
        return Err(contiguous(obj.py(), name));
    }
    let shape = a.shape();
    Ok((a, shape[0], shape[1]))
}

/// A non-negative count (`n`, `num_tokens`, `page_size`): negative values raise ValueError.
pub(crate) fn count(what: &'static str, value: i64) -> PyResult<usize> {
    alloc::count(what, value).map_err(to_py)
}

pub(crate) fn page_array<'py>(py: Python<'py>, pages: &[PageId]) -> Bound<'py, PyArray1<i32>> {
    let v: Vec<i32> = pages.iter().map(|p| p.as_i32()).collect();
    PyArray1::from_vec(py, v)
}
