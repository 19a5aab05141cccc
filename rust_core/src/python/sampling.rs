//! `_core.SamplingParams`: one request's sampling parameters as a typed object, checked once
//! (here, by `SamplingParams::validate`) and handed to `Engine.submit` / `submit_chat` as they
//! are. `ninfer.SamplingParams` builds one per completion; the async engine builds one from a
//! dict of the same fields.

use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::errors::IntoPy;
use super::json_value::dict_to_json;
use crate::sampling::SamplingParams;

/// Sampling parameters of one request, checked.
#[pyclass(name = "SamplingParams", module = "ninfer._core", frozen)]
pub struct PySamplingParams {
    pub inner: SamplingParams,
}

#[pymethods]
impl PySamplingParams {
    /// Keyword arguments named as the request fields (max_tokens, temperature, top_p, top_k,
    /// min_p, presence_penalty, frequency_penalty, repetition_penalty, logit_bias, seed, stop,
    /// stop_token_ids, ignore_eos, logprobs, top_logprobs, skip_special_tokens,
    /// response_format, thinking_budget, thinking_budget_message, draft_tokens); the others keep their defaults. An unknown field, a value of the
    /// wrong type or out of range raise InvalidRequestError naming it.
    #[new]
    #[pyo3(signature = (**fields))]
    fn new(fields: Option<&Bound<'_, PyDict>>) -> PyResult<Self> {
        let fields = match fields {
            Some(d) => dict_to_json(d, "sampling_params")?,
            None => Default::default(),
        };
        Ok(PySamplingParams { inner: SamplingParams::from_value(serde_json::Value::Object(fields)).py()? })
    }

    /// The fields as a JSON object (for logs and test doubles of the engine).
    fn to_json(&self) -> String {
        serde_json::to_string(&self.inner).unwrap_or_default()
    }

    #[getter]
    fn max_tokens(&self) -> usize {
        self.inner.max_tokens
    }

    #[getter]
    fn thinking_budget(&self) -> Option<u32> {
        self.inner.thinking_budget
    }

    #[getter]
    fn seed(&self) -> Option<u64> {
        self.inner.seed
    }

    fn __repr__(&self) -> String {
        format!("SamplingParams({})", self.to_json())
    }
}

/// Add `SamplingParams` to `_core`.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PySamplingParams>()
}
