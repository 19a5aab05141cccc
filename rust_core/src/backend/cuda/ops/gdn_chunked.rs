//! Chunked Gated DeltaNet prefill launcher (cuda/gdn_chunked.cu): the same contract as
//! `gdn_recurrent` (inputs, f32 state slots, outputs), computed 64 tokens at a time by two
//! kernels: a chunk-parallel preparation that writes the state-independent W, U, M and
//! per-token scales to a caller-owned workspace, then a scan over each sequence's chunks.

use cudarc::driver::sys::CUfunction_attribute_enum;
use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig};

use super::gdn::{check_delta_rule, RecurrentShape};
use super::{as_i32, check_len};
use crate::backend::cuda::device::{driver_err, CudaDevice};
use crate::backend::cuda::kernels::KernelFamily;
use crate::Result;

/// Tokens per chunk (CH_C), threads per block (CH_THREADS) and value columns per scan block
/// (CH_COLS) of gdn_chunked.cu.
const CH_C: usize = 64;
const CH_THREADS: u32 = 128;
const CH_COLS: usize = 32;
/// Threads per block of the eight-warp scan (CHW_THREADS).
const CHW_THREADS: u32 = 256;

/// Dynamic shared memory of a prep block in bytes: the k tile, the q tile (at least
/// CH_THREADS columns wide: it then holds the substitution's columns), A and five per-token
/// vectors (the layout at the top of prep_body).
fn prep_smem_bytes(dk: usize) -> usize {
    4 * (CH_C * (dk + 1) + CH_C * (dk + 1).max(CH_THREADS as usize) + CH_C * CH_C + 5 * CH_C)
}

/// Dynamic shared memory of a tensor-core prep block in bytes (`PrepTcLayout` in
/// gdn_chunked.cu): A (64 rows of 68 f32), five per-token vectors, the raw q tile (64 rows of
/// dk + 8 storage elements) sharing its space with the solved columns (64 x CH_THREADS f32),
/// then the raw k tile.
fn prep_tc_smem_bytes(dk: usize) -> usize {
    let rows = 2 * CH_C * (dk + 8);
    4 * (CH_C * (CH_C + 4) + 5 * CH_C) + rows.max(4 * CH_C * CH_THREADS as usize) + rows
}

/// Dynamic shared memory of a scan block in bytes: the state slice, the Q and W/K tiles, M
/// and u (the layout at the top of scan_body).
fn scan_smem_bytes(dk: usize) -> usize {
    4 * (dk * (CH_COLS + 1) + 2 * CH_C * (dk + 1) + CH_C * (CH_C + 1) + CH_C * (CH_COLS + 1))
}

/// Dynamic shared memory of a pipelined scan block in bytes (`PipeLayout` in gdn_chunked.cu):
/// the state slice and u (32 f32 columns each), then per warp its W rows (dk + 4 f32) and M rows
/// (68 f32) for 16 tokens, its raw q rows (dk + 8 storage elements) and its dk / 4 raw k columns
/// (+ 8) for the 64 tokens.
fn pipe_smem_bytes(dk: usize) -> usize {
    let warps = CH_THREADS as usize / 32;
    let rows = CH_C / warps;
    // State and u tiles transposed, rows of 4 mod 32 words (cuda/gdn_chunked.cu PipeLayout).
    4 * (CH_COLS * (dk + 4) + CH_COLS * (CH_C + 4) + warps * rows * (dk + 4 + CH_C + 4)) + 2 * (warps * rows * (dk + 8) + warps * CH_C * (dk / warps + 8))
}

/// Dynamic shared memory of an eight-warp scan block in bytes (`WideLayout` in gdn_chunked.cu):
/// the state slice and u as the pipelined scan's, then the chunk's W rows (dk + 4 f32), M rows
/// (68 f32) and per-token scales (4 f32), and its raw q and k rows (dk + 8 storage elements
/// each), one tile of each.
fn wide_smem_bytes(dk: usize) -> usize {
    4 * (CH_COLS * (dk + 4) + CH_COLS * (CH_C + 4) + CH_C * (dk + 4 + CH_C + 4 + 4)) + 2 * 2 * CH_C * (dk + 8)
}

impl RecurrentShape {
    /// f32 elements of the workspace `gdn_chunked` needs for `n_tokens` packed tokens: per
    /// token and value head W (dk), U (dv), M (64) and 4 scales.
    pub fn chunked_workspace_len(n_tokens: usize, n_v_heads: usize, dk: usize, dv: usize) -> usize {
        n_tokens * n_v_heads * (dk + dv + CH_C + 4)
    }
}

/// Which kernel runs the chunk scan's three products per chunk (u = U - W S, o = e^G Q S + M u,
/// S' = e^{G_last} S + K'^T u). The state stays f32 in both.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScanForm {
    /// `gdn_chunk_scan_dk*`: f32 FMAs on CUDA cores, 4 x 4 register tiles per thread.
    Simt,
    /// `gdn_chunk_scan_tc_dk*`: mma.sync m16n8k8 with tf32 operands (10 mantissa bits) and f32
    /// accumulation, sm_80+; compiled as the SIMT scan below sm_80.
    TensorCores,
    /// `gdn_chunk_scan_pipe_dk*`: the tensor-core products with each warp's operands staged
    /// by cp.async a chunk ahead (loads overlap the products instead of preceding them), sm_80+;
    /// compiled as the SIMT scan below sm_80. Needs 16-byte aligned q, k and workspace and a
    /// q/k row stride of a multiple of 8 elements; `gdn_chunked_via` runs `TensorCores`
    /// otherwise. Its fragments are read by ldmatrix from tiles whose state and u are kept as
    /// tf32 bits (cuda/gdn_chunked.cu says why).
    Pipelined,
    /// `gdn_chunk_scan_wide_dk*`: the pipelined scan's products over 8 warps a block instead
    /// of 4 (each warp half of every product), its tiles copied by the whole block; the same
    /// bits as `Pipelined`, sm_80+ (`Simt` below), with `Pipelined`'s alignment needs and a
    /// 4-byte aligned output (`TensorCores` runs otherwise).
    Wide,
}

/// Which kernel prepares each chunk's W, U, M and scales (`gdn_chunked`'s first kernel). Both
/// solve the triangular system in f32 on CUDA cores; they differ in how A and M are formed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrepForm {
    /// `gdn_chunk_prep_dk*`: A = K K^T and M = Q K^T as f32 dot products on CUDA cores over the
    /// normalised rows.
    Simt,
    /// `gdn_chunk_prep_tc_dk*`: A and M as mma.sync m16n8k16 on the raw storage-type q / k rows
    /// (exact products, f32 accumulation; the norms scale the f32 results), the substitution
    /// reading A four entries per shared load; sm_80+ (the launcher runs `Simt` below).
    TensorCores,
}

/// The scan of each key head size the chunked kernels take, chosen once per device by the plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GdnScanForms {
    /// For key heads of 64.
    pub dk64: ScanForm,
    /// For key heads of 128.
    pub dk128: ScanForm,
}

impl GdnScanForms {
    /// The default scans of a device of compute capability major `cc_major` whose blocks may opt
    /// into `smem_optin` bytes: tensor cores from sm_80 on, the eight-warp form where its shared
    /// memory fits (every sm_80+ part that runs the chunked kernels), else the pipelined one.
    pub fn for_device(cc_major: u32, smem_optin: usize) -> GdnScanForms {
        let form = |dk: usize| {
            if cc_major < 8 {
                ScanForm::Simt
            } else if wide_smem_bytes(dk) <= smem_optin {
                ScanForm::Wide
            } else if pipe_smem_bytes(dk) <= smem_optin {
                ScanForm::Pipelined
            } else {
                ScanForm::TensorCores
            }
        };
        GdnScanForms { dk64: form(64), dk128: form(128) }
    }

    /// The scan for key head size `dk` (the 128 kernels serve every size but 64).
    pub fn for_dk(&self, dk: usize) -> ScanForm {
        if dk == 64 { self.dk64 } else { self.dk128 }
    }
}

impl CudaDevice {
    /// The prep `gdn_chunked` runs here: the plan's (tensor cores from sm_80 on).
    pub fn gdn_prep_form(&self) -> PrepForm {
        self.plan().gdn_prep
    }

    /// The scan `gdn_chunked` runs here for key head size `dk`: the plan's (`GdnScanForms`).
    pub fn gdn_scan_form(&self, dk: usize) -> ScanForm {
        self.plan().gdn_scan.for_dk(dk)
    }

    /// Whether `gdn_chunked` runs the chunked kernels for key head size `dk` here: the scan
    /// needs more shared memory per block than sm_70/sm_86/sm_89 give for dk = 128 (106 KiB).
    pub fn has_gdn_chunked(&self, dk: usize) -> bool {
        matches!(dk, 64 | 128) && prep_smem_bytes(dk).max(scan_smem_bytes(dk)) <= self.smem_optin()
    }

    /// The gated delta rule of `gdn_recurrent` in its chunked form: same arguments plus an f32
    /// workspace of at least `RecurrentShape::chunked_workspace_len` elements, same results (q/k
    /// L2-normalised inside, q scaled by dk^-1/2, each sequence's f32 state slot read at the
    /// start and written back). Falls back to the recurrent kernel where the device lacks the
    /// shared memory (see `has_gdn_chunked`); the workspace is then unused.
    #[allow(clippy::too_many_arguments)]
    pub fn gdn_chunked(
        &self,
        q: &impl DevicePtr<u16>,
        k: &impl DevicePtr<u16>,
        v: &impl DevicePtr<u16>,
        g: &impl DevicePtr<f32>,
        beta: &impl DevicePtr<f32>,
        state: &mut impl DevicePtrMut<f32>,
        cu_seqlens: &impl DevicePtr<i32>,
        slots: &impl DevicePtr<i32>,
        out: &mut impl DevicePtrMut<u16>,
        work: &mut impl DevicePtrMut<f32>,
        shape: &RecurrentShape,
    ) -> Result<()> {
        self.gdn_chunked_via(self.gdn_scan_form(shape.dk), q, k, v, g, beta, state, cu_seqlens, slots, out, work, shape)
    }

    /// `gdn_chunked` with the scan kernel chosen by the caller and this device's prep
    /// (`gdn_prep_form`).
    #[allow(clippy::too_many_arguments)]
    pub fn gdn_chunked_via(
        &self,
        form: ScanForm,
        q: &impl DevicePtr<u16>,
        k: &impl DevicePtr<u16>,
        v: &impl DevicePtr<u16>,
        g: &impl DevicePtr<f32>,
        beta: &impl DevicePtr<f32>,
        state: &mut impl DevicePtrMut<f32>,
        cu_seqlens: &impl DevicePtr<i32>,
        slots: &impl DevicePtr<i32>,
        out: &mut impl DevicePtrMut<u16>,
        work: &mut impl DevicePtrMut<f32>,
        shape: &RecurrentShape,
    ) -> Result<()> {
        self.gdn_chunked_forms(form, self.gdn_prep_form(), q, k, v, g, beta, state, cu_seqlens, slots, out, work, shape)
    }

    /// `gdn_chunked` with both kernels chosen by the caller (the op-parity tests run every pair).
    #[allow(clippy::too_many_arguments)]
    pub fn gdn_chunked_forms(
        &self,
        form: ScanForm,
        prep: PrepForm,
        q: &impl DevicePtr<u16>,
        k: &impl DevicePtr<u16>,
        v: &impl DevicePtr<u16>,
        g: &impl DevicePtr<f32>,
        beta: &impl DevicePtr<f32>,
        state: &mut impl DevicePtrMut<f32>,
        cu_seqlens: &impl DevicePtr<i32>,
        slots: &impl DevicePtr<i32>,
        out: &mut impl DevicePtrMut<u16>,
        work: &mut impl DevicePtrMut<f32>,
        shape: &RecurrentShape,
    ) -> Result<()> {
        self.gdn_chunked_launch(form, Some(prep), true, q, k, v, g, beta, state, cu_seqlens, slots, out, work, shape)
    }

    /// Only the prep of `gdn_chunked_forms` (fills the workspace; state and output untouched):
    /// the prep forms' timing. Same checks; does nothing where the chunked kernels do not run.
    #[allow(clippy::too_many_arguments)]
    pub fn gdn_chunked_prep_only(
        &self,
        prep: PrepForm,
        q: &impl DevicePtr<u16>,
        k: &impl DevicePtr<u16>,
        v: &impl DevicePtr<u16>,
        g: &impl DevicePtr<f32>,
        beta: &impl DevicePtr<f32>,
        state: &mut impl DevicePtrMut<f32>,
        cu_seqlens: &impl DevicePtr<i32>,
        slots: &impl DevicePtr<i32>,
        out: &mut impl DevicePtrMut<u16>,
        work: &mut impl DevicePtrMut<f32>,
        shape: &RecurrentShape,
    ) -> Result<()> {
        if !self.has_gdn_chunked(shape.dk) {
            return Ok(());
        }
        self.gdn_chunked_launch(ScanForm::Simt, Some(prep), false, q, k, v, g, beta, state, cu_seqlens, slots, out, work, shape)
    }

    /// Only the scan of `gdn_chunked_via`, over a workspace that a `gdn_chunked_via` call with
    /// the same arguments filled: the scan forms' timing (the state moves on with each call).
    /// Same checks and fallback.
    #[allow(clippy::too_many_arguments)]
    pub fn gdn_chunked_scan_only(
        &self,
        form: ScanForm,
        q: &impl DevicePtr<u16>,
        k: &impl DevicePtr<u16>,
        v: &impl DevicePtr<u16>,
        g: &impl DevicePtr<f32>,
        beta: &impl DevicePtr<f32>,
        state: &mut impl DevicePtrMut<f32>,
        cu_seqlens: &impl DevicePtr<i32>,
        slots: &impl DevicePtr<i32>,
        out: &mut impl DevicePtrMut<u16>,
        work: &mut impl DevicePtrMut<f32>,
        shape: &RecurrentShape,
    ) -> Result<()> {
        self.gdn_chunked_launch(form, None, true, q, k, v, g, beta, state, cu_seqlens, slots, out, work, shape)
    }

    /// Runs the prep (`prep`, if any) then the scan (if `with_scan`).
    #[allow(clippy::too_many_arguments)]
    fn gdn_chunked_launch(
        &self,
        form: ScanForm,
        prep: Option<PrepForm>,
        with_scan: bool,
        q: &impl DevicePtr<u16>,
        k: &impl DevicePtr<u16>,
        v: &impl DevicePtr<u16>,
        g: &impl DevicePtr<f32>,
        beta: &impl DevicePtr<f32>,
        state: &mut impl DevicePtrMut<f32>,
        cu_seqlens: &impl DevicePtr<i32>,
        slots: &impl DevicePtr<i32>,
        out: &mut impl DevicePtrMut<u16>,
        work: &mut impl DevicePtrMut<f32>,
        shape: &RecurrentShape,
    ) -> Result<()> {
        let sh = shape;
        if !self.has_gdn_chunked(sh.dk) {
            return self.gdn_recurrent(q, k, v, g, beta, state, cu_seqlens, slots, out, sh);
        }
        let lens = [q.len(), k.len(), v.len(), g.len(), beta.len(), state.len(), cu_seqlens.len(), slots.len(), out.len()];
        let n_seqs = check_delta_rule(sh, lens)?;
        check_len("gdn workspace", work.len(), RecurrentShape::chunked_workspace_len(sh.n_tokens, sh.n_v_heads, sh.dk, sh.dv))?;
        if sh.n_tokens == 0 || n_seqs == 0 {
            return Ok(());
        }
        let s = self.stream();
        let (qp, _a) = q.device_ptr(s);
        let (kp, _b) = k.device_ptr(s);
        let (vp, _c) = v.device_ptr(s);
        let (gp, _d) = g.device_ptr(s);
        let (bp, _e) = beta.device_ptr(s);
        let (sp, _f) = state.device_ptr_mut(s);
        let (cp, _g) = cu_seqlens.device_ptr(s);
        let (lp, _h) = slots.device_ptr(s);
        let (op, _i) = out.device_ptr_mut(s);
        let (wp, _j) = work.device_ptr_mut(s);
        // The pipelined scan's 16-byte copies need aligned rows; the plain tensor-core scan
        // takes any layout.
        let aligned = (qp | kp | wp).is_multiple_of(16) && sh.qk_stride.is_multiple_of(8);
        let form = match form {
            ScanForm::Wide if self.compute_capability().0 < 8 => ScanForm::Simt,
            // (and it stores two output columns at a time)
            ScanForm::Wide if !aligned || !op.is_multiple_of(4) || wide_smem_bytes(sh.dk) > self.smem_optin() => ScanForm::TensorCores,
            ScanForm::Pipelined if !aligned || pipe_smem_bytes(sh.dk) > self.smem_optin() => ScanForm::TensorCores,
            f => f,
        };
        let (prep_name, scan_name, scan_smem) = match (sh.dk, form) {
            (64, ScanForm::Simt) => ("gdn_chunk_prep_dk64", "gdn_chunk_scan_dk64", scan_smem_bytes(64)),
            (64, ScanForm::TensorCores) => ("gdn_chunk_prep_dk64", "gdn_chunk_scan_tc_dk64", scan_smem_bytes(64)),
            (64, ScanForm::Pipelined) => ("gdn_chunk_prep_dk64", "gdn_chunk_scan_pipe_dk64", pipe_smem_bytes(64)),
            (_, ScanForm::Simt) => ("gdn_chunk_prep_dk128", "gdn_chunk_scan_dk128", scan_smem_bytes(128)),
            (_, ScanForm::TensorCores) => ("gdn_chunk_prep_dk128", "gdn_chunk_scan_tc_dk128", scan_smem_bytes(128)),
            (_, ScanForm::Pipelined) => ("gdn_chunk_prep_dk128", "gdn_chunk_scan_pipe_dk128", pipe_smem_bytes(128)),
            (64, ScanForm::Wide) => ("gdn_chunk_prep_dk64", "gdn_chunk_scan_wide_dk64", wide_smem_bytes(64)),
            (_, ScanForm::Wide) => ("gdn_chunk_prep_dk128", "gdn_chunk_scan_wide_dk128", wide_smem_bytes(128)),
        };
        let scan_threads = if form == ScanForm::Wide { CHW_THREADS } else { CH_THREADS };
        // Below sm_80 the tensor-core prep is compiled as the SIMT one, whose shared memory it
        // then needs: run the SIMT prep by name there.
        let (prep_name, prep_smem) = match prep {
            Some(PrepForm::TensorCores) if self.compute_capability().0 >= 8 => {
                (if sh.dk == 64 { "gdn_chunk_prep_tc_dk64" } else { "gdn_chunk_prep_tc_dk128" }, prep_tc_smem_bytes(sh.dk))
            }
            _ => (prep_name, prep_smem_bytes(sh.dk)),
        };
        let prep_fn = self.function(KernelFamily::GdnChunked, prep_name)?;
        let scan = self.function(KernelFamily::GdnChunked, scan_name)?;
        prep_fn
            .set_attribute(CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, prep_smem as i32)
            .map_err(driver_err("raising the GDN chunk-prep shared-memory limit"))?;
        scan.set_attribute(CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, scan_smem as i32)
            .map_err(driver_err("raising the GDN chunk-scan shared-memory limit"))?;
        let (n_seqs_i, n_tokens) = (as_i32("n_seqs", n_seqs)?, as_i32("n_tokens", sh.n_tokens)?);
        let (nk, nv, dv) = (as_i32("n_k_heads", sh.n_k_heads)?, as_i32("n_v_heads", sh.n_v_heads)?, as_i32("dv", sh.dv)?);
        let prep_args = kargs![
            qp,
            kp,
            sh.qk_stride as i64,
            vp,
            sh.v_stride as i64,
            gp,
            bp,
            cp,
            n_seqs_i,
            nk,
            nv,
            dv,
            n_tokens,
            wp,
        ];
        // Every sequence has at most ceil(len / 64) chunks, so this bounds the chunk count;
        // blocks past the last chunk return at once.
        let max_chunks = as_i32("gdn chunks", sh.n_tokens.div_ceil(CH_C) + n_seqs)? as u32;
        let config = LaunchConfig { grid_dim: (max_chunks, sh.n_v_heads as u32, 1), block_dim: (CH_THREADS, 1, 1), shared_mem_bytes: prep_smem as u32 };
        if prep.is_some() {
            self.launch(&prep_fn, config, prep_name, &prep_args)?;
        }
        if !with_scan {
            return Ok(());
        }
        let scan_args = kargs![
            qp,
            kp,
            sh.qk_stride as i64,
            wp,
            sp,
            cp,
            lp,
            nk,
            nv,
            dv,
            n_tokens,
            op,
        ];
        let grid = ((sh.dv / CH_COLS) as u32, sh.n_v_heads as u32, n_seqs_i as u32);
        let config = LaunchConfig { grid_dim: grid, block_dim: (scan_threads, 1, 1), shared_mem_bytes: scan_smem as u32 };
        self.launch(&scan, config, scan_name, &scan_args)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The pipelined scan's layout at dk 128 is 114,688 bytes: two blocks fit an sm_90 SM
    /// (228 KiB, 1 KiB reserved per block), so the 27B shape's 192 scan blocks stay one wave
    /// on an H200's 132 SMs, as the plain scan's 108,032 did.
    #[test]
    fn pipelined_scan_keeps_two_blocks_per_sm90_sm() {
        assert_eq!(pipe_smem_bytes(128), 114_688);
        assert_eq!(scan_smem_bytes(128), 108_032);
        assert!(2 * (pipe_smem_bytes(128) + 1024) <= 228 * 1024);
        assert!(pipe_smem_bytes(64) < pipe_smem_bytes(128));
    }

    /// The tensor-core prep's layout at dk 128 is 68,864 bytes: three blocks fit an sm_90 SM
    /// (the SIMT prep's 83,712 fit two), and it never needs more than the SIMT prep, so
    /// `has_gdn_chunked` (sized by the SIMT prep and the scan) covers it.
    /// The eight-warp scan's layout at dk 128 is 112,640 bytes: two of its blocks fit an
    /// sm_90 SM too (its launch bounds cap the registers at 128 for the same reason).
    #[test]
    fn eight_warp_scan_keeps_two_blocks_per_sm90_sm() {
        assert_eq!(wide_smem_bytes(128), 112_640);
        assert_eq!(wide_smem_bytes(64), 71_680);
        assert!(2 * (wide_smem_bytes(128) + 1024) <= 228 * 1024);
    }

    #[test]
    fn tensor_core_prep_fits_three_blocks_per_sm90_sm() {
        assert_eq!(prep_tc_smem_bytes(128), 68_864);
        assert_eq!(prep_smem_bytes(128), 83_712);
        assert!(3 * (prep_tc_smem_bytes(128) + 1024) <= 228 * 1024);
        for dk in [64, 128] {
            assert!(prep_tc_smem_bytes(dk) <= prep_smem_bytes(dk));
        }
    }
}
