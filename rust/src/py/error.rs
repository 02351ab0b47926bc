//! The one place where core errors become Python exceptions.
//!
//! Every class derives from the built-in the design calls for, so `except ValueError` /
//! `except MemoryError` keep working; messages come from the core's `Display`.

use pyo3::create_exception;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::sizing::SizingError as CoreSizingError;
use crate::Error;

create_exception!(kvpool, KvDtypeError, PyValueError, "Unknown or unusable KV cache dtype.");
create_exception!(kvpool, ModelConfigError, PyValueError, "Model geometry that kvpool cannot size.");
create_exception!(kvpool, LayoutError, PyValueError, "A pool layout that cannot be built (page size, block alignment, recipe).");
create_exception!(kvpool, SizingError, PyValueError, "A memory budget that cannot hold the pool.");
create_exception!(kvpool, BudgetTooSmallError, SizingError, "The budget cannot hold even one page of the pool.");

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("KvDtypeError", py.get_type::<KvDtypeError>())?;
    m.add("ModelConfigError", py.get_type::<ModelConfigError>())?;
    m.add("LayoutError", py.get_type::<LayoutError>())?;
    m.add("SizingError", py.get_type::<SizingError>())?;
    m.add("BudgetTooSmallError", py.get_type::<BudgetTooSmallError>())?;
    Ok(())
}

impl From<Error> for PyErr {
    fn from(e: Error) -> Self {
        let msg = e.to_string();
        match flatten(e) {
            Error::Dtype(_) => KvDtypeError::new_err(msg),
            Error::Model(_) => ModelConfigError::new_err(msg),
            Error::Layout(_) => LayoutError::new_err(msg),
            Error::Sizing(CoreSizingError::TooSmall { .. } | CoreSizingError::NoBudget { .. }) => {
                BudgetTooSmallError::new_err(msg)
            }
            Error::Sizing(_) => SizingError::new_err(msg),
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
