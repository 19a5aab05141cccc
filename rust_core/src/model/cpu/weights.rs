//! The weights of one model, loaded from a checkpoint into the layouts the CPU backend wants.
//!
//! Load-time rearrangements (so the step does fewer, larger matmuls): q|k|v (and the Qwen3.5
//! attention gate) fused into one projection, gate|up fused, the four GDN input projections
//! fused; Qwen3.5's per-head interleaved query/gate rows reordered to all queries then all
//! gates; zero-centred norm weights stored as `1 + w`.
//!
//! A projection's weight is held in the format the load gives it (`quant_load`): dense f32, or
//! packed row blocks, one per checkpoint tensor, decoded on the fly by their forward. Packed rows
//! are never moved, so the gated q_proj's reordering becomes an output order there.

use crate::artifact::WeightStore;
use crate::backend::cpu::matmul::{linear, SMALL_M};
use crate::config::{LayerType, ModelConfig};
use crate::quant::QuantLinear;
use crate::{NinferError, Result};

use crate::model::names;

use super::quant_load::{LinearRole, QuantSource};

/// A block of output rows of a projection's weight, in the format it is held in.
pub enum Part {
    /// f32 `[rows, k]`, row-major (HF layout).
    Dense(Vec<f32>),
    /// Packed in a quantized format; its forward decodes row tiles on the fly.
    Quant(QuantLinear),
}

impl Part {
    /// Output rows of this block.
    pub fn rows(&self, k: usize) -> usize {
        match self {
            Part::Dense(w) => w.len() / k,
            Part::Quant(q) => q.shape()[0],
        }
    }

    /// Bytes held (packed bytes and companions for a quantized block).
    pub fn bytes(&self) -> usize {
        match self {
            Part::Dense(w) => 4 * w.len(),
            Part::Quant(q) => {
                let w = q.weight();
                w.data.len() + [&w.scale, &w.zero, &w.g_idx].into_iter().flatten().map(|r| r.bytes.len()).sum::<usize>()
            }
        }
    }
}

/// A projection `y = x · Wᵀ + b` with `W` as `[n, k]`, held as row blocks (one per checkpoint
/// tensor when quantized, adjacent dense blocks merged into one matmul).
pub struct Linear {
    /// Row blocks in computed-output order.
    pub parts: Vec<Part>,
    /// Output `j` is computed output `order[j]`; None: the identity. A quantized Qwen3.5 q_proj
    /// keeps its checkpoint row order (packed rows cannot be moved in every format), so the
    /// per-head query/gate interleave is undone on its outputs instead.
    pub order: Option<Vec<u32>>,
    /// Optional bias `[n]`, in output order.
    pub b: Option<Vec<f32>>,
    /// Output features.
    pub n: usize,
    /// Input features.
    pub k: usize,
}

impl Linear {
    /// One block.
    pub fn single(part: Part, b: Option<Vec<f32>>, n: usize, k: usize) -> Self {
        Linear { parts: vec![part], order: None, b, n, k }
    }

    /// A dense projection read as f32 (`{name}.weight`, and `{name}.bias` with `bias`).
    pub(super) fn load(store: &WeightStore, name: &str, n: usize, k: usize, bias: bool) -> Result<Self> {
        let w = store.load_f32(&format!("{name}.weight"), &[n, k])?;
        let b = if bias { Some(store.load_f32(&format!("{name}.bias"), &[n])?) } else { None };
        Ok(Linear::single(Part::Dense(w), b, n, k))
    }

    /// Stack projections that read the same input into one (outputs concatenated in order).
    pub(super) fn fuse(linears: Vec<Linear>) -> Linear {
        let k = linears[0].k;
        let n = linears.iter().map(|p| p.n).sum();
        let any_bias = linears.iter().any(|p| p.b.is_some());
        let any_order = linears.iter().any(|p| p.order.is_some());
        let mut parts: Vec<Part> = Vec::new();
        let mut b = Vec::with_capacity(if any_bias { n } else { 0 });
        let mut order = Vec::with_capacity(if any_order { n } else { 0 });
        for l in linears {
            debug_assert_eq!(l.k, k);
            if any_bias {
                match &l.b {
                    Some(pb) => b.extend_from_slice(pb),
                    None => b.extend(std::iter::repeat_n(0.0, l.n)),
                }
            }
            if any_order {
                let base = order.len() as u32;
                match &l.order {
                    Some(o) => order.extend(o.iter().map(|i| base + i)),
                    None => order.extend(base..base + l.n as u32),
                }
            }
            for p in l.parts {
                match (parts.last_mut(), p) {
                    (Some(Part::Dense(w)), Part::Dense(more)) => w.extend_from_slice(&more),
                    (_, p) => parts.push(p),
                }
            }
        }
        Linear { parts, order: any_order.then_some(order), b: any_bias.then_some(b), n, k }
    }

    /// `out[rows, n] = x[rows, k] · Wᵀ + b`, each block through its own format's matmul.
    pub fn forward(&self, x: &[f32], rows: usize, out: &mut [f32]) {
        let (n, k) = (self.n, self.k);
        let out = &mut out[..rows * n];
        if let ([Part::Dense(w)], None) = (self.parts.as_slice(), &self.order) {
            return linear(x, rows, k, w, n, self.b.as_deref(), out);
        }
        let mut computed = if self.order.is_some() { vec![0f32; rows * n] } else { Vec::new() };
        let target: &mut [f32] = if self.order.is_some() { &mut computed } else { &mut *out };
        let mut col = 0;
        for p in &self.parts {
            let pn = p.rows(k);
            let y = match p {
                Part::Dense(w) => {
                    let mut y = vec![0f32; rows * pn];
                    linear(x, rows, k, w, pn, None, &mut y);
                    y
                }
                Part::Quant(q) if rows <= SMALL_M => q.forward(&x[..rows * k], rows).expect("x holds rows * k inputs"),
                Part::Quant(q) => prefill_quant(q, x, rows, k),
            };
            for r in 0..rows {
                target[r * n + col..r * n + col + pn].copy_from_slice(&y[r * pn..(r + 1) * pn]);
            }
            col += pn;
        }
        if let Some(order) = &self.order {
            for r in 0..rows {
                for (j, &src) in order.iter().enumerate() {
                    out[r * n + j] = computed[r * n + src as usize];
                }
            }
        }
        if let Some(b) = &self.b {
            for row in out.chunks_exact_mut(n) {
                for (o, bi) in row.iter_mut().zip(b) {
                    *o += bi;
                }
            }
        }
    }

    /// The dense `[n, k]` weight when the projection is one dense block in output order.
    pub fn dense_weight(&self) -> Option<&[f32]> {
        match (self.parts.as_slice(), &self.order) {
            ([Part::Dense(w)], None) => Some(w),
            _ => None,
        }
    }

    /// Whether any block is quantized.
    pub fn is_quantized(&self) -> bool {
        self.parts.iter().any(|p| matches!(p, Part::Quant(_)))
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.parts.iter().map(Part::bytes).sum::<usize>() + 4 * self.b.as_ref().map_or(0, Vec::len) + 4 * self.order.as_ref().map_or(0, Vec::len)
    }
}

/// Weight rows decoded per tile of a many-row (prefill) quantized matmul: 256 rows of a
/// 5120-wide weight is 5 MB of f32.
const PREFILL_TILE_ROWS: usize = 256;

/// `y[rows, N] = x · Wᵀ` for many rows: each tile of weight rows is decoded once (exactly as
/// the format defines it) and multiplied by the blocked f32 GEMM, instead of a scalar dot
/// product per output as `QuantLinear::forward` (the decode path and the GPU kernels' oracle)
/// does.
fn prefill_quant(q: &QuantLinear, x: &[f32], rows: usize, k: usize) -> Vec<f32> {
    let n = q.shape()[0];
    let view = q.weight().view();
    let mut y = vec![0f32; rows * n];
    let mut w = Vec::new();
    let mut yt = Vec::new();
    for start in (0..n).step_by(PREFILL_TILE_ROWS) {
        let tn = PREFILL_TILE_ROWS.min(n - start);
        w.resize(tn * k, 0f32);
        crate::quant::dequantize_rows(&view, start..start + tn, &mut w);
        yt.resize(rows * tn, 0f32);
        linear(x, rows, k, &w, tn, None, &mut yt);
        for r in 0..rows {
            y[r * n + start..r * n + start + tn].copy_from_slice(&yt[r * tn..(r + 1) * tn]);
        }
    }
    y
}

/// `reorder` of a gated q_proj's rows applied to output indices: entry `d * hd + i` is the
/// checkpoint row that lands there.
fn reorder_u32(identity: &[u32], hd: usize, nh: usize) -> Vec<u32> {
    let mut dst = vec![0u32; identity.len()];
    for d in 0..2 * nh {
        let from = names::gated_query_source_block(d, nh) * hd;
        dst[d * hd..(d + 1) * hd].copy_from_slice(&identity[from..from + hd]);
    }
    dst
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
    quant: &'a QuantSource<'a>,
}

impl Loader<'_> {
    /// Projection `{name}.weight` `[n, k]` (in the format the load gives it) with its bias.
    fn linear(&self, name: &str, n: usize, k: usize, bias: bool) -> Result<Linear> {
        let part = self.quant.weight(name, n, k, LinearRole::Body)?;
        let b = if bias { Some(self.store.load_f32(&format!("{name}.bias"), &[n])?) } else { None };
        Ok(Linear::single(part, b, n, k))
    }

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
        let mut q = self.linear(&qp.name, qp.rows, h, c.qkv_bias)?;
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
            q.b = q.b.as_deref().map(|b| reorder(b, 1));
            match q.parts.as_mut_slice() {
                [Part::Dense(w)] => *w = reorder(w, h),
                _ => {
                    let identity: Vec<u32> = (0..q.n as u32).collect();
                    q.order = Some(reorder_u32(&identity, hd, nh));
                }
            }
        }
        let k = self.linear(&kp.name, kp.rows, h, c.qkv_bias)?;
        let v = self.linear(&vp.name, vp.rows, h, c.qkv_bias)?;
        let o = self.linear(&format!("{p}.o_proj"), h, nh * hd, c.o_bias)?;
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
        let in_proj = names::gdn_in_proj(c, p)?.iter().map(|part| self.linear(&part.name, part.rows, h, false)).collect::<Result<Vec<_>>>()?;
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
            out_proj: self.linear(&format!("{p}.out_proj"), h, vd, false)?,
        })
    }

    fn layer(&self, p: &str, kind: LayerType) -> Result<LayerWeights> {
        let c = self.cfg;
        let (h, inter) = (c.hidden_size, c.intermediate_size);
        let mixer = match kind {
            LayerType::FullAttention => Mixer::Attention(self.attention(&names::mixer(p, kind))?),
            LayerType::LinearAttention => Mixer::Gdn(self.gdn(&names::mixer(p, kind))?),
        };
        let gate_up = names::gate_up(c, p).iter().map(|part| self.linear(&part.name, part.rows, h, c.mlp_bias)).collect::<Result<Vec<_>>>()?;
        Ok(LayerWeights {
            input_norm: self.norm(&format!("{p}.input_layernorm.weight"), h)?,
            post_norm: self.norm(&format!("{p}.post_attention_layernorm.weight"), h)?,
            mixer,
            gate_up: Linear::fuse(gate_up),
            down: self.linear(&format!("{p}.mlp.down_proj"), h, inter, c.mlp_bias)?,
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
            fc: self.linear("mtp.fc", h, 2 * h, false)?,
            pre_fc_norm_embedding: self.norm("mtp.pre_fc_norm_embedding.weight", h)?,
            pre_fc_norm_hidden: self.norm("mtp.pre_fc_norm_hidden.weight", h)?,
            layers,
            norm: self.norm("mtp.norm.weight", h)?,
        }))
    }
}

impl ModelWeights {
    /// Load every tensor the config calls for, checking each shape.
    /// Load every tensor the config calls for, checking each shape; projections come in the
    /// format `quant` gives them.
    pub fn load(store: &WeightStore, cfg: &ModelConfig, quant: &QuantSource<'_>) -> Result<Self> {
        let prefix = names::decoder_prefix(store);
        let l = Loader { store, cfg, quant };
        let (v, h) = (cfg.vocab_size, cfg.hidden_size);
        let embed = quant.embedding(&format!("{prefix}.embed_tokens.weight"), v, h)?;
        let total = cfg.layer_types.len();
        let layers = cfg
            .layer_types
            .iter()
            .enumerate()
            .map(|(i, kind)| {
                let layer = l.layer(&names::layer(prefix, i), *kind);
                quant.layer_done(i, total);
                layer
            })
            .collect::<Result<Vec<_>>>()?;
        let lm_head = if cfg.tie_word_embeddings {
            quant.tied_lm_head(&embed, v, h)?.map(|part| Linear::single(part, None, v, h))
        } else {
            Some(Linear::single(quant.weight("lm_head", v, h, LinearRole::LmHead)?, None, v, h))
        };
        let weights = ModelWeights { embed, layers, final_norm: l.norm(&format!("{prefix}.norm.weight"), h)?, lm_head, mtp: l.mtp()? };
        quant.finish()?;
        Ok(weights)
    }

    /// Logits `out[m, vocab]` of `m` normed hidden rows `x[m, hidden]`: the lm_head, or the
    /// (dense) embedding when tied.
    pub fn lm_head_forward(&self, x: &[f32], m: usize, hidden: usize, vocab: usize, out: &mut [f32]) {
        // A step that wants no logits (a speculative round's recomputed rows): nothing to do,
        // and a quantized head's matmul takes at least one row.
        if m == 0 {
            return;
        }
        match &self.lm_head {
            Some(l) => l.forward(x, m, out),
            None => linear(x, m, hidden, &self.embed, vocab, None, out),
        }
    }

    /// The dense `[vocab, hidden]` matrix the logits are computed with (the tied embedding or
    /// a dense lm_head); None when the lm_head is quantized.
    pub fn lm_head_dense(&self) -> Option<&[f32]> {
        match &self.lm_head {
            Some(l) => l.dense_weight(),
            None => Some(&self.embed),
        }
    }

    /// Bytes of all weights as held (f32, or packed where quantized).
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
