//! The weights of one model, loaded from a checkpoint into the layouts the CPU backend wants.
//!
//! Load-time rearrangements (so the step does fewer, larger matmuls): q|k|v (and the Qwen3.5
//! attention gate) fused into one projection, gate|up fused, the four GDN input projections
//! fused; Qwen3.5's per-head interleaved query/gate rows reordered to all queries then all
//! gates; zero-centred norm weights stored as `1 + w`.

use crate::artifact::WeightStore;
use crate::config::{LayerType, ModelConfig};
use crate::{NinferError, Result};

use crate::model::names;

/// A projection `y = x · Wᵀ + b` with `w` as `[n, k]`.
pub struct Linear {
    /// Weight `[n, k]`, row-major (HF layout).
    pub w: Vec<f32>,
    /// Optional bias `[n]`.
    pub b: Option<Vec<f32>>,
    /// Output features.
    pub n: usize,
    /// Input features.
    pub k: usize,
}

impl Linear {
    pub(super) fn load(store: &WeightStore, name: &str, n: usize, k: usize, bias: bool) -> Result<Self> {
        let w = store.load_f32(&format!("{name}.weight"), &[n, k])?;
        let b = if bias { Some(store.load_f32(&format!("{name}.bias"), &[n])?) } else { None };
        Ok(Linear { w, b, n, k })
    }

    /// Stack projections that read the same input into one (outputs concatenated in order).
    pub(super) fn fuse(parts: Vec<Linear>) -> Linear {
        let k = parts[0].k;
        let n = parts.iter().map(|p| p.n).sum();
        let any_bias = parts.iter().any(|p| p.b.is_some());
        let mut w = Vec::with_capacity(n * k);
        let mut b = Vec::with_capacity(if any_bias { n } else { 0 });
        for p in parts {
            debug_assert_eq!(p.k, k);
            w.extend_from_slice(&p.w);
            if any_bias {
                match &p.b {
                    Some(pb) => b.extend_from_slice(pb),
                    None => b.extend(std::iter::repeat_n(0.0, p.n)),
                }
            }
        }
        Linear { w, b: any_bias.then_some(b), n, k }
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        4 * (self.w.len() + self.b.as_ref().map_or(0, Vec::len))
    }
}

/// Softmax attention weights of one layer.
pub struct AttentionWeights {
    /// Rows: queries `[n_heads * head_dim]`, then gates `[n_heads * head_dim]` when the model
    /// gates its attention output, then keys and values `[n_kv_heads * head_dim]` each.
    pub qkv: Linear,
    /// Output projection.
    pub o: Linear,
    /// Per-head q RMSNorm weight `[head_dim]` (Qwen3, Qwen3.5).
    pub q_norm: Option<Vec<f32>>,
    /// Per-head k RMSNorm weight `[head_dim]`.
    pub k_norm: Option<Vec<f32>>,
}

/// Gated DeltaNet weights of one layer.
pub struct GdnWeights {
    /// Rows: conv channels (q, k, v) `[conv_dim]`, then z `[value_dim]`, then b, a
    /// `[num_value_heads]` each.
    pub in_proj: Linear,
    /// Depthwise conv `[conv_dim, kernel]`.
    pub conv_w: Vec<f32>,
    /// Conv bias `[conv_dim]` when the checkpoint has one.
    pub conv_b: Option<Vec<f32>>,
    /// `-exp(A_log)` per value head.
    pub neg_a: Vec<f32>,
    /// Added to `a` before the softplus of the decay.
    pub dt_bias: Vec<f32>,
    /// Gated RMSNorm weight `[value_head_dim]` (applied as is).
    pub norm: Vec<f32>,
    /// `[hidden, value_dim]`.
    pub out_proj: Linear,
}

/// The token mixer of a layer.
pub enum Mixer {
    Attention(AttentionWeights),
    Gdn(GdnWeights),
}

/// One decoder layer.
pub struct LayerWeights {
    /// RMSNorm before the mixer (zero-centred weights already `1 + w`).
    pub input_norm: Vec<f32>,
    /// RMSNorm before the MLP.
    pub post_norm: Vec<f32>,
    /// Attention or Gated DeltaNet.
    pub mixer: Mixer,
    /// Rows: gate `[intermediate]` then up `[intermediate]`.
    pub gate_up: Linear,
    /// `[hidden, intermediate]`.
    pub down: Linear,
}

/// Multi-token-prediction head of Qwen3.5 checkpoints (`mtp.*`): kept for speculative decoding.
pub struct MtpWeights {
    /// `[hidden, 2 * hidden]`: projects concat(norm(embedding), norm(hidden)).
    pub fc: Linear,
    /// Norm of the next token's embedding.
    pub pre_fc_norm_embedding: Vec<f32>,
    /// Norm of the main model's last hidden state.
    pub pre_fc_norm_hidden: Vec<f32>,
    /// Full-attention decoder layers.
    pub layers: Vec<LayerWeights>,
    /// Final norm before the (shared) LM head.
    pub norm: Vec<f32>,
}

/// All weights of a model.
pub struct ModelWeights {
    /// `[vocab, hidden]`.
    pub embed: Vec<f32>,
    /// Decoder layers in order.
    pub layers: Vec<LayerWeights>,
    /// Norm before the LM head.
    pub final_norm: Vec<f32>,
    /// None when tied to `embed`.
    pub lm_head: Option<Linear>,
    /// MTP head when the checkpoint has `mtp.*` tensors.
    pub mtp: Option<MtpWeights>,
}

struct Loader<'a> {
    store: &'a WeightStore,
    cfg: &'a ModelConfig,
}

impl Loader<'_> {
    fn norm(&self, name: &str, dim: usize) -> Result<Vec<f32>> {
        let mut w = self.store.load_f32(name, &[dim])?;
        if self.cfg.zero_centered_norm {
            for x in &mut w {
                *x += 1.0;
            }
        }
        Ok(w)
    }

    fn attention(&self, p: &str) -> Result<AttentionWeights> {
        let c = self.cfg;
        let (h, nh, hd) = (c.hidden_size, c.num_attention_heads, c.head_dim);
        let [qp, kp, vp] = names::attention_qkv(c, p);
        let mut q = Linear::load(self.store, &qp.name, qp.rows, h, c.qkv_bias)?;
        if c.attn_output_gate {
            // HF layout: per head [query(hd) | gate(hd)]; reorder to [all queries | all gates].
            let reorder = |src: &[f32], width: usize| {
                let mut dst = vec![0f32; src.len()];
                let block = hd * width;
                for d in 0..2 * nh {
                    let from = names::gated_query_source_block(d, nh) * block;
                    dst[d * block..(d + 1) * block].copy_from_slice(&src[from..from + block]);
                }
                dst
            };
            q.w = reorder(&q.w, h);
            q.b = q.b.as_deref().map(|b| reorder(b, 1));
        }
        let k = Linear::load(self.store, &kp.name, kp.rows, h, c.qkv_bias)?;
        let v = Linear::load(self.store, &vp.name, vp.rows, h, c.qkv_bias)?;
        let o = Linear::load(self.store, &format!("{p}.o_proj"), h, nh * hd, c.o_bias)?;
        let (q_norm, k_norm) = if c.qk_norm {
            (Some(self.norm(&format!("{p}.q_norm.weight"), hd)?), Some(self.norm(&format!("{p}.k_norm.weight"), hd)?))
        } else {
            (None, None)
        };
        Ok(AttentionWeights { qkv: Linear::fuse(vec![q, k, v]), o, q_norm, k_norm })
    }

    fn gdn(&self, p: &str) -> Result<GdnWeights> {
        let c = self.cfg;
        let la = c.linear_attention.ok_or_else(|| NinferError::config("linear_num_key_heads", "missing for a linear_attention layer"))?;
        let h = c.hidden_size;
        let (cd, vd, nv) = (la.conv_dim(), la.value_dim(), la.num_value_heads);
        let in_proj = names::gdn_in_proj(c, p)?.iter().map(|part| Linear::load(self.store, &part.name, part.rows, h, false)).collect::<Result<Vec<_>>>()?;
        let conv_w = self.store.load_f32(&format!("{p}.conv1d.weight"), &[cd, 1, la.conv_kernel])?;
        let conv_b_name = format!("{p}.conv1d.bias");
        let conv_b = if self.store.contains(&conv_b_name) { Some(self.store.load_f32(&conv_b_name, &[cd])?) } else { None };
        let a_log = self.store.load_f32(&format!("{p}.A_log"), &[nv])?;
        Ok(GdnWeights {
            in_proj: Linear::fuse(in_proj),
            conv_w,
            conv_b,
            neg_a: a_log.iter().map(|x| -x.exp()).collect(),
            dt_bias: self.store.load_f32(&format!("{p}.dt_bias"), &[nv])?,
            norm: self.store.load_f32(&format!("{p}.norm.weight"), &[la.value_head_dim])?,
            out_proj: Linear::load(self.store, &format!("{p}.out_proj"), h, vd, false)?,
        })
    }

    fn layer(&self, p: &str, kind: LayerType) -> Result<LayerWeights> {
        let c = self.cfg;
        let (h, inter) = (c.hidden_size, c.intermediate_size);
        let mixer = match kind {
            LayerType::FullAttention => Mixer::Attention(self.attention(&names::mixer(p, kind))?),
            LayerType::LinearAttention => Mixer::Gdn(self.gdn(&names::mixer(p, kind))?),
        };
        let gate_up = names::gate_up(c, p).iter().map(|part| Linear::load(self.store, &part.name, part.rows, h, c.mlp_bias)).collect::<Result<Vec<_>>>()?;
        Ok(LayerWeights {
            input_norm: self.norm(&format!("{p}.input_layernorm.weight"), h)?,
            post_norm: self.norm(&format!("{p}.post_attention_layernorm.weight"), h)?,
            mixer,
            gate_up: Linear::fuse(gate_up),
            down: Linear::load(self.store, &format!("{p}.mlp.down_proj"), h, inter, c.mlp_bias)?,
        })
    }

    fn mtp(&self) -> Result<Option<MtpWeights>> {
        if !self.store.contains("mtp.fc.weight") {
            return Ok(None);
        }
        let h = self.cfg.hidden_size;
        let mut n_layers = 0;
        while self.store.contains(&format!("mtp.layers.{n_layers}.input_layernorm.weight")) {
            n_layers += 1;
        }
        let n_layers = n_layers.max(self.cfg.mtp_num_layers).max(1);
        let layers = (0..n_layers).map(|i| self.layer(&format!("mtp.layers.{i}"), LayerType::FullAttention)).collect::<Result<Vec<_>>>()?;
        Ok(Some(MtpWeights {
            fc: Linear::load(self.store, "mtp.fc", h, 2 * h, false)?,
            pre_fc_norm_embedding: self.norm("mtp.pre_fc_norm_embedding.weight", h)?,
            pre_fc_norm_hidden: self.norm("mtp.pre_fc_norm_hidden.weight", h)?,
            layers,
            norm: self.norm("mtp.norm.weight", h)?,
        }))
    }
}

impl ModelWeights {
    /// Load every tensor the config calls for, checking each shape.
    pub fn load(store: &WeightStore, cfg: &ModelConfig) -> Result<Self> {
        let prefix = names::decoder_prefix(store);
        let l = Loader { store, cfg };
        let (v, h) = (cfg.vocab_size, cfg.hidden_size);
        let embed = store.load_f32(&format!("{prefix}.embed_tokens.weight"), &[v, h])?;
        let layers = cfg
            .layer_types
            .iter()
            .enumerate()
            .map(|(i, kind)| l.layer(&names::layer(prefix, i), *kind))
            .collect::<Result<Vec<_>>>()?;
        let lm_head = if cfg.tie_word_embeddings { None } else { Some(Linear::load(store, "lm_head", v, h, false)?) };
        Ok(ModelWeights { embed, layers, final_norm: l.norm(&format!("{prefix}.norm.weight"), h)?, lm_head, mtp: l.mtp()? })
    }

    /// The `[vocab, hidden]` matrix the logits are computed with.
    pub fn lm_head_weights(&self) -> &[f32] {
        self.lm_head.as_ref().map_or(&self.embed, |l| &l.w)
    }

    /// Bytes of all weights as loaded (f32).
    pub fn bytes(&self) -> usize {
        let layer_bytes = |l: &LayerWeights| {
            let mixer = match &l.mixer {
                Mixer::Attention(a) => a.qkv.bytes() + a.o.bytes() + 4 * (a.q_norm.as_ref().map_or(0, Vec::len) + a.k_norm.as_ref().map_or(0, Vec::len)),
                Mixer::Gdn(g) => {
                    g.in_proj.bytes() + g.out_proj.bytes() + 4 * (g.conv_w.len() + g.conv_b.as_ref().map_or(0, Vec::len) + g.neg_a.len() + g.dt_bias.len() + g.norm.len())
                }
            };
            mixer + l.gate_up.bytes() + l.down.bytes() + 4 * (l.input_norm.len() + l.post_norm.len())
        };
        let mtp = self.mtp.as_ref().map_or(0, |m| {
            m.fc.bytes() + m.layers.iter().map(layer_bytes).sum::<usize>() + 4 * (m.pre_fc_norm_embedding.len() + m.pre_fc_norm_hidden.len() + m.norm.len())
        });
        4 * (self.embed.len() + self.final_norm.len())
            + self.layers.iter().map(layer_bytes).sum::<usize>()
            + self.lm_head.as_ref().map_or(0, Linear::bytes)
            + mtp
    }
}
