//! NInfer engine core.
//!
//! Everything that touches model math lives here: weights, backends, the KV cache, the
//! scheduler, sampling and tokenization. Python drives it through the `python` module (the only
//! module that knows PyO3), built only with the `python` feature so that `cargo test` links
//! without a Python interpreter.

pub mod artifact;
pub mod backend;
pub mod config;
pub mod engine;
pub mod error;
pub mod kv;
pub mod model;
pub mod plan;
pub mod quant;
pub mod sampling;
pub mod sched;
pub mod spec;
pub mod state;
pub mod tokenizer;

#[cfg(feature = "python")]
mod python;

pub use error::{NinferError, Result};
