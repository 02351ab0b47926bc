//! PyO3 bindings: conversion only, no logic. One file per room, mirroring the core.

use pyo3::prelude::*;

mod alloc;
mod array;
mod batch;
mod detach;
mod error;
mod hash;
mod namespace;
mod radix;
mod sizing;
mod state;
mod window;

#[pymodule(name = "_core")]
fn core_module(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // (rust-numpy's state first: built lazily, a pending Ctrl-C could make it panic mid-call)
    array::init(m.py())?;
    error::register(m)?;
    sizing::register(m)?;
    alloc::register(m)?;
    radix::register(m)?;
    batch::register(m)?;
    state::register(m)?;
    window::register(m)?;
    hash::register(m)?;
    Ok(())
}
