//! `EngineCore`: one engine step is three verbs. `schedule` frees the requests aborted since
//! the last step and picks this step's work; `execute` runs it and samples a token for every
//! sequence that produces logits; `update` postprocesses the tokens (detokenize, check stops,
//! build the deltas) and hands the outcome to the scheduler's bookkeeping
//! (`Scheduler::update_from_output`).
//!
//! The core owns the model runner, the scheduler (with the KV block pool and state slots behind
//! it) and the per-request sampling / detokenization state. It is single-threaded;
//! `EngineHandle` runs it on its own OS thread. The core only does bookkeeping: device memory
//! belongs to the runner, so the same core drives a CPU or a CUDA backend.
//!
//! Asynchronous scheduling (`EngineConfig::async_scheduling`, effective where the runner
//! `overlaps_steps`) keeps a step in flight between `step()` calls: `OverlappedStep`
//! (overlap.rs) takes the same verbs, split at the runner's launch and collect, in its order.

use std::collections::HashMap;
use std::sync::Arc;

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::overlap::{Lookahead, OverlappedStep};
use super::request::RowInput;
use super::{EngineConfig, MemoryLedger, RequestOutput, RequestState, RequestValidator, ResolvedConfig};
use crate::kv::BlockPool;
use crate::model::{CacheSpec, LogitsWanted, ModelRunner, SeqChunk, StepBatch};
use crate::sampling::thinking::ThinkingTags;
use crate::sampling::{GrammarConstraint, RowSampling, SampledToken, SamplingParams, SharedGrammarCompiler};
use crate::sched::{Loan, ScheduledStep, Scheduler, SchedulerConfig, SeqId, SeqOutcome, Sequence, SlotState};
use crate::spec::{speculative_rule, AdaptiveSpec, DraftRule, Drafter, NgramDrafter, SpecConfig, SpecMethod, SpecStats};
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
    /// Of those, the tokens generated inside reasoning blocks (what thinking budgets count).
    pub reasoning_tokens_total: u64,
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
    /// Speculative decoding's draft and acceptance counters (all zero without `--spec`).
    pub spec: SpecStats,
}

/// The engine: requests in, deltas out, one `step()` at a time.
pub struct EngineCore {
    pub(super) cfg: ResolvedConfig,
    spec: CacheSpec,
    pub(super) runner: Box<dyn ModelRunner>,
    pub(super) sched: Scheduler,
    pub(super) tokenizer: Option<Arc<Tokenizer>>,
    pub(super) eos_token_ids: Vec<u32>,
    validator: RequestValidator,
    pub(super) requests: HashMap<SeqId, RequestState>,
    pub(super) ids: HashMap<String, SeqId>,
    pub(super) pending_aborts: Vec<SeqId>,
    next_seq: SeqId,
    seed_rng: ChaCha8Rng,
    pub(super) stats: EngineStats,
    /// Speculative decoding (`--spec`) with its drafter (n-gram; MTP drafts through the
    /// runner); None: plain decoding.
    pub(super) speculation: Option<(SpecConfig, Box<dyn Drafter>)>,
    /// `--spec-adaptive`'s step cost fit and per-request acceptance estimates.
    pub(super) adaptive: Option<AdaptiveSpec>,
    /// First of the `rollback_state_slots` (after the scheduler's slots).
    pub(super) rollback_slot_base: usize,
    /// Rollback rebuilds recurrent states by replay of kept inputs
    /// (`ModelRunner::enable_state_replay`), else by recompute.
    pub(super) replays_states: bool,
    /// How a sampled request verifies a draft drawn from a distribution (`spec::speculative_rule`;
    /// the distribution test puts broken rules here to show that it catches them).
    pub(super) draft_rule: DraftRule,
    /// The most drafts one round may carry: `MAX_DRAFT_TOKENS`, or a DFlash drafter's block
    /// less its anchor (a request's own `draft_tokens` is cut to it).
    pub(super) max_drafts: usize,
    /// Measured by the warm-up step at startup.
    workspace_bytes: u64,
    device_free_bytes: Option<u64>,
    /// The stepper that keeps a step in flight, when steps overlap (asynchronous scheduling).
    overlap: Option<OverlappedStep>,
}

impl EngineCore {
    /// Validate the config against the model, allocate the runner's caches, build the
    /// scheduler. `eos_token_ids` usually come from `GenerationConfig`.
    pub fn new(mut runner: Box<dyn ModelRunner>, config: &EngineConfig, tokenizer: Option<Arc<Tokenizer>>, eos_token_ids: Vec<u32>) -> Result<Self> {
        if let Some(s) = &config.spec {
            s.check()?;
        }
        if config.spec.is_some() && !runner.verifies_drafts() {
            return Err(NinferError::config("spec (--spec)", "speculative decoding is not supported on this backend yet (the CPU and CUDA backends run it)"));
        }
        if config.spec.as_ref().is_some_and(|s| s.method == SpecMethod::Mtp) {
            // Before cache_spec: the MTP layer's KV is part of every token's KV bytes.
            runner.enable_mtp()?;
        }
        let mut max_drafts = crate::spec::MAX_DRAFT_TOKENS;
        if let Some(s) = config.spec.as_ref().filter(|s| s.method == SpecMethod::Dflash) {
            // Before cache_spec: the drafter's context is part of every token's KV bytes.
            let block = runner.enable_dflash(s.drafter.as_deref().expect("checked: dflash has a drafter"))?;
            max_drafts = crate::plan::drafter::max_drafts(block, s.draft_tokens)?;
        }
        if let Some(d) = config.spec.as_ref().and_then(|s| s.lm_head_draft.as_ref()) {
            if d.token_ids.is_empty() {
                return Err(NinferError::config("lm_head_draft (--lm-head-draft)", "the draft vocabulary was not read (spec::draft_vocab::read)"));
            }
            runner.set_mtp_draft_vocab(&d.token_ids)?;
        }
        // Before the caches are planned: the kept inputs are step buffers, one verify chunk a
        // sequence of up to max_drafts + 1 tokens (a model without recurrent state says false).
        let replays_states = config.spec.is_some() && runner.enable_state_replay(config.max_concurrency, max_drafts + 1)?;
        let spec = runner.cache_spec();
        let model_max = runner.config().max_position_embeddings;
        let step_rows = if model_max > 0 { config.prefill_chunk.min(model_max) } else { config.prefill_chunk };
        // A step's tokens fit the one budget (prefill_chunk), so decode rows do too.
        let decode_rows = config.max_concurrency.min(step_rows);
        if config.spec.is_some() {
            // The verify steps' buffers, before the budget is asked (`plan::verify_rows`).
            runner.reserve_verify(step_rows, decode_rows, max_drafts)?;
        }
        // Asked either way, so that the runner's step buffers for the largest steps exist
        // before the caches are planned; its budget counts only without a --kv-capacity.
        let budget = runner.cache_budget_bytes(step_rows, decode_rows)?.filter(|_| config.kv_capacity_tokens.is_none());
        let cfg = config.resolve(model_max, &spec, budget)?;
        let slots = if cfg.running_state_slots > 0 { StateSlots::new(cfg.running_state_slots, cfg.snapshot_state_slots) } else { StateSlots::none() };
        let rollback_slot_base = slots.total();
        runner.allocate_caches(cfg.num_blocks, cfg.block_size, slots.total() + cfg.rollback_state_slots)?;
        let sched = Scheduler::new(
            SchedulerConfig {
                max_concurrency: cfg.max_concurrency,
                prefill_chunk: cfg.prefill_chunk,
                prefix_reuse: cfg.prefix_reuse,
                key_next_token: config.spec.as_ref().is_some_and(|s| s.method == SpecMethod::Mtp),
            },
            BlockPool::new(cfg.num_blocks, cfg.block_size),
            slots,
        );
        let vocab_size = runner.config().vocab_size;
        let grammar = SharedGrammarCompiler::new(tokenizer.clone(), eos_token_ids.clone(), vocab_size, config.json_schema_open_objects);
        let thinking = tokenizer.as_ref().and_then(ThinkingTags::of).filter(|t| (t.open.max(t.close) as usize) < vocab_size);
        let validator = RequestValidator { max_context: cfg.max_context, vocab_size, grammar, thinking, speculation: config.spec.is_some() };
        let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
        // Speculation runs the synchronous step: a round's accepted length, and so the next
        // step's input, is known only once its logits are on the host.
        let overlap = (config.async_scheduling && config.spec.is_none() && runner.overlaps_steps()).then(OverlappedStep::default);
        let speculation = config.spec.clone().map(|s| (s, Box::new(NgramDrafter::default()) as Box<dyn Drafter>));
        let adaptive = config.spec.as_ref().filter(|s| s.adaptive).map(|_| AdaptiveSpec::default());
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
            speculation,
            adaptive,
            rollback_slot_base,
            replays_states,
            draft_rule: speculative_rule,
            max_drafts,
        };
        core.warm_up()?;
        Ok(core)
    }

    /// Run one step of the largest size the scheduler will hand out (a `prefill_chunk`-token
    /// prompt chunk, capped by the context and the KV pool) on blocks and a state slot lent by
    /// the scheduler, so that every step buffer reaches its high-water mark now: the ledger
    /// then shows the real workspace and free memory, and a too-small device fails at startup
    /// instead of on the first long request. Then the runner's `warm_up_kernels`, so that the
    /// first requests of other sizes do not pay for kernels met for the first time either.
    fn warm_up(&mut self) -> Result<()> {
        let bs = self.cfg.block_size;
        let tokens = self.cfg.prefill_chunk.min(self.cfg.max_context).min(self.sched.free_blocks() * bs);
        if tokens > 0 {
            let loan = self.sched.lend(tokens.div_ceil(bs)).expect("free blocks counted above");
            let result = match loan.state_slot {
                Some(state_slot) => {
                    let seq = SeqChunk { tokens: vec![0; tokens], start_pos: 0, block_table: loan.block_table.clone(), state_slot, logits: LogitsWanted::Last };
                    self.runner.forward(&StepBatch { seqs: vec![seq] }).map(|_| ())
                }
                None => Ok(()),
            };
            self.sched.give_back(loan);
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

    /// Queue a request: where the inline engine validates it. Errors: empty prompt, context
    /// overflow, bad params (a bad `response_format` included), duplicate id.
    pub fn add_request(&mut self, request_id: &str, prompt: Vec<u32>, params: SamplingParams) -> Result<()> {
        let grammar = self.validator.validate(&prompt, &params)?;
        if self.ids.contains_key(request_id) {
            return Err(NinferError::Request(request_id.to_string(), "a request with this id is already running".into()));
        }
        self.add_checked_request(request_id, prompt, params, grammar);
        Ok(())
    }

    /// Queue a request validated by the caller (`RequestValidator::validate`, which compiled
    /// its grammar constraint), whose id is not running: `EngineHandle::submit` does both on
    /// the submitting thread.
    pub fn add_checked_request(&mut self, request_id: &str, prompt: Vec<u32>, params: SamplingParams, grammar: Option<GrammarConstraint>) {
        debug_assert!(!self.ids.contains_key(request_id), "request id {request_id} is already running");
        let id = self.next_seq;
        self.next_seq += 1;
        let fallback_seed = self.seed_rng.random();
        self.stats.prompt_tokens_total += prompt.len() as u64;
        let thinking = self.validator.thinking_tracker(&prompt, &params);
        let mut req = RequestState::new(request_id.to_string(), &prompt, params, fallback_seed, grammar, thinking);
        req.spec = self.speculation.as_ref().map(|_| SpecStats::default());
        self.requests.insert(id, req);
        self.ids.insert(request_id.to_string(), id);
        self.sched.add(Sequence::new(id, prompt));
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

    /// Speculative decoding's settings, None when off.
    pub fn spec_config(&self) -> Option<&SpecConfig> {
        self.speculation.as_ref().map(|(s, _)| s)
    }

    /// Whether steps overlap the host's work on the last one (asynchronous scheduling).
    pub fn overlaps_steps(&self) -> bool {
        self.overlap.is_some()
    }

    /// Whether any request is queued, running or awaiting its abort delta.
    pub fn has_unfinished(&self) -> bool {
        !self.requests.is_empty()
    }

    /// One engine step: schedule, execute, update. With asynchronous scheduling the
    /// overlapped stepper runs the same verbs with a step left in flight. On a runner failure
    /// every request is dropped (blocks and slots freed) and the error is returned: a half-run
    /// step cannot be resumed.
    pub fn step(&mut self) -> Result<Vec<RequestOutput>> {
        if let Some(overlapped) = self.overlap.take() {
            return self.step_overlapped(overlapped);
        }
        if self.speculation.is_some() {
            return self.dropping_all_on_failure(Self::step_speculative);
        }
        self.dropping_all_on_failure(|core| {
            let (step, mut outputs) = core.schedule()?;
            if !step.is_empty() {
                let sampled = core.execute(&step)?;
                outputs.extend(core.update(&step, sampled, None)?);
            }
            Ok(outputs)
        })
    }

    /// `step` through the overlapped stepper (taken out of the core while it runs).
    fn step_overlapped(&mut self, mut overlapped: OverlappedStep) -> Result<Vec<RequestOutput>> {
        let result = overlapped.step(self);
        if result.is_err() {
            overlapped.drop_in_flight(self);
            self.drop_all();
        }
        self.overlap = Some(overlapped);
        result
    }

    /// `f`'s result; when it failed, every request is forgotten first (`drop_all`).
    pub(super) fn dropping_all_on_failure<T>(&mut self, f: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        let result = f(self);
        if result.is_err() {
            self.drop_all();
        }
        result
    }

    /// Free the requests aborted since the last step (their final deltas come with it) and pick
    /// this step's work.
    pub(super) fn schedule(&mut self) -> Result<(ScheduledStep, Vec<RequestOutput>)> {
        let aborted = self.apply_aborts()?;
        Ok((self.sched.schedule(), aborted))
    }

    /// Run `step` now (a runner that does not overlap steps, or asynchronous scheduling off):
    /// its snapshot restores, the forward and a sampled token for every sequence that produces
    /// logits, in step order; then its bookkeeping (`account`).
    pub(super) fn execute(&mut self, step: &ScheduledStep) -> Result<Vec<SampledToken>> {
        let sampled = self.run_unaccounted(step)?;
        self.account(step)?;
        Ok(sampled)
    }

    /// `execute` without its bookkeeping, which the caller runs (`account`) once what the
    /// step's blocks must carry before they are published to the prefix cache is written.
    pub(super) fn run_unaccounted(&mut self, step: &ScheduledStep) -> Result<Vec<SampledToken>> {
        self.restore_states(step)?;
        let rows = self.sampling_rows(step, RowInput::Accepted);
        self.runner.forward_sampled(&step.batch, &rows)
    }

    /// Postprocess the tokens `step` sampled, then the scheduler's bookkeeping of the outcome
    /// (tokens appended, ended sequences removed, their final snapshots copied) and the ended
    /// requests forgotten. `queued_after`: the lookahead already queued behind `step`; a
    /// sequence that ends here but runs in it has a slot already past its tokens (no final
    /// snapshot then), and its row of that step is simply never collected into an output.
    pub(super) fn update(&mut self, step: &ScheduledStep, sampled: Vec<SampledToken>, queued_after: Option<&ScheduledStep>) -> Result<Vec<RequestOutput>> {
        let (outputs, outcomes) = self.postprocess(step, sampled)?;
        self.settle(&outcomes, queued_after)?;
        Ok(outputs)
    }

    /// The scheduler's bookkeeping of postprocessed `outcomes` (tokens appended, ended
    /// sequences removed, their final snapshots copied) and the ended requests forgotten.
    pub(super) fn settle(&mut self, outcomes: &[SeqOutcome], queued_after: Option<&ScheduledStep>) -> Result<()> {
        for (src, dst) in self.sched.update_from_output(outcomes, queued_after) {
            self.runner.copy_state(src, dst)?;
        }
        for ended in outcomes.iter().filter(|o| o.finished) {
            self.runner.mtp_release(ended.id);
            if let Some(req) = self.requests.remove(&ended.id) {
                self.ids.remove(&req.request_id);
            }
            self.pending_aborts.retain(|&a| a != ended.id);
        }
        Ok(())
    }

    /// Accept the tokens of `step` (one per sequence that produced logits, in step order): for
    /// each sequence whose request is still running, detokenize, check stop conditions and
    /// build its delta. The sequences of requests that ended with the step before (rows of a
    /// lookahead) are skipped.
    pub(super) fn postprocess(&mut self, step: &ScheduledStep, sampled: Vec<SampledToken>) -> Result<(Vec<RequestOutput>, Vec<SeqOutcome>)> {
        let mut outputs = Vec::new();
        let mut outcomes = Vec::new();
        let with_logits = step.seq_ids.iter().zip(&step.batch.seqs).filter(|(_, seq)| seq.logits != LogitsWanted::None);
        for ((&id, _), s) in with_logits.zip(sampled) {
            let cached = self.sched.cached_tokens(id);
            let Some(req) = self.requests.get_mut(&id) else { continue };
            let reasoning_before = req.reasoning_tokens();
            let event = req.accept(s.token, s.logprob, self.tokenizer.as_deref(), &self.eos_token_ids, cached)?;
            self.stats.generation_tokens_total += 1;
            self.stats.reasoning_tokens_total += (req.reasoning_tokens() - reasoning_before) as u64;
            outcomes.push(SeqOutcome { id, token: s.token, finished: event.finished, computed: false });
            outputs.push(event.output);
        }
        Ok((outputs, outcomes))
    }

    /// The decode step to queue behind `prev` before its tokens are known, when that is safe:
    /// no abort is pending (aborts free blocks and take snapshots, which need a settled state),
    /// no sequence of `prev` is sure to end with its token in flight (its length limit), and
    /// the scheduler would pick exactly this step (`Scheduler::schedule_lookahead`). Split
    /// when a sequence samples its next token from a host input the token in flight changes (a
    /// grammar mask; penalties count it on the runner instead, `count_input`), so only the
    /// forward pass runs ahead.
    pub(super) fn schedule_lookahead(&mut self, prev: &ScheduledStep) -> Option<(ScheduledStep, Lookahead)> {
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
        let how = if split { Lookahead::Split } else { Lookahead::Whole };
        self.sched.schedule_lookahead(prev).map(|next| (next, how))
    }

    /// Queue `step` (with the snapshot restores it needs first) and the sampling of a token for
    /// every sequence that produces logits, in step order, on a runner that overlaps steps; its
    /// tokens come from `collect`. `input`: `RowInput::InFlight` for a lookahead, whose tokens
    /// the runner takes from the step launched before it.
    pub(super) fn launch(&mut self, step: &ScheduledStep, input: RowInput) -> Result<()> {
        self.restore_states(step)?;
        let rows = self.sampling_rows(step, input);
        self.runner.launch_sampled(&step.batch, &rows, input == RowInput::InFlight)
    }

    /// The first half of a split lookahead: the forward pass of `step` (fed its tokens on the
    /// runner), queued before the step in flight is updated.
    pub(super) fn launch_forward(&mut self, step: &ScheduledStep) -> Result<()> {
        self.restore_states(step)?;
        self.runner.launch_forward(&step.batch, true)
    }

    /// The second half, once the step before is updated: the rows, built from the states its
    /// tokens left, and their sampling, queued behind the forward.
    pub(super) fn launch_sampling(&mut self, step: &ScheduledStep) -> Result<()> {
        let rows = self.sampling_rows(step, RowInput::FedThenAccepted);
        self.runner.launch_sampling(&rows)
    }

    /// The tokens of the oldest step launched and not collected (waits for it).
    pub(super) fn collect(&mut self) -> Result<Vec<SampledToken>> {
        self.runner.collect_sampled()
    }

    /// The scheduler's bookkeeping of a launched step (computed counts, prefix-cache blocks,
    /// the snapshots it reaches, queued right behind it) and the step counters.
    pub(super) fn account(&mut self, step: &ScheduledStep) -> Result<()> {
        for (src, dst) in self.sched.on_step_launched(step) {
            self.runner.copy_state(src, dst)?;
        }
        self.stats.steps += 1;
        self.stats.max_batch_size_seen = self.stats.max_batch_size_seen.max(step.seq_ids.len());
        self.stats.prefill_tokens_computed += (step.batch.num_tokens() - step.num_decodes - step.num_draft_tokens()) as u64;
        Ok(())
    }

    /// Forget every request and free what it holds (after a runner failure).
    fn drop_all(&mut self) {
        // No final snapshots: a failed step may have left any slot half-written (and a snapshot
        // reserved here would never be copied into).
        for id in self.requests.keys().copied().collect::<Vec<_>>() {
            self.sched.finish(id, SlotState::Unsettled);
            self.runner.mtp_release(id);
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
        let Some(loan) = self.sched.lend(needed) else {
            let per_block = (bs * self.spec.kv_bytes_per_token) as u64;
            return Err(NinferError::OutOfMemory {
                what: format!("KV blocks to score {} tokens", tokens.len()),
                needed: needed as u64 * per_block,
                available: self.sched.free_blocks() as u64 * per_block,
                hint: "wait for running requests to finish or raise --kv-capacity".into(),
            });
        };
        let result = self.score_with(tokens, &loan);
        self.sched.give_back(loan);
        result
    }

    /// Counters.
    pub fn stats(&self) -> EngineStats {
        let (lookahead_steps, split_lookahead_steps) = self.overlap.as_ref().map_or((0, 0), |o| (o.lookahead_steps, o.split_lookahead_steps));
        EngineStats {
            running: self.sched.num_running(),
            waiting: self.sched.num_waiting(),
            kv_blocks_used: self.sched.used_blocks(),
            kv_blocks_total: self.sched.total_blocks(),
            prefix_hit_tokens: self.sched.prefix_hit_tokens(),
            preemptions: self.sched.num_preemptions(),
            lookahead_steps,
            split_lookahead_steps,
            ..self.stats.clone()
        }
    }

    /// Recurrent-state snapshots currently held (tests).
    #[cfg(test)]
    pub(crate) fn sched_snapshots_held(&self) -> usize {
        self.sched.snapshots_held()
    }

    fn score_with(&mut self, tokens: &[u32], loan: &Loan) -> Result<Vec<f32>> {
        let slot = loan.state_slot.ok_or_else(|| NinferError::Request("score".into(), "no free recurrent-state slot".into()))?;
        let bs = self.cfg.block_size;
        let mut out = Vec::with_capacity(tokens.len() * self.validator.vocab_size);
        let mut start = 0;
        while start < tokens.len() {
            let end = (start + self.cfg.prefill_chunk).min(tokens.len());
            let batch = StepBatch {
                seqs: vec![SeqChunk {
                    tokens: tokens[start..end].to_vec(),
                    start_pos: start,
                    block_table: loan.block_table[..end.div_ceil(bs)].to_vec(),
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
            let cached = self.sched.cached_tokens(id);
            if let Some(copy) = self.sched.finish(id, SlotState::Current) {
                self.runner.copy_state(copy.0, copy.1)?;
            }
            self.runner.mtp_release(id);
            if let Some(req) = self.requests.remove(&id) {
                self.ids.remove(&req.request_id);
                outputs.push(req.aborted(cached));
            }
        }
        Ok(outputs)
    }

    /// The snapshot restores `step` needs before it runs.
    pub(super) fn restore_states(&mut self, step: &ScheduledStep) -> Result<()> {
        for &(src, dst) in &step.copies_before {
            self.runner.copy_state(src, dst)?;
        }
        Ok(())
    }

    /// One sampling row for every sequence of `step` that produces logits (each takes its
    /// request's RNG draw), built knowing what `input` says of the step's input tokens. Under
    /// `RowInput::FedThenAccepted` a request that ended with its input token is gone and gets a
    /// greedy, unconstrained row whose token is dropped, as a request ending under a whole
    /// lookahead has its row computed and dropped.
    fn sampling_rows(&mut self, step: &ScheduledStep, input: RowInput) -> Vec<RowSampling> {
        let vocab = self.runner.config().vocab_size;
        step.seq_ids
            .iter()
            .zip(&step.batch.seqs)
            .filter(|(_, seq)| seq.logits != LogitsWanted::None)
            .map(|(id, _)| match self.requests.get_mut(id) {
                Some(req) => req.prepare_sampling(vocab, input),
                None if input == RowInput::FedThenAccepted => RowSampling { temperature: 0.0, ..Default::default() },
                None => unreachable!("a scheduled request runs until a completed step ends it"),
            })
            .collect()
    }
}
