//! KV cache dtypes as data: bits per value, block size, scale encoding, per-layer scales.
//!
//! One table answers every question sizing and allocation ask about a dtype, so a new dtype is a
//! new row, never a new pool class. Formats: OCP 8-bit floating point (OFP8) for e4m3/e5m2; OCP
//! Microscaling (MX) v1.0 for e2m1 values and ue8m0 scales; NVIDIA's NVFP4 (e2m1 values, one e4m3
//! scale per 16 values, one fp32 global scale per tensor).

use std::fmt;
use std::str::FromStr;

/// Errors of the `dtype` room.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DtypeError {
    /// The name is not a KV cache dtype.
    #[error("unknown KV cache dtype `{name}`; expected one of: {}", KvDtype::ACCEPTED.join(", "))]
    Unknown { name: String },
    /// `auto` was asked for but nothing says what the model's dtype is.
    #[error("KV cache dtype `auto` needs the model's compute dtype; `{name}` is not one of fp32, bf16, fp16")]
    BadModelDtype { name: String },
}

/// Element type of one stored buffer (what `torch` allocates).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ElemDtype {
    F32,
    Bf16,
    F16,
    /// OCP e4m3 (`float8_e4m3fn`, max 448).
    F8E4m3,
    /// OCP e5m2 (`float8_e5m2`, max 57344).
    F8E5m2,
    /// Raw bytes: packed e2m1 pairs, or ue8m0 scale bytes.
    U8,
}

impl ElemDtype {
    /// Bytes per element.
    pub const fn bytes(self) -> u64 {
        match self {
            Self::F32 => 4,
            Self::Bf16 | Self::F16 => 2,
            Self::F8E4m3 | Self::F8E5m2 | Self::U8 => 1,
        }
    }

    /// The torch dtype name (`torch.<name>`).
    pub const fn torch_name(self) -> &'static str {
        match self {
            Self::F32 => "float32",
            Self::Bf16 => "bfloat16",
            Self::F16 => "float16",
            Self::F8E4m3 => "float8_e4m3fn",
            Self::F8E5m2 => "float8_e5m2",
            Self::U8 => "uint8",
        }
    }
}

/// How a dtype's values are scaled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScaleKind {
    /// Stored as is (16/32-bit floats).
    None,
    /// One static fp32 scale per layer for K and one for V (`k_scale`, `v_scale`).
    PerTensor,
    /// One e4m3 scale per block of 16 values plus one fp32 global scale per layer for K and for V.
    E4m3BlockAndGlobal,
    /// One ue8m0 (power of two, bias 127) scale per block of 16 values.
    Ue8m0Block,
}

/// A KV cache dtype (SGLang's `--kv-cache-dtype` names; `fp8` is an alias of `fp8_e4m3`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvDtype {
    Fp32,
    Bf16,
    Fp16,
    Fp8E4m3,
    Fp8E5m2,
    Nvfp4,
    Fp4MxBlock16,
}

/// Values per block scale for the FP4 formats (NVFP4's 16; kvpool's MX variant also uses 16, not
/// OCP MXFP4's 32).
pub const FP4_BLOCK: u64 = 16;

impl KvDtype {
    /// Every concrete dtype, in the order reports list them.
    pub const ALL: [KvDtype; 7] = [
        Self::Fp32,
        Self::Bf16,
        Self::Fp16,
        Self::Fp8E4m3,
        Self::Fp8E5m2,
        Self::Nvfp4,
        Self::Fp4MxBlock16,
    ];
    /// Names accepted by [`KvDtype::parse`].
    pub const ACCEPTED: [&'static str; 9] = [
        "auto",
        "fp32",
        "bf16",
        "fp16",
        "fp8",
        "fp8_e4m3",
        "fp8_e5m2",
        "nvfp4",
        "fp4_mx_block16",
    ];

    /// Parses a dtype name; `auto` resolves to `model_dtype` (itself one of fp32/bf16/fp16).
    ///
    /// # Errors
    /// [`DtypeError::Unknown`] for a name that is not a KV dtype, [`DtypeError::BadModelDtype`]
    /// when `auto` meets a model dtype that is not a 16/32-bit float.
    pub fn parse(name: &str, model_dtype: &str) -> Result<Self, DtypeError> {
        if name == "auto" {
            return match name_to_dtype(model_dtype) {
                Some(d @ (Self::Fp32 | Self::Bf16 | Self::Fp16)) => Ok(d),
                _ => Err(DtypeError::BadModelDtype { name: model_dtype.to_owned() }),
            };
        }
        name.parse()
    }

    /// The canonical name.
    pub const fn name(self) -> &'static str {
        match self {
            Self::Fp32 => "fp32",
            Self::Bf16 => "bf16",
            Self::Fp16 => "fp16",
            Self::Fp8E4m3 => "fp8_e4m3",
            Self::Fp8E5m2 => "fp8_e5m2",
            Self::Nvfp4 => "nvfp4",
            Self::Fp4MxBlock16 => "fp4_mx_block16",
        }
    }

    /// Bits per stored value (scales not included).
    pub const fn bits(self) -> u64 {
        match self {
            Self::Fp32 => 32,
            Self::Bf16 | Self::Fp16 => 16,
            Self::Fp8E4m3 | Self::Fp8E5m2 => 8,
            Self::Nvfp4 | Self::Fp4MxBlock16 => 4,
        }
    }

    /// Element type of the data buffer (FP4 packs two values per `U8`).
    pub const fn data_elem(self) -> ElemDtype {
        match self {
            Self::Fp32 => ElemDtype::F32,
            Self::Bf16 => ElemDtype::Bf16,
            Self::Fp16 => ElemDtype::F16,
            Self::Fp8E4m3 => ElemDtype::F8E4m3,
            Self::Fp8E5m2 => ElemDtype::F8E5m2,
            Self::Nvfp4 | Self::Fp4MxBlock16 => ElemDtype::U8,
        }
    }

    /// How values are scaled.
    pub const fn scale_kind(self) -> ScaleKind {
        match self {
            Self::Fp32 | Self::Bf16 | Self::Fp16 => ScaleKind::None,
            Self::Fp8E4m3 | Self::Fp8E5m2 => ScaleKind::PerTensor,
            Self::Nvfp4 => ScaleKind::E4m3BlockAndGlobal,
            Self::Fp4MxBlock16 => ScaleKind::Ue8m0Block,
        }
    }

    /// Values per block scale, if the dtype has block scales.
    pub const fn block_size(self) -> Option<u64> {
        match self.scale_kind() {
            ScaleKind::E4m3BlockAndGlobal | ScaleKind::Ue8m0Block => Some(FP4_BLOCK),
            _ => None,
        }
    }

    /// Element of the block-scale buffers, if any.
    pub const fn block_scale_elem(self) -> Option<ElemDtype> {
        match self.scale_kind() {
            ScaleKind::E4m3BlockAndGlobal => Some(ElemDtype::F8E4m3),
            ScaleKind::Ue8m0Block => Some(ElemDtype::U8),
            _ => None,
        }
    }

    /// Bytes that `n` values take in the data buffer (`n` must be a multiple of the pack factor).
    pub const fn data_bytes(self, n: u64) -> u64 {
        n * self.bits() / 8
    }
}

fn name_to_dtype(name: &str) -> Option<KvDtype> {
    Some(match name {
        "fp32" | "float32" | "float" => KvDtype::Fp32,
        "bf16" | "bfloat16" => KvDtype::Bf16,
        "fp16" | "float16" | "half" => KvDtype::Fp16,
        "fp8" | "fp8_e4m3" | "float8_e4m3fn" => KvDtype::Fp8E4m3,
        "fp8_e5m2" | "float8_e5m2" => KvDtype::Fp8E5m2,
        "nvfp4" => KvDtype::Nvfp4,
        "fp4_mx_block16" => KvDtype::Fp4MxBlock16,
        _ => return None,
    })
}

impl FromStr for KvDtype {
    type Err = DtypeError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        name_to_dtype(s).ok_or_else(|| DtypeError::Unknown { name: s.to_owned() })
    }
}

impl fmt::Display for KvDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp4_costs_half_a_byte_plus_one_sixteenth() {
        // 128 values: 64 data bytes + 8 scale bytes = 0.5625 bytes per value.
        for d in [KvDtype::Nvfp4, KvDtype::Fp4MxBlock16] {
            let scale = d.block_scale_elem().unwrap().bytes() * 128 / d.block_size().unwrap();
            assert_eq!(d.data_bytes(128) + scale, 72);
        }
    }

    #[test]
    fn parse_names_and_auto() {
        assert_eq!(KvDtype::parse("fp8", "bf16"), Ok(KvDtype::Fp8E4m3));
        assert_eq!(KvDtype::parse("auto", "float32"), Ok(KvDtype::Fp32));
        assert_eq!(KvDtype::parse("auto", "bfloat16"), Ok(KvDtype::Bf16));
        assert!(matches!(KvDtype::parse("auto", "int8"), Err(DtypeError::BadModelDtype { .. })));
        let err = KvDtype::parse("fp6", "bf16").unwrap_err();
        assert!(err.to_string().contains("`fp6`"));
        assert!(err.to_string().contains("nvfp4"));
    }
}
