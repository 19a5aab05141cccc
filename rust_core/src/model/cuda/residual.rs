//! The end of every sub-block: its output projection, added into the residual stream and
//! followed by the RMSNorm of the next sub-block (`Activations::project_out`), and the plain
//! projection (`linear`) the sub-blocks also run.

use cudarc::driver::CudaSlice;

use crate::backend::cuda::CudaDevice;
use crate::Result;

use super::buffers::{buf, buf_mut, Activations};
use super::weights::DevLinear;

/// The residual add + RMSNorm that follows a sub-block's output projection.
pub(super) struct NormNext<'a> {
    /// The norm's weight: the post-attention norm, the next layer's input norm or the final
    /// norm. None leaves the projection in `act.tmp` (the last layer of a prefill step).
    pub(super) w: Option<&'a CudaSlice<u16>>,
    pub(super) eps: f32,
    pub(super) plus_one: bool,
    /// `CudaModel::fused_norm`: `gemv_add_rmsnorm`, else `linear` + `add_rmsnorm`.
    pub(super) fused: bool,
}

/// The activation buffer a sub-block's output projection reads.
#[derive(Clone, Copy)]
pub(super) enum ProjIn {
    /// The mixer output (attention, GDN).
    Mix,
    /// The MLP activation.
    Act,
}

impl Activations {
    /// A sub-block's output projection of `input` for `rows` rows, then `then`: residual
    /// `x` += projection and `h` = rmsnorm(x), in one kernel where `gemv_add_rmsnorm` can
    /// (tensor-core decode GEMV), else `linear` into `tmp` and `add_rmsnorm`, bit for bit the
    /// same; with no norm, the projection is left in `tmp`.
    pub(super) fn project_out(&mut self, dev: &CudaDevice, l: &DevLinear, input: ProjIn, rows: usize, then: &NormNext) -> Result<()> {
        let Activations { x, h, tmp, mix, act, norm_arrivals, lin32, .. } = self;
        let src = buf(match input {
            ProjIn::Mix => mix,
            ProjIn::Act => act,
        });
        match then.w {
            None => linear(dev, l, src, buf_mut(tmp), lin32, rows),
            Some(w) if then.fused && l.bias.is_none() => dev.gemv_add_rmsnorm(src, &l.w, buf_mut(tmp), buf_mut(x), w, buf_mut(h), buf_mut(norm_arrivals), rows, l.n, l.k, then.eps, then.plus_one),
            Some(w) => {
                linear(dev, l, src, buf_mut(tmp), lin32, rows)?;
                dev.add_rmsnorm(buf_mut(x), buf(tmp), w, buf_mut(h), rows, l.n, then.eps, then.plus_one)
            }
        }
    }
}

/// `y = x · Wᵀ (+ bias)` for `rows` rows (GEMV up to 8 rows, cuBLAS above); a bias is added
/// to the f32 sums in `lin32` and rounded once (`CudaDevice::linear_bias`).
pub(super) fn linear(dev: &CudaDevice, l: &DevLinear, x: &CudaSlice<u16>, y: &mut CudaSlice<u16>, lin32: &mut Option<CudaSlice<f32>>, rows: usize) -> Result<()> {
    match &l.bias {
        None => dev.linear(x, &l.w, y, rows, l.n, l.k),
        Some(b) => dev.linear_bias(x, &l.w, b, buf_mut(lin32), y, rows, l.n, l.k),
    }
}
