//! Decode GEMV launcher (cuda/gemv.cu): y[M, N] = x[M, K] * W[N, K]^T for small M.

use cudarc::driver::{DevicePtr, DevicePtrMut};

use super::{as_i32, cfg, check_len, strided_len, KArg};
use crate::backend::cuda::device::CudaDevice;
use crate::backend::cuda::kernels::KernelFamily;
use crate::{NinferError, Result};

/// Output columns per block (warps per block in gemv.cu).
const GEMV_WARPS: usize = 8;
/// Largest M one launch handles; larger M is split into launches of this many rows.
pub const GEMV_MAX_M: usize = 8;
/// Largest M that `linear` sends to the GEMV kernel; above it cuBLAS. Up to GEMV_MAX_M the
/// kernel's per-row summation order does not depend on M (each row keeps its own f32 chain over
/// the same weight loads, then the same warp reduction), so a sequence decoded in a batch of up
/// to 8 gets bit-identical projections, and hence logits, to the same sequence decoded alone.
/// cuBLAS picks its algorithm (and summation order) by M, which would break that. Measured on
/// the H200 at 14336x4096 bf16 (benches/results/gpu_op_parity.json): GEMV 3.79 / 3.20 / 2.93 /
/// 1.56 TB/s at M = 1 / 2 / 4 / 8 against cuBLAS 3.54 / 3.54 / 3.83 / 3.59.
pub const GEMV_ROUTE_MAX_M: usize = GEMV_MAX_M;
/// Largest M whose SwiGLU MLP runs its down projection as `gemv_swiglu` (the activation folded
/// into the GEMV) instead of the swiglu kernel and `linear`. The two routes give the same bits,
/// so this is a speed choice only: every block computes the activations of all M rows, which
/// costs most at M = 5..8, where the grid has the fewest blocks (4 columns per warp).
pub const GEMV_SWIGLU_ROUTE_MAX_M: usize = GEMV_ROUTE_MAX_M;

/// Output columns one warp computes in the kernel for `m` rows (the C of each GEMV_INSTANCE
/// in gemv.cu, which this must match): sharing each x load between C weight rows keeps
/// multi-row GEMV from being bound by re-reading x; one row keeps one column per warp for
/// more warps in flight.
fn cols_per_warp(m: usize) -> usize {
    match m {
        1 => 1,
        2..=4 => 2,
        _ => 4,
    }
}

const NAMES: [&str; GEMV_MAX_M] =
    ["gemv_m1", "gemv_m2", "gemv_m3", "gemv_m4", "gemv_m5", "gemv_m6", "gemv_m7", "gemv_m8"];
const NAMES_SWIGLU: [&str; GEMV_MAX_M] = [
    "gemv_swiglu_m1",
    "gemv_swiglu_m2",
    "gemv_swiglu_m3",
    "gemv_swiglu_m4",
    "gemv_swiglu_m5",
    "gemv_swiglu_m6",
    "gemv_swiglu_m7",
    "gemv_swiglu_m8",
];
const NAMES_F32: [&str; GEMV_MAX_M] = [
    "gemv_f32out_m1",
    "gemv_f32out_m2",
    "gemv_f32out_m3",
    "gemv_f32out_m4",
    "gemv_f32out_m5",
    "gemv_f32out_m6",
    "gemv_f32out_m7",
    "gemv_f32out_m8",
];

impl CudaDevice {
    #[allow(clippy::too_many_arguments)]
    fn gemv_launch(
        &self,
        x: u64,
        w: u64,
        y: u64,
        y_elem_bytes: u64,
        m: usize,
        n: usize,
        k: usize,
        f32_out: bool,
    ) -> Result<()> {
        if !k.is_multiple_of(8) {
            return Err(NinferError::Device(format!(
                "gemv needs K to be a multiple of 8 (16-byte loads), got K = {k}"
            )));
        }
        let mut row = 0;
        while row < m {
            let mm = (m - row).min(GEMV_MAX_M);
            let grid = (as_i32("gemv n", n.div_ceil(GEMV_WARPS * cols_per_warp(mm)))? as u32, 1, 1);
            let name = if f32_out { NAMES_F32[mm - 1] } else { NAMES[mm - 1] };
            let f = self.function(KernelFamily::Gemv, name)?;
            let args = [
                KArg::Ptr(x + (row * k * 2) as u64),
                KArg::Ptr(w),
                KArg::Ptr(y + (row * n) as u64 * y_elem_bytes),
                KArg::I32(as_i32("gemv n", n)?),
                KArg::I32(as_i32("gemv k", k)?),
            ];
            self.launch_pdl(&f, cfg(grid, (GEMV_WARPS * 32) as u32), name, &args)?;
            row += mm;
        }
        Ok(())
    }

    /// y[M, N] (storage type) = x[M, K] * W[N, K]^T, reading W once per 8 rows of x. For
    /// decode (small M); K must be a multiple of 8 and all buffers 16-byte aligned.
    pub fn gemv(
        &self,
        x: &impl DevicePtr<u16>,
        w: &impl DevicePtr<u16>,
        y: &mut impl DevicePtrMut<u16>,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<()> {
        check_len("gemv x", x.len(), m * k)?;
        check_len("gemv w", w.len(), n * k)?;
        check_len("gemv y", y.len(), m * n)?;
        let s = self.stream();
        let (xp, _a) = x.device_ptr(s);
        let (wp, _b) = w.device_ptr(s);
        let (yp, _c) = y.device_ptr_mut(s);
        self.gemv_launch(xp, wp, yp, 2, m, n, k, false)
    }

    /// y[M, N] = x[M, K] * W[N, K]^T by the faster route for M: the GEMV kernel for
    /// M <= GEMV_ROUTE_MAX_M (and K % 8 == 0), cuBLAS otherwise.
    pub fn linear(
        &self,
        x: &impl DevicePtr<u16>,
        w: &impl DevicePtr<u16>,
        y: &mut impl DevicePtrMut<u16>,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<()> {
        if m <= GEMV_ROUTE_MAX_M && k.is_multiple_of(8) {
            self.gemv(x, w, y, m, n, k)
        } else {
            self.gemm(x, w, y, m, n, k)
        }
    }

    /// As `linear` with f32 output (the lm_head producing logits): GEMV up to
    /// GEMV_ROUTE_MAX_M rows, cuBLAS above.
    pub fn linear_f32_out(
        &self,
        x: &impl DevicePtr<u16>,
        w: &impl DevicePtr<u16>,
        y: &mut impl DevicePtrMut<f32>,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<()> {
        if m <= GEMV_ROUTE_MAX_M && k.is_multiple_of(8) {
            self.gemv_f32_out(x, w, y, m, n, k)
        } else {
            self.gemm_f32_out(x, w, y, m, n, k)
        }
    }

    /// As `gemv` with f32 output (the lm_head producing logits).
    pub fn gemv_f32_out(
        &self,
        x: &impl DevicePtr<u16>,
        w: &impl DevicePtr<u16>,
        y: &mut impl DevicePtrMut<f32>,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<()> {
        check_len("gemv x", x.len(), m * k)?;
        check_len("gemv w", w.len(), n * k)?;
        check_len("gemv y", y.len(), m * n)?;
        let s = self.stream();
        let (xp, _a) = x.device_ptr(s);
        let (wp, _b) = w.device_ptr(s);
        let (yp, _c) = y.device_ptr_mut(s);
        self.gemv_launch(xp, wp, yp, 4, m, n, k, true)
    }

    /// The down projection of a SwiGLU MLP with the activation folded in:
    /// y[M, N] = (silu(gate) * up)[M, K] * W[N, K]^T, gate and up read in place from the fused
    /// gate_up projection (row r's gate at `gate_up[r * gu_stride..]`, its up K elements
    /// later). Bit for bit what `swiglu` followed by `gemv` gives (the activation is rounded to
    /// the storage type where swiglu stores it), one kernel instead of two. M <= GEMV_MAX_M
    /// (decode); K and `gu_stride` multiples of 8, buffers 16-byte aligned.
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_swiglu(
        &self,
        gate_up: &impl DevicePtr<u16>,
        w: &impl DevicePtr<u16>,
        y: &mut impl DevicePtrMut<u16>,
        m: usize,
        n: usize,
        k: usize,
        gu_stride: usize,
    ) -> Result<()> {
        if m > GEMV_MAX_M || !k.is_multiple_of(8) || !gu_stride.is_multiple_of(8) || gu_stride < 2 * k {
            return Err(NinferError::Device(format!(
                "gemv_swiglu needs M <= {GEMV_MAX_M}, K and the gate_up row stride multiples of 8 \
                 and the stride >= 2K (16-byte loads of gate and up), got M = {m}, K = {k}, stride = {gu_stride}"
            )));
        }
        if m == 0 {
            return Ok(());
        }
        check_len("gemv_swiglu gate_up", gate_up.len(), strided_len(m, 2 * k, gu_stride))?;
        check_len("gemv_swiglu w", w.len(), n * k)?;
        check_len("gemv_swiglu y", y.len(), m * n)?;
        let s = self.stream();
        let (gp, _a) = gate_up.device_ptr(s);
        let (wp, _b) = w.device_ptr(s);
        let (yp, _c) = y.device_ptr_mut(s);
        let grid = (as_i32("gemv n", n.div_ceil(GEMV_WARPS * cols_per_warp(m)))? as u32, 1, 1);
        let name = NAMES_SWIGLU[m - 1];
        let f = self.function(KernelFamily::Gemv, name)?;
        let args = [
            KArg::Ptr(gp),
            KArg::Ptr(gp + (k * 2) as u64),
            KArg::I64(gu_stride as i64),
            KArg::Ptr(wp),
            KArg::Ptr(yp),
            KArg::I32(as_i32("gemv n", n)?),
            KArg::I32(as_i32("gemv k", k)?),
        ];
        self.launch_pdl(&f, cfg(grid, (GEMV_WARPS * 32) as u32), name, &args)
    }
}
