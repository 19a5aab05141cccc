//! The CUDA backend's rules that decide, from shapes alone, what a GPU load holds and refuses:
//! kept here, outside the CUDA build, so that the loader (`model::cuda::load`, the cuBLASLt
//! wrapper) and `ninfer plan` for a GPU read the same rule, with or without a device.

use crate::quant::{self, QuantFormat};
use crate::NinferError;

/// cuBLASLt workspace bytes: NVIDIA's recommendation for Hopper (32 MiB), allocated once with
/// the handle (the first FP8 weight that takes the tensor-core route creates it at load), so
/// that a GEMM inside a captured graph never allocates.
pub const LT_WORKSPACE_BYTES: usize = 32 << 20;

/// Whether cuBLASLt's FP8 GEMM takes a `[n, k]` weight: K and N multiples of 16.
pub fn fp8_gemm_fits(n: usize, k: usize) -> bool {
    n > 0 && k > 0 && n.is_multiple_of(16) && k.is_multiple_of(16)
}

/// Where each NVFP4 part's payload starts on the device (a multiple of this many bytes): the
/// payload ends in its 4-byte divisor, so a stacked weight's later parts would otherwise start
/// 4 bytes past an alignment the FP4 GEMM (16 bytes; 256 is cuBLASLt's preferred) and the chunk
/// GEMV's 16-byte loads need.
pub const NVFP4_PART_ALIGN: usize = 256;

/// Whether cuBLASLt's block-scaled FP4 GEMM takes an `[n, k]` NVFP4 part: the NVFP4 layout's
/// own rule (rows in 128-row tiles, K in 64-value tiles), which also meets the GEMM's.
pub fn nvfp4_gemm_fits(n: usize, k: usize) -> bool {
    n > 0 && k > 0 && n.is_multiple_of(128) && k.is_multiple_of(64)
}

/// Bytes a `(tile, block)` of the CUDA backend's 4-bit tiled layout holds (16 rows by 128
/// values: codes, 16-bit scales, and zeros where the weight has them): the geometry of
/// `backend::cuda::ops::quant_tiles`, kept here so that the plan counts what the upload holds.
const Q4_TILE_ROWS: usize = 16;
const Q4_TILE_K: usize = 128;
const Q4_TILE_BYTES: usize = 1024 + 64;
const Q4_TILE_ZERO_BYTES: usize = 32;

/// Bytes of a `[n, k]` weight in the 4-bit tiled layout, with or without its zero plane.
pub fn q4_tiled_bytes(n: usize, k: usize, zeros: bool) -> usize {
    n.div_ceil(Q4_TILE_ROWS) * k.div_ceil(Q4_TILE_K) * (Q4_TILE_BYTES + if zeros { Q4_TILE_ZERO_BYTES } else { 0 })
}

/// Whether a 4-bit weight in `format` may be uploaded in the tiled layout, and then whether
/// with a zero plane: Q4G64_F16S always (no zeros); AWQ, GPTQ and asymmetric pack-quantized
/// (zeros) and symmetric pack-quantized (none) whose groups are whole runs of 64 values (group
/// 0, one group a row, or a multiple of 64). None: uploaded as stored.
pub fn q4_tiled_layout(format: QuantFormat) -> Option<bool> {
    let runs_of_64 = |group: usize| group.is_multiple_of(64);
    match format {
        QuantFormat::Q4G64F16S => Some(false),
        QuantFormat::Awq4 { group } | QuantFormat::Gptq4 { group, .. } if runs_of_64(group) => Some(true),
        QuantFormat::PackQuantized4 { group, symmetric } if runs_of_64(group) => Some(!symmetric),
        _ => None,
    }
}

/// Bytes the CUDA backend holds for a quantized `[n, k]` weight (one matrix, a fused
/// projection's parts stacked; an NVFP4 part alone) whose stored tensors take `stored` bytes:
/// an NVFP4 payload padded to NVFP4_PART_ALIGN; the tiled layout's for Q4G64_F16S; for the HF 4-bit forms the layout may take, the larger of the two, since
/// only the values decide (an act-order g_idx, or F32 scales that are neither f16 nor bf16
/// values, keep the stored form); else `stored`.
pub fn quant_device_bytes(format: QuantFormat, [n, k]: [usize; 2], stored: usize) -> usize {
    match (format, q4_tiled_layout(format)) {
        (QuantFormat::Nvfp4, _) => stored.next_multiple_of(NVFP4_PART_ALIGN),
        (QuantFormat::Q4G64F16S, Some(zeros)) => q4_tiled_bytes(n, k, zeros),
        (_, Some(zeros)) => q4_tiled_bytes(n, k, zeros).max(stored),
        (_, None) => stored,
    }
}

/// Why the CUDA backend cannot run the quantized `[_, k]` weight `name` (a fused projection's
/// parts joined by `|`) in `format`, if it cannot: its kernels decode 8 values at a time, so K
/// must be a multiple of 8. The loader checks it before reading any weight, the plan on the
/// shapes it counts.
pub fn quant_shape_error(name: &str, format: QuantFormat, k: usize) -> Option<NinferError> {
    (!k.is_multiple_of(8)).then(|| NinferError::QuantTensor {
        name: name.to_string(),
        format: format.name().to_string(),
        reason: format!("K = {k} is not a multiple of 8, the values the GPU kernels decode at a time: the CUDA backend cannot run it (the CPU backend can: --device cpu)"),
    })
}

/// Why a GPU cannot draft with an MTP head of `layers` layers (`--spec mtp`), if it cannot: the
/// CUDA backend runs one MTP layer.
pub fn mtp_layers_error(layers: usize) -> Option<NinferError> {
    match layers {
        1 => None,
        0 => Some(NinferError::config("spec", crate::model::cpu::mtp::NO_MTP_WEIGHTS)),
        _ => Some(NinferError::Unsupported(format!("drafting with {layers} MTP layers (mtp_num_hidden_layers) on the CUDA backend; it runs one"))),
    }
}

/// How many leading parts (`rows` each, of `k` columns) of a projection `--quantize nvfp4`
/// holds packed on CUDA: those NVFP4's layout holds (rows a multiple of 128, K of 64), when
/// they come first and the rest are all parts it cannot hold (the dense tail); None (the whole
/// projection dense) when none is held or a part it cannot hold comes before one it can (the
/// CPU loader packs that one; the CUDA weight holds dense rows only after the packed ones).
pub fn nvfp4_held_parts(rows: &[usize], k: usize) -> Option<usize> {
    let held: Vec<bool> = rows.iter().map(|r| matches!(quant::payload_bytes(QuantFormat::Nvfp4, [*r, k]), Some(Ok(_)))).collect();
    let lead = held.iter().take_while(|h| **h).count();
    (lead > 0 && !held[lead..].iter().any(|h| *h)).then_some(lead)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn four_bit_weights_count_the_tiled_layout_the_upload_holds() {
        // Q4G64: 16 x 128 values a tile block, 1024 code bytes and 32 f16 scales; padding rows
        // and K count.
        assert_eq!(quant_device_bytes(QuantFormat::Q4G64F16S, [4096, 4096], 1), 256 * 32 * 1088);
        assert_eq!(quant_device_bytes(QuantFormat::Q4G64F16S, [17, 200], 1), 2 * 2 * 1088);
        // AWQ group 128 stored: codes k n / 2, f16 scales and packed zeros per (group, row). The
        // tiled layout doubles the scales (groups of 64) and adds a byte of zero per group of
        // 64: it is the larger, and counted.
        let (n, k) = (4096usize, 4096usize);
        let awq_stored = n * k / 2 + (k / 128) * n * 2 + (k / 128) * n / 2;
        let awq = QuantFormat::Awq4 { group: 128 };
        assert_eq!(quant_device_bytes(awq, [n, k], awq_stored), 256 * 32 * 1120);
        assert!(256 * 32 * 1120 > awq_stored);
        // Groups that are not runs of 64 keep the stored form.
        assert_eq!(quant_device_bytes(QuantFormat::Gptq4 { group: 32, zero_plus_one: true }, [n, k], 123), 123);
        assert_eq!(q4_tiled_layout(QuantFormat::PackQuantized4 { group: 0, symmetric: true }), Some(false));
        assert_eq!(q4_tiled_layout(QuantFormat::Nvfp4), None);
        assert_eq!(quant_device_bytes(QuantFormat::W8G32F16S, [n, k], 7), 7);
    }

    #[test]
    fn the_shape_rules_name_the_tensor_the_format_and_the_reason() {
        assert!(fp8_gemm_fits(4096, 14336) && !fp8_gemm_fits(776, 256) && !fp8_gemm_fits(256, 200) && !fp8_gemm_fits(0, 16));
        assert!(quant_shape_error("w", QuantFormat::Q4G64F16S, 5120).is_none());
        let e = quant_shape_error("layers.0.mlp.down_proj.weight", QuantFormat::W8G32F16S, 100).unwrap().to_string();
        assert!(e.contains("layers.0.mlp.down_proj.weight") && e.contains("W8G32_F16S") && e.contains("K = 100") && e.contains("CUDA"), "{e}");
        assert!(mtp_layers_error(1).is_none());
        assert!(mtp_layers_error(0).unwrap().to_string().contains("mtp.* weights"), "no head: the flag's message, not a layer count");
        assert!(mtp_layers_error(2).unwrap().to_string().contains("2 MTP layers"));
        // q|k|v of 256, 128, 128 rows at K = 128: all held; a 48-row part after them is the
        // dense tail; before them, the whole projection stays dense.
        assert_eq!(nvfp4_held_parts(&[256, 128, 128], 128), Some(3));
        assert_eq!(nvfp4_held_parts(&[256, 48], 128), Some(1));
        assert_eq!(nvfp4_held_parts(&[48, 256], 128), None);
        assert_eq!(nvfp4_held_parts(&[256, 48, 256], 128), None);
    }
}
