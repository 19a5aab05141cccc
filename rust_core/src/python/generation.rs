//! generation_config.json's sampling defaults as Python sees them: a dict under the request's
//! field names, from the engine (`Engine.generation_defaults`) or, before any engine loads,
//! from a directory (`_core.generation_defaults`, for `ninfer serve --generation-config`).

use std::path::PathBuf;

use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::errors::IntoPy;
use crate::config::generation_config::SamplingDefaults;
use crate::config::GenerationConfig;

/// The fields the file sets (temperature, top_p, top_k, min_p, repetition_penalty, max_tokens).
pub fn defaults_dict<'py>(py: Python<'py>, s: &SamplingDefaults) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    for (name, value) in [("temperature", s.temperature), ("top_p", s.top_p)] {
        if let Some(v) = value {
            d.set_item(name, v)?;
        }
    }
    if let Some(k) = s.top_k {
        d.set_item("top_k", k)?;
    }
    for (name, value) in [("min_p", s.min_p), ("repetition_penalty", s.repetition_penalty)] {
        if let Some(v) = value {
            d.set_item(name, v)?;
        }
    }
    if let Some(n) = s.max_tokens {
        d.set_item("max_tokens", n)?;
    }
    Ok(d)
}

/// The sampling defaults of `model_dir`'s generation_config.json ({} without the file); a
/// malformed file raises ModelLoadError naming it and the field.
#[pyfunction]
fn generation_defaults(py: Python<'_>, model_dir: PathBuf) -> PyResult<Bound<'_, PyDict>> {
    let config = py.detach(|| GenerationConfig::from_dir(&model_dir)).py()?;
    defaults_dict(py, &config.sampling)
}

/// Add `generation_defaults` to `_core`.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(generation_defaults, m)?)
}
