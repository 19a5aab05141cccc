//! Checkpoint tensor names and the fused layouts built from them: the one place both the CPU
//! loader (`cpu::weights`) and the CUDA loader (`cuda::load`) read them from.

use crate::artifact::WeightStore;
use crate::config::{LayerType, ModelConfig};
use crate::{NinferError, Result};

/// Prefix of the decoder's tensors: Qwen3.5 checkpoints nest it in `model.language_model`.
pub fn decoder_prefix(store: &WeightStore) -> &'static str {
    if store.contains("model.language_model.embed_tokens.weight") {
        "model.language_model"
    } else {
        "model"
    }
}

/// Prefix of decoder layer `i`.
pub fn layer(prefix: &str, i: usize) -> String {
    format!("{prefix}.layers.{i}")
}

/// Prefix of a layer's token mixer.
pub fn mixer(layer: &str, kind: LayerType) -> String {
    match kind {
        LayerType::FullAttention => format!("{layer}.self_attn"),
        LayerType::LinearAttention => format!("{layer}.linear_attn"),
    }
}

/// A projection stored as `{name}.weight` with `rows` output features.
pub struct Part {
    pub name: String,
    pub rows: usize,
}

fn part(name: String, rows: usize) -> Part {
    Part { name, rows }
}

/// Parts of the fused attention input projection, in fused row order (all read `hidden`
/// inputs): q (with the output gate's rows when the model gates), k, v.
pub fn attention_qkv(cfg: &ModelConfig, attn: &str) -> [Part; 3] {
    let (nh, nkv, hd) = (cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim);
    let q_rows = nh * hd * if cfg.attn_output_gate { 2 } else { 1 };
    [part(format!("{attn}.q_proj"), q_rows), part(format!("{attn}.k_proj"), nkv * hd), part(format!("{attn}.v_proj"), nkv * hd)]
}

/// For a gated-attention q_proj (HF layout: per head `[query(hd) | gate(hd)]`) fused as
/// `[all queries | all gates]`: the source block of `head_dim` rows that lands at fused
/// block `dst` (blocks `0..nh` are the queries, `nh..2nh` the gates).
pub fn gated_query_source_block(dst: usize, nh: usize) -> usize {
    let (half, head) = (dst / nh, dst % nh);
    head * 2 + half
}

/// Parts of the fused Gated DeltaNet input projection in fused row order: conv channels
/// (q, k, v), z, b, a.
pub fn gdn_in_proj(cfg: &ModelConfig, gdn: &str) -> Result<[Part; 4]> {
    let la = cfg.linear_attention.ok_or_else(|| NinferError::config("linear_num_key_heads", "missing for a linear_attention layer"))?;
    let (cd, vd, nv) = (la.conv_dim(), la.value_dim(), la.num_value_heads);
    Ok([
        part(format!("{gdn}.in_proj_qkv"), cd),
        part(format!("{gdn}.in_proj_z"), vd),
        part(format!("{gdn}.in_proj_b"), nv),
        part(format!("{gdn}.in_proj_a"), nv),
    ])
}

/// Parts of the fused MLP input projection: gate, then up.
pub fn gate_up(cfg: &ModelConfig, layer: &str) -> [Part; 2] {
    let inter = cfg.intermediate_size;
    [part(format!("{layer}.mlp.gate_proj"), inter), part(format!("{layer}.mlp.up_proj"), inter)]
}
