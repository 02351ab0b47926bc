//! Namespaces from Python values: the tag-encoded key (`radix::Namespace`) of `RadixCache`'s
//! trees and of `page_hashes`, from None, int, str, bytes or (nested) tuples of those.

use std::borrow::Cow;
use std::sync::OnceLock;

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{IntoPyDict, PyBytes, PyInt, PyString, PyTuple};

use super::error::InvalidArgumentError;
use crate::radix::{Namespace, NamespaceBuilder};

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
    } else if let Some(i) = index(obj)? {
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

/// `obj.__index__()` (numpy integers), `None` for an object that is no integer (no `__index__`,
/// or one raising TypeError); any other exception of `__index__` (KeyboardInterrupt included)
/// propagates.
fn index<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Option<Bound<'py, PyInt>>> {
    let py = obj.py();
    let Ok(f) = obj.get_type().getattr("__index__") else {
        return Ok(None);
    };
    match f.call1((obj,)) {
        Ok(v) => Ok(v.cast_into::<PyInt>().ok()),
        Err(e) if e.is_instance_of::<PyTypeError>(py) => Ok(None),
        Err(e) => Err(e),
    }
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
pub(crate) fn namespace(obj: Option<&Bound<'_, PyAny>>) -> PyResult<Cow<'static, Namespace>> {
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
