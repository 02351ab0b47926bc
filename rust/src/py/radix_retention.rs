//! Bindings of `radix::retention`: the cache's clock (`now=`), priorities on `insert`, pins and
//! `stats()`. Conversion and delegation only.
//!
//! The clock is read before any mutex is taken: a `now` callable is Python code, and no Python
//! code runs while a Rust lock is held. The reading crosses into the core as a number
//! ([`Seconds`]), set first thing inside the locked call.

use std::time::Instant;

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::super::alloc::with_lock;
use super::super::array::{int_arg, BadInt};
use super::super::error::{to_py, InvalidArgumentError};
use super::{PyRadixCache, PyRadixNode};
use crate::radix::{Retain, Seconds, Stats};

/// Where a cache reads the time.
pub(super) enum Clock {
    /// Seconds since the cache was made, from `std::time::Instant` (monotonic).
    Monotonic(Instant),
    /// A Python callable returning seconds.
    Callable(Py<PyAny>),
}

impl Clock {
    pub(super) fn from_py(now: Option<Bound<'_, PyAny>>) -> PyResult<Self> {
        match now.filter(|n| !n.is_none()) {
            None => Ok(Self::Monotonic(Instant::now())),
            Some(f) if f.is_callable() => Ok(Self::Callable(f.unbind())),
            Some(f) => Err(PyTypeError::new_err(format!(
                "`now` must be a callable returning seconds (e.g. time.monotonic), got `{}`",
                f.get_type()
                    .name()
                    .map(|n| n.to_string())
                    .unwrap_or_default()
            ))),
        }
    }

    /// The time now, in seconds. Runs the `now` callable (if any): call it with no lock held.
    pub(super) fn read(&self, py: Python<'_>) -> PyResult<Seconds> {
        let secs = match self {
            Self::Monotonic(t0) => t0.elapsed().as_secs_f64(),
            Self::Callable(f) => {
                let v = f.call0(py)?;
                v.extract::<f64>(py).map_err(|_| {
                    PyTypeError::new_err(format!(
                        "`now()` must return seconds as a float, got `{}`",
                        v.bind(py).repr().map(|r| r.to_string()).unwrap_or_default()
                    ))
                })?
            }
        };
        Seconds::new(secs).map_err(to_py)
    }
}

/// `priority=` / `retention_s=` of `insert` as a core [`Retain`].
pub(super) fn retain(
    priority: Option<&Bound<'_, PyAny>>,
    retention_s: Option<f64>,
) -> PyResult<Retain> {
    let p = match priority.filter(|p| !p.is_none()) {
        None => 0,
        // (the range 0..=100 is the core's check: `Retain::new`)
        Some(p) => int_arg::<i64>(p).map_err(|e| match e {
            // (a bool is an int in Python, but `priority=True` is a mistake, not priority 1)
            BadInt::Bool(what) => {
                PyTypeError::new_err(format!("`priority` must be an int 0..=100, got {what}"))
            }
            BadInt::Range(text) => InvalidArgumentError::new_err(format!(
                "`priority` = {text} is outside 0..=100 (higher is kept longer)"
            )),
            BadInt::NotInt(_) => PyTypeError::new_err(format!(
                "`priority` must be an int 0..=100, got `{}`",
                p.repr().map(|s| s.to_string()).unwrap_or_default()
            )),
        })?,
    };
    Retain::new(p, retention_s).map_err(to_py)
}

impl PyRadixCache {
    /// The clock, read before any lock (see the module text).
    pub(super) fn time(&self, py: Python<'_>) -> PyResult<Seconds> {
        self.clock.read(py)
    }

    pub(super) fn pin_node(&self, py: Python<'_>, node: &PyRadixNode, on: bool) -> PyResult<()> {
        let h = node.0;
        with_lock(py, &self.cache, false, |c| {
            if on {
                c.pin(h)
            } else {
                c.unpin(h)
            }
        })
        .map_err(to_py)
    }

    pub(super) fn stats_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let t = self.time(py)?;
        let (s, sizes): (Stats, [u64; 5]) = with_lock(py, &self.cache, false, |c| {
            c.set_now(t);
            let sizes = [
                c.hit_tokens(),
                c.miss_tokens(),
                c.evictable_size() as u64,
                c.protected_size() as u64,
                c.total_size() as u64,
            ];
            (c.stats(), sizes)
        });
        // (Python objects only now, with the lock released)
        let d = PyDict::new(py);
        let by = PyDict::new(py);
        for (p, tokens) in &s.evicted_tokens_by_priority {
            by.set_item(p, tokens)?;
        }
        d.set_item("evicted_tokens", s.evicted_tokens)?;
        d.set_item("evicted_nodes", s.evicted_nodes)?;
        d.set_item("evicted_tokens_by_priority", by)?;
        d.set_item("pinned_tokens", s.pinned_tokens)?;
        d.set_item("max_pinned_tokens", s.max_pinned_tokens)?;
        d.set_item("retention_expiries", s.retention_expiries)?;
        d.set_item("retained_nodes", s.retained_nodes)?;
        let names = [
            "hit_tokens",
            "miss_tokens",
            "evictable_size",
            "protected_size",
            "total_size",
        ];
        for (k, v) in names.iter().zip(sizes) {
            d.set_item(k, v)?;
        }
        Ok(d)
    }
}
