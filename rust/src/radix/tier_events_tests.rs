//! Unit tests of the host tier with KV events: demotion is `BlockRemoved` (GPU) then
//! `BlockStored` (CPU), a load back the reverse, a dropped host node `BlockRemoved` (CPU); the
//! events replayed always give the snapshot's (page hash, medium) set.

use std::collections::HashSet;

use super::super::*;

fn setup(dev: u64, host: u64) -> (PageAllocator, PageAllocator, RadixCache) {
    let a = PageAllocator::new(dev, 1).unwrap();
    let h = PageAllocator::new(host, 1).unwrap();
    let mut c = RadixCache::with_host(&a, 1, &h).unwrap();
    c.enable_kv_events(7);
    (a, h, c)
}

fn put(a: &mut PageAllocator, h: &mut PageAllocator, c: &mut RadixCache, t: &[i32]) -> bool {
    let Ok(p) = c.alloc_tiered(a, h, t.len()) else {
        return false;
    };
    c.insert_tiered(a, h, &Namespace::none(), t, &[&p[..]])
        .unwrap();
    a.free(&p).unwrap();
    c.take_demotions();
    true
}

/// Applies `events` to a consumer's view: the set of (page hash, medium) cached.
fn apply(seen: &mut HashSet<(u64, Medium)>, events: &[KvEvent]) {
    for e in events {
        match e {
            KvEvent::BlockStored {
                block_hashes,
                medium,
                ..
            } => {
                for &b in block_hashes {
                    assert!(seen.insert((b, *medium)), "stored twice: {b} on {medium:?}");
                }
            }
            KvEvent::BlockRemoved {
                block_hashes,
                medium,
            } => {
                for &b in block_hashes {
                    assert!(
                        seen.remove(&(b, *medium)),
                        "removed, never stored: {b} on {medium:?}"
                    );
                }
            }
            KvEvent::AllBlocksCleared => seen.clear(),
        }
    }
}

/// Takes the pending events into `seen`, then checks it against a fresh snapshot.
fn sync(c: &mut RadixCache, seen: &mut HashSet<(u64, Medium)>) {
    let ev = c.take_kv_events();
    apply(seen, &ev);
    let mut want = HashSet::new();
    apply(&mut want, &c.kv_events_snapshot());
    assert_eq!(*seen, want);
}

fn hashes(t: &[i32]) -> Vec<u64> {
    crate::hash::page_hashes(&Namespace::none(), t, 1, 7, None)
}

#[test]
fn demotion_and_load_back_move_the_pages_between_media() {
    let (mut a, mut h, mut c) = setup(4, 8);
    let ns = Namespace::none();
    let mut seen = HashSet::new();
    put(&mut a, &mut h, &mut c, &[1, 2]);
    put(&mut a, &mut h, &mut c, &[3, 4]);
    sync(&mut c, &mut seen);
    put(&mut a, &mut h, &mut c, &[5, 6]); // demotes [1, 2]
    let ev = c.take_kv_events();
    let h12 = hashes(&[1, 2]);
    assert_eq!(
        ev[0],
        KvEvent::BlockRemoved {
            block_hashes: h12.clone(),
            medium: Medium::Gpu
        }
    );
    assert!(
        matches!(&ev[1], KvEvent::BlockStored { block_hashes, medium: Medium::Cpu,
        parent_block_hash: None, token_ids, .. } if *block_hashes == h12 && *token_ids == [1, 2])
    );
    assert!(matches!(
        &ev[2],
        KvEvent::BlockStored {
            medium: Medium::Gpu,
            ..
        }
    ));
    assert_eq!(ev.len(), 3);
    apply(&mut seen, &ev);
    sync(&mut c, &mut seen);
    let m = c.match_prefix_host(&ns, &[1, 2]);
    assert_eq!(m.len, 2);
    let dev = c.alloc_tiered(&mut a, &mut h, 2).unwrap(); // demotes [3, 4]
    sync(&mut c, &mut seen);
    c.load_back(&mut a, &mut h, m.node, &dev).unwrap();
    a.free(&dev).unwrap();
    let ev = c.take_kv_events();
    assert_eq!(
        ev[0],
        KvEvent::BlockRemoved {
            block_hashes: h12.clone(),
            medium: Medium::Cpu
        }
    );
    assert!(
        matches!(&ev[1], KvEvent::BlockStored { block_hashes, medium: Medium::Gpu, .. }
        if *block_hashes == h12)
    );
    apply(&mut seen, &ev);
    sync(&mut c, &mut seen);
    c.check_invariants_tiered(&a, &h).unwrap();
    c.reset_tiered(&mut a, &mut h).unwrap();
    assert_eq!(c.take_kv_events(), vec![KvEvent::AllBlocksCleared]);
    assert!(c.kv_events_enabled());
}

#[test]
fn a_dropped_host_node_is_removed_on_the_cpu() {
    let (mut a, mut h, mut c) = setup(2, 2);
    let mut seen = HashSet::new();
    put(&mut a, &mut h, &mut c, &[1, 2]);
    put(&mut a, &mut h, &mut c, &[3, 4]); // [1, 2] to the host
    sync(&mut c, &mut seen);
    put(&mut a, &mut h, &mut c, &[5, 6]); // [3, 4] to the host, [1, 2] dropped
    let ev = c.take_kv_events();
    assert_eq!(
        ev[0],
        KvEvent::BlockRemoved {
            block_hashes: hashes(&[1, 2]),
            medium: Medium::Cpu
        }
    );
    apply(&mut seen, &ev);
    sync(&mut c, &mut seen);
}

#[test]
fn events_replay_to_the_snapshot_through_random_tier_traffic() {
    let (mut a, mut h, mut c) = setup(6, 5);
    let ns = Namespace::none();
    let mut seen = HashSet::new();
    let mut x: u64 = 12345;
    let mut next = |m: u64| {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (x >> 33) % m
    };
    for step in 0..400 {
        let len = 1 + next(3) as usize;
        let t: Vec<i32> = (0..len).map(|_| next(3) as i32).collect();
        match next(10) {
            0..=5 => {
                put(&mut a, &mut h, &mut c, &t);
            }
            6..=7 => {
                let m = c.match_prefix_host(&ns, &t);
                if m.len > 0 {
                    if let Ok(dev) = c.alloc_tiered(&mut a, &mut h, m.pages.len()) {
                        let _ = c.load_back(&mut a, &mut h, m.node, &dev);
                        a.free(&dev).unwrap();
                    }
                }
            }
            8 => {
                c.evict_tiered(&mut a, &mut h, len).unwrap();
            }
            _ if step % 50 == 9 => c.reset_tiered(&mut a, &mut h).unwrap(),
            _ => {
                c.match_prefix(&ns, &t);
            }
        }
        c.take_demotions();
        c.check_invariants_tiered(&a, &h).unwrap();
        sync(&mut c, &mut seen);
    }
    assert!(c.tier_stats().demoted_pages > 0 && c.tier_stats().loaded_pages > 0);
    assert!(c.tier_stats().host_evicted_pages > 0);
}
