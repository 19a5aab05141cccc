//! Sampling: per-request parameters, logits processors, samplers, logprobs.
//!
//! Everything here works on one CPU logits row of one sequence, so a request's output never
//! depends on which other requests share its step. Logprobs are computed from the raw model
//! logits (log-softmax before any processor), like vLLM's default "raw logprobs" mode.

pub mod grammar;
pub mod params;
pub mod penalties;
pub mod row;
pub mod sampler;

pub use grammar::{GrammarCompiler, GrammarConstraint, ResponseFormat, SharedGrammarCompiler, TokenMask};
pub use params::SamplingParams;
pub use penalties::{PenaltyHistory, PenaltyParams};
pub use row::RowSampling;
pub use sampler::{argmax, raw_logprobs, RequestSampler, SampledToken, TokenLogprob};
