//! The end of every sub-block: its output projection, added into the residual stream and
//! followed by the RMSNorm of the next sub-block (`Activations::project_out`).

use cudarc::driver::CudaSlice;

use crate::backend::cuda::CudaDevice;
use crate::Result;

use super::buffers::{buf, buf_mut, Activations};
use super::linear::Linear;

/// The residual add + RMSNorm that follows a sub-block's output projection.
pub(super) struct NormNext<'a> {
    /// The norm's weight: the post-attention norm, the next layer's input norm or the final
    /// norm. None leaves the projection in `act.tmp` (the last layer of a prefill step).
    pub(super) w: Option<&'a CudaSlice<u16>>,
    pub(super) eps: f32,
    pub(super) plus_one: bool,
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
    /// A sub-block's output projection `l` of `input` for `rows` rows, then `then`: residual
    /// `x` += projection and `h` = rmsnorm(x) (`Linear::forward` into `tmp`, then
    /// `add_rmsnorm`); with no norm, the projection is left in `tmp`.
    pub(super) fn project_out(&mut self, dev: &CudaDevice, l: &Linear, input: ProjIn, rows: usize, then: &NormNext) -> Result<()> {
        let Activations { x, h, tmp, mix, act, lin32, .. } = self;
        let src = buf(match input {
            ProjIn::Mix => mix,
            ProjIn::Act => act,
        });
        l.forward(dev, src, buf_mut(tmp), buf_mut(lin32), rows)?;
        match then.w {
            None => Ok(()),
            Some(w) => dev.add_rmsnorm(buf_mut(x), buf(tmp), w, buf_mut(h), rows, l.n, then.eps, then.plus_one),
        }
    }
}
