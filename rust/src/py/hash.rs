//! Bindings of `hash`: chained page hashes of a token sequence as a numpy uint64 array.

use numpy::PyArray1;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::array::{count, int_arg, ints, BadInt, Int};
use super::error::to_py;
use super::namespace::namespace as to_namespace;
use crate::hash;

/// A 64-bit unsigned argument (`seed`, `parent`): an int (or `__index__`) in `0 .. 2**64 - 1`,
/// not a bool ([`int_arg`]). ValueError naming `what` and the value.
pub(crate) fn u64_arg(what: &str, obj: &Bound<'_, PyAny>) -> PyResult<u64> {
    int_arg::<u64>(obj).map_err(|e| {
        let got = match e {
            BadInt::Range(text) => text,
            BadInt::Bool(_) | BadInt::NotInt(_) => {
                obj.repr().map(|r| r.to_string()).unwrap_or_default()
            }
        };
        PyValueError::new_err(format!(
            "`{what}` must be an int in 0 .. 2**64 - 1, got {got}"
        ))
    })
}

/// Chained 64-bit hashes of the whole pages of `tokens`: the keys KV events announce and a
/// shared page store is keyed by, equal in every process that uses the same `seed`.
///
/// Page `i`'s hash depends on the namespace, on every token up to the end of page `i` and on
/// `seed`; a partial last page has none. Definition (version 1), with XXH3-64 of the xxHash
/// specification: ``h[-1] = XXH3_64(seed, b"kvpool.page_hash.v1" + ns)`` and
/// ``h[i] = XXH3_64(seed, le_u64(h[i-1]) + le_i32(tokens[i*P:(i+1)*P]))``, where ``ns`` is the
/// namespace's tagged encoding (the one `RadixCache` keys its trees by) and ``P`` the page size.
/// Never Python's randomized `hash`.
///
/// Parameters
/// ----------
/// tokens : sequence of int or ndarray of int32/int64, shape [n]
///     Token ids (0 .. 2**31 - 1).
/// page_size : int
///     Tokens per page (>= 1).
/// seed : int
///     0 .. 2**64 - 1; every process that must agree on the keys uses the same seed.
/// namespace : None, int, str, bytes or tuple of those, optional
///     As for `RadixCache.insert`: equal tokens in different namespaces hash differently.
/// parent : int, optional
///     The hash of the page before `tokens[0]`, to continue a chain (then `namespace` is not
///     used); default: start a new chain.
///
/// Returns
/// -------
/// ndarray of uint64, shape [n // page_size]
///
/// Raises
/// ------
/// InvalidArgumentError
///     A token outside int32 or negative, `page_size` 0 or negative.
/// ValueError
///     `seed` or `parent` not an int in 0 .. 2**64 - 1.
///
/// Notes
/// -----
/// Releases the GIL for 16,384 tokens or more, reading `tokens` in place: no other thread may
/// write it during the call.
///
/// Examples
/// --------
/// >>> import kvpool
/// >>> h = kvpool.page_hashes([1, 2, 3, 4, 5], 2, seed=0)
/// >>> h.dtype, h.shape
/// (dtype('uint64'), (2,))
/// >>> bool(kvpool.page_hashes([3, 4], 2, seed=0, parent=int(h[0]))[0] == h[1])
/// True
#[pyfunction]
#[pyo3(signature = (tokens, page_size, *, seed, namespace=None, parent=None))]
fn page_hashes<'py>(
    py: Python<'py>,
    tokens: &Bound<'py, PyAny>,
    page_size: Int,
    seed: &Bound<'py, PyAny>,
    namespace: Option<&Bound<'py, PyAny>>,
    parent: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyArray1<u64>>> {
    let page_size = count("page_size", &page_size)?;
    if page_size == 0 {
        return Err(super::error::InvalidArgumentError::new_err(
            "`page_size` must be at least 1, got 0",
        ));
    }
    let seed = u64_arg("seed", seed)?;
    let parent = parent.map(|p| u64_arg("parent", p)).transpose()?;
    let ns = to_namespace(namespace)?;
    let arr = ints(tokens, "tokens")?;
    let view = arr.view("tokens")?;
    // (read in place and checked with the GIL released when long: see `detach.rs`)
    let run = || view.with_tokens(|t| hash::page_hashes(&ns, t, page_size, seed, parent));
    let out = if view.long() { py.detach(run) } else { run() };
    Ok(PyArray1::from_vec(py, out.map_err(to_py)?))
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(page_hashes, m)?)
}
