//! Attention geometry of a model: its layers and their kinds, KV heads, head dims, TP sharding.
//!
//! Config parsing (Hugging Face `config.json`, GGUF metadata) lives in Python
//! (`kvpool.config`); it hands this room the numbers, and this room checks them.

use crate::dtype::ElemDtype;

/// Errors of the `model` room.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ModelError {
    /// A field that must be positive is zero.
    #[error("`{field}` must be positive, got 0")]
    Zero { field: &'static str },
    /// A number far beyond any real model (guards the byte arithmetic against overflow).
    #[error("`{field}` = {value} exceeds {limit}; no real model is that large")]
    TooLarge { field: &'static str, value: u64, limit: u64 },
    #[error("layer {layer}: unknown layer kind `{name}`; expected full, sliding, linear or shared")]
    UnknownLayerKind { name: String, layer: usize },
    /// A shared-KV layer whose source is missing, out of range, itself shared or stores no KV.
    #[error("`num_kv_shared_layers`: layer {layer} reuses the KV of layer {source_layer}, {why}")]
    BadSharedSource { layer: usize, source_layer: usize, why: &'static str },
    /// A shared-KV layer without a source layer.
    #[error("`num_kv_shared_layers`: layer {layer} is a shared-KV layer but no source layer is given for it (`kv_shared_sources`)")]
    MissingSharedSource { layer: usize },
    /// Linear-attention layers without a state geometry (or one without linear layers).
    #[error("`{field}`: {why}")]
    Inconsistent { field: &'static str, why: String },
    /// A draft model's layer that is not plain attention.
    #[error("draft model layer {layer} is `{kind}`; a draft's layers are full or sliding attention (stored for every token)")]
    DraftLayerKind { layer: usize, kind: &'static str },
    /// The model has no layer that owns KV pages.
    #[error("the model has no attention layer that stores KV (all {num_layers} layers are linear-attention)")]
    NoKvLayers { num_layers: usize },
    /// tp_size and KV heads where neither divides the other.
    #[error("tp_size `{tp_size}` does not fit `num_key_value_heads` = {num_kv_heads}: one must divide the other (KV heads per rank = max(1, {num_kv_heads} // {tp_size}))")]
    TpMismatch { tp_size: u64, num_kv_heads: u64 },
    /// Query heads that do not group evenly over the KV heads.
    #[error("`num_attention_heads` = {num_attention_heads} is not a multiple of `num_key_value_heads` = {num_kv_heads}: grouped-query attention shares each KV head among the same number of query heads")]
    GroupMismatch { num_attention_heads: u64, num_kv_heads: u64 },
    /// tp_size that does not split the query heads.
    #[error("tp_size `{tp_size}` does not divide `num_attention_heads` = {num_attention_heads}: every rank needs whole query heads")]
    TpQueryMismatch { tp_size: u64, num_attention_heads: u64 },
}

/// What one layer stores.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerKind {
    /// Full attention: every token of the request.
    Full,
    /// Sliding-window attention over the last `window` tokens (first version: stored like a full
    /// layer, the window applied in attention).
    Sliding { window: u64 },
    /// Linear attention / state-space layer: per-request state, no token pages.
    Linear,
    /// A layer that reads the KV of layer `source` (Gemma-3n `num_kv_shared_layers`); owns no bytes.
    Shared { source: usize },
}

impl LayerKind {
    /// Parses `full`, `sliding` (needs a positive `window`), `linear` or `shared` (needs `source`).
    ///
    /// # Errors
    /// [`ModelError::UnknownLayerKind`], [`ModelError::Zero`] for a sliding layer without a
    /// window, [`ModelError::MissingSharedSource`] for a shared layer without a source.
    pub fn from_name(name: &str, window: Option<u64>, source: Option<usize>, layer: usize) -> Result<Self, ModelError> {
        match (name, window) {
            ("full", _) => Ok(Self::Full),
            ("linear", _) => Ok(Self::Linear),
            ("sliding", Some(w)) if w > 0 => Ok(Self::Sliding { window: w }),
            ("sliding", _) => Err(ModelError::Zero { field: "sliding_window" }),
            ("shared", _) => source.map(|s| Self::Shared { source: s }).ok_or(ModelError::MissingSharedSource { layer }),
            _ => Err(ModelError::UnknownLayerKind { name: name.to_owned(), layer }),
        }
    }

    /// Whether the layer owns token pages in the pool (linear layers own state slots, shared
    /// layers read another layer's pages).
    pub const fn stores_kv(self) -> bool {
        matches!(self, Self::Full | Self::Sliding { .. })
    }

    /// The kind's name (`full`, `sliding`, `linear`, `shared`).
    pub const fn name(self) -> &'static str {
        match self {
            Self::Full => "full",
            Self::Sliding { .. } => "sliding",
            Self::Linear => "linear",
            Self::Shared { .. } => "shared",
        }
    }
}

/// Multi-head latent attention (DeepSeek-V2/V3): one latent of `kv_lora_rank + qk_rope_head_dim`
/// values per token per layer, no separate V, not split by tensor parallelism.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mla {
    pub kv_lora_rank: u64,
    pub qk_rope_head_dim: u64,
}

/// Per-request state of one linear-attention layer (gated delta net, Mamba-2) on one rank
/// (already sharded by the caller), as the pool allocates it: a conv state
/// `[conv_dim, conv_width]` in `conv_elem` (the last `conv_kernel - 1` inputs of the causal conv)
/// and a recurrent state `[ssm_heads, ssm_k, ssm_v]` in `ssm_elem`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinearState {
    pub conv_dim: u64,
    pub conv_width: u64,
    pub conv_elem: ElemDtype,
    pub ssm_heads: u64,
    pub ssm_k: u64,
    pub ssm_v: u64,
    pub ssm_elem: ElemDtype,
}

impl LinearState {
    /// A state known only by its byte counts: one row of `conv_bytes` and one of `ssm_bytes` bytes.
    pub const fn from_bytes(conv_bytes: u64, ssm_bytes: u64) -> Self {
        Self { conv_dim: 1, conv_width: conv_bytes, conv_elem: ElemDtype::U8, ssm_heads: 1, ssm_k: 1, ssm_v: ssm_bytes, ssm_elem: ElemDtype::U8 }
    }
    /// Bytes of one slot's conv state.
    pub const fn conv_bytes(&self) -> u64 {
        self.conv_dim * self.conv_width * self.conv_elem.bytes()
    }
    /// Bytes of one slot's recurrent (SSM) state.
    pub const fn ssm_bytes(&self) -> u64 {
        self.ssm_heads * self.ssm_k * self.ssm_v * self.ssm_elem.bytes()
    }
}

/// Attention geometry (global, before TP sharding).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelGeometry {
    pub layers: Vec<LayerKind>,
    pub num_attention_heads: u64,
    pub num_kv_heads: u64,
    pub head_dim: u64,
    pub v_head_dim: u64,
    /// Head dims of the sliding layers when they differ (GGUF `key_length_swa`/`value_length_swa`).
    pub sliding_head_dim: Option<u64>,
    pub sliding_v_head_dim: Option<u64>,
    pub mla: Option<Mla>,
    /// Per layer, per rank (already sharded by the caller); required when a layer is linear.
    pub linear_state: Option<LinearState>,
    /// The draft model of speculative decoding (MTP layers or an EAGLE-style model), sized with
    /// its own geometry in the target's primary page space.
    pub draft: Option<Box<ModelGeometry>>,
}

impl ModelGeometry {
    /// Checks the numbers that sizing relies on.
    ///
    /// # Errors
    /// [`ModelError::Zero`] for a zero head count or head dim, [`ModelError::GroupMismatch`] when
    /// the query heads do not group evenly over the KV heads, [`ModelError::NoKvLayers`] when no
    /// layer stores KV.
    pub fn validate(&self) -> Result<(), ModelError> {
        if self.layers.is_empty() {
            return Err(ModelError::Zero { field: "num_hidden_layers" });
        }
        const MAX_LAYERS: u64 = 1 << 16;
        const MAX_DIM: u64 = 1 << 20;
        let n = self.layers.len() as u64;
        if n > MAX_LAYERS {
            return Err(ModelError::TooLarge { field: "num_hidden_layers", value: n, limit: MAX_LAYERS });
        }
        let mla = self.mla.unwrap_or(Mla { kv_lora_rank: 0, qk_rope_head_dim: 0 });
        for (field, v) in [
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
            ("v_head_dim", self.v_head_dim),
            ("kv_lora_rank", mla.kv_lora_rank),
            ("qk_rope_head_dim", mla.qk_rope_head_dim),
        ] {
            if v > MAX_DIM {
                return Err(ModelError::TooLarge { field, value: v, limit: MAX_DIM });
            }
        }
        if self.mla.is_none() {
            for (field, v) in [
                ("num_attention_heads", self.num_attention_heads),
                ("num_key_value_heads", self.num_kv_heads),
                ("head_dim", self.head_dim),
                ("v_head_dim", self.v_head_dim),
            ] {
                if v == 0 {
                    return Err(ModelError::Zero { field });
                }
            }
            if self.num_attention_heads % self.num_kv_heads != 0 {
                return Err(ModelError::GroupMismatch {
                    num_attention_heads: self.num_attention_heads,
                    num_kv_heads: self.num_kv_heads,
                });
            }
        } else if let Some(m) = self.mla {
            if m.kv_lora_rank == 0 {
                return Err(ModelError::Zero { field: "kv_lora_rank" });
            }
        }
        if !self.layers.iter().any(|l| l.stores_kv()) {
            return Err(ModelError::NoKvLayers { num_layers: self.layers.len() });
        }
        for (field, v) in [("sliding_head_dim", self.sliding_head_dim), ("sliding_v_head_dim", self.sliding_v_head_dim)] {
            match v {
                Some(0) => return Err(ModelError::Zero { field }),
                Some(d) if d > MAX_DIM => return Err(ModelError::TooLarge { field, value: d, limit: MAX_DIM }),
                _ => {}
            }
        }
        for (layer, kind) in self.layers.iter().enumerate() {
            if let LayerKind::Shared { source } = *kind {
                let why = match self.layers.get(source) {
                    None => Some("which does not exist"),
                    Some(LayerKind::Shared { .. }) => Some("which itself reuses another layer's KV"),
                    Some(LayerKind::Linear) => Some("a linear-attention layer that stores no KV"),
                    Some(_) if source == layer => Some("itself"),
                    Some(_) => None,
                };
                if let Some(why) = why {
                    return Err(ModelError::BadSharedSource { layer, source_layer: source, why });
                }
            }
        }
        let has_linear = self.layers.contains(&LayerKind::Linear);
        match (has_linear, self.linear_state) {
            (true, None) => {
                return Err(ModelError::Inconsistent {
                    field: "linear_state",
                    why: "the model has linear-attention layers but no state geometry (conv and SSM state shapes)".into(),
                })
            }
            (true, Some(st)) => {
                const MAX_STATE: u128 = 1 << 40;
                for (field, v) in [
                    ("linear_conv_dim", st.conv_dim),
                    ("linear_conv_kernel_dim", st.conv_width),
                    ("linear_num_value_heads", st.ssm_heads),
                    ("linear_key_head_dim", st.ssm_k),
                    ("linear_value_head_dim", st.ssm_v),
                ] {
                    if v == 0 {
                        return Err(ModelError::Zero { field });
                    }
                }
                let conv = u128::from(st.conv_dim) * u128::from(st.conv_width) * u128::from(st.conv_elem.bytes());
                let ssm = u128::from(st.ssm_heads) * u128::from(st.ssm_k) * u128::from(st.ssm_v) * u128::from(st.ssm_elem.bytes());
                for (field, v) in [("linear conv state bytes", conv), ("linear ssm state bytes", ssm)] {
                    if v > MAX_STATE {
                        return Err(ModelError::TooLarge { field, value: u64::try_from(v).unwrap_or(u64::MAX), limit: 1 << 40 });
                    }
                }
            }
            (false, Some(_)) => {
                return Err(ModelError::Inconsistent {
                    field: "linear_state",
                    why: "a linear-attention state geometry is given but no layer is linear".into(),
                })
            }
            _ => {}
        }
        if let Some(d) = &self.draft {
            if d.draft.is_some() {
                return Err(ModelError::Inconsistent { field: "draft", why: "a draft model cannot have a draft of its own".into() });
            }
            for (layer, kind) in d.layers.iter().enumerate() {
                if !kind.stores_kv() {
                    return Err(ModelError::DraftLayerKind { layer, kind: kind.name() });
                }
            }
            d.validate()?;
        }
        Ok(())
    }

    /// KV heads one TP rank stores: `max(1, num_kv_heads // tp_size)`; ranks beyond the KV head
    /// count hold a replicated head. MLA's single latent is never split.
    ///
    /// # Errors
    /// [`ModelError::Zero`] for `tp_size` 0, [`ModelError::TpQueryMismatch`] when `tp_size` does
    /// not divide the query heads, [`ModelError::TpMismatch`] when neither of `tp_size` and
    /// `num_kv_heads` divides the other.
    pub fn kv_heads_per_rank(&self, tp_size: u64) -> Result<u64, ModelError> {
        if tp_size == 0 {
            return Err(ModelError::Zero { field: "tp_size" });
        }
        // (attention is split by query heads; a fraction of a head per rank is no layout)
        if self.num_attention_heads % tp_size != 0 {
            return Err(ModelError::TpQueryMismatch {
                tp_size,
                num_attention_heads: self.num_attention_heads,
            });
        }
        if self.mla.is_some() {
            return Ok(1);
        }
        let h = self.num_kv_heads;
        let fits = if h >= tp_size { h % tp_size == 0 } else { tp_size % h == 0 };
        if !fits {
            return Err(ModelError::TpMismatch { tp_size, num_kv_heads: h });
        }
        Ok((h / tp_size).max(1))
    }

    /// Per-request linear-attention state summed over layers, per rank: `(conv, ssm)` bytes.
    pub fn linear_state_bytes(&self) -> (u64, u64) {
        let n = self.layers.iter().filter(|l| **l == LayerKind::Linear).count() as u64;
        let st = self.linear_state.map_or((0, 0), |s| (s.conv_bytes(), s.ssm_bytes()));
        (n * st.0, n * st.1)
    }

    /// Values per token per KV head stored for K and for V (`(k, v)`) by full layers; MLA stores
    /// one latent as "K" and nothing as V.
    pub fn stored_dims(&self) -> (u64, u64) {
        match self.mla {
            Some(m) => (m.kv_lora_rank + m.qk_rope_head_dim, 0),
            None => (self.head_dim, self.v_head_dim),
        }
    }

    /// [`ModelGeometry::stored_dims`] of sliding layers: their own head dims when given.
    pub fn sliding_stored_dims(&self) -> (u64, u64) {
        match self.mla {
            Some(_) => self.stored_dims(),
            None => (
                self.sliding_head_dim.unwrap_or(self.head_dim),
                self.sliding_v_head_dim.unwrap_or(self.v_head_dim),
            ),
        }
    }
}
