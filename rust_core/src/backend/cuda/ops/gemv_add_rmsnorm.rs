//! An output projection followed by the residual add + RMSNorm as one decode kernel
//! (cuda/gemv_tc.cu `gemv_tc_add_rmsnorm`, or at batch 1 on CUDA cores cuda/gemv.cu
//! `gemv_add_rmsnorm_m1` under `NINFER_CC_ADD_NORM`), or as the two kernels it replaces where
//! neither applies.
//!
//! Why: every layer ends each sub-block with an output projection (attention o_proj, GDN
//! out_proj, MLP down) and an `add_rmsnorm` of its output into the residual stream. At decode
//! the norm is a one-block-per-row kernel whose cost is mostly the kernel boundary (grid
//! completion, then the next grid's PDL wait) on the step's critical path: 64 boundaries of a
//! Llama-3-8B step. The fused kernel adds each block's projection columns into the residual as
//! add_rmsnorm adds them, and the last block to finish normalises the rows.

use cudarc::driver::{DevicePtr, DevicePtrMut};

use super::gemv::{gemv_kernel, tc_add_rmsnorm_name, GemvForm, GEMV_MAX_M, GEMV_ROUTE_MAX_M};
use super::gemv_tuning::GemvKernel;
use super::norm::chunked_norm_threads;
use super::{as_i32, cfg, check_len, KArg};
use crate::backend::cuda::device::CudaDevice;
use crate::backend::cuda::kernels::KernelFamily;
use crate::{NinferError, Result};

/// Output columns one block of the fused kernel covers (the tensor-core GEMV's 16-row tile).
const TC_COLS: usize = 16;

/// Output columns one block of the CUDA-core fused kernel covers (a warp a column, GEMV_WARPS
/// warps whatever `NINFER_CC_WARPS` says: its norm tail strides by them).
const CC_COLS: usize = super::gemv::GEMV_WARPS;

/// `NINFER_CC_ADD_NORM`: at batch 1, an output projection the per-shape table runs on CUDA
/// cores (Llama-3-8B's o and down) takes the residual add + RMSNorm into its last block
/// (`gemv_add_rmsnorm_m1`) instead of a separate `add_rmsnorm` launch: one kernel boundary
/// fewer, 64 a Llama-3-8B step, the same bits. A switch (`config::env_switch`), read once per
/// device; default CC_ADD_NORM_DEFAULT until measured in the model.
pub const CC_ADD_NORM_SWITCH: &str = "NINFER_CC_ADD_NORM";

/// The switch's default.
pub const CC_ADD_NORM_DEFAULT: bool = false;

/// How `gemv_add_rmsnorm` runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AddNormRoute {
    /// `gemv_tc_add_rmsnorm`: one kernel.
    Fused,
    /// `gemv_add_rmsnorm_m1`: one kernel, the CUDA-core GEMV of one row.
    FusedCudaCores,
    /// `linear` into the scratch buffer, then `add_rmsnorm`: the SIMT GEMV (sm_7x) or cuBLAS
    /// (more than GEMV_ROUTE_MAX_M rows, prefill) has no such epilogue.
    TwoKernels,
}

/// The route for `rows` rows of width `n` (the hidden size) over K = `k`, in GEMV form `form`
/// under the built-in per-shape table (`add_norm_route_for` of the form's kernel for the
/// weight), with all of the norm's buffers 16-byte aligned or not.
pub fn add_norm_route(form: GemvForm, rows: usize, n: usize, k: usize, aligned: bool) -> AddNormRoute {
    add_norm_route_for(gemv_kernel(form, None, n, k, rows), rows, n, k, aligned, CC_ADD_NORM_DEFAULT)
}

/// The route when the plain GEMV of the [n, k] weight runs `kernel` (`gemv_kernel`) and
/// `NINFER_CC_ADD_NORM` is `cc_add_norm`: the one place that decides it. The fused kernels are
/// the GEMV the plain one of the weight runs (the tensor-core instance, rows up to GEMV_MAX_M;
/// the CUDA-core kernel at one row, under the switch), with K % 8 == 0, whose last block
/// normalises whole rows with 16-byte accesses (n % 8 == 0, aligned rows). Otherwise the two
/// kernels; every route gives the plain GEMV + add_rmsnorm bits (`NINFER_FUSED_NORM` on == off).
pub fn add_norm_route_for(kernel: GemvKernel, rows: usize, n: usize, k: usize, aligned: bool, cc_add_norm: bool) -> AddNormRoute {
    let fits = (1..=GEMV_MAX_M).contains(&rows) && k.is_multiple_of(8) && n.is_multiple_of(8) && aligned;
    match kernel {
        GemvKernel::TensorCores(_) if fits => AddNormRoute::Fused,
        GemvKernel::CudaCores if fits && rows == 1 && cc_add_norm => AddNormRoute::FusedCudaCores,
        _ => AddNormRoute::TwoKernels,
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
        match (add_norm_route_for(kernel, rows, n, k, aligned, self.cc_add_norm()), kernel) {
            (AddNormRoute::FusedCudaCores, _) => self.gemv_add_rmsnorm_m1(x, w, residual, norm_w, h, arrivals, n, k, eps, plus_one),
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
    /// The batch-1 CUDA-core form of `gemv_add_rmsnorm` (`gemv_add_rmsnorm_m1`), whatever
    /// `NINFER_CC_ADD_NORM` says (the route calls it under the switch; tests call it directly):
    /// gemv_m1 into a buffer then `add_rmsnorm`, bit for bit, in one kernel. Needs n and k
    /// multiples of 8 and 16-byte aligned residual, norm weight and h (a typed error otherwise).
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_add_rmsnorm_m1(
        &self,
        x: &impl DevicePtr<u16>,
        w: &impl DevicePtr<u16>,
        residual: &mut impl DevicePtrMut<u16>,
        norm_w: &impl DevicePtr<u16>,
        h: &mut impl DevicePtrMut<u16>,
        arrivals: &mut impl DevicePtrMut<u32>,
        n: usize,
        k: usize,
        eps: f32,
        plus_one: bool,
    ) -> Result<()> {
        check_len("gemv_add_rmsnorm_m1 x", x.len(), k)?;
        check_len("gemv_add_rmsnorm_m1 w", w.len(), n * k)?;
        check_len("gemv_add_rmsnorm_m1 residual", residual.len(), n)?;
        check_len("gemv_add_rmsnorm_m1 norm weight", norm_w.len(), n)?;
        check_len("gemv_add_rmsnorm_m1 h", h.len(), n)?;
        check_len("gemv_add_rmsnorm_m1 arrivals", arrivals.len(), 1)?;
        let s = self.stream();
        let (xp, _a) = x.device_ptr(s);
        let (wp, _b) = w.device_ptr(s);
        let (rp, _c) = residual.device_ptr_mut(s);
        let (np, _d) = norm_w.device_ptr(s);
        let (hp, _e) = h.device_ptr_mut(s);
        let (ap, _f) = arrivals.device_ptr_mut(s);
        if !(n.is_multiple_of(8) && k.is_multiple_of(8) && [rp, np, hp].iter().all(|p| p % 16 == 0)) {
            return Err(NinferError::Device(format!(
                "gemv_add_rmsnorm_m1 needs N and K multiples of 8 and 16-byte aligned rows, got N = {n}, K = {k}"
            )));
        }
        let name = "gemv_add_rmsnorm_m1";
        let f = self.function(KernelFamily::Gemv, name)?;
        let args = [
            KArg::Ptr(xp),
            KArg::Ptr(wp),
            KArg::Ptr(rp),
            KArg::I32(as_i32("gemv_add_rmsnorm_m1 n", n)?),
            KArg::I32(as_i32("gemv_add_rmsnorm_m1 k", k)?),
            KArg::I32(self.cc_prefetch().vectors(n, k) as i32),
            KArg::Ptr(np),
            KArg::Ptr(hp),
            KArg::Ptr(ap),
            // add_rmsnorm's block size for rows of n: the lanes of its sum order.
            KArg::I32(chunked_norm_threads(n) as i32),
            KArg::F32(eps),
            KArg::I32(plus_one as i32),
        ];
        let grid = (as_i32("gemv_add_rmsnorm_m1 n", n.div_ceil(CC_COLS))? as u32, 1, 1);
        self.launch_pdl(&f, cfg(grid, (CC_COLS * 32) as u32), name, &args)
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

    #[test]
    fn the_cuda_core_fused_route_is_batch_1_under_its_switch() {
        let cc = GemvKernel::CudaCores;
        assert_eq!(add_norm_route_for(cc, 1, 4096, 14336, true, true), AddNormRoute::FusedCudaCores);
        assert_eq!(add_norm_route_for(cc, 1, 4096, 14336, true, false), AddNormRoute::TwoKernels);
        for (rows, n, k, aligned) in [(2, 4096, 4096, true), (0, 4096, 4096, true), (1, 4100, 4096, true), (1, 4096, 4100, true), (1, 4096, 4096, false)] {
            assert_eq!(add_norm_route_for(cc, rows, n, k, aligned, true), AddNormRoute::TwoKernels, "rows {rows} n {n} k {k} aligned {aligned}");
        }
        // The switch never moves a tensor-core weight.
        let w4 = crate::backend::cuda::ops::GemvTcConfig { warps: 4, unroll: 4, hold: false };
        assert_eq!(add_norm_route_for(GemvKernel::TensorCores(w4), 1, 4096, 4096, true, true), AddNormRoute::Fused);
    }
}
