//! Unit tests of the host tier together with retention: demotion and host drops follow the
//! (priority, last access) order, pins are never demoted, host nodes are never pinned.

use super::super::*;
use crate::alloc::AllocError;

fn setup(dev: u64, host: u64, max_pinned: usize) -> (PageAllocator, PageAllocator, RadixCache) {
    let a = PageAllocator::new(dev, 1).unwrap();
    let h = PageAllocator::new(host, 1).unwrap();
    let c = RadixCache::with_host(&a, 1, &h)
        .unwrap()
        .with_max_pinned_tokens(max_pinned);
    (a, h, c)
}

fn put(
    a: &mut PageAllocator,
    h: &mut PageAllocator,
    c: &mut RadixCache,
    t: &[i32],
    priority: i64,
    retention_s: Option<f64>,
) {
    let retain = Retain::new(priority, retention_s).unwrap();
    let p = c.alloc_tiered(a, h, t.len()).unwrap();
    c.insert_tiered_retained(a, h, &Namespace::none(), t, &[&p[..]], retain)
        .unwrap();
    a.free(&p).unwrap();
    c.check_invariants_tiered(a, h).unwrap();
}

fn device_len(c: &mut RadixCache, t: &[i32]) -> usize {
    c.match_prefix(&Namespace::none(), t).len
}

fn host_len(c: &mut RadixCache, t: &[i32]) -> usize {
    c.match_prefix_host(&Namespace::none(), t).len
}

#[test]
fn demotion_takes_the_lowest_priority_first() {
    let (mut a, mut h, mut c) = setup(4, 8, 0);
    put(&mut a, &mut h, &mut c, &[1, 2], 50, None);
    put(&mut a, &mut h, &mut c, &[3, 4], 0, None); // more recent, lower priority
    put(&mut a, &mut h, &mut c, &[5, 6], 0, None); // demotes [3, 4], not the older [1, 2]
    assert_eq!(c.take_demotions().len(), 2);
    c.check_invariants_tiered(&a, &h).unwrap();
    assert_eq!(device_len(&mut c, &[1, 2]), 2);
    assert_eq!(device_len(&mut c, &[3, 4]), 0);
    assert_eq!(host_len(&mut c, &[3, 4]), 2);
    // A demotion is no eviction: the retention counters count none.
    assert_eq!(c.stats().evicted_tokens, 0);
}

#[test]
fn pinned_paths_are_never_demoted_and_host_nodes_never_pinned() {
    let (mut a, mut h, mut c) = setup(4, 8, 4);
    let ns = Namespace::none();
    put(&mut a, &mut h, &mut c, &[1, 2], 0, None);
    let pinned = c.match_prefix(&ns, &[1, 2]).node;
    c.pin(pinned).unwrap();
    put(&mut a, &mut h, &mut c, &[3, 4], 0, None);
    // [1, 2] is the least recently used leaf, but pinned: [3, 4] is demoted.
    let held = c.alloc_tiered(&mut a, &mut h, 2).unwrap();
    assert_eq!(c.take_demotions().len(), 2);
    assert_eq!(device_len(&mut c, &[1, 2]), 2);
    // Nothing else can leave the device: the pinned path stays.
    assert!(matches!(
        c.alloc_tiered(&mut a, &mut h, 1),
        Err(RadixError::Page(AllocError::OutOfPages { .. }))
    ));
    let m = c.match_prefix_host(&ns, &[3, 4]);
    assert_eq!(m.len, 2);
    assert_eq!(
        c.pin(m.node),
        Err(RadixError::OnHost {
            node: m.node.node().get()
        })
    );
    assert_eq!(c.pinned_tokens(), 2);
    c.check_invariants_tiered(&a, &h).unwrap();
    a.free(&held).unwrap();
    c.unpin(pinned).unwrap();
    assert_eq!(c.pinned_tokens(), 0);
    c.check_invariants_tiered(&a, &h).unwrap();
}

#[test]
fn full_host_pool_drops_the_lowest_priority_then_lru() {
    let (mut a, mut h, mut c) = setup(2, 4, 0);
    put(&mut a, &mut h, &mut c, &[1, 2], 50, Some(10.0));
    put(&mut a, &mut h, &mut c, &[3, 4], 0, None); // [1, 2] to the host
    put(&mut a, &mut h, &mut c, &[5, 6], 0, None); // [3, 4] to the host: host full
    put(&mut a, &mut h, &mut c, &[7, 8], 0, None); // [5, 6] down; drops [3, 4] (priority 0)
    assert_eq!(host_len(&mut c, &[1, 2]), 2);
    assert_eq!(host_len(&mut c, &[3, 4]), 0);
    assert_eq!(host_len(&mut c, &[5, 6]), 2);
    assert_eq!(c.stats().evicted_tokens_by_priority, vec![(0, 2)]);
    // Once its retention ran out, the host node decays (re-keyed in the host order) and, least
    // recently used, goes first.
    c.set_now(Seconds::new(20.0).unwrap());
    assert_eq!(host_len(&mut c, &[5, 6]), 2); // (a hit: [5, 6] more recent than [1, 2])
    put(&mut a, &mut h, &mut c, &[9, 9], 0, None); // [7, 8] down; drops [1, 2]
    assert_eq!(host_len(&mut c, &[1, 2]), 0);
    assert_eq!(host_len(&mut c, &[5, 6]), 2);
    assert_eq!(host_len(&mut c, &[7, 8]), 2);
    let s = c.stats();
    assert_eq!(s.retention_expiries, 1);
    assert_eq!(s.evicted_tokens_by_priority, vec![(0, 4)]);
    c.check_invariants_tiered(&a, &h).unwrap();
}

#[test]
fn reset_tiered_keeps_the_pin_budget_and_clock() {
    let (mut a, mut h, mut c) = setup(4, 4, 3);
    c.set_now(Seconds::new(5.0).unwrap());
    put(&mut a, &mut h, &mut c, &[1, 2], 10, Some(1.0));
    c.reset_tiered(&mut a, &mut h).unwrap();
    assert_eq!((c.max_pinned_tokens(), c.now()), (3, 5.0));
    assert!(c.has_host_tier());
    c.check_invariants_tiered(&a, &h).unwrap();
}
