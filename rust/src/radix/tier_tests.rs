//! Unit tests of the host tier (`tier.rs`).

use super::super::*;

fn setup(dev: u64, host: u64) -> (PageAllocator, PageAllocator, RadixCache) {
    let a = PageAllocator::new(dev, 1).unwrap();
    let h = PageAllocator::new(host, 1).unwrap();
    let c = RadixCache::with_host(&a, 1, &h).unwrap();
    (a, h, c)
}

fn put(a: &mut PageAllocator, h: &mut PageAllocator, c: &mut RadixCache, t: &[i32]) {
    let p = c.alloc_tiered(a, h, t.len()).unwrap();
    c.insert_tiered(a, h, &Namespace::none(), t, &[&p[..]]).unwrap();
    a.free(&p).unwrap();
    c.check_invariants_tiered(a, h).unwrap();
}

#[test]
fn eviction_demotes_and_load_back_promotes() {
    let (mut a, mut h, mut c) = setup(4, 8);
    let ns = Namespace::none();
    put(&mut a, &mut h, &mut c, &[1, 2, 3]);
    assert!(c.take_demotions().is_empty());
    put(&mut a, &mut h, &mut c, &[7, 8, 9]); // needs 3 pages of 4: demotes the first path
    let d = c.take_demotions();
    assert_eq!(d.len(), 3);
    assert_eq!((c.host_size(), c.total_size()), (3, 3));
    // The device match stops at the host node; the host match continues it.
    assert_eq!(c.match_prefix(&ns, &[1, 2, 3]).len, 0);
    let m = c.match_prefix_host(&ns, &[1, 2, 3, 4]);
    assert_eq!((m.len, m.device_len), (3, 0));
    assert_eq!(m.pages, d.iter().map(|x| x.1).collect::<Vec<_>>());
    assert!(matches!(c.lock(m.node), Err(RadixError::OnHost { .. })));
    let dev = c.alloc_tiered(&mut a, &mut h, 3).unwrap(); // demotes [7, 8, 9]
    assert_eq!(c.take_demotions().len(), 3);
    assert!(matches!(
        c.load_back(&mut a, &mut h, m.node, &dev[..2]),
        Err(RadixError::LoadLength { expected: 3, got: 2, .. })
    ));
    c.check_invariants_tiered(&a, &h).unwrap();
    assert_eq!(c.load_back(&mut a, &mut h, m.node, &dev).unwrap(), 3);
    a.free(&dev).unwrap();
    c.check_invariants_tiered(&a, &h).unwrap();
    let got = c.match_prefix(&ns, &[1, 2, 3]);
    assert_eq!(got.len, 3);
    assert_eq!(got.pages.iter().map(|p| p.as_i32()).collect::<Vec<_>>(), dev);
    assert_eq!(c.tier_stats().loaded_pages, 3);
    assert_eq!(c.host_size(), 3);
}

#[test]
fn full_host_pool_drops_lru_host_entries_then_nodes() {
    let (mut a, mut h, mut c) = setup(2, 2);
    let ns = Namespace::none();
    put(&mut a, &mut h, &mut c, &[1, 2]);
    put(&mut a, &mut h, &mut c, &[3, 4]); // [1, 2] to the host
    put(&mut a, &mut h, &mut c, &[5, 6]); // [3, 4] to the host, [1, 2] dropped
    assert_eq!(c.match_prefix_host(&ns, &[1, 2]).len, 0);
    assert_eq!(c.match_prefix_host(&ns, &[3, 4]).len, 2);
    assert_eq!(c.tier_stats().host_evicted_pages, 2);
    // A node larger than the host pool is dropped with no copy.
    let p = c.alloc_tiered(&mut a, &mut h, 2).unwrap();
    c.insert_tiered(&mut a, &mut h, &ns, &[9, 9], &[&p[..]]).unwrap();
    a.free(&p).unwrap();
    c.take_demotions();
    let (mut a2, mut h2, mut c2) = setup(3, 2);
    put(&mut a2, &mut h2, &mut c2, &[1, 2, 3]);
    put(&mut a2, &mut h2, &mut c2, &[4]);
    assert_eq!(c2.tier_stats().dropped_pages, 3);
    assert!(c2.take_demotions().is_empty());
    c2.check_invariants_tiered(&a2, &h2).unwrap();
}

#[test]
fn insert_over_host_nodes_takes_the_callers_pages() {
    let (mut a, mut h, mut c) = setup(4, 8);
    let ns = Namespace::none();
    put(&mut a, &mut h, &mut c, &[1, 2, 3, 4]);
    c.evict_tiered(&mut a, &mut h, 4).unwrap();
    c.take_demotions();
    assert_eq!(c.host_size(), 4);
    // A request recomputed [1, 2, 3, 4, 5, 6] (host split after 2: the rest stays on the host).
    let m = c.match_prefix_host(&ns, &[1, 2]);
    assert_eq!(m.len, 2);
    let p = c.alloc_tiered(&mut a, &mut h, 4).unwrap();
    assert_eq!(c.insert_tiered(&mut a, &mut h, &ns, &[1, 2, 5, 6], &[&p[..]]).unwrap(), 0);
    a.free(&p).unwrap();
    c.check_invariants_tiered(&a, &h).unwrap();
    assert_eq!(c.match_prefix(&ns, &[1, 2, 5, 6]).len, 4);
    assert_eq!(c.match_prefix(&ns, &[1, 2, 3, 4]).len, 2);
    assert_eq!(c.match_prefix_host(&ns, &[1, 2, 3, 4]).len, 2);
    assert_eq!(c.host_size(), 2);
    // Plain entry points refuse a tiered cache; reset empties both tiers.
    assert!(matches!(c.alloc_i32(&mut a, 1), Err(RadixError::HostAllocator { has_tier: true })));
    c.reset_tiered(&mut a, &mut h).unwrap();
    assert_eq!((a.num_free(), h.num_free(), c.host_size()), (4, 8, 0));
}

#[test]
fn locked_paths_are_never_demoted() {
    let (mut a, mut h, mut c) = setup(4, 8);
    let ns = Namespace::none();
    put(&mut a, &mut h, &mut c, &[1, 2]);
    let m = c.match_prefix(&ns, &[1, 2]);
    c.lock(m.node).unwrap();
    assert_eq!(c.evict_tiered(&mut a, &mut h, 10).unwrap(), 0);
    assert!(c.alloc_tiered(&mut a, &mut h, 3).is_err());
    assert_eq!(c.host_size(), 0);
    c.unlock(m.node).unwrap();
    c.check_invariants_tiered(&a, &h).unwrap();
}

#[test]
fn insert_splitting_a_host_edge_promotes_its_head() {
    let (mut a, mut h, mut c) = setup(8, 8);
    let ns = Namespace::none();
    put(&mut a, &mut h, &mut c, &[1, 2, 3, 4]);
    c.evict_tiered(&mut a, &mut h, 4).unwrap();
    c.take_demotions();
    // No match before: the insert itself splits the host edge after [1, 2].
    let p = c.alloc_tiered(&mut a, &mut h, 4).unwrap();
    assert_eq!(c.insert_tiered(&mut a, &mut h, &ns, &[1, 2, 9, 9], &[&p[..]]).unwrap(), 0);
    a.free(&p).unwrap();
    c.check_invariants_tiered(&a, &h).unwrap();
    let m = c.match_prefix(&ns, &[1, 2, 9, 9]);
    assert_eq!(m.pages.iter().map(|x| x.as_i32()).collect::<Vec<_>>(), p);
    let hm = c.match_prefix_host(&ns, &[1, 2, 3, 4]);
    assert_eq!((hm.device_len, hm.len), (2, 2));
    assert_eq!((c.host_size(), h.num_used()), (2, 2));
}

#[test]
fn namespaces_stay_apart_on_the_host() {
    let (mut a, mut h, mut c) = setup(4, 8);
    let mut b = Namespace::builder();
    b.str("lora");
    let other = b.finish();
    put(&mut a, &mut h, &mut c, &[1, 2]);
    c.evict_tiered(&mut a, &mut h, 2).unwrap();
    c.take_demotions();
    assert_eq!(c.match_prefix_host(&other, &[1, 2]).len, 0);
    assert_eq!(c.match_prefix_host(&Namespace::none(), &[1, 2]).len, 2);
    // The host pages of a namespace whose last node is dropped free its root too.
    c.reset_tiered(&mut a, &mut h).unwrap();
    assert_eq!((c.num_nodes(), h.num_used()), (0, 0));
}

#[test]
fn reset_refusals_change_nothing_and_reset_keeps_the_tier() {
    let (mut a, mut h, mut c) = setup(4, 8);
    let ns = Namespace::none();
    put(&mut a, &mut h, &mut c, &[1, 2, 3]);
    put(&mut a, &mut h, &mut c, &[7, 8, 9]); // demotes [1, 2, 3]
    c.take_demotions();
    let before = (
        a.ref_counts(),
        h.ref_counts(),
        c.total_size(),
        c.host_size(),
    );
    let same = |a: &PageAllocator, h: &PageAllocator, c: &RadixCache| {
        (
            a.ref_counts(),
            h.ref_counts(),
            c.total_size(),
            c.host_size(),
        ) == before
    };
    // The plain entry point refuses a tiered cache, another host allocator is refused, and a
    // lock refuses the reset: each before any page is released.
    assert!(matches!(
        c.reset_with(&mut a, &mut Others::default()),
        Err(RadixError::HostAllocator { has_tier: true })
    ));
    let mut other = PageAllocator::new(8, 1).unwrap();
    assert!(matches!(
        c.reset_tiered(&mut a, &mut other),
        Err(RadixError::WrongAllocator)
    ));
    let m = c.match_prefix(&ns, &[7, 8, 9]);
    c.lock(m.node).unwrap();
    assert!(matches!(
        c.reset_tiered(&mut a, &mut h),
        Err(RadixError::Locked { locks: 1, .. })
    ));
    assert!(same(&a, &h, &c));
    c.unlock(m.node).unwrap();
    c.check_invariants_tiered(&a, &h).unwrap();
    // Reset: both tiers' pages released, counters zeroed, the tier still demotes afterwards.
    c.reset_tiered(&mut a, &mut h).unwrap();
    assert_eq!((a.num_used(), h.num_used(), c.host_size()), (0, 0, 0));
    assert_eq!(c.tier_stats(), TierStats::default());
    put(&mut a, &mut h, &mut c, &[4, 5, 6]);
    put(&mut a, &mut h, &mut c, &[1, 2, 3]);
    assert_eq!((c.take_demotions().len(), c.host_size()), (3, 3));
    c.check_invariants_tiered(&a, &h).unwrap();
    // A cache without a tier refuses the tiered reset.
    let mut plain = RadixCache::new(&a, 1).unwrap();
    assert!(matches!(
        plain.reset_tiered(&mut a, &mut h),
        Err(RadixError::HostAllocator { has_tier: false })
    ));
}
