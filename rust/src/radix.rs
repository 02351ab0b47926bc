//! Radix prefix cache: token keys at page granularity, lock counts, LRU eviction, hit statistics.
//!
//! Keys are token ids matched and stored in whole pages: a partial last page is never cached.
//! Every edge of the tree holds a multiple of `page_size` tokens and one page id per `page_size`
//! tokens. Children are keyed by their first page of tokens.
//!
//! Ownership follows docs/architecture.md ("Ownership"): the tree takes its own reference on each page it stores (and only
//! on pages of the part that was not cached yet); eviction drops that reference, so a page a
//! request still holds is never reused. Namespaces (LoRA adapter, cache salt, ...) are separate
//! trees under one super-root: equal tokens in different namespaces never match.
//!
//! Handles name a node by slot, generation and cache epoch, so a handle to an evicted node (or one
//! from before `reset`, or from another cache) is detected instead of corrupting the tree. A match
//! or insert that ends inside an edge splits it there; the deeper half keeps the old slot, so
//! handles stay valid when paths are split or extended.
//!
//! Every operation validates its input before changing anything: on error nothing changed.
//!
//! ```
//! use kvpool::alloc::PageAllocator;
//! use kvpool::radix::{Namespace, RadixCache};
//! let mut a = PageAllocator::new(8, 1).unwrap();
//! let mut c = RadixCache::new(&a, 1).unwrap();
//! let ns = Namespace::none();
//! let pages = a.alloc(3).unwrap();
//! assert_eq!(c.insert(&mut a, &ns, &[1, 2, 3], &pages).unwrap(), 0);
//! a.free(&pages).unwrap(); // the tree keeps its own reference
//! let m = c.match_prefix(&ns, &[1, 2, 9]);
//! assert_eq!((m.len, m.pages.len()), (2, 2));
//! ```

use std::borrow::Cow;
use std::collections::{BTreeSet, HashMap};

use crate::alloc::{next_id, PageAllocator, PageId, RawPage};

mod check;
mod children;
mod error;
mod events;
mod evict;
mod groups;
mod namespace;
mod tier;
mod retention;
pub use events::{encode_events, EventCounts, KvEvent, Medium, WireFormat, MAX_PENDING_TOKENS};
use children::Children;
pub use error::{check_tokens, narrow_tokens, RadixError};
use groups::Groups;
use retention::{lru_key, EvictKey, NodeRet, Retention};
pub use retention::{Retain, Seconds, Stats, MAX_PRIORITY};
pub use groups::{GroupMatch, GroupPath, Others};
pub use namespace::{Namespace, NamespaceBuilder};
pub use tier::{HostMatch, TierStats};

/// A node slot of the tree (internal index; callers hold [`Handle`]s).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(u32);

impl NodeId {
    pub const fn get(self) -> u32 {
        self.0
    }
}

/// A checked reference to a node: slot, generation of the slot, and the cache epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Handle {
    node: NodeId,
    generation: u32,
    epoch: u64,
}

impl Handle {
    pub const fn node(self) -> NodeId {
        self.node
    }
}

/// Result of [`RadixCache::match_prefix`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Match {
    /// Page ids of the longest cached page-aligned prefix.
    pub pages: Vec<PageId>,
    /// The node where the match ends (the super-root for an empty match).
    pub node: Handle,
    /// Matched length in tokens (a multiple of the page size).
    pub len: usize,
}

const NONE: u32 = u32::MAX;
/// The super-root: parent of nothing, handle of every empty match, never evicted.
const SUPER: u32 = 0;

#[derive(Debug, Default)]
struct Node {
    parent: u32,
    /// The edge in one buffer: its `key_len` tokens, then one validated page id per `page_size`
    /// of them (int32, as stored in page tables).
    data: Vec<i32>,
    key_len: u32,
    children: Children,
    /// Locks on paths through this node (its own and its descendants').
    lock: u32,
    /// Locks taken through a handle to this very node (what `unlock` may release).
    own_locks: u32,
    last_access: u64,
    generation: u32,
    live: bool,
    in_lru: bool,
    /// The namespace key, for namespace roots only.
    ns: Option<Box<[u8]>>,
    /// Hybrid caches only (empty otherwise): one page id per page of the edge for each sliding
    /// group in turn (0: released), then the state slot saved at the node's end (0: none).
    extra: Vec<i32>,
    /// On the host tier: `data`'s page ids are host pages (see `tier`).
    host: bool,
    /// Children on the host tier (a device node with only those is a device leaf).
    host_kids: u32,
    in_host_lru: bool,
    /// Priority, retention and pins (see `retention`).
    ret: NodeRet,
}

impl Node {
    fn key(&self) -> &[i32] {
        &self.data[..self.key_len as usize]
    }
    fn pages(&self) -> &[i32] {
        &self.data[self.key_len as usize..]
    }
}

enum Goal {
    Tokens(usize),
    FreePages(usize),
    /// Free pages of sliding group `.0`.
    FreeSliding(usize, usize),
    FreeStateSlots(usize),
}

struct Plan {
    order: Vec<u32>,
    tokens: usize,
    freed_pages: usize,
}

/// Where the nodes a plan evicts go: dropped (with their pages in the extra spaces `others`),
/// or demoted to the host tier (see `tier`). `reset` releases the tree's pages into the same
/// spaces (the host tier's pages into its allocator).
enum Sink<'a, 'o> {
    Drop(&'a mut Others<'o>),
    Demote(&'a mut PageAllocator),
}

/// The radix prefix cache. Works on a [`PageAllocator`] passed to each call that touches pages
/// (the allocator never calls into the cache); the cache checks it is always the same allocator.
#[derive(Debug)]
pub struct RadixCache {
    page_size: usize,
    alloc_id: u64,
    epoch: u64,
    nodes: Vec<Node>,
    free_slots: Vec<u32>,
    roots: HashMap<Box<[u8]>, u32>,
    /// Unlocked, unpinned leaves by (current priority, last access, slot): the eviction order.
    lru: BTreeSet<EvictKey>,
    clock: u64,
    evictable: usize,
    protected: usize,
    hit: u64,
    miss: u64,
    /// The extra page spaces of a hybrid model (sliding groups, state slots); None for a plain one.
    groups: Option<Box<Groups>>,
    /// The host-memory tier, when built with a host allocator.
    tier: Option<Box<tier::Tier>>,
    /// Priorities, expiries, pins and their counters (see `retention`).
    ret: Retention,
    /// KV events (page hashes, pending events); None while events are off (see `events`).
    events: Option<Box<events::Events>>,
}

fn common_prefix(a: &[i32], b: &[i32]) -> usize {
    let n = a.len().min(b.len());
    // A whole match is the common case: one memcmp. Otherwise narrow down in shrinking chunks.
    if a[..n] == b[..n] {
        return n;
    }
    let mut i = 0;
    for chunk in [512, 64, 8] {
        while i + chunk <= n && a[i..i + chunk] == b[i..i + chunk] {
            i += chunk;
        }
    }
    while i < n && a[i] == b[i] {
        i += 1;
    }
    i
}

/// Entries `start..end` of the concatenation of `parts` (in range), borrowed when one part holds
/// them all.
fn page_range<'a, P: RawPage>(parts: &[&'a [P]], start: usize, end: usize) -> Cow<'a, [P]> {
    let mut off = 0;
    let mut out = Vec::new();
    for &part in parts {
        let (lo, hi) = (start.max(off), end.min(off + part.len()));
        if lo < hi {
            if lo == start && hi == end {
                return Cow::Borrowed(&part[lo - off..hi - off]);
            }
            out.extend_from_slice(&part[lo - off..hi - off]);
        }
        off += part.len();
    }
    Cow::Owned(out)
}

impl RadixCache {
    /// An empty cache over `alloc`, whose page size must equal `page_size`.
    ///
    /// # Errors
    /// [`RadixError::PageSizeMismatch`].
    pub fn new(alloc: &PageAllocator, page_size: usize) -> Result<Self, RadixError> {
        if page_size != alloc.page_size() {
            return Err(RadixError::PageSizeMismatch {
                cache: page_size,
                allocator: alloc.page_size(),
            });
        }
        Ok(Self {
            page_size,
            alloc_id: alloc.id(),
            epoch: next_id(),
            nodes: vec![Node {
                parent: NONE,
                live: true,
                ..Node::default()
            }],
            free_slots: Vec::new(),
            roots: HashMap::new(),
            lru: BTreeSet::new(),
            clock: 0,
            evictable: 0,
            protected: 0,
            hit: 0,
            miss: 0,
            groups: None,
            tier: None,
            ret: Retention::default(),
            events: None,
        })
    }

    pub const fn page_size(&self) -> usize {
        self.page_size
    }
    /// Cached tokens no lock or pin protects.
    pub const fn evictable_size(&self) -> usize {
        self.evictable
    }
    /// Cached tokens on locked or pinned paths.
    pub const fn protected_size(&self) -> usize {
        self.protected
    }
    /// All cached tokens (`evictable + protected`).
    pub const fn total_size(&self) -> usize {
        self.evictable + self.protected
    }
    /// Tokens served from the cache by `match_prefix` so far.
    pub const fn hit_tokens(&self) -> u64 {
        self.hit
    }
    /// Tokens asked of `match_prefix` and not served (partial last pages included).
    pub const fn miss_tokens(&self) -> u64 {
        self.miss
    }
    /// Live nodes holding tokens.
    pub fn num_nodes(&self) -> usize {
        self.nodes
            .iter()
            .filter(|n| n.live && !n.key().is_empty())
            .count()
    }

    fn check_alloc(&self, alloc: &PageAllocator) -> Result<(), RadixError> {
        if alloc.id() == self.alloc_id {
            Ok(())
        } else {
            Err(RadixError::WrongAllocator)
        }
    }

    fn handle(&self, id: u32) -> Handle {
        Handle {
            node: NodeId(id),
            generation: self.nodes[id as usize].generation,
            epoch: self.epoch,
        }
    }

    fn resolve(&self, h: Handle) -> Result<u32, RadixError> {
        let id = h.node.0;
        match self.nodes.get(id as usize) {
            Some(n) if n.live && n.generation == h.generation && h.epoch == self.epoch => Ok(id),
            _ => Err(RadixError::StaleHandle { node: id }),
        }
    }

    fn node(&self, id: u32) -> &Node {
        &self.nodes[id as usize]
    }
    fn node_mut(&mut self, id: u32) -> &mut Node {
        &mut self.nodes[id as usize]
    }

    /// A live node in a free slot or a new one; `key` and `pages` make up its edge (one
    /// allocation of exactly its size).
    fn new_node(
        &mut self,
        mut node: Node,
        key: &[i32],
        pages: impl ExactSizeIterator<Item = i32>,
    ) -> u32 {
        node.live = true;
        node.key_len = key.len() as u32;
        let mut data = Vec::with_capacity(key.len() + pages.len());
        data.extend_from_slice(key);
        data.extend(pages);
        node.data = data;
        if let Some(slot) = self.free_slots.pop() {
            node.generation = self.nodes[slot as usize].generation;
            self.nodes[slot as usize] = node;
            slot
        } else {
            self.nodes.push(node);
            (self.nodes.len() - 1) as u32
        }
    }

    fn free_node(&mut self, id: u32) {
        let old = &mut self.nodes[id as usize];
        *old = Node {
            generation: old.generation.wrapping_add(1),
            parent: NONE,
            ..Node::default()
        };
        self.free_slots.push(id);
    }

    /// The child of `parent` whose key starts with the page `page`.
    fn child(&self, parent: u32, page: &[i32]) -> Option<u32> {
        let ps = page.len();
        let kids = self.node(parent).children.candidates(page[0]);
        // Candidates share the first token (their map key): the rest of the page decides.
        kids.iter()
            .copied()
            .find(|&c| self.node(c).key()[1..ps] == page[1..])
    }

    fn is_evictable_leaf(&self, id: u32) -> bool {
        let n = self.node(id);
        n.live
            && !n.key().is_empty()
            && !n.host
            && n.children.len() == n.host_kids as usize
            && n.lock == 0
            && n.ret.pins == 0
    }

    /// Puts `id` in or out of the LRU set after its children, lock or access time changed.
    fn refresh(&mut self, id: u32) {
        if self.node(id).host {
            return self.refresh_host(id);
        }
        let want = self.is_evictable_leaf(id);
        let n = &mut self.nodes[id as usize];
        if n.in_lru {
            self.lru.remove(&lru_key(n, id));
        }
        n.in_lru = want;
        if want {
            self.lru.insert(lru_key(n, id));
        }
    }

    fn touch(&mut self, id: u32, clock: u64) {
        let n = &mut self.nodes[id as usize];
        if n.last_access == clock {
            return;
        }
        if n.in_lru {
            self.lru.remove(&lru_key(n, id));
        }
        let old = std::mem::replace(&mut n.last_access, clock);
        if n.in_lru {
            self.lru.insert(lru_key(n, id));
        }
        if n.in_host_lru {
            self.touch_host(id, old, clock);
        }
        self.hit_retention(id);
    }

    /// Splits `child` after `m` tokens (a positive multiple of the page size below its length).
    /// The new node takes the first half; `child` keeps its slot (and its handles) for the rest.
    fn split(&mut self, child: u32, m: usize) -> u32 {
        let ps = self.page_size;
        let shape = self.shape();
        let c = &mut self.nodes[child as usize];
        let (parent, lock, last_access, host) = (c.parent, c.lock, c.last_access, c.host);
        let ret = c.ret.head();
        // `child` keeps its slot with the rest (a buffer of its own); the head takes a new slot.
        let old = std::mem::take(&mut c.data);
        let (key, pages) = old.split_at(c.key_len as usize);
        let mut rest = Vec::with_capacity(old.len() - m - m / ps);
        rest.extend_from_slice(&key[m..]);
        rest.extend_from_slice(&pages[m / ps..]);
        c.key_len -= m as u32;
        c.data = rest;
        let mut children = Children::default();
        children.insert(key[m], child);
        let first = key[0];
        let extra = if c.extra.is_empty() {
            Vec::new()
        } else {
            groups::split_extra(&mut c.extra, shape, pages.len(), m / ps)
        };
        let head = Node {
            parent,
            children,
            lock,
            last_access,
            extra,
            host,
            host_kids: u32::from(host),
            ret,
            ..Node::default()
        };
        let mid = self.new_node(head, &key[..m], pages[..m / ps].iter().copied());
        self.on_split(mid);
        self.events_split(child, mid, m / ps);
        self.node_mut(child).parent = mid;
        self.node_mut(parent).children.replace(first, child, mid);
        mid
    }

    /// Longest cached page-aligned prefix of `tokens` in namespace `ns`. Splits the edge where the
    /// match ends inside it, updates access times and the hit/miss counters. Takes no lock.
    pub fn match_prefix(&mut self, ns: &Namespace, tokens: &[i32]) -> Match {
        let mut pages = Vec::new();
        let (node, len) = self.match_prefix_with(ns, tokens, |p| {
            pages.extend(p.iter().filter_map(|&x| PageId::new(x as u32)));
        });
        Match { pages, node, len }
    }

    /// [`match_prefix`](Self::match_prefix) handing the matched pages to `sink`, one slice per
    /// node in path order as int32 ids (so callers can copy them straight into their own buffer).
    /// Returns the handle and the matched length in tokens.
    pub fn match_prefix_with(
        &mut self,
        ns: &Namespace,
        tokens: &[i32],
        mut sink: impl FnMut(&[i32]),
    ) -> (Handle, usize) {
        if self.groups.is_some() {
            // Only as long as every group can serve (see `groups`).
            let m = self.match_prefix_groups(ns, tokens);
            sink(&m.pages);
            return (m.node, m.len);
        }
        self.clock += 1;
        let clock = self.clock;
        let ps = self.page_size;
        let aligned = tokens.len() / ps * ps;
        let mut node = SUPER;
        let mut pos = 0;
        if let Some(&root) = self.roots.get(ns.as_bytes()) {
            let mut cur = root;
            while pos < aligned {
                let Some(child) = self.child(cur, &tokens[pos..pos + ps]) else {
                    break;
                };
                let c = self.node(child);
                if c.host {
                    break; // host pages: `match_prefix_host`
                }
                let m = common_prefix(c.key(), &tokens[pos..aligned]) / ps * ps;
                let whole = m == c.key().len();
                sink(&c.pages()[..m / ps]);
                pos += m;
                cur = if whole { child } else { self.split(child, m) };
                self.touch(cur, clock);
                if !whole {
                    break;
                }
            }
            if pos > 0 {
                node = cur;
            }
        }
        self.hit += pos as u64;
        self.miss += (tokens.len() - pos) as u64;
        (self.handle(node), pos)
    }

    /// Caches the page-aligned part of `tokens` in namespace `ns`, `pages` holding one id per page
    /// (whole pages only, or with the partial last page, which is not cached). The tree takes one
    /// reference on the pages of the part not cached yet; the others stay the caller's.
    /// Returns the number of tokens that were already cached.
    ///
    /// Only the pages the tree takes are looked at (the others are the caller's business).
    ///
    /// # Errors
    /// [`RadixError::LengthMismatch`]; a page the tree would take that is the padding page, out of
    /// range, not allocated, repeated, or already in the tree. Nothing changes then.
    pub fn insert<P: RawPage>(
        &mut self,
        alloc: &mut PageAllocator,
        ns: &Namespace,
        tokens: &[i32],
        pages: &[P],
    ) -> Result<usize, RadixError> {
        self.insert_parts(alloc, ns, tokens, &[pages])
    }

    /// [`insert`](Self::insert) with the page ids given in consecutive parts (e.g. the pages a
    /// match returned, then the pages allocated for the rest): they count as their concatenation,
    /// which is never built; only the pages the tree takes are read.
    ///
    /// # Errors
    /// As [`insert`](Self::insert), the parts' total length standing for `pages.len()`.
    pub fn insert_parts<P: RawPage>(
        &mut self,
        alloc: &mut PageAllocator,
        ns: &Namespace,
        tokens: &[i32],
        parts: &[&[P]],
    ) -> Result<usize, RadixError> {
        // A hybrid cache needs every group's pages ([`insert_groups`](Self::insert_groups)).
        self.check_others(&Others::default())?;
        Ok(self.insert_inner(alloc, ns, tokens, parts)?.0)
    }

    /// [`insert_parts`](Self::insert_parts), also returning the node that ends at the aligned end
    /// of `tokens` (`NONE` when nothing is cached and nothing was inserted).
    fn insert_inner<P: RawPage>(
        &mut self,
        alloc: &mut PageAllocator,
        ns: &Namespace,
        tokens: &[i32],
        parts: &[&[P]],
    ) -> Result<(usize, u32), RadixError> {
        let n_pages = parts.iter().map(|p| p.len()).sum();
        self.check_alloc(alloc)?;
        let ps = self.page_size;
        let (full, ceil) = (tokens.len() / ps, tokens.len().div_ceil(ps));
        if n_pages != full && n_pages != ceil {
            return Err(RadixError::LengthMismatch {
                tokens: tokens.len(),
                pages: n_pages,
                page_size: ps,
                full,
                ceil,
            });
        }
        let aligned = full * ps;
        // Read-only walk: whole nodes on the path (down to `last`), then where the walk stops
        // inside an edge.
        let root = self.roots.get(ns.as_bytes()).copied();
        let mut last = NONE;
        let mut partial = None;
        let mut pos = 0;
        let mut host_at = None; // the first host node walked, and where it starts
        if let Some(root) = root {
            let mut cur = root;
            while pos < aligned {
                let Some(child) = self.child(cur, &tokens[pos..pos + ps]) else {
                    break;
                };
                if host_at.is_none() && self.node(child).host {
                    host_at = Some((child, pos));
                }
                let key = self.node(child).key();
                let m = common_prefix(key, &tokens[pos..aligned]) / ps * ps;
                pos += m;
                if m < key.len() {
                    partial = Some((child, m));
                    break;
                }
                last = child;
                cur = child;
            }
        }
        // The pages the tree takes: borrowed when one part holds them all (a serving loop's
        // new pages), gathered otherwise.
        // (host nodes walked take the caller's pages too: from where the host tier starts)
        let from = host_at.map_or(pos, |(_, p)| p);
        let taken = page_range(parts, from / ps, full);
        // Validates the pages the tree takes and takes its reference on them (one pass).
        if from < aligned {
            alloc.cache_pages(&taken)?;
        }
        // Validated: from here on nothing fails.
        self.clock += 1;
        let clock = self.clock;
        let retain = self.ret.take_pending();
        // The whole nodes walked: `last` and its ancestors below the namespace root.
        let mut id = last;
        while id != NONE && Some(id) != root {
            self.touch(id, clock);
            self.retain(id, retain);
            id = self.node(id).parent;
        }
        let mut parent = if last != NONE {
            last
        } else {
            root.unwrap_or(NONE)
        };
        if let Some((child, m)) = partial {
            parent = self.split(child, m);
            self.touch(parent, clock);
            host_at = host_at.map(|(h, p)| (if h == child { parent } else { h }, p));
            self.retain(parent, retain);
        }
        let promoted = self.promote_walked(host_at, parent, &taken);
        let taken = &taken[promoted..];
        if pos == aligned {
            return Ok((from, parent));
        }
        if parent == NONE {
            let root = Node {
                parent: NONE,
                ns: Some(ns.as_bytes().into()),
                ..Node::default()
            };
            parent = self.new_node(root, &[], std::iter::empty());
            self.roots.insert(ns.as_bytes().into(), parent);
        }
        let leaf = Node {
            parent,
            last_access: clock,
            ..Node::default()
        };
        let taken = taken.iter().map(|p| p.to_i64() as i32);
        let leaf = self.new_node(leaf, &tokens[pos..aligned], taken);
        self.node_mut(parent).children.insert(tokens[pos], leaf);
        self.retain(leaf, retain);
        self.events_stored(leaf, parent, ns, &tokens[pos..aligned]);
        self.evictable += aligned - pos;
        self.refresh(parent);
        self.refresh(leaf);
        Ok((from, leaf))
    }

    /// Locks the path from `h`'s node to its root: none of it is evicted until `unlock(h)`.
    ///
    /// # Errors
    /// [`RadixError::StaleHandle`], [`RadixError::LockOverflow`]; nothing changes then.
    pub fn lock(&mut self, h: Handle) -> Result<(), RadixError> {
        let id = self.resolve(h)?;
        self.check_device(id)?;
        let mut cur = id;
        while cur != NONE {
            if self.node(cur).lock == u32::MAX {
                return Err(RadixError::LockOverflow { node: cur });
            }
            cur = self.node(cur).parent;
        }
        self.node_mut(id).own_locks += 1;
        let mut cur = id;
        while cur != NONE {
            let n = &mut self.nodes[cur as usize];
            n.lock += 1;
            if n.lock == 1 {
                if n.ret.pins == 0 {
                    self.evictable -= n.key().len();
                    self.protected += n.key().len();
                }
                self.refresh(cur);
            }
            cur = self.node(cur).parent;
        }
        Ok(())
    }

    /// Releases one lock taken by [`lock`](Self::lock) on the same node.
    ///
    /// # Errors
    /// [`RadixError::StaleHandle`]; [`RadixError::NotLocked`] when the node holds no lock of its
    /// own (the count would go below zero). Nothing changes then.
    pub fn unlock(&mut self, h: Handle) -> Result<(), RadixError> {
        let id = self.resolve(h)?;
        if self.node(id).own_locks == 0 {
            return Err(RadixError::NotLocked { node: id });
        }
        self.node_mut(id).own_locks -= 1;
        let mut cur = id;
        while cur != NONE {
            let n = &mut self.nodes[cur as usize];
            n.lock -= 1;
            if n.lock == 0 {
                if n.ret.pins == 0 {
                    self.protected -= n.key().len();
                    self.evictable += n.key().len();
                }
                self.refresh(cur);
            }
            cur = self.node(cur).parent;
        }
        Ok(())
    }

    /// `reset` refuses a cache any lock is held on.
    fn check_unlocked(&self) -> Result<(), RadixError> {
        let locks: u64 = self
            .nodes
            .iter()
            .filter(|n| n.live)
            .map(|n| u64::from(n.own_locks))
            .sum();
        if locks > 0 {
            return Err(RadixError::Locked {
                protected: self.protected,
                locks,
            });
        }
        Ok(())
    }

    /// Empties the cache (dropping the tree's page references) and zeroes the counters. Every
    /// handle becomes stale.
    ///
    /// # Errors
    /// [`RadixError::Locked`] while any lock is held; nothing changes then.
    pub fn reset(&mut self, alloc: &mut PageAllocator) -> Result<(), RadixError> {
        self.reset_with(alloc, &mut Others::default())
    }

    /// [`reset`](Self::reset) for any cache (`others` as for [`evict_with`](Self::evict_with)).
    ///
    /// # Errors
    /// As [`reset`](Self::reset), plus [`RadixError::GroupAllocators`].
    pub fn reset_with(
        &mut self,
        alloc: &mut PageAllocator,
        others: &mut Others<'_>,
    ) -> Result<(), RadixError> {
        self.reset_into(alloc, &mut Sink::Drop(others))
    }

    /// The one body of `reset_with` and `reset_tiered`. `sink` names the spaces besides `alloc`
    /// whose pages the tree holds: a hybrid cache's extra spaces (`Drop`) or the host tier's
    /// allocator (`Demote`: host nodes' pages go back there). Every check runs, and the empty
    /// cache is built, before any page is released: on error nothing changed.
    fn reset_into(
        &mut self,
        alloc: &mut PageAllocator,
        sink: &mut Sink<'_, '_>,
    ) -> Result<(), RadixError> {
        match sink {
            Sink::Drop(others) => {
                self.check_alloc(alloc)?;
                self.check_others(others)?;
            }
            Sink::Demote(host) => self.check_host(alloc, host)?,
        }
        self.check_unlocked()?;
        let mut fresh = Self::new(alloc, self.page_size)?;
        for id in 0..self.nodes.len() as u32 {
            let n = self.node(id);
            if !n.live {
                continue;
            }
            match sink {
                Sink::Demote(host) if n.host => host.release_cached_all(n.pages()),
                _ => alloc.release_cached_all(n.pages()),
            }
            if let (Sink::Drop(others), false) = (&mut *sink, n.extra.is_empty()) {
                self.release_extra(id, others);
            }
        }
        fresh.groups = self.groups.take();
        fresh.tier = self.tier.as_ref().map(|t| t.after_reset());
        fresh.ret = self.ret.after_reset();
        fresh.events = self.events_reset();
        *self = fresh;
        Ok(())
    }

    /// Full root-to-leaf paths (tokens, pages) of namespace `ns`, for tests and debugging.
    pub fn leaf_paths(&self, ns: &Namespace) -> Vec<(Vec<i32>, Vec<PageId>)> {
        let mut out = Vec::new();
        let Some(&root) = self.roots.get(ns.as_bytes()) else {
            return out;
        };
        let mut stack = vec![(root, Vec::new(), Vec::new())];
        while let Some((id, toks, pages)) = stack.pop() {
            let n = self.node(id);
            if n.children.is_empty() {
                out.push((toks, pages));
                continue;
            }
            for c in n.children.ids() {
                let cn = self.node(c);
                let mut t = toks.clone();
                t.extend_from_slice(cn.key());
                let mut p = pages.clone();
                p.extend(cn.pages().iter().filter_map(|&x| PageId::new(x as u32)));
                stack.push((c, t, p));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests;
