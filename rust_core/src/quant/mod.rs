//! Quantized weight formats: the one place their exact layouts are defined, with the CPU
//! reference every GPU kernel is tested against.
//!
//! A quantized weight is a logical `[N, K]` matrix (N output rows, K inputs: `y = x W^T`) held
//! as packed bytes in one of the formats of [`FORMATS`]:
//! - the NInfer family's own formats (`grouped`: W8G32_F16S, Q4G64_F16S, Q5G64_F16S, Q6G64_F16S;
//!   `fp8_row`: FP8_E4M3FN_ROW_BF16S; `nvfp4`: NVFP4), one payload per tensor with scales inside;
//! - GGUF block formats (`gguf`: Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS, IQ3_S), rows of blocks;
//! - quantized Hugging Face checkpoints (`hf`: block-scaled FP8, AWQ, GPTQ, compressed-tensors
//!   pack-quantized), a data tensor plus scale / zero / g_idx companions.
//!
//! Each submodule's doc comment is that format's definition. [`dequantize`] decodes a
//! [`QuantTensor`] to f32 exactly as the definition says (one binary32 rounding per product);
//! [`quantize`] encodes f32 for the `--quantize` modes; [`validate`] refuses bytes or companions
//! that do not fit the declared shape, naming the tensor; [`QuantLinear`] multiplies on the CPU
//! through row tiles of dequantized weights.
//!
//! How a loader uses it (one [`QuantWeight`] per quantized linear weight, shape `[N, K]` taken
//! from the model config so that validation checks the file against the model):
//! - `.ninfer` object: `QuantFormat::from_ninfer(format, layout)`, then
//!   `QuantTensor::packed(name, f, [n, k], payload)` and [`validate`].
//! - GGUF tensor: `QuantFormat::from_gguf_type(type_id, name)?` (`None`: a dense F32/F16/BF16
//!   tensor; an unknown id is an error naming the tensor), shape `[ne[1], ne[0]]`, the tensor's
//!   bytes as the payload.
//! - HF directory: `HfQuantConfig::from_model_config(&config)?`; for each linear module,
//!   `tensor_names(module)` gives the data / scale / zero / g_idx tensor names; a module whose
//!   data tensor is absent (or, for FP8, is not F8_E4M3) is dense. Companions become
//!   [`RawTensor`]s with `RawDtype::from_safetensors(info.dtype)` and the stored shape.
//! - `--quantize MODE`: `QuantizeMode::parse(mode)?.format()`, then [`quantize`] on each linear
//!   weight's f32 values (embeddings and lm_head stay dense unless asked); [`payload_bytes`] gives
//!   the exact size for the memory plan before any weight is read, and its `Err` names the shapes
//!   a format's layout cannot hold (NVFP4 needs `N % 128 == 0`, `K % 64 == 0`).

pub mod fp8_groups;
pub mod fp8_row;
pub mod gguf;
pub mod grouped;
pub mod hf;
mod hf_config;
pub mod iq3s_grid;
mod linear;
pub mod nvfp4;
pub mod scalars;
mod validate;

pub use hf_config::{HfQuantConfig, HfTensorNames};
pub use linear::{OwnedRaw, QuantLinear, QuantWeight};
pub use validate::{payload_bytes, validate};

use crate::{NinferError, Result};

/// Every quantized weight format NInfer can represent. HF forms carry their config parameters
/// (a group of 0 spans the whole row).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QuantFormat {
    W8G32F16S,
    Q4G64F16S,
    Q5G64F16S,
    Q6G64F16S,
    Fp8E4m3fnRowBf16s,
    Nvfp4,
    GgufQ8_0,
    GgufQ4K,
    GgufQ5K,
    GgufQ6K,
    GgufIq4Xs,
    GgufIq3S,
    HfFp8Block { block_n: usize, block_k: usize },
    Awq4 { group: usize },
    Gptq4 { group: usize, zero_plus_one: bool },
    PackQuantized4 { group: usize, symmetric: bool },
}

/// Where a format's bytes come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// `.ninfer` artifacts (and `--quantize` on load).
    Ninfer,
    /// GGUF files.
    Gguf,
    /// Quantized Hugging Face safetensors checkpoints.
    HuggingFace,
}

/// One row of the format table: what a format stores, as data (the CLI, `ninfer plan` and the
/// docs read it; the submodules hold the bit-level definitions).
#[derive(Clone, Copy, Debug)]
pub struct FormatSpec {
    /// Canonical name (NInfer's own names; `GGUF_*` for ggml types; `HF_*` for checkpoint forms).
    pub name: &'static str,
    pub family: Family,
    /// Values sharing one scale along K (`None`: from the checkpoint config).
    pub group: Option<usize>,
    /// Bytes of one group/block with its scales when that is fixed (`None`: split planes or
    /// several tensors, see `bits_per_weight`).
    pub block_bytes: Option<usize>,
    /// Storage cost of full groups, scales included (HF: at group 128).
    pub bits_per_weight: f32,
    /// The stored value type.
    pub element: &'static str,
    /// The scale type and granularity.
    pub scale: &'static str,
    /// The byte layout identity.
    pub layout: &'static str,
}

/// The format table.
pub const FORMATS: [FormatSpec; 16] = [
    spec("W8G32_F16S", Family::Ninfer, Some(32), None, 8.5, "int8 [-127,127]", "f16 per 32", "row-split-k128-v1"),
    spec("Q4G64_F16S", Family::Ninfer, Some(64), None, 4.25, "int4 [-8,7]", "f16 per 64", "row-split-k128-v1"),
    spec("Q5G64_F16S", Family::Ninfer, Some(64), None, 5.25, "int5 [-16,15]", "f16 per 64", "row-split-k128-v1"),
    spec("Q6G64_F16S", Family::Ninfer, Some(64), None, 6.25, "int6 [-32,31]", "f16 per 64", "row-split-k128-v1"),
    spec("FP8_E4M3FN_ROW_BF16S", Family::Ninfer, None, None, 8.0, "e4m3fn", "bf16 per row", "row-scale-v1"),
    spec("NVFP4", Family::Ninfer, Some(16), None, 4.5, "e2m1", "e4m3fn per 16 + f32 tensor divisor", "blockscale-k16-m128x4-v1"),
    spec("GGUF_Q8_0", Family::Gguf, Some(32), Some(34), 8.5, "int8", "f16 per 32", "gguf-blocks"),
    spec("GGUF_Q4_K", Family::Gguf, Some(256), Some(144), 4.5, "uint4", "f16 d/dmin per 256, 6-bit per 32", "gguf-blocks"),
    spec("GGUF_Q5_K", Family::Gguf, Some(256), Some(176), 5.5, "uint5", "f16 d/dmin per 256, 6-bit per 32", "gguf-blocks"),
    spec("GGUF_Q6_K", Family::Gguf, Some(256), Some(210), 6.5625, "int6", "f16 per 256, int8 per 16", "gguf-blocks"),
    spec("GGUF_IQ4_XS", Family::Gguf, Some(256), Some(136), 4.25, "4-bit index into a 16-value table", "f16 per 256, 6-bit per 32", "gguf-blocks"),
    spec("GGUF_IQ3_S", Family::Gguf, Some(256), Some(110), 3.4375, "9-bit index into a 512x4 grid + sign bits", "f16 per 256, 4-bit per 32", "gguf-blocks"),
    spec("HF_FP8_BLOCK", Family::HuggingFace, None, None, 8.0, "e4m3fn", "f32 or bf16 per weight_block_size tile", "weight + weight_scale_inv"),
    spec("HF_AWQ4", Family::HuggingFace, None, None, 4.25, "uint4 minus packed zero", "f16 per group", "qweight [K,N/8] + qzeros + scales"),
    spec("HF_GPTQ4", Family::HuggingFace, None, None, 4.25, "uint4 minus packed zero", "f16 per group", "qweight [K/8,N] + qzeros + scales (+ g_idx)"),
    spec("HF_PACK_QUANTIZED4", Family::HuggingFace, None, None, 4.25, "int4 (+8 stored)", "f16/bf16/f32 per group", "weight_packed [N,K/8] + weight_scale (+ zero point, g_idx)"),
];

#[allow(clippy::too_many_arguments)]
const fn spec(
    name: &'static str,
    family: Family,
    group: Option<usize>,
    block_bytes: Option<usize>,
    bits_per_weight: f32,
    element: &'static str,
    scale: &'static str,
    layout: &'static str,
) -> FormatSpec {
    FormatSpec { name, family, group, block_bytes, bits_per_weight, element, scale, layout }
}

impl QuantFormat {
    /// The canonical name (a row of [`FORMATS`]).
    pub fn name(&self) -> &'static str {
        self.spec().name
    }

    /// This format's row of the table.
    pub fn spec(&self) -> &'static FormatSpec {
        let i = match self {
            QuantFormat::W8G32F16S => 0,
            QuantFormat::Q4G64F16S => 1,
            QuantFormat::Q5G64F16S => 2,
            QuantFormat::Q6G64F16S => 3,
            QuantFormat::Fp8E4m3fnRowBf16s => 4,
            QuantFormat::Nvfp4 => 5,
            QuantFormat::GgufQ8_0 => 6,
            QuantFormat::GgufQ4K => 7,
            QuantFormat::GgufQ5K => 8,
            QuantFormat::GgufQ6K => 9,
            QuantFormat::GgufIq4Xs => 10,
            QuantFormat::GgufIq3S => 11,
            QuantFormat::HfFp8Block { .. } => 12,
            QuantFormat::Awq4 { .. } => 13,
            QuantFormat::Gptq4 { .. } => 14,
            QuantFormat::PackQuantized4 { .. } => 15,
        };
        &FORMATS[i]
    }

    /// A format stored as one self-contained payload, by its canonical name (HF forms need their
    /// config: see [`QuantFormat::HfFp8Block`] and friends).
    pub fn from_name(name: &str) -> Option<QuantFormat> {
        [
            QuantFormat::W8G32F16S,
            QuantFormat::Q4G64F16S,
            QuantFormat::Q5G64F16S,
            QuantFormat::Q6G64F16S,
            QuantFormat::Fp8E4m3fnRowBf16s,
            QuantFormat::Nvfp4,
            QuantFormat::GgufQ8_0,
            QuantFormat::GgufQ4K,
            QuantFormat::GgufQ5K,
            QuantFormat::GgufQ6K,
            QuantFormat::GgufIq4Xs,
            QuantFormat::GgufIq3S,
        ]
        .into_iter()
        .find(|f| f.name() == name)
    }

    /// The format of a GGUF tensor from its ggml type id: `Ok(None)` for the dense F32 / F16 /
    /// BF16 types (loaded as plain tensors), an error naming the tensor for a known type NInfer
    /// does not read yet and for an unknown id.
    pub fn from_gguf_type(type_id: u32, tensor: &str) -> Result<Option<QuantFormat>> {
        if matches!(type_id, 0 | 1 | 30) {
            return Ok(None);
        }
        if let Some((_, f)) = gguf::GGUF_TYPE_IDS.iter().find(|(id, _)| *id == type_id) {
            return Ok(Some(*f));
        }
        let err = |reason: String| NinferError::QuantTensor { name: tensor.to_string(), format: format!("GGUF type {type_id}"), reason };
        match gguf::KNOWN_UNSUPPORTED_GGUF_TYPES.iter().find(|(id, _)| *id == type_id) {
            Some((_, name)) => Err(err(format!(
                "ggml type {name} is not supported yet; supported: Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS, IQ3_S, F32, F16, BF16"
            ))),
            None => Err(err(format!("unknown GGUF type id {type_id}"))),
        }
    }

    /// The format of a `.ninfer` tensor object from its `format` and `layout` strings; `None`
    /// for a combination the storage registry does not define.
    pub fn from_ninfer(format: &str, layout: &str) -> Option<QuantFormat> {
        let f = QuantFormat::from_name(format)?;
        (f.spec().family == Family::Ninfer && f.spec().layout == layout).then_some(f)
    }
}

/// Element types of the raw tensors an HF quantized weight is made of.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RawDtype {
    U8,
    F8E4M3,
    F16,
    BF16,
    F32,
    I32,
}

impl RawDtype {
    /// The dtype of a safetensors tensor by its dtype name (`TensorInfo::dtype`); `None` for one
    /// no quantized format stores.
    pub fn from_safetensors(name: &str) -> Option<RawDtype> {
        Some(match name {
            "U8" => RawDtype::U8,
            "F8_E4M3" => RawDtype::F8E4M3,
            "F16" => RawDtype::F16,
            "BF16" => RawDtype::BF16,
            "F32" => RawDtype::F32,
            "I32" => RawDtype::I32,
            _ => return None,
        })
    }

    /// Bytes per element.
    pub fn size(&self) -> usize {
        match self {
            RawDtype::U8 | RawDtype::F8E4M3 => 1,
            RawDtype::F16 | RawDtype::BF16 => 2,
            RawDtype::F32 | RawDtype::I32 => 4,
        }
    }
}

/// A borrowed companion tensor (scales, zeros, g_idx) as the checkpoint stores it.
#[derive(Clone, Debug)]
pub struct RawTensor<'a> {
    pub name: &'a str,
    pub dtype: RawDtype,
    pub shape: Vec<usize>,
    pub bytes: &'a [u8],
}

/// A borrowed quantized weight: the bytes of its data tensor (the whole payload for NInfer and
/// GGUF formats; `qweight` / `weight_packed` / `weight` for HF) plus its HF companions.
#[derive(Clone, Debug)]
pub struct QuantTensor<'a> {
    pub name: &'a str,
    pub format: QuantFormat,
    /// Logical `[N, K]`.
    pub shape: [usize; 2],
    pub data: &'a [u8],
    pub scale: Option<RawTensor<'a>>,
    pub zero: Option<RawTensor<'a>>,
    pub g_idx: Option<RawTensor<'a>>,
}

impl<'a> QuantTensor<'a> {
    /// A self-contained payload (NInfer and GGUF formats).
    pub fn packed(name: &'a str, format: QuantFormat, shape: [usize; 2], data: &'a [u8]) -> Self {
        QuantTensor { name, format, shape, data, scale: None, zero: None, g_idx: None }
    }
}

/// Binary16's largest finite value: the most an f16-storage device (sm_7x) holds of a value.
pub const F16_MAX: f32 = 65504.0;

/// The largest magnitude a weight of an FP8 or NVFP4 format can decode to, read from its scales
/// alone (FP8 row: its bf16 row scales; HF block FP8: its scale tensor; NVFP4: its tensor
/// divisor), so that a mapped checkpoint pages in only those. None for the integer formats
/// (their binary16 scales keep the values in binary16's range at the codes their encoders
/// emit) and for a payload or scale tensor too short to hold the scales (validation refuses it).
pub fn float_format_bound(t: &QuantTensor<'_>) -> Option<f32> {
    let [n, k] = t.shape;
    let whole = || matches!(payload_bytes(t.format, t.shape), Some(Ok(b)) if b == t.data.len());
    match t.format {
        QuantFormat::Fp8E4m3fnRowBf16s if whole() => {
            let max = (0..n).map(|r| scalars::bf16_to_f32(fp8_row::scale_word(t.data, n, k, r))).fold(0.0f32, f32::max);
            Some(448.0 * max)
        }
        QuantFormat::HfFp8Block { .. } => {
            let s = t.scale.as_ref().filter(|s| matches!(s.dtype, RawDtype::F32 | RawDtype::F16 | RawDtype::BF16))?;
            let count = s.shape.iter().product::<usize>();
            (s.bytes.len() >= count * s.dtype.size()).then(|| 448.0 * (0..count).map(|i| hf::float_at(s, i).abs()).fold(0.0f32, f32::max))
        }
        QuantFormat::Nvfp4 if whole() => Some(6.0 * 448.0 / nvfp4::divisor(t.data, n, k)),
        _ => None,
    }
}

/// Where `t`'s scales let it decode beyond binary16's range, its refusal on `device`, an
/// f16-storage device: the prefill route dequantizes into f16, which would hold infinities.
/// The device's upload and the CUDA loader's plan pass both refuse with it.
pub fn f16_range_error(t: &QuantTensor<'_>, device: &str) -> Option<NinferError> {
    let bound = float_format_bound(t).filter(|b| *b > F16_MAX)?;
    Some(NinferError::QuantTensor {
        name: t.name.to_string(),
        format: t.format.name().to_string(),
        reason: format!("its scales let values reach {bound:e}, beyond the f16 storage type (max 65504) the prefill route dequantizes into: {device} cannot run it"),
    })
}

/// Decode rows `rows` of a validated tensor into `out` (`rows.len() * K` values).
pub(crate) fn dequantize_rows(t: &QuantTensor<'_>, rows: std::ops::Range<usize>, out: &mut [f32]) {
    let [n, k] = t.shape;
    if let Some(g) = grouped::Grouped::of(t.format) {
        return grouped::decode_rows(&g, t.data, n, k, rows, out);
    }
    match t.format {
        QuantFormat::Fp8E4m3fnRowBf16s => fp8_row::decode_rows(t.data, n, k, rows, out),
        QuantFormat::Nvfp4 => nvfp4::decode_rows(t.data, n, k, rows, out),
        f if f.spec().family == Family::Gguf => gguf::decode_rows(f, t.data, k, rows, out),
        _ => hf::decode_rows(t, rows, out),
    }
}

/// The f32 values of a quantized weight, row-major `[N, K]`, exactly as its format defines them.
/// Validates first.
pub fn dequantize(t: &QuantTensor<'_>) -> Result<Vec<f32>> {
    validate(t)?;
    let [n, k] = t.shape;
    let mut out = vec![0.0f32; n * k];
    dequantize_rows(t, 0..n, &mut out);
    Ok(out)
}

/// The `--quantize` modes: which format a bf16/f16 checkpoint's linear weights become on load.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantizeMode {
    W8,
    Q4,
    Q5,
    Q6,
    Fp8,
    Nvfp4,
}

/// The `--quantize` spellings, in the order the CLI lists them.
pub const QUANTIZE_MODES: [&str; 6] = ["w8", "q4", "q5", "q6", "fp8", "nvfp4"];

impl QuantizeMode {
    /// Parse a `--quantize` value.
    pub fn parse(s: &str) -> Result<QuantizeMode> {
        Ok(match s {
            "w8" => QuantizeMode::W8,
            "q4" => QuantizeMode::Q4,
            "q5" => QuantizeMode::Q5,
            "q6" => QuantizeMode::Q6,
            "fp8" => QuantizeMode::Fp8,
            "nvfp4" => QuantizeMode::Nvfp4,
            other => return Err(NinferError::config("quantize", format!("unknown mode {other:?}; expected one of {}", QUANTIZE_MODES.join(", ")))),
        })
    }

    /// The format this mode writes.
    pub fn format(&self) -> QuantFormat {
        match self {
            QuantizeMode::W8 => QuantFormat::W8G32F16S,
            QuantizeMode::Q4 => QuantFormat::Q4G64F16S,
            QuantizeMode::Q5 => QuantFormat::Q5G64F16S,
            QuantizeMode::Q6 => QuantFormat::Q6G64F16S,
            QuantizeMode::Fp8 => QuantFormat::Fp8E4m3fnRowBf16s,
            QuantizeMode::Nvfp4 => QuantFormat::Nvfp4,
        }
    }
}

/// Encode a row-major `[N, K]` f32 matrix named `name` into `format` (one of the `--quantize`
/// formats), round to nearest with the format's scales. NaN and infinity are refused naming the
/// tensor and the element; so is a shape the format's layout cannot hold.
pub fn quantize(format: QuantFormat, name: &str, values: &[f32], shape: [usize; 2]) -> Result<Vec<u8>> {
    let [n, k] = shape;
    let err = |reason: String| NinferError::QuantTensor { name: name.to_string(), format: format.name().to_string(), reason };
    if n == 0 || k == 0 {
        return Err(err(format!("shape [{n}, {k}] has no elements")));
    }
    if values.len() != n * k {
        return Err(err(format!("{} values given for shape [{n}, {k}] ({} expected)", values.len(), n * k)));
    }
    if let Some(i) = values.iter().position(|v| !v.is_finite()) {
        return Err(err(format!("element [{}, {}] is {}; only finite values can be quantized", i / k, i % k, values[i])));
    }
    if let Some(g) = grouped::Grouped::of(format) {
        return grouped::encode(&g, values, n, k).map_err(err);
    }
    match format {
        QuantFormat::Fp8E4m3fnRowBf16s => Ok(fp8_row::encode(values, n, k)),
        QuantFormat::Nvfp4 => {
            if n % 128 != 0 || k % 64 != 0 {
                return Err(err(format!("shape [{n}, {k}] does not fit NVFP4's layout (rows a multiple of 128, columns of 64)")));
            }
            Ok(nvfp4::encode(values, n, k))
        }
        other => Err(NinferError::Unsupported(format!("quantizing to {}", other.name()))),
    }
}

#[cfg(test)]
mod tests;
