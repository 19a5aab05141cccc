//! cuBLASLt's FP8 and FP4 GEMMs, the tensor-core products of the low-precision prefill routes.
//! Row-major on our side; as for cuBLAS (blas.rs) we ask for y^T = W * x^T, which is the TN form
//! cuBLASLt's FP8 and FP4 kernels require on sm_89 / sm_90 / sm_100 / sm_120: A = W transposed
//! ([k, n] column-major, op T), B = x^T not ([k, m]), D = y^T ([n, m]), both operands
//! K-contiguous; cuBLASLt's M is our N, its N our row count m.
//!
//! - Unit scales (ops/fp8_linear.rs, FP8_E4M3FN_ROW_BF16S): y[M, N] (bf16) = codes_x *
//!   codes_w^T, f32 accumulation, the caller applying the row multipliers afterwards.
//! - Block scales (ops/fp8_block.rs, HF block FP8): CUBLASLT_MATMUL_DESC_A_SCALE_MODE =
//!   CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F for the weight, B_SCALE_MODE =
//!   CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F for the activations (cuBLAS 12.9+, documented for
//!   compute capability 9.0 only; the pair is one of the three the cuBLAS guide's "128-element
//!   1D and 128x128 2D block scaling" section supports), output in the storage type. The
//!   guide's "Scaling factors layouts" for these modes, with L = ceil(K / 128): VEC128_32F
//!   factors are outer-dimension-major, so B's (our activations) are [L][m] with the m rows
//!   contiguous; BLK128x128_32F factors are K-major with a column stride of L4 = L rounded up
//!   to 4, so A's (our weight) are [ceil(n / 128)][L4] with the K blocks contiguous (the HF
//!   `weight_scale_inv` [ceil(N/128), L] row-major is that where L is a multiple of 4).
//!   cuBLASLt's M and N (our n and m) must be multiples of 4 and the factors 16-byte aligned.
//! - NVFP4 (ops/fp4_linear.rs): E2M1 operands, A_SCALE_MODE = B_SCALE_MODE =
//!   CUBLASLT_MATMUL_MATRIX_SCALE_VEC16_UE4M3 (an E4M3 factor per 16 values along K; sm_100
//!   and newer), the factors in the guide's 128 x 4 tiles: for an operand of R rows (its outer
//!   dimension) the tile of rows r / 128 and 16-value blocks g / 4 is tile (r / 128) * ceil(K /
//!   64) + g / 4, 512 bytes, the factor at (r % 32) * 16 + (r % 128 / 32) * 4 + g % 4: the NVFP4
//!   layout's scale plane (quant/nvfp4.rs), which the weight passes as stored. alpha (a host
//!   scalar) is the weight's 1 / d_w; the output bfloat16, its leading dimension the caller's
//!   (a stacked weight's parts write their columns of one y).
//!
//! Requirements (cuBLASLt's FP8 rules, checked by `fp8_gemm_fits` and at each call): K and N
//! multiples of 16 (16-byte leading dimensions of the codes and of the 16-bit output, whose
//! columns are N), every pointer 16-byte aligned, compute 32F with scale type 32F. M is free
//! with unit scales, a multiple of 4 with block scales.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use cudarc::cublaslt::{result, sys};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};

use super::device::{driver_err, CudaDevice};
use crate::{NinferError, Result};

// The workspace size and the FP8 shape rule are the memory plan's too (plan/gpu.rs).
pub use crate::plan::gpu::{fp8_gemm_fits, nvfp4_gemm_fits, LT_WORKSPACE_BYTES};

/// A cuBLASLt handle with its workspace and the algorithm its heuristic chose per shape.
pub struct BlasLt {
    handle: sys::cublasLtHandle_t,
    workspace: CudaSlice<u8>,
    /// (scaling, N, M, K) -> the heuristic's first algorithm: asked once per shape, not per call.
    algos: Mutex<HashMap<(LtScaling, usize, usize, usize), sys::cublasLtMatmulAlgo_t>>,
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

/// The operands of a cuBLASLt GEMM and how they are scaled (module doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum LtScaling {
    /// E4M3 operands, unit scales, bf16 raw sums.
    Unit,
    /// E4M3 operands, the weight's 128 x 128 blocks and the activations' 128-value groups, each
    /// with an f32 multiplier; output in binary16 (`f16_out`) or bfloat16.
    Block { f16_out: bool },
    /// E2M1 operands with an E4M3 factor per 16 values of each, bf16 output of leading
    /// dimension `ldd`.
    Nvfp4 { ldd: usize },
}

/// The descriptors of one FP8 GEMM shape and its algorithm (`CudaDevice::fp8_plan`).
struct LtPlan {
    scaling: LtScaling,
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

    /// The descriptors of the FP8 or FP4 GEMM of `m` x `n` x `k` with `scaling` and the algorithm
    /// cuBLASLt's heuristic gives it (asked once per shape); an error naming the shape and the
    /// device where this cuBLASLt has none, or where a dimension exceeds i32.
    fn lt_plan(&self, lt: &BlasLt, scaling: LtScaling, m: usize, n: usize, k: usize) -> Result<LtPlan> {
        if [m, n, k].iter().any(|&d| d > i32::MAX as usize) {
            return Err(NinferError::Device(format!("fp8 gemm dims {:?} exceed i32", [m, n, k])));
        }
        use sys::cudaDataType::{CUDA_R_16BF, CUDA_R_16F, CUDA_R_32F, CUDA_R_4F_E2M1, CUDA_R_8F_E4M3};
        use sys::cublasLtMatmulDescAttributes_t::{CUBLASLT_MATMUL_DESC_A_SCALE_MODE, CUBLASLT_MATMUL_DESC_B_SCALE_MODE};
        use sys::cublasLtMatmulMatrixScale_t::{CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F, CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F, CUBLASLT_MATMUL_MATRIX_SCALE_VEC16_UE4M3};
        let desc = Owned(result::create_matmul_desc(sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, CUDA_R_32F).map_err(lt_err("creating the matmul descriptor"))?, result::destroy_matmul_desc);
        // cublasOperation_t: 1 = T, 0 = N.
        let (op_t, op_n) = (1i32, 0i32);
        // SAFETY: the descriptor is live; the values are the attributes' documented types
        // (the scale modes are int32_t).
        unsafe {
            set_desc(desc.0, sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA, &op_t)?;
            set_desc(desc.0, sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB, &op_n)?;
            let modes = match scaling {
                LtScaling::Unit => None,
                LtScaling::Block { .. } => Some((CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F, CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F)),
                LtScaling::Nvfp4 { .. } => Some((CUBLASLT_MATMUL_MATRIX_SCALE_VEC16_UE4M3, CUBLASLT_MATMUL_MATRIX_SCALE_VEC16_UE4M3)),
            };
            if let Some((a_mode, b_mode)) = modes {
                set_desc(desc.0, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &(a_mode as i32))?;
                set_desc(desc.0, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &(b_mode as i32))?;
                // Aligned device addresses until the call sets the real ones, so that the
                // heuristic never sees a block-scaled GEMM without its factors.
                let placeholder = lt.workspace.device_ptr(self.stream()).0;
                set_desc(desc.0, sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &placeholder)?;
                set_desc(desc.0, sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &placeholder)?;
            }
        }
        let out_type = match scaling {
            LtScaling::Block { f16_out: true } => CUDA_R_16F,
            _ => CUDA_R_16BF,
        };
        let layout = |t, rows: usize, cols: usize, ld: usize| {
            result::create_matrix_layout(t, rows as u64, cols as u64, ld as i64).map(|l| Owned(l, result::destroy_matrix_layout)).map_err(lt_err("creating a matrix layout"))
        };
        let (operand, ldd) = match scaling {
            LtScaling::Nvfp4 { ldd } => (CUDA_R_4F_E2M1, ldd),
            _ => (CUDA_R_8F_E4M3, n),
        };
        // Column-major views: A = W as [k, n] (op T), B = x^T as [k, m], D = y^T as [n, m]
        // (leading dimensions in elements, also for the packed E2M1 operands).
        let a = layout(operand, k, n, k)?;
        let b = layout(operand, k, m, k)?;
        let d = layout(out_type, n, m, ldd)?;
        let mut algos = lt.algos.lock().expect("cublasLt algorithms poisoned");
        let algo = match algos.get(&(scaling, n, m, k)) {
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
                .map_err(|e| NinferError::Device(format!("cuBLASLt has no {scaling:?} GEMM for m={m} n={n} k={k} on cuda:{} ({}): {e:?}", self.ordinal(), self.name())))?;
                algos.insert((scaling, n, m, k), heur.algo);
                heur.algo
            }
        };
        Ok(LtPlan { scaling, desc, a, b, d, algo })
    }

    /// Whether this device's cuBLASLt has an FP8 GEMM for an `[n, k]` weight (asked of its
    /// heuristic at 64 rows; no GPU work): the FP8 route's check at load, so that a library
    /// without one leaves the weight on the dequantize route rather than failing its steps.
    pub fn fp8_gemm_available(&self, n: usize, k: usize) -> Result<()> {
        let lt = self.blas_lt()?;
        self.lt_plan(&lt, LtScaling::Unit, 64, n, k).map(|_| ())
    }

    /// Whether this device's cuBLASLt has a block-scaled FP8 GEMM (module doc) for an `[n, k]`
    /// weight with output in binary16 (`f16_out`) or bfloat16, asked of its heuristic at 64
    /// rows and at 4 (the route's smallest launch; no GPU work): the HF block route's check at
    /// load, so that a library or device without one (block scaling is documented for sm_90
    /// only) leaves the weight on the dequantize route.
    pub fn fp8_block_gemm_available(&self, n: usize, k: usize, f16_out: bool) -> Result<()> {
        if !fp8_gemm_fits(n, k) {
            return Err(NinferError::Device(format!("a block-scaled FP8 GEMM needs N and K multiples of 16, not [{n}, {k}]")));
        }
        let lt = self.blas_lt()?;
        for m in [64, 4] {
            self.lt_plan(&lt, LtScaling::Block { f16_out }, m, n, k)?;
        }
        Ok(())
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
        let lt = self.blas_lt()?;
        let plan = self.lt_plan(&lt, LtScaling::Unit, m, n, k)?;
        self.lt_matmul(&lt, &plan, [x, w, y], None, 1.0, [m, n, k])
    }

    /// y[m, n] (16-bit at `y`, row stride n: binary16 with `f16_out`, else bfloat16) =
    /// sum over the 128-value groups g of xs[g, t] * ws[n / 128, g] * (codes_x[t, g] .
    /// codes_w[n, g]): cuBLASLt's block-scaled FP8 GEMM (module doc) over row-major E4M3FN code
    /// matrices `x` [m, k] and `w` [n, k], `xs` the activations' multipliers [L][m] and `ws` the
    /// weight's [ceil(n / 128)][L4] (f32, device addresses). m a multiple of 4; the caller
    /// checked the buffers' lengths; here the shape and alignment rules are checked.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn fp8_block_gemm_raw(&self, x: u64, xs: u64, w: u64, ws: u64, y: u64, m: usize, n: usize, k: usize, f16_out: bool) -> Result<()> {
        if !fp8_gemm_fits(n, k) || !m.is_multiple_of(4) || [x, xs, w, ws, y].iter().any(|p| !p.is_multiple_of(16)) {
            return Err(NinferError::Device(format!(
                "block-scaled fp8 gemm m={m} n={n} k={k}: cuBLASLt's block-scaled FP8 GEMM needs K and N multiples of 16, m of 4 and 16-byte aligned operands and factors"
            )));
        }
        if m == 0 {
            return Ok(());
        }
        let lt = self.blas_lt()?;
        let plan = self.lt_plan(&lt, LtScaling::Block { f16_out }, m, n, k)?;
        self.lt_matmul(&lt, &plan, [x, w, y], Some([ws, xs]), 1.0, [m, n, k])
    }

    /// Whether this device's cuBLASLt has a block-scaled FP4 GEMM (module doc) for an `[n, k]`
    /// NVFP4 weight part writing a y of `ldd` columns, asked of its heuristic at 128 rows and
    /// at 17 (the route's smallest launch; no GPU work): the NVFP4 route's check at load, so
    /// that a library or device without one leaves the weight on the dequantize route.
    pub fn nvfp4_gemm_available(&self, n: usize, k: usize, ldd: usize) -> Result<()> {
        if !nvfp4_gemm_fits(n, k) {
            return Err(NinferError::Device(format!("the FP4 GEMM takes NVFP4 parts of rows in multiples of 128 and K of 64, not [{n}, {k}]")));
        }
        let lt = self.blas_lt()?;
        for m in [128, 17] {
            self.lt_plan(&lt, LtScaling::Nvfp4 { ldd }, m, n, k)?;
        }
        Ok(())
    }

    /// y[m, n] (bfloat16 at `y`, row stride `ldd`) = alpha * sum over the 16-value groups g of
    /// xs[t, g] * ws[n, g] * (codes_x[t, g] . codes_w[n, g]): cuBLASLt's block-scaled FP4 GEMM
    /// (module doc) over row-major E2M1 code matrices `x` [m, k / 2 bytes] and `w` [n, k / 2
    /// bytes] with their swizzled E4M3 factor planes `xs` and `ws` (device addresses). The
    /// caller checked the buffers' lengths; here the shape and alignment rules are checked.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn nvfp4_gemm_raw(&self, x: u64, xs: u64, w: u64, ws: u64, y: u64, [m, n, k]: [usize; 3], ldd: usize, alpha: f32) -> Result<()> {
        if !nvfp4_gemm_fits(n, k) || ldd < n || !ldd.is_multiple_of(8) || [x, xs, w, ws, y].iter().any(|p| !p.is_multiple_of(16)) {
            return Err(NinferError::Device(format!(
                "fp4 gemm m={m} n={n} k={k} ldd={ldd}: cuBLASLt's FP4 GEMM takes N in multiples of 128, K of 64, 16-byte aligned operands and factors"
            )));
        }
        if m == 0 {
            return Ok(());
        }
        let lt = self.blas_lt()?;
        let plan = self.lt_plan(&lt, LtScaling::Nvfp4 { ldd }, m, n, k)?;
        self.lt_matmul(&lt, &plan, [x, w, y], Some([ws, xs]), alpha, [m, n, k])
    }

    /// One cublasLtMatmul of `plan` (beta 0) over the code matrices at `x` and `w` into `y`,
    /// with the scale factors at `scales` (the weight's, then the activations') where the plan
    /// scales its operands, on this device's stream; an error names the route and `dims`.
    fn lt_matmul(&self, lt: &BlasLt, plan: &LtPlan, [x, w, y]: [u64; 3], scales: Option<[u64; 2]>, alpha: f32, [m, n, k]: [usize; 3]) -> Result<()> {
        let LtPlan { desc, a, b, d, algo, .. } = plan;
        if let Some([ws, xs]) = scales {
            use sys::cublasLtMatmulDescAttributes_t::{CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER};
            // SAFETY: the descriptor is live; the scale pointers are device addresses (void*).
            unsafe {
                set_desc(desc.0, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &ws)?;
                set_desc(desc.0, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &xs)?;
            }
        }
        let beta = 0.0f32;
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
                algo,
                wsp as *mut c_void,
                LT_WORKSPACE_BYTES,
                s.cu_stream() as sys::cudaStream_t,
            )
        }
        .map_err(|e| NinferError::Device(format!("cublasLtMatmul ({:?}) m={m} n={n} k={k}: {e:?}", plan.scaling)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_block_scale_modes_are_the_cublaslt_header_values() {
        // cublasLt.h (12.9+): CUBLASLT_MATMUL_DESC_A_SCALE_MODE = 31, B_SCALE_MODE = 32,
        // CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F = 4, BLK128x128_32F = 5.
        use sys::cublasLtMatmulDescAttributes_t as D;
        use sys::cublasLtMatmulMatrixScale_t as S;
        assert_eq!((D::CUBLASLT_MATMUL_DESC_A_SCALE_MODE as u32, D::CUBLASLT_MATMUL_DESC_B_SCALE_MODE as u32), (31, 32));
        assert_eq!((S::CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F as u32, S::CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F as u32), (4, 5));
        // CUBLASLT_MATMUL_MATRIX_SCALE_VEC16_UE4M3 = 1, CUDA_R_4F_E2M1 = 33 (library_types.h).
        assert_eq!(S::CUBLASLT_MATMUL_MATRIX_SCALE_VEC16_UE4M3 as u32, 1);
        assert_eq!(sys::cudaDataType::CUDA_R_4F_E2M1 as u32, 33);
    }

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
