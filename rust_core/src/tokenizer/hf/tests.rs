//! Loading a model directory's tokenizer files the way transformers does.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

use serde_json::json;

use super::*;

/// A word-level `tokenizer.json`: small enough to write by hand, with two special tokens.
const WORD_LEVEL: &str = r#"{
  "version": "1.0", "truncation": null, "padding": null,
  "added_tokens": [
    {"id": 6, "content": "<s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
    {"id": 7, "content": "</s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}
  ],
  "normalizer": null,
  "pre_tokenizer": {"type": "WhitespaceSplit"},
  "post_processor": null,
  "decoder": null,
  "model": {"type": "WordLevel", "vocab": {"hello": 0, "world": 1, ".": 2, "[UNK]": 3, "it": 4, "'s": 5}, "unk_token": "[UNK]"}
}"#;

struct ModelDir(PathBuf);

impl ModelDir {
    fn new(files: &[(&str, &str)]) -> Self {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("ninfer-tok-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        for (name, text) in files {
            let path = dir.join(name);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, text).unwrap();
        }
        ModelDir(dir)
    }
}

impl Drop for ModelDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn no_kwargs() -> Map<String, Json> {
    Map::new()
}

#[test]
fn encodes_decodes_and_names_special_tokens() {
    let config = json!({"bos_token": "<s>", "eos_token": {"content": "</s>", "special": true}}).to_string();
    let dir = ModelDir::new(&[("tokenizer.json", WORD_LEVEL), ("tokenizer_config.json", &config)]);
    let tok = Tokenizer::from_dir(&dir.0).unwrap();
    assert_eq!(tok.vocab_size(), 8);
    assert_eq!(tok.encode("hello world .", false).unwrap(), vec![0, 1, 2]);
    assert_eq!(tok.encode("hello world .", true).unwrap(), vec![0, 1, 2], "no post-processor and no add_bos_token: nothing added");
    assert_eq!(tok.decode(&[6, 0, 1, 7], true).unwrap(), "hello world");
    assert_eq!(tok.bos_token(), Some("<s>"));
    assert_eq!(tok.eos_token(), Some("</s>"));
    assert_eq!(tok.eos_token_id(), Some(7));
    assert_eq!(tok.id_to_token(1).as_deref(), Some("world"));
    assert!(!tok.has_chat_template());
}

#[test]
fn add_bos_token_in_config_does_not_override_tokenizer_json() {
    // transformers 5 drops add_bos_token/add_eos_token when tokenizer.json exists.
    let config = json!({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": true, "add_eos_token": true}).to_string();
    let dir = ModelDir::new(&[("tokenizer.json", WORD_LEVEL), ("tokenizer_config.json", &config)]);
    let tok = Tokenizer::from_dir(&dir.0).unwrap();
    assert_eq!(tok.encode("hello", true).unwrap(), vec![0]);
}

#[test]
fn clean_up_tokenization_spaces_applies_to_non_bpe_models() {
    let config = json!({"clean_up_tokenization_spaces": true}).to_string();
    let dir = ModelDir::new(&[("tokenizer.json", WORD_LEVEL), ("tokenizer_config.json", &config)]);
    let tok = Tokenizer::from_dir(&dir.0).unwrap();
    assert_eq!(tok.decode(&[4, 5, 0, 2], false).unwrap(), "it's hello.");
}

#[test]
fn added_tokens_decoder_entries_missing_from_tokenizer_json_are_added() {
    let config = json!({"added_tokens_decoder": {"8": {"content": "<tool>", "special": false}}}).to_string();
    let dir = ModelDir::new(&[("tokenizer.json", WORD_LEVEL), ("tokenizer_config.json", &config)]);
    let tok = Tokenizer::from_dir(&dir.0).unwrap();
    assert_eq!(tok.token_to_id("<tool>"), Some(8));
    assert_eq!(tok.encode("hello<tool>world", false).unwrap(), vec![0, 8, 1]);
}

#[test]
fn chat_template_comes_from_config_string_with_special_tokens_as_variables() {
    let config = json!({"bos_token": "<s>", "chat_template": "{{ bos_token }}{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}{{ flag | default('-') }}"}).to_string();
    let dir = ModelDir::new(&[("tokenizer.json", WORD_LEVEL), ("tokenizer_config.json", &config)]);
    let tok = Tokenizer::from_dir(&dir.0).unwrap();
    let messages = json!([{"role": "user", "content": "hi"}]);
    assert_eq!(tok.apply_chat_template(&messages, None, false, &no_kwargs()).unwrap(), "<s>user:hi;-");
    let kwargs: Map<String, Json> = json!({"flag": "on", "bos_token": "[B]"}).as_object().cloned().unwrap();
    assert_eq!(tok.apply_chat_template(&messages, None, false, &kwargs).unwrap(), "[B]user:hi;on", "kwargs override special tokens");
}

#[test]
fn named_templates_pick_tool_use_when_tools_are_given() {
    let config = json!({"chat_template": [{"name": "default", "template": "plain"}, {"name": "tool_use", "template": "tools={{ tools | length }}"}]}).to_string();
    let dir = ModelDir::new(&[("tokenizer.json", WORD_LEVEL), ("tokenizer_config.json", &config)]);
    let tok = Tokenizer::from_dir(&dir.0).unwrap();
    let messages = json!([{"role": "user", "content": "hi"}]);
    assert_eq!(tok.chat_template_names(), vec!["default", "tool_use"]);
    assert_eq!(tok.apply_chat_template(&messages, None, true, &no_kwargs()).unwrap(), "plain");
    let tools = json!([{"type": "function", "function": {"name": "f"}}]);
    assert_eq!(tok.apply_chat_template(&messages, Some(&tools), true, &no_kwargs()).unwrap(), "tools=1");
}

#[test]
fn template_files_override_the_config_template() {
    let config = json!({"chat_template": "from config"}).to_string();
    let dir = ModelDir::new(&[
        ("tokenizer.json", WORD_LEVEL),
        ("tokenizer_config.json", &config),
        ("chat_template.jinja", "from file\n"),
        ("additional_chat_templates/tool_use.jinja", "tool file"),
    ]);
    let tok = Tokenizer::from_dir(&dir.0).unwrap();
    let messages = json!([{"role": "user", "content": "hi"}]);
    assert_eq!(tok.apply_chat_template(&messages, None, true, &no_kwargs()).unwrap(), "from file");
    assert_eq!(tok.apply_chat_template(&messages, Some(&json!([])), true, &no_kwargs()).unwrap(), "tool file");
}

#[test]
fn chat_template_json_is_the_last_resort() {
    let dir = ModelDir::new(&[("tokenizer.json", WORD_LEVEL), ("chat_template.json", r#"{"chat_template": "vision {{ messages | length }}"}"#)]);
    let tok = Tokenizer::from_dir(&dir.0).unwrap();
    assert_eq!(tok.apply_chat_template(&json!([{"role": "user", "content": "x"}]), None, true, &no_kwargs()).unwrap(), "vision 1");
}

#[test]
fn no_template_is_a_template_error() {
    let dir = ModelDir::new(&[("tokenizer.json", WORD_LEVEL)]);
    let tok = Tokenizer::from_dir(&dir.0).unwrap();
    let err = tok.apply_chat_template(&json!([{"role": "user", "content": "x"}]), None, true, &no_kwargs()).unwrap_err();
    assert!(matches!(err, NinferError::Template(_)), "{err:?}");
}

#[test]
fn missing_tokenizer_json_names_the_path() {
    let dir = ModelDir::new(&[("tokenizer_config.json", "{}")]);
    match Tokenizer::from_dir(&dir.0).unwrap_err() {
        NinferError::MissingFile { path, .. } => assert_eq!(path, dir.0.join("tokenizer.json")),
        other => panic!("expected MissingFile, got {other:?}"),
    }
}

#[test]
fn malformed_files_name_their_path() {
    let cases = [
        (vec![("tokenizer.json", "{ not json")], "tokenizer.json"),
        (vec![("tokenizer.json", WORD_LEVEL), ("tokenizer_config.json", "[1, 2")], "tokenizer_config.json"),
        (vec![("tokenizer.json", WORD_LEVEL), ("chat_template.jinja", "{% for m in messages %}")], "chat_template.jinja"),
        (vec![("tokenizer.json", WORD_LEVEL), ("chat_template.json", r#"{"x": 1}"#)], "chat_template.json"),
    ];
    for (files, bad) in cases {
        let dir = ModelDir::new(&files);
        match Tokenizer::from_dir(&dir.0).unwrap_err() {
            NinferError::MalformedFile { path, .. } => assert_eq!(path, dir.0.join(bad)),
            other => panic!("expected MalformedFile for {bad}, got {other:?}"),
        }
    }
}
