//! Speculative decoding: a drafter proposes up to K tokens after a decoding request's last token,
//! one verify chunk (the last token plus the drafts, logits at every position) runs in the same
//! engine step as the other requests' decodes and prompt chunks, and the engine accepts the
//! longest prefix the target agrees with plus the target's own next token (`accept`).
//!
//! What each drafter needs from the verify forward:
//! - n-gram (`NgramDrafter`): nothing; it reads the request's prompt and output tokens.
//! - MTP: the target's last hidden state (after the final norm's input) at every accepted
//!   position, and an attention KV of its own in the paged pool, truncated with the target's.
//! - DFlash: the hidden states of the target layers its config names, at every accepted
//!   position of the verify chunk.
//!
//! Only the n-gram drafter runs today; `SpecMethod::Mtp` and `SpecMethod::Dflash` are refused
//! at engine start with "not supported yet".

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
