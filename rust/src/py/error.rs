//! The one place where core errors become Python exceptions.
//!
//! Every class derives from the built-in the design calls for, so `except ValueError` /
//! `except MemoryError` keep working; messages come from the core's `Display`.

use pyo3::create_exception;
use pyo3::exceptions::{PyKeyError, PyMemoryError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};

use crate::alloc::AllocError;
use crate::radix::RadixError;
use crate::sizing::SizingError as CoreSizingError;
use crate::Error;

create_exception!(kvpool, KvDtypeError, PyValueError, "Unknown or unusable KV cache dtype.");
create_exception!(kvpool, ModelConfigError, PyValueError, "Model geometry that kvpool cannot size.");
create_exception!(kvpool, LayoutError, PyValueError, "A pool layout that cannot be built (page size, block alignment, recipe).");
create_exception!(kvpool, SizingError, PyValueError, "A memory budget that cannot hold the pool.");
create_exception!(kvpool, BudgetTooSmallError, SizingError, "The budget cannot hold even one page of the pool.");
create_exception!(kvpool, OutOfPagesError, PyMemoryError, "Not enough free pages; `requested`, `free` and `evictable` (pages eviction could reclaim) say how many.");
create_exception!(kvpool, PageError, PyValueError, "A page id that cannot be used here: padding page 0, out of range, free (double free), repeated in one call, or already cached.");
create_exception!(kvpool, InvalidArgumentError, PyValueError, "A bad argument to the allocator or the cache: negative count, mismatched lengths, wrong page size, unsupported namespace.");
create_exception!(kvpool, StaleNodeError, PyKeyError, "A node handle whose node was evicted, whose cache was reset, or that belongs to another cache.");
create_exception!(kvpool, LockError, PyValueError, "An unlock without a matching lock on the same node (the count would go below zero).");
create_exception!(kvpool, PinBudgetError, LockError, "A pin that would take the pinned tokens beyond the cache's `max_pinned_tokens` (nothing changed).");
create_exception!(kvpool, CacheBusyError, PyRuntimeError, "The cache cannot do this while locks are held.");
create_exception!(kvpool, CacheCorruptError, PyRuntimeError, "An internal invariant of the radix cache is broken (a bug in kvpool).");
create_exception!(kvpool, BatchError, PyValueError, "Inconsistent batch metadata: lengths, page-table width, missing pages.");

static ARRAY_TYPE_ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// `ArrayTypeError(TypeError, ValueError)`: an argument that is not a numpy array of an accepted
/// dtype, rank and memory order. Built at runtime because it has two bases.
fn array_type_error_type(py: Python<'_>) -> PyResult<&Bound<'_, PyType>> {
    let ty = ARRAY_TYPE_ERROR.get_or_try_init(py, || -> PyResult<Py<PyType>> {
        let bases = PyTuple::new(py, [py.get_type::<PyTypeError>(), py.get_type::<PyValueError>()])?;
        let ns = PyDict::new(py);
        ns.set_item("__module__", "kvpool")?;
        ns.set_item("__doc__", "An array argument of the wrong dtype, rank or memory order (wrong type, bad value: catchable as either).")?;
        let t = py.get_type::<PyType>().call1(("ArrayTypeError", bases, ns))?;
        Ok(t.cast_into::<PyType>()?.unbind())
    })?;
    Ok(ty.bind(py))
}

/// An `ArrayTypeError` with `msg`.
pub(crate) fn array_type_error(py: Python<'_>, msg: String) -> PyErr {
    match array_type_error_type(py) {
        Ok(ty) => PyErr::from_type(ty.clone(), msg),
        Err(e) => e,
    }
}

fn out_of_pages(msg: String, requested: usize, free: usize, evictable: usize) -> PyErr {
    Python::attach(|py| {
        let err = OutOfPagesError::new_err(msg);
        let v = err.value(py);
        let set = || -> PyResult<()> {
            v.setattr("requested", requested)?;
            v.setattr("free", free)?;
            v.setattr("evictable", evictable)
        };
        match set() {
            Ok(()) => err,
            Err(e) => e,
        }
    })
}

fn alloc_err(e: AllocError, msg: String) -> PyErr {
    match e {
        AllocError::OutOfPages { requested, free, evictable } => out_of_pages(msg, requested, free, evictable),
        AllocError::OutOfStateSlots { requested, free } => out_of_pages(msg, requested, free, 0),
        AllocError::InStateSlots(inner) => alloc_err(*inner, msg),
        AllocError::ZeroPages
        | AllocError::ZeroPageSize
        | AllocError::TooManySlots { .. }
        | AllocError::Negative { .. }
        | AllocError::TooLarge { .. } => InvalidArgumentError::new_err(msg),
        AllocError::NoMemory { .. } => PyMemoryError::new_err(msg),
        AllocError::PaddingPage
        | AllocError::OutOfRange { .. }
        | AllocError::NotAllocated { .. }
        | AllocError::Duplicate { .. }
        | AllocError::OnlyCached { .. }
        | AllocError::AlreadyCached { .. }
        | AllocError::RefOverflow { .. }
        | AllocError::Reused { .. }
        | AllocError::OverReleased { .. } => PageError::new_err(msg),
    }
}

fn radix_err(e: RadixError, msg: String) -> PyErr {
    match e {
        RadixError::Page(a) => alloc_err(a, msg),
        RadixError::WrongAllocator
        | RadixError::PageSizeMismatch { .. }
        | RadixError::LengthMismatch { .. }
        | RadixError::TokenOutOfRange { .. } => InvalidArgumentError::new_err(msg),
        RadixError::StaleHandle { .. } => StaleNodeError::new_err(msg),
        RadixError::NotLocked { .. }
        | RadixError::LockOverflow { .. }
        | RadixError::NotPinned { .. }
        | RadixError::PinOverflow { .. } => LockError::new_err(msg),
        RadixError::PinBudget { .. } => PinBudgetError::new_err(msg),
        RadixError::BadPriority { .. } | RadixError::BadRetention { .. } | RadixError::BadTime { .. } => {
            InvalidArgumentError::new_err(msg)
        }
        RadixError::Locked { .. } => CacheBusyError::new_err(msg),
        RadixError::Corrupt(_) => CacheCorruptError::new_err(msg),
        RadixError::GroupPage { source, .. } => alloc_err(source, msg),
        RadixError::GroupAllocators { .. }
        | RadixError::BadGroup { .. }
        | RadixError::GroupCount { .. }
        | RadixError::GroupLength { .. }
        | RadixError::StateNotAligned { .. }
        | RadixError::NoStatePool
        | RadixError::SharedAllocator
        | RadixError::HostAllocator { .. }
        | RadixError::HostTierHybrid
        | RadixError::HostTierBusy
        | RadixError::OnHost { .. }
        | RadixError::NotOnHost { .. }
        | RadixError::LoadLength { .. } => InvalidArgumentError::new_err(msg),
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("KvDtypeError", py.get_type::<KvDtypeError>())?;
    m.add("ModelConfigError", py.get_type::<ModelConfigError>())?;
    m.add("LayoutError", py.get_type::<LayoutError>())?;
    m.add("SizingError", py.get_type::<SizingError>())?;
    m.add("BudgetTooSmallError", py.get_type::<BudgetTooSmallError>())?;
    m.add("OutOfPagesError", py.get_type::<OutOfPagesError>())?;
    m.add("PageError", py.get_type::<PageError>())?;
    m.add("InvalidArgumentError", py.get_type::<InvalidArgumentError>())?;
    m.add("StaleNodeError", py.get_type::<StaleNodeError>())?;
    m.add("LockError", py.get_type::<LockError>())?;
    m.add("PinBudgetError", py.get_type::<PinBudgetError>())?;
    m.add("CacheBusyError", py.get_type::<CacheBusyError>())?;
    m.add("CacheCorruptError", py.get_type::<CacheCorruptError>())?;
    m.add("BatchError", py.get_type::<BatchError>())?;
    m.add("ArrayTypeError", array_type_error_type(py)?)?;
    Ok(())
}

impl From<Error> for PyErr {
    fn from(e: Error) -> Self {
        let msg = e.to_string();
        match flatten(e) {
            Error::Dtype(_) => KvDtypeError::new_err(msg),
            Error::Model(_) => ModelConfigError::new_err(msg),
            Error::Layout(_) => LayoutError::new_err(msg),
            Error::Sizing(
                CoreSizingError::TooSmall { .. } | CoreSizingError::TooSmallForRequest { .. } | CoreSizingError::NoBudget { .. },
            ) => {
                BudgetTooSmallError::new_err(msg)
            }
            Error::Sizing(_) => SizingError::new_err(msg),
            Error::Alloc(a) => alloc_err(a, msg),
            Error::Radix(r) => radix_err(r, msg),
            Error::Batch(crate::batch::BatchError::Page { source, .. }) => alloc_err(source, msg),
            Error::Batch(_) => BatchError::new_err(msg),
        }
    }
}

/// Unwraps errors that rooms pass through (`Sizing(Layout(Model(..)))`) to the room that raised them.
fn flatten(e: Error) -> Error {
    match e {
        Error::Sizing(CoreSizingError::Layout(l)) => flatten(Error::Layout(l)),
        Error::Layout(crate::layout::LayoutError::Model(m)) => Error::Model(m),
        other => other,
    }
}

/// Converts a room's error through the crate error.
pub(crate) fn to_py<E: Into<Error>>(e: E) -> PyErr {
    e.into().into()
}
