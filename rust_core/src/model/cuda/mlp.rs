//! SwiGLU MLP sub-block of a `CudaModel` layer.

use crate::backend::cuda::ops::GEMV_ROUTE_MAX_M;
use crate::backend::cuda::CudaDevice;
use crate::Result;

use super::buffers::{buf, buf_mut, Activations};
use super::residual::{NormNext, ProjIn};
use super::route::MlpRoute;
use super::weights::DevLayer;

/// SwiGLU MLP sub-block: reads `act.h`, ends with `Activations::project_out`. Decode-sized
/// steps (the GEMV's rows, up to GEMV_ROUTE_MAX_M) of a layer whose route allows compute the
/// activation in the gate_up GEMV's epilogue (`gemv_gateup_swiglu`: bit for bit the GEMV
/// followed by swiglu, one kernel and the [rows, 2 * inter] round trip less, the weight stream
/// untouched); larger steps run the GEMM, swiglu and the GEMM. The loader packs every model's
/// gate_up weight as gate rows then up rows, the layout the kernel pairs.
pub(super) fn mlp(dev: &CudaDevice, layer: &DevLayer, route: &MlpRoute, act: &mut Activations, rows: usize, then: &NormNext) -> Result<()> {
    let up = &layer.gate_up;
    let inter = up.n / 2;
    if route.swiglu_in_gemv && rows <= GEMV_ROUTE_MAX_M {
        dev.gemv_gateup_swiglu(buf(&act.h), &up.w, buf_mut(&mut act.act), rows, inter, up.k)?;
    } else {
        up.forward(dev, buf(&act.h), buf_mut(&mut act.gate_up), buf_mut(&mut act.lin32), rows)?;
        let gu = buf(&act.gate_up);
        dev.swiglu(&gu.slice(0..), &gu.slice(inter..), buf_mut(&mut act.act), rows, inter, 2 * inter, 2 * inter)?;
    }
    act.project_out(dev, &layer.down, ProjIn::Act, rows, then)
}
