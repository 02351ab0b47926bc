//! Unit tests of `radix` (kept beside it so the room's file holds the code alone).

use super::*;
use crate::alloc::AllocError;

fn setup(pages: u64, ps: u64) -> (PageAllocator, RadixCache) {
    let a = PageAllocator::new(pages, ps).unwrap();
    let c = RadixCache::new(&a, ps as usize).unwrap();
    (a, c)
}

/// Allocates pages for `tokens`, inserts, and frees the caller's references.
fn put(a: &mut PageAllocator, c: &mut RadixCache, ns: &Namespace, tokens: &[i32]) -> usize {
    let n = tokens.len().div_ceil(c.page_size());
    let p = c.alloc(a, n).unwrap();
    let present = c.insert(a, ns, tokens, &p).unwrap();
    a.free(&p).unwrap();
    c.check_invariants(a).unwrap();
    present
}

fn ids(p: &[PageId]) -> Vec<u32> {
    p.iter().map(|x| x.get()).collect()
}

#[test]
fn namespace_encoding_is_tagged_and_canonical() {
    let enc = |f: &dyn Fn(&mut NamespaceBuilder)| {
        let mut b = Namespace::builder();
        f(&mut b);
        b.finish()
    };
    let lora1 = enc(&|b| {
        b.tuple(2).str("lora").int(1);
    });
    let salt1 = enc(&|b| {
        b.tuple(2).str("salt").str("1");
    });
    let lora1_str = enc(&|b| {
        b.tuple(2).str("lora").str("1");
    });
    assert_ne!(lora1, salt1);
    assert_ne!(lora1, lora1_str);
    assert_ne!(
        enc(&|b| {
            b.str("a");
        }),
        enc(&|b| {
            b.bytes(b"a");
        })
    );
    assert_ne!(
        Namespace::none(),
        enc(&|b| {
            b.tuple(1).none();
        })
    );
    // One value, one key, whatever width it arrived in.
    for v in [0i64, 1, -1, 127, 128, -128, -129, i64::MAX, i64::MIN] {
        let wide = if v < 0 {
            [v.to_le_bytes(), [0xFF; 8]].concat()
        } else {
            [v.to_le_bytes(), [0; 8]].concat()
        };
        assert_eq!(
            enc(&|b| {
                b.int(v);
            }),
            enc(&|b| {
                b.int_le(&wide);
            }),
            "{v}"
        );
    }
    assert_ne!(
        enc(&|b| {
            b.int(-128);
        }),
        enc(&|b| {
            b.int(128);
        })
    );
}

#[test]
fn match_is_page_granular_and_splits() {
    let (mut a, mut c) = setup(32, 4);
    let ns = Namespace::none();
    // 10 tokens: 2 whole pages cached, the partial last page is not.
    assert_eq!(
        put(&mut a, &mut c, &ns, &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]),
        0
    );
    assert_eq!(c.total_size(), 8);
    assert_eq!(a.num_used(), 2);
    // Shorter than a page: nothing.
    let m = c.match_prefix(&ns, &[1, 2, 3]);
    assert_eq!((m.len, m.pages.len()), (0, 0));
    // Ends inside the edge: split after the first page.
    let m = c.match_prefix(&ns, &[1, 2, 3, 4, 5, 6, 0, 0]);
    assert_eq!(m.len, 4);
    assert_eq!(c.num_nodes(), 2);
    c.check_invariants(&a).unwrap();
    // The handle stays valid while a later insert extends the path.
    assert_eq!(put(&mut a, &mut c, &ns, &[1, 2, 3, 4, 9, 9, 9, 9]), 4);
    c.lock(m.node).unwrap();
    assert_eq!(c.protected_size(), 4);
    c.unlock(m.node).unwrap();
    assert_eq!((c.hit_tokens(), c.miss_tokens()), (4, 3 + 4));
}

/// KVB-17 (docs/architecture.md): the matched node itself is locked, and unlock below zero raises.
#[test]
fn kvb17_lock_covers_the_matched_node() {
    let (mut a, mut c) = setup(16, 1);
    let ns = Namespace::none();
    put(&mut a, &mut c, &ns, &[1, 2, 3]);
    put(&mut a, &mut c, &ns, &[1, 2, 3, 4, 5, 6]);
    let h = c.match_prefix(&ns, &[1, 2, 3, 4, 5, 6]).node;
    c.lock(h).unwrap();
    assert_eq!((c.evictable_size(), c.protected_size()), (0, 6));
    assert_eq!(c.evict(&mut a, 6).unwrap(), 0);
    c.unlock(h).unwrap();
    assert_eq!((c.evictable_size(), c.protected_size()), (6, 0));
    assert_eq!(c.evict(&mut a, 6).unwrap(), 6);
    assert_eq!(c.total_size(), 0);
    assert_eq!(a.num_free(), 16);
    assert!(matches!(c.unlock(h), Err(RadixError::StaleHandle { .. })));
    c.check_invariants(&a).unwrap();
    // Unlock without lock, on a live node.
    put(&mut a, &mut c, &ns, &[1, 2, 3]);
    let h = c.match_prefix(&ns, &[1, 2, 3]).node;
    assert_eq!(
        c.unlock(h).unwrap_err(),
        RadixError::NotLocked {
            node: h.node().get()
        }
    );
    assert_eq!((c.evictable_size(), c.protected_size()), (3, 0));
}

/// KVB-19 (docs/architecture.md): namespaces never share entries.
#[test]
fn kvb19_namespaces_are_separate() {
    let (mut a, mut c) = setup(64, 1);
    let key = |lora: Option<(i64, &str)>, salt: Option<&str>| {
        let mut b = Namespace::builder();
        b.tuple(usize::from(lora.is_some()) + usize::from(salt.is_some()));
        if let Some((id, _name)) = lora {
            b.tuple(2).str("lora").int(id);
        }
        if let Some(s) = salt {
            b.tuple(2).str("salt").str(s);
        }
        b.finish()
    };
    let t = [10, 11, 12, 13];
    put(&mut a, &mut c, &key(Some((1, "a")), None), &t);
    for ns in [
        key(Some((2, "a")), None),
        key(None, Some("a")),
        key(Some((1, "a")), Some("x")),
        key(None, None),
    ] {
        assert_eq!(c.match_prefix(&ns, &t).len, 0);
    }
    assert_eq!(c.match_prefix(&key(Some((1, "a")), None), &t).len, 4);
}

#[test]
fn insert_takes_only_new_pages() {
    let (mut a, mut c) = setup(8, 1);
    let ns = Namespace::none();
    let p1 = a.alloc(2).unwrap();
    assert_eq!(c.insert(&mut a, &ns, &[1, 2], &p1).unwrap(), 0);
    let p2 = a.alloc(3).unwrap();
    assert_eq!(c.insert(&mut a, &ns, &[1, 2, 3], &p2).unwrap(), 2);
    assert_eq!(
        ids(&[p2[0], p2[1]])
            .iter()
            .map(|&p| a.ref_count(PageId::new(p).unwrap()))
            .collect::<Vec<_>>(),
        vec![1, 1]
    );
    assert_eq!(a.ref_count(p2[2]), 2);
    a.free(&p1).unwrap();
    a.free(&p2).unwrap();
    assert_eq!(a.num_used(), 3);
    let m = c.match_prefix(&ns, &[1, 2, 3]);
    assert_eq!(ids(&m.pages), ids(&[p1[0], p1[1], p2[2]]));
    c.check_invariants(&a).unwrap();
}

#[test]
fn insert_rejects_bad_input_atomically() {
    let (mut a, mut c) = setup(8, 2);
    let ns = Namespace::none();
    let p = a.alloc(2).unwrap();
    assert!(matches!(
        c.insert(&mut a, &ns, &[1, 2, 3, 4, 5, 6], &p),
        Err(RadixError::LengthMismatch { .. })
    ));
    assert!(c.insert(&mut a, &ns, &[1, 2, 3, 4], &[p[0], p[0]]).is_err());
    assert!(c
        .insert(&mut a, &ns, &[1, 2, 3, 4], &[p[0].get(), 0])
        .is_err());
    assert!(
        c.insert(&mut a, &ns, &[1, 2, 3, 4], &[p[0].get(), 7])
            .is_err(),
        "page 7 is free"
    );
    assert_eq!(c.total_size(), 0);
    assert_eq!(c.insert(&mut a, &ns, &[1, 2, 3, 4, 5], &p).unwrap(), 0);
    // The same page again under another key.
    let q = a.alloc(1).unwrap();
    assert_eq!(
        c.insert(&mut a, &ns, &[7, 7, 8, 8], &[q[0], p[1]])
            .unwrap_err(),
        RadixError::Page(AllocError::AlreadyCached { page: p[1].get() })
    );
    assert_eq!(c.total_size(), 4);
    c.check_invariants(&a).unwrap();
}

#[test]
fn eviction_is_lru_and_cache_alloc_is_atomic() {
    let (mut a, mut c) = setup(6, 1);
    let ns = Namespace::none();
    put(&mut a, &mut c, &ns, &[1, 1]);
    put(&mut a, &mut c, &ns, &[2, 2]);
    put(&mut a, &mut c, &ns, &[3, 3]);
    c.match_prefix(&ns, &[1, 1]); // [2,2] is now the oldest
    let h = c.match_prefix(&ns, &[3, 3]).node;
    c.lock(h).unwrap();
    assert_eq!(c.evict(&mut a, 1).unwrap(), 2);
    assert_eq!(c.match_prefix(&ns, &[2, 2]).len, 0);
    assert_eq!(c.match_prefix(&ns, &[1, 1]).len, 2);
    // 2 free + 2 evictable: asking 5 fails and evicts nothing.
    let err = c.alloc(&mut a, 5).unwrap_err();
    assert_eq!(
        err,
        RadixError::Page(AllocError::OutOfPages {
            requested: 5,
            free: 2,
            evictable: 2
        })
    );
    assert_eq!(c.total_size(), 4);
    let got = c.alloc(&mut a, 4).unwrap();
    assert_eq!(got.len(), 4);
    assert_eq!(c.total_size(), 2);
    c.check_invariants(&a).unwrap();
    // A page a request still holds is not reclaimable.
    a.free(&got).unwrap();
    c.unlock(h).unwrap();
    let m = c.match_prefix(&ns, &[3, 3]);
    a.inc_ref(&m.pages).unwrap();
    let err = c.alloc(&mut a, 7).unwrap_err();
    assert_eq!(
        err,
        RadixError::Page(AllocError::OutOfPages {
            requested: 7,
            free: 4,
            evictable: 0
        })
    );
    assert_eq!(c.evict(&mut a, 100).unwrap(), 2);
    assert_eq!(a.num_free(), 4);
    a.free(&m.pages).unwrap();
    assert_eq!(a.num_free(), 6);
    c.check_invariants(&a).unwrap();
}

#[test]
fn insert_parts_is_insert_of_the_concatenation() {
    for ps in [1u64, 2] {
        let (mut a, mut c) = setup(32, ps);
        let ns = Namespace::none();
        let n = 6 * ps as usize;
        let toks: Vec<i32> = (0..n as i32).collect();
        put(&mut a, &mut c, &ns, &toks[..2 * ps as usize]);
        let m = c.match_prefix(&ns, &toks);
        let cached: Vec<i32> = m.pages.iter().map(|p| p.as_i32()).collect();
        let new: Vec<i32> = c
            .alloc(&mut a, 6 - cached.len())
            .unwrap()
            .iter()
            .map(|p| p.as_i32())
            .collect();
        // The taken pages span three parts (gathered), then a wrong total changes nothing.
        let parts: [&[i32]; 4] = [&cached[..1], &[cached[1], new[0]], &new[1..3], &new[3..]];
        let bad: [&[i32]; 2] = [&cached, &new[1..]];
        assert!(matches!(
            c.insert_parts(&mut a, &ns, &toks, &bad),
            Err(RadixError::LengthMismatch { pages: 5, .. })
        ));
        assert_eq!(c.total_size(), 2 * ps as usize);
        assert_eq!(
            c.insert_parts(&mut a, &ns, &toks, &parts).unwrap(),
            2 * ps as usize
        );
        a.free(&new).unwrap();
        c.check_invariants(&a).unwrap();
        let m = c.match_prefix(&ns, &toks);
        let all: Vec<i32> = cached.iter().chain(&new).copied().collect();
        assert_eq!(m.pages.iter().map(|p| p.as_i32()).collect::<Vec<_>>(), all);
        // All within one part: borrowed.
        assert!(matches!(page_range(&parts, 3, 5), Cow::Borrowed([_, _])));
        assert_eq!(&*page_range(&parts, 1, 4), &all[1..4]);
        assert!(page_range(&parts, 6, 6).is_empty());
    }
}

/// `cache.alloc` hands out the pages its eviction frees: each with one reference, never one
/// a request still holds, the rest of what eviction freed on the free list.
#[test]
fn cache_alloc_hands_out_evicted_pages() {
    let (mut a, mut c) = setup(8, 1);
    let ns = Namespace::none();
    put(&mut a, &mut c, &ns, &[1, 1, 1]);
    put(&mut a, &mut c, &ns, &[2, 2, 2]);
    let rest = a.alloc(2).unwrap(); // the pool is full now
    let got = c.alloc(&mut a, 2).unwrap();
    assert_eq!(c.total_size(), 3, "one leaf of 3 evicted");
    assert_eq!(a.num_free(), 1);
    for p in &got {
        assert_eq!(a.ref_count(*p), 1);
        assert!(!a.is_cached(*p) && !rest.contains(p));
    }
    c.check_invariants(&a).unwrap();
    // A cached page shared with a request is not freed by eviction, so not handed out.
    let m = c.match_prefix(&ns, &[2, 2, 2]);
    a.inc_ref(&m.pages[..1]).unwrap();
    let got2 = c.alloc(&mut a, 3).unwrap();
    assert_eq!(c.total_size(), 0);
    assert!(!got2.contains(&m.pages[0]));
    assert_eq!(a.ref_count(m.pages[0]), 1);
    assert_eq!(a.num_free(), 0);
    a.free(&m.pages[..1]).unwrap();
    a.free(&got2).unwrap();
    a.free(&got).unwrap();
    a.free(&rest).unwrap();
    assert_eq!(a.num_free(), 8);
    c.check_invariants(&a).unwrap();
}

#[test]
fn children_sharing_a_first_token() {
    // page_size 2: [1, 2] and [1, 3] both start with token 1 but are different pages.
    let (mut a, mut c) = setup(16, 2);
    let ns = Namespace::none();
    put(&mut a, &mut c, &ns, &[1, 2, 5, 5]);
    put(&mut a, &mut c, &ns, &[1, 3, 6, 6]);
    put(&mut a, &mut c, &ns, &[1, 4]);
    assert_eq!(c.match_prefix(&ns, &[1, 3, 6, 6]).len, 4);
    assert_eq!(c.match_prefix(&ns, &[1, 2, 5, 5]).len, 4);
    assert_eq!(c.match_prefix(&ns, &[1, 9]).len, 0);
    assert_eq!(c.evict(&mut a, 2).unwrap(), 2); // [1, 4], the least recently used
    assert_eq!(c.match_prefix(&ns, &[1, 4]).len, 0);
    assert_eq!(c.evict(&mut a, 4).unwrap(), 4);
    assert_eq!(c.match_prefix(&ns, &[1, 2, 5, 5]).len, 4);
    c.check_invariants(&a).unwrap();
}

#[test]
fn parents_are_evicted_after_children() {
    let (mut a, mut c) = setup(16, 1);
    let ns = Namespace::none();
    put(&mut a, &mut c, &ns, &[1, 2, 3]);
    put(&mut a, &mut c, &ns, &[1, 2, 3, 4]);
    put(&mut a, &mut c, &ns, &[9]);
    // [1,2,3] and its child [4] are older than [9]: the chain goes first.
    c.match_prefix(&ns, &[9]);
    assert_eq!(c.evict(&mut a, 2).unwrap(), 4);
    assert_eq!(c.match_prefix(&ns, &[9]).len, 1);
    c.check_invariants(&a).unwrap();
}

#[test]
fn reset_refuses_locks_and_stales_handles() {
    let (mut a, mut c) = setup(8, 1);
    let ns = Namespace::none();
    put(&mut a, &mut c, &ns, &[1, 2]);
    let h = c.match_prefix(&ns, &[1, 2]).node;
    c.lock(h).unwrap();
    assert!(matches!(
        c.reset(&mut a),
        Err(RadixError::Locked {
            protected: 2,
            locks: 1
        })
    ));
    c.unlock(h).unwrap();
    c.reset(&mut a).unwrap();
    assert_eq!((c.total_size(), a.num_free(), c.hit_tokens()), (0, 8, 0));
    assert!(matches!(c.lock(h), Err(RadixError::StaleHandle { .. })));
    let empty = c.match_prefix(&ns, &[5]).node;
    c.lock(empty).unwrap();
    assert!(
        c.reset(&mut a).is_err(),
        "a lock on the super-root counts too"
    );
    c.unlock(empty).unwrap();
    c.check_invariants(&a).unwrap();
}

#[test]
fn wrong_allocator_and_page_size() {
    let (mut a, mut c) = setup(8, 1);
    let mut b = PageAllocator::new(8, 1).unwrap();
    assert_eq!(c.evict(&mut b, 1).unwrap_err(), RadixError::WrongAllocator);
    assert!(matches!(
        RadixCache::new(&a, 2),
        Err(RadixError::PageSizeMismatch { .. })
    ));
    let other = RadixCache::new(&a, 1).unwrap();
    put(&mut a, &mut c, &Namespace::none(), &[1]);
    let mut other = other;
    let h = c.match_prefix(&Namespace::none(), &[1]).node;
    assert!(matches!(other.lock(h), Err(RadixError::StaleHandle { .. })));
}

#[test]
fn narrow_tokens_names_the_value() {
    assert_eq!(narrow_tokens(&[1, 2]), Ok(vec![1, 2]));
    assert_eq!(
        narrow_tokens(&[1, 1 << 33]),
        Err(RadixError::TokenOutOfRange {
            index: 1,
            value: 1 << 33
        })
    );
}

#[test]
fn common_prefix_chunks() {
    let a: Vec<i32> = (0..2000).collect();
    for k in [0, 1, 7, 8, 63, 64, 70, 511, 512, 1500, 1999] {
        let mut b = a.clone();
        b[k] = -1;
        assert_eq!(common_prefix(&a, &b), k);
    }
    assert_eq!(common_prefix(&a, &a), 2000);
    assert_eq!(common_prefix(&a[..5], &a), 5);
    assert_eq!(common_prefix(&[], &a), 0);
}
