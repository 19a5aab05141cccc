//! The vocabulary as llguidance sees it: the exact bytes each token id stands for.
//!
//! Grammar masks are computed by walking a byte trie of the vocabulary, so every token id needs
//! the bytes it appends to the output. Those bytes are not the token strings of `tokenizer.json`:
//! byte-level BPE (GPT-2, Llama 3, Qwen) stores each byte as a printable stand-in character,
//! SentencePiece models store `<0xNN>` byte tokens and write spaces as `▁`. This module undoes
//! those encodings from the tokenizer's own decoder description, marks special tokens so that no
//! grammar ever produces them, and pads the table to the width of the model's logits rows.

use std::collections::HashMap;
use std::sync::Arc;

use serde_json::Value as Json;
use toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};

use crate::tokenizer::Tokenizer;
use crate::{NinferError, Result};

/// How the tokenizer's token strings encode bytes, read from its decoder.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum TokenSpelling {
    /// Byte-level BPE: every byte is written as one printable character.
    ByteLevel,
    /// SentencePiece style: plain UTF-8 text with `space` for ' ', plus `<0xNN>` byte tokens
    /// when the decoder has a byte fallback.
    Text { space: char, byte_fallback: bool },
}

/// The tokenizer's vocabulary as a token trie, what llguidance's parsers are built on.
pub struct GrammarVocab {
    trie: TokTrie,
}

impl GrammarVocab {
    /// Build the trie for `tokenizer`, with `eos_token_ids` as the tokens that end a generation
    /// (allowed by a mask once the grammar accepts) and `logits_width` the length of the model's
    /// logits rows (ids past the tokenizer's vocabulary are never allowed).
    pub fn new(tokenizer: &Tokenizer, eos_token_ids: &[u32], logits_width: usize) -> Result<Self> {
        let words = token_bytes(tokenizer, logits_width)?;
        let mut eos: Vec<u32> = eos_token_ids.iter().copied().filter(|&t| (t as usize) < words.len()).collect();
        if eos.is_empty() {
            eos.extend(tokenizer.eos_token_id());
        }
        let Some(&first_eos) = eos.first() else {
            return Err(NinferError::Unsupported(
                "grammar-constrained decoding for a model without an EOS token (no eos_token_id in generation_config.json or eos_token in tokenizer_config.json)".into(),
            ));
        };
        let info = TokRxInfo::new(words.len() as u32, first_eos);
        let trie = TokTrie::from(&info, &words).with_eos_tokens(&eos);
        Ok(GrammarVocab { trie })
    }

    /// The shared handle llguidance's parser factory takes.
    pub fn into_env(self) -> TokEnv {
        Arc::new(self)
    }
}

impl TokenizerEnv for GrammarVocab {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    /// Greedy longest-match over the trie. llguidance only tokenizes here for forced-token
    /// fast-forwarding and prompt healing, neither of which the engine uses: masks are computed
    /// from the trie alone, so a canonical BPE encoding is not needed.
    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.greedy_tokenize(s)
    }
}

/// The bytes every token id in `0..max(vocab, logits_width)` stands for. Special tokens (and
/// padding ids past the vocabulary) get llguidance's special-token marker in front, which no
/// grammar matches.
fn token_bytes(tokenizer: &Tokenizer, logits_width: usize) -> Result<Vec<Vec<u8>>> {
    let inner = tokenizer.inner();
    let spelling = token_spelling(inner)?;
    let vocab_size = tokenizer.vocab_size();
    let added: HashMap<u32, tokenizers::AddedToken> = inner.get_added_tokens_decoder().into_iter().collect();
    let byte_chars = byte_level_chars();
    let width = vocab_size.max(logits_width);
    let mut words = Vec::with_capacity(width);
    for id in 0..width as u32 {
        let word = match (added.get(&id), inner.id_to_token(id)) {
            (Some(token), _) if token.special => special_word(&token.content),
            (Some(token), _) => token.content.as_bytes().to_vec(),
            (None, Some(piece)) => spell(&piece, spelling, &byte_chars).unwrap_or_else(|| special_word(&piece)),
            (None, None) => special_word(&format!("<[unused {id}]>")),
        };
        words.push(word);
    }
    Ok(words)
}

/// Bytes llguidance reads as "a special token named `name`", never produced by a grammar.
fn special_word(name: &str) -> Vec<u8> {
    let mut word = Vec::with_capacity(name.len() + 1);
    word.push(TokTrie::SPECIAL_TOKEN_MARKER);
    word.extend_from_slice(name.as_bytes());
    word
}

/// The bytes of one vocabulary piece, or None when the piece is not a valid spelling (a
/// byte-level piece with a character outside the byte alphabet).
fn spell(piece: &str, spelling: TokenSpelling, byte_chars: &HashMap<char, u8>) -> Option<Vec<u8>> {
    match spelling {
        TokenSpelling::ByteLevel => piece.chars().map(|c| byte_chars.get(&c).copied()).collect(),
        TokenSpelling::Text { space, byte_fallback } => {
            if byte_fallback {
                if let Some(byte) = byte_fallback_value(piece) {
                    return Some(vec![byte]);
                }
            }
            Some(piece.replace(space, " ").into_bytes())
        }
    }
}

/// The byte of a SentencePiece byte token `<0xNN>`.
fn byte_fallback_value(piece: &str) -> Option<u8> {
    let hex = piece.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

/// Read the spelling from the decoder's serialized form (its fields are private in the
/// `tokenizers` crate, its JSON is the stable description).
fn token_spelling(inner: &tokenizers::Tokenizer) -> Result<TokenSpelling> {
    let Some(decoder) = inner.get_decoder() else {
        return Ok(TokenSpelling::Text { space: ' ', byte_fallback: false });
    };
    let description = serde_json::to_value(decoder).map_err(|e| NinferError::Tokenizer(format!("cannot describe the decoder: {e}")))?;
    let mut found = DecoderFacts::default();
    found.visit(&description);
    if found.byte_level {
        return Ok(TokenSpelling::ByteLevel);
    }
    if found.unknown.is_empty() || found.byte_fallback || found.space.is_some() {
        return Ok(TokenSpelling::Text { space: found.space.unwrap_or(' '), byte_fallback: found.byte_fallback });
    }
    Err(NinferError::Unsupported(format!(
        "grammar-constrained decoding with a tokenizer whose decoder is {}",
        found.unknown.join(", ")
    )))
}

/// What the decoder steps say about token spelling.
#[derive(Default)]
struct DecoderFacts {
    byte_level: bool,
    byte_fallback: bool,
    space: Option<char>,
    unknown: Vec<String>,
}

impl DecoderFacts {
    fn visit(&mut self, step: &Json) {
        let kind = step.get("type").and_then(Json::as_str).unwrap_or_default();
        match kind {
            "ByteLevel" => self.byte_level = true,
            "ByteFallback" => self.byte_fallback = true,
            "Sequence" => {
                for inner in step.get("decoders").and_then(Json::as_array).into_iter().flatten() {
                    self.visit(inner);
                }
            }
            "Replace" if step.get("content").and_then(Json::as_str) == Some(" ") => {
                let pattern = step.get("pattern").and_then(|p| p.get("String")).and_then(Json::as_str);
                if let Some(c) = pattern.and_then(single_char) {
                    self.space = Some(c);
                }
            }
            "Metaspace" => {
                let replacement = step.get("replacement").and_then(Json::as_str).and_then(single_char);
                self.space = Some(replacement.unwrap_or('\u{2581}'));
            }
            "Fuse" | "Strip" | "Replace" => {}
            other => self.unknown.push(other.to_string()),
        }
    }
}

fn single_char(s: &str) -> Option<char> {
    let mut chars = s.chars();
    match (chars.next(), chars.next()) {
        (Some(c), None) => Some(c),
        _ => None,
    }
}

/// The byte-level BPE alphabet: printable Latin-1 bytes stand for themselves, every other byte
/// is written as the next unused code point from U+0100 on, in byte order.
pub(super) fn byte_level_chars() -> HashMap<char, u8> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut next = 0x100u32;
    let mut map = HashMap::with_capacity(256);
    for byte in 0..=255u8 {
        let c = if printable(byte) {
            char::from(byte)
        } else {
            let c = char::from_u32(next).expect("U+0100..U+0143 are chars");
            next += 1;
            c
        };
        map.insert(c, byte);
    }
    map
}

/// The bytes of every id, for tests of the spelling rules.
#[cfg(test)]
pub(super) fn token_bytes_for_test(tokenizer: &Tokenizer, logits_width: usize) -> Vec<Vec<u8>> {
    token_bytes(tokenizer, logits_width).unwrap()
}
