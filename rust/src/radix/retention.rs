//! Retention: priorities that decay, pins with a token budget, and the cache's clock.
//!
//! **Priorities.** Every node carries a priority (0..=100, higher is kept longer) and a retention
//! (seconds). An insert with priority `p` and retention `r` gives the nodes it inserts or walks
//! through priority `p` until `r` seconds after their last hit (an insert or a `match_prefix`
//! through the node; a hit refreshes the retention). Then the priority decays to 0 and stays 0
//! until an insert with a higher priority lifts it again; a decayed node's hits no longer renew
//! anything. On a node that holds a priority already, an insert with a *lower* priority leaves it
//! as it is, one with the *same* priority keeps the longer of the two retentions, a higher one
//! replaces both. No retention (`None`, or infinity) means no decay.
//!
//! **Eviction order.** The evictable leaves are kept in one ordered set keyed by
//! `(current priority, last access, slot)`: eviction takes the lowest priority first and the least
//! recently used within one priority, at O(log leaves) per node (no heap is rebuilt). The nodes
//! whose priority will decay sit in a second ordered set keyed by `(time, slot)`, one entry per
//! node at a time no later than its expiry: a hit that renews a retention only moves the node's
//! expiry (O(1), the entry stays), and only an expiry moved earlier moves the entry. Before every
//! eviction plan the entries whose time has come are popped: a node whose expiry moved on since is
//! filed again at its expiry, the others decay and are re-keyed at priority 0 (O(log n) each). A
//! hit on an expired node decays it instead of renewing it, so a node's priority is always the one
//! its last hit and the clock give.
//!
//! **Pins.** `pin(node)` protects the path from the node to its root from eviction until
//! `unpin(node)`, across requests, like a lock but counted apart from locks. Pinned tokens are the
//! tokens of the nodes on at least one pinned path: a token is counted once however many pins
//! cover it (nested pins, or one node pinned twice). A `pin` that would take the pinned tokens
//! beyond `max_pinned_tokens` fails with [`RadixError::PinBudget`] and changes nothing, so pins can
//! never hold more of the pool than the budget. Pinned tokens count as protected (not evictable).
//! Splits keep the count: the upper half of a split edge is pinned as the lower half was.
//!
//! **Clock.** The core has no clock of its own: [`RadixCache::set_now`] sets the current time in
//! seconds (any origin) before a call; it never runs backwards (an earlier time is taken as the
//! latest seen). Until it is set the time is 0, so nothing expires. The Python binding sets it
//! before every call that matches, inserts, evicts or allocates.

use std::cmp::Ordering;
use std::collections::BTreeSet;

use super::{Node, RadixCache, RadixError, NONE};
use crate::alloc::PageAllocator;

/// The highest priority (the lowest is 0).
pub const MAX_PRIORITY: u8 = 100;

/// Key of the evictable-leaf set: (current priority, last access, slot).
pub(super) type EvictKey = (u8, u64, u32);

pub(super) const fn lru_key(n: &Node, id: u32) -> EvictKey {
    (n.ret.priority, n.last_access, id)
}

/// A time or duration in seconds, finite (checked when built), ordered.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Seconds(f64);

impl Seconds {
    /// A clock reading in seconds.
    ///
    /// # Errors
    /// [`RadixError::BadTime`] for NaN or an infinity.
    pub fn new(secs: f64) -> Result<Self, RadixError> {
        if secs.is_finite() {
            Ok(Self(secs))
        } else {
            Err(RadixError::BadTime {
                value: format!("{secs}"),
            })
        }
    }
    pub const fn get(self) -> f64 {
        self.0
    }
}

/// Expiry-index key: total order on f64 (times in the index are finite).
#[derive(Debug, Clone, Copy, PartialEq)]
struct At(f64);
impl Eq for At {}
impl PartialOrd for At {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for At {
    fn cmp(&self, other: &Self) -> Ordering {
        self.0.total_cmp(&other.0)
    }
}

/// What an insert gives the nodes it inserts or touches (see the module text).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Retain {
    priority: u8,
    /// Seconds after the last hit; infinity: no decay.
    retention: f64,
}

impl Default for Retain {
    fn default() -> Self {
        Self::NONE
    }
}

impl Retain {
    /// Priority 0: plain LRU.
    pub const NONE: Self = Self {
        priority: 0,
        retention: f64::INFINITY,
    };

    /// Priority `priority` (0..=100) for `retention_s` seconds after the last hit (`None` or
    /// infinity: no decay).
    ///
    /// # Errors
    /// [`RadixError::BadPriority`], [`RadixError::BadRetention`] (negative or NaN).
    pub fn new(priority: i64, retention_s: Option<f64>) -> Result<Self, RadixError> {
        if !(0..=i64::from(MAX_PRIORITY)).contains(&priority) {
            return Err(RadixError::BadPriority { value: priority });
        }
        let retention = retention_s.unwrap_or(f64::INFINITY);
        if retention.is_nan() || retention < 0.0 {
            return Err(RadixError::BadRetention {
                value: format!("{retention}"),
            });
        }
        Ok(Self {
            priority: priority as u8,
            retention,
        })
    }
    pub const fn priority(self) -> u8 {
        self.priority
    }
}

/// Per-node retention state.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct NodeRet {
    /// Current priority (0 once decayed).
    pub(super) priority: u8,
    /// Seconds of retention after a hit (meaningful while `priority > 0`; infinity: none).
    retention: f64,
    /// Absolute time the priority decays (infinity: never); in the expiry index iff finite and
    /// `priority > 0`.
    expiry: f64,
    /// The time of the node's expiry-index entry (`<= expiry`), while it has one.
    indexed_at: f64,
    /// Pins on paths through this node (its own and its descendants').
    pub(super) pins: u32,
    /// Pins taken through a handle to this very node (what `unpin` may release).
    own_pins: u32,
}

impl NodeRet {
    /// The state of the upper half of a split node: the same priority and pins on its path, no
    /// pins of its own.
    pub(super) const fn head(&self) -> Self {
        Self {
            own_pins: 0,
            ..*self
        }
    }
    fn indexed(&self) -> bool {
        self.priority > 0 && self.expiry.is_finite()
    }
}

/// The cache-wide retention state (one field of [`RadixCache`]).
#[derive(Debug, Clone)]
pub(super) struct Retention {
    now: f64,
    expiry: BTreeSet<(At, u32)>,
    pinned: usize,
    max_pinned: usize,
    /// What the insert in progress gives its nodes ([`RadixCache::insert_parts_retained`]).
    pending: Retain,
    /// Tokens evicted, per priority at eviction.
    evicted: [u64; MAX_PRIORITY as usize + 1],
    evicted_nodes: u64,
    expiries: u64,
}

impl Default for Retention {
    fn default() -> Self {
        Self {
            now: 0.0,
            expiry: BTreeSet::new(),
            pinned: 0,
            max_pinned: 0,
            pending: Retain::NONE,
            evicted: [0; MAX_PRIORITY as usize + 1],
            evicted_nodes: 0,
            expiries: 0,
        }
    }
}

impl Retention {
    /// A fresh state after `reset`: the clock and the budget stay, everything else goes.
    pub(super) fn after_reset(&self) -> Self {
        Self {
            now: self.now,
            max_pinned: self.max_pinned,
            ..Self::default()
        }
    }
    pub(super) fn take_pending(&mut self) -> Retain {
        std::mem::take(&mut self.pending)
    }
}

/// The retention counters of [`RadixCache::stats`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stats {
    /// Tokens evicted so far (since creation or `reset`).
    pub evicted_tokens: u64,
    /// Nodes evicted so far.
    pub evicted_nodes: u64,
    /// `(priority, tokens)` evicted at that (current) priority, ascending, nonzero only.
    pub evicted_tokens_by_priority: Vec<(u8, u64)>,
    /// Tokens on pinned paths (each counted once).
    pub pinned_tokens: usize,
    /// The pin budget in tokens.
    pub max_pinned_tokens: usize,
    /// Nodes whose priority decayed to 0 when their retention ran out.
    pub retention_expiries: u64,
    /// Nodes that hold a priority above 0 now.
    pub retained_nodes: usize,
}

impl RadixCache {
    /// This cache with a pin budget of `max_pinned_tokens` tokens (0, the default: no pins).
    #[must_use]
    pub const fn with_max_pinned_tokens(mut self, max_pinned_tokens: usize) -> Self {
        self.ret.max_pinned = max_pinned_tokens;
        self
    }

    /// Sets the clock (seconds, any origin) for the calls that follow; an earlier time than the
    /// latest seen is taken as the latest (the clock never runs backwards).
    pub fn set_now(&mut self, now: Seconds) {
        self.ret.now = self.ret.now.max(now.0);
    }

    /// The clock as the cache sees it (seconds).
    pub const fn now(&self) -> f64 {
        self.ret.now
    }

    /// Tokens on pinned paths (each token counted once).
    pub const fn pinned_tokens(&self) -> usize {
        self.ret.pinned
    }

    /// The pin budget in tokens.
    pub const fn max_pinned_tokens(&self) -> usize {
        self.ret.max_pinned
    }

    /// [`insert_parts`](Self::insert_parts) giving the nodes it inserts or walks through
    /// `retain`'s priority (see the module text).
    ///
    /// # Errors
    /// As [`insert_parts`](Self::insert_parts).
    pub fn insert_parts_retained<P: crate::alloc::RawPage>(
        &mut self,
        alloc: &mut PageAllocator,
        ns: &super::Namespace,
        tokens: &[i32],
        parts: &[&[P]],
        retain: Retain,
    ) -> Result<usize, RadixError> {
        self.with_retain(retain, |c| c.insert_parts(alloc, ns, tokens, parts))
    }

    /// [`insert_groups`](Self::insert_groups) with `retain`, as
    /// [`insert_parts_retained`](Self::insert_parts_retained).
    ///
    /// # Errors
    /// As [`insert_groups`](Self::insert_groups).
    #[allow(clippy::too_many_arguments)]
    pub fn insert_groups_retained<P: crate::alloc::RawPage>(
        &mut self,
        alloc: &mut PageAllocator,
        others: &mut super::Others<'_>,
        ns: &super::Namespace,
        tokens: &[i32],
        parts: &[&[P]],
        sliding: &[&[i32]],
        state: i32,
        retain: Retain,
    ) -> Result<usize, RadixError> {
        self.with_retain(retain, |c| {
            c.insert_groups(alloc, others, ns, tokens, parts, sliding, state)
        })
    }

    /// [`insert_tiered`](Self::insert_tiered) with `retain`, as
    /// [`insert_parts_retained`](Self::insert_parts_retained).
    ///
    /// # Errors
    /// As [`insert_tiered`](Self::insert_tiered).
    pub fn insert_tiered_retained<P: crate::alloc::RawPage>(
        &mut self,
        alloc: &mut PageAllocator,
        host: &mut PageAllocator,
        ns: &super::Namespace,
        tokens: &[i32],
        parts: &[&[P]],
        retain: Retain,
    ) -> Result<usize, RadixError> {
        self.with_retain(retain, |c| c.insert_tiered(alloc, host, ns, tokens, parts))
    }

    /// Runs `f` (one insert) with `retain` pending; it is cleared afterwards whatever happened.
    fn with_retain<R>(&mut self, retain: Retain, f: impl FnOnce(&mut Self) -> R) -> R {
        self.ret.pending = retain;
        let r = f(self);
        self.ret.pending = Retain::NONE;
        r
    }

    /// Files node `id` in the expiry index after its state changed from `old`: an entry is
    /// added, dropped, or moved only when the expiry moved before it (later is left to
    /// [`expire`](Self::expire)).
    fn reindex(&mut self, id: u32, old: NodeRet) {
        let new = self.nodes[id as usize].ret;
        match (old.indexed(), new.indexed()) {
            (true, false) => {
                self.ret.expiry.remove(&(At(old.indexed_at), id));
            }
            (false, true) => self.file(id, new.expiry),
            (true, true) if new.expiry < old.indexed_at => {
                self.ret.expiry.remove(&(At(old.indexed_at), id));
                self.file(id, new.expiry);
            }
            _ => {}
        }
    }

    fn file(&mut self, id: u32, at: f64) {
        self.ret.expiry.insert((At(at), id));
        self.nodes[id as usize].ret.indexed_at = at;
    }

    /// Sets node `id`'s priority, re-keying it in the evictable set.
    fn set_priority(&mut self, id: u32, priority: u8) {
        let n = &self.nodes[id as usize];
        if n.ret.priority == priority {
            return;
        }
        if n.in_lru {
            self.lru.remove(&lru_key(n, id));
        }
        let host = n.in_host_lru;
        if host {
            self.rekey_host(id, priority);
        }
        let n = &mut self.nodes[id as usize];
        n.ret.priority = priority;
        if n.in_lru {
            self.lru.insert(lru_key(n, id));
        }
    }

    /// Decays node `id` to priority 0 (its retention ran out); `filed`: it still has its
    /// expiry-index entry.
    fn decay(&mut self, id: u32, filed: bool) {
        let r = self.nodes[id as usize].ret;
        if filed {
            self.ret.expiry.remove(&(At(r.indexed_at), id));
        }
        self.set_priority(id, 0);
        self.ret.expiries += 1;
    }

    /// Decays every node whose retention ran out by now (before an eviction plan).
    pub(super) fn expire(&mut self) {
        let now = self.ret.now;
        while let Some(&(At(t), id)) = self.ret.expiry.first() {
            if t > now {
                break;
            }
            self.ret.expiry.pop_first();
            let expiry = self.nodes[id as usize].ret.expiry;
            if expiry > now {
                self.file(id, expiry); // renewed since it was filed
            } else {
                self.decay(id, false);
            }
        }
    }

    /// A hit on node `id` (match or insert): renews its retention, or decays it when the
    /// retention ran out already.
    pub(super) fn hit_retention(&mut self, id: u32) {
        let r = self.nodes[id as usize].ret;
        if !r.indexed() {
            return;
        }
        if r.expiry <= self.ret.now {
            self.decay(id, true);
            return;
        }
        // (later than before: the index entry stays, see `reindex`)
        self.nodes[id as usize].ret.expiry = self.ret.now + r.retention;
    }

    /// An insert's `retain` on node `id` (after its hit): see the module text.
    pub(super) fn retain(&mut self, id: u32, retain: Retain) {
        if retain.priority == 0 {
            return;
        }
        let old = self.nodes[id as usize].ret;
        let now = self.ret.now;
        let until = now + retain.retention; // (infinity for no decay)
        let n = &mut self.nodes[id as usize].ret;
        match retain.priority.cmp(&old.priority) {
            Ordering::Less => return,
            Ordering::Equal => {
                n.retention = n.retention.max(retain.retention);
                n.expiry = n.expiry.max(until);
            }
            Ordering::Greater => {
                n.retention = retain.retention;
                n.expiry = until;
            }
        }
        self.set_priority(id, retain.priority);
        self.reindex(id, old);
    }

    /// Bookkeeping of node `id` leaving the tree by eviction.
    pub(super) fn on_evict(&mut self, id: u32) {
        let n = &self.nodes[id as usize];
        let (r, len) = (n.ret, n.key().len() as u64);
        self.ret.evicted[r.priority as usize] += len;
        self.ret.evicted_nodes += 1;
        if r.indexed() {
            self.ret.expiry.remove(&(At(r.indexed_at), id));
        }
    }

    /// Index entry for a node made by a split (a copy of the state of the node it came from).
    pub(super) fn on_split(&mut self, head: u32) {
        let r = self.nodes[head as usize].ret;
        if r.indexed() {
            self.file(head, r.expiry);
        }
    }

    /// Pins the path from `h`'s node to its root: none of it is evicted until `unpin(h)`.
    ///
    /// # Errors
    /// [`RadixError::StaleHandle`]; [`RadixError::OnHost`] for a node on the host tier;
    /// [`RadixError::PinBudget`] when the tokens it would newly pin take the pinned tokens beyond
    /// the budget; [`RadixError::PinOverflow`]. Nothing changes then.
    pub fn pin(&mut self, h: super::Handle) -> Result<(), RadixError> {
        let id = self.resolve(h)?;
        self.check_device(id)?;
        let mut add = 0;
        let mut cur = id;
        while cur != NONE {
            let n = self.node(cur);
            if n.ret.pins == u32::MAX {
                return Err(RadixError::PinOverflow { node: cur });
            }
            if n.ret.pins == 0 {
                add += n.key().len();
            }
            cur = n.parent;
        }
        if self.ret.pinned + add > self.ret.max_pinned {
            return Err(RadixError::PinBudget {
                node: id,
                tokens: add,
                pinned: self.ret.pinned,
                max: self.ret.max_pinned,
            });
        }
        self.ret.pinned += add;
        self.node_mut(id).ret.own_pins += 1;
        let mut cur = id;
        while cur != NONE {
            let n = &mut self.nodes[cur as usize];
            n.ret.pins += 1;
            if n.ret.pins == 1 {
                if n.lock == 0 {
                    self.evictable -= n.key().len();
                    self.protected += n.key().len();
                }
                self.refresh(cur);
            }
            cur = self.node(cur).parent;
        }
        Ok(())
    }

    /// Releases one [`pin`](Self::pin) taken on the same node.
    ///
    /// # Errors
    /// [`RadixError::StaleHandle`]; [`RadixError::NotPinned`] when the node holds no pin of its
    /// own. Nothing changes then.
    pub fn unpin(&mut self, h: super::Handle) -> Result<(), RadixError> {
        let id = self.resolve(h)?;
        if self.node(id).ret.own_pins == 0 {
            return Err(RadixError::NotPinned { node: id });
        }
        self.node_mut(id).ret.own_pins -= 1;
        let mut cur = id;
        while cur != NONE {
            let n = &mut self.nodes[cur as usize];
            n.ret.pins -= 1;
            if n.ret.pins == 0 {
                let len = n.key().len();
                self.ret.pinned -= len;
                if n.lock == 0 {
                    self.protected -= len;
                    self.evictable += len;
                }
                self.refresh(cur);
            }
            cur = self.node(cur).parent;
        }
        Ok(())
    }

    /// The retention counters (decays what expired by now first, so the counts are current).
    pub fn stats(&mut self) -> Stats {
        self.expire();
        let by: Vec<(u8, u64)> = (0..=MAX_PRIORITY)
            .map(|p| (p, self.ret.evicted[p as usize]))
            .filter(|&(_, t)| t > 0)
            .collect();
        Stats {
            evicted_tokens: self.ret.evicted.iter().sum(),
            evicted_nodes: self.ret.evicted_nodes,
            evicted_tokens_by_priority: by,
            pinned_tokens: self.ret.pinned,
            max_pinned_tokens: self.ret.max_pinned,
            retention_expiries: self.ret.expiries,
            retained_nodes: self
                .nodes
                .iter()
                .filter(|n| n.live && n.ret.priority > 0)
                .count(),
        }
    }

    /// The current priority of the node `h` names (for tests and debugging; the clock as last
    /// set, expiries not yet processed counted as decayed).
    ///
    /// # Errors
    /// [`RadixError::StaleHandle`].
    pub fn priority(&self, h: super::Handle) -> Result<u8, RadixError> {
        let r = self.node(self.resolve(h)?).ret;
        Ok(if r.expiry <= self.ret.now {
            0
        } else {
            r.priority
        })
    }

    /// The retention invariants (part of [`check_invariants`](Self::check_invariants)).
    pub(super) fn check_retention(&self) -> Result<(), RadixError> {
        let bad = |s: String| Err(RadixError::Corrupt(s));
        let (mut pinned, mut indexed) = (0, 0);
        for (i, n) in self.nodes.iter().enumerate() {
            let id = i as u32;
            if !n.live {
                continue;
            }
            let child_pins: u64 = n
                .children
                .ids()
                .map(|c| u64::from(self.node(c).ret.pins))
                .sum();
            if u64::from(n.ret.pins) != child_pins + u64::from(n.ret.own_pins) {
                return bad(format!("node {id}: pins {} != own + children", n.ret.pins));
            }
            if n.ret.pins > 0 {
                pinned += n.key().len();
            }
            if n.ret.priority > MAX_PRIORITY {
                return bad(format!("node {id}: priority {}", n.ret.priority));
            }
            if n.ret.indexed() {
                indexed += 1;
                let r = n.ret;
                if !self.ret.expiry.contains(&(At(r.indexed_at), id)) || r.indexed_at > r.expiry {
                    return bad(format!("node {id}: missing from the expiry index, or late"));
                }
            }
        }
        if indexed != self.ret.expiry.len() {
            return bad("stale expiry-index entries".into());
        }
        if pinned != self.ret.pinned || pinned > self.ret.max_pinned {
            return bad(format!(
                "pinned tokens: counted {pinned}, kept {}, budget {}",
                self.ret.pinned, self.ret.max_pinned
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
#[path = "retention_tests.rs"]
mod tests;
