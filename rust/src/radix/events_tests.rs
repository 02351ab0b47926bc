use super::*;
use crate::alloc::PageAllocator;
use crate::hash::page_hashes;

fn setup(ps: usize) -> (PageAllocator, RadixCache) {
    let a = PageAllocator::new(64, ps as u64).unwrap();
    let mut c = RadixCache::new(&a, ps).unwrap();
    c.enable_kv_events(7);
    (a, c)
}

fn insert(a: &mut PageAllocator, c: &mut RadixCache, ns: &Namespace, t: &[i32]) -> usize {
    let pages = a.alloc_i32(t.len() / c.page_size()).unwrap();
    let n = c.insert(a, ns, t, &pages).unwrap();
    a.free(&pages).unwrap();
    n
}

#[test]
fn insert_extend_split_evict_reset() {
    let (mut a, mut c) = setup(2);
    let ns = Namespace::none();
    insert(&mut a, &mut c, &ns, &[1, 2, 3, 4]);
    let h = page_hashes(&ns, &[1, 2, 3, 4, 5, 6], 2, 7, None);
    let ev = c.take_kv_events();
    assert_eq!(
        ev,
        vec![KvEvent::BlockStored {
            block_hashes: h[..2].to_vec(),
            parent_block_hash: None,
            token_ids: vec![1, 2, 3, 4],
            block_size: 2,
            medium: Medium::Gpu,
            namespace: None,
        }]
    );
    // extending the path chains from the last page
    insert(&mut a, &mut c, &ns, &[1, 2, 3, 4, 5, 6]);
    let ev = c.take_kv_events();
    assert!(
        matches!(&ev[..], [KvEvent::BlockStored { block_hashes, parent_block_hash: Some(p), token_ids, .. }]
        if block_hashes == &h[2..] && *p == h[1] && token_ids == &[5, 6])
    );
    // a match ending inside an edge splits it: no event
    let m = c.match_prefix(&ns, &[1, 2, 9, 9]);
    assert_eq!(m.len, 2);
    c.check_invariants(&a).unwrap();
    // a branch off the split point chains from the first page
    insert(&mut a, &mut c, &ns, &[1, 2, 8, 8]);
    let b = page_hashes(&ns, &[1, 2, 8, 8], 2, 7, None);
    let ev = c.take_kv_events();
    assert!(
        matches!(&ev[..], [KvEvent::BlockStored { block_hashes, parent_block_hash: Some(p), .. }]
        if block_hashes == &b[1..] && *p == h[0])
    );
    c.check_invariants(&a).unwrap();
    // evicting everything: one merged removal of all 4 pages
    assert_eq!(c.evict(&mut a, 100).unwrap(), 8);
    let ev = c.take_kv_events();
    let [KvEvent::BlockRemoved {
        block_hashes,
        medium: Medium::Gpu,
    }] = &ev[..]
    else {
        panic!("{ev:?}")
    };
    let mut got = block_hashes.clone();
    got.sort_unstable();
    let mut want = vec![h[0], h[1], h[2], b[1]];
    want.sort_unstable();
    assert_eq!(got, want);
    insert(&mut a, &mut c, &ns, &[1, 2]);
    c.reset(&mut a).unwrap();
    let ev = c.take_kv_events();
    assert!(matches!(
        &ev[..],
        [KvEvent::BlockStored { .. }, KvEvent::AllBlocksCleared]
    ));
    assert!(c.kv_events_enabled() && c.hash_seed() == Some(7));
    let n = c.kv_event_counts();
    assert_eq!((n.blocks_stored, n.blocks_removed), (5, 4));
}

#[test]
fn namespace_bytes_on_first_pages_and_snapshot() {
    let (mut a, mut c) = setup(1);
    let mut b = Namespace::builder();
    b.str("lora-1");
    let ns = b.finish();
    insert(&mut a, &mut c, &ns, &[5, 6]);
    insert(&mut a, &mut c, &ns, &[5, 6, 7]);
    let ev = c.take_kv_events();
    let KvEvent::BlockStored {
        namespace,
        block_hashes,
        ..
    } = &ev[0]
    else {
        panic!()
    };
    assert_eq!(namespace.as_deref(), Some(ns.as_bytes()));
    assert_eq!(block_hashes, &page_hashes(&ns, &[5, 6], 1, 7, None));
    let KvEvent::BlockStored { namespace, .. } = &ev[1] else {
        panic!()
    };
    assert!(namespace.is_none());
    let snap = c.kv_events_snapshot();
    assert_eq!(snap[0], KvEvent::AllBlocksCleared);
    assert_eq!(snap.len(), 3);
    assert!(c.take_kv_events().is_empty());
}

#[test]
fn overflow_turns_into_a_snapshot() {
    let ps: usize = 1024;
    let mut a = PageAllocator::new(8192, ps as u64).unwrap();
    let mut c = RadixCache::new(&a, ps).unwrap();
    c.enable_kv_events(0);
    let ns = Namespace::none();
    let n = MAX_PENDING_TOKENS / ps + 1;
    for i in 0..n as i32 {
        insert(&mut a, &mut c, &ns, &vec![i; ps]);
    }
    assert_eq!(c.kv_event_counts().overflows, 1);
    let ev = c.take_kv_events();
    assert_eq!(ev[0], KvEvent::AllBlocksCleared);
    assert_eq!(ev.len(), n + 1);
    assert!(c.take_kv_events().is_empty());
}

#[test]
fn enabling_later_hashes_existing_pages() {
    let mut a = PageAllocator::new(16, 2).unwrap();
    let mut c = RadixCache::new(&a, 2).unwrap();
    let ns = Namespace::none();
    insert(&mut a, &mut c, &ns, &[1, 2, 3, 4]);
    c.match_prefix(&ns, &[1, 2]);
    assert!(c.take_kv_events().is_empty());
    c.enable_kv_events(3);
    c.check_invariants(&a).unwrap();
    assert!(c.take_kv_events().is_empty());
    let snap = c.kv_events_snapshot();
    assert_eq!(snap.len(), 3);
}

#[test]
fn tier_move_hook_announces_both_media() {
    let (mut a, mut c) = setup(2);
    let mut b = Namespace::builder();
    b.int(3);
    let ns = b.finish();
    insert(&mut a, &mut c, &ns, &[1, 2, 3, 4]);
    let ev = c.take_kv_events();
    let KvEvent::BlockStored {
        block_hashes,
        namespace,
        ..
    } = &ev[0]
    else {
        panic!()
    };
    let (h, nsb) = (block_hashes.clone(), namespace.clone());
    let leaf = c.match_prefix(&ns, &[1, 2, 3, 4]).node.node().get();
    c.events_moved(leaf, Medium::Gpu, Medium::Cpu);
    let ev = c.take_kv_events();
    assert_eq!(ev.len(), 2);
    assert_eq!(
        ev[0],
        KvEvent::BlockRemoved {
            block_hashes: h.clone(),
            medium: Medium::Gpu
        }
    );
    assert!(
        matches!(&ev[1], KvEvent::BlockStored { block_hashes, medium: Medium::Cpu, namespace, parent_block_hash: None, .. }
        if *block_hashes == h && *namespace == nsb)
    );
    assert_eq!(Medium::Cpu.as_str(), "CPU");
}
