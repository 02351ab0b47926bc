//! The crate error: one enum per room, composed here, mapped to Python once (`py/error.rs`).

use crate::alloc::AllocError;
use crate::batch::BatchError;
use crate::dtype::DtypeError;
use crate::layout::LayoutError;
use crate::model::ModelError;
use crate::radix::RadixError;
use crate::sizing::SizingError;

/// Any error of the kvpool core.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Dtype(#[from] DtypeError),
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Layout(#[from] LayoutError),
    #[error(transparent)]
    Sizing(#[from] SizingError),
    #[error(transparent)]
    Alloc(#[from] AllocError),
    #[error(transparent)]
    Radix(#[from] RadixError),
    #[error(transparent)]
    Batch(#[from] BatchError),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
