//! Uniform speculative verify steps: every sequence brings its decode token and K drafts
//! (K + 1 tokens), wants logits at each, and no prompt chunk shares the step. Such a step is
//! padded to its bucket of sequences and replayed as a CUDA graph keyed (bucket, block-table
//! stride, K + 1) (`GraphKey`), captured on first use; with graphs off the same padded launches
//! run eagerly, so the logits agree bit for bit. Its kernels are the eager prefill pass's for
//! chunks of K + 1 tokens (projections, rotation, cache write, flash attention, the recurrent
//! Gated DeltaNet), over metadata in buffers of their own (`vmeta`), so a row's arithmetic is the
//! eager path's. Steps that mix verify chunks with prompt chunks or plain decodes, or whose
//! sequences verify different K, run the eager prefill path (`run`).
//!
//! Rollback is the engine's (engine/speculation.rs): it copies each sequence's recurrent state
//! aside before the step (`copy_state`) and, where a draft is rejected, rebuilds it by replay
//! (model/cuda/replay.rs: every verify graph copies the GDN layers' kept input rows, which a
//! step that keeps nothing leaves unnamed); the step itself, as the eager one, leaves the state
//! after its last token.

use crate::backend::cuda::device::driver_err;
use crate::model::runner::{LogitsWanted, StepBatch};
use crate::Result;

use super::buffers::{buf, buf_mut};
use super::forward::Pass;
use super::graphs::{decode_bucket, GraphKey, VERIFY_MAX_ROWS};
use super::route::MixerRoute;
use super::step_meta::PaddedShape;
use super::CudaModel;

/// The tokens each sequence brings when `batch` is a uniform verify step (every sequence the
/// same 2..=VERIFY_MAX_ROWS tokens after a prefilled prefix, each wanting its logits), else
/// None. A chunk at position 0 is a prompt's, never a verify chunk.
pub(super) fn uniform_verify_rows(batch: &StepBatch) -> Option<usize> {
    let r = batch.seqs.first()?.tokens.len();
    let uniform = batch.seqs.iter().all(|q| q.tokens.len() == r && q.logits == LogitsWanted::All && q.start_pos > 0);
    (uniform && (2..=VERIFY_MAX_ROWS).contains(&r)).then_some(r)
}

/// How a verify step's attention runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum VerifyAttention {
    /// Flash attention, as the eager prefill path runs it.
    Flash,
    /// Decode attention over the split-K scratch: each row attends to its own prefix through
    /// its sequence's block table, after every row's K/V was written.
    Decode,
}

impl VerifyAttention {
    /// Flash attention where it serves every attention layer (`flash_everywhere`: the layers'
    /// routes and the device), else decode attention, but only without programmatic dependent
    /// launch (`pdl`): under PDL decode attention loads every key but a token's newest before
    /// waiting for the kernel before it (ops/decode_attention.rs), and in a verify step that
    /// kernel wrote K + 1 keys of each sequence. None: such steps run the eager prefill path
    /// (paged attention, whose partials are allocated per launch, cannot be captured).
    pub(super) fn choose(flash_everywhere: bool, pdl: bool) -> Option<Self> {
        if flash_everywhere {
            Some(VerifyAttention::Flash)
        } else if !pdl {
            Some(VerifyAttention::Decode)
        } else {
            None
        }
    }
}

impl CudaModel {
    /// How this model's verify steps attend on this device (`VerifyAttention::choose`).
    pub(super) fn verify_attention(&self) -> Option<VerifyAttention> {
        let flash = self.dev.has_flash_attention() && self.routes.iter().all(|r| !matches!(r.mixer, MixerRoute::Attention(a) if !a.flash_prefill));
        VerifyAttention::choose(flash, self.dev.plan().pdl)
    }

    /// `ModelRunner::reserve_verify`: the buffers of the largest verify step
    /// (`plan::verify_rows`, its sequences padded to the decode buckets as `verify_step` pads
    /// them) grown now: the activations and the decode attention's scratch of its padded rows,
    /// the logits and the device sampler's buffers of every row that wants logits, and the MTP
    /// head's step buffers.
    pub(super) fn reserve_verify_rows(&mut self, step_rows: usize, decode_rows: usize, max_drafts: usize) -> Result<()> {
        let (padded, logits) = crate::plan::verify_rows(step_rows, decode_rows, max_drafts, decode_bucket);
        self.ensure_rows(padded)?;
        self.ensure_logit_rows(logits)?;
        if self.verify_attention() == Some(VerifyAttention::Decode) {
            self.ensure_scratch(padded)?;
        }
        if self.sampler.enabled() {
            self.sampler.reserve(&self.dev, logits, self.cfg.vocab_size)?;
        }
        let h = self.cfg.hidden_size;
        if let Some(mtp) = self.mtp.as_mut() {
            mtp.reserve(&self.dev, padded.max(step_rows), step_rows, h)?;
        }
        Ok(())
    }

    /// A uniform verify step of `r` tokens a sequence: padded to its `GraphKey` and replayed
    /// as a graph (captured on first use), or run eagerly over the same padded rows when
    /// graphs are off. The real sequences' rows come first, so their logits are the first
    /// n x r rows of `act.logits`, in order.
    pub(super) fn verify_step(&mut self, batch: &StepBatch, r: usize, attention: VerifyAttention) -> Result<Vec<usize>> {
        let n = batch.seqs.len();
        let bs = self.caches.block_size.max(1);
        let blocks = batch.seqs.iter().map(|q| (q.start_pos + r).div_ceil(bs)).max().unwrap_or(1);
        let key = GraphKey::of(n, r, blocks);
        let rows = key.rows();
        self.ensure_rows(rows)?;
        self.ensure_logit_rows(rows)?;
        if attention == VerifyAttention::Decode {
            self.ensure_scratch(rows)?;
        }
        self.dev.context().bind_to_thread().map_err(driver_err("binding the CUDA context"))?;
        let shape = PaddedShape { seqs: key.seqs, rows_per_seq: r, stride: key.stride };
        if self.vmeta.upload_padded(&self.dev, batch, shape, bs, self.caches.num_slots)? {
            self.graphs.clear();
        }
        self.zero_new_states(batch)?;
        self.replay_or_run(key, "verify", |m| m.verify_forward(rows, r))?;
        // The verify forward leaves the final normed hidden states in act.h.
        self.keep_hidden(batch, n * r)?;
        self.keep_dflash(batch, n * r)?;
        self.logits_rows = n * r;
        Ok(vec![r; n])
    }

    /// Queues a verify step's forward over `rows` (padded) rows of `vmeta`, `r` a sequence,
    /// logits of every row into `act.logits`: the layers, then the final norm and the lm_head
    /// as the eager path runs them. Nothing here allocates or synchronizes (graphs capture it).
    fn verify_forward(&mut self, rows: usize, r: usize) -> Result<()> {
        self.run_layers(Pass::Verify { rows_per_seq: r }, rows)?;
        let CudaModel { cfg, dev, weights, act, logits_round, .. } = self;
        let (h, eps, plus_one) = (cfg.hidden_size, cfg.rms_norm_eps, weights.norm_plus_one);
        dev.add_rmsnorm(buf_mut(&mut act.x), buf(&act.tmp), &weights.final_norm, buf_mut(&mut act.h), rows, h, eps, plus_one)?;
        weights.logits(dev, buf(&act.h), buf_mut(&mut act.logits), rows, cfg.vocab_size, h, *logits_round)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::runner::SeqChunk;

    fn seq(n: usize, logits: LogitsWanted) -> SeqChunk {
        SeqChunk { tokens: vec![3; n], start_pos: 10, block_table: vec![0], state_slot: 0, logits }
    }

    #[test]
    fn only_steps_of_equal_verify_chunks_wanting_every_row_are_uniform() {
        let batch = |seqs: Vec<SeqChunk>| StepBatch { seqs };
        use LogitsWanted::{All, Last, None as Nothing};
        assert_eq!(uniform_verify_rows(&batch(vec![seq(4, All)])), Some(4));
        assert_eq!(uniform_verify_rows(&batch(vec![seq(2, All), seq(2, All), seq(2, All)])), Some(2));
        assert_eq!(uniform_verify_rows(&batch(vec![seq(VERIFY_MAX_ROWS, All)])), Some(VERIFY_MAX_ROWS));
        // Mixed K, a plain decode beside, a prompt chunk beside (logits of its last row or none),
        // a decode step, a chunk longer than any verify chunk, no sequence: the eager paths.
        assert_eq!(uniform_verify_rows(&batch(vec![seq(4, All), seq(6, All)])), None);
        assert_eq!(uniform_verify_rows(&batch(vec![seq(4, All), seq(1, Last)])), None);
        assert_eq!(uniform_verify_rows(&batch(vec![seq(4, All), seq(4, Last)])), None);
        assert_eq!(uniform_verify_rows(&batch(vec![seq(4, All), seq(4, Nothing)])), None);
        assert_eq!(uniform_verify_rows(&batch(vec![seq(1, All)])), None);
        assert_eq!(uniform_verify_rows(&batch(vec![seq(VERIFY_MAX_ROWS + 1, All)])), None);
        assert_eq!(uniform_verify_rows(&batch(vec![])), None);
        // A whole prompt scored at every position.
        let prompt = SeqChunk { start_pos: 0, ..seq(4, All) };
        assert_eq!(uniform_verify_rows(&batch(vec![seq(4, All), prompt])), None);
    }

    #[test]
    fn verify_attention_is_flash_where_it_serves_and_decode_attention_only_without_pdl() {
        assert_eq!(VerifyAttention::choose(true, true), Some(VerifyAttention::Flash));
        assert_eq!(VerifyAttention::choose(true, false), Some(VerifyAttention::Flash));
        assert_eq!(VerifyAttention::choose(false, false), Some(VerifyAttention::Decode));
        assert_eq!(VerifyAttention::choose(false, true), None);
    }
}
