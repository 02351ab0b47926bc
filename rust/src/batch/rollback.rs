//! Speculative-decoding rollback over a batch: the pages wholly past each request's accepted
//! length, and the new lengths.
//!
//! A verify step writes every draft token's KV; verification accepts a prefix of them. Request
//! `i` keeps positions `0..accepted[i]`, so its page-table entries
//! `ceil(accepted[i] / page_size) .. ceil(seq[i] / page_size)` hold only rejected tokens: those
//! pages go back to the allocator, and the page that holds the last accepted token stays (its
//! rejected tail is overwritten by the next step). Pages shared with the radix tree are never
//! among them as long as only committed tokens were inserted: the tree holds whole pages of
//! tokens before the request's committed length, and `accepted` is at least that length (pass it
//! as `cached` to have it checked).
//!
//! ```
//! use kvpool::batch::rollback_slots;
//! // page_size 4; request 0 wrote 10 tokens (3 pages) and keeps 5; request 1 keeps all 3.
//! let table = [11, 12, 13, 21, 0, 0];
//! let (free, lens) = rollback_slots(&table, 3, &[10, 3], &[5, 3], 4, None).unwrap();
//! assert_eq!((free, lens), (vec![13], vec![5, 3]));
//! ```

use super::{pages_for, BatchError};
use crate::layout::PADDING_PAGE;

/// `(pages_to_free, new_seq_lens)` of a rollback: the page ids of the entries
/// `ceil(accepted[i] / page_size) .. ceil(seq[i] / page_size)` of each row of `table`
/// (`[B, max_pages]` row-major), in batch order, and `accepted` as int32. `cached[i]`, when
/// given, is request `i`'s prefix the tree may hold (its committed length at the last insert):
/// a rollback below it is refused. Reads the table only.
///
/// # Errors
/// [`BatchError::ZeroPageSize`], [`BatchError::Length`], [`BatchError::Negative`],
/// [`BatchError::TooLong`], [`BatchError::AcceptedBeyondSeq`], [`BatchError::BelowCached`],
/// [`BatchError::TooManyPages`], [`BatchError::NoPageToFree`] for a padding (or negative) entry
/// among those to free. Nothing is returned then.
pub fn rollback_slots(
    table: &[i32],
    max_pages: usize,
    seq: &[i64],
    accepted: &[i64],
    page_size: usize,
    cached: Option<&[i64]>,
) -> Result<(Vec<i32>, Vec<i32>), BatchError> {
    if page_size == 0 {
        return Err(BatchError::ZeroPageSize);
    }
    let b = seq.len();
    for (what, v) in [("accepted_lens", Some(accepted)), ("cached_lens", cached)] {
        if let Some(v) = v.filter(|v| v.len() != b) {
            return Err(BatchError::Length {
                what,
                expected: b,
                got: v.len(),
            });
        }
    }
    // (saturating: no product of real lengths overflows, and a saturated one mismatches)
    let expected = b.saturating_mul(max_pages);
    if table.len() != expected {
        return Err(BatchError::Length {
            what: "page_table",
            expected,
            got: table.len(),
        });
    }
    // One pass per request: its checks, then its entries to free (the ranges are computed once;
    // on an error the partial list is dropped, and nothing else was touched).
    let mut free = Vec::new();
    let mut lens = Vec::with_capacity(b);
    for index in 0..b {
        let (s, a) = (seq[index], accepted[index]);
        let c = cached.map_or(0, |c| c[index]);
        for (what, value) in [("seq_lens", s), ("accepted_lens", a), ("cached_lens", c)] {
            if value < 0 {
                return Err(BatchError::Negative { what, index, value });
            }
        }
        if s > i64::from(i32::MAX) {
            return Err(BatchError::TooLong { index, value: s });
        }
        if a > s {
            return Err(BatchError::AcceptedBeyondSeq {
                index,
                accepted: a,
                seq: s,
            });
        }
        if c > a {
            return Err(BatchError::BelowCached {
                index,
                accepted: a,
                cached: c,
            });
        }
        let (lo, hi) = (pages_for(a, page_size), pages_for(s, page_size));
        if hi > max_pages {
            return Err(BatchError::TooManyPages {
                index,
                pages: hi,
                max_pages,
            });
        }
        // (in range: `table` has `b * max_pages` entries and `hi <= max_pages`)
        let row = &table[index * max_pages..index * max_pages + hi];
        if let Some(j) = (lo..hi).find(|&j| row[j] <= PADDING_PAGE as i32) {
            return Err(BatchError::NoPageToFree {
                index,
                entry: j,
                page: row[j],
            });
        }
        free.extend_from_slice(&row[lo..hi]);
        lens.push(a as i32); // (0 <= a <= s <= i32::MAX)
    }
    Ok((free, lens))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reference: every entry whose first position is at or past `accepted`.
    fn reference(table: &[i32], w: usize, seq: &[i64], acc: &[i64], ps: usize) -> Vec<i32> {
        let mut out = Vec::new();
        for i in 0..seq.len() {
            for j in 0..w {
                let first = (j * ps) as i64;
                if first >= acc[i] && first < seq[i] {
                    out.push(table[i * w + j]);
                }
            }
        }
        out
    }

    #[test]
    fn frees_exactly_the_pages_past_the_accepted_length() {
        for ps in 1..=5usize {
            for s in 0..12i64 {
                for a in 0..=s {
                    let w = 12;
                    let table: Vec<i32> = (0..2 * w as i32).map(|x| x + 1).collect();
                    let (seq, acc) = ([s, 12 - s], [a, 12 - s]);
                    let (free, lens) = rollback_slots(&table, w, &seq, &acc, ps, None).unwrap();
                    assert_eq!(
                        free,
                        reference(&table, w, &seq, &acc, ps),
                        "ps {ps} s {s} a {a}"
                    );
                    assert_eq!(lens, vec![a as i32, 12 - s as i32]);
                }
            }
        }
    }

    #[test]
    fn bad_input_names_the_value() {
        let t = [1, 2, 3, 0];
        let e = |r: Result<_, BatchError>| r.unwrap_err().to_string();
        let msg = e(rollback_slots(&t, 2, &[4, 1], &[5, 1], 2, None));
        assert!(
            msg.contains("`accepted_lens[0]` = 5") && msg.contains("`seq_lens[0]` = 4"),
            "{msg}"
        );
        let msg = e(rollback_slots(&t, 2, &[4, 1], &[2, -1], 2, None));
        assert!(
            msg.contains("`accepted_lens[1]` is negative: `-1`"),
            "{msg}"
        );
        let msg = e(rollback_slots(&t, 2, &[4, 1], &[2, 1], 2, Some(&[3, 0])));
        assert!(msg.contains("`cached_lens[0]` = 3"), "{msg}");
        let msg = e(rollback_slots(&t, 2, &[4, 4], &[2, 0], 2, None));
        assert!(
            msg.contains("page_table[1, 1]") && msg.contains("`0`"),
            "{msg}"
        );
        let msg = e(rollback_slots(&t, 2, &[5, 1], &[2, 1], 2, None));
        assert!(msg.contains("max_pages"), "{msg}");
        let msg = e(rollback_slots(&t, 2, &[4], &[2], 2, None));
        assert!(msg.contains("page_table"), "{msg}");
        assert_eq!(
            rollback_slots(&t, 2, &[4, 1], &[2, 1], 0, None),
            Err(BatchError::ZeroPageSize)
        );
    }

    #[test]
    fn the_first_bad_request_is_named_and_nothing_is_returned() {
        // Request 0 would free a padding entry, request 1 keeps more than it wrote: one pass
        // checks request by request, so request 0's error comes first.
        let t = [1, 0, 3, 4];
        assert_eq!(
            rollback_slots(&t, 2, &[4, 1], &[1, 2], 2, None),
            Err(BatchError::NoPageToFree {
                index: 0,
                entry: 1,
                page: 0
            })
        );
        // A good request 0 before a bad request 1: still an error, no partial list.
        assert_eq!(
            rollback_slots(&[1, 2, 3, 4], 2, &[4, 1], &[1, 2], 2, None),
            Err(BatchError::AcceptedBeyondSeq {
                index: 1,
                accepted: 2,
                seq: 1
            })
        );
        // An empty batch, and requests that keep everything: nothing to free.
        assert_eq!(
            rollback_slots(&[], 0, &[], &[], 4, None),
            Ok((vec![], vec![]))
        );
        assert_eq!(
            rollback_slots(&[1, 2, 3, 4], 2, &[3, 4], &[3, 4], 2, Some(&[2, 4])),
            Ok((vec![], vec![3, 4]))
        );
    }
}
