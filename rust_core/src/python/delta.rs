//! `_core.Delta` (exported as `ninfer.Delta`): one engine step's new output of one request.
//!
//! `step` and `poll` return these typed objects instead of dicts, so the async engine hands the
//! core's object to the request's stream as it is. The mapping protocol (`delta["text"]`,
//! `delta.get`, `keys`, iteration over the names) reads the same fields, for code written
//! against the dicts the core used to return.

use pyo3::exceptions::PyKeyError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::engine::{RequestOutput, StopReason};

/// The field names item access accepts.
const FIELDS: [&str; 12] = ["request_id", "token_ids", "text", "logprobs", "finish_reason", "prompt_tokens", "completion_tokens", "reasoning_tokens", "cached_tokens", "error", "stop_reason", "spec"];

/// New output of one request after one engine step (text never splits a UTF-8 sequence).
#[pyclass(name = "Delta", module = "ninfer._core", frozen)]
pub struct PyDelta {
    #[pyo3(get)]
    request_id: String,
    /// Tokens generated in this step.
    #[pyo3(get)]
    token_ids: Vec<u32>,
    /// New text: complete UTF-8, stop strings removed.
    #[pyo3(get)]
    text: String,
    /// Per token of `token_ids` when asked: dicts of token_id, logprob and top ([id, logprob] pairs).
    #[pyo3(get)]
    logprobs: Option<Py<PyList>>,
    /// "stop", "length", "abort" or "error" on the request's last delta, else None.
    #[pyo3(get)]
    finish_reason: Option<String>,
    #[pyo3(get)]
    prompt_tokens: usize,
    #[pyo3(get)]
    completion_tokens: usize,
    /// Of `completion_tokens` so far, those inside the reasoning block (what a thinking budget
    /// counts; the think tags and a closing sequence the engine forced are not).
    #[pyo3(get)]
    reasoning_tokens: usize,
    /// Prompt tokens served from the prefix cache.
    #[pyo3(get)]
    cached_tokens: usize,
    /// Why the request failed midway: set with finish_reason "error" on its last delta.
    #[pyo3(get)]
    error: Option<String>,
    /// What ended a "stop" request besides EOS, on its last delta: the matched stop string (str)
    /// or stop token id (int); None otherwise.
    #[pyo3(get)]
    stop_reason: Option<Py<PyAny>>,
    /// Speculative decoding's counts of the request (drafted, accepted, verify_steps,
    /// mean_accepted_length, acceptance_by_position), on its last delta when `--spec` is on.
    #[pyo3(get)]
    spec: Option<Py<PyDict>>,
}

impl PyDelta {
    /// The delta of one engine output.
    pub fn from_output(py: Python<'_>, o: &RequestOutput) -> PyResult<Self> {
        let logprobs = match &o.logprobs {
            None => None,
            Some(lps) => {
                let list = PyList::empty(py);
                for lp in lps {
                    let e = PyDict::new(py);
                    e.set_item("token_id", lp.token_id)?;
                    e.set_item("logprob", lp.logprob)?;
                    let top = PyList::empty(py);
                    for &(t, l) in &lp.top {
                        top.append(PyList::new(py, [t.into_pyobject(py)?.into_any(), l.into_pyobject(py)?.into_any()])?)?;
                    }
                    e.set_item("top", top)?;
                    list.append(e)?;
                }
                Some(list.unbind())
            }
        };
        let stop_reason = match &o.stop_reason {
            None => None,
            Some(StopReason::Text(s)) => Some(s.into_pyobject(py)?.into_any().unbind()),
            Some(StopReason::Token(t)) => Some(t.into_pyobject(py)?.into_any().unbind()),
        };
        let spec = match &o.spec {
            None => None,
            Some(s) => {
                let d = PyDict::new(py);
                d.set_item("verify_steps", s.verify_steps)?;
                d.set_item("drafted", s.drafted)?;
                d.set_item("accepted", s.accepted)?;
                d.set_item("mean_accepted_length", s.mean_accepted_length())?;
                d.set_item("acceptance_by_position", s.acceptance_by_position())?;
                if let Some(k) = s.mean_k_chosen() {
                    d.set_item("mean_k_chosen", k)?;
                }
                Some(d.unbind())
            }
        };
        Ok(PyDelta {
            spec,
            request_id: o.request_id.clone(),
            token_ids: o.token_ids.clone(),
            text: o.text.clone(),
            logprobs,
            finish_reason: o.finish_reason.map(|f| f.as_str().to_string()),
            prompt_tokens: o.prompt_tokens,
            completion_tokens: o.completion_tokens,
            reasoning_tokens: o.reasoning_tokens,
            cached_tokens: o.cached_tokens,
            error: o.error.clone(),
            stop_reason,
        })
    }
}

#[pymethods]
impl PyDelta {
    /// A delta from its fields (test doubles of the engine build theirs this way).
    #[new]
    #[pyo3(signature = (request_id, token_ids=Vec::new(), text=String::new(), finish_reason=None, prompt_tokens=0, completion_tokens=0, cached_tokens=0, logprobs=None, error=None, reasoning_tokens=0, stop_reason=None, spec=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        request_id: String,
        token_ids: Vec<u32>,
        text: String,
        finish_reason: Option<String>,
        prompt_tokens: usize,
        completion_tokens: usize,
        cached_tokens: usize,
        logprobs: Option<Py<PyList>>,
        error: Option<String>,
        reasoning_tokens: usize,
        stop_reason: Option<Py<PyAny>>,
        spec: Option<Py<PyDict>>,
    ) -> Self {
        PyDelta { request_id, token_ids, text, logprobs, finish_reason, prompt_tokens, completion_tokens, reasoning_tokens, cached_tokens, error, stop_reason, spec }
    }

    /// True on the last delta of a request.
    #[getter]
    fn finished(&self) -> bool {
        self.finish_reason.is_some()
    }

    /// OpenAI-style token usage as of this delta.
    #[getter]
    fn usage<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("prompt_tokens", self.prompt_tokens)?;
        d.set_item("completion_tokens", self.completion_tokens)?;
        d.set_item("total_tokens", self.prompt_tokens + self.completion_tokens)?;
        Ok(d)
    }

    /// `delta["text"]`: a field by name (KeyError for another name).
    fn __getitem__<'py>(slf: &Bound<'py, Self>, key: &str) -> PyResult<Bound<'py, PyAny>> {
        if !FIELDS.contains(&key) {
            return Err(PyKeyError::new_err(key.to_string()));
        }
        slf.as_any().getattr(key)
    }

    /// `delta.get("finish_reason")`: a field by name, `default` for another name.
    #[pyo3(signature = (key, default=None))]
    fn get<'py>(slf: &Bound<'py, Self>, key: &str, default: Option<Bound<'py, PyAny>>) -> PyResult<Bound<'py, PyAny>> {
        if !FIELDS.contains(&key) {
            return Ok(default.unwrap_or_else(|| slf.py().None().into_bound(slf.py())));
        }
        slf.as_any().getattr(key)
    }

    /// The field names, as a dict's keys.
    fn keys(&self) -> Vec<&'static str> {
        FIELDS.to_vec()
    }

    /// Iterate over the field names, as over a dict.
    fn __iter__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        PyList::new(py, FIELDS)?.as_any().try_iter().map(|it| it.into_any())
    }

    fn __repr__(&self) -> String {
        format!(
            "Delta(request_id={:?}, token_ids={:?}, text={:?}, finish_reason={:?}, completion_tokens={})",
            self.request_id, self.token_ids, self.text, self.finish_reason, self.completion_tokens
        )
    }
}

/// Add `Delta` to `_core`.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyDelta>()
}
