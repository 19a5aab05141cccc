//! The speculative engine step (`--spec`): drafts proposed for every decoding request, one
//! forward that runs each draft as a verify chunk beside the step's other decodes and prompt
//! chunks, acceptance position by position (`spec::accept_draft`), and the exact rollback of
//! what the rejected draft tokens wrote.
//!
//! Rollback: the attention KV of rejected positions is simply not counted (the sequence's
//! computed length stops at the accepted tokens, blocks that held only rejected tokens go back
//! to the pool, and only blocks of accepted tokens are hashed into the prefix cache). The Gated
//! DeltaNet conv and recurrent states are rebuilt by replay: the state before the verify chunk
//! is copied into a rollback slot, the verify forward keeps each layer's recurrence inputs of
//! the chunk (`ModelRunner::keep_replay_inputs`), and where a draft token is rejected the
//! runner runs only the conv and delta rule over the accepted tokens from the kept state
//! (`ModelRunner::replay_states`). Rebuilding by recompute (a second forward over the input
//! token and the accepted drafts) cost about one whole extra forward per round with a rejection
//! at the 27B shape (a round 2.4x a decode step against 1.1x for the verify step alone), and
//! keeping every position's full state instead is ~150 MB a position there; a runner without
//! replay still rolls back by recompute. The rebuild stops at a block boundary the accepted
//! tokens reach to take the decode snapshot there, so snapshots hold accepted tokens only.

use super::core::EngineCore;
use super::request::RowInput;
use super::RequestOutput;
use crate::model::{DflashDraftSeq, DflashRows, DraftSampling, LogitsWanted, MtpDraftSeq, MtpRows, SeqChunk, StateReplay, StepBatch};
use crate::sched::{ScheduledStep, SeqOutcome};
use crate::spec::{accept_draft, draft_warpers, SpecMethod};
use crate::{NinferError, Result};

impl EngineCore {
    /// One step with speculation on: propose, schedule, verify, accept, roll back, settle.
    pub(super) fn step_speculative(&mut self) -> Result<Vec<RequestOutput>> {
        self.propose_drafts();
        let (mut step, mut outputs) = self.schedule()?;
        if step.is_empty() {
            return Ok(outputs);
        }
        let started = std::time::Instant::now();
        // The distributions sampled requests' drafts were drawn from.
        let draft_q = match self.speculation.as_ref().map(|(s, _)| s.method) {
            Some(SpecMethod::Dflash) => self.fill_dflash_drafts(&mut step)?,
            _ => self.fill_mtp_drafts(&mut step)?,
        };
        // The drafters' rows of a step are written before the step is accounted (`account`
        // publishes the blocks it filled to the prefix cache): a failure in between leaves no
        // cached block without them.
        if step.num_draft_tokens() == 0 {
            let sampled = self.run_unaccounted(&step)?;
            let (outs, outcomes) = self.postprocess(&step, sampled)?;
            self.absorb_mtp(&step, &outcomes)?;
            self.absorb_dflash(&step, &outcomes)?;
            self.account(&step)?;
            self.settle(&outcomes, None)?;
            self.time_step(&step, started);
            outputs.extend(outs);
            return Ok(outputs);
        }
        self.restore_states(&step)?;
        // The state before each verify chunk, kept for its rollback (hybrid models).
        let mut rollback = Vec::new();
        if self.cfg.rollback_state_slots > 0 {
            for (i, chunk) in step.batch.seqs.iter().enumerate().filter(|(i, _)| step.draft_len(*i) > 0) {
                let keep = self.rollback_slot_base + rollback.len();
                self.runner.copy_state(chunk.state_slot, keep)?;
                rollback.push((i, keep));
            }
            if self.replays_states {
                self.runner.keep_replay_inputs(&rollback.iter().map(|&(i, _)| i).collect::<Vec<_>>())?;
            }
        }
        let argmax = self.verify_argmax_rows(&step);
        let verified = self.runner.forward_verify(&step.batch, &argmax)?;
        let (logits, ids) = (&verified.logits, &verified.ids);
        let vocab = logits.vocab;
        let mut outcomes = Vec::new();
        let mut accepted_drafts = vec![0; step.seq_ids.len()];
        for (i, (&id, chunk)) in step.seq_ids.iter().zip(&step.batch.seqs).enumerate() {
            if chunk.logits == LogitsWanted::None {
                continue;
            }
            let rows = logits.of_seq(i);
            let picked = &ids[i];
            let cached = self.sched.cached_tokens(id);
            let Some(req) = self.requests.get_mut(&id) else { continue };
            let k = step.draft_len(i);
            let draft = &chunk.tokens[chunk.tokens.len() - k..];
            let first_row = if argmax[i].is_some() { picked.len() } else { rows.len() / vocab } - (k + 1);
            let (tokenizer, eos, rule) = (self.tokenizer.as_deref(), &self.eos_token_ids, self.draft_rule);
            let q = draft_q.get(i).map_or(&[][..], Vec::as_slice);
            let mut delta: Option<RequestOutput> = None;
            let accepted = accept_draft(draft, |j| {
                // Picked on the runner: the same greedy row at every position, nothing else
                // wanted of the logits.
                if argmax[i].is_some() {
                    let event = req.accept(picked[first_row + j], None, tokenizer, eos, cached)?;
                    match delta.as_mut() {
                        Some(d) => d.merge(event.output),
                        None => delta = Some(event.output),
                    }
                    return Ok((picked[first_row + j], event.finished));
                }
                let row = req.prepare_sampling(vocab, RowInput::Accepted);
                let raw = &rows[(first_row + j) * vocab..(first_row + j + 1) * vocab];
                // A draft drawn from q: the speculative sampling rule against the target's p,
                // with the row's own draw to accept; else (greedy, a point-mass draft, the
                // bonus position) the target's token as plain decoding picks it.
                let s = match q.get(j) {
                    Some(qj) if !row.is_greedy() => {
                        let token = rule(&row.distribution(raw), qj, draft[j], row.u, &mut || req.uniform());
                        row.picked(raw, token)
                    }
                    _ => row.sample(raw),
                };
                let event = req.accept(s.token, s.logprob, tokenizer, eos, cached)?;
                match delta.as_mut() {
                    Some(d) => d.merge(event.output),
                    None => delta = Some(event.output),
                }
                Ok((s.token, event.finished))
            })?;
            if k > 0 {
                if let Some(s) = req.spec.as_mut() {
                    s.record(k, accepted.drafts, accepted.tokens.len());
                }
                self.stats.spec.record(k, accepted.drafts, accepted.tokens.len());
                if let Some(a) = self.adaptive.as_mut() {
                    a.record(id, k, accepted.drafts);
                }
                if let Some(d) = delta.as_mut().filter(|d| d.finished()) {
                    d.spec = req.spec.clone();
                }
            }
            accepted_drafts[i] = accepted.drafts;
            let n = accepted.tokens.len();
            self.stats.generation_tokens_total += n as u64;
            for (t, &token) in accepted.tokens.iter().enumerate() {
                outcomes.push(SeqOutcome { id, token, finished: accepted.finished && t + 1 == n, computed: t < accepted.drafts });
            }
            outputs.extend(delta);
        }
        // Before the rollback's forward replaces the verify forward's hidden states.
        self.absorb_mtp(&step, &outcomes)?;
        self.absorb_dflash(&step, &outcomes)?;
        self.account(&step)?;
        self.roll_back_states(&step, &accepted_drafts, &rollback)?;
        self.settle(&outcomes, None)?;
        self.time_step(&step, started);
        Ok(outputs)
    }

    /// The verify step's argmax rows, one per sequence (`ModelRunner::forward_verify`): a
    /// greedy request whose rows are alike at every draft position (no grammar mask, no
    /// penalties, no thinking budget that could force a token) and that wants no logprobs is
    /// picked on the runner; every other sequence (sampled, logprobs, per-position rows, no
    /// logits) gets its logits rows and is picked here.
    fn verify_argmax_rows(&mut self, step: &ScheduledStep) -> Vec<Option<crate::sampling::RowSampling>> {
        let vocab = self.runner.config().vocab_size;
        step.seq_ids
            .iter()
            .zip(&step.batch.seqs)
            .map(|(id, chunk)| {
                let req = self.requests.get_mut(id).filter(|_| chunk.logits != LogitsWanted::None)?;
                req.argmax_row(vocab)
            })
            .collect()
    }

    /// With `--spec-adaptive`, count a step of decodes and verify chunks only (a prompt chunk's
    /// cost is another matter) in the step cost fit: its tokens and the seconds from drafting
    /// to the rollback.
    fn time_step(&mut self, step: &ScheduledStep, started: std::time::Instant) {
        let Some(a) = self.adaptive.as_mut() else { return };
        let decodes_only = step.batch.seqs.iter().enumerate().all(|(i, c)| c.tokens.len() == 1 + step.draft_len(i) && c.logits != LogitsWanted::None);
        if decodes_only {
            a.cost.record(step.batch.num_tokens(), started.elapsed().as_secs_f64());
        }
    }

    /// Set every decoding request's draft: up to K tokens (its own `draft_tokens`, else the
    /// engine's) from the drafter, never more than its `max_tokens` or the context leave room
    /// for after the token it gets anyway.
    /// With `--spec-adaptive` that K is the most, and the adaptive choice
    /// (`spec::adaptive`) is made within it.
    fn propose_drafts(&mut self) {
        let Some((spec, drafter)) = self.speculation.as_ref() else { return };
        let (requests, max_context, max_drafts) = (&mut self.requests, self.cfg.max_context, self.max_drafts);
        let mut adaptive = self.adaptive.as_mut();
        if let Some(a) = adaptive.as_mut() {
            a.retain(|id| requests.contains_key(&id));
        }
        let batch = self.sched.num_running();
        let stats = &mut self.stats.spec;
        self.sched.set_drafts(|seq| {
            let Some(req) = requests.get_mut(&seq.id) else { return Vec::new() };
            let max = req.params.draft_tokens.unwrap_or(spec.draft_tokens);
            let max = match adaptive.as_mut() {
                Some(a) => {
                    let k = a.choose(seq.id, max, batch);
                    stats.record_choice(k);
                    if let Some(s) = req.spec.as_mut() {
                        s.record_choice(k);
                    }
                    k
                }
                None => max,
            };
            let room = req.params.max_tokens.saturating_sub(req.completion_tokens + 1).min(max_context.saturating_sub(seq.tokens.len()));
            let k = max.min(room).min(max_drafts);
            match spec.method {
                // Placeholders: the MTP drafts once the blocks for them are scheduled
                // (`fill_mtp_drafts`), as its recursive rows write KV at the draft positions;
                // DFlash drafts every scheduled round in one batched forward
                // (`fill_dflash_drafts`).
                SpecMethod::Mtp | SpecMethod::Dflash => vec![0; k],
                _ => drafter.propose(&seq.tokens, k),
            }
        });
    }

    /// How a request's `k` drafts are drawn: None for a greedy request; for a sampled one its
    /// warpers (`spec::draft_warpers`) and one draw per draft from its RNG, so a seeded request
    /// drafts the same tokens on every run.
    fn draft_sampling(&mut self, id: u64, k: usize) -> Option<DraftSampling> {
        let r = self.requests.get_mut(&id).filter(|r| !r.params.is_greedy())?;
        Some(DraftSampling { warpers: draft_warpers(&r.params), u: (0..k).map(|_| r.uniform()).collect() })
    }

    /// With `--spec mtp`, replace the placeholder drafts of `step`'s verify chunks by the MTP
    /// head's drafts (one batched call), each drafted from its sequence's last absorbed row into
    /// the blocks its verify chunk holds: greedy for a greedy request; for a sampled one drawn
    /// from the head's distribution under its warpers (`spec::draft_warpers`) with draws from
    /// its RNG, so a seeded request drafts the same tokens on every run. Returns, for each
    /// entry of `step`, the distribution each draft was drawn from (none for greedy drafts).
    fn fill_mtp_drafts(&mut self, step: &mut ScheduledStep) -> Result<Vec<Vec<Vec<f32>>>> {
        let mut draft_q = Vec::new();
        if !self.speculation.as_ref().is_some_and(|(s, _)| s.method == SpecMethod::Mtp) || step.num_draft_tokens() == 0 {
            return Ok(draft_q);
        }
        let idx: Vec<usize> = (0..step.seq_ids.len()).filter(|&i| step.draft_len(i) > 0).collect();
        let mut seqs = Vec::with_capacity(idx.len());
        for &i in &idx {
            let (c, k) = (&step.batch.seqs[i], step.draft_len(i));
            let sampling = self.draft_sampling(step.seq_ids[i], k);
            seqs.push(MtpDraftSeq { key: step.seq_ids[i], pos: c.start_pos, token: c.tokens[0], block_table: c.block_table.clone(), k, sampling });
        }
        let drafts = self.runner.mtp_draft(&seqs)?;
        draft_q.resize(step.seq_ids.len(), Vec::new());
        for ((&i, seq), d) in idx.iter().zip(&seqs).zip(drafts) {
            let chunk = &mut step.batch.seqs[i];
            let k = step.drafts[i];
            // No q: deterministic drafts (a runner that drafts greedily for every request), which
            // the point-mass rule verifies exactly.
            if d.tokens.len() != k || !(d.q.is_empty() || (seq.sampling.is_some() && d.q.len() == k)) {
                return Err(NinferError::invalid("mtp_draft", format!("{} drafts and {} distributions for {k} asked", d.tokens.len(), d.q.len())));
            }
            chunk.tokens.truncate(1);
            chunk.tokens.extend(d.tokens);
            draft_q[i] = d.q;
        }
        Ok(draft_q)
    }

    /// With `--spec dflash`, replace the placeholder drafts of `step`'s verify chunks by the
    /// drafter's block drafts (one batched forward), each anchored at its chunk's input token
    /// with the context absorbed before it: greedy for a greedy request; for a sampled one drawn
    /// from the drafter's distribution under its warpers with draws from its RNG, as MTP drafts
    /// are (`fill_mtp_drafts`). Returns the distributions, as `fill_mtp_drafts` does.
    fn fill_dflash_drafts(&mut self, step: &mut ScheduledStep) -> Result<Vec<Vec<Vec<f32>>>> {
        let mut draft_q = Vec::new();
        if !self.speculation.as_ref().is_some_and(|(s, _)| s.method == SpecMethod::Dflash) || step.num_draft_tokens() == 0 {
            return Ok(draft_q);
        }
        let idx: Vec<usize> = (0..step.seq_ids.len()).filter(|&i| step.draft_len(i) > 0).collect();
        let mut seqs = Vec::with_capacity(idx.len());
        for &i in &idx {
            let (c, k) = (&step.batch.seqs[i], step.draft_len(i));
            let sampling = self.draft_sampling(step.seq_ids[i], k);
            seqs.push(DflashDraftSeq { pos: c.start_pos, token: c.tokens[0], block_table: c.block_table.clone(), k, sampling });
        }
        let drafts = self.runner.dflash_draft(&seqs)?;
        draft_q.resize(step.seq_ids.len(), Vec::new());
        for ((&i, seq), d) in idx.iter().zip(&seqs).zip(drafts) {
            let chunk = &mut step.batch.seqs[i];
            let k = step.drafts[i];
            if d.tokens.len() != k || !(d.q.is_empty() || (seq.sampling.is_some() && d.q.len() == k)) {
                return Err(NinferError::invalid("dflash_draft", format!("{} drafts and {} distributions for {k} asked", d.tokens.len(), d.q.len())));
            }
            chunk.tokens.truncate(1);
            chunk.tokens.extend(d.tokens);
            draft_q[i] = d.q;
        }
        Ok(draft_q)
    }

    /// With `--spec dflash`, hand the drafter the target features of every position `step`
    /// computed and kept (a prompt chunk's tokens, a decode's token, a verify chunk's input
    /// token and accepted drafts), written into the sequence's blocks: its context then covers
    /// exactly the computed positions, and the rows of rejected drafts are never absorbed. It
    /// runs before the step is accounted, which publishes the blocks it filled to the prefix
    /// cache, so a hit's blocks always carry their rows.
    fn absorb_dflash(&mut self, step: &ScheduledStep, outcomes: &[SeqOutcome]) -> Result<()> {
        if !self.speculation.as_ref().is_some_and(|(s, _)| s.method == SpecMethod::Dflash) {
            return Ok(());
        }
        let rows = step
            .seq_ids
            .iter()
            .zip(&step.batch.seqs)
            .enumerate()
            .map(|(i, (&id, chunk))| {
                let inputs = chunk.tokens.len() - step.draft_len(i);
                let accepted = outcomes.iter().filter(|o| o.id == id && o.computed).count();
                DflashRows { chunk: i, start_pos: chunk.start_pos, rows: inputs + accepted, block_table: chunk.block_table.clone() }
            })
            .collect::<Vec<_>>();
        self.runner.dflash_absorb(&rows)
    }

    /// With `--spec mtp`, write the MTP KV rows of every position `step` computed and kept (a
    /// prompt chunk's tokens, a decode's token, a verify chunk's input token and accepted drafts),
    /// each paired with the token after it: the MTP KV then covers exactly the computed positions,
    /// and whatever a rejected draft's recursion wrote past them is rewritten by the next call.
    fn absorb_mtp(&mut self, step: &ScheduledStep, outcomes: &[SeqOutcome]) -> Result<()> {
        if !self.speculation.as_ref().is_some_and(|(s, _)| s.method == SpecMethod::Mtp) {
            return Ok(());
        }
        let mut rows = Vec::new();
        for (i, (&id, chunk)) in step.seq_ids.iter().zip(&step.batch.seqs).enumerate() {
            // The input tokens that are not drafts, then the tokens the step output: accepted
            // drafts and the target's token. A prompt chunk short of the prompt's end is
            // followed by the next prompt token.
            let inputs = chunk.tokens.len() - step.draft_len(i);
            let mut next: Vec<u32> = chunk.tokens[1..inputs].to_vec();
            if chunk.logits == LogitsWanted::None {
                match self.sched.get(id).and_then(|s| s.tokens.get(chunk.start_pos + inputs)) {
                    Some(&t) => next.push(t),
                    None => continue,
                }
            } else {
                next.extend(outcomes.iter().filter(|o| o.id == id).map(|o| o.token));
            }
            // Rows computed and kept: the inputs and the accepted drafts; a request that ended
            // on its last token has no token after it.
            let computed = inputs + outcomes.iter().filter(|o| o.id == id && o.computed).count();
            next.truncate(computed);
            if next.is_empty() {
                continue;
            }
            rows.push(MtpRows { key: id, chunk: i, start_pos: chunk.start_pos, next_tokens: next, block_table: chunk.block_table.clone() });
        }
        self.runner.mtp_absorb(&rows)
    }

    /// Bring each verify chunk's recurrent state back to just after its accepted tokens: where
    /// a draft token was rejected, rebuild it from the state kept before the chunk, by replay
    /// of the kept recurrence inputs (`ModelRunner::replay_states`) or, for a runner without
    /// it, by recompute (`recompute_states`). Where the accepted tokens reach a block
    /// boundary, the state there is the sequence's decode snapshot
    /// (`Scheduler::draft_snapshot`): taken from the slot when the boundary is the last accepted
    /// token, else the rebuild stops at the boundary, which the rest continues from. A snapshot
    /// thus never holds a rejected token's state.
    fn roll_back_states(&mut self, step: &ScheduledStep, accepted: &[usize], rollback: &[(usize, usize)]) -> Result<()> {
        if !self.replays_states {
            return self.recompute_states(step, accepted, rollback);
        }
        // Replays from the kept states, then those that continue from a snapshot the first
        // wrote; copies to snapshots after the first.
        let (mut first, mut rest, mut snapshots, mut snapshot_now) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (j, &(i, keep)) in rollback.iter().enumerate() {
            let chunk = &step.batch.seqs[i];
            let Some((n, snapshot, at)) = self.chunk_rollback(step, accepted, i, &mut snapshot_now) else { continue };
            let replay = |src, dst, start, tokens| StateReplay { kept: j, src, dst, start, tokens };
            match snapshot {
                Some((_, _, dst)) if at.is_some_and(|at| at < n) => {
                    let at = at.expect("matched");
                    first.push(replay(keep, dst, 0, at));
                    rest.push(replay(dst, chunk.state_slot, at, n - at));
                }
                _ => {
                    first.push(replay(keep, chunk.state_slot, 0, n));
                    snapshots.extend(snapshot.map(|(_, src, dst)| (src, dst)));
                }
            }
        }
        for (src, dst) in snapshot_now {
            self.runner.copy_state(src, dst)?;
        }
        for replays in [first, rest] {
            if !replays.is_empty() {
                self.stats.spec.replayed_tokens += replays.iter().map(|r| r.tokens as u64).sum::<u64>();
                self.runner.replay_states(&replays)?;
            }
            for (src, dst) in snapshots.drain(..) {
                self.runner.copy_state(src, dst)?;
            }
        }
        Ok(())
    }

    /// What verify chunk `i` of `step` needs rolled back: None when all its drafts were
    /// accepted and any decode snapshot they reach is at their end (its copy is pushed to
    /// `snapshot_now`); else the tokens the state must end after (`n`: the input token and the
    /// accepted drafts), the snapshot (tokens, source, destination) and the tokens of the chunk
    /// the state must be at for its copy.
    #[allow(clippy::type_complexity)]
    fn chunk_rollback(&mut self, step: &ScheduledStep, accepted: &[usize], i: usize, snapshot_now: &mut Vec<(usize, usize)>) -> Option<(usize, Option<(usize, usize, usize)>, Option<usize>)> {
        let chunk = &step.batch.seqs[i];
        let (n, all) = (1 + accepted[i], accepted[i] == step.draft_len(i));
        let snapshot = self.sched.draft_snapshot(step.seq_ids[i], &chunk.tokens[1..n]);
        let at = snapshot.map(|(tokens, _, _)| tokens - chunk.start_pos);
        if all && at.is_none_or(|at| at == n) {
            snapshot_now.extend(snapshot.map(|(_, src, dst)| (src, dst)));
            return None;
        }
        Some((n, snapshot, at))
    }

    /// `roll_back_states` by recompute: restore the state kept before the chunk and run the
    /// input token and the accepted drafts again, all such chunks in one forward without
    /// logits (a second forward for what continues past a snapshot's boundary).
    fn recompute_states(&mut self, step: &ScheduledStep, accepted: &[usize], rollback: &[(usize, usize)]) -> Result<()> {
        let bs = self.cfg.block_size;
        let (mut redo, mut rest, mut snapshots, mut snapshot_now) = (StepBatch::default(), StepBatch::default(), Vec::new(), Vec::new());
        let part = |chunk: &SeqChunk, from: usize, to: usize| SeqChunk {
            tokens: chunk.tokens[from..to].to_vec(),
            start_pos: chunk.start_pos + from,
            block_table: chunk.block_table[..(chunk.start_pos + to).div_ceil(bs)].to_vec(),
            state_slot: chunk.state_slot,
            logits: LogitsWanted::None,
        };
        for &(i, keep) in rollback {
            let chunk = &step.batch.seqs[i];
            let Some((n, snapshot, at)) = self.chunk_rollback(step, accepted, i, &mut snapshot_now) else { continue };
            self.runner.copy_state(keep, chunk.state_slot)?;
            let stop = at.unwrap_or(n);
            redo.seqs.push(part(chunk, 0, stop));
            snapshots.extend(snapshot.map(|(_, src, dst)| (src, dst)));
            if stop < n {
                rest.seqs.push(part(chunk, stop, n));
            }
        }
        for (src, dst) in snapshot_now {
            self.runner.copy_state(src, dst)?;
        }
        for batch in [redo, rest] {
            if !batch.seqs.is_empty() {
                self.stats.spec.rollback_tokens += batch.num_tokens() as u64;
                self.runner.forward(&batch)?;
            }
            for (src, dst) in snapshots.drain(..) {
                self.runner.copy_state(src, dst)?;
            }
        }
        Ok(())
    }
}
