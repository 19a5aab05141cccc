//! The engine: validated config and memory ledger, the single-threaded `EngineCore` (schedule
//! -> execute -> update), the overlapped stepper that keeps one step in flight under
//! asynchronous scheduling, per-request postprocessing state, and `EngineHandle`, which runs
//! the core on its own OS thread.

pub mod config;
pub mod core;
pub mod handle;
pub mod output;
mod overlap;
pub mod request;
mod speculation;
#[cfg(any(test, feature = "testing"))]
pub mod toy_runner;
pub mod validator;

pub use config::{cache_fit_hint, EngineConfig, MemoryLedger, ResolvedConfig};
pub use core::{EngineCore, EngineStats};
pub use handle::EngineHandle;
pub use output::{FinishReason, RequestOutput, StopReason};
pub use request::RequestState;
#[cfg(any(test, feature = "testing"))]
pub use toy_runner::ToyRunner;
pub use validator::RequestValidator;

#[cfg(test)]
mod tests;
