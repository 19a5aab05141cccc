//! Sampling: per-request parameters, logits processors, samplers, logprobs.

pub mod params;

pub use params::SamplingParams;
