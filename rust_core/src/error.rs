//! One typed error for the whole crate.
//!
//! Every variant carries the path, field or numbers that explain it, so that the message a user
//! sees says what to change. Python exceptions are derived from these variants in one place
//! (`python::errors`), and the server maps those to OpenAI error JSON in one place.

use std::path::PathBuf;

/// Crate-wide result type.
pub type Result<T, E = NinferError> = std::result::Result<T, E>;

/// Every failure the core can report.
#[derive(Debug, thiserror::Error)]
pub enum NinferError {
    /// A file the model directory must contain is absent.
    #[error("missing file {path}: {what}")]
    MissingFile { path: PathBuf, what: String },

    /// An I/O failure on a named path.
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// A file exists but its contents are malformed (truncated safetensors, bad JSON, ...).
    #[error("malformed file {path}: {reason}")]
    MalformedFile { path: PathBuf, reason: String },

    /// A required tensor is not present in the checkpoint.
    #[error("missing tensor {name} in {path}")]
    MissingTensor { name: String, path: PathBuf },

    /// A tensor is present with a shape that does not match the config.
    #[error("tensor {name} has shape {got:?}, expected {expected:?} (from config.json)")]
    TensorShape { name: String, expected: Vec<usize>, got: Vec<usize> },

    /// A tensor has a dtype we cannot load.
    #[error("tensor {name} has dtype {dtype}, supported: F32, F16, BF16")]
    TensorDtype { name: String, dtype: String },

    /// A quantized tensor (or one of its scale / zero companions) is inconsistent with its
    /// declared format and shape, or a value cannot be quantized.
    #[error("quantized tensor {name} ({format}): {reason}")]
    QuantTensor { name: String, format: String, reason: String },

    /// The checkpoint's architecture is not implemented.
    #[error("unsupported architecture {name}; supported: {}", supported.join(", "))]
    UnsupportedArchitecture { name: String, supported: Vec<String> },

    /// A config field (model config.json or engine config) is missing or out of range.
    #[error("invalid config field `{field}`: {reason}")]
    Config { field: String, reason: String },

    /// Tokenizer load or encode/decode failure.
    #[error("tokenizer: {0}")]
    Tokenizer(String),

    /// Chat template rendering failure.
    #[error("chat template: {0}")]
    Template(String),

    /// A request parameter is out of range; `field` names the request field.
    #[error("invalid request field `{field}`: {reason}")]
    InvalidRequest { field: String, reason: String },

    /// A prompt with no tokens.
    #[error("prompt is empty: at least one token is required")]
    EmptyPrompt,

    /// Prompt plus requested tokens exceed the context the engine was started with.
    #[error("prompt of {prompt_tokens} tokens plus max_tokens {max_tokens} exceeds the maximum context of {max_context} tokens")]
    ContextOverflow { prompt_tokens: usize, max_tokens: usize, max_context: usize },

    /// Memory planning found that something does not fit.
    #[error("out of memory planning {what}: needs {needed} B, available {available} B; {hint}")]
    OutOfMemory { what: String, needed: u64, available: u64, hint: String },

    /// A request id that the engine does not know or already has.
    #[error("request {0}: {1}")]
    Request(String, String),

    /// A feature or flag that exists in the interface but is not implemented yet.
    #[error("{0} is not supported yet")]
    Unsupported(String),

    /// Device (GPU) errors.
    #[error("device: {0}")]
    Device(String),
}

impl NinferError {
    /// Shorthand for a config error.
    pub fn config(field: impl Into<String>, reason: impl Into<String>) -> Self {
        NinferError::Config { field: field.into(), reason: reason.into() }
    }

    /// Shorthand for an invalid request field.
    pub fn invalid(field: impl Into<String>, reason: impl Into<String>) -> Self {
        NinferError::InvalidRequest { field: field.into(), reason: reason.into() }
    }

    /// Shorthand for an I/O error on a path.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        NinferError::Io { path: path.into(), source }
    }

    /// Shorthand for a malformed file.
    pub fn malformed(path: impl Into<PathBuf>, reason: impl Into<String>) -> Self {
        NinferError::MalformedFile { path: path.into(), reason: reason.into() }
    }
}
