//! The FP8 prefill route of FP8_E4M3FN_ROW_BF16S weights on sm_89 and newer (cuda/fp8_gemm.cu
//! around cuBLASLt's FP8 GEMM, blaslt.rs): each row of x quantized to E4M3FN with its own f32
//! multiplier (amax / 448), the codes multiplied on FP8 tensor cores against the weight's codes
//! as stored (its bfloat16 row multipliers factor out of each sum), then
//! y[t, n] = sum[t, n] * xs[t] * ws[n] (+ bias[n]) in place. The weight is read as stored
//! (1 byte a value) where the dequantize route writes and reads a 2-byte workspace copy, and
//! the product runs at the FP8 tensor rate.
//!
//! Rows run in chunks that fit the model's dequantization workspace (which this route does not
//! otherwise need): each chunk's codes, then its multipliers, at the workspace's start.
//! Numerics: x's quantization adds a relative error of at most 2^-4 per value (E4M3FN's 3
//! mantissa bits, round to nearest; saturation never, the multiplier maps amax to 448), the
//! GEMM's sums of products of codes are exact in f32 up to 2^24 / 448^2 = 83 terms and
//! accumulated in f32 beyond, and the sums pass through the storage type once before scaling.

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};

use super::{as_i32, cfg, check_len, check_linear};
use crate::backend::cuda::blas::padded_rows;
use crate::backend::cuda::device::CudaDevice;
use crate::backend::cuda::kernels::KernelFamily;
use crate::backend::cuda::ops::DeviceQuantWeight;
use crate::{NinferError, Result};

/// Threads of a `fp8_quantize_rows` block (a row) and of a `fp8_scale_rows` block.
const FP8_THREADS: u32 = 256;

/// Rows of x one chunk of the route takes in a workspace of `ws_bytes` bytes at K = `k`: the
/// codes (`rows * k` bytes, padded to 256) then the f32 multipliers (`4 * rows`).
pub fn fp8_chunk_rows(ws_bytes: usize, k: usize) -> usize {
    ws_bytes.saturating_sub(256) / (k + 4)
}

impl CudaDevice {
    /// Row t of x [m, k] (storage type) into E4M3FN codes [m, k] and its multiplier
    /// scales[t] = amax / 448 (0 for a zero row): codes = e4m3(x / scale), round to nearest
    /// even, as `quant::scalars::f32_to_e4m3`. k a multiple of 8, x 16-byte aligned.
    pub fn fp8_quantize_rows(&self, x: &impl DevicePtr<u16>, codes: &mut impl DevicePtrMut<u8>, scales: &mut impl DevicePtrMut<f32>, m: usize, k: usize) -> Result<()> {
        check_len("fp8_quantize_rows x", x.len(), m * k)?;
        check_len("fp8_quantize_rows codes", codes.len(), m * k)?;
        check_len("fp8_quantize_rows scales", scales.len(), m)?;
        let s = self.stream();
        let (xp, _a) = x.device_ptr(s);
        let (cp, _b) = codes.device_ptr_mut(s);
        let (sp, _c) = scales.device_ptr_mut(s);
        self.fp8_quantize_launch(xp, cp, sp, m, k)
    }

    fn fp8_quantize_launch(&self, x: u64, codes: u64, scales: u64, m: usize, k: usize) -> Result<()> {
        if !k.is_multiple_of(8) || !x.is_multiple_of(16) || !codes.is_multiple_of(8) {
            return Err(NinferError::Device(format!("fp8_quantize_rows: K = {k} must be a multiple of 8, x 16-byte and the codes 8-byte aligned")));
        }
        let f = self.function(KernelFamily::Fp8Gemm, "fp8_quantize_rows")?;
        let grid = m.min(1 << 16) as u32;
        let args = kargs![x, codes, scales, as_i32("fp8 rows", m)?, as_i32("fp8 k", k)?];
        self.launch(&f, cfg((grid, 1, 1), FP8_THREADS), "fp8_quantize_rows", &args)
    }

    /// y = x W^T (+ bias) for `m` rows of x through the FP8 route (module doc): `w` an
    /// FP8_E4M3FN_ROW_BF16S weight without a dense tail, N and K multiples of 16, x and y
    /// 16-byte aligned, bf16 storage; `workspace` the model's dequantization workspace. Where
    /// `x` and `y` hold `padded_rows(m)` rows, that many run (rows m.. of `y` are then written
    /// too, so they must be scratch), as `CudaDevice::gemm`.
    pub fn fp8_linear(
        &self,
        x: &impl DevicePtr<u16>,
        w: &DeviceQuantWeight,
        bias: Option<&CudaSlice<u16>>,
        workspace: &mut CudaSlice<u16>,
        y: &mut impl DevicePtrMut<u16>,
        m: usize,
    ) -> Result<()> {
        let (n, k) = (w.n, w.k);
        check_linear("fp8_linear", x.len(), y.len(), bias.map(|b| b.len()), [m, n, k])?;
        let s = self.stream();
        let (w_codes, w_scales) = w.fp8_row_planes(s).ok_or_else(|| NinferError::Device(format!("{}: the FP8 GEMM route takes FP8_E4M3FN_ROW_BF16S weights without dense rows, not {}", w.name, w.format.name())))?;
        let chunk = fp8_chunk_rows(2 * workspace.len(), k);
        if chunk == 0 {
            return Err(NinferError::Device(format!("{}: a workspace of {} elements holds no row of K = {k} codes", w.name, workspace.len())));
        }
        // Padded as the dense GEMM pads (blas.rs `padded_rows`: cuBLAS's kernels follow the
        // row count) where x and y hold the padded rows, which are scratch then.
        let padded = padded_rows(m);
        let m = if x.len() >= padded * k && y.len() >= padded * n { padded } else { m };
        let (xp, _a) = x.device_ptr(s);
        let (yp, _b) = y.device_ptr_mut(s);
        let bp = bias.map_or(0u64, |b| b.device_ptr(s).0);
        let (wsp, _c) = workspace.device_ptr_mut(s);
        let codes = wsp;
        let scales = wsp + (chunk * k).next_multiple_of(256) as u64;
        let f = self.function(KernelFamily::Fp8Gemm, "fp8_scale_rows")?;
        let mut r0 = 0;
        while r0 < m {
            let r = chunk.min(m - r0);
            let (xr, yr) = (xp + (r0 * k * 2) as u64, yp + (r0 * n * 2) as u64);
            self.fp8_quantize_launch(xr, codes, scales, r, k)?;
            self.fp8_gemm_raw(codes, w_codes, yr, r, n, k)?;
            let grid = ((n / 8).div_ceil(FP8_THREADS as usize) as u32, r.min(65_535) as u32, 1);
            let args = kargs![yr, scales, w_scales, bp, as_i32("fp8 rows", r)?, as_i32("fp8 n", n)?];
            self.launch(&f, cfg(grid, FP8_THREADS), "fp8_scale_rows", &args)?;
            r0 += r;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_hold_their_codes_and_multipliers_in_the_workspace() {
        for (ws, k) in [(2 * 256 * 64, 64), (2 * 4096 * 14336, 4096), (2 * 16 * 16, 16), (1 << 20, 5120)] {
            let r = fp8_chunk_rows(ws, k);
            assert!(r >= 1, "ws {ws} k {k}");
            assert!((r * k).next_multiple_of(256) + 4 * r <= ws, "ws {ws} k {k}: {r} rows overflow");
            let r1 = r + 1;
            assert!((r1 * k).next_multiple_of(256) + 4 * r1 > ws - 256, "ws {ws} k {k}: {r} rows leave a row's room");
        }
        // A Llama-3-8B workspace (its gate_up, [28672, 4096]) takes an 8k-token prefill in one
        // chunk at every K of the model.
        assert_eq!(8192usize.div_ceil(fp8_chunk_rows(2 * 28672 * 4096, 4096)), 1);
        assert_eq!(8192usize.div_ceil(fp8_chunk_rows(2 * 28672 * 4096, 14336)), 1);
        assert_eq!(fp8_chunk_rows(100, 16), 0);
    }
}
