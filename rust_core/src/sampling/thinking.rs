//! Thinking budgets: a reasoning model's `<think>` block counted token by token and, when a
//! request's `thinking_budget` runs out, closed by forcing the end-of-thinking text.
//!
//! A [`ReasoningTracker`] follows one request's output: before the reasoning (it opens when the
//! model emits the think-open token, or in the prompt when the chat template opened it), inside
//! it (every token counts against the budget), while closing it (each row allows only the next
//! token of the closing sequence) and after it (the answer, free). The forced token reaches the
//! sampler as a one-token allow-mask, the same path a grammar's mask takes, so budgets work on
//! every sampler and under asynchronous scheduling exactly as grammar rows do.

use std::sync::Arc;

use crate::tokenizer::chat_prompt::{THINK_CLOSE, THINK_OPEN};
use crate::tokenizer::Tokenizer;
use crate::{NinferError, Result};

/// The text the engine forces when a budget runs out, after the optional
/// `thinking_budget_message`: the end-of-thinking tag framed as Qwen3-style templates frame it.
pub const THINK_END_TEXT: &str = "\n</think>\n\n";

/// A tokenizer's thinking tags: what a request's tracker is built from. None for a vocabulary
/// without both tags (no reasoning to count, a budget has nothing to close).
#[derive(Clone, Debug)]
pub struct ThinkingTags {
    pub open: u32,
    pub close: u32,
    /// `THINK_END_TEXT` tokenized.
    end: Vec<u32>,
    tokenizer: Arc<Tokenizer>,
}

impl ThinkingTags {
    /// The tags of `tokenizer`, when its vocabulary holds `<think>` and `</think>` and the end
    /// text tokenizes with the close tag as one token.
    pub fn of(tokenizer: &Arc<Tokenizer>) -> Option<Self> {
        let open = tokenizer.token_to_id(THINK_OPEN)?;
        let close = tokenizer.token_to_id(THINK_CLOSE)?;
        let end = tokenizer.encode(THINK_END_TEXT, false).ok()?;
        end.contains(&close).then(|| ThinkingTags { open, close, end, tokenizer: tokenizer.clone() })
    }

    /// The tokens forced when a budget runs out: `message` (a transition sentence) then the end
    /// text, tokenized together as the model would read them.
    pub fn closing(&self, message: Option<&str>) -> Result<Vec<u32>> {
        match message.filter(|m| !m.is_empty()) {
            None => Ok(self.end.clone()),
            Some(m) => {
                let ids = self.tokenizer.encode(&format!("{m}{THINK_END_TEXT}"), false)?;
                if ids.last() == Some(&self.close) || !ids.contains(&self.close) {
                    return Err(NinferError::invalid("thinking_budget_message", "must not end the text inside the end-of-thinking tag"));
                }
                Ok(ids)
            }
        }
    }

    /// Whether `prompt` leaves a think block open (its last open tag after its last close tag):
    /// the chat template opened the reasoning, the output starts inside it.
    pub fn starts_in_reasoning(&self, prompt: &[u32]) -> bool {
        let last = |t: u32| prompt.iter().rposition(|&p| p == t);
        last(self.open) > last(self.close)
    }

    /// A tracker for a request with this `prompt`, `budget` and transition `message`.
    pub fn tracker(&self, prompt: &[u32], budget: Option<u32>, message: Option<&str>) -> Result<ReasoningTracker> {
        let closing = if budget.is_some() { self.closing(message)? } else { Vec::new() };
        Ok(ReasoningTracker::new(self.open, self.close, self.starts_in_reasoning(prompt), budget, closing))
    }

    /// Whether `token` decodes to whitespace only (output before the open tag that still lets
    /// the reasoning open, as the server's reasoning parser skips it).
    pub fn is_blank(&self, token: u32) -> bool {
        self.tokenizer.decode(&[token], false).map(|s| s.trim().is_empty()).unwrap_or(false)
    }
}

/// Where a request's output stands with respect to its reasoning block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// No reasoning yet: the model may still open it.
    Before,
    /// Inside the reasoning: tokens count.
    Reasoning,
    /// The budget ran out: the next token is `closing[i]`.
    Closing(usize),
    /// The reasoning was closed (or never opened): the answer, unconstrained.
    After,
}

/// One request's reasoning: its phase, its count, its budget.
#[derive(Clone, Debug)]
pub struct ReasoningTracker {
    open: u32,
    close: u32,
    /// None: counted, never closed by force.
    budget: Option<u32>,
    closing: Vec<u32>,
    phase: Phase,
    reasoning_tokens: usize,
}

impl ReasoningTracker {
    /// A tracker starting inside the reasoning when `in_reasoning`; `closing` (forced when
    /// `budget` runs out) must end after the close tag `close`.
    pub fn new(open: u32, close: u32, in_reasoning: bool, budget: Option<u32>, closing: Vec<u32>) -> Self {
        debug_assert!(budget.is_none() || closing.contains(&close), "the closing sequence closes the reasoning");
        let mut t = ReasoningTracker { open, close, budget, closing, phase: Phase::Before, reasoning_tokens: 0 };
        if in_reasoning {
            t.enter_reasoning();
        }
        t
    }

    /// The phase the output is in.
    pub fn phase(&self) -> Phase {
        self.phase
    }

    /// The tokens generated inside the reasoning that count against the budget (not the tags,
    /// not the closing sequence the engine forced).
    pub fn reasoning_tokens(&self) -> usize {
        self.reasoning_tokens
    }

    /// The one token the next row must sample (the budget ran out), None when the row is free.
    pub fn forced(&self) -> Option<u32> {
        match self.phase {
            Phase::Closing(i) => self.closing.get(i).copied(),
            _ => None,
        }
    }

    /// Whether the row after the next token may be forced, which then depends on that token:
    /// such a row can only be built once the token is accepted (`samples_after_input`). False
    /// when the row after any next token is free.
    pub fn next_row_depends_on_token(&self) -> bool {
        match self.phase {
            Phase::Before => self.budget == Some(0),
            Phase::Reasoning => self.budget.is_some_and(|b| self.reasoning_tokens as u64 + 1 >= b as u64),
            Phase::Closing(_) => true,
            Phase::After => false,
        }
    }

    /// Advance past an output token. `is_blank` says whether it is whitespace only (asked only
    /// before the reasoning: blank output there still lets the model open it). A token other
    /// than the forced one (a grammar that refused it) gives up the budget: the reasoning is
    /// still counted and ends at the model's own close tag.
    pub fn accept(&mut self, token: u32, is_blank: impl Fn(u32) -> bool) {
        match self.phase {
            Phase::Before if token == self.open => self.enter_reasoning(),
            Phase::Before if is_blank(token) => {}
            Phase::Before => self.phase = Phase::After,
            Phase::Reasoning if token == self.close => self.phase = Phase::After,
            Phase::Reasoning => {
                self.reasoning_tokens += 1;
                self.check_budget();
            }
            Phase::Closing(i) if self.closing.get(i) == Some(&token) => {
                self.phase = if i + 1 == self.closing.len() { Phase::After } else { Phase::Closing(i + 1) };
            }
            Phase::Closing(i) if self.closing[..i].contains(&self.close) => self.phase = Phase::After,
            Phase::Closing(_) => {
                self.budget = None;
                self.phase = Phase::Reasoning;
                self.accept(token, is_blank);
            }
            Phase::After => {}
        }
    }

    fn enter_reasoning(&mut self) {
        self.phase = Phase::Reasoning;
        self.check_budget();
    }

    fn check_budget(&mut self) {
        if self.budget.is_some_and(|b| self.reasoning_tokens as u64 >= b as u64) {
            self.phase = Phase::Closing(0);
        }
    }
}

#[cfg(test)]
mod tests;
