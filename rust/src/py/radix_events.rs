//! Bindings of KV events (`rust/src/radix/events.rs`): the events a `RadixCache` recorded, taken
//! under its lock as Rust data and turned into plain Python tuples after the lock is released.
//! Conversion only.

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};

use super::super::alloc::with_lock;
use super::super::error::InvalidArgumentError;
use super::super::hash::u64_arg;
use super::PyRadixCache;
use crate::radix::{encode_events, KvEvent, RadixCache, WireFormat};

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
    /// The pending events (`snapshot` false) or a snapshot (true), as Rust data, taken under the
    /// cache's lock (a snapshot walks the whole tree: the GIL is released for it).
    fn take_events(&self, py: Python<'_>, snapshot: bool) -> Vec<KvEvent> {
        with_lock(py, &self.cache, snapshot, |c| {
            if snapshot {
                c.kv_events_snapshot()
            } else {
                c.take_kv_events()
            }
        })
    }

    /// `take_kv_events` (`snapshot` false) / `kv_events_snapshot` (true).
    pub(super) fn events_take<'py>(
        &self,
        py: Python<'py>,
        snapshot: bool,
    ) -> PyResult<Bound<'py, PyList>> {
        // (the tuples are built after the lock is released)
        let items = self
            .take_events(py, snapshot)
            .into_iter()
            .map(|e| event(py, e))
            .collect::<PyResult<Vec<_>>>()?;
        PyList::new(py, items)
    }

    /// `take_kv_events_batch`: the events (or a snapshot) as an opaque batch, taken in O(1).
    pub(super) fn events_batch(&self, py: Python<'_>, snapshot: bool) -> PyKvEventBatch {
        PyKvEventBatch::new(self.take_events(py, snapshot))
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

/// KV events taken from a `RadixCache` in one call (`take_kv_events_batch`), held in Rust:
/// taking them costs no Python object per event, and `encode` writes vLLM's wire form with the
/// GIL released, so a publisher thread can encode while the serving loop runs.
///
/// `len(batch)` is the number of events; `to_list()` gives the tuples of `take_kv_events`.
#[pyclass(name = "KvEventBatch", module = "kvpool._core", frozen)]
pub(crate) struct PyKvEventBatch {
    events: Vec<KvEvent>,
    stored: usize,
    removed: usize,
    tokens: usize,
}

impl PyKvEventBatch {
    fn new(events: Vec<KvEvent>) -> Self {
        let (mut stored, mut removed, mut tokens) = (0, 0, 0);
        for e in &events {
            match e {
                KvEvent::BlockStored {
                    block_hashes,
                    token_ids,
                    ..
                } => {
                    stored += block_hashes.len();
                    tokens += token_ids.len();
                }
                KvEvent::BlockRemoved { block_hashes, .. } => removed += block_hashes.len(),
                KvEvent::AllBlocksCleared => {}
            }
        }
        Self {
            events,
            stored,
            removed,
            tokens,
        }
    }
}

#[pymethods]
impl PyKvEventBatch {
    /// The events as vLLM's msgpack wire form: one msgpack array, the second item of a batch
    /// payload ``[ts, events, data_parallel_rank]`` (see `kvpool.events`).
    ///
    /// Parameters
    /// ----------
    /// event_format : {"array", "map"}
    ///     Tagged arrays (vLLM <= v0.23) or tagged maps (vLLM since its PR #42892).
    ///
    /// Raises
    /// ------
    /// InvalidArgumentError
    ///     An unknown `event_format`.
    ///
    /// Notes
    /// -----
    /// Releases the GIL for 4,096 tokens or more.
    #[pyo3(signature = (event_format="array"))]
    fn encode<'py>(&self, py: Python<'py>, event_format: &str) -> PyResult<Bound<'py, PyBytes>> {
        let fmt = match event_format {
            "array" => WireFormat::Array,
            "map" => WireFormat::Map,
            other => {
                return Err(InvalidArgumentError::new_err(format!(
                    "`event_format` must be \"array\" or \"map\", got {other:?}"
                )))
            }
        };
        let encode = || {
            let mut out =
                Vec::with_capacity(16 + 5 * self.tokens + 9 * (self.stored + self.removed));
            encode_events(&self.events, fmt, &mut out);
            out
        };
        let out = if self.tokens >= 4096 {
            py.detach(encode)
        } else {
            encode()
        };
        Ok(PyBytes::new(py, &out))
    }

    /// The events as the tuples `RadixCache.take_kv_events` returns.
    fn to_list<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let items = self
            .events
            .iter()
            .map(|e| event(py, e.clone()))
            .collect::<PyResult<Vec<_>>>()?;
        PyList::new(py, items)
    }

    /// Pages the batch announces as stored.
    #[getter]
    fn blocks_stored(&self) -> usize {
        self.stored
    }
    /// Pages the batch announces as removed.
    #[getter]
    fn blocks_removed(&self) -> usize {
        self.removed
    }

    fn __len__(&self) -> usize {
        self.events.len()
    }

    /// `KvEventBatch(events=..., blocks_stored=..., blocks_removed=...)`.
    fn __repr__(&self) -> String {
        format!(
            "KvEventBatch(events={}, blocks_stored={}, blocks_removed={})",
            self.events.len(),
            self.stored,
            self.removed
        )
    }
}
