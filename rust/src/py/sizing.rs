//! Bindings of `model`, `layout` and `sizing`: geometry in, plan out.

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;

use super::error::to_py;
use crate::dtype::KvDtype;
use crate::layout::{LayoutConfig, Nvfp4Recipe, Role, Tensor};
use crate::model::{LayerKind, LinearState, Mla, ModelGeometry};
use crate::sizing::{kv_budget, Plan};

/// Attention geometry (global, before TP sharding); built by `kvpool.config`.
#[pyclass(name = "ModelGeometry", module = "kvpool._core", frozen)]
#[derive(Clone)]
pub(crate) struct PyModelGeometry(ModelGeometry);

#[pymethods]
impl PyModelGeometry {
    #[new]
    #[pyo3(signature = (*, layer_kinds, num_attention_heads, num_kv_heads, head_dim, v_head_dim, sliding_window=None, kv_lora_rank=None, qk_rope_head_dim=None, linear_conv_bytes=0, linear_ssm_bytes=0))]
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
    ) -> PyResult<Self> {
        let layers = layer_kinds
            .iter()
            .enumerate()
            .map(|(i, k)| LayerKind::from_name(k, sliding_window, i))
            .collect::<Result<Vec<_>, _>>()
            .map_err(to_py)?;
        let mla = kv_lora_rank.map(|r| Mla { kv_lora_rank: r, qk_rope_head_dim: qk_rope_head_dim.unwrap_or(0) });
        let g = ModelGeometry {
            layers,
            num_attention_heads,
            num_kv_heads,
            head_dim,
            v_head_dim,
            mla,
            linear_state: LinearState { conv_bytes: linear_conv_bytes, ssm_bytes: linear_ssm_bytes },
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
    model: ModelGeometry,
}

/// One buffer: (name, layer or None, tensor "k"/"v"/"kv", role, torch dtype name, shape, nbytes).
type BufferRow = (String, Option<usize>, &'static str, &'static str, &'static str, Vec<u64>, u64);

#[pymethods]
impl PyPlan {
    #[getter]
    fn num_tokens(&self) -> u64 {
        self.plan.num_tokens
    }
    #[getter]
    fn num_pages(&self) -> u64 {
        self.plan.num_pages()
    }
    #[getter]
    fn page_size(&self) -> u64 {
        self.plan.layout.page_size
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
        self.plan.bytes_where(|t, r| r == Role::Data && t != Tensor::V)
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
    fn nvfp4_recipe(&self) -> &'static str {
        self.plan.layout.config.nvfp4_recipe.name()
    }
    #[getter]
    fn dtype(&self) -> &'static str {
        self.plan.layout.config.dtype.name()
    }
    /// Dtype name of each layer; None for layers that store no KV.
    #[getter]
    fn layer_dtypes(&self) -> Vec<Option<&'static str>> {
        self.plan.layout.layer_dtypes.iter().map(|d| d.map(KvDtype::name)).collect()
    }
    /// Every buffer, in allocation order.
    #[getter]
    fn buffers(&self) -> Vec<BufferRow> {
        let rows = self.plan.layout.rows(self.plan.num_tokens);
        let ps = self.plan.layout.page_size;
        self.plan
            .layout
            .buffers
            .iter()
            .map(|b| {
                let nbytes = rows * b.row_bytes() + b.fixed_bytes();
                (b.name.clone(), b.layer, b.tensor.name(), b.role.name(), b.elem.torch_name(), b.shape(rows, ps), nbytes)
            })
            .collect()
    }
    /// Bytes one request of `n` tokens holds (sliding layers windowed; see DESIGN.md).
    fn request_bytes(&self, n: u64) -> PyResult<u64> {
        self.plan.request_bytes(&self.model, n).map_err(to_py)
    }
    /// Per-request bytes of linear-attention state (conv, ssm) summed over layers, per rank.
    fn linear_state_bytes(&self) -> (u64, u64) {
        self.model.linear_state_bytes()
    }
}

/// SGLang's KV budget in bytes: available_memory - total_memory * (1 - mem_frac).
#[pyfunction]
fn kv_budget_bytes(total_memory: u64, available_memory: u64, mem_frac: f64) -> PyResult<u64> {
    kv_budget(total_memory, available_memory, mem_frac).map_err(to_py)
}

/// Builds a plan: capacity for `budget` bytes, or exactly `num_tokens` tokens (page-rounded).
#[pyfunction]
#[pyo3(signature = (geometry, dtype, *, model_dtype="bf16", page_size=1, tp_size=1, nvfp4_recipe="linear", overrides=Vec::new(), sliding_dtype=None, budget=None, num_tokens=None))]
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
    let model = geometry.0.clone();
    let plan = match (budget, num_tokens) {
        (Some(b), None) => Plan::new(&model, &config, b),
        (None, Some(n)) => Plan::with_tokens(&model, &config, n),
        _ => return Err(PyTypeError::new_err("plan() takes exactly one of `budget` and `num_tokens`")),
    };
    Ok(PyPlan { plan: plan.map_err(to_py)?, model })
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("KV_DTYPES", KvDtype::ALL.iter().map(|d| d.name()).collect::<Vec<_>>())?;
    m.add_class::<PyModelGeometry>()?;
    m.add_class::<PyPlan>()?;
    m.add_function(wrap_pyfunction!(kv_budget_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(plan, m)?)?;
    Ok(())
}
