//! Byte-exact pool layout: every buffer the pool allocates (data, block scales in each layout the
//! kernels read, per-layer scales, the shared FP8 workspace), described once.
//!
//! `sizing` sums this description and `KVPool` (Python) allocates exactly its buffers, so counted
//! and allocated bytes cannot drift apart. Every per-row buffer has `num_tokens + page_size` rows:
//! page 0 ([`PADDING_PAGE`]) is the reserved padding page that masked or padded slots point at;
//! usable pages are `1..=num_pages`, slot = page * page_size + offset.

use std::fmt;
use std::str::FromStr;

use crate::dtype::{ElemDtype, KvDtype, ScaleKind};
use crate::model::{LayerKind, ModelError, ModelGeometry};

/// The reserved padding page: never handed out, its rows absorb padded writes.
pub const PADDING_PAGE: u32 = 0;

/// Largest page size accepted (real engines use 1 to 1,024).
pub const MAX_PAGE_SIZE: u64 = 1 << 20;

/// Errors of the `layout` room.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    #[error("`page_size` must be at least 1, got 0")]
    ZeroPageSize,
    #[error("`page_size` = {page_size} exceeds {MAX_PAGE_SIZE} tokens")]
    PageSizeTooLarge { page_size: u64 },
    #[error("{dtype} needs head dims that are multiples of 16 (one block scale per 16 values); layer {layer} has `{which}` = {dim}")]
    BlockMisaligned { dtype: KvDtype, layer: usize, which: &'static str, dim: u64 },
    #[error("nvfp4 recipe `{recipe}` (page-major scales) needs page_size % 4 == 0 and head_dim % 64 == 0; got page_size = {page_size}, head_dim = {head_dim}")]
    PageMajorShape { recipe: Nvfp4Recipe, page_size: u64, head_dim: u64 },
    #[error("unknown nvfp4 recipe `{name}`; expected one of: linear, page_major, mixed, linear_workspace")]
    UnknownRecipe { name: String },
    #[error("per-layer dtype override for layer `{layer}`, but the model has {num_layers} layers")]
    OverrideOutOfRange { layer: usize, num_layers: usize },
    #[error("layer {layer} is a linear-attention layer and stores no KV; it cannot take a dtype override")]
    OverrideOnLinear { layer: usize },
    #[error(transparent)]
    Model(#[from] ModelError),
}

/// Which scale layouts an nvfp4 pool keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Nvfp4Recipe {
    /// Token-linear block scales `[rows, H, D/16]` (what kvpool's kernels read).
    #[default]
    Linear,
    /// Only the SM100 page-major layout `[rows/page_size, H, page_size, D/16]`.
    PageMajor,
    /// Both layouts plus the shared one-layer FP8 workspace used by FP8 prefill.
    Mixed,
    /// Token-linear scales plus the workspace.
    LinearWorkspace,
}

impl Nvfp4Recipe {
    pub const fn name(self) -> &'static str {
        match self {
            Self::Linear => "linear",
            Self::PageMajor => "page_major",
            Self::Mixed => "mixed",
            Self::LinearWorkspace => "linear_workspace",
        }
    }
    const fn linear(self) -> bool {
        !matches!(self, Self::PageMajor)
    }
    const fn page_major(self) -> bool {
        matches!(self, Self::PageMajor | Self::Mixed)
    }
    const fn workspace(self) -> bool {
        matches!(self, Self::Mixed | Self::LinearWorkspace)
    }
}

impl FromStr for Nvfp4Recipe {
    type Err = LayoutError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s {
            "linear" => Self::Linear,
            "page_major" => Self::PageMajor,
            "mixed" => Self::Mixed,
            "linear_workspace" => Self::LinearWorkspace,
            _ => return Err(LayoutError::UnknownRecipe { name: s.to_owned() }),
        })
    }
}

impl fmt::Display for Nvfp4Recipe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What a pool is asked to be, apart from its token count.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayoutConfig {
    pub dtype: KvDtype,
    /// Per-layer dtype overrides (layer index, dtype).
    pub overrides: Vec<(usize, KvDtype)>,
    /// Dtype for every sliding-window layer (applied before `overrides`).
    pub sliding_dtype: Option<KvDtype>,
    pub page_size: u64,
    pub tp_size: u64,
    pub nvfp4_recipe: Nvfp4Recipe,
}

/// Which tensor a buffer belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tensor {
    K,
    V,
    /// MLA's joint latent (`kv_lora_rank + qk_rope_head_dim` values).
    Latent,
}

impl Tensor {
    pub const fn name(self) -> &'static str {
        match self {
            Self::K => "k",
            Self::V => "v",
            Self::Latent => "kv",
        }
    }
}

/// What a buffer holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Values (`[rows, H, D]`, FP4 packed `[rows, H, D/2]`).
    Data,
    /// Token-linear block scales (nvfp4 `[rows, H, D/16]` e4m3; fp4_mx `[rows, H*D/16]` ue8m0).
    BlockScale,
    /// nvfp4 page-major block scales `[rows/page_size, H, page_size, D/16]` (V with the 4-token
    /// interleave of the SM100 kernels).
    BlockScalePageMajor,
    /// Per-layer fp32 scale: fp8 `k_scale`/`v_scale`, nvfp4 global scale. Shape `[1]`.
    LayerScale,
    /// Shared one-layer FP8 (e4m3) workspace `[rows, H, D]` of the mixed nvfp4 recipe.
    Workspace,
}

impl Role {
    pub const fn name(self) -> &'static str {
        match self {
            Self::Data => "data",
            Self::BlockScale => "block_scale",
            Self::BlockScalePageMajor => "block_scale_page_major",
            Self::LayerScale => "scale",
            Self::Workspace => "workspace",
        }
    }
}

/// A buffer before the token count is known: its bytes are `rows * row_bytes` or `fixed_bytes`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BufferTemplate {
    /// Stable name, e.g. `layers.3.k`, `layers.3.k_block_scale`, `layers.3.k_scale`, `workspace.k`.
    pub name: String,
    pub layer: Option<usize>,
    pub tensor: Tensor,
    pub role: Role,
    pub elem: ElemDtype,
    /// Shape after the row dimension (per-row buffers) or the whole shape (fixed buffers).
    pub inner_shape: Vec<u64>,
    /// Whether the first dimension is rows (`num_tokens + page_size`). Page-major buffers are
    /// per-row too: `[rows / page_size, H, page_size, D/16]`.
    pub per_row: bool,
    pub page_major: bool,
}

impl BufferTemplate {
    /// Bytes one row adds (0 for fixed buffers).
    pub fn row_bytes(&self) -> u64 {
        let elems = self.inner_shape.iter().product::<u64>();
        match (self.per_row, self.page_major) {
            // [H, page_size, D/16] is one page's worth: divide by the page's rows.
            (true, true) => elems / self.inner_shape[1] * self.elem.bytes(),
            (true, false) => elems * self.elem.bytes(),
            (false, _) => 0,
        }
    }

    /// Bytes that do not depend on the row count.
    pub fn fixed_bytes(&self) -> u64 {
        if self.per_row {
            0
        } else {
            self.inner_shape.iter().product::<u64>() * self.elem.bytes()
        }
    }

    /// The full shape for `rows` rows (`rows` a multiple of `page_size`).
    pub fn shape(&self, rows: u64, page_size: u64) -> Vec<u64> {
        if !self.per_row {
            return self.inner_shape.clone();
        }
        if self.page_major {
            // inner_shape = [H, page_size, D/16]
            let mut s = vec![rows / page_size];
            s.extend_from_slice(&self.inner_shape);
            return s;
        }
        let mut s = vec![rows];
        s.extend_from_slice(&self.inner_shape);
        s
    }
}

/// A pool's buffers for a given model and config, independent of its token count.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    pub buffers: Vec<BufferTemplate>,
    /// Dtype of each layer (`None` for layers that store no KV).
    pub layer_dtypes: Vec<Option<KvDtype>>,
    pub kv_heads_per_rank: u64,
    pub page_size: u64,
    pub config: LayoutConfig,
}

impl Layout {
    /// Describes every buffer for `model` under `config`.
    ///
    /// # Errors
    /// [`LayoutError`] for a zero page size, a TP/KV-head mismatch, FP4 head dims that are not
    /// multiples of 16, page-major shapes the SM100 layout cannot hold, bad overrides.
    pub fn new(model: &ModelGeometry, config: &LayoutConfig) -> Result<Self, LayoutError> {
        model.validate()?;
        if config.page_size == 0 {
            return Err(LayoutError::ZeroPageSize);
        }
        if config.page_size > MAX_PAGE_SIZE {
            return Err(LayoutError::PageSizeTooLarge { page_size: config.page_size });
        }
        let heads = model.kv_heads_per_rank(config.tp_size)?;
        let layer_dtypes = resolve_layer_dtypes(model, config)?;
        let (dk, dv) = model.stored_dims();
        let ps = config.page_size;
        let recipe = config.nvfp4_recipe;
        let mut buffers = Vec::new();
        let mut any_workspace = false;
        for (layer, dtype) in layer_dtypes.iter().enumerate() {
            let Some(dtype) = *dtype else { continue };
            let tensors: &[(Tensor, u64)] = if model.mla.is_some() {
                &[(Tensor::Latent, dk)]
            } else {
                &[(Tensor::K, dk), (Tensor::V, dv)]
            };
            for &(t, d) in tensors {
                let which = match t {
                    Tensor::V => "v_head_dim",
                    Tensor::K => "head_dim",
                    Tensor::Latent => "kv_lora_rank + qk_rope_head_dim",
                };
                let name = |suffix: &str| format!("layers.{layer}.{}{suffix}", t.name());
                let tmpl = |suffix: &str, role, elem, inner_shape: Vec<u64>, per_row, page_major| {
                    BufferTemplate {
                        name: name(suffix),
                        layer: Some(layer),
                        tensor: t,
                        role,
                        elem,
                        inner_shape,
                        per_row,
                        page_major,
                    }
                };
                let data_shape = if dtype.bits() == 4 { vec![heads, d / 2] } else { vec![heads, d] };
                buffers.push(tmpl("", Role::Data, dtype.data_elem(), data_shape, true, false));
                if let Some(block) = dtype.block_size() {
                    if d % block != 0 {
                        return Err(LayoutError::BlockMisaligned { dtype, layer, which, dim: d });
                    }
                    let elem = dtype.block_scale_elem().expect("block dtypes have a scale elem");
                    match dtype.scale_kind() {
                        ScaleKind::E4m3BlockAndGlobal => {
                            if recipe.linear() {
                                let s = vec![heads, d / block];
                                buffers.push(tmpl("_block_scale", Role::BlockScale, elem, s, true, false));
                            }
                            if recipe.page_major() {
                                if ps % 4 != 0 || d % 64 != 0 {
                                    return Err(LayoutError::PageMajorShape { recipe, page_size: ps, head_dim: d });
                                }
                                let s = vec![heads, ps, d / block];
                                buffers.push(tmpl("_block_scale_page_major", Role::BlockScalePageMajor, elem, s, true, true));
                            }
                            any_workspace |= recipe.workspace();
                            buffers.push(tmpl("_global_scale", Role::LayerScale, ElemDtype::F32, vec![1], false, false));
                        }
                        ScaleKind::Ue8m0Block => {
                            let s = vec![heads * d / block];
                            buffers.push(tmpl("_block_scale", Role::BlockScale, elem, s, true, false));
                        }
                        ScaleKind::PerTensor | ScaleKind::None => unreachable!("block dtypes"),
                    }
                } else if dtype.scale_kind() == ScaleKind::PerTensor {
                    buffers.push(tmpl("_scale", Role::LayerScale, ElemDtype::F32, vec![1], false, false));
                }
            }
        }
        if any_workspace {
            let tensors: &[(Tensor, u64)] = if model.mla.is_some() {
                &[(Tensor::Latent, dk)]
            } else {
                &[(Tensor::K, dk), (Tensor::V, dv)]
            };
            for &(t, d) in tensors {
                buffers.push(BufferTemplate {
                    name: format!("workspace.{}", t.name()),
                    layer: None,
                    tensor: t,
                    role: Role::Workspace,
                    elem: ElemDtype::F8E4m3,
                    inner_shape: vec![heads, d],
                    per_row: true,
                    page_major: false,
                });
            }
        }
        Ok(Self { buffers, layer_dtypes, kv_heads_per_rank: heads, page_size: ps, config: config.clone() })
    }

    /// Bytes each row (token slot) costs across all buffers.
    pub fn bytes_per_token(&self) -> u64 {
        self.buffers.iter().map(BufferTemplate::row_bytes).sum()
    }

    /// Bytes that do not grow with the pool (per-layer fp32 scales).
    pub fn fixed_bytes(&self) -> u64 {
        self.buffers.iter().map(BufferTemplate::fixed_bytes).sum()
    }

    /// Rows a pool of `num_tokens` usable tokens allocates: the padding page included.
    /// `num_tokens` is at most [`crate::sizing::MAX_TOKENS`] (callers check), so this cannot overflow.
    pub const fn rows(&self, num_tokens: u64) -> u64 {
        num_tokens + self.page_size
    }

    /// Every byte a pool of `num_tokens` usable tokens allocates; `None` past `u64::MAX`.
    pub fn checked_total_bytes(&self, num_tokens: u64) -> Option<u64> {
        self.rows(num_tokens).checked_mul(self.bytes_per_token())?.checked_add(self.fixed_bytes())
    }

    /// [`Layout::checked_total_bytes`] saturating at `u64::MAX` (for comparisons against a budget).
    pub fn total_bytes(&self, num_tokens: u64) -> u64 {
        self.checked_total_bytes(num_tokens).unwrap_or(u64::MAX)
    }

    /// Per-row bytes of one layer's own buffers (the shared workspace not included).
    pub fn layer_bytes_per_token(&self, layer: usize) -> u64 {
        self.buffers.iter().filter(|b| b.layer == Some(layer)).map(BufferTemplate::row_bytes).sum()
    }
}

fn resolve_layer_dtypes(
    model: &ModelGeometry,
    config: &LayoutConfig,
) -> Result<Vec<Option<KvDtype>>, LayoutError> {
    let mut out: Vec<Option<KvDtype>> = model
        .layers
        .iter()
        .map(|k| match k {
            LayerKind::Full => Some(config.dtype),
            LayerKind::Sliding { .. } => Some(config.sliding_dtype.unwrap_or(config.dtype)),
            LayerKind::Linear => None,
        })
        .collect();
    for &(layer, dtype) in &config.overrides {
        match out.get_mut(layer) {
            None => return Err(LayoutError::OverrideOutOfRange { layer, num_layers: model.layers.len() }),
            Some(None) => return Err(LayoutError::OverrideOnLinear { layer }),
            Some(slot) => *slot = Some(dtype),
        }
    }
    Ok(out)
}
