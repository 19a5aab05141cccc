//! Bytes of a weight matrix in each storage format the memory plan counts: the dense types the
//! backends hold today and the `--quantize` formats of the NInfer family's containers.
//!
//! The quantized rows are one small table (`QUANT_FORMATS`): code bits per value, values per
//! scale group and bytes per scale, plus a per-tensor scale. It plans sizes only; the exact
//! layouts (packing order, tiling) belong to the quantization module, and this table is to be
//! pointed at its descriptors once both exist, so that the two cannot disagree.

use crate::{NinferError, Result};

/// A `--quantize` format: what a `[n, k]` weight matrix costs in it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QuantFormat {
    /// The `--quantize` value (`q4`).
    pub flag: &'static str,
    /// The container's format name (`Q4G64_F16S`).
    pub name: &'static str,
    /// Bits of each quantized value.
    pub code_bits: usize,
    /// Values of a row that share one scale; `ROW`: one scale per row.
    pub group: usize,
    /// Bytes of one scale.
    pub scale_bytes: usize,
    /// Bytes of the scale of the whole tensor (NVFP4's f32), 0 when none.
    pub tensor_scale_bytes: usize,
}

/// `QuantFormat::group` of a format with one scale per row.
pub const ROW: usize = 0;

/// The `--quantize` formats. Q4/Q5/Q6 are symmetric (an f16 scale per group of 64, no zero
/// point); FP8 keeps e4m3 values with a bf16 scale per row; NVFP4 keeps e2m1 values with an
/// e4m3 scale per 16 and one f32 scale per tensor.
pub const QUANT_FORMATS: [QuantFormat; 6] = [
    QuantFormat { flag: "w8", name: "W8G32_F16S", code_bits: 8, group: 32, scale_bytes: 2, tensor_scale_bytes: 0 },
    QuantFormat { flag: "q4", name: "Q4G64_F16S", code_bits: 4, group: 64, scale_bytes: 2, tensor_scale_bytes: 0 },
    QuantFormat { flag: "q5", name: "Q5G64_F16S", code_bits: 5, group: 64, scale_bytes: 2, tensor_scale_bytes: 0 },
    QuantFormat { flag: "q6", name: "Q6G64_F16S", code_bits: 6, group: 64, scale_bytes: 2, tensor_scale_bytes: 0 },
    QuantFormat { flag: "fp8", name: "FP8_E4M3FN_ROW_BF16S", code_bits: 8, group: ROW, scale_bytes: 2, tensor_scale_bytes: 0 },
    QuantFormat { flag: "nvfp4", name: "NVFP4", code_bits: 4, group: 16, scale_bytes: 1, tensor_scale_bytes: 4 },
];

impl QuantFormat {
    /// The format a `--quantize` value names (case-insensitive); an error naming the value and
    /// the choices otherwise.
    pub fn parse(text: &str) -> Result<Self> {
        let lower = text.trim().to_ascii_lowercase();
        QUANT_FORMATS.iter().copied().find(|f| f.flag == lower).ok_or_else(|| {
            let flags: Vec<&str> = QUANT_FORMATS.iter().map(|f| f.flag).collect();
            NinferError::config("quantize (--quantize)", format!("`{text}` is not a weight format; give one of {}", flags.join(", ")))
        })
    }

    /// Bytes of the `[n, k]` matrix `name` in this format; an error naming the tensor when the
    /// scale group does not divide its rows (the format cannot hold it).
    pub fn matrix_bytes(&self, name: &str, n: usize, k: usize) -> Result<u64> {
        let (n, k) = (n as u64, k as u64);
        let groups = if self.group == ROW {
            1
        } else if k % self.group as u64 == 0 {
            k / self.group as u64
        } else {
            return Err(NinferError::config(
                "quantize (--quantize)",
                format!("{name}: rows of {k} values are not a whole number of {} groups of {} ({})", self.flag, self.group, self.name),
            ));
        };
        let code_bits = n * k * self.code_bits as u64;
        Ok(code_bits.div_ceil(8) + n * groups * self.scale_bytes as u64 + self.tensor_scale_bytes as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_format_counts_its_codes_scales_and_tensor_scale() {
        let f = |flag| QuantFormat::parse(flag).unwrap();
        // [128, 256]: 32768 values.
        assert_eq!(f("w8").matrix_bytes("w", 128, 256).unwrap(), 32768 + 128 * 8 * 2);
        assert_eq!(f("Q4").matrix_bytes("w", 128, 256).unwrap(), 16384 + 128 * 4 * 2);
        assert_eq!(f("q5").matrix_bytes("w", 128, 256).unwrap(), 20480 + 128 * 4 * 2);
        assert_eq!(f("q6").matrix_bytes("w", 128, 256).unwrap(), 24576 + 128 * 4 * 2);
        assert_eq!(f("fp8").matrix_bytes("w", 128, 256).unwrap(), 32768 + 128 * 2);
        assert_eq!(f("nvfp4").matrix_bytes("w", 128, 256).unwrap(), 16384 + 128 * 16 + 4);
    }

    #[test]
    fn a_group_that_does_not_divide_the_row_and_an_unknown_name_are_refused_by_name() {
        let e = QuantFormat::parse("q4").unwrap().matrix_bytes("layers.0.mlp.down_proj.weight", 8, 100).unwrap_err().to_string();
        assert!(e.contains("layers.0.mlp.down_proj.weight") && e.contains("100") && e.contains("64"), "{e}");
        // Row scales take any width.
        assert_eq!(QuantFormat::parse("fp8").unwrap().matrix_bytes("w", 2, 100).unwrap(), 200 + 4);
        let e = QuantFormat::parse("q3").unwrap_err().to_string();
        assert!(e.contains("`q3`") && e.contains("nvfp4") && e.contains("--quantize"), "{e}");
    }
}
