//! The host tier's whole-cache operations: `reset_tiered` and the invariant checks of both tiers.

use super::Sink;
use crate::alloc::PageAllocator;
use crate::radix::{RadixCache, RadixError};

impl RadixCache {
    /// [`reset`](Self::reset) with the host tier: both tiers emptied, counters zeroed, pending
    /// demotions dropped.
    ///
    /// # Errors
    /// [`RadixError::Locked`] while any lock is held; [`RadixError::HostAllocator`].
    pub fn reset_tiered(
        &mut self,
        alloc: &mut PageAllocator,
        host: &mut PageAllocator,
    ) -> Result<(), RadixError> {
        self.reset_into(alloc, &mut Sink::Demote(host))
    }

    /// Checks the host tier's invariants (and the device tier's, as `check_invariants`).
    ///
    /// # Errors
    /// [`RadixError::Corrupt`] naming the first broken invariant.
    pub fn check_invariants_tiered(
        &self,
        alloc: &PageAllocator,
        host: &PageAllocator,
    ) -> Result<(), RadixError> {
        self.check_host(alloc, host)?;
        self.check_invariants(alloc)?;
        let bad = |s: String| Err(RadixError::Corrupt(s));
        let Some(t) = self.tier.as_ref() else {
            return Ok(());
        };
        let mut seen = vec![false; host.num_pages() + 1];
        let (mut tokens, mut in_lru) = (0, 0);
        for (i, n) in self.nodes.iter().enumerate() {
            let id = i as u32;
            if !n.live || n.key().is_empty() {
                continue;
            }
            let host_kids = n.children.ids().filter(|&c| self.node(c).host).count();
            if host_kids != n.host_kids as usize {
                return bad(format!("node {id}: {host_kids} host children, counted {}", n.host_kids));
            }
            if !n.host {
                if n.in_host_lru {
                    return bad(format!("device node {id} in the host LRU"));
                }
                continue;
            }
            if n.lock != 0 || n.own_locks != 0 || n.in_lru || host_kids != n.children.len() {
                return bad(format!("host node {id}: locked, in the device LRU or with a device child"));
            }
            let want = n.children.is_empty();
            if n.in_host_lru != want || (want && !t.lru.contains(&super::lru_key(n, id))) {
                return bad(format!("host node {id}: host LRU membership wrong"));
            }
            in_lru += usize::from(want);
            tokens += n.key().len();
            for &raw in n.pages() {
                let k = raw as u32 as usize;
                let ok = crate::alloc::PageId::new(raw as u32)
                    .filter(|&p| k < seen.len() && host.is_cached(p))
                    .is_some();
                if !ok || seen[k] {
                    return bad(format!("host page {raw}: not the host allocator's, uncached or held twice"));
                }
                seen[k] = true;
            }
        }
        if tokens != t.tokens || in_lru != t.lru.len() {
            return bad(format!(
                "host tier: counted {tokens} tokens and {in_lru} leaves, kept {} and {}",
                t.tokens,
                t.lru.len()
            ));
        }
        let cached = (1..=host.num_pages() as u32)
            .filter_map(crate::alloc::PageId::new)
            .filter(|&p| host.is_cached(p))
            .count();
        if cached != seen.iter().filter(|&&s| s).count() {
            return bad(format!("host allocator marks {cached} pages cached, the tree holds fewer"));
        }
        Ok(())
    }
}
