//! Attention geometry of a model: its layers and their kinds, KV heads, head dims, TP sharding.
//!
//! Config parsing (Hugging Face `config.json`, GGUF metadata) lives in Python
//! (`kvpool.config`); it hands this room the numbers, and this room checks them.

/// Errors of the `model` room.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ModelError {
    /// A field that must be positive is zero.
    #[error("`{field}` must be positive, got 0")]
    Zero { field: &'static str },
    /// A number far beyond any real model (guards the byte arithmetic against overflow).
    #[error("`{field}` = {value} exceeds {limit}; no real model is that large")]
    TooLarge { field: &'static str, value: u64, limit: u64 },
    #[error("layer {layer}: unknown layer kind `{name}`; expected full, sliding or linear")]
    UnknownLayerKind { name: String, layer: usize },
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
}

impl LayerKind {
    /// Parses `full`, `sliding` (needs a positive `window`) or `linear`.
    ///
    /// # Errors
    /// [`ModelError::UnknownLayerKind`], or [`ModelError::Zero`] for a sliding layer without a window.
    pub fn from_name(name: &str, window: Option<u64>, layer: usize) -> Result<Self, ModelError> {
        match (name, window) {
            ("full", _) => Ok(Self::Full),
            ("linear", _) => Ok(Self::Linear),
            ("sliding", Some(w)) if w > 0 => Ok(Self::Sliding { window: w }),
            ("sliding", _) => Err(ModelError::Zero { field: "sliding_window" }),
            _ => Err(ModelError::UnknownLayerKind { name: name.to_owned(), layer }),
        }
    }

    /// Whether the layer owns token pages in the pool.
    pub const fn stores_kv(self) -> bool {
        !matches!(self, Self::Linear)
    }
}

/// Multi-head latent attention (DeepSeek-V2/V3): one latent of `kv_lora_rank + qk_rope_head_dim`
/// values per token per layer, no separate V, not split by tensor parallelism.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mla {
    pub kv_lora_rank: u64,
    pub qk_rope_head_dim: u64,
}

/// Per-request state of linear-attention layers (gated delta net, Mamba-2), in bytes per layer
/// per rank. Reported beside a plan; the pool does not allocate it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LinearState {
    pub conv_bytes: u64,
    pub ssm_bytes: u64,
}

/// Attention geometry (global, before TP sharding).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelGeometry {
    pub layers: Vec<LayerKind>,
    pub num_attention_heads: u64,
    pub num_kv_heads: u64,
    pub head_dim: u64,
    pub v_head_dim: u64,
    pub mla: Option<Mla>,
    /// Per layer, per rank (already sharded by the caller).
    pub linear_state: LinearState,
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
        (n * self.linear_state.conv_bytes, n * self.linear_state.ssm_bytes)
    }

    /// Values per token per KV head stored for K and for V (`(k, v)`); MLA stores one latent as
    /// "K" and nothing as V.
    pub fn stored_dims(&self) -> (u64, u64) {
        match self.mla {
            Some(m) => (m.kv_lora_rank + m.qk_rope_head_dim, 0),
            None => (self.head_dim, self.v_head_dim),
        }
    }
}
