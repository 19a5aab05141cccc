//! The tensors a backend loads for a model, with their shapes, read from config.json and, when
//! the directory has weights, checked against the safetensors headers (names, dtypes, shapes:
//! no tensor data is read). The lists follow the loaders (`model::names`, `cpu::weights`,
//! `cuda::load`); `plan::tests` checks the counted bytes against what each loader holds.

use crate::artifact::WeightStore;
use crate::config::{LayerType, ModelConfig};
use crate::model::names;
use crate::Result;

/// What a tensor is for, which decides how it is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// A projection `[n, k]`: what `--quantize` quantizes.
    Matrix,
    /// The token embedding `[vocab, hidden]` (also the LM head when tied).
    Embedding,
    /// The untied LM head `[vocab, hidden]`.
    LmHead,
    /// Norm weights, biases, the GDN conv: the backend's dense type.
    Dense,
    /// `A_log` and `dt_bias`: f32 on every backend.
    DenseF32,
}

/// One tensor of the plan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlannedTensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub role: Role,
    /// Part of the MTP head (`mtp.*`).
    pub mtp: bool,
    /// A projection weight that continues the previous one's matrix on the GPU (k and v after
    /// q, up after gate, the GDN input projection's later parts): the CUDA loader holds the
    /// fused projection as one matrix.
    pub fused: bool,
    /// A gated-attention q_proj (per head `[query | gate]` rows): the CPU loader keeps a
    /// quantized one in checkpoint row order and holds the fused projection's output order
    /// beside it (a u32 per fused row).
    pub gated_query: bool,
}

impl PlannedTensor {
    pub fn numel(&self) -> u64 {
        self.shape.iter().map(|&d| d as u64).product()
    }
}

/// The checkpoint's headers, or none for a config-only directory.
struct Source<'a> {
    store: Option<&'a WeightStore>,
    out: Vec<PlannedTensor>,
    mtp: bool,
}

impl Source<'_> {
    /// Adds a tensor, after the loaders' own header check (shape, dtype, byte range) when the
    /// directory has weights.
    fn push(&mut self, name: String, shape: Vec<usize>, role: Role) -> Result<()> {
        if let Some(store) = self.store {
            store.raw(&name, &shape)?;
        }
        self.out.push(PlannedTensor { name, shape, role, mtp: self.mtp, fused: false, gated_query: false });
        Ok(())
    }

    /// Whether an optional tensor is there (config-only: `default`).
    fn has(&self, name: &str, default: bool) -> bool {
        self.store.map_or(default, |s| s.contains(name))
    }

    /// A projection's weight and bias; `fused`: it continues the previous projection's matrix.
    /// Returns the weight's index.
    fn linear(&mut self, name: &str, n: usize, k: usize, bias: bool, fused: bool) -> Result<usize> {
        self.push(format!("{name}.weight"), vec![n, k], Role::Matrix)?;
        let at = self.out.len() - 1;
        self.out[at].fused = fused;
        if bias {
            self.push(format!("{name}.bias"), vec![n], Role::Dense)?;
        }
        Ok(at)
    }

    fn layer(&mut self, c: &ModelConfig, p: &str, kind: LayerType) -> Result<()> {
        let (h, inter) = (c.hidden_size, c.intermediate_size);
        self.push(format!("{p}.input_layernorm.weight"), vec![h], Role::Dense)?;
        self.push(format!("{p}.post_attention_layernorm.weight"), vec![h], Role::Dense)?;
        let m = names::mixer(p, kind);
        match kind {
            LayerType::FullAttention => {
                for (i, part) in names::attention_qkv(c, &m).iter().enumerate() {
                    let at = self.linear(&part.name, part.rows, h, c.qkv_bias, i > 0)?;
                    self.out[at].gated_query = i == 0 && c.attn_output_gate;
                }
                self.linear(&format!("{m}.o_proj"), h, c.num_attention_heads * c.head_dim, c.o_bias, false)?;
                if c.qk_norm {
                    self.push(format!("{m}.q_norm.weight"), vec![c.head_dim], Role::Dense)?;
                    self.push(format!("{m}.k_norm.weight"), vec![c.head_dim], Role::Dense)?;
                }
            }
            LayerType::LinearAttention => {
                let la = c.linear_attention.ok_or_else(|| crate::NinferError::config("linear_num_key_heads", "missing for a linear_attention layer"))?;
                for (i, part) in names::gdn_in_proj(c, &m)?.iter().enumerate() {
                    self.linear(&part.name, part.rows, h, false, i > 0)?;
                }
                self.push(format!("{m}.conv1d.weight"), vec![la.conv_dim(), 1, la.conv_kernel], Role::Dense)?;
                if self.has(&format!("{m}.conv1d.bias"), false) {
                    self.push(format!("{m}.conv1d.bias"), vec![la.conv_dim()], Role::Dense)?;
                }
                self.push(format!("{m}.A_log"), vec![la.num_value_heads], Role::DenseF32)?;
                self.push(format!("{m}.dt_bias"), vec![la.num_value_heads], Role::DenseF32)?;
                self.push(format!("{m}.norm.weight"), vec![la.value_head_dim], Role::Dense)?;
                self.linear(&format!("{m}.out_proj"), h, la.value_dim(), false, false)?;
            }
        }
        for (i, part) in names::gate_up(c, p).iter().enumerate() {
            self.linear(&part.name, part.rows, h, c.mlp_bias, i > 0)?;
        }
        self.linear(&format!("{p}.mlp.down_proj"), h, inter, c.mlp_bias, false)?;
        Ok(())
    }
}

/// Every tensor the loaders read for `cfg`, the MTP head's (`mtp.*`) included when the
/// checkpoint has one (config-only: when the config declares MTP layers). With `store`, each
/// is checked as the loaders check it, so a plan refuses what a load would.
pub fn model_tensors(cfg: &ModelConfig, store: Option<&WeightStore>) -> Result<Vec<PlannedTensor>> {
    let prefix = if store.is_some_and(|s| s.contains("model.language_model.embed_tokens.weight")) { "model.language_model" } else { "model" };
    let (v, h) = (cfg.vocab_size, cfg.hidden_size);
    let mut s = Source { store, out: Vec::new(), mtp: false };
    s.push(format!("{prefix}.embed_tokens.weight"), vec![v, h], Role::Embedding)?;
    for (i, kind) in cfg.layer_types.iter().enumerate() {
        s.layer(cfg, &names::layer(prefix, i), *kind)?;
    }
    s.push(format!("{prefix}.norm.weight"), vec![h], Role::Dense)?;
    if !cfg.tie_word_embeddings {
        s.push("lm_head.weight".into(), vec![v, h], Role::LmHead)?;
    }
    if s.has("mtp.fc.weight", cfg.mtp_num_layers > 0) {
        s.mtp = true;
        // As the CPU loader counts them: the layers present, at least the config's, at least one.
        let mut present = 0;
        while s.has(&format!("mtp.layers.{present}.input_layernorm.weight"), false) {
            present += 1;
        }
        s.push("mtp.fc.weight".into(), vec![h, 2 * h], Role::Matrix)?;
        s.push("mtp.pre_fc_norm_embedding.weight".into(), vec![h], Role::Dense)?;
        s.push("mtp.pre_fc_norm_hidden.weight".into(), vec![h], Role::Dense)?;
        for i in 0..present.max(cfg.mtp_num_layers).max(1) {
            s.layer(cfg, &format!("mtp.layers.{i}"), LayerType::FullAttention)?;
        }
        s.push("mtp.norm.weight".into(), vec![h], Role::Dense)?;
    }
    Ok(s.out)
}
