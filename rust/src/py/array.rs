//! numpy in and out for the bookkeeping rooms: 1-D int32/int64 arrays borrowed without copies
//! (int64 is narrowed once where the core works in int32) or, when short, copied out in one memcpy
//! (cheaper than registering a numpy borrow, about a thousand instructions but only ~70 ns: longer
//! copies cost more time than they save, with their allocation and the extra pass over the data);
//! int32 results moved into numpy.

use std::borrow::Cow;

use numpy::{PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray1, PyUntypedArrayMethods};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::type_object::PyTypeCheck;
use pyo3::types::{PyBool, PyInt, PyTuple};

use super::error::{array_type_error, to_py};
use crate::alloc::{self, PageId};
use crate::radix;

/// An integer argument: a Python `int` or anything with `__index__` (numpy integers), but not a
/// bool. Python's bool is an int subclass, and `alloc(True)` is a mistake, not one page; so is a
/// bool tensor or array, whose `__index__` also gives 0 or 1. The message names the value (PyO3
/// attaches the argument's name as a note).
pub(crate) struct Int(pub(crate) i64);

impl<'a, 'py> FromPyObject<'a, 'py> for Int {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        if obj.is_instance_of::<PyBool>() {
            let b: bool = obj.extract()?;
            let v = if b { "True" } else { "False" };
            return Err(PyTypeError::new_err(format!(
                "expected an integer, got the bool `{v}`"
            )));
        }
        if !obj.is_exact_instance_of::<PyInt>() {
            if let Ok(d) = obj.getattr("dtype") {
                let d = d.str()?.to_string();
                if d == "bool" || d == "torch.bool" {
                    return Err(PyTypeError::new_err(format!(
                        "expected an integer, got a value of dtype `{d}`"
                    )));
                }
            }
        }
        Ok(Self(obj.extract::<i64>()?))
    }
}

/// A numpy int32 array of zeros of `shape`, made by `numpy.zeros`: a shape too large to allocate
/// raises MemoryError there (rust-numpy's constructor panics on a failed allocation).
pub(crate) fn zeros<'py, T: PyTypeCheck>(
    py: Python<'py>,
    shape: &[usize],
) -> PyResult<Bound<'py, T>> {
    let np = py.import("numpy")?;
    let arr = np.call_method1("zeros", (PyTuple::new(py, shape)?, np.getattr("int32")?))?;
    Ok(arr.cast_into::<T>()?)
}

/// A 1-D integer array, borrowed or (short int32 ones) copied.
pub(crate) enum Ints<'py> {
    /// A short int32 array's values; `None` when it is not contiguous.
    Short(Python<'py>, Option<Vec<i32>>),
    I32(PyReadonlyArray1<'py, i32>),
    I64(PyReadonlyArray1<'py, i64>),
}

/// Up to this many elements (1 KiB) an int32 array is copied rather than borrowed.
const COPY_MAX: usize = 256;

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
