//! The kernels each layer of a `CudaModel` runs, decided once at load (`LayerRoute::choose`)
//! from the model's shapes, the layer's weights (biases, q/k norms, each projection's
//! `LinearRoute`), the device (chunked GDN) and the fusions its plan enables. A step matches on
//! its layer's route and adds only what depends on the step itself: decode or prefill, its
//! rows, its longest chunk.

use crate::backend::cuda::ops::{qkv_rope_fits, tc_direct_rope_fits, GATED_MAX_DV};
use crate::config::ModelConfig;

use super::weights::{DevAttention, DevLayer, DevMixer};

/// The model-wide fusions the device's plan enables; each layer's route applies them where its
/// weights allow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fusions {
    /// Batch-1 decode may run the qkv projection with RoPE and the KV cache write in its
    /// epilogue (`gemv_qkv_rope_kv_write`) instead of the GEMV and `rope_kv_write`: the same
    /// bits (the plan's `fused_rope`).
    pub rope_in_gemv: bool,
    /// Decode steps may run the q / k head norms, RoPE and the KV cache write inside decode
    /// attention's direct tensor-core form (`paged_attention_decode_rope`) instead of
    /// `rope_kv_write[_normed]` before it: the same bits (the plan's `fused_rope`, where its
    /// decode attention route runs that form: tensor cores, sm_80+, not batch invariant).
    pub rope_in_attention: bool,
}

impl Fusions {
    /// The fusions `plan` enables on a device of compute capability `cc`.
    pub fn of(plan: &crate::backend::cuda::plan::Plan, cc: (u32, u32)) -> Self {
        let da = plan.decode_attention;
        Fusions { rope_in_gemv: plan.fused_rope, rope_in_attention: plan.fused_rope && da.tensor_cores && !da.batch_invariant && cc.0 >= 8 }
    }

    /// None: what a layer that never runs a decode step of its own takes (the MTP head).
    pub const NONE: Fusions = Fusions { rope_in_gemv: false, rope_in_attention: false };
}

/// Where q, k and v sit in a row of the packed qkv projection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QueryLayout {
    /// q | k | v.
    Plain,
    /// q | gate | k | v: the attention output is multiplied by sigmoid(gate) before the
    /// output projection (Qwen3.5's `attn_output_gate`).
    Gated,
}

/// How q and k go from the projection to attention.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QkRoute {
    /// A per-head RMSNorm of q and k into their own buffers (`qn`, `kn`), rotated there (a
    /// decode step normalises, rotates and caches in one kernel, `rope_kv_write_normed`).
    HeadNorm,
    /// Rotated in place in the projection's rows.
    InPlace,
}

/// The route of a softmax attention layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionRoute {
    pub query: QueryLayout,
    pub qk: QkRoute,
    /// A one-row decode step runs `gemv_qkv_rope_kv_write` (projection, RoPE and KV cache
    /// write in one kernel) instead of `linear` and `rope_kv_write_packed`: the qkv weight's
    /// one-row GEMV is the CUDA-core kernel (the fused kernel's sums are that GEMV's, and it
    /// needs K a multiple of 8), rotary over the whole head, q | k | v rows with no norm and no
    /// bias between projection and RoPE, and the plan's fusion on. Same bits either way.
    pub rope_in_gemv: bool,
    /// Decode steps that `rope_in_gemv` does not take run `paged_attention_decode_rope` (head
    /// norms, RoPE, KV cache write and attention in one kernel) instead of
    /// `rope_kv_write[_normed]` and `paged_attention_decode`: the heads fit the direct
    /// tensor-core form (`tc_direct_rope_fits`) and the plan's fusion is on. Same bits either way.
    pub rope_in_attention: bool,
    /// Steps where a sequence brings several tokens run flash attention (the queries' row
    /// stride a multiple of 8), else paged attention.
    pub flash_prefill: bool,
}

/// Which kernels a Gated DeltaNet step runs (`GdnRoute::kernels`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GdnKernels {
    /// `gdn_conv_recurrent_gated`: conv, gates, recurrent rule and gated norm in one kernel.
    ConvRecurrentGated,
    /// `causal_conv1d`, `gdn_gates`, `gdn_recurrent`, `rmsnorm_gated`: the same bits.
    Recurrent,
    /// `causal_conv1d`, `gdn_gates`, `gdn_chunked` (which runs the recurrent rule where the device lacks the
    /// chunked kernel's shared memory), `rmsnorm_gated`.
    Chunked,
}

/// Tokens per chunk of the chunked GDN kernel; shorter steps stay on the recurrent kernel.
pub const GDN_CHUNK: usize = 64;

/// Sequences up to which a short GDN step runs its conv inside the one-kernel core. Above it
/// the conv runs once in a kernel of its own: the core's blocks of one key head each repeat
/// that head's q / k conv, which at the Qwen3.5-27B shape on the H100 cost more than the three
/// launches saved at 64 sequences (0.965x the four kernels) and less at 16 (1.10x) and 1 (2.4x).
pub const GDN_FUSED_CONV_MAX_SEQS: usize = 16;

/// The route of a Gated DeltaNet layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GdnRoute {
    /// The device runs the chunked kernel for this key head dim (`has_gdn_chunked`).
    pub chunked: bool,
    /// The value head dim fits the one-kernel form (at most GATED_MAX_DV).
    pub gated_recurrent: bool,
}

impl GdnRoute {
    /// The kernels of a step of `n_seqs` sequences whose longest chunk is `max_rows` tokens:
    /// the chunked kernel from GDN_CHUNK tokens on where the device has it (it is exact for the
    /// short sequences of that step too), else the recurrent rule, in one kernel with the conv
    /// where the value head dim allows and the step has at most GDN_FUSED_CONV_MAX_SEQS
    /// sequences.
    pub fn kernels(&self, max_rows: usize, n_seqs: usize) -> GdnKernels {
        let long = max_rows >= GDN_CHUNK;
        let recurrent = !long || !self.chunked;
        if recurrent && self.gated_recurrent && n_seqs <= GDN_FUSED_CONV_MAX_SEQS {
            GdnKernels::ConvRecurrentGated
        } else if long {
            GdnKernels::Chunked
        } else {
            GdnKernels::Recurrent
        }
    }
}

/// The token mixer's route.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MixerRoute {
    Attention(AttentionRoute),
    Gdn(GdnRoute),
}

/// The route of the SwiGLU MLP.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MlpRoute {
    /// Decode-sized steps (up to GEMV_ROUTE_MAX_M rows) compute SwiGLU in the gate_up GEMV's
    /// epilogue (`gemv_gateup_swiglu`): the weight runs the GEMV and has no bias.
    pub swiglu_in_gemv: bool,
}

/// The kernels of one decoder layer, decided at load.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerRoute {
    pub mixer: MixerRoute,
    pub mlp: MlpRoute,
}

impl LayerRoute {
    /// The route of `layer` of the model `cfg`: `rotary_dim` is the rotated part of a head
    /// (twice the RoPE frequencies), `gdn_chunked` whether the device runs the chunked GDN
    /// kernel for the model's key head dim.
    pub fn choose<W, F>(cfg: &ModelConfig, layer: &DevLayer<W, F>, rotary_dim: usize, gdn_chunked: bool, fusions: Fusions) -> Self {
        let mixer = match &layer.mixer {
            DevMixer::Attention(a) => MixerRoute::Attention(attention(cfg, a, rotary_dim, fusions)),
            DevMixer::Gdn(_) => MixerRoute::Gdn(gdn(cfg, gdn_chunked)),
        };
        let up = &layer.gate_up;
        let mlp = MlpRoute { swiglu_in_gemv: up.route.gemv && up.bias.is_none() };
        LayerRoute { mixer, mlp }
    }
}

fn attention<W>(cfg: &ModelConfig, a: &DevAttention<W>, rotary_dim: usize, fusions: Fusions) -> AttentionRoute {
    let query = if cfg.attn_output_gate { QueryLayout::Gated } else { QueryLayout::Plain };
    let qk = if a.q_norm.is_some() && a.k_norm.is_some() { QkRoute::HeadNorm } else { QkRoute::InPlace };
    let plain_qkv = query == QueryLayout::Plain && a.q_norm.is_none() && a.k_norm.is_none() && a.qkv.bias.is_none();
    let rope_in_gemv = fusions.rope_in_gemv && plain_qkv && a.qkv.route.gemv && qkv_rope_fits(a.qkv.route.gemv_m1, 1, cfg.head_dim, rotary_dim, a.qkv.k);
    let q_stride = match qk {
        QkRoute::HeadNorm => cfg.num_attention_heads * cfg.head_dim,
        QkRoute::InPlace => a.qkv.n,
    };
    let rope_in_attention = fusions.rope_in_attention && tc_direct_rope_fits(cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim, rotary_dim);
    AttentionRoute { query, qk, rope_in_gemv, rope_in_attention, flash_prefill: q_stride.is_multiple_of(8) }
}

fn gdn(cfg: &ModelConfig, gdn_chunked: bool) -> GdnRoute {
    let dv = cfg.linear_attention.map_or(0, |la| la.value_head_dim);
    GdnRoute { chunked: gdn_chunked, gated_recurrent: dv <= GATED_MAX_DV }
}

#[cfg(test)]
mod tests;
