//! The one mapping from `NinferError` to Python exceptions.
//!
//! `NinferError` is the base; subclasses let Python callers (and the server's error mapping)
//! tell bad requests from bad model files without parsing messages.

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

use crate::NinferError;

create_exception!(_core, NinferErrorPy, PyException, "Base class of every NInfer error.");
create_exception!(_core, ModelLoadError, NinferErrorPy, "The model directory or a file in it is missing or malformed.");
create_exception!(_core, UnsupportedError, NinferErrorPy, "An architecture, flag or feature that is not supported.");
create_exception!(_core, InvalidRequestError, NinferErrorPy, "A request field or prompt is invalid.");
create_exception!(_core, ContextOverflowError, InvalidRequestError, "Prompt plus max_tokens exceed the context.");
create_exception!(_core, OutOfMemoryError, NinferErrorPy, "Memory planning found that something does not fit.");
create_exception!(_core, DeviceError, NinferErrorPy, "A GPU/device failure.");

/// Convert a core error to the matching Python exception.
pub fn to_py(e: NinferError) -> PyErr {
    let msg = e.to_string();
    match e {
        NinferError::MissingFile { .. }
        | NinferError::Io { .. }
        | NinferError::MalformedFile { .. }
        | NinferError::MissingTensor { .. }
        | NinferError::TensorShape { .. }
        | NinferError::TensorDtype { .. }
        | NinferError::QuantTensor { .. }
        | NinferError::Config { .. }
        | NinferError::Tokenizer(_) => ModelLoadError::new_err(msg),
        NinferError::UnsupportedArchitecture { .. } | NinferError::Unsupported(_) => UnsupportedError::new_err(msg),
        NinferError::InvalidRequest { .. } | NinferError::EmptyPrompt | NinferError::Request(..) | NinferError::Template(_) => {
            InvalidRequestError::new_err(msg)
        }
        NinferError::ContextOverflow { .. } => ContextOverflowError::new_err(msg),
        NinferError::OutOfMemory { .. } => OutOfMemoryError::new_err(msg),
        NinferError::Device(_) => DeviceError::new_err(msg),
    }
}

/// Extension trait so call sites read `result.py()?`.
pub trait IntoPy<T> {
    fn py(self) -> PyResult<T>;
}

impl<T> IntoPy<T> for crate::Result<T> {
    fn py(self) -> PyResult<T> {
        self.map_err(to_py)
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("NinferError", py.get_type::<NinferErrorPy>())?;
    m.add("ModelLoadError", py.get_type::<ModelLoadError>())?;
    m.add("UnsupportedError", py.get_type::<UnsupportedError>())?;
    m.add("InvalidRequestError", py.get_type::<InvalidRequestError>())?;
    m.add("ContextOverflowError", py.get_type::<ContextOverflowError>())?;
    m.add("OutOfMemoryError", py.get_type::<OutOfMemoryError>())?;
    m.add("DeviceError", py.get_type::<DeviceError>())?;
    Ok(())
}
