//! The Hugging Face tokenizer of a model directory: `tokenizer.json` through the `tokenizers`
//! crate, plus what transformers reads beside it (`tokenizer_config.json`, `chat_template.jinja`,
//! `additional_chat_templates/*.jinja`), so that encode, decode and chat templates give what
//! `transformers.AutoTokenizer` gives for the same directory.

mod config;

use std::path::{Path, PathBuf};

use serde_json::{Map, Value as Json};
use tokenizers::models::ModelWrapper;
use tokenizers::AddedToken;

use crate::tokenizer::chat_template::ChatTemplate;
use crate::{NinferError, Result};

pub use config::{AddedTokenSpec, ConfigTemplates, TokenizerConfig, NAMED_SPECIAL_TOKENS};

/// The template transformers picks when tools are given and the model has several templates.
const TOOL_USE_TEMPLATE: &str = "tool_use";
/// The template picked otherwise.
const DEFAULT_TEMPLATE: &str = "default";

/// A loaded tokenizer with its special tokens and chat templates.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
    special_tokens: Vec<(String, String)>,
    /// `(name, template)`; a model with one template has it under "default".
    chat_templates: Vec<(String, ChatTemplate)>,
    clean_up_spaces: bool,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("path", &self.path)
            .field("vocab_size", &self.vocab_size())
            .field("special_tokens", &self.special_tokens)
            .field("chat_templates", &self.chat_template_names())
            .finish()
    }
}

impl Tokenizer {
    /// Load `tokenizer.json`, `tokenizer_config.json` (optional) and the chat templates of a
    /// model directory.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        if !path.exists() {
            return Err(NinferError::MissingFile { path, what: "the HF tokenizer (tokenizer.json)".into() });
        }
        let mut inner = tokenizers::Tokenizer::from_file(&path).map_err(|e| NinferError::malformed(&path, e.to_string()))?;
        let config_path = config::config_path(dir);
        let config = TokenizerConfig::load(&config_path)?;
        apply_config(&mut inner, &config).map_err(|reason| NinferError::malformed(&config_path, reason))?;
        let chat_templates = load_chat_templates(dir, &config, &config_path)?;
        let clean_up_spaces = config.clean_up_tokenization_spaces && !matches!(inner.get_model(), ModelWrapper::BPE(_));
        Ok(Tokenizer { inner, path, special_tokens: config.special_tokens, chat_templates, clean_up_spaces })
    }

    /// Text to token ids; `add_special_tokens` adds what the post-processor adds (BOS for Llama).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let enc = self.inner.encode_fast(text, add_special_tokens).map_err(|e| NinferError::Tokenizer(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Token ids to text.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        let text = self.inner.decode(ids, skip_special_tokens).map_err(|e| NinferError::Tokenizer(e.to_string()))?;
        Ok(if self.clean_up_spaces { clean_up_tokenization(&text) } else { text })
    }

    /// Id of a token string (special tokens included).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Token string of an id (byte-level tokens in their mapped form, e.g. "Ġthe").
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Size of the vocabulary including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The text of a named special token (`"bos_token"`, `"eos_token"`, `"pad_token"`, ...).
    pub fn special_token(&self, name: &str) -> Option<&str> {
        self.special_tokens.iter().find(|(n, _)| n == name).map(|(_, t)| t.as_str())
    }

    /// The BOS token text, when the model has one (Qwen models do not).
    pub fn bos_token(&self) -> Option<&str> {
        self.special_token("bos_token")
    }

    /// The EOS token text from `tokenizer_config.json` (the end-of-turn token for chat models).
    pub fn eos_token(&self) -> Option<&str> {
        self.special_token("eos_token")
    }

    /// Id of the EOS token, for stop conditions when `generation_config.json` is absent.
    pub fn eos_token_id(&self) -> Option<u32> {
        self.eos_token().and_then(|t| self.token_to_id(t))
    }

    /// The named special tokens transformers passes to chat templates, as `(name, text)`.
    pub fn special_tokens(&self) -> &[(String, String)] {
        &self.special_tokens
    }

    /// Whether the model ships any chat template.
    pub fn has_chat_template(&self) -> bool {
        !self.chat_templates.is_empty()
    }

    /// Names of the chat templates ("default", "tool_use", ...).
    pub fn chat_template_names(&self) -> Vec<&str> {
        self.chat_templates.iter().map(|(n, _)| n.as_str()).collect()
    }

    /// The chat template transformers would use: with several, "tool_use" when tools are given
    /// and the model has it, else "default".
    pub fn chat_template(&self, with_tools: bool) -> Result<&ChatTemplate> {
        let find = |name: &str| self.chat_templates.iter().find(|(n, _)| n == name).map(|(_, t)| t);
        match self.chat_templates.as_slice() {
            [] => Err(NinferError::Template(format!(
                "the tokenizer in {} has no chat template (none in tokenizer_config.json, chat_template.jinja or additional_chat_templates/)",
                self.path.parent().unwrap_or(&self.path).display()
            ))),
            [(_, only)] => Ok(only),
            _ => {
                let picked = if with_tools { find(TOOL_USE_TEMPLATE).or_else(|| find(DEFAULT_TEMPLATE)) } else { find(DEFAULT_TEMPLATE) };
                picked.ok_or_else(|| {
                    NinferError::Template(format!(
                        "the model has several chat templates and none named \"default\": {}",
                        self.chat_template_names().join(", ")
                    ))
                })
            }
        }
    }

    /// Render a conversation with the model's chat template, as transformers'
    /// `apply_chat_template(messages, tools=tools, add_generation_prompt=..., tokenize=False,
    /// **kwargs)` does: the named special tokens are template variables, and `kwargs` (such as
    /// `enable_thinking`) override them.
    pub fn apply_chat_template(&self, messages: &Json, tools: Option<&Json>, add_generation_prompt: bool, kwargs: &Map<String, Json>) -> Result<String> {
        let template = self.chat_template(tools.is_some())?;
        let mut extra = Map::new();
        for (name, text) in &self.special_tokens {
            extra.insert(name.clone(), Json::String(text.clone()));
        }
        for (key, value) in kwargs {
            extra.insert(key.clone(), value.clone());
        }
        template.render(messages, tools, add_generation_prompt, &extra)
    }

    /// The file it was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The wrapped tokenizer, for the detokenizer and template helpers.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

/// What transformers' `TokenizersBackend.__init__` does with the config: add configured tokens
/// the vocabulary lacks and honour `split_special_tokens`. `add_bos_token`/`add_eos_token` are
/// not applied: transformers 5 drops them whenever `tokenizer.json` exists, whose post-processor
/// alone decides what `add_special_tokens=True` adds.
fn apply_config(inner: &mut tokenizers::Tokenizer, config: &TokenizerConfig) -> std::result::Result<(), String> {
    let added: std::collections::HashSet<String> = inner.get_added_tokens_decoder().into_values().map(|t| t.content).collect();
    let missing: Vec<AddedToken> = config
        .added_tokens
        .iter()
        .filter(|t| !added.contains(&t.content))
        .map(|t| {
            AddedToken::from(t.content.clone(), t.special)
                .lstrip(t.lstrip)
                .rstrip(t.rstrip)
                .normalized(t.normalized)
                .single_word(t.single_word)
        })
        .collect();
    if !missing.is_empty() {
        inner.add_tokens(missing).map_err(|e| e.to_string())?;
    }
    let named: Vec<AddedToken> = config
        .special_tokens
        .iter()
        .filter(|(_, text)| !added.contains(text))
        .map(|(_, text)| AddedToken::from(text.clone(), true).normalized(false))
        .collect();
    if !named.is_empty() {
        inner.add_special_tokens(named).map_err(|e| e.to_string())?;
    }
    inner.set_encode_special_tokens(config.split_special_tokens);

    Ok(())
}

/// transformers' search order: `chat_template.jinja` ("default") and `additional_chat_templates/*.jinja`
/// (named by file stem) win over `chat_template` in the config; `chat_template.json` (where
/// processors of vision models keep it) is the last resort.
fn load_chat_templates(dir: &Path, config: &TokenizerConfig, config_path: &Path) -> Result<Vec<(String, ChatTemplate)>> {
    let mut sources: Vec<(String, String, PathBuf)> = Vec::new();
    let single_file = dir.join("chat_template.jinja");
    if single_file.exists() {
        sources.push((DEFAULT_TEMPLATE.into(), read_text(&single_file)?, single_file));
    }
    let template_dir = dir.join("additional_chat_templates");
    if template_dir.is_dir() {
        let mut files: Vec<PathBuf> = std::fs::read_dir(&template_dir)
            .map_err(|e| NinferError::io(&template_dir, e))?
            .filter_map(|entry| entry.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|ext| ext == "jinja"))
            .collect();
        files.sort();
        for file in files {
            let name = file.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
            sources.push((name, read_text(&file)?, file));
        }
    }
    if sources.is_empty() {
        match &config.chat_template {
            Some(ConfigTemplates::Single(text)) => sources.push((DEFAULT_TEMPLATE.into(), text.clone(), config_path.to_path_buf())),
            Some(ConfigTemplates::Named(list)) => {
                for (name, text) in list {
                    sources.push((name.clone(), text.clone(), config_path.to_path_buf()));
                }
            }
            None => {}
        }
    }
    if sources.is_empty() {
        let json_file = dir.join("chat_template.json");
        if json_file.exists() {
            let value: Json = serde_json::from_str(&read_text(&json_file)?).map_err(|e| NinferError::malformed(&json_file, e.to_string()))?;
            let text = value
                .get("chat_template")
                .and_then(Json::as_str)
                .ok_or_else(|| NinferError::malformed(&json_file, "expected an object with a string `chat_template`"))?;
            sources.push((DEFAULT_TEMPLATE.into(), text.to_string(), json_file));
        }
    }
    sources
        .into_iter()
        .map(|(name, text, path)| {
            let template = ChatTemplate::new(&text).map_err(|e| NinferError::malformed(&path, format!("chat template {name:?}: {e}")))?;
            Ok((name, template))
        })
        .collect()
}

fn read_text(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(|e| NinferError::io(path, e))
}

/// transformers' `clean_up_tokenization`: removes the spaces WordPiece-style decoders leave
/// before punctuation and contractions.
fn clean_up_tokenization(text: &str) -> String {
    text.replace(" .", ".")
        .replace(" ?", "?")
        .replace(" !", "!")
        .replace(" ,", ",")
        .replace(" ' ", "'")
        .replace(" n't", "n't")
        .replace(" 'm", "'m")
        .replace(" 's", "'s")
        .replace(" 've", "'ve")
        .replace(" 're", "'re")
}

#[cfg(test)]
mod tests;
