//! kvpool core: KV cache dtypes, attention geometry, byte-exact pool layout and sizing, the page
//! allocator and the radix prefix cache. Usable without Python; the PyO3 bindings live in `py`
//! behind the `python` feature.

pub mod alloc;
pub mod batch;
pub mod dtype;
pub mod error;
pub mod groups;
pub mod hash;
pub mod layout;
pub mod model;
pub mod radix;
pub mod sizing;
pub mod window;

#[cfg(feature = "python")]
mod py;

pub use alloc::{AllocError, PageAllocator, PageId};
pub use batch::BatchError;
pub use dtype::{ElemDtype, KvDtype, ScaleKind};
pub use error::{Error, Result};
pub use groups::{Group, GroupKind, PageSpace, SpaceKind, Target};
pub use layout::{BufferTemplate, GroupGeometry, Layout, LayoutConfig, Nvfp4Recipe, Role, Tensor, PADDING_PAGE};
pub use model::{LayerKind, LinearState, Mla, ModelGeometry};
pub use radix::{
    GroupMatch, GroupPath, Handle, Match, Namespace, NodeId, Others, RadixCache, RadixError,
};
pub use sizing::{capacity, kv_budget, Plan};
