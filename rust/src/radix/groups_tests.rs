//! Unit tests of the hybrid radix cache (`groups.rs`).

use super::*;

struct Hybrid {
    full: PageAllocator,
    sw: PageAllocator,
    st: PageAllocator,
    c: RadixCache,
}

fn hybrid(ps: u64, window: usize) -> Hybrid {
    let full = PageAllocator::new(32, ps).unwrap();
    let sw = PageAllocator::new(32, ps).unwrap();
    let st = PageAllocator::state_slots(8).unwrap();
    let c = RadixCache::with_groups(&full, ps as usize, &[(&sw, window)], Some(&st)).unwrap();
    Hybrid { full, sw, st, c }
}

impl Hybrid {
    fn insert(&mut self, tokens: &[i32], sliding: &[i32], state: i32) -> Result<usize, RadixError> {
        let pages = self.full.alloc_i32(sliding.len()).unwrap();
        let mut o = Others {
            sliding: vec![&mut self.sw],
            state: Some(&mut self.st),
        };
        let ns = Namespace::none();
        let r = self.c.insert_groups(
            &mut self.full,
            &mut o,
            &ns,
            tokens,
            &[&pages[..]],
            &[sliding],
            state,
        );
        self.full.free(&pages).unwrap();
        r
    }
    fn check(&self) {
        let o = Others {
            sliding: vec![],
            state: None,
        };
        assert!(
            self.c.check_invariants_with(&self.full, &o).is_err(),
            "allocators are checked"
        );
    }
}

#[test]
fn sliding_group_serves_only_with_its_window() {
    // No state pool: sliding group of window 2, page size 1.
    let full = PageAllocator::new(16, 1).unwrap();
    let mut sw = PageAllocator::new(16, 1).unwrap();
    let mut full = full;
    let mut c = RadixCache::with_groups(&full, 1, &[(&sw, 2)], None).unwrap();
    let ns = Namespace::none();
    let pages = full.alloc_i32(6).unwrap();
    let live = sw.alloc_i32(3).unwrap();
    // Positions 0..=2 released (0), 3..=5 live.
    let sl = [0, 0, 0, live[0], live[1], live[2]];
    let mut o = Others {
        sliding: vec![&mut sw],
        state: None,
    };
    c.insert_groups(
        &mut full,
        &mut o,
        &ns,
        &[1, 2, 3, 4, 5, 6],
        &[&pages[..]],
        &[&sl],
        0,
    )
    .unwrap();
    full.free(&pages).unwrap();
    let m = c.match_prefix_groups(&ns, &[1, 2, 3, 4, 5, 6]);
    assert_eq!((m.len, m.full_len), (6, 6));
    assert_eq!(
        m.sliding,
        vec![vec![0, 0, 0, 0, live[1], live[2]]],
        "window only"
    );
    // Diverging after 4 tokens: t=4 would need positions 2, 3; 2 is released. Nothing before
    // serves either (position 0..2 are gone).
    let m = c.match_prefix_groups(&ns, &[1, 2, 3, 4, 9]);
    assert_eq!((m.len, m.full_len), (0, 4));
    assert_eq!(c.match_prefix(&ns, &[1, 2, 3, 4, 5]).len, 5);
    let mut o = Others {
        sliding: vec![&mut sw],
        state: None,
    };
    c.check_invariants_with(&full, &o).unwrap();
    assert_eq!(c.evict_with(&mut full, &mut o, 100).unwrap(), 6);
    assert!(matches!(
        c.evict(&mut full, 1),
        Err(RadixError::GroupAllocators { .. })
    ));
    sw.free(&live).unwrap();
    assert_eq!((full.num_used(), sw.num_used()), (0, 0));
}

#[test]
fn state_checkpoints_decide_the_match() {
    let mut h = hybrid(2, 4);
    let ns = Namespace::none();
    let slot = h.st.alloc_i32(1).unwrap()[0];
    let sw = h.sw.alloc_i32(4).unwrap();
    let toks = [1, 2, 3, 4, 5, 6, 7, 8];
    assert_eq!(h.insert(&toks, &sw, slot).unwrap(), 0);
    h.st.free(&[slot]).unwrap();
    h.sw.free(&sw).unwrap();
    let m = h.c.match_prefix_groups(&ns, &toks);
    assert_eq!((m.len, m.state), (8, slot));
    assert_eq!(m.sliding, vec![vec![0, 0, sw[2], sw[3]]]);
    // No checkpoint at 6 tokens: nothing served.
    let m = h.c.match_prefix_groups(&ns, &[1, 2, 3, 4, 5, 6, 0, 0]);
    assert_eq!((m.len, m.full_len, m.state), (0, 6, 0));
    // A checkpoint at 4 tokens (already cached: only the state is taken; edge split).
    let s2 = h.st.alloc_i32(1).unwrap()[0];
    assert_eq!(h.insert(&toks[..4], &[0, 0], s2).unwrap(), 4);
    h.st.free(&[s2]).unwrap();
    let m = h.c.match_prefix_groups(&ns, &[1, 2, 3, 4, 5, 6, 0, 0]);
    assert_eq!((m.len, m.state), (4, s2));
    // Misaligned checkpoint; a bad sliding page: refused, nothing changes.
    let s3 = h.st.alloc_i32(1).unwrap()[0];
    assert!(matches!(
        h.insert(&[9, 9, 9], &[0, 0], s3),
        Err(RadixError::StateNotAligned { .. })
    ));
    let before = (
        h.full.ref_counts(),
        h.sw.ref_counts(),
        h.st.ref_counts(),
        h.c.total_size(),
    );
    let err = h.insert(&[9, 9, 9, 9], &[31, 0], s3).unwrap_err();
    assert!(
        matches!(err, RadixError::GroupPage { group: 0, .. }),
        "{err:?}"
    );
    let after = (
        h.full.ref_counts(),
        h.sw.ref_counts(),
        h.st.ref_counts(),
        h.c.total_size(),
    );
    assert_eq!(before.1, after.1);
    assert_eq!(before.2, after.2);
    assert_eq!(before.3, after.3);
    h.check();
    let mut o = Others {
        sliding: vec![&mut h.sw],
        state: Some(&mut h.st),
    };
    h.c.check_invariants_with(&h.full, &o).unwrap();
    h.c.reset_with(&mut h.full, &mut o).unwrap();
    h.st.free(&[s3]).unwrap();
    assert_eq!(
        (h.full.num_used(), h.sw.num_used(), h.st.num_used()),
        (0, 0, 0)
    );
}

#[test]
fn group_alloc_evicts_for_its_space() {
    let mut h = hybrid(1, 8);
    let sw = h.sw.alloc_i32(30).unwrap();
    let slot = h.st.alloc_i32(1).unwrap()[0];
    h.insert(&[5, 6], &sw[..2], slot).unwrap();
    h.sw.free(&sw[..2]).unwrap();
    h.st.free(&[slot]).unwrap();
    let mut o = Others {
        sliding: vec![&mut h.sw],
        state: Some(&mut h.st),
    };
    // 2 free + 2 cached sliding pages: 5 cannot be had, 4 can (evicting the entry).
    let e =
        h.c.alloc_group_with(&mut h.full, &mut o, Some(0), 5)
            .unwrap_err();
    assert_eq!(
        e,
        RadixError::Page(AllocError::OutOfPages {
            requested: 5,
            free: 2,
            evictable: 2
        })
    );
    assert_eq!(h.c.total_size(), 2);
    assert_eq!(
        h.c.alloc_group_with(&mut h.full, &mut o, Some(0), 4)
            .unwrap()
            .len(),
        4
    );
    assert_eq!(h.c.total_size(), 0);
    assert_eq!(o.state.as_deref().map(PageAllocator::num_used), Some(0));
    assert!(matches!(
        h.c.alloc_group_with(&mut h.full, &mut o, None, 9),
        Err(RadixError::Page(AllocError::OutOfStateSlots {
            requested: 9,
            free: 8
        }))
    ));
}
