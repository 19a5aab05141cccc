//! A chat request's prompt: the conversation rendered with the chat template and tokenized in
//! one go, with what the server reads before it streams (whether the rendered prompt leaves a
//! `<think>` block open for the model to continue).

use serde_json::{Map, Value as Json};

use super::Tokenizer;
use crate::Result;

/// The tag that opens a thinking model's reasoning block.
pub const THINK_OPEN: &str = "<think>";
/// The tag that closes it.
pub const THINK_CLOSE: &str = "</think>";

/// A rendered and tokenized conversation.
#[derive(Clone, Debug, PartialEq)]
pub struct ChatPrompt {
    pub token_ids: Vec<u32>,
    /// The prompt opens `<think>` without closing it: the output starts inside reasoning.
    pub starts_in_reasoning: bool,
}

/// True when `text` leaves a `<think>` block open (Qwen3-style templates open it in the prompt
/// when thinking is on; otherwise the model opens it itself, or the template closes it empty).
pub fn starts_in_reasoning(text: &str) -> bool {
    // None (absent) orders before any position, as Python's rfind's -1 does.
    text.rfind(THINK_OPEN) > text.rfind(THINK_CLOSE)
}

impl Tokenizer {
    /// Render `messages` with the chat template and tokenize the text as transformers does
    /// (`apply_chat_template(..., tokenize=True)`: no special tokens added by the encoder).
    pub fn chat_prompt(&self, messages: &Json, tools: Option<&Json>, add_generation_prompt: bool, kwargs: &Map<String, Json>) -> Result<ChatPrompt> {
        let text = self.apply_chat_template(messages, tools, add_generation_prompt, kwargs)?;
        let token_ids = self.encode(&text, false)?;
        Ok(ChatPrompt { token_ids, starts_in_reasoning: starts_in_reasoning(&text) })
    }

    /// Whether the vocabulary holds both `<think>` and `</think>`: the output may carry a
    /// reasoning block to split off.
    pub fn has_thinking_tags(&self) -> bool {
        self.token_to_id(THINK_OPEN).is_some() && self.token_to_id(THINK_CLOSE).is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_open_think_block_at_the_end_starts_the_output_in_reasoning() {
        assert!(starts_in_reasoning("<|im_start|>assistant\n<think>\n"));
        assert!(!starts_in_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n"));
        assert!(!starts_in_reasoning("<|im_start|>assistant\n"));
        assert!(starts_in_reasoning("<think>a</think> then <think>"));
    }
}
