//! Bindings of `radix`: `RadixCache` and its node handles, namespaces from Python values.
//!
//! Sharing: `RadixCache(allocator)` keeps a clone of the allocator's `Arc<Mutex<PageAllocator>>`,
//! so both Python objects see one allocator (requests allocate and free through either). The tree
//! has its own mutex; calls that touch both lock the cache first, then the allocator.

use std::borrow::Cow;
use std::sync::{Mutex, OnceLock};

use numpy::PyArray1;
use pyo3::prelude::*;
use pyo3::types::{IntoPyDict, PyBytes, PyInt, PyList, PyString, PyTuple};

use super::alloc::{guard, PyPageAllocator, Shared};
use super::array::{count, ints, page_array, Int};
use super::error::{to_py, InvalidArgumentError};
use crate::alloc::AllocError;
use crate::radix::{Handle, Namespace, NamespaceBuilder, RadixCache, RadixError};

#[path = "radix_groups.rs"]
mod groups;
use groups::Groups;

/// A handle to a radix node, from `match_prefix`; pass it to `lock` / `unlock`.
#[pyclass(name = "RadixNode", module = "kvpool._core", frozen, eq, hash)]
#[derive(PartialEq, Eq, Hash)]
pub(crate) struct PyRadixNode(Handle);

#[pymethods]
impl PyRadixNode {
    fn __repr__(&self) -> String {
        format!("RadixNode({})", self.0.node().get())
    }
}

const MAX_DEPTH: usize = 16;

fn encode(b: &mut NamespaceBuilder, obj: &Bound<'_, PyAny>, depth: usize) -> PyResult<()> {
    if depth > MAX_DEPTH {
        return Err(InvalidArgumentError::new_err(format!(
            "`namespace` nests tuples deeper than {MAX_DEPTH}"
        )));
    }
    if obj.is_none() {
        b.none();
    } else if let Ok(t) = obj.cast::<PyTuple>() {
        b.tuple(t.len());
        for item in t.iter() {
            encode(b, &item, depth + 1)?;
        }
    } else if let Ok(s) = obj.cast::<PyString>() {
        // (a lone surrogate has no UTF-8 form: name the argument, not the codec)
        let text = s.to_cow().map_err(|e| {
            InvalidArgumentError::new_err(format!(
                "`namespace` strings must encode as UTF-8 (lone surrogates do not): {e}"
            ))
        })?;
        b.str(&text);
    } else if let Ok(by) = obj.cast::<PyBytes>() {
        b.bytes(by.as_bytes());
    } else if let Ok(i) = obj.cast::<PyInt>() {
        int(b, i)?;
    } else if let Ok(i) = obj
        .call_method0("__index__")
        .and_then(|v| v.cast_into::<PyInt>().map_err(PyErr::from))
    {
        int(b, &i)?; // numpy integers
    } else {
        let ty = obj
            .get_type()
            .name()
            .map(|n| n.to_string())
            .unwrap_or_default();
        return Err(InvalidArgumentError::new_err(format!(
            "`namespace` items must be None, int, str, bytes or tuples of those; got `{ty}`"
        )));
    }
    Ok(())
}

fn int(b: &mut NamespaceBuilder, i: &Bound<'_, PyInt>) -> PyResult<()> {
    if let Ok(v) = i.extract::<i64>() {
        b.int(v);
    } else {
        let bits: usize = i.call_method0("bit_length")?.extract()?;
        let kw = [("signed", true)].into_py_dict(i.py())?;
        let bytes = i.call_method("to_bytes", (bits / 8 + 1, "little"), Some(&kw))?;
        b.int_le(bytes.cast::<PyBytes>()?.as_bytes());
    }
    Ok(())
}

/// Python value -> namespace key: None, int, str, bytes, or (nested) tuples, tag-encoded.
/// The default namespace is built once (no allocation per call).
fn namespace(obj: Option<&Bound<'_, PyAny>>) -> PyResult<Cow<'static, Namespace>> {
    static NONE: OnceLock<Namespace> = OnceLock::new();
    match obj {
        Some(o) if !o.is_none() => {
            let mut b = Namespace::builder();
            encode(&mut b, o, 0)?;
            Ok(Cow::Owned(b.finish()))
        }
        _ => Ok(Cow::Borrowed(NONE.get_or_init(Namespace::none))),
    }
}

/// Radix prefix cache over a `PageAllocator` (shared with it).
#[pyclass(name = "RadixCache", module = "kvpool._core", frozen)]
pub(crate) struct PyRadixCache {
    alloc: Shared,
    allocator: Py<PyPageAllocator>,
    cache: Mutex<RadixCache>,
    /// Hybrid models: the sliding groups' and the state pool's allocators (see `radix_groups.rs`).
    groups: Groups,
}

type MatchTuple<'py> = (Bound<'py, PyArray1<i32>>, PyRadixNode, usize);
type PathPair<'py> = (Bound<'py, PyArray1<i32>>, Bound<'py, PyArray1<i32>>);

#[pymethods]
impl PyRadixCache {
    #[new]
    #[pyo3(signature = (allocator, page_size=None, *, sliding=None, state_slots=None))]
    fn new(
        allocator: Bound<'_, PyPageAllocator>,
        page_size: Option<Int>,
        sliding: Option<Vec<(Bound<'_, PyPageAllocator>, Int)>>,
        state_slots: Option<Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let alloc = allocator.get().inner.clone();
        let groups = Groups::from_py(&alloc, sliding, state_slots)?;
        let ps = page_size.map(|p| count("page_size", p.0)).transpose()?;
        let cache = groups.build(&alloc, ps).map_err(to_py)?;
        Ok(Self {
            alloc,
            allocator: allocator.unbind(),
            cache: Mutex::new(cache),
            groups,
        })
    }

    #[pyo3(signature = (tokens, namespace=None))]
    fn match_prefix<'py>(
        &self,
        py: Python<'py>,
        tokens: &Bound<'py, PyAny>,
        namespace: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<MatchTuple<'py>> {
        let ns = self::namespace(namespace)?;
        let arr = ints(tokens, "tokens")?;
        let tokens = arr.tokens("tokens")?;
        let mut c = guard(&self.cache);
        let mut pages: Vec<i32> = Vec::with_capacity(tokens.len() / c.page_size());
        let (node, len) = c.match_prefix_with(&ns, &tokens, |p| pages.extend_from_slice(p));
        drop(c);
        Ok((PyArray1::from_vec(py, pages), PyRadixNode(node), len))
    }

    #[pyo3(signature = (tokens, pages, namespace=None, *, sliding_pages=None, state_slot=None))]
    fn insert(
        &self,
        tokens: &Bound<'_, PyAny>,
        pages: &Bound<'_, PyAny>,
        namespace: Option<&Bound<'_, PyAny>>,
        sliding_pages: Option<Vec<Bound<'_, PyAny>>>,
        state_slot: Option<Int>,
    ) -> PyResult<usize> {
        if self.groups.is_hybrid() || sliding_pages.is_some() || state_slot.is_some() {
            let state = state_slot.map_or(0, |s| s.0);
            return self.insert_groups(tokens, pages, namespace, sliding_pages, state);
        }
        let ns = self::namespace(namespace)?;
        let t = ints(tokens, "tokens")?;
        // One array, or a tuple / list of arrays standing for their concatenation (what a serving
        // loop holds: the matched pages, then the new ones), never built.
        let items: Vec<Bound<'_, PyAny>> = if let Ok(tup) = pages.cast::<PyTuple>() {
            tup.iter().collect()
        } else if let Ok(list) = pages.cast::<PyList>() {
            list.iter().collect()
        } else {
            let p = ints(pages, "pages")?;
            let (toks, pages) = (t.tokens("tokens")?, p.pages("pages")?);
            let mut c = guard(&self.cache);
            return c
                .insert(&mut guard(&self.alloc), &ns, &toks, &pages)
                .map_err(to_py);
        };
        let arrays = items
            .iter()
            .enumerate()
            // The error names the part (rare path: the name is only built then).
            .map(|(i, a)| ints(a, "pages").or_else(|_| ints(a, &format!("pages[{i}]"))))
            .collect::<PyResult<Vec<_>>>()?;
        let toks = t.tokens("tokens")?;
        let parts = arrays
            .iter()
            .map(|a| a.pages("pages"))
            .collect::<PyResult<Vec<_>>>()?;
        let parts: Vec<&[i32]> = parts.iter().map(|p| &p[..]).collect();
        let mut c = guard(&self.cache);
        c.insert_parts(&mut guard(&self.alloc), &ns, &toks, &parts)
            .map_err(to_py)
    }

    fn lock(&self, node: &PyRadixNode) -> PyResult<()> {
        guard(&self.cache).lock(node.0).map_err(to_py)
    }

    fn unlock(&self, node: &PyRadixNode) -> PyResult<()> {
        guard(&self.cache).unlock(node.0).map_err(to_py)
    }

    fn evict(&self, num_tokens: Int) -> PyResult<usize> {
        let n = count("num_tokens", num_tokens.0)?;
        if self.groups.is_hybrid() {
            let r = self.with_spaces(|c, a, o| c.evict_with(a, o, n));
            return r.map_err(to_py);
        }
        let mut c = guard(&self.cache);
        c.evict(&mut guard(&self.alloc), n).map_err(to_py)
    }

    fn alloc<'py>(&self, py: Python<'py>, n: Int) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let n = count("n", n.0)?;
        if self.groups.is_hybrid() {
            let r = self.with_spaces(|c, a, o| c.alloc_i32_with(a, o, n));
            return Ok(PyArray1::from_vec(py, r.map_err(to_py)?));
        }
        let mut c = guard(&self.cache);
        let pages = c.alloc_i32(&mut guard(&self.alloc), n).map_err(to_py)?;
        Ok(PyArray1::from_vec(py, pages))
    }

    fn try_alloc<'py>(
        &self,
        py: Python<'py>,
        n: Int,
    ) -> PyResult<Option<Bound<'py, PyArray1<i32>>>> {
        let n = count("n", n.0)?;
        if self.groups.is_hybrid() {
            let r = self.with_spaces(|c, a, o| c.alloc_i32_with(a, o, n));
            return match r {
                Ok(pages) => Ok(Some(PyArray1::from_vec(py, pages))),
                Err(RadixError::Page(AllocError::OutOfPages { .. })) => Ok(None),
                Err(e) => Err(to_py(e)),
            };
        }
        let mut c = guard(&self.cache);
        match c.alloc_i32(&mut guard(&self.alloc), n) {
            Ok(pages) => Ok(Some(PyArray1::from_vec(py, pages))),
            Err(RadixError::Page(AllocError::OutOfPages { .. })) => Ok(None),
            Err(e) => Err(to_py(e)),
        }
    }

    fn reset(&self) -> PyResult<()> {
        if self.groups.is_hybrid() {
            return self
                .with_spaces(|c, a, o| c.reset_with(a, o))
                .map_err(to_py);
        }
        let mut c = guard(&self.cache);
        c.reset(&mut guard(&self.alloc)).map_err(to_py)
    }

    fn check_invariants(&self) -> PyResult<()> {
        if self.groups.is_hybrid() {
            let r = self.with_spaces(|c, a, o| c.check_invariants_with(a, o));
            return r.map_err(to_py);
        }
        let c = guard(&self.cache);
        c.check_invariants(&guard(&self.alloc)).map_err(to_py)
    }

    #[pyo3(signature = (namespace=None))]
    fn leaf_paths<'py>(
        &self,
        py: Python<'py>,
        namespace: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Vec<PathPair<'py>>> {
        let ns = self::namespace(namespace)?;
        let paths = guard(&self.cache).leaf_paths(&ns);
        Ok(paths
            .into_iter()
            .map(|(t, p)| (PyArray1::from_vec(py, t), page_array(py, &p)))
            .collect())
    }

    #[getter]
    fn allocator(&self, py: Python<'_>) -> Py<PyPageAllocator> {
        self.allocator.clone_ref(py)
    }
    #[getter]
    fn page_size(&self) -> usize {
        guard(&self.cache).page_size()
    }
    #[getter]
    fn evictable_size(&self) -> usize {
        guard(&self.cache).evictable_size()
    }
    #[getter]
    fn protected_size(&self) -> usize {
        guard(&self.cache).protected_size()
    }
    #[getter]
    fn total_size(&self) -> usize {
        guard(&self.cache).total_size()
    }
    #[getter]
    fn hit_tokens(&self) -> u64 {
        guard(&self.cache).hit_tokens()
    }
    #[getter]
    fn miss_tokens(&self) -> u64 {
        guard(&self.cache).miss_tokens()
    }
    #[getter]
    fn num_nodes(&self) -> usize {
        guard(&self.cache).num_nodes()
    }

    // --- hybrid models (see `radix_groups.rs`) ---

    #[pyo3(signature = (tokens, namespace=None))]
    fn match_prefix_groups<'py>(
        &self,
        py: Python<'py>,
        tokens: &Bound<'py, PyAny>,
        namespace: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<groups::GroupMatchTuple<'py>> {
        self.match_groups(py, tokens, namespace)
    }

    fn alloc_sliding<'py>(
        &self,
        py: Python<'py>,
        group: Int,
        n: Int,
    ) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let g = count("group", group.0)?;
        self.alloc_group(py, Some(g), n)
    }

    fn alloc_state_slots<'py>(
        &self,
        py: Python<'py>,
        n: Int,
    ) -> PyResult<Bound<'py, PyArray1<i32>>> {
        self.alloc_group(py, None, n)
    }

    #[pyo3(signature = (namespace=None))]
    fn leaf_paths_groups<'py>(
        &self,
        py: Python<'py>,
        namespace: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Vec<groups::GroupPathTuple<'py>>> {
        self.paths_groups(py, namespace)
    }

    #[getter]
    fn sliding(&self, py: Python<'_>) -> Vec<(Py<PyPageAllocator>, usize)> {
        self.sliding_objs(py)
    }
    #[getter]
    fn state_slots(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        self.state_obj(py)
    }
    #[getter]
    fn has_state_slots(&self) -> bool {
        guard(&self.cache).has_state_slots()
    }

    fn __repr__(&self) -> String {
        let c = guard(&self.cache);
        format!(
            "RadixCache(page_size={}, total_size={}, protected_size={})",
            c.page_size(),
            c.total_size(),
            c.protected_size()
        )
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyRadixNode>()?;
    m.add_class::<PyRadixCache>()
}
