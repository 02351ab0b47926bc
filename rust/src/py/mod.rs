//! PyO3 bindings: conversion only, no logic. One file per room, mirroring the core.

use pyo3::prelude::*;

mod error;
mod sizing;

#[pymodule(name = "_core")]
fn core_module(m: &Bound<'_, PyModule>) -> PyResult<()> {
    error::register(m)?;
    sizing::register(m)?;
    Ok(())
}
