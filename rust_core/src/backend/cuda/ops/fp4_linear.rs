//! The prefill route of NVFP4 weights on FP4 tensor cores (sm_100 and newer, where the device's
//! cuBLASLt has the block-scaled FP4 GEMM: checked at load, `CudaDevice::nvfp4_gemm_available`):
//! each row of x quantized to NVFP4 as a matrix of its own (cuda/fp4_gemm.cu
//! `nvfp4_quantize_rows`, `quant::nvfp4::quantize_rows`: divisor 2688 / amax over the row, an
//! E4M3 scale per 16 values in the swizzle cuBLASLt's VEC16_UE4M3 mode reads, E2M1 codes), then
//! one cuBLASLt GEMM per part of the weight (a fused projection's parts keep their own tensor
//! divisors: alpha is the part's 1 / d_w) writing its columns of y, then y divided by each row's
//! divisor and the bias added in place. The weight is read as stored (half a byte a value)
//! where the dequantize route writes and reads a 2-byte workspace copy, and the product runs at
//! the FP4 tensor rate.
//!
//! Everything the route writes lives in the model's dequantization workspace (which this route
//! does not otherwise need): a chunk of rows' codes, scales and divisors, the scale plane in
//! whole 128-row tiles. Numerics: x's quantization keeps 2 significant bits of each value under
//! its group's E4M3 scale (relative error up to 1/6 of the group's largest value); the GEMM
//! sums the products of codes and scales in f32 and rounds once to bf16, the row division and
//! the bias round once more each in f32 and once to bf16. bf16 storage only: the GEMM's output
//! is scaled by the row's divisor, beyond binary16's range at real shapes.

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};

use super::{as_i32, cfg, check_len, check_linear};
use crate::backend::cuda::device::CudaDevice;
use crate::backend::cuda::kernels::{KernelFamily, StorageDType};
use crate::backend::cuda::ops::DeviceQuantWeight;
use crate::{NinferError, Result};

/// Threads of a `nvfp4_quantize_rows` block (a row) and of a `nvfp4_scale_rows` block.
const FP4_THREADS: u32 = 256;

/// Rows of the scale plane's tiles (the swizzle's outer unit).
const TILE_ROWS: usize = 128;

/// Alignment of each part of the route's workspace (cuBLASLt's preferred operand alignment).
const PART_ALIGN: usize = 256;

/// Where a chunk of `rows_ld` rows (a multiple of 128) at K = `k` keeps its parts in the
/// workspace: (codes offset, scales offset, divisors offset, end), in bytes.
fn chunk_layout(rows_ld: usize, k: usize) -> (usize, usize, usize, usize) {
    let scales = (rows_ld * k / 2).next_multiple_of(PART_ALIGN);
    let divisors = (scales + rows_ld * k / 16).next_multiple_of(PART_ALIGN);
    (0, scales, divisors, divisors + 4 * rows_ld)
}

/// Rows of x one chunk of the route takes (a multiple of 128) in a workspace of `ws_bytes`
/// bytes at K = `k`: its codes (`k / 2` bytes a row), scales (`k / 16`) and divisor (4).
pub fn nvfp4_chunk_rows(ws_bytes: usize, k: usize) -> usize {
    let per_row = k / 2 + k / 16 + 4;
    (ws_bytes.saturating_sub(2 * PART_ALIGN) / per_row) / TILE_ROWS * TILE_ROWS
}

impl CudaDevice {
    /// x [m, k] (storage type) into NVFP4 activations as `quant::nvfp4::quantize_rows` gives
    /// them, bit for bit: codes [rows_ld, k / 2], the swizzled scale plane of rows_ld rows and
    /// the divisors [rows_ld], rows m .. rows_ld zero (divisor 1). k a multiple of 64, rows_ld
    /// of 128 and at least m, x 16-byte aligned.
    pub fn nvfp4_quantize_rows(
        &self,
        x: &impl DevicePtr<u16>,
        codes: &mut impl DevicePtrMut<u8>,
        scales: &mut impl DevicePtrMut<u8>,
        divisors: &mut impl DevicePtrMut<f32>,
        m: usize,
        rows_ld: usize,
        k: usize,
    ) -> Result<()> {
        check_len("nvfp4_quantize_rows x", x.len(), m * k)?;
        check_len("nvfp4_quantize_rows codes", codes.len(), rows_ld * k / 2)?;
        check_len("nvfp4_quantize_rows scales", scales.len(), rows_ld * k / 16)?;
        check_len("nvfp4_quantize_rows divisors", divisors.len(), rows_ld)?;
        let s = self.stream();
        let (xp, _a) = x.device_ptr(s);
        let (cp, _b) = codes.device_ptr_mut(s);
        let (sp, _c) = scales.device_ptr_mut(s);
        let (dp, _d) = divisors.device_ptr_mut(s);
        self.nvfp4_quantize_launch([xp, cp, sp, dp], m, rows_ld, k)
    }

    fn nvfp4_quantize_launch(&self, [x, codes, scales, divisors]: [u64; 4], m: usize, rows_ld: usize, k: usize) -> Result<()> {
        if !k.is_multiple_of(64) || !rows_ld.is_multiple_of(TILE_ROWS) || m > rows_ld || !x.is_multiple_of(16) || !codes.is_multiple_of(8) || !divisors.is_multiple_of(4) {
            return Err(NinferError::Device(format!(
                "nvfp4_quantize_rows: K = {k} must be a multiple of 64, the {rows_ld} rows of the codes a multiple of 128 holding the {m} of x, x 16-byte, the codes 8-byte and the divisors 4-byte aligned"
            )));
        }
        if rows_ld == 0 {
            return Ok(());
        }
        let f = self.function(KernelFamily::Fp4Gemm, "nvfp4_quantize_rows")?;
        let grid = rows_ld.min(1 << 16) as u32;
        let args = kargs![x, codes, scales, divisors, as_i32("fp4 rows", m)?, as_i32("fp4 rows_ld", rows_ld)?, as_i32("fp4 k", k)?];
        self.launch(&f, cfg((grid, 1, 1), FP4_THREADS), "nvfp4_quantize_rows", &args)
    }

    /// y = x W^T (+ bias) for `m` rows of x through the NVFP4 route (module doc): `w` an NVFP4
    /// weight without a dense tail (`DeviceQuantWeight::is_nvfp4`), x and y 16-byte aligned,
    /// bf16 storage; `workspace` the model's dequantization workspace.
    pub fn nvfp4_linear(
        &self,
        x: &impl DevicePtr<u16>,
        w: &DeviceQuantWeight,
        bias: Option<&CudaSlice<u16>>,
        workspace: &mut CudaSlice<u16>,
        y: &mut impl DevicePtrMut<u16>,
        m: usize,
    ) -> Result<()> {
        let (n, k) = (w.n, w.k);
        check_linear("nvfp4_linear", x.len(), y.len(), bias.map(|b| b.len()), [m, n, k])?;
        if self.storage() != StorageDType::Bf16 {
            return Err(NinferError::Device(format!("{}: the FP4 GEMM route writes bfloat16, not {}", w.name, self.storage().name())));
        }
        if m == 0 {
            return Ok(());
        }
        let s = self.stream();
        let parts = w.nvfp4_planes(s).ok_or_else(|| NinferError::Device(format!("{}: the FP4 GEMM route takes NVFP4 weights without dense rows, not {}", w.name, w.format.name())))?;
        let chunk = nvfp4_chunk_rows(2 * workspace.len(), k);
        if chunk == 0 {
            return Err(NinferError::Device(format!("{}: a workspace of {} elements holds no 128-row chunk of K = {k} codes", w.name, workspace.len())));
        }
        let (xp, _a) = x.device_ptr(s);
        let (yp, _b) = y.device_ptr_mut(s);
        let bp = bias.map_or(0u64, |b| b.device_ptr(s).0);
        let (wsp, _c) = workspace.device_ptr_mut(s);
        let scale_rows = self.function(KernelFamily::Fp4Gemm, "nvfp4_scale_rows")?;
        let mut r0 = 0;
        while r0 < m {
            let r = chunk.min(m - r0);
            let rows_ld = r.next_multiple_of(TILE_ROWS);
            let (c_off, s_off, d_off, _) = chunk_layout(rows_ld, k);
            let (codes, scales, divisors) = (wsp + c_off as u64, wsp + s_off as u64, wsp + d_off as u64);
            let (xr, yr) = (xp + (r0 * k * 2) as u64, yp + (r0 * n * 2) as u64);
            self.nvfp4_quantize_launch([xr, codes, scales, divisors], r, rows_ld, k)?;
            for p in &parts {
                self.nvfp4_gemm_raw(codes, scales, p.codes, p.scales, yr + (p.r0 * 2) as u64, [r, p.rows, k], n, 1.0 / p.d_w)?;
            }
            let grid = ((n / 8).div_ceil(FP4_THREADS as usize) as u32, r.min(65_535) as u32, 1);
            let args = kargs![yr, divisors, bp, as_i32("fp4 rows", r)?, as_i32("fp4 n", n)?];
            self.launch(&scale_rows, cfg(grid, FP4_THREADS), "nvfp4_scale_rows", &args)?;
            r0 += r;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_hold_their_codes_scales_and_divisors_in_the_workspace() {
        for (ws, k) in [(2 * 128 * 64, 64), (2 * 17408 * 5120, 5120), (2 * 5120 * 17408, 17408), (1 << 22, 4096)] {
            let r = nvfp4_chunk_rows(ws, k);
            assert!(r >= TILE_ROWS && r.is_multiple_of(TILE_ROWS), "ws {ws} k {k}: {r} rows");
            let (_, scales, divisors, end) = chunk_layout(r, k);
            assert!(scales >= r * k / 2 && divisors >= scales + r * k / 16 && end <= ws, "ws {ws} k {k}: {r} rows overflow");
            assert!(scales.is_multiple_of(PART_ALIGN) && divisors.is_multiple_of(PART_ALIGN));
            assert!(chunk_layout(r + TILE_ROWS, k).3 > ws, "ws {ws} k {k}: {r} rows leave a tile's room");
        }
        // Qwen3.5-27B's workspace (its gate_up, [34816, 5120]) takes an 8k-token prefill in one
        // chunk at every K of the model.
        assert_eq!(8192usize.div_ceil(nvfp4_chunk_rows(2 * 34816 * 5120, 5120)), 1);
        assert_eq!(8192usize.div_ceil(nvfp4_chunk_rows(2 * 34816 * 5120, 17408)), 1);
        assert_eq!(nvfp4_chunk_rows(1000, 64), 0);
    }
}
