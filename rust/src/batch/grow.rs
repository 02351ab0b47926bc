//! A running decode batch's page table grown in place: the rows whose pages do not hold their
//! tokens, and the pages they gain written after their last ones (what
//! `kvpool.running.RunningBatch.grow` does every step, in one call instead of a dozen numpy
//! operations).

use super::{check_seq_lens, pages_for, BatchError, PADDING_PAGE};

/// `(row, pages short)` of every row whose `num_pages[row]` pages hold fewer than its
/// `seq_lens[row]` tokens: `ceil(seq / page_size) - num_pages` where that is positive, in row
/// order.
///
/// # Errors
/// [`BatchError::ZeroPageSize`]; [`BatchError::Length`] when `num_pages` and `seq` differ in
/// length; [`BatchError::Negative`] for a negative page count or length;
/// [`BatchError::TooLong`]; [`BatchError::TooManyPages`] when a row would need more than
/// `max_pages` entries.
pub fn rows_short(
    num_pages: &[i32],
    seq: &[i64],
    page_size: usize,
    max_pages: usize,
) -> Result<Vec<(usize, usize)>, BatchError> {
    if page_size == 0 {
        return Err(BatchError::ZeroPageSize);
    }
    if num_pages.len() != seq.len() {
        return Err(BatchError::Length {
            what: "num_pages",
            expected: seq.len(),
            got: num_pages.len(),
        });
    }
    check_seq_lens(seq)?;
    let mut short = Vec::new();
    for (index, (&have, &s)) in num_pages.iter().zip(seq).enumerate() {
        if have < 0 {
            return Err(BatchError::Negative {
                what: "num_pages",
                index,
                value: i64::from(have),
            });
        }
        let pages = pages_for(s, page_size);
        let have = have as usize;
        if pages > have {
            if pages > max_pages {
                return Err(BatchError::TooManyPages {
                    index,
                    pages,
                    max_pages,
                });
            }
            short.push((index, pages - have));
        }
    }
    Ok(short)
}

/// Writes `new_pages` (in the order of `short`, [`rows_short`]'s result) after each short row's
/// `num_pages[row]` pages in `table` (`[rows, max_pages]`, row-major) and adds them to
/// `num_pages`.
///
/// # Errors
/// [`BatchError::Length`] when `table` or `new_pages` has the wrong size;
/// [`BatchError::PaddingPage`] for a page id below 1; [`BatchError::TooManyPages`] when a row
/// would overflow its entries. Nothing is written on error.
pub fn append_pages(
    table: &mut [i32],
    max_pages: usize,
    num_pages: &mut [i32],
    short: &[(usize, usize)],
    new_pages: &[i32],
) -> Result<(), BatchError> {
    let expected = num_pages.len() * max_pages;
    if table.len() != expected {
        return Err(BatchError::Length {
            what: "page_table",
            expected,
            got: table.len(),
        });
    }
    let total: usize = short.iter().map(|&(_, n)| n).sum();
    if new_pages.len() != total {
        return Err(BatchError::Length {
            what: "new_pages",
            expected: total,
            got: new_pages.len(),
        });
    }
    if let Some((index, &value)) = new_pages
        .iter()
        .enumerate()
        .find(|(_, &p)| p <= PADDING_PAGE as i32)
    {
        return Err(BatchError::PaddingPage { index, value });
    }
    // every row checked (and its page count read once) before anything is written
    let mut at = Vec::with_capacity(short.len());
    for &(row, n) in short {
        let have = match num_pages.get(row) {
            None => {
                return Err(BatchError::Length {
                    what: "num_pages",
                    expected: row + 1,
                    got: num_pages.len(),
                })
            }
            Some(&h) => usize::try_from(h).map_err(|_| BatchError::Negative {
                what: "num_pages",
                index: row,
                value: i64::from(h),
            })?,
        };
        if have + n > max_pages {
            return Err(BatchError::TooManyPages {
                index: row,
                pages: have + n,
                max_pages,
            });
        }
        at.push(have);
    }
    let mut next = 0;
    for (&(row, n), have) in short.iter().zip(at) {
        let start = row * max_pages + have;
        table[start..start + n].copy_from_slice(&new_pages[next..next + n]);
        // (have + n <= max_pages, which fits an i32: a table row's width)
        num_pages[row] = (have + n) as i32;
        next += n;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_rows_gain_their_pages_after_their_last() {
        // rows: 16 tokens in 1 page (full, next token already counted: 17 needs 2), 5 in 1,
        // 33 in 2 (needs 3), 0 tokens in 0 pages
        let num = [1, 1, 2, 0];
        let seq = [17, 5, 33, 0];
        let short = rows_short(&num, &seq, 16, 4).unwrap();
        assert_eq!(short, vec![(0, 1), (2, 1)]);
        let mut table = vec![7, 0, 0, 0, 8, 0, 0, 0, 9, 10, 0, 0, 0, 0, 0, 0];
        let mut num = num;
        append_pages(&mut table, 4, &mut num, &short, &[21, 22]).unwrap();
        assert_eq!(
            table,
            vec![7, 21, 0, 0, 8, 0, 0, 0, 9, 10, 22, 0, 0, 0, 0, 0]
        );
        assert_eq!(num, [2, 1, 3, 0]);
        // a row holding more pages than its tokens need is not short
        assert!(rows_short(&[3], &[1], 16, 4).unwrap().is_empty());
        // several pages at once (a jump of 40 tokens)
        assert_eq!(rows_short(&[1], &[41], 16, 4).unwrap(), vec![(0, 2)]);
    }

    #[test]
    fn bad_input_is_refused_and_nothing_written() {
        assert_eq!(rows_short(&[1], &[17], 0, 4), Err(BatchError::ZeroPageSize));
        assert!(matches!(
            rows_short(&[1, 1], &[17], 16, 4),
            Err(BatchError::Length {
                what: "num_pages",
                expected: 1,
                got: 2
            })
        ));
        assert!(matches!(
            rows_short(&[1], &[-2], 16, 4),
            Err(BatchError::Negative {
                what: "seq_lens",
                index: 0,
                value: -2
            })
        ));
        assert!(matches!(
            rows_short(&[1], &[1 << 31], 16, 1 << 30),
            Err(BatchError::TooLong { index: 0, .. })
        ));
        assert!(matches!(
            rows_short(&[-1], &[17], 16, 4),
            Err(BatchError::Negative {
                what: "num_pages",
                index: 0,
                value: -1
            })
        ));
        assert!(matches!(
            rows_short(&[4], &[65], 16, 4),
            Err(BatchError::TooManyPages {
                index: 0,
                pages: 5,
                max_pages: 4
            })
        ));
        let mut table = vec![7, 0];
        let mut num = [1];
        let short = [(0, 1)];
        for (pages, what) in [(&[][..], "new_pages"), (&[3, 4][..], "new_pages")] {
            let e = append_pages(&mut table, 2, &mut num, &short, pages).unwrap_err();
            assert!(matches!(e, BatchError::Length { what: w, .. } if w == what));
        }
        assert_eq!(
            append_pages(&mut table, 2, &mut num, &short, &[0]),
            Err(BatchError::PaddingPage { index: 0, value: 0 })
        );
        assert!(matches!(
            append_pages(&mut table, 2, &mut num, &[(0, 2)], &[3, 4]),
            Err(BatchError::TooManyPages {
                index: 0,
                pages: 3,
                max_pages: 2
            })
        ));
        assert!(matches!(
            append_pages(&mut table, 2, &mut num, &[(1, 1)], &[3]),
            Err(BatchError::Length {
                what: "num_pages",
                ..
            })
        ));
        let mut neg = [-1];
        assert!(matches!(
            append_pages(&mut table, 2, &mut neg, &short, &[3]),
            Err(BatchError::Negative {
                what: "num_pages",
                index: 0,
                value: -1
            })
        ));
        assert_eq!((table, num), (vec![7, 0], [1]));
    }
}
