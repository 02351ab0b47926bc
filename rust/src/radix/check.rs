//! `check_invariants`: the structural invariants of the device tier, checked O(tree) (for
//! tests; the host tier's are in `tier_check`).

use super::{lru_key, RadixCache, RadixError, NONE, SUPER};
use crate::alloc::{PageAllocator, PageId};

impl RadixCache {
    /// Checks every structural invariant against `alloc` (O(tree); for tests).
    ///
    /// # Errors
    /// [`RadixError::Corrupt`] naming the first broken invariant.
    pub fn check_invariants(&self, alloc: &PageAllocator) -> Result<(), RadixError> {
        let bad = |s: String| Err(RadixError::Corrupt(s));
        self.check_alloc(alloc)?;
        let ps = self.page_size;
        let (mut evictable, mut protected, mut in_lru) = (0, 0, 0);
        let mut seen = vec![false; alloc.num_pages() + 1];
        for (i, n) in self.nodes.iter().enumerate() {
            let id = i as u32;
            if !n.live {
                if !self.free_slots.contains(&id) {
                    return bad(format!("dead slot {id} not on the free list"));
                }
                continue;
            }
            let child_locks: u64 = n.children.ids().map(|c| u64::from(self.node(c).lock)).sum();
            if u64::from(n.lock) != child_locks + u64::from(n.own_locks) {
                return bad(format!(
                    "node {id}: lock {} != own {} + children {child_locks}",
                    n.lock, n.own_locks
                ));
            }
            if n.children.ids().count() != n.children.len() || !n.children.well_formed() {
                return bad(format!("node {id}: child count or representation wrong"));
            }
            for (first, c) in n.children.entries() {
                let cn = self.node(c);
                let found = cn.key().get(..ps).and_then(|page| self.child(id, page));
                if !cn.live
                    || cn.parent != id
                    || cn.key().first() != Some(&first)
                    || found != Some(c)
                {
                    return bad(format!("node {id}: child {c} mislinked"));
                }
            }
            if id == SUPER {
                continue;
            }
            if n.key().is_empty() {
                let ok = n.parent == NONE
                    && n.ns
                        .as_ref()
                        .is_some_and(|ns| self.roots.get(ns) == Some(&id))
                    && !n.children.is_empty();
                if !ok {
                    return bad(format!("namespace root {id} malformed or childless"));
                }
                continue;
            }
            if n.key().len() != n.pages().len() * ps
                || n.parent == NONE
                || !self.node(n.parent).live
            {
                return bad(format!(
                    "node {id}: {} tokens, {} pages, parent {}",
                    n.key().len(),
                    n.pages().len(),
                    n.parent
                ));
            }
            let parent = self.node(n.parent);
            if !parent.key().is_empty() && parent.last_access < n.last_access {
                return bad(format!("node {id} accessed after its parent"));
            }
            if n.host {
                continue; // host pages and LRU: `check_invariants_tiered`
            }
            if n.lock == 0 && n.ret.pins == 0 {
                evictable += n.key().len();
            } else {
                protected += n.key().len();
            }
            if n.in_lru != self.is_evictable_leaf(id)
                || (n.in_lru && !self.lru.contains(&lru_key(n, id)))
            {
                return bad(format!("node {id}: LRU membership wrong"));
            }
            in_lru += usize::from(n.in_lru);
            for &raw in n.pages() {
                let i = raw as u32 as usize;
                let Some(p) = PageId::new(raw as u32).filter(|_| i < seen.len()) else {
                    return bad(format!("page {raw} stored in the tree is not a usable id"));
                };
                if seen[i] || !alloc.is_cached(p) || alloc.ref_count(p) == 0 {
                    return bad(format!("page {i}: held twice, unmarked or free"));
                }
                seen[i] = true;
            }
        }
        let shared = (1..=alloc.num_pages() as u32)
            .filter_map(PageId::new)
            .filter(|&p| alloc.is_cached(p) && alloc.ref_count(p) >= 2)
            .count();
        if shared != alloc.shared_cached() {
            return bad(format!(
                "allocator counts {} shared cached pages, there are {shared}",
                alloc.shared_cached()
            ));
        }
        if (evictable, protected) != (self.evictable, self.protected) {
            return bad(format!(
                "sizes: counted evictable {evictable} protected {protected}, kept {} {}",
                self.evictable, self.protected
            ));
        }
        if in_lru != self.lru.len() {
            return bad("stale LRU entries".into());
        }
        self.check_retention()?;
        self.check_events().map_err(RadixError::Corrupt)?;
        for (ns, &r) in &self.roots {
            if self.node(r).ns.as_deref() != Some(&ns[..]) {
                return bad(format!("root {r} has the wrong namespace"));
            }
        }
        Ok(())
    }
}
