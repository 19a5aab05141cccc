//! Decode GEMV launcher: y[M, N] = x[M, K] * W[N, K]^T for small M, on tensor cores
//! (cuda/gemv_tc.cu) from sm_80 on, on CUDA cores (cuda/gemv.cu) below.

use cudarc::driver::{DevicePtr, DevicePtrMut};

use super::{as_i32, cfg, check_len, KArg};
use crate::backend::cuda::device::CudaDevice;
use crate::backend::cuda::kernels::KernelFamily;
use crate::{NinferError, Result};

/// Output columns per block (warps per block in gemv.cu).
const GEMV_WARPS: usize = 8;
/// Threads per block of the tensor-core GEMV (GEMV_TC_WARPS warps in gemv_tc.cu, splitting K).
const GEMV_TC_THREADS: u32 = 8 * 32;
/// Largest M one launch handles; larger M is split into launches of this many rows.
pub const GEMV_MAX_M: usize = 8;
/// Largest M that `linear` sends to the GEMV kernel; above it cuBLAS. Up to GEMV_MAX_M the
/// kernel's per-row summation order does not depend on M (each row keeps its own f32 chain over
/// the same weight loads, then the same warp reduction), so a sequence decoded in a batch of up
/// to 8 gets bit-identical projections, and hence logits, to the same sequence decoded alone.
/// cuBLAS picks its algorithm (and summation order) by M, which would break that. Both GEMV
/// forms keep it (each on its own; a device runs one form for every M, `gemv_form`). Measured on
/// the H200 at 14336x4096 bf16 (benches/results/perf_ops_71d15e5.log): SIMT GEMV 3.70 / 3.33 /
/// 2.68 / 1.15 TB/s at M = 1 / 2 / 4 / 8 against cuBLAS 3.74 / 3.56 / 3.83 / 3.84.
pub const GEMV_ROUTE_MAX_M: usize = GEMV_MAX_M;

/// Which kernel runs the decode GEMV.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemvForm {
    /// cuda/gemv.cu: f32 FMAs on CUDA cores, a warp per 1 / 2 / 4 output columns by M. Bound by
    /// instruction issue from M = 4 on (2 M FLOP per weight element plus conversions).
    Simt,
    /// cuda/gemv_tc.cu: mma.sync m16n8k16 (storage-type inputs, f32 accumulation), a block of 8
    /// warps per 16 weight rows with K split across the warps; the same code for every M of 1..8,
    /// so the weight stream, not the products, bounds every M. sm_80+.
    TensorCores,
}

/// The GEMV form for compute capability `cc`: tensor cores from sm_80 on (m16n8k16 with bf16
/// inputs), CUDA cores below. The one place that decides it; every `gemv*` launcher asks here.
pub fn gemv_form(cc: (u32, u32)) -> GemvForm {
    if cc.0 >= 8 {
        GemvForm::TensorCores
    } else {
        GemvForm::Simt
    }
}

/// The environment switch that turns the tensor-core GEMV off (A/B measurements, and a way back
/// to the CUDA-core kernel should a driver mis-run the mma path).
pub const TC_GEMV_SWITCH: &str = "NINFER_TC_GEMV";

/// `gemv_form(cc)`, or `Simt` when `NINFER_TC_GEMV` (value `switch`) is off; a misspelt value
/// is an error naming the variable. Read once per device (`CudaDevice::gemv_form`), so a
/// sequence's projections never change form mid-run (batch == alone holds within a form).
pub fn gemv_form_with_switch(cc: (u32, u32), switch: Option<&str>) -> Result<GemvForm> {
    let on = crate::config::env_switch::parse_switch(TC_GEMV_SWITCH, switch, true)?;
    Ok(if on { gemv_form(cc) } else { GemvForm::Simt })
}
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

/// Gate/up pairs (output columns of the activation) one warp computes in
/// `gemv_gateup_swiglu_m*` for `m` rows: the kernel's SC (weight rows per warp, the GEMV_INSTANCE
/// macro in gemv.cu) is cols_per_warp rounded up to a pair, and each pair is two weight rows.
fn pairs_per_warp(m: usize) -> usize {
    cols_per_warp(m).div_ceil(2)
}

/// What the GEMV kernel stores: the three epilogues of gemv_body (GEMV_OUT_* in gemv.cu).
#[derive(Clone, Copy)]
enum GemvOut {
    /// y[M, N] in the storage type.
    Store,
    /// y[M, N] in f32.
    F32,
    /// act[M, N] = silu(gate) * up of the fused gate_up weight's rows n and N + n.
    SwiGlu,
}

impl GemvOut {
    fn name(self, m: usize) -> &'static str {
        match self {
            GemvOut::Store => NAMES[m - 1],
            GemvOut::F32 => NAMES_F32[m - 1],
            GemvOut::SwiGlu => NAMES_GATEUP_SWIGLU[m - 1],
        }
    }

    /// The tensor-core kernel of this epilogue (one for every M).
    fn tc_name(self) -> &'static str {
        match self {
            GemvOut::Store => "gemv_tc",
            GemvOut::F32 => "gemv_tc_f32out",
            GemvOut::SwiGlu => "gemv_tc_gateup_swiglu",
        }
    }

    /// Output columns one tensor-core block covers: a tile of 16 weight rows, which for SwiGLU
    /// is 8 gate rows and their 8 up rows (gemv_tc_cols in gemv_tc.cu).
    fn tc_cols_per_block(self) -> usize {
        match self {
            GemvOut::Store | GemvOut::F32 => 16,
            GemvOut::SwiGlu => 8,
        }
    }

    /// Output columns one block covers for `m` rows.
    fn cols_per_block(self, m: usize) -> usize {
        GEMV_WARPS
            * match self {
                GemvOut::Store | GemvOut::F32 => cols_per_warp(m),
                GemvOut::SwiGlu => pairs_per_warp(m),
            }
    }

    fn elem_bytes(self) -> u64 {
        match self {
            GemvOut::F32 => 4,
            GemvOut::Store | GemvOut::SwiGlu => 2,
        }
    }
}

const NAMES: [&str; GEMV_MAX_M] =
    ["gemv_m1", "gemv_m2", "gemv_m3", "gemv_m4", "gemv_m5", "gemv_m6", "gemv_m7", "gemv_m8"];
const NAMES_GATEUP_SWIGLU: [&str; GEMV_MAX_M] = [
    "gemv_gateup_swiglu_m1",
    "gemv_gateup_swiglu_m2",
    "gemv_gateup_swiglu_m3",
    "gemv_gateup_swiglu_m4",
    "gemv_gateup_swiglu_m5",
    "gemv_gateup_swiglu_m6",
    "gemv_gateup_swiglu_m7",
    "gemv_gateup_swiglu_m8",
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
    /// Launches the GEMV of form `form` with epilogue `out` over `m` rows, GEMV_MAX_M rows per
    /// launch; `n` is the number of output columns (the activation width for SwiGlu).
    #[allow(clippy::too_many_arguments)]
    fn gemv_launch(&self, form: GemvForm, x: u64, w: u64, y: u64, out: GemvOut, m: usize, n: usize, k: usize) -> Result<()> {
        if !k.is_multiple_of(8) {
            return Err(NinferError::Device(format!(
                "gemv needs K to be a multiple of 8 (16-byte loads), got K = {k}"
            )));
        }
        if form == GemvForm::TensorCores && self.compute_capability().0 < 8 {
            return Err(NinferError::Device(format!(
                "the tensor-core GEMV needs sm_80 or newer, this device is {}",
                self.arch()
            )));
        }
        let mut row = 0;
        while row < m {
            let mm = (m - row).min(GEMV_MAX_M);
            let xr = x + (row * k * 2) as u64;
            let yr = y + (row * n) as u64 * out.elem_bytes();
            match form {
                GemvForm::Simt => {
                    let grid = (as_i32("gemv n", n.div_ceil(out.cols_per_block(mm)))? as u32, 1, 1);
                    let name = out.name(mm);
                    let f = self.function(KernelFamily::Gemv, name)?;
                    let args = [
                        KArg::Ptr(xr),
                        KArg::Ptr(w),
                        KArg::Ptr(yr),
                        KArg::I32(as_i32("gemv n", n)?),
                        KArg::I32(as_i32("gemv k", k)?),
                    ];
                    self.launch_pdl(&f, cfg(grid, (GEMV_WARPS * 32) as u32), name, &args)?;
                }
                GemvForm::TensorCores => {
                    let grid = (as_i32("gemv n", n.div_ceil(out.tc_cols_per_block()))? as u32, 1, 1);
                    let name = out.tc_name();
                    let f = self.function(KernelFamily::GemvTc, name)?;
                    let args = [
                        KArg::Ptr(xr),
                        KArg::Ptr(w),
                        KArg::Ptr(yr),
                        KArg::I32(mm as i32),
                        KArg::I32(as_i32("gemv n", n)?),
                        KArg::I32(as_i32("gemv k", k)?),
                    ];
                    self.launch_pdl(&f, cfg(grid, GEMV_TC_THREADS), name, &args)?;
                }
            }
            row += mm;
        }
        Ok(())
    }

    /// y[M, N] (storage type) = x[M, K] * W[N, K]^T, reading W once per 8 rows of x, in this
    /// device's `gemv_form`. For decode (small M); K must be a multiple of 8 and all buffers
    /// 16-byte aligned.
    pub fn gemv(
        &self,
        x: &impl DevicePtr<u16>,
        w: &impl DevicePtr<u16>,
        y: &mut impl DevicePtrMut<u16>,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<()> {
        self.gemv_with(self.gemv_form(), x, w, y, m, n, k)
    }

    /// As `gemv` in the given form (tests and the throughput report compare the forms;
    /// TensorCores on a device below sm_80 is an error).
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_with(
        &self,
        form: GemvForm,
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
        self.gemv_launch(form, xp, wp, yp, GemvOut::Store, m, n, k)
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
        self.gemv_f32_out_with(self.gemv_form(), x, w, y, m, n, k)
    }

    /// As `gemv_f32_out` in the given form.
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_f32_out_with(
        &self,
        form: GemvForm,
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
        self.gemv_launch(form, xp, wp, yp, GemvOut::F32, m, n, k)
    }

    /// The gate_up projection of a SwiGLU MLP with the activation in its epilogue:
    /// act[M, inter] = silu(x W_gate^T) * (x W_up^T), where `w_gate_up` is the fused [2 * inter, K]
    /// weight the loader packs (gate rows, then up rows). Bit for bit what `gemv` into a
    /// [M, 2 * inter] buffer followed by `swiglu` gives (each sum is rounded to the storage type
    /// where the GEMV stores it), with one kernel and one gate_up round trip less; the weight
    /// stream is the plain GEMV's. For decode (small M; any M runs, in launches of GEMV_MAX_M
    /// rows); K must be a multiple of 8 and all buffers 16-byte aligned.
    pub fn gemv_gateup_swiglu(
        &self,
        x: &impl DevicePtr<u16>,
        w_gate_up: &impl DevicePtr<u16>,
        act: &mut impl DevicePtrMut<u16>,
        m: usize,
        inter: usize,
        k: usize,
    ) -> Result<()> {
        self.gemv_gateup_swiglu_with(self.gemv_form(), x, w_gate_up, act, m, inter, k)
    }

    /// As `gemv_gateup_swiglu` in the given form (bit for bit `gemv_with` of the same form
    /// followed by swiglu).
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_gateup_swiglu_with(
        &self,
        form: GemvForm,
        x: &impl DevicePtr<u16>,
        w_gate_up: &impl DevicePtr<u16>,
        act: &mut impl DevicePtrMut<u16>,
        m: usize,
        inter: usize,
        k: usize,
    ) -> Result<()> {
        check_len("gemv_gateup_swiglu x", x.len(), m * k)?;
        check_len("gemv_gateup_swiglu w", w_gate_up.len(), 2 * inter * k)?;
        check_len("gemv_gateup_swiglu act", act.len(), m * inter)?;
        let s = self.stream();
        let (xp, _a) = x.device_ptr(s);
        let (wp, _b) = w_gate_up.device_ptr(s);
        let (ap, _c) = act.device_ptr_mut(s);
        self.gemv_launch(form, xp, wp, ap, GemvOut::SwiGlu, m, inter, k)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tc_gemv_switch_picks_the_form_and_rejects_a_misspelt_value() {
        assert_eq!(gemv_form_with_switch((9, 0), None).unwrap(), GemvForm::TensorCores);
        assert_eq!(gemv_form_with_switch((9, 0), Some("0")).unwrap(), GemvForm::Simt);
        assert_eq!(gemv_form_with_switch((9, 0), Some("on")).unwrap(), GemvForm::TensorCores);
        // On will not force the mma path onto a device without it.
        assert_eq!(gemv_form_with_switch((7, 5), Some("1")).unwrap(), GemvForm::Simt);
        let e = gemv_form_with_switch((9, 0), Some("tc")).unwrap_err().to_string();
        assert!(e.contains(TC_GEMV_SWITCH) && e.contains("tc"), "{e}");
    }
}
