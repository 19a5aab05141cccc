//! `OverlappedStep`: asynchronous scheduling around `EngineCore`'s verbs, for a runner that
//! `overlaps_steps` (`EngineConfig::async_scheduling`, on by default).
//!
//! A launched step stays in flight when `step()` returns, and the next call queues the
//! following decode step (its tokens fed on the device) before it waits for the one in flight,
//! so the device runs the next step while the host copies results, detokenizes and schedules:
//! the host's turnaround between decode steps leaves the device's timeline. Outputs then come
//! one `step()` call later. The lookahead is taken only when it is the step the scheduler would
//! pick anyway and no request is sure to end with the token in flight
//! (`EngineCore::schedule_lookahead`); otherwise the step waits, exactly as without it. When a
//! sampling row needs the token in flight on the host (a grammar's allow-mask), only the
//! lookahead's forward pass is queued ahead: its rows are built, and its sampling queued, once
//! the step in flight is updated, while the device runs the forward (a split lookahead).
//!
//! Speculative decoding adds its verbs here: the draft's propose queued with the lookahead, and
//! verify between the collect of the step in flight and its update.

use super::core::EngineCore;
use super::request::RowInput;
use super::RequestOutput;
use crate::sampling::SampledToken;
use crate::sched::ScheduledStep;
use crate::Result;

/// How a lookahead step is queued.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Lookahead {
    /// The forward and the sampling, both before the step in flight is updated.
    Whole,
    /// The forward before, the sampling after (a row needs the token in flight on the host).
    Split,
}

/// The state asynchronous scheduling keeps between `step()` calls.
#[derive(Debug, Default)]
pub(super) struct OverlappedStep {
    /// The step launched last whose tokens are not collected yet.
    inflight: Option<ScheduledStep>,
    /// Steps launched and not collected yet (0 to 2): what a failure must collect and drop,
    /// whichever step it interrupted.
    uncollected: usize,
    /// `EngineStats::lookahead_steps`.
    pub(super) lookahead_steps: u64,
    /// `EngineStats::split_lookahead_steps`.
    pub(super) split_lookahead_steps: u64,
}

impl OverlappedStep {
    /// One engine step with a step kept in flight. A step in flight is first followed by its
    /// lookahead when there is one (queued before waiting for it), then updated; with no
    /// lookahead it is updated, and the next step is scheduled as usual and left in flight. A
    /// split lookahead queues its forward pass before the update and its sampling after it, so
    /// that the rows are built from the states the update leaves (grammars advanced on its
    /// tokens) while the device runs the forward.
    pub(super) fn step(&mut self, core: &mut EngineCore) -> Result<Vec<RequestOutput>> {
        let mut outputs = Vec::new();
        if let Some(prev) = self.inflight.take() {
            if let Some((next, how)) = core.schedule_lookahead(&prev) {
                match how {
                    Lookahead::Whole => {
                        self.launch(core, &next, RowInput::InFlight)?;
                        let sampled = self.collect(core)?;
                        outputs = core.update(&prev, sampled, Some(&next))?;
                    }
                    Lookahead::Split => {
                        core.launch_forward(&next)?;
                        let sampled = self.collect(core)?;
                        outputs = core.update(&prev, sampled, Some(&next))?;
                        core.launch_sampling(&next)?;
                        self.uncollected += 1;
                        self.split_lookahead_steps += 1;
                    }
                }
                self.lookahead_steps += 1;
                core.account(&next)?;
                self.inflight = Some(next);
                return Ok(outputs);
            }
            let sampled = self.collect(core)?;
            outputs = core.update(&prev, sampled, None)?;
        }
        let (step, aborted) = core.schedule()?;
        outputs.extend(aborted);
        if step.is_empty() {
            return Ok(outputs);
        }
        self.launch(core, &step, RowInput::Accepted)?;
        core.account(&step)?;
        self.inflight = Some(step);
        Ok(outputs)
    }

    /// After a failure: wait for every step launched and not collected and drop its tokens, so
    /// the runner holds none; nothing stays in flight.
    pub(super) fn drop_in_flight(&mut self, core: &mut EngineCore) {
        for _ in 0..std::mem::take(&mut self.uncollected) {
            let _ = core.collect();
        }
        self.inflight = None;
    }

    fn launch(&mut self, core: &mut EngineCore, step: &ScheduledStep, input: RowInput) -> Result<()> {
        core.launch(step, input)?;
        self.uncollected += 1;
        Ok(())
    }

    fn collect(&mut self, core: &mut EngineCore) -> Result<Vec<SampledToken>> {
        self.uncollected = self.uncollected.saturating_sub(1);
        core.collect()
    }
}
