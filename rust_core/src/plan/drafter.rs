//! A DFlash drafter's memory (`--spec dflash --drafter DIR`): its weights, and the context K/V
//! every token of the pool keeps for it, from its config.json and (when present) checked
//! against its safetensors headers, no weight read. The CPU drafter's ledger
//! (`DflashDrafter::weight_bytes`, `context_bytes_per_token`) is this arithmetic, so that
//! `ninfer plan` and the engine's startup ledger agree.

use std::path::Path;

use super::Target;
use crate::artifact::WeightStore;
use crate::config::ModelConfig;
use crate::model::cpu::dflash::DflashConfig;
use crate::{NinferError, Result};

/// What a drafter takes beside its target.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DrafterBytes {
    pub weight_bytes: u64,
    pub tensors: usize,
    /// Context K/V bytes of one token (paged with the target's KV).
    pub context_bytes_per_token: usize,
    /// Rows of one drafting forward (the anchor and `block_size - 1` drafts).
    pub block_size: usize,
}

/// (name, shape) of every tensor of a drafter of `cfg`, in the public `DFlashDraftModel`
/// layout the CPU loader reads (biases on the attention projections with `attention_bias`).
pub fn drafter_tensors(cfg: &DflashConfig) -> Vec<(String, Vec<usize>)> {
    let (h, hd, inter) = (cfg.hidden_size, cfg.head_dim, cfg.intermediate_size);
    let (qd, kvd) = (cfg.num_heads * hd, cfg.num_kv_heads * hd);
    let mut t = vec![("fc.weight".to_string(), vec![h, cfg.target_layer_ids.len() * h]), ("hidden_norm.weight".into(), vec![h]), ("norm.weight".into(), vec![h])];
    for i in 0..cfg.num_layers {
        let p = format!("layers.{i}");
        t.push((format!("{p}.input_layernorm.weight"), vec![h]));
        t.push((format!("{p}.post_attention_layernorm.weight"), vec![h]));
        for (name, n, k) in [("q_proj", qd, h), ("k_proj", kvd, h), ("v_proj", kvd, h), ("o_proj", h, qd)] {
            t.push((format!("{p}.self_attn.{name}.weight"), vec![n, k]));
            if cfg.attention_bias {
                t.push((format!("{p}.self_attn.{name}.bias"), vec![n]));
            }
        }
        t.push((format!("{p}.self_attn.q_norm.weight"), vec![hd]));
        t.push((format!("{p}.self_attn.k_norm.weight"), vec![hd]));
        t.push((format!("{p}.mlp.gate_proj.weight"), vec![inter, h]));
        t.push((format!("{p}.mlp.up_proj.weight"), vec![inter, h]));
        t.push((format!("{p}.mlp.down_proj.weight"), vec![h, inter]));
    }
    t
}

/// Bytes of a drafter's weights on `target`, every tensor in its dense type (f32 on the CPU).
pub fn weight_bytes(cfg: &DflashConfig, target: Target) -> u64 {
    drafter_tensors(cfg).iter().map(|(_, s)| s.iter().product::<usize>() as u64).sum::<u64>() * target.dense_bytes() as u64
}

/// Context bytes one token takes on `target`: K and V of every drafter layer in its dense type.
pub fn context_bytes_per_token(cfg: &DflashConfig, target: Target) -> usize {
    cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * target.dense_bytes()
}

/// The drafter in `dir` for the target `model`, as `target` holds it: its config read and
/// checked against the target as the loader checks it (`DflashConfig::check_target`), its
/// headers (where it has safetensors) against the tensors its config gives. Every problem is an
/// error naming `--drafter` and the directory.
pub fn drafter_bytes(dir: &Path, model: &ModelConfig, target: Target) -> Result<DrafterBytes> {
    let bad = |reason: String| NinferError::config("drafter (--drafter)", format!("{}: {reason}", dir.display()));
    if !dir.is_dir() {
        return Err(bad("no such drafter directory".into()));
    }
    let cfg = DflashConfig::from_dir(dir)?;
    cfg.check_target(dir, model)?;
    let tensors = drafter_tensors(&cfg);
    if dir.join("model.safetensors").exists() || dir.join("model.safetensors.index.json").exists() {
        let store = WeightStore::open(dir).map_err(|e| bad(e.to_string()))?;
        for (name, shape) in &tensors {
            store.raw(name, shape).map_err(|e| bad(e.to_string()))?;
        }
    }
    Ok(DrafterBytes { weight_bytes: weight_bytes(&cfg, target), tensors: tensors.len(), context_bytes_per_token: context_bytes_per_token(&cfg, target), block_size: cfg.block_size })
}

/// The most drafts a round carries with a drafter of `block_size` rows (its block less the
/// anchor); `draft_tokens` (`--draft-tokens`) above it is refused naming the flag. The engine's
/// startup and the plan both ask it.
pub fn max_drafts(block_size: usize, draft_tokens: usize) -> Result<usize> {
    let max = block_size.saturating_sub(1);
    if draft_tokens > max {
        return Err(NinferError::config("draft_tokens (--draft-tokens)", format!("{draft_tokens} drafts do not fit the drafter's block of {block_size} tokens (at most {max})")));
    }
    Ok(max)
}
