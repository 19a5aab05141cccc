//! The chat request's one crossing: what `Engine.submit_chat` needs beside the engine itself.
//!
//! The conversation, tools and template arguments arrive as the JSON texts the chat template
//! reads; the prompt is rendered, tokenized and measured here, so the server learns the prompt's
//! length and whether the output starts inside `<think>` from the call that queues the request.

use pyo3::prelude::*;
use serde_json::{Map, Value as Json};

use super::errors::ContextOverflowError;
use crate::NinferError;

/// A chat request's conversation, tools and template arguments, parsed.
pub struct ChatInput {
    pub messages: Json,
    pub tools: Option<Json>,
    pub kwargs: Map<String, Json>,
}

fn parse_json(text: &str, field: &str) -> Result<Json, NinferError> {
    serde_json::from_str(text).map_err(|e| NinferError::invalid(field, format!("not valid JSON: {e}")))
}

impl ChatInput {
    /// Parse the JSON texts; bad JSON or kwargs that are not an object name the field.
    pub fn parse(messages_json: &str, tools_json: Option<&str>, kwargs_json: Option<&str>) -> Result<Self, NinferError> {
        let messages = parse_json(messages_json, "messages")?;
        let tools = tools_json.map(|t| parse_json(t, "tools")).transpose()?.filter(|t| !t.is_null());
        let kwargs = match kwargs_json.map(|k| parse_json(k, "chat_template_kwargs")).transpose()? {
            None | Some(Json::Null) => Map::new(),
            Some(Json::Object(map)) => map,
            Some(_) => return Err(NinferError::invalid("chat_template_kwargs", "must be a JSON object")),
        };
        Ok(ChatInput { messages, tools, kwargs })
    }
}

/// The `max_tokens` of a request whose prompt has `prompt_len` tokens: the requested one, else
/// `default` clamped to the context left, else all of it. A prompt that leaves no room is a
/// ContextOverflowError whose `param` is `messages` (the server's 400 names that field).
pub fn resolve_max_tokens(py: Python<'_>, requested: Option<usize>, default: Option<usize>, prompt_len: usize, max_context: usize) -> PyResult<usize> {
    if let Some(n) = requested {
        return Ok(n);
    }
    if prompt_len >= max_context {
        let err = ContextOverflowError::new_err(format!("prompt of {prompt_len} tokens leaves no room in the maximum context of {max_context} tokens"));
        err.value(py).setattr("param", "messages")?;
        return Err(err);
    }
    let room = max_context - prompt_len;
    Ok(default.map_or(room, |d| d.min(room)))
}
