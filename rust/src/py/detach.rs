//! Input and output arrays of long calls, handled with the GIL released (issue 18).
//!
//! A long call (`DETACH_MIN` elements or more) holds the GIL only for O(1) work: taking a view
//! of the numpy argument (dtype, contiguity, a shared borrow), making the result array from a Rust
//! `Vec` it owns (no copy), and building its small Python results. What grows with the input runs
//! in the call's detached closure: the check of the ids (negative tokens, int64 narrowing), the
//! copy of ids the call validates and then applies, the result's allocation and page faults.
//!
//! The contract this needs: a caller does not write an array argument from another thread while
//! the call runs (the call reads it in place, or copies it, with the GIL released: such a write
//! is a data race). numpy keeps the buffer in place while the call holds its reference. Ids the
//! call checks and then applies (pages, slots, inserted tokens) are copied first, so a racing
//! write cannot make them differ between the check and the change.

use std::borrow::Cow;
use std::cell::RefCell;

use super::alloc::DETACH_MIN;
use crate::alloc::{self, try_vec, AllocError};
use crate::radix::{self, RadixError};

/// Int64 tokens narrowed into a thread's scratch buffer are kept up to this many (16 MiB).
const SCRATCH_KEEP: usize = 1 << 22;

thread_local! {
    static SCRATCH: RefCell<Vec<i32>> = const { RefCell::new(Vec::new()) };
}

/// The error of int64 tokens that are not all int32 ids (checked branch-free first).
fn narrow_err(s: &[i64]) -> Option<RadixError> {
    let fits = |v: i64| (0..=i64::from(i32::MAX)).contains(&v);
    if s.iter().fold(true, |ok, &v| ok & fits(v)) {
        return None;
    }
    radix::narrow_tokens(s).err()
}

/// A 1-D integer argument's values, borrowed from numpy (or from the short copy `Ints` took),
/// readable with the GIL released (`Send`). Made by `Ints::view` with the GIL held (O(1)).
#[derive(Clone, Copy)]
pub(crate) struct View<'a> {
    data: Data<'a>,
    /// The values are the call's own copy (a short array), not numpy memory.
    own: bool,
}

#[derive(Clone, Copy)]
enum Data<'a> {
    I32(&'a [i32]),
    I64(&'a [i64]),
}

impl<'a> View<'a> {
    pub(crate) fn i32s(s: &'a [i32], own: bool) -> Self {
        Self {
            data: Data::I32(s),
            own,
        }
    }

    pub(crate) fn i64s(s: &'a [i64]) -> Self {
        Self {
            data: Data::I64(s),
            own: false,
        }
    }

    pub(crate) fn len(&self) -> usize {
        match self.data {
            Data::I32(s) => s.len(),
            Data::I64(s) => s.len(),
        }
    }

    /// Whether a call on this many elements runs with the GIL released.
    pub(crate) fn long(&self) -> bool {
        self.len() >= DETACH_MIN
    }

    /// Runs `f` on the token ids as int32, none negative: int32 input in place, int64 input
    /// narrowed into this thread's scratch buffer, kept between calls (up to [`SCRATCH_KEEP`]
    /// ids). A fresh buffer per call would be faulted in each time, and returning it to the OS
    /// (glibc trims the heap top) fell on the caller's free of the result, with the GIL held:
    /// 3-12 ms at 4M tokens.
    ///
    /// # Errors
    /// [`RadixError::TokenOutOfRange`] naming the first bad value; [`AllocError::NoMemory`].
    pub(crate) fn with_tokens<R>(self, f: impl FnOnce(&[i32]) -> R) -> Result<R, RadixError> {
        let s = match self.data {
            Data::I32(s) => {
                radix::check_tokens(s)?;
                return Ok(f(s));
            }
            Data::I64(s) => s,
        };
        if let Some(e) = narrow_err(s) {
            return Err(e);
        }
        let narrow = |v: &mut Vec<i32>| -> Result<(), AllocError> {
            v.clear();
            v.try_reserve_exact(s.len())
                .map_err(|_| AllocError::NoMemory {
                    what: format!("int32 copies of {} int64 tokens", s.len()),
                    bytes: 4 * s.len() as u64,
                })?;
            v.extend(s.iter().map(|&t| t as i32));
            Ok(())
        };
        SCRATCH.with(|cell| match cell.try_borrow_mut() {
            Ok(mut v) => {
                narrow(&mut v)?;
                let r = f(&v);
                if v.capacity() > SCRATCH_KEEP {
                    *v = Vec::new();
                }
                Ok(r)
            }
            // (not reentered in practice: no Python code runs in `f`)
            Err(_) => {
                let mut v = Vec::new();
                narrow(&mut v)?;
                Ok(f(&v))
            }
        })
    }

    /// As [`View::with_tokens`], but never numpy memory: the ids stay as checked while the call
    /// applies them.
    ///
    /// # Errors
    /// As [`View::with_tokens`]; [`AllocError::NoMemory`] for a copy that cannot be allocated.
    pub(crate) fn tokens_stable(self) -> Result<Cow<'a, [i32]>, RadixError> {
        match self.data {
            Data::I32(s) => {
                let t = self.own_i32(s)?;
                radix::check_tokens(&t)?;
                Ok(t)
            }
            Data::I64(s) => radix::narrow_tokens(s).map(Cow::Owned),
        }
    }

    /// Page ids as int32 (int64 input narrowed), never numpy memory: a call validates them and
    /// then applies them, so they must not change in between.
    ///
    /// # Errors
    /// [`AllocError::OutOfRange`] for an int64 id beyond int32; [`AllocError::NoMemory`].
    pub(crate) fn pages_stable(self) -> Result<Cow<'a, [i32]>, AllocError> {
        match self.data {
            Data::I32(s) => self.own_i32(s),
            Data::I64(s) => alloc::narrow_pages(s).map(Cow::Owned),
        }
    }

    /// `s` (this view's int32 values) as the call's own: a copy unless it is one already.
    fn own_i32(self, s: &'a [i32]) -> Result<Cow<'a, [i32]>, AllocError> {
        if self.own {
            return Ok(Cow::Borrowed(s));
        }
        let mut v = try_vec(s.len(), || format!("a copy of {} ids", s.len()))?;
        v.extend_from_slice(s);
        Ok(Cow::Owned(v))
    }
}
