//! The host-memory tier of the radix cache: evicted device pages demoted to host pages instead of
//! dropped, matched and loaded back later.
//!
//! A node is on the device tier (its edge holds device page ids, from the cache's allocator) or
//! on the host tier (host page ids, from the host allocator given at construction). Host nodes
//! form the lower part of the tree: every child of a host node is a host node, so the device
//! nodes are a prefix-closed subtree and a device match ([`RadixCache::match_prefix`]) stops at
//! the first host node.
//!
//! - **Demotion.** With a host tier, eviction of an unlocked device node whose children are all on
//!   the host (a device leaf) demotes it: the node keeps its tokens, takes host pages (the host
//!   tier first drops its own least-recently-used leaves when its pool is short) and drops the
//!   tree's reference on the device pages. The (device page, host page) pairs whose bytes must be
//!   copied before the device pages are written again wait in [`RadixCache::take_demotions`].
//!   A node the host pool cannot hold even after dropping every unheld host entry is dropped
//!   with its host subtree, as without a tier.
//! - **Match.** [`RadixCache::match_prefix_host`] returns the host pages that continue the device
//!   match (splitting the host edge where the match ends); it changes no device counter.
//! - **Load back.** [`RadixCache::load_back`] swaps a host node (and its host ancestors up to the
//!   device tier) to device pages the caller filled, taking the tree's reference on them and
//!   dropping the host pages. `insert` over host nodes does the same with the caller's pages
//!   (a request that recomputed the prefix).
//! - Host nodes are never locked or pinned (`lock` or `pin` of one raises
//!   [`RadixError::OnHost`]); the host pages a loader is still reading can be protected with the
//!   host allocator's `inc_ref`.
//! - **KV events.** A demotion records `BlockRemoved` (GPU) and `BlockStored` (CPU) for the
//!   node's pages, a load back the reverse, a dropped host node `BlockRemoved` (CPU) (see
//!   `events`).
//! - **Retention.** Demotion follows the eviction order (lowest priority, then least recently
//!   used; pinned nodes are never demoted), and the host tier drops its own leaves in the same
//!   (priority, last access) order; a host node keeps its priority and expiry.
//!
//! Every call validates its input before changing anything. Hybrid caches (sliding groups, state
//! slots) take no host tier ([`RadixError::HostTierHybrid`]).

use std::collections::BTreeSet;

use super::{lru_key, EvictKey, Handle, Namespace, Others, RadixCache, RadixError, Sink};
use super::{Medium, NONE, SUPER};
use crate::alloc::{PageAllocator, RawPage};

/// Counters of the host tier, in pages and tokens since construction or `reset`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TierStats {
    /// Device pages demoted to host pages (copies handed out by `take_demotions`).
    pub demoted_pages: u64,
    /// Device pages evicted without a host copy (the host pool could not take the node).
    pub dropped_pages: u64,
    /// Host pages dropped by the host tier's own LRU eviction (or with a dropped device node).
    pub host_evicted_pages: u64,
    /// Host pages loaded back to the device by `load_back` (`insert` over host nodes, which
    /// takes recomputed pages, is not counted).
    pub loaded_pages: u64,
    /// Tokens asked of `match_prefix_host` (after the device match).
    pub host_query_tokens: u64,
    /// Tokens `match_prefix_host` found on the host tier.
    pub host_hit_tokens: u64,
}

/// What the cache keeps for its host tier.
#[derive(Debug)]
pub(super) struct Tier {
    host_id: u64,
    /// Host nodes without children, by (last access, slot): the host tier's eviction order.
    /// Host leaves keyed as the device LRU is, by (priority, last access, slot).
    lru: BTreeSet<EvictKey>,
    /// Tokens stored on the host tier.
    tokens: usize,
    /// Demotions not yet taken: (device page, host page).
    pending: Vec<(i32, i32)>,
    /// Host pages of nodes promoted by `insert` (which has no host allocator), released by the
    /// tiered entry point right after.
    release: Vec<i32>,
    stats: TierStats,
}

impl Tier {
    fn new(host_id: u64) -> Box<Self> {
        Box::new(Self {
            host_id,
            lru: BTreeSet::new(),
            tokens: 0,
            pending: Vec::new(),
            release: Vec::new(),
            stats: TierStats::default(),
        })
    }

    /// The tier of a reset cache: empty, counters zeroed, over the same host allocator.
    pub(super) fn after_reset(&self) -> Box<Self> {
        Self::new(self.host_id)
    }
}

/// Result of [`RadixCache::match_prefix_host`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostMatch {
    /// Host page ids continuing the device match (`len / page_size` of them).
    pub pages: Vec<i32>,
    /// The node where the host match ends (the device match's end when `len == 0`).
    pub node: Handle,
    /// Tokens matched on the host tier after the device match.
    pub len: usize,
    /// Tokens of the device match before them.
    pub device_len: usize,
}

impl RadixCache {
    /// An empty cache over `alloc` with a host tier over `host` (same page size).
    ///
    /// # Errors
    /// [`RadixError::PageSizeMismatch`]; [`RadixError::SharedAllocator`] when `host` is `alloc`.
    pub fn with_host(
        alloc: &PageAllocator,
        page_size: usize,
        host: &PageAllocator,
    ) -> Result<Self, RadixError> {
        let mut c = Self::new(alloc, page_size)?;
        c.enable_host_tier(alloc, host)?;
        Ok(c)
    }

    /// Adds a host tier over `host` to an empty, plain cache.
    ///
    /// # Errors
    /// [`RadixError::HostTierHybrid`] for a hybrid cache, [`RadixError::PageSizeMismatch`],
    /// [`RadixError::SharedAllocator`] when `host` is the cache's allocator, [`RadixError::Locked`]
    /// when the cache is not empty (it already has a tier, or holds tokens).
    pub fn enable_host_tier(
        &mut self,
        alloc: &PageAllocator,
        host: &PageAllocator,
    ) -> Result<(), RadixError> {
        self.check_alloc(alloc)?;
        if self.groups.is_some() {
            return Err(RadixError::HostTierHybrid);
        }
        if host.page_size() != self.page_size {
            return Err(RadixError::PageSizeMismatch {
                cache: self.page_size,
                allocator: host.page_size(),
            });
        }
        if host.id() == alloc.id() {
            return Err(RadixError::SharedAllocator);
        }
        if self.tier.is_some() || self.total_size() > 0 {
            return Err(RadixError::HostTierBusy);
        }
        self.tier = Some(Tier::new(host.id()));
        Ok(())
    }

    /// Whether the cache has a host tier.
    pub fn has_host_tier(&self) -> bool {
        self.tier.is_some()
    }
    /// Tokens stored on the host tier (0 without one).
    pub fn host_size(&self) -> usize {
        self.tier.as_ref().map_or(0, |t| t.tokens)
    }
    /// The host tier's counters (zero without one).
    pub fn tier_stats(&self) -> TierStats {
        self.tier.as_ref().map_or_else(TierStats::default, |t| t.stats)
    }
    /// Demotions since the last call: (device page, host page) pairs, in the order they were
    /// made. Copy each device page's bytes to its host page before the device page is written
    /// again (it may already be handed out); a host page listed twice takes the later copy.
    pub fn take_demotions(&mut self) -> Vec<(i32, i32)> {
        self.tier
            .as_mut()
            .map_or_else(Vec::new, |t| std::mem::take(&mut t.pending))
    }

    /// Plain entry points refuse a cache with a host tier (they cannot reach its allocator).
    pub(super) fn check_no_tier(&self) -> Result<(), RadixError> {
        if self.tier.is_some() {
            Err(RadixError::HostAllocator { has_tier: true })
        } else {
            Ok(())
        }
    }

    pub(super) fn check_host(
        &self,
        alloc: &PageAllocator,
        host: &PageAllocator,
    ) -> Result<(), RadixError> {
        self.check_alloc(alloc)?;
        match &self.tier {
            None => Err(RadixError::HostAllocator { has_tier: false }),
            Some(t) if t.host_id != host.id() => Err(RadixError::WrongAllocator),
            Some(_) => Ok(()),
        }
    }

    /// `lock` refuses host nodes (they hold no device pages to protect).
    pub(super) fn check_device(&self, id: u32) -> Result<(), RadixError> {
        if self.node(id).host {
            Err(RadixError::OnHost { node: id })
        } else {
            Ok(())
        }
    }

    /// Host-LRU membership of host node `id` after its children or access time changed.
    pub(super) fn refresh_host(&mut self, id: u32) {
        let n = &self.nodes[id as usize];
        let want = n.live && n.host && n.children.is_empty();
        let (was, key) = (n.in_host_lru, lru_key(n, id));
        let Some(t) = self.tier.as_mut() else { return };
        if was {
            t.lru.remove(&key);
        }
        if want {
            t.lru.insert(key);
        }
        self.nodes[id as usize].in_host_lru = want;
    }

    /// Re-keys host leaf `id` (in the host LRU) at `priority` (retention: a decay or a raise).
    pub(super) fn rekey_host(&mut self, id: u32, priority: u8) {
        let n = &self.nodes[id as usize];
        let (old, last) = (lru_key(n, id), n.last_access);
        if let Some(t) = self.tier.as_mut() {
            t.lru.remove(&old);
            t.lru.insert((priority, last, id));
        }
    }

    /// Moves host node `id` in the host LRU from access time `old` to `clock`.
    pub(super) fn touch_host(&mut self, id: u32, old: u64, clock: u64) {
        if let Some(t) = self.tier.as_mut() {
            let p = self.nodes[id as usize].ret.priority;
            t.lru.remove(&(p, old, id));
            t.lru.insert((p, clock, id));
        }
    }

    /// Bookkeeping of a host leaf leaving the tree (called by `remove_leaf`): host LRU, host
    /// token count and its parent's host-children count. Returns whether it was a host node.
    pub(super) fn forget_host(&mut self, id: u32) -> bool {
        let n = &self.nodes[id as usize];
        if !n.host {
            return false;
        }
        let (key, was, len, parent) = (lru_key(n, id), n.in_host_lru, n.key().len(), n.parent);
        if let Some(t) = self.tier.as_mut() {
            if was {
                t.lru.remove(&key);
            }
            t.tokens -= len;
        }
        self.nodes[id as usize].in_host_lru = false;
        self.node_mut(parent).host_kids -= 1;
        true
    }

    /// Drops host leaves, least recently used first, until `host` has `need` free pages.
    /// Returns false (having dropped what it could) when that is not reachable.
    fn make_host_room(&mut self, host: &mut PageAllocator, need: usize) -> bool {
        while host.num_free() < need {
            let Some(&(_, _, id)) = self.tier.as_ref().and_then(|t| t.lru.first()) else {
                return false;
            };
            self.drop_host_leaf(host, id);
        }
        true
    }

    fn drop_host_leaf(&mut self, host: &mut PageAllocator, id: u32) {
        let np = self.node(id).pages().len() as u64;
        if let Some(t) = self.tier.as_mut() {
            t.stats.host_evicted_pages += np;
        }
        self.remove_leaf(host, &mut Others::default(), id, &mut Vec::new(), 0);
    }

    /// Drops every host node below device node `id` (deepest first).
    fn drop_host_subtree(&mut self, host: &mut PageAllocator, id: u32) {
        let mut order = Vec::new();
        let mut stack: Vec<u32> = self.node(id).children.ids().collect();
        while let Some(c) = stack.pop() {
            order.push(c);
            stack.extend(self.node(c).children.ids());
        }
        // Children come after their parent in `order`: dropping it backwards drops leaves only.
        for &c in order.iter().rev() {
            self.drop_host_leaf(host, c);
        }
    }

    /// Demotes device leaf `id` (unlocked, all children on the host), or drops it with its host
    /// subtree when the host pool cannot take it. Its device pages go to `out` up to `want`, as
    /// `remove_leaf` does.
    pub(super) fn demote(
        &mut self,
        alloc: &mut PageAllocator,
        host: &mut PageAllocator,
        id: u32,
        out: &mut Vec<i32>,
        want: usize,
    ) {
        let np = self.node(id).pages().len();
        let held = self.tier.as_ref().map_or(0, |t| t.tokens) / self.page_size;
        let fits = np <= host.num_free() + held && self.make_host_room(host, np);
        if !fits {
            if let Some(t) = self.tier.as_mut() {
                t.stats.dropped_pages += np as u64;
            }
            self.drop_host_subtree(host, id);
            self.remove_leaf(alloc, &mut Others::default(), id, out, want);
            return;
        }
        // Room made: none of these can fail (free pages, taken once, the holder dropped).
        let mut hp = Vec::with_capacity(np);
        let ok = host.alloc_into(&mut hp, np).is_ok()
            && host.cache_pages(&hp).is_ok()
            && host.free(&hp).is_ok();
        debug_assert!(ok, "host pages could not be taken after making room");
        let n = &mut self.nodes[id as usize];
        let (key_len, parent, was, key) = (n.key_len as usize, n.parent, n.in_lru, lru_key(n, id));
        let dev: Vec<i32> = n.data[key_len..].to_vec();
        n.data[key_len..].copy_from_slice(&hp);
        n.host = true;
        n.in_lru = false;
        if was {
            self.lru.remove(&key);
        }
        self.evictable -= key_len;
        if let Some(t) = self.tier.as_mut() {
            t.tokens += key_len;
            t.pending.extend(dev.iter().copied().zip(hp.iter().copied()));
            t.stats.demoted_pages += np as u64;
        }
        alloc.release_cached_into(&dev, out, want);
        self.node_mut(parent).host_kids += 1;
        self.refresh_host(id);
        self.refresh(parent);
        self.events_moved(id, Medium::Gpu, Medium::Cpu);
    }

    /// [`evict`](Self::evict) with the host tier: the nodes evicted are demoted (see the module
    /// docs). Returns the tokens that left the device tier.
    ///
    /// # Errors
    /// [`RadixError::WrongAllocator`], [`RadixError::HostAllocator`] without a host tier.
    pub fn evict_tiered(
        &mut self,
        alloc: &mut PageAllocator,
        host: &mut PageAllocator,
        num_tokens: usize,
    ) -> Result<usize, RadixError> {
        self.check_host(alloc, host)?;
        Ok(self.evict_tokens(alloc, &mut Sink::Demote(host), num_tokens))
    }

    /// [`alloc_i32`](Self::alloc_i32) with the host tier: the nodes evicted to free pages are
    /// demoted; drain [`take_demotions`](Self::take_demotions) before writing the pages.
    ///
    /// # Errors
    /// As [`alloc`](Self::alloc) (nothing is evicted on error), plus
    /// [`RadixError::HostAllocator`].
    pub fn alloc_tiered(
        &mut self,
        alloc: &mut PageAllocator,
        host: &mut PageAllocator,
        n: usize,
    ) -> Result<Vec<i32>, RadixError> {
        self.check_host(alloc, host)?;
        self.alloc_evicting(alloc, &mut Sink::Demote(host), n)
    }

    /// [`insert_parts`](Self::insert_parts) with the host tier: host nodes on the inserted path
    /// take the caller's pages at their positions (as [`load_back`](Self::load_back) does) and
    /// their host pages are dropped. Returns the tokens already cached on the device.
    ///
    /// # Errors
    /// As [`insert`](Self::insert), plus [`RadixError::HostAllocator`].
    pub fn insert_tiered<P: RawPage>(
        &mut self,
        alloc: &mut PageAllocator,
        host: &mut PageAllocator,
        ns: &Namespace,
        tokens: &[i32],
        parts: &[&[P]],
    ) -> Result<usize, RadixError> {
        self.check_host(alloc, host)?;
        let r = self.insert_inner(alloc, ns, tokens, parts);
        if let Some(t) = self.tier.as_mut() {
            let rel = std::mem::take(&mut t.release);
            host.release_cached_all(&rel);
        }
        Ok(r?.0)
    }

    /// For `insert_inner`: the host nodes it walked (from `first`, which the walk entered at
    /// token `from`, down to `end`, the deepest node walked) take the pages `taken[..k]` in path
    /// order; their host pages wait in `release`. Returns `k`, the pages used.
    pub(super) fn promote_walked<P: RawPage>(
        &mut self,
        first: Option<(u32, usize)>,
        end: u32,
        taken: &[P],
    ) -> usize {
        let Some((first, _)) = first else { return 0 };
        let mut chain = vec![end];
        while *chain.last().unwrap_or(&first) != first {
            let up = self.node(*chain.last().unwrap_or(&first)).parent;
            chain.push(up);
        }
        chain.reverse();
        let pages: Vec<i32> = taken.iter().map(|p| p.to_i64() as i32).collect();
        let old = self.promote_chain(&chain, &pages);
        if let Some(t) = self.tier.as_mut() {
            t.release.extend_from_slice(&old);
        }
        old.len()
    }

    /// Swaps the host nodes `chain` (top-down, each the parent of the next) to the device pages
    /// `pages` (in path order, at least as many as the chain holds; validated and referenced by
    /// the caller). Returns their host pages, to release.
    fn promote_chain(&mut self, chain: &[u32], pages: &[i32]) -> Vec<i32> {
        let mut old = Vec::new();
        let mut at = 0;
        for &id in chain {
            let n = &mut self.nodes[id as usize];
            let (kl, np) = (n.key_len as usize, n.pages().len());
            old.extend_from_slice(&n.data[kl..]);
            n.data[kl..].copy_from_slice(&pages[at..at + np]);
            at += np;
            n.host = false;
            n.host_kids = n.children.len() as u32;
            let (was, key, parent) = (n.in_host_lru, lru_key(n, id), n.parent);
            n.in_host_lru = false;
            if let Some(t) = self.tier.as_mut() {
                if was {
                    t.lru.remove(&key);
                }
                t.tokens -= kl;
            }
            self.evictable += kl;
            self.node_mut(parent).host_kids -= 1;
        }
        if let Some(&top) = chain.first() {
            let parent = self.node(top).parent;
            if !self.node(parent).key().is_empty() {
                self.refresh(parent);
            }
        }
        for &id in chain {
            self.refresh(id);
            self.events_moved(id, Medium::Cpu, Medium::Gpu);
        }
        old
    }

    /// The host pages continuing the longest device match of `tokens` in `ns`: device nodes are
    /// walked as [`match_prefix`](Self::match_prefix) does (nothing split there, no device
    /// counter changed), then host nodes; the host edge is split where the match ends inside it.
    /// Updates access times along the path and the tier's counters.
    pub fn match_prefix_host(&mut self, ns: &Namespace, tokens: &[i32]) -> HostMatch {
        self.clock += 1;
        let clock = self.clock;
        let ps = self.page_size;
        let aligned = tokens.len() / ps * ps;
        let (mut node, mut pos, mut device_len) = (SUPER, 0, 0);
        let mut pages = Vec::new();
        let mut path = Vec::new();
        if let (Some(&root), true) = (self.roots.get(ns.as_bytes()), self.tier.is_some()) {
            let mut cur = root;
            while pos < aligned {
                let Some(child) = self.child(cur, &tokens[pos..pos + ps]) else {
                    break;
                };
                let c = self.node(child);
                let m = super::common_prefix(c.key(), &tokens[pos..aligned]) / ps * ps;
                let whole = m == c.key().len();
                if !c.host && !whole {
                    break; // the device match ends inside a device edge: no host pages follow
                }
                if c.host {
                    pages.extend_from_slice(&c.pages()[..m / ps]);
                } else {
                    device_len = pos + m;
                }
                pos += m;
                cur = if whole { child } else { self.split(child, m) };
                path.push(cur);
                node = cur;
                if !whole {
                    break;
                }
            }
        }
        // Touch root-down so that every parent stays at least as recent as its children.
        for &id in &path {
            self.touch(id, clock);
        }
        let len = pos - device_len;
        if let Some(t) = self.tier.as_mut() {
            t.stats.host_query_tokens += (tokens.len() - device_len) as u64;
            t.stats.host_hit_tokens += len as u64;
        }
        if len == 0 {
            // The handle names the device match's end (as `match_prefix` would).
            while node != SUPER && node != NONE && self.node(node).host {
                node = self.node(node).parent;
            }
            if node != SUPER && self.node(node).key().is_empty() {
                node = SUPER;
            }
        }
        HostMatch {
            pages,
            node: self.handle(node),
            len,
            device_len,
        }
    }

    /// Moves host node `h` and its host ancestors (up to the device tier) back to the device:
    /// they take `pages` (device page ids in path order, one per page of those nodes, filled
    /// with the host pages' bytes by the caller), the tree takes its reference on them and drops
    /// the host pages. Returns the tokens loaded back.
    ///
    /// # Errors
    /// [`RadixError::StaleHandle`]; [`RadixError::NotOnHost`] for a device node;
    /// [`RadixError::LoadLength`] when `pages` does not have one id per host page above `h`; a
    /// bad device page (padding, out of range, free, repeated, already cached). Nothing changes
    /// then.
    pub fn load_back(
        &mut self,
        alloc: &mut PageAllocator,
        host: &mut PageAllocator,
        h: Handle,
        pages: &[i32],
    ) -> Result<usize, RadixError> {
        self.check_host(alloc, host)?;
        let id = self.resolve(h)?;
        if !self.node(id).host {
            return Err(RadixError::NotOnHost { node: id });
        }
        let mut chain = vec![id];
        loop {
            let up = self.node(*chain.last().unwrap_or(&id)).parent;
            if up == NONE || !self.node(up).host {
                break;
            }
            chain.push(up);
        }
        chain.reverse();
        let need: usize = chain.iter().map(|&c| self.node(c).pages().len()).sum();
        if pages.len() != need {
            return Err(RadixError::LoadLength {
                node: id,
                expected: need,
                got: pages.len(),
            });
        }
        alloc.cache_pages(pages)?;
        let old = self.promote_chain(&chain, pages);
        host.release_cached_all(&old);
        if let Some(t) = self.tier.as_mut() {
            t.stats.loaded_pages += need as u64;
        }
        Ok(need * self.page_size)
    }

}

#[path = "tier_check.rs"]
mod check;

#[cfg(test)]
#[path = "tier_tests.rs"]
mod tests;

#[cfg(test)]
#[path = "tier_retention_tests.rs"]
mod retention_tests;

#[cfg(test)]
#[path = "tier_events_tests.rs"]
mod events_tests;
