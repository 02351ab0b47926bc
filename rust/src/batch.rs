//! Batch helpers for a forward step: the `[B, max_pages]` page table and the slot indices of new
//! tokens (slot = page * page_size + offset), over the whole batch at once.
//!
//! A request of `seq` tokens uses pages `0..ceil(seq / page_size)` of its row; token `t` lives in
//! row entry `t / page_size` at offset `t % page_size`. Extending a request from `prefix` to `seq`
//! tokens therefore fills the last partial page first, then the pages from entry
//! `ceil(prefix / page_size)` on ([`pages_needed`] of them, placed by [`assign_pages`]); this is
//! what engines call alloc_extend, and alloc_decode is the case `seq = prefix + 1`. Unused row
//! entries hold [`PADDING_PAGE`].
//!
//! Every function validates the whole batch before writing, so on error the output is untouched.
//!
//! ```
//! use kvpool::batch::{assign_pages, extend_slots, pages_needed};
//! // Two requests, page_size 4: one goes from 3 to 6 tokens, one is new with 2 tokens.
//! let (prefix, seq) = ([3i64, 0], [6i64, 2]);
//! assert_eq!(pages_needed(&prefix, &seq, 4).unwrap(), vec![1, 1]);
//! let mut table = vec![7, 0, 0, 0]; // [B=2, max_pages=2]; request 0 holds page 7
//! assign_pages(&mut table, 2, &prefix, &seq, &[8, 9], 4).unwrap();
//! assert_eq!(table, vec![7, 8, 9, 0]);
//! let mut slots = vec![0; 5];
//! extend_slots(&table, 2, &prefix, &seq, 4, &mut slots).unwrap();
//! assert_eq!(slots, vec![31, 32, 33, 36, 37]); // 7*4+3, then page 8; page 9 from offset 0
//! ```

use crate::layout::PADDING_PAGE;

mod grow;
mod rollback;
pub use grow::{append_pages, rows_short};
pub use rollback::rollback_slots;

/// Errors of the `batch` room.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BatchError {
    #[error("`page_size` must be at least 1, got 0")]
    ZeroPageSize,
    #[error("`{what}` has {got} entries, expected {expected}")]
    Length {
        what: &'static str,
        expected: usize,
        got: usize,
    },
    #[error("`{what}[{index}]` is negative: `{value}`")]
    Negative {
        what: &'static str,
        index: usize,
        value: i64,
    },
    #[error("`seq_lens[{index}]` = {value}: a decode step needs at least one token (its own)")]
    EmptyDecode { index: usize, value: i64 },
    #[error("`seq_lens[{index}]` = {value}: more tokens than int32 slot indices address (at most 2147483647)")]
    TooLong { index: usize, value: i64 },
    #[error("`new_pages[{index}]` = {value}: page ids start at 1 (page 0 is the padding page)")]
    PaddingPage { index: usize, value: i32 },
    #[error("request {index}: `seq_lens` {seq} is below `prefix_lens` {prefix}")]
    SeqBeforePrefix { index: usize, prefix: i64, seq: i64 },
    #[error("request {index} needs {pages} pages, but the page table has `max_pages` = {max_pages} columns")]
    TooManyPages {
        index: usize,
        pages: usize,
        max_pages: usize,
    },
    #[error("request {index}: token {position} falls in page-table entry {entry}, which holds page `{page}` (padding or invalid): assign its pages first")]
    MissingPage {
        index: usize,
        position: i64,
        entry: usize,
        page: i32,
    },
    #[error("`window` must be at least 1 token, got 0")]
    ZeroWindow,
    #[error("`first_live[{index}]` = {value} is outside 0..={max_pages} (page-table entries)")]
    FirstLive {
        index: usize,
        value: i32,
        max_pages: usize,
    },
    #[error("`page_table[{index}, {entry}]`: {source}")]
    Page {
        index: usize,
        entry: usize,
        source: crate::alloc::AllocError,
    },
    #[error("request {index}: slot of token {position} (page `{page}`) exceeds the int32 range")]
    SlotOverflow {
        index: usize,
        position: i64,
        page: i32,
    },
    #[error("`accepted_lens[{index}]` = {accepted} exceeds `seq_lens[{index}]` = {seq}: a rollback keeps at most the tokens written")]
    AcceptedBeyondSeq { index: usize, accepted: i64, seq: i64 },
    #[error("`accepted_lens[{index}]` = {accepted} is below `cached_lens[{index}]` = {cached}: the tree may hold those tokens' pages, a rollback never reaches into them")]
    BelowCached { index: usize, accepted: i64, cached: i64 },
    #[error("`page_table[{index}, {entry}]` = `{page}` (padding or invalid) is among the entries to free: request {index} holds no page there")]
    NoPageToFree { index: usize, entry: usize, page: i32 },
}

/// Refuses a negative length and one past the int32 slot range (what a `seq_lens` entry may be
/// in every room that reads page tables).
///
/// # Errors
/// [`BatchError::Negative`], [`BatchError::TooLong`], naming the first bad entry.
pub(crate) fn check_seq_lens(seq: &[i64]) -> Result<(), BatchError> {
    for (index, &s) in seq.iter().enumerate() {
        if s < 0 {
            return Err(BatchError::Negative {
                what: "seq_lens",
                index,
                value: s,
            });
        }
        if s > i64::from(i32::MAX) {
            return Err(BatchError::TooLong { index, value: s });
        }
    }
    Ok(())
}

fn check_lens(prefix: &[i64], seq: &[i64]) -> Result<(), BatchError> {
    if prefix.len() != seq.len() {
        return Err(BatchError::Length {
            what: "prefix_lens",
            expected: seq.len(),
            got: prefix.len(),
        });
    }
    for (index, (&p, &s)) in prefix.iter().zip(seq).enumerate() {
        if p < 0 {
            return Err(BatchError::Negative {
                what: "prefix_lens",
                index,
                value: p,
            });
        }
        if s < p {
            return Err(BatchError::SeqBeforePrefix {
                index,
                prefix: p,
                seq: s,
            });
        }
        // Slots are int32, so no request can address more tokens; the page counts and token
        // sums below then fit their types (int32 pages, a usize total).
        if s > i64::from(i32::MAX) {
            return Err(BatchError::TooLong { index, value: s });
        }
    }
    Ok(())
}

/// Refuses a request whose `seq` tokens need more than `max_pages` page-table entries; with
/// `prefix`, only requests that grow (`seq > prefix`: the others read no entry).
///
/// # Errors
/// [`BatchError::TooManyPages`] naming the first such request.
pub fn check_width(
    prefix: Option<&[i64]>,
    seq: &[i64],
    max_pages: usize,
    page_size: usize,
) -> Result<(), BatchError> {
    for (index, &s) in seq.iter().enumerate() {
        if prefix.is_some_and(|p| p.get(index).is_some_and(|&p| p >= s)) {
            continue;
        }
        let pages = pages_for(s.max(0), page_size.max(1));
        if pages > max_pages {
            return Err(BatchError::TooManyPages {
                index,
                pages,
                max_pages,
            });
        }
    }
    Ok(())
}

fn pages_for(tokens: i64, ps: usize) -> usize {
    (tokens as u64).div_ceil(ps as u64) as usize
}

/// Fills `out` (`[rows.len(), max_pages]`, row-major) with each request's pages, padded with
/// [`PADDING_PAGE`].
///
/// # Errors
/// [`BatchError::Length`] when `out` has the wrong size, [`BatchError::TooManyPages`],
/// [`BatchError::Negative`] for a negative page id.
pub fn page_table(rows: &[&[i32]], max_pages: usize, out: &mut [i32]) -> Result<(), BatchError> {
    let expected = rows.len() * max_pages;
    if out.len() != expected {
        return Err(BatchError::Length {
            what: "out",
            expected,
            got: out.len(),
        });
    }
    for (index, row) in rows.iter().enumerate() {
        if row.len() > max_pages {
            return Err(BatchError::TooManyPages {
                index,
                pages: row.len(),
                max_pages,
            });
        }
        if let Some(&p) = row.iter().find(|&&p| p < 0) {
            return Err(BatchError::Negative {
                what: "pages",
                index,
                value: i64::from(p),
            });
        }
    }
    for (row, dst) in rows.iter().zip(out.chunks_exact_mut(max_pages.max(1))) {
        dst[..row.len()].copy_from_slice(row);
        dst[row.len()..].fill(PADDING_PAGE as i32);
    }
    Ok(())
}

/// New pages each request needs to grow from `prefix` to `seq` tokens:
/// `ceil(seq / page_size) - ceil(prefix / page_size)`.
///
/// # Errors
/// [`BatchError::ZeroPageSize`], [`BatchError::Length`], [`BatchError::Negative`],
/// [`BatchError::SeqBeforePrefix`].
pub fn pages_needed(prefix: &[i64], seq: &[i64], page_size: usize) -> Result<Vec<i32>, BatchError> {
    if page_size == 0 {
        return Err(BatchError::ZeroPageSize);
    }
    check_lens(prefix, seq)?;
    Ok(prefix
        .iter()
        .zip(seq)
        .map(|(&p, &s)| (pages_for(s, page_size) - pages_for(p, page_size)) as i32)
        .collect())
}

/// Writes `new_pages` (in batch order, [`pages_needed`] per request) into the page-table entries
/// `ceil(prefix / page_size) .. ceil(seq / page_size)` of each row of `table` (`[B, max_pages]`).
///
/// # Errors
/// As [`pages_needed`], plus [`BatchError::Length`] when `table` or `new_pages` has the wrong
/// size and [`BatchError::TooManyPages`] when a row is too short.
pub fn assign_pages(
    table: &mut [i32],
    max_pages: usize,
    prefix: &[i64],
    seq: &[i64],
    new_pages: &[i32],
    page_size: usize,
) -> Result<(), BatchError> {
    let needed = pages_needed(prefix, seq, page_size)?;
    let expected = seq.len() * max_pages;
    if table.len() != expected {
        return Err(BatchError::Length {
            what: "page_table",
            expected,
            got: table.len(),
        });
    }
    let total: usize = needed.iter().map(|&n| n as usize).sum();
    if new_pages.len() != total {
        return Err(BatchError::Length {
            what: "new_pages",
            expected: total,
            got: new_pages.len(),
        });
    }
    check_width(None, seq, max_pages, page_size)?;
    // (a negative id or the padding page would read as a hole or garbage later)
    if let Some((index, &value)) = new_pages
        .iter()
        .enumerate()
        .find(|(_, &p)| p <= PADDING_PAGE as i32)
    {
        return Err(BatchError::PaddingPage { index, value });
    }
    let mut next = 0;
    for (index, &n) in needed.iter().enumerate() {
        let start = index * max_pages + pages_for(prefix[index], page_size);
        let n = n as usize;
        table[start..start + n].copy_from_slice(&new_pages[next..next + n]);
        next += n;
    }
    Ok(())
}

fn slot(
    table: &[i32],
    max_pages: usize,
    index: usize,
    pos: i64,
    ps: usize,
) -> Result<i32, BatchError> {
    let entry = (pos as u64 / ps as u64) as usize;
    if entry >= max_pages {
        return Err(BatchError::TooManyPages {
            index,
            pages: entry + 1,
            max_pages,
        });
    }
    let page = table[index * max_pages + entry];
    if page <= PADDING_PAGE as i32 {
        return Err(BatchError::MissingPage {
            index,
            position: pos,
            entry,
            page,
        });
    }
    let s = i64::from(page) * ps as i64 + pos % ps as i64;
    i32::try_from(s).map_err(|_| BatchError::SlotOverflow {
        index,
        position: pos,
        page,
    })
}

/// Number of new tokens of an extend batch: `sum(seq - prefix)`.
///
/// # Errors
/// As [`pages_needed`]'s length checks.
pub fn num_new_tokens(prefix: &[i64], seq: &[i64]) -> Result<usize, BatchError> {
    check_lens(prefix, seq)?;
    Ok(prefix
        .iter()
        .zip(seq)
        .map(|(&p, &s)| (s - p) as usize)
        .sum())
}

/// Slot indices of tokens `prefix..seq` of every request, in batch order, into `out`
/// (length [`num_new_tokens`]).
///
/// # Errors
/// As [`pages_needed`], plus [`BatchError::Length`] (table or `out`), [`BatchError::MissingPage`]
/// when a needed entry holds the padding page, [`BatchError::SlotOverflow`].
pub fn extend_slots(
    table: &[i32],
    max_pages: usize,
    prefix: &[i64],
    seq: &[i64],
    page_size: usize,
    out: &mut [i32],
) -> Result<(), BatchError> {
    if page_size == 0 {
        return Err(BatchError::ZeroPageSize);
    }
    let total = num_new_tokens(prefix, seq)?;
    let expected = seq.len() * max_pages;
    if table.len() != expected {
        return Err(BatchError::Length {
            what: "page_table",
            expected,
            got: table.len(),
        });
    }
    if out.len() != total {
        return Err(BatchError::Length {
            what: "out",
            expected: total,
            got: out.len(),
        });
    }
    // Validate first (first and last token of each page touched), then write.
    for (index, (&p, &s)) in prefix.iter().zip(seq).enumerate() {
        let mut pos = p;
        while pos < s {
            slot(table, max_pages, index, pos, page_size)?;
            let page_end = (pos / page_size as i64 + 1) * page_size as i64;
            slot(table, max_pages, index, page_end.min(s) - 1, page_size)?;
            pos = page_end;
        }
    }
    let mut k = 0;
    for (index, (&p, &s)) in prefix.iter().zip(seq).enumerate() {
        for pos in p..s {
            out[k] = slot(table, max_pages, index, pos, page_size)?;
            k += 1;
        }
    }
    Ok(())
}

/// Slot of each request's last token (position `seq - 1`, the one a decode step writes) into
/// `out` (length B).
///
/// # Errors
/// [`BatchError::EmptyDecode`] for `seq < 1`, and as [`extend_slots`].
pub fn decode_slots(
    table: &[i32],
    max_pages: usize,
    seq: &[i64],
    page_size: usize,
    out: &mut [i32],
) -> Result<(), BatchError> {
    if page_size == 0 {
        return Err(BatchError::ZeroPageSize);
    }
    let expected = seq.len() * max_pages;
    if table.len() != expected {
        return Err(BatchError::Length {
            what: "page_table",
            expected,
            got: table.len(),
        });
    }
    if out.len() != seq.len() {
        return Err(BatchError::Length {
            what: "out",
            expected: seq.len(),
            got: out.len(),
        });
    }
    for (index, &s) in seq.iter().enumerate() {
        if s < 1 {
            return Err(BatchError::EmptyDecode { index, value: s });
        }
        slot(table, max_pages, index, s - 1, page_size)?;
    }
    for (index, &s) in seq.iter().enumerate() {
        out[index] = slot(table, max_pages, index, s - 1, page_size)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_table_pads_and_checks_width() {
        let mut out = vec![-1; 6];
        page_table(&[&[3, 4], &[], &[5]], 2, &mut out).unwrap();
        assert_eq!(out, vec![3, 4, 0, 0, 5, 0]);
        assert!(matches!(
            page_table(&[&[1, 2, 3]], 2, &mut [0; 2]),
            Err(BatchError::TooManyPages { index: 0, .. })
        ));
        assert!(matches!(
            page_table(&[&[1]], 2, &mut [0; 3]),
            Err(BatchError::Length { .. })
        ));
        let mut empty: [i32; 0] = [];
        page_table(&[&[], &[]], 0, &mut empty).unwrap();
    }

    #[test]
    fn extend_fills_the_partial_page_first() {
        // page_size 16: 20 cached tokens on pages [5, 6]; grow to 40 -> one new page (9).
        let ps = 16;
        let (prefix, seq) = ([20i64], [40i64]);
        assert_eq!(pages_needed(&prefix, &seq, ps).unwrap(), vec![1]);
        let mut table = vec![5, 6, 0, 0];
        assign_pages(&mut table, 4, &prefix, &seq, &[9], ps).unwrap();
        assert_eq!(table, vec![5, 6, 9, 0]);
        let mut out = vec![0; 20];
        extend_slots(&table, 4, &prefix, &seq, ps, &mut out).unwrap();
        let expect: Vec<i32> = (20..32)
            .map(|t| 6 * 16 + (t % 16))
            .chain((32..40).map(|t| 9 * 16 + (t % 16)))
            .collect();
        assert_eq!(out, expect);
        let mut d = vec![0];
        decode_slots(&table, 4, &[40], ps, &mut d).unwrap();
        assert_eq!(d, vec![9 * 16 + 7]);
    }

    #[test]
    fn errors_leave_outputs_untouched() {
        let table = vec![5, 0];
        let mut out = vec![-7; 3];
        let err = extend_slots(&table, 2, &[0], &[3], 2, &mut out).unwrap_err();
        assert_eq!(
            err,
            BatchError::MissingPage {
                index: 0,
                position: 2,
                entry: 1,
                page: 0
            }
        );
        assert_eq!(out, vec![-7; 3]);
        assert!(matches!(
            extend_slots(&table, 2, &[2], &[1], 2, &mut [0; 0]),
            Err(BatchError::SeqBeforePrefix { .. })
        ));
        assert!(matches!(
            pages_needed(&[-1], &[1], 2),
            Err(BatchError::Negative { .. })
        ));
        assert!(matches!(
            pages_needed(&[0], &[1, 2], 2),
            Err(BatchError::Length { .. })
        ));
        let mut t = vec![1, 0];
        assert!(matches!(
            assign_pages(&mut t, 2, &[0], &[5], &[1, 2, 3], 2),
            Err(BatchError::TooManyPages { .. })
        ));
        assert!(matches!(
            assign_pages(&mut t, 2, &[0], &[3], &[1], 2),
            Err(BatchError::Length {
                what: "new_pages",
                ..
            })
        ));
        assert_eq!(t, vec![1, 0]);
        assert!(matches!(
            decode_slots(&[1], 1, &[0], 1, &mut [0]),
            Err(BatchError::EmptyDecode { index: 0, value: 0 })
        ));
        assert!(matches!(
            extend_slots(&[i32::MAX], 1, &[0], &[1], 2, &mut [0]),
            Err(BatchError::SlotOverflow { .. })
        ));
    }
}
