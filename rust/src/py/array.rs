//! numpy in and out for the bookkeeping rooms: 1-D int32/int64 arrays borrowed without copies
//! (int64 is narrowed once where the core works in int32) or, when short, copied out in one memcpy
//! (cheaper than registering a numpy borrow, about a thousand instructions but only ~70 ns: longer
//! copies cost more time than they save, with their allocation and the extra pass over the data);
//! int32 results moved into numpy.

use std::borrow::Cow;

use numpy::ndarray::Dimension;
use numpy::{
    Element, PyArray, PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray1, PyReadwriteArray,
    PyUntypedArray, PyUntypedArrayMethods,
};
use pyo3::exceptions::{PyOverflowError, PyTypeError};
use pyo3::prelude::*;
use pyo3::type_object::{PyTypeCheck, PyTypeInfo};
use pyo3::types::{PyBool, PyInt, PySlice, PyTuple};

use super::detach::View;
use super::error::{array_type_error, to_py};
use crate::alloc::{self, PageId};

/// An integer argument: a Python `int` or anything with `__index__` (numpy integers), but not a
/// bool (see [`int_arg`]). The message names the value (PyO3 attaches the argument's name as a
/// note). A value beyond int64 is kept as its text, so that [`count`] can refuse it naming the
/// argument (not a bare `OverflowError`).
pub(crate) struct Int {
    pub(crate) value: i64,
    /// The decimal text of a value beyond int64 (`value` is then its sign: -1 or 1).
    big: Option<String>,
}

impl Int {
    /// Zero, the default of optional counts.
    pub(crate) const ZERO: Self = Self {
        value: 0,
        big: None,
    };
}

impl<'a, 'py> FromPyObject<'a, 'py> for Int {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        match int_arg::<i64>(&obj) {
            Ok(value) => Ok(Self { value, big: None }),
            Err(BadInt::Bool(what)) => Err(PyTypeError::new_err(format!(
                "expected an integer, got {what}"
            ))),
            Err(BadInt::Range(text)) => Ok(Self {
                value: if text.starts_with('-') { -1 } else { 1 },
                big: Some(text),
            }),
            Err(BadInt::NotInt(e)) => Err(e),
        }
    }
}

/// Why an argument is not an integer of the type asked for (see [`int_arg`]).
pub(crate) enum BadInt {
    /// A bool, or a value of bool dtype (numpy / torch): its description, "the bool `True`" or
    /// "a value of dtype `bool`".
    Bool(String),
    /// An integer outside the type's range: its decimal text (as `str(int(obj))` prints it).
    Range(String),
    /// Not an integer (no `__index__`): PyO3's extraction error.
    NotInt(PyErr),
}

/// An integer argument as `T` by PyO3's extraction (a Python `int` or anything with
/// `__index__`), refusing bools: Python's bool is an int subclass, and `alloc(True)` is a
/// mistake, not one page; so is a bool tensor or array, whose `__index__` also gives 0 or 1.
/// The one integer extraction of the bindings: [`Int`], `u64_arg` (hash seeds) and `priority=`
/// turn its [`BadInt`] into their messages, each naming the value.
pub(crate) fn int_arg<'py, T>(obj: &Bound<'py, PyAny>) -> Result<T, BadInt>
where
    T: for<'a> FromPyObject<'a, 'py, Error = PyErr>,
{
    if obj.is_instance_of::<PyBool>() {
        let v = obj.is_truthy().map_err(BadInt::NotInt)?;
        let v = if v { "True" } else { "False" };
        return Err(BadInt::Bool(format!("the bool `{v}`")));
    }
    if !obj.is_exact_instance_of::<PyInt>() {
        if let Ok(d) = obj.getattr("dtype") {
            let d = d.str().map_err(BadInt::NotInt)?.to_string();
            if d == "bool" || d == "torch.bool" {
                return Err(BadInt::Bool(format!("a value of dtype `{d}`")));
            }
        }
    }
    match obj.extract::<T>() {
        Ok(v) => Ok(v),
        Err(e) if e.is_instance_of::<PyOverflowError>(obj.py()) => {
            // (an int, or what `__index__` made of the value: its text names it)
            let text = obj
                .py()
                .get_type::<PyInt>()
                .call1((obj,))
                .and_then(|i| i.str())
                .map_err(BadInt::NotInt)?;
            Err(BadInt::Range(text.to_string()))
        }
        Err(e) => Err(BadInt::NotInt(e)),
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

/// Refuses a numpy masked array (an ndarray subclass whose data under the mask is arbitrary: its
/// values are not the ids the caller means). Plain arrays pay one type comparison.
fn masked(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<()> {
    // (an exact ndarray first, by identity: the per-row check of a page table, issue 22)
    let t = obj.get_type();
    if t.is(PyUntypedArray::type_object(obj.py()))
        || t.name().is_ok_and(|n| n == "ndarray")
        || obj.getattr("mask").is_err()
    {
        return Ok(());
    }
    Err(array_type_error(
        obj.py(),
        format!("`{name}` is a masked array; pass `{name}.compressed()` or fill it (np.ma.filled)"),
    ))
}

/// Borrows (or, when short, copies) `obj` as a 1-D int32 or int64 numpy array.
pub(crate) fn ints<'py>(obj: &Bound<'py, PyAny>, name: &str) -> PyResult<Ints<'py>> {
    masked(obj, name)?;
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

    /// The values as a [`View`] to read in the call's Rust work (with the GIL released when
    /// long): O(1) here, the checks and copies happen there.
    pub(crate) fn view(&self, name: &str) -> PyResult<View<'_>> {
        match self {
            Self::Short(py, v) => v
                .as_deref()
                .map(|s| View::i32s(s, true))
                .ok_or_else(|| contiguous(*py, name)),
            Self::I32(a) => a
                .as_slice()
                .map(|s| View::i32s(s, false))
                .map_err(|_| contiguous(self.py(), name)),
            Self::I64(a) => a
                .as_slice()
                .map(View::i64s)
                .map_err(|_| contiguous(self.py(), name)),
        }
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
    masked(obj, name)?;
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

/// `a` borrowed for writing in place, or TypeError naming it (read-only, or borrowed already).
pub(crate) fn writable<'py, T: Element, D: Dimension>(
    a: &Bound<'py, PyArray<T, D>>,
    name: &str,
) -> PyResult<PyReadwriteArray<'py, T, D>> {
    a.try_readwrite()
        .map_err(|e| array_type_error(a.py(), format!("`{name}`: {e}")))
}

/// The elements of a borrow from [`writable`], or TypeError naming it when not C-contiguous.
pub(crate) fn slice_mut<'a, T: Element, D: Dimension>(
    w: &'a mut PyReadwriteArray<'_, T, D>,
    name: &str,
) -> PyResult<&'a mut [T]> {
    let py = w.py();
    w.as_slice_mut()
        .map_err(|_| array_type_error(py, format!("`{name}` must be C-contiguous")))
}

/// A non-negative count (`n`, `num_tokens`, `page_size`): negative values raise ValueError, and
/// so do values beyond int64 (InvalidArgumentError naming `what` and the value).
pub(crate) fn count(what: &'static str, value: &Int) -> PyResult<usize> {
    match &value.big {
        None => alloc::count(what, value.value).map_err(to_py),
        Some(text) => Err(to_py(alloc::AllocError::TooLarge {
            what,
            value: text.clone(),
        })),
    }
}

/// `s` as an owned copy when the call runs with the GIL released, else as it is: for short
/// arguments (O(batch) lengths) that a call checks with the GIL held and then relies on. Long
/// arrays are read with the GIL released instead ([`super::detach::View`]). A copy that cannot
/// be allocated is MemoryError.
pub(crate) fn detachable<T: Copy>(s: Cow<'_, [T]>, long: bool) -> PyResult<Cow<'_, [T]>> {
    match s {
        Cow::Borrowed(b) if long => {
            let mut v = alloc::try_vec(b.len(), || format!("a copy of {} ids", b.len()))
                .map_err(to_py)?;
            v.extend_from_slice(b);
            Ok(Cow::Owned(v))
        }
        other => Ok(other),
    }
}

/// Marks the buffer behind a page array handed out by a debug-mode allocator. The buffer is
/// `[GRANT_MAGIC, tag, n, gens (n, as int32 bits)..., ids (n)...]`; the caller gets the view of
/// the ids, whose `.base` is the whole buffer (numpy keeps it as the base of every view of the
/// view too, so slices of it are checked as well).
const GRANT_MAGIC: i32 = 0x4B56_5047; // "KVPG"
const GRANT_HEAD: usize = 3;

/// The page array of `pages` with their generations `gens` recorded (see [`GRANT_MAGIC`]); the
/// buffer is filled with the GIL released for 16,384 pages or more.
pub(crate) fn page_array_granted<'py>(
    py: Python<'py>,
    tag: i32,
    pages: &[i32],
    gens: &[u32],
) -> PyResult<Bound<'py, PyArray1<i32>>> {
    let n = pages.len();
    let fill = || {
        let mut buf = alloc::try_vec::<i32>(GRANT_HEAD + 2 * n, || format!("`n` = {n} page ids"))?;
        buf.extend([GRANT_MAGIC, tag, n as i32]);
        buf.extend(gens.iter().map(|&g| g as i32));
        buf.extend_from_slice(pages);
        Ok::<_, alloc::AllocError>(buf)
    };
    let buf = if n >= super::alloc::DETACH_MIN { py.detach(fill) } else { fill() };
    let full = PyArray1::from_vec(py, buf.map_err(to_py)?);
    let start = GRANT_HEAD + n;
    let view = full.get_item(PySlice::new(py, start as isize, (start + n) as isize, 1))?;
    Ok(view.cast_into::<PyArray1<i32>>()?)
}

/// The generations recorded for the `len` pages of `obj` when a debug-mode allocator of `tag`
/// handed them out; `None` for an array it did not hand out (a copy, a concatenation: those are
/// not checked).
pub(crate) fn grant_of(obj: &Bound<'_, PyAny>, tag: i32, len: usize) -> PyResult<Option<Vec<u32>>> {
    let Ok(view) = obj.cast::<PyArray1<i32>>() else {
        return Ok(None);
    };
    let Ok(base) = view.getattr("base") else {
        return Ok(None);
    };
    let Ok(base) = base.cast::<PyArray1<i32>>() else {
        return Ok(None);
    };
    let Ok(b) = base.try_readonly() else {
        return Ok(None);
    };
    let Ok(all) = b.as_slice() else {
        return Ok(None);
    };
    if all.len() < GRANT_HEAD || all[0] != GRANT_MAGIC || all[1] != tag {
        return Ok(None);
    }
    let n = all[2] as usize;
    if all.len() != GRANT_HEAD + 2 * n || view.strides()[0] != 4 {
        return Ok(None);
    }
    // Where the view starts within the ids (a slice of the handed-out array starts later).
    let offset = (view.data() as usize).wrapping_sub(all.as_ptr() as usize) / 4;
    let Some(j) = offset.checked_sub(GRANT_HEAD + n) else {
        return Ok(None);
    };
    if j + len > n {
        return Ok(None);
    }
    let gens = &all[GRANT_HEAD + j..GRANT_HEAD + j + len];
    Ok(Some(gens.iter().map(|&g| g as u32).collect()))
}

/// Sets up rust-numpy's lazily built state (the NumPy C-API capsule, the shared borrow checker)
/// at module import: built on first use instead, a pending signal there (Ctrl-C) made rust-numpy
/// panic after an allocation had taken its pages.
pub(crate) fn init(py: Python<'_>) -> PyResult<()> {
    let a = PyArray1::from_vec(py, vec![0i32]);
    drop(a.try_readonly().map_err(|e| array_type_error(py, format!("numpy: {e}")))?);
    drop(a.try_readwrite().map_err(|e| array_type_error(py, format!("numpy: {e}")))?);
    let b = PyArray1::from_vec(py, vec![0i64]);
    drop(b.try_readonly().map_err(|e| array_type_error(py, format!("numpy: {e}")))?);
    let _ = PyArray1::from_vec(py, vec![0u32]);
    let _ = zeros::<PyArray2<i32>>(py, &[1, 1])?;
    Ok(())
}

pub(crate) fn page_array<'py>(py: Python<'py>, pages: &[PageId]) -> Bound<'py, PyArray1<i32>> {
    let v: Vec<i32> = pages.iter().map(|p| p.as_i32()).collect();
    PyArray1::from_vec(py, v)
}
