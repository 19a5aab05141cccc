//! Chunked Gated DeltaNet prefill launcher (cuda/gdn_chunked.cu): the same contract as
//! `gdn_recurrent` (inputs, f32 state slots, outputs), computed 64 tokens at a time.

use cudarc::driver::sys::{CUdevice_attribute_enum, CUfunction_attribute_enum};
use cudarc::driver::{DevicePtr, DevicePtrMut};

use super::gdn::RecurrentShape;
use crate::backend::cuda::device::{driver_err, CudaDevice};
use crate::backend::cuda::kernels::KernelFamily;
use crate::Result;

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
        let smem = smem_bytes(sh.dk);
        let f = self.function(KernelFamily::GdnChunked, name)?;
        f.set_attribute(CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32)
            .map_err(driver_err("raising the chunked GDN shared-memory limit"))?;
        // The grid's 32 value columns per block are CH_COLS.
        self.delta_rule_launch(&f, name, CH_THREADS, smem as u32, q, k, v, g, beta, state, cu_seqlens, slots, out, sh)
    }
}
