//! Byte-exact pool layout: every buffer the pool allocates (data, block scales in each layout the
//! kernels read, per-layer scales, the shared FP8 workspace), described once.
//!
//! `sizing` sums this description and `KVPool` (Python) allocates exactly its buffers, so counted
//! and allocated bytes cannot drift apart. Every buffer belongs to a layer group and a page space
//! (`groups`); a per-row buffer has `(num_pages + 1) * page_size` rows of its space: page 0
//! ([`PADDING_PAGE`]) is the reserved padding page that masked or padded slots point at; usable
//! pages are `1..=num_pages`, slot = page * page_size + offset. Linear-attention state buffers
//! are per-row in the state space (one row per slot, slot 0 padding).

use std::fmt;
use std::str::FromStr;

use crate::dtype::{ElemDtype, KvDtype, ScaleKind};
use crate::groups::{groups_of, Group, GroupKind, PageSpace};
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
    #[error("layer {layer} reuses the KV of layer {source_layer} (shared KV) and owns no buffers; override layer {source_layer} instead")]
    OverrideOnShared { layer: usize, source_layer: usize },
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
    /// Linear attention's causal-conv state `[slots + 1, conv_dim, conv_kernel - 1]`.
    ConvState,
    /// Linear attention's recurrent state `[slots + 1, num_v_heads, k_head_dim, v_head_dim]`.
    SsmState,
}

impl Tensor {
    pub const fn name(self) -> &'static str {
        match self {
            Self::K => "k",
            Self::V => "v",
            Self::Latent => "kv",
            Self::ConvState => "conv_state",
            Self::SsmState => "ssm_state",
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
    /// One-layer FP8 (e4m3) workspace `[rows, H, D]` of the mixed nvfp4 recipe, one per group.
    Workspace,
    /// Per-request linear-attention state, one row per state slot.
    State,
}

impl Role {
    pub const fn name(self) -> &'static str {
        match self {
            Self::Data => "data",
            Self::BlockScale => "block_scale",
            Self::BlockScalePageMajor => "block_scale_page_major",
            Self::LayerScale => "scale",
            Self::Workspace => "workspace",
            Self::State => "state",
        }
    }
}

/// A buffer before the page counts are known: its bytes are `rows * row_bytes` or `fixed_bytes`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BufferTemplate {
    /// Stable name, e.g. `layers.3.k`, `layers.3.k_block_scale`, `layers.3.k_scale`,
    /// `workspace.k`, `draft.layers.0.kv`, `layers.0.conv_state`.
    pub name: String,
    /// Layer index (of the draft model for draft buffers); `None` for workspaces.
    pub layer: Option<usize>,
    pub tensor: Tensor,
    pub role: Role,
    pub elem: ElemDtype,
    /// Shape after the row dimension (per-row buffers) or the whole shape (fixed buffers).
    pub inner_shape: Vec<u64>,
    /// Whether the first dimension is rows of its page space. Page-major buffers are per-row
    /// too: `[rows / page_size, H, page_size, D/16]`.
    pub per_row: bool,
    pub page_major: bool,
    /// Index into [`Layout::groups`].
    pub group: usize,
    /// Index into [`Layout::spaces`]: whose rows this buffer has.
    pub space: usize,
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

/// The attention geometry one group's layers store (per rank).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct GroupGeometry {
    pub kv_heads: u64,
    /// Values per token per head stored as K (MLA: the latent) and as V (0 for MLA and state).
    pub head_dim: u64,
    pub v_head_dim: u64,
    pub mla: bool,
}

/// A pool's buffers for a given model and config, independent of its page counts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    pub buffers: Vec<BufferTemplate>,
    pub groups: Vec<Group>,
    /// Per group, what its layers store (zeros for linear-state and shared groups).
    pub group_geometry: Vec<GroupGeometry>,
    pub spaces: Vec<PageSpace>,
    /// Dtype of each target layer (`None` for layers that store no KV: linear and shared).
    pub layer_dtypes: Vec<Option<KvDtype>>,
    /// Source layer of each shared-KV layer (`None` elsewhere).
    pub shared_sources: Vec<Option<usize>>,
    pub kv_heads_per_rank: u64,
    pub page_size: u64,
    pub config: LayoutConfig,
}

/// Appends one attention layer's buffers (data, block scales, per-layer scales).
struct AttnLayer<'a> {
    prefix: String,
    layer: usize,
    dtype: KvDtype,
    geo: GroupGeometry,
    group: usize,
    space: usize,
    config: &'a LayoutConfig,
}

impl AttnLayer<'_> {
    /// Pushes the buffers; returns whether the group needs a workspace.
    fn push(&self, buffers: &mut Vec<BufferTemplate>) -> Result<bool, LayoutError> {
        let (dtype, layer, heads) = (self.dtype, self.layer, self.geo.kv_heads);
        let ps = self.config.page_size;
        let recipe = self.config.nvfp4_recipe;
        let tensors: &[(Tensor, u64)] = if self.geo.mla {
            &[(Tensor::Latent, self.geo.head_dim)]
        } else {
            &[(Tensor::K, self.geo.head_dim), (Tensor::V, self.geo.v_head_dim)]
        };
        let mut workspace = false;
        for &(t, d) in tensors {
            let which = match t {
                Tensor::V => "v_head_dim",
                Tensor::Latent => "kv_lora_rank + qk_rope_head_dim",
                _ => "head_dim",
            };
            let tmpl = |suffix: &str, role, elem, inner_shape: Vec<u64>, per_row, page_major| BufferTemplate {
                name: format!("{}.{}{suffix}", self.prefix, t.name()),
                layer: Some(layer),
                tensor: t,
                role,
                elem,
                inner_shape,
                per_row,
                page_major,
                group: self.group,
                space: self.space,
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
                        workspace |= recipe.workspace();
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
        Ok(workspace)
    }
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
        let (groups, spaces) = groups_of(model, config.page_size);
        let group_of = |kind: GroupKind| groups.iter().position(|g| g.kind == kind).expect("every kind present has a group");
        let space_of = |g: usize| groups[g].space.expect("groups with buffers have a space");
        let (dk, dv) = model.stored_dims();
        let (sk, sv) = model.sliding_stored_dims();
        let mla = model.mla.is_some();
        let mut group_geometry = vec![GroupGeometry::default(); groups.len()];
        let mut buffers = Vec::new();
        let mut workspaces: Vec<usize> = Vec::new();
        for (layer, kind) in model.layers.iter().enumerate() {
            let (group, geo) = match *kind {
                LayerKind::Full => {
                    let g = group_of(if mla { GroupKind::Mla } else { GroupKind::Full });
                    (g, GroupGeometry { kv_heads: heads, head_dim: dk, v_head_dim: dv, mla })
                }
                LayerKind::Sliding { window } => {
                    (group_of(GroupKind::Sliding { window }), GroupGeometry { kv_heads: heads, head_dim: sk, v_head_dim: sv, mla })
                }
                LayerKind::Linear => {
                    let g = group_of(GroupKind::LinearState);
                    push_state(&mut buffers, model, layer, g, space_of(g));
                    continue;
                }
                LayerKind::Shared { .. } => continue,
            };
            group_geometry[group] = geo;
            let dtype = layer_dtypes[layer].expect("attention layers have a dtype");
            let l = AttnLayer { prefix: format!("layers.{layer}"), layer, dtype, geo, group, space: space_of(group), config };
            if l.push(&mut buffers)? && !workspaces.contains(&group) {
                workspaces.push(group);
            }
        }
        if let Some(draft) = &model.draft {
            let g = group_of(GroupKind::Draft);
            let dh = draft.kv_heads_per_rank(config.tp_size)?;
            let (ddk, ddv) = draft.stored_dims();
            let geo = GroupGeometry { kv_heads: dh, head_dim: ddk, v_head_dim: ddv, mla: draft.mla.is_some() };
            group_geometry[g] = geo;
            for layer in 0..draft.layers.len() {
                // (the draft's KV dtype is the target's; its sliding layers, if any, are stored
                // for every token of the primary space)
                let l = AttnLayer { prefix: format!("draft.layers.{layer}"), layer, dtype: config.dtype, geo, group: g, space: space_of(g), config };
                if l.push(&mut buffers)? && !workspaces.contains(&g) {
                    workspaces.push(g);
                }
            }
        }
        for g in workspaces {
            let geo = group_geometry[g];
            let tensors: &[(Tensor, u64)] = if geo.mla {
                &[(Tensor::Latent, geo.head_dim)]
            } else {
                &[(Tensor::K, geo.head_dim), (Tensor::V, geo.v_head_dim)]
            };
            // (the primary group's workspace keeps its old name, `workspace.k`)
            let prefix = match groups[g].kind {
                GroupKind::Full | GroupKind::Mla => "workspace".to_owned(),
                _ => format!("workspace.{}", groups[g].name),
            };
            for &(t, d) in tensors {
                buffers.push(BufferTemplate {
                    name: format!("{prefix}.{}", t.name()),
                    layer: None,
                    tensor: t,
                    role: Role::Workspace,
                    elem: ElemDtype::F8E4m3,
                    inner_shape: vec![geo.kv_heads, d],
                    per_row: true,
                    page_major: false,
                    group: g,
                    space: space_of(g),
                });
            }
        }
        let shared_sources = model.layers.iter().map(|k| if let LayerKind::Shared { source } = *k { Some(source) } else { None }).collect();
        Ok(Self {
            buffers,
            groups,
            group_geometry,
            spaces,
            layer_dtypes,
            shared_sources,
            kv_heads_per_rank: heads,
            page_size: config.page_size,
            config: config.clone(),
        })
    }

    /// Bytes one row of space `space` costs across its buffers.
    pub fn space_row_bytes(&self, space: usize) -> u64 {
        self.buffers.iter().filter(|b| b.space == space).map(BufferTemplate::row_bytes).sum()
    }

    /// [`Layout::space_row_bytes`] without workspaces: what a request's page (slot) costs.
    pub fn space_request_row_bytes(&self, space: usize) -> u64 {
        self.buffers.iter().filter(|b| b.space == space && b.role != Role::Workspace).map(BufferTemplate::row_bytes).sum()
    }

    /// Bytes each row of the first page space costs (the only space of a full-attention model).
    pub fn bytes_per_token(&self) -> u64 {
        self.space_row_bytes(0)
    }

    /// Bytes that do not grow with the pool (per-layer fp32 scales).
    pub fn fixed_bytes(&self) -> u64 {
        self.buffers.iter().map(BufferTemplate::fixed_bytes).sum()
    }

    /// Rows space `space` allocates for `pages` usable pages: the padding page included.
    /// `pages` is capped below 2^31 rows by the plan, so this cannot overflow.
    pub fn rows(&self, space: usize, pages: u64) -> u64 {
        (pages + 1) * self.spaces[space].page_size
    }

    /// Every byte a pool with `pages[s]` usable pages in space `s` allocates; `None` past `u64::MAX`.
    pub fn checked_total_bytes(&self, pages: &[u64]) -> Option<u64> {
        let mut total = self.fixed_bytes();
        for (s, &p) in pages.iter().enumerate() {
            let rows = p.checked_add(1)?.checked_mul(self.spaces[s].page_size)?;
            total = total.checked_add(rows.checked_mul(self.space_row_bytes(s))?)?;
        }
        Some(total)
    }

    /// [`Layout::checked_total_bytes`] saturating at `u64::MAX` (for comparisons against a budget).
    pub fn total_bytes(&self, pages: &[u64]) -> u64 {
        self.checked_total_bytes(pages).unwrap_or(u64::MAX)
    }

    /// Bytes of group `group` for `pages` per space (rows and fixed scales).
    pub fn group_bytes(&self, group: usize, pages: &[u64]) -> u64 {
        self.buffers
            .iter()
            .filter(|b| b.group == group)
            .map(|b| self.rows(b.space, pages[b.space]) * b.row_bytes() + b.fixed_bytes())
            .sum()
    }

    /// Row bytes of group `group` (per token, or per state slot).
    pub fn group_row_bytes(&self, group: usize) -> u64 {
        self.buffers.iter().filter(|b| b.group == group).map(BufferTemplate::row_bytes).sum()
    }
}

/// One linear-attention layer's state buffers (rows = state slots + 1).
fn push_state(buffers: &mut Vec<BufferTemplate>, model: &ModelGeometry, layer: usize, group: usize, space: usize) {
    let st = model.linear_state.expect("validated: linear layers have a state geometry");
    for (t, elem, inner) in [
        (Tensor::ConvState, st.conv_elem, vec![st.conv_dim, st.conv_width]),
        (Tensor::SsmState, st.ssm_elem, vec![st.ssm_heads, st.ssm_k, st.ssm_v]),
    ] {
        buffers.push(BufferTemplate {
            name: format!("layers.{layer}.{}", t.name()),
            layer: Some(layer),
            tensor: t,
            role: Role::State,
            elem,
            inner_shape: inner,
            per_row: true,
            page_major: false,
            group,
            space,
        });
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
            LayerKind::Linear | LayerKind::Shared { .. } => None,
        })
        .collect();
    for &(layer, dtype) in &config.overrides {
        if let Some(LayerKind::Shared { source }) = model.layers.get(layer) {
            return Err(LayoutError::OverrideOnShared { layer, source_layer: *source });
        }
        match out.get_mut(layer) {
            None => return Err(LayoutError::OverrideOutOfRange { layer, num_layers: model.layers.len() }),
            Some(None) => return Err(LayoutError::OverrideOnLinear { layer }),
            Some(slot) => *slot = Some(dtype),
        }
    }
    Ok(out)
}
