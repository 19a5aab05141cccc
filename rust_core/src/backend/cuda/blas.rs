//! cuBLAS GEMM for prefill: y[M, N] = x[M, K] * W[N, K]^T with storage-type inputs and f32
//! accumulation, output in storage type or f32 (logits). Row-major on our side; cuBLAS is
//! column-major, so we ask it for y^T = W * x^T, which is the same memory.
//!
//! Rows are padded to a few buckets (`padded_rows`) where the buffers hold them: on Hopper,
//! cuBLAS 12.8+ / 13 runs generated `nvjet` kernels whose tile follows M in steps of 8, and each
//! costs ~4 ms the first time a process runs it (the first call at M = 100, 117, 200 paid
//! 3.5-6 ms a shape; M = 104 and 1608 reused the kernels of 100 and 1601 and paid nothing;
//! CUDA_MODULE_LOADING=EAGER does not remove it). Unpadded, every new token count of a prefill
//! or mixed step met new kernels (an 8B prefill paid 10-24 ms more the first time); padded,
//! the buckets are few and `CudaModel` runs them all once at startup (`warm_gemm_kernels`).

use std::ffi::c_void;

use cudarc::cublas::{result, sys};
use cudarc::driver::{DevicePtr, DevicePtrMut};

use super::device::CudaDevice;
use super::kernels::StorageDType;
use super::ops::check_len;
use crate::{NinferError, Result};

/// Rows above which cuBLAS calls are not padded: a prefill step this large takes tens of ms, and
/// the kernels cuBLAS picks there follow its waves over the SMs rather than M (M = 3000, 5000 and
/// 6400 met 0-2 new kernels in the probe), so padding would cost compute and save little.
pub const PAD_MAX_ROWS: usize = 2048;

/// The rows a cuBLAS GEMM of `m` rows runs with when the buffers hold them: up to 8 and above
/// PAD_MAX_ROWS as they are (the GEMV's rows, which cuBLAS sees only in tests), else the next
/// multiple of max(16, m's power of two / 32): at most 15 rows more up to 256 rows (below ~165
/// an H200 GEMM reads its weights at the same pace whatever the rows), at most 1/16 more (3% on
/// average) above; 64 buckets in all, 32 up to the default 512-token prefill chunk.
pub fn padded_rows(m: usize) -> usize {
    if m <= 8 || m > PAD_MAX_ROWS {
        return m;
    }
    m.next_multiple_of((m.next_power_of_two() / 32).max(16))
}

/// The row buckets `padded_rows` produces for 9 to `max_rows` rows: what a warm-up runs so that
/// no request meets a GEMM kernel for the first time.
pub fn padded_row_buckets(max_rows: usize) -> Vec<usize> {
    let mut b: Vec<usize> = (9..=max_rows.min(PAD_MAX_ROWS)).map(padded_rows).filter(|&p| p <= max_rows).collect();
    b.dedup();
    b
}

/// Rows `m` padded where `x_len` and `y_len` (elements) hold the padded rows, else `m`.
fn rows_to_run(m: usize, n: usize, k: usize, x_len: usize, y_len: usize) -> usize {
    let p = padded_rows(m);
    if x_len >= p * k && y_len >= p * n {
        p
    } else {
        m
    }
}

impl CudaDevice {
    fn storage_cuda_type(&self) -> sys::cudaDataType {
        match self.storage() {
            StorageDType::Bf16 => sys::cudaDataType::CUDA_R_16BF,
            StorageDType::F16 => sys::cudaDataType::CUDA_R_16F,
        }
    }

    /// y (rows of `ldy` elements of `y_type`, the first n of each written) = x[m, k] W[n, k]^T
    /// through cuBLAS with f32 accumulation; `ldy` > n writes a band of y's columns (a
    /// vocabulary chunk of the logits).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gemm_raw(
        &self,
        x: u64,
        w: u64,
        y: u64,
        y_type: sys::cudaDataType,
        m: usize,
        n: usize,
        k: usize,
        ldy: usize,
    ) -> Result<()> {
        let blas = self.blas()?;
        let (alpha, beta) = (1.0f32, 0.0f32);
        let dims = [m, n, k, ldy];
        if dims.iter().any(|&d| d > i32::MAX as usize) {
            return Err(NinferError::Device(format!("gemm dims {dims:?} exceed i32")));
        }
        // SAFETY: the pointers are live device buffers whose lengths the callers checked
        // against m, n, k; the handle is bound to this device's stream.
        unsafe {
            result::gemm_ex(
                *blas.handle(),
                sys::cublasOperation_t::CUBLAS_OP_T,
                sys::cublasOperation_t::CUBLAS_OP_N,
                n as i32,
                m as i32,
                k as i32,
                &alpha as *const f32 as *const c_void,
                w as *const c_void,
                self.storage_cuda_type(),
                k as i32,
                x as *const c_void,
                self.storage_cuda_type(),
                k as i32,
                &beta as *const f32 as *const c_void,
                y as *mut c_void,
                y_type,
                ldy as i32,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| NinferError::Device(format!("cublasGemmEx m={m} n={n} k={k} ldc={ldy}: {e:?}")))
    }

    /// y[M, N] (storage type) = x[M, K] * W[N, K]^T through cuBLAS with f32 accumulation.
    /// Where `x` and `y` hold `padded_rows(m)` rows, that many run: rows m.. of `y` are then
    /// written too (from rows m.. of `x`), so they must be scratch.
    pub fn gemm(
        &self,
        x: &impl DevicePtr<u16>,
        w: &impl DevicePtr<u16>,
        y: &mut impl DevicePtrMut<u16>,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<()> {
        check_len("gemm x", x.len(), m * k)?;
        check_len("gemm w", w.len(), n * k)?;
        check_len("gemm y", y.len(), m * n)?;
        let rows = rows_to_run(m, n, k, x.len(), y.len());
        let s = self.stream();
        let (xp, _a) = x.device_ptr(s);
        let (wp, _b) = w.device_ptr(s);
        let (yp, _c) = y.device_ptr_mut(s);
        let t = self.storage_cuda_type();
        self.gemm_raw(xp, wp, yp, t, rows, n, k, n)
    }

    /// y[M, N] (f32) = x[M, K] * W[N, K]^T: the lm_head for logits. Padded as `gemm`.
    pub fn gemm_f32_out(
        &self,
        x: &impl DevicePtr<u16>,
        w: &impl DevicePtr<u16>,
        y: &mut impl DevicePtrMut<f32>,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<()> {
        check_len("gemm x", x.len(), m * k)?;
        check_len("gemm w", w.len(), n * k)?;
        check_len("gemm y", y.len(), m * n)?;
        let rows = rows_to_run(m, n, k, x.len(), y.len());
        let s = self.stream();
        let (xp, _a) = x.device_ptr(s);
        let (wp, _b) = w.device_ptr(s);
        let (yp, _c) = y.device_ptr_mut(s);
        self.gemm_raw(xp, wp, yp, sys::cudaDataType::CUDA_R_32F, rows, n, k, n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_pad_to_the_buckets_and_only_where_the_buffers_hold_them() {
        let rows = [1, 8, 9, 16, 17, 64, 65, 100, 129, 257, 500, 513, 1025, 2000, 2048, 2049, 5000];
        assert_eq!(rows.map(padded_rows), [1, 8, 16, 16, 32, 64, 80, 112, 144, 272, 512, 544, 1088, 2048, 2048, 2049, 5000]);
        assert_eq!(padded_row_buckets(200), vec![16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192]);
        assert_eq!(padded_row_buckets(512).len(), 32);
        assert_eq!(padded_row_buckets(4096).len(), 64);
        assert!((9..=256).all(|m| padded_rows(m) - m <= 15));
        assert!((257..=PAD_MAX_ROWS).all(|m| (padded_rows(m) - m) * 16 <= m));
        assert!(padded_row_buckets(4096).iter().all(|&b| padded_rows(b) == b));
        // x [100, 4] and y [100, 3] in buffers of 112 rows or more: padded to 112; one short: not.
        assert_eq!(rows_to_run(100, 3, 4, 112 * 4, 112 * 3), 112);
        assert_eq!(rows_to_run(100, 3, 4, 128 * 4, 128 * 3), 112);
        assert_eq!(rows_to_run(100, 3, 4, 112 * 4 - 1, 112 * 3), 100);
        assert_eq!(rows_to_run(100, 3, 4, 112 * 4, 112 * 3 - 1), 100);
    }
}
