//! Continuous-batching scheduler: one token budget per step, decodes first, then prefill chunks,
//! admission by reservation of KV blocks and state slots, recompute preemption newest-first.

pub mod scheduler;
pub mod sequence;

pub use scheduler::{Loan, ScheduledStep, Scheduler, SchedulerConfig, SeqOutcome, SlotState};
pub use sequence::{SeqId, SeqStatus, Sequence};
