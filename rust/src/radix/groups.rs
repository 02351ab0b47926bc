//! The radix cache for hybrid models: sliding-window groups and linear-attention state slots.
//!
//! A hybrid cache stores, beside each edge's full-attention pages, one page id per page of the
//! edge for every sliding group (0 where the request had released it, a tombstone) and the state
//! slot saved at the node's end (0: none). A match is only as long as every group can serve:
//!
//! - full attention needs every page of the prefix (the walk of a plain cache);
//! - a sliding group of window `w` resuming at `t` needs the pages of the last `w` tokens before
//!   `t` (positions `max(0, t - w) .. t - 1`, as `window::release_window_pages` keeps them);
//! - a linear-attention group needs the state saved after exactly `t` tokens: a checkpoint the
//!   caller inserted (`state_slot` of `insert_groups`) at a page-aligned point. With a state pool
//!   and no checkpoint, every match has length 0.
//!
//! The match point is the longest page-aligned `t` all groups accept; the edge is split there, so
//! the handle's node ends at `t`. Sliding pages returned are those of the window at `t` (0
//! before it): they are the cache's, protected by a lock on the node like the full pages; a
//! request that will release them with `release_window_pages` first takes its own reference
//! (`inc_ref`). Eviction drops the tree's reference on every group's pages and the state slot.
//!
//! Every allocator is passed by the caller to each call ([`Others`] beside the full-attention
//! one), checked against the ids the cache was built with.

use super::{common_prefix, Goal, Handle, Namespace, Node, RadixCache, RadixError, Sink};
use super::{NONE, SUPER};
use crate::alloc::{AllocError, PageAllocator, RawPage};
use crate::window::first_kept_entry;

/// What a hybrid cache was built with (the full-attention allocator is the cache's own).
#[derive(Debug)]
pub(super) struct Groups {
    windows: Vec<usize>,
    sliding_ids: Vec<u64>,
    state_id: Option<u64>,
}

/// The allocators of a hybrid cache's extra page spaces, in the order the cache was built with.
#[derive(Debug, Default)]
pub struct Others<'a> {
    pub sliding: Vec<&'a mut PageAllocator>,
    pub state: Option<&'a mut PageAllocator>,
}

/// Result of [`RadixCache::match_prefix_groups`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupMatch {
    /// Full-attention pages of the served prefix (`len / page_size` of them).
    pub pages: Vec<i32>,
    /// Per sliding group, one entry per page of the served prefix: the pages of the window
    /// before `len`, 0 before it.
    pub sliding: Vec<Vec<i32>>,
    /// The state slot saved after `len` tokens (0 for an empty match or no state pool).
    pub state: i32,
    /// The node where the served prefix ends (the super-root for an empty match).
    pub node: Handle,
    /// Served length in tokens (a multiple of the page size).
    pub len: usize,
    /// What full attention alone would have served (`>= len`).
    pub full_len: usize,
}

/// One root-to-leaf path of a hybrid cache, for tests and debugging.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupPath {
    pub tokens: Vec<i32>,
    pub pages: Vec<i32>,
    pub sliding: Vec<Vec<i32>>,
    /// Per page position `j`, the state slot saved after `j + 1` pages (0: none).
    pub states: Vec<i32>,
}

/// Splits a node's `extra` (`np` pages per group) after `head` pages: returns the head's part
/// (no state at its end) and keeps the rest, with the state, in `extra`.
pub(super) fn split_extra(
    extra: &mut Vec<i32>,
    (g, st): (usize, bool),
    np: usize,
    head: usize,
) -> Vec<i32> {
    let mut h = Vec::with_capacity(g * head + usize::from(st));
    let mut rest = Vec::with_capacity(g * (np - head) + usize::from(st));
    for k in 0..g {
        let b = &extra[k * np..(k + 1) * np];
        h.extend_from_slice(&b[..head]);
        rest.extend_from_slice(&b[head..]);
    }
    if st {
        h.push(0);
        rest.push(extra[g * np]);
    }
    *extra = rest;
    h
}

/// Where a read-only insert walk stops.
enum End {
    /// Nothing cached at the aligned end (it is the namespace root, or a new leaf will be).
    None,
    /// A whole node ends there.
    Whole(u32),
    /// Inside an edge: a split will end a node there.
    Partial,
}

impl RadixCache {
    /// A cache for a hybrid model: `sliding` holds each sliding group's allocator and window (in
    /// tokens), `state` the linear-attention state-slot pool. With neither it is a plain cache.
    ///
    /// # Errors
    /// [`RadixError::PageSizeMismatch`]; [`RadixError::BadGroup`] for a window of 0 or a sliding
    /// allocator of another page size; [`RadixError::SharedAllocator`] when one allocator is
    /// passed for two spaces.
    pub fn with_groups(
        alloc: &PageAllocator,
        page_size: usize,
        sliding: &[(&PageAllocator, usize)],
        state: Option<&PageAllocator>,
    ) -> Result<Self, RadixError> {
        let mut c = Self::new(alloc, page_size)?;
        let mut ids = vec![alloc.id()];
        for (index, &(a, w)) in sliding.iter().enumerate() {
            if w == 0 {
                return Err(RadixError::BadGroup {
                    index,
                    reason: "`window` must be at least 1 token, got 0".into(),
                });
            }
            if a.page_size() != page_size {
                return Err(RadixError::BadGroup {
                    index,
                    reason: format!(
                        "allocator page_size {} differs from the cache's page_size {page_size}",
                        a.page_size()
                    ),
                });
            }
            if ids.contains(&a.id()) {
                return Err(RadixError::SharedAllocator);
            }
            ids.push(a.id());
        }
        if let Some(s) = state {
            if ids.contains(&s.id()) {
                return Err(RadixError::SharedAllocator);
            }
        }
        if !sliding.is_empty() || state.is_some() {
            c.groups = Some(Box::new(Groups {
                windows: sliding.iter().map(|&(_, w)| w).collect(),
                sliding_ids: sliding.iter().map(|(a, _)| a.id()).collect(),
                state_id: state.map(PageAllocator::id),
            }));
        }
        Ok(c)
    }

    /// Whether the cache serves extra page spaces (sliding groups or state slots).
    pub fn is_hybrid(&self) -> bool {
        self.groups.is_some()
    }
    /// The window (tokens) of each sliding group.
    pub fn sliding_windows(&self) -> &[usize] {
        self.groups.as_deref().map_or(&[], |g| &g.windows)
    }
    /// Whether matches need a saved linear-attention state (then only checkpoints match).
    pub fn has_state_slots(&self) -> bool {
        self.groups.as_deref().is_some_and(|g| g.state_id.is_some())
    }

    /// (sliding groups, state pool present).
    pub(super) fn shape(&self) -> (usize, bool) {
        self.groups
            .as_deref()
            .map_or((0, false), |g| (g.windows.len(), g.state_id.is_some()))
    }

    /// Checks that `o` holds exactly the extra allocators the cache was built with.
    pub(super) fn check_others(&self, o: &Others<'_>) -> Result<(), RadixError> {
        self.check_no_tier()?;
        let (sliding, state) = self.shape();
        let word = |b: bool| if b { " and a state-slot pool" } else { "" };
        if o.sliding.len() != sliding || o.state.is_some() != state {
            return Err(RadixError::GroupAllocators {
                sliding,
                state: word(state),
                got_sliding: o.sliding.len(),
                got_state: word(o.state.is_some()),
            });
        }
        let Some(g) = self.groups.as_deref() else {
            return Ok(());
        };
        let ok = o
            .sliding
            .iter()
            .zip(&g.sliding_ids)
            .all(|(a, &id)| a.id() == id)
            && o.state.as_deref().map(PageAllocator::id) == g.state_id;
        if ok {
            Ok(())
        } else {
            Err(RadixError::WrongAllocator)
        }
    }

    /// Pages (or the state slot, `group == None`) that evicting `n` would free in that space.
    pub(super) fn freed_in(&self, n: &Node, o: &Others<'_>, group: Option<usize>) -> usize {
        let (g, _) = self.shape();
        let np = n.pages().len();
        match group {
            Some(k) => match (n.extra.get(k * np..(k + 1) * np), o.sliding.get(k)) {
                (Some(pages), Some(a)) => pages
                    .iter()
                    .filter(|&&p| p != 0 && a.only_cached(p))
                    .count(),
                _ => 0,
            },
            None => match (n.extra.get(g * np), o.state.as_deref()) {
                (Some(&s), Some(a)) => usize::from(s != 0 && a.only_cached(s)),
                _ => 0,
            },
        }
    }

    /// Drops the tree's reference on node `id`'s group pages and state slot (it is removed).
    pub(super) fn release_extra(&mut self, id: u32, o: &mut Others<'_>) {
        let (g, st) = self.shape();
        let n = &self.nodes[id as usize];
        let np = n.pages().len();
        for (k, a) in o.sliding.iter_mut().enumerate().take(g) {
            let live: Vec<i32> = n.extra[k * np..(k + 1) * np]
                .iter()
                .copied()
                .filter(|&p| p != 0)
                .collect();
            a.release_cached_all(&live);
        }
        if let (true, Some(a)) = (st, o.state.as_deref_mut()) {
            let s = n.extra[g * np];
            if s != 0 {
                a.release_cached_all(&[s]);
            }
        }
    }

    /// The longest prefix of `tokens` that every group can serve (see the module text), with each
    /// group's pages and the state slot. Splits the edge where it ends, updates access times (of
    /// the served path) and the hit/miss counters (served tokens are hits). Takes no lock.
    pub fn match_prefix_groups(&mut self, ns: &Namespace, tokens: &[i32]) -> GroupMatch {
        let ps = self.page_size;
        let (g, st) = self.shape();
        let aligned = tokens.len() / ps * ps;
        // Read-only walk of the full-attention match: (node, tokens matched in it).
        let mut path: Vec<(u32, usize)> = Vec::new();
        let mut pos = 0;
        if let Some(&root) = self.roots.get(ns.as_bytes()) {
            let mut cur = root;
            while pos < aligned {
                let Some(child) = self.child(cur, &tokens[pos..pos + ps]) else {
                    break;
                };
                let key = self.node(child).key();
                let m = common_prefix(key, &tokens[pos..aligned]) / ps * ps;
                path.push((child, m));
                pos += m;
                if m < key.len() {
                    break;
                }
                cur = child;
            }
        }
        let full_k = pos / ps;
        let mut sliding: Vec<Vec<i32>> = vec![Vec::with_capacity(full_k); g];
        let mut cands = vec![0usize];
        let mut k = 0;
        for &(id, m) in &path {
            let n = self.node(id);
            let (np, mp) = (n.pages().len(), m / ps);
            for (j, s) in sliding.iter_mut().enumerate() {
                s.extend_from_slice(&n.extra[j * np..j * np + mp]);
            }
            k += mp;
            if st && mp == np && n.extra[g * np] != 0 {
                cands.push(k);
            }
        }
        let windows = self.sliding_windows().to_vec();
        // Per group, `live_from[j]`: the first entry from which entries `..j` are all live.
        let live_from: Vec<Vec<usize>> = sliding
            .iter()
            .map(|s| {
                let mut v = Vec::with_capacity(s.len() + 1);
                v.push(0);
                for (j, &p) in s.iter().enumerate() {
                    let last = v[j];
                    v.push(if p == 0 { j + 1 } else { last });
                }
                v
            })
            .collect();
        let serves = |k: usize| {
            windows
                .iter()
                .zip(&live_from)
                .all(|(&w, lf)| first_kept_entry((k * ps) as i64, w, 0, ps) >= lf[k])
        };
        let best = if st {
            cands
                .iter()
                .rev()
                .copied()
                .find(|&k| serves(k))
                .unwrap_or(0)
        } else {
            (0..=full_k).rev().find(|&k| serves(k)).unwrap_or(0)
        };
        // Apply: touch the served path, split where it ends inside an edge.
        self.clock += 1;
        let clock = self.clock;
        let t = best * ps;
        let (mut node, mut acc) = (SUPER, 0);
        let mut pages = Vec::with_capacity(best);
        for &(id, _) in &path {
            if acc >= t {
                break;
            }
            let len = self.node(id).key().len();
            let cur = if acc + len <= t {
                id
            } else {
                self.split(id, t - acc)
            };
            pages.extend_from_slice(self.node(cur).pages());
            acc += self.node(cur).key().len();
            self.touch(cur, clock);
            node = cur;
        }
        let state = if st && best > 0 {
            let n = self.node(node);
            n.extra[g * n.pages().len()]
        } else {
            0
        };
        for (s, &w) in sliding.iter_mut().zip(&windows) {
            s.truncate(best);
            let lo = first_kept_entry(t as i64, w, 0, ps).min(best);
            s[..lo].fill(0);
        }
        self.hit += t as u64;
        self.miss += (tokens.len() - t) as u64;
        GroupMatch {
            pages,
            sliding,
            state,
            node: self.handle(node),
            len: t,
            full_len: pos,
        }
    }

    /// Read-only: tokens of `tokens[..aligned]` already cached, and what ends at `aligned`.
    fn walk_insert(&self, ns: &Namespace, tokens: &[i32], aligned: usize) -> (usize, End) {
        let ps = self.page_size;
        let (mut pos, mut end) = (0, End::None);
        if let Some(&root) = self.roots.get(ns.as_bytes()) {
            let mut cur = root;
            while pos < aligned {
                let Some(child) = self.child(cur, &tokens[pos..pos + ps]) else {
                    break;
                };
                let key = self.node(child).key();
                let m = common_prefix(key, &tokens[pos..aligned]) / ps * ps;
                pos += m;
                if m < key.len() {
                    end = End::Partial;
                    break;
                }
                end = End::Whole(child);
                cur = child;
            }
        }
        (pos, end)
    }

    /// [`insert_parts`](Self::insert_parts) for a hybrid cache: `sliding[g]` holds sliding group
    /// `g`'s page per page of `tokens` (as many entries as the pages; 0 where released), and
    /// `state` (0: none) the slot holding the linear-attention state after exactly `tokens`
    /// (`len(tokens)` a positive multiple of the page size). The tree takes its reference on the
    /// full and live sliding pages of the part not cached yet, and on `state` when no state is
    /// saved at that point yet; the caller's references stay the caller's.
    ///
    /// # Errors
    /// As [`insert_parts`](Self::insert_parts); [`RadixError::GroupCount`],
    /// [`RadixError::GroupLength`], [`RadixError::StateNotAligned`], [`RadixError::NoStatePool`];
    /// [`RadixError::GroupPage`] for a sliding page the tree would take that is out of range, not
    /// allocated, repeated or cached already (and the same for `state`, as a state-slot error).
    /// Nothing changes then.
    #[allow(clippy::too_many_arguments)]
    pub fn insert_groups<P: RawPage>(
        &mut self,
        alloc: &mut PageAllocator,
        others: &mut Others<'_>,
        ns: &Namespace,
        tokens: &[i32],
        parts: &[&[P]],
        sliding: &[&[i32]],
        state: i32,
    ) -> Result<usize, RadixError> {
        self.check_alloc(alloc)?;
        self.check_others(others)?;
        let ps = self.page_size;
        let (g, st) = self.shape();
        let n_pages: usize = parts.iter().map(|p| p.len()).sum();
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
        if sliding.len() != g {
            return Err(RadixError::GroupCount {
                expected: g,
                got: sliding.len(),
            });
        }
        if let Some((group, s)) = sliding.iter().enumerate().find(|(_, s)| s.len() != n_pages) {
            return Err(RadixError::GroupLength {
                group,
                expected: n_pages,
                got: s.len(),
            });
        }
        if state != 0 && !st {
            return Err(RadixError::NoStatePool);
        }
        if state != 0 && (tokens.is_empty() || !tokens.len().is_multiple_of(ps)) {
            return Err(RadixError::StateNotAligned {
                tokens: tokens.len(),
                page_size: ps,
            });
        }
        let aligned = full * ps;
        let (pos, end) = self.walk_insert(ns, tokens, aligned);
        let take_state = state != 0
            && (pos < aligned
                || match end {
                    End::Whole(id) => {
                        let n = self.node(id);
                        n.extra[g * n.pages().len()] == 0
                    }
                    End::Partial => true,
                    End::None => false,
                });
        // Take the groups' references (validating), then the full pages'; undo on any error.
        let live: Vec<Vec<i32>> = sliding
            .iter()
            .map(|s| {
                s[pos / ps..full]
                    .iter()
                    .copied()
                    .filter(|&p| p != 0)
                    .collect()
            })
            .collect();
        // (the pages were held and not cached: dropping the cache's reference undoes the take)
        let undo = |o: &mut Others<'_>, groups: usize| {
            for (a, l) in o.sliding.iter_mut().zip(&live).take(groups) {
                a.release_cached_all(l);
            }
        };
        let failed = (0..g).find_map(|k| {
            let r = others.sliding[k].cache_pages(&live[k]);
            r.err().map(|source| (k, source))
        });
        if let Some((k, source)) = failed {
            undo(others, k);
            return Err(RadixError::GroupPage { group: k, source });
        }
        if take_state {
            if let Some(a) = others.state.as_deref_mut() {
                if let Err(e) = a.cache_pages(&[state]) {
                    undo(others, g);
                    return Err(RadixError::Page(e));
                }
            }
        }
        let (found, end_node) = match self.insert_inner(alloc, ns, tokens, parts) {
            Ok(r) => r,
            Err(e) => {
                undo(others, g);
                if take_state {
                    if let Some(a) = others.state.as_deref_mut() {
                        a.release_cached_all(&[state]);
                    }
                }
                return Err(e);
            }
        };
        debug_assert_eq!(found, pos);
        if end_node != NONE && pos < aligned {
            // The new leaf: its group pages and the state at its end.
            let mut extra = Vec::with_capacity(g * (full - pos / ps) + usize::from(st));
            for s in sliding {
                extra.extend_from_slice(&s[pos / ps..full]);
            }
            if st {
                extra.push(if take_state { state } else { 0 });
            }
            self.node_mut(end_node).extra = extra;
        } else if take_state && end_node != NONE {
            let n = self.node_mut(end_node);
            let np = n.pages().len();
            n.extra[g * np] = state;
        }
        Ok(found)
    }

    /// [`alloc_i32_with`](Self::alloc_i32_with) for sliding group `group` (or the state-slot
    /// pool, `None`): allocates `n` from that space, first evicting LRU entries until enough are
    /// free there.
    ///
    /// # Errors
    /// [`AllocError::OutOfPages`] / [`AllocError::OutOfStateSlots`] (with what eviction could
    /// reclaim) when even evicting everything evictable would not do: nothing changes then;
    /// [`RadixError::BadGroup`] / [`RadixError::NoStatePool`] for a space the cache lacks.
    pub fn alloc_group_with(
        &mut self,
        alloc: &mut PageAllocator,
        others: &mut Others<'_>,
        group: Option<usize>,
        n: usize,
    ) -> Result<Vec<i32>, RadixError> {
        self.check_alloc(alloc)?;
        self.check_others(others)?;
        let free = match group {
            Some(k) => others.sliding.get(k).map(|a| a.num_free()),
            None => others.state.as_deref().map(PageAllocator::num_free),
        };
        let Some(free) = free else {
            return Err(match group {
                Some(index) => RadixError::BadGroup {
                    index,
                    reason: format!(
                        "no such sliding group (the cache has {})",
                        others.sliding.len()
                    ),
                },
                None => RadixError::NoStatePool,
            });
        };
        if n > free {
            let goal = match group {
                Some(k) => Goal::FreeSliding(k, n - free),
                None => Goal::FreeStateSlots(n - free),
            };
            let plan = self.plan(alloc, others, &goal);
            if plan.freed_pages < n - free {
                let e = AllocError::OutOfPages {
                    requested: n,
                    free,
                    evictable: plan.freed_pages,
                };
                return Err(match group {
                    Some(_) => e.into(),
                    None => AllocError::OutOfStateSlots { requested: n, free }.into(),
                });
            }
            self.apply(alloc, &mut Sink::Drop(others), &plan, &mut Vec::new(), 0);
        }
        let space = match group {
            Some(k) => others.sliding.get_mut(k).map(|a| &mut **a),
            None => others.state.as_deref_mut(),
        };
        match space {
            Some(a) => Ok(a.alloc_i32(n)?),
            None => Err(RadixError::NoStatePool),
        }
    }

    /// Every root-to-leaf path of namespace `ns` with all groups' pages and the saved states.
    pub fn leaf_paths_groups(&self, ns: &Namespace) -> Vec<GroupPath> {
        let (g, st) = self.shape();
        let mut out = Vec::new();
        let Some(&root) = self.roots.get(ns.as_bytes()) else {
            return out;
        };
        let empty = GroupPath {
            tokens: Vec::new(),
            pages: Vec::new(),
            sliding: vec![Vec::new(); g],
            states: Vec::new(),
        };
        let mut stack = vec![(root, empty)];
        while let Some((id, path)) = stack.pop() {
            let n = self.node(id);
            if n.children.is_empty() {
                out.push(path);
                continue;
            }
            for c in n.children.ids() {
                let cn = self.node(c);
                let np = cn.pages().len();
                let mut p = path.clone();
                p.tokens.extend_from_slice(cn.key());
                p.pages.extend_from_slice(cn.pages());
                for (k, s) in p.sliding.iter_mut().enumerate() {
                    s.extend_from_slice(&cn.extra[k * np..(k + 1) * np]);
                }
                p.states.extend(std::iter::repeat_n(0, np));
                if st && np > 0 {
                    let last = p.states.len() - 1;
                    p.states[last] = cn.extra[g * np];
                }
                stack.push((c, p));
            }
        }
        out
    }

    /// [`check_invariants`](Self::check_invariants) plus the groups: every node's group entries
    /// are there, and every stored sliding page and state slot is held by the tree once.
    ///
    /// # Errors
    /// [`RadixError::Corrupt`] naming the first broken invariant; as `check_others`.
    pub fn check_invariants_with(
        &self,
        alloc: &PageAllocator,
        others: &Others<'_>,
    ) -> Result<(), RadixError> {
        self.check_invariants(alloc)?;
        self.check_others(others)?;
        let (g, st) = self.shape();
        let bad = |s: String| Err(RadixError::Corrupt(s));
        let mut seen: Vec<Vec<bool>> = others
            .sliding
            .iter()
            .map(|a| vec![false; a.num_pages() + 1])
            .chain(
                others
                    .state
                    .as_deref()
                    .map(|a| vec![false; a.num_pages() + 1]),
            )
            .collect();
        for (i, n) in self.nodes.iter().enumerate() {
            if !n.live || n.key().is_empty() {
                continue;
            }
            let np = n.pages().len();
            if n.extra.len() != g * np + usize::from(st) {
                return bad(format!(
                    "node {i}: {} group entries, expected {}",
                    n.extra.len(),
                    g * np + usize::from(st)
                ));
            }
            let spaces = (0..g).map(|k| (k, &n.extra[k * np..(k + 1) * np]));
            let state = st.then(|| (g, &n.extra[g * np..]));
            for (k, ids) in spaces.chain(state) {
                let a: &PageAllocator = if k < g {
                    others.sliding[k]
                } else {
                    match others.state.as_deref() {
                        Some(a) => a,
                        None => return bad("state pool missing".into()),
                    }
                };
                for &p in ids.iter().filter(|&&p| p != 0) {
                    let Ok(id) = a.page(p) else {
                        return bad(format!("node {i}: group {k} entry {p} is not a usable id"));
                    };
                    let j = id.get() as usize;
                    if seen[k][j] || !a.is_cached(id) {
                        return bad(format!(
                            "node {i}: group {k} page {p} held twice or unmarked"
                        ));
                    }
                    seen[k][j] = true;
                }
            }
        }
        // Every id an allocator marks as cached is in the tree.
        let spaces = others
            .sliding
            .iter()
            .map(|a| &**a)
            .chain(others.state.as_deref());
        for (k, (s, a)) in seen.iter().zip(spaces).enumerate() {
            let marked = (1..=a.num_pages() as u32)
                .filter_map(crate::alloc::PageId::new)
                .filter(|&p| a.is_cached(p))
                .count();
            if marked != s.iter().filter(|&&x| x).count() {
                return bad(format!(
                    "group {k}: {marked} ids marked cached, the tree holds fewer"
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
#[path = "groups_tests.rs"]
mod tests;
