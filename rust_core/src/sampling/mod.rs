//! Sampling: per-request parameters, logits processors, samplers, logprobs.
//!
//! Everything here works on one logits row of one sequence, so a request's output never
//! depends on which other requests share its step. A request turns its state into a
//! `RowSampling` per token (`row.rs`); the host sampler here is the reference that the device
//! sampler (`cuda/sampling.cu`) reproduces. Logprobs are computed from the raw model
//! logits (log-softmax before any processor), like vLLM's default "raw logprobs" mode.

pub mod grammar;
pub mod params;
pub mod penalties;
pub mod row;
pub mod sampler;
pub mod thinking;

pub use grammar::{GrammarCompiler, GrammarConstraint, ResponseFormat, SharedGrammarCompiler, TokenMask};
pub use params::SamplingParams;
pub use penalties::{PenaltyHistory, PenaltyParams};
pub use row::RowSampling;
pub use sampler::{argmax, draw, raw_logprobs, RequestSampler, SampledToken, TokenLogprob};
