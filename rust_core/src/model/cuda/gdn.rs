//! Gated DeltaNet sub-block of a `CudaModel` layer.

use cudarc::driver::CudaSlice;

use crate::backend::cuda::ops::{ConvShape, KeptShape, RecurrentShape};
use crate::backend::cuda::CudaDevice;
use crate::config::ModelConfig;
use crate::Result;

use super::buffers::{buf, buf_mut, Activations};
use super::residual::{NormNext, ProjIn};
use super::route::{GdnKernels, GdnRoute};
use super::step_meta::StepMeta;
use super::weights::DevGdn;

/// One GDN layer's recurrent state on the device: the conv and delta buffers of every slot.
pub(super) struct GdnState<'a> {
    pub(super) conv: &'a mut CudaSlice<u16>,
    pub(super) delta: &'a mut CudaSlice<f32>,
    /// Slots the buffers hold (the engine's and the decode padding slot).
    pub(super) n_slots: usize,
}

/// Where a keeping step copies its verify chunks' recurrence inputs (model/cuda/replay.rs):
/// kept row r takes step row `rows[r]` (none where negative) into this layer's `kept`.
pub(super) struct KeepRows<'a> {
    pub(super) rows: &'a CudaSlice<i32>,
    pub(super) shape: KeptShape,
    pub(super) kept: &'a mut CudaSlice<u16>,
}

/// Gated DeltaNet sub-block over all sequences of the step at once: reads `act.h`, projects it
/// (q, k, v, z, b, a in one GEMM / GEMV into `act.proj`), runs the kernels
/// `GdnRoute::kernels` gives the step's longest chunk `max_rows`, and ends with
/// `Activations::project_out`. With `keep`, the projection's kept rows are copied out first.
#[allow(clippy::too_many_arguments)]
pub(super) fn gdn_layer(cfg: &ModelConfig, dev: &CudaDevice, meta: &StepMeta, g: &DevGdn, route: &GdnRoute, state: GdnState<'_>, act: &mut Activations, rows: usize, max_rows: usize, then: &NormNext, keep: Option<KeepRows<'_>>) -> Result<()> {
    let GdnState { conv, delta, n_slots } = state;
    let la = cfg.linear_attention.expect("GDN layer without linear_attention config");
    let (cd, kd, vd, nv) = (la.conv_dim(), la.key_dim(), la.value_dim(), la.num_value_heads);
    // One projection: row t of act.proj is q | k | v (conv channels), z, b, a (DevGdn::in_proj).
    let width = g.in_proj.n;
    g.in_proj.forward(dev, buf(&act.h), buf_mut(&mut act.proj), buf_mut(&mut act.lin32), rows)?;
    let proj = buf(&act.proj);
    if let Some(k) = keep {
        dev.gdn_keep_rows(proj, width, rows, k.rows, cd + vd, &k.shape, k.kept)?;
    }
    let cu = meta.cu_seqlens();
    let slots = meta.slots();
    let conv_shape = ConvShape { n_tokens: rows, channels: cd, x_stride: width, kernel_size: la.conv_kernel, n_slots };
    let bias = g.conv_b.as_ref().map(|b| b as &dyn crate::backend::cuda::ops::DevicePtrDyn);
    let (z, b, a) = (proj.slice(cd..), proj.slice(cd + vd..), proj.slice(cd + vd + nv..));
    let shape = RecurrentShape {
        n_tokens: rows,
        n_k_heads: la.num_key_heads,
        n_v_heads: nv,
        dk: la.key_head_dim,
        dv: la.value_head_dim,
        qk_stride: cd,
        v_stride: cd,
        n_slots,
    };
    match route.kernels(max_rows, slots.len()) {
        GdnKernels::ConvRecurrentGated => {
            let tickets = buf_mut(&mut act.gdn_tickets);
            dev.gdn_conv_recurrent_gated(proj, conv, &g.conv_w, bias, &conv_shape, tickets, &a, &b, width, &g.a_log, &g.dt_bias, delta, &cu, &slots, &z, width, &g.norm, cfg.rms_norm_eps, buf_mut(&mut act.mix), &shape)?;
        }
        kernels => {
            dev.causal_conv1d(proj, conv, &g.conv_w, bias, &cu, &slots, buf_mut(&mut act.conv_out), &conv_shape)?;
            let co = buf(&act.conv_out);
            let (q, k, v) = (co.slice(0..), co.slice(kd..), co.slice(2 * kd..));
            dev.gdn_gates(&a, &b, width, &g.a_log, &g.dt_bias, buf_mut(&mut act.g), buf_mut(&mut act.beta), rows, nv)?;
            if kernels == GdnKernels::Chunked {
                dev.gdn_chunked(&q, &k, &v, buf(&act.g), buf(&act.beta), delta, &cu, &slots, buf_mut(&mut act.core), buf_mut(&mut act.gdn_work), &shape)?;
            } else {
                dev.gdn_recurrent(&q, &k, &v, buf(&act.g), buf(&act.beta), delta, &cu, &slots, buf_mut(&mut act.core), &shape)?;
            }
            dev.rmsnorm_gated(buf(&act.core), &z, width, &g.norm, buf_mut(&mut act.mix), rows, nv, la.value_head_dim, cfg.rms_norm_eps)?;
        }
    }
    act.project_out(dev, &g.out, ProjIn::Mix, rows, then)
}
