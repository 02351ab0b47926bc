//! Bindings of the radix cache's host-memory tier (`radix/tier.rs`): the host allocator a
//! `RadixCache` holds, the lock order (cache, device allocator, host allocator) and the tiered
//! calls. Conversion and delegation only.

use numpy::PyArray1;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::super::alloc::{guard, hand_out, try_guard, PyPageAllocator, Shared, DETACH_MIN};
use super::super::array::ints;
use super::super::error::to_py;
use super::{namespace, PyRadixCache, PyRadixNode};
use crate::alloc::{AllocError, PageAllocator};
use crate::radix::{RadixCache, RadixError};

/// The host tier's allocator as the binding holds it.
pub(super) struct Host {
    pub(super) inner: Shared,
    pub(super) obj: Py<PyPageAllocator>,
}

/// `match_prefix_host`'s result: (host pages, node, host tokens).
pub(super) type HostMatchTuple<'py> = (Bound<'py, PyArray1<i32>>, PyRadixNode, usize);
/// `take_demotions`' result: (device pages, host pages).
pub(super) type Demotions<'py> = (Bound<'py, PyArray1<i32>>, Bound<'py, PyArray1<i32>>);

impl Host {
    pub(super) fn from_py(
        full: &Shared,
        host: Option<Bound<'_, PyPageAllocator>>,
        hybrid: bool,
    ) -> PyResult<Option<Self>> {
        let Some(h) = host else { return Ok(None) };
        if hybrid {
            return Err(to_py(RadixError::HostTierHybrid));
        }
        let inner = h.get().inner.clone();
        if std::sync::Arc::ptr_eq(&inner, full) {
            return Err(to_py(RadixError::SharedAllocator));
        }
        Ok(Some(Self {
            inner,
            obj: h.unbind(),
        }))
    }
}

impl PyRadixCache {
    fn host_of(&self) -> Result<&Shared, RadixError> {
        self.host
            .as_ref()
            .map(|h| &h.inner)
            .ok_or(RadixError::HostAllocator { has_tier: false })
    }

    /// Runs `f` with the cache, the device allocator and the host allocator locked, in that
    /// order (short work keeps the GIL only when all three are free now).
    pub(super) fn with_tier<R: Send>(
        &self,
        py: Python<'_>,
        long: bool,
        f: impl FnOnce(&mut RadixCache, &mut PageAllocator, &mut PageAllocator) -> R + Send,
    ) -> Result<R, RadixError> {
        let host = self.host_of()?;
        if !long {
            if let Some(mut c) = try_guard(&self.cache) {
                if let Some(mut a) = try_guard(&self.alloc) {
                    if let Some(mut h) = try_guard(host) {
                        return Ok(f(&mut c, &mut a, &mut h));
                    }
                }
            }
        }
        Ok(py.detach(|| f(&mut guard(&self.cache), &mut guard(&self.alloc), &mut guard(host))))
    }

    /// [`Self::with_tier`] for a fallible `f`: its error, or the missing tier, as a Python error.
    pub(super) fn tiered<R: Send>(
        &self,
        py: Python<'_>,
        long: bool,
        f: impl FnOnce(&mut RadixCache, &mut PageAllocator, &mut PageAllocator) -> Result<R, RadixError>
            + Send,
    ) -> PyResult<R> {
        self.with_tier(py, long, f).and_then(|r| r).map_err(to_py)
    }

    pub(super) fn has_tier(&self) -> bool {
        self.host.is_some()
    }

    /// Adds the tier to the freshly built Rust cache.
    pub(super) fn enable_tier(&self, py: Python<'_>) -> PyResult<()> {
        if self.host.is_none() {
            return Ok(());
        }
        self.tiered(py, false, |c, a, h| c.enable_host_tier(a, h))
    }

    pub(super) fn take_tiered<'py>(
        &self,
        py: Python<'py>,
        n: usize,
        soft: bool,
    ) -> PyResult<Option<Bound<'py, PyArray1<i32>>>> {
        let now = self.time(py)?;
        let r = self
            .with_tier(py, n >= DETACH_MIN, |c, a, h| {
                c.set_now(now);
                let pages = c.alloc_tiered(a, h, n)?;
                let mut gens = Vec::new();
                a.grant(&pages, &mut gens);
                Ok::<_, RadixError>((pages, gens))
            })
            .and_then(|r| r);
        match r {
            Ok((pages, gens)) => {
                let tag = self.allocator.get().tag;
                hand_out(py, &self.alloc, tag, pages, gens).map(Some)
            }
            Err(RadixError::Page(AllocError::OutOfPages { .. })) if soft => Ok(None),
            Err(e) => Err(to_py(e)),
        }
    }

    pub(super) fn match_host<'py>(
        &self,
        py: Python<'py>,
        tokens: &Bound<'py, PyAny>,
        ns: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<HostMatchTuple<'py>> {
        let ns = namespace(ns)?;
        let arr = ints(tokens, "tokens")?;
        let view = arr.view("tokens")?;
        // (read in place and checked with the GIL released when long: see `detach.rs`)
        let now = self.time(py)?;
        let m = self.tiered(py, view.long(), |c, _, _| {
            c.set_now(now);
            view.with_tokens(|t| c.match_prefix_host(&ns, t))
        })?;
        Ok((PyArray1::from_vec(py, m.pages), PyRadixNode(m.node), m.len))
    }

    pub(super) fn load(
        &self,
        py: Python<'_>,
        node: &PyRadixNode,
        pages: &Bound<'_, PyAny>,
    ) -> PyResult<usize> {
        let arr = ints(pages, "pages")?;
        let view = arr.view("pages")?;
        let h = node.0;
        // (copied, narrowed, checked and applied with the GIL released when long: the closure
        // touches no Python object, only the numpy buffer the view borrows; see `detach.rs`)
        self.tiered(py, view.long(), |c, a, host| {
            let pages = view.pages_stable()?;
            c.load_back(a, host, h, &pages)
        })
    }

    pub(super) fn demotions<'py>(&self, py: Python<'py>) -> PyResult<Demotions<'py>> {
        let d = self
            .with_tier(py, false, |c, _, _| c.take_demotions())
            .map_err(to_py)?;
        let (dev, host): (Vec<i32>, Vec<i32>) = d.into_iter().unzip();
        Ok((PyArray1::from_vec(py, dev), PyArray1::from_vec(py, host)))
    }

    pub(super) fn tier_stats_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let (s, size) = super::super::alloc::with_lock(py, &self.cache, false, |c| {
            (c.tier_stats(), c.host_size())
        });
        let d = PyDict::new(py);
        d.set_item("demoted_pages", s.demoted_pages)?;
        d.set_item("dropped_pages", s.dropped_pages)?;
        d.set_item("host_evicted_pages", s.host_evicted_pages)?;
        d.set_item("loaded_pages", s.loaded_pages)?;
        d.set_item("host_query_tokens", s.host_query_tokens)?;
        d.set_item("host_hit_tokens", s.host_hit_tokens)?;
        d.set_item("host_size", size)?;
        Ok(d)
    }

    pub(super) fn host_obj(&self, py: Python<'_>) -> Option<Py<PyPageAllocator>> {
        self.host.as_ref().map(|h| h.obj.clone_ref(py))
    }
}
