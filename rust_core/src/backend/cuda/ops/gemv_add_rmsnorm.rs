//! An output projection followed by the residual add + RMSNorm as one decode kernel
//! (cuda/gemv_tc.cu `gemv_tc_add_rmsnorm`), or as the two kernels it replaces where that kernel
//! does not apply.
//!
//! Why: every layer ends each sub-block with an output projection (attention o_proj, GDN
//! out_proj, MLP down) and an `add_rmsnorm` of its output into the residual stream. At decode
//! the norm is a one-block-per-row kernel whose cost is mostly the kernel boundary (grid
//! completion, then the next grid's PDL wait) on the step's critical path: 64 boundaries of a
//! Llama-3-8B step. The fused kernel adds each block's projection columns into the residual as
//! add_rmsnorm adds them, and the last block to finish normalises the rows.
//!
//! Measured, the serial tail (one block normalising every row after the whole grid) costs more
//! than the boundary, so the model calls this only under `NINFER_FUSED_NORM=1` (off by default,
//! model/cuda_model.rs FUSED_NORM_DEFAULT); the kernel stays for that switch and its tests.

use cudarc::driver::{DevicePtr, DevicePtrMut};

use super::gemv_route::{gemv_kernel, tc_add_rmsnorm_name, GemvForm, GemvKernel, GEMV_MAX_M, GEMV_ROUTE_MAX_M};
use super::norm::chunked_norm_threads;
use super::{as_i32, cfg, check_len, KArg};
use crate::backend::cuda::device::CudaDevice;
use crate::backend::cuda::kernels::KernelFamily;
use crate::Result;

/// Output columns one block of the fused kernel covers (the tensor-core GEMV's 16-row tile).
const TC_COLS: usize = 16;

/// How `gemv_add_rmsnorm` runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AddNormRoute {
    /// `gemv_tc_add_rmsnorm`: one kernel.
    Fused,
    /// `linear` into the scratch buffer, then `add_rmsnorm`: the SIMT GEMV (sm_7x) or cuBLAS
    /// (more than GEMV_ROUTE_MAX_M rows, prefill) has no such epilogue.
    TwoKernels,
}

/// The route for `rows` rows of width `n` (the hidden size) over K = `k`, in GEMV form `form`
/// under the built-in per-shape table (`add_norm_route_for` of the form's kernel for the
/// weight), with all of the norm's buffers 16-byte aligned or not.
pub fn add_norm_route(form: GemvForm, rows: usize, n: usize, k: usize, aligned: bool) -> AddNormRoute {
    add_norm_route_for(gemv_kernel(form, crate::backend::cuda::plan::GEMV_TC_RULES, n, k, rows), rows, n, k, aligned)
}

/// The route when the plain GEMV of the [n, k] weight runs `kernel` (`gemv_kernel`): the one
/// place that decides it. The fused kernel is the tensor-core GEMV (rows up to GEMV_MAX_M,
/// K % 8 == 0; the instance the plain GEMV of the weight runs) whose last block normalises
/// whole rows with 16-byte accesses (n % 8 == 0, aligned rows). A weight the plain GEMV runs on
/// CUDA cores keeps the two kernels, so that both routes give the plain GEMV's bits
/// (`NINFER_FUSED_NORM` on == off).
pub fn add_norm_route_for(kernel: GemvKernel, rows: usize, n: usize, k: usize, aligned: bool) -> AddNormRoute {
    let fits = (1..=GEMV_MAX_M).contains(&rows) && k.is_multiple_of(8) && n.is_multiple_of(8) && aligned;
    if matches!(kernel, GemvKernel::TensorCores(_)) && fits {
        AddNormRoute::Fused
    } else {
        AddNormRoute::TwoKernels
    }
}

impl CudaDevice {
    /// residual[rows, n] += x[rows, k] * W[n, k]^T (the sum rounded to storage), then
    /// h = rmsnorm(residual) with weight `norm_w` (1 + norm_w when `plus_one`): `linear` into
    /// `tmp` followed by `add_rmsnorm`, bit for bit, in one kernel where `add_norm_route` says
    /// Fused (then `tmp` is not touched). `arrivals` is the fused kernel's block counter: at
    /// least one u32, zero when first used (the kernel leaves it zero), used by one launch at a
    /// time (the stream orders them).
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_add_rmsnorm(
        &self,
        x: &impl DevicePtr<u16>,
        w: &impl DevicePtr<u16>,
        tmp: &mut (impl DevicePtr<u16> + DevicePtrMut<u16>),
        residual: &mut impl DevicePtrMut<u16>,
        norm_w: &impl DevicePtr<u16>,
        h: &mut impl DevicePtrMut<u16>,
        arrivals: &mut impl DevicePtrMut<u32>,
        rows: usize,
        n: usize,
        k: usize,
        eps: f32,
        plus_one: bool,
    ) -> Result<()> {
        self.gemv_add_rmsnorm_with(self.gemv_form(), x, w, tmp, residual, norm_w, h, arrivals, rows, n, k, eps, plus_one)
    }

    /// As `gemv_add_rmsnorm` in the given GEMV form (tests run the SIMT form's two kernels on
    /// an sm_80+ device; TensorCores below sm_80 is an error).
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_add_rmsnorm_with(
        &self,
        form: GemvForm,
        x: &impl DevicePtr<u16>,
        w: &impl DevicePtr<u16>,
        tmp: &mut (impl DevicePtr<u16> + DevicePtrMut<u16>),
        residual: &mut impl DevicePtrMut<u16>,
        norm_w: &impl DevicePtr<u16>,
        h: &mut impl DevicePtrMut<u16>,
        arrivals: &mut impl DevicePtrMut<u32>,
        rows: usize,
        n: usize,
        k: usize,
        eps: f32,
        plus_one: bool,
    ) -> Result<()> {
        check_len("gemv_add_rmsnorm x", x.len(), rows * k)?;
        check_len("gemv_add_rmsnorm w", w.len(), n * k)?;
        check_len("gemv_add_rmsnorm residual", residual.len(), rows * n)?;
        check_len("gemv_add_rmsnorm norm weight", norm_w.len(), n)?;
        check_len("gemv_add_rmsnorm h", h.len(), rows * n)?;
        check_len("gemv_add_rmsnorm arrivals", arrivals.len(), 1)?;
        let aligned = {
            let s = self.stream();
            let (rp, _r) = residual.device_ptr_mut(s);
            let (np, _n) = norm_w.device_ptr(s);
            let (hp, _h) = h.device_ptr_mut(s);
            [rp, np, hp].iter().all(|p| p % 16 == 0)
        };
        let kernel = self.gemv_kernel(form, n, k, rows);
        match (add_norm_route_for(kernel, rows, n, k, aligned), kernel) {
            // Fused is only ever the route of a tensor-core kernel.
            (AddNormRoute::TwoKernels, _) | (AddNormRoute::Fused, GemvKernel::CudaCores) => {
                if rows <= GEMV_ROUTE_MAX_M && k.is_multiple_of(8) {
                    self.gemv_with(form, x, w, tmp, rows, n, k)?;
                } else {
                    self.gemm(x, w, tmp, rows, n, k)?;
                }
                self.add_rmsnorm(residual, tmp, norm_w, h, rows, n, eps, plus_one)
            }
            // The instance `gemv` runs for this weight: the same sums, bit for bit.
            (AddNormRoute::Fused, GemvKernel::TensorCores(c)) => {
                let name = tc_add_rmsnorm_name(c)?;
                let f = self.function(KernelFamily::GemvTc, name)?;
                let s = self.stream();
                let (xp, _a) = x.device_ptr(s);
                let (wp, _b) = w.device_ptr(s);
                let (rp, _c) = residual.device_ptr_mut(s);
                let (np, _d) = norm_w.device_ptr(s);
                let (hp, _e) = h.device_ptr_mut(s);
                let (ap, _f) = arrivals.device_ptr_mut(s);
                let args = [
                    KArg::Ptr(xp),
                    KArg::Ptr(wp),
                    KArg::Ptr(rp),
                    KArg::I32(rows as i32),
                    KArg::I32(as_i32("gemv_add_rmsnorm n", n)?),
                    KArg::I32(as_i32("gemv_add_rmsnorm k", k)?),
                    KArg::I32(self.tc_prefetch_steps() as i32),
                    KArg::Ptr(np),
                    KArg::Ptr(hp),
                    KArg::Ptr(ap),
                    // add_rmsnorm's block size for rows of n: the lanes of its sum order.
                    KArg::I32(chunked_norm_threads(n) as i32),
                    KArg::F32(eps),
                    KArg::I32(plus_one as i32),
                ];
                let grid = (as_i32("gemv_add_rmsnorm n", n.div_ceil(TC_COLS))? as u32, 1, 1);
                self.launch_pdl(&f, cfg(grid, (c.warps * 32) as u32), name, &args)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fused_only_for_tensor_core_decode_rows_of_aligned_whole_chunks() {
        let tc = GemvForm::TensorCores;
        for rows in 1..=GEMV_MAX_M {
            assert_eq!(add_norm_route(tc, rows, 4096, 14336, true), AddNormRoute::Fused);
        }
        assert_eq!(add_norm_route(tc, 0, 4096, 4096, true), AddNormRoute::TwoKernels);
        assert_eq!(add_norm_route(tc, GEMV_MAX_M + 1, 4096, 4096, true), AddNormRoute::TwoKernels);
        assert_eq!(add_norm_route(tc, 1, 4100, 4096, true), AddNormRoute::TwoKernels);
        assert_eq!(add_norm_route(tc, 1, 4096, 4100, true), AddNormRoute::TwoKernels);
        assert_eq!(add_norm_route(tc, 1, 4096, 4096, false), AddNormRoute::TwoKernels);
        assert_eq!(add_norm_route(GemvForm::Simt, 1, 4096, 4096, true), AddNormRoute::TwoKernels);
        let w4 = crate::backend::cuda::ops::GemvTcConfig { warps: 4, unroll: 4, hold: false };
        assert_eq!(add_norm_route(GemvForm::TensorCoresAs(w4), 8, 5120, 17408, true), AddNormRoute::Fused);
        // Per shape and M: at M = 1 the 8B's o and down projections run on CUDA cores, from M = 2
        // on tensor cores (GEMV_TC_RULES); the route follows.
        assert_eq!(add_norm_route(GemvForm::ByShape, 1, 4096, 4096, true), AddNormRoute::TwoKernels);
        assert_eq!(add_norm_route(GemvForm::ByShape, 1, 4096, 14336, true), AddNormRoute::TwoKernels);
        assert_eq!(add_norm_route(GemvForm::ByShape, 2, 4096, 4096, true), AddNormRoute::Fused);
        assert_eq!(add_norm_route(GemvForm::ByShape, 2, 4096, 14336, true), AddNormRoute::Fused);
    }
}
