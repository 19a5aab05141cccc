//! Grammar constraints over small hand-built tokenizers: token spelling, masks, and randomly
//! sampled constrained outputs that must parse and validate.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Map, Value as Json};

use super::vocab::{byte_level_chars, token_bytes_for_test};
use super::*;

/// Pieces merged on top of the 256 byte tokens: JSON punctuation, keywords, the schema's keys,
/// and some words, so that outputs mix multi-byte and single-byte tokens.
const BYTE_LEVEL_WORDS: &[&str] = &[
    "{\"", "\":", "\",", "\"}", "\": ", ", \"", "true", "false", "null", "name", "age", "tags", "active", "alpha", "beta", "gamma", "12", "100", "\n  ",
    " the", " cat", "ab", "\"a", "\"b",
];

/// A temporary model directory holding one tokenizer.
struct TokenizerDir(PathBuf);

impl TokenizerDir {
    fn new(tokenizer_json: &Json, config: &Json) -> Self {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("ninfer-grammar-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("tokenizer.json"), tokenizer_json.to_string()).unwrap();
        std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
        TokenizerDir(dir)
    }

    fn load(&self) -> Tokenizer {
        Tokenizer::from_dir(&self.0).unwrap()
    }
}

impl Drop for TokenizerDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn added_token(id: usize, content: &str, special: bool) -> Json {
    json!({"id": id, "content": content, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": special})
}

/// A byte-level BPE tokenizer (Qwen/GPT-2 style): ids 0..256 are the bytes in order, then
/// `BYTE_LEVEL_WORDS` with every prefix as an intermediate merge, then `<|endoftext|>` and
/// `<|im_end|>` (special, the EOS) and `<think>` (added, not special).
fn byte_level_tokenizer() -> (TokenizerDir, Tokenizer) {
    let mut chars = vec![' '; 256];
    for (c, b) in byte_level_chars() {
        chars[b as usize] = c;
    }
    let spell = |text: &str| -> Vec<String> { text.bytes().map(|b| chars[b as usize].to_string()).collect() };
    let mut vocab = Map::new();
    for c in &chars {
        vocab.insert(c.to_string(), json!(vocab.len()));
    }
    let mut merges = Vec::new();
    for word in BYTE_LEVEL_WORDS {
        let pieces = spell(word);
        let mut prefix = pieces[0].clone();
        for piece in &pieces[1..] {
            let merged = format!("{prefix}{piece}");
            if !vocab.contains_key(&merged) {
                merges.push(json!([prefix, piece]));
                vocab.insert(merged.clone(), json!(vocab.len()));
            }
            prefix = merged;
        }
    }
    let n = vocab.len();
    let added = vec![added_token(n, "<|endoftext|>", true), added_token(n + 1, "<|im_end|>", true), added_token(n + 2, "<think>", false)];
    let tokenizer = json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": false, "byte_fallback": false, "ignore_merges": false, "vocab": vocab, "merges": merges}
    });
    let dir = TokenizerDir::new(&tokenizer, &json!({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}));
    let tok = dir.load();
    (dir, tok)
}

/// A SentencePiece-style tokenizer: `▁` for spaces and `<0xNN>` byte-fallback tokens.
fn byte_fallback_tokenizer() -> (TokenizerDir, Tokenizer) {
    let mut vocab = vec![json!(["<unk>", 0.0]), json!(["<s>", 0.0]), json!(["</s>", 0.0])];
    for b in 0..=255u8 {
        vocab.push(json!([format!("<0x{b:02X}>"), 0.0]));
    }
    for piece in ["\u{2581}hello", "\u{2581}", "world", "{"] {
        vocab.push(json!([piece, -1.0]));
    }
    let tokenizer = json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [added_token(0, "<unk>", true), added_token(1, "<s>", true), added_token(2, "</s>", true)],
        "normalizer": {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "\u{2581}"}, {"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"}]},
        "pre_tokenizer": null,
        "post_processor": null,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "Unigram", "unk_id": 0, "vocab": vocab, "byte_fallback": true}
    });
    let dir = TokenizerDir::new(&tokenizer, &json!({"bos_token": "<s>", "eos_token": "</s>"}));
    let tok = dir.load();
    (dir, tok)
}

/// Generate under `format` with a seeded "model" that draws uniformly among the allowed tokens,
/// picking EOS with probability `eos_bias` whenever it is allowed. Returns the decoded text and
/// whether the grammar finished within `max_tokens`.
fn sample_constrained(compiler: &GrammarCompiler, tok: &Tokenizer, format: &Json, seed: u64, eos_bias: f64, max_tokens: usize) -> (String, bool) {
    let mut constraint = compiler.compile_value(format).unwrap().expect("a constrained format");
    let eos = tok.eos_token_id().unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut out = Vec::new();
    for _ in 0..max_tokens {
        let mask = constraint.compute_mask().unwrap();
        let allowed = mask.allowed();
        assert!(!allowed.is_empty());
        let token = if mask.is_allowed(eos) && rng.random::<f64>() < eos_bias { eos } else { allowed[rng.random_range(0..allowed.len())] };
        constraint.consume(token).unwrap();
        if token != eos {
            out.push(token);
        }
        if constraint.is_finished() {
            return (tok.decode(&out, true).unwrap(), true);
        }
    }
    (tok.decode(&out, true).unwrap(), false)
}

#[test]
fn byte_level_tokens_spell_their_raw_bytes_and_specials_are_marked() {
    let (_dir, tok) = byte_level_tokenizer();
    let words = token_bytes_for_test(&tok, tok.vocab_size() + 5);
    assert_eq!(words.len(), tok.vocab_size() + 5, "padded to the logits width");
    for b in 0..=255u8 {
        assert_eq!(words[b as usize], vec![b], "byte token {b}");
    }
    let id = |s: &str| tok.encode(s, false).unwrap();
    let [space_the] = id(" the")[..] else { panic!("\" the\" is one token") };
    assert_eq!(words[space_the as usize], b" the");
    let [newline_indent] = id("\n  ")[..] else { panic!("one token") };
    assert_eq!(words[newline_indent as usize], b"\n  ");
    let im_end = tok.token_to_id("<|im_end|>").unwrap() as usize;
    assert_eq!(words[im_end][0], toktrie::TokTrie::SPECIAL_TOKEN_MARKER);
    assert_eq!(&words[im_end][1..], b"<|im_end|>");
    let think = tok.token_to_id("<think>").unwrap() as usize;
    assert_eq!(words[think], b"<think>", "a non-special added token is plain text");
    for pad in &words[tok.vocab_size()..] {
        assert_eq!(pad[0], toktrie::TokTrie::SPECIAL_TOKEN_MARKER);
    }
}

#[test]
fn byte_fallback_tokens_spell_bytes_and_spaces() {
    let (_dir, tok) = byte_fallback_tokenizer();
    let words = token_bytes_for_test(&tok, tok.vocab_size());
    let id = |s: &str| tok.token_to_id(s).unwrap() as usize;
    assert_eq!(words[id("<0x41>")], vec![0x41]);
    assert_eq!(words[id("<0xFF>")], vec![0xFF]);
    assert_eq!(words[id("\u{2581}hello")], b" hello");
    assert_eq!(words[id("\u{2581}")], b" ");
    assert_eq!(words[id("world")], b"world");
    assert_eq!(words[id("</s>")][0], toktrie::TokTrie::SPECIAL_TOKEN_MARKER);
}

#[test]
fn json_object_outputs_parse_as_objects() {
    let (_dir, tok) = byte_level_tokenizer();
    let compiler = GrammarCompiler::new(&tok, &[], tok.vocab_size() + 3).unwrap();
    let format = json!({"type": "json_object"});
    for seed in 0..30 {
        let (text, finished) = sample_constrained(&compiler, &tok, &format, seed, 0.5, 4000);
        assert!(finished, "seed {seed}: not finished after 4000 tokens: {text:?}");
        // IgnoredAny checks the syntax without converting numbers, which may exceed f64 (1e400
        // is valid JSON).
        serde_json::from_str::<serde::de::IgnoredAny>(&text).unwrap_or_else(|e| panic!("seed {seed}: {e}: {text:?}"));
        assert!(text.trim_start().starts_with('{') && text.trim_end().ends_with('}'), "seed {seed}: {text:?}");
    }
}

/// The schema of the random-sampling test, and a hand-written check of exactly its rules.
fn person_schema() -> Json {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "tags": {"type": "array", "items": {"enum": ["alpha", "beta", "gamma"]}, "maxItems": 3},
            "active": {"type": "boolean"}
        },
        "required": ["name", "age", "tags", "active"],
        "additionalProperties": false
    })
}

fn check_person(value: &Json) -> std::result::Result<(), String> {
    let object = value.as_object().ok_or("not an object")?;
    let mut keys: Vec<&str> = object.keys().map(String::as_str).collect();
    keys.sort();
    if keys != ["active", "age", "name", "tags"] {
        return Err(format!("keys {keys:?}"));
    }
    let name = object["name"].as_str().ok_or("name is not a string")?;
    if !(1..=12).contains(&name.chars().count()) {
        return Err(format!("name length {}", name.chars().count()));
    }
    let age = object["age"].as_i64().ok_or("age is not an integer")?;
    if !(0..=150).contains(&age) {
        return Err(format!("age {age}"));
    }
    let tags = object["tags"].as_array().ok_or("tags is not an array")?;
    if tags.len() > 3 || tags.iter().any(|t| !matches!(t.as_str(), Some("alpha" | "beta" | "gamma"))) {
        return Err(format!("tags {tags:?}"));
    }
    object["active"].as_bool().ok_or("active is not a boolean")?;
    Ok(())
}

#[test]
fn json_schema_outputs_parse_and_validate() {
    let (_dir, tok) = byte_level_tokenizer();
    let compiler = GrammarCompiler::new(&tok, &[], tok.vocab_size()).unwrap();
    let format = json!({"type": "json_schema", "json_schema": {"name": "person", "schema": person_schema(), "strict": true}});
    for seed in 0..40 {
        let (text, finished) = sample_constrained(&compiler, &tok, &format, seed, 0.5, 2000);
        assert!(finished, "seed {seed}: not finished: {text:?}");
        let value: Json = serde_json::from_str(&text).unwrap_or_else(|e| panic!("seed {seed}: {e}: {text:?}"));
        check_person(&value).unwrap_or_else(|e| panic!("seed {seed}: {e}: {text:?}"));
    }
}

#[test]
fn json_schema_works_with_a_byte_fallback_tokenizer() {
    let (_dir, tok) = byte_fallback_tokenizer();
    let compiler = GrammarCompiler::new(&tok, &[], tok.vocab_size()).unwrap();
    let format = json!({"type": "json_schema", "json_schema": {"name": "person", "schema": person_schema()}});
    for seed in 0..10 {
        let (text, finished) = sample_constrained(&compiler, &tok, &format, seed, 0.5, 2000);
        assert!(finished, "seed {seed}: not finished: {text:?}");
        let value: Json = serde_json::from_str(&text).unwrap_or_else(|e| panic!("seed {seed}: {e}: {text:?}"));
        check_person(&value).unwrap_or_else(|e| panic!("seed {seed}: {e}: {text:?}"));
    }
}

#[test]
fn regex_format_matches_the_whole_pattern_then_finishes() {
    let (_dir, tok) = byte_level_tokenizer();
    let compiler = GrammarCompiler::new(&tok, &[], tok.vocab_size()).unwrap();
    let format = json!({"type": "regex", "regex": "(true|false)-[0-9]{3}"});
    for seed in 0..20 {
        let (text, finished) = sample_constrained(&compiler, &tok, &format, seed, 0.0, 100);
        assert!(finished, "seed {seed}: {text:?}");
        let (word, digits) = text.split_once('-').unwrap_or_else(|| panic!("{text:?}"));
        assert!(word == "true" || word == "false", "{text:?}");
        assert!(digits.len() == 3 && digits.bytes().all(|b| b.is_ascii_digit()), "{text:?}");
    }
}

#[test]
fn masks_exclude_specials_and_padding_and_allow_only_eos_after_a_complete_output() {
    let (_dir, tok) = byte_level_tokenizer();
    let width = tok.vocab_size() + 7;
    let compiler = GrammarCompiler::new(&tok, &[], width).unwrap();
    let mut constraint = compiler.compile_value(&json!({"type": "regex", "regex": "a[bx]"})).unwrap().unwrap();
    let eos = tok.eos_token_id().unwrap();
    let first = constraint.compute_mask().unwrap();
    let allowed = first.allowed();
    let ab = tok.encode("ab", false).unwrap();
    assert_eq!(ab.len(), 1, "\"ab\" is one token");
    assert_eq!(allowed, vec![b'a' as u32, ab[0]], "exactly the tokens that start a match");
    assert!(!first.is_allowed(eos), "EOS before the output is complete");
    assert!(!first.is_allowed(tok.vocab_size() as u32), "padding ids are never allowed");

    let mut logits: Vec<f32> = (0..width).map(|i| i as f32 * 0.01).collect();
    first.apply(&mut logits);
    for (i, l) in logits.iter().enumerate() {
        assert_eq!(l.is_finite(), allowed.contains(&(i as u32)), "token {i}");
    }

    constraint.consume(ab[0]).unwrap();
    assert!(constraint.is_accepting());
    assert!(constraint.is_finished(), "nothing can follow \"ab\"");
    assert_eq!(constraint.compute_mask().unwrap().allowed(), vec![eos], "only EOS after the complete output");
}

#[test]
fn an_accepting_grammar_that_can_continue_finishes_on_eos() {
    let (_dir, tok) = byte_level_tokenizer();
    let compiler = GrammarCompiler::new(&tok, &[], tok.vocab_size()).unwrap();
    let mut constraint = compiler.compile_value(&json!({"type": "regex", "regex": "a+"})).unwrap().unwrap();
    let eos = tok.eos_token_id().unwrap();
    constraint.consume(b'a' as u32).unwrap();
    let mask = constraint.compute_mask().unwrap();
    assert!(mask.is_allowed(eos) && mask.is_allowed(b'a' as u32));
    assert!(!constraint.is_finished());
    constraint.consume(eos).unwrap();
    assert!(constraint.is_finished());
}

#[test]
fn engine_eos_ids_replace_the_tokenizer_eos() {
    let (_dir, tok) = byte_level_tokenizer();
    let endoftext = tok.token_to_id("<|endoftext|>").unwrap();
    let im_end = tok.eos_token_id().unwrap();
    let compiler = GrammarCompiler::new(&tok, &[endoftext, im_end], tok.vocab_size()).unwrap();
    let mut constraint = compiler.compile_value(&json!({"type": "regex", "regex": "a"})).unwrap().unwrap();
    constraint.consume(b'a' as u32).unwrap();
    assert_eq!(constraint.compute_mask().unwrap().allowed(), vec![endoftext, im_end]);
}

#[test]
fn consuming_a_disallowed_token_is_an_error_naming_response_format() {
    let (_dir, tok) = byte_level_tokenizer();
    let compiler = GrammarCompiler::new(&tok, &[], tok.vocab_size()).unwrap();
    let mut constraint = compiler.compile_value(&json!({"type": "json_object"})).unwrap().unwrap();
    let err = constraint.consume(b'x' as u32).unwrap_err();
    assert!(matches!(&err, NinferError::InvalidRequest { field, .. } if field == "response_format"), "{err}");
}

#[test]
fn text_format_is_unconstrained() {
    let (_dir, tok) = byte_level_tokenizer();
    let compiler = GrammarCompiler::new(&tok, &[], tok.vocab_size()).unwrap();
    assert!(compiler.compile_value(&json!({"type": "text"})).unwrap().is_none());
    assert!(!ResponseFormat::parse(&json!({"type": "text"})).unwrap().is_constrained());
}

#[test]
fn invalid_formats_are_rejected_naming_response_format_and_the_problem() {
    let (_dir, tok) = byte_level_tokenizer();
    let compiler = GrammarCompiler::new(&tok, &[], tok.vocab_size()).unwrap();
    let cases = [
        (json!("json"), "must be an object"),
        (json!({"schema": {}}), "`type` is required"),
        (json!({"type": "yaml"}), "unknown type \"yaml\""),
        (json!({"type": "json_schema"}), "`json_schema`"),
        (json!({"type": "json_schema", "json_schema": {"name": "x"}}), "`json_schema.schema` is required"),
        (json!({"type": "json_schema", "json_schema": {"schema": 3}}), "must be a JSON schema object"),
        (json!({"type": "json_schema", "json_schema": {"schema": {"type": "banana"}}}), "json_schema.schema"),
        (json!({"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}, "required": ["a"]}}}), "json_schema.schema"),
        (json!({"type": "regex", "regex": "(unclosed"}), "invalid regex"),
        (json!({"type": "regex"}), "`regex`"),
    ];
    for (format, expected) in cases {
        let err = compiler.compile_value(&format).unwrap_err();
        match &err {
            NinferError::InvalidRequest { field, reason } => {
                assert_eq!(field, "response_format");
                assert!(reason.contains(expected), "{format}: {reason:?} should mention {expected:?}");
            }
            other => panic!("{format}: {other}"),
        }
    }
}

#[test]
fn compiler_is_shareable_and_constraints_move_between_threads() {
    fn shareable<T: Send + Sync>() {}
    fn movable<T: Send>() {}
    shareable::<GrammarCompiler>();
    movable::<GrammarConstraint>();
}

/// Consume `text` one byte token at a time (the byte-level tokenizer's ids 0..256 are the bytes).
fn consume_bytes(constraint: &mut GrammarConstraint, text: &str) {
    for b in text.bytes() {
        constraint.consume(b as u32).unwrap_or_else(|e| panic!("{text:?} at {:?}: {e}", b as char));
    }
}

/// A two-field schema as instructor and LangChain send it: no `additionalProperties`.
fn two_field_format(strict: Option<bool>) -> Json {
    let schema = json!({"type": "object", "title": "Person", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name", "age"]});
    let mut spec = json!({"name": "Person", "schema": schema});
    if let Some(strict) = strict {
        spec["strict"] = json!(strict);
    }
    json!({"type": "json_schema", "json_schema": spec})
}

#[test]
fn a_schema_without_additional_properties_admits_only_its_keys_unless_the_server_opens_objects() {
    let (_dir, tok) = byte_level_tokenizer();
    let eos = tok.eos_token_id().unwrap();
    for strict in [None, Some(false), Some(true)] {
        let format = two_field_format(strict);
        let compiler = GrammarCompiler::new(&tok, &[], tok.vocab_size()).unwrap();
        let mut constraint = compiler.compile_value(&format).unwrap().unwrap();
        consume_bytes(&mut constraint, r#"{"name": "Al", "age": 3"#);
        let mask = constraint.compute_mask().unwrap();
        assert!(!mask.is_allowed(b',' as u32), "{strict:?}: no key after the listed ones");
        assert!(mask.is_allowed(b'}' as u32) && mask.is_allowed(b'0' as u32));
        consume_bytes(&mut constraint, "}");
        assert!(constraint.is_finished(), "{strict:?}: nothing can follow the closed object");
        assert_eq!(constraint.compute_mask().unwrap().allowed(), vec![eos]);

        let open = GrammarCompiler::new(&tok, &[], tok.vocab_size()).unwrap().with_open_objects(true);
        let mut constraint = open.compile_value(&format).unwrap().unwrap();
        consume_bytes(&mut constraint, r#"{"name": "Al", "age": 3"#);
        let more_keys = constraint.compute_mask().unwrap().is_allowed(b',' as u32);
        assert_eq!(more_keys, strict != Some(true), "{strict:?}: open objects admit more keys, strict never");
        if more_keys {
            consume_bytes(&mut constraint, r#", "extra": [1]}"#);
            assert!(constraint.is_finished());
        }
    }
}

#[test]
fn randomly_sampled_outputs_of_an_unlisted_schema_have_exactly_its_keys() {
    let (_dir, tok) = byte_level_tokenizer();
    let compiler = GrammarCompiler::new(&tok, &[], tok.vocab_size()).unwrap();
    let schema = json!({"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "tags": {"type": "array", "maxItems": 2,
        "items": {"type": "object", "properties": {"label": {"enum": ["alpha", "beta"]}}, "required": ["label"]}}}, "required": ["name", "tags"]});
    let format = json!({"type": "json_schema", "json_schema": {"name": "t", "schema": schema}});
    for seed in 0..30 {
        let (text, finished) = sample_constrained(&compiler, &tok, &format, seed, 0.5, 2000);
        assert!(finished, "seed {seed}: {text:?}");
        let value: Json = serde_json::from_str(&text).unwrap_or_else(|e| panic!("seed {seed}: {e}: {text:?}"));
        let keys: Vec<&String> = value.as_object().unwrap().keys().collect();
        assert_eq!(keys, ["name", "tags"], "seed {seed}: {text:?}");
        for tag in value["tags"].as_array().unwrap() {
            assert_eq!(tag.as_object().unwrap().keys().collect::<Vec<_>>(), ["label"], "seed {seed}: {text:?}");
        }
    }
}

#[test]
fn json_output_is_spaced_like_json_dumps_with_no_free_whitespace() {
    let (_dir, tok) = byte_level_tokenizer();
    let compiler = GrammarCompiler::new(&tok, &[], tok.vocab_size()).unwrap();
    let one_space = |mask: &TokenMask, at: &str| {
        assert!(mask.is_allowed(b' ' as u32), "a space {at}");
        for t in mask.allowed() {
            let text = tok.decode(&[t], false).unwrap();
            assert!(text.starts_with(' ') && !text[1..].starts_with(char::is_whitespace), "{text:?} admitted {at}");
        }
    };
    let no_whitespace = |mask: &TokenMask, at: &str| {
        for ws in [b' ', b'\n', b'\t', b'\r'] {
            assert!(!mask.is_allowed(ws as u32), "{:?} admitted {at}", ws as char);
        }
    };
    for format in [json!({"type": "json_object"}), two_field_format(None)] {
        let mut constraint = compiler.compile_value(&format).unwrap().unwrap();
        no_whitespace(&constraint.compute_mask().unwrap(), "before the object");
        consume_bytes(&mut constraint, "{");
        no_whitespace(&constraint.compute_mask().unwrap(), "after {");
        consume_bytes(&mut constraint, r#""name""#);
        no_whitespace(&constraint.compute_mask().unwrap(), "before the colon");
        consume_bytes(&mut constraint, ":");
        one_space(&constraint.compute_mask().unwrap(), "after the colon");
        consume_bytes(&mut constraint, r#" "Al""#);
        no_whitespace(&constraint.compute_mask().unwrap(), "after a value");
        consume_bytes(&mut constraint, ",");
        one_space(&constraint.compute_mask().unwrap(), "after the comma");
        consume_bytes(&mut constraint, r#" "age": 7"#);
        no_whitespace(&constraint.compute_mask().unwrap(), "after the last value");
        consume_bytes(&mut constraint, "}");
        assert!(constraint.is_accepting());
    }
    let (text, finished) = sample_constrained(&compiler, &tok, &json!({"type": "json_object"}), 3, 0.2, 4000);
    assert!(finished && !text.contains('\n') && !text.starts_with(' ') && !text.ends_with(' '), "{text:?}");
}

#[test]
fn a_schema_may_bring_its_own_layout() {
    let (_dir, tok) = byte_level_tokenizer();
    let compiler = GrammarCompiler::new(&tok, &[], tok.vocab_size()).unwrap();
    let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}, "x-guidance": {"item_separator": ",", "key_separator": ":", "whitespace_flexible": false}});
    let mut constraint = compiler.compile_value(&json!({"type": "json_schema", "json_schema": {"schema": schema}})).unwrap().unwrap();
    consume_bytes(&mut constraint, r#"{"a":"#);
    assert!(!constraint.compute_mask().unwrap().is_allowed(b' ' as u32));
    consume_bytes(&mut constraint, "1}");
    assert!(constraint.is_finished());
}

#[test]
fn strict_schemas_that_admit_more_keys_and_non_boolean_strict_are_refused() {
    let (_dir, tok) = byte_level_tokenizer();
    let compiler = GrammarCompiler::new(&tok, &[], tok.vocab_size()).unwrap().with_open_objects(true);
    let open_meta = json!({"type": "object", "properties": {"meta": {"type": "object", "additionalProperties": true}}});
    let cases = [
        (json!({"type": "json_schema", "json_schema": {"schema": open_meta.clone(), "strict": true}}), "#/properties/meta/additionalProperties"),
        (json!({"type": "json_schema", "json_schema": {"schema": open_meta.clone(), "strict": "yes"}}), "`json_schema.strict` must be a boolean"),
    ];
    for (format, expected) in cases {
        match compiler.compile_value(&format).unwrap_err() {
            NinferError::InvalidRequest { field, reason } => {
                assert_eq!(field, "response_format");
                assert!(reason.contains(expected), "{reason:?} should mention {expected:?}");
            }
            other => panic!("{other}"),
        }
    }
    for strict in [json!(false), json!(null)] {
        let format = json!({"type": "json_schema", "json_schema": {"schema": open_meta.clone(), "strict": strict}});
        assert!(compiler.compile_value(&format).unwrap().is_some(), "an explicit true is honoured without strict");
    }
    assert_eq!(ResponseFormat::parse(&two_field_format(Some(true))).unwrap(), ResponseFormat::JsonSchema { schema: two_field_format(None)["json_schema"]["schema"].clone(), strict: true });
}
