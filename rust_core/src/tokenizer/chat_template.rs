//! Jinja chat templates rendered with minijinja, the way transformers renders them.
//!
//! A model's chat template turns OpenAI-style messages into the prompt text the model was
//! trained on. The text must equal what `transformers`' `apply_chat_template(...,
//! tokenize=False)` gives, so this mirrors its Jinja environment: `trim_blocks` and
//! `lstrip_blocks`, loop controls, the globals `raise_exception`, `strftime_now`, `namespace` and
//! `dict`, a `tojson` that is Python's `json.dumps` (no HTML escaping, `ensure_ascii=False`, key
//! order kept), Python string/dict methods (minijinja-contrib `pycompat`), Python's `str()` for
//! printed values, and transformers' message normalization (keys whose value is null dropped,
//! reasoning fields aliased).

mod pyformat;
mod strftime;

use minijinja::value::{Kwargs, Serde, Value, ValueKind};
use minijinja::{AutoEscape, Environment, Error, ErrorKind, UndefinedBehavior};
use serde_json::{Map, Value as Json};

use crate::{NinferError, Result};

pub use pyformat::{json_dumps, py_repr, py_str, JsonOptions};
pub use strftime::CivilTime;

const TEMPLATE_NAME: &str = "chat_template";

/// Names a message's reasoning may come under; the first is the one templates read.
const REASONING_FIELDS: [&str; 3] = ["reasoning_content", "thinking", "reasoning"];

/// Variables `render` sets itself; `extra` may not redefine them.
const RESERVED_VARIABLES: [&str; 3] = ["messages", "tools", "add_generation_prompt"];

/// A compiled chat template, ready to render conversations into prompt text.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").field("source_len", &self.source.len()).finish()
    }
}

impl ChatTemplate {
    /// Compile `source` (Jinja2 syntax as used by Hugging Face chat templates).
    pub fn new(source: &str) -> Result<Self> {
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .keep_trailing_newline(false)
            .build()
            .map_err(|e| NinferError::Template(e.to_string()))?;
        env.set_syntax(syntax);
        env.set_auto_escape_callback(|_| AutoEscape::None);
        env.set_undefined_behavior(UndefinedBehavior::Lenient);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_formatter(|out, _state, value| {
            match value.as_str() {
                Some(s) if value.kind() == ValueKind::String => out.write_str(s),
                _ => out.write_str(&py_str(value)),
            }
            .map_err(|_| Error::from(ErrorKind::WriteFailure))
        });
        // Jinja2's `iterable` and `sequence` tests are Python's: none is neither, strings and
        // dicts are both (minijinja iterates none as empty and calls only lists sequences).
        env.add_test("iterable", |value: &Value| {
            matches!(value.kind(), ValueKind::String | ValueKind::Seq | ValueKind::Map | ValueKind::Iterable | ValueKind::Bytes | ValueKind::Undefined)
        });
        env.add_test("sequence", |value: &Value| {
            matches!(value.kind(), ValueKind::String | ValueKind::Seq | ValueKind::Map | ValueKind::Bytes | ValueKind::Undefined)
        });
        env.add_filter("tojson", tojson_filter);
        env.add_filter("string", |value: &Value| Value::from(py_str(value)));
        env.add_function("raise_exception", |message: String| -> std::result::Result<Value, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, message))
        });
        env.add_function("strftime_now", |format: String| CivilTime::now().format(&format));
        env.add_template_owned(TEMPLATE_NAME, rewrite_generation_tags(source))
            .map_err(|e| NinferError::Template(format!("cannot compile: {}", describe(&e))))?;
        Ok(ChatTemplate { env, source: source.to_string() })
    }

    /// The template text as the model ships it.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Render a conversation.
    ///
    /// `messages` is a JSON array of message objects (`content` a string or a list of content
    /// parts; assistant `tool_calls` with `arguments` as an object or a JSON string are passed
    /// through as given). `tools` is a JSON array of tool schemas or `None`. `extra` holds the
    /// other template variables: the tokenizer's special tokens and caller kwargs such as
    /// `enable_thinking`.
    pub fn render(&self, messages: &Json, tools: Option<&Json>, add_generation_prompt: bool, extra: &Map<String, Json>) -> Result<String> {
        let messages = normalize_messages(messages)?;
        if let Some(name) = RESERVED_VARIABLES.iter().find(|name| extra.contains_key(**name)) {
            return Err(NinferError::invalid(
                "chat_template_kwargs",
                format!("`{name}` is set by the request itself and cannot be passed as a template kwarg"),
            ));
        }
        if let Some(tools) = tools {
            if !tools.is_array() {
                return Err(NinferError::invalid("tools", "must be a list of tool schemas"));
            }
        }
        let mut context = Map::new();
        context.insert("messages".into(), Json::Array(messages));
        context.insert("tools".into(), tools.cloned().unwrap_or(Json::Null));
        context.insert("documents".into(), Json::Null);
        context.insert("add_generation_prompt".into(), Json::Bool(add_generation_prompt));
        for (key, value) in extra {
            context.insert(key.clone(), value.clone());
        }
        let template = self.env.get_template(TEMPLATE_NAME).map_err(|e| NinferError::Template(describe(&e)))?;
        template.render(Value::from(Serde(&context))).map_err(|e| NinferError::Template(describe(&e)))
    }
}

/// A one-line error message: the kind's text, the template's own message and where it failed.
fn describe(e: &Error) -> String {
    let mut text = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(inner) = source {
        text.push_str(": ");
        text.push_str(&inner.to_string());
        source = inner.source();
    }
    text
}

/// transformers' normalization: each message must be an object; keys whose value is null are
/// dropped (templates test `is defined`, not `is none`); reasoning given as `thinking` or
/// `reasoning` is also exposed as `reasoning_content` (and `thinking`), in the same key order
/// Python's `{"thinking": r, **message, "reasoning_content": r}` gives.
fn normalize_messages(messages: &Json) -> Result<Vec<Json>> {
    let list = messages.as_array().ok_or_else(|| NinferError::invalid("messages", "must be a list of message objects"))?;
    if list.is_empty() {
        return Err(NinferError::invalid("messages", "cannot apply a chat template to an empty conversation"));
    }
    list.iter()
        .enumerate()
        .map(|(i, message)| {
            let object = message
                .as_object()
                .ok_or_else(|| NinferError::invalid(format!("messages[{i}]"), "must be an object with `role` and `content`"))?;
            let kept: Map<String, Json> = object.iter().filter(|(_, v)| !v.is_null()).map(|(k, v)| (k.clone(), v.clone())).collect();
            let reasoning = REASONING_FIELDS.iter().find_map(|field| kept.get(*field)).cloned();
            let Some(reasoning) = reasoning else {
                return Ok(Json::Object(kept));
            };
            let mut aliased = Map::new();
            aliased.insert("thinking".into(), reasoning.clone());
            for (key, value) in kept {
                aliased.insert(key, value);
            }
            aliased.insert("reasoning_content".into(), reasoning);
            Ok(Json::Object(aliased))
        })
        .collect()
}

/// transformers' `tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`:
/// Python's `json.dumps` with the same positional and keyword arguments.
fn tojson_filter(
    value: &Value,
    ensure_ascii: Option<Value>,
    indent: Option<Value>,
    separators: Option<Value>,
    kwargs: Kwargs,
) -> std::result::Result<String, Error> {
    let ensure_ascii = kwargs.get::<Option<Value>>("ensure_ascii")?.or(ensure_ascii);
    let indent = kwargs.get::<Option<Value>>("indent")?.or(indent);
    let separators = kwargs.get::<Option<Value>>("separators")?.or(separators);
    let sort_keys = kwargs.get::<Option<Value>>("sort_keys")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) if v.kind() == ValueKind::String => Some(v.as_str().unwrap_or_default().to_string()),
        Some(v) => match v.as_i64() {
            Some(n) => Some(" ".repeat(n.max(0) as usize)),
            None => return Err(Error::new(ErrorKind::InvalidOperation, format!("tojson indent must be an int or a string, got {}", v.kind()))),
        },
    };
    let separators = match separators {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => {
            let parts: Vec<Value> = v.try_iter()?.collect();
            match parts.as_slice() {
                [item, key] if item.as_str().is_some() && key.as_str().is_some() => {
                    Some((item.as_str().unwrap_or_default().to_string(), key.as_str().unwrap_or_default().to_string()))
                }
                _ => return Err(Error::new(ErrorKind::InvalidOperation, "tojson separators must be two strings")),
            }
        }
    };
    let options = JsonOptions {
        ensure_ascii: ensure_ascii.is_some_and(|v| v.is_true()),
        indent,
        separators,
        sort_keys: sort_keys.is_some_and(|v| v.is_true()),
    };
    json_dumps(value, &options)
}

/// transformers' `{% generation %}...{% endgeneration %}` tag only marks assistant text for
/// training masks and renders its body unchanged; minijinja has no such tag, so it becomes
/// `{% if true %}...{% endif %}`, keeping every whitespace-control marker in place.
fn rewrite_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        out.push_str(&rest[..start]);
        let tag = &rest[start..];
        let Some(end) = tag.find("%}") else {
            out.push_str(tag);
            return out;
        };
        let inner = &tag[2..end];
        let marker_start = inner.starts_with(['-', '+']);
        let body_start = if marker_start { 1 } else { 0 };
        let marker_end = inner.len() > body_start && inner.ends_with(['-', '+']);
        let body_end = if marker_end { inner.len() - 1 } else { inner.len() };
        let keyword = inner[body_start..body_end].trim();
        let replacement = match keyword {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        match replacement {
            Some(new_keyword) => {
                out.push_str("{%");
                out.push_str(&inner[..body_start]);
                out.push(' ');
                out.push_str(new_keyword);
                out.push(' ');
                out.push_str(&inner[body_end..]);
                out.push_str("%}");
            }
            None => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests;
