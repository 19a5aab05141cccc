//! `Scheduler`: decides, each step, which sequences run and with how many tokens, and hands out
//! KV blocks and state slots for them.
//!
//! One token budget (`prefill_chunk`) covers the whole step: first every running sequence that
//! is decoding (one token each), then running sequences that are part-way through a long prompt,
//! then waiting sequences in arrival order, each admitted only when the KV blocks for all its
//! tokens plus one block of headroom (and a state slot) are free. When a decode needs a block and
//! none is free, the newest running sequence is preempted: its blocks and slot are freed and it
//! goes back to the front of the queue to be recomputed (its full blocks usually stay cached).

use std::collections::{HashMap, VecDeque};

use super::{SeqId, SeqStatus, Sequence};
use crate::kv::BlockPool;
use crate::model::{LogitsWanted, SeqChunk, StepBatch};
use crate::state::StateSlots;

/// The knobs the scheduler needs.
#[derive(Clone, Debug)]
pub struct SchedulerConfig {
    pub max_concurrency: usize,
    /// Token budget of one step.
    pub prefill_chunk: usize,
    pub prefix_reuse: bool,
    /// A cached block also holds state that reads the token after it (`--spec mtp`: the MTP
    /// row at its last position pairs the hidden state there with the next token): that token
    /// is part of what a prefix hit must match, and a block is cached once it is known.
    pub key_next_token: bool,
}

/// What one step runs.
#[derive(Debug, Default)]
pub struct ScheduledStep {
    /// The batch for the runner.
    pub batch: StepBatch,
    /// Which sequence each batch entry belongs to.
    pub seq_ids: Vec<SeqId>,
    /// State copies (src slot, dst slot) to run before the forward (snapshot restores).
    pub copies_before: Vec<(usize, usize)>,
    /// Entries that are decodes (one token of a sequence past its prompt).
    pub num_decodes: usize,
    /// Draft tokens after the input token of each entry (a verify chunk; speculative
    /// decoding), parallel to `seq_ids`; empty when no entry carries one.
    pub drafts: Vec<usize>,
}

impl ScheduledStep {
    /// Whether nothing runs.
    pub fn is_empty(&self) -> bool {
        self.seq_ids.is_empty()
    }

    /// Draft tokens carried by entry `i` (0 for a prompt chunk or a plain decode).
    pub fn draft_len(&self, i: usize) -> usize {
        self.drafts.get(i).copied().unwrap_or(0)
    }

    /// All draft tokens of the step.
    pub fn num_draft_tokens(&self) -> usize {
        self.drafts.iter().sum()
    }
}

/// One sequence's outcome of a completed step, as the engine's postprocessing decided it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeqOutcome {
    pub id: SeqId,
    /// The token it sampled (appended to its tokens).
    pub token: u32,
    /// Its request ended with this token: the sequence is removed.
    pub finished: bool,
    /// The token is an accepted draft token: the step already computed its KV and state.
    pub computed: bool,
}

/// Whether a finishing sequence's state slot holds the state of exactly its computed tokens,
/// so that a final snapshot of it can be taken.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotState {
    /// It does: a snapshot is taken when the sequence ends on a block boundary.
    Current,
    /// A step queued after its last counted one has already advanced it (asynchronous
    /// scheduling; the decode-boundary snapshot of `on_step_launched` already holds that state,
    /// under the same key), or a runner failure interrupted a step: no snapshot.
    Unsettled,
}

/// KV blocks and a state slot lent outside any sequence (the engine's warm-up step, `score`);
/// nobody else holds them until `Scheduler::give_back`.
#[derive(Debug)]
#[must_use = "a loan must be given back"]
pub struct Loan {
    pub block_table: Vec<u32>,
    /// The slot to run in: 0 for a model without recurrent state, None when every running slot
    /// is taken.
    pub state_slot: Option<usize>,
}

/// Queues, sequences and the caches' bookkeeping. The KV block pool and the state slots are
/// its own: the engine reaches them only through the methods below.
#[derive(Debug)]
pub struct Scheduler {
    cfg: SchedulerConfig,
    pool: BlockPool,
    slots: StateSlots,
    seqs: HashMap<SeqId, Sequence>,
    waiting: VecDeque<SeqId>,
    /// Running sequences, oldest admission first.
    running: Vec<SeqId>,
    /// Preemptions since start.
    num_preemptions: u64,
}

impl Scheduler {
    /// A scheduler over a KV pool and state slots sized by the engine.
    pub fn new(cfg: SchedulerConfig, pool: BlockPool, slots: StateSlots) -> Self {
        Scheduler { cfg, pool, slots, seqs: HashMap::new(), waiting: VecDeque::new(), running: Vec::new(), num_preemptions: 0 }
    }

    /// Queue a new sequence.
    pub fn add(&mut self, seq: Sequence) {
        self.waiting.push_back(seq.id);
        self.seqs.insert(seq.id, seq);
    }

    /// A sequence by id.
    pub fn get(&self, id: SeqId) -> Option<&Sequence> {
        self.seqs.get(&id)
    }

    /// Append a sampled token to a sequence.
    pub fn append_token(&mut self, id: SeqId, token: u32) {
        if let Some(s) = self.seqs.get_mut(&id) {
            s.tokens.push(token);
        }
    }

    /// Prompt tokens `id` was served from the prefix cache at its first admission (0 before).
    pub fn cached_tokens(&self, id: SeqId) -> usize {
        self.seqs.get(&id).and_then(|s| s.cached_tokens).unwrap_or(0)
    }

    /// Blocks that can be handed out now.
    pub fn free_blocks(&self) -> usize {
        self.pool.num_free()
    }

    /// Blocks held by a sequence or a loan.
    pub fn used_blocks(&self) -> usize {
        self.pool.num_used()
    }

    /// Blocks in the KV pool.
    pub fn total_blocks(&self) -> usize {
        self.pool.num_blocks()
    }

    /// Prefix-cache hits, in tokens, since start.
    pub fn prefix_hit_tokens(&self) -> u64 {
        self.pool.hit_tokens
    }

    /// Preemptions since start.
    pub fn num_preemptions(&self) -> u64 {
        self.num_preemptions
    }

    /// Recurrent-state snapshots currently held.
    pub fn snapshots_held(&self) -> usize {
        self.slots.num_snapshots_held()
    }

    /// Lend `blocks` free KV blocks and a running state slot to a step outside the queues; None
    /// when fewer blocks are free.
    pub fn lend(&mut self, blocks: usize) -> Option<Loan> {
        if self.pool.num_free() < blocks {
            return None;
        }
        let block_table = (0..blocks).map(|_| self.pool.allocate().expect("free blocks counted above")).collect();
        let state_slot = if self.slots.enabled() { self.slots.acquire() } else { Some(0) };
        Some(Loan { block_table, state_slot })
    }

    /// Take back what `lend` handed out. Nothing a loan's step wrote is reachable afterwards:
    /// its blocks were never registered in the prefix cache, and a sequence starting at
    /// position 0 clears the slot it gets.
    pub fn give_back(&mut self, loan: Loan) {
        self.pool.free_all(&loan.block_table);
        if let (true, Some(s)) = (self.slots.enabled(), loan.state_slot) {
            self.slots.release(s);
        }
    }

    /// Running sequences.
    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Waiting sequences.
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Whether any sequence is known.
    pub fn has_work(&self) -> bool {
        !self.seqs.is_empty()
    }

    /// Pick this step's work.
    pub fn schedule(&mut self) -> ScheduledStep {
        let mut step = ScheduledStep::default();
        let mut budget = self.cfg.prefill_chunk;
        let mut scheduled: Vec<SeqId> = Vec::new();

        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let id = self.running[i];
            if self.seqs[&id].remaining() != 1 {
                i += 1;
                continue;
            }
            if !self.ensure_blocks_or_preempt(id) {
                break;
            }
            // Blocks for drafts come after one block for each decode still to schedule.
            let k = self.fit_draft(id, budget - 1, self.running.len() - i - 1);
            self.push_chunk(&mut step, id, 1);
            if k > 0 {
                let chunk = step.batch.seqs.last_mut().expect("pushed above");
                let seq = &self.seqs[&id];
                chunk.tokens.extend_from_slice(&seq.draft[..k]);
                chunk.block_table = seq.block_table[..(chunk.start_pos + 1 + k).div_ceil(self.pool.block_size())].to_vec();
                chunk.logits = LogitsWanted::All;
                step.drafts.resize(step.seq_ids.len() - 1, 0);
                step.drafts.push(k);
            }
            step.num_decodes += 1;
            scheduled.push(id);
            budget -= 1 + k;
            i += 1;
        }

        for idx in 0..self.running.len() {
            if budget == 0 {
                break;
            }
            let id = self.running[idx];
            if scheduled.contains(&id) || self.seqs[&id].remaining() <= 1 {
                continue;
            }
            let n = self.chunk_len(id, budget);
            self.push_chunk(&mut step, id, n);
            budget -= n;
        }

        while budget > 0 && self.running.len() < self.cfg.max_concurrency {
            let Some(&id) = self.waiting.front() else { break };
            let Some(copy) = self.try_admit(id) else { break };
            self.waiting.pop_front();
            step.copies_before.extend(copy);
            let n = self.chunk_len(id, budget);
            self.push_chunk(&mut step, id, n);
            budget -= n;
        }
        step
    }

    /// Once the runner has `step` (run, or queued in order): advance computed counts, publish full blocks to the prefix
    /// cache, and return the state copies (src, dst) that take snapshots now: at a prompt's last
    /// block boundary, and at each block boundary reached while decoding (a sequence keeps only
    /// its latest decode snapshot, which is what the next turn of a conversation resumes from).
    pub fn on_step_launched(&mut self, step: &ScheduledStep) -> Vec<(usize, usize)> {
        let bs = self.pool.block_size();
        let mut copies = Vec::new();
        for (chunk, id) in step.batch.seqs.iter().zip(&step.seq_ids) {
            let Some(seq) = self.seqs.get_mut(id) else { continue };
            // A verify chunk's draft tokens count once accepted (`update_from_output`).
            seq.num_computed += chunk.tokens.len().min(seq.remaining());
            if self.cfg.prefix_reuse {
                register_full_blocks(&mut self.pool, seq, bs, self.cfg.key_next_token);
                // Snapshot keys: blocks not cached yet (their next token unknown) have them too.
                seq.ensure_hashes(seq.num_computed / bs, bs);
            }
            // A verify chunk's boundaries are reached once its drafts are accepted
            // (`draft_snapshot`).
            let decode_boundary = self.cfg.prefix_reuse && chunk.tokens.len() == 1 && seq.num_computed % bs == 0;
            if seq.snapshot_at == Some(seq.num_computed) {
                seq.snapshot_at = None;
                if let (Some(slot), Some(dst)) = (seq.state_slot, self.slots.reserve_snapshot(seq.block_hashes[seq.num_computed / bs - 1])) {
                    copies.push((slot, dst));
                }
            } else if decode_boundary && seq.state_slot.is_some() {
                let key = seq.block_hashes[seq.num_computed / bs - 1];
                if let Some(old) = seq.trailing_snapshot.replace(key) {
                    self.slots.drop_snapshot(old);
                }
                if let (Some(slot), Some(dst)) = (seq.state_slot, self.slots.reserve_snapshot(key)) {
                    copies.push((slot, dst));
                }
            }
        }
        copies
    }

    /// The bookkeeping of a completed step, once its tokens were postprocessed: append each
    /// sequence's token and remove those whose requests ended (`finish`). `queued_after`: the
    /// lookahead step already queued behind it (asynchronous scheduling); a sequence ending here
    /// that runs in it has a slot already past its tokens (`SlotState::Unsettled`). Returns the
    /// state copies that take final snapshots, in order.
    pub fn update_from_output(&mut self, outcomes: &[SeqOutcome], queued_after: Option<&ScheduledStep>) -> Vec<(usize, usize)> {
        let mut copies = Vec::new();
        let bs = self.pool.block_size();
        for o in outcomes {
            self.append_token(o.id, o.token);
            if let Some(seq) = self.seqs.get_mut(&o.id) {
                seq.draft.clear();
                if o.computed {
                    seq.num_computed += 1;
                }
                // A block's next token may be the one just appended.
                if self.cfg.prefix_reuse && (o.computed || self.cfg.key_next_token) {
                    register_full_blocks(&mut self.pool, seq, bs, self.cfg.key_next_token);
                }
            }
            if o.finished {
                let slot = if queued_after.is_some_and(|n| n.seq_ids.contains(&o.id)) { SlotState::Unsettled } else { SlotState::Current };
                copies.extend(self.finish(o.id, slot));
            }
        }
        // Blocks that held only rejected draft tokens go back to the pool: a sequence keeps the
        // blocks up to the position of its next input token.
        for o in outcomes {
            if let Some(seq) = self.seqs.get_mut(&o.id) {
                let keep = seq.tokens.len().div_ceil(bs);
                if seq.block_table.len() > keep {
                    let freed = seq.block_table.split_off(keep);
                    self.pool.free_all(&freed);
                }
            }
        }
        copies
    }

    /// Remove a sequence (finished or aborted), freeing its blocks and slot. Returns a state
    /// copy that snapshots its final state when it ends on a block boundary (hybrid models) and
    /// its slot is `SlotState::Current`.
    pub fn finish(&mut self, id: SeqId, slot_state: SlotState) -> Option<(usize, usize)> {
        let mut seq = self.seqs.remove(&id)?;
        self.running.retain(|&r| r != id);
        self.waiting.retain(|&w| w != id);
        let bs = self.pool.block_size();
        let mut copy = None;
        if let Some(slot) = seq.state_slot {
            let n = seq.num_computed;
            if self.cfg.prefix_reuse {
                seq.ensure_hashes(n / bs, bs);
            }
            if slot_state == SlotState::Current && self.cfg.prefix_reuse && n > 0 && n % bs == 0 && seq.block_hashes.len() >= n / bs {
                copy = self.slots.reserve_snapshot(seq.block_hashes[n / bs - 1]).map(|dst| (slot, dst));
            }
            self.slots.release(slot);
        }
        self.pool.free_all(&seq.block_table);
        copy
    }

    /// The decode step after `prev` for a backend that queues it before `prev`'s tokens are
    /// known (asynchronous scheduling): one token for each sequence of `prev`, in its order, at
    /// the position after its computed tokens; the token itself is the backend's to take from
    /// `prev`'s sampled output on the device (`tokens` holds a placeholder 0). Built only when it
    /// is the step `schedule` would build once `prev`'s tokens are appended: `prev` is all
    /// decodes and holds every running sequence, nobody waiting could be admitted (the queue is
    /// empty or the concurrency is full), and the blocks it needs are free without preempting.
    /// None otherwise, with nothing changed (the engine then waits for `prev` first).
    /// Call after `on_step_launched(prev)`; call `on_step_launched` on the result once `prev`'s tokens
    /// are appended (a block that fills must be hashed over real tokens).
    pub fn schedule_lookahead(&mut self, prev: &ScheduledStep) -> Option<ScheduledStep> {
        let n = prev.seq_ids.len();
        if n == 0 || prev.num_decodes != n || self.running.len() != n || n > self.cfg.prefill_chunk {
            return None;
        }
        if !self.waiting.is_empty() && self.running.len() < self.cfg.max_concurrency {
            return None;
        }
        let bs = self.pool.block_size();
        let mut new_blocks = 0;
        for id in &prev.seq_ids {
            let seq = self.seqs.get(id)?;
            if seq.status != SeqStatus::Running || seq.remaining() != 0 {
                return None;
            }
            new_blocks += usize::from(seq.block_table.len() * bs <= seq.num_computed);
        }
        if new_blocks > self.pool.num_free() {
            return None;
        }
        let mut step = ScheduledStep::default();
        for &id in &prev.seq_ids {
            let seq = self.seqs.get_mut(&id).expect("checked above");
            let pos = seq.num_computed;
            if seq.block_table.len() * bs <= pos {
                seq.block_table.push(self.pool.allocate().expect("free blocks counted above"));
            }
            step.batch.seqs.push(SeqChunk {
                tokens: vec![0],
                start_pos: pos,
                block_table: seq.block_table[..(pos + 1).div_ceil(bs)].to_vec(),
                state_slot: seq.state_slot.unwrap_or(0),
                logits: LogitsWanted::Last,
            });
            step.seq_ids.push(id);
        }
        step.num_decodes = n;
        Some(step)
    }

    /// Make sure a decoding sequence has a block for its next token, preempting the newest
    /// running sequences if needed. False when `id` itself had to be preempted.
    fn ensure_blocks_or_preempt(&mut self, id: SeqId) -> bool {
        let bs = self.pool.block_size();
        loop {
            let seq = &self.seqs[&id];
            if seq.block_table.len() * bs > seq.num_computed {
                return true;
            }
            if let Some(b) = self.pool.allocate() {
                self.seqs.get_mut(&id).expect("running").block_table.push(b);
                return true;
            }
            let victim = *self.running.last().expect("id is running");
            self.preempt(victim);
            if victim == id {
                return false;
            }
        }
    }

    /// Free a running sequence's blocks and slot and requeue it at the front for recompute.
    fn preempt(&mut self, id: SeqId) {
        self.running.retain(|&r| r != id);
        let seq = self.seqs.get_mut(&id).expect("known");
        self.pool.free_all(&seq.block_table);
        seq.block_table.clear();
        if let Some(slot) = seq.state_slot.take() {
            self.slots.release(slot);
        }
        seq.num_computed = 0;
        seq.num_registered_blocks = 0;
        seq.snapshot_at = None;
        seq.draft.clear();
        seq.status = SeqStatus::Waiting;
        self.waiting.push_front(id);
        self.num_preemptions += 1;
    }

    /// Admit the waiting sequence `id` if its blocks and slot fit: takes its prefix hit and
    /// allocates blocks for all its tokens. Returns the snapshot-restore copy, if any.
    fn try_admit(&mut self, id: SeqId) -> Option<Option<(usize, usize)>> {
        let bs = self.pool.block_size();
        let hybrid = self.slots.enabled();
        if hybrid && self.slots.num_free() == 0 {
            return None;
        }
        let seq = self.seqs.get_mut(&id).expect("waiting");
        let len = seq.tokens.len();
        let (hit_ids, snapshot) = if self.cfg.prefix_reuse {
            seq.ensure_hashes(len / bs, bs);
            let max_hit = (len - 1) / bs;
            let next = usize::from(self.cfg.key_next_token);
            let mut ids = Vec::new();
            for b in 0..max_hit {
                match self.pool.lookup(seq.block_hashes[b], &seq.tokens[b * bs..(b + 1) * bs + next]) {
                    Some(blk) => ids.push(blk),
                    None => break,
                }
            }
            if hybrid {
                let usable = (1..=ids.len()).rev().find(|&j| self.slots.has_snapshot(seq.block_hashes[j - 1]));
                match usable {
                    Some(j) => {
                        ids.truncate(j);
                        (ids, self.slots.find_snapshot(seq.block_hashes[j - 1]))
                    }
                    None => (Vec::new(), None),
                }
            } else {
                (ids, None)
            }
        } else {
            (Vec::new(), None)
        };
        let needed = len.div_ceil(bs) - hit_ids.len();
        let hits_now_free = hit_ids.iter().filter(|&&b| self.pool.ref_count(b) == 0).count();
        let headroom = usize::from(!self.running.is_empty());
        if needed + hits_now_free + headroom > self.pool.num_free() {
            return None;
        }
        let hit = hit_ids.len() * bs;
        for &b in &hit_ids {
            self.pool.acquire_cached(b);
        }
        let mut table = hit_ids;
        for _ in 0..needed {
            table.push(self.pool.allocate().expect("checked free blocks"));
        }
        let slot = if hybrid { self.slots.acquire() } else { None };
        let seq = self.seqs.get_mut(&id).expect("waiting");
        seq.block_table = table;
        seq.num_computed = hit;
        seq.num_registered_blocks = hit / bs;
        seq.state_slot = slot;
        seq.cached_tokens.get_or_insert(hit);
        seq.status = SeqStatus::Running;
        let aligned = len / bs * bs;
        seq.snapshot_at = (hybrid && self.cfg.prefix_reuse && aligned > hit).then_some(aligned);
        self.running.push(id);
        Some(match (snapshot, slot) {
            (Some(src), Some(dst)) if hit > 0 => Some((src, dst)),
            _ => None,
        })
    }

    /// The decode-boundary snapshot a verify chunk of `id` reaches once its draft tokens
    /// `accepted` (computed by the verify forward, not appended yet) follow its input token
    /// (counted by `on_step_launched`): the state after the last block boundary within them
    /// becomes the sequence's trailing snapshot, as a plain decode's does at each boundary.
    /// Returns (the token count the snapshot holds, the sequence's slot, the snapshot slot):
    /// the engine copies the state when its rollback has brought the slot to that point.
    pub fn draft_snapshot(&mut self, id: SeqId, accepted: &[u32]) -> Option<(usize, usize, usize)> {
        let bs = self.pool.block_size();
        let seq = self.seqs.get_mut(&id)?;
        let (slot, end) = (seq.state_slot?, seq.num_computed + accepted.len());
        let boundary = end / bs * bs;
        if !self.cfg.prefix_reuse || seq.snapshot_at.is_some() || boundary == 0 || boundary < seq.num_computed || seq.tokens.len() != seq.num_computed {
            return None;
        }
        let mut key = seq.block_hashes.get(boundary / bs - 1).copied();
        if key.is_none() {
            let mut tokens = seq.tokens.clone();
            tokens.extend_from_slice(accepted);
            let mut parent = seq.block_hashes.last().copied();
            for b in seq.block_hashes.len()..boundary / bs {
                parent = Some(crate::kv::block_hash(parent, &tokens[b * bs..(b + 1) * bs]));
            }
            key = parent;
        }
        let key = key?;
        if let Some(old) = seq.trailing_snapshot.replace(key) {
            self.slots.drop_snapshot(old);
        }
        self.slots.reserve_snapshot(key).map(|dst| (boundary, slot, dst))
    }

    /// Give every running decoding sequence the draft `propose` returns for it (speculative
    /// decoding), to be verified in the next `schedule`. A sequence whose state snapshot is due
    /// right after its next token gets none: the snapshot is copied as the step is launched,
    /// before a rejected draft could be rolled back.
    pub fn set_drafts(&mut self, mut propose: impl FnMut(&Sequence) -> Vec<u32>) {
        for id in &self.running {
            let seq = self.seqs.get_mut(id).expect("running");
            let snapshot_due = seq.snapshot_at == Some(seq.num_computed + 1);
            seq.draft = if seq.remaining() == 1 && !snapshot_due { propose(seq) } else { Vec::new() };
        }
    }

    /// Draft tokens of decoding sequence `id` that fit `budget` and the KV blocks: blocks for
    /// them are taken only while more than `reserve` are free (a draft never makes a decode
    /// preempt anyone), and the draft is cut where they run out.
    fn fit_draft(&mut self, id: SeqId, budget: usize, reserve: usize) -> usize {
        let bs = self.pool.block_size();
        let seq = self.seqs.get_mut(&id).expect("running");
        let mut k = seq.draft.len().min(budget);
        while k > 0 && seq.block_table.len() * bs < seq.num_computed + 1 + k {
            match (self.pool.num_free() > reserve).then(|| self.pool.allocate()).flatten() {
                Some(b) => seq.block_table.push(b),
                None => k = seq.block_table.len() * bs - seq.num_computed - 1,
            }
        }
        seq.draft.truncate(k);
        k
    }

    /// Tokens of `id` to run now within `budget`, stopping at its snapshot point.
    fn chunk_len(&self, id: SeqId, budget: usize) -> usize {
        let seq = &self.seqs[&id];
        let mut n = seq.remaining().min(budget);
        if let Some(at) = seq.snapshot_at {
            if at > seq.num_computed {
                n = n.min(at - seq.num_computed);
            }
        }
        n
    }

    fn push_chunk(&mut self, step: &mut ScheduledStep, id: SeqId, n: usize) {
        let seq = &self.seqs[&id];
        let start = seq.num_computed;
        let end = start + n;
        let bs = self.pool.block_size();
        step.batch.seqs.push(SeqChunk {
            tokens: seq.tokens[start..end].to_vec(),
            start_pos: start,
            block_table: seq.block_table[..end.div_ceil(bs)].to_vec(),
            state_slot: seq.state_slot.unwrap_or(0),
            logits: if end == seq.tokens.len() { LogitsWanted::Last } else { LogitsWanted::None },
        });
        step.seq_ids.push(id);
    }
}

/// Publish the full blocks of `seq`'s computed tokens to the prefix cache; with
/// `key_next_token`, only those whose next token is known, cached with it.
fn register_full_blocks(pool: &mut BlockPool, seq: &mut Sequence, bs: usize, key_next_token: bool) {
    let next = usize::from(key_next_token);
    let full = seq.num_computed.min(seq.tokens.len() - next) / bs;
    seq.ensure_hashes(full, bs);
    for b in seq.num_registered_blocks..full {
        pool.register_full(seq.block_table[b], seq.block_hashes[b], &seq.tokens[b * bs..(b + 1) * bs + next]);
    }
    seq.num_registered_blocks = seq.num_registered_blocks.max(full);
}

#[cfg(test)]
#[path = "scheduler_tests.rs"]
mod tests;
