//! The engine: validated config and memory ledger, the single-threaded `EngineCore` (schedule
//! -> launch -> complete, with one step in flight under asynchronous scheduling), per-request
//! postprocessing state, and `EngineHandle`, which runs the core on its own OS thread.

pub mod config;
pub mod core;
pub mod handle;
pub mod output;
pub mod request;
pub mod toy_runner;

pub use config::{cache_fit_hint, EngineConfig, MemoryLedger, ResolvedConfig};
pub use core::{EngineCore, EngineStats, RequestValidator};
pub use handle::EngineHandle;
pub use output::{FinishReason, RequestOutput};
pub use request::RequestState;
pub use toy_runner::ToyRunner;

#[cfg(test)]
mod tests;
