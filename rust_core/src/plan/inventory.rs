//! The tensors a backend loads for a model, with their shapes, read from config.json and, when
//! the directory has weights, checked against the safetensors headers (names, dtypes, shapes:
//! no tensor data is read). The lists follow the loaders (`model::names`, `cpu::weights`,
//! `cuda::load`); `plan::tests` checks the counted bytes against what each loader holds.

use std::path::Path;

use crate::artifact::WeightStore;
use crate::config::{LayerType, ModelConfig};
use crate::model::names;
use crate::quant::{hf, HfQuantConfig, QuantFormat, RawDtype};
use crate::{NinferError, Result};

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
    /// Stored quantized by the checkpoint (a quantized HF checkpoint's module): held as stored
    /// on every backend.
    pub stored: Option<StoredQuant>,
}

/// A projection weight a quantized HF checkpoint stores quantized.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StoredQuant {
    pub format: QuantFormat,
    /// Bytes of its stored tensors (data, scale, zero point, g_idx).
    pub bytes: u64,
    /// Of which its g_idx (a fused projection on the GPU keeps one for all its parts).
    pub g_idx_bytes: u64,
}

impl PlannedTensor {
    pub fn numel(&self) -> u64 {
        self.shape.iter().map(|&d| d as u64).product()
    }
}

/// The checkpoint's headers, or none for a config-only directory.
struct Source<'a> {
    store: Option<&'a WeightStore>,
    /// The checkpoint's `quantization_config`.
    hf: Option<HfQuantConfig>,
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
        self.out.push(PlannedTensor { name, shape, role, mtp: self.mtp, fused: false, gated_query: false, stored: None });
        Ok(())
    }

    /// `module`'s weight where the checkpoint stores it quantized (its data tensor present; for
    /// FP8, an F8_E4M3 `weight`, as the loaders decide), its stored tensors' headers checked
    /// against the shapes and dtypes its format gives `[n, k]`.
    fn stored_quant(&self, module: &str, n: usize, k: usize) -> Result<Option<StoredQuant>> {
        let (Some(c), Some(store)) = (self.hf, self.store) else { return Ok(None) };
        let names = c.tensor_names(module);
        if !store.contains(&names.data) || (matches!(c.format, QuantFormat::HfFp8Block { .. }) && store.info(&names.data)?.dtype != "F8_E4M3") {
            return Ok(None);
        }
        let g_idx = names.g_idx.filter(|g| store.contains(g));
        let specs = hf::part_specs(c.format, n, k, g_idx.is_some());
        let (mut bytes, mut g_idx_bytes) = (0u64, 0u64);
        for (i, (name, spec)) in [Some(names.data), Some(names.scale), names.zero, g_idx].into_iter().zip(specs).enumerate() {
            let (Some(name), Some((dtypes, shape))) = (name, spec) else { continue };
            let info = store.info(&name)?;
            let dtype = RawDtype::from_safetensors(&info.dtype).filter(|d| dtypes.contains(d));
            let Some(dtype) = dtype.filter(|_| info.shape == shape) else {
                return Err(NinferError::QuantTensor {
                    name,
                    format: c.format.name().to_string(),
                    reason: format!("stored as {} {:?}, expected one of {dtypes:?} {shape:?} for the [{n}, {k}] weight", info.dtype, info.shape),
                });
            };
            let size = (dtype.size() * shape.iter().product::<usize>()) as u64;
            bytes += size;
            if i == 3 {
                g_idx_bytes = size;
            }
        }
        Ok(Some(StoredQuant { format: c.format, bytes, g_idx_bytes }))
    }

    /// Whether an optional tensor is there (config-only: `default`).
    fn has(&self, name: &str, default: bool) -> bool {
        self.store.map_or(default, |s| s.contains(name))
    }

    /// A projection's weight and bias; `fused`: it continues the previous projection's matrix.
    /// Returns the weight's index.
    fn linear(&mut self, name: &str, n: usize, k: usize, bias: bool, fused: bool) -> Result<usize> {
        match self.stored_quant(name, n, k)? {
            Some(q) => self.out.push(PlannedTensor { name: format!("{name}.weight"), shape: vec![n, k], role: Role::Matrix, mtp: self.mtp, fused, gated_query: false, stored: Some(q) }),
            None => self.push(format!("{name}.weight"), vec![n, k], Role::Matrix)?,
        }
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
/// is checked as the loaders check it, so a plan refuses what a load would. A dense checkpoint's
/// (`checkpoint_tensors` reads a quantized one's).
pub fn model_tensors(cfg: &ModelConfig, store: Option<&WeightStore>) -> Result<Vec<PlannedTensor>> {
    tensors(cfg, store, None)
}

/// `model_tensors` of the checkpoint in `dir`: where its config.json declares a
/// `quantization_config`, the projections it stores quantized (read from the headers) carry
/// their stored bytes. A quantized checkpoint without its weights cannot be planned: which
/// modules are quantized is read from them.
pub fn checkpoint_tensors(dir: &Path, cfg: &ModelConfig, store: Option<&WeightStore>) -> Result<Vec<PlannedTensor>> {
    let hf = crate::model::cpu::quant_load::hf_quant_config(dir)?;
    if let (Some(c), None) = (hf, store) {
        return Err(NinferError::config(
            "quantization_config",
            format!("{} declares {} weights, but has no safetensors: which projections are quantized is read from their headers", dir.join("config.json").display(), c.format.name()),
        ));
    }
    tensors(cfg, store, hf)
}

fn tensors(cfg: &ModelConfig, store: Option<&WeightStore>, hf: Option<HfQuantConfig>) -> Result<Vec<PlannedTensor>> {
    let prefix = if store.is_some_and(|s| s.contains("model.language_model.embed_tokens.weight")) { "model.language_model" } else { "model" };
    let (v, h) = (cfg.vocab_size, cfg.hidden_size);
    let mut s = Source { store, hf, out: Vec::new(), mtp: false };
    s.push(format!("{prefix}.embed_tokens.weight"), vec![v, h], Role::Embedding)?;
    for (i, kind) in cfg.layer_types.iter().enumerate() {
        s.layer(cfg, &names::layer(prefix, i), *kind)?;
    }
    s.push(format!("{prefix}.norm.weight"), vec![h], Role::Dense)?;
    if !cfg.tie_word_embeddings {
        match s.stored_quant("lm_head", v, h)? {
            Some(q) => s.out.push(PlannedTensor { name: "lm_head.weight".into(), shape: vec![v, h], role: Role::LmHead, mtp: false, fused: false, gated_query: false, stored: Some(q) }),
            None => s.push("lm_head.weight".into(), vec![v, h], Role::LmHead)?,
        }
    }
    if s.has("mtp.fc.weight", cfg.mtp_num_layers > 0) {
        s.mtp = true;
        // As the CPU loader counts them: the layers present, at least the config's, at least one.
        let mut present = 0;
        while s.has(&format!("mtp.layers.{present}.input_layernorm.weight"), false) {
            present += 1;
        }
        s.linear("mtp.fc", h, 2 * h, false, false)?;
        s.push("mtp.pre_fc_norm_embedding.weight".into(), vec![h], Role::Dense)?;
        s.push("mtp.pre_fc_norm_hidden.weight".into(), vec![h], Role::Dense)?;
        for i in 0..present.max(cfg.mtp_num_layers).max(1) {
            s.layer(cfg, &format!("mtp.layers.{i}"), LayerType::FullAttention)?;
        }
        s.push("mtp.norm.weight".into(), vec![h], Role::Dense)?;
    }
    Ok(s.out)
}
