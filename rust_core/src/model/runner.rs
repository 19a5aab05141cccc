//! The contract between the engine and a model on some backend.
//!
//! The scheduler hands the model one flat step (several sequences, each a prefill chunk or a
//! single decode token) and gets logits back. Caches live with the model (they are backend
//! memory); the engine only hands out block ids and state-slot ids, which are pure bookkeeping.

use crate::config::ModelConfig;
use crate::sampling::{RowSampling, SampledToken};
use crate::{NinferError, Result};

/// Which logits rows a sequence wants from this step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitsWanted {
    /// A prefill chunk that does not reach the end of the prompt: no logits.
    None,
    /// Logits of the last token of the chunk (end of prompt, or a decode step).
    Last,
    /// Logits of every token of the chunk (scoring, perplexity, speculative verification).
    All,
}

/// One sequence's share of a step.
#[derive(Clone, Debug)]
pub struct SeqChunk {
    /// Tokens to run now: a prefill chunk or the single decode token.
    pub tokens: Vec<u32>,
    /// How many tokens of this sequence are already in the KV cache and recurrent state; the
    /// position of `tokens[0]`.
    pub start_pos: usize,
    /// KV block ids of this sequence, in order, covering positions `0..start_pos + tokens.len()`.
    pub block_table: Vec<u32>,
    /// Recurrent-state slot of this sequence (hybrid models); ignored by pure-attention models.
    pub state_slot: usize,
    /// Which logits rows to return.
    pub logits: LogitsWanted,
}

/// A whole engine step: every sequence that runs in it.
#[derive(Clone, Debug, Default)]
pub struct StepBatch {
    pub seqs: Vec<SeqChunk>,
}

impl StepBatch {
    /// Total tokens in the step (the scheduler's token budget counts these).
    pub fn num_tokens(&self) -> usize {
        self.seqs.iter().map(|s| s.tokens.len()).sum()
    }
}

/// Logits of a step: rows in sequence order; `rows[i]` is how many rows sequence `i` produced
/// (0, 1 or its chunk length, following its `LogitsWanted`).
#[derive(Clone, Debug, Default)]
pub struct Logits {
    pub vocab: usize,
    pub data: Vec<f32>,
    pub rows: Vec<usize>,
}

impl Logits {
    /// The logits rows of sequence `seq` (empty when it asked for none).
    pub fn of_seq(&self, seq: usize) -> &[f32] {
        let start: usize = self.rows[..seq].iter().sum();
        &self.data[start * self.vocab..(start + self.rows[seq]) * self.vocab]
    }

    /// Sample each sequence that produced rows from its last row with the host sampler, in
    /// sequence order: `rows[i]` belongs to the i-th such sequence. A row that `count_input`s
    /// is refused: the host does not know the step's input token (resolve it with
    /// `RowSampling::with_input`).
    pub fn sample_on_host(&self, rows: &[RowSampling]) -> Result<Vec<SampledToken>> {
        let seqs: Vec<usize> = (0..self.rows.len()).filter(|&i| self.rows[i] > 0).collect();
        check_sampling_rows(seqs.len(), rows.len())?;
        if rows.iter().any(|r| r.count_input) {
            return Err(NinferError::invalid("sampling rows", "a row counts its step's input token, which the host sampler does not know"));
        }
        Ok(seqs
            .iter()
            .zip(rows)
            .map(|(&i, row)| {
                let r = self.of_seq(i);
                row.sample(&r[r.len() - self.vocab..])
            })
            .collect())
    }
}

/// What a speculative verify step returns (`ModelRunner::forward_verify`): for each sequence
/// picked by argmax, its rows' tokens; for every other sequence, its logits rows as `forward`
/// gives them.
#[derive(Clone, Debug, Default)]
pub struct VerifyLogits {
    /// The logits rows of the sequences not picked by argmax (`rows[i]` is 0 for one that is).
    pub logits: Logits,
    /// `ids[i]`: the token picked at each row of sequence `i` when it was picked by argmax;
    /// empty otherwise.
    pub ids: Vec<Vec<u32>>,
}

impl VerifyLogits {
    /// Picks the rows of the sequences with an `argmax` row on the host from a step's `logits`
    /// (`RowSampling::sample`, the reference) and drops those rows from the logits.
    pub fn on_host(logits: Logits, argmax: &[Option<RowSampling>]) -> Result<VerifyLogits> {
        check_verify_rows(logits.rows.len(), argmax)?;
        let vocab = logits.vocab;
        let mut ids = vec![Vec::new(); logits.rows.len()];
        let mut kept = Logits { vocab, data: Vec::with_capacity(logits.data.len()), rows: logits.rows.clone() };
        for (i, pick) in argmax.iter().enumerate() {
            let rows = logits.of_seq(i);
            match pick {
                Some(row) => {
                    ids[i] = rows.chunks_exact(vocab.max(1)).map(|r| row.sample(r).token).collect();
                    kept.rows[i] = 0;
                }
                None => kept.data.extend_from_slice(rows),
            }
        }
        Ok(VerifyLogits { logits: kept, ids })
    }
}

/// `forward_verify` takes one entry per sequence of the batch; an argmax row must be greedy,
/// want no logprobs and know its input token.
pub fn check_verify_rows(seqs: usize, argmax: &[Option<RowSampling>]) -> Result<()> {
    if argmax.len() != seqs {
        return Err(NinferError::invalid("verify rows", format!("{} entries for {seqs} sequences", argmax.len())));
    }
    if argmax.iter().flatten().any(|r| !r.is_greedy() || r.wants_logprobs() || r.count_input) {
        return Err(NinferError::invalid("verify rows", "an argmax row must be greedy, without logprobs and without a pending input token"));
    }
    Ok(())
}

/// `forward_sampled` needs one `RowSampling` per sequence that produces logits.
pub fn check_sampling_rows(seqs_with_logits: usize, rows: usize) -> Result<()> {
    if seqs_with_logits != rows {
        return Err(NinferError::invalid("sampling rows", format!("{rows} rows for {seqs_with_logits} sequences that produce logits")));
    }
    Ok(())
}

/// One sequence's MTP rows to write from the last `forward` (`ModelRunner::mtp_absorb`): the
/// first `rows` rows of chunk `chunk` of that step, at positions `start_pos..start_pos + rows`,
/// each paired with the token after its position.
#[derive(Clone, Debug)]
pub struct MtpRows {
    /// The engine's id of the sequence (the runner keeps its last row's hidden state under it).
    pub key: u64,
    /// Index of the chunk in the last forward's batch.
    pub chunk: usize,
    pub start_pos: usize,
    /// The token after each row's position (`rows` of them).
    pub next_tokens: Vec<u32>,
    /// The sequence's block table, covering the rows.
    pub block_table: Vec<u32>,
}

/// One sequence to draft for (`ModelRunner::mtp_draft`): its verify chunk's input token at
/// `pos` (the MTP rows before it were absorbed) and `k` drafts after it.
#[derive(Clone, Debug)]
pub struct MtpDraftSeq {
    pub key: u64,
    pub pos: usize,
    pub token: u32,
    /// Covering at least `pos + k` positions (the verify chunk's table).
    pub block_table: Vec<u32>,
    pub k: usize,
    /// How a sampled request's drafts are drawn; None: greedy drafts (argmax).
    pub sampling: Option<DraftSampling>,
}

/// The draws of a sampled request's MTP or DFlash drafts: each draft token is drawn with
/// `u[depth]` from the drafter's logits under `warpers` (`spec::draft_warpers`), as
/// `spec::draw_draft` does.
#[derive(Clone, Debug)]
pub struct DraftSampling {
    pub warpers: RowSampling,
    /// One uniform in [0, 1) per draft, from the request's RNG.
    pub u: Vec<f64>,
}

/// The MTP or DFlash drafts of one sequence: the tokens and, for sampled drafts, the
/// distribution q each was drawn from (`[k][vocab]`; empty for greedy drafts, and for a runner that drafts greedily
/// for every request: the point-mass rule then verifies them, exactly but accepting fewer).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MtpDraft {
    pub tokens: Vec<u32>,
    pub q: Vec<Vec<f32>>,
}

/// One sequence's DFlash context rows to take from the last `forward`
/// (`ModelRunner::dflash_absorb`): the first `rows` rows of chunk `chunk` of that step, at
/// positions `start_pos..start_pos + rows` (what the step computed and kept).
#[derive(Clone, Debug)]
pub struct DflashRows {
    /// Index of the chunk in the last forward's batch.
    pub chunk: usize,
    pub start_pos: usize,
    pub rows: usize,
    /// The sequence's block table, covering the rows: the drafter's context is paged like the
    /// KV, so a prefix hit's blocks carry their context rows.
    pub block_table: Vec<u32>,
}

/// One sequence to draft for (`ModelRunner::dflash_draft`): the anchor `token` at `pos` (the
/// context rows before it were absorbed, by this sequence or, in prefix-cache blocks, by the
/// one that computed them) and `k` drafts after it.
#[derive(Clone, Debug)]
pub struct DflashDraftSeq {
    pub pos: usize,
    pub token: u32,
    /// Covering at least the `pos` context positions.
    pub block_table: Vec<u32>,
    pub k: usize,
    /// How a sampled request's drafts are drawn; None: greedy drafts (argmax).
    pub sampling: Option<DraftSampling>,
}

/// One recurrent-state rebuild (`ModelRunner::replay_states`): slot `dst` gets the state of
/// slot `src` advanced over tokens `start..start + tokens` of kept chunk `kept` (the index of
/// its chunk in the `keep_replay_inputs` call before the forward that kept it). `src` holds
/// the state after the chunk's token `start - 1` (before the chunk when `start` is 0) and is
/// only read; it is never `dst`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StateReplay {
    pub kept: usize,
    pub src: usize,
    pub dst: usize,
    pub start: usize,
    pub tokens: usize,
}

/// Check `replays` against `slots` state slots and `kept[j]`, the tokens of kept chunk j:
/// slots in range, each token range inside its chunk, every `dst` distinct and no `src` a
/// `dst` (the entries of one call run at once).
pub fn check_replays(replays: &[StateReplay], slots: usize, kept: &[usize]) -> Result<()> {
    for (i, r) in replays.iter().enumerate() {
        if r.src >= slots || r.dst >= slots {
            return Err(NinferError::invalid(format!("replays[{i}]"), format!("slots {} -> {} outside {slots} slots", r.src, r.dst)));
        }
        let have = kept.get(r.kept).copied().ok_or_else(|| NinferError::invalid(format!("replays[{i}].kept"), format!("chunk {} was not kept ({} were)", r.kept, kept.len())))?;
        if r.start + r.tokens > have {
            return Err(NinferError::invalid(format!("replays[{i}]"), format!("tokens {}..{} of a kept chunk of {have}", r.start, r.start + r.tokens)));
        }
        if replays.iter().enumerate().any(|(j, o)| o.src == r.dst || (j != i && o.dst == r.dst)) {
            return Err(NinferError::invalid(format!("replays[{i}].dst"), format!("slot {} is another replay's source or destination", r.dst)));
        }
    }
    Ok(())
}

/// What the caches of one model cost, so that the engine can plan memory before allocating.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheSpec {
    /// KV bytes one token takes across all attention layers.
    pub kv_bytes_per_token: usize,
    /// Recurrent-state bytes of one slot across all linear-attention layers (0 when none).
    pub state_bytes_per_slot: usize,
    /// Bytes of the weights as loaded.
    pub weight_bytes: usize,
}

/// A model loaded on a backend, ready to run steps.
pub trait ModelRunner: Send {
    /// The model's config.
    fn config(&self) -> &ModelConfig;

    /// Cache costs, for the memory ledger.
    fn cache_spec(&self) -> CacheSpec;

    /// Allocate the KV pool (`num_blocks` blocks of `block_size` tokens) and `num_state_slots`
    /// recurrent-state slots. Called once before the first step.
    fn allocate_caches(&mut self, num_blocks: usize, block_size: usize, num_state_slots: usize) -> Result<()>;

    /// Run one step. Sequences with `start_pos == 0` start from a zero recurrent state.
    fn forward(&mut self, batch: &StepBatch) -> Result<Logits>;

    /// Run one step and pick one token for every sequence whose `logits` is not `None`: `rows[i]`
    /// samples the last logits row of the i-th such sequence, in batch order. A device backend
    /// overrides this to sample where the logits are and copy back only ids and logprobs; the
    /// default runs `forward` and the host sampler (`RowSampling::sample`, the reference).
    fn forward_sampled(&mut self, batch: &StepBatch, rows: &[RowSampling]) -> Result<Vec<SampledToken>> {
        self.forward(batch)?.sample_on_host(rows)
    }

    /// Run a speculative verify step: `argmax[i]` (one per sequence of the batch) picks every
    /// logits row of sequence `i` with that greedy row (one row for every position: no
    /// grammar mask, no penalty history that the accepted drafts change), and only the picked ids come back for it; a sequence
    /// with None gets its logits rows, as `forward` gives them (sampled requests, per-position
    /// rows). A device backend overrides this to take the argmax where the logits are; the
    /// default runs `forward` and picks on the host (`VerifyLogits::on_host`).
    fn forward_verify(&mut self, batch: &StepBatch, argmax: &[Option<RowSampling>]) -> Result<VerifyLogits> {
        check_verify_rows(batch.seqs.len(), argmax)?;
        VerifyLogits::on_host(self.forward(batch)?, argmax)
    }

    /// Whether `launch_sampled` returns before its step has run on the device, so that the
    /// engine can queue the next decode step (fed its tokens on the device) while this one runs
    /// and the host turns the last results into outputs (asynchronous scheduling). Runners that
    /// say false are only driven through `forward_sampled`.
    fn overlaps_steps(&self) -> bool {
        false
    }

    /// Queue a step that `forward_sampled` would run, without waiting for it: its forward pass
    /// (`launch_forward`), then its sampling (`launch_sampling`). Its tokens come from
    /// `collect_sampled`, in launch order (at most two steps are uncollected at a time).
    fn launch_sampled(&mut self, batch: &StepBatch, rows: &[RowSampling], feed: bool) -> Result<()> {
        self.launch_forward(batch, feed)?;
        self.launch_sampling(rows)
    }

    /// Queue the forward pass of a step, without waiting for it and without sampling it: the
    /// engine then collects the step before it and builds this step's rows from the tokens it
    /// got (a grammar's allow-mask), while the device runs the forward. `launch_sampling` must
    /// follow before anything else is queued (it reads the logits this writes); a forward that
    /// is never sampled (a step that failed between the two) is abandoned by the next one.
    /// With `feed`, the step is all decodes whose sequence `i` continues the sequence sampled in
    /// row `i` of the step sampled just before, and its token is that row's sampled token, taken
    /// on the device (the batch's token is a placeholder).
    fn launch_forward(&mut self, _batch: &StepBatch, _feed: bool) -> Result<()> {
        Err(NinferError::invalid("launch_forward", "this backend runs steps synchronously (overlaps_steps is false)"))
    }

    /// Queue the sampling of the step whose forward `launch_forward` queued last: `rows[i]`
    /// samples the last logits row of its i-th sequence that produces logits; the tokens come
    /// from `collect_sampled`. A row of a fed step may `count_input` (it has penalties and was
    /// built before the token in flight was accepted): its sampler counts the step's input
    /// token as one more output occurrence, as `RowSampling::with_input` does on the host.
    fn launch_sampling(&mut self, _rows: &[RowSampling]) -> Result<()> {
        Err(NinferError::invalid("launch_sampling", "this backend runs steps synchronously (overlaps_steps is false)"))
    }

    /// The sampled tokens of the oldest launched step not yet collected (waits for it).
    fn collect_sampled(&mut self) -> Result<Vec<SampledToken>> {
        Err(NinferError::invalid("collect_sampled", "this backend runs steps synchronously (overlaps_steps is false)"))
    }

    /// Whether this runner verifies speculative drafts (`--spec`): its forward returns logits at
    /// every position of a multi-token decode chunk and `copy_state` restores a recurrent state
    /// exactly, which rollback needs.
    fn verifies_drafts(&self) -> bool {
        false
    }

    /// Set up drafting with the model's MTP head (`--spec mtp`), before `cache_spec` and
    /// `allocate_caches` (which then count and allocate the MTP layer's KV too). From then on
    /// `forward` keeps the final hidden state of every row it runs, for `mtp_absorb`.
    fn enable_mtp(&mut self) -> Result<()> {
        Err(NinferError::config("spec (--spec)", "--spec mtp is not supported on this backend yet"))
    }

    /// Draft with the MTP head over `token_ids` only (`--lm-head-draft`): its logits are
    /// computed for those rows of the LM head, the draft is the argmax among them. After
    /// `enable_mtp`.
    fn set_mtp_draft_vocab(&mut self, _token_ids: &[u32]) -> Result<()> {
        Err(NinferError::config("lm_head_draft (--lm-head-draft)", "--lm-head-draft is not supported on this backend yet"))
    }

    /// Write the MTP KV of the given rows of the last `forward` (what the step computed and
    /// accepted), replacing whatever the MTP KV held at those positions.
    fn mtp_absorb(&mut self, _rows: &[MtpRows]) -> Result<()> {
        Err(NinferError::invalid("mtp_absorb", "MTP drafting is not enabled"))
    }

    /// MTP drafts: `k` tokens after each sequence's input token, from the hidden state of its
    /// last absorbed row (at `pos - 1`), greedy or drawn as its `sampling` says.
    fn mtp_draft(&mut self, _seqs: &[MtpDraftSeq]) -> Result<Vec<MtpDraft>> {
        Err(NinferError::invalid("mtp_draft", "MTP drafting is not enabled"))
    }

    /// Forget what `mtp_absorb` kept for a sequence that ended.
    fn mtp_release(&mut self, _key: u64) {}

    /// Set up drafting with the DFlash drafter in `dir` (`--spec dflash --drafter DIR`), before
    /// `cache_spec` and `allocate_caches` (which then count and allocate the drafter's paged
    /// context per token, beside the KV). From then on `forward`
    /// keeps the outputs of the target layers the drafter reads, for `dflash_absorb`. Returns the
    /// drafter's block size (at most `block_size - 1` drafts per round).
    fn enable_dflash(&mut self, _dir: &std::path::Path) -> Result<usize> {
        Err(NinferError::config("spec (--spec)", "--spec dflash is not supported on this backend yet"))
    }

    /// Write the drafter context of the given rows of the last `forward` into the sequences'
    /// blocks; a sequence's context is then its positions up to the rows' end (what rejected
    /// drafts left past it is never read: the rollback).
    fn dflash_absorb(&mut self, _rows: &[DflashRows]) -> Result<()> {
        Err(NinferError::invalid("dflash_absorb", "DFlash drafting is not enabled"))
    }

    /// DFlash drafts: `k` tokens after each sequence's anchor, one drafting forward; greedy, or
    /// drawn from the drafter's distribution at each depth for a sequence with `sampling`.
    fn dflash_draft(&mut self, _seqs: &[DflashDraftSeq]) -> Result<Vec<MtpDraft>> {
        Err(NinferError::invalid("dflash_draft", "DFlash drafting is not enabled"))
    }

    /// Run once, after the engine's warm-up step, what would otherwise first run inside a
    /// request at another step size and cost it time then (CUDA: cuBLAS's kernels for each
    /// row bucket). Nothing it writes is read afterwards.
    fn warm_up_kernels(&mut self) -> Result<()> {
        Ok(())
    }

    /// Copy recurrent state slot `src` into `dst` (snapshots for prefix reuse).
    fn copy_state(&mut self, src: usize, dst: usize) -> Result<()>;

    /// Set up the rollback of recurrent states by replay (hybrid models under `--spec`): keep,
    /// for up to `seqs` verify chunks of up to `tokens` tokens a step, the per-token inputs of
    /// every linear-attention layer's recurrence (what its short conv and delta rule read), so
    /// that `replay_states` rebuilds a state without a forward. Returns false where the runner
    /// cannot (the engine then rolls back by recompute). Its buffers count in `workspace_bytes`.
    fn enable_state_replay(&mut self, _seqs: usize, _tokens: usize) -> Result<bool> {
        Ok(false)
    }

    /// The next `forward` (or `forward_verify`) keeps the recurrence inputs of its chunks
    /// `chunks[j]` as kept chunk j (`StateReplay::kept`), replacing what was kept before.
    /// After `enable_state_replay` returned true.
    fn keep_replay_inputs(&mut self, _chunks: &[usize]) -> Result<()> {
        Err(NinferError::invalid("keep_replay_inputs", "state replay is not enabled"))
    }

    /// Rebuild states from kept inputs (`StateReplay`), every entry's `dst` distinct and none
    /// another's `src`: each linear-attention layer's conv and recurrent state advanced over
    /// the kept tokens exactly as the forward that kept them advanced it, with no projection,
    /// attention or MLP run.
    fn replay_states(&mut self, _replays: &[StateReplay]) -> Result<()> {
        Err(NinferError::invalid("replay_states", "state replay is not enabled"))
    }

    /// Bytes the runner's step buffers (activations, scratch, step metadata) hold now. The
    /// engine reads it after its warm-up step of the largest size it will schedule, so that
    /// the startup ledger shows the real high-water mark, not an estimate.
    fn workspace_bytes(&self) -> usize {
        0
    }

    /// Bytes the device can give to the caches (KV pool and recurrent-state slots), planned
    /// before they are allocated: the runner first grows its step buffers to hold a step of
    /// `step_rows` tokens and a decode step of `decode_rows` sequences, all wanting logits (so
    /// they are not counted as free), then answers with the free memory less a reserve for what
    /// a step allocates later. None for host memory, where the engine keeps its fixed default
    /// budget (EngineConfig::resolve). The engine asks even with a KV capacity given (and then
    /// ignores the answer), so the step buffers are grown before the caches either way.
    fn cache_budget_bytes(&mut self, _step_rows: usize, _decode_rows: usize) -> Result<Option<u64>> {
        Ok(None)
    }

    /// Under speculative decoding, grows the step buffers (activations, logits, attention
    /// scratch, sampler, the MTP head's) to the largest verify step of up to `decode_rows`
    /// sequences with up to `max_drafts` drafts each in a step of `step_rows` tokens
    /// (`plan::verify_rows`), before the caches are planned (`cache_budget_bytes`): so that a
    /// start that fits does not run out of memory at its first speculative step, and the
    /// memory plan counts what it takes. Runners without device buffers do nothing.
    fn reserve_verify(&mut self, _step_rows: usize, _decode_rows: usize, _max_drafts: usize) -> Result<()> {
        Ok(())
    }

    /// Free memory of the device the runner allocates from, when the backend can tell (a
    /// CUDA device); None for host memory, which the caller measures itself.
    fn device_free_bytes(&self) -> Option<u64> {
        None
    }

    /// CUDA graphs of decode steps this runner holds (0 for backends without graphs); lets
    /// tests tell a replayed decode step from an eager one.
    fn decode_graphs(&self) -> usize {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The host route of a verify step: an argmax sequence gets the lowest id among tied maxima
    /// at each of its rows (`sampling::argmax`, the device greedy kernel's rule too) and its
    /// rows leave the logits; another sequence keeps its rows.
    #[test]
    fn verify_rows_on_the_host_pick_argmax_sequences_and_keep_the_others() {
        let data = vec![
            1.0, 3.0, 3.0, 0.0, // seq 0 row 0: tie of ids 1 and 2
            5.0, 1.0, 2.0, 5.0, // seq 0 row 1: tie of ids 0 and 3
            0.0, 1.0, 2.0, 3.0, // seq 2, host
            9.0, 0.0, 0.0, 0.0, // seq 2, host
            0.0, 0.0, 0.0, 1.0, // seq 3 (bias makes id 0 win)
        ];
        let logits = Logits { vocab: 4, data: data.clone(), rows: vec![2, 0, 2, 1] };
        let greedy = RowSampling { temperature: 0.0, ..Default::default() };
        let biased = RowSampling { logit_bias: vec![(0, 2.0)], ..greedy.clone() };
        let v = VerifyLogits::on_host(logits, &[Some(greedy.clone()), None, None, Some(biased)]).unwrap();
        assert_eq!(v.ids, vec![vec![1, 0], vec![], vec![], vec![0]]);
        assert_eq!(v.logits.rows, vec![0, 0, 2, 0]);
        assert_eq!(v.logits.of_seq(2), &data[8..16]);
        let sampled = RowSampling { temperature: 1.0, ..Default::default() };
        let logprobs = RowSampling { logprobs: true, ..greedy.clone() };
        for bad in [sampled, logprobs] {
            let l = Logits { vocab: 4, data: vec![0.0; 4], rows: vec![1] };
            assert!(VerifyLogits::on_host(l, &[Some(bad)]).is_err(), "only a greedy row without logprobs is picked by argmax");
        }
        let l = Logits { vocab: 4, data: vec![0.0; 4], rows: vec![1] };
        assert!(VerifyLogits::on_host(l, &[None, None]).is_err(), "one entry per sequence");
    }

    /// A row that counts its step's input token (a lookahead row with penalties) needs that
    /// token, which only the runner knows: the host sampler refuses it instead of sampling
    /// with one occurrence too few.
    #[test]
    fn the_host_sampler_refuses_a_row_that_counts_its_input_token() {
        let logits = Logits { vocab: 4, data: vec![0.0, 1.0, 3.0, 2.0], rows: vec![1] };
        let plain = RowSampling { temperature: 0.0, ..Default::default() };
        assert_eq!(logits.sample_on_host(std::slice::from_ref(&plain)).unwrap()[0].token, 2);
        let counting = RowSampling { count_input: true, ..plain };
        let e = logits.sample_on_host(&[counting]).unwrap_err().to_string();
        assert!(e.contains("input token"), "{e}");
    }
}
