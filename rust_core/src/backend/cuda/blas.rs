//! cuBLAS GEMM for prefill: y[M, N] = x[M, K] * W[N, K]^T with storage-type inputs and f32
//! accumulation, output in storage type or f32 (logits). Row-major on our side; cuBLAS is
//! column-major, so we ask it for y^T = W * x^T, which is the same memory.

use std::ffi::c_void;

use cudarc::cublas::{result, sys};
use cudarc::driver::{DevicePtr, DevicePtrMut};

use super::device::CudaDevice;
use super::kernels::StorageDType;
use super::ops::check_len;
use crate::{NinferError, Result};

impl CudaDevice {
    fn storage_cuda_type(&self) -> sys::cudaDataType {
        match self.storage() {
            StorageDType::Bf16 => sys::cudaDataType::CUDA_R_16BF,
            StorageDType::F16 => sys::cudaDataType::CUDA_R_16F,
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn gemm_raw(
        &self,
        x: u64,
        w: u64,
        y: u64,
        y_type: sys::cudaDataType,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<()> {
        let blas = self.blas()?;
        let (alpha, beta) = (1.0f32, 0.0f32);
        let dims = [m, n, k];
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
                n as i32,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| NinferError::Device(format!("cublasGemmEx m={m} n={n} k={k}: {e:?}")))
    }

    /// y[M, N] (storage type) = x[M, K] * W[N, K]^T through cuBLAS with f32 accumulation.
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
        let s = self.stream();
        let (xp, _a) = x.device_ptr(s);
        let (wp, _b) = w.device_ptr(s);
        let (yp, _c) = y.device_ptr_mut(s);
        let t = self.storage_cuda_type();
        self.gemm_raw(xp, wp, yp, t, m, n, k)
    }

    /// y[M, N] (f32) = x[M, K] * W[N, K]^T: the lm_head for logits.
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
        let s = self.stream();
        let (xp, _a) = x.device_ptr(s);
        let (wp, _b) = w.device_ptr(s);
        let (yp, _c) = y.device_ptr_mut(s);
        self.gemm_raw(xp, wp, yp, sys::cudaDataType::CUDA_R_32F, m, n, k)
    }
}
