//! The weights of one model on a CUDA device, in the device's storage type (bf16, or f16 on
//! sm_7x), loaded once by `load` straight from the checkpoint. The types are generic over
//! the buffer types so that the packing can be checked into host vectors in tests; the
//! defaults are the device buffers the step code uses.
//!
//! Differences from the host layout, each because a kernel wants it: zero-centred norm weights
//! go up as the raw `w` and the kernels add 1 in f32 (as transformers does; storing `1 + w` in
//! bf16 would round it); `A_log` goes up in f32 because `gdn_gates` computes `-exp(A_log)` itself.

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};

use super::linear::{Linear, WeightFormat};
use crate::backend::cuda::CudaDevice;
use crate::Result;

/// Softmax attention of one layer (q | gate | k | v fused as on the host).
pub struct DevAttention<W = CudaSlice<u16>> {
    pub qkv: Linear<W>,
    pub o: Linear<W>,
    pub q_norm: Option<W>,
    pub k_norm: Option<W>,
}

/// Gated DeltaNet of one layer.
pub struct DevGdn<W = CudaSlice<u16>, F = CudaSlice<f32>> {
    /// The four input projections as one `[conv_dim + value_dim + 2 n_v_heads, hidden]`
    /// matrix, rows q | k | v (the conv input channels), z, b, a: one GEMV per decode step
    /// instead of four (b and a are 48 rows each at the 27B shape, a launch each for ~0.5 MB).
    pub in_proj: Linear<W>,
    /// `[conv_dim, kernel]`.
    pub conv_w: W,
    pub conv_b: Option<W>,
    /// f32 `[n_v_heads]`.
    pub a_log: F,
    /// f32 `[n_v_heads]`.
    pub dt_bias: F,
    /// `[value_head_dim]`, applied as is (not zero-centred).
    pub norm: W,
    pub out: Linear<W>,
}

/// The token mixer of one layer.
pub enum DevMixer<W = CudaSlice<u16>, F = CudaSlice<f32>> {
    Attention(Box<DevAttention<W>>),
    Gdn(Box<DevGdn<W, F>>),
}

/// One decoder layer on the device.
pub struct DevLayer<W = CudaSlice<u16>, F = CudaSlice<f32>> {
    pub input_norm: W,
    pub post_norm: W,
    pub mixer: DevMixer<W, F>,
    /// gate | up, `[2 * intermediate, hidden]`.
    pub gate_up: Linear<W>,
    pub down: Linear<W>,
}

/// All weights of a model on the device.
pub struct DevWeights<W = CudaSlice<u16>, F = CudaSlice<f32>> {
    /// `[vocab, hidden]`.
    pub embed: W,
    pub layers: Vec<DevLayer<W, F>>,
    pub final_norm: W,
    /// None when tied to `embed`.
    pub lm_head: Option<Linear<W>>,
    /// Device bytes of all of the above.
    pub bytes: usize,
    /// Whether norm weights are `w` with the kernels adding 1 (zero-centred checkpoints).
    pub norm_plus_one: bool,
}

impl<W, F> DevWeights<W, F> {
    /// The dense `[vocab, hidden]` matrix the logits are computed with (the embedding where the
    /// head is tied); None where the head is quantized (`logits` runs it).
    pub fn lm_head(&self) -> Option<&W> {
        match &self.lm_head {
            None => Some(&self.embed),
            Some(l) if !matches!(l.format, WeightFormat::Quant(_)) => Some(&l.w),
            Some(_) => None,
        }
    }
}

impl<F> DevWeights<CudaSlice<u16>, F> {
    /// Logits `y[rows, vocab]` (f32) of the normed hidden rows `x[rows, hidden]`, rounded to the
    /// storage type with `round`: the dense head (or the tied embedding) through
    /// `linear_f32_out`, a quantized head through its own routes (`Linear::forward_f32_out`).
    pub fn logits(&self, dev: &CudaDevice, x: &impl DevicePtr<u16>, y: &mut impl DevicePtrMut<f32>, rows: usize, vocab: usize, hidden: usize, round: bool) -> Result<()> {
        match &self.lm_head {
            Some(l) => l.forward_f32_out(dev, x, y, rows, round),
            None => dev.linear_f32_out(x, &self.embed, y, rows, vocab, hidden, round),
        }
    }
}

/// The multi-token-prediction head of a Qwen3.5 / Qwen3-Next checkpoint (`mtp.*`) on the
/// device, loaded only for `--spec mtp` (`CudaModel::enable_mtp`): its full-attention layer,
/// the `fc` over the two normed halves and the norms; the embedding and the lm_head are the
/// model's.
pub struct DevMtp<W = CudaSlice<u16>, F = CudaSlice<f32>> {
    /// `[hidden, 2 * hidden]` over `[normed embedding | normed hidden state]`.
    pub fc: Linear<W>,
    pub pre_fc_norm_embedding: W,
    pub pre_fc_norm_hidden: W,
    /// `mtp.layers.0`, a full-attention decoder layer.
    pub layer: DevLayer<W, F>,
    /// The norm before the shared lm_head.
    pub norm: W,
    /// Device bytes of all of the above.
    pub bytes: usize,
}
