//! `tokenizer_config.json`: the part of a Hugging Face tokenizer that `tokenizer.json` lacks.
//!
//! It names the special tokens the chat template sees (`bos_token`, `eos_token`, ...), says
//! whether BOS/EOS are added on encode, lists added tokens, and (in older checkpoints) holds the
//! chat template itself, as a string or as a list of named templates. The file is optional:
//! transformers loads a tokenizer without it, and so do we.

use std::path::{Path, PathBuf};

use serde_json::Value as Json;

use crate::{NinferError, Result};

/// The named special-token attributes transformers passes to chat templates, in its order.
pub const NAMED_SPECIAL_TOKENS: [&str; 7] = ["bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"];

/// One entry of `added_tokens_decoder`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AddedTokenSpec {
    pub id: u32,
    pub content: String,
    pub special: bool,
    pub lstrip: bool,
    pub rstrip: bool,
    pub normalized: bool,
    pub single_word: bool,
}

/// Chat templates stored in the config, before the template files override them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConfigTemplates {
    /// `"chat_template": "..."`.
    Single(String),
    /// `"chat_template": [{"name": ..., "template": ...}, ...]`.
    Named(Vec<(String, String)>),
}

/// What NInfer reads from `tokenizer_config.json`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TokenizerConfig {
    /// `(attribute, token text)` for each named special token that is set, e.g. `("eos_token", "<|im_end|>")`.
    pub special_tokens: Vec<(String, String)>,
    /// `add_bos_token`, when the file sets it. transformers 5 ignores it when `tokenizer.json`
    /// exists (always, for us); kept for converters that build a tokenizer without one.
    pub add_bos_token: Option<bool>,
    /// `add_eos_token`, when the file sets it (same caveat as `add_bos_token`).
    pub add_eos_token: Option<bool>,
    /// `added_tokens_decoder`, sorted by id.
    pub added_tokens: Vec<AddedTokenSpec>,
    /// `chat_template`, when the file holds one.
    pub chat_template: Option<ConfigTemplates>,
    /// `clean_up_tokenization_spaces` (transformers applies it to non-BPE models only).
    pub clean_up_tokenization_spaces: bool,
    /// `split_special_tokens`: encode special-token text as plain text.
    pub split_special_tokens: bool,
}

impl TokenizerConfig {
    /// Read `path`; a missing file gives the empty config.
    pub fn load(path: &Path) -> Result<Self> {
        if !path.exists() {
            return Ok(Self::default());
        }
        let text = std::fs::read_to_string(path).map_err(|e| NinferError::io(path, e))?;
        let json: Json = serde_json::from_str(&text).map_err(|e| NinferError::malformed(path, e.to_string()))?;
        Self::from_json(&json, path)
    }

    /// Parse the JSON object of a config file; `path` names it in errors.
    pub fn from_json(json: &Json, path: &Path) -> Result<Self> {
        let object = json.as_object().ok_or_else(|| NinferError::malformed(path, "expected a JSON object"))?;
        let mut config = TokenizerConfig::default();
        for name in NAMED_SPECIAL_TOKENS {
            if let Some(value) = object.get(name) {
                if let Some(text) = token_text(value, path, name)? {
                    config.special_tokens.push((name.to_string(), text));
                }
            }
        }
        config.add_bos_token = optional_bool(object.get("add_bos_token"), path, "add_bos_token")?;
        config.add_eos_token = optional_bool(object.get("add_eos_token"), path, "add_eos_token")?;
        config.clean_up_tokenization_spaces =
            optional_bool(object.get("clean_up_tokenization_spaces"), path, "clean_up_tokenization_spaces")?.unwrap_or(false);
        config.split_special_tokens = optional_bool(object.get("split_special_tokens"), path, "split_special_tokens")?.unwrap_or(false);
        if let Some(decoder) = object.get("added_tokens_decoder") {
            config.added_tokens = added_tokens(decoder, path)?;
        }
        config.chat_template = match object.get("chat_template") {
            None | Some(Json::Null) => None,
            Some(Json::String(text)) => Some(ConfigTemplates::Single(text.clone())),
            Some(Json::Array(items)) => Some(ConfigTemplates::Named(named_templates(items, path)?)),
            Some(_) => {
                return Err(NinferError::malformed(path, "`chat_template` must be a string or a list of {\"name\", \"template\"} objects"));
            }
        };
        Ok(config)
    }
}

/// A special token is written as a string or as a serialized `AddedToken` (`{"content": ...}`).
fn token_text(value: &Json, path: &Path, field: &str) -> Result<Option<String>> {
    match value {
        Json::Null => Ok(None),
        Json::String(text) => Ok(Some(text.clone())),
        Json::Object(map) => match map.get("content") {
            Some(Json::String(text)) => Ok(Some(text.clone())),
            _ => Err(NinferError::malformed(path, format!("`{field}` is an object without a string `content`"))),
        },
        other => Err(NinferError::malformed(path, format!("`{field}` must be a string or an AddedToken object, got {other}"))),
    }
}

fn optional_bool(value: Option<&Json>, path: &Path, field: &str) -> Result<Option<bool>> {
    match value {
        None | Some(Json::Null) => Ok(None),
        Some(Json::Bool(b)) => Ok(Some(*b)),
        Some(other) => Err(NinferError::malformed(path, format!("`{field}` must be true or false, got {other}"))),
    }
}

fn added_tokens(decoder: &Json, path: &Path) -> Result<Vec<AddedTokenSpec>> {
    let map = decoder.as_object().ok_or_else(|| NinferError::malformed(path, "`added_tokens_decoder` must be an object of id -> token"))?;
    let mut tokens = Vec::with_capacity(map.len());
    for (key, value) in map {
        let id: u32 = key
            .parse()
            .map_err(|_| NinferError::malformed(path, format!("`added_tokens_decoder` key {key:?} is not a token id")))?;
        let entry = value
            .as_object()
            .ok_or_else(|| NinferError::malformed(path, format!("`added_tokens_decoder[{key}]` must be an object")))?;
        let flag = |name: &str, default: bool| entry.get(name).and_then(Json::as_bool).unwrap_or(default);
        let content = entry
            .get("content")
            .and_then(Json::as_str)
            .ok_or_else(|| NinferError::malformed(path, format!("`added_tokens_decoder[{key}]` has no string `content`")))?;
        let special = flag("special", false);
        tokens.push(AddedTokenSpec {
            id,
            content: content.to_string(),
            special,
            lstrip: flag("lstrip", false),
            rstrip: flag("rstrip", false),
            normalized: flag("normalized", !special),
            single_word: flag("single_word", false),
        });
    }
    tokens.sort_by_key(|t| t.id);
    Ok(tokens)
}

fn named_templates(items: &[Json], path: &Path) -> Result<Vec<(String, String)>> {
    items
        .iter()
        .enumerate()
        .map(|(i, item)| {
            let name = item.get("name").and_then(Json::as_str);
            let template = item.get("template").and_then(Json::as_str);
            match (name, template) {
                (Some(name), Some(template)) => Ok((name.to_string(), template.to_string())),
                _ => Err(NinferError::malformed(path, format!("`chat_template[{i}]` needs string `name` and `template`"))),
            }
        })
        .collect()
}

/// The config file's path inside a model directory.
pub fn config_path(dir: &Path) -> PathBuf {
    dir.join("tokenizer_config.json")
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn reads_special_tokens_as_strings_or_added_token_objects() {
        let json = json!({
            "bos_token": {"__type": "AddedToken", "content": "<s>", "special": true},
            "eos_token": "</s>",
            "pad_token": null,
            "add_bos_token": true,
            "added_tokens_decoder": {"5": {"content": "<x>", "special": true}, "2": {"content": "</s>", "special": true}},
            "chat_template": [{"name": "default", "template": "A"}, {"name": "tool_use", "template": "B"}]
        });
        let config = TokenizerConfig::from_json(&json, Path::new("tc.json")).unwrap();
        assert_eq!(config.special_tokens, vec![("bos_token".into(), "<s>".into()), ("eos_token".into(), "</s>".into())]);
        assert_eq!(config.add_bos_token, Some(true));
        assert_eq!(config.add_eos_token, None);
        assert_eq!(config.added_tokens.iter().map(|t| t.id).collect::<Vec<_>>(), vec![2, 5]);
        assert!(!config.added_tokens[0].normalized);
        assert_eq!(
            config.chat_template,
            Some(ConfigTemplates::Named(vec![("default".into(), "A".into()), ("tool_use".into(), "B".into())]))
        );
    }

    #[test]
    fn wrong_types_name_the_file() {
        for bad in [json!({"chat_template": 3}), json!({"add_bos_token": "yes"}), json!([1]), json!({"added_tokens_decoder": {"x": {}}})] {
            let err = TokenizerConfig::from_json(&bad, Path::new("/m/tokenizer_config.json")).unwrap_err();
            assert!(err.to_string().contains("/m/tokenizer_config.json"), "{err}");
        }
    }
}
