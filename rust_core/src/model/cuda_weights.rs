//! The weights of one model on a CUDA device, in the device's storage type (bf16, or f16 on
//! sm_7x), uploaded once at load from the host layouts `ModelWeights` builds.
//!
//! Differences from the host layout, each because a kernel wants it: zero-centred norm weights
//! go up as the raw `w` and the kernels add 1 in f32 (as transformers does; storing `1 + w` in
//! bf16 would round it); the fused GDN input projection is split back into its four parts so
//! that z, b and a land in contiguous buffers, which `rmsnorm_gated` and `gdn_gates` read;
//! `A_log` goes up in f32 because `gdn_gates` computes `-exp(A_log)` itself.

use cudarc::driver::CudaSlice;
use rayon::prelude::*;

use crate::backend::cuda::device::driver_err;
use crate::backend::cuda::transfer::storage_bits_from_f32;
use crate::backend::cuda::CudaDevice;
use crate::config::ModelConfig;
use crate::{NinferError, Result};

use super::weights::{AttentionWeights, GdnWeights, LayerWeights, Linear, Mixer, ModelWeights};

/// A bias-free projection `y = x · Wᵀ` with `w` as `[n, k]` in storage type.
pub struct DevLinear {
    pub w: CudaSlice<u16>,
    pub n: usize,
    pub k: usize,
}

/// Softmax attention of one layer (q | gate | k | v fused as on the host).
pub struct DevAttention {
    pub qkv: DevLinear,
    pub o: DevLinear,
    pub q_norm: Option<CudaSlice<u16>>,
    pub k_norm: Option<CudaSlice<u16>>,
}

/// Gated DeltaNet of one layer, input projection split into its four outputs.
pub struct DevGdn {
    /// Conv input `[conv_dim, hidden]`: q | k | v channels.
    pub qkv: DevLinear,
    pub z: DevLinear,
    pub b: DevLinear,
    pub a: DevLinear,
    /// `[conv_dim, kernel]`.
    pub conv_w: CudaSlice<u16>,
    pub conv_b: Option<CudaSlice<u16>>,
    /// f32 `[n_v_heads]`.
    pub a_log: CudaSlice<f32>,
    /// f32 `[n_v_heads]`.
    pub dt_bias: CudaSlice<f32>,
    /// `[value_head_dim]`, applied as is (not zero-centred).
    pub norm: CudaSlice<u16>,
    pub out: DevLinear,
}

/// The token mixer of one layer.
pub enum DevMixer {
    Attention(Box<DevAttention>),
    Gdn(Box<DevGdn>),
}

/// One decoder layer on the device.
pub struct DevLayer {
    pub input_norm: CudaSlice<u16>,
    pub post_norm: CudaSlice<u16>,
    pub mixer: DevMixer,
    /// gate | up, `[2 * intermediate, hidden]`.
    pub gate_up: DevLinear,
    pub down: DevLinear,
}

/// All weights of a model on the device.
pub struct DevWeights {
    /// `[vocab, hidden]`.
    pub embed: CudaSlice<u16>,
    pub layers: Vec<DevLayer>,
    pub final_norm: CudaSlice<u16>,
    /// None when tied to `embed`.
    pub lm_head: Option<DevLinear>,
    /// Device bytes of all of the above.
    pub bytes: usize,
    /// Whether norm weights are `w` with the kernels adding 1 (zero-centred checkpoints).
    pub norm_plus_one: bool,
}

/// Uploads host tensors, counting bytes.
struct Uploader<'a> {
    dev: &'a CudaDevice,
    bytes: usize,
    plus_one: bool,
}

impl Uploader<'_> {
    fn storage(&mut self, values: &[f32]) -> Result<CudaSlice<u16>> {
        const CHUNK: usize = 1 << 20;
        let st = self.dev.storage();
        let bits: Vec<u16> = values.par_chunks(CHUNK).flat_map_iter(|c| storage_bits_from_f32(c, st)).collect();
        self.bytes += 2 * bits.len();
        self.dev.stream().clone_htod(&bits).map_err(driver_err("uploading weights"))
    }

    fn f32(&mut self, values: &[f32]) -> Result<CudaSlice<f32>> {
        self.bytes += 4 * values.len();
        self.dev.stream().clone_htod(values).map_err(driver_err("uploading weights"))
    }

    /// A norm weight stored on the host as `1 + w` for zero-centred models: upload `w`.
    fn norm(&mut self, w: &[f32]) -> Result<CudaSlice<u16>> {
        if self.plus_one {
            let raw: Vec<f32> = w.iter().map(|x| x - 1.0).collect();
            self.storage(&raw)
        } else {
            self.storage(w)
        }
    }

    fn linear(&mut self, l: &Linear, what: &str) -> Result<DevLinear> {
        if l.b.is_some() {
            return Err(NinferError::Unsupported(format!("{what}: projection biases on the CUDA backend (Qwen2-style qkv_bias); use device=\"cpu\"")));
        }
        self.rows(l, 0, l.n)
    }

    /// Rows `r0..r1` of a projection as its own matrix.
    fn rows(&mut self, l: &Linear, r0: usize, r1: usize) -> Result<DevLinear> {
        Ok(DevLinear { w: self.storage(&l.w[r0 * l.k..r1 * l.k])?, n: r1 - r0, k: l.k })
    }

    fn attention(&mut self, a: &AttentionWeights, li: usize) -> Result<DevAttention> {
        Ok(DevAttention {
            qkv: self.linear(&a.qkv, &format!("layer {li} qkv"))?,
            o: self.linear(&a.o, &format!("layer {li} o_proj"))?,
            q_norm: a.q_norm.as_deref().map(|w| self.norm(w)).transpose()?,
            k_norm: a.k_norm.as_deref().map(|w| self.norm(w)).transpose()?,
        })
    }

    fn gdn(&mut self, cfg: &ModelConfig, g: &GdnWeights, li: usize) -> Result<DevGdn> {
        let la = cfg.linear_attention.ok_or_else(|| NinferError::config("linear_num_key_heads", "missing for a linear_attention layer"))?;
        let (cd, vd, nv) = (la.conv_dim(), la.value_dim(), la.num_value_heads);
        if g.in_proj.b.is_some() {
            return Err(NinferError::Unsupported(format!("layer {li}: GDN input projection bias on the CUDA backend")));
        }
        let a_log: Vec<f32> = g.neg_a.iter().map(|x| (-x).ln()).collect();
        Ok(DevGdn {
            qkv: self.rows(&g.in_proj, 0, cd)?,
            z: self.rows(&g.in_proj, cd, cd + vd)?,
            b: self.rows(&g.in_proj, cd + vd, cd + vd + nv)?,
            a: self.rows(&g.in_proj, cd + vd + nv, cd + vd + 2 * nv)?,
            conv_w: self.storage(&g.conv_w)?,
            conv_b: g.conv_b.as_deref().map(|b| self.storage(b)).transpose()?,
            a_log: self.f32(&a_log)?,
            dt_bias: self.f32(&g.dt_bias)?,
            norm: self.storage(&g.norm)?,
            out: self.linear(&g.out_proj, &format!("layer {li} out_proj"))?,
        })
    }

    fn layer(&mut self, cfg: &ModelConfig, l: &LayerWeights, li: usize) -> Result<DevLayer> {
        let mixer = match &l.mixer {
            Mixer::Attention(a) => DevMixer::Attention(Box::new(self.attention(a, li)?)),
            Mixer::Gdn(g) => DevMixer::Gdn(Box::new(self.gdn(cfg, g, li)?)),
        };
        Ok(DevLayer {
            input_norm: self.norm(&l.input_norm)?,
            post_norm: self.norm(&l.post_norm)?,
            mixer,
            gate_up: self.linear(&l.gate_up, &format!("layer {li} gate_up"))?,
            down: self.linear(&l.down, &format!("layer {li} down_proj"))?,
        })
    }
}

impl DevWeights {
    /// Upload host weights layer by layer, freeing each host layer once it is on the device so
    /// that host memory peaks near one copy of the f32 weights.
    pub fn upload(dev: &CudaDevice, cfg: &ModelConfig, host: ModelWeights) -> Result<Self> {
        let mut up = Uploader { dev, bytes: 0, plus_one: cfg.zero_centered_norm };
        let ModelWeights { embed, layers, final_norm, lm_head, .. } = host;
        let mut dev_layers = Vec::with_capacity(layers.len());
        for (li, l) in layers.into_iter().enumerate() {
            dev_layers.push(up.layer(cfg, &l, li)?);
        }
        let lm_head = lm_head.as_ref().map(|l| up.linear(l, "lm_head")).transpose()?;
        let embed = up.storage(&embed)?;
        let final_norm = up.norm(&final_norm)?;
        Ok(DevWeights { embed, layers: dev_layers, final_norm, lm_head, bytes: up.bytes, norm_plus_one: cfg.zero_centered_norm })
    }

    /// The `[vocab, hidden]` matrix the logits are computed with.
    pub fn lm_head(&self) -> &CudaSlice<u16> {
        self.lm_head.as_ref().map_or(&self.embed, |l| &l.w)
    }
}
