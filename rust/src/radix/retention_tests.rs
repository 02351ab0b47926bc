//! Unit tests of `radix::retention`: priorities, expiry, pins, stats.

use super::super::*;
use crate::alloc::AllocError;

fn setup(pages: u64, ps: u64) -> (PageAllocator, RadixCache) {
    let a = PageAllocator::new(pages, ps).unwrap();
    let c = RadixCache::new(&a, ps as usize).unwrap();
    (a, c)
}

fn at(c: &mut RadixCache, t: f64) {
    c.set_now(Seconds::new(t).unwrap());
}

/// Allocates, inserts with `retain`, frees the caller's references; returns the leaf's handle.
fn put(a: &mut PageAllocator, c: &mut RadixCache, tokens: &[i32], retain: Retain) -> Handle {
    let ns = Namespace::none();
    let p = c.alloc(a, tokens.len().div_ceil(c.page_size())).unwrap();
    c.insert_parts_retained(a, &ns, tokens, &[&p[..]], retain)
        .unwrap();
    a.free(&p).unwrap();
    c.check_invariants(a).unwrap();
    c.match_prefix(&ns, tokens).node
}

fn cached(c: &RadixCache) -> Vec<Vec<i32>> {
    let mut v: Vec<Vec<i32>> = c
        .leaf_paths(&Namespace::none())
        .into_iter()
        .map(|(t, _)| t)
        .collect();
    v.sort();
    v
}

fn r(p: i64, s: Option<f64>) -> Retain {
    Retain::new(p, s).unwrap()
}

#[test]
fn lowest_priority_goes_first_then_lru() {
    let (mut a, mut c) = setup(16, 1);
    put(&mut a, &mut c, &[1, 2], r(50, None)); // oldest, but kept longer
    put(&mut a, &mut c, &[3, 4], Retain::NONE);
    put(&mut a, &mut c, &[5, 6], Retain::NONE);
    assert_eq!(c.evict(&mut a, 2).unwrap(), 2);
    assert_eq!(cached(&c), vec![vec![1, 2], vec![5, 6]]);
    assert_eq!(c.evict(&mut a, 2).unwrap(), 2);
    assert_eq!(cached(&c), vec![vec![1, 2]]);
    let s = c.stats();
    assert_eq!(s.evicted_tokens_by_priority, vec![(0, 4)]);
    c.evict(&mut a, 2).unwrap();
    assert_eq!(c.stats().evicted_tokens_by_priority, vec![(0, 4), (50, 2)]);
    c.check_invariants(&a).unwrap();
}

#[test]
fn retention_expires_and_hits_renew_it() {
    let (mut a, mut c) = setup(16, 1);
    at(&mut c, 100.0);
    let h = put(&mut a, &mut c, &[1, 2], r(80, Some(10.0)));
    put(&mut a, &mut c, &[3, 4], Retain::NONE);
    at(&mut c, 105.0);
    c.match_prefix(&Namespace::none(), &[1, 2]); // renews until 115
    at(&mut c, 112.0);
    assert_eq!(c.priority(h).unwrap(), 80);
    assert_eq!(c.evict(&mut a, 1).unwrap(), 2);
    assert_eq!(cached(&c), vec![vec![1, 2]]);
    put(&mut a, &mut c, &[3, 4], Retain::NONE); // newer than [1, 2]'s last hit
    at(&mut c, 115.0); // expired: now plain LRU, and [1, 2] is the older
    assert_eq!(c.priority(h).unwrap(), 0);
    assert_eq!(c.evict(&mut a, 1).unwrap(), 2);
    assert_eq!(cached(&c), vec![vec![3, 4]]);
    assert_eq!(c.stats().retention_expiries, 1);
    c.check_invariants(&a).unwrap();
}

#[test]
fn a_hit_after_expiry_does_not_revive() {
    let (mut a, mut c) = setup(16, 1);
    let h = put(&mut a, &mut c, &[1, 2], r(80, Some(1.0)));
    at(&mut c, 2.0);
    c.match_prefix(&Namespace::none(), &[1, 2]);
    assert_eq!(c.priority(h).unwrap(), 0);
    assert_eq!(c.stats().retention_expiries, 1);
    at(&mut c, 2.5);
    assert_eq!(c.priority(h).unwrap(), 0);
    c.check_invariants(&a).unwrap();
}

#[test]
fn lower_priority_keeps_higher_equal_keeps_longer() {
    let (mut a, mut c) = setup(16, 1);
    let ns = Namespace::none();
    let h = put(&mut a, &mut c, &[1, 2], r(60, Some(10.0)));
    put(&mut a, &mut c, &[1, 2, 3], r(20, Some(100.0))); // touches [1, 2] at a lower priority
    assert_eq!(c.priority(h).unwrap(), 60);
    put(&mut a, &mut c, &[1, 2, 4], r(60, Some(50.0))); // same priority, longer retention
    at(&mut c, 40.0);
    assert_eq!(c.priority(h).unwrap(), 60);
    let h3 = c.match_prefix(&ns, &[1, 2, 3]).node; // renews [1, 2] at its longer retention
    at(&mut c, 85.0);
    assert_eq!(c.priority(h).unwrap(), 60);
    assert_eq!(c.priority(h3).unwrap(), 20);
    put(&mut a, &mut c, &[1, 2], r(90, Some(1.0))); // higher: replaces both
    at(&mut c, 86.0);
    assert_eq!(c.priority(h).unwrap(), 0);
    c.check_invariants(&a).unwrap();
}

#[test]
fn a_split_keeps_priority_and_pins_on_both_halves() {
    let (mut a, c) = setup(16, 2);
    let mut c = c.with_max_pinned_tokens(8);
    let h = put(&mut a, &mut c, &[1, 1, 2, 2, 3, 3], r(40, Some(5.0)));
    c.pin(h).unwrap();
    assert_eq!(c.pinned_tokens(), 6);
    let m = c.match_prefix(&Namespace::none(), &[1, 1, 2, 2]); // splits the edge
    assert_eq!(c.num_nodes(), 2);
    assert_eq!(c.priority(m.node).unwrap(), 40);
    assert_eq!(c.pinned_tokens(), 6);
    c.check_invariants(&a).unwrap();
    c.pin(m.node).unwrap(); // nested: no new tokens
    assert_eq!(c.pinned_tokens(), 6);
    c.unpin(h).unwrap();
    assert_eq!(c.pinned_tokens(), 4);
    assert_eq!(c.evict(&mut a, 100).unwrap(), 2); // only the unpinned tail goes
    c.unpin(m.node).unwrap();
    assert_eq!(c.pinned_tokens(), 0);
    at(&mut c, 10.0);
    assert_eq!(c.evict(&mut a, 100).unwrap(), 4);
    assert_eq!(c.stats().evicted_tokens_by_priority, vec![(0, 4), (40, 2)]);
    c.check_invariants(&a).unwrap();
}

#[test]
fn pins_are_budgeted_and_never_evicted() {
    let (mut a, c) = setup(8, 1);
    let mut c = c.with_max_pinned_tokens(4);
    let ha = put(&mut a, &mut c, &[1, 2, 3], Retain::NONE);
    let hb = put(&mut a, &mut c, &[1, 2, 9], Retain::NONE);
    c.pin(ha).unwrap();
    c.pin(ha).unwrap(); // twice: the tokens count once
    assert_eq!(c.pinned_tokens(), 3);
    assert_eq!(c.protected_size(), 3);
    c.pin(hb).unwrap(); // shares [1, 2]: one more token
    assert_eq!(c.pinned_tokens(), 4);
    let hc = put(&mut a, &mut c, &[7], Retain::NONE);
    let before = (c.pinned_tokens(), c.protected_size(), c.evictable_size());
    let e = c.pin(hc).unwrap_err();
    assert_eq!(
        e,
        RadixError::PinBudget {
            node: hc.node().get(),
            tokens: 1,
            pinned: 4,
            max: 4
        }
    );
    assert!(e.to_string().contains("`max_pinned_tokens` = 4"));
    assert_eq!(
        before,
        (c.pinned_tokens(), c.protected_size(), c.evictable_size())
    );
    // Locks and pins are separate counts.
    c.lock(hb).unwrap();
    c.unpin(hb).unwrap();
    assert_eq!(
        c.unpin(hb),
        Err(RadixError::NotPinned {
            node: hb.node().get()
        })
    );
    assert_eq!(c.protected_size(), 4);
    c.unlock(hb).unwrap();
    // Everything evictable goes; the pinned path stays, and alloc counts only what can go.
    assert_eq!(c.evict(&mut a, 100).unwrap(), 2);
    assert_eq!(cached(&c), vec![vec![1, 2, 3]]);
    let free = a.num_free();
    assert!(matches!(
        c.alloc(&mut a, free + 1),
        Err(RadixError::Page(AllocError::OutOfPages {
            evictable: 0,
            ..
        }))
    ));
    c.unpin(ha).unwrap();
    c.unpin(ha).unwrap();
    assert_eq!((c.pinned_tokens(), c.protected_size()), (0, 0));
    assert_eq!(c.evict(&mut a, 100).unwrap(), 3);
    c.check_invariants(&a).unwrap();
}

#[test]
fn stale_handles_and_bad_values_change_nothing() {
    let (mut a, c) = setup(8, 1);
    let mut c = c.with_max_pinned_tokens(10);
    let h = put(&mut a, &mut c, &[1, 2], Retain::NONE);
    c.evict(&mut a, 10).unwrap();
    assert_eq!(
        c.pin(h),
        Err(RadixError::StaleHandle {
            node: h.node().get()
        })
    );
    assert_eq!(
        c.unpin(h),
        Err(RadixError::StaleHandle {
            node: h.node().get()
        })
    );
    assert_eq!(
        Retain::new(101, None),
        Err(RadixError::BadPriority { value: 101 })
    );
    assert_eq!(
        Retain::new(-1, None),
        Err(RadixError::BadPriority { value: -1 })
    );
    assert!(matches!(
        Retain::new(5, Some(-0.5)),
        Err(RadixError::BadRetention { .. })
    ));
    assert!(matches!(
        Retain::new(5, Some(f64::NAN)),
        Err(RadixError::BadRetention { .. })
    ));
    assert!(Retain::new(5, Some(f64::INFINITY)).is_ok());
    assert!(matches!(
        Seconds::new(f64::NAN),
        Err(RadixError::BadTime { .. })
    ));
    assert_eq!(c.stats().pinned_tokens, 0);
}

#[test]
fn the_clock_never_runs_backwards_and_reset_keeps_config() {
    let (mut a, c) = setup(8, 1);
    let mut c = c.with_max_pinned_tokens(3);
    at(&mut c, 50.0);
    at(&mut c, 10.0);
    assert_eq!(c.now(), 50.0);
    let h = put(&mut a, &mut c, &[1], r(10, Some(1.0)));
    c.pin(h).unwrap();
    c.reset(&mut a).unwrap(); // pins are the cache's: reset drops them
    assert_eq!(
        (c.now(), c.max_pinned_tokens(), c.pinned_tokens()),
        (50.0, 3, 0)
    );
    assert_eq!(a.num_free(), 8);
    c.check_invariants(&a).unwrap();
}

/// Eviction order against a brute-force reference: random inserts with priorities, hits, time.
#[test]
fn eviction_order_matches_a_reference() {
    let (mut a, mut c) = setup(64, 1);
    let ns = Namespace::none();
    let mut rng = 12345u64;
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    // Reference: leaf token -> (priority, expiry, retention, last access).
    let mut model: HashMap<i32, (u8, f64, f64, u64)> = HashMap::new();
    let mut t = 0.0;
    let mut tick = 0u64;
    for step in 0..2000 {
        t += (next() % 3) as f64;
        at(&mut c, t);
        let tok = (next() % 40) as i32;
        tick += 1;
        if next() % 3 == 0 && model.contains_key(&tok) {
            c.match_prefix(&ns, &[tok]);
            let e = model.get_mut(&tok).unwrap();
            if e.0 > 0 && e.1 <= t {
                e.0 = 0;
            } else if e.0 > 0 {
                e.1 = t + e.2;
            }
            e.3 = tick;
        } else if !model.contains_key(&tok) {
            if a.num_free() == 0 {
                // Evict one: the reference picks (current priority, last access).
                let victim = *model
                    .iter()
                    .min_by_key(|(_, &(p, exp, _, la))| (if exp <= t { 0 } else { p }, la))
                    .unwrap()
                    .0;
                assert_eq!(c.evict(&mut a, 1).unwrap(), 1);
                model.remove(&victim);
                let left: Vec<i32> = c.leaf_paths(&ns).into_iter().map(|(k, _)| k[0]).collect();
                assert!(!left.contains(&victim), "step {step}: wrong victim");
            }
            let p = (next() % 4) as i64 * 30;
            let ret = (next() % 20) as f64;
            let pg = a.alloc(1).unwrap();
            c.insert_parts_retained(&mut a, &ns, &[tok], &[&pg[..]], r(p, Some(ret)))
                .unwrap();
            a.free(&pg).unwrap();
            let exp = if p > 0 { t + ret } else { 0.0 };
            model.insert(tok, (p as u8, exp, ret, tick));
        }
        c.check_invariants(&a).unwrap();
    }
}
