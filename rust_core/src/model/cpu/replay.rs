//! Rollback of the Gated DeltaNet states by replay (`ModelRunner::replay_states`): a verify
//! forward keeps, per GDN layer and verify-chunk token, the recurrence's inputs (conv inputs,
//! decay log g, beta); a rollback then runs only the conv and the delta rule over the accepted
//! tokens from the state kept before the chunk (`layers::gdn_recurrence`, the forward's own
//! code), so the rebuilt state is the forward's bit for bit.

use rayon::prelude::*;

use crate::config::ModelConfig;
use crate::model::runner::{check_replays, StateReplay, StepBatch};
use crate::{NinferError, Result};

use super::alloc;
use super::layers::{gdn_recurrence, RecurrenceScratch};
use super::weights::GdnWeights;

/// One GDN layer's kept inputs: `[seqs, tokens, conv_dim]` conv inputs, `[seqs, tokens,
/// num_value_heads]` g and beta.
pub struct KeptLayer {
    pub conv_in: Vec<f32>,
    pub g: Vec<f32>,
    pub beta: Vec<f32>,
}

/// The kept inputs of every GDN layer, for up to `seqs` chunks of up to `tokens` tokens.
pub struct ReplayBuffers {
    pub seqs: usize,
    pub tokens: usize,
    pub layers: Vec<KeptLayer>,
    /// Chunks of the next forward to keep (`keep_replay_inputs`).
    pub pending: Vec<usize>,
    /// Tokens of each chunk the last keeping forward kept.
    pub kept: Vec<usize>,
}

impl ReplayBuffers {
    pub fn new(cfg: &ModelConfig, seqs: usize, tokens: usize) -> Result<Self> {
        let la = cfg.linear_attention.ok_or_else(|| NinferError::invalid("enable_state_replay", "the model has no linear-attention layers"))?;
        let (cd, nv) = (la.conv_dim(), la.num_value_heads);
        let mut layers = Vec::with_capacity(cfg.num_linear_layers());
        for _ in 0..cfg.num_linear_layers() {
            let n = seqs * tokens;
            layers.push(KeptLayer { conv_in: alloc(n * cd, "replay inputs")?, g: alloc(n * nv, "replay inputs")?, beta: alloc(n * nv, "replay inputs")? });
        }
        Ok(ReplayBuffers { seqs, tokens, layers, pending: Vec::new(), kept: Vec::new() })
    }

    pub fn bytes(&self) -> usize {
        self.layers.iter().map(|l| 4 * (l.conv_in.len() + l.g.len() + l.beta.len())).sum()
    }

    /// For a forward of `batch`: the kept index of each of its chunks (None: not kept), from
    /// the pending chunks, checked against the buffers; empty when nothing is pending.
    pub fn take_pending(&mut self, batch: &StepBatch) -> Result<Vec<Option<usize>>> {
        if self.pending.is_empty() {
            return Ok(Vec::new());
        }
        let pending = std::mem::take(&mut self.pending);
        if pending.len() > self.seqs {
            return Err(NinferError::invalid("keep_replay_inputs", format!("{} chunks kept, buffers for {}", pending.len(), self.seqs)));
        }
        let mut of_chunk = vec![None; batch.seqs.len()];
        self.kept.clear();
        for (j, &i) in pending.iter().enumerate() {
            let t = batch.seqs.get(i).map(|c| c.tokens.len()).ok_or_else(|| NinferError::invalid("keep_replay_inputs", format!("chunk {i} of a step of {}", batch.seqs.len())))?;
            if t > self.tokens || of_chunk[i].is_some() {
                return Err(NinferError::invalid("keep_replay_inputs", format!("chunk {i}: {t} tokens kept twice or past the buffers' {}", self.tokens)));
            }
            of_chunk[i] = Some(j);
            self.kept.push(t);
        }
        Ok(of_chunk)
    }
}

/// Run `replays` on every GDN layer (layers in parallel): each `dst` slot gets its `src`
/// slot's conv and delta state, then the recurrence over its kept tokens.
pub fn replay_states(cfg: &ModelConfig, gdn: &[&GdnWeights], conv: &mut [Vec<f32>], delta: &mut [Vec<f32>], buffers: &ReplayBuffers, slots: usize, replays: &[StateReplay]) -> Result<()> {
    check_replays(replays, slots, &buffers.kept)?;
    let la = cfg.linear_attention.ok_or_else(|| NinferError::invalid("replay_states", "the model has no linear-attention layers"))?;
    let (cd, nv, cap) = (la.conv_dim(), la.num_value_heads, buffers.tokens);
    let (conv_floats, delta_floats) = (la.conv_floats(), la.delta_floats());
    gdn.par_iter().zip(conv.par_iter_mut()).zip(delta.par_iter_mut()).zip(buffers.layers.par_iter()).for_each(|(((g, conv), delta), kept)| {
        let mut s = RecurrenceScratch::default();
        for r in replays {
            conv.copy_within(r.src * conv_floats..(r.src + 1) * conv_floats, r.dst * conv_floats);
            delta.copy_within(r.src * delta_floats..(r.src + 1) * delta_floats, r.dst * delta_floats);
            if r.tokens == 0 {
                continue;
            }
            let row = r.kept * cap + r.start;
            let conv_in = &kept.conv_in[row * cd..(row + r.tokens) * cd];
            let (gb, beta) = (&kept.g[row * nv..(row + r.tokens) * nv], &kept.beta[row * nv..(row + r.tokens) * nv]);
            let c = &mut conv[r.dst * conv_floats..(r.dst + 1) * conv_floats];
            let d = &mut delta[r.dst * delta_floats..(r.dst + 1) * delta_floats];
            gdn_recurrence(cfg, g, conv_in, gb, beta, r.tokens, c, d, &mut s);
        }
    });
    Ok(())
}
