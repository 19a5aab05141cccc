//! Incremental detokenization: turn one new token at a time into new text, never emitting a
//! broken UTF-8 sequence, such that the deltas concatenate to the decode of all the tokens.
//!
//! Decoding a single token is wrong for byte-level BPE (a character split over tokens) and for
//! sentencepiece (a leading space that depends on the previous token), so each step decodes a
//! short window: `tokens[prefix_offset..read_offset]` is text already emitted and
//! `tokens[prefix_offset..]` the same window plus the new tokens; the delta is the difference.
//! While the window's text ends in U+FFFD the tail is an incomplete character and is held back.

use super::Tokenizer;
use crate::Result;

/// How many prompt tokens seed the window, so the first output token decodes in context.
const PROMPT_CONTEXT: usize = 5;

/// Detokenizer state of one sequence.
#[derive(Clone, Debug)]
pub struct IncrementalDetokenizer {
    tokens: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
    skip_special_tokens: bool,
}

impl IncrementalDetokenizer {
    /// Start after `prompt` (only its last few tokens are kept as context).
    pub fn new(prompt: &[u32], skip_special_tokens: bool) -> Self {
        let ctx = &prompt[prompt.len().saturating_sub(PROMPT_CONTEXT)..];
        IncrementalDetokenizer { tokens: ctx.to_vec(), prefix_offset: 0, read_offset: ctx.len(), skip_special_tokens }
    }

    /// Add one token; returns the newly completed text (possibly empty).
    pub fn push(&mut self, tok: &Tokenizer, token: u32) -> Result<String> {
        self.tokens.push(token);
        let prefix = tok.decode(&self.tokens[self.prefix_offset..self.read_offset], self.skip_special_tokens)?;
        let full = tok.decode(&self.tokens[self.prefix_offset..], self.skip_special_tokens)?;
        if full.len() <= prefix.len() || full.ends_with('\u{FFFD}') {
            return Ok(String::new());
        }
        let delta = text_after(&full, &prefix);
        self.prefix_offset = self.read_offset;
        self.read_offset = self.tokens.len();
        self.compact();
        Ok(delta)
    }

    /// Whatever text is still held back (an incomplete character at the end of generation).
    pub fn flush(&mut self, tok: &Tokenizer) -> Result<String> {
        if self.read_offset == self.tokens.len() {
            return Ok(String::new());
        }
        let prefix = tok.decode(&self.tokens[self.prefix_offset..self.read_offset], self.skip_special_tokens)?;
        let full = tok.decode(&self.tokens[self.prefix_offset..], self.skip_special_tokens)?;
        self.prefix_offset = self.read_offset;
        self.read_offset = self.tokens.len();
        Ok(text_after(&full, &prefix))
    }

    /// Drop tokens before the window so memory stays bounded on long generations.
    fn compact(&mut self) {
        if self.prefix_offset > 64 {
            self.tokens.drain(..self.prefix_offset);
            self.read_offset -= self.prefix_offset;
            self.prefix_offset = 0;
        }
    }
}

/// The part of `full` past `prefix`: a byte slice when `full` extends `prefix`, otherwise by
/// character count (decoders that rewrite the start of the window).
fn text_after(full: &str, prefix: &str) -> String {
    match full.strip_prefix(prefix) {
        Some(rest) => rest.to_string(),
        None => full.chars().skip(prefix.chars().count()).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sentencepiece-style word tokenizer (Metaspace decoder) saved into a fresh directory.
    fn metaspace_tokenizer() -> Tokenizer {
        let json = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [], "normalizer": null,
            "pre_tokenizer": {"type": "Metaspace", "replacement": "\u{2581}", "prepend_scheme": "always", "split": true},
            "post_processor": null,
            "decoder": {"type": "Metaspace", "replacement": "\u{2581}", "prepend_scheme": "always", "split": true},
            "model": {"type": "WordLevel", "unk_token": "<unk>",
                      "vocab": {"<unk>": 0, "\u{2581}a": 1, "\u{2581}Hello": 2, "\u{2581}world": 3, "!": 4, "\u{2581}x": 5}}
        });
        let dir = std::env::temp_dir().join(format!("ninfer-metaspace-tok-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("tokenizer.json"), json.to_string()).unwrap();
        Tokenizer::from_dir(&dir).unwrap()
    }

    #[test]
    fn sentencepiece_spaces_between_tokens_survive_incremental_decoding() {
        let tok = metaspace_tokenizer();
        let prompt = [1, 5];
        let out = [2, 3, 4, 1];
        let mut d = IncrementalDetokenizer::new(&prompt, true);
        let mut text = String::new();
        for &t in &out {
            text.push_str(&d.push(&tok, t).unwrap());
        }
        text.push_str(&d.flush(&tok).unwrap());
        let all: Vec<u32> = prompt.iter().chain(&out).copied().collect();
        let expected = tok.decode(&all, true).unwrap()[tok.decode(&prompt, true).unwrap().len()..].to_string();
        assert_eq!(text, expected);
        assert_eq!(text, " Hello world! a");
    }
}
