//! Bindings of `model`, `layout` and `sizing`: geometry in, plan out.

use std::collections::HashMap;

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;

use super::error::to_py;
use crate::dtype::{ElemDtype, KvDtype};
use crate::groups::{SpaceKind, Target};
use crate::layout::{BufferTemplate, LayoutConfig, Nvfp4Recipe, Role, Tensor};
use crate::model::{LayerKind, LinearState, Mla, ModelError, ModelGeometry};
use crate::sizing::{kv_budget, Plan};

/// Attention geometry (global, before TP sharding); built by `kvpool.sizing`/`kvpool.config`.
#[pyclass(name = "ModelGeometry", module = "kvpool._core", frozen)]
#[derive(Clone)]
pub(crate) struct PyModelGeometry(ModelGeometry);

/// A linear-attention state geometry per rank: (conv_dim, conv_kernel - 1, conv dtype,
/// num_v_heads, k_head_dim, v_head_dim, ssm dtype).
type StateShape = (u64, u64, String, u64, u64, u64, String);

fn state_elem(field: &'static str, name: &str) -> PyResult<ElemDtype> {
    match KvDtype::parse(name, "bf16") {
        Ok(d @ (KvDtype::Fp32 | KvDtype::Bf16 | KvDtype::Fp16)) => Ok(d.data_elem()),
        _ => Err(to_py(ModelError::Inconsistent { field, why: format!("state dtype `{name}` is not one of fp32, bf16, fp16") })),
    }
}

#[pymethods]
impl PyModelGeometry {
    #[new]
    #[pyo3(signature = (*, layer_kinds, num_attention_heads, num_kv_heads, head_dim, v_head_dim, sliding_window=None, kv_lora_rank=None, qk_rope_head_dim=None, linear_conv_bytes=0, linear_ssm_bytes=0, layer_windows=None, sliding_head_dim=None, sliding_v_head_dim=None, kv_shared_sources=None, linear_state=None, draft=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        layer_kinds: Vec<String>,
        num_attention_heads: u64,
        num_kv_heads: u64,
        head_dim: u64,
        v_head_dim: u64,
        sliding_window: Option<u64>,
        kv_lora_rank: Option<u64>,
        qk_rope_head_dim: Option<u64>,
        linear_conv_bytes: u64,
        linear_ssm_bytes: u64,
        layer_windows: Option<Vec<Option<u64>>>,
        sliding_head_dim: Option<u64>,
        sliding_v_head_dim: Option<u64>,
        kv_shared_sources: Option<HashMap<usize, usize>>,
        linear_state: Option<StateShape>,
        draft: Option<PyRef<'_, PyModelGeometry>>,
    ) -> PyResult<Self> {
        if let Some(w) = &layer_windows {
            if w.len() != layer_kinds.len() {
                return Err(to_py(ModelError::Inconsistent {
                    field: "sliding_window",
                    why: format!("{} per-layer windows for {} layers", w.len(), layer_kinds.len()),
                }));
            }
        }
        let shared = kv_shared_sources.unwrap_or_default();
        if let Some((&layer, _)) = shared.iter().find(|(l, _)| layer_kinds.get(**l).is_none_or(|k| k != "shared")) {
            return Err(to_py(ModelError::Inconsistent {
                field: "kv_shared_sources",
                why: format!("layer {layer} has a KV source but is not a `shared` layer"),
            }));
        }
        let layers = layer_kinds
            .iter()
            .enumerate()
            .map(|(i, k)| {
                let window = layer_windows.as_ref().map_or(sliding_window, |w| w[i]);
                LayerKind::from_name(k, window, shared.get(&i).copied(), i)
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(to_py)?;
        let mla = kv_lora_rank.map(|r| Mla { kv_lora_rank: r, qk_rope_head_dim: qk_rope_head_dim.unwrap_or(0) });
        let has_linear = layers.contains(&LayerKind::Linear);
        let linear_state = match linear_state {
            Some((conv_dim, conv_width, conv_dtype, ssm_heads, ssm_k, ssm_v, ssm_dtype)) => Some(LinearState {
                conv_dim,
                conv_width,
                conv_elem: state_elem("linear_state", &conv_dtype)?,
                ssm_heads,
                ssm_k,
                ssm_v,
                ssm_elem: state_elem("mamba_ssm_dtype", &ssm_dtype)?,
            }),
            // (byte counts only: the state is stored as raw bytes)
            None if has_linear && linear_conv_bytes + linear_ssm_bytes > 0 => {
                Some(LinearState::from_bytes(linear_conv_bytes, linear_ssm_bytes))
            }
            None => None,
        };
        let g = ModelGeometry {
            layers,
            num_attention_heads,
            num_kv_heads,
            head_dim,
            v_head_dim,
            sliding_head_dim,
            sliding_v_head_dim,
            mla,
            linear_state,
            draft: draft.map(|d| Box::new(d.0.clone())),
        };
        g.validate().map_err(to_py)?;
        Ok(Self(g))
    }

    /// KV heads one rank stores: max(1, num_kv_heads // tp_size).
    fn kv_heads_per_rank(&self, tp_size: u64) -> PyResult<u64> {
        self.0.kv_heads_per_rank(tp_size).map_err(to_py)
    }

    #[getter]
    fn num_layers(&self) -> usize {
        self.0.layers.len()
    }
}

/// A sized pool: layout plus capacity. Built by `plan()`.
#[pyclass(name = "Plan", module = "kvpool._core", frozen)]
pub(crate) struct PyPlan {
    plan: Plan,
}

/// One buffer: (name, layer or None, tensor, role, torch dtype name, shape, nbytes, group, space).
type BufferRow = (String, Option<usize>, &'static str, &'static str, &'static str, Vec<u64>, u64, String, String);
/// One group: (name, kind, layers, space or None, kv_heads, head_dim, v_head_dim, row bytes, bytes).
type GroupRow = (String, &'static str, Vec<usize>, Option<String>, u64, u64, u64, u64, u64);
/// One page space: (name, kind, page_size, pages, rows, row bytes, bytes, headroom pages,
/// capped_by_int32, requests of context_len tokens).
type SpaceRow = (String, &'static str, u64, u64, u64, u64, u64, u64, bool, u64);

#[pymethods]
impl PyPlan {
    #[getter]
    fn num_tokens(&self) -> u64 {
        self.plan.num_tokens()
    }
    #[getter]
    fn num_pages(&self) -> u64 {
        self.plan.num_pages()
    }
    #[getter]
    fn num_state_slots(&self) -> u64 {
        self.plan.num_state_slots()
    }
    #[getter]
    fn page_size(&self) -> u64 {
        self.plan.layout.page_size
    }
    #[getter]
    fn context_len(&self) -> u64 {
        self.plan.target.context_len
    }
    #[getter]
    fn chunked_prefill_size(&self) -> Option<u64> {
        self.plan.target.chunked_prefill_size
    }
    #[getter]
    fn num_draft_tokens(&self) -> u64 {
        self.plan.target.num_draft_tokens
    }
    #[getter]
    fn kv_heads_per_rank(&self) -> u64 {
        self.plan.layout.kv_heads_per_rank
    }
    #[getter]
    fn budget_bytes(&self) -> u64 {
        self.plan.budget
    }
    #[getter]
    fn bytes_per_token(&self) -> u64 {
        self.plan.layout.bytes_per_token()
    }
    #[getter]
    fn fixed_bytes(&self) -> u64 {
        self.plan.layout.fixed_bytes()
    }
    #[getter]
    fn total_bytes(&self) -> u64 {
        self.plan.total_bytes()
    }
    #[getter]
    fn k_bytes(&self) -> u64 {
        self.plan.bytes_where(|t, r| r == Role::Data && matches!(t, Tensor::K | Tensor::Latent))
    }
    #[getter]
    fn v_bytes(&self) -> u64 {
        self.plan.bytes_where(|t, r| r == Role::Data && t == Tensor::V)
    }
    #[getter]
    fn scale_bytes(&self) -> u64 {
        self.plan.bytes_where(|_, r| matches!(r, Role::BlockScale | Role::BlockScalePageMajor | Role::LayerScale))
    }
    #[getter]
    fn workspace_bytes(&self) -> u64 {
        self.plan.bytes_where(|_, r| r == Role::Workspace)
    }
    #[getter]
    fn state_bytes(&self) -> u64 {
        self.plan.bytes_where(|_, r| r == Role::State)
    }
    #[getter]
    fn nvfp4_recipe(&self) -> &'static str {
        self.plan.layout.config.nvfp4_recipe.name()
    }
    #[getter]
    fn dtype(&self) -> &'static str {
        self.plan.layout.config.dtype.name()
    }
    /// Dtype name of each layer; None for layers that store no KV (linear, shared).
    #[getter]
    fn layer_dtypes(&self) -> Vec<Option<&'static str>> {
        self.plan.layout.layer_dtypes.iter().map(|d| d.map(KvDtype::name)).collect()
    }
    /// Source layer of each shared-KV layer; None elsewhere.
    #[getter]
    fn shared_sources(&self) -> Vec<Option<usize>> {
        self.plan.layout.shared_sources.clone()
    }
    /// Every buffer, in allocation order.
    #[getter]
    fn buffers(&self) -> Vec<BufferRow> {
        let l = &self.plan.layout;
        l.buffers
            .iter()
            .map(|b| {
                let rows = self.plan.rows(b.space);
                let nbytes = rows * b.row_bytes() + b.fixed_bytes();
                let shape = b.shape(rows, l.spaces[b.space].page_size);
                let (group, space) = (l.groups[b.group].name.clone(), l.spaces[b.space].name.clone());
                (b.name.clone(), b.layer, b.tensor.name(), b.role.name(), b.elem.torch_name(), shape, nbytes, group, space)
            })
            .collect()
    }
    /// Every layer group, in layout order.
    #[getter]
    fn groups(&self) -> Vec<GroupRow> {
        let l = &self.plan.layout;
        l.groups
            .iter()
            .enumerate()
            .map(|(i, g)| {
                let geo = l.group_geometry[i];
                let space = g.space.map(|s| l.spaces[s].name.clone());
                let bytes = l.group_bytes(i, &self.plan.pages);
                (g.name.clone(), g.kind.kind_name(), g.layers.clone(), space, geo.kv_heads, geo.head_dim, geo.v_head_dim, l.group_row_bytes(i), bytes)
            })
            .collect()
    }
    /// Every page space (the state pool included), in layout order.
    #[getter]
    fn page_spaces(&self) -> Vec<SpaceRow> {
        let p = &self.plan;
        p.layout
            .spaces
            .iter()
            .enumerate()
            .map(|(s, sp)| {
                let kind = match sp.kind {
                    SpaceKind::Primary => "primary",
                    SpaceKind::Sliding { .. } => "sliding",
                    SpaceKind::State => "state",
                };
                let requests = p.space_requests(s, p.target.context_len);
                (sp.name.clone(), kind, sp.page_size, p.pages[s], p.rows(s), p.layout.space_row_bytes(s), p.space_bytes(s), p.headroom[s], p.capped_by_int32[s], requests)
            })
            .collect()
    }
    /// Bytes one request of `n` tokens holds (pages of every space plus its state slot).
    fn request_bytes(&self, n: u64) -> PyResult<u64> {
        self.plan.request_bytes(n).map_err(to_py)
    }
    /// Requests of `n` tokens every space holds at once (the least over spaces).
    fn requests_fit(&self, n: u64) -> PyResult<u64> {
        self.plan.requests_fit(n).map_err(to_py)
    }
    /// Per-request bytes of linear-attention state (conv, ssm) summed over layers, per rank.
    fn linear_state_bytes(&self) -> (u64, u64) {
        let l = &self.plan.layout;
        let sum = |t| l.buffers.iter().filter(|b| b.tensor == t).map(BufferTemplate::row_bytes).sum();
        (sum(Tensor::ConvState), sum(Tensor::SsmState))
    }
}

/// SGLang's KV budget in bytes: available_memory - total_memory * (1 - mem_frac).
#[pyfunction]
fn kv_budget_bytes(total_memory: u64, available_memory: u64, mem_frac: f64) -> PyResult<u64> {
    kv_budget(total_memory, available_memory, mem_frac).map_err(to_py)
}

/// Builds a plan: capacity for `budget` bytes, or exactly `num_tokens` tokens (page-rounded).
#[pyfunction]
#[pyo3(signature = (geometry, dtype, *, model_dtype="bf16", page_size=1, tp_size=1, nvfp4_recipe="linear", overrides=Vec::new(), sliding_dtype=None, budget=None, num_tokens=None, context_len=8192, chunked_prefill_size=Some(8192), num_draft_tokens=0))]
#[allow(clippy::too_many_arguments)]
fn plan(
    geometry: &PyModelGeometry,
    dtype: &str,
    model_dtype: &str,
    page_size: u64,
    tp_size: u64,
    nvfp4_recipe: &str,
    overrides: Vec<(usize, String)>,
    sliding_dtype: Option<&str>,
    budget: Option<u64>,
    num_tokens: Option<u64>,
    context_len: u64,
    chunked_prefill_size: Option<u64>,
    num_draft_tokens: u64,
) -> PyResult<PyPlan> {
    let parse = |s: &str| KvDtype::parse(s, model_dtype).map_err(to_py);
    let config = LayoutConfig {
        dtype: parse(dtype)?,
        overrides: overrides.iter().map(|(l, d)| Ok((*l, parse(d)?))).collect::<PyResult<_>>()?,
        sliding_dtype: sliding_dtype.map(parse).transpose()?,
        page_size,
        tp_size,
        nvfp4_recipe: nvfp4_recipe.parse::<Nvfp4Recipe>().map_err(to_py)?,
    };
    let model = &geometry.0;
    let target = Target { context_len, chunked_prefill_size, num_draft_tokens };
    let plan = match (budget, num_tokens) {
        (Some(b), None) => Plan::new(model, &config, target, b),
        (None, Some(n)) => Plan::with_tokens(model, &config, target, n),
        _ => return Err(PyTypeError::new_err("plan() takes exactly one of `budget` and `num_tokens`")),
    };
    Ok(PyPlan { plan: plan.map_err(to_py)? })
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("KV_DTYPES", KvDtype::ALL.iter().map(|d| d.name()).collect::<Vec<_>>())?;
    m.add_class::<PyModelGeometry>()?;
    m.add_class::<PyPlan>()?;
    m.add_function(wrap_pyfunction!(kv_budget_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(plan, m)?)?;
    Ok(())
}
