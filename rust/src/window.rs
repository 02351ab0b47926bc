//! Sliding-window page recycling: the pages of a sliding page space that no query reads again go
//! back to the free list, for a whole batch in one call.
//!
//! A sliding-window layer's query at position `p` reads positions `p - window + 1 ..= p` (the
//! attention kernels never read before the window). A request of `seq` tokens, `seq` counting the
//! tokens of the current step, has its last query at `seq - 1`, which reads `seq - window ..
//! seq - 1`; a speculative step that may roll back `d` draft tokens can resume from `seq - d`,
//! whose queries read from `seq - d - window + 1`. So after [`release_window_pages`] a request
//! holds exactly the pages that intersect positions `[max(0, seq - window - d), seq - 1]`: at most
//! `ceil(min(seq, window + d) / page_size) + 1` pages (`+ 0` when `page_size == 1`), the count the
//! sizing plan reserves per request. Released entries of the page table become the padding page
//! `0`, so the table keeps its meaning for the kernels (entries before the window are never read).
//!
//! Cost: `first_live[i]`, the first page-table entry request `i` may still hold, moves forward
//! monotonically; a call looks only at the entries between it and the new window start, so a
//! whole decode run costs O(B per step + pages released), not O(sequence length).
//!
//! ```
//! use kvpool::alloc::PageAllocator;
//! use kvpool::window::release_window_pages;
//! let mut a = PageAllocator::new(8, 4).unwrap();
//! let pages = a.alloc_i32(3).unwrap(); // 10 tokens on pages 1, 2, 3
//! let mut table = pages.clone();
//! let mut first_live = vec![0];
//! // window 4: positions 6..=9 are kept, on pages 2 and 3; page 1 (positions 0..=3) goes.
//! let n = release_window_pages(&mut a, &mut table, 3, &[10], 4, 0, Some(&mut first_live)).unwrap();
//! assert_eq!((n, table, first_live, a.num_used()), (1, vec![0, 2, 3], vec![1], 2));
//! ```

use crate::alloc::{AllocError, PageAllocator};
use crate::batch::{check_seq_lens, check_width, BatchError};

/// The page-table entries before which request `seq` holds nothing after the call: the entry of
/// position `max(0, seq - window - draft)`.
pub fn first_kept_entry(seq: i64, window: usize, draft: usize, page_size: usize) -> usize {
    let lo = (seq as i128 - window as i128 - draft as i128).max(0);
    (lo / page_size as i128) as usize
}

/// Releases, for every request of a batch, the pages of a sliding page space that lie wholly
/// before position `seq_lens[i] - window - num_draft_tokens`, and writes the padding page into
/// their page-table entries. Returns the number of references dropped (one per released entry).
///
/// `table` is `[B, max_pages]` row-major; `seq_lens[i]` is request `i`'s length after the current
/// step (draft tokens included). With `first_live`, entries before `first_live[i]` are taken as
/// released already and `first_live[i]` is advanced; without it every entry from 0 is looked at.
/// Entries holding the padding page are skipped (released before). A page listed in several rows
/// (shared) drops one reference per entry.
///
/// # Errors
/// [`BatchError`] for a bad length, negative or too long `seq_lens`, a request whose pages do not
/// fit in `max_pages` columns, `window == 0`, or `first_live[i]` outside `0..=max_pages`;
/// [`BatchError::Page`] naming the entry when a page to release is out of range, free, held only
/// by a prefix cache, or listed more often than it has holders. Nothing changes on error.
pub fn release_window_pages(
    alloc: &mut PageAllocator,
    table: &mut [i32],
    max_pages: usize,
    seq_lens: &[i64],
    window: usize,
    num_draft_tokens: usize,
    mut first_live: Option<&mut [i32]>,
) -> Result<usize, BatchError> {
    let (b, ps) = (seq_lens.len(), alloc.page_size());
    if window == 0 {
        return Err(BatchError::ZeroWindow);
    }
    if table.len() != b * max_pages {
        return Err(BatchError::Length {
            what: "page_table",
            expected: b * max_pages,
            got: table.len(),
        });
    }
    if let Some(f) = first_live.as_deref() {
        if f.len() != b {
            return Err(BatchError::Length {
                what: "first_live",
                expected: b,
                got: f.len(),
            });
        }
        if let Some((index, &value)) = f
            .iter()
            .enumerate()
            .find(|(_, &v)| v < 0 || v as usize > max_pages)
        {
            return Err(BatchError::FirstLive {
                index,
                value,
                max_pages,
            });
        }
    }
    check_seq_lens(seq_lens)?;
    check_width(None, seq_lens, max_pages, ps)?;
    // Gather what goes (with where it sits, for the error), validate it all, then apply.
    let mut gone: Vec<i32> = Vec::new();
    let mut ranges: Vec<(usize, usize)> = Vec::with_capacity(b);
    for (i, &s) in seq_lens.iter().enumerate() {
        let start = first_live.as_deref().map_or(0, |f| f[i] as usize);
        let end = first_kept_entry(s, window, num_draft_tokens, ps).min(max_pages);
        let row = &table[i * max_pages..(i + 1) * max_pages];
        if start < end {
            gone.extend(row[start..end].iter().copied().filter(|&p| p != 0));
        }
        ranges.push((start, end.max(start)));
    }
    if let Err(e) = alloc.free_counted(&gone) {
        return Err(locate(table, max_pages, &ranges, e));
    }
    for (i, &(start, end)) in ranges.iter().enumerate() {
        table[i * max_pages + start..i * max_pages + end].fill(0);
        if let Some(f) = first_live.as_deref_mut() {
            f[i] = end as i32;
        }
    }
    Ok(gone.len())
}

/// The page a refused release names, and the first entry that holds it (error path only).
#[cold]
fn locate(table: &[i32], max_pages: usize, ranges: &[(usize, usize)], e: AllocError) -> BatchError {
    let inner = match &e {
        AllocError::InStateSlots(inner) => inner.as_ref(),
        e => e,
    };
    let page = match *inner {
        AllocError::OutOfRange { page, .. } => page,
        AllocError::NotAllocated { page }
        | AllocError::OnlyCached { page }
        | AllocError::OverReleased { page, .. } => i64::from(page),
        _ => 0,
    };
    for (index, &(start, end)) in ranges.iter().enumerate() {
        let row = &table[index * max_pages..(index + 1) * max_pages];
        if let Some(k) = (start..end).find(|&k| i64::from(row[k]) == page) {
            return BatchError::Page {
                index,
                entry: k,
                source: e,
            };
        }
    }
    BatchError::Page {
        index: 0,
        entry: 0,
        source: e,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bound the sizing plan counts per request and sliding group.
    fn bound(n: usize, w: usize, d: usize, ps: usize) -> usize {
        n.min(w + d).div_ceil(ps) + usize::from(ps > 1)
    }

    #[test]
    fn decode_run_holds_at_most_the_window_and_leaks_nothing() {
        // One request decoding token by token, page sizes 1..5, windows 1..9, drafts 0..2.
        for ps in 1..=5usize {
            for w in 1..=9usize {
                for d in 0..=2usize {
                    let mut a = PageAllocator::new(64, ps as u64).unwrap();
                    let max_pages = 40usize;
                    let mut table = vec![0i32; max_pages];
                    let mut fl = vec![0i32];
                    for s in 1..=(max_pages * ps) as i64 {
                        let e = (s as usize - 1) / ps;
                        if table[e] == 0 && (s as usize - 1).is_multiple_of(ps) {
                            table[e] = a.alloc_i32(1).unwrap()[0];
                        }
                        release_window_pages(
                            &mut a,
                            &mut table,
                            max_pages,
                            &[s],
                            w,
                            d,
                            Some(&mut fl),
                        )
                        .unwrap();
                        let held = table.iter().filter(|&&p| p != 0).count();
                        assert!(
                            held <= bound(s as usize, w, d, ps),
                            "ps {ps} w {w} d {d} s {s}"
                        );
                        assert_eq!(held, a.num_used(), "no page leaked");
                        // Exactly the pages that intersect the kept positions.
                        let lo = (s as usize).saturating_sub(w + d) / ps;
                        let hi = (s as usize - 1) / ps;
                        assert_eq!(held, hi - lo + 1);
                    }
                }
            }
        }
    }

    #[test]
    fn errors_name_the_entry_and_change_nothing() {
        let mut a = PageAllocator::new(8, 2).unwrap();
        let p = a.alloc_i32(3).unwrap();
        // Row 1 holds page 6, which is free.
        let mut table = vec![p[0], p[1], p[2], 0, 6, 0];
        let mut fl = vec![0, 0];
        let before = (table.clone(), a.ref_counts());
        let err =
            release_window_pages(&mut a, &mut table, 3, &[6, 6], 2, 0, Some(&mut fl)).unwrap_err();
        assert_eq!(
            err,
            BatchError::Page {
                index: 1,
                entry: 1,
                source: AllocError::NotAllocated { page: 6 }
            }
        );
        assert_eq!(
            (table.clone(), a.ref_counts(), fl.clone()),
            (before.0.clone(), before.1, vec![0, 0])
        );
        assert!(matches!(
            release_window_pages(&mut a, &mut table, 3, &[6], 2, 0, None),
            Err(BatchError::Length {
                what: "page_table",
                ..
            })
        ));
        assert!(matches!(
            release_window_pages(&mut a, &mut table, 3, &[6, 6], 0, 0, None),
            Err(BatchError::ZeroWindow)
        ));
        assert!(matches!(
            release_window_pages(&mut a, &mut table, 3, &[6, 6], 2, 0, Some(&mut [0, 4])),
            Err(BatchError::FirstLive {
                index: 1,
                value: 4,
                ..
            })
        ));
        assert!(matches!(
            release_window_pages(&mut a, &mut table, 3, &[7, 0], 2, 0, None),
            Err(BatchError::TooManyPages { .. })
        ));
        // A page shared by two rows drops two references; listed more often than held: refused.
        let mut table = vec![p[0], p[1], 0, p[0], p[2], 0];
        let err = release_window_pages(&mut a, &mut table, 3, &[4, 4], 2, 0, None).unwrap_err();
        assert!(
            matches!(
                err,
                BatchError::Page {
                    index: 0,
                    entry: 0,
                    ..
                }
            ),
            "{err:?}"
        );
        a.inc_ref(&p[..1]).unwrap();
        assert_eq!(
            release_window_pages(&mut a, &mut table, 3, &[4, 4], 2, 0, None).unwrap(),
            2
        );
        assert_eq!(table, vec![0, p[1], 0, 0, p[2], 0]);
        assert_eq!(a.num_used(), 2);
    }
}
