//! `EngineCore`: one engine step is `schedule()` -> `launch()` (run and sample) -> `complete()`
//! (collect the tokens, detokenize, check stops).
//!
//! The core owns the model runner, the scheduler (with the KV block pool and state slots) and
//! the per-request sampling / detokenization state. It is single-threaded; `EngineHandle` runs
//! it on its own OS thread. The core only does bookkeeping: device memory belongs to the runner,
//! so the same core drives a CPU or a CUDA backend.
//!
//! Asynchronous scheduling (`NINFER_ASYNC_SCHEDULING`, on by default where the runner
//! `overlaps_steps`): a launched step stays in flight when `step()` returns, and the next call
//! queues the following decode step (its tokens fed on the device) before it waits for the one
//! in flight, so the device runs the next step while the host copies results, detokenizes and
//! schedules: the ~50 us of host turnaround between decode steps leaves the device's timeline.
//! Outputs then come one `step()` call later. The lookahead is taken only when it is the step the
//! scheduler would pick anyway and no request is sure to end with the token in flight
//! (`lookahead`); otherwise the core waits, exactly as without it. When a sampling row needs the
//! token in flight on the host (a grammar's allow-mask), only the lookahead's forward pass is
//! queued ahead: its rows are built, and its sampling queued, once the step in flight is
//! completed, while the device runs the forward (a split lookahead).

use std::collections::HashMap;
use std::sync::Arc;

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::{EngineConfig, MemoryLedger, RequestOutput, RequestState, ResolvedConfig};
use crate::kv::BlockPool;
use crate::model::{CacheSpec, LogitsWanted, ModelRunner, SeqChunk, StepBatch};
use crate::sampling::{GrammarConstraint, RowSampling, SampledToken, SamplingParams, SharedGrammarCompiler};
use crate::sched::{ScheduledStep, Scheduler, SchedulerConfig, SeqId, Sequence};
use crate::state::StateSlots;
use crate::tokenizer::Tokenizer;
use crate::{NinferError, Result};

/// Counters for `stats()`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EngineStats {
    pub running: usize,
    pub waiting: usize,
    pub kv_blocks_used: usize,
    pub kv_blocks_total: usize,
    pub prefix_hit_tokens: u64,
    pub prompt_tokens_total: u64,
    pub generation_tokens_total: u64,
    /// Tokens run through the model as prompt (prefill chunks and recompute), not decodes.
    pub prefill_tokens_computed: u64,
    pub max_batch_size_seen: usize,
    pub steps: u64,
    /// Steps queued before the tokens of the step ahead of them were known (asynchronous
    /// scheduling).
    pub lookahead_steps: u64,
    /// The lookahead steps of those whose forward pass only was queued ahead, their sampling
    /// after the step before was completed (a row needed its token on the host: a grammar).
    pub split_lookahead_steps: u64,
    pub preemptions: u64,
}

/// The checks a request must pass before it is queued; cheap and shareable, so a submitting
/// thread can reject bad input at once while the core runs elsewhere.
#[derive(Clone, Debug)]
pub struct RequestValidator {
    pub max_context: usize,
    /// 0 when unknown.
    pub vocab_size: usize,
    /// Compiles `response_format` into a grammar constraint (built on first use).
    pub grammar: SharedGrammarCompiler,
}

impl RequestValidator {
    /// Reject an empty prompt, out-of-vocabulary ids, bad params and context overflow.
    pub fn check(&self, prompt: &[u32], params: &SamplingParams) -> Result<()> {
        if prompt.is_empty() {
            return Err(NinferError::EmptyPrompt);
        }
        if self.vocab_size > 0 {
            if let Some(&bad) = prompt.iter().find(|&&t| t as usize >= self.vocab_size) {
                return Err(NinferError::invalid("prompt_token_ids", format!("token id {bad} is outside the vocabulary of {} tokens", self.vocab_size)));
            }
            // A bias on a token the model has no logit for would be ignored: say so instead (a
            // mistyped id), as the OpenAI API does.
            if let Some(&bad) = params.logit_bias.keys().filter(|&&t| t as usize >= self.vocab_size).min() {
                return Err(NinferError::invalid("logit_bias", format!("token id {bad} is outside the vocabulary of {} tokens", self.vocab_size)));
            }
        }
        params.validate()?;
        // Saturating: a max_tokens near usize::MAX (JSON allows 2^64 - 1) must not wrap past the check.
        if prompt.len().saturating_add(params.max_tokens) > self.max_context {
            return Err(NinferError::ContextOverflow { prompt_tokens: prompt.len(), max_tokens: params.max_tokens, max_context: self.max_context });
        }
        Ok(())
    }

    /// The grammar constraint of a request with a `response_format` (None without one). A schema
    /// the compiler rejects is an `InvalidRequest` on `response_format`, reported at submit.
    pub fn grammar(&self, params: &SamplingParams) -> Result<Option<GrammarConstraint>> {
        self.grammar.constraint_for(params.response_format.as_ref())
    }
}

/// The synchronous engine.
pub struct EngineCore {
    cfg: ResolvedConfig,
    spec: CacheSpec,
    runner: Box<dyn ModelRunner>,
    sched: Scheduler,
    tokenizer: Option<Arc<Tokenizer>>,
    eos_token_ids: Vec<u32>,
    validator: RequestValidator,
    requests: HashMap<SeqId, RequestState>,
    ids: HashMap<String, SeqId>,
    pending_aborts: Vec<SeqId>,
    next_seq: SeqId,
    seed_rng: ChaCha8Rng,
    stats: EngineStats,
    /// Measured by the warm-up step at startup.
    workspace_bytes: u64,
    device_free_bytes: Option<u64>,
    /// Launch steps through `launch_sampled` / `collect_sampled` and keep one in flight.
    overlap: bool,
    /// The step launched last whose tokens are not collected yet (only when `overlap`).
    inflight: Option<ScheduledStep>,
    /// Tokens of the last step of a runner that does not overlap, until `complete` takes them.
    sampled: Option<Vec<SampledToken>>,
    /// Steps launched on an overlapping runner and not collected yet (0 to 2): what a failure
    /// must collect and drop, whichever step it interrupted.
    uncollected: usize,
}

/// The switch of asynchronous scheduling (`config::env_switch`; on by default).
pub const ASYNC_SCHEDULING_SWITCH: &str = "NINFER_ASYNC_SCHEDULING";

impl EngineCore {
    /// Validate the config against the model, allocate the runner's caches, build the
    /// scheduler. `eos_token_ids` usually come from `GenerationConfig`.
    pub fn new(mut runner: Box<dyn ModelRunner>, config: &EngineConfig, tokenizer: Option<Arc<Tokenizer>>, eos_token_ids: Vec<u32>) -> Result<Self> {
        let spec = runner.cache_spec();
        let model_max = runner.config().max_position_embeddings;
        let step_rows = if model_max > 0 { config.prefill_chunk.min(model_max) } else { config.prefill_chunk };
        // A step's tokens fit the one budget (prefill_chunk), so decode rows do too.
        let decode_rows = config.max_concurrency.min(step_rows);
        // Asked either way, so that the runner's step buffers for the largest steps exist
        // before the caches are planned; its budget counts only without a --kv-capacity.
        let budget = runner.cache_budget_bytes(step_rows, decode_rows)?.filter(|_| config.kv_capacity_tokens.is_none());
        let cfg = config.resolve(model_max, &spec, budget)?;
        let slots = if cfg.running_state_slots > 0 { StateSlots::new(cfg.running_state_slots, cfg.snapshot_state_slots) } else { StateSlots::none() };
        runner.allocate_caches(cfg.num_blocks, cfg.block_size, slots.total())?;
        let sched = Scheduler::new(
            SchedulerConfig { max_concurrency: cfg.max_concurrency, prefill_chunk: cfg.prefill_chunk, prefix_reuse: cfg.prefix_reuse },
            BlockPool::new(cfg.num_blocks, cfg.block_size),
            slots,
        );
        let vocab_size = runner.config().vocab_size;
        let grammar = SharedGrammarCompiler::new(tokenizer.clone(), eos_token_ids.clone(), vocab_size);
        let validator = RequestValidator { max_context: cfg.max_context, vocab_size, grammar };
        let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
        // Read on every backend, so a misspelt value is an error wherever it is set.
        let overlap = crate::config::env_switch(ASYNC_SCHEDULING_SWITCH, true)? && runner.overlaps_steps();
        let mut core = EngineCore {
            cfg,
            spec,
            runner,
            sched,
            tokenizer,
            eos_token_ids,
            validator,
            requests: HashMap::new(),
            ids: HashMap::new(),
            pending_aborts: Vec::new(),
            next_seq: 0,
            seed_rng: ChaCha8Rng::seed_from_u64(seed),
            stats: EngineStats::default(),
            workspace_bytes: 0,
            device_free_bytes: None,
            overlap,
            inflight: None,
            sampled: None,
            uncollected: 0,
        };
        core.warm_up()?;
        Ok(core)
    }

    /// Run one step of the largest size the scheduler will hand out (a `prefill_chunk`-token
    /// prompt chunk, capped by the context and the KV pool) on blocks and a state slot that are
    /// free, so that every step buffer reaches its high-water mark now: the ledger then shows
    /// the real workspace and free memory, and a too-small device fails at startup instead of
    /// on the first long request. Nothing it writes is reachable afterwards: the blocks hold no
    /// cached prefix yet and a sequence starting at position 0 clears its state slot. Then the
    /// runner's `warm_up_kernels`, so that the first requests of other sizes do not pay for
    /// kernels met for the first time either.
    fn warm_up(&mut self) -> Result<()> {
        let bs = self.cfg.block_size;
        let tokens = self.cfg.prefill_chunk.min(self.cfg.max_context).min(self.sched.pool.num_free() * bs);
        if tokens > 0 {
            let table: Vec<u32> = (0..tokens.div_ceil(bs)).map(|_| self.sched.pool.allocate().expect("free blocks counted above")).collect();
            let slot = if self.sched.slots.enabled() { self.sched.slots.acquire() } else { Some(0) };
            let result = match slot {
                Some(state_slot) => {
                    let seq = SeqChunk { tokens: vec![0; tokens], start_pos: 0, block_table: table.clone(), state_slot, logits: LogitsWanted::Last };
                    self.runner.forward(&StepBatch { seqs: vec![seq] }).map(|_| ())
                }
                None => Ok(()),
            };
            self.sched.pool.free_all(&table);
            if let (true, Some(s)) = (self.sched.slots.enabled(), slot) {
                self.sched.slots.release(s);
            }
            result.map_err(|e| match e {
                NinferError::OutOfMemory { what, needed, available, hint } => NinferError::OutOfMemory {
                    what: format!("the warm-up step of {tokens} tokens (--prefill-chunk): {what}"),
                    needed,
                    available,
                    hint,
                },
                e => e,
            })?;
        }
        self.runner.warm_up_kernels()?;
        self.workspace_bytes = self.runner.workspace_bytes() as u64;
        self.device_free_bytes = self.runner.device_free_bytes();
        Ok(())
    }

    /// The sizes the engine runs with.
    pub fn config(&self) -> &ResolvedConfig {
        &self.cfg
    }

    /// Memory ledger (weights, KV, state slots, workspace, free device memory).
    pub fn ledger(&self) -> MemoryLedger {
        let mut l = self.cfg.ledger(&self.spec);
        l.workspace_bytes = self.workspace_bytes;
        l.total_bytes += self.workspace_bytes;
        l.device_free_bytes = self.device_free_bytes;
        l
    }

    /// The request checks, for callers on other threads.
    pub fn validator(&self) -> RequestValidator {
        self.validator.clone()
    }

    /// The tokenizer, when the model directory has one.
    pub fn tokenizer(&self) -> Option<&Arc<Tokenizer>> {
        self.tokenizer.as_ref()
    }

    /// Token ids that end generation unless `ignore_eos`.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_token_ids
    }

    /// Queue a request. Errors: empty prompt, context overflow, bad params (a bad
    /// `response_format` included), duplicate id.
    pub fn add_request(&mut self, request_id: &str, prompt: Vec<u32>, params: SamplingParams) -> Result<()> {
        self.validator.check(&prompt, &params)?;
        let grammar = self.validator.grammar(&params)?;
        self.add_checked_request(request_id, prompt, params, grammar)
    }

    /// Queue a request whose checks already passed and whose grammar constraint (if any) was
    /// compiled by the caller (`EngineHandle::submit` does both on the submitting thread).
    pub fn add_checked_request(&mut self, request_id: &str, prompt: Vec<u32>, params: SamplingParams, grammar: Option<GrammarConstraint>) -> Result<()> {
        if self.ids.contains_key(request_id) {
            return Err(NinferError::Request(request_id.to_string(), "a request with this id is already running".into()));
        }
        self.validator.check(&prompt, &params)?;
        let id = self.next_seq;
        self.next_seq += 1;
        let fallback_seed = self.seed_rng.random();
        self.stats.prompt_tokens_total += prompt.len() as u64;
        self.requests.insert(id, RequestState::new(request_id.to_string(), &prompt, params, fallback_seed, grammar));
        self.ids.insert(request_id.to_string(), id);
        self.sched.add(Sequence::new(id, prompt));
        Ok(())
    }

    /// Abort a request; its blocks are freed and its final delta emitted in the next step.
    /// False when the id is unknown (already finished).
    pub fn abort(&mut self, request_id: &str) -> bool {
        match self.ids.get(request_id) {
            Some(&id) if !self.pending_aborts.contains(&id) => {
                self.pending_aborts.push(id);
                true
            }
            Some(_) => true,
            None => false,
        }
    }

    /// Ids of every request not yet finished.
    pub fn request_ids(&self) -> Vec<String> {
        self.ids.keys().cloned().collect()
    }

    /// Whether steps overlap the host's work on the last one (asynchronous scheduling).
    pub fn overlaps_steps(&self) -> bool {
        self.overlap
    }

    /// Whether any request is queued, running or awaiting its abort delta.
    pub fn has_unfinished(&self) -> bool {
        !self.requests.is_empty()
    }

    /// One engine step.
    /// On a runner failure every request is dropped (blocks and slots freed) and the error is
    /// returned: a half-run step cannot be resumed.
    pub fn step(&mut self) -> Result<Vec<RequestOutput>> {
        let result = self.try_step();
        if result.is_err() {
            self.drop_all();
        }
        result
    }

    /// Without overlap: schedule, launch, complete. With it, a step in flight is first followed
    /// by its lookahead when there is one (queued before waiting for it), then completed; with
    /// no lookahead the next step is scheduled as usual and left in flight. A split lookahead
    /// queues its forward pass before the completion and its sampling after it, so that the
    /// rows are built from the states the completed tokens leave (grammars advanced on them)
    /// while the device runs the forward.
    fn try_step(&mut self) -> Result<Vec<RequestOutput>> {
        let mut outputs = Vec::new();
        if let Some(prev) = self.inflight.take() {
            if let Some((next, split)) = self.lookahead(&prev) {
                if split {
                    self.launch_forward(&next)?;
                    outputs.extend(self.complete(&prev, Some(&next))?);
                    self.launch_sampling(&next)?;
                    self.stats.split_lookahead_steps += 1;
                } else {
                    self.launch(&next, true)?;
                    outputs.extend(self.complete(&prev, Some(&next))?);
                }
                self.stats.lookahead_steps += 1;
                self.after_launch(&next)?;
                self.inflight = Some(next);
                return Ok(outputs);
            }
            outputs.extend(self.complete(&prev, None)?);
        }
        outputs.extend(self.apply_aborts()?);
        let step = self.sched.schedule();
        if step.is_empty() {
            return Ok(outputs);
        }
        self.launch(&step, false)?;
        self.after_launch(&step)?;
        if self.overlap {
            self.inflight = Some(step);
        } else {
            outputs.extend(self.complete(&step, None)?);
        }
        Ok(outputs)
    }

    /// The decode step to queue behind `prev` before its tokens are known, when that is safe:
    /// no abort is pending (aborts free blocks and take snapshots, which need a settled state),
    /// no sequence of `prev` is sure to end with its token in flight (its length limit), and
    /// the scheduler would pick exactly this step (`Scheduler::schedule_lookahead`). True with
    /// it when the step must be split: a sequence samples its next token from a host input the
    /// token in flight changes (a grammar mask; penalties count it on the runner instead,
    /// `count_input`), so only the forward pass runs ahead.
    fn lookahead(&mut self, prev: &ScheduledStep) -> Option<(ScheduledStep, bool)> {
        if !self.pending_aborts.is_empty() {
            return None;
        }
        let mut split = false;
        for id in &prev.seq_ids {
            let req = self.requests.get(id)?;
            if !req.can_run_ahead() {
                return None;
            }
            split |= req.samples_after_input();
        }
        self.sched.schedule_lookahead(prev).map(|next| (next, split))
    }

    /// Forget every request and free what it holds (after a runner failure). Steps launched and
    /// not collected are waited for and their tokens dropped, so the runner holds none after.
    fn drop_all(&mut self) {
        for _ in 0..std::mem::take(&mut self.uncollected) {
            let _ = self.runner.collect_sampled();
        }
        self.inflight = None;
        self.sampled = None;
        // No final snapshots: a failed step may have left any slot half-written (and a snapshot
        // reserved here would never be copied into).
        for id in self.requests.keys().copied().collect::<Vec<_>>() {
            self.sched.finish(id, false);
        }
        self.requests.clear();
        self.ids.clear();
        self.pending_aborts.clear();
    }

    /// Logits of every position of `tokens` (one sequence, no prefix cache, no sampling).
    pub fn score(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        self.validator.check(tokens, &SamplingParams { max_tokens: 1, ..Default::default() }).or_else(|e| match e {
            NinferError::ContextOverflow { .. } if tokens.len() <= self.cfg.max_context => Ok(()),
            e => Err(e),
        })?;
        let bs = self.cfg.block_size;
        let needed = tokens.len().div_ceil(bs);
        let pool = &mut self.sched.pool;
        if pool.num_free() < needed {
            let per_block = (bs * self.spec.kv_bytes_per_token) as u64;
            return Err(NinferError::OutOfMemory {
                what: format!("KV blocks to score {} tokens", tokens.len()),
                needed: needed as u64 * per_block,
                available: pool.num_free() as u64 * per_block,
                hint: "wait for running requests to finish or raise --kv-capacity".into(),
            });
        }
        let table: Vec<u32> = (0..needed).map(|_| pool.allocate().expect("checked")).collect();
        let slot = if self.sched.slots.enabled() { self.sched.slots.acquire() } else { Some(0) };
        let result = self.score_with(tokens, &table, slot);
        self.sched.pool.free_all(&table);
        if let (true, Some(s)) = (self.sched.slots.enabled(), slot) {
            self.sched.slots.release(s);
        }
        result
    }

    /// Counters.
    pub fn stats(&self) -> EngineStats {
        EngineStats {
            running: self.sched.num_running(),
            waiting: self.sched.num_waiting(),
            kv_blocks_used: self.sched.pool.num_used(),
            kv_blocks_total: self.sched.pool.num_blocks(),
            prefix_hit_tokens: self.sched.pool.hit_tokens,
            preemptions: self.sched.num_preemptions,
            ..self.stats.clone()
        }
    }

    /// Recurrent-state snapshots currently held (tests).
    #[cfg(test)]
    pub(crate) fn sched_snapshots_held(&self) -> usize {
        self.sched.slots.num_snapshots_held()
    }

    fn score_with(&mut self, tokens: &[u32], table: &[u32], slot: Option<usize>) -> Result<Vec<f32>> {
        let slot = slot.ok_or_else(|| NinferError::Request("score".into(), "no free recurrent-state slot".into()))?;
        let bs = self.cfg.block_size;
        let mut out = Vec::with_capacity(tokens.len() * self.validator.vocab_size);
        let mut start = 0;
        while start < tokens.len() {
            let end = (start + self.cfg.prefill_chunk).min(tokens.len());
            let batch = StepBatch {
                seqs: vec![SeqChunk {
                    tokens: tokens[start..end].to_vec(),
                    start_pos: start,
                    block_table: table[..end.div_ceil(bs)].to_vec(),
                    state_slot: slot,
                    logits: LogitsWanted::All,
                }],
            };
            let logits = self.runner.forward(&batch)?;
            out.extend_from_slice(logits.of_seq(0));
            start = end;
        }
        Ok(out)
    }

    /// Free aborted requests and emit their final deltas.
    fn apply_aborts(&mut self) -> Result<Vec<RequestOutput>> {
        let mut outputs = Vec::new();
        for id in std::mem::take(&mut self.pending_aborts) {
            let cached = self.cached_tokens(id);
            if let Some(copy) = self.sched.finish(id, true) {
                self.runner.copy_state(copy.0, copy.1)?;
            }
            if let Some(req) = self.requests.remove(&id) {
                self.ids.remove(&req.request_id);
                outputs.push(req.aborted(cached));
            }
        }
        Ok(outputs)
    }

    /// Queue the scheduled batch (with the snapshot restores it needs first) and the sampling
    /// of a token for every sequence that produces logits, in step order; `feed`: a lookahead
    /// step, whose tokens the runner takes from the step launched before it (and whose rows
    /// with penalties count that token, not accepted yet, on the runner). A runner that does
    /// not overlap runs it now and `complete` takes its tokens.
    fn launch(&mut self, step: &ScheduledStep, feed: bool) -> Result<()> {
        self.restore_states(step)?;
        let rows = self.sampling_rows(step, feed, false);
        if self.overlap {
            self.runner.launch_sampled(&step.batch, &rows, feed)?;
            self.uncollected += 1;
        } else {
            self.sampled = Some(self.runner.forward_sampled(&step.batch, &rows)?);
        }
        Ok(())
    }

    /// The first half of a split lookahead: the forward pass of `step` (fed its tokens on the
    /// runner), queued before the step in flight is completed.
    fn launch_forward(&mut self, step: &ScheduledStep) -> Result<()> {
        self.restore_states(step)?;
        self.runner.launch_forward(&step.batch, true)
    }

    /// The second half, once the step before is completed: the rows, built from the states its
    /// tokens left, and their sampling, queued behind the forward.
    fn launch_sampling(&mut self, step: &ScheduledStep) -> Result<()> {
        let rows = self.sampling_rows(step, true, true);
        self.runner.launch_sampling(&rows)?;
        self.uncollected += 1;
        Ok(())
    }

    /// The snapshot restores `step` needs before it runs.
    fn restore_states(&mut self, step: &ScheduledStep) -> Result<()> {
        for &(src, dst) in &step.copies_before {
            self.runner.copy_state(src, dst)?;
        }
        Ok(())
    }

    /// One sampling row for every sequence of `step` that produces logits (each takes its
    /// request's RNG draw). `feed`: the step takes the tokens of the step before as input.
    /// `completed`: that step is completed already (a split lookahead), so its tokens are
    /// accepted and no row counts its input on the runner; a request that ended with them is
    /// gone and gets a greedy, unconstrained row whose token is dropped, as a request ending
    /// under a whole lookahead has its row computed and dropped.
    fn sampling_rows(&mut self, step: &ScheduledStep, feed: bool, completed: bool) -> Vec<RowSampling> {
        let vocab = self.runner.config().vocab_size;
        step.seq_ids
            .iter()
            .zip(&step.batch.seqs)
            .filter(|(_, seq)| seq.logits != LogitsWanted::None)
            .map(|(id, _)| match self.requests.get_mut(id) {
                Some(req) => req.prepare_sampling(vocab, feed && !completed),
                None if completed => RowSampling { temperature: 0.0, ..Default::default() },
                None => unreachable!("a scheduled request runs until a completed step ends it"),
            })
            .collect()
    }

    /// The scheduler's bookkeeping of a launched step (computed counts, prefix-cache blocks,
    /// the snapshots it reaches, queued right behind it) and the step counters.
    fn after_launch(&mut self, step: &ScheduledStep) -> Result<()> {
        for &(src, dst) in &self.sched.on_step_done(step) {
            self.runner.copy_state(src, dst)?;
        }
        self.stats.steps += 1;
        self.stats.max_batch_size_seen = self.stats.max_batch_size_seen.max(step.seq_ids.len());
        self.stats.prefill_tokens_computed += (step.batch.num_tokens() - step.num_decodes) as u64;
        Ok(())
    }

    /// Take the tokens of `step` and, for every sequence that sampled one, detokenize and check
    /// stop conditions. `next`: the lookahead already queued behind `step`; a sequence that ends
    /// here but runs in it has a slot already past its tokens (no final snapshot then), and its
    /// row of `next` is simply never collected into an output.
    fn complete(&mut self, step: &ScheduledStep, next: Option<&ScheduledStep>) -> Result<Vec<RequestOutput>> {
        let sampled = match self.sampled.take() {
            Some(s) => s,
            None => {
                self.uncollected = self.uncollected.saturating_sub(1);
                self.runner.collect_sampled()?
            }
        };
        let mut outputs = Vec::new();
        let with_logits = step.seq_ids.iter().zip(&step.batch.seqs).filter(|(_, seq)| seq.logits != LogitsWanted::None);
        for ((&id, _), s) in with_logits.zip(sampled) {
            let cached = self.cached_tokens(id);
            let Some(req) = self.requests.get_mut(&id) else { continue };
            let event = req.accept(s.token, s.logprob, self.tokenizer.as_deref(), &self.eos_token_ids, cached)?;
            self.stats.generation_tokens_total += 1;
            self.sched.append_token(id, s.token);
            if event.finished {
                let state_current = next.is_none_or(|n| !n.seq_ids.contains(&id));
                if let Some(copy) = self.sched.finish(id, state_current) {
                    self.runner.copy_state(copy.0, copy.1)?;
                }
                self.requests.remove(&id);
                self.ids.remove(&event.output.request_id);
                self.pending_aborts.retain(|&a| a != id);
            }
            outputs.push(event.output);
        }
        Ok(outputs)
    }

    fn cached_tokens(&self, id: SeqId) -> usize {
        self.sched.get(id).and_then(|s| s.cached_tokens).unwrap_or(0)
    }
}
