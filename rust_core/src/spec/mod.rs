//! Speculative decoding: a drafter proposes up to K tokens after a decoding request's last token,
//! one verify chunk (the last token plus the drafts, logits at every position) runs in the same
//! engine step as the other requests' decodes and prompt chunks, and the engine accepts the
//! longest prefix the target agrees with plus the target's own next token (`accept`), or for a
//! sampled draft drawn from a distribution, what the speculative sampling rule keeps (`sampled`).
//!
//! What each drafter needs from the verify forward:
//! - n-gram (`NgramDrafter`): nothing; it reads the request's prompt and output tokens.
//! - MTP: the target's final hidden state (after the final norm) at every computed and kept
//!   position, and an attention KV of its own in the paged pool, keyed by the target's blocks.
//!   The runner keeps the hidden states of its last forward; the engine has the rows it kept
//!   absorbed after every step (`ModelRunner::mtp_absorb`) and drafts greedily once the verify
//!   chunk's blocks are scheduled (`ModelRunner::mtp_draft`): greedy drafts for greedy requests;
//!   for sampled requests drafts drawn from the head's distribution q, verified by the
//!   speculative sampling rule (`sampled`).
//! - DFlash: the outputs of the target layers its config names, at every computed and kept
//!   position; the runner keeps them from its last forward, the engine has the kept rows
//!   absorbed into the drafter's context after every step (`ModelRunner::dflash_absorb`) and
//!   drafts every verify chunk's block in one forward once they are scheduled
//!   (`ModelRunner::dflash_draft`): greedy or, for sampled requests, drawn from the drafter's
//!   distribution q at each depth and verified by the speculative sampling rule, as MTP's.
//!
//! With `--spec-adaptive` each request's K is chosen per step (`adaptive`); with
//! `--lm-head-draft` the MTP head drafts over the most frequent ids only (`draft_vocab`).
//!
//! All three run on the CPU backend; n-gram and MTP on CUDA too.

mod accept;
pub mod adaptive;
mod config;
pub mod draft_vocab;
mod ngram;
mod sampled;
mod stats;

pub use accept::{accept_draft, Accepted};
pub use adaptive::{AdaptiveK, AdaptiveSpec, StepCost};
pub use config::{LmHeadDraft, SpecConfig, SpecMethod, MAX_DRAFT_TOKENS};
pub use ngram::NgramDrafter;
pub use sampled::{draft_warpers, draw_draft, speculative_rule, DraftRule};
pub use stats::SpecStats;

/// Proposes draft tokens for one request from what the engine knows of it.
pub trait Drafter: Send {
    /// Up to `k` tokens likely to follow `tokens` (the request's prompt then output); fewer or
    /// none when the drafter has no guess.
    fn propose(&self, tokens: &[u32], k: usize) -> Vec<u32>;
}
