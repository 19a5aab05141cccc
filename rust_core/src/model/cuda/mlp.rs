//! SwiGLU MLP sub-block of a `CudaModel` layer.

use crate::backend::cuda::ops::GEMV_ROUTE_MAX_M;
use crate::backend::cuda::CudaDevice;
use crate::Result;

use super::buffers::{buf, buf_mut, Activations};
use super::residual::{linear, NormNext, ProjIn};
use super::weights::DevLayer;

/// SwiGLU MLP sub-block: reads `act.h`, ends with `Activations::project_out`. Decode-sized steps (the GEMV's rows,
/// up to GEMV_ROUTE_MAX_M) compute the activation in the gate_up GEMV's epilogue
/// (`gemv_gateup_swiglu`: bit for bit the GEMV followed by swiglu, one kernel and the
/// [rows, 2 * inter] round trip less, the weight stream untouched); larger steps run cuBLAS,
/// swiglu and cuBLAS. The loader packs every model's gate_up weight as gate rows then up rows,
/// the layout the kernel pairs.
pub(super) fn mlp(dev: &CudaDevice, layer: &DevLayer, act: &mut Activations, rows: usize, then: &NormNext) -> Result<()> {
    let inter = layer.gate_up.n / 2;
    if rows <= GEMV_ROUTE_MAX_M && layer.gate_up.k.is_multiple_of(8) && layer.gate_up.bias.is_none() {
        dev.gemv_gateup_swiglu(buf(&act.h), &layer.gate_up.w, buf_mut(&mut act.act), rows, inter, layer.gate_up.k)?;
    } else {
        linear(dev, &layer.gate_up, buf(&act.h), buf_mut(&mut act.gate_up), &mut act.lin32, rows)?;
        let gu = buf(&act.gate_up);
        dev.swiglu(&gu.slice(0..), &gu.slice(inter..), buf_mut(&mut act.act), rows, inter, 2 * inter, 2 * inter)?;
    }
    act.project_out(dev, &layer.down, ProjIn::Act, rows, then)
}
