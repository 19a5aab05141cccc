//! Speculative decoding: a drafter proposes up to K tokens after a decoding request's last token,
//! one verify chunk (the last token plus the drafts, logits at every position) runs in the same
//! engine step as the other requests' decodes and prompt chunks, and the engine accepts the
//! longest prefix the target agrees with plus the target's own next token (`accept`).
//!
//! What each drafter needs from the verify forward:
//! - n-gram (`NgramDrafter`): nothing; it reads the request's prompt and output tokens.
//! - MTP: the target's final hidden state (after the final norm) at every computed and kept
//!   position, and an attention KV of its own in the paged pool, keyed by the target's blocks.
//!   The runner keeps the hidden states of its last forward; the engine has the rows it kept
//!   absorbed after every step (`ModelRunner::mtp_absorb`) and drafts greedily once the verify
//!   chunk's blocks are scheduled (`ModelRunner::mtp_draft`). Sampled requests verify these
//!   deterministic drafts by the same rule as the n-gram's, which is exact for them.
//! - DFlash: the outputs of the target layers its config names, at every computed and kept
//!   position; the runner keeps them from its last forward, the engine has the kept rows
//!   absorbed into the drafter's context after every step (`ModelRunner::dflash_absorb`) and
//!   drafts every verify chunk's block in one forward once they are scheduled
//!   (`ModelRunner::dflash_draft`).
//!
//! All three run on the CPU backend.

mod accept;
mod config;
mod ngram;
mod stats;

pub use accept::{accept_draft, Accepted};
pub use config::{SpecConfig, SpecMethod, MAX_DRAFT_TOKENS};
pub use ngram::NgramDrafter;
pub use stats::SpecStats;

/// Proposes draft tokens for one request from what the engine knows of it.
pub trait Drafter: Send {
    /// Up to `k` tokens likely to follow `tokens` (the request's prompt then output); fewer or
    /// none when the drafter has no guess.
    fn propose(&self, tokens: &[u32], k: usize) -> Vec<u32>;
}
