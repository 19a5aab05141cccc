//! A DFlash block-diffusion drafter (`--spec dflash --drafter DIR`) on the CPU backend.
//!
//! DFlash (arXiv 2602.06036) drafts a whole block in one forward of a few Qwen3-style layers
//! that share the target's embedding and LM head and are conditioned on the target's hidden
//! states. Context rows: for every position the target computed and kept, the outputs of the
//! target layers the drafter's config names (`target_layer_ids`), concatenated, projected by
//! `fc` and normed by `hidden_norm`; each drafter layer turns them into K/V with its own
//! `k_proj`/`v_proj` (`k_norm`, RoPE at the row's position). Block rows: the embeddings of the
//! anchor (the token after the context, at the next position) and `block_size - 1` mask tokens.
//! Every block row attends to every context row and every row of its block (not causal); rows
//! 1.. of the block, normed and through the target's LM head, are the drafts.
//!
//! The context K/V of each drafter layer is paged like the target's KV and keyed by the same
//! positions, so a sequence's block table serves both. A context row at position `p` reads only
//! the target's features at `p`, which depend on the tokens up to `p` and nothing after, so a
//! full block's rows are a function of the tokens its prefix-cache hash covers: a prefix hit
//! reuses them as it reuses the target's KV (no per-block copy, and their memory is the pool's,
//! counted per token in `cache_spec` and freed with the block). Absorbing writes the rows a step
//! computed and kept; the rows of rejected drafts are never absorbed, and a sequence's context
//! length is its anchor position, so what they left past it is never read (the rollback).
//!
//! Checkpoints are read in the public `DFlashDraftModel` layout: `config.json` (Qwen3 fields
//! and `dflash_config` {block_size, mask_token_id, target_layer_ids}) and `model.safetensors`
//! (`fc`, `hidden_norm`, `norm`, `layers.{i}.{input_layernorm, post_attention_layernorm,
//! self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm, mlp.{gate,up,down}_proj}`).

use std::path::{Path, PathBuf};

use rayon::prelude::*;
use serde_json::Value;

use crate::artifact::WeightStore;
use crate::backend::cpu::activation::swiglu;
use crate::backend::cpu::norm::{rms_norm, rms_norm_heads_inplace};
use crate::backend::cpu::rope::{apply_rope, rope_tables};
use crate::config::ModelConfig;
use crate::model::runner::{DflashDraftSeq, DflashRows, MtpDraft};
use crate::sampling::argmax;
use crate::spec::draw_draft;
use crate::{NinferError, Result};

use super::layers::fit;
use super::weights::{Linear, ModelWeights};
use super::CpuModel;

/// The field every drafter error names.
const FLAG: &str = "drafter (--drafter)";

/// A drafter error naming the flag and the directory.
fn bad(dir: &Path, reason: impl std::fmt::Display) -> NinferError {
    NinferError::config(FLAG, format!("{}: {reason}", dir.display()))
}

/// The drafter's shape and its link to the target, from its `config.json`.
#[derive(Clone, Debug, PartialEq)]
pub struct DflashConfig {
    pub hidden_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub intermediate_size: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    pub attention_bias: bool,
    /// Target layers (0-based) whose outputs make a context row, in concatenation order.
    pub target_layer_ids: Vec<usize>,
    /// Rows of one drafting forward: the anchor and `block_size - 1` drafts.
    pub block_size: usize,
    /// The token whose embedding fills the block after the anchor.
    pub mask_token_id: u32,
    /// The target's layer count the drafter was trained for (0 when the config omits it).
    pub num_target_layers: usize,
}

impl DflashConfig {
    /// Read and check `dir/config.json`; every problem is an error naming `--drafter`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| bad(dir, format!("cannot read config.json ({e})")))?;
        let root: Value = serde_json::from_str(&text).map_err(|e| bad(dir, format!("config.json is not JSON ({e})")))?;
        let root = root.as_object().ok_or_else(|| bad(dir, "config.json is not a JSON object"))?;
        if let Some(arch) = root.get("architectures").and_then(Value::as_array).and_then(|a| a.first()).and_then(Value::as_str) {
            if arch != "DFlashDraftModel" {
                return Err(bad(dir, format!("architecture {arch:?} is not supported (DFlashDraftModel is)")));
            }
        }
        let dc = root.get("dflash_config").and_then(Value::as_object);
        // `dflash_config` first, then the top level (older drafters keep the keys there).
        let get = |key: &str| dc.and_then(|d| d.get(key)).or_else(|| root.get(key)).filter(|v| !v.is_null());
        let uint = |key: &str| -> Result<usize> {
            let v = get(key).ok_or_else(|| bad(dir, format!("config.json has no `{key}`")))?;
            v.as_u64().map(|x| x as usize).ok_or_else(|| bad(dir, format!("`{key}` must be a non-negative integer, got {v}")))
        };
        let uint_or = |key: &str, default: usize| if get(key).is_some() { uint(key) } else { Ok(default) };
        let float_or = |key: &str, default: f64| -> Result<f32> {
            match get(key) {
                None => Ok(default as f32),
                Some(v) => v.as_f64().map(|x| x as f32).ok_or_else(|| bad(dir, format!("`{key}` must be a number, got {v}"))),
            }
        };
        let hidden_size = uint("hidden_size")?;
        let num_heads = uint("num_attention_heads")?;
        let ids = get("target_layer_ids").ok_or_else(|| bad(dir, "config.json has no `dflash_config.target_layer_ids`"))?;
        let target_layer_ids = ids
            .as_array()
            .and_then(|a| a.iter().map(|x| x.as_u64().map(|x| x as usize)).collect::<Option<Vec<_>>>())
            .ok_or_else(|| bad(dir, format!("`target_layer_ids` must be a list of layer indices, got {ids}")))?;
        let rope_theta = match root.get("rope_parameters").and_then(|r| r.get("rope_theta")) {
            Some(v) => v.as_f64().ok_or_else(|| bad(dir, format!("`rope_parameters.rope_theta` must be a number, got {v}")))? as f32,
            None => float_or("rope_theta", 10000.0)?,
        };
        for key in ["rope_parameters", "rope_scaling"] {
            if let Some(t) = root.get(key).and_then(|r| r.get("rope_type")).and_then(Value::as_str) {
                if t != "default" {
                    return Err(bad(dir, format!("`{key}.rope_type` {t:?} is not supported (default RoPE is)")));
                }
            }
        }
        if root.get("use_sliding_window").and_then(Value::as_bool) == Some(true)
            || root.get("layer_types").and_then(Value::as_array).is_some_and(|a| a.iter().any(|t| t.as_str() != Some("full_attention")))
        {
            return Err(bad(dir, "sliding-window drafter layers are not supported (full attention is)"));
        }
        if root.get("is_causal").and_then(Value::as_bool) == Some(true) {
            return Err(bad(dir, "a causal drafter (is_causal) is not supported (DFlash blocks attend both ways)"));
        }
        let cfg = DflashConfig {
            hidden_size,
            num_layers: uint("num_hidden_layers")?,
            num_heads,
            num_kv_heads: uint_or("num_key_value_heads", num_heads)?,
            head_dim: uint_or("head_dim", if num_heads > 0 { hidden_size / num_heads } else { 0 })?,
            intermediate_size: uint("intermediate_size")?,
            vocab_size: uint("vocab_size")?,
            rms_norm_eps: float_or("rms_norm_eps", 1e-6)?,
            rope_theta,
            attention_bias: root.get("attention_bias").and_then(Value::as_bool).unwrap_or(false),
            target_layer_ids,
            block_size: uint_or("block_size", 16)?,
            mask_token_id: uint("mask_token_id")? as u32,
            num_target_layers: uint_or("num_target_layers", 0)?,
        };
        cfg.check_shape(dir)?;
        Ok(cfg)
    }

    fn check_shape(&self, dir: &Path) -> Result<()> {
        if self.num_layers == 0 || self.num_heads == 0 || self.num_kv_heads == 0 || self.hidden_size == 0 || self.intermediate_size == 0 {
            return Err(bad(dir, "hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads and intermediate_size must be positive"));
        }
        if self.num_heads % self.num_kv_heads != 0 {
            return Err(bad(dir, format!("num_attention_heads {} is not a multiple of num_key_value_heads {}", self.num_heads, self.num_kv_heads)));
        }
        if self.head_dim == 0 || self.head_dim % 2 != 0 {
            return Err(bad(dir, format!("head_dim {} must be positive and even (RoPE)", self.head_dim)));
        }
        if self.block_size < 2 {
            return Err(bad(dir, format!("block_size {} leaves no draft (at least 2)", self.block_size)));
        }
        if self.target_layer_ids.is_empty() {
            return Err(bad(dir, "target_layer_ids is empty"));
        }
        Ok(())
    }

    /// Whether this drafter fits `target`: the hidden size and vocabulary it shares, and the
    /// layers it reads.
    pub fn check_target(&self, dir: &Path, target: &ModelConfig) -> Result<()> {
        if self.hidden_size != target.hidden_size {
            return Err(bad(dir, format!("hidden_size {} does not match the target's {}", self.hidden_size, target.hidden_size)));
        }
        if self.vocab_size != target.vocab_size {
            return Err(bad(dir, format!("vocab_size {} does not match the target's {}", self.vocab_size, target.vocab_size)));
        }
        if self.mask_token_id as usize >= target.vocab_size {
            return Err(bad(dir, format!("mask_token_id {} is outside the target's vocabulary of {}", self.mask_token_id, target.vocab_size)));
        }
        if let Some(&l) = self.target_layer_ids.iter().find(|&&l| l >= target.num_layers) {
            return Err(bad(dir, format!("target_layer_ids names layer {l}; the target has {} layers (0..={})", target.num_layers, target.num_layers - 1)));
        }
        if self.num_target_layers != 0 && self.num_target_layers != target.num_layers {
            return Err(bad(dir, format!("num_target_layers {} does not match the target's {} layers", self.num_target_layers, target.num_layers)));
        }
        Ok(())
    }
}

/// One drafter layer.
struct DflashLayer {
    input_norm: Vec<f32>,
    post_norm: Vec<f32>,
    q: Linear,
    /// Rows: keys then values (`[2 * n_kv_heads * head_dim, hidden]`), applied to context rows
    /// and block rows alike.
    kv: Linear,
    o: Linear,
    q_norm: Vec<f32>,
    k_norm: Vec<f32>,
    /// Rows: gate then up.
    gate_up: Linear,
    down: Linear,
}

/// The context K/V pool, per drafter layer `[num_blocks, block_size, n_kv_heads * head_dim]`:
/// block `b` holds the rows of the positions the target's KV block `b` holds.
#[derive(Default)]
struct Pages {
    block_size: usize,
    num_blocks: usize,
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

impl Pages {
    /// Offset of position `pos`'s row in a layer's K or V buffer (`kvd` floats a row).
    #[inline]
    fn row(&self, block_table: &[u32], pos: usize, kvd: usize) -> usize {
        (block_table[pos / self.block_size] as usize * self.block_size + pos % self.block_size) * kvd
    }

    /// Whether `block_table` covers positions `..end` inside the pool.
    fn check(&self, block_table: &[u32], end: usize, what: &str) -> Result<()> {
        if self.block_size == 0 {
            return Err(NinferError::invalid(what, "the drafter's context pool is not allocated (allocate)"));
        }
        let need = end.div_ceil(self.block_size);
        if block_table.len() < need {
            return Err(NinferError::invalid(what, format!("{} blocks cover fewer than {end} positions (block size {})", block_table.len(), self.block_size)));
        }
        if let Some(b) = block_table[..need].iter().find(|&&b| b as usize >= self.num_blocks) {
            return Err(NinferError::invalid(what, format!("block {b} >= num_blocks {}", self.num_blocks)));
        }
        Ok(())
    }
}

/// One sequence to draft for: its block table, its context length (the anchor's position:
/// rows `0..len` are read) and its anchor token.
#[derive(Clone, Copy, Debug)]
pub struct DraftContext<'a> {
    pub block_table: &'a [u32],
    pub len: usize,
    pub anchor: u32,
}

/// A loaded drafter and its paged context K/V.
pub struct DflashDrafter {
    pub cfg: DflashConfig,
    /// Where it was loaded from (error messages).
    dir: PathBuf,
    fc: Linear,
    hidden_norm: Vec<f32>,
    norm: Vec<f32>,
    layers: Vec<DflashLayer>,
    inv_freq: Vec<f32>,
    pages: Pages,
}

impl DflashDrafter {
    /// Load the drafter in `dir` for `target`; a missing directory, a malformed config or
    /// checkpoint, or a drafter built for another target is an error naming `--drafter`.
    pub fn load(dir: &Path, target: &ModelConfig) -> Result<Self> {
        if !dir.is_dir() {
            return Err(bad(dir, "no such drafter directory"));
        }
        let cfg = DflashConfig::from_dir(dir)?;
        cfg.check_target(dir, target)?;
        let store = WeightStore::open(dir).map_err(|e| bad(dir, e))?;
        let (h, hd, inter, b) = (cfg.hidden_size, cfg.head_dim, cfg.intermediate_size, cfg.attention_bias);
        let (qd, kvd) = (cfg.num_heads * hd, cfg.num_kv_heads * hd);
        let vec = |name: &str, n: usize| store.load_f32(name, &[n]).map_err(|e| bad(dir, e));
        let lin = |name: &str, n: usize, k: usize, bias: bool| Linear::load(&store, name, n, k, bias).map_err(|e| bad(dir, e));
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for i in 0..cfg.num_layers {
            let p = format!("layers.{i}");
            layers.push(DflashLayer {
                input_norm: vec(&format!("{p}.input_layernorm.weight"), h)?,
                post_norm: vec(&format!("{p}.post_attention_layernorm.weight"), h)?,
                q: lin(&format!("{p}.self_attn.q_proj"), qd, h, b)?,
                kv: Linear::fuse(vec![lin(&format!("{p}.self_attn.k_proj"), kvd, h, b)?, lin(&format!("{p}.self_attn.v_proj"), kvd, h, b)?]),
                o: lin(&format!("{p}.self_attn.o_proj"), h, qd, b)?,
                q_norm: vec(&format!("{p}.self_attn.q_norm.weight"), hd)?,
                k_norm: vec(&format!("{p}.self_attn.k_norm.weight"), hd)?,
                gate_up: Linear::fuse(vec![lin(&format!("{p}.mlp.gate_proj"), inter, h, false)?, lin(&format!("{p}.mlp.up_proj"), inter, h, false)?]),
                down: lin(&format!("{p}.mlp.down_proj"), h, inter, false)?,
            });
        }
        let inv_freq = (0..hd / 2).map(|i| 1.0 / cfg.rope_theta.powf(2.0 * i as f32 / hd as f32)).collect();
        Ok(DflashDrafter {
            fc: lin("fc", h, cfg.target_layer_ids.len() * h, false)?,
            hidden_norm: vec("hidden_norm.weight", h)?,
            norm: vec("norm.weight", h)?,
            layers,
            inv_freq,
            pages: Pages::default(),
            dir: dir.to_path_buf(),
            cfg,
        })
    }

    /// Width of one context row: the concatenated outputs of the target layers it reads.
    pub fn feature_width(&self) -> usize {
        self.cfg.target_layer_ids.len() * self.cfg.hidden_size
    }

    /// Context bytes one token takes (f32 K and V of every drafter layer), for the ledger: the
    /// memory plan's arithmetic (`plan::drafter`).
    pub fn context_bytes_per_token(&self) -> usize {
        crate::plan::drafter::context_bytes_per_token(&self.cfg, crate::plan::Target::Cpu)
    }

    /// Bytes of the weights as loaded (f32): the memory plan's arithmetic (`plan::drafter`).
    pub fn weight_bytes(&self) -> usize {
        crate::plan::drafter::weight_bytes(&self.cfg, crate::plan::Target::Cpu) as usize
    }

    /// Allocate the context pool: `num_blocks` blocks of `block_size` positions, the target's
    /// KV pool shape (the old pool is freed first).
    pub fn allocate(&mut self, num_blocks: usize, block_size: usize) -> Result<()> {
        if block_size == 0 {
            return Err(NinferError::config("block_size", "must be positive"));
        }
        self.pages = Pages::default();
        let floats = num_blocks * block_size * self.cfg.num_kv_heads * self.cfg.head_dim;
        let mut pages = Pages { block_size, num_blocks, ..Default::default() };
        for _ in 0..self.cfg.num_layers {
            pages.k.push(super::alloc(floats, "DFlash drafter context")?);
            pages.v.push(super::alloc(floats, "DFlash drafter context")?);
        }
        self.pages = pages;
        Ok(())
    }

    /// Bytes the context pool holds (`context_bytes_per_token` for every position of the pool).
    pub fn context_bytes(&self) -> usize {
        4 * self.pages.k.iter().chain(&self.pages.v).map(Vec::len).sum::<usize>()
    }

    /// Write the context rows at positions `start_pos..start_pos + rows` of the sequence with
    /// `block_table`, from the target features `[rows, feature_width]`.
    pub fn absorb(&mut self, block_table: &[u32], start_pos: usize, features: &[f32]) -> Result<()> {
        let (h, hd, eps) = (self.cfg.hidden_size, self.cfg.head_dim, self.cfg.rms_norm_eps);
        let width = self.feature_width();
        if features.len() % width != 0 {
            return Err(NinferError::invalid("dflash absorb", format!("{} feature values are not rows of {width}", features.len())));
        }
        let rows = features.len() / width;
        if rows == 0 {
            return Ok(());
        }
        self.pages.check(block_table, start_pos + rows, "dflash absorb")?;
        let mut projected = vec![0f32; rows * h];
        self.fc.forward(features, rows, &mut projected);
        let mut normed = vec![0f32; rows * h];
        rms_norm(&projected, rows, h, &self.hidden_norm, eps, &mut normed);
        let positions: Vec<usize> = (start_pos..start_pos + rows).collect();
        let (mut cos, mut sin) = (Vec::new(), Vec::new());
        rope_tables(&positions, &self.inv_freq, 1.0, &mut cos, &mut sin);
        let kvd = self.cfg.num_kv_heads * hd;
        let mut kv = vec![0f32; rows * 2 * kvd];
        let pages = &mut self.pages;
        for (l, layer) in self.layers.iter().enumerate() {
            layer.kv.forward(&normed, rows, &mut kv);
            rms_norm_heads_inplace(&mut kv, rows, 2 * kvd, 0, self.cfg.num_kv_heads, hd, &layer.k_norm, eps);
            apply_rope(&mut kv, rows, 2 * kvd, 0, self.cfg.num_kv_heads, hd, &cos, &sin, hd / 2);
            for r in 0..rows {
                let at = pages.row(block_table, start_pos + r, kvd);
                pages.k[l][at..at + kvd].copy_from_slice(&kv[r * 2 * kvd..r * 2 * kvd + kvd]);
                pages.v[l][at..at + kvd].copy_from_slice(&kv[r * 2 * kvd + kvd..(r + 1) * 2 * kvd]);
            }
        }
        Ok(())
    }

    /// One drafting forward for each sequence: its anchor sits right after its context rows.
    /// Returns, per sequence, the logits `[block_size - 1, vocab]` of the tokens after the
    /// anchor, with the target's embedding and LM head.
    pub fn draft_logits(&self, weights: &ModelWeights, seqs: &[DraftContext]) -> Result<Vec<Vec<f32>>> {
        let embed = &weights.embed;
        let c = &self.cfg;
        let (h, hd, bs, eps) = (c.hidden_size, c.head_dim, c.block_size, c.rms_norm_eps);
        let (nh, nkv) = (c.num_heads, c.num_kv_heads);
        let (qd, kvd) = (nh * hd, nkv * hd);
        let vocab = embed.len() / h;
        for s in seqs {
            if s.anchor as usize >= vocab {
                return Err(NinferError::invalid("dflash draft", format!("anchor token {} >= vocab_size {vocab}", s.anchor)));
            }
            self.pages.check(s.block_table, s.len, "dflash draft")?;
        }
        let rows = seqs.len() * bs;
        let mut x = vec![0f32; rows * h];
        let mut positions = Vec::with_capacity(rows);
        for (s, seq) in seqs.iter().enumerate() {
            for j in 0..bs {
                let t = if j == 0 { seq.anchor } else { c.mask_token_id } as usize;
                x[(s * bs + j) * h..(s * bs + j + 1) * h].copy_from_slice(&embed[t * h..(t + 1) * h]);
                positions.push(seq.len + j);
            }
        }
        let (mut cos, mut sin) = (Vec::new(), Vec::new());
        rope_tables(&positions, &self.inv_freq, 1.0, &mut cos, &mut sin);
        let (mut hn, mut q, mut kv, mut att, mut tmp, mut gu, mut act) = (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let scale = 1.0 / (hd as f32).sqrt();
        for (l, layer) in self.layers.iter().enumerate() {
            rms_norm(&x, rows, h, &layer.input_norm, eps, fit(&mut hn, rows * h));
            layer.q.forward(&hn, rows, fit(&mut q, rows * qd));
            layer.kv.forward(&hn, rows, fit(&mut kv, rows * 2 * kvd));
            rms_norm_heads_inplace(&mut q, rows, qd, 0, nh, hd, &layer.q_norm, eps);
            rms_norm_heads_inplace(&mut kv, rows, 2 * kvd, 0, nkv, hd, &layer.k_norm, eps);
            apply_rope(&mut q, rows, qd, 0, nh, hd, &cos, &sin, hd / 2);
            apply_rope(&mut kv, rows, 2 * kvd, 0, nkv, hd, &cos, &sin, hd / 2);
            let (q, kv) = (&q, &kv);
            let pages = &self.pages;
            fit(&mut att, rows * qd).par_chunks_mut(bs * qd).zip(seqs.par_iter()).enumerate().for_each(|(s, (out, seq))| {
                let block_q = &q[s * bs * qd..(s + 1) * bs * qd];
                let block_kv = &kv[s * bs * 2 * kvd..(s + 1) * bs * 2 * kvd];
                block_attention(pages, seq, l, block_q, block_kv, nh, nkv, hd, scale, out);
            });
            layer.o.forward(&att, rows, fit(&mut tmp, rows * h));
            add_into(&mut x, &tmp);
            rms_norm(&x, rows, h, &layer.post_norm, eps, fit(&mut hn, rows * h));
            let inter = layer.gate_up.n / 2;
            layer.gate_up.forward(&hn, rows, fit(&mut gu, rows * 2 * inter));
            swiglu(&gu, rows, inter, fit(&mut act, rows * inter));
            layer.down.forward(&act, rows, fit(&mut tmp, rows * h));
            add_into(&mut x, &tmp);
        }
        rms_norm(&x, rows, h, &self.norm, eps, fit(&mut hn, rows * h));
        let mut out = Vec::with_capacity(seqs.len());
        for s in 0..seqs.len() {
            let mut logits = vec![0f32; (bs - 1) * vocab];
            weights.lm_head_forward(&hn[(s * bs + 1) * h..(s + 1) * bs * h], bs - 1, h, vocab, &mut logits);
            out.push(logits);
        }
        Ok(out)
    }

    /// `draft_logits` with `model`'s embedding and LM head, on its thread pool.
    pub fn draft_logits_with(&self, model: &CpuModel, seqs: &[DraftContext]) -> Result<Vec<Vec<f32>>> {
        model.pool.install(|| self.draft_logits(&model.weights, seqs))
    }

    /// The directory this drafter was loaded from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

/// One sequence's block attention in drafter layer `layer`: each of its `block_size` query rows
/// over its context K/V (rows `0..seq.len` through its block table) and the block's own K/V,
/// every head; writes `[block_size, heads * hd]`.
#[allow(clippy::too_many_arguments)]
fn block_attention(pages: &Pages, seq: &DraftContext, layer: usize, q: &[f32], kv: &[f32], nh: usize, nkv: usize, hd: usize, scale: f32, out: &mut [f32]) {
    let (qd, kvd) = (nh * hd, nkv * hd);
    let bs = q.len() / qd;
    let (ck, cv, len) = (&pages.k[layer], &pages.v[layer], seq.len);
    let rows: Vec<usize> = (0..len).map(|i| pages.row(seq.block_table, i, kvd)).collect();
    let n = len + bs;
    let mut scores = vec![0f32; n];
    for j in 0..bs {
        for head in 0..nh {
            let g = head / (nh / nkv);
            let qh = &q[j * qd + head * hd..j * qd + (head + 1) * hd];
            let key = |i: usize| if i < len { &ck[rows[i] + g * hd..rows[i] + (g + 1) * hd] } else { &kv[(i - len) * 2 * kvd + g * hd..(i - len) * 2 * kvd + (g + 1) * hd] };
            let value = |i: usize| if i < len { &cv[rows[i] + g * hd..rows[i] + (g + 1) * hd] } else { &kv[(i - len) * 2 * kvd + kvd + g * hd..(i - len) * 2 * kvd + kvd + (g + 1) * hd] };
            let mut max = f32::NEG_INFINITY;
            for (i, s) in scores.iter_mut().enumerate() {
                *s = qh.iter().zip(key(i)).map(|(a, b)| a * b).sum::<f32>() * scale;
                max = max.max(*s);
            }
            let mut sum = 0f32;
            for s in scores.iter_mut() {
                *s = (*s - max).exp();
                sum += *s;
            }
            let o = &mut out[j * qd + head * hd..j * qd + (head + 1) * hd];
            o.fill(0.0);
            for (i, &s) in scores.iter().enumerate() {
                let w = s / sum;
                for (a, b) in o.iter_mut().zip(value(i)) {
                    *a += w * b;
                }
            }
        }
    }
}

fn add_into(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// What the CPU runner keeps for `--spec dflash`: the drafter (with its paged context) and the
/// target features of every row of the last forward. Nothing per sequence: a sequence's
/// context is the rows its blocks hold before its anchor, absorbed by the steps that computed
/// them (its own, or the request's that cached the blocks it hit).
pub(super) struct DflashState {
    pub(super) drafter: DflashDrafter,
    /// `[rows, feature_width]` of the last forward.
    pub(super) features: Vec<f32>,
    /// First row of each chunk of the last forward, then the row count.
    pub(super) chunk_rows: Vec<usize>,
}

impl DflashState {
    pub(super) fn new(drafter: DflashDrafter) -> Self {
        DflashState { drafter, features: Vec::new(), chunk_rows: Vec::new() }
    }

    /// `ModelRunner::dflash_absorb`.
    pub(super) fn absorb(&mut self, rows: &[DflashRows]) -> Result<()> {
        let width = self.drafter.feature_width();
        for r in rows.iter().filter(|r| r.rows > 0) {
            let (first, end) = match (self.chunk_rows.get(r.chunk), self.chunk_rows.get(r.chunk + 1)) {
                (Some(&a), Some(&b)) if a + r.rows <= b => (a, a + r.rows),
                _ => return Err(NinferError::invalid("dflash_absorb", format!("{} rows of chunk {} are not in the last forward", r.rows, r.chunk))),
            };
            self.drafter.absorb(&r.block_table, r.start_pos, &self.features[first * width..end * width])?;
        }
        Ok(())
    }

    /// `ModelRunner::dflash_draft`: every sequence in one drafting forward; greedy drafts, or
    /// for a sequence with `sampling` each depth's draft drawn from the drafter's distribution
    /// there (`spec::draw_draft`). The depths of a block are drafted together, so each q
    /// depends on the context and the anchor only, which the speculative sampling rule allows.
    pub(super) fn draft(&mut self, model: &CpuModel, seqs: &[DflashDraftSeq]) -> Result<Vec<MtpDraft>> {
        let bs = self.drafter.cfg.block_size;
        for s in seqs {
            if s.k >= bs {
                return Err(NinferError::invalid("dflash_draft", format!("{} drafts asked; the drafter's block gives {}", s.k, bs - 1)));
            }
            if let Some(d) = s.sampling.as_ref().filter(|d| d.u.len() < s.k) {
                return Err(NinferError::invalid("dflash_draft", format!("{} draft draws for {} drafts", d.u.len(), s.k)));
            }
        }
        let idx: Vec<usize> = (0..seqs.len()).filter(|&i| seqs[i].k > 0).collect();
        let mut out = vec![MtpDraft::default(); seqs.len()];
        if idx.is_empty() {
            return Ok(out);
        }
        let asked: Vec<DraftContext> = idx.iter().map(|&i| DraftContext { block_table: &seqs[i].block_table, len: seqs[i].pos, anchor: seqs[i].token }).collect();
        let logits = self.drafter.draft_logits(&model.weights, &asked)?;
        let vocab = model.cfg.vocab_size;
        for (&i, l) in idx.iter().zip(logits) {
            let rows = l.chunks_exact(vocab).take(seqs[i].k);
            out[i] = match &seqs[i].sampling {
                Some(s) => {
                    let (tokens, q) = rows.zip(&s.u).map(|(row, &u)| draw_draft(row, &s.warpers, u)).unzip();
                    MtpDraft { tokens, q }
                }
                None => MtpDraft { tokens: rows.map(argmax).collect(), q: Vec::new() },
            };
        }
        Ok(out)
    }
}

/// Copy the target features of one layer's output `x` `[rows, h]` into column block `slot` of
/// `out` `[rows, n_slots * h]`.
pub(super) fn capture_layer(x: &[f32], rows: usize, h: usize, slot: usize, n_slots: usize, out: &mut [f32]) {
    for r in 0..rows {
        out[r * n_slots * h + slot * h..r * n_slots * h + (slot + 1) * h].copy_from_slice(&x[r * h..(r + 1) * h]);
    }
}
