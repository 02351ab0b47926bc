//! Bindings of KV events (`rust/src/radix/events.rs`): the events a `RadixCache` recorded, taken
//! under its lock as Rust data and turned into plain Python tuples after the lock is released.
//! Conversion only.

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};

use super::super::alloc::with_lock;
use super::super::alloc::DETACH_MIN;
use super::super::error::InvalidArgumentError;
use super::super::hash::u64_arg;
use super::PyRadixCache;
use crate::radix::{encode_events, KvEvent, RadixCache, WireFormat};

pub(super) type PackedTuple<'py> = (Bound<'py, PyBytes>, usize, usize, usize);

/// Turns events on for a new cache (`kv_events`, `hash_seed` of the constructor).
pub(super) fn configure(
    cache: &mut RadixCache,
    kv_events: bool,
    hash_seed: Option<&Bound<'_, PyAny>>,
) -> PyResult<()> {
    let seed = hash_seed.map(|s| u64_arg("hash_seed", s)).transpose()?;
    match (kv_events, seed) {
        (true, s) => cache.enable_kv_events(s.unwrap_or(0)),
        (false, Some(_)) => return Err(InvalidArgumentError::new_err(
            "`hash_seed` is given but `kv_events` is False: the seed only keys the page hashes \
                 of KV events (pass kv_events=True)",
        )),
        (false, None) => {}
    }
    Ok(())
}

fn event<'py>(py: Python<'py>, e: KvEvent) -> PyResult<Bound<'py, PyTuple>> {
    match e {
        KvEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            medium,
            namespace,
        } => (
            "BlockStored",
            PyList::new(py, block_hashes)?,
            parent_block_hash,
            PyList::new(py, token_ids)?,
            block_size,
            medium.as_str(),
            namespace.map(|b| PyBytes::new(py, &b)),
        )
            .into_pyobject(py),
        KvEvent::BlockRemoved {
            block_hashes,
            medium,
        } => (
            "BlockRemoved",
            PyList::new(py, block_hashes)?,
            medium.as_str(),
        )
            .into_pyobject(py),
        KvEvent::AllBlocksCleared => ("AllBlocksCleared",).into_pyobject(py),
    }
}

impl PyRadixCache {
    /// `take_kv_events` (`snapshot` false) / `kv_events_snapshot` (true).
    pub(super) fn events_take<'py>(
        &self,
        py: Python<'py>,
        snapshot: bool,
    ) -> PyResult<Bound<'py, PyList>> {
        // (a snapshot walks the whole tree: the GIL is released for it)
        let evs = with_lock(py, &self.cache, snapshot, |c| {
            if snapshot {
                c.kv_events_snapshot()
            } else {
                c.take_kv_events()
            }
        });
        let items = evs
            .into_iter()
            .map(|e| event(py, e))
            .collect::<PyResult<Vec<_>>>()?;
        PyList::new(py, items)
    }

    /// `take_kv_events_packed`: the events (or a snapshot) as msgpack bytes, with their counts.
    pub(super) fn events_packed<'py>(
        &self,
        py: Python<'py>,
        event_format: &str,
        snapshot: bool,
    ) -> PyResult<PackedTuple<'py>> {
        let fmt = match event_format {
            "array" => WireFormat::Array,
            "map" => WireFormat::Map,
            other => {
                return Err(InvalidArgumentError::new_err(format!(
                    "`event_format` must be \"array\" or \"map\", got {other:?}"
                )))
            }
        };
        let evs = with_lock(py, &self.cache, snapshot, |c| {
            if snapshot {
                c.kv_events_snapshot()
            } else {
                c.take_kv_events()
            }
        });
        let (mut stored, mut removed, mut size) = (0usize, 0usize, 0usize);
        for e in &evs {
            match e {
                KvEvent::BlockStored {
                    block_hashes,
                    token_ids,
                    ..
                } => {
                    stored += block_hashes.len();
                    size += token_ids.len();
                }
                KvEvent::BlockRemoved { block_hashes, .. } => removed += block_hashes.len(),
                KvEvent::AllBlocksCleared => {}
            }
        }
        // (plain Rust data: encoded with the GIL released when large)
        let encode = || {
            let mut out = Vec::with_capacity(16 + 5 * size + 9 * (stored + removed));
            encode_events(&evs, fmt, &mut out);
            out
        };
        let out = if size >= DETACH_MIN {
            py.detach(encode)
        } else {
            encode()
        };
        Ok((PyBytes::new(py, &out), evs.len(), stored, removed))
    }

    /// `kv_event_counts` as a dict.
    pub(super) fn events_counts<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let n = with_lock(py, &self.cache, false, |c| c.kv_event_counts());
        let d = PyDict::new(py);
        d.set_item("events", n.events)?;
        d.set_item("blocks_stored", n.blocks_stored)?;
        d.set_item("blocks_removed", n.blocks_removed)?;
        d.set_item("overflows", n.overflows)?;
        Ok(d)
    }
}
