//! `size_for`: a memory budget -> the largest page-aligned token capacity whose whole layout fits.
//!
//! The budget follows SGLang's `profile_max_num_token`, so numbers agree with its logs:
//! `rest = available_memory - total_memory * (1 - mem_frac)`, with `total_memory` the free device
//! memory before the weights were loaded and `available_memory` the free memory after.

use crate::groups::{SpaceKind, Target};
use crate::layout::{Layout, LayoutConfig, LayoutError, Role, Tensor};
use crate::model::ModelGeometry;

/// Errors of the `sizing` room.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SizingError {
    #[error("`mem_frac` must be in (0, 1], got {value}")]
    MemFrac { value: f64 },
    #[error("available memory ({available} bytes) exceeds total memory ({total} bytes); `available_memory` is what is free after loading weights, `total_memory` what was free before")]
    AvailableAboveTotal { available: u64, total: u64 },
    #[error("no memory left for the KV pool: {available} bytes available after weights, but {reserved} bytes (total {total} x (1 - mem_frac {mem_frac})) are reserved for activations; raise `mem_frac`, use a larger GPU or smaller weights")]
    NoBudget { available: u64, reserved: u64, total: u64, mem_frac: f64 },
    #[error("budget of {budget} bytes cannot hold one page: the smallest pool (one usable page of {page_size} tokens plus the padding page, {bytes_per_token} bytes per token, {fixed} fixed bytes) needs {needed} bytes, {missing} more; raise `mem_frac`, lower `page_size`, or pick a smaller KV dtype")]
    TooSmall { budget: u64, needed: u64, missing: u64, page_size: u64, bytes_per_token: u64, fixed: u64 },
    #[error("budget of {budget} bytes cannot hold one request of `context_len` = {context_len} tokens in every layer group (page spaces and linear-attention state slots, with the prefill-chunk headroom of sliding spaces): that needs {needed} bytes, {missing} more; lower `context_len` or `chunked_prefill_size`, raise `mem_frac`, or pick a smaller KV dtype")]
    TooSmallForRequest { budget: u64, needed: u64, missing: u64, context_len: u64 },
    #[error("`context_len` must be at least 1 token, got 0")]
    ZeroContext,
    #[error("`chunked_prefill_size` must be at least 1 token (or None for unchunked prefill), got 0")]
    ZeroChunk,
    #[error("`{what}` = {value} exceeds {MAX_TOKENS} tokens")]
    TooManyTokens { what: &'static str, value: u64 },
    #[error("a pool of {num_tokens} tokens would take more than 2^64 bytes")]
    TooLarge { num_tokens: u64 },
    #[error(transparent)]
    Layout(#[from] LayoutError),
}

/// Largest token count a plan or request may have (2^40, about 1.1e12 tokens).
pub const MAX_TOKENS: u64 = 1 << 40;

fn check_tokens(what: &'static str, value: u64) -> Result<u64, SizingError> {
    if value > MAX_TOKENS {
        return Err(SizingError::TooManyTokens { what, value });
    }
    Ok(value)
}

/// SGLang's KV budget in bytes: `available - total * (1 - mem_frac)`.
///
/// # Errors
/// [`SizingError::MemFrac`] outside (0, 1], [`SizingError::AvailableAboveTotal`],
/// [`SizingError::NoBudget`] when nothing is left.
pub fn kv_budget(total_memory: u64, available_memory: u64, mem_frac: f64) -> Result<u64, SizingError> {
    if !(mem_frac > 0.0 && mem_frac <= 1.0) {
        return Err(SizingError::MemFrac { value: mem_frac });
    }
    if available_memory > total_memory {
        return Err(SizingError::AvailableAboveTotal { available: available_memory, total: total_memory });
    }
    // f64 holds byte counts exactly up to 2^53 (8 PiB); round to the nearest byte so that
    // 1 - 0.85 = 0.15000000000000002 does not cost a byte.
    let reserved = (total_memory as f64 * (1.0 - mem_frac)).round() as u64;
    if available_memory <= reserved {
        return Err(SizingError::NoBudget { available: available_memory, reserved, total: total_memory, mem_frac });
    }
    Ok(available_memory - reserved)
}

/// The largest `num_tokens`, a multiple of `page_size`, with a one-space `layout`'s bytes within
/// `budget` (the only space of a model without sliding or linear layers).
///
/// # Errors
/// [`SizingError::TooSmall`] when not even one usable page fits, naming the missing bytes.
pub fn capacity(layout: &Layout, budget: u64) -> Result<u64, SizingError> {
    let ps = layout.spaces[0].page_size;
    let bpt = layout.space_row_bytes(0);
    let fixed = layout.fixed_bytes();
    let needed = layout.total_bytes(&[1]);
    if budget < needed {
        return Err(SizingError::TooSmall {
            budget,
            needed,
            missing: needed - budget,
            page_size: ps,
            bytes_per_token: bpt,
            fixed,
        });
    }
    // needed fits in `budget`, so rows >= 2 pages and bpt > 0 (every KV layer stores bytes).
    let rows = (budget - fixed) / bpt;
    Ok((rows / ps - 1) * ps).and_then(|n| check_tokens("capacity", n))
}

/// A sized pool: its layout and how many pages (slots) each page space holds.
///
/// Split rule for a model with several spaces: at `target.context_len` every space holds the same
/// number of requests `N` (the largest that fits), sliding spaces keep `headroom` pages more for
/// one prefill chunk, and what is left of the budget goes to the first space. Every space is
/// capped so that its slot ids fit int32: `(num_pages + 1) * page_size - 1 <= 2^31 - 1`.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    pub layout: Layout,
    pub target: Target,
    /// Usable pages of each space of `layout.spaces` (state slots for the state space).
    pub pages: Vec<u64>,
    /// Pages of each space kept for one prefill chunk (0 outside sliding spaces).
    pub headroom: Vec<u64>,
    /// Whether the int32 cap, not the budget, set the space's pages.
    pub capped_by_int32: Vec<bool>,
    pub budget: u64,
}

fn check_target(t: &Target) -> Result<(), SizingError> {
    if t.context_len == 0 {
        return Err(SizingError::ZeroContext);
    }
    if t.chunked_prefill_size == Some(0) {
        return Err(SizingError::ZeroChunk);
    }
    check_tokens("context_len", t.context_len)?;
    check_tokens("num_draft_tokens", t.num_draft_tokens)?;
    if let Some(c) = t.chunked_prefill_size {
        check_tokens("chunked_prefill_size", c)?;
    }
    Ok(())
}

impl Plan {
    /// Sizes `model` under `config` for `target` to fit in `budget` bytes.
    ///
    /// # Errors
    /// Any [`LayoutError`] of the config, [`SizingError::TooSmall`] (one space, not one page
    /// fits), [`SizingError::TooSmallForRequest`] (several spaces, not one request of
    /// `context_len` fits in all of them).
    pub fn new(model: &ModelGeometry, config: &LayoutConfig, target: Target, budget: u64) -> Result<Self, SizingError> {
        check_target(&target)?;
        let layout = Layout::new(model, config)?;
        let k = layout.spaces.len();
        let caps: Vec<u64> = layout.spaces.iter().map(|s| s.int32_max_pages()).collect();
        let headroom: Vec<u64> = layout.spaces.iter().map(|s| s.headroom(&target)).collect();
        let mut capped = vec![false; k];
        if k == 1 {
            let ps = layout.spaces[0].page_size;
            let mut pages = capacity(&layout, budget)? / ps;
            if pages > caps[0] {
                (pages, capped[0]) = (caps[0], true);
            }
            // (a one-space sliding model may get fewer pages than a chunk; it holds no request)
            let headroom = vec![headroom[0].min(pages)];
            return Ok(Self { layout, target, pages: vec![pages], headroom, capped_by_int32: capped, budget });
        }
        // bytes(N) = a + N * b, exact in u128
        let page_bytes: Vec<u128> =
            (0..k).map(|s| u128::from(layout.spaces[s].page_size) * u128::from(layout.space_row_bytes(s))).collect();
        let per_req: Vec<u64> = layout.spaces.iter().map(|s| s.pages_per_request(target.context_len, target.num_draft_tokens)).collect();
        let a: u128 = u128::from(layout.fixed_bytes()) + (0..k).map(|s| (u128::from(headroom[s]) + 1) * page_bytes[s]).sum::<u128>();
        let b: u128 = (0..k).map(|s| u128::from(per_req[s]) * page_bytes[s]).sum();
        let n_budget = u128::from(budget).saturating_sub(a) / b;
        if n_budget == 0 {
            let needed = u64::try_from(a + b).unwrap_or(u64::MAX);
            return Err(SizingError::TooSmallForRequest {
                budget,
                needed,
                missing: needed.saturating_sub(budget),
                context_len: target.context_len,
            });
        }
        let mut n = u64::try_from(n_budget).unwrap_or(u64::MAX);
        let n_caps: Vec<u64> = (0..k).map(|s| caps[s].saturating_sub(headroom[s]) / per_req[s]).collect();
        let n_cap = n_caps.iter().copied().min().unwrap_or(u64::MAX);
        if n_cap < n {
            n = n_cap;
            for s in 0..k {
                capped[s] = n_caps[s] == n_cap;
            }
        }
        let mut pages: Vec<u64> = (0..k).map(|s| n * per_req[s] + headroom[s]).collect();
        // what is left goes to the first space, in whole pages
        let used = a + u128::from(n) * b;
        let extra = u64::try_from((u128::from(budget) - used) / page_bytes[0]).unwrap_or(u64::MAX);
        let room = caps[0] - pages[0];
        if extra > room {
            capped[0] = true;
        }
        pages[0] += extra.min(room);
        Ok(Self { layout, target, pages, headroom, capped_by_int32: capped, budget })
    }

    /// A plan with a caller-chosen token count for the first space (rounded up to whole pages);
    /// the other spaces hold as many requests of `context_len` tokens as it does (at least one),
    /// budget = its bytes.
    ///
    /// # Errors
    /// Any [`LayoutError`] of the config, [`SizingError::TooManyTokens`].
    pub fn with_tokens(model: &ModelGeometry, config: &LayoutConfig, target: Target, num_tokens: u64) -> Result<Self, SizingError> {
        check_target(&target)?;
        let layout = Layout::new(model, config)?;
        let k = layout.spaces.len();
        let headroom: Vec<u64> = layout.spaces.iter().map(|s| s.headroom(&target)).collect();
        let per_req: Vec<u64> = layout.spaces.iter().map(|s| s.pages_per_request(target.context_len, target.num_draft_tokens)).collect();
        let mut pages = vec![check_tokens("num_tokens", num_tokens)?.div_ceil(layout.spaces[0].page_size)];
        let n = (pages[0].saturating_sub(headroom[0]) / per_req[0]).max(1);
        pages.extend((1..k).map(|s| n * per_req[s] + headroom[s]));
        let mut capped = vec![false; k];
        for (s, p) in pages.iter_mut().enumerate() {
            let cap = layout.spaces[s].int32_max_pages();
            if *p > cap {
                (*p, capped[s]) = (cap, true);
            }
        }
        let budget = layout.checked_total_bytes(&pages).ok_or(SizingError::TooLarge { num_tokens })?;
        let headroom = headroom.iter().zip(&pages).map(|(&h, &p)| h.min(p)).collect();
        Ok(Self { layout, target, pages, headroom, capped_by_int32: capped, budget })
    }

    /// Usable pages of the first page space (the primary one, when the model has full layers).
    pub fn num_pages(&self) -> u64 {
        self.pages[0]
    }

    /// Usable token slots of the first page space.
    pub fn num_tokens(&self) -> u64 {
        self.pages[0] * self.layout.spaces[0].page_size
    }

    /// Linear-attention state slots (0 without linear layers); slot 0 is padding on top.
    pub fn num_state_slots(&self) -> u64 {
        self.layout.spaces.iter().position(|s| s.kind == SpaceKind::State).map_or(0, |s| self.pages[s])
    }

    /// Rows of space `space` (padding page included).
    pub fn rows(&self, space: usize) -> u64 {
        self.layout.rows(space, self.pages[space])
    }

    pub fn total_bytes(&self) -> u64 {
        self.layout.total_bytes(&self.pages)
    }

    /// Bytes of space `space`'s buffers.
    pub fn space_bytes(&self, space: usize) -> u64 {
        self.rows(space) * self.layout.space_row_bytes(space)
    }

    /// Bytes of the buffers that match `pred`, for this plan's row counts.
    pub fn bytes_where(&self, pred: impl Fn(Tensor, Role) -> bool) -> u64 {
        self.layout
            .buffers
            .iter()
            .filter(|b| pred(b.tensor, b.role))
            .map(|b| self.rows(b.space) * b.row_bytes() + b.fixed_bytes())
            .sum()
    }

    /// Bytes one request of `n` tokens holds: in each page space the pages of
    /// [`crate::groups::PageSpace::pages_per_request`] (full layers `ceil(n / page_size)`,
    /// sliding layers their window plus rounding and rollback pages), plus one linear-attention
    /// state slot. Workspaces are not per request.
    ///
    /// # Errors
    /// [`SizingError::TooManyTokens`] for `n` beyond [`MAX_TOKENS`], [`SizingError::TooLarge`]
    /// when the bytes exceed `u64::MAX`.
    pub fn request_bytes(&self, n: u64) -> Result<u64, SizingError> {
        check_tokens("n", n)?;
        let mut total: u64 = 0;
        for (s, space) in self.layout.spaces.iter().enumerate() {
            total = (space.pages_per_request(n, self.target.num_draft_tokens) * space.page_size)
                .checked_mul(self.layout.space_request_row_bytes(s))
                .and_then(|b| total.checked_add(b))
                .ok_or(SizingError::TooLarge { num_tokens: n })?;
        }
        Ok(total)
    }

    /// Requests of `n` tokens each space holds at once: pages outside the prefill-chunk headroom
    /// over pages per request; state slots for the state space.
    pub fn space_requests(&self, space: usize, n: u64) -> u64 {
        let per = self.layout.spaces[space].pages_per_request(n, self.target.num_draft_tokens);
        if per == 0 {
            return u64::MAX;
        }
        self.pages[space].saturating_sub(self.headroom[space]) / per
    }

    /// Requests of `n` tokens the whole pool holds: the least over its spaces.
    ///
    /// # Errors
    /// [`SizingError::TooManyTokens`] for `n` beyond [`MAX_TOKENS`].
    pub fn requests_fit(&self, n: u64) -> Result<u64, SizingError> {
        check_tokens("n", n)?;
        Ok((0..self.layout.spaces.len()).map(|s| self.space_requests(s, n)).min().unwrap_or(0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::KvDtype;
    use crate::layout::Nvfp4Recipe;
    use crate::model::{LayerKind, LinearState, Mla, ModelError};
    use crate::dtype::ElemDtype;

    const GIB: u64 = 1 << 30;

    fn gqa(layers: usize, kv: u64, d: u64) -> ModelGeometry {
        ModelGeometry {
            layers: vec![LayerKind::Full; layers],
            num_attention_heads: 4 * kv,
            num_kv_heads: kv,
            head_dim: d,
            v_head_dim: d,
            sliding_head_dim: None,
            sliding_v_head_dim: None,
            mla: None,
            linear_state: None,
            draft: None,
        }
    }

    fn cfg(dtype: KvDtype, page_size: u64, tp_size: u64) -> LayoutConfig {
        LayoutConfig { dtype, overrides: vec![], sliding_dtype: None, page_size, tp_size, nvfp4_recipe: Nvfp4Recipe::Linear }
    }

    #[test]
    fn llama8b_capacities_in_10_gib() {
        // KVB-07: 32 layers, 8 KV heads, head_dim 128.
        let m = gqa(32, 8, 128);
        let cases = [
            (KvDtype::Bf16, 131_072, 0, 81_919),
            (KvDtype::Fp8E4m3, 65_536, 256, 163_838),
            (KvDtype::Nvfp4, 36_864, 256, 291_270),
            (KvDtype::Fp4MxBlock16, 36_864, 0, 291_270),
        ];
        for (d, bpt, fixed, tokens) in cases {
            let plan = Plan::new(&m, &cfg(d, 1, 1), Target::default(), 10 * GIB).unwrap();
            assert_eq!(plan.layout.bytes_per_token(), bpt, "{d}");
            assert_eq!(plan.layout.fixed_bytes(), fixed, "{d}");
            assert_eq!(plan.num_tokens(), tokens, "{d}");
        }
    }

    #[test]
    fn mla_latent_is_one_per_token_on_every_rank() {
        let m = ModelGeometry {
            mla: Some(Mla { kv_lora_rank: 512, qk_rope_head_dim: 64 }),
            ..gqa(61, 128, 192)
        };
        for tp in [1, 2, 8, 16] {
            let l = Layout::new(&m, &cfg(KvDtype::Bf16, 1, tp)).unwrap();
            assert_eq!(l.bytes_per_token(), 70_272);
        }
        // 512 query heads do not split over 3 ranks
        assert!(matches!(
            Layout::new(&m, &cfg(KvDtype::Bf16, 1, 3)),
            Err(LayoutError::Model(ModelError::TpQueryMismatch { tp_size: 3, num_attention_heads: 512 }))
        ));
    }

    #[test]
    fn query_heads_group_evenly_over_kv_heads() {
        // 32 query heads over 6 KV heads: no even grouping
        let m = ModelGeometry { num_attention_heads: 32, ..gqa(4, 6, 128) };
        assert!(matches!(
            m.validate(),
            Err(ModelError::GroupMismatch { num_attention_heads: 32, num_kv_heads: 6 })
        ));
        assert!(gqa(4, 8, 128).validate().is_ok());
    }

    #[test]
    fn capacity_is_page_aligned_and_fits() {
        let l = Layout::new(&gqa(4, 8, 128), &cfg(KvDtype::Nvfp4, 16, 1)).unwrap();
        for budget in [l.total_bytes(&[1]), l.total_bytes(&[1]) + 1, 123_456_789, 10 * GIB] {
            let n = capacity(&l, budget).unwrap();
            assert_eq!(n % 16, 0);
            assert!(l.total_bytes(&[n / 16]) <= budget && l.total_bytes(&[n / 16 + 1]) > budget);
        }
        let too_small = l.total_bytes(&[1]) - 1;
        assert!(matches!(capacity(&l, too_small), Err(SizingError::TooSmall { missing: 1, .. })));
    }

    #[test]
    fn budget_rules() {
        assert_eq!(kv_budget(80 * GIB, 60 * GIB, 0.85).unwrap(), 48 * GIB);
        assert!(matches!(kv_budget(1, 1, 0.0), Err(SizingError::MemFrac { .. })));
        assert!(matches!(kv_budget(1, 1, f64::NAN), Err(SizingError::MemFrac { .. })));
        assert!(matches!(kv_budget(GIB, 2 * GIB, 0.5), Err(SizingError::AvailableAboveTotal { .. })));
        assert!(matches!(kv_budget(GIB, GIB / 4, 0.5), Err(SizingError::NoBudget { .. })));
    }

    #[test]
    fn tp_heads() {
        let m = gqa(80, 8, 128);
        let per_rank: Vec<u64> = [1, 2, 4, 8, 16, 32].iter().map(|&tp| m.kv_heads_per_rank(tp).unwrap()).collect();
        assert_eq!(per_rank, [8, 4, 2, 1, 1, 1]);
        assert!(m.kv_heads_per_rank(3).is_err() && m.kv_heads_per_rank(12).is_err() && m.kv_heads_per_rank(0).is_err());
    }

    #[test]
    fn sliding_request_bytes() {
        // KVB-03: 18 sliding (window 128) + 18 full layers, 2,048 bytes per layer per token.
        let m = gpt_oss_like();
        let plan = Plan::new(&m, &cfg(KvDtype::Bf16, 1, 1), Target::default(), GIB).unwrap();
        assert_eq!(plan.request_bytes(100), Ok(7_372_800));
        assert_eq!(plan.request_bytes(8192), Ok(306_708_480));
    }

    fn gpt_oss_like() -> ModelGeometry {
        let mut m = gqa(36, 8, 64);
        for (i, l) in m.layers.iter_mut().enumerate() {
            if i % 2 == 0 {
                *l = LayerKind::Sliding { window: 128 };
            }
        }
        m
    }

    #[test]
    fn split_holds_the_same_requests_in_every_space_at_context_len() {
        // 18 full + 18 sliding layers of 2,048 B/token each: primary 36,864 B/token,
        // sliding_128 36,864 B/token. At 8,192 tokens (page 1) a request holds 8,192 primary
        // pages and 128 sliding pages; the sliding space keeps 8,192 - 128 = 8,064 pages of
        // headroom (one chunk of 8,192 tokens, at most the unwindowed rest).
        let m = gpt_oss_like();
        let budget = 10 * GIB;
        let plan = Plan::new(&m, &cfg(KvDtype::Bf16, 1, 1), Target::default(), budget).unwrap();
        assert_eq!(plan.layout.spaces.len(), 2);
        assert_eq!(plan.headroom, vec![0, 8_064]);
        // N = (budget - a) / b with a = (0 + 1) * 36,864 + (8,064 + 1) * 36,864, b = (8,192 + 128) * 36,864
        let a = 36_864 + 8_065 * 36_864;
        let n = (budget - a) / (8_320 * 36_864);
        assert_eq!(n, 34);
        assert_eq!(plan.pages[1], n * 128 + 8_064);
        assert_eq!(plan.requests_fit(8192), Ok(n));
        assert!(plan.pages[0] >= n * 8192);
        assert!(plan.total_bytes() <= budget);
        // one more page in the first space would not fit
        let mut more = plan.pages.clone();
        more[0] += 1;
        assert!(plan.layout.total_bytes(&more) > budget);
        assert!(plan.requests_fit(8192).unwrap() * plan.request_bytes(8192).unwrap() <= budget);
    }

    #[test]
    fn linear_state_is_a_slot_pool_inside_the_budget() {
        let mut m = gqa(4, 2, 64);
        m.layers[0] = LayerKind::Linear;
        m.layers[1] = LayerKind::Linear;
        m.linear_state = Some(LinearState { conv_dim: 10, conv_width: 3, conv_elem: ElemDtype::Bf16, ssm_heads: 2, ssm_k: 4, ssm_v: 4, ssm_elem: ElemDtype::F32 });
        let plan = Plan::new(&m, &cfg(KvDtype::Bf16, 16, 1), Target::default(), GIB).unwrap();
        assert_eq!(plan.layout.spaces[1].name, "linear_state");
        // per slot: 2 layers x (10 x 3 x 2 + 2 x 4 x 4 x 4) = 2 x (60 + 128) = 376 bytes
        assert_eq!(plan.layout.space_row_bytes(1), 376);
        let slots = plan.num_state_slots();
        assert_eq!(plan.requests_fit(8192), Ok(slots));
        assert_eq!(plan.request_bytes(8192), Ok(8192 * 2 * 2 * 64 * 2 * 2 + 376));
        assert_eq!(plan.total_bytes(), plan.layout.buffers.iter().map(|b| plan.rows(b.space) * b.row_bytes() + b.fixed_bytes()).sum::<u64>());
        // tiny budget: not one request of 8k fits
        assert!(matches!(Plan::new(&m, &cfg(KvDtype::Bf16, 16, 1), Target::default(), 1 << 20), Err(SizingError::TooSmallForRequest { .. })));
    }

    #[test]
    fn int32_cap_bounds_every_space() {
        // 1 layer, 1 KV head of 16 values in fp4: 8 + 1 bytes per token; 64 GiB asks for ~7.6e9 tokens
        let m = gqa(1, 1, 16);
        let plan = Plan::new(&m, &cfg(KvDtype::Fp4MxBlock16, 1, 1), Target::default(), 64 * GIB).unwrap();
        assert_eq!(plan.num_pages(), (1 << 31) - 1);
        assert_eq!(plan.capped_by_int32, vec![true]);
        let plan = Plan::new(&m, &cfg(KvDtype::Fp4MxBlock16, 64, 1), Target::default(), 64 * GIB).unwrap();
        assert_eq!((plan.num_pages() + 1) * 64 - 1, (1 << 31) - 1);
    }

    #[test]
    fn shared_layers_own_nothing_and_draft_shares_primary_pages() {
        let mut m = gqa(4, 2, 64);
        m.layers[3] = LayerKind::Shared { source: 1 };
        m.draft = Some(Box::new(gqa(1, 4, 128)));
        let l = Layout::new(&m, &cfg(KvDtype::Bf16, 1, 1)).unwrap();
        let names: Vec<&str> = l.groups.iter().map(|g| g.name.as_str()).collect();
        assert_eq!(names, ["full", "shared", "draft"]);
        assert_eq!(l.spaces.len(), 1);
        // 3 target layers x 2 x 2 heads x 64 x 2 B + draft 2 x 4 x 128 x 2 B = 1,536 + 2,048
        assert_eq!(l.bytes_per_token(), 3_584);
        assert!(l.buffers.iter().any(|b| b.name == "draft.layers.0.k"));
        m.layers[3] = LayerKind::Shared { source: 3 };
        assert!(matches!(Layout::new(&m, &cfg(KvDtype::Bf16, 1, 1)), Err(LayoutError::Model(ModelError::BadSharedSource { layer: 3, .. }))));
    }

    #[test]
    fn one_space_per_window_with_its_own_head_dims() {
        // 2 full layers (head_dim 128), sliding layers of windows 512 and 1,024 (head_dim 64)
        let mut m = gqa(4, 2, 128);
        m.layers[1] = LayerKind::Sliding { window: 1024 };
        m.layers[2] = LayerKind::Sliding { window: 512 };
        m.sliding_head_dim = Some(64);
        m.sliding_v_head_dim = Some(64);
        let plan = Plan::new(&m, &cfg(KvDtype::Bf16, 16, 1), Target::default(), GIB).unwrap();
        let names: Vec<&str> = plan.layout.spaces.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["primary", "sliding_512", "sliding_1024"]);
        // full: 2 layers x 2 x 2 heads x 128 x 2 B = 2,048; each sliding layer 2 x 2 x 64 x 2 = 512
        assert_eq!(plan.layout.space_row_bytes(0), 2_048);
        assert_eq!((plan.layout.space_row_bytes(1), plan.layout.space_row_bytes(2)), (512, 512));
        // 8k requests: 512 / 16 + 1 = 33 and 1,024 / 16 + 1 = 65 pages; headroom 512 - 33, 512 - 65
        let n = plan.requests_fit(8192).unwrap();
        assert_eq!(plan.headroom, vec![0, 479, 447]);
        assert_eq!((plan.pages[1], plan.pages[2]), (33 * n + 479, 65 * n + 447));
        assert_eq!(plan.request_bytes(8192), Ok(8192 * 2_048 + (33 + 65) * 16 * 512));
    }
}
