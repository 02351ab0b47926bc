//! Layer groups and page spaces: which layers share page ids, and what one request holds in each.
//!
//! A layer belongs to a group by what it stores: `full` (full attention; `mla` for an MLA latent),
//! `sliding_<window>` (one group per window size), `linear_state` (per-request conv + SSM state,
//! no token pages), `shared` (reads another layer's KV, owns no bytes) and `draft` (the layers of
//! a draft model). Groups with storage live in a page space, whose rows are
//! `(num_pages + 1) * page_size` (page 0 is padding):
//!
//! - `primary`: full, MLA and draft layers. They share page ids: the draft runs over the same
//!   tokens, so one page table addresses both (as SGLang's draft KV pool shares the target's slots).
//! - `sliding_<window>`: one space per window size with its own page count, since a request keeps
//!   only the pages of its last `window` tokens there.
//! - `linear_state`: one slot per running request (`page_size` 1); slot 0 is padding for
//!   CUDA-graph padded requests, as page 0 is.

use crate::model::{LayerKind, ModelGeometry};

/// What a group stores.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupKind {
    Full,
    Mla,
    Sliding { window: u64 },
    LinearState,
    Shared,
    Draft,
}

impl GroupKind {
    /// `full`, `mla`, `sliding_<window>`, `linear_state`, `shared`, `draft`.
    pub fn name(self) -> String {
        match self {
            Self::Full => "full".into(),
            Self::Mla => "mla".into(),
            Self::Sliding { window } => format!("sliding_{window}"),
            Self::LinearState => "linear_state".into(),
            Self::Shared => "shared".into(),
            Self::Draft => "draft".into(),
        }
    }

    /// The kind without its window (`sliding` for every window).
    pub const fn kind_name(self) -> &'static str {
        match self {
            Self::Full => "full",
            Self::Mla => "mla",
            Self::Sliding { .. } => "sliding",
            Self::LinearState => "linear_state",
            Self::Shared => "shared",
            Self::Draft => "draft",
        }
    }
}

/// What a page space holds per request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpaceKind {
    /// Every token of the request.
    Primary,
    /// The last `window` tokens (plus rounding and rollback pages).
    Sliding { window: u64 },
    /// One state slot per request.
    State,
}

/// A set of page ids with its own allocator and row count.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PageSpace {
    pub name: String,
    pub kind: SpaceKind,
    /// Tokens per page (1 for the state pool: a slot is a page of one row).
    pub page_size: u64,
}

/// A group of layers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Group {
    pub name: String,
    pub kind: GroupKind,
    /// Layer indices (of the draft model for the draft group).
    pub layers: Vec<usize>,
    /// Index into the layout's spaces; `None` for shared layers.
    pub space: Option<usize>,
}

/// What a plan is sized for: requests of `context_len` tokens, speculative drafts, prefill chunks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Target {
    /// Tokens per request at which every group holds the same number of requests.
    pub context_len: u64,
    /// Tokens one prefill chunk writes into sliding spaces before the window drops them (SGLang
    /// `--chunked-prefill-size`); `None`: prefills are not chunked (a whole request at once).
    pub chunked_prefill_size: Option<u64>,
    /// Draft tokens per speculative step (SGLang `--speculative-num-draft-tokens`): sliding
    /// spaces keep that many tokens' pages past the window for rollback.
    pub num_draft_tokens: u64,
}

impl Default for Target {
    fn default() -> Self {
        Self { context_len: 8192, chunked_prefill_size: Some(8192), num_draft_tokens: 0 }
    }
}

impl PageSpace {
    /// Pages (slots) one request of `n` tokens holds here.
    ///
    /// Primary: `ceil(n / page_size)`. Sliding: `min(ceil(n / ps), ceil(min(n, w) / ps) + r +
    /// ceil(draft / ps))` with `r` = 1 when `ps > 1` (a window rarely starts on a page boundary)
    /// and `draft` the pages a speculative step may roll back into. State: 1 slot.
    pub fn pages_per_request(&self, n: u64, num_draft_tokens: u64) -> u64 {
        let ps = self.page_size;
        let full = n.div_ceil(ps);
        match self.kind {
            SpaceKind::Primary => full,
            SpaceKind::Sliding { window } => {
                let windowed = n.min(window).div_ceil(ps) + u64::from(ps > 1) + num_draft_tokens.div_ceil(ps);
                windowed.min(full)
            }
            SpaceKind::State => 1,
        }
    }

    /// Pages a sliding space keeps free beyond `N` requests' steady state: one prefill chunk
    /// writes all its tokens before the window drops them, so a request in prefill may hold up
    /// to `ceil(chunk / ps)` pages more, never more than a request of `context_len` holds without
    /// a window. 0 for other spaces.
    pub fn headroom(&self, target: &Target) -> u64 {
        match self.kind {
            SpaceKind::Sliding { .. } => {
                let l = target.context_len;
                let chunk = target.chunked_prefill_size.unwrap_or(l).min(l);
                let full = l.div_ceil(self.page_size);
                let steady = self.pages_per_request(l, target.num_draft_tokens);
                chunk.div_ceil(self.page_size).min(full - steady)
            }
            _ => 0,
        }
    }

    /// Most pages whose slot ids fit int32 page tables and slot arrays:
    /// `(num_pages + 1) * page_size - 1 <= 2^31 - 1`.
    pub const fn int32_max_pages(&self) -> u64 {
        (1u64 << 31) / self.page_size - 1
    }
}

/// The groups and page spaces of `model` (validated by the caller), in a fixed order: spaces
/// `primary`, `sliding_<w>` by window, `linear_state`; groups `full`/`mla`, `sliding_<w>`,
/// `linear_state`, `shared`, `draft`. Empty groups and spaces are left out.
pub fn groups_of(model: &ModelGeometry, page_size: u64) -> (Vec<Group>, Vec<PageSpace>) {
    let mut windows: Vec<u64> = model
        .layers
        .iter()
        .filter_map(|k| if let LayerKind::Sliding { window } = *k { Some(window) } else { None })
        .collect();
    windows.sort_unstable();
    windows.dedup();
    let layers_where = |f: &dyn Fn(LayerKind) -> bool| -> Vec<usize> {
        model.layers.iter().enumerate().filter(|(_, k)| f(**k)).map(|(i, _)| i).collect()
    };
    let full = layers_where(&|k| k == LayerKind::Full);
    let linear = layers_where(&|k| k == LayerKind::Linear);
    let shared = layers_where(&|k| matches!(k, LayerKind::Shared { .. }));
    let draft: Vec<usize> = model.draft.as_ref().map_or(vec![], |d| (0..d.layers.len()).collect());

    let mut spaces = Vec::new();
    let mut groups = Vec::new();
    if !full.is_empty() || !draft.is_empty() {
        spaces.push(PageSpace { name: "primary".into(), kind: SpaceKind::Primary, page_size });
    }
    if !full.is_empty() {
        let kind = if model.mla.is_some() { GroupKind::Mla } else { GroupKind::Full };
        groups.push(Group { name: kind.name(), kind, layers: full, space: Some(0) });
    }
    for &window in &windows {
        let kind = GroupKind::Sliding { window };
        spaces.push(PageSpace { name: kind.name(), kind: SpaceKind::Sliding { window }, page_size });
        let layers = layers_where(&|k| k == LayerKind::Sliding { window });
        groups.push(Group { name: kind.name(), kind, layers, space: Some(spaces.len() - 1) });
    }
    if !linear.is_empty() {
        spaces.push(PageSpace { name: "linear_state".into(), kind: SpaceKind::State, page_size: 1 });
        let kind = GroupKind::LinearState;
        groups.push(Group { name: kind.name(), kind, layers: linear, space: Some(spaces.len() - 1) });
    }
    if !shared.is_empty() {
        groups.push(Group { name: "shared".into(), kind: GroupKind::Shared, layers: shared, space: None });
    }
    if !draft.is_empty() {
        groups.push(Group { name: "draft".into(), kind: GroupKind::Draft, layers: draft, space: Some(0) });
    }
    (groups, spaces)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn space(kind: SpaceKind, page_size: u64) -> PageSpace {
        PageSpace { name: String::new(), kind, page_size }
    }

    #[test]
    fn pages_per_request_by_hand() {
        let s = space(SpaceKind::Sliding { window: 128 }, 16);
        // 8192 tokens, window 128, 16-token pages: 8 pages of window + 1 for the boundary
        assert_eq!(s.pages_per_request(8192, 0), 9);
        // 3 draft tokens keep one more page for rollback
        assert_eq!(s.pages_per_request(8192, 3), 10);
        // a short request holds no more than its own pages
        assert_eq!(s.pages_per_request(100, 3), 7);
        assert_eq!(space(SpaceKind::Sliding { window: 128 }, 1).pages_per_request(8192, 0), 128);
        assert_eq!(space(SpaceKind::Primary, 16).pages_per_request(8193, 5), 513);
        assert_eq!(space(SpaceKind::State, 1).pages_per_request(8193, 5), 1);
    }

    #[test]
    fn headroom_is_one_chunk_at_most_the_unwindowed_rest() {
        let s = space(SpaceKind::Sliding { window: 128 }, 16);
        let t = Target::default();
        // one chunk of 8,192 tokens is 512 pages, but a request never holds more than its 512
        // pages: 512 - 9 steady = 503 more
        assert_eq!(s.headroom(&t), 503);
        // a window that never binds at context_len needs no headroom
        assert_eq!(space(SpaceKind::Sliding { window: 8192 }, 16).headroom(&t), 0);
        let t = Target { context_len: 4096, chunked_prefill_size: Some(8192), num_draft_tokens: 0 };
        assert_eq!(s.headroom(&t), 256 - 9);
    }

    #[test]
    fn int32_cap() {
        assert_eq!(space(SpaceKind::Primary, 1).int32_max_pages(), (1 << 31) - 1);
        let s = space(SpaceKind::Primary, 64);
        let p = s.int32_max_pages();
        assert!((p + 1) * 64 - 1 <= i32::MAX as u64 && (p + 2) * 64 - 1 > i32::MAX as u64);
    }
}
