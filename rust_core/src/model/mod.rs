//! Model architectures and the engine-facing runner contract.

pub mod runner;

pub use runner::{CacheSpec, Logits, LogitsWanted, ModelRunner, SeqChunk, StepBatch};
