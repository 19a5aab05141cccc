//! Bytes of a weight matrix in each `--quantize` format, for the memory plan: the exact payload
//! sizes of the quantization module's layouts (`quant::payload_bytes`), so that the plan and
//! the loader cannot disagree.

use crate::quant::{payload_bytes, QuantizeMode, QUANTIZE_MODES};
use crate::{NinferError, Result};

/// A `--quantize` format, as the plan counts it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QuantFormat {
    /// The `--quantize` value (`q4`).
    pub flag: &'static str,
    pub mode: QuantizeMode,
}

impl QuantFormat {
    /// The format a `--quantize` value names (case-insensitive); an error naming the value and
    /// the choices otherwise.
    pub fn parse(text: &str) -> Result<Self> {
        let lower = text.trim().to_ascii_lowercase();
        let flag = QUANTIZE_MODES.iter().copied().find(|f| *f == lower).ok_or_else(|| {
            NinferError::config("quantize (--quantize)", format!("`{text}` is not a weight format; give one of {}", QUANTIZE_MODES.join(", ")))
        })?;
        Ok(QuantFormat { flag, mode: QuantizeMode::parse(flag)? })
    }

    /// The format a load's `--quantize` mode writes.
    pub fn of(mode: QuantizeMode) -> Self {
        let flag = QUANTIZE_MODES.iter().copied().find(|f| QuantizeMode::parse(f).ok() == Some(mode)).expect("every mode has a flag");
        QuantFormat { flag, mode }
    }

    /// The container's format name (`Q4G64_F16S`).
    pub fn name(&self) -> &'static str {
        self.mode.format().name()
    }

    /// Whether this format's layout can hold an `[n, k]` matrix. `--quantize` keeps a matrix it
    /// cannot (NVFP4 tiles rows by 128 and columns by 64; Qwen3.5's `[48, 5120]` GDN gate
    /// projections are neither) in the dense type, as llama.cpp's quantizer does.
    pub fn holds(&self, n: usize, k: usize) -> bool {
        matches!(payload_bytes(self.mode.format(), [n, k]), Some(Ok(_)))
    }

    /// Whether each row is encoded from its own values alone (every format but NVFP4, whose
    /// tensor scale spans the matrix): the CUDA loader then encodes a fused projection whole,
    /// and the plan counts the fused matrix.
    pub fn encodes_rows_alone(&self) -> bool {
        self.mode != QuantizeMode::Nvfp4
    }

    /// Bytes of the `[n, k]` matrix `name` in this format; an error naming the tensor when the
    /// format's layout cannot hold that shape.
    pub fn matrix_bytes(&self, name: &str, n: usize, k: usize) -> Result<u64> {
        match payload_bytes(self.mode.format(), [n, k]) {
            Some(Ok(bytes)) => Ok(bytes as u64),
            Some(Err(reason)) => Err(NinferError::config("quantize (--quantize)", format!("{name} [{n}, {k}] cannot be held as {}: {reason}", self.name()))),
            None => Err(NinferError::config("quantize (--quantize)", format!("{} has no payload size", self.name()))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_format_counts_its_codes_scales_and_tensor_scale() {
        let f = |flag| QuantFormat::parse(flag).unwrap();
        // [128, 256]: 32768 values (K a multiple of the layouts' 128-value row tiles).
        assert_eq!(f("w8").matrix_bytes("w", 128, 256).unwrap(), 32768 + 128 * 8 * 2);
        assert_eq!(f("Q4").matrix_bytes("w", 128, 256).unwrap(), 16384 + 128 * 4 * 2);
        assert_eq!(f("q5").matrix_bytes("w", 128, 256).unwrap(), 20480 + 128 * 4 * 2);
        assert_eq!(f("q6").matrix_bytes("w", 128, 256).unwrap(), 24576 + 128 * 4 * 2);
        assert_eq!(f("fp8").matrix_bytes("w", 128, 256).unwrap(), 32768 + 128 * 2);
        assert_eq!(f("nvfp4").matrix_bytes("w", 128, 256).unwrap(), 16384 + 128 * 16 + 4);
    }

    #[test]
    fn a_shape_the_layout_cannot_hold_and_an_unknown_name_are_refused_by_name() {
        let e = QuantFormat::parse("nvfp4").unwrap().matrix_bytes("layers.0.mlp.down_proj.weight", 8, 100).unwrap_err().to_string();
        assert!(e.contains("layers.0.mlp.down_proj.weight") && e.contains("100") && e.contains("NVFP4"), "{e}");
        assert!(!QuantFormat::parse("nvfp4").unwrap().holds(48, 5120) && QuantFormat::parse("q4").unwrap().holds(48, 5120));
        for flag in QUANTIZE_MODES {
            assert_eq!(QuantFormat::of(QuantizeMode::parse(flag).unwrap()), QuantFormat::parse(flag).unwrap());
        }
        let e = QuantFormat::parse("q3").unwrap_err().to_string();
        assert!(e.contains("`q3`") && e.contains("nvfp4") && e.contains("--quantize"), "{e}");
    }
}
