//! `_core.Tokenizer`: the model directory's tokenizer and chat template, for the offline API,
//! the server's /tokenize and tests against transformers (a chat request to the engine renders
//! and tokenizes inside `Engine.submit_chat`).

use std::path::PathBuf;
use std::sync::Arc;

use pyo3::prelude::*;

use super::chat::ChatInput;
use super::errors::IntoPy;
use crate::tokenizer::Tokenizer;

/// Texts shorter than this are encoded without releasing the GIL: the release costs more.
const GIL_RELEASE_BYTES: usize = 2048;
/// Id lists shorter than this are decoded without releasing the GIL.
const GIL_RELEASE_IDS: usize = 512;

/// Python handle on a shared `Tokenizer` (the engine hands out the one it decodes with).
#[pyclass(name = "Tokenizer", module = "ninfer._core", frozen)]
pub struct PyTokenizer {
    inner: Arc<Tokenizer>,
}

impl PyTokenizer {
    /// Wrap a tokenizer the caller already loaded (e.g. the engine's), without reloading it.
    pub fn from_shared(inner: Arc<Tokenizer>) -> Self {
        PyTokenizer { inner }
    }

    /// The shared Rust tokenizer.
    pub fn shared(&self) -> Arc<Tokenizer> {
        self.inner.clone()
    }
}

#[pymethods]
impl PyTokenizer {
    /// Load `tokenizer.json`, `tokenizer_config.json` and the chat templates of `model_dir`.
    #[new]
    fn new(py: Python<'_>, model_dir: PathBuf) -> PyResult<Self> {
        let tokenizer = py.detach(|| Tokenizer::from_dir(&model_dir)).py()?;
        Ok(PyTokenizer { inner: Arc::new(tokenizer) })
    }

    /// Text to token ids.
    #[pyo3(signature = (text, add_special_tokens = false))]
    fn encode(&self, py: Python<'_>, text: &str, add_special_tokens: bool) -> PyResult<Vec<u32>> {
        if text.len() < GIL_RELEASE_BYTES {
            return self.inner.encode(text, add_special_tokens).py();
        }
        py.detach(|| self.inner.encode(text, add_special_tokens)).py()
    }

    /// Token ids to text.
    #[pyo3(signature = (ids, skip_special_tokens = true))]
    fn decode(&self, py: Python<'_>, ids: Vec<u32>, skip_special_tokens: bool) -> PyResult<String> {
        if ids.len() < GIL_RELEASE_IDS {
            return self.inner.decode(&ids, skip_special_tokens).py();
        }
        py.detach(|| self.inner.decode(&ids, skip_special_tokens)).py()
    }

    /// Id of a token string, or None when it is not in the vocabulary.
    fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Token string of an id, or None when the id is out of range.
    fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Number of ids, added tokens included.
    #[getter]
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }

    /// Whether the model ships a chat template.
    #[getter]
    fn has_chat_template(&self) -> bool {
        self.inner.has_chat_template()
    }

    /// The default chat template's source, or None.
    #[getter]
    fn chat_template(&self) -> Option<String> {
        self.inner.chat_template(false).ok().map(|t| t.source().to_string())
    }

    /// BOS token text, or None (Qwen models have none).
    #[getter]
    fn bos_token(&self) -> Option<String> {
        self.inner.bos_token().map(str::to_string)
    }

    /// EOS token text from tokenizer_config.json, or None.
    #[getter]
    fn eos_token(&self) -> Option<String> {
        self.inner.eos_token().map(str::to_string)
    }

    /// Id of the EOS token, or None.
    #[getter]
    fn eos_token_id(&self) -> Option<u32> {
        self.inner.eos_token_id()
    }

    /// Render messages (a JSON array) with the chat template. `tools_json` is a JSON array of
    /// tool schemas; `kwargs_json` a JSON object of extra template variables such as
    /// `{"enable_thinking": false}`. Bad JSON or a template's `raise_exception` raise
    /// InvalidRequestError.
    #[pyo3(signature = (messages_json, tools_json = None, add_generation_prompt = true, kwargs_json = None))]
    fn apply_chat_template(
        &self,
        py: Python<'_>,
        messages_json: &str,
        tools_json: Option<&str>,
        add_generation_prompt: bool,
        kwargs_json: Option<&str>,
    ) -> PyResult<String> {
        let input = ChatInput::parse(messages_json, tools_json, kwargs_json).py()?;
        py.detach(|| self.inner.apply_chat_template(&input.messages, input.tools.as_ref(), add_generation_prompt, &input.kwargs)).py()
    }

    /// `apply_chat_template` and the encoding of its text (no special tokens added), in one call.
    #[pyo3(signature = (messages_json, tools_json = None, add_generation_prompt = true, kwargs_json = None))]
    fn encode_chat(
        &self,
        py: Python<'_>,
        messages_json: &str,
        tools_json: Option<&str>,
        add_generation_prompt: bool,
        kwargs_json: Option<&str>,
    ) -> PyResult<Vec<u32>> {
        let input = ChatInput::parse(messages_json, tools_json, kwargs_json).py()?;
        let prompt = py.detach(|| self.inner.chat_prompt(&input.messages, input.tools.as_ref(), add_generation_prompt, &input.kwargs)).py()?;
        Ok(prompt.token_ids)
    }

    fn __repr__(&self) -> String {
        format!("Tokenizer({}, vocab_size={})", self.inner.path().display(), self.inner.vocab_size())
    }
}

/// Add `Tokenizer` to `_core`.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyTokenizer>()?;
    Ok(())
}
