//! The `radix` room's error ([`RadixError`], mapped to Python once in the bindings) and the
//! checks of its token input.

use crate::alloc::AllocError;

/// Errors of the `radix` room.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RadixError {
    #[error(transparent)]
    Page(#[from] AllocError),
    #[error("this radix cache was built over another page allocator")]
    WrongAllocator,
    #[error("cache `page_size` {cache} differs from the allocator's page_size {allocator}")]
    PageSizeMismatch { cache: usize, allocator: usize },
    #[error("`pages` has {pages} entries, but {tokens} tokens at page_size {page_size} need {full} (whole pages) or {ceil} (with the partial last page)")]
    LengthMismatch {
        tokens: usize,
        pages: usize,
        page_size: usize,
        full: usize,
        ceil: usize,
    },
    #[error("token `{value}` at index {index} is not a token id (token ids are 0..=2147483647, int32 and non-negative)")]
    TokenOutOfRange { index: usize, value: i64 },
    #[error("stale node handle `{node}`: the node was evicted, the cache was reset, or the handle belongs to another cache")]
    StaleHandle { node: u32 },
    #[error("unlock of node `{node}`, which holds no lock (each unlock must match one lock of the same handle)")]
    NotLocked { node: u32 },
    #[error("lock count of node `{node}` would overflow")]
    LockOverflow { node: u32 },
    #[error("cannot reset: {protected} tokens are locked ({locks} locks held); unlock them first")]
    Locked { protected: usize, locks: u64 },
    #[error("radix cache invariant broken: {0}")]
    Corrupt(String),
    #[error("this radix cache serves {sliding} sliding-window group(s){state}: pass their allocators (got {got_sliding} sliding{got_state})")]
    GroupAllocators {
        sliding: usize,
        state: &'static str,
        got_sliding: usize,
        got_state: &'static str,
    },
    #[error("`sliding[{index}]`: {reason}")]
    BadGroup { index: usize, reason: String },
    #[error("`sliding_pages[{group}]`: {source}")]
    GroupPage { group: usize, source: AllocError },
    #[error("`sliding_pages` has {got} arrays, expected {expected} (one per sliding group)")]
    GroupCount { expected: usize, got: usize },
    #[error("`sliding_pages[{group}]` has {got} entries, expected {expected} (one per page, as `pages`)")]
    GroupLength {
        group: usize,
        expected: usize,
        got: usize,
    },
    #[error("`state_slot` is a checkpoint after exactly `len(tokens)` = {tokens} tokens, which must be a positive multiple of page_size {page_size}")]
    StateNotAligned { tokens: usize, page_size: usize },
    #[error("`state_slot` given, but this radix cache has no state-slot pool")]
    NoStatePool,
    #[error("the same allocator is passed twice (full, sliding and state spaces need one each)")]
    SharedAllocator,
    #[error("{}", if *has_tier { "this radix cache has a host tier: use the calls that take its host allocator" } else { "this radix cache has no host tier (build it with a host allocator)" })]
    HostAllocator { has_tier: bool },
    #[error("a host tier is not supported for hybrid caches (sliding groups or state slots)")]
    HostTierHybrid,
    #[error("a host tier can only be added to an empty radix cache without one")]
    HostTierBusy,
    #[error("node `{node}` is on the host tier: load it back (`load_back`) before locking it")]
    OnHost { node: u32 },
    #[error("node `{node}` is on the device tier: nothing to load back")]
    NotOnHost { node: u32 },
    #[error("`pages` has {got} entries, but node `{node}` and its host ancestors hold {expected} host pages")]
    LoadLength { node: u32, expected: usize, got: usize },
    #[error("`priority` = {value} is outside 0..=100 (higher is kept longer)")]
    BadPriority { value: i64 },
    #[error("`retention_s` = {value}: a retention is a number of seconds >= 0 (None: no decay)")]
    BadRetention { value: String },
    #[error("the clock (`now`) read `{value}`: not a finite number of seconds")]
    BadTime { value: String },
    #[error("unpin of node `{node}`, which holds no pin (each unpin must match one pin of the same handle)")]
    NotPinned { node: u32 },
    #[error("pin count of node `{node}` would overflow")]
    PinOverflow { node: u32 },
    #[error("pin of node `{node}` would pin {tokens} more tokens, {pinned} of the budget `max_pinned_tokens` = {max} are pinned already")]
    PinBudget {
        node: u32,
        tokens: usize,
        pinned: usize,
        max: usize,
    },
}

/// Narrows int64 token ids to int32 (token ids of every tokenizer fit).
///
/// # Errors
/// [`RadixError::TokenOutOfRange`] naming the first value that does not fit or is negative.
pub fn narrow_tokens(tokens: &[i64]) -> Result<Vec<i32>, RadixError> {
    let fits = |v: i64| (0..=i64::from(i32::MAX)).contains(&v);
    // Branch-free check first (vectorizes), then a plain cast; the slow path only names the value.
    if tokens.iter().fold(true, |ok, &v| ok & fits(v)) {
        return Ok(tokens.iter().map(|&v| v as i32).collect());
    }
    let (index, &value) = tokens
        .iter()
        .enumerate()
        .find(|(_, &v)| !fits(v))
        .unwrap_or((0, &0));
    Err(RadixError::TokenOutOfRange { index, value })
}

/// Checks int32 token ids: a negative one is no token of any tokenizer (a padding value or a
/// bug), and caching it would make a key no real prompt matches.
///
/// # Errors
/// [`RadixError::TokenOutOfRange`] naming the first negative value.
pub fn check_tokens(tokens: &[i32]) -> Result<(), RadixError> {
    // Branch-free first (vectorizes); the slow path only names the value.
    if tokens.iter().fold(0, |acc, &v| acc | v) >= 0 {
        return Ok(());
    }
    let (index, &value) = tokens.iter().enumerate().find(|(_, &v)| v < 0).unwrap_or((0, &0));
    Err(RadixError::TokenOutOfRange { index, value: i64::from(value) })
}
