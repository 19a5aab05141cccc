//! `ToyRunner`: a deterministic stand-in model that really uses the KV blocks and state slots it
//! is handed, for testing the engine without weights (Rust tests, and Python tests through
//! `Engine.toy`).
//!
//! Each step writes every token into its KV slot (block table + position). The logits of a
//! position are a hash of the whole history read back through the block table, so a wrong block
//! table, a wrong start position or a stale block changes the output. In hybrid mode the runner
//! also keeps a recurrent "state" per slot (the same hash chain, carried across steps) and fails
//! the step when it disagrees with the KV history: a wrong slot, a missing snapshot restore or a
//! bad prefix hit is caught at once.
//!
//! `with_mtp_head()` gives it a toy MTP head for `--spec mtp`: its MTP KV row at position p is
//! a hash of the history through p and the token at p + 1, and every draft call first checks
//! the rows before it against the KV history (a stale row, left by a rejected draft or a
//! prefix hit, fails the call); its draft distribution q is a known function of the history,
//! different from the target's (`draft_logits`).
//!
//! In hybrid mode it rolls its state back by replay (`enable_state_replay`): a keeping forward
//! keeps the verify chunks' tokens, and a replay folds the kept tokens into the source slot's
//! hash chain. `recomputing()` turns that off, so the engine rolls back by recompute.
//!
//! `overlapping()` makes it a runner that `overlaps_steps` the way a device backend does, for
//! testing asynchronous scheduling on the host: `launch_forward` runs the forward at once and
//! `launch_sampling` samples it (as a device stream runs queued work in order), keeping the
//! tokens until `collect_sampled`; a fed step takes its tokens from the step sampled before it,
//! and its rows with penalties count them (`RowSampling::with_input`, the device sampler's
//! reference).

use std::sync::{Arc, Mutex};

use crate::config::ModelConfig;
use std::collections::VecDeque;

use crate::model::runner::check_verify_rows;
use crate::model::runner::check_replays;
use crate::model::{CacheSpec, Logits, LogitsWanted, ModelRunner, MtpDraft, MtpDraftSeq, MtpRows, StateReplay, StepBatch, VerifyLogits};
use crate::sampling::{argmax, RowSampling, SampledToken};
use crate::spec::draw_draft;
use crate::{NinferError, Result};

/// What a test can inspect after the run.
#[derive(Debug, Default)]
pub struct ToyLog {
    /// Every batch the runner received.
    pub steps: Vec<StepBatch>,
    /// Every `copy_state(src, dst)` call.
    pub copies: Vec<(usize, usize)>,
    /// Every `replay_states` call.
    pub replays: Vec<Vec<StateReplay>>,
    /// For each `warm_up_kernels` call, the steps the runner had received by then.
    pub kernel_warm_ups: Vec<usize>,
    /// For each `forward_verify` call, each sequence's wanted logits and whether it was picked
    /// by argmax (true) or got its logits rows (false).
    pub verify_routes: Vec<Vec<(LogitsWanted, bool)>>,
}

/// Deterministic toy model.
pub struct ToyRunner {
    config: ModelConfig,
    hybrid: bool,
    block_size: usize,
    kv: Vec<Option<u32>>,
    states: Vec<u64>,
    /// Shared with the test that built the runner.
    pub log: Arc<Mutex<ToyLog>>,
    /// Launched steps' tokens not collected yet (`overlapping` only).
    launched: Option<VecDeque<Vec<SampledToken>>>,
    /// Tokens of the last launched step (what a fed step continues).
    last_launched: Vec<u32>,
    /// The logits of the step `launch_forward` ran and `launch_sampling` has not sampled yet,
    /// with the input token of each row when it was fed.
    forwarded: Option<(Logits, Option<Vec<u32>>)>,
    /// The toy MTP head (`with_mtp_head`): whether `--spec mtp` enabled it, and its KV rows.
    mtp: Option<(bool, Vec<Option<u64>>)>,
    /// State replay (hybrid only): None after `recomputing()`; else the chunks the next forward
    /// keeps and the tokens of each kept chunk, once `enable_state_replay` ran.
    replay: Option<Option<(Vec<usize>, Vec<Vec<u32>>)>>,
}

fn mix(h: u64, t: u64) -> u64 {
    let mut x = h ^ t.wrapping_add(0x9E37_79B9_7F4A_7C15).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 31;
    x = x.wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 29)
}

impl ToyRunner {
    /// A toy with `vocab_size` tokens and context `max_position_embeddings`; `hybrid` adds a
    /// recurrent state per slot.
    pub fn new(vocab_size: usize, max_position_embeddings: usize, hybrid: bool) -> Self {
        ToyRunner {
            config: ModelConfig { vocab_size, max_position_embeddings, ..Default::default() },
            hybrid,
            block_size: 0,
            kv: Vec::new(),
            states: Vec::new(),
            log: Arc::new(Mutex::new(ToyLog::default())),
            launched: None,
            last_launched: Vec::new(),
            forwarded: None,
            mtp: None,
            replay: hybrid.then_some(None),
        }
    }

    /// The same toy without state replay: the engine rolls its state back by recompute.
    pub fn recomputing(mut self) -> Self {
        self.replay = None;
        self
    }

    /// The same toy with an MTP head to draft with (`--spec mtp`).
    pub fn with_mtp_head(mut self) -> Self {
        self.mtp = Some((false, Vec::new()));
        self
    }

    /// The toy head's draft logits after the history whose hash chain ends in `h`: half the
    /// target's logits plus a fixed tilt over the ids, so q differs from the target's p.
    pub fn draft_logits(&self, h: u64) -> Vec<f32> {
        let mut target = Vec::with_capacity(self.config.vocab_size);
        self.row(h, &mut target);
        let n = self.config.vocab_size as f32;
        target.iter().enumerate().map(|(v, &l)| 0.5 * l + ((v * 7) % self.config.vocab_size) as f32 * 3.0 / n - 1.5).collect()
    }

    /// The MTP rows at positions `0..end` of a sequence, checked against the rows its KV
    /// history gives.
    fn check_mtp_rows(&self, table: &[u32], end: usize) -> Result<()> {
        let Some((_, rows)) = &self.mtp else { return Ok(()) };
        let hist = self.history(table, end + 1)?;
        for p in 0..end {
            let next = self.kv[self.kv_index(table, p + 1)?].expect("read by history");
            if rows[self.kv_index(table, p)?] != Some(mix(hist[p], next as u64)) {
                return Err(NinferError::Device(format!("toy: stale MTP KV row at position {p}")));
            }
        }
        Ok(())
    }

    /// The same toy as a runner that overlaps steps (`launch_forward`, `launch_sampling`, `collect_sampled`).
    pub fn overlapping(mut self) -> Self {
        self.launched = Some(VecDeque::new());
        self
    }

    /// The logits row after the history whose hash chain ends in `h`.
    fn row(&self, h: u64, out: &mut Vec<f32>) {
        for v in 0..self.config.vocab_size {
            out.push(((mix(h, v as u64) >> 40) as f32 / (1u64 << 24) as f32) * 8.0 - 4.0);
        }
    }

    fn kv_index(&self, table: &[u32], pos: usize) -> Result<usize> {
        let b = *table.get(pos / self.block_size).ok_or_else(|| NinferError::Device(format!("toy: block table too short for position {pos}")))?;
        Ok(b as usize * self.block_size + pos % self.block_size)
    }

    /// Hash chains of positions `0..end` read back from the KV cache.
    fn history(&self, table: &[u32], end: usize) -> Result<Vec<u64>> {
        let mut h = 0u64;
        let mut out = Vec::with_capacity(end);
        for pos in 0..end {
            let t = self.kv[self.kv_index(table, pos)?].ok_or_else(|| NinferError::Device(format!("toy: position {pos} read before it was written")))?;
            h = mix(h, t as u64);
            out.push(h);
        }
        Ok(out)
    }
}

impl ModelRunner for ToyRunner {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn cache_spec(&self) -> CacheSpec {
        CacheSpec { kv_bytes_per_token: 64, state_bytes_per_slot: if self.hybrid { 256 } else { 0 }, weight_bytes: 4096 }
    }

    fn allocate_caches(&mut self, num_blocks: usize, block_size: usize, num_state_slots: usize) -> Result<()> {
        self.block_size = block_size;
        self.kv = vec![None; num_blocks * block_size];
        if let Some((_, rows)) = self.mtp.as_mut() {
            *rows = vec![None; num_blocks * block_size];
        }
        self.states = vec![0; num_state_slots];
        Ok(())
    }

    fn forward(&mut self, batch: &StepBatch) -> Result<Logits> {
        self.log.lock().expect("toy log").steps.push(batch.clone());
        if let Some(Some((pending, kept))) = self.replay.as_mut() {
            if !pending.is_empty() {
                let chunk = |i: usize| batch.seqs.get(i).map(|c| c.tokens.clone()).ok_or_else(|| NinferError::Device(format!("toy: kept chunk {i} of a step of {}", batch.seqs.len())));
                *kept = pending.drain(..).map(chunk).collect::<Result<_>>()?;
            }
        }
        let mut logits = Logits { vocab: self.config.vocab_size, data: Vec::new(), rows: Vec::new() };
        for seq in &batch.seqs {
            for (j, &t) in seq.tokens.iter().enumerate() {
                let idx = self.kv_index(&seq.block_table, seq.start_pos + j)?;
                self.kv[idx] = Some(t);
            }
            let end = seq.start_pos + seq.tokens.len();
            let hist = self.history(&seq.block_table, end)?;
            if self.hybrid {
                let mut state = if seq.start_pos == 0 { 0 } else { self.states[seq.state_slot] };
                let expected_before = if seq.start_pos == 0 { 0 } else { hist[seq.start_pos - 1] };
                if state != expected_before {
                    return Err(NinferError::Device(format!("toy: state slot {} does not match the KV history at {}", seq.state_slot, seq.start_pos)));
                }
                for &t in &seq.tokens {
                    state = mix(state, t as u64);
                }
                self.states[seq.state_slot] = state;
            }
            let rows = match seq.logits {
                LogitsWanted::None => 0,
                LogitsWanted::Last => 1,
                LogitsWanted::All => seq.tokens.len(),
            };
            for &h in &hist[end - rows..end] {
                self.row(h, &mut logits.data);
            }
            logits.rows.push(rows);
        }
        Ok(logits)
    }

    fn overlaps_steps(&self) -> bool {
        self.launched.is_some()
    }

    fn launch_forward(&mut self, batch: &StepBatch, feed: bool) -> Result<()> {
        if self.launched.is_none() {
            return Err(NinferError::Device("toy: launch_forward without overlapping()".into()));
        }
        self.forwarded = None;
        let mut batch = batch.clone();
        let inputs = if feed {
            if batch.seqs.len() != self.last_launched.len() || batch.seqs.iter().any(|q| q.tokens.len() != 1) {
                return Err(NinferError::Device(format!("toy: a fed step of {} rows after a step of {} sampled rows", batch.seqs.len(), self.last_launched.len())));
            }
            for (q, &t) in batch.seqs.iter_mut().zip(&self.last_launched) {
                q.tokens[0] = t;
            }
            Some(self.last_launched.clone())
        } else {
            None
        };
        let logits = self.forward(&batch)?;
        self.forwarded = Some((logits, inputs));
        Ok(())
    }

    fn launch_sampling(&mut self, rows: &[RowSampling]) -> Result<()> {
        let (logits, inputs) = self.forwarded.take().ok_or_else(|| NinferError::Device("toy: launch_sampling with no forward queued".into()))?;
        if self.launched.as_ref().is_none_or(|q| q.len() >= 2) {
            return Err(NinferError::Device("toy: launch_sampling without overlapping() or with two steps uncollected".into()));
        }
        let sampled = match inputs {
            // Every sequence of a fed step samples: row i's input is the token fed to sequence
            // i, which a row with penalties counts as the device sampler does.
            Some(inputs) => logits.sample_on_host(&rows.iter().zip(&inputs).map(|(row, &t)| row.with_input(t)).collect::<Vec<_>>())?,
            None => logits.sample_on_host(rows)?,
        };
        self.last_launched = sampled.iter().map(|s| s.token).collect();
        self.launched.as_mut().expect("checked above").push_back(sampled);
        Ok(())
    }

    fn collect_sampled(&mut self) -> Result<Vec<SampledToken>> {
        self.launched.as_mut().and_then(VecDeque::pop_front).ok_or_else(|| NinferError::Device("toy: collect_sampled with no step launched".into()))
    }

    fn warm_up_kernels(&mut self) -> Result<()> {
        let mut log = self.log.lock().expect("toy log");
        let steps = log.steps.len();
        log.kernel_warm_ups.push(steps);
        Ok(())
    }

    fn verifies_drafts(&self) -> bool {
        true
    }

    /// The host argmax of the default, with the route of each sequence logged.
    fn forward_verify(&mut self, batch: &StepBatch, argmax: &[Option<RowSampling>]) -> Result<VerifyLogits> {
        check_verify_rows(batch.seqs.len(), argmax)?;
        self.log.lock().expect("toy log").verify_routes.push(batch.seqs.iter().zip(argmax).map(|(q, a)| (q.logits, a.is_some())).collect());
        VerifyLogits::on_host(self.forward(batch)?, argmax)
    }

    fn enable_mtp(&mut self) -> Result<()> {
        match self.mtp.as_mut() {
            Some((enabled, _)) => {
                *enabled = true;
                Ok(())
            }
            None => Err(NinferError::config("spec (--spec)", "--spec mtp is not supported on this backend yet")),
        }
    }

    fn mtp_absorb(&mut self, rows: &[MtpRows]) -> Result<()> {
        if !matches!(self.mtp, Some((true, _))) {
            return Err(NinferError::invalid("mtp_absorb", "MTP drafting is not enabled"));
        }
        for r in rows {
            let hist = self.history(&r.block_table, r.start_pos + r.next_tokens.len())?;
            for (i, &t) in r.next_tokens.iter().enumerate() {
                let p = r.start_pos + i;
                let idx = self.kv_index(&r.block_table, p)?;
                self.mtp.as_mut().expect("checked above").1[idx] = Some(mix(hist[p], t as u64));
            }
        }
        Ok(())
    }

    fn mtp_draft(&mut self, seqs: &[MtpDraftSeq]) -> Result<Vec<MtpDraft>> {
        if !matches!(self.mtp, Some((true, _))) {
            return Err(NinferError::invalid("mtp_draft", "MTP drafting is not enabled"));
        }
        let mut out = Vec::with_capacity(seqs.len());
        for s in seqs {
            // Rows before the last absorbed one are read by the head's attention: they must be
            // what the KV history gives. The last one is rewritten with the input token.
            self.check_mtp_rows(&s.block_table, s.pos.saturating_sub(1))?;
            let mut h = self.history(&s.block_table, s.pos)?.last().copied().unwrap_or(0);
            let mut writes = vec![(s.pos.wrapping_sub(1), mix(h, s.token as u64))];
            h = mix(h, s.token as u64);
            let mut d = MtpDraft::default();
            for depth in 0..s.k {
                let logits = self.draft_logits(h);
                let token = match &s.sampling {
                    Some(ds) => {
                        let u = *ds.u.get(depth).ok_or_else(|| NinferError::invalid("mtp_draft", "too few draft draws"))?;
                        let (t, q) = draw_draft(&logits, &ds.warpers, u);
                        d.q.push(q);
                        t
                    }
                    None => argmax(&logits),
                };
                d.tokens.push(token);
                if depth + 1 < s.k {
                    // A recursive row reads the head's own output, not the target's hidden
                    // state: never what absorbing that position writes.
                    writes.push((s.pos + depth, !mix(h, token as u64)));
                }
                h = mix(h, token as u64);
            }
            for (p, v) in writes.into_iter().filter(|&(p, _)| p != usize::MAX) {
                let idx = self.kv_index(&s.block_table, p)?;
                self.mtp.as_mut().expect("checked above").1[idx] = Some(v);
            }
            out.push(d);
        }
        Ok(out)
    }

    fn enable_state_replay(&mut self, _seqs: usize, _tokens: usize) -> Result<bool> {
        let Some(r) = self.replay.as_mut() else { return Ok(false) };
        *r = Some((Vec::new(), Vec::new()));
        Ok(true)
    }

    fn keep_replay_inputs(&mut self, chunks: &[usize]) -> Result<()> {
        let Some(Some((pending, _))) = self.replay.as_mut() else { return Err(NinferError::invalid("keep_replay_inputs", "state replay is not enabled")) };
        *pending = chunks.to_vec();
        Ok(())
    }

    fn replay_states(&mut self, replays: &[StateReplay]) -> Result<()> {
        let Some(Some((_, kept))) = self.replay.as_ref() else { return Err(NinferError::invalid("replay_states", "state replay is not enabled")) };
        check_replays(replays, self.states.len(), &kept.iter().map(Vec::len).collect::<Vec<_>>())?;
        self.log.lock().expect("toy log").replays.push(replays.to_vec());
        let mut next = self.states.clone();
        for r in replays {
            next[r.dst] = kept[r.kept][r.start..r.start + r.tokens].iter().fold(self.states[r.src], |h, &t| mix(h, t as u64));
        }
        self.states = next;
        Ok(())
    }

    fn copy_state(&mut self, src: usize, dst: usize) -> Result<()> {
        self.log.lock().expect("toy log").copies.push((src, dst));
        self.states[dst] = self.states[src];
        Ok(())
    }
}
