//! KV events: what the tree stored and dropped, for KV-aware routers (vLLM's KV event stream).
//!
//! A cache built with events on ([`RadixCache::enable_kv_events`]) keeps the chained page hash
//! ([`crate::hash`]) of every page it holds, and every operation that changes the set of cached
//! pages records, in the same call, what changed:
//!
//! - pages newly stored by `insert` -> one [`KvEvent::BlockStored`] per new edge (its pages'
//!   hashes, the hash of the page before them, their tokens);
//! - nodes evicted (by `evict`, or by `alloc` making room) -> [`KvEvent::BlockRemoved`] with
//!   their pages' hashes (consecutive removals of one call merge into one event);
//! - `reset` -> [`KvEvent::AllBlocksCleared`].
//!
//! Splitting an edge (a match or insert ending inside it) records nothing: the pages are the
//! same, only their grouping into nodes changes. Events wait in a buffer until
//! [`RadixCache::take_kv_events`]; a buffer that grows past [`MAX_PENDING_TOKENS`] tokens of
//! stored pages is dropped and the next take returns a full snapshot instead
//! (`AllBlocksCleared`, then every cached page as `BlockStored`), so a consumer that applies the
//! events in order always ends at the tree's state.
//!
//! Namespaces: a page whose predecessor is the chain root (the first page of a namespace's
//! tree) carries the namespace's canonical bytes ([`Namespace::as_bytes`], the bytes the chain
//! root hash is computed from) in `namespace`; deeper pages chain from their parent's hash.
//! The default namespace carries none. Tiers: pages on the device are [`Medium::Gpu`], those on
//! the host tier ([`crate::radix`]'s `tier`) [`Medium::Cpu`] (`node_medium`). A demotion records
//! `BlockRemoved` (GPU) then `BlockStored` (CPU) for the node's pages, a `load_back` (or an
//! `insert` over host nodes) the reverse (`events_moved`); a host node dropped records
//! `BlockRemoved` (CPU).
//!
//! Hybrid caches (sliding-window groups, state slots): events describe the full-attention page
//! space (the tree's primary pages); the sliding groups' pages and the state slots of a node
//! come and go with it and have no events of their own.

use super::{Namespace, RadixCache};
use crate::hash;

#[path = "events_wire.rs"]
mod wire;
pub use wire::{encode_events, WireFormat};

/// Stored pages' tokens the pending buffer may hold before it is replaced by a snapshot on the
/// next take (16 MiB of token ids).
pub const MAX_PENDING_TOKENS: usize = 1 << 22;

/// Where a page's KV lives (vLLM's `medium`: `"GPU"`, `"CPU"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Medium {
    /// The device pool.
    Gpu,
    /// A host-memory tier.
    Cpu,
}

impl Medium {
    /// vLLM's spelling: `"GPU"`, `"CPU"`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Gpu => "GPU",
            Self::Cpu => "CPU",
        }
    }
}

/// One change of the set of cached pages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// Pages newly cached, in path order.
    BlockStored {
        /// One chained hash per page.
        block_hashes: Vec<u64>,
        /// The hash of the page before the first one; `None` for the first page of a namespace.
        parent_block_hash: Option<u64>,
        /// The pages' tokens (`block_hashes.len() * block_size` of them).
        token_ids: Vec<i32>,
        /// Tokens per page.
        block_size: usize,
        medium: Medium,
        /// The namespace's canonical bytes when `parent_block_hash` is `None` and the namespace
        /// is not the default one.
        namespace: Option<Box<[u8]>>,
    },
    /// Pages no longer cached (any order).
    BlockRemoved {
        block_hashes: Vec<u64>,
        medium: Medium,
    },
    /// Every page left the cache.
    AllBlocksCleared,
}

/// Counts of what a cache recorded since events were enabled (not reset by `reset`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EventCounts {
    /// Events recorded (a merged removal counts once; snapshots are not counted).
    pub events: u64,
    /// Pages announced as stored.
    pub blocks_stored: u64,
    /// Pages announced as removed.
    pub blocks_removed: u64,
    /// Times the pending buffer overflowed and was replaced by a snapshot.
    pub overflows: u64,
}

/// Event state of a cache: the seed, each node's page hashes, the pending events.
#[derive(Debug)]
pub(super) struct Events {
    seed: u64,
    /// Page hashes of each node's edge, by slot (empty for the super-root, namespace roots and
    /// free slots).
    hashes: Vec<Vec<u64>>,
    pending: Vec<KvEvent>,
    pending_tokens: usize,
    overflowed: bool,
    counts: EventCounts,
    buf: Vec<u8>,
}

impl Events {
    fn record(&mut self, e: KvEvent) {
        if self.overflowed {
            return; // the next take sends a snapshot
        }
        if let KvEvent::BlockStored { token_ids, .. } = &e {
            self.pending_tokens += token_ids.len();
            if self.pending_tokens > MAX_PENDING_TOKENS {
                self.pending = Vec::new();
                self.pending_tokens = 0;
                self.overflowed = true;
                self.counts.overflows += 1;
                return;
            }
        }
        self.pending.push(e);
    }

    fn slot(&mut self, id: u32) -> &mut Vec<u64> {
        let i = id as usize;
        if self.hashes.len() <= i {
            self.hashes.resize_with(i + 1, Vec::new);
        }
        &mut self.hashes[i]
    }
}

impl RadixCache {
    /// Turns KV events on: from now on every page the tree holds keeps its chained hash under
    /// `seed` ([`crate::hash`]), and every change is recorded for
    /// [`take_kv_events`](Self::take_kv_events). Pages already cached get their hashes now and
    /// no event (take a [`kv_events_snapshot`](Self::kv_events_snapshot) to announce them).
    /// Enabling again with another seed recomputes every hash.
    pub fn enable_kv_events(&mut self, seed: u64) {
        let mut ev = Events {
            seed,
            hashes: Vec::new(),
            pending: Vec::new(),
            pending_tokens: 0,
            overflowed: false,
            counts: self.events.as_ref().map(|e| e.counts).unwrap_or_default(),
            buf: Vec::new(),
        };
        for (id, parent, ns) in self.preorder() {
            let prev = match ns {
                Some(ns) => hash::root_hash(&ns, seed),
                None => *ev.slot(parent).last().unwrap_or(&0),
            };
            let h = hash::page_hashes(
                &Namespace::none(),
                self.node(id).key(),
                self.page_size,
                seed,
                Some(prev),
            );
            *ev.slot(id) = h;
        }
        self.events = Some(Box::new(ev));
    }

    /// Whether KV events are on.
    pub fn kv_events_enabled(&self) -> bool {
        self.events.is_some()
    }

    /// The seed of the page hashes, when KV events are on.
    pub fn hash_seed(&self) -> Option<u64> {
        self.events.as_ref().map(|e| e.seed)
    }

    /// What was recorded so far (zeros when events are off).
    pub fn kv_event_counts(&self) -> EventCounts {
        self.events.as_ref().map(|e| e.counts).unwrap_or_default()
    }

    /// The events recorded since the last take, in order (empty when events are off). After an
    /// overflow of the pending buffer: a snapshot instead
    /// ([`kv_events_snapshot`](Self::kv_events_snapshot)).
    pub fn take_kv_events(&mut self) -> Vec<KvEvent> {
        let Some(ev) = self.events.as_mut() else {
            return Vec::new();
        };
        if ev.overflowed {
            return self.kv_events_snapshot();
        }
        ev.pending_tokens = 0;
        std::mem::take(&mut ev.pending)
    }

    /// A full resync: `AllBlocksCleared`, then every cached page as `BlockStored` (one event per
    /// node, parents before children). Pending events are dropped (the snapshot supersedes
    /// them). Empty when events are off.
    pub fn kv_events_snapshot(&mut self) -> Vec<KvEvent> {
        let mut out = Vec::new();
        let Some(ev) = self.events.as_ref() else {
            return out;
        };
        out.push(KvEvent::AllBlocksCleared);
        for (id, parent, ns) in self.preorder() {
            let block_hashes = ev.hashes[id as usize].clone();
            let parent_block_hash = if ns.is_some() {
                None
            } else {
                ev.hashes[parent as usize].last().copied()
            };
            out.push(KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids: self.node(id).key().to_vec(),
                block_size: self.page_size,
                medium: self.node_medium(id),
                namespace: ns
                    .filter(|n| *n != Namespace::none())
                    .map(|n| n.as_bytes().into()),
            });
        }
        if let Some(ev) = self.events.as_mut() {
            ev.pending = Vec::new();
            ev.pending_tokens = 0;
            ev.overflowed = false;
        }
        out
    }

    /// The tier of node `id`'s pages: the host-memory tier's nodes are [`Medium::Cpu`].
    pub(super) fn node_medium(&self, id: u32) -> Medium {
        if self.node(id).host {
            Medium::Cpu
        } else {
            Medium::Gpu
        }
    }

    /// Nodes holding tokens, parents before children, each with its parent and, for a child of a
    /// namespace root, that namespace.
    fn preorder(&self) -> Vec<(u32, u32, Option<Namespace>)> {
        let mut out = Vec::new();
        let mut roots: Vec<(&Box<[u8]>, &u32)> = self.roots.iter().collect();
        roots.sort_unstable(); // deterministic order
        for (ns, &root) in roots {
            let ns = Namespace::from_bytes(ns);
            let mut stack: Vec<u32> = self.node(root).children.ids().collect();
            stack.sort_unstable();
            for &c in &stack {
                out.push((c, root, Some(ns.clone())));
            }
            let mut i = out.len() - stack.len();
            while i < out.len() {
                let id = out[i].0;
                let mut kids: Vec<u32> = self.node(id).children.ids().collect();
                kids.sort_unstable();
                out.extend(kids.into_iter().map(|k| (k, id, None)));
                i += 1;
            }
        }
        out
    }

    /// Hook of `insert`: the new leaf `leaf` under `parent` holds `tokens` (whole pages) of
    /// namespace `ns`.
    pub(super) fn events_stored(&mut self, leaf: u32, parent: u32, ns: &Namespace, tokens: &[i32]) {
        if self.events.is_none() {
            return;
        }
        let root = self.node(parent).key().is_empty();
        let ps = self.page_size;
        let medium = self.node_medium(leaf);
        let Some(ev) = self.events.as_mut() else {
            return;
        };
        let (prev, parent_block_hash) = if root {
            (hash::root_hash(ns, ev.seed), None)
        } else {
            let p = *ev.slot(parent).last().unwrap_or(&0);
            (p, Some(p))
        };
        let mut buf = std::mem::take(&mut ev.buf);
        let mut h = Vec::with_capacity(tokens.len() / ps);
        let mut last = prev;
        for page in tokens.chunks_exact(ps) {
            last = hash::next_hash(last, page, ev.seed, &mut buf);
            h.push(last);
        }
        ev.buf = buf;
        ev.counts.events += 1;
        ev.counts.blocks_stored += h.len() as u64;
        *ev.slot(leaf) = h.clone();
        let namespace = (root && *ns != Namespace::none()).then(|| ns.as_bytes().into());
        ev.record(KvEvent::BlockStored {
            block_hashes: h,
            parent_block_hash,
            token_ids: tokens.to_vec(),
            block_size: ps,
            medium,
            namespace,
        });
    }

    /// Hook of `split`: `head` (a new slot) took the first `pages` pages of `child`. No event.
    pub(super) fn events_split(&mut self, child: u32, head: u32, pages: usize) {
        if let Some(ev) = self.events.as_mut() {
            let rest = ev.slot(child).split_off(pages);
            let first = std::mem::replace(ev.slot(child), rest);
            *ev.slot(head) = first;
        }
    }

    /// Hook of eviction: leaf `id` is about to be removed.
    pub(super) fn events_removed(&mut self, id: u32) {
        if self.events.is_none() {
            return;
        }
        let medium = self.node_medium(id);
        let Some(ev) = self.events.as_mut() else {
            return;
        };
        let h = std::mem::take(ev.slot(id));
        if h.is_empty() {
            return;
        }
        ev.counts.blocks_removed += h.len() as u64;
        if !ev.overflowed {
            if let Some(KvEvent::BlockRemoved {
                block_hashes,
                medium: m,
            }) = ev.pending.last_mut()
            {
                if *m == medium {
                    block_hashes.extend_from_slice(&h);
                    return;
                }
            }
        }
        ev.counts.events += 1;
        ev.record(KvEvent::BlockRemoved {
            block_hashes: h,
            medium,
        });
    }

    /// Hook for a tiered cache: node `id`'s pages moved from tier `from` to tier `to` (a
    /// host-memory tier demoting or loading them back). Records `BlockRemoved` on `from` and
    /// `BlockStored` on `to` (vLLM announces each medium's copies apart); the node's hashes stay.
    /// [`node_medium`](Self::node_medium) must answer `to` for the node from now on.
    pub(super) fn events_moved(&mut self, id: u32, from: Medium, to: Medium) {
        let Some(ev) = self.events.as_ref() else {
            return;
        };
        let n = self.node(id);
        let hashes = ev.hashes.get(id as usize).cloned().unwrap_or_default();
        if hashes.is_empty() || from == to {
            return;
        }
        let parent = self.node(n.parent);
        let root = parent.key().is_empty();
        let parent_block_hash = if root {
            None
        } else {
            ev.hashes[n.parent as usize].last().copied()
        };
        let namespace = parent
            .ns
            .as_ref()
            .filter(|b| root && b[..] != *Namespace::none().as_bytes())
            .cloned();
        let stored = KvEvent::BlockStored {
            block_hashes: hashes.clone(),
            parent_block_hash,
            token_ids: n.key().to_vec(),
            block_size: self.page_size,
            medium: to,
            namespace,
        };
        let Some(ev) = self.events.as_mut() else {
            return;
        };
        ev.counts.events += 2;
        ev.counts.blocks_removed += hashes.len() as u64;
        ev.counts.blocks_stored += hashes.len() as u64;
        ev.record(KvEvent::BlockRemoved {
            block_hashes: hashes,
            medium: from,
        });
        ev.record(stored);
    }

    /// Hook of `reset`: the event state for the emptied cache (`AllBlocksCleared` appended to the
    /// pending events).
    pub(super) fn events_reset(&mut self) -> Option<Box<Events>> {
        let mut ev = self.events.take()?;
        ev.hashes.clear();
        if ev.overflowed {
            // (the snapshot a take would send is now empty: the clear says it all)
            ev.overflowed = false;
            ev.pending_tokens = 0;
        }
        ev.counts.events += 1;
        ev.pending.push(KvEvent::AllBlocksCleared);
        Some(ev)
    }

    /// Checks every node's stored hashes against its tokens (for `check_invariants`).
    pub(super) fn check_events(&self) -> Result<(), String> {
        let Some(ev) = self.events.as_ref() else {
            return Ok(());
        };
        for (id, parent, ns) in self.preorder() {
            let prev = match &ns {
                Some(ns) => hash::root_hash(ns, ev.seed),
                None => *ev.hashes[parent as usize].last().unwrap_or(&0),
            };
            let want = hash::page_hashes(
                ns.as_ref().unwrap_or(&Namespace::none()),
                self.node(id).key(),
                self.page_size,
                ev.seed,
                Some(prev),
            );
            if ev.hashes.get(id as usize) != Some(&want) {
                return Err(format!(
                    "node {id}: stored page hashes differ from its tokens'"
                ));
            }
        }
        for (i, h) in ev.hashes.iter().enumerate() {
            let holds = self
                .nodes
                .get(i)
                .is_some_and(|n| n.live && !n.key().is_empty());
            if !holds && !h.is_empty() {
                return Err(format!("slot {i} holds no pages but keeps page hashes"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
#[path = "events_tests.rs"]
mod tests;
