//! Launchers of the GDN state replay kernels (cuda/gdn.cu, `ModelRunner::replay_states`): the
//! copy of a verify chunk's recurrence inputs out of the fused input projection, and the
//! rebuild of states from them.

use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig};

use super::gdn::{DevicePtrDyn, RecurrentShape, GATED_MAX_DV};
use super::{as_i32, cfg, check_len, strided_len};
use crate::backend::cuda::device::CudaDevice;
use crate::backend::cuda::kernels::KernelFamily;
use crate::{NinferError, Result};

/// The layout of kept rows: each `channels` conv inputs then b and a (`n_v_heads` each).
#[derive(Debug, Clone, Copy)]
pub struct KeptShape {
    /// The GDN conv channels (2 * key_dim + value_dim).
    pub channels: usize,
    pub n_v_heads: usize,
}

impl KeptShape {
    /// Elements of one kept row.
    pub fn width(&self) -> usize {
        self.channels + 2 * self.n_v_heads
    }
}

impl CudaDevice {
    /// Copy into kept row r, for every r with `rows[r] >= 0`, step row `rows[r]` of `x` (the
    /// fused input projection, `x_stride` wide): its conv channels and the b, a columns at
    /// `ab_offset`; `x` holds `n_rows` rows, which every source row is below (the caller wrote
    /// `rows`). One launch over all of `rows` (its length fixed, so a captured graph keeps it;
    /// rows without a source are skipped).
    #[allow(clippy::too_many_arguments)]
    pub fn gdn_keep_rows(&self, x: &impl DevicePtr<u16>, x_stride: usize, n_rows: usize, rows: &impl DevicePtr<i32>, ab_offset: usize, sh: &KeptShape, kept: &mut impl DevicePtrMut<u16>) -> Result<()> {
        let width = sh.width();
        if ab_offset < sh.channels || ab_offset + 2 * sh.n_v_heads > x_stride {
            return Err(NinferError::Device(format!("gdn_keep_rows: b / a at {ab_offset} outside rows of {x_stride} past {} channels", sh.channels)));
        }
        check_len("gdn_keep_rows kept", kept.len(), rows.len() * width)?;
        check_len("gdn_keep_rows x", x.len(), strided_len(n_rows, x_stride, x_stride))?;
        if rows.len() == 0 {
            return Ok(());
        }
        let f = self.function(KernelFamily::Gdn, "gdn_keep_rows")?;
        let s = self.stream();
        let (xp, _a) = x.device_ptr(s);
        let (rp, _b) = rows.device_ptr(s);
        let (kp, _c) = kept.device_ptr_mut(s);
        let args = kargs![xp, x_stride as i64, rp, as_i32("channels", sh.channels)?, as_i32("ab_offset", ab_offset)?, as_i32("n_v_heads", sh.n_v_heads)?, kp];
        let grid = (width.div_ceil(256) as u32, as_i32("kept rows", rows.len())? as u32, 1);
        self.launch_pdl(&f, cfg(grid, 256), "gdn_keep_rows", &args)
    }

    /// Rebuild states from kept rows: replay s (`params[4 s..4 s + 4]`: first kept row, tokens,
    /// source slot, destination slot) gives the destination slot's conv and delta state the
    /// source's advanced over its kept rows, with the forward's per-token arithmetic (conv,
    /// `gdn_gate`, the recurrent delta rule), the source read once and the destination written
    /// once. No destination may be any replay's source. `kept_rows` bounds the rows `params`
    /// may name (checked on the host by the caller, which wrote them).
    #[allow(clippy::too_many_arguments)]
    pub fn gdn_replay(
        &self,
        kept: &impl DevicePtr<u16>,
        kept_rows: usize,
        params: &impl DevicePtr<i32>,
        n_replays: usize,
        conv_state: &mut impl DevicePtrMut<u16>,
        conv_w: &impl DevicePtr<u16>,
        conv_b: Option<&dyn DevicePtrDyn>,
        kernel_size: usize,
        a_log: &impl DevicePtr<f32>,
        dt_bias: &impl DevicePtr<f32>,
        state: &mut impl DevicePtrMut<f32>,
        sh: &RecurrentShape,
    ) -> Result<()> {
        let name = match (sh.dk, kernel_size) {
            (64, 2) => "gdn_replay_dk64_k2",
            (64, 3) => "gdn_replay_dk64_k3",
            (64, 4) => "gdn_replay_dk64_k4",
            (128, 2) => "gdn_replay_dk128_k2",
            (128, 3) => "gdn_replay_dk128_k3",
            (128, 4) => "gdn_replay_dk128_k4",
            (d, k) => return Err(NinferError::Unsupported(format!("CUDA GDN replay with key head dim {d}, conv kernel {k}"))),
        };
        if sh.dv > GATED_MAX_DV || sh.dv % 32 != 0 || sh.n_k_heads == 0 || sh.n_v_heads % sh.n_k_heads != 0 {
            return Err(NinferError::Unsupported(format!("CUDA GDN replay with value head dim {} ({} value heads over {} key heads)", sh.dv, sh.n_v_heads, sh.n_k_heads)));
        }
        let kd = sh.n_k_heads * sh.dk;
        let channels = 2 * kd + sh.n_v_heads * sh.dv;
        let ks = KeptShape { channels, n_v_heads: sh.n_v_heads };
        check_len("gdn_replay kept", kept.len(), kept_rows * ks.width())?;
        check_len("gdn_replay params", params.len(), 4 * n_replays)?;
        check_len("gdn_replay conv_state", conv_state.len(), sh.n_slots * channels * (kernel_size - 1))?;
        check_len("gdn_replay conv_w", conv_w.len(), channels * kernel_size)?;
        if let Some(b) = conv_b {
            check_len("gdn_replay conv_b", b.elems(), channels)?;
        }
        check_len("gdn_replay A_log", a_log.len(), sh.n_v_heads)?;
        check_len("gdn_replay dt_bias", dt_bias.len(), sh.n_v_heads)?;
        check_len("gdn_replay state", state.len(), sh.n_slots * sh.n_v_heads * sh.dk * sh.dv)?;
        if n_replays == 0 {
            return Ok(());
        }
        let f = self.function(KernelFamily::Gdn, name)?;
        let s = self.stream();
        let (kp, _a) = kept.device_ptr(s);
        let (pp, _b) = params.device_ptr(s);
        let (cp, _c) = conv_state.device_ptr_mut(s);
        let (wp, _d) = conv_w.device_ptr(s);
        let bp = conv_b.map(|b| b.raw_ptr(s)).unwrap_or(0);
        let (alp, _e) = a_log.device_ptr(s);
        let (dtp, _f) = dt_bias.device_ptr(s);
        let (sp, _g) = state.device_ptr_mut(s);
        let args = kargs![
            kp,
            as_i32("width", ks.width())?,
            as_i32("key dim", kd)?,
            pp,
            cp,
            wp,
            bp,
            alp,
            dtp,
            sp,
            as_i32("n_k_heads", sh.n_k_heads)?,
            as_i32("n_v_heads", sh.n_v_heads)?,
            as_i32("dv", sh.dv)?,
        ];
        let grid = (sh.n_v_heads as u32, as_i32("replays", n_replays)? as u32, 1);
        let config = LaunchConfig { grid_dim: grid, block_dim: (sh.dv as u32, 1, 1), shared_mem_bytes: 0 };
        self.launch_pdl(&f, config, name, &args)
    }
}
