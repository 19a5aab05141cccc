//! cuBLASLt's FP8 GEMM, the tensor-core product of the FP8 prefill route (ops/fp8_linear.rs):
//! y[M, N] (bf16) = codes_x[M, K] * codes_w[N, K]^T over E4M3FN codes with f32 accumulation and
//! unit scales, the caller applying the row multipliers afterwards. Row-major on our side; as
//! for cuBLAS (blas.rs) we ask for y^T = W * x^T, which is the TN form cuBLASLt's FP8 kernels
//! require on sm_89 / sm_90 / sm_120: A = W transposed, B = x^T not, both K-contiguous.
//!
//! Requirements (cuBLASLt's FP8 rules, checked by `fp8_gemm_fits` and at each call): K and N
//! multiples of 16 (16-byte leading dimensions of the codes and of the bf16 output, whose
//! columns are N), every pointer 16-byte aligned, compute 32F with scale type 32F. M is free.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use cudarc::cublaslt::{result, sys};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};

use super::device::{driver_err, CudaDevice};
use crate::{NinferError, Result};

// The workspace size and the FP8 shape rule are the memory plan's too (plan/gpu.rs).
pub use crate::plan::gpu::{fp8_gemm_fits, LT_WORKSPACE_BYTES};

/// A cuBLASLt handle with its workspace and the algorithm its heuristic chose per shape.
pub struct BlasLt {
    handle: sys::cublasLtHandle_t,
    workspace: CudaSlice<u8>,
    /// (N, M, K) -> the heuristic's first algorithm: asked once per shape, not per call.
    algos: Mutex<HashMap<(usize, usize, usize), sys::cublasLtMatmulAlgo_t>>,
    /// Keeps the context alive while the handle is.
    _stream: Arc<CudaStream>,
}

// SAFETY: the handle is used only through `&self` methods that cuBLASLt allows from any
// thread (one stream orders the work); the algorithm cache is behind a mutex.
unsafe impl Send for BlasLt {}
unsafe impl Sync for BlasLt {}

impl Drop for BlasLt {
    fn drop(&mut self) {
        // SAFETY: the handle was created by `create_handle` and is dropped once.
        unsafe {
            let _ = result::destroy_handle(self.handle);
        }
    }
}

/// The descriptors of one FP8 GEMM shape and its algorithm (`CudaDevice::fp8_plan`).
struct Fp8Plan {
    desc: Owned<sys::cublasLtMatmulDesc_t>,
    a: Owned<sys::cublasLtMatrixLayout_t>,
    b: Owned<sys::cublasLtMatrixLayout_t>,
    d: Owned<sys::cublasLtMatrixLayout_t>,
    algo: sys::cublasLtMatmulAlgo_t,
}

/// Owns a cuBLASLt descriptor and destroys it when dropped (also on an error path).
struct Owned<T: Copy>(T, unsafe fn(T) -> std::result::Result<(), result::CublasError>);

impl<T: Copy> Drop for Owned<T> {
    fn drop(&mut self) {
        // SAFETY: the descriptor was created by the matching create call and is dropped once.
        unsafe {
            let _ = (self.1)(self.0);
        }
    }
}

fn lt_err(what: &'static str) -> impl Fn(result::CublasError) -> NinferError {
    move |e| NinferError::Device(format!("cuBLASLt {what}: {e:?}"))
}

/// Sets a descriptor attribute from a plain value.
unsafe fn set_desc<T>(desc: sys::cublasLtMatmulDesc_t, attr: sys::cublasLtMatmulDescAttributes_t, v: &T) -> Result<()> {
    result::set_matmul_desc_attribute(desc, attr, v as *const T as *const c_void, std::mem::size_of::<T>()).map_err(lt_err("setting a matmul attribute"))
}

impl CudaDevice {
    /// The cuBLASLt handle of this device, created on first use (with its workspace).
    pub fn blas_lt(&self) -> Result<Arc<BlasLt>> {
        let mut slot = self.blas_lt.lock().expect("cublasLt slot poisoned");
        if let Some(b) = slot.as_ref() {
            return Ok(b.clone());
        }
        // SAFETY: only tries to dlopen libcublasLt by its candidate names.
        if !unsafe { sys::is_culib_present() } {
            return Err(NinferError::Device("cuBLASLt (libcublasLt.so.13 or .so.12) was not found on the library path".into()));
        }
        self.context().bind_to_thread().map_err(driver_err("binding the CUDA context"))?;
        let handle = result::create_handle().map_err(lt_err("creating the handle"))?;
        // SAFETY: workspace bytes are only ever touched by cuBLASLt.
        let workspace = match unsafe { self.stream().alloc::<u8>(LT_WORKSPACE_BYTES) } {
            Ok(w) => w,
            Err(e) => {
                // SAFETY: created above, not yet shared.
                unsafe {
                    let _ = result::destroy_handle(handle);
                }
                return Err(driver_err("allocating the cuBLASLt workspace")(e));
            }
        };
        let b = Arc::new(BlasLt { handle, workspace, algos: Mutex::new(HashMap::new()), _stream: self.stream().clone() });
        *slot = Some(b.clone());
        Ok(b)
    }

    /// The descriptors of the FP8 GEMM of `m` x `n` x `k` and the algorithm cuBLASLt's
    /// heuristic gives it (asked once per shape); an error naming the shape and the device
    /// where this cuBLASLt has none.
    fn fp8_plan(&self, lt: &BlasLt, m: usize, n: usize, k: usize) -> Result<Fp8Plan> {
        use sys::cudaDataType::{CUDA_R_16BF, CUDA_R_32F, CUDA_R_8F_E4M3};
        let desc = Owned(result::create_matmul_desc(sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, CUDA_R_32F).map_err(lt_err("creating the matmul descriptor"))?, result::destroy_matmul_desc);
        // cublasOperation_t: 1 = T, 0 = N.
        let (op_t, op_n) = (1i32, 0i32);
        // SAFETY: the descriptor is live; the values are the attributes' documented types.
        unsafe {
            set_desc(desc.0, sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA, &op_t)?;
            set_desc(desc.0, sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB, &op_n)?;
        }
        let layout = |t, rows: usize, cols: usize, ld: usize| {
            result::create_matrix_layout(t, rows as u64, cols as u64, ld as i64).map(|l| Owned(l, result::destroy_matrix_layout)).map_err(lt_err("creating a matrix layout"))
        };
        // Column-major views: A = W as [k, n] (op T), B = x^T as [k, m], D = y^T as [n, m].
        let a = layout(CUDA_R_8F_E4M3, k, n, k)?;
        let b = layout(CUDA_R_8F_E4M3, k, m, k)?;
        let d = layout(CUDA_R_16BF, n, m, n)?;
        let mut algos = lt.algos.lock().expect("cublasLt algorithms poisoned");
        let algo = match algos.get(&(n, m, k)) {
            Some(a) => *a,
            None => {
                let pref = Owned(result::create_matmul_pref().map_err(lt_err("creating the preference"))?, result::destroy_matmul_pref);
                let ws = LT_WORKSPACE_BYTES as u64;
                // SAFETY: all descriptors are live for the call.
                let heur = unsafe {
                    result::set_matmul_pref_attribute(
                        pref.0,
                        sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                        &ws as *const u64 as *const c_void,
                        std::mem::size_of::<u64>(),
                    )
                    .map_err(lt_err("setting the workspace preference"))?;
                    result::get_matmul_algo_heuristic(lt.handle, desc.0, a.0, b.0, d.0, d.0, pref.0)
                }
                .map_err(|e| NinferError::Device(format!("cuBLASLt has no FP8 GEMM for m={m} n={n} k={k} on cuda:{} ({}): {e:?}", self.ordinal(), self.name())))?;
                algos.insert((n, m, k), heur.algo);
                heur.algo
            }
        };
        Ok(Fp8Plan { desc, a, b, d, algo })
    }

    /// Whether this device's cuBLASLt has an FP8 GEMM for an `[n, k]` weight (asked of its
    /// heuristic at 64 rows; no GPU work): the FP8 route's check at load, so that a library
    /// without one leaves the weight on the dequantize route rather than failing its steps.
    pub fn fp8_gemm_available(&self, n: usize, k: usize) -> Result<()> {
        let lt = self.blas_lt()?;
        self.fp8_plan(&lt, 64, n, k).map(|_| ())
    }

    /// y[m, n] (bf16 at `y`, row stride n) = x[m, k] * W[n, k]^T over E4M3FN codes (`x` and `w`
    /// device addresses of row-major code matrices), f32 accumulation, unit scales. The
    /// caller checked the buffers' lengths; here the shape and alignment rules are checked.
    pub(crate) fn fp8_gemm_raw(&self, x: u64, w: u64, y: u64, m: usize, n: usize, k: usize) -> Result<()> {
        if !fp8_gemm_fits(n, k) || [x, w, y].iter().any(|p| !p.is_multiple_of(16)) {
            return Err(NinferError::Device(format!("fp8 gemm m={m} n={n} k={k}: cuBLASLt's FP8 GEMM needs K and N multiples of 16 and 16-byte aligned operands")));
        }
        if m == 0 {
            return Ok(());
        }
        if [m, n, k].iter().any(|&d| d > i32::MAX as usize) {
            return Err(NinferError::Device(format!("fp8 gemm dims {:?} exceed i32", [m, n, k])));
        }
        let lt = self.blas_lt()?;
        let Fp8Plan { desc, a, b, d, algo } = self.fp8_plan(&lt, m, n, k)?;
        let (alpha, beta) = (1.0f32, 0.0f32);
        let s = self.stream();
        let (wsp, _g) = lt.workspace.device_ptr(s);
        // SAFETY: the operands are live device buffers of the shapes the layouts give (the
        // callers checked their lengths); beta = 0, so C (= D) is not read; the workspace is
        // this handle's and outlives the call.
        unsafe {
            result::matmul(
                lt.handle,
                desc.0,
                &alpha as *const f32 as *const c_void,
                &beta as *const f32 as *const c_void,
                w as *const c_void,
                a.0,
                x as *const c_void,
                b.0,
                y as *const c_void,
                d.0,
                y as *mut c_void,
                d.0,
                &algo,
                wsp as *mut c_void,
                LT_WORKSPACE_BYTES,
                s.cu_stream() as sys::cudaStream_t,
            )
        }
        .map_err(|e| NinferError::Device(format!("cublasLtMatmul (FP8) m={m} n={n} k={k}: {e:?}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fp8_gemm_takes_k_and_n_in_multiples_of_16() {
        assert!(fp8_gemm_fits(16, 16));
        assert!(fp8_gemm_fits(4096, 14336));
        assert!(!fp8_gemm_fits(37, 200));
        assert!(!fp8_gemm_fits(24, 64), "N = 24: cuBLASLt's FP8 kernels take its m (our N) in multiples of 16");
        assert!(!fp8_gemm_fits(64, 200), "K = 200");
        assert!(!fp8_gemm_fits(0, 16));
    }
}
