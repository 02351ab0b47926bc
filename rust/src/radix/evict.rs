//! Eviction: the plan (which nodes go, lowest priority and least recently used first) and
//! its application (nodes dropped or demoted to the host tier), with the public calls that
//! evict (`evict`, `alloc`).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use super::{lru_key, EvictKey, Goal, Others, Plan, RadixCache, RadixError, Sink, SUPER};
use crate::alloc::{AllocError, PageAllocator, PageId};

impl RadixCache {
    /// The eviction order that reaches `goal`: least recently used unlocked leaves first, parents
    /// once all their children are gone. Changes nothing; stops early when the goal is reached.
    pub(super) fn plan(&mut self, alloc: &PageAllocator, others: &Others<'_>, goal: &Goal) -> Plan {
        self.expire();
        let mut plan = Plan {
            order: Vec::new(),
            tokens: 0,
            freed_pages: 0,
        };
        let mut leaves = self.lru.iter().copied().peekable();
        let mut exposed: BinaryHeap<Reverse<EvictKey>> = BinaryHeap::new();
        let mut gone: HashMap<u32, usize> = HashMap::new();
        // With no cached page shared, every evicted page is freed: no need to look at each.
        let exact = alloc.shared_cached() == 0;
        loop {
            let reached = match *goal {
                Goal::Tokens(n) => plan.tokens >= n,
                Goal::FreePages(n) | Goal::FreeSliding(_, n) | Goal::FreeStateSlots(n) => {
                    plan.freed_pages >= n
                }
            };
            if reached {
                break;
            }
            let next = match (leaves.peek().copied(), exposed.peek().map(|r| r.0)) {
                (Some(a), Some(b)) if b < a => exposed.pop().map(|r| r.0),
                (Some(_), _) => leaves.next(),
                (None, Some(_)) => exposed.pop().map(|r| r.0),
                (None, None) => None,
            };
            let Some((_, _, id)) = next else { break };
            let n = self.node(id);
            plan.order.push(id);
            plan.tokens += n.key().len();
            plan.freed_pages += match *goal {
                Goal::FreeSliding(g, _) => self.freed_in(n, others, Some(g)),
                Goal::FreeStateSlots(_) => self.freed_in(n, others, None),
                _ if exact => n.pages().len(),
                _ => n.pages().iter().filter(|&&p| alloc.only_cached(p)).count(),
            };
            let parent = self.node(n.parent);
            if !parent.key().is_empty() && parent.lock == 0 && parent.ret.pins == 0 {
                let g = gone.entry(n.parent).or_insert(0);
                *g += 1;
                if *g == parent.children.len() - parent.host_kids as usize {
                    exposed.push(Reverse(lru_key(parent, n.parent)));
                }
            }
        }
        plan
    }

    /// Removes an unlocked leaf: drops the tree's reference on its pages.
    /// Pages freed by it go to `out` (allocated) while `out` has fewer than `want`, else to the
    /// free list.
    pub(super) fn remove_leaf(
        &mut self,
        alloc: &mut PageAllocator,
        others: &mut Others<'_>,
        id: u32,
        out: &mut Vec<i32>,
        want: usize,
    ) {
        self.events_removed(id);
        let n = &self.nodes[id as usize];
        if n.in_lru {
            self.lru.remove(&lru_key(n, id));
        }
        self.on_evict(id);
        let n = &self.nodes[id as usize];
        alloc.release_cached_into(n.pages(), out, want);
        if !n.extra.is_empty() {
            self.release_extra(id, others);
        }
        let n = &self.nodes[id as usize];
        let (parent, first, len) = (n.parent, n.key()[0], n.key_len as usize);
        if !self.forget_host(id) {
            self.evictable -= len;
        }
        self.free_node(id);
        self.node_mut(parent).children.remove(first, id);
        let p = self.node(parent);
        if p.key().is_empty() {
            if parent != SUPER && p.children.is_empty() && p.lock == 0 {
                if let Some(ns) = self.node_mut(parent).ns.take() {
                    self.roots.remove(&ns);
                }
                self.free_node(parent);
            }
        } else {
            self.refresh(parent);
        }
    }

    /// Evicts the plan's nodes into `sink`; the pages they free go to `out` (allocated) up to
    /// `want` entries, the rest to the free list.
    pub(super) fn apply(
        &mut self,
        alloc: &mut PageAllocator,
        sink: &mut Sink<'_, '_>,
        plan: &Plan,
        out: &mut Vec<i32>,
        want: usize,
    ) {
        for &id in &plan.order {
            match sink {
                Sink::Drop(others) => self.remove_leaf(alloc, others, id, out, want),
                Sink::Demote(host) => self.demote(alloc, host, id, out, want),
            }
        }
    }

    /// [`plan`](Self::plan) for eviction into `sink` (the extra spaces of a `Sink::Drop`).
    pub(super) fn plan_for(
        &mut self,
        alloc: &PageAllocator,
        sink: &Sink<'_, '_>,
        goal: &Goal,
    ) -> Plan {
        match sink {
            Sink::Drop(others) => self.plan(alloc, others, goal),
            Sink::Demote(_) => self.plan(alloc, &Others::default(), goal),
        }
    }

    /// Evicts into `sink` until at least `num_tokens` tokens left the device tier: the body of
    /// `evict_with` and `evict_tiered`, their allocators checked. Returns the tokens evicted.
    pub(super) fn evict_tokens(
        &mut self,
        alloc: &mut PageAllocator,
        sink: &mut Sink<'_, '_>,
        num_tokens: usize,
    ) -> usize {
        let plan = self.plan_for(alloc, sink, &Goal::Tokens(num_tokens));
        self.apply(alloc, sink, &plan, &mut Vec::new(), 0);
        plan.tokens
    }

    /// Allocates `n` pages, first evicting into `sink` until enough are free (all or nothing):
    /// the body of `alloc_i32_with` and `alloc_tiered`, their allocators checked.
    pub(super) fn alloc_evicting(
        &mut self,
        alloc: &mut PageAllocator,
        sink: &mut Sink<'_, '_>,
        n: usize,
    ) -> Result<Vec<i32>, RadixError> {
        let free = alloc.num_free();
        // (capped: `n` is the caller's, and more than the pool holds fails below)
        let mut out = Vec::with_capacity(n.min(alloc.num_pages()));
        if n > free {
            // Evict until enough pages are free; nothing changes when even evicting all would
            // not do. The pages eviction frees are handed out directly (then the free list's).
            let plan = self.plan_for(alloc, sink, &Goal::FreePages(n - free));
            if plan.freed_pages < n - free {
                return Err(AllocError::OutOfPages {
                    requested: n,
                    free,
                    evictable: plan.freed_pages,
                }
                .into());
            }
            self.apply(alloc, sink, &plan, &mut out, n);
        }
        let rest = n - out.len();
        alloc.alloc_into(&mut out, rest)?;
        Ok(out)
    }

    /// Evicts unlocked, unpinned leaves (then their parents), lowest current priority first and
    /// least recently used within one priority (see `retention`), until at least
    /// `num_tokens` tokens left the tree or nothing evictable is left. Whole nodes go, so more
    /// than asked may be evicted. Returns the tokens evicted.
    ///
    /// # Errors
    /// [`RadixError::WrongAllocator`]; [`RadixError::GroupAllocators`] for a hybrid cache (use
    /// [`evict_with`](Self::evict_with)).
    pub fn evict(
        &mut self,
        alloc: &mut PageAllocator,
        num_tokens: usize,
    ) -> Result<usize, RadixError> {
        self.evict_with(alloc, &mut Others::default(), num_tokens)
    }

    /// [`evict`](Self::evict) for any cache: `others` holds the allocators of the extra page
    /// spaces (sliding groups, state slots) the cache was built with; their pages are released
    /// with the nodes.
    ///
    /// # Errors
    /// [`RadixError::WrongAllocator`], [`RadixError::GroupAllocators`].
    pub fn evict_with(
        &mut self,
        alloc: &mut PageAllocator,
        others: &mut Others<'_>,
        num_tokens: usize,
    ) -> Result<usize, RadixError> {
        self.check_alloc(alloc)?;
        self.check_others(others)?;
        Ok(self.evict_tokens(alloc, &mut Sink::Drop(others), num_tokens))
    }

    /// Allocates `n` pages, first evicting LRU entries until enough pages are free.
    ///
    /// # Errors
    /// [`AllocError::OutOfPages`] (with the pages eviction could reclaim) when even evicting
    /// everything evictable would not free enough; nothing is evicted or allocated then.
    pub fn alloc(
        &mut self,
        alloc: &mut PageAllocator,
        n: usize,
    ) -> Result<Vec<PageId>, RadixError> {
        Ok(self
            .alloc_i32(alloc, n)?
            .into_iter()
            .filter_map(|p| PageId::new(p as u32))
            .collect())
    }

    /// [`alloc`](Self::alloc) returning the ids as int32 (page-table entries).
    ///
    /// # Errors
    /// As [`alloc`](Self::alloc).
    pub fn alloc_i32(
        &mut self,
        alloc: &mut PageAllocator,
        n: usize,
    ) -> Result<Vec<i32>, RadixError> {
        self.alloc_i32_with(alloc, &mut Others::default(), n)
    }

    /// [`alloc_i32`](Self::alloc_i32) for any cache (`others` as for
    /// [`evict_with`](Self::evict_with)).
    ///
    /// # Errors
    /// As [`alloc`](Self::alloc), plus [`RadixError::GroupAllocators`].
    pub fn alloc_i32_with(
        &mut self,
        alloc: &mut PageAllocator,
        others: &mut Others<'_>,
        n: usize,
    ) -> Result<Vec<i32>, RadixError> {
        self.check_alloc(alloc)?;
        self.check_others(others)?;
        self.alloc_evicting(alloc, &mut Sink::Drop(others), n)
    }
}
