//! `CpuModel`: a loaded model on the CPU backend, running engine steps.
//!
//! `weights` loads a checkpoint into host layouts (f32, or packed quantized projections where
//! `quant_load` says), `layers` runs each layer kind over a step, and `CpuModel` ties them into a
//! `ModelRunner`.

pub mod dflash;
pub mod layers;
pub mod mtp;
pub mod quant_load;
pub mod replay;
pub mod weights;

#[cfg(test)]
mod dflash_tests;
#[cfg(test)]
mod mtp_tests;
#[cfg(test)]
mod quant_tests;
#[cfg(test)]
mod tests;

use std::path::Path;
use std::sync::Arc;

use crate::artifact::WeightStore;
use crate::backend::cpu::attention::KvLayout;
use crate::backend::cpu::norm::rms_norm;
use crate::backend::cpu::rope::rope_tables;
use crate::config::ModelConfig;
use crate::model::runner::{CacheSpec, DflashDraftSeq, DflashRows, Logits, LogitsWanted, ModelRunner, MtpDraft, MtpDraftSeq, MtpRows, StateReplay, StepBatch};
use crate::model::{KvDtype, LoadOptions, LogitsRound};
use crate::{NinferError, Result};

use layers::{attention_step, fit, gdn_step, mlp_step, KeepLayer, LayerKv, LayerState, Workspace};
use weights::{Mixer, ModelWeights, MtpWeights};

/// KV pool and recurrent-state slots, per layer.
#[derive(Default)]
struct Caches {
    block_size: usize,
    num_blocks: usize,
    num_slots: usize,
    /// Per attention layer, `[num_blocks, block_size, n_kv_heads, head_dim]`.
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    /// Per linear-attention layer, `[slots, conv_dim, kernel - 1]`.
    conv: Vec<Vec<f32>>,
    /// Per linear-attention layer, `[slots, num_v_heads, k_dim, v_dim]`.
    delta: Vec<Vec<f32>>,
}

/// A model on the CPU backend (f32 weights, rayon pool of its own).
pub struct CpuModel {
    cfg: ModelConfig,
    weights: ModelWeights,
    /// Layer index -> index into the KV lists (attention) or the state lists (GDN).
    cache_index: Vec<usize>,
    inv_freq: Vec<f32>,
    rope_scale: f32,
    caches: Caches,
    ws: Workspace,
    pool: Arc<rayon::ThreadPool>,
    /// Where `forward` rounds the lm_head's sums (`LoadOptions::logits_dtype`), None for f32:
    /// every consumer of this model's logits (host sampling, logprobs, `Model.logits`) reads
    /// them after this one place.
    logits_round: Option<LogitsRound>,
    /// `--spec mtp`'s drafting state (`enable_mtp`); None otherwise.
    mtp_state: Option<mtp::MtpState>,
    /// `--spec dflash`'s drafter and the features of the last forward (`enable_dflash`).
    dflash_state: Option<dflash::DflashState>,
    /// The kept recurrence inputs of verify chunks (`enable_state_replay`).
    replay: Option<replay::ReplayBuffers>,
}

fn alloc(floats: usize, what: &str) -> Result<Vec<f32>> {
    let mut v = Vec::new();
    v.try_reserve_exact(floats).map_err(|_| NinferError::OutOfMemory {
        what: what.to_string(),
        needed: 4 * floats as u64,
        available: 0,
        hint: "lower --kv-capacity or --max-concurrency".into(),
    })?;
    v.resize(floats, 0.0);
    Ok(v)
}

impl CpuModel {
    /// Load config and weights from a HF model directory.
    pub fn load(dir: &Path, opts: &LoadOptions) -> Result<Self> {
        // The KV cache (`Caches`) is f32 whatever the checkpoint's dtype.
        opts.kv_dtype.check("cpu", KvDtype::Float32)?;
        let cfg = ModelConfig::from_dir(dir)?;
        let store = WeightStore::open(dir)?;
        let quant = quant_load::QuantSource::new(dir, &store, opts)?;
        let weights = ModelWeights::load(&store, &cfg, &quant)?;
        let logits_round = opts.logits_dtype.resolve(&store, &cfg)?;
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(opts.num_threads.unwrap_or(0))
            .thread_name(|i| format!("ninfer-cpu-{i}"))
            .build()
            .map_err(|e| NinferError::config("num_threads", e.to_string()))?;
        let cache_index = cfg.cache_index();
        let (inv_freq, rope_scale) = cfg.rope.inv_freq(cfg.head_dim);
        Ok(CpuModel { cfg, weights, cache_index, inv_freq, rope_scale, caches: Caches::default(), ws: Workspace::default(), pool: Arc::new(pool), logits_round, mtp_state: None, dflash_state: None, replay: None })
    }

    /// The MTP head, when the checkpoint has one.
    pub fn mtp(&self) -> Option<&MtpWeights> {
        self.weights.mtp.as_ref()
    }

    /// Threads of this model's pool.
    pub fn num_threads(&self) -> usize {
        self.pool.current_num_threads()
    }

    /// Bytes of the DFlash drafter's context pool (None without `--spec dflash`).
    pub fn dflash_context_bytes(&self) -> Option<usize> {
        self.dflash_state.as_ref().map(|st| st.drafter.context_bytes())
    }

    /// KV blocks and state slots currently allocated.
    pub fn cache_capacity(&self) -> (usize, usize, usize) {
        (self.caches.num_blocks, self.caches.block_size, self.caches.num_slots)
    }

    fn validate(&self, batch: &StepBatch) -> Result<()> {
        let c = &self.caches;
        let has_attn = !c.k.is_empty();
        let has_lin = !c.conv.is_empty() || self.cfg.num_linear_layers() > 0;
        if (has_attn || self.cfg.num_attention_layers() > 0) && c.block_size == 0 {
            return Err(NinferError::invalid("caches", "allocate_caches was not called before forward"));
        }
        for (i, s) in batch.seqs.iter().enumerate() {
            if s.tokens.is_empty() {
                return Err(NinferError::invalid(format!("seqs[{i}].tokens"), "empty chunk"));
            }
            if let Some(t) = s.tokens.iter().find(|&&t| t as usize >= self.cfg.vocab_size) {
                return Err(NinferError::invalid(format!("seqs[{i}].tokens"), format!("token id {t} >= vocab_size {}", self.cfg.vocab_size)));
            }
            if self.cfg.num_attention_layers() > 0 {
                let end = s.start_pos + s.tokens.len();
                let need = end.div_ceil(c.block_size);
                if s.block_table.len() < need {
                    return Err(NinferError::invalid(
                        format!("seqs[{i}].block_table"),
                        format!("{} blocks cover fewer than {end} positions (block size {})", s.block_table.len(), c.block_size),
                    ));
                }
                if let Some(b) = s.block_table[..need].iter().find(|&&b| b as usize >= c.num_blocks) {
                    return Err(NinferError::invalid(format!("seqs[{i}].block_table"), format!("block {b} >= num_blocks {}", c.num_blocks)));
                }
            }
            if has_lin && s.state_slot >= c.num_slots {
                return Err(NinferError::invalid(format!("seqs[{i}].state_slot"), format!("slot {} >= num_state_slots {}", s.state_slot, c.num_slots)));
            }
        }
        if has_lin {
            let mut slots: Vec<usize> = batch.seqs.iter().map(|s| s.state_slot).collect();
            slots.sort_unstable();
            if let Some(w) = slots.windows(2).find(|w| w[0] == w[1]) {
                return Err(NinferError::invalid("state_slot", format!("slot {} is used by two sequences of one step", w[0])));
            }
        }
        Ok(())
    }

    /// `forward`, also writing the final hidden state (after the model's norm, what the lm_head
    /// reads and what an MTP head is conditioned on) of every token of the step into `hidden`,
    /// `[num_tokens, hidden_size]` in batch order. The logits are those `forward` returns.
    pub fn forward_with_hidden(&mut self, batch: &StepBatch, hidden: &mut Vec<f32>) -> Result<Logits> {
        let pool = Arc::clone(&self.pool);
        pool.install(|| self.step(batch, Some(hidden), None))
    }

    /// `forward`, also writing the outputs of target layers `layer_ids` (0-based; the last
    /// layer's after the model's norm, as transformers reports it) of every token of the step
    /// into `features`, `[num_tokens, layer_ids.len() * hidden_size]`, layers concatenated in
    /// the given order: a DFlash drafter's context rows.
    pub fn forward_with_features(&mut self, batch: &StepBatch, layer_ids: &[usize], features: &mut Vec<f32>) -> Result<Logits> {
        let pool = Arc::clone(&self.pool);
        pool.install(|| self.step(batch, None, Some((layer_ids, features))))
    }

    fn step(&mut self, batch: &StepBatch, hidden_out: Option<&mut Vec<f32>>, mut features: Option<(&[usize], &mut Vec<f32>)>) -> Result<Logits> {
        self.validate(batch)?;
        let CpuModel { cfg, weights, cache_index, inv_freq, rope_scale, caches, ws, replay, .. } = self;
        let keep_chunks = match replay.as_mut() {
            Some(r) => r.take_pending(batch)?,
            None => Vec::new(),
        };
        let h = cfg.hidden_size;
        let rows = batch.num_tokens();
        if let Some(la) = cfg.linear_attention {
            let (conv_floats, delta_floats) = (la.conv_floats(), la.delta_floats());
            for s in batch.seqs.iter().filter(|s| s.start_pos == 0) {
                for (conv, delta) in caches.conv.iter_mut().zip(caches.delta.iter_mut()) {
                    conv[s.state_slot * conv_floats..(s.state_slot + 1) * conv_floats].fill(0.0);
                    delta[s.state_slot * delta_floats..(s.state_slot + 1) * delta_floats].fill(0.0);
                }
            }
        }
        let x = fit(&mut ws.x, rows * h);
        ws.positions.clear();
        let mut r = 0;
        for s in &batch.seqs {
            for (i, &tok) in s.tokens.iter().enumerate() {
                let t = tok as usize;
                x[r * h..(r + 1) * h].copy_from_slice(&weights.embed[t * h..(t + 1) * h]);
                ws.positions.push(s.start_pos + i);
                r += 1;
            }
        }
        rope_tables(&ws.positions, inv_freq, *rope_scale, &mut ws.cos, &mut ws.sin);
        let layout = KvLayout { block_size: caches.block_size, n_kv_heads: cfg.num_kv_heads, head_dim: cfg.head_dim };
        if let Some((ids, out)) = features.as_mut() {
            fit(out, rows * ids.len() * h);
        }
        for (li, layer) in weights.layers.iter().enumerate() {
            rms_norm(&ws.x, rows, h, &layer.input_norm, cfg.rms_norm_eps, fit(&mut ws.h, rows * h));
            let ci = cache_index[li];
            match &layer.mixer {
                Mixer::Attention(a) => {
                    let kv = LayerKv { k: &mut caches.k[ci], v: &mut caches.v[ci], layout };
                    attention_step(cfg, a, kv, batch, ws, rows);
                }
                Mixer::Gdn(g) => {
                    let st = LayerState { conv: &mut caches.conv[ci], delta: &mut caches.delta[ci] };
                    let keep = match replay.as_mut() {
                        Some(r) if !keep_chunks.is_empty() => Some(KeepLayer { chunks: &keep_chunks, tokens: r.tokens, layer: &mut r.layers[ci] }),
                        _ => None,
                    };
                    gdn_step(cfg, g, st, batch, ws, rows, keep);
                }
            }
            add_into(&mut ws.x[..rows * h], &ws.tmp[..rows * h]);
            rms_norm(&ws.x, rows, h, &layer.post_norm, cfg.rms_norm_eps, fit(&mut ws.h, rows * h));
            mlp_step(layer, ws, rows);
            add_into(&mut ws.x[..rows * h], &ws.tmp[..rows * h]);
            if let Some((ids, out)) = features.as_mut() {
                for (slot, _) in ids.iter().enumerate().filter(|(_, &id)| id == li) {
                    if li + 1 == weights.layers.len() {
                        rms_norm(&ws.x, rows, h, &weights.final_norm, cfg.rms_norm_eps, fit(&mut ws.h, rows * h));
                        dflash::capture_layer(&ws.h, rows, h, slot, ids.len(), out);
                    } else {
                        dflash::capture_layer(&ws.x, rows, h, slot, ids.len(), out);
                    }
                }
            }
        }
        if let Some(out) = hidden_out {
            rms_norm(&ws.x, rows, h, &weights.final_norm, cfg.rms_norm_eps, fit(out, rows * h));
        }
        let mut counts = Vec::with_capacity(batch.seqs.len());
        let mut picked = Vec::new();
        let mut r0 = 0;
        for s in &batch.seqs {
            let t = s.tokens.len();
            let n = match s.logits {
                LogitsWanted::None => 0,
                LogitsWanted::Last => {
                    picked.push(r0 + t - 1);
                    1
                }
                LogitsWanted::All => {
                    picked.extend(r0..r0 + t);
                    t
                }
            };
            counts.push(n);
            r0 += t;
        }
        let m = picked.len();
        let sel = fit(&mut ws.sel, m * h);
        for (i, &row) in picked.iter().enumerate() {
            sel[i * h..(i + 1) * h].copy_from_slice(&ws.x[row * h..(row + 1) * h]);
        }
        rms_norm(&ws.sel, m, h, &weights.final_norm, cfg.rms_norm_eps, fit(&mut ws.sel_normed, m * h));
        let vocab = cfg.vocab_size;
        let mut data = vec![0f32; m * vocab];
        weights.lm_head_forward(&ws.sel_normed, m, h, vocab, &mut data);
        if let Some(r) = self.logits_round {
            r.apply(&mut data);
        }
        Ok(Logits { vocab, data, rows: counts })
    }
}

fn add_into(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

impl ModelRunner for CpuModel {
    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn cache_spec(&self) -> CacheSpec {
        // The plan's arithmetic (plan/mod.rs), so that `ninfer plan` and this ledger agree, plus
        // a DFlash drafter's context and weights under --spec dflash.
        let spec = crate::plan::cache_spec(&self.cfg, crate::plan::Target::Cpu, self.mtp_state.is_some(), self.weights.bytes());
        let (dflash_kv, dflash_weights) = self.dflash_state.as_ref().map_or((0, 0), |d| (d.drafter.context_bytes_per_token(), d.drafter.weight_bytes()));
        CacheSpec { kv_bytes_per_token: spec.kv_bytes_per_token + dflash_kv, weight_bytes: spec.weight_bytes + dflash_weights, ..spec }
    }

    fn allocate_caches(&mut self, num_blocks: usize, block_size: usize, num_state_slots: usize) -> Result<()> {
        if block_size == 0 {
            return Err(NinferError::config("block_size", "must be positive"));
        }
        let c = &self.cfg;
        let kv_floats = num_blocks * block_size * c.num_kv_heads * c.head_dim;
        let mut caches = Caches { block_size, num_blocks, num_slots: num_state_slots, ..Default::default() };
        // Free the old pool first so that a resize does not need both at once.
        self.caches = Caches::default();
        for _ in 0..c.num_attention_layers() {
            caches.k.push(alloc(kv_floats, "KV cache")?);
            caches.v.push(alloc(kv_floats, "KV cache")?);
        }
        if let Some(la) = c.linear_attention {
            for _ in 0..c.num_linear_layers() {
                caches.conv.push(alloc(num_state_slots * la.conv_floats(), "recurrent state")?);
                caches.delta.push(alloc(num_state_slots * la.delta_floats(), "recurrent state")?);
            }
        }
        self.caches = caches;
        if let Some(mut st) = self.mtp_state.take() {
            let r = st.drafter.allocate(self, num_blocks, block_size);
            self.mtp_state = Some(st);
            r?;
        }
        if let Some(st) = self.dflash_state.as_mut() {
            st.drafter.allocate(num_blocks, block_size)?;
        }
        Ok(())
    }

    fn forward(&mut self, batch: &StepBatch) -> Result<Logits> {
        let pool = Arc::clone(&self.pool);
        if let Some(st) = self.dflash_state.as_mut() {
            // Keep every row's context features for `dflash_absorb`.
            let mut features = std::mem::take(&mut st.features);
            let ids = st.drafter.cfg.target_layer_ids.clone();
            let logits = pool.install(|| self.step(batch, None, Some((&ids, &mut features))));
            let st = self.dflash_state.as_mut().expect("checked above");
            st.features = features;
            st.chunk_rows = chunk_starts(batch);
            return logits;
        }
        let Some(st) = self.mtp_state.as_mut() else { return pool.install(|| self.step(batch, None, None)) };
        // Keep every row's hidden state for `mtp_absorb`.
        let mut hidden = std::mem::take(&mut st.hidden);
        let logits = pool.install(|| self.step(batch, Some(&mut hidden), None));
        let st = self.mtp_state.as_mut().expect("checked above");
        st.hidden = hidden;
        st.chunk_rows.clear();
        st.chunk_rows.push(0);
        for s in &batch.seqs {
            st.chunk_rows.push(st.chunk_rows.last().copied().unwrap_or(0) + s.tokens.len());
        }
        logits
    }

    fn enable_mtp(&mut self) -> Result<()> {
        if self.mtp_state.is_none() {
            self.mtp_state = Some(mtp::MtpState::new(mtp::MtpDrafter::new(self)?));
        }
        Ok(())
    }

    fn set_mtp_draft_vocab(&mut self, token_ids: &[u32]) -> Result<()> {
        let mut st = self.mtp_state.take().ok_or_else(|| NinferError::invalid("set_mtp_draft_vocab", "MTP drafting is not enabled"))?;
        let r = st.drafter.set_draft_vocab(self, token_ids);
        self.mtp_state = Some(st);
        r
    }

    fn mtp_absorb(&mut self, rows: &[MtpRows]) -> Result<()> {
        let mut st = self.mtp_state.take().ok_or_else(|| NinferError::invalid("mtp_absorb", "MTP drafting is not enabled"))?;
        let r = st.absorb(self, rows);
        self.mtp_state = Some(st);
        r
    }

    fn mtp_draft(&mut self, seqs: &[MtpDraftSeq]) -> Result<Vec<MtpDraft>> {
        let mut st = self.mtp_state.take().ok_or_else(|| NinferError::invalid("mtp_draft", "MTP drafting is not enabled"))?;
        let r = st.draft(self, seqs);
        self.mtp_state = Some(st);
        r
    }

    fn mtp_release(&mut self, key: u64) {
        if let Some(st) = self.mtp_state.as_mut() {
            st.release(key);
        }
    }

    fn enable_dflash(&mut self, dir: &Path) -> Result<usize> {
        let mut drafter = dflash::DflashDrafter::load(dir, &self.cfg)?;
        if self.caches.block_size > 0 {
            drafter.allocate(self.caches.num_blocks, self.caches.block_size)?;
        }
        let block_size = drafter.cfg.block_size;
        self.dflash_state = Some(dflash::DflashState::new(drafter));
        Ok(block_size)
    }

    fn dflash_absorb(&mut self, rows: &[DflashRows]) -> Result<()> {
        let pool = Arc::clone(&self.pool);
        let st = self.dflash_state.as_mut().ok_or_else(|| NinferError::invalid("dflash_absorb", "DFlash drafting is not enabled"))?;
        pool.install(|| st.absorb(rows))
    }

    fn dflash_draft(&mut self, seqs: &[DflashDraftSeq]) -> Result<Vec<MtpDraft>> {
        let mut st = self.dflash_state.take().ok_or_else(|| NinferError::invalid("dflash_draft", "DFlash drafting is not enabled"))?;
        let pool = Arc::clone(&self.pool);
        let r = pool.install(|| st.draft(self, seqs));
        self.dflash_state = Some(st);
        r
    }

    fn workspace_bytes(&self) -> usize {
        self.ws.bytes() + self.replay.as_ref().map_or(0, replay::ReplayBuffers::bytes)
    }

    fn enable_state_replay(&mut self, seqs: usize, tokens: usize) -> Result<bool> {
        if self.cfg.num_linear_layers() == 0 {
            return Ok(false);
        }
        self.replay = None;
        self.replay = Some(replay::ReplayBuffers::new(&self.cfg, seqs, tokens)?);
        Ok(true)
    }

    fn keep_replay_inputs(&mut self, chunks: &[usize]) -> Result<()> {
        let r = self.replay.as_mut().ok_or_else(|| NinferError::invalid("keep_replay_inputs", "state replay is not enabled"))?;
        r.pending = chunks.to_vec();
        Ok(())
    }

    fn replay_states(&mut self, replays: &[StateReplay]) -> Result<()> {
        let r = self.replay.as_ref().ok_or_else(|| NinferError::invalid("replay_states", "state replay is not enabled"))?;
        let gdn: Vec<&weights::GdnWeights> = self
            .weights
            .layers
            .iter()
            .filter_map(|l| match &l.mixer {
                Mixer::Gdn(g) => Some(g),
                Mixer::Attention(_) => None,
            })
            .collect();
        let (cfg, caches) = (&self.cfg, &mut self.caches);
        self.pool.install(|| replay::replay_states(cfg, &gdn, &mut caches.conv, &mut caches.delta, r, caches.num_slots, replays))
    }

    fn verifies_drafts(&self) -> bool {
        true
    }

    fn copy_state(&mut self, src: usize, dst: usize) -> Result<()> {
        let slots = self.caches.num_slots;
        if src >= slots || dst >= slots {
            return Err(NinferError::invalid("state_slot", format!("copy {src} -> {dst} outside {slots} slots")));
        }
        if src == dst {
            return Ok(());
        }
        for buf in self.caches.conv.iter_mut().chain(self.caches.delta.iter_mut()) {
            let per = buf.len() / slots;
            buf.copy_within(src * per..(src + 1) * per, dst * per);
        }
        Ok(())
    }
}

/// First row of each chunk of `batch`, then the row count.
fn chunk_starts(batch: &StepBatch) -> Vec<usize> {
    let mut rows = Vec::with_capacity(batch.seqs.len() + 1);
    rows.push(0);
    for s in &batch.seqs {
        rows.push(rows.last().copied().unwrap_or(0) + s.tokens.len());
    }
    rows
}
