//! Bindings of the hybrid radix cache (sliding groups, state slots): the allocators a
//! `RadixCache` holds beside the full-attention one, the one lock order over all of them, and the
//! methods that take every group's pages. Conversion and delegation only.

use std::borrow::Cow;
use std::sync::MutexGuard;

use numpy::PyArray1;
use pyo3::prelude::*;

use super::super::alloc::{
    guard, hand_out, try_guard, with_lock, PyPageAllocator, Shared, DETACH_MIN,
};
use super::super::array::{count, ints, Int};
use super::super::detach::View;
use super::super::error::{to_py, InvalidArgumentError};
use super::super::state::PyStateSlotAllocator;
use super::{namespace, page_parts, PyRadixCache, PyRadixNode};
use crate::alloc::{AllocError, PageAllocator};
use crate::radix::{Others, RadixCache, RadixError, Retain};

/// The extra page spaces of a hybrid cache, as the binding holds them.
pub(super) struct Groups {
    pub(super) sliding: Vec<(Shared, usize)>,
    pub(super) sliding_objs: Vec<Py<PyPageAllocator>>,
    pub(super) state: Option<(Shared, Py<PyAny>)>,
    /// The debug-mode mark of the state pool's arrays (a `PageAllocator(..., debug=True)`).
    state_tag: Option<i32>,
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
            state_tag: None,
        };
        for (a, w) in sliding.unwrap_or_default() {
            let w = count("window", &w)?;
            g.sliding.push((a.get().inner.clone(), w));
            g.sliding_objs.push(a.unbind());
        }
        if let Some(s) = state.filter(|s| !s.is_none()) {
            let inner = if let Ok(a) = s.cast::<PyStateSlotAllocator>() {
                a.get().inner.clone()
            } else if let Ok(a) = s.cast::<PyPageAllocator>() {
                g.state_tag = a.get().tag;
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

    /// The allocators of every space, locked in the one order of the bindings: full, the
    /// sliding groups in turn, state. `None` when one is taken now (nothing stays held).
    fn try_lock<'a>(&'a self, full: &'a Shared) -> Option<Spaces<'a>> {
        Some(Spaces {
            full: try_guard(full)?,
            sliding: self
                .sliding
                .iter()
                .map(|(s, _)| try_guard(s))
                .collect::<Option<Vec<_>>>()?,
            state: match &self.state {
                Some((s, _)) => Some(try_guard(s)?),
                None => None,
            },
        })
    }

    /// [`try_lock`](Self::try_lock), waiting for each lock (call it with the GIL released).
    fn lock<'a>(&'a self, full: &'a Shared) -> Spaces<'a> {
        Spaces {
            full: guard(full),
            sliding: self.sliding.iter().map(|(s, _)| guard(s)).collect(),
            state: self.state.as_ref().map(|(s, _)| guard(s)),
        }
    }

    /// The Rust cache over every space (`page_size` defaults to the full allocator's). Waits for
    /// busy allocators with the GIL released; creates no Python object under a lock.
    pub(super) fn build(
        &self,
        py: Python<'_>,
        full: &Shared,
        page_size: Option<usize>,
    ) -> Result<RadixCache, RadixError> {
        let make = |s: Spaces<'_>| {
            let ps = page_size.unwrap_or(s.full.page_size());
            let sliding: Vec<(&PageAllocator, usize)> = s
                .sliding
                .iter()
                .zip(&self.sliding)
                .map(|(g, &(_, w))| (&**g, w))
                .collect();
            RadixCache::with_groups(&s.full, ps, &sliding, s.state.as_deref())
        };
        match self.try_lock(full) {
            Some(s) => make(s),
            None => py.detach(|| make(self.lock(full))),
        }
    }
}

/// The locked allocators of a hybrid cache (see [`Groups::lock`]).
struct Spaces<'a> {
    full: MutexGuard<'a, PageAllocator>,
    sliding: Vec<MutexGuard<'a, PageAllocator>>,
    state: Option<MutexGuard<'a, PageAllocator>>,
}

impl Spaces<'_> {
    fn run<R>(
        &mut self,
        c: &mut RadixCache,
        f: impl FnOnce(&mut RadixCache, &mut PageAllocator, &mut Others<'_>) -> R,
    ) -> R {
        let mut others = Others {
            sliding: self.sliding.iter_mut().map(|g| &mut **g).collect(),
            state: self.state.as_deref_mut(),
        };
        f(c, &mut self.full, &mut others)
    }
}

impl PyRadixCache {
    /// Runs `f` with the cache and every allocator locked, in the one lock order of the
    /// bindings (cache, full, sliding groups in turn, state), as [`with_both`] does for a plain
    /// cache: long work runs with the GIL released; short work keeps it only when every lock is
    /// free now. `f` is `Send`, so it cannot create Python objects; the caller builds arrays and
    /// exceptions after the locks are gone.
    ///
    /// (Two hybrid caches that use one allocator in opposite roles, full in one and sliding in the
    /// other, lock it in different orders: give each cache its own allocators.)
    ///
    /// [`with_both`]: PyRadixCache::with_both
    pub(super) fn with_spaces<R: Send>(
        &self,
        py: Python<'_>,
        long: bool,
        f: impl FnOnce(&mut RadixCache, &mut PageAllocator, &mut Others<'_>) -> R + Send,
    ) -> R {
        if !long {
            if let Some(mut c) = try_guard(&self.cache) {
                if let Some(mut s) = self.groups.try_lock(&self.alloc) {
                    return s.run(&mut c, f);
                }
            }
        }
        py.detach(|| {
            let mut c = guard(&self.cache);
            let mut s = self.groups.lock(&self.alloc);
            s.run(&mut c, f)
        })
    }
}

/// [`View::pages_stable`] of each array.
fn copies<'a>(v: &[View<'a>]) -> Result<Vec<Cow<'a, [i32]>>, AllocError> {
    v.iter().map(|p| p.pages_stable()).collect()
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
        let view = arr.view("tokens")?;
        let t = self.time(py)?;
        // (read in place and checked with the GIL released when long: see `detach.rs`)
        let m = with_lock(py, &self.cache, view.long(), |c| {
            c.set_now(t);
            view.with_tokens(|t| c.match_prefix_groups(&ns, t))
        })
        .map_err(to_py)?;
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

    /// `insert` of a hybrid cache (or of a plain one given `sliding_pages` / `state_slot`).
    pub(super) fn insert_groups(
        &self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        pages: &Bound<'_, PyAny>,
        ns: Option<&Bound<'_, PyAny>>,
        (sliding_pages, state_slot, retain): (Option<Vec<Bound<'_, PyAny>>>, Option<Int>, Retain),
    ) -> PyResult<usize> {
        let ns = namespace(ns)?;
        let state = state_slot
            .map(|s| count("state_slot", &s))
            .transpose()?
            .unwrap_or(0);
        let state = i32::try_from(state).map_err(|_| {
            to_py(AllocError::OutOfRange {
                page: state as i64,
                num_pages: i32::MAX as u32,
            })
        })?;
        let t = ints(tokens, "tokens")?;
        let items = page_parts(pages);
        let arrays = items
            .iter()
            .map(|a| ints(a, "pages"))
            .collect::<PyResult<Vec<_>>>()?;
        let sl = sliding_pages
            .unwrap_or_default()
            .iter()
            .enumerate()
            .map(|(i, a)| ints(a, &format!("sliding_pages[{i}]")))
            .collect::<PyResult<Vec<_>>>()?;
        let toks = t.view("tokens")?;
        let parts = arrays
            .iter()
            .map(|a| a.view("pages"))
            .collect::<PyResult<Vec<_>>>()?;
        let sl = sl
            .iter()
            .enumerate()
            .map(|(i, a)| a.view(&format!("sliding_pages[{i}]")))
            .collect::<PyResult<Vec<_>>>()?;
        let total = toks.len()
            + parts.iter().map(|p| p.len()).sum::<usize>()
            + sl.iter().map(|p| p.len()).sum::<usize>();
        let t = self.time(py)?;
        // (checked and copied with the GIL released when long: see `detach.rs`)
        self.with_spaces(py, total >= DETACH_MIN, |c, a, o| {
            let toks = toks.tokens_stable()?;
            let parts = copies(&parts)?;
            let sl = copies(&sl)?;
            let parts: Vec<&[i32]> = parts.iter().map(|p| &p[..]).collect();
            let sl: Vec<&[i32]> = sl.iter().map(|p| &p[..]).collect();
            c.set_now(t);
            c.insert_groups_retained(a, o, &ns, &toks, &parts, &sl, state, retain)
        })
        .map_err(to_py)
    }

    /// `group`: a sliding group's index, or None for the state-slot pool.
    pub(super) fn alloc_group<'py>(
        &self,
        py: Python<'py>,
        group: Option<usize>,
        n: &Int,
    ) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let n = count("n", n)?;
        let t = self.time(py)?;
        let r = self.with_spaces(py, n >= DETACH_MIN, |c, a, o| {
            c.set_now(t);
            let pages = c.alloc_group_with(a, o, group, n)?;
            let mut gens = Vec::new();
            let space = match group {
                Some(k) => o.sliding.get(k).map(|a| &**a),
                None => o.state.as_deref(),
            };
            if let Some(s) = space {
                s.grant(&pages, &mut gens);
            }
            Ok::<_, RadixError>((pages, gens))
        });
        let (pages, gens) = r.map_err(to_py)?;
        // (the space exists: `alloc_group_with` refused a missing one)
        let (shared, tag) = match group {
            Some(k) => (
                &self.groups.sliding[k].0,
                self.groups.sliding_objs[k].get().tag,
            ),
            None => match &self.groups.state {
                Some((s, _)) => (s, self.groups.state_tag),
                None => return Err(to_py(RadixError::NoStatePool)),
            },
        };
        hand_out(py, shared, tag, pages, gens)
    }

    pub(super) fn paths_groups<'py>(
        &self,
        py: Python<'py>,
        ns: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Vec<GroupPathTuple<'py>>> {
        let ns = namespace(ns)?;
        let paths = with_lock(py, &self.cache, true, |c| c.leaf_paths_groups(&ns));
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
