//! Decode GEMV launchers: y[M, N] = x[M, K] * W[N, K]^T for small M, in the kernel the plan
//! routes each weight shape to (gemv_route.rs): tensor cores (cuda/gemv_tc.cu) or CUDA cores
//! (cuda/gemv.cu); and `linear`, which sends larger M to cuBLAS.

use cudarc::driver::{DevicePtr, DevicePtrMut};

use super::gemv_route::{gemv_launch_spec, GemvForm, GemvOut, GEMV_MAX_M, GEMV_ROUTE_MAX_M};
use super::{cfg, check_len, KernelArg};
use crate::backend::cuda::device::CudaDevice;
use crate::backend::cuda::kernels::KernelFamily;
use crate::{NinferError, Result};

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
        if form != GemvForm::Simt && self.compute_capability().0 < 8 {
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
            let l = gemv_launch_spec(self.plan(), form, out, mm, n, k)?;
            let f = self.function(l.family, l.name)?;
            let mut args = kargs![xr, w, yr, 0i32, 0i32, 0i32, 0i32, 0i32];
            for (slot, &v) in args[3..].iter_mut().zip(l.ints()) {
                *slot = v.karg();
            }
            self.launch_pdl(&f, cfg((l.grid, 1, 1), l.block), l.name, &args[..3 + l.ints().len()])?;
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
    /// GEMV_ROUTE_MAX_M rows, cuBLAS above. With `round`, every output is rounded to the
    /// storage type and kept as f32 (logits_dtype "auto", model/logits_dtype.rs): in the GEMV's
    /// epilogue (decode of up to 8 rows gains no kernel), and after cuBLAS by
    /// `round_f32_to_storage` in place (one elementwise kernel for prefill and for decode
    /// batches above 8 rows; cuBLAS writing the storage type instead would round the same sums
    /// identically but needs a second buffer and a widening kernel all the same).
    #[allow(clippy::too_many_arguments)]
    pub fn linear_f32_out(
        &self,
        x: &impl DevicePtr<u16>,
        w: &impl DevicePtr<u16>,
        y: &mut impl DevicePtrMut<f32>,
        m: usize,
        n: usize,
        k: usize,
        round: bool,
    ) -> Result<()> {
        if m <= GEMV_ROUTE_MAX_M && k.is_multiple_of(8) {
            self.gemv_f32_out_round_with(self.gemv_form(), x, w, y, m, n, k, round)
        } else {
            self.gemm_f32_out(x, w, y, m, n, k)?;
            if round {
                self.round_f32_to_storage(y, m * n)?;
            }
            Ok(())
        }
    }

    /// y[M, N] = x[M, K] * W[N, K]^T + bias[N] in the storage type, rounded once after the
    /// bias is added (as torch's addmm rounds): the f32 sums of `linear_f32_out` into `y32`
    /// (at least M x N), then `add_bias_to_storage`. For the projections of checkpoints with
    /// biases; the fused epilogues (RoPE, SwiGLU, residual + norm) run only without one.
    #[allow(clippy::too_many_arguments)]
    pub fn linear_bias(
        &self,
        x: &impl DevicePtr<u16>,
        w: &impl DevicePtr<u16>,
        bias: &impl DevicePtr<u16>,
        y32: &mut impl DevicePtrMut<f32>,
        y: &mut impl DevicePtrMut<u16>,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<()> {
        check_len("linear_bias bias", bias.len(), n)?;
        check_len("linear_bias y32", y32.len(), m * n)?;
        check_len("linear_bias y", y.len(), m * n)?;
        if m == 0 {
            return Ok(());
        }
        self.linear_f32_out(x, w, y32, m, n, k, false)?;
        let s = self.stream();
        let (sp, _a) = y32.device_ptr_mut(s);
        let (bp, _b) = bias.device_ptr(s);
        let (yp, _c) = y.device_ptr_mut(s);
        let f = self.function(KernelFamily::Gemv, "add_bias_to_storage")?;
        let args = kargs![sp, bp, yp, m as i64, n as i64];
        self.launch(&f, cfg(super::elementwise::elementwise_grid(m * n), 256), "add_bias_to_storage", &args)
    }

    /// Rounds the first `len` values of `y` to the storage type in place, kept as f32
    /// (`round_st` of common.cuh, round-to-nearest-even: what the GEMV's `round_out` does).
    pub fn round_f32_to_storage(&self, y: &mut impl DevicePtrMut<f32>, len: usize) -> Result<()> {
        check_len("round_f32_to_storage y", y.len(), len)?;
        if len == 0 {
            return Ok(());
        }
        let s = self.stream();
        let (yp, _c) = y.device_ptr_mut(s);
        // Four values a thread where y allows 16-byte accesses (the logits buffers do), so a
        // quarter of the threads; at most enough blocks to fill the device several times over
        // (the kernels stride past them).
        const THREADS: usize = 256;
        const MAX_BLOCKS: usize = 1 << 16;
        let (name, per_thread) = if yp.is_multiple_of(16) { ("round_f32_to_storage_v4", 4) } else { ("round_f32_to_storage", 1) };
        let grid = (len.div_ceil(per_thread * THREADS).min(MAX_BLOCKS) as u32, 1, 1);
        let f = self.function(KernelFamily::Gemv, name)?;
        let args = kargs![yp, len as i64];
        self.launch(&f, cfg(grid, THREADS as u32), name, &args)
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
        self.gemv_f32_out_round_with(form, x, w, y, m, n, k, false)
    }

    /// As `gemv_f32_out_with`, each output rounded to the storage type (kept as f32) in the
    /// kernel's epilogue when `round`: bit for bit the unrounded output rounded afterwards.
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_f32_out_round_with(
        &self,
        form: GemvForm,
        x: &impl DevicePtr<u16>,
        w: &impl DevicePtr<u16>,
        y: &mut impl DevicePtrMut<f32>,
        m: usize,
        n: usize,
        k: usize,
        round: bool,
    ) -> Result<()> {
        check_len("gemv x", x.len(), m * k)?;
        check_len("gemv w", w.len(), n * k)?;
        check_len("gemv y", y.len(), m * n)?;
        let s = self.stream();
        let (xp, _a) = x.device_ptr(s);
        let (wp, _b) = w.device_ptr(s);
        let (yp, _c) = y.device_ptr_mut(s);
        self.gemv_launch(form, xp, wp, yp, GemvOut::F32(round), m, n, k)
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
