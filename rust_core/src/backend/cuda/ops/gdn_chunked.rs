//! Chunked Gated DeltaNet prefill launcher (cuda/gdn_chunked.cu): the same contract as
//! `gdn_recurrent` (inputs, f32 state slots, outputs), computed 64 tokens at a time.

use cudarc::driver::sys::{CUdevice_attribute_enum, CUfunction_attribute_enum};
use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig};

use super::gdn::RecurrentShape;
use super::{as_i32, check_len, strided_len, KArg};
use crate::backend::cuda::device::{driver_err, CudaDevice};
use crate::backend::cuda::kernels::KernelFamily;
use crate::{NinferError, Result};

/// Tokens per chunk (CH_C), threads per block (CH_THREADS) and value columns per block
/// (CH_COLS) of gdn_chunked.cu.
const CH_C: usize = 64;
const CH_THREADS: u32 = 128;
const CH_COLS: usize = 32;

/// Dynamic shared memory of one block in bytes: the q and k tiles, A and QK, the state slice,
/// U and three per-token vectors (the layout at the top of chunked_body).
fn smem_bytes(dk: usize) -> usize {
    4 * (2 * CH_C * (dk + 1) + 2 * CH_C * (CH_C + 1) + (dk + CH_C) * (CH_COLS + 1) + 3 * CH_C)
}

impl CudaDevice {
    /// Whether `gdn_chunked` runs the chunked kernel for key head size `dk` here: it needs
    /// more shared memory per block than sm_86/sm_89 give for dk = 128 (about 123 KiB).
    pub fn has_gdn_chunked(&self, dk: usize) -> bool {
        let optin = self
            .context()
            .attribute(CUdevice_attribute_enum::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .unwrap_or(0);
        matches!(dk, 64 | 128) && smem_bytes(dk) <= optin.max(0) as usize
    }

    /// The gated delta rule of `gdn_recurrent` in its chunked form: same arguments, same
    /// results (q/k L2-normalised inside, q scaled by dk^-1/2, each sequence's f32 state slot
    /// read at the start and written back). Falls back to the recurrent kernel where the
    /// device lacks the shared memory (see `has_gdn_chunked`).
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
        shape: &RecurrentShape,
    ) -> Result<()> {
        let sh = shape;
        if !self.has_gdn_chunked(sh.dk) {
            return self.gdn_recurrent(q, k, v, g, beta, state, cu_seqlens, slots, out, sh);
        }
        let name = if sh.dk == 64 { "gdn_chunked_dk64" } else { "gdn_chunked_dk128" };
        if cu_seqlens.len() != slots.len() + 1 {
            return Err(NinferError::Device(format!(
                "gdn: cu_seqlens has {} entries for {} sequences (needs n_seqs + 1)",
                cu_seqlens.len(),
                slots.len()
            )));
        }
        if !sh.dv.is_multiple_of(CH_COLS) || sh.n_k_heads == 0 || !sh.n_v_heads.is_multiple_of(sh.n_k_heads) {
            return Err(NinferError::Device(format!(
                "gdn: dv {} must be a multiple of 32 and {} v heads a multiple of {} k heads",
                sh.dv, sh.n_v_heads, sh.n_k_heads
            )));
        }
        let t = sh.n_tokens;
        check_len("gdn q", q.len(), strided_len(t, sh.n_k_heads * sh.dk, sh.qk_stride))?;
        check_len("gdn k", k.len(), strided_len(t, sh.n_k_heads * sh.dk, sh.qk_stride))?;
        check_len("gdn v", v.len(), strided_len(t, sh.n_v_heads * sh.dv, sh.v_stride))?;
        check_len("gdn g", g.len(), t * sh.n_v_heads)?;
        check_len("gdn beta", beta.len(), t * sh.n_v_heads)?;
        check_len("gdn state", state.len(), sh.n_slots * sh.n_v_heads * sh.dk * sh.dv)?;
        check_len("gdn out", out.len(), t * sh.n_v_heads * sh.dv)?;
        let smem = smem_bytes(sh.dk);
        let f = self.function(KernelFamily::GdnChunked, name)?;
        f.set_attribute(CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32)
            .map_err(driver_err("raising the chunked GDN shared-memory limit"))?;
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
        let args = [
            KArg::Ptr(qp),
            KArg::Ptr(kp),
            KArg::I64(sh.qk_stride as i64),
            KArg::Ptr(vp),
            KArg::I64(sh.v_stride as i64),
            KArg::Ptr(gp),
            KArg::Ptr(bp),
            KArg::Ptr(sp),
            KArg::Ptr(cp),
            KArg::Ptr(lp),
            KArg::I32(as_i32("n_k_heads", sh.n_k_heads)?),
            KArg::I32(as_i32("n_v_heads", sh.n_v_heads)?),
            KArg::I32(as_i32("dv", sh.dv)?),
            KArg::Ptr(op),
        ];
        let grid = ((sh.dv / CH_COLS) as u32, sh.n_v_heads as u32, as_i32("n_seqs", slots.len())? as u32);
        let config = LaunchConfig { grid_dim: grid, block_dim: (CH_THREADS, 1, 1), shared_mem_bytes: smem as u32 };
        self.launch(&f, config, name, &args)
    }
}
