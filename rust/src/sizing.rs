//! `size_for`: a memory budget -> the largest page-aligned token capacity whose whole layout fits.
//!
//! The budget follows SGLang's `profile_max_num_token`, so numbers agree with its logs:
//! `rest = available_memory - total_memory * (1 - mem_frac)`, with `total_memory` the free device
//! memory before the weights were loaded and `available_memory` the free memory after.

use crate::layout::{Layout, LayoutConfig, LayoutError, Role, Tensor};
use crate::model::{LayerKind, ModelGeometry};

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

/// The largest `num_tokens`, a multiple of `page_size`, with `layout.total_bytes(num_tokens) <= budget`.
///
/// # Errors
/// [`SizingError::TooSmall`] when not even one usable page fits, naming the missing bytes.
pub fn capacity(layout: &Layout, budget: u64) -> Result<u64, SizingError> {
    let ps = layout.page_size;
    let bpt = layout.bytes_per_token();
    let fixed = layout.fixed_bytes();
    let needed = layout.total_bytes(ps);
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

/// A sized pool: its layout and how many tokens it holds.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    pub layout: Layout,
    pub num_tokens: u64,
    pub budget: u64,
}

impl Plan {
    /// Sizes `model` under `config` to fit in `budget` bytes.
    ///
    /// # Errors
    /// Any [`LayoutError`] of the config, [`SizingError::TooSmall`].
    pub fn new(model: &ModelGeometry, config: &LayoutConfig, budget: u64) -> Result<Self, SizingError> {
        let layout = Layout::new(model, config)?;
        let num_tokens = capacity(&layout, budget)?;
        Ok(Self { layout, num_tokens, budget })
    }

    /// A plan with a caller-chosen token count (rounded up to whole pages), budget = its bytes.
    ///
    /// # Errors
    /// Any [`LayoutError`] of the config.
    pub fn with_tokens(model: &ModelGeometry, config: &LayoutConfig, num_tokens: u64) -> Result<Self, SizingError> {
        let layout = Layout::new(model, config)?;
        let ps = layout.page_size;
        let num_tokens = check_tokens("num_tokens", num_tokens)?.div_ceil(ps) * ps;
        let budget = layout.checked_total_bytes(num_tokens).ok_or(SizingError::TooLarge { num_tokens })?;
        Ok(Self { layout, num_tokens, budget })
    }

    pub const fn num_pages(&self) -> u64 {
        self.num_tokens / self.layout.page_size
    }

    pub fn total_bytes(&self) -> u64 {
        self.layout.total_bytes(self.num_tokens)
    }

    /// Bytes of the buffers that match `pred`, for this plan's row count.
    pub fn bytes_where(&self, pred: impl Fn(Tensor, Role) -> bool) -> u64 {
        let rows = self.layout.rows(self.num_tokens);
        self.layout
            .buffers
            .iter()
            .filter(|b| pred(b.tensor, b.role))
            .map(|b| rows * b.row_bytes() + b.fixed_bytes())
            .sum()
    }

    /// Bytes one request of `n` tokens holds. Full layers hold `ceil(n / page_size)` pages;
    /// sliding-window layers are counted as a windowed pool would hold them: `min(n, window)`
    /// tokens rounded up to whole pages, plus one page when `page_size > 1` (the window's start
    /// rarely falls on a page boundary). The shared workspace is not per request.
    ///
    /// # Errors
    /// [`SizingError::TooManyTokens`] for `n` beyond [`MAX_TOKENS`], [`SizingError::TooLarge`]
    /// when the bytes exceed `u64::MAX`.
    pub fn request_bytes(&self, model: &ModelGeometry, n: u64) -> Result<u64, SizingError> {
        let ps = self.layout.page_size;
        let full_tokens = check_tokens("n", n)?.div_ceil(ps) * ps;
        let mut total: u64 = 0;
        for (i, kind) in model.layers.iter().enumerate() {
            let tokens = match *kind {
                LayerKind::Full => full_tokens,
                LayerKind::Sliding { window } => {
                    let held = n.min(window).div_ceil(ps) * ps + if ps > 1 { ps } else { 0 };
                    held.min(full_tokens)
                }
                LayerKind::Linear => 0,
            };
            total = tokens
                .checked_mul(self.layout.layer_bytes_per_token(i))
                .and_then(|b| total.checked_add(b))
                .ok_or(SizingError::TooLarge { num_tokens: n })?;
        }
        Ok(total)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::KvDtype;
    use crate::layout::Nvfp4Recipe;
    use crate::model::{LinearState, Mla, ModelError};

    const GIB: u64 = 1 << 30;

    fn gqa(layers: usize, kv: u64, d: u64) -> ModelGeometry {
        ModelGeometry {
            layers: vec![LayerKind::Full; layers],
            num_attention_heads: 4 * kv,
            num_kv_heads: kv,
            head_dim: d,
            v_head_dim: d,
            mla: None,
            linear_state: LinearState::default(),
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
            let plan = Plan::new(&m, &cfg(d, 1, 1), 10 * GIB).unwrap();
            assert_eq!(plan.layout.bytes_per_token(), bpt, "{d}");
            assert_eq!(plan.layout.fixed_bytes(), fixed, "{d}");
            assert_eq!(plan.num_tokens, tokens, "{d}");
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
        for budget in [l.total_bytes(16), l.total_bytes(16) + 1, 123_456_789, 10 * GIB] {
            let n = capacity(&l, budget).unwrap();
            assert_eq!(n % 16, 0);
            assert!(l.total_bytes(n) <= budget && l.total_bytes(n + 16) > budget);
        }
        let too_small = l.total_bytes(16) - 1;
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
        let mut m = gqa(36, 8, 64);
        for (i, l) in m.layers.iter_mut().enumerate() {
            if i % 2 == 0 {
                *l = LayerKind::Sliding { window: 128 };
            }
        }
        let plan = Plan::new(&m, &cfg(KvDtype::Bf16, 1, 1), GIB).unwrap();
        assert_eq!(plan.request_bytes(&m, 100), Ok(7_372_800));
        assert_eq!(plan.request_bytes(&m, 8192), Ok(306_708_480));
    }
}
