//! Unit tests of `alloc` (kept beside it so the room's file holds the code alone).

use super::*;

fn ids(v: &[PageId]) -> Vec<u32> {
    v.iter().map(|p| p.get()).collect()
}

#[test]
fn option_page_id_is_four_bytes() {
    assert_eq!(std::mem::size_of::<Option<PageId>>(), 4);
}

#[test]
fn new_rejects_bad_sizes() {
    assert_eq!(PageAllocator::new(0, 1).unwrap_err(), AllocError::ZeroPages);
    assert_eq!(
        PageAllocator::new(1, 0).unwrap_err(),
        AllocError::ZeroPageSize
    );
    // (3 + 1) * 2^29 = 2^31 > i32::MAX; one page less fits.
    assert!(matches!(
        PageAllocator::new(3, 1 << 29),
        Err(AllocError::TooManySlots { .. })
    ));
    assert!(PageAllocator::new(2, 1 << 29).is_ok());
    assert!(matches!(
        PageAllocator::new(u64::MAX, 2),
        Err(AllocError::TooManySlots { .. })
    ));
}

#[test]
fn alloc_hands_out_pages_one_to_n_never_padding() {
    let mut a = PageAllocator::new(4, 1).unwrap();
    assert_eq!(ids(&a.alloc(3).unwrap()), vec![1, 2, 3]);
    assert_eq!(a.num_free(), 1);
    assert_eq!(a.num_used(), 3);
    let err = a.alloc(2).unwrap_err();
    assert_eq!(
        err,
        AllocError::OutOfPages {
            requested: 2,
            free: 1,
            evictable: 0
        }
    );
    assert_eq!(a.num_free(), 1, "failed alloc changes nothing");
    assert_eq!(ids(&a.alloc(1).unwrap()), vec![4]);
    assert!(a.alloc(0).unwrap().is_empty());
}

/// KVB-21 (docs/architecture.md), for both page sizes.
#[test]
fn kvb21_double_free_never_aliases_a_page() {
    for ps in [1, 16] {
        let mut a = PageAllocator::new(4, ps).unwrap();
        let p = a.alloc(1).unwrap();
        a.free(&p).unwrap();
        assert_eq!(
            a.free(&p).unwrap_err(),
            AllocError::NotAllocated { page: p[0].get() }
        );
        assert_eq!(a.num_free(), 4);
        let x = a.alloc(2).unwrap();
        let y = a.alloc(2).unwrap();
        let mut all = ids(&x);
        all.extend(ids(&y));
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), 4, "four distinct pages");
        assert!(matches!(
            a.alloc(1),
            Err(AllocError::OutOfPages {
                requested: 1,
                free: 0,
                ..
            })
        ));
        let q = x[0];
        assert_eq!(
            a.free(&[q, q]).unwrap_err(),
            AllocError::Duplicate { page: q.get() }
        );
        assert_eq!(a.ref_count(q), 1, "q untouched by the rejected call");

        let mut a = PageAllocator::new(4, ps).unwrap();
        let p = a.alloc(1).unwrap();
        a.inc_ref(&p).unwrap();
        assert_eq!(a.ref_count(p[0]), 2);
        a.free(&p).unwrap();
        assert_eq!(a.num_free(), 3);
        a.free(&p).unwrap();
        assert_eq!(
            a.num_free(),
            4,
            "returned exactly once, on the second release"
        );
        assert!(a.free(&p).is_err());
        assert_eq!(a.num_free(), 4);
    }
}

#[test]
fn free_is_atomic_on_any_bad_id() {
    let mut a = PageAllocator::new(4, 1).unwrap();
    let p = a.alloc(2).unwrap();
    for bad in [
        vec![1i64, 0],
        vec![1, 5],
        vec![1, -1],
        vec![1, 3],
        vec![2, 1, 2],
    ] {
        assert!(a.free(&bad).is_err(), "{bad:?}");
        assert_eq!(a.num_free(), 2);
        assert_eq!(a.ref_count(p[0]), 1);
        assert_eq!(a.ref_count(p[1]), 1);
    }
    assert_eq!(a.free(&[0i32]).unwrap_err(), AllocError::PaddingPage);
    assert_eq!(
        a.free(&[9i32]).unwrap_err(),
        AllocError::OutOfRange {
            page: 9,
            num_pages: 4
        }
    );
    assert!(a.inc_ref(&[3i32]).is_err(), "cannot share a free page");
}

#[test]
fn a_cached_reference_cannot_be_freed_by_a_holder() {
    let mut a = PageAllocator::new(2, 1).unwrap();
    let p = a.alloc(1).unwrap();
    a.retain_cached(p[0]);
    a.free(&p).unwrap();
    assert_eq!(
        a.free(&p).unwrap_err(),
        AllocError::OnlyCached { page: p[0].get() }
    );
    assert_eq!(a.ref_count(p[0]), 1);
    a.release_cached(p[0]);
    assert_eq!(a.num_free(), 2);
}

#[test]
fn stamp_wraparound_keeps_duplicate_detection() {
    let mut a = PageAllocator::new(2, 1).unwrap();
    let p = a.alloc(2).unwrap();
    a.stamp = u32::MAX;
    a.seen[1] = 1; // a stale stamp that would alias after the wrap
    assert!(a.inc_ref(&p).is_ok());
    assert_eq!(a.stamp, 1);
    assert!(a.inc_ref(&[p[0], p[0]]).is_err());
}

#[test]
fn debug_generations_catch_a_free_after_reuse() {
    let mut a = PageAllocator::with_debug(2, 1, true).unwrap();
    let p = a.alloc_i32(2).unwrap();
    let mut g = Vec::new();
    a.grant(&p, &mut g);
    assert_eq!(g, vec![1, 1]);
    a.check_grant(&p, &g).unwrap();
    a.free(&p).unwrap();
    let q = a.alloc_i32(2).unwrap();
    assert!(matches!(
        a.check_grant(&p, &g),
        Err(AllocError::Reused {
            granted: 1,
            now: 2,
            ..
        })
    ));
    let mut gq = Vec::new();
    a.grant(&q, &mut gq);
    a.check_grant(&q, &gq).unwrap();
    // Without debug nothing is recorded and every grant passes.
    let mut b = PageAllocator::new(2, 1).unwrap();
    let p = b.alloc_i32(1).unwrap();
    let mut none = Vec::new();
    b.grant(&p, &mut none);
    assert!(none.is_empty() && !b.debug());
    assert!(b.check_grant(&p, &[7]).is_ok());
}

#[test]
fn try_vec_refuses_what_cannot_be_allocated() {
    let e = try_vec::<u32>(usize::MAX / 2, || "x".into()).unwrap_err();
    assert!(matches!(e, AllocError::NoMemory { .. }));
    assert_eq!(
        PageAllocator::new(3, 1).unwrap().ref_counts().unwrap(),
        vec![0; 4]
    );
}

#[test]
fn helpers() {
    assert_eq!(count("n", 3), Ok(3));
    assert_eq!(
        count("n", -1),
        Err(AllocError::Negative {
            what: "n",
            value: -1
        })
    );
    assert_eq!(narrow_pages(&[1, 2]), Ok(vec![1, 2]));
    assert!(narrow_pages(&[1 << 40]).is_err());
}
