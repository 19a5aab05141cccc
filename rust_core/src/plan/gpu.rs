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
