//! Bindings of the hybrid radix cache (sliding groups, state slots): the allocators a
//! `RadixCache` holds beside the full-attention one, the one lock order over all of them, and the
//! methods that take every group's pages. Conversion and delegation only.

use std::sync::MutexGuard;

use numpy::PyArray1;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};

use super::super::alloc::{guard, PyPageAllocator, Shared};
use super::super::array::{count, ints, Int};
use super::super::error::{to_py, InvalidArgumentError};
use super::super::state::PyStateSlotAllocator;
use super::{namespace, PyRadixCache, PyRadixNode};
use crate::alloc::{AllocError, PageAllocator};
use crate::radix::{Others, RadixCache, RadixError};

/// The extra page spaces of a hybrid cache, as the binding holds them.
pub(super) struct Groups {
    pub(super) sliding: Vec<(Shared, usize)>,
    pub(super) sliding_objs: Vec<Py<PyPageAllocator>>,
    pub(super) state: Option<(Shared, Py<PyAny>)>,
}

impl Groups {
    pub(super) fn from_py(
        full: &Shared,
        sliding: Option<Vec<(Bound<'_, PyPageAllocator>, Int)>>,
        state: Option<Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let mut g = Self {
            sliding: Vec::new(),
            sliding_objs: Vec::new(),
            state: None,
        };
        for (a, w) in sliding.unwrap_or_default() {
            let w = count("window", w.0)?;
            g.sliding.push((a.get().inner.clone(), w));
            g.sliding_objs.push(a.unbind());
        }
        if let Some(s) = state.filter(|s| !s.is_none()) {
            let inner = if let Ok(a) = s.cast::<PyStateSlotAllocator>() {
                a.get().inner.clone()
            } else if let Ok(a) = s.cast::<PyPageAllocator>() {
                a.get().inner.clone()
            } else {
                return Err(InvalidArgumentError::new_err(format!(
                    "`state_slots` must be a StateSlotAllocator (or a PageAllocator), got `{}`",
                    s.get_type()
                        .name()
                        .map(|n| n.to_string())
                        .unwrap_or_default()
                )));
            };
            g.state = Some((inner, s.unbind()));
        }
        // One mutex per space: the same allocator twice would deadlock the calls that lock all.
        let all: Vec<&Shared> = std::iter::once(full)
            .chain(g.sliding.iter().map(|(a, _)| a))
            .chain(g.state.as_ref().map(|(a, _)| a))
            .collect();
        for (i, a) in all.iter().enumerate() {
            if all[..i].iter().any(|b| std::sync::Arc::ptr_eq(a, b)) {
                return Err(to_py(RadixError::SharedAllocator));
            }
        }
        Ok(g)
    }

    pub(super) fn is_hybrid(&self) -> bool {
        !self.sliding.is_empty() || self.state.is_some()
    }

    pub(super) fn build(
        &self,
        full: &Shared,
        page_size: Option<usize>,
    ) -> Result<RadixCache, RadixError> {
        let a = guard(full);
        let ps = page_size.unwrap_or(a.page_size());
        let gs: Vec<MutexGuard<'_, PageAllocator>> =
            self.sliding.iter().map(|(s, _)| guard(s)).collect();
        let st = self.state.as_ref().map(|(s, _)| guard(s));
        let sliding: Vec<(&PageAllocator, usize)> = gs
            .iter()
            .zip(&self.sliding)
            .map(|(g, &(_, w))| (&**g, w))
            .collect();
        RadixCache::with_groups(&a, ps, &sliding, st.as_deref())
    }
}

impl PyRadixCache {
    /// Runs `f` with the cache and every allocator locked (cache, full, sliding in order, state:
    /// the one lock order of the bindings). `f` computes only; the caller builds Python objects
    /// after the locks are gone.
    pub(super) fn with_spaces<R>(
        &self,
        f: impl FnOnce(&mut RadixCache, &mut PageAllocator, &mut Others<'_>) -> R,
    ) -> R {
        let mut c = guard(&self.cache);
        let mut a = guard(&self.alloc);
        let mut gs: Vec<MutexGuard<'_, PageAllocator>> =
            self.groups.sliding.iter().map(|(s, _)| guard(s)).collect();
        let mut st = self.groups.state.as_ref().map(|(s, _)| guard(s));
        let mut others = Others {
            sliding: gs.iter_mut().map(|g| &mut **g).collect(),
            state: st.as_deref_mut(),
        };
        f(&mut c, &mut a, &mut others)
    }
}

/// `match_prefix_groups`' result: (pages, node, len, sliding pages per group, state slot).
pub(super) type GroupMatchTuple<'py> = (
    Bound<'py, PyArray1<i32>>,
    PyRadixNode,
    usize,
    Vec<Bound<'py, PyArray1<i32>>>,
    i32,
);

/// `leaf_paths_groups`' rows: (tokens, pages, sliding pages per group, states per page).
pub(super) type GroupPathTuple<'py> = (
    Bound<'py, PyArray1<i32>>,
    Bound<'py, PyArray1<i32>>,
    Vec<Bound<'py, PyArray1<i32>>>,
    Bound<'py, PyArray1<i32>>,
);

impl PyRadixCache {
    pub(super) fn match_groups<'py>(
        &self,
        py: Python<'py>,
        tokens: &Bound<'py, PyAny>,
        ns: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<GroupMatchTuple<'py>> {
        let ns = namespace(ns)?;
        let arr = ints(tokens, "tokens")?;
        let tokens = arr.tokens("tokens")?;
        let m = guard(&self.cache).match_prefix_groups(&ns, &tokens);
        let sliding = m
            .sliding
            .into_iter()
            .map(|s| PyArray1::from_vec(py, s))
            .collect();
        Ok((
            PyArray1::from_vec(py, m.pages),
            PyRadixNode(m.node),
            m.len,
            sliding,
            m.state,
        ))
    }

    pub(super) fn insert_groups(
        &self,
        tokens: &Bound<'_, PyAny>,
        pages: &Bound<'_, PyAny>,
        ns: Option<&Bound<'_, PyAny>>,
        sliding_pages: Option<Vec<Bound<'_, PyAny>>>,
        state_slot: i64,
    ) -> PyResult<usize> {
        let ns = namespace(ns)?;
        let t = ints(tokens, "tokens")?;
        let items: Vec<Bound<'_, PyAny>> = if let Ok(tup) = pages.cast::<PyTuple>() {
            tup.iter().collect()
        } else if let Ok(list) = pages.cast::<PyList>() {
            list.iter().collect()
        } else {
            vec![pages.clone()]
        };
        let arrays = items
            .iter()
            .map(|a| ints(a, "pages"))
            .collect::<PyResult<Vec<_>>>()?;
        let sl = sliding_pages
            .unwrap_or_default()
            .iter()
            .map(|a| ints(a, "sliding_pages[i]"))
            .collect::<PyResult<Vec<_>>>()?;
        let toks = t.tokens("tokens")?;
        let parts = arrays
            .iter()
            .map(|a| a.pages("pages"))
            .collect::<PyResult<Vec<_>>>()?;
        let sl = sl
            .iter()
            .map(|a| a.pages("sliding_pages[i]"))
            .collect::<PyResult<Vec<_>>>()?;
        let state = i32::try_from(state_slot).map_err(|_| {
            to_py(AllocError::OutOfRange {
                page: state_slot,
                num_pages: i32::MAX as u32,
            })
        })?;
        if state < 0 {
            return Err(to_py(AllocError::OutOfRange {
                page: state_slot,
                num_pages: i32::MAX as u32,
            }));
        }
        let parts: Vec<&[i32]> = parts.iter().map(|p| &p[..]).collect();
        let sl: Vec<&[i32]> = sl.iter().map(|p| &p[..]).collect();
        let r = self.with_spaces(|c, a, o| c.insert_groups(a, o, &ns, &toks, &parts, &sl, state));
        r.map_err(to_py)
    }

    /// `group`: a sliding group's index, or None for the state-slot pool.
    pub(super) fn alloc_group<'py>(
        &self,
        py: Python<'py>,
        group: Option<usize>,
        n: Int,
    ) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let n = count("n", n.0)?;
        let r = self.with_spaces(|c, a, o| c.alloc_group_with(a, o, group, n));
        Ok(PyArray1::from_vec(py, r.map_err(to_py)?))
    }

    pub(super) fn paths_groups<'py>(
        &self,
        py: Python<'py>,
        ns: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Vec<GroupPathTuple<'py>>> {
        let ns = namespace(ns)?;
        let paths = guard(&self.cache).leaf_paths_groups(&ns);
        Ok(paths
            .into_iter()
            .map(|p| {
                (
                    PyArray1::from_vec(py, p.tokens),
                    PyArray1::from_vec(py, p.pages),
                    p.sliding
                        .into_iter()
                        .map(|s| PyArray1::from_vec(py, s))
                        .collect(),
                    PyArray1::from_vec(py, p.states),
                )
            })
            .collect())
    }

    pub(super) fn sliding_objs(&self, py: Python<'_>) -> Vec<(Py<PyPageAllocator>, usize)> {
        self.groups
            .sliding_objs
            .iter()
            .zip(&self.groups.sliding)
            .map(|(o, &(_, w))| (o.clone_ref(py), w))
            .collect()
    }

    pub(super) fn state_obj(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        self.groups.state.as_ref().map(|(_, o)| o.clone_ref(py))
    }
}
